"""Model configuration from a Hugging Face `config.json` (DeepSeek-V3 / Kimi-K2 / Kimi-K2.5 families).

    cfg = ModelConfig.from_json("data/configs/tiny-a.json")      # or ModelConfig.from_dict(d)
    cfg.softmax_scale, cfg.rope.factor, cfg.to_hf_dict()

Accepted `model_type`: `deepseek_v3`, `kimi_k2`, and `kimi_k25` (the LM lives under `text_config`).
RoPE parameters are read from transformers-5 `rope_parameters` (with `rope_theta` inside) or from the
older `rope_scaling` + top-level `rope_theta`; the type key may be `type` or `rope_type`
(models-hardware.md §1.6). A missing required field or an unsupported value raises `ConfigError`
(a ValueError) naming the field. Pure Python: the torch model, the numpy golden forward and the
memory math all read this one dataclass.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "kimi_k25")


class ConfigError(ValueError):
    """A config.json that the engine cannot run: the message names the field."""


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
        """The cos/sin magnitude: HF `attention_factor` (1.0 for V3/K2 where mscale == mscale_all_dim)."""
        r = self.rope
        if r is None:
            return 1.0
        if r.attention_factor is not None:
            return float(r.attention_factor)
        if r.mscale and r.mscale_all_dim:
            return _yarn_mscale(r.factor, r.mscale) / _yarn_mscale(r.factor, r.mscale_all_dim)
        return _yarn_mscale(r.factor, 1.0)

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-1/2, times yarn_mscale(factor, mscale_all_dim)^2 when mscale_all_dim is set."""
        scale = self.qk_head_dim**-0.5
        if self.rope is not None and self.rope.mscale_all_dim:
            m = _yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    # ---- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from e
        return cls.from_dict(d)

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

        rope_theta, rope = _parse_rope(d)
        q_lora = d.get("q_lora_rank")
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
            n_shared_experts=opt("n_shared_experts", int, 0),
            num_experts_per_tok=req("num_experts_per_tok", int),
            first_k_dense_replace=opt("first_k_dense_replace", int, 0),
            n_group=opt("n_group", int, 1),
            topk_group=opt("topk_group", int, 1),
            routed_scaling_factor=opt("routed_scaling_factor", float, 1.0),
            norm_topk_prob=opt("norm_topk_prob", bool, False),
            rms_norm_eps=req("rms_norm_eps", float),
            rope_theta=rope_theta,
            max_position_embeddings=req("max_position_embeddings", int),
            rope=rope,
            rope_interleave=opt("rope_interleave", bool, True),
            tie_word_embeddings=opt("tie_word_embeddings", bool, False),
            model_type=model_type,
            extra={k: d[k] for k in ("bos_token_id", "eos_token_id", "num_nextn_predict_layers") if k in d},
        )
        cfg.validate()
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

    def to_hf_dict(self) -> dict:
        """A transformers-5 style config.json dict (`rope_parameters`) that round-trips through `from_dict`."""
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope is not None:
            r = asdict(self.rope)
            rope = {"rope_theta": self.rope_theta, "rope_type": "yarn",
                    **{k: v for k, v in r.items() if v is not None and k != "truncate"}}
            if not self.rope.truncate:
                rope["truncate"] = False
        d = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3" if self.model_type == "kimi_k25" else self.model_type,
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
        }
        return d


def _yarn_mscale(scale: float, mscale: float) -> float:
    """YaRN magnitude 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1); models-hardware.md §3 step 7."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


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


def _parse_rope(d: dict) -> tuple[float, YarnScaling | None]:
    """(rope_theta, YaRN or None) from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta`."""
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
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
    if kind not in ("yarn", "deepseek_yarn"):
        raise ConfigError(f"{src}.rope_type: {kind!r} is not supported (only 'default' and 'yarn')")
    factor = block.get("factor")
    orig = block.get("original_max_position_embeddings")
    if orig is None:
        raise ConfigError(f"{src}.original_max_position_embeddings: required for YaRN")
    orig = _typed(f"{src}.original_max_position_embeddings", orig, int)
    if factor is None:  # transformers derives it from the two lengths when absent
        factor = d.get("max_position_embeddings", 0) / orig
    # transformers treats beta 0 / missing as its default 32 / 1 (`or` in _compute_yarn_parameters).
    beta_fast = block.get("beta_fast") or 32.0
    beta_slow = block.get("beta_slow") or 1.0
    opt = {k: (None if block.get(k) is None else _typed(f"{src}.{k}", block[k], float))
           for k in ("mscale", "mscale_all_dim", "attention_factor")}
    truncate = block.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{src}.truncate: expected true/false, got {truncate!r}")
    return theta, YarnScaling(
        factor=_typed(f"{src}.factor", factor, float),
        original_max_position_embeddings=orig,
        beta_fast=_typed(f"{src}.beta_fast", beta_fast, float),
        beta_slow=_typed(f"{src}.beta_slow", beta_slow, float),
        truncate=truncate,
        **opt,
    )
