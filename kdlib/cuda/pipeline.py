"""One DDTree decode step on the device, end to end, captured in one CUDA graph.

    build (tree.build_tree_batch, its default version) -> stand-in verify -> accept
    (tree_accept_greedy_v1) -> compact (kv_compact_v1)

The stand-in verify is a lookup-table target: the target's next token after a node is
`target_table[token of that node]` (the root's token is the request's bonus token `root_tokens[b]`).
It runs as two CuPy element-wise ops on the device, so nothing crosses to the host between the
stages. A real verify (the tree_verify attention plus an LM head) would replace exactly this
stage. `reference_step` runs the same step with `kdlib.ref` in numpy; `TreeStep` results must
equal it element for element.

All buffers are allocated up front (`make_step`), so the graph captured by `TreeStep.capture`
reads and writes fixed addresses: refill the inputs in place (`step.ids[...] = ...`) and
`replay()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kdlib import ref
from kdlib.cuda import accept, compact, loader, tree


@dataclass
class TreeStep:
    """Device buffers of one step. Shapes: B requests, L depths, K' columns, S = budget + 1.

    Inputs:  ids [B, L, K'] int64, lp [B, L, K'] float32, root [B] int64, table [V] int64,
             cache [num_slots, D...] (compacted in place), starts [B] int64.
    Outputs: trees (DDTreeBatch), targets [B, S] int64, paths [B, min(L, budget)+1] int64,
             lengths [B] int64, bonus [B] int64, and the compacted cache.
    """

    budget: int
    ids: object
    lp: object
    root: object
    table: object
    cache: object
    starts: object
    trees: object
    tokens: object
    index: object
    targets: object
    paths: object
    lengths: object
    bonus: object
    graph: object = None
    stream: object = None

    def run(self) -> None:
        """Launch the four stages on the current stream (eagerly)."""
        import cupy

        tree.build_tree_batch(self.ids, self.lp, self.budget, out=self.trees)
        self.tokens[:, 0] = self.root
        self.tokens[:, 1:] = self.trees.node_token_ids
        cupy.maximum(self.tokens, 0, out=self.index)  # padding (-1) reads table[0]; never used by the walk
        cupy.take(self.table, self.index, out=self.targets)
        accept.accept_greedy_batch(self.trees, self.targets, max_depth=self.paths.shape[1] - 1,
                                   out=(self.paths, self.lengths, self.bonus))
        compact.compact_kv_batch(self.cache, self.starts, self.paths, self.lengths)

    def capture(self) -> None:
        """Record `run` into one CUDA graph (after one eager run, so every kernel is compiled)."""
        import cupy

        self.run()
        cupy.cuda.runtime.deviceSynchronize()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            self.stream.begin_capture()
            self.run()
            self.graph = self.stream.end_capture()

    def replay(self) -> None:
        """Launch the captured graph on its stream (call `capture` first), after the work already queued on
        the current stream (fresh inputs written into the captured buffers there): `stream` is non-blocking,
        so without that wait the graph could read the old inputs. The outputs are ready once `stream` has run
        it."""
        import cupy

        if self.graph is None:
            raise ValueError("no graph captured: call capture() first")
        current = cupy.cuda.get_current_stream()
        if current != self.stream:
            self.stream.wait_event(current.record())
        self.graph.launch(self.stream)


def _check_step_inputs(ids, lp, root, table, cache, starts):
    if ids.ndim != 3 or lp.shape != ids.shape:
        raise ValueError(f"top_token_ids / top_log_probs must share a [B, L, K'] shape, got {ids.shape}, "
                         f"{lp.shape}")
    bsz = ids.shape[0]
    if root.shape != (bsz,) or starts.shape != (bsz,):
        raise ValueError(f"root_tokens and starts must have shape [{bsz}], got {root.shape}, {starts.shape}")
    if table.ndim != 1:
        raise ValueError(f"target_table must be [V], got shape {table.shape}")
    if cache.ndim < 1:
        raise ValueError("cache must have a slot axis")


def make_step(
    top_token_ids, top_log_probs, root_tokens, target_table, cache, starts, budget: int
) -> TreeStep:
    """Allocate a step's buffers on the device (copies of the inputs; `cache` is used in place).

    Shape: top_token_ids [B, L, K'] int64, top_log_probs [B, L, K'] float32, root_tokens [B] int,
    target_table [V] int (every token id < V), cache [num_slots, D...] (CuPy, compacted in place),
    starts [B] int (tree row i of request b sits at cache row starts[b] + i).
    """
    tree.launch(budget)  # the budget's checks, before any device memory is taken
    budget = int(budget)
    import cupy

    ids = cupy.array(loader.int_array(top_token_ids, "top_token_ids", "int64"))
    lp = loader.as_cupy(top_log_probs)
    if lp.dtype.kind != "f":
        raise ValueError(f"top_log_probs must be a floating array, got {lp.dtype}")
    lp = cupy.array(lp, dtype=cupy.float32)
    root = cupy.array(loader.int_array(root_tokens, "root_tokens", "int64"))
    table = cupy.array(loader.int_array(target_table, "target_table", "int64"))
    st = cupy.array(loader.int_array(starts, "starts", "int64"))
    c = loader.as_cupy(cache)
    _check_step_inputs(ids, lp, root, table, c, st)
    bsz, depth, _ = ids.shape
    if min(depth, budget) > tree.MAX_DEPTH:
        raise ValueError(f"min(L, budget) = {min(depth, budget)} exceeds the GPU builder's depth limit "
                         f"{tree.MAX_DEPTH}")
    s = budget + 1
    width = min(depth, budget) + 1
    return TreeStep(
        budget=budget, ids=ids, lp=lp, root=root, table=table, cache=c, starts=st,
        trees=tree.empty_batch(bsz, budget),
        tokens=cupy.empty((bsz, s), dtype=cupy.int64),  # [B, S] root, then node tokens
        index=cupy.empty((bsz, s), dtype=cupy.int64),  # [B, S]
        targets=cupy.empty((bsz, s), dtype=cupy.int64),  # [B, S]
        paths=cupy.empty((bsz, width), dtype=cupy.int64),  # [B, min(L, budget)+1]
        lengths=cupy.empty(bsz, dtype=cupy.int64),  # [B]
        bonus=cupy.empty(bsz, dtype=cupy.int64),  # [B]
    )


def reference_step(
    top_token_ids, top_log_probs, root_tokens, target_table, cache, starts, budget: int
) -> dict:
    """The same step with `kdlib.ref` on numpy inputs; `cache` is copied, not modified.

    Returns {trees, targets, paths, lengths, bonus, cache}.
    """
    trees = ref.build_tree_batch(top_token_ids, top_log_probs, budget)
    # [B, S]
    tokens = np.concatenate([np.asarray(root_tokens, np.int64)[:, None], trees.node_token_ids], axis=1)
    targets = np.asarray(target_table, np.int64)[np.maximum(tokens, 0)]  # [B, S]
    width = min(top_token_ids.shape[1], budget) + 1
    paths, lengths, bonus = ref.accept_greedy_batch(trees, targets, max_depth=width - 1)
    out = cache.copy()
    ref.compact_kv_batch(out, np.asarray(starts, np.int64), paths, lengths)
    return {
        "trees": trees,
        "targets": targets,
        "paths": paths,
        "lengths": lengths,
        "bonus": bonus,
        "cache": out,
    }


def step_outputs_trees(trees):
    """A DDTreeBatch of CuPy arrays copied to numpy (synchronises)."""
    return trees.__class__(**{k: v.get() for k, v in vars(trees).items()})


def step_outputs(step: TreeStep) -> dict:
    """The step's results copied to numpy (synchronises), keyed like `reference_step`."""
    return {"trees": step_outputs_trees(step.trees),
            "targets": step.targets.get(), "paths": step.paths.get(), "lengths": step.lengths.get(),
            "bonus": step.bonus.get(), "cache": step.cache.get()}


