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
# A rate set's chain, where it is not (3, 1, 4): at most this many tokens a verify.
CHAIN_TOKENS = {"h100-ngram-chat": 8}


def _per_request(accept: float, step_ms: dict) -> dict:
    """Tok/s a request by bucket of steps taking step_ms[bucket] and emitting `accept` tokens."""
    return {b: round(accept * 1e3 / ms) for b, ms in step_ms.items()}


# NGRAM (7, 1, 8) on the default model's chat prompts, batch 64 (H100, 3ca0b67: pinned
# speculation's step period by running batch size, docs/PERFORMANCE.md "Batch 64: why the
# estimate stays plain"; bucket 1 from c1a2a8b's batch-1 runs). Across 64 answers NGRAM accepted
# 1.10-7.1 tokens a verify, median 2.3 (about --alphas 0.57 --spreads 0.25 with --growth). A
# plain step costs a speculative one / 1.22, as measured at batch 1 (0.48 against 0.59 ms) and
# 64 (1.34 against 1.65).
_NGRAM_SPEC_MS = {1: 0.59, 2: 0.88, 4: 0.88, 8: 1.00, 16: 1.07, 32: 1.53, 64: 1.65}
RATES["h100-ngram-chat"] = (2.3, _per_request(2.3, _NGRAM_SPEC_MS),
                            _per_request(1.22, _NGRAM_SPEC_MS))

