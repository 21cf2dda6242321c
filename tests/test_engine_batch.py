"""kdlib.engine.batch: batched DDTree == single-stream AR greedy under continuous batching, the sampled
distribution (chi-square against the exact AR distribution), seeds independent of the batch, the pool's
bookkeeping (all free afterwards, no stream reads another's slots, poisoned free slots), clear errors."""

import dataclasses
import itertools
import math
from functools import cache

import numpy as np
import pytest
import torch
from test_engine_generate import assert_equals_ar_up_to_near_tie

from kdlib import DATA
from kdlib.engine.batch import (
    STEP_HISTORY,
    BatchEngine,
    SamplingParams,
    filtered_probs,
    generate_batch,
    hashed_uniforms,
)
from kdlib.engine.config import ModelConfig
from kdlib.engine.drafter import DFlashConfig, DFlashDrafter, NoisyOracleDrafter
from kdlib.engine.generate import generate
from kdlib.engine.model import Model


@cache
def _model(vocab: int | None = None, device: str = "cpu") -> Model:
    cfg = ModelConfig.from_json(DATA / "configs" / "tiny-a.json")
    if vocab is not None:
        cfg = dataclasses.replace(cfg, vocab_size=vocab)
    return Model.random(cfg, seed=0, device=device)


def _drafter(kind: str, model: Model, block: int = 6):
    if kind == "oracle":
        return NoisyOracleDrafter(model.cfg.vocab_size, p_wrong=0.3, block_size=block, seed=1)
    return DFlashDrafter(DFlashConfig.for_target(model.cfg, block_size=block), seed=2).to(model.device)


def _prompts(n: int, seed: int, vocab: int, lo: int = 1, hi: int = 300) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def _ar(model, prompt, n) -> list[int]:
    return generate(model, prompt, n).tokens


def _equals_ar(model, prompt, tokens, n, what=""):
    """tokens == single-stream AR greedy's n tokens after prompt, up to a near-tie within float rounding (a
    batched step computes each row with other shapes than a one-stream step)."""
    assert_equals_ar_up_to_near_tie(model, prompt, _ar(model, prompt, n), list(tokens), what)


@pytest.mark.parametrize("streams", [1, 3, 16])
@pytest.mark.parametrize(
    "method,kind,budget,overlap",
    [("ar", None, None, False), ("ddtree", "oracle", 1, False), ("ddtree", "oracle", 64, False),
     ("ddtree", "dflash", 8, False), ("ar", None, None, True), ("ddtree", "dflash", 8, True)],
)
def test_greedy_batch_equals_single_stream_ar(streams, method, kind, budget, overlap):
    m = _model()
    prompts = _prompts(streams, seed=streams * 7 + (budget or 0), vocab=m.cfg.vocab_size)
    new = [int(x) for x in np.random.default_rng(streams).integers(4, 14, streams)]
    drafter = _drafter(kind, m) if kind else None
    eng = BatchEngine(m, max_streams=streams, method=method, drafter=drafter, budget=budget,
                      keep_results=True, overlap=overlap)
    rids = [eng.add_request(p, n) for p, n in zip(prompts, new, strict=True)]
    while eng.has_work():
        eng.step()
    for rid, p, n in zip(rids, prompts, new, strict=True):
        _equals_ar(m, p, eng.result(rid).tokens, n, (method, kind, budget, len(p)))
    assert eng.pool_free_slots == eng.pool_slots and eng.num_running == 0


def test_overlap_runs_past_a_request_that_fills_its_context():
    """Under overlap the step after a request's last one runs before the host sees it finish: with
    accepted drafts it starts up to a tree's width past the end, and a request that fills max_context
    (generate_batch sets it to the longest request) must still find its page-table columns."""
    from kdlib import zoo

    target = zoo.load_target()
    drafter, tok = zoo.load_drafter(target), zoo.load_tokenizer()
    prompt = tok.encode("def foo(x):\n    return")
    runs = [generate_batch(target, [prompt], 40, method="ddtree", drafter=drafter, budget=8, overlap=overlap,
                           graphs=False)[0] for overlap in (True, False)]
    assert runs[0].tokens == runs[1].tokens == generate(target, prompt, 40).tokens
    assert max(runs[0].accepted) > 2  # the drafts were accepted: the step in flight ran past the end


def test_generate_batch_matches_ar_and_reports_acceptance():
    m = _model()
    prompts = _prompts(4, seed=3, vocab=m.cfg.vocab_size, hi=40)
    res = generate_batch(m, prompts, 12, method="ddtree", drafter=_drafter("oracle", m), budget=16)
    for r, p in zip(res, prompts, strict=True):
        _equals_ar(m, p, r.tokens, 12)
        assert sum(r.accepted) >= 11 and r.target_forwards == 1 + len(r.accepted)
        assert r.mean_accepted > 1.0  # the oracle is right 70% of the time per depth


