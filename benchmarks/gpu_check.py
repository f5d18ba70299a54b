"""The Python half of ``scripts/gpu/check.sh``: which carried wheels a machine lacks, what the machine is,
and the one results file.  Standard library only: it runs before anything is installed.

``wheels`` prints every carried distribution pinned (``name==version``, one a line): the list
``scripts/gpu/fetch-wheels.sh`` downloads.  ``missing`` prints those the interpreter lacks (the module
does not import, or its version is below what replayjob or pytest requires), which are the only ones
``check.sh`` installs.  ``env FILE`` records the interpreter, torch, CUDA, the GPU (``nvidia-smi``) and
where each required package came from.  ``unpack WHEEL... --target DIR`` installs wheels by
extraction, for a machine without pip.  ``collect`` reads what the parts left in the work directory
(their exit codes and times, pytest's JUnit XML, the ablation's benchmark JSON and verdicts, or its
partial replays when it was cut short), writes the results file and prints a summary drawn from it,
so every figure printed is in the file.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

SCHEMA = "replayjob.gpu-check/v1"
RESULTS_NAME = "gpu-check.json"
LOG_TAIL = 65536  # bytes of each part's output kept in the results file (its figures included)

# (distribution, pinned version carried, import name, lowest version accepted from the machine).
# The pins are the versions the test suite passes with; the minimums are pyproject.toml's (replayjob's
# dependencies) and pytest's own (its dependencies).  torch, transformers, peft and numpy are never
# carried: the machine's builds are used.
REQUIREMENTS: tuple[tuple[str, str, str, str], ...] = (
    ("docopt-ng", "0.9.0", "docopt", "0.9"),
    ("msgspec", "0.23.0", "msgspec", "0.18"),
    ("safetensors", "0.8.0", "safetensors", "0.4"),
    ("PyYAML", "6.0.4", "yaml", "6.0"),
    ("pytest", "9.2.0", "pytest", "8.0"),
    ("pluggy", "1.7.0", "pluggy", "1.6"),
    ("iniconfig", "2.3.1", "iniconfig", "2.0"),
    ("packaging", "26.4", "packaging", "24.0"),
    ("Pygments", "2.21.0", "pygments", "2.15"),
)
# The build backend for installing replayjob itself; used only in pip's isolated build environment
# when the machine's setuptools is missing or older than pyproject.toml's build requirement.
# 70.1: the first setuptools that builds wheels without the separate ``wheel`` package.
BUILD_REQUIREMENTS: tuple[tuple[str, str, str, str], ...] = (("setuptools", "84.2.1", "setuptools", "70.1"),)


def _version_tuple(text: str) -> tuple[int, ...]:
    m = re.match(r"\d+(?:\.\d+)*", text)
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def _installed_version(dist: str, module: str) -> str | None:
    """The distribution's version when its module imports, else None."""
    try:
        importlib.import_module(module)
    except Exception:
        return None
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        mod = sys.modules.get(module)
        return str(getattr(mod, "__version__", "0"))


def _dist_version(dist: str, module: str) -> str | None:
    """The distribution's version without importing it (None when its module cannot be found)."""
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def missing(force: list[str], rows: tuple[tuple[str, str, str, str], ...] = REQUIREMENTS) -> list[str]:
    """``name==version`` of every row the interpreter lacks or has too old, plus those named in ``force``."""
    forced = {_normal(f) for f in force}
    out = []
    for dist, pin, module, minimum in rows:
        have = _installed_version(dist, module)
        if _normal(dist) in forced or have is None or _version_tuple(have) < _version_tuple(minimum):
            out.append(f"{dist}=={pin}")
    return out


def _run(cmd: list[str], timeout: float = 20) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def source_digest(root: Path) -> dict[str, Any]:
    """SHA-256 over the checked sources (path and bytes of each file, sorted), so a result names its tree
    even where the copy has no git metadata."""
    files = sorted(p for pattern in ("replayjob/**/*.py", "replayjob/data/*", "benchmarks/*.py", "benchmarks/*.sh",
                                     "scripts/gpu/*.sh", "tests/test_gpu.py", "tests/conftest.py", "pyproject.toml")
                   for p in root.glob(pattern) if p.is_file() and "__pycache__" not in p.parts)
    h = hashlib.sha256()
    for p in files:
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    head = _run(["git", "-C", str(root), "rev-parse", "HEAD"])
    return {"sha256": h.hexdigest(), "files": len(files), "git_head": head}


