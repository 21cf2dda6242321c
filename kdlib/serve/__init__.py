"""An OpenAI-compatible HTTP server around the engine: the workbook's embedded default endpoint.

    kdlib serve --port 8000                      # FastAPI + uvicorn, as vLLM and SGLang serve
    curl localhost:8000/v1/completions -d '{"model": "...", "prompt": "def f(", "max_tokens": 32}'

    with EmbeddedServer() as srv:                # in-process (a thread), on 127.0.0.1 and a free port
        httpx.post(srv.url + "/v1/completions", json={...})
    with ServerProcess(["--random"]) as srv:     # `kdlib serve` as a child process: what to time against
        ...

Routes:
  POST /v1/completions       prompt (a string, or a list of token ids) -> text_completion
  POST /v1/chat/completions  messages -> chat.completion, through CHAT_TEMPLATE below
  GET  /v1/models            the one served model; `max_model_len` and a `kdlib` block saying which
                             weights, drafter and tokenizer are in use (trained or random fallback)
  GET  /health               {"status": "ok", ...} with the same block and the queue depth
  GET  /metrics              Prometheus text: per-step accepted length and step time
                             (histograms), tokens, decode seconds, requests (counters), per-request
                             decode tokens/s and time to first token (histograms)

Request fields read (others are ignored, as vLLM and SGLang ignore unknown fields): model,
prompt | messages, max_tokens (chat also max_completion_tokens; default 16 as OpenAI's
completions), temperature (default 1.0 as OpenAI; 0 = greedy), seed, stream,
stream_options.include_usage and .continuous_usage_stats (vLLM's: usage in every chunk), n (only
1), stop (only null: the engine has no stop strings), ignore_eos and min_tokens (accepted; the
engine has no end-of-sequence token, so it always generates exactly max_tokens and
finish_reason is "length").

Responses follow OpenAI's shapes (`usage` with prompt/completion/total tokens) plus an extension
field `ddtree`: method, budget, steps, per-step accepted lengths and step ms, prefill / drafter
set-up / decode ms, tokens per step and decode tokens/s. Streaming is SSE: `data: {chunk}` lines,
one per DDTree step (every token committed in that step), then `data: [DONE]`. A step's tokens
reach the client when the drafter is handed them (`Drafter.commit`), which `generate` calls once
per step; the last bonus token follows at the end of the request.

Errors are 4xx JSON in OpenAI's shape {"error": {"message", "type", "param", "code"}}, raised before
any work: malformed JSON, a field of the wrong type, an unknown model (404), max_tokens <= 0 or
over the limit, a prompt (plus max_tokens) over the context, a full queue (429).

Concurrency: one engine worker thread takes requests from a FIFO queue one at a time, so greedy
outputs under concurrency equal the sequential ones. Models: `kdlib.zoo` (the trained tiny target,
drafter and tokenizer) when `zoo.available()`; otherwise a random tiny model from
`data/configs/tiny-a.json`, a noisy-oracle drafter (`LazyOracle` below) and `ByteTokenizer` (printable ASCII), and
/v1/models and /health say so. FastAPI, uvicorn and prometheus_client are imported lazily.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import numbers
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

from kdlib import DATA

# The chat template: each message as "<|role|>\n" + content + "\n", then "<|assistant|>\n" for the
# reply. Roles: system, user, assistant. Plain text markers, so any tokenizer encodes them.
CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
CHAT_ROLES = ("system", "user", "assistant")
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
SWITCH_INTERVAL_S = 0.0005  # `kdlib serve` process: see cli()
MAX_QUEUE = 64  # waiting requests beyond this are refused with 429 (a bounded queue keeps latency bounded)
FALLBACK_CONFIG = "tiny-a"
FALLBACK_P_WRONG = 0.35  # the oracle's per-position miss rate: ~2.5 tokens per step, near the seeds' 2.9
# Histogram buckets. Accepted length tau counts root + accepted drafts: 1..MAX_DEPTH + 1 (= 17).
ACCEPT_BUCKETS = tuple(range(1, 18))
STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
# Running totals an Engine keeps (the Prometheus series: kdlib_spec_accept_length_{sum,count},
# kdlib_step_seconds_{sum,count}, kdlib_generation_tokens_total, kdlib_prompt_tokens_total).
TOTALS = ("accept_sum", "accept_count", "step_sum_s", "step_count", "generation_tokens", "prompt_tokens", "requests")


def render_chat(messages) -> str:
    """The prompt text of a chat (CHAT_TEMPLATE); raises RequestError on a malformed message list."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty array", param="messages")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
            raise RequestError(f"messages[{i}] must be an object with role in {list(CHAT_ROLES)} and a string "
                               "content", param=f"messages[{i}]")
        parts.append(CHAT_TEMPLATE.format(role=m["role"], content=m["content"]))
    return "".join(parts) + "<|assistant|>\n"


