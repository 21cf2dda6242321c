"""Throughput diagnosis of an OpenAI-compatible endpoint (the seeds' method, as a tool).

    kdlib diagnose                                   # starts `kdlib serve` on loopback (a child process)
    kdlib diagnose --endpoint http://host:30000 --json diag.json

    client = OpenAIClient(url)                       # or EngineClient(engine): the engine in process
    two_point(client, prompt)                        # 256 / (t(264) - t(8)): decode rate, prefill cancels
    context_sweep(client)                            # two-point at prompt lengths 64, 128, ... up to the limit
    sustained(client, prompt, 1500)                  # one long streamed generation: TTFT, decode tok/s
    decompose(before, after, measured)               # accepted length / step time vs the measured tok/s

Measurements:
  two-point   the same prompt with max_tokens 8 and 264 (interleaved, `repeats` each, medians):
              rate = (n_264 - n_8) / (t_264 - t_8). Prefill, queueing and the first token cost the
              same in both and cancel. completion_tokens of both replies are checked: an early stop
              (EOS despite ignore_eos) is flagged and the rate uses the tokens actually returned.
  sweep       two-point at prompt lengths doubling from 64 while prompt + 264 fits the context.
  sustained   one streamed request of `max_tokens` (default 1500): TTFT = time to the first chunk;
              decode tok/s = tokens after the first chunk / time from the first to the last chunk.
  decompose   from two /metrics snapshots around a measurement: mean accepted length (tokens per
              step) and mean step time; their ratio predicts tok/s, compared with the measured one.

What it relies on from an endpoint (vLLM and SGLang both serve these): POST /v1/completions with
`prompt` (a string), `max_tokens`, `temperature` 0, `stream`, `stream_options.include_usage`; the
extra sampling fields `ignore_eos` and `min_tokens` (vLLM and SGLang accept them; OpenAI itself
does not, and an endpoint that refuses them is retried without); `usage.prompt_tokens` and
`usage.completion_tokens` (in the last stream chunk when streaming); GET /v1/models `data[0].id`
and `max_model_len` (else pass --max-context). Prompt lengths are hit by calibrating characters
per token against `usage.prompt_tokens`; the lengths actually used are reported.

Chunk token counts: a speculative server sends several tokens per chunk. The tool asks for
`stream_options.continuous_usage_stats` (vLLM's; the embedded server's too) and then knows the
count per chunk; without it, each chunk is taken to hold completion_tokens / chunks.

Metrics (`METRIC_SETS`): "kdlib" (the embedded server: kdlib_spec_accept_length and
kdlib_step_seconds histograms: accepted length and step time measured inside the engine);
"vllm" (`vllm:spec_decode_num_accepted_tokens_total` / `vllm:spec_decode_num_drafts_total`:
accepted length = 1 + accepted / drafts; vLLM exports no step time, so no prediction);
anything else: no decomposition (reported as unavailable).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

SHORT, LONG = 8, 264  # the seeds' two points: 256 decode tokens apart
SUSTAINED_TOKENS = 1500  # the seeds' reproduction: a 1,500-token continuous generation
SWEEP_START = 64  # the seeds' sweep started at 64 tokens of context
DECOMPOSE_TOLERANCE = 0.10  # the decomposition "explains" a measured rate when within 10%
METRIC_SETS = {
    "kdlib": {"accept_sum": "kdlib_spec_accept_length_sum", "accept_count": "kdlib_spec_accept_length_count",
              "step_sum_s": "kdlib_step_seconds_sum", "step_count": "kdlib_step_seconds_count"},
    "vllm": {"accepted": "vllm:spec_decode_num_accepted_tokens_total", "drafts": "vllm:spec_decode_num_drafts_total"},
}


class DiagnoseError(RuntimeError):
    """The endpoint answered something the diagnosis cannot use (an HTTP error, a missing field)."""


@dataclass
class Completion:
    """One request as the client saw it. Times in seconds (perf_counter differences).

    decode_tokens / decode_s: tokens after the first chunk and the time from first to last chunk
    (streaming only). ddtree: the server's per-response DDTree stats when it returns them.
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

    @property
    def early_stop(self) -> bool:
        return self.completion_tokens < self.requested


