"""Run the tensor-parallel engine (kdlib.tp) and check it against one process; on GPUs, benchmark it.

Check (`kdlib.engine.generate` on N TPModel ranks: AR and DDTree, greedy and sampled with a seed, vs the
single-process run; exit 1 on a mismatch):

    python tools/tp_run.py --world-size 2                                  # gloo on CPU, mp.spawn
    python tools/tp_run.py --world-size 4 --config tiny-a --moe-mode tp
    python3 -m torch.distributed.run --nproc-per-node 2 tools/tp_run.py    # the same under torchrun
    python3 tools/tp_run.py --world-size 8 --backend nccl                  # NCCL, one GPU per rank

Benchmark (GPUs; step time and all-reduce share against the GPU count, NCCL checks included;
writes <out>/tp.<gpu>.json through kdlib.perf.write):

    python3 tools/tp_run.py --bench --out $OUT [--quick]                   # 1, 2, 4, 8 up to the GPUs seen
    python3 -m kdlib.perf.run --suite tp --out $OUT                        # the same as a perf suite

Every process sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from kdlib.perf import write
from kdlib.perf.suites.tp import run


def _spec(args):
    from kdlib.tp.workers import check_spec

    kw = {"config": args.config, "moe_mode": args.moe_mode, "max_new": args.max_new, "budget": args.budget,
          "block": args.block, "device": "cuda" if args.backend == "nccl" else "cpu"}
    if args.zoo:
        kw = {**kw, "zoo": True, "prompt_len": 24}
    return check_spec(**kw)


def _torchrun(args) -> int:
    """Launched by torchrun: this process is one rank; rank 0 compares and prints the verdict."""
    import datetime

    import torch
    import torch.distributed as dist

    from kdlib.tp.engine import DEFAULT_TIMEOUT_S, set_nccl_env
    from kdlib.tp.workers import check_worker, compare, reference

    set_nccl_env()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
    spec = _spec(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.pt")
        try:
            check_worker(rank, world, device, spec, path)
        finally:
            dist.destroy_process_group()
        if rank != 0:
            return 0
        lines = compare(torch.load(path), reference(spec))
    print(f"[tp_run] {world} ranks ({args.backend}, torchrun):\n  " + "\n  ".join(lines), flush=True)
    return 1 if any(x.startswith("FAIL") for x in lines) else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2, help="ranks to spawn for a check (default 2)")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--config", default="tiny-a", help="a data/configs/<name>.json tiny config (default "
                                                       "tiny-a)")
    ap.add_argument("--zoo", action="store_true", help="use the trained kdlib.zoo models instead of --config")
    ap.add_argument("--moe-mode", choices=("ep", "tp"), default="ep", help="experts whole per rank or sliced")
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--block", type=int, default=5, help="drafter block size (horizon = block - 1)")
    ap.add_argument(
        "--bench", action="store_true", help="GPU benchmark over 1, 2, 4, 8 GPUs -> tp.<gpu>.json"
    )
    ap.add_argument("--quick", action="store_true", help="with --bench: a reduced sweep")
    ap.add_argument("--out", default=None, help="with --bench: folder of the result JSON (default "
                                                "data/results/)")
    args = ap.parse_args(argv)

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if args.bench:
            ap.error("--bench spawns its own ranks for every GPU count: run it with plain python3, not "
                     "torchrun")
        return _torchrun(args)
    if args.bench:
        path = write(
            "tp", run(quick=args.quick), out_dir=args.out,
            command="python3 tools/tp_run.py " + " ".join(sys.argv[1:]),
        )
        print(f"[tp_run] wrote {path}", flush=True)
        return 0
    from kdlib.tp.workers import run_check

    lines = run_check(args.world_size, _spec(args), backend=args.backend)
    print(f"[tp_run] {args.world_size} ranks ({args.backend}):\n  " + "\n  ".join(lines), flush=True)
    return 1 if any(x.startswith("FAIL") for x in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
