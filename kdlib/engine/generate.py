"""Generation: autoregressive and DDTree speculative decoding over one request.

    res = generate(model, prompt_ids, 64)                                             # AR greedy
    res = generate(model, prompt_ids, 64, method="ddtree", drafter=d, budget=32)      # DDTree
    res.tokens, res.tokens_per_forward, res.accepted, res.phase_totals_ms()

One DDTree round (survey §1), with the bonus token b committed to the output but not yet cached
and s tokens in the cache:

  draft    the drafter's logits for depths 1..L after b -> log-softmax over the full vocabulary in
           fp32 -> top-K per depth (K = top_k, default min(budget, V) as the paper code;
           `model.draft_topk`);
  build    `ops.build_tree_batch` (best-first heap; numpy on CPU, the CUDA builder on GPU);
  verify   one target forward of [b, tree tokens] at positions s + depth, each row attending to
           the whole prefix and to its tree ancestors-or-self (absorbed MLA over the latent cache),
           and the target's argmax per node (`model.greedy`; at T > 0 its logits, `model.head`);
  accept   greedy walk over those argmaxes (`ops.accept_greedy_batch`), or at temperature T > 0
           sample-and-walk (`ops.accept_sample_batch`) with one explicit uniform per node from a
           seeded numpy generator; the drafter is never tempered (survey §4.2);
  compact  keep the accepted rows as positions s .. s+tau-1 (`LatentCache.commit_path`), feed the
           accepted nodes' target hidden states to the drafter, b = the new bonus.

An AR step is a verify of one row (forward, LM head, argmax) and, at T > 0, an accept (the draw).
At T = 0 the output equals AR greedy up to near-ties within float rounding (the two compute each
row with differently shaped products: the MoE's dense path in a many-row verify, its gather path in
a one-row AR step, ~1e-6 apart); at T > 0 it has AR sampling's distribution (both tested). Phase
times are wall times with a device synchronisation at each boundary (`torch.cuda.synchronize` on
CUDA), so they add up to the step time.

The same loop runs one rank of tensor parallelism: `kdlib.tp.TPModel` overrides the model's
hooks (`greedy` and `draft_topk` vocab-parallel, `head` gathered, `begin_decode` resets its
collective counters, `assert_replicated` compares ranks), and every rank gets the same result.
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kdlib import ops
from kdlib.engine.cache import LatentCache
from kdlib.engine.drafter import DFlashDrafter, Drafter
from kdlib.engine.model import check_int

PHASES = ("draft", "build", "verify", "accept", "compaction")
METHODS = ("ar", "ddtree")
# The GPU tree builder's limits (kdlib/cuda/tree.py): budget <= 256, tree depth min(L, budget) <= 16.
# The engine enforces them on every device so that a run means the same thing on CPU and GPU.
MAX_BUDGET = 256
MAX_DEPTH = 16
MIN_TEMPERATURE = 1e-5  # a smaller T > 0 overflows logits / T in float32 (vLLM samples greedily below it)
MAX_TEMPERATURE = float(np.finfo(np.float32).max)  # the batched engine holds T per lane in float32


def check_temperature(t) -> None:
    """ValueError unless t is 0 (greedy) or a number in [MIN_TEMPERATURE, MAX_TEMPERATURE]."""
    if isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 <= t <= MAX_TEMPERATURE:
        raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:.4g}] (float32's range), "
                         f"got {t!r}")
    if 0 < t < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g} (logits / T overflows "
                         f"below), got {t!r}")
# With Model.attention == "ops" the verify runs through the tree-verify kernels: at most 65 rows
# (kdlib/cuda/attention.py MAX_Q), i.e. budget <= 64, and the 576-wide MLA latent on CUDA.
MAX_OPS_BUDGET = 64


@dataclass
class GenerateResult:
    """Tokens and per-step statistics of one `generate` call.

    tokens           generated ids (prompt excluded), exactly max_new_tokens of them
    target_forwards  target model forwards, the prefill included
    accepted         tau per decode step (root + accepted drafts; 1 for every AR step)
    tree_sizes       verified rows per step (n + 1; 1 for AR)
    phase_ms         phase -> per-step wall ms (PHASES; AR fills verify and accept)
    """

    tokens: list[int]
    method: str
    prompt_len: int
    budget: int | None
    top_k: int | None
    temperature: float
    target_forwards: int
    accepted: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    phase_ms: dict = field(default_factory=lambda: {p: [] for p in PHASES})
    prefill_ms: float = 0.0
    drafter_setup_ms: float = 0.0
    total_ms: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def tokens_per_forward(self) -> float:
        """Generated tokens per target forward (the prefill counts as one; AR = 1.0)."""
        return len(self.tokens) / self.target_forwards

    @property
    def mean_accepted(self) -> float:
        return float(np.mean(self.accepted)) if self.accepted else 0.0

    def phase_totals_ms(self) -> dict:
        return {p: float(np.sum(v)) for p, v in self.phase_ms.items()}

    def step_ms(self) -> np.ndarray:
        """[steps] wall ms per decode step (the sum of its phases)."""
        return np.sum([np.asarray(self.phase_ms[p]) for p in PHASES], axis=0)


def check_tree(cfg, drafter, budget, top_k, min_budget: int = 0, budget_note: str = ""):
    """The tree's shape for a drafter over a target of config `cfg`, checked as the GPU tree kernels need
    it: returns (horizon L = block_size - 1, budget (default L), K). budget_note ends the budget's error."""
    if drafter.vocab_size != cfg.vocab_size:
        raise ValueError(f"drafter vocabulary {drafter.vocab_size} != target vocabulary {cfg.vocab_size}")
    horizon = drafter.block_size - 1
    if budget is None:
        budget = horizon
    elif isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < min_budget:
        raise ValueError(f"budget must be an int >= {min_budget}, got {budget!r}{budget_note}")
    budget = int(budget)
    if budget > MAX_BUDGET:
        raise ValueError(f"budget {budget} exceeds the tree kernels' limit {MAX_BUDGET}")
    if min(horizon, budget) > MAX_DEPTH:
        raise ValueError(f"tree depth min(L={horizon}, budget={budget}) exceeds the tree kernels' limit "
                         f"{MAX_DEPTH}")
    if top_k is not None:
        check_int("top_k", top_k, 1)
    # K never exceeds the budget (survey §2.1); a root-only tree still reads one column
    cap = max(budget, 1)
    return horizon, budget, min(top_k if top_k is not None else cap, cap, cfg.vocab_size)


