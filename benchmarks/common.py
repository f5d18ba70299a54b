"""Shared benchmark plumbing: repeated timing, the machine description, one JSON result per run.

Every benchmark measures a ratio against a baseline timed in the same process and the same run,
prints exactly one summary line (:func:`summary_line`) and writes one JSON document
(:func:`write_result`, schema ``replayjob.benchmark/v1``) to ``benchmarks/results/`` (git-ignored)
or to ``--results DIR``.  ``--smoke`` runs tiny sizes so CI keeps every benchmark working; smoke
figures are recorded as such and are never compared with a target.

Run a benchmark from the repository root: ``python -m benchmarks.<name> [--smoke]``.

Example:
    >>> times = measure(lambda: sum(range(1000)), repeats=5, warmup=1)
    >>> len(times), stats(times)["n"]
    (5, 5)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import hashlib
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from replayjob import __version__
from replayjob.fsio import atomic_write_bytes
from replayjob.jsonio import pretty_bytes

SCHEMA = "replayjob.benchmark/v1"
REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
Op = Literal["<=", ">="]


@contextlib.contextmanager
def environment(values: dict[str, str | None]) -> Iterator[None]:
    """Set (``None``: unset) environment variables for the block, then restore what was there."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def measure(fn: Callable[[], object], *, repeats: int, warmup: int = 1) -> list[float]:
    """Call ``fn`` ``warmup`` times untimed, then ``repeats`` times; return each call's seconds.

    The garbage collector runs before each timed call (not during it), so one call's garbage is not
    collected on another's clock.
    """
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def stats(values: list[float]) -> dict[str, Any]:
    """n, median, min, max and the interquartile range of ``values`` (the raw values included)."""
    if not values:
        raise ValueError("no measurements")
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values),
            "iqr": q[2] - q[0], "values": list(values)}


def ratio(value: float, baseline: float) -> float:
    """``value / baseline``; a zero baseline (a clock too coarse for the size) is an error."""
    if baseline <= 0:
        raise ValueError(f"baseline measured {baseline} s; increase the size or the repeats")
    return value / baseline


def met(value: float, op: Op, target: float) -> bool:
    return value <= target if op == "<=" else value >= target


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU, cores, memory, OS, Python, Torch (when imported)."""
    cores = os.cpu_count() or 0
    desc: dict[str, Any] = {
        "cpu": _cpu_model(), "logical_cores": cores, "memory_bytes": _memory_bytes(),
        "platform": platform.platform(), "python": platform.python_version(),
        "summary": f"{cores}-core CPU ({_cpu_model()})",
        # Other work on the machine skews timings; the 1/5/15-minute load averages say how much.
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        desc["torch"] = torch.__version__
        if torch.cuda.is_available():
            desc["gpu"] = torch.cuda.get_device_name(0)
            desc["summary"] += f", {desc['gpu']}"
    return desc


def parser(description: str) -> argparse.ArgumentParser:
    """The options every benchmark takes; a benchmark adds its own sizes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the benchmark runs (no target)")
    p.add_argument("--results", type=Path, default=RESULTS_DIR, help="directory for the JSON result")
    return p


def summary_line(name: str, ratio_value: float, target: Target, detail: str, *, smoke: bool,
                 also: Sequence[Target] = ()) -> str:
    """``name: ratio 1.012x; target ratio <= 1.05 met; <detail>`` (smoke runs are not assessed); each of
    ``also`` (further judged targets) is named after the first."""
    if smoke:
        verdict = "smoke run, target not assessed"
    else:
        verdict = "; ".join(f"target {t.describe()} {'met' if t.met() else 'MISSED'}" for t in (target, *also))
    return f"{name}: ratio {ratio_value:.3f}x; {verdict}; {detail}"


@dataclass(frozen=True)
class Target:
    """What a full-size run is judged on: ``metric op value`` (usually the ratio itself)."""

    op: Op
    value: float
    observed: float
    metric: str = "ratio"

    def met(self) -> bool:
        return met(self.observed, self.op, self.value)

    def describe(self) -> str:
        return f"{self.metric} {self.op} {self.value:g} (measured {self.observed:.3f})"


def write_result(name: str, *, smoke: bool, results: Path, ratio_value: float, ratio_definition: str,
                 baseline: str, target: Target, measurements: dict[str, Any], parameters: dict[str, Any],
                 notes: list[str] | None = None, also: Sequence[Target] = ()) -> Path:
    """Write ``<results>/<name>[.smoke].json`` atomically and return its path.  ``target_met`` holds only when
    ``target`` and every further judged target in ``also`` (listed under ``also_targets``) are met."""
    doc = {
        "schema": SCHEMA,
        "benchmark": name,
        "mode": "smoke" if smoke else "full",
        "ratio": ratio_value,
        "ratio_definition": ratio_definition,
        "baseline": baseline,
        "target": {"metric": target.metric, "op": target.op, "value": target.value,
                   "observed": target.observed},
        "also_targets": [{"metric": t.metric, "op": t.op, "value": t.value, "observed": t.observed,
                          "met": None if smoke else t.met()} for t in also],
        "target_met": None if smoke else all(t.met() for t in (target, *also)),
        "parameters": parameters,
        "measurements": measurements,
        "notes": list(notes or []),
        "machine": machine(),
        "replayjob_version": __version__,
        "git_commit": _git_commit(),
        "created_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}{'.smoke' if smoke else ''}.json"
    atomic_write_bytes(path, pretty_bytes(doc))
    return path


def report(name: str, *, smoke: bool, results: Path, ratio_value: float, ratio_definition: str,
           baseline: str, target: Target, detail: str, measurements: dict[str, Any],
           parameters: dict[str, Any], notes: list[str] | None = None, also: Sequence[Target] = ()) -> Path:
    """Write the JSON result, then print the one summary line (which names the JSON file)."""
    path = write_result(name, smoke=smoke, results=results, ratio_value=ratio_value,
                        ratio_definition=ratio_definition, baseline=baseline, target=target,
                        measurements=measurements, parameters=parameters, notes=notes, also=also)
    print(summary_line(name, ratio_value, target, f"{detail}; wrote {path}", smoke=smoke, also=also))
    return path


HASH_CHUNK = 8 * 1024 * 1024  # the readers' chunk


def hash_files(paths: Sequence[Path]) -> list[str]:
    """The hashing floor: every byte of ``paths`` through one ``hashlib.sha256`` per file, one thread, one
    reused buffer (what a reader that hashes as files cannot beat on one core)."""
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    out = []
    for p in paths:
        h = hashlib.sha256()
        with open(p, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                h.update(view[:n])
        out.append(h.hexdigest())
    return out