def random_topk(rng: np.random.Generator, bsz: int, depth: int, kp: int, vocab: int, mode: str = "random"):
    """Random drafter top-k for tests and benchmarks: (ids [B, L, K'] int64, lp [B, L, K'] float32).

    Rows hold K' distinct ids from [0, vocab) and non-increasing log-probs. mode:
      "random"   strictly decreasing values (cumulative exponential gaps), generic floats;
      "tied"     values from {0, -0.5, -1, -1.5} (-0.0 included): many exact score ties, so the
                 rank-tuple tie-break decides;
      "denormal" float32 subnormals (k * -1e-42): ties and the exact float->double conversion.
    """
    if kp > vocab:
        raise ValueError(f"K' {kp} exceeds the vocabulary {vocab}")
    shape = (bsz, depth, kp)
    ids = np.argsort(rng.random((bsz, depth, vocab)), axis=-1)[..., :kp].astype(np.int64)  # [B, L, K']
    if mode == "random":
        lp = -np.cumsum(rng.exponential(1.0, shape), axis=-1)
    elif mode == "tied":
        lp = -0.5 * np.sort(rng.integers(0, 4, shape), axis=-1)
    elif mode == "denormal":
        lp = -1e-42 * np.sort(rng.integers(0, 1000, shape), axis=-1)
    else:
        raise ValueError(f"mode must be 'random', 'tied' or 'denormal', got {mode!r}")
    return ids, lp.astype(np.float32)  # float32 rounding is monotone: rows stay non-increasing


