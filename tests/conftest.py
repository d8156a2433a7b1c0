"""Shared pytest setup: tests marked `cuda` need a GPU and skip without one."""

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """A tiny random-weight Llama checkpoint directory (HF layout), shared by the tests."""
    from tests.tiny_models import save_tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_checkpoint("llama", path)
    return str(path)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped when torch.cuda is unavailable")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
