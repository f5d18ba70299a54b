"""The optimizer batch: ragged rows exactly as the optimizer consumes them, and their digests.

Each row is a token sequence (prompt + response) with per-response-token float64 old and
reference logprobs, advantages and loss weights.  Rows are stored flat with offsets, the form
captured to safetensors.  ``logical_sha256`` hashes the rows themselves in logical order, so it
does not depend on micro-batching; ``effective_sha256`` hashes only rows that carry loss weight.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch
from torch import Tensor

_ROW_FIELDS = ("old_logprobs", "ref_logprobs", "advantages", "loss_weights")


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
        return {name: getattr(self, name) for name in (
            "tokens", "token_offsets", "prompt_lens", "resp_offsets", *_ROW_FIELDS)}

    def logical_sha256(self) -> str:
        return _rows_digest(self, range(self.rows), b"replayjob.logical-rows.v1")

    def effective_sha256(self) -> str:
        keep = [i for i in range(self.rows) if bool((self.row_field("loss_weights", i) != 0).any())]
        return _rows_digest(self, keep, b"replayjob.effective-rows.v1")

    @staticmethod
    def from_padded(seqs: list[list[int]], prompt_lens: list[int], fields: dict[str, Tensor],
                    mask: Tensor) -> OptimizerBatch:
        """Build from per-row token lists and padded ``[N, T]`` response-token fields."""
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
        )


def _offsets(lengths: list[int]) -> Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int64)


def _rows_digest(b: OptimizerBatch, rows: object, domain: bytes) -> str:
    h = hashlib.sha256(domain)
    idx = list(rows)  # type: ignore[call-overload]
    h.update(struct.pack("<q", len(idx)))
    for i in idx:
        toks = b.row_tokens(i)
        h.update(struct.pack("<qqq", i, int(b.prompt_lens[i]), int(toks.numel())))
        h.update(toks.to(torch.int64).contiguous().numpy().astype("<i8").tobytes())
        for name in _ROW_FIELDS:
            h.update(b.row_field(name, i).to(torch.float64).contiguous().numpy().astype("<f8").tobytes())
    return h.hexdigest()


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
