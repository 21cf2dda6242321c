"""KV-cache, weight, KV-pool and context memory math from a Hugging Face config.json, and YaRN checks.

    kv_bytes_per_token("kimi-k2.6")                              # 70272: 61 layers x 576 x 2 B
    kv_bytes_per_token("kimi-k2.6", tp=8)                        # 70272: the latent is replicated
    kv_bytes_per_token("kimi-k2.6", tp=8, kv_split="context_parallel")   # 8784
    p = plan("kimi-k2.6", "rtx-pro-6000", tp=8, context=200_000)
    print(p); p.verdict; p.value("pool_tokens"); p.to_frame()

`config` everywhere is a dict (a parsed config.json), a path to a config.json (or to a directory
holding one), or the name of a shipped config: a file stem in `data/configs/` (`shipped()` lists
them). Multimodal wrappers (`kimi_k25`: Kimi-K2.5 / K2.6) keep the language model under
`text_config`; only that part is counted (the vision tower is left out, and said so). The config is
read by `kdlib.config` (`load_config`, `text_config`, `geometry`, `ConfigError`, the one YaRN).

KV cache per token, whole model (`tp=1`):
  MLA      layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes: the latent c_kv and the shared
           RoPE key, one "head" (SGLang `MLATokenToKVPool`; vLLM `MLAAttentionSpec`, head_size 576).
  GQA/MHA  layers x num_key_value_heads x (head_dim + v_head_dim) x dtype bytes (K and V).
  fp4_e2m1 (MLA only) half a byte per element plus one 1-byte scale per 16 elements
           (SGLang `MLATokenToKVPoolFP4`).
  fp8_ds_mla (MLA only) DeepSeek-V3.2's FP8 layout (FlashMLA "FP8 with scale", vLLM `fp8_ds_mla`): the
           latent in e4m3 with one float32 scale per 128 dims, the RoPE key in bf16: 656 B per layer at
           512 + 64 (`kdlib.ref.fp8.layout_bytes`, the reference of that layout).
Per GPU under tensor parallelism (`tp`), by `kv_split` (models-hardware.md §2.2):
  "replicated"        plain TP, the default of SGLang and vLLM. MLA: every rank stores the full latent
                      of every token (the latent has no head axis to shard: SGLang docs, "Duplicated KV
                      cache across all GPUs", docs.sglang.io/docs/advanced_features/dp_dpa_smg_guide;
                      SGLang `get_cell_size_per_token` has no division by TP). GQA/MHA: KV heads split
                      over the ranks, one head per rank (replicated) when num_key_value_heads < tp.
  "dp_attention"      attention data parallel over the whole TP group (SGLang --enable-dp-attention
                      --dp-size tp): each rank stores full entries for its own requests only, so the
                      bytes per token on the owning rank are the whole-model figure and the group's
                      capacity is tp pools; attention weights are then replicated on every rank.
  "context_parallel"  decode context parallel over the whole TP group (SGLang DCP, vLLM
                      --decode-context-parallel-size): tokens striped over the ranks (position p on
                      rank p mod c, docs.sglang.io/docs/advanced_features/dcp.md), so about 1/tp of
                      the bytes per rank; for GQA this assumes the DCP size that removes all head
                      duplication. In `plan`, one request may then use c x the per-rank pool slots;
                      how SGLang's scheduler counts DCP capacity was not read (an assumption).

KV pool (SGLang, `model_runner_kv_cache_mixin.py`, models-hardware.md §2.3):
  rest = free_before_weights x mem_fraction_static - weights_per_gpu;  tokens = rest // cell
with free_before_weights = GPU memory - `overhead_bytes` (CUDA context and NCCL buffers; 1.5 GiB is
an assumption, not a measurement). The default mem_fraction_static is SGLang's v0.4.8-0.5.x heuristic
by GPU-memory bucket (`default_mem_fraction_static`), cut further for multimodal checkpoints such as
Kimi-K2.6 (`vlm_mem_fraction_factor`); newer SGLang derives the reserve differently (PR #10975), so
pass the value your server logs when you know it, or recover it from a logged pool size with
`implied_mem_fraction`.

Not modelled: a speculative draft model's own KV pool and weights (pass `draft_weight_bytes`;
`speculative=True` only adds SGLang's +2 GiB reserve), the req_to_token pool (int32 indices, ~0.27 GB
at 256 requests x 262k), activation peaks beyond the (1 - mem_fraction_static) reserve, and the
vision tower of multimodal checkpoints.
"""

from __future__ import annotations

import json
import math
import numbers

from kdlib import hw
from kdlib.cli import Parser, fail, fraction, nonnegative_float, positive_int
from kdlib.config import CONFIGS as CONFIGS  # the shipped configs' folder, memory.CONFIGS to its users
from kdlib.config import (
    DEEPSEEK_V3_DEFAULTS,
    ConfigError,
    Geometry,
    geometry,
    load_config,
    parse_rope,
    require,
    rope_block,
    rope_type,
    shipped,
    text_config,
)

GiB = 2**30
KV_SPLITS = ("replicated", "dp_attention", "context_parallel")
DTYPE_BYTES = {
    "float32": 4, "fp32": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "fp4_e2m1": 0.5,
    "fp8_ds_mla": 1,  # the latent's e4m3 bytes; kv_bytes_per_token adds the scales and the bf16 RoPE key
}
WEIGHT_FORMATS = ("auto", "bf16", "fp8_block", "int4_g32")
# SGLang's free-memory assumption before weights load: CUDA context + NCCL buffers. An assumption
# (models-hardware.md §2.4 uses it for its illustrative pools), not a measured figure.
DEFAULT_OVERHEAD_BYTES = int(1.5 * GiB)
FP8_BLOCK = 128  # DeepSeek block-FP8: one fp32 scale per 128 x 128 weight block (README_WEIGHTS.md)
FP4_SCALE_BLOCK = 16  # SGLang MLATokenToKVPoolFP4: one 1-byte scale per 16 elements


# ----------------------------------------------------------------------------------------- KV cache

def dtype_bytes(dtype: str, config=None) -> float:
    """Bytes per element of a KV dtype name; "auto" is the model's torch_dtype (SGLang's default)."""
    if dtype == "auto":
        if config is None:
            raise ValueError("kv dtype 'auto' needs the config (it means the model's torch_dtype)")
        dtype = geometry(config).torch_dtype
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)} or 'auto'")
    return DTYPE_BYTES[dtype]


def _check_split(tp: int, kv_split: str) -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if kv_split not in KV_SPLITS:
        raise ValueError(f"kv_split {kv_split!r} not in {KV_SPLITS}")


