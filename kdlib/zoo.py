"""The workbook's trained tiny models: tokenizer, MLA + MoE target, DFlash-style drafter, held-out text.

    from kdlib import zoo
    if zoo.available():
        tok = zoo.load_tokenizer()                     # .encode(str) -> list[int], .decode(ids), .vocab_size
        target = zoo.load_target()                     # kdlib.engine.Model, float32, eval mode
        drafter = zoo.load_drafter(target)             # engine DFlashDrafter: generate(..., method="ddtree", drafter=drafter)
        texts = zoo.held_out("code")                   # held-out excerpts of one kind (KINDS)

Files (all under data/models/, written by `tools/train_tiny.py`, which re-trains everything):

    tokenizer.json          byte-level BPE (Hugging Face `tokenizers`)
    target.config.json      HF DeepseekV3 config.json of the target
    target.kdtr             the target's weights, HF DeepseekV3 parameter names, float16
    drafter.config.json     the drafter's config (block size, target layer taps, sizes, mask token)
    drafter.kdtr            the drafter's own weights (the embedding and LM head are the target's)
    held_out.json           {kind: [excerpt, ...]}: up to 24 excerpts (<= 2400 characters) of held-out
                            documents per kind, the prompts of the acceptance figures
    training_record.json    command, commit, device, loss curves, held-out perplexity per kind
    train.h200.log          the log of the device run that trained the committed models

Weights are stored in float16 (half the bytes of float32; every trained value lies well inside
float16's range) and loaded as float32 unless a dtype is given. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from kdlib import DATA

MODELS = DATA / "models"
KINDS = ("code", "prose", "templated")
FILES = ("tokenizer.json", "target.config.json", "target.kdtr", "drafter.config.json", "drafter.kdtr",
         "held_out.json", "training_record.json")


def available(folder: str | Path | None = None) -> bool:
    """True when every file of the trained models is present."""
    root = Path(folder) if folder is not None else MODELS
    return all((root / f).is_file() for f in FILES)


def _require(folder, *names: str) -> Path:
    root = Path(folder) if folder is not None else MODELS
    missing = [f for f in names if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{root}: trained models missing ({', '.join(missing)}); run `python tools/train_tiny.py` to train them"
        )
    return root


class Tokenizer:
    """A thin wrapper over a `tokenizers.Tokenizer`: plain lists in and out, no special tokens added."""

    def __init__(self, inner):
        self._tok = inner

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def load_tokenizer(folder: str | Path | None = None) -> Tokenizer:
    from tokenizers import Tokenizer as _Tok

    return Tokenizer(_Tok.from_file(str(_require(folder, "tokenizer.json") / "tokenizer.json")))


def _state_dict(path, dtype, device) -> dict:
    import numpy as np
    import torch

    from kdlib import kdtr

    return {k: torch.from_numpy(np.ascontiguousarray(v)).to(device=device, dtype=dtype)
            for k, v in kdtr.load(path, mmap=False).items()}


def load_target(device: str = "cpu", dtype=None, folder: str | Path | None = None):
    """The trained target as a `kdlib.engine.Model` (eval mode, float32 by default)."""
    import torch

    from kdlib.engine.config import ModelConfig
    from kdlib.engine.model import Model

    root = _require(folder, "target.config.json", "target.kdtr")
    dtype = dtype or torch.float32
    cfg = ModelConfig.from_json(root / "target.config.json")
    model = Model(cfg)
    model.load_weights(_state_dict(root / "target.kdtr", torch.float32, "cpu"))
    return model.to(device=device, dtype=dtype).eval()


def load_drafter(target, device: str | None = None, folder: str | Path | None = None):
    """The trained drafter as the engine's `DFlashDrafter`, on the target's device and dtype by default.

    drafter.kdtr holds the weights under the training module's names (`kdlib.training.DraftNet`);
    `kdlib.training.to_engine` renames them for the engine's class.
    """
    import numpy as np

    from kdlib import kdtr
    from kdlib.training import DraftConfig, to_engine

    root = _require(folder, "drafter.config.json", "drafter.kdtr")
    cfg = DraftConfig.from_dict(json.loads((root / "drafter.config.json").read_text()))
    if cfg.hidden_size != target.cfg.hidden_size:
        raise ValueError(f"drafter hidden {cfg.hidden_size} != target hidden {target.cfg.hidden_size}")
    weights = {k: np.asarray(v, dtype=np.float32) for k, v in kdtr.load(root / "drafter.kdtr", mmap=False).items()}
    d = to_engine(cfg, target.cfg.vocab_size, weights)
    d.c.validate(target.cfg)
    return d.to(device=device if device is not None else target.device, dtype=target.dtype).eval()


def held_out(kind: str, folder: str | Path | None = None) -> list[str]:
    """Held-out excerpts of one text kind (KINDS): text never seen in training."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return list(json.loads((_require(folder, "held_out.json") / "held_out.json").read_text())[kind])


def training_record(folder: str | Path | None = None) -> dict:
    """The training record (command, commit, device, loss curves, held-out perplexity per kind)."""
    return json.loads((_require(folder, "training_record.json") / "training_record.json").read_text())
