"""What the server serves: target, drafter and tokenizer, trained (`kdlib.zoo`) or a random fallback.

    b = load_bundle("cuda", dtype="bfloat16")   # the trained tiny models when present, else the fallback
    b.model, b.drafter, b.tokenizer, b.stop_token_ids, b.info

Fallback (no trained models, or prefer_trained=False): a random tiny model from
data/configs/tiny-a.json, a noisy-oracle drafter (`LazyOracle`) and `ByteTokenizer` (printable
ASCII); it has no end-of-text token, so it stops only at max_tokens or a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kdlib import DATA

FALLBACK_CONFIG = "tiny-a"
FALLBACK_P_WRONG = 0.35  # the oracle's per-position miss rate: ~2.5 tokens per step, near the seeds' 2.9
DTYPES = ("float32", "bfloat16")
END_OF_TEXT = "<|endoftext|>"  # the trained tokenizer's document separator (kdlib.training.SPECIAL_TOKENS)


class ByteTokenizer:
    """Printable ASCII for the random fallback model: id 0 = newline, ids 1..95 = chr(32..126).

    Ids past 95 (a vocabulary larger than 96) decode to nothing; a character outside the table
    encodes as '?'. Same interface as `kdlib.zoo.Tokenizer` (encode, decode, vocab_size).
    """

    TABLE = "\n" + "".join(chr(c) for c in range(32, 127))

    def __init__(self, vocab_size: int):
        if vocab_size < len(self.TABLE):
            raise ValueError(f"ByteTokenizer needs a vocabulary of >= {len(self.TABLE)} ids, "
                             f"got {vocab_size}")
        self.vocab_size = vocab_size
        self._ids = {c: i for i, c in enumerate(self.TABLE)}

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        q = self._ids["?"]
        return [self._ids.get(c, q) for c in text]

    def decode(self, ids) -> str:
        n = len(self.TABLE)
        return "".join(self.TABLE[i] for i in (int(x) for x in ids) if 0 <= i < n)


def _lazy_oracle_class():
    """`LazyOracle` (and its per-lane state for the batched engine), defined on first use so that
    importing this module needs no torch."""
    import numpy as np
    import torch

    from kdlib.engine.batch import OracleLanes
    from kdlib.engine.cache import LatentCache
    from kdlib.engine.drafter import NoisyOracleDrafter

    class LazyOracle(NoisyOracleDrafter):
        """A NoisyOracleDrafter whose greedy script grows as decoding needs it, on a private cache.

        The engine's oracle computes the whole greedy continuation (max_new_tokens of AR) in
        `begin`; for a server that set-up grows with max_tokens, lands in the two-point difference
        t(264) - t(8), and turns the diagnosis into a measurement of the oracle. Here `begin`
        prefills the prompt and scripts the first draft window only (a fixed cost), and each
        `draft` extends the script by the tokens the last step committed (about tau AR forwards,
        counted in the draft phase of that step), so the cost scales with the generated tokens as
        a real drafter's does. Drafts are the base class's.
        """

        def begin(self, target, prompt_ids, features, max_new_tokens: int) -> None:
            self._model = target
            self._rng = np.random.Generator(np.random.PCG64(self.seed))
            ids = target.check_tokens(prompt_ids)
            self._ctx = [int(t) for t in ids.tolist()]
            self._cache = LatentCache(target.cfg, len(self._ctx) + max_new_tokens + self.block_size + 2,
                                      device=target.device, dtype=target.dtype)
            h, _ = target.prefill(self._cache, ids)
            self._script = self._ctx + [int(target.head(h[-1:]).argmax(-1))]
            # the first draft's window: step 1 costs as the rest
            self._extend(len(self._ctx) + self.block_size)

        def _extend(self, want: int) -> None:
            while len(self._script) < want and self._cache.length + 1 < self._cache.num_slots:
                pos = self._cache.length
                h, _ = self._model.forward_cached(self._cache, torch.tensor([self._script[pos]]), [pos])
                self._cache.commit()
                self._script.append(int(self._model.head(h).argmax(-1)))

        def draft(self, bonus: int, s: int) -> torch.Tensor:
            ctx = self._ctx + [int(bonus)]
            if self._script[: len(ctx)] == ctx:  # still on the greedy path (always at T = 0)
                self._extend(len(ctx) + self.block_size - 1)
            return super().draft(bonus, s)

        def make_lanes(self, target, lanes: int, cap: int):
            """The batched engine's per-lane state (`kdlib.engine.batch`'s drafter hook)."""
            return LazyOracleLanes(self, target, lanes, cap)

    class LazyOracleLanes(OracleLanes):
        """The batched engine's per-lane oracles (host-side drafts: eager steps only), each a LazyOracle."""

        def admit(self, lane: int, prompt, feats, max_new: int) -> None:
            p = self.proto
            d = LazyOracle(p.vocab_size, p.p_wrong, p.block_size, seed=p.seed, margin=p.margin)
            d.begin(self.target, prompt, None, max_new)
            self.lanes[lane] = d

    return LazyOracle


