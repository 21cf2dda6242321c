"""The estimator's inputs: every assumption a named parameter with its unit and source.

    a = Assumptions()                          # defaults, each with .source
    a.moe_bw_eff.value, a.moe_bw_eff.source
    a2 = a.with_(moe_bw_eff=(0.62, "calibrated: data/results/moe.h200.json"))
    shape = ModelShape()                       # Kimi-K2 at TP8 (data/configs/kimi-k2.6.json)
    Scenario(concurrency=4, q_len=33, block=16, accepted=12.0, context=4096)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from kdlib.config import ModelConfig

# The shipped config (data/configs/) whose shapes are ModelShape()'s defaults (test_estimator checks).
SHAPE_CONFIG = "kimi-k2.6"


@dataclass(frozen=True)
class Param:
    """One assumption: value, unit, and where it comes from ([U] = unverified, an assumption)."""

    value: float
    unit: str
    source: str

    def __post_init__(self):
        if isinstance(self.value, bool) or not isinstance(self.value, int | float) \
                or not math.isfinite(self.value):
            raise ValueError(f"Param value must be a finite number, got {self.value!r}")
        if not self.source:
            raise ValueError("every Param needs a source")


def _p(value, unit, source):
    return field(default_factory=lambda: Param(value, unit, source))


@dataclass(frozen=True)
class Assumptions:
    """Efficiencies, latencies and host costs the step-time model needs (hardware peaks come from
    `data/hw/` through `kdlib.hw`; model shapes from `ModelShape`)."""

    moe_bw_eff: Param = _p(
        0.70, "fraction of HBM peak",
        "W4A16 MoE weight streaming: the seeds' Marlin at 67-73% of the PRO 6000 peak (seed article "
        "“The Three Acts of Engineering”: '67-73% of the 1.8 TB/s'); 70-85% of copy bandwidth assumed "
        "reachable on other GPUs [U]")
    moe_compute_eff: Param = _p(
        0.35, "fraction of dense bf16 peak",
        "W4A16 plateau on mma.sync with in-register dequant: Marlin ~141 TFLOP/s "
        "(vllm-project/vllm PR #2497; GPU unstated, taken as an A100 of ~312: 45%) and "
        "'not yet optimized for Hopper' (IST-DASLab/marlin README) [U]")
    moe_layer_latency_s: Param = _p(
        15e-6, "s per MoE layer",
        "router top-k, sort, two grouped-GEMM launches, combine: ~5 kernels x ~3 us "
        "(the 3 us constant latency of AIConfigurator's system YAMLs (ai-dynamo/aiconfigurator)) [U]")
    moe_per_expert_latency_s: Param = _p(
        0.0, "s per touched expert per MoE layer",
        "grouped MoE kernels launch once per layer (0 here); an expert loop, as the MVP engine's PyTorch "
        "MoE, pays launches per touched expert: calibrated from the engine's verify-forward sweep")
    dense_bw_eff: Param = _p(
        0.80, "fraction of HBM peak",
        "bf16 GEMV-like weight streaming (attention projections, shared expert, dense layer, lm_head): "
        "mem_bw_empirical_scaling_factor 0.8 of AIConfigurator's system YAMLs (ai-dynamo/aiconfigurator)")
    dense_compute_eff: Param = _p(
        0.80, "fraction of dense bf16 peak",
        "cuBLAS bf16 GEMM ~790 of 989 TFLOP/s on an H200 (design/reference/kernels-perf.md); calibration "
        "takes the bf16 matmul rate of the ceilings suite's record instead")
    attn_bw_eff: Param = _p(
        0.85, "fraction of HBM peak",
        "FlashMLA memory-bound decode 84-90% of peak on H800/H100 (deepseek-ai/FlashMLA README) [U here]")
    attn_compute_eff: Param = _p(
        0.70, "fraction of dense bf16 peak",
        "FlashMLA compute-bound ~75-80% of tensor peak; FlashInfer MLA 72-73% on the H200 at h = 64/128 "
        "(deepseek-ai/FlashMLA README; FlashInfer's MLA benchmarks) [U here]")
    kernels_per_layer: Param = _p(
        12.0, "kernels per layer",
        "a layer's kernels besides its MoE's (whose launches moe_layer_latency_s carries), "
        "assumed for a fused serving stack; the batched engine's count per step is recorded as "
        "kernels_per_step in data/results/engine_batch.h200.json where measured [U]")
    kernel_latency_s: Param = _p(
        3e-6, "s per kernel",
        "fixed cost of a small kernel inside a CUDA graph: AIConfigurator's 3 us constant latency "
        "(AIConfigurator's system YAMLs (ai-dynamo/aiconfigurator)) [U]")
    allreduces_per_layer: Param = _p(
        2.0, "collectives per layer",
        "TP all-reduce after attention and after the MoE (the split kdlib.tp implements)")
    allreduce_latency_nvlink_s: Param = _p(
        10e-6, "s per collective",
        "10 us p2p latency of AIConfigurator's system YAMLs (ai-dynamo/aiconfigurator); "
        "data/hw gives none [U]")
    allreduce_latency_pcie_s: Param = _p(
        30e-6, "s per collective",
        "PCIe-only 8-GPU all-reduce latency, ~3x NVLink: 'the all-reduce latency term is much larger "
        "than on NVLink systems' (PCIe Gen5 x16 only: interconnect source of data/hw/rtx-pro-6000.json) [U]")
    allreduce_bw_eff: Param = _p(
        0.7, "fraction of link bandwidth",
        "ring all-reduce bus efficiency of NCCL on small messages [U]")
    draft_layers: Param = _p(
        1.0, "layers",
        "DFlash-style block drafter: a few target-width layers conditioned on target features; "
        "one layer assumed (DDTree survey; drafter size not given in the seeds) [U]")
    draft_layer_params: Param = _p(
        0.5e9, "parameters per draft layer",
        "one Kimi-K2-width dense layer: MLA projections ~0.1 B + dense MLP 3 x 7168 x 18432 = 0.4 B "
        "(hidden_size and intermediate_size of data/configs/kimi-k2.6.json) [U]")
    draft_host_s: Param = _p(
        0.2e-3, "s per draft call",
        "host-side cost of one drafter call (sampling the block's top-K, feature hand-off) [U]")
    tree_build_cpu_s_per_request: Param = _p(
        0.27e-3, "s per request",
        "CPU heapq builder: 17.4 ms at batch 64 on a 2-core machine (before calibration; the GPU "
        "host's tree_build of data/results/kernels.h200.json replaces it); seeds: 6-21 ms at batch 64")
    tree_build_gpu_s: Param = _p(
        41e-6, "s per step",
        "GPU DDTree builder inside a CUDA graph: 40.8 us at batch 64, 37.7 us at batch 1 "
        "(before calibration; tree_build of data/results/kernels.h200.json replaces it)")
    dispatch_s: Param = _p(
        0.5e-3, "s per step",
        "host dispatch of one verify step with CUDA graphs in a native loop (sampling, accept, "
        "bookkeeping) [U]; the seeds' Python stack carried ~12.5 ms of overhead in total "
        "(seed article “The Three Acts of Engineering”)")
    kv_bytes_per_elem: Param = _p(
        2.0, "bytes",
        "bf16 MLA latent cache: 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 B = 70,272 B/token "
        "(data/configs/kimi-k2.6.json; kdlib.memory)")

    def __post_init__(self):
        for name in self.names():
            v = self.v(name)
            if name.endswith("_eff"):  # a fraction of a peak: a percentage (85) would beat the floor
                if not 0 < v <= 1:
                    raise ValueError(f"assumption {name} is a fraction of a peak, in (0, 1]; got {v!r}")
            elif v < 0:
                raise ValueError(f"assumption {name} must be >= 0, got {v!r}")

    def names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)]

    def v(self, name: str) -> float:
        """The value of parameter `name`."""
        return getattr(self, name).value

    def with_(self, **changes) -> Assumptions:
        """A copy with some parameters replaced; each change is a Param or (value, source)."""
        out = {}
        for name, change in changes.items():
            if name not in self.names():
                raise ValueError(f"unknown assumption {name!r}; known: {', '.join(self.names())}")
            if isinstance(change, Param):
                out[name] = change
            else:
                value, source = change
                out[name] = Param(float(value), getattr(self, name).unit, source)
        return dataclasses.replace(self, **out)

    def scaled(self, name: str, factor: float) -> Assumptions:
        p = getattr(self, name)
        return self.with_(**{name: Param(p.value * factor, p.unit, f"{p.source} (x{factor:g})")})

    def table(self) -> list[dict]:
        return [{"name": n, "value": getattr(self, n).value, "unit": getattr(self, n).unit,
                 "source": getattr(self, n).source} for n in self.names()]


@dataclass(frozen=True)
class ModelShape:
    """The target model's shapes as one GPU of a TP group sees them. Defaults: Kimi-K2 (K2.x
    share these; data/configs/kimi-k2.6.json and its _provenance), routed experts INT4 group 32, the
    rest bf16."""

    n_layers: int = 61
    n_dense_layers: int = 1            # first_k_dense_replace
    hidden: int = 7168
    moe_inter: int = 2048
    dense_inter: int = 18432
    n_experts: int = 384
    top_k: int = 8
    n_shared: int = 1
    n_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_rope_dim: int = 64
    qk_nope_dim: int = 128
    v_head_dim: int = 128
    vocab: int = 163840
    expert_bits: int = 4
    dense_bits: int = 16               # everything but the routed experts (bf16 in the INT4 checkpoints)
    group: int = 32
    tp: int = 8
    q_lora: bool = True                # the config has a q_lora_rank (q_a_proj, whole on every GPU)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"ModelShape.{f.name} must be a finite number >= 0, got {v!r}")
        if self.tp < 1 or self.top_k < 1 or self.top_k > self.n_experts:
            raise ValueError(f"ModelShape: tp >= 1 and 1 <= top_k <= n_experts required, got tp {self.tp}, "
                             f"top_k {self.top_k}, n_experts {self.n_experts}")
        if self.n_dense_layers > self.n_layers:
            raise ValueError(f"ModelShape: n_dense_layers {self.n_dense_layers} exceeds n_layers "
                             f"{self.n_layers}")
        if self.expert_bits < 16 and self.group < 1:
            raise ValueError(f"ModelShape: {self.expert_bits:g}-bit experts need a scale group >= 1, got "
                             f"{self.group!r}")

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    @property
    def heads_per_gpu(self) -> float:
        return self.n_heads / self.tp

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_dim

    def expert_bytes(self, *, scales: bool = True) -> float:
        """One routed expert (gate, up, down): weights + bf16 group scales (if quantized); scales=False:
        the weights alone."""
        params = 3 * self.hidden * self.moe_inter
        group_scales = params / self.group * 2 if self.expert_bits < 16 and scales else 0.0
        return params * self.expert_bits / 8 + group_scales

    def attn_params(self) -> float:
        """MLA projections of one layer (q_a, q_b, kv_a, kv_b, o)."""
        h, H = self.hidden, self.n_heads
        return (h * self.q_lora_rank + self.q_lora_rank * H * (self.qk_nope_dim + self.qk_rope_dim)
                + h * self.latent_dim + self.kv_lora_rank * H * (self.qk_nope_dim + self.v_head_dim)
                + H * self.v_head_dim * h)

    def dense_params_per_gpu(self) -> float:
        """Parameters one GPU multiplies every step besides the routed experts, placed as plain TP places
        them (`kdlib.memory`, `kdlib.engine.rank`): q_a_proj, kv_a_proj_with_mqa and the router whole on
        every GPU; q_b, kv_b, o_proj, the shared experts, the dense MLP layers and lm_head split over tp.
        Without a q_lora_rank in the config the query projection is split too."""
        h = self.hidden
        whole_attn = h * ((self.q_lora_rank if self.q_lora else 0) + self.latent_dim)
        whole = self.n_layers * whole_attn + self.n_moe_layers * self.n_experts * h
        split = (self.n_layers * (self.attn_params() - whole_attn)
                 + self.n_moe_layers * self.n_shared * 3 * h * self.moe_inter
                 + self.n_dense_layers * 3 * h * self.dense_inter
                 + self.vocab * h)
        return whole + split / self.tp

    def dense_bytes_per_gpu(self) -> float:
        """Bytes of `dense_params_per_gpu` at dense_bits each: what every step streams besides the routed
        experts."""
        return self.dense_params_per_gpu() * self.dense_bits / 8

    @classmethod
    def from_config(cls, config, tp: int = 1, expert_bits: int = 4, dense_bits: int = 16) -> ModelShape:
        """From a DeepSeek-V3 / Kimi-K2 style config: a `kdlib.config.ModelConfig`, or what
        `ModelConfig.load` reads (a config.json dict, a path, a shipped name); ConfigError names a bad field.
        Without q_lora_rank the query projection is counted as a hidden-wide q_lora pair."""
        c = config if isinstance(config, ModelConfig) else ModelConfig.load(config)
        return cls(
            n_layers=c.num_hidden_layers,
            n_dense_layers=c.first_k_dense_replace,
            hidden=c.hidden_size,
            moe_inter=c.moe_intermediate_size,
            dense_inter=c.intermediate_size,
            n_experts=c.n_routed_experts,
            top_k=c.num_experts_per_tok,
            n_shared=c.n_shared_experts,
            n_heads=c.num_attention_heads,
            q_lora_rank=c.q_lora_rank or c.hidden_size,
            q_lora=bool(c.q_lora_rank),
            kv_lora_rank=c.kv_lora_rank,
            qk_rope_dim=c.qk_rope_head_dim,
            qk_nope_dim=c.qk_nope_head_dim,
            v_head_dim=c.v_head_dim,
            vocab=c.vocab_size,
            expert_bits=expert_bits,
            dense_bits=dense_bits,
            tp=tp,
        )


@dataclass(frozen=True)
class Scenario:
    """One operating point. q_len: tokens verified per stream per step (tree budget + 1 root);
    block: drafter block size; accepted: tokens committed per stream per step (incl. the bonus)."""

    concurrency: int = 1
    q_len: int = 9
    block: int = 8
    accepted: float = 4.4
    context: int = 2048
    tree_builder: str = "cpu"          # "cpu" (heapq on the host) or "gpu" (kernel in the graph)
    name: str = ""

    def __post_init__(self):
        counts = (self.concurrency, self.q_len, self.block, self.context)
        if not all(math.isfinite(v) and v == int(v) for v in counts) \
                or self.concurrency < 1 or self.q_len < 1 or self.block < 1 or self.context < 0:
            raise ValueError(f"Scenario needs whole numbers concurrency, q_len, block >= 1 and context >= 0: "
                             f"{self}")
        if not 1 <= self.accepted <= self.max_accepted:
            raise ValueError(f"accepted {self.accepted} must lie in [1, min(q_len, block + 1) = "
                             f"{self.max_accepted}]: a step commits the bonus token, and at most its drafted "
                             "tokens and the bonus")
        if self.tree_builder not in ("cpu", "gpu"):
            raise ValueError(f"tree_builder must be 'cpu' or 'gpu', got {self.tree_builder!r}")

    @property
    def max_accepted(self) -> int:
        """The most a step commits: its verified rows, and along one path the block's drafts + the bonus."""
        return min(self.q_len, self.block + 1)

    @property
    def m(self) -> int:
        """Tokens per layer call: concurrency x q_len."""
        return self.concurrency * self.q_len


