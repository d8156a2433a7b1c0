"""Shared pytest setup: tests marked `cuda` need a GPU and skip without one; the Triton
interpreter's nested calls are made cheaper (see `_patch_language_once_per_helper`), and its
tl.dot sums each element in one order whatever numpy's BLAS (`_dot_in_one_order`)."""

import gc
import os
import traceback

import pytest
import torch


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


def _dot_in_one_order() -> None:
    """The interpreter's tl.dot is numpy's matmul, whose BLAS kernels may sum an output element
    in an order that follows the matrices' shapes (OpenBLAS's Haswell and Zen kernels do; its
    Nehalem kernel does not, and OPENBLAS_CORETYPE, which picks one, is the machine's to set).
    The kernels' tests of bit invariance (a row among others, a tile's width, a program's rows)
    would then blame the kernels for the BLAS: on the GPU one tile's dot is one order. Here a
    float32 dot is summed in float64 and rounded once: the products are exact, and the rounding
    gives each element the same bits whatever the tile's other rows or columns (unless an order's
    float64 error crosses a float32 rounding boundary, about 2^-29 of elements). The kernels'
    own sums across tiles stay float32, as on the GPU."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    cls, handle = getattr(interpreter, "InterpreterBuilder", None), getattr(
        interpreter, "TensorHandle", None)
    if cls is None or handle is None or not hasattr(cls, "create_dot"):
        return
    real = cls.create_dot
    if getattr(real, "in_one_order", False):
        return

    def create_dot(self, a, b, d, *rest):
        if not all(t.data.dtype == np.float32 for t in (a, b, d)):
            return real(self, a, b, d, *rest)
        out = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64))
        return handle(out.astype(np.float32) + d.data, d.dtype.scalar)

    create_dot.in_one_order = True
    cls.create_dot = create_dot


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped when torch.cuda is unavailable")
    if os.environ.get("TRITON_INTERPRET") == "1":
        _patch_language_once_per_helper()
        _dot_in_one_order()


def pytest_collection_finish(session):
    """Test files that set TRITON_INTERPRET themselves (a plain `pytest`) have set it now; an
    import of the interpreter before they did would have left Triton compiling."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        _dot_in_one_order()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def release_frames(tb) -> None:
    """Lets go of every local of a failed test's frames (its engines among them): pytest keeps
    the exception, and with it the frames. On one H100 the engines of one failed draft training
    left every later test of that process "no memory left for the KV cache" (25e331a)."""
    traceback.clear_frames(tb)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The report of a failure is written first (its text holds what the frames showed)."""
    outcome = yield
    if outcome.get_result().failed and call.excinfo is not None:
        release_frames(call.excinfo.tb)