# ----------------------------------------------------------------------------- models
class ByteTokenizer:
    """Printable ASCII for the random fallback model: id 0 = newline, ids 1..95 = chr(32..126).

    Ids past 95 (a vocabulary larger than 96) decode to nothing; a character outside the table
    encodes as '?'. Same interface as `kdlib.zoo.Tokenizer` (encode, decode, vocab_size).
    """

    TABLE = "\n" + "".join(chr(c) for c in range(32, 127))

    def __init__(self, vocab_size: int):
        if vocab_size < len(self.TABLE):
            raise ValueError(f"ByteTokenizer needs a vocabulary of >= {len(self.TABLE)} ids, got {vocab_size}")
        self.vocab_size = vocab_size
        self._ids = {c: i for i, c in enumerate(self.TABLE)}

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        q = self._ids["?"]
        return [self._ids.get(c, q) for c in text]

    def decode(self, ids) -> str:
        n = len(self.TABLE)
        return "".join(self.TABLE[i] for i in (int(x) for x in ids) if 0 <= i < n)


def _lazy_oracle_class():
    """`LazyOracle`, defined on first use so that importing this module needs no torch."""
    import numpy as np
    import torch

    from kdlib.engine.cache import LatentCache
    from kdlib.engine.drafter import NoisyOracleDrafter

    class LazyOracle(NoisyOracleDrafter):
        """A NoisyOracleDrafter whose greedy script grows as decoding needs it, on a private cache.

        The engine's oracle computes the whole greedy continuation (max_new_tokens of AR) in
        `begin`; for a server that set-up grows with max_tokens, lands in the two-point difference
        t(264) - t(8), and turns the diagnosis into a measurement of the oracle. Here `begin`
        prefills the prompt and scripts the first draft window only (a fixed cost), and each
        `draft` extends the script by the tokens the last step committed (about tau AR forwards,
        counted in the draft phase of that step), so the cost scales with the generated tokens as
        a real drafter's does. Drafts are the base class's.
        """

        def begin(self, target, prompt_ids, features, max_new_tokens: int) -> None:
            self._model = target
            self._rng = np.random.Generator(np.random.PCG64(self.seed))
            ids = target.check_tokens(prompt_ids)
            self._ctx = [int(t) for t in ids.tolist()]
            self._cache = LatentCache(target.cfg, len(self._ctx) + max_new_tokens + self.block_size + 2,
                                      device=target.device, dtype=target.dtype)
            h, _ = target.prefill(self._cache, ids)
            self._script = self._ctx + [int(target.head(h[-1:]).argmax(-1))]
            self._extend(len(self._ctx) + self.block_size)  # the first draft's window: step 1 costs as the rest

        def _extend(self, want: int) -> None:
            while len(self._script) < want and self._cache.length + 1 < self._cache.num_slots:
                pos = self._cache.length
                h, _ = self._model.forward_cached(self._cache, torch.tensor([self._script[pos]]), [pos])
                self._cache.commit()
                self._script.append(int(self._model.head(h).argmax(-1)))

        def draft(self, bonus: int, s: int) -> torch.Tensor:
            ctx = self._ctx + [int(bonus)]
            if self._script[: len(ctx)] == ctx:  # still on the greedy path (always at T = 0)
                self._extend(len(ctx) + self.block_size - 1)
            return super().draft(bonus, s)

    return LazyOracle


