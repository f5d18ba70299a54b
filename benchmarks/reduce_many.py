"""Reduce at scale: 1,000 and 10,000 replays with 0.25 MiB final adapters, against the in-process floor.

Inputs (made here first by ``replayjob.gate.synthetic``, following docs/replay-metrics.md): a source
run with its capture manifest and N replay_metrics.json files (two arms), each with a final adapter
of ``--adapter-mib`` MiB: a valid safetensors file of ``--tensors`` F32 tensors (LoRA A/B pairs), the
same bytes for every replay and the source, as a bitwise-equal ablation has.  Timed in the same run,
alternating after one untimed pass of each (page cache warm):

* the floor: ``sha256sum`` over every adapter file reduce hashes (the replays' and the source's), in one
  process, plus a stdlib read + ``json.loads`` of every metrics file (the replays' and the source's);
* the stricter in-process floor, reported: the same files through ``hashlib.sha256`` (OpenSSL) on one
  thread, plus the same parse;
* ``reduce --claim exact-input --baseline`` in-process: strict reading and validation, every check
  (each final adapter hashed and its safetensors header checked), spread statistics, seeded bootstrap
  ratios and the verdict write; the same with ``--claim bitwise``;
* one fresh ``python -m replayjob reduce --claim exact-input`` process, interpreter start and imports
  included: what a workflow step pays, with the package's bytecode written first (``compileall``), as an
  install writes it (an editable install under ``PYTHONDONTWRITEBYTECODE`` never does, and each process
  would compile every module again: about 0.17 s here);
* the CPU seconds of each: ``time.process_time`` (every thread of this process) for the floor and the
  in-process reduces, the children's ``getrusage`` for the fresh process (the JSON records the load
  averages too: other load on a 2-core machine inflates wall time, and the CPU ratio says how much work
  each did whatever the load).

* the same fresh process over a handful of replays (three an arm): its fixed cost (interpreter, imports, the
  verdict's write), so the fresh process's cost per file is reported above it.

Ratio (judged): the slower of the two in-process reduces / the in-process floor (one-thread ``hashlib`` +
parse), at each file count; the largest counts.  Target: <= 1.5 at 1,000 and at 10,000 files (small
adapters make the per-file cost visible: a ``sha256sum`` subprocess would hide it).  The fresh process is
reported beside it, whole and above its fixed cost: at 1,000 files the floor is about 0.2 s and the fixed cost
(an interpreter and numpy's import among it) about as much, which no per-file work can bring under 1.5x.  The
``sha256sum`` ratios stay in the JSON.  The summary gives, at each count, the judged ratio, the milliseconds
per file above the floor (linear growth keeps it flat), each reduce's own ratio and the CPU ratios.

Size: 10,000 x 0.25 MiB is 2.5 GiB in the page cache; ``--files`` and ``--adapter-mib`` change it.

Run: ``python -m benchmarks.reduce_many [--smoke] [--files N...] [--adapter-mib M] [--tensors T] [--repeats N]``
"""

from __future__ import annotations

import compileall
import json
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import replayjob
from benchmarks import common
from replayjob.gate import synthetic
from replayjob.gate.evidence import REPLAY_FILE, SOURCE_FILE
from replayjob.gate.reducer import Request, reduce_evidence
from replayjob.runtime.knobs import GRADIENT_CHECKPOINTING as GC_KEY

NAME = "reduce_many"
TARGET = 1.5  # x the in-process floor, at every file count (the per-file cost above hashing)
JUDGED = ("exact_input", "bitwise")  # the in-process reduces; the fresh process is reported beside them
ARMS: dict[str, dict[str, Any]] = {"baseline": {}, "gradient_checkpointing=true": {GC_KEY: True}}


