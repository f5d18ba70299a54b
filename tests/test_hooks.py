"""The step-hook protocol's shared background writer: order, errors, release (no model, no trainer)."""

from __future__ import annotations

import threading

import pytest

from replayjob.errors import RefusedError
from replayjob.rl.hooks import BackgroundWriter, StepHook, abandon_all


def test_jobs_run_in_order_on_the_writer_thread_and_errors_surface_at_drain() -> None:
    w = BackgroundWriter("test-writer")
    gate, seen = threading.Event(), []

    def job(i: int) -> None:
        gate.wait(30)
        seen.append((i, threading.current_thread().name))
        if i == 1:
            raise RefusedError("job 1 failed")

    for i in range(3):
        w.submit(lambda i=i: job(i))  # returns at once: the writer is held on the gate
    assert seen == []
    gate.set()
    with pytest.raises(RefusedError, match="job 1 failed"):
        w.drain()
    assert seen == [(0, "test-writer"), (1, "test-writer"), (2, "test-writer")]  # the job after an error ran
    assert not w.running
    w.release()  # idempotent
    with pytest.raises(RuntimeError, match="after the writer was released"):
        w.submit(lambda: None)


def test_release_finishes_handed_over_work_and_keeps_errors() -> None:
    w = BackgroundWriter("test-writer")
    done: list[int] = []
    w.submit(lambda: done.append(1))
    w.fail(RefusedError("found on the training thread"))
    w.release()
    assert done == [1] and [str(e) for e in w.errors] == ["found on the training thread"]
    assert "test-writer" not in {t.name for t in threading.enumerate()}


def test_the_protocol_defaults_and_abandon_all() -> None:
    class Counting(StepHook):
        abandoned = 0

        def abandon(self) -> None:
            Counting.abandoned += 1

    h = Counting()
    assert h.finish({}) == {} and h.wants_update_logprobs is False
    abandon_all([h, h])
    assert Counting.abandoned == 2
