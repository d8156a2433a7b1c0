#!/usr/bin/env bash
# The performance report, on a GPU machine: runs every benchmark against MODEL (appending JSON
# lines and plots under benchmarks/results/), then renders benchmarks/results/REPORT.md.
# Trained drafts are made once by drafts.train.ensure_draft and cached in .cache/drafts.
# Usage: bash scripts/report.sh [MODEL]   (default: the bundled SmolLM2-135M-Instruct GGUF)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-$(python3 -c "from specpcg.models.loader import default_model_path as p; print(p())")}
export PYTHONUNBUFFERED=1
python3 benchmarks/bench_engine.py --model-path "$MODEL"
python3 benchmarks/bench_graphs.py --model-path "$MODEL"
python3 benchmarks/bench_graphs.py --model-path shape:llama-3-8b
python3 benchmarks/bench_ngram.py
python3 benchmarks/bench_spec.py --model-path "$MODEL"
python3 benchmarks/bench_heads.py --model-path "$MODEL"
python3 benchmarks/bench_accept.py --model-path "$MODEL"
python3 -m pytest -q -m cuda tests/test_gsm8k_matrix.py
python3 benchmarks/report.py
