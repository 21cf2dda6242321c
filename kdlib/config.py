"""The one reader of a Hugging Face `config.json`, and the one YaRN, for every kdlib module.

    lm = text_config("kimi-k2.6")                   # the language-model part, a dict (name, path or dict)
    g = geometry("qwen3-30b-a3b")                   # attention / KV geometry of any family: MLA, GQA, MHA
    cfg = ModelConfig.load("tiny-a")                # the engine's typed view (DeepSeek-V3 / Kimi-K2 families)
    cfg.softmax_scale, cfg.rope.attention_scale(), rope_inv_freq(cfg)   # [rope / 2] float64

`config` is a dict (a parsed config.json), a path to a config.json (or to a directory holding one),
or the name of a shipped config: a file stem in `data/configs/` (`shipped()` lists them).
Multimodal wrappers (`kimi_k25`: Kimi-K2.5 / K2.6) keep the language model under `text_config`.

Three views of one file, from loose to strict: `text_config` (the dict itself, for fields only one
module reads), `geometry` (what the memory math needs, for every family it models) and
`ModelConfig` (every architectural field the engine runs, validated; the estimator's `ModelShape`
is made from it). A missing field or an unsupported value raises `ConfigError`, a ValueError whose
message names the field.

RoPE parameters are read from transformers-5 `rope_parameters` (with `rope_theta` inside) or from
the older `rope_scaling` + top-level `rope_theta`; the type key may be `type` or `rope_type`
(models-hardware.md §1.6). YaRN follows transformers' `_compute_yarn_parameters`
(models-hardware.md §3): with d the rotary width, pair i has the frequency
base^(-2i/d) (1 - ramp_i) + base^(-2i/d) / factor ramp_i, ramp_i = clip((i - low) / (high - low), 0, 1),
low / high the pair index where the original context turns beta_fast / beta_slow rotations
(floored / ceiled when `truncate`; low >= 0, high <= d - 1); cos/sin carry `attention_factor` (default
mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else mscale(factor, 1)),
and DeepSeek-V3 multiplies the softmax scale by mscale(factor, mscale_all_dim)^2 when mscale_all_dim
is set; mscale(s, m) = 0.1 m ln s + 1 for s > 1, else 1. Pure Python: numpy is imported only by
`rope_inv_freq`.
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kdlib import DATA

CONFIGS = DATA / "configs"
SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "kimi_k25")
# The router and layout fields a DeepSeek-V3 config may leave out, as transformers' DeepseekV3Config has them
# (q_lora_rank: a config leaving it out has the query LoRA; null is the one without, as DeepSeek-V2-Lite's)
DEEPSEEK_V3_DEFAULTS = {"n_shared_experts": 1, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
                        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": 1536}
# A config is MLA when it has any MLA field or an MLA model_type; then every MLA field is required,
# so a DeepSeek config that lost kv_lora_rank is an error, not a silent MHA reading.
MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim")
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


class ConfigError(ValueError):
    """A config.json that lacks a field a reader needs, or holds an unsupported value: the message
    names it."""


# ----------------------------------------------------------------------------------------- files

def shipped() -> list[str]:
    """Names of the shipped configs (file stems in data/configs/: real models and the engine's tiny ones)."""
    return sorted(p.stem for p in CONFIGS.glob("*.json"))


def config_file(config: str | os.PathLike) -> Path:
    """The config.json file a path (file or directory) or a shipped name stands for; ValueError naming
    `config` where there is none."""
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"no config {str(config)!r}: a folder that holds no config.json")
    elif not path.exists() and str(config) in shipped():
        path = CONFIGS / f"{config}.json"
    if not path.is_file():
        raise ValueError(f"no config {str(config)!r}: not a file, and not one of the shipped configs "
                         f"{shipped()}")
    return path


