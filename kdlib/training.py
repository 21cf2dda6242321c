"""Training the tiny target and its DFlash-style drafter; device-agnostic (CPU or CUDA).

    tok = train_tokenizer(texts, 4096)                       # byte-level BPE (`tokenizers`)
    streams = token_streams(tok, docs)                       # {(kind, split): int32 ids, docs joined by EOS}
    target = Model(ModelConfig.from_dict(target_config(tok.get_vocab_size())))
    curve = train_target(target, streams, TrainSpec(...))    # next-token CE, AdamW, cosine LR
    net = DraftNet(DraftConfig(...), target.cfg)
    curve = train_drafter(net, target, streams, TrainSpec(...))
    drafter = to_engine(net.cfg, V, net.state_dict())        # kdlib.engine DFlashDrafter, for generate(method="ddtree")

Target training runs a batched forward (`target_forward`) over the engine's own modules and
parameters (HF DeepseekV3 names): the plain MLA form through `scaled_dot_product_attention`, and
the MoE with every expert computed densely and combined with the router's sparse top-k weights
(a tiny model on a GPU is launch-bound; the dense form is a handful of large kernels and gives
the same sum). `tests/test_training.py` checks it against `Model.logits`. Expert load is balanced
without an auxiliary loss, as DeepSeek-V3 does (arXiv 2412.19437 §2.1.2): after every step each
expert's `e_score_correction_bias` moves by BIAS_RATE towards the mean load.

The drafter (survey §6; SpecForge `specforge/core/dflash.py` describes the training): the target's
outputs of `target_layer_ids` layers, concatenated, go through `fc` and `hidden_norm` into a
context; `num_layers` Qwen3-style decoder layers (q/k RMSNorm, NeoX RoPE, SwiGLU) run over a
block [x_anchor, MASK x (B_blk - 1)] whose queries attend, without a causal mask, to the context
keys before the anchor and to the whole block; the final norm and the target's LM head give the
logits of slots 1..B_blk - 1. The target's embedding and LM head are used frozen and are not
part of the drafter's weights. Training samples `anchors` random anchors per sequence, one
forward covers them all (blocks see each other not at all), slot k predicts token anchor + k
with the CE weighted exp(-(k - 1) / gamma). This is the batched training twin of the engine's
`DFlashDrafter` (same architecture, same maths; its `block_forward` takes one sequence at a time):
`to_engine` hands the trained weights to it, and the tests check that both give the same logits.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np

SPECIAL_TOKENS = ("<|endoftext|>", "<|mask|>")  # document separator, drafter mask token
BIAS_RATE = 1e-3  # DeepSeek-V3's bias update speed gamma (arXiv 2412.19437 §4.2: 0.001 for most of training)


# ----------------------------------------------------------------------------- tokenizer and data
def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE tokenizer (lossless round trip for every str) with SPECIAL_TOKENS first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must cover the 256 byte symbols and the special tokens, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def token_streams(tok, docs) -> dict:
    """{(kind, split): int32 array}: every document's ids followed by the EOS id, in document order."""
    eos = tok.token_to_id(SPECIAL_TOKENS[0])
    groups: dict = {}
    for d in docs:
        groups.setdefault((d.kind, d.split), []).append(d.text)
    out = {}
    for key, texts in groups.items():
        enc = tok.encode_batch(texts, add_special_tokens=False)
        out[key] = np.fromiter((i for e in enc for i in (*e.ids, eos)), dtype=np.int32)
    return out


def sample_windows(streams: dict, weights: dict, batch: int, seq: int, rng: np.random.Generator) -> np.ndarray:
    """[batch, seq] int64 windows from the train streams, the kind of each row drawn by `weights`."""
    kinds = sorted(weights)
    p = np.array([weights[k] for k in kinds], dtype=np.float64)
    rows = rng.choice(len(kinds), size=batch, p=p / p.sum())
    out = np.empty((batch, seq), dtype=np.int64)
    for r, ki in enumerate(rows):
        s = streams[(kinds[ki], "train")]
        start = int(rng.integers(0, len(s) - seq))
        out[r] = s[start : start + seq]
    return out