def environment(site: Path | None) -> dict[str, Any]:
    """The interpreter, torch and its device, the GPU as nvidia-smi sees it, and each package's origin."""
    env: dict[str, Any] = {
        "python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
        "cpus": os.cpu_count(), "utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    with contextlib.suppress(OSError):
        env["load_average"] = list(os.getloadavg())
    packages: dict[str, Any] = {}
    heavy = ("torch", "transformers", "peft", "accelerate", "numpy", "replayjob")
    for dist, module in [(r[0], r[2]) for r in (*REQUIREMENTS, *BUILD_REQUIREMENTS)] + [(m, m) for m in heavy]:
        # the carried ones are imported (they are light, and must load); the machine's heavy ones are only found
        version = _installed_version(dist, module) if module not in heavy else _dist_version(dist, module)
        spec = importlib.util.find_spec(module) if version is not None else None
        where = spec.origin if spec is not None else None
        origin = None
        if version is not None:
            origin = ("carried" if site is not None and where and where.startswith(str(site))
                      else "source tree" if where and where.startswith(os.path.join(os.getcwd(), module, ""))
                      else "machine")
        packages[dist] = {"version": version, "origin": origin, "path": where}
    env["packages"] = packages
    env["source"] = source_digest(Path.cwd())
    try:
        import torch
    except Exception as exc:
        env["torch_error"] = f"{type(exc).__name__}: {exc}"
    else:
        env["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                        "cuda_available": torch.cuda.is_available(),
                        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                        if torch.cuda.is_available() else []}
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used,utilization.gpu,"
                "temperature.gpu,clocks.sm,clocks.max.sm,mig.mode.current", "--format=csv,noheader"])
    env["nvidia_smi"] = smi.splitlines() if smi else None
    return env


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def find_wheel(directory: Path, spec: str) -> Path:
    """The wheel for ``name==version`` in ``directory`` (wheel file names are normalised inconsistently)."""
    name, _, version = spec.partition("==")
    found = [w for w in sorted(directory.glob("*.whl"))
             if _normal(w.name.split("-")[0]) == _normal(name) and w.name.split("-")[1] == version]
    if not found:
        raise SystemExit(f"no wheel for {spec} in {directory}; run scripts/gpu/fetch-wheels.sh where there is network")
    return found[0]


def unpack(specs: list[str], directory: Path, target: Path) -> list[str]:
    """Install ``name==version`` wheels from ``directory`` by extraction (what pip does for ``--target``, less
    scripts and metadata records); for a machine without pip."""
    target.mkdir(parents=True, exist_ok=True)
    done = []
    for wheel in (find_wheel(directory, s) for s in specs):
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                parts = Path(name).parts
                if ".." in parts or name.startswith("/"):
                    raise SystemExit(f"{wheel}: refusing member {name!r}")
            zf.extractall(target)
        done.append(wheel.name)
    return done


def _tail(path: Path, n: int = LOG_TAIL) -> str:
    if not path.is_file():
        return ""
    data = path.read_bytes()[-n:]
    return data.decode("utf-8", errors="replace")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _parts(work: Path) -> dict[str, dict[str, Any]]:
    parts: dict[str, dict[str, Any]] = {}
    tsv = work / "parts.tsv"
    if tsv.is_file():
        for line in tsv.read_text(encoding="utf-8").splitlines():
            name, rc, seconds, limit, note = (line.split("\t") + [""] * 5)[:5]
            parts[name] = {"rc": int(rc), "seconds": float(seconds), "limit_s": float(limit),
                           "timed_out": int(rc) in (124, 137), "note": note or None,
                           "log_tail": _tail(work / "logs" / f"{name}.log")}
    return parts


def _junit(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        root = ElementTree.parse(path).getroot()
    except ElementTree.ParseError as exc:
        return {"parse_error": str(exc)}
    cases = []
    for case in root.iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome, message = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag], \
                    (el.get("message") or "")[:500]
                break
        cases.append({"name": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0.0), "message": message})
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    return {"tests": len(cases), **counts, "cases": cases}


def _quartiles(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values),
            "iqr": q[2] - q[0], "values": values}


