"""benchmarks/probe_shadow_cost.py: one NGRAM engine's arms take turns, and each runs what it
names: held to plain steps without shadow verifies, with them, and its own controller."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_shadow_cost  # noqa: E402

from tests.tiny_models import save_tiny_checkpoint  # noqa: E402

CPU = dict(device="cpu", dtype="float32", attention_backend="torch", skip_tokenizer_init=True,
           max_total_tokens=2048, disable_cuda_graph=True)


def test_each_arm_runs_its_own_steps(tmp_path):
    save_tiny_checkpoint("llama", tmp_path)
    args = probe_shadow_cost.parse(["--model-path", str(tmp_path), "--batch", "2", "--rounds",
                                    "2", "--max-new-tokens", "12", "--prompt-len", "32"])
    records = probe_shadow_cost.run(args, CPU)
    arms = probe_shadow_cost.ARMS
    assert [r["arm"] for r in records] == list(arms) + list(arms[1:] + arms[:1])
    by_arm = {arm: [r for r in records if r["arm"] == arm] for arm in arms}
    for r in by_arm["plain"]:
        assert r["shadow_rounds"] == 0 and r["overlapped_steps"] >= 10, r
    for r in by_arm["plain+shadow"]:  # after each plain step but the one the batch ends in
        assert r["shadow_rounds"] >= r["overlapped_steps"] - 1 >= 10, r
    assert all(r["shadow_rounds"] > 0 for r in by_arm["adaptive"])
    assert all(r["tok_per_s"] > 0 and r["bench"] == "shadow_cost" for r in records)


def test_a_no_spec_engine_runs_one_arm(tmp_path):
    save_tiny_checkpoint("llama", tmp_path)
    args = probe_shadow_cost.parse(["--model-path", str(tmp_path), "--batch", "2", "--rounds",
                                    "2", "--max-new-tokens", "8", "--no-spec"])
    records = probe_shadow_cost.run(args, CPU)
    assert [r["arm"] for r in records] == ["no-spec", "no-spec"]
    assert all(r["shadow_rounds"] == 0 for r in records)
