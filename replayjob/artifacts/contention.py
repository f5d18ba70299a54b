"""The contention record a replay stores under ``contention`` (docs/replay-metrics.md), declared.

The figures are what :class:`replayjob.runtime.contention_probe.Probe` read around the timed updates; every field that
summarises others is recomputed when the record is read, and a difference refused: the rates
(``cpu_per_wall``, ``involuntary_switches_per_s``), the CUDA device's count of other processes (from the
process lists) and, above all, ``contended`` and ``reasons``, recomputed by the thresholds in force
(:func:`replayjob.runtime.contention_probe.decide`).  A record that calls itself uncontended while its own figures cross
a threshold therefore never admits timing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from replayjob.declaration import Count, Document, Finite, NonNegative, Positive, Share, Text, agree, to_builtins
from replayjob.runtime.contention_probe import SCHEMA, THRESHOLDS, decide

LoadAverage = Annotated[list[NonNegative], msgspec.Meta(min_length=3, max_length=3)]
UNAVAILABLE = {"run_queue_wait": "run_queue_wait_share", "steal": "steal_share", "loadavg": "loadavg_before",
               "cuda_processes": "cuda.other_processes"}
"""What ``unavailable`` may name, each with the figure it explains (null exactly when named)."""


class CudaProcess(Document, frozen=True):
    pid: Count
    used_bytes: Count | None


def other_processes(before: list[CudaProcess] | None, after: list[CudaProcess] | None) -> int | None:
    """Other compute processes on the device: of each list (this process among them, or taken as one of them
    where a PID namespace hides it), all but one; the larger; None where neither list tells."""
    counts = [len({p.pid for p in procs}) - 1 for procs in (before, after) if procs]
    return max(counts) if counts else None


class CudaFigures(Document, frozen=True):
    device: Text
    read_by: Literal["nvml", "nvidia-smi"] | None
    processes_before: list[CudaProcess] | None
    processes_after: list[CudaProcess] | None
    other_processes: Count | None
    note: str

    def __post_init__(self) -> None:
        agree("other_processes", self.other_processes, other_processes(self.processes_before, self.processes_after))


class ContentionRecord(Document, frozen=True):
    """One probe's window (schema ``replayjob.contention/v1``)."""

    schema: Literal["replayjob.contention/v1"]
    device: Text
    cpus: Positive
    online_cpus: Positive | None
    wall_s: Annotated[float, msgspec.Meta(gt=0.0, le=1e9)]
    cpu_s: NonNegative
    cpu_per_wall: NonNegative
    involuntary_switches: Count
    involuntary_switches_per_s: NonNegative
    voluntary_switches: Count
    run_queue_wait_s: NonNegative | None
    run_queue_wait_share: Share | None
    steal_share: Share | None
    loadavg_before: LoadAverage | None
    loadavg_after: LoadAverage | None
    cuda: CudaFigures | None
    unavailable: dict[Text, Text]
    thresholds: dict[Text, Finite]
    contended: bool
    reasons: list[Text]

    def __post_init__(self) -> None:
        assert self.schema == SCHEMA
        agree("thresholds", self.thresholds, THRESHOLDS)
        if self.online_cpus is not None and self.cpus > self.online_cpus:  # the thresholds scale with both
            raise ValueError(f"`cpus` {self.cpus}, the CPUs the replay could run on, is more than `online_cpus` "
                             f"{self.online_cpus}, the CPUs there are")
        agree("cpu_per_wall", self.cpu_per_wall, self.cpu_s / self.wall_s)
        agree("involuntary_switches_per_s", self.involuntary_switches_per_s, self.involuntary_switches / self.wall_s)
        if (self.cuda is None) == self.device.startswith("cuda"):
            raise ValueError("`cuda` holds the CUDA figures exactly when the device is a CUDA device")
        if set(self.unavailable) - set(UNAVAILABLE):
            raise ValueError(f"`unavailable` names {sorted(set(self.unavailable) - set(UNAVAILABLE))}; it may name "
                             f"only {list(UNAVAILABLE)}")
        missing = {"run_queue_wait": self.run_queue_wait_s is None or self.run_queue_wait_share is None,
                   "steal": self.steal_share is None, "loadavg": self.loadavg_before is None,
                   "cuda_processes": self.cuda is None or self.cuda.other_processes is None}
        for name, absent in missing.items():  # a figure is null exactly when the record says why
            if absent != (name in self.unavailable):
                raise ValueError(f"`{UNAVAILABLE[name]}` is null but `unavailable` does not say why" if absent else
                                 f"`unavailable.{name}` says a figure could not be read, but it is recorded")
        if (self.run_queue_wait_s is None) != (self.run_queue_wait_share is None):
            raise ValueError("`run_queue_wait_s` and `run_queue_wait_share` are read together: both or neither")
        reasons = decide(self.figures())
        agree("reasons", self.reasons, reasons)
        agree("contended", self.contended, bool(reasons))

    def figures(self) -> dict[str, Any]:
        """The record as a plain dict (what :func:`replayjob.runtime.contention_probe.decide` reads)."""
        return to_builtins(self)