# ----------------------------------------------------------------------------- clients
def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {series name: value summed over label sets} (no dependency)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line[: line.index("{")], line[line.rindex("}") + 1 :].split()
        else:
            name, *rest = line.split()
        if not rest:
            continue
        value = rest[0]  # a timestamp may follow
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


class OpenAIClient:
    """A client of any OpenAI-compatible endpoint (httpx, imported lazily)."""

    def __init__(self, base_url: str, model: str | None = None, *, timeout: float = 900.0, api_key: str | None = None,
                 metric_set: str = "auto"):
        import httpx

        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers)
        self._extras = True  # ignore_eos / min_tokens until the endpoint refuses them
        info = self.model_info(model)
        self.model = info["id"]
        self.max_context = info.get("max_model_len")
        self.info = info
        self.metric_set = metric_set

    def close(self) -> None:
        self._http.close()

    def model_info(self, model: str | None = None) -> dict:
        import httpx

        try:
            r = self._http.get("/v1/models")
        except httpx.HTTPError as e:
            raise DiagnoseError(f"cannot reach {self.base_url}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise DiagnoseError(f"GET /v1/models: HTTP {r.status_code}: {r.text[:200]}")
        data = r.json().get("data") or []
        if not data:
            raise DiagnoseError("GET /v1/models lists no model")
        if model is None:
            return data[0]
        for d in data:
            if d.get("id") == model:
                return d
        raise DiagnoseError(f"model {model!r} not served here; the endpoint lists {[d.get('id') for d in data]}")

    def metrics(self) -> dict[str, float] | None:
        """Parsed /metrics, or None when the endpoint has none."""
        try:
            r = self._http.get("/metrics")
        except Exception:  # noqa: BLE001 - no metrics endpoint is a normal case
            return None
        return parse_metrics(r.text) if r.status_code == 200 else None

    def _body(self, prompt: str, max_tokens: int, stream: bool) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        if self._extras:
            body.update({"ignore_eos": True, "min_tokens": max_tokens})
        return body

    def complete(self, prompt: str, max_tokens: int, *, stream: bool = False, on_tokens=None) -> Completion:
        """One greedy completion; raises DiagnoseError on an HTTP error. `on_tokens(n)`: called per
        streamed chunk with the completion tokens so far (the chunk count when the server sends no
        running usage)."""
        import httpx

        for attempt in range(2):
            body = self._body(prompt, max_tokens, stream)
            t0 = time.perf_counter()
            try:
                return self._stream(body, t0, on_tokens) if stream else self._plain(body, t0)
            except httpx.HTTPError as e:
                raise DiagnoseError(f"POST /v1/completions failed: {type(e).__name__}: {e}") from None
            except DiagnoseError as e:
                if attempt == 0 and self._extras and getattr(e, "status", 0) == 400 and (
                        "ignore_eos" in str(e) or "min_tokens" in str(e)):
                    self._extras = False  # an endpoint that refuses the extra fields: go without them
                    continue
                raise
        raise AssertionError("unreachable")

    @staticmethod
    def _error(r) -> DiagnoseError:
        e = DiagnoseError(f"POST /v1/completions: HTTP {r.status_code}: {r.text[:300]}")
        e.status = r.status_code
        return e

    def _plain(self, body, t0) -> Completion:
        r = self._http.post("/v1/completions", json=body)
        elapsed = time.perf_counter() - t0
        if r.status_code != 200:
            raise self._error(r)
        d = r.json()
        u = d.get("usage") or {}
        if "completion_tokens" not in u:
            raise DiagnoseError("the reply has no usage.completion_tokens")
        return Completion(d["choices"][0].get("text", ""), int(u.get("prompt_tokens", 0)), int(u["completion_tokens"]),
                          body["max_tokens"], elapsed, ddtree=d.get("ddtree"))

    def _stream(self, body, t0, on_tokens=None) -> Completion:
        text, usage, ddtree = [], None, None
        times, counts = [], []  # per content chunk: arrival time, cumulative completion tokens (or None)
        with self._http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise self._error(r)
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                d = json.loads(data)
                if "error" in d:
                    raise DiagnoseError(f"stream error: {d['error']}")
                now = time.perf_counter()
                if d.get("usage"):
                    usage = d["usage"]
                if d.get("ddtree"):
                    ddtree = d["ddtree"]
                for ch in d.get("choices") or []:
                    piece = ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                    if piece or (d.get("usage") and d["usage"].get("completion_tokens")
                                 and (not counts or d["usage"]["completion_tokens"] != counts[-1])):
                        text.append(piece)
                        times.append(now)
                        counts.append(d["usage"]["completion_tokens"] if d.get("usage") else None)
                        if on_tokens:
                            on_tokens(counts[-1] if counts[-1] is not None else len(counts))
        elapsed = time.perf_counter() - t0
        if usage is None or "completion_tokens" not in usage:
            raise DiagnoseError("the stream carried no usage (stream_options.include_usage unsupported?)")
        n = int(usage["completion_tokens"])
        c = Completion("".join(text), int(usage.get("prompt_tokens", 0)), n, body["max_tokens"], elapsed,
                       chunks=len(times), ddtree=ddtree)
        if times:
            c.ttft_s = times[0] - t0
            first = counts[0] if counts[0] is not None else n / len(times)
            c.decode_tokens, c.decode_s = n - first, times[-1] - times[0]
        return c


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
        ids = self.engine.bundle.tokenizer.encode(prompt)
        events = []
        seen = [0]

        def listen(ev):  # called on the engine's worker thread
            n = len(ev[1]) if ev[0] == "tokens" else 0
            events.append((ev[0], n, ev[2]))
            seen[0] += n
            if on_tokens and n:
                on_tokens(seen[0])

        t0 = time.perf_counter()
        res = self.engine.run(ids, max_tokens, 0.0, 0, listener=listen)
        elapsed = time.perf_counter() - t0
        toks = [(n, t) for kind, n, t in events if kind == "tokens"]
        c = Completion(self.engine.bundle.tokenizer.decode(res["tokens"]), res["prompt_tokens"], len(res["tokens"]),
                       max_tokens, elapsed, chunks=len(toks), ddtree=res["ddtree"])
        if stream and toks:
            c.ttft_s = toks[0][1] - t0
            c.decode_tokens, c.decode_s = c.completion_tokens - toks[0][0], toks[-1][1] - toks[0][1]
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


def make_prompt(client, tokens: int, text: str | None = None) -> tuple[str, int]:
    """A prefix of `text` of about `tokens` prompt tokens on this endpoint: (prompt, its token count).

    Calibrates characters per token with the endpoint's own count (usage.prompt_tokens of a
    1-token request, or the in-process tokenizer), up to three rounds.
    """
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    text = text if text is not None else source_text()

    def count(p):
        if hasattr(client, "prompt_tokens"):
            return client.prompt_tokens(p)
        return client.complete(p, 1).prompt_tokens

    probe = 256  # characters: a short first probe (fits any context) measures characters per token
    while len(text) < probe:
        text = text + "\n\n" + text
    chars = max(1, int(tokens * probe / max(1, count(text[:probe]))))
    n = 0
    for _ in range(3):
        while len(text) < chars:
            text = text + "\n\n" + text
        prompt = text[:chars]
        n = count(prompt)
        if n == tokens or n == 0:
            break
        chars = max(1, int(chars * tokens / n))
    while n > tokens and chars > 1:  # never over: the caller sized prompt + max_tokens to the context
        chars = max(1, int(chars * 0.97))
        prompt = text[:chars]
        n = count(prompt)
    return prompt, n


# ----------------------------------------------------------------------------- measurements
def decompose(before: dict | None, after: dict | None, measured_tok_s: float | None = None,
              metric_set: str = "kdlib") -> dict:
    """Mean accepted length and step time between two metric snapshots, and the tok/s they predict.

    `metric_set`: "kdlib" (Prometheus names of the embedded server), "engine" (EngineClient
    snapshots: the same totals unprefixed), "vllm" (accepted length only). Returns
    {available, accepted_length, step_ms, predicted_tok_s, measured_tok_s, ratio, within_tolerance}.
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
        out["accepted_length"] = delta(names["accept_sum"]) / steps
        out["step_ms"] = delta(names["step_sum_s"]) / delta(names["step_count"]) * 1e3
        out["predicted_tok_s"] = out["accepted_length"] / (out["step_ms"] / 1e3)
        out["steps"] = steps
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
    of the times are used. The long requests are bracketed by metric snapshots for `decompose`.
    """
    if not 1 <= short < long:
        raise ValueError(f"need 1 <= short < long, got short={short}, long={long}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    client.complete(prompt, short, stream=stream)
    ts, tl, ns, nl, pt = [], [], [], [], None
    before = client.metrics()
    for _ in range(repeats):
        s = client.complete(prompt, short, stream=stream)
        lo = client.complete(prompt, long, stream=stream)
        ts.append(s.elapsed_s)
        tl.append(lo.elapsed_s)
        ns.append(s.completion_tokens)
        nl.append(lo.completion_tokens)
        pt = lo.prompt_tokens
    after = client.metrics()
    t_s, t_l = statistics.median(ts), statistics.median(tl)
    n_s, n_l = statistics.median(ns), statistics.median(nl)
    early = any(n < short for n in ns) or any(n < long for n in nl)
    rate = (n_l - n_s) / (t_l - t_s) if t_l > t_s and n_l > n_s else None
    res = {"prompt_tokens": pt, "short": short, "long": long, "repeats": repeats, "t_short_s": t_s, "t_long_s": t_l,
           "completion_short": n_s, "completion_long": n_l, "early_stop": early, "tokens_per_s": rate,
           "nominal_tokens_per_s": (long - short) / (t_l - t_s) if t_l > t_s else None}
    if early:
        res["warning"] = (f"the endpoint stopped early (completion tokens {ns} / {nl} for max_tokens {short} / {long}); "
                          "the rate uses the tokens actually returned")
    ms = _metric_set(client, before)
    res["decomposition"] = decompose(before, after, rate, ms)  # over the steps of the short and long requests
    return res


def context_sweep(client, *, lengths: list[int] | None = None, max_context: int | None = None, text: str | None = None,
                  repeats: int = 2, long: int = LONG, progress: bool = True) -> list[dict]:
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
    with _progress(total=max_tokens, desc=f"sustained {max_tokens} tokens", unit="tok", disable=not progress) as bar:
        def advance(n):
            bar.update(n - bar.n)

        c = client.complete(prompt, max_tokens, stream=True, on_tokens=advance)
        advance(c.completion_tokens)
    after = client.metrics()
    rate = c.decode_tokens / c.decode_s if c.decode_s else None
    res = {"prompt_tokens": c.prompt_tokens, "max_tokens": max_tokens, "completion_tokens": c.completion_tokens,
           "early_stop": c.early_stop, "ttft_s": c.ttft_s, "elapsed_s": c.elapsed_s, "decode_tokens_per_s": rate,
           "end_to_end_tokens_per_s": c.completion_tokens / c.elapsed_s, "chunks": c.chunks,
           "decomposition": decompose(before, after, rate, _metric_set(client, before))}
    if c.ddtree:
        res["per_step"] = {"accepted": c.ddtree.get("accepted"), "step_ms": c.ddtree.get("step_ms")}
    return res


def diagnose(client, *, sweep: bool = True, sustained_tokens: int = SUSTAINED_TOKENS, sustained_prompt: int = 512,
             max_context: int | None = None, repeats: int = 2, text: str | None = None, progress: bool = True) -> dict:
    """Everything: two-point at 64 tokens, the sweep, and the sustained run. A JSON-ready dict."""
    text = text if text is not None else source_text()
    limit = max_context or client.max_context
    out = {"endpoint": getattr(client, "base_url", "in-process engine"), "model": client.model, "model_info": client.info,
           "max_context": limit, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    prompt, _ = make_prompt(client, SWEEP_START, text)
    out["two_point"] = two_point(client, prompt, repeats=repeats)
    if sweep:
        out["sweep"] = context_sweep(client, max_context=limit, text=text, repeats=repeats, progress=progress)
    if sustained_tokens:
        if limit:
            sustained_tokens = min(sustained_tokens, limit - 16)  # leave a prompt of >= 16 tokens inside the context
            sustained_prompt = max(8, min(sustained_prompt, limit - sustained_tokens - 8))
        p, _ = make_prompt(client, sustained_prompt, text)
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
    fallback = (client.info.get("kdlib") or {}).get("source") == "random"  # the embedded server's random model
    kinds = tuple(kinds) if kinds is not None else (("pydoc",) if fallback else kinds_available(models))
    limit = client.max_context
    room = limit - max(long, sustained_tokens) - 8
    if room < 16:
        raise ValueError(f"the context ({limit}) leaves no room for a prompt next to {max(long, sustained_tokens)} "
                         "generated tokens")
    prompt_tokens = min(prompt_tokens, room)
    lengths, n = [], SWEEP_START
    while n + long + 8 <= limit and (sweep_max is None or n <= sweep_max):
        lengths.append(n)
        n *= 2
    sweep = context_sweep(client, lengths=lengths, text=kind_text(sweep_kind or kinds[0], models), repeats=repeats, long=long,
                          progress=progress) if lengths else []
    rows = {}
    for kind in kinds:
        prompt, actual = make_prompt(client, prompt_tokens, kind_text(kind, models))
        tp = two_point(client, prompt, short=short, long=long, repeats=repeats)
        su = sustained(client, prompt, sustained_tokens, progress=progress)
        rows[kind] = {"prompt_tokens": actual, "two_point": tp, "sustained": su}
    return {"model": client.model, "model_info": client.info, "max_context": limit,
            "parameters": {"kinds": list(kinds), "prompt_tokens": prompt_tokens, "sustained_tokens": sustained_tokens,
                           "short": short, "long": long, "repeats": repeats, "sweep_max": sweep_max},
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
    lines = [f"endpoint {result['endpoint']}  model {result['model']}  max context {result['max_context']}", ""]
    lines.append(f"{'measurement':<28}{'prompt tok':>11}{'tok/s':>10}{'accepted':>10}{'step ms':>10}{'predicted':>11}"
                 f"{'meas/pred':>10}")

    def row(name, r, rate_key):
        d = r.get("decomposition") or {}
        flag = " EARLY STOP" if r.get("early_stop") else ""
        lines.append(f"{name:<28}{_fmt(r.get('prompt_tokens'), 'd') if r.get('prompt_tokens') is not None else '-':>11}"
                     f"{_fmt(r.get(rate_key)):>10}{_fmt(d.get('accepted_length'), '.2f'):>10}"
                     f"{_fmt(d.get('step_ms'), '.2f'):>10}{_fmt(d.get('predicted_tok_s')):>11}"
                     f"{_fmt(d.get('ratio'), '.3f'):>10}{flag}")

    row("two-point", result["two_point"], "tokens_per_s")
    for r in result.get("sweep", []):
        row(f"  sweep {r['target_prompt_tokens']}", r, "tokens_per_s")
    if "sustained" in result:
        s = result["sustained"]
        row(f"sustained {s['max_tokens']} (decode)", s, "decode_tokens_per_s")
        lines.append(f"{'':<28}TTFT {_fmt(s['ttft_s'], '.3f')} s, end-to-end {_fmt(s['end_to_end_tokens_per_s'])} tok/s")
    return "\n".join(lines)


def write_json(result: dict, path) -> None:
    """Atomic write (temp file + os.replace)."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(result, f, indent=1, default=float)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kdlib diagnose", description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", help="base URL of an OpenAI-compatible server (default: start the embedded one)")
    ap.add_argument("--model", help="model id (default: the first /v1/models lists)")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--max-context", type=int, help="context limit when /v1/models reports none")
    ap.add_argument("--sustained-tokens", type=int, default=SUSTAINED_TOKENS)
    ap.add_argument("--sustained-prompt", type=int, default=512, help="prompt tokens of the sustained run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--metrics", default="auto", choices=["auto", "kdlib", "vllm", "none"])
    args = ap.parse_args(argv)
    for name in ("sustained_tokens", "repeats", "max_context"):
        v = getattr(args, name)
        if v is not None and v < (0 if name == "sustained_tokens" else 1):
            ap.error(f"--{name.replace('_', '-')} must be positive")
    server = None
    try:
        url = args.endpoint
        if url is None:
            from kdlib.serve import ServerProcess

            server = ServerProcess().start()  # `kdlib serve` in its own process, as a real endpoint
            url = server.url
            print(f"kdlib diagnose: started the embedded server at {url}", file=sys.stderr)
        client = OpenAIClient(url, args.model, api_key=args.api_key, metric_set=args.metrics)
        try:
            result = diagnose(client, sweep=not args.no_sweep, sustained_tokens=args.sustained_tokens,
                              sustained_prompt=args.sustained_prompt, max_context=args.max_context,
                              repeats=args.repeats)
        finally:
            client.close()
    except (DiagnoseError, ValueError) as e:
        print(f"kdlib diagnose: {e}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    print(table(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0