@dataclass
class Bundle:
    """What the server serves: target, drafter, tokenizer, and a description of where they came from."""

    model: object
    drafter: object
    tokenizer: object
    name: str
    info: dict = field(default_factory=dict)


def load_bundle(device: str = "cpu", *, prefer_trained: bool = True, config: str = FALLBACK_CONFIG,
                p_wrong: float = FALLBACK_P_WRONG, seed: int = 0, folder=None) -> Bundle:
    """The trained zoo models when present (and prefer_trained), else the random fallback.

    folder: where the trained models are (default `kdlib.zoo.MODELS`, i.e. data/models/).
    """
    if prefer_trained:
        try:
            from kdlib import zoo

            if zoo.available(folder):
                model = zoo.load_target(device=device, folder=folder)
                where = folder if folder is not None else "data/models/"
                return Bundle(model, zoo.load_drafter(model, folder=folder), zoo.load_tokenizer(folder), "kdtree-tiny",
                              {"source": "trained", "weights": f"trained (kdlib.zoo, {where})", "drafter": "trained DFlash-style",
                               "tokenizer": "trained byte-level BPE"})
        except ImportError:
            pass
    import torch

    from kdlib.engine.config import ModelConfig
    from kdlib.engine.model import Model

    cfg = ModelConfig.from_json(DATA / "configs" / f"{config}.json")
    model = Model.random(cfg, seed=seed, device=device, dtype=torch.float32)
    drafter = _lazy_oracle_class()(cfg.vocab_size, p_wrong, block_size=8, seed=seed)
    return Bundle(model, drafter, ByteTokenizer(cfg.vocab_size), f"kdtree-random-{config}",
                  {"source": "random", "weights": f"random (data/configs/{config}.json, seed {seed}): no trained "
                   "models found",
                   "drafter": f"noisy oracle (lazy script), p_wrong {p_wrong}", "tokenizer": "printable ASCII (ByteTokenizer)"})


# ----------------------------------------------------------------------------- the engine worker
class RequestError(ValueError):
    """A bad request: HTTP `status`, OpenAI error `type`, the offending `param` and a `code`."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Job:
    """One queued generation. `listener(event)` is called from the worker thread with
    ("tokens", [ids], t) per step, then ("done", result_dict, t) or ("error", RequestError, t)."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int
    listener: object = None
    submitted: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    result: dict | None = None
    error: Exception | None = None


class _Tap:
    """Wraps a drafter: every `commit` (once per DDTree step) also hands the committed ids to `emit`.

    The Drafter interface is spelled out member by member: from Python 3.12 on, `isinstance` against a
    runtime-checkable Protocol looks members up statically, so `__getattr__` delegation would not count.
    """

    def __init__(self, inner, emit):
        self._inner, self._emit = inner, emit

    @property
    def block_size(self) -> int:
        return self._inner.block_size

    @property
    def vocab_size(self) -> int:
        return self._inner.vocab_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self._inner.target_layer_ids

    def begin(self, target, prompt_ids, features, max_new_tokens: int) -> None:
        self._inner.begin(target, prompt_ids, features, max_new_tokens)

    def draft(self, bonus: int, s: int):
        return self._inner.draft(bonus, s)

    def commit(self, token_ids, features) -> None:
        self._inner.commit(token_ids, features)
        self._emit([int(t) for t in token_ids.tolist()])


