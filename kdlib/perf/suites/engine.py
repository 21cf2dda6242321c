"""GPU suite `engine`: tokens/s of AR and DDTree in the MVP engine, step time per phase, verify forward cost.

    python3 -m kdlib.perf.run --suite engine [--quick] --out $OUT

Precision: every section but `bf16` runs the model in float32 with TF32 off (cuBLAS and cuDNN),
so that DDTree's tokens equal AR's (`matches_ar`) and the noisy oracle never recomputes its script
(in bfloat16 the verify forward's reduction order differs from the decode step's, the tokens
diverge, and each step's 'draft' phase would then hold an AR recomputation).

Sections of the payload:
  config          the benchmark model's HF config (random weights): MLA with the real head
                  dims (nope 128, rope 64, v 128, kv_lora 512) and a small MoE; see BENCH_CONFIG
  runs            one row per configuration (method ar | ddtree, context = prompt length, budget,
                  block, p_wrong of the noisy-oracle drafter): decode tokens/s, tokens per target
                  forward, mean accepted length, median step ms, per-step phase ms (draft, build,
                  verify, accept, compaction), and whether the DDTree tokens equal AR's
  verify_forward  CUDA-event time of one absorbed verify forward (+ LM head) at contexts x rows
                  (Q = budget + 1), with its bytes, FLOPs and the floor they imply; `attention`
                  "torch" (einsum attention) and "ops" (the CuPy tree-verify kernels, Q <= 65)
  runs_kernel_attention  the DDTree rows again (one oracle rate, budgets <= 64) with the verify
                  attention in the CuPy kernels (Model.attention = "ops"); kept apart from `runs`,
                  which the estimator validates against
  dflash_draft    CUDA-event time of one DFlash-style draft call (a random drafter with 2 layers,
                  block 16) against the context it attends to: the draft-phase cost a real drafter
                  adds, which the noisy oracle (a table look-up) does not have
  trained         the same AR / DDTree comparison on the trained tiny models of `kdlib.zoo`
                  (held-out text per kind) when data/models/ holds them; else a note
  bf16            the one bfloat16 timing: the same model cast to bfloat16, one verify forward
                  (torch attention, first verify context, q = BLOCK + 1), beside its float32 row

Timing: `generate` brackets every phase with a device synchronisation, so phase times add up to
the step time (they include host work: Python and kernel launches, tree build on the GPU through
kdlib.ops). Each configuration runs once untimed (warm-up: kernels compiled, allocator primed).
The engine is host-bound, and a shared host's CPU speed drifts by up to ~2x over seconds: the full
run repeats every `runs` configuration and verify point 3 times, interleaved, keeps the fastest
repeat and lists all of them with a host-speed probe. Pin the process to one core
(`taskset -c 2 python3 -m kdlib.perf.run --suite engine ...`); `parameters.cpu_affinity` records it.
"""

from __future__ import annotations

import os

import numpy as np

from kdlib import perf, zoo
from kdlib.estimator.model import touched_experts
from kdlib.perf import floor_ms, host_probe_ms, results
from kdlib.perf.bench_model import BENCH_CONFIG, BLOCK

BF16_VERIFY = (1024, BLOCK + 1)  # (context, q) of the one bf16 row: the budget-16 verify at a 1k context