def test_tree_sizes_and_draft_tokens_are_the_trees_built():
    """A top-K of 1 builds a chain of the block's depth, well under the budget: generate_batch reports the
    verified rows as generate does (nodes, root included), and the spec-decode counters count those drafts."""
    m = _model()
    p = [5, 6, 7, 8]
    d = NoisyOracleDrafter(m.cfg.vocab_size, p_wrong=0.3, block_size=5, seed=1)
    single = generate(m, p, 10, method="ddtree", drafter=d, budget=32, top_k=1)
    batched = generate_batch(m, [p], 10, method="ddtree", drafter=d, budget=32, top_k=1)[0]
    assert batched.tokens == single.tokens and batched.tree_sizes == single.tree_sizes
    assert max(single.tree_sizes) < 33
    eng = BatchEngine(m, method="ddtree", drafter=d, budget=32, top_k=1, max_streams=1, keep_results=True)
    rid = eng.add_request(p, 10)
    while eng.has_work():
        eng.step()
    assert eng.spec_stats["draft_tokens"] == sum(n - 1 for n in eng.result(rid).tree_sizes)
    assert eng.result(rid).tree_sizes == single.tree_sizes


@pytest.mark.parametrize("overlap", [False, True])
def test_streams_join_and_leave_mid_run_with_poisoned_free_slots(overlap):
    """Continuous batching over 3 lanes: requests arrive between steps, one is aborted, the rest equal
    their single-stream AR output; every free slot holds NaN at every step (a stream reading a slot it
    does not own would turn NaN), and each lane's page table only names its own slots. With overlap
    the step in flight also runs requests that finished in the step before it (their tokens dropped)."""
    m = _model()
    V = m.cfg.vocab_size
    prompts = _prompts(8, seed=11, vocab=V, hi=120)
    new = [5, 9, 3, 12, 7, 1, 10, 6]
    eng = BatchEngine(
        m,
        max_streams=3,
        method="ddtree",
        drafter=_drafter("dflash", m),
        budget=5,
        keep_results=True,
        num_slots=420,
        overlap=overlap,
    )
    arrivals = {0: [0, 1], 2: [2, 3, 4], 3: [5], 6: [6, 7]}
    rids, aborted = {}, None
    for step in itertools.count():
        for i in arrivals.get(step, []):
            rids[i] = eng.add_request(prompts[i], new[i])
        if step == 4:
            aborted = rids[3]
            assert eng.abort(aborted)
        free = torch.tensor(eng.pool.free_slots(), dtype=torch.int64)
        eng.pool.kv[:, free] = float("nan")
        eng.step()
        for lane, r in enumerate(eng._lanes):
            if r is not None:
                seen = set(eng.table[lane, : int(eng.lens[lane]) + eng.rows].tolist())
                assert seen <= set(r.slots), f"lane {lane} reads slots it does not own"
        if step > max(arrivals) and not eng.has_work():
            break
    for i, rid in rids.items():
        if rid == aborted:
            assert eng.result(rid) is None
            continue
        _equals_ar(m, prompts[i], eng.result(rid).tokens, new[i], i)
    assert eng.pool_free_slots == eng.pool_slots and eng.num_running == eng.num_waiting == 0


def test_a_request_waits_for_slots_then_runs():
    m = _model()
    p = _prompts(3, seed=5, vocab=m.cfg.vocab_size, lo=50, hi=60)
    eng = BatchEngine(m, max_streams=3, num_slots=2 * (60 + 8 + 1), keep_results=True)
    rids = [eng.add_request(x, 8) for x in p]
    eng.step()
    assert eng.num_running == 2 and eng.num_waiting == 1  # the third does not fit until one ends
    while eng.has_work():
        eng.step()
    for r, x in zip(rids, p, strict=True):
        _equals_ar(m, x, eng.result(r).tokens, 8)