# ----------------------------------------------------------------------------- target
def target_config(vocab_size: int, **overrides) -> dict:
    """The tiny target's HF DeepseekV3 config.json dict (see data/models/target.config.json).

    4 layers (the first dense, as DeepSeek-V3's first_k_dense_replace), hidden 256, 4 heads of
    qk 32 + 32 rope / v 32, no q LoRA, kv_lora 64; 16 routed experts of width 96, top-2, plus one
    shared: ~7M parameters, 14 MB in float16, a few ms per token on a CPU core.
    """
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": vocab_size, "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 96,
        "num_hidden_layers": 4, "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": None, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32,
        "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rope_interleave": True,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0,
    }
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise ValueError(f"unknown target config fields {sorted(unknown)}")
    cfg.update(overrides)
    return cfg


def init_target(model, seed: int) -> None:
    """GPT-2 style initialisation: linear and embedding weights N(0, 0.02), output projections scaled
    by 1/sqrt(2 * layers) (residual growth), norms 1, router bias 0."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n_layers = model.cfg.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()


def _attention(attn, x, cos, sin):
    """Batched causal plain-form MLA: x [B, T, H] -> [B, T, H] (as MLAttention.forward_plain per row)."""
    import torch
    import torch.nn.functional as F

    from kdlib.engine.model import apply_rope

    c = attn.cfg
    B, T, _ = x.shape
    nh = c.num_attention_heads
    q = attn.q_proj(x) if c.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q_nope, q_rope = q.view(B, T, nh, c.qk_head_dim).split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
    q_rope = apply_rope(q_rope.transpose(0, 1), cos, sin, c.rope_interleave).transpose(0, 1)  # [B, T, nh, rope]
    c_kv, k_rope = attn.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
    k_rope = apply_rope(k_rope.transpose(0, 1), cos, sin, c.rope_interleave).transpose(0, 1)  # [B, T, rope]
    kv = attn.kv_b_proj(attn.kv_a_layernorm(c_kv)).view(B, T, nh, c.qk_nope_head_dim + c.v_head_dim)
    k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
    q = torch.cat([q_nope, q_rope.to(q_nope.dtype)], dim=-1).transpose(1, 2)  # [B, nh, T, qk]
    k = torch.cat([k_nope, k_rope[:, :, None].expand(B, T, nh, -1).to(k_nope.dtype)], dim=-1).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, scale=c.softmax_scale)
    return attn.o_proj(o.transpose(1, 2).reshape(B, T, nh * c.v_head_dim))


def _moe(moe, x, loads):
    """Dense-expert MoE: x [N, H] -> [N, H]; appends the per-expert token count [E] to `loads`."""
    import torch

    w, idx = moe.gate(x)  # [N, k] float32, [N, k] int64
    E = len(moe.experts)
    combine = torch.zeros(x.shape[0], E, dtype=torch.float32, device=x.device).scatter_add_(1, idx, w)  # [N, E]
    gate = torch.stack([e.gate_proj.weight for e in moe.experts])  # [E, I, H]
    up = torch.stack([e.up_proj.weight for e in moe.experts])  # [E, I, H]
    down = torch.stack([e.down_proj.weight for e in moe.experts])  # [E, H, I]
    a = torch.nn.functional.silu(torch.einsum("nh,eih->nei", x, gate)) * torch.einsum("nh,eih->nei", x, up)
    y = torch.einsum("nei,ehi->neh", a, down)  # [N, E, H]
    out = torch.einsum("ne,neh->nh", combine.to(y.dtype), y)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x)
    loads.append(torch.bincount(idx.flatten(), minlength=E))
    return out


def target_forward(model, ids, capture: tuple[int, ...] = (), loads: list | None = None):
    """Batched causal forward with gradients. ids [B, T] -> (h [B, T, H] pre-norm, taps [B, T, F] or None).

    Same maths as `Model.forward_plain` row by row; `loads` (a list) collects each MoE layer's
    expert token counts.
    """
    import torch

    from kdlib.engine.model import MoE, rope_cos_sin

    B, T = ids.shape
    cos, sin = rope_cos_sin(model.cfg, torch.arange(T), torch.float32, ids.device)
    h = model.model.embed_tokens(ids)
    taps = []
    loads = [] if loads is None else loads
    for i, layer in enumerate(model.model.layers):
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), cos, sin)
        x = layer.post_attention_layernorm(h)
        if isinstance(layer.mlp, MoE):
            h = h + _moe(layer.mlp, x.reshape(B * T, -1), loads).view(B, T, -1)
        else:
            h = h + layer.mlp(x)
        if i in capture:
            taps.append(h)
    return h, (torch.cat(taps, dim=-1) if capture else None)


def lm_loss(model, ids, loads: list | None = None):
    """Mean next-token cross-entropy (nats) of ids [B, T] over B * (T - 1) targets."""
    import torch.nn.functional as F

    h, _ = target_forward(model, ids[:, :-1], loads=loads)
    logits = model.head(h)  # [B, T-1, V] float32
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def balance_router(model, loads, rate: float = BIAS_RATE) -> None:
    """Aux-loss-free balancing: bias += rate * sign(mean load - load), per MoE layer, in order."""
    import torch

    from kdlib.engine.model import MoE

    moes = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]
    with torch.no_grad():
        for moe, load in zip(moes, loads, strict=True):
            lf = load.float()
            moe.gate.e_score_correction_bias.add_(rate * torch.sign(lf.mean() - lf))


# ----------------------------------------------------------------------------- drafter
@dataclass(frozen=True)
class DraftConfig:
    """The DFlash-style drafter's shape. hidden_size must equal the target's (shared embedding/head)."""

    hidden_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # 7 at block 16 as SpecForge's DFlash recipes (sgl-project/SpecForge
    # examples/configs/online/disaggregated/external/qwen3-8b-dflash-1server-dp4.yaml: loss_decay_gamma 7.0)
    loss_gamma: float = 7.0

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE pairs), got {self.head_dim}")

    @classmethod
    def from_dict(cls, d: dict) -> DraftConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known - {"architecture"}
        if unknown:
            raise ValueError(f"drafter config: unknown fields {sorted(unknown)}")
        d = {k: v for k, v in d.items() if k in known}
        return cls(**{**d, "target_layer_ids": tuple(d["target_layer_ids"])})

    def to_dict(self) -> dict:
        return {"architecture": "DFlashDraft", **asdict(self), "target_layer_ids": list(self.target_layer_ids)}


def _rope_neox(x, pos, theta: float):
    """NeoX RoPE (rotate halves) on x [..., T, nh, d] at integer positions pos [..., T]."""
    import torch

    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)  # [d/2]
    ang = pos.to(torch.float64)[..., None] * inv  # [..., T, d/2]
    cos, sin = ang.cos().to(x.dtype)[..., None, :], ang.sin().to(x.dtype)[..., None, :]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def _draft_modules(cfg: DraftConfig):
    from torch import nn

    from kdlib.engine.model import MLP, RMSNorm

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            H, nh, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
            self.q_proj = nn.Linear(H, nh * hd, bias=False)
            self.k_proj = nn.Linear(H, nh * hd, bias=False)
            self.v_proj = nn.Linear(H, nh * hd, bias=False)
            self.o_proj = nn.Linear(nh * hd, H, bias=False)
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

        def kv(self, x, pos):
            """x [..., T, H] at positions pos [..., T] -> K, V [..., T, nh, hd] (K normed and rotated)."""
            shape = x.shape[:-1] + (cfg.num_heads, cfg.head_dim)
            k = _rope_neox(self.k_norm(self.k_proj(x).view(shape)), pos, cfg.rope_theta)
            return k, self.v_proj(x).view(shape)

        def q(self, x, pos):
            shape = x.shape[:-1] + (cfg.num_heads, cfg.head_dim)
            return _rope_neox(self.q_norm(self.q_proj(x).view(shape)), pos, cfg.rope_theta)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.self_attn = Attn()
            self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    return Layer, RMSNorm


def _make_net():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class DraftNet(nn.Module):
        """The drafter's own weights: fc, hidden_norm, decoder layers, norm (see module docstring)."""

        def __init__(self, cfg: DraftConfig, target_cfg):
            super().__init__()
            if cfg.hidden_size != target_cfg.hidden_size:
                raise ValueError(f"drafter hidden {cfg.hidden_size} != target hidden {target_cfg.hidden_size}")
            bad = [i for i in cfg.target_layer_ids if not 0 <= i < target_cfg.num_hidden_layers]
            if bad:
                raise ValueError(f"target_layer_ids {bad} are not layers of a {target_cfg.num_hidden_layers}-layer target")
            if not 0 <= cfg.mask_token_id < target_cfg.vocab_size:
                raise ValueError(f"mask_token_id {cfg.mask_token_id} outside the vocabulary {target_cfg.vocab_size}")
            Layer, RMSNorm = _draft_modules(cfg)
            self.cfg = cfg
            self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.layers = nn.ModuleList(Layer() for _ in range(cfg.num_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

        def load_weights(self, weights: dict) -> None:
            from kdlib.engine.loading import check_keys

            own = self.state_dict()
            check_keys(set(own), set(weights))
            with torch.no_grad():
                for k, t in own.items():
                    if tuple(weights[k].shape) != tuple(t.shape):
                        raise ValueError(f"{k}: shape {tuple(weights[k].shape)} does not match {tuple(t.shape)}")
                    t.copy_(torch.as_tensor(weights[k]).to(t.dtype))

        def context(self, feats):
            """Target features [..., T, F] -> drafter context [..., T, H]."""
            return self.hidden_norm(self.fc(feats))

        def context_kv(self, ctx, pos):
            """Per-layer context K, V for ctx [..., T, H] at positions pos [..., T]."""
            return [layer.self_attn.kv(ctx, pos) for layer in self.layers]

        def run_block(self, h, pos, ctx_kv, mask, lm_head_weight):
            """Block states h [B, Q, H] at positions pos [B, Q] over context K/V [B, C, nh, hd] per layer.

            mask [B, Q, C + Q] bool (True = visible) or None (all visible). Returns logits [B, Q, V] float32.
            """
            B, Q, _ = h.shape
            m = None if mask is None else mask[:, None]  # [B, 1, Q, C+Q]
            for layer, (kc, vc) in zip(self.layers, ctx_kv, strict=True):
                x = layer.input_layernorm(h)
                a = layer.self_attn
                q = a.q(x, pos)
                kb, vb = a.kv(x, pos)
                k = torch.cat([kc, kb], dim=1).transpose(1, 2)  # [B, nh, C+Q, hd]
                v = torch.cat([vc, vb], dim=1).transpose(1, 2)
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=m)  # [B, nh, Q, hd]
                h = h + a.o_proj(o.transpose(1, 2).reshape(B, Q, -1))
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            return F.linear(self.norm(h), lm_head_weight).float()

        def block_forward(self, target, ids, feats, anchors):
            """Training forward (SpecForge-style): logits of every anchor's block, slots 1..B_blk-1.

            ids [B, T] int64, feats [B, T, F] (target taps), anchors [B, A] int64 with
            1 <= a <= T - B_blk. Returns logits [B, A, B_blk - 1, V] float32 and labels [B, A, B_blk - 1].
            """
            c = self.cfg
            B, T = ids.shape
            A, S = anchors.shape[1], c.block_size
            k = torch.arange(S, device=ids.device)
            pos = anchors[:, :, None] + k  # [B, A, S]
            block = torch.full((B, A, S), c.mask_token_id, dtype=torch.int64, device=ids.device)
            block[:, :, 0] = torch.gather(ids, 1, anchors)
            labels = torch.gather(ids, 1, pos[:, :, 1:].reshape(B, -1)).view(B, A, S - 1)
            ctx = self.context(feats)  # [B, T, H]
            ctx_kv = self.context_kv(ctx, torch.arange(T, device=ids.device).expand(B, T))
            # visibility: context j < anchor; block keys of the same anchor only
            q_anchor = pos[:, :, :1].expand(B, A, S).reshape(B, A * S)  # [B, Q]
            see_ctx = torch.arange(T, device=ids.device)[None, None, :] < q_anchor[:, :, None]  # [B, Q, T]
            blk = torch.arange(A, device=ids.device).repeat_interleave(S)  # [Q]
            see_blk = (blk[:, None] == blk[None, :]).expand(B, -1, -1)  # [B, Q, Q]
            mask = torch.cat([see_ctx, see_blk], dim=-1)
            h = target.model.embed_tokens(block.view(B, A * S))
            logits = self.run_block(h, pos.view(B, A * S), ctx_kv, mask, _lm_head(target))
            return logits.view(B, A, S, -1)[:, :, 1:], labels

    return DraftNet


def _lm_head(target):
    return target.model.embed_tokens.weight if target.cfg.tie_word_embeddings else target.lm_head.weight


def __getattr__(name):  # DraftNet is built on first use: importing kdlib.training does not import torch
    if name == "DraftNet":
        globals()["DraftNet"] = _make_net()
        return globals()["DraftNet"]
    raise AttributeError(f"module 'kdlib.training' has no attribute {name!r}")


def engine_state_dict(weights: dict) -> dict:
    """DraftNet weight names -> `kdlib.engine.drafter.DFlashDrafter` names (the engine's layers hold the
    attention projections directly, without the `self_attn.` level)."""
    return {k.replace(".self_attn.", "."): v for k, v in weights.items()}


def engine_config(cfg: DraftConfig, vocab_size: int):
    """The `DFlashConfig` of the same drafter (the engine's inference class)."""
    from kdlib.engine.drafter import DFlashConfig

    return DFlashConfig(hidden_size=cfg.hidden_size, vocab_size=vocab_size, target_layer_ids=cfg.target_layer_ids,
                        mask_token_id=cfg.mask_token_id, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                        head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size, block_size=cfg.block_size,
                        rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps)


def to_engine(cfg: DraftConfig, vocab_size: int, weights: dict):
    """A `kdlib.engine.drafter.DFlashDrafter` (the engine's drafter, what `generate` runs) holding
    `weights` (a state dict under DraftNet names, e.g. `net.state_dict()`), on the CPU in float32."""
    import torch

    from kdlib.engine.drafter import DFlashDrafter

    d = DFlashDrafter(engine_config(cfg, vocab_size))
    src = engine_state_dict(weights)
    own = d.state_dict()
    if set(src) != set(own):
        raise ValueError(f"drafter weights do not match the engine's names: {sorted(set(src) ^ set(own))[:4]}")
    d.load_state_dict({k: torch.as_tensor(v).detach().to("cpu", torch.float32) for k, v in src.items()})
    return d.eval()


def drafter_loss(net, target, ids, anchors_per_seq: int, gen):
    """Position-decayed block CE of the drafter on ids [B, T] with random anchors.

    Returns (loss, per-slot top-1 accuracy [B_blk - 1] float tensor, detached).
    """
    import torch
    import torch.nn.functional as F

    c = net.cfg
    B, T = ids.shape
    hi = T - c.block_size  # the last anchor whose block stays inside the window
    if hi < 1:
        raise ValueError(f"sequence length {T} leaves no anchor for block size {c.block_size}")
    A = min(anchors_per_seq, hi)
    anchors = torch.stack([torch.randperm(hi, generator=gen)[:A] + 1 for _ in range(B)]).to(ids.device)  # [B, A]
    with torch.no_grad():
        _, feats = target_forward(target, ids, capture=c.target_layer_ids)
    logits, labels = net.block_forward(target, ids, feats.detach(), anchors)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(labels.shape)
    k = torch.arange(1, c.block_size, device=ids.device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / c.loss_gamma)  # [B_blk - 1]
    loss = (ce.mean(dim=(0, 1)) * w).sum() / w.sum()
    acc = (logits.argmax(-1) == labels).float().mean(dim=(0, 1)).detach()
    return loss, acc


# ----------------------------------------------------------------------------- loops
@dataclass
class TrainSpec:
    """One training run. The run stops at max_steps or time_budget_s, whichever comes first; the
    cosine LR schedule follows progress = max(step / max_steps, elapsed / time_budget_s).

    Defaults are the usual small-GPT choices (nanoGPT-style): AdamW betas (0.9, 0.95), weight
    decay 0.1 on matrices only, cosine decay to a tenth of the peak. `weights` is the share of
    each text kind among the sampled windows: prose is the scarcest kind (~6 % of the tokens) and
    is drawn more often than its share so that the model learns English at all; templated text
    is easy and needs little. `anchors` is per sequence (drafter only).
    """

    max_steps: int
    batch: int
    seq: int
    lr: float
    time_budget_s: float = float("inf")
    warmup_steps: int = 50
    weight_decay: float = 0.1
    min_lr_ratio: float = 0.1
    weights: dict = field(default_factory=lambda: {"code": 0.5, "prose": 0.3, "templated": 0.2})
    anchors: int = 32
    log_every: int = 50
    seed: int = 0


def _autocast(device):
    import torch

    if torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _lr(spec: TrainSpec, step: int, progress: float) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * cos)


