"""kdlib.ops: dispatch by array module, torch crossing without copies, results back as torch."""

import numpy as np
import pytest
import torch

from kdlib import ops, ref
from kdlib.check import assert_close


def example():
    ids = np.array([[[10, 11], [20, 21], [30, 31]]], dtype=np.int64)
    lp = np.log(np.array([[[0.60, 0.30], [0.90, 0.05], [0.45, 0.40]]], dtype=np.float32))
    return ids, lp


def test_numpy_goes_to_ref():
    ids, lp = example()
    a = ops.build_tree_batch(ids, lp, 5)
    b = ref.build_tree_batch(ids, lp, 5)
    assert isinstance(a.parents, np.ndarray)
    np.testing.assert_array_equal(a.visibility, b.visibility)


def test_torch_cpu_round_trip():
    ids, lp = example()
    t = ops.build_tree_batch(torch.from_numpy(ids), torch.from_numpy(lp), 5)
    assert isinstance(t.parents, torch.Tensor) and t.parents.dtype == torch.int64
    assert t.tree(0).parents.tolist() == [-1, 0, 1, 0, 3, 2]
    paths, lengths, bonus = ops.accept_greedy_batch(t, torch.tensor([[11, 0, 0, 20, 77, 0]]))
    assert paths[0, :3].tolist() == [0, 3, 4] and lengths.tolist() == [3] and bonus.tolist() == [77]
    path, b1 = ops.accept_greedy(t.tree(0), torch.tensor([11, 0, 0, 20, 77, 0]))
    assert isinstance(path, torch.Tensor) and b1 == 77


def test_in_place_ops_write_through_torch():
    cache = torch.arange(24, dtype=torch.bfloat16).reshape(8, 3)
    before = cache.clone()
    out = ops.compact_kv(cache, 2, torch.tensor([0, 3, 4]))
    assert out is cache
    assert torch.equal(cache[2:5], before[[2, 5, 6]])
    req = torch.zeros((1, 8), dtype=torch.int32)
    freed = ops.remap_slots(req, torch.tensor([1]), torch.tensor([[7, 8, 9]], dtype=torch.int32),
                            torch.tensor([[0, 2]]), torch.tensor([2]))
    assert req[0, 1:3].tolist() == [7, 9] and freed.tolist() == [8]


def test_attention_torch_bf16():
    rng = np.random.default_rng(0)
    q = torch.from_numpy(rng.standard_normal((2, 2, 576)).astype(np.float32)).to(torch.bfloat16)
    kv = torch.from_numpy(rng.standard_normal((4, 576)).astype(np.float32))
    out, lse = ops.prefix_attention(q, kv, torch.tensor([3, 1, 0]), 3, 0.1)
    ref_out, ref_lse = ref.prefix_attention(
        q.float().numpy().astype(np.float64), kv.numpy(), np.array([3, 1, 0]), 3, 0.1
    )
    assert out.dtype == torch.float64
    np.testing.assert_array_equal(out.numpy(), ref_out)
    np.testing.assert_array_equal(lse.numpy(), ref_lse)


def test_errors_pass_through():
    ids, lp = example()
    with pytest.raises(ValueError, match="sorted"):
        ops.build_tree_batch(torch.from_numpy(ids), torch.from_numpy(lp[..., ::-1].copy()), 5)


def test_numpy_scalars_are_numbers_not_a_device():
    """softmax_scale=1 / np.sqrt(192) or budget=np.int64(64) beside device arrays: the arrays pick the
    device. (A stand-in for a CuPy array: the dispatcher reads only its type's module.)"""
    device_array = type("ndarray", (), {"__module__": "cupy._core.core", "shape": (2,)})()
    assert ops._backend((device_array, np.float64(0.07)), {"budget": np.int64(64)}) == ("cupy", False)
    assert ops._backend((np.zeros(2), np.float32(1.0)), {}) == ("numpy", False)
    with pytest.raises(ValueError, match="different devices"):  # a numpy array beside it still is one
        ops._backend((device_array, np.zeros(2)), {})
    ids, lp = example()
    tree = ops.build_tree_batch(torch.from_numpy(ids), torch.from_numpy(lp), np.int64(5))
    assert isinstance(tree.node_token_ids, torch.Tensor)


