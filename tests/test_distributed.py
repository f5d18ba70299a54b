"""Capture and replay over several ranks: real torchrun (``python -m torch.distributed.run``), gloo on CPU.

The chain of issue 20 end to end through the CLI: a 2-rank DDP capture, a 2-rank replay that
reproduces the source bitwise, a 1-rank replay of the same capture declaring
``distributed.world_size``, and ``reduce --claim exact-input`` over both arms (each replay's rank
files merged into it, never counted as repeats); then the refusals: a tampered rank payload, a
missing rank, an undeclared world-size change, a declared world size the launcher contradicts.

Every rank of a launch is a real torchrun process (the captures call torchrun directly); the
commands that run in one process (``explain``, ``reduce``, the 1-rank replays, a refusal before any
work) and ``replay --nproc 2``, which launches its ranks with torchrun from the calling process, are
called through ``replayjob.cli.main`` in the test process (``cli``): the boundary of that one
process is not what these checks are about.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from replayjob.artifacts.metrics import FINAL_ADAPTER, LOGICAL, MANIFEST, PIN_KEYS, rank_file
from replayjob.cli import main
from replayjob.errors import ConfigError, ContractError
from replayjob.rl.batch import OptimizerBatch
from replayjob.runtime import distributed

pytestmark = pytest.mark.alone  # ranks under torchrun rendezvous (gloo): run alone on the host

DDP = 'distributed.strategy="ddp"'
WORLD_1 = ["--set", "distributed.world_size=1",
           "--set", 'optimizer_batch.allow_config_differences=["distributed.world_size"]']


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node N -m replayjob ARGS`` (the launcher itself, not our wrapper)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "replayjob", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``replayjob ARGS`` in this process: (exit code, stdout, stderr)."""
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def pins(capture: Path) -> list[str]:
    m = json.loads((capture / "metrics.json").read_text())
    return ["--set", f'optimizer_batch.replay_path="{capture / "optimizer_batch_step_000000.manifest.json"}"',
            "--set", f'optimizer_batch.expected_logical_sha256="{m[LOGICAL]}"',
            "--set", f'optimizer_batch.expected_manifest_sha256="{m[MANIFEST]}"', "--set", DDP]


