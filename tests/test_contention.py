"""The contention guard (replayjob/runtime/contention_probe.py) and what reduce makes of its record.

The thresholds are checked on stated figures (those measured on the 2-core development machine: a
busy loop alone, and the same loop sharing its core with a CPU hog); one test plants a real CPU hog
on the probed process's core.  The reducer's side runs on synthetic paired evidence
(replayjob.gate.synthetic) with a ``contention`` record written into each replay's metrics, as the
replay drivers write it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from replayjob.artifacts.metrics import CONTENTION, read_replay
from replayjob.cli import main
from replayjob.errors import IntegrityError
from replayjob.gate import synthetic
from replayjob.jsonio import pretty_bytes
from replayjob.runtime import contention_probe as contention
from replayjob.runtime.contention_probe import Probe, decide

BASE, SLOW = "mb-default", "mb-1"
MB = "training.micro_batch_size"
# Measured around a 1.5 s busy loop on the 2-core machine, load average 0.3-0.5.
QUIET = {"device": "cpu", "cpus": 2, "online_cpus": 2, "cpu_per_wall": 0.991, "involuntary_switches_per_s": 30.0,
         "run_queue_wait_share": 0.006, "steal_share": 0.027, "loadavg_before": [0.35, 0.31, 0.15],
         "loadavg_after": [0.48, 0.34, 0.16], "cuda": None}
HOGGED = {**QUIET, "cpus": 1, "cpu_per_wall": 0.499, "involuntary_switches_per_s": 125.0,
          "run_queue_wait_share": 0.501, "steal_share": 0.0}


def busy(seconds: float) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


def test_thresholds_pass_a_quiet_window_and_trip_a_shared_core() -> None:
    assert decide(QUIET) == []
    assert decide({**QUIET, "cpus": 1, "involuntary_switches_per_s": 4.0, "run_queue_wait_share": 0.002}) == []
    reasons = decide(HOGGED)
    assert [r.split(" ")[0] for r in reasons] == ["run-queue", "the"], reasons
    assert [r.split(" ")[0] for r in decide({**HOGGED, "run_queue_wait_share": None})] == ["125", "the"]


@pytest.mark.parametrize("change, needle", [
    ({"run_queue_wait_share": contention.RUN_QUEUE_WAIT_SHARE_MAX + 0.01}, "run-queue wait"),
    ({"involuntary_switches_per_s": contention.INVOLUNTARY_SWITCHES_PER_S_MAX * 2 + 1, "run_queue_wait_share": None},
     "involuntary"),
    ({"steal_share": contention.STEAL_SHARE_MAX + 0.01}, "steal time"),
    ({"loadavg_after": [2.5, 1.0, 0.5], "run_queue_wait_share": None}, "load average 2.50 above 1 x 2"),
    ({"cpu_per_wall": contention.CPU_PER_WALL_MIN - 0.01}, "CPU s per wall s"),
    ({"device": "cuda:0", "cuda": {"other_processes": 1}}, "1 other compute process"),
])
def test_each_threshold_names_its_reason(change: dict[str, Any], needle: str) -> None:
    (reason,) = decide({**QUIET, **change})
    assert needle in reason


def test_load_and_switches_decide_only_without_the_run_queue_wait() -> None:
    """The machine-wide average lags a minute, and a process with more threads than CPUs preempts itself
    (measured: 165 involuntary switches/s with a run-queue wait share of 0.004): where this process's own
    wait is read, it decides."""
    assert decide({**QUIET, "loadavg_before": [3.9, 2.0, 1.0], "involuntary_switches_per_s": 165.0,
                   "run_queue_wait_share": 0.004, "cpu_per_wall": 1.98}) == []


def test_unreadable_figures_decide_nothing_and_cuda_ignores_cpu_share() -> None:
    blank = {k: None for k in QUIET if k not in ("device", "cpus", "online_cpus")}
    assert decide({**QUIET, **blank}) == []
    assert decide({**QUIET, "device": "cuda", "cpu_per_wall": 0.05,
                   "cuda": {"other_processes": None}}) == []  # a GPU replay waits on its device


def test_probe_record_is_json_and_consistent() -> None:
    with Probe("cpu") as probe:
        busy(0.3)
    rec = probe.record()
    assert json.loads(json.dumps(rec)) == rec
    assert rec["schema"] == contention.SCHEMA and rec["thresholds"] == contention.THRESHOLDS
    assert rec["wall_s"] >= 0.3 and rec["cpu_s"] > 0.0 and rec["cpus"] == contention.allowed_cpus()
    assert rec["cuda"] is None and "cuda_processes" in rec["unavailable"]
    assert rec["contended"] == bool(rec["reasons"]) and rec["reasons"] == decide(rec)
    with pytest.raises(RuntimeError):
        Probe("cpu").record()


@pytest.mark.alone
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_a_cpu_hog_on_the_same_core_trips_the_probe() -> None:
    """A busy subprocess pinned to this process's one core while the probed loop runs: contended."""
    saved = os.sched_getaffinity(0)
    core = {min(saved)}
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(hog.pid, core)
        os.sched_setaffinity(0, core)
        time.sleep(0.2)
        with Probe("cpu") as probe:
            busy(1.0)
        rec = probe.record()
    finally:
        os.sched_setaffinity(0, saved)
        hog.kill()
        hog.wait()
    assert rec["contended"] and rec["cpus"] == 1, rec
    assert rec["cpu_per_wall"] < 0.75
    if rec["run_queue_wait_share"] is not None:
        assert rec["run_queue_wait_share"] > 0.3
        assert any("run-queue wait" in r for r in rec["reasons"])


