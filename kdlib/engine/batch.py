"""The batched engine: many requests over one shared paged latent pool, each step one CUDA-graph replay.

    outs = generate_batch(model, prompts, 64, method="ddtree", drafter=d, budget=32)   # list[GenerateResult]

    eng = BatchEngine(model, max_streams=16, method="ddtree", drafter=d, budget=32)
    rid = eng.add_request(prompt_ids, 64, SamplingParams(temperature=0.7, seed=1))
    while eng.has_work():
        for o in eng.step():                 # StepOutput per request that emitted tokens or finished
            ...                              # (two for a request admitted and decoded in this step)

State. The pool `kv [layers, S + 1, kv_lora + rope]` is shared: slot S is a null slot that no request
owns (the page-table padding). A request reserves prompt + max_new_tokens + W slots when it is
admitted (W = budget + 1 verify rows, 1 for AR) and returns them when it ends; a request that cannot
get its slots waits in FIFO order, one that could never fit is refused by `add_request`. Each
running request holds a lane c < max_streams: its page-table row `table[c]` (logical position ->
slot, page_size 1, as SGLang's req_to_token), committed length `lens[c]`, bonus token `bonus[c]`
(emitted, not yet cached), sampling settings and, for the DFlash drafter, its context K/V.

One step, over lanes 0..C-1 (C = the smallest power of two holding every running lane):

  draft    the drafter's block over [bonus, MASK...] against each lane's own context -> log-softmax
           over the vocabulary in fp32 -> top-K per depth;
  build    the project's tree builder (CUDA kernel with out= buffers; numpy reference on CPU);
  verify   `Model.forward_batch` over all C x W rows: the tree rows' latents go to the slots at
           positions lens .. lens + W - 1 of each lane's table, every row attends to its own
           lane's prefix and tree ancestors, the MoE runs on the C x W rows at once;
  accept   the target token per row (argmax, or at T > 0 a draw from the tempered, top-k / top-p
           filtered distribution with a uniform hashed from (seed, lens, row): the same seed draws
           the same uniforms whatever else is in the batch, and the same tokens wherever the batch's
           shape leaves the logits' rounding alone; a lane's stop tokens are masked on the rows whose
           token comes before its min_tokens, as vLLM's min_tokens), then the greedy tree walk;
  commit   the page-table tail is permuted so the accepted rows sit at positions lens .. lens+tau-1
           (page_size 1: no KV bytes move); the drafter writes the accepted rows' context K/V;
           lens += tau; the emitted tokens (accepted + new bonus) are packed into one buffer and
           copied to pinned host memory: the step's one device-to-host copy.

AR steps are the same with W = 1 and no draft/build. On CUDA each (C, T, sampling, min_tokens masking)
bucket is captured once into a CUDA graph over static buffers (T = the page-table width a step reads,
rounded up to a power of two) and replayed; the host's work between replays is reading the packed
tokens, finishing requests and admitting new ones (prefill is eager, one request at a time).
`graphs=False` runs the same step eagerly (the CPU path, and for debugging): the same tokens.
`overlap=True` launches step k+1 before reading step k's tokens (a finished request runs one step more,
its tokens dropped); `compile=True` runs the verify forward and the drafter block through torch.compile
(fewer, fused kernels in the same graphs); a model whose experts went through
`Model.quantize_experts_int4` runs its MoE through `moe_w4a16` inside the step. The attention is the
torch path (keys gathered up to T): the tree-verify kernels' paged path is what `kdlib.engine.rank` uses
at real shapes.
"""

from __future__ import annotations

import numbers
import secrets
import time
from collections import deque
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from kdlib import ops
from kdlib.engine.drafter import DFlashDrafter, NoisyOracleDrafter
from kdlib.engine.generate import GenerateResult, check_int, check_temperature, check_tree

MIN_TABLE = 64  # the narrowest page-table width a step reads (positions); buckets double from here
TOP_LOGPROBS = 20  # alternatives computed when a request asks for logprobs (OpenAI's maximum)
STEP_HISTORY = 4096  # steps whose host wall time `step_ms` keeps (a server steps for weeks)
_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (the OpenAI / vLLM names). One difference: stop_token_ids here are the
    ids that end a request, the model's end of text among them (the server passes those alone), and
    ignore_eos sets all of them aside, their min_tokens masking too, where vLLM's sets the EOS id alone
    aside."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None

    def validate(self, vocab_size: int) -> SamplingParams:
        """self, checked (ValueError naming the field); with stop_token_ids made a tuple of ints where they
        came as another sequence (a list, a set, a numpy array)."""
        check_temperature(self.temperature)
        if (isinstance(self.top_p, bool) or not isinstance(self.top_p, numbers.Real)
                or not 0 < self.top_p <= 1):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        # both go to int64 lane tensors, min_tokens as prompt + min_tokens
        for name, v in (("top_k", self.top_k), ("min_tokens", self.min_tokens)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= v < 2**62:
                raise ValueError(f"{name} must be an int in [0, 2**62), got {v!r}")
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, numbers.Integral)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool)
                                          or not isinstance(self.logprobs, numbers.Integral)
                                          or not 0 <= self.logprobs <= TOP_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {TOP_LOGPROBS}], got {self.logprobs!r}")
        stops = self.stop_token_ids
        if isinstance(stops, str | bytes) or not isinstance(stops, Iterable):
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {type(stops).__name__}")
        stops = tuple(stops)  # a list, a set, a numpy array ...
        bad = [s for s in stops
               if isinstance(s, bool) or not isinstance(s, numbers.Integral) or not 0 <= s < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:3]} are not token ids of the vocabulary "
                             f"[0, {vocab_size})")
        tupled = type(self.stop_token_ids) is tuple
        p = self if tupled else replace(self, stop_token_ids=tuple(map(int, stops)))
        if masks_stops(p) and len(set(stops)) >= vocab_size:
            raise ValueError("min_tokens masks the stop tokens, and they are the whole vocabulary")
        return p


def masks_stops(p: SamplingParams) -> bool:
    """Whether p's stop tokens are masked until its min_tokens (vLLM's min_tokens: unless ignore_eos)."""
    return p.min_tokens > 0 and not p.ignore_eos and bool(p.stop_token_ids)