@dataclass
class Bundle:
    """What the server serves: target, drafter, tokenizer, and a description of where they came from."""

    model: object
    drafter: object
    tokenizer: object
    name: str
    info: dict = field(default_factory=dict)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The end-of-text id(s): the tokenizer's END_OF_TEXT token, else the config's eos_token_id
        when the tokenizer has a token of that id (it decodes to text); () when there is none (the
        fallback's ByteTokenizer has no token lookup)."""
        lookup = getattr(self.tokenizer, "token_to_id", None)
        if lookup is None:
            return ()
        eot = lookup(END_OF_TEXT)
        if eot is not None:
            return (int(eot),)
        eos = self.model.cfg.extra.get("eos_token_id")
        ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        return tuple(int(i) for i in ids
                     if 0 <= int(i) < self.tokenizer.vocab_size and self.tokenizer.decode([int(i)]))


def _host_available_bytes() -> int | None:
    """The host's MemAvailable (/proc/meminfo); None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_fits(config: Path, dtype, device) -> None:
    """ValueError where a random model of the config file `config` in `dtype` cannot be built:
    `Model.random` holds float32 parameters and their float32 numpy draw on the host, then the cast copy
    (8 bytes a parameter + the dtype's), whatever the device; a CUDA device then holds the weights (the
    dtype's). A full-size config (kimi-k2.6: a trillion parameters) is refused before any allocation."""
    import torch

    from kdlib import memory

    params = memory.param_count(config)["total"]
    needs = [("the host", params * (8 + dtype.itemsize), _host_available_bytes())]
    if torch.device(device).type == "cuda":
        needs.append((str(device), params * dtype.itemsize, int(torch.cuda.mem_get_info(device)[0])))
    for where, need, free in needs:
        if free is not None and need > free:
            raise ValueError(f"a random {config.stem} is {params / 1e9:,.1f}B parameters: building it in "
                             f"{str(dtype).removeprefix('torch.')} takes {need / 2**30:,.1f} GiB on {where}, "
                             f"past the {free / 2**30:,.1f} GiB free: --random serves configs that fit "
                             "(tiny-a, tiny-b)")


def load_bundle(device: str = "cpu", *, prefer_trained: bool = True, config: str = FALLBACK_CONFIG,
                p_wrong: float = FALLBACK_P_WRONG, seed: int = 0, folder=None,
                dtype: str = "float32") -> Bundle:
    """The trained zoo models when present (and prefer_trained), else the random fallback.

    folder: where the trained models are (default `kdlib.zoo.MODELS`, i.e. data/models/); dtype:
    "float32" (greedy outputs bit-stable across batch shapes) or "bfloat16".
    """
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    dt = getattr(torch, dtype)
    if prefer_trained:
        try:
            from kdlib import zoo

            if zoo.available(folder):
                model = zoo.load_target(device=device, dtype=dt, folder=folder)
                where = folder if folder is not None else "data/models/"
                return Bundle(model, zoo.load_drafter(model, folder=folder), zoo.load_tokenizer(folder),
                              "kdtree-tiny",
                              {"source": "trained", "weights": f"trained (kdlib.zoo, {where})",
                               "drafter": "trained DFlash-style", "tokenizer": "trained byte-level BPE",
                               "dtype": dtype})
        except ImportError:
            pass
    from kdlib.engine.config import ModelConfig
    from kdlib.engine.model import Model

    path = DATA / "configs" / f"{config}.json"
    cfg = ModelConfig.from_json(path)
    _check_fits(path, dt, device)
    model = Model.random(cfg, seed=seed, device=device, dtype=dt)
    drafter = _lazy_oracle_class()(cfg.vocab_size, p_wrong, block_size=8, seed=seed)
    return Bundle(model, drafter, ByteTokenizer(cfg.vocab_size), f"kdtree-random-{config}",
                  {"source": "random",
                   "weights": f"random (data/configs/{config}.json, seed {seed})"
                              + ("" if not prefer_trained else ": no trained models found"),
                   "drafter": f"noisy oracle (lazy script), p_wrong {p_wrong}",
                   "tokenizer": "printable ASCII (ByteTokenizer)", "dtype": dtype})
