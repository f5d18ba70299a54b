"""Benchmark: ``diag-diff`` of two large diagnostics files against a parse-only floor.

Writes two JSONL files of ``--rows`` rows (default 20,000) with ``--leaves`` leaves each (default
700: nested groups of floats, integers, strings, bools and arrays, like a trainer's diag rows).
The wall-clock leaves (``timing.*_wall_s``, ``timing.elapsed_s``) and the memory peak differ on every
row, as they do between two identical runs; a drift is planted in one leaf at 99.5 % of the rows
and in three more ten rows later.  Then it times, alternating so that machine load hits both alike:

* the baseline: read both files line by line and ``json.loads`` every line (the standard library's
  parse alone, no check of any kind);
* ``diff_files`` with the default tolerances and ignore list (streaming, the same code the CLI runs:
  strict rows, msgspec's parser with the standard library deciding anything it cannot vouch for);
* reported, not judged: msgspec's parse alone of every line (``msgspec.json.decode``, the floor for
  that parser).

Ratio: median diag-diff CPU seconds / median baseline CPU seconds (``time.process_time``: all paths
are single-threaded and CPU-bound on page-cached files, and CPU time is not inflated by other load
on a shared machine; wall-clock times are recorded too).  Target: <= 1.0, at or below the standard
library's parse alone.  The run fails if the diff does not report the planted first divergence at
its step.

Run: ``python -m benchmarks.diag_diff [--smoke] [--rows N] [--leaves N] [--repeats N]``
"""

from __future__ import annotations

import gc
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import common
from replayjob.check.diagdiff import diff_files

NAME = "diag_diff"
TARGET = 1.0
ARRAY_LEN = 8
FIXED_LEAVES = 7  # step, five timing leaves, one memory peak


def _shape(leaves: int) -> list[tuple[str, str, int]]:
    """``(group, key, kind)`` making up ``leaves`` in all; kind 0 float, 1 int, 2 str, 3 bool, 4 array."""
    out: list[tuple[str, str, int]] = []
    remaining = max(leaves - FIXED_LEAVES, 1)
    g = 0
    while remaining > 0:
        for k in range(20):
            if remaining <= 0:
                break
            kind = 4 if k == 19 else 1 if k == 16 else 2 if k == 17 else 3 if k == 18 else 0
            if kind == 4 and remaining < ARRAY_LEN:
                kind = 0
            out.append((f"group_{g:03d}", f"metric_{k:02d}", kind))
            remaining -= ARRAY_LEN if kind == 4 else 1
        g += 1
    return out


def _rows(rows: int, leaves: int, seed: int) -> Iterator[dict[str, Any]]:
    rng = random.Random(seed)
    shape = _shape(leaves)
    for step in range(rows):
        row: dict[str, Any] = {"step": step}
        for group, key, kind in shape:
            grp = row.setdefault(group, {})
            if kind == 0:
                grp[key] = rng.random() * 100.0
            elif kind == 1:
                grp[key] = rng.randrange(1 << 40)
            elif kind == 2:
                grp[key] = f"{rng.getrandbits(64):016x}"
            elif kind == 3:
                grp[key] = rng.random() < 0.5
            else:
                grp[key] = [rng.random() for _ in range(ARRAY_LEN)]
        yield row


def _leaf_count(row: Any) -> int:
    if isinstance(row, dict) and row:
        return sum(_leaf_count(v) for v in row.values())
    if isinstance(row, list) and row:
        return sum(_leaf_count(v) for v in row)
    return 1


def write_pair(directory: Path, rows: int, leaves: int) -> tuple[Path, Path, int, int]:
    """Write ``a.jsonl`` and ``b.jsonl``; return their paths, the planted step and the leaf count."""
    timing_keys = ("elapsed_s", "sample_wall_s", "forward_wall_s", "backward_wall_s", "optimizer_wall_s")
    planted = min(rows - 1, int(rows * 0.995))
    clock = random.Random(7)
    a_path, b_path = directory / "a.jsonl", directory / "b.jsonl"
    per_row = 0
    with open(a_path, "wb") as fa, open(b_path, "wb") as fb:
        for row in _rows(rows, leaves, seed=1):
            step = row["step"]
            for f in (fa, fb):
                row["timing"] = {k: clock.random() for k in timing_keys}
                row["memory"] = {"peak_rss_bytes": clock.randrange(1 << 30, 1 << 31)}
                if f is fb and step >= planted:
                    row["group_000"]["metric_05"] += 1.0
                    if step >= planted + 10:
                        for key in ("metric_01", "metric_02", "metric_03"):
                            row["group_000"][key] *= 1.01
                f.write(json.dumps(row, sort_keys=True, separators=(",", ":")).encode() + b"\n")
            if not per_row:
                per_row = _leaf_count(row)
    return a_path, b_path, planted, per_row