def random_step_inputs(rng: np.random.Generator, bsz: int, depth: int, kp: int, vocab: int, budget: int,
                       row_dim: int = 8, mode: str = "random", topk=None) -> dict:
    """Inputs of one `make_step` / `reference_step` call, numpy, with real acceptances.

    The target table is a random map token -> next token; along each request's target chain
    (root, table[root], ...) the drafter's top-k holds the target token at rank 0 with
    probability 1/2, else at a random rank (or not at all when it falls outside K'), so paths of
    every length occur. Cache: [B * (budget + 1) + 1, row_dim] float32, tree rows of request b
    at starts[b] = b * (budget + 1). topk: optional (ids, lp) to plant the chains into (copied)
    instead of `random_topk(rng, bsz, depth, kp, vocab, mode)`.
    """
    if topk is None:
        ids, lp = random_topk(rng, bsz, depth, kp, vocab, mode)
    else:
        ids, lp = np.array(topk[0], dtype=np.int64), np.array(topk[1], dtype=np.float32)
        if ids.shape != (bsz, depth, kp):
            raise ValueError(f"topk ids must have shape {(bsz, depth, kp)}, got {ids.shape}")
    table = rng.integers(0, vocab, vocab).astype(np.int64)  # [V]
    root = rng.integers(0, vocab, bsz).astype(np.int64)  # [B]
    for b in range(bsz):
        tok = root[b]
        for d in range(depth):
            tok = table[tok]
            rank = 0 if rng.random() < 0.5 else int(rng.integers(0, 2 * kp))
            if rank < kp:
                row = ids[b, d]
                hit = np.flatnonzero(row == tok)
                if hit.size:  # keep the row's ids distinct: swap
                    row[hit[0]] = row[rank]
                row[rank] = tok
    cache = rng.standard_normal((bsz * (budget + 1) + 1, row_dim)).astype(np.float32)  # [slots, D]
    starts = np.arange(bsz, dtype=np.int64) * (budget + 1)  # [B]
    return {"top_token_ids": ids, "top_log_probs": lp, "root_tokens": root, "target_table": table,
            "cache": cache, "starts": starts, "budget": budget}


