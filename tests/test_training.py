"""kdlib.training: the batched training forwards equal the engine's, the trained drafter is the
engine's class and loads through kdlib.zoo, documents end with the end-of-text token, a few steps
reduce the loss, bad input."""

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kdlib import DATA, ROOT, corpus, zoo
from kdlib import training as T
from kdlib.engine.cache import LatentCache
from kdlib.engine.config import ModelConfig
from kdlib.engine.drafter import DFlashDrafter
from kdlib.engine.generate import generate
from kdlib.engine.model import Model


def _micro_target(vocab=64, seed=0) -> Model:
    cfg = T.target_config(
        vocab,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        max_position_embeddings=256,
    )
    m = Model(ModelConfig.from_dict(cfg))
    T.init_target(m, seed)
    return m


def _micro_drafter(target, block=6, seed=0) -> DFlashDrafter:
    cfg = T.drafter_config(target.cfg, T.MASK_ID, target_layer_ids=(0, target.cfg.num_hidden_layers - 1),
                           block_size=block, num_layers=2, num_heads=2, head_dim=8, intermediate_size=32)
    d = DFlashDrafter(cfg)
    T.init_drafter(d, seed)
    return d


def _streams(vocab, period=12, n=4000):
    """A periodic stream (learnable in a few steps) for every kind's train split: documents of the tokens
    2..period, each followed by EOS."""
    s = (np.arange(n) % period + 2).astype(np.int32) % vocab
    s[s == period + 1] = T.EOS_ID
    return {(k, "train"): s for k in ("code", "prose", "templated")}


@pytest.mark.parametrize("name", ["tiny-a", "tiny-b"])
def test_target_forward_equals_engine(name):
    """The batched training forward (SDPA MLA, dense-expert MoE) is the engine's model, row by row."""
    cfg = ModelConfig.from_json(DATA / "configs" / f"{name}.json")
    m = Model.random(cfg, seed=3)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 17)))
    capture = (0, cfg.num_hidden_layers - 1)
    with torch.no_grad():
        h, taps = T.target_forward(m, ids, capture=capture)
        for b in range(ids.shape[0]):
            h_ref, _, taps_ref = m.forward_plain(ids[b], capture=capture)
            torch.testing.assert_close(m.head(h[b]), m.logits(ids[b]), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(taps[b], taps_ref, rtol=1e-5, atol=1e-5)


def test_drafter_forward_equals_block_forward_loss_and_draft():
    """The batched training forward gives, row by row, the engine's block_forward logits and loss, and the
    logits the engine's inference `draft` gives after a prefill of the anchor's prefix."""
    cfg = ModelConfig.from_json(DATA / "configs" / "tiny-a.json")
    target = Model.random(cfg, seed=1)
    d = _micro_drafter(target).eval()
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 24)))
    anchors = torch.tensor([[1, 5, 17], [3, 9, 18]])
    with torch.no_grad():
        _, feats = T.target_forward(target, ids, capture=d.target_layer_ids)
        logits, labels = T.drafter_forward(d, target, ids, feats, anchors)
        loss, _ = T.drafter_loss(d, target, ids, anchors, gamma=3.0)
        rows = [d.loss(target, ids[b], feats[b], anchors[b], gamma=3.0) for b in range(2)]
        torch.testing.assert_close(loss, torch.stack(rows).mean(), rtol=1e-5, atol=1e-6)
        for b in range(2):
            torch.testing.assert_close(logits[b], d.block_forward(target, ids[b], feats[b], anchors[b]),
                                       rtol=1e-5, atol=1e-5)
    for b in range(2):
        for j, a in enumerate(anchors[b].tolist()):
            assert labels[b, j].tolist() == ids[b, a + 1 : a + d.block_size].tolist()
            cache = LatentCache(cfg, 64)
            _, f = target.prefill(cache, ids[b, :a], d.target_layer_ids)
            d.begin(target, ids[b, :a], f, 8)
            torch.testing.assert_close(d.draft(int(ids[b, a]), a), logits[b, j], rtol=1e-5, atol=1e-5)


def test_sample_anchors_are_distinct_and_keep_blocks_inside():
    gen = torch.Generator().manual_seed(0)
    a = T.sample_anchors(5, 40, 16, 30, gen)
    assert a.shape == (5, 24)  # min(30, 40 - 16)
    for row in a.tolist():
        assert len(set(row)) == len(row) and min(row) >= 1 and max(row) <= 40 - 16


