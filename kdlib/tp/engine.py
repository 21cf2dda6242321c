"""Tensor parallelism on torch.distributed (NCCL on GPUs, gloo on CPU): plain TP under the MVP engine's loop.

    comm = Comm()                                                  # after init_process_group(...)
    tp = TPModel.from_model(Model.random(cfg, seed=0), comm, moe_mode="ep")
    res = kdlib.engine.generate(tp, prompt_ids, 64, method="ddtree", drafter=d, budget=32)  # rank-invariant

    spawn(worker, world=2, backend="gloo")                         # worker(rank, world, device, *args)

Layout per rank r of W (contiguous, near-equal ranges from `partition`; uneven splits allowed):

  * attention (plain TP, models-hardware.md §2.2): the heads are split. q_proj / q_b_proj and
    kv_b_proj keep this rank's head rows, o_proj its head columns; q_a_proj and kv_a_proj_with_mqa
    are replicated, so every rank computes the same latent rows and holds the **full** latent cache
    (a replicated `LatentCache`). The o_proj partial sums are all-reduced (one per layer).
  * FFN: dense layers and the shared expert(s) slice the intermediate dimension (gate/up rows,
    down columns). Routed experts: `moe_mode="ep"` gives each rank whole experts (expert parallel),
    `"tp"` slices every expert like the dense MLP. The router is replicated. The layer's partial
    FFN output is all-reduced once (so: two all-reduces per layer, after attention and after MoE).
  * embedding: replicated (a lookup; a vocab-parallel embedding would add a third all-reduce).
  * LM head: vocab-parallel, `lm_head.weight` holds this rank's vocabulary rows [v0, v1).
    `greedy` takes the global argmax from gathered (max, id) pairs; `head` gathers dense logits
    (sampling at T > 0, checks and the noisy-oracle study drafter).
  * drafter: replicated; its logits come out of the target's `lm_head.weight`, i.e. this rank's
    vocabulary shard. `draft_topk` (`vocab_parallel_topk`) gathers per rank the top-K (log-prob numerator, id)
    pairs and the shard's logsumexp, and forms the global top-K log-probs over the full vocabulary
    (SGLang's `_topk_from_vocab_parallel_head` scheme, ddtree-survey.md §2.6 and §8 item 3): the
    traffic is W x L x (2K + 1) numbers instead of L x V.
  * tree: built identically on every rank, not built once and broadcast. Its inputs (the gathered
    top-K) are bit-identical on every rank and the builder is deterministic, so the copies agree
    with no communication. A broadcast would put one more collective on every step's critical
    path while the other ranks sit idle during the build anyway; nothing is saved by building once.
    `generate(..., debug=True)` asserts the agreement (tree fields, accepted paths).

The decode loop is `kdlib.engine.generate`'s, the one of a single process: TPModel only overrides
its hooks (`greedy`, `draft_topk`, `head`, `begin_decode`, `assert_replicated`).

Every all-reduce returns the same bits on every rank (gloo and NCCL's ring and tree reduce each
chunk once, then distribute it), so hidden states, argmaxes, trees and accepted paths agree across
ranks (the checks assert it); reduction order differs from one GPU, so TP logits equal the
single-process ones within fp32 rounding, not bit for bit. In bfloat16 each rank's partial sum is
rounded to bf16 where it is made (o_proj, expert and MLP outputs), so TP greedy tokens may part
from one GPU's (DDTree still equals AR on the same TP numerics); reducing in float32 does not
change that, the rounding happens before the collective.

At T > 0 the draws read the gathered dense logits (V per verified row, not vocab-parallel) and
the seeded uniforms, both identical on every rank, so the ranks draw the same tokens.

Not here: DP-attention and decode context parallel (the cache is replicated), vocab-parallel
sampling, loading a checkpoint shard by shard (`from_model` slices a full model held by every rank).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from kdlib.engine.model import MLP, MLAttention, Model, MoE, RMSNorm, upcast

MOE_MODES = ("ep", "tp")
BACKENDS = ("gloo", "nccl")
# NVLink multicast (NVLS) stays off on every path that sets NCCL's environment (workbook rule).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# A collective that waits longer than this raises instead of hanging (a dead peer in a test).
DEFAULT_TIMEOUT_S = 120


# ----------------------------------------------------------------------------- process group
def partition(n: int, world: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of n items over `world` ranks: contiguous, the first n % world ranks get one more."""
    if world < 1 or n < world:
        raise ValueError(f"cannot split {n} items over {world} ranks (every rank needs at least one)")
    q, rem = divmod(n, world)
    out, lo = [], 0
    for r in range(world):
        hi = lo + q + (r < rem)
        out.append((lo, hi))
        lo = hi
    return out


