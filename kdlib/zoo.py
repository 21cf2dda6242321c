"""The workbook's trained tiny models: tokenizer, MLA + MoE target, DFlash-style drafter, held-out text.

    from kdlib import zoo
    if zoo.available():
        tok = zoo.load_tokenizer()                     # .encode(str) -> list[int], .decode(ids), .vocab_size,
                                                       # .eos_token_id (the end-of-text token, EOS_TOKEN)
        target = zoo.load_target()                     # kdlib.engine.Model, float32, eval mode
        drafter = zoo.load_drafter(target)             # engine DFlashDrafter, for generate's method="ddtree"
        texts = zoo.held_out("code")                   # held-out excerpts of one kind (KINDS)

Files (all under data/models/, written by `tools/train_tiny.py`, which re-trains everything):

    tokenizer.json          byte-level BPE (Hugging Face `tokenizers`); special tokens EOS_TOKEN (id 0,
                            the end of every training document) and MASK_TOKEN (id 1, the drafter's filler)
    target.config.json      HF DeepseekV3 config.json of the target (eos_token_id: EOS_TOKEN's id)
    target.kdtr             the target's weights, HF DeepseekV3 parameter names, float16
    drafter.kdtr            the engine's DFlashDrafter as its `save` writes it: its own weights (the
                            embedding and LM head are the target's), float16, config in the metadata
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

from kdlib import DATA, kdtr

MODELS = DATA / "models"
KINDS = ("code", "prose", "templated")
FILES = ("tokenizer.json", "target.config.json", "target.kdtr", "drafter.kdtr", "held_out.json",
         "training_record.json")
EOS_TOKEN = "<|endoftext|>"  # end of text, as GPT-2's and Qwen's tokenizers name it
MASK_TOKEN = "<|mask|>"  # fills the drafter's block slots after the first
EXCERPT_CHARS = 2400  # held_out.json's excerpt length: a shorter excerpt is a whole document


def available(folder: str | Path | None = None) -> bool:
    """True when every file of the trained models is present."""
    root = Path(folder) if folder is not None else MODELS
    return all((root / f).is_file() for f in FILES)


def _require(folder, *names: str) -> Path:
    root = Path(folder) if folder is not None else MODELS
    missing = [f for f in names if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{root}: trained models missing ({', '.join(missing)}); run `python tools/train_tiny.py --out "
            f"{root}{' --replace-shipped' if root.resolve() == MODELS.resolve() else ''}` to train them"
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
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise ValueError("encode_batch takes a list of str (a lone str would be split into characters)")
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-text token's id (EOS_TOKEN), None for a tokenizer without it."""
        return self._tok.token_to_id(EOS_TOKEN)

    def decode(self, ids) -> str:
        """Special tokens decode to their text (EOS_TOKEN included); an id outside the vocabulary is a
        ValueError (the library would drop it silently)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:3]} lie outside the vocabulary [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token i stands for: a piece of a UTF-8 character keeps its own bytes, which its
        decoded text (U+FFFD) loses. Byte-level BPE spells each byte as one symbol (BYTE_OF); a token
        spelled otherwise (none here) counts as the UTF-8 of its text."""
        i = int(i)
        if not 0 <= i < self.vocab_size:  # as decode (the library: None past the end, OverflowError below 0)
            raise ValueError(f"token id {i} lies outside the vocabulary [0, {self.vocab_size})")
        tok = self._tok.id_to_token(i)
        if tok is None:
            return b""
        if all(c in BYTE_OF for c in tok):
            return bytes(BYTE_OF[c] for c in tok)
        return tok.encode("utf-8")


def _byte_symbols() -> dict[str, int]:
    """Byte-level BPE's symbol -> byte: printable Latin-1 bytes stand for themselves, the 68 others
    take the code points 256, 257, ... in byte order (the GPT-2 convention of `tokenizers`' ByteLevel)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


BYTE_OF = _byte_symbols()


def load_tokenizer(folder: str | Path | None = None) -> Tokenizer:
    from tokenizers import Tokenizer as _Tok

    path = _require(folder, "tokenizer.json") / "tokenizer.json"
    try:
        return Tokenizer(_Tok.from_file(str(path)))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception on a bad file
        raise ValueError(f"{path}: not a tokenizer the tokenizers library reads ({e})") from e


def _state_dict(path, dtype, device) -> dict:
    import numpy as np
    import torch

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
    """The trained drafter, the engine's `DFlashDrafter`, on the target's device and dtype by default."""
    from kdlib.engine.drafter import DFlashDrafter

    d = DFlashDrafter.load(_require(folder, "drafter.kdtr") / "drafter.kdtr")
    d.c.validate(target.cfg)
    return d.to(device=device if device is not None else target.device, dtype=target.dtype).eval()


def held_out(kind: str, folder: str | Path | None = None) -> list[str]:
    """Held-out excerpts of one text kind (KINDS): documents of the held-out split, none of which the
    models trained on. The 'templated' ones are calendar year pages, and a year's calendar repeats one
    of the training years' (the Gregorian cycle): only the year in the header is new, so they measure
    predictable, near-memorised text; 'code' and 'prose' are new text."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return list(json.loads((_require(folder, "held_out.json") / "held_out.json").read_text())[kind])


def training_record(folder: str | Path | None = None) -> dict:
    """The training record (command, commit, device, loss curves, held-out perplexity per kind)."""
    return json.loads((_require(folder, "training_record.json") / "training_record.json").read_text())
