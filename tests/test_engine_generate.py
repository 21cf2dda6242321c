"""kdlib.engine.generate: the DDTree == AR greedy invariant up to near-ties (CPU and CUDA), the T > 0
distribution, bad input."""

import dataclasses
import math
from functools import cache

import numpy as np
import pytest
import torch

import kdlib.engine.drafter as drafter_mod
from kdlib import DATA
from kdlib.engine.cache import LatentCache
from kdlib.engine.config import ModelConfig
from kdlib.engine.drafter import DFlashConfig, DFlashDrafter, NoisyOracleDrafter
from kdlib.engine.generate import generate
from kdlib.engine.model import Model

N_CASES = 52
NEAR_TIE = 1e-5  # AR logit gap below which DDTree may pick another token (rounding is ~1e-6)


@torch.no_grad()
def ar_logits(model, prompt, tokens) -> torch.Tensor:
    """[V] float64: the target's logits after prompt + tokens as AR computes them (prefill, then one-row
    decode steps)."""
    cache = LatentCache(model.cfg, len(prompt) + len(tokens) + 1, device=model.device, dtype=model.dtype)
    h, _ = model.prefill(cache, model.check_tokens(prompt))
    for t in tokens:
        h, _ = model.forward_cached(cache, torch.tensor([t]), [cache.length])
        cache.commit()
    return model.head(h[-1:])[0].double().cpu()


def assert_equals_ar_up_to_near_tie(model, prompt, ar_tokens, dd_tokens, what=""):
    """DDTree's tokens == AR greedy's up to their first mismatch, allowed only where DDTree's token is
    within NEAR_TIE of AR's top logit (a verify of many rows and an AR step of one round differently)."""
    assert len(dd_tokens) == len(ar_tokens), what
    i = next((j for j, (a, d) in enumerate(zip(ar_tokens, dd_tokens, strict=True)) if a != d), None)
    if i is None:
        return
    row = ar_logits(model, prompt, ar_tokens[:i])
    gap = float(row.max() - row[dd_tokens[i]])
    assert gap < NEAR_TIE, (f"DDTree != AR at token {i}: {dd_tokens[i]} vs {ar_tokens[i]}, AR logit gap "
                            f"{gap:.3g} >= {NEAR_TIE:g} {what}")


def _config(name: str) -> ModelConfig:
    base = ModelConfig.from_json(DATA / "configs" / f"{name.split('+')[0]}.json")
    if name.endswith("+noqlora"):  # tiny-a without q_lora and without YaRN
        return dataclasses.replace(base, q_lora_rank=None, rope=None)
    if name.endswith("+v8"):  # a vocabulary small enough to tabulate distributions
        return dataclasses.replace(base, vocab_size=8)
    if name.endswith("+mla576"):  # the kernels' latent width: kv_lora 512 + rope 64
        return dataclasses.replace(base, kv_lora_rank=512, qk_rope_head_dim=64)
    return base


CONFIGS = ("tiny-a", "tiny-b", "tiny-a+noqlora")


@cache
def _model(name: str, seed: int, device: str = "cpu", attention: str = "torch") -> Model:
    m = Model.random(_config(name), seed=seed, device=device)
    m.attention = attention
    return m