def kv_heads_per_rank(g: Geometry, tp: int) -> int:
    """GQA/MHA KV heads a rank holds under plain TP: kv/tp, or 1 (replicated) when kv < tp."""
    if g.num_kv_heads >= tp and g.num_kv_heads % tp:
        raise ValueError(f"{g.name}: {g.num_kv_heads} KV heads cannot be split evenly over tp={tp}")
    if g.num_kv_heads < tp and tp % g.num_kv_heads:
        raise ValueError(f"{g.name}: tp={tp} is not a multiple of its {g.num_kv_heads} KV heads, so they "
                         f"cannot be replicated evenly over the ranks")
    return max(1, g.num_kv_heads // tp)


def check_tp(config, tp: int, kv_split: str = "replicated") -> None:
    """Refuse a TP size the model cannot be split over (ValueError naming what does not divide).

    Attention TP gives every rank whole heads, so tp must divide num_attention_heads (not checked
    under dp_attention, where attention is not split); GQA KV heads are split or replicated evenly
    (`kv_heads_per_rank`). Routed experts go whole to ranks (EP: tp divides the expert count) or
    in slices (TP: tp divides moe_intermediate_size); one of the two must work.
    """
    _check_split(tp, kv_split)
    g = geometry(config)
    if kv_split != "dp_attention":
        if g.num_heads % tp:
            raise ValueError(f"{g.name}: tp={tp} cannot split its {g.num_heads} attention heads (every rank "
                             f"holds whole heads: tp must divide {g.num_heads})")
        if g.attention != "mla":
            kv_heads_per_rank(g, tp)
    lm = text_config(config)
    experts = int(lm.get("n_routed_experts") or lm.get("num_experts") or 0)
    if experts:
        inter = int(require(lm, "moe_intermediate_size", "MoE expert weights"))
        if experts % tp and inter % tp:
            raise ValueError(f"{g.name}: tp={tp} splits neither its {experts} routed experts (whole experts "
                             f"per rank) nor their intermediate size {inter} (a slice of every expert per "
                             f"rank)")


def dcp_size(g: Geometry, tp: int) -> int:
    """Decode-context-parallel size that removes all KV duplication in a TP group: tp for MLA,
    tp / kv heads for GQA with fewer KV heads than ranks, else 1 (heads already split)."""
    if g.attention == "mla":
        return tp
    return max(1, tp // g.num_kv_heads)


def _exact(x):
    return int(x) if float(x).is_integer() else x


def kv_bytes_per_token(config, dtype: str = "bfloat16", tp: int = 1, kv_split: str = "replicated"):
    """KV-cache bytes per token on one GPU (tp=1: the whole model). See the module docstring for modes.

    Returns an int when the figure is whole (always, for the shipped configs and tp a power of two),
    else a float (context_parallel averages over the striped ranks).
    """
    _check_split(tp, kv_split)
    g = geometry(config)
    elt = dtype_bytes(dtype, config)
    per_layer = g.kv_elements_per_layer  # whole model
    if g.attention != "mla" and kv_split == "replicated":
        per_layer = kv_heads_per_rank(g, tp) * (g.head_dim + g.v_head_dim)
    if elt == DTYPE_BYTES["fp4_e2m1"]:
        if g.attention != "mla":
            raise ValueError(f"{g.name}: fp4 KV is only modelled for MLA (SGLang MLATokenToKVPoolFP4)")
        full = g.num_layers * (per_layer // 2 + per_layer // FP4_SCALE_BLOCK)
    elif dtype == "fp8_ds_mla":
        from kdlib.ref.fp8 import layout_bytes  # numpy: kdlib.memory itself imports pure Python only

        if g.attention != "mla":
            raise ValueError(f"{g.name}: fp8_ds_mla is an MLA latent layout (FlashMLA's FP8 KV cache)")
        full = g.num_layers * layout_bytes(g.kv_lora_rank, g.qk_rope_head_dim)
    else:
        full = g.num_layers * per_layer * elt
    return _exact(full / tp if kv_split == "context_parallel" else full)


def kv_bytes(config, tokens: int, dtype: str = "bfloat16", tp: int = 1, kv_split: str = "replicated"):
    """KV-cache bytes on one GPU for `tokens` tokens (context_parallel: the busiest rank, ceil(n/tp))."""
    if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral) or tokens < 0:
        raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")
    _check_split(tp, kv_split)
    if kv_split == "context_parallel":
        c = dcp_size(geometry(config), tp)
        return math.ceil(tokens / c) * kv_bytes_per_token(config, dtype, tp, "replicated")
    return tokens * kv_bytes_per_token(config, dtype, tp, kv_split)


# ----------------------------------------------------------------------------------------- weights

# Parts of the language model and how plain TP stores them:
#   "split"      divided over the TP ranks (vocab-parallel embedding / lm_head, head-split attention,
#                TP- or EP-sharded MLPs and experts);
#   "attn"       divided over the attention-TP ranks (tp, or 1 under DP-attention);
#   "kv"         GQA/MHA k_proj and v_proj: as the KV heads, one head per rank when kv heads < tp;
#   "replicated" whole on every rank (norms, the router, MLA's down projections q_a / kv_a, which
#                SGLang builds as ReplicatedLinear: sgl-project/sglang
#                python/sglang/srt/models/deepseek_v2.py).
_PART_SHARDING = {
    "embed": "split", "lm_head": "split", "attention": "attn", "attention_kv": "kv",
    "attention_replicated": "replicated",
    "dense_mlp": "split", "shared_experts": "split", "routed_experts": "split", "router": "replicated",
    "norms": "replicated",
}


def _tensors(g: Geometry, lm: dict, include_mtp: bool) -> list[tuple[str, str, int, int, int]]:
    """(part, kind, out, in, count) for every weight of the LM; kind: linear | table | vector | bias32.

    Shape: a linear is [out, in]; a table (embedding) [vocab, hidden]; a vector [out] (in = 1).
    """
    h, L = g.hidden_size, g.num_layers
    t = [("embed", "table", g.vocab_size, h, 1), ("norms", "vector", h, 1, 1)]
    if not lm.get("tie_word_embeddings", False):
        t.append(("lm_head", "table", g.vocab_size, h, 1))
    layers = L + (g.mtp_layers if include_mtp else 0)
    t.append(("norms", "vector", h, 1, 2 * layers))  # input and post-attention RMSNorm
    if g.attention == "mla":
        n, nope, rope, v, r = (
            g.num_heads,
            g.head_dim - g.qk_rope_head_dim,
            g.qk_rope_head_dim,
            g.v_head_dim,
            g.kv_lora_rank,
        )
        q_lora = lm.get("q_lora_rank", DEEPSEEK_V3_DEFAULTS["q_lora_rank"])
        if q_lora:
            t += [("attention_replicated", "linear", q_lora, h, layers),
                  ("attention_replicated", "vector", q_lora, 1, layers),  # q_a_layernorm
                  ("attention", "linear", n * (nope + rope), q_lora, layers)]
        else:
            t.append(("attention", "linear", n * (nope + rope), h, layers))
        t += [("attention_replicated", "linear", r + rope, h, layers),  # kv_a_proj_with_mqa
              ("attention_replicated", "vector", r, 1, layers),  # kv_a_layernorm
              ("attention", "linear", n * (nope + v), r, layers),  # kv_b_proj
              ("attention", "linear", h, n * v, layers)]  # o_proj
    else:
        hd, n, kv = g.head_dim, g.num_heads, g.num_kv_heads
        t += [("attention", "linear", n * hd, h, layers), ("attention_kv", "linear", kv * hd, h, 2 * layers),
              ("attention", "linear", h, n * hd, layers)]
        if lm.get("attention_bias"):
            t.append(("attention", "vector", (n + 2 * kv) * hd, 1, layers))
        if lm.get("model_type") in ("qwen3", "qwen3_moe"):
            t.append(("norms", "vector", hd, 1, 2 * layers))  # per-head q_norm and k_norm
    # MLP: DeepSeek / Kimi (first_k_dense_replace, n_routed_experts, n_shared_experts) or Qwen3-MoE
    # (num_experts, decoder_sparse_step, mlp_only_layers); a model with neither is dense.
    experts = lm.get("n_routed_experts") or lm.get("num_experts") or 0
    if experts:
        moe_inter = require(lm, "moe_intermediate_size", "MoE expert weights")
        if "n_routed_experts" in lm:  # DeepSeek's layout: the fields it leaves out as the engine reads them
            first = lm.get("first_k_dense_replace", DEEPSEEK_V3_DEFAULTS["first_k_dense_replace"])
            dense_layers = int(first or 0)
            moe_layers = L - dense_layers
        else:
            step = int(lm.get("decoder_sparse_step") or 1)
            only = set(lm.get("mlp_only_layers") or [])
            moe_layers = sum(1 for i in range(L) if i not in only and (i + 1) % step == 0)
            dense_layers = L - moe_layers
        moe_layers += g.mtp_layers if include_mtp else 0
        absent = DEEPSEEK_V3_DEFAULTS["n_shared_experts"] if "n_routed_experts" in lm else 0
        shared = int(lm.get("n_shared_experts", absent) or 0)
        t.append(("routed_experts", "linear", moe_inter, h, 3 * experts * moe_layers))  # gate, up, down
        if shared:
            t.append(("shared_experts", "linear", shared * moe_inter, h, 3 * moe_layers))
        t.append(("router", "linear", experts, h, moe_layers))
        if lm.get("topk_method") == "noaux_tc":
            t.append(("router", "bias32", experts, 1, moe_layers))  # e_score_correction_bias, fp32
    else:
        dense_layers = L
    if dense_layers:
        inter = require(lm, "intermediate_size", "dense MLP weights")
        t.append(("dense_mlp", "linear", inter, h, 3 * dense_layers))
    return t


def param_count(config, include_mtp: bool = False) -> dict[str, int]:
    """Parameters of the language model by part (see `_PART_SHARDING`), plus "total".

    include_mtp adds the MTP decoder layers (num_nextn_predict_layers); their eh_proj and extra norms
    (~2 x hidden^2 each) are left out."""
    g = geometry(config)
    out: dict[str, int] = {}
    for part, _kind, o, i, count in _tensors(g, text_config(config), include_mtp):
        out[part] = out.get(part, 0) + o * i * count
    out["total"] = sum(out.values())
    return out


def resolve_weight_format(config, weight_format: str = "auto") -> str:
    """"auto" -> the checkpoint's format from quantization_config: fp8_block, int4_g<N> or bf16."""
    if weight_format != "auto":
        if weight_format not in WEIGHT_FORMATS and not weight_format.startswith("int4_g"):
            raise ValueError(f"weight_format {weight_format!r} not in {WEIGHT_FORMATS} (or int4_g<N>)")
        group = weight_format[len("int4_g"):] if weight_format.startswith("int4_g") else "1"
        if not group.isdigit() or int(group) < 1:
            raise ValueError(f"weight_format {weight_format!r}: int4_g<N> needs a positive integer group "
                             f"size N")
        return weight_format
    qc = text_config(config).get("quantization_config")
    if not qc:
        return "bf16"
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block != [FP8_BLOCK, FP8_BLOCK]:
            raise ConfigError(f"fp8 quantization_config with weight_block_size {block!r}: only 128x128 "
                              "blocks are modelled")
        return "fp8_block"
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        weights = [grp.get("weights") or {} for grp in groups.values()]
        if len(weights) == 1 and weights[0].get("num_bits") == 4 and weights[0].get("group_size"):
            return f"int4_g{int(weights[0]['group_size'])}"
    raise ConfigError(f"quantization_config {method!r} is not modelled; pass weight_format= explicitly")


def _tensor_bytes(kind: str, part: str, o: int, i: int, fmt: str) -> float:
    """Bytes of one tensor in a checkpoint format (scales included)."""
    if kind == "bias32":
        return 4 * o * i
    if fmt == "fp8_block" and kind == "linear" and part != "router":
        # e4m3 weight + fp32 scale per 128x128 block (DeepSeek-V3 README_WEIGHTS.md, `weight_scale_inv`)
        return o * i + 4 * math.ceil(o / FP8_BLOCK) * math.ceil(i / FP8_BLOCK)
    if fmt.startswith("int4_g") and part == "routed_experts":
        # compressed-tensors pack-quantized W4A16, symmetric: packed int4 + one bf16 scale per group
        # along the input dim; no zero points (models-hardware.md §1.1, K2-Thinking / K2.6)
        group = int(fmt[len("int4_g"):])
        return o * i / 2 + 2 * o * math.ceil(i / group)
    return 2 * o * i  # bf16: embeddings, lm_head, norms, router, and everything unquantized


def weight_bytes(config, weight_format: str = "auto", tp: int = 1, kv_split: str = "replicated",
                 include_mtp: bool = False) -> dict:
    """Checkpoint bytes of the LM, whole and per GPU under `tp`, by part.

    Formats: bf16 (everything 2 B); fp8_block (every decoder linear e4m3 + fp32 128x128 block scales;
    embeddings, lm_head, norms and the router stay bf16); int4_g<N> (routed experts INT4 with a bf16
    scale per N inputs; attention, shared experts, dense layers, router, embeddings and lm_head stay
    bf16, as in the INT4 K2 checkpoints, models-hardware.md §1.6).
    Per GPU: "split" parts / tp, attention / attention-TP (1 under dp_attention), replicated parts whole.
    Returns {"format", "total", "per_gpu", "by_part": {part: total bytes}, "per_gpu_by_part"}.
    """
    check_tp(config, tp, kv_split)
    fmt = resolve_weight_format(config, weight_format)
    g = geometry(config)
    attn_tp = 1 if kv_split == "dp_attention" else tp
    by_part: dict[str, float] = {}
    per_gpu_by_part: dict[str, float] = {}
    for part, kind, o, i, count in _tensors(g, text_config(config), include_mtp):
        b = _tensor_bytes(kind, part, o, i, fmt) * count
        by_part[part] = by_part.get(part, 0) + b
        sharding = _PART_SHARDING[part]
        if sharding == "kv":
            share = g.num_kv_heads / kv_heads_per_rank(g, attn_tp)
        else:
            share = {"split": tp, "attn": attn_tp, "replicated": 1}[sharding]
        per_gpu_by_part[part] = per_gpu_by_part.get(part, 0) + b / share
    return {
        "format": fmt,
        "total": int(round(sum(by_part.values()))),
        "per_gpu": int(round(sum(per_gpu_by_part.values()))),
        "by_part": {k: int(round(v)) for k, v in by_part.items()},
        "per_gpu_by_part": {k: int(round(v)) for k, v in per_gpu_by_part.items()},
    }


# ----------------------------------------------------------------------------------------- KV pool

def default_mem_fraction_static(gpu_memory_bytes: int, tp: int, pp: int = 1, speculative: bool = False,
                                dp_attention: bool = False) -> tuple[float, float, str]:
    """SGLang v0.4.8-0.5.x default: (mem_fraction_static, reserved GiB, bucket) by GPU memory.

    reserved GiB by bucket, with ps = tp x pp: < 35 GiB: 2.8 + ps/10; < 90: 9.5 + ps/2; < 160 (H20,
    RTX PRO 6000 96 GB, H200): 12 + ps/2; else (B200, B300): 32; +2 with speculative decoding (+6 for
    a STANDALONE draft model in later 0.5.x), +4 with DP-attention; fraction = round((memory -
    reserved) / memory, 3); memory in MiB as the driver reports it (sgl-project/sglang
    python/sglang/srt/server_args.py, _handle_mem_fraction_static; models-hardware.md §2.3). For
    multimodal checkpoints SGLang then multiplies by `vlm_mem_fraction_factor`. Newer SGLang
    (PR #10975) uses another reserve rule.
    """
    mem_gib = gpu_memory_bytes / GiB
    ps = tp * pp
    if mem_gib < 35:
        reserved, bucket = 2.8 + ps / 10, "< 35 GiB: 2.8 + tp*pp/10"
    elif mem_gib < 90:
        reserved, bucket = 9.5 + ps / 2, "< 90 GiB: 9.5 + tp*pp/2"
    elif mem_gib < 160:
        reserved, bucket = 12 + ps / 2, "90-160 GiB: 12 + tp*pp/2"
    else:
        reserved, bucket = 32.0, ">= 160 GiB: 32"
    if speculative:
        reserved, bucket = reserved + 2, bucket + " (+2 speculative)"
    if dp_attention:
        reserved, bucket = reserved + 4, bucket + " (+4 DP-attention)"
    if reserved >= mem_gib:
        raise ValueError(f"SGLang's default reserve of {reserved:g} GiB ({bucket}, tp={tp}) is not below the "
                         f"{mem_gib:.2f} GiB of GPU memory: no default mem_fraction_static; give one")
    return round((mem_gib - reserved) / mem_gib, 3), reserved, bucket


def vlm_mem_fraction_factor(config) -> float:
    """SGLang's cut of the default mem_fraction_static for multimodal checkpoints (1.0 without a
    vision tower).

    0.95 x clamp(1 - 0.1 x (ratio - 1), 0.8, 1.05), ratio = vision layers x hidden^2 / (24 x 1024^2),
    reading vision_config.num_hidden_layers / hidden_size with defaults 24 / 1024 (ServerArgs.
    adjust_mem_fraction_for_vlm in python/sglang/srt/server_args.py, v0.5.x; applied only when the
    fraction is not given). Kimi-K2.5/K2.6 name their vision fields vt_*, so the defaults apply: 0.95.
    """
    vision = load_config(config).get("vision_config")
    if not isinstance(vision, dict):
        return 1.0
    ratio = (
        int(vision.get("num_hidden_layers", 24)) * int(vision.get("hidden_size", 1024)) ** 2 / (24 * 1024**2)
    )
    return 0.95 * max(0.8, min(1.05, 1.0 - 0.1 * (ratio - 1.0)))


def free_before_weights(gpu_memory_bytes: int, overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> int:
    """GPU memory left once the CUDA context and NCCL buffers (`overhead_bytes`) are taken (> 0, else
    ValueError)."""
    if overhead_bytes < 0:
        raise ValueError(f"overhead_bytes must be >= 0, got {overhead_bytes}")
    if overhead_bytes >= gpu_memory_bytes:
        raise ValueError(f"the overhead before weights, {_fmt_bytes(overhead_bytes)}, is not below the GPU "
                         f"memory, {_fmt_bytes(gpu_memory_bytes)}: nothing is left for weights or KV")
    return gpu_memory_bytes - overhead_bytes


def pool_bytes(gpu_memory_bytes: int, weights_per_gpu: int, mem_fraction_static: float,
               overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> int:
    """SGLang's rest_memory in bytes: free_before x fraction - weights (may be <= 0: does not fit)."""
    if not 0 < mem_fraction_static < 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static}")
    free_before = free_before_weights(gpu_memory_bytes, overhead_bytes)
    return int(free_before * mem_fraction_static) - int(weights_per_gpu)


def pool_tokens(gpu_memory_bytes: int, weights_per_gpu: int, cell_bytes: float, mem_fraction_static: float,
                overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> int:
    """SGLang's max_total_num_tokens per GPU: rest_memory // cell, and 0 (never negative) when
    nothing is left."""
    if cell_bytes <= 0:
        raise ValueError(f"cell_bytes must be > 0, got {cell_bytes}")
    rest = pool_bytes(gpu_memory_bytes, weights_per_gpu, mem_fraction_static, overhead_bytes)
    return max(0, int(rest // cell_bytes))


def fraction_to_set(fraction: float) -> float:
    """The mem_fraction_static to set for a needed `fraction`: three decimals, rounded up (0.8932 -> 0.894;
    0.893 would not fit)."""
    return math.ceil(fraction * 1000 - 1e-9) / 1000


def mem_fraction_for_pool(gpu_memory_bytes: int, weights_per_gpu: int, pool_bytes_needed: float,
                          overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> float:
    """The mem_fraction_static at which SGLang's pool reaches `pool_bytes_needed` (may exceed 1:
    impossible)."""
    return (weights_per_gpu + pool_bytes_needed) / free_before_weights(gpu_memory_bytes, overhead_bytes)


def implied_mem_fraction(config, gpu: str, tp: int, pool_tokens_logged: int, kv_dtype: str = "bfloat16",
                         kv_split: str = "replicated", weight_format: str = "auto",
                         overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> float:
    """The mem_fraction_static that reproduces a pool size a server logged (max_total_num_tokens),
    under this module's weight count and overhead assumption."""
    if (isinstance(pool_tokens_logged, bool) or not isinstance(pool_tokens_logged, numbers.Integral)
            or pool_tokens_logged < 1):
        raise ValueError(f"pool_tokens_logged must be an int >= 1, got {pool_tokens_logged!r}")
    cell = kv_bytes_per_token(
        config, kv_dtype, tp, kv_split if kv_split != "context_parallel" else "replicated"
    )
    weights = weight_bytes(config, weight_format, tp, kv_split)["per_gpu"]
    return mem_fraction_for_pool(
        hw.load(gpu)["memory_bytes"], weights, pool_tokens_logged * cell, overhead_bytes
    )


# ----------------------------------------------------------------------------------------- YaRN

def context_source(config) -> tuple[str, int, float]:
    """(key, its value, rope factor) SGLang derives the context length from
    (hf_transformers_utils.get_context_length); `sglang_context_length` is value x factor.

    The key is the first of max_sequence_length, seq_length, max_seq_len, model_max_length,
    max_position_embeddings; the factor is rope_scaling.factor only when original_max_position_embeddings
    is absent and the rope type is not llama3, else 1.
    """
    lm = text_config(config)
    for key in (
        "max_sequence_length",
        "seq_length",
        "max_seq_len",
        "model_max_length",
        "max_position_embeddings",
    ):
        if lm.get(key) is not None:
            base = int(lm[key])
            break
    else:
        raise ConfigError(f"config {lm['_name']}: missing field 'max_position_embeddings' (needed for the "
                          "context length)")
    rs = rope_block(lm)
    factor = 1.0
    if rs and "original_max_position_embeddings" not in rs and rope_type(lm) != "llama3":
        factor = float(rs.get("factor") or 1.0)
    return key, base, factor


def _context_note(config) -> str:
    """What the derived context length came from: "max_position_embeddings x rope factor 4"."""
    key, _, factor = context_source(config)
    return key if factor == 1.0 else f"{key} x rope factor {factor:g}"


def sglang_context_length(config) -> int:
    """The context length SGLang derives from a config: `context_source`'s value x factor.
    SGLang refuses a larger --context-length unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1."""
    _, base, factor = context_source(config)
    return int(base * factor)


def _is_yarn(lm: dict) -> bool:
    """A YaRN RoPE: HF's "yarn" or DeepSeek's "deepseek_yarn"."""
    return rope_type(lm) in ("yarn", "deepseek_yarn")


def yarn(config) -> dict:
    """YaRN checks of a config: factor x original vs max_position_embeddings, the derived context,
    the correction range, and the attention-temperature factors and where they are applied.

    kdlib.config's one YaRN (transformers' `_compute_yarn_parameters`, models-hardware.md §3):
    cos/sin scaled by `cos_sin_mscale` (attention_factor; for DeepSeek-V2/V3 and Kimi-K2, which set
    mscale and mscale_all_dim, mscale(s, mscale) / mscale(s, mscale_all_dim) = 1 when they are
    equal, as SGLang's DeepseekScalingRotaryEmbedding), so q.k of the rotary dims is scaled by its
    square; and, when mscale_all_dim is set (DeepSeek-V3 attention), the softmax scale multiplied by
    mscale(s, mscale_all_dim)^2 = (0.1 * mscale_all_dim * ln s + 1)^2. `logit_scale_factor` is the
    product of both on the rotary part of q.k. The scaling is static: it applies at every sequence
    length, so the factor must match the checkpoint. Returns {"yarn": False, ...} for configs
    without YaRN.
    """
    lm = text_config(config)
    g = geometry(config)
    kind = rope_type(lm)
    max_pos = lm.get("max_position_embeddings")
    out = {
        "model": g.name,
        "rope_type": kind,
        "yarn": _is_yarn(lm),
        "rope_theta": lm.get("rope_theta", (rope_block(lm) or {}).get("rope_theta")),
        "max_position_embeddings": max_pos,
        "sglang_context_length": sglang_context_length(config),
    }
    if not out["yarn"]:
        return out
    theta, y = parse_rope(lm)
    original = y.original_max_position_embeddings
    cos_sin, softmax = y.attention_scale(), y.softmax_factor()
    if y.mscale_all_dim:
        applied = ("softmax scale x mscale(s, mscale_all_dim)^2; cos/sin x attention factor "
                   "(mscale(s, mscale)/mscale(s, mscale_all_dim) unless given)")
    else:
        applied = "cos/sin x attention_factor (q.k x its square); softmax scale untouched"
    out.update({
        "factor": y.factor, "original_max_position_embeddings": original,
        "factor_x_original": int(y.factor * original),
        "consistent": max_pos is not None and int(y.factor * original) == int(max_pos),
        "beta_fast": y.beta_fast, "beta_slow": y.beta_slow,
        "mscale": y.mscale, "mscale_all_dim": y.mscale_all_dim,
        "cos_sin_mscale": cos_sin, "logit_scale_factor": cos_sin**2 * softmax,
        "softmax_scale": g.head_dim**-0.5 * softmax,  # head_dim: nope + rope for MLA
        "applied_by": applied,
        "correction_range": y.correction_range(g.rotary_dim, theta),
    })
    return out


# ----------------------------------------------------------------------------------------- plan

def _fmt_bytes(b: float) -> str:
    return f"{b / GiB:,.2f} GiB ({b / 1e9:,.2f} GB)"


def format_value(value, unit: str = "") -> str:
    """A table cell for humans: bytes as GiB (GB), counts with thousands separators, the unit appended."""
    if value is None:
        return "-"
    if unit == "B" and isinstance(value, int | float) and not isinstance(value, bool):
        return _fmt_bytes(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        shown = str(value)
    elif float(value).is_integer() and abs(value) >= 1:
        shown = f"{int(value):,}"
    else:
        shown = f"{value:,.4g}"
    return shown + (f" {unit}" if unit else "")


class Plan(list):
    """The memory plan: a list of row dicts {key, term, value, unit, note}, plus the verdict.

    Attributes: verdict (str), fits (bool: one request of `context` tokens fits), inputs (dict).
    `value(key)` reads a row; `to_frame()` gives a pandas DataFrame; `to_dict()` is JSON-ready;
    `str(plan)` is the table the CLI prints.
    """

    def __init__(self, rows, verdict: str, fits: bool, inputs: dict):
        super().__init__(rows)
        self.verdict, self.fits, self.inputs = verdict, fits, inputs

    def value(self, key: str):
        for row in self:
            if row["key"] == key:
                return row["value"]
        raise KeyError(f"no row {key!r}; rows: {[r['key'] for r in self]}")

    def to_frame(self, human: bool = False):
        """A DataFrame indexed by row key; human=True replaces value and unit by one formatted `shown`
        column."""
        import pandas as pd

        frame = pd.DataFrame(list(self)).set_index("key")
        if human:
            frame.insert(1, "shown", [format_value(r["value"], r["unit"]) for r in self])
            frame = frame.drop(columns=["value", "unit"])
        return frame

    def to_dict(self) -> dict:
        return {"inputs": self.inputs, "rows": list(self), "verdict": self.verdict, "fits": self.fits}

    def __str__(self) -> str:
        i = self.inputs
        head = (f"memory plan: {i['model']} on {i['tp']} x {i['gpu']}, context {i['context']:,}, "
                f"KV {i['kv_dtype']} {i['kv_split']}, weights {i['weight_format']}")
        lines = [head, "-" * len(head)]
        for r in self:
            lines.append(f"{r['term']:<44} {format_value(r['value'], r['unit']):<34} {r['note']}")
        lines += ["", f"verdict: {self.verdict}"]
        return "\n".join(lines)


def plan(config, gpu: str, tp: int, context: int, *, kv_dtype: str = "bfloat16", weight_format: str = "auto",
         mem_fraction_static: float | None = None, kv_split: str = "replicated",
         overhead_bytes: int = DEFAULT_OVERHEAD_BYTES, speculative: bool = False, draft_weight_bytes: int = 0,
         max_total_tokens: int | None = None) -> Plan:
    """Every term of the per-GPU memory budget for serving `config` on `tp` GPUs, and a verdict.

    `gpu` is a slug of kdlib.hw (rtx-pro-6000, h200, b200, b300); `context` the request length to
    check (tokens). mem_fraction_static None -> SGLang's default heuristic. max_total_tokens caps the
    per-GPU pool as SGLang's --max-total-tokens does (min of it and the profiled size; use it to
    replay a pool size a server logged). Returns a `Plan`.
    A plan that cannot fit says so in its verdict; token counts are never negative.
    """
    _check_split(tp, kv_split)
    if not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be a positive integer (tokens), got {context!r}")
    if draft_weight_bytes < 0:
        raise ValueError(f"draft_weight_bytes must be >= 0, got {draft_weight_bytes}")
    spec = hw.load(gpu)
    g = geometry(config)
    mem = int(spec["memory_bytes"])
    free_before = free_before_weights(mem, overhead_bytes)
    w = weight_bytes(config, weight_format, tp, kv_split)
    weights = w["per_gpu"] + int(draft_weight_bytes)
    if mem_fraction_static is None:
        mfs, reserved, bucket = default_mem_fraction_static(mem, tp, speculative=speculative,
                                                            dp_attention=kv_split == "dp_attention")
        mfs_note = f"SGLang default: reserve {reserved:g} GiB ({bucket})"
        vlm = vlm_mem_fraction_factor(config)
        if vlm != 1.0:
            mfs = mfs * vlm
            mfs_note += f" x {vlm:.3f} for the vision tower"
    elif not 0 < mem_fraction_static < 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static}")
    else:
        mfs, mfs_note = float(mem_fraction_static), "given"
    # A pool slot holds one token's KV on one rank; under DCP a request's tokens are striped over c ranks.
    c = dcp_size(g, tp) if kv_split == "context_parallel" else 1
    cell = kv_bytes_per_token(config, kv_dtype, tp, "replicated" if c > 1 else kv_split)
    static = int(free_before * mfs)
    rest = pool_bytes(mem, weights, mfs, overhead_bytes)
    profiled = pool_tokens(mem, weights, cell, mfs, overhead_bytes) if rest > 0 else 0
    tokens = profiled
    if max_total_tokens is not None:
        if max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be >= 1, got {max_total_tokens}")
        tokens = min(tokens, int(max_total_tokens))
    group_tokens = tokens * tp if kv_split == "dp_attention" else tokens * c
    one_request_tokens = tokens * c  # under DP-attention a request lives on one rank
    derived = sglang_context_length(config)
    source = _context_note(config)
    # SGLang's max_req_len (prompt + output); its prompts stop 5 short of it (max_req_input_len)
    longest = max(0, min(derived, one_request_tokens) - 1)
    if kv_split == "dp_attention":
        concurrent = tp * (tokens // context)
    else:  # under DCP a request takes ceil(context / c) slots of the busiest rank's pool
        concurrent = tokens // math.ceil(context / c)
    if context > longest:  # past the longest request (the context length or one request's pool): none
        concurrent = 0
    need = kv_bytes(config, context, kv_dtype, tp, kv_split)
    mode_note = {
        "replicated": "plain TP: every rank holds every token" if g.attention == "mla"
        else f"plain TP: {kv_heads_per_rank(g, tp)} of {g.num_kv_heads} KV heads per rank",
        "dp_attention": f"DP-attention: a rank holds its own requests; group capacity = {tp} pools",
        "context_parallel": f"DCP {c}: tokens striped over {c} ranks, a slot holds one token on one rank",
    }[kv_split]
    rows = [
        {"key": "gpu_memory", "term": "GPU memory", "value": mem, "unit": "B", "note": spec["name"]},
        {
            "key": "overhead",
            "term": "CUDA context + NCCL before weights",
            "value": overhead_bytes,
            "unit": "B",
            "note": "assumed" if overhead_bytes == DEFAULT_OVERHEAD_BYTES else "given",
        },
        {
            "key": "free_before_weights",
            "term": "free before weights",
            "value": free_before,
            "unit": "B",
            "note": "",
        },
        {
            "key": "mem_fraction_static",
            "term": "mem_fraction_static",
            "value": mfs,
            "unit": "",
            "note": mfs_note,
        },
        {
            "key": "static_budget",
            "term": "static budget (free x fraction)",
            "value": static,
            "unit": "B",
            "note": "weights + KV pool",
        },
        {
            "key": "reserve",
            "term": "reserve (activations, CUDA graphs)",
            "value": free_before - static,
            "unit": "B",
            "note": "free x (1 - fraction)",
        },
        {
            "key": "weights_total",
            "term": "weights, whole model",
            "value": w["total"],
            "unit": "B",
            "note": f"{w['format']}, LM only",
        },
        {
            "key": "weights_per_gpu",
            "term": "weights per GPU",
            "value": weights,
            "unit": "B",
            "note": f"tp={tp}"
            + (", attention replicated (DP-attention)" if kv_split == "dp_attention" else "")
            + (f", + draft {_fmt_bytes(draft_weight_bytes)}" if draft_weight_bytes else ""),
        },
        {
            "key": "kv_pool",
            "term": "KV pool per GPU (rest_memory)",
            "value": max(0, rest),
            "unit": "B",
            "note": "" if rest > 0 else f"nothing left: short by {_fmt_bytes(-rest)}",
        },
        {
            "key": "kv_bytes_per_token",
            "term": "KV bytes per pool slot per GPU",
            "value": cell,
            "unit": "B/token",
            "note": f"{kv_dtype}, {mode_note}",
        },
        {
            "key": "pool_tokens",
            "term": "pool tokens per GPU (max_total_num_tokens)",
            "value": tokens,
            "unit": "tokens",
            "note": "" if max_total_tokens is None else f"capped by max_total_tokens={max_total_tokens:,}",
        },
        {
            "key": "group_tokens",
            "term": f"tokens the {tp}-GPU group holds",
            "value": group_tokens,
            "unit": "tokens",
            "note": mode_note,
        },
        {
            "key": "derived_context",
            "term": "derived context length (SGLang)",
            "value": derived,
            "unit": "tokens",
            "note": f"from {source}",
        },
        {
            "key": "longest_request",
            "term": "longest single request",
            "value": longest,
            "unit": "tokens",
            "note": "SGLang max_req_len = min(context_len, pool) - 1; prompts up to 5 fewer",
        },
        {
            "key": "request_kv",
            "term": f"KV of one {context:,}-token request per GPU",
            "value": need,
            "unit": "B",
            "note": "",
        },
        {
            "key": "concurrent_at_context",
            "term": f"concurrent {context:,}-token requests",
            "value": concurrent,
            "unit": "requests",
            "note": "",
        },
    ]
    inputs = {
        "model": g.name,
        "gpu": gpu,
        "tp": tp,
        "context": context,
        "kv_dtype": kv_dtype,
        "kv_split": kv_split,
        "weight_format": w["format"],
        "mem_fraction_static": mfs,
        "overhead_bytes": overhead_bytes,
        "speculative": speculative,
        "draft_weight_bytes": draft_weight_bytes,
        "max_total_tokens": max_total_tokens,
    }
    pool_needed = kv_bytes(config, context + 1, kv_dtype, tp, kv_split)  # one request of `context` tokens
    if weights >= mem:
        verdict = (f"DOES NOT FIT: the weights alone need {_fmt_bytes(weights)} per GPU, more than the "
                   f"{_fmt_bytes(mem)} a {spec['name']} has; use more GPUs or a smaller weight format.")
        fits = False
    elif rest <= 0:
        need_mfs = mem_fraction_for_pool(mem, weights, pool_needed, overhead_bytes)
        verdict = (
            f"DOES NOT FIT at mem_fraction_static={mfs:g}: the weights ({_fmt_bytes(weights)} per "
            "GPU) leave no "
            f"KV pool (SGLang stops with 'Not enough memory'); one {context:,}-token request would "
            "need "
            f"mem_fraction_static >= {fraction_to_set(need_mfs):.3f}"
            + (" (impossible)" if need_mfs >= 1 else "") + "."
        )
        fits = False
    elif context >= derived:  # max_req_len is context_len - 1 whatever the pool holds
        verdict = (f"DOES NOT FIT the model: {context:,} tokens "
                   + (f"exceed the derived context length {derived:,}" if context > derived
                      else "are the whole derived context length")
                   + f"; SGLang serves at most context_len - 1 = {derived - 1:,} tokens a request "
                   "(max_req_len), whatever the pool holds. A longer context_len needs "
                   "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1, past "
                   + ("the end of the YaRN range." if _is_yarn(text_config(config)) else f"{source}."))
        fits = False
    elif context > longest and tokens < profiled and profiled * c > context:
        # the cap binds, and the pool the fraction gives would hold the request: the cap is the fix
        verdict = (f"ONE {context:,}-TOKEN REQUEST DOES NOT FIT: max_total_tokens={max_total_tokens:,} "
                   f"caps the pool at {one_request_tokens:,} tokens for one request, so the longest is "
                   f"{longest:,}; raise max_total_tokens to >= {math.ceil((context + 1) / c):,} or drop "
                   f"it (the pool at mem_fraction_static={mfs:g} holds {profiled * c:,} tokens for one "
                   "request).")
        fits = False
    elif context > longest:
        need_mfs = mem_fraction_for_pool(mem, weights, pool_needed, overhead_bytes)
        verdict = (f"ONE {context:,}-TOKEN REQUEST DOES NOT FIT: the pool holds {one_request_tokens:,} "
                   "tokens for one "
                   f"request, so the longest is {longest:,}. It needs {_fmt_bytes(need)} of KV per GPU; "
                   "options: "
                   f"mem_fraction_static >= {fraction_to_set(need_mfs):.3f}"
                   + (" (impossible)" if need_mfs >= 1 else "")
                   + (f" with max_total_tokens raised to >= {math.ceil((context + 1) / c):,} or dropped"
                      if tokens < profiled else "")
                   + ", a smaller KV dtype, or context parallelism (DP-attention adds capacity for more "
                     "requests, "
                   "not for a longer one).")
        fits = False
    else:
        verdict = (f"FITS: one {context:,}-token request takes {context / one_request_tokens:.0%} of the "
                   "pool; "
                   f"{concurrent:,} such request(s) at once; longest single request {longest:,} tokens.")
        fits = True
    return Plan(rows, verdict, fits, inputs)


def max_context(config, gpu: str, tp: int, **kwargs) -> int:
    """The longest single request (tokens) a deployment serves; 0 when it does not fit at all.
    kwargs: as for `plan` (kv_dtype, kv_split, weight_format, mem_fraction_static, ...)."""
    return plan(config, gpu, tp, 1, **kwargs).value("longest_request")


def concurrent_requests(config, gpu: str, tp: int, context: int, **kwargs) -> int:
    """How many requests of `context` tokens the deployment's KV pool holds at once (0 when none)."""
    return plan(config, gpu, tp, context, **kwargs).value("concurrent_at_context")


# ----------------------------------------------------------------------------------- the seeds' 200k decision

# The memory figures of the seeds' 200k-context decision for Kimi-K2.6 INT4 on 8 x RTX PRO 6000, TP8
# (seeds/000, "Thread Three: Extending Context Length to 200k"; seeds/002, "Act II"), as they state them.
SEEDS_200K = {
    "model": "kimi-k2.6", "gpu": "rtx-pro-6000", "tp": 8, "context": 200_000,
    "elements_per_token_layer": 576,  # "The per-token KV storage is 576 elements per layer"
    # "each GPU stores only 1/8 ... approximately 8.6 KB per token per GPU"
    "kv_per_token_per_gpu_bytes": 8.6e3,
    "kv_200k_per_gpu_bytes": 1.72e9,  # "A 200k-token context would require roughly 1.72 GB per GPU"
    "free_per_gpu_bytes": 10e9,  # "approximately 10 GB of free memory available after weights, CUDA graphs"
    "pool_tokens": 101_134,  # "The KV cache pool was allocated for approximately 101,134 tokens"
    "max_position_embeddings": 262_144,  # "max_position_embeddings: 262144"
    "yarn_factor": 64.0,  # "YaRN ... scaling at factor 64.0"
    "old_context_length": 32_768,  # "--context-length 32768"
    "model_size_bytes": 548e9,  # seeds/002: "a cold reload of the 548 GB model"
    # seeds/002: "Extending to 200k tokens would increase the cache size by roughly 2x"
    "growth_vs_pool": 2.0,
}


def _agrees(ours: float, theirs: float, rel: float = 0.05) -> str:
    """A recheck row's status: "reproduced" when the seeds' figure lies within rel of ours (same sign),
    else "wrong"."""
    return "reproduced" if ours * theirs > 0 and abs(theirs - ours) <= rel * abs(ours) else "wrong"


def seeds_200k_recheck(seeds: dict | None = None, overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> list[dict]:
    """Each memory figure of the seeds' 200k decision, recomputed: rows {key, claim, seeds, recomputed,
    unit, status, reason, stated}; status is "reproduced", "consistent", "wrong" or "not checkable";
    stated: False where `seeds` is derived from their figures rather than a number they state."""
    s = dict(SEEDS_200K if seeds is None else seeds)
    cfg, gpu, tp, ctx = s["model"], s["gpu"], s["tp"], s["context"]
    g = geometry(cfg)
    y = yarn(cfg)
    full = kv_bytes_per_token(cfg, "bfloat16", tp, "replicated")
    dcp = kv_bytes_per_token(cfg, "bfloat16", tp, "context_parallel")
    pool_b = s["pool_tokens"] * full
    w = weight_bytes(cfg, "auto", tp)
    implied_mfs = implied_mem_fraction(cfg, gpu, tp, s["pool_tokens"], overhead_bytes=overhead_bytes)
    # their server: a hand-set fraction just above the implied one, capped at the logged pool
    deployed = plan(cfg, gpu, tp, ctx, mem_fraction_static=min(implied_mfs + 1e-4, 0.999),
                    max_total_tokens=s["pool_tokens"], overhead_bytes=overhead_bytes)
    default = plan(cfg, gpu, tp, ctx, overhead_bytes=overhead_bytes)
    rows = [
        dict(
            key="elements_per_token_layer",
            claim="KV elements per token per layer",
            seeds=s["elements_per_token_layer"],
            recomputed=g.kv_elements_per_layer,
            unit="elements",
            status="reproduced" if g.kv_elements_per_layer == s["elements_per_token_layer"] else "wrong",
            reason=f"kv_lora_rank {g.kv_lora_rank} + qk_rope_head_dim {g.qk_rope_head_dim}",
        ),
        dict(
            key="kv_per_token_per_gpu",
            claim="KV bytes per token per GPU at TP8",
            seeds=s["kv_per_token_per_gpu_bytes"],
            recomputed=full,
            unit="B/token",
            status=_agrees(full, s["kv_per_token_per_gpu_bytes"]),
            reason=f"SGLang plain TP replicates the MLA latent on every rank: {g.num_layers} x "
            f"{g.kv_elements_per_layer} x 2 B "
            f"= {full:,} B. Their 8.6 'KB' is {dcp:,} B = {dcp / 1024:.2f} KiB, the figure only "
            "decode context "
            f"parallelism over 8 ranks would give",
        ),
        dict(
            key="kv_200k_per_gpu",
            claim="KV of one 200k request per GPU",
            seeds=s["kv_200k_per_gpu_bytes"],
            recomputed=ctx * full,
            unit="B",
            status=_agrees(ctx * full, s["kv_200k_per_gpu_bytes"]),
            reason=f"{ctx:,} x {full:,} B = {ctx * full / 1e9:.2f} GB ({ctx * full / GiB:.2f} GiB). Two "
            "slips: the /8, "
            f"and 8.6 KiB taken as 8,600 B (even under DCP8 it is {ctx * dcp / 1e9:.3f} GB)",
        ),
        dict(
            key="pool_tokens",
            claim="KV pool per GPU (tokens, logged at start-up)",
            seeds=s["pool_tokens"],
            recomputed=default.value("pool_tokens"),
            unit="tokens",
            status="consistent",
            reason=f"their {pool_b / 1e9:.2f} GB pool (bf16) is what mem_fraction_static {implied_mfs:.3f} "
            "gives with our "
            f"weight count ({w['per_gpu'] / GiB:.2f} GiB per GPU) and {overhead_bytes / GiB:g} GiB "
            "assumed overhead, "
            "so the fraction was set by hand ('based on the memory fraction configuration'); "
            "SGLang's own "
            f"default for this multimodal checkpoint, {default.value('mem_fraction_static'):.3f}, "
            "would give the "
            f"recomputed {default.value('pool_tokens'):,} tokens. The pool is sized once at start-up "
            "and bounds "
            f"a request's KV",
        ),
        dict(
            key="free_memory",
            claim="free memory per GPU after weights and CUDA graphs",
            seeds=s["free_per_gpu_bytes"],
            recomputed=None,
            unit="B",
            status="not checkable",
            reason="an observation (nvidia-smi), not derivable from the config; beside the point, because "
            "the "
            "KV pool does not grow into free memory after start-up",
        ),
        dict(
            key="kv_200k_headroom",
            claim="headroom left by one 200k request (budget - need), as their 10 GB and 1.72 GB imply",
            seeds=s["free_per_gpu_bytes"] - s["kv_200k_per_gpu_bytes"],
            recomputed=pool_b - ctx * full,
            unit="B",
            status=_agrees(pool_b - ctx * full, s["free_per_gpu_bytes"] - s["kv_200k_per_gpu_bytes"]),
            reason=f"their budget was free memory (10 GB) and their need 1.72 GB; the budget is the pool, "
            f"{pool_b / 1e9:.2f} GB, and the need {ctx * full / 1e9:.2f} GB: one 200k request needs "
            f"{ctx / s['pool_tokens']:.2f}x the pool",
        ),
        dict(
            key="growth_vs_pool",
            claim="200k versus the current pool",
            seeds=s["growth_vs_pool"],
            recomputed=round(ctx / s["pool_tokens"], 3),
            unit="x",
            status="reproduced" if abs(ctx / s["pool_tokens"] - s["growth_vs_pool"]) < 0.05 else "wrong",
            reason="the arithmetic holds, and it is the answer: a request twice the pool's size cannot be "
            "held "
            "by the pool, whose size does not change when --context-length does",
        ),
        dict(
            key="longest_request",
            claim="longest single request the pool allowed",
            seeds=ctx,
            recomputed=deployed.value("longest_request"),
            unit="tokens",
            status="reproduced" if deployed.value("longest_request") >= ctx else "wrong",
            reason="SGLang max_req_len = min(context_len - 1, max_total_num_tokens - 1): "
            "--context-length "
            "200000 passes start-up (<= the derived 262,144) but longer requests than this are "
            "refused",
        ),
        dict(
            key="max_position_embeddings",
            claim="max_position_embeddings",
            seeds=s["max_position_embeddings"],
            recomputed=y["max_position_embeddings"],
            unit="tokens",
            status="reproduced" if y["max_position_embeddings"] == s["max_position_embeddings"] else "wrong",
            reason=f"= factor x original = {y['factor']:g} x {y['original_max_position_embeddings']:,} = "
            f"{y['factor_x_original']:,}; SGLang derives context {y['sglang_context_length']:,}",
        ),
        dict(
            key="yarn_factor",
            claim="YaRN factor",
            seeds=s["yarn_factor"],
            recomputed=y["factor"],
            unit="",
            status="reproduced" if y["factor"] == s["yarn_factor"] else "wrong",
            reason=f"static YaRN: attention logits x (0.1 ln {y['factor']:g} + 1)^2 = "
            f"{y['logit_scale_factor']:.4f} "
            f"at every length",
        ),
        dict(
            key="model_size",
            claim="checkpoint size",
            seeds=s["model_size_bytes"],
            recomputed=w["total"],
            unit="B",
            status="consistent"
            if abs(w["total"] / GiB * 1e9 / s["model_size_bytes"] - 1) < 0.02
            else "wrong",
            reason=f"INT4 g32 routed experts + bf16 rest = {w['total'] / 1e9:.1f} GB = "
            f"{w['total'] / GiB:.1f} GiB (LM only, "
            f"vision tower left out); the seeds' 548 'GB' is within "
            f"{abs(w['total'] / GiB * 1e9 / s['model_size_bytes'] - 1):.1%} of the GiB figure "
            "(likely a du -h "
            f"reading), {1 - s['model_size_bytes'] / w['total']:.0%} below the decimal one",
        ),
    ]
    for r in rows:
        r["stated"] = r["key"] != "kv_200k_headroom"  # the one figure derived (10 GB - 1.72 GB)
    return rows


# ----------------------------------------------------------------------------------------- CLI

def cli(argv: list[str] | None = None) -> int:
    """`kdlib memory CONFIG --gpu GPU --tp N --context T [...]`: print the memory plan.
    Bad input, or a deployment the model cannot be split over, is one line on stderr and exit 2."""
    ap = Parser(prog="kdlib memory", description="KV-cache and weight memory plan from a config.json "
                f"(shipped configs: {', '.join(shipped())})")
    ap.add_argument("config", help="a shipped config name, a config.json, or a directory holding one")
    ap.add_argument("--gpu", required=True, help=f"one of {', '.join(hw.slugs())}")
    ap.add_argument("--tp", type=positive_int, required=True,
                    help="tensor-parallel size (GPUs); must split the routed experts, and the attention "
                         "heads unless --kv-split dp_attention (attention then is not split)")
    ap.add_argument("--context", type=positive_int, required=True, help="request length to check, tokens")
    ap.add_argument("--kv-dtype", default="bfloat16", help=f"KV dtype: {', '.join(DTYPE_BYTES)} or auto")
    ap.add_argument("--kv-split", default="replicated", choices=KV_SPLITS)
    ap.add_argument("--weight-format", default="auto",
                    help=f"{', '.join(WEIGHT_FORMATS)} or int4_g<N> (N >= 1)")
    ap.add_argument("--mem-fraction-static", type=fraction, default=None,
                    help="in (0, 1); default: SGLang's heuristic")
    ap.add_argument("--overhead-gib", type=nonnegative_float, default=DEFAULT_OVERHEAD_BYTES / GiB,
                    help="memory taken before weights load (CUDA context, NCCL), GiB, below the GPU's "
                         "memory; an assumption")
    ap.add_argument("--speculative", action="store_true",
                    help="add SGLang's +2 GiB speculative reserve to its default fraction (as SGLang, "
                         "nothing with --mem-fraction-static)")
    ap.add_argument("--max-total-tokens", type=positive_int, default=None,
                    help="cap the per-GPU pool (SGLang --max-total-tokens)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)
    try:
        p = plan(
            args.config,
            args.gpu,
            args.tp,
            args.context,
            kv_dtype=args.kv_dtype,
            weight_format=args.weight_format,
            mem_fraction_static=args.mem_fraction_static,
            kv_split=args.kv_split,
            overhead_bytes=int(args.overhead_gib * GiB),
            speculative=args.speculative,
            max_total_tokens=args.max_total_tokens,
        )
    except ValueError as e:
        return fail(ap.prog, e)
    print(json.dumps(p.to_dict(), indent=1) if args.json else p)
    return 0