def test_torch_float8_and_bf16_caches_compact_in_place():
    """compact_kv on torch CPU caches of the dtypes numpy lacks (bf16, both float8 kinds): the rows move in
    the tensor itself, bit for bit (a float8 cache once failed inside torch's numpy bridge)."""
    rows = torch.arange(32, dtype=torch.float32).reshape(8, 4) / 4
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        cache = rows.to(dtype)
        want = cache.clone()
        want[2:4] = cache[[3, 5]]
        ops.compact_kv(cache, 2, torch.tensor([1, 3]))  # node i of the path at row start + 1 + i
        assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8)), dtype


def test_torch_bf16_crosses_to_numpy_at_any_shape_and_stride():
    """The bridge views bf16 through int16 (its own size): a 0-d tensor and one whose last stride is not 1
    cross with their values (viewed as bytes, both failed inside torch)."""
    scalar, transposed = torch.tensor(1.5, dtype=torch.bfloat16), torch.arange(24.0).reshape(4, 6).T
    for t in (scalar, transposed.to(torch.bfloat16)):
        got = ops._torch_to_numpy(t)
        assert got.shape == tuple(t.shape)
        np.testing.assert_array_equal(got.astype(np.float32), t.float().numpy())


@pytest.mark.gpu
def test_cupy_dispatches_to_cuda():
    import cupy

    ids, lp = example()
    got = ops.build_tree_batch(cupy.asarray(ids), cupy.asarray(lp), 5)
    assert isinstance(got.parents, cupy.ndarray)
    want = ref.build_tree_batch(ids, lp, 5)
    np.testing.assert_array_equal(cupy.asnumpy(got.parents), want.parents)
    got_t = ops.build_tree_batch(torch.from_numpy(ids).cuda(), torch.from_numpy(lp).cuda(), 5)
    assert got_t.parents.is_cuda
    np.testing.assert_array_equal(got_t.parents.cpu().numpy(), want.parents)


@pytest.mark.gpu
def test_torch_cuda_bf16_bool_and_in_place():
    """bf16 queries, a bool visibility mask and an in-place compaction, all as torch CUDA tensors."""
    ids, lp = example()
    trees = ops.build_tree_batch(torch.from_numpy(ids).cuda(), torch.from_numpy(lp).cuda(), 5)
    assert trees.visibility.dtype == torch.bool and trees.visibility.is_cuda
    rng = np.random.default_rng(1)
    q = torch.from_numpy(rng.standard_normal((1, 6, 8, 576)).astype(np.float32)).to(torch.bfloat16).cuda()
    tkv = torch.from_numpy(rng.standard_normal((1, 6, 576)).astype(np.float32)).to(torch.bfloat16).cuda()
    out, lse = ops.tree_tail_attention(q, tkv, trees.visibility, trees.sizes, 0.07)
    want = ref.tree_tail_attention(q.float().cpu().numpy(), tkv.float().cpu().numpy(),
                                   trees.visibility.cpu().numpy(), trees.sizes.cpu().numpy(), 0.07)
    assert out.is_cuda
    assert_close(out.cpu().numpy(), want[0], rtol=2e-2, name="bf16 tail via ops")
    cache = torch.arange(24, dtype=torch.float32, device="cuda").reshape(8, 3)
    before = cache.clone()
    got = ops.compact_kv_batch(
        cache,
        torch.tensor([2], device="cuda"),
        torch.tensor([[0, 3, 4]], device="cuda"),
        torch.tensor([3], device="cuda"),
    )
    assert got is cache and torch.equal(cache[2:5], before[[2, 5, 6]])
