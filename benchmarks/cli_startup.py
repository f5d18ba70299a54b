"""CLI start-up: each command that needs no model, timed as a fresh process against ``python -c pass``.

Commands timed, each on a tiny valid input made here first (a ``replayjob init`` workspace, one
capture with bundle capture on, one replay): ``--help``, ``diag-diff`` (the capture's diag.jsonl
against a copy of it), ``reduce --claim exact-input`` and ``--claim bitwise`` (the one replay, ``--source``
the capture), ``bundle inspect`` and ``bundle validate`` (the captured update bundle) and
``explain`` (the replay config with its pins).  A command not in this tree's CLI is reported as
missing, not timed.  Each process also reports whether ``transformers`` or ``peft`` was imported.

The installed ``replayjob`` console script is timed (what a user runs); runs alternate between the
bare interpreter and each command so that load on the machine hits both alike.  Commands run with
``PYTHONDONTWRITEBYTECODE`` removed from their environment, so the untimed first start writes the
bytecode cache a user's installation has: with the variable set every start compiles each module
again (about 0.13 s of a ``reduce`` start on a 2-core Xeon).  The JSON says whether the cache was
there (``bytecode_cached``).

Ratio: median ``replayjob --help`` seconds / median ``python -c pass`` seconds.  Target: ``--help``
within 0.3 s of the bare interpreter (median difference <= 0.3 s); also judged: ``reduce`` for the
exact-input and bitwise claims within 0.3 s of it (the gate every submission runs; neither imports
torch).  Every command's median, its difference from the bare interpreter and whether it imported
torch are in the JSON, and (reported, not judged) docopt's in-process parse of the ``reduce`` command
line with the whole usage text and with its command's lines only (``reduce_parse_s``).

Run: ``python -m benchmarks.cli_startup [--smoke] [--repeats N]``
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common

NAME = "cli_startup"
TARGET_DELTA_S = 0.3
HEAVY = ("transformers", "peft")
REDUCE = ("reduce exact-input", "reduce bitwise")  # also judged: within TARGET_DELTA_S of the bare interpreter
# Runs replayjob.cli.main(argv) and then writes which heavy modules the process imported.
PROBE = ("import json, sys\n"
         "from replayjob.cli import main\n"
         "out = sys.argv[1]\n"
         "rc = main(sys.argv[2:])\n"
         "heavy = sorted(m for m in ('transformers', 'peft') if m in sys.modules)\n"
         "open(out, 'w').write(json.dumps({'rc': rc, 'heavy': heavy, 'torch': 'torch' in sys.modules}))\n")



def pin_args(source: Path) -> list[str]:
    """The two ``--set`` pins a replay or explain of the capture in ``source`` needs, from its metrics.json."""
    from replayjob.artifacts.metrics import read_pins

    logical, manifest, _ = read_pins(source)
    return ["--set", f"optimizer_batch.expected_logical_sha256=\"{logical}\"",
            "--set", f"optimizer_batch.expected_manifest_sha256=\"{manifest}\""]


def _copy(diag: Path, scratch: Path) -> Path:
    """A second file of the capture's rows (diag-diff refuses a file compared with itself)."""
    copy = scratch / "diag-copy.jsonl"
    copy.write_bytes(diag.read_bytes())
    return copy


