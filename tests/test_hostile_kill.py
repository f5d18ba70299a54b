"""Crash safety: SIGKILL writers at deterministic write boundaries, then verify what remains and rerun.

One driver process (this file run as a script) imports replayjob once, runs each writer once with
``REPLAYJOB_FAULT_TRACE`` to list the boundaries it passes (``replayjob/crashpoints.py``), then for each
chosen boundary N forks a child that runs the same command with ``REPLAYJOB_FAULT_POINT=*:N`` and so
SIGKILLs itself there.  After each kill the driver checks that what remains is absent, complete and
verifiable, or incomplete and refused by its reader; then reruns the command on the same directory:
it must succeed, or refuse with a message naming exactly what to remove -- which the driver removes
before a last rerun that must succeed.  Forking from one warm process keeps each point well under a
second; the driver runs single-threaded (OMP_NUM_THREADS=1), which is what makes fork safe with Torch.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

MIN_POINTS = 20
MAX_POINTS = 24
REMOVAL_EVERY = 6  # perform the named removal and a full rerun at every 6th point (and the last)


# ------------------------------------------------------------------------------------ verification
def verify_train(out: Path) -> str:
    """'complete' (metrics.json, final adapter and checkpoints all verify) or 'incomplete'."""
    from replayjob.digest import sha256_file
    from replayjob.jsonio import read_json_object
    from replayjob.rl.state import STATE_FILE, read_state

    for ck in sorted((out / "checkpoints").glob("step_*")) if (out / "checkpoints").is_dir() else []:
        if (ck / STATE_FILE).exists():
            read_state(ck)  # a checkpoint that declares itself complete must verify
    if not (out / "metrics.json").exists():
        return "incomplete" if out.exists() else "absent"
    metrics = read_json_object(out / "metrics.json")
    final = out / metrics["final_adapter_path"]
    assert sha256_file(final) == metrics["final_adapter_sha256"], "final adapter does not match metrics.json"
    rows = (out / "diag.jsonl").read_bytes().splitlines()
    assert len(rows) == metrics["steps_run"], "diag.jsonl rows do not match metrics.json"
    for line in rows:
        json.loads(line)
    return "complete"


def verify_capture(out: Path) -> str:
    """A manifest in place must verify with its payload; 'complete' also needs metrics.json to pin it."""
    from replayjob.artifacts import capture_manifest as manifest
    from replayjob.artifacts import capture_payload as payload
    from replayjob.digest import sha256_file
    from replayjob.jsonio import read_json_object

    found = sorted(out.glob("*.manifest.json")) if out.is_dir() else []
    for m in found:
        man = manifest.read_verified(m, sha256_file(m))
        data = man.payload_path.read_bytes()
        assert len(data) == man.payload_size and payload.digest_bytes(data) == man.payload_digest, \
            "payload != manifest"
        payload.decode(data, man.payload_path)
    state = verify_train(out)
    if state == "complete":
        metrics = read_json_object(out / "metrics.json")
        assert found and metrics["optimizer_batch/manifest_sha256"] == sha256_file(found[0])
    return state


def verify_bundled(out: Path) -> str:
    """Every bundle in place loads completely; staging directories ('.name.tmp-*') are never in place."""
    from replayjob.bundle.reader import load_bundle

    bdir = out / "bundles"
    listing = sorted(bdir.iterdir()) if bdir.is_dir() else []
    staging = [d for d in listing if d.name.startswith(".")]  # an interrupted writer's, never in place
    for d in listing:
        if d not in staging:
            load_bundle(d)
    state = verify_train(out)
    if state == "complete":  # metrics.json comes after the bundle writer has drained
        assert not staging and [d.name for d in listing] == ["update-000000-000000", "update-000001-000000"], \
            [d.name for d in listing]
    return state


def verify_reduce(out: Path) -> str:
    """verdict.json is the completion marker: when present it is whole and says pass."""
    from replayjob.jsonio import read_json_object

    if not (out / "verdict.json").exists():
        return "incomplete" if out.exists() and any(out.iterdir()) else "absent"
    doc = read_json_object(out / "verdict.json")
    assert doc["claim"] == "bitwise" and doc["status"] == "pass", doc.get("summary")
    return "complete"


VERIFIERS: dict[str, Callable[[Path], str]] = {"train": verify_train, "capture": verify_capture,
                                               "bundle": verify_bundled, "reduce": verify_reduce}


# ------------------------------------------------------------------------------------------ driver
def _spawn(argv: list[str], log: Path, spec: str | None = None, trace: Path | None = None,
           env: dict[str, str] | None = None) -> int:
    """Fork a child that runs ``main(argv)`` with its output in ``log``; return its pid."""
    from replayjob import crashpoints as faults
    from replayjob.cli import main

    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # child
        rc = 99
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.update(env or {})
            faults.configure(spec, str(trace) if trace else None)
            rc = main(argv)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    return pid


def _wait(pid: int) -> tuple[str, int]:
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return "killed", os.WTERMSIG(status)
    return "exit", os.WEXITSTATUS(status)


def _fork_run(argv: list[str], log: Path, spec: str | None = None, trace: Path | None = None,
              env: dict[str, str] | None = None) -> tuple[str, int]:
    """Run ``main(argv)`` in a forked child; return ('killed', signal) or ('exit', status)."""
    return _wait(_spawn(argv, log, spec, trace, env))


def _race(argv: list[str], root: Path, k: int, env: dict[str, str]) -> list[dict[str, Any]]:
    """Start ``k`` children on one destination at once; return each one's status and first message line."""
    pids = [_spawn(argv, root / f"race-{i}.log", env=env) for i in range(k)]
    out = []
    for i, pid in enumerate(pids):
        kind, code = _wait(pid)
        lines = (root / f"race-{i}.log").read_text().strip().splitlines()
        out.append({"status": code if kind == "exit" else f"killed {code}",
                    "message": next((ln for ln in lines if ln.startswith("replayjob")), "")})
    return out


