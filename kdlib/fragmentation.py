"""KV-slot fragmentation under page_size 1: a simulation of the token-slot allocator under DDTree.

    sim = simulate(requests=4, prompt_len=512, new_tokens=2048, budget=32, policy="fifo")
    sim.tables[0]            # [len] int64: slot of each position of request 0, in position order
    layout_stats(sim.tables[0])   # runs, mean run length, page-64 blocks touched, ...

Why it matters (survey §5.1): with page_size 1 an engine keeps the accepted tree nodes where the
verify wrote them and frees the rejected ones, so no KV is moved after acceptance; the price is
that a request's positions stop being contiguous slots. Attention then gathers rows through the
page table (`req_to_token`), and a kernel that wants pages of 64 (FlashMLA) cannot use the cache
as it stands.

The allocator modelled is SGLang's page-size-1 `TokenToKVPoolAllocator`
(sgl-project/sglang `python/sglang/srt/mem_cache/allocator.py` @02e29cb): the free list starts as
every slot in ascending order; `alloc(n)` takes the first n entries; `free(idx)` appends idx to the
end of the list (`need_sort=False`), or, with `need_sort=True`, to a release list that is merged
into the free list and sorted only when an allocation no longer fits. POLICIES:

  fifo    need_sort False: freed slots queue behind every never-used slot
  sorted  need_sort True: freed slots come back in ascending order once the free list runs short
  lifo    freed slots go to the front and are reused at once (not SGLang's; the other extreme)

One decode round for a batch of running requests (how the SGLang DDTree ports allocate):
allocate (budget + 1) slots per request in ONE call for the whole batch (the verify rows
`out_cache_loc`), keep the root and the accepted path's slots, free the rest in one call. The
accepted path is the top-1 chain of a real DDTree (`kdlib.ref.build_tree_batch` on synthetic
drafter top-k), cut at the sampled accepted length tau, so the kept slots sit at the indices
best-first order gives those nodes (siblings popped in between leave gaps). The simplification:
acceptance always follows the top-1 chain (a sibling is never the accepted node).
A request that finishes frees all its slots; a new one takes its place until `total` requests
have run, so prefills land in whatever the free list holds then.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kdlib.ref.tree import build_tree_batch, synthetic_topk

POLICIES = ("fifo", "sorted", "lifo")
PAGE = 64  # FlashMLA's page size (kernels-perf.md §1): the block a page-64 kernel reads


@dataclass
class Simulation:
    """Result of `simulate`.

    tables      one [length] int64 array per finished request: the slot of each position, in order
    accepted    tau per decode step (all requests, in step order)
    pool_slots  size of the slot pool
    params      the arguments (accept_mean None where `accepted` was given) and realised_accept_mean,
                the mean tau drawn
    """

    tables: list[np.ndarray]
    accepted: list[int]
    pool_slots: int
    params: dict = field(default_factory=dict)


class Allocator:
    """SGLang's page-size-1 slot allocator (see module docstring), one of POLICIES.

    Slot 0 is never handed out (SGLang reserves it for padded tokens); slots are 1..size.
    """

    def __init__(self, size: int, policy: str = "fifo"):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size, self.policy = size, policy
        self._free = deque(range(1, size + 1))
        self._release: list[int] = []
        self._held: set[int] = set()  # handed out and not freed: a double or stray free is an error

    def available(self) -> int:
        return len(self._free) + len(self._release)

    def alloc(self, n: int) -> np.ndarray:
        """n slots (int64), or raise MemoryError when the pool cannot hold them."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if self.policy == "sorted" and n > len(self._free) and self._release:
            merged = sorted(list(self._free) + self._release)
            self._free, self._release = deque(merged), []
        if n > len(self._free):
            raise MemoryError(f"KV pool exhausted: {n} slots wanted, {self.available()} free of {self.size}")
        out = np.array([self._free.popleft() for _ in range(n)], dtype=np.int64)
        self._held.update(out.tolist())
        return out

    def free(self, slots) -> None:
        """Give slots back (each one this allocator handed out and not yet freed; else ValueError)."""
        slots = [int(s) for s in np.asarray(slots).ravel()]
        stray = [s for s in slots if s not in self._held]
        if stray or len(set(slots)) != len(slots):
            raise ValueError(f"free of slots not held: {sorted(set(stray))[:5] or 'a slot given twice'}")
        self._held.difference_update(slots)
        if self.policy == "fifo":
            self._free.extend(slots)
        elif self.policy == "sorted":
            self._release.extend(slots)
        else:
            self._free.extendleft(reversed(slots))


