"""``funnel.json``, the workstation funnel's document (docs/funnel.md, "Output"), declared and written here.

The funnel (:mod:`replayjob.launch.funnel`) builds the document and writes it with :func:`write`, which reads it
back through :class:`FunnelRecord` first: a field the declaration does not know, or a status and exit code that
do not follow from the stages, is never written (a bug in replayjob, exit 3).  Summaries recomputed from the
stages: the exit code is the first non-passing stage's, and the status follows from it (``pass``/``fail`` for
0/1, else that stage's own status); each stage's status agrees with its exit code.

Example:
    >>> from replayjob.declaration import decode
    >>> stage = {"name": "determinism", "status": "fail", "exit_code": 2, "detail": "", "wall_s": 1.0,
    ...          "artifacts": {}}
    >>> decode(stage, FunnelStage, where="funnel.json")
    Traceback (most recent call last):
    ...
    replayjob.errors.IntegrityError: funnel.json: `exit_code` is 2, but status 'fail' exits 1
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from replayjob.declaration import Count, Document, Finite, Int, NonNegative, Positive, Share, Text, decode
from replayjob.errors import OperationalError, ReplayjobError
from replayjob.fsio import atomic_write_bytes
from replayjob.jsonio import loads_strict, pretty_bytes

SCHEMA = "replayjob.funnel/v1"
FUNNEL_FILE = "funnel.json"
STAGES = ("determinism", "signals", "ablation")
STATUS = {0: "pass", 1: "fail", 2: "refused", 3: "error"}  # a stage's status from its exit code, unless it names one
# The exit code each status means (a stage that names its own status: the verdict's inconclusive, contended or
# incomplete; a stage not run is skipped, exit 0).
STATUS_CODES = {"pass": 0, "skipped": 0, "fail": 1, "refused": 2, "inconclusive": 2, "error": 3, "contended": 3,
                "incomplete": 3}
ExitCode = Annotated[int, msgspec.Meta(ge=0, le=3)]
StageStatus = Literal["pass", "skipped", "fail", "refused", "inconclusive", "error", "contended", "incomplete"]
FunnelStatus = Literal["pass", "fail", "refused", "inconclusive", "error", "contended", "incomplete"]
Limit = Annotated[float, msgspec.Meta(gt=0.0, le=1.7976931348623157e308)]


class FunnelStage(Document, frozen=True):
    """One stage: its outcome (a status agreeing with its exit code), what it said and wrote, its seconds."""

    name: Literal["determinism", "signals", "ablation"]
    status: StageStatus
    exit_code: ExitCode
    detail: str
    wall_s: NonNegative
    artifacts: dict[Text, str]

    def __post_init__(self) -> None:
        if self.exit_code != STATUS_CODES[self.status]:
            raise ValueError(f"`exit_code` is {self.exit_code}, but status {self.status!r} exits "
                             f"{STATUS_CODES[self.status]}")


class FunnelArm(Document, frozen=True):
    """One arm's row of the summary (medians, ratio to the baseline, equality with the source)."""

    median_step_wall_s: Finite | None
    median_warm_wall_s: Finite | None
    decision: Literal["decided", "undecided", "not_evaluated"] | None
    step_ratio: Annotated[list[Finite | None], msgspec.Meta(min_length=3, max_length=3)] | None  # ratio, low, high
    peak_memory_ratio: Finite | None
    memory_kind: list[Text]
    loss_equal_source: bool
    adapter_equal_source: bool


class FunnelContended(Document, frozen=True):
    """A replay a contention probe flagged, as the verdict's ``contention.contended`` lists it."""

    arm: Text
    repeat_index: Count
    path: str
    block: Count | None
    reasons: list[str]


class FunnelBound(Document, frozen=True):
    """A budget bound and its decision, as the verdict's ``budgets.bounds`` lists it (an undecided bound has no
    interval: ``pairs``, ``ratio``, ``low``, ``high`` and ``more_blocks`` absent)."""

    arm: Text
    metric: Text
    kind: Literal["max_ratio", "min_ratio"]
    limit: Limit
    decision: Literal["pass", "fail", "inconclusive", "refused", "not_evaluated", "not_measurable"]
    note: str
    pairs: Count | UnsetType = UNSET
    ratio: Finite | UnsetType | None = UNSET
    low: Finite | UnsetType | None = UNSET
    high: Finite | UnsetType | None = UNSET
    more_blocks: Count | UnsetType | None = UNSET


class FunnelSummary(Document, frozen=True):
    """Stage 3's summary of its verdict (null in the document when stage 3 reached no verdict)."""

    verdict: Literal["pass", "fail", "refused", "inconclusive", "contended", "incomplete"]
    baseline: Text | None
    admission: str
    timing_metric: Text
    confidence: Share
    paired: bool
    max_looks: Positive
    contended: list[FunnelContended]
    arms: dict[Text, FunnelArm]
    budgets: list[FunnelBound]
    blocks: Count
    max_blocks: Count


class FunnelRecord(Document, frozen=True):
    """``funnel.json``'s top level: the run's settings, every stage in order, stage 3's summary."""

    schema: Literal["replayjob.funnel/v1"]
    status: FunnelStatus
    exit_code: ExitCode
    device: Literal["cpu", "cuda"]
    model: Text
    claim: Text
    spec: Text
    arms: list[Text]
    design: Text
    seed: Int
    omp_num_threads: str | None
    stages: list[FunnelStage]
    summary: FunnelSummary | None
    wall_s: NonNegative

    def __post_init__(self) -> None:
        names = tuple(s.name for s in self.stages)
        if names != STAGES:
            raise ValueError(f"`stages` are {list(names)}, expected {list(STAGES)} in order")
        first = next((s for s in self.stages if s.exit_code), None)
        code = 0 if first is None else first.exit_code
        if self.exit_code != code:
            raise ValueError(f"`exit_code` is {self.exit_code}, but the first non-passing stage's is {code}")
        status = "pass" if first is None else first.status
        if self.status != status:
            raise ValueError(f"`status` is {self.status!r}, but the stages give {status!r}")


def write(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` atomically as ``funnel.json``, once it reads back through :class:`FunnelRecord`: a document
    that breaks its own declaration is never written (a bug in replayjob: exit 3)."""
    data = pretty_bytes(doc)
    try:
        decode(loads_strict(data, where=path), FunnelRecord, where=path)
    except ReplayjobError as exc:
        raise OperationalError(f"the funnel document about to be written breaks its own declaration "
                               f"({exc.message}): a bug in replayjob; nothing was written", where=path) from None
    atomic_write_bytes(path, data)