def _cases(n: int, seed: int):
    """Random (config, model seed, prompt, max_new, budget, top_k, block, p_wrong, cache mode, drafter seed,
    drafter kind, attention) tuples; every fifth case drafts with a random DFlash drafter, the others with
    the oracle; every third verifies through kdlib.ops.tree_verify_attention (numpy reference on CPU)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        name = CONFIGS[i % len(CONFIGS)]
        vocab = _config(name).vocab_size
        prompt = rng.integers(0, vocab, int(rng.integers(1, 20))).tolist()
        block = int(rng.integers(2, 9))
        budget = int(rng.choice([0, 1, 2, 3, 5, 8, 13, 24, 40]))
        top_k = [None, 1, 1, 2, 3, 5][int(rng.integers(0, 6))]  # K' = 1 is the chain
        out.append(
            (
                name,
                int(rng.integers(0, 2)),
                prompt,
                int(rng.integers(4, 21)),
                budget,
                top_k,
                block,
                float(rng.choice([0.0, 0.2, 0.5, 0.9, 1.0])),
                ["compact", "remap"][i % 2],
                int(rng.integers(0, 1000)),
                "dflash" if i % 5 == 4 else "oracle",
                "ops" if i % 3 == 2 else "torch",
            )
        )
    return out


def _check_case(case, device="cpu"):
    name, mseed, prompt, max_new, budget, top_k, block, p_wrong, mode, dseed, kind, attention = case
    if device == "cuda" and _config(name).latent_dim != 576:
        attention = "torch"  # the CUDA tree-verify kernels are built for the 576-wide latent only
    model = _model(name, mseed, device, attention)
    ar = generate(model, prompt, max_new)
    if kind == "dflash":  # a random DFlash drafter: poor drafts, real hidden-state plumbing
        cfg = DFlashConfig.for_target(model.cfg, num_layers=1, block_size=block)
        drafter = DFlashDrafter(cfg, seed=dseed).to(device)
    else:
        drafter = NoisyOracleDrafter(model.cfg.vocab_size, p_wrong, block_size=block, seed=dseed)
    dd = generate(
        model, prompt, max_new, method="ddtree", drafter=drafter, budget=budget, top_k=top_k, cache_mode=mode
    )
    assert_equals_ar_up_to_near_tie(model, prompt, ar.tokens, dd.tokens, f"for {case}")
    assert len(dd.tokens) == max_new and dd.target_forwards == 1 + dd.steps
    assert all(1 <= a <= min(block, budget + 1) for a in dd.accepted)
    return dd


def test_ddtree_equals_ar_greedy_cpu():
    """>= 50 random cases: every budget, top-k (chain included), prompt, config and cache mode tried."""
    cases = _cases(N_CASES, seed=0)
    results = [_check_case(c) for c in cases]
    # the corpus must exercise real trees: long accepts and rejections both occur
    assert max(max(r.accepted) for r in results) >= 4
    assert any(1 in r.accepted for r in results)
    assert any(c[5] == 1 for c in cases) and any(c[4] == 0 for c in cases)


@pytest.mark.gpu
def test_ddtree_equals_ar_greedy_cuda():
    """The same invariant on CUDA: tree build, accept and compaction run as CuPy kernels via kdlib.ops."""
    for case in _cases(N_CASES, seed=1):
        _check_case(case, device="cuda")


@pytest.mark.gpu
def test_ddtree_equals_ar_greedy_cuda_kernel_attention():
    """And with the verify attention itself in the CuPy tree-verify kernels (576-wide latent, FP32)."""
    for i, case in enumerate(_cases(24, seed=2)):
        prompt = [t % _config("tiny-a").vocab_size for t in case[2]]
        case = ("tiny-a+mla576", case[1], prompt, case[3], min(case[4], 64), *case[5:11], "ops")
        _check_case(case, device="cuda")
        assert _model("tiny-a+mla576", case[1], "cuda", "ops").attention == "ops", i


def test_cache_modes_agree_and_tree_beats_chain():
    """remap and compact give the same tokens and acceptance; on this seeded case (oracle p_wrong 0.4, budget
    16 over L = 5) the tree accepts at least as much as the chain (not a theorem: a tree may trade spine
    depth for siblings)."""
    model = _model("tiny-a", 0)
    prompt = [1, 2, 3, 4, 5]
    kw = dict(method="ddtree", budget=16)
    runs = {}
    for mode in ("compact", "remap"):
        for k in (1, None):
            d = NoisyOracleDrafter(model.cfg.vocab_size, 0.4, block_size=6, seed=7)
            runs[mode, k] = generate(model, prompt, 48, drafter=d, top_k=k, cache_mode=mode, **kw)
    assert runs["compact", None].tokens == runs["remap", None].tokens == runs["compact", 1].tokens
    assert runs["compact", None].accepted == runs["remap", None].accepted
    assert runs["compact", None].tokens_per_forward >= runs["compact", 1].tokens_per_forward


def test_oracle_acceptance_dial():
    """p_wrong = 0 accepts whole blocks; p_wrong = 1 with a chain accepts nothing."""
    model = _model("tiny-b", 0)
    d0 = NoisyOracleDrafter(model.cfg.vocab_size, 0.0, block_size=5, seed=0)
    r0 = generate(model, [3, 4], 30, method="ddtree", drafter=d0, budget=4)
    assert set(r0.accepted[:-1]) == {5}
    d1 = NoisyOracleDrafter(model.cfg.vocab_size, 1.0, block_size=5, seed=0)
    r1 = generate(model, [3, 4], 10, method="ddtree", drafter=d1, budget=4, top_k=1)
    assert set(r1.accepted) == {1} and r1.tokens_per_forward == 10 / 10


# ----------------------------------------------------------------------------- temperature > 0
class _MarginalDrafter:
    """Drafts depth d from the target's own next-token logits after context + bonus (depth 1 exact,
    deeper depths repeat it): cheap, and good enough that tree nodes are often accepted."""

    target_layer_ids = ()

    def __init__(self, model, block_size):
        self.model, self.block_size, self.vocab_size = model, block_size, model.cfg.vocab_size

    def begin(self, target, prompt_ids, features, max_new_tokens):
        self.ctx = list(torch.as_tensor(prompt_ids).tolist())

    def commit(self, token_ids, features):
        self.ctx += torch.as_tensor(token_ids).tolist()

    def draft(self, bonus, s):
        row = self.model.logits(self.ctx + [int(bonus)])[-1]
        return row[None].expand(self.block_size - 1, -1)


def _chi2_pvalue(observed: np.ndarray, expected_p: np.ndarray) -> float:
    """Pearson chi-square goodness of fit (cells with expectation < 5 pooled), Wilson-Hilferty p-value."""
    n = observed.sum()
    exp = expected_p * n
    order = np.argsort(exp)
    obs_s, exp_s = observed[order].astype(float), exp[order]
    pooled_o, pooled_e, acc_o, acc_e = [], [], 0.0, 0.0
    for o, e in zip(obs_s, exp_s, strict=True):
        acc_o, acc_e = acc_o + o, acc_e + e
        if acc_e >= 5:
            pooled_o.append(acc_o)
            pooled_e.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:
        pooled_o[-1] += acc_o
        pooled_e[-1] += acc_e
    o, e = np.array(pooled_o), np.array(pooled_e)
    stat, dof = float(((o - e) ** 2 / e).sum()), len(o) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _exact_two_token_joint(model, prompt, temperature):
    """[V, V] exact p(t1, t2 | prompt) of the tempered target."""
    V = model.cfg.vocab_size
    p1 = torch.softmax(model.logits(prompt)[-1] / temperature, -1).double().cpu()
    joint = torch.zeros(V, V, dtype=torch.float64)
    for t1 in range(V):
        joint[t1] = p1[t1] * torch.softmax(model.logits(prompt + [t1])[-1] / temperature, -1).double().cpu()
    return joint.numpy()


def _sampling_check(device: str, n: int):
    model = _model("tiny-a+v8", 2, device)
    prompt, temp = [1, 5, 2], 0.8
    joint = _exact_two_token_joint(model, prompt, temp).ravel()
    dd_counts, ar_counts, taus = np.zeros(64), np.zeros(64), []
    for seed in range(n):
        d = _MarginalDrafter(model, block_size=3)
        r = generate(
            model, prompt, 2, method="ddtree", drafter=d, budget=4, top_k=2, temperature=temp, seed=seed
        )
        dd_counts[r.tokens[0] * 8 + r.tokens[1]] += 1
        taus.extend(r.accepted)
        a = generate(model, prompt, 2, temperature=temp, seed=10_000 + seed)
        ar_counts[a.tokens[0] * 8 + a.tokens[1]] += 1
    assert np.mean(np.array(taus) > 1) > 0.2, "the test must exercise accepted tree nodes"
    p_dd, p_ar = _chi2_pvalue(dd_counts, joint), _chi2_pvalue(ar_counts, joint)
    assert p_dd > 1e-3, f"DDTree samples do not follow the target (p = {p_dd:.2e})"
    assert p_ar > 1e-3, f"AR samples do not follow the target (p = {p_ar:.2e})"
    # the test can fail: the same samples against the law at another temperature are rejected
    wrong = _exact_two_token_joint(model, prompt, 1.6).ravel()
    assert _chi2_pvalue(dd_counts, wrong) < 1e-3


@pytest.mark.slow
def test_sampling_distribution_equals_ar():
    """At T > 0, DDTree's first two tokens follow the target's exact joint law (and so does AR)."""
    _sampling_check("cpu", 1200)


@pytest.mark.gpu
def test_sampling_distribution_equals_ar_cuda():
    """The same law on CUDA, where sampling and sample-and-walk run as CuPy kernels."""
    _sampling_check("cuda", 1200)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt_ids=[]), "non-empty"),
        (dict(prompt_ids=[0, 96]), "vocabulary"),
        (dict(prompt_ids=[-3]), "vocabulary"),
        (dict(prompt_ids=list(range(10)) * 103), "longer than the context limit"),
        (dict(max_new_tokens=1022), "exceeds the context limit"),
        (dict(max_context=8, prompt_ids=list(range(9))), "longer than the context limit"),
        (dict(method="ddtree", budget=257), "budget 257 exceeds"),
        (dict(method="ddtree", budget=-1), "budget"),
        (dict(method="ddtree", budget=20, block=18), "tree depth"),
        (dict(method="ddtree", drafter=None), "needs a drafter"),
        (dict(method="beam"), "method"),
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=1e-40), "temperature must be 0 \\(greedy\\) or >= 1e-05"),
        (dict(budget=4), "apply to method 'ddtree' only"),
        (dict(method="ddtree", top_k=0), "top_k"),
        (dict(seed=-1), "seed must be"),
        (dict(seed=1.5), "seed must be"),
    ],
)
def test_bad_input_raises_before_compute(kwargs, match, monkeypatch):
    model = Model.random(_config("tiny-a"), seed=0)
    monkeypatch.setattr(model, "prefill", lambda *a, **k: pytest.fail("computed before validating"))
    args = dict(prompt_ids=[1, 2, 3], max_new_tokens=4, method="ar")
    block = kwargs.pop("block", 4)
    args.update(kwargs)
    if args["method"] == "ddtree" and "drafter" not in kwargs:
        args["drafter"] = NoisyOracleDrafter(model.cfg.vocab_size, 0.1, block_size=block)
    with pytest.raises(ValueError, match=match):
        generate(model, **args)


@pytest.mark.parametrize("prompt", ["hello", b"hi", None, [[1], [2, 3]], ["a"]])
def test_prompts_that_are_not_id_sequences_name_token_ids(prompt, monkeypatch):
    """Text and the like gave torch's errors naming no argument (TypeError new(): invalid data type 'str')."""
    model = Model.random(_config("tiny-a"), seed=0)
    monkeypatch.setattr(model, "prefill", lambda *a, **k: pytest.fail("computed before validating"))
    with pytest.raises(ValueError, match="token_ids must be a sequence of token ids, got"):
        generate(model, prompt, 4)


