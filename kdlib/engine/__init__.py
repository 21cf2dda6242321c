"""The MVP engine in PyTorch: config, MLA + MoE model, latent KV cache, drafters, AR / DDTree generate.

    from kdlib.engine import Model, ModelConfig, generate
    model = Model.from_pretrained("hf_dir")                       # or Model.random(cfg, seed=0)
    res = generate(model, prompt_ids, 64, method="ddtree", drafter=drafter, budget=32)

Modules: `config` (a re-export of `kdlib.config`, the one pure-Python config.json reader), `model`,
`loading` (HF safetensors, random weights), `cache` (paged latent KV cache), `drafter` (DFlash block
drafter, noisy oracle), `generate` (the single-stream eager loop, one GPU and TP), `batch` (the batched
graph engine), `rank` (one TP8 rank of Kimi-K2.6 at real shapes). Importing this package imports
torch; `kdlib.engine.config` alone needs only the standard library, but Python runs this file first,
so use the engine where torch is installed.
The package attribute `generate` is the function (bound after its module was imported); the module's
other names are reached with `from kdlib.engine.generate import PHASES, ...`.
"""

from kdlib.engine.cache import LatentCache
from kdlib.engine.config import ConfigError, ModelConfig
from kdlib.engine.drafter import DFlashConfig, DFlashDrafter, NoisyOracleDrafter
from kdlib.engine.generate import GenerateResult, generate
from kdlib.engine.model import Model

__all__ = [
    "ConfigError",
    "DFlashConfig",
    "DFlashDrafter",
    "GenerateResult",
    "LatentCache",
    "Model",
    "ModelConfig",
    "NoisyOracleDrafter",
    "generate",
]