def record(contended: bool) -> dict[str, Any]:
    """A complete, consistent record of a one-second window (every summary agreeing with its figures)."""
    figures = HOGGED if contended else QUIET
    rec = {**figures, "schema": contention.SCHEMA, "wall_s": 1.0, "cpu_s": figures["cpu_per_wall"],
           "involuntary_switches": int(figures["involuntary_switches_per_s"]), "voluntary_switches": 3,
           "run_queue_wait_s": 0.01, "unavailable": {"cuda_processes": "not a CUDA device"},
           "thresholds": dict(contention.THRESHOLDS)}
    reasons = decide(rec)
    return {**rec, "contended": bool(reasons), "reasons": reasons}


def paired(tmp_path: Path, walls: dict[str, list[float]], contended: set[tuple[str, int]], *,
           budgets: Path | None = None, recorded: bool = True) -> synthetic.Evidence:
    """Synthetic ABBA evidence with ``walls[arm][block]`` as step times and a contention record per replay
    (contended for the (arm, block) in ``contended``)."""
    def edit(doc: dict[str, Any], arm: str, block: int) -> None:
        if recorded:
            doc[CONTENTION] = record((arm, block) in contended)

    return synthetic.paired(tmp_path / "ev", {BASE: {}, SLOW: {MB: 1}}, walls, budgets=budgets, edit=edit)


def reduce(ev: synthetic.Evidence, *extra: str) -> tuple[int, dict[str, Any]]:
    out = ev.root.parent / "verdict.json"
    code = main(["reduce", str(ev.root / "replays"), "--claim", "exact-input", "--source", str(ev.source),
                 "--out", str(out), "--baseline", BASE, *extra])
    doc = json.loads(out.read_text())
    assert doc["exit_code"] == code
    return code, doc


SLOWDOWN = {BASE: [1.0, 1.1, 0.9], SLOW: [3.0, 3.4, 2.6]}