def test_a_few_target_steps_reduce_the_loss():
    target = _micro_target()
    streams = _streams(64)
    window = streams[("code", "train")]
    before = T.evaluate_target(target, window, 32, 8, max_windows=8)["nll"]
    spec = T.TrainSpec(max_steps=3, batch=8, seq=32, lr=1e-2, warmup_steps=1, log_every=1)
    curve = T.train_target(target, streams, spec, log=lambda _: None)
    after = T.evaluate_target(target, window, 32, 8, max_windows=8)["nll"]
    assert curve["steps"] == 3 and len(curve["loss"]) == 3
    assert after < before


def test_the_target_learns_where_documents_end():
    """Documents end with EOS in the streams, so a trained target puts EOS first at their ends, and not
    inside them; an untrained one does neither."""
    target = _micro_target()
    streams = _streams(64)
    stream = streams[("code", "train")][:600]
    before = T.evaluate_eos(target, stream, 32)
    T.train_target(target, streams, T.TrainSpec(max_steps=40, batch=8, seq=32, lr=1e-2, warmup_steps=1,
                                                log_every=10), log=lambda _: None)
    after = T.evaluate_eos(target, stream, 32)
    assert before["documents"] == after["documents"] == len(np.flatnonzero(stream[32:] == T.EOS_ID))
    assert before["eos_top1_at_end"] < 0.5 < after["eos_top1_at_end"]
    assert after["p_eos_at_end"] > 0.5 and after["false_eos_top1"] < 0.05
    assert T.evaluate_eos(target, stream[:20], 32)["documents"] == 0


def test_a_few_drafter_steps_reduce_the_loss_and_ddtree_stays_exact(tmp_path):
    """The engine's DFlashDrafter trains in place, saves with its own `save`, loads through kdlib.zoo, and
    keeps greedy DDTree equal to AR."""
    target = _micro_target()
    streams = _streams(64)
    T.train_target(target, streams, T.TrainSpec(max_steps=20, batch=8, seq=32, lr=1e-2, warmup_steps=1,
                                                log_every=10), log=lambda _: None)
    d = _micro_drafter(target)
    window = streams[("code", "train")]
    before = T.evaluate_drafter(d, target, window, 32, 8, windows=8)["loss"]
    spec = T.TrainSpec(max_steps=3, batch=8, seq=32, lr=1e-2, warmup_steps=1, log_every=1, anchors=8)
    T.train_drafter(d, target, streams, spec, log=lambda _: None)
    after = T.evaluate_drafter(d, target, window, 32, 8, windows=8)["loss"]
    assert after < before
    assert not any(p.requires_grad for p in target.parameters())  # the target stayed frozen
    prompt = window[:20].tolist()
    ar = generate(target, prompt, 24)
    for budget in (4, 16):
        assert generate(target, prompt, 24, method="ddtree", drafter=d, budget=budget).tokens == ar.tokens
    T.save_drafter(d, tmp_path / "drafter.kdtr", {"note": "test", "steps": 3})
    loaded = zoo.load_drafter(target, folder=tmp_path)
    assert type(loaded) is DFlashDrafter and loaded.c == d.c
    for k, v in d.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v.half().float()), k  # stored in float16


def test_save_weights_refuses_a_value_float16_cannot_hold(tmp_path):
    lin = torch.nn.Linear(2, 2)
    with torch.no_grad():
        lin.weight[0, 0] = 1e5  # float16 tops out at 65,504: it would load back as inf
    with pytest.raises(ValueError, match="weight: a value past float16's range"):
        T.save_weights(lin, tmp_path / "w.kdtr", {})
    assert not (tmp_path / "w.kdtr").exists()
    with torch.no_grad():
        lin.weight[0, 0] = float("inf")  # already not finite: stored as it is
    T.save_weights(lin, tmp_path / "w.kdtr", {})


def test_kept_state_is_the_best_validation_score():
    target = _micro_target()
    scores = iter([3.0, 1.0, 2.0])
    snapshots = []

    def eval_fn():
        snapshots.append(target.model.norm.weight.detach().clone())
        return {"score": next(scores)}

    spec = T.TrainSpec(max_steps=3, batch=4, seq=16, lr=1e-2, warmup_steps=1, log_every=1)
    curve = T.train_target(target, _streams(64), spec, log=lambda _: None, eval_fn=eval_fn, eval_every=1)
    assert curve["kept_step"] == 2
    torch.testing.assert_close(target.model.norm.weight, snapshots[1])


