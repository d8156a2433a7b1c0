"""Shared pytest setup: tests marked `cuda` need a GPU and skip without one; the Triton
interpreter's nested calls are made cheaper (see `_patch_language_once_per_helper`)."""

import os
import platform
import sys

# pytest run without scripts/test.sh: numpy's OpenBLAS reads its kernel choice when it loads
# (scripts/test.sh says why the tests need this one).
if "numpy" not in sys.modules and platform.machine() == "x86_64":
    os.environ.setdefault("OPENBLAS_CORETYPE", "Nehalem")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """A tiny random-weight Llama checkpoint directory (HF layout), shared by the tests."""
    from tests.tiny_models import save_tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_checkpoint("llama", path)
    return str(path)


def _patch_language_once_per_helper() -> None:
    """The interpreter (triton 3.x) re-patches triton.language on every call of a @triton.jit
    helper (tl.sum, tl.max, tl.cdiv, our own helpers): an inspect.getmembers walk over the
    language modules, about 3 ms a call, 40% of a decode kernel's time on CPU. A launch has
    already patched the language of the kernel's module, and a helper's patches are never
    undone, so the first call of each helper does what every later one would. Only the
    interpreter's speed changes; where its internals differ, nothing is touched."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    cls, patch = getattr(interpreter, "InterpretedFunction", None), getattr(
        interpreter, "_patch_lang", None)
    if cls is None or patch is None or not hasattr(cls, "rewrite"):
        return
    patched = set()

    def call(self, *args, **kwargs):
        if self.fn not in patched:
            patch(self.fn)
            patched.add(self.fn)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    cls.__call__ = call


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped when torch.cuda is unavailable")
    if os.environ.get("TRITON_INTERPRET") == "1":
        _patch_language_once_per_helper()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