def test_a_contended_replay_makes_a_time_budget_contended_exit_3(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    b = tmp_path / "budgets.toml"
    b.write_text(f'[{SLOW}]\nlocal_train_wall_s = {{ max_ratio = 10 }}\npeak_memory_bytes = {{ max_ratio = 2 }}\n')
    code, doc = reduce(paired(tmp_path, SLOWDOWN, {(SLOW, 1)}, budgets=b), "--budgets", str(b),
                       "--report", str(tmp_path / "report.md"))
    assert code == 3 and doc["status"] == "contended" and doc["failed_checks"] == ["timing.uncontended"]
    assert doc["admission"] == "not admitted (contended)"
    (c,) = doc["contention"]["contended"]
    assert (c["arm"], c["repeat_index"], c["block"]) == (SLOW, 1, 1) and c["reasons"]
    assert c["path"].endswith("replay_metrics.json") and doc["contention"]["recorded"] == 6
    rows = {r["metric"]: r for r in doc["budgets"]["bounds"]}
    assert rows["local_train_wall_s"]["decision"] == "not_evaluated"
    assert f"{SLOW}#1" in rows["local_train_wall_s"]["note"]
    assert rows["peak_memory_bytes"]["decision"] == "not_measurable"  # CPU: memory is never decided
    ratio = doc["comparisons"]["ratios"][SLOW]["local_train_wall_s"]
    assert ratio["ratio"] is not None and ratio["low"] is None and ratio["excludes_1"] is None
    assert doc["comparisons"]["paired"]["arms"][SLOW]["decision"] == "not_evaluated"
    err = capsys.readouterr()
    assert f"timing not admitted (contended): {SLOW} repeat 1 (block 1)" in err.out
    assert "Traceback" not in err.err and "timing.uncontended" in err.err
    assert "not admitted (contended)" in (tmp_path / "report.md").read_text()


def test_without_budgets_the_numbers_pass_but_timing_is_not_admitted(tmp_path: Path) -> None:
    code, doc = reduce(paired(tmp_path, SLOWDOWN, {(BASE, 0), (SLOW, 2)}))
    assert code == 0 and doc["status"] == "pass"
    assert doc["admission"] == "not admitted (contended)"
    assert "timing not admitted (contended)" in doc["summary"]
    (check,) = [c for c in doc["checks"] if c["name"] == "timing.uncontended"]
    assert check["status"] == "not_applicable" and check["offenders"] == sorted([f"{BASE}#0", f"{SLOW}#2"])
    for metric in ("local_train_wall_s", "forward_wall_s", "backward_wall_s", "optimizer_wall_s"):
        assert doc["comparisons"]["ratios"][SLOW][metric]["excludes_1"] is None
    assert doc["comparisons"]["ratios"][SLOW]["padding_fraction"]["note"] == ""  # not timing


def test_uncontended_records_admit_and_unrecorded_ones_are_listed(tmp_path: Path) -> None:
    code, doc = reduce(paired(tmp_path / "a", SLOWDOWN, set()))
    assert code == 0 and doc["admission"] == "admitted" and doc["contention"]["contended"] == []
    (check,) = [c for c in doc["checks"] if c["name"] == "timing.uncontended"]
    assert check["status"] == "pass"
    paired_row = doc["comparisons"]["paired"]["arms"][SLOW]
    assert paired_row["decision"] == "decided" and paired_row["low"] > 1.0
    code, doc = reduce(paired(tmp_path / "b", SLOWDOWN, set(), recorded=False))
    assert "contention" not in doc and not any(c["name"] == "timing.uncontended" for c in doc["checks"])


def test_paired_comparison_undecided_when_the_interval_includes_1(tmp_path: Path) -> None:
    code, doc = reduce(paired(tmp_path, {BASE: [1.0, 1.2, 0.9], SLOW: [1.1, 1.0, 1.0]}, set()), "--max-looks", "8")
    row = doc["comparisons"]["paired"]["arms"][SLOW]
    assert code == 0 and row["decision"] == "undecided" and row["low"] < 1.0 < row["high"]
    assert doc["comparisons"]["paired"]["look_confidence"] == pytest.approx(1 - 0.05 / 8)


def test_the_reader_refuses_a_malformed_contention_record(tmp_path: Path) -> None:
    ev = paired(tmp_path, SLOWDOWN, set())
    f = ev.replay_files[0]
    assert read_replay(f).contention is not None
    doc = json.loads(f.read_text())
    for bad in ({"contended": "yes", "reasons": []}, {"contended": True, "reasons": []}, [1]):
        doc[CONTENTION] = bad
        f.write_bytes(pretty_bytes(doc))
        with pytest.raises(IntegrityError, match="contention"):
            read_replay(f)
    quiet, hogged = record(False), record(True)
    forged = {  # each: what the record claims -> the rule that refuses it
        "uncontended, figures over a threshold": ({**hogged, "contended": False, "reasons": []}, "reasons"),
        "a flag with no figure behind it": ({**quiet, "contended": True, "reasons": ["busy"]}, "reasons"),
        "reasons that are not the figures'": ({**hogged, "reasons": hogged["reasons"][:1]}, "reasons"),
        "a rate that is not count / wall": ({**quiet, "involuntary_switches_per_s": 1.0}, "involuntary_switches_per_s"),
        "CPU per wall that is not cpu / wall": ({**hogged, "cpu_per_wall": 0.9}, "cpu_per_wall"),
        "a count as a float": ({**quiet, "involuntary_switches": 30.0}, "expected `int`, got `float`"),
        "a count as a bool": ({**quiet, "voluntary_switches": True}, "expected `int`, got `bool`"),
        "a share above 1": ({**quiet, "steal_share": 1.5}, "steal_share"),
        "a negative load": ({**quiet, "loadavg_before": [-1.0, 0.0, 0.0]}, "loadavg_before"),
        "an unknown schema": ({**quiet, "schema": "replayjob.contention/v9"}, "schema"),
        "an unknown field": ({**quiet, "note": "trust me"}, "unknown field `note`"),
        "a missing figure": ({k: v for k, v in quiet.items() if k != "run_queue_wait_share"}, "run_queue_wait_share"),
        "other thresholds": ({**quiet, "thresholds": {**quiet["thresholds"], "run_queue_wait_share_max": 0.9}},
                             "thresholds"),
        "CUDA figures on a CPU device": ({**quiet, "cuda": {"device": "cuda:0", "read_by": None, "note": "",
                                                            "processes_before": None, "processes_after": None,
                                                            "other_processes": None}}, "cuda"),
        "a null figure the record does not explain": ({**quiet, "steal_share": None}, "`steal_share` is null"),
        "an explained figure that is recorded": ({**quiet, "unavailable": {**quiet["unavailable"], "steal": "?"}},
                                                 "unavailable.steal"),
        "an unknown unavailable figure": ({**quiet, "unavailable": {**quiet["unavailable"], "gpu_clock": "?"}},
                                          "gpu_clock"),
        "a record of another device": ({**quiet, "device": "cuda:0", "unavailable": {"cuda_processes": "hidden"},
                                        "cuda": {"device": "cuda:0", "read_by": None, "note": "hidden",
                                                 "processes_before": None, "processes_after": None,
                                                 "other_processes": None}}, "contention.device"),
    }
    long_window = {**quiet, "wall_s": 1e6, "cpu_s": quiet["cpu_per_wall"] * 1e6,
                   "involuntary_switches": quiet["involuntary_switches"] * 10**6}
    long_window["involuntary_switches_per_s"] = long_window["involuntary_switches"] / 1e6
    forged["a window longer than the whole replay"] = (long_window, "longer than the whole replay")
    forged["more CPUs to run on than there are"] = ({**quiet, "cpus": 512, "online_cpus": 1}, "`online_cpus` 1")
    for what, (bad, rule) in forged.items():
        doc[CONTENTION] = bad
        f.write_bytes(pretty_bytes(doc))
        with pytest.raises(IntegrityError, match="contention") as info:
            read_replay(f)
        assert rule in info.value.message, (what, info.value.message)
    doc[CONTENTION] = hogged
    f.write_bytes(pretty_bytes(doc))
    assert read_replay(f).contention == hogged
    doc[CONTENTION] = None
    f.write_bytes(pretty_bytes(doc))
    assert read_replay(f).contention is None


@pytest.mark.slow
@pytest.mark.alone
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_a_cpu_hog_during_one_blocks_replays_is_not_admitted(tmp_path: Path) -> None:
    """End to end through the replay driver's own ``contention`` record: the funnel's stage 3 (steps run in
    this process, pinned to one core) with a busy subprocess pinned to that core while block 1's replays
    run, both times: block 1 is replayed once more, contended again, and the timing is not admitted (exit 3),
    naming block 1's replays.  Other work on the machine may flag more replays; block 1's must be among them."""
    import contextlib

    from replayjob.launch import funnel as funnel_module
    from replayjob.launch.funnel import FUNNEL_FILE, STATUS

    spec = Path(__file__).resolve().parents[1] / "examples" / "ablation-microbatch.toml"
    saved = os.sched_getaffinity(0)
    core = {min(saved)}
    hogged: list[int] = []

    def cli_step(args: Any, log: Path) -> int:
        hog = None
        if list(map(str, args[:2])) == ["step", "replay"] and int(str(args[list(args).index("--index") + 1])) in (2, 3):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            os.sched_setaffinity(hog.pid, core)
            hogged.append(hog.pid)
        try:
            with log.open("a", encoding="utf-8") as fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
                code = main([str(a) for a in args])
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
        return code if code in STATUS else 3

    import torch

    mp = pytest.MonkeyPatch()
    mp.setattr(funnel_module, "cli_step", cli_step)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 makes each fresh step process: two threads on one core spin
    os.sched_setaffinity(0, core)
    try:
        out = tmp_path / "hog"
        code = main(["funnel", "--out", str(out), "--device", "cpu", "--spec", str(spec), "--repeats", "2",
                     "--only-ablation", "--fixed-blocks", "--no-report"])
    finally:
        os.sched_setaffinity(0, saved)
        torch.set_num_threads(threads)
        mp.undo()
    doc = json.loads((out / FUNNEL_FILE).read_text())
    verdict = json.loads((out / "verdict.json").read_text())
    assert "contention" in verdict, "the replay driver writes no contention record (Probe not wired yet)"
    assert len(hogged) == 4  # block 1's two replays, and their one retry
    assert code == 3 and doc["status"] == "contended" and doc["stages"][2]["status"] == "contended"
    assert verdict["admission"] == "not admitted (contended)"
    flagged = {(c["arm"], c["block"]) for c in verdict["contention"]["contended"]}
    assert {("mb-default", 1), ("mb-1", 1)} <= flagged, verdict["contention"]
    assert {"contended-mb-1-1.0", "contended-mb-default-1.0"} <= {p.name for p in (out / "attempts").iterdir()}
    assert verdict["comparisons"]["ratios"]["mb-1"]["local_train_wall_s"]["excludes_1"] is None


def test_cuda_other_processes_are_read_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without NVML bindings, nvidia-smi's compute apps on the replay's device (by UUID): this process is
    told apart from the others; none visible at all (another PID namespace) is unreadable, said."""
    smi = tmp_path / "nvidia-smi"
    lines = tmp_path / "apps.csv"
    smi.write_text(f"#!/bin/sh\ncat {lines}\n")
    smi.chmod(0o755)
    monkeypatch.setattr(contention.shutil, "which", lambda name: str(smi) if name == "nvidia-smi" else None)
    monkeypatch.setattr(contention, "_cuda_uuid", lambda device: "GPU-aaaa")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML bindings
    lines.write_text(f"GPU-aaaa, {os.getpid()}, 1000\nGPU-aaaa, 999999, 500\nGPU-bbbb, 888888, 10\n")
    with Probe("cuda:0") as probe:
        pass
    rec = probe.record()
    assert rec["cuda"]["read_by"] == "nvidia-smi" and rec["cuda"]["other_processes"] == 1
    assert rec["cuda"]["processes_after"] == [{"pid": os.getpid(), "used_bytes": 1000 * 2**20},
                                              {"pid": 999999, "used_bytes": 500 * 2**20}]
    assert "1 other compute process(es) on the CUDA device (max 0)" in rec["reasons"]
    lines.write_text("")
    with Probe("cuda:0") as probe:
        pass
    rec = probe.record()
    assert rec["cuda"]["other_processes"] is None and "PID namespace" in rec["unavailable"]["cuda_processes"]
    assert not any("CUDA" in r for r in rec["reasons"])


def test_the_cuda_figures_count_of_other_processes_is_recomputed_from_its_process_lists() -> None:
    from replayjob.artifacts.contention import ContentionRecord
    from replayjob.declaration import decode
    procs = [{"pid": 10, "used_bytes": 2**20}, {"pid": 11, "used_bytes": None}]
    cuda = {"device": "cuda:0", "read_by": "nvml", "processes_before": procs[:1], "processes_after": procs,
            "other_processes": 1, "note": ""}
    rec = {**record(False), "device": "cuda:0", "cuda": cuda, "unavailable": {}}
    rec["reasons"] = decide(rec)
    rec["contended"] = bool(rec["reasons"])
    assert rec["contended"] and "other compute process" in rec["reasons"][-1]
    assert decode(rec, ContentionRecord, where="m.json").cuda is not None
    hidden = {**rec, "cuda": {**cuda, "other_processes": 0}, "contended": False,
              "reasons": [r for r in rec["reasons"] if "other compute" not in r]}
    with pytest.raises(IntegrityError, match="other_processes"):
        decode(hidden, ContentionRecord, where="m.json")