# The pieces of one TP rank's step (`kdlib.perf.rank_work`): per layer, then per step.
# commit_ar: an AR step's commit (no drafter); moe_wide: the MoE layer where its launch bound passes
# MOE_NARROW_BOUND (another moe_w4a16 version: `calibration.moe_piece`)
RANK_PIECES = ("dense_first", "dense", "attention", "moe", "moe_wide", "head", "draft", "tree", "accept",
               "commit", "commit_ar")


@dataclass(frozen=True)
class PieceTerms:
    """One piece of a rank's step: time = kernels(M) x kernel_s + bytes / (HBM peak x mem_eff) + FLOPs /
    (bf16 peak x comp_eff), the peaks of the GPU's spec (`data/hw/`), so that each efficiency is a fraction
    of peak and the terms carry over to another GPU by its peaks. The two byte and FLOP terms add (a piece
    of several kernels streams some and computes others): a piece memory-bound at small M and compute-bound
    at large M fits both ends, which one efficiency against max(bytes, FLOPs) cannot.

    kernels: (M, kernels per call) measured at each row count M, from the profile; `kernels_at` reads the
    nearest M (in log M)."""

    kernel_s: Param
    mem_eff: Param
    comp_eff: Param
    kernels: tuple[tuple[int, float], ...]
    kernels_source: str

    def __post_init__(self):
        if not self.kernels:
            raise ValueError("PieceTerms needs the kernels per call at one M at least")

    def kernels_at(self, m: int) -> float:
        return min(self.kernels, key=lambda mk: abs(math.log(mk[0]) - math.log(m)))[1]

    def seconds(self, kernels: float, nbytes: float, flops: float, bandwidth: float,
                flop_rate: float) -> float:
        """The piece's time: kernels x kernel_s + bytes / (bandwidth x mem_eff) + FLOPs / (flop_rate x
        comp_eff), bandwidth and flop_rate a GPU's peaks."""
        return (kernels * self.kernel_s.value + nbytes / (bandwidth * self.mem_eff.value)
                + flops / (flop_rate * self.comp_eff.value))


