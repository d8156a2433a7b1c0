"""Prometheus metrics under SGLang's names (prefix `specpcg:`): request and token counters,
TTFT and inter-token histograms fed by the server, and gauges read from the engine at scrape
time (queue depth, running requests, KV usage, speculative accept length and rate)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0)


class EngineCollector:
    """Reads the engine when scraped (plain ints and lists: no lock needed for a snapshot)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        eng = self.engine
        sched, kv = eng.scheduler, eng.kv_cache
        yield GaugeMetricFamily("specpcg:num_queue_reqs", "requests waiting",
                                value=len(sched.waiting))
        yield GaugeMetricFamily("specpcg:num_running_reqs", "requests running",
                                value=len(sched.running))
        yield GaugeMetricFamily("specpcg:token_usage", "share of KV slots in use",
                                value=1.0 - kv.free_slots / max(kv.total_slots, 1))
        if eng.spec_decoder is None:
            return
        stats = eng.spec_decoder.stats()
        hist = stats["spec_accept_histogram"]
        verifies = sum(hist.values())
        drafts = verifies * (eng.spec.num_draft_tokens - 1)
        accepted = sum(m * c for m, c in hist.items())
        yield GaugeMetricFamily("specpcg:spec_accept_length",
                                "tokens per verify, bonus token included",
                                value=stats["avg_spec_accept_length"])
        yield GaugeMetricFamily("specpcg:spec_accept_rate", "accepted drafts / drafted",
                                value=accepted / drafts if drafts else 0.0)
        yield CounterMetricFamily("specpcg:spec_verify_calls", "verify steps (per request)",
                                  value=stats["spec_verify_ct"])


class ServerMetrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specpcg:num_requests", "finished requests", ["finish_reason"],
                                registry=r)
        self.prompt_tokens = Counter("specpcg:prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("specpcg:generation_tokens", "generated tokens",
                                         registry=r)
        self.ttft = Histogram("specpcg:time_to_first_token_seconds", "time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specpcg:inter_token_latency_seconds",
                             "time between streamed chunks, per token", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram("specpcg:e2e_request_latency_seconds", "request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        r.register(EngineCollector(engine))

    def finished(self, meta: dict, reason: str) -> None:
        self.requests.labels(finish_reason=reason or "none").inc()
        self.prompt_tokens.inc(meta.get("prompt_tokens", 0))
        self.generation_tokens.inc(meta.get("completion_tokens", 0))
        if "ttft" in meta:
            self.ttft.observe(meta["ttft"])
        if "e2e_latency" in meta:
            self.e2e.observe(meta["e2e_latency"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