def load_config(config) -> dict:
    """The parsed config.json (a fresh copy): from a dict, a path (file or directory), or a shipped name.

    The returned dict gets a `_name` key (file stem, directory name or the dict's own `_name`) used in
    error messages and tables.
    """
    if isinstance(config, dict):
        cfg = copy.deepcopy(config)
        cfg.setdefault("_name", cfg.get("_name") or cfg.get("model_type") or "config")
        return cfg
    if not isinstance(config, str | os.PathLike):
        raise ValueError(f"config must be a dict, a path or a shipped name, got {type(config).__name__}")
    path = config_file(config)
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text, so no config.json ({e.reason} at byte {e.start})") from e
    except OSError as e:  # unreadable: permissions, a device file
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: a config.json must hold a JSON object")
    cfg["_name"] = path.parent.name if path.name == "config.json" else path.stem
    return cfg


def text_config(config) -> dict:
    """The language-model part of a config: `text_config` for multimodal wrappers, else the config.

    Fields the wrapper keeps at top level (quantization_config, torch_dtype) are carried down when
    the text part lacks them (models-hardware.md §1.6).
    """
    cfg = load_config(config)
    if "text_config" not in cfg:
        return cfg
    lm = copy.deepcopy(cfg["text_config"])
    if not isinstance(lm, dict):
        raise ConfigError(f"config {cfg['_name']}: text_config is not an object")
    for key in ("quantization_config", "torch_dtype"):
        if key not in lm and key in cfg:
            lm[key] = cfg[key]
    lm["_name"] = cfg["_name"]
    lm["_wrapper_model_type"] = cfg.get("model_type")
    return lm


def require(lm: dict, key: str, why: str, minimum: int = 1) -> int:
    """lm[key], a size: a whole number >= minimum (61.0 reads as 61); ConfigError naming the field (and
    what needs it) otherwise, NaN, 61.9 and 0 (below a minimum of 1) included."""
    if lm.get(key) is None:
        raise ConfigError(f"config {lm.get('_name', '?')}: missing field {key!r} (needed for {why})")
    value = lm[key]
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ConfigError(f"config {lm.get('_name', '?')}: field {key!r} must be a number, got {value!r}")
    if not (math.isfinite(value) and value == int(value) and value >= minimum):
        raise ConfigError(f"config {lm.get('_name', '?')}: field {key!r} must be a whole number >= {minimum} "
                          f"(a size), got {value!r}")
    return int(value)


def rope_block(lm: dict) -> dict | None:
    """The RoPE block: `rope_parameters` (transformers >= 5) or `rope_scaling`; None when neither is
    a dict."""
    block = lm.get("rope_parameters") or lm.get("rope_scaling")
    return block if isinstance(block, dict) else None


def rope_type(lm: dict) -> str | None:
    """The RoPE type of a config ("yarn", "llama3", "default", ...; `rope_type` or `type`), None
    without one."""
    block = rope_block(lm)
    return (block.get("rope_type") or block.get("type")) if block else None


# ----------------------------------------------------------------------------------------- geometry

@dataclass(frozen=True)
class Geometry:
    """The attention / KV geometry of a config's language model, for every family the memory math models."""

    name: str
    model_type: str
    attention: str  # "mla" | "gqa" | "mha"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int  # GQA/MHA KV heads; 1 for MLA (the latent is one shared "head")
    head_dim: int  # GQA/MHA K head dim; for MLA qk_nope + qk_rope (192 for K2/V3, not hidden/heads)
    v_head_dim: int
    kv_lora_rank: int | None
    qk_rope_head_dim: int | None
    vocab_size: int
    torch_dtype: str
    mtp_layers: int

    @property
    def kv_elements_per_layer(self) -> int:
        """Elements cached per token per layer, whole model: 576 for K2 / DeepSeek-V3."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return self.num_kv_heads * (self.head_dim + self.v_head_dim)

    @property
    def rotary_dim(self) -> int:
        """Width RoPE rotates: qk_rope_head_dim for MLA, the whole head for GQA/MHA."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim


