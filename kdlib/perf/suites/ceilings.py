"""Ceilings: the GPU's device-to-device copy bandwidth and its dense bf16 matmul rate, measured.

    python3 -m kdlib.perf.run --suite ceilings [--quick]   ->  data/results/ceilings.<gpu>.json

Later benchmarks divide by these two numbers of the GPU they run on (`kdlib.perf.results.ceilings()`,
keys `copy_bandwidth_Bps` and `bf16_matmul_flops` of the file) to state their fraction of what the chip
really does, next to the datasheet figures.

Copy: `dst.copy_(src)` on contiguous uint8 buffers of the same device (torch issues a
device-to-device cudaMemcpyAsync); each copy moves 2 x size bytes (read src + write dst). The
headline is the median at 4 GiB, large enough that launch cost and the L2 (60 MiB on the H200, as the
device reports it) are negligible.
A second method, an elementwise kernel (`torch.mul(src, 1, out=dst)` on float32), shows what a
plain streaming kernel reaches. Every copy result is checked bit-exact against its source.

Matmul: `torch.matmul(a, b, out=c)` with a [M, K], b [K, N] bf16 drawn from N(0, 1) (random data:
zeros or constants draw less power and read higher); FLOPs = 2 * M * N * K. The headline is the
median at M = N = K = 8192: the sustained rate, over a run long enough for the chip to reach its power
limit and lower its clocks (on the H200 its samples split in two, the median in the lower group); the
fastest shape's median is kept beside it (`details.matmul_best_flops`), what a fraction of the compute
floor becomes against the unthrottled rate. One slice of the product is checked against a float32 matmul.

All timings: CUDA events around each call, warm-up calls first, median and quantiles
(`kdlib.perf.cuda_time`).
"""

from __future__ import annotations

from kdlib.check import assert_close
from kdlib.perf.timing import copy_bandwidth, cuda_time

GiB = 1 << 30
HEADLINE_COPY_BYTES = 4 * GiB  # >= 4 GiB: 68x the H200's 60 MiB L2, launch overhead < 0.1 %
COPY_SIZES = (256 << 20, 1 * GiB, 4 * GiB)  # the curve shows where bandwidth saturates
HEADLINE_MATMUL = (8192, 8192, 8192)  # M, N, K: large enough to saturate every SM on H100/H200-class parts
MATMUL_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (16384, 16384, 8192))
CHECK_ROWS = 256  # rows of the product checked against float32: 256 x 8192, cheap on the host


def _matmul_case(torch, m: int, n: int, k: int, *, warmup: int, iters: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=gen)  # [M, K]
    b = torch.randn(k, n, dtype=torch.bfloat16, device="cuda", generator=gen)  # [K, N]
    c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")  # [M, N]

    def fn():
        torch.matmul(a, b, out=c)

    timing = cuda_time(fn, warmup=warmup, iters=iters)
    ref = a[:CHECK_ROWS].float() @ b.float()  # [CHECK_ROWS, N] float32
    # bf16 output rounding alone gives ~2^-9 relative error per element; 1e-2 catches a wrong result.
    err = assert_close(c[:CHECK_ROWS].float(), ref, rtol=1e-2, name=f"bf16 matmul {m}x{n}x{k}", quiet=True)
    flops = 2.0 * m * n * k
    return {
        "m": m, "n": n, "k": k,
        "flops": flops,
        "timing": timing.as_dict(),
        "flops_per_s": flops / (timing.median_ms * 1e-3),
        "check_norm_rel_err": err["norm_rel"],
    }


def run(*, quick: bool = False) -> dict:
    """Measure both ceilings on the current CUDA device; see the module docstring.

    quick: the headline copy size and matmul shape only, 3 warm-up / 10 timed runs (else every size
    and shape, 10 / 50).
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("the ceilings suite needs a CUDA device")
    copy_sizes = (HEADLINE_COPY_BYTES,) if quick else COPY_SIZES
    shapes = (HEADLINE_MATMUL,) if quick else MATMUL_SHAPES
    warmup, iters = (3, 10) if quick else (10, 50)
    free, _ = torch.cuda.mem_get_info()
    need = 3 * HEADLINE_COPY_BYTES + GiB  # src, dst, torch.equal's bool mask, and room for the matmuls
    if free < need:
        raise RuntimeError(f"need {need} free bytes on the GPU, have {free}")

    copies, matmuls = [], []
    for method in ("memcpy", "kernel"):
        for size in copy_sizes:
            copies.append(copy_bandwidth(size, method=method, warmup=warmup, iters=iters))
            torch.cuda.empty_cache()  # the case's buffers died with it; hand their memory back
    for m, n, k in shapes:
        matmuls.append(_matmul_case(torch, m, n, k, warmup=warmup, iters=iters))
        torch.cuda.empty_cache()

    headline_copy = next(
        c for c in copies if c["method"] == "memcpy" and c["bytes_per_copy"] == HEADLINE_COPY_BYTES
    )
    headline_mm = next(r for r in matmuls if (r["m"], r["n"], r["k"]) == HEADLINE_MATMUL)
    return {
        "parameters": {
            "copy_sizes_bytes": list(copy_sizes),
            "copy_methods": ["memcpy", "kernel"],
            "matmul_shapes_mnk": [list(s) for s in shapes],
            "warmup": warmup,
            "iters": iters,
            "quick": quick,
            "bf16_reduced_precision_reduction": getattr(
                torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", None),
        },
        "copy_bandwidth_Bps": headline_copy["Bps"],
        "bf16_matmul_flops": headline_mm["flops_per_s"],
        "details": {
            "copy_headline": "memcpy (dst.copy_(src)), 4 GiB, median; bytes = read + write",
            "matmul_headline": "torch.matmul bf16 8192^3, N(0,1) data, median; FLOPs = 2 M N K",
            "copy_best_Bps": max(c["Bps"] for c in copies),
            "matmul_best_flops": max(r["flops_per_s"] for r in matmuls),
            "copy": copies,
            "matmul": matmuls,
        },
    }
