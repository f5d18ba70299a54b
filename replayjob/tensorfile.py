"""The one validated safetensors reader: every tensor file replayjob reads goes through here.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte span, then the data section.  Nothing in it is trusted, so before a single
tensor is built :func:`parse_header` checks that

* the file is at least 8 bytes and is not a pickle, zip or NumPy file (a ``torch.save`` file
  renamed ``.safetensors`` is refused by name: pickle is never loaded);
* the header length is positive, at most :data:`MAX_HEADER_BYTES` and inside the file;
* the header is strict JSON (:func:`replayjob.jsonio.loads_strict`: duplicate tensor names,
  invalid UTF-8, NaN literals and deep nesting refused) holding one object;
* every dtype is on an allow-list, every shape is a list of non-negative integers, and
  ``prod(shape) * itemsize`` equals the tensor's byte span;
* the spans, sorted, are in range, do not overlap, and cover the data section exactly.

A pinned SHA-256 is checked over the same bytes that are parsed (one read, no second open), and
only then are tensors built -- by ``safetensors.torch.load`` for a whole file in memory (at most
2 GiB by default), or from each validated span, one tensor at a time: :class:`TensorReader` (what
``reduce`` uses on adapters) and the streaming :func:`iter_tensors`.

Example:
    >>> import torch, tempfile, pathlib
    >>> from safetensors.torch import save
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "w.safetensors"
    >>> _ = p.write_bytes(save({"w": torch.zeros(2, 3)}))
    >>> sorted(read_header(p).tensors), load(p)["w"].shape
    (['w'], torch.Size([2, 3]))
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replayjob.digest import normalize_digest
from replayjob.errors import IntegrityError
from replayjob.fsio import open_regular
from replayjob.jsonio import loads_strict

if TYPE_CHECKING:
    import torch

MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_RANK = 16
# safetensors dtype -> bytes per element; the allow-list every reader starts from.
ITEMSIZE: dict[str, int] = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8,
                            "F16": 2, "BF16": 2, "F32": 4, "F64": 8}
_HINT = "regenerate the file with replayjob; it is not a valid safetensors file"
_PICKLE_HINT = "convert it with safetensors.torch.save_file in a trusted environment; pickle is never loaded"
_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class TensorSpec:
    """One header entry; ``begin``/``end`` are offsets into the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A validated header: ``data_start`` is the absolute offset of the data section."""

    where: str
    file_size: int
    data_start: int
    metadata: dict[str, str]
    tensors: dict[str, TensorSpec] = field(default_factory=dict)

    def in_file_order(self) -> list[TensorSpec]:
        return sorted(self.tensors.values(), key=lambda s: (s.begin, s.end))


def _fail(where: str, message: str, hint: str = _HINT) -> IntegrityError:
    return IntegrityError(f"safetensors refused: {message}", where=where, hint=hint)


def refuse_pickle(prefix: bytes, where: str | Path) -> None:
    """Refuse, by name, the containers that can carry pickle (zip, pickle stream, NumPy) from the first
    bytes (pass at least 9 when the file has them); for readers that parse safetensors themselves."""
    _sniff(bytes(prefix[:9]), str(where))


def _sniff(prefix: bytes, where: str) -> None:
    """Refuse the containers that can carry pickle before the length is even decoded.

    A pickle stream starts ``\\x80`` then its protocol (2-5), which is also how a header length of
    640, 896, 1152 or 1408 bytes (plus any multiple of 65536) starts; a safetensors header always
    opens with ``{`` at byte 8, so a file that has it there is read as safetensors, not named pickle.
    """
    if prefix[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        raise _fail(where, "this is a zip archive (a torch.save file?), not safetensors; "
                           "pickle is never loaded", _PICKLE_HINT)
    if (prefix[:1] == b"\x80" and prefix[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
            and prefix[8:9] != b"{"):
        raise _fail(where, "this is a pickle stream, not safetensors; pickle is never loaded", _PICKLE_HINT)
    if prefix[:6] == b"\x93NUMPY":
        raise _fail(where, "this is a NumPy .npy file, not safetensors", _PICKLE_HINT)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_header(prefix: bytes, file_size: int, *, where: str | Path = "<safetensors>",
                 dtypes: frozenset[str] | set[str] | None = None,
                 max_header_bytes: int = MAX_HEADER_BYTES) -> Header:
    """Validate a header; ``prefix`` holds at least the first ``8 + header length`` bytes."""
    w = str(where)
    allowed = set(ITEMSIZE) if dtypes is None else set(dtypes) & set(ITEMSIZE)
    if file_size < 8 or len(prefix) < 8:
        _sniff(prefix, w)
        raise _fail(w, f"truncated: {file_size} bytes, but the file must start with an 8-byte header length")
    _sniff(prefix, w)
    (n,) = struct.unpack("<Q", prefix[:8])
    if n < 2:
        raise _fail(w, f"header length is {n}; an empty header is not a safetensors file")
    if n > max_header_bytes:
        raise _fail(w, f"header declares {n} bytes, above the {max_header_bytes}-byte header limit")
    if 8 + n > file_size:
        raise _fail(w, f"header length {n} is larger than the file ({file_size - 8} bytes follow it); "
                       "the file is truncated or corrupt")
    if len(prefix) < 8 + n:
        raise _fail(w, "header is incomplete in the bytes read")  # a caller bug; never for files
    raw = prefix[8:8 + n]
    if raw[:1] != b"{":
        raise _fail(w, "header does not start with '{'")
    try:
        doc = loads_strict(raw, where=w)
    except IntegrityError as exc:
        msg = exc.message.replace("duplicate key", "duplicate tensor name")
        raise _fail(w, f"header is not strict JSON ({msg})") from None
    if not isinstance(doc, dict):
        raise _fail(w, "header is not a JSON object")
    meta = doc.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _fail(w, "__metadata__ must map strings to strings")
    body = file_size - 8 - n
    tensors: dict[str, TensorSpec] = {}
    for name, entry in doc.items():
        tensors[name] = _spec(name, entry, body, allowed, w)
    pos = 0
    for spec in sorted(tensors.values(), key=lambda s: (s.begin, s.end)):
        if spec.begin < pos:
            raise _fail(w, f"tensor {spec.name!r} bytes [{spec.begin}, {spec.end}) overlap the previous tensor "
                           f"(which ends at {pos})")
        if spec.begin > pos:
            raise _fail(w, f"{spec.begin - pos} unaccounted bytes before tensor {spec.name!r} at {pos}")
        pos = spec.end
    if pos != body:
        raise _fail(w, f"the data section has {body} bytes, the tensors cover {pos}")
    return Header(w, file_size, 8 + n, dict(meta), tensors)


def _spec(name: str, entry: Any, body: int, allowed: set[str], w: str) -> TensorSpec:
    if not name:
        raise _fail(w, "a tensor has an empty name")
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise _fail(w, f"tensor {name!r} must have exactly dtype, shape and data_offsets")
    dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in allowed:
        raise _fail(w, f"tensor {name!r} has dtype {dtype!r}; allowed here: {', '.join(sorted(allowed))}")
    if (not isinstance(shape, list) or len(shape) > MAX_RANK
            or not all(_is_int(d) and d >= 0 for d in shape)):
        raise _fail(w, f"tensor {name!r} shape {shape!r} is not a list of at most {MAX_RANK} "
                       "non-negative integers")
    if not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(x) for x in offs):
        raise _fail(w, f"tensor {name!r} data_offsets {offs!r} are not two integers")
    begin, end = offs
    if not 0 <= begin <= end <= body:
        raise _fail(w, f"tensor {name!r} data_offsets [{begin}, {end}] are out of range of the "
                       f"{body}-byte data section")
    need = math.prod(shape) * ITEMSIZE[dtype]
    if end - begin != need:
        raise _fail(w, f"tensor {name!r} shape {shape} x {ITEMSIZE[dtype]} bytes ({dtype}) is {need} bytes, "
                       f"its span holds {end - begin}")
    return TensorSpec(name, dtype, tuple(shape), begin, end)


def _open_regular(path: str | Path, follow_symlinks: bool) -> tuple[int, int]:
    return open_regular(path, follow_symlinks=follow_symlinks, what="tensor file")


def _read_exact(fd: int, offset: int, n: int, where: str) -> bytes:
    """``n`` bytes at ``offset``; one ``pread`` (no copy) unless the kernel returns less."""
    first = os.pread(fd, n, offset) if n else b""
    if len(first) == n:
        return first
    chunks, got = [first], len(first)
    while got < n:
        b = os.pread(fd, min(n - got, _CHUNK), offset + got)
        if not b:
            raise _fail(where, f"file ended after {offset + got} bytes while reading; it changed or is truncated")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _read_prefix(fd: int, size: int, where: str) -> bytes:
    """The first ``8 + header length`` bytes when that fits the limit and the file, else at most 8."""
    head8 = _read_exact(fd, 0, min(size, 8), where) if size else b""
    if len(head8) == 8:
        (n,) = struct.unpack("<Q", head8)
        if 8 + n <= min(size, 8 + MAX_HEADER_BYTES):
            return _read_exact(fd, 0, 8 + n, where)
    return head8


def _bad_bool(data: bytes) -> bool:
    return bool(data.translate(None, b"\x00\x01"))


def _bool_error(where: str, name: str) -> IntegrityError:
    return _fail(where, f"tensor {name!r} is BOOL but holds bytes other than 0 and 1")


def _check_pin(actual: str, expected: str | None, where: str) -> None:
    if expected is None:
        return
    pin = normalize_digest(expected, what="the pinned tensor-file SHA-256")
    if actual != pin:
        raise IntegrityError(f"SHA-256 is {actual}, the pin is {pin}", where=where,
                             hint="the file changed after it was pinned, or the pin belongs to another file")


def read_header(path: str | Path, *, dtypes: frozenset[str] | set[str] | None = None,
                follow_symlinks: bool = True) -> Header:
    """Validate only the header (reads ``8 + header length`` bytes, never the data)."""
    fd, size = _open_regular(path, follow_symlinks)
    try:
        return parse_header(_read_prefix(fd, size, str(path)), size, where=path, dtypes=dtypes)
    finally:
        os.close(fd)


def load_bytes(data: bytes, *, where: str | Path = "<safetensors>", expected_sha256: str | None = None,
               dtypes: frozenset[str] | set[str] | None = None) -> tuple[Header, dict[str, torch.Tensor]]:
    """Check the pin over ``data``, validate, then build every tensor with safetensors."""
    _check_pin(hashlib.sha256(data).hexdigest(), expected_sha256, str(where))
    header = parse_header(data, len(data), where=where, dtypes=dtypes)
    _check_bools(header, data)
    from safetensors.torch import load as st_load

    return header, dict(st_load(data))


def load(path: str | Path, *, expected_sha256: str | None = None,
         dtypes: frozenset[str] | set[str] | None = None, follow_symlinks: bool = True,
         max_bytes: int = 2 * 1024 ** 3) -> dict[str, torch.Tensor]:
    """Read a whole tensor file once (bounded by ``max_bytes``), verify, validate, build the tensors."""
    fd, size = _open_regular(path, follow_symlinks)
    try:
        if size > max_bytes:
            raise _fail(str(path), f"file is {size} bytes, above the {max_bytes}-byte in-memory limit",
                        "read it with replayjob.tensorfile.iter_tensors (streaming)")
        data = _read_exact(fd, 0, size, str(path))
    finally:
        os.close(fd)
    return load_bytes(data, where=path, expected_sha256=expected_sha256, dtypes=dtypes)[1]


def _check_bools(header: Header, data: bytes) -> None:
    start = header.data_start
    for spec in header.tensors.values():
        if spec.dtype == "BOOL" and _bad_bool(data[start + spec.begin:start + spec.end]):
            raise _bool_error(header.where, spec.name)


def _build(spec: TensorSpec, data: bytes, where: str) -> torch.Tensor:
    import torch

    if sys.byteorder != "little":  # pragma: no cover - no big-endian machine here
        raise _fail(where, "streaming reads need a little-endian machine", "use load() instead")
    dt = getattr(torch, _TORCH_NAMES[spec.dtype])
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dt)
    return torch.frombuffer(bytearray(data), dtype=dt).reshape(spec.shape)


def iter_tensors(path: str | Path, *, expected_sha256: str | None = None,
                 dtypes: frozenset[str] | set[str] | None = None,
                 follow_symlinks: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` in file order, one tensor in memory at a time.

    The header is validated before the first tensor.  With ``expected_sha256`` the bytes are hashed
    as they are read (the spans cover the file exactly, so this is one sequential read) and the pin
    is checked after the last tensor, before the iterator returns: a consumer must not act on what it
    accumulated until the loop ends without an exception.
    """
    fd, size = _open_regular(path, follow_symlinks)
    try:
        prefix = _read_prefix(fd, size, str(path))
        header = parse_header(prefix, size, where=path, dtypes=dtypes)
        h = hashlib.sha256(prefix)
        for spec in header.in_file_order():
            data = _read_exact(fd, header.data_start + spec.begin, spec.nbytes, str(path))
            h.update(data)
            if spec.dtype == "BOOL" and _bad_bool(data):
                raise _bool_error(header.where, spec.name)
            yield spec.name, _build(spec, data, str(path))
        _check_pin(h.hexdigest(), expected_sha256, str(path))
    finally:
        os.close(fd)


class TensorReader:
    """Random access by name to a validated file (the ``safe_open`` use case), one open descriptor.

    With ``expected_sha256`` the whole file is hashed through the open descriptor before any tensor is
    served.  Use as a context manager; :meth:`get_tensor` reads only the named tensor's span.
    """

    def __init__(self, path: str | Path, *, expected_sha256: str | None = None,
                 dtypes: frozenset[str] | set[str] | None = None, follow_symlinks: bool = True):
        self.path = Path(path)
        self._fd, size = _open_regular(path, follow_symlinks)
        try:
            if expected_sha256 is not None:
                h = hashlib.sha256()
                for off in range(0, size, _CHUNK):
                    h.update(_read_exact(self._fd, off, min(_CHUNK, size - off), str(path)))
                _check_pin(h.hexdigest(), expected_sha256, str(path))
            self.header = parse_header(_read_prefix(self._fd, size, str(path)), size, where=path,
                                       dtypes=dtypes)
        except BaseException:
            os.close(self._fd)
            raise

    def keys(self) -> list[str]:
        """The tensor names, sorted (``safe_open``'s spelling, so the reader drops in where it was used)."""
        return sorted(self.header.tensors)

    def get_tensor(self, name: str) -> torch.Tensor:
        """One tensor, read from its validated span only."""
        spec = self.header.tensors.get(name)
        if spec is None:
            raise IntegrityError(f"no tensor named {name!r}", where=self.path)
        data = _read_exact(self._fd, self.header.data_start + spec.begin, spec.nbytes, str(self.path))
        if spec.dtype == "BOOL" and _bad_bool(data):
            raise _bool_error(self.header.where, name)
        return _build(spec, data, str(self.path))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class ScannedFile:
    """One streaming read of a tensor file: its size and SHA-256, its header, and the bytes when kept.

    The header and BOOL checks ran over the very bytes that were hashed, but their verdict is held
    back until :meth:`validated`, so that a caller compares the digest first and reports a modified
    file as a checksum mismatch rather than as whatever the modification happened to break.
    """

    where: str
    size: int
    sha256: str
    header: Header | None
    error: IntegrityError | None
    buffer: mmap.mmap | None

    def validated(self) -> Header:
        """The header, or the first header/BOOL fault found while reading."""
        if self.error is not None:
            raise self.error
        assert self.header is not None
        return self.header

    def tensors(self) -> dict[str, torch.Tensor]:
        """Zero-copy tensors over the kept bytes (copied only for a span not aligned to its dtype)."""
        import torch

        header = self.validated()
        if self.buffer is None:
            raise IntegrityError("the file was scanned without keeping its bytes", where=self.where,
                                 hint="scan it with keep=True")
        if sys.byteorder != "little":  # pragma: no cover - no big-endian machine here
            raise _fail(self.where, "zero-copy tensors need a little-endian machine", "use load() instead")
        out = {}
        for spec in header.tensors.values():
            dt = _TORCH_NAMES[spec.dtype]
            dtype = getattr(torch, dt)
            start, item = header.data_start + spec.begin, ITEMSIZE[spec.dtype]
            if spec.nbytes == 0:
                t = torch.empty(spec.shape, dtype=dtype)
            elif start % item == 0:
                t = torch.frombuffer(self.buffer, dtype=dtype, count=spec.nbytes // item, offset=start)
            else:
                t = torch.frombuffer(bytearray(self.buffer[start:start + spec.nbytes]), dtype=dtype)
            out[spec.name] = t.reshape(spec.shape)
        return out


_TORCH_NAMES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
                "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


def _header_bytes(piece: memoryview) -> bytes:
    """The header prefix of a file's first piece (all of it when the length field is implausible)."""
    if len(piece) < 8:
        return bytes(piece)
    (n,) = struct.unpack("<Q", piece[:8])
    return bytes(piece[:8 + n]) if n <= MAX_HEADER_BYTES else bytes(piece[:8])


def _bool_fault(header: Header, piece: memoryview, offset: int) -> IntegrityError | None:
    """A BOOL tensor's bytes other than 0/1 inside ``piece`` (which starts at file ``offset``)."""
    for spec in header.tensors.values():
        if spec.dtype != "BOOL":
            continue
        lo = max(header.data_start + spec.begin, offset)
        hi = min(header.data_start + spec.end, offset + len(piece))
        if lo < hi and _bad_bool(piece[lo - offset:hi - offset].tobytes()):
            return _bool_error(header.where, spec.name)
    return None


def scan(path: str | Path, *, keep: bool = True, dtypes: frozenset[str] | set[str] | None = None,
         follow_symlinks: bool = True, max_bytes: int = 2 * 1024 ** 3,
         visit: Callable[[Header, memoryview, int], None] | None = None) -> ScannedFile:
    """Read a tensor file once, hashing each chunk as it lands, and validate its header on those bytes.

    With ``keep`` the file is read into one buffer (an anonymous mapping: no zero-fill pass) that
    :meth:`ScannedFile.tensors` views without copying; without it a single reused chunk buffer is
    enough and memory stays bounded whatever the file size (for callers that need the digest and
    the header only).  The header is parsed from the first chunk, which is read large enough to
    hold it; BOOL spans are checked chunk by chunk.  Faults found on the way are returned, not
    raised (see :meth:`ScannedFile.validated`); a file that changes size while it is read is
    refused at once.

    ``visit(header, piece, offset)`` is called with each piece just read (file offset ``offset``)
    once the header is valid, while the bytes are still in cache, so a caller can check contents
    without a second pass; an :class:`IntegrityError` it raises is held back like the others.
    Every piece after the first starts at a data-section offset that is a multiple of 8, so no
    element of an aligned dtype straddles two pieces.
    """
    w = str(path)
    fd, size = _open_regular(path, follow_symlinks)
    try:
        if keep and size > max_bytes:
            raise _fail(w, f"file is {size} bytes, above the {max_bytes}-byte in-memory limit",
                        "scan it with keep=False or read it with iter_tensors (streaming)")
        first = _CHUNK
        head8 = os.pread(fd, 8, 0) if size >= 8 else b""
        if len(head8) == 8 and struct.unpack("<Q", head8)[0] <= MAX_HEADER_BYTES:
            data_start = 8 + struct.unpack("<Q", head8)[0]
            first = max(first, data_start)
            first += (data_start - first) % 8
        first = min(first, size)
        buffer = mmap.mmap(-1, size) if keep and size else None
        view = memoryview(buffer) if buffer is not None else memoryview(bytearray(max(first, 1)))
        h = hashlib.sha256()
        header: Header | None = None
        error: IntegrityError | None = None
        off = 0
        with open(fd, "rb", buffering=0, closefd=False) as fh:
            while off < size:
                want = first if off == 0 else min(_CHUNK, size - off)
                piece = view[off:off + want] if buffer is not None else view[:want]
                got = 0
                while got < want:
                    k = fh.readinto(piece[got:])
                    if not k:
                        raise _fail(w, f"file ended after {off + got} bytes while reading; it changed or is "
                                       "truncated")
                    got += k
                h.update(piece)
                if off == 0:
                    try:
                        header = parse_header(_header_bytes(piece), size, where=w, dtypes=dtypes)
                    except IntegrityError as exc:
                        error = exc
                if header is not None and error is None:
                    error = _bool_fault(header, piece, off)
                    if error is None and visit is not None:
                        try:
                            visit(header, piece, off)
                        except IntegrityError as exc:
                            error = exc
                off += want
            if fh.read(1):
                raise _fail(w, f"file grew past {size} bytes while reading; it changed")
        if size == 0:
            try:
                parse_header(b"", 0, where=w, dtypes=dtypes)
            except IntegrityError as exc:
                error = exc
    except OSError as exc:
        raise _fail(w, f"cannot read the file: {exc.strerror}") from None
    finally:
        os.close(fd)
    return ScannedFile(w, size, h.hexdigest(), header, error, buffer)
