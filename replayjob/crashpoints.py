"""Deterministic crash points for the kill tests: SIGKILL this process at the N-th named write boundary.

Writers call :func:`point` at each boundary where a crash leaves a distinct state on disk (a temp
file created, half written, synced, renamed into place, the directory synced).  Point names are
``<boundary>/<file name>``, e.g. ``write.synced/metrics.json``.

Two environment variables, read once at import (so an unset variable costs one ``None`` check):

* ``REPLAYJOB_FAULT_POINT=PATTERN:N`` -- on the N-th (1-based) call whose name matches the
  ``fnmatch`` pattern (alternatives separated by ``|``), the process sends itself SIGKILL.  ``*:7``
  kills at the 7th boundary of any kind; ``write.renamed/COMPLETE:1`` right after a bundle's
  completion marker is in place; ``write.*/COMPLETE|write.*/index.json:3`` counts only those two
  files' boundaries (useful when a background writer interleaves with the main thread).
* ``REPLAYJOB_FAULT_TRACE=FILE`` -- append every point name reached to FILE (one per line, flushed
  before any kill), so a test can count the points a command passes and choose which to kill.

A third, for the anomaly-trigger tests, plants a fault instead of killing:

* ``REPLAYJOB_FAULT_NONFINITE_GRAD=N`` -- the source trainer's update at step N sets one gradient
  element to NaN after the backward pass (before clipping), as a numerically broken step would.
  Only the source trainer asks (:func:`nonfinite_grad_at`); a replay never plants it.

Example:
    $ REPLAYJOB_FAULT_TRACE=/tmp/points replayjob train d/train.toml --out runs/a
    $ wc -l < /tmp/points            # 23 boundaries
    $ REPLAYJOB_FAULT_POINT='*:12' replayjob train d/train.toml --out runs/b   # killed at the 12th
"""

from __future__ import annotations

import fnmatch
import os
import signal

from replayjob.errors import UsageError

POINT_ENV = "REPLAYJOB_FAULT_POINT"
TRACE_ENV = "REPLAYJOB_FAULT_TRACE"
NONFINITE_GRAD_ENV = "REPLAYJOB_FAULT_NONFINITE_GRAD"


class _Armed:
    def __init__(self, spec: str | None, trace: str | None):
        self.pattern: str | None = None
        self.target = 0
        self.seen = 0
        self.trace = trace or None
        self.error: str | None = None
        if spec:
            pattern, sep, count = spec.rpartition(":")
            if not sep or not pattern or not count.isdigit() or int(count) < 1:
                self.error = f"{POINT_ENV}={spec!r} is not PATTERN:N with N >= 1"
            else:
                self.pattern, self.target = pattern, int(count)

    def hit(self, name: str) -> None:
        if self.error:  # reported at the first boundary, where the CLI can turn it into exit 2
            raise UsageError(self.error, hint="for example REPLAYJOB_FAULT_POINT='*:3', or unset it")
        if self.trace:
            fd = os.open(self.trace, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, (name + "\n").encode("utf-8"))
            finally:
                os.close(fd)
        if self.pattern is not None and any(fnmatch.fnmatchcase(name, p) for p in self.pattern.split("|")):
            self.seen += 1
            if self.seen == self.target:
                os.kill(os.getpid(), signal.SIGKILL)


_ARMED: _Armed | None = None


def armed() -> bool:
    """True when a fault variable is set: boundaries are being counted or traced in this process."""
    return _ARMED is not None


def configure(spec: str | None = None, trace: str | None = None) -> None:
    """(Re)arm from explicit values; ``configure()`` disarms.  Used by forked test children."""
    global _ARMED
    _ARMED = _Armed(spec, trace) if (spec or trace) else None


def point(name: str) -> None:
    """A crash boundary; does nothing unless a fault variable was set."""
    if _ARMED is not None:
        _ARMED.hit(name)


configure(os.environ.get(POINT_ENV), os.environ.get(TRACE_ENV))


def nonfinite_grad_at(step: int) -> bool:
    """True when ``REPLAYJOB_FAULT_NONFINITE_GRAD`` names ``step`` (read at each call: tests set it late)."""
    raw = os.environ.get(NONFINITE_GRAD_ENV)
    if raw is None:
        return False
    if not raw.isascii() or not raw.isdigit():
        raise UsageError(f"{NONFINITE_GRAD_ENV}={raw!r} is not a step number", hint="for example 4, or unset it")
    return int(raw) == step
