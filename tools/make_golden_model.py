"""Write the golden model logits: `python tools/make_golden_model.py [--out DIR]`.

The one generator of `data/golden/model_<config>.kdtr`: for each tiny configuration in
`data/configs/` (CONFIGS below) the deterministic random weights `kdlib.engine.loading.random_weights`
(numpy PCG64, seed per configuration), a token sequence from the same generator family, and the
float64 logits of the numpy golden forward `kdlib.ref.model.forward`. Fixed seeds, no timestamps:
regenerating gives the same bytes on any x86-64 CPU except the logits, which go through BLAS
matmuls and numpy's SIMD exp (their rounding depends on the CPU) and are compared at RTOL_REGEN.
`python tools/make_golden_model.py --check` regenerates into a temporary folder and compares with
the committed files (tests/test_engine_golden.py does the same).

Tensors per file:
  token_ids [T] int64                       the input, positions 0..T-1
  logits    [T, V] float64                  kdlib.ref.model.forward(cfg, weights, token_ids)
  weight.<HF name>  float32                 every model weight under its Hugging Face name
Metadata (strings): generator, config_name, config (the config.json text), weight_seed,
token_seed, rtol_fp32 (the torch FP32 model must match within it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
from make_golden import check  # tools/ is sys.path[0] when this file runs as a script

from kdlib import DATA, kdtr
from kdlib.cli import folder
from kdlib.engine.config import ModelConfig
from kdlib.engine.loading import random_weights
from kdlib.ref.model import forward

# name -> (weight seed, token seed, sequence length). Two configurations: tiny-a (q_lora, YaRN with
# mscale != mscale_all_dim, 4 groups / top-2 routing) and tiny-b (no q_lora, Kimi-K2 spelling, beta 1/1).
CONFIGS = {"tiny-a": (1001, 2001, 40), "tiny-b": (1002, 2002, 33)}
RTOL_FP32 = 1e-5
# The logits between OpenBLAS kernels (SkylakeX, Haswell, Sandybridge, Prescott) and numpy's SIMD
# paths: at most 1e-15 norm-relative apart; 1e-13 is the reference-recompute tolerance of the tests.
RTOL_REGEN = 1e-13


def build(name: str) -> tuple[dict, dict]:
    wseed, tseed, T = CONFIGS[name]
    text = (DATA / "configs" / f"{name}.json").read_text()
    cfg = ModelConfig.from_dict(json.loads(text))
    weights = random_weights(cfg, wseed)
    ids = np.random.Generator(np.random.PCG64(tseed)).integers(0, cfg.vocab_size, T, dtype=np.int64)
    tensors = {"token_ids": ids, "logits": forward(cfg, weights, ids)}
    tensors.update({f"weight.{k}": v for k, v in weights.items()})
    meta = {"generator": "tools/make_golden_model.py", "config_name": name, "config": text,
            "weight_seed": str(wseed), "token_seed": str(tseed), "rtol_fp32": repr(RTOL_FP32)}
    return tensors, meta


def write(out: Path) -> list[Path]:
    """Write every configuration's file into `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in CONFIGS:
        tensors, meta = build(name)
        paths.append(out / f"model_{name.replace('-', '_')}.kdtr")
        kdtr.save(paths[-1], tensors, metadata=meta)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=folder, default=DATA / "golden", help="output folder (default data/golden)")
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temporary folder and compare with --out instead of writing it")
    args = ap.parse_args(argv)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            problems = check(write(Path(tmp)), Path(args.out), lambda _: {"logits": RTOL_REGEN},
                             owns=lambda name: name.startswith("model_"))
        print("\n".join(problems) or f"{args.out}: the model golden files regenerate (logits at "
                                     f"{RTOL_REGEN:g})")
        return 1 if problems else 0
    for path in write(Path(args.out)):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