@dataclass
class StepOutput:
    """What one request emitted in one step (see kdlib.engine.batch's module docstring). A request admitted
    in a step has two in it where that step also decoded it: its prefill's, then its decode step's."""

    request_id: int
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None
    accepted: int  # the decode step's tau (accepted rows, root included); 0 for the prefill's token
    logprobs: list[dict] | None = None
    error: str | None = None  # finish_reason "error" (isolate_failures): what failed


@dataclass
class _Request:
    rid: int
    prompt: list[int]
    max_new: int
    params: SamplingParams
    seed: int
    lane: int = -1
    slots: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    steps: int = 0
    error: str | None = None


class SlotPool:
    """The shared latent pool [layers, S + 1, D] and its allocator (host-side free list, lowest slot
    first)."""

    def __init__(self, cfg, num_slots: int, device, dtype):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self.num_slots = int(num_slots)
        self.null = self.num_slots  # the padding slot: owned by no request
        self.kv = torch.zeros(cfg.num_hidden_layers, self.num_slots + 1, cfg.latent_dim,
                              device=device, dtype=dtype)
        self._free = list(range(self.num_slots - 1, -1, -1))

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n slots, or None when fewer are free (nothing taken)."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def release(self, slots: list[int]) -> None:
        self._free.extend(reversed(slots))

    def free_slots(self) -> list[int]:
        return list(self._free)


# ----------------------------------------------------------------------------- drafters, per lane
class _DFlashLanes:
    """A DFlash drafter's context K/V for every lane: [lanes, cap, nh, hd] per drafter layer."""

    graph_safe = True

    def __init__(self, drafter: DFlashDrafter, target, lanes: int, cap: int):
        drafter.c.validate(target.cfg)
        self.d, self.target = drafter, target
        self.capture = tuple(drafter.target_layer_ids)  # target layers whose outputs feed the context
        c = drafter.c
        w = drafter.fc.weight
        self.k = [torch.zeros(lanes, cap, c.num_heads, c.head_dim, device=w.device, dtype=w.dtype)
                  for _ in drafter.layers]
        self.v = [torch.zeros_like(k) for k in self.k]

    def admit(self, lane: int, prompt: list[int], feats: torch.Tensor, max_new: int) -> None:
        """The prompt's target features [P, F] become context positions 0..P-1 of `lane`."""
        self._write(torch.tensor([lane], device=feats.device),
                    torch.zeros(1, dtype=torch.int64, device=feats.device), feats[None])

    def draft(self, bonus: torch.Tensor, lens: torch.Tensor, T: int) -> torch.Tensor:
        """bonus, lens [C] -> logits [C, L, V] of depths 1..L (context: each lane's positions < lens)."""
        d, C, B = self.d, bonus.shape[0], self.d.c.block_size
        dev = bonus.device
        ids = torch.full((C, B), d.c.mask_token_id, dtype=torch.int64, device=dev)  # [C, B]
        ids[:, 0] = bonus
        x = self.target.model.embed_tokens(ids).to(d.fc.weight.dtype)  # [C, B, H]
        pos = lens[:, None] + torch.arange(B, device=dev)[None]  # [C, B]
        valid = torch.arange(T, device=dev)[None] < lens[:, None]  # [C, T]
        for layer, k, v in zip(d.layers, self.k, self.v, strict=True):
            x = layer.forward_batch(x, pos, k[:C, :T], v[:C, :T], valid)
        return d._logits(self.target, x[:, 1:])  # [C, L, V]

    def commit(self, lens, tokens, feats, tau) -> None:
        """feats [C, W, F] of the verify rows in accepted-path order go to positions lens + i."""
        C = feats.shape[0]
        self._write(torch.arange(C, device=feats.device), lens, feats)

    def _write(self, lanes, starts, feats) -> None:
        C, W, _ = feats.shape
        dev = feats.device
        h = self.d.context(feats.reshape(C * W, -1))  # [C*W, H]
        pos = starts[:, None] + torch.arange(W, device=dev)[None]  # [C, W]
        for layer, kbuf, vbuf in zip(self.d.layers, self.k, self.v, strict=True):
            k, v = layer.kv(h, pos.reshape(-1))  # [C*W, nh, hd]
            kbuf[lanes[:, None], pos] = k.view(C, W, *k.shape[1:]).to(kbuf.dtype)
            vbuf[lanes[:, None], pos] = v.view(C, W, *v.shape[1:]).to(vbuf.dtype)


class OracleLanes:
    """The noisy oracle, one `NoisyOracleDrafter` per lane (host-side: eager steps only)."""

    graph_safe = False

    def __init__(self, proto: NoisyOracleDrafter, target, lanes: int, cap: int):
        self.proto, self.target = proto, target
        self.lanes: list[NoisyOracleDrafter | None] = [None] * lanes

    def admit(self, lane, prompt, feats, max_new) -> None:
        p = self.proto
        d = NoisyOracleDrafter(p.vocab_size, p.p_wrong, p.block_size, seed=p.seed, margin=p.margin)
        d.begin(self.target, prompt, None, max_new)
        self.lanes[lane] = d

    def draft(self, bonus, lens, T) -> torch.Tensor:
        L, V = self.proto.block_size - 1, self.proto.vocab_size
        rows = []
        for c, (b, s) in enumerate(zip(bonus.tolist(), lens.tolist(), strict=True)):
            d = self.lanes[c]
            rows.append(d.draft(b, s) if d is not None else torch.zeros(L, V, device=bonus.device))
        return torch.stack(rows)

    def commit(self, lens, tokens, feats, tau) -> None:
        for c, n in enumerate(tau.tolist()):
            if self.lanes[c] is not None:
                self.lanes[c].commit(tokens[c, :n], None)


def _lane_drafter(drafter, target, lanes, cap):
    """The per-lane state of a drafter: DFlash and the noisy oracle here; any other drafter brings its
    own through `drafter.make_lanes(target, lanes, cap)` -> an object with graph_safe, admit, draft, commit
    (the signatures of _DFlashLanes)."""
    if hasattr(drafter, "make_lanes"):
        return drafter.make_lanes(target, lanes, cap)
    if isinstance(drafter, DFlashDrafter):
        return _DFlashLanes(drafter, target, lanes, cap)
    return OracleLanes(drafter, target, lanes, cap)  # a NoisyOracleDrafter (BatchEngine checked)


