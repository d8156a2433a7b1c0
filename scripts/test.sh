#!/usr/bin/env bash
# Sets up and runs the test suite (the README's test command). CUDA tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
export TRITON_INTERPRET=1  # Triton kernels run on the CPU through the interpreter
# The interpreter's tl.dot is numpy's matmul: OpenBLAS's Haswell and Zen kernels give an
# output element other bits as the matrix around it changes shape, which the kernels' tests
# of bit invariance (a row among others, a tile's width) would blame on the kernels. Its
# plain SSE kernels sum each element in one order. x86 only: elsewhere the name is unknown.
if [ "$(uname -m)" = "x86_64" ]; then
  export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-Nehalem}
fi
# One worker per core (SPECPCG_TEST_WORKERS overrides; 1 runs in this process), each test file
# on one worker (module fixtures built once), one intra-op thread each: most of the suite's
# time is the single-threaded Triton interpreter.
workers=${SPECPCG_TEST_WORKERS:-$(nproc)}
if [ "$workers" -gt 1 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  set -- -n "$workers" --dist loadfile "$@"
fi
exec python3 -m pytest -q -rs --durations=30 "$@"