# AttentionPlanTerms' regressors (`kdlib.perf.rank_work.attention_plan`'s keys), a Param of seconds each
ATTENTION_PLAN_TERMS = ("busiest_tiles", "busiest_jobs", "latent_bytes", "rows", "jobs")


@dataclass(frozen=True)
class AttentionPlanTerms:
    """The rank's tree-verify attention on the GPU it was timed on, from the work its plan lays out over the
    CTAs (`kdlib.perf.rank_work.attention_plan` at `grid` CTAs): time = fixed_s + per[t] x plan[t] summed over
    ATTENTION_PLAN_TERMS: the busiest CTA's key tiles and jobs (the attend kernel's critical path), the latent
    bytes read, the query rows (the combine's) and all jobs. Seconds of that GPU (`gpu`): on another one the
    rank's step takes the peak-scaled `PieceTerms` of the attention instead."""

    gpu: str
    grid: int
    fixed_s: Param
    per: dict  # {ATTENTION_PLAN_TERMS name: Param, seconds per unit}

    def time(self, plan: dict) -> float:
        return self.fixed_s.value + sum(self.per[t].value * plan[t] for t in ATTENTION_PLAN_TERMS)


@dataclass(frozen=True)
class RankLayerTerms:
    """The rank's step terms from a suite that times one layer's pieces (`calibrate_rank_layer`): a
    `PieceTerms` per piece of RANK_PIECES the suite measured, the cost of one graph replay beyond its
    kernels (a whole step pays it once), the rank's MoE mode and TP degree, `a` for everything else
    (the all-reduce), and the attention's plan-form terms on the timed GPU (`AttentionPlanTerms`; None:
    the attention's `PieceTerms` everywhere)."""

    pieces: dict
    graph_overhead_s: Param
    moe_mode: str
    a: Assumptions
    tp: int = 8
    attention_plan: AttentionPlanTerms | None = None

    def table(self) -> list[dict]:
        """One row per piece: kernel_s, mem_eff, comp_eff, the fit's source, the kernels per call's range."""
        return [{"piece": p, "kernel_s": t.kernel_s.value, "mem_eff": t.mem_eff.value,
                 "comp_eff": t.comp_eff.value, "kernels_min": min(k for _, k in t.kernels),
                 "kernels_max": max(k for _, k in t.kernels), "source": t.kernel_s.source}
                for p, t in self.pieces.items()]