def test_errors_are_clear_and_before_any_work():
    m = _model()
    eng = BatchEngine(m, max_streams=2, num_slots=100)
    with pytest.raises(ValueError, match="KV slots"):
        eng.add_request([1] * 90, 20)
    with pytest.raises(ValueError, match="context limit"):
        eng.add_request([1] * 1000, 100)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request([m.cfg.vocab_size], 4)
    with pytest.raises(ValueError, match="temperature"):
        eng.add_request([1], 4, SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="top_p"):
        eng.add_request([1], 4, SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="or >= 1e-05"):  # logits / 1e-40 overflows: refused, not NaN
        eng.add_request([1], 4, SamplingParams(temperature=1e-40))
    for t in (1e39, float("inf"), float("nan")):  # past float32: the lane's tensor write had raised mid-step
        with pytest.raises(ValueError, match=r"temperature must be a number in \[0, 3.403e\+38\]"):
            eng.add_request([1], 4, SamplingParams(temperature=t))
    with pytest.raises(ValueError, match="needs a drafter"):
        BatchEngine(m, method="ddtree")
    # the tree's shape is checked as generate checks it (kdlib.engine.generate.check_tree), from 1
    for budget, named in ((0, r"budget must be an int >= 1, got 0 \(generate's budget 0"), (2.5, "got 2.5"),
                          (257, "budget 257 exceeds the tree kernels' limit 256")):
        with pytest.raises(ValueError, match=named):
            BatchEngine(m, method="ddtree", drafter=_drafter("oracle", m), budget=budget)
    with pytest.raises(ValueError, match=r"tree depth min\(L=19, budget=20\) exceeds"):
        BatchEngine(m, method="ddtree", drafter=_drafter("oracle", m, block=20), budget=20)
    for top_k in (0, -1, 2.5):  # 0 would draft nothing, -1 fail inside torch at the first step
        with pytest.raises(ValueError, match="top_k must be an int >= 1"):
            BatchEngine(m, method="ddtree", drafter=_drafter("oracle", m), budget=4, top_k=top_k)
    # sizes that were truncated (2.9 -> 2) or taken as ints (True -> 1), stop ids of the wrong kind
    for kw, named in (({"max_context": 2.9}, "max_context"), ({"num_slots": True}, "num_slots"),
                      ({"max_streams": 2.0}, "max_streams")):
        with pytest.raises(ValueError, match=f"{named} must be an int >= 1"):
            BatchEngine(m, **kw)
    for stops in ((True,), 5, "12"):
        with pytest.raises(ValueError, match="stop_token_ids"):
            eng.add_request([1], 4, SamplingParams(stop_token_ids=stops))
    for stops in (np.array([1, 2]), {1, 2}, [1, 2]):  # sequences of ids other than tuples: made tuples
        got = SamplingParams(stop_token_ids=stops, min_tokens=2).validate(64).stop_token_ids
        assert got in ((1, 2), (2, 1)) and all(type(t) is int for t in got)
    for new in (None, 2.5, 0):
        with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
            generate_batch(m, [[1]], new)
    assert not eng.has_work() and eng.pool_free_slots == 100


def test_wrong_types_and_ints_past_the_lanes_are_named_before_any_work():
    """These gave raw errors: 'Overflow when unpacking long long' at the prefill (top_k, min_tokens of
    2**63), 'int' object is not iterable, 'dict' object has no attribute 'validate', 'str' object has no
    attribute 'vocab_size'."""
    m = _model()
    eng = BatchEngine(m, max_streams=2, keep_results=True)
    for field in ("top_k", "min_tokens"):
        for v in (2**63, 2**62, -1):
            with pytest.raises(ValueError, match=rf"{field} must be an int in \[0, 2\*\*62\)"):
                eng.add_request([1], 2, SamplingParams(temperature=0.5, stop_token_ids=(3,), **{field: v}))
    with pytest.raises(ValueError, match="params must be a SamplingParams or None, got dict"):
        eng.add_request([1], 2, {"temperature": 0.5})
    with pytest.raises(ValueError, match="token_ids must be a sequence of token ids, got str"):
        eng.add_request("hello", 2)
    assert not eng.has_work()
    with pytest.raises(ValueError, match=r"prompts\[0\] must be a sequence of token ids, got int"):
        generate_batch(m, [1, 2, 3], 4)
    with pytest.raises(ValueError, match=r"prompts\[1\] must be a sequence of token ids, got str"):
        generate_batch(m, [[1], "hi"], 4)
    with pytest.raises(ValueError, match="prompts must be a sequence of prompts, got str"):
        generate_batch(m, "hello", 4)
    for drafter in ("x", generate):
        with pytest.raises(ValueError, match="drafter must be a DFlashDrafter, a NoisyOracleDrafter or one"):
            BatchEngine(m, method="ddtree", drafter=drafter)
    # the largest values allowed run: top_k past the vocabulary keeps every token, min_tokens masks all along
    big = SamplingParams(temperature=0.5, top_k=2**62 - 1, min_tokens=2**62 - 1, stop_token_ids=(3,), seed=0)
    rid = eng.add_request([1, 2], 3, big)
    while eng.has_work():
        eng.step()
    got = eng.result(rid).tokens
    assert len(got) == 3 and 3 not in got


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_tokens_min_tokens_and_ignore_eos(overlap):
    m = _model()
    prompt = _prompts(1, seed=2, vocab=m.cfg.vocab_size, hi=30)[0]
    ref = _ar(m, prompt, 12)
    stop = ref[4]
    first = ref.index(stop)
    eng = BatchEngine(m, max_streams=3, method="ddtree", drafter=_drafter("oracle", m), budget=8,
                      keep_results=True, overlap=overlap)
    a = eng.add_request(prompt, 12, SamplingParams(stop_token_ids=(stop,)))
    b = eng.add_request(prompt, 12, SamplingParams(stop_token_ids=(stop,), ignore_eos=True))
    c = eng.add_request(prompt, 12, SamplingParams(stop_token_ids=(stop,), min_tokens=first + 1))
    reasons = {}
    while eng.has_work():
        for o in eng.step():
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    _equals_ar(m, prompt, eng.result(b).tokens, 12, "ignore_eos")
    assert reasons[b] == "length"
    assert eng.result(b).tokens == ref, "a near-tie within the first 12 tokens: pick another prompt seed"
    assert eng.result(a).tokens == ref[: first + 1] and reasons[a] == "stop"
    # min_tokens masks the stop token where it led (vLLM's rule): the best other token comes instead
    got = eng.result(c).tokens
    with torch.no_grad():
        masked = m.logits(prompt + ref[:first])[-1].clone()
    masked[stop] = float("-inf")
    assert got[:first] == ref[:first] and got[first] == int(masked.argmax()) != stop
    assert (reasons[c], got[-1]) == ("stop", stop) if stop in got else reasons[c] == "length"
    ar = BatchEngine(m, max_streams=1, keep_results=True, overlap=overlap)  # AR under the same masking
    rid = ar.add_request(prompt, 12, SamplingParams(stop_token_ids=(stop,), min_tokens=first + 1))
    while ar.has_work():
        ar.step()
    assert ar.result(rid).tokens == got


