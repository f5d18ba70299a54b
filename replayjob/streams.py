"""The command line's standard streams: every line reaches its reader when printed, and a reader that
went away never changes an exit code.

Two rules for every command, whatever the environment (no ``PYTHONUNBUFFERED`` needed):

- **Line-buffered.** A progress line ("waiting up to N s ...") shows in a Slurm or pod log, or a pipe,
  when it is printed, not when the process exits.
- **A closed output is not an error.** ``replayjob explain CONFIG | head -1`` exits with explain's own
  code: once a write to stdout or stderr finds its reader gone (``EPIPE``), that stream's descriptor
  is pointed at ``/dev/null`` and the rest of its output is dropped; no ``BrokenPipeError`` traceback,
  no exit code 120 from the interpreter's final flush.

:func:`guarded` installs both around one command and restores the previous streams afterwards, so an
in-process caller (a test capturing output) sees its own streams again.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO, cast

_GONE = (errno.EPIPE, errno.ECONNRESET)


def _reader_gone(exc: BaseException) -> bool:
    return isinstance(exc, BrokenPipeError) or (isinstance(exc, OSError) and exc.errno in _GONE)


class _Guarded(io.TextIOBase):
    """A text stream that forwards to ``inner`` and goes quiet once the reader has gone away."""

    def __init__(self, inner: TextIO) -> None:
        super().__init__()
        self._inner = inner
        self.gone = False

    def _silence(self) -> None:
        """The reader is gone: drop what follows, and let the interpreter's last flush succeed."""
        self.gone = True
        with contextlib.suppress(Exception):
            fd = self._inner.fileno()
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, fd)
            finally:
                os.close(null)

    def write(self, s: str) -> int:
        if not self.gone:
            try:
                try:
                    self._inner.write(s)
                except UnicodeEncodeError:  # a lone surrogate from a cluster object's text: shown escaped, never
                    enc = getattr(self._inner, "encoding", None) or "utf-8"  # a traceback that changes the code
                    self._inner.write(s.encode(enc, "backslashreplace").decode(enc))
                if "\n" in s:
                    self._inner.flush()
            except OSError as exc:
                if not _reader_gone(exc):
                    raise
                self._silence()
        return len(s)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._inner.flush()
            except OSError as exc:
                if not _reader_gone(exc):
                    raise
                self._silence()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return bool(self._inner.isatty())

    def fileno(self) -> int:
        return self._inner.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return cast(str, getattr(self._inner, "encoding", None))  # None for a StringIO, as it says

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return getattr(self._inner, "errors", None)

    def __getattr__(self, name: str) -> Any:  # buffer, reconfigure, ...: the real stream's
        return getattr(self._inner, name)


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """Line-buffered stdout and stderr that tolerate a closed reader, for the duration of one command."""
    saved = sys.stdout, sys.stderr
    sys.stdout = _Guarded(saved[0])
    sys.stderr = _Guarded(saved[1])
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        sys.stdout, sys.stderr = saved
