"""Measured step rates sim_adaptive.py's simulated steps take (its --rates): per batch-size
bucket, tokens per second per request of speculative steps and of plain ones, and the accept
length the speculative rates were measured at."""

MEAN_ACCEPT = 2.6  # tokens a verify at the rates below (NEXTN's chat accept length)
# Per-request tok/s by bucket: speculative steps and plain ones (H100, dae63fc).
SPEC_RATE = {1: 1460, 2: 1280, 4: 1353, 8: 1441, 16: 1213, 32: 1000, 64: 779}
PLAIN_RATE = {1: 932, 2: 868, 4: 876, 8: 855, 16: 836, 32: 700, 64: 626}
# --rates NAME: (MEAN_ACCEPT, SPEC_RATE, PLAIN_RATE) measured elsewhere. "h200-weak-eagle3":
# the adaptive engine's buckets with an EAGLE3 head trained 2.8 minutes (offline accept length
# 1.71 at (3, 1, 4); H200, 800b3e5, adaptive_weak_eagle3_314_800b3e5_h200.jsonl; buckets 2, 8
# and 32, barely measured there, read between their neighbours), a draft that ties plain steps.
RATES = {
    "h100-nextn": (MEAN_ACCEPT, SPEC_RATE, PLAIN_RATE),
    "h200-weak-eagle3": (1.75, {1: 1834, 2: 1500, 4: 1300, 8: 1300, 16: 1288, 32: 1000, 64: 896},
                         {1: 1771, 2: 1450, 4: 1359, 8: 1100, 16: 969, 32: 800, 64: 677}),
    # The default model as its own STANDALONE draft at (7, 1, 8), whose steps tie plain ones:
    # the adaptive engine's buckets 1, 4, 16 and 64 (H200, 3e9f562,
    # adaptive_alone_prefill_3e9f562_h200.jsonl; 2, 8 and 32 read between their neighbours).
    # Its accept length is the chain's at --alphas 0.97 (it accepts nearly every token).
    "h200-self-standalone": (3.82, {1: 1466, 2: 1400, 4: 1342, 8: 1190, 16: 1035, 32: 870,
                                    64: 713},
                             {1: 1827, 2: 1550, 4: 1353, 8: 1225, 16: 1097, 32: 900, 64: 731}),
}