def _loop(module, params, step_fn, spec: TrainSpec, log, eval_fn=None, eval_every: int = 0) -> dict:
    """AdamW steps until max_steps or the time budget. When eval_fn's result has a "score" (lower is
    better, on validation data), the module ends with the state of the best-scoring evaluation."""
    import torch

    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.95))
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    curve = {"step": [], "loss": [], "lr": [], "elapsed_s": [], "extra": [], "eval": []}
    t0 = time.perf_counter()
    step, acc_loss, acc_n = 0, 0.0, 0
    best = None  # (score, step, state dict on the host)
    while step < spec.max_steps:
        elapsed = time.perf_counter() - t0
        if elapsed >= spec.time_budget_s:
            break
        lr = _lr(spec, step, max(step / spec.max_steps, elapsed / spec.time_budget_s))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, extra = step_fn(rng)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        acc_loss += float(loss.detach())
        acc_n += 1
        if step % spec.log_every == 0 or step == spec.max_steps:
            curve["step"].append(step)
            curve["loss"].append(acc_loss / acc_n)
            curve["lr"].append(lr)
            curve["elapsed_s"].append(round(time.perf_counter() - t0, 2))
            curve["extra"].append(extra() if callable(extra) else extra)
            acc_loss, acc_n = 0.0, 0
            log(f"step {step:6d}  loss {curve['loss'][-1]:.4f}  lr {lr:.2e}  {curve['elapsed_s'][-1]:7.1f}s")
        if eval_fn is not None and eval_every and (step % eval_every == 0 or step == spec.max_steps):
            _evaluate(module, eval_fn, step, curve, log)
            if "score" in curve["eval"][-1] and (best is None or curve["eval"][-1]["score"] < best[0]):
                best = (curve["eval"][-1]["score"], step,
                        {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()})
    if eval_fn is not None and (not curve["eval"] or curve["eval"][-1]["step"] != step):
        _evaluate(module, eval_fn, step, curve, log)
        if "score" in curve["eval"][-1] and (best is None or curve["eval"][-1]["score"] < best[0]):
            best = None  # the final state is the best: keep it
    if best is not None:
        module.load_state_dict(best[2])
        log(f"kept the state of step {best[1]} (best validation score {best[0]:.4f})")
    curve["kept_step"] = best[1] if best is not None else step
    curve["steps"] = step
    curve["seconds"] = round(time.perf_counter() - t0, 2)
    return curve


