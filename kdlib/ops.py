"""One name per op, dispatched by array module: numpy -> `kdlib.ref`, cupy -> `kdlib.cuda`.

    tree = kdlib.ops.build_tree_batch(ids, lps, budget)        # numpy, cupy or torch arrays
    paths, lengths, bonus = kdlib.ops.accept_greedy_batch(tree, targets)

torch tensors cross without copies: CPU tensors become numpy views (`Tensor.numpy()`;
bfloat16 through an int16 view reinterpreted as `ml_dtypes.bfloat16`), CUDA tensors become
cupy arrays through DLPack (bool as uint8 bytes viewed back as bool; bfloat16 stays a torch
tensor, which the kdlib.cuda wrappers take as it is, since CuPy has no bfloat16); results come
back as torch tensors on the same device (DDTree and DDTreeBatch fields included). In-place ops
(`compact_kv*`, `remap_slots`) write through the views into the caller's tensors;
`compact_kv*` return the caller's own object. `kdlib.cuda` is imported
only when a cupy (or CUDA torch) argument shows up.
"""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np

from kdlib import ref
from kdlib.cuda import loader
from kdlib.ref.tree import DDTree, DDTreeBatch

# every reference operation; the tree containers and constants are not dispatched
OPS = tuple(n for n in ref.__all__ if n not in ("PAD", "KV_LORA_RANK", "DDTree", "DDTreeBatch"))

RETURNS_FIRST_ARG = ("compact_kv", "compact_kv_batch")  # in place: they return their `cache` argument


def _kind(x) -> str | None:
    """'numpy', 'cupy', 'torch-cpu', 'torch-cuda' or None (not an array)."""
    mod = type(x).__module__
    if mod.startswith("numpy"):  # a numpy scalar (np.float64(0.1), np.int64(64)) is a number, not an array
        return "numpy" if hasattr(x, "shape") and not isinstance(x, np.generic) else None
    if mod.startswith("cupy"):
        return "cupy"
    if mod.startswith("torch") and hasattr(x, "device"):
        return "torch-cuda" if x.device.type == "cuda" else "torch-cpu"
    if isinstance(x, DDTree | DDTreeBatch):
        kinds = {_kind(getattr(x, f.name)) for f in dataclasses.fields(x)} - {None}
        if len(kinds) > 1:
            raise ValueError(f"{type(x).__name__} mixes array kinds {sorted(kinds)}")
        return kinds.pop() if kinds else None
    return None


def _torch_to_numpy(t):
    """A numpy view of a torch CPU tensor; bfloat16 and float8 (which numpy lacks) cross as integers of their
    size (any shape and strides), viewed as ml_dtypes' types of the same bits."""
    import ml_dtypes
    import torch

    t = t.detach()
    lacking = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
               torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
               torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2),
               torch.float8_e4m3fnuz: (torch.uint8, ml_dtypes.float8_e4m3fnuz),
               torch.float8_e5m2fnuz: (torch.uint8, ml_dtypes.float8_e5m2fnuz)}
    if t.dtype in lacking:
        bits, kind = lacking[t.dtype]
        return t.view(bits).numpy().view(kind)
    return t.numpy()


def _to_backend(x, kind: str, originals: dict, in_tree: bool = False):
    """torch -> numpy/cupy view; containers recursively; remember each view's torch original.

    A torch CUDA bfloat16 tensor outside a DDTree stays torch: CuPy has no bfloat16 dtype, and the
    kdlib.cuda wrappers take torch CUDA tensors themselves.
    """
    if isinstance(x, DDTree | DDTreeBatch):
        return type(x)(
            **{f.name: _to_backend(getattr(x, f.name), kind, originals, True) for f in dataclasses.fields(x)}
        )
    k = _kind(x)
    if k == "torch-cpu":
        v = _torch_to_numpy(x)
    elif k == "torch-cuda":
        import torch

        if x.dtype == torch.bfloat16 and not in_tree:
            return x
        v = loader.as_cupy(x.detach())  # DLPack view; bool crosses as bytes
    else:
        return x
    originals[id(v)] = (v, x)
    return v


def _to_torch(x, originals: dict):
    if isinstance(x, tuple):
        return tuple(_to_torch(v, originals) for v in x)
    if isinstance(x, DDTree | DDTreeBatch):
        return type(x)(**{f.name: _to_torch(getattr(x, f.name), originals) for f in dataclasses.fields(x)})
    hit = originals.get(id(x))
    if hit is not None and hit[0] is x:
        return hit[1]  # an in-place op returned the caller's own buffer
    k = _kind(x)
    if k == "numpy":
        import torch

        return torch.from_numpy(x)
    if k == "cupy":
        import cupy
        import torch

        if x.dtype == cupy.bool_:
            return torch.from_dlpack(x.view(cupy.uint8)).view(torch.bool)
        return torch.from_dlpack(x)
    return x


def _backend(args, kwargs) -> tuple[str, bool]:
    """('numpy' | 'cupy', whether torch arguments need converting back)."""
    kinds = {_kind(a) for a in (*args, *kwargs.values())} - {None}
    device = {"numpy": "cpu", "torch-cpu": "cpu", "cupy": "cuda", "torch-cuda": "cuda"}
    devices = {device[k] for k in kinds}
    if len(devices) > 1:
        raise ValueError(f"arguments live on different devices: {sorted(kinds)}")
    is_torch = any(k.startswith("torch") for k in kinds)
    return ("cupy" if devices == {"cuda"} else "numpy"), is_torch


def _implementation(name: str, backend: str):
    if backend == "numpy":
        return getattr(ref, name)
    try:
        cuda = importlib.import_module("kdlib.cuda")
    except ImportError as e:
        raise NotImplementedError(f"kdlib.cuda could not be imported for {name}: {e}") from e
    fn = getattr(cuda, name, None)
    if fn is None:
        raise NotImplementedError(f"kdlib.cuda has no {name} yet")
    return fn


def _make(name: str):
    def op(*args, **kwargs):
        backend, is_torch = _backend(args, kwargs)
        fn = _implementation(name, backend)
        if not is_torch:
            return fn(*args, **kwargs)
        kind = "torch-cuda" if backend == "cupy" else "torch-cpu"
        originals: dict = {}
        torch_args, torch_kwargs = args, kwargs
        args = tuple(_to_backend(a, kind, originals) for a in args)
        kwargs = {k: _to_backend(v, kind, originals) for k, v in kwargs.items()}
        result = fn(*args, **kwargs)
        if name in RETURNS_FIRST_ARG:
            # the caller's cache, written in place
            return torch_args[0] if torch_args else torch_kwargs["cache"]
        return _to_torch(result, originals)

    ref_fn = getattr(ref, name)
    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"Dispatching `{name}` (numpy -> kdlib.ref, cupy -> kdlib.cuda).\n\n{ref_fn.__doc__}"
    op.__wrapped__ = ref_fn
    return op


build_tree = _make("build_tree")
build_tree_batch = _make("build_tree_batch")
accept_greedy = _make("accept_greedy")
accept_greedy_batch = _make("accept_greedy_batch")
sample_tokens = _make("sample_tokens")
accept_sample = _make("accept_sample")
accept_sample_batch = _make("accept_sample_batch")
prefix_attention = _make("prefix_attention")
tree_tail_attention = _make("tree_tail_attention")
merge_attention = _make("merge_attention")
tree_verify_attention = _make("tree_verify_attention")
compact_kv = _make("compact_kv")
compact_kv_batch = _make("compact_kv_batch")
remap_slots = _make("remap_slots")

__all__ = ["DDTree", "DDTreeBatch", *OPS]
