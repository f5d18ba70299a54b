"""The optimizer batch: ragged rows exactly as the optimizer consumes them, and their digests.

Each row is a token sequence (prompt + response) with per-response-token float64 old and
reference logprobs, advantages and loss weights.  Rows are stored flat with offsets, the form
captured to safetensors.  ``logical_sha256`` hashes the rows themselves in logical order, so it
does not depend on micro-batching; ``effective_sha256`` hashes only rows that carry loss weight.

Digests: :func:`replayjob.digest.batch_sha256` (every producer's one batch digest) of one part whose
tensors are the rows' flat arrays -- token_offsets, prompt_lens, resp_offsets, tokens (int64),
old_logprobs, ref_logprobs, advantages, loss_weights (float64), each ``[dtype, [count], SHA-256 of its
little-endian bytes]`` -- plus, in the effective digest, ``row_index`` (the kept rows' logical indices).

An optional per-response-token float64 array, ``sampler_logprobs`` (the sampler's own
log-probability of each sampled token, ``docs/mismatch.md``), travels with the rows but is not
consumed by the update, so it is in neither digest (the payload's span digest covers it); a batch
without it (a capture written before the sampler recorded it) has no sampler source.

The effective rows are those with at least one non-zero loss weight; their arrays are the logical
ones restricted to those rows, offsets rebased to start at zero.  Each flat array is hashed whole
(a zero-copy view of contiguous memory), the large ones on parallel threads (hashlib releases
the GIL), and :meth:`OptimizerBatch.digests` reuses the logical arrays' digests for the effective
digest when every row carries loss weight, so each byte is hashed once.
"""

from __future__ import annotations

import hashlib
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from replayjob.digest import batch_part, batch_sha256

if TYPE_CHECKING:
    from torch import Tensor

_ROW_FIELDS = ("old_logprobs", "ref_logprobs", "advantages", "loss_weights")
SAMPLER_FIELD = "sampler_logprobs"  # optional, not hashed into the row digests


