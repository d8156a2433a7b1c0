cd "$1"; source .gpu/env.sh > /dev/null 2>&1
export SPECPCG_GIT_COMMIT=$(cat .gpu/commit)
B=/root/bg; mkdir -p $B /root/d; date
cat .dr/drafts.tar.* > /root/d/drafts.tar && tar xf /root/d/drafts.tar -C /root/d && ls /root/d/drafts
D=/root/d/drafts; export SPECPCG_GPU_DRAFTS=EAGLE3=$D/eagle3,EAGLE=$D/eagle,NEXTN=$D/nextn
export SPECPCG_DETERMINISTIC_OUT=$B/deterministic.jsonl
timeout 560 python3 -m pytest -q -m cuda tests/test_cuda_deterministic.py -k EAGLE3 2>&1 | tail -n 15 > $B/pytest_det.txt
tail -n 3 $B/pytest_det.txt; echo DET_DONE; date
timeout 420 python3 benchmarks/bench_adaptive.py --drafts EAGLE3=$D/eagle3 --out $B/adaptive.jsonl 2>&1 | grep -v "%|" | tail -n 30 > $B/adaptive.txt
tail -n 12 $B/adaptive.txt; echo ADAPTIVE_DONE; date
timeout 500 python3 -m pytest -q -m cuda tests/test_cuda_eagle.py tests/test_tree_graphs.py 2>&1 | tail -n 15 > $B/pytest_eagle.txt
tail -n 3 $B/pytest_eagle.txt; echo EAGLE_DONE; date
