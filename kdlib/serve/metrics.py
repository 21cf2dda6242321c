"""Prometheus families of one server engine (its own registry, so several servers in one process stay apart).

kdlib's own (the throughput decomposition reads the first two):
  kdlib_spec_accept_length               histogram, per request per step: the tokens it added to the answer
                                         (root + accepted, less a cut at max_tokens, end of text or a stop)
  kdlib_step_seconds                     histogram, per engine step: wall time of one batched step
  kdlib_step_batch_size                  histogram, per engine step: requests that emitted tokens
  kdlib_request_decode_tokens_per_second histogram, per request: tokens after the first / first-to-last time
  kdlib_time_to_first_token_seconds      histogram, per request: submission to first token
  kdlib_generation_tokens, kdlib_prompt_tokens, kdlib_decode_seconds, kdlib_requests{status}   counters
  kdlib_kv_pool_slots, kdlib_kv_pool_free_slots                                               gauges
Under vLLM's names (label model_name), read by serving tools:
  vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc               gauges
  vllm:spec_decode_num_drafts_total, vllm:spec_decode_num_draft_tokens_total,
  vllm:spec_decode_num_accepted_tokens_total, vllm:spec_decode_num_accepted_tokens_per_pos_total{position}
  vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds (between a request's
  successive emissions: one per step, several tokens under DDTree), vllm:e2e_request_latency_seconds
"""

from __future__ import annotations

# Accepted length tau counts root + accepted drafts: 1..MAX_DEPTH + 1 (= 17).
ACCEPT_BUCKETS = tuple(range(1, 18))
STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


class Metrics:
    """The registry and the hooks the engine loop calls (from its thread; prometheus_client locks).

    state(): a callable returning the engine's latest snapshot {running, waiting, pool_slots,
    pool_free, spec: {drafts, draft_tokens, accepted_tokens, accepted_per_pos}}.
    """

    def __init__(self, model_name: str, state):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        r = self.registry = CollectorRegistry()
        self.accept = Histogram("kdlib_spec_accept_length",
                                "Tokens a step added to a request's answer (root + accepted, less a cut at "
                                "max_tokens or a stop)",
                                buckets=ACCEPT_BUCKETS, registry=r)
        self.step = Histogram("kdlib_step_seconds", "Wall time of one batched engine step",
                              buckets=STEP_BUCKETS, registry=r)
        self.batch = Histogram("kdlib_step_batch_size", "Requests that emitted tokens in one engine step",
                               buckets=BATCH_BUCKETS, registry=r)
        self.rate = Histogram("kdlib_request_decode_tokens_per_second",
                              "Per request: tokens after the first / seconds from the first to the last",
                              buckets=RATE_BUCKETS, registry=r)
        self.ttft_kdlib = Histogram("kdlib_time_to_first_token_seconds",
                                    "Submission (after tokenisation) to the first token",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.gen = Counter("kdlib_generation_tokens", "Completion tokens generated", registry=r)
        self.prompt = Counter("kdlib_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.decode_s = Counter("kdlib_decode_seconds", "Seconds spent in engine steps", registry=r)
        self.requests = Counter("kdlib_requests",
                                "Finished sequences by finish reason (stop, length, abort, error)",
                                ["status"], registry=r)
        lab = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", lab,
                              buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Time between a request's successive emissions", lab,
                             buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Submission to the last token", lab,
                             buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        r.register(_StateCollector(model_name, state))

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _StateCollector:
    """Gauges and the speculative-decoding counters, read from the engine's snapshot at scrape time."""

    def __init__(self, model_name: str, state):
        self.name, self.state = model_name, state

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s, lab = self.state(), [self.name]
        for name, doc, v in (("vllm:num_requests_running", "Requests in the running batch", s["running"]),
                             ("vllm:num_requests_waiting", "Requests waiting to join the batch",
                              s["waiting"]),
                             ("vllm:kv_cache_usage_perc", "Fraction of the KV pool in use",
                              1.0 - s["pool_free"] / s["pool_slots"] if s["pool_slots"] else 0.0)):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(lab, v)
            yield g
        yield GaugeMetricFamily("kdlib_kv_pool_slots", "KV pool slots", value=s["pool_slots"])
        yield GaugeMetricFamily("kdlib_kv_pool_free_slots", "Free KV pool slots", value=s["pool_free"])
        spec = s["spec"]
        for key, name, doc in (("drafts", "vllm:spec_decode_num_drafts",
                                "Draft (speculation) rounds, per request"),
                               ("draft_tokens", "vllm:spec_decode_num_draft_tokens", "Draft tokens verified"),
                               ("accepted_tokens", "vllm:spec_decode_num_accepted_tokens",
                                "Draft tokens accepted")):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(lab, spec.get(key, 0))
            yield c
        c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted by position", labels=["model_name", "position"])
        for pos, v in enumerate(spec.get("accepted_per_pos", ())):
            c.add_metric([self.name, str(pos)], v)
        yield c
