"""The capture payload: an :class:`OptimizerBatch` and the Torch RNG state as one safetensors file.

Tensors: ``tokens``, ``token_offsets``, ``prompt_lens``, ``resp_offsets`` (int64),
``old_logprobs``, ``ref_logprobs``, ``advantages``, ``loss_weights`` (float64), ``rng.cpu`` and
``rng.cuda.N`` (uint8), and optionally ``sampler_logprobs`` (float64, one per response token: the
sampler's own view, read by ``replayjob mismatch``; a payload written before the sampler recorded it
has none, which means "no sampler source recorded").  Metadata names the format and its version.

The payload is pinned by its **span digest** (:data:`DIGEST_TAG`): the SHA-256 of a domain tag, the
file size (u64), the SHA-256 of the header block (the 8-byte length and the JSON header), then for
every tensor in data-section order (empty tensors sharing an offset: by name) its byte length (u64)
and the SHA-256 of its bytes.  The spans tile the data section exactly (checked), so every byte of
the file is covered once, as by a plain file hash; but the parts are independent, so the tensors
are hashed in parallel, and each array's SHA-256 is the one the row digests
(:mod:`replayjob.rl.batch`, layout v2) are built from, so one pass over the bytes yields the pin
and both row digests.

Reading (:func:`read`, :func:`scan_bytes`) trusts nothing and goes through the one validated
reader, :mod:`replayjob.tensorfile`: :data:`SCHEMA` declares the format (exact tensor names,
dtypes, rank 1, the metadata, a 1 MiB header limit), the header block is validated against it --
a header that fails cannot belong to any pinned payload -- then the scan engine reads every span
once, hashing the spans in parallel and checking each chunk while it is in cache (negative token
ids, non-finite values, finite values outside their field's declared domain (:data:`FIELD_DOMAINS`:
log-probabilities <= 0, loss weights >= 0), the loss weights' non-zero count and exact sum).  The caller compares the
digest with its pin before it looks at any other finding; the ragged offsets and lengths are
checked from the small index arrays.  Only then are tensors built by the reader's one tensor
builder, as zero-copy views of a private buffer (never pickle).  Streaming (``keep=False``) holds
only the index arrays and RNG states (24 bytes per row in a capture's payload), so memory does not
grow with the tokens (what ``explain`` needs); the header decides those arrays' sizes, so a
payload that is not the pinned one can make them as large as the (size-pinned) file, no more than
a kept read holds.

Example:
    >>> import torch
    >>> from replayjob.rl.batch import OptimizerBatch
    >>> m = torch.ones((1, 2), dtype=torch.float64)
    >>> b = OptimizerBatch.from_padded([[1, 2, 3]], [1], {k: -m if k.endswith("logprobs") else m for k in
    ...     ("old_logprobs", "ref_logprobs", "advantages", "loss_weights")}, m)
    >>> b2, rng = decode(encode(b, {"cpu": torch.get_rng_state()}))
    >>> b2.logical_sha256() == b.logical_sha256(), sorted(rng)
    (True, ['cpu'])
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from replayjob import tensorfile
from replayjob.artifacts.capture_manifest import FINITE, LOGPROB, MAX_PAYLOAD_BYTES, WEIGHT, Domain, Manifest
from replayjob.declaration import check_summaries
from replayjob.errors import IntegrityError
from replayjob.rl import batch as batch_mod
from replayjob.rl.batch import OptimizerBatch
from replayjob.rl.state import rng_state_reason

if TYPE_CHECKING:
    from torch import Tensor

# One metadata key only: safetensors writes metadata from a hash map, so several keys would come
# out in a different order from run to run and the same batch would not give the same bytes.
FORMAT = "replayjob.optimizer_batch/v1"
DIGEST_TAG = b"replayjob.payload-spans.v1\n"
MAX_HEADER_BYTES = 1024 * 1024
INT_FIELDS = ("tokens", "token_offsets", "prompt_lens", "resp_offsets")
FLOAT_FIELDS = ("old_logprobs", "ref_logprobs", "advantages", "loss_weights")
OPTIONAL_FLOAT_FIELDS = (batch_mod.SAMPLER_FIELD,)  # per response token when present; not in the row digests
#: the domain of each per-response-token array, enforced by the reader (a finite value outside it is refused)
FIELD_DOMAINS: dict[str, Domain] = {"old_logprobs": LOGPROB, "ref_logprobs": LOGPROB, batch_mod.SAMPLER_FIELD: LOGPROB,
                                    "advantages": FINITE, "loss_weights": WEIGHT}
STREAMED = ("tokens", *FLOAT_FIELDS, *OPTIONAL_FLOAT_FIELDS)  # per-token arrays: never held when streaming
RNG_PREFIX = "rng."
MAX_WORKERS = 4  # spans hashed at once, at most
Buffer = tensorfile.Buffer
Span = tuple[int, int, int]  # absolute (begin, end, element count)
SCHEMA = tensorfile.Schema(
    "payload", {**{k: ("I64", 1) for k in INT_FIELDS}, **{k: ("F64", 1) for k in FLOAT_FIELDS}, "rng.cpu": ("U8", 1)},
    optional=((r"rng\.cuda\.(0|[1-9][0-9]*)", "U8", 1),  # ASCII digits only (matched with re.ASCII)
              *((name, "F64", 1) for name in OPTIONAL_FLOAT_FIELDS)),
    metadata={"format": FORMAT}, max_header_bytes=MAX_HEADER_BYTES)
_SUM_CHUNK = 1 << 16  # elements per exact-sum step: small temporaries stay in the allocator's cache


def encode(batch: OptimizerBatch, rng: dict[str, Tensor]) -> bytes:
    """Serialise ``batch`` and the RNG states (keys ``cpu``, ``cuda.N``) to safetensors bytes."""
    import torch

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in batch.tensors().items()}
    for key, t in rng.items():
        tensors[RNG_PREFIX + key] = t.detach().to("cpu", torch.uint8).contiguous()
    return tensorfile.encode(tensors, metadata={"format": FORMAT}, schema=SCHEMA, where="optimizer-batch payload").data


def _fail(msg: str, where: str | Path | None, hint: str | None = None) -> IntegrityError:
    return IntegrityError(f"payload refused: {msg}", where=where,
                          hint=hint or "recapture the source step; the payload does not match its format")


def parse_header(data: Buffer, where: str | Path | None = None, size: int | None = None) -> dict[str, Span]:
    """The validated header (:data:`SCHEMA`) as ``name -> (begin, end, count)`` with absolute offsets.

    ``data`` is the whole payload, or (with ``size``, the file's size) at least its header block.
    """
    h = tensorfile.parse_header(bytes(data[:8 + MAX_HEADER_BYTES]), len(data) if size is None else size,
                                where=where or "payload", schema=SCHEMA)
    return {t.name: (h.data_start + t.begin, h.data_start + t.end, t.shape[0]) for t in h.tensors.values()}


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
    import torch
    acc = ExactSum()
    acc.add(t.detach().to("cpu", torch.float64).contiguous().numpy())
    return acc.value()


# ------------------------------------------------------------------------------------ reading
@dataclass
class _SpanResult:
    negative: bool = False               # tokens: a negative id was seen
    top: int = -1                        # tokens: the largest id seen (a model's vocabulary must hold it)
    first_nonfinite: int | None = None   # floats: the first NaN/Inf element's index
    outside: tuple[int, float] | None = None  # floats: the first finite element outside its domain (index, value)
    nonzero: int = 0                     # loss_weights
    total: ExactSum | None = None        # loss_weights


class _Checks:
    """The scan visitor: per-token checks on each chunk of a span (each span is read by one thread)."""

    def __init__(self) -> None:
        self.results = {f: _SpanResult(total=ExactSum() if f == "loss_weights" else None) for f in STREAMED}

    def __call__(self, spec: tensorfile.TensorSpec, piece: memoryview, first: int) -> None:
        name = spec.name
        if name == "tokens":
            a = np.frombuffer(piece, dtype="<i8")
            res = self.results[name]
            res.negative = res.negative or bool(a.size and a.min() < 0)
            res.top = max(res.top, int(a.max())) if a.size else res.top
        elif name in FLOAT_FIELDS or name in OPTIONAL_FLOAT_FIELDS:
            _check_floats(name, np.frombuffer(piece, dtype="<f8"), first, self.results[name])


def _check_floats(name: str, a: np.ndarray, first: int, res: _SpanResult) -> None:
    with np.errstate(over="ignore", invalid="ignore"):  # a NaN/Inf or an overflow is looked into below
        total = float(a.sum()) if res.first_nonfinite is None and a.size else 0.0
    if not math.isfinite(total):
        bad = ~np.isfinite(a)  # the sum may also overflow with every value finite
        if bad.any():
            res.first_nonfinite = first + int(np.argmax(bad))
    if res.outside is None:
        found = FIELD_DOMAINS[name].first_outside(a)
        if found is not None:
            res.outside = (first + found[0], found[1])
    if name == "loss_weights":
        res.nonzero += int(np.count_nonzero(a))
        assert res.total is not None
        res.total.add(a, finite=res.first_nonfinite is None)


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
    nonfinite: str | None = None  # read with allow_nonfinite: the first NaN/Inf it admitted (None: none there)
    top_token: int = -1  # the largest token id of the rows (-1: none read)
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


def _held_when_streaming(name: str) -> bool:
    return name not in STREAMED  # the index arrays and the RNG states


def _scan(source: str | Path | Buffer, keep: bool, where: str | Path | None,
          expected_size: int | None = None, allow_nonfinite: bool = False) -> Scanned:
    out = Scanned()
    checks = _Checks()
    scanned = tensorfile.scan(source, keep=True if keep else _held_when_streaming, schema=SCHEMA, digest="spans",
                              visit=checks, workers=MAX_WORKERS, follow_symlinks=False,
                              expected_size=expected_size, where=where)
    header = scanned.header
    if header is None:
        out.header_fault = scanned.error
        return out
    assert scanned.header_sha256 is not None
    order = sorted(header.tensors.values(), key=lambda t: (t.begin, t.end, t.name))  # ties: empty spans, by name
    out.digest = spans_digest(scanned.size, scanned.header_sha256,
                              [(t.nbytes, scanned.tensor_sha256[t.name]) for t in order])
    out.sums = {k: (header.tensors[k].shape[0], scanned.tensor_sha256[k]) for k in (*INT_FIELDS, *FLOAT_FIELDS)}
    if scanned.error is not None:  # a visitor fault (none is raised by these checks) or a BOOL fault
        out.fault = scanned.error
        return out
    ints = {k: np.frombuffer(scanned.kept[k], dtype="<i8") for k in ("token_offsets", "prompt_lens", "resp_offsets")}
    floats = (*FLOAT_FIELDS, *(k for k in OPTIONAL_FLOAT_FIELDS if k in header.tensors))
    counts = {k: header.tensors[k].shape[0] for k in (*INT_FIELDS, *floats)}
    try:
        out.nonfinite = _check_content(header, counts, ints, checks.results, where, allow_nonfinite)
    except IntegrityError as exc:
        out.fault = exc
        return out
    resp_lens = np.diff(ints["resp_offsets"])
    out.top_token = checks.results["tokens"].top
    weights = checks.results["loss_weights"]
    assert weights.total is not None
    out.rows = {"rows": len(ints["prompt_lens"]), "tokens": counts["tokens"],
                "response_tokens": int(ints["resp_offsets"][-1]), "loss_bearing_tokens": weights.nonzero,
                "loss_weight_sum": weights.total.value()}
    if not math.isfinite(float(out.rows["loss_weight_sum"])):  # every value finite, the sum is not
        out.fault, out.rows = _fail("the loss weights sum beyond the float64 range", where), None
        return out
    out.every_row_bears_loss = weights.nonzero == counts["loss_weights"] and bool((resp_lens > 0).all())
    rng_names = [k for k in header.tensors if k.startswith(RNG_PREFIX)]
    out.rng = {k[len(RNG_PREFIX):]: t for k, t in scanned.tensors(rng_names).items()}
    for key in sorted(out.rng):  # a state of the right length the generator would refuse (rng_state_reason)
        reason = rng_state_reason(key, out.rng[key])
        if reason is not None:
            out.fault, out.rows, out.rng = _fail(reason, where, "the captured RNG state is damaged; recapture "
                                                 "the source step"), None, {}
            return out
    if keep:
        out.batch = OptimizerBatch(**scanned.tensors((*INT_FIELDS, *floats)))
    return out


def _check_content(header: tensorfile.Header, counts: dict[str, int], ints: dict[str, np.ndarray],
                   results: dict[str, _SpanResult], where: str | Path | None,
                   allow_nonfinite: bool = False) -> str | None:
    """Ragged structure from the index arrays, then the per-token findings (first one raised); the first
    non-finite value admitted (None: none).

    ``allow_nonfinite`` admits NaN/Inf in the logprobs and advantages (a capture flagged so, replayed
    under ``optimizer_batch.allow_nonfinite_inputs``); never in the loss weights."""
    import torch
    check_ragged(ints, counts, where)
    if results["tokens"].negative:
        raise _fail("negative token id", where)
    admitted = None
    for f in (*FLOAT_FIELDS, *OPTIONAL_FLOAT_FIELDS):
        first = results[f].first_nonfinite
        if first is None:
            continue
        finding = f"row {int(np.searchsorted(ints['resp_offsets'], first, side='right')) - 1} holds a non-finite " \
                  f"{f} value"
        if not (allow_nonfinite and f != "loss_weights"):
            raise _fail(finding, where, "the source step produced NaN/Inf; fix the source run and recapture")
        admitted = admitted or finding
    for f in (*FLOAT_FIELDS, *OPTIONAL_FLOAT_FIELDS):
        outside = results[f].outside
        if outside is not None:
            row = int(np.searchsorted(ints["resp_offsets"], outside[0], side="right")) - 1
            at = f"row {row}, response token {outside[0] - int(ints['resp_offsets'][row])}"
            raise _fail(FIELD_DOMAINS[f].reason(f, outside[1], at), where,
                        "no real step holds this value; the payload was edited after capture (recapture the step)")
    cpu = header.tensors["rng.cpu"].shape[0]
    if cpu != torch.get_rng_state().numel():
        raise _fail(f"rng.cpu has {cpu} bytes, this Torch's CPU generator state has "
                    f"{torch.get_rng_state().numel()}", where)
    return admitted


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
    for f in (*FLOAT_FIELDS, *(k for k in OPTIONAL_FLOAT_FIELDS if k in counts)):
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


def read(path: str | Path, *, keep: bool, expected_size: int | None = None,
         allow_nonfinite: bool = False) -> Scanned:
    """Read the payload file once (see the module docstring); ``keep`` also builds its tensors;
    ``allow_nonfinite``: see :func:`_check_content`."""
    return _scan(path, keep, path, expected_size, allow_nonfinite)


def scan_bytes(data: Buffer, where: str | Path | None = None) -> Scanned:
    """:func:`read` for a payload in memory (kept; a writable buffer is viewed, ``bytes`` copied once)."""
    return _scan(data, True, where)


def digest_bytes(data: Buffer, where: str | Path | None = None) -> str:
    """The span digest of an encoded payload (what a manifest pins); refuses an invalid header."""
    s = _scan(data, False, where)
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


def read_payload(m: Manifest, *, keep: bool, allow_nonfinite: bool = False) -> Scanned:
    """The payload ``m`` pins, read once and verified: its span digest equals the pin, then its structure.

    Raises :class:`IntegrityError` whose message is the whole reason (nothing in a payload that fails
    is used); the rows are kept when ``keep``, or when the row digests need them (some row bears no loss).
    """
    p = m.payload_path
    try:
        if p.is_symlink() or not p.is_file():
            raise IntegrityError("payload missing (or not a regular file)", where=p)
        if m.payload_size > MAX_PAYLOAD_BYTES:
            raise IntegrityError(f"the manifest pins a {m.payload_size}-byte payload, above the "
                                 f"{MAX_PAYLOAD_BYTES}-byte limit", where=p)
        scan = read(p, keep=keep, expected_size=m.payload_size, allow_nonfinite=allow_nonfinite)
        if scan.digest == m.payload_digest and scan.fault is None and scan.row_digests() is None:
            scan = read(p, keep=True, expected_size=m.payload_size,  # some row bears no loss
                                allow_nonfinite=allow_nonfinite)
    except OSError as exc:
        raise IntegrityError(f"{p}: cannot read the payload: {exc.strerror}") from None
    except IntegrityError as exc:
        raise IntegrityError(exc.diagnostics()) from None
    if scan.header_fault is not None:
        raise IntegrityError(f"{p}: {scan.header_fault.message} (so it is not the payload the manifest pins; "
                             "nothing in it was used)")
    if scan.digest != m.payload_digest:
        raise IntegrityError(f"{p}: payload span digest (SHA-256) is {scan.digest}, the manifest pins "
                             f"{m.payload_digest} (the payload changed after capture; nothing in it was used)")
    if scan.fault is not None:
        raise IntegrityError(scan.fault.diagnostics().replace("\n  fix:", "; fix:"))
    assert scan.rows is not None
    check_summaries(m.doc["rows"], scan.rows, where=m.path, what="rows")  # counts and the weight sum, recomputed
    return scan
