"""The OpenAI-compatible server (kdlib.serve) on a real uvicorn loopback server, with httpx clients."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kdlib import serve
from kdlib.diagnose import parse_metrics


@pytest.fixture(scope="module")
def server():
    bundle = serve.load_bundle(prefer_trained=False)  # the random fallback: fast and always there
    with serve.EmbeddedServer(serve.Engine(bundle, max_tokens_limit=200)) as srv:
        yield srv
    srv.engine.close()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _complete(client, prompt, n, **kw):
    r = client.post("/v1/completions", json={"model": client_model(client), "prompt": prompt, "max_tokens": n,
                                             "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def client_model(client):
    return client.get("/v1/models").json()["data"][0]["id"]


def _sse(client, path, body):
    chunks = []
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        assert ln.startswith("data: ")
        chunks.append(json.loads(ln[6:]))
    return chunks


def test_models_and_health_say_what_is_served(client, server):
    m = client.get("/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == server.engine.name
    assert m["data"][0]["max_model_len"] == 1024  # data/configs/tiny-a.json
    assert m["data"][0]["kdlib"]["source"] == "random"
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["kdlib"]["source"] == "random" and h["queue"] == 0


def test_completion_shape_usage_and_ddtree_stats(client):
    d = _complete(client, "The quick brown fox", 24)
    assert d["object"] == "text_completion" and d["choices"][0]["finish_reason"] == "length"
    assert d["usage"] == {"prompt_tokens": 19, "completion_tokens": 24, "total_tokens": 43}
    assert len(d["choices"][0]["text"]) == 24  # the byte tokenizer: one character per token
    st = d["ddtree"]
    assert st["method"] == "ddtree" and len(st["accepted"]) == len(st["step_ms"]) == st["steps"]
    assert sum(st["accepted"]) >= 23  # every token after the prefill's one comes from a step


def test_greedy_server_output_equals_autoregressive_greedy(client, server):
    import torch

    from kdlib.engine.generate import generate

    prompt = "def main():\n    return"
    d = _complete(client, prompt, 30)
    b = server.engine.bundle
    with torch.no_grad():
        ar = generate(b.model, b.tokenizer.encode(prompt), 30, method="ar")
    assert d["choices"][0]["text"] == b.tokenizer.decode(ar.tokens)


def test_token_id_prompt_and_batch_of_one_string(client):
    by_text = _complete(client, "abc", 8)
    by_list = _complete(client, ["abc"], 8)
    ids = serve.ByteTokenizer(96).encode("abc")
    by_ids = _complete(client, ids, 8)
    assert by_text["choices"][0]["text"] == by_list["choices"][0]["text"] == by_ids["choices"][0]["text"]


def test_streaming_equals_non_streaming(client):
    body = {"prompt": "Streaming test:", "max_tokens": 40, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _sse(client, "/v1/completions", body)
    content = [c for c in chunks if c["choices"]]
    text = "".join(c["choices"][0]["text"] for c in content)
    assert text == _complete(client, "Streaming test:", 40)["choices"][0]["text"]
    assert content[-1]["choices"][0]["finish_reason"] == "length" and "ddtree" in content[-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in content]
    assert counts == sorted(counts) and counts[-1] == 40
    assert len(content) > 2  # several steps, several chunks
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 40


def test_chat_streaming_and_plain(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    plain = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 20, "temperature": 0}).json()
    assert plain["object"] == "chat.completion"
    assert plain["choices"][0]["message"]["role"] == "assistant"
    assert plain["usage"]["prompt_tokens"] == len(serve.render_chat(msgs))
    chunks = _sse(client, "/v1/chat/completions", {"messages": msgs, "max_tokens": 20, "temperature": 0,
                                                   "stream": True})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]


def test_concurrent_greedy_requests_equal_sequential(server):
    prompts = [f"Request number {i}: " for i in range(6)]

    def one(p):
        with httpx.Client(base_url=server.url, timeout=300) as c:
            r = c.post("/v1/completions", json={"prompt": p, "max_tokens": 32, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(prompts)) as ex:
        parallel = list(ex.map(one, prompts))
    sequential = [one(p) for p in prompts]
    assert parallel == sequential


BAD = [
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_json"),
    (b'{"prompt": 5}', 400, "invalid_type"),
    (b'{"prompt": "x", "max_tokens": "8"}', 400, "invalid_type"),
    (b'{"prompt": "x", "max_tokens": true}', 400, "invalid_type"),
    (b'{"prompt": "x", "model": "gpt-4"}', 404, "model_not_found"),
    (b'{"prompt": "x", "max_tokens": 0}', 400, "invalid_value"),
    (b'{"prompt": "x", "max_tokens": -3}', 400, "invalid_value"),
    (b'{"prompt": "x", "max_tokens": 201}', 400, "invalid_value"),  # over the server's limit (200)
    (json.dumps({"prompt": "y" * 1000, "max_tokens": 100}).encode(), 400, "context_length_exceeded"),
    (b'{"prompt": [1, 2, 999]}', 400, "invalid_value"),
    (b'{"prompt": ""}', 400, "invalid_value"),
    (b'{"prompt": "x", "temperature": -1}', 400, "invalid_value"),
    (b'{"prompt": "x", "stream": "yes"}', 400, "invalid_type"),
    (b'{"prompt": "x", "stop": ["\\n"]}', 400, "unsupported"),
]


@pytest.mark.parametrize("body,status,code", BAD)
def test_bad_requests_get_openai_errors_and_server_stays_up(client, body, status, code):
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"] == "invalid_request_error"
    assert client.get("/health").json()["status"] == "ok"
    assert _complete(client, "still up", 4)["usage"]["completion_tokens"] == 4


def test_bad_chat_messages(client):
    for msgs in ([], [{"role": "robot", "content": "x"}], [{"role": "user", "content": 3}], "hi"):
        r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")


def test_unknown_route_is_an_openai_shaped_404(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_metrics_count_steps_and_tokens(client):
    before = parse_metrics(client.get("/metrics").text)
    d = _complete(client, "metrics", 20)
    after = parse_metrics(client.get("/metrics").text)
    steps = d["ddtree"]["steps"]
    assert after["kdlib_spec_accept_length_count"] - before.get("kdlib_spec_accept_length_count", 0) == steps
    assert after["kdlib_spec_accept_length_sum"] - before.get("kdlib_spec_accept_length_sum", 0) == sum(
        d["ddtree"]["accepted"])
    assert after["kdlib_step_seconds_count"] - before.get("kdlib_step_seconds_count", 0) == steps
    assert after["kdlib_generation_tokens_total"] - before.get("kdlib_generation_tokens_total", 0) == 20
    assert after["kdlib_step_seconds_sum"] > before.get("kdlib_step_seconds_sum", 0)


def test_full_queue_is_refused_with_429():
    eng = serve.Engine(serve.load_bundle(prefer_trained=False), max_queue=0)
    try:
        with pytest.raises(serve.RequestError) as e:
            eng.submit(serve.Job([1, 2], 4, 0.0, 0))
        assert e.value.status == 429 and e.value.body()["error"]["code"] == "queue_full"
    finally:
        eng.close()


def test_byte_tokenizer_and_chat_template():
    tok = serve.ByteTokenizer(96)
    text = "Hello,\nworld ~!"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("é")) == "?"
    with pytest.raises(ValueError):
        serve.ByteTokenizer(50)
    assert serve.render_chat([{"role": "user", "content": "hi"}]) == "<|user|>\nhi\n<|assistant|>\n"


def test_cli_help_runs():
    with pytest.raises(SystemExit) as e:
        serve.cli(["--help"])
    assert e.value.code == 0


def test_server_process_serves_and_stops():
    with serve.ServerProcess(["--random"]) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 6, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        url, proc = srv.url, srv._proc
    assert proc.poll() is not None  # the child is gone
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)


def test_worker_survives_a_failing_generation():
    eng = serve.Engine(serve.load_bundle(prefer_trained=False))
    try:
        with pytest.raises(serve.RequestError) as e:
            eng.run([1, 2, 10_000], 4)  # past the vocabulary: the engine raises, the worker reports it
        assert e.value.status == 500 and "generation failed" in str(e.value)
        assert len(eng.run([1, 2, 3], 4)["tokens"]) == 4  # and keeps serving
    finally:
        eng.close()