def smoke(bsz: int = 4) -> dict:
    """Run every kernel once on small inputs and compare with `kdlib.ref` (for compute-sanitizer).

    Returns {kernel: bool}. `python3 -m kdlib.cuda.pipeline [--no-pool]` prints it; --no-pool
    gives every array its own cudaMalloc so memcheck sees out-of-bounds accesses exactly.
    """
    import cupy

    rng = np.random.default_rng(0)
    budget, depth, kp, vocab = 24, 6, 8, 40
    inp = random_step_inputs(rng, bsz, depth, kp, vocab, budget, mode="tied")
    want = reference_step(**inp)
    verdict = {}
    step = make_step(cupy.asarray(inp["top_token_ids"]), cupy.asarray(inp["top_log_probs"]),
                     cupy.asarray(inp["root_tokens"]), cupy.asarray(inp["target_table"]),
                     cupy.asarray(inp["cache"]), cupy.asarray(inp["starts"]), budget)
    step.run()  # the default tree build, tree_accept_greedy_v1, kv_compact_v1_u128
    got = step_outputs(step)
    verdict[tree.kernel_name(budget)[1]] = all(
        (getattr(got["trees"], f) == getattr(want["trees"], f)).all()
        for f in ("sizes", "node_token_ids", "parents", "visibility", "next_token", "next_sibling")
    )
    verdict["tree_accept_greedy_v1"] = all((got[k] == want[k]).all() for k in ("paths", "lengths", "bonus"))
    verdict["kv_compact_v1_u128"] = bool((got["cache"] == want["cache"]).all())
    for dtype in (np.float32, np.float64):
        probs = rng.random((bsz, budget + 1, vocab)).astype(dtype)
        u = rng.random((bsz, budget + 1))
        for version in accept.SAMPLE_VERSIONS:
            w = ref.accept_sample_batch(want["trees"], probs, u, order=accept.SAMPLE_ORDER[version])
            p = accept.accept_sample_batch(step.trees, cupy.asarray(probs), cupy.asarray(u), version=version)
            verdict[accept.sample_kernel(dtype, version)[1]] = all(
                (a.get() == b).all() for a, b in zip(p, w, strict=True)
            )
    # every register-row variant of tree_build_v2/v3 (r1, r3, r9) and frontier-row variant of v4 (r1, r2, r4)
    for bud in (budget, 40, 120, 200):
        ids, lp = random_topk(rng, bsz, 10, 16, 50, "tied")
        w = ref.build_tree_batch(ids, lp, bud)
        for version in (2, 3, 4):
            g = tree.build_tree_batch(cupy.asarray(ids), cupy.asarray(lp), bud, version=version)
            verdict[tree.kernel_name(bud, version)[1]] = all(
                (getattr(g, f).get() == getattr(w, f)).all()
                for f in ("sizes", "node_token_ids", "parents", "visibility", "next_token", "next_sibling"))
    got_v1 = tree.build_tree_batch(
        cupy.asarray(inp["top_token_ids"]), cupy.asarray(inp["top_log_probs"]), budget, version=1
    )
    verdict["tree_build_v1"] = all(
        (getattr(got_v1, f).get() == getattr(want["trees"], f)).all()
        for f in ("sizes", "node_token_ids", "parents", "visibility", "next_token", "next_sibling")
    )
    for dtype, shape, name in ((np.int8, (7,), "kv_compact_v1_u8"), (np.float32, (3,), "kv_compact_v1_u32")):
        cache = rng.integers(0, 100, (inp["cache"].shape[0], *shape)).astype(dtype)
        wc = cache.copy()
        ref.compact_kv_batch(wc, inp["starts"], want["paths"], want["lengths"])
        gc = cupy.asarray(cache)
        compact.compact_kv_batch(
            gc, cupy.asarray(inp["starts"]), cupy.asarray(want["paths"]), cupy.asarray(want["lengths"])
        )
        verdict[name] = bool((gc.get() == wc).all())
    slots = rng.permutation(4 * bsz * (budget + 1))[: bsz * (budget + 1)].reshape(bsz, budget + 1)
    for dtype, name in ((np.int64, "kv_remap_v1_i64"), (np.int32, "kv_remap_v1_i32")):
        r2t = np.zeros((bsz, 64), dtype=dtype)
        starts = np.full(bsz, 5, dtype=np.int64)
        wf = ref.remap_slots(r2t, starts, slots, want["paths"], want["lengths"])
        g = cupy.zeros((bsz, 64), dtype=dtype)
        gf = compact.remap_slots(g, cupy.asarray(starts), cupy.asarray(slots), cupy.asarray(want["paths"]),
                                 cupy.asarray(want["lengths"]))
        verdict[name] = bool((g.get() == r2t).all() and (gf.get() == wf).all())
    cupy.cuda.runtime.deviceSynchronize()
    return verdict


if __name__ == "__main__":
    import argparse
    import sys

    from kdlib.cli import require_gpu

    ap = argparse.ArgumentParser(prog="python -m kdlib.cuda.pipeline",
                                 description="the device step's smoke test: each stage against kdlib.ref")
    ap.add_argument("--no-pool", action="store_true",
                    help="CuPy without its memory pool (what compute-sanitizer needs)")
    args = ap.parse_args()
    require_gpu(ap)
    if args.no_pool:
        import cupy

        cupy.cuda.set_allocator(None)
    result = smoke()
    print(result)
    sys.exit(0 if all(result.values()) else 1)