def _partial_ablation(run: Path) -> dict[str, Any]:
    """What a cut-short ablation left: per arm the finished replays' update seconds and peak memory."""
    arms: dict[str, Any] = {}
    for path in sorted((run / "replays").glob("*/repeat-*/replay_metrics.json")):
        doc = _read_json(path)
        if not isinstance(doc, dict):
            continue
        arm = arms.setdefault(path.parent.parent.name, {"local_train_wall_s": [], "peak_memory_bytes": []})
        with contextlib.suppress(KeyError, TypeError, ValueError):
            arm["local_train_wall_s"].append(float(doc["timing"]["local_train_wall_s"]))
            arm["peak_memory_bytes"].append(float(doc["memory"]["peak_bytes"]))
    walls: dict[str, list[float]] = {}
    tsv = run / "process_wall.tsv"
    if tsv.is_file():
        for line in tsv.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                phase, seconds = line.split("\t")
                walls.setdefault(phase, []).append(float(seconds))
    return {"source_captured": (run / "source" / "metrics.json").is_file(),
            "arms": {a: {k: _quartiles(v) for k, v in d.items()} for a, d in arms.items()},
            "process_wall_s": {k: _quartiles(v) for k, v in walls.items()}}


def _verdicts(run: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path in sorted(run.glob("verdict-*.json")):
        doc = _read_json(path)
        if isinstance(doc, dict):
            claim = path.stem.removeprefix("verdict-")
            report = run / f"report-{claim}.md"
            out[claim] = {"verdict": doc, "report_md": report.read_text(encoding="utf-8") if report.is_file() else None}
    return out


def _judge(mode: str, parts: dict[str, Any], pytest_doc: dict[str, Any] | None,
           ablation: dict[str, Any]) -> list[str]:
    """The names of the parts that failed, each with why."""
    failed = []
    for name in ("install", "env", "pytest-gpu", "ablation"):
        p = parts.get(name)
        if p is None:
            failed.append(f"{name}: did not run")
        elif p["rc"] != 0:
            failed.append(f"{name}: exit {p['rc']}" + (" (time limit)" if p["timed_out"] else "")
                          + (f", {p['note']}" if p["note"] else ""))
    if pytest_doc is None or "parse_error" in pytest_doc:
        failed.append("pytest-gpu: no JUnit report")
    elif mode == "gpu" and (pytest_doc["passed"] == 0 or pytest_doc["skipped"]):
        failed.append(f"pytest-gpu: {pytest_doc['passed']} passed, {pytest_doc['skipped']} skipped on the GPU")
    if ablation.get("benchmark") is None:
        failed.append("ablation: no benchmark JSON")
    elif mode == "gpu":
        devices = ablation["benchmark"].get("measurements", {}).get("devices", [])
        if not any(str(d).startswith("cuda") for d in devices):
            failed.append(f"ablation: replays ran on {devices}, not CUDA")
    return failed


def collect(work: Path, results: Path, *, mode: str, budget_s: float, total_s: float) -> dict[str, Any]:
    parts = _parts(work)
    run = work / "ablation"
    bench_dir = work / "bench"
    bench = next((d for d in (_read_json(p) for p in sorted(bench_dir.glob("gpu_ablation*.json")))
                  if isinstance(d, dict)), None)
    ablation: dict[str, Any] = {"benchmark": bench, "verdicts": _verdicts(run)}
    if bench is None:
        ablation["partial"] = _partial_ablation(run)
    pytest_doc = _junit(work / "pytest-gpu.xml")
    install = {"missing": _lines(work / "missing.txt"), "installed": _lines(work / "installed.txt"),
               "how": _lines(work / "install-how.txt")}
    failed = _judge(mode, parts, pytest_doc, ablation)
    doc = {"schema": SCHEMA, "mode": mode, "status": "fail" if failed else "pass", "failed": failed,
           "total_s": total_s, "budget_s": budget_s, "environment": _read_json(work / "env.json"),
           "install": install, "parts": parts, "pytest_gpu": pytest_doc, "ablation": ablation}
    results.parent.mkdir(parents=True, exist_ok=True)
    tmp = results.with_name(results.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, results)
    return doc


def _lines(path: Path) -> list[str]:
    return [x for x in path.read_text(encoding="utf-8").splitlines() if x] if path.is_file() else []


def summary(doc: dict[str, Any]) -> list[str]:
    """The printed summary; every figure in it is read from ``doc``."""
    out = [f"# gpu check ({doc['mode']}): {doc['status']} in {doc['total_s']:.0f} s of {doc['budget_s']:.0f} s"]
    env = doc.get("environment") or {}
    torch_info = env.get("torch") or {}
    out.append(f"- machine: python {env.get('python')}, torch {torch_info.get('version')} (CUDA "
               f"{torch_info.get('cuda')}), devices {torch_info.get('devices')}, nvidia-smi {env.get('nvidia_smi')}")
    out.append(f"- install: missing {doc['install']['missing'] or 'none'}; installed "
               f"{doc['install']['installed'] or 'none'}; {'; '.join(doc['install']['how'])}")
    for name, p in doc["parts"].items():
        out.append(f"- part {name}: exit {p['rc']} in {p['seconds']:.1f} s (limit {p['limit_s']:.0f} s)"
                   + (" TIMED OUT" if p["timed_out"] else "") + (f"; {p['note']}" if p["note"] else ""))
    pt = doc.get("pytest_gpu")
    if pt and "parse_error" not in pt:
        out.append(f"- pytest -m gpu: {pt['passed']} passed, {pt['failed']} failed, {pt['error']} errors, "
                   f"{pt['skipped']} skipped")
        out.extend(f"  - {c['name']}: {c['outcome']} ({c['seconds']:.1f} s)" for c in pt["cases"])
    ab = doc["ablation"]
    bench = ab.get("benchmark")
    if bench:
        m = bench.get("measurements", {})
        target = bench.get("target") or {}
        out.append(f"- ablation ({bench.get('mode')}): ratio {bench.get('ratio')} ({bench.get('ratio_definition')})")
        out.append(f"  - raw source step {m.get('raw_step_s')} s; whole run {m.get('total_s')} s (target "
                   f"{target.get('op')} {target.get('value')} s, met: {bench.get('target_met')}); verdict exit codes "
                   f"{m.get('verdict_exit_codes')}; devices {m.get('devices')}")
        for arm, a in (m.get("arms") or {}).items():
            upd, peak, proc = a["local_train_wall_s"], a["peak_memory_bytes"], a.get("process_wall_s") or {}
            out.append(f"  - {arm}: n {a['n']}, update median {upd['median']:.4f} s (min {upd['min']:.4f}, "
                       f"max {upd['max']:.4f}, IQR {upd['iqr']:.4f}), process median {proc.get('median')} s, "
                       f"peak {peak['median'] / 2**30:.3f} GiB ({a['memory_kind']})")
    elif "partial" in ab:
        p = ab["partial"]
        out.append(f"- ablation (partial): source captured {p['source_captured']}")
        for arm, a in p["arms"].items():
            upd = a["local_train_wall_s"]
            out.append(f"  - {arm}: {upd['n']} replays, update median {upd.get('median')} s, "
                       f"peak median {a['peak_memory_bytes'].get('median')} bytes")
    for claim, v in ab.get("verdicts", {}).items():
        verdict = v.get("verdict") or {}
        out.append(f"  - verdict {claim}: {verdict.get('status')} (exit {verdict.get('exit_code')}); failed checks "
                   f"{verdict.get('failed_checks') or 'none'}")
    out.extend(f"- FAILED {f}" for f in doc["failed"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "gpu_check")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("wheels", help="every carried distribution, pinned")
    m = sub.add_parser("missing", help="the carried distributions this interpreter lacks")
    m.add_argument("--force", action="append", default=[], metavar="DIST", help="count DIST as missing")
    m.add_argument("--build", action="store_true", help="the build backend instead of the run dependencies")
    e = sub.add_parser("env", help="record the machine")
    e.add_argument("file", type=Path)
    e.add_argument("--site", type=Path)
    u = sub.add_parser("unpack", help="install wheels by extraction")
    u.add_argument("specs", nargs="+", metavar="NAME==VERSION")
    u.add_argument("--find-links", type=Path, required=True)
    u.add_argument("--target", type=Path, required=True)
    c = sub.add_parser("collect", help="write the results file and print its summary")
    c.add_argument("--work", type=Path, required=True)
    c.add_argument("--results", type=Path, required=True)
    c.add_argument("--mode", choices=("gpu", "cpu"), required=True)
    c.add_argument("--budget-s", type=float, required=True)
    c.add_argument("--total-s", type=float, required=True)
    args = p.parse_args(argv)
    if args.cmd == "wheels":
        print(*(f"{d}=={v}" for d, v, _, _ in (*REQUIREMENTS, *BUILD_REQUIREMENTS)), sep="\n")
    elif args.cmd == "missing":
        print(*missing(args.force, BUILD_REQUIREMENTS if args.build else REQUIREMENTS), sep="\n")
    elif args.cmd == "env":
        doc = environment(args.site)
        args.file.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        print(json.dumps(doc, sort_keys=True))
    elif args.cmd == "unpack":
        print(*unpack(args.specs, args.find_links, args.target), sep="\n")
    else:
        doc = collect(args.work, args.results, mode=args.mode, budget_s=args.budget_s, total_s=args.total_s)
        print("\n".join(summary(doc)))
        print(f"wrote {args.results}")
        return 0 if doc["status"] == "pass" else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
