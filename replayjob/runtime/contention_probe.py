"""What contended with a replay while its timed updates ran, and whether that makes its timing void.

A replay driver wraps its timed updates (and nothing else) in a :class:`Probe`::

    with Probe(device) as probe:
        ...timed updates...
    metrics[CONTENTION] = probe.record()   # replayjob.artifacts.metrics.CONTENTION, a JSON-able dict

The record (:data:`SCHEMA`, docs/replay-metrics.md, ``contention``) holds what was read around the
window: the load average before and after (``os.getloadavg``), the process's CPU time against the
window's wall time and its involuntary context switches and their rate (``resource.getrusage``, every
thread), the time its threads spent runnable but waiting for a CPU (``/proc/self/task/*/schedstat``,
where the kernel has it), the steal time of the CPUs it may run on (``/proc/stat``, where the kernel
reports it) and, on CUDA, the other compute processes on its device (NVML or ``nvidia-smi``, where
either can be read).  A figure that cannot be read is null and ``unavailable`` says why.

``contended`` is true when any figure crosses its threshold (the constants below, relative to the
CPUs this process may run on, ``os.sched_getaffinity``, or for the machine-wide load average to
``os.cpu_count()``; the involuntary switches and the load average decide only where the run-queue wait
cannot be read), and ``reasons`` says which.  They are set so that one replay running alone on a
quiet 2-core machine stays clear of them (run-queue wait share under 0.02, a few involuntary switches
per second), while a CPU-bound process sharing its core trips them (wait share near 0.5, CPU per wall
second near 0.5, over a hundred switches per second).  Nothing here imports torch unless the device is CUDA.

Example:
    >>> with Probe("cpu") as p:
    ...     _ = sum(range(1000))
    >>> sorted(k for k in p.record() if k in ("contended", "reasons", "schema"))
    ['contended', 'reasons', 'schema']
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

SCHEMA = "replayjob.contention/v1"
# Thresholds (docs/replay-metrics.md, "contention"); a figure above (below, for CPU_PER_WALL_MIN) trips.
RUN_QUEUE_WAIT_SHARE_MAX = 0.10  # waiting for a CPU / (waiting + running), summed over the process's threads
# Preemptions per second of the window, per CPU the process may use.  Decides only where the run-queue wait
# cannot be read: a process running more threads than CPUs preempts itself (counted, yet no time is lost).
INVOLUNTARY_SWITCHES_PER_S_MAX = 50.0
STEAL_SHARE_MAX = 0.10  # steal / all time of the CPUs the process may run on (a hypervisor took them)
STEAL_MIN_TICKS = 100  # /proc/stat counts in 1/100 s ticks: a window of fewer ticks (all its CPUs) reads no steal
# 1-minute load average (before or after) per online CPU: more runnable than CPUs.  Decides only where the
# run-queue wait cannot be read: the average lags a minute and counts every CPU, the wait is this process's own.
LOAD_PER_CPU_MAX = 1.0
CPU_PER_WALL_MIN = 0.75  # CPU device only: the process's CPU seconds per wall second of its window
CUDA_OTHER_PROCESSES_MAX = 0  # other compute processes seen on the replay's CUDA device
THRESHOLDS = {
    "run_queue_wait_share_max": RUN_QUEUE_WAIT_SHARE_MAX,
    "involuntary_switches_per_s_per_cpu_max": INVOLUNTARY_SWITCHES_PER_S_MAX,
    "steal_share_max": STEAL_SHARE_MAX,
    "load_per_cpu_max": LOAD_PER_CPU_MAX,
    "cpu_per_wall_min": CPU_PER_WALL_MIN,
    "cuda_other_processes_max": CUDA_OTHER_PROCESSES_MAX,
}
_PROC = Path("/proc")


def allowed_cpus() -> int:
    """CPUs this process may run on (``sched_getaffinity``), else ``os.cpu_count()``, at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _affinity() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 3) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _schedstat() -> dict[str, tuple[int, int]] | None:
    """Per thread of this process: (ns on a CPU, ns runnable but waiting for one); None when unreadable."""
    out: dict[str, tuple[int, int]] = {}
    try:
        tids = os.listdir(_PROC / "self" / "task")
    except OSError:
        return None
    for tid in tids:
        try:
            fields = (_PROC / "self" / "task" / tid / "schedstat").read_text().split()
            out[tid] = (int(fields[0]), int(fields[1]))
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return out or None


