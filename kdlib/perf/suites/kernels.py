"""The tree kernels on the GPU: build, accept, sample, compaction, remap and the whole step.

`python3 -m kdlib.perf.run --suite kernels --out DIR` -> `kernels.<gpu>.json`. Per batch
B in 1..64 (L 15, budget 64, K' 64: the seeds' comparison point):

  * tree build, every kernel version of `kdlib.cuda.tree.VERSIONS` (v1-v4; `sweep(versions=...)`
    or env `KDLIB_TREE_VERSIONS=3,4` restricts the list), against
    `kdlib.ref.build_tree_batch` on the same inputs in the same run
    (`kdlib.ref.tree.synthetic_topk`, drafter-like): CPU reference time, CPU reference with the
    device->host->device copies and the sync it forces, and three GPU times:
      - `kernel`: one CUDA graph holding REPEAT back-to-back builds, replay time / REPEAT
        (kernel time plus the ~1 us graph node gap);
      - `graph_replay`: a graph of one build, replay time (what a captured decode step pays);
      - `eager`: one launch from Python between two events (includes the CPU launch gap);
    each GPU result is checked bit-exact against the reference before it is timed;
  * tree build at batch 64 on tied inputs (`kdlib.cuda.pipeline.random_topk(..., "tied")`: log-probs
    from 4 values, so most score comparisons are exact ties and the rank tuples decide), kernel
    time per version, so the cost of the tie-break paths is on record;
  * accept (greedy walk), compaction (one layer of bf16 latent KV and 61 layers), page-1 remap
    and the composed step (build -> stand-in verify -> accept -> compact, `kdlib.cuda.pipeline`):
    graph-replay time per step; sampling (V 32,000) eager.
Data are L2-resident (a few MB at most): these kernels are launch/latency-bound and the numbers
are L2-warm, which is what a decode step sees for them.

Floors: compaction moves bytes (read + write of each moved row): floor = bytes / copy bandwidth
from the running GPU's `data/results/ceilings.<gpu>.json` (`kdlib.perf.results.ceilings()`; the H200's
where that GPU has none) when recorded, else the fallback 4.3e12 B/s (kernels-perf.md §0); the other
kernels have no meaningful byte/FLOP floor (dependent latency chains), so only their times are recorded.

The verify-attention sweep of `kdlib.perf.suites._attention` (written by the attention
engineer) is embedded under `verify_attention` when that module exists. `sweep(attention=...)` or env
`KDLIB_KERNELS_ATTENTION` = skip|quick|full overrides its grid (default: quick under --quick,
else full), and `sweep(attention_budget_s=...)` or env `KDLIB_KERNELS_ATTENTION_BUDGET_S` caps its
wall time (its points come in priority order); when absent or skipped, the payload says so.
`run` is `sweep` (the name the entry point calls).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence

import numpy as np

from kdlib import perf, ref
from kdlib.cuda import accept, compact, pipeline, tree
from kdlib.perf import results, timing
from kdlib.perf.suites import env_choice
from kdlib.ref.tree import BATCH_FIELDS, synthetic_topk

BATCHES = (1, 2, 4, 8, 16, 32, 64)
DEPTH, BUDGET, K_PRIME = 15, 64, 64
REPEAT = 20  # builds per graph for the kernel-time estimate: amortises the graph launch
ROW_BYTES = 576 * 2  # one token's bf16 MLA latent (kv_lora 512 + rope 64) in one layer
LAYERS = 61  # Kimi-K2 / DeepSeek-V3 layer count (data/configs)
SAMPLE_VOCAB = 32000


def _graph_ms(fn, iters: int, repeats: int = 1) -> dict:
    """Timing dict of a CUDA-graph replay of `repeats` calls of fn (after an eager warm-up call)."""
    return timing.graph_time(fn, iters=iters, warmup=5, repeats=repeats).as_dict()


def _us(d: dict, repeats: int = 1) -> float:
    return d["median_ms"] * 1e3 / repeats


def _trees_equal(got, want) -> bool:
    for name in BATCH_FIELDS:
        g, w = getattr(got, name).get(), getattr(want, name)
        if name == "scores":
            g, w = g.view(np.int64), w.view(np.int64)
        if g.shape != w.shape or not (g == w).all():
            return False
    return True


def tree_versions(versions: Sequence[int] | None = None) -> tuple[int, ...]:
    """The build versions to time: `versions`, else `KDLIB_TREE_VERSIONS` (comma-separated), else all
    of tree.VERSIONS."""
    if versions is not None:
        chosen, raw = tuple(versions), list(versions)
    else:
        raw = os.environ.get("KDLIB_TREE_VERSIONS", "").strip()
        if not raw:
            return tuple(tree.VERSIONS)
        try:
            chosen = tuple(int(v) for v in raw.split(","))
        except ValueError:
            raise ValueError(f"KDLIB_TREE_VERSIONS must be comma-separated ints, got {raw!r}") from None
    unknown = [v for v in chosen if v not in tree.VERSIONS]
    if unknown or not chosen:
        source = "versions" if versions is not None else "KDLIB_TREE_VERSIONS"
        raise ValueError(f"{source} {raw!r}: versions must be among {tree.VERSIONS}")
    return chosen


def bench_build(ids_all, lp_all, iters: int, versions: Sequence[int] = tree.VERSIONS) -> list[dict]:
    """One row per (batch, kernel version): GPU times, CPU reference times, speed-ups, exactness."""
    import cupy

    rows = []
    for bsz in BATCHES:
        ids, lp = ids_all[:bsz], lp_all[:bsz]
        d_ids, d_lp = cupy.asarray(ids), cupy.asarray(lp)
        want = ref.build_tree_batch(ids, lp, BUDGET)

        def cpu_with_copies(d_ids=d_ids, d_lp=d_lp):
            t = ref.build_tree_batch(d_ids.get(), d_lp.get(), BUDGET)
            arrays = [
                cupy.asarray(getattr(t, f))
                for f in (
                    "sizes",
                    "node_token_ids",
                    "parents",
                    "visibility",
                    "next_token",
                    "next_sibling",
                    "positions",
                )
            ]
            cupy.cuda.runtime.deviceSynchronize()
            return arrays

        cpu = perf.cpu_time(
            lambda ids=ids, lp=lp: ref.build_tree_batch(ids, lp, BUDGET), warmup=1, iters=iters
        )
        cpu_copies = perf.cpu_time(cpu_with_copies, warmup=1, iters=iters)
        for version in versions:
            out = tree.empty_batch(bsz, BUDGET)

            def build(d_ids=d_ids, d_lp=d_lp, out=out, version=version):
                tree.build_tree_batch(d_ids, d_lp, BUDGET, out=out, version=version)

            build()
            exact = _trees_equal(out, want)
            eager = perf.cuda_time(build, warmup=5, iters=100, backend="cupy").as_dict()
            replay = _graph_ms(build, 200)
            kernel = _graph_ms(build, 50, REPEAT)
            rows.append({
                "batch": bsz, "version": version, "kernel": tree.kernel_name(BUDGET, version)[1],
                "depth": DEPTH, "budget": BUDGET, "k_prime": K_PRIME, "bit_exact": exact,
                "cpu_ref": cpu.as_dict(), "cpu_ref_with_copies": cpu_copies.as_dict(),
                "gpu_eager": eager, "gpu_graph_replay": replay, f"gpu_graph_x{REPEAT}": kernel,
                "kernel_us": _us(kernel, REPEAT), "graph_replay_us": _us(replay), "eager_us": _us(eager),
                "cpu_ref_us": cpu.median_ms * 1e3, "cpu_ref_with_copies_us": cpu_copies.median_ms * 1e3,
                "speedup_vs_cpu_kernel": cpu.median_ms / (kernel["median_ms"] / REPEAT),
                "speedup_vs_cpu_graph_replay": cpu.median_ms / replay["median_ms"],
                "speedup_vs_cpu_with_copies_graph_replay": cpu_copies.median_ms / replay["median_ms"],
            })
            print(
                f"[kernels] build v{version} B={bsz}: exact={exact} kernel {rows[-1]['kernel_us']:.2f} us, "
                f"replay {rows[-1]['graph_replay_us']:.2f} us, cpu {rows[-1]['cpu_ref_us']:.0f} us",
                flush=True,
            )
    return rows


def bench_build_tied(vocab: int = 1000, versions: Sequence[int] = tree.VERSIONS) -> list[dict]:
    """Kernel time per version at batch 64 on tied log-probs (exactness checked first)."""
    import cupy

    bsz = max(BATCHES)
    # [64, 15, 64]
    ids, lp = pipeline.random_topk(np.random.default_rng(5), bsz, DEPTH, K_PRIME, vocab, "tied")
    want = ref.build_tree_batch(ids, lp, BUDGET)
    d_ids, d_lp = cupy.asarray(ids), cupy.asarray(lp)
    rows = []
    for version in versions:
        out = tree.empty_batch(bsz, BUDGET)

        def build(out=out, version=version):
            tree.build_tree_batch(d_ids, d_lp, BUDGET, out=out, version=version)

        build()
        exact = _trees_equal(out, want)
        kernel = _graph_ms(build, 50, REPEAT)
        rows.append(
            {
                "batch": bsz,
                "version": version,
                "kernel": tree.kernel_name(BUDGET, version)[1],
                "inputs": "random_topk(seed 5, tied)",
                "bit_exact": exact,
                f"gpu_graph_x{REPEAT}": kernel,
                "kernel_us": _us(kernel, REPEAT),
            }
        )
        print(
            f"[kernels] build v{version} tied B={bsz}: exact={exact} kernel {rows[-1]['kernel_us']:.2f} us",
            flush=True,
        )
    return rows


def bench_rest(inputs: dict, iters: int, bw: float) -> dict:
    """Accept, sampling, compaction, remap and the composed step, per batch."""
    import cupy

    out = {"accept": [], "sample": [], "compact": [], "remap": [], "step": []}
    rng = np.random.default_rng(7)
    for bsz in BATCHES:
        inp = {k: (v[:bsz] if isinstance(v, np.ndarray) and k not in ("target_table", "cache") else v)
               for k, v in inputs.items()}
        inp["cache"] = inputs["cache"][: bsz * (BUDGET + 1) + 1]
        want = pipeline.reference_step(**inp)
        trees = tree.build_tree_batch(
            cupy.asarray(inp["top_token_ids"]), cupy.asarray(inp["top_log_probs"]), BUDGET
        )
        targets = cupy.asarray(want["targets"])
        width = want["paths"].shape[1]
        bufs = (
            cupy.empty((bsz, width), cupy.int64),
            cupy.empty(bsz, cupy.int64),
            cupy.empty(bsz, cupy.int64),
        )

        def acc(trees=trees, targets=targets, bufs=bufs, width=width):
            accept.accept_greedy_batch(trees, targets, max_depth=width - 1, out=bufs)

        acc()
        exact = all(
            (g.get() == w).all()
            for g, w in zip(bufs, (want["paths"], want["lengths"], want["bonus"]), strict=True)
        )
        replay = _graph_ms(acc, 200)
        rk = _graph_ms(acc, 50, REPEAT)
        cpu = perf.cpu_time(
            lambda w=want, m=width - 1: ref.accept_greedy_batch(w["trees"], w["targets"], max_depth=m),
            warmup=1,
            iters=iters,
        )
        out["accept"].append({"batch": bsz, "exact": exact, "mean_path_length": float(want["lengths"].mean()),
                              "graph_replay": replay, f"gpu_graph_x{REPEAT}": rk,
                              "kernel_us": _us(rk, REPEAT), "cpu_ref": cpu.as_dict()})
        out["accept"][-1]["graph_replay_us"] = _us(out["accept"][-1]["graph_replay"])

        paths, lengths, starts = (
            cupy.asarray(want["paths"]),
            cupy.asarray(want["lengths"]),
            cupy.asarray(inp["starts"]),
        )
        moved_rows = int(
            sum(
                int((want["paths"][b, : want["lengths"][b]] != np.arange(want["lengths"][b])).sum())
                for b in range(bsz)
            )
        )
        for layers in (1, LAYERS):
            # [slots, layers*576] bf16 bits
            cache = cupy.zeros((bsz * (BUDGET + 1) + 1, layers * ROW_BYTES // 2), dtype=cupy.uint16)
            cache[...] = cupy.arange(cache.size, dtype=cupy.uint32).reshape(cache.shape).astype(cupy.uint16)

            def comp(cache=cache, paths=paths, lengths=lengths, starts=starts):
                compact.compact_kv_batch(cache, starts, paths, lengths)

            t = _graph_ms(comp, 200)
            nbytes = 2 * moved_rows * layers * ROW_BYTES
            out["compact"].append(
                {
                    "batch": bsz,
                    "layers": layers,
                    "row_bytes": layers * ROW_BYTES,
                    "moved_rows": moved_rows,
                    "bytes": nbytes,
                    "graph_replay": t,
                    "graph_replay_us": _us(t),
                    **perf.floor_ms(nbytes, 0.0, bandwidth_Bps=bw, flop_rate=1.0),
                    "achieved_Bps": nbytes / (t["median_ms"] * 1e-3),
                }
            )
            del cache

        slots = cupy.asarray(
            rng.permutation(bsz * (BUDGET + 1) * 2)[: bsz * (BUDGET + 1)].reshape(bsz, BUDGET + 1)
        )
        r2t = cupy.zeros((bsz, 4096), dtype=cupy.int32)
        rstarts = cupy.full(bsz, 1000, dtype=cupy.int64)
        freed = cupy.empty((bsz, BUDGET + 1), dtype=cupy.bool_)

        def remap(r2t=r2t, rstarts=rstarts, slots=slots, paths=paths, lengths=lengths, freed=freed):
            compact.remap_slots_masked(r2t, rstarts, slots, paths, lengths, freed=freed)

        t = _graph_ms(remap, 200)
        out["remap"].append({"batch": bsz, "graph_replay": t, "graph_replay_us": _us(t)})

        step = pipeline.make_step(cupy.asarray(inp["top_token_ids"]), cupy.asarray(inp["top_log_probs"]),
                                  cupy.asarray(inp["root_tokens"]), cupy.asarray(inp["target_table"]),
                                  cupy.asarray(inp["cache"]), cupy.asarray(inp["starts"]), BUDGET)
        step.capture()
        step.cache[...] = cupy.asarray(inp["cache"])
        step.replay()
        step.stream.synchronize()
        got = pipeline.step_outputs(step)
        step_exact = _trees_equal(step.trees, want["trees"]) and all(
            (got[k] == want[k]).all() for k in ("targets", "paths", "lengths", "bonus", "cache"))
        t = timing.replay_time(step.graph, step.stream, iters=200, warmup=5).as_dict()
        eager = perf.cuda_time(step.run, warmup=3, iters=50, backend="cupy").as_dict()
        out["step"].append({"batch": bsz, "exact": step_exact, "build_kernel": tree.kernel_name(BUDGET)[1],
                            "graph_replay": t, "graph_replay_us": _us(t),
                            "eager": eager, "eager_us": _us(eager),
                            # build, 2 copies + max + take (stand-in verify), accept, compact
                            "kernels_per_step": 7})
        print(f"[kernels] B={bsz}: accept {out['accept'][-1]['graph_replay_us']:.2f} us, step "
              f"{out['step'][-1]['graph_replay_us']:.2f} us (exact={step_exact})", flush=True)

    for bsz in (1, 64):
        probs_h = rng.random((bsz, BUDGET + 1, SAMPLE_VOCAB), dtype=np.float32)  # [B, S, V]
        u_h = rng.random((bsz, BUDGET + 1))
        probs, u = cupy.asarray(probs_h), cupy.asarray(u_h)
        trees = tree.build_tree_batch(cupy.asarray(inputs["top_token_ids"][:bsz]),
                                      cupy.asarray(inputs["top_log_probs"][:bsz]), BUDGET)
        want_s = {o: ref.accept_sample_batch(pipeline.step_outputs_trees(trees), probs_h, u_h, order=o)
                  for o in set(accept.SAMPLE_ORDER.values())}
        for version in accept.SAMPLE_VERSIONS:
            got_s = accept.accept_sample_batch(trees, probs, u, version=version)
            exact = all(
                (g.get() == w).all() for g, w in zip(got_s, want_s[accept.SAMPLE_ORDER[version]], strict=True)
            )
            t = perf.cuda_time(lambda trees=trees, probs=probs, u=u, v=version: accept.accept_sample_batch(
                trees, probs, u, version=v), warmup=2, iters=10, backend="cupy").as_dict()
            out["sample"].append({"batch": bsz, "version": version, "vocab": SAMPLE_VOCAB, "dtype": "float32",
                                  "exact": exact, "eager": t, "eager_us": _us(t),
                                  "note": "bit-exact inverse CDF, float64 sums: " + (
                                      "one block per row" if version == 3 else "one thread per row, 2 V "
                                                                               "sequential adds")})
            print(f"[kernels] sample v{version} B={bsz}: {_us(t):.0f} us exact={exact}", flush=True)
        del probs
    return out


ATTENTION_MODES = ("skip", "quick", "full")  # of the verify-attention part (KDLIB_KERNELS_ATTENTION)


def _attention(*, quick: bool, attention: str | None, budget_s: float | None) -> dict:
    mode = attention or env_choice("KDLIB_KERNELS_ATTENTION", ATTENTION_MODES, "quick" if quick else "full")
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {mode!r}")
    if mode == "skip":
        return {"absent": "skipped (KDLIB_KERNELS_ATTENTION=skip)"}
    try:
        module = importlib.import_module("kdlib.perf.suites._attention")
    except ImportError as e:
        return {"absent": f"kdlib.perf.suites._attention not importable: {e}"}
    if budget_s is None:
        env = os.environ.get("KDLIB_KERNELS_ATTENTION_BUDGET_S")
        budget_s = float(env) if env else None
    return module.sweep(quick=mode == "quick", time_budget_s=budget_s)


def sweep(*, quick: bool = False, attention: str | None = None, versions: Sequence[int] | None = None,
          attention_budget_s: float | None = None) -> dict:
    """The kernels sweep.

    quick: 3 CPU-reference repeats instead of 7 (and the quick verify-attention grid by default).
    attention: 'quick' / 'full' / 'skip', the verify-attention sweep embedded in it; None: env
        `KDLIB_KERNELS_ATTENTION`, else as `quick`.
    versions: the tree-build versions timed (among tree.VERSIONS); None: env `KDLIB_TREE_VERSIONS`
        (comma-separated), else all.
    attention_budget_s: past this many seconds no new verify-attention point starts; None: env
        `KDLIB_KERNELS_ATTENTION_BUDGET_S`, else no limit.
    """
    import cupy

    versions = tree_versions(versions)
    iters = 3 if quick else 7
    ceil = results.ceilings()
    bw, bw_source = ceil.bandwidth_Bps, ceil.source
    clocks_before = timing.clocks()
    ids, lp = synthetic_topk(0, max(BATCHES), DEPTH, K_PRIME)  # [64, 15, 64] drafter-like, vocab 32000
    inputs = pipeline.random_step_inputs(
        np.random.default_rng(3), max(BATCHES), DEPTH, K_PRIME, 32000, BUDGET, row_dim=8, topk=(ids, lp)
    )  # target chains planted into these top-k
    build = bench_build(inputs["top_token_ids"], inputs["top_log_probs"], iters, versions)
    build_tied = bench_build_tied(versions=versions)
    rest = bench_rest(inputs, iters, bw)
    cupy.get_default_memory_pool().free_all_blocks()
    attention = _attention(quick=quick, attention=attention, budget_s=attention_budget_s)
    b64 = [r for r in build if r["batch"] == max(BATCHES)]
    exact64 = [r for r in b64 if r["bit_exact"]] or b64
    head = min(exact64, key=lambda r: r["kernel_us"])  # the fastest bit-exact version at batch 64
    return {
        "parameters": {"batches": list(BATCHES), "depth": DEPTH, "budget": BUDGET, "k_prime": K_PRIME,
                       "tree_versions": list(versions),
                       "repeat_per_graph": REPEAT, "cpu_iters": iters, "quick": quick,
                       "inputs": "kdlib.ref.tree.synthetic_topk(0, 64, 15, 64) with target chains planted by "
                                 "kdlib.cuda.pipeline.random_step_inputs(seed 3, topk=...); every sweep uses "
                                 "them",
                       "l2": "all tree-kernel data L2-resident (launch/latency-bound kernels)"},
        "copy_bandwidth_Bps": bw, "copy_bandwidth_source": bw_source,
        "clocks_before": clocks_before, "clocks_after": timing.clocks(),
        "headline": {"batch": head["batch"], "version": head["version"], "kernel": head["kernel"],
                     "bit_exact": head["bit_exact"], "kernel_us": head["kernel_us"],
                     "graph_replay_us": head["graph_replay_us"], "cpu_ref_us": head["cpu_ref_us"],
                     "speedup_vs_cpu_kernel": head["speedup_vs_cpu_kernel"],
                     "speedup_vs_cpu_graph_replay": head["speedup_vs_cpu_graph_replay"]},
        "tree_build": build, "tree_build_tied": build_tied, **rest, "verify_attention": attention,
    }


run = sweep  # the suite's entry (kdlib.perf.run calls every suite's `run`)
