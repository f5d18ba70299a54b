"""Final adapter files scanned for ``reduce``: each file's SHA-256 and whether it is a valid safetensors file.

:func:`scan` reads one file once through :func:`replayjob.tensorfile.scan` (no tensor built, nothing kept).
:class:`AdapterScans` overlaps that work with the reading of the evidence: ``reduce`` hands each replay's
adapter over as soon as its metrics are read (:meth:`AdapterScans.start`) and collects the scans when the
on-disk check asks (:meth:`AdapterScans.take`).

Where the scanning runs.  A thread does not help with many small files: each file is a handful of short
calls that need the interpreter lock back, and the reading thread holds it for its parsing, so two threads
run one after the other and slower than one (measured: 1,000 metrics files read while 1,000 adapters of
0.25 MiB are hashed took 314 ms on two threads, 264 ms on one, 191 ms in two processes).  The scanning runs
in a **forked copy of this process** instead (:class:`_Worker`): the paths go to it as they are handed over,
and its answers come back as JSON lines (no pickle), both through unnamed temporary files, so neither side
ever waits for the other.  When the scans are asked for, this process takes the files the worker has not
reached yet from the last one back, and stops the worker where the two meet.  The copy is only a helper: it
decides nothing, and whenever it cannot be used or does not answer (no ``fork``, other threads in this
process, crash points armed, a worker that died or wrote something that is not a scan), the files are
scanned here by the same :func:`scan`.

Example:
    >>> scans = AdapterScans()                                   # doctest: +SKIP
    >>> for r in replays: scans.start(r.final_adapter_file)      # doctest: +SKIP
    >>> sha256, error = scans.take(replays[0].final_adapter_file)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from replayjob import crashpoints, tensorfile
from replayjob.errors import ReplayjobError

Scan = tuple[str | None, str | None]  # (SHA-256 or None when unreadable, why it is not a valid safetensors file)

PARALLEL_HASH_BYTES = 32 * 1024 * 1024  # adapters adding up to less are hashed on one thread when asked at once
HASH_WORKERS = 4  # large adapter files hashed at once, at most (SHA-256 and reads release the GIL)
_SEP = b"\0"  # ends each path in the paths file: no path holds a NUL byte


def scan(path: Path) -> Scan:
    """One read of an adapter file: its SHA-256 (``None`` when unreadable) and, when the bytes are not a valid
    safetensors file, why."""
    try:
        scanned = tensorfile.scan(path, keep=False)
    except ReplayjobError:
        return None, None
    return scanned.sha256, None if scanned.error is None else scanned.error.message


def scan_all(paths: list[Path]) -> list[Scan]:
    """:func:`scan` of every path, in order; several files at once on threads when they are large together
    (then hashing, which releases the interpreter lock, is what each thread does)."""
    total = 0
    for p in paths:
        with contextlib.suppress(OSError):
            total += os.stat(p, follow_symlinks=False).st_size
    workers = min(HASH_WORKERS, os.cpu_count() or 1, len(paths))
    if workers < 2 or total < PARALLEL_HASH_BYTES:
        return [scan(p) for p in paths]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="replayjob-adapter-hash") as pool:
        return list(pool.map(scan, paths))


def _serve(paths_fd: int, bell_fd: int, answers_fd: int) -> None:
    """The worker: scan each path as soon as it is in the paths file, and append its answer (one JSON line) to
    the answers file; wait for the bell when there is none new."""
    offset, pending = 0, b""
    while True:
        new = os.pread(paths_fd, os.fstat(paths_fd).st_size - offset, offset)
        if not new:
            if not os.read(bell_fd, 1 << 12):  # rung after every hand-over; closed: nothing more will come
                return
            continue
        offset += len(new)
        *complete, pending = (pending + new).split(_SEP)
        for p in complete:
            line = json.dumps(scan(Path(os.fsdecode(p)))).encode() + b"\n"
            while line:
                line = line[os.write(answers_fd, line):]


class _Worker:
    """A forked copy of this process running :func:`_serve`.  Paths go to it through an unnamed temporary file
    (and a pipe that rings it awake), answers come back through another, read here at its own offsets: files
    never fill up, so neither side ever waits for the other to read, however many paths there are."""

    def __init__(self) -> None:
        self._paths = tempfile.TemporaryFile(prefix="replayjob-scans-")  # noqa: SIM115 - closed by stop()
        self._answers = tempfile.TemporaryFile(prefix="replayjob-scans-")  # noqa: SIM115 - closed by stop()
        bell_r, self._bell = os.pipe()
        try:
            self.pid = os.fork()
        except OSError:
            for fd in (bell_r, self._bell):
                os.close(fd)
            self._paths.close()
            self._answers.close()
            raise
        if self.pid == 0:  # the copy: never returns, never runs this process's exit handlers
            code = 1
            try:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.close(self._bell)
                _serve(self._paths.fileno(), bell_r, self._answers.fileno())
                code = 0
            finally:
                os._exit(code)
        os.close(bell_r)
        os.set_blocking(self._bell, False)
        self._offset = 0
        self._partial = b""
        self.answered: list[Scan] = []  # the answers so far, in the order the paths were sent

    def send(self, paths: list[Path]) -> None:
        """Hand ``paths`` over (appended to the paths file) and ring the worker awake; never blocks."""
        data = b"".join(os.fsencode(p) + _SEP for p in paths)
        while data:
            data = data[os.write(self._paths.fileno(), data):]
        with contextlib.suppress(BlockingIOError):  # a full pipe has rung already
            os.write(self._bell, b"\0")

    def poll(self) -> int:
        """Read the answers the worker has written since the last poll; how many there are now.  A line is
        taken only when it is whole and reads as a scan (a line still being written is left for later)."""
        fd = self._answers.fileno()
        new = os.pread(fd, os.fstat(fd).st_size - self._offset, self._offset)
        self._offset += len(new)
        data = self._partial + new
        *lines, self._partial = data.split(b"\n")
        for i, line in enumerate(lines):
            try:
                self.answered.append(_scan_of(json.loads(line)))
            except (ValueError, TypeError):  # not yet whole: read again from here next time
                self._partial = b"\n".join([*lines[i:], self._partial])
                break
        return len(self.answered)

    def stop(self) -> None:
        """Stop the worker and reap it; the answers read so far stay."""
        with contextlib.suppress(OSError):
            os.close(self._bell)
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.waitpid(self.pid, 0)
        self._paths.close()
        self._answers.close()


def _scan_of(value: object) -> Scan:
    if (not isinstance(value, list) or len(value) != 2
            or not all(v is None or isinstance(v, str) for v in value)):
        raise ValueError("not a scan")
    return value[0], value[1]


def _can_fork() -> bool:
    """A forked helper is safe and deterministic here: ``fork`` exists, no other thread could hold a lock the
    copy needs, and no crash point counts boundaries (the copy would count them too)."""
    return hasattr(os, "fork") and threading.active_count() == 1 and not crashpoints.armed()


class AdapterScans:
    """Adapter files scanned beside the reading of the evidence (the module docstring says where).

    :meth:`start` hands a path over (every :data:`BATCH` paths go to the worker together).  When the scans are
    first asked for, the paths the worker has not answered yet are shared: this process scans them from the
    last one back while the worker goes on from the front, until the two meet; then the worker is stopped.
    :meth:`take` returns a path's scan once; a path not handed over, or taken twice, is scanned when asked.
    :meth:`close` stops the worker (a refusal part-way)."""

    BATCH = 64

    def __init__(self) -> None:
        self._worker: _Worker | None = None
        self._sent: list[Path] = []
        self._batch: list[Path] = []
        self._answers: dict[Path, Scan] | None = None
        self._usable = _can_fork()

    def start(self, path: Path) -> None:
        """Queue ``path`` for scanning."""
        if self._usable and self._answers is None:
            self._batch.append(path)
            if len(self._batch) >= self.BATCH:
                self._send()

    def _send(self) -> None:
        if not self._batch:
            return
        try:
            if self._worker is None:
                self._worker = _Worker()
            self._worker.send(self._batch)
            self._sent += self._batch
        except OSError:  # no process, pipe or temporary file to spare: scan here when asked
            self._usable = False
            self.close()
        self._batch = []

    def _collect(self) -> dict[Path, Scan]:
        if self._answers is not None:
            return self._answers
        self._answers = {}
        worker, self._worker = self._worker, None
        if worker is None:
            return self._answers
        try:
            mine: list[Scan] = []
            end = len(self._sent)
            while worker.poll() < end:  # the unanswered tail, from its last path back, until the two meet
                end -= 1
                mine.append(scan(self._sent[end]))
            answered = worker.answered[:end] + mine[::-1]
        except OSError:  # the answers file failed: scan here when asked
            answered = []
        finally:
            worker.stop()
        self._answers = dict(zip(self._sent, answered, strict=False))
        return self._answers

    def take(self, path: Path) -> Scan:
        """The scan of ``path``: the one made beside the reading (once), else one made now."""
        found = self._collect().pop(path, None)
        return scan(path) if found is None else found

    def take_all(self, paths: list[Path]) -> list[Scan]:
        """:meth:`take` of every path, in order; those not scanned beside the reading scanned together
        (:func:`scan_all`: on threads when they are large)."""
        answers = self._collect()
        found = [answers.pop(p, None) for p in paths]
        rest = iter(scan_all([p for p, f in zip(paths, found, strict=True) if f is None]))
        return [next(rest) if f is None else f for f in found]

    def close(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
        self._batch.clear()
        self._answers = {}
