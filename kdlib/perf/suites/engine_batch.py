"""GPU suite `engine_batch`: the batched graph engine (kdlib.engine.batch) against the eager loop and
Hugging Face transformers' `generate`, bf16, measured in one run.

    python3 -m kdlib.perf.run --suite engine_batch [--quick] --out $OUT

Sections of the payload:
  trained    the trained tiny target + drafter of `kdlib.zoo`, held-out prompts of each text kind
             (256 tokens), AR and DDTree budgets 8/16/32/64, C = 1, 4, 16, 64 streams: wall step
             (host time of `BatchEngine.step`, a graph replay and its one wait; the median of the
             timed steps), device time of a step (CUDA kernels summed by torch.profiler over the three
             steps just before the timed ones, same batch and bucket: the mean), busy = device / wall,
             tokens/s per stream and in aggregate (the timed steps), mean accepted length (over every
             step of each request, the profiled and untimed ones included), DDTree / (accepted x AR)
             ratio, and the bf16 token agreement of DDTree with AR in the same engine
  bench      the 8-layer engine-suite model (engine.BENCH_CONFIG, random weights) with a random
             DFlash drafter (block 16): AR, DDTree 16 and DDTree 32 at contexts 256 and 4096
             (quick: AR and DDTree 8 at 256)
  baselines  the same first rows through the eager single-stream loop (`kdlib.engine.generate`) and
             transformers' DeepseekV3ForCausalLM.generate (eager, bf16, the same weights; one timed call
             of max_new tokens after a 4-token warm-up, its 256-token prefill included: tokens/s is a
             single sample and counts the prefill against it)
  goals      the issue's four goals read off the rows (busy >= 85 % at C = 1, AR step <= 0.5 ms and
             DDTree budget 32 <= 1.0 ms at C = 1, DDTree >= 0.8 x accepted x AR per text kind,
             aggregate at C = 16 >= 10 x C = 1), each with the measured value

Rows are timed after a warm-up step per (streams, table width, sampling) bucket: graph capture is
outside the timed steps; prefill (eager, per request) is outside too.
"""

from __future__ import annotations

import time

import numpy as np

from kdlib import zoo
from kdlib.perf.bench_model import BENCH_CONFIG, BLOCK
from kdlib.perf.profile import device_profile

METHODS = (("ar", None), ("ddtree", 8), ("ddtree", 16), ("ddtree", 32), ("ddtree", 64))
STREAMS = (1, 4, 16, 64)
TIMED_STEPS = 24
NEW_TRAINED = 256  # tokens per trained-model request: room for the steps after warm-up and profiling
PROMPT = 256


def _engine(model, method, budget, drafter, streams, max_context, compile_=False, overlap=False):
    from kdlib.engine.batch import BatchEngine

    return BatchEngine(model, max_streams=streams, method=method,
                       drafter=drafter if method == "ddtree" else None, budget=budget,
                       max_context=max_context, keep_results=True, compile=compile_, overlap=overlap)