def test_sampled_lanes_draw_no_stop_token_before_min_tokens():
    """At a flat temperature half the vocabulary as stop tokens ends an unmasked request within a few tokens
    (all three surviving 10 draws: ~1e-9); masked until min_tokens, none of them is drawn there, in AR or
    DDTree, beside the unmasked lanes."""
    m = _model()
    V = m.cfg.vocab_size
    stops = tuple(range(0, V, 2))
    prompt = _prompts(1, seed=5, vocab=V, hi=20)[0]
    for method, kw in (("ar", {}), ("ddtree", {"drafter": _drafter("oracle", m), "budget": 8})):
        eng = BatchEngine(m, max_streams=8, method=method, keep_results=True, **kw)
        masked = [eng.add_request(prompt, 12, SamplingParams(temperature=5.0, seed=s, stop_token_ids=stops,
                                                              min_tokens=10)) for s in range(6)]
        free = [eng.add_request(prompt, 12, SamplingParams(temperature=5.0, seed=s, stop_token_ids=stops))
                for s in range(3)]
        while eng.has_work():
            eng.step()
        for rid in masked:
            toks = eng.result(rid).tokens
            assert len(toks) >= 10 and not set(toks[:10]) & set(stops), (method, toks)
        assert min(len(eng.result(r).tokens) for r in free) < 10


def test_logprobs_match_the_target_distribution():
    m = _model()
    prompt = _prompts(1, seed=4, vocab=m.cfg.vocab_size, hi=20)[0]
    eng = BatchEngine(
        m, max_streams=1, method="ddtree", drafter=_drafter("oracle", m), budget=4, keep_results=True
    )
    rid = eng.add_request(prompt, 6, SamplingParams(logprobs=3))
    entries = []
    while eng.has_work():
        for o in eng.step():
            entries.extend(o.logprobs)
    toks = eng.result(rid).tokens
    assert [e["token"] for e in entries] == toks
    # [6, V] row i predicts toks[i]
    lp = torch.log_softmax(m.logits(prompt + toks), dim=-1)[len(prompt) - 1 : -1]
    for i, e in enumerate(entries):
        assert e["logprob"] == pytest.approx(float(lp[i, toks[i]]), abs=1e-4)
        assert [t for t, _ in e["top"]] == lp[i].topk(3).indices.tolist()


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_logprobs_on_a_vocabulary_under_twenty(method):
    """A vocabulary smaller than TOP_LOGPROBS: every token is an alternative, each once, best first."""
    m = _model(vocab=12)
    prompt = _prompts(1, seed=9, vocab=12, hi=10)[0]
    spec = {"drafter": _drafter("oracle", m), "budget": 4} if method == "ddtree" else {}
    eng = BatchEngine(m, max_streams=1, method=method, **spec)
    eng.add_request(prompt, 5, SamplingParams(logprobs=20))
    entries = [e for _ in range(20) if eng.has_work() for o in eng.step() for e in o.logprobs]
    assert len(entries) == 5
    for e in entries:
        ids, vals = [t for t, _ in e["top"]], [v for _, v in e["top"]]
        assert sorted(ids) == list(range(12)) and vals == sorted(vals, reverse=True)
        assert dict(e["top"])[e["token"]] == pytest.approx(e["logprob"], abs=1e-6)


