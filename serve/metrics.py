"""A replica's Prometheus metrics: HTTP requests by endpoint and status, time to first token and
inter-token latency, the engine's counters and queues, and the replica process's memory and CPU
(process_resident_memory_bytes, ...).

The engine's series come from one EngineStats snapshot taken on its step thread (so they all
belong to the same moment between two steps) and its fixed EngineInfo; nothing here reads the
scheduler, the cache or the prefix cache behind them.
"""
from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from sala.engine import EngineInfo, EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self, info: EngineInfo):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("sala_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("sala_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("sala_inter_token_latency_seconds", "Gap between consecutive tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.engine = EngineSeries(info)
        r.register(self.engine)
        ProcessCollector(registry=r)

    def exposition(self, stats: EngineStats) -> bytes:
        """The text format, the engine's series from `stats`. Synchronous: no other scrape on this
        event loop can set another snapshot before this one is written."""
        self.engine.stats = stats
        return generate_latest(self.registry)


class EngineSeries:
    """A collector of the engine's series: its settings and the snapshot last given."""

    def __init__(self, info: EngineInfo, stats: EngineStats | None = None):
        self.info, self.stats = info, stats

    def collect(self) -> Iterator[Metric]:
        info, s = self.info, self.stats
        yield GaugeMetricFamily("sala_queue_depth", "Requests waiting for admission", value=s.waiting)
        yield GaugeMetricFamily("sala_running_requests", "Requests holding cache", value=s.running)
        yield CounterMetricFamily("sala_prompt_tokens", "Prompt tokens of accepted requests", value=s.prompt_tokens)
        yield CounterMetricFamily("sala_generation_tokens", "Tokens generated", value=s.generated_tokens)
        yield CounterMetricFamily("sala_preemptions", "Requests preempted when the K/V pages ran out (recomputed later)",
                                  value=s.preemptions)
        yield GaugeMetricFamily("sala_kv_pages_free", "Free K/V cache pages", value=s.free_pages)
        yield GaugeMetricFamily("sala_kv_pages", "K/V cache pages in all", value=info.num_pages)
        if p := s.prefix:
            yield CounterMetricFamily("sala_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                      value=p.queried_tokens)
            yield CounterMetricFamily("sala_prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache "
                                      "(cached_tokens)", value=p.hit_tokens)
            yield GaugeMetricFamily("sala_prefix_cache_hit_rate", "Cached prompt tokens / prompt tokens looked up",
                                    value=p.hit_rate)
            yield GaugeMetricFamily("sala_prefix_cache_pages", "K/V pages held by the prefix cache and no request",
                                    value=p.evictable_pages)
            yield GaugeMetricFamily("sala_prefix_snapshot_bytes", "Memory holding lightning-state snapshots",
                                    value=p.snapshot_bytes)
            yield GaugeMetricFamily("sala_prefix_snapshot_capacity_bytes", "The snapshots' budget",
                                    value=p.snapshot_capacity_bytes)
            yield CounterMetricFamily("sala_prefix_cache_evicted_pages", "Cached pages taken back for new requests",
                                      value=p.evicted_pages)
        yield GaugeMetricFamily("sala_kv_cache_bytes_per_token", "K/V bytes one token takes in all sparse layers, as the "
                                "loaded cache plan stores them", value=info.kv_bytes_per_token)
        yield GaugeMetricFamily("sala_state_bytes_per_sequence", "Lightning state bytes one sequence takes in all "
                                "lightning layers, as the loaded cache plan stores them", value=info.state_bytes_per_seq)
        per_layer = GaugeMetricFamily("sala_cache_layer_bytes", "Cache bytes of one layer: K/V a token (sparse) or "
                                      "state a sequence (lightning)", labels=["layer", "kind", "format", "per"])
        for layer in info.layers:
            per_layer.add_metric([str(layer.layer), layer.kind, layer.format, layer.per], layer.bytes)
        yield per_layer
        finished = CounterMetricFamily("sala_finished_requests", "Finished requests by reason", labels=["reason"])
        for reason, count in s.finished.items():
            finished.add_metric([reason], count)
        yield finished
        if spec := s.speculation:  # Medusa: mean accept length = 1 + accepted / verify steps (bonus included, as vLLM / SGLang)
            yield CounterMetricFamily("sala_spec_verify_steps", "Medusa tree-verify steps", value=spec.verify_steps)
            yield CounterMetricFamily("sala_spec_draft_tokens", "Drafted tokens verified (tree nodes below the root)",
                                      value=spec.draft_tokens)
            yield CounterMetricFamily("sala_spec_accepted_tokens", "Drafted tokens accepted (the bonus token not counted)",
                                      value=spec.accepted_tokens)
            yield GaugeMetricFamily("sala_spec_accept_length", "Tokens per verify step, bonus included",
                                    value=spec.accept_length)
            # The tree chosen now at each batch size class timed (medusa_nodes='auto'), and why.
            labels = ["batch", "sampling"]
            nodes = GaugeMetricFamily("sala_spec_tree_nodes", "Draft tree nodes a verify step checks at this batch "
                                      "size class now (0: plain decoding)", labels=labels)
            expected = GaugeMetricFamily("sala_spec_expected_accept_length", "Tokens the chosen tree's verify step is "
                                         "expected to yield now (the heads' acceptance scaled by recent steps')",
                                         labels=labels)
            speedup = GaugeMetricFamily("sala_spec_expected_speedup", "Expected tokens/s of the chosen tree over plain "
                                        "decoding at this batch size class now (measured step costs and acceptance)",
                                        labels=labels)
            for t in spec.trees:
                key = [str(t.batch), t.kind]
                nodes.add_metric(key, t.nodes)
                expected.add_metric(key, t.accept_length)
                speedup.add_metric(key, t.speedup)
            yield from (nodes, expected, speedup)