@pytest.mark.parametrize("change, match", [
    (dict(target_layer_ids=(7,)), r"target_layer_ids \[7\] are not decoder layers of the target \(0\.\.2\)"),
    (dict(hidden_size=48), "drafter hidden_size / vocab_size differ from the target's"),
])
def test_a_drafter_that_does_not_fit_the_target_raises_before_compute(change, match, monkeypatch):
    """Only the vocabulary was checked: a drafter tapping layer 7 of 3, or of another hidden size,
    failed after the prefill had run."""
    model = Model.random(_config("tiny-a"), seed=0)
    monkeypatch.setattr(model, "prefill", lambda *a, **k: pytest.fail("computed before validating"))
    drafter = DFlashDrafter(dataclasses.replace(DFlashConfig.for_target(model.cfg, block_size=4), **change))
    with pytest.raises(ValueError, match=match):
        generate(model, [1, 2, 3], 4, method="ddtree", drafter=drafter)


def test_unsigned_token_arrays_are_taken():
    """nanoGPT-style token files are uint16: torch has no min() for it (NotImplementedError)."""
    model = Model.random(_config("tiny-a"), seed=0)
    want = generate(model, [1, 2, 3], 4).tokens
    for dt in (np.uint16, np.uint32, np.uint64):
        assert generate(model, np.array([1, 2, 3], dtype=dt), 4).tokens == want
    with pytest.raises(ValueError, match="vocabulary"):
        generate(model, np.array([1, 2**63 + 5], dtype=np.uint64), 4)