def parse_only(a: Path, b: Path) -> int:
    """The floor: every line of both files read and parsed by the standard library."""
    n = 0
    loads = json.loads
    with open(a, "rb") as fa, open(b, "rb") as fb:
        for la, lb in zip(fa, fb, strict=False):
            loads(la)
            loads(lb)
            n += 1
    return n


def parse_only_msgspec(a: Path, b: Path) -> int:
    """msgspec's parse alone of every line of both files (reported: the floor for that parser)."""
    import msgspec

    n = 0
    decode = msgspec.json.Decoder().decode
    with open(a, "rb") as fa, open(b, "rb") as fb:
        for la, lb in zip(fa, fb, strict=False):
            decode(la)
            decode(lb)
            n += 1
    return n


def run(rows: int, leaves: int, repeats: int, workdir: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    a, b, planted, per_row = write_pair(workdir, rows, leaves)
    gen_s = time.perf_counter() - t0
    parse_only(a, b)  # untimed: warms the page cache for both timed paths
    names = ("baseline", "diag_diff", "msgspec_parse")
    cpu: dict[str, list[float]] = {k: [] for k in names}
    wall: dict[str, list[float]] = {k: [] for k in names}
    loads: list[list[float]] = []
    report = None
    for _ in range(repeats):
        loads.append(list(common.machine()["load_average"] or []))
        for name in names:
            gc.collect()
            w, c = time.perf_counter(), time.process_time()
            if name == "baseline":
                parse_only(a, b)
            elif name == "msgspec_parse":
                parse_only_msgspec(a, b)
            else:
                report = diff_files(a, b)
            cpu[name].append(time.process_time() - c)
            wall[name].append(time.perf_counter() - w)
    assert report is not None
    first = report.first
    if first is None or first.step != planted or report.rows_compared != rows:
        raise SystemExit(f"{NAME}: the planted divergence at step {planted} was not reported "
                         f"(first: {first.step if first else None}, rows compared {report.rows_compared})")
    return {"rows": rows, "leaves_per_row": per_row, "planted_step": planted, "generate_s": gen_s,
            "bytes_per_file": a.stat().st_size,
            "baseline_cpu_s": common.stats(cpu["baseline"]), "diag_diff_cpu_s": common.stats(cpu["diag_diff"]),
            "baseline_wall_s": common.stats(wall["baseline"]), "diag_diff_wall_s": common.stats(wall["diag_diff"]),
            "msgspec_parse_cpu_s": common.stats(cpu["msgspec_parse"]),
            "msgspec_parse_wall_s": common.stats(wall["msgspec_parse"]), "load_average_per_round": loads,
            "rows_diverging": report.rows_diverging,
            "first_divergence_leaves": first.diverging_leaves}


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__.splitlines()[0] if __doc__ else NAME)
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--leaves", type=int, default=700)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None, help="where to write the two files (default: a temp dir)")
    args = ap.parse_args(argv)
    rows, leaves, repeats = (300, 60, 1) if args.smoke else (args.rows, args.leaves, args.repeats)
    with tempfile.TemporaryDirectory(prefix="diag_diff.", dir=args.workdir) as tmp:
        m = run(rows, leaves, repeats, Path(tmp))
    med_base, med_diff = m["baseline_cpu_s"]["median"], m["diag_diff_cpu_s"]["median"]
    r = common.ratio(med_diff, med_base)
    common.report(
        NAME, smoke=args.smoke, results=args.results, ratio_value=r,
        ratio_definition="median diag-diff CPU seconds / median parse-only CPU seconds (both files, same run)",
        baseline="read both files line by line and json.loads every line",
        target=common.Target("<=", TARGET, r),
        detail=(f"{m['rows']} rows x {m['leaves_per_row']} leaves: diag-diff {med_diff:.2f} CPU s vs parse-only "
                f"{med_base:.2f} CPU s (median of {repeats}; msgspec parse-only "
                f"{m['msgspec_parse_cpu_s']['median']:.2f} CPU s); first divergence step {m['planted_step']}"),
        notes=["Both timed paths are single-threaded and CPU-bound on page-cached files, so the ratio uses "
               "this process's CPU time (time.process_time), which other load on the machine does not "
               "inflate; wall-clock times are recorded alongside."],
        measurements=m, parameters={"rows": rows, "leaves": leaves, "repeats": repeats},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
