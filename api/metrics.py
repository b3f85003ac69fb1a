"""Prometheus metrics of the gateway, in a registry owned by the app (no process-wide state).

Latencies are observed here as tokens pass through; the cluster's numbers (running/waiting
requests, tier bytes and counters, handoff bytes, prefill progress) are read from the frontend's
latest actor reports at scrape time, so a scrape never waits on an actor.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class _ClusterCollector:
    def __init__(self, model: str, stats: Callable[[], dict]) -> None:
        self.model, self.stats = model, stats

    def collect(self):
        s = self.stats() or {}
        lab = ["model"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=lab)
            g.add_metric([self.model], float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=lab)
            c.add_metric([self.model], float(value))
            return c

        yield gauge("hisparse_requests_running", "Requests decoding on the decode actors", s.get("running", 0))
        yield gauge("hisparse_requests_waiting", "Requests queued on decode actors or in the router",
                    s.get("waiting", 0) + s.get("router_waiting", 0))
        yield gauge("hisparse_prefill_queued_tokens", "Prompt tokens waiting on prefill actors", s.get("prefill_queued_tokens", 0))
        yield gauge("hisparse_kv_device_bytes_used", "Device bytes holding KV (all decode actors)", s.get("device_bytes_used", 0))
        yield gauge("hisparse_kv_device_bytes_capacity", "Device KV budget (all decode actors)", s.get("device_bytes_total", 0))
        yield gauge("hisparse_kv_host_bytes_used", "Host-pool bytes holding C4 entries", s.get("host_bytes_used", 0))
        yield gauge("hisparse_kv_host_bytes_capacity", "Host-pool capacity", s.get("host_bytes_total", 0))
        yield counter("hisparse_hot_buffer_hits", "Selected C4 entries already in the hot buffer", s.get("hits", 0))
        yield counter("hisparse_hot_buffer_misses", "Selected C4 entries copied in from the host pool", s.get("misses", 0))
        yield counter("hisparse_hot_buffer_h2d_bytes", "Bytes copied host to device by the tier", s.get("bytes_h2d", 0))
        yield counter("hisparse_handoff_bytes", "Layout bytes handed from prefill to decode", s.get("handoff_bytes", 0))
        yield gauge("hisparse_kept_requests", "Finished requests whose prompt pages decode actors keep for a follow-up turn",
                    s.get("kept_requests", 0))
        yield gauge("hisparse_kept_bytes", "Host bytes of the prompt pages decode actors keep", s.get("kept_bytes", 0))
        yield counter("hisparse_kept_reused_pages", "Kept pages follow-up turns used (their handoffs left them out)",
                      s.get("kept_reused_pages", 0))
        yield gauge("hisparse_decode_actors_alive", "Decode actors answering", s.get("decode_alive", 0))
        yield gauge("hisparse_prefill_actors_alive", "Prefill actors answering", s.get("prefill_alive", 0))
        yield gauge("hisparse_integrity_errors", "Failed idle integrity checks on decode actors", s.get("integrity_errors", 0))
        yield gauge("hisparse_integrity_checks", "Idle integrity checks passed or failed on decode actors",
                    s.get("integrity_checks", 0))
        yield gauge("hisparse_prefill_held_layouts", "Layouts prefill actors are handing over right now", s.get("held_layouts", 0))
        tables = GaugeMetricFamily("hisparse_table_entries", "Per-request bookkeeping entries (zero when idle)",
                                   labels=["model", "table"])
        for name, n in (s.get("tables") or {}).items():
            tables.add_metric([self.model, name], float(n))
        yield tables
        yield counter("hisparse_failed_steps", "Decode steps that raised (their requests were prefilled again)",
                      s.get("failed_steps", 0))
        retries = CounterMetricFamily("hisparse_request_retries", "Attempts prefilled again after a failure, by stage",
                                      labels=["model", "stage"])
        for stage, n in (s.get("retries") or {}).items():
            retries.add_metric([self.model, stage], float(n))
        yield retries
        yield counter("hisparse_prefill_computed_tokens", "Prompt tokens prefill computed (resumed ones excluded)",
                      s.get("prefill_tokens_computed", 0))
        yield from _prefix_cache(self.model, s.get("prefix_cache"))
        routing = CounterMetricFamily("hisparse_prefix_routing", "Prefill routing decisions: to the actor holding the "
                                      "prefix, away from it for load (capped), or least loaded", labels=["model", "decision"])
        for decision, n in (s.get("prefix_routing") or {}).items():
            routing.add_metric([self.model, decision], float(n))
        yield routing
        progress = GaugeMetricFamily("hisparse_prefill_progress_tokens", "Prompt tokens done and in total of prompts "
                                     "being prefilled", labels=["model", "request", "part"])
        for rid, (done, total) in (s.get("prefill_progress") or {}).items():
            progress.add_metric([self.model, rid, "done"], float(done))
            progress.add_metric([self.model, rid, "total"], float(total))
        yield progress


def _prefix_cache(model: str, pc: dict | None):
    """The prefix cache's numbers, summed over the prefill actors (absent while no actor runs one)."""
    if not pc:
        return
    lab = ["model"]

    def one(kind, name, doc, value):
        m = kind(name, doc, labels=lab)
        m.add_metric([model], float(value))
        return m

    yield one(CounterMetricFamily, "hisparse_prefix_cache_prompt_tokens", "Prompt tokens looked up in the prefix cache",
              pc["prompt_tokens"])
    yield one(CounterMetricFamily, "hisparse_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
              pc["hit_tokens"])
    rate = pc["hit_tokens"] / pc["prompt_tokens"] if pc["prompt_tokens"] else 0.0
    yield one(GaugeMetricFamily, "hisparse_prefix_cache_hit_rate", "Cached tokens / prompt tokens since start", rate)
    tier = GaugeMetricFamily("hisparse_prefix_cache_bytes", "Bytes the prefix cache holds, by tier and part",
                             labels=["model", "tier", "part"])
    for t in ("host", "disk"):
        for part in ("seg", "state"):
            tier.add_metric([model, t, "classical" if part == "seg" else "state"], float(pc[f"{t}_{part}_bytes"]))
    yield tier
    yield one(GaugeMetricFamily, "hisparse_prefix_cache_pages", "Pages cached (any tier)", pc["nodes"])
    yield one(GaugeMetricFamily, "hisparse_prefix_cache_page_tokens", "Tokens per cached page", pc.get("page_tokens", 0))
    pages = GaugeMetricFamily("hisparse_prefix_cache_tier_pages", "Pages whose entries a tier holds", labels=["model", "tier"])
    for t in ("host", "disk"):
        pages.add_metric([model, t], float(pc.get(f"{t}_pages", 0)))
    yield pages
    yield one(GaugeMetricFamily, "hisparse_prefix_cache_state_snapshots", "State snapshots cached", pc["state_snapshots"])
    yield one(GaugeMetricFamily, "hisparse_prefix_cache_state_bytes_every_page",
              "State bytes a snapshot at every cached page would hold", pc["state_bytes_every_page"])
    yield one(CounterMetricFamily, "hisparse_prefix_cache_evictions", "Parts moved out of host memory", pc["evictions"])
    yield one(CounterMetricFamily, "hisparse_prefix_cache_disk_drops", "Parts whose file left the disk tier", pc["disk_drops"])
    io = CounterMetricFamily("hisparse_prefix_cache_disk_ops", "Disk tier reads and writes", labels=["model", "op"])
    io.add_metric([model, "read"], float(pc["disk_reads"]))
    io.add_metric([model, "write"], float(pc["disk_writes"]))
    yield io
    io_bytes = CounterMetricFamily("hisparse_prefix_cache_disk_io_bytes", "Bytes read and written by the disk tier",
                                   labels=["model", "op"])
    io_bytes.add_metric([model, "read"], float(pc["disk_read_bytes"]))
    io_bytes.add_metric([model, "write"], float(pc["disk_write_bytes"]))
    yield io_bytes
    yield one(CounterMetricFamily, "hisparse_prefix_cache_disk_errors", "Disk tier failures, reads and writes (the cache "
              "goes on without what failed)", pc["disk_errors"])
    errors = CounterMetricFamily("hisparse_prefix_cache_disk_op_errors", "Disk tier failures by operation (read: a file "
                                 "unreadable or failing its checks, a miss; write: a file not written or removed)",
                                 labels=["model", "op"])
    for op in ("read", "write"):
        errors.add_metric([model, op], float(pc.get(f"disk_{op}_errors", 0)))
    yield errors


