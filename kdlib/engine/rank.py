"""One tensor-parallel rank of a DeepSeek-V3 / Kimi-K2 model at real shapes, with random weights made
on the device.

    shape = RankShape(ModelConfig.from_json("data/configs/kimi-k2.6.json"), tp=8, rank=0, moe_mode="tp")
    model = RankModel(shape, device="cuda", seed=0)   # ~76 GB of weights, generated in seconds
    drafter = RankDrafter(model, DFLASH_KIMI)
    step = RankStep(model, streams=10, context=5500, budget=16, drafter=drafter)
    drafter.make_pool(step.pool.shape[1])             # the drafter's context K/V over the step's slots
    step.run()                                        # one verify step, all parts, on static buffers

The batched engine runs the rank too (`RankTarget`: vocab-parallel, shard-local token ids; `RankDrafter`
brings its lanes through `make_lanes`), AR or DDTree, each step one CUDA-graph replay; there the
trees are accepted as far as the random drafter and target agree (no forced tau):

    target = RankTarget(model, routing="router", prefill="layers", max_rows=16 * 17)
    eng = BatchEngine(target, max_streams=16, method="ddtree", drafter=RankDrafter(model, DFLASH_KIMI),
                      budget=16)                      # then add_request / step as in kdlib.engine.batch

What rank `rank` of `tp` holds (the slicing of `kdlib.tp.engine.shard_state_dict`, `partition` ranges):
  * attention (plain TP): its heads of q_b_proj / kv_b_proj / o_proj; q_a_proj, kv_a_proj_with_mqa
    and their norms replicated (the two projections stacked in one matrix, `qkv_a`: one GEMM over the
    normed rows), so the latent cache [layers, slots, kv_lora + rope] is the whole one;
  * FFN: the dense first layer and the shared expert sliced along the intermediate axis; the routed
    experts sliced the same way (`moe_mode="tp"`, all 384 with N = 2048 / tp each) or whole (`"ep"`,
    384 / tp experts of N = 2048); the router replicated (its rows stacked under the shared expert's
    gate and up in `mlp_gu`: one GEMM gives both);
  * embedding and LM head: its vocabulary rows (vocab-parallel, as `kdlib.memory` counts them).
Weights: bf16 everywhere but the routed experts, which are INT4 with a bf16 scale per 32 inputs in the
packed layout of `kdlib.cuda.moe.pack_moe` (`pack_moe_torch` is its torch twin), quantized from
Gaussians on the device; std 1 / sqrt(fan in) (unit gain), norms 1, router bias 0.

The forward of a step (`RankStep.verify`) is the batched engine's verify (C streams x W rows over a
paged latent pool) with the rank's kernels: the tree-verify MLA kernels (`kdlib.ops`, 576-wide latent)
and `moe_w4a16` with routing built on the device (`device_routing`: no host sync, launch sizes from
static bounds), so the whole step is CUDA-graph capturable. What a rank does not do here: the
collectives. Their time is modelled from the recorded NCCL fit (`allreduce_ms`); the partial sums
stand in for the reduced ones (the step's work does not depend on their values).

The drafter (`RankDrafter`) is a DFlash block drafter at a given shape, sharded like the target
(heads and MLP split over the ranks, one KV head per rank at 8 KV heads and tp 8, fc split along its
input features), its context K/V held per slot beside the target's latent. Acceptance is a parameter:
the tree builder gets the drafter's top-K ids with log-probs of a fixed profile (`draft_profile`),
and the accept walk gets forced targets (`forced_targets`) that agree with the tree's first-child
chain up to the chosen accepted length, so the step's work is real while tau is chosen. The experts'
choice is a parameter too (`RankStep(routing=...)`): uniform draws by default, as a trained, balanced
router gives on average (a random network's own router crowds a few experts). `RankModel.compile_pieces`
compiles the torch code between the kernels with torch.compile (fewer, fused kernels).
On the CPU the same code runs with the numpy references for attention and tree, and the routed
experts dequantized in torch (the INT4 kernel needs CUDA).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kdlib import ops
from kdlib.cuda import accept as cuda_accept
from kdlib.cuda import tree as ktree
from kdlib.cuda.loader import as_cupy
from kdlib.engine.batch import TreeBuffers, cupy_on_torch_stream
from kdlib.engine.config import ModelConfig
from kdlib.engine.generate import MAX_OPS_BUDGET
from kdlib.engine.int4 import (
    DeviceRouting,
    count_bound,
    device_routing,
    pack_moe_torch,
    quantize_w4_torch,
    routed_dequantized,
    routed_kernel,
)
from kdlib.engine.model import Model, apply_rope, rope_cos_sin, rope_inv_freq
from kdlib.tp.engine import MOE_MODES, partition

# the layer weights `RankModel.pre` and `RankModel.post` read, in their argument order
_PRE = ("in_norm", "qkv_a", "q_a_norm", "q_b", "kv_b", "kv_a_norm")
_POST = ("kv_b", "o", "post_norm", "mlp_gu", "mlp_down")
ROUTINGS = ("uniform", "router")  # RankStep's and RankTarget's expert choice
PREFILLS = ("layers", "synthetic")  # RankTarget's prefill
PREFILL_CHUNK = 64  # prompt rows one prefill chunk verifies (the tree-verify kernels take <= 65 a stream)


# ----------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class RankShape:
    """The slice of `cfg` that rank `rank` of `tp` holds (kdlib.tp's `partition` ranges)."""

    cfg: ModelConfig
    tp: int = 8
    rank: int = 0
    moe_mode: str = "tp"

    def __post_init__(self):
        if self.moe_mode not in MOE_MODES:
            raise ValueError(f"moe_mode must be one of {MOE_MODES}, got {self.moe_mode!r}")
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank must lie in [0, {self.tp}), got {self.rank}")

    def _range(self, n: int) -> tuple[int, int]:
        return partition(n, self.tp)[self.rank]

    @property
    def heads(self) -> int:
        lo, hi = self._range(self.cfg.num_attention_heads)
        return hi - lo

    @property
    def vocab_range(self) -> tuple[int, int]:
        return self._range(self.cfg.vocab_size)

    @property
    def expert_range(self) -> tuple[int, int]:
        """Global ids [e0, e1) of the experts this rank holds (all of them under "tp")."""
        return (
            self._range(self.cfg.n_routed_experts)
            if self.moe_mode == "ep"
            else (0, self.cfg.n_routed_experts)
        )

    @property
    def n_experts(self) -> int:
        e0, e1 = self.expert_range
        return e1 - e0

    @property
    def expert_inter(self) -> int:
        """N of each local expert: whole under "ep", this rank's slice under "tp"."""
        if self.moe_mode == "ep":
            return self.cfg.moe_intermediate_size
        lo, hi = self._range(self.cfg.moe_intermediate_size)
        return hi - lo

    @property
    def shared_inter(self) -> int:
        lo, hi = self._range(self.cfg.moe_intermediate_size * self.cfg.n_shared_experts)
        return hi - lo

    @property
    def dense_inter(self) -> int:
        lo, hi = self._range(self.cfg.intermediate_size)
        return hi - lo


# ----------------------------------------------------------------------------- INT4 on the device
# ----------------------------------------------------------------------------- the rank's weights
def _randn(shape, std, device, gen, dtype=torch.bfloat16):
    return (torch.randn(shape, device=device, generator=gen, dtype=torch.float32) * std).to(dtype)


class RankModel:
    """The weights of one rank (module docstring) and its layer pieces; tensors in `self.layers[l]`."""

    def __init__(self, shape: RankShape, device="cuda", seed: int = 0, expert_chunk: int = 32,
                 keep_unpacked: bool | None = None):
        """keep_unpacked: also keep the experts' q / scales (the torch path's input; default on the CPU
        only)."""
        c = shape.cfg
        self.shape, self.cfg, self.device = shape, c, torch.device(device)
        # the slice sizes the traced pieces read, as plain ints (tracing stops at `partition`'s divmod)
        self.heads, self.e0, self.n_local = shape.heads, shape.expert_range[0], shape.n_experts
        dev, bf = self.device, torch.bfloat16
        gen = torch.Generator(device=dev).manual_seed(seed)
        H, nh, r, rope = c.hidden_size, shape.heads, c.kv_lora_rank, c.qk_rope_head_dim
        v0, v1 = shape.vocab_range
        ones = torch.ones  # norms
        self.embed = _randn((v1 - v0, H), 1.0, dev, gen)  # [V_r, H]
        self.lm_head = _randn((v1 - v0, H), H**-0.5, dev, gen)  # [V_r, H]
        self.norm = ones(H, dtype=bf, device=dev)
        self.layers: list[dict] = []
        for i in range(c.num_hidden_layers):
            L = {
                "in_norm": ones(H, dtype=bf, device=dev),
                "post_norm": ones(H, dtype=bf, device=dev),
                # [q_a | kv_a, H]: q_a_proj's q_lora rows over kv_a_proj_with_mqa's kv_lora + rope rows
                "qkv_a": _randn((c.q_lora_rank + r + rope, H), H**-0.5, dev, gen),
                "q_a_norm": ones(c.q_lora_rank, dtype=bf, device=dev),
                "q_b": _randn((nh * c.qk_head_dim, c.q_lora_rank), c.q_lora_rank**-0.5, dev, gen),
                "kv_a_norm": ones(r, dtype=bf, device=dev),
                "kv_b": _randn((nh * (c.qk_nope_head_dim + c.v_head_dim), r), r**-0.5, dev, gen),
                "o": _randn((H, nh * c.v_head_dim), (nh * c.v_head_dim * shape.tp) ** -0.5, dev, gen),
            }
            if i < c.first_k_dense_replace:
                n = shape.dense_inter
                L["mlp_gu"] = _randn((2 * n, H), H**-0.5, dev, gen)  # [gate | up, H]
                L["mlp_down"] = _randn((H, n), c.intermediate_size**-0.5, dev, gen)
            else:
                L["router_bias"] = torch.zeros(c.n_routed_experts, dtype=torch.float32, device=dev)
                n = shape.shared_inter
                # [gate | up | router, H]: the shared expert's rows and the router's, one GEMM over the rows
                L["mlp_gu"] = _randn((2 * n + c.n_routed_experts, H), H**-0.5, dev, gen)
                L["mlp_down"] = _randn(
                    (H, n), (c.moe_intermediate_size * c.n_shared_experts) ** -0.5, dev, gen
                )
                L.update(self._experts(gen, expert_chunk, self.device.type != "cuda" if keep_unpacked is None
                                       else keep_unpacked))
            self.layers.append(L)
        self._rope_inv = None
        self._pre_fn, self._post_fn, self._route_fn = self._pre, self._post, self._route
        self.compiled = False

    def _experts(self, gen, chunk: int, keep: bool) -> dict:
        """The local experts of one layer, quantized and packed chunk by chunk (bounded transient memory).
        With `keep` the unpacked q / scales are kept too (the torch path dequantizes them)."""
        s, c, dev = self.shape, self.cfg, self.device
        E, N, K = s.n_experts, s.expert_inter, c.hidden_size
        parts, canon = [], []
        chunk = max(1, chunk * 256 // N)  # ~chunk x 256 x K elements per pass
        for e in range(0, E, chunk):
            n = min(chunk, E - e)
            gate = quantize_w4_torch(torch.randn((n, N, K), device=dev, generator=gen) * K**-0.5)
            up = quantize_w4_torch(torch.randn((n, N, K), device=dev, generator=gen) * K**-0.5)
            down = quantize_w4_torch(
                torch.randn((n, K, N), device=dev, generator=gen) * c.moe_intermediate_size**-0.5
            )
            parts.append(pack_moe_torch(*gate, *up, *down))
            if keep:
                canon.append((*gate, *up, *down))
        out = {"experts": {k: torch.cat([p[k] for p in parts]) for k in ("w1", "s1", "w2", "s2")}}
        if canon:
            out["experts_q"] = tuple(torch.cat([x[i] for x in canon]) for i in range(6))
        return out

    # ---- accounting
    def weight_bytes(self) -> int:
        """Bytes of every weight tensor this rank holds (what `kdlib.memory.weight_bytes(...)["per_gpu"]`
        counts)."""
        tensors = [self.embed, self.lm_head, self.norm]
        for L in self.layers:
            for k, v in L.items():
                if k == "experts":
                    tensors += list(v.values())
                elif not k.startswith("_") and k != "experts_q":
                    tensors.append(v)
        return sum(t.numel() * t.element_size() for t in tensors)

    def rope_inv(self) -> torch.Tensor:
        if self._rope_inv is None:
            self._rope_inv = torch.from_numpy(rope_inv_freq(self.cfg)).to(self.device)
        return self._rope_inv

    # ---- layer pieces (shapes: M = C x W rows)
    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [M] global -> [M, H]: this rank's vocabulary rows, zero elsewhere (the all-reduce sums the
        shards)."""
        v0, v1 = self.shape.vocab_range
        inside = (ids >= v0) & (ids < v1)
        rows = F.embedding((ids - v0).clamp(0, v1 - v0 - 1), self.embed)
        return rows * inside[:, None].to(rows.dtype)

    @staticmethod
    def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm as the engine's `RMSNorm` computes it: one fused kernel on CUDA, float32 inside."""
        return F.rms_norm(x, (x.shape[-1],), w.to(x.dtype), eps)

    def pre(self, L: dict, h: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The input norm and `attn_pre`: h [M, H] -> normed x [M, H], q [M, nh, 576], latent rows
        [M, 576]."""
        return self._pre_fn(h, cos, sin, *(L[k] for k in _PRE))

    def post(self, L: dict, h: torch.Tensor, o_lat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`attn_post`, the residual, the FFN norm and the dense MLP (the shared expert where routed):
        -> h [M, H] (after attention), normed f [M, H], y [M, H] (the MLP's output), the router's logits
        [M, E] in a MoE layer (None in a dense one)."""
        return self._post_fn(h, o_lat, *(L[k] for k in _POST))

    def _pre(self, h, cos, sin, *w):
        L = dict(zip(_PRE, w, strict=True))
        x = self.rms(h, L["in_norm"], self.cfg.rms_norm_eps)
        return (x, *self.attn_pre(L, x, cos, sin))

    def _post(self, h, o_lat, *w):
        L = dict(zip(_POST, w, strict=True))
        h = h + self.attn_post(L, o_lat)
        f = self.rms(h, L["post_norm"], self.cfg.rms_norm_eps)
        return h, f, *self.mlp(L, f)

    def _route(self, logits, router_bias, ids=None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route({"router_bias": router_bias}, logits, ids)

    def compile_pieces(self, backend: str = "inductor") -> None:
        """Compile the torch code between the kernels (`pre`, `post`, the router's scores and top-k) with
        torch.compile (Inductor, dynamic row count, whole graphs: a graph break raises), so the norms, RoPE,
        concatenations and the router's small ops fuse into a few kernels; the matmuls stay cuBLAS,
        attention / experts / the slot sort the project's kernels (`device_routing`: on CUDA one launch
        of moe_routing_v1, whose cost does not depend on a compile). The first call of each piece per row
        count 1 / > 1 compiles (before any CUDA-graph capture). backend: torch.compile's ("aot_eager"
        traces without code generation: the CPU test's check that every piece is one graph)."""
        self._pre_fn, self._post_fn, self._route_fn = (
            torch.compile(f, dynamic=True, fullgraph=True, backend=backend)
            for f in (self._pre, self._post, self._route))
        self.compiled = True

    def attn_pre(self, L: dict, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, H] (normed) -> q [M, nh, kv_lora + rope] (absorbed), latent rows [M, kv_lora + rope]."""
        c, nh = self.cfg, self.heads
        qa, kv = F.linear(x, L["qkv_a"]).split([c.q_lora_rank, c.latent_dim], dim=-1)  # one GEMM
        q = F.linear(self.rms(qa, L["q_a_norm"], 1e-6), L["q_b"]).view(-1, nh, c.qk_head_dim)
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        w = L["kv_b"].view(nh, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        q_lat = torch.einsum("mhn,hnr->mhr", q_nope, w[:, : c.qk_nope_head_dim])  # [M, nh, r]
        q = torch.cat([q_lat, apply_rope(q_rope, cos, sin, c.rope_interleave)], dim=-1)
        c_kv, k_rope = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        rows = torch.cat(
            [self.rms(c_kv, L["kv_a_norm"], 1e-6), apply_rope(k_rope, cos, sin, c.rope_interleave)], -1
        )
        return q, rows

    def attn_post(self, L: dict, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [M, nh, kv_lora] -> this rank's o_proj partial [M, H]."""
        c, nh = self.cfg, self.heads
        w_uv = L["kv_b"].view(nh, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)[:, c.qk_nope_head_dim:]
        o = torch.einsum("mhr,hvr->mhv", o_lat.to(w_uv.dtype), w_uv)
        return F.linear(o.reshape(o.shape[0], -1), L["o"])

    def mlp(self, L: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The dense layer's or the shared expert's slice: SwiGLU [M, H] -> [M, H]; in a MoE layer also the
        router's logits [M, E], from the same GEMM (the router's rows follow gate and up in `mlp_gu`)."""
        n = L["mlp_down"].shape[1]
        gu = F.linear(x, L["mlp_gu"])  # [M, 2n (+ E)]
        g, u, logits = gu[:, :n], gu[:, n : 2 * n], gu[:, 2 * n :]
        return F.linear(F.silu(g) * u, L["mlp_down"]), logits if logits.shape[1] else None

    def route(self, L: dict, logits: torch.Tensor, ids: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """noaux_tc router (n_group 1 for Kimi-K2): the router's logits [M, E] (`post`) -> weights [M, k]
        float32, ids [M, k] int64. ids: the experts to use instead of the top-k choice (the scores and
        weights are still computed)."""
        c = self.cfg
        scores = logits.float().sigmoid()  # [M, E]
        idx = (scores + L["router_bias"]).topk(c.num_experts_per_tok, dim=-1).indices if ids is None else ids
        w = scores.gather(1, idx)
        if c.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * c.routed_scaling_factor, idx

    def routed(
        self, L: dict, x: torch.Tensor, logits: torch.Tensor, bound: int,
        overflow: torch.Tensor | None = None, ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's routed-expert partial sum [M, H] (bf16) of the normed rows x [M, H] with the router's
        logits [M, E] (`post`): `moe_w4a16` on CUDA (graph-safe routing with static launch bound `bound`
        slots per expert; `overflow` += 1 when an expert had more, whose extra slots the kernels skip),
        torch on the CPU. ids [M, k]: forced experts (`route`)."""
        w, idx = self._route_fn(logits, L["router_bias"], ids)
        rt = device_routing(idx, w, self.e0, self.n_local, bound, overflow)
        if x.device.type != "cuda":
            return self.routed_torch(L, x, rt)
        return self._routed_kernel(L, x, rt, bound)

    def _routed_kernel(self, L, x, rt: DeviceRouting, bound: int) -> torch.Tensor:
        import cupy

        views = L.get("_cupy")
        if views is None:
            views = L["_cupy"] = {n: as_cupy(t).view(cupy.uint32) for n, t in L["experts"].items()}
        return routed_kernel(x, L["experts"], rt, self.cfg.num_experts_per_tok, self.shape.expert_inter,
                             bound, cupy_packed=views)

    def routed_torch(self, L, x, rt: DeviceRouting) -> torch.Tensor:
        """The routed experts from the unpacked q / scales (`keep_unpacked`), float32 sums -> x.dtype."""
        return routed_dequantized(x, L["experts_q"], rt)

    def head_local(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + this rank's LM head rows: [M, H] -> [M, V_r] float32."""
        return F.linear(self.rms(h, self.norm, self.cfg.rms_norm_eps), self.lm_head).float()

    # ---- the verify forward's loop (RankStep and RankTarget)
    def prologue(self, table: torch.Tensor, lens: torch.Tensor, depth: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What every layer of a verify reads: RoPE cos, sin [M, rope / 2] of the rows' positions lens + depth
        and the rows' cache slots [M] (row j of stream c at table[c, lens[c] + j]); table [C, T], lens [C],
        depth [C, W]."""
        W = depth.shape[1]
        pos = (lens[:, None] + depth).reshape(-1)  # [M]
        cos, sin = rope_cos_sin(self.cfg, pos, torch.bfloat16, self.device, inv=self.rope_inv())
        slots = table.gather(1, lens[:, None] + torch.arange(W, device=self.device)[None]).reshape(-1)
        return cos, sin, slots

    def attend(self, kv: torch.Tensor, q, rows, slots, table, lens, vis, sizes, ws=None,
               plan_ready: bool = False) -> torch.Tensor:
        """One layer's latent rows [M, 576] to their slots [M] of kv [S, 576], then the tree-verify attention
        of q [M, nh, 576] over each stream's prefix (table [C, T] slots, lens [C]) and its own rows (vis
        [C, W, W], sizes [C]) -> o_lat [M, nh, kv_lora] float32. On CUDA table, lens and sizes are int32
        (the kernels' types), unchecked (graph-safe); ws: the call's workspace (`verify_workspace`), its
        plan reused with plan_ready (the layers after the first of one forward: the same lens and sizes),
        made by the first layer's call with reuse_plan (`kdlib.cuda.attention.tree_verify_attention`).
        The result is a view of ws's output, valid until the next call on ws."""
        c, nh = self.cfg, self.heads
        C, W = vis.shape[:2]
        kv.index_copy_(0, slots, rows)
        shared = ws is not None  # the first layer's plan is the later layers' (version 10: its plan kernel's)
        extra = {"validate": False, "workspace": ws, "plan_ready": plan_ready and shared,
                 "reuse_plan": shared and not plan_ready} if self.device.type == "cuda" else {}
        out, _ = ops.tree_verify_attention(
            q.view(C, W, nh, c.latent_dim), kv, table, lens, rows.view(C, W, c.latent_dim), vis, sizes,
            c.softmax_scale, kv_lora_rank=c.kv_lora_rank, **extra)
        return torch.as_tensor(out, device=self.device).reshape(C * W, nh, c.kv_lora_rank).float()

    def verify_workspace(self, streams: int, rows_per_stream: int):
        """The tree-verify attention's buffers for C x W rows (`kdlib.cuda.attention.make_workspace`, in
        torch's allocator as the calls' own were); None on the CPU (the numpy reference allocates its own)
        and where the device's bf16 pick is not a workspace version (no sm_90a: no plan to share)."""
        if self.device.type != "cuda":
            return None
        from kdlib.cuda import attention

        if attention.pick_version(None, None, "bf16") not in attention.WGMMA_VERSIONS:
            return None
        with _cupy_stream():
            return attention.make_workspace(streams, rows_per_stream, self.heads)

    def layers_forward(self, h: torch.Tensor, cos, sin, attend, bound: int, overflow: torch.Tensor | None,
                       route_ids: torch.Tensor | None = None, taps: tuple[int, ...] = (), keep=None
                       ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The decoder layers over M rows: h [M, H] (embedded) -> (h [M, H] after the last layer, {layer i:
        h [M, H] after layer i} for i in taps). attend(i, q, rows) -> o_lat: layer i's attention (`attend`
        over the caller's pool); bound / overflow: `routed`'s; route_ids [layers, >= M, k]: forced experts
        (rows [:M]), None: the router's; keep(i, x, q, rows, o_lat, f, logits): each layer's piece inputs."""
        M, out = h.shape[0], {}
        for i, L in enumerate(self.layers):
            x, q, rows = self.pre(L, h, cos, sin)
            o_lat = attend(i, q, rows)
            h, f, y, logits = self.post(L, h, o_lat)
            if logits is not None:
                ids = None if route_ids is None else route_ids[i, :M]
                y = y + self.routed(L, f, logits, bound, overflow, ids)
            if keep is not None:
                keep(i, x, q, rows, o_lat, f, logits)
            h = h + y
            if i in taps:
                out[i] = h
        return h, out


# ----------------------------------------------------------------------------- the DFlash drafter
@dataclass(frozen=True)
class DraftShape:
    """A DFlash drafter's shape (whole model; `RankDrafter` keeps a rank's slice) and where it comes from."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    source: str = ""

    def __post_init__(self):
        """ValueError naming the field (DFlashConfig.validate's checks): these failed in torch at the first
        engine step."""
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"DraftShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(f"DraftShape.block_size must be >= 2 (horizon block_size - 1), got "
                             f"{self.block_size}")
        if self.head_dim % 2:
            raise ValueError(f"DraftShape.head_dim must be even (RoPE pairs), got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"DraftShape.num_heads {self.num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")
        if not self.target_layer_ids:
            raise ValueError("DraftShape.target_layer_ids must name at least one target layer")


# z-lab/Kimi-K2.5-DFlash as published (Hugging Face; the shape from the GGUF conversion's model card,
# huggingface.co/freakyskittle/kimi-k2.5-dflash.gguf: 6 layers, hidden 7168, 64 Q / 8 KV heads,
# intermediate 18432; block size 8, target layers [1, 12, 24, 35, 47, 58] from the K2.6 DFlash-shaped
# card huggingface.co/freakyskittle/Kimi-K2.6-DFlash-baseinit). head_dim 128 is inferred: it makes the
# F32 file's ~13.9 GB (3.48 B parameters without embedding and LM head, which are the target's).
DFLASH_KIMI = DraftShape(6, 64, 8, 128, 18432, 8, (1, 12, 24, 35, 47, 58),
                         "z-lab/Kimi-K2.5-DFlash (HF): 6 layers, 64/8 heads, inter 18432, block 8; head_dim "
                         "128 inferred")


class RankDrafter:
    """A rank's slice of a DFlash drafter (module docstring); context K/V per pool slot
    [layers, S, kv_r, hd]."""

    def __init__(self, model: RankModel, ds: DraftShape, seed: int = 1):
        s, c, dev = model.shape, model.cfg, model.device
        self.model, self.ds, self.seed = model, ds, seed
        gen = torch.Generator(device=dev).manual_seed(seed)
        H, hd = c.hidden_size, ds.head_dim
        self.nh = partition(ds.num_heads, s.tp)[s.rank][1] - partition(ds.num_heads, s.tp)[s.rank][0]
        self.nkv = max(1, ds.num_kv_heads // s.tp)  # replicated when fewer KV heads than ranks
        lo, hi = partition(ds.intermediate_size, s.tp)[s.rank]
        taps = len(ds.target_layer_ids)
        flo, fhi = partition(taps * H, s.tp)[s.rank]
        self.fc_cols = (flo, fhi)
        bf = torch.bfloat16
        self.fc = _randn((H, fhi - flo), (taps * H) ** -0.5, dev, gen)  # [H, F_r] row-parallel
        self.hidden_norm = torch.ones(H, dtype=bf, device=dev)
        self.norm = torch.ones(H, dtype=bf, device=dev)
        self.layers = []
        for _ in range(ds.num_layers):
            self.layers.append(
                {
                    "in_norm": torch.ones(H, dtype=bf, device=dev),
                    "post_norm": torch.ones(H, dtype=bf, device=dev),
                    "q": _randn((self.nh * hd, H), H**-0.5, dev, gen),
                    "k": _randn((self.nkv * hd, H), H**-0.5, dev, gen),
                    "v": _randn((self.nkv * hd, H), H**-0.5, dev, gen),
                    "o": _randn((H, self.nh * hd), (ds.num_heads * hd) ** -0.5, dev, gen),
                    "q_norm": torch.ones(hd, dtype=bf, device=dev),
                    "k_norm": torch.ones(hd, dtype=bf, device=dev),
                    "gu": _randn((2 * (hi - lo), H), H**-0.5, dev, gen),
                    "down": _randn((H, hi - lo), ds.intermediate_size**-0.5, dev, gen),
                }
            )
        self.kv = None  # [layers, 2, S + 1, kv_r, hd], made by `make_pool`

    def weight_bytes(self) -> int:
        ts = [self.fc, self.hidden_norm, self.norm] + [t for L in self.layers for t in L.values()]
        return sum(t.numel() * t.element_size() for t in ts)

    @property
    def vocab_size(self) -> int:
        """V_r: the rank's vocabulary shard (what the engine's target, a `RankTarget`, has)."""
        v0, v1 = self.model.shape.vocab_range
        return v1 - v0

    @property
    def block_size(self) -> int:
        return self.ds.block_size

    def new_pool(self, slots: int) -> torch.Tensor:
        """Zeroed context K/V [layers, 2, slots, kv_r, hd] bf16."""
        ds = self.ds
        return torch.zeros(ds.num_layers, 2, slots, self.nkv, ds.head_dim, dtype=torch.bfloat16,
                           device=self.model.device)

    def make_pool(self, slots: int) -> None:
        self.kv = self.new_pool(slots)

    def make_lanes(self, target: RankTarget, lanes: int, cap: int) -> RankLanes:
        """The batched engine's per-lane drafter state (`kdlib.engine.batch._lane_drafter`'s hook)."""
        if not isinstance(target, RankTarget) or target.m is not self.model:
            raise ValueError("RankDrafter drafts for the RankTarget of the RankModel it was built on; "
                             "this target is another")
        return RankLanes(self, target, lanes, cap)

    def _rope(self, x, pos):
        hd = self.ds.head_dim
        # DFlash: rope_theta 1e6
        inv = 1e6 ** (-torch.arange(0, hd, 2, dtype=torch.float64, device=x.device) / hd)
        ang = pos.double()[:, None] * inv[None]
        return apply_rope(x, ang.cos().to(x.dtype), ang.sin().to(x.dtype), interleave=False)

    def _kv(self, L, h, pos):
        hd = self.ds.head_dim
        k = self.model.rms(F.linear(h, L["k"]).view(-1, self.nkv, hd), L["k_norm"], 1e-6)
        return self._rope(k, pos), F.linear(h, L["v"]).view(-1, self.nkv, hd)

    def draft(self, bonus: torch.Tensor, lens: torch.Tensor, table: torch.Tensor,
              pool: torch.Tensor | None = None) -> torch.Tensor:
        """bonus [C] (global ids), lens [C], table [C, T] (context slots of pool, default the drafter's) ->
        local logits [C, B - 1, V_r] float32 (depths 1..L)."""
        m, ds = self.model, self.ds
        C, T = table.shape
        B, hd, eps = ds.block_size, ds.head_dim, m.cfg.rms_norm_eps
        dev = bonus.device
        ids = torch.full((C, B), m.cfg.vocab_size - 2, dtype=torch.int64, device=dev)  # MASK: a reserved id
        ids[:, 0] = bonus
        x = m.embed_rows(ids.reshape(-1))  # [C*B, H]
        pos = (lens[:, None] + torch.arange(B, device=dev)[None]).reshape(-1)  # [C*B]
        valid = torch.arange(T, device=dev)[None] < lens[:, None]  # [C, T]
        seen = torch.cat([valid, torch.ones(C, B, dtype=torch.bool, device=dev)], 1)  # [C, T + B]
        rep = self.nh // self.nkv
        for L, kv in zip(self.layers, self.kv if pool is None else pool, strict=True):
            a = m.rms(x, L["in_norm"], eps)
            q = self._rope(m.rms(F.linear(a, L["q"]).view(-1, self.nh, hd), L["q_norm"], 1e-6), pos)
            bk, bv = self._kv(L, a, pos)
            k = torch.cat([kv[0][table], bk.view(C, B, self.nkv, hd)], 1)  # [C, T + B, kv_r, hd]
            v = torch.cat([kv[1][table], bv.view(C, B, self.nkv, hd)], 1)
            q = q.view(C, B, self.nkv, rep, hd)
            sc = torch.einsum("cbgrd,ctgd->cgrbt", q, k) * hd**-0.5  # [C, kv_r, rep, B, T + B]
            sc = sc.masked_fill(~seen[:, None, None, None, :], float("-inf"))
            p = torch.softmax(sc.float(), dim=-1).to(x.dtype)
            o = torch.einsum("cgrbt,ctgd->cbgrd", p, v).reshape(C * B, self.nh * hd)
            x = x + F.linear(o, L["o"])
            gu = F.linear(m.rms(x, L["post_norm"], eps), L["gu"])
            g, u = gu.chunk(2, dim=-1)
            x = x + F.linear(F.silu(g) * u, L["down"])
        return m.head_local(x.view(C, B, -1)[:, 1:].reshape(C * (B - 1), -1)).view(C, B - 1, -1)

    def commit(self, feats: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
               pool: torch.Tensor | None = None) -> None:
        """feats [N, taps x H] of committed rows -> their context K/V at `slots` [N] (positions `pos` [N]) of
        pool (default the drafter's)."""
        m = self.model
        f0, f1 = self.fc_cols
        # [N, H] (partial)
        h = m.rms(F.linear(feats[:, f0:f1], self.fc), self.hidden_norm, m.cfg.rms_norm_eps)
        for L, kv in zip(self.layers, self.kv if pool is None else pool, strict=True):
            k, v = self._kv(L, h, pos)
            kv[0].index_copy_(0, slots, k)
            kv[1].index_copy_(0, slots, v)


# ----------------------------------------------------------------------------- acceptance as a parameter
def draft_profile(depth: int, k: int, p_top: float) -> torch.Tensor:
    """Log-probs [depth, k] float32 of the forced-acceptance drafter: the top token p_top, the others
    sharing 1 - p_top geometrically (ratio 1/2), the same at every depth (descending rows)."""
    rest = (1 - p_top) * 0.5 ** torch.arange(1, k, dtype=torch.float64)
    rest = rest / rest.sum() * (1 - p_top) if k > 1 else rest
    row = torch.cat([torch.tensor([p_top], dtype=torch.float64), rest]).clamp(min=1e-30).log()
    return row.float().expand(depth, k).contiguous()


def forced_targets(
    tokens: torch.Tensor,
    positions: torch.Tensor,
    next_token: torch.Tensor,
    argmax: torch.Tensor,
    accepted: int,
) -> torch.Tensor:
    """The accept walk's targets [C, W] for a chosen accepted length: a row at depth < accepted - 1 names the
    token of its first child (the walk descends the first-child chain), deeper rows keep the target's argmax.

    tokens [C, W] (slot 0 = the bonus), positions [C, W] (tree depth, -1 = padding), next_token [C, W]
    (first child's slot or -1), argmax [C, W]."""
    child = tokens.gather(1, next_token.clamp(min=0))
    return torch.where((positions >= 0) & (positions < accepted - 1) & (next_token >= 0), child, argmax)


def uniform_experts(cfg: ModelConfig, rows: int, gen: torch.Generator) -> torch.Tensor:
    """[layers, rows, k] int64: per layer and row k distinct experts of cfg's, drawn uniformly (the top-k of
    uniforms on gen's device)."""
    draw = [torch.rand(rows, cfg.n_routed_experts, generator=gen, device=gen.device)
            for _ in range(cfg.num_hidden_layers)]  # [rows, E] each
    return torch.stack([u.topk(cfg.num_experts_per_tok).indices for u in draw])


# ----------------------------------------------------------------------------- modelled collectives
def allreduce_ms(nbytes: float, fit: dict, world: int) -> float:
    """NCCL ring all-reduce time of `nbytes` from a fit {latency_s, bus_bandwidth_Bps}:
    lat + 2 (W-1)/W bytes / bw."""
    return (fit["latency_s"] + 2.0 * (world - 1) / world * nbytes / fit["bus_bandwidth_Bps"]) * 1e3


def step_allreduces(
    shape: RankShape, rows: int, draft_rows: int, commit_rows: int, ds: DraftShape | None
) -> list[int]:
    """Bytes of each all-reduce of one step on a rank (bf16 hidden rows): the embedding, two per target
    layer; with a drafter its embedding, two per draft layer and its fc on the committed rows."""
    H = shape.cfg.hidden_size * 2
    out = [rows * H] * (1 + 2 * shape.cfg.num_hidden_layers)
    if ds is not None:
        out += [draft_rows * H] * (1 + 2 * ds.num_layers) + [commit_rows * H]
    return out


# ----------------------------------------------------------------------------- one step on static buffers
class RankStep:
    """Static buffers and the parts of one step for C streams at `context` cached tokens each (AR when
    drafter is None, else DDTree with `budget` nodes); slots of stream c: c * (context + W) + position.

    parts: "draft", "tree", "verify" (embed, layers, head), "accept", "commit"; `run()` runs them in order.
    `run(only=...)` with a subset of {"dense", "attention", "moe"} runs the verify forward with just those
    pieces (the others read the outputs a full forward left in place): the per-component timings."""

    PARTS = ("draft", "tree", "verify", "accept", "commit")

    def __init__(
        self,
        model: RankModel,
        streams: int,
        context: int,
        budget: int | None = None,
        drafter: RankDrafter | None = None,
        accepted: int = 4,
        p_top: float = 0.8,
        bound_factor: float = 4.0,
        pool: torch.Tensor | None = None,
        seed: int = 0,
        routing: str = "uniform",
    ):
        """routing: "uniform" — each row's experts drawn uniformly (k distinct of the model's, fixed per layer
        and row; `route_ids`), the routing a trained, balanced router has on average and the one the floors
        count; "router" — the random router's own top-k (a random network's rows drift together over the
        layers and crowd a few experts past the launch bound, whose extra slots the kernels skip)."""
        c = model.cfg
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        if int(streams) < 1 or int(context) < 0:
            raise ValueError(f"streams must be >= 1 and context >= 0, got {streams} and {context}")
        if drafter is not None:  # checked before any buffer: a bad one failed deep in torch
            if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_OPS_BUDGET:
                raise ValueError(f"a DDTree step needs budget an int in [1, {MAX_OPS_BUDGET}] (the "
                                 f"tree-verify kernels take {MAX_OPS_BUDGET + 1} rows at most), got "
                                 f"{budget!r}")
            reach = min(drafter.ds.block_size, budget + 1)  # the horizon and the bonus; a chain of the budget
            if not 1 <= int(accepted) <= reach:
                raise ValueError(f"accepted must lie in [1, {reach}]: at most block_size = "
                                 f"{drafter.ds.block_size} (the horizon and the bonus) and budget + 1 = "
                                 f"{budget + 1} (the deepest tree of the budget and the bonus), got "
                                 f"{accepted}")
        self.m, self.d, self.C, self.ctx = model, drafter, int(streams), int(context)
        dev = model.device
        self.ddtree = drafter is not None
        self.budget = int(budget) if self.ddtree else 0
        self.W = self.budget + 1 if self.ddtree else 1
        self.accepted = int(accepted) if self.ddtree else 1
        C, W = self.C, self.W
        per = self.ctx + W
        need = C * per
        if pool is None:
            pool = torch.zeros(c.num_hidden_layers, need, c.latent_dim, dtype=torch.bfloat16, device=dev)
        if pool.shape[1] < need:
            raise ValueError(f"the pool holds {pool.shape[1]} slots, {C} streams of {per} need {need}")
        self.pool = pool
        gen = torch.Generator(device=dev).manual_seed(seed)
        i64 = dict(dtype=torch.int64, device=dev)
        self.table = (torch.arange(C, **i64)[:, None] * per + torch.arange(per, **i64)[None])  # [C, ctx + W]
        # [C, ctx] the kernels' page table
        self.prefix32 = self.table[:, : self.ctx].to(torch.int32).contiguous()
        self.lens = torch.full((C,), self.ctx, **i64)
        self.lens32 = self.lens.to(torch.int32)
        self.bonus = torch.randint(0, c.vocab_size, (C,), generator=gen, device=dev)
        self.M = C * W
        self.bound = count_bound(self.M, c.num_experts_per_tok, c.n_routed_experts, bound_factor)
        self.routing = routing
        self.route_ids = None  # [layers, M, k] forced experts under "uniform"
        if routing == "uniform":
            self.route_ids = uniform_experts(c, self.M, gen)
        self.overflow = torch.zeros((), dtype=torch.int64, device=dev)
        self.tokens = self.bonus[:, None].repeat(1, W).contiguous()  # [C, W]
        self.depth = torch.zeros(C, W, **i64)
        self.vis = torch.ones(C, W, W, dtype=torch.bool, device=dev) if W == 1 else \
            torch.eye(W, dtype=torch.bool, device=dev).expand(C, W, W).contiguous()
        self.sizes32 = torch.full((C,), W, dtype=torch.int32, device=dev)
        self.ws = model.verify_workspace(C, W)  # the attention's buffers, one plan a step
        H = c.hidden_size
        self.taps = tuple(drafter.ds.target_layer_ids) if self.ddtree else ()
        self.feats = (
            torch.zeros(self.M, len(self.taps) * H, dtype=torch.bfloat16, device=dev) if self.taps else None
        )
        # per-layer outputs a part-only forward reads in place of the pieces it skips
        L = c.num_hidden_layers
        self.x_saved = torch.zeros(L, self.M, H, dtype=torch.bfloat16, device=dev)  # normed attention input
        self.q_saved = torch.zeros(
            L, self.M, model.shape.heads, c.latent_dim, dtype=torch.bfloat16, device=dev
        )
        self.rows_saved = torch.zeros(L, self.M, c.latent_dim, dtype=torch.bfloat16, device=dev)
        self.o_saved = torch.zeros(
            L, self.M, model.shape.heads, c.kv_lora_rank, dtype=torch.float32, device=dev
        )
        self.f_saved = torch.zeros(L, self.M, H, dtype=torch.bfloat16, device=dev)  # normed FFN input
        # [layers, M, E] the router's logits (MoE layers), the MoE piece's other input
        self.logits_saved = torch.zeros(L, self.M, c.n_routed_experts, dtype=torch.bfloat16, device=dev)
        self.argmax = torch.zeros(C, W, **i64)
        self.target = torch.zeros(C, W, **i64)
        self.tau = torch.ones(C, **i64)
        self.lens_next = self.lens.clone()
        if self.ddtree:
            v0, v1 = model.shape.vocab_range
            self.k = min(self.budget, v1 - v0)  # the drafter's top-K runs over the rank's shard
            self.profile = draft_profile(drafter.ds.block_size - 1, self.k, p_top).to(dev)
            self.horizon = drafter.ds.block_size - 1
            self.trees = None
            self.top_ids = torch.zeros(C, self.horizon, self.k, **i64)
            self.top_lp = self.profile.expand(C, -1, -1).contiguous()

    # ---- the parts
    def run(self, only: tuple[str, ...] | None = None, save: bool = False) -> None:
        ctx = _cupy_stream() if self.m.device.type == "cuda" else nullcontext()
        with ctx, torch.no_grad():
            if only is not None:
                self.verify(only)
                return
            for p in self.parts():
                self.verify(save=save) if p == "verify" else getattr(self, p)()

    def parts(self) -> tuple[str, ...]:
        return self.PARTS if self.ddtree else ("verify", "commit")

    def part(self, name: str) -> None:
        ctx = _cupy_stream() if self.m.device.type == "cuda" else nullcontext()
        with ctx, torch.no_grad():
            getattr(self, name)()

    def draft(self) -> None:
        held, need = 0 if self.d.kv is None else self.d.kv.shape[2], self.C * (self.ctx + self.W)
        if held < need:  # it failed as a TypeError / IndexError inside the drafter
            raise ValueError(f"the drafter's context K/V holds {held} slots, the step's table {need}: call "
                             "drafter.make_pool(slots) first")
        logits = self.d.draft(self.bonus, self.lens, self.table[:, : self.ctx])  # [C, L, V_r]
        top = torch.log_softmax(logits, dim=-1).topk(self.k, dim=-1)  # the shard's top-K (no gather modelled)
        v0 = self.m.shape.vocab_range[0]
        self.top_ids.copy_(top.indices + v0)
        self.top_lp.copy_(self.profile.expand_as(top.values))  # acceptance is a parameter (module docstring)

    def tree(self) -> None:
        dev = self.m.device
        if dev.type == "cuda":
            if self.trees is None:
                self.trees = TreeBuffers(self.C, self.budget, self.horizon, dev)
            ktree.build_tree_batch(self.top_ids, self.top_lp, self.budget, out=self.trees.cupy)
            t = self.trees
            nodes, depth, vis, nxt = t.node_token_ids, t.positions, t.visibility, t.next_token
        else:
            t = self.trees = ops.build_tree_batch(self.top_ids, self.top_lp, self.budget)
            nodes, depth, vis, nxt = (
                torch.as_tensor(x) for x in (t.node_token_ids, t.positions, t.visibility, t.next_token)
            )
        self.tokens.copy_(torch.cat([self.bonus[:, None], nodes.clamp(min=0)], dim=1))
        self.depth.copy_(depth.clamp(min=0))
        self.vis.copy_(vis)
        self.tree_depth, self.next_token = depth, nxt

    def verify(self, only: tuple[str, ...] | None = None, save: bool = False) -> None:
        """The target's forward over the C x W rows; save=True (eager, before timing) keeps each layer's
        piece inputs and outputs for the part-only forwards."""
        m, H = self.m, self.m.cfg.hidden_size
        cos, sin, slots = self.prologue()
        if only is None:  # the whole forward: the layer loop RankTarget runs too
            h, taps = m.layers_forward(
                m.embed_rows(self.tokens.reshape(-1)), cos, sin,
                lambda i, q, rows: self.attention(i, q, rows, slots), self.bound, self.overflow,
                self.route_ids, self.taps, self._save if save else None)
            for t, i in enumerate(i for i in self.taps if i in taps):  # a cut model lacks the deep taps
                self.feats[:, t * H:(t + 1) * H].copy_(taps[i])
            self.head(h)
            return
        do = only.__contains__  # the pieces named, on the inputs a saved forward left
        h = m.embed_rows(self.tokens.reshape(-1)) if do("dense") else None
        tap = 0
        for i, L in enumerate(m.layers):
            if do("dense"):
                m.pre(L, h, cos, sin)
            if do("attention"):
                self.attention(i, self.q_saved[i], self.rows_saved[i], slots)
            if do("dense"):
                h, _, y, _ = m.post(L, h, self.o_saved[i])
            if do("moe") and "router_bias" in L:
                ids = None if self.route_ids is None else self.route_ids[i]
                y = m.routed(L, self.f_saved[i], self.logits_saved[i], self.bound, self.overflow, ids)
            if do("dense"):
                h = h + y
                if i in self.taps:
                    self.feats[:, tap * H:(tap + 1) * H].copy_(h)
                    tap += 1
        if do("dense"):
            self.head(h)

    def _save(self, i, x, q, rows, o_lat, f, logits) -> None:
        """Layer i's piece inputs and outputs, kept for the part-only forwards."""
        for buf, t in ((self.x_saved, x), (self.q_saved, q), (self.rows_saved, rows), (self.o_saved, o_lat),
                       (self.f_saved, f), (self.logits_saved, logits)):
            if t is not None:  # logits: MoE layers only
                buf[i].copy_(t)

    def prologue(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What every layer of the verify reads: RoPE cos, sin [M, rope / 2] of the rows' positions and the
        rows' cache slots [M]."""
        return self.m.prologue(self.table, self.lens, self.depth)

    def head(self, h: torch.Tensor) -> None:
        """The last layer's output h [M, H] -> final norm, this rank's LM head rows, `argmax` [C, W]."""
        logits = self.m.head_local(h).view(self.C, self.W, -1)  # [C, W, V_r]; the global argmax: a gather
        self.argmax.copy_(logits.argmax(-1) + self.m.shape.vocab_range[0])

    def attention(self, i: int, q, rows, slots) -> torch.Tensor:
        """Latent rows to their slots, then the tree-verify attention -> o_lat [M, nh, kv_lora] float32; the
        attention's plan is made at layer 0 and read by the others (one step: the same lens and sizes)."""
        cuda = self.m.device.type == "cuda"
        table = self.prefix32 if cuda else self.table[:, : self.ctx]
        return self.m.attend(self.pool[i], q, rows, slots, table, self.lens32 if cuda else self.lens,
                             self.vis, self.sizes32 if cuda else self.sizes32.long(), self.ws, i > 0)

    def accept(self) -> None:
        dev = self.m.device
        self.target.copy_(
            forced_targets(
                self.tokens,
                torch.as_tensor(self.tree_depth, device=dev),
                torch.as_tensor(self.next_token, device=dev),
                self.argmax,
                self.accepted,
            )
        )
        if dev.type == "cuda":
            t = self.trees
            cuda_accept.accept_greedy_batch(t.cupy, self.target, max_depth=self.horizon, out=t.accept_cupy)
            self.paths, self.tau_dev = t.paths, t.lengths
        else:
            paths, lengths, _ = ops.accept_greedy_batch(self.trees, self.target, max_depth=self.horizon)
            self.paths, self.tau_dev = torch.as_tensor(paths), torch.as_tensor(lengths)
        self.tau.copy_(self.tau_dev)

    def commit(self) -> None:
        """Page-table tail permuted so the accepted rows come first (page_size 1: no KV bytes move),
        the drafter's context K/V of the W rows in that order, lens + tau into `lens_next`."""
        C, W, dev = self.C, self.W, self.m.device
        idx = self.lens[:, None] + torch.arange(W, device=dev)[None]  # [C, W]
        if self.ddtree:
            paths = self.paths
            key = W + torch.arange(W + 1, device=dev).expand(C, W + 1).clone()  # [C, W + 1]
            order = torch.arange(paths.shape[1], device=dev).expand_as(paths)
            key.scatter_(1, torch.where(paths >= 0, paths, W), order)
            perm = key[:, :W].argsort(dim=1, stable=True)  # [C, W]
            tail = self.table.gather(1, idx).gather(1, perm)
            self.table.scatter_(1, idx, tail)
            f = self.feats.view(C, W, -1).gather(1, perm[:, :, None].expand(C, W, self.feats.shape[-1]))
            self.d.commit(f.reshape(C * W, -1), tail.reshape(-1), idx.reshape(-1))
        self.lens_next.copy_(self.lens + self.tau)

    def allreduce_bytes(self) -> list[int]:
        ds = self.d.ds if self.ddtree else None
        return step_allreduces(self.m.shape, self.M, self.C * ds.block_size if ds else 0, self.M, ds)


# ----------------------------------------------------------------------------- the rank behind BatchEngine
class RankTarget:
    """A `RankModel` as the batched engine's target (`kdlib.engine.batch.BatchEngine`'s model interface).

    Vocabulary-parallel: the engine sees the rank's shard. `cfg` is the model's with vocab_size = V_r,
    token ids are shard-local (global id - v0), `head` gives this rank's logits [M, V_r] (`head_local`),
    so the engine's argmax, top-K and sampling run over the shard. What a real TP service adds, the
    all-gather of the logits (or an argmax across the ranks), is neither run nor modelled: one or two
    small collectives a step beside the all-reduces `step_allreduces` counts.

    forward_batch is RankStep's verify on the engine's inputs (`RankModel.layers_forward`: the latent rows
    into the pool at the rows' slots, `ops.tree_verify_attention` over the paged pool, MLP and
    `moe_w4a16`), graph-capturable on CUDA. The experts' launch bound is `count_bound` of the step's rows
    M = C x W (static per captured step, RankStep's bound at the same M); `overflow` counts the layers
    where an expert got more rows than that (whose extra slots the kernels skip).

    routing: "router" — the model's router: the target is a pure function of the tokens (DDTree == AR);
    "uniform" — per (layer, row index in the step) experts drawn uniformly once into `route_ids`
    [layers, max_rows, k], rows [:M] used by each forward: balanced experts, as a trained router gives on
    average. The outputs then depend on a row's index in its step: only the timing means something.
    prefill: "layers" — the prompt through the layers causally, in chunks of `chunk` rows through
    forward_batch (one stream, causal visibility, lens = the rows done): the same kernels as a step;
    "synthetic" — for long contexts: random latent rows at the cache's scale (c_kv at unit RMS as
    kv_a_norm leaves it, the RoPE part at unit scale), h [1, H] the embedded last token, no features
    (the drafter fills its context with random K/V) and no layers run (a step's work does not depend on
    the cached values). max_rows: the most rows a forward takes (steps: max_streams x (budget + 1))."""

    check_tokens = Model.check_tokens  # ids inside [0, cfg.vocab_size = V_r), as int64 on the device

    def __init__(self, model: RankModel, routing: str = "router", prefill: str = "layers",
                 max_rows: int = 1040, bound_factor: float = 4.0, chunk: int = PREFILL_CHUNK, seed: int = 0):
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        if prefill not in PREFILLS:
            raise ValueError(f"prefill must be one of {PREFILLS}, got {prefill!r}")
        for name, v, hi in (("max_rows", max_rows, None), ("chunk", chunk, PREFILL_CHUNK)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or (hi is not None and v > hi):
                raise ValueError(f"{name} must be an int in [1, {hi or 'inf'}], got {v!r}")
        if not bound_factor > 0:
            raise ValueError(f"bound_factor must be > 0, got {bound_factor!r}")
        self.m, self.routing, self.prefill = model, routing, prefill
        self.max_rows, self.bound_factor, self.chunk = max_rows, float(bound_factor), min(chunk, max_rows)
        self.v0, v1 = model.shape.vocab_range
        self.cfg = replace(model.cfg, vocab_size=v1 - self.v0)
        self.device, self.dtype = model.device, torch.bfloat16
        self.gen = torch.Generator(device=model.device).manual_seed(seed)
        self.route_ids = uniform_experts(model.cfg, max_rows, self.gen) if routing == "uniform" else None
        self.overflow = torch.zeros((), dtype=torch.int64, device=model.device)
        self._ws: dict = {}  # (C, W) -> the attention's workspace (`RankModel.verify_workspace`)

    @torch.no_grad()
    def forward_plain(self, token_ids, capture: tuple[int, ...] = ()):
        """The prefill: (h [P, H] ([1, H] under "synthetic"), latents [P, layers, kv_lora + rope],
        captured [P, F] | None)."""
        ids = self.check_tokens(token_ids)
        P, c, dev = ids.shape[0], self.cfg, self.device
        if self.prefill == "synthetic":
            r = c.kv_lora_rank
            lats = torch.empty(P, c.num_hidden_layers, c.latent_dim, dtype=torch.bfloat16, device=dev)
            for i in range(c.num_hidden_layers):  # one layer's draw at a time: [P, D] float32
                x = torch.randn(P, c.latent_dim, generator=self.gen, device=dev)
                x[:, :r] = F.rms_norm(x[:, :r], (r,))
                lats[:, i] = x
            return self.m.embed_rows(ids[-1:] + self.v0), lats, None
        kv = torch.zeros(c.num_hidden_layers, P, c.latent_dim, dtype=torch.bfloat16, device=dev)  # slot = pos
        table = torch.arange(P, device=dev)[None]  # [1, P]
        hs, fs = [], []
        with _cupy_stream() if dev.type == "cuda" else nullcontext():
            for s in range(0, P, self.chunk):
                w = min(self.chunk, P - s)
                vis = torch.ones(w, w, dtype=torch.bool, device=dev).tril()[None]  # [1, w, w] causal
                h, f = self.forward_batch(kv, table, torch.tensor([s], device=dev), ids[None, s:s + w],
                                          torch.arange(w, device=dev)[None], vis, capture,
                                          keep_workspace=False)
                hs.append(h)
                fs.append(f)
        return torch.cat(hs), kv.transpose(0, 1), torch.cat(fs) if capture else None

    @torch.no_grad()
    def logits(self, token_ids) -> torch.Tensor:
        """[P, V_r] float32 logits of the prompt (prefill "layers" only)."""
        if self.prefill == "synthetic":
            raise ValueError("RankTarget(prefill='synthetic') runs no layers over the prompt: no logits")
        return self.head(self.forward_plain(token_ids)[0])

    @torch.no_grad()
    def forward_batch(self, kv, table, lens, token_ids, depth, visibility, capture: tuple[int, ...] = (), *,
                      keep_workspace: bool = True):
        """`Model.forward_batch`'s contract (C streams x W rows over the paged pool kv [layers, S, 576]):
        -> (h [C*W, H], captured [C*W, F] | None); token ids shard-local. keep_workspace: the attention's
        workspace of this (C, W) is kept for the next forwards (the steps' graph-safe buffers); False:
        one for this forward alone (the prefill's chunks, whose W vary)."""
        C, W = token_ids.shape
        M, m, c = C * W, self.m, self.m.cfg
        if M > self.max_rows:
            raise ValueError(f"a forward of {C} x {W} rows exceeds RankTarget's max_rows {self.max_rows} "
                             "(make it >= max_streams x (budget + 1))")
        bad = [i for i in capture if not 0 <= i < c.num_hidden_layers]
        if bad:
            raise ValueError(f"capture layers {bad} are not decoder layers of this model")
        cos, sin, slots = m.prologue(table, lens, depth)
        i32 = torch.int32 if self.device.type == "cuda" else torch.int64  # the kernels' index type
        pt, ln = table.to(i32), lens.to(i32)
        sizes = torch.full((C,), W, dtype=i32, device=self.device)
        bound = count_bound(M, c.num_experts_per_tok, c.n_routed_experts, self.bound_factor)
        if keep_workspace and (C, W) not in self._ws:  # the first (eager) forward of a shape, before capture
            self._ws[C, W] = m.verify_workspace(C, W)
        ws = self._ws[C, W] if keep_workspace else m.verify_workspace(C, W)
        h, taps = m.layers_forward(
            m.embed_rows(token_ids.reshape(-1) + self.v0), cos, sin,
            lambda i, q, rows: m.attend(kv[i], q, rows, slots, pt, ln, visibility, sizes, ws, i > 0),
            bound, self.overflow, self.route_ids, tuple(capture))
        return h, torch.cat([taps[i] for i in capture], dim=-1) if capture else None

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """h [M, H] -> this rank's logits [M, V_r] float32."""
        return self.m.head_local(h)


class RankLanes:
    """A `RankDrafter`'s per-lane state in the batched engine (the signatures of batch's _DFlashLanes):
    context K/V of lane l's position t at slot l x cap + t of its own pool [layers, 2, lanes x cap, kv_r,
    hd]; the draft and commit are `RankDrafter.draft` / `commit` over that pool."""

    graph_safe = True

    def __init__(self, drafter: RankDrafter, target: RankTarget, lanes: int, cap: int):
        bad = [i for i in drafter.ds.target_layer_ids if not 0 <= i < target.cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"the drafter's target layers {bad} are not layers of the target")
        self.d, self.target, self.cap = drafter, target, cap
        self.capture = tuple(drafter.ds.target_layer_ids)
        self.kv = drafter.new_pool(lanes * cap)
        dev = target.device
        self.base = torch.arange(lanes, device=dev)[:, None] * cap  # [lanes, 1] each lane's first slot
        self.gen = torch.Generator(device=dev).manual_seed(drafter.seed)

    def admit(self, lane: int, prompt: list[int], feats: torch.Tensor | None, max_new: int) -> None:
        """The prompt's features [P, F] become context positions 0..P-1 of `lane`; without features
        (prefill "synthetic") random K/V at their scale: K at unit RMS a head (k_norm; RoPE keeps the
        norm), V at unit scale (unit-gain v over the normed hidden state)."""
        dev, ds, d = self.target.device, self.d.ds, self.d
        pos = torch.arange(len(prompt), device=dev)
        slots = lane * self.cap + pos
        if feats is not None:
            d.commit(feats, slots, pos, self.kv)
            return
        shape = (ds.num_layers, len(prompt), d.nkv, ds.head_dim)
        k = torch.randn(shape, generator=self.gen, device=dev)
        self.kv[:, 0, slots] = F.rms_norm(k, (ds.head_dim,)).to(self.kv.dtype)
        self.kv[:, 1, slots] = torch.randn(shape, generator=self.gen, device=dev).to(self.kv.dtype)

    def draft(self, bonus: torch.Tensor, lens: torch.Tensor, T: int) -> torch.Tensor:
        """bonus (shard-local), lens [C] -> logits [C, L, V_r] float32 (context: positions < lens)."""
        table = self.base[: bonus.shape[0]] + torch.arange(T, device=bonus.device)[None]  # [C, T]
        return self.d.draft(bonus + self.target.v0, lens, table, self.kv)

    def commit(self, lens, tokens, feats, tau) -> None:
        """feats [C, W, F] of the verify rows in accepted-path order go to positions lens + i."""
        C, W, F_ = feats.shape
        pos = lens[:, None] + torch.arange(W, device=feats.device)[None]  # [C, W]
        self.d.commit(feats.reshape(C * W, F_), (self.base[:C] + pos).reshape(-1), pos.reshape(-1), self.kv)


def _cupy_stream():
    return cupy_on_torch_stream()
