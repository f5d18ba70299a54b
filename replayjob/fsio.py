"""Atomic, crash-safe writes (temp file in the same directory, fsync, rename, fsync directory), and
the one guarded way to open a file an artifact names (regular files only, never blocking).

The symlink rule for reading artifacts: :func:`open_regular` (and every reader built on it:
:func:`read_regular_bytes`, :func:`replayjob.digest.sha256_file`, :mod:`replayjob.tensorfile`,
:func:`replayjob.jsonio.read_json`) never opens a file through a symbolic link unless the caller
passes ``follow_symlinks=True``, which only readers of files a user names directly do (configs,
specs, tolerance and budget files, a model's files); and :func:`check_no_symlinks` /
:func:`resolve_inside` refuse a path one of whose components *below* an artifact root (a replay,
capture or trace directory) is a symbolic link, a device, a FIFO or a socket.  The root itself and
its parents are not checked: the directory a user names may be reached through links (``/tmp`` on
macOS).

A reader therefore sees either nothing or a complete file.  Each boundary is a
:func:`replayjob.crashpoints.point` (``write.open``, ``write.temp``, ``write.half``, ``write.synced``,
``write.linked`` for exclusive writes, ``write.renamed``), so the kill tests can crash between any two.

``exclusive=True`` refuses to replace an existing destination (checked again at rename time with a
hard link, so two concurrent writers cannot both win).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

from replayjob.crashpoints import point
from replayjob.errors import (
    ArtifactExistsError,
    IntegrityError,
    OperationalError,
    RefusedError,
    ReplayjobError,
    UsageError,
)

_UMASK = os.umask(0)
os.umask(_UMASK)  # read once at import: artifacts get the process's usual file mode


def fsync_dir(path: str | Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# A write that fails with one of these decided nothing about the input: the device or filesystem
# failed (or filled up), so it is an error (exit 3, retryable), not a refusal.  Every other errno
# (permissions, a read-only mount, a directory in the way, a name too long) needs the user to change
# the output path: refused (exit 2).
_TRANSIENT = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.ENOMEM, errno.EAGAIN, errno.EINTR,
                        errno.ESTALE, errno.ETIMEDOUT})


def write_failure(exc: OSError, where: Path, action: str) -> ReplayjobError:
    """The domain error for an ``OSError`` raised while writing ``where``: see :data:`_TRANSIENT`."""
    reason = exc.strerror or str(exc)
    if exc.errno in _TRANSIENT:
        return OperationalError(f"{action}: {reason}", where=where,
                                hint="free space or fix the device, then run the command again")
    return RefusedError(f"{action}: {reason}", where=where, hint="check the output path and its permissions")


def _replaceable(dest: Path) -> None:
    """Refuse a destination that exists and is not a regular file: a rename would replace a device, FIFO,
    socket or symbolic link with a file (``--out /dev/null`` run as root would turn the device into a file)."""
    try:
        mode = os.lstat(dest).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise write_failure(exc, dest, "cannot examine the output path") from None
    if not stat.S_ISREG(mode):
        kind = ("a symbolic link" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode)
                else "a device, FIFO or socket")
        raise RefusedError(f"the output path is {kind}, not a regular file: writing would replace it", where=dest,
                           hint="name a new file or an existing regular file as the output")


def atomic_write_bytes(path: str | Path, data: bytes, *, exclusive: bool = False) -> None:
    """Write ``data`` to ``path`` atomically; with ``exclusive`` never replace an existing file."""
    dest = Path(path)
    if exclusive and dest.exists():
        raise ArtifactExistsError("refusing to overwrite an existing artifact", where=dest,
                                  hint="write to a new output directory or remove the old one")
    _replaceable(dest)
    point(f"write.open/{dest.name}")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
        os.fchmod(fd, 0o666 & ~_UMASK)  # the mode an ordinary create gets, not mkstemp's 0600
    except OSError as exc:
        raise write_failure(exc, dest.parent, "cannot create a file here") from None
    try:
        point(f"write.temp/{dest.name}")
        with os.fdopen(fd, "wb") as fh:
            view, half = memoryview(data), len(data) // 2  # no copy of large payloads
            fh.write(view[:half])
            fh.flush()
            point(f"write.half/{dest.name}")  # a crash here leaves a partial temp file
            fh.write(view[half:])
            fh.flush()
            os.fsync(fh.fileno())
        point(f"write.synced/{dest.name}")
        if exclusive:
            try:
                os.link(tmp, dest)  # fails if dest appeared meanwhile: exactly one writer wins
            except FileExistsError:
                raise ArtifactExistsError("another writer created this artifact first", where=dest,
                                          hint="write to a new output directory") from None
            point(f"write.linked/{dest.name}")  # destination complete, temp name still present
            os.unlink(tmp)
        else:
            os.replace(tmp, dest)
        point(f"write.renamed/{dest.name}")
        fsync_dir(dest.parent)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):  # disk full or a failing device: 3; a bad output path: 2
            raise write_failure(exc, dest, "cannot write") from None
        raise


def atomic_write_text(path: str | Path, text: str, *, exclusive: bool = False) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), exclusive=exclusive)


_LINK_HINT = "copy the file or directory into the artifact instead of linking to it"


def open_regular(path: str | Path, *, follow_symlinks: bool = False, what: str = "file") -> tuple[int, int]:
    """Open ``path`` read-only and return ``(fd, size)``, refusing anything but a regular file.

    The open never blocks (a FIFO would otherwise hang the reader) and the type is checked on the
    open descriptor, so a device, FIFO, socket or directory is refused before a byte is read.  A
    symbolic link as the last component is refused (``O_NOFOLLOW``) unless ``follow_symlinks``:
    only a file the user names directly (a config) may be one; the directories above it are the
    caller's to check (:func:`check_no_symlinks`).
    """
    point(f"read.open/{os.path.basename(path)}")  # crash boundaries for readers, too (e.g. reduce)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if not follow_symlinks and Path(path).is_symlink():
            raise IntegrityError(f"{what} is a symbolic link, not a regular file; symlinks inside artifacts "
                                 "are refused", where=path, hint=_LINK_HINT) from None
        raise IntegrityError(f"cannot open {what}: {exc.strerror}", where=path, hint="check the path") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise IntegrityError(f"{what} is not a regular file (a directory, device or FIFO)", where=path)
    return fd, st.st_size


def read_regular_bytes(path: str | Path, *, max_bytes: int, follow_symlinks: bool = False,
                       what: str = "file") -> bytes:
    """All bytes of a regular file of at most ``max_bytes``, read through one descriptor (a symbolic link
    refused unless ``follow_symlinks``, see :func:`open_regular`)."""
    fd, size = open_regular(path, follow_symlinks=follow_symlinks, what=what)
    try:
        if size > max_bytes:
            raise IntegrityError(f"{what} is {size} bytes, above the {max_bytes}-byte limit", where=path)
        chunks, got = [], 0
        while True:
            b = os.read(fd, min(max_bytes + 1 - got, 8 * 1024 * 1024))
            if not b:
                break
            chunks.append(b)
            got += len(b)
            if got > max_bytes:
                raise IntegrityError(f"{what} grew past the {max_bytes}-byte limit while being read", where=path)
    except OSError as exc:
        raise IntegrityError(f"cannot read {what}: {exc.strerror}", where=path) from None
    finally:
        os.close(fd)
    return b"".join(chunks)


def check_no_symlinks(root: str | Path, path: str | Path, *, what: str = "artifact file") -> Path:
    """Return ``path`` unless a component of it below ``root`` is a symbolic link, device, FIFO or socket.

    ``path`` must be ``root`` or lie lexically below it (``root / relative``, no ``..``).  Each
    component after ``root`` is examined with ``lstat`` (never followed), from the top down: a link
    anywhere (a linked ``final_adapter/``, ``trace/`` or ``rank-1/`` directory, or a linked file) is
    refused, as is a component above the last that is not a directory, and a last component that is
    neither a regular file nor a directory.  The walk stops quietly at the first component that does
    not exist (the open that follows reports the missing file).  ``root`` itself and its parents are
    not examined: the directory a user names may be reached through links.
    """
    r = root if isinstance(root, Path) else Path(root)
    p = path if isinstance(path, Path) else Path(path)
    rs, ps = str(r), str(p)  # both as pathlib spells them (normalised): the common case costs no path objects
    if rs != "/" and ps.startswith(rs + "/"):
        parts: tuple[str, ...] | list[str] = ps[len(rs) + 1:].split("/")
    elif ps == rs:
        parts = ()
    else:
        try:
            parts = p.relative_to(r).parts
        except ValueError:
            raise IntegrityError(f"{what} is not inside its artifact directory {r}", where=p) from None
    if ".." in parts:
        raise IntegrityError(f"{what} leaves its artifact directory through '..'", where=p)
    cur = rs
    for i, part in enumerate(parts):
        cur = os.path.join(cur, part)
        try:
            mode = os.lstat(cur).st_mode
        except FileNotFoundError:
            return p
        except OSError as exc:
            raise IntegrityError(f"cannot examine {what}: {exc.strerror}", where=cur) from None
        if stat.S_ISLNK(mode):
            raise IntegrityError(f"{what}: {part!r} is a symbolic link; symlinks inside artifacts are refused",
                                 where=cur, hint=_LINK_HINT)
        last = i == len(parts) - 1
        if not stat.S_ISDIR(mode) and not (last and stat.S_ISREG(mode)):
            kind = "regular file or directory" if last else "directory"
            raise IntegrityError(f"{what}: {part!r} is not a {kind} (devices, FIFOs and sockets are refused)",
                                 where=cur)
    return p


def refuse_unusable_out(out: Path) -> None:
    """Refuse (exit 2) an output directory that is a file, or lies below one (or below a dangling link), before
    anything runs: a run that had already built its model and updated it failed only when it wrote (exit 3).

    Each path is looked at once (one ``stat``): under torchrun another rank makes the directory meanwhile, and a
    look that found nothing, then something, read that new directory as something that is not one."""
    for p in (out, *out.parents):
        try:
            mode = os.stat(p).st_mode  # a link to a directory is one
        except FileNotFoundError:
            if os.path.islink(p):
                raise UsageError("the output directory is a link to nothing" if p == out else
                                 f"the output directory {str(out)!r} lies below a link to nothing", where=p,
                                 hint="choose a new --out directory") from None
            continue
        except OSError:  # below a file (its own path is looked at next), or not searchable: the write will say
            continue
        if stat.S_ISDIR(mode):
            return
        raise UsageError("the output directory is not a directory" if p == out else
                         f"the output directory {str(out)!r} lies below something that is not a directory",
                         where=p, hint="choose a new --out directory")
