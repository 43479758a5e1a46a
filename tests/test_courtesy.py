"""A long call giving way to the other calls of its process (engine/courtesy.jac): alone, or
short, or in-process, it never waits; past LONG seconds beside another call in progress it waits
after each SLICE of computing, at most WAIT at a time, and goes on as soon as the other call
ends. (The guard's count and turns: tests/test_guard.py.)"""

from __future__ import annotations

import threading
import time
import types

import pytest

from contextrender import core


@pytest.fixture
def courtesy():
    import engine.courtesy as courtesy

    assert courtesy.GIVE_WAY, "CONTEXTRENDER_GIVE_WAY is on unless set to 0"
    running = courtesy.CALLS.running
    token = courtesy.TURN.set(turn := courtesy.CallTurn())  # a server call's turn, as the guard gives it
    courtesy.CALLS.enter()  # and its count
    yield courtesy
    courtesy.TURN.reset(token)
    courtesy.CALLS.leave(turn)  # as the guard does: a long call's hold on full collections ends
    courtesy.CALLS.running = running


def _counted_sleeps(courtesy, monkeypatch) -> list[float]:
    """The seconds each wait of engine/courtesy.jac asks for, counted, not slept. Its own `time`
    only: the process's `time.sleep` patched would count (and spin) other threads' sleeps too, as
    pymongo's monitor threads left by an earlier test's clients did (0.5 s each, millions)."""
    sleeps: list[float] = []
    monkeypatch.setattr(courtesy, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=sleeps.append))
    return sleeps


def _compute_for(seconds: float) -> float:
    """Steps of a pass for `seconds` of computing; the seconds it took."""
    start = time.monotonic()
    busy = 0.0
    while busy < seconds:
        step = time.monotonic()
        while time.monotonic() - step < 0.0005:
            pass
        busy += time.monotonic() - step
        core.give_way()
    return time.monotonic() - start


def test_a_call_alone_never_waits(courtesy, monkeypatch):
    sleeps = _counted_sleeps(courtesy, monkeypatch)
    _compute_for(courtesy.LONG + 0.2)
    assert sleeps == []


def test_a_short_call_or_an_in_process_one_never_waits_beside_others(courtesy, monkeypatch):
    # Counted, not timed: on a loaded machine a short call's wall time says little (a call
    # preempted between its steps for LONG seconds is a long one by the clock, and gives way).
    sleeps = _counted_sleeps(courtesy, monkeypatch)
    courtesy.CALLS.enter()  # another call, in progress throughout
    try:
        _compute_for(courtesy.LONG * 0.3)
        assert sleeps == [], "a short call waited"
        token = courtesy.TURN.set(None)  # in-process: the Engine gives no turn
        try:
            _compute_for(0.3)
            assert sleeps == [], "an in-process call waited"
        finally:
            courtesy.TURN.reset(token)
    finally:
        courtesy.CALLS.leave()


