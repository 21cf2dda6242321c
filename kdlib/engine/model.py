"""The DeepSeek-V3 / Kimi-K2 transformer in PyTorch: MLA + MoE, device-agnostic, FP32 (bf16 optional).

    model = Model.from_pretrained("path/to/hf_dir")            # config.json + *.safetensors (HF names)
    model = Model.random(cfg, seed=0)                            # deterministic numpy-seeded weights
    logits = model.logits(token_ids)                             # [T, V], full causal forward

Two attention forms over the same weights (parameter names are the Hugging Face DeepseekV3 names,
so `state_dict()` loads a HF checkpoint as it is):

  * plain (`forward_plain`, used by `logits` and prefill): expand the latent through `kv_b_proj`
    into per-head K and V and attend causally, as transformers' `DeepseekV3Attention` does;
  * absorbed (`forward_cached`, used by decode and tree verify): fold `kv_b_proj` into the query
    and the output, so every head attends over the latent cache rows `[c_kv (kv_lora) | k_rope]`
    directly: score = (q_nope W_uk) . c + q_rope . k_rope, out = (p . c) W_uv.

RoPE follows transformers: with `rope_interleave` (the DeepSeek default) the rotary half of q/k is
read as interleaved pairs (x0, x1), (x2, x3)... and written out de-interleaved, [rotated evens |
rotated odds]; otherwise the NeoX halves (rotate_half). q and k get the same layout, so the dot
product is unchanged, and the cache stores k_rope already rotated. YaRN (`kdlib.config`): inverse
frequencies and magnitudes as transformers' `_compute_yarn_parameters`, the softmax scale multiplied
by mscale(factor, mscale_all_dim)^2 (models-hardware.md §3). cos/sin are computed in float64 and
rounded once to the compute dtype.

MoE: sigmoid router scores; expert choice uses scores + e_score_correction_bias, restricted to the
`topk_group` groups with the largest sum of their top-2 biased scores (noaux_tc); the weights are
the unbiased scores of the chosen experts, normalised when `norm_topk_prob`, times
`routed_scaling_factor`; plus the shared expert(s). Layers below `first_k_dense_replace` are dense.
"""

from __future__ import annotations

import numbers
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from kdlib import ops
from kdlib.config import ModelConfig, rope_inv_freq
from kdlib.engine.loading import check_keys, checkpoint_layout, random_weights

# torch's grouped GEMM (one launch for all experts, offsets on the device: no host sync); CUDA bf16 only
GROUPED_MM = hasattr(torch, "_grouped_mm")


# ----------------------------------------------------------------------------- RoPE (host side)
def rope_cos_sin(cfg: ModelConfig, positions: torch.Tensor, dtype, device, inv: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rope/2] for integer positions [T], magnitude-scaled by the YaRN attention factor.

    inv: `rope_inv_freq(cfg)` already on `device` (float64), e.g. to keep host copies out of a CUDA graph.
    """
    inv = torch.from_numpy(rope_inv_freq(cfg)).to(device) if inv is None else inv
    ang = positions.to(device=device, dtype=torch.float64)[:, None] * inv[None, :]  # [T, rope/2]
    m = cfg.rope_attention_factor
    return (ang.cos() * m).to(dtype), (ang.sin() * m).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate the last axis of x [T, ..., rope] with cos/sin [T, rope/2]; output de-interleaved."""
    if interleave:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    c, s = cos.view(shape), sin.view(shape)
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


# ----------------------------------------------------------------------------- layers
def upcast(x: torch.Tensor) -> torch.Tensor:
    """Half types to float32 for norms and softmax (as transformers); float32/float64 stay as they are."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # w * x * rsqrt(mean(x^2) + eps), one fused kernel on CUDA that accumulates half types in float32
        # and rounds once (transformers rounds x * rsqrt to the half type before the weight: bf16 may part
        # from it in the last bit; float32 and float64 are the same arithmetic)
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def check_int(name, v, lo):
    """int(v), after a ValueError naming `name` unless v is an int (not a bool) >= lo."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return int(v)


def _signed(t: torch.Tensor, name: str, past: str) -> torch.Tensor:
    """An integer tensor as a signed one torch can reduce (its unsigned types have no min): ValueError for a
    float, complex or bool tensor, and for uint64 values of 2**63 and more (`past` says what they are)."""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must be integers, got {t.dtype}")
    if t.dtype == torch.uint64 and bool((t.view(torch.int64) < 0).any()):
        raise ValueError(f"{name}: values of 2**63 and more, {past}")
    return t.to(torch.int64) if t.dtype in (torch.uint16, torch.uint32, torch.uint64) else t


