"""The GPU suite's heads trained in one call: `python -m tests.gpu_drafts` trains each head in
turn with the budget asked for and prints a SPECPCG_GPU_DRAFTS value that gpu_draft then reads,
training nothing more."""

from unittest import mock

import pytest

from tests import gpu_drafts


def _fake_ensure(calls, root):
    def ensure(algo, cache_dir, **opts):
        calls.append((algo, cache_dir, opts))
        path = root / f"{algo.lower()}-head"
        path.mkdir(exist_ok=True)
        return str(path)
    return ensure


def test_the_printed_value_names_each_head_and_gpu_draft_trains_nothing(tmp_path, capsys,
                                                                        monkeypatch):
    calls = []
    with mock.patch("drafts.train.ensure_draft", _fake_ensure(calls, tmp_path)):
        gpu_drafts.main(["--algorithms", "NEXTN", "EAGLE3", "--minutes", "1.5",
                         "--num-prompts", "300", "--cache-dir", str(tmp_path / "cache")])
    assert calls == [(a, str(tmp_path / "cache"), {"num_prompts": 300, "minutes": 1.5})
                     for a in ("NEXTN", "EAGLE3")]  # in the order asked, one at a time
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("SPECPCG_GPU_")][-1]
    monkeypatch.setenv("SPECPCG_GPU_DRAFTS", line.split("=", 1)[1])
    with mock.patch("drafts.train.ensure_draft", side_effect=AssertionError("trained again")):
        assert gpu_drafts.gpu_draft("EAGLE3") == str(tmp_path / "eagle3-head")
        assert gpu_drafts.gpu_draft("NEXTN") == str(tmp_path / "nextn-head")


def test_the_cli_defaults_to_the_short_budget_for_every_head(tmp_path, capsys):
    calls = []
    with mock.patch("drafts.train.ensure_draft", _fake_ensure(calls, tmp_path)):
        gpu_drafts.main([])
    assert [c[0] for c in calls] == list(gpu_drafts.SUITE)
    assert all(c[2] == gpu_drafts.SHORT for c in calls)


def test_a_head_named_twice_is_refused_before_training(capsys):
    with mock.patch("drafts.train.ensure_draft", side_effect=AssertionError("trained")):
        with pytest.raises(SystemExit):
            gpu_drafts.main(["--algorithms", "EAGLE", "EAGLE"])
    assert "EAGLE" in capsys.readouterr().err


def test_a_named_directory_that_is_missing_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECPCG_GPU_DRAFTS", f"EAGLE={tmp_path / 'gone'}")
    with pytest.raises(FileNotFoundError, match="EAGLE="):
        gpu_drafts.gpu_draft("EAGLE")
