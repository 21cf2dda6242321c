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

import json
import numbers
from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kdlib import kdtr
from kdlib.engine.cache import LatentCache
from kdlib.engine.model import MLP, RMSNorm, apply_rope, check_int, upcast


@runtime_checkable
class Drafter(Protocol):
    """What `generate(method="ddtree")` needs from a drafter (see the module docstring for the call order)."""

    block_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]

    def begin(self, target, prompt_ids, features, max_new_tokens: int) -> None: ...

    def draft(self, bonus: int, s: int) -> torch.Tensor: ...

    def commit(self, token_ids, features) -> None: ...


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
    not a drafter cost). `reference`: the target's greedy continuation of the prompt when the caller
    already has it (an AR run of at least max_new_tokens + B_blk tokens), to skip that set-up.
    """

    target_layer_ids: tuple[int, ...] = ()

    def __init__(
        self,
        vocab_size: int,
        p_wrong: float,
        block_size: int = 8,
        seed: int = 0,
        margin: float = 3.0,
        reference: list[int] | None = None,
    ):
        if not 0.0 <= p_wrong <= 1.0:
            raise ValueError(f"p_wrong must lie in [0, 1], got {p_wrong}")
        block_size = check_int("block_size", block_size, 2)  # horizon L = block_size - 1
        if not margin > 0:  # at 0 or below the chosen token need not be the top one: p_wrong loses meaning
            raise ValueError(f"margin must be > 0 (the chosen token above the noise maximum), got {margin}")
        vocab_size = check_int("vocab_size", vocab_size, 2)  # >= 2: a wrong token to draft
        self.vocab_size, self.p_wrong, self.block_size, self.margin = (
            vocab_size,
            float(p_wrong),
            block_size,
            margin,
        )
        self.seed = check_int("seed", seed, 0)  # PCG64's, in `begin`
        self.reference = None if reference is None else [int(t) for t in reference]
        self._model = None
        self._ctx: list[int] = []
        self._script: list[int] = []

    def begin(self, target, prompt_ids, features, max_new_tokens: int) -> None:
        self._model = target
        self._rng = np.random.Generator(np.random.PCG64(self.seed))
        self._ctx = [int(t) for t in torch.as_tensor(prompt_ids).tolist()]
        need = max_new_tokens + self.block_size
        if self.reference is not None and len(self.reference) >= need:
            self._script = self._ctx + self.reference
        else:
            self._script = self._ctx + greedy_continuation(target, self._ctx, need)

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


# ----------------------------------------------------------------------------- DFlash block drafter
def default_target_layers(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """DFlash's default taps (survey §6; DFL `model.py:27-36`): one tap -> the middle target layer;
    otherwise `num_taps` layers evenly spaced from 1 to num_target_layers - 3 (clamped for tiny
    targets, duplicates dropped)."""
    if num_taps < 1:
        raise ValueError(f"num_taps must be >= 1, got {num_taps}")
    if num_taps == 1:
        return (num_target_layers // 2,)
    lo = min(1, num_target_layers - 1)
    hi = max(lo, num_target_layers - 3)
    return tuple(sorted({int(round(x)) for x in np.linspace(lo, hi, num_taps)}))


@dataclass(frozen=True)
class DFlashConfig:
    """Shape of a DFlash drafter for a given target.

    hidden_size / vocab_size are the target's; block_size B_blk (horizon L = B_blk - 1; generate bounds
    the tree depth min(L, budget) by 16, the GPU tree kernels' limit, so a larger L needs budget <= 16);
    target_layer_ids: the target decoder layers tapped (HF hidden_states[id + 1]); mask_token_id: the
    id filling block slots 1..B_blk-1 (a token of the target's vocabulary; trained checkpoints reserve
    one, the tiny default takes the last id).
    """

    hidden_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 16
    intermediate_size: int = 128
    block_size: int = 8
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @classmethod
    def for_target(
        cls, cfg, *, num_layers: int = 2, block_size: int = 8, target_layer_ids=None, **kw
    ) -> DFlashConfig:
        ids = tuple(target_layer_ids) if target_layer_ids is not None else default_target_layers(
            cfg.num_hidden_layers, num_layers)
        kw.setdefault("mask_token_id", cfg.vocab_size - 1)
        kw.setdefault("intermediate_size", 4 * cfg.hidden_size)
        return cls(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, target_layer_ids=ids,
                   num_layers=num_layers, block_size=block_size, **kw)

    # integer fields -> least value (check_int's)
    _SIZES = dict(hidden_size=1, vocab_size=1, mask_token_id=0, num_layers=1, num_heads=1, head_dim=1,
                  intermediate_size=1, block_size=2)

    def validate(self, target_cfg=None) -> None:
        """ValueError naming the field; numpy ints become ints in place (`save` writes the config as JSON)."""
        for name, lo in self._SIZES.items():
            object.__setattr__(self, name, check_int(name, getattr(self, name), lo))
        ids = tuple(check_int("target_layer_ids", i, 0) for i in self.target_layer_ids)
        object.__setattr__(self, "target_layer_ids", ids)
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, "
                             f"{self.vocab_size})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE pairs), got {self.head_dim}")
        if target_cfg is not None:
            if (self.hidden_size, self.vocab_size) != (target_cfg.hidden_size, target_cfg.vocab_size):
                raise ValueError("drafter hidden_size / vocab_size differ from the target's")
            bad = [i for i in self.target_layer_ids if not 0 <= i < target_cfg.num_hidden_layers]
            if bad:
                raise ValueError(f"target_layer_ids {bad} are not layers of the target")


def neox_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype, device):
    """The NeoX rotary table for `positions` [N]: cos, sin [N, head_dim/2] in `dtype`, angles in float64
    (position * theta^(-2i/head_dim)), as `apply_rope` takes them."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    ang = positions.to(device=device, dtype=torch.float64)[:, None] * inv[None]  # [N, hd/2]
    return ang.cos().to(dtype), ang.sin().to(dtype)