class Engine:
    """The served model behind a FIFO queue and one worker thread; Prometheus metrics of every step."""

    def __init__(self, bundle: Bundle | None = None, *, budget: int | None = None, max_tokens_limit: int | None = None,
                 max_queue: int = MAX_QUEUE, threads: int | None = None):
        self.bundle = bundle or load_bundle()
        if threads is None and self.bundle.model.device.type == "cpu":
            # A tiny model's ops are far too small to split; on a shared CPU, torch's worker threads
            # contend with other processes and a step took 10-20x longer (measured on a 2-core host).
            threads = 1
        if threads is not None:
            import torch

            torch.set_num_threads(threads)  # process-wide
        self.budget = budget
        self.max_context = int(self.bundle.model.cfg.max_position_embeddings)
        self.max_tokens_limit = min(max_tokens_limit or self.max_context, self.max_context)
        self.max_queue = max_queue
        self._q: queue.Queue = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._metrics()
        self._thread = threading.Thread(target=self._work, name="kdlib-engine", daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return self.bundle.name

    def info(self) -> dict:
        b = self.bundle
        return {**b.info, "method": "ddtree", "budget": self.budget, "max_model_len": self.max_context,
                "max_tokens_limit": self.max_tokens_limit, "device": str(b.model.device)}

    def queue_depth(self) -> int:
        return self._pending

    def _metrics(self) -> None:
        # Plain running totals (what `kdlib.diagnose.EngineClient` reads in process, where
        # prometheus_client may be missing, as on the GPU machine), plus Prometheus when installed.
        self.totals = dict.fromkeys(TOTALS, 0.0)
        try:
            from prometheus_client import CollectorRegistry, Counter, Histogram
        except ImportError:
            self.registry = None
            return
        r = self.registry = CollectorRegistry()  # one per engine: several servers in one process stay apart
        self.m_accept = Histogram("kdlib_spec_accept_length", "Tokens committed per DDTree step (root + accepted)",
                                  buckets=ACCEPT_BUCKETS, registry=r)
        self.m_step = Histogram("kdlib_step_seconds", "Wall time of one decode step (draft+build+verify+accept+"
                                "compaction)", buckets=STEP_BUCKETS, registry=r)
        self.m_rate = Histogram("kdlib_request_decode_tokens_per_second", "Per request: decode tokens / decode "
                                "seconds (steps only)", buckets=RATE_BUCKETS, registry=r)
        self.m_ttft = Histogram("kdlib_time_to_first_token_seconds", "Queue + prefill + drafter set-up + first step",
                                buckets=STEP_BUCKETS, registry=r)
        self.m_gen = Counter("kdlib_generation_tokens", "Completion tokens returned", registry=r)
        self.m_prompt = Counter("kdlib_prompt_tokens", "Prompt tokens processed", registry=r)
        self.m_decode_s = Counter("kdlib_decode_seconds", "Seconds spent in decode steps", registry=r)
        self.m_req = Counter("kdlib_requests", "Finished requests", ["status"], registry=r)

    def snapshot(self) -> dict:
        """A copy of the running totals (TOTALS)."""
        with self._lock:
            return dict(self.totals)

    def metrics_text(self) -> bytes:
        from prometheus_client import generate_latest

        if self.registry is None:
            raise RuntimeError("prometheus_client is not installed: no /metrics")
        return generate_latest(self.registry)

    def submit(self, job: Job) -> Job:
        """Queue a job (raises RequestError 429 when MAX_QUEUE are waiting)."""
        with self._lock:
            if self._pending >= self.max_queue:
                raise RequestError(f"the queue is full ({self.max_queue} requests waiting)", status=429,
                                   type="rate_limit_error", code="queue_full")
            self._pending += 1
        self._q.put(job)
        return job

    def run(self, prompt_ids, max_tokens: int, temperature: float = 0.0, seed: int = 0, listener=None) -> dict:
        """Submit and wait (in-process use, e.g. `kdlib.diagnose.EngineClient`)."""
        job = self.submit(Job(list(prompt_ids), max_tokens, temperature, seed, listener))
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)

    def _work(self) -> None:
        # One short untimed request first: torch's first calls (allocator growth, kernel selection)
        # cost seconds on CPU and would land in the first client's timings.
        warm = Job([0] * 8, 8, 0.0, 0)
        try:
            self._generate(warm, observe=False)
        except Exception:  # noqa: BLE001 - a failing model shows on the first real request instead
            pass
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                job.result = self._generate(job)
                self._count("ok")
                if job.listener:
                    job.listener(("done", job.result, time.perf_counter()))
            except Exception as e:  # noqa: BLE001 - reported to the client; the worker keeps serving
                job.error = e if isinstance(e, RequestError) else RequestError(
                    f"generation failed: {type(e).__name__}: {e}", status=500, type="server_error")
                self._count("error")
                if job.listener:
                    job.listener(("error", job.error, time.perf_counter()))
            finally:
                with self._lock:
                    self._pending -= 1
                job.done.set()

    def _count(self, status: str) -> None:
        if self.registry is not None:
            self.m_req.labels(status).inc()

    def _generate(self, job: Job, observe: bool = True) -> dict:
        import torch

        from kdlib.engine.generate import generate

        t_start = time.perf_counter()
        sent = [0]
        first = [None]

        def emit(ids):
            n = min(len(ids), job.max_tokens - sent[0])  # the last step may overshoot max_tokens
            if n <= 0:
                return
            sent[0] += n
            now = time.perf_counter()
            if first[0] is None:
                first[0] = now
            if job.listener:
                job.listener(("tokens", ids[:n], now))

        b = self.bundle
        with torch.no_grad():
            res = generate(b.model, job.prompt_ids, job.max_tokens, method="ddtree", drafter=_Tap(b.drafter, emit),
                           budget=self.budget, temperature=job.temperature, seed=job.seed)
        emit(res.tokens[sent[0]:])  # the final bonus (and anything a step committed past the last commit)
        steps_ms = res.step_ms().tolist()
        decode_s = sum(steps_ms) / 1e3
        rate = (len(res.tokens) - 1) / decode_s if decode_s > 0 else None
        stats = {
            "method": res.method, "budget": res.budget, "steps": res.steps,
            "accepted": res.accepted, "step_ms": [round(x, 4) for x in steps_ms],
            "mean_accepted": res.mean_accepted,
            "mean_step_ms": (sum(steps_ms) / len(steps_ms)) if steps_ms else None,
            "prefill_ms": res.prefill_ms, "drafter_setup_ms": res.drafter_setup_ms, "decode_ms": decode_s * 1e3,
            "queue_ms": (t_start - job.submitted) * 1e3, "tokens_per_forward": res.tokens_per_forward,
            "decode_tokens_per_s": rate, "phase_totals_ms": res.phase_totals_ms(),
        }
        out = {"tokens": res.tokens, "prompt_tokens": res.prompt_len, "ddtree": stats}
        if not observe:
            return out
        with self._lock:
            for k, v in (("accept_sum", sum(res.accepted)), ("accept_count", res.steps), ("step_sum_s", decode_s),
                         ("step_count", res.steps), ("generation_tokens", len(res.tokens)),
                         ("prompt_tokens", res.prompt_len), ("requests", 1)):
                self.totals[k] += v
        if self.registry is None:
            return out
        for tau, ms in zip(res.accepted, steps_ms, strict=True):
            self.m_accept.observe(tau)
            self.m_step.observe(ms / 1e3)
        self.m_decode_s.inc(decode_s)
        self.m_gen.inc(len(res.tokens))
        self.m_prompt.inc(res.prompt_len)
        if rate is not None:
            self.m_rate.observe(rate)
        self.m_ttft.observe(first[0] - job.submitted)
        return out


