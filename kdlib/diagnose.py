"""Throughput diagnosis of an OpenAI-compatible endpoint (the seeds' method, as a tool), and a load mode.

    kdlib diagnose                                   # starts `kdlib serve` on loopback (a child process)
    kdlib diagnose --endpoint http://host:30000/v1 --json diag.json
    kdlib diagnose --load --concurrency 1,2,4,8,16 --json load.json      # beside `vllm bench serve`

    client = OpenAIClient(url)                       # or EngineClient(engine): the engine in process
    two_point(client, prompt)                        # 256 / (t(264) - t(8)): decode rate, prefill cancels
    context_sweep(client)                            # two-point at prompt lengths 64, 128, ... to the limit
    sustained(client, prompt, 1500)                  # one long streamed generation: TTFT, decode tok/s
    decompose(before, after, measured)               # accepted length / step time vs the measured tok/s
    load_test(client, concurrency=(1, 2, 4, 8, 16))  # latency percentiles, throughput, goodput per level

Measurements:
  two-point   the same prompt with max_tokens 8 and 264 (interleaved, `repeats` each, medians):
              rate = (n_264 - n_8) / (t_264 - t_8). Prefill, queueing and the first token cost the
              same in both and cancel. completion_tokens of both replies are checked: an early stop
              (EOS despite ignore_eos) is flagged and the rate uses the tokens actually returned.
  sweep       two-point at prompt lengths doubling from 64 while prompt + 264 fits the context.
  sustained   one streamed request of `max_tokens` (default 1500): TTFT = time to the first chunk;
              decode tok/s = tokens after the first chunk / time from the first to the last chunk.
  decompose   from two /metrics snapshots around a measurement: mean accepted length (tokens per
              request per step), mean step time and streams per step; accepted / step time
              predicts one stream's tok/s, times the streams the aggregate tok/s.
  load        fixed concurrency levels and request-rate sweeps (`load_test`): TTFT, TPOT, ITL and
              end-to-end latency (p50 / p90 / p99), request / output throughput, goodput under
              latency targets, the decomposition per level, the spread of every figure over
              repeats, and whether greedy outputs under load equal the sequential ones.

Clients: the official `openai` package (OpenAI / AsyncOpenAI, no retries), and
`prometheus_client.parser` for /metrics. The base URL may be given with or without /v1. What it
relies on from an endpoint (vLLM and SGLang both serve these): POST /v1/completions with `prompt`
(a string), `max_tokens`, `temperature` 0, `stream`, `stream_options.include_usage`; the extra
fields `ignore_eos`, `min_tokens` and `stream_options.continuous_usage_stats` (vLLM and SGLang
accept them; OpenAI itself does not, and an endpoint that refuses them is retried without);
`usage.prompt_tokens` and `usage.completion_tokens` (in the last stream chunk when streaming); GET
/v1/models `data[0].id` and `max_model_len` (else pass --max-context). Prompt lengths are hit by
calibrating characters per token against `usage.prompt_tokens`; the lengths actually used are
reported.

Chunk token counts: a speculative server sends several tokens per chunk. With vLLM's
`continuous_usage_stats` (the embedded server's too) the count per chunk is known; without it,
each chunk is taken to hold completion_tokens / chunks. ITL is the gap between content chunks.

Metrics (`METRIC_SETS`): "kdlib" (the embedded server: kdlib_spec_accept_length and
kdlib_step_seconds histograms: accepted length and step time measured inside the engine);
"vllm" (`vllm:spec_decode_num_accepted_tokens_total` / `vllm:spec_decode_num_drafts_total`:
accepted length = 1 + accepted / drafts; vLLM exports no step time, so no prediction);
anything else: no decomposition (reported as unavailable).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import shlex
import socket
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

import kdlib
from kdlib.cli import Parser, Terminated, fail, interrupted_code, positive_float, sigterm_as_interrupt
from kdlib.files import atomic_write_text, check_folder

NONCE_DIGITS = 8  # the fresh first line of a prompt a prefix cache must not hold (make_prompt)
SHORT, LONG = 8, 264  # the seeds' two points: 256 decode tokens apart
SUSTAINED_TOKENS = 1500  # the seeds' reproduction: a 1,500-token continuous generation
SWEEP_START = 64  # the seeds' sweep started at 64 tokens of context
DECOMPOSE_TOLERANCE = 0.10  # the decomposition "explains" a measured rate when within 10%
METRIC_SETS = {
    "kdlib": {"accept_sum": "kdlib_spec_accept_length_sum", "accept_count": "kdlib_spec_accept_length_count",
              "step_sum_s": "kdlib_step_seconds_sum", "step_count": "kdlib_step_seconds_count"},
    "vllm": {"accepted": "vllm:spec_decode_num_accepted_tokens_total",
             "drafts": "vllm:spec_decode_num_drafts_total"},
}
# beyond OpenAI's API (vLLM's, SGLang's)
EXTRA_FIELDS = ("ignore_eos", "min_tokens", "continuous_usage_stats")
CONCURRENCY = (1, 2, 4, 8, 16)  # the load mode's default levels
PERCENTILES = (50, 90, 99)


class DiagnoseError(RuntimeError):
    """The endpoint answered something the diagnosis cannot use (an HTTP error, a missing field)."""


# what parsing a reply the endpoint malformed raises (json.JSONDecodeError is a ValueError)
MALFORMED = (ValueError, TypeError, AttributeError, KeyError)


@dataclass
class Completion:
    """One request as the client saw it. Times in seconds (perf_counter differences).

    decode_tokens / decode_s: tokens after the first chunk and the time from first to last chunk;
    itl_s: the gaps between content chunks (streaming only). ddtree: the server's per-choice
    DDTree stats when it returns them.
    """

    text: str
    prompt_tokens: int
    completion_tokens: int
    requested: int
    elapsed_s: float
    ttft_s: float | None = None
    decode_tokens: float | None = None
    decode_s: float | None = None
    chunks: int = 0
    ddtree: dict | None = None
    finish_reason: str | None = None
    itl_s: list[float] | None = None

    @property
    def early_stop(self) -> bool:
        return self.completion_tokens < self.requested




# ----------------------------------------------------------------------------- clients
def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {sample name: value summed over label sets}, through
    `prometheus_client.parser` (histogram buckets and `_created` samples left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def split_base_url(url: str) -> tuple[str, str]:
    """A server's root and its OpenAI base: 'http://h:1/v1/' and 'http://h:1' both give
    ('http://h:1', 'http://h:1/v1')."""
    root = url.strip().rstrip("/")
    if root.endswith("/v1"):
        root = root[:-3]
    return root, root + "/v1"


class _Chunks:
    """What a client sees of one streamed completion: text, and per content chunk its arrival time
    and the completion tokens so far (from vLLM's `continuous_usage_stats`, else None)."""

    def __init__(self, t0: float, on_tokens=None):
        self.t0, self.on_tokens = t0, on_tokens
        self.text: list[str] = []
        self.times: list[float] = []
        self.counts: list[int | None] = []
        self.usage = self.ddtree = self.finish_reason = None

    def add(self, chunk, now: float) -> None:
        u = chunk.usage
        if u is not None:
            self.usage = u
        for ch in chunk.choices or ():
            extra = ch.model_extra or {}
            if extra.get("ddtree"):
                self.ddtree = extra["ddtree"]
            if ch.finish_reason:
                self.finish_reason = ch.finish_reason
            piece = ch.text or ""
            n = u.completion_tokens if u is not None else None
            if piece or (n and (not self.counts or n != self.counts[-1])):
                self.text.append(piece)
                self.times.append(now)
                self.counts.append(n)
                if self.on_tokens:
                    self.on_tokens(n if n is not None else len(self.counts))

    def result(self, requested: int, elapsed: float) -> Completion:
        if self.usage is None:
            raise DiagnoseError("the stream carried no usage (stream_options.include_usage unsupported?)")
        n = int(self.usage.completion_tokens)
        c = Completion("".join(self.text), int(self.usage.prompt_tokens or 0), n, requested, elapsed,
                       chunks=len(self.times), ddtree=self.ddtree, finish_reason=self.finish_reason)
        if self.times:
            c.ttft_s = self.times[0] - self.t0
            first = self.counts[0] if self.counts[0] is not None else n / len(self.times)
            c.decode_tokens, c.decode_s = n - first, self.times[-1] - self.times[0]
            c.itl_s = [b - a for a, b in zip(self.times, self.times[1:], strict=False)]
        return c


def _http_client(asynchronous: bool):
    """openai's default HTTP client with TCP_NODELAY on its sockets: without it a request's body,
    written after its headers, could wait ~40 ms for the server's delayed ACK (Nagle's algorithm;
    seen on the first request of a new connection), and that lands in TTFT. The transport comes
    from the httpx flavour the openai package uses."""
    import openai

    base = openai.DefaultAsyncHttpxClient if asynchronous else openai.DefaultHttpxClient
    httpx_base = next(c for c in base.__mro__[1:] if c.__name__.endswith("Client"))
    hx = sys.modules[httpx_base.__module__.split(".")[0]]
    transport = hx.AsyncHTTPTransport if asynchronous else hx.HTTPTransport
    return base(transport=transport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
                                    limits=hx.Limits(max_connections=1000, max_keepalive_connections=100)))