def test_prompt_logprobs_match_a_full_forward():
    m = _model()
    prompt = _prompts(1, seed=6, vocab=m.cfg.vocab_size, lo=8, hi=20)[0]
    eng = BatchEngine(m, max_streams=1)
    got = eng.prompt_logprobs(prompt, 2)
    lp = torch.log_softmax(m.logits(prompt), dim=-1)  # [P, V] row i predicts prompt[i+1]
    assert got[0] is None and len(got) == len(prompt)
    for i in range(1, len(prompt)):
        assert got[i]["token"] == prompt[i]
        assert got[i]["logprob"] == pytest.approx(float(lp[i - 1, prompt[i]]), abs=1e-5)
        assert [t for t, _ in got[i]["top"]] == lp[i - 1].topk(2).indices.tolist()
    with pytest.raises(ValueError, match="top_n"):
        eng.prompt_logprobs(prompt, 99)


def test_hashed_uniforms_are_uniform_and_a_pure_function():
    seeds = torch.arange(64, dtype=torch.int64) * 7919 + 3
    u = hashed_uniforms(seeds, torch.full((64,), 17, dtype=torch.int64), 256)  # [64, 256]
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(u, hashed_uniforms(seeds, torch.full((64,), 17, dtype=torch.int64), 256))
    counts = torch.histc(u.float(), bins=16, min=0, max=1)
    chi2 = float(((counts - u.numel() / 16) ** 2 / (u.numel() / 16)).sum())
    p = float(torch.special.gammaincc(torch.tensor(7.5), torch.tensor(chi2 / 2)))
    assert p > 1e-3, f"uniformity chi-square {chi2:.1f}, p = {p:.2e}"
    assert len(set(u.flatten().tolist())) == u.numel()


def test_filtered_probs_top_k_and_top_p():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    one = torch.ones(1)
    p = filtered_probs(logits, one, torch.tensor([0.7]), torch.tensor([0]), True)[0, 0]
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    p = filtered_probs(logits, one, torch.tensor([1.0]), torch.tensor([3]), True)[0, 0]
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    assert torch.allclose(filtered_probs(logits, one, one, torch.tensor([0]), False)[0, 0],
                          torch.tensor([0.5, 0.3, 0.15, 0.05]))
    for tiny in (1e-30, 1e-46):  # 1e-46 is 0 in float32: the most likely token stays (it had left a 0 / 0)
        p = filtered_probs(logits, one, torch.tensor([tiny]), torch.tensor([0]), True)[0, 0]
        assert torch.equal(p, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_top_p_one_keeps_every_token_beside_a_filtered_lane():
    """top_p 1 means all tokens, also when a neighbour's top_p makes the batch filter: a float32 cumsum of
    4096 probabilities reaches 1 before its tail, which must not be cut."""
    logits = torch.randn(2, 1, 4096, generator=torch.Generator().manual_seed(0)) * 5  # [C, W, V]
    one = torch.ones(2)
    p = filtered_probs(logits, one, torch.tensor([1.0, 0.5]), torch.zeros(2, dtype=torch.long), True)
    assert (p[0, 0] > 0).all()  # every token keeps its (tiny) probability
    assert torch.equal(p[0, 0], torch.softmax(logits[0, 0], -1))  # to the bit: draws independent of the batch
    assert (p[1, 0] == 0).any()  # the neighbour's top_p still cuts


def _exact_joint(model, prompt, temperature, n=3) -> dict:
    """P(t1..tn) of AR sampling at `temperature`, enumerated over a small vocabulary."""
    V = model.cfg.vocab_size
    probs = {}
    for seq in itertools.product(range(V), repeat=n - 1):
        logits = model.logits(prompt + list(seq))[len(prompt) - 1 :]  # [n, V] rows predict t1..tn
        p = torch.softmax(logits.double() / temperature, dim=-1)
        head = math.prod(float(p[i, seq[i]]) for i in range(n - 1))
        for t in range(V):
            probs[seq + (t,)] = head * float(p[n - 1, t])
    return probs


def _chi2_p(counts: dict, probs: dict, total: int) -> tuple[float, float, int]:
    """Pearson chi-square over the cells with expected count >= 5 (the rest pooled into one)."""
    obs, exp, rest_o, rest_e = [], [], 0.0, 0.0
    for cell, p in probs.items():
        e = p * total
        if e >= 5:
            obs.append(counts.get(cell, 0))
            exp.append(e)
        else:
            rest_o += counts.get(cell, 0)
            rest_e += e
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    o, e = np.asarray(obs, dtype=float), np.asarray(exp, dtype=float)
    chi2 = float(((o - e) ** 2 / e).sum())
    df = len(o) - 1
    p = float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(chi2 / 2, dtype=torch.float64)
        )
    )
    return chi2, p, df


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_sampled_distribution_equals_ar_sampling(method, capsys):
    """Over 3000 seeds, the first three sampled tokens of the batched engine (64 streams at a time)
    follow the exact AR sampling distribution at T = 0.9 (DDTree: a random DFlash drafter, budget 3,
    so the first step's accept walk decides t2 and usually t3)."""
    m = _model(vocab=8)
    prompt = [1, 5, 2]
    temp, N = 0.9, 3000
    probs = _exact_joint(m, prompt, temp)
    drafter = _drafter("dflash", m, block=4) if method == "ddtree" else None
    eng = BatchEngine(m, max_streams=64, method=method, drafter=drafter, budget=3 if drafter else None,
                      keep_results=True)
    rids = [eng.add_request(prompt, 3, SamplingParams(temperature=temp, seed=s)) for s in range(N)]
    while eng.has_work():
        eng.step()
    counts: dict = {}
    for rid in rids:
        key = tuple(eng.result(rid).tokens)
        counts[key] = counts.get(key, 0) + 1
    chi2, p, df = _chi2_p(counts, probs, N)
    # the test's power: T = 1.2 is told apart
    _, p_wrong_t, _ = _chi2_p(counts, _exact_joint(m, prompt, 1.2), N)
    with capsys.disabled():
        print(f"\n[{method}] chi-square {chi2:.1f} on {df} dof, p = {p:.3f} (against T = 1.2: p = "
              f"{p_wrong_t:.1e})")
    assert p > 1e-3, f"{method}: chi-square {chi2:.1f} on {df} dof, p = {p:.2e}"
    assert p_wrong_t < 1e-3