# ----------------------------------------------------------------------------- device-side helpers
def _mul32(h: torch.Tensor, m: int) -> torch.Tensor:
    """(h * m) mod 2^32 for 0 <= h < 2^32 in int64 without overflow (16-bit halves)."""
    return ((h & 0xFFFF) * m + (((h >> 16) * m) & 0xFFFF) * 65536) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values < 2^32."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def hashed_uniforms(seed: torch.Tensor, key: torch.Tensor, rows: int) -> torch.Tensor:
    """[C, rows] float64 uniforms in [0, 1) from (seed [C] int64, key [C] int64, row index): a pure
    function of its inputs, identical on CPU and CUDA; 53 random bits from two 32-bit hashes."""
    h = _fmix32((torch.arange(rows, device=seed.device)[None] + 0x9E3779B9) & _M32)  # [1, rows]
    h = _fmix32(h ^ (key & _M32)[:, None])  # [C, rows]
    h = _fmix32(h ^ ((seed >> 32) & _M32)[:, None])
    h = _fmix32(h ^ (seed & _M32)[:, None])
    h2 = _fmix32(h ^ 0x68E31DA4)
    return ((h >> 5) * 67108864 + (h2 >> 6)).double() * 2.0**-53  # 27 + 26 bits


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                   filtered: bool) -> torch.Tensor:
    """logits [C, W, V] -> float32 probabilities of softmax(logits / T) per lane, restricted to the
    top_k most likely tokens (0 = all) and the smallest prefix whose mass reaches top_p (vLLM's order:
    top-k, then top-p over what is left, renormalised). temperature/top_p/top_k [C]; lanes at T = 0
    get T = 1 (their rows are taken greedily). A lane without a filter gets the plain softmax whatever its
    neighbours use (the sorted path's sums differ in the last bit: its draws would depend on the batch)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None, None]
    z = logits.float() / t
    plain = torch.softmax(z, dim=-1)
    if not filtered:
        return plain
    zs, order = z.sort(dim=-1, descending=True)
    rank = torch.arange(z.shape[-1], device=z.device)
    k = top_k[:, None, None]
    zs = zs.masked_fill((k > 0) & (rank >= k), float("-inf"))
    ps = torch.softmax(zs, dim=-1)
    before = ps.cumsum(-1) - ps  # mass of the better tokens
    p = top_p[:, None, None]
    # top_p 1: all (a float32 cumsum reaches 1 early); the most likely token always stays (a top_p that
    # rounds to 0 in float32 would leave none)
    ps = ps.masked_fill((before >= p) & (p < 1) & (rank > 0), 0.0)
    ps = ps / ps.sum(-1, keepdim=True)
    unfiltered = ((top_p >= 1) & (top_k <= 0))[:, None, None]
    return torch.where(unfiltered, plain, torch.zeros_like(ps).scatter_(-1, order, ps))


@contextmanager
def cupy_on_torch_stream():
    """CuPy launches on torch's current stream and CuPy allocations from torch's caching allocator,
    so that CuPy kernels join a torch CUDA-graph capture (memory from the graph's pool)."""
    import cupy

    def alloc(size):
        t = torch.empty(max(int(size), 1), dtype=torch.uint8, device="cuda")
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(t.data_ptr(), size, t), 0)

    prev = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(alloc)
    try:
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            yield
    finally:
        cupy.cuda.set_allocator(prev)


