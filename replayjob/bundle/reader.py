"""Strict bundle reader: format, integrity, safety and dependency closure before any use.

:func:`load_bundle` returns a :class:`Bundle` only when everything holds, in this order: the
directory is complete (``COMPLETE`` present, the manifest digest it records matches), it is not a
format 1.x bundle (refused by version), no symlink, directory, pickle-capable or unknown file is in
it, the manifest and its index and expected sections match their schemas, ``payloads.safetensors``
is a regular file of the declared size whose header block and every tensor's bytes match their
SHA-256 and whose tensors have the declared dtypes and shapes (token ids in the tokenizer's range),
every ``recompute`` stage has its inputs, and every group recomputed closes.  A
multi-rank root is read only when its final ``COMPLETE`` exists, its rank list equals the
``expected_ranks`` of every ``COMPLETE.<r>`` and every rank manifest, every listed rank is
there, every rank's ``manifest.json`` has the SHA-256 the root records for it (compared before
the manifest is parsed, whatever it says), every rank manifest is a rank manifest of this root
(``multi_rank`` set, naming the directory's rank, the root's ranks, run id and bundle id; ranks of
two runs are refused, naming both ids) and the ranks share one schema (payload dtypes and roles,
recorded outputs); a ``rank-<r>/`` directory passed directly is read against its root the same
way, and refused until its root is complete.

Threat model: a bundle is untrusted input copied between machines.  Payloads load through
:mod:`replayjob.tensorfile` (strict header checks) from bytes already hashed (no re-read between
hash and parse); pickle is never loaded; the only files read have fixed names, so nothing read can
lie outside the bundle.
"""

from __future__ import annotations

import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from replayjob import tensorfile
from replayjob.artifacts.bundle import (
    FLOAT_DTYPES,
    LEGACY_ROOT_KEYS,
    PAYLOAD_DOMAINS,
    PAYLOAD_DTYPES,
    BundleComplete,
    RankComplete,
    RootComplete,
)
from replayjob.bundle import format as fmt
from replayjob.bundle.mask import MaskRows
from replayjob.bundle.schema import check_closure, check_groups, check_shapes, check_tokens, decode_manifest
from replayjob.declaration import decode
from replayjob.digest import sha256_bytes
from replayjob.errors import ContractError, IntegrityError, ReplayjobError
from replayjob.fsio import read_regular_bytes
from replayjob.jsonio import DEFAULT_MAX_BYTES, loads_strict, read_json_object
from replayjob.model.tokenizer import ByteTokenizer

if TYPE_CHECKING:
    from torch import Tensor

PARALLEL_FILES = 4  # payload tensors read at once, at most
PARALLEL_MIN_BYTES = 32 * 1024 * 1024  # below this, threads cost more than they save
_TOP = {fmt.MANIFEST, fmt.PAYLOAD_FILE, fmt.COMPLETE}


@dataclass
class LossCohort:
    """Rows whose loss was one scalar (one rank's shard), with the recorded value."""

    rank: int
    rows: list[int]
    loss: float | None


@dataclass
class Bundle:
    """A validated bundle (for a multi-rank root: all ranks merged in rank order)."""

    path: Path
    manifest: dict[str, Any]
    index: dict[str, Any]
    expected: dict[str, Any]
    payloads: dict[str, Tensor]
    ranks: list[int] | None = None
    loss_cohorts: list[LossCohort] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return str(self.manifest["kind"])

    @property
    def samples(self) -> list[dict[str, Any]]:
        samples: list[dict[str, Any]] = self.index["samples"]
        return samples

    @property
    def config(self) -> dict[str, Any]:
        return dict(self.index["config"])

    def capability(self, stage: str) -> str:
        return str(self.manifest["stages"][stage]["capability"])


def is_multi_rank_root(path: Path) -> bool:
    return not (path / fmt.MANIFEST).exists() and (
        any(path.glob("rank-*")) or any(path.glob(f"{fmt.COMPLETE}.*")))


def is_bundle(path: Path) -> bool:
    """A bundle directory or multi-rank root, complete or not (what a capture directory holds)."""
    return (path / fmt.MANIFEST).exists() or (path / fmt.COMPLETE).exists() or is_multi_rank_root(path)


def _check_dir(path: Path) -> None:
    try:
        st = os.lstat(path)
    except OSError:
        raise IntegrityError("bundle not found", where=path, hint="check the path") from None
    if stat.S_ISLNK(st.st_mode):
        raise IntegrityError("bundle directory is a symlink; symlinks are refused", where=path)
    if not stat.S_ISDIR(st.st_mode):
        raise IntegrityError("a bundle is a directory", where=path)


