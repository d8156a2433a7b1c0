"""Shared pytest setup: the `cuda` marker for tests that need a GPU (they skip without one)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped when torch.cuda is unavailable")
