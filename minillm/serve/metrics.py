"""Prometheus metrics of the server (chapter 08), named after vLLM's (`vllm:` -> `minillm:`).

Scraped at GET /metrics. What each one answers when something is wrong:

    metric                                         kind       what it answers
    ---------------------------------------------  ---------  -------------------------------------
    minillm:time_to_first_token_seconds            histogram  is TTFT high? (queueing, prefills)
    minillm:inter_token_latency_seconds            histogram  are streams stuttering? (p99 spikes)
    minillm:e2e_request_latency_seconds            histogram  what users wait in total
    minillm:request_queue_time_seconds             histogram  how much of TTFT is waiting, not work
    minillm:num_requests_running / _waiting        gauge      load now; waiting > 0 long = saturated
    minillm:kv_blocks_in_use, kv_cache_usage_perc  gauge      KV pool occupancy (1.0 -> preemptions)
    minillm:prefix_cache_hit_rate                  gauge      prompt tokens found / looked up; NaN
                                                              while none was looked up (no cache)
    minillm:num_preemptions_total                  counter    rising fast = preemption storm
    minillm:request_success_total{finished_reason} counter    stop / length / abort / error
    minillm:requests_rejected_total{reason}        counter    queue_full 429 / invalid 400 /
                                                              draining 503
    minillm:prompt_tokens_total, _generation_...   counter    token throughput = rate() of these

The gauges and the preemption counter come from each step's `StepStats` (`on_step`), the
histograms and token counters from each finished `RequestOutput` (`on_finished`): the exporter
reads nothing else of the engine.

Every server gets its own CollectorRegistry, so several servers in one process (tests, the
notebook) never share or clash over metrics.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, {"model_name": model_name}

        def hist(name, doc, buckets):
            return Histogram(name, doc, buckets=buckets, registry=r,
                             labelnames=list(labels)).labels(**labels)

        def gauge(name, doc):
            return Gauge(name, doc, registry=r, labelnames=list(labels)).labels(**labels)

        self.ttft = hist("minillm:time_to_first_token_seconds",
                         "Arrival to first output token.", TTFT_BUCKETS)
        self.itl = hist("minillm:inter_token_latency_seconds",
                        "Gap between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = hist("minillm:e2e_request_latency_seconds",
                        "Arrival to finish.", E2E_BUCKETS)
        self.queue_time = hist("minillm:request_queue_time_seconds",
                               "Arrival to first scheduled.", TTFT_BUCKETS)
        self.running = gauge("minillm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("minillm:num_requests_waiting",
                             "Requests waiting to run (new or preempted).")
        self.blocks_in_use = gauge("minillm:kv_blocks_in_use", "KV blocks allocated.")
        self.kv_usage = gauge("minillm:kv_cache_usage_perc", "Fraction of KV blocks in use.")
        self.prefix_hit_rate = gauge("minillm:prefix_cache_hit_rate",
                                     "Prefix-cache hit rate (NaN without a prefix cache).")
        self.preemptions = Counter("minillm:num_preemptions", "Preemptions (recompute or swap).",
                                   registry=r, labelnames=list(labels)).labels(**labels)
        self.success = Counter("minillm:request_success", "Finished requests.", registry=r,
                               labelnames=["model_name", "finished_reason"])
        self.rejected = Counter("minillm:requests_rejected", "Requests refused.", registry=r,
                                labelnames=["model_name", "reason"])
        self.prompt_tokens = Counter("minillm:prompt_tokens", "Prompt tokens of finished "
                                     "requests.", registry=r,
                                     labelnames=list(labels)).labels(**labels)
        self.generation_tokens = Counter("minillm:generation_tokens", "Generated tokens.",
                                         registry=r, labelnames=list(labels)).labels(**labels)
        self.model_name = model_name
        self._preemptions_seen = 0
        self.prefix_hit_rate.set(float("nan"))

    # --- called from the engine thread ---------------------------------------------------------
    def on_step(self, stats) -> None:
        """Set the gauges from one step's StepStats (`LLMEngine.step_outputs().stats`): a
        snapshot of the queues and the KV pool after the step, plus cumulative counters."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        used = stats.num_kv_blocks - stats.num_free_blocks
        self.blocks_in_use.set(used)
        self.kv_usage.set(used / stats.num_kv_blocks)
        if stats.total_preemptions > self._preemptions_seen:    # a counter only goes up
            self.preemptions.inc(stats.total_preemptions - self._preemptions_seen)
            self._preemptions_seen = stats.total_preemptions
        if stats.prefix_cache_queries:                          # NaN until a lookup happened
            self.prefix_hit_rate.set(stats.prefix_cache_hits / stats.prefix_cache_queries)

    def on_finished(self, out) -> None:
        self.success.labels(self.model_name, out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        for o in out.outputs:
            self.generation_tokens.inc(len(o.token_ids))
            m = o.metrics
            if m is None or o.finish_reason == "abort":
                continue
            if m.ttft is not None:
                self.ttft.observe(m.ttft)
            for gap in m.itl:
                self.itl.observe(gap)
            if m.e2e_latency is not None:
                self.e2e.observe(m.e2e_latency)
            if m.queueing_time is not None:
                self.queue_time.observe(m.queueing_time)

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def text(self) -> str:
        """What GET /metrics returns."""
        from prometheus_client import generate_latest
        return generate_latest(self.registry).decode()


def parse_metrics(text: str) -> dict:
    """Prometheus text -> {(sample name, frozenset of labels without model_name): value}."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            out[(s.name, labels)] = s.value
    return out


def histogram_quantile(q: float, samples: dict, name: str) -> float:
    """PromQL's histogram_quantile over the cumulative `name_bucket` samples of parse_metrics:
    find the bucket holding rank q x count and interpolate linearly inside it. This is what a
    dashboard's "p99 TTFT" panel shows: an estimate, only as fine as the buckets."""
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q}")
    buckets = sorted((float(dict(lbl)["le"]), v) for (n, lbl), v in samples.items()
                     if n == name + "_bucket")
    if not buckets or buckets[-1][1] == 0:
        return float("nan")
    rank = q * buckets[-1][1]
    lo_bound, lo_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lo_bound                 # beyond the last finite bucket: its bound
            if count == lo_count:
                return bound
            return lo_bound + (bound - lo_bound) * (rank - lo_count) / (count - lo_count)
        lo_bound, lo_count = bound, count
    return lo_bound


__all__ = ["ServerMetrics", "parse_metrics", "histogram_quantile"]