@pytest.fixture(scope="module")
def capture2(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist") / "source"
    proc = torchrun(2, "capture", str(workspace / "source.toml"), "--out", str(out), "--set", DDP)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def replays(workspace: Path, capture2: Path) -> Path:
    """Arm ``two`` (2 ranks, ``replay --nproc 2``), arm ``world_size=1`` (one process, a group of one) and arm
    ``bucket_cap_mb=1.0`` (2 ranks, 1 MiB DDP buckets)."""
    d = capture2.parent / "replays"
    assert main(["replay", str(workspace / "replay.toml"), "--out", str(d / "two"), "--nproc", "2",
                 *pins(capture2), "--set", 'optimizer_batch.arm="two"']) == 0
    assert main(["replay", str(workspace / "replay.toml"), "--out", str(d / "one"), *pins(capture2), *WORLD_1]) == 0
    assert main(["replay", str(workspace / "replay.toml"), "--out", str(d / "bucket"), "--nproc", "2",
                 *pins(capture2), "--set", "distributed.bucket_cap_mb=1",
                 "--set", 'optimizer_batch.allow_config_differences=["distributed.bucket_cap_mb"]']) == 0
    return d


@pytest.mark.slow  # a two-rank capture (torchrun): its own, or the module's shared one
def test_each_rank_lands_then_the_root_with_the_single_device_pins(capture2: Path, capture_dir: Path) -> None:
    names = {p.name for p in capture2.iterdir()}
    assert {"rank-0", "rank-1", "COMPLETE.0", "COMPLETE.1", "metrics.json",
            "optimizer_batch_step_000000.manifest.json"} <= names
    root = json.loads((capture2 / "optimizer_batch_step_000000.manifest.json").read_text())
    assert root["schema"] == "replayjob.capture_manifest/v3" and root["framework"] == "replayjob"
    assert root["distributed"] == {"world_size": 2, "strategy": "ddp", "bucket_cap_mb": 25.0, "backend": "gloo",
                                   "sharding": "contiguous"}
    assert [e["rows"] for e in root["ranks"]] == [[0, 8], [8, 16]]
    m2 = json.loads((capture2 / "metrics.json").read_text())
    m1 = json.loads((capture_dir / "metrics.json").read_text())
    assert set(PIN_KEYS) <= set(m2) and {k for k in m1 if k.startswith("optimizer")} == {
        k for k in m2 if k.startswith("optimizer")}
    assert m2["config"]["distributed"]["world_size"] == 2 and m1["config"]["distributed"]["world_size"] == 1
    # the logical batch does not depend on how the rows were split (the same source config on one process)
    assert m2[LOGICAL] == m1[LOGICAL]
    assert m2["optimizer/local_effective_rows_sha256"] == m1["optimizer/local_effective_rows_sha256"]
    rank1 = json.loads((capture2 / "rank-1" / "optimizer_batch_step_000000.manifest.json").read_text())
    assert rank1["rows"]["rows"] == 8 and rank1["logical_batch_sha256"] != m2[LOGICAL]  # its own rows


@pytest.mark.slow  # a two-rank capture (torchrun): its own, or the module's shared one
def test_explain_verifies_every_rank(workspace: Path, capture2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "explain", str(workspace / "replay.toml"), "--json", *pins(capture2), *WORLD_1)
    assert code == 0, err
    rep = json.loads(out)
    assert rep["rows"]["rows"] == 16 and rep[LOGICAL] == json.loads((capture2 / "metrics.json").read_text())[LOGICAL]
    assert rep["distributed"]["world_size"] == 2 and rep["world_size"] == 1
    assert [e["rows"] for e in rep["distributed"]["ranks"]] == [[0, 8], [8, 16]]


@pytest.mark.slow
def test_same_world_size_replay_is_bitwise_and_one_rank_passes_exact_input(
        capture2: Path, replays: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = json.loads((capture2 / "metrics.json").read_text())
    two = json.loads((replays / "two" / "replay_metrics.json").read_text())
    one = json.loads((replays / "one" / "replay_metrics.json").read_text())
    assert two[FINAL_ADAPTER] == src[FINAL_ADAPTER] and two["loss"] == src["loss"]  # bitwise, same world size
    assert two["runtime"]["distributed.world_size"] == 2 and two["runtime"]["distributed.strategy"] == "ddp"
    assert one["runtime"]["distributed.world_size"] == 1 and one["knobs"] == {"distributed.world_size": 1}
    assert [e["rows"] for e in two["distributed"]["ranks"]] == [[0, 8], [8, 16]]
    assert (replays / "two" / rank_file(1)).is_file() and "distributed" not in one
    bucket = json.loads((replays / "bucket" / "replay_metrics.json").read_text())
    assert bucket["runtime"]["distributed.bucket_cap_mb"] == 1.0 == bucket["knobs"]["distributed.bucket_cap_mb"]
    verdict = tmp_path / "bitwise.json"
    code, out, err = cli(capsys, "reduce", str(replays / "two"), "--claim", "bitwise", "--source", str(capture2),
                         "--min-repeats", "1", "--out", str(verdict))
    assert code == 0, out + err
    verdict = tmp_path / "exact.json"
    code, out, err = cli(capsys, "reduce", str(replays), "--claim", "exact-input", "--source", str(capture2),
                         "--min-repeats", "1", "--arms", "two,world_size=1,bucket_cap_mb=1.0", "--out", str(verdict))
    assert code == 0, out + err
    checks = {c["name"]: c for c in json.loads(verdict.read_text())["checks"]}
    # one replay per arm: a replay's rank files are merged into it, never counted as repeats
    assert checks["inputs.min_repeats"]["observed"] == {"two": 1, "world_size=1": 1, "bucket_cap_mb=1.0": 1}
    assert checks["exact.knobs_in_effect"]["status"] == "pass"


@pytest.mark.slow
def test_a_rank_file_changed_after_the_replay_is_refused(capture2: Path, replays: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "two"
    shutil.copytree(replays / "two", d)
    doc = json.loads((d / rank_file(1)).read_text())
    doc["loss"] += 1.0
    (d / rank_file(1)).write_text(json.dumps(doc))
    code, _, _ = cli(capsys, "reduce", str(d), "--claim", "exact-input", "--source", str(capture2),
                     "--min-repeats", "1", "--out", str(tmp_path / "v.json"))
    assert code == 2 and "rank file SHA-256" in json.loads((tmp_path / "v.json").read_text())[
        "refusal"]["message"]


@pytest.mark.slow  # a two-rank capture (torchrun): its own, or the module's shared one
@pytest.mark.parametrize("damage, message", [
    ("payload", "rank 1: "),
    ("landing", "incomplete capture over 2 ranks: COMPLETE.1 missing"),
    ("rank-dir", "incomplete capture over 2 ranks: rank-1 missing"),
    ("rank-link", "'rank-1' is a symbolic link"),  # a valid rank directory, moved out and linked back
])
def test_a_damaged_capture_over_ranks_is_refused(workspace: Path, capture2: Path, tmp_path: Path, damage: str,
                                                 message: str, capsys: pytest.CaptureFixture[str]) -> None:
    cap = tmp_path / "source"
    shutil.copytree(capture2, cap)
    if damage == "payload":
        p = cap / "rank-1" / "optimizer_batch_step_000000.safetensors"
        data = bytearray(p.read_bytes())
        data[-1] ^= 1
        p.write_bytes(bytes(data))
    elif damage == "landing":
        (cap / "COMPLETE.1").unlink()
    elif damage == "rank-link":
        shutil.move(cap / "rank-1", tmp_path / "elsewhere")
        (cap / "rank-1").symlink_to(tmp_path / "elsewhere")
    else:
        shutil.rmtree(cap / "rank-1")
    code, out, err = cli(capsys, "explain", str(workspace / "replay.toml"), *pins(cap), *WORLD_1)
    assert code == 2 and message in out + err, out + err


@pytest.mark.slow  # a two-rank capture (torchrun): its own, or the module's shared one
@pytest.mark.parametrize("edit, message", [
    (lambda d: d["ranks"][1].update(dir="../rank-1"), "manifest field"),  # a rank directory outside the capture
    (lambda d: d["distributed"].update(world_size=3), "manifest field"),  # ranks listed != world size
    (lambda d: d["ranks"].reverse(), "manifest field"),  # ranks out of order
    # well formed, but contradicting the ranks it lists
    (lambda d: d["initial_adapter"].update(sha256="0" * 64), "started from another adapter than the root records"),
    (lambda d: d["payload"].update(size=d["payload"]["size"] + 1), "is not the ranks' total"),
    # a summary of the ranks' rows that is not theirs (recomputed from the payloads)
    (lambda d: d["rows"].update(loss_weight_sum=d["rows"]["loss_weight_sum"] + 1.0), "rows.loss_weight_sum is"),
    (lambda d: d["rows"].update(tokens=d["rows"]["tokens"] - 1), "rows.tokens is"),
    # summaries of the root's own fields, recomputed by its declaration
    (lambda d: d["rows"].update(rows=d["rows"]["rows"] + 1), "`rows.rows` is"),
    (lambda d: d["payload"].update(spans_sha256="0" * 64), "`payload.spans_sha256` is '" + "0" * 64),
    # wrong types, an unknown key, an integer beyond 64 bits
    (lambda d: d["distributed"].update(world_size=False), "field `distributed.world_size`: expected `int`, got `bool`"),
    (lambda d: d["ranks"][0]["rows"].__setitem__(0, 0.0), "field `ranks[0].rows[0]`: expected `int`, got `float`"),
    (lambda d: d.update(trust_me=True), "unknown field `trust_me`"),
    (lambda d: d["payload"].update(size=2**64), "field `payload.size`: expected `int` <= 9223372036854775807"),
])
def test_a_malformed_or_contradicting_root_is_refused_even_when_pinned(workspace: Path, capture2: Path,
                                                                       tmp_path: Path, edit: Any, message: str,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    cap = tmp_path / "source"
    shutil.copytree(capture2, cap)
    root = cap / "optimizer_batch_step_000000.manifest.json"
    doc = json.loads(root.read_text())
    edit(doc)
    root.write_text(json.dumps(doc))
    sha = hashlib.sha256(root.read_bytes()).hexdigest()
    code, out, err = cli(capsys, "explain", str(workspace / "replay.toml"), *pins(cap), *WORLD_1,
                         "--set", f'optimizer_batch.expected_manifest_sha256="{sha}"')
    assert code == 2 and message in out + err, out + err


@pytest.mark.slow  # a two-rank capture (torchrun): its own, or the module's shared one
def test_an_undeclared_world_size_change_is_refused(workspace: Path, capture2: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "explain", str(workspace / "replay.toml"), *pins(capture2))
    assert code == 2
    assert "undeclared difference 'distributed.world_size' (systems-only knob): source 2, replay 1" in out


@pytest.mark.slow  # a two-rank capture (torchrun): its own, or the module's shared one
def test_a_declared_world_size_the_launcher_contradicts_is_refused(workspace: Path, capture2: Path,
                                                                   tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # one process, declared 2: refused before any work
    code, _, err = cli(capsys, "replay", str(workspace / "replay.toml"), "--out", str(tmp_path / "a"),
                       *pins(capture2), "--set", "distributed.world_size=2")
    assert code == 2 and "not launched by torchrun" in err
    assert not (tmp_path / "a").exists()
    # torchrun launches 2 ranks, the config declares 3: every rank refuses, the launch exits 2 (not torchrun's 1)
    code, tail = distributed.run_launched(2, ["replay", str(workspace / "replay.toml"), "--out", str(tmp_path / "b"),
                                              *pins(capture2), "--set", "distributed.world_size=3"])
    assert code == 2 and "torchrun launched 2 rank(s)" in tail
    assert not (tmp_path / "b" / "replay_metrics.json").exists()


@pytest.mark.slow  # a two-rank capture (torchrun): its own, or the module's shared one
def test_a_rank_killed_mid_capture_stops_the_launch_with_exit_3_and_no_root(workspace: Path, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # rank 1 alone writes COMPLETE.1: it is killed half way through its landing record; rank 0 waits at the
    # barrier until torchrun stops it (no hang), and nothing claims the capture is complete
    monkeypatch.setenv("REPLAYJOB_FAULT_POINT", "write.half/COMPLETE.1:1")
    out = tmp_path / "source"
    code, tail = distributed.run_launched(2, ["capture", str(workspace / "source.toml"), "--out", str(out),
                                              "--set", DDP], timeout=600)
    assert code == 3, tail
    assert not (out / "optimizer_batch_step_000000.manifest.json").exists() and not (out / "metrics.json").exists()
    assert not (out / "COMPLETE.1").exists()


# -- FSDP2 (fully_shard runs on CPU with gloo) ---------------------------------------------------------
@pytest.mark.slow
def test_an_fsdp2_capture_replays_bitwise_and_with_ddp_and_on_one_rank_under_exact_input(
        workspace: Path, capture2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cap = tmp_path / "source"
    proc = torchrun(2, "capture", str(workspace / "source.toml"), "--out", str(cap),
                    "--set", 'distributed.strategy="fsdp2"')
    assert proc.returncode == 0, proc.stderr[-3000:]
    root = json.loads((cap / "optimizer_batch_step_000000.manifest.json").read_text())
    assert root["distributed"]["strategy"] == "fsdp2"
    src = json.loads((cap / "metrics.json").read_text())
    assert src[LOGICAL] == json.loads((capture2 / "metrics.json").read_text())[LOGICAL]  # the same rows
    fsdp2 = [*pins(cap)[:-2], "--set", 'distributed.strategy="fsdp2"']  # pins() ends with the DDP strategy
    code, _, err = cli(capsys, "replay", str(workspace / "replay.toml"), "--out", str(tmp_path / "r" / "ddp"),
                       "--nproc", "2", *pins(cap),
                       "--set", 'optimizer_batch.allow_config_differences=["distributed.strategy"]')
    assert code == 0, err[-3000:]
    code, _, err = cli(capsys, "replay", str(workspace / "replay.toml"), "--out", str(tmp_path / "r" / "one"),
                       *fsdp2, *WORLD_1)
    assert code == 0, err[-3000:]
    code, _, err = cli(capsys, "replay", str(workspace / "replay.toml"), "--out", str(tmp_path / "r" / "same"),
                       "--nproc", "2", *fsdp2, "--set", 'optimizer_batch.arm="fsdp2"')
    assert code == 0, err[-3000:]
    rm = json.loads((tmp_path / "r" / "same" / "replay_metrics.json").read_text())
    assert rm[FINAL_ADAPTER] == src[FINAL_ADAPTER] and rm["loss"] == src["loss"]  # bitwise, same world size
    runtime = json.loads((tmp_path / "r" / "one" / "replay_metrics.json").read_text())["runtime"]
    assert runtime["distributed.strategy"] == "fsdp2" and runtime["distributed.bucket_cap_mb"] is None
    verdict = tmp_path / "v.json"
    code, out, err = cli(capsys, "reduce", str(tmp_path / "r"), "--claim", "exact-input", "--source", str(cap),
                         "--min-repeats", "1", "--arms", "fsdp2,strategy=ddp,world_size=1", "--out", str(verdict))
    assert code == 0, out + err


# -- the parts, without a launcher ------------------------------------------------------------------
def test_shards_concatenate_to_the_logical_batch() -> None:
    m = torch.ones((5, 3), dtype=torch.float64)
    m[2, 2] = 0.0
    fields = {k: torch.rand(5, 3, dtype=torch.float64)
              for k in ("old_logprobs", "ref_logprobs", "advantages", "loss_weights")}
    b = OptimizerBatch.from_padded([[1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3], [4, 5, 6, 7], [9, 8, 7, 6]],
                                   [1, 1, 1, 1, 1], fields, m)
    for world in (1, 2, 3, 5):
        bounds = distributed.shard_bounds(b.rows, world)
        assert OptimizerBatch.concat([b.shard(*r) for r in bounds]).digests() == b.digests()
    with pytest.raises(ContractError):
        distributed.shard_bounds(2, 3)


def test_exit_codes_of_a_launch_and_the_rank_environment() -> None:
    assert distributed.merged_exit(0, []) == 0
    assert distributed.merged_exit(1, [3, 2]) == 2  # a refusal on any rank
    assert distributed.merged_exit(1, [3]) == 3
    assert distributed.merged_exit(1, []) == 3  # killed before recording: nothing decided
    assert distributed.merged_exit(1, [1, 0]) == 1
    assert distributed.launch_env({}) == distributed.Launch()
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
    assert distributed.launch_env(env) == distributed.Launch(1, 2, 1, True)
    with pytest.raises(ConfigError):
        distributed.launch_env({**env, "RANK": "2"})
    with pytest.raises(ConfigError):
        distributed.launch_env({"RANK": "0"})


UNEVEN_PROGRAM = """
import sys
from pathlib import Path
import torch, torch.distributed as dist
from replayjob.runtime import distributed
from replayjob.errors import ContractError
dist.init_process_group("gloo")
seen = []
for strategy in ("ddp", "fsdp2"):
    p = distributed.Parallel(strategy, torch.nn.Linear(1, 1), None)
    p.check_micro_batches(2)  # the same count on every rank
    try:
        p.check_micro_batches(1 + dist.get_rank())
        seen.append(strategy + " ran")
    except ContractError as exc:
        seen.append(strategy + " refused: " + str(exc).replace("\\n", " "))
Path(sys.argv[1], f"rank-{dist.get_rank()}").write_text("\\n".join(seen))
dist.destroy_process_group()
"""


@pytest.mark.slow  # two ranks under torchrun
def test_fsdp2_refuses_ranks_with_different_micro_batch_counts_on_every_rank(tmp_path: Path) -> None:
    """FSDP2 gathers parameters in every forward: unequal micro-batch counts would pair unrelated
    collectives (a hang under gloo), so every rank refuses alike; DDP communicates in the last backward only."""
    prog = tmp_path / "uneven.py"
    prog.write_text(UNEVEN_PROGRAM)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(prog), str(tmp_path)], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(2):
        ddp, fsdp2 = (tmp_path / f"rank-{r}").read_text().splitlines()
        assert ddp == "ddp ran" and "fsdp2 refused:" in fsdp2 and "the shards give [1, 2]" in fsdp2


def test_a_launch_reports_the_ranks_diagnostics_not_the_launchers_traceback() -> None:
    text = ("[rank0]: noise\nreplayjob replay: distributed.strategy: refused here\n  fix: do this\n"
            "replayjob replay: distributed.strategy: refused here\n  fix: do this\n"
            "Traceback (most recent call last):\n  File \"run.py\", line 1\nreplayjob FAILED\n")
    assert distributed.rank_diagnostics(text) == ("replayjob replay: distributed.strategy: refused here\n"
                                                  "  fix: do this")
    assert distributed.rank_diagnostics("Traceback (most recent call last):\n  File x\n") == ""


# torchrun's stderr when rank 1 aborted (recorded from torch 2.13's launcher; paths shortened): the rank's own
# message comes before the launcher's traceback, the failed rank's signal after it.
CRASHED = """
*****************************************
Setting OMP_NUM_THREADS environment variable for each process to be 1 in default
*****************************************
terminate called after throwing an instance of 'gloo::IoException'
E1206 04:46:43.074000 9522 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -6) local_rank: 1
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=====================================================
replayjob FAILED
-----------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
-----------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 9528)  (SIGABRT)
  traceback : Signal 6 (SIGABRT) received by PID 9528
=====================================================
replayed arm baseline repeat 0: loss -0.0043
"""


def test_a_crashed_rank_is_reported_with_its_own_last_words_and_the_launchers_root_cause() -> None:
    said = distributed.launch_failure(CRASHED)
    assert "terminate called after throwing an instance of 'gloo::IoException'" in said
    assert "[torchrun] Root Cause" in said and "Signal 6 (SIGABRT)" in said
    assert "raise ChildFailedError" not in said and "_run_module_as_main" not in said  # the launcher's traceback
    assert distributed.launch_failure("srun: error: task 1: Aborted\n") == "srun: error: task 1: Aborted"
    long = "x" * 5000 + "\nterminate called\n" + CRASHED[CRASHED.index("Traceback"):]
    assert distributed.launch_failure(long).startswith("x" * 10) and len(distributed.launch_failure(long)) < 2000
