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

from kdlib.cli import folder, require_gpu
from kdlib.engine import ModelConfig
from kdlib.engine.generate import MAX_BUDGET, MAX_DEPTH
from kdlib.perf import write
from kdlib.perf.suites.tp import run
from kdlib.tp.engine import DEFAULT_TIMEOUT_S


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

    from kdlib.tp.engine import set_nccl_env
    from kdlib.tp.workers import check_worker, compare, reference

    set_nccl_env()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
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


def _check_args(ap: argparse.ArgumentParser, args) -> None:
    """One-line errors (exit 2) for arguments the run would fail on, before any rank is spawned."""
    if args.bench:  # the suite's own sweep: a check's flag would be recorded in the command, not run
        for dest in ("config", "zoo", "world_size", "moe_mode", "max_new", "budget", "block", "backend",
                     "timeout"):
            if getattr(args, dest) != ap.get_default(dest):
                ap.error(f"--{dest.replace('_', '-')} applies to the check, not to --bench (which sweeps its "
                         "own GPU counts, models and settings)")
        require_gpu(ap)
        return
    if args.quick or args.out is not None:
        ap.error("--quick and --out apply to --bench only")
    if args.zoo and args.config is not None:
        ap.error("--zoo uses the trained models: --config does not apply")
    args.config = args.config or "tiny-a"
    world = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else args.world_size  # torchrun sets it
    if not 0 < args.timeout < float("inf"):
        ap.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    for flag, value, low in (("--world-size", args.world_size, 1), ("--max-new", args.max_new, 2),
                             ("--budget", args.budget, 0), ("--block", args.block, 2)):
        if value < low:  # --max-new 1: the prefill's token alone, no DDTree step to check
            ap.error(f"{flag} must be >= {low}, got {value}")
    if args.budget > MAX_BUDGET:
        ap.error(f"--budget {args.budget} exceeds the tree kernels' limit {MAX_BUDGET}")
    depth = min(args.block - 1, args.budget)
    if depth > MAX_DEPTH:
        ap.error(f"the tree's depth min(--block - 1, --budget) = {depth} exceeds the tree kernels' limit "
                 f"{MAX_DEPTH}")
    if args.backend == "nccl":
        import torch

        if torch.cuda.device_count() < world:
            ap.error(f"--backend nccl needs one GPU per rank: {world} ranks, "
                     f"{torch.cuda.device_count()} GPUs visible")
    from kdlib import zoo
    from kdlib.tp import check_tp_config

    if args.zoo and not zoo.available():
        ap.error(f"--zoo: the trained models are not in {zoo.MODELS}")
    try:
        cfg = (ModelConfig.from_json(zoo.MODELS / "target.config.json") if args.zoo
               else ModelConfig.load(args.config))
        check_tp_config(cfg, world, args.moe_mode)
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        ap.error(str(e))
    prompt = _spec(args)["prompt_len"]
    if prompt + args.max_new > cfg.max_position_embeddings:
        ap.error(f"the check's prompt ({prompt}) + --max-new ({args.max_new}) exceeds the model's context "
                 f"{cfg.max_position_embeddings}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2, help="ranks to spawn for a check (default 2)")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--config", default=None, help="a shipped config's name (data/configs/<name>.json) or a "
                                                   "config.json path (default tiny-a)")
    ap.add_argument("--zoo", action="store_true", help="use the trained kdlib.zoo models instead of --config")
    ap.add_argument("--moe-mode", choices=("ep", "tp"), default="ep", help="experts whole per rank or sliced")
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--block", type=int, default=5, help="drafter block size (horizon = block - 1)")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help=f"seconds a collective may wait; the check is stopped this + 60 s after it starts "
                         f"(default {DEFAULT_TIMEOUT_S:g})")
    ap.add_argument(
        "--bench", action="store_true", help="GPU benchmark over 1, 2, 4, 8 GPUs -> tp.<gpu>.json"
    )
    ap.add_argument("--quick", action="store_true", help="with --bench: a reduced sweep")
    ap.add_argument("--out", default=None, type=folder,
                    help="with --bench: folder of the result JSON (default data/results/)")
    args = ap.parse_args(argv)
    _check_args(ap, args)

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if args.bench:
            ap.error("--bench spawns its own ranks for every GPU count: run it with plain python3, not "
                     "torchrun")
        return _torchrun(args)
    if args.bench:
        payload = run(quick=args.quick)
        path = write("tp", payload, out_dir=args.out,
                     command="python3 tools/tp_run.py " + " ".join(sys.argv[1:]))
        passed = payload.get("checks_pass", True)
        print(f"[tp_run] wrote {path}" + ("" if passed else "; its checks FAILED (checks_pass false)"),
              flush=True)
        return 0 if passed else 1
    from kdlib.tp.workers import run_check

    lines = run_check(args.world_size, _spec(args), backend=args.backend, timeout_s=args.timeout)
    print(f"[tp_run] {args.world_size} ranks ({args.backend}):\n  " + "\n  ".join(lines), flush=True)
    return 1 if any(x.startswith("FAIL") for x in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