def geometry(config) -> Geometry:
    """Parse the attention / KV geometry of a config. ConfigError names any missing field."""
    lm = text_config(config)
    layers = require(lm, "num_hidden_layers", "the KV cache (one entry per layer)")
    hidden = require(lm, "hidden_size", "weights")
    heads = require(lm, "num_attention_heads", "attention")
    if any(lm.get(k) is not None for k in MLA_FIELDS) or lm.get("model_type") in MLA_MODEL_TYPES:
        kv_lora = require(lm, "kv_lora_rank", "the MLA latent cache")
        rope = require(lm, "qk_rope_head_dim", "the MLA latent cache (the shared RoPE key)", minimum=0)
        nope = require(lm, "qk_nope_head_dim", "MLA head dims")
        v = require(lm, "v_head_dim", "MLA head dims")
        kind, kv_heads, head_dim = "mla", 1, nope + rope
    else:
        kv_heads = lm.get("num_key_value_heads") or heads
        head_dim = lm.get("head_dim") or hidden // heads
        v = head_dim
        kv_lora = rope = None
        kind = "mha" if kv_heads == heads else "gqa"
        if heads % kv_heads:
            raise ConfigError(f"config {lm['_name']}: num_attention_heads {heads} not a multiple of "
                              f"num_key_value_heads {kv_heads}")
    return Geometry(
        name=lm["_name"],
        model_type=str(lm.get("model_type", "?")),
        attention=kind,
        num_layers=int(layers),
        hidden_size=int(hidden),
        num_heads=int(heads),
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        v_head_dim=int(v),
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope,
        vocab_size=int(require(lm, "vocab_size", "embeddings")),
        torch_dtype=str(lm.get("torch_dtype") or "bfloat16"),
        mtp_layers=int(lm.get("num_nextn_predict_layers") or 0),
    )


# ----------------------------------------------------------------------------------------- YaRN

def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude 0.1 * mscale * ln(s) + 1 (1 for s <= 1): DeepSeek / SGLang / vLLM yarn_get_mscale."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE parameters as transformers' `_compute_yarn_parameters` reads them (models-hardware.md §3)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def attention_scale(self) -> float:
        """The cos/sin magnitude: `attention_factor`, else mscale(f, mscale) / mscale(f, mscale_all_dim) when
        both are set (1.0 for V3/K2, where they are equal), else mscale(f, 1)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def softmax_factor(self) -> float:
        """What DeepSeek-V3 multiplies the softmax scale by: mscale(f, mscale_all_dim)^2 when set, else 1."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def correction_range(self, rotary_dim: int, base: float) -> tuple[float, float]:
        """(low, high) rotary-pair indices of the ramp: where the original context turns beta_fast and
        beta_slow rotations, floored / ceiled when `truncate`; low at least 0, high at most rotary_dim - 1."""
        def dim(rotations):
            return (rotary_dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
                    / (2 * math.log(base)))

        low, high = dim(self.beta_fast), dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, rotary_dim - 1)


def rope_inv_freq(cfg: ModelConfig):
    """Inverse frequencies [qk_rope_head_dim / 2] float64 (numpy), YaRN-blended when configured."""
    import numpy as np

    d, r = cfg.qk_rope_head_dim, cfg.rope
    pos_freqs = cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)  # [d / 2]
    extrap = 1.0 / pos_freqs
    if r is None:
        return extrap
    interp = 1.0 / (r.factor * pos_freqs)
    low, high = r.correction_range(d, cfg.rope_theta)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)  # [d / 2]
    extrap_weight = 1.0 - ramp
    return interp * (1.0 - extrap_weight) + extrap * extrap_weight


# ----------------------------------------------------------------------------------------- engine view

