"""Training the tiny target and its DFlash-style drafter; device-agnostic (CPU or CUDA).

    tok = train_tokenizer(texts, 4096)                       # byte-level BPE (`tokenizers`), EOS 0, MASK 1
    streams = token_streams(tok, docs)                       # {(kind, split): int32 ids, each doc + EOS}
    target = Model(ModelConfig.from_dict(target_config(tok.get_vocab_size())))
    curve = train_target(target, streams, TrainSpec(...))    # next-token CE, AdamW, cosine LR
    drafter = DFlashDrafter(drafter_config(target.cfg, MASK_ID))   # the engine's class (kdlib.engine.drafter)
    init_drafter(drafter, seed)
    curve = train_drafter(drafter, target, streams, TrainSpec(...))
    save_drafter(drafter, "drafter.kdtr", {...})             # DFlashDrafter.save; zoo.load_drafter reads it

Every document of the training streams ends with the end-of-text token (`kdlib.zoo.EOS_TOKEN`,
"<|endoftext|>" as GPT-2's and Qwen's tokenizers name it), so the target learns to emit it where
a text ends; target_config names it `eos_token_id`.

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
with the CE weighted exp(-(k - 1) / gamma). The module trained is the engine's own
`DFlashDrafter`: `drafter_forward` runs its `block_forward` for a whole batch of sequences at once
(the engine's takes one sequence), over its modules and parameters, and `save_drafter` writes it
with its own `save`; the tests check both forwards give the same logits. Serving never imports
this module.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field

import numpy as np

from kdlib import kdtr, zoo

SPECIAL_TOKENS = (zoo.EOS_TOKEN, zoo.MASK_TOKEN)  # the BPE trainer gives them the first ids, in this order
EOS_ID, MASK_ID = 0, 1  # end of text (every document ends with it), the drafter's block filler
BIAS_RATE = 1e-3  # DeepSeek-V3's bias update speed gamma (arXiv 2412.19437 §4.2: 0.001 for most of training)


# ----------------------------------------------------------------------------- tokenizer and data
def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE tokenizer (lossless round trip for every str) with SPECIAL_TOKENS first (ids
    EOS_ID, MASK_ID). vocab_size counts the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError("vocab_size must cover the 256 byte symbols and the special tokens, got "
                         f"{vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != [EOS_ID, MASK_ID]:
        raise RuntimeError(f"the BPE trainer gave the special tokens ids {ids}, expected {[EOS_ID, MASK_ID]}")
    return tok


def token_streams(tok, docs) -> dict:
    """{(kind, split): int32 array}: every document's ids followed by EOS_ID, in document order.

    A document holding a special token's text is refused (it would encode to that token and end or
    mask the text mid-way).
    """
    eos = tok.token_to_id(zoo.EOS_TOKEN)
    if eos is None:
        raise ValueError(f"the tokenizer has no {zoo.EOS_TOKEN} token")
    groups: dict = {}
    for d in docs:
        bad = [t for t in SPECIAL_TOKENS if t in d.text]
        if bad:
            raise ValueError(f"document {d.kind}:{d.id} holds the special token text {bad[0]}")
        groups.setdefault((d.kind, d.split), []).append(d.text)
    out = {}
    for key, texts in groups.items():
        enc = tok.encode_batch(texts, add_special_tokens=False)
        out[key] = np.fromiter((i for e in enc for i in (*e.ids, eos)), dtype=np.int32)
    return out


def sample_windows(
    streams: dict, weights: dict, batch: int, seq: int, rng: np.random.Generator
) -> np.ndarray:
    """[batch, seq] int64 windows from the train streams, the kind of each row drawn by `weights`."""
    kinds = sorted(weights)
    p = np.array([weights[k] for k in kinds], dtype=np.float64)
    rows = rng.choice(len(kinds), size=batch, p=p / p.sum())
    out = np.empty((batch, seq), dtype=np.int64)
    short = {k: len(streams[(k, "train")]) for k in kinds if len(streams[(k, "train")]) < seq}
    if short:
        raise ValueError(f"train streams shorter than the window ({seq} tokens): {short}")
    for r, ki in enumerate(rows):
        s = streams[(kinds[ki], "train")]
        start = int(rng.integers(0, len(s) - seq + 1))  # every start whose window fits, the last one included
        out[r] = s[start : start + seq]
    return out


# ----------------------------------------------------------------------------- target
def target_config(vocab_size: int, **overrides) -> dict:
    """The tiny target's HF DeepseekV3 config.json dict (see data/models/target.config.json).

    4 layers (the first dense, as DeepSeek-V3's first_k_dense_replace), hidden 256, 4 heads of
    qk 32 + 32 rope / v 32, no q LoRA, kv_lora 64; 16 routed experts of width 96, top-2, plus one
    shared: ~7M parameters, 14 MB in float16, a few ms per token on a CPU core. bos and eos are the
    end-of-text token (GPT-2's convention: it ends every document, so it also precedes the next).
    """
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 768,
        "moe_intermediate_size": 96,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32,
        "v_head_dim": 32,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_interleave": True,
        "tie_word_embeddings": False,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
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
                std = (
                    0.02 / math.sqrt(2 * n_layers)
                    if name.endswith(("o_proj.weight", "down_proj.weight"))
                    else 0.02
                )
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
    # [B, T, nh, rope]
    q_rope = apply_rope(q_rope.transpose(0, 1), cos, sin, c.rope_interleave).transpose(0, 1)
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
    # [N, E]
    combine = torch.zeros(x.shape[0], E, dtype=torch.float32, device=x.device).scatter_add_(1, idx, w)
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
# 7 at block 16 as SpecForge's DFlash recipes (sgl-project/SpecForge
# examples/configs/online/disaggregated/external/qwen3-8b-dflash-1server-dp4.yaml: loss_decay_gamma 7.0)
LOSS_GAMMA = 7.0


def drafter_config(target_cfg, mask_token_id: int, **overrides):
    """The tiny drafter's `kdlib.engine.drafter.DFlashConfig` for `target_cfg` (an engine ModelConfig).

    Block 16, taps on every target layer, 2 layers of 4 heads x 64, SwiGLU width 512: ~1.6M
    parameters beside the tiny target. `overrides` replace these shape fields.
    """
    from kdlib.engine.drafter import DFlashConfig

    kw = {
        "target_layer_ids": tuple(range(target_cfg.num_hidden_layers)),
        "block_size": 16,
        "num_layers": 2,
        "num_heads": 4,
        "head_dim": 64,
        "intermediate_size": 512,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
    }
    unknown = set(overrides) - set(kw)
    if unknown:
        raise ValueError(f"unknown drafter config fields {sorted(unknown)}")
    kw.update(overrides)
    kw["target_layer_ids"] = tuple(kw["target_layer_ids"])
    cfg = DFlashConfig(hidden_size=target_cfg.hidden_size, vocab_size=target_cfg.vocab_size,
                       mask_token_id=mask_token_id, **kw)
    cfg.validate(target_cfg)
    return cfg


def init_drafter(drafter, seed: int) -> None:
    """torch.nn.Linear's default initialisation, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), for every projection
    of a `DFlashDrafter`, from its own generator; norms 1."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                bound = 1.0 / math.sqrt(p.shape[1])
                p.copy_(torch.rand(p.shape, generator=g) * (2 * bound) - bound)
            else:
                p.fill_(1.0)


def drafter_forward(drafter, target, ids, feats, anchors):
    """`DFlashDrafter.block_forward` for a batch, over the drafter's own modules and parameters.

    ids [B, T] int64, feats [B, T, F] (the target's taps), anchors [B, A] int64 with
    1 <= a <= T - B_blk. Block a of row b is [ids[b, a], MASK x (B_blk - 1)] at positions
    a..a + B_blk - 1; it sees row b's context j < a and its own block, nothing of other blocks or
    rows. Returns logits [B, A, B_blk - 1, V] float32 and labels [B, A, B_blk - 1] (ids[b, a + k]).
    The same maths as block_forward row by row (tests/test_training.py checks it); the attention
    runs through scaled_dot_product_attention over the whole batch with the block mask.
    """
    import torch
    import torch.nn.functional as F

    from kdlib.engine.drafter import neox_cos_sin
    from kdlib.engine.model import apply_rope

    c = drafter.c
    B, T = ids.shape
    A, S = anchors.shape[1], c.block_size
    Q, nh, hd = A * S, c.num_heads, c.head_dim
    dev = ids.device
    pos = anchors[:, :, None] + torch.arange(S, device=dev)  # [B, A, S]
    block = torch.full((B, A, S), c.mask_token_id, dtype=torch.int64, device=dev)
    block[:, :, 0] = torch.gather(ids, 1, anchors)
    labels = torch.gather(ids, 1, pos[:, :, 1:].reshape(B, -1)).view(B, A, S - 1)
    ctx = drafter.context(feats.reshape(B * T, -1))  # [B*T, H]
    ctx_pos = torch.arange(T, device=dev).repeat(B)  # [B*T]
    # [B, Q, T]
    see_ctx = torch.arange(T, device=dev)[None, None, :] < anchors.repeat_interleave(S, dim=1)[:, :, None]
    blk = torch.arange(A, device=dev).repeat_interleave(S)  # [Q] block of each query row
    see_blk = (blk[:, None] == blk[None, :]).expand(B, Q, Q)  # [B, Q, Q]
    mask = torch.cat([see_ctx, see_blk], dim=-1)[:, None]  # [B, 1, Q, T + Q]
    qpos = pos.reshape(B * Q)
    x = target.model.embed_tokens(block.view(B * Q)).to(ctx.dtype)  # [B*Q, H]
    for layer in drafter.layers:
        kc, vc = layer.kv(ctx, ctx_pos)  # [B*T, nh, hd]
        a = layer.input_layernorm(x)
        cos, sin = neox_cos_sin(qpos, hd, c.rope_theta, x.dtype, dev)
        # [B*Q, nh, hd]
        q = apply_rope(layer.q_norm(layer.q_proj(a).view(-1, nh, hd)), cos, sin, interleave=False)
        kb, vb = layer.kv(a, qpos)  # [B*Q, nh, hd]
        # [B, nh, T+Q, hd]
        k = torch.cat([kc.view(B, T, nh, hd), kb.view(B, Q, nh, hd)], dim=1).transpose(1, 2)
        v = torch.cat([vc.view(B, T, nh, hd), vb.view(B, Q, nh, hd)], dim=1).transpose(1, 2)
        # [B, nh, Q, hd]
        o = F.scaled_dot_product_attention(q.view(B, Q, nh, hd).transpose(1, 2), k, v, attn_mask=mask)
        x = x + layer.o_proj(o.transpose(1, 2).reshape(B * Q, nh * hd))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    logits = drafter._logits(target, x).float()  # [B*Q, V]
    return logits.view(B, A, S, -1)[:, :, 1:], labels


def sample_anchors(batch: int, seq: int, block_size: int, per_seq: int, gen, device="cpu"):
    """[batch, A] int64 anchors, A = min(per_seq, seq - block_size): distinct per row, drawn uniformly
    from 1..seq - block_size (every block stays inside the window) with the torch generator `gen`."""
    import torch

    if isinstance(per_seq, bool) or not isinstance(per_seq, int) or per_seq < 1:
        raise ValueError(f"per_seq must be an int >= 1, got {per_seq!r}")
    hi = seq - block_size  # the last anchor whose block stays inside the window
    if hi < 1:
        raise ValueError(f"sequence length {seq} leaves no anchor for block size {block_size}")
    A = min(per_seq, hi)
    return torch.stack([torch.randperm(hi, generator=gen)[:A] + 1 for _ in range(batch)]).to(device)


def drafter_loss(drafter, target, ids, anchors, gamma: float = LOSS_GAMMA):
    """Position-decayed block CE of the drafter on ids [B, T] at anchors [B, A]: slot k's mean CE
    weighted exp(-(k - 1) / gamma), as `DFlashDrafter.loss` averaged over the rows.

    Returns (loss, per-slot top-1 accuracy [B_blk - 1] float tensor, detached).
    """
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        _, feats = target_forward(target, ids, capture=drafter.target_layer_ids)
    logits, labels = drafter_forward(drafter, target, ids, feats.detach(), anchors)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(
        labels.shape
    )
    k = torch.arange(1, drafter.block_size, device=ids.device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)  # [B_blk - 1]
    loss = (ce.mean(dim=(0, 1)) * w).sum() / w.sum()
    acc = (logits.argmax(-1) == labels).float().mean(dim=(0, 1)).detach()
    return loss, acc


def save_drafter(drafter, path, metadata: dict) -> None:
    """The drafter through `DFlashDrafter.save` (config in the file's metadata), weights in float16."""
    from kdlib.engine.drafter import DFlashDrafter

    half = DFlashDrafter(drafter.c)
    half.load_state_dict(drafter.state_dict())
    half.half().save(path, {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()})


# ----------------------------------------------------------------------------- loops
@dataclass
class TrainSpec:
    """One training run. The run stops at max_steps or time_budget_s, whichever comes first; the
    cosine LR schedule follows progress = max(step / max_steps, elapsed / time_budget_s).

    Defaults are the usual small-GPT choices (nanoGPT-style): AdamW betas (0.9, 0.95), weight
    decay 0.1 on matrices only, cosine decay to a tenth of the peak. `weights` is the share of
    each text kind among the sampled windows: prose is the scarcest kind (~6 % of the tokens) and
    is drawn more often than its share so that the model learns English at all; templated text
    is easy and needs little. `anchors` (per sequence) and `loss_gamma` (slot k's CE weight
    exp(-(k - 1) / gamma)) are the drafter's only.
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
    loss_gamma: float = LOSS_GAMMA
    log_every: int = 50
    seed: int = 0

    def __post_init__(self):
        """ValueError naming the field: a zero batch failed as a reshape, log_every 0 divided by zero, a
        misspelt kind as a KeyError mid-run."""
        for name, low in (("max_steps", 1), ("batch", 1), ("seq", 1), ("warmup_steps", 0), ("anchors", 1),
                          ("log_every", 1), ("seed", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"TrainSpec.{name} must be an int >= {low}, got {v!r}")
        for name, positive in (("lr", True), ("loss_gamma", True), ("time_budget_s", True),
                               ("weight_decay", False), ("min_lr_ratio", False)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (v > 0 if positive else v >= 0):
                op = ">" if positive else ">="
                raise ValueError(f"TrainSpec.{name} must be a number {op} 0, got {v!r}")
        shares = list(self.weights.values())
        numbers = all(isinstance(w, int | float) and math.isfinite(w) and w >= 0 for w in shares)
        if set(self.weights) - set(zoo.KINDS) or not numbers or not sum(shares) > 0:
            raise ValueError(f"TrainSpec.weights must map kinds of {zoo.KINDS} to shares >= 0 with a "
                             f"positive sum, got {self.weights!r}")


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
            if _better(curve["eval"][-1], best):
                best = (curve["eval"][-1]["score"], step,
                        {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()})
    if eval_fn is not None and (not curve["eval"] or curve["eval"][-1]["step"] != step):
        _evaluate(module, eval_fn, step, curve, log)
        if _better(curve["eval"][-1], best):
            best = None  # the final state is the best: keep it
    if best is not None:
        module.load_state_dict(best[2])
        log(f"kept the state of step {best[1]} (best validation score {best[0]:.4f})")
    curve["kept_step"] = best[1] if best is not None else step
    curve["steps"] = step
    curve["seconds"] = round(time.perf_counter() - t0, 2)
    return curve


def _better(ev: dict, best) -> bool:
    """Whether evaluation `ev` beats the best kept so far (a (score, ...) tuple or None): a score that is
    not a finite number (a NaN of an overflowed pass) is never the best."""
    return "score" in ev and math.isfinite(ev["score"]) and (best is None or ev["score"] < best[0])


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
        ids = torch.from_numpy(sample_windows(streams, spec.weights, spec.batch, spec.seq + 1, rng)).to(
            device
        )
        loads: list = []
        with _autocast(device):
            loss = lm_loss(model, ids, loads)
        balance_router(model, loads)
        return loss, None

    curve = _loop(model, params, step_fn, spec, log, eval_fn, eval_every)
    model.eval()
    return curve


def train_drafter(drafter, target, streams: dict, spec: TrainSpec, log=print, eval_fn=None,
                  eval_every: int = 0) -> dict:
    """Train `drafter` (a kdlib.engine.drafter.DFlashDrafter) against the frozen `target`.
    Returns the loss curve (with per-slot accuracy)."""
    import torch

    device = target.device
    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()
    drafter.train()
    gen = torch.Generator().manual_seed(spec.seed)
    params = list(drafter.parameters())

    def step_fn(rng):
        ids = torch.from_numpy(sample_windows(streams, spec.weights, spec.batch, spec.seq, rng)).to(device)
        anchors = sample_anchors(spec.batch, spec.seq, drafter.block_size, spec.anchors, gen, device)
        with _autocast(device):
            loss, acc = drafter_loss(drafter, target, ids, anchors, spec.loss_gamma)
        return loss, lambda: [round(float(a), 4) for a in acc]

    curve = _loop(drafter, params, step_fn, spec, log, eval_fn, eval_every)
    drafter.eval()
    return curve


def evaluate_target(model, stream, seq: int, batch: int, max_windows: int | None = None) -> dict:
    """Held-out next-token CE over non-overlapping windows of `seq + 1` tokens: {"nll", "ppl", "tokens"}."""
    import torch

    n = (len(stream) - 1) // seq
    if max_windows is not None:
        if max_windows < 1:
            raise ValueError(f"max_windows must be >= 1 or None, got {max_windows}")
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


def evaluate_eos(model, stream, seq: int, batch: int = 16) -> dict:
    """How the target ends texts, on the documents of a stream (each followed by EOS_ID).

    For every document end with at least `seq` tokens before it, the window of those tokens is
    run once: `p_eos_at_end` is the mean probability of EOS as the next token there and
    `eos_top1_at_end` how often it is the top-1; `false_eos_top1` is the share of the window's
    other positions (where the next token is not EOS) at which EOS is the top-1 anyway. With no
    such document end the three figures are None.
    """
    import torch

    ends = np.flatnonzero(stream == EOS_ID)
    ends = ends[ends >= seq]
    if len(ends) == 0:
        return {"documents": 0, "p_eos_at_end": None, "eos_top1_at_end": None, "false_eos_top1": None}
    wins = np.stack([stream[e - seq : e + 1] for e in ends]).astype(np.int64)  # [n, seq + 1], EOS last
    p_end, top_end, false_top, inner = [], [], 0, 0
    with torch.no_grad(), _autocast(model.device):
        for i in range(0, len(wins), batch):
            ids = torch.from_numpy(wins[i : i + batch]).to(model.device)
            h, _ = target_forward(model, ids[:, :-1])
            logits = model.head(h).float()  # [b, seq, V]
            top = logits.argmax(-1) == EOS_ID  # [b, seq]
            p_end += torch.softmax(logits[:, -1], dim=-1)[:, EOS_ID].tolist()
            top_end += top[:, -1].tolist()
            other = ids[:, 1:-1] != EOS_ID  # [b, seq - 1]: positions whose next token is inside a text
            false_top += int((top[:, :-1] & other).sum())
            inner += int(other.sum())
    return {"documents": len(wins), "p_eos_at_end": round(float(np.mean(p_end)), 4),
            "eos_top1_at_end": round(float(np.mean(top_end)), 4),
            "false_eos_top1": round(false_top / max(inner, 1), 6)}


def evaluate_drafter(drafter, target, stream, seq: int, batch: int, windows: int, seed: int = 0,
                     anchors: int = 32, gamma: float = LOSS_GAMMA) -> dict:
    """Held-out drafter block CE and per-slot top-1 accuracy on `windows` windows of the stream."""
    import torch

    rng = np.random.Generator(np.random.PCG64(seed))
    gen = torch.Generator().manual_seed(seed)
    if len(stream) < seq:
        raise ValueError(f"the held-out stream ({len(stream)} tokens) is shorter than the window ({seq})")
    starts = rng.integers(0, len(stream) - seq + 1, windows)
    wins = np.stack([stream[s : s + seq] for s in starts]).astype(np.int64)  # [windows, seq]
    losses, accs = [], []
    with torch.no_grad(), _autocast(target.device):
        for i in range(0, windows, batch):
            ids = torch.from_numpy(wins[i : i + batch]).to(target.device)
            at = sample_anchors(ids.shape[0], seq, drafter.block_size, anchors, gen, target.device)
            loss, acc = drafter_loss(drafter, target, ids, at, gamma)
            losses.append(float(loss))
            accs.append(acc.cpu().numpy())
    return {"loss": float(np.mean(losses)), "slot_acc": [round(float(a), 4) for a in np.mean(accs, axis=0)]}


def save_weights(module, path, metadata: dict) -> None:
    """state_dict -> KDTR in float16 (atomic), metadata values stringified (JSON for non-str). A finite value
    past float16's range (65,504) is a ValueError naming its tensor, before anything is written."""
    tensors = {}
    for k, v in module.state_dict().items():
        v = v.detach().to("cpu")
        h = v.half()
        if bool((h.isinf() & v.isfinite()).any()):
            raise ValueError(f"{k}: a value past float16's range ({v.abs().max().item():.4g}): not saved")
        tensors[k] = h.numpy()
    kdtr.save(path, tensors, {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()})
