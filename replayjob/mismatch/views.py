"""What a mismatch check holds per response token: the trainer's recompute, each recorded source and
each attribution test's alternative recompute (the hypotheses), all float64 and in one flat order
(rows in logical order, positions ascending).

A recompute (:mod:`~replayjob.mismatch.builtin`, :mod:`~replayjob.mismatch.trl`) feeds a
:class:`Collector` one micro-batch at a time, so only per-token numbers are kept, never logits.  From
the trainer's own logits it derives the cheap hypotheses on the spot: the logits divided by another
temperature (each candidate, and a grid for the best-fitting one) and the trainer's distribution
truncated to the sampler's top-k / top-p set and renormalised.  The hypotheses that need a forward of
their own (another dtype, another layout) arrive as values through :meth:`Collector.hypothesis`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from replayjob.errors import IntegrityError
from replayjob.rl.logprobs import logprobs_of, truncate

if TYPE_CHECKING:
    from torch import Tensor

GRID_BLOCK_ELEMENTS = 1 << 24  # logits per block of grid temperatures (64 MiB in float32)
TEMPERATURE_GRID = tuple(math.exp(math.log(0.25) + i * (math.log(4.0) - math.log(0.25)) / 48) for i in range(49))


@dataclass(frozen=True)
class Side:
    """How one side turns the model's logits into a token's log-probability."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    dtype: str = "model"  # "model" (the model's parameter dtype) or the autocast dtype of its forward
    layout: str = ""      # how its rows were laid out (padding, positions)
    recorded: bool = True  # False: a setting the capture does not record (assumed)

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    def to_json(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "dtype": self.dtype,
                "layout": self.layout, "recorded": self.recorded}


@dataclass
class Source:
    """One recorded logprob source of the capture, named by what produced it.

    ``lag`` is how many optimizer steps the weights that produced it predate the captured step K
    (``None``: unknown); ``values`` holds one float64 per response token (NaN where nothing was recorded).
    """

    name: str
    field: str
    description: str
    side: Side
    lag: int | None
    lag_reason: str
    values: Tensor


@dataclass
class Hypothesis:
    """One attribution test's alternative recompute: per token, what the trainer would compute if the
    named factor were the source's."""

    test: str
    label: str
    values: Tensor  # float64; -inf where the token is outside a truncated set


@dataclass
class Views:
    """Everything the statistics and the attribution need, per response token."""

    row: Tensor          # int64: the token's logical row
    position: Tensor     # int64: its 0-based position in the response
    token: Tensor        # int64: the token id
    pad_offset: Tensor   # int64: the sampler's left padding of its row (0 when the sampler padded nothing)
    trainer: Tensor      # float64: the trainer's recompute
    trainer_side: Side
    sampler_side: Side
    sources: list[Source]
    hypotheses: list[Hypothesis] = field(default_factory=list)
    outside_set: Tensor | None = None   # bool: the token is outside the trainer's top-k/top-p set
    grid: tuple[float, ...] = ()
    grid_residual: dict[str, Tensor] = field(default_factory=dict)  # source -> sum (source - lp_T)^2 per grid T
    passes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    prompt_len: Tensor | None = None  # int64 [rows]: each logical row's prompt tokens (where its response starts)
    routing: dict[str, Any] = field(default_factory=dict)  # an MoE model: pass -> the moe.RoutingTable it routed

    @property
    def tokens(self) -> int:
        return int(self.token.numel())


