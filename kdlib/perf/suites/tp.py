"""GPU suite `tp`: the tensor-parallel engine (`kdlib.tp`) on NCCL over 1, 2, 4, 8 GPUs of one host.

    python3 -m kdlib.perf.run --suite tp [--quick] --out $OUT        # needs >= 2 visible GPUs

Sections of the payload:
  checks          per world size (expert parallel; sliced experts too at the largest): NCCL ranks vs one GPU
                  on tiny-a in fp32 (logits within tolerance, vocab-parallel top-K == dense top-K,
                  TP AR and TP DDTree == single-GPU AR greedy); `checks_pass`
  runs            per world size (1 = TPModel with no collectives, plus the single-GPU engine):
                  AR and DDTree (noisy oracle) step time on the engine suite's BENCH_CONFIG in
                  float32 with TF32 off (as the engine suite, so that DDTree == AR and the oracle
                  never re-derives its script inside the draft phase), and from a second run with
                  synchronised collectives the all-reduce and all-gather ms per step and their share
                  of the step (`allreduce_share`); `matches_tp_ar` (DDTree == AR on the TP numerics)
                  and `matches_single_ar` (vs one GPU; `logits_max_abs_diff_vs_single` shows how far
                  the TP partial sums move the logits)
  allreduce       NCCL all-reduce of [rows, 7168] bf16 (Kimi-K2 / DeepSeek-V3 hidden size) per
                  world size; `allreduce_fit`: latency and bus bandwidth of t = lat + ring_bytes / bw,
                  the estimator's all-reduce model (kdlib/estimator/model.py)
  allreduce_graph the same sweep with 20 collectives captured per CUDA graph (per collective =
                  replay / 20: no Python launch per call, as in a graph-captured serving step), in
                  its own spawn (a capture failure is recorded as `error`); `allreduce_graph_fit`.
                  The estimator calibrates on the graph fit when present

Every process sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1
(NVLink multicast off). World sizes: 1 and the powers of two up to the visible GPU count.
"""

from __future__ import annotations


def world_sizes(n_gpus: int) -> list[int]:
    """[1, 2, 4, 8, ...] up to n_gpus."""
    out, w = [1], 2
    while w <= n_gpus:
        out.append(w)
        w *= 2
    return out


def run(*, quick: bool = False) -> dict:
    """The suite over world sizes 1, 2, 4, ... up to the visible GPUs (at least 2); quick: the reduced
    sweep of `kdlib.tp.workers.gpu_payload`."""
    import torch

    from kdlib.tp.engine import set_nccl_env
    from kdlib.tp.workers import gpu_payload

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        raise SystemExit(f"the tp suite needs at least 2 GPUs of one host, {n} visible "
                         "(run it on nvidia-h200-x2 or larger)")
    set_nccl_env()  # the spawned ranks inherit it (and set it again themselves)
    return gpu_payload(world_sizes(n), quick=quick)