# ----------------------------------------------------------------------------- the engine
class BatchEngine:
    """Continuous batching of AR or DDTree requests (module docstring). One thread drives it.

    isolate_failures: a request whose prefill raises (out of memory on a long prompt, say) finishes
    alone, StepOutput finish_reason "error" with the message in `error`, its lane and slots returned,
    and the others run on (a server's choice); off, the exception propagates (the library's default:
    nothing fails silently), the request ended the same way first (its `error` set, under keep_results
    in `finished`), so that the engine can step on: the outputs of the requests admitted before it in
    that call come first from the next `step`."""

    def __init__(self, model, max_streams: int = 16, method: str = "ar", drafter=None,
                 budget: int | None = None, top_k: int | None = None, num_slots: int | None = None,
                 max_context: int | None = None, graphs: bool | None = None, keep_results: bool = False,
                 compile: bool = False, overlap: bool = False, isolate_failures: bool = False):
        if method not in ("ar", "ddtree"):
            raise ValueError(f"method must be 'ar' or 'ddtree', got {method!r}")
        cfg = model.cfg
        self.model, self.cfg, self.method = model, cfg, method
        self.device, self.dtype = model.device, model.dtype
        self.max_streams = check_int("max_streams", max_streams, 1)
        self.max_context = (cfg.max_position_embeddings if max_context is None
                            else check_int("max_context", max_context, 1))
        if not 1 <= self.max_context <= cfg.max_position_embeddings:
            raise ValueError(f"max_context must lie in [1, {cfg.max_position_embeddings}], "
                             f"got {max_context!r}")
        if method == "ddtree":
            if drafter is None:
                raise ValueError("method 'ddtree' needs a drafter")
            if not (hasattr(drafter, "make_lanes")
                    or isinstance(drafter, DFlashDrafter | NoisyOracleDrafter)):
                raise ValueError("drafter must be a DFlashDrafter, a NoisyOracleDrafter or one with "
                                 f"make_lanes, got {type(drafter).__name__}")
            self.horizon, self.budget, self.k = check_tree(
                cfg, drafter, budget, top_k, min_budget=1,
                budget_note=" (generate's budget 0, a root-only tree, is method 'ar' here)")
            self.rows = self.budget + 1
        elif drafter is not None or budget is not None or top_k is not None:
            raise ValueError("drafter, budget and top_k apply to method 'ddtree' only")
        else:
            self.horizon, self.budget, self.k, self.rows = 0, 0, 0, 1
        # emitted tokens per step, at most
        self.width = min(self.horizon, self.budget) + 1 if method == "ddtree" else 1
        # page-table width: the last step's tree rows past the end, and under overlap the step that runs
        # on while the host reads the previous one (a request it finished has committed up to width more)
        cap = self.max_context + self.rows + (self.width if overlap else 0)
        self.table_cap = cap
        num_slots = self.max_streams * cap if num_slots is None else check_int("num_slots", num_slots, 1)
        self.pool = SlotPool(cfg, num_slots, self.device, self.dtype)
        self.drafter = None if method == "ar" else _lane_drafter(drafter, model, self.max_streams, cap)
        self.graphs = (self.device.type == "cuda") if graphs is None else bool(graphs)
        # torch.compile (inductor, dynamic shapes) fuses the verify forward's and the drafter block's
        # elementwise chains into fewer kernels; compiled on the first step of a shape (outside the graph)
        self.compile = bool(compile)
        self._verify = torch.compile(_verify, dynamic=True) if compile else _verify
        if compile and isinstance(self.drafter, _DFlashLanes):
            self.drafter.draft = torch.compile(self.drafter.draft, dynamic=True)
        if self.graphs and self.device.type != "cuda":
            raise ValueError("graphs=True needs the model on a CUDA device")
        if self.graphs and self.drafter is not None and not self.drafter.graph_safe:
            raise ValueError(f"{type(drafter).__name__} drafts on the host: run it with graphs=False")
        dev, n = self.device, self.max_streams
        i64 = dict(dtype=torch.int64, device=dev)
        # per-lane device state (lanes >= the running count are idle: null table rows, lens 0)
        self.table = torch.full((n, cap), self.pool.null, **i64)  # [lanes, cap]
        self.lens = torch.zeros(n, **i64)  # [lanes]
        self.bonus = torch.zeros(n, **i64)  # [lanes]
        self.active = torch.zeros(n, dtype=torch.bool, device=dev)  # [lanes]
        self.seeds = torch.zeros(n, **i64)  # [lanes]
        self.temperature = torch.zeros(n, dtype=torch.float32, device=dev)  # [lanes]
        self.top_p = torch.ones(n, dtype=torch.float32, device=dev)  # [lanes]
        self.top_kk = torch.zeros(n, **i64)  # [lanes]
        # min_tokens, as vLLM: a lane's stop tokens get no probability at a row whose token would come
        # before its min_tokens-th, i.e. whose KV position (lens + depth + 1) is below prompt + min_tokens
        self.min_until = torch.zeros(n, **i64)  # [lanes] prompt + min_tokens (0: nothing masked)
        self.stop_mask = torch.zeros(n, self.cfg.vocab_size, dtype=torch.bool, device=dev)  # [lanes, V]
        # packed step result: [emitted count, tokens x width, (logprob, top ids, top logprobs) x width,
        # the rows verified (the tree's nodes, root included; 1 for AR)]
        self.out_cols = 1 + self.width * (2 + 2 * TOP_LOGPROBS) + 1
        self.out_dev = torch.zeros(n, self.out_cols, dtype=torch.float64, device=dev)  # [lanes, cols]
        pinned = dict(dtype=torch.float64, pin_memory=dev.type == "cuda")
        # [2, lanes, cols] under overlap (one per step in flight), else [lanes, cols]
        self.out_host = (torch.zeros(2, n, self.out_cols, **pinned) if overlap
                         else torch.zeros(n, self.out_cols, **pinned))
        self.overlap, self._inflight, self._flip = bool(overlap), None, 0
        self._graphs: dict = {}
        self._graph_pool = None
        self._trees: dict = {}
        self._lanes: list[_Request | None] = [None] * n
        self._waiting: deque[_Request] = deque()
        self._requests: dict[int, _Request] = {}  # waiting and running
        self.keep_results = keep_results
        self.isolate_failures = bool(isolate_failures)
        self._held: list[StepOutput] = []  # outputs of a step whose admission raised, for the next step
        self.finished: dict[int, _Request] = {}  # with keep_results: finished requests by id
        self._next_id = 0
        self.spec_stats = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                           "accepted_per_pos": [0] * max(self.horizon, 1)}
        self.step_ms: deque[float] = deque(maxlen=STEP_HISTORY)  # host wall time of the last steps
        # a list: each replay's device span is appended (benchmarks)
        self.replay_ms: list[float] | None = None

    # ---- public state
    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self._lanes)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def pool_free_slots(self) -> int:
        return self.pool.free_count

    @property
    def pool_slots(self) -> int:
        return self.pool.num_slots

    def has_work(self) -> bool:
        """Whether a `step` has anything to do or return: requests waiting or running, a step in flight, or
        the outputs a raising step held for the next (a request that finished in that step's prefill)."""
        return (bool(self._waiting) or self.num_running > 0 or self._inflight is not None
                or bool(self._held))

    # ---- requests
    def reserve(self, prompt_len: int, max_new_tokens: int) -> int:
        """Slots a request holds while it runs: every position it can reach plus one step's rows."""
        return prompt_len + max_new_tokens + self.rows

    def add_request(self, prompt_ids, max_new_tokens: int, params: SamplingParams | None = None) -> int:
        """Queue a request (validated now: a clear ValueError if it could never run); returns its id."""
        prompt = self.model.check_tokens(prompt_ids).tolist()
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
        if params is not None and not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams or None, got {type(params).__name__}")
        params = (params or SamplingParams()).validate(self.cfg.vocab_size)
        if len(prompt) + max_new_tokens > self.max_context:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"context limit {self.max_context}")
        need = self.reserve(len(prompt), max_new_tokens)
        if need > self.pool.num_slots:
            raise ValueError(f"the request needs {need} KV slots (prompt + max_new_tokens + {self.rows} "
                             f"verify rows); the pool holds {self.pool.num_slots}")
        seed = secrets.randbits(63) if params.seed is None else int(params.seed) & (2**63 - 1)
        r = _Request(self._next_id, prompt, max_new_tokens, params, seed)
        self._next_id += 1
        self._requests[r.rid] = r
        self._waiting.append(r)
        return r.rid

    def abort(self, rid: int) -> bool:
        """Drop a waiting or running request and free its slots (between steps)."""
        r = self._requests.pop(rid, None)
        if r is None:
            return False
        if r.lane < 0:
            self._waiting.remove(r)
        else:
            self._retire(r)
        return True

    @torch.no_grad()
    def prompt_logprobs(self, prompt_ids, top_n: int) -> list[dict | None]:
        """Between steps: per prompt position i the log-probability of prompt[i] given prompt[:i] and the
        top_n alternatives (echo + logprobs); position 0 has no context and gets None."""
        if (isinstance(top_n, bool) or not isinstance(top_n, numbers.Integral)
                or not 0 <= top_n <= TOP_LOGPROBS):
            raise ValueError(f"top_n must be an int in [0, {TOP_LOGPROBS}], got {top_n!r}")
        ids = self.model.check_tokens(prompt_ids)
        if ids.shape[0] > self.max_context:
            raise ValueError(f"prompt of {ids.shape[0]} tokens exceeds the context limit {self.max_context}")
        # [P-1, V]: row i predicts prompt[i+1]
        lp = torch.log_softmax(self.model.logits(ids).float(), dim=-1)[:-1]
        return [None] + self._logprob_entries(lp, ids[1:].tolist(), int(top_n))

    def result(self, rid: int) -> _Request | None:
        """A request's record (tokens, accepted, steps): running or waiting, or finished under
        keep_results."""
        return self._requests.get(rid) or self.finished.get(rid)

    # ---- admission (eager prefill)
    def _admit(self, outs: list[StepOutput]) -> None:
        """Admit the waiting requests that fit (FIFO), their prefill outputs appended to `outs`."""
        while self._waiting:
            lane = next((i for i, r in enumerate(self._lanes) if r is None), None)
            if lane is None:
                break
            r = self._waiting[0]
            slots = self.pool.alloc(self.reserve(len(r.prompt), r.max_new))
            if slots is None:
                break  # FIFO: the head waits for slots, nobody overtakes it
            self._waiting.popleft()
            r.lane, r.slots = lane, slots
            self._lanes[lane] = r
            try:
                outs.append(self._prefill(r))
            except Exception as e:
                r.error = f"{type(e).__name__}: {e}"
                self._retire(r)
                self._requests.pop(r.rid, None)
                if self.keep_results:
                    self.finished[r.rid] = r
                if not self.isolate_failures:
                    raise
                outs.append(StepOutput(r.rid, [], True, "error", 0, error=r.error))

    def _prefill(self, r: _Request) -> StepOutput:
        m, lane, P = self.model, r.lane, len(r.prompt)
        capture = getattr(self.drafter, "capture", ())
        h, lats, feats = m.forward_plain(r.prompt, capture)  # [P, H], [P, layers, D], [P, F] | None
        dev = self.device
        slots = torch.tensor(r.slots, dtype=torch.int64, device=dev)
        self.table[lane].fill_(self.pool.null)
        self.table[lane, : len(r.slots)] = slots
        self.pool.kv[:, slots[:P]] = lats.transpose(0, 1).to(self.pool.kv.dtype)
        p = r.params
        self.seeds[lane] = r.seed
        self.temperature[lane] = float(p.temperature)
        self.top_p[lane] = float(p.top_p)
        self.top_kk[lane] = int(p.top_k)
        masked = masks_stops(p)
        self.stop_mask[lane] = False
        if masked:
            self.stop_mask[lane, list(p.stop_token_ids)] = True
        self.min_until[lane] = P + p.min_tokens if masked else 0
        logits = m.head(h[-1:])[None]  # [1, 1, V]
        lane_t = torch.tensor([lane], device=dev)
        u = hashed_uniforms(self.seeds[lane_t], torch.tensor([P - 1], device=dev), 1)  # [1, 1]
        sampled = p.temperature > 0
        # the first token comes before any min_tokens >= 1
        pick = logits.masked_fill(self.stop_mask[lane], float("-inf")) if masked else logits
        tok = self._pick(pick, u, lane_t, sampled, sampled and (p.top_p < 1 or p.top_k > 0))[0, 0]
        self.lens[lane] = P
        self.bonus[lane] = tok
        self.active[lane] = True
        if self.drafter is not None:
            self.drafter.admit(lane, r.prompt, feats, r.max_new)
        t = int(tok)
        lp = None
        if p.logprobs is not None:
            lp = self._logprob_entries(torch.log_softmax(logits[0].float(), -1), [t], p.logprobs)
        return self._emit(r, [t], 0, lp)  # no verify step: nothing accepted

    def _mask_stops(self, logits: torch.Tensor, pos: torch.Tensor, C: int) -> torch.Tensor:
        """logits [C, W, V] with each lane's stop tokens at -inf on the rows at KV position pos [C, W] whose
        token (at pos + 1) comes before the lane's min_tokens-th."""
        early = pos + 1 < self.min_until[:C, None]  # [C, W]
        return logits.masked_fill(early[:, :, None] & self.stop_mask[:C, None, :], float("-inf"))

    def _pick(self, logits, u, lanes, sampled: bool, filtered: bool) -> torch.Tensor:
        """Target token per row: logits [C, W, V], u [C, W] -> [C, W] int64; argmax on lanes at T = 0,
        an inverse-CDF draw (`ops.sample_tokens`) on the others. sampled: some lane has T > 0;
        filtered: some lane uses top_k / top_p (both known on the host: they pick the graph)."""
        greedy = logits.argmax(-1)
        if not sampled:
            return greedy
        temp = self.temperature[lanes]
        probs = filtered_probs(logits, temp, self.top_p[lanes], self.top_kk[lanes], filtered)
        C, W, V = probs.shape
        drawn = torch.as_tensor(ops.sample_tokens(probs.reshape(C * W, V), u.reshape(-1)),
                                device=logits.device)
        return torch.where((temp > 0)[:, None], drawn.view(C, W), greedy)

    # ---- one step
    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """Admit waiting requests, then one decode step of every running request (module docstring).

        With overlap, the device runs step k+1 while the host reads step k's tokens: a call launches
        the next step for the requests running now, then collects the previous one (a request that
        finished there has run one step more, whose tokens are dropped), then admits; its outputs lag
        the device by one step."""
        t0 = time.perf_counter()
        outs, self._held = self._held, []  # what steps that raised had emitted
        try:
            if not self.overlap:
                self._admit(outs)
                launched = self._launch()
                if launched is not None:
                    outs += self._finish(launched)
                    self.step_ms.append((time.perf_counter() - t0) * 1e3)
                return outs
            launched = self._launch()
            outs += self._finish(self._inflight) if self._inflight is not None else []
            self._inflight = launched
            self._admit(outs)
        except Exception:
            self._held = outs  # emitted before the failure: the next step returns them first
            raise
        if launched is not None:
            self.step_ms.append((time.perf_counter() - t0) * 1e3)
        return outs

    def _launch(self):
        """Start one device step over the running lanes; returns (requests by lane, C, host buffer, event)."""
        running = [(r.lane, r) for r in self._lanes if r is not None]
        if not running:
            return None
        C = min(1 << max(lane for lane, _ in running).bit_length(), self.max_streams)  # lanes 0..C-1 step
        ahead = self.width if self._inflight is not None else 0  # a step in flight may commit this many more
        lens = [len(r.prompt) + len(r.tokens) - 1 + ahead for _, r in running]  # committed: all but the bonus
        T = MIN_TABLE
        while T < max(lens) + self.rows:
            T *= 2
        T = min(T, self.table_cap)
        reqs = [self._lanes[i] for i in range(C)]
        sampled = any(r is not None and r.params.temperature > 0 for r in reqs)
        filtered = any(r is not None and r.params.temperature > 0
                       and (r.params.top_p < 1 or r.params.top_k > 0) for r in reqs)
        want_lp = any(r is not None and r.params.logprobs is not None for r in reqs)
        # some lane may still be short of its min_tokens (the host's count lags a step in flight: harmless)
        masking = any(r is not None and masks_stops(r.params) and len(r.tokens) < r.params.min_tokens
                      for r in reqs)
        key = (C, T, sampled, filtered, want_lp, masking)
        # the buffer the step in flight does not hold (a raising step left no half-flipped state behind)
        host = self.out_host[self._flip] if self.overlap else self.out_host
        event = span = None
        if self.graphs:
            span = self._replay(key)
            if self.overlap:  # the copy leaves the graph: each step has its own host buffer
                host[:C].copy_(self.out_dev[:C], non_blocking=True)
                event = torch.cuda.Event()
                event.record()
        else:
            self._device_step(*key)
            host[:C].copy_(self.out_dev[:C])
        self._flip ^= 1  # launched: the next step takes the other buffer
        return running, C, host, event, span

    def _finish(self, launched) -> list[StepOutput]:
        """Wait for a launched step's packed tokens and hand them to the requests still in their lanes."""
        running, C, host, event, span = launched
        if event is not None:
            event.synchronize()  # the step's one wait
        if span is not None and self.replay_ms is not None:
            self.replay_ms.append(span[0].elapsed_time(span[1]))
        out = host[:C].numpy()
        return [self._collect(r, out[lane]) for lane, r in running if self._lanes[lane] is r]

    def _collect(self, r: _Request, row: np.ndarray) -> StepOutput:
        n = int(row[0])
        w = self.width
        toks = row[1 : 1 + n].astype(np.int64).tolist()
        lp = None
        if r.params.logprobs is not None:
            base = 1 + w
            chosen = row[base : base + w]
            ids = row[base + w : base + w + w * TOP_LOGPROBS].reshape(w, TOP_LOGPROBS).astype(np.int64)
            vals = row[base + w + w * TOP_LOGPROBS : base + w + 2 * w * TOP_LOGPROBS].reshape(w, TOP_LOGPROBS)
            k = min(r.params.logprobs, self.cfg.vocab_size)
            lp = [{"token": toks[i], "logprob": float(chosen[i]),
                   "top": [(int(a), float(b)) for a, b in zip(ids[i, :k], vals[i, :k], strict=True)]}
                  for i in range(n)]
        verified = int(row[-1])
        r.steps += 1
        r.accepted.append(n)
        r.tree_sizes.append(verified)
        if self.method == "ddtree":
            s = self.spec_stats
            s["drafts"] += 1
            s["draft_tokens"] += verified - 1
            s["accepted_tokens"] += n - 1
            for i in range(n - 1):
                s["accepted_per_pos"][i] += 1
        return self._emit(r, toks, n, lp)

    def _emit(self, r: _Request, toks: list[int], tau: int, lp) -> StepOutput:
        """Append this step's tokens to r, cut at a stop token or max_new, retire r if it finished."""
        p, reason = r.params, None
        keep = []
        for t in toks:
            keep.append(t)
            n = len(r.tokens) + len(keep)
            if not p.ignore_eos and t in p.stop_token_ids and n > p.min_tokens:
                reason = "stop"
                break
            if n >= r.max_new:
                reason = "length"
                break
        r.tokens.extend(keep)
        lp = lp[: len(keep)] if lp is not None else None
        if reason is not None:
            self._retire(r)
            self._requests.pop(r.rid, None)
            if self.keep_results:
                self.finished[r.rid] = r
        return StepOutput(r.rid, keep, reason is not None, reason, tau, lp)

    def _retire(self, r: _Request) -> None:
        lane = r.lane
        if lane >= 0 and self._lanes[lane] is r:
            self._lanes[lane] = None
            self.pool.release(r.slots)
            self.table[lane].fill_(self.pool.null)
            self.lens[lane] = 0
            self.bonus[lane] = 0
            self.active[lane] = False
            self.temperature[lane] = 0.0
            self.min_until[lane] = 0
            if isinstance(self.drafter, OracleLanes):
                self.drafter.lanes[lane] = None
        r.lane = -1
        r.slots = []

    # ---- the device step (eager, or captured into a graph)
    def _device_step(self, *key) -> None:
        """One step's device work; key: (C, T, sampled, filtered, want_lp, masking), as `_launch` makes it."""
        if self.device.type == "cuda":
            with cupy_on_torch_stream():
                self._device_step_body(*key)
        else:
            self._device_step_body(*key)

    def _device_step_body(self, C: int, T: int, sampled: bool, filtered: bool, want_lp: bool,
                          masking: bool) -> None:
        m, dev, W = self.model, self.device, self.rows
        lanes = torch.arange(C, device=dev)
        lens, bonus, table = self.lens[:C], self.bonus[:C], self.table[:C, :T]
        u = hashed_uniforms(self.seeds[:C], lens, W) if sampled else None  # [C, W]
        if self.method == "ar":
            tokens = bonus[:, None]  # [C, 1]
            depth = torch.zeros(C, 1, dtype=torch.int64, device=dev)
            vis = torch.ones(C, 1, 1, dtype=torch.bool, device=dev)
            logits, _ = self._verify(m, self.pool.kv, table, lens, tokens, depth, vis, ())  # [C, 1, V]
            pick = self._mask_stops(logits, lens[:, None] + depth, C) if masking else logits
            nxt = self._pick(pick, u, lanes, sampled, filtered)  # [C, 1]
            tau = torch.ones(C, dtype=torch.int64, device=dev)
            emitted, rows = nxt, torch.zeros(C, 1, dtype=torch.int64, device=dev)
            verified = torch.ones(C, dtype=torch.int64, device=dev)
        else:
            logp = torch.log_softmax(self.drafter.draft(bonus, lens, T).float(), dim=-1)  # [C, L, V]
            top = logp.topk(self.k, dim=-1)
            trees = self._build(top.indices.contiguous(), top.values.contiguous(), C)
            verified = torch.as_tensor(trees.sizes, device=dev)  # [C] nodes, root included
            nodes = torch.as_tensor(trees.node_token_ids, device=dev)  # [C, budget]
            tokens = torch.cat([bonus[:, None], nodes.clamp(min=0)], dim=1)  # [C, W]
            depth = torch.as_tensor(trees.positions, device=dev).clamp(min=0)  # [C, W]
            # [C, W, W]; every row sees itself: a padding row of a tree smaller than the budget sees nothing
            # else, and in an idle lane (no prefix) its softmax over no key was NaN, written to the null slot
            vis = torch.as_tensor(trees.visibility, device=dev) | torch.eye(W, dtype=torch.bool, device=dev)
            capture = getattr(self.drafter, "capture", ())
            # logits [C, W, V]
            logits, feats = self._verify(m, self.pool.kv, table, lens, tokens, depth, vis, tuple(capture))
            pick = self._mask_stops(logits, lens[:, None] + depth, C) if masking else logits
            target = self._pick(pick, u, lanes, sampled, filtered)  # [C, W]
            paths, tau, new_bonus = self._accept(trees, target, C)  # [C, L+1], [C], [C]
            # page-table tail: accepted rows first (path order), then the rest in index order; padded
            # path entries (-1) write into a spare column W
            key = W + torch.arange(W + 1, device=dev).expand(C, W + 1).clone()  # [C, W+1]
            order = torch.arange(paths.shape[1], device=dev).expand_as(paths)
            key.scatter_(1, torch.where(paths >= 0, paths, W), order)
            perm = key[:, :W].argsort(dim=1, stable=True)  # [C, W]
            idx = lens[:, None] + torch.arange(W, device=dev)[None]  # [C, W]
            tail = table.gather(1, idx)
            self.table[:C, :T].scatter_(1, idx, tail.gather(1, perm))
            path_tokens = tokens.gather(1, perm)  # [C, W] tokens in committed order
            f = (feats.view(C, W, -1).gather(1, perm[:, :, None].expand(C, W, feats.shape[-1]))
                 if feats is not None else None)
            self.drafter.commit(lens, path_tokens, f, tau)
            # emitted: accepted nodes' tokens after the root, then the new bonus
            j = torch.arange(self.width, device=dev)[None]  # [1, width]
            shifted = torch.cat([path_tokens[:, 1 : self.width],
                                 torch.zeros(C, 1, dtype=torch.int64, device=dev)], 1)
            emitted = torch.where(j == (tau - 1)[:, None], new_bonus[:, None], shifted[:, : self.width])
            rows = paths.clamp(min=0)[:, : self.width]  # [C, width] the row that predicted each emitted token
            nxt = new_bonus[:, None]
        act = self.active[:C]
        self.lens[:C] = torch.where(act, lens + tau, 0)
        self.bonus[:C] = torch.where(act, nxt[:, -1], 0)
        out = self.out_dev[:C]
        out.zero_()
        out[:, 0] = tau.double()
        out[:, 1 : 1 + emitted.shape[1]] = emitted.double()
        out[:, -1] = verified.double()
        if want_lp:
            wd = self.width
            lp = torch.log_softmax(
                logits.gather(1, rows[:, :, None].expand(-1, -1, logits.shape[-1])).float(), -1)
            lp = lp[:, :wd]  # [C, width, V]
            base = 1 + wd
            out[:, base : base + emitted.shape[1]] = lp.gather(2, emitted[:, :, None])[..., 0].double()
            kt = min(TOP_LOGPROBS, lp.shape[-1])  # a vocabulary under TOP_LOGPROBS has fewer alternatives
            top = lp.topk(kt, dim=-1)
            n = emitted.shape[1]
            # [C, ids | values, width, TOP_LOGPROBS], before the verified-rows column
            alts = out[:, base + wd : -1].view(C, 2, wd, TOP_LOGPROBS)
            alts[:, 0, :n, :kt] = top.indices[:, :n].double()
            alts[:, 1, :n, :kt] = top.values[:, :n].double()

    def _logprob_entries(self, lp: torch.Tensor, toks: list[int], n_top: int) -> list[dict]:
        """lp [n, V] log-probabilities of the rows that predicted toks [n]; n_top alternatives each."""
        top = lp.topk(min(n_top, lp.shape[-1]), dim=-1)
        return [{"token": t, "logprob": float(lp[i, t]),
                 "top": list(zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True))}
                for i, t in enumerate(toks)]

    def _build(self, ids, lps, C):
        if self.device.type != "cuda":
            return ops.build_tree_batch(ids, lps, self.budget, vocab_size=self.cfg.vocab_size)
        from kdlib.cuda import tree

        buf = self._trees.get(C)
        if buf is None:
            buf = self._trees[C] = TreeBuffers(C, self.budget, self.horizon, self.device)
        tree.build_tree_batch(ids, lps, self.budget, out=buf.cupy)
        return buf

    def _accept(self, trees, target, C):
        if self.device.type != "cuda":
            paths, lengths, bonus = ops.accept_greedy_batch(trees, target, max_depth=self.width - 1)
            return (torch.as_tensor(paths, device=self.device), torch.as_tensor(lengths, device=self.device),
                    torch.as_tensor(bonus, device=self.device))
        from kdlib.cuda import accept

        accept.accept_greedy_batch(trees.cupy, target, max_depth=self.width - 1, out=trees.accept_cupy)
        return trees.paths, trees.lengths, trees.new_bonus

    # ---- CUDA graphs
    def _replay(self, key):
        g = self._graphs.get(key)
        if g is None:
            g = self._capture(key)
        span = None
        if self.replay_ms is None:
            g.replay()
        else:  # the graph's span on the device, between two events on its stream
            span = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            span[0].record()
            g.replay()
            span[1].record()
        if not self.overlap:
            # the step's one wait: the packed tokens are on the host
            torch.cuda.current_stream().synchronize()
        return span  # read once the step is known done (_finish)

    def _capture(self, key):
        C, T, sampled, filtered, want_lp, masking = key
        state = (self.lens, self.bonus, self.table)  # what a step advances (the rest it rewrites)
        saved = [t.clone() for t in state]

        def restore():
            for t, s in zip(state, saved, strict=True):
                t.copy_(s)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up from the same state: kernels compiled, cuBLAS and allocator primed
                restore()
                self._device_step(*key)
        torch.cuda.current_stream().wait_stream(side)
        restore()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._graph_pool):
            self._device_step(*key)
            if not self.overlap:
                self.out_host[:C].copy_(self.out_dev[:C], non_blocking=True)
        restore()
        self._graphs[key] = g
        return g


