"""Prometheus metrics of one server: engine state read at scrape time, latencies observed as tokens go out.

Each app has its own `CollectorRegistry`, so several apps (tests, embedding) never collide in the global one. With
data-parallel replicas the engine series are the replicas' sums (the prefix-cache hit rate: their mean), the
`hf_paged_replica_*` series give each replica's, and the request / latency series are counted once, in the front.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["ServerMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0)


class _EngineCollector:
    """Reads `Engine.queue_stats()` when scraped (set by `ServerMetrics.snapshot` just before)."""

    def __init__(self) -> None:
        self.stats: dict = {}

    def collect(self):
        s = self.stats
        gauges = [
            ("hf_paged_num_requests_waiting", "Requests waiting to be scheduled", s.get("waiting", 0)),
            ("hf_paged_num_requests_running", "Requests running on the device", s.get("running", 0)),
            ("hf_paged_num_requests_swapped", "Requests swapped out to the CPU", s.get("swapped", 0)),
            ("hf_paged_kv_blocks_used", "KV-cache blocks in use", s.get("kv_blocks_used", 0)),
            ("hf_paged_kv_blocks_total", "KV-cache blocks in the pool", s.get("kv_blocks_total", 0)),
            ("hf_paged_kv_cache_usage_ratio", "Fraction of the KV pool in use",
             s.get("kv_blocks_used", 0) / max(1, s.get("kv_blocks_total", 0))),
            ("hf_paged_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / tokens looked up",
             s.get("prefix_cache_hit_rate", 0.0)),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily("hf_paged_num_requests_queued", "API requests admitted, waiting for a first output",
                                value=s.get("queued", 0))
        yield CounterMetricFamily("hf_paged_requests_refused", "API requests refused with 429 (--max-queue-len)",
                                  value=s.get("refused", 0))
        yield CounterMetricFamily("hf_paged_requests_timed_out", "API requests aborted past --request-timeout",
                                  value=s.get("timed_out", 0))
        yield CounterMetricFamily("hf_paged_preemptions", "Requests preempted (recompute or swap)",
                                  value=s.get("preemptions", 0))
        yield CounterMetricFamily("hf_paged_engine_steps", "Engine steps run", value=s.get("steps", 0))
        yield from _replica_families(s.get("replicas"), s.get("router"))


# per-replica series of data-parallel serving (`ReplicaRouter.queue_stats`): (name, help, key, kind)
_REPLICA_SERIES = (
    ("hf_paged_replica_up", "1 while the replica serves, 0 while it is down or restarting", "up", "gauge"),
    ("hf_paged_replica_restarts", "Times the replica process was restarted", "restarts", "counter"),
    ("hf_paged_replica_requests_routed", "Engine requests routed to the replica", "routed", "counter"),
    ("hf_paged_replica_requests_in_flight", "Engine requests in flight on the replica", "pending", "gauge"),
    ("hf_paged_replica_num_requests_running", "Requests running on the replica's device", "running", "gauge"),
    ("hf_paged_replica_num_requests_waiting", "Requests waiting on the replica", "waiting", "gauge"),
    ("hf_paged_replica_kv_blocks_used", "KV-cache blocks in use on the replica", "kv_blocks_used", "gauge"),
    ("hf_paged_replica_prefix_cache_hit_rate", "The replica's prefix-cache hit rate", "prefix_cache_hit_rate",
     "gauge"),
)


def _replica_families(replicas: list[dict] | None, router: dict | None):
    """Series labelled `replica` (the unlabelled ones above are the replicas' sums), and the router's counts."""
    if not replicas:
        return
    for name, doc, key, kind in _REPLICA_SERIES:
        family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=["replica"])
        for r in replicas:
            family.add_metric([str(r["replica"])], r.get(key, 0))
        yield family
    for key, doc in (("prefix_hits", "Requests routed to the replica holding their longest known prefix"),
                     ("key_hits", "Requests routed by their X-HF-Paged-Affinity key"),
                     ("balanced", "Requests with a known prefix routed elsewhere because its replica was busier")):
        yield CounterMetricFamily(f"hf_paged_router_{key}", doc, value=(router or {}).get(key, 0))


class ServerMetrics:
    """The server's registry: engine gauges plus request counters and TTFT / inter-token latency histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._engine = _EngineCollector()
        self.registry.register(self._engine)
        self.ttft = Histogram("hf_paged_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("hf_paged_inter_token_latency_seconds", "Time between consecutive output tokens",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("hf_paged_e2e_request_latency_seconds", "Request latency, arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter("hf_paged_requests", "Requests by finish reason", ["finish_reason"],
                                registry=self.registry)
        self.prompt_tokens = Counter("hf_paged_prompt_tokens", "Prompt tokens", registry=self.registry)
        self.generation_tokens = Counter("hf_paged_generation_tokens", "Generated tokens", registry=self.registry)

    def render(self, engine_stats: dict) -> bytes:
        self._engine.stats = engine_stats
        return generate_latest(self.registry)