def _evaluate(module, eval_fn, step, curve, log) -> None:
    was_training = module.training
    module.eval()
    curve["eval"].append({"step": step, **eval_fn()})
    module.train(was_training)
    log(f"  eval {curve['eval'][-1]}")


def train_target(model, streams: dict, spec: TrainSpec, log=print, eval_fn=None, eval_every: int = 0) -> dict:
    """Train `model` (a kdlib.engine.Model) on windows of the train streams. Returns the loss curve."""
    import torch

    device = model.device
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]

    def step_fn(rng):
        ids = torch.from_numpy(sample_windows(streams, spec.weights, spec.batch, spec.seq + 1, rng)).to(device)
        loads: list = []
        with _autocast(device):
            loss = lm_loss(model, ids, loads)
        balance_router(model, loads)
        return loss, None

    curve = _loop(model, params, step_fn, spec, log, eval_fn, eval_every)
    model.eval()
    return curve


def train_drafter(net, target, streams: dict, spec: TrainSpec, log=print, eval_fn=None, eval_every: int = 0) -> dict:
    """Train the drafter `net` against the frozen `target`. Returns the loss curve (with per-slot accuracy)."""
    import torch

    device = target.device
    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()
    net.train()
    gen = torch.Generator().manual_seed(spec.seed)
    params = list(net.parameters())

    def step_fn(rng):
        ids = torch.from_numpy(sample_windows(streams, spec.weights, spec.batch, spec.seq, rng)).to(device)
        with _autocast(device):
            loss, acc = drafter_loss(net, target, ids, spec.anchors, gen)
        return loss, lambda: [round(float(a), 4) for a in acc]

    curve = _loop(net, params, step_fn, spec, log, eval_fn, eval_every)
    net.eval()
    return curve


