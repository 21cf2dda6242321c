"""tools/barrier_model.py: the attend kernels' synchronisation (versions 7-10 and 12, version 13's cluster
pair) and the stage-fill probe's push arm under random schedules, and mutants of them that the model must
refuse (a deadlock, an aliased phase, a named barrier passed twice, a swap stored or read out of turn, a copy
landed, pushed or read out of turn)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import barrier_model as bm  # noqa: E402

STREAMS = [[(1, True)], [(1, False)], [(3, True)], [(2, False), (1, True), (1, True), (3, False)],
           [(1, True)] * 4, [(5, True), (1, False)]]


@pytest.mark.parametrize("mixed", [False, True], ids=["v7", "v12"])
def test_every_schedule_finishes_and_keeps_the_rules(mixed):
    rng = random.Random(7)
    for groups in STREAMS:
        for _ in range(100):
            bm.run(bm.stream(groups), mixed, rng)
    for _ in range(300):
        bm.run(bm.random_stream(rng), mixed, rng)


def _roles(pairs, producer=None, consumer=None):
    producer = producer or (lambda: bm.producer(pairs, True))
    consumer = consumer or (lambda c: bm.consumer(c, pairs, True))
    return {0: producer, 1: lambda: consumer(0), 2: lambda: consumer(1)}


def _refused(pairs, roles, match, runs=200):
    rng = random.Random(3)
    with pytest.raises(bm.ProtocolError, match=match):
        for _ in range(runs):  # some schedule shows it
            bm.run(pairs, True, rng, roles)


def test_a_producer_that_arrives_on_rope8_only_with_rows_of_its_own_deadlocks():
    pairs = bm.stream([(1, True), (2, False)])

    def producer():  # the mutant: no ROPE8 arrival in a group without rows past 64
        n = -1
        for op in bm.producer(pairs, True):
            n += op[0] == "write_desc"
            if op[0] == "arrive" and op[1] in (("rope8", 0), ("rope8", 1)) and not pairs[n].r8:
                continue
            yield op

    _refused(pairs, _roles(pairs, producer=producer), "deadlock")


def test_consumers_that_never_arrive_on_qrope_deadlock_the_producer():
    pairs = bm.stream([(2, True)])

    def consumer(c):
        yield from (op for op in bm.consumer(c, pairs, True) if op != ("arrive", "qrope"))

    _refused(pairs, _roles(pairs, consumer=consumer), "deadlock")


def test_a_producer_that_fills_without_the_releases_runs_two_phases_ahead():
    pairs = bm.stream([(3, False)])

    def producer():
        yield from (op for op in bm.producer(pairs, True) if not (op[0] == "wait" and op[1][0] == "empty"))

    _refused(pairs, _roles(pairs, producer=producer), "phases on")


def test_a_consumer_without_its_syncs_passes_a_named_barrier_twice():
    pairs = bm.stream([(3, False)])

    def consumer(c):
        yield from (op for op in bm.consumer(c, pairs, True) if c == 1 or op[0] != "nb_sync" or op[1] == 4)

    _refused(pairs, _roles(pairs, consumer=consumer), "twice")


def test_a_producer_that_writes_its_descriptors_ahead_of_its_fills_overwrites_an_unread_one():
    pairs = bm.stream([(8, True)])

    def producer():  # the mutant: every descriptor written first, then the fills
        ops = list(bm.producer(pairs, True))
        yield from (op for op in ops if op[0] == "write_desc" or op[1][0] == "desc")
        yield from (op for op in ops if op[0] != "write_desc" and op[1][0] != "desc")

    _refused(pairs, _roles(pairs, producer=producer), "not read")


PAIR_STREAMS = [(1, 1), (1, 3), (3, 1), (2, 2), (4, 3)]  # each CTA's pairs


def _pair(n0, n1):
    return bm.stream([(n0, False)]), bm.stream([(n1, False)])


def test_version_13s_pair_finishes_and_keeps_the_rules():
    rng = random.Random(11)
    for n in PAIR_STREAMS:
        for _ in range(200):
            bm.run_pair(_pair(*n), rng)


def _pair_refused(consumer, match, runs=300):
    rng = random.Random(5)
    with pytest.raises(bm.ProtocolError, match=match):
        for _ in range(runs):  # some schedule shows it
            for n in PAIR_STREAMS:
                pairs = _pair(*n)
                bm.run_pair(pairs, rng, bm.pair_roles(pairs, consumer))


def _dropping(drop):
    """Version 13's consumers without the operation `drop` (a mutant)."""
    def consumer(c, pairs, r):
        yield from (op for op in bm.consumer(c, pairs, False, r) if op != drop)
    return consumer