def _choose(k: int) -> list[int]:
    n = min(k, MAX_POINTS)
    if n <= 1:
        return list(range(1, k + 1))
    return sorted({round(1 + i * (k - 1) / (n - 1)) for i in range(n)})


def _rerun(name: str, argv: list[str], out: Path, log: Path, remove: bool, env: dict[str, str]) -> dict[str, Any]:
    kind, code = _fork_run(argv, log, env=env)
    text = log.read_text()
    res: dict[str, Any] = {"rerun": code if kind == "exit" else f"killed {code}"}
    if kind == "exit" and code == 0:
        res["after_rerun"] = VERIFIERS[name](out)
        return res
    if kind == "exit" and code == 2:
        m = re.search(r"remove (\S+?) and rerun", text)
        res["remove"] = m.group(1) if m else None
        res["message"] = text.strip().splitlines()[0] if text.strip() else ""
        if m and remove:
            target = Path(m.group(1))
            assert target.resolve().is_relative_to(out.parent.resolve()), f"asked to remove {target}"
            shutil.rmtree(target) if target.is_dir() else target.unlink()
            kind2, code2 = _fork_run(argv, log, env=env)
            res["rerun_after_removal"] = code2 if kind2 == "exit" else f"killed {code2}"
            if kind2 == "exit" and code2 == 0:
                res["after_rerun"] = VERIFIERS[name](out)
        return res
    res["message"] = text[-2000:]
    return res


