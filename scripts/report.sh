#!/usr/bin/env bash
# The performance report, on a GPU machine: runs the benchmarks against MODEL (appending JSON
# lines and plots under benchmarks/results/), then renders benchmarks/results/REPORT.md.
#
# Usage: bash scripts/report.sh [PART ...]   (default: all)
#   drafts  train every draft the report needs, one at a time (each <= 5 min, alone on the
#           GPU), cached in $SPECPCG_DRAFT_CACHE (default .cache/drafts); later parts reuse
#           them. Side by side, four trainers got a third of the steps each (EAGLE3: 624
#           against 1,601 alone; held-out top-1 .70/.64/.60 against .79/.76/.73).
#   engine  bench_engine, bench_graphs (default model and the 8B shape)
#   spec    bench_spec (NGRAM, STANDALONE, EAGLE, HF transformers baselines)
#   heads   bench_heads (EAGLE, EAGLE3, NEXTN: three chains and a tree, PCG on and off)
#   step    bench_step (where a batch-1 step's time goes: host phases, each graph's GPU time)
#   accept  bench_accept (accept-length grids, synthetic acceptance, the 8B shape)
#   matrix  the GPU GSM8K matrix (tests/test_gsm8k_matrix.py -m cuda)
#   render  benchmarks/report.py -> benchmarks/results/REPORT.md and README.md's headline table
# Parts are separate so each fits a bounded job; MODEL defaults to the bundled GGUF
# ($SPECPCG_DEFAULT_MODEL overrides it).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
CACHE=${SPECPCG_DRAFT_CACHE:-.cache/drafts}
export SPECPCG_DRAFT_CACHE=$CACHE
MODEL=$(python3 -c "from specpcg.models.loader import default_model_path as p; print(p())")

drafts() {
  for algo in EAGLE EAGLE3 NEXTN STANDALONE; do
    python3 -c "from drafts.train import ensure_draft; print(ensure_draft('$algo', \
cache_dir='$CACHE', show_progress=False))"
  done
}
engine() {
  python3 benchmarks/bench_engine.py --model-path "$MODEL"
  python3 benchmarks/bench_graphs.py --model-path "$MODEL"
  python3 benchmarks/bench_graphs.py --model-path shape:llama-3-8b
  python3 benchmarks/bench_reference.py --model-path "$MODEL"
  python3 benchmarks/bench_ngram.py
}
spec() {
  local draft head
  draft=$(python3 -c "from drafts.train import ensure_draft; print(ensure_draft('STANDALONE', cache_dir='$CACHE', show_progress=False))")
  head=$(python3 -c "from drafts.train import ensure_draft; print(ensure_draft('EAGLE', cache_dir='$CACHE', show_progress=False))")
  python3 benchmarks/bench_spec.py --model-path "$MODEL" --draft-path "$draft" --head-path "$head"
}
heads() { python3 benchmarks/bench_heads.py --model-path "$MODEL" --cache-dir "$CACHE"; }
step() {
  python3 benchmarks/bench_step.py --model-path "$MODEL" --cache-dir "$CACHE" \
    --algorithms none,EAGLE,EAGLE3,NEXTN
}
accept() { python3 benchmarks/bench_accept.py --model-path "$MODEL" --cache-dir "$CACHE"; }
matrix() { python3 -m pytest -q -m cuda tests/test_gsm8k_matrix.py; }
render() { python3 benchmarks/report.py --readme README.md; }

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(drafts engine spec heads step accept matrix render)
for part in "${parts[@]}"; do
  case "$part" in
    drafts|engine|spec|heads|step|accept|matrix|render) echo "== $part"; "$part" ;;
    *) echo "unknown part '$part' (drafts engine spec heads step accept matrix render)" >&2
       exit 2 ;;
  esac
done
