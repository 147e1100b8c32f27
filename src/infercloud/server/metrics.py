"""Prometheus metrics of one engine, with vLLM's names under the `infercloud:` prefix.

State gauges and token counters are read from the engine's latest stats snapshot at scrape time
(a custom collector), so they never drift from the engine's own counts. Latency histograms are
fed from each request output as it leaves the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from infercloud.engine.llm_engine import EngineStats
from infercloud.engine.outputs import RequestOutput

_LATENCY_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class _StatsCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        labels = ["model_name"]
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", s.num_requests_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_requests_waiting),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", s.kv_cache_usage),
        ):
            g = GaugeMetricFamily(f"infercloud:{name}", doc, labels=labels)
            g.add_metric([self._model], value)
            yield g
        for name, doc, value in (
            ("num_preemptions", "Preemptions by recompute.", s.num_preemptions),
            ("prompt_tokens", "Prompt tokens admitted.", s.num_prompt_tokens_total),
            ("generation_tokens", "Tokens generated.", s.num_generation_tokens_total),
            (
                "kv_blocks_moved",
                "Idle cached KV blocks moved to another id so that running requests' blocks "
                "stay packed.",
                s.kv_blocks_moved,
            ),
        ):
            c = CounterMetricFamily(f"infercloud:{name}", doc, labels=labels)
            c.add_metric([self._model], value)
            yield c
        # Per tier, in tokens as vLLM counts them: "device" is the engine's pool, "host" the
        # second tier (queried for the tokens the device did not have).
        tiered = ["model_name", "tier"]
        host = s.host_cache_enabled
        for name, doc, device_value, host_value in (
            (
                "prefix_cache_queries",
                "Tokens looked up in the prefix cache.",
                s.prefix_cache_queries_tokens,
                s.host_cache_queries_tokens,
            ),
            (
                "prefix_cache_hits",
                "Tokens found in the prefix cache.",
                s.prefix_cache_hits_tokens,
                s.host_cache_hits_tokens,
            ),
            (
                "prefix_cache_evictions",
                "Cached KV blocks evicted from a tier (from the device to the host, if any).",
                s.prefix_cache_evicted_blocks,
                s.host_cache_evicted_blocks,
            ),
        ):
            c = CounterMetricFamily(f"infercloud:{name}", doc, labels=tiered)
            c.add_metric([self._model, "device"], device_value)
            if host:
                c.add_metric([self._model, "host"], host_value)
            yield c
        g = GaugeMetricFamily(
            "infercloud:prefix_cache_blocks", "KV blocks held by the prefix cache.", labels=tiered
        )
        g.add_metric([self._model, "device"], s.prefix_cache_blocks)
        if host:
            g.add_metric([self._model, "host"], s.host_cache_blocks)
        yield g
        if host:
            for name, doc, value in (
                (
                    "host_cache_copy_seconds_per_block",
                    "Measured time to load one KV block back from the host tier.",
                    s.host_copy_s_per_block,
                ),
                (
                    "recompute_seconds_per_first_block",
                    "Estimated time to recompute a prompt's first KV block (fitted to steps).",
                    s.recompute_s_per_first_block,
                ),
            ):
                g = GaugeMetricFamily(f"infercloud:{name}", doc, labels=labels)
                g.add_metric([self._model], value)
                yield g
        c = CounterMetricFamily(
            "infercloud:kv_block_migrations",
            "KV blocks copied between tiers.",
            labels=["model_name", "direction"],
        )
        c.add_metric([self._model, "device_to_host"], s.kv_blocks_saved_to_host)
        c.add_metric([self._model, "host_to_device"], s.kv_blocks_loaded_from_host)
        yield c


class EngineMetrics:
    """Owns a registry; `observe` is called on the engine thread for every output."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        model_name: str,
        clock: Callable[[], float] = time.monotonic,
        cache_config: dict[str, str] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(stats, model_name))
        if cache_config:
            # vLLM's cache_config_info: the KV cache's settings as labels of a constant 1
            names = sorted(cache_config)
            info = Gauge(
                "infercloud:cache_config_info",
                "Information of the KV cache's configuration.",
                ["model_name", *names],
                registry=self.registry,
            )
            info.labels(model_name, *(cache_config[n] for n in names)).set(1)
        self._clock = clock
        self._model = model_name
        labels = ["model_name"]

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(
                f"infercloud:{name}",
                doc,
                labels,
                registry=self.registry,
                buckets=_LATENCY_BUCKETS_S,
            )

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.")
        self.success = Counter(
            "infercloud:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        # Touched only on the engine thread (see `observe`); prometheus objects are thread-safe.
        self._last_token_s: dict[str, float] = {}

    def observe(self, out: RequestOutput) -> None:
        now = self._clock()
        last = self._last_token_s.get(out.request_id)
        if out.new_token_ids:
            if last is None:
                self.ttft.labels(self._model).observe(now - out.arrival_time_s)
                if out.first_scheduled_time_s is not None:
                    wait = out.first_scheduled_time_s - out.arrival_time_s
                    self.queue.labels(self._model).observe(wait)
            else:
                self.itl.labels(self._model).observe(now - last)
            self._last_token_s[out.request_id] = now
        if out.finished:
            self._last_token_s.pop(out.request_id, None)
            self.e2e.labels(self._model).observe(now - out.arrival_time_s)
            self.success.labels(self._model, out.finish_reason or "abort").inc()
