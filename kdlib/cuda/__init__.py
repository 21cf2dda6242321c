"""CuPy glue for the CUDA kernels in `kernels/<family>/*.cu`.

`loader` compiles and caches the sources (`loader.get_function(stem, kernel_name)`). Each
wrapper module has the function names and positional arguments of its `kdlib.ref` twin (keyword-only
options may be added: `kdlib.ref`'s docstring says which), takes CuPy
arrays (or torch CUDA tensors, by DLPack without copies), checks shapes, dtypes and limits
before any launch (ValueError), and returns CuPy arrays:

- `kdlib.cuda.tree`: `build_tree_batch` (and the one-request `build_tree`)
- `kdlib.cuda.accept`: `accept_greedy_batch`, `sample_tokens`, `accept_sample_batch`
  (and `accept_greedy`, `accept_sample`)
- `kdlib.cuda.compact`: `compact_kv_batch`, `remap_slots` (and `compact_kv`,
  `remap_slots_masked`, which skips the host sync)
- `kdlib.cuda.attention` (the tree-verify MLA kernels): `prefix_attention`,
  `tree_tail_attention`, `merge_attention`, `tree_verify_attention`
- `kdlib.cuda.pipeline`: build -> stand-in verify -> accept -> compact in one CUDA graph

cupy is imported lazily (inside functions), so `import kdlib.cuda` works without it.
"""

import importlib

_EXPORTS = {
    "build_tree": "tree",
    "build_tree_batch": "tree",
    "accept_greedy": "accept",
    "accept_greedy_batch": "accept",
    "sample_tokens": "accept",
    "accept_sample": "accept",
    "accept_sample_batch": "accept",
    "compact_kv": "compact",
    "compact_kv_batch": "compact",
    "remap_slots": "compact",
    "prefix_attention": "attention",
    "tree_tail_attention": "attention",
    "merge_attention": "attention",
    "tree_verify_attention": "attention",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"kdlib.cuda.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'kdlib.cuda' has no attribute {name!r}")
