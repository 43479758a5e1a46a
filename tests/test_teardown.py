"""adapters/server/teardown.py: a big call's working set freed by reference counting, in slices,
after the server's request context closes (no full collection of the cyclic collector needed)."""

from __future__ import annotations

import subprocess
import sys

# A request context as the server's plugin makes it, a user root with a chain of `nodes` nodes
# under it (each an anchor and archetype in a cycle, each edge in one with its nodes), and a walker
# spawned in it that lists every node as visited and holds them in a field (as ingestion's walkers
# do), closed with the cyclic collector off: how many of the nodes are still alive once the close's
# slices are done, whether the first node (its root's edge reaches it) is as it was, and the
# collector's thresholds and the counted calls after, and whether the walker is still alive.
PROBE = """
import gc, sys, threading, weakref
from contextrender.jaclang_setup import import_jaclang
import_jaclang()
from contextrender.server.plugin import register_server
assert register_server()
from contextrender.server import teardown
teardown.UNTIE_AT_LEAST = int(sys.argv[2])
untie, third = teardown.untie_in_slices, []
def spy(anchors, turn):
    third.append(gc.get_threshold()[2])  # the collector's third threshold as the slices begin
    untie(anchors, turn)
teardown.untie_in_slices = spy
teardown._collect_when_idle = lambda: (0, 0.0)  # what reference counting frees, without the collection after
import jaclang.lib as L
from jaclang.jac0core.runtime import plugin_manager, JacRuntime
from contextrender import core

class Item(L.Node):
    pass

class Visitor(L.Walker):
    pass

if sys.argv[3] == "held":
    core.CALLS.hold_full_collections()  # a long call in progress
ctx = plugin_manager.hook.create_j_context(user_root=None, base_path_dir=None, full_target_path=None)
token = JacRuntime.push_request_context(ctx)
user = L.Root()
ctx.mem.put(user.__jac__)
ctx.user_root = user.__jac__
gc.disable()
walker = L.spawn(Visitor(), L.root())
first = previous = Item()
L.connect(L.root(), first)
refs, made = [], []
for i in range(int(sys.argv[1])):
    node = Item()
    L.connect(previous, node)
    refs.append(weakref.ref(node))
    made.append(node)
    walker.__jac__.path.append(node.__jac__)
    previous = node
walker.made = made
walker_alive = weakref.ref(walker)
del node, previous, made, walker
JacRuntime.reset_request_context(token)
thresholds = gc.get_threshold()
ctx.close()
for thread in threading.enumerate():
    if thread.name == "contextrender-untie":
        thread.join()
del ctx
print(sum(r() is not None for r in refs), first.__jac__.archetype is first and len(first.__jac__.edges) == 2,
      bool(third) and third[0] > thresholds[2], gc.get_threshold() == thresholds, core.CALLS.running, core.CALLS.holding,
      walker_alive() is not None, len(third))
"""


def probe(nodes: int, untie_at_least: int, tmp_path, held: bool = False) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE, str(nodes), str(untie_at_least), "held" if held else "-"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1].split()[:7]