def _verify(model, kv, table, lens, tokens, depth, vis, capture):
    """`Model.forward_batch` + the LM head: logits [C, W, V] and the captured features [C*W, F] | None."""
    h, feats = model.forward_batch(kv, table, lens, tokens, depth, vis, capture)
    return model.head(h).view(tokens.shape[0], tokens.shape[1], -1), feats


class TreeBuffers:
    """Static torch buffers of C trees and their accept outputs, with CuPy views (zero copy) for the
    kernels."""

    def __init__(self, C: int, budget: int, horizon: int, device):
        import cupy

        from kdlib.ref.tree import BATCH_FIELDS, DDTreeBatch

        s = budget + 1
        i64 = dict(dtype=torch.int64, device=device)
        self.sizes = torch.zeros(C, **i64)  # [C]
        self.node_token_ids = torch.zeros(C, budget, **i64)  # [C, budget]
        self.node_depths = torch.zeros(C, budget, **i64)
        self.parents = torch.zeros(C, s, **i64)  # [C, budget+1]
        self.visibility = torch.zeros(C, s, s, dtype=torch.bool, device=device)  # [C, budget+1, budget+1]
        self.next_token = torch.zeros(C, s, **i64)
        self.next_sibling = torch.zeros(C, s, **i64)
        self.positions = torch.zeros(C, s, **i64)
        self.scores = torch.zeros(C, budget, dtype=torch.float64, device=device)  # [C, budget]
        self.paths = torch.zeros(C, min(horizon, budget) + 1, **i64)  # [C, depth+1]
        self.lengths = torch.zeros(C, **i64)
        self.new_bonus = torch.zeros(C, **i64)

        def cp(t):
            if t.dtype == torch.bool:
                return cupy.from_dlpack(t.view(torch.uint8)).view(cupy.bool_)
            return cupy.from_dlpack(t)

        self.cupy = DDTreeBatch(**{n: cp(getattr(self, n)) for n in BATCH_FIELDS})
        self.accept_cupy = (cp(self.paths), cp(self.lengths), cp(self.new_bonus))