def evaluate_target(model, stream, seq: int, batch: int, max_windows: int | None = None) -> dict:
    """Held-out next-token CE over non-overlapping windows of `seq + 1` tokens: {"nll", "ppl", "tokens"}."""
    import torch

    n = (len(stream) - 1) // seq
    if max_windows is not None:
        n = min(n, max_windows)
    if n < 1:
        raise ValueError(f"stream of {len(stream)} tokens is shorter than one window of {seq + 1}")
    wins = np.stack([stream[i * seq : i * seq + seq + 1] for i in range(n)]).astype(np.int64)  # [n, seq+1]
    total, count = 0.0, 0
    with torch.no_grad(), _autocast(model.device):
        for i in range(0, n, batch):
            ids = torch.from_numpy(wins[i : i + batch]).to(model.device)
            total += float(lm_loss(model, ids)) * ids.shape[0] * seq
            count += ids.shape[0] * seq
    nll = total / count
    return {"nll": nll, "ppl": math.exp(nll), "tokens": count}


def evaluate_drafter(net, target, stream, seq: int, batch: int, windows: int, seed: int = 0) -> dict:
    """Held-out drafter block CE and per-slot top-1 accuracy on `windows` windows of the stream."""
    import torch

    rng = np.random.Generator(np.random.PCG64(seed))
    gen = torch.Generator().manual_seed(seed)
    starts = rng.integers(0, len(stream) - seq, windows)
    wins = np.stack([stream[s : s + seq] for s in starts]).astype(np.int64)
    losses, accs = [], []
    with torch.no_grad(), _autocast(target.device):
        for i in range(0, windows, batch):
            ids = torch.from_numpy(wins[i : i + batch]).to(target.device)
            loss, acc = drafter_loss(net, target, ids, 32, gen)
            losses.append(float(loss))
            accs.append(acc.cpu().numpy())
    return {"loss": float(np.mean(losses)), "slot_acc": [round(float(a), 4) for a in np.mean(accs, axis=0)]}


def save_weights(module, path, metadata: dict) -> None:
    """state_dict -> KDTR in float16 (atomic), metadata values stringified (JSON for non-str)."""
    from kdlib import kdtr

    tensors = {k: v.detach().to("cpu").half().numpy() for k, v in module.state_dict().items()}
    kdtr.save(path, tensors, {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()})
