"""Write every golden vector of the workbook: `python tools/make_golden.py [--out DIR]`.

The one deterministic generator of `data/golden/*.kdtr` (inputs + the kdlib.ref outputs).
`python tools/make_golden.py --check` regenerates into a temporary folder and compares with the
committed files (tests/test_golden.py does the same). Fixed seeds, inputs built with IEEE
arithmetic and libm only (no SIMD-dispatched exp/log/pow), no timestamps or commits in the
metadata: every byte is the same on any x86-64 CPU except the attention outputs (COMPUTED),
which go through BLAS and numpy's SIMD exp, and are compared at a tolerance.

Files and tensors (B requests, S = budget + 1 slots, all padding as in kdlib.ref.DDTreeBatch):

  tree_<config>.kdtr      build + greedy accept, one per named configuration (CONFIGS)
      inputs   top_token_ids [B, L, K'] int64, top_log_probs [B, L, K'] float32, budget [] int64,
               target_tokens [B, S] int64 (the target's token at every node)
      outputs  sizes [B], node_token_ids [B, budget], node_depths [B, budget], parents [B, S],
               visibility [B, S, S] bool, next_token [B, S], next_sibling [B, S], positions [B, S],
               scores [B, budget] float64; paths [B, S] (max_depth = budget), lengths [B], bonus [B]
  accept_sample.kdtr      sampling: the tree tensors above plus
      inputs   probs [B, S, V] float32, uniforms [B, S] float64, st_probs [N, V] float32,
               st_uniforms [N] float64
      outputs  tokens [B, S] int64 (sample_tokens per node), paths, lengths, bonus, st_tokens [N]
  attention_<case>.kdtr   tree-verify MLA attention (absorb form, 576 = 512 latent + 64 rope)
      inputs   q [B, Q, H, 576], kv_cache [slots, 576], tree_kv [B, Q, 576] (float32 or bfloat16),
               page_table [B, P] int32, prefix_lens [B] int64, visibility [B, Q, Q] bool,
               tree_sizes [B] int64, softmax_scale [] float64
      outputs  out [B, Q, H, 512] float64, lse [B, Q, H] float64 (natural log), and the parts
               prefix_out/prefix_lse and tail_out/tail_lse (merge(prefix, tail) == out)
  compact.kdtr            KV compaction and the page_size 1 remap
      inputs   cache [slots, 576] float32, starts [B] int64, paths [B, W] int64, lengths [B] int64,
               req_to_token [B, ctx] int32, remap_starts [B] int64, tree_slots [B, S] int32
      outputs  cache_out [slots, 576], req_to_token_out [B, ctx] int32, freed_slots [k] int32

Poison (so an out-of-bounds read shows): top-k columns >= min(budget, K') hold token id
INT64_MAX and log-prob NaN; target tokens, paths past lengths and probs/uniforms at padding
slots hold INT64_MAX / NaN; q and tree_kv rows >= tree_sizes and kv_cache slots no page table
points at are NaN; page_table entries past prefix_lens are INT32_MAX. Metadata (strings):
generator, kind, name, seed, config (JSON), tolerances, poison.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

from kdlib import DATA, kdtr, ref
from kdlib.cli import folder
from kdlib.ref.tree import BATCH_FIELDS, synthetic_topk

GENERATOR = "tools/make_golden.py"
I64_POISON = np.iinfo(np.int64).max
I32_POISON = np.iinfo(np.int32).max
TREE_FIELDS = BATCH_FIELDS
TOL_TREE = "bit-exact: every integer/bool tensor equal; scores equal as float64 bytes"

# name -> (seed, B, L, K', budget, input kind). Input kinds: "draft" = synthetic_topk (peaked,
# sharpness 5), "flat" = sharpness 1 (wide trees), "peaked" = sharpness 14 (deep trees),
# "tied" = dyadic log-probs from {0, -0.5, ..., -2} (exact ties everywhere), "spread" = -10**U(-14, 1)
# (the float64 score sums round, so only REF's exact arithmetic order reproduces them).
CONFIGS = {
    "default": (1, 8, 15, 64, 64, "draft"),  # the production point: L 15, budget 64, K' 64
    "mid": (2, 8, 8, 40, 32, "draft"),  # K' > budget: columns 32..39 unused (poisoned)
    "wide": (3, 8, 3, 64, 64, "flat"),  # shallow and wide
    "underfull": (4, 8, 2, 4, 64, "draft"),  # capacity 4 + 16 = 20 < 64: padding in every request
    "chain": (5, 8, 15, 1, 64, "draft"),  # K' = 1: the rank-0 chain of 15
    "maxbudget": (6, 4, 15, 256, 256, "draft"),  # budget 256: the GPU builder's limit (kdlib.cuda.tree)
    "maxdepth": (7, 8, 16, 16, 64, "peaked"),  # L 16: the deepest the GPU builder takes
    "highbatch": (8, 64, 15, 64, 64, "draft"),  # B 64: the CPU-baseline point
    "tied": (9, 8, 6, 8, 64, "tied"),
    # exponents over 1e-14..10, far-apart ranks: inexact float64 sums
    "spread": (19, 16, 15, 2, 64, "spread"),
    "budget0": (10, 3, 4, 4, 0, "draft"),  # root-only trees
    "depth0": (11, 3, 0, 4, 8, "draft"),  # L = 0: root-only trees
}


def _meta(kind: str, name: str, seed: int, config: dict, tolerances: dict) -> dict:
    return {
        "generator": GENERATOR,
        "kind": kind,
        "name": name,
        "seed": str(seed),
        "config": json.dumps(config, sort_keys=True),
        "tolerances": json.dumps(tolerances, sort_keys=True),
        "poison": "int64 INT64_MAX / int32 INT32_MAX indices, NaN floats in every unused slot",
    }


def topk_inputs(seed: int, bsz: int, L: int, kp: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    if kind == "tied":
        rng = np.random.default_rng(seed)
        lp = -0.5 * rng.integers(0, 5, size=(bsz, L, kp))  # dyadic: sums exact in float64
        lp = (-np.sort(-lp, axis=-1)).astype(np.float32)
        lp[0] = 0.0  # one request of all-equal log-probs
        ids = np.stack([np.stack([rng.permutation(1000)[:kp] for _ in range(L)]) for _ in range(bsz)]) \
            if L else np.zeros((bsz, 0, kp))
        return ids.astype(np.int64).reshape(bsz, L, kp), lp
    if kind == "spread":
        rng = np.random.default_rng(seed)
        mags = [
            [[math.pow(10.0, e) for e in row] for row in req]
            for req in rng.uniform(-14.0, 1.0, size=(bsz, L, kp))
        ]
        # libm pow: no SIMD variance
        lp = (-np.sort(np.array(mags), axis=-1)).astype(np.float32).reshape(bsz, L, kp)
        ids = np.stack([np.stack([rng.permutation(1000)[:kp] for _ in range(L)]) for _ in range(bsz)])
        return ids.astype(np.int64), lp
    sharp = {"draft": 5.0, "flat": 1.0, "peaked": 14.0}[kind]
    return synthetic_topk(seed, bsz, L, kp, sharpness=sharp, draft_vocab=max(kp, 1024))


def poison_topk(ids: np.ndarray, lp: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    k = min(budget, ids.shape[-1])
    ids, lp = ids.copy(), lp.copy()
    ids[..., k:] = I64_POISON
    lp[..., k:] = np.nan
    return ids, lp


def greedy_targets(rng, trees: ref.DDTreeBatch, follow: float, vocab: int) -> np.ndarray:
    """At each node, the target picks one of its children's tokens with probability `follow`,
    otherwise a random token (usually a miss): acceptance lengths of every size show up."""
    bsz, s = trees.batch, trees.budget + 1
    targets = np.full((bsz, s), I64_POISON, dtype=np.int64)  # [B, S], poisoned past sizes
    for b in range(bsz):
        t = trees.tree(b)
        for i in range(t.n + 1):
            kids = np.flatnonzero(t.parents == i)
            if kids.size and rng.random() < follow:
                targets[b, i] = t.node_token_ids[rng.choice(kids) - 1]
            else:
                targets[b, i] = rng.integers(0, vocab)
    return targets


def tree_file(name: str, out: Path) -> None:
    seed, bsz, L, kp, budget, kind = CONFIGS[name]
    ids, lp = topk_inputs(seed, bsz, L, kp, kind)
    trees = ref.build_tree_batch(ids, lp, budget)
    targets = greedy_targets(np.random.default_rng(seed + 1000), trees, follow=0.8, vocab=32000)
    paths, lengths, bonus = ref.accept_greedy_batch(trees, targets)
    ids_p, lp_p = poison_topk(ids, lp, budget)
    tensors = {"top_token_ids": ids_p, "top_log_probs": lp_p, "budget": np.array(budget, dtype=np.int64),
               "target_tokens": targets}
    tensors.update({f: getattr(trees, f) for f in TREE_FIELDS})
    tensors.update({"paths": paths, "lengths": lengths, "bonus": bonus})
    config = {"batch": bsz, "depth": L, "k_prime": kp, "budget": budget, "inputs": kind, "max_depth": budget}
    kdtr.save(out / f"tree_{name}.kdtr", tensors,
              _meta("tree", name, seed, config, {"tree": TOL_TREE, "accept": "exact"}))


def example_file(out: Path) -> None:
    """Survey §2.7, with the greedy walk example (target 11 at node 0, 20 at 3, 77 at 4)."""
    ids = np.array([[[10, 11], [20, 21], [30, 31]]], dtype=np.int64)
    lp = np.log(np.array([[[0.60, 0.30], [0.90, 0.05], [0.45, 0.40]]], dtype=np.float32))
    trees = ref.build_tree_batch(ids, lp, 5)
    targets = np.array([[11, 0, 0, 20, 77, 0]], dtype=np.int64)
    paths, lengths, bonus = ref.accept_greedy_batch(trees, targets)
    tensors = {
        "top_token_ids": ids,
        "top_log_probs": lp,
        "budget": np.array(5, dtype=np.int64),
        "target_tokens": targets,
    }
    tensors.update({f: getattr(trees, f) for f in TREE_FIELDS})
    tensors.update({"paths": paths, "lengths": lengths, "bonus": bonus})
    kdtr.save(out / "tree_example.kdtr", tensors,
              _meta("tree", "example", 0, {"survey": "ddtree-survey.md section 2.7", "budget": 5},
                    {"tree": TOL_TREE, "accept": "exact"}))


def sample_file(out: Path) -> None:
    seed, bsz, L, kp, budget, vocab = 20, 8, 6, 8, 32, 16
    rng = np.random.default_rng(seed)
    ids = np.stack([np.stack([rng.permutation(vocab)[:kp] for _ in range(L)]) for _ in range(bsz)]).astype(
        np.int64
    )
    lp = -np.sort(rng.random((bsz, L, kp)) * 4.0, axis=-1).astype(np.float32)
    trees = ref.build_tree_batch(ids, lp, budget)
    s = budget + 1
    r = rng.random((bsz, s, vocab))
    weights = r * r * r  # uneven target distributions; products, not a SIMD pow whose rounding varies
    for b in range(bsz):  # lean towards the drafted children, so that walks go deep
        t = trees.tree(b)
        for i in range(1, t.n + 1):
            weights[b, t.parents[i], t.node_token_ids[i - 1]] += 1.0
    probs = (weights / weights.sum(axis=-1, keepdims=True)).astype(np.float32)  # [B, S, V]
    uniforms = rng.random((bsz, s))  # [B, S]
    tokens = np.full((bsz, s), -1, dtype=np.int64)
    for b in range(bsz):
        m = int(trees.sizes[b])
        tokens[b, :m] = ref.sample_tokens(probs[b, :m], uniforms[b, :m])
        probs[b, m:] = np.nan
        uniforms[b, m:] = np.nan
    paths, lengths, bonus = ref.accept_sample_batch(trees, probs, uniforms)
    r = rng.random((64, 1000))
    st_w = (r * r) * (r * r)
    st_w[:, ::7] = 0.0  # zero-probability tokens are never drawn
    st_probs = st_w.astype(np.float32)  # [N, V], unnormalised on purpose
    st_uniforms = rng.random(64)
    st_uniforms[0] = 0.0
    st_tokens = ref.sample_tokens(st_probs, st_uniforms)
    tensors = {"top_token_ids": ids, "top_log_probs": lp, "budget": np.array(budget, dtype=np.int64)}
    tensors.update({f: getattr(trees, f) for f in TREE_FIELDS})
    tensors.update(
        {
            "probs": probs,
            "uniforms": uniforms,
            "tokens": tokens,
            "paths": paths,
            "lengths": lengths,
            "bonus": bonus,
            "st_probs": st_probs,
            "st_uniforms": st_uniforms,
            "st_tokens": st_tokens,
        }
    )
    config = {"batch": bsz, "depth": L, "k_prime": kp, "budget": budget, "vocab": vocab, "max_depth": budget}
    kdtr.save(out / "accept_sample.kdtr", tensors,
              _meta("accept_sample", "sample", seed, config,
                    {"sample": "exact (sequential float64 cumsum, first i with u*total < cumsum[i])"}))


# name -> (seed, B, budget, H, prefix lengths, cache slots, input dtype)
ATTENTION = {
    "small": (30, 2, 4, 8, (0, 37), 48, "float32"),  # 8 heads: Kimi-K2 at TP8
    "mid": (31, 2, 16, 2, (120, 30), 160, "float32"),  # a longer prefix and tree, few heads (file size)
    "bf16": (32, 2, 4, 4, (19, 0), 24, "bfloat16"),
}


def attention_file(name: str, out: Path) -> None:
    import ml_dtypes

    seed, bsz, budget, heads, lens, slots, dtype = ATTENTION[name]
    rng = np.random.default_rng(seed)
    ids, lp = synthetic_topk(seed, bsz, 6, 4, draft_vocab=64)
    trees = ref.build_tree_batch(ids, lp, budget)
    q_len = budget + 1
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    q = rng.standard_normal((bsz, q_len, heads, 576)).astype(np_dtype)  # [B, Q, H, 576]
    tree_kv = rng.standard_normal((bsz, q_len, 576)).astype(np_dtype)  # [B, Q, 576]
    kv_cache = rng.standard_normal((slots, 576)).astype(np_dtype)  # [slots, 576]
    width = max(lens) + 3
    page_table = np.full((bsz, width), I32_POISON, dtype=np.int32)  # [B, P]
    order = rng.permutation(slots)
    at = 0
    for b, n in enumerate(lens):
        page_table[b, :n] = order[at : at + n]
        at += n
    kv_cache[order[at:]] = np.nan
    for b in range(bsz):
        m = int(trees.sizes[b])
        q[b, m:] = np.nan
        tree_kv[b, m:] = np.nan
    prefix_lens = np.array(lens, dtype=np.int64)
    scale = 1.0 / np.sqrt(192.0)  # DeepSeek-V3 / Kimi-K2: 1/sqrt(qk_nope 128 + qk_rope 64)
    args = (q, kv_cache, page_table, prefix_lens)
    p_out, p_lse = ref.prefix_attention(*args, scale)
    t_out, t_lse = ref.tree_tail_attention(q, tree_kv, trees.visibility, trees.sizes, scale)
    v_out, v_lse = ref.merge_attention(p_out, p_lse, t_out, t_lse)
    tensors = {
        "q": q,
        "kv_cache": kv_cache,
        "page_table": page_table,
        "prefix_lens": prefix_lens,
        "tree_kv": tree_kv,
        "visibility": trees.visibility,
        "tree_sizes": trees.sizes,
        "softmax_scale": np.array(scale),
        "out": v_out,
        "lse": v_lse,
        "prefix_out": p_out,
        "prefix_lse": p_lse,
        "tail_out": t_out,
        "tail_lse": t_lse,
    }
    config = {
        "batch": bsz,
        "budget": budget,
        "heads": heads,
        "prefix_lens": list(lens),
        "slots": slots,
        "dtype": dtype,
    }
    tol = {"float32": "1e-5 norm-relative (fp32 kernels)", "bfloat16": "2e-2 norm-relative (bf16 inputs, "
                                                                       "fp32 accumulate)"}
    kdtr.save(
        out / f"attention_{name}.kdtr",
        tensors,
        _meta(
            "attention",
            name,
            seed,
            config,
            {"out_lse": tol[dtype], "reference_recompute": "1e-12 norm-relative (BLAS rounding)"},
        ),
    )


def compact_file(out: Path) -> None:
    seed, bsz, budget, slots = 40, 4, 12, 80
    rng = np.random.default_rng(seed)
    ids, lp = synthetic_topk(seed, bsz, 5, 4, draft_vocab=64)
    trees = ref.build_tree_batch(ids, lp, budget)
    targets = greedy_targets(rng, trees, follow=0.9, vocab=32000)
    paths, lengths, _ = ref.accept_greedy_batch(trees, targets)
    s = budget + 1
    starts = np.array([1 + b * (s + 5) for b in range(bsz)], dtype=np.int64)  # disjoint regions
    paths_p = paths.copy()
    paths_p[paths_p < 0] = I64_POISON
    cache = rng.standard_normal((slots, 576)).astype(np.float32)  # [slots, 576]
    cache_out = ref.compact_kv_batch(cache.copy(), starts, paths, lengths)
    ctx = 40
    req_to_token = np.full((bsz, ctx), I32_POISON, dtype=np.int32)  # [B, ctx]
    remap_starts = rng.integers(0, ctx - s, size=bsz).astype(np.int64)
    tree_slots = np.full((bsz, s), -1, dtype=np.int32)  # [B, S]; -1: no slot (padding)
    pool = rng.permutation(10_000).astype(np.int32)
    for b in range(bsz):
        m = int(trees.sizes[b])
        tree_slots[b, :m] = pool[b * s : b * s + m]
    req_out = req_to_token.copy()
    freed = ref.remap_slots(req_out, remap_starts, tree_slots, paths, lengths)
    tensors = {"cache": cache, "starts": starts, "paths": paths_p, "lengths": lengths, "cache_out": cache_out,
               "req_to_token": req_to_token, "remap_starts": remap_starts, "tree_slots": tree_slots,
               "req_to_token_out": req_out, "freed_slots": freed}
    config = {"batch": bsz, "budget": budget, "slots": slots, "ctx": ctx}
    kdtr.save(out / "compact.kdtr", tensors, _meta("compact", "compact", seed, config, {"all": "exact"}))


# kind -> (tensor names, rtol): outputs computed through BLAS matmuls and numpy's SIMD exp/log, whose
# kernels (and so rounding and summation order) depend on the CPU. Between the OpenBLAS SkylakeX,
# Haswell, Sandybridge and Prescott kernels with numpy's AVX-512, AVX2 and SSE4.2 paths they differ
# by at most 1e-15 norm-relative; 1e-12 is the reference-recompute tolerance of tests/test_golden.py.
# Everything else (inputs, integers, tree scores in REF's sequential float64 order, metadata, layout)
# must match byte for byte.
COMPUTED = {"attention": (("out", "lse", "prefix_out", "prefix_lse", "tail_out", "tail_lse"), 1e-12)}


def close_tensors(path: Path) -> dict[str, float]:
    """name -> rtol for the tensors of golden file `path` compared at a tolerance (COMPUTED by kind)."""
    names, rtol = COMPUTED.get(kdtr.read_metadata(path)["kind"], ((), 0.0))
    return dict.fromkeys(names, rtol)


def check(made: list[Path], committed: Path, close=close_tensors,
          owns=lambda name: not name.startswith("model_")) -> list[str]:
    """Regenerated files `made` against their namesakes in `committed`: one line per difference (or per
    damaged file), and one per committed file this generator `owns` (by name; model_* are
    make_golden_model.py's) that it no longer makes."""
    problems = []
    for p in made:
        if not (committed / p.name).is_file():
            problems.append(f"{p.name}: not in {committed}")
            continue
        try:
            problems += [f"{p.name}: {line}" for line in kdtr.differences(p, committed / p.name, close(p))]
        except kdtr.KdtrError as e:  # a damaged file (truncated, bad checksum): one line, as drift is
            problems.append(f"{p.name}: {e}")
    names = {p.name for p in made}
    problems += [f"{p.name}: in {committed}, not regenerated (no config makes it)"
                 for p in sorted(committed.glob("*.kdtr")) if owns(p.name) and p.name not in names]
    return problems


def generate(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    for name in CONFIGS:
        tree_file(name, out)
    example_file(out)
    sample_file(out)
    for name in ATTENTION:
        attention_file(name, out)
    compact_file(out)
    return sorted(out.glob("*.kdtr"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=folder, default=DATA / "golden", help="output folder (default data/golden)")
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temporary folder and compare with --out instead of writing it")
    args = ap.parse_args(argv)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            problems = check(generate(Path(tmp)), args.out)
        print("\n".join(problems) or f"{args.out}: every golden file regenerates (COMPUTED at their "
                                     "tolerance)")
        return 1 if problems else 0
    for path in generate(args.out):
        print(f"{path}  {path.stat().st_size:>9,d} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
