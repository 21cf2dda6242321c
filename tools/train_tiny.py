"""Re-train the workbook's tiny models from scratch: corpus -> tokenizer -> target -> drafter -> acceptance.

    python tools/train_tiny.py --device cuda --corpus .carry/corpus --out $OUT --target-s 90 --drafter-s 110
    python tools/train_tiny.py --smoke --out /tmp/tiny   # minutes on a CPU: micro sizes, 3 steps each

Writes, in this order, each file atomically (the files `kdlib.zoo` reads, then the run's own):
held_out.json, tokenizer.json, target.config.json, target.kdtr, drafter.kdtr into --out's
`.train_tiny.staging/` folder; once all five are written, the old training_record.json goes, the
five move into --out, and training_record.json follows (before the acceptance run, so a run stopped
there still has it): a run that fails leaves an earlier set's files in --out whole (its train.log
is this run's, with the failure), and a set interrupted while it moves has no record, which `kdlib.zoo`
refuses. Then the acceptance result accept.<gpu>.json
(`kdlib.perf.write`; it belongs in data/results/), and train.log (everything printed, as it is
printed). Eight files: what one device call brings back.

--target-s and --drafter-s are the two training phases' wall-clock budgets (each phase's cosine LR
schedule runs over its own budget); tokenising (~5 s on the GPU machine), evaluations (~10 s) and
the acceptance run (--accept-s, 80 by default, plus the prompt in flight) come on top. In the run
that trained the models committed before these flags (--time-budget-s 210: 140 s target, 70 s
drafter; data/models/train.h200.log) the target's validation score was best at step 1000 of 3156
(46 s; prose overfits after that) while the drafter's still fell at its end: hence the defaults.

The corpus folder is built with `kdlib.corpus` when it has no manifest (python -m kdlib.corpus --out
DIR builds it alone; build it where you want its Python's stdlib: the corpus differs between
versions). The run asks nothing, prints every line with a flush, and ends with a line naming the
folder and its files; it exits 2 on bad arguments, 1 when a phase fails (what was written stays in
the staging folder).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a bare checkout (the GPU machine)

from kdlib import corpus, perf, zoo  # noqa: E402
from kdlib import training as T  # noqa: E402
from kdlib.cli import folder, make_folder, positive_float  # noqa: E402
from kdlib.files import atomic_write_text  # noqa: E402
from kdlib.perf.suites import accept  # noqa: E402

VOCAB = 4096  # special tokens included
EXCERPT_CHARS = zoo.EXCERPT_CHARS  # per held-out document: ~700 tokens, room for a prompt + continuation
MAX_EXCERPTS = 24  # per kind
VAL_FRACTION = 0.02  # of each kind's train tokens, for checkpoint selection
MODEL_FILES = ("tokenizer.json", "target.config.json", "target.kdtr", "drafter.kdtr", "held_out.json")
LOG_NAME = "train.log"
STAGING = ".train_tiny.staging"  # --out's folder the model files are written into before they move
# Full run (GPU): batch x seq tokens per step; the drafter's anchors per sequence (SpecForge samples up to 512
# per much longer sequence; 48 of 512 positions keeps the block attention mask small).
FULL = {"batch": 64, "seq": 512, "target_lr": 3e-3, "drafter_lr": 2e-3, "anchors": 48, "max_steps": 100_000}
SMOKE = {"batch": 4, "seq": 64, "target_lr": 3e-3, "drafter_lr": 2e-3, "anchors": 4, "max_steps": 3}
SMOKE_TARGET = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
}
SMOKE_DRAFTER = {"num_layers": 1, "num_heads": 2, "head_dim": 32, "intermediate_size": 128}


def specs(target_s: float, drafter_s: float, smoke: bool, seed: int):
    """The target's and the drafter's TrainSpec."""
    run = SMOKE if smoke else FULL
    tspec = T.TrainSpec(max_steps=run["max_steps"], batch=run["batch"], seq=run["seq"], lr=run["target_lr"],
                        time_budget_s=target_s, warmup_steps=1 if smoke else 100,
                        log_every=1 if smoke else 100, seed=seed)
    dspec = T.TrainSpec(
        max_steps=run["max_steps"],
        batch=run["batch"] // 2,
        seq=run["seq"],
        lr=run["drafter_lr"],
        time_budget_s=drafter_s,
        warmup_steps=1 if smoke else 50,
        anchors=run["anchors"],
        log_every=1 if smoke else 100,
        seed=seed + 1,
    )
    return tspec, dspec


def excerpt(text: str) -> str:
    """A deterministic excerpt: from the first line start at or after a third of the document."""
    if len(text) <= EXCERPT_CHARS:
        return text
    cut = text.find("\n", len(text) // 3)
    start = cut + 1 if 0 <= cut < len(text) - EXCERPT_CHARS else 0
    return text[start : start + EXCERPT_CHARS]


def _write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1) + "\n")


def _spec(spec) -> dict:
    d = asdict(spec)
    d["time_budget_s"] = None if d["time_budget_s"] == float("inf") else d["time_budget_s"]
    return d


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--corpus", default=Path(".carry/corpus"), type=folder,
                    help="corpus folder (built, parents too, when missing)")
    ap.add_argument("--out", required=True, type=folder,
                    help=f"output folder (required; the workbook's own models are {zoo.MODELS}: writing "
                         "there replaces them, so it takes --replace-shipped)")
    ap.add_argument("--replace-shipped", action="store_true",
                    help="allow --out to be the shipped models' folder")
    ap.add_argument("--target-s", type=positive_float, default=90.0, help="training seconds of the target")
    ap.add_argument("--drafter-s", type=positive_float, default=110.0, help="training seconds of the drafter")
    ap.add_argument("--accept-s", type=positive_float, default=80.0,
                    help="the acceptance run takes no new prompt after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="micro sizes and 3 steps each: checks the pipeline")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.seed < 0:
        ap.error(f"--seed must be >= 0, got {args.seed}")
    if args.out.resolve() == zoo.MODELS.resolve() and not args.replace_shipped:
        ap.error(f"--out {args.out} holds the workbook's trained models; pass --replace-shipped to overwrite "
                 "them")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.error("--device cuda but torch sees no CUDA device")
    make_folder(ap, args.out)  # last: a bad argument writes nothing
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out
    t_start = time.perf_counter()
    with open(out / LOG_NAME, "w", encoding="utf-8", buffering=1) as log_file:

        def log(msg):
            line = f"[{time.perf_counter() - t_start:7.1f}s] {msg}"
            print(line, flush=True)
            log_file.write(line + "\n")

        try:
            train(args, out, log, t_start)
            rc = 0
        except Exception:  # the phase's traceback goes to the log; what was written stays
            for line in traceback.format_exc().rstrip().splitlines():
                log(line)
            rc = 1
        files = sorted(p.name for p in out.iterdir() if p.is_file() and not p.name.endswith(".tmp"))
        log(f"{'done' if rc == 0 else 'FAILED'} after {time.perf_counter() - t_start:.1f}s; "
            f"{len(files)} files in {out.resolve()}: {' '.join(files)}")
    return rc


def train(args, out: Path, log, t_start: float) -> None:
    import torch

    from kdlib.engine.config import ModelConfig
    from kdlib.engine.drafter import DFlashDrafter
    from kdlib.engine.model import Model

    run = SMOKE if args.smoke else FULL
    torch.manual_seed(args.seed)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    log(f"train_tiny: device {args.device}, target {args.target_s:g} s, drafter {args.drafter_s:g} s, "
        f"acceptance {args.accept_s:g} s, out {out.resolve()}")

    # corpus
    cdir = args.corpus
    if not (cdir / "manifest.json").is_file():
        log(f"building the corpus into {cdir}")
        corpus.write(corpus.extract(), cdir)
    docs = corpus.read(cdir)
    manifest = json.loads((cdir / "manifest.json").read_text())
    log(f"corpus: {len(docs)} documents from Python {manifest['python']}")
    empty = [f"{k}.{s}" for k in corpus.KINDS for s in ("train", "held_out")
             if not any(d.kind == k and d.split == s for d in docs)]
    if empty:
        raise ValueError(f"corpus {cdir} has no documents for {', '.join(empty)}")
    final, out = out, out / STAGING  # the model files go to the staging folder first
    shutil.rmtree(out, ignore_errors=True)  # an earlier failed run's
    out.mkdir()

    # held-out excerpts (what the notebooks and the acceptance suite prompt with)
    held = {k: [excerpt(d.text) for d in docs if d.kind == k and d.split == "held_out"][:MAX_EXCERPTS]
            for k in corpus.KINDS}
    _write_json(out / "held_out.json", held)

    # tokenizer
    tok = T.train_tokenizer((d.text for d in docs if d.split == "train"), VOCAB)
    atomic_write_text(out / "tokenizer.json", tok.to_str(pretty=True))
    streams = T.token_streams(tok, docs)
    sizes = {f"{k}.{s}": int(len(v)) for (k, s), v in sorted(streams.items())}
    log(f"tokenizer: {tok.get_vocab_size()} tokens ({zoo.EOS_TOKEN} {T.EOS_ID}, {zoo.MASK_TOKEN} "
        f"{T.MASK_ID}); "
        f"streams {sizes}")

    # target
    tcfg = T.target_config(tok.get_vocab_size(), **(SMOKE_TARGET if args.smoke else {}))
    target = Model(ModelConfig.from_dict(tcfg))
    T.init_target(target, args.seed)
    target.to(args.device)
    n_target = sum(p.numel() for p in target.parameters())
    log(f"target: {n_target / 1e6:.2f} M parameters")
    held_streams = {k: streams[(k, "held_out")] for k in corpus.KINDS}
    # validation: the tail of each kind's train stream, cut off from training; it picks the kept checkpoint
    # so that the held-out text is never used for a decision
    val_streams = {}
    for k in corpus.KINDS:
        s = streams[(k, "train")]
        cut = len(s) - max(int(len(s) * VAL_FRACTION), run["seq"] * 2 + 2)
        streams[(k, "train")], val_streams[k] = s[:cut], s[cut:]
    eval_windows = 4 if args.smoke else 32

    def eval_target():
        r = {k: round(T.evaluate_target(target, s, run["seq"], run["batch"], eval_windows)["nll"], 4)
             for k, s in val_streams.items()}
        return {**r, "score": round(sum(r.values()) / len(r), 4)}

    tspec, dspec = specs(args.target_s, args.drafter_s, args.smoke, args.seed)
    tcurve = T.train_target(target, streams, tspec, log=log, eval_fn=eval_target,
                            eval_every=1 if args.smoke else 250)
    target_eval = {k: T.evaluate_target(target, s, run["seq"], run["batch"], 4 if args.smoke else None)
                   for k, s in held_streams.items()}
    train_eval = {
        k: T.evaluate_target(target, streams[(k, "train")], run["seq"], run["batch"], eval_windows * 4)
        for k in corpus.KINDS
    }
    eos_eval = {k: T.evaluate_eos(target, s, run["seq"]) for k, s in held_streams.items()}
    log(f"target held-out perplexity: { {k: round(v['ppl'], 2) for k, v in target_eval.items()} }")
    log("target held-out end of text: "
        f"{ {k: (v['p_eos_at_end'], v['false_eos_top1']) for k, v in eos_eval.items()} }")
    _write_json(out / "target.config.json", tcfg)
    T.save_weights(target, out / "target.kdtr", {"generator": "tools/train_tiny.py", "dtype": "float16"})

    # drafter: the engine's own class
    dcfg = T.drafter_config(target.cfg, T.MASK_ID, **(SMOKE_DRAFTER if args.smoke else {}))
    drafter = DFlashDrafter(dcfg)
    T.init_drafter(drafter, args.seed + 1)
    drafter.to(args.device)
    n_draft = sum(p.numel() for p in drafter.parameters())
    log(f"drafter: {n_draft / 1e6:.2f} M parameters, taps {dcfg.target_layer_ids}, block {dcfg.block_size}")

    def eval_drafter():
        r = {k: round(T.evaluate_drafter(drafter, target, s, run["seq"], run["batch"],
                                         8 if args.smoke else 64)["loss"], 4)
             for k, s in val_streams.items()}
        return {**r, "score": round(sum(r.values()) / len(r), 4)}

    dcurve = T.train_drafter(drafter, target, streams, dspec, log=log, eval_fn=eval_drafter,
                             eval_every=1 if args.smoke else 250)
    drafter_eval = {
        k: T.evaluate_drafter(drafter, target, s, run["seq"], run["batch"], 8 if args.smoke else 128)
        for k, s in held_streams.items()
    }
    log(f"drafter held-out slot-1 accuracy: { {k: v['slot_acc'][0] for k, v in drafter_eval.items()} }")
    T.save_drafter(drafter, out / "drafter.kdtr", {"generator": "tools/train_tiny.py", "dtype": "float16"})

    # record (before the acceptance run, which reads its models_sha256)
    prov = perf.provenance()
    record = {
        "command": prov["command"],
        "commit": prov["commit"],
        "date": prov["date"],
        "device": prov["gpu"],
        "torch": prov["torch"],
        "python": prov["python"],
        "smoke": args.smoke,
        "corpus": {"python": manifest["python"], "files": manifest["files"]},
        "tokenizer": {
            "vocab_size": tok.get_vocab_size(),
            "kind": "byte-level BPE",
            "stream_tokens": sizes,
            "special_tokens": {t: tok.token_to_id(t) for t in T.SPECIAL_TOKENS},
        },
        "target": {
            "parameters": n_target,
            "spec": _spec(tspec),
            "curve": tcurve,
            "held_out": target_eval,
            "train_sample": train_eval,
            "end_of_text": eos_eval,
        },
        "drafter": {
            "parameters": n_draft,
            "config": {**asdict(dcfg), "target_layer_ids": list(dcfg.target_layer_ids)},
            "spec": _spec(dspec),
            "curve": dcurve,
            "held_out": drafter_eval,
        },
        "models_sha256": {f: hashlib.sha256((out / f).read_bytes()).hexdigest() for f in MODEL_FILES},
        "validation": {
            "fraction_of_train": VAL_FRACTION,
            "tokens": {k: int(len(v)) for k, v in val_streams.items()},
        },
        "train_seconds": round(time.perf_counter() - t_start, 1),
    }
    (final / "training_record.json").unlink(missing_ok=True)  # no record: zoo refuses a set half moved
    for f in MODEL_FILES:
        os.replace(out / f, final / f)
    out.rmdir()
    out = final
    _write_json(out / "training_record.json", record)
    log("models and training record written")

    # acceptance on held-out text, in full float32 (TF32 matmuls would flip near-tied argmaxes between
    # the AR and the tree-verify paths)
    torch.backends.cuda.matmul.allow_tf32 = False
    n, new, budgets = (
        (1, 24, (8,)) if args.smoke else (accept.FULL_PROMPTS, accept.NEW_TOKENS, accept.BUDGETS)
    )
    payload = accept.measure(
        args.device,
        n,
        new,
        budgets,
        prompt_tokens=32 if args.smoke else accept.PROMPT_TOKENS,
        folder=out,
        log=log,
        time_limit_s=args.accept_s,
    )
    path = perf.write("accept", payload, out_dir=out, command=prov["command"])
    log(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