@pytest.mark.parametrize("scores,kept", [((float("nan"), 1.0, 0.5), 3), ((2.0, float("nan"), 3.0), 1),
                                         ((float("nan"),) * 3, 3)])
def test_a_score_that_is_not_a_number_is_never_kept_as_the_best(scores, kept):
    target = _micro_target()
    scores = iter(scores)
    spec = T.TrainSpec(max_steps=3, batch=4, seq=16, lr=1e-2, warmup_steps=1, log_every=1)
    curve = T.train_target(target, _streams(64), spec, log=lambda _: None,
                           eval_fn=lambda: {"score": next(scores)}, eval_every=1)
    assert curve["kept_step"] == kept


def test_router_bias_moves_towards_the_mean_load():
    target = _micro_target()
    n_moe = sum(cfg_is for cfg_is in target.cfg.is_moe_layer)
    loads = [torch.tensor([10, 0, 3, 3])] * n_moe
    T.balance_router(target, loads, rate=0.5)
    bias = target.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.tolist() == [-0.5, 0.5, 0.5, 0.5]


@settings(max_examples=25, deadline=None)
@given(st.text(max_size=200))
def test_tokenizer_round_trips(text):
    assert _tok().decode(_tok().encode(text, add_special_tokens=False).ids) == text


_TOK = []


def _tok():
    if not _TOK:
        _TOK.append(
            T.train_tokenizer(["def f(x):\n    return x + 1\n", "Hello, world. " * 20, "é ü 中文 🙂"], 300)
        )
    return _TOK[0]


def test_special_tokens_have_fixed_ids_and_are_atomic():
    assert T.train_tokenizer(["def f(x):\n    return x + 1\n"], 270).get_vocab_size() == 270  # specials count
    tok = _tok()
    assert [tok.token_to_id(t) for t in (zoo.EOS_TOKEN, zoo.MASK_TOKEN)] == [T.EOS_ID, T.MASK_ID] == [0, 1]
    ids = tok.encode(f"x = 1{zoo.EOS_TOKEN}def", add_special_tokens=False).ids
    assert ids.count(T.EOS_ID) == 1
    assert tok.decode(ids, skip_special_tokens=False) == f"x = 1{zoo.EOS_TOKEN}def"
    assert tok.encode(zoo.EOS_TOKEN, add_special_tokens=False).ids == [T.EOS_ID]
    assert tok.decode([T.EOS_ID], skip_special_tokens=False) == zoo.EOS_TOKEN
    wrapped = zoo.Tokenizer(tok)
    assert wrapped.eos_token_id == T.EOS_ID and wrapped.encode(zoo.EOS_TOKEN) == [T.EOS_ID]
    assert T.target_config(300)["eos_token_id"] == T.EOS_ID


def test_training_windows_end_documents_with_eos():
    """Every document of a stream ends with EOS and holds no other; a window decodes to whole documents
    between its EOS tokens."""
    tok = _tok()
    texts = [f"def f{i}(x):\n    return x + {i}\n" * (1 + i % 3) for i in range(12)]
    docs = [corpus.Doc("code", f"m{i}.py", t, "train") for i, t in enumerate(texts)]
    stream = T.token_streams(tok, docs)[("code", "train")]
    ends = np.cumsum([len(tok.encode(t, add_special_tokens=False).ids) + 1 for t in texts]) - 1
    assert np.flatnonzero(stream == T.EOS_ID).tolist() == ends.tolist()
    rng = np.random.Generator(np.random.PCG64(0))
    wins = T.sample_windows({("code", "train"): stream}, {"code": 1.0}, 16, 60, rng)
    assert all((w == T.EOS_ID).any() for w in wins)
    for w in wins:
        pieces = tok.decode(w.tolist(), skip_special_tokens=False).split(zoo.EOS_TOKEN)
        assert all(p in texts for p in pieces[1:-1])
        assert any(t.endswith(pieces[0]) for t in texts) and any(t.startswith(pieces[-1]) for t in texts)
    with pytest.raises(ValueError, match="special token"):
        T.token_streams(tok, [corpus.Doc("prose", "x", f"a {zoo.EOS_TOKEN} b", "train")])