def check_tp_config(cfg, world: int, moe_mode: str = "ep") -> None:
    """ValueError naming the dimension that cannot be split over `world` ranks (before any work)."""
    if moe_mode not in MOE_MODES:
        raise ValueError(f"moe_mode must be one of {MOE_MODES}, got {moe_mode!r}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world size must be an int >= 1, got {world!r}")
    dims = {"num_attention_heads": cfg.num_attention_heads, "vocab_size": cfg.vocab_size}
    if cfg.first_k_dense_replace:
        dims["intermediate_size"] = cfg.intermediate_size
    if cfg.first_k_dense_replace < cfg.num_hidden_layers:
        if cfg.n_shared_experts:
            dims["moe_intermediate_size x n_shared_experts"] = (
                cfg.moe_intermediate_size * cfg.n_shared_experts
            )
        dims["n_routed_experts" if moe_mode == "ep" else "moe_intermediate_size"] = (
            cfg.n_routed_experts if moe_mode == "ep" else cfg.moe_intermediate_size)
    for name, n in dims.items():
        if n < world:
            raise ValueError(f"{name} ({n}) cannot be split over {world} ranks (every rank needs at least "
                             "one)")


def set_nccl_env() -> None:
    """Force NVLink multicast off (NCCL NVLS, torch symmetric memory, NVSHMEM)."""
    os.environ.update(NCCL_ENV)


def init_process_group(
    rank: int,
    world: int,
    *,
    backend: str = "gloo",
    port: int,
    master_addr: str = "127.0.0.1",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> torch.device:
    """Join a TCP rendezvous at master_addr:port; returns this rank's device (cuda:rank for NCCL)."""
    import datetime

    import torch.distributed as dist

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    set_nccl_env()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(port)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    kw = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s), **kw
    )
    return device


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world, backend, port, timeout_s, args):
    import torch.distributed as dist

    if backend == "gloo":  # W ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    else:  # fp32 matmuls stay fp32 (no TF32), so fp32 checks keep their tolerance
        torch.backends.cuda.matmul.allow_tf32 = False
    device = init_process_group(rank, world, backend=backend, port=port, timeout_s=timeout_s)
    try:
        fn(rank, world, device, *args)
    finally:
        dist.destroy_process_group()


def spawn(
    fn, world: int, args: tuple = (), *, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S
) -> None:
    """Run fn(rank, world, device, *args) on `world` fresh processes joined by a process group.

    fn must be importable (a module-level function). A child's exception is re-raised here (the
    other children are terminated); collectives time out after timeout_s, and the whole run is
    killed with TimeoutError after timeout_s + 60 s (process start and imports), so nothing hangs.
    """
    import torch.multiprocessing as mp

    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1 (the number of ranks), got {world!r}")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ValueError(f"world {world} needs {world} GPUs, {torch.cuda.device_count()} visible")
    ctx = mp.start_processes(_entry, args=(fn, world, backend, free_port(), timeout_s, args), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s + 60
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"tensor-parallel run of {world} ranks stopped at its deadline, "
                               f"{timeout_s + 60:.0f} s (timeout_s + 60): a longer run needs a larger "
                               "timeout_s")