def _status_error(e) -> DiagnoseError:
    err = DiagnoseError(f"POST /v1/completions: HTTP {e.status_code}: {str(e)[:300]}")
    err.status = e.status_code
    return err


def _refuses_extras(e: DiagnoseError) -> bool:
    return getattr(e, "status", 0) == 400 and any(k in str(e) for k in EXTRA_FIELDS)


class OpenAIClient:
    """A client of any OpenAI-compatible endpoint, through the official `openai` package.

    base_url: the server's root or its /v1 base. Requests are greedy completions that ask for
    exactly max_tokens (`ignore_eos`, `min_tokens`; dropped for good if the endpoint refuses them)
    and, when streaming, for usage in every chunk. No retries: a failure is a finding.
    """

    def __init__(self, base_url: str, model: str | None = None, *, timeout: float = 900.0,
                 api_key: str | None = None, metric_set: str = "auto"):
        import httpx
        import openai

        self.root, self.base_url = split_base_url(base_url)
        self.api_key = api_key or "-"  # the openai client insists on one; open endpoints ignore it
        self.timeout = timeout
        self._oa = openai.OpenAI(base_url=self.base_url, api_key=self.api_key, timeout=timeout, max_retries=0,
                                 http_client=_http_client(False))
        self._http = httpx.Client(timeout=30.0)
        self.extras = True  # ignore_eos / min_tokens / continuous_usage_stats until the endpoint refuses them
        info = self.model_info(model)
        self.model = info["id"]
        self.max_context = info.get("max_model_len")
        self.info = info
        self.metric_set = metric_set

    def close(self) -> None:
        self._oa.close()
        self._http.close()

    def model_info(self, model: str | None = None) -> dict:
        import openai

        try:
            data = [m.model_dump() for m in self._oa.models.list().data]
        except openai.APIConnectionError as e:
            raise DiagnoseError(f"cannot reach {self.base_url}: {e.__cause__ or e}") from None
        except openai.APIStatusError as e:
            hint = " (pass --api-key, or set OPENAI_API_KEY)" if e.status_code == 401 else ""
            raise DiagnoseError(f"GET /v1/models: HTTP {e.status_code}: {str(e)[:200]}{hint}") from None
        if not data:
            raise DiagnoseError("GET /v1/models lists no model")
        if model is None:
            return data[0]
        for d in data:
            if d.get("id") == model:
                return d
        raise DiagnoseError(f"model {model!r} not served here; the endpoint lists "
                            f"{[d.get('id') for d in data]}")

    def metrics(self) -> dict[str, float] | None:
        """Parsed /metrics, or None when the endpoint has none."""
        try:
            r = self._http.get(self.root + "/metrics")
        except Exception:  # noqa: BLE001 - no metrics endpoint is a normal case
            return None
        if r.status_code != 200:
            return None
        try:
            return parse_metrics(r.text)
        except ValueError:  # a 200 that is not Prometheus text (a gateway's page): no metrics either
            return None

    def request_kwargs(self, prompt: str, max_tokens: int, stream: bool) -> dict:
        """The arguments of one greedy completion (shared with the load mode's async client)."""
        kw = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
              "stream": stream}
        if stream:
            kw["stream_options"] = {"include_usage": True,
                                    **({"continuous_usage_stats": True} if self.extras else {})}
        if self.extras:
            kw["extra_body"] = {"ignore_eos": True, "min_tokens": max_tokens}
        return kw

    def complete(self, prompt: str, max_tokens: int, *, stream: bool = False, on_tokens=None) -> Completion:
        """One greedy completion; raises DiagnoseError on an HTTP error. `on_tokens(n)`: called per
        streamed chunk with the completion tokens so far (the chunk count when the server sends no
        running usage)."""
        for attempt in range(2):
            try:
                return self._complete(prompt, max_tokens, stream, on_tokens)
            except DiagnoseError as e:
                if attempt == 0 and self.extras and _refuses_extras(e):
                    self.extras = False  # an endpoint that refuses the extra fields: go without them
                    continue
                raise
        raise AssertionError("unreachable")

    def _complete(self, prompt, max_tokens, stream, on_tokens) -> Completion:
        import openai

        t0 = time.perf_counter()
        try:
            r = self._oa.completions.create(**self.request_kwargs(prompt, max_tokens, stream))
            if not stream:
                elapsed = time.perf_counter() - t0
                if r.usage is None:
                    raise DiagnoseError("the reply has no usage.completion_tokens")
                ch = r.choices[0]
                return Completion(ch.text or "", int(r.usage.prompt_tokens or 0),
                                  int(r.usage.completion_tokens), max_tokens, elapsed,
                                  ddtree=(ch.model_extra or {}).get("ddtree"),
                                  finish_reason=ch.finish_reason)
            acc = _Chunks(t0, on_tokens)
            for chunk in r:
                now = time.perf_counter()
                if now - t0 > self.timeout:  # httpx's timeout bounds each read, not the whole stream
                    r.close()
                    raise DiagnoseError(f"POST /v1/completions: no complete reply within {self.timeout:g} s")
                acc.add(chunk, now)
            return acc.result(max_tokens, time.perf_counter() - t0)
        except openai.APIStatusError as e:
            raise _status_error(e) from None
        except openai.APIError as e:  # connection errors, and an error event inside the stream
            raise DiagnoseError(f"POST /v1/completions failed: {type(e).__name__}: {e}") from None
        except MALFORMED as e:  # a reply the client could not parse (a bad stream event, say)
            raise DiagnoseError(f"POST /v1/completions: a malformed reply: {type(e).__name__}: {e}") from None