# ----------------------------------------------------------------------------- request parsing
def _int(body, key, *, lo, hi=None, default=None, hi_what=""):
    v = body.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise RequestError(f"'{key}' must be an integer, got {type(v).__name__}", param=key, code="invalid_type")
    if v < lo:
        raise RequestError(f"'{key}' must be >= {lo}, got {v}", param=key, code="invalid_value")
    if hi is not None and v > hi:
        raise RequestError(f"'{key}' must be <= {hi}{hi_what}, got {v}", param=key, code="invalid_value")
    return int(v)


def _bool(body, key, default=False):
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"'{key}' must be a boolean, got {type(v).__name__}", param=key, code="invalid_type")
    return v


@dataclass
class Parsed:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int
    stream: bool
    include_usage: bool
    continuous_usage: bool


def parse_request(raw: bytes, engine: Engine, chat: bool) -> Parsed:
    """Validate one request body; every problem raises RequestError before any work."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model", code="invalid_type")
    if model is not None and model != engine.name:
        raise RequestError(f"the model '{model}' does not exist; this server serves '{engine.name}'", status=404,
                           param="model", code="model_not_found")
    tok = engine.bundle.tokenizer
    if chat:
        prompt_ids = tok.encode(render_chat(body.get("messages")))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]  # a batch of one string, as OpenAI clients send
        if isinstance(prompt, str):
            prompt_ids = tok.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                              for t in prompt):
            prompt_ids = [int(t) for t in prompt]
            vocab = engine.bundle.model.cfg.vocab_size
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise RequestError(f"prompt token ids must lie in [0, {vocab})", param="prompt", code="invalid_value")
        else:
            raise RequestError("'prompt' must be a string or an array of token ids (one prompt per request)",
                               param="prompt", code="invalid_type")
    if not prompt_ids:
        raise RequestError("the prompt is empty", param="prompt" if not chat else "messages", code="invalid_value")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, key, lo=1, hi=engine.max_tokens_limit, default=DEFAULT_MAX_TOKENS,
                      hi_what=" (the server's limit)")
    if len(prompt_ids) + max_tokens > engine.max_context:
        raise RequestError(
            f"this model's maximum context length is {engine.max_context} tokens; the request asks for "
            f"{len(prompt_ids)} prompt + {max_tokens} completion tokens", param="prompt", code="context_length_exceeded")
    t = body.get("temperature", DEFAULT_TEMPERATURE)
    t = DEFAULT_TEMPERATURE if t is None else t
    if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
        raise RequestError("'temperature' must be a finite number >= 0", param="temperature", code="invalid_value")
    seed = _int(body, "seed", lo=0, default=0)
    if _int(body, "n", lo=1, hi=1, default=1) != 1:
        raise RequestError("only n = 1 is supported", param="n")
    if body.get("stop") not in (None, [], ""):
        raise RequestError("stop sequences are not supported by this engine", param="stop", code="unsupported")
    _bool(body, "ignore_eos")
    _int(body, "min_tokens", lo=0, hi=max_tokens, default=0)
    stream = _bool(body, "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise RequestError("'stream_options' must be an object", param="stream_options", code="invalid_type")
    return Parsed(prompt_ids, max_tokens, float(t), seed, stream, _bool(opts, "include_usage"),
                  _bool(opts, "continuous_usage_stats"))


# ----------------------------------------------------------------------------- the FastAPI app
def create_app(engine: Engine):
    """The FastAPI application serving `engine`."""
    import asyncio

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="kdlib serve", version="0.1.0")
    ids = itertools.count()

    @app.exception_handler(RequestError)
    async def _bad(request, e: RequestError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        return JSONResponse(RequestError(str(e.detail), status=e.status_code, code=str(e.status_code)).body(),
                            status_code=e.status_code)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.name, "queue": engine.queue_depth(), "kdlib": engine.info()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": int(time.time()),
                                            "owned_by": "kdlib", "max_model_len": engine.max_context,
                                            "kdlib": engine.info()}]}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(engine.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    async def complete(request, chat: bool):
        p = parse_request(await request.body(), engine, chat)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        engine.submit(Job(p.prompt_ids, p.max_tokens, p.temperature, p.seed,
                                lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:20]}-{next(ids)}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        tok = engine.bundle.tokenizer

        def usage(n):
            return {"prompt_tokens": len(p.prompt_ids), "completion_tokens": n, "total_tokens": len(p.prompt_ids) + n}

        if not p.stream:
            while True:
                kind, payload, _ = await events.get()
                if kind == "error":
                    raise payload
                if kind == "done":
                    break
            text = tok.decode(payload["tokens"])
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
            return {"id": rid, "object": obj, "created": created, "model": engine.name, "choices": [choice],
                    "usage": usage(len(payload["tokens"])), "ddtree": payload["ddtree"]}

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text, finish=None, role=False):
            if chat:
                delta = {"role": "assistant", "content": text} if role else {"content": text}
                return {"index": 0, "delta": delta, "finish_reason": finish}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        def sse(d) -> str:
            return f"data: {json.dumps(d, separators=(',', ':'))}\n\n"

        async def stream():
            n, first = 0, True
            sent_ids: list[int] = []
            while True:
                kind, payload, _ = await events.get()
                if kind == "error":
                    yield sse(payload.body())
                    break
                if kind == "tokens":
                    # decode the whole text so far and send the new suffix: BPE merges stay intact
                    before = tok.decode(sent_ids)
                    sent_ids.extend(payload)
                    n += len(payload)
                    d = {"id": rid, "object": chunk_obj, "created": created, "model": engine.name,
                         "choices": [chunk(tok.decode(sent_ids)[len(before):], role=first)]}
                    if p.continuous_usage:
                        d["usage"] = usage(n)
                    first = False
                    yield sse(d)
                else:
                    d = {"id": rid, "object": chunk_obj, "created": created, "model": engine.name,
                         "choices": [chunk("", finish="length")], "ddtree": payload["ddtree"]}
                    if p.continuous_usage:
                        d["usage"] = usage(n)
                    yield sse(d)
                    if p.include_usage:
                        yield sse({"id": rid, "object": chunk_obj, "created": created, "model": engine.name,
                                   "choices": [], "usage": usage(n)})
                    break
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def completions(request):
        return await complete(request, chat=False)

    async def chat_completions(request):
        return await complete(request, chat=True)

    # The annotation FastAPI injects the raw request by (set here: this module's postponed
    # annotations would name a Request that only exists inside this function).
    for route, fn in (("/v1/completions", completions), ("/v1/chat/completions", chat_completions)):
        fn.__annotations__["request"] = Request
        app.post(route)(fn)
    return app


class EmbeddedServer:
    """uvicorn serving `create_app(engine)` in a background thread on host:port (port 0 = a free one).

    with EmbeddedServer() as srv: ... srv.url ...      # the engine is closed on exit when it made it

    Client and server share this process's GIL here, so a client timing a stream sees chunk
    arrival late by up to a switch interval per hand-over; for measurements use `ServerProcess`.
    """

    def __init__(self, engine: Engine | None = None, host: str = "127.0.0.1", port: int = 0, **engine_kw):
        self._own = engine is None
        self.engine = engine or Engine(**engine_kw)
        self.host, self.port = host, port
        self._server = self._thread = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> EmbeddedServer:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))  # bound here, so port 0 resolves before uvicorn starts
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(create_app(self.engine), log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the embedded server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=30)
            self._server = None
        if self._own:
            self.engine.close()

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ServerProcess:
    """`kdlib serve` in a child process on 127.0.0.1 and a free port: a separate interpreter, as a
    real endpoint is, so the client's timings do not share a GIL with the engine.

    with ServerProcess(["--random"]) as srv: ... srv.url ...
    """

    def __init__(self, args: list[str] | None = None, host: str = "127.0.0.1", startup_s: float = 180.0):
        self.args, self.host, self.startup_s = list(args or []), host, startup_s
        self.port = None
        self._proc = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerProcess:
        import subprocess
        import sys

        import httpx

        with socket.socket() as s:  # a free port; released just before the child binds it
            s.bind((self.host, 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "kdlib.cli", "serve", "--host", self.host, "--port", str(self.port), *self.args]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read()[-2000:]
                raise RuntimeError(f"kdlib serve exited with {self._proc.returncode}: {err}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"kdlib serve did not answer /health on {self.url} within {self.startup_s:.0f} s")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - it would not stop: kill our own child
                self._proc.kill()
                self._proc.wait(timeout=30)
        if self._proc is not None and self._proc.stderr:
            self._proc.stderr.close()
        self._proc = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kdlib serve", description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--budget", type=int, default=None, help="DDTree budget (default: the drafter's horizon)")
    ap.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens accepted")
    ap.add_argument("--random", action="store_true", help="serve the random fallback even when trained models exist")
    ap.add_argument("--config", default=FALLBACK_CONFIG, help="fallback model config under data/configs/")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 on CPU)")
    ap.add_argument("--models", default=None, help="folder of the trained models (default data/models/)")
    args = ap.parse_args(argv)
    import sys

    import uvicorn

    # The event loop must get the GIL between engine steps to send each step's chunk promptly; at the
    # default 5 ms switch interval a stream of 2-3 ms steps reaches the client in late bursts.
    sys.setswitchinterval(SWITCH_INTERVAL_S)

    bundle = load_bundle(args.device, prefer_trained=not args.random, config=args.config, folder=args.models)
    engine = Engine(bundle, budget=args.budget, max_tokens_limit=args.max_tokens_limit, threads=args.threads)
    print(f"kdlib serve: {engine.name} ({bundle.info['weights']}) on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level="info")
    engine.close()
    return 0
