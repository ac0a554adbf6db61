"""Prometheus metrics of one server, under SGLang's names (``sglang:*``, labelled ``model_name``).

What is measured where (SGLang's TokenizerMetricsCollector and SchedulerMetricsCollector, merged):

- In the TokenizerManager, as each request's outputs arrive from the detokenizer (`observe_output`):
  ``sglang:time_to_first_token_seconds`` (first output carrying a token - the request's arrival, i.e. before
  tokenization), ``sglang:inter_token_latency_seconds`` (the time between two outputs divided among the
  tokens the later one brings, observed once per token), and when the request finishes
  ``sglang:e2e_request_latency_seconds``, ``sglang:prompt_tokens_total``, ``sglang:generation_tokens_total``,
  ``sglang:cached_tokens_total``, ``sglang:num_requests_total`` (and ``sglang:num_aborted_requests_total``
  when it finished by an abort). A request whose client went away before its end is not counted, nor are
  /v1/score requests (they do not generate). ``sglang:num_rejected_requests_total`` counts the requests
  refused with 503 because the queue was full (--max-queued-requests; TokenizerManager.check_admission).
- At scrape time, from the scheduler's internal state (`update_gauges`): ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs``, ``sglang:num_used_tokens``, ``sglang:max_total_num_tokens`` and
  ``sglang:token_usage`` = used / total KV tokens, where used = total - free - evictable (SGLang's
  definition: cached prefixes that no request holds count as free); ``sglang:num_streaming_sessions`` and
  ``sglang:streaming_session_held_tokens`` (KV tokens streaming sessions hold between turns, SGLang's
  names). ``sglang:cache_hit_rate`` is the
  fraction of the prompt tokens of finished requests that came from the prefix cache (cumulative; SGLang
  reports the last prefill batch's fraction, which jumps between 0 and 1 on a quiet server); it is set as
  requests finish.
- Speculative decoding (--speculative-algorithm), at scrape time from the scheduler's counts since start:
  ``sglang:spec_accept_length`` (the mean tokens a request's verified draft gives: its accepted draft tokens + the
  bonus token) and ``sglang:spec_accept_rate`` (accepted / verified draft tokens); 0 before the first draft.
- Mixture-of-experts models, at scrape time from the scheduler's ``moe`` state (model_executor/moe_stats.py):
  ``sglang:moe_ep_imbalance`` (max / mean tokens per expert-parallel device over the last window of steps)
  and the histogram ``sglang:moe_expert_load_ratio`` (each sparse layer's experts' tokens over a window / the
  layer's mean per expert, one observation per expert and layer per window: the scheduler keeps the buckets,
  which are rendered as they are).

- The scheduler loop, at scrape time from its ``step_stats`` (scheduler/step_stats.py): the histograms
  ``sglang:scheduler_step_host_seconds`` (each loop iteration that launched a step, minus its waits on the device),
  ``sglang:scheduler_step_device_wait_seconds`` (those waits: blocked reading a step's sampled tokens) and
  ``sglang:scheduler_steps_per_second`` (the launch rate over each window of at least a second with steps).

- The hierarchical cache (--enable-hierarchical-cache), at scrape time from the scheduler's KV accounting (all DP
  ranks): ``sglang:hicache_host_hit_tokens_total`` (prompt tokens whose KV was loaded back from the host pool
  instead of recomputed; they count in ``sglang:cached_tokens_total`` too), ``sglang:hicache_host_written_tokens_total``
  (tokens copied to the host pool), ``sglang:hicache_host_used_tokens`` and ``sglang:hicache_host_total_tokens``
  (the host pool).

Histogram buckets are SGLang's defaults. Every collector owns a private ``CollectorRegistry``, so several
servers (or tests) in one process never clash over metric names.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

# SGLang's default bucket boundaries, in seconds
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
               0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST  # Prometheus text format 0.0.4


@dataclasses.dataclass
class RequestTimes:
    """One request's timestamps for the latency histograms (``time.perf_counter()`` seconds).

    received: when the request arrived (before tokenization).
    first_token: when its first output carrying a token arrived (None before).
    last_token: when its latest output carrying a token arrived.
    completion_tokens: output tokens seen so far.
    """

    received: float = dataclasses.field(default_factory=time.perf_counter)
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    completion_tokens: int = 0


class MetricsCollector:
    """The metrics of one server (see the module docstring), in a private registry.

    Args:
        model_name: the ``model_name`` label of every series (the served model name).
        registry: where the metrics live (default: a new ``CollectorRegistry``; never the global one).
    """

    def __init__(self, model_name: str, registry: Optional[CollectorRegistry] = None):
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name}
        self._prompt_tokens = 0
        self._cached_tokens = 0

        def counter(name, doc):
            return Counter(name, doc, labelnames=["model_name"], registry=self.registry).labels(**self.labels)

        def gauge(name, doc):
            return Gauge(name, doc, labelnames=["model_name"], registry=self.registry).labels(**self.labels)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labelnames=["model_name"], buckets=buckets,
                             registry=self.registry).labels(**self.labels)

        self.prompt_tokens = counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = counter("sglang:generation_tokens_total", "Number of generation tokens processed.")
        self.cached_tokens = counter("sglang:cached_tokens_total", "Number of cached prompt tokens.")
        self.num_requests = counter("sglang:num_requests_total", "Number of requests processed.")
        self.num_aborted_requests = counter("sglang:num_aborted_requests_total", "Number of requests aborted.")
        self.num_rejected_requests = counter("sglang:num_rejected_requests_total",
                                             "Number of requests refused with 503 because the queue was full "
                                             "(--max-queued-requests).")
        self.ttft = histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("sglang:e2e_request_latency_seconds",
                             "Histogram of End-to-end request latency in seconds", E2E_BUCKETS)
        self.num_running_reqs = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "The number of used tokens.")
        self.max_total_num_tokens = gauge("sglang:max_total_num_tokens",
                                          "Maximum total number of tokens in the KV cache pool.")
        self.token_usage = gauge("sglang:token_usage", "The token usage (fraction of the KV cache pool in use).")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.num_streaming_sessions = gauge("sglang:num_streaming_sessions", "The number of open streaming sessions.")
        self.streaming_session_held_tokens = gauge("sglang:streaming_session_held_tokens",
                                                   "KV tokens held by streaming sessions between turns.")
        self.spec_accept_length = gauge("sglang:spec_accept_length",
                                        "The average acceptance length of speculative decoding.")
        self.spec_accept_rate = gauge("sglang:spec_accept_rate",
                                      "The fraction of verified draft tokens accepted by speculative decoding.")
        self.moe = _MoeCollector(model_name)
        self.registry.register(self.moe)
        self.host_tier = _HostTierCollector(model_name)
        self.registry.register(self.host_tier)
        self.steps = _StepCollector(model_name)
        self.registry.register(self.steps)

    def observe_output(self, times: RequestTimes, completion_tokens: int, finished: bool, prompt_tokens: int = 0,
                       cached_tokens: int = 0, aborted: bool = False, now: Optional[float] = None) -> None:
        """One output of a request arrived.

        Args:
            times: the request's timestamps (updated here).
            completion_tokens: the request's output tokens so far (cumulative, as in ``StrOut``).
            finished: this is the request's last output; then the counters and the E2E histogram are
                observed with `prompt_tokens`, `completion_tokens`, `cached_tokens` (token counts) and
                `aborted` (it finished by an abort).
            now: the arrival time (``time.perf_counter()`` seconds; default: now).
        """
        now = time.perf_counter() if now is None else now
        new_tokens = completion_tokens - times.completion_tokens
        if new_tokens > 0:
            if times.first_token is None:
                times.first_token = now
                self.ttft.observe(now - times.received)
            else:
                per_token = (now - times.last_token) / new_tokens
                for _ in range(new_tokens):
                    self.itl.observe(per_token)
            times.last_token = now
            times.completion_tokens = completion_tokens
        if finished:
            self.prompt_tokens.inc(prompt_tokens)
            self.generation_tokens.inc(completion_tokens)
            self.cached_tokens.inc(cached_tokens)
            self.num_requests.inc()
            if aborted:
                self.num_aborted_requests.inc()
            self.e2e.observe(now - times.received)
            self._prompt_tokens += prompt_tokens
            self._cached_tokens += cached_tokens
            if self._prompt_tokens:
                self.cache_hit_rate.set(self._cached_tokens / self._prompt_tokens)

    def update_gauges(self, internal_state: dict) -> None:
        """Set the gauges from the scheduler's internal state (``TokenizerManager.get_internal_state()``:
        ``kv_tokens_total``, ``kv_tokens_free``, ``kv_tokens_evictable``, ``num_running_reqs``,
        ``num_waiting_reqs``, ``num_streaming_sessions``, ``kv_tokens_session_held``, and with speculative decoding
        ``spec_drafted_rows``, ``spec_draft_tokens``, ``spec_accepted_tokens``; token counts in tokens)."""
        total = internal_state["kv_tokens_total"]
        used = total - internal_state["kv_tokens_free"] - internal_state["kv_tokens_evictable"]
        self.num_running_reqs.set(internal_state["num_running_reqs"])
        self.num_queue_reqs.set(internal_state["num_waiting_reqs"])
        self.num_used_tokens.set(used)
        self.max_total_num_tokens.set(total)
        self.token_usage.set(used / total if total > 0 else 0.0)
        self.num_streaming_sessions.set(internal_state.get("num_streaming_sessions", 0))
        self.streaming_session_held_tokens.set(internal_state.get("kv_tokens_session_held", 0))
        self.moe.state = internal_state.get("moe")
        self.host_tier.state = internal_state if "host_kv_tokens_total" in internal_state else None
        self.steps.state = internal_state.get("step_stats")
        rows = internal_state.get("spec_drafted_rows")
        if rows:
            accepted = internal_state["spec_accepted_tokens"]
            self.spec_accept_length.set((accepted + rows) / rows)
            self.spec_accept_rate.set(accepted / max(internal_state["spec_draft_tokens"], 1))

    def render(self) -> bytes:
        """Every metric in the Prometheus text format (`METRICS_CONTENT_TYPE`)."""
        return generate_latest(self.registry)


class _StateCollector:
    """A custom collector of part of the scheduler's state (``state``, set at each scrape): nothing while it is
    None, else the metric families of `families`."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.state: Optional[dict] = None

    def collect(self):
        if self.state:
            yield from self.families()

    def families(self):
        raise NotImplementedError