def _steal(cpus: set[int] | None) -> tuple[int, int] | None:
    """(steal ticks, all ticks) summed over ``cpus`` (every CPU when None) from /proc/stat; None without."""
    try:
        lines = (_PROC / "stat").read_text().splitlines()
    except OSError:
        return None
    steal = total = 0
    seen = False
    for line in lines:
        parts = line.split()
        if not parts or not parts[0].startswith("cpu") or parts[0] == "cpu":
            continue
        try:
            n = int(parts[0][3:])
            values = [int(x) for x in parts[1:9]]
        except ValueError:
            continue
        if (cpus is not None and n not in cpus) or len(values) < 8:
            continue
        seen = True
        steal += values[7]
        total += sum(values)  # user nice system idle iowait irq softirq steal (guest is inside user)
    return (steal, total) if seen else None


def _cuda_index(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else 0


def _cuda_uuid(device: str) -> str | None:
    """The CUDA device's UUID as NVML and nvidia-smi spell it (``GPU-...``), where torch reports it."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(_cuda_index(device)).uuid)
    except Exception:  # an old torch, no CUDA: the figure is unavailable, said
        return None
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def _cuda_processes(device: str) -> tuple[list[dict[str, Any]] | None, str]:
    """The compute processes on ``device`` (pid, used memory in bytes) and how they were read (or why not)."""
    uuid = _cuda_uuid(device)
    if uuid is None:
        return None, "the device's UUID is not reported by torch, so its processes cannot be told apart"
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid.encode())
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            return [{"pid": int(p.pid), "used_bytes": p.usedGpuMemory} for p in procs], "nvml"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML bindings or no NVML: try nvidia-smi
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, "neither NVML (pynvml) nor nvidia-smi is available"
    try:
        text = subprocess.run([smi, "--query-compute-apps=gpu_uuid,pid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"nvidia-smi failed: {exc}"
    procs = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].lower() == uuid.lower() and parts[1].isdigit():
            mib = parts[2]
            procs.append({"pid": int(parts[1]), "used_bytes": int(mib) * 2**20 if mib.isdigit() else None})
    return procs, "nvidia-smi"


def _others(procs: list[dict[str, Any]] | None, own: int) -> tuple[int | None, str]:
    """How many listed processes are not this one; None when that cannot be told."""
    if procs is None:
        return None, ""
    pids = {p["pid"] for p in procs}
    if own in pids:
        return len(pids) - 1, ""
    if not pids:
        return None, ("no compute process is visible on the device, not even this one (another PID namespace "
                      "hides them)")
    return len(pids) - 1, "this process's PID is not listed (PID namespace): one listed process is taken as this one"


class Probe:
    """Reads what contends with this process between ``__enter__`` and ``__exit__``; :meth:`record` tells.

    ``device`` is the replay's device (``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``).  Every
    read is cheap (a few /proc files) except the CUDA process list, read once before and once after the
    window, outside it.  A probe never raises for a figure it cannot read.
    """

    def __init__(self, device: object = "cpu"):
        self.device = str(device)
        self.cuda = self.device.startswith("cuda")
        self._before: dict[str, Any] = {}
        self._after: dict[str, Any] = {}

    def _read(self) -> dict[str, Any]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return {"wall": time.perf_counter(), "cpu": ru.ru_utime + ru.ru_stime, "nivcsw": ru.ru_nivcsw,
                "nvcsw": ru.ru_nvcsw, "sched": _schedstat(), "steal": _steal(_affinity()), "load": _loadavg()}

    def __enter__(self) -> Probe:
        self._after = {}
        self._cuda_before = _cuda_processes(self.device) if self.cuda else None
        self._before = self._read()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._after = self._read()
        self._cuda_after = _cuda_processes(self.device) if self.cuda else None

    def record(self) -> dict[str, Any]:
        """The figures of the window (JSON-able), ``contended`` and its ``reasons`` (see the module)."""
        if not self._before or not self._after:
            raise RuntimeError("Probe.record() needs a finished `with Probe(...)` window")
        b, a = self._before, self._after
        cpus = allowed_cpus()
        wall = max(a["wall"] - b["wall"], 1e-9)
        cpu = max(0.0, a["cpu"] - b["cpu"])
        nivcsw = max(0, a["nivcsw"] - b["nivcsw"])
        unavailable: dict[str, str] = {}
        wait_s = wait_share = None
        if b["sched"] is not None and a["sched"] is not None:
            run = sum(max(0, v[0] - b["sched"].get(t, (0, 0))[0]) for t, v in a["sched"].items())
            wait = sum(max(0, v[1] - b["sched"].get(t, (0, 0))[1]) for t, v in a["sched"].items())
            wait_s = wait / 1e9
            wait_share = wait / (wait + run) if wait + run > 0 else 0.0
        else:
            unavailable["run_queue_wait"] = "/proc/self/task/*/schedstat is not readable (no scheduler statistics)"
        steal_share = None
        if b["steal"] is not None and a["steal"] is not None:
            ds, dt = a["steal"][0] - b["steal"][0], a["steal"][1] - b["steal"][1]
            if dt >= STEAL_MIN_TICKS:
                steal_share = ds / dt
            else:
                unavailable["steal"] = (f"the window spans {dt} accounting ticks of its CPUs, fewer than "
                                        f"{STEAL_MIN_TICKS}: too coarse to read a share")
        else:
            unavailable["steal"] = "/proc/stat reports no per-CPU steal time here"
        if b["load"] is None:
            unavailable["loadavg"] = "os.getloadavg() is not available"
        cuda: dict[str, Any] | None = None
        if self.cuda:
            (p0, how0), (p1, how1) = self._cuda_before or (None, ""), self._cuda_after or (None, "")
            (o0, n0), (o1, n1) = _others(p0, os.getpid()), _others(p1, os.getpid())
            others = None if o0 is None and o1 is None else max(o for o in (o0, o1) if o is not None)
            note = "; ".join(dict.fromkeys(x for x in (n0, n1) if x))
            if p0 is None and p1 is None:
                note = how0 or how1
            cuda = {"device": self.device, "read_by": how0 if p0 is not None else how1 if p1 is not None else None,
                    "processes_before": p0, "processes_after": p1, "other_processes": others, "note": note}
            if others is None:
                unavailable["cuda_processes"] = note or "not readable"
        else:
            unavailable["cuda_processes"] = "not a CUDA device"
        rec: dict[str, Any] = {
            "schema": SCHEMA, "device": self.device, "cpus": cpus, "online_cpus": os.cpu_count(),
            "wall_s": wall, "cpu_s": cpu, "cpu_per_wall": cpu / wall,
            "involuntary_switches": nivcsw, "involuntary_switches_per_s": nivcsw / wall,
            "voluntary_switches": max(0, a["nvcsw"] - b["nvcsw"]),
            "run_queue_wait_s": wait_s, "run_queue_wait_share": wait_share, "steal_share": steal_share,
            "loadavg_before": b["load"], "loadavg_after": a["load"], "cuda": cuda,
            "unavailable": unavailable, "thresholds": dict(THRESHOLDS),
        }
        reasons = decide(rec)
        rec.update(contended=bool(reasons), reasons=reasons)
        return rec


def decide(rec: dict[str, Any]) -> list[str]:
    """Which thresholds the figures of a contention record cross (empty: not contended).  Null figures
    (unreadable) cross none."""
    reasons: list[str] = []
    cpus = int(rec.get("cpus") or 1)
    online = int(rec.get("online_cpus") or cpus)
    share = rec.get("run_queue_wait_share")
    if share is not None and share > RUN_QUEUE_WAIT_SHARE_MAX:
        reasons.append(f"run-queue wait {share:.0%} of the threads' CPU demand (max {RUN_QUEUE_WAIT_SHARE_MAX:.0%})")
    rate = rec.get("involuntary_switches_per_s")
    if share is None and rate is not None and rate > INVOLUNTARY_SWITCHES_PER_S_MAX * cpus:
        reasons.append(f"{rate:.0f} involuntary context switches/s (max {INVOLUNTARY_SWITCHES_PER_S_MAX:g} x "
                       f"{cpus} CPU(s))")
    steal = rec.get("steal_share")
    if steal is not None and steal > STEAL_SHARE_MAX:
        reasons.append(f"steal time {steal:.0%} of the CPUs' time (max {STEAL_SHARE_MAX:.0%})")
    loads = [x[0] for x in (rec.get("loadavg_before"), rec.get("loadavg_after")) if x]
    if share is None and loads and max(loads) > LOAD_PER_CPU_MAX * online:
        reasons.append(f"1-minute load average {max(loads):.2f} above {LOAD_PER_CPU_MAX:g} x {online} online CPU(s)")
    cpw = rec.get("cpu_per_wall")
    if not str(rec.get("device", "")).startswith("cuda") and cpw is not None and cpw < CPU_PER_WALL_MIN:
        reasons.append(f"the process ran {cpw:.2f} CPU s per wall s (min {CPU_PER_WALL_MIN:g} on a CPU device)")
    others = (rec.get("cuda") or {}).get("other_processes")
    if others is not None and others > CUDA_OTHER_PROCESSES_MAX:
        reasons.append(f"{others} other compute process(es) on the CUDA device (max {CUDA_OTHER_PROCESSES_MAX})")
    return reasons
