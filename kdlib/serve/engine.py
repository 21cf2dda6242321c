"""The server's engine loop: one thread drives the batched engine (`kdlib.engine.batch.BatchEngine`).

    engine = Engine(load_bundle("cuda"), max_num_seqs=16)
    seq = Sequence(prompt_ids, max_tokens=64, params=SamplingParams(temperature=0), listener=fn)
    engine.submit([seq])            # any thread; RequestError 429 when the waiting queue is full
    engine.cancel(seq)              # any thread: aborted before the next step, its slots freed
    engine.run(prompt_ids, 64)      # blocking, in process (kdlib.diagnose.EngineClient)

The loop, on its own thread: take new and cancelled sequences from the inbox (`add_request`,
`abort`), run one `step()`, hand every sequence its new tokens. Requests join the running batch
between steps and leave when done (continuous batching), each with its own sampling settings.
Text is made here (`TextStream`): a sequence whose text completes a stop string is aborted in the
engine at once and finishes with "stop" (stop strings count from min_tokens on); an end-of-text
token ends it with "stop" too; end-of-text tokens are counted but never decoded into text.
A request whose prefill raises fails alone with a 500 (the engine's `isolate_failures`); a step that
raises fails every running and waiting request, and the loop serves on. Listeners run on the loop's thread and
must only hand the event on: ("prompt", [per-position logprobs]) first when asked for, then ("delta",
Delta) per step with tokens, then ("done", Done) or ("error", RequestError).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from kdlib.serve.bundle import Bundle, load_bundle
from kdlib.serve.metrics import Metrics
from kdlib.serve.text import TextStream

MAX_WAITING = 256  # sequences waiting for a stream beyond this are refused with 429
RETRY_AFTER_S = 1  # the Retry-After of a 429: the batch frees a stream every few steps
# Running totals an Engine keeps (also without prometheus_client, as on the GPU machine; the same
# series as kdlib_spec_accept_length_{sum,count}, kdlib_step_seconds_{sum,count}, ...).
TOTALS = ("accept_sum", "accept_count", "step_sum_s", "step_count", "generation_tokens", "prompt_tokens",
          "requests")


class RequestError(ValueError):
    """A bad request: HTTP `status`, OpenAI error `type`, the offending `param` and a `code`."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def _shutdown_error() -> RequestError:
    """What the requests still in flight when the server stops get."""
    return RequestError("the server shut down", status=503, type="server_error", code="shutdown")