# ----------------------------------------------------------------------------- one call for many prompts
def generate_batch(model, prompts, max_new_tokens: int, method: str = "ar", drafter=None,
                   budget: int | None = None, temperature: float = 0.0, seed: int | None = None,
                   max_streams: int | None = None, graphs: bool | None = None, top_k: int | None = None,
                   compile: bool = False, overlap: bool = False) -> list[GenerateResult]:
    """Generate max_new_tokens after each prompt with the batched engine; results in prompt order.

    top_k: the drafts per depth (DDTree's K), not a sampling top-k (SamplingParams.top_k).
    seed: request i gets seed + i (None: fresh randomness). GenerateResult.phase_ms stays empty
    (a step's phases run inside one graph); accepted / tree_sizes / target_forwards are per request,
    total_ms is the whole batch's wall time.
    """
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Iterable):
        raise ValueError(f"prompts must be a sequence of prompts, got {type(prompts).__name__}")
    listed = []
    for i, p in enumerate(prompts):  # the ids themselves: add_request's check
        if isinstance(p, str | bytes) or not isinstance(p, Iterable):
            raise ValueError(f"prompts[{i}] must be a sequence of token ids, got {type(p).__name__}")
        listed.append(list(p))
    prompts = listed
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
    if not prompts:
        return []
    n = len(prompts) if max_streams is None else max_streams
    longest = max(len(p) for p in prompts) + max_new_tokens
    eng = BatchEngine(model, max_streams=n, method=method, drafter=drafter, budget=budget, top_k=top_k,
                      max_context=min(model.cfg.max_position_embeddings, max(longest, 1)), graphs=graphs,
                      keep_results=True, compile=compile, overlap=overlap)
    t0 = time.perf_counter()
    rids = [eng.add_request(p, max_new_tokens, SamplingParams(temperature=temperature,
                                                             seed=None if seed is None else seed + i))
            for i, p in enumerate(prompts)]
    while eng.has_work():
        eng.step()
    total = (time.perf_counter() - t0) * 1e3
    out = []
    for rid, p in zip(rids, prompts, strict=True):
        r = eng.result(rid)
        out.append(GenerateResult(tokens=r.tokens, method=method, prompt_len=len(p),
                                  budget=eng.budget or None, top_k=eng.k or None,
                                  temperature=float(temperature), target_forwards=1 + r.steps,
                                  accepted=r.accepted, tree_sizes=r.tree_sizes, total_ms=total))
    return out
