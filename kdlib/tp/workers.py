"""What `tools/tp_run.py`, the `tp` perf suite and `tests/test_tp.py` run on every rank, and the
single-process reference they compare against.

    spec = check_spec(config="tiny-a", moe_mode="ep")
    spawn(check_worker, 2, (spec, "/tmp/tp.pt"))           # rank 0 saves its outputs (torch.save)
    got, ref = torch.load("/tmp/tp.pt"), reference(spec)     # compare with compare(got, ref)

    spawn(bench_worker, 4, (bench_spec(), "/tmp/b.json"), backend="nccl")   # GPU: step time, all-reduce share

A check runs, through `kdlib.engine.generate` on TPModel ranks: dense logits of a prompt, the
vocab-parallel top-K of synthetic logits, AR greedy, DDTree with each drafter (debug mode: trees and
accepted paths asserted equal across ranks), and AR and DDTree (first drafter) sampled at
temperature > 0 with a fixed seed. The reference runs the same on one process.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from kdlib import zoo
from kdlib.engine import DFlashConfig, DFlashDrafter, Model, ModelConfig, NoisyOracleDrafter
from kdlib.engine.generate import generate
from kdlib.engine.loading import random_weights_on_device
from kdlib.perf import cpu_time, cuda_time
from kdlib.perf.bench_model import BENCH_CONFIG
from kdlib.perf.timing import graph_time
from kdlib.tp.engine import DEFAULT_TIMEOUT_S, Comm, TPModel, assert_replicated, spawn, vocab_parallel_topk

# fp32 tolerance for TP vs single-process logits: the all-reduce sums partial products in a
# different order; a few ulps of |logit| ~ 10 after 2-3 layers, with margin.
LOGITS_ATOL, LOGITS_RTOL = 1e-4, 1e-4


def check_spec(**kw) -> dict:
    """Parameters of one check (defaults: tiny-a, expert parallel, 24 tokens, budget 8, block 5,
    sampled runs at temperature 0.8)."""
    spec = {"config": "tiny-a", "seed": 0, "moe_mode": "ep", "prompt_len": 12, "max_new": 24, "budget": 8,
            "block": 5, "p_wrong": 0.3, "topk_rows": 6, "topk_k": 7, "drafters": ("oracle", "dflash"),
            "temperature": 0.8, "zoo": False, "device": "cpu", "attention": "torch"}
    spec = _override(spec, kw, "check")
    names = spec["drafters"]
    if isinstance(names, str) or not set(names) <= {"oracle", "dflash"}:  # a name matching none checked none
        raise ValueError(f"drafters must be a sequence of 'oracle' and 'dflash', got {names!r}")
    return spec


def _override(spec: dict, kw: dict, what: str) -> dict:
    """spec updated with kw; ValueError naming the keys spec does not have."""
    unknown = set(kw) - set(spec)
    if unknown:
        raise ValueError(f"unknown {what} parameters {sorted(unknown)}")
    return {**spec, **kw}


def _models(spec: dict, device):
    """(full Model, {drafter name: factory(target)}, prompt list) for a spec, identical on every process."""
    if spec["zoo"]:
        model = zoo.load_target(device=str(device))
        text = zoo.held_out("code")[0]
        prompt = zoo.load_tokenizer().encode(text)[: spec["prompt_len"]]
        drafters = {"zoo": lambda target: zoo.load_drafter(model, device=str(device))}
    else:
        cfg = ModelConfig.load(spec["config"])  # a shipped name or a path, as tools/tp_run.py checked it
        model = Model.random(cfg, seed=spec["seed"], device=device)
        prompt = np.random.default_rng(spec["seed"]).integers(0, cfg.vocab_size, spec["prompt_len"]).tolist()
        V, B = cfg.vocab_size, spec["block"]
        dcfg = DFlashConfig.for_target(cfg, block_size=B)
        drafters = {
            "oracle": lambda target: NoisyOracleDrafter(
                V, spec["p_wrong"], block_size=B, seed=spec["seed"] + 1
            ),
            "dflash": lambda target: DFlashDrafter(dcfg, seed=spec["seed"] + 2).to(device),
        }
        drafters = {k: v for k, v in drafters.items() if k in spec["drafters"]}
    if spec["attention"] != "torch":
        model.attention = spec["attention"]  # the engine's decode/verify form; TPModel copies it
    return model, drafters, prompt


def synthetic_logits(spec: dict, vocab_size: int) -> torch.Tensor:
    """[rows, V] float32 draft logits for the top-K check: N(0, 3^2) rows, the last one rounded to
    multiples of 0.5 so that it holds many ties, the one before zero but for id 5 (a tie that crosses
    every shard's k-th place: the lower ids must win it)."""
    g = torch.Generator().manual_seed(spec["seed"] + 7)
    x = 3.0 * torch.randn(spec["topk_rows"], vocab_size, generator=g)  # 3: spread like real draft logits
    x[-1] = (x[-1] * 2).round() / 2
    x[-2] = 0.0
    x[-2, 5 % vocab_size] = 1.0
    return x


def dense_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The single-device rule: log_softmax over the full row, best k, ties to the lower id."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    order = torch.sort(logp, dim=-1, descending=True, stable=True).indices[:, :k]
    return order, logp.gather(-1, order)


def check_worker(rank: int, world: int, device, spec: dict, out_path: str) -> None:
    """Run the TP checks; rank 0 writes its outputs to out_path (atomic torch.save)."""
    comm = Comm()
    model, drafters, prompt = _models(spec, device)
    tp = TPModel.from_model(model, comm, spec["moe_mode"])
    out = {"world": world, "logits": tp.logits(prompt).cpu()}
    v0, v1 = tp.vocab_range
    syn = synthetic_logits(spec, model.cfg.vocab_size)
    ids, lps = vocab_parallel_topk(syn[:, v0:v1].to(device), v0, spec["topk_k"], comm)
    out["topk_ids"], out["topk_logp"] = ids.cpu(), lps.cpu()
    out["ar"] = generate(tp, prompt, spec["max_new"]).tokens
    for name, make in drafters.items():
        r = generate(
            tp, prompt, spec["max_new"], method="ddtree", drafter=make(tp), budget=spec["budget"], debug=True
        )
        out[f"ddtree:{name}"], out[f"accepted:{name}"] = r.tokens, r.accepted
    out.update(_sampled(tp, drafters, prompt, spec, debug=True))
    for key in [k for k in out if k.startswith(("ar", "ddtree", "topk", "sampled"))] + ["logits"]:
        assert_replicated(comm, **{key.replace(":", "_"): torch.as_tensor(out[key])})
    if rank == 0:
        tmp = f"{out_path}.tmp"
        torch.save(out, tmp)
        os.replace(tmp, out_path)


def _sampled(model, drafters: dict, prompt, spec: dict, debug: bool = False) -> dict:
    """{"sampled:ar": tokens, "sampled:ddtree:<first drafter>": tokens} at spec["temperature"],
    seed spec["seed"]."""
    kw = {"temperature": spec["temperature"], "seed": spec["seed"]}
    out = {"sampled:ar": generate(model, prompt, spec["max_new"], **kw).tokens}
    for name, make in list(drafters.items())[:1]:
        out[f"sampled:ddtree:{name}"] = generate(
            model,
            prompt,
            spec["max_new"],
            method="ddtree",
            drafter=make(model),
            budget=spec["budget"],
            debug=debug,
            **kw,
        ).tokens
    return out


def reference(spec: dict) -> dict:
    """The same outputs from one process (DDTree references are AR greedy; sampled ones the same seed's)."""
    model, drafters, prompt = _models(spec, torch.device(spec["device"]))
    ids, lps = dense_topk(synthetic_logits(spec, model.cfg.vocab_size), spec["topk_k"])
    out = {"logits": model.logits(prompt).cpu(), "topk_ids": ids, "topk_logp": lps,
           "ar": generate(model, prompt, spec["max_new"]).tokens}
    for name, make in drafters.items():
        r = generate(
            model, prompt, spec["max_new"], method="ddtree", drafter=make(model), budget=spec["budget"]
        )
        out[f"ddtree:{name}"], out[f"accepted:{name}"] = r.tokens, r.accepted
    out.update(_sampled(model, drafters, prompt, spec))
    return out


def compare(got: dict, ref: dict) -> list[str]:
    """Verdict lines; a line starting with 'FAIL' names a mismatch."""
    lines = []
    d = float((got["logits"] - ref["logits"]).abs().max())
    ok = torch.allclose(got["logits"], ref["logits"], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    lines.append(f"{'ok  ' if ok else 'FAIL'} logits: max |TP - single| = {d:.2e}")
    ok = torch.equal(got["topk_ids"], ref["topk_ids"])
    lines.append(f"{'ok  ' if ok else 'FAIL'} vocab-parallel top-k ids == dense top-k ids")
    d = float((got["topk_logp"] - ref["topk_logp"]).abs().max())
    ok = d <= 1e-5  # log-partition merged from shards: a few fp32 ulps of |log Z| ~ 10
    lines.append(f"{'ok  ' if ok else 'FAIL'} vocab-parallel top-k log-probs: max diff {d:.2e}")
    ok = got["ar"] == ref["ar"]
    lines.append(f"{'ok  ' if ok else 'FAIL'} TP AR == single-process AR ({len(ref['ar'])} tokens)")
    for key in [k for k in got if k.startswith("ddtree:")]:
        ok = got[key] == ref["ar"]
        name = key.split(":")[1]
        lines.append(f"{'ok  ' if ok else 'FAIL'} TP DDTree ({name}) == single-process AR; mean accepted "
                     f"{np.mean(got['accepted:' + name]):.2f} (single-process DDTree "
                     f"{np.mean(ref['accepted:' + name]):.2f})")
    # Same seed, same uniforms: the draws could part only where the fp32 rounding of the logits (~1e-6)
    # moves a CDF boundary across a uniform, a chance of that order per token.
    for key in [k for k in got if k.startswith("sampled:")]:
        ok = got[key] == ref.get(key)
        lines.append(f"{'ok  ' if ok else 'FAIL'} TP {key.split(':', 1)[1]} sampled at T > 0 == "
                     "single-process, "
                     "same seed")
    return lines


# ----------------------------------------------------------------------------- benchmark (GPU)
def bench_spec(**kw) -> dict:
    """Parameters of the step-time benchmark. config None = the engine suite's BENCH_CONFIG (MLA
    with the real head dims, 16 heads, 32 experts); a tiny config name for a CPU smoke run.
    dtype float32 (TF32 off on NCCL ranks), as the engine suite: in bfloat16 the DDTree tokens part
    from AR, and the noisy oracle then re-derives its script inside the draft phase (~15 target
    forwards a step), which would be timed as drafting. The all-reduce sweep runs in
    `allreduce_dtype` (bfloat16, the serving activations) over [rows, allreduce_hidden] messages;
    7168 is Kimi-K2 / DeepSeek-V3's hidden size, the message the estimator models, and the rows
    reach 64 MiB so that the bandwidth term of the fit is not lost under the latency."""
    spec = {
        "config": None,
        "seed": 0,
        "moe_mode": "ep",
        "context": 512,
        "max_new": 64,
        "budget": 32,
        "block": 16,
        "p_wrong": 0.2,
        "dtype": "float32",
        "allreduce_dtype": "bfloat16",
        "allreduce_rows": (1, 8, 33, 64, 128, 256, 1024, 4096),
        "allreduce_hidden": 7168,
        "iters": 50,
    }
    return _override(spec, kw, "bench")


def _bench_model(spec: dict, device):
    dtype = getattr(torch, spec["dtype"])
    if spec["config"] is None:
        cfg = ModelConfig.from_dict(BENCH_CONFIG)
        model = Model(cfg).to(device=device, dtype=dtype).eval()
        random_weights_on_device(model, spec["seed"])  # seeded on the device: the same weights on every GPU
        return model
    cfg = ModelConfig.load(spec["config"])
    return Model.random(cfg, seed=spec["seed"], device=device, dtype=dtype)


def _time(fn, device, iters):
    return cuda_time(fn, iters=iters) if device.type == "cuda" else cpu_time(fn, iters=iters)


def bench_worker(rank: int, world: int, device, spec: dict, out_path: str) -> None:
    """AR and DDTree (noisy oracle) on the TP engine: step time, then the same run with timed
    collectives for the all-reduce share; an all-reduce sweep over message sizes; the single-device
    engine as the reference (tokens compared, and timed on the world-1 run). Rank 0 writes JSON."""
    import torch.distributed as dist

    full = _bench_model(spec, device)
    cfg = full.cfg
    comm = Comm()
    tp = TPModel.from_model(full, comm, spec["moe_mode"])
    prompt = np.random.default_rng(spec["seed"]).integers(0, cfg.vocab_size, spec["context"]).tolist()
    single_ar = generate(full, prompt, spec["max_new"]).tokens
    probe = prompt[:64]
    ref_logits = full.logits(probe)
    logit_diff = float((tp.logits(probe) - ref_logits).abs().max())
    logit_scale = float(ref_logits.abs().max())

    def kw(method):
        if method == "ar":
            return {}
        return {
            "method": "ddtree",
            "budget": spec["budget"],
            "drafter": NoisyOracleDrafter(cfg.vocab_size, spec["p_wrong"], block_size=spec["block"], seed=1),
        }

    rows, tp_ar = [], None
    for method in ("ar", "ddtree"):
        generate(tp, prompt, 8, **kw(method))  # warm-up
        comm.timed = False
        r = generate(tp, prompt, spec["max_new"], **kw(method))
        comm.timed = True
        rt = generate(tp, prompt, spec["max_new"], **kw(method))
        comm.timed = False
        st, stt = r.step_ms(), rt.step_ms()
        stats = comm.stats()
        tp_ar = r.tokens if method == "ar" else tp_ar
        rows.append({
            "world": world, "engine": "tp", "method": method, "moe_mode": spec["moe_mode"], "steps": r.steps,
            "step_ms": float(np.median(st)), "step_ms_p10": float(np.quantile(st, 0.1)),
            "step_ms_p90": float(np.quantile(st, 0.9)),
            "decode_tokens_per_s": (len(r.tokens) - 1) / (float(st.sum()) / 1e3),
            "mean_accepted": r.mean_accepted,
            "phase_median_ms": {k: float(np.median(v)) for k, v in r.phase_ms.items()},
            "allreduce_calls_per_step": stats["all_reduce"]["calls"] / rt.steps,
            "allreduce_bytes_per_step": stats["all_reduce"]["bytes"] / rt.steps,
            "allreduce_ms_per_step": stats["all_reduce"]["ms"] / rt.steps,
            "allgather_ms_per_step": stats["all_gather"]["ms"] / rt.steps,
            "timed_step_ms": float(np.median(stt)),
            "allreduce_share": stats["all_reduce"]["ms"] / float(stt.sum()),
            "allgather_share": stats["all_gather"]["ms"] / float(stt.sum()),
            "matches_single_ar": r.tokens == single_ar,
            "matches_tp_ar": r.tokens == tp_ar,  # DDTree == AR on the same (TP) numerics
        })
        if world == 1:  # the single-device engine itself, same prompt and drafter
            generate(full, prompt, 8, **kw(method))
            e = generate(full, prompt, spec["max_new"], **kw(method))
            se = e.step_ms()
            rows.append({"world": 1, "engine": "single", "method": method, "steps": e.steps,
                         "step_ms": float(np.median(se)), "step_ms_p10": float(np.quantile(se, 0.1)),
                         "step_ms_p90": float(np.quantile(se, 0.9)),
                         "decode_tokens_per_s": (len(e.tokens) - 1) / (float(se.sum()) / 1e3),
                         "mean_accepted": e.mean_accepted, "matches_single_ar": e.tokens == single_ar})
    sweep = []
    if world > 1:
        for m in spec["allreduce_rows"]:
            x = torch.randn(m, spec["allreduce_hidden"], device=device).to(
                getattr(torch, spec["allreduce_dtype"])
            )  # [m, 7168]
            t = _time(lambda x=x: dist.all_reduce(x), device, spec["iters"])
            sweep.append(_allreduce_row(world, m, x, t.median_ms, t.p10_ms, t.p90_ms))
    if rank == 0:
        doc = {"runs": rows, "allreduce": sweep, "logits_max_abs_diff_vs_single": logit_diff,
               "logits_max_abs_single": logit_scale}
        tmp = f"{out_path}.tmp"
        Path(tmp).write_text(json.dumps(doc))
        os.replace(tmp, out_path)


def _allreduce_row(world: int, rows: int, x, median_ms: float, p10_ms: float, p90_ms: float) -> dict:
    nbytes = x.numel() * x.element_size()
    return {
        "world": world,
        "rows": rows,
        "bytes": nbytes,
        "median_us": median_ms * 1e3,
        "p10_us": p10_ms * 1e3,
        "p90_us": p90_ms * 1e3,
        "bus_bandwidth_Bps": 2 * (world - 1) / world * nbytes / (median_ms / 1e3),
    }


GRAPH_ALLREDUCES = 20  # collectives captured back to back per graph: per-collective time = replay / 20


def graph_allreduce_worker(rank: int, world: int, device, spec: dict, out_path: str) -> None:
    """The all-reduce sweep with the collectives captured in a CUDA graph (as a serving step runs
    them: no per-call launch from Python); per collective = graph replay time / GRAPH_ALLREDUCES.
    Spawned on its own by `bench`, so that a capture failure cannot cost the other measurements.
    Rank 0 writes JSON."""
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1, device=device))  # communicator up before any capture
    out = []
    for m in spec["allreduce_rows"]:
        x = torch.randn(m, spec["allreduce_hidden"], device=device).to(
            getattr(torch, spec["allreduce_dtype"])
        )  # [m, 7168]
        t = graph_time(lambda x=x: dist.all_reduce(x), iters=max(5, spec["iters"] // 5), warmup=3,
                       repeats=GRAPH_ALLREDUCES, warm=3, backend="torch")
        out.append(_allreduce_row(world, m, x, t.median_ms / GRAPH_ALLREDUCES, t.p10_ms / GRAPH_ALLREDUCES,
                                  t.p90_ms / GRAPH_ALLREDUCES))
    if rank == 0:
        tmp = f"{out_path}.tmp"
        Path(tmp).write_text(json.dumps(out))
        os.replace(tmp, out_path)


def fit_allreduce(sweep: list[dict]) -> dict:
    """Per world size: latency (intercept) and bus bandwidth (from the slope) of a least-squares line
    time = latency + ring_bytes / bandwidth, ring_bytes = 2 (W - 1) / W x message bytes (the
    estimator's all-reduce model, kdlib/estimator/model.py)."""
    out = {}
    for w in sorted({r["world"] for r in sweep}):
        pts = [r for r in sweep if r["world"] == w]
        ring = np.array([2 * (w - 1) / w * r["bytes"] for r in pts])
        t = np.array([r["median_us"] * 1e-6 for r in pts])
        slope, lat = np.polyfit(ring, t, 1) if len(pts) > 1 else (float("nan"), float(t[0]))
        out[str(w)] = {"latency_s": float(lat), "bus_bandwidth_Bps": float(1 / slope) if slope > 0 else None}
    return out


def bench(
    world_sizes, spec: dict, backend: str = "nccl", timeout_s: float = 300, graph_timeout_s: float = 60
) -> dict:
    """Spawn bench_worker once per world size (and, on NCCL, graph_allreduce_worker); the payload of
    `tp.<gpu>.json`."""
    import tempfile

    from torch.multiprocessing.spawn import ProcessException

    runs, sweep, graph_sweep, diffs, scale = [], [], [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for w in world_sizes:
            path = os.path.join(tmp, f"w{w}.json")
            t0 = time.perf_counter()
            spawn(bench_worker, w, (spec, path), backend=backend, timeout_s=timeout_s)
            doc = json.loads(Path(path).read_text())
            runs += doc["runs"]
            sweep += doc["allreduce"]
            if w > 1 and backend == "nccl":
                gpath = os.path.join(tmp, f"g{w}.json")
                try:
                    spawn(
                        graph_allreduce_worker, w, (spec, gpath), backend=backend, timeout_s=graph_timeout_s
                    )
                    graph_sweep += json.loads(Path(gpath).read_text())
                except (ProcessException, TimeoutError) as e:  # recorded: the eager figures above still stand
                    graph_sweep.append({"world": w, "error": f"{type(e).__name__}: {e}"})
                    print(f"[tp] world {w}: all-reduce graph capture failed: {e}", flush=True)
            diffs[str(w)] = doc["logits_max_abs_diff_vs_single"]
            scale[str(w)] = doc["logits_max_abs_single"]
            print(
                f"[tp] world {w}: {time.perf_counter() - t0:.0f} s; "
                + "; ".join(f"{r['engine']} {r['method']} {r['step_ms']:.2f} ms/step" for r in doc["runs"]),
                flush=True,
            )
    return {"parameters": {**spec, "world_sizes": list(world_sizes), "backend": backend},
            "runs": runs, "allreduce": sweep, "allreduce_fit": fit_allreduce(sweep) if sweep else {},
            "allreduce_graph": graph_sweep,
            "allreduce_graph_fit": fit_allreduce([r for r in graph_sweep if "error" not in r]),
            "logits_max_abs_diff_vs_single": diffs, "logits_max_abs_single": scale}


def run_check(world: int, spec: dict, backend: str = "gloo",
              timeout_s: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Spawn check_worker over `world` ranks and compare rank 0's outputs with the single-process
    reference (a collective waits timeout_s at most; `spawn` stops the run timeout_s + 60 s in)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.pt")
        spawn(check_worker, world, (spec, path), backend=backend, timeout_s=timeout_s)
        got = torch.load(path)
    return compare(got, reference(spec))


def gpu_payload(world_sizes, *, quick: bool = False) -> dict:
    """The `tp` record: NCCL checks (tiny-a, fp32, EP and sliced MoE) and the benchmark per world size."""
    checks = {}
    multi = [w for w in world_sizes if w > 1]
    for w in multi:
        for mode in ("ep", "tp") if w == multi[-1] else ("ep",):  # sliced experts at the largest only
            lines = run_check(w, check_spec(moe_mode=mode, device="cuda"), backend="nccl")
            checks[f"w{w}-{mode}"] = lines
            print(f"[tp] check world {w} moe {mode}:\n  " + "\n  ".join(lines), flush=True)
    spec = bench_spec(**({"max_new": 32, "iters": 20, "allreduce_rows": (1, 64, 256)} if quick else {}))
    payload = bench(world_sizes, spec, backend="nccl")
    payload["checks"] = checks
    payload["checks_pass"] = all(not x.startswith("FAIL") for v in checks.values() for x in v)
    payload["nccl_env"] = {
        k: os.environ.get(k)
        for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
    }
    return payload