def threads_untied(nodes: int, untie_at_least: int, tmp_path, held: bool = False) -> int:
    """How many times a probe's close handed anchors to the untying thread."""
    done = subprocess.run([sys.executable, "-c", PROBE, str(nodes), str(untie_at_least), "held" if held else "-"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.strip().splitlines()[-1].split()[7])


def test_a_big_working_set_is_freed_without_a_full_collection(tmp_path):
    """2,000 nodes (over a threshold of 1,000 anchors): every one freed by reference counting once
    the slices are done, the cyclic collector off throughout, though the request's walker listed
    and held them all (it is emptied and freed too); full collections were held from the close
    until then and are given back; the node its root's edge reaches is left as it was."""
    (alive, first_intact, held, given_back, running, holding, walker_alive) = probe(2000, 1000, tmp_path)
    assert (alive, walker_alive) == ("0", "False")
    assert first_intact == "True"
    assert (held, given_back, running, holding) == ("True", "True", "0", "0")


def test_an_ordinary_working_set_closes_as_before(tmp_path):
    """Under the threshold nothing is untied (the collector frees it as before) and nothing held."""
    (alive, first_intact, held, given_back, running, holding, walker_alive) = probe(200, 1000, tmp_path)
    assert (alive, walker_alive) == ("200", "True")
    assert (first_intact, held, given_back, running, holding) == ("True", "False", "True", "0", "0")


def test_an_ordinary_working_set_closed_while_a_long_call_runs_is_untied_at_once(tmp_path):
    """Full collections held (a long call in progress): an ordinary context's nodes and walker are
    freed by reference counting as it closes, without slices or a thread, and the hold is left as
    it was (the long call's)."""
    (alive, first_intact, held, given_back, running, holding, walker_alive) = probe(200, 1000, tmp_path, held=True)
    assert (alive, walker_alive) == ("0", "False")
    assert (first_intact, held, running, holding) == ("True", "False", "0", "1")


def test_a_mid_sized_working_set_closed_while_a_long_call_runs_is_untied_in_a_thread(tmp_path):
    """Full collections held: a context over UNTIE_SLICE anchors (under the big call's threshold)
    is untied slice by slice in a thread, not on the closing thread (the server's event loop);
    every node is freed all the same and the hold is left as it was."""
    (alive, first_intact, held, given_back, running, holding, walker_alive) = probe(1000, 10_000, tmp_path, held=True)
    assert (alive, walker_alive, first_intact, running, holding) == ("0", "False", "True", "0", "1")
    assert threads_untied(1000, 10_000, tmp_path, held=True) == 1
    assert threads_untied(200, 10_000, tmp_path, held=True) == 0


# A walker spawned with the server's plugin on but no request context (the process's own context):
# how many walkers that context's working set noted.
OUTSIDE_A_REQUEST = """
from contextrender.jaclang_setup import import_jaclang
import_jaclang()
from contextrender.server.plugin import register_server
assert register_server()
from contextrender.server import teardown
import jaclang.lib as L
from jaclang.jac0core.runtime import JacRuntime

class Visitor(L.Walker):
    pass

for _ in range(3):
    L.spawn(Visitor(), L.root())
print(len(getattr(JacRuntime.get_context().mem, teardown._WALKERS, None) or []))
"""


def test_a_walker_spawned_outside_a_request_is_not_kept(tmp_path):
    """The process's own context closes only at exit: walkers spawned in it (a job, an embedding
    process with the plugin on) are not noted, or they would live as long as the process."""
    done = subprocess.run([sys.executable, "-c", OUTSIDE_A_REQUEST], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "0"


def test_the_full_collection_after_the_slices_waits_for_a_moment_without_calls(monkeypatch):
    """What the slices leave to the cyclic collector is collected once, when no other call is in
    progress: not while one is, and at once when it ends."""
    import gc
    import threading
    import time
    from types import SimpleNamespace

    from contextrender import core
    from contextrender.server import teardown

    full: list[float] = []
    sliced = threading.Event()  # the slices are done: the pass is at its collection
    collect_when_idle = teardown._collect_when_idle

    def at_the_collection() -> tuple[int, float]:
        sliced.set()
        return collect_when_idle()

    monkeypatch.setattr(teardown, "_collect_when_idle", at_the_collection)

    def counted(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            full.append(time.monotonic())

    core.CALLS.enter()  # another call, in progress
    other_ended = None
    gc.callbacks.append(counted)
    try:
        turn = core.background_pass()
        pass_ = threading.Thread(target=teardown.untie_in_slices, args=([SimpleNamespace(archetype=None) for _ in range(10)], turn))
        pass_.start()
        assert sliced.wait(timeout=30)
        time.sleep(0.2)
        assert full == [], "a full collection ran while another call was in progress"
        other_ended = time.monotonic()
        core.CALLS.leave()
        pass_.join(timeout=10)
        assert not pass_.is_alive()
        assert len(full) == 1 and full[0] >= other_ended
    finally:
        gc.callbacks.remove(counted)
        if other_ended is None:
            core.CALLS.leave()
    assert core.CALLS.holding == 0


# Put on a real server's PYTHONPATH: each big close's untying spied on. Before the slices, weak
# references to the anchors it empties (not those left as they are) and to their archetypes; after
# the slices and a full collection, how many of each are still alive, and what holds the first few.
SPY = """import gc, os, sys, threading, time, weakref
def _spy(untie):
    def untie_in_slices(anchors, turn=None):
        from contextrender.server import teardown
        kept = teardown._left_as_they_are(anchors)
        emptied = [a for a in anchors if id(a) not in kept]
        refs = [weakref.ref(a) for a in emptied] + [weakref.ref(a.archetype) for a in emptied]
        del emptied
        untie(anchors, turn)
        gc.collect()
        alive = [r() for r in refs if r() is not None]
        held = sorted({type(h).__name__ for a in alive[:3] for h in gc.get_referrers(a) if h is not alive})
        with open(os.environ["TEARDOWN_SPY_LOG"], "a") as log:
            log.write(f"{len(refs)} {len(alive)} {','.join(held) or '-'}\\n")
    return untie_in_slices
def _install():
    while getattr(sys.modules.get("contextrender.server.teardown"), "untie_in_slices", None) is None:
        time.sleep(0.05)
    teardown = sys.modules["contextrender.server.teardown"]
    teardown.untie_in_slices = _spy(teardown.untie_in_slices)
    sys.modules["contextrender.core"].CALLS.hold_full_collections()  # every call's context is untied as it closes
threading.Thread(target=_install, daemon=True).start()
"""


def test_nothing_alive_holds_a_big_calls_anchors_and_its_session_reads_right_after(tmp_path):
    """A 4,000-message ingestion on the real server (over 10,000 anchors: its close empties them in
    slices): once the slices and a full collection are done, none of the anchors it emptied nor
    their archetypes is alive (nothing past the request holds one: no cache, no other request's
    context); then, with full collections held throughout (so every ordinary call's context is
    untied as it closes), the same session reads back whole, takes an append and renders what the
    in-process Engine renders from the same messages, and a small session made and read meanwhile
    reads right."""
    import time

    from contextrender import Engine
    from contextrender.client import Client
    from jacserver import JacServer

    (tmp_path / "spy").mkdir()
    (tmp_path / "spy" / "sitecustomize.py").write_text(SPY)
    log = tmp_path / "spy.log"
    big = [{"role": "user", "content": "Fix the failing test in the parser module."}]
    for i in range(2000):
        big += [{"role": "assistant", "content": "", "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
                    "name": "bash", "arguments": f'{{"cmd": "sed -n {i},{i + 9}p src/parser.py"}}'}}]},
                {"role": "tool", "tool_call_id": f"call_{i}", "content": f"{i}: def parse_{i}(tokens): return tokens[{i % 7}:]"}]
    added = [{"role": "assistant", "content": "parse_17 drops the first token; fixing it."}, {"role": "user", "content": "Go on."}]
    server = JacServer(tmp_path / "server", PYTHONPATH=str(tmp_path / "spy"), TEARDOWN_SPY_LOG=str(log)).start()
    try:
        with Client(server.url) as client:
            client.register("big-user", "secret-password-1")
            client.ingest("big", big)
            deadline = time.monotonic() + 120
            while not log.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            (spied, alive, held) = log.read_text().split()
            assert int(spied) > 2 * 10_000 and (alive, held) == ("0", "-")
            assert client.get_session("big", include_messages=True)["messages"] == big
            client.ingest("big", added, append=True)
            served = client.render("big", budget=2000)
            small = big[:7]
            for end in range(3, 8, 2):
                client.render("small", small[:end], budget=300)
            assert client.get_session("small", include_messages=True)["messages"] == small
            assert {s["session_id"] for s in client.list_sessions()} == {"big", "small"}
            assert client.get_session("big", include_messages=True)["messages"] == big + added
    finally:
        server.stop()
    engine = Engine(tmp_path / "engine")
    assert served.messages == engine.render("big", big + added, budget=2000).messages
