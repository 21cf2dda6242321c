"""The MVP engine in PyTorch: config, MLA + MoE model, latent KV cache, drafters, AR / DDTree generate.

    from kdlib.engine import Model, ModelConfig, generate
    model = Model.from_pretrained("hf_dir")                       # or Model.random(cfg, seed=0)
    res = generate(model, prompt_ids, 64, method="ddtree", drafter=drafter, budget=32)

Names resolve lazily so that `kdlib.engine.config` (pure Python) imports without torch.
"""

import importlib

_EXPORTS = {
    "ModelConfig": "config",
    "ConfigError": "config",
    "Model": "model",
    "LatentCache": "cache",
    "generate": "generate",
    "GenerateResult": "generate",
    "DFlashDrafter": "drafter",
    "DFlashConfig": "drafter",
    "NoisyOracleDrafter": "drafter",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"kdlib.engine.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'kdlib.engine' has no attribute {name!r}")