def _scan(path: Path) -> None:
    """Refuse symlinks, pickle-capable files, directories and unknown entries in a bundle."""
    with os.scandir(path) as it:
        entries = sorted((e.name, e) for e in it)
    for name, e in entries:
        p = path / name
        if e.is_symlink():
            raise IntegrityError("symlink inside the bundle; symlinks are refused", where=p,
                                 hint="copy the file into the bundle instead of linking it")
        if name.lower().endswith(fmt.PICKLE_SUFFIXES):
            raise IntegrityError("pickle-capable file inside the bundle; only safetensors payloads "
                                 "are accepted", where=p, hint="remove it; nothing reads pickle")
    unknown = sorted(name for name, _ in entries if name not in _TOP)
    if unknown:
        _refuse_v1(path)  # a format 1.x bundle is refused by its version, not as unknown entries
        raise IntegrityError(f"unknown entries {unknown} in the bundle (a bundle holds {sorted(_TOP)} only)",
                             where=path)
    dirs = [name for name, e in entries if e.is_dir(follow_symlinks=False)]
    if dirs:
        raise IntegrityError(f"unexpected directory {dirs[0]!r} inside the bundle", where=path / dirs[0])


def _read_bytes(p: Path, what: str) -> bytes:
    return read_regular_bytes(p, max_bytes=DEFAULT_MAX_BYTES, follow_symlinks=False, what=what)


def _refuse_v1(path: Path) -> None:
    """A format 1.x bundle (``index.json``, ``expected.json``, ``payloads/``) is refused by its version."""
    if not any(os.path.lexists(path / name) for name in fmt.V1_ENTRIES):
        return
    try:
        doc = loads_strict(_read_bytes(path / fmt.MANIFEST, "manifest.json"), where=path / fmt.MANIFEST)
    except IntegrityError:
        doc = None
    version = doc.get("format_version") if isinstance(doc, dict) else None
    if version is None:  # no readable manifest: the layout alone says it is 1.x
        raise fmt.version_error("1.x")
    fmt.check_version(version)  # a 2.x manifest beside 1.x entries: refused below as unknown entries


_NP_INTEGER = {"I64": np.int64, "I32": np.int32, "U8": np.uint8}  # fmt.INTEGER_DTYPES as NumPy reads them


class TokenIds:
    """A ``scan`` visitor: token-id payloads hold ids the tokenizer has, checked as their bytes stream past.

    An id below 0 is never a token (the byte tokenizer's decoder would drop it silently, and the reward
    be computed on another text); under the byte tokenizer ``response_ids`` are below its vocabulary
    size and ``label_ids`` (the label text's bytes) below 256.  Padding is 0, so every value is checked.
    The dtype (an integer one) is checked with the manifest, before the scan.
    """

    def __init__(self, tokenizer: str | None, sample_ids: list[str]):
        byte = tokenizer == "byte"
        self.bounds: dict[str, int | None] = {"response_ids": ByteTokenizer.vocab_size if byte else None,
                                              "label_ids": 256 if byte else None}
        self.sample_ids = sample_ids

    def __call__(self, spec: tensorfile.TensorSpec, piece: memoryview, first: int) -> None:
        """Check ``piece``: elements ``first ..`` of tensor ``spec``, just read and hashed."""
        import torch
        if spec.name not in self.bounds or spec.dtype not in fmt.INTEGER_DTYPES or len(spec.shape) != 2:
            return  # refused by the manifest or the header check
        dtype = tensorfile.torch_dtype(spec.dtype)
        count = len(piece) // dtype.itemsize
        if not count:
            return
        # One min and one max over the chunk on this thread (NumPy: no temporary arrays, and no wake-up of
        # Torch's intra-op pool from each hashing thread, which on a busy 2-core machine cost more than the
        # hashing); only a chunk that breaks the bound is searched for its first offending id.
        values = np.frombuffer(piece, dtype=_NP_INTEGER[spec.dtype], count=count)
        bound = self.bounds[spec.name]
        if values.min() >= 0 and (bound is None or values.max() < bound):
            return
        self._check(spec.name, torch.frombuffer(piece, dtype=dtype, count=count), first, spec.shape[1])

    def check_tensor(self, name: str, t: Tensor) -> None:
        """The same check on a whole ``[N, T]`` tensor (the writer, before it writes)."""
        import torch
        if name in self.bounds and t.dim() == 2 and not t.dtype.is_floating_point and t.dtype != torch.bool:
            self._check(name, t.reshape(-1), 0, t.shape[1])

    def _check(self, name: str, values: Tensor, first: int, width: int) -> None:
        bound = self.bounds[name]
        bad = values < 0 if bound is None else (values < 0) | (values >= bound)
        if bool(bad.any()):
            k = int(bad.nonzero()[0, 0])
            row, col = divmod(first + k, max(1, width))
            sample = self.sample_ids[row] if row < len(self.sample_ids) else f"row {row}"
            allowed = "integers >= 0" if bound is None else f"integers in [0, {bound})"
            raise IntegrityError(f"payload {name!r} holds token id {int(values[k])} (sample {sample!r}, token "
                                 f"{col}): token ids are {allowed}", where=fmt.payload_where(name),
                                 hint="record the ids the tokenizer produced (pad with 0); a negative or unknown id "
                                      "would be dropped when the text is decoded")


_NP_FLOAT = {"F64": np.float64, "F32": np.float32, "F16": np.float16}  # BF16 is read by its exponent bits
_PER_TOKEN_FLOATS = tuple(n for n, d in PAYLOAD_DTYPES.items() if d == FLOAT_DTYPES)