class Comm:
    """The process group's collectives with call/byte/time counters.

    With `timed=True` each collective is bracketed by device synchronisations, so `seconds` is the
    collective's wall time including the wait for the slowest rank (load imbalance shows here).
    """

    KINDS = ("all_reduce", "all_gather")

    def __init__(self, group=None, timed: bool = False):
        import torch.distributed as dist

        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        # where collective buffers must live: NCCL moves CUDA tensors only
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.timed = timed
        self.reset()

    def reset(self) -> None:
        self.calls = dict.fromkeys(self.KINDS, 0)
        self.bytes = dict.fromkeys(self.KINDS, 0)
        self.seconds = dict.fromkeys(self.KINDS, 0.0)

    def stats(self) -> dict:
        return {
            k: {"calls": self.calls[k], "bytes": self.bytes[k], "ms": self.seconds[k] * 1e3}
            for k in self.KINDS
        }

    def _run(self, kind, x, op):
        self.calls[kind] += 1
        self.bytes[kind] += x.numel() * x.element_size()
        if not self.timed:
            return op()
        sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        out = op()
        sync()
        self.seconds[kind] += time.perf_counter() - t0
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, identical bits on every rank: in place where x is contiguous (the caller's
        tensor is overwritten), else on a contiguous copy."""
        import torch.distributed as dist

        if self.world == 1:
            return x
        x = x.contiguous()
        return self._run("all_reduce", x, lambda: (dist.all_reduce(x, group=self.group), x)[1])

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[W, *x.shape]: every rank's x, in rank order (shapes must agree across ranks)."""
        import torch.distributed as dist

        if self.world == 1:
            return x[None]
        x = x.contiguous()

        def op():
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x, group=self.group)
            return torch.stack(parts)

        return self._run("all_gather", x, op)


# ----------------------------------------------------------------------------- sharded modules
class TPAttention(MLAttention):
    """MLA over this rank's heads (a local config with num_attention_heads = its head count); the
    latent projection is replicated. Both forms end in the all-reduce of the o_proj partial sums."""

    def __init__(self, cfg, heads: tuple[int, int], comm: Comm):
        super().__init__(replace(cfg, num_attention_heads=heads[1] - heads[0]))
        self.heads, self.comm = heads, comm

    def forward_plain(self, x, cos, sin):
        out, lat = super().forward_plain(x, cos, sin)
        return self.comm.all_reduce(out), lat

    def forward_absorbed(self, x, cos, sin, keys, mask):
        return self.comm.all_reduce(super().forward_absorbed(x, cos, sin, keys, mask))

    def forward_absorbed_ops(self, *args, **kwargs):
        """The engine's `kdlib.ops` attention form (Model.attention == "ops") over this rank's heads."""
        return self.comm.all_reduce(super().forward_absorbed_ops(*args, **kwargs))


class TPMoE(MoE):
    """Routed experts (whole, `ep`, or sliced, `tp`) + sliced shared expert; returns this rank's partial sum.

    The engine's MoE paths over this rank's experts: for "gather" and "dense" the other ranks'
    experts get routing weight 0 (an exact zero in the ascending-expert sum) and a clamped local id;
    "loop" visits the local experts in use only."""

    def __init__(self, cfg, rank: int, world: int, moe_mode: str):
        inter = cfg.moe_intermediate_size
        lo, hi = partition(inter * cfg.n_shared_experts, world)[rank] if cfg.n_shared_experts else (0, 0)
        if moe_mode == "ep":
            expert_range = partition(cfg.n_routed_experts, world)[rank]
            super().__init__(cfg, n_experts=expert_range[1] - expert_range[0], shared_inter=hi - lo)
        else:
            expert_range = (0, cfg.n_routed_experts)
            ilo, ihi = partition(inter, world)[rank]
            super().__init__(cfg, inter=ihi - ilo, shared_inter=hi - lo)
        self.expert_range = expert_range

    def quantize_int4(self) -> None:
        raise ValueError("INT4 experts are not supported under kdlib.tp (its MoE paths are the float ones); "
                         "quantize a one-process Model")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = self.gate(x)  # [T, k] each, identical on every rank
        lo, hi = self.expert_range
        path = self.path(x.shape[0])
        if path == "loop":
            out = torch.zeros_like(x)
            for e in torch.unique(idx).tolist():
                if lo <= e < hi:
                    rows, slot = torch.where(idx == e)
                    out.index_add_(0, rows, self.experts[e - lo](x[rows]) * w[rows, slot, None].to(x.dtype))
        else:
            local = (idx >= lo) & (idx < hi)
            out = self._routed_vectorised(x, torch.where(local, w, torch.zeros_like(w)),
                                          (idx - lo).clamp(0, hi - lo - 1), path)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class TPDecoderLayer(nn.Module):
    """The engine's DecoderLayer interface (self_attn, input_layernorm, ffn) over sharded modules."""

    def __init__(self, cfg, index: int, comm: Comm, moe_mode: str):
        super().__init__()
        self.comm = comm
        r, w = comm.rank, comm.world
        self.self_attn = TPAttention(cfg, partition(cfg.num_attention_heads, w)[r], comm)
        if index >= cfg.first_k_dense_replace:
            self.mlp = TPMoE(cfg, r, w, moe_mode)
        else:
            lo, hi = partition(cfg.intermediate_size, w)[r]
            self.mlp = MLP(cfg.hidden_size, hi - lo)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.comm.all_reduce(self.mlp(self.post_attention_layernorm(h)))


