"""IoThreads keeps the part of ThreadPoolExecutor's contract the store relies on (StoreState.submit_io,
close()): results and exceptions travel in the Future, shutdown cancels what has not started and runs
its done callbacks, a submit after shutdown raises RuntimeError, and its threads are daemons."""

import threading

import pytest

from sglang_cp.l3.io_threads import IoThreads


def test_results_exceptions_and_daemon_threads():
    io = IoThreads(2, "t-io")
    try:
        assert io.submit(lambda a, b: a + b, 2, 3).result(5) == 5
        fut = io.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            fut.result(5)
        names = [t for t in threading.enumerate() if t.name.startswith("t-io_")]
        assert len(names) == 2 and all(t.daemon for t in names)
    finally:
        io.shutdown(wait=True)
    assert not any(t.name.startswith("t-io_") for t in threading.enumerate())


def test_shutdown_cancels_queued_tasks_and_refuses_new_ones():
    io = IoThreads(1, "t-io2")
    gate, entered = threading.Event(), threading.Event()
    running = io.submit(lambda: (entered.set(), gate.wait(5)))
    assert entered.wait(5)
    queued = [io.submit(lambda: "ran") for _ in range(3)]
    called = []
    for f in queued:
        f.add_done_callback(called.append)
    io.shutdown(wait=False, cancel_futures=True)
    assert all(f.cancelled() for f in queued) and len(called) == 3  # callbacks ran (close() counts on them)
    with pytest.raises(RuntimeError):
        io.submit(lambda: None)
    gate.set()
    assert running.result(5)  # the task under way finishes
    io.shutdown(wait=True)  # idempotent; the thread ended