class EngineClient:
    """The same interface over a `kdlib.serve.Engine` in this process (no HTTP; works without FastAPI)."""

    metric_set = "engine"

    def __init__(self, engine):
        self.engine = engine
        self.model = engine.name
        self.max_context = engine.max_context
        self.info = {"id": engine.name, "max_model_len": engine.max_context, "kdlib": engine.info()}

    def close(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return self.engine.snapshot()

    def prompt_tokens(self, prompt: str) -> int:
        return len(self.engine.bundle.tokenizer.encode(prompt))

    def complete(self, prompt: str, max_tokens: int, *, stream: bool = False, on_tokens=None) -> Completion:
        from kdlib.engine.batch import SamplingParams

        ids = self.engine.bundle.tokenizer.encode(prompt)
        deltas = []  # (cumulative tokens, time) per step that emitted tokens, from the engine's thread

        def listen(ev):
            if ev[0] == "delta" and ev[1].token_ids:
                deltas.append((ev[1].completion_tokens, ev[1].t))
                if on_tokens:
                    on_tokens(ev[1].completion_tokens)

        t0 = time.perf_counter()
        res = self.engine.run(ids, max_tokens, SamplingParams(ignore_eos=True), listener=listen)
        elapsed = time.perf_counter() - t0
        c = Completion(res["text"], res["prompt_tokens"], len(res["tokens"]), max_tokens, elapsed,
                       chunks=len(deltas), ddtree=res["ddtree"], finish_reason=res["finish_reason"])
        if stream and deltas:
            c.ttft_s = deltas[0][1] - t0
            c.decode_tokens, c.decode_s = c.completion_tokens - deltas[0][0], deltas[-1][1] - deltas[0][1]
            c.itl_s = [b[1] - a[1] for a, b in zip(deltas, deltas[1:], strict=False)]
        return c


# ----------------------------------------------------------------------------- prompts
def source_text(kind: str | None = None, folder=None) -> str:
    """Text to cut prompts from: held-out documents of `kind` (kdlib.zoo, models in `folder`) when
    the trained models are present, else Python's own documentation topics (`pydoc_data.topics`)."""
    if kind is not None:
        from kdlib import zoo

        if zoo.available(folder):
            return "\n\n".join(zoo.held_out(kind, folder))
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def make_prompt(client, tokens: int, text: str | None = None, *, fresh: bool = False) -> tuple[str, int]:
    """A prefix of `text` of about `tokens` prompt tokens on this endpoint: (prompt, its token count).

    Calibrates characters per token with the endpoint's own count (usage.prompt_tokens of a
    1-token request, or the in-process tokenizer), up to three rounds; a candidate the endpoint refuses
    (HTTP 400: longer than its context) shrinks by a tenth. fresh: the prompt opens with a line of
    NONCE_DIGITS random digits that no calibration request sent (they send others of the same length),
    so a prefix cache (vLLM's, SGLang's radix cache) holds none of it: its prefill is measured.
    """
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    text = text if text is not None else source_text()

    def head() -> str:
        return "".join(secrets.choice("123456789") for _ in range(NONCE_DIGITS)) + "\n" if fresh else ""

    def count(p):
        """The tokens of p; None when the endpoint refuses p as too long."""
        try:
            if hasattr(client, "prompt_tokens"):
                return client.prompt_tokens(head() + p)
            return client.complete(head() + p, 1).prompt_tokens
        except DiagnoseError as e:
            if getattr(e, "status", None) == 400 and len(p) > probe:
                return None
            raise

    probe = 256  # characters: a short first probe (fits any context) measures characters per token
    while len(text) < probe:
        text = text + "\n\n" + text
    chars = max(1, int(tokens * probe / max(1, count(text[:probe]))))
    n, rounds = None, 0
    while rounds < 3:
        while len(text) < chars:
            text = text + "\n\n" + text
        got = count(text[:chars])
        if got is None:  # over the context: shrink, not a round
            chars = max(1, int(chars * 0.9))
            continue
        n, rounds = got, rounds + 1
        if n == tokens or n == 0:
            break
        chars = max(1, int(chars * tokens / n))
    while (n is None or n > tokens) and chars > 1:  # never over: the caller sized prompt + max_tokens
        chars = max(1, int(chars * 0.97))
        n = count(text[:chars])
    return head() + text[:chars], n


# ----------------------------------------------------------------------------- measurements
def decompose(before: dict | None, after: dict | None, measured_tok_s: float | None = None,
              metric_set: str = "kdlib") -> dict:
    """Mean accepted length and step time between two metric snapshots, and the tok/s they predict.

    `metric_set`: "kdlib" (Prometheus names of the embedded server), "engine" (EngineClient
    snapshots: the same totals unprefixed), "vllm" (accepted length only). Returns
    {available, accepted_length, step_ms, predicted_tok_s, measured_tok_s, ratio, within_tolerance}
    and, for kdlib / engine, steps (request steps), engine_steps, batch (request steps per engine
    step) and predicted_aggregate_tok_s (accepted_length x batch / step time). predicted_tok_s is
    one stream's rate, what `measured_tok_s` (one stream's) is compared with.
    """
    out = {"available": False, "metric_set": metric_set, "accepted_length": None, "step_ms": None,
           "predicted_tok_s": None, "measured_tok_s": measured_tok_s, "ratio": None, "within_tolerance": None}
    if before is None or after is None:
        out["why"] = "the endpoint exposes no metrics"
        return out

    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    if metric_set in ("kdlib", "engine"):
        names = METRIC_SETS["kdlib"] if metric_set == "kdlib" else {k: k for k in METRIC_SETS["kdlib"]}
        steps = delta(names["accept_count"])
        if steps <= 0:
            out["why"] = "no decode steps between the snapshots"
            return out
        if delta(names["step_count"]) <= 0 or delta(names["step_sum_s"]) <= 0:
            out["why"] = "no engine step time between the snapshots"
            return out
        out["accepted_length"] = delta(names["accept_sum"]) / steps
        out["step_ms"] = delta(names["step_sum_s"]) / delta(names["step_count"]) * 1e3
        out["predicted_tok_s"] = out["accepted_length"] / (out["step_ms"] / 1e3)
        out["steps"] = steps
        out["engine_steps"] = delta(names["step_count"])
        out["batch"] = steps / out["engine_steps"]
        out["predicted_aggregate_tok_s"] = delta(names["accept_sum"]) / delta(names["step_sum_s"])
        out["available"] = True
    elif metric_set == "vllm":
        names = METRIC_SETS["vllm"]
        drafts = delta(names["drafts"])
        if drafts > 0:
            out["accepted_length"] = 1.0 + delta(names["accepted"]) / drafts
        out["why"] = "vLLM exports no step time: accepted length only"
        return out
    else:
        out["why"] = f"no metric names known for {metric_set!r}"
        return out
    if measured_tok_s:
        out["ratio"] = measured_tok_s / out["predicted_tok_s"]
        out["within_tolerance"] = abs(out["ratio"] - 1.0) <= DECOMPOSE_TOLERANCE
    return out


def _metric_set(client, snapshot) -> str:
    ms = getattr(client, "metric_set", "auto")
    if ms != "auto":
        return ms
    if snapshot is None:
        return "none"
    if any(k.startswith("kdlib_") for k in snapshot):
        return "kdlib"
    if any(k.startswith("vllm:") for k in snapshot):
        return "vllm"
    return "none"


def two_point(client, prompt: str, *, short: int = SHORT, long: int = LONG, repeats: int = 3,
              stream: bool = False) -> dict:
    """The seeds' two-point decode rate on one prompt: (n_long - n_short) / (t_long - t_short).

    Requests alternate short, long (`repeats` pairs, after one untimed pair as warm-up); medians
    of the times are used. Metric snapshots bracket every request, and `decompose` reads the long
    requests' counters less the short ones': the steps past the short request's tokens, the ones the
    rate counts (the short request's prefill and first steps cancel from both).
    """
    if not 1 <= short < long:
        raise ValueError(f"need 1 <= short < long, got short={short}, long={long}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    client.complete(prompt, short, stream=stream)  # the untimed warm-up pair
    client.complete(prompt, long, stream=stream)
    ts, tl, ns, nl, pt = [], [], [], [], None
    first = client.metrics()
    snaps = [first]
    diff: dict[str, float] | None = {} if first is not None else None  # long requests' counters less short's
    for _ in range(repeats):
        s = client.complete(prompt, short, stream=stream)
        snaps.append(client.metrics())
        lo = client.complete(prompt, long, stream=stream)
        snaps.append(client.metrics())
        ts.append(s.elapsed_s)
        tl.append(lo.elapsed_s)
        ns.append(s.completion_tokens)
        nl.append(lo.completion_tokens)
        pt = lo.prompt_tokens
        m0, m1, m2 = snaps[-3:]
        if diff is not None and m1 is not None and m2 is not None:
            for key in m2:
                long_d, short_d = m2[key] - m1.get(key, 0.0), m1.get(key, 0.0) - m0.get(key, 0.0)
                diff[key] = diff.get(key, 0.0) + long_d - short_d
        else:
            diff = None
    t_s, t_l = statistics.median(ts), statistics.median(tl)
    n_s, n_l = statistics.median(ns), statistics.median(nl)
    early = any(n < short for n in ns) or any(n < long for n in nl)
    rate = (n_l - n_s) / (t_l - t_s) if t_l > t_s and n_l > n_s else None
    res = {"prompt_tokens": pt, "short": short, "long": long, "repeats": repeats, "t_short_s": t_s,
           "t_long_s": t_l, "completion_short": n_s, "completion_long": n_l, "early_stop": early,
           "tokens_per_s": rate,
           "nominal_tokens_per_s": (long - short) / (t_l - t_s) if t_l > t_s else None}
    if early:
        res["warning"] = (f"the endpoint stopped early (completion tokens {ns} / {nl} for max_tokens "
                          f"{short} / {long}); the rate uses the tokens actually returned")
    res["decomposition"] = decompose({} if diff is not None else None, diff, rate, _metric_set(client, first))
    res["decomposition"]["over"] = "long requests less short ones"
    return res


def context_sweep(client, *, lengths: list[int] | None = None, max_context: int | None = None,
                  text: str | None = None, repeats: int = 2, long: int = LONG,
                  progress: bool = True) -> list[dict]:
    """Two-point at prompt lengths 64, 128, ... (doubling, each with prompt + long inside the context)."""
    limit = max_context or client.max_context
    if lengths is None:
        if not limit:
            raise ValueError("the endpoint reports no max_model_len: pass max_context")
        lengths, n = [], SWEEP_START
        while n + long + 8 <= limit:  # 8: room for calibration overshoot of the prompt length
            lengths.append(n)
            n *= 2
        if limit - long - 8 > (lengths[-1] if lengths else 0):
            lengths.append(limit - long - 8)  # the model's limit itself
    text = text if text is not None else source_text()
    rows = []
    for n in _progress(lengths, desc="context sweep", unit="point", disable=not progress):
        prompt, actual = make_prompt(client, n, text)
        rows.append({"target_prompt_tokens": n, **two_point(client, prompt, long=long, repeats=repeats)})
        rows[-1]["prompt_tokens"] = actual
    return rows


class _NoBar:
    """Stands in for tqdm where it is not installed."""

    n = 0

    def __init__(self, iterable=None, **kw):
        self._it = iterable

    def __iter__(self):
        return iter(self._it)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, k=1):
        self.n += k


def _progress(iterable=None, **kw):
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar(iterable, **kw)
    return tqdm(iterable, **kw)


def sustained(client, prompt: str, max_tokens: int = SUSTAINED_TOKENS, *, progress: bool = True) -> dict:
    """One long streamed generation: TTFT, decode tok/s (first to last chunk), end-to-end tok/s,
    and the decomposition over its steps."""
    before = client.metrics()
    with _progress(total=max_tokens, desc=f"sustained {max_tokens} tokens", unit="tok",
                   disable=not progress) as bar:
        def advance(n):
            bar.update(n - bar.n)

        c = client.complete(prompt, max_tokens, stream=True, on_tokens=advance)
        advance(c.completion_tokens)
    after = client.metrics()
    rate = c.decode_tokens / c.decode_s if c.decode_s else None
    res = {"prompt_tokens": c.prompt_tokens, "max_tokens": max_tokens,
           "completion_tokens": c.completion_tokens, "early_stop": c.early_stop, "ttft_s": c.ttft_s,
           "elapsed_s": c.elapsed_s, "decode_tokens_per_s": rate,
           "end_to_end_tokens_per_s": c.completion_tokens / c.elapsed_s, "chunks": c.chunks,
           "decomposition": decompose(before, after, rate, _metric_set(client, before))}
    if c.ddtree:
        res["per_step"] = {"accepted": c.ddtree.get("accepted"), "step_ms": c.ddtree.get("step_ms")}
    return res


def diagnose(client, *, sweep: bool = True, sustained_tokens: int = SUSTAINED_TOKENS,
             sustained_prompt: int = 512, max_context: int | None = None, repeats: int = 2,
             text: str | None = None, progress: bool = True) -> dict:
    """Everything: two-point at 64 tokens, the sweep, and the sustained run (its prompt fresh to any
    prefix cache, so its TTFT holds the prefill). A JSON-ready dict with the parameters it ran with."""
    text = text if text is not None else source_text()
    limit = max_context or client.max_context
    if sweep and not limit:
        raise ValueError("the endpoint reports no max_model_len: give the context limit "
                         "(max_context; kdlib diagnose --max-context)")
    if limit and SWEEP_START + LONG + 8 > limit:
        raise ValueError(f"a context of {limit} tokens is too short for the two-point method "
                         f"({SWEEP_START} prompt + {LONG} generated + 8 tokens)")
    out = {"endpoint": getattr(client, "base_url", "in-process engine"), "model": client.model,
           "model_info": client.info, "max_context": limit,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "kdlib": kdlib.__version__,
           "parameters": {"sweep": sweep, "sustained_tokens": sustained_tokens,
                          "sustained_prompt": sustained_prompt, "repeats": repeats,
                          "metric_set": getattr(client, "metric_set", None)}}
    prompt, _ = make_prompt(client, SWEEP_START, text)
    out["two_point"] = two_point(client, prompt, repeats=repeats)
    if sweep:
        out["sweep"] = context_sweep(client, max_context=limit, text=text, repeats=repeats, progress=progress)
    if sustained_tokens:
        if limit:
            # leave a prompt of >= 16 tokens inside the context
            sustained_tokens = min(sustained_tokens, limit - 16)
            sustained_prompt = max(8, min(sustained_prompt, limit - sustained_tokens - 8))
        p, _ = make_prompt(client, sustained_prompt, text, fresh=True)
        out["sustained"] = sustained(client, p, sustained_tokens, progress=progress)
    return out


def kinds_available(folder=None) -> tuple[str, ...]:
    """Text kinds to measure: kdlib.zoo's held-out kinds with the trained models, else ("pydoc",)."""
    from kdlib import zoo

    return zoo.KINDS if zoo.available(folder) else ("pydoc",)


def kind_text(kind: str, folder=None) -> str:
    """The text of one kind: held-out documents (kdlib.zoo) or, for "pydoc", `source_text()`."""
    return source_text() if kind == "pydoc" else source_text(kind, folder)


def study(client, *, kinds=None, prompt_tokens: int = 256, sustained_tokens: int = 300, short: int = SHORT,
          long: int = LONG, repeats: int = 1, sweep_max: int | None = None, sweep_kind: str | None = None,
          progress: bool = False, models=None) -> dict:
    """What notebook 04 and the `diagnosis` suite measure, on one client (`models`: the trained
    models' folder, for the held-out text; default data/models/).

    sweep     two-point at prompt lengths 64, 128, ... up to min(sweep_max, the context) on
              `sweep_kind` text (default the first kind), each with its decomposition;
    by_kind   per text kind, on a `prompt_tokens` prompt of that kind: the two-point rate and a
              sustained streamed run of `sustained_tokens` (TTFT, decode tok/s, per-step accepted
              lengths and step ms, decomposition).
    """
    # the embedded server's random model
    fallback = (client.info.get("kdlib") or {}).get("source") == "random"
    kinds = tuple(kinds) if kinds is not None else (("pydoc",) if fallback else kinds_available(models))
    limit = client.max_context
    room = limit - max(long, sustained_tokens) - 8
    if room < 16:
        raise ValueError(f"the context ({limit}) leaves no room for a prompt next to "
                         f"{max(long, sustained_tokens)} generated tokens")
    prompt_tokens = min(prompt_tokens, room)
    lengths, n = [], SWEEP_START
    while n + long + 8 <= limit and (sweep_max is None or n <= sweep_max):
        lengths.append(n)
        n *= 2
    sweep = context_sweep(client, lengths=lengths, text=kind_text(sweep_kind or kinds[0], models),
                          repeats=repeats, long=long, progress=progress) if lengths else []
    rows = {}
    for kind in kinds:
        prompt, actual = make_prompt(client, prompt_tokens, kind_text(kind, models))
        tp = two_point(client, prompt, short=short, long=long, repeats=repeats)
        su = sustained(client, prompt, sustained_tokens, progress=progress)
        rows[kind] = {"prompt_tokens": actual, "two_point": tp, "sustained": su}
    return {"model": client.model, "model_info": client.info, "max_context": limit,
            "parameters": {"kinds": list(kinds), "prompt_tokens": prompt_tokens,
                           "sustained_tokens": sustained_tokens, "short": short, "long": long,
                           "repeats": repeats, "sweep_max": sweep_max},
            "sweep": sweep, "by_kind": rows}


# The seeds' own figures (seeds/002 Act I; seeds/000 Thread Two), to check their arithmetic.
SEED_FIGURES = {
    "accepted_per_step": 2.9,  # tokens per step on reasoning text
    "step_ms": 144.0,  # verify step at ~5.5k context
    "step_ms_short": 34.0,  # verify step at 13 tokens of context
    "step_ctx_short": 13,
    "step_ctx_long": 5500,
    "observed_tok_s": 32.0,  # the user's sustained figure (their repro: 32.7)
    "sustained_prompt": 3200,  # the repro: ~3,200-token prompt, 1,500 tokens generated
    "sustained_tokens": 1500,
    "two_point_5k_tok_s": 66.8,  # two-point at 5,120 tokens of context
    "two_point_ctx": 5120,
}


def seed_arithmetic(f: dict = SEED_FIGURES) -> dict:
    """What the seeds' figures imply when multiplied out (throughput = accepted length / step time).

    product_tok_s          2.9 / 0.144 s: the rate their accepted length and step time give
    implied_accept         the accepted length 32 t/s needs at a 144 ms step
    implied_step_ms        the step time 32 t/s needs at 2.9 tokens per step
    linear_step_ms_mean    the mean step over the repro's contexts (3.2k -> 4.7k), interpolating the
                           seeds' two step times (34 ms at 13 tokens, 144 ms at 5.5k) linearly
    linear_product_tok_s   2.9 / that mean step
    two_point_implied_accept  tokens per step the two-point 66.8 t/s at 5,120 implies at the
                           interpolated step time there
    """
    slope = (f["step_ms"] - f["step_ms_short"]) / (f["step_ctx_long"] - f["step_ctx_short"])

    def step_at(ctx):
        return f["step_ms_short"] + slope * (ctx - f["step_ctx_short"])

    mean_step = (step_at(f["sustained_prompt"]) + step_at(f["sustained_prompt"] + f["sustained_tokens"])) / 2
    return {
        "product_tok_s": f["accepted_per_step"] / (f["step_ms"] / 1e3),
        "implied_accept": f["observed_tok_s"] * f["step_ms"] / 1e3,
        "implied_step_ms": f["accepted_per_step"] / f["observed_tok_s"] * 1e3,
        "linear_step_ms_mean": mean_step,
        "linear_product_tok_s": f["accepted_per_step"] / (mean_step / 1e3),
        "two_point_implied_accept": f["two_point_5k_tok_s"] * step_at(f["two_point_ctx"]) / 1e3,
        "observed_over_product": f["observed_tok_s"] / (f["accepted_per_step"] / (f["step_ms"] / 1e3)),
    }


def _fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def table(result: dict) -> str:
    """A plain-text table of a `diagnose` result."""
    lines = [f"endpoint {result['endpoint']}  model {result['model']}  max context {result['max_context']}",
             ""]
    lines.append(f"{'measurement':<28}{'prompt tok':>11}{'tok/s':>10}{'accepted':>10}{'step ms':>10}"
                 f"{'predicted':>11}{'meas/pred':>10}")

    def row(name, r, rate_key):
        d = r.get("decomposition") or {}
        flag = " EARLY STOP" if r.get("early_stop") else ""
        prompt_tokens = _fmt(r.get("prompt_tokens"), "d") if r.get("prompt_tokens") is not None else "-"
        lines.append(f"{name:<28}{prompt_tokens:>11}"
                     f"{_fmt(r.get(rate_key)):>10}{_fmt(d.get('accepted_length'), '.2f'):>10}"
                     f"{_fmt(d.get('step_ms'), '.2f'):>10}{_fmt(d.get('predicted_tok_s')):>11}"
                     f"{_fmt(d.get('ratio'), '.3f'):>10}{flag}")

    row("two-point", result["two_point"], "tokens_per_s")
    for r in result.get("sweep", []):
        row(f"  sweep {r['target_prompt_tokens']}", r, "tokens_per_s")
    if "sustained" in result:
        s = result["sustained"]
        row(f"sustained {s['max_tokens']} (decode)", s, "decode_tokens_per_s")
        lines.append(f"{'':<28}TTFT {_fmt(s['ttft_s'], '.3f')} s, "
                     f"end-to-end {_fmt(s['end_to_end_tokens_per_s'])} tok/s")
    return "\n".join(lines)


def _strict(o):
    """o with every non-finite float as JSON has none: NaN -> null, +-inf -> "inf" / "-inf" (a request rate
    of inf: all at once)."""
    if isinstance(o, dict):
        return {k: _strict(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_strict(v) for v in o]
    if isinstance(o, float | np.floating) and not math.isfinite(o):
        return None if math.isnan(o) else ("inf" if o > 0 else "-inf")
    return o


def write_json(result: dict, path) -> None:
    """Atomic write (`kdlib.files.atomic_write_text`) of strict JSON (`_strict`)."""
    atomic_write_text(path, json.dumps(_strict(result), indent=1, default=float, allow_nan=False) + "\n")


# ----------------------------------------------------------------------------- load mode
def prompt_pool(client, n: int, tokens: int, text: str | None = None) -> list[str]:
    """n distinct prompts of at most `tokens` tokens each (about as many): each a `make_prompt` over its
    own evenly spaced part of `text`, so a denser part gets a shorter slice, not one past the context."""
    text = text if text is not None else source_text()
    first, _ = make_prompt(client, tokens, text)
    chars = len(first)
    while len(text) < chars * (n + 1):
        text = text + "\n\n" + text
    stride = (len(text) - chars) // n
    return [first] + [make_prompt(client, tokens, text[i * stride:])[0] for i in range(1, n)]


def _spread(values: list[float]) -> dict:
    """mean, std (sample), min, max and n of a figure over repeats."""
    v = [float(x) for x in values if x is not None]
    if not v:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0, "min": min(v),
            "max": max(v), "n": len(v)}


def _percentiles(values: list[float]) -> dict:
    """mean and the PERCENTILES of `values` (None each when empty)."""
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in PERCENTILES}}


