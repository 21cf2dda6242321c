"""numpy references for DDTree: float64 where it matters, exact where it must be.

Every function here has a CUDA twin in `kdlib.cuda` with the same name and the same positional
arguments (defaults included); a twin may add keyword-only options (check_values, out, version, ...),
and the sampling twins' `order=` defaults to None: the default kernel, which draws in the reference's
default order, "blocked".
`kdlib.ops` dispatches between the two by array module. Modules:

  tree       DDTree, DDTreeBatch, build_tree, build_tree_batch       (survey §2.3-2.5)
  accept     accept_greedy[_batch], sample_tokens, accept_sample[_batch]  (§4)
  attention  prefix_attention, tree_tail_attention, merge_attention,
             tree_verify_attention (MLA absorb form, natural-log LSE)  (§3)
  compact    compact_kv, compact_kv_batch, remap_slots               (§5.1)

`kdlib.ref.fp8` (the FP8 MLA latent-cache layout an FP8 verify kernel is checked against, issue 19) has no
CUDA twin yet, so it is not re-exported here: import it as a module.

Padding conventions (batched forms, `budget + 1` slots, slot 0 = root): -1 in int arrays,
False in visibility, NaN in float arrays; per-request sizes are explicit (`sizes`, n + 1).
"""

from kdlib.ref.accept import (
    accept_greedy,
    accept_greedy_batch,
    accept_sample,
    accept_sample_batch,
    sample_tokens,
)
from kdlib.ref.attention import (
    KV_LORA_RANK,
    merge_attention,
    prefix_attention,
    tree_tail_attention,
    tree_verify_attention,
)
from kdlib.ref.compact import compact_kv, compact_kv_batch, remap_slots
from kdlib.ref.tree import PAD, DDTree, DDTreeBatch, build_tree, build_tree_batch

__all__ = [
    "PAD",
    "KV_LORA_RANK",
    "DDTree",
    "DDTreeBatch",
    "build_tree",
    "build_tree_batch",
    "accept_greedy",
    "accept_greedy_batch",
    "sample_tokens",
    "accept_sample",
    "accept_sample_batch",
    "prefix_attention",
    "tree_tail_attention",
    "merge_attention",
    "tree_verify_attention",
    "compact_kv",
    "compact_kv_batch",
    "remap_slots",
]
