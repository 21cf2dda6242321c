"""kernels/moe_routing/v1.cu (the device routing of `kdlib.engine.int4.device_routing` on CUDA) against
`routing_torch` (itself checked against stable argsorts in tests/test_k2_rank.py): on the host emulation
(g++, every CPU) and on the GPU (marked gpu), including a captured CUDA graph replayed over new expert
choices."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kdlib.cuda import loader
from kdlib.engine.int4 import (
    ROUTING_KERNEL,
    ROUTING_MAX_SMEM,
    ROUTING_WARPS,
    device_routing,
    routing_kernel,
    routing_smem,
    routing_torch,
)

FIELDS = ("expert_offsets", "active_experts", "n_active", "active_ranges", "sorted_token", "sorted_weight",
          "max_count")
POISON = -7


def cases():
    """(ids [M, k] int64, weights [M, k] float32, e0, n_local): Kimi-K2 shapes (384 experts, top 8) on
    one rank of tp (all 384 local) and ep (48 local), ragged row counts, a crowded routing, a rank with
    no local slot, and more local experts than the kernel's threads (each thread then scans 2 keys)."""
    g = torch.Generator().manual_seed(0)

    def uniform(M, E, k):
        return torch.rand(M, E, generator=g).topk(k).indices

    out = []
    for M in (1, 3, 17, 130, 1040):
        ids = uniform(M, 384, 8)
        out += [(ids, 0, 384), (ids, 48 * (M % 8), 48)]
    crowd = torch.randint(0, 6, (257, 8), generator=g)  # repeated experts in a row: still one slot each
    out += [(crowd, 0, 384), (crowd, 2, 3), (uniform(64, 384, 8), 1000, 16), (uniform(200, 1100, 6), 0, 1100)]
    return [(ids, torch.rand(ids.shape, generator=g), e0, n) for ids, e0, n in out]


def case_id(c):
    ids, _, e0, n = c
    return f"M{ids.shape[0]}-k{ids.shape[1]}-e0{e0}-n{n}"


CASES = cases()


def assert_same(got: dict, want, what: str) -> None:
    for name in FIELDS:
        a, b = got[name], getattr(want, name).cpu().numpy()
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{what}: {name}: {a.dtype}{a.shape}"
        np.testing.assert_array_equal(a, b, err_msg=f"{what}: {name}")


# ----------------------------------------------------------------------------- the host emulation
@pytest.fixture(scope="module")
def routing_host(host_emulation):
    return host_emulation(ROUTING_KERNEL[0], "moe_routing_driver")


def host_routing(lib, ids: torch.Tensor, w: torch.Tensor, e0: int, n_local: int, bound: int = 0,
                 overflow: np.ndarray | None = None) -> dict:
    """moe_routing_v1 on the host emulation, outputs poisoned first -> the DeviceRouting arrays (numpy);
    overflow: the [1] int64 counter the kernel increments past `bound` (None: the null pointer)."""
    M, k = ids.shape
    out = {"expert_offsets": np.full(n_local + 1, POISON, np.int32),
           "active_experts": np.full(n_local, POISON, np.int32), "n_active": np.full(1, POISON, np.int32),
           "active_ranges": np.full((n_local, 2), POISON, np.int32),
           "sorted_token": np.full(M * k, POISON, np.int32),
           "sorted_weight": np.full(M * k, POISON, np.float32), "max_count": np.full(1, POISON, np.int64)}
    ids_np = np.ascontiguousarray(ids.numpy(), dtype=np.int64)
    w_np = np.ascontiguousarray(w.numpy(), dtype=np.float32)

    def ptr(a):
        return a.ctypes.data_as(ctypes.c_void_p)

    rc = lib.emu_routing(
        ctypes.c_int(32 * ROUTING_WARPS), ctypes.c_int(routing_smem(M * k, n_local)), ptr(ids_np), ptr(w_np),
        ctypes.c_int(M * k), ctypes.c_int(k), ctypes.c_longlong(e0), ctypes.c_int(n_local),
        *(ptr(out[n]) for n in FIELDS), ctypes.c_int(bound), ptr(overflow) if overflow is not None else None)
    assert rc == 0, "the emulated block deadlocked"
    out["max_count"] = out["max_count"].reshape(())
    return out


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_host_kernel_matches_routing_torch(routing_host, case):
    ids, w, e0, n = case
    assert_same(host_routing(routing_host, ids, w, e0, n), routing_torch(ids, w, e0, n), case_id(case))