@dataclass(frozen=True)
class Delta:
    """What one step added to a sequence: `text` safe to send, the kept `token_ids` (a stop string
    cuts the step's tokens after the one completing it), their `logprobs` when asked for."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple | None
    completion_tokens: int
    t: float


@dataclass(frozen=True)
class Done:
    """The end of a sequence. finish_reason: "stop" | "length" | "abort". stats: the `ddtree` block."""

    index: int
    finish_reason: str
    token_ids: tuple[int, ...]
    text: str
    stats: dict
    t: float


@dataclass(eq=False)
class Sequence:
    """One generated sequence (one choice of a request). params: the engine's SamplingParams.

    prompt_logprobs: top-n for the prompt's own logprobs (echo + logprobs), None = not asked.
    post: None (the listener is called on the loop's thread) or a callable(fn, arg) running fn(arg)
    on the listener's own thread, e.g. an event loop's call_soon_threadsafe: the events of one engine
    step then reach that thread in one call. The fields after `post` belong to the loop's thread.
    """

    prompt_ids: list[int]
    max_tokens: int
    params: object
    stops: tuple[str, ...] = ()
    listener: object = None
    index: int = 0
    prompt_logprobs: int | None = None
    post: object = None
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    rid: int | None = None
    text: TextStream | None = None
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # each decode step's tau: the tokens it added
    step_ms: list[float] = field(default_factory=list)
    first_at: float | None = None
    first_tokens: int = 0  # the tokens emitted at first_at (the prefill's, and its step's decode's)
    last_at: float | None = None

    def emit(self, kind: str, payload) -> None:
        if self.listener is not None:
            try:
                self.listener((kind, payload))
            except RuntimeError:  # the listener's event loop has closed (server shut down): nobody to tell
                pass

    def stats(self, method: str, budget) -> dict:
        n, steps = len(self.tokens), len(self.accepted)
        decode_s = (self.last_at - self.first_at) if self.first_at is not None else 0.0
        first_n = self.first_tokens
        return {"method": method, "budget": budget, "steps": steps, "accepted": list(self.accepted),
                "step_ms": [round(x, 4) for x in self.step_ms],
                "mean_accepted": sum(self.accepted) / steps if steps else None,
                "mean_step_ms": sum(self.step_ms) / steps if steps else None,
                "ttft_ms": (self.first_at - self.submitted) * 1e3 if self.first_at is not None else None,
                "decode_ms": decode_s * 1e3,
                "decode_tokens_per_s": (n - first_n) / decode_s if decode_s > 0 else None}


def _deliver(items) -> None:
    for listener, ev in items:
        listener(ev)


def make_core(bundle: Bundle, *, max_num_seqs: int, max_model_len: int | None, method: str,
              budget: int | None, overlap: bool = False, compile: bool = False):
    """The batched engine over the bundle's model (and drafter for DDTree; the fallback's oracle
    drafts on the host, so its steps run eagerly instead of as CUDA graphs); overlap and compile as
    `BatchEngine` takes them."""
    from kdlib.engine.batch import BatchEngine
    from kdlib.engine.drafter import NoisyOracleDrafter

    ddtree = method == "ddtree"
    return BatchEngine(bundle.model, max_streams=max_num_seqs, method=method,
                       drafter=bundle.drafter if ddtree else None, budget=budget, max_context=max_model_len,
                       graphs=False if ddtree and isinstance(bundle.drafter, NoisyOracleDrafter) else None,
                       overlap=overlap, compile=compile, isolate_failures=True)


class Engine:
    """The served model behind the engine loop (module docstring); Prometheus metrics when installed.

    core: a BatchEngine-compatible object (default `make_core`); max_waiting: sequences that may wait for
    one of the max_num_seqs streams (429 beyond; 0: only free streams take requests); threads: torch CPU
    threads (default 1 on CPU, where a tiny model's ops are far too small to split and torch's workers
    contend with other processes; torch's setting is the process's, so `close` puts the old one back);
    overlap: the device runs step k+1 while the loop reads step k's tokens (`kdlib serve
    --async-scheduling`); compile: torch.compile inside the CUDA graphs (`--enable-torch-compile`; a CUDA
    model only). Both go to `make_core`; a `core` given here carries its
    own (passing them beside it is an error), and `info()` reports the core's method and levers.
    """

    def __init__(self, bundle: Bundle | None = None, *, method: str = "ddtree", budget: int | None = None,
                 max_num_seqs: int = 16, max_model_len: int | None = None, max_waiting: int = MAX_WAITING,
                 threads: int | None = None, core=None, served_names: tuple[str, ...] | None = None,
                 warm_up: bool = True, overlap: bool = False, compile: bool = False):
        self.bundle = bundle or load_bundle()
        limit = int(self.bundle.model.cfg.max_position_embeddings)
        if max_model_len is not None and not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must lie in [1, {limit}] (the model's max_position_embeddings), "
                             f"got {max_model_len}")
        if not 1 <= max_num_seqs:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        if served_names is not None and not all(name.strip() for name in served_names):
            raise ValueError(f"served model names must not be empty or blank, got {list(served_names)}")
        if core is not None and (overlap or compile):
            raise ValueError("overlap and compile configure the core that Engine builds; a core given "
                             "to Engine carries its own (build it with them: make_core(..., overlap=True))")
        device = getattr(self.bundle.model, "device", None)
        if compile and core is None and (device is None or device.type != "cuda"):
            raise ValueError("torch.compile needs a CUDA model (it fuses kernels inside the step's CUDA "
                             "graphs; the CPU runs the step eagerly)")
        self.max_model_len = max_model_len or limit
        self.budget = budget
        self.max_num_seqs, self.max_waiting = max_num_seqs, max_waiting
        self.names = tuple(served_names or (self.bundle.name,))
        self.stop_token_ids = frozenset(self.bundle.stop_token_ids)
        if threads is None and getattr(self.bundle.model, "device", None) is not None \
                and self.bundle.model.device.type == "cpu":
            threads = 1
        self._threads_before = None
        if threads is not None:
            import torch

            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(threads)  # process-wide: until close
        self.core = core if core is not None else make_core(self.bundle, max_num_seqs=max_num_seqs,
                                                            max_model_len=self.max_model_len, method=method,
                                                            budget=budget, overlap=overlap, compile=compile)
        self.method = getattr(self.core, "method", method)
        self.overlap = bool(getattr(self.core, "overlap", False))
        self.compile = bool(getattr(self.core, "compile", False))
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, Sequence]] = []
        self._adds = 0  # "add" commands in the inbox (they count as waiting)
        self._active: dict[int, Sequence] = {}
        self._outbox: dict[object, list] = {}  # post -> [(listener, event)] of this loop iteration
        self._closing = False
        self.totals = dict.fromkeys(TOTALS, 0.0)
        self._spec_base: dict = {}  # the core's spec_stats after the warm-up: /metrics counts from there
        self._state = self._read_state()
        try:
            self.metrics = Metrics(self.name, self.state)
        except ImportError:  # prometheus_client missing: running totals only
            self.metrics = None
        self._warm = warm_up
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kdlib-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread
    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def max_context(self) -> int:
        return self.max_model_len

    def info(self) -> dict:
        b = self.bundle
        return {**b.info, "method": self.method, "budget": getattr(self.core, "budget", self.budget) or None,
                "max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
                "device": str(b.model.device), "stop_token_ids": sorted(self.stop_token_ids),
                "async_scheduling": self.overlap, "torch_compile": self.compile}

    def state(self) -> dict:
        """The latest snapshot: running, waiting (incl. the inbox), pool_slots, pool_free, spec."""
        with self._cv:
            return {**self._state, "waiting": self._state["waiting"] + self._adds}

    def snapshot(self) -> dict:
        """A copy of the running totals (TOTALS)."""
        with self._cv:
            return dict(self.totals)

    def metrics_text(self) -> bytes:
        if self.metrics is None:
            raise RuntimeError("prometheus_client is not installed: no /metrics")
        return self.metrics.text()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the warm-up request is done and the loop serves."""
        return self._ready.wait(timeout)

    def check_capacity(self, n: int = 1) -> None:
        """RequestError 429 (with Retry-After) when n more sequences would overflow the waiting queue;
        400 when n alone exceeds what the server holds."""
        s = self.state()
        self._refuse_if_busy(s["running"], s["waiting"], n)

    def _refuse_if_busy(self, running: int, waiting: int, n: int) -> None:
        """The server holds max_num_seqs running sequences and max_waiting more waiting for a stream:
        n that never fit is a bad request; n that fit once others finish is a 429 (retry later)."""
        room = self.max_num_seqs + self.max_waiting
        if n > room:
            raise RequestError(f"n = {n} sequences is more than this server holds at once: "
                               f"{self.max_num_seqs} streams + {self.max_waiting} waiting", param="n",
                               code="invalid_value")
        if running + waiting + n > room:
            raise RequestError(f"the server is busy: {running} sequences run and {waiting} wait for "
                               f"{self.max_num_seqs} streams (at most {self.max_waiting} waiting); retry "
                               "later", status=429, type="rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(RETRY_AFTER_S)})

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue the sequences of one request together, or refuse them all (429)."""
        with self._cv:
            if self._closing:
                raise RequestError("the server is shutting down", status=503, type="server_error",
                                   code="shutdown")
            self._refuse_if_busy(self._state["running"], self._state["waiting"] + self._adds, len(seqs))
            for s in seqs:
                s.submitted = time.perf_counter()
                self._inbox.append(("add", s))
            self._adds += len(seqs)
            self._cv.notify()

    def cancel(self, seq: Sequence) -> None:
        """Abort a sequence before the next step (a client gone); a finished one is left alone."""
        with self._cv:
            seq.cancelled = True
            self._inbox.append(("abort", seq))
            self._cv.notify()

    def shutdown_requests(self) -> None:
        """Answer every running and waiting sequence 503 "shutdown" (each aborted in the engine) before the
        next step, on the loop's thread; the engine serves on (a server stopping over an engine it may
        not own)."""
        with self._cv:
            self._inbox.append(("shutdown", None))
            self._cv.notify()

    def run(self, prompt_ids, max_tokens: int, params=None, *, stops=(), listener=None) -> dict:
        """Generate in process and wait: {"tokens", "text", "prompt_tokens", "finish_reason", "ddtree"}.
        params: SamplingParams (default greedy); listener: also gets the sequence's events."""
        if params is None:
            from kdlib.engine.batch import SamplingParams

            params = SamplingParams(stop_token_ids=tuple(sorted(self.stop_token_ids)))
        done, box = threading.Event(), {}

        def on(ev):
            if listener is not None:
                listener(ev)
            if ev[0] in ("done", "error"):
                box["ev"] = ev
                done.set()

        self.submit([Sequence(list(prompt_ids), max_tokens, params, tuple(stops), on)])
        done.wait()
        kind, d = box["ev"]
        if kind == "error":
            raise d
        return {"tokens": list(d.token_ids), "text": d.text, "prompt_tokens": len(prompt_ids),
                "finish_reason": d.finish_reason, "ddtree": d.stats}

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout=60)
        if self._threads_before is not None:
            import torch

            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    # ------------------------------------------------------------------ the loop's thread
    def _read_state(self) -> dict:
        c = self.core
        return {"running": c.num_running, "waiting": c.num_waiting, "pool_slots": c.pool_slots,
                "pool_free": c.pool_free_slots, "spec": self._spec_since(self._spec_base)}

    def _spec_since(self, base: dict) -> dict:
        """The core's spec_stats less `base` (counts, and the per-position list element by element)."""
        spec = getattr(self.core, "spec_stats", None) or {}
        out = {}
        for k, v in spec.items():
            b = base.get(k)
            if isinstance(v, list | tuple):
                out[k] = [x - (b[i] if b is not None and i < len(b) else 0) for i, x in enumerate(v)]
            else:
                out[k] = v - (b or 0)
        return out

    def _loop(self) -> None:
        import torch

        with torch.no_grad():  # grad mode is per thread
            if self._warm:
                self._warm_up()
            self._ready.set()
            while True:
                with self._cv:
                    while not self._inbox and not self._closing and not self.core.has_work():
                        self._cv.wait()
                    if self._closing:
                        break
                    cmds, self._inbox = self._inbox, []
                    self._state["waiting"] += self._adds  # until the next snapshot counts them in the engine
                    self._adds = 0
                try:
                    for kind, seq in cmds:
                        if kind == "shutdown":
                            self._fail_all(_shutdown_error())
                        else:
                            (self._add if kind == "add" else self._abort)(seq)
                    if self.core.has_work():
                        self._step()
                    state = self._read_state()
                except Exception as e:  # noqa: BLE001 - a bug of ours or the engine's: fail what runs, go on
                    self._fail_all(RequestError(f"server error: {type(e).__name__}: {e}", status=500,
                                                type="server_error"))
                    state = self._read_state()
                with self._cv:
                    self._state = state
                self._flush()
        self._fail_all(_shutdown_error())
        for kind, seq in self._inbox:
            if kind == "add":
                self._emit(seq, "error", _shutdown_error())
        self._flush()

    def _emit(self, seq: Sequence, kind: str, payload) -> None:
        if seq.post is None:
            seq.emit(kind, payload)
        else:
            self._outbox.setdefault(seq.post, []).append((seq.listener, (kind, payload)))

    def _flush(self) -> None:
        """Hand this iteration's events over: one call per listener thread."""
        box, self._outbox = self._outbox, {}
        for post, items in box.items():
            try:
                post(_deliver, items)
            except RuntimeError:  # that event loop has closed (server shut down): nobody to tell
                pass

    def _fail_all(self, err: RequestError) -> None:
        """Fail (and abort in the engine) every running or waiting sequence."""
        for seq in list(self._active.values()):
            try:
                self.core.abort(seq.rid)
            except Exception:  # noqa: BLE001 - the engine is already in trouble
                pass
            self._fail(seq, err)

    def _warm_up(self) -> None:
        """One short untimed request: torch's first calls (allocator growth, kernel selection) cost
        seconds and would land in the first client's timings. A failure shows on real requests. Its
        draft rounds are left out of the spec-decode counters (`_spec_base`), as it is of the totals."""
        from kdlib.engine.batch import SamplingParams

        try:
            rid = self.core.add_request([0] * 8, 8, SamplingParams())
            while self.core.has_work():
                self.core.step()
            self.core.abort(rid)
        except Exception:  # noqa: BLE001 - reported by the first real request instead
            pass
        self._spec_base = self._spec_since({})  # its draft rounds are nobody's: /metrics leaves them out

    def _add(self, seq: Sequence) -> None:
        try:
            seq.text = TextStream(self.bundle.tokenizer, seq.stops)
            if seq.cancelled:  # the client left before the sequence reached the engine
                self._finish(seq, "abort", time.perf_counter())
                return
            if seq.prompt_logprobs is not None:
                self._emit(seq, "prompt", self.core.prompt_logprobs(seq.prompt_ids, seq.prompt_logprobs))
            seq.rid = self.core.add_request(seq.prompt_ids, seq.max_tokens, seq.params)
        except ValueError as e:
            self._emit(seq, "error", RequestError(str(e), code="invalid_value"))
            return
        except Exception as e:  # noqa: BLE001 - reported to the client; the loop keeps serving
            if self.metrics is not None:  # a server error, as _fail counts one a step later
                self.metrics.requests.labels("error").inc()
            self._emit(seq, "error", RequestError(f"generation failed: {type(e).__name__}: {e}", status=500,
                                           type="server_error"))
            return
        self._active[seq.rid] = seq
        with self._cv:
            self.totals["prompt_tokens"] += len(seq.prompt_ids)
        if self.metrics is not None:
            self.metrics.prompt.inc(len(seq.prompt_ids))

    def _abort(self, seq: Sequence) -> None:
        if seq.rid is not None and self._active.get(seq.rid) is seq:
            self.core.abort(seq.rid)
            self._finish(seq, "abort", time.perf_counter())

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outs = self.core.step()
        except Exception as e:  # noqa: BLE001 - every running request fails; the loop keeps serving
            self._fail_all(RequestError(f"generation failed: {type(e).__name__}: {e}", status=500,
                                        type="server_error"))
            return
        now = time.perf_counter()
        dt = now - t0
        by_request: dict[int, list] = {}  # a request admitted in this step has its prefill's output too
        for o in outs:
            by_request.setdefault(o.request_id, []).append(o)
        taus = []
        m = self.metrics
        for rid, group in by_request.items():
            seq = self._active.get(rid)
            if seq is None:
                continue
            failed = next((o.error for o in group if o.finish_reason == "error"), None)
            if failed is not None:  # its prefill raised: this sequence fails, the others go on
                self._fail(seq, RequestError(f"generation failed: {failed}", status=500, type="server_error"))
                continue
            if seq.first_at is None:
                seq.first_at = now
                seq.first_tokens = sum(len(o.new_tokens) for o in group)
                if m is not None:
                    m.ttft.observe(now - seq.submitted)
                    m.ttft_kdlib.observe(now - seq.submitted)
            elif m is not None:
                m.itl.observe(now - seq.last_at)
            seq.last_at = now
            try:
                for o in group:
                    if self._active.get(rid) is not seq:  # finished by a stop string in the prefill's token:
                        break  # the decode step computed beside it is no step of this answer
                    tau = self._advance(seq, o, now, dt)
                    if tau is not None:
                        taus.append(tau)
            except Exception as e:  # noqa: BLE001 - this sequence fails, the others go on
                self.core.abort(rid)
                self._fail(seq, RequestError(f"server error: {type(e).__name__}: {e}", status=500,
                                             type="server_error"))
        if not taus:
            return
        with self._cv:
            t = self.totals
            t["accept_sum"] += sum(taus)
            t["accept_count"] += len(taus)
            t["step_sum_s"] += dt
            t["step_count"] += 1
        if m is not None:
            m.step.observe(dt)
            m.batch.observe(len(taus))
            m.decode_s.inc(dt)
            for tau in taus:
                m.accept.observe(tau)

    def _advance(self, seq: Sequence, o, now: float, dt: float) -> int | None:
        """Hand seq the output o of a step of dt seconds. Returns a decode step's tau, the tokens it
        added to the answer: o.accepted less those cut at max_tokens, an end of text or a stop string
        (None for the prefill's token)."""
        toks = [int(t) for t in o.new_tokens]
        lps = list(o.logprobs) if o.logprobs is not None else None
        finished, reason = o.finished, o.finish_reason
        # end-of-text: counted, not shown
        shown = [j for j, t in enumerate(toks) if t not in self.stop_token_ids]
        min_tokens = getattr(seq.params, "min_tokens", 0)
        first_checked = next((k for k, j in enumerate(shown) if len(seq.tokens) + j + 1 > min_tokens),
                             len(shown))
        used = seq.text.push([toks[j] for j in shown], check_from=first_checked)
        if used is not None:  # a stop string: keep the tokens up to the one completing it
            toks = toks[: shown[used - 1] + 1]
            lps = lps[: len(toks)] if lps is not None else None  # one a token, shown or not
            if not finished:
                self.core.abort(seq.rid)
            finished, reason = True, "stop"
        tau = None
        if o.accepted > 0:  # a decode step (the prefill's token accepts 0); recorded before _finish's stats
            tau = len(toks)
            seq.accepted.append(tau)
            seq.step_ms.append(dt * 1e3)
        seq.tokens.extend(toks)
        with self._cv:
            self.totals["generation_tokens"] += len(toks)
        if self.metrics is not None:
            self.metrics.gen.inc(len(toks))
        text = seq.text.take(final=finished)
        if toks or text:
            self._emit(seq, "delta", Delta(seq.index, text, tuple(toks),
                                           tuple(lps) if lps is not None else None, len(seq.tokens), now))
        if finished:
            self._finish(seq, reason or "length", now)
        return tau

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        self._active.pop(seq.rid, None)
        stats = seq.stats(self.method, getattr(self.core, "budget", self.budget) or None)
        with self._cv:
            self.totals["requests"] += 1
        m = self.metrics
        if m is not None:
            m.requests.labels(reason).inc()
            m.e2e.observe(now - seq.submitted)
            if stats["decode_tokens_per_s"] is not None:
                m.rate.observe(stats["decode_tokens_per_s"])
        self._emit(seq, "done", Done(seq.index, reason, tuple(seq.tokens), seq.text.text, stats, now))

    def _fail(self, seq: Sequence, err: RequestError) -> None:
        self._active.pop(seq.rid, None)
        if self.metrics is not None:
            self.metrics.requests.labels("error").inc()
        self._emit(seq, "error", err)