def shard_state_dict(sd: dict, cfg, rank: int, world: int, moe_mode: str) -> dict:
    """Slice a full model's state dict (HF names) into rank `rank`'s TPModel state dict.

    Routed expert e of an `ep` shard is renamed to its local index e - e0. `lm_head.weight` is this
    rank's vocabulary rows (from the embedding when the config ties them).
    """
    check_tp_config(cfg, world, moe_mode)
    h0, h1 = partition(cfg.num_attention_heads, world)[rank]
    qk, nv, v = cfg.qk_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.v_head_dim

    def sl(lo, hi, axis):
        return (lambda t: t[lo:hi] if axis == 0 else t[:, lo:hi])

    def mlp_rule(n):
        lo, hi = partition(n, world)[rank]
        return {"gate_proj": sl(lo, hi, 0), "up_proj": sl(lo, hi, 0), "down_proj": sl(lo, hi, 1)}

    attn = {"q_proj": sl(h0 * qk, h1 * qk, 0), "q_b_proj": sl(h0 * qk, h1 * qk, 0),
            "kv_b_proj": sl(h0 * nv, h1 * nv, 0), "o_proj": sl(h0 * v, h1 * v, 1)}
    # only the kinds of layer the config has: a dimension it leaves unused need not split (check_tp_config)
    moe_layers = cfg.first_k_dense_replace < cfg.num_hidden_layers
    dense = mlp_rule(cfg.intermediate_size) if cfg.first_k_dense_replace else {}
    shared_width = cfg.moe_intermediate_size * cfg.n_shared_experts
    shared = mlp_rule(shared_width) if moe_layers and shared_width else {}
    sliced_expert = mlp_rule(cfg.moe_intermediate_size) if moe_layers and moe_mode == "tp" else {}
    e0, e1 = partition(cfg.n_routed_experts, world)[rank] if moe_mode == "ep" else (0, cfg.n_routed_experts)
    v0, v1 = partition(cfg.vocab_size, world)[rank]

    out = {}
    for name, t in sd.items():
        p = name.split(".")
        if name == "lm_head.weight":
            continue
        if len(p) >= 6 and p[3] == "self_attn" and p[4] in attn:
            t = attn[p[4]](t)
        elif len(p) == 6 and p[3] == "mlp" and p[4] in dense:  # dense layer MLP
            t = dense[p[4]](t)
        elif len(p) >= 6 and p[3:5] == ["mlp", "shared_experts"]:
            t = shared[p[5]](t)
        elif len(p) >= 7 and p[3:5] == ["mlp", "experts"]:
            e = int(p[5])
            if not e0 <= e < e1:
                continue
            if moe_mode == "ep":
                name = ".".join(p[:5] + [str(e - e0)] + p[6:])
            else:
                t = sliced_expert[p[6]](t)
        out[name] = t.clone()
    head = sd["model.embed_tokens.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
    out["lm_head.weight"] = head[v0:v1].clone()
    return out


class TPModel(Model):
    """One rank's shard of `kdlib.engine.Model`; Model's forwards (plain, prefill, cached) run
    unchanged over the sharded layers, which all-reduce internally. `cfg` is the full config."""

    def __init__(self, cfg, comm: Comm, moe_mode: str = "ep", attention: str = "torch"):
        check_tp_config(cfg, comm.world, moe_mode)
        nn.Module.__init__(self)  # not Model.__init__: that would build the full, unsharded layers
        self.cfg, self.comm, self.moe_mode = cfg, comm, moe_mode
        self.attention = attention  # Model's decode/verify attention form ("torch" or "ops")
        self.model = nn.Module()  # the Backbone's attribute names, sharded layers
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(
            TPDecoderLayer(cfg, i, comm, moe_mode) for i in range(cfg.num_hidden_layers)
        )
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.vocab_range = partition(cfg.vocab_size, comm.world)[comm.rank]
        self.lm_head = nn.Linear(cfg.hidden_size, self.vocab_range[1] - self.vocab_range[0], bias=False)

    @classmethod
    def from_model(cls, model: Model, comm: Comm, moe_mode: str = "ep", device=None, dtype=None) -> TPModel:
        """This rank's shard of a full model (every rank passes the same weights); same attention form."""
        if any(getattr(layer.mlp, "int4", None) is not None for layer in model.model.layers):
            raise ValueError("INT4 experts are not supported under kdlib.tp (its MoE paths are the float "
                             "ones): pass the model before quantize_experts_int4")
        tp = cls(model.cfg, comm, moe_mode, attention=getattr(model, "attention", "torch"))
        tp.load_state_dict(shard_state_dict(model.state_dict(), model.cfg, comm.rank, comm.world, moe_mode))
        return tp.to(device=device or model.device, dtype=dtype or model.dtype).eval()

    @classmethod
    def random(cls, cfg, comm: Comm, seed: int = 0, moe_mode: str = "ep", dtype=None, device=None) -> TPModel:
        """This rank's shard of `Model.random(cfg, seed)` (the same weights on every rank)."""
        return cls.from_model(Model.random(cfg, seed=seed, dtype=dtype, device=device), comm, moe_mode)

    @classmethod
    def from_pretrained(cls, path, comm: Comm, moe_mode: str = "ep", dtype=None, device=None) -> TPModel:
        """Load the full HF checkpoint on this rank, then keep its shard (fine for small models only)."""
        return cls.from_model(Model.from_pretrained(path, dtype=dtype, device=device), comm, moe_mode)

    def head_local(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + this rank's LM head rows: h [T, H] -> logits [T, v1 - v0], float32 or wider."""
        return upcast(F.linear(self.model.norm(h), self.lm_head.weight))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Dense logits [T, V] gathered from every rank (checks and study drafters; decoding uses
        `greedy`)."""
        ranges = partition(self.cfg.vocab_size, self.comm.world)
        width = max(hi - lo for lo, hi in ranges)  # shards differ by at most one row: pad to one width
        local = self.head_local(h)
        local = F.pad(local, (0, width - local.shape[-1]), value=float("-inf"))
        parts = self.comm.all_gather(local)  # [W, T, width]
        return torch.cat([parts[r, :, : hi - lo] for r, (lo, hi) in enumerate(ranges)], dim=-1)

    def forward_batch(self, *args, **kwargs):
        raise ValueError("the batched engine (kdlib.engine.batch) runs one-process Models; kdlib.tp runs "
                         "one stream (kdlib.engine.generate)")

    # ---- the decode loop's hooks (kdlib.engine.generate; Model has the one-process forms)
    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """[T] int64 global argmax over the full vocabulary from gathered per-shard (max, id) pairs."""
        return vocab_parallel_argmax(self.head_local(h), self.vocab_range[0], self.comm)

    def draft_topk(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafter logits -> (ids [L, k], full-vocabulary log-probs [L, k]) by `vocab_parallel_topk`.

        Drafters that read the target's `lm_head.weight` give this rank's shard [L, V_r]; dense
        [L, V] ones (tied heads, the noisy oracle) are sliced to it."""
        v0, v1 = self.vocab_range
        if logits.shape[-1] == self.cfg.vocab_size and v1 - v0 != self.cfg.vocab_size:
            logits = logits[:, v0:v1]
        elif logits.shape[-1] != v1 - v0:
            raise ValueError(f"drafter logits of width {logits.shape[-1]}: expected {v1 - v0} (shard) or "
                             f"{self.cfg.vocab_size} (dense)")
        return vocab_parallel_topk(logits, v0, k, self.comm)

    def begin_decode(self) -> None:
        """From here on `comm` counts the decode steps' collectives only (prefill and drafter set-up
        excluded)."""
        self.comm.reset()

    def assert_replicated(self, **tensors) -> None:
        """RuntimeError naming the first tensor whose bits differ between rank 0 and another rank."""
        assert_replicated(self.comm, **tensors)


# ----------------------------------------------------------------------------- vocab-parallel selection
def vocab_parallel_argmax(local: torch.Tensor, v0: int, comm: Comm) -> torch.Tensor:
    """Global argmax [T] int64 of logits split by vocabulary: local [T, V_r] holds ids v0 .. v0+V_r-1.

    Each rank sends its (max, id) pair per row; ties go to the lower id, as `torch.argmax` on the
    dense row (shards are in rank order, and `argmax` over ranks keeps the first maximum).
    """
    vals, idx = local.max(dim=-1)  # [T]
    g_vals = comm.all_gather(vals)  # [W, T], in the logits' own dtype: a float64 model's maxima stay whole
    g_ids = comm.all_gather(idx + v0)  # [W, T]
    best = g_vals.argmax(dim=0)  # [T]
    return g_ids.gather(0, best[None])[0]


def vocab_parallel_topk(
    local: torch.Tensor, v0: int, k: int, comm: Comm
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k of log_softmax over a vocabulary split across ranks, from (score, id) pairs.

    local [L, V_r] float logits of ids v0 .. v0+V_r-1. Each rank gathers its top-min(k, V_r)
    (logit, id) pairs (padded to k with (-inf, an id past every real one), so that a real -inf logit wins
    the tie and k <= V never returns padding) and its shard's logsumexp; the global log-partition
    is the logsumexp of the gathered ones. Returns (ids [L, k] int64, log-probs [L, k] float32),
    best first, ties to the lower id; bit-identical on every rank (same gathered inputs, same ops).
    """
    L, width = local.shape
    x = local.float()
    kl = min(k, width)
    pad = torch.iinfo(torch.int64).max  # the padding's id, past every real one: it loses every tie
    # a stable sort, not topk: which of equal logits topk keeps is unspecified, and a tie across the
    # k-th place must keep the lower ids for the merge below to give them
    top = torch.sort(x, dim=-1, descending=True, stable=True)
    vals = torch.full((L, k), float("-inf"), device=x.device)  # [L, k]
    ids = torch.full((L, k), pad, dtype=torch.int64, device=x.device)  # [L, k]
    vals[:, :kl], ids[:, :kl] = top.values[:, :kl], top.indices[:, :kl] + v0
    g_vals, g_ids = comm.all_gather(vals), comm.all_gather(ids)  # [W, L, k]
    lse = torch.logsumexp(comm.all_gather(torch.logsumexp(x, dim=-1)), dim=0)  # [L]
    cand_vals = g_vals.permute(1, 0, 2).reshape(L, -1)  # [L, W*k]
    cand_ids = g_ids.permute(1, 0, 2).reshape(L, -1)
    by_id = cand_ids.argsort(dim=-1, stable=True)  # ids ascending, then a stable sort by score
    cand_vals, cand_ids = cand_vals.gather(-1, by_id), cand_ids.gather(-1, by_id)
    order = cand_vals.argsort(dim=-1, descending=True, stable=True)[:, :k]
    return cand_ids.gather(-1, order), cand_vals.gather(-1, order) - lse[:, None]


_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)


def assert_replicated(comm: Comm, **tensors) -> None:
    """RuntimeError naming the first tensor whose dtype, shape or bits differ between rank 0 and another
    rank (the shapes are compared first: a byte count that differs cannot be gathered)."""
    for name, t in tensors.items():
        t = torch.as_tensor(t).to(comm.device)
        code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1
        head = torch.full((67,), -2, dtype=torch.int64, device=comm.device)  # dtype, its size, ndim, dims
        head[:3] = torch.tensor([code, t.element_size(), t.dim()])  # the size parts the unlisted dtypes
        head[3:3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        heads = comm.all_gather(head)  # [W, 67]
        bad = [r for r in range(comm.world) if not torch.equal(heads[r], heads[0])]
        if bad:
            raise RuntimeError(f"{name}: the dtype or shape differs between rank 0 and rank(s) {bad} (rank "
                               f"{comm.rank}'s: {t.dtype} {tuple(t.shape)})")
        flat = t.contiguous().reshape(-1)  # 1-D with unit stride: empty and 0-d tensors included
        raw = flat.view(torch.uint8) if t.dtype != torch.bool else flat.to(torch.uint8)
        got = comm.all_gather(raw)  # [W, bytes]
        bad = [r for r in range(comm.world) if not torch.equal(got[r], got[0])]
        if bad:
            raise RuntimeError(f"{name} differs between rank 0 and rank(s) {bad}")