def validate(model, prompt_ids, max_new_tokens, method, drafter, budget, top_k, temperature, max_context):
    """All input checks, before any compute. Returns (prompt tensor, budget, K)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    prompt = model.check_tokens(prompt_ids)
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
    limit = (
        model.cfg.max_position_embeddings
        if max_context is None
        else check_int("max_context", max_context, 1)
    )
    if limit > model.cfg.max_position_embeddings:
        raise ValueError(f"max_context {limit} exceeds the model's max_position_embeddings "
                         f"{model.cfg.max_position_embeddings}")
    if prompt.shape[0] > limit:
        raise ValueError(f"prompt of {prompt.shape[0]} tokens is longer than the context limit {limit}")
    if prompt.shape[0] + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({prompt.shape[0]}) + max_new_tokens ({max_new_tokens}) exceeds the context limit "
            f"{limit}"
        )
    check_temperature(temperature)
    k = None
    if method == "ddtree":
        if drafter is None:
            raise ValueError("method 'ddtree' needs a drafter")
        if not isinstance(drafter, Drafter):
            raise ValueError(f"drafter {type(drafter).__name__} lacks the Drafter interface "
                             "(block_size, vocab_size, target_layer_ids, begin, draft, commit)")
        n_layers = model.cfg.num_hidden_layers
        bad = [i for i in drafter.target_layer_ids if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"drafter target_layer_ids {bad} are not decoder layers of the target "
                             f"(0..{n_layers - 1})")
        if isinstance(drafter, DFlashDrafter):  # hidden size too: what the batched engine checks
            drafter.c.validate(model.cfg)
        _, budget, k = check_tree(model.cfg, drafter, budget, top_k)
        if getattr(model, "attention", "torch") == "ops" and budget > MAX_OPS_BUDGET:
            raise ValueError(f"budget {budget} exceeds the tree-verify kernels' limit {MAX_OPS_BUDGET} "
                             "(attention 'ops')")
    elif drafter is not None or budget is not None or top_k is not None:
        raise ValueError("drafter, budget and top_k apply to method 'ddtree' only")
    return prompt, budget, k


def generate(
    model,
    prompt_ids,
    max_new_tokens: int,
    method: str = "ar",
    drafter=None,
    budget: int | None = None,
    top_k: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    cache_mode: str = "compact",
    max_context: int | None = None,
    debug: bool = False,
) -> GenerateResult:
    """Generate max_new_tokens after prompt_ids with the target `model` (see module docstring).

    method "ar" | "ddtree"; drafter: a Drafter (kdlib.engine.drafter) for "ddtree"; budget: tree
    nodes (non-root, default L = block_size - 1); top_k: per-depth candidates K (default
    min(budget, V)); temperature 0 = greedy; seed: the numpy generator of the sampling uniforms;
    cache_mode "compact" | "remap" (LatentCache); max_context: the context limit (default the
    model's max_position_embeddings); debug: `model.assert_replicated` on every step's draft top-K,
    tree and accepted path (a no-op on one process). Bad input raises ValueError before any compute.

    The loop is the same for one process and for a `kdlib.tp.TPModel` rank (every rank calls it with
    the same arguments and gets the same result); what differs lives in the model's hooks:
    `greedy(h)` (target argmax), `head(h)` (dense logits, for sampling), `draft_topk(logits, k)`,
    `begin_decode()` and `assert_replicated(**tensors)`.
    """
    prompt, budget, k = validate(
        model, prompt_ids, max_new_tokens, method, drafter, budget, top_k, temperature, max_context
    )
    seed = check_int("seed", seed, 0)
    cfg, dev = model.cfg, model.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rng = np.random.Generator(np.random.PCG64(seed))
    rows = budget + 1 if method == "ddtree" else 1
    cache = LatentCache(
        cfg, prompt.shape[0] + max_new_tokens + rows + 1, mode=cache_mode, device=dev, dtype=model.dtype
    )
    res = GenerateResult(tokens=[], method=method, prompt_len=int(prompt.shape[0]), budget=budget, top_k=k,
                         temperature=float(temperature), target_forwards=0)

    def score(h):  # h [N, H] -> T = 0: [N] int64 target tokens; T > 0: [N, V] dense logits
        return model.greedy(h) if temperature == 0 else model.head(h)

    def pick(scores):  # score(h) -> [N] int64 tokens: the argmax, or one draw per row at temperature T
        if temperature == 0:
            return scores
        probs = torch.softmax(scores.float() / temperature, dim=-1)
        u = torch.from_numpy(rng.random(scores.shape[0])).to(dev)
        return ops.sample_tokens(probs, u)

    sync()
    t_start = time.perf_counter()
    capture = tuple(drafter.target_layer_ids) if method == "ddtree" else ()
    h, feats = model.prefill(cache, prompt, capture)
    out = [int(pick(score(h[-1:]))[0])]
    res.target_forwards = 1
    sync()
    t1 = time.perf_counter()
    res.prefill_ms = (t1 - t_start) * 1e3
    if method == "ddtree":
        drafter.begin(model, prompt, feats, max_new_tokens)
        sync()
        res.drafter_setup_ms = (time.perf_counter() - t1) * 1e3
    model.begin_decode()
    while len(out) < max_new_tokens:
        if method == "ar":
            out.append(_ar_step(model, cache, out[-1], score, pick, res, sync))
        else:
            out.extend(
                _ddtree_step(
                    model,
                    cache,
                    drafter,
                    out[-1],
                    budget,
                    k,
                    temperature,
                    rng,
                    score,
                    res,
                    sync,
                    capture,
                    debug,
                )
            )
        res.target_forwards += 1
    sync()
    res.total_ms = (time.perf_counter() - t_start) * 1e3
    res.tokens = out[:max_new_tokens]
    return res


def _ar_step(model, cache, token, score, pick, res, sync) -> int:
    t0 = time.perf_counter()
    h, _ = model.forward_cached(cache, torch.tensor([token]), [cache.length])
    scores = score(h)
    cache.commit()
    sync()
    t1 = time.perf_counter()
    nxt = int(pick(scores)[0])
    sync()
    t2 = time.perf_counter()
    record_step(res, [t0, t0, t0, t1, t2, t2], 1, 1)  # no draft, build or compaction
    return nxt


def _ddtree_step(model, cache, drafter, bonus, budget, k, temperature, rng, score, res, sync, capture,
                 debug) -> list[int]:
    dev, V = model.device, model.cfg.vocab_size
    s = cache.length
    t = [time.perf_counter()]
    # draft: the drafter's logits per depth -> top-K of the full-vocabulary fp32 log-probs
    ids, lps = model.draft_topk(check_draft(model, drafter, drafter.draft(bonus, s)), k)  # [L, K] each
    sync()
    t.append(time.perf_counter())
    # build (on every TP rank, from identical inputs)
    trees = ops.build_tree_batch(ids[None].contiguous(), lps[None].contiguous(), budget, vocab_size=V)
    m = int(trees.sizes[0])  # n + 1 verified rows
    if debug:
        model.assert_replicated(top_ids=ids, top_logp=lps, node_token_ids=trees.node_token_ids,
                                visibility=trees.visibility, positions=trees.positions)
    sync()
    t.append(time.perf_counter())
    # verify: the target's argmax per node (T = 0) or its dense logits (T > 0)
    tokens = torch.cat([torch.tensor([bonus], device=dev), trees.node_token_ids[0, : m - 1]])  # [n+1]
    h, feats = model.forward_cached(
        cache, tokens, s + trees.positions[0, :m], trees.visibility[0, :m, :m], capture
    )
    scores = score(h)  # [n+1] or [n+1, V]
    sync()
    t.append(time.perf_counter())
    # accept
    horizon = drafter.block_size - 1
    if temperature == 0:
        target = torch.zeros(1, budget + 1, dtype=torch.int64, device=dev)  # [1, budget+1]; pad never read
        target[0, :m] = scores
        paths, lengths, new_bonus = ops.accept_greedy_batch(trees, target, max_depth=horizon)
    else:
        probs = torch.zeros(1, budget + 1, V, dtype=torch.float32, device=dev)  # [1, budget+1, V]
        probs[0, :m] = torch.softmax(scores / temperature, dim=-1)
        probs[0, m:] = 1.0  # padding rows are never read; keep them valid probabilities
        u = torch.from_numpy(rng.random((1, budget + 1))).to(dev)  # [1, budget+1] one uniform per node
        paths, lengths, new_bonus = ops.accept_sample_batch(trees, probs, u, max_depth=horizon)
    if debug:
        model.assert_replicated(paths=paths, lengths=lengths, bonus=new_bonus)
    sync()
    t.append(time.perf_counter())
    tau, emitted = commit_accepted(cache, drafter, tokens, feats, paths, lengths, new_bonus)
    sync()
    t.append(time.perf_counter())
    record_step(res, t, tau, m)
    return emitted


def check_draft(model, drafter, logits) -> torch.Tensor:
    """logits, after a ValueError naming the drafter's class unless floating [block_size - 1, V]: V the
    vocabulary, or on a `kdlib.tp` rank its shard (a drafter that reads the rank's LM head)."""
    v0, v1 = getattr(model, "vocab_range", (0, model.cfg.vocab_size))
    widths = sorted({model.cfg.vocab_size, v1 - v0})
    name, L = type(drafter).__name__, drafter.block_size - 1
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError(f"{name}.draft must return a floating tensor, got "
                         f"{getattr(logits, 'dtype', type(logits).__name__)}")
    if logits.dim() != 2 or logits.shape[0] != L or logits.shape[1] not in widths:
        raise ValueError(f"{name}.draft must return logits [block_size - 1 = {L}, vocab_size "
                         f"{' or '.join(map(str, widths))}], got {list(logits.shape)}")
    return logits


def commit_accepted(cache, drafter, tokens, feats, paths, lengths, new_bonus) -> tuple[int, list[int]]:
    """Compaction + drafter context update after the accept walk of one request.

    tokens [n+1] and feats [n+1, F] | None are the verified tree's; paths/lengths/new_bonus come from
    the accept kernel. Returns (tau = root + accepted nodes, the tokens emitted this step incl. the bonus).
    """
    tau = cache.commit_path(paths, lengths)
    path = paths[0, :tau]
    accepted_tokens = tokens[path]
    drafter.commit(accepted_tokens, feats[path] if feats is not None else None)
    return tau, accepted_tokens[1:].tolist() + [int(new_bonus[0])]


def record_step(res, t: list[float], tau: int, tree_size: int) -> None:
    """Per-phase times (t: perf_counter stamps at the phase boundaries, in PHASES order), tau and
    tree size."""
    for p, a, b in zip(PHASES, t[:-1], t[1:], strict=True):
        res.phase_ms[p].append((b - a) * 1e3)
    res.accepted.append(tau)
    res.tree_sizes.append(tree_size)
