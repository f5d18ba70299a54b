"""The capture payload: an :class:`OptimizerBatch` and the Torch RNG state as one safetensors file.

Tensors: ``tokens``, ``token_offsets``, ``prompt_lens``, ``resp_offsets`` (int64),
``old_logprobs``, ``ref_logprobs``, ``advantages``, ``loss_weights`` (float64), ``rng.cpu`` and
``rng.cuda.N`` (uint8).  Metadata names the format and its version.

The payload is pinned by its **span digest** (:data:`DIGEST_TAG`): the SHA-256 of a domain tag, the
file size (u64), the SHA-256 of the header block (the 8-byte length and the JSON header), then for
every tensor in data-section order (empty tensors sharing an offset: by name) its byte length (u64)
and the SHA-256 of its bytes.  The spans tile the data section exactly (checked), so every byte of
the file is covered once, as by a plain file hash; but the parts are independent, so the tensors
are hashed in parallel, and each array's SHA-256 is the one the row digests
(:mod:`replayjob.rl.batch`, layout v2) are built from, so one pass over the bytes yields the pin
and both row digests.

Reading (:func:`read`, :func:`scan_bytes`) trusts nothing: the header block is parsed by replayjob
itself (size limit, exact tensor names, dtypes, 1-D shapes, data offsets that tile the data
section) -- a header that fails cannot belong to any pinned payload -- then every span is read
once, hashed and checked chunk by chunk while the chunk is in cache (negative token ids, non-finite
values, the loss weights' non-zero count and exact sum).  The caller compares the digest with its
pin before it looks at any other finding; the ragged offsets and lengths are checked from the
small index arrays.  Only then are tensors built, as zero-copy views of a private buffer
(``torch.frombuffer``; never pickle).  Streaming (``keep=False``) holds only the index arrays and
RNG states (24 bytes per row in a capture's payload), so memory does not grow with the tokens
(what ``explain`` needs); the header decides those arrays' sizes, so a payload that is not the
pinned one can make them as large as the (size-pinned) file, no more than a kept read holds.

Example:
    >>> import torch
    >>> from replayjob.rl.batch import OptimizerBatch
    >>> m = torch.ones((1, 2), dtype=torch.float64)
    >>> b = OptimizerBatch.from_padded([[1, 2, 3]], [1], {k: m for k in
    ...     ("old_logprobs", "ref_logprobs", "advantages", "loss_weights")}, m)
    >>> b2, rng = decode(encode(b, {"cpu": torch.get_rng_state()}))
    >>> b2.logical_sha256() == b.logical_sha256(), sorted(rng)
    (True, ['cpu'])
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import re
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from replayjob import tensorfile
from replayjob.errors import IntegrityError
from replayjob.fsio import open_regular
from replayjob.jsonio import loads_strict
from replayjob.rl import batch as batch_mod
from replayjob.rl.batch import OptimizerBatch

# One metadata key only: safetensors writes metadata from a hash map, so several keys would come
# out in a different order from run to run and the same batch would not give the same bytes.
FORMAT = "replayjob.optimizer_batch/v1"
DIGEST_TAG = b"replayjob.payload-spans.v1\n"
MAX_HEADER_BYTES = 1024 * 1024
INT_FIELDS = ("tokens", "token_offsets", "prompt_lens", "resp_offsets")
FLOAT_FIELDS = ("old_logprobs", "ref_logprobs", "advantages", "loss_weights")
STREAMED = ("tokens", *FLOAT_FIELDS)  # per-token arrays: never held when streaming
RNG_PREFIX = "rng."
CHUNK = 8 * 1024 * 1024  # bytes per read; a multiple of 8, so no element straddles two chunks
MAX_WORKERS = 4
Buffer = bytes | bytearray | mmap.mmap | memoryview
Span = tuple[int, int, int]  # absolute (begin, end, element count)
_ITEMSIZE = {"I64": 8, "F64": 8, "U8": 1}
_TORCH_DTYPE = {"I64": torch.int64, "F64": torch.float64, "U8": torch.uint8}
_NUMPY = {torch.int64: "<i8", torch.float64: "<f8", torch.uint8: "|u1"}
_CUDA_RNG = re.compile(r"rng\.cuda\.(0|[1-9][0-9]*)")  # ASCII digits only ("²".isdigit() is True)
_SUM_CHUNK = 1 << 16  # elements per exact-sum step: small temporaries stay in the allocator's cache


def encode(batch: OptimizerBatch, rng: dict[str, Tensor]) -> bytes:
    """Serialise ``batch`` and the RNG states (keys ``cpu``, ``cuda.N``) to safetensors bytes."""
    from safetensors.torch import save

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in batch.tensors().items()}
    for key, t in rng.items():
        tensors[RNG_PREFIX + key] = t.detach().to("cpu", torch.uint8).contiguous()
    return bytes(save(tensors, metadata={"format": FORMAT}))


def _fail(msg: str, where: str | Path | None, hint: str | None = None) -> IntegrityError:
    return IntegrityError(f"payload refused: {msg}", where=where,
                          hint=hint or "recapture the source step; the payload does not match its format")


def _expected_dtype(name: str) -> str | None:
    if name in INT_FIELDS:
        return "I64"
    if name in FLOAT_FIELDS:
        return "F64"
    if name == "rng.cpu" or _CUDA_RNG.fullmatch(name):
        return "U8"
    return None


def parse_header(data: Buffer, where: str | Path | None = None, size: int | None = None) -> dict[str, Span]:
    """Validate the safetensors header; return ``name -> (begin, end, count)`` with absolute offsets.

    ``data`` is the whole payload, or (with ``size``, the file's size) at least its header block.
    """
    size = len(data) if size is None else size
    tensorfile.refuse_pickle(bytes(data[:9]), where or "payload")  # a renamed pickle/zip is named as such
    if size < 8:
        raise _fail(f"{size} bytes is too short for a safetensors file", where)
    if bytes(data[:4]) == b"PK\x03\x04":  # as a header length this is far above the limit: no collision
        raise _fail("this is a zip file (torch.save?), not safetensors; pickle is never loaded", where)
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > MAX_HEADER_BYTES:
        raise _fail(f"header declares {n} bytes, above the {MAX_HEADER_BYTES}-byte limit", where)
    if 8 + n > size:
        raise _fail(f"header declares {n} bytes but the file has {size - 8} after the length", where)
    header = loads_strict(bytes(data[8:8 + n]), where=f"{where or 'payload'} (safetensors header)")
    if not isinstance(header, dict):
        raise _fail("header is not a JSON object", where)
    meta = header.pop("__metadata__", None)
    if meta != {"format": FORMAT}:
        raise _fail(f"metadata {meta!r} does not declare format {FORMAT!r}", where)
    missing = [f for f in (*INT_FIELDS, *FLOAT_FIELDS, "rng.cpu") if f not in header]
    if missing:
        raise _fail(f"missing tensors {missing}", where)
    body = size - 8 - n
    spans: list[tuple[int, int, str]] = []
    out: dict[str, Span] = {}
    for name, entry in header.items():
        want = _expected_dtype(name)
        if want is None:
            raise _fail(f"unexpected tensor {name!r}", where)
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise _fail(f"tensor {name!r} entry must have exactly dtype, shape, data_offsets", where)
        if entry["dtype"] != want:
            raise _fail(f"tensor {name!r} has dtype {entry['dtype']!r}, expected {want}", where)
        shape, offs = entry["shape"], entry["data_offsets"]
        if (not isinstance(shape, list) or len(shape) != 1 or not isinstance(shape[0], int)
                or isinstance(shape[0], bool) or shape[0] < 0):
            raise _fail(f"tensor {name!r} must be 1-D with a non-negative length, shape is {shape!r}", where)
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in offs)
                or not 0 <= offs[0] <= offs[1] <= body):
            raise _fail(f"tensor {name!r} data_offsets {offs!r} are outside the {body}-byte data section",
                        where)
        if offs[1] - offs[0] != shape[0] * _ITEMSIZE[want]:
            raise _fail(f"tensor {name!r}: {offs[1] - offs[0]} bytes for {shape[0]} elements of {want}",
                        where)
        spans.append((offs[0], offs[1], name))
        out[name] = (8 + n + offs[0], 8 + n + offs[1], shape[0])
    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:
            raise _fail(f"tensor {name!r} starts at {begin}, expected {pos} (overlap or gap)", where)
        pos = end
    if pos != body:
        raise _fail(f"data section has {body - pos} trailing bytes", where)
    # and the shared validated reader's checks as well (metadata types, dtype allow-list, limits)
    tensorfile.parse_header(bytes(data[:8 + n]), size, where=where or "payload", dtypes={"I64", "F64", "U8"})
    return out


def spans_digest(size: int, header_sha256: bytes, parts: list[tuple[int, bytes]]) -> str:
    """The payload digest from the header block's SHA-256 and ``(byte length, SHA-256)`` per span."""
    h = hashlib.sha256(DIGEST_TAG)
    h.update(struct.pack("<Q", size))
    h.update(header_sha256)
    for length, digest in parts:
        h.update(struct.pack("<Q", length))
        h.update(digest)
    return h.hexdigest()


# ----------------------------------------------------------------------------------- exact sum
class ExactSum:
    """``math.fsum`` of float64 values fed in pieces, without a Python float per value.

    A finite value is ``(-1)**sign * mantissa * 2**(max(exponent, 1) - 1075)``, its 53-bit integer
    mantissa being the 52 fraction bits plus the implicit bit of a normal number.  Keyed by the
    12 sign-and-exponent bits, the fractions' high and low 26-bit halves are summed exactly in
    float64 (``np.bincount``; no partial sum reaches 2**53 in a step of :data:`_SUM_CHUNK` values)
    and the implicit bits are counted; the per-key sums go into one Python integer, and
    :meth:`value` divides once, rounding to nearest even, as ``fsum`` does.  Non-finite values
    follow ``fsum``'s result (``nan`` where ``fsum`` would raise on ``inf - inf``), a finite sum beyond
    float64 is ``±inf`` (``fsum`` raises ``OverflowError``, also for an intermediate overflow whose
    exact result is finite, which is returned here); an exact zero takes ``fsum``'s sign.
    """

    def __init__(self) -> None:
        self.total = 0
        self.nan = self.pos_inf = self.neg_inf = False
        self.count = 0
        self.all_negative_zero = True

    def add(self, a: np.ndarray, finite: bool = False) -> None:
        """Add the float64 values of ``a``; ``finite`` says the caller knows none is NaN or Inf."""
        if a.size == 0:
            return
        self.count += a.size
        with np.errstate(over="ignore", invalid="ignore"):  # only probing for NaN/Inf
            probe = float(a.sum()) if not finite else 0.0
        if not math.isfinite(probe):
            special = ~np.isfinite(a)
            v = a[special]
            self.nan |= bool(np.isnan(v).any())
            self.pos_inf |= bool((v == np.inf).any())
            self.neg_inf |= bool((v == -np.inf).any())
            a = a[~special]
        bits = a.view("<u8")
        if self.all_negative_zero and bool((bits != np.uint64(1 << 63)).any()):
            self.all_negative_zero = False
        for start in range(0, a.size, _SUM_CHUNK):
            b = bits[start:start + _SUM_CHUNK]
            key = (b >> np.uint64(52)).astype(np.intp)
            frac = b & np.uint64(0xFFFFFFFFFFFFF)
            hi = np.bincount(key, weights=(frac >> np.uint64(26)).astype(np.float64), minlength=4096)
            lo = np.bincount(key, weights=(frac & np.uint64(0x3FFFFFF)).astype(np.float64), minlength=4096)
            normal = np.bincount(key, minlength=4096)
            for k in np.flatnonzero(normal).tolist():
                exp = k & 0x7FF
                mant = (int(hi[k]) << 26) + int(lo[k]) + (int(normal[k]) << 52 if exp else 0)
                term = mant << (max(exp, 1) - 1)
                self.total += -term if k & 0x800 else term

    def value(self) -> float:
        if self.nan or (self.pos_inf and self.neg_inf):
            return math.nan
        if self.pos_inf or self.neg_inf:
            return math.inf if self.pos_inf else -math.inf
        if self.total == 0:
            return math.fsum([-0.0] if self.count and self.all_negative_zero else [])
        try:
            return self.total / (1 << 1074)
        except OverflowError:  # where fsum raises: the exact sum is beyond float64
            return math.inf if self.total > 0 else -math.inf


def exact_sum(t: Tensor) -> float:
    """``math.fsum`` of a float64 tensor (the correctly rounded sum); see :class:`ExactSum`."""
    acc = ExactSum()
    acc.add(t.detach().to("cpu", torch.float64).contiguous().numpy())
    return acc.value()


# ------------------------------------------------------------------------------------ reading
@dataclass
class _SpanResult:
    sha256: bytes
    negative: bool = False               # tokens: a negative id was seen
    first_nonfinite: int | None = None   # floats: the first NaN/Inf element's index
    nonzero: int = 0                     # loss_weights
    total: ExactSum | None = None        # loss_weights


def _check_piece(name: str, piece: memoryview, first: int, res: _SpanResult) -> None:
    """The per-token checks on one chunk of a span (``first`` is its first element's index)."""
    if name == "tokens":
        a = np.frombuffer(piece, dtype="<i8")
        res.negative = res.negative or bool(a.size and a.min() < 0)
        return
    if name not in FLOAT_FIELDS:
        return
    a = np.frombuffer(piece, dtype="<f8")
    with np.errstate(over="ignore", invalid="ignore"):  # a NaN/Inf or an overflow is looked into below
        total = float(a.sum()) if res.first_nonfinite is None and a.size else 0.0
    if not math.isfinite(total):
        bad = ~np.isfinite(a)  # the sum may also overflow with every value finite
        if bad.any():
            res.first_nonfinite = first + int(np.argmax(bad))
    if name == "loss_weights":
        res.nonzero += int(np.count_nonzero(a))
        assert res.total is not None
        res.total.add(a, finite=res.first_nonfinite is None)


class _Reader:
    """Spans of the payload read into ``into`` (a file, through ``preadv``) or viewed (a buffer)."""

    def __init__(self, where: str | Path | None, data: Buffer | None = None, fd: int | None = None,
                 size: int = 0):
        self.where, self.fd = where, fd
        self.view = memoryview(data).cast("B") if data is not None else None
        self.size = len(self.view) if self.view is not None else size

    def read(self, offset: int, n: int, into: memoryview | None) -> memoryview:
        if self.view is not None:
            if into is None:
                return self.view[offset:offset + n]
            into[:n] = self.view[offset:offset + n]
            return into[:n]
        assert into is not None and self.fd is not None
        got = 0
        while got < n:
            k = os.preadv(self.fd, [into[got:n]], offset + got)
            if k == 0:
                raise IntegrityError(f"payload ended after {offset + got} of {self.size} bytes while it was "
                                     "read (it changed during the read)", where=self.where)
            got += k
        return into[:n]


@dataclass
class Scanned:
    """One read of a payload: its digest, what the checks found, and (kept) its tensors.

    ``header_fault`` means the header block is invalid (no digest exists); ``fault`` is the first
    structural finding behind a valid header, to be reported only once the digest matches its pin.
    """

    digest: str | None = None
    header_fault: IntegrityError | None = None
    fault: IntegrityError | None = None
    sums: dict[str, tuple[int, bytes]] = field(default_factory=dict)  # array name -> (count, SHA-256)
    rng: dict[str, Tensor] = field(default_factory=dict)
    batch: OptimizerBatch | None = None
    rows: dict[str, int | float] | None = None
    every_row_bears_loss: bool = False
    _row_digests: tuple[str, str] | None = field(default=None, repr=False)

    def row_digests(self) -> tuple[str, str] | None:
        """``(logical, effective)`` from the span hashes; None when the rows are needed and not kept.

        Computed once (selecting and hashing the loss-bearing rows is the one costly case)."""
        if self._row_digests is None:
            if self.every_row_bears_loss:
                self._row_digests = batch_mod.digests_from_sums(int(self.rows["rows"]) if self.rows else 0,
                                                                self.sums)
            elif self.batch is not None:
                self._row_digests = self.batch.digests(known=self.sums)
        return self._row_digests


def _scan(reader: _Reader, keep: bool, where: str | Path | None, allow_nonfinite: bool = False) -> Scanned:
    size = reader.size
    out = Scanned()
    head = bytearray(8)
    if size >= 8:
        head = bytearray(reader.read(0, 8, memoryview(head)))
    (n,) = struct.unpack("<Q", bytes(head)) if size >= 8 else (0,)
    try:
        if size >= 8 and n <= MAX_HEADER_BYTES and 8 + n <= size:
            block = bytes(reader.read(0, 8 + n, memoryview(bytearray(8 + n))))
        else:
            block = bytes(head[:min(size, 8)])
        spans = parse_header(block, where, size)
    except IntegrityError as exc:
        out.header_fault = exc
        return out
    header_sha = hashlib.sha256(block).digest()
    buf: Buffer | None = None
    if keep:
        if reader.view is not None and not reader.view.readonly:
            buf = reader.view
        else:
            buf = mmap.mmap(-1, max(size, 1))
            if hasattr(mmap, "MADV_HUGEPAGE"):  # fewer page faults while the buffer fills (Linux, THP)
                buf.madvise(mmap.MADV_HUGEPAGE)
            memoryview(buf)[:8 + n] = block
    in_place = buf is not None and buf is reader.view  # a writable buffer is kept as it is
    kept: dict[str, memoryview] = {}
    local = threading.local()

    def one(name: str) -> _SpanResult:
        begin, end, _count = spans[name]
        res = _SpanResult(b"", total=ExactSum() if name == "loss_weights" else None)
        h = hashlib.sha256()
        target: memoryview | None = None
        if buf is not None:
            target = memoryview(buf)[begin:end]
        elif name not in STREAMED:
            target = memoryview(bytearray(end - begin))
        if target is not None:
            kept[name] = target
        itemsize = _ITEMSIZE[str(_expected_dtype(name))]
        off = begin
        while off < end:
            k = min(CHUNK, end - off)
            into: memoryview | None
            if target is not None:
                into = None if in_place else target[off - begin:off - begin + k]
            elif reader.view is not None:
                into = None  # streaming a buffer: view it, copy nothing
            else:
                if getattr(local, "buf", None) is None:
                    local.buf = memoryview(bytearray(CHUNK))
                into = local.buf
            piece = reader.read(off, k, into)
            h.update(piece)
            _check_piece(name, piece, (off - begin) // itemsize, res)
            off += k
        res.sha256 = h.digest()
        return res

    order = sorted(spans, key=lambda k: spans[k][1] - spans[k][0], reverse=True)  # largest first
    workers = max(1, min(MAX_WORKERS, os.cpu_count() or 1, len(order)))
    try:
        if workers > 1 and size >= 4 * CHUNK:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="replayjob-payload") as pool:
                results = dict(zip(order, pool.map(one, order), strict=True))
        else:
            results = {k: one(k) for k in order}
    except OSError as exc:
        raise IntegrityError(f"cannot read the payload: {exc.strerror}", where=where) from None
    in_file_order = sorted(spans, key=lambda k: (spans[k][0], spans[k][1], k))  # ties: empty spans, by name
    out.digest = spans_digest(size, header_sha, [(spans[k][1] - spans[k][0], results[k].sha256)
                                                 for k in in_file_order])
    out.sums = {k: (spans[k][2], results[k].sha256) for k in (*INT_FIELDS, *FLOAT_FIELDS)}
    ints = {k: np.frombuffer(kept[k], dtype="<i8") for k in ("token_offsets", "prompt_lens", "resp_offsets")}
    try:
        _check_content(spans, ints, results, where, allow_nonfinite)
    except IntegrityError as exc:
        out.fault = exc
        return out
    resp_lens = np.diff(ints["resp_offsets"])
    weights = results["loss_weights"]
    assert weights.total is not None
    out.rows = {"rows": len(ints["prompt_lens"]), "tokens": spans["tokens"][2],
                "response_tokens": int(ints["resp_offsets"][-1]), "loss_bearing_tokens": weights.nonzero,
                "loss_weight_sum": weights.total.value()}
    if not math.isfinite(float(out.rows["loss_weight_sum"])):  # every value finite, the sum is not
        out.fault, out.rows = _fail("the loss weights sum beyond the float64 range", where), None
        return out
    out.every_row_bears_loss = weights.nonzero == spans["loss_weights"][2] and bool((resp_lens > 0).all())
    out.rng = {k[len(RNG_PREFIX):]: _tensor(kept[k], torch.uint8) for k in spans if k.startswith(RNG_PREFIX)}
    if buf is not None:
        tensors = {k: _tensor(kept[k], _TORCH_DTYPE[str(_expected_dtype(k))]) for k in (*INT_FIELDS, *FLOAT_FIELDS)}
        out.batch = OptimizerBatch(**tensors)
    return out


def _check_content(spans: dict[str, Span], ints: dict[str, np.ndarray], results: dict[str, _SpanResult],
                   where: str | Path | None, allow_nonfinite: bool = False) -> None:
    """Ragged structure from the index arrays, then the per-token findings (first one raised).

    ``allow_nonfinite`` admits NaN/Inf in the logprobs and advantages (a capture flagged so, replayed
    under ``optimizer_batch.allow_nonfinite_inputs``); never in the loss weights."""
    check_ragged(ints, {k: spans[k][2] for k in (*INT_FIELDS, *FLOAT_FIELDS)}, where)
    if results["tokens"].negative:
        raise _fail("negative token id", where)
    for f in FLOAT_FIELDS:
        first = results[f].first_nonfinite
        if first is not None and not (allow_nonfinite and f != "loss_weights"):
            row = int(np.searchsorted(ints["resp_offsets"], first, side="right")) - 1
            raise _fail(f"row {row} holds a non-finite {f} value", where,
                        "the source step produced NaN/Inf; fix the source run and recapture")
    if spans["rng.cpu"][2] != torch.get_rng_state().numel():
        raise _fail(f"rng.cpu has {spans['rng.cpu'][2]} bytes, this Torch's CPU generator state has "
                    f"{torch.get_rng_state().numel()}", where)


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


def check_ragged(ints: dict[str, np.ndarray], counts: dict[str, int], where: str | Path | None = None) -> None:
    """Check the offsets and lengths against each other and the arrays' element ``counts`` (whole arrays)."""
    tok_off, resp_off, prompt = ints["token_offsets"], ints["resp_offsets"], ints["prompt_lens"]
    rows = len(prompt)
    if rows < 1:
        raise _fail("the batch has no rows", where)
    for name, offs in (("token_offsets", tok_off), ("resp_offsets", resp_off)):
        if len(offs) != rows + 1:
            raise _fail(f"{name} has {len(offs)} entries for {rows} rows (expected {rows + 1})", where)
        if offs[0] != 0:
            raise _fail(f"{name}[0] is {int(offs[0])}, expected 0", where)
        down = offs[1:] < offs[:-1]
        if down.any():
            i = _first(down)
            raise _fail(f"{name} decreases at row {i} ({int(offs[i])} -> {int(offs[i + 1])})", where)
    if tok_off[-1] != counts["tokens"]:
        raise _fail(f"token_offsets end at {int(tok_off[-1])} but there are {counts['tokens']} tokens", where)
    for f in FLOAT_FIELDS:
        if resp_off[-1] != counts[f]:
            raise _fail(f"resp_offsets end at {int(resp_off[-1])} but {f} has {counts[f]} values", where)
    # Offsets now lie in [0, count], so these differences cannot overflow; the prompt length is
    # compared before it is subtracted.
    n_tok, n_resp = np.diff(tok_off), np.diff(resp_off)
    fits = (prompt >= 1) & (prompt <= n_tok)
    bad = ~fits | (n_tok - np.where(fits, prompt, 0) != n_resp)
    if bad.any():
        i = _first(bad)
        raise _fail(f"row {i}: {int(n_tok[i])} tokens, prompt length {int(prompt[i])} and {int(n_resp[i])} "
                    "response values do not fit together", where)


def _tensor(view: memoryview, dtype: torch.dtype) -> Tensor:
    """A view of ``view``'s bytes (copied only when they are not aligned to the element size)."""
    if len(view) == 0:
        return torch.empty(0, dtype=dtype)
    if sys.byteorder != "little":  # pragma: no cover - no big-endian machine here
        return torch.from_numpy(np.frombuffer(view, dtype=_NUMPY[dtype]).astype(_NUMPY[dtype][1:]))
    if view.readonly or np.frombuffer(view, dtype=np.uint8).ctypes.data % dtype.itemsize:
        return torch.frombuffer(bytearray(view), dtype=dtype)
    return torch.frombuffer(view, dtype=dtype)


def read(path: str | Path, *, keep: bool, expected_size: int | None = None,
         allow_nonfinite: bool = False) -> Scanned:
    """Read the payload file once (see the module docstring); ``keep`` also builds its tensors;
    ``allow_nonfinite``: see :func:`_check_content`."""
    fd, size = open_regular(path, follow_symlinks=False, what="payload")
    try:
        if expected_size is not None and size != expected_size:
            raise IntegrityError(f"payload is {size} bytes, the manifest pins {expected_size}", where=path)
        return _scan(_Reader(path, fd=fd, size=size), keep, path, allow_nonfinite)
    finally:
        os.close(fd)


def scan_bytes(data: Buffer, where: str | Path | None = None) -> Scanned:
    """:func:`read` for a payload in memory (kept; a writable buffer is viewed, ``bytes`` copied once)."""
    return _scan(_Reader(where, data=data), True, where)


def digest_bytes(data: Buffer, where: str | Path | None = None) -> str:
    """The span digest of an encoded payload (what a manifest pins); refuses an invalid header."""
    s = _scan(_Reader(where, data=data), False, where)
    if s.header_fault is not None:
        raise s.header_fault
    assert s.digest is not None
    return s.digest


def decode(data: Buffer, where: str | Path | None = None) -> tuple[OptimizerBatch, dict[str, Tensor]]:
    """Validate then deserialise a payload; return the batch and RNG states (keys ``cpu``, ``cuda.N``).

    A writable buffer (``bytearray``, anonymous ``mmap``) is used in place: the returned tensors are
    views of it, so the caller must not modify it afterwards.  ``bytes`` are copied once.
    """
    s = scan_bytes(data, where)
    if s.header_fault is not None:
        raise s.header_fault
    if s.fault is not None:
        raise s.fault
    assert s.batch is not None
    return s.batch, s.rng


def summary(batch: OptimizerBatch) -> dict[str, int | float]:
    """Row and token counts (what explain prints; :attr:`Scanned.rows` holds the same from a read)."""
    weights = batch.loss_weights
    return {"rows": batch.rows, "tokens": int(batch.tokens.numel()),
            "response_tokens": batch.response_tokens(),
            "loss_bearing_tokens": int((weights != 0).sum()),
            "loss_weight_sum": exact_sum(weights)}
