"""CuPy glue for the CUDA kernels in `kernels/*.cu`.

`loader` compiles and caches the sources (`loader.get_function(stem, kernel_name)`). Each
wrapper module has the same function names and signatures as its `kdlib.ref` twin, takes CuPy
arrays (or torch CUDA tensors, by DLPack without copies), checks shapes, dtypes and limits
before any launch (ValueError), and returns CuPy arrays:

- `kdlib.cuda.tree`: `build_tree_batch`
- `kdlib.cuda.accept`: `accept_greedy_batch`, `sample_tokens`, `accept_sample_batch`
- `kdlib.cuda.compact`: `compact_kv_batch`, `remap_slots`
- `kdlib.cuda.pipeline`: build -> stand-in verify -> accept -> compact in one CUDA graph

cupy is imported lazily (inside functions), so `import kdlib.cuda` works without it.
"""

import importlib

_EXPORTS = {
    "build_tree_batch": "tree",
    "accept_greedy_batch": "accept",
    "sample_tokens": "accept",
    "accept_sample_batch": "accept",
    "compact_kv_batch": "compact",
    "remap_slots": "compact",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"kdlib.cuda.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'kdlib.cuda' has no attribute {name!r}")