def drive(plan: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for sc in plan["scenarios"]:
        name, root = sc["name"], Path(sc["root"])
        root.mkdir(parents=True, exist_ok=True)

        def argv(out: Path, sc: dict[str, Any] = sc) -> list[str]:
            return [a.replace("{out}", str(out)) for a in sc["argv"]]

        def env(out: Path, sc: dict[str, Any] = sc) -> dict[str, str]:
            return {k: v.replace("{out}", str(out)) for k, v in sc.get("env", {}).items()}

        from replayjob.cli import main

        t0 = time.perf_counter()
        saved = dict(os.environ)
        os.environ.update(env(root / "warm"))
        try:  # in this process, so that every lazy import is done once, before the first fork
            assert main(argv(root / "warm")) == 0, f"{name}: the unfaulted command fails"
        finally:
            os.environ.clear()
            os.environ.update(saved)
        t_warm = time.perf_counter() - t0
        trace = root / "trace.txt"
        kind, code = _fork_run(argv(root / "trace"), root / "trace.log", trace=trace, env=env(root / "trace"))
        assert (kind, code) == ("exit", 0), (name, kind, code, (root / "trace.log").read_text()[-2000:])
        # The boundaries counted: all of them, or (``focus``) only those of a background writer, whose
        # order is deterministic although it interleaves with the main thread's.
        focus = sc.get("focus", ["*"])
        names = [nm for nm in trace.read_text().splitlines() if any(fnmatch.fnmatchcase(nm, g) for g in focus)]
        points = []
        for i, n in enumerate(chosen := _choose(len(names))):
            out = root / f"kill-{n:03d}"
            ktrace = root / f"kill-{n:03d}.trace"
            kind, code = _fork_run(argv(out), root / f"kill-{n:03d}.log", spec=f"{'|'.join(focus)}:{n}",
                                   trace=ktrace, env=env(out))
            passed = [nm for nm in (ktrace.read_text().splitlines() if ktrace.exists() else [])
                      if any(fnmatch.fnmatchcase(nm, g) for g in focus)]
            entry: dict[str, Any] = {"n": n, "point": names[n - 1], "outcome": f"{kind} {code}",
                                     "same_path": passed == names[:n]}  # deterministic: same boundaries
            try:
                entry["after_kill"] = VERIFIERS[name](out)
                entry.update(_rerun(name, argv(out), out, root / f"rerun-{n:03d}.log",
                                    remove=i % REMOVAL_EVERY == 0 or i == len(chosen) - 1, env=env(out)))
            except BaseException as exc:  # recorded, asserted on by the test
                entry["error"] = f"{type(exc).__name__}: {exc}"
            points.append(entry)
        race = _race(argv(root / "race"), root, sc["race"], env(root / "race")) if sc.get("race") else []
        race_verified = VERIFIERS[name](root / "race") if race else None
        results[name] = {"boundaries": len(names), "points": points, "warm_s": t_warm, "race": race,
                         "race_verified": race_verified, "total_s": time.perf_counter() - t0}
    return results


# ------------------------------------------------------------------------------------------- tests
def run_driver(plan: dict[str, Any], tmp: Path, timeout: float = 600) -> dict[str, Any]:
    (tmp / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("REPLAYJOB_FAULT_POINT", None)
    env.pop("REPLAYJOB_FAULT_TRACE", None)
    proc = subprocess.run([sys.executable, __file__, str(tmp / "plan.json"), str(tmp / "result.json")],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out: dict[str, Any] = json.loads((tmp / "result.json").read_text())
    return out


def check_points(result: dict[str, Any]) -> None:
    points = result["points"]
    assert len(points) >= MIN_POINTS, f"only {len(points)} boundaries"
    assert len({p["point"] + str(p["n"]) for p in points}) == len(points)
    removed = 0
    for p in points:
        assert "error" not in p, p
        assert p["outcome"] == f"killed {int(signal.SIGKILL)}", p
        assert p["same_path"], p  # the killed run passed exactly the traced boundaries, in order
        assert p["after_kill"] in ("absent", "incomplete", "complete"), p
        if p["rerun"] == 0:
            assert p["after_rerun"] == "complete", p
        elif p["after_kill"] == "complete":  # the kill came after the completion marker
            assert p["rerun"] == 2 and "already" in p["message"], p  # never overwritten
        else:
            assert p["rerun"] == 2 and p["remove"], p  # refused, naming exactly what to remove
            if "rerun_after_removal" in p:
                assert p["rerun_after_removal"] == 0 and p["after_rerun"] == "complete", p
                removed += 1
    assert removed >= 2 or all(p["rerun"] == 0 for p in points)


def test_fault_points_cost_nothing_and_reject_a_bad_spec(tmp_path: Path) -> None:
    from replayjob import crashpoints as faults
    from replayjob.errors import UsageError
    from replayjob.fsio import atomic_write_bytes

    faults.configure()
    atomic_write_bytes(tmp_path / "a", b"x")  # unarmed: no trace, no kill
    faults.configure(trace=str(tmp_path / "trace"))
    try:
        atomic_write_bytes(tmp_path / "b", b"xy", exclusive=True)
    finally:
        faults.configure()
    assert (tmp_path / "trace").read_text().split() == [
        "write.open/b", "write.temp/b", "write.half/b", "write.synced/b", "write.linked/b", "write.renamed/b"]
    faults.configure("no-count")
    try:
        with pytest.raises(UsageError, match="PATTERN:N"):
            atomic_write_bytes(tmp_path / "c", b"x")
    finally:
        faults.configure()


def check_race(result: dict[str, Any], loser_says: tuple[str, ...]) -> None:
    """Exactly one concurrent writer wins; every other is refused (exit 2) with a reason."""
    statuses = [r["status"] for r in result["race"]]
    assert statuses.count(0) == 1 and statuses.count(2) == len(statuses) - 1, result["race"]
    for r in result["race"]:
        if r["status"] == 2:
            assert any(s in r["message"] for s in loser_says), r
    assert result["race_verified"] == "complete"


def _racer(dest: str, data: bytes, barrier: Any, results: Any) -> None:
    from replayjob.errors import ArtifactExistsError
    from replayjob.fsio import atomic_write_bytes

    barrier.wait()
    try:
        atomic_write_bytes(dest, data, exclusive=True)
        results.put(("won", data))
    except ArtifactExistsError as exc:
        results.put(("refused", exc.message.encode()))


def test_concurrent_exclusive_writers_exactly_one_wins(tmp_path: Path) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("fork")  # the racers only touch the filesystem
    for round_ in range(4):
        dest = tmp_path / f"artifact-{round_}.json"
        barrier, results = ctx.Barrier(6), ctx.Queue()
        procs = [ctx.Process(target=_racer, args=(str(dest), f"writer {i}".encode() * 1000, barrier, results))
                 for i in range(6)]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
        winners = [data for kind, data in outcomes if kind == "won"]
        assert len(winners) == 1, outcomes
        assert dest.read_bytes() == winners[0]
        assert sorted(os.listdir(tmp_path)) == sorted(f"artifact-{r}.json" for r in range(round_ + 1))


def _bundle_racer(dest: str, barrier: Any, results: Any) -> None:
    from replayjob.bundle import BundleWriter, default_config
    from replayjob.errors import ArtifactExistsError

    w = BundleWriter(dest, kind="rollout", rollout_id=7, config=default_config(samples_per_prompt=2))
    for i, text in enumerate(["2", "3"]):
        w.add_sample(f"s-{i}", group="g-0", prompt_length=6, response_length=2, prompt="Q:1+1=",
                     completion=text, label="2")
    w.set_expected("reward.raw", "raw", [1.0, 0.0])
    w.set_expected("reward.post_process", "scores", [0.7071057811879616, -0.7071057811879616])
    for stage in ("reward.raw", "advantage.kl", "advantage.estimate"):
        w.set_capability(stage, "inspect-only", "not captured in this example")
    barrier.wait()
    try:
        w.finalize()
        results.put("won")
    except ArtifactExistsError as exc:
        results.put(f"refused: {exc.message}")


def test_concurrent_bundle_writers_exactly_one_wins(tmp_path: Path) -> None:
    import multiprocessing

    from replayjob.bundle.reader import load_bundle

    ctx = multiprocessing.get_context("fork")
    for round_ in range(3):
        dest = tmp_path / f"b{round_}"
        barrier, results = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_bundle_racer, args=(str(dest), barrier, results)) for _ in range(4)]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        assert outcomes.count("won") == 1, outcomes
        assert all(o.startswith("refused") for o in outcomes if o != "won")
        load_bundle(dest)  # the winner's bundle is complete
        assert sorted(x.name for x in tmp_path.iterdir()) == [f"b{r}" for r in range(round_ + 1)]  # no leftovers


# Capture writes its payload and manifest on a writer thread while the training thread saves the final
# adapter: these are the boundaries whose order is fixed (before the thread, on it, after it is joined).
CAPTURE_POINTS = ["capture.start", "capture.before-payload", "write.*/optimizer_batch_step_*",
                  "capture.payload-written", "capture.manifest-written", "capture.metrics", "write.*/metrics.json"]
BUNDLE_FILES = ["bundle.*", *(f"write.*/{f}" for f in ("COMPLETE", "manifest.json", "payloads.safetensors"))]


@pytest.mark.slow
def test_kill_every_writer_at_20_or_more_boundaries(workspace: Path, tmp_path: Path,
                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """One driver process: train (checkpoints), capture, bundle writing and reduce, plus races."""
    from conftest import load_corpus_module

    corpus = load_corpus_module()

    src = corpus.build_sources(workspace, tmp_path_factory.getbasetemp() / "hostile-sources")
    ws = str(workspace)
    small = ["--set", "algorithm.prompts_per_step=2", "--set", "algorithm.group_size=2",
             "--set", "inference.max_new_tokens=4"]
    plan = {"scenarios": [
        {"name": "train", "root": str(tmp_path / "train"), "race": 3,
         "argv": ["train", f"{ws}/train.toml", "--out", "{out}", "--set", "training.max_steps=1",
                  "--set", "training.save_every=1", *small]},
        {"name": "capture", "root": str(tmp_path / "capture"), "race": 3, "focus": CAPTURE_POINTS,
         "argv": ["capture", f"{ws}/source.toml", "--out", "{out}"]},
        {"name": "bundle", "root": str(tmp_path / "bundle"), "race": 2, "focus": BUNDLE_FILES,
         "argv": ["train", f"{ws}/train.toml", "--out", "{out}", "--set", "training.max_steps=2"],  # two bundles
         "env": {"REPLAYJOB_BUNDLE_CAPTURE": "1", "REPLAYJOB_BUNDLE_DIR": "{out}/bundles"}},
        {"name": "reduce", "root": str(tmp_path / "reduce"),
         "argv": ["reduce", str(src["replays"]), "--claim", "bitwise", "--source", str(src["source"]),
                  "--out", "{out}/verdict.json"]},  # no --report: the PNG would cost a second a run
    ]}
    results = run_driver(plan, tmp_path)
    for name in ("train", "capture", "bundle", "reduce"):
        check_points(results[name])
    assert "incomplete" in {p["after_kill"] for p in results["train"]["points"]}
    check_race(results["train"], ("already holds a run", "another run created"))
    check_race(results["capture"], ("already", "another run", "exists"))
    check_race(results["bundle"], ("already", "another run", "exists"))
    assert any(p["after_kill"] == "complete" for p in results["reduce"]["points"])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    plan_file, result_file = Path(sys.argv[1]), Path(sys.argv[2])
    Path(result_file).write_text(json.dumps(drive(json.loads(plan_file.read_text())), indent=1))
