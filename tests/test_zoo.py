"""kdlib.zoo: the committed trained models load on the CPU, model real text, and keep DDTree exact."""

import hashlib
import math
from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kdlib import zoo
from kdlib.engine.generate import generate
from kdlib.perf.suites import accept

MAX_MODEL_BYTES = 20 * 10**6  # the storage limit for data/models/


@cache
def _models():
    target = zoo.load_target()
    return zoo.load_tokenizer(), target, zoo.load_drafter(target)


def test_models_are_committed_small_and_match_the_record():
    assert zoo.available()
    assert sum(p.stat().st_size for p in zoo.MODELS.iterdir() if p.is_file()) <= MAX_MODEL_BYTES
    rec = zoo.training_record()
    for name, digest in rec["models_sha256"].items():
        assert hashlib.sha256((zoo.MODELS / name).read_bytes()).hexdigest() == digest, name


@settings(max_examples=30, deadline=None)
@given(st.text(max_size=300))
def test_tokenizer_round_trips_any_text(text):
    tok = _models()[0]
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=30, deadline=None)
@given(st.text(max_size=100))
def test_token_bytes_join_into_the_text(text):
    """Each token's own bytes (a piece of a character included, which decodes to U+FFFD alone) join into
    the text's UTF-8; the byte symbols are the ones `tokenizers`' ByteLevel uses."""
    from tokenizers import pre_tokenizers

    tok = _models()[0]
    assert set(zoo.BYTE_OF) == set(pre_tokenizers.ByteLevel.alphabet()) and sorted(zoo.BYTE_OF.values()) == \
        list(range(256))
    assert b"".join(tok.token_bytes(i) for i in tok.encode(text)) == text.encode("utf-8", "surrogatepass")


def test_tokenizer_round_trips_held_out_text():
    tok = _models()[0]
    assert tok.vocab_size == zoo.training_record()["tokenizer"]["vocab_size"]
    for kind in zoo.KINDS:
        for text in zoo.held_out(kind)[:3]:
            ids = tok.encode(text)
            assert tok.decode(ids) == text
            assert len(ids) < len(text)  # BPE merges: fewer tokens than characters


def test_end_of_text_token_is_named_and_atomic():
    """The tokenizer's end-of-text token is the target config's eos_token_id and one token both ways."""
    tok, target, drafter = _models()
    eos = tok.eos_token_id
    assert eos == tok.token_to_id(zoo.EOS_TOKEN) == target.cfg.extra["eos_token_id"] == 0
    assert tok.encode(zoo.EOS_TOKEN) == [eos] and tok.decode([eos]) == zoo.EOS_TOKEN
    text = zoo.held_out("code")[0][:200]
    ids = tok.encode(text + zoo.EOS_TOKEN + text)
    assert (
        ids == tok.encode(text) + [eos] + tok.encode(text) and tok.decode(ids) == text + zoo.EOS_TOKEN + text
    )
    assert drafter.c.mask_token_id == tok.token_to_id(zoo.MASK_TOKEN) != eos


def test_target_ends_whole_documents_with_eos():
    """Held-out templated excerpts shorter than the excerpt length are whole documents: the target's top-1
    after them is the end-of-text token for at least three in four, and EOS is almost never its top-1
    inside a text (the committed models: 24 of 24, and never)."""
    tok, target, _ = _models()
    whole = [t for t in zoo.held_out("templated") if len(t) < zoo.EXCERPT_CHARS][:8]
    assert len(whole) >= 4
    ends, inside, positions = 0, 0, 0
    with torch.no_grad():
        for text in whole:
            top = target.logits(torch.tensor(tok.encode(text)[-200:])).argmax(-1) == tok.eos_token_id
            ends += int(top[-1])
            inside += int(top[:-1].sum())
            positions += top.shape[0] - 1
    assert ends >= 0.75 * len(whole)
    assert inside <= 0.01 * positions


@pytest.mark.parametrize("kind", zoo.KINDS)
def test_target_models_held_out_text(kind):
    """Perplexity of the engine's own forward on a held-out window, against the recorded full-set figure.

    One window of WINDOW tokens scatters around the full held-out set's NLL; a 1-nat allowance
    (a factor e in perplexity) covers that. The recorded figure itself must lie far below a
    uniform guess over the vocabulary (ln V nats): half of it, i.e. perplexity below sqrt(V).
    """
    window = 256
    tok, target, _ = _models()
    recorded = zoo.training_record()["target"]["held_out"][kind]["nll"]
    assert recorded < 0.5 * math.log(target.cfg.vocab_size)
    text = next(t for t in zoo.held_out(kind) if len(tok.encode(t)) > window)
    ids = torch.tensor(tok.encode(text)[: window + 1])
    logits = target.logits(ids[:-1])
    nll = float(torch.nn.functional.cross_entropy(logits, ids[1:]))
    assert nll < recorded + 1.0


