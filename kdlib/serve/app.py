"""The FastAPI application: OpenAI's routes over an `Engine`, with admission control in front.

    app = create_app(engine, api_key=None, max_body_bytes=MAX_BODY_BYTES)

In front of every route (`Guard`, plain ASGI): the API key (Bearer, on /v1/* only; 401), then
the body size (413 from Content-Length before any byte is read, or as soon as a chunked body
passes the limit). Bodies are validated by the pydantic models of `kdlib.serve.protocol`;
tokenisation and the checks that need the tokenizer run in a worker thread, off the event
loop; a request whose sequences would overflow the waiting queue gets 429 with Retry-After.
A client that disconnects has its sequences cancelled (streaming or not): the engine drops
them before its next step.

Responses follow OpenAI's shapes; each choice also carries `ddtree` (kdlib's extension: method,
budget, steps, per-step accepted lengths and step ms, TTFT, decode tokens/s). Streaming is SSE:
one chunk per engine step per choice with text, then the choice's finishing chunk (with its
`ddtree`), the usage chunk when `stream_options.include_usage`, and `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import time
import uuid
from dataclasses import dataclass

from kdlib.engine.generate import MAX_TEMPERATURE, MIN_TEMPERATURE
from kdlib.serve.engine import Engine, RequestError, Sequence
from kdlib.serve.text import REPLACEMENT, TokenOffsets

MAX_BODY_BYTES = 1 << 20  # 1 MiB: ~100x the longest prompt the tiny models' 2,048-token context takes
COMPLETIONS_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's and vLLM's default)
GREEDY_BELOW = MIN_TEMPERATURE  # a temperature below this samples greedily (vLLM's rule: 1 / T overflows)


def _error_response(err: RequestError):
    from fastapi.responses import JSONResponse

    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class Guard:
    """ASGI middleware: API key on /v1/*, then the request body size (module docstring)."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.limit = app, api_key, max_body_bytes

    async def _refuse(self, scope, receive, send, err: RequestError) -> None:
        await _error_response(err)(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if self.api_key is not None and scope["path"].startswith("/v1"):
            got = headers.get(b"authorization", b"")
            if not hmac.compare_digest(got, b"Bearer " + self.api_key.encode()):
                return await self._refuse(scope, receive, send, RequestError(
                    "invalid or missing API key (send 'Authorization: Bearer <key>')", status=401,
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await self._refuse(scope, receive, send, RequestError("invalid Content-Length",
                                                                             code="invalid_request"))
            if int(length) > self.limit:
                return await self._refuse(scope, receive, send, self._too_large(f"{int(length)} bytes"))
        chunks, total = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            total += len(body)
            if total > self.limit:
                more = f"more than {self.limit} bytes"  # the rest is left unread: its size is unknown
                return await self._refuse(scope, receive, send, self._too_large(more))
            chunks.append(body)
            if not msg.get("more_body"):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def receive_again():
            return replay.pop() if replay else await receive()

        await self.app(scope, receive_again, send)

    def _too_large(self, size: str) -> RequestError:
        return RequestError(f"the request body is too large ({size}; the limit is {self.limit})", status=413,
                            code="request_too_large")


@dataclass
class Plan:
    """A validated request, ready for the engine. logprobs: top-n per token (None = off)."""

    prompt_ids: list[int]
    prompt_text: str
    max_tokens: int
    params: list
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None
    echo: bool


def plan_request(req, engine: Engine, chat: bool) -> Plan:
    """Tokenise and check a validated body against the model (runs in a worker thread)."""
    from kdlib.engine.batch import SamplingParams
    from kdlib.serve.protocol import render_chat

    if req.model is not None and req.model not in engine.names:
        raise RequestError(f"the model '{req.model}' does not exist; this server serves {list(engine.names)}",
                           status=404, param="model", code="model_not_found")
    tok, vocab = engine.bundle.tokenizer, engine.bundle.model.cfg.vocab_size
    where = "messages" if chat else "prompt"

    def encode(text: str) -> list[int]:
        try:  # encode_batch: the trained tokenizer lets go of the GIL there (encode holds it throughout)
            return tok.encode_batch([text])[0] if hasattr(tok, "encode_batch") else tok.encode(text)
        except Exception as e:  # noqa: BLE001 - the tokenizer's own failure (protocol refuses lone surrogates)
            raise RequestError(f"the {where} cannot be tokenised: {type(e).__name__}: {str(e)[:200]}",
                               param=where, code="invalid_value") from None

    if chat:
        prompt_text = render_chat(req.messages)
        ids = encode(prompt_text)
    elif isinstance(req.prompt, str):
        prompt_text, ids = req.prompt, encode(req.prompt)
    else:
        ids = list(req.prompt)
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt token ids must lie in [0, {vocab})", param="prompt",
                               code="invalid_value")
        prompt_text = tok.decode(ids) if req.echo else ""
    if not ids:
        raise RequestError("the prompt is empty", param=where, code="invalid_value")
    limit = engine.max_model_len
    if len(ids) >= limit:
        raise RequestError(f"this model's maximum context length is {limit} tokens; the prompt alone has "
                           f"{len(ids)}", param=where, code="context_length_exceeded")
    key = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(req, key)
    if not chat and key not in req.model_fields_set:  # OpenAI's legacy default, cut to the context
        max_tokens = min(COMPLETIONS_MAX_TOKENS, limit - len(ids))
    if max_tokens is None:
        max_tokens = limit - len(ids)  # chat without it, or an explicit null: the rest of the context (vLLM)
    elif len(ids) + max_tokens > limit:
        raise RequestError(f"this model's maximum context length is {limit} tokens; the request asks for "
                           f"{len(ids)} prompt + {max_tokens} completion tokens", param=key,
                           code="context_length_exceeded")
    min_tokens = req.min_tokens or 0
    if min_tokens > max_tokens:
        raise RequestError(f"min_tokens ({min_tokens}) exceeds max_tokens ({max_tokens})", param="min_tokens",
                           code="invalid_value")
    logprobs = ((req.top_logprobs or 0) if req.logprobs else None) if chat else req.logprobs
    if not chat and req.echo and logprobs is not None and not hasattr(engine.core, "prompt_logprobs"):
        raise RequestError("echo with logprobs needs the prompt's logprobs, which this engine does not "
                           "compute", param="echo", code="unsupported")
    seed = None if req.seed is None else req.seed % 2**64
    n = req.n or 1
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature > MAX_TEMPERATURE:  # a 400 here, before a stream's 200 is sent
        raise RequestError(f"temperature must be at most {MAX_TEMPERATURE:.4g} (float32's range), got "
                           f"{temperature!r}", param="temperature", code="invalid_value")
    # k >= the vocabulary: no filter
    top_k = 0 if req.top_k in (None, -1) or req.top_k >= vocab else req.top_k
    params = [SamplingParams(temperature=temperature if temperature >= GREEDY_BELOW else 0.0,
                             top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k,
                             seed=None if seed is None else (seed + i) % 2**64,
                             stop_token_ids=tuple(sorted(engine.stop_token_ids)),
                             ignore_eos=bool(req.ignore_eos), min_tokens=min_tokens, logprobs=logprobs)
              for i in range(n)]
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = include_usage and bool(req.stream_options.continuous_usage_stats)  # vLLM's: beside it only
    return Plan(ids, prompt_text, max_tokens, params, tuple(req.stop or ()), bool(req.stream), include_usage,
                continuous, logprobs, bool(getattr(req, "echo", False)))


class _Logprobs:
    """OpenAI's logprobs shapes from the engine's per-token dicts {"token", "logprob", "top"}."""

    def __init__(self, tokenizer, chat: bool):
        self.tok, self.chat = tokenizer, chat

    def piece(self, i: int) -> str:
        """Token i's text; a token that is not whole UTF-8 characters (all such decode to U+FFFD) gets its
        bytes, as OpenAI spells them ("bytes:\\xe6\\x97"): distinct tokens keep distinct pieces."""
        s = self.tok.decode([i])
        if REPLACEMENT in s and hasattr(self.tok, "token_bytes"):
            raw = self.tok.token_bytes(i)
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return s

    def chat_content(self, entries) -> list[dict]:
        def one(i, lp):
            s = self.piece(i)
            raw = self.tok.token_bytes(i) if hasattr(self.tok, "token_bytes") else s.encode()
            return {"token": s, "logprob": lp, "bytes": list(raw)}  # a character's share of its bytes

        return [{**one(e["token"], e["logprob"]), "top_logprobs": [one(i, lp) for i, lp in e["top"]]}
                for e in entries]

    def completion(self, entries, at: TokenOffsets, hidden=frozenset()) -> dict:
        """at: the choice's offsets, pushed each entry's token in turn (`hidden`: ids its text does not show).
        An entry's "top" None: no alternatives. top_logprobs holds the sampled token beside the top ones
        (OpenAI: up to logprobs + 1 of them)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            s = self.piece(e["token"])
            out["tokens"].append(s)
            out["token_logprobs"].append(e["logprob"])
            top = None if e["top"] is None else {self.piece(i): lp for i, lp in e["top"]}
            if top is not None:
                top.setdefault(s, e["logprob"])
            out["top_logprobs"].append(top)
            out["text_offset"].append(at.push(e["token"], e["token"] not in hidden))
        return out


class _Request:
    """One HTTP request's sequences and their event queue on the event loop."""

    def __init__(self, engine: Engine, plan: Plan, loop):
        self.engine, self.plan = engine, plan
        self.queue: asyncio.Queue = asyncio.Queue()
        want = plan.logprobs if plan.echo and plan.logprobs is not None else None
        self.seqs = [Sequence(plan.prompt_ids, plan.max_tokens, p, plan.stops, self.queue.put_nowait, index=i,
                              prompt_logprobs=want if i == 0 else None, post=loop.call_soon_threadsafe)
                     for i, p in enumerate(plan.params)]
        self.open = len(self.seqs)

    def submit(self) -> None:
        self.engine.submit(self.seqs)

    def cancel(self) -> None:
        """Cancel what has not finished (idempotent)."""
        if self.open:
            self.open = 0
            for s in self.seqs:
                self.engine.cancel(s)

    async def events(self, gone: asyncio.Future | None = None):
        """The engine's events until every sequence is done; raises the first error; stops quietly
        (after cancelling) when `gone` (the client's disconnect) resolves first."""
        while self.open:
            get = asyncio.ensure_future(self.queue.get())
            if gone is not None:
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    self.cancel()
                    return
            kind, payload = await get
            if kind == "error":
                self.cancel()
                raise payload
            if kind == "done":
                self.open -= 1
            yield kind, payload


async def _disconnected(request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(engine: Engine, *, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES):
    """The FastAPI application serving `engine` (see the module docstring)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException

    from kdlib.serve.protocol import ChatCompletionRequest, CompletionRequest, error_from_validation

    app = FastAPI(title="kdlib serve", version="0.2.0")
    counter = itertools.count()

    @app.exception_handler(RequestError)
    async def _request_error(request, e: RequestError):
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        return _error_response(error_from_validation(e.errors()))

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        codes = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}
        code = codes.get(e.status_code, str(e.status_code))
        # FastAPI's 400 for a body json.loads cannot take (not UTF-8, nested past the recursion limit)
        msg = "the request body is not valid JSON (not UTF-8, or nested too deeply)" if e.status_code == 400 \
            else str(e.detail)
        return _error_response(RequestError(msg, status=e.status_code, code=code, headers=e.headers))

    @app.exception_handler(Exception)
    async def _crash(request, e: Exception):
        return _error_response(RequestError(f"internal error: {type(e).__name__}: {e}", status=500,
                                            type="server_error"))

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "kdlib",
                "max_model_len": engine.max_model_len, "kdlib": engine.info()}

    @app.get("/health")
    async def health():
        s = engine.state()
        return {"status": "ok", "model": engine.name, "running": s["running"], "waiting": s["waiting"],
                "kdlib": engine.info()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(n) for n in engine.names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in engine.names:
            raise RequestError(f"the model '{model_id}' does not exist; this server serves "
                               f"{list(engine.names)}", status=404, param="model", code="model_not_found")
        return model_card(model_id)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(engine.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    async def complete(request, body, chat: bool):
        engine.check_capacity(body.n or 1)  # before tokenising: a full server refuses at once
        plan = await run_in_threadpool(plan_request, body, engine, chat)
        r = _Request(engine, plan, asyncio.get_running_loop())
        r.submit()
        name = body.model or engine.name
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:20]}-{next(counter)}"
        created = int(time.time())
        lp = _Logprobs(engine.bundle.tokenizer, chat)
        hidden = engine.stop_token_ids  # generated, counted, not shown in the text
        prompt_n = len(plan.prompt_ids)

        def prompt_entries(per_position) -> list:
            """The engine's prompt logprobs with position 0 (no logprob: nothing precedes it) filled in."""
            return [{"token": plan.prompt_ids[0], "logprob": None, "top": None}, *per_position[1:]]

        def usage(completion: int) -> dict:
            return {"prompt_tokens": prompt_n, "completion_tokens": completion,
                    "total_tokens": prompt_n + completion}

        if not plan.stream:
            gone = asyncio.ensure_future(_disconnected(request))
            try:
                prompt_lp, token_lp, dones = None, [[] for _ in r.seqs], {}
                async for kind, d in r.events(gone):
                    if kind == "prompt":
                        prompt_lp = d
                    elif kind == "delta" and d.logprobs is not None:
                        token_lp[d.index].extend(d.logprobs)
                    elif kind == "done":
                        dones[d.index] = d
            finally:
                gone.cancel()
                r.cancel()
            if len(dones) < len(r.seqs):
                return Response(status_code=499)  # the client is gone; nobody reads this
            choices = []
            for i in range(len(r.seqs)):
                d = dones[i]
                text = (plan.prompt_text + d.text) if plan.echo else d.text
                if chat:
                    c = {"index": i, "message": {"role": "assistant", "content": text},
                         "logprobs": ({"content": lp.chat_content(token_lp[i])} if plan.logprobs is not None
                                      else None)}
                else:
                    logprobs = None
                    if plan.logprobs is not None:  # the echoed prompt's entries first, as streamed
                        at = TokenOffsets(lp.tok)
                        echoed = None if prompt_lp is None else lp.completion(prompt_entries(prompt_lp), at)
                        logprobs = lp.completion(token_lp[i], at, hidden)
                        if echoed is not None:
                            logprobs = {k: echoed[k] + logprobs[k] for k in logprobs}
                    c = {"index": i, "text": text, "logprobs": logprobs}
                choices.append({**c, "finish_reason": d.finish_reason, "ddtree": d.stats})
            return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                    "model": name, "choices": choices,
                    "usage": usage(sum(len(d.token_ids) for d in dones.values()))}

        obj = "chat.completion.chunk" if chat else "text_completion"

        def sse(d: dict) -> str:
            return f"data: {json.dumps(d, separators=(',', ':'))}\n\n"

        async def stream():
            counts = [0] * len(r.seqs)
            offsets = [TokenOffsets(lp.tok) for _ in r.seqs]  # after the echoed prompt's entries, if any
            first = [True] * len(r.seqs)

            def chunk(i: int, text: str, logprobs=None, finish=None, **extra) -> dict:
                if chat:
                    delta = ({"role": "assistant", "content": text} if first[i]
                             else ({"content": text} if text else {}))
                    first[i] = False
                    choice = {"index": i, "delta": delta,
                              "logprobs": {"content": logprobs} if logprobs is not None else None}
                else:
                    choice = {"index": i, "text": text, "logprobs": logprobs}
                d = {"id": rid, "object": obj, "created": created, "model": name,
                     "choices": [{**choice, "finish_reason": finish, **extra}]}
                if plan.continuous_usage:  # the choice's own tokens so far (vLLM's)
                    d["usage"] = usage(counts[i])
                elif plan.include_usage:  # OpenAI's: null in every chunk before the usage chunk
                    d["usage"] = None
                return d

            try:
                if plan.echo and plan.logprobs is None:
                    for i in range(len(r.seqs)):
                        yield sse(chunk(i, plan.prompt_text))
                async for kind, d in r.events():
                    if kind == "prompt":  # echo + logprobs: the prompt with its own logprobs first
                        for i in range(len(r.seqs)):
                            echoed = lp.completion(prompt_entries(d), offsets[i])
                            yield sse(chunk(i, plan.prompt_text, echoed))
                        continue
                    if kind == "delta":
                        counts[d.index] = d.completion_tokens
                        logprobs = None
                        if d.logprobs is not None:
                            logprobs = (lp.chat_content(d.logprobs) if chat
                                        else lp.completion(d.logprobs, offsets[d.index], hidden))
                        yield sse(chunk(d.index, d.text, logprobs))
                    elif kind == "done":
                        counts[d.index] = len(d.token_ids)
                        yield sse(chunk(d.index, "", finish=d.finish_reason, ddtree=d.stats))
                if plan.include_usage:
                    yield sse({"id": rid, "object": obj, "created": created, "model": name, "choices": [],
                               "usage": usage(sum(counts))})
            except RequestError as e:
                yield sse(e.body())
            yield "data: [DONE]\n\n"

        return _Stream(stream(), r.cancel)

    class _Stream(StreamingResponse):
        """SSE whose sequences are cancelled however it ends (done, client gone, server error)."""

        def __init__(self, gen, on_close):
            super().__init__(gen, media_type="text/event-stream")
            self._on_close = on_close

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self._on_close()

    async def completions(request: Request, body: CompletionRequest):
        return await complete(request, body, chat=False)

    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await complete(request, body, chat=True)

    # The annotations FastAPI injects by (set here: this module's postponed annotations would name
    # classes that exist only inside this function).
    for route, fn, model in (("/v1/completions", completions, CompletionRequest),
                             ("/v1/chat/completions", chat_completions, ChatCompletionRequest)):
        fn.__annotations__.update(request=Request, body=model)
        app.post(route)(fn)
    return Guard(app, api_key=api_key, max_body_bytes=max_body_bytes)