def test_oracle_reference_equals_computed_script(monkeypatch):
    """A given greedy reference (skipping the oracle's own AR set-up) drafts exactly as the computed one."""
    model = _model("tiny-a", 1)
    prompt = [7, 8, 9, 10]
    ref = generate(model, prompt, 30 + 6).tokens
    computed = generate(model, prompt, 30, method="ddtree", budget=8,
                        drafter=NoisyOracleDrafter(model.cfg.vocab_size, 0.4, block_size=6, seed=3))
    monkeypatch.setattr(drafter_mod, "greedy_continuation", lambda *a, **k: pytest.fail("recomputed the "
                                                                                        "script"))
    given = generate(
        model,
        prompt,
        30,
        method="ddtree",
        budget=8,
        drafter=NoisyOracleDrafter(model.cfg.vocab_size, 0.4, block_size=6, seed=3, reference=ref),
    )
    assert computed.tokens == given.tokens and computed.accepted == given.accepted


# ----------------------------------------------------------------------------- the model's hooks
class _HookedModel(Model):
    """Model with its decode-loop hooks counted and recomputed in float64: the argmax is the same (the
    float32 logits convert exactly); the top-K may order near-ties otherwise, which DDTree == AR does
    not depend on."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.calls = {"greedy": 0, "draft_topk": 0, "begin_decode": 0, "assert_replicated": 0}

    def greedy(self, h):
        self.calls["greedy"] += 1
        return self.head(h).double().argmax(-1)

    def draft_topk(self, logits, k):
        self.calls["draft_topk"] += 1
        top = torch.log_softmax(logits.double(), dim=-1).topk(k, dim=-1)
        return top.indices, top.values.float()

    def begin_decode(self):
        self.calls["begin_decode"] += 1

    def assert_replicated(self, **tensors):
        assert {"top_ids", "paths", "bonus"} & set(tensors)
        self.calls["assert_replicated"] += 1


def test_loop_picks_and_drafts_through_the_model_hooks():
    """generate's only target pick (T = 0) and draft top-K are model.greedy / model.draft_topk (what
    kdlib.tp overrides): a subclass's hooks are called once per forward and per step, and give the same
    tokens as the base Model; debug asks the model for two agreement checks per step."""
    cfg = _config("tiny-a")
    base = _model("tiny-a", 0)
    hooked = _HookedModel(cfg)
    hooked.load_state_dict(base.state_dict())
    prompt = [4, 9, 2, 7]
    ar = generate(hooked, prompt, 12)
    assert ar.tokens == generate(base, prompt, 12).tokens
    assert hooked.calls == {"greedy": 12, "draft_topk": 0, "begin_decode": 1, "assert_replicated": 0}
    hooked.calls = dict.fromkeys(hooked.calls, 0)
    d = NoisyOracleDrafter(cfg.vocab_size, 0.3, block_size=5, seed=1)
    dd = generate(hooked, prompt, 12, method="ddtree", drafter=d, budget=6, debug=True)
    assert_equals_ar_up_to_near_tie(hooked, prompt, ar.tokens, dd.tokens)
    assert hooked.calls == {"greedy": 1 + dd.steps, "draft_topk": dd.steps, "begin_decode": 1,
                            "assert_replicated": 2 * dd.steps}


# ----------------------------------------------------------------------------- near-ties
def test_near_tie_check_takes_a_rounding_flip_and_refuses_a_wide_gap(monkeypatch):
    """A one-row AR step and a many-row verify compute a row ~1e-6 apart, so at a near-tie the argmax can
    differ: the LM head row of token j is set to a's plus 1e-5 x a direction that puts j 5e-6 below a
    in AR's second-step logits (ten times float32's rounding of a logit here, half NEAR_TIE) and, where
    the two paths' hidden states differ, above it in the verify's (a reviewer's construction flipped AR
    [28, 94, 35] to DDTree [28, 95, 95])."""
    cfg = _config("tiny-a")
    model = Model.random(cfg, seed=0)
    prompt, seen = [5, 6, 7, 8], []
    greedy = model.greedy
    monkeypatch.setattr(model, "greedy", lambda h: seen.append(h.clone()) or greedy(h))

    def ddtree():
        d = NoisyOracleDrafter(cfg.vocab_size, 0.0, block_size=5, seed=1)
        return generate(model, prompt, 3, method="ddtree", drafter=d, budget=4).tokens

    ar = generate(model, prompt, 3).tokens
    n_ar = len(seen)
    ddtree()
    h_ar, h_tree = seen[1][0], seen[n_ar + 1][0]  # the second token's row: AR's step, the first verify's root
    with torch.no_grad():
        g_ar, g_tree = (model.model.norm(h[None])[0].double() for h in (h_ar, h_tree))
        dg = g_tree - g_ar
        v = dg / (dg @ dg) if bool(dg.any()) else torch.zeros_like(dg)
        v = v - (g_ar @ v + 0.5) * g_ar / (g_ar @ g_ar)  # g_ar . v = -0.5, g_tree . v = +0.5
        a = ar[1]
        j = (a + 1) % cfg.vocab_size
        model.lm_head.weight[j] = (model.lm_head.weight[a].double() + 1e-5 * v).float()
    ar = generate(model, prompt, 3).tokens
    row = ar_logits(model, prompt, ar[:1])
    assert int(row.argmax()) == a == ar[1] and 0 < float(row[a] - row[j]) < NEAR_TIE
    assert_equals_ar_up_to_near_tie(model, prompt, ar, ddtree())  # flipped or not, it passes
    assert_equals_ar_up_to_near_tie(model, prompt, ar, [ar[0], j, j])  # the flip such a tie allows
    wide = int(row.argmin())
    with pytest.raises(AssertionError, match="DDTree != AR at token 1"):
        assert_equals_ar_up_to_near_tie(model, prompt, ar, [ar[0], wide, ar[2]])
    with pytest.raises(AssertionError, match="DDTree != AR at token 0"):
        assert_equals_ar_up_to_near_tie(model, prompt, ar, [(ar[0] + 1) % cfg.vocab_size, *ar[1:]])


# ----------------------------------------------------------------------------- the drafter's output
class _Reshaped:
    """A noisy oracle (block 9, L = 8) whose drafts pass through `change`, claiming `block_size`."""

    target_layer_ids = ()

    def __init__(self, vocab_size, change, block_size):
        self.inner = NoisyOracleDrafter(vocab_size, 0.0, block_size=9, seed=1)
        self.change, self.block_size, self.vocab_size = change, block_size, vocab_size

    def begin(self, *args):
        self.inner.begin(*args)

    def commit(self, *args):
        self.inner.commit(*args)

    def draft(self, bonus, s):
        return self.change(self.inner.draft(bonus, s))


@pytest.mark.parametrize("change, block_size, match", [
    (lambda x: x[:, :50], 9, r"logits \[block_size - 1 = 8, vocab_size 96\], got \[8, 50\]"),
    (lambda x: x[:2], 9, r"got \[2, 96\]"),
    (lambda x: x, 3, r"= 2, vocab_size 96\], got \[8, 96\]"),
    (lambda x: x[0], 9, r"got \[96\]"),
    (lambda x: x.long(), 9, "a floating tensor, got torch.int64"),
    (lambda x: x.tolist(), 9, "a floating tensor, got list"),
], ids=["50 columns", "2 rows", "8 rows of 2", "1-D", "int64", "list"])
def test_a_draft_of_the_wrong_shape_or_dtype_names_the_drafter(change, block_size, match):
    """50 columns of a 96-token vocabulary or 2 rows of 8 ran silently; 8 rows for block_size 3 failed in
    the accept walk, naming no drafter."""
    model = _model("tiny-a", 0)
    d = _Reshaped(model.cfg.vocab_size, change, block_size)
    with pytest.raises(ValueError, match="_Reshaped.draft must return .*" + match):
        generate(model, [5, 6, 7, 8], 8, method="ddtree", drafter=d, budget=8)


def test_a_float64_draft_is_taken():
    model = _model("tiny-a", 0)
    d = _Reshaped(model.cfg.vocab_size, lambda x: x.double(), 9)
    dd = generate(model, [5, 6, 7, 8], 8, method="ddtree", drafter=d, budget=8)
    assert_equals_ar_up_to_near_tie(model, [5, 6, 7, 8], generate(model, [5, 6, 7, 8], 8).tokens, dd.tokens)