class _MoeCollector(_StateCollector):
    """Renders the scheduler's mixture-of-experts routing state (`MoeStats.state`) as ``sglang:moe_ep_imbalance``
    and ``sglang:moe_expert_load_ratio``; nothing for a dense model."""

    def families(self):
        imbalance = GaugeMetricFamily("sglang:moe_ep_imbalance", "Max / mean tokens per expert-parallel device "
                                      "over the last window of steps (1: even).", labels=["model_name"])
        if self.state.get("ep_imbalance") is not None:
            imbalance.add_metric([self.model_name], self.state["ep_imbalance"])
        yield imbalance
        yield histogram_family("sglang:moe_expert_load_ratio", "Tokens an expert got in a window of steps / the mean "
                               "per expert of its layer.", self.model_name, self.state["load_ratio_histogram"])


def histogram_family(name: str, doc: str, model_name: str, h: dict) -> HistogramMetricFamily:
    """A histogram family from buckets the scheduler keeps ({"buckets": upper bounds, "counts": per bucket, "sum"})."""
    cumulative, buckets = 0, []
    for le, count in zip(h["buckets"], h["counts"]):
        cumulative += count
        buckets.append(("+Inf" if le == float("inf") else repr(float(le)), cumulative))
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model_name], buckets, h["sum"])
    return family