def _flatten(d: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = v
    return out


async def _one_request(aoa, kw: dict, rec: dict, timeout: float) -> None:
    """One streamed completion into `rec` (its start time already set): ok, ttft_s, itl_s, e2e_s,
    output/prompt tokens and text, or ok False with the error (also a malformed reply, or none complete
    within `timeout` seconds)."""
    import openai

    acc = _Chunks(rec["start"])

    async def read():
        stream = await aoa.completions.create(**kw)
        async for chunk in stream:
            acc.add(chunk, time.perf_counter())

    try:
        await asyncio.wait_for(read(), timeout)
        c = acc.result(kw["max_tokens"], time.perf_counter() - rec["start"])
    except TimeoutError:
        rec.update(ok=False, end=time.perf_counter(), error=f"no complete reply within {timeout:g} s")
        return
    except (openai.APIError, DiagnoseError, *MALFORMED) as e:
        rec.update(ok=False, end=time.perf_counter(), error=f"{type(e).__name__}: {e}"[:300])
        return
    rec.update(ok=True, end=rec["start"] + c.elapsed_s, ttft_s=c.ttft_s, e2e_s=c.elapsed_s,
               itl_s=c.itl_s or [], output_tokens=c.completion_tokens, prompt_tokens=c.prompt_tokens,
               text=c.text)


async def _load_run(client, prompts: list[str], order: list[int], output_len: int, *, concurrency: int | None,
                    rate: float | None, seed: int) -> list[dict]:
    """Send one request per entry of `order` (an index into prompts): at most `concurrency` in flight,
    arrivals a Poisson process of `rate` per second when given (inf: all at once)."""
    import openai

    aoa = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, timeout=client.timeout,
                             max_retries=0, http_client=_http_client(True))
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    recs = [{"prompt": i} for i in order]
    gaps = (np.random.default_rng(seed).exponential(1.0 / rate, len(order)) if rate and math.isfinite(rate)
            else None)

    async def run(rec):
        kw = client.request_kwargs(prompts[rec["prompt"]], output_len, True)
        if gate is None:
            rec["start"] = time.perf_counter()
            return await _one_request(aoa, kw, rec, client.timeout)
        async with gate:
            rec["start"] = time.perf_counter()
            await _one_request(aoa, kw, rec, client.timeout)

    try:
        tasks = []
        for k, rec in enumerate(recs):
            if gaps is not None and k:
                await asyncio.sleep(gaps[k])
            tasks.append(asyncio.ensure_future(run(rec)))
        await asyncio.gather(*tasks)
    finally:
        await aoa.close()
    return recs


