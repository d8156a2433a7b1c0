"""Compiles Triton kernels for a Hopper GPU (sm_90) on a machine without one.

The interpreter (TRITON_INTERPRET=1) checks what a kernel computes, not whether Triton's compiler
takes it: a constexpr used where a tensor must be, or a loop the compiler cannot lower, passes
on the CPU and fails on the first GPU launch. Run as a program (tests/test_hopper_compile.py
runs it in a process of its own, the interpreter off), it calls kernel launchers on CPU tensors
with each launch replaced by a compile for sm_90 (PTX and cubin, by Triton's own ptxas), and
prints one JSON line per distinct kernel variant compiled.

    python -m tests.hopper_compile [--case topk-and-ring ...]
"""

from __future__ import annotations

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") != "1", "the interpreter must be off: nothing compiles"

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile as triton_compile  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
         torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
         torch.uint8: "u8", torch.bool: "i1"}
OPTIONS = ("num_warps", "num_stages", "num_ctas")  # compile options among a launch's kwargs
compiled: dict = {}


def _type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__} {value!r}")


def _compile_instead(self, *args, grid, warmup, **kwargs):
    """JITFunction.run's stand-in: the launch's kernel compiled for TARGET, nothing run."""
    options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
    kwargs.pop("launch_pdl", None)
    values = dict(zip([p.name for p in self.params], args)) | kwargs
    signature, constexprs = {}, {}
    for p in self.params:
        value = values[p.name]
        if p.is_constexpr or value is None:
            signature[p.name], constexprs[p.name] = "constexpr", value
        else:
            signature[p.name] = _type(value)
    key = (self.fn.__qualname__, tuple(signature.items()), tuple(constexprs.items()))
    if key not in compiled:
        kernel = triton_compile(ASTSource(self, signature, constexprs), target=TARGET,
                                options=options)
        compiled[key] = {"kernel": f"{self.fn.__module__}.{self.fn.__qualname__}",
                         "constexprs": {k: v for k, v in constexprs.items()
                                        if isinstance(v, (bool, int, float, str))},
                         "ptx_bytes": len(kernel.asm["ptx"]), "cubin": "cubin" in kernel.asm}


def _topk_and_ring() -> None:
    """The greedy pick with and without a head's ring write, a tree's top-k, and the ring's
    own write, at the default model's sizes."""
    from kernels.hidden_ring_triton import write_ring_triton
    from kernels.topk_triton import topk_rows_triton

    logits = torch.zeros(4, 49152, dtype=torch.bfloat16)
    ring = torch.zeros(5, 64, 3 * 576, dtype=torch.bfloat16)
    sources = [torch.zeros(4, 576, dtype=torch.bfloat16) for _ in range(3)]
    where = (torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long))
    topk_rows_triton(logits, 1, False)
    topk_rows_triton(logits, 1, False, ring=(ring, sources, *where))
    one = torch.zeros(5, 64, 576, dtype=torch.bfloat16)  # a head of the last layer's rows
    topk_rows_triton(logits[:, :1000], 1, False, ring=(one, sources[:1], *where))
    topk_rows_triton(logits.float(), 4, True)
    write_ring_triton(ring, sources, *where)


def _refused() -> None:
    """A kernel the compiler refuses (a range of 3: Triton's ranges are powers of two)."""
    import triton
    import triton.language as tl

    @triton.jit
    def bad(out_ptr):
        tl.store(out_ptr + tl.arange(0, 3), 1.0)

    bad[(1,)](torch.zeros(3))


CASES = {"topk-and-ring": _topk_and_ring, "refused": _refused}


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=tuple(CASES), nargs="+",
                   default=[c for c in CASES if c != "refused"])
    args = p.parse_args(argv)
    JITFunction.run = _compile_instead
    for case in args.case:
        CASES[case]()
    for line in compiled.values():
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