def _train_tiny():
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "tools" / "train_tiny.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _mini_corpus(folder: Path) -> None:
    """A few documents of every kind and split, long enough for 64-token windows and 32-token prompts."""
    docs = []
    for kind in corpus.KINDS:
        for i in range(8):
            text = "".join(f"{kind} line {i}.{j}: value = {i * j} # {'abcdefgh'[j % 8]}\n" for j in range(40))
            docs.append(corpus.Doc(kind, f"{kind}/{i}", text, "held_out" if i >= 6 else "train"))
    corpus.write(docs, folder)


def test_train_tiny_smoke_run_writes_everything(tmp_path, capsys):
    """The whole pipeline (tiny corpus, micro sizes): eight files, a record written by the run itself, a
    drafter that zoo loads and that keeps DDTree equal to AR, EOS named consistently, a final line that
    names the folder."""
    _mini_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    rc = _train_tiny().main(["--smoke", "--corpus", str(tmp_path / "corpus"), "--out", str(out),
                             "--target-s", "60", "--drafter-s", "60", "--accept-s", "30"])
    assert rc == 0
    names = sorted(p.name for p in out.iterdir())
    assert len(names) == 8 and {*zoo.FILES, "train.log"} <= set(names)
    assert [n for n in names if n.startswith("accept.")]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "done" in last and str(out.resolve()) in last and "drafter.kdtr" in last
    assert (out / "train.log").read_text().strip().splitlines()[-1].endswith(last.split("] ", 1)[1])
    rec = json.loads((out / "training_record.json").read_text())
    assert rec["smoke"] and rec["target"]["spec"]["time_budget_s"] == 60
    assert rec["tokenizer"]["special_tokens"] == {zoo.EOS_TOKEN: 0, zoo.MASK_TOKEN: 1}
    assert set(rec["target"]["end_of_text"]) == set(corpus.KINDS)
    tok = zoo.load_tokenizer(out)
    assert json.loads((out / "target.config.json").read_text())["eos_token_id"] == tok.eos_token_id == 0
    target = zoo.load_target(folder=out)
    drafter = zoo.load_drafter(target, folder=out)
    assert drafter.c.mask_token_id == tok.token_to_id(zoo.MASK_TOKEN)
    prompt = tok.encode(zoo.held_out("code", out)[0])[:24]
    ar = generate(target, prompt, 16)
    assert generate(target, prompt, 16, method="ddtree", drafter=drafter, budget=8).tokens == ar.tokens


def test_train_tiny_bad_arguments(capsys, tmp_path):
    """Exit 2 with one line before anything is written; the shipped models are never a default target."""
    tt = _train_tiny()
    (tmp_path / "file").write_text("x")
    out = ["--out", str(tmp_path / "run")]
    for argv, message in (
        (["--target-s", "0", *out], "argument --target-s: must be a positive number, got '0'"),
        (["--drafter-s", "-1", *out], "argument --drafter-s: must be a positive number, got '-1'"),
        (["--accept-s", "nan", *out], "argument --accept-s: must be a positive number, got 'nan'"),
        (["--device", "tpu", *out], "argument --device: invalid choice: 'tpu'"),
        (["--smoke"], "required: --out"),
        (["--out", str(zoo.MODELS)], "--replace-shipped"),
        (["--out", str(tmp_path / "file")], "is a file, not a folder"),
        (["--corpus", str(tmp_path / "file"), *out], "argument --corpus: " + str(tmp_path / "file")),
        (["--seed", "-1", *out], "--seed must be >= 0"),
        (["--out", str(tmp_path / "file" / "sub")],
         "argument --out: cannot use " + str(tmp_path / "file" / "sub")),
        *([(["--device", "cuda", *out], "--device cuda but torch sees no CUDA device")]
          if not torch.cuda.is_available() else []),
    ):
        with pytest.raises(SystemExit) as e:
            tt.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err, argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_train_tiny_that_fails_leaves_the_earlier_models_whole(tmp_path, monkeypatch):
    """A run into a folder of trained models that failed after its first files (here: a corpus with no
    held-out text) left new held_out.json and tokenizer.json beside the old target and drafter, a mix that
    zoo loaded; the files now land together, or the old set stays."""
    out = tmp_path / "out"
    out.mkdir()
    for f in zoo.FILES:
        (out / f).write_text(f"old {f}")
    empty = tmp_path / "empty"
    docs = [corpus.Doc(k, f"{k}/0", "some text\n" * 50, "train") for k in corpus.KINDS]
    corpus.write(docs, empty)
    tt = _train_tiny()
    assert tt.main(["--smoke", "--corpus", str(empty), "--out", str(out)]) == 1
    assert all((out / f).read_text() == f"old {f}" for f in zoo.FILES)
    log = (out / "train.log").read_text()
    assert "has no documents for code.held_out, prose.held_out, templated.held_out" in log

    def fail_late(*args, **kwargs):
        raise RuntimeError("stopped in the drafter phase")

    monkeypatch.setattr(tt.T, "train_drafter", fail_late)
    _mini_corpus(tmp_path / "corpus")
    assert tt.main(["--smoke", "--corpus", str(tmp_path / "corpus"), "--out", str(out)]) == 1
    assert all((out / f).read_text() == f"old {f}" for f in zoo.FILES)
    assert (out / tt.STAGING / "target.kdtr").is_file()  # what was written stays, apart