def _summarise(recs: list[dict], requested: int, reference: list[str] | None, slo: dict | None,
               decomposition: dict) -> dict:
    ok = [r for r in recs if r["ok"]]
    t0 = min(r["start"] for r in recs)
    duration = max(r["end"] for r in recs) - t0
    out_tokens = sum(r["output_tokens"] for r in ok)
    tpot = [(r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) for r in ok
            if r["output_tokens"] > 1 and r["ttft_s"] is not None]
    per_stream = [(r["output_tokens"] - 1) / (r["e2e_s"] - r["ttft_s"]) for r in ok
                  if r["output_tokens"] > 1 and r["ttft_s"] is not None and r["e2e_s"] > r["ttft_s"]]

    def good(r) -> bool:
        n = r["output_tokens"]
        got = {"ttft_ms": (r["ttft_s"] or 0) * 1e3, "e2e_ms": r["e2e_s"] * 1e3,
               "tpot_ms": ((r["e2e_s"] - r["ttft_s"]) / (n - 1) * 1e3 if n > 1 and r["ttft_s"] is not None
                           else 0.0)}
        return all(got[k] <= v for k, v in slo.items())

    res = {"requests": len(recs), "completed": len(ok), "failed": len(recs) - len(ok), "duration_s": duration,
           "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
           "total_token_throughput": (out_tokens + sum(r["prompt_tokens"] for r in ok)) / duration,
           "goodput": (sum(good(r) for r in ok) / duration) if slo else None,
           "ttft_ms": _percentiles([r["ttft_s"] * 1e3 for r in ok if r["ttft_s"] is not None]),
           "tpot_ms": _percentiles([x * 1e3 for x in tpot]),
           "itl_ms": _percentiles([x * 1e3 for r in ok for x in r["itl_s"]]),
           "e2e_ms": _percentiles([r["e2e_s"] * 1e3 for r in ok]),
           "per_stream_tok_s": statistics.fmean(per_stream) if per_stream else None,
           "early_stops": sum(r["output_tokens"] < requested for r in ok),
           "greedy_mismatches": (sum(r["text"] != reference[r["prompt"]] for r in ok) if reference is not None
                                 else None),
           "errors": sorted({r["error"] for r in recs if not r["ok"]})[:5],
           "decomposition": decomposition}
    d = decomposition
    if d.get("predicted_aggregate_tok_s"):
        d["measured_aggregate_tok_s"] = res["output_throughput"]
        d["aggregate_ratio"] = res["output_throughput"] / d["predicted_aggregate_tok_s"]
    return res