def test_same_seed_same_tokens_whatever_else_runs():
    m = _model()
    prompt = _prompts(1, seed=9, vocab=m.cfg.vocab_size, hi=25)[0]
    others = _prompts(5, seed=10, vocab=m.cfg.vocab_size, hi=60)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=1234)

    def run(with_others: bool, overlap: bool = False):
        eng = BatchEngine(m, max_streams=6, method="ddtree", drafter=_drafter("dflash", m), budget=6,
                          keep_results=True, overlap=overlap)
        if with_others:
            for i, o in enumerate(others[:3]):
                eng.add_request(o, 9, SamplingParams(temperature=0.5, seed=i))
        rid = eng.add_request(prompt, 10, params)
        if with_others:
            for o in others[3:]:
                eng.add_request(o, 4)
        while eng.has_work():
            eng.step()
        return eng.result(rid).tokens

    alone = run(False)
    assert alone == run(True) == run(True, overlap=True)
    assert len(alone) == 10


# ----------------------------------------------------------------------------- INT4 experts
def _int4_config(hidden: int = 64, inter: int = 32) -> ModelConfig:
    """tiny-a widened so the INT4 groups (32) fit: hidden and expert intermediate multiples of 32 (of 64
    on CUDA)."""
    cfg = ModelConfig.from_json(DATA / "configs" / "tiny-a.json")
    return dataclasses.replace(cfg, hidden_size=hidden, moe_intermediate_size=inter,
                               intermediate_size=2 * hidden)


def test_int4_experts_match_the_numpy_quantizer_and_reference():
    """The routed experts after quantize_int4 equal the sum over each token's experts computed from
    kdlib.cuda.moe's numpy quantizer and dequantizer (h rounded to bf16 as the kernel does)."""
    from kdlib.cuda import moe as kmoe

    m = Model.random(_int4_config(), seed=3)
    layer = next(la.mlp for la in m.model.layers if hasattr(la.mlp, "experts"))
    x = torch.randn(7, m.cfg.hidden_size, generator=torch.Generator().manual_seed(0))  # [T, H]
    w13, w2 = (a.detach().numpy().astype(np.float64) for a in layer.stacked())
    I = w13.shape[1] // 2
    deq = [kmoe.dequantize_w4(*kmoe.quantize_w4(a)).astype(np.float64) for a in (w13[:, :I], w13[:, I:], w2)]
    with torch.no_grad():
        wts, idx = layer.gate(x)
        shared = layer.shared_experts(x)
        layer.quantize_int4()
        got = (layer(x) - shared).numpy()
    assert len(layer.experts) == 0 and layer.path(7) == "int4"
    xs = x.numpy().astype(np.float64)
    ref = np.zeros_like(xs)
    for t_ in range(x.shape[0]):
        for e, wt in zip(idx[t_].tolist(), wts[t_].tolist(), strict=True):
            g, u = deq[0][e] @ xs[t_], deq[1][e] @ xs[t_]
            h = kmoe.round_bf16(g / (1 + np.exp(-g)) * u).astype(np.float64)
            ref[t_] += wt * (deq[2][e] @ h)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4
    with pytest.raises(ValueError, match="INT4 already"):
        layer.quantize_int4()


def test_int4_engine_ddtree_equals_ar():
    m = Model.random(_int4_config(), seed=4).quantize_experts_int4()
    prompts = _prompts(3, seed=8, vocab=m.cfg.vocab_size, hi=50)
    res = generate_batch(m, prompts, 10, method="ddtree", drafter=_drafter("dflash", m), budget=8)
    for r, p in zip(res, prompts, strict=True):
        _equals_ar(m, p, r.tokens, 10)