def verify_cost(cfg, context: int, q: int, elem_bytes: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one verify forward of q rows over `context` cached rows, LM head included.

    Bytes: every weight read once (routed experts: the E (1 - (1 - k / E)^q) distinct ones q rows of
    uniform top-k touch on average, `kdlib.estimator.model.touched_experts`, as the rank's floors count
    them), the latent cache rows read once per layer. FLOPs: 2 per weight per row for the active
    parameters (kv_b_proj among them: in the absorbed form its two halves are the absorb projections
    W_UK and W_UV, applied once per row), plus the absorbed attention: per layer and head, q x keys x
    (kv_lora + rope) for the scores and q x keys x kv_lora for the values.
    """
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    attn = (
        H * cfg.q_lora_rank + cfg.q_lora_rank * nh * cfg.qk_head_dim
        if cfg.q_lora_rank
        else H * nh * cfg.qk_head_dim
    )
    attn += (
        H * cfg.latent_dim
        + cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        + nh * cfg.v_head_dim * H
    )
    expert = 3 * H * cfg.moe_intermediate_size
    dense = 3 * H * cfg.intermediate_size
    n_dense = cfg.first_k_dense_replace
    n_moe = cfg.num_hidden_layers - n_dense
    touched = touched_experts(q, cfg.n_routed_experts, cfg.num_experts_per_tok)
    shared = cfg.n_shared_experts * expert
    head = cfg.vocab_size * H
    weights = cfg.num_hidden_layers * attn + n_dense * dense + n_moe * (touched * expert + shared
                                                                        + cfg.n_routed_experts * H) + head
    keys = context + q
    kv = cfg.num_hidden_layers * keys * cfg.latent_dim
    active = (
        cfg.num_hidden_layers * attn
        + n_dense * dense
        + n_moe * (cfg.num_experts_per_tok * expert + shared)
        + head
    )
    att_flops = cfg.num_hidden_layers * 2 * q * nh * keys * (cfg.latent_dim + cfg.kv_lora_rank)
    return float((weights + kv) * elem_bytes), float(2 * q * active + att_flops)


def _row(res, *, context, block, p_wrong=None, ar_tokens=None, **extra) -> dict:
    step = res.step_ms()
    decode_s = float(step.sum()) / 1e3
    return {
        "method": res.method, "context": context, "budget": res.budget if res.budget is not None else 0,
        "block": block, "p_wrong": p_wrong, "concurrency": 1, "top_k": res.top_k,
        "new_tokens": len(res.tokens), "steps": res.steps, "target_forwards": res.target_forwards,
        "decode_tokens_per_s": (len(res.tokens) - 1) / decode_s if decode_s > 0 else None,
        "tokens_per_forward": res.tokens_per_forward, "mean_accepted": res.mean_accepted,
        "step_ms": float(np.median(step)), "step_ms_p10": float(np.quantile(step, 0.1)),
        "step_ms_p90": float(np.quantile(step, 0.9)), "prefill_ms": res.prefill_ms,
        "phase_ms": {k: [float(x) for x in v] for k, v in res.phase_ms.items()},
        "phase_median_ms": {k: float(np.median(v)) for k, v in res.phase_ms.items()},
        "matches_ar": None if ar_tokens is None else res.tokens == ar_tokens,
        **extra,
    }


def _generate_sweep(model, contexts, budgets, p_wrongs, max_new, rng, attention: str = "torch",
                    repeats: int = 1) -> list[dict]:
    """One row per configuration (AR, then DDTree per oracle rate x budget) and context.

    The engine is host-bound (Python + eager launches), so its step time follows the host CPU's
    speed, which on a shared machine drifts by up to ~2x over seconds. Each configuration therefore
    runs `repeats` times, the repeats interleaved round-robin over the context's configurations;
    the row keeps the repeat with the lowest median step time (host noise only adds) and lists all
    repeats, each with a host-speed probe (`kdlib.perf.host_probe_ms`) taken just before it."""
    from kdlib.engine.drafter import NoisyOracleDrafter
    from kdlib.engine.generate import generate

    V = model.cfg.vocab_size
    model.attention = attention
    rows = []
    for ctx in contexts:
        prompt = rng.integers(0, V, ctx).tolist()
        generate(model, prompt, 8)  # warm-up
        # the oracle's greedy reference, computed once
        script = generate(model, prompt, max_new + BLOCK).tokens
        configs = [(None, 0)] + [(p, b) for p in p_wrongs for b in budgets]
        for p, b in configs[1:]:  # warm-up per tree shape (kernels compiled, allocator primed)
            generate(
                model,
                prompt,
                8,
                drafter=NoisyOracleDrafter(V, p, block_size=BLOCK, seed=1, reference=script),
                method="ddtree",
                budget=b,
            )
        done: dict = {c: [] for c in configs}
        for _ in range(repeats):
            for p, b in configs:
                probe = host_probe_ms()
                if p is None:
                    r = generate(model, prompt, max_new)
                else:
                    d = NoisyOracleDrafter(V, p, block_size=BLOCK, seed=1, reference=script)
                    r = generate(model, prompt, max_new, drafter=d, method="ddtree", budget=b)
                done[p, b].append((r, probe))
        ar_tokens = done[None, 0][0][0].tokens
        for p, b in configs:
            reps = [
                (
                    _row(
                        r,
                        context=ctx,
                        block=BLOCK if p is not None else 1,
                        p_wrong=p,
                        ar_tokens=None if p is None else ar_tokens,
                        attention=attention,
                    ),
                    probe,
                )
                for r, probe in done[p, b]
            ]
            row = dict(min(reps, key=lambda rp: rp[0]["step_ms"])[0])
            if p is not None:
                row["drafter"] = "noisy_oracle"
                row["matches_ar"] = all(rr["matches_ar"] for rr, _ in reps)
            row["repeats"] = [
                {
                    "step_ms": rr["step_ms"],
                    "decode_tokens_per_s": rr["decode_tokens_per_s"],
                    "mean_accepted": rr["mean_accepted"],
                    "host_probe_ms": probe,
                }
                for rr, probe in reps
            ]
            rows.append(row)
            what = "AR" if p is None else f"p_wrong {p} budget {b}"
            steps = ", ".join(format(rr["step_ms"], ".1f") for rr, _ in reps)
            print(f"[engine] {attention} ctx {ctx} {what}: {row['decode_tokens_per_s']:.1f} tok/s "
                  f"(best of {len(reps)}; step ms {steps}), tau {row['mean_accepted']:.2f}", flush=True)
    return rows


def _verify_sweep(model, contexts, qs, bw, fl, attentions=("torch",), repeats: int = 1) -> list[dict]:
    """CUDA-event time of one verify forward (+ LM head) per (attention, context, q). With
    repeats > 1 the points are timed round-robin `repeats` times and each keeps its lowest median
    (the forward is host-bound; see _generate_sweep); `repeat_medians_ms` lists them all."""
    import torch

    from kdlib.engine.cache import LatentCache

    cfg, dev = model.cfg, model.device
    g = torch.Generator(device=dev).manual_seed(0)
    points = []
    for attention, ctx, q in ((a, c, q) for a in attentions for c in contexts for q in qs):
        if attention == "ops" and q > 65:  # the tree-verify kernels' limit (kdlib/cuda/attention.py MAX_Q)
            continue
        cache = LatentCache(cfg, ctx + q + 1, device=dev, dtype=model.dtype)
        cache.kv.normal_(generator=g)  # [L, S, 576]
        cache.req_to_token[0, :ctx] = torch.arange(ctx, device=dev)
        cache.length = ctx
        tokens = torch.randint(0, cfg.vocab_size, (q,), generator=g, device=dev)
        depth = torch.arange(q, device=dev)  # a chain: the attention cost does not depend on the shape
        vis = torch.ones(q, q, dtype=torch.bool, device=dev).tril()

        def step(tokens=tokens, depth=depth, vis=vis, cache=cache, ctx=ctx):
            h, _ = model.forward_cached(cache, tokens, ctx + depth, vis)
            model.head(h)
            cache.discard()

        points.append((attention, ctx, q, step))
    timings: list[list] = [[] for _ in points]
    for _ in range(repeats):
        for (attention, _ctx, _q, step), ts in zip(points, timings, strict=True):
            model.attention = attention
            ts.append(perf.cuda_time(step, warmup=3, iters=15))
    out = []
    for (attention, ctx, q, _), ts in zip(points, timings, strict=True):
        t = min(ts, key=lambda t: t.median_ms)
        nbytes, flops = verify_cost(cfg, ctx, q, model.dtype.itemsize)
        out.append(
            {
                "attention": attention,
                "dtype": str(model.dtype).removeprefix("torch."),
                "context": ctx,
                "q": q,
                "budget": q - 1,
                **t.as_dict(),
                "repeat_medians_ms": [x.median_ms for x in ts],
                "bytes": nbytes,
                "flops": flops,
                **floor_ms(nbytes, flops, bandwidth_Bps=bw, flop_rate=fl),
            }
        )
        print(
            f"[engine] verify {attention} ctx {ctx} q {q}: {t.median_ms:.2f} ms (best of {len(ts)})",
            flush=True,
        )
    del points
    model.attention = "torch"
    return out


def _dflash_sweep(model, contexts) -> list[dict]:
    import torch

    from kdlib.engine.drafter import DFlashConfig, DFlashDrafter

    cfg = model.cfg
    d = DFlashDrafter(DFlashConfig.for_target(cfg, num_layers=2, block_size=BLOCK, num_heads=16, head_dim=64))
    d = d.to(device=model.device, dtype=model.dtype).eval()
    g = torch.Generator(device=model.device).manual_seed(1)
    out = []
    for ctx in contexts:
        feats = torch.randn(ctx, len(d.target_layer_ids) * cfg.hidden_size, generator=g, device=model.device,
                            dtype=model.dtype)
        d.begin(model, torch.zeros(ctx, dtype=torch.int64), feats, 1)
        t = perf.cuda_time(lambda ctx=ctx: d.draft(1, ctx), warmup=3, iters=20)
        out.append({"context": ctx, "layers": 2, "block": BLOCK, **t.as_dict()})
        print(f"[engine] dflash draft ctx {ctx}: {t.median_ms:.2f} ms", flush=True)
    return out


def _trained(budgets, max_new, device: str = "cuda") -> dict:
    """AR vs DDTree on the trained zoo models, prompts from the held-out text of each kind."""
    from kdlib.engine.generate import generate

    if not zoo.available():
        return {"available": False, "note": "no trained models in data/models/ (kdlib.zoo.available() is "
                                            "False)"}
    try:
        tok = zoo.load_tokenizer()
        target = zoo.load_target(device=device)
        drafter = zoo.load_drafter(target, device=device)
        rows = []
        for kind in zoo.KINDS:
            doc = zoo.held_out(kind)[0]
            prompt = tok.encode(doc)[:256]
            ar = generate(target, prompt, max_new)
            rows.append(_row(ar, context=len(prompt), block=1, kind=kind))
            for b in budgets:
                generate(target, prompt, 8, method="ddtree", drafter=drafter, budget=b)  # warm-up
                r = generate(target, prompt, max_new, method="ddtree", drafter=drafter, budget=b)
                rows.append(
                    _row(r, context=len(prompt), block=drafter.block_size, kind=kind, ar_tokens=ar.tokens)
                )
        return {"available": True, "config": target.cfg.to_hf_dict(), "runs": rows}
    except Exception as e:  # keep the synthetic measurements when the zoo is present but broken
        return {"available": True, "error": f"{type(e).__name__}: {e}"}


def _bf16_verify(model, bw, fl) -> dict:
    """The bf16 row: cast the (float32) model to bfloat16 and time one verify forward."""
    import torch

    model.to(torch.bfloat16)
    (row,) = _verify_sweep(model, [BF16_VERIFY[0]], [BF16_VERIFY[1]], bw, fl)
    return {"dtype": "bfloat16", "note": "the float32 model cast to bfloat16; timing only (no AR comparison)",
            "verify_forward": [row]}


def run(*, quick: bool = False) -> dict:
    """The suite on the CUDA device, float32 with TF32 off (restored after); quick: the reduced
    sweep of `_run` (one context, budget and p_wrong, fewer tokens and repeats)."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("the engine suite needs a CUDA device")
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 matmuls in float32: DDTree == AR exactly
    torch.backends.cudnn.allow_tf32 = False
    try:
        return _run(quick)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _run(quick: bool, device: str = "cuda", config: dict = BENCH_CONFIG) -> dict:
    """The measurements; `device` / `config` other than the defaults only for a smoke run of this code."""
    import torch

    from kdlib.engine.config import ModelConfig
    from kdlib.engine.loading import random_weights_on_device
    from kdlib.engine.model import Model

    cfg = ModelConfig.from_dict(config)
    model = Model(cfg).to(device=device, dtype=torch.float32).eval()
    random_weights_on_device(model, seed=0)
    ceil = results.ceilings()
    bw, fl, ceil_src = ceil.bandwidth_Bps, ceil.flop_rate, ceil.source
    params = {
        "dtype": "float32", "tf32": False, "block": BLOCK, "max_new_tokens": 32 if quick else 96,
        "repeats": 1 if quick else 3, "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "contexts": [128] if quick else [128, 1024, 4096],
        "budgets": [16] if quick else [4, 16, 64],
        "p_wrong": [0.3] if quick else [0.1, 0.3, 0.6],
        "verify_contexts": [1024] if quick else [256, 1024, 4096, 16384],
        "verify_q": [1, 17] if quick else [1, 5, 9, 17, 33, 65, 129],
        "trained_budgets": [16] if quick else [8, 16, 32, 64],
        "ceilings": ceil_src,
        "floor_note": "bytes at the row's dtype; FLOPs against the bf16 matmul ceiling, which float32 "
                      "without TF32 "
                      "does not reach, so a compute-bound float32 floor is optimistic",
        "bf16_verify": {"context": BF16_VERIFY[0], "q": BF16_VERIFY[1]},
    }
    rng = np.random.Generator(np.random.PCG64(0))
    runs = _generate_sweep(
        model,
        params["contexts"],
        params["budgets"],
        params["p_wrong"],
        params["max_new_tokens"],
        rng,
        repeats=params["repeats"],
    )
    verify = _verify_sweep(
        model, params["verify_contexts"], params["verify_q"], bw, fl, repeats=params["repeats"]
    )
    try:  # the kernel-attention arm is new: a failure there must not cost the torch measurements
        runs_k = _generate_sweep(model, params["contexts"], [b for b in params["budgets"] if b <= 64], [0.3],
                                 params["max_new_tokens"], rng, attention="ops")
        verify += _verify_sweep(
            model, params["verify_contexts"], params["verify_q"], bw, fl, attentions=("ops",)
        )
    except Exception as e:
        runs_k = {"error": f"{type(e).__name__}: {e}"}
        model.attention = "torch"
        print(f"[engine] kernel attention arm failed: {runs_k['error']}", flush=True)
    dflash = _dflash_sweep(model, params["verify_contexts"])
    bf16 = _bf16_verify(model, bw, fl)
    del model
    torch.cuda.empty_cache()
    trained = _trained(params["trained_budgets"], params["max_new_tokens"], device)
    return {"parameters": params, "config": cfg.to_hf_dict(), "runs": runs, "runs_kernel_attention": runs_k,
            "verify_forward": verify, "dflash_draft": dflash, "trained": trained, "bf16": bf16}
