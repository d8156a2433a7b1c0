#!/usr/bin/env bash
# Sets up and runs the test suite (the README's test command). CUDA tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
export TRITON_INTERPRET=1  # Triton kernels run on the CPU through the interpreter
exec python3 -m pytest -q -rs --durations=30 "$@"