@dataclass(frozen=True)
class ModelConfig:
    """Every architectural field the engine uses. Sizes are per the HF names; see `from_dict`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope: YarnScaling | None = None
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    model_type: str = "deepseek_v3"
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived -------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """q/k head width = nope + rope (192 for V3/K2), not hidden/heads (models-hardware.md §1.6)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Latent KV cache row per token per layer: kv_lora_rank + qk_rope_head_dim (576 for V3/K2)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def is_moe_layer(self) -> list[bool]:
        return [i >= self.first_k_dense_replace for i in range(self.num_hidden_layers)]

    @property
    def yarn_factor(self) -> float:
        return self.rope.factor if self.rope is not None else 1.0

    @property
    def rope_attention_factor(self) -> float:
        """The cos/sin magnitude (`YarnScaling.attention_scale`; 1.0 without YaRN)."""
        return self.rope.attention_scale() if self.rope is not None else 1.0

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 when mscale_all_dim is set."""
        return self.qk_head_dim**-0.5 * (self.rope.softmax_factor() if self.rope is not None else 1.0)

    # ---- parsing -------------------------------------------------------------------------------
    @classmethod
    def load(cls, config) -> ModelConfig:
        """From a dict, a path (file or directory) or a shipped name (`load_config`)."""
        return cls.from_dict(load_config(config))

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """From a path (file or directory) or a shipped name, as `load`; a field's error names the file."""
        p = config_file(path)
        d = load_config(p)
        try:
            return cls.from_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{p}: {e}") from None

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """Parse a HF config dict. Raises ConfigError naming the first missing or unsupported field."""
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a dict, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type: {model_type!r} is not supported (supported: "
                              f"{SUPPORTED_MODEL_TYPES})")
        if model_type == "kimi_k25":
            text = d.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("text_config: required for model_type 'kimi_k25' (the LM config lives "
                                  "there)")
            inner = dict(text)
            inner.setdefault("model_type", "kimi_k2")
            # a composite model's output head follows the wrapper's tie_word_embeddings (transformers)
            if "tie_word_embeddings" in d:
                tie = d["tie_word_embeddings"]
                if inner.get("tie_word_embeddings", tie) != tie:
                    raise ConfigError(f"tie_word_embeddings: the wrapper says {d['tie_word_embeddings']!r}, "
                                      f"text_config says {inner['tie_word_embeddings']!r}")
                inner["tie_word_embeddings"] = d["tie_word_embeddings"]
            if inner["model_type"] not in ("deepseek_v3", "kimi_k2"):
                raise ConfigError(f"text_config.model_type: {inner['model_type']!r} is not supported")
            cfg = cls.from_dict(inner)
            return replace(cfg, model_type="kimi_k25")

        def req(name, kind):
            if name not in d or d[name] is None:
                raise ConfigError(f"{name}: required field is missing")
            return _typed(name, d[name], kind)

        def opt(name, kind, default):
            v = d.get(name, default)
            return default if v is None else _typed(name, v, kind)

        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ConfigError(f"hidden_act: {hidden_act!r} is not supported (SwiGLU needs 'silu')")
        scoring = d.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ConfigError(f"scoring_func: {scoring!r} is not supported (only 'sigmoid', DeepSeek-V3 "
                              "routing)")
        topk_method = d.get("topk_method", "noaux_tc")
        if topk_method != "noaux_tc":
            raise ConfigError(f"topk_method: {topk_method!r} is not supported (only 'noaux_tc')")
        if d.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"moe_layer_freq: {d['moe_layer_freq']!r} is not supported (only 1)")
        if d.get("attention_bias", False):
            raise ConfigError("attention_bias: true is not supported (DeepSeek-V3 projections have no bias)")

        rope_theta, rope = parse_rope(d)
        q_lora = d.get("q_lora_rank", DEEPSEEK_V3_DEFAULTS["q_lora_rank"])
        cfg = cls(
            vocab_size=req("vocab_size", int),
            hidden_size=req("hidden_size", int),
            intermediate_size=req("intermediate_size", int),
            moe_intermediate_size=req("moe_intermediate_size", int),
            num_hidden_layers=req("num_hidden_layers", int),
            num_attention_heads=req("num_attention_heads", int),
            q_lora_rank=None if q_lora in (None, 0) else _typed("q_lora_rank", q_lora, int),
            kv_lora_rank=req("kv_lora_rank", int),
            qk_nope_head_dim=req("qk_nope_head_dim", int),
            qk_rope_head_dim=req("qk_rope_head_dim", int),
            v_head_dim=req("v_head_dim", int),
            n_routed_experts=req("n_routed_experts", int),
            # a field left out reads as transformers' DeepseekV3Config has it (the router it builds)
            n_shared_experts=opt("n_shared_experts", int, DEEPSEEK_V3_DEFAULTS["n_shared_experts"]),
            num_experts_per_tok=req("num_experts_per_tok", int),
            first_k_dense_replace=opt("first_k_dense_replace", int,
                                      DEEPSEEK_V3_DEFAULTS["first_k_dense_replace"]),
            n_group=opt("n_group", int, DEEPSEEK_V3_DEFAULTS["n_group"]),
            topk_group=opt("topk_group", int, DEEPSEEK_V3_DEFAULTS["topk_group"]),
            routed_scaling_factor=opt("routed_scaling_factor", float,
                                      DEEPSEEK_V3_DEFAULTS["routed_scaling_factor"]),
            norm_topk_prob=opt("norm_topk_prob", bool, DEEPSEEK_V3_DEFAULTS["norm_topk_prob"]),
            rms_norm_eps=req("rms_norm_eps", float),
            rope_theta=rope_theta,
            max_position_embeddings=req("max_position_embeddings", int),
            rope=rope,
            rope_interleave=opt("rope_interleave", bool, True),
            tie_word_embeddings=opt("tie_word_embeddings", bool, False),
            model_type=model_type,
            extra={k: d[k] for k in ("bos_token_id", "eos_token_id", "num_nextn_predict_layers") if k in d},
        )
        try:
            cfg.validate()
        except ConfigError as e:
            field = str(e).split(":", 1)[0]
            if field in DEEPSEEK_V3_DEFAULTS and d.get(field) is None:  # a value the config did not give
                raise ConfigError(f"{e} (absent from the config: transformers' DeepseekV3Config default; "
                                  "give the field)") from None
            raise
        return cfg

    def validate(self) -> None:
        """Cross-field checks (ConfigError naming the field)."""
        positive = [
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "max_position_embeddings",
        ]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("n_shared_experts", "first_k_dense_replace"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"q_lora_rank: must be > 0 or null, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim: must be even (pairs rotate), got {self.qk_rope_head_dim}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError("first_k_dense_replace: must be in [0, num_hidden_layers], got "
                              f"{self.first_k_dense_replace}")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"n_group: {self.n_group} does not divide n_routed_experts "
                              f"{self.n_routed_experts}")
        per_group = self.n_routed_experts // self.n_group
        if per_group < 2 and self.n_group > 1:
            raise ConfigError(f"n_group: group scores take the top-2 experts of each group; {per_group} per "
                              "group is too few")
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group: {self.topk_group} exceeds n_group {self.n_group}")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ConfigError(
                f"num_experts_per_tok: {self.num_experts_per_tok} exceeds the experts left after group "
                f"selection ({self.topk_group} x {per_group})"
            )
        if self.rms_norm_eps <= 0:
            raise ConfigError(f"rms_norm_eps: must be > 0, got {self.rms_norm_eps}")
        if self.rope_theta <= 1:
            raise ConfigError(f"rope_theta: must be > 1, got {self.rope_theta}")
        if self.rope is not None:
            if self.rope.factor <= 0:
                raise ConfigError(f"rope_scaling.factor: must be > 0, got {self.rope.factor}")
            if self.rope.original_max_position_embeddings <= 0:
                raise ConfigError("rope_scaling.original_max_position_embeddings: must be > 0")
            if not self.rope.beta_fast >= self.rope.beta_slow > 0:  # Kimi-K2's are 1 and 1
                raise ConfigError("rope_scaling.beta_fast / beta_slow: need beta_fast >= beta_slow > 0 (the "
                                  f"ramp runs from fast to slow rotations), got {self.rope.beta_fast} / "
                                  f"{self.rope.beta_slow}")
            for name in ("mscale", "mscale_all_dim", "attention_factor"):  # 0 reads as unset, as transformers
                value = getattr(self.rope, name)
                if value is not None and value < 0:
                    raise ConfigError(f"rope_scaling.{name}: must be >= 0 or absent, got {value}")
        if not self.routed_scaling_factor > 0:
            raise ConfigError(f"routed_scaling_factor: must be > 0, got {self.routed_scaling_factor}")

    def to_hf_dict(self) -> dict:
        """A transformers-5 style config.json dict (`rope_parameters`) of the language model, a
        DeepseekV3ForCausalLM that transformers loads as it is: `from_dict` of it gives this config back,
        except that the model_type is always deepseek_v3 (kimi_k2 names remote code transformers does not
        ship; a kimi_k25 wrapper's vision part is not the engine's)."""
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope is not None:
            r = asdict(self.rope)
            rope = {"rope_theta": self.rope_theta, "rope_type": "yarn",
                    **{k: v for k, v in r.items() if v is not None and k != "truncate"}}
            if not self.rope.truncate:
                rope["truncate"] = False
        d = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "first_k_dense_replace": self.first_k_dense_replace,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": rope,
            "rope_interleave": self.rope_interleave,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "num_nextn_predict_layers": 0,
            **{k: self.extra[k] for k in ("bos_token_id", "eos_token_id") if k in self.extra},
        }
        return d