class Collector:
    """Fill a :class:`Views` micro-batch by micro-batch (see the module docstring)."""

    def __init__(self, row: Tensor, position: Tensor, token: Tensor, pad_offset: Tensor, trainer_side: Side,
                 sampler_side: Side, sources: list[Source]):
        import torch
        n = int(token.numel())
        for s in sources:  # one recorded value per response token, in the tokens' order
            if tuple(s.values.shape) != (n,):
                raise IntegrityError(f"the {s.name} source ({s.field}) holds {list(s.values.shape)} values for {n} "
                                     "response tokens: its values cannot be placed at the tokens", where="payload",
                                     hint="capture the step again; a logprob source is recorded per response token")
        self.views = Views(row=row, position=position, token=token, pad_offset=pad_offset,
                           trainer=torch.full((n,), math.nan, dtype=torch.float64), trainer_side=trainer_side,
                           sampler_side=sampler_side, sources=sources)
        self._candidates = candidate_temperatures(trainer_side, [s.side for s in sources])
        self._temps = {t: torch.full((n,), math.nan, dtype=torch.float64) for t in self._candidates}
        self._trunc = (torch.full((n,), math.nan, dtype=torch.float64) if sampler_side.truncates else None)
        self._outside = torch.zeros(n, dtype=torch.bool) if sampler_side.truncates else None
        self._grid = torch.tensor(TEMPERATURE_GRID, dtype=torch.float64)
        self._residual = {s.name: torch.zeros(len(TEMPERATURE_GRID), dtype=torch.float64) for s in sources}
        self._extra: dict[tuple[str, str], Tensor] = {}
        self._done = 0

    def trainer_chunk(self, start: int, trainer_values: Tensor, logits: Tensor, grid: bool = True) -> None:
        """The trainer's values for tokens ``[start, start + n)`` and their float32 logits ``[n, V]``
        (undivided), from which the temperature and truncation hypotheses are derived here."""
        import torch
        n = int(trainer_values.numel())
        sl = slice(start, start + n)
        y = self.views.token[sl].to(logits.device)
        self.views.trainer[sl] = trainer_values.detach().double().cpu()
        for t, out in self._temps.items():
            out[sl] = logprobs_of(logits, y, t).double().cpu()
        if self._trunc is not None and self._outside is not None:
            s = self.views.sampler_side
            scaled = logits / self.views.trainer_side.temperature
            kept = truncate(scaled, s.top_k, s.top_p)
            self._outside[sl] = kept.gather(-1, y.unsqueeze(-1)).squeeze(-1).isinf().cpu()
            self._trunc[sl] = torch.log_softmax(kept, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1).double().cpu()
        if grid and self.views.sources:
            self._grid_chunk(sl, logits, y)
        self._done += n

    def _grid_chunk(self, sl: slice, logits: Tensor, y: Tensor) -> None:
        """Squared residuals of every source against ``log_softmax(logits / T)`` for each grid ``T``, the
        temperatures taken in blocks of at most :data:`GRID_BLOCK_ELEMENTS` logits."""
        import torch
        n, vocab = logits.shape
        block = max(1, GRID_BLOCK_ELEMENTS // max(1, n * vocab))
        index = y.view(1, n, 1)
        for b in range(0, len(TEMPERATURE_GRID), block):
            ts = self._grid[b:b + block].to(logits.device, logits.dtype).view(-1, 1, 1)
            lp = torch.log_softmax(logits.unsqueeze(0) / ts, dim=-1)
            lp = lp.gather(-1, index.expand(lp.shape[0], n, 1)).squeeze(-1).double().cpu()  # [block, n]
            for s in self.views.sources:
                r = s.values[sl]
                ok = ~r.isnan()
                self._residual[s.name][b:b + block] += (r[ok].unsqueeze(0) - lp[:, ok]).square().sum(-1)

    def hypothesis(self, test: str, label: str, start: int, values: Tensor) -> None:
        """Values of a hypothesis that needed its own forward, for tokens ``[start, start + n)``."""
        import torch
        key = (test, label)
        if key not in self._extra:
            self._extra[key] = torch.full((self.views.tokens,), math.nan, dtype=torch.float64)
        self._extra[key][start:start + int(values.numel())] = values.detach().double().cpu()

    def finish(self) -> Views:
        v = self.views
        if self._done != v.tokens:
            raise RuntimeError(f"the recompute covered {self._done} of {v.tokens} response tokens")
        for t, values in self._temps.items():
            v.hypotheses.append(Hypothesis("temperature", temperature_label(t, v.trainer_side.temperature), values))
        if self._trunc is not None:
            s = v.sampler_side
            v.hypotheses.append(Hypothesis(
                "truncation", f"the trainer's distribution truncated to top_k={s.top_k}, top_p={s.top_p:g} and "
                              "renormalised", self._trunc))
            v.outside_set = self._outside
        for (test, label), values in self._extra.items():
            v.hypotheses.append(Hypothesis(test, label, values))
        v.grid = TEMPERATURE_GRID
        v.grid_residual = self._residual
        return v


def candidate_temperatures(trainer: Side, others: list[Side]) -> list[float]:
    """Temperatures other than the trainer's to test: each source's own, and 1 (none applied)."""
    out: list[float] = []
    for t in [*(s.temperature for s in others), 1.0]:
        if t != trainer.temperature and t not in out:
            out.append(t)
    return out


def fitted_temperature(residual: Tensor) -> float:
    """The temperature minimising the squared residuals on :data:`TEMPERATURE_GRID`, refined by the parabola
    through the grid minimum and its neighbours (in log T, where the grid is even)."""
    import torch
    i = int(torch.argmin(residual))
    x = math.log(TEMPERATURE_GRID[i])
    if 0 < i < len(TEMPERATURE_GRID) - 1:
        a, b, c = (float(residual[j]) for j in (i - 1, i, i + 1))
        h = math.log(TEMPERATURE_GRID[i + 1]) - x
        curve = a - 2 * b + c
        if curve > 0:
            x += 0.5 * h * (a - c) / curve
    return math.exp(x)


def temperature_label(t: float, trainer_t: float) -> str:
    if t == 1.0:
        return f"the logits undivided (the trainer divides them by {trainer_t:g}; the source applied no temperature)"
    if trainer_t == 1.0:
        return f"the logits divided by {t:g} (a temperature the trainer did not apply)"
    return f"the logits divided by {t:g} instead of the trainer's {trainer_t:g}"


def check_token_aligned(index: int, inputs: dict[str, Any], mask_name: str, per_token: list[str],
                        per_row: tuple[str, ...] = ()) -> None:
    """A captured micro-batch's per-token tensors (token ids, each logprob source) have its mask's shape
    ``[rows, tokens]`` and its per-row tensors (a prompt's ids and mask) its rows: a source of another shape would
    put its values at other tokens than the trainer recomputes (or fail on the mask, exit 3).  Refused naming the
    micro-batch and the tensor."""
    mask = inputs[mask_name]
    if mask.dim() != 2:
        raise IntegrityError(f"captured micro-batch {index}: {mask_name} has shape {list(mask.shape)}, not "
                             "[rows, tokens]", where="payload", hint="capture the step again")
    for name in per_token:
        shape = list(inputs[name].shape)
        if shape != list(mask.shape):
            raise IntegrityError(f"captured micro-batch {index}: {name} has shape {shape}, its {mask_name} "
                                 f"{list(mask.shape)}: each per-token value must sit at its token", where="payload",
                                 hint="capture the step again; a logprob source is recorded over the same tokens "
                                      "as the mask")
    for name in per_row:
        shape = list(inputs[name].shape)
        if len(shape) != 2 or shape[0] != mask.shape[0]:
            raise IntegrityError(f"captured micro-batch {index}: {name} has shape {shape}, not one row per row of "
                                 f"its {mask_name} {list(mask.shape)}", where="payload",
                                 hint="capture the step again")