def run_row(model, method, budget, drafter, prompts, max_new, label: dict, compile_: bool = False,
            overlap: bool = False) -> dict:
    """C = len(prompts) streams; wall and device time of TIMED_STEPS steps after the buckets are captured
    (compile_: the engine's torch.compile arm; the first steps' wall, compile included, is recorded)."""

    C = len(prompts)
    context = max(len(p) for p in prompts) + max_new + 8
    eng = _engine(model, method, budget, drafter, C, context, compile_, overlap)
    rids = [eng.add_request(p, max_new) for p in prompts]
    t_first = time.perf_counter()
    eng.step()  # admissions + first step (captures the first bucket)
    eng.step()
    first_s = time.perf_counter() - t_first
    prof = device_profile(eng.step, 3) if eng.num_running == C else {"device_ms": float("nan")}
    eng.replay_ms = []
    wall, span, toks = [], [], 0
    for _ in range(TIMED_STEPS):
        if eng.num_running < C:
            break
        before, graphs = sum(len(eng.result(r).tokens) for r in rids), len(eng._graphs)
        # no synchronisation here: a step ends in its own wait, and with overlap a call's wall is the
        # steady state only if the device still runs the step launched by the call before
        t0 = time.perf_counter()
        eng.step()
        dt = (time.perf_counter() - t0) * 1e3
        if len(eng._graphs) == graphs:  # a step that captured a new bucket is not timed
            wall.append(dt)
            if eng.replay_ms:
                span.append(eng.replay_ms[-1])
            toks += sum(len(eng.result(r).tokens) for r in rids) - before
    steps = len(wall)
    dev = prof["device_ms"]
    recs = [eng.result(r) for r in rids]
    acc = [np.mean(r.accepted[1:]) for r in recs if len(r.accepted) > 1]
    first_tokens = list(recs[0].tokens)
    for r in rids:
        eng.abort(r)
    step_ms = float(np.median(wall)) if wall else float("nan")
    agg = toks / (sum(wall) / 1e3) if wall else float("nan")
    return {**label, "method": method, "budget": budget or 0, "streams": C, "step_ms": step_ms,
            "step_ms_p10": float(np.quantile(wall, 0.1)) if wall else None,
            "step_ms_p90": float(np.quantile(wall, 0.9)) if wall else None, "timed_steps": steps,
            "device_ms": dev, "busy": dev / step_ms if wall else None,
            "replay_span_ms": float(np.median(span)) if span else None, "tokens_per_s": agg,
            "tokens_per_s_per_stream": agg / C, "mean_accepted": float(np.mean(acc)) if acc else 1.0,
            "kernels_per_step": prof.get("kernels_per_step"), "compiled": compile_, "overlap": overlap,
            "first_steps_s": first_s,
            "top_kernels": prof.get("top_kernels") if C == 1 else None, "tokens": [first_tokens]}


def _hf_state_dict(model, hf_keys: set) -> dict:
    """The engine's weights under transformers' names: per-expert weights fused into
    experts.gate_up_proj [E, 2I, H] (gate rows, then up) and experts.down_proj [E, H, I] where
    the installed transformers fuses them (5.x), as they are otherwise."""
    sd = model.state_dict()
    for i, layer in enumerate(model.model.layers):
        fused = f"model.layers.{i}.mlp.experts.gate_up_proj"
        if fused in hf_keys and hasattr(layer.mlp, "experts"):
            w13, w2 = layer.mlp.stacked()
            sd = {k: v for k, v in sd.items() if not k.startswith(f"model.layers.{i}.mlp.experts.")}
            sd[fused], sd[f"model.layers.{i}.mlp.experts.down_proj"] = w13, w2
    return sd


