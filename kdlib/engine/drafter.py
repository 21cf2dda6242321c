"""Drafters for DDTree: one interface, a DFlash-style block drafter and a noisy oracle.

The interface (what `generate` calls, in this order):

    drafter.begin(target, prompt_ids [P], features [P, F] | None, max_new_tokens)
    logits = drafter.draft(bonus, s)          # [L, V] float32: depths 1..L after `bonus` at position s
    drafter.commit(token_ids [tau], features [tau, F] | None)   # root + accepted nodes, positions s..s+tau-1

with attributes `block_size` (B_blk; the draft horizon is L = B_blk - 1), `vocab_size`, and
`target_layer_ids` (the decoder layers whose outputs the drafter wants as features; empty = none).

* `DFlashDrafter` (survey §6): target features from chosen layers -> `fc` -> `hidden_norm` give the
  context; a few non-causal decoder layers run over the block [bonus, MASK x (B_blk - 1)] with the
  context as extra keys/values, then the final norm and the target's LM head. It reuses the
  target's embedding and LM head (frozen, not in its state dict). `block_forward` is the training
  forward over many anchors at once (SpecForge-style block attention).
* `NoisyOracleDrafter`: knows the target's greedy continuation and replaces each drafted position's
  top token by a wrong one with probability `p_wrong`, so the acceptance rate is a dial for studies.
"""

from __future__ import annotations

import numpy as np
import torch


# ----------------------------------------------------------------------------- noisy oracle
class NoisyOracleDrafter:
    """The target's greedy continuation, corrupted with probability `p_wrong` per drafted position.

    Logits per depth: N(0, 1) noise over the vocabulary, then the chosen top token is lifted
    `margin` above the noise maximum. The chosen token is the true greedy token with probability
    1 - p_wrong, else a uniformly drawn other token (the true one keeps its noise logit and may
    still land in the top-K as a sibling). At temperature 0 the per-depth top-1 acceptance is
    1 - p_wrong as long as the earlier depths were right.

    The oracle computes the continuation with the target itself (AR greedy, its own cache): once in
    `begin` for max_new_tokens + B_blk tokens after the prompt (`generate` times this as
    drafter_setup_ms, outside the steps), and L tokens afresh whenever the committed context has
    left that script, which happens at T > 0 only (counted in the draft phase: a study artefact,
    not a drafter cost).
    """

    target_layer_ids: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, p_wrong: float, block_size: int = 8, seed: int = 0, margin: float = 3.0):
        if not 0.0 <= p_wrong <= 1.0:
            raise ValueError(f"p_wrong must lie in [0, 1], got {p_wrong}")
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2 (horizon L = block_size - 1), got {block_size}")
        if vocab_size < 2:
            raise ValueError("the oracle needs a vocabulary of at least 2 tokens to draft a wrong one")
        self.vocab_size, self.p_wrong, self.block_size, self.margin = vocab_size, float(p_wrong), block_size, margin
        self.seed = seed
        self._model = None
        self._ctx: list[int] = []
        self._script: list[int] = []

    def begin(self, target, prompt_ids, features, max_new_tokens: int) -> None:
        self._model = target
        self._rng = np.random.Generator(np.random.PCG64(self.seed))
        self._ctx = [int(t) for t in torch.as_tensor(prompt_ids).tolist()]
        self._script = self._ctx + greedy_continuation(target, self._ctx, max_new_tokens + self.block_size)

    def commit(self, token_ids, features) -> None:
        self._ctx.extend(int(t) for t in torch.as_tensor(token_ids).tolist())

    def draft(self, bonus: int, s: int) -> torch.Tensor:
        L, V = self.block_size - 1, self.vocab_size
        ctx = self._ctx + [int(bonus)]
        if len(self._script) < len(ctx) + L or self._script[: len(ctx)] != ctx:
            self._script = ctx + greedy_continuation(self._model, ctx, L)
        truth = self._script[len(ctx) : len(ctx) + L]
        logits = self._rng.standard_normal((L, V))  # [L, V]
        wrong = self._rng.random(L) < self.p_wrong
        other = self._rng.integers(0, V - 1, L)
        for d in range(L):
            top = truth[d] if not wrong[d] else int(other[d] + (other[d] >= truth[d]))  # a token != truth
            logits[d, top] = logits[d].max() + self.margin
        return torch.from_numpy(logits.astype(np.float32)).to(self._model.device)


@torch.no_grad()
def greedy_continuation(model, ids, n: int) -> list[int]:
    """The target's next n greedy tokens after ids (prefill + absorbed decode on a private cache)."""
    from kdlib.engine.cache import LatentCache

    ids = model.check_tokens(ids)
    cache = LatentCache(model.cfg, ids.shape[0] + n + 1, device=model.device, dtype=model.dtype)
    h, _ = model.prefill(cache, ids)
    tok = int(model.head(h[-1:]).argmax(-1))
    out = [tok]
    while len(out) < n:
        h, _ = model.forward_cached(cache, torch.tensor([tok]), [cache.length])
        cache.commit()
        tok = int(model.head(h).argmax(-1))
        out.append(tok)
    return out[:n]