@pytest.mark.parametrize("change, message", [
    (dict(batch=0), "TrainSpec.batch must be an int >= 1, got 0"),
    (dict(seq=0), "TrainSpec.seq must be an int >= 1, got 0"),
    (dict(log_every=0), "TrainSpec.log_every must be an int >= 1, got 0"),
    (dict(max_steps=2.5), "TrainSpec.max_steps must be an int >= 1, got 2.5"),
    (dict(lr=float("nan")), "TrainSpec.lr must be a number > 0, got nan"),
    (dict(time_budget_s=0), "TrainSpec.time_budget_s must be a number > 0, got 0"),
    (dict(weight_decay=-0.1), "TrainSpec.weight_decay must be a number >= 0, got -0.1"),
    (dict(weights={"cod": 1}), "TrainSpec.weights must map kinds of"),
    (dict(weights={"code": 0}), "with a positive sum, got {'code': 0}"),
    (dict(weights={"code": "a"}), "TrainSpec.weights must map kinds of"),
])
def test_train_spec_refuses_what_fails_mid_run(change, message):
    """batch 0 failed as a reshape, log_every 0 divided by zero, a misspelt kind was a KeyError and a zero
    share numpy's 'Probabilities contain NaN', each once training had begun."""
    with pytest.raises(ValueError, match=re.escape(message)):
        T.TrainSpec(**{**dict(max_steps=3, batch=8, seq=32, lr=1e-2), **change})


def test_evaluate_target_refuses_zero_windows():
    with pytest.raises(ValueError, match="max_windows must be >= 1 or None, got 0"):
        T.evaluate_target(_micro_target(), np.arange(5000), 16, 4, max_windows=0)


def test_bad_input():
    with pytest.raises(ValueError, match="vocab_size"):
        T.train_tokenizer(["x"], 100)
    with pytest.raises(ValueError, match="unknown"):
        T.target_config(64, hidden=3)
    target = _micro_target()
    with pytest.raises(ValueError, match="unknown"):
        T.drafter_config(target.cfg, 1, heads=2)
    with pytest.raises(ValueError, match="block_size"):
        T.drafter_config(target.cfg, 1, block_size=1)
    with pytest.raises(ValueError, match="target_layer_ids"):
        T.drafter_config(target.cfg, 1, target_layer_ids=(5,))
    with pytest.raises(ValueError, match="anchor"):
        T.sample_anchors(2, 10, 16, 4, torch.Generator())


def test_windows_reach_the_stream_end_and_bad_sizes_are_named():
    """Every start whose window fits is drawn, the last one included (the final token, an EOS, was never a
    target); a stream shorter than the window and per_seq below 1 are named errors (a bare 'high <= 0',
    and a NaN loss from an empty anchor set, before)."""
    rng = np.random.default_rng(0)
    streams = {("code", "train"): np.arange(10)}
    starts = {int(T.sample_windows(streams, {"code": 1.0}, 1, 5, rng)[0, 0]) for _ in range(400)}
    assert starts == set(range(6))
    assert T.sample_windows({("code", "train"): np.arange(5)}, {"code": 1.0}, 2, 5, rng).tolist() == [
        list(range(5))] * 2  # a stream of exactly one window
    with pytest.raises(ValueError, match="shorter than the window"):
        T.sample_windows({("code", "train"): np.arange(4)}, {"code": 1.0}, 1, 5, rng)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="per_seq must be"):
            T.sample_anchors(2, 48, 8, bad, torch.Generator())
