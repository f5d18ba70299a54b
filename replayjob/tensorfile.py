"""The one validated safetensors reader: every tensor file replayjob reads goes through here.

It also holds the encoder of the per-step hot path (:func:`encode`: bundle capture), which hashes
each tensor while it builds the file instead of scanning the file again.

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
* the spans, sorted, are in range, do not overlap, and cover the data section exactly;
* and, when the caller names the format, its :class:`Schema`: the exact tensor names, each one's
  dtype and rank, and the metadata (the capture payload and bundle payloads declare theirs).

One scan engine (:func:`scan`) reads a file or an in-memory buffer once: the header block first,
then every span in chunks that are hashed -- into the plain file SHA-256, or per span for formats
pinned by a digest of their parts, with spans read by parallel workers -- BOOL-checked and handed
to the format's own checks while in cache.  Its findings are held back until the caller has
compared the digest with its pin, so a modified file is reported as modified.  A pinned SHA-256 is
checked over the same bytes that are parsed (one read, no second open), and only then are tensors
built, by one builder (:func:`build_tensor`: zero-copy views of the bytes read, never pickle), for a
whole file in memory (:func:`load`, at most 2 GiB by default) or one tensor at a time from its
validated span (:class:`TensorReader`, what ``reduce`` uses on adapters, and :func:`iter_tensors`).
A file is opened through :func:`replayjob.fsio.open_regular`: regular files only, and a symbolic
link is refused unless the caller passes ``follow_symlinks=True`` (a model file the user names).

Example:
    >>> import torch, tempfile, pathlib
    >>> from safetensors.torch import save
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "w.safetensors"
    >>> _ = p.write_bytes(save({"w": torch.zeros(2, 3)}))
    >>> sorted(read_header(p).tensors), load(p)["w"].shape
    (['w'], torch.Size([2, 3]))
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import mmap
import os
import re
import struct
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

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
CHUNK = 8 * 1024 * 1024  # bytes per read; a multiple of 8, so no element straddles two chunks


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


@dataclass(frozen=True)
class Schema:
    """What one format's tensor files hold, checked by :func:`parse_header` after its generic checks.

    ``tensors`` maps each required name to its ``(dtype, rank)``; ``optional`` lists
    ``(full-match pattern, dtype, rank)`` for names that may also appear; any other name is refused.
    ``metadata`` is the exact ``__metadata__`` required (``None``: any string map);
    ``max_header_bytes`` the format's own header limit.  ``what`` names the file in messages.
    """

    what: str
    tensors: Mapping[str, tuple[str, int]]
    optional: tuple[tuple[str, str, int], ...] = ()
    metadata: Mapping[str, str] | None = None
    max_header_bytes: int = MAX_HEADER_BYTES

    @property
    def dtypes(self) -> frozenset[str]:
        return frozenset(d for d, _ in self.tensors.values()) | {d for _, d, _ in self.optional}

    def expect(self, name: str) -> tuple[str, int] | None:
        """The ``(dtype, rank)`` a tensor of this name must have; None when the name is not allowed."""
        if name in self.tensors:
            return self.tensors[name]
        return next(((d, r) for pattern, d, r in self.optional if re.fullmatch(pattern, name, re.ASCII)), None)

    def check(self, header: Header) -> None:
        w, what = header.where, self.what
        if self.metadata is not None and header.metadata != dict(self.metadata):
            raise _fail(w, f"{what} metadata {header.metadata!r} is not {dict(self.metadata)!r}")
        missing = [n for n in self.tensors if n not in header.tensors]
        if missing:
            raise _fail(w, f"{what} is missing tensors {missing}")
        for name, spec in header.tensors.items():
            want = self.expect(name)
            if want is None:
                raise _fail(w, f"unexpected tensor {name!r} in a {what}")
            if spec.dtype != want[0] or len(spec.shape) != want[1]:
                raise _fail(w, f"{what} tensor {name!r} is {spec.dtype} of rank {len(spec.shape)}, "
                               f"expected {want[0]} of rank {want[1]}")


def _fail(where: str, message: str, hint: str = _HINT) -> IntegrityError:
    return IntegrityError(f"safetensors refused: {message}", where=where, hint=hint)


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


def parse_header(prefix: bytes, file_size: int, *, where: str | Path = "<safetensors>",
                 dtypes: frozenset[str] | set[str] | None = None, schema: Schema | None = None,
                 max_header_bytes: int | None = None) -> Header:
    """Validate a header; ``prefix`` holds at least the first ``8 + header length`` bytes.

    ``dtypes`` narrows the allow-list; a ``schema`` narrows it to its own dtypes, sets the header
    limit and is checked last (names, dtypes, ranks, metadata).
    """
    w = str(where)
    allowed = set(ITEMSIZE) if dtypes is None else set(dtypes) & set(ITEMSIZE)
    if schema is not None:
        allowed &= schema.dtypes
    if max_header_bytes is None:
        max_header_bytes = schema.max_header_bytes if schema is not None else MAX_HEADER_BYTES
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
    key = (raw, file_size) if schema is None and dtypes is None and n <= _VALIDATED_MAX_BYTES else None
    if key is not None and (hit := _VALIDATED.get(key)) is not None:
        return Header(w, file_size, 8 + n, dict(hit[0]), dict(hit[1]))
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
    header = Header(w, file_size, 8 + n, dict(meta), tensors)
    if schema is not None:
        schema.check(header)
    if key is not None:
        if len(_VALIDATED) >= _VALIDATED_ENTRIES:
            _VALIDATED.clear()
        _VALIDATED[key] = (dict(meta), dict(tensors))
    return header


# Headers validated with the default allow-list, by their exact bytes and the file size (all the verdict
# depends on): the adapters of one ablation share one header layout, so reduce validates it once, not
# once per replay.  Only successes are kept (a refusal names its file); each hit gets its own dicts.
_VALIDATED: dict[tuple[bytes, int], tuple[dict[str, str], dict[str, TensorSpec]]] = {}
_VALIDATED_ENTRIES = 16
_VALIDATED_MAX_BYTES = 1024 * 1024


_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})


def _spec(name: str, entry: Any, body: int, allowed: set[str], w: str) -> TensorSpec:
    if not name:
        raise _fail(w, "a tensor has an empty name")
    # The values come from JSON, so an integer is exactly an int (type(True) is bool, not int).
    if not isinstance(entry, dict) or entry.keys() != _ENTRY_KEYS:
        raise _fail(w, f"tensor {name!r} must have exactly dtype, shape and data_offsets")
    dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in allowed:
        raise _fail(w, f"tensor {name!r} has dtype {dtype!r}; allowed here: {', '.join(sorted(allowed))}")
    if (type(shape) is not list or len(shape) > MAX_RANK
            or not all(type(d) is int and d >= 0 for d in shape)):
        raise _fail(w, f"tensor {name!r} shape {shape!r} is not a list of at most {MAX_RANK} "
                       "non-negative integers")
    if type(offs) is not list or len(offs) != 2 or type(offs[0]) is not int or type(offs[1]) is not int:
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


def _bad_bool(data: Buffer) -> bool:
    return bool(bytes(data).translate(None, b"\x00\x01"))


def _bool_error(where: str, name: str) -> IntegrityError:
    return _fail(where, f"tensor {name!r} is BOOL but holds bytes other than 0 and 1")


# ------------------------------------------------------------------------------------ sources
Buffer = bytes | bytearray | mmap.mmap | memoryview
# visit(spec, piece, first): ``piece`` holds elements ``first ..`` of tensor ``spec``, just hashed.
Visitor = Callable[[TensorSpec, memoryview, int], None]


class _Source:
    """Bytes at offsets: a file descriptor (read with ``preadv`` into a target) or a buffer (viewed)."""

    def __init__(self, where: str, *, fd: int | None = None, size: int = 0, data: Buffer | None = None):
        self.where, self.fd = where, fd
        self.view = memoryview(data).cast("B") if data is not None else None
        self.size = len(self.view) if self.view is not None else size

    def read(self, offset: int, n: int, into: memoryview | None = None) -> memoryview:
        """``n`` bytes at ``offset``: a view of the buffer (``into`` None), or read/copied into ``into``."""
        if self.view is not None:
            if into is None:
                return self.view[offset:offset + n]
            into[:n] = self.view[offset:offset + n]
            return into[:n]
        if into is None:
            into = memoryview(bytearray(n))
        assert self.fd is not None
        got = 0
        while got < n:
            k = os.preadv(self.fd, [into[got:n]], offset + got)
            if k == 0:
                raise _fail(self.where, f"file ended after {offset + got} of {self.size} bytes while reading; "
                                        "it changed or is truncated")
            got += k
        return into[:n]

    def check_unchanged(self) -> None:
        if self.fd is not None and os.pread(self.fd, 1, self.size):
            raise _fail(self.where, f"file grew past {self.size} bytes while reading; it changed")


def _open_regular(path: str | Path, follow_symlinks: bool) -> tuple[int, int]:
    return open_regular(path, follow_symlinks=follow_symlinks, what="tensor file")


def _header_block(src: _Source, max_header_bytes: int) -> bytes:
    """The first ``8 + header length`` bytes when that fits the limit and the file, else at most 8."""
    head8 = bytes(src.read(0, min(src.size, 8)))
    if len(head8) == 8:
        (n,) = struct.unpack("<Q", head8)
        if 8 + n <= min(src.size, 8 + max_header_bytes):
            return bytes(src.read(0, 8 + n))
    return head8


# ------------------------------------------------------------------------------ tensor builder
_TORCH_NAMES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
                "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name on the allow-list."""
    import torch

    out: torch.dtype = getattr(torch, _TORCH_NAMES[dtype])
    return out