class _Clock:
    """A clock of the pass's own: computing and sleeping advance it, nothing else, so what a pass
    waits is counted exactly, whatever the machine's load (`at`: a function called at a time,
    from within a wait; `waited`: the seconds waited, since `at`'s call once it was called)."""

    def __init__(self) -> None:
        self.now = time.monotonic()
        self.at: tuple | None = None
        self.waited = 0.0

    def monotonic(self) -> float:
        return self.now

    def compute(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.waited += seconds
        if self.at is not None and self.now >= self.at[0]:
            (_, then) = self.at
            self.at = None
            then()
            self.waited = 0.0  # from here on, what it waits after `then`


@pytest.fixture
def clock(courtesy, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(courtesy, "time", clock)
    turn = courtesy.TURN.get()
    (turn.first, turn.last) = (clock.now, clock.now)
    return clock


def _compute_on(clock: _Clock, seconds: float) -> float:
    """Steps of 0.5 ms of a pass for `seconds` of computing on `clock`; the seconds it took."""
    start = clock.now
    busy = 0.0
    while busy < seconds:
        clock.compute(0.0005)
        busy += 0.0005
        core.give_way()
    return clock.now - start


def test_a_long_call_waits_after_each_slice_and_at_most_wait(courtesy, clock):
    courtesy.CALLS.enter()  # another call, in progress throughout
    try:
        took = _compute_on(clock, courtesy.LONG + 0.1)
    finally:
        courtesy.CALLS.leave()
    slices = 0.1 / courtesy.SLICE
    # Past LONG, each slice was followed by a wait of WAIT (the other call never ended): the long
    # call got SLICE / (SLICE + WAIT) of the time.
    assert took == pytest.approx(courtesy.LONG + 0.1 + clock.waited)
    assert 0.9 * slices * courtesy.WAIT < clock.waited < 1.1 * slices * courtesy.WAIT


def test_it_goes_on_as_soon_as_the_other_call_ends(courtesy, clock):
    courtesy.CALLS.enter()
    clock.at = (clock.now + courtesy.LONG + 0.15, courtesy.CALLS.leave)
    took = _compute_on(clock, courtesy.LONG + 0.3)
    # Waiting only while the other call ran (until LONG + 0.15), then computing without a pause.
    assert clock.at is None and courtesy.CALLS.running == 1
    assert clock.waited == 0.0
    assert courtesy.LONG + 0.3 < took <= courtesy.LONG + 0.3 + 0.15


def _full_collections_while(make_garbage) -> int:
    """How many full collections Python's garbage collector started on its own while `make_garbage`
    ran, everything older out of its walks (as the server does once started: adapters/server/app.py).
    `make_garbage(n)` is given a count in proportion to the process's heap: Python 3.12 makes a full
    collection only once the objects moved to the old generation since the last one exceed a quarter
    of those that one kept (the whole heap here, frozen or not), larger in a whole test run than in
    this file alone."""
    import gc

    import engine.courtesy as courtesy

    for _ in range(5):
        full = []
        holds = {courtesy.CALLS.holding}

        def count(phase: str, info: dict) -> None:
            holds.add(courtesy.CALLS.holding)
            if phase == "start" and info["generation"] == 2:
                full.append(1)

        gc.collect()
        heap = len(gc.get_objects())
        gc.freeze()
        gc.callbacks.append(count)
        # Python's young threshold (an earlier test's Engine raised it for the process): the
        # count of young collections, and so of full ones, is then this file's alone.
        young = gc.get_threshold()[0]
        gc.set_threshold(courtesy.PYTHON_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        try:
            make_garbage(max(300_000, heap // 3))
        finally:
            gc.set_threshold(young, *gc.get_threshold()[1:])
            gc.callbacks.remove(count)
            gc.unfreeze()
        if len(holds) == 1:
            break
        # Another thread of the process (an earlier test's proxy storing an answer in-process)
        # took or left a hold of full collections meanwhile: measure again.
        time.sleep(0.5)
    return len(full)


def _cycles(n: int) -> None:
    """`n` pairs of allocations in cycles that survive young collections (what a big ingestion
    makes), kept until the end, so that the old generation grows past the collector's rule for a
    full collection."""
    kept = []
    for i in range(n):
        a, b = {}, {}
        a["b"], b["a"] = b, a
        kept.append(a)


def test_no_full_collection_runs_while_a_long_call_is_in_progress(courtesy):
    import gc

    # An earlier test's in-process ingestion still running in a thread (a proxy's answer) holds
    # full collections too (engine/courtesy.jac): let it end.
    deadline = time.monotonic() + 30
    while courtesy.CALLS.holding and time.monotonic() < deadline:
        time.sleep(0.05)
    thresholds = gc.get_threshold()
    # Without a long call the collector makes full collections over such garbage.
    assert _full_collections_while(_cycles) > 0
    turn = courtesy.TURN.get()
    _compute_for(courtesy.LONG + 0.01)  # past LONG: a long call from now on
    assert turn.long and courtesy.CALLS.holding == 1
    try:
        assert _full_collections_while(_cycles) == 0
        assert gc.get_threshold()[:2] == thresholds[:2]  # the young generations are collected as before
    finally:
        courtesy.CALLS.leave(turn)
    assert gc.get_threshold() == thresholds and courtesy.CALLS.holding == 0 and not turn.long
    assert _full_collections_while(_cycles) > 0


def test_collections_wait_for_the_last_of_several_long_calls(courtesy):
    import gc

    thresholds = gc.get_threshold()
    first, second = courtesy.CallTurn(), courtesy.CallTurn()
    courtesy.CALLS.hold_collections(first)
    courtesy.CALLS.hold_collections(first)  # once per call
    courtesy.CALLS.hold_collections(second)
    assert courtesy.CALLS.holding == 2
    courtesy.CALLS.enter()
    courtesy.CALLS.leave(first)
    assert gc.get_threshold()[2] == courtesy.HELD_FULL_THRESHOLD  # the second still runs
    courtesy.CALLS.enter()
    courtesy.CALLS.leave(second)
    assert gc.get_threshold() == thresholds and courtesy.CALLS.holding == 0


def test_a_background_pass_is_a_long_call_from_the_start(courtesy, monkeypatch):
    """A pass after a call answered (adapters/server/teardown.py): counted, full collections held
    until it ends, and it gives way at once beside another call (no LONG seconds first)."""
    import gc

    thresholds = gc.get_threshold()
    running = courtesy.CALLS.running
    turn = courtesy.background_pass()
    assert courtesy.CALLS.running == running + 1 and turn.long
    assert gc.get_threshold()[2] == courtesy.HELD_FULL_THRESHOLD
    sleeps = _counted_sleeps(courtesy, monkeypatch)
    token = courtesy.TURN.set(turn)
    try:
        turn.last = 0.0  # its last turn long past
        courtesy.give_way()  # the fixture's call is in progress beside it
    finally:
        courtesy.TURN.reset(token)
        monkeypatch.undo()
        courtesy.CALLS.leave(turn)
    assert sleeps, "it did not give way"
    assert courtesy.CALLS.running == running and gc.get_threshold() == thresholds


def test_an_in_process_call_leaves_the_collector_alone(courtesy):
    import gc

    thresholds = gc.get_threshold()
    token = courtesy.TURN.set(None)  # the Engine gives no turn: the host application's collector
    try:
        _compute_for(courtesy.LONG + 0.05)
        assert gc.get_threshold() == thresholds and courtesy.CALLS.holding == 0
    finally:
        courtesy.TURN.reset(token)


def test_long_calls_without_a_pause_still_get_a_full_collection_now_and_then(courtesy, monkeypatch):
    import gc

    turn = courtesy.TURN.get()
    _compute_for(courtesy.LONG + 0.01)
    assert turn.long
    monkeypatch.setattr(courtesy, "HOLD_AT_MOST", 0.05)
    assert _full_collections_while(lambda n: _compute_for(0.2)) >= 1  # made by give_way, the hold kept
    assert gc.get_threshold()[2] == courtesy.HELD_FULL_THRESHOLD


@pytest.fixture
def python_thresholds():
    """The process's collector as Python starts it (an earlier test's Engine raised the young
    threshold), given back as it was."""
    import gc

    import engine.courtesy as courtesy

    before = gc.get_threshold()
    gc.set_threshold(courtesy.PYTHON_YOUNG_THRESHOLD, *before[1:])
    yield courtesy
    gc.set_threshold(*before)


def test_a_serving_process_collects_its_young_generation_less_often(python_thresholds):
    import gc

    courtesy = python_thresholds
    middle, full = gc.get_threshold()[1:]
    core.serve_young_collections()
    assert gc.get_threshold() == (courtesy.YOUNG_THRESHOLD, middle, full)
    assert courtesy.YOUNG_THRESHOLD > courtesy.PYTHON_YOUNG_THRESHOLD
    core.serve_young_collections()  # a second Engine: the same
    assert gc.get_threshold() == (courtesy.YOUNG_THRESHOLD, middle, full)


def test_an_engine_raises_the_young_threshold_and_an_application_s_own_is_kept(python_thresholds, tmp_path):
    import gc

    from contextrender import Engine

    courtesy = python_thresholds
    Engine(tmp_path / "store").close()
    assert gc.get_threshold()[0] == courtesy.YOUNG_THRESHOLD
    gc.set_threshold(5, *gc.get_threshold()[1:])  # the host application's own
    Engine(tmp_path / "other").close()
    assert gc.get_threshold()[0] == 5


def test_the_young_threshold_and_the_hold_of_full_collections_keep_each_other(python_thresholds):
    import gc

    courtesy = python_thresholds
    thresholds = gc.get_threshold()
    courtesy.CALLS.hold_full_collections()  # a long call already in progress at the start
    try:
        core.serve_young_collections()
        assert gc.get_threshold() == (courtesy.YOUNG_THRESHOLD, thresholds[1], courtesy.HELD_FULL_THRESHOLD)
    finally:
        courtesy.CALLS.release_full_collections()
    # The hold gives back its third threshold only, not the young one it found.
    assert gc.get_threshold() == (courtesy.YOUNG_THRESHOLD, *thresholds[1:])
    courtesy.CALLS.hold_full_collections()
    try:
        assert gc.get_threshold() == (courtesy.YOUNG_THRESHOLD, thresholds[1], courtesy.HELD_FULL_THRESHOLD)
    finally:
        courtesy.CALLS.release_full_collections()
    assert gc.get_threshold() == (courtesy.YOUNG_THRESHOLD, *thresholds[1:])


def test_the_proxy_gives_python_s_young_threshold_back_and_keeps_an_application_s(python_thresholds):
    import gc

    courtesy = python_thresholds
    core.serve_young_collections()  # its Engine raised it
    core.serve_short_waits()
    assert gc.get_threshold()[0] == courtesy.PYTHON_YOUNG_THRESHOLD
    gc.set_threshold(courtesy.YOUNG_THRESHOLD, *gc.get_threshold()[1:])  # the host application's own
    core.serve_young_collections()
    core.serve_short_waits()
    assert gc.get_threshold()[0] == courtesy.YOUNG_THRESHOLD