class Router(nn.Module):
    """DeepSeek-V3 noaux_tc router: group-limited top-k over sigmoid scores + correction bias."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts), persistent=True)

    def _apply(self, fn, recurse=True):
        """Moves and casts as any module, but the weight and the correction bias stay float32 where the
        cast is to a narrower float: transformers keeps both so (_keep_in_fp32_modules_strict), and a
        bias rounded to bfloat16 routes some tokens to other experts."""
        wide = self.weight.data, self.e_score_correction_bias
        super()._apply(fn, recurse)
        if self.weight.dtype in (torch.float16, torch.bfloat16) and wide[0].dtype.itemsize >= 4:
            dev = self.weight.device
            self.weight.data = wide[0].to(device=dev, dtype=torch.float32)
            self.e_score_correction_bias = wide[1].to(device=dev, dtype=torch.float32)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        c = self.cfg
        xr = x if x.dtype == torch.float64 else x.float()  # router in fp32 at least (as transformers)
        scores = F.linear(xr, self.weight.to(xr.dtype)).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.to(xr.dtype)
        if c.n_group > 1:
            per = c.n_routed_experts // c.n_group
            group_scores = choice.view(-1, c.n_group, per).topk(2, dim=-1).values.sum(-1)  # [T, G]
            group_idx = group_scores.topk(c.topk_group, dim=-1).indices  # [T, topk_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
            keep = keep[:, :, None].expand(-1, -1, per).reshape(-1, c.n_routed_experts)
            choice = choice.masked_fill(~keep, float("-inf"))
        idx = choice.topk(c.num_experts_per_tok, dim=-1).indices  # [T, k]
        w = scores.gather(1, idx)
        if c.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)  # 1e-20: transformers' guard against a zero sum
        return w * c.routed_scaling_factor, idx


class MoE(nn.Module):
    """Routed experts (top-k of `n_routed_experts`) plus the shared expert(s).

    Four exact-same-maths paths, picked by size (`path`): T tokens, k = top-k, E experts.
      * "gather" (3 T k <= E, e.g. AR decode): the chosen experts' weights are gathered per
        (token, slot) from a stacked copy and applied with two batched matmuls; the gather copies
        T k experts (read, write, read again by the matmul: 3 T k expert-sized transfers), no more
        than the dense path's one read of all E.
      * "dense" (T E <= DENSE_MAX_ROWS, e.g. tree verify): every expert runs on every token (E / k
        times the routed FLOPs, each expert's weights read once), then each token's k outputs are
        picked out. No host sync, a fixed launch count whatever the experts touched.
      * "loop" (long prefill): one iteration per expert in use; reading that list is a host sync
        per layer, but the FLOPs stay the routed ones.
      * "grouped" (`sync_free`, CUDA bfloat16, past the dense bound): slots sorted by expert on the
        device and both matmuls as one `torch._grouped_mm` each, the routed FLOPs with no host sync
        (the batched engine's large verify batches, CUDA graphs). Without it, sync_free takes "dense".
    Every path adds a token's expert outputs in ascending expert id, as the loop's index_add_ does,
    so the paths differ only in the matmul rounding of each expert's output.

    The stacked copy ([E, 2I, H] gate|up and [E, H, I] down) is cached while autograd is off and
    rebuilt when any expert parameter changes storage (`.to()`, a new tensor) or is written in
    place (its version counter moves: `load_weights`, `load_state_dict`). The cache holds the source
    tensors so that a freed storage cannot come back at the same address; after a `.to()` the old
    copy is freed at the next forward. The cache doubles the routed experts' memory. With
    autograd on, the weights are stacked per call.

    `quantize_int4()` replaces the routed experts by INT4 group-32 weights (`kdlib.engine.int4`):
    the layer then routes on the device and runs `kdlib.cuda.moe.moe_w4a16` on CUDA (bf16 inputs,
    launch sizes from the exact bound of M slots per expert: no host sync, graph-capturable), the
    dequantized weights in torch elsewhere (one iteration per expert, the CPU reference).
    """

    # Bound on the dense path's expert-token rows (E / k x the routed FLOPs): 8192 keeps every
    # verify of a 32-expert model (T <= 256) vectorised while a layer's dense FLOPs stay a fraction
    # of a millisecond on an H100-class GPU at the engine suite's widths; longer prefills take the
    # loop, whose host sync and per-expert launches matter less there.
    DENSE_MAX_ROWS = 8192

    def __init__(self, cfg: ModelConfig, *, n_experts: int | None = None, inter: int | None = None,
                 shared_inter: int | None = None):
        """n_experts / inter / shared_inter: a shard's expert count and widths (kdlib.tp); default the
        config's n_routed_experts, moe_intermediate_size and moe_intermediate_size x n_shared_experts."""
        super().__init__()
        self.gate = Router(cfg)
        n_experts = cfg.n_routed_experts if n_experts is None else n_experts
        inter = cfg.moe_intermediate_size if inter is None else inter
        shared_inter = (
            cfg.moe_intermediate_size * cfg.n_shared_experts if shared_inter is None else shared_inter
        )
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, inter) for _ in range(n_experts))
        self.shared_experts = MLP(cfg.hidden_size, shared_inter) if cfg.n_shared_experts else None
        # (source tensors, their (address, version), w13, w2); a plain attribute, not state
        self._stack_cache = None
        # after quantize_int4: {"q": unpacked (q, s) x 3, "packed": kernel layout | None, ...}
        self.int4 = None

    def path(self, n_tokens: int, sync_free: bool = False, device=None, dtype=None) -> str:
        """The forward path for n_tokens rows: "gather", "dense", "grouped" or "loop" (class docstring).

        sync_free (batched engine steps, CUDA graphs): never "loop"; past DENSE_MAX_ROWS "grouped"
        (torch._grouped_mm: CUDA, bfloat16) where it runs, else "dense".
        """
        if self.int4 is not None:
            return "int4"
        E, k = len(self.experts), self.gate.cfg.num_experts_per_tok
        if 3 * n_tokens * k <= E:
            return "gather"
        if n_tokens * E <= self.DENSE_MAX_ROWS:
            return "dense"
        if not sync_free:
            return "loop"
        grouped = device is not None and device.type == "cuda" and dtype == torch.bfloat16 and GROUPED_MM
        return "grouped" if grouped else "dense"

    def _expert_params(self) -> list[torch.Tensor]:
        # the module dicts read directly: nn.Module.__getattr__ for 3E weights per layer and forward
        # costs more host time than a decode step's launches of the whole layer
        return [e._modules[n]._parameters["weight"] for e in self.experts._modules.values()
                for n in ("gate_proj", "up_proj", "down_proj")]

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H] = gate | up rows, w2 [E, H, I]): the expert weights stacked."""
        ps = self._expert_params()
        try:
            key = [(p.data_ptr(), p._version) for p in ps]
        except RuntimeError:  # inference-mode tensors keep no version counter: no cache
            key = None
        cacheable = key is not None and not (torch.is_grad_enabled() and any(p.requires_grad for p in ps))
        c = self._stack_cache
        if cacheable and c is not None and key == c[1]:
            return c[2], c[3]
        self._stack_cache = None  # free the stale copy before building the new one
        w13 = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self.experts])
        w2 = torch.stack([e.down_proj.weight for e in self.experts])
        if cacheable:
            # keeps the storages alive: no other tensor can reuse their addresses
            held = [p.detach() for p in ps]
            self._stack_cache = (held, key, w13.detach(), w2.detach())
        return w13, w2

    @torch.no_grad()
    def quantize_int4(self) -> None:
        """Quantize the routed experts to INT4 (group 32 along each matrix's input axis) and free their
        float weights. On CUDA the packed kernel layout is kept too; it needs the hidden size and the
        expert intermediate size to be multiples of 64 (moe_w4a16's tiles): ValueError otherwise."""
        from kdlib.engine.int4 import pack_moe_torch, quantize_w4_torch

        if self.int4 is not None:
            raise ValueError("the experts are INT4 already")
        w13, w2 = self.stacked()  # [E, 2I, H], [E, H, I]
        E, I2, H = w13.shape
        I = I2 // 2
        if H % 32 or I % 32:
            raise ValueError(f"INT4 groups of 32 need hidden {H} and expert intermediate {I} "
                             "to be multiples of 32")
        cuda = w13.device.type == "cuda"
        if cuda and (H % 64 or I % 64):
            raise ValueError(f"moe_w4a16 needs hidden {H} and expert intermediate {I} to be multiples of 64")
        qs = (*quantize_w4_torch(w13[:, :I]), *quantize_w4_torch(w13[:, I:]), *quantize_w4_torch(w2))
        self.int4 = {"q": qs, "packed": pack_moe_torch(*qs) if cuda else None, "n_experts": E, "inter": I,
                     "views": None}
        self.experts = nn.ModuleList()
        self._stack_cache = None

    def _routed_int4(self, x, w, idx) -> torch.Tensor:
        from kdlib.engine.int4 import device_routing, routed_dequantized, routed_kernel

        q = self.int4
        if q["q"][0].device != x.device:
            raise ValueError(f"the INT4 experts live on {q['q'][0].device}, the input on {x.device}: "
                             "quantize after moving the model")
        rt = device_routing(idx, w, 0, q["n_experts"])
        if q["packed"] is None or x.device.type != "cuda":
            return routed_dequantized(x, q["q"], rt)
        if q["views"] is None:  # made once, outside any graph capture (the first call is a warm-up)
            import cupy

            from kdlib.cuda.loader import as_cupy

            q["views"] = {n: as_cupy(t).view(cupy.uint32) for n, t in q["packed"].items()}
        return routed_kernel(x, q["packed"], rt, idx.shape[1], q["inter"], bound=x.shape[0],
                             cupy_packed=q["views"])

    def forward(self, x: torch.Tensor, sync_free: bool = False) -> torch.Tensor:
        w, idx = self.gate(x)  # [T, k] float32, [T, k] int64
        path = self.path(x.shape[0], sync_free, x.device, x.dtype)
        if path == "int4":
            out = self._routed_int4(x, w, idx)
        elif path == "loop":
            out = torch.zeros_like(x)
            for e in torch.unique(idx).tolist():
                rows, slot = torch.where(idx == e)
                out.index_add_(0, rows, self.experts[e](x[rows]) * w[rows, slot, None].to(x.dtype))
        else:
            out = self._routed_vectorised(x, w, idx, path)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _routed_vectorised(self, x, w, idx, path: str) -> torch.Tensor:
        T, k = idx.shape
        I = self.experts[0].gate_proj.weight.shape[0]
        idx, order = idx.sort(dim=1)  # ascending expert id per token: the loop's order of addition
        w = w.gather(1, order)
        w13, w2 = self.stacked()
        if path == "gather":
            flat = idx.reshape(-1)  # [T k]
            xs = x.repeat_interleave(k, dim=0)[:, :, None]  # [T k, H, 1]
            gu = torch.bmm(w13[flat], xs)[:, :, 0]  # [T k, 2I]
            act = F.silu(gu[:, :I]) * gu[:, I:]  # [T k, I]
            y = torch.bmm(w2[flat], act[:, :, None])[:, :, 0].view(T, k, -1)  # [T, k, H]
        elif path == "grouped":
            E = w13.shape[0]
            flat = idx.reshape(-1)  # [T k] slots, token-major
            order = flat.argsort(stable=True)  # slots grouped by expert
            counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
                0, flat, torch.ones_like(flat, dtype=torch.int32))
            offs = counts.cumsum(0, dtype=torch.int32)  # [E] end row of each expert's group
            xs = x[order // k]  # [T k, H] rows grouped by expert
            gu = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)  # [T k, 2I]
            act = F.silu(gu[:, :I]) * gu[:, I:]
            ys = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [T k, H]
            y = torch.empty_like(ys).index_copy_(0, order, ys).view(T, k, -1)  # back to token-major
        else:
            gu = torch.matmul(x[None], w13.transpose(1, 2))  # [E, T, 2I]
            act = F.silu(gu[..., :I]) * gu[..., I:]  # [E, T, I]
            y_all = torch.matmul(act, w2.transpose(1, 2))  # [E, T, H]
            y = y_all[idx, torch.arange(T, device=x.device)[:, None]]  # [T, k, H]
        y = y * w[:, :, None].to(x.dtype)
        out = y[:, 0]
        for s in range(1, k):  # sequential, as index_add_ onto zeros in ascending expert order
            out = out + y[:, s]
        return out


class MLAttention(nn.Module):
    """Multi-head latent attention with the plain and the absorbed forms (see module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(H, nh * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)  # transformers keeps the default eps here
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, cfg.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)  # ditto
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * cfg.v_head_dim, H, bias=False)

    def _q(self, x, cos, sin):
        """x [T, H] -> q_nope [T, nh, nope], q_rope [T, nh, rope] (rotated)."""
        c = self.cfg
        q = self.q_proj(x) if c.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(x.shape[0], c.num_attention_heads, c.qk_head_dim)
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        return q_nope, apply_rope(q_rope, cos, sin, c.rope_interleave)

    def latent(self, x, cos, sin) -> torch.Tensor:
        """The cache row of each token: [T, kv_lora + rope] = [normed c_kv | rotated k_rope]."""
        c = self.cfg
        kv = self.kv_a_proj_with_mqa(x)
        c_kv, k_rope = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        return torch.cat([self.kv_a_layernorm(c_kv), apply_rope(k_rope, cos, sin, c.rope_interleave)], dim=-1)

    def forward_plain(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal self-attention over x [T, H]. Returns (out [T, H], latent rows [T, kv_lora + rope])."""
        c = self.cfg
        T, nh = x.shape[0], c.num_attention_heads
        q_nope, q_rope = self._q(x, cos, sin)
        lat = self.latent(x, cos, sin)
        kv = self.kv_b_proj(lat[:, : c.kv_lora_rank]).view(T, nh, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k_rope = lat[:, None, c.kv_lora_rank :].expand(T, nh, c.qk_rope_head_dim)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # [nh, T, qk]
        k = torch.cat([k_nope, k_rope], dim=-1).transpose(0, 1)  # [nh, T, qk]
        s = torch.matmul(q, k.transpose(1, 2)) * c.softmax_scale  # [nh, T, T]
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        s = s.masked_fill(~causal, float("-inf"))
        p = torch.softmax(upcast(s), dim=-1).to(x.dtype)
        o = torch.matmul(p, v.transpose(0, 1)).transpose(0, 1).reshape(T, nh * c.v_head_dim)
        return self.o_proj(o), lat

    def _absorbed_q(self, x, cos, sin):
        """x [Q, H] -> (q_lat [Q, nh, kv_lora], q_rope [Q, nh, rope], w_uv [nh, v, kv_lora])."""
        c = self.cfg
        q_nope, q_rope = self._q(x, cos, sin)
        w = self.kv_b_proj.weight.view(
            c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank
        )
        w_uk, w_uv = w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]  # [nh, nope, r], [nh, v, r]
        return torch.einsum("qhn,hnr->qhr", q_nope, w_uk), q_rope, w_uv

    def _out(self, o_lat, w_uv):
        """o_lat [Q, nh, kv_lora] -> [Q, H] through W_uv and o_proj."""
        o = torch.einsum("qhr,hvr->qhv", o_lat, w_uv)
        return self.o_proj(o.reshape(o.shape[0], -1))

    def forward_absorbed(self, x, cos, sin, keys: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Queries x [Q, H] over latent keys [N, kv_lora + rope] (already holding the queries' own rows).

        mask [Q, N] bool (True = visible) or None (all visible). Returns out [Q, H].
        """
        c = self.cfg
        q_lat, q_rope, w_uv = self._absorbed_q(x, cos, sin)
        k_c, k_r = keys[:, : c.kv_lora_rank], keys[:, c.kv_lora_rank :]
        s = (
            torch.einsum("qhr,kr->qhk", q_lat, k_c) + torch.einsum("qhd,kd->qhk", q_rope, k_r)
        ) * c.softmax_scale
        if mask is not None:
            s = s.masked_fill(~mask[:, None, :], float("-inf"))  # [Q, nh, N]
        p = torch.softmax(upcast(s), dim=-1).to(x.dtype)
        return self._out(torch.einsum("qhk,kr->qhr", p, k_c), w_uv)

    def forward_batch(self, x, cos, sin, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """C streams of W queries each, x [C*W, H], over their own latent keys [C, T, kv_lora + rope]
        (new rows included); mask [C, W, T] bool (True = visible). Returns out [C*W, H]."""
        c = self.cfg
        C, W, T = mask.shape
        q_lat, q_rope, w_uv = self._absorbed_q(x, cos, sin)
        q_lat = q_lat.view(C, W, c.num_attention_heads, c.kv_lora_rank)  # [C, W, nh, r]
        q_rope = q_rope.view(C, W, c.num_attention_heads, c.qk_rope_head_dim)
        k_c, k_r = keys[..., : c.kv_lora_rank], keys[..., c.kv_lora_rank :]  # [C, T, r], [C, T, rope]
        s = (
            torch.einsum("cwhr,ctr->cwht", q_lat, k_c) + torch.einsum("cwhd,ctd->cwht", q_rope, k_r)
        ) * c.softmax_scale
        s = s.masked_fill(~mask[:, :, None, :], float("-inf"))  # [C, W, nh, T]
        p = torch.softmax(upcast(s), dim=-1).to(x.dtype)
        o_lat = torch.einsum("cwht,ctr->cwhr", p, k_c).reshape(C * W, c.num_attention_heads, c.kv_lora_rank)
        return self._out(o_lat, w_uv)

    def forward_absorbed_ops(self, x, cos, sin, pool, page_table, new_rows, visibility) -> torch.Tensor:
        """The same attention through `kdlib.ops.tree_verify_attention` (numpy reference on CPU, the
        CuPy tree-verify kernels on CUDA): prefix over the paged pool plus the tree tail, LSE-merged.

        pool [S, kv_lora + rope] (one layer's slots), page_table [1, s], new_rows [Q, kv_lora + rope],
        visibility [Q, Q] bool. Returns out [Q, H].
        """
        c = self.cfg
        Q = x.shape[0]
        q_lat, q_rope, w_uv = self._absorbed_q(x, cos, sin)
        q = torch.cat([q_lat, q_rope], dim=-1)[None].contiguous()  # [1, Q, nh, kv_lora + rope]
        dev = x.device
        extra = {"validate": False} if dev.type == "cuda" else {}  # inputs are built here, not user data
        out, _ = ops.tree_verify_attention(
            q, pool, page_table, torch.tensor([page_table.shape[1]], device=dev), new_rows[None].contiguous(),
            visibility[None].contiguous(), torch.tensor([Q], device=dev), c.softmax_scale,
            kv_lora_rank=c.kv_lora_rank, **extra)
        return self._out(torch.as_tensor(out)[0].to(x.dtype), w_uv)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.self_attn = MLAttention(cfg)
        self.mlp = (
            MoE(cfg) if index >= cfg.first_k_dense_replace else MLP(cfg.hidden_size, cfg.intermediate_size)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def ffn(self, h: torch.Tensor, sync_free: bool = False) -> torch.Tensor:
        x = self.post_attention_layernorm(h)
        return h + (self.mlp(x, sync_free) if isinstance(self.mlp, MoE) else self.mlp(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# ----------------------------------------------------------------------------- the model
class Model(nn.Module):
    """DeepseekV3ForCausalLM-compatible model. Parameter names equal the HF ones.

    Hidden-state taps for a drafter: `capture=(l1, l2, ...)` returns the outputs of those decoder
    layers (HF `hidden_states[l + 1]`), concatenated on the feature axis: [T, len(capture) * H].

    `attention` picks the decode / verify attention (the plain prefill form is always torch):
    "torch" (einsum over the gathered latent rows, the default) or "ops"
    (`kdlib.ops.tree_verify_attention`: the float64 numpy reference on CPU, the CuPy tree-verify
    kernels on CUDA, which need kv_lora_rank 512 + rope 64 and at most 65 verified rows).
    """

    ATTENTION = ("torch", "ops")

    @property
    def attention(self) -> str:
        return self._attention

    @attention.setter
    def attention(self, value: str) -> None:
        if value not in self.ATTENTION:
            raise ValueError(f"attention must be one of {self.ATTENTION}, got {value!r}")
        self._attention = value

    def __init__(self, cfg: ModelConfig, attention: str = "torch"):
        super().__init__()
        self.cfg = cfg
        self.attention = attention
        self.model = Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    # ---- construction
    @classmethod
    def from_pretrained(cls, path, dtype=None, device=None) -> Model:
        """Load config.json + the safetensors files (HF DeepseekV3 names; a kimi_k25 wrapper's under
        `language_model.`) from a folder: the shards that model.safetensors.index.json names, else every
        *.safetensors (`loading.checkpoint_files`). The names, dtypes and shapes are checked from the files'
        headers before the model is built (`loading.checkpoint_layout`); then one tensor at a time is read
        beside the model."""
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"{path}: not a folder")
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: no config.json (a Hugging Face checkpoint folder holds one)")
        cfg = ModelConfig.from_json(path / "config.json")
        by_file: dict[Path, list[tuple[str, str]]] = {}  # file -> (model name, name stored there)
        for k, (f, stored) in checkpoint_layout(path, cfg).items():
            by_file.setdefault(f, []).append((k, stored))
        m = cls(cfg).to(dtype=dtype or torch.float32)  # the stored values in the asked dtype: a float64
        own = m.state_dict()  # checkpoint read as float64 keeps its bits (the router stays float32 or wider)
        with torch.no_grad():
            for f, names in by_file.items():
                with safe_open(str(f), framework="pt") as tensors:
                    for k, stored in names:
                        own[k].copy_(tensors.get_tensor(stored).to(own[k].dtype))
        return m.to(device=device or "cpu").eval()

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, dtype=None, device=None) -> Model:
        """Deterministic random weights (numpy PCG64 per `loading.random_weights`): same seed, same model."""
        m = cls(cfg)
        m.load_weights(random_weights(cfg, seed))
        return m.to(device=device or "cpu", dtype=dtype or torch.float32).eval()

    def load_weights(self, weights: dict) -> None:
        """Copy a name -> array mapping (numpy or torch, HF names) into the parameters; exact key match."""
        own = self.state_dict()
        check_keys(set(own), set(weights))
        with torch.no_grad():
            for k, t in own.items():
                src = weights[k]
                src = torch.from_numpy(np.ascontiguousarray(src)) if isinstance(src, np.ndarray) else src
                if tuple(src.shape) != tuple(t.shape):
                    raise ValueError(f"{k}: shape {tuple(src.shape)} does not match the config's "
                                     f"{tuple(t.shape)}")
                t.copy_(src.to(t.dtype))

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def quantize_experts_int4(self) -> Model:
        """Every MoE layer's routed experts to INT4 group 32 (`MoE.quantize_int4`), in place; returns self.
        On CUDA the model must be bfloat16 (moe_w4a16's activations); quantize after moving it."""
        if self.device.type == "cuda" and self.dtype != torch.bfloat16:
            raise ValueError("INT4 experts on CUDA run moe_w4a16 on bfloat16 activations; "
                             f"the model is {self.dtype}")
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.quantize_int4()
        return self

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: h [T, H] (pre-norm residual stream) -> logits [T, V], float32 or wider."""
        h = self.model.norm(h)
        w = self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        return upcast(F.linear(h, w))

    # ---- decode-loop hooks (kdlib.engine.generate); kdlib.tp.TPModel overrides them vocab-parallel
    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """[T] int64 argmax over the vocabulary of head(h); ties to the lower id."""
        return self.head(h).argmax(-1)

    def draft_topk(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafter logits [L, V] -> (ids [L, k] int64, log-probs [L, k] float32): top-k of the float32
        log-softmax over the full vocabulary, best first."""
        top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        return top.indices, top.values

    def begin_decode(self) -> None:
        """Called after the prefill and the drafter's set-up, before the first decode step (one
        process: nothing)."""

    def assert_replicated(self, **tensors) -> None:
        """Debug check that every process holds the same bits of `tensors` (one process: nothing to
        compare)."""

    def check_tokens(self, token_ids) -> torch.Tensor:
        """Validate ids (1-D, non-empty, inside the vocabulary) and return them as int64 on the
        model's device."""
        try:
            t = torch.as_tensor(token_ids)
        except (TypeError, ValueError, RuntimeError) as e:  # text, None, ragged lists: torch names nothing
            raise ValueError(f"token_ids must be a sequence of token ids, got {type(token_ids).__name__}: "
                             f"{e}") from None
        if t.dim() != 1 or t.numel() == 0:
            raise ValueError(f"token_ids must be a non-empty 1-D sequence, got shape {tuple(t.shape)}")
        t = _signed(t, "token_ids", f"out of the vocabulary [0, {self.cfg.vocab_size})")
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(f"token id out of the vocabulary [0, {self.cfg.vocab_size}): min {lo}, max {hi}")
        return t.to(device=self.device, dtype=torch.int64)

    # ---- forwards
    @torch.no_grad()
    def forward_plain(self, token_ids, capture: tuple[int, ...] = ()):
        """Full causal forward from position 0 in the plain MLA form.

        The scores are materialised ([heads, T, T] per layer): fine for the prompts of this workbook,
        no chunked prefill.
        Returns (h [T, H] last residual stream, latents [T, L, kv_lora + rope], captured [T, F] or None).
        """
        ids = self.check_tokens(token_ids)
        T = ids.shape[0]
        cos, sin = rope_cos_sin(self.cfg, torch.arange(T), self.dtype, self.device)
        h = self.model.embed_tokens(ids)
        lats, taps = [], []
        for i, layer in enumerate(self.model.layers):
            a, lat = layer.self_attn.forward_plain(layer.input_layernorm(h), cos, sin)
            h = layer.ffn(h + a)
            lats.append(lat)
            if i in capture:
                taps.append((i, h))
        return h, torch.stack(lats, dim=1), _concat_taps(taps, capture)

    @torch.no_grad()
    def logits(self, token_ids) -> torch.Tensor:
        """[T, V] float32 logits of a full causal forward (plain form)."""
        h, _, _ = self.forward_plain(token_ids)
        return self.head(h)

    @torch.no_grad()
    def prefill(self, cache, token_ids, capture: tuple[int, ...] = ()):
        """Plain-form forward of a prompt into an empty cache; its latent rows are committed.

        Returns (h [T, H], captured [T, F] or None).
        """
        self._check_cache(cache)
        if cache.length:
            raise ValueError(f"prefill needs an empty cache, this one holds {cache.length} tokens")
        h, lats, taps = self.forward_plain(token_ids, capture)
        cache.write_all(cache.pending(h.shape[0]), lats)
        cache.commit()
        return h, taps

    def _check_cache(self, cache) -> None:
        """ValueError unless `cache` holds this model's latent rows: its layers and width, dtype, device."""
        c, kv = self.cfg, cache.kv
        if kv.shape[0] != c.num_hidden_layers or kv.shape[2] != c.latent_dim:
            raise ValueError(f"the cache holds {kv.shape[0]} layers of {kv.shape[2]}-wide rows, the model "
                             f"{c.num_hidden_layers} of {c.latent_dim}")
        if kv.dtype != self.dtype or kv.device != self.device:
            raise ValueError(f"the cache is {kv.dtype} on {kv.device}, the model {self.dtype} on "
                             f"{self.device}: make it with LatentCache(..., device=model.device, "
                             "dtype=model.dtype)")

    @torch.no_grad()
    def forward_cached(self, cache, token_ids, positions, visibility=None, capture: tuple[int, ...] = ()):
        """Absorbed-form forward of Q new tokens against a latent cache (decode: Q = 1; tree verify).

        token_ids [Q]; positions [Q] (RoPE positions: s + depth for a tree); visibility [Q, Q] bool,
        row i = the new rows query i may see (itself and its tree ancestors); None is allowed for
        Q = 1 only. Every query sees all committed rows. The new latent rows go to `cache.pending(Q)`
        slots; the caller keeps them with `cache.commit()` or `cache.commit_path(...)`.
        Returns (h [Q, H] last residual stream, captured [Q, F] or None).
        """
        ids = self.check_tokens(token_ids)
        Q = ids.shape[0]
        if visibility is None and Q != 1:
            raise ValueError("visibility is required when more than one token is verified")
        if visibility is not None and tuple(torch.as_tensor(visibility).shape) != (Q, Q):
            raise ValueError(f"visibility must have shape [{Q}, {Q}], got "
                             f"{tuple(torch.as_tensor(visibility).shape)}")
        self._check_cache(cache)
        given = _signed(torch.as_tensor(positions), "positions", "past any position")
        if tuple(given.shape) != (Q,):
            raise ValueError(f"positions must have shape [{Q}], got {tuple(given.shape)}")
        # s + depth, depth < Q: checked where they are on the host (on the device it would cost a sync)
        if given.device.type == "cpu" and Q and not (
                cache.length <= int(given.min()) and int(given.max()) < cache.length + Q):
            raise ValueError(f"positions must lie in [{cache.length}, {cache.length + Q}) (the cache holds "
                             f"{cache.length} tokens, {Q} are verified), got {given.tolist()}")
        pos = given.to(device=self.device, dtype=torch.int64)
        cos, sin = rope_cos_sin(self.cfg, pos, self.dtype, self.device)
        slots = cache.pending(Q)  # [Q] physical slots of the new rows
        key_slots = cache.key_slots(slots)  # [s + Q]
        mask = None
        if visibility is not None:
            vis = torch.as_tensor(visibility, device=self.device, dtype=torch.bool)
            mask = torch.cat(
                [torch.ones(Q, key_slots.shape[0] - Q, dtype=torch.bool, device=self.device), vis], dim=1
            )
        use_ops = self.attention == "ops"
        if (
            use_ops
            and self.device.type == "cuda"
            and (self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim) != (512, 64)
        ):
            raise ValueError("attention 'ops' on CUDA needs kv_lora_rank 512 and qk_rope_head_dim 64 (the "
                             "kernels' 576)")
        if use_ops:
            vis_q = (
                mask[:, -Q:] if mask is not None else torch.ones(1, 1, dtype=torch.bool, device=self.device)
            )
            table = cache.prefix_table()
        h = self.model.embed_tokens(ids)
        taps = []
        for i, layer in enumerate(self.model.layers):
            x = layer.input_layernorm(h)
            rows = layer.self_attn.latent(x, cos, sin)  # [Q, kv_lora + rope]
            cache.write(i, slots, rows)
            if use_ops:
                a = layer.self_attn.forward_absorbed_ops(
                    x, cos, sin, cache.kv[i], table, rows.to(cache.kv.dtype), vis_q
                )
            else:
                a = layer.self_attn.forward_absorbed(x, cos, sin, cache.read(i, key_slots), mask)
            h = layer.ffn(h + a)
            if i in capture:
                taps.append((i, h))
        return h, _concat_taps(taps, capture)


    def rope_inv(self) -> torch.Tensor:
        """`rope_inv_freq(cfg)` as a float64 tensor on the model's device, made once (graph-safe
        afterwards)."""
        inv = getattr(self, "_rope_inv", None)
        if inv is None or inv.device != self.device:
            inv = torch.from_numpy(rope_inv_freq(self.cfg)).to(self.device)
            self._rope_inv = inv
        return inv

    @torch.no_grad()
    def forward_batch(
        self,
        kv: torch.Tensor,
        table: torch.Tensor,
        lens: torch.Tensor,
        token_ids: torch.Tensor,
        depth: torch.Tensor,
        visibility: torch.Tensor,
        capture: tuple[int, ...] = (),
    ):
        """Absorbed-form forward of C streams of W new rows each over a shared paged latent pool.

        kv [layers, S, kv_lora + rope] the pool; table [C, T] int64, the slot of each stream's
        logical positions (T >= lens + W); lens [C] committed tokens per stream; token_ids [C, W];
        depth [C, W] (RoPE position lens + depth: 0 for AR, the tree depth for a verify);
        visibility [C, W, W] bool (row i sees itself and its tree ancestors). Row j's latent is
        written to slot table[c, lens[c] + j]; stream c's keys are its positions t < lens[c] + W,
        visible to row i when t < lens[c] or visibility[c, i, t - lens[c]]. No host sync, no
        host-to-device copy and, with MoE's sync_free paths, graph-capturable: the batched engine's
        step. Returns (h [C*W, H] last residual stream, captured [C*W, F] or None).
        """
        C, W = token_ids.shape
        T = table.shape[1]
        dev = self.device
        pos = (lens[:, None] + depth).reshape(-1)  # [C*W] RoPE positions
        cos, sin = rope_cos_sin(self.cfg, pos, self.dtype, dev, inv=self.rope_inv())
        cols = torch.arange(W, device=dev)
        slots = table.gather(1, lens[:, None] + cols[None]).reshape(-1)  # [C*W] slots of the new rows
        rel = torch.arange(T, device=dev)[None, :] - lens[:, None]  # [C, T] key position - lens
        tree = torch.gather(visibility, 2, rel.clamp(0, W - 1)[:, None, :].expand(C, W, T))  # [C, W, T]
        mask = (rel < 0)[:, None, :] | (tree & ((rel >= 0) & (rel < W))[:, None, :])  # [C, W, T]
        exists = (rel < W)[..., None]  # [C, T, 1]: keys past a stream's rows read as 0, never as stale bytes
        h = self.model.embed_tokens(token_ids.reshape(-1))  # [C*W, H]
        taps = []
        for i, layer in enumerate(self.model.layers):
            x = layer.input_layernorm(h)
            rows = layer.self_attn.latent(x, cos, sin)  # [C*W, kv_lora + rope]
            kv[i].index_copy_(0, slots, rows.to(kv.dtype))
            keys = torch.where(exists, kv[i][table], 0).to(x.dtype)  # [C, T, kv_lora + rope]
            h = layer.ffn(h + layer.self_attn.forward_batch(x, cos, sin, keys, mask), sync_free=True)
            if i in capture:
                taps.append((i, h))
        return h, _concat_taps(taps, capture)


def _concat_taps(taps, capture):
    if not capture:
        return None
    got = dict(taps)
    missing = [c for c in capture if c not in got]
    if missing:
        raise ValueError(f"capture layers {missing} are not decoder layers of this model")
    return torch.cat([got[c] for c in capture], dim=-1)
