#!/usr/bin/env bash
# Sets up and runs the test suite (the README's test command). CUDA tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
export TRITON_INTERPRET=1  # Triton kernels run on the CPU through the interpreter
# The interpreter's tl.dot sums each element in one order whatever numpy's BLAS kernel
# (tests/conftest.py, `_dot_in_one_order`): the kernels' tests of bit invariance need it.
# One worker per core (SPECPCG_TEST_WORKERS overrides; 1 runs in this process), each test file
# on one worker (module fixtures built once), one intra-op thread each: most of the suite's
# time is the single-threaded Triton interpreter.
workers=${SPECPCG_TEST_WORKERS:-$(nproc)}
if [ "$workers" -gt 1 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  set -- -n "$workers" --dist loadfile "$@"
fi
exec python3 -m pytest -q -rs --durations=30 "$@"
