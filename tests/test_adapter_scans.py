"""Adapters scanned beside the reading (gate.adapter_scans.AdapterScans): the forked worker's scans are the files'
own, in any order of asking, and whenever the worker cannot answer the files are scanned here instead."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from replayjob import crashpoints
from replayjob.gate import adapter_scans as S
from replayjob.gate import synthetic


@pytest.fixture()
def files(tmp_path: Path) -> list[Path]:
    paths = []
    for i in range(7):
        p = tmp_path / f"a{i}.safetensors"
        p.write_bytes(synthetic.adapter_file(bytes([i]) * 64) if i != 3 else b"not a tensor file")
        paths.append(p)
    paths.append(tmp_path / "missing.safetensors")
    return paths


@pytest.fixture()
def forking(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Use the worker whatever threads the test runner keeps, and record each worker's pid."""
    monkeypatch.setattr(S, "_can_fork", lambda: True)
    pids: list[int] = []
    init = S._Worker.__init__

    def spy(self: S._Worker) -> None:
        init(self)
        pids.append(self.pid)

    monkeypatch.setattr(S._Worker, "__init__", spy)
    return pids


def test_worker_scans_are_the_files_own_in_any_order(files: list[Path], forking: list[int]) -> None:
    scans = S.AdapterScans()
    scans.BATCH = 3  # two full batches go while "reading", the rest when the first scan is asked for
    for p in files:
        scans.start(p)
    assert len(forking) == 1
    want = [S.scan(p) for p in files]
    assert want[3][0] is not None and want[3][1] is not None  # hashed, and refused as a safetensors file
    assert want[7] == (None, None)  # unreadable
    for i in (6, 0, 3, 7, 5, 1, 2, 4):
        assert scans.take(files[i]) == want[i]
    with pytest.raises(ChildProcessError):  # stopped and reaped: no zombie left
        os.waitpid(forking[0], 0)
    files[1].write_bytes(b"changed")
    assert scans.take(files[1]) == S.scan(files[1]) != want[1]  # taken twice: scanned again, not remembered
    scans.close()


def test_take_all_is_take_of_each(files: list[Path], forking: list[int]) -> None:
    scans = S.AdapterScans()
    for p in files[:5]:
        scans.start(p)
    assert scans.take_all(files) == [S.scan(p) for p in files]  # three never handed over: scanned here


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Record every scan made in this process from now on (the worker forked earlier keeps the real one)."""
    made: list[Path] = []
    real = S.scan
    monkeypatch.setattr(S, "scan", lambda path: made.append(path) or real(path))
    return made


def test_a_worker_that_dies_is_replaced_by_scanning_here(files: list[Path], forking: list[int],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    want = [S.scan(p) for p in files]
    scans = S.AdapterScans()
    for p in files:
        scans.start(p)
    scans._send()
    os.kill(forking[0], signal.SIGKILL)
    os.waitpid(forking[0], 0)
    assert scans._worker is not None
    answered = scans._worker.poll()  # what it finished before it died, if anything
    made = _counting(monkeypatch)
    assert scans.take_all(files) == want
    assert made == files[answered:][::-1]  # the rest scanned here, from the last file back


def test_the_unanswered_tail_is_scanned_here_from_the_back(files: list[Path], forking: list[int],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker still busy when the scans are asked for: this process takes the files it has not reached, from
    the last one back, and the worker is stopped where the two meet."""
    want = [S.scan(p) for p in files]
    real = S.scan
    monkeypatch.setattr(S, "scan", lambda path: time.sleep(0.5 if path.name == "a1.safetensors" else 0) or
                        real(path))
    scans = S.AdapterScans()
    for p in files:
        scans.start(p)
    scans._send()  # forked with the slow scan: it answers a0, then spends half a second on a1
    time.sleep(0.2)
    made = _counting(monkeypatch)
    assert scans.take_all(files) == want
    assert made and made[0] == files[-1] and files[0] not in made
    with pytest.raises(ChildProcessError):  # stopped and reaped
        os.waitpid(forking[0], 0)


def test_a_garbled_answer_is_not_trusted(files: list[Path], forking: list[int],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    want = [S.scan(p) for p in files]
    monkeypatch.setattr(S, "scan", lambda path: ["0" * 64, None, "extra"])
    scans = S.AdapterScans()
    for p in files:
        scans.start(p)
    scans._send()  # forked now, with the garbling scan
    monkeypatch.undo()
    assert scans.take_all(files) == want


def test_close_stops_the_worker_and_keeps_nothing(files: list[Path], forking: list[int]) -> None:
    scans = S.AdapterScans()
    scans.start(files[0])
    scans._send()
    scans.close()
    with pytest.raises(ChildProcessError):
        os.waitpid(forking[0], 0)
    assert scans.take(files[0]) == S.scan(files[0])  # nothing kept: scanned now


def test_no_worker_while_other_threads_run_or_crash_points_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked copy of a threaded process could inherit a lock another thread held; armed crash points would
    count the copy's boundaries too: in both cases the files are scanned in this process."""
    monkeypatch.setattr(S.threading, "active_count", lambda: 1)
    assert S._can_fork() is (hasattr(os, "fork") and not crashpoints.armed())
    monkeypatch.setattr(S.threading, "active_count", lambda: 2)
    assert S._can_fork() is False
    monkeypatch.setattr(S.threading, "active_count", lambda: 1)
    monkeypatch.setattr(crashpoints, "armed", lambda: True)
    assert S._can_fork() is False