@dataclass(frozen=True)
class OptimizerBatch:
    tokens: Tensor          # int64 [sum(len)]: prompt + response tokens of every row
    token_offsets: Tensor   # int64 [N+1]
    prompt_lens: Tensor     # int64 [N]
    resp_offsets: Tensor    # int64 [N+1]: offsets into the per-response-token arrays
    old_logprobs: Tensor    # float64 [sum(resp)]
    ref_logprobs: Tensor    # float64 [sum(resp)]
    advantages: Tensor      # float64 [sum(resp)]
    loss_weights: Tensor    # float64 [sum(resp)]: mask, token cap and loss normalisation folded in
    sampler_logprobs: Tensor | None = None  # float64 [sum(resp)], optional: the sampler's view

    @property
    def rows(self) -> int:
        return int(self.prompt_lens.numel())

    def row_tokens(self, i: int) -> Tensor:
        return self.tokens[int(self.token_offsets[i]):int(self.token_offsets[i + 1])]

    def row_field(self, name: str, i: int) -> Tensor:
        t: Tensor = getattr(self, name)
        return t[int(self.resp_offsets[i]):int(self.resp_offsets[i + 1])]

    def response_tokens(self) -> int:
        return int(self.resp_offsets[-1])

    def tensors(self) -> dict[str, Tensor]:
        """Every array by name (``sampler_logprobs`` only when present)."""
        out = {name: getattr(self, name) for name in (
            "tokens", "token_offsets", "prompt_lens", "resp_offsets", *_ROW_FIELDS)}
        if self.sampler_logprobs is not None:
            out[SAMPLER_FIELD] = self.sampler_logprobs
        return out

    def logical_sha256(self) -> str:
        return self.digests()[0]

    def effective_sha256(self) -> str:
        return self.digests()[1]

    def digests(self, known: dict[str, tuple[int, bytes]] | None = None) -> tuple[str, str]:
        """``(logical, effective)`` digests in one pass: every array is hashed at most once.

        ``known`` maps array names to ``(element count, SHA-256)`` already computed over these very
        arrays (a payload read hashes them as it goes); those are not hashed again.
        """
        logical = {name: getattr(self, name) for name in _LOGICAL_ARRAYS if name not in (known or {})}
        keep = effective_rows(self)
        if bool(keep.all()):  # the effective arrays are the logical ones: reuse their digests
            return digests_from_sums(self.rows, {**(known or {}), **_array_digests(logical)})
        eff = _select_rows(self, keep)
        sums = {**(known or {}), **_array_digests({**logical, **{f"effective.{k}": v for k, v in eff.items()}})}
        eff_sums = {k: sums[f"effective.{k}"] for k in _EFFECTIVE_ARRAYS}
        return _combine("logical", sums, _LOGICAL_ARRAYS), _combine("effective", eff_sums, _EFFECTIVE_ARRAYS)

    def shard(self, begin: int, end: int) -> OptimizerBatch:
        """Rows ``[begin, end)`` as a batch of their own (offsets rebased to zero): one rank's share."""
        t0, t1 = int(self.token_offsets[begin]), int(self.token_offsets[end])
        r0, r1 = int(self.resp_offsets[begin]), int(self.resp_offsets[end])
        return OptimizerBatch(
            tokens=self.tokens[t0:t1].clone(), token_offsets=self.token_offsets[begin:end + 1] - t0,
            prompt_lens=self.prompt_lens[begin:end].clone(), resp_offsets=self.resp_offsets[begin:end + 1] - r0,
            **{k: getattr(self, k)[r0:r1].clone() for k in _ROW_FIELDS},
            sampler_logprobs=None if self.sampler_logprobs is None else self.sampler_logprobs[r0:r1].clone())

    @staticmethod
    def concat(parts: list[OptimizerBatch]) -> OptimizerBatch:
        """The rows of ``parts`` one after another (offsets rebased): the inverse of :meth:`shard`
        (``sampler_logprobs`` only when every part has them)."""
        import torch
        def offsets(name: str) -> Tensor:
            out, base = [torch.zeros(1, dtype=torch.int64)], 0
            for p in parts:
                out.append(getattr(p, name)[1:] + base)
                base += int(getattr(p, name)[-1])
            return torch.cat(out)
        return OptimizerBatch(
            tokens=torch.cat([p.tokens for p in parts]), token_offsets=offsets("token_offsets"),
            prompt_lens=torch.cat([p.prompt_lens for p in parts]), resp_offsets=offsets("resp_offsets"),
            **{k: torch.cat([getattr(p, k) for p in parts]) for k in _ROW_FIELDS},
            sampler_logprobs=(torch.cat([p.sampler_logprobs for p in parts])  # type: ignore[misc]
                              if all(p.sampler_logprobs is not None for p in parts) else None))

    @staticmethod
    def from_padded(seqs: list[list[int]], prompt_lens: list[int], fields: dict[str, Tensor],
                    mask: Tensor) -> OptimizerBatch:
        """Build from per-row token lists and padded ``[N, T]`` response-token fields (``sampler_logprobs``
        among them is optional)."""
        import torch
        lens = [int(mask[i].sum()) for i in range(len(seqs))]
        for i, (s, p) in enumerate(zip(seqs, prompt_lens, strict=True)):
            if len(s) - p != lens[i]:
                raise ValueError(f"row {i}: {len(s) - p} response tokens but mask has {lens[i]}")
        def flat(t: Tensor) -> Tensor:
            return torch.cat([t[i, :n] for i, n in enumerate(lens)]).to(torch.float64).contiguous()
        return OptimizerBatch(
            tokens=torch.tensor([t for s in seqs for t in s], dtype=torch.int64),
            token_offsets=_offsets([len(s) for s in seqs]),
            prompt_lens=torch.tensor(prompt_lens, dtype=torch.int64),
            resp_offsets=_offsets(lens),
            **{k: flat(fields[k]) for k in _ROW_FIELDS},
            sampler_logprobs=flat(fields[SAMPLER_FIELD]) if SAMPLER_FIELD in fields else None,
        )


def _offsets(lengths: list[int]) -> Tensor:
    import torch
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int64)


_LOGICAL_ARRAYS = ("token_offsets", "prompt_lens", "resp_offsets", "tokens", *_ROW_FIELDS)
_EFFECTIVE_ARRAYS = ("row_index", *_LOGICAL_ARRAYS)
_PARALLEL_MIN_BYTES = 4 * 1024 * 1024  # below this a thread costs more than it saves


def effective_rows(b: OptimizerBatch) -> Tensor:
    """A bool mask over rows: True where the row has at least one non-zero loss weight."""
    import torch
    nonzero = b.loss_weights != 0
    resp_lens = b.resp_offsets[1:] - b.resp_offsets[:-1]
    if bool(nonzero.all()):
        return resp_lens > 0
    counts = torch.cat([torch.zeros(1, dtype=torch.int64), nonzero.cumsum(0)])
    return (counts[b.resp_offsets[1:]] - counts[b.resp_offsets[:-1]]) > 0


def _select_rows(b: OptimizerBatch, keep: Tensor) -> dict[str, Tensor]:
    """The arrays of the kept rows, offsets rebased; masks are built per token, not per row."""
    import torch
    tok_lens = b.token_offsets[1:] - b.token_offsets[:-1]
    resp_lens = b.resp_offsets[1:] - b.resp_offsets[:-1]
    tok_mask = torch.repeat_interleave(keep, tok_lens, output_size=int(b.tokens.numel()))
    resp_mask = torch.repeat_interleave(keep, resp_lens, output_size=b.response_tokens())
    out = {"row_index": keep.nonzero().flatten().to(torch.int64),
           "token_offsets": _offsets_of(tok_lens[keep]), "prompt_lens": b.prompt_lens[keep],
           "resp_offsets": _offsets_of(resp_lens[keep]), "tokens": b.tokens[tok_mask]}
    out.update({k: getattr(b, k)[resp_mask] for k in _ROW_FIELDS})
    return out


