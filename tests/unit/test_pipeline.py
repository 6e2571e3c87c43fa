"""The push pipeline's pure parts (worker/pipeline.py): order, window, and the pool driver."""
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from shoal.errors import InvalidArgument
from shoal.worker.pipeline import Pipeline, PushWindow, push_order, window_from, worker_rank


def test_order_takes_servers_in_turn_and_staggers_by_rank():
    server_of = {0: "a", 1: "b", 2: "a", 3: "b"}
    assert push_order([0, 1, 2, 3], server_of, 0) == [0, 1, 2, 3]
    assert push_order([0, 1, 2, 3], server_of, 1) == [1, 0, 3, 2]
    assert push_order([0, 1, 2, 3], server_of, 2) == [0, 1, 2, 3]     # rank wraps around the servers


def test_order_with_contiguous_placement_interleaves_servers():
    server_of = {0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "b"}
    assert push_order(range(6), server_of, 0) == [0, 3, 1, 4, 2, 5]
    assert push_order(range(6), server_of, 1) == [3, 0, 4, 1, 5, 2]


def test_order_at_any_moment_ranks_push_to_different_servers():
    servers = ["s0", "s1", "s2", "s3"]
    server_of = {k: servers[k % 4] for k in range(8)}
    orders = [push_order(range(8), server_of, r) for r in range(4)]
    for i in range(8):
        assert len({server_of[o[i]] for o in orders}) == 4, f"position {i}: {[o[i] for o in orders]}"
    for o in orders:
        assert sorted(o) == list(range(8))


def test_order_uneven_servers_and_empty():
    server_of = {0: "a", 1: "a", 2: "a", 3: "b"}
    assert push_order([0, 1, 2, 3], server_of, 1) == [3, 0, 1, 2]
    assert push_order([], {}, 3) == []


def test_window_zero_sends_everything_at_once():
    w = PushWindow([0, 1, 2], 0)
    assert w.ready(2) == [2]
    assert w.ready(0) == [0]
    assert w.ready(1) == [1]
    assert w.in_flight == {0, 1, 2}


def test_window_holds_pushes_back_and_releases_in_order():
    w = PushWindow([1, 0, 3, 2], 2)
    # backward readies the last shards first
    assert w.ready(3) == [3]
    assert w.ready(2) == [2]
    assert w.ready(1) == []          # two unanswered: held
    assert w.ready(0) == []
    assert w.waiting == [1, 0]       # the order decides which goes next, not readiness
    assert w.answered(2) == [1]
    assert w.answered(3) == [0]
    assert w.answered(1) == []
    assert w.answered(0) == []
    assert w.started == [3, 2, 1, 0]
    assert w.done == {0, 1, 2, 3} and not w.in_flight


def test_window_answers_out_of_order():
    w = PushWindow([0, 1, 2, 3], 1)
    for k in (0, 1, 2, 3):
        w.ready(k)
    assert w.in_flight == {0}
    assert w.answered(0) == [1]
    assert w.answered(1) == [2]
    with pytest.raises(ValueError):
        w.answered(3)                # never started
    with pytest.raises(ValueError):
        w.ready(1)                   # once per step


def test_window_never_exceeds_its_size():
    w = PushWindow(list(range(10)), 3)
    live = set()
    for k in reversed(range(10)):
        live |= set(w.ready(k))
        assert len(w.in_flight) <= 3
    while w.in_flight:
        k = min(w.in_flight)
        w.answered(k)
        assert len(w.in_flight) <= 3
    assert sorted(w.started) == list(range(10))


def test_window_settings():
    assert window_from(2) == 2
    with pytest.raises(InvalidArgument, match="-1"):
        window_from(-1)
    with pytest.raises(InvalidArgument, match="must be >= 0"):
        PushWindow([0], -1)


def test_window_from_env(monkeypatch):
    monkeypatch.setenv("SHOAL_PUSH_WINDOW", "3")
    assert window_from(None) == 3
    monkeypatch.setenv("SHOAL_PUSH_WINDOW", "x")
    with pytest.raises(InvalidArgument, match="'x'"):
        window_from(None)
    monkeypatch.delenv("SHOAL_PUSH_WINDOW")
    assert window_from(None) == 0


def test_worker_rank():
    ids = ["worker-10", "worker-2", "worker-9"]
    assert worker_rank("worker-2", ids) == 0
    assert worker_rank("worker-10", ids) == 2
    assert worker_rank("worker-7", ids) == 0


def test_pipeline_runs_at_most_window_pushes_and_answers_before_freeing():
    pool = ThreadPoolExecutor(8)
    gates = {k: threading.Event() for k in range(4)}
    lock = threading.Lock()
    running, most, answered = set(), [0], []

    def push(k):
        def run():
            with lock:
                running.add(k)
                most[0] = max(most[0], len(running))
            gates[k].wait(10)
            with lock:
                running.discard(k)
            return f"reply{k}"
        return run

    pipe = Pipeline(pool, 2, on_answer=lambda k, r: answered.append((k, r)))
    futures = {k: pipe.launch(k, push(k), lambda: [0, 1, 2, 3]) for k in (3, 2, 1, 0)}
    for k in (3, 2, 1, 0):
        gates[k].set()
        assert futures[k].result(10) == f"reply{k}"
    assert pipe.end() == [3, 2, 0, 1]            # the two held back go in the order asked for
    assert most[0] <= 2
    assert sorted(answered) == [(k, f"reply{k}") for k in range(4)]
    pool.shutdown()


def test_pipeline_a_failed_push_frees_its_slot():
    pool = ThreadPoolExecutor(4)
    pipe = Pipeline(pool, 1)

    def boom():
        raise RuntimeError("gone")

    f0 = pipe.launch(0, boom, lambda: [0, 1])
    f1 = pipe.launch(1, lambda: "ok", lambda: [0, 1])
    with pytest.raises(RuntimeError, match="gone"):
        f0.result(10)
    assert f1.result(10) == "ok"
    pipe.end()
    pool.shutdown()


def test_pipeline_a_step_never_collected_does_not_block_the_next():
    pool = ThreadPoolExecutor(4)
    pipe = Pipeline(pool, 1)
    hold = threading.Event()
    pipe.launch(0, lambda: hold.wait(10), lambda: [0, 1])    # a skipped step: launched, never collected
    f = pipe.launch(0, lambda: "next", lambda: [0, 1])        # the next step pushes shard 0 again
    assert f.result(10) == "next"
    hold.set()
    pool.shutdown()