def build_tensor(view: Buffer, dtype: str, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    """The one tensor builder: a tensor over ``view``'s bytes (validated elsewhere; never pickle).

    Zero-copy when the bytes are writable and aligned to the element size (the tensor then shares
    them: the caller must not modify them afterwards); copied otherwise.
    """
    import torch

    if sys.byteorder != "little":  # pragma: no cover - no big-endian machine here
        raise _fail("<tensor>", "tensors are built from little-endian bytes on little-endian machines only",
                    "use a little-endian machine")
    dt = torch_dtype(dtype)
    mv = memoryview(view).cast("B")
    if len(mv) == 0:
        return torch.empty(tuple(shape), dtype=dt)
    if mv.readonly or _address(mv) % ITEMSIZE[dtype]:
        return torch.frombuffer(bytearray(mv), dtype=dt).reshape(tuple(shape))
    return torch.frombuffer(mv, dtype=dt).reshape(tuple(shape))


def _address(mv: memoryview) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


# --------------------------------------------------------------------------------- scan engine
@dataclass(frozen=True)
class ScannedFile:
    """One read of a tensor file: its size, its digests, its header, and the bytes it kept.

    ``sha256`` is the plain SHA-256 of the file (``digest="file"``); ``header_sha256`` and
    ``tensor_sha256`` are the SHA-256 of the header block and of each tensor's bytes
    (``digest="spans"``, for formats pinned by a digest of those parts).  The header and BOOL checks
    and the caller's visitor ran over the very bytes that were hashed, but their verdict is held
    back until :meth:`validated`, so that a caller compares the digest first and reports a modified
    file as a checksum mismatch rather than as whatever the modification happened to break.
    """

    where: str
    size: int
    sha256: str | None
    header: Header | None
    error: IntegrityError | None
    buffer: Buffer | None
    kept: dict[str, memoryview] = field(default_factory=dict)
    header_sha256: bytes | None = None
    tensor_sha256: dict[str, bytes] = field(default_factory=dict)

    def validated(self) -> Header:
        """The header, or the first header/BOOL/visitor fault found while reading."""
        if self.error is not None:
            raise self.error
        assert self.header is not None
        return self.header

    def tensors(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Tensors over the kept bytes (:func:`build_tensor`: zero-copy where aligned), all or ``names``."""
        header = self.validated()
        want = list(header.tensors) if names is None else list(names)
        missing = [n for n in want if n not in self.kept]
        if missing:
            raise IntegrityError(f"the file was scanned without keeping {missing}", where=self.where,
                                 hint="scan it with keep=True")
        return {n: build_tensor(self.kept[n], header.tensors[n].dtype, header.tensors[n].shape) for n in want}


@dataclass
class _SpanRead:
    sha256: bytes = b""
    error: IntegrityError | None = None


def _keep_set(keep: bool | Callable[[str], bool], header: Header) -> set[str]:
    if isinstance(keep, bool):
        return set(header.tensors) if keep else set()
    return {n for n in header.tensors if keep(n)}


def scan(source: str | Path | Buffer, *, keep: bool | Callable[[str], bool] = True, schema: Schema | None = None,
         dtypes: frozenset[str] | set[str] | None = None, digest: Literal["file", "spans"] = "file",
         visit: Visitor | None = None, workers: int = 1, follow_symlinks: bool = False,
         max_bytes: int = 2 * 1024 ** 3, expected_size: int | None = None,
         where: str | Path | None = None) -> ScannedFile:
    """Read a tensor file (a path, or bytes already in memory) once: hash, validate, check, keep.

    The header block is read and validated first (:func:`parse_header`, with ``schema`` or
    ``dtypes``); then every tensor's span is read in chunks of :data:`CHUNK` bytes (a multiple of 8,
    so no element of an aligned dtype straddles two chunks), each chunk hashed, its BOOL bytes
    checked and handed to ``visit(spec, piece, first_element)`` while it is in cache.

    ``digest="file"`` feeds the header block and the spans in file order to one SHA-256: the spans
    tile the data section, so this is the plain file digest (a file whose header is invalid is
    still hashed whole, so a caller can report it as modified); when nothing is kept or visited and no
    tensor is BOOL, the data section is read in whole chunks across span boundaries (hashing and the
    header checks are all there is to do: ``reduce`` on adapters).  ``digest="spans"`` hashes the header
    block and each span on its own, so ``workers`` threads read and hash tensors in parallel
    (largest first; SHA-256 and reads release the GIL); an invalid header then has only the digest of
    the bytes read as its header block (the first ``8 + length`` bytes, or 8 when that does not fit).

    ``keep=True`` reads the file into one buffer (an anonymous mapping: no zero-fill pass; a
    writable in-memory buffer is used in place) that :meth:`ScannedFile.tensors` views without
    copying; ``keep`` as a predicate keeps only the tensors it names (each in its own buffer); with
    ``keep=False`` one reused chunk buffer per thread is enough and memory stays bounded whatever
    the file size.  Faults found on the way are returned, not raised (:meth:`ScannedFile.validated`);
    a file that changes size while it is read, or is not ``expected_size`` bytes, is refused at once.
    ``where`` names the file in messages (default: the path, or ``<safetensors>`` for a buffer).
    """
    if isinstance(source, str | Path):
        w = str(where or source)
        fd, size = _open_regular(source, follow_symlinks)
        try:
            if expected_size is not None and size != expected_size:
                raise IntegrityError(f"the file is {size} bytes, {expected_size} are expected", where=w,
                                     hint="the file was modified or truncated")
            return _scan(_Source(w, fd=fd, size=size), keep, schema, dtypes, digest, visit, workers, max_bytes)
        except OSError as exc:
            raise _fail(w, f"cannot read the file: {exc.strerror}") from None
        finally:
            os.close(fd)
    return _scan(_Source(str(where or "<safetensors>"), data=source), keep, schema, dtypes, digest, visit, workers,
                 max_bytes)


def _scan(src: _Source, keep: bool | Callable[[str], bool], schema: Schema | None,
          dtypes: frozenset[str] | set[str] | None, digest: str, visit: Visitor | None, workers: int,
          max_bytes: int) -> ScannedFile:
    w, size = src.where, src.size
    if keep is True and size > max_bytes:
        raise _fail(w, f"file is {size} bytes, above the {max_bytes}-byte in-memory limit",
                    "read it with keep=False or with replayjob.tensorfile.TensorReader (one tensor at a time)")
    limit = schema.max_header_bytes if schema is not None else MAX_HEADER_BYTES
    block = _header_block(src, limit)
    header: Header | None = None
    error: IntegrityError | None = None
    try:
        header = parse_header(block, size, where=w, dtypes=dtypes, schema=schema)
    except IntegrityError as exc:
        error = exc
    buffer: Buffer | None = None
    if keep is True and size:
        if src.view is not None and not src.view.readonly:
            buffer = src.view  # a writable buffer is kept as it is
        else:
            buffer = mmap.mmap(-1, size)
            if hasattr(mmap, "MADV_HUGEPAGE"):  # fewer page faults while the buffer fills (Linux, THP)
                buffer.madvise(mmap.MADV_HUGEPAGE)
            memoryview(buffer)[:len(block)] = block
    if header is None:
        if digest == "spans":  # only the header block is hashed: a caller compares it with its pin first
            return ScannedFile(w, size, None, None, error, None, header_sha256=hashlib.sha256(block).digest())
        h = hashlib.sha256(block)
        _read_range(src, len(block), size, buffer, h.update)
        src.check_unchanged()
        return ScannedFile(w, size, h.hexdigest(), None, error, None)
    keep_names = _keep_set(keep, header)
    kept: dict[str, memoryview] = {}
    for spec in header.tensors.values():
        if buffer is not None:
            kept[spec.name] = memoryview(buffer)[header.data_start + spec.begin:header.data_start + spec.end]
        elif spec.name in keep_names:
            kept[spec.name] = memoryview(bytearray(spec.nbytes))
    in_place = buffer is not None and buffer is src.view
    order = header.in_file_order()
    results: dict[str, _SpanRead] = {}
    if digest == "file":
        h = hashlib.sha256(block)
        if buffer is None and not kept and visit is None and all(spec.dtype != "BOOL" for spec in order):
            # Nothing to check or keep per tensor, and the spans tile the data section: hash it in whole
            # chunks (an adapter of hundreds of small tensors costs one read per chunk, not per tensor).
            _read_range(src, header.data_start, size, None, h.update)
        else:
            results = {spec.name: _read_span(src, header, spec, kept.get(spec.name), in_place, h.update, visit)
                       for spec in order}
        sha: str | None = h.hexdigest()
    else:
        sha = None
        by_size = sorted(order, key=lambda s: s.nbytes, reverse=True)

        def one(spec: TensorSpec) -> _SpanRead:
            h = hashlib.sha256()
            res = _read_span(src, header, spec, kept.get(spec.name), in_place, h.update, visit)
            res.sha256 = h.digest()
            return res

        n = max(1, min(workers, os.cpu_count() or 1, len(by_size)))
        if n > 1 and size >= 4 * CHUNK:
            with ThreadPoolExecutor(max_workers=n, thread_name_prefix="replayjob-tensorfile") as pool:
                results = dict(zip((s.name for s in by_size), pool.map(one, by_size), strict=True))
        else:
            results = {spec.name: one(spec) for spec in by_size}
    src.check_unchanged()
    error = next((r.error for s in order if (r := results.get(s.name)) is not None and r.error is not None), None)
    return ScannedFile(w, size, sha, header, error, buffer, kept, hashlib.sha256(block).digest(),
                       {k: v.sha256 for k, v in results.items()} if digest == "spans" else {})


_local = threading.local()


def _scratch() -> memoryview:
    """This thread's chunk buffer (reads that keep nothing reuse it)."""
    buf: memoryview | None = getattr(_local, "buf", None)
    if buf is None or len(buf) < CHUNK:
        buf = _local.buf = memoryview(bytearray(CHUNK))
    return buf


def _read_range(src: _Source, begin: int, end: int, buffer: Buffer | None, update: Callable[[Any], None]) -> None:
    """Bytes ``[begin, end)`` through ``update`` in chunks (into ``buffer`` when given)."""
    off = begin
    while off < end:
        k = min(CHUNK, end - off)
        into = memoryview(buffer)[off:off + k] if buffer is not None else (None if src.view is not None else _scratch())
        update(src.read(off, k, into))
        off += k


def _read_span(src: _Source, header: Header, spec: TensorSpec, target: memoryview | None, in_place: bool,
               update: Callable[[Any], None], visit: Visitor | None) -> _SpanRead:
    """One tensor's bytes in chunks: hashed, BOOL-checked, visited; into ``target`` when kept."""
    res = _SpanRead()
    item = ITEMSIZE[spec.dtype]
    begin = header.data_start + spec.begin
    off = 0
    while off < spec.nbytes:
        k = min(CHUNK, spec.nbytes - off)
        into: memoryview | None
        if target is not None:
            into = None if in_place else target[off:off + k]
        else:
            into = None if src.view is not None else _scratch()
        piece = src.read(begin + off, k, into)
        update(piece)
        if res.error is None:
            try:
                if spec.dtype == "BOOL" and _bad_bool(piece):
                    raise _bool_error(header.where, spec.name)
                if visit is not None:
                    visit(spec, piece, off // item)
            except IntegrityError as exc:
                res.error = exc
        off += k
    return res


# ------------------------------------------------------------------------------------ encoder
# The order the safetensors library lays tensors out in (its dtype order, descending), then by name.
_FILE_ORDER = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "I8", "U8", "BOOL")


@dataclass(frozen=True)
class Encoded:
    """A tensor file built in memory, with the digests :func:`scan` would find in it.

    ``data`` is the whole file; ``header`` its validated header; ``header_sha256`` and
    ``tensor_sha256`` are what ``scan(data, digest="spans")`` computes (the header block, each
    tensor's bytes), taken from the tensors' own memory while the file is assembled."""

    data: bytes
    header: Header
    header_sha256: bytes
    tensor_sha256: dict[str, bytes]


@functools.cache
def _safetensors_names() -> dict[torch.dtype, str]:
    """torch dtype -> safetensors name, the inverse of :func:`torch_dtype` (built once)."""
    return {torch_dtype(d): d for d in _TORCH_NAMES}


def safetensors_name(dtype: torch.dtype) -> str | None:
    """The safetensors name of a torch dtype on the allow-list (None: not on it)."""
    return _safetensors_names().get(dtype)


def encode(tensors: Mapping[str, torch.Tensor], *, metadata: Mapping[str, str] | None = None,
           schema: Schema | None = None, where: str | Path = "<safetensors>") -> Encoded:
    """Serialize CPU tensors into a safetensors file in memory, hashing each tensor once.

    The layout is the one the safetensors library writes: a compact JSON header padded with spaces
    to a multiple of 8 bytes, then the data section, tensors in the library's order (by dtype, see
    :data:`_FILE_ORDER`: largest items first, so every tensor is aligned to its element size for
    zero-copy reads, then by name); the library loads the result and writes the same bytes
    (tested).  The header is the one :func:`parse_header` would return (the round trip is tested)
    and passes the format's ``schema``, so a file built here is one :func:`scan` accepts.  This is
    the per-step hot path of bundle capture: one copy of each tensor into the file, no re-read or
    re-parse of the file to hash and check it.
    """
    import torch

    if sys.byteorder != "little":  # safetensors is little-endian; tensors are copied as they lie in memory
        raise IntegrityError("tensor files are little-endian; this host is not", where=str(where))
    names = _safetensors_names()
    entries: list[tuple[str, str, list[int], Any]] = []
    for name, t in tensors.items():
        dtype = names.get(t.dtype)
        if dtype is None or t.device.type != "cpu":
            raise _fail(str(where), f"tensor {name!r} is {t.dtype} on {t.device}; only CPU tensors of "
                                    f"{', '.join(sorted(ITEMSIZE))} are written")
        if t.dim() > MAX_RANK:
            raise _fail(str(where), f"tensor {name!r} has rank {t.dim()}; readers accept at most {MAX_RANK}")
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        if dtype == "BOOL" and _bad_bool(raw.data):
            raise _bool_error(str(where), name)
        entries.append((name, dtype, list(t.shape), raw))
    entries.sort(key=lambda e: (_FILE_ORDER.index(e[1]), e[0]))
    doc: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata is not None else {}
    specs: dict[str, TensorSpec] = {}
    off = 0
    for name, dtype, shape, raw in entries:
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise _fail(str(where), f"tensor name {name!r} cannot be written")
        doc[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + raw.nbytes]}
        specs[name] = TensorSpec(name, dtype, tuple(shape), off, off + raw.nbytes)
        off += raw.nbytes
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise _fail(str(where), "__metadata__ must map strings to strings")
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    text += b" " * (-len(text) % 8)
    limit = schema.max_header_bytes if schema is not None else MAX_HEADER_BYTES
    if len(text) > limit:
        raise _fail(str(where), f"the header would be {len(text)} bytes, above the {limit}-byte header limit")
    block = struct.pack("<Q", len(text)) + text
    # The header as parse_header would return it, built from the entries themselves (every name,
    # dtype, shape and span is right by construction; the round trip is tested), then the format's
    # own schema: names, dtypes, ranks and metadata.
    header = Header(str(where), len(block) + off, len(block), dict(metadata or {}), specs)
    if schema is not None:
        allowed = schema.dtypes
        bad = sorted({s.dtype for s in specs.values()} - allowed)
        if bad:
            raise _fail(str(where), f"tensor dtype(s) {bad} are not allowed here: {', '.join(sorted(allowed))}")
        schema.check(header)
    data = b"".join([block, *(e[3] for e in entries)])
    return Encoded(data, header, hashlib.sha256(block).digest(),
                   {e[0]: hashlib.sha256(e[3]).digest() for e in entries})