def top1_chains(
    budget: int, depth: int, *, trees: int = 32, seed: int = 0, sharpness: float = 5.0
) -> list[np.ndarray]:
    """Tree indices of the top-1 chain (root excluded) of `trees` DDTrees built from synthetic top-k.

    Each array holds the index (1..budget) of the depth-1, depth-2, ... node of the chain that
    always takes the first child, as `kdlib.ref.build_tree_batch` numbers nodes (pop order).
    """
    k = max(1, min(budget, 16))  # 16 candidates per depth: wider rows only add low-score siblings
    ids, lps = synthetic_topk(seed, trees, depth, k, vocab_size=4096, draft_vocab=256, sharpness=sharpness)
    batch = build_tree_batch(ids, lps, budget)
    out = []
    for b in range(trees):
        chain, node = [], 0
        while True:
            node = int(batch.next_token[b, node])
            if node < 0:
                break
            chain.append(node)
        out.append(np.array(chain, dtype=np.int64))
    return out


def simulate(
    requests: int = 4,
    prompt_len: int = 512,
    new_tokens: int = 2048,
    budget: int = 32,
    depth: int = 15,
    accept_mean: float = 3.0,
    accepted=None,
    policy: str = "fifo",
    total: int | None = None,
    pool_slots: int | None = None,
    length_jitter: float = 0.5,
    seed: int = 0,
) -> Simulation:
    """Run the allocator through DDTree generation of `requests` concurrent requests.

    requests      requests decoding at once (continuous batching keeps this many running)
    total         requests to run in all (default 2 x requests: the second wave prefills into
                  a pool the first has churned)
    prompt_len    prompt tokens per request (allocated at its prefill in one call)
    new_tokens    mean generated tokens per request; each request draws its own length uniformly
                  in new_tokens x [1 - length_jitter, 1 + length_jitter] so requests finish apart
    budget, depth the tree: budget + 1 verify slots per step, chains at most `depth` deep
    accept_mean   mean tau (root + accepted drafts) when `accepted` is not given: tau is
                  geometric on 1, 2, ..., capped at the chain length + 1
    accepted      optional sample of tau values (e.g. a measured GenerateResult.accepted) to draw from
    pool_slots    pool size (default: 1.5x what the running requests need at their longest plus
                  one round of trees, so freed slots do get reused)
    Returns a Simulation whose tables are the finished requests' slot lists.
    """
    for name, v, lo in (
        ("requests", requests, 1),
        ("prompt_len", prompt_len, 0),
        ("new_tokens", new_tokens, 1),
        ("budget", budget, 1),
        ("depth", depth, 1),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not 0.0 <= length_jitter < 1.0:
        raise ValueError(f"length_jitter must lie in [0, 1), got {length_jitter}")
    if accepted is None and not accept_mean >= 1.0:
        raise ValueError(f"accept_mean must be >= 1 (tau counts the root), got {accept_mean}")
    sample = None
    if accepted is not None:
        raw = np.asarray(accepted)
        if raw.ndim != 1 or raw.size == 0 or raw.dtype.kind not in "iuf" or (raw != np.round(raw)).any():
            raise ValueError("accepted must be a non-empty 1-D sample of whole tau values >= 1 "
                             f"(got {raw.dtype} of shape {raw.shape})")
        sample = raw.astype(np.int64)
        if (sample < 1).any():
            raise ValueError("accepted must be a non-empty sample of tau values >= 1")
    total = 2 * requests if total is None else total
    if total < requests:
        raise ValueError(f"total ({total}) must be >= requests ({requests})")
    longest = prompt_len + math.ceil(new_tokens * (1 + length_jitter)) + depth + 1
    pool = pool_slots if pool_slots is not None else int(1.5 * requests * (longest + budget + 1))
    rng = np.random.Generator(np.random.PCG64(seed))
    chains = top1_chains(budget, depth, seed=seed)
    alloc = Allocator(pool, policy)

    def draw_tau(cap: int) -> int:
        if sample is not None:
            t = int(sample[rng.integers(sample.size)])
        else:
            t = int(rng.geometric(1.0 / accept_mean))
        return max(1, min(t, cap + 1))

    started, running, done, taus = 0, [], [], []

    def start():
        nonlocal started
        target = int(
            rng.integers(round(new_tokens * (1 - length_jitter)), round(new_tokens * (1 + length_jitter)) + 1)
        )
        running.append({"slots": list(alloc.alloc(prompt_len)) if prompt_len else [], "left": max(1, target)})
        started += 1

    while started < requests:
        start()
    while running:
        rows = budget + 1
        block = alloc.alloc(rows * len(running))  # one allocation for the whole batch's verify rows
        freed = []
        for i, req in enumerate(running):
            mine = block[i * rows : (i + 1) * rows]  # [budget + 1]: row 0 = root, row j = tree node j
            chain = chains[int(rng.integers(len(chains)))]
            tau = draw_tau(len(chain))
            keep = np.concatenate([[0], chain[: tau - 1]])
            mask = np.zeros(rows, dtype=bool)
            mask[keep] = True
            req["slots"].extend(mine[keep].tolist())  # accepted nodes keep their slots, in path order
            freed.append(mine[~mask])
            req["left"] -= tau
            taus.append(tau)
        alloc.free(np.concatenate(freed))
        for req in [r for r in running if r["left"] <= 0]:
            running.remove(req)
            done.append(np.array(req["slots"], dtype=np.int64))
            alloc.free(req["slots"])
            if started < total:
                start()
    params = {"requests": requests, "total": total, "prompt_len": prompt_len, "new_tokens": new_tokens,
              "budget": budget, "depth": depth, "accept_mean": None if accepted is not None else accept_mean,
              "realised_accept_mean": float(np.mean(taus)), "policy": policy,
              "length_jitter": length_jitter, "seed": seed}
    return Simulation(tables=done, accepted=taus, pool_slots=pool, params=params)


def layout_stats(slots, page: int = PAGE) -> dict:
    """How scattered one request's slots are.

    slots: [n] the slot of each position, in position order.
    runs            maximal stretches where the next position sits in the next slot
    mean_run        n / runs (n for a contiguous request)
    pages_touched   distinct page-`page` blocks (slot // page) the request reads
    pages_min       ceil(n / page): what a contiguous, page-aligned request would touch
    page_amplification  pages_touched / pages_min (1.0 = packed)
    page_fill       n / (pages_touched x page): the share of the touched blocks' rows that are its own
    """
    s = np.asarray(slots, dtype=np.int64).ravel()
    n = int(s.size)
    if n == 0:
        raise ValueError("layout_stats needs at least one slot")
    if page < 1:
        raise ValueError(f"page must be >= 1, got {page}")
    runs = 1 + int(np.count_nonzero(np.diff(s) != 1))
    touched = int(np.unique(s // page).size)
    pmin = math.ceil(n / page)
    return {"length": n, "runs": runs, "mean_run": n / runs, "pages_touched": touched, "pages_min": pmin,
            "page_amplification": touched / pmin, "page_fill": n / (touched * page)}


def summary(sim: Simulation, page: int = PAGE) -> dict:
    """Mean of `layout_stats` over the finished requests, plus the generated part alone.

    The prompt part of a request is allocated in one call, so it is as contiguous as the free
    list was at its prefill; `generated_*` isolate what decoding did.
    """
    p = sim.params["prompt_len"]
    whole = [layout_stats(t, page) for t in sim.tables]
    gen = [layout_stats(t[p:], page) for t in sim.tables if t.size > p]
    out = {k: float(np.mean([w[k] for w in whole])) for k in whole[0]}
    out.update(
        {
            f"generated_{k}": float(np.mean([g[k] for g in gen]))
            for k in ("length", "runs", "mean_run", "page_amplification", "page_fill")
        }
    )
    out["requests"] = len(sim.tables)
    out["mean_accepted"] = float(np.mean(sim.accepted))
    return out


def contiguous_table(length: int, start: int = 0) -> np.ndarray:
    """[length] int64 slots start, start+1, ...: the layout page_size > 1 (after KV moves) keeps."""
    return np.arange(start, start + length, dtype=np.int64)


def scattered_table(length: int, pool: int, seed: int = 0) -> np.ndarray:
    """[length] int64 distinct slots drawn uniformly from [0, pool): the worst case, no locality."""
    if pool < length:
        raise ValueError(f"pool ({pool}) must hold length ({length}) slots")
    return (
        np.random.Generator(np.random.PCG64(seed)).choice(pool, size=length, replace=False).astype(np.int64)
    )
