"""The capture payload: an :class:`OptimizerBatch` and the Torch RNG state as one safetensors file.

Tensors: ``tokens``, ``token_offsets``, ``prompt_lens``, ``resp_offsets`` (int64),
``old_logprobs``, ``ref_logprobs``, ``advantages``, ``loss_weights`` (float64), ``rng.cpu`` and
``rng.cuda.N`` (uint8).  Metadata names the format and its version.

:func:`decode` trusts nothing: it parses the safetensors header itself (size limit, exact tensor
names, dtypes, 1-D shapes, contiguous non-overlapping in-range data offsets), then reads the four
integer arrays straight from the bytes and checks every ragged offset and length before any
tensor is built, with whole-array (vectorised) comparisons.  Only then are the tensors built as
zero-copy views of the validated spans (``torch.frombuffer``; never pickle), and rows holding a
non-finite value are refused.  The caller has already checked the payload's SHA-256.

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

import math
import mmap
import struct
import sys
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from replayjob import tensorfile
from replayjob.errors import IntegrityError
from replayjob.jsonio import loads_strict
from replayjob.rl.batch import OptimizerBatch

# One metadata key only: safetensors writes metadata from a hash map, so several keys would come
# out in a different order from run to run and the same batch would not give the same bytes.
FORMAT = "replayjob.optimizer_batch/v1"
MAX_HEADER_BYTES = 1024 * 1024
INT_FIELDS = ("tokens", "token_offsets", "prompt_lens", "resp_offsets")
FLOAT_FIELDS = ("old_logprobs", "ref_logprobs", "advantages", "loss_weights")
RNG_PREFIX = "rng."
Buffer = bytes | bytearray | mmap.mmap
_ITEMSIZE = {"I64": 8, "F64": 8, "U8": 1}
_TORCH_DTYPE = {"I64": torch.int64, "F64": torch.float64, "U8": torch.uint8}
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
    if name == "rng.cpu" or (name.startswith("rng.cuda.") and name[9:].isdigit()
                             and str(int(name[9:])) == name[9:]):
        return "U8"
    return None


def parse_header(data: Buffer, where: str | Path | None = None) -> dict[str, tuple[int, int, int]]:
    """Validate the safetensors header; return ``name -> (begin, end, length)`` with absolute offsets."""
    tensorfile.refuse_pickle(bytes(data[:8]), where or "payload")  # a renamed pickle/zip is named as such
    if len(data) < 8:
        raise _fail(f"{len(data)} bytes is too short for a safetensors file", where)
    if data[:4] == b"PK\x03\x04":  # as a header length this is far above the limit: no collision
        raise _fail("this is a zip file (torch.save?), not safetensors; pickle is never loaded", where)
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES:
        raise _fail(f"header declares {n} bytes, above the {MAX_HEADER_BYTES}-byte limit", where)
    if 8 + n > len(data):
        raise _fail(f"header declares {n} bytes but the file has {len(data) - 8} after the length", where)
    header = loads_strict(bytes(data[8:8 + n]), where=f"{where or 'payload'} (safetensors header)")
    if not isinstance(header, dict):
        raise _fail("header is not a JSON object", where)
    meta = header.pop("__metadata__", None)
    if meta != {"format": FORMAT}:
        raise _fail(f"metadata {meta!r} does not declare format {FORMAT!r}", where)
    missing = [f for f in (*INT_FIELDS, *FLOAT_FIELDS, "rng.cpu") if f not in header]
    if missing:
        raise _fail(f"missing tensors {missing}", where)
    body = len(data) - 8 - n
    spans: list[tuple[int, int, str]] = []
    out: dict[str, tuple[int, int, int]] = {}
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
    tensorfile.parse_header(bytes(data[:8 + n]), len(data), where=where or "payload", dtypes={"I64", "F64", "U8"})
    return out


def _ints(data: Buffer, span: tuple[int, int, int]) -> np.ndarray:
    begin, _end, count = span
    return np.frombuffer(data, dtype="<i8", count=count, offset=begin)


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


def check_ragged(data: Buffer, spans: dict[str, tuple[int, int, int]],
                 where: str | Path | None = None) -> None:
    """Check offsets and lengths against each other, read straight from the bytes (whole arrays)."""
    tok_off = _ints(data, spans["token_offsets"])
    resp_off = _ints(data, spans["resp_offsets"])
    prompt = _ints(data, spans["prompt_lens"])
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
    if tok_off[-1] != spans["tokens"][2]:
        raise _fail(f"token_offsets end at {int(tok_off[-1])} but there are {spans['tokens'][2]} tokens", where)
    for f in FLOAT_FIELDS:
        if resp_off[-1] != spans[f][2]:
            raise _fail(f"resp_offsets end at {int(resp_off[-1])} but {f} has {spans[f][2]} values", where)
    # Offsets now lie in [0, count], so these differences cannot overflow; the prompt length is
    # compared before it is subtracted.
    n_tok, n_resp = np.diff(tok_off), np.diff(resp_off)
    fits = (prompt >= 1) & (prompt <= n_tok)
    bad = ~fits | (n_tok - np.where(fits, prompt, 0) != n_resp)
    if bad.any():
        i = _first(bad)
        raise _fail(f"row {i}: {int(n_tok[i])} tokens, prompt length {int(prompt[i])} and {int(n_resp[i])} "
                    "response values do not fit together", where)
    tokens = _ints(data, spans["tokens"])
    if tokens.size and tokens.min() < 0:
        raise _fail("negative token id", where)


def _tensor(buf: bytearray | mmap.mmap, span: tuple[int, int, int], dtype: torch.dtype) -> Tensor:
    """A view of ``buf[begin:end]`` (copied only when the span is not aligned to its element size)."""
    begin, end, count = span
    if count == 0:
        return torch.empty(0, dtype=dtype)
    if begin % dtype.itemsize:
        return torch.frombuffer(bytearray(buf[begin:end]), dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=begin)


def _check_finite(batch: OptimizerBatch, where: str | Path | None) -> None:
    for f in FLOAT_FIELDS:
        t: Tensor = getattr(batch, f)
        if bool(torch.isfinite(t.sum())):  # one NaN or Inf anywhere makes the sum non-finite
            continue
        bad = ~torch.isfinite(t)  # the sum may also overflow with every value finite
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            row = int(torch.searchsorted(batch.resp_offsets, torch.tensor(first), right=True)) - 1
            raise _fail(f"row {row} holds a non-finite {f} value", where,
                        "the source step produced NaN/Inf; fix the source run and recapture")


def decode(data: Buffer, where: str | Path | None = None) -> tuple[OptimizerBatch, dict[str, Tensor]]:
    """Validate then deserialise a payload; return the batch and RNG states (keys ``cpu``, ``cuda.N``).

    A writable buffer (``bytearray``, anonymous ``mmap``) is used in place: the returned tensors are
    views of it, so the caller must not modify it afterwards.  ``bytes`` are copied once.
    """
    spans = parse_header(data, where)
    check_ragged(data, spans, where)
    if spans["rng.cpu"][2] != torch.get_rng_state().numel():
        raise _fail(f"rng.cpu has {spans['rng.cpu'][2]} bytes, this Torch's CPU generator state has "
                    f"{torch.get_rng_state().numel()}", where)
    if sys.byteorder != "little":  # pragma: no cover - no big-endian machine here
        from safetensors.torch import load

        tensors = load(bytes(data))
    else:
        buf = data if isinstance(data, bytearray | mmap.mmap) else bytearray(data)
        tensors = {k: _tensor(buf, span, _TORCH_DTYPE[str(_expected_dtype(k))]) for k, span in spans.items()}
    batch = OptimizerBatch(**{k: tensors[k] for k in (*INT_FIELDS, *FLOAT_FIELDS)})
    _check_finite(batch, where)
    rng = {k[len(RNG_PREFIX):]: v for k, v in tensors.items() if k.startswith(RNG_PREFIX)}
    return batch, rng


def exact_sum(t: Tensor) -> float:
    """``math.fsum`` of a float64 tensor (the correctly rounded sum), without a Python float per value.

    Each finite value is ``mantissa * 2**(exponent - 1075)`` with a 53-bit integer mantissa read from
    its bits.  Per exponent, the mantissas' high and low 26-bit halves are summed exactly in float64
    (``np.bincount``; no partial sum can reach 2**53 in a chunk of :data:`_SUM_CHUNK` values), the
    per-exponent sums are combined as one Python integer, and the final integer division rounds once,
    to nearest even, as ``fsum`` does.  Non-finite input and an exact zero (whose sign ``fsum``
    decides) go to ``math.fsum`` itself.
    """
    a = t.detach().to("cpu", torch.float64).contiguous().numpy()
    if a.size == 0:
        return 0.0
    if not math.isfinite(float(a.sum())):
        return math.fsum(a.data)
    bits = a.view("<i8")
    total = 0
    for start in range(0, a.size, _SUM_CHUNK):
        b = bits[start:start + _SUM_CHUNK]
        exp = (b >> 52) & 0x7FF
        mant = (b & 0xFFFFFFFFFFFFF) | ((exp != 0).astype(np.int64) << 52)
        mant = np.where(b < 0, -mant, mant)
        idx = np.maximum(exp, 1)  # subnormals share the smallest normal exponent
        hi = np.bincount(idx, weights=(mant >> 26).astype(np.float64), minlength=2047)
        lo = np.bincount(idx, weights=(mant & 0x3FFFFFF).astype(np.float64), minlength=2047)
        for k in np.flatnonzero((hi != 0) | (lo != 0)).tolist():
            total += ((int(hi[k]) << 26) + int(lo[k])) << (k - 1)
    if total == 0:
        return math.fsum(a.data)
    return total / (1 << 1074)


def summary(batch: OptimizerBatch) -> dict[str, int | float]:
    """Row and token counts (what explain prints)."""
    weights = batch.loss_weights
    return {"rows": batch.rows, "tokens": int(batch.tokens.numel()),
            "response_tokens": batch.response_tokens(),
            "loss_bearing_tokens": int((weights != 0).sum()),
            "loss_weight_sum": exact_sum(weights)}