def commands(inputs: dict[str, Path]) -> dict[str, tuple[str, list[str], tuple[int, ...]]]:
    """label -> (CLI command name, argv, accepted exit codes) for every no-model command."""
    ws, src, rep, bundle = inputs["workspace"], inputs["source"], inputs["replays"], inputs["bundle"]
    pin_sets = pin_args(src)
    out = inputs["scratch"]
    return {
        "--help": ("--help", ["--help"], (0,)),
        "diag-diff": ("diag-diff", ["diag-diff", str(src / "diag.jsonl"), str(_copy(src / "diag.jsonl", out))], (0,)),
        "reduce exact-input": ("reduce", ["reduce", str(rep), "--claim", "exact-input", "--source", str(src),
                                          "--min-repeats", "1", "--out", str(out / "exact.json")], (0,)),
        "reduce bitwise": ("reduce", ["reduce", str(rep), "--claim", "bitwise", "--source", str(src),
                                      "--min-repeats", "1", "--out", str(out / "bitwise.json")], (0,)),
        "bundle inspect": ("bundle", ["bundle", "inspect", str(bundle)], (0,)),
        "bundle validate": ("bundle", ["bundle", "validate", str(bundle)], (0,)),
        "explain": ("explain", ["explain", str(ws / "replay.toml"), *pin_sets], (0,)),
    }


def prepare(work: Path) -> dict[str, Path]:
    """A workspace, one capture (with a bundle) and one replay, made in this process."""
    from replayjob.cli import main
    from replayjob.launch.workspace import init_workspace

    ws = work / "ws"
    init_workspace(ws, 123)
    src, bundles = ws / "source", work / "bundles"
    env: dict[str, str | None] = {"REPLAYJOB_BUNDLE_CAPTURE": "1", "REPLAYJOB_BUNDLE_DIR": str(bundles)}
    with common.environment(env), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["capture", str(ws / "source.toml"), "--out", str(src)])
    if rc != 0:
        raise RuntimeError("the capture that makes the benchmark's inputs failed")
    rep = ws / "replays"
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["replay", str(ws / "replay.toml"), "--out", str(rep / "repeat-000"), *pin_args(src)])
    if rc != 0:
        raise RuntimeError("the replay that makes the benchmark's inputs failed")
    found = sorted(p.parent for p in bundles.rglob("COMPLETE") if p.parent.name.startswith("update-"))
    if not found:
        raise RuntimeError(f"bundle capture wrote no update bundle under {bundles}")
    scratch = work / "scratch"
    scratch.mkdir()
    return {"workspace": ws, "source": src, "replays": rep, "bundle": found[0], "scratch": scratch}


def _launcher() -> list[str]:
    script = Path(sys.executable).with_name("replayjob")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "replayjob"]


# Every timed process: the caller's environment, but bytecode is cached as in a user's installation.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def bytecode_cached() -> bool:
    """Whether the CLI's modules have their bytecode cache (written by the untimed first start)."""
    import replayjob.cli
    import replayjob.commands.reduce

    return all(Path(importlib.util.cache_from_source(m.__file__)).is_file()
               for m in (replayjob.cli, replayjob.commands.reduce) if m.__file__)


def _time(argv: list[str], ok: tuple[int, ...]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, env=ENV)
    dt = time.perf_counter() - t0
    if proc.returncode not in ok:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return dt


