"""kdlib.serve.text (incremental detokenisation, stop strings) and kdlib.serve.protocol (request models)
without a server: the trained byte-level BPE tokenizer and the fallback's ByteTokenizer."""

import random

import pytest

from kdlib import zoo
from kdlib.serve import ByteTokenizer, TextStream
from kdlib.serve.text import TokenOffsets

pytest.importorskip("pydantic")
from pydantic import ValidationError  # noqa: E402

from kdlib.serve.protocol import (  # noqa: E402
    MAX_STOPS,
    ChatCompletionRequest,
    CompletionRequest,
    error_from_validation,
    render_chat,
)

TEXT = "Héllo wörld — “quotes” 漢字 😀\ndef f(x):\n    return x  # done\n\nEND"


@pytest.fixture(scope="module")
def bpe():
    if not zoo.available():
        pytest.skip("the trained tokenizer is not in data/models/")
    return zoo.load_tokenizer()


def test_token_offsets_index_the_text_a_genuine_replacement_character_included(bpe):
    """A token starts at its offset; a character's first bytes add none. A U+FFFD the text holds was taken
    for an incomplete character (the TextStream form): the token after it got its offset."""
    text = 'x = "\ufffd" + y ' + TEXT
    ids = bpe.encode(text)
    at = TokenOffsets(bpe)
    offsets = [at.push(i) for i in ids]
    assert offsets == sorted(offsets) and offsets[0] == 0 and bpe.decode(ids) == text
    for i, o in zip(ids, offsets, strict=True):
        piece = bpe.decode([i])
        if "\ufffd" not in piece:  # a whole token starts where its text does
            assert text[o:o + len(piece)] == piece, (piece, o)
    quote = next(o for i, o in zip(ids, offsets, strict=True) if bpe.decode([i]).startswith('"') and o > 4)
    assert quote == 6  # after x = "<U+FFFD>


def _stream(tok, ids, chunks, stops=(), check_from=0):
    """Push ids in the given chunk sizes; returns (text sent, ids used up to a stop or None, stream)."""
    ts, out, at, used = TextStream(tok, stops), "", 0, None
    for n in chunks:
        u = ts.push(ids[at: at + n], check_from=max(0, check_from - at))
        if u is not None:
            used = at + u
            break
        at += n
        out += ts.take()
    return out + ts.take(final=True), used, ts


def _random_chunks(rng, n):
    chunks = []
    while sum(chunks) < n:
        chunks.append(rng.randint(1, 4))
    return chunks


def test_incremental_text_equals_one_decode(bpe):
    rng = random.Random(0)
    ids = bpe.encode(TEXT)
    assert any(bpe.decode([i]).endswith("\ufffd") for i in ids)  # the text has characters split across tokens
    for _ in range(20):
        out, used, _ = _stream(bpe, ids, _random_chunks(rng, len(ids)))
        assert out == TEXT and used is None
    for _ in range(50):  # arbitrary ids, incomplete characters included: the same text as one decode
        junk = [rng.randrange(2, bpe.vocab_size) for _ in range(30)]
        assert _stream(bpe, junk, _random_chunks(rng, 30))[0] == bpe.decode(junk)


def test_stop_string_across_token_boundaries_is_cut_and_held_back(bpe):
    ids = bpe.encode(TEXT)
    stop = "rn x  #"
    cut = TEXT.index(stop)
    rng = random.Random(1)
    for _ in range(20):
        ts, sent, at = TextStream(bpe, (stop, "never there")), "", 0
        for n in _random_chunks(rng, len(ids)):
            used = ts.push(ids[at: at + n])
            if used is not None:
                break
            at += n
            sent += ts.take()
            assert len(sent) <= cut and TEXT.startswith(sent)  # nothing of the stop string ever goes out
        sent += ts.take(final=True)
        assert sent == TEXT[:cut] and ts.stopped == stop
        assert bpe.decode(ids[: at + used]).find(stop) >= 0 > bpe.decode(ids[: at + used - 1]).find(stop)


def test_hold_back_releases_a_false_start():
    tok = ByteTokenizer(96)
    ids = tok.encode("ab-x-y-z")
    ts = TextStream(tok, ("-y-q",))
    sent = []
    for i in ids:
        assert ts.push([i]) is None
        sent.append(ts.take())
    assert sent == ["a", "b", "", "-x", "", "", "", "-y-z"]  # "-", "-y", "-y-" could begin the stop string
    assert ts.take(final=True) == "" and ts.stopped is None


def test_earliest_stop_wins_and_check_from_skips_early_ones():
    tok = ByteTokenizer(96)
    ids = tok.encode("one. two! three.")
    out, used, ts = _stream(tok, ids, [len(ids)], stops=("!", "."))
    assert out == "one" and used == 4 and ts.stopped == "."
    out, used, ts = _stream(tok, ids, [1] * len(ids), stops=("!", "."), check_from=5)  # "." at id 3 too early
    assert out == "one. two" and used == 9 and ts.stopped == "!"
    with pytest.raises(ValueError):
        TextStream(tok, ("",))


def test_request_models_name_every_bad_field():
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": "8", "foo": 1, "bar": None})
    err = error_from_validation(e.value.errors())
    assert err.status == 400 and "foo, bar" in str(err) and "max_tokens" in str(err)
    assert err.code == "unsupported_field"
    for body, param, code in [
        ({"prompt": "x", "n": 17}, "n", "invalid_value"),
        ({"prompt": "x", "temperature": True}, "temperature", "invalid_type"),
        ({"prompt": "x", "stop": ["s"] * (MAX_STOPS + 1)}, "stop", "invalid_value"),
        ({"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty", "unsupported"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        ({"prompt": "x", "best_of": 2}, "best_of", "unsupported"),
        ({"prompt": []}, "prompt", "invalid_type"),
        ({}, "prompt", "missing_field"),
    ]:
        with pytest.raises(ValidationError) as e:
            CompletionRequest.model_validate(body)
        err = error_from_validation(e.value.errors())
        assert (err.param, err.code) == (param, code), (body, err.body())


def test_request_models_accept_what_clients_send():
    r = CompletionRequest.model_validate({"prompt": ["abc"], "max_tokens": None, "frequency_penalty": 0,
                                          "logit_bias": {}, "stop": "\n", "stream": True, "seed": -1,
                                          "stream_options": {"include_usage": True}, "user": "u", "n": 16})
    assert r.prompt == "abc" and r.stop == ("\n",) and r.max_tokens is None
    assert CompletionRequest.model_validate({"prompt": [[5, 6]]}).prompt == [5, 6]
    chat = ChatCompletionRequest.model_validate({
        "messages": [{"role": "developer",
                      "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
                     {"role": "user", "content": "Hi"}],
        "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 3, "response_format": {"type": "text"},
        "tools": [], "store": False})
    assert render_chat(chat.messages) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    named = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Hi", "name": "ada"}]})
    assert render_chat(named.messages) == "<|user|>\nHi\n<|assistant|>\n"  # OpenAI's name: not templated
    for bad in ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                {"role": "tool", "content": "x"}, {"role": "user", "content": "x", "name": 3},
                {"role": "user", "content": "x", "tool_call_id": "t"}):
        with pytest.raises(ValidationError) as e:
            ChatCompletionRequest.model_validate({"messages": [bad]})
        assert error_from_validation(e.value.errors()).param.startswith("messages[0]")
