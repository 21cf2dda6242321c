"""Weights: Hugging Face checkpoint loading and saving, deterministic random weights.

    layout = checkpoint_layout(Path("hf_dir"), cfg)    # name -> (file, stored name), headers checked
    w = random_weights(cfg, seed=0)                    # float32 arrays by name (same seed + numpy build)
    random_weights_on_device(model, seed=0)            # the same scales drawn by torch on the model's device
    save_pretrained(model, "out_dir")                  # config.json + model.safetensors (HF layout)

Checkpoint names are the transformers DeepseekV3 ones (per-expert `mlp.experts.{e}.gate_proj.weight`,
as `save_pretrained` writes them). Multi-token-prediction layers (layer index >= num_hidden_layers,
DeepSeek-V3 README_WEIGHTS) are skipped; an untied checkpoint without `lm_head.weight` is an error;
block-FP8 / INT4 checkpoints (`*_scale_inv`, `weight_packed`) are refused: the MVP engine loads
dense float weights only. A Kimi-K2.5 / K2.6 wrapper checkpoint (`kimi_k25`) keeps the language model's
weights under `language_model.`, which is stripped, and its vision tower and projector beside them, which are
skipped. KDTR <-> safetensors conversion is `kdlib.kdtr.to_safetensors` / `from_safetensors`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from kdlib.engine.config import ModelConfig
from kdlib.files import atomic_write_path, atomic_write_text


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of the model under its HF name, in a fixed order, with its shape."""
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, H)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if cfg.q_lora_rank is None:
            out[a + "q_proj.weight"] = (nh * cfg.qk_head_dim, H)
        else:
            out[a + "q_a_proj.weight"] = (cfg.q_lora_rank, H)
            out[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            out[a + "q_b_proj.weight"] = (nh * cfg.qk_head_dim, cfg.q_lora_rank)
        out[a + "kv_a_proj_with_mqa.weight"] = (cfg.latent_dim, H)
        out[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
        out[a + "kv_b_proj.weight"] = (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        out[a + "o_proj.weight"] = (H, nh * cfg.v_head_dim)
        m = p + "mlp."
        if i < cfg.first_k_dense_replace:
            out.update(_mlp(m, H, cfg.intermediate_size))
        else:
            out[m + "gate.weight"] = (cfg.n_routed_experts, H)
            out[m + "gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
            for e in range(cfg.n_routed_experts):
                out.update(_mlp(f"{m}experts.{e}.", H, cfg.moe_intermediate_size))
            if cfg.n_shared_experts:
                out.update(_mlp(m + "shared_experts.", H, cfg.moe_intermediate_size * cfg.n_shared_experts))
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "post_attention_layernorm.weight"] = (H,)
    out["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, H)
    return out


def _mlp(prefix, hidden, inter):
    return {prefix + "gate_proj.weight": (inter, hidden), prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter)}


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Deterministic float32 weights from numpy's PCG64: the same seed gives the same weights on the same
    numpy build and machine, which is all numpy's random compatibility policy promises (a later numpy may
    change the stream).

    Scales keep a random tiny model away from a flat output: linear weights N(0, 1/fan_in) (unit
    gain), embeddings N(0, 1), norm weights 1 + N(0, 0.1) and a router bias N(0, 0.1) so that every
    parameter's role is exercised (a model of all-ones norms would hide a norm bug).
    """
    rng = np.random.Generator(np.random.PCG64(seed))
    out = {}
    for name, shape in parameter_shapes(cfg).items():
        if name.endswith("norm.weight"):
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("e_score_correction_bias"):
            a = 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            a = rng.standard_normal(shape)
        else:
            a = rng.standard_normal(shape) / np.sqrt(shape[1])
        out[name] = a.astype(np.float32)
    return out


def random_weights_on_device(model, seed: int) -> None:
    """Fill `model` in place with `random_weights`' scales, drawn by torch on the model's device.

    For large benchmark models, whose numpy initialisation would dominate a GPU run. Same seed and
    device kind, same weights (so every GPU of a TP group draws identical ones); the values differ
    from `random_weights(cfg, seed)`, which stays the reference for tests.
    """
    import torch

    g = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.state_dict().items():
            r = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * r)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * r)
            elif name == "model.embed_tokens.weight":
                p.copy_(r)
            else:
                p.copy_(r / p.shape[1] ** 0.5)


_MTP = re.compile(r"^model\.layers\.(\d+)\.")
_QUANT = ("_scale_inv", "weight_scale", "weight_packed", "weight_shape", "input_scale")
# a kimi_k25 wrapper checkpoint: the language model's weights under LM_PREFIX, the other towers' beside them
LM_PREFIX = "language_model."
OTHER_TOWERS = ("vision_tower.", "mm_projector.", "multi_modal_projector.")


def check_keys(expected: set, got: set) -> None:
    """ValueError listing missing / unexpected weight names (first few of each), naming the prefix that
    every missing name carries among the unexpected ones where there is one (Kimi-K2.5's
    `language_model.`)."""
    missing, extra = sorted(expected - got), sorted(got - expected)
    if missing or extra:
        prefix = _shared_prefix(missing, extra)
        raise ValueError(
            "checkpoint does not match the config: "
            + (f"missing {len(missing)} weights, e.g. {missing[:4]}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"{len(extra)} unexpected, e.g. {extra[:4]}" if extra else "")
            + (f"; the checkpoint's weights carry the prefix {prefix!r}, which the loader does not strip"
               if prefix else "")
        )


def _shared_prefix(missing: list[str], extra: list[str]) -> str | None:
    """The prefix p with p + name among `extra` for every name of `missing`, if there is one."""
    if not missing:
        return None
    have = set(extra)
    for e in extra:  # the names are disjoint, so a match is longer than missing[0]: p is never empty
        if e.endswith(missing[0]):
            p = e[:-len(missing[0])]
            if all(p + m in have for m in missing):
                return p
    return None


INDEX = "model.safetensors.index.json"  # a sharded checkpoint's map: weight name -> shard file


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: the shards its index names when it has one (a stale
    file beside them is not read), else every *.safetensors. ValueError naming a missing shard."""
    index = path / INDEX
    if not index.is_file():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path}: no *.safetensors files")
        return files
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
        bad = [s for s in shards if not isinstance(s, str) or Path(s).name != s or s in ("", ".", "..")]
        if bad:  # a file of this folder, by name: not a path out of it
            raise ValueError(f"weight_map names {bad[0]!r}, not a file name in the folder")
        shards = sorted(shards)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    missing = [s for s in shards if not (path / s).is_file()]
    if missing:
        raise ValueError(f"{path}: {missing[0]} (named in {INDEX}) not found" +
                         (f", nor {len(missing) - 1} more shards" if len(missing) > 1 else ""))
    return [path / s for s in shards]


# a safetensors header's float dtypes: what the engine loads (fp8 and integer tensors are quantized
# checkpoints' and would be cast blindly); a tuple, so the error lists them in this order
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def checkpoint_layout(path: Path, cfg: ModelConfig) -> dict[str, tuple[Path, str]]:
    """name -> (file, name stored there) of every weight the model takes, from the safetensors headers of
    `checkpoint_files` alone: no tensor is read and nothing allocated, so a mismatch costs nothing.
    Multi-token-prediction layers (num_nextn_predict_layers past the last decoder layer), buffers, and
    `lm_head.weight` under a tied config are dropped; under a `kimi_k25` config whose checkpoint stores
    names under LM_PREFIX, that prefix is stripped and the vision tower's and projector's weights
    (OTHER_TOWERS) are dropped. ValueError for a quantized or non-float tensor, a name two files both hold,
    missing or unexpected names (`check_keys`) and a shape that is not the config's."""
    last = cfg.num_hidden_layers
    mtp = range(last, last + int(cfg.extra.get("num_nextn_predict_layers") or 0))
    files = checkpoint_files(path)
    wrapped = cfg.model_type == "kimi_k25" and any(k.startswith(LM_PREFIX) for k in _stored_names(files))
    where, shapes = {}, {}
    for f in files:
        with _header(f) as header:
            for stored in header.keys():
                if wrapped and stored.startswith(OTHER_TOWERS):
                    continue
                k = stored[len(LM_PREFIX):] if wrapped and stored.startswith(LM_PREFIX) else stored
                if any(s in k for s in _QUANT):
                    raise ValueError(f"{f.name}: quantized weight {stored!r}; the engine loads dense float "
                                     "checkpoints only")
                part = header.get_slice(stored)
                if part.get_dtype() not in FLOAT_DTYPES:
                    raise ValueError(f"{f.name}: {stored!r} is {part.get_dtype()}; the engine loads dense "
                                     f"float checkpoints ({', '.join(FLOAT_DTYPES)})")
                m = _MTP.match(k)
                if (m and int(m.group(1)) in mtp) or k.endswith("rotary_emb.inv_freq") \
                        or (cfg.tie_word_embeddings and k == "lm_head.weight"):
                    continue
                if k in where:
                    raise ValueError(f"{k!r} is in both {where[k][0].name} ({where[k][1]!r}) and {f.name} "
                                     f"({stored!r})")
                where[k], shapes[k] = (f, stored), tuple(part.get_shape())
    expected = parameter_shapes(cfg)
    check_keys(set(expected), set(where))
    for k, shape in expected.items():
        if shapes[k] != shape:
            raise ValueError(f"{where[k][0].name}: {where[k][1]}: shape {shapes[k]} does not match the "
                             f"config's {shape}")
    return where


def _header(f: Path):
    """safe_open of a checkpoint file; ValueError naming it where it is truncated or damaged."""
    try:
        return safe_open(str(f), framework="pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{f}: not a readable safetensors file ({' '.join(str(e).split())})") from None


def _stored_names(files: list[Path]):
    """Every weight name the files' headers hold."""
    for f in files:
        with _header(f) as header:
            yield from header.keys()


def save_pretrained(model, path) -> None:
    """Write config.json + model.safetensors in the HF layout (atomic per file). ValueError, before anything
    is written, where the folder holds another checkpoint's files (a shard index or other shards, which
    `checkpoint_files` would read in place of the new file) or where the model's weights are not the
    config's dense layout (INT4 experts, a tensor-parallel shard): what `Model.from_pretrained` could
    not load back."""
    from safetensors.torch import save_file

    out = Path(path)
    state = model.state_dict()
    expected = parameter_shapes(model.cfg)
    try:
        check_keys(set(expected), set(state))
    except ValueError as e:
        raise ValueError(f"this model's weights are not its config's dense layout (INT4 experts or a "
                         f"tensor-parallel shard?): {e}") from None
    wrong = [k for k, shape in expected.items() if tuple(state[k].shape) != shape]
    if wrong:
        raise ValueError(f"{wrong[0]}: shape {tuple(state[wrong[0]].shape)} is not the config's "
                         f"{expected[wrong[0]]} (a tensor-parallel shard?); save the whole model")
    # what `checkpoint_files` would read in place of the new file (a killed save's temp file it does not)
    others = sorted([p.name for p in out.glob("*.safetensors") if p.name != "model.safetensors"]
                    + [INDEX] * (out / INDEX).is_file()) if out.is_dir() else []
    if others:
        raise ValueError(f"{out} holds another checkpoint's files ({', '.join(others[:4])}"
                         f"{', ...' if len(others) > 4 else ''}), which loading would read in place of "
                         "model.safetensors: save into a folder without them")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    atomic_write_path(out / "model.safetensors",
                      lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    atomic_write_text(out / "config.json", json.dumps(model.cfg.to_hf_dict(), indent=2) + "\n")