def _offsets_of(lengths: Tensor) -> Tensor:
    import torch
    return torch.cat([torch.zeros(1, dtype=torch.int64), lengths.to(torch.int64).cumsum(0)])


def _le_view(t: Tensor) -> memoryview:
    """A zero-copy view of ``t``'s little-endian bytes (int64 / float64; copies only if it must)."""
    import torch
    dtype = torch.float64 if t.dtype.is_floating_point else torch.int64
    t = t.detach()
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
        t = t.to("cpu", dtype).contiguous()
    arr = t.numpy()
    if sys.byteorder != "little":  # pragma: no cover - no big-endian machine here
        arr = arr.astype("<i8" if dtype == torch.int64 else "<f8")
    return arr.data.cast("B")


def _sha256(view: memoryview) -> bytes:
    return hashlib.sha256(view).digest()


def _array_digests(arrays: dict[str, Tensor]) -> dict[str, tuple[int, bytes]]:
    """``name -> (element count, SHA-256)``; large arrays are hashed on parallel threads."""
    views = {k: _le_view(v) for k, v in arrays.items()}
    large = [k for k, v in views.items() if v.nbytes >= _PARALLEL_MIN_BYTES]
    out = {k: (arrays[k].numel(), _sha256(v)) for k, v in views.items() if k not in large}
    workers = min(len(large), os.cpu_count() or 1)
    if workers > 1:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="replayjob-digest") as pool:
            done = dict(zip(large, pool.map(_sha256, [views[k] for k in large]), strict=True))
    else:
        done = {k: _sha256(views[k]) for k in large}
    out.update({k: (arrays[k].numel(), d) for k, d in done.items()})
    return out


def digests_from_sums(rows: int, sums: dict[str, tuple[int, bytes]]) -> tuple[str, str]:
    """``(logical, effective)`` from the logical arrays' ``(count, SHA-256)`` when every row bears loss."""
    import torch
    row_index = _array_digests({"row_index": torch.arange(rows)})["row_index"]
    return _combine("logical", sums, _LOGICAL_ARRAYS), _combine("effective", {"row_index": row_index, **sums},
                                                                _EFFECTIVE_ARRAYS)


def _combine(kind: str, sums: dict[str, tuple[int, bytes]], names: tuple[str, ...]) -> str:
    """The rows' one part of :func:`replayjob.digest.batch_sha256` from each array's ``(count, SHA-256)``."""
    tensors = {n: ("float64" if n in _ROW_FIELDS else "int64", [sums[n][0]], sums[n][1].hex()) for n in names}
    return batch_sha256(kind, [batch_part(tensors)])


@dataclass(frozen=True)
class MicroBatch:
    rows: list[int]
    input_ids: Tensor       # [B, L] right-padded
    attention_mask: Tensor  # [B, L]
    resp_mask: Tensor       # [B, L-1] 1 where position t predicts a response token t+1
    old_logprobs: Tensor    # [B, L-1] float64, aligned with resp_mask
    ref_logprobs: Tensor
    advantages: Tensor
    loss_weights: Tensor
    real_tokens: int
    padded_tokens: int


def micro_batches(b: OptimizerBatch, size: int, pad_id: int) -> list[MicroBatch]:
    """Split rows in logical order into right-padded micro-batches of ``size`` rows."""
    import torch
    out = []
    for start in range(0, b.rows, size):
        rows = list(range(start, min(start + size, b.rows)))
        lens = [int(b.token_offsets[i + 1] - b.token_offsets[i]) for i in rows]
        L = max(lens)
        ids = torch.full((len(rows), L), pad_id, dtype=torch.int64)
        att = torch.zeros((len(rows), L), dtype=torch.int64)
        fields = {k: torch.zeros((len(rows), L - 1), dtype=torch.float64) for k in _ROW_FIELDS}
        rmask = torch.zeros((len(rows), L - 1), dtype=torch.float64)
        for j, i in enumerate(rows):
            n = lens[j]
            ids[j, :n] = b.row_tokens(i)
            att[j, :n] = 1
            p = int(b.prompt_lens[i])
            rmask[j, p - 1:n - 1] = 1.0
            for k in _ROW_FIELDS:
                fields[k][j, p - 1:n - 1] = b.row_field(k, i)
        out.append(MicroBatch(rows, ids, att, rmask, real_tokens=sum(lens), padded_tokens=L * len(rows),
                              **fields))
    return out
