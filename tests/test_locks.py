"""adapters/locks.py `Turns`: served in the order asked, per key, each wait bounded, and never left
held by an exception or a KeyboardInterrupt, wherever it comes."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import pytest

from contextrender import locks
from contextrender.locks import Turns


def _holding(turns: Turns, key: str, taken: threading.Event, done: threading.Event) -> threading.Thread:
    """A thread that takes `key`'s turn and holds it until `done`."""
    def hold() -> None:
        with turns.turn(key, 10):
            taken.set()
            done.wait(10)
    thread = threading.Thread(target=hold)
    thread.start()
    assert taken.wait(5)
    return thread


def test_turns_are_served_in_the_order_asked():
    turns, order = Turns(), []
    taken, done = threading.Event(), threading.Event()
    holder = _holding(turns, "f", taken, done)

    def ask(n: int) -> None:
        with turns.turn("f", 10) as served:
            order.append((n, served))
    waiters = []
    for n in range(5):
        waiters.append(threading.Thread(target=ask, args=(n,)))
        waiters[-1].start()
        while turns.waiting("f") < n + 2:  # in the line before the next one asks
            time.sleep(0.001)
    done.set()
    for thread in [holder, *waiters]:
        thread.join(10)
    assert order == [(n, True) for n in range(5)]
    assert turns.waiting("f") == 0


def test_a_turn_on_one_file_does_not_wait_for_another_file():
    """The review of the first version: one turn for every store file of the process, so a write
    to an idle file waited 2.7-2.9 s behind a stuck write to another."""
    turns = Turns()
    taken, done = threading.Event(), threading.Event()
    holder = _holding(turns, "a.db", taken, done)
    try:
        started = time.monotonic()
        with turns.turn("b.db", 3) as served:
            assert served
        assert time.monotonic() - started < 0.5
    finally:
        done.set()
        holder.join(10)


def test_every_wait_ends_at_its_timeout_however_many_wait():
    """The review of the first version: five writers behind a stuck one, with a 1 s timeout, gave
    up at 1, 2, 3, 4 and 5 s (each waited its turn, then its own timeout). Each one's wait is its
    own timeout: all five end at about 1 s, holding nothing."""
    turns = Turns()
    taken, done = threading.Event(), threading.Event()
    holder = _holding(turns, "f", taken, done)
    ended: list[tuple[float, bool]] = []
    started = time.monotonic()

    def ask() -> None:
        with turns.turn("f", 1.0) as served:
            ended.append((time.monotonic() - started, served))
    waiters = [threading.Thread(target=ask) for _ in range(5)]
    for thread in waiters:
        thread.start()
    for thread in waiters:
        thread.join(10)
    try:
        assert [served for (_, served) in ended] == [False] * 5
        assert max(seconds for (seconds, _) in ended) < 1.6, ended
        assert turns.waiting("f") == 1  # the holder alone: the five left the line
    finally:
        done.set()
        holder.join(10)
    assert turns.waiting("f") == 0


class _Injected(KeyboardInterrupt):
    pass


def _interrupt_at(n: int):
    """A profile function that raises `_Injected` at the n-th point where Python would raise a
    KeyboardInterrupt in the code of a turn (adapters/locks.py, and contextlib's `with` around it):
    as a function starts, or as a call made from it returns."""
    seen = [0]
    mine = (locks.__file__, contextlib.__file__)

    def profile(frame, event, arg):
        if (event == "call" or event == "c_return") and frame.f_code.co_filename in mine:
            seen[0] += 1
            if seen[0] == n:
                raise _Injected
    return profile, seen


def test_an_interrupt_at_any_point_leaves_the_turn_free_and_passes_it_on():
    """A KeyboardInterrupt at each point of a turn where one can be raised, one run each, from the
    ask through the block and the leaving (the first version took the turn before the `try` that
    gave it back: an interrupt there left it held). After each, the turn is free, and a caller that
    was waiting behind gets it at once."""
    n = 0
    while True:
        n += 1
        turns = Turns()
        waiter_served, waiter_asked = threading.Event(), threading.Event()
        body = threading.Event()

        def waiter() -> None:
            waiter_asked.set()
            with turns.turn("f", 5) as served:
                if served:
                    waiter_served.set()
        profile, seen = _interrupt_at(n)
        thread = threading.Thread(target=waiter)
        interrupted = False
        sys.setprofile(profile)
        try:
            with turns.turn("f", 5):
                thread.start()
                while len(turns._lines.get("f", ())) < 2:  # (read here: no line of locks.py run)
                    time.sleep(0.001)
                body.set()
        except _Injected:
            interrupted = True
        finally:
            sys.setprofile(None)
        if not body.is_set() and not thread.is_alive():
            thread.start()  # interrupted before the block: the waiter asks of a free turn
        assert waiter_served.wait(2), f"interrupted at point {n}: the waiter was never served"
        thread.join(5)
        assert turns.waiting("f") == 0, f"interrupted at point {n}: a ticket is left in the line"
        with turns.turn("f", 0) as served:
            assert served, f"interrupted at point {n}: the turn is still held"
        if not interrupted:
            assert n > 20  # the run went through without an interrupt: every point was tried
            break


@pytest.mark.parametrize("timeout", [0.0, -1.0])
def test_a_free_turn_is_served_even_with_no_time_left(timeout):
    turns = Turns()
    with turns.turn("f", timeout) as served:
        assert served