class _ResponseRows:
    """What a per-token ``scan`` visitor knows of the samples: each one's ``response_length`` and id."""

    def __init__(self, lengths: list[int], sample_ids: list[str]):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.sample_ids = sample_ids

    def judges(self, spec: tensorfile.TensorSpec, names: Any) -> bool:
        """``spec`` is one of ``names``, a floating ``[N, T]`` payload of these samples (anything else is refused
        by the manifest or the header check)."""
        return (spec.name in names and spec.dtype in FLOAT_DTYPES and len(spec.shape) == 2
                and spec.shape[0] == len(self.lengths))


class FinitePadding(_ResponseRows):
    """A ``scan`` visitor: the positions past a sample's ``response_length`` (its padding) hold finite values in
    every per-token floating payload (log-probabilities, KL, advantages, loss weights).

    The stages weigh every position by the mask (``kl * mask``, ``sum(weights * token_loss)``), as the trainer
    does: a zero-weighted NaN or infinity is still NaN, so a non-finite pad would make the recomputed stage (the
    whole loss of its rank) NaN and read as a divergence the trainer, which saw finite pads, never had.  A
    non-finite value inside the response is evidence and is left to the comparison.
    """

    def __call__(self, spec: tensorfile.TensorSpec, piece: memoryview, first: int) -> None:
        """Check ``piece``: elements ``first ..`` of tensor ``spec``, just read and hashed."""
        if not self.judges(spec, _PER_TOKEN_FLOATS):
            return
        if spec.dtype == "BF16":  # an all-ones exponent: NaN or an infinity
            bits = np.frombuffer(piece, dtype=np.uint16, count=len(piece) // 2)
            bad = (bits & 0x7F80) == 0x7F80
        else:
            np_dtype = np.dtype(_NP_FLOAT[spec.dtype])
            values = np.frombuffer(piece, dtype=np_dtype, count=len(piece) // np_dtype.itemsize)
            bad = ~np.isfinite(values)
        if bad.any():
            self._check(spec.name, np.flatnonzero(bad), first, spec.shape[1], spec.dtype, piece)

    def check_tensor(self, name: str, t: Tensor) -> None:
        """The same check on a whole ``[N, T]`` tensor (the writer, before it writes)."""
        import torch
        if name in _PER_TOKEN_FLOATS and t.dim() == 2 and t.dtype.is_floating_point and t.shape[0] == len(self.lengths):
            bad = ~torch.isfinite(t.reshape(-1))
            if bool(bad.any()):
                flat = t.reshape(-1)
                where = bad.nonzero()[:, 0].numpy()
                self._raise_first(name, where, 0, t.shape[1], lambda k: float(flat[k]))

    def _check(self, name: str, where: np.ndarray, first: int, width: int, dtype: str, piece: memoryview) -> None:
        import torch
        tdtype = tensorfile.torch_dtype(dtype)
        values = torch.frombuffer(piece, dtype=tdtype, count=len(piece) // tdtype.itemsize)
        self._raise_first(name, where, first, width, lambda k: float(values[k - first]))

    def _raise_first(self, name: str, where: np.ndarray, first: int, width: int, value: Any) -> None:
        flat = where.astype(np.int64) + first
        rows, cols = np.divmod(flat, max(1, width))
        pad = cols >= self.lengths[rows]
        if not pad.any():
            return
        k = int(np.flatnonzero(pad)[0])
        row, col = int(rows[k]), int(cols[k])
        raise IntegrityError(f"payload {name!r} holds {value(int(flat[k]))} at padding (sample "
                             f"{self.sample_ids[row]!r}, token {col}, past its response_length="
                             f"{int(self.lengths[row])}): padding is finite", where=fmt.payload_where(name),
                             hint="pad per-token payloads with finite values (0): every position is weighed by the "
                                  "mask, and a NaN or an infinity there, weighed by 0, is still NaN")


class InDomain(_ResponseRows):
    """A ``scan`` visitor: inside each sample's response (its first ``response_length`` tokens) a per-token payload
    with a declared domain (:data:`replayjob.artifacts.bundle.PAYLOAD_DOMAINS`: log-probabilities <= 0) holds no
    finite value outside it, checked as the payload's bytes stream past the hash.

    A re-sealed bundle whose log-probabilities were above 0 (probabilities above 1, no value a trainer consumed)
    was validated and recomputed like any other, and with its recorded loss recomputed from them passed.  Non-finite
    values inside the response are evidence (:class:`FinitePadding` judges the padding), and padding may hold any
    finite value: only the response is judged.
    """

    def __call__(self, spec: tensorfile.TensorSpec, piece: memoryview, first: int) -> None:
        """Check ``piece``: elements ``first ..`` of tensor ``spec``, just read and hashed."""
        if not self.judges(spec, PAYLOAD_DOMAINS):
            return
        if spec.dtype == "BF16":  # a bfloat16 is the high half of the float32 of the same value: exact
            bits = np.frombuffer(piece, dtype=np.uint16, count=len(piece) // 2)
            values = (bits.astype(np.uint32) << 16).view(np.float32)
        else:
            np_dtype = np.dtype(_NP_FLOAT[spec.dtype])
            values = np.frombuffer(piece, dtype=np_dtype, count=len(piece) // np_dtype.itemsize)
        self._check(spec.name, values, first, spec.shape[1])

    def check_tensor(self, name: str, t: Tensor) -> None:
        """The same check on a whole ``[N, T]`` tensor (the writer, before it writes)."""
        import torch
        if name in PAYLOAD_DOMAINS and t.dim() == 2 and t.dtype.is_floating_point and t.shape[0] == len(self.lengths):
            self._check(name, t.detach().to("cpu", torch.float64).reshape(-1).numpy(), 0, t.shape[1])

    def _check(self, name: str, values: np.ndarray, first: int, width: int) -> None:
        domain = PAYLOAD_DOMAINS[name]
        if not values.size or domain.first_outside(values) is None:  # the common case: one pass, nothing found
            return
        rows, cols = np.divmod(np.arange(first, first + values.size, dtype=np.int64), max(1, width))
        inside = np.flatnonzero(cols < self.lengths[rows])
        found = domain.first_outside(values[inside])
        if found is None:  # only padding is outside: any finite pad is allowed
            return
        k = int(inside[found[0]])
        row, col = int(rows[k]), int(cols[k])
        raise IntegrityError(domain.reason(f"payload {name!r}", found[1], f"sample {self.sample_ids[row]!r}, token "
                                           f"{col} (inside its response_length={int(self.lengths[row])})"),
                             where=fmt.payload_where(name),
                             hint="record the log-probabilities the trainer computed (a log-softmax is never above "
                                  "0); capture the step again")


def _visit_all(*visitors: tensorfile.Visitor) -> tensorfile.Visitor:
    def visit(spec: tensorfile.TensorSpec, piece: memoryview, first: int) -> None:
        for v in visitors:
            v(spec, piece, first)
    return visit


def _load_payloads(path: Path, manifest: dict[str, Any], keep: bool, rows: MaskRows,
                   ids: TokenIds, pads: FinitePadding, domains: InDomain) -> dict[str, Tensor]:
    """One read of ``payloads.safetensors``: size, header SHA-256 and every tensor's SHA-256 first,
    then the header, BOOL bytes, mask rows, token ids, finite padding and log-probabilities <= 0 inside the
    responses checked on those very bytes.

    The header block and each tensor's bytes are hashed on their own (together they tile the file,
    so every byte is pinned); with 32 MiB or more, up to four threads read and hash tensors at once
    (SHA-256 and file reads release the GIL).  With ``keep`` the tensors are zero-copy views over
    the bytes read; without it (validation only) the file streams through a chunk buffer and
    ``meta`` tensors of the declared dtypes and shapes stand in (any numeric use fails loudly).
    """
    import torch
    specs, pf = manifest["payloads"], manifest["payload_file"]
    p = path / fmt.PAYLOAD_FILE
    try:
        st = os.lstat(p)
    except OSError:
        if pf is None:
            return {}
        raise IntegrityError(f"the payload file {fmt.PAYLOAD_FILE} is missing", where=p,
                             hint="the bundle is incomplete; capture it again") from None
    if pf is None:
        raise IntegrityError(f"undeclared {fmt.PAYLOAD_FILE}: the manifest declares no payloads", where=p)
    if not stat.S_ISREG(st.st_mode):
        raise IntegrityError(f"{fmt.PAYLOAD_FILE} is not a regular file (symlinks are refused)", where=p)
    workers = min(PARALLEL_FILES, len(specs)) if int(pf["bytes"]) >= PARALLEL_MIN_BYTES else 1
    scanned = tensorfile.scan(p, keep=keep, schema=fmt.payload_schema({n: s["dtype"] for n, s in specs.items()}),
                              digest="spans", visit=_visit_all(rows, ids, pads, domains), workers=workers,
                              follow_symlinks=False)
    header_sha = (scanned.header_sha256 or b"").hex()
    if scanned.size != pf["bytes"] or header_sha != pf["header_sha256"]:
        raise IntegrityError(f"checksum mismatch for {fmt.PAYLOAD_FILE}: {scanned.size} bytes, header sha256 "
                             f"{header_sha[:16]}..., manifest says {pf['bytes']} bytes, "
                             f"{pf['header_sha256'][:16]}...", where=p,
                             hint="the payload file was modified or truncated")
    if scanned.header is None:  # the pinned header itself is malformed or is not the declared tensors
        scanned.validated()
    for name in sorted(specs):  # the header passed the schema: it holds exactly the declared tensors
        sha = scanned.tensor_sha256[name].hex()
        if sha != specs[name]["sha256"]:
            raise IntegrityError(f"checksum mismatch for payload {name!r}: sha256 {sha[:16]}..., manifest says "
                                 f"{specs[name]['sha256'][:16]}...", where=fmt.payload_where(name),
                                 hint="the payload was modified")
    header = scanned.validated()  # strict header, schema, BOOL bytes, mask rows, token ids, padding: hashed bytes
    for name, spec in specs.items():
        ts = header.tensors[name]
        if ts.dtype != spec["dtype"] or list(ts.shape) != spec["shape"]:
            raise IntegrityError(f"payload {name!r} is {ts.dtype} {list(ts.shape)}, manifest says {spec['dtype']} "
                                 f"{spec['shape']}", where=fmt.payload_where(name))
    # One row per sample, one width, before the mask's element count is compared (a mask of other rows is never read).
    check_shapes(len(rows.lengths), {n: list(header.tensors[n].shape) for n in sorted(specs)})
    if "mask" in specs and rows.checked != math.prod(specs["mask"]["shape"]):  # never expected: fail closed
        raise IntegrityError(f"payload 'mask': only {rows.checked} values were checked",
                             where=fmt.payload_where("mask"))
    if not keep:
        return {n: torch.empty(header.tensors[n].shape, dtype=tensorfile.torch_dtype(specs[n]["dtype"]), device="meta")
                for n in sorted(specs)}
    tensors = scanned.tensors()
    return {n: tensors[n] for n in sorted(specs)}


_REFUSED_HINT = ("a bundle is read only as replayjob's BundleWriter wrote it (every check is the writer's too); "
                 "capture the bundle again rather than editing it")
_TOPOLOGY_HINT = ("this replayjob recomputes only what docs/bundle-format.md lists; declare the stage recorded-only "
                  "or unsupported")


def _placed(exc: ReplayjobError, base: Path, inside: bool) -> ReplayjobError:
    """``exc`` naming where in ``base`` its fault lies, and how to fix it.

    The bundle's checks name a place inside a bundle (``manifest.json: index: samples``, ``payloads.safetensors:
    mask``), the same for every bundle and every rank of a root: the reader anchors it at the bundle directory
    (``inside``: ``<bundle>/manifest.json: ...``) or, for a check over every rank of a root, at the root
    (``<root>: manifest.json: ...``).  A refusal without a fix gets the bundle's (capture again; for an unsupported
    topology, what this replayjob recomputes)."""
    where = exc.where
    if where is None:
        exc.where = str(base)
    elif not os.path.isabs(where.split(":", 1)[0]):
        exc.where = str(base / where) if inside else f"{base}: {where}"
    if exc.hint is None:
        exc.hint = _TOPOLOGY_HINT if isinstance(exc, ContractError) else _REFUSED_HINT
    return exc


def _load_single(path: Path, tensors: bool = True, root: RootRecord | None = None) -> Bundle:
    """One bundle directory; ``root``: what its multi-rank root records, when it is a rank directory (read from
    the parent when ``path`` is ``rank-<r>/`` of a root and no record is given).  A refusal names the place in
    this directory it found the fault (:func:`_placed`)."""
    try:
        return _read_single(path, tensors, root)
    except ReplayjobError as exc:
        raise _placed(exc, path, inside=True) from None


def _read_single(path: Path, tensors: bool, root: RootRecord | None) -> Bundle:
    _check_dir(path)
    if not (path / fmt.COMPLETE).exists() and not (path / fmt.COMPLETE).is_symlink():
        raise IntegrityError("incomplete bundle: COMPLETE is missing (the writer did not finish)", where=path,
                             hint="wait for the capture to finish or capture again")
    _scan(path)
    complete = decode(loads_strict(_read_bytes(path / fmt.COMPLETE, "COMPLETE"), where=path / fmt.COMPLETE),
                      BundleComplete, where=path / fmt.COMPLETE,
                      hint="COMPLETE is written last by the bundle's writer; capture the bundle again")
    mbytes = _read_bytes(path / fmt.MANIFEST, "manifest.json")
    manifest_sha = sha256_bytes(mbytes)
    if manifest_sha != complete.manifest_sha256:
        raise IntegrityError("checksum mismatch: manifest.json does not match the digest in COMPLETE",
                             where=path / fmt.MANIFEST, hint="the manifest was modified after capture")
    if root is None and _in_root(path):  # a rank directory passed alone: its root is read all the same
        root = _read_root(path.parent)
    rank = None if root is None else _rank_pinned(path, root, manifest_sha)  # before the manifest is parsed
    manifest = decode_manifest(loads_strict(mbytes, where=path / fmt.MANIFEST), path / fmt.MANIFEST)
    if complete.bundle_id != manifest["bundle_id"]:
        raise IntegrityError("COMPLETE and manifest name different bundles", where=path)
    mr = manifest["multi_rank"]
    if root is None and mr is not None:
        raise IntegrityError(f"a rank bundle (multi_rank rank {mr['rank']}) lives in rank-{mr['rank']}/ of its "
                             f"multi-rank root, found {path.name}/", where=path,
                             hint="pass the multi-rank root (or its rank-<r>/ directory)")
    if root is not None and rank is not None:
        _check_rank_manifest(path, root, rank, manifest, manifest_sha)
    index, expected = manifest["index"], manifest["expected"]
    n = len(index["samples"])
    # Mask rows are checked against the recorded lengths as the mask's bytes stream past the hash.
    sample_ids = [s["sample_id"] for s in index["samples"]]
    lengths = [s["response_length"] for s in index["samples"]]
    rows = MaskRows(lengths, sample_ids)
    payloads = _load_payloads(path, manifest, tensors, rows, TokenIds(index["config"]["tokenizer"], sample_ids),
                              FinitePadding(lengths, sample_ids), InDomain(lengths, sample_ids))
    specs = manifest["payloads"]
    check_closure(manifest, index, expected, {k: (specs[k]["dtype"], list(v.shape)) for k, v in payloads.items()})
    _check_labels(payloads, index)
    loss = expected.get("loss.policy", {}).get("loss")
    return Bundle(path, manifest, index, expected, payloads,
                  loss_cohorts=[LossCohort(index["identity"]["physical"]["rank"], list(range(n)), loss)])


def _check_labels(payloads: dict[str, Tensor], index: dict[str, Any]) -> None:
    labels = payloads.get("label_ids")
    if labels is not None:
        for s in index["samples"]:
            if s["label_length"] is not None and s["label_length"] > labels.shape[1]:
                raise IntegrityError(f"label_length of sample {s['sample_id']!r} exceeds the label_ids width "
                                     f"{labels.shape[1]}", where=fmt.payload_where("label_ids"))


_ROOT_HINT = ("the root COMPLETE must record exactly format 'replayjob.bundle', bundle_id, run_id, ranks and "
              "rank_manifests, as the last rank to land writes it; capture the bundle again")
_RANK_HINT = ("a rank landing record holds exactly format, bundle_id, rank, expected_ranks, run_id and "
              "manifest_sha256, as the rank's writer writes it; capture the bundle again")


@dataclass(frozen=True)
class RootRecord:
    """What a multi-rank root's ``COMPLETE`` records about its ranks, agreed by every ``COMPLETE.<r>``.

    None of it is trusted: each rank directory's manifest is compared with it (:func:`_rank_pinned`,
    :func:`_check_rank_manifest`) whether or not that manifest says it is a rank's.
    """

    path: Path
    bundle_id: str
    run_id: str
    ranks: list[int]
    manifests: dict[str, str]  # rank -> SHA-256 of rank-<r>/manifest.json


def _read_root(root: Path) -> RootRecord:
    """The root ``COMPLETE`` cross-checked against every ``COMPLETE.<r>`` it lists.  Each is read through its
    declaration (:class:`RootComplete`, :class:`RankComplete`).

    The root's rank list must be exactly the ``expected_ranks`` each landed rank recorded, so a root
    that lists fewer ranks than its producers expected (a rank dropped, its records deleted) is
    refused, as is a landing record that names another rank, bundle or manifest, and a root whose
    ranks carry different run ids (two runs' ranks landed in one directory).
    """
    landed = sorted(p.name for p in root.glob(f"{fmt.COMPLETE}.*"))
    if not os.path.lexists(root / fmt.COMPLETE):  # a link, directory or FIFO is there: refused below, by what it is
        raise IntegrityError(f"multi-rank bundle is incomplete: the root COMPLETE is missing, so not every rank "
                             f"has landed (landed: {landed})", where=root,
                             hint="wait for every rank to flush or capture again")
    where = root / fmt.COMPLETE
    raw = read_json_object(where, follow_symlinks=False)
    if set(raw) == LEGACY_ROOT_KEYS:  # the root of a 2.0 or 2.1 multi-rank bundle: refused by version
        raise IntegrityError(f"this multi-rank root records no run id (written before bundle format "
                             f"{fmt.MULTI_RANK_VERSION}): its ranks cannot be shown to come from one run", where=where,
                             hint="capture the bundle again with this replayjob")
    doc = decode(raw, RootComplete, where=where, hint=_ROOT_HINT)
    ranks, manifests = doc.ranks, doc.rank_manifests
    found = {}
    for r in ranks:
        rec_path = root / f"{fmt.COMPLETE}.{r}"
        if not rec_path.exists() and not rec_path.is_symlink():
            raise IntegrityError(f"rank {r} is missing ({fmt.COMPLETE}.{r}); expected ranks {ranks}", where=root,
                                 hint="the producer of that rank did not land")
        found[r] = read_json_object(rec_path, follow_symlinks=False)  # a link, FIFO or directory: refused, named
    run_ids = {r: rec.get("run_id") for r, rec in found.items()}
    if len(set(map(repr, run_ids.values()))) > 1:  # before any other disagreement: the cause, named
        raise IntegrityError(fmt.run_mix(run_ids), where=root,
                             hint="capture into a new directory; a directory reused after a failed run keeps the "
                                  "dead run's ranks")
    for r, raw_rec in found.items():
        rec_path = root / f"{fmt.COMPLETE}.{r}"
        rec = decode(raw_rec, RankComplete, where=rec_path, hint=_RANK_HINT)
        if sorted(rec.expected_ranks) != ranks:
            raise IntegrityError(f"the root COMPLETE lists ranks {ranks} but rank {r}'s producer expected ranks "
                                 f"{rec.expected_ranks!r}: a partial root is refused", where=rec_path,
                                 hint="wait for every expected rank to land, or capture again")
        if rec.run_id != doc.run_id:
            raise IntegrityError(f"the ranks come from another run than the root COMPLETE: rank {r} carries run id "
                                 f"{rec.run_id!r}, the root COMPLETE records run id {doc.run_id!r}",
                                 where=rec_path, hint="capture into a new directory")
        if (rec.rank, rec.bundle_id, rec.manifest_sha256) != (r, doc.bundle_id, manifests[str(r)]):
            raise IntegrityError(f"{fmt.COMPLETE}.{r} disagrees with the root COMPLETE on the rank, the bundle id "
                                 "or the rank's manifest digest", where=rec_path)
    return RootRecord(root, doc.bundle_id, doc.run_id, list(ranks), dict(manifests))


_RANK_DIR = re.compile(r"rank-(0|[1-9][0-9]{0,17})")


def _in_root(path: Path) -> bool:
    """``path`` is a rank directory of a multi-rank root: named ``rank-*`` in a directory that is no bundle."""
    return path.name.startswith("rank-") and not os.path.lexists(path.parent / fmt.MANIFEST)


def _rank_pinned(rank_dir: Path, root: RootRecord, manifest_sha: str) -> int:
    """The rank ``rank_dir`` holds (from its name), whose manifest bytes must be those the root recorded for it."""
    m = _RANK_DIR.fullmatch(rank_dir.name)
    if m is None or int(m[1]) not in root.ranks:
        raise IntegrityError(f"{rank_dir.name}/ is not a rank directory of this multi-rank root (its ranks: "
                             f"{root.ranks})", where=rank_dir, hint="pass the multi-rank root")
    rank = int(m[1])
    pinned = root.manifests[str(rank)]
    if manifest_sha != pinned:
        raise IntegrityError(f"rank {rank}'s manifest is not the one its root recorded: rank-{rank}/manifest.json "
                             f"has SHA-256 {manifest_sha}, the root COMPLETE (and COMPLETE.{rank}) records "
                             f"{pinned}", where=rank_dir / fmt.MANIFEST,
                             hint="the rank directory was replaced or edited after it landed; capture the bundle "
                                  "again")
    return rank


def _check_rank_manifest(rank_dir: Path, root: RootRecord, rank: int, manifest: dict[str, Any],
                         manifest_sha: str) -> None:
    """A rank directory's manifest is that rank's of this root: rank, expected ranks, run id and bundle id."""
    mr, where = manifest["multi_rank"], rank_dir / fmt.MANIFEST
    if mr is None:
        raise IntegrityError(f"rank {rank}'s directory holds a single bundle (multi_rank null), not a rank of this "
                             f"multi-rank root (rank-{rank}/manifest.json SHA-256 {manifest_sha}, the root records "
                             f"{root.manifests[str(rank)]})", where=where,
                             hint="a rank directory holds only what that rank's writer wrote; capture the bundle again")
    if mr["rank"] != rank:
        raise IntegrityError(f"a rank bundle lives in rank-{mr['rank']}/, found {rank_dir.name}/", where=rank_dir)
    if mr["run_id"] != root.run_id:
        raise IntegrityError(f"the ranks come from different runs: rank {rank}'s manifest carries run id "
                             f"{mr['run_id']!r}, its root (and every landing record) run id {root.run_id!r}",
                             where=where, hint="capture into a new directory")
    if sorted(mr["expected_ranks"]) != root.ranks:
        raise IntegrityError(f"this rank's manifest expects ranks {sorted(mr['expected_ranks'])}, the root "
                             f"COMPLETE lists {root.ranks}: a partial root is refused", where=where)
    if manifest["bundle_id"] != root.bundle_id:
        raise IntegrityError(f"rank {rank}'s manifest names bundle {manifest['bundle_id']!r}, its root COMPLETE "
                             f"bundle {root.bundle_id!r}", where=where, hint="capture the bundle again")


def _load_root(root: Path, tensors: bool = True) -> Bundle:
    _check_dir(root)
    record = _read_root(root)
    ranks = record.ranks
    for entry in root.iterdir():
        ok = entry.name == fmt.COMPLETE or entry.name in {f"rank-{r}" for r in ranks} or entry.name in {
            f"{fmt.COMPLETE}.{r}" for r in ranks}
        if entry.is_symlink() or not ok:
            raise IntegrityError(f"unexpected entry {entry.name!r} in a multi-rank bundle (symlinks and "
                                 "unlisted ranks are refused)", where=entry)
    parts = []
    for r in ranks:
        d = root / f"rank-{r}"
        if os.path.lexists(d) and not d.is_dir():  # there, but no directory (links were refused above)
            raise IntegrityError(f"rank {r}'s rank-{r} is not a directory (a file, a device or a FIFO); a rank lands "
                                 "as a directory", where=d, hint="recapture the step into a new directory")
        if not d.is_dir():
            raise IntegrityError(f"rank {r} is missing (rank-{r}/); expected ranks {ranks}", where=root,
                                 hint="the producer of that rank did not land")
        parts.append(_load_single(root / f"rank-{r}", tensors, record))
    return merge(root, ranks, parts)


def _spec(spec: dict[str, Any] | None) -> str:
    return "absent" if spec is None else f"{spec['dtype']} ({spec['role']})"


def merge(root: Path, ranks: list[int], parts: list[Bundle]) -> Bundle:
    """Concatenate rank shards in rank order (per-token payloads padded to one T)."""
    import torch
    first = parts[0]
    for b in parts[1:]:
        for key in ("format_version", "bundle_id", "kind", "stages", "comparison", "redaction"):
            if b.manifest[key] != first.manifest[key]:
                raise IntegrityError(f"ranks disagree on manifest {key}", where=b.path)
        # One schema: the same payloads of the same dtypes and roles, the same recorded outputs.  Tensors of
        # different dtypes are never concatenated (torch.cat would promote them) and graded as one.
        for name in sorted(set(first.payloads) | set(b.payloads)):
            s0, s1 = first.manifest["payloads"].get(name), b.manifest["payloads"].get(name)
            if s0 is None or s1 is None or (s0["dtype"], s0["role"]) != (s1["dtype"], s1["role"]):
                raise IntegrityError(f"ranks disagree on payload {name!r}: rank {ranks[0]} has it {_spec(s0)}, rank "
                                     f"{ranks[parts.index(b)]} {_spec(s1)}; ranks of different schemas are never "
                                     "concatenated", where=fmt.payload_where(name),
                                     hint="every rank of a run writes the same payloads with the same dtypes")
        if {s: sorted(f) for s, f in b.expected.items()} != {s: sorted(f) for s, f in first.expected.items()}:
            raise IntegrityError(f"ranks disagree on the recorded outputs: rank {ranks[0]} records "
                                 f"{ {s: sorted(f) for s, f in first.expected.items()} }, rank {ranks[parts.index(b)]} "
                                 f"{ {s: sorted(f) for s, f in b.expected.items()} }", where=b.path)
        ident, ident0 = b.index["identity"], first.index["identity"]
        if b.index["config"] != first.index["config"] or (ident["rollout_id"], ident["step_id"]) != (
                ident0["rollout_id"], ident0["step_id"]) or set(b.payloads) != set(first.payloads):
            raise IntegrityError("ranks disagree on config, actor step or payload names", where=b.path)
    samples = [s for b in parts for s in b.samples]
    if len({s["sample_id"] for s in samples}) != len(samples):
        raise IntegrityError("a sample id appears in more than one rank", where=root)
    payloads = {}
    for name in first.payloads:
        width = max(int(b.payloads[name].shape[1]) for b in parts)
        payloads[name] = torch.cat([torch.nn.functional.pad(b.payloads[name], (0, width - b.payloads[name].shape[1]))
                                    for b in parts])
    expected: dict[str, Any] = {}
    for stage, fields in first.expected.items():
        expected[stage] = {}
        for f, v in fields.items():
            expected[stage][f] = [x for b in parts for x in b.expected[stage][f]] if isinstance(v, list) else v
    cohorts, start = [], 0
    for r, b in zip(ranks, parts, strict=True):
        n = len(b.samples)
        cohorts.append(LossCohort(r, list(range(start, start + n)), b.loss_cohorts[0].loss))
        start += n
    index = dict(first.index, samples=samples)
    return Bundle(root, first.manifest, index, expected, payloads, ranks=ranks, loss_cohorts=cohorts)


def load_bundle(path: str | Path, *, tensors: bool = True) -> Bundle:
    """Validate and load a bundle directory or a multi-rank root; raise naming the first fault.

    ``tensors=False`` (``bundle validate``) runs every check -- digests over every byte, headers,
    dtypes, shapes, BOOL bytes, mask rows, token ids, finite padding, log-probabilities <= 0, config ranges, group
    closure -- but keeps no payload data: ``payloads`` then holds ``meta`` tensors of the recorded dtypes and
    shapes.  Every structural check ``bundle replay`` relies on is made here, so what ``validate`` passes, ``replay``
    recomputes.
    """
    p = Path(path)
    try:
        b = _load(p, tensors)
        check_groups(b.manifest, b.samples, b.config)  # on the whole bundle: a root's ranks merged
        check_tokens(b.manifest, b.samples)
    except ReplayjobError as exc:  # a fault of one rank names its directory already; what is left, the root's
        raise _placed(exc, p, inside=not (p.is_dir() and not p.is_symlink() and is_multi_rank_root(p))) from None
    return b


def _load(p: Path, tensors: bool) -> Bundle:
    if p.is_dir() and not p.is_symlink() and is_multi_rank_root(p):
        return _load_root(p, tensors)
    if p.is_dir() and not p.is_symlink() and not (p / fmt.MANIFEST).exists() and not (p / fmt.COMPLETE).exists():
        inner = sorted(c.name for c in p.iterdir() if c.is_dir() and is_bundle(c))
        if inner:
            raise IntegrityError(f"this is a capture directory holding {len(inner)} bundle(s) {inner}, not a "
                                 "bundle", where=p, hint="pass one bundle directory (replay also takes --step R:S "
                                                         "or --rollout R with the capture directory)")
    return _load_single(p, tensors)