def load_test(client, *, concurrency=CONCURRENCY, rates=(), max_concurrency: int | None = None,
              num_prompts: int | None = None, distinct: int = 16, input_len: int = 128, output_len: int = 128,
              repeats: int = 3, slo: dict | None = None, check_greedy: bool = True, warmup: bool = True,
              seed: int = 0, text: str | None = None, progress: bool = True) -> dict:
    """`vllm bench serve`'s figures per level, plus the decomposition and a greedy-equality check.

    Levels: each fixed concurrency C (num_prompts requests, default 4 C, at most C in flight), then
    each request rate (Poisson arrivals; inf = all at once; at most max_concurrency in flight).
    Requests cycle through `distinct` prompts of ~input_len tokens and ask for exactly output_len
    greedy tokens. Per level: one untimed warm-up run (CUDA-graph buckets, allocator) when
    `warmup`, then `repeats` runs; each run reports TTFT / TPOT / ITL / e2e (mean, p50, p90, p99,
    ms), request, output and total throughput, goodput (requests per second meeting every target
    of `slo`, e.g. {"ttft_ms": 500, "tpot_ms": 50}), the mean per-stream decode rate, and the
    decomposition over its steps (from /metrics): accepted length per stream step x streams per
    step / step time = predicted aggregate tok/s, against the measured output throughput.
    `summary` gives every figure's spread over the repeats. check_greedy: a sequential pass over
    the prompts first gives each one's reference text; every later output is compared with it
    (`greedy_mismatches`: differing outputs; 0 means concurrency changed no greedy output).
    The prompts repeat (the reference pass, the warm-up, every level): an endpoint with a prefix cache
    (vLLM's default, SGLang's radix cache) serves their prefill from it, so TTFT here is a cached
    prefill's; run the server with the cache off (vLLM --no-enable-prefix-caching, SGLang
    --disable-radix-cache) to measure prefill under load. The decode figures do not depend on it.
    """
    if client.max_context and input_len + output_len + 16 > client.max_context:
        raise ValueError(f"input_len {input_len} + output_len {output_len} (+16) exceeds the context "
                         f"{client.max_context}")
    for name, v in (("repeats", repeats), ("distinct", distinct), ("output_len", output_len),
                    ("input_len", input_len)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if slo and set(slo) - {"ttft_ms", "tpot_ms", "e2e_ms"}:
        raise ValueError(f"slo keys are ttft_ms, tpot_ms, e2e_ms; got {sorted(slo)}")
    prompts = prompt_pool(client, distinct, input_len, text)
    out = {"endpoint": getattr(client, "base_url", None), "model": client.model, "model_info": client.info,
           "max_context": client.max_context, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "parameters": {"concurrency": list(concurrency), "rates": [float(r) for r in rates],
                          "max_concurrency": max_concurrency, "num_prompts": num_prompts,
                          "distinct": distinct, "input_len": input_len, "output_len": output_len,
                          "repeats": repeats, "slo": slo, "warmup": warmup, "seed": seed}}
    reference = None
    if check_greedy:
        t0 = time.perf_counter()
        recs = asyncio.run(_load_run(client, prompts, list(range(distinct)), output_len, concurrency=1,
                                     rate=None, seed=seed))
        bad = [r["error"] for r in recs if not r["ok"]]
        if bad:
            raise DiagnoseError(f"the sequential reference pass failed: {bad[0]}")
        reference = [r["text"] for r in recs]
        out["reference"] = {"prompts": distinct, "seconds": time.perf_counter() - t0,
                            "prompt_tokens": [r["prompt_tokens"] for r in recs]}
    levels = [("concurrency", c) for c in concurrency] + [("rate", r) for r in rates]
    out["levels"] = []
    for mode, v in _progress(levels, desc="load levels", unit="level", disable=not progress):
        c = int(v) if mode == "concurrency" else max_concurrency
        rate = float(v) if mode == "rate" else None
        n = num_prompts or (4 * int(v) if mode == "concurrency" else 4 * distinct)
        order = [k % distinct for k in range(n)]
        if warmup:
            asyncio.run(_load_run(client, prompts, order[: max(c or 1, 1)], output_len, concurrency=c,
                                  rate=None, seed=seed))
        runs = []
        for rep in range(repeats):
            before = client.metrics()
            recs = asyncio.run(_load_run(client, prompts, order, output_len, concurrency=c, rate=rate,
                                         seed=seed + rep))
            after = client.metrics()
            runs.append(_summarise(recs, output_len, reference, slo,
                                   decompose(before, after, None, _metric_set(client, before))))
        flat = [_flatten({k: v for k, v in r.items() if k != "errors"}) for r in runs]
        keys = sorted(set().union(*flat))
        out["levels"].append({"mode": mode, "concurrency": c, "request_rate": rate, "requests": n,
                              "runs": runs, "summary": {k: _spread([f.get(k) for f in flat]) for k in keys}})
    return out


CURVE_FIELDS = {  # load_curve column -> the summary key whose mean over repeats it holds
    "aggregate tok/s": "output_throughput", "per-stream tok/s": "per_stream_tok_s",
    "TTFT p50 ms": "ttft_ms.p50", "TTFT p99 ms": "ttft_ms.p99", "TPOT p50 ms": "tpot_ms.p50",
    "ITL p99 ms": "itl_ms.p99", "e2e p99 ms": "e2e_ms.p99", "accepted/step": "decomposition.accepted_length",
    "step ms": "decomposition.step_ms", "batch": "decomposition.batch",
    "measured / predicted": "decomposition.aggregate_ratio", "greedy mismatches": "greedy_mismatches",
}


def load_curve(result: dict) -> list[dict]:
    """One row per fixed-concurrency level of a `load_test` result: the means over repeats of
    CURVE_FIELDS, the aggregate's std beside it, and the greedy mismatches' maximum."""
    rows = []
    for lv in result["levels"]:
        if lv["mode"] != "concurrency":
            continue
        s = lv["summary"]
        row = {"concurrency": lv["concurrency"]}
        for col, key in CURVE_FIELDS.items():
            stat = s.get(key, {})
            row[col] = stat.get("max" if key == "greedy_mismatches" else "mean")
        row["aggregate std"] = s.get("output_throughput", {}).get("std")
        rows.append(row)
    return rows


def load_table(result: dict) -> str:
    """A plain-text table of a `load_test` result: means over repeats (± std where it matters); failed:
    the most requests of one run of the level that failed."""
    p = result["parameters"]
    lines = [f"endpoint {result['endpoint']}  model {result['model']}  input {p['input_len']} "
             f"output {p['output_len']} tokens, {p['repeats']} repeats", ""]
    lines.append(f"{'level':<10}{'req/s':>7}{'out tok/s':>16}{'tok/s/strm':>11}{'TTFT p50/p99':>15}"
                 f"{'TPOT p50/p99':>15}{'ITL p50/p99':>14}{'e2e p99':>9}{'goodput':>8}{'acc':>6}"
                 f"{'step ms':>8}{'batch':>6}{'meas/pred':>10}{'greedy':>7}{'failed':>7}")

    def m(s, k, spec=".1f"):
        v = s.get(k, {}).get("mean")
        return "-" if v is None else format(v, spec)

    for lv in result["levels"]:
        s = lv["summary"]
        name = f"C={lv['concurrency']}" if lv["mode"] == "concurrency" else f"{lv['request_rate']:g}/s"
        tput = f"{m(s, 'output_throughput')}±{_fmt(s.get('output_throughput', {}).get('std'))}"
        ratio = s.get("decomposition.aggregate_ratio", {}).get("mean")
        mism = s.get("greedy_mismatches", {}).get("max")
        lines.append(f"{name:<10}{m(s, 'request_throughput', '.2f'):>7}{tput:>16}"
                     f"{m(s, 'per_stream_tok_s'):>11}"
                     f"{m(s, 'ttft_ms.p50') + '/' + m(s, 'ttft_ms.p99'):>15}"
                     f"{m(s, 'tpot_ms.p50', '.2f') + '/' + m(s, 'tpot_ms.p99', '.2f'):>15}"
                     f"{m(s, 'itl_ms.p50', '.2f') + '/' + m(s, 'itl_ms.p99', '.2f'):>14}"
                     f"{m(s, 'e2e_ms.p99', '.0f'):>9}"
                     f"{m(s, 'goodput', '.2f'):>8}{m(s, 'decomposition.accepted_length', '.2f'):>6}"
                     f"{m(s, 'decomposition.step_ms', '.2f'):>8}{m(s, 'decomposition.batch', '.1f'):>6}"
                     f"{_fmt(ratio, '.3f'):>10}{'-' if mism is None else int(mism):>7}"
                     f"{int(s.get('failed', {}).get('max') or 0):>7}")
    return "\n".join(lines)


def _levels(text: str, what: str, *, integer: bool) -> tuple:
    """'1,2,4' -> (1, 2, 4); rates may be 'inf'; '' -> (). ValueError naming `what` otherwise."""
    try:
        vals = tuple((int(x) if integer else float(x)) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--{what}: a comma-separated list of {'integers' if integer else 'numbers'}, "
                         f"got {text!r}") from None
    if not vals and text.strip():
        raise ValueError(f"--{what}: a comma-separated list of values, got {text!r}")
    if any(not v > 0 for v in vals):
        raise ValueError(f"--{what}: every value must be > 0, got {text!r}")
    return vals


def _slo(items: list[str]) -> dict:
    """['ttft:500', 'tpot:50'] -> {'ttft_ms': 500.0, 'tpot_ms': 50.0} (vllm bench serve's --goodput form)."""
    out = {}
    for it in items:
        key, _, ms = it.partition(":")
        if key not in ("ttft", "tpot", "e2e") or not ms:
            raise ValueError(f"--goodput: items are ttft:MS, tpot:MS or e2e:MS, got {it!r}")
        try:
            out[f"{key}_ms"] = float(ms)
        except ValueError:
            raise ValueError(f"--goodput: {it!r} has no number of milliseconds") from None
        if not 0 < out[f"{key}_ms"] < math.inf:
            raise ValueError(f"--goodput: {it!r}: the milliseconds must be finite and > 0")
    return out


# the flags of one mode alone (argparse dests): the load test's, the diagnosis's
_LOAD_ONLY = ("concurrency", "request_rate", "max_concurrency", "num_prompts", "distinct_prompts",
              "input_len", "output_len", "goodput", "no_greedy_check", "seed")
_DIAGNOSE_ONLY = ("sustained_tokens", "sustained_prompt", "no_sweep")


def _endpoint(text: str) -> str:
    """--endpoint: an http(s) URL with a host (bad input, exit 2; a server that does not answer exits 1)."""
    import urllib.parse

    try:
        u = urllib.parse.urlsplit(text)
        u.port  # noqa: B018 - raises on a port past 65535 or not a number
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid URL ({e})") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL with a host")
    return text


