"""`python -m drafts.evaluate` end to end on the default model (CPU, fp32): a random EAGLE3
head's offline and online accept lengths on two held-out zero-shot GSM8K prompts."""

import json

import torch

from drafts.evaluate import main
from drafts.head_checkpoint import random_head, save_head
from specpcg.models.loader import default_model_path, load_checkpoint


def test_evaluate_prints_offline_beside_online_and_they_agree(tmp_path, capsys):
    target = default_model_path()
    cfg, _ = load_checkpoint(target)
    head, spec = random_head("EAGLE3", cfg, "cpu", torch.float32, draft_vocab_size=8192)
    draft = save_head(head, spec, cfg, str(tmp_path / "head"))
    out = tmp_path / "evaluate.jsonl"
    main(["--draft", draft, "--data", "gsm8k", "--num-prompts", "2", "--max-new-tokens", "6",
          "--settings", "3,1,4", "--algorithm", "EAGLE3", "--target", target, "--device", "cpu",
          "--out", str(out)])
    assert "offline AL" in capsys.readouterr().out
    record = json.loads(out.read_text().splitlines()[-1])
    row = record["settings"]["3,1,4"]
    assert record["num_prompts"] == 2 and row["online"]["identical_to_no_spec"] == 2
    assert row["online"]["tokens"] == 12  # every answer ran its 6 tokens
    # The engine drafts exactly what the offline walk simulates: the same accept length.
    assert abs(row["offline_over_online"] - 1.0) < 0.05, row
    # NGRAM ran the same prompts at the same setting, for the draft's margin over it.
    assert row["ngram"]["identical_to_no_spec"] == 2 and row["ngram"]["tokens"] == 12
    assert row["ngram"]["accept_length"] >= 1.0
