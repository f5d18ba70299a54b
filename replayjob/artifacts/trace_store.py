"""The trace artifact: ``trace/trace.safetensors`` plus ``trace/index.json``, written last.

A trace holds, for one replayed update, every traced module output in forward order and every
output gradient in backward order (:class:`Site`), each as the unpadded tokens of every logical row
concatenated in logical row order, so the layout does not depend on micro-batching; per row, the
SHA-256 of the row's bytes and float64 statistics (L2 norm, max abs, mean); and per trainable
parameter the accumulated gradient (before clipping) and the update ``after - before``
(:class:`Param`).  The format is documented in ``docs/trace-format.md``.

Integrity: both files are written atomically and exclusively; the index, written last, pins the
payload by SHA-256 and size and names every tensor with its shape, so a reader refuses a missing
index (an interrupted replay), a changed payload, or a payload whose tensors do not match the index.
The payload is read through :mod:`replayjob.tensorfile` (validated header, no pickle), and neither
file nor ``trace/`` itself may be a symbolic link (:func:`replayjob.fsio.check_no_symlinks`).
Nothing here imports transformers or peft.

Example:
    >>> t = read_trace("runs/replays/ckpt-off/repeat-000")   # doctest: +SKIP
    >>> [s.name for s in t.forward][:2]                       # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from replayjob import tensorfile
from replayjob.declaration import Count, Digest, Document, Positive, Printable, decode
from replayjob.digest import normalize_digest, sha256_bytes
from replayjob.errors import IntegrityError, RefusedError
from replayjob.fsio import atomic_write_bytes, check_no_symlinks, read_regular_bytes
from replayjob.jsonio import loads_strict, pretty_bytes

if TYPE_CHECKING:
    import torch

TRACE_SCHEMA = "replayjob.trace/v1"
TRACE_DIR = "trace"
INDEX_FILE = "index.json"
PAYLOAD_FILE = "trace.safetensors"
MAX_INDEX_BYTES = 64 * 1024 * 1024
STATS = ("l2", "max_abs", "mean")
PARAM_STATS = ("grad_l2", "grad_max_abs", "update_l2", "update_max_abs")
IDENTITY_KEYS = ("manifest_sha256", "logical_batch_sha256", "initial_adapter_sha256", "arm", "repeat_index",
                 "micro_batch_size", "gradient_checkpointing", "device", "torch_version", "fault")
_FLOATS = ("F32", "F64", "F16", "BF16")  # the dtypes a trace holds, by their safetensors names
_HINT = "rerun the replay with --trace into a new --out directory"


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors spelling of a floating dtype a trace can hold."""
    name = tensorfile.safetensors_name(dtype)
    if name not in _FLOATS:
        raise IntegrityError(f"a traced tensor has dtype {dtype}; traces hold floating dtypes only")
    return name


def _row_bytes(t: torch.Tensor) -> bytes:
    import torch
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()  # any rank, a scalar too