def adapter(nbytes: int, tensors: int) -> bytes:
    """A seeded ``nbytes`` safetensors adapter of ``tensors`` F32 tensors (``nbytes`` rounded down to fit)."""
    per = max(4, nbytes // tensors // 4 * 4)
    return synthetic.adapter_file(random.Random(0).randbytes(per * tensors), tensors=tensors, dtype="F32")


def sha256sum(paths: list[Path], exe: str) -> None:
    """The floor the target names: coreutils ``sha256sum`` over the files, one process."""
    proc = subprocess.run([exe, "--", *map(str, paths)], capture_output=True, check=False)
    if proc.returncode != 0 or proc.stdout.count(b"\n") != len(paths):
        raise RuntimeError(f"sha256sum exited {proc.returncode}: {proc.stderr.decode()[-500:]}")


def parse(paths: list[Path]) -> None:
    for p in paths:
        json.loads(p.read_bytes())


def run(files: int, adapter_bytes: int, tensors: int, repeats: int, work: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    final = adapter(adapter_bytes, tensors)
    ev = synthetic.build(work / "ev", ARMS, max(1, files // len(ARMS)), final=final)
    few = synthetic.build(work / "few", ARMS, 3, final=final)  # the fresh process's fixed cost
    build_s = time.perf_counter() - t0
    replays = ev.root / "replays"
    metrics = [*sorted(replays.rglob(REPLAY_FILE)), ev.source / SOURCE_FILE]
    adapters = [*(p.parent / synthetic.ADAPTER for p in metrics[:-1]), ev.source / synthetic.ADAPTER]
    exe = shutil.which("sha256sum")

    def reduce(claim: str) -> None:
        v = reduce_evidence(Request([str(replays)], claim, work / f"{claim}.json", source=ev.source,
                                    baseline="baseline"))
        if v.status != "pass":
            raise RuntimeError(f"benchmark evidence did not pass {claim}: {v.doc['failed_checks']}")

    if not compileall.compile_dir(Path(replayjob.__file__).parent, quiet=1):
        raise RuntimeError("compileall could not write the package's bytecode")
    argv = [sys.executable, "-m", "replayjob", "reduce", str(replays), "--claim", "exact-input", "--out",
            str(work / "cli.json"), "--source", str(ev.source), "--baseline", "baseline"]

    argv_few = [sys.executable, "-m", "replayjob", "reduce", str(few.root / "replays"), "--claim", "exact-input",
                "--out", str(work / "cli-few.json"), "--source", str(few.source), "--baseline", "baseline"]

    def cli(args: list[str] = argv) -> None:
        proc = subprocess.run(args, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"reduce process exited {proc.returncode}: {proc.stderr.strip()[-500:]}")

    timed: dict[str, Any] = {
        "parse": lambda: parse(metrics),
        "hashlib": lambda: common.hash_files(adapters),
        "exact_input": lambda: reduce("exact-input"),
        "bitwise": lambda: reduce("bitwise"),
        "cli_process_exact_input": cli,
        "cli_process_fixed": lambda: cli(argv_few),
    }
    if exe is not None:
        timed["sha256sum"] = lambda: sha256sum(adapters, exe)
    wall: dict[str, list[float]] = {k: [] for k in timed}
    cpu: dict[str, list[float]] = {k: [] for k in ("parse", "hashlib", "exact_input", "bitwise",
                                                   "cli_process_exact_input")}
    loads: list[list[float]] = []
    for fn in timed.values():  # untimed: the page cache and every code path warm
        fn()
    for _ in range(repeats):
        loads.append(list(common.machine()["load_average"] or []))
        for k, fn in timed.items():
            c, kids = time.process_time(), _children_cpu()
            wall[k] += common.measure(fn, repeats=1, warmup=0)
            if k in cpu:
                cpu[k].append(_children_cpu() - kids if k.startswith("cli") else time.process_time() - c)
    med = {k: common.stats(v)["median"] for k, v in wall.items()}
    cpu_med = {k: common.stats(v)["median"] for k, v in cpu.items()}
    floor = med["sha256sum"] + med["parse"] if exe is not None else None
    floor_hashlib = med["hashlib"] + med["parse"]
    floor_cpu = cpu_med["hashlib"] + cpu_med["parse"]
    slowest = max(JUDGED, key=lambda k: med[k])
    return {
        "files": len(metrics) - 1, "adapter_bytes": len(final), "adapter_files": len(adapters),
        "adapter_total_bytes": len(final) * len(adapters), "tensors_per_adapter": tensors, "build_s": build_s,
        **{f"{k}_s": common.stats(v) for k, v in wall.items()},
        "cpu_s": {k.replace("_", "-"): common.stats(v) for k, v in cpu.items()},
        "floor_s": floor, "floor_hashlib_s": floor_hashlib, "floor_hashlib_cpu_s": floor_cpu, "slowest": slowest,
        "ratios": {k: {"sha256sum": None if floor is None else med[k] / floor, "hashlib": med[k] / floor_hashlib,
                       "cpu": cpu_med[k] / floor_cpu}
                   for k in ("exact_input", "bitwise", "cli_process_exact_input")},
        "ms_per_file_above_floor": {k: 1e3 * (med[k] - floor_hashlib) / (len(metrics) - 1)
                                    for k in ("exact_input", "bitwise", "cli_process_exact_input")},
        "cli_process_above_fixed": {
            "fixed_s": med["cli_process_fixed"],
            "ratio": (med["cli_process_exact_input"] - med["cli_process_fixed"]) / floor_hashlib},
        "load_average_per_round": loads, "sha256sum": exe,
    }


def _summary(m: dict[str, Any], ratio: float, per_file_ms: float) -> str:
    """One count's figures: the judged ratio and cost per file above the floor, each reduce's ratio, CPU, load."""
    r = m["ratios"]
    loads = [x for round_ in m["load_average_per_round"] for x in round_]
    return (f"{m['files']} files x {m['adapter_bytes'] / 2**20:.2f} MiB: {ratio:.2f}x, {per_file_ms:.3f} ms a file "
            f"above the floor (slowest: {m['slowest'].replace('_', ' ')}); exact-input "
            f"{m['exact_input_s']['median']:.3f} s ({r['exact_input']['hashlib']:.2f}x), bitwise "
            f"{m['bitwise_s']['median']:.3f} s ({r['bitwise']['hashlib']:.2f}x), fresh process "
            f"{m['cli_process_exact_input_s']['median']:.3f} s ({r['cli_process_exact_input']['hashlib']:.2f}x; "
            f"{m['cli_process_above_fixed']['ratio']:.2f}x above its fixed {m['cli_process_fixed_s']['median']:.3f} s) "
            f"against hashlib+parse {m['floor_hashlib_s']:.3f} s; CPU {r['exact_input']['cpu']:.2f}x / "
            f"{r['bitwise']['cpu']:.2f}x / {r['cli_process_exact_input']['cpu']:.2f}x of the floor's "
            f"{m['floor_hashlib_cpu_s']:.3f} s; load average {min(loads, default=0):.1f}-{max(loads, default=0):.1f}")


def _children_cpu() -> float:
    """User + system CPU seconds of every finished child process so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0] if __doc__ else NAME)
    p.add_argument("--files", type=int, nargs="+", default=None,
                   help="replay metric files, one run per count (default 1000 10000; smoke 20)")
    p.add_argument("--adapter-mib", type=float, default=None, help="MiB per final adapter (default 0.25; smoke 0.0625)")
    p.add_argument("--tensors", type=int, default=None, help="tensors per adapter (default 16)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 3; smoke 1)")
    p.add_argument("--workdir", type=Path, default=None, help="where to write the evidence (default: a temp dir)")
    args = p.parse_args(argv)
    sizes = args.files or ([20] if args.smoke else [1000, 10000])
    mib = args.adapter_mib or (1 / 16 if args.smoke else 0.25)
    tensors = args.tensors or 16
    repeats = args.repeats or (1 if args.smoke else 3)
    runs = {}
    for files in sizes:
        with tempfile.TemporaryDirectory(prefix="replayjob-bench-", dir=args.workdir) as tmp:
            runs[files] = run(files, int(mib * 2**20), tensors, repeats, Path(tmp))
    ratios = {n: m["ratios"][m["slowest"]]["hashlib"] for n, m in runs.items()}
    judged = max(ratios.values())
    per_file_ms = {n: 1e3 * (m[f"{m['slowest']}_s"]["median"] - m["floor_hashlib_s"]) / m["files"]
                   for n, m in runs.items()}
    detail = "; ".join(_summary(m, ratios[n], per_file_ms[n]) for n, m in runs.items())
    common.report(
        NAME, smoke=args.smoke, results=args.results, ratio_value=judged,
        ratio_definition="largest over the file counts of: slower median in-process reduce seconds (exact-input "
                         "or bitwise) / (median one-thread hashlib.sha256 seconds over the same adapter files + "
                         "median stdlib parse seconds of the metrics files); the fresh process is reported beside "
                         "it, whole and above its fixed cost (the same process over three replays an arm)",
        baseline="the in-process floor: the same adapter files through hashlib.sha256 and the metrics files through "
                 "a stdlib read and json.loads, one pass, same run",
        target=common.Target("<=", TARGET, judged), detail=detail,
        measurements={"runs": {str(n): m for n, m in runs.items()}, "ms_per_file_above_floor": per_file_ms},
        parameters={"files": sizes, "adapter_mib": mib, "tensors": tensors, "repeats": repeats,
                    "arms": list(ARMS), "package_bytecode": "written by compileall before the fresh process is timed"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
