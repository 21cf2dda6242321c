"""Run the W4A16 MoE layer a few times at one M, for a profiler to attach to.

`kdlib.cuda.moe.moe_w4a16` runs its default kernel for that M unless --version is given:

    ncu --clock-control none -k regex:moe_w4a16 --launch-skip 8 --launch-count 2 \
        python3 tools/moe_profile.py --m 32 --version 2

Random INT4 experts in the kernel layout (Kimi-K2 shapes at the TP8 shard, as the moe suite),
uniform top-8 routing; a fresh routing for every call.
"""

from __future__ import annotations

import argparse

from kdlib.cli import positive_int, require_gpu
from kdlib.cuda import moe
from kdlib.perf.suites import moe as s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=positive_int, default=32, help="tokens in the layer call")
    ap.add_argument("--calls", type=positive_int, default=8)
    ap.add_argument("--version", type=int, choices=(1, 2, 3), default=None,
                    help="kernel version (default: the library's pick for this M)")
    args = ap.parse_args()
    require_gpu(ap)

    import cupy as cp
    import numpy as np
    import torch

    P, KC = s.N // 16, s.K // 64
    packed = {
        "w1": s._random_words(torch, cp, s.E * P * KC * 2 * 32 * 4).reshape(s.E, P, KC, 2, 32, 4),
        "s1": s._random_scales(torch, cp, s.E * P * KC * 2 * 16).reshape(s.E, P, KC, 2, 16),
        "w2": s._random_words(torch, cp, s.E * (s.K // 16) * (s.N // 64) * 32 * 4).reshape(
            s.E, s.K // 16, s.N // 64, 32, 4
        ),
        "s2": s._random_scales(torch, cp, s.E * (s.K // 16) * (s.N // 64) * 16).reshape(
            s.E, s.K // 16, s.N // 64, 16
        ),
    }
    x = torch.randn(args.m, s.K, device="cuda").to(torch.bfloat16)      # [M, K]
    rng = np.random.default_rng(0)
    for _ in range(args.calls):
        ids, w = s._routing(rng, args.m)
        r = moe.prepare_routing(cp.asarray(ids), cp.asarray(w), s.E)
        moe.moe_w4a16(x, packed, r, version=args.version, sync=True)
    print(f"moe_profile: {args.calls} calls at M={args.m}, version {args.version or 'default'}")


if __name__ == "__main__":
    main()