# ------------------------------------------------------------------------------------ readers
def _check_pin(actual: str | None, expected: str | None, where: str) -> None:
    if expected is None:
        return
    pin = normalize_digest(expected, what="the pinned tensor-file SHA-256")
    if actual != pin:
        raise IntegrityError(f"SHA-256 is {actual}, the pin is {pin}", where=where,
                             hint="the file changed after it was pinned, or the pin belongs to another file")


def read_header(path: str | Path, *, dtypes: frozenset[str] | set[str] | None = None,
                schema: Schema | None = None, follow_symlinks: bool = False) -> Header:
    """Validate only the header (reads ``8 + header length`` bytes, never the data)."""
    fd, size = _open_regular(path, follow_symlinks)
    try:
        src = _Source(str(path), fd=fd, size=size)
        limit = schema.max_header_bytes if schema is not None else MAX_HEADER_BYTES
        return parse_header(_header_block(src, limit), size, where=path, dtypes=dtypes, schema=schema)
    finally:
        os.close(fd)


def load_bytes(data: Buffer, *, where: str | Path = "<safetensors>", expected_sha256: str | None = None,
               dtypes: frozenset[str] | set[str] | None = None,
               schema: Schema | None = None) -> tuple[Header, dict[str, torch.Tensor]]:
    """Check the pin over ``data``, validate, then build every tensor (``bytes`` are copied once)."""
    scanned = scan(data, dtypes=dtypes, schema=schema, where=where)
    _check_pin(scanned.sha256, expected_sha256, str(where))
    return scanned.validated(), scanned.tensors()


