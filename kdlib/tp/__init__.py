"""Tensor parallelism for the MVP engine on torch.distributed (see `kdlib.tp.engine` for the layout).

    from kdlib.tp import Comm, TPModel, spawn
    spawn(worker, world=2, backend="gloo")        # worker(rank, world, device, *args)
    kdlib.engine.generate(TPModel.from_model(model, Comm()), prompt_ids, 64)   # inside a worker, every rank

Modules: `engine` (process group, sharded model and its hooks for `kdlib.engine.generate`'s loop:
vocab-parallel argmax and top-K), `workers` (the check and benchmark workers that `tools/tp_run.py`,
the `tp` perf suite and `tests/test_tp.py` spawn, and the single-process reference they compare
against).
"""

from kdlib.tp.engine import (
    MOE_MODES,
    NCCL_ENV,
    Comm,
    TPModel,
    assert_replicated,
    check_tp_config,
    init_process_group,
    partition,
    shard_state_dict,
    spawn,
    vocab_parallel_argmax,
    vocab_parallel_topk,
)

__all__ = ["MOE_MODES", "NCCL_ENV", "Comm", "TPModel", "assert_replicated", "check_tp_config",
           "init_process_group", "partition", "shard_state_dict", "spawn", "vocab_parallel_argmax",
           "vocab_parallel_topk"]
