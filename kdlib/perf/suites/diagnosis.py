"""The engine's throughput diagnosis on the GPU, in process: suite `diagnosis`.

`python3 -m kdlib.perf.run --suite diagnosis [--quick]`. No HTTP (the GPU machine has no FastAPI):
`kdlib.serve.Engine` (the same worker the server runs) behind `kdlib.diagnose.EngineClient`, and
`kdlib.diagnose.study`: two-point decode over a context sweep, then per text kind a two-point rate
and a sustained streamed run with its decomposition (accepted length / step time against the
measured tok/s). Models: the trained tiny target and drafter (`kdlib.zoo`) when present, else the
random fallback (noisy oracle); the result's `model_info` says which.

Wall-clock figures (perf_counter around whole requests, with the engine's per-phase CUDA
synchronisation), not CUDA-event kernel times: this is what a client sees. The tiny models make
every step launch-bound, so the figures speak to the method (two-point vs sustained, the
decomposition), not to a large model's speed.
"""

from __future__ import annotations

from kdlib import diagnose, serve

CPU_OK = True  # runs on the CUDA device when there is one, else on the CPU
FULL = {"prompt_tokens": 512, "sustained_tokens": 1500, "repeats": 3, "sweep_max": None}
QUICK = {"prompt_tokens": 256, "sustained_tokens": 300, "repeats": 1, "sweep_max": 512}


def measure(
    device: str = "cpu",
    *,
    prompt_tokens: int,
    sustained_tokens: int,
    repeats: int,
    sweep_max: int | None,
    long: int = 264,
    kinds=None,
    prefer_trained: bool = True,
) -> dict:
    """`diagnose.study` against an in-process Engine on `device` (the suite's core; runs on CPU too)."""
    engine = serve.Engine(serve.load_bundle(device, prefer_trained=prefer_trained))
    try:
        client = diagnose.EngineClient(engine)
        limit = engine.max_context
        sustained_tokens = min(sustained_tokens, limit - 64)  # keep a prompt of >= 64 tokens in the context
        return diagnose.study(
            client,
            kinds=kinds,
            prompt_tokens=prompt_tokens,
            sustained_tokens=sustained_tokens,
            long=long,
            repeats=repeats,
            sweep_max=sweep_max,
        )
    finally:
        engine.close()


def run(*, quick: bool = False) -> dict:
    """`measure` on CUDA when present (else the CPU) with the QUICK profile (quick) or FULL."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    p = QUICK if quick else FULL
    res = measure(device, **p)
    res["parameters"].update({"device": device, "profile": "quick" if quick else "full"})
    return res
