"""Device time against wall time: what the GPU runs during a call, from torch.profiler's CUDA events.

    prof = device_profile(graph.replay, steps=3)   # per call: device_ms, kernels_per_step, top_kernels
    classes = kernel_classes(prof["kernels"])      # device us per step by kind of kernel

A step whose device time is well under its wall time leaves the GPU idle: the gap is overhead (launch
latency, small kernels' fixed costs, host work) that the kernels themselves do not need.
"""

from __future__ import annotations

import re

# kernel name pattern (searched in the lower-cased name) -> class, first match wins: Inductor's fused
# kernels first (their names list the ops they fuse), attention before GEMM (the tree-verify kernels use
# wgmma), MoE before GEMM
KERNEL_CLASSES = (
    ("fused (torch.compile)", r"^triton_"),
    ("attention", r"attn|attention|flash|fmha|sdpa|tree_verify"),
    ("MoE routing / experts", r"moe|expert|grouped|route"),
    ("GEMM", r"gemm|gemv|cutlass|xmma|cublas|matmul|splitk|wgmma|nvjet"),
    ("norm", r"norm"),
    ("softmax / top-k / sort", r"softmax|topk|top_k|sort|argmax|scan|radix"),
    ("tree build / accept", r"tree|accept|ddtree"),
    ("copy / index", r"copy|memcpy|memset|index|gather|scatter|cat|fill"),
    ("elementwise / reduce", r"elementwise|vectorized|unrolled|reduce|pointwise|mul|add"),
)
OTHER = "other"


def kernel_class(name: str) -> str:
    """The class of one kernel name (`KERNEL_CLASSES`, first match; `other` when none matches)."""
    low = name.lower()
    return next((c for c, pat in KERNEL_CLASSES if re.search(pat, low)), OTHER)


def device_profile(fn, steps: int, top: int = 25) -> dict:
    """Per call of fn (after a synchronize, `steps` calls profiled): CUDA kernel time `device_ms`, the
    kernel count `kernels_per_step`, every kernel as (name, calls per step, us per step) in `kernels`
    (longest first), the `top` of them in `top_kernels`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    rows = [(e.key[:120], e.count / steps, e.self_device_time_total / steps) for e in kernels]
    return {
        "device_ms": sum(r[2] for r in rows) / 1e3,
        "kernels_per_step": sum(r[1] for r in rows),
        "kernels": rows,
        "top_kernels": rows[:top],
    }


def kernel_classes(kernels: list) -> dict:
    """(name, calls, us) rows -> {class: {"calls": per step, "us": per step}} (`kernel_class`)."""
    out: dict = {}
    for name, calls, us in kernels:
        c = out.setdefault(kernel_class(name), {"calls": 0.0, "us": 0.0})
        c["calls"] += calls
        c["us"] += us
    return out
