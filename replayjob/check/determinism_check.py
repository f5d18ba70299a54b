"""``determinism-check``: run the same training K times, each in a fresh process, and diag-diff
every run against the first.

Two modes:

* the source trainer: ``python -m replayjob train CONFIG --out RUN_DIR [--set ...]``; the config and
  overrides are validated here first, so a bad config is refused before any run starts;
* any command: ``--command 'TEMPLATE'`` with ``{out}`` replaced by each run's directory (shell
  quoted); the command must write ``{out}/diag.jsonl``.

Each run gets ``OUT/run_<i>/`` with its stdout and stderr kept beside it as ``OUT/run_<i>.stdout.log``
and ``.stderr.log``.  ``OUT/determinism_check.json`` (the report) is written last.  A run's
``diag.jsonl`` must be a regular file it wrote: a symbolic link anywhere below ``OUT``, or two runs
whose files are one (hard links), is refused (exit 2), since a file compared with itself proves
nothing.  A run that exits
non-zero is refused (exit 2) with its status and the tail of its stderr, except a run that crashed
(any status but 1 or 2: :func:`replayjob.errors.is_retryable`, a signal included), which decided nothing
(exit 3, retryable); a drift is a negative
verdict (exit 1).  The math mode (``REPLAYJOB_MATH_MODE``) is inherited by every run, and the mode
recorded in the first run's diag provenance is reported, so a verdict says which mode produced it.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replayjob.check.diagdiff import check_options, diff_files
from replayjob.check.diagreport import DiffReport
from replayjob.check.leafdiff import Tolerance
from replayjob.check.rows import iter_rows
from replayjob.config import load_config
from replayjob.config.dump import set_args
from replayjob.errors import (
    ArtifactExistsError,
    ConfigError,
    OperationalError,
    RefusedError,
    UsageError,
    is_retryable,
)
from replayjob.fsio import atomic_write_bytes, check_no_symlinks, write_failure
from replayjob.jsonio import non_finite_as_strings, pretty_bytes
from replayjob.redact import redact_command
from replayjob.runtime.determinism import math_mode_from_env

SCHEMA = "replayjob.determinism_check/1"
REPORT_FILE = "determinism_check.json"
DIAG_FILE = "diag.jsonl"
STDERR_TAIL_LINES = 20


class RunFailedError(RefusedError):
    """One of the runs exited non-zero or wrote no diagnostics (exit 2)."""


@dataclass
class RunRecord:
    index: int
    dir: Path
    exit_status: int
    wall_s: float


@dataclass
class DeterminismReport:
    out: Path
    command: str
    runs: list[RunRecord] = field(default_factory=list)
    diffs: list[DiffReport] = field(default_factory=list)
    provenance: dict[str, Any] | None = None

    @property
    def deterministic(self) -> bool:
        return all(d.equal for d in self.diffs)

    @property
    def exit_code(self) -> int:
        return 0 if self.deterministic else 1

    def math_mode_text(self) -> str:
        p = self.provenance
        if not p or "math_mode" not in p:
            return "math mode not recorded in the diagnostics"
        strict = p.get("strict_deterministic")
        tail = "" if strict is None else f", strict_deterministic={json.dumps(strict)}"
        mode = p["math_mode"]  # as the run's diagnostics wrote it: anything but a printable string is shown as JSON
        return f"math mode {mode if isinstance(mode, str) and mode.isprintable() else json.dumps(mode)}{tail}"

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "deterministic": self.deterministic, "command": self.command,
                "out": str(self.out), "provenance": non_finite_as_strings(self.provenance),  # as diag-diff's do
                "runs": [{"index": r.index, "dir": str(r.dir), "exit_status": r.exit_status,
                          "wall_s": r.wall_s} for r in self.runs],
                "diffs": [d.to_json() for d in self.diffs]}

    def render(self) -> str:
        verdict = "DETERMINISTIC" if self.deterministic else "DRIFT"
        lines = [f"determinism-check {verdict}: {len(self.runs)} runs; {self.math_mode_text()}",
                 f"  command: {self.command}", f"  runs under {self.out}"]
        for i, d in enumerate(self.diffs, 1):
            if d.equal:
                state = "equal"
            else:
                assert d.first is not None  # a drifting diff always has a first divergent row
                state = f"drift from {d.first.where}"
            lines.append(f"  run_{i} vs run_0: {state} ({d.rows_compared} rows compared)")
        first_drift = next((d for d in self.diffs if not d.equal), None)
        if first_drift is not None:
            lines.append(first_drift.render())
        return "\n".join(lines)


def _prepare_out(out: str | Path | None) -> Path:
    if out is None:
        return Path(tempfile.mkdtemp(prefix="replayjob-determinism-"))
    p = Path(out)
    # an earlier attempt's error report (exit 3, replayjob-error-*.txt) does not block its retry
    if p.exists() and (not p.is_dir() or any(not q.name.startswith("replayjob-error-") for q in p.iterdir())):
        raise ArtifactExistsError("output directory exists and is not empty", where=p,
                                  hint="choose a new --out directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a component that is a file, a read-only or full filesystem: named, no traceback
        raise write_failure(exc, p, "cannot create the --out directory") from None
    return p


def trainer_argv(config: str | Path, run_dir: Path, sets: Sequence[str]) -> list[str]:
    argv = [sys.executable, "-m", "replayjob", "train", str(config), "--out", str(run_dir)]
    for s in sets:
        argv += ["--set", s]
    return argv


def _validate_trainer_config(config: str | Path, sets: Sequence[str]) -> None:
    cfg = load_config(config, list(sets))
    if cfg.training.trainer != "grpo":
        raise ConfigError(f"determinism-check runs the source trainer ('grpo'), the config says "
                          f"{cfg.training.trainer!r}", where="training.trainer",
                          hint="use --command to check any other trainer")
    math_mode_from_env(cfg.backend.options.strict_deterministic)  # every run would refuse a bad mode


def _stderr_tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return "(stderr not readable)"
    tail = text.splitlines()[-STDERR_TAIL_LINES:]
    return "\n".join("    " + line for line in tail) if tail else "    (stderr is empty)"


def _run_one(index: int, total: int, argv: list[str], out: Path) -> RunRecord:
    run_dir = out / f"run_{index}"
    run_dir.mkdir()
    err_path = out / f"run_{index}.stderr.log"
    t0 = time.perf_counter()
    with open(out / f"run_{index}.stdout.log", "wb") as so, open(err_path, "wb") as se:
        try:
            proc = subprocess.run(argv, stdout=so, stderr=se, stdin=subprocess.DEVNULL, check=False)
        except OSError as exc:
            raise RunFailedError(f"run {index + 1} of {total} could not start: {exc.strerror}",
                                 where=argv[0]) from None
    rec = RunRecord(index, run_dir, proc.returncode, time.perf_counter() - t0)
    if proc.returncode != 0:
        how = (f"was killed by signal {-proc.returncode}" if proc.returncode < 0
               else f"exited with status {proc.returncode}")
        # a run that crashed (exit 3, a signal: any status the launchers retry) decided nothing: exit 3,
        # retryable; a decided 1 or 2 is refused
        crashed = is_retryable(proc.returncode)
        cls = OperationalError if crashed else RunFailedError
        raise cls(f"run {index + 1} of {total} {how}; the end of its stderr:\n{_stderr_tail(err_path)}",
                  where=run_dir, hint=f"full stderr in {err_path}")
    _run_diag(out, index, total)
    return rec


def _run_diag(out: Path, index: int, total: int) -> Path:
    """``OUT/run_<index>/diag.jsonl``, refused unless the run wrote it there as a regular file: a
    symbolic link (to the file of another run, or to one shared file) would compare a file with
    itself, so no component below ``OUT`` may be one."""
    diag = out / f"run_{index}" / DIAG_FILE
    if diag.is_symlink():
        raise RunFailedError(f"run {index + 1} of {total} left {DIAG_FILE} as a symbolic link to "
                             f"{os.readlink(diag)!r}; runs must write their own diagnostics, and linked ones "
                             "can compare one file with itself", where=diag,
                             hint="make the command write the file into {out} (copy it there, do not link it)")
    check_no_symlinks(out, diag, what=f"run {index + 1}'s {DIAG_FILE}")  # run_<i> itself a link, a FIFO
    if not diag.is_file():
        raise RunFailedError(f"run {index + 1} of {total} exited 0 but wrote no {DIAG_FILE}", where=diag.parent,
                             hint="the command must write its diagnostics to {out}/diag.jsonl")
    return diag


def _distinct_files(diags: list[Path]) -> None:
    """Refuse two runs whose diag.jsonl is one file (hard links): the comparison would be with itself."""
    seen: dict[tuple[int, int], Path] = {}
    for diag in diags:
        st = os.lstat(diag)
        first = seen.setdefault((st.st_dev, st.st_ino), diag)
        if first is not diag:
            raise RunFailedError(f"{diag} and {first} are one file (hard links); each run must write its own "
                                 f"{DIAG_FILE}", where=diag, hint="make the command write the file into {out} "
                                                                  "(copy it there, do not link it)")


def _provenance(diag: Path) -> dict[str, Any] | None:
    for _, row in iter_rows(diag, follow_symlinks=False):
        prov = row.get("provenance")
        return prov if isinstance(prov, dict) else None
    return None


def check(config: str | Path | None = None, *, runs: int = 2, steps: int | None = None,
          out: str | Path | None = None, sets: Sequence[str] = (), command: str | None = None,
          tol: Tolerance | None = None, ignore: Sequence[str] = (), top: int = 10,
          progress: Callable[[str], None] | None = None) -> DeterminismReport:
    """Run ``runs`` identical trainings and diff them; see the module docstring."""
    if runs < 2:
        raise UsageError(f"--runs must be at least 2, got {runs}")
    if steps is not None and steps < 1:
        raise UsageError(f"--steps must be at least 1, got {steps}")
    if (config is None) == (command is None):
        raise UsageError("give either a config (the source trainer) or --command, not both")
    if command is not None and "{out}" not in command:
        raise UsageError("--command must contain {out}, the directory each run writes diag.jsonl into",
                         hint="for example --command 'python train.py --log-dir {out}'")
    check_options(tol or Tolerance(), ignore, top)
    all_sets = [*sets, *(set_args({"training.max_steps": steps}) if steps is not None else [])]
    if config is not None:
        _validate_trainer_config(config, all_sets)
    root = _prepare_out(out)
    shown = command if command is not None else \
        shlex.join(trainer_argv(config or "", Path("{out}"), all_sets)).replace("'{out}'", "{out}")
    report = DeterminismReport(out=root, command=redact_command(shown))  # no secret is recorded
    for i in range(runs):
        run_dir = root / f"run_{i}"
        if command is not None:
            argv = ["/bin/sh", "-c", command.replace("{out}", shlex.quote(str(run_dir)))]
        else:
            argv = trainer_argv(config or "", run_dir, all_sets)
        rec = _run_one(i, runs, argv, root)
        report.runs.append(rec)
        if progress:
            progress(f"run {i + 1}/{runs}: exit 0 in {rec.wall_s:.1f} s -> {rec.dir}")
    # checked again once every run is done: a later run could have replaced an earlier one's file
    diags = [_run_diag(root, rec.index, runs) for rec in report.runs]
    _distinct_files(diags)
    report.provenance = _provenance(diags[0])
    for diag in diags[1:]:  # opened without following a link that appears after the check
        report.diffs.append(diff_files(diags[0], diag, tol=tol, ignore=ignore, top=top, follow_symlinks=False))
    atomic_write_bytes(root / REPORT_FILE, pretty_bytes(report.to_json()))
    return report