class Metrics:
    def __init__(self, model: str, cluster_stats: Callable[[], dict]) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        lab = ["model"]
        self.ttft = Histogram("hisparse_time_to_first_token_seconds", "Time to first token", lab, registry=self.registry,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("hisparse_inter_token_latency_seconds", "Time between tokens of a request", lab,
                             registry=self.registry, buckets=_ITL_BUCKETS)
        self.e2e = Histogram("hisparse_e2e_request_latency_seconds", "End-to-end request latency", lab, registry=self.registry,
                             buckets=_LATENCY_BUCKETS)
        self.requests = Counter("hisparse_requests", "Finished requests by finish reason", lab + ["finish_reason"],
                                registry=self.registry)
        self.prompt_tokens = Counter("hisparse_prompt_tokens", "Prompt tokens processed", lab, registry=self.registry)
        self.generation_tokens = Counter("hisparse_generation_tokens", "Tokens generated", lab, registry=self.registry)
        self.errors = Counter("hisparse_request_errors", "Requests answered with an error, by status", lab + ["status"],
                              registry=self.registry)
        self.cluster = _ClusterCollector(model, cluster_stats)
        self.registry.register(self.cluster)
        # the children of the one model label, bound once: the per-token path never looks labels up
        self.ttft_m, self.itl_m, self.e2e_m = self.ttft.labels(model), self.itl.labels(model), self.e2e.labels(model)
        self.prompt_tokens_m, self.generation_tokens_m = self.prompt_tokens.labels(model), self.generation_tokens.labels(model)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MultiprocessMetrics(Metrics):
    """Metrics of one of several gateway processes: latencies and counts are written to the shared
    directory named by PROMETHEUS_MULTIPROC_DIR and summed over all processes at scrape time; the
    cluster's numbers come from this process's own view of the actors (the same in every process)."""

    def render(self) -> bytes:
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(self.cluster)
        return generate_latest(registry)
