"""Robustness of `kdlib serve` (a child process on 127.0.0.1, the trained tiny models on CPU): 200
concurrent streams with 30 % of the clients hanging up at random points, and hostile bodies. Every
wait is bounded; the server must stay up, serve greedy outputs equal to the sequential ones, and end
with an empty batch and a free KV pool."""

import asyncio
import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kdlib import serve, zoo
from kdlib.diagnose import parse_metrics
from kdlib.serve import server as server_mod

pytest.importorskip("fastapi")  # the GPU machine has no web stack unless its wheels were brought
openai = pytest.importorskip("openai")
text_string_to_metric_families = pytest.importorskip(
    "prometheus_client.parser").text_string_to_metric_families

CONTEXT = 96
CLIENTS = 200
HANG_UP = 0.3
PROMPTS = ["def add(a, b):\n", "The weather today", "import numpy as np\n", "Dear Sir,\n",
           "for i in range(10):", "class Stack:\n", "Once upon a time", "# Notes\n\n"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server():
    if not zoo.available():
        pytest.skip("the trained models are not in data/models/")
    with serve.ServerProcess(["--max-num-seqs", "16", "--max-model-len", str(CONTEXT), "--max-body-bytes",
                              str(1 << 20)]) as srv:
        yield srv


def _body(i: int, **kw) -> dict:
    """Request spec i: a prompt, and end-of-text honoured or not (both paths under load)."""
    return {"model": "kdtree-tiny", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": (i // len(PROMPTS)) % 2 == 1, **kw}


SPECS = 2 * len(PROMPTS)


def _metrics(url: str) -> dict:
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


def _by_status(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.labels["status"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "kdlib_requests" for s in f.samples if s.name == "kdlib_requests_total"}


def _settled(url: str, timeout: float = 30.0) -> dict:
    """/metrics once no request runs or waits (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url)
        idle = m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


@pytest.fixture(scope="module")
def reference(server):
    """Each spec's greedy text, one request at a time."""
    out = []
    for i in range(SPECS):
        r = httpx.post(server.url + "/v1/completions", json=_body(i), timeout=60)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


async def _client(k: int, url: str, rng: random.Random, oa: openai.AsyncOpenAI,
                  http: httpx.AsyncClient) -> dict:
    """Client k streams spec k % SPECS; HANG_UP of them leave after a random number of events (0: at once)."""
    spec = k % SPECS
    leave = rng.randrange(0, 6) if rng.random() < HANG_UP else None
    got, n = [], 0
    if k % 2:  # the official client
        b = _body(spec)
        stream = await oa.completions.create(model=b["model"], prompt=b["prompt"], max_tokens=b["max_tokens"],
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": b["ignore_eos"]})
        try:
            async for chunk in stream:
                if leave is not None and n >= leave:
                    return {"spec": spec, "left": True}
                n += 1
                got += [c.text for c in chunk.choices]
        finally:
            await stream.close()
    else:  # raw SSE over httpx
        async with http.stream("POST", url + "/v1/completions", json=_body(spec, stream=True)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if leave is not None and n >= leave:
                    return {"spec": spec, "left": True}
                if line.startswith("data: {"):
                    n += 1
                    got += [c["text"] for c in json.loads(line[6:])["choices"]]
    return {"spec": spec, "left": False, "text": "".join(got)}


async def _crowd(url: str) -> list[dict]:
    rng = random.Random(17)
    limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http, \
            openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120,
                               http_client=httpx.AsyncClient(timeout=120, limits=limits)) as oa:
        clients = (_client(k, url, rng, oa, http) for k in range(CLIENTS))
        return await asyncio.wait_for(asyncio.gather(*clients), timeout=150)


def test_200_streams_with_clients_hanging_up(server, reference):
    before = _metrics(server.url)
    results = asyncio.run(_crowd(server.url))
    left = [r for r in results if r["left"]]
    done = [r for r in results if not r["left"]]
    assert 0.2 * CLIENTS < len(left) < 0.4 * CLIENTS and len(done) + len(left) == CLIENTS
    bad = [r["spec"] for r in done if r["text"] != reference[r["spec"]]]
    assert not bad, f"{len(bad)} completed streams differ from their sequential output (specs {bad[:8]})"
    m = _settled(server.url)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["kdlib_kv_pool_free_slots"] == m["kdlib_kv_pool_slots"]
    finished = m["kdlib_requests_total"] - before.get("kdlib_requests_total", 0)
    assert finished == CLIENTS  # every stream ended: finished, stopped or aborted, none lost
    aborted = _by_status(server.url).get("abort", 0)
    assert 0 < aborted <= len(left)  # hung-up clients were cancelled (those not already served)
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
    r = httpx.post(server.url + "/v1/completions", json=_body(3), timeout=60)
    assert r.json()["choices"][0]["text"] == reference[3]


def test_tokenising_a_large_prompt_does_not_stall_the_server(server):
    """The server in its own process: the client's requests do not compete with it for a GIL."""
    big = ("def f(x):\n    return x * 2  # twice\n" * 30_000)[:900_000]  # JSON under the 1 MiB body limit

    def post():
        return httpx.post(server.url + "/v1/completions", json={"prompt": big, "max_tokens": 1}, timeout=60)

    with ThreadPoolExecutor(1) as ex, httpx.Client(base_url=server.url, timeout=10) as c:
        fut = ex.submit(post)
        answered = 0  # /health answers while the prompt was in flight: an event loop that tokenised it
        while not fut.done():  # would answer one, maybe two, and then the prompt's error
            assert c.get("/health").status_code == 200
            answered += 1
        r = fut.result()
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert answered >= 5, f"only {answered} /health answers while a prompt was tokenised"


def test_accepted_connections_send_without_nagle():
    """A response on a kept-alive connection waited ~40 ms for the client's delayed ACK: asyncio sets
    TCP_NODELAY on what a listener accepts only where the listener was made with proto IPPROTO_TCP."""
    async def main():
        got = asyncio.get_running_loop().create_future()

        def handle(reader, writer):
            got.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        listener = server_mod.bind("127.0.0.1", 0)
        srv = await asyncio.start_server(handle, sock=listener)
        async with srv:
            _, writer = await asyncio.open_connection(*listener.getsockname())
            nodelay = await asyncio.wait_for(got, 30)
            writer.close()
        return nodelay

    assert asyncio.run(main()) != 0


# ----------------------------------------------------------------------------- hostile bodies
WRONG_TYPE = {
    "model": [1, True, [], {}], "prompt": [5, True, {}, [1.5], [True], [[1], [2]], ["a", "b"], None],
    "max_tokens": ["8", 1.5, True, [], {}], "temperature": ["0", True, [], {}], "top_p": ["1", True, {}],
    "top_k": ["1", 1.5, True], "n": ["2", 2.0, True], "seed": ["1", 1.5, True],
    "stop": [1, [1], {"a": 1}, True],
    "stream": ["yes", 1, []], "stream_options": ["x", [], {"include_usage": "yes"}, {"bogus": True}],
    "user": [1, [], {}], "ignore_eos": ["true", 1], "min_tokens": ["1", 1.5], "echo": ["1", 1],
    "logprobs": ["1", True, 1.5], "best_of": ["1", 1.5], "suffix": [1, []], "frequency_penalty": ["0", []],
    "presence_penalty": [[], "0"], "logit_bias": ["x", {"1": "a"}, []], "repetition_penalty": ["1"],
}
OUT_OF_RANGE = {
    "max_tokens": [0, -1, 10**30, CONTEXT], "temperature": [-0.1, -1e308, 1e39], "top_p": [0, 1.5, -1],
    "top_k": [-2, -(10**30)], "n": [0, 17, 10**30], "seed": [2**64, -(2**63) - 1, 10**40],
    "min_tokens": [-1, 10**9], "logprobs": [-1, 21, 10**9], "best_of": [0, 3],
    "stop": [["a"] * 5, [""], ["x" * 10_000]], "prompt": [[-1], [10**9], [2**70], "", []],
    "frequency_penalty": [0.5], "presence_penalty": [-2.0], "logit_bias": [{"1": 100}], "suffix": ["s"],
    "repetition_penalty": [1.2],
}
CHAT_BAD = [{"messages": m} for m in (None, [], {}, "hi", [{"role": "robot", "content": "x"}],
                                      [{"role": "user"}], [{"role": "user", "content": 3}],
                                      [{"role": "user", "content": [{"type": "x"}]}],
                                      [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                                      [{"role": "user", "content": "x", "name": 3}], [[]])] + [
    {"messages": [{"role": "user", "content": "x"}], **extra} for extra in (
        {"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2}, {"tools": [{"type": "function"}]},
        {"response_format": {"type": "json_object"}}, {"max_completion_tokens": 0}, {"echo": True},
        {"store": True})]


def _raw_cases() -> list[tuple[str, bytes, dict]]:
    """(name, body bytes, extra headers) of bodies that are not (valid) JSON objects."""
    deep_list = b"[" * 100_000 + b"]" * 100_000
    nested = b'{"prompt": ' + b"[" * 5000 + b"1" + b"]" * 5000 + b"}"
    deep_obj = b'{"messages": [{"role": "user", "content": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3000 + b"}]}"
    return [("empty", b"", {}), ("not json", b"{not json", {}), ("array", b"[1, 2]", {}),
            ("string", b'"x"', {}), ("number", b"5", {}), ("null", b"null", {}), ("deep list", deep_list, {}),
            ("deep prompt", nested, {}),
            ("deep object", deep_obj, {}), ("invalid utf-8", b'{"prompt": "\xff\xfe\xfd"}', {}),
            ("utf-16 bom", b'\xff\xfe{\x00}\x00', {}), ("lone surrogate", b'{"prompt": "\\ud800"}', {}),
            ("nan", b'{"prompt": "x", "temperature": NaN}', {}),
            ("inf", b'{"prompt": "x", "top_p": Infinity}', {}),
            ("huge exponent", b'{"prompt": "x", "temperature": 1e400}', {}),
            ("10,000 stop strings",
             json.dumps({"prompt": "x", "stop": [f"s{i}" for i in range(10_000)]}).encode(), {}),
            ("10,000 unknown fields",
             json.dumps({"prompt": "x", **{f"f{i}": i for i in range(10_000)}}).encode(), {}),
            ("text/plain", b'{"prompt": "x"}', {"content-type": "text/plain"}),
            ("null everywhere", json.dumps(dict.fromkeys(["prompt", *WRONG_TYPE], None)).encode(), {})]


def _cases() -> list[tuple[str, str, bytes, dict]]:
    out = [(f"{f}={v!r}"[:60], "/v1/completions",
            json.dumps({"prompt": "x", "stream": f == "stream_options", f: v} if f != "prompt"
                       else {"prompt": v}).encode(), {})
           for table in (WRONG_TYPE, OUT_OF_RANGE) for f, vals in table.items() for v in vals]
    out += [(f"chat {json.dumps(b)[:50]}", "/v1/chat/completions", json.dumps(b).encode(), {})
            for b in CHAT_BAD]
    out += [(name, "/v1/completions", body, headers) for name, body, headers in _raw_cases()]
    return out


def test_hostile_bodies_get_4xx_json_errors_and_nothing_else_is_affected(server, reference):
    url = server.url
    canary, texts = _body(5, stream=True, max_tokens=CONTEXT - 16, ignore_eos=True), []

    async def barrage():
        async with httpx.AsyncClient(timeout=60) as c:
            async def watch():  # a long stream running through the whole barrage
                async with c.stream("POST", url + "/v1/completions", json=canary) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            texts.extend(ch["text"] for ch in json.loads(line[6:])["choices"])

            task = asyncio.ensure_future(watch())
            replies = []
            for name, path, body, headers in _cases():
                r = await c.post(url + path, content=body,
                                 headers={"content-type": "application/json", **headers})
                replies.append((name, r))
            big = b'{"prompt": "' + b"y" * (2 << 20) + b'"}'
            replies.append(("2 MiB body", await c.post(url + "/v1/completions", content=big)))
            async def chunks():  # no Content-Length: the limit must trip while reading
                for i in range(0, len(big), 65536):
                    yield big[i: i + 65536]

            replies.append(("2 MiB chunked", await c.post(url + "/v1/completions", content=chunks())))
            replies.append(("GET on a POST route", await c.get(url + "/v1/completions")))
            replies.append(("unknown route", await c.post(url + "/v1/nothing", json={})))
            await asyncio.wait_for(task, timeout=120)
            return replies

    t0 = time.monotonic()
    replies = asyncio.run(barrage())
    failures = []
    for name, r in replies:
        try:
            err = r.json()["error"]
            ok = 400 <= r.status_code < 500 and isinstance(err["message"], str) and err["message"] \
                and "type" in err and "code" in err and len(err["message"]) < 4000
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            failures.append(f"{name}: HTTP {r.status_code} {r.text[:120]!r}")
    assert not failures, "\n".join(failures)
    codes = {name: r.status_code for name, r in replies}
    assert codes["2 MiB body"] == codes["2 MiB chunked"] == 413 and codes["GET on a POST route"] == 405
    assert time.monotonic() - t0 < 60
    # the stream that ran through it all is the sequential greedy output
    solo = httpx.post(url + "/v1/completions", json={**canary, "stream": False}, timeout=60).json()
    assert "".join(texts) == solo["choices"][0]["text"]
    ok = httpx.post(url + "/v1/completions", json={"prompt": "x", **dict.fromkeys(list(WRONG_TYPE)[2:], None),
                                                  "temperature": 0}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1  # null = absent
    m = _settled(url)
    assert m["kdlib_kv_pool_free_slots"] == m["kdlib_kv_pool_slots"]
    again = httpx.post(url + "/v1/completions", json=_body(0), timeout=60).json()
    assert reference[0] == again["choices"][0]["text"]
