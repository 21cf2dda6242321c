"""One whole tree-verify call, run twice on random bf16 inputs: the program Nsight Compute profiles (the
second call: the first compiles and warms). Up to 8 requests version 10's attend kernels make their own plan
and carry the suffix _own. Run from the repo root on the GPU machine:

    ncu --kernel-name 'regex:^tree_verify_v10_attend_t(_own)?$' --launch-skip 1 --launch-count 1 ... \
        python3 tools/ncu_verify.py --impl wgmma_v10 --queries 1 --heads 8 --prefix 200000 [--fp8]

--fp8: the prefix pool in the FP8 layout (`kdlib.cuda.attention.fp8_pool` of the same rows; version 10 only).
"""

from __future__ import annotations

import argparse

import torch

from kdlib.cli import positive_int, require_gpu
from kdlib.cuda import attention as cu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", required=True, help="the version by name, e.g. wgmma_v10")
    ap.add_argument("--queries", type=positive_int, default=65)
    ap.add_argument("--heads", type=positive_int, default=8)
    ap.add_argument("--prefix", type=positive_int, default=200_000)
    ap.add_argument("--fp8", action="store_true", help="the prefix pool in the FP8 layout (version 10)")
    a = ap.parse_args()
    require_gpu(ap)
    g = torch.Generator(device="cuda").manual_seed(0)
    nq, nh, s = a.queries, a.heads, a.prefix
    q = torch.randn(1, nq, nh, cu.D_QK, device="cuda", generator=g).bfloat16()  # [1, Q, H, 576]
    kv = torch.randn(s, cu.D_QK, device="cuda", generator=g).bfloat16()  # [S, 576]
    if a.fp8:
        kv = cu.fp8_pool(kv)  # [S, 656] uint8
    pt = torch.randperm(s, device="cuda", generator=g).int()[None]  # [1, S] scattered slots
    tkv = torch.randn(1, nq, cu.D_QK, device="cuda", generator=g).bfloat16()  # [1, Q, 576]
    vis = torch.tril(torch.ones(nq, nq, dtype=torch.bool, device="cuda"))[None]  # [1, Q, Q]
    lens = torch.tensor([s], dtype=torch.int32, device="cuda")  # [1]
    sizes = torch.tensor([nq], dtype=torch.int32, device="cuda")  # [1]
    ws = cu.make_workspace(1, nq, nh)
    for _ in range(2):
        cu.tree_verify_attention(q, kv, pt, lens, tkv, vis, sizes, cu.D_QK ** -0.5, impl=a.impl, workspace=ws)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