# ----------------------------------------------------------------------------- CUDA
def _cuda_model(dtype=torch.float32):
    m = _model(device="cuda")
    return m if dtype == torch.float32 else Model.random(m.cfg, seed=0, device="cuda", dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("streams,budget", [(1, 16), (3, 3), (16, 16)])
def test_gpu_graphs_equal_eager_and_ar(streams, budget):
    torch.backends.cuda.matmul.allow_tf32 = False
    m = _cuda_model()
    prompts = _prompts(streams, seed=streams, vocab=m.cfg.vocab_size)
    d = _drafter("dflash", m)
    outs = {}
    for graphs in (False, True):
        outs[graphs] = [
            r.tokens
            for r in generate_batch(m, prompts, 12, method="ddtree", drafter=d, budget=budget, graphs=graphs)
        ]
    outs["overlap"] = [r.tokens for r in generate_batch(m, prompts, 12, method="ddtree", drafter=d,
                                                        budget=budget, graphs=True, overlap=True)]
    assert outs[True] == outs[False] == outs["overlap"]
    for p, tokens in zip(prompts, outs[True], strict=True):
        _equals_ar(m, p, tokens, 12, (streams, budget))
    sampled = [
        generate_batch(
            m, prompts, 8, method="ddtree", drafter=d, budget=budget, temperature=0.8, seed=5, graphs=g
        )
        for g in (False, True)
    ]
    assert [r.tokens for r in sampled[0]] == [r.tokens for r in sampled[1]]


@pytest.mark.gpu
def test_gpu_int4_engine_runs_moe_w4a16_in_graphs():
    """bf16 model with INT4 experts on CUDA: the MoE layer through moe_w4a16 equals the dequantized torch
    path on the same weights (bf16 tolerance), and the batched engine runs it eagerly and in graphs."""
    from kdlib.engine.int4 import device_routing, routed_dequantized

    cfg = _int4_config(256, 128)
    m = Model.random(cfg, seed=5, device="cuda", dtype=torch.bfloat16).quantize_experts_int4()
    layer = next(la.mlp for la in m.model.layers if hasattr(la.mlp, "experts"))
    for rows in (1, 5, 40):  # the decode kernels' regime (<= 8 slots an expert) and version 1's
        x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            w, idx = layer.gate(x)
            got = layer._routed_int4(x, w, idx).float()
        rt = device_routing(idx, w, 0, layer.int4["n_experts"])
        ref = routed_dequantized(x, layer.int4["q"], rt).float()
        assert float((got - ref).norm() / ref.norm()) < 2e-2, rows
    prompts = _prompts(3, seed=9, vocab=m.cfg.vocab_size, hi=40)
    d = _drafter("dflash", m).to(dtype=torch.bfloat16)
    for graphs in (False, True):
        res = generate_batch(m, prompts, 8, method="ddtree", drafter=d, budget=8, graphs=graphs)
        assert all(len(r.tokens) == 8 and 0 <= min(r.tokens) and max(r.tokens) < m.cfg.vocab_size
                   for r in res)


@pytest.mark.gpu
def test_gpu_grouped_moe_matches_dense_in_bf16():
    m = _cuda_model(torch.bfloat16)
    moe = next(layer.mlp for layer in m.model.layers if hasattr(layer.mlp, "experts"))
    x = torch.randn(4096, m.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    assert moe.path(4096, True, x.device, x.dtype) == "grouped"
    w, idx = moe.gate(x)
    grouped = moe._routed_vectorised(x, w, idx, "grouped").float()
    dense = moe._routed_vectorised(x, w, idx, "dense").float()
    rel = float(((grouped - dense).norm() / dense.norm()).detach())
    assert rel < 2e-2, rel


def test_an_idle_lane_beside_small_trees_stays_finite():
    """top_k 1 gives trees smaller than the budget; their padding rows saw no key in an idle lane (below C,
    no prefix): NaN there, in the null slot, and at T > 0 every later step failed on NaN probabilities."""
    m = _model()
    d = _drafter("dflash", m)
    eng = BatchEngine(m, max_streams=2, method="ddtree", drafter=d, budget=16, top_k=1, keep_results=True)
    short = eng.add_request([3, 1, 4, 1, 5], 2, SamplingParams(temperature=0.7, seed=1))  # then lane 0 idles
    long = eng.add_request([2, 7, 1, 8], 20, SamplingParams(temperature=0.7, seed=2))
    while eng.has_work():
        eng.step()
    assert len(eng.result(short).tokens) == 2 and len(eng.result(long).tokens) == 20
    assert torch.isfinite(eng.pool.kv).all()
    greedy = BatchEngine(m, max_streams=2, method="ddtree", drafter=d, budget=16, top_k=1, keep_results=True)
    rids = [greedy.add_request(p, n) for p, n in (([3, 1, 4, 1, 5], 2), ([2, 7, 1, 8], 20))]
    while greedy.has_work():
        greedy.step()
    for r, (p, n) in zip(rids, (([3, 1, 4, 1, 5], 2), ([2, 7, 1, 8], 20)), strict=True):
        _equals_ar(m, p, greedy.result(r).tokens, n)
    assert torch.isfinite(greedy.pool.kv).all()


def test_isolate_failures_fails_one_prefill_alone(monkeypatch):
    """A prefill that raises (out of memory on a long prompt, say): with isolate_failures that request
    finishes alone with finish_reason "error", its lane and slots go back, the others equal AR; by default
    the exception propagates, the request ended first the same way, so that a caller that steps on gets
    the others' tokens, the first from the step after the one that raised."""
    m = _model()
    real = m.forward_plain

    def forward_plain(prompt, capture=()):
        if prompt[0] == 13:  # the poisoned request
            raise RuntimeError("out of memory (simulated)")
        return real(prompt, capture)

    monkeypatch.setattr(m, "forward_plain", forward_plain)
    good, bad = [2, 7, 1, 8], [13, 5, 5]
    eng = BatchEngine(m, max_streams=2, method="ddtree", drafter=_drafter("oracle", m), budget=8,
                      keep_results=True, isolate_failures=True)
    ok, broken = eng.add_request(good, 12), eng.add_request(bad, 12)
    outs = []
    while eng.has_work():
        outs += eng.step()
    failed = [o for o in outs if o.request_id == broken]
    assert [(o.finished, o.finish_reason, o.new_tokens) for o in failed] == [(True, "error", [])]
    assert failed[0].error == eng.result(broken).error == "RuntimeError: out of memory (simulated)"
    _equals_ar(m, good, eng.result(ok).tokens, 12)
    assert eng.pool_free_slots == eng.pool.num_slots
    plain = BatchEngine(m, max_streams=2, keep_results=True)
    first, broken = plain.add_request(good, 6), plain.add_request(bad, 4)
    with pytest.raises(RuntimeError, match="simulated"):
        plain.step()
    assert (plain.num_running, plain.num_waiting) == (1, 0)
    assert plain.result(broken).error == "RuntimeError: out of memory (simulated)"
    outs = []
    while plain.has_work():
        outs += plain.step()
    _equals_ar(m, good, [t for o in outs if o.request_id == first for t in o.new_tokens], 6)
    assert {o.request_id for o in outs} == {first} and plain.pool_free_slots == plain.pool.num_slots
    # under overlap (a step's decode outputs are collected before admission), and over two failing steps
    # in a row, every token reaches the stream once
    for overlap, failures in ((True, 1), (False, 2)):
        eng = BatchEngine(m, max_streams=3, keep_results=True, overlap=overlap)
        first = eng.add_request(good, 8)
        outs = eng.step() + eng.step()
        for _ in range(failures):
            eng.add_request(bad, 4)
            with pytest.raises(RuntimeError, match="simulated"):
                eng.step()
        while eng.has_work():
            outs += eng.step()
        _equals_ar(m, good, [t for o in outs if o.request_id == first for t in o.new_tokens], 8, overlap)
    # the only output held, a request's that finished in the raising step's prefill: has_work says so
    eng = BatchEngine(m, max_streams=2, keep_results=True)
    one = eng.add_request(good, 1)
    eng.add_request(bad, 4)
    with pytest.raises(RuntimeError, match="simulated"):
        eng.step()
    assert eng.has_work()
    outs = []
    while eng.has_work():
        outs += eng.step()
    assert [(o.request_id, o.new_tokens, o.finish_reason) for o in outs] == [(one, _ar(m, good, 1), "length")]


def test_an_overlapped_device_step_that_raises_loses_no_token(monkeypatch):
    """The step's host buffer was flipped before its device step ran: after one that raised, the next step
    wrote into the buffer of the step still in flight (a token lost, the next one twice)."""
    m = _model()
    eng = BatchEngine(m, max_streams=1, keep_results=True, overlap=True)
    real, calls = eng._device_step, []

    def device_step(*key):
        calls.append(key)
        if len(calls) == 6:
            raise RuntimeError("out of memory (simulated)")
        return real(*key)

    monkeypatch.setattr(eng, "_device_step", device_step)
    rid = eng.add_request([3, 1, 4, 1, 5], 8)
    outs, raised = [], 0
    while eng.has_work():
        try:
            outs += eng.step()
        except RuntimeError:
            raised += 1
    assert raised == 1 and [t for o in outs for t in o.new_tokens] == eng.result(rid).tokens
    _equals_ar(m, [3, 1, 4, 1, 5], eng.result(rid).tokens, 8)
    assert eng.step_ms.maxlen == STEP_HISTORY  # a server's steps: their host times grew without end
