"""Attention over scattered vs contiguous KV slots at the same length (page_size 1): suite `fragmentation`.

`python3 -m kdlib.perf.run --suite fragmentation [--quick]`. Per point (heads H, queries Q,
prefix length S, batch 1), the same bf16 latent rows K [S, 576] are written into a slot pool
at three layouts (LAYOUTS) and attended through a page table:

  contiguous  slots s0, s0+1, ...: what page_size > 1 keeps after moving the accepted KV
  simulated   the slot list of a request after DDTree decoding under SGLang's page-size-1
              allocator (`kdlib.fragmentation.simulate`: 4 concurrent requests, prompt S/4, the
              rest generated at budget 32 and a mean accepted length of 3)
  random      S distinct slots drawn uniformly from a pool of 4 S: no locality at all

Arms, each a CUDA graph replayed and timed with CUDA events (median of `iters`):
  kernel      `kdlib.cuda.attention.prefix_attention` (split-KV prefix kernel + combine), which
              reads rows through the page table, so a layout is just another table;
  gather      torch `index_select` of the S rows (the copy a dense kernel would need first);
  torch       gather + bmm + fp32 softmax + bmm (the PyTorch baseline of the verify suite).
Outputs of every layout are compared with the contiguous one (same keys, so they must agree).
Rows are rotated among up to 8 table copies at disjoint slots so that one pass reads >= 256 MB
(> 4x the 60 MB L2) where the pool allows; `l2_resident` marks points whose rows could still fit.
Bytes = KV rows + page table + queries + outputs; FLOPs = 2 H Q S (576 + 512); floor from the running
GPU's `ceilings.<gpu>.json` (the H200's where it has none; else 4.3 TB/s and 790 TFLOP/s, kernels-perf.md).
"""

from __future__ import annotations

import numpy as np

from kdlib import fragmentation as fr
from kdlib import perf
from kdlib.cuda import attention as cu
from kdlib.perf import results, timing
from kdlib.perf.suites._attention import graph_time

D_QK, D_V = 576, 512
LAYOUTS = ("contiguous", "simulated", "random")
FULL = {"prefix": [8192, 32768, 131072], "queries": [9, 65], "heads": [8]}
QUICK = {"prefix": [32768], "queries": [65], "heads": [8]}


def layouts(length: int, seed: int = 0) -> dict[str, np.ndarray]:
    """[length] int64 slot tables of each layout (LAYOUTS), each a set of distinct slots."""
    prompt = length // 4
    sim = fr.simulate(requests=4, total=4, prompt_len=prompt, new_tokens=length - prompt + 64, budget=32,
                      accept_mean=3.0, length_jitter=0.0, seed=seed)
    simulated = min(sim.tables, key=len)[:length]  # every request ran past `length`; cut to it
    return {"contiguous": fr.contiguous_table(length), "simulated": simulated,
            "random": fr.scattered_table(length, 4 * length, seed=seed)}


def cost(h: int, q: int, s: int) -> dict:
    """Bytes and FLOPs of one prefix-attention call (batch 1)."""
    return {"bytes": s * (D_QK * 2 + 4) + q * h * D_QK * 2 + q * h * (D_V * 4 + 4),
            "flops": 2.0 * h * q * s * (D_QK + D_V)}


def run_point(h: int, q: int, s: int, ceil: dict, *, iters: int, seed: int = 0) -> dict:
    import torch

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed + s + q)
    keys = torch.randn(s, D_QK, generator=gen).to(dev, torch.bfloat16)  # [S, 576] the request's rows
    qt = torch.randn(1, q, h, D_QK, generator=gen).to(dev, torch.bfloat16)  # [1, Q, H, 576]
    lens = torch.tensor([s], dtype=torch.int32, device=dev)
    scale = D_QK**-0.5
    c = cost(h, q, s)
    fl = perf.floor_ms(
        c["bytes"], c["flops"], bandwidth_Bps=ceil["bandwidth_Bps"], flop_rate=ceil["flop_rate"]
    )
    tables = layouts(s, seed)
    span = int(max(int(t.max()) for t in tables.values())) + 1
    n_rot = timing.l2_rotations(s * D_QK * 2)
    pool = torch.zeros(n_rot * span, D_QK, dtype=torch.bfloat16, device=dev)  # [rot * span, 576]
    row = {"heads": h, "queries": q, "prefix": s, **c, **fl, "rotations": n_rot,
           "l2_resident": timing.l2_resident(s * D_QK * 2, n_rot), "layouts": {}}
    ref = None
    for name in LAYOUTS:
        base = torch.from_numpy(tables[name]).to(dev)
        pts = [(base + r * span).to(torch.int32)[None] for r in range(n_rot)]  # [1, S] each
        for pt in pts:
            pool[pt[0].long()] = keys
        stats = fr.layout_stats(tables[name])

        def call(pt):
            return cu.prefix_attention(qt, pool, pt, lens, scale, validate=False)

        out = torch.from_dlpack(cu.prefix_attention(qt, pool, pts[0], lens, scale)[0])  # validated once
        ref = out if ref is None else ref
        t = graph_time([lambda pt=pt: call(pt) for pt in pts], iters)
        idx = pts[0][0].long()

        def gather(idx=idx):
            return pool.index_select(0, idx)

        def torch_attn(idx=idx):
            k = pool.index_select(0, idx)[None]  # [1, S, 576]
            sc = torch.bmm(qt.reshape(1, q * h, D_QK), k.transpose(1, 2)) * scale  # [1, Q*H, S]
            pr = torch.softmax(sc, -1, dtype=torch.float32).to(torch.bfloat16)
            return torch.bmm(pr, k[:, :, :D_V])

        tg, _, _ = timing.graph_or_eager(gather, iters=iters)
        tt, mode, _ = timing.graph_or_eager(torch_attn, iters=iters)
        rel = float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))
        row["layouts"][name] = {
            "layout": {
                k: stats[k] for k in ("runs", "mean_run", "pages_touched", "page_amplification", "page_fill")
            },
            "kernel": t.as_dict(),
            "fraction_of_floor": fl["floor_ms"] / t.median_ms,
            "achieved_TBps": c["bytes"] / (t.median_ms * 1e-3) / 1e12,
            "gather": tg.as_dict(),
            "torch": {**tt.as_dict(), "mode": mode},
            "rel_diff_vs_contiguous": rel,
        }
    k0 = row["layouts"]["contiguous"]["kernel"]["median_ms"]
    for v in row["layouts"].values():
        v["kernel_slowdown_vs_contiguous"] = v["kernel"]["median_ms"] / k0
        v["torch_slowdown_vs_contiguous"] = (
            v["torch"]["median_ms"] / row["layouts"]["contiguous"]["torch"]["median_ms"]
        )
    return row


def run(*, quick: bool = False) -> dict:
    """The suite: every (H, Q, S) of FULL, 100 replays a layout (quick: QUICK, 30 replays)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("the fragmentation suite needs a CUDA device")
    grid = QUICK if quick else FULL
    ceil = results.ceilings().as_dict()
    iters = 30 if quick else 100
    clocks_before = timing.clocks()
    pts = []
    for h in grid["heads"]:
        for s in grid["prefix"]:
            for q in grid["queries"]:
                pts.append(run_point(h, q, s, ceil, iters=iters))
                torch.cuda.empty_cache()  # the point's slot pool is garbage now
    return {"parameters": {"grid": grid, "iters": iters, "layouts": list(LAYOUTS), "dtype": "bfloat16",
                           "page_size": 1, "batch": 1},
            "ceilings": ceil, "clocks_before": clocks_before, "clocks_after": timing.clocks(), "points": pts}