def cli(argv: list[str]) -> int:
    ap = Parser(prog="kdlib diagnose", description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", type=_endpoint, help="base URL of an OpenAI-compatible server (http:// or "
                    "https://), with or without /v1 (default: start the embedded one)")
    ap.add_argument("--serve-args", default="", help="arguments of the embedded `kdlib serve`, one string "
                    "(a lone flag as --serve-args=--random)")
    ap.add_argument("--model", help="model id (default: the first /v1/models lists)")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--timeout", type=positive_float, default=900.0,
                    help="seconds one request may take, whole (a stream too), before it counts as failed "
                         "(default 900)")
    ap.add_argument("--max-context", type=int,
                    help="context limit, in place of the max_model_len /v1/models reports (needed where it "
                         "reports none)")
    ap.add_argument("--sustained-tokens", type=int, default=SUSTAINED_TOKENS)
    ap.add_argument("--sustained-prompt", type=int, default=512, help="prompt tokens of the sustained run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--metrics", default="auto", choices=["auto", "kdlib", "vllm", "none"])
    g = ap.add_argument_group("load mode (--load)")
    g.add_argument("--load", action="store_true", help="measure under load instead (load_test)")
    g.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)),
                   help="fixed concurrency levels, comma-separated, e.g. 1,2,4")
    g.add_argument("--request-rate", default="",
                   help="request rates per second to sweep, comma-separated, e.g. 1,2,inf (inf: all at once)")
    g.add_argument("--max-concurrency", type=int, default=None, help="in-flight cap of the rate sweep")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="requests per run (default 4 x C; rates: 4 x distinct)")
    g.add_argument("--distinct-prompts", type=int, default=16)
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS",
                   help="latency targets: ttft:MS tpot:MS e2e:MS")
    g.add_argument("--no-greedy-check", action="store_true", help="skip the sequential reference pass")
    g.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    args = ap.parse_args(argv)
    for name in ("sustained_tokens", "sustained_prompt", "repeats", "max_context", "num_prompts",
                 "max_concurrency", "distinct_prompts", "input_len", "output_len"):
        v = getattr(args, name)
        if v is not None and v < (0 if name == "sustained_tokens" else 1):
            least = ">= 0" if name == "sustained_tokens" else "positive"
            ap.error(f"--{name.replace('_', '-')} must be {least}")
    # a flag of the other mode would be ignored: refused, as estimate refuses its own mixes
    other = _LOAD_ONLY if not args.load else _DIAGNOSE_ONLY
    given = ["--" + d.replace("_", "-") for d in other if getattr(args, d) != ap.get_default(d)]
    if given:
        ap.error(f"{', '.join(given)} {'apply' if len(given) > 1 else 'applies'} to "
                 f"{'--load only' if not args.load else 'the diagnosis without --load'}")
    try:
        levels = _levels(args.concurrency, "concurrency", integer=True)
        rates = _levels(args.request_rate, "request-rate", integer=False)
        slo = _slo(args.goodput)
    except ValueError as e:
        ap.error(str(e))
    if args.load and not levels and not rates:
        ap.error("--concurrency and --request-rate name no level to run")
    if args.max_concurrency is not None and not rates:  # the fixed levels are their own cap
        ap.error("--max-concurrency caps the rate sweep only: give --request-rate too")
    if args.json is not None:  # checked before measuring: the write comes last
        if not args.json:
            ap.error("--json: an empty path")
        if os.path.isdir(args.json):
            ap.error(f"--json {args.json} is a folder, not a file")
        try:
            folder = check_folder(args.json)
        except ValueError as e:
            ap.error(f"--json {e}")
        if not os.access(folder, os.W_OK):
            ap.error(f"--json {args.json}: its folder {folder} is not writable")
    if args.endpoint is not None and args.serve_args:
        ap.error("--serve-args configures the embedded server, which --endpoint replaces")
    try:
        serve_args = shlex.split(args.serve_args)
    except ValueError as e:
        ap.error(f"--serve-args: {e}")
    server, api_key = None, args.api_key
    try:
        with sigterm_as_interrupt():  # SIGTERM as Ctrl-C: the embedded server stopped, not orphaned
            url = args.endpoint
            if url is None:
                from kdlib.serve import ServerProcess

                server = ServerProcess(serve_args)  # `kdlib serve` in its own process; stopped even mid-start
                server.start()
                url = server.url
                api_key = api_key or os.environ.get("KDLIB_API_KEY")  # the key that server took from the env
                print(f"kdlib diagnose: started the embedded server at {url}", file=sys.stderr)
            client = OpenAIClient(url, args.model, api_key=api_key, metric_set=args.metrics,
                                  timeout=args.timeout)
            if args.max_context:
                client.max_context = args.max_context
            try:
                if args.load:
                    result = load_test(client, concurrency=levels, rates=rates,
                                       max_concurrency=args.max_concurrency, num_prompts=args.num_prompts,
                                       distinct=args.distinct_prompts, input_len=args.input_len,
                                       output_len=args.output_len, repeats=args.repeats, slo=slo or None,
                                       check_greedy=not args.no_greedy_check, seed=args.seed)
                else:
                    result = diagnose(client, sweep=not args.no_sweep, sustained_tokens=args.sustained_tokens,
                                      sustained_prompt=args.sustained_prompt, max_context=args.max_context,
                                      repeats=args.repeats)
            finally:
                client.close()
    except ValueError as e:  # a request this endpoint cannot take (context, prompt lengths)
        return fail("kdlib diagnose", e)
    except (DiagnoseError, RuntimeError) as e:  # the endpoint failed, or the embedded server did not start
        print(f"kdlib diagnose: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"kdlib diagnose: {'terminated' if isinstance(e, Terminated) else 'interrupted'}; nothing "
              "measured is printed or written", file=sys.stderr)
        return interrupted_code(e)
    finally:
        if server is not None:
            server.stop()
    print(load_table(result) if args.load else table(result))
    failed = sum(lv["summary"].get("failed", {}).get("max") or 0 for lv in result.get("levels", []))
    if failed:
        print(f"kdlib diagnose: warning: requests failed under load (up to {failed:g} in a run of a level; "
              "the 'failed' column, errors in the JSON)", file=sys.stderr)
    if args.json is not None:
        try:
            write_json(result, args.json)
        except (OSError, ValueError) as e:  # the folder went away or filled up while measuring
            print(f"kdlib diagnose: error: the result (printed above) was not written: {e}", file=sys.stderr)
            return 1
        print(f"wrote {args.json}")
    return 0