def load(path: str | Path, *, expected_sha256: str | None = None,
         dtypes: frozenset[str] | set[str] | None = None, schema: Schema | None = None,
         follow_symlinks: bool = False, max_bytes: int = 2 * 1024 ** 3) -> dict[str, torch.Tensor]:
    """Read a whole tensor file once (bounded by ``max_bytes``), verify, validate, build the tensors."""
    scanned = scan(path, dtypes=dtypes, schema=schema, follow_symlinks=follow_symlinks, max_bytes=max_bytes)
    _check_pin(scanned.sha256, expected_sha256, str(path))
    return scanned.tensors()


def iter_tensors(path: str | Path, *, expected_sha256: str | None = None,
                 dtypes: frozenset[str] | set[str] | None = None,
                 follow_symlinks: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` in file order, one tensor in memory at a time.

    The header is validated before the first tensor.  With ``expected_sha256`` the bytes are hashed
    as they are read (the spans cover the file exactly, so this is one sequential read) and the pin
    is checked after the last tensor, before the iterator returns: a consumer must not act on what it
    accumulated until the loop ends without an exception.
    """
    with TensorReader(path, dtypes=dtypes, follow_symlinks=follow_symlinks) as reader:
        h = hashlib.sha256(reader.block)
        for spec in reader.header.in_file_order():
            t = reader.get_tensor(spec.name, update=h.update)
            yield spec.name, t
        _check_pin(h.hexdigest(), expected_sha256, str(path))


class TensorReader:
    """Random access by name to a validated file (the ``safe_open`` use case), one open descriptor.

    With ``expected_sha256`` the whole file is scanned through the open descriptor (hashed, header
    and BOOL bytes checked) before any tensor is served.  Use as a context manager;
    :meth:`get_tensor` reads only the named tensor's span.
    """

    def __init__(self, path: str | Path, *, expected_sha256: str | None = None,
                 dtypes: frozenset[str] | set[str] | None = None, schema: Schema | None = None,
                 follow_symlinks: bool = False):
        self.path = Path(path)
        self._fd, size = _open_regular(path, follow_symlinks)
        try:
            self._src = _Source(str(path), fd=self._fd, size=size)
            if expected_sha256 is not None:
                scanned = _scan(self._src, False, schema, dtypes, "file", None, 1, 0)
                _check_pin(scanned.sha256, expected_sha256, str(path))
                scanned.validated()
            limit = schema.max_header_bytes if schema is not None else MAX_HEADER_BYTES
            self.block = _header_block(self._src, limit)
            self.header = parse_header(self.block, size, where=path, dtypes=dtypes, schema=schema)
        except BaseException:
            os.close(self._fd)
            raise

    def keys(self) -> list[str]:
        """The tensor names, sorted (``safe_open``'s spelling, so the reader drops in where it was used)."""
        return sorted(self.header.tensors)

    def get_tensor(self, name: str, update: Callable[[Any], None] | None = None) -> torch.Tensor:
        """One tensor, read from its validated span only (its bytes also fed to ``update``)."""
        spec = self.header.tensors.get(name)
        if spec is None:
            raise IntegrityError(f"no tensor named {name!r}", where=self.path)
        target = memoryview(bytearray(spec.nbytes))
        res = _read_span(self._src, self.header, spec, target, False, update or (lambda _b: None), None)
        if res.error is not None:
            raise res.error
        return build_tensor(target, spec.dtype, spec.shape)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