def row_stats(values: torch.Tensor, row_tokens: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """Per row (of ``values`` [T, W], rows of ``row_tokens`` tokens each): float64 stats and SHA-256.

    Statistics are NumPy segment reductions over the whole tensor in float64 (single-threaded: no
    per-row loop of Torch calls, no intra-op thread pool for these small arrays); each row's digest
    is taken over a zero-copy slice of the tensor's bytes.
    """
    import numpy as np
    import torch

    lens = np.asarray(row_tokens.tolist(), dtype=np.int64)
    v = values.detach().contiguous()
    x = (v if v.dtype in (torch.float32, torch.float64) else v.to(torch.float32)).numpy()
    x = x.reshape(x.shape[0], int(np.prod(x.shape[1:]))).astype(np.float64)  # -1 cannot be inferred for 0 tokens
    width = max(x.shape[1], 1)
    stats = np.zeros((lens.size, len(STATS)), dtype=np.float64)
    keep = lens > 0
    if keep.any():
        starts = (np.cumsum(lens) - lens)[keep]
        stats[keep, 0] = np.sqrt(np.add.reduceat(np.einsum("ij,ij->i", x, x), starts))
        stats[keep, 1] = np.maximum.reduceat(np.abs(x).max(axis=1), starts) if x.shape[1] else 0.0
        stats[keep, 2] = np.add.reduceat(x.sum(axis=1), starts) / (lens[keep] * width)
    return torch.from_numpy(stats), row_digests(v, lens.tolist())


def row_digests(values: torch.Tensor, row_tokens: list[int]) -> list[str]:
    """The SHA-256 of each row's bytes (rows of ``row_tokens`` tokens each, in order), over zero-copy slices."""
    import torch
    v = values.detach().contiguous()
    raw = v.view(torch.uint8).numpy().data.cast("B") if v.numel() else memoryview(b"")  # no tokens: empty rows
    row_bytes = int(v.element_size()) * (int(v[0].numel()) if v.shape[0] else 0)
    digests, start = [], 0
    for k in row_tokens:
        digests.append(sha256_bytes(raw[start:start + k * row_bytes]))
        start += k * row_bytes
    return digests


@dataclass(frozen=True)
class Site:
    """One traced output: ``values`` [tokens, width] over every logical row's unpadded tokens."""

    name: str
    kind: str
    values: torch.Tensor
    stats: torch.Tensor          # float64 [rows, 3]: l2, max_abs, mean
    sha256: tuple[str, ...]      # one per logical row

    @property
    def dtype(self) -> str:
        return dtype_name(self.values.dtype)

    @property
    def width(self) -> int:
        return int(self.values.shape[1])


@dataclass(frozen=True)
class Param:
    """One trainable parameter: its accumulated gradient before clipping and its update."""

    name: str
    grad: torch.Tensor
    update: torch.Tensor
    grad_sha256: str
    update_sha256: str


def make_param(name: str, grad: torch.Tensor, update: torch.Tensor) -> Param:
    g, u = grad.detach().to("cpu").contiguous(), update.detach().to("cpu").contiguous()
    return Param(name, g, u, sha256_bytes(_row_bytes(g)), sha256_bytes(_row_bytes(u)))


@dataclass(frozen=True)
class Trace:
    identity: dict[str, Any]
    row_tokens: torch.Tensor      # int64 [rows]: unpadded tokens per logical row
    row_micro_batch: torch.Tensor  # int64 [rows]: which micro-batch processed the row
    forward: list[Site]
    backward: list[Site]
    params: list[Param]
    untraced: list[str] = field(default_factory=list)
    path: Path | None = None

    @property
    def rows(self) -> int:
        return int(self.row_tokens.numel())


def _stack_digests(digests: list[tuple[str, ...]], rows: int) -> torch.Tensor:
    import torch
    raw = b"".join(bytes.fromhex(d) for ds in digests for d in ds)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(len(digests), rows, 32).clone() \
        if raw else torch.zeros((len(digests), rows, 32), dtype=torch.uint8)


def _sites_tensors(prefix: str, sites: list[Site], rows: int) -> dict[str, torch.Tensor]:
    import torch
    out = {f"{prefix}.{k:04d}.values": s.values.contiguous() for k, s in enumerate(sites)}
    out[f"{prefix}.stats"] = (torch.stack([s.stats for s in sites]) if sites
                              else torch.zeros((0, rows, len(STATS)), dtype=torch.float64))
    out[f"{prefix}.sha256"] = _stack_digests([s.sha256 for s in sites], rows)
    return out


def _param_stats(p: Param) -> list[float]:
    import torch
    g, u = p.grad.to(torch.float64), p.update.to(torch.float64)
    return [float(torch.linalg.vector_norm(g)), float(g.abs().max()) if g.numel() else 0.0,
            float(torch.linalg.vector_norm(u)), float(u.abs().max()) if u.numel() else 0.0]


def write_trace(run_dir: str | Path, trace: Trace) -> tuple[Path, str]:
    """Write ``RUN_DIR/trace/`` (payload, then the index last); return the index path and its SHA-256."""
    import torch

    d = Path(run_dir) / TRACE_DIR
    rows = trace.rows
    tensors: dict[str, torch.Tensor] = {"rows.tokens": trace.row_tokens.to(torch.int64).contiguous(),
                                        "rows.micro_batch": trace.row_micro_batch.to(torch.int64).contiguous()}
    tensors.update(_sites_tensors("forward", trace.forward, rows))
    tensors.update(_sites_tensors("backward", trace.backward, rows))
    for k, p in enumerate(trace.params):
        tensors[f"param.{k:04d}.grad"] = p.grad
        tensors[f"param.{k:04d}.update"] = p.update
    tensors["param.stats"] = torch.tensor([_param_stats(p) for p in trace.params], dtype=torch.float64) \
        .reshape(len(trace.params), len(PARAM_STATS))
    tensors["param.sha256"] = _stack_digests([(p.grad_sha256, p.update_sha256) for p in trace.params], 2)
    payload = tensorfile.encode(tensors, metadata={"format": TRACE_SCHEMA}, where=d / PAYLOAD_FILE).data
    atomic_write_bytes(d / PAYLOAD_FILE, payload, exclusive=True)
    index = {
        "schema": TRACE_SCHEMA,
        "identity": {k: trace.identity[k] for k in IDENTITY_KEYS},
        "payload": {"file": PAYLOAD_FILE, "sha256": sha256_bytes(payload), "bytes": len(payload)},
        "rows": rows, "tokens": int(trace.row_tokens.sum()),
        "stats": list(STATS), "param_stats": list(PARAM_STATS),
        "forward": [{"name": s.name, "kind": s.kind, "dtype": s.dtype, "width": s.width} for s in trace.forward],
        "backward": [{"name": s.name, "kind": s.kind, "dtype": s.dtype, "width": s.width}
                     for s in trace.backward],
        "params": [{"name": p.name, "dtype": dtype_name(p.grad.dtype), "shape": list(p.grad.shape)}
                   for p in trace.params],
        "untraced": sorted(trace.untraced),
    }
    data = pretty_bytes(index)
    atomic_write_bytes(d / INDEX_FILE, data, exclusive=True)  # last: declares the trace complete
    return d / INDEX_FILE, sha256_bytes(data)


# ---------------------------------------------------------------------------------------------- reading

FloatDtype = Literal["F32", "F64", "F16", "BF16"]  # _FLOATS, as the index declares a site's or parameter's dtype


class TraceIdentity(Document, frozen=True):
    """What replay a trace is of (traces of different captures are never compared)."""

    manifest_sha256: Digest
    logical_batch_sha256: Digest
    initial_adapter_sha256: Digest
    arm: Printable
    repeat_index: Count
    micro_batch_size: Count
    gradient_checkpointing: bool
    device: Printable
    torch_version: Printable
    fault: str | None  # the test-only perturbation the replay ran with (REPLAYJOB_TRACE_FAULT), else null


class TracePayloadPin(Document, frozen=True):
    file: Literal["trace.safetensors"]
    sha256: Digest
    bytes: Count


class TraceSiteEntry(Document, frozen=True):
    name: Printable
    kind: Printable
    dtype: FloatDtype
    width: Count


class TraceParamEntry(Document, frozen=True):
    name: Printable
    dtype: FloatDtype
    shape: Annotated[list[Count], msgspec.Meta(max_length=tensorfile.MAX_RANK)]


class TraceIndex(Document, frozen=True):
    """``trace/index.json`` (docs/trace-format.md): the payload's pin and a description of every tensor in it.
    The statistics' names are the ones this version writes; a site or parameter named twice is refused."""

    schema: Literal["replayjob.trace/v1"]
    identity: TraceIdentity
    payload: TracePayloadPin
    rows: Positive  # a replayed update has a row, and every row a token: a trace of none compares nothing
    tokens: Positive
    stats: list[Literal["l2", "max_abs", "mean"]]
    param_stats: list[Literal["grad_l2", "grad_max_abs", "update_l2", "update_max_abs"]]
    forward: list[TraceSiteEntry]
    backward: list[TraceSiteEntry]
    params: list[TraceParamEntry]
    untraced: list[Printable]

    def __post_init__(self) -> None:
        if tuple(self.stats) != STATS or tuple(self.param_stats) != PARAM_STATS:
            raise ValueError(f"`stats` and `param_stats` must be {list(STATS)} and {list(PARAM_STATS)}")
        for key in ("forward", "backward", "params"):
            names = [e.name for e in getattr(self, key)]
            dups = sorted({n for n in names if names.count(n) > 1})
            if dups:
                raise ValueError(f"`{key}` names {len(dups)} site(s) more than once: {dups[:5]}")


def _fail(where: Path, message: str) -> IntegrityError:
    return IntegrityError(f"trace refused: {message}", where=where, hint=_HINT)


def _expect(cond: bool, where: Path, message: str) -> None:
    if not cond:
        raise _fail(where, message)


def _read_index(d: Path, expected_sha256: str | None) -> TraceIndex:
    p = d / INDEX_FILE
    if not p.exists():
        if (d / PAYLOAD_FILE).exists():
            raise RefusedError("trace is incomplete: the payload exists but index.json (written last) does not",
                               where=d, hint="the replay was interrupted; " + _HINT)
        raise RefusedError("no trace here", where=d, hint="replay with --trace (or optimizer_batch.trace = true)")
    data = read_regular_bytes(p, max_bytes=MAX_INDEX_BYTES, follow_symlinks=False, what="trace index")
    if expected_sha256 is not None:
        pin = normalize_digest(expected_sha256, what="the trace index SHA-256")
        if sha256_bytes(data) != pin:
            raise IntegrityError(f"trace index SHA-256 is {sha256_bytes(data)}, replay_metrics.json pins {pin}",
                                 where=p, hint="the trace changed after the replay; " + _HINT)
    try:
        return decode(loads_strict(data, where=p), TraceIndex, where=p)
    except IntegrityError as exc:
        raise _fail(p, exc.message) from None


def _sites(doc: TraceIndex, tensors: dict[str, torch.Tensor], prefix: str, where: Path) -> list[Site]:
    import torch
    rows, tokens = doc.rows, doc.tokens
    entries: list[TraceSiteEntry] = getattr(doc, prefix)
    stats, digests = tensors[f"{prefix}.stats"], tensors[f"{prefix}.sha256"]
    _expect(tuple(stats.shape) == (len(entries), rows, len(STATS)) and stats.dtype == torch.float64, where,
            f"{prefix}.stats has shape {tuple(stats.shape)}")
    _expect(tuple(digests.shape) == (len(entries), rows, 32) and digests.dtype == torch.uint8, where,
            f"{prefix}.sha256 has shape {tuple(digests.shape)}")
    out = []
    for k, e in enumerate(entries):
        v = tensors[f"{prefix}.{k:04d}.values"]
        _expect(tuple(v.shape) == (tokens, e.width) and v.dtype == tensorfile.torch_dtype(e.dtype),
                where, f"{prefix} site {e.name!r}: values {v.dtype}{tuple(v.shape)} do not match the index")
        hexes = tuple(bytes(digests[k, i].tolist()).hex() for i in range(rows))
        own, actual = row_stats(v, tensors["rows.tokens"])  # never trust recorded tables: recompute
        bad = [i for i in range(rows) if actual[i] != hexes[i]]
        _expect(not bad, where, f"{prefix} site {e.name!r}: the recorded SHA-256 of {len(bad)} row(s) (first: "
                                f"row {bad[0] if bad else 0}) does not match the values' bytes")
        _expect(_same_stats(stats[k], own), where, f"{prefix} site {e.name!r}: the recorded statistics "
                                                   f"({', '.join(STATS)}) are not the values'")
        out.append(Site(e.name, e.kind, v, own, tuple(actual)))
    return out


def _same_stats(recorded: torch.Tensor, own: torch.Tensor) -> bool:
    """Recorded statistics equal to the ones recomputed from the values but for float rounding (another machine
    may sum in another order): each within 1e-6 of its own size plus 1e-9 of its row's largest figure, a NaN
    where the values give NaN and nowhere else."""
    import torch

    if recorded.shape != own.shape:
        return False
    nan = torch.isnan(own)
    if not torch.equal(torch.isnan(recorded), nan):
        return False
    a, b = recorded.masked_fill(nan, 0.0), own.masked_fill(nan, 0.0)
    if not torch.equal(torch.isinf(a), torch.isinf(b)) or not torch.equal(a[torch.isinf(a)], b[torch.isinf(b)]):
        return False
    a, b = a.masked_fill(torch.isinf(a), 0.0), b.masked_fill(torch.isinf(b), 0.0)
    scale = b.abs().amax(dim=-1, keepdim=True) if b.ndim else b.abs()
    return bool(((a - b).abs() <= 1e-6 * b.abs() + 1e-9 * scale).all())


def read_trace(run_dir: str | Path, expected_index_sha256: str | None = None) -> Trace:
    """Read and verify ``RUN_DIR/trace/`` (or a trace directory itself); refuse anything inconsistent,
    and a trace reached through a symbolic link below ``run_dir`` (a linked ``trace/`` or file)."""
    import torch

    root = d = Path(run_dir)
    if d.name != TRACE_DIR and (d / TRACE_DIR).is_dir():
        d = d / TRACE_DIR
    for name in (INDEX_FILE, PAYLOAD_FILE):
        check_no_symlinks(root, d / name, what="trace")
    doc = _read_index(d, expected_index_sha256)
    pay = d / PAYLOAD_FILE
    tensors = tensorfile.load(pay, expected_sha256=doc.payload.sha256, follow_symlinks=False,
                              dtypes={"F16", "BF16", "F32", "F64", "I64", "U8"})
    size = pay.stat().st_size  # the bytes just verified against the pin: the index's count is a summary of them
    _expect(size == doc.payload.bytes, pay, f"the index records a payload of {doc.payload.bytes} bytes, the pinned "
                                            f"payload holds {size}")
    names = {"rows.tokens", "rows.micro_batch", "param.stats", "param.sha256"}
    for prefix in ("forward", "backward"):
        names |= {f"{prefix}.stats", f"{prefix}.sha256"} | {f"{prefix}.{k:04d}.values"
                                                              for k in range(len(getattr(doc, prefix)))}
    names |= {f"param.{k:04d}.{w}" for k in range(len(doc.params)) for w in ("grad", "update")}
    extra, missing = sorted(set(tensors) - names), sorted(names - set(tensors))
    _expect(not extra and not missing, pay, f"tensors do not match the index (missing {missing[:3]}, "
                                            f"extra {extra[:3]})")
    rt, mb = tensors["rows.tokens"], tensors["rows.micro_batch"]
    _expect(rt.dtype == torch.int64 and tuple(rt.shape) == (doc.rows,) and bool((rt >= 0).all())
            and sum(rt.tolist()) == doc.tokens, pay, "rows.tokens does not match the index")  # exact: no int64 wrap
    _expect(mb.dtype == torch.int64 and tuple(mb.shape) == (doc.rows,) and bool((mb >= 0).all()), pay,
            "rows.micro_batch is not one micro-batch index (>= 0) per row")
    params = []
    pst = tensors["param.sha256"]
    _expect(tuple(pst.shape) == (len(doc.params), 2, 32) and pst.dtype == torch.uint8, pay,
            f"param.sha256 is {pst.dtype}{tuple(pst.shape)}, not uint8 [{len(doc.params)}, 2, 32]")
    for k, e in enumerate(doc.params):
        g, u = tensors[f"param.{k:04d}.grad"], tensors[f"param.{k:04d}.update"]
        _expect(list(g.shape) == e.shape == list(u.shape) and g.dtype == u.dtype == tensorfile.torch_dtype(e.dtype),
                pay, f"parameter {e.name!r} does not match the index")
        recorded = (bytes(pst[k, 0].tolist()).hex(), bytes(pst[k, 1].tolist()).hex())
        actual = (sha256_bytes(_row_bytes(g)), sha256_bytes(_row_bytes(u)))
        _expect(recorded == actual, pay, f"parameter {e.name!r}: the recorded gradient or update SHA-256 does "
                                         "not match the tensors' bytes")
        params.append(Param(e.name, g, u, *actual))
    pstats = tensors["param.stats"]
    own = torch.tensor([_param_stats(p) for p in params], dtype=torch.float64).reshape(len(params), len(PARAM_STATS))
    _expect(pstats.dtype == torch.float64 and tuple(pstats.shape) == tuple(own.shape) and _same_stats(pstats, own),
            pay, f"param.stats ({pstats.dtype}{tuple(pstats.shape)}) is not the parameters' statistics "
                 f"({', '.join(PARAM_STATS)}, float64 [{len(params)}, {len(PARAM_STATS)}])")
    return Trace(identity=msgspec.to_builtins(doc.identity), row_tokens=rt, row_micro_batch=mb,
                 forward=_sites(doc, tensors, "forward", pay), backward=_sites(doc, tensors, "backward", pay),
                 params=params, untraced=list(doc.untraced), path=d)
