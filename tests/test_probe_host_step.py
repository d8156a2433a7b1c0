"""benchmarks/probe_host_step.py: the engine with a draft held to plain steps runs the same
no-op decode graphs, its turns taken beside the engine without one."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_host_step  # noqa: E402


def test_the_held_draft_engine_times_plain_graph_steps_beside_no_spec():
    records = probe_host_step.main(["--batches", "1", "2", "--steps", "6", "--repeats", "2",
                                    "--draft", "held"])
    held = probe_host_step.DRAFTED["held"]
    assert [(r["engine"], r["batch_size"]) for r in records] == [
        ("no-spec", 1), (held, 1), ("no-spec", 2), (held, 2)]
    assert all(r["host_us_per_step"] > 0 for r in records)


def test_the_held_ngram_engine_runs_shadow_verifies_on_its_plain_graph_steps(monkeypatch):
    from specpcg.speculative.shadow import ShadowVerify

    seen = []
    observe = ShadowVerify.observe
    monkeypatch.setattr(ShadowVerify, "observe",
                        lambda self, reqs, depth=None: seen.append(len(reqs)) or
                        observe(self, reqs, depth))
    records = probe_host_step.main(["--batches", "2", "--steps", "24", "--repeats", "1",
                                    "--draft", "ngram-held"])
    held = probe_host_step.DRAFTED["ngram-held"]
    assert [(r["engine"], r["batch_size"]) for r in records] == [("no-spec", 2), (held, 2)]
    assert seen.count(2) >= 2 * 20, seen  # the warm-up's and the timed run's plain steps


def test_the_held_eagle3_engines_keep_their_plain_graph_steps_hidden_rows(monkeypatch):
    """Their decode graphs capture the three layers the head reads, and every plain step hands
    their rows to the head, as in the engine: written to its ring by the graph (a no-op replay
    here, so what the capture-time forward left), or copied out after the step (ring off)."""
    from drafts.eagle import HeadDraft

    rows, ringed = [], []
    absorb, absorb_ring = HeadDraft.absorb_rows, HeadDraft.absorb_ring
    monkeypatch.setattr(HeadDraft, "absorb_rows",
                        lambda self, reqs, hidden: rows.append(tuple(hidden.shape)) or
                        absorb(self, reqs, hidden))
    monkeypatch.setattr(HeadDraft, "absorb_ring",
                        lambda self, reqs: ringed.append(self.hidden_ring.width) or
                        absorb_ring(self, reqs))
    records = probe_host_step.main(["--batches", "2", "--steps", "12", "--repeats", "1",
                                    "--draft", "eagle3-held", "eagle3-copied"])
    held, copied = (probe_host_step.DRAFTED[d] for d in ("eagle3-held", "eagle3-copied"))
    assert [(r["engine"], r["batch_size"]) for r in records] == [
        ("no-spec", 2), (held, 2), (copied, 2)]
    assert rows.count((2, 3 * 64)) >= 2 * 10, rows  # 3 layers of the 64-wide tiny model
    assert ringed.count(3 * 64) >= 2 * 10, ringed