def probe(argv: list[str], work: Path) -> dict[str, Any]:
    """Run ``replayjob.cli.main(argv)`` in a fresh interpreter; return its exit code and heavy imports."""
    out = work / f"probe-{time.perf_counter_ns()}.json"
    proc = subprocess.run([sys.executable, "-c", PROBE, str(out), *argv], capture_output=True, text=True,
                          check=False, env=ENV)
    if not out.is_file():
        raise RuntimeError(f"probe of {argv} wrote nothing: {proc.stderr.strip()[-500:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def parse_cost(argv: list[str], repeats: int) -> dict[str, float]:
    """Median seconds of docopt's parse of ``argv`` in this process: with the whole usage text and with the
    lines of its command only (what the CLI parses, :func:`replayjob.cli.usage_for`)."""
    from docopt import docopt

    import replayjob.cli as cli

    out = {}
    for label, doc in (("whole_usage_s", cli.__doc__ or ""), ("own_usage_s", cli.usage_for(argv))):
        runs = []
        for _ in range(max(repeats, 3)):
            t0 = time.perf_counter()
            docopt(doc, argv=argv, default_help=True)
            runs.append(time.perf_counter() - t0)
        out[label] = sorted(runs)[len(runs) // 2]
    return out


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0] if __doc__ else NAME)
    p.add_argument("--repeats", type=int, default=None, help="timed starts per command (default 15; smoke 1)")
    args = p.parse_args(argv)
    repeats = args.repeats or (1 if args.smoke else 15)
    from replayjob.cli import COMMANDS

    with tempfile.TemporaryDirectory(prefix="replayjob-bench-") as tmp:
        work = Path(tmp)
        table = commands(prepare(work))
        missing = sorted(label for label, (cmd, _, _) in table.items() if cmd != "--help" and cmd not in COMMANDS)
        present = {k: v for k, v in table.items() if k not in missing}
        bare = [sys.executable, "-c", "pass"]
        launch = _launcher()
        times: dict[str, list[float]] = {"python -c pass": [], **{k: [] for k in present}}
        for _cmd, cmd_argv, ok in present.values() if not args.smoke else ():  # untimed warm-up
            _time([*launch, *cmd_argv], ok)
        cached = bytecode_cached()
        for _ in range(repeats):
            for label, (_, cmd_argv, ok) in present.items():
                times["python -c pass"].append(_time(bare, (0,)))
                times[label].append(_time([*launch, *cmd_argv], ok))
        # tests/test_imports.py asserts the imports; the smoke run leaves the probes to it.
        parse = parse_cost(table["reduce bitwise"][1], repeats)
        imports = {} if args.smoke else {label: probe(cmd_argv, work) for label, (_, cmd_argv, _) in present.items()}
    st = {label: common.stats(v) for label, v in times.items()}
    base = st["python -c pass"]["median"]
    per_command = {label: {"median_s": s["median"], "delta_s": s["median"] - base,
                           "ratio": common.ratio(s["median"], base), "stats": s,
                           "heavy_imports": imports.get(label, {}).get("heavy"),
                           "torch_imported": imports.get(label, {}).get("torch"),
                           "probe_exit_code": imports.get(label, {}).get("rc")}
                   for label, s in st.items() if label != "python -c pass"}
    helpd = per_command["--help"]
    heavy = sorted(label for label, d in per_command.items() if d["heavy_imports"])
    worst = max(per_command, key=lambda k: per_command[k]["delta_s"])
    notes = [f"not in this tree's CLI, not timed: {', '.join(missing)}"] if missing else []
    if not cached and not args.smoke:  # the smoke run has no untimed first start to write the cache
        notes.append("no bytecode cache beside the package (not writable?): every start compiled its modules")
    if heavy:
        notes.append(f"imported transformers or peft: {', '.join(heavy)}")
    common.report(
        NAME, smoke=args.smoke, results=args.results, ratio_value=helpd["ratio"],
        ratio_definition="median `replayjob --help` seconds / median `python -c pass` seconds",
        baseline="`python -c pass` with the same interpreter, alternating with every command",
        target=common.Target("<=", TARGET_DELTA_S, helpd["delta_s"], metric="--help minus bare (s)"),
        also=[common.Target("<=", TARGET_DELTA_S, per_command[k]["delta_s"], metric=f"{k} minus bare (s)")
              for k in REDUCE if k in per_command],
        detail=(f"--help {helpd['median_s']:.3f} s vs bare {base:.3f} s; reduce's usage parse "
                f"{parse['own_usage_s'] * 1e3:.1f} ms (whole text {parse['whole_usage_s'] * 1e3:.1f} ms); "
                f"slowest {worst} "
                f"+{per_command[worst]['delta_s']:.3f} s; heavy imports in {len(heavy)} of {len(per_command)} "
                f"commands" + (f"; missing: {', '.join(missing)}" if missing else "")),
        measurements={"bare_s": st["python -c pass"], "commands": per_command, "missing_commands": missing,
                      "reduce_parse_s": parse},
        parameters={"repeats": repeats, "launcher": launch, "bytecode_cached": cached}, notes=notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