def test_a_sender_that_does_not_wait_on_free_stores_over_the_peers_reads():
    _pair_refused(_dropping(("wait", "free", 0)), "while its consumers read it")


def test_consumers_that_arrive_on_their_own_free_let_the_sender_store_too_early():
    def consumer(c, pairs, r):
        for op in bm.consumer(c, pairs, False, r):
            yield ("arrive", "free") if op == ("arrive_peer", "free") else op

    _pair_refused(consumer, "while its consumers read it")


def test_a_receiver_that_does_not_wait_on_full_reads_the_swap_early():
    _pair_refused(_dropping(("wait", "full", 0)), "before the peer's stores landed")


def test_a_receiver_that_never_arms_full_deadlocks():
    _pair_refused(_dropping(("arrive", "full")), "deadlock")


def test_the_push_arm_finishes_and_keeps_the_rules():
    rng = random.Random(13)
    for fills in (1, 2, 3, 4, 7):
        for _ in range(300):
            bm.run_push(fills, rng)


def _push_refused(match, counts=None, runs=300, **mutants):
    """Some schedule of the push arm over 5 tiles, with mutant roles or counts, breaks match."""
    rng = random.Random(9)
    with pytest.raises(bm.ProtocolError, match=match):
        for _ in range(runs):
            bm.run_push(5, rng, bm.push_roles(5, **mutants), counts)


def _without(make, kind):
    """A push-arm role (rank, fills) with make's operations but those of `kind` (a mutant)."""
    def role(r, fills):
        yield from (op for op in make(r, fills) if op[0] != kind)
    return role


@pytest.mark.parametrize("role, make, kind, match", [
    ("sender", bm.push_sender, "wait", "before it landed"),  # pushes copies still in flight
    ("copier", bm.push_copier, "wait", "before its reader released|phases on"),  # lands over a stage read
    ("reader", bm.push_reader, "wait", "read stage"),  # reads a stage whose halves hold another fill
    ("sender", bm.push_sender, "expect", "deadlock"),  # the full barrier never completes
], ids=["sender-no-half-wait", "copier-no-release-wait", "reader-no-full-wait", "sender-no-expect"])
def test_push_roles_without_an_operation_are_refused(role, make, kind, match):
    _push_refused(match, **{role: _without(make, kind)})


def test_readers_that_release_only_their_own_stage_let_the_other_push_over_it():
    def reader(r, fills):
        for op in bm.push_reader(r, fills):
            yield ("release_own", op[1]) if op[0] == "release" else op

    counts = {**bm.PUSH_COUNTS, ("empty", 0): 1, ("empty", 1): 1}
    _push_refused("before its reader released", counts=counts, reader=reader)


def test_the_tool_exits_0_when_every_schedule_holds(capsys):
    assert bm.main(["--runs", "50"]) == 0
    out = capsys.readouterr().out
    assert "version 12: 50 random schedules finished" in out
    assert "version 13's pair: 50 random schedules finished" in out
    assert "the push arm: 50 random schedules finished" in out


@pytest.mark.parametrize("runs", ["0", "-5"])
def test_no_schedule_is_refused(runs, capsys):
    """--runs below 1 checked nothing and said every rule held."""
    with pytest.raises(SystemExit) as e:
        bm.main(["--runs", runs])
    assert e.value.code == 2 and "--runs must be >= 1" in capsys.readouterr().err
