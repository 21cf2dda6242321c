"""Re-train the workbook's tiny models from scratch: corpus -> tokenizer -> target -> drafter -> acceptance.

    python tools/train_tiny.py --device cuda --corpus .carry/corpus --out data/models --time-budget-s 240
    python tools/train_tiny.py --smoke --out /tmp/tiny        # seconds on a CPU: micro sizes, a few steps

Writes into --out (the files `kdlib.zoo` reads): tokenizer.json, target.config.json, target.kdtr,
drafter.config.json, drafter.kdtr, held_out.json, training_record.json, and the acceptance
result accept.<gpu>.json (`kdlib.perf.write`; move it to data/results/). The corpus folder is
built with `kdlib.corpus` when it has no manifest (python -m kdlib.corpus --out DIR builds it
alone; build it where you want its Python's stdlib: the corpus differs between versions).

The device run that trained the committed models (its log is data/models/train.h200.log):

    python3 tools/train_tiny.py --device cuda --corpus .carry/corpus --out $OUT --time-budget-s 210

Its training_record.json did not come back (the run's folder held one file more than a device call
returns), so the committed record was rebuilt from the log, with the held-out figures recomputed
on the CPU from the stored weights:

    python tools/train_tiny.py --record-from-log data/models/train.h200.log \
        --accept-json data/results/accept.h200.json --out data/models --corpus .carry/corpus

--time-budget-s is the training time: TARGET_SHARE of it for the target, the rest for the
drafter; tokenising, evaluation and the acceptance run come on top (about a minute on a GPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a bare checkout (the GPU machine)

from kdlib import corpus, perf, zoo  # noqa: E402
from kdlib import training as T  # noqa: E402
from kdlib.perf.suites import accept  # noqa: E402

TARGET_SHARE = 2 / 3  # the target learns the language; the drafter only its continuation, and converges faster
VOCAB = 4096
EXCERPT_CHARS = 2400  # per held-out document in held_out.json: ~700 tokens, room for a prompt + continuation
MAX_EXCERPTS = 24  # per kind
VAL_FRACTION = 0.02  # of each kind's train tokens, for checkpoint selection
ACCEPT_TIME_S = 80.0  # the acceptance run stops taking new prompts after this (the device call has a hard limit)
# Full run (GPU): batch x seq tokens per step; the drafter's anchors per sequence (SpecForge samples up to 512
# per much longer sequence; 48 of 512 positions keeps the block attention mask small).
FULL = {"batch": 64, "seq": 512, "target_lr": 3e-3, "drafter_lr": 2e-3, "anchors": 48, "max_steps": 100_000}
SMOKE = {"batch": 4, "seq": 64, "target_lr": 3e-3, "drafter_lr": 2e-3, "anchors": 4, "max_steps": 3}
SMOKE_TARGET = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
                "num_attention_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
                "v_head_dim": 16, "n_routed_experts": 4}


def specs(time_budget_s: float, smoke: bool, seed: int):
    """The target's and the drafter's TrainSpec."""
    run = SMOKE if smoke else FULL
    tspec = T.TrainSpec(max_steps=run["max_steps"], batch=run["batch"], seq=run["seq"], lr=run["target_lr"],
                        time_budget_s=time_budget_s * TARGET_SHARE, warmup_steps=1 if smoke else 100,
                        log_every=1 if smoke else 100, seed=seed)
    dspec = T.TrainSpec(max_steps=run["max_steps"], batch=run["batch"] // 2, seq=run["seq"], lr=run["drafter_lr"],
                        time_budget_s=time_budget_s * (1 - TARGET_SHARE), warmup_steps=1 if smoke else 50,
                        anchors=run["anchors"], log_every=1 if smoke else 100, seed=seed + 1)
    return tspec, dspec


def excerpt(text: str) -> str:
    """A deterministic excerpt: from the first line start at or after a third of the document."""
    if len(text) <= EXCERPT_CHARS:
        return text
    cut = text.find("\n", len(text) // 3)
    start = cut + 1 if 0 <= cut < len(text) - EXCERPT_CHARS else 0
    return text[start : start + EXCERPT_CHARS]


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--corpus", default=".carry/corpus", help="corpus folder (built when missing)")
    ap.add_argument("--out", default=str(zoo.MODELS), help="output folder")
    ap.add_argument("--time-budget-s", type=float, default=240.0, help="training seconds, target + drafter")
    ap.add_argument("--smoke", action="store_true", help="micro sizes and 3 steps each: checks the pipeline")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record-from-log", metavar="LOG", help="no training: rebuild training_record.json in --out "
                    "from a run's log and its accept JSON (--accept-json), re-evaluating held-out figures on the CPU")
    ap.add_argument("--accept-json", help="the run's accept.<gpu>.json (its provenance) for --record-from-log")
    args = ap.parse_args(argv)
    import torch

    if args.record_from_log:
        rec = record_from_log(Path(args.record_from_log), Path(args.out), Path(args.corpus), Path(args.accept_json))
        _write_json(Path(args.out) / "training_record.json", rec)
        print(json.dumps({k: rec[k]["held_out"] for k in ("target", "drafter")}, indent=1))
        return 0

    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = SMOKE if args.smoke else FULL
    torch.manual_seed(args.seed)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    def log(msg):
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    # corpus
    cdir = Path(args.corpus)
    if not (cdir / "manifest.json").is_file():
        log(f"building the corpus into {cdir}")
        corpus.write(corpus.extract(), cdir)
    docs = corpus.read(cdir)
    manifest = json.loads((cdir / "manifest.json").read_text())
    log(f"corpus: {len(docs)} documents from Python {manifest['python']}")

    # held-out excerpts (what the notebooks and the acceptance suite prompt with)
    held = {k: [excerpt(d.text) for d in docs if d.kind == k and d.split == "held_out"][:MAX_EXCERPTS]
            for k in corpus.KINDS}
    _write_json(out / "held_out.json", held)

    # tokenizer
    tok = T.train_tokenizer((d.text for d in docs if d.split == "train"), VOCAB)
    tok.save(str(out / "tokenizer.json"))
    streams = T.token_streams(tok, docs)
    sizes = {f"{k}.{s}": int(len(v)) for (k, s), v in sorted(streams.items())}
    log(f"tokenizer: {tok.get_vocab_size()} tokens; streams {sizes}")

    # target
    from kdlib.engine.config import ModelConfig
    from kdlib.engine.model import Model

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

    tspec, dspec = specs(args.time_budget_s, args.smoke, args.seed)
    tcurve = T.train_target(target, streams, tspec, log=log, eval_fn=eval_target,
                            eval_every=1 if args.smoke else 250)
    target_eval = {k: T.evaluate_target(target, s, run["seq"], run["batch"], 4 if args.smoke else None)
                   for k, s in held_streams.items()}
    train_eval = {k: T.evaluate_target(target, streams[(k, "train")], run["seq"], run["batch"], eval_windows * 4)
                  for k in corpus.KINDS}
    log(f"target held-out perplexity: { {k: round(v['ppl'], 2) for k, v in target_eval.items()} }")
    _write_json(out / "target.config.json", tcfg)
    T.save_weights(target, out / "target.kdtr", {"generator": "tools/train_tiny.py", "dtype": "float16"})

    # drafter
    n_layers = target.cfg.num_hidden_layers
    dcfg = T.DraftConfig(hidden_size=target.cfg.hidden_size, target_layer_ids=tuple(range(n_layers)),
                         mask_token_id=tok.token_to_id(T.SPECIAL_TOKENS[1]),
                         **({"num_layers": 1, "num_heads": 2, "head_dim": 32, "intermediate_size": 128}
                            if args.smoke else {}))
    net = T.DraftNet(dcfg, target.cfg).to(args.device)
    n_draft = sum(p.numel() for p in net.parameters())
    log(f"drafter: {n_draft / 1e6:.2f} M parameters, taps {dcfg.target_layer_ids}")

    def eval_drafter():
        r = {k: round(T.evaluate_drafter(net, target, s, run["seq"], run["batch"], 8 if args.smoke else 64)["loss"], 4)
             for k, s in val_streams.items()}
        return {**r, "score": round(sum(r.values()) / len(r), 4)}

    dcurve = T.train_drafter(net, target, streams, dspec, log=log, eval_fn=eval_drafter,
                             eval_every=1 if args.smoke else 250)
    drafter_eval = {k: T.evaluate_drafter(net, target, s, run["seq"], run["batch"], 8 if args.smoke else 128)
                    for k, s in held_streams.items()}
    log(f"drafter held-out slot-1 accuracy: { {k: v['slot_acc'][0] for k, v in drafter_eval.items()} }")
    _write_json(out / "drafter.config.json", dcfg.to_dict())
    T.save_weights(net, out / "drafter.kdtr", {"generator": "tools/train_tiny.py", "dtype": "float16"})

    # record
    prov = perf.provenance()
    files = ("tokenizer.json", "target.config.json", "target.kdtr", "drafter.config.json", "drafter.kdtr",
             "held_out.json")
    record = {
        "command": prov["command"], "commit": prov["commit"], "date": prov["date"], "device": prov["gpu"],
        "torch": prov["torch"], "python": prov["python"], "smoke": args.smoke,
        "corpus": {"python": manifest["python"], "files": manifest["files"]},
        "tokenizer": {"vocab_size": tok.get_vocab_size(), "kind": "byte-level BPE", "stream_tokens": sizes},
        "target": {"parameters": n_target, "spec": _spec(tspec), "curve": tcurve,
                   "held_out": target_eval, "train_sample": train_eval},
        "drafter": {"parameters": n_draft, "spec": _spec(dspec), "curve": dcurve, "held_out": drafter_eval},
        "models_sha256": {f: hashlib.sha256((out / f).read_bytes()).hexdigest() for f in files},
        "validation": {"fraction_of_train": VAL_FRACTION, "tokens": {k: int(len(v)) for k, v in val_streams.items()}},
        "train_seconds": round(time.perf_counter() - t_start, 1),
    }
    _write_json(out / "training_record.json", record)
    log("models and training record written")

    # acceptance on held-out text, in full float32 (TF32 matmuls would flip near-tied argmaxes between
    # the AR and the tree-verify paths)
    torch.backends.cuda.matmul.allow_tf32 = False
    n, new, budgets = (1, 24, (8,)) if args.smoke else (accept.FULL_PROMPTS, accept.NEW_TOKENS, accept.BUDGETS)
    payload = accept.measure(args.device, n, new, budgets, prompt_tokens=32 if args.smoke else accept.PROMPT_TOKENS,
                             folder=out, log=log, time_limit_s=ACCEPT_TIME_S)
    path = perf.write("accept", payload, out_dir=out, command=prov["command"])
    log(f"wrote {path}; total {time.perf_counter() - t_start:.1f}s")
    return 0


def parse_log(text: str) -> dict:
    """Loss curves and evaluations of both phases from a train_tiny log: {"target": curve, "drafter": curve}."""
    import ast
    import re

    step_re = re.compile(r"step\s+(\d+)\s+loss ([\d.]+)\s+lr ([\d.e+-]+)\s+([\d.]+)s")
    out, phase = {}, None
    for line in text.splitlines():
        body = line.split("] ", 1)[-1]
        if body.startswith("target: "):
            phase = "target"
        elif body.startswith("drafter: "):
            phase = "drafter"
        if phase is None:
            continue
        c = out.setdefault(phase, {"step": [], "loss": [], "lr": [], "elapsed_s": [], "eval": []})
        m = step_re.match(body)
        if m:
            for key, v in zip(("step", "loss", "lr", "elapsed_s"), m.groups(), strict=True):
                c[key].append(int(v) if key == "step" else float(v))
        elif body.strip().startswith("eval {"):
            c["eval"].append(ast.literal_eval(body.strip()[5:]))
        elif body.startswith("kept the state of step"):
            c["kept_step"] = int(body.split()[5])
    for c in out.values():
        c["steps"] = c["eval"][-1]["step"] if c["eval"] else (c["step"][-1] if c["step"] else 0)
    return out


def record_from_log(log_path: Path, out: Path, corpus_dir: Path, provenance_from: Path) -> dict:
    """Rebuild training_record.json for models already in `out` from the run's log (curves) and a CPU
    re-evaluation of the held-out figures (float32, from the stored float16 weights); every such field
    is marked. The provenance (command, commit, device, date) is read from the run's accept JSON."""
    import torch

    docs = corpus.read(corpus_dir)
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    prov = json.loads(provenance_from.read_text())["provenance"]
    tok = zoo.load_tokenizer(out)
    held = [d for d in docs if d.split == "held_out"]
    streams = T.token_streams(tok._tok, held)
    target = zoo.load_target(folder=out)
    drafter = zoo.load_drafter(target, folder=out)
    net = T.DraftNet(T.DraftConfig.from_dict(json.loads((out / "drafter.config.json").read_text())), target.cfg)
    net.load_weights(zoo._state_dict(out / "drafter.kdtr", torch.float32, "cpu"))
    run = FULL
    with torch.no_grad():
        target_eval = {k: T.evaluate_target(target, streams[(k, "held_out")], run["seq"], run["batch"] // 4)
                       for k in corpus.KINDS}
        drafter_eval = {k: T.evaluate_drafter(net, target, streams[(k, "held_out")], run["seq"],
                                              run["batch"] // 4, 128) for k in corpus.KINDS}
    curves = parse_log(log_path.read_text())
    cmd = prov["command"].split()
    budget = float(cmd[cmd.index("--time-budget-s") + 1]) if "--time-budget-s" in cmd else 240.0
    tspec, dspec = specs(budget, False, 0)
    files = ("tokenizer.json", "target.config.json", "target.kdtr", "drafter.config.json", "drafter.kdtr",
             "held_out.json")
    return {
        "command": prov["command"], "commit": prov["commit"], "date": prov["date"], "device": prov["gpu"],
        "torch": prov["torch"], "python": prov["python"], "smoke": False,
        "reconstructed": (
            f"the run's own training_record.json did not come back from the device; this record was rebuilt "
            f"from its log ({log_path.name}: curves and evaluations as printed) and a re-evaluation on the CPU "
            f"(float32, torch {torch.__version__}) of the held-out figures from the stored float16 weights; "
            f"'log_held_out_ppl' is what the run itself printed"),
        "corpus": {"python": manifest["python"], "files": manifest["files"]},
        "tokenizer": {"vocab_size": tok.vocab_size, "kind": "byte-level BPE",
                      "held_out_tokens": {k: int(len(streams[(k, "held_out")])) for k in corpus.KINDS}},
        "target": {"parameters": sum(p.numel() for p in target.parameters()), "spec": _spec(tspec),
                   "curve": curves.get("target"),
                   "held_out": target_eval, "log_held_out_ppl": _logged(log_path, "target held-out perplexity: ")},
        "drafter": {"parameters": sum(p.numel() for p in drafter.parameters()), "spec": _spec(dspec),
                    "curve": curves.get("drafter"),
                    "held_out": drafter_eval,
                    "log_held_out_slot1_acc": _logged(log_path, "drafter held-out slot-1 accuracy: ")},
        "validation": {"fraction_of_train": VAL_FRACTION},
        "models_sha256": {f: hashlib.sha256((out / f).read_bytes()).hexdigest() for f in files},
    }


def _logged(log_path: Path, prefix: str):
    import ast

    for line in log_path.read_text().splitlines():
        body = line.split("] ", 1)[-1]
        if body.startswith(prefix):
            return ast.literal_eval(body[len(prefix):])
    return None


def _spec(spec) -> dict:
    from dataclasses import asdict

    d = asdict(spec)
    d["time_budget_s"] = None if d["time_budget_s"] == float("inf") else d["time_budget_s"]
    return d


if __name__ == "__main__":
    sys.exit(main())