def _hf_generate(model, prompt, max_new) -> dict:
    """tokens/s of transformers' DeepseekV3ForCausalLM.generate (greedy, eager attention) on the same
    weights."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hf_cfg = DeepseekV3Config(**{k: v for k, v in model.cfg.to_hf_dict().items() if k != "architectures"})
    hf_cfg._attn_implementation = "eager"
    hf = DeepseekV3ForCausalLM(hf_cfg).to(device=model.device, dtype=model.dtype).eval()
    missing = hf.load_state_dict(_hf_state_dict(model, set(hf.state_dict())), strict=False)
    ids = torch.tensor([prompt], device=model.device)
    kw = dict(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=0)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    hf.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
    sync()
    t0 = time.perf_counter()
    out = hf.generate(ids, **kw)
    sync()
    dt = time.perf_counter() - t0
    return {"tokens_per_s": max_new / dt, "missing_keys": sorted(missing.missing_keys),
            "unexpected_keys": sorted(missing.unexpected_keys), "tokens": out[0, len(prompt):].tolist()}


def _eager_loop(model, prompt, max_new, method, drafter, budget) -> dict:
    from kdlib.engine.generate import generate

    generate(model, prompt, 8, method=method, drafter=drafter, budget=budget)
    res = generate(model, prompt, max_new, method=method, drafter=drafter, budget=budget)
    step = res.step_ms()
    return {
        "method": method,
        "budget": budget or 0,
        "step_ms": float(np.median(step)),
        "tokens_per_s": (len(res.tokens) - 1) / (float(step.sum()) / 1e3),
        "mean_accepted": res.mean_accepted,
    }


def _ratios(rows: list[dict]) -> None:
    """DDTree tokens/s over (mean accepted x AR tokens/s) of the same kind, streams and context."""
    ar = {(r.get("kind"), r.get("context"), r["streams"]): r for r in rows if r["method"] == "ar"}
    for r in rows:
        a = ar.get((r.get("kind"), r.get("context"), r["streams"]))
        if r["method"] == "ddtree" and a:
            r["ratio_vs_accepted_ar"] = r["tokens_per_s"] / (r["mean_accepted"] * a["tokens_per_s"])
            ta, tb = a["tokens"][0], r["tokens"][0]
            same = next(
                (i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb))
            )
            r["agreement_with_ar"] = {"first_difference": same, "of": min(len(ta), len(tb))}


def _goals(trained: list[dict]) -> dict:
    def pick(**kw):
        return [r for r in trained if all(r.get(k) == v for k, v in kw.items())]

    c1 = pick(streams=1)
    ar1 = pick(streams=1, method="ar")
    dd32 = pick(streams=1, method="ddtree", budget=32)
    ratios = {r["kind"]: r.get("ratio_vs_accepted_ar") for r in dd32}
    scale = {}
    for m, b in METHODS:
        one = pick(streams=1, method=m, budget=b or 0)
        sixteen = pick(streams=16, method=m, budget=b or 0)
        if one and sixteen:
            scale[f"{m}{b or ''}"] = float(np.mean([r["tokens_per_s"] for r in sixteen])
                                           / np.mean([r["tokens_per_s"] for r in one]))
    return {
        "busy_at_c1_min": min(
            (r["busy"] for r in c1 if r["busy"] is not None and np.isfinite(r["busy"])), default=None
        ),
        "ar_step_ms_c1": float(np.median([r["step_ms"] for r in ar1])) if ar1 else None,
        "ddtree32_step_ms_c1": float(np.median([r["step_ms"] for r in dd32])) if dd32 else None,
        "ddtree32_ratio_by_kind": ratios,
        "aggregate_c16_over_c1": scale,
        "targets": {
            "busy": 0.85,
            "ar_step_ms": 0.5,
            "ddtree32_step_ms": 1.0,
            "ratio": 0.8,
            "c16_over_c1": 10.0,
        },
    }


def _partial(out: str | None, payload) -> None:
    """The rows so far, written after each row (a cut run still leaves its measurements)."""
    import json
    from pathlib import Path

    if out:
        Path(out, "engine_batch.partial.json").write_text(json.dumps(payload, default=float))


def run(*, quick: bool = False, out: str | None = None) -> dict:
    """Every row of the sweep (module docstring).

    quick: streams (1, 4) and the first two methods only, for a smoke run.
    out: folder for `engine_batch.partial.json`, rewritten after each row (None: not written).
    """
    import torch

    from kdlib.engine.config import ModelConfig
    from kdlib.engine.drafter import DFlashConfig, DFlashDrafter
    from kdlib.engine.model import Model

    streams = (1, 4) if quick else STREAMS
    methods = METHODS[:2] if quick else METHODS
    torch.manual_seed(0)
    payload = {
        "parameters": {
            "streams": list(streams),
            "methods": [list(m) for m in methods],
            "prompt": PROMPT,
            "timed_steps": TIMED_STEPS,
            "dtype": "bfloat16",
        }
    }
    rng = np.random.default_rng(0)

    # trained tiny model, held-out prompts per kind
    trained = []
    if zoo.available():
        tok = zoo.load_tokenizer()
        target = zoo.load_target(device="cuda", dtype=torch.bfloat16)
        drafter = zoo.load_drafter(target)
        kinds = zoo.KINDS[:1] if quick else zoo.KINDS
        for kind in kinds:
            texts = [t for t in zoo.held_out(kind) if len(tok.encode(t)) >= PROMPT + 1]
            enc = [tok.encode(t)[:PROMPT] for t in texts]
            for m, b in methods:
                for c in streams:
                    prompts = [enc[i % len(enc)] for i in range(c)]
                    trained.append(
                        run_row(
                            target,
                            m,
                            b,
                            drafter,
                            prompts,
                            NEW_TRAINED,
                            {"model": "trained", "kind": kind, "context": PROMPT},
                        )
                    )
                    print(f"[engine_batch] trained {kind} {m}{b or ''} C={c}: {trained[-1]['step_ms']:.3f} "
                          "ms, "
                          f"busy {trained[-1]['busy']:.2f}, {trained[-1]['tokens_per_s']:.0f} tok/s, "
                          f"accepted {trained[-1]['mean_accepted']:.2f}", flush=True)
                    _partial(out, {**payload, "trained": trained})
        _ratios(trained)
        compiled = []
        if not quick:  # the torch.compile arm: C = 1 and 16, code prompts, AR and DDTree budget 32
            enc = [tok.encode(t)[:PROMPT] for t in zoo.held_out("code") if len(tok.encode(t)) > PROMPT]
            t_arm = time.perf_counter()
            for m, b in (METHODS[0], METHODS[3]):
                for c in (1, 16):
                    if time.perf_counter() - t_arm > 240:
                        break
                    row = run_row(target, m, b, drafter, [enc[i % len(enc)] for i in range(c)], 96,
                                   {"model": "trained", "kind": "code", "context": PROMPT}, compile_=True)
                    compiled.append(row)
                    print(
                        f"[engine_batch] compiled {m}{b or ''} C={c}: {row['step_ms']:.3f} ms, busy "
                        f"{row['busy']:.2f}, "
                        f"kernels {row.get('kernels_per_step')}, first steps {row['first_steps_s']:.1f} s",
                        flush=True,
                    )
                    _partial(out, {**payload, "trained": trained, "compiled": compiled})
        payload["compiled"] = compiled
        p0 = tok.encode(zoo.held_out("code")[0])[:PROMPT]
        payload["baselines"] = {
            "eager_loop": [
                _eager_loop(target, p0, 64, m, drafter if m == "ddtree" else None, b) for m, b in methods
            ],
            "transformers_generate": _hf_generate(target, p0, 64),
        }
    payload["trained"] = trained

    # 8-layer engine-suite model, random weights and drafter, contexts
    cfg = ModelConfig.from_dict(BENCH_CONFIG)
    bench = Model.random(cfg, seed=0, device="cuda", dtype=torch.bfloat16)
    bd = DFlashDrafter(DFlashConfig.for_target(cfg, block_size=BLOCK), seed=1).to(
        device="cuda", dtype=torch.bfloat16
    )
    rows = []
    for ctx in ((256,) if quick else (256, 4096)):
        for m, b in (methods if quick else (METHODS[0], METHODS[2], METHODS[3])):
            for c in streams:
                prompts = [np.random.default_rng([ctx, c, i]).integers(0, cfg.vocab_size, ctx).tolist()
                           for i in range(c)]  # the same prompts for every method at (context, C)
                rows.append(run_row(bench, m, b, bd, prompts, 48, {"model": "bench8", "context": ctx}))
                print(f"[engine_batch] bench ctx={ctx} {m}{b or ''} C={c}: {rows[-1]['step_ms']:.3f} ms, "
                      f"busy {rows[-1]['busy']:.2f}, {rows[-1]['tokens_per_s']:.0f} tok/s", flush=True)
                _partial(out, {**payload, "trained": trained, "bench": rows})
    _ratios(rows)
    payload["bench"] = rows
    payload["bench_baselines"] = {
        "transformers_generate": _hf_generate(bench, rng.integers(0, cfg.vocab_size, 256).tolist(), 32)
    }
    payload["goals"] = _goals(trained)
    print(f"[engine_batch] goals {payload['goals']}", flush=True)
    return payload
