"""A long call giving way to the other calls of its process (engine/courtesy.jac): alone, or
short, or in-process, it never waits; past LONG seconds beside another call in progress it waits
after each SLICE of computing, at most WAIT at a time, and goes on as soon as the other call
ends. (The guard's count and turns: tests/test_guard.py.)"""

from __future__ import annotations

import threading
import time

import pytest

from contextrender import core


@pytest.fixture
def courtesy():
    import engine.courtesy as courtesy

    assert courtesy.GIVE_WAY, "CONTEXTRENDER_GIVE_WAY is on unless set to 0"
    running = courtesy.CALLS.running
    token = courtesy.TURN.set(courtesy.CallTurn())  # a server call's turn, as the guard gives it
    courtesy.CALLS.enter()  # and its count
    yield courtesy
    courtesy.TURN.reset(token)
    courtesy.CALLS.running = running


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


def test_a_call_alone_never_waits(courtesy):
    assert _compute_for(0.3) < 0.3 + 0.05


def test_a_short_call_or_an_in_process_one_never_waits_beside_others(courtesy):
    courtesy.CALLS.enter()  # another call, in progress throughout
    try:
        assert _compute_for(courtesy.LONG * 0.8) < courtesy.LONG * 0.8 + 0.03
        token = courtesy.TURN.set(None)  # in-process: the Engine gives no turn
        try:
            assert _compute_for(0.3) < 0.3 + 0.05
        finally:
            courtesy.TURN.reset(token)
    finally:
        courtesy.CALLS.leave()


def test_a_long_call_waits_after_each_slice_and_at_most_wait(courtesy):
    courtesy.CALLS.enter()  # another call, in progress throughout
    try:
        took = _compute_for(courtesy.LONG + 0.1)
    finally:
        courtesy.CALLS.leave()
    slices = 0.1 / courtesy.SLICE
    # Past LONG, each slice was followed by a wait of about WAIT (never more): the long call got
    # about SLICE / (SLICE + WAIT) of the time.
    waited = took - courtesy.LONG - 0.1
    assert 0.5 * slices * courtesy.WAIT < waited < 1.5 * slices * (courtesy.WAIT + courtesy.SLICE)


def test_it_goes_on_as_soon_as_the_other_call_ends(courtesy):
    courtesy.CALLS.enter()
    ended = threading.Timer(courtesy.LONG + 0.15, courtesy.CALLS.leave)
    ended.start()
    try:
        took = _compute_for(courtesy.LONG + 0.3)
    finally:
        ended.join()
    # Waiting only while the other call ran, then computing without a pause.
    assert took < courtesy.LONG + 0.3 + 0.15 + 0.1