@pytest.mark.parametrize("case", CASES[:4], ids=case_id)
def test_host_kernel_counts_an_expert_past_the_bound(routing_host, case):
    """With a counter the kernel adds 1 when the largest local count passes `bound` and 0 at the bound;
    the torch path counts the same."""
    ids, w, e0, n = case
    top = int(routing_torch(ids, w, e0, n).max_count)
    counter = np.zeros(1, np.int64)
    for bound, want in ((top, 0), (top - 1, 1), (0, 1 + (top > 0))):
        host_routing(routing_host, ids, w, e0, n, bound, counter)
        assert int(counter[0]) == want, (bound, top)
    mine = torch.zeros((), dtype=torch.int64)
    device_routing(ids, w, e0, n, top - 1, mine)
    assert int(mine) == 1


def test_kernel_shared_memory_is_the_sources_layout():
    """routing_smem counts the .cu header's layout; the grid's largest routing (M 1,040 x top-8 over 384
    experts) fits and a routing past the limit is refused with the sizes."""
    src = loader.source_path(ROUTING_KERNEL[0]).read_text()
    assert f"#define RT_WARPS {ROUTING_WARPS}" in src
    assert f"{routing_smem(8320, 384):,} B at n_local = 384 and 8,320 slots" in src
    assert routing_smem(8320, 384) <= ROUTING_MAX_SMEM
    too_many = torch.zeros(ROUTING_MAX_SMEM // 4, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="shared memory"):
        routing_kernel(too_many, torch.zeros(too_many.shape), 0, 384)


def test_device_routing_dispatch_on_cpu_is_the_torch_path():
    ids, w, e0, n = CASES[0]
    got, want = device_routing(ids, w, e0, n), routing_torch(ids, w, e0, n)
    assert_same({f: getattr(got, f).numpy() for f in FIELDS}, want, "cpu dispatch")


# ----------------------------------------------------------------------------- the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gpu_kernel_matches_routing_torch(case):
    ids, w, e0, n = case
    want = routing_torch(ids, w, e0, n)
    counter = torch.zeros((), dtype=torch.int64, device="cuda")
    got = routing_kernel(ids.cuda(), w.cuda(), e0, n, int(want.max_count) - 1, counter)
    assert_same({f: getattr(got, f).cpu().numpy() for f in FIELDS}, want, case_id(case))
    assert int(counter) == 1  # the largest count passes a bound one below it


@pytest.mark.gpu
def test_gpu_kernel_replays_in_a_cuda_graph():
    """Captured once, replayed over new expert choices copied into the static input: each replay's arrays
    are the reference's for that choice."""
    from kdlib.engine.batch import cupy_on_torch_stream

    g = torch.Generator().manual_seed(5)
    M, E, k = 90, 384, 8
    ids = torch.zeros(M, k, dtype=torch.int64, device="cuda")
    w = torch.zeros(M, k, dtype=torch.float32, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), cupy_on_torch_stream():
        routing_kernel(ids, w, 0, E)  # compiled and loaded before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            rt = routing_kernel(ids, w, 0, E)
    for _ in range(3):
        new_ids = torch.rand(M, E, generator=g).topk(k).indices
        new_w = torch.rand(M, k, generator=g)
        ids.copy_(new_ids)
        w.copy_(new_w)
        graph.replay()
        torch.cuda.synchronize()
        assert_same({f: getattr(rt, f).cpu().numpy() for f in FIELDS}, routing_torch(new_ids, new_w, 0, E),
                    "replay")