def test_ddtree_with_the_trained_drafter_equals_ar():
    """The engine's invariant on real weights: greedy DDTree (tree and chain) reproduces AR token for token,
    and on templated text the drafter accepts more than one token per step."""
    tok, target, drafter = _models()
    for kind in zoo.KINDS:
        prompt = tok.encode(zoo.held_out(kind)[0])[:48]
        ar = generate(target, prompt, 24)
        tree = generate(target, prompt, 24, method="ddtree", drafter=drafter, budget=16)
        chain = generate(
            target, prompt, 24, method="ddtree", drafter=drafter, budget=drafter.block_size - 1, top_k=1
        )
        assert tree.tokens == ar.tokens, kind
        assert chain.tokens == ar.tokens, kind
        if kind == "templated":
            assert tree.mean_accepted > 1.0


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="kind"):
        zoo.held_out("poetry")
    if zoo.available():
        tok = zoo.load_tokenizer()
        for ids in ([300, tok.vocab_size, 301], [-1]):  # dropped silently / OverflowError before
            with pytest.raises(ValueError, match="outside the vocabulary"):
                tok.decode(ids)
        with pytest.raises(ValueError, match="list of str"):
            tok.encode_batch("hi")
        assert tok.encode_batch(["hi"]) == [tok.encode("hi")]
    assert not zoo.available(tmp_path)
    with pytest.raises(FileNotFoundError, match="train_tiny"):
        zoo.load_target(folder=tmp_path)


@pytest.mark.gpu
def test_ddtree_with_the_trained_drafter_equals_ar_on_cuda():
    """The same invariant on the GPU (CUDA tree builder and accept kernels via kdlib.ops), float32 matmuls
    (TF32 flips near-tied argmaxes between the AR and the tree-verify paths)."""
    assert not torch.backends.cuda.matmul.allow_tf32
    tok = _models()[0]
    target = zoo.load_target(device="cuda")
    drafter = zoo.load_drafter(target)
    for kind in zoo.KINDS:
        prompt = tok.encode(zoo.held_out(kind)[0])[:128]
        ar = generate(target, prompt, 64)
        for budget in (8, 64):
            assert (
                generate(target, prompt, 64, method="ddtree", drafter=drafter, budget=budget).tokens
                == ar.tokens
            ), (kind, budget)


def test_accept_suite_on_the_cpu():
    """The acceptance suite's payload on a minimal sample: every method and kind, AR accepts 1 per step,
    the chain verifies L + 1 rows, every speculative output equals AR's."""
    p = accept.measure("cpu", 1, 12, budgets=(4,), prompt_tokens=32, log=lambda _: None)
    assert p["parameters"]["methods"] == ["ar", "chain", "ddtree_b4"]
    assert not p["notes"]
    for kind in zoo.KINDS:
        rows = p["accept"][kind]["methods"]
        assert p["accept"][kind]["prompts"] == 1
        assert rows["ar"]["mean_accepted"] == 1.0
        assert rows["chain"]["mean_verified_rows"] == p["parameters"]["block_size"]
        assert all(r["equal_to_ar"] for r in rows.values())
        assert all(sum(r["tau_hist"]) == r["steps"] for r in rows.values())
        assert 1.0 <= rows["ddtree_b4"]["mean_accepted"] <= 5.0  # depth <= budget: tau <= budget + 1


def test_training_record_is_complete():
    """Command, commit and device of the run; loss curves that fall; a kept checkpoint that was evaluated;
    held-out figures per kind with perplexity = exp(NLL)."""
    rec = zoo.training_record()
    assert rec["command"].startswith("python") and len(rec["commit"]) == 40 and rec["device"]
    for part in ("target", "drafter"):
        curve = rec[part]["curve"]
        assert len(curve["step"]) == len(curve["loss"]) >= 2
        assert curve["loss"][-1] < curve["loss"][0]
        assert curve["kept_step"] in [e["step"] for e in curve["eval"]]
        assert set(rec[part]["held_out"]) == set(zoo.KINDS)
    for kind, ev in rec["target"]["held_out"].items():
        assert math.isclose(ev["ppl"], math.exp(ev["nll"]), rel_tol=1e-9), kind
        assert ev["tokens"] > 0
