"""The OpenAI-compatible server (kdlib.serve) on a real uvicorn loopback server, driven by the official
`openai` client and raw httpx: the trained tiny models (kdlib.zoo) on CPU, context 128."""

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from kdlib import serve, zoo
from kdlib.diagnose import parse_metrics
from kdlib.engine.batch import SamplingParams, StepOutput
from kdlib.engine.generate import generate

CONTEXT = 128
# the trained target's greedy continuation is end-of-text
EOS_PROMPT = "if __name__ == '__main__':\n    main()\n"


@pytest.fixture(scope="module")
def bundle():
    if not zoo.available():
        pytest.skip("the trained models are not in data/models/")
    return serve.load_bundle()


@pytest.fixture(scope="module")
def server(bundle):
    with serve.EmbeddedServer(serve.Engine(bundle, max_num_seqs=8, max_model_len=CONTEXT)) as srv:
        yield srv
    srv.engine.close()


@pytest.fixture(scope="module")
def oa(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _greedy(oa, prompt, n, **kw):
    return oa.completions.create(model="kdtree-tiny", prompt=prompt, max_tokens=n, temperature=0, **kw)


def test_models_health_and_model_by_id(oa, http, server):
    ids = [m.id for m in oa.models.list().data]
    assert ids == [server.engine.name] == ["kdtree-tiny"]
    m = oa.models.retrieve("kdtree-tiny")
    assert m.model_extra["max_model_len"] == CONTEXT and m.model_extra["kdlib"]["source"] == "trained"
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("gpt-4")
    h = http.get("/health").json()
    assert h["status"] == "ok" and h["running"] == 0 and h["kdlib"]["stop_token_ids"] == [0]


def test_completion_shape_usage_and_ddtree_stats(oa):
    r = _greedy(oa, "The quick brown fox", 12, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert r.object == "text_completion" and c.finish_reason == "length" and c.index == 0
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    st = c.model_extra["ddtree"]
    assert st["method"] == "ddtree" and len(st["accepted"]) == len(st["step_ms"]) == st["steps"]
    assert sum(st["accepted"]) == 12 - 1  # the prefill's token is no step's


def test_greedy_output_equals_single_stream_autoregressive(oa, bundle):
    prompt = "def main():\n    return"
    r = _greedy(oa, prompt, 24, extra_body={"ignore_eos": True})
    with torch.no_grad():
        ar = generate(bundle.model, bundle.tokenizer.encode(prompt), 24, method="ar")
    assert r.choices[0].text == bundle.tokenizer.decode(ar.tokens)


def test_streaming_equals_plain_with_usage_chunks(oa):
    kw = {"extra_body": {"ignore_eos": True}}
    plain = _greedy(oa, "Streaming test:", 30, **kw).choices[0].text
    chunks = list(_greedy(oa, "Streaming test:", 30, stream=True, **kw,
                          stream_options={"include_usage": True, "continuous_usage_stats": True}))
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == plain
    assert content[-1].choices[0].finish_reason == "length" and "ddtree" in content[-1].choices[0].model_extra
    counts = [c.usage.completion_tokens for c in content]
    assert counts == sorted(counts) and counts[-1] == 30 and len(content) > 3
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    # vLLM's: continuous stats only beside include_usage; with n > 1, each chunk's choice's own count
    alone = list(_greedy(oa, "Streaming test:", 4, stream=True, **kw,
                         stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in alone) and all(c.choices for c in alone)
    two = list(oa.completions.create(model="kdtree-tiny", prompt="Streaming test:", max_tokens=4,
                                     temperature=0, n=2, stream=True, **kw,
                                     stream_options={"include_usage": True, "continuous_usage_stats": True}))
    last = {c.choices[0].index: c.usage.completion_tokens for c in two if c.choices}
    assert last == {0: 4, 1: 4} and two[-1].usage.completion_tokens == 8


def test_a_temperature_past_float32_is_a_400_streamed_too(http):
    for stream in (False, True):
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 1e39,
                                               "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", (stream, r.text)


def test_include_usage_chunks_carry_a_null_usage(http):
    """With include_usage every chunk before the usage chunk has "usage": null (OpenAI's stream format)."""
    body = {"prompt": "Streaming test:", "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1]) and len(chunks) > 2
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_chat_with_developer_role_and_text_parts(oa, server):
    msgs = [{"role": "developer",
             "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
            {"role": "user", "content": "Hi", "name": "ada"}]  # OpenAI's participant name: not templated
    plain = oa.chat.completions.create(model="kdtree-tiny", messages=msgs, max_completion_tokens=16,
                                       temperature=0)
    assert plain.object == "chat.completion" and plain.choices[0].message.role == "assistant"
    req = serve.protocol.ChatCompletionRequest.model_validate({"messages": msgs})
    text = serve.protocol.render_chat(req.messages)
    assert plain.usage.prompt_tokens == len(server.engine.bundle.tokenizer.encode(text))
    chunks = list(oa.chat.completions.create(model="kdtree-tiny", messages=msgs, max_tokens=16, temperature=0,
                                             stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].message.content


def test_n_choices_seed_and_fresh_randomness(oa):
    kw = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.2, "n": 3,
          "extra_body": {"ignore_eos": True}}
    a = oa.completions.create(model="kdtree-tiny", seed=7, **kw)
    b = oa.completions.create(model="kdtree-tiny", seed=7, **kw)
    texts = [c.text for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2] and texts == [c.text for c in b.choices]
    assert len(set(texts)) > 1  # choice i samples with seed + i
    assert a.usage.completion_tokens == 48
    fresh = [oa.completions.create(model="kdtree-tiny", **kw).choices[0].text for _ in range(2)]
    assert fresh[0] != fresh[1] or fresh[0] != texts[0]  # no seed: fresh randomness every time


def test_stop_strings_end_the_text_before_them(oa):
    full = _greedy(oa, "import os\n", 40, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    r = _greedy(oa, "import os\n", 40, stop=[stop, "never-in-there"], extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text == full[: full.index(stop)] and c.finish_reason == "stop"
    streamed = list(_greedy(oa, "import os\n", 40, stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == c.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_end_of_text_token_stop_min_tokens_and_ignore_eos(oa):
    r = _greedy(oa, EOS_PROMPT, 20)
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.text == "" and r.usage.completion_tokens == 1  # counted, not shown
    assert _greedy(oa, EOS_PROMPT, 20, extra_body={"ignore_eos": True}).choices[0].finish_reason == "length"
    m = _greedy(oa, EOS_PROMPT, 20, logprobs=1, extra_body={"min_tokens": 6})
    assert m.usage.completion_tokens >= 6 and "<|endoftext|>" not in m.choices[0].text
    assert "<|endoftext|>" not in m.choices[0].logprobs.tokens[:6]  # masked until min_tokens (vLLM's rule)


def test_logprobs_in_completion_and_chat_shapes(oa):
    r = _greedy(oa, "x = 1\n", 8, logprobs=2, extra_body={"ignore_eos": True}).choices[0]
    lp = r.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == r.text and lp.text_offset[0] == 0
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 3 for t in lp.top_logprobs)  # 2 + chosen
    assert all(t[s] == v for s, t, v in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs, strict=True))
    assert all(max(t.values()) >= v - 1e-6 for t, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    sampled = oa.completions.create(model="kdtree-tiny", prompt="x = 1\n", max_tokens=8, temperature=1.5,
                                    seed=3, logprobs=0).choices[0].logprobs  # OpenAI: the chosen token always
    assert [list(t) for t in sampled.top_logprobs] == [[s] for s in sampled.tokens]
    chat = oa.chat.completions.create(model="kdtree-tiny", messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                                      extra_body={"ignore_eos": True}).choices[0]
    content = chat.logprobs.content
    assert len(content) == 6 and all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in content)
    assert "".join(e.token for e in content) == chat.message.content
    assert bytes(x for e in content for x in e.bytes).decode() == chat.message.content


def test_streamed_text_offsets_are_the_unstreamed_ones(oa):
    """A stop string held back over several tokens delays the text a stream sends, not the offsets."""
    kw = dict(model="kdtree-tiny", prompt="def add(a, b):\n", max_tokens=12, temperature=0, logprobs=1)
    whole = oa.completions.create(**kw).choices[0]
    assert len(whole.text) >= 8
    kw["stop"] = [whole.text[2:8] + "\x00"]  # matches for 6 characters, then fails: held back, then sent
    whole = oa.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in oa.completions.create(stream=True, **kw)]
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset and "".join(c.text for c in chunks) == whole.text


def test_text_offsets_index_the_text(oa):
    """A token starts at its offset in the text; a hidden end of text, or a character's first bytes, adds no
    characters (the offsets counted each token's piece: 13 for <|endoftext|>, 1 for a lone byte's U+FFFD;
    such a token's piece is its bytes, "bytes:\\xe6")."""
    cases = (("s = '日本'\n", dict(echo=True)), (EOS_PROMPT, dict(extra_body={"ignore_eos": True})))
    for prompt, kw in cases:
        kw = dict(model="kdtree-tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=1, **kw)
        c = oa.completions.create(**kw).choices[0]
        lp = c.logprobs
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(c.text)
        whole = [(s, o) for s, o in zip(lp.tokens, lp.text_offset, strict=True)
                 if not s.startswith("bytes:") and s != "<|endoftext|>"]
        assert all(c.text[o:o + len(s)] == s for s, o in whole), (lp.tokens, lp.text_offset)
        assert len(whole) < len(lp.tokens)  # a split character, or the end of text, was among them
        chunks = [ch.choices[0] for ch in oa.completions.create(stream=True, **kw)]
        assert [o for ch in chunks if ch.logprobs for o in ch.logprobs.text_offset] == lp.text_offset


def _piece_bytes(piece: str) -> bytes:
    """The bytes a completion's token piece stands for ("bytes:\\xe6\\x97" for a character's share)."""
    return bytes.fromhex(piece[6:].replace("\\x", "")) if piece.startswith("bytes:") else piece.encode()


def test_tokens_that_split_a_character_keep_distinct_pieces(http, bundle):
    """A token holding part of a UTF-8 character decodes to U+FFFD, as do all its kind: each gets its bytes as
    its piece instead (OpenAI's "bytes:\\xe6\\x97"), so top_logprobs holds `logprobs` alternatives and the
    sampled token's own value; chat's entries name the same pieces beside their bytes."""
    prompt = "s = '日本語 漢字 😀 ñ é ü ø'"
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 5,
                                           "echo": True}).json()
    lp = r["choices"][0]["logprobs"]
    entries = zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)
    scored = [(s, v, t) for s, v, t in entries if t is not None]
    assert len(scored) == len(lp["tokens"]) - 1  # the first token has no logprob
    assert all(t[s] == v and len(t) >= 5 for s, v, t in scored), scored
    assert any(s.startswith("bytes:") for s, _, _ in scored)
    p = r["usage"]["prompt_tokens"]
    assert b"".join(_piece_bytes(s) for s in lp["tokens"][:p]) == prompt.encode()
    tok = bundle.tokenizer
    e6, e7 = tok.token_to_id("\u00e6"), tok.token_to_id("\u00e7")  # byte-level BPE's symbols of 0xe6, 0xe7
    chat = serve.app._Logprobs(tok, chat=True).chat_content([{"token": e6, "logprob": -1.0,
                                                              "top": [(e6, -1.0), (e7, -2.0)]}])
    assert [(e["token"], e["bytes"]) for e in chat[0]["top_logprobs"]] == [("bytes:\\xe6", [0xE6]),
                                                                         ("bytes:\\xe7", [0xE7])]
    assert chat[0]["token"] == "bytes:\\xe6"


def test_errors_name_the_real_problem(http):
    """A field that failed its own check raises no second, false cross-field error; a content part's error
    names the part; a lone surrogate is named as such; an empty body is unreadable JSON."""
    chat = "/v1/chat/completions"
    hi = [{"role": "user", "content": "hi"}]

    def parts(*ps):
        return [{"role": "user", "content": [{"type": "text", "text": "a"}, *ps]}]

    for path, body, param, message in [
            ("/v1/completions", {"prompt": "x", "n": 20, "best_of": 20}, "n", "n: Input should be"),
            ("/v1/completions", {"prompt": "x", "stream": "yes", "stream_options": {"include_usage": True}},
             "stream", "stream: Input should be"),
            (chat, {"messages": hi, "logprobs": "yes", "top_logprobs": 2}, "logprobs", "logprobs: Input"),
            (chat, {"messages": parts({"type": "text"})},
             "messages[0].content[1].text", "messages[0].content[1].text: Field required"),
            (chat, {"messages": parts({"type": "image_url"})},
             "messages[0].content", "part 1: only text parts"),
            ("/v1/completions", {"prompt": "abc\ud800"}, "prompt",
             "prompt: holds a lone UTF-16 surrogate (U+D800) at character 3: not valid Unicode text"),
            (chat, {"messages": [{"role": "user", "content": "\udc00"}]}, "messages[0].content",
             "messages[0].content: holds a lone UTF-16 surrogate (U+DC00) at character 0"),
            ("/v1/completions", {"prompt": "x", "model": "m\ud800"}, "model",
             "model: holds a lone UTF-16 surrogate (U+D800) at character 1"),
            (chat, {"messages": hi, "stop": ["ok", "\udfff"]}, "stop",
             "stop: holds a lone UTF-16 surrogate (U+DFFF) at character 0")]:
        # json.dumps escapes a lone surrogate ("\\ud800"); httpx's json= would fail to encode it
        r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and message in err["message"], (body, err)
        assert ";" not in err["message"], err  # one problem, not a false second one
    # the cross-field checks still hold where both fields are valid
    r = http.post("/v1/completions", json={"prompt": "x", "best_of": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    r = http.post("/v1/completions", content=b"", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text


def test_a_body_past_the_limit_is_sized_only_when_its_length_is_known(http):
    """Content-Length: the body's size; chunked: the limit, the rest of the body never read."""
    big = json.dumps({"prompt": "y" * (2 << 20)}).encode()
    limit = serve.app.MAX_BODY_BYTES
    r = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert f"({len(big)} bytes; the limit is {limit})" in r.json()["error"]["message"]
    r = http.post("/v1/completions", content=(big[i:i + 65536] for i in range(0, len(big), 65536)),
                  headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert f"(more than {limit} bytes; the limit is {limit})" in r.json()["error"]["message"]


def test_a_request_without_decode_steps_has_no_mean_accepted(oa):
    st = _greedy(oa, "x = ", 1, extra_body={"ignore_eos": True}).choices[0].model_extra["ddtree"]
    assert st["steps"] == 0 and st["mean_accepted"] is None and st["mean_step_ms"] is None


def test_a_body_sent_without_a_json_content_type_is_named_so(http):
    """`curl -d` sends a form's content type; FastAPI then hands over bytes: the error says what to send."""
    r = http.post("/v1/completions", content=b'{"prompt": "x"}',
                  headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json=[1, 2])
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body must be a JSON object"


def test_echo_and_max_tokens_null(oa, http):
    r = _greedy(oa, "abc", 5, echo=True, extra_body={"ignore_eos": True}).choices[0]
    assert r.text.startswith("abc") and len(r.text) > 3
    ids = serve.load_bundle().tokenizer.encode("Hello")
    rest = http.post("/v1/completions", json={"prompt": ids, "max_tokens": None, "temperature": 0,
                                              "ignore_eos": True}).json()
    assert rest["usage"]["completion_tokens"] == CONTEXT - len(ids)  # null = the rest of the context
    assert rest["choices"][0]["finish_reason"] == "length"


def test_default_max_tokens_follow_openai(http):
    """/v1/completions without max_tokens: 16 tokens (OpenAI's and vLLM's default), cut to the context;
    chat without it: the rest of the context."""
    body = {"temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json={"prompt": "x = ", **body}).json()
    assert r["usage"]["completion_tokens"] == 16 and r["choices"][0]["finish_reason"] == "length"
    long = list(range(1, CONTEXT - 5))
    r = http.post("/v1/completions", json={"prompt": long, **body}).json()
    assert r["usage"]["completion_tokens"] == CONTEXT - len(long) < 16
    chat = {"messages": [{"role": "user", "content": "hi"}], **body}
    assert http.post("/v1/chat/completions", json=chat).json()["usage"]["total_tokens"] == CONTEXT


def test_echo_with_logprobs_scores_the_prompt(oa, bundle):
    """echo + logprobs: the prompt's tokens come first, the first without a logprob (as OpenAI), the
    others scored by the target given what precedes them, then the completion's."""
    ids = bundle.tokenizer.encode("def f(x):\n    return x")
    r = _greedy(oa, ids, 4, echo=True, logprobs=1, extra_body={"ignore_eos": True}).choices[0]
    lp = r.logprobs
    assert len(lp.tokens) == len(ids) + 4 and lp.token_logprobs[0] is None
    ref = torch.log_softmax(bundle.model.logits(ids).float(), dim=-1)  # [P, V] row i predicts ids[i+1]
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-4)
    assert all(v <= 0 for v in lp.token_logprobs[1:])


def test_fields_it_cannot_honour_get_a_400_naming_them(http):
    for body, named, status in [({"prompt": "x", "logit_bias": {"5": 3}}, "logit_bias", 400),
                                ({"prompt": "x", "presence_penalty": 1.0}, "presence_penalty", 400),
                                ({"prompt": "x", "guided_json": {}}, "guided_json", 400),
                                ({"prompt": "x", "max_tokens": CONTEXT}, "max_tokens", 400),
                                ({"prompt": "x", "model": "gpt-4"}, "model", 404)]:
        r = http.post("/v1/completions", json=body)
        err = r.json()["error"]
        assert r.status_code == status and err["param"] == named, body
        assert err["type"] == "invalid_request_error", body
        assert named in err["message"] or "context length" in err["message"] or "gpt-4" in err["message"]
    r = http.post("/v1/chat/completions",
                  json={"messages": [{"role": "user", "content": "x"}], "tools": [{}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_concurrent_greedy_requests_equal_sequential(server):
    prompts = [f"Request number {i}: " for i in range(8)]

    def one(p):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": p, "max_tokens": 20, "temperature": 0,
                                                             "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(prompts)) as ex:
        parallel = list(ex.map(one, prompts))
    assert parallel == [one(p) for p in prompts]


def test_metrics_under_kdlib_and_vllm_names(http, oa):
    before = parse_metrics(http.get("/metrics").text)
    r = _greedy(oa, "metrics", 20, extra_body={"ignore_eos": True})
    after = parse_metrics(http.get("/metrics").text)

    def d(k):
        return after.get(k, 0) - before.get(k, 0)

    steps = r.choices[0].model_extra["ddtree"]["steps"]
    assert d("kdlib_spec_accept_length_count") == steps and d("kdlib_step_seconds_count") == steps
    assert d("kdlib_generation_tokens_total") == 20 and d("kdlib_requests_total") == 1
    assert d("vllm:time_to_first_token_seconds_count") == 1
    assert d("vllm:inter_token_latency_seconds_count") == steps - 1
    drafts = d("vllm:spec_decode_num_drafts_total")
    assert steps - 1 <= drafts <= steps  # the prefill's token is no draft round
    assert (d("vllm:spec_decode_num_accepted_tokens_total")
            == d("vllm:spec_decode_num_accepted_tokens_per_pos_total"))
    assert after["vllm:num_requests_running"] == 0 == after["vllm:num_requests_waiting"]
    assert after["kdlib_kv_pool_free_slots"] == after["kdlib_kv_pool_slots"] > 0


def test_a_request_failing_at_admission_is_counted_as_an_error(server, http, monkeypatch):
    """A 500 raised while a request was admitted (here its prompt logprobs) reached the client but not
    kdlib_requests_total{status="error"}; the same failure a step later was counted."""
    def errors():
        text = http.get("/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("kdlib_requests_total{") and 'status="error"' in line)

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    before = errors()
    monkeypatch.setattr(server.engine.core, "prompt_logprobs", fail)
    r = http.post("/v1/completions", json={"prompt": "def f(", "max_tokens": 4, "echo": True, "logprobs": 1})
    assert r.status_code == 500 and "out of memory (simulated)" in r.json()["error"]["message"]
    assert errors() == before + 1


def test_a_disconnected_client_is_cancelled(server, http, monkeypatch):
    def aborted():
        return parse_metrics(http.get("/metrics").text).get("kdlib_requests_total", 0)

    step = server.engine.core.step

    def slow_step():  # each step at least 50 ms: the requests outlast the client's patience on any CPU
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(server.engine.core, "step", slow_step)
    before = aborted()
    body = {"prompt": "Long story: ", "max_tokens": CONTEXT - 8, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/completions",
                                                                      json={**body, "stream": True}) as r:
        for _ in zip(range(3), r.iter_lines(), strict=False):  # read a few events, then hang up
            pass
    with pytest.raises(httpx.ReadTimeout):  # not streaming: the client gives up waiting
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (server.engine.state()["running"] or aborted() < before + 2):
        time.sleep(0.05)
    s = server.engine.state()
    assert s["running"] == 0 and s["pool_free"] == s["pool_slots"] and aborted() == before + 2
    assert parse_metrics(http.get("/metrics").text)["kdlib_generation_tokens_total"] > 0


class _GatedCore:
    """The real core whose steps wait for `go`: the sequences it holds stay until the test lets them run."""

    def __init__(self, core):
        self.core, self.go = core, threading.Event()

    def __getattr__(self, name):
        return getattr(self.core, name)

    def step(self):
        self.go.wait(60)
        return self.core.step()


def test_api_key_body_limit_and_full_queue(bundle):
    """max_waiting=0: free streams still take requests; a full server answers 429 (retry), a request of
    more sequences than it ever holds 400."""
    gated = _GatedCore(serve.make_core(bundle, max_num_seqs=2, max_model_len=64, method="ddtree",
                                       budget=None))
    engine = serve.Engine(bundle, core=gated, max_num_seqs=2, max_model_len=64, max_waiting=0, warm_up=False)
    with serve.EmbeddedServer(engine, api_key="sesame", max_body_bytes=10_000) as srv:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        assert httpx.get(srv.url + "/health").status_code == 200  # open: only /v1/* needs the key
        key = {"Authorization": "Bearer sesame"}
        assert httpx.get(srv.url + "/v1/models", headers=key).status_code == 200
        big = json.dumps({"prompt": "y" * 20_000}).encode()
        r = httpx.post(srv.url + "/v1/completions", content=big,
                       headers={**key, "content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        chunked = httpx.post(srv.url + "/v1/completions", content=iter([big[:8000], big[8000:]]), headers=key)
        assert chunked.status_code == 413
        one = {"prompt": "x", "max_tokens": 2}
        r = httpx.post(srv.url + "/v1/completions", json={**one, "n": 3}, headers=key)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        with ThreadPoolExecutor(1) as ex:
            pair = ex.submit(httpx.post, srv.url + "/v1/completions", json={**one, "n": 2}, headers=key,
                             timeout=60)
            deadline = time.monotonic() + 30
            while sum(engine.state()[k] for k in ("running", "waiting")) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            r = httpx.post(srv.url + "/v1/completions", json=one, headers=key)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            gated.go.set()
            assert pair.result().status_code == 200 and len(pair.result().json()["choices"]) == 2
        assert httpx.post(srv.url + "/v1/completions", json={**one, "n": 2}, headers=key,
                          timeout=60).status_code == 200  # an idle server takes as many as it has streams
    engine.close()


def test_served_model_names_and_streamed_choices(bundle):
    engine = serve.Engine(bundle, max_num_seqs=4, max_model_len=64, served_names=("tiny", "org/tiny-alias"))
    with (serve.EmbeddedServer(engine) as srv,
          openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0) as oa):
        assert [m.id for m in oa.models.list().data] == ["tiny", "org/tiny-alias"]
        assert oa.models.retrieve("org/tiny-alias").id == "org/tiny-alias"
        chunks = list(oa.completions.create(model="org/tiny-alias", prompt="a = [", max_tokens=6, n=2, seed=3,
                                            temperature=1.0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
        assert {c.model for c in chunks} == {"org/tiny-alias"}
        finished = {ch.index: ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason}
        assert finished == {0: "length", 1: "length"} and chunks[-1].usage.completion_tokens == 12
        with pytest.raises(openai.NotFoundError):
            oa.completions.create(model="kdtree-tiny", prompt="x", max_tokens=1)
    engine.close()


def test_a_failing_engine_step_fails_its_requests_and_the_loop_goes_on(bundle):
    engine = serve.Engine(bundle, max_num_seqs=2, max_model_len=64)
    assert engine.wait_ready(60)  # the warm-up request has run its steps
    real = engine.core.step
    calls = []

    def broken():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return real()

    engine.core.step = broken
    try:
        with pytest.raises(serve.RequestError) as e:
            engine.run([5, 6, 7], 4)
        assert e.value.status == 500 and "device lost" in str(e.value)
        assert len(engine.run([5, 6, 7], 4)["tokens"]) >= 1 and engine.state()["running"] == 0
    finally:
        engine.close()


def test_a_failing_prefill_fails_its_request_alone(bundle):
    """One request's prefill raises (a simulated out-of-memory error): that request gets a 500, a request
    running beside it finishes as it would alone, and the engine serves on."""
    engine = serve.Engine(bundle, max_num_seqs=2, max_model_len=128)
    assert engine.wait_ready(60)
    model = engine.core.model
    real = model.forward_plain

    def forward_plain(prompt, capture=()):
        if prompt[0] == 13:
            raise RuntimeError("out of memory (simulated)")
        return real(prompt, capture)

    model.forward_plain = forward_plain
    try:
        params = SamplingParams(ignore_eos=True)
        alone = engine.run([5, 6, 7], 40, params)["tokens"]
        box = {}
        beside = threading.Thread(target=lambda: box.setdefault("r", engine.run([5, 6, 7], 40, params)))
        beside.start()
        time.sleep(0.05)
        with pytest.raises(serve.RequestError) as e:
            engine.run([13, 5, 5], 8, params)
        beside.join(120)
        assert e.value.status == 500 and "out of memory (simulated)" in str(e.value)
        assert box["r"]["tokens"] == alone and engine.state()["running"] == 0
    finally:
        del model.forward_plain
        engine.close()


def test_port_in_use_is_a_clear_error(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        assert serve.cli(["--port", str(s.getsockname()[1])]) == 1
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


def test_a_stop_string_past_a_hidden_end_of_text_keeps_one_logprob_a_token(bundle):
    """ignore_eos: an end-of-text token is kept (counted, not shown); a stop string completed after it in
    the same step cuts the tokens and their logprobs at the same place."""
    engine = serve.Engine(bundle, max_num_seqs=2, max_model_len=64, warm_up=False)
    x, b, y = (bundle.tokenizer.encode(s)[0] for s in ("x", "B", "y"))
    eos = bundle.tokenizer.eos_token_id
    rids, real_add = [], engine.core.add_request

    def add(*args):
        rids.append(real_add(*args))
        return rids[-1]

    def step():  # one step of four tokens: x, end of text, B (the stop string), y
        toks = [x, eos, b, y]
        return [StepOutput(rids[-1], toks, False, None, len(toks),
                           [{"token": t, "logprob": -1.0 - k, "top": []} for k, t in enumerate(toks)])]

    engine.core.add_request, engine.core.step = add, step
    deltas = []
    try:
        params = SamplingParams(ignore_eos=True, logprobs=0, stop_token_ids=(eos,))
        out = engine.run([5, 6, 7], 8, params, stops=("B",),
                         listener=lambda ev: ev[0] == "delta" and deltas.append(ev[1]))
    finally:
        engine.close()
    assert out["tokens"] == [x, eos, b] and out["text"] == "x" and out["finish_reason"] == "stop"
    assert [e["token"] for d in deltas for e in d.logprobs] == [x, eos, b]


def test_engine_in_process_reports_bad_requests_and_keeps_serving(bundle):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    engine = serve.Engine(bundle, max_num_seqs=2, max_model_len=64)
    assert torch.get_num_threads() == 1  # a tiny model's ops on one thread, while the engine runs
    try:
        with pytest.raises(serve.RequestError) as e:
            engine.run([1, 2, 10_000], 4)  # past the vocabulary: the engine refuses it
        assert e.value.status == 400
        out = engine.run([5, 6, 7], 4)
        assert len(out["tokens"]) <= 4 and out["finish_reason"] in ("stop", "length")
        assert engine.snapshot()["requests"] == 1
    finally:
        engine.close()
        assert torch.get_num_threads() == 2  # the process's setting back
        torch.set_num_threads(threads)


def test_a_stop_string_in_the_prefills_token_counts_no_decode_step(bundle):
    """The step that ran the prefill also decoded: without overlap its decode output was counted (a step
    that accepted 2 in a 1-token answer) before the stop string ended the request; with overlap it was not."""
    prompt = bundle.tokenizer.encode("def foo(x):\n    return")
    for overlap in (False, True):
        engine = serve.Engine(bundle, max_num_seqs=2, max_model_len=128, overlap=overlap)
        try:
            engine.wait_ready(60)
            r = engine.run(prompt, 20, stops=(" foo",))
            assert r["text"] == "" and len(r["tokens"]) == 1 and r["finish_reason"] == "stop", overlap
            assert r["ddtree"]["steps"] == 0 and r["ddtree"]["accepted"] == [], (overlap, r["ddtree"])
            assert engine.snapshot()["accept_count"] == 0, overlap
        finally:
            engine.close()


def test_server_process_serves_and_stops():
    with serve.ServerProcess(["--random", "--method", "ar", "--max-model-len", "64"]) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 6, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        weights = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["kdlib"]["weights"]
        assert weights.startswith("random") and "no trained models" not in weights  # asked for, not missing
        url, proc = srv.url, srv._proc
    assert proc.poll() is not None
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)


def test_shutdown_answers_the_requests_in_flight(monkeypatch):
    """uvicorn cancelled the requests left after its grace period: a plain-text 500, a stream cut mid-body,
    and the engine's 503 "shutdown" reached nobody. Now the server stops accepting, waits the grace period,
    and has the engine answer the rest while its event loop runs; the engine then holds nothing."""
    monkeypatch.setattr(serve.server, "GRACE_S", 0.2)
    engine = serve.Engine(serve.load_bundle(prefer_trained=False), method="ar", max_num_seqs=2, threads=1)
    srv = serve.EmbeddedServer(engine).start()
    body = {"model": engine.names[0], "prompt": "abc", "max_tokens": engine.max_model_len - 8,
            "temperature": 0, "ignore_eos": True}
    got = {}

    def plain():
        got["plain"] = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)

    def stream():
        url = srv.url + "/v1/completions"
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            got["stream"] = [line for line in r.iter_lines() if line]

    clients = [threading.Thread(target=f) for f in (plain, stream)]
    for c in clients:
        c.start()
    deadline = time.monotonic() + 30
    while engine.state()["running"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.state()["running"] == 2, "both requests run before the server stops"
    srv.stop()
    for c in clients:
        c.join(timeout=60)
    try:
        assert got["plain"].status_code == 503 and got["plain"].json()["error"]["code"] == "shutdown"
        last, done = got["stream"][-2:]
        assert done == "data: [DONE]"
        assert json.loads(last.removeprefix("data: "))["error"]["code"] == "shutdown"
        assert engine.state()["running"] == engine.state()["waiting"] == 0
        assert engine.state()["pool_free"] == engine.state()["pool_slots"]
    finally:
        engine.close()


@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_kdlib_serve_stops_on_a_signal_with_the_shell_code_and_no_traceback(sig, code):
    """Ctrl-C printed uvicorn's re-raised KeyboardInterrupt as a traceback, and the process died by the
    signal (-2, -15) instead of exiting 130 / 143 as the other commands do."""
    import signal

    with serve.ServerProcess(["--random", "--method", "ar", "--max-model-len", "64"]) as srv:
        srv._proc.send_signal(getattr(signal, sig))
        assert srv._proc.wait(timeout=60) == code
        assert "Traceback" not in srv.log()


def test_kdlib_serve_started_with_sigint_ignored_still_exits_130_on_it():
    """A script's background job starts with SIGINT ignored: uvicorn stopped on it anyway and exited 0."""
    import signal

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the child, as from `cmd &`
    try:
        srv = serve.ServerProcess(["--random", "--method", "ar", "--max-model-len", "64"]).start()
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        srv._proc.send_signal(signal.SIGINT)
        assert srv._proc.wait(timeout=60) == 130
    finally:
        srv.stop()


def test_base_url_brackets_ipv6_hosts():
    assert serve.server.base_url("::1", 8000) == "http://[::1]:8000"
    assert serve.server.base_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert serve.EmbeddedServer(engine=object(), host="::1", port=9).url == "http://[::1]:9"


def test_cli_help_runs_and_counts_are_checked(capsys):
    with pytest.raises(SystemExit) as e:
        serve.cli(["--help"])
    assert e.value.code == 0
    for flag, value, message in (("--max-waiting", "-1", "must be >= 0, got -1"),
                                 ("--max-num-seqs", "0", "must be >= 1, got 0"),
                                 ("--max-waiting", "x", "invalid integer value: 'x'"),
                                 ("--device", "cdua", "must be cpu, cuda or cuda:N, got 'cdua'"),
                                 ("--port", "99999", "must be a TCP port (0 to 65535), got 99999"),
                                 ("--port", "-1", "must be >= 0, got -1"),
                                 ("--models", "/nonexistent/models", "does not hold the trained models"),
                                 ("--port", "abc", "invalid port value: 'abc'"),
                                 ("--config", "nosuch", "--config nosuch: no such config under"),
                                 # trained models are present: a --config without --random was ignored
                                 ("--config", "tiny-b", "trained models are present: add --random")):
        with pytest.raises(SystemExit) as e:
            serve.cli([flag, value])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and err.count("\n") == 1  # one line, no usage block


def test_async_scheduling_serves_what_the_plain_loop_serves(server, bundle):
    """`--async-scheduling` (the engine's overlap): concurrent greedy completions, a stop string and logprobs
    come out as the plain loop's (the module's server), and the model card says the lever is on."""
    prompts = [f"Request number {i}: " for i in range(8)]

    def body(p):
        return {"prompt": p, "max_tokens": 20, "temperature": 0, "ignore_eos": True}

    def texts(url):
        def one(p):
            r = httpx.post(url + "/v1/completions", json=body(p), timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(prompts)) as ex:
            return list(ex.map(one, prompts))

    def stop_and_logprobs(url):
        stop = httpx.post(url + "/v1/completions", json={**body("def add(a, b):"), "stop": ["\n"]},
                          timeout=120).json()["choices"][0]
        lp = httpx.post(url + "/v1/completions", json={**body("x = 1\n"), "max_tokens": 8, "logprobs": 2},
                        timeout=120).json()["choices"][0]["logprobs"]
        return stop["text"], stop["finish_reason"], lp

    engine = serve.Engine(bundle, max_num_seqs=8, max_model_len=CONTEXT, overlap=True)
    assert engine.core.overlap
    with serve.EmbeddedServer(engine) as lagged:
        card = httpx.get(lagged.url + "/v1/models/kdtree-tiny", timeout=30).json()
        assert card["kdlib"]["async_scheduling"] is True and card["kdlib"]["torch_compile"] is False
        assert texts(lagged.url) == texts(server.url)
        (s_text, s_reason, s_lp), (p_text, p_reason, p_lp) = stop_and_logprobs(lagged.url), \
            stop_and_logprobs(server.url)
        assert (s_text, s_reason) == (p_text, p_reason) and "\n" not in s_text
        assert s_lp["tokens"] == p_lp["tokens"] and [sorted(t) for t in s_lp["top_logprobs"]] == \
            [sorted(t) for t in p_lp["top_logprobs"]]
        assert s_lp["token_logprobs"] == pytest.approx(p_lp["token_logprobs"], abs=1e-5)
        assert engine.state()["running"] == 0
    engine.close()


def test_torch_compile_needs_a_cuda_model(bundle, capsys):
    with pytest.raises(ValueError, match="torch.compile needs a CUDA model"):
        serve.Engine(bundle, compile=True, warm_up=False)
    assert serve.cli(["--port", "0", "--enable-torch-compile"]) == 2
    assert "kdlib serve: error: torch.compile needs a CUDA model" in capsys.readouterr().err


def test_a_random_model_past_the_free_memory_is_refused_before_it_is_built(capsys):
    """--random --config kimi-k2.6 built a trillion random parameters on the CPU (out of memory, or a
    traceback); it is one line and status 2 before anything is allocated."""
    assert serve.cli(["--port", "0", "--random", "--config", "kimi-k2.6"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kdlib serve: error: a random kimi-k2.6 is 1,026.4B parameters")
    assert err.count("\n") == 1


def test_a_blank_served_model_name_is_refused(capsys):
    assert serve.cli(["--port", "0", "--served-model-name", "tiny", " "]) == 2
    assert "served model names must not be empty or blank, got ['tiny', ' ']" in capsys.readouterr().err


def test_a_random_model_is_sized_from_the_shipped_config(tmp_path, monkeypatch):
    """--config tiny-a names data/configs/tiny-a.json, not a folder of that name where the server runs."""
    (tmp_path / "tiny-a").mkdir()
    (tmp_path / "tiny-a" / "config.json").write_text("{bad")
    monkeypatch.chdir(tmp_path)
    assert serve.load_bundle(prefer_trained=False, config="tiny-a").name == "kdtree-random-tiny-a"


def test_a_corrupt_tokenizer_is_refused_in_one_line(tmp_path, capsys):
    """A damaged tokenizer.json beside good weights: one line and status 2, as a damaged config gives."""
    if not zoo.available():
        pytest.skip("the trained models are not in data/models/")
    for f in zoo.MODELS.iterdir():
        if f.name != "tokenizer.json":
            (tmp_path / f.name).symlink_to(f)
    (tmp_path / "tokenizer.json").write_text("{garbage")
    assert serve.cli(["--port", "0", "--models", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kdlib serve: error: {tmp_path}/tokenizer.json: not a tokenizer")
    assert err.count("\n") == 1


def test_a_given_core_reports_its_own_levers(bundle):
    """A core built outside Engine carries its levers: the model card reports the core's, and flags passed
    beside a core (which Engine could not apply) are refused."""
    core = serve.make_core(bundle, max_num_seqs=2, max_model_len=64, method="ddtree", budget=None,
                           overlap=True)
    with pytest.raises(ValueError, match="a core given to Engine carries its own"):
        serve.Engine(bundle, core=core, overlap=True, warm_up=False)
    engine = serve.Engine(bundle, core=core, max_num_seqs=2, max_model_len=64, warm_up=False)
    try:
        info = engine.info()
        assert info["async_scheduling"] is True and info["torch_compile"] is False
    finally:
        engine.close()
    plain = serve.Engine(bundle, core=serve.make_core(bundle, max_num_seqs=2, max_model_len=64, method="ar",
                                                       budget=None), max_num_seqs=2, max_model_len=64,
                         warm_up=False)
    try:
        assert plain.info()["async_scheduling"] is False and plain.info()["method"] == "ar"
    finally:
        plain.close()


def _settled_state(engine) -> dict:
    """The engine's state once its loop has snapshotted it with nothing running."""
    deadline = time.monotonic() + 10
    while engine.state()["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.state()


def test_accept_lengths_and_spec_counters_count_decode_steps_alone():
    """The prefill's token is no accepted token: an AR request's steps each accept 1 (they read 2 on the
    step that also ran the prefill). The warm-up request's draft rounds are in no counter: after one DDTree
    request the spec-decode counters hold its steps alone."""
    bundle = serve.load_bundle()
    prompt = bundle.tokenizer.encode("def main():\n    return")
    ar = serve.Engine(bundle, method="ar", max_num_seqs=2, max_model_len=128, warm_up=False)
    try:
        st = ar.run(prompt, 6, SamplingParams(ignore_eos=True))["ddtree"]
        assert (st["accepted"], st["steps"], st["mean_accepted"]) == ([1] * 5, 5, 1.0)
    finally:
        ar.close()
    dd = serve.Engine(bundle, method="ddtree", budget=8, max_num_seqs=2, max_model_len=128, warm_up=True)
    try:
        assert dd.wait_ready(60)
        st = dd.run(prompt, 12, SamplingParams(ignore_eos=True))["ddtree"]
        spec = _settled_state(dd)["spec"]
        assert spec["drafts"] == st["steps"] and spec["accepted_tokens"] == sum(st["accepted"]) - st["steps"]
        assert sum(spec["accepted_per_pos"]) == spec["accepted_tokens"]
    finally:
        dd.close()


def _oracle_engine() -> serve.Engine:
    """The random fallback with a drafter that never misses (p_wrong 0): each step accepts several tokens."""
    bundle = serve.load_bundle(prefer_trained=False, p_wrong=0.0)
    return serve.Engine(bundle, max_num_seqs=2, max_model_len=CONTEXT, warm_up=False)


def _accept_totals(engine) -> tuple[float, float, float, float]:
    """(accept sum, accept count) from /metrics, then the same from the engine's running totals."""
    m, t = parse_metrics(engine.metrics_text().decode()), engine.snapshot()
    return (m["kdlib_spec_accept_length_sum"], m["kdlib_spec_accept_length_count"], t["accept_sum"],
            t["accept_count"])


def test_accepted_lengths_count_the_tokens_kept_past_max_tokens():
    """The step cut at max_tokens counted every token the engine accepted: the request's accepted, its
    mean and /metrics' accept length held tokens the answer never got (312 accepted for 300 tokens)."""
    engine = _oracle_engine()
    try:
        prompt = engine.bundle.tokenizer.encode("def main():\n    return")
        r = engine.run(prompt, 20)
        st, spec = r["ddtree"], _settled_state(engine)["spec"]
        assert len(r["tokens"]) == 20 and r["finish_reason"] == "length" and st["steps"] >= 2
        assert spec["accepted_tokens"] + spec["drafts"] > 19  # the last step accepted past max_tokens
        assert sum(st["accepted"]) == 20 - 1  # the prefill's token is no step's
        assert st["mean_accepted"] == 19 / st["steps"]
        assert _accept_totals(engine) == (19, st["steps"], 19, st["steps"])
    finally:
        engine.close()


def test_accepted_lengths_count_the_tokens_kept_before_a_stop_string():
    """A stop string completed inside a step ends the answer there: that step's tau is the tokens it kept."""
    engine = _oracle_engine()
    try:
        tok = engine.bundle.tokenizer
        prompt = tok.encode("def main():\n    return")
        full = engine.run(prompt, 20)
        first = 1 + full["ddtree"]["accepted"][0]  # the prefill's token, then the first step's
        assert full["ddtree"]["accepted"][1] > 3
        stop = tok.decode(full["tokens"][first + 1: first + 3])  # completed by the second step's third token
        assert stop not in tok.decode(full["tokens"][: first + 2])
        before = _accept_totals(engine)
        r = engine.run(prompt, 20, stops=(stop,))
        st = r["ddtree"]
        assert r["finish_reason"] == "stop" and r["tokens"] == full["tokens"][: first + 3]
        assert st["accepted"] == [first - 1, 3] and sum(st["accepted"]) == len(r["tokens"]) - 1
        after = _accept_totals(engine)
        assert [a - b for a, b in zip(after, before, strict=True)] == [len(r["tokens"]) - 1, 2] * 2
    finally:
        engine.close()