class DraftLayer(nn.Module):
    """Qwen3-style decoder layer with non-causal attention over [context ; block] keys (survey §6)."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.c = c
        H, nh, hd = c.hidden_size, c.num_heads, c.head_dim
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.q_proj = nn.Linear(H, nh * hd, bias=False)
        self.k_proj = nn.Linear(H, nh * hd, bias=False)
        self.v_proj = nn.Linear(H, nh * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)
        self.mlp = MLP(H, c.intermediate_size)

    def kv(self, h: torch.Tensor, positions: torch.Tensor, cos_sin=None) -> tuple[torch.Tensor, torch.Tensor]:
        """h [N, H] at positions [N] -> k, v [N, nh, hd] (k normed and rotated); cos_sin: the
        positions' (cos, sin)."""
        c = self.c
        k = self.k_norm(self.k_proj(h).view(-1, c.num_heads, c.head_dim))
        cos, sin = cos_sin or neox_cos_sin(positions, c.head_dim, c.rope_theta, h.dtype, h.device)
        return apply_rope(k, cos, sin, interleave=False), self.v_proj(h).view(-1, c.num_heads, c.head_dim)

    def forward(self, x, positions, ctx_k, ctx_v, mask=None):
        """x [Nq, H] block states at positions [Nq]; ctx_k/ctx_v [Nc, nh, hd]; mask [Nq, Nc + Nq] or None."""
        c = self.c
        a = self.input_layernorm(x)
        q = self.q_norm(self.q_proj(a).view(-1, c.num_heads, c.head_dim))
        cos, sin = neox_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype, x.device)
        q = apply_rope(q, cos, sin, interleave=False)
        bk, bv = self.kv(a, positions)
        k, v = torch.cat([ctx_k, bk]), torch.cat([ctx_v, bv])  # [Nc + Nq, nh, hd]
        s = torch.einsum("qhd,khd->hqk", q, k) * c.head_dim**-0.5
        if mask is not None:
            s = s.masked_fill(~mask[None], float("-inf"))
        p = torch.softmax(upcast(s), dim=-1).to(x.dtype)
        o = torch.einsum("hqk,khd->qhd", p, v).reshape(-1, c.num_heads * c.head_dim)
        x = x + self.o_proj(o)
        return x + self.mlp(self.post_attention_layernorm(x))


    def forward_batch(self, x, positions, ctx_k, ctx_v, ctx_valid):
        """C blocks at once: x [C, B, H] at positions [C, B]; ctx_k/ctx_v [C, T, nh, hd] each block's
        own context, ctx_valid [C, T] bool (rows past a stream's context are never seen)."""
        c = self.c
        C, B, H = x.shape
        a = self.input_layernorm(x).reshape(C * B, H)
        pos = positions.reshape(-1)
        q = self.q_norm(self.q_proj(a).view(-1, c.num_heads, c.head_dim))
        cos, sin = neox_cos_sin(pos, c.head_dim, c.rope_theta, x.dtype, x.device)
        q = apply_rope(q, cos, sin, interleave=False).view(C, B, c.num_heads, c.head_dim)
        bk, bv = self.kv(a, pos, (cos, sin))
        keep = ctx_valid[:, :, None, None]
        # [C, T+B, nh, hd]
        k = torch.cat([torch.where(keep, ctx_k, 0), bk.view(C, B, c.num_heads, c.head_dim)], dim=1)
        v = torch.cat([torch.where(keep, ctx_v, 0), bv.view(C, B, c.num_heads, c.head_dim)], dim=1)
        s = torch.einsum("cqhd,ckhd->chqk", q, k) * c.head_dim**-0.5  # [C, nh, B, T+B]
        seen = torch.cat([ctx_valid, torch.ones(C, B, dtype=torch.bool, device=x.device)], dim=1)  # [C, T+B]
        s = s.masked_fill(~seen[:, None, None, :], float("-inf"))
        p = torch.softmax(upcast(s), dim=-1).to(x.dtype)
        o = torch.einsum("chqk,ckhd->cqhd", p, v).reshape(C, B, c.num_heads * c.head_dim)
        x = x + self.o_proj(o)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """DFlash-style block drafter (survey §6). Weights: fc, hidden_norm, layers.*, norm (no embedding
    or LM head: the target's are used, frozen). `state_dict()` holds exactly the drafter's weights.

    Inference (the Drafter interface): `begin` projects the prompt's target features into per-layer
    context K/V; `draft(bonus, s)` runs the block [bonus, MASK x (B-1)] at positions s..s+B-1
    against all context (positions < s) and returns the logits of slots 1..B-1; `commit` appends
    the accepted nodes' features (positions s..s+tau-1). The block's own K/V are never kept.

    Training: `block_forward(target, token_ids, features, anchors)` runs many anchor blocks in one
    pass with the block-attention mask (block i sees context strictly before its anchor and its own
    block, bidirectionally; nothing across blocks); `loss` adds the slot-weighted cross-entropy.
    """

    def __init__(self, c: DFlashConfig, seed: int = 0):
        super().__init__()
        c.validate()
        self.c = c
        H = c.hidden_size
        self.fc = nn.Linear(len(c.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(H, c.rms_norm_eps)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # unit-gain init: N(0, 1/fan_in) for every projection, ones for norms
            for p in self.parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
        self._target = None
        self._ctx: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._ctx_len = 0

    # ---- Drafter interface attributes
    @property
    def block_size(self) -> int:
        return self.c.block_size

    @property
    def vocab_size(self) -> int:
        return self.c.vocab_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.c.target_layer_ids

    # ---- shared pieces
    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [N, len(ids) * H] -> context states [N, H] (fc, then hidden_norm)."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def _logits(self, target, x: torch.Tensor) -> torch.Tensor:
        """The target's head on the drafter's states, in the head's dtype (a float32 drafter of a bfloat16
        target, say)."""
        w = target.model.embed_tokens.weight if target.cfg.tie_word_embeddings else target.lm_head.weight
        return upcast(F.linear(self.norm(x).to(w.dtype), w))

    def _block_ids(self, first: torch.Tensor) -> torch.Tensor:
        """first [A] -> [A, B] = [first, MASK x (B - 1)]."""
        ids = torch.full(
            (first.shape[0], self.c.block_size), self.c.mask_token_id, dtype=torch.int64, device=first.device
        )
        ids[:, 0] = first
        return ids

    # ---- inference
    @torch.no_grad()
    def begin(self, target, prompt_ids, features, max_new_tokens: int) -> None:
        self.c.validate(target.cfg)
        object.__setattr__(self, "_target", target)
        self._ctx = [(None, None)] * len(self.layers)
        self._ctx_len = 0
        self.commit(prompt_ids, features)

    @torch.no_grad()
    def commit(self, token_ids, features) -> None:
        """The committed tokens' context K/V from their target features [len(token_ids), len(taps) * H]."""
        width, n_ids = self.fc.in_features, len(token_ids)
        if features is None or tuple(features.shape) != (n_ids, width):
            raise ValueError(f"DFlash commits the target's features of each token, [{n_ids}, {width}], got "
                             f"{None if features is None else tuple(features.shape)}")
        n = features.shape[0]
        pos = torch.arange(self._ctx_len, self._ctx_len + n, device=features.device)
        h = self.context(features)
        new = []
        for layer, (k0, v0) in zip(self.layers, self._ctx, strict=True):
            k, v = layer.kv(h, pos)
            new.append((k, v) if k0 is None else (torch.cat([k0, k]), torch.cat([v0, v])))
        self._ctx = new
        self._ctx_len += n

    @torch.no_grad()
    def draft(self, bonus: int, s: int) -> torch.Tensor:
        if s != self._ctx_len:
            raise ValueError(f"draft at position {s} but the drafter context holds {self._ctx_len} positions")
        target = self._target
        dev = self.fc.weight.device
        ids = self._block_ids(torch.tensor([int(bonus)], device=dev))[0]  # [B]
        x = target.model.embed_tokens(ids).to(self.fc.weight.dtype)  # [B, H]
        pos = torch.arange(s, s + self.c.block_size, device=dev)
        for layer, (k, v) in zip(self.layers, self._ctx, strict=True):
            x = layer(x, pos, k, v)
        return self._logits(target, x)[1:]  # [L, V]

    # ---- training
    def block_forward(
        self, target, token_ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor
    ) -> torch.Tensor:
        """Logits [A, B-1, V] of the blocks anchored at `anchors` [A] of one sequence.

        token_ids [T] and features [T, len(ids) * H] (the target's taps over the whole sequence,
        from `Model.forward_plain(ids, capture=drafter.target_layer_ids)`); block a is
        [token_ids[a], MASK x (B-1)] at positions a..a+B-1 and sees the context rows j < a plus its
        own block. Slot k (1..B-1) predicts token_ids[a + k]. Gradients flow into the drafter only
        when the caller enables them (the target's weights should be frozen).
        """
        T, A, B = token_ids.shape[0], anchors.shape[0], self.c.block_size
        if A and not bool(((anchors >= 0) & (anchors < T)).all()):  # a negative one would wrap around
            raise ValueError(f"anchors must lie in [0, {T}) (token_ids' length), got {anchors.tolist()}")
        dev = features.device
        ctx = self.context(features)  # [T, H]
        ctx_pos = torch.arange(T, device=dev)
        ids = self._block_ids(token_ids[anchors])  # [A, B]
        x = target.model.embed_tokens(ids.reshape(-1)).to(ctx.dtype)  # [A*B, H]
        pos = (anchors[:, None] + torch.arange(B, device=dev)[None]).reshape(-1)  # [A*B]
        blk = torch.arange(A, device=dev).repeat_interleave(B)  # block index of each query row
        see_ctx = ctx_pos[None, :] < anchors[blk][:, None]  # [A*B, T]
        see_blk = blk[:, None] == blk[None, :]  # [A*B, A*B]
        mask = torch.cat([see_ctx, see_blk], dim=1)
        for layer in self.layers:
            k, v = layer.kv(ctx, ctx_pos)
            x = layer(x, pos, k, v, mask)
        return self._logits(target, x).view(A, B, -1)[:, 1:]

    def loss(self, target, token_ids, features, anchors, gamma: float | None = None) -> torch.Tensor:
        """Mean cross-entropy of slots 1..B-1 against token_ids[anchor + k], weighted exp(-(k-1)/gamma)
        when gamma is given (SpecForge `loss_decay_gamma`, > 0); targets past the sequence end are skipped."""
        real = isinstance(gamma, numbers.Real) and not isinstance(gamma, bool)
        if gamma is not None and not (real and gamma > 0):  # 0 gave nan; < 0 weighted later slots more
            raise ValueError(f"gamma must be a number > 0 or None (equal weights), got {gamma!r}")
        logits = self.block_forward(target, token_ids, features, anchors)  # [A, L, V]
        L = logits.shape[1]
        k = torch.arange(1, L + 1, device=logits.device)
        tgt_pos = anchors[:, None] + k[None]  # [A, L]
        valid = tgt_pos < token_ids.shape[0]
        labels = token_ids[tgt_pos.clamp(max=token_ids.shape[0] - 1)]
        ce = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
        ).view_as(labels)
        w = torch.ones(L, device=logits.device) if gamma is None else torch.exp(-(k - 1).float() / gamma)
        w = w[None].expand_as(ce) * valid
        return (ce * w).sum() / w.sum().clamp(min=1e-12)

    # ---- persistence
    def save(self, path, metadata: dict | None = None) -> None:
        """state_dict + config to a KDTR file (metadata key `dflash_config` holds the config JSON)."""
        meta = {"kind": "dflash_drafter", "dflash_config": json.dumps(asdict(self.c))}
        meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
        kdtr.save(
            path, {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, metadata=meta
        )

    @classmethod
    def load(cls, path, device=None, dtype=torch.float32) -> DFlashDrafter:
        meta = kdtr.read_metadata(path)
        if "dflash_config" not in meta:
            raise ValueError(f"{path}: not a DFlash drafter file (no dflash_config metadata)")
        raw = json.loads(meta["dflash_config"])
        raw["target_layer_ids"] = tuple(raw["target_layer_ids"])
        d = cls(DFlashConfig(**raw))
        tensors = kdtr.load(path, mmap=False)
        own = d.state_dict()
        missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
        if missing or extra:
            raise ValueError(f"{path}: drafter weights do not match the config (missing {missing[:3]}, extra "
                             f"{extra[:3]})")
        d.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()})
        return d.to(device=device or "cpu", dtype=dtype).eval()