def _typed(name, value, kind):
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true/false, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not (
            isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        ):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        return int(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{name}: must be finite, got {value!r}")
    return float(value)


def _rope_differences(a, b) -> list[str]:
    """The fields on which two RoPE blocks disagree: the type ('default' where none is named), then
    every field both set."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return [] if a == b else ["the block itself"]

    def kind(block):
        k = block.get("rope_type", block.get("type")) or "default"
        return "yarn" if k == "deepseek_yarn" else k

    named = {"type", "rope_type"}
    return (["rope_type"] if kind(a) != kind(b) else []) + sorted(
        k for k in (set(a) & set(b)) - named if a[k] != b[k])


def parse_rope(d: dict) -> tuple[float, YarnScaling | None]:
    """(rope_theta, YaRN or None) from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta`."""
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    if params and scaling:
        differ = _rope_differences(params, scaling)
        if differ:
            raise ConfigError(f"rope_parameters and rope_scaling disagree on {differ}; keep one")
    src = "rope_parameters" if params else "rope_scaling"
    block = params or scaling or {}
    if not isinstance(block, dict):
        raise ConfigError(f"{src}: expected a dict, got {block!r}")
    theta = block.get("rope_theta", d.get("rope_theta"))
    if theta is None:
        raise ConfigError("rope_theta: required field is missing (top level or inside rope_parameters)")
    theta = _typed("rope_theta", theta, float)
    kind = block.get("rope_type", block.get("type", "default"))
    if kind in ("default", None) and "factor" not in block:
        return theta, None
    if kind in ("default", None):
        raise ConfigError(f"{src}.factor: a 'default' RoPE is not scaled; scaling needs rope_type 'yarn'")
    if kind not in ("yarn", "deepseek_yarn"):
        raise ConfigError(f"{src}.rope_type: {kind!r} is not supported (only 'default' and 'yarn')")
    factor = block.get("factor")
    orig = block.get("original_max_position_embeddings")
    if orig is None:
        raise ConfigError(f"{src}.original_max_position_embeddings: required for YaRN")
    orig = _typed(f"{src}.original_max_position_embeddings", orig, int)
    if orig < 1:
        raise ConfigError(f"{src}.original_max_position_embeddings: must be >= 1, got {orig}")
    if factor is None:  # transformers derives it from the two lengths when absent
        factor = _typed("max_position_embeddings", d.get("max_position_embeddings", 0), int) / orig
    # transformers treats beta 0 / missing as its default 32 / 1 (`or` in _compute_yarn_parameters).
    beta_fast = block.get("beta_fast") or 32.0
    beta_slow = block.get("beta_slow") or 1.0
    opt = {k: (None if block.get(k) is None else _typed(f"{src}.{k}", block[k], float))
           for k in ("mscale", "mscale_all_dim", "attention_factor")}
    truncate = block.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{src}.truncate: expected true/false, got {truncate!r}")
    factor = _typed(f"{src}.factor", factor, float)
    if factor < 1:
        raise ConfigError(f"{src}.factor: YaRN extends the context, so it must be >= 1, got {factor}")
    return theta, YarnScaling(
        factor=factor,
        original_max_position_embeddings=orig,
        beta_fast=_typed(f"{src}.beta_fast", beta_fast, float),
        beta_slow=_typed(f"{src}.beta_slow", beta_slow, float),
        truncate=truncate,
        **opt,
    )