class _StepCollector(_StateCollector):
    """Renders the scheduler loop's step histograms (scheduler/step_stats.py) as ``sglang:scheduler_step_host_seconds``,
    ``sglang:scheduler_step_device_wait_seconds`` and ``sglang:scheduler_steps_per_second``."""

    def families(self):
        yield histogram_family("sglang:scheduler_step_host_seconds", "Host time of each scheduler loop iteration "
                               "that launched a step, waits on the device excluded (seconds).", self.model_name,
                               self.state["host_seconds"])
        yield histogram_family("sglang:scheduler_step_device_wait_seconds", "Time each such iteration was blocked "
                               "reading a step's sampled tokens (seconds).", self.model_name,
                               self.state["device_wait_seconds"])
        yield histogram_family("sglang:scheduler_steps_per_second", "Steps launched per second, over windows of at "
                               "least a second in which steps ran.", self.model_name, self.state["steps_per_second"])


class _HostTierCollector(_StateCollector):
    """Renders the host tier's counts from the scheduler's KV accounting (module docstring); nothing without
    --enable-hierarchical-cache."""

    def families(self):
        for name, key, doc in (
                ("sglang:hicache_host_hit_tokens", "host_hit_tokens",
                 "Prompt tokens whose KV was loaded back from the host pool instead of recomputed."),
                ("sglang:hicache_host_written_tokens", "host_written_tokens", "Tokens of KV copied to the host pool.")):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], self.state[key])
            yield family
        for name, value, doc in (
                ("sglang:hicache_host_used_tokens", self.state["host_kv_tokens_cached"],
                 "Tokens of KV the host pool holds."),
                ("sglang:hicache_host_total_tokens", self.state["host_kv_tokens_total"], "Tokens the host pool holds "
                 "at most.")):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
