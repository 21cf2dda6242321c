"""A model of the warp-specialised attend kernels' synchronisation, run under random schedules (no GPU).

    python3 tools/barrier_model.py [--runs N] [--seed S]       exit 0: every schedule finished cleanly

Versions 7-10's attend kernel (`kernels/tree_verify/wgmma_v7.cu`'s protocol), version 12's (`wgmma_v12.cu`:
the producer also computes the rows past 64, with its barriers QROPE and ROPE8) and version 13's cluster pair
(`wgmma_v13.cu`: two CTAs, each one job, whose ends swap half of O through the other's stage 0 on the
mbarriers FREE and FULL) are written here as what each warpgroup does to the CTA's barriers, pair by pair: the
producer and the two consumers, each a sequence of mbarrier arrivals and parity waits and of named-barrier
arrivals and syncs, with the kernel's counts (one unit a warpgroup: a consumer's four warps' arrivals count
one). A schedule runs any warpgroup whose next operation can go; it must end with all of them done. Checked on
the way:

* no deadlock: some warpgroup can always go until all are done;
* no aliased phase: a parity wait means one phase of its barrier (pair n's fill, job j's Q, ...), and the
  barrier is never two phases past it when the wait looks (the parity would then read as not yet done);
* each named barrier's generation is passed by the two consumers, one each (a consumer arriving twice in one
  would release the other's sync with the wrong pair);
* the pair-descriptor ring: the producer writes descriptor n only once both consumers read descriptor n - 4;
* version 13's swap: a sender stores into the other CTA's stage 0 only once both of that CTA's consumers are
  done reading it, no producer fills a stage 0 that holds a swap, and a receiver reads the swap only once the
  stores have landed.

It models order, not time or data: copies land at once, MMAs take no time. What each kernel's code does
between the operations is in its file; this model must change with it.

The push arm of the stage-fill probe (`kernels/gather_read/stage_v1.cu`, gather_stage_v1_push) is modelled
apart (`run_push`), with its copies as events that land later, in any order: two CTAs of a cluster both read
every tile; CTA r's copiers (two warps of its producer) copy rows 32 r .. 32 r + 31 of fill k into its stage
k % 2 once both CTAs' readers have released it (landing on the stage's half mbarrier); its pusher (another
warp's lane) waits for them to land, pushes them into the other CTA's stage (landing on that CTA's full
mbarrier as bytes: complete_tx), then expects the other's bytes on its own full; each reader waits on full,
reads, and releases the stage to both CTAs (their empty mbarrier: one unit from each reader).
Checked besides deadlocks and aliased phases: no copy lands in a stage before its reader has released the fill
two back; a push reads only a half that has landed; a reader reads only a stage whose two halves hold its
fill.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass, field

NDESC = 4  # the descriptor ring (NDESC in wgmma_ws.cuh)


@dataclass(frozen=True)
class Pair:
    """Pair i of a group of `pairs` pairs; r8: the group has rows past 64 (version 12's producer rows)."""

    i: int
    pairs: int
    r8: bool

    @property
    def first(self) -> bool:
        return self.i == 0

    @property
    def last(self) -> bool:
        return self.i == self.pairs - 1


def stream(groups: list[tuple[int, bool]]) -> list[Pair]:
    """A CTA's pairs: each group (pairs, r8) in turn."""
    return [Pair(i, n, r8) for n, r8 in groups for i in range(n)]


# mbarriers and their arrivals a phase (wgmma_ws.cuh's init_bars, V12Mix::init)
COUNTS = {**{("full", s, g): 1 for s in (0, 1) for g in (0, 1, 2)},  # the producer's fill of a group
          **{("empty", s, g): 2 if g == 2 else 1 for s in (0, 1) for g in (0, 1, 2)},  # V_L, V_R, rope
          "qfull": 1, "qempty": 2, "qrope": 2, ("rope8", 0): 1, ("rope8", 1): 1,
          **{("desc", d): 1 for d in range(NDESC)},
          "free": 2,  # version 13: the peer's two consumers, done reading this CTA's stage 0
          "full": 2}  # version 13: this receiver's expect_tx and the peer's stores landing


def producer(pairs: list[Pair], mixed: bool):
    """The producer warpgroup (produce / produce_v12)."""
    loads = 0
    for n, p in enumerate(pairs):
        if p.first:  # a new job (group): its Q once both consumers' S of the last one are done
            yield ("wait", "qempty", loads - 1)
            yield ("arrive", "qfull")
            loads += 1
        yield ("write_desc", n)
        yield ("arrive", ("desc", n % NDESC))
        for s in (0, 1):
            for g in (0, 1, 2):  # each group once its readers of pair n - 1 released it
                yield ("wait", ("empty", s, g), n - 1)
                yield ("arrive", ("full", s, g))
        if not mixed:
            continue
        if p.r8:
            if p.first:  # Q's rope block in the consumers' registers
                yield ("wait", "qrope", loads - 1)
            for s in (0, 1):  # issue_s8: the stage landed, its rope products done
                for g in (0, 1, 2):
                    yield ("wait", ("full", s, g), n)
                yield ("arrive", ("rope8", s))
        else:
            yield ("arrive", ("rope8", 0))
            yield ("arrive", ("rope8", 1))


def consumer(c: int, pairs: list[Pair], mixed: bool, rank: int | None = None):
    """Consumer warpgroup c (attend_v7's branch; Mix::on for version 12); rank: version 13's CTA in its pair,
    whose one job ends in pair_merge."""
    jobs = 0
    for n, p in enumerate(pairs):
        yield ("wait", ("desc", n % NDESC), n // NDESC)
        yield ("read_desc", n)
        if p.first:
            yield ("wait", "qfull", jobs)
            jobs += 1
            if mixed:
                yield ("arrive", "qrope")
        for g in (0, 1, 2):  # its S over its own stage c
            yield ("wait", ("full", c, g), n)
        if p.last:
            yield ("arrive", "qempty")
        if c == 0:
            if mixed:
                yield ("wait", ("rope8", 0), n)
            yield ("nb_arrive", 1)  # publish_p: NB_SCALE_A
            yield ("arrive", ("empty", 0, 0))  # pv_own_tile: V_AL, the rope block
            yield ("arrive", ("empty", 0, 2))
            if p.last and rank is not None:
                yield ("stage0_read",)  # its last read of stage 0
            yield ("nb_sync", 2)  # NB_SCALE_B
            yield ("nb_sync", 3)  # NB_PB
            yield ("arrive", ("empty", 1, 0))  # P_B V_BL done
            yield ("arrive", ("empty", 1, 2))
        else:
            yield ("nb_sync", 1)
            yield ("nb_arrive", 2)  # handoff(NB_SCALE_B)
            if mixed:
                yield ("wait", ("rope8", 1), n)
            yield ("nb_arrive", 3)  # publish_p: NB_PB
            yield ("arrive", ("empty", 0, 1))  # P_A V_AR done
            yield ("arrive", ("empty", 0, 2))
            if p.last and rank is not None:
                yield ("stage0_read",)
            yield ("arrive", ("empty", 1, 1))  # pv_own_tile: V_BR, the rope block
            yield ("arrive", ("empty", 1, 2))
        if p.last and rank is None:
            yield ("nb_sync", 4)  # job_end: NB_LSUM
        elif p.last:  # pair_merge
            yield ("arrive_peer", "free")  # this CTA's stage 0 read: the peer may store into it
            yield ("nb_sync", 4)  # job_sums: NB_LSUM
            if c != rank:  # the sender: its dims are the peer's to merge
                yield ("wait", "free", 0)
                yield ("store_peer",)  # st.async into the peer's stage 0, completing on its FULL
            else:
                yield ("arrive", "full")  # mbar_expect
                yield ("wait", "full", 0)
                yield ("read_swap",)


class ProtocolError(AssertionError):
    pass


@dataclass
class Cta:
    phase: dict = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    pending: dict = field(default_factory=lambda: dict(COUNTS))
    named: dict = field(default_factory=dict)  # id -> (generations ended, actors arrived in the current one)
    read: dict = field(default_factory=lambda: {1: -1, 2: -1})  # consumer actor -> last descriptor read
    peer: Cta | None = None  # version 13: the other CTA of the cluster
    done0: set = field(default_factory=set)  # version 13: consumers done reading stage 0
    swapped: bool = False  # version 13: the peer's stores have landed in stage 0

    def arrive(self, bar) -> None:
        self.pending[bar] -= 1
        if self.pending[bar] == 0:
            self.phase[bar] += 1
            self.pending[bar] = COUNTS[bar]

    def can(self, actor: int, op: tuple, joined: dict) -> bool:
        kind = op[0]
        if kind == "wait":
            _, bar, k = op
            if self.phase[bar] > k + 1:
                raise ProtocolError(f"{bar} is {self.phase[bar]} phases on, past the phase {k} waited for")
            return self.phase[bar] > k
        if kind == "nb_sync" and actor in joined:  # arrived already: waiting for the generation to end
            return self.named[op[1]][0] > joined[actor]
        if kind == "write_desc" and op[1] >= NDESC and min(self.read.values()) < op[1] - NDESC:
            # the kernel does not wait here: the producer's other waits must already order it
            raise ProtocolError(f"descriptor {op[1]} written over {op[1] - NDESC}, which a consumer has "
                                "not read")
        return True

    def do(self, actor: int, op: tuple, joined: dict) -> bool:
        """Carry op out; False where the actor stays on it (a sync it has joined)."""
        kind = op[0]
        if kind == "arrive":
            if self.swapped and op[1][:2] == ("full", 0):
                raise ProtocolError("the producer filled stage 0 over the swap")
            self.arrive(op[1])
        elif kind == "arrive_peer":
            self.peer.arrive(op[1])
        elif kind == "stage0_read":
            self.done0.add(actor)
        elif kind == "store_peer":
            if len(self.peer.done0) < 2:
                raise ProtocolError("stored into the peer's stage 0 while its consumers read it")
            self.peer.swapped = True
            self.peer.arrive("full")
        elif kind == "read_swap":
            if not self.swapped:
                raise ProtocolError("read the swap before the peer's stores landed")
        elif kind in ("nb_arrive", "nb_sync"):
            if actor in joined:  # its sync's generation has ended: on
                del joined[actor]
                return True
            gen, who = self.named.get(op[1], (0, ()))
            if actor in who:
                raise ProtocolError(f"named barrier {op[1]}: actor {actor} arrived twice in one generation")
            who = (*who, actor)
            done = len(who) == 2  # 256 threads: both consumers
            self.named[op[1]] = (gen + 1, ()) if done else (gen, who)
            if kind == "nb_sync" and not done:
                joined[actor] = gen  # it waits for this generation's end
                return False
        elif kind == "read_desc":
            self.read[actor] = op[1]
        return True


def run(pairs: list[Pair], mixed: bool, rng: random.Random, roles=None) -> None:
    """One random schedule of a CTA over `pairs`; ProtocolError on a deadlock or a broken rule."""
    make = roles or {0: lambda: producer(pairs, mixed), 1: lambda: consumer(0, pairs, mixed),
                     2: lambda: consumer(1, pairs, mixed)}
    gens = {a: f() for a, f in make.items()}
    nxt = {a: next(g, None) for a, g in gens.items()}
    cta, joined = Cta(), {}
    while any(op is not None for op in nxt.values()):
        ready = [a for a, op in nxt.items() if op is not None and cta.can(a, op, joined)]
        if not ready:
            raise ProtocolError("deadlock: " + ", ".join(f"{a}: {op}" for a, op in nxt.items() if op))
        a = rng.choice(ready)
        if cta.do(a, nxt[a], joined):
            nxt[a] = next(gens[a], None)


def pair_roles(pairs: tuple[list[Pair], list[Pair]], make_consumer=None) -> dict:
    """Version 13's warpgroups, (CTA rank, actor) -> generator maker: CTA r's producer and consumers over
    pairs[r]; make_consumer(c, pairs, rank) makes the consumers (a mutant's), else `consumer`."""
    cons = make_consumer or (lambda c, p, r: consumer(c, p, False, r))
    return {key: f for r in (0, 1) for key, f in (
        ((r, 0), lambda r=r: producer(pairs[r], False)),
        ((r, 1), lambda r=r: cons(0, pairs[r], r)),
        ((r, 2), lambda r=r: cons(1, pairs[r], r)))}


def run_pair(pairs: tuple[list[Pair], list[Pair]], rng: random.Random, roles=None) -> None:
    """One random schedule of version 13's cluster pair: CTA r over pairs[r], one job of version 7's
    consumers ending in pair_merge; ProtocolError on a deadlock or a broken rule. roles: `pair_roles`'."""
    gens = {a: f() for a, f in (roles or pair_roles(pairs)).items()}
    nxt = {a: next(g, None) for a, g in gens.items()}
    ctas, joined = (Cta(), Cta()), ({}, {})
    ctas[0].peer, ctas[1].peer = ctas[1], ctas[0]
    while any(op is not None for op in nxt.values()):
        ready = [a for a, op in nxt.items() if op is not None and ctas[a[0]].can(a[1], op, joined[a[0]])]
        if not ready:
            raise ProtocolError("deadlock: " + ", ".join(f"{a}: {op}" for a, op in nxt.items() if op))
        a = rng.choice(ready)
        if ctas[a[0]].do(a[1], nxt[a], joined[a[0]]):
            nxt[a] = next(gens[a], None)


# the push arm's mbarriers a CTA, units a phase: full (its producer's expect; the other's bytes as tx), half
# (its own copies landed), empty (each CTA's reader once)
PUSH_COUNTS = {**{("full", s): 1 for s in (0, 1)}, **{("half", s): 1 for s in (0, 1)},
               **{("empty", s): 2 for s in (0, 1)}}
PUSH_BYTES = 1  # the other CTA's half, as one unit of tx


def push_copier(rank: int, fills: int):
    """CTA rank's copiers in the push arm (push_copy: the producer's warps 0-1, one unit)."""
    for k in range(fills):
        s = k % 2
        if k >= 2:
            yield ("wait", ("empty", s), k // 2 - 1)  # fill k - 2 released by both CTAs' readers
        yield ("copy_own", k)  # cp.async of its 32 rows, landing on half (s)


def push_sender(rank: int, fills: int):
    """CTA rank's pusher in the push arm (push_send: one thread)."""
    for k in range(fills):
        s = k % 2
        yield ("wait", ("half", s), k // 2)
        yield ("push", k)  # the bulk copies into the other CTA's stage s, landing on its full (s)
        yield ("expect", ("full", s))  # its own arrival, and the other's half as tx


def push_reader(rank: int, fills: int):
    """CTA rank's reader warpgroup in the push arm."""
    for k in range(fills):
        s = k % 2
        yield ("wait", ("full", s), k // 2)
        yield ("read", k)
        yield ("release", k)  # on its own empty (s) and the other CTA's


@dataclass
class PushCta:
    rank: int
    counts: dict = field(default_factory=lambda: dict(PUSH_COUNTS))  # a mutant's counts where it changes them
    phase: dict = field(default_factory=lambda: dict.fromkeys(PUSH_COUNTS, 0))
    pending: dict = field(default_factory=dict)
    tx: dict = field(default_factory=lambda: {("full", 0): 0, ("full", 1): 0})
    held: dict = field(default_factory=dict)  # (stage, half) -> the fill whose rows it holds
    released: dict = field(default_factory=lambda: {0: -1, 1: -1})  # stage -> its reader's last fill released
    peer: PushCta | None = None

    def __post_init__(self):
        self.pending = dict(self.counts)

    def settle(self, bar) -> None:
        if self.pending[bar] == 0 and self.tx.get(bar, 0) == 0:
            self.phase[bar] += 1
            self.pending[bar] = self.counts[bar]

    def arrive(self, bar) -> None:
        self.pending[bar] -= 1
        self.settle(bar)

    def land(self, k: int, half: int) -> None:
        """Fill k's rows of `half` land in this CTA's stage k % 2."""
        s = k % 2
        if self.released[s] < k - 2:
            raise ProtocolError(f"fill {k} landed in stage {s} of CTA {self.rank} before its reader released "
                                f"fill {k - 2}")
        self.held[(s, half)] = k

    def can(self, op: tuple) -> bool:
        if op[0] != "wait":
            return True
        _, bar, k = op
        if self.phase[bar] > k + 1:
            raise ProtocolError(f"{bar} of CTA {self.rank} is {self.phase[bar]} phases on, past the phase "
                                f"{k} waited for")
        return self.phase[bar] > k

    def do(self, op: tuple, events: list) -> None:
        kind, k = op[0], op[1]
        if kind == "copy_own":
            events.append(("own", self, k))
        elif kind == "push":
            if self.held.get((k % 2, self.rank)) != k:
                raise ProtocolError(f"CTA {self.rank} pushed fill {k}'s half before it landed")
            events.append(("pushed", self, k))
        elif kind == "expect":  # op[1]: the barrier
            self.tx[op[1]] += PUSH_BYTES
            self.arrive(op[1])
        elif kind == "read":
            s = k % 2
            if self.held.get((s, 0)) != k or self.held.get((s, 1)) != k:
                raise ProtocolError(f"CTA {self.rank} read stage {s} for fill {k} holding fills "
                                    f"{self.held.get((s, 0))}, {self.held.get((s, 1))}")
        elif kind in ("release", "release_own"):  # release_own: a mutant's, on its own CTA's empty alone
            s = k % 2
            self.released[s] = k
            self.arrive(("empty", s))
            if kind == "release":
                self.peer.arrive(("empty", s))


def land_event(event: tuple) -> None:
    """An asynchronous copy lands: ("own", cta, k) its copies into its own stage, on its half barrier;
    ("pushed", cta, k) its half into the other CTA's stage, as tx on that CTA's full barrier."""
    kind, cta, k = event
    s = k % 2
    if kind == "own":
        cta.land(k, cta.rank)
        cta.arrive(("half", s))
    else:
        cta.peer.land(k, cta.rank)
        cta.peer.tx[("full", s)] -= PUSH_BYTES
        cta.peer.settle(("full", s))


PUSH_ROLES = {"copier": push_copier, "sender": push_sender, "reader": push_reader}


def push_roles(fills: int, **mutants) -> dict:
    """The push arm's actors, (CTA rank, role) -> generator maker; mutants: role -> a generator function
    (rank, fills) in place of PUSH_ROLES' (a mutant's)."""
    make = {**PUSH_ROLES, **mutants}
    return {(r, role): lambda r=r, role=role: make[role](r, fills) for r in (0, 1) for role in make}


def run_push(fills: int, rng: random.Random, roles=None, counts=None) -> None:
    """One random schedule of the push arm's cluster over `fills` tiles, its copies landing as events in any
    order; ProtocolError on a deadlock or a broken rule. roles: `push_roles`' (a mutant's); counts: the
    barriers' units a phase (PUSH_COUNTS, or a mutant's)."""
    gens = {a: f() for a, f in (roles or push_roles(fills)).items()}
    nxt = {a: next(g, None) for a, g in gens.items()}
    ctas = (PushCta(0, dict(counts or PUSH_COUNTS)), PushCta(1, dict(counts or PUSH_COUNTS)))
    ctas[0].peer, ctas[1].peer = ctas[1], ctas[0]
    events: list = []
    while any(op is not None for op in nxt.values()) or events:
        ready = [a for a, op in nxt.items() if op is not None and ctas[a[0]].can(op)]
        if not ready and not events:
            raise ProtocolError("deadlock: " + ", ".join(f"{a}: {op}" for a, op in nxt.items() if op))
        pick = rng.randrange(len(ready) + len(events))
        if pick >= len(ready):
            land_event(events.pop(pick - len(ready)))
            continue
        a = ready[pick]
        ctas[a[0]].do(nxt[a], events)
        nxt[a] = next(gens[a], None)


def random_stream(rng: random.Random) -> list[Pair]:
    """1-4 groups of 1-3 pairs, each with rows past 64 or not."""
    return stream([(rng.randint(1, 3), rng.random() < 0.6) for _ in range(rng.randint(1, 4))])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2000, help="random schedules of each kernel")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.runs < 1:
        ap.error(f"--runs must be >= 1 (no schedule checks nothing), got {a.runs}")
    rng = random.Random(a.seed)
    cases = [(name, lambda: random_stream(rng), lambda p, m=mixed: run(p, m, rng),
              lambda p: f"groups {[(q.pairs, q.r8) for q in p if q.first]}")
             for name, mixed in (("versions 7-10", False), ("version 12", True))]
    cases.append(("version 13's pair", lambda: tuple(stream([(rng.randint(1, 4), False)]) for _ in range(2)),
                  lambda p: run_pair(p, rng), lambda p: f"pairs {[len(q) for q in p]}"))  # one job a CTA
    cases.append(("the push arm", lambda: rng.randint(1, 6), lambda n: run_push(n, rng),
                  lambda n: f"{n} tiles"))
    return 0 if all(schedules(name, a.runs, make, go, what) for name, make, go, what in cases) else 1


def schedules(name: str, runs: int, make, go, what) -> bool:
    """`runs` random schedules of a protocol: each of a case make() run by go(case); the first broken rule
    printed with what(case) -> False, else one line that every rule held -> True."""
    for _ in range(runs):
        case = make()
        try:
            go(case)
        except ProtocolError as e:
            print(f"{name}: {e} ({what(case)})")
            return False
    print(f"{name}: {runs} random schedules finished, every rule held")
    return True


if __name__ == "__main__":
    sys.exit(main())
