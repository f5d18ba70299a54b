"""TRL over several processes: a GRPOTrainer step captured in each process of a two-process DDP run (torchrun,
gloo on CPU), replayed bitwise on two processes, and on one process where TRL's loss normalisation keeps the
gradient (``dapo``: gradient_accumulation_steps / steps_per_generation kept), refused where it does not.

One capture per module (``ranks_capture``: the conftest scenario with LoRA dropout 0 and loss_type "dapo", step 1
of 2, launched by ``tests/trl_ranks_source.py``); refusals run in-process on copies of it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the TRL tests need the 'trl' extra: pip install -e '.[trl]'")
os.environ["HF_HUB_OFFLINE"] = "1"  # inherited by the launched processes

import torch

from replayjob.artifacts import api_manifest as imanifest
from replayjob.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.alone,  # several processes rendezvous (torchrun, gloo)
              pytest.mark.usefixtures("fresh_determinism_mode")]

STEP = 1
SCRIPT = Path(__file__).resolve().parent / "trl_ranks_source.py"
ONE_PROCESS = ["--set", "trl.gradient_accumulation_steps=4", "--set", "trl.steps_per_generation=4",
               "--set", 'optimizer_batch.allow_config_differences=["distributed.num_processes", '
                        '"trl.gradient_accumulation_steps", "trl.steps_per_generation"]']


@pytest.fixture(scope="module")
def ranks_capture(trl_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("trl_ranks_capture")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           str(trl_base), str(out), str(STEP), "lora_dropout=0.0", 'loss_type="dapo"']
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    source = json.loads((out / "source.json").read_text())
    return {"dir": out, "source": source, "toml": Path(source["replay_toml"])}


@pytest.fixture(scope="module")
def two_process_replay(ranks_capture: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``replayjob replay --nproc 2`` of the capture (the same-condition baseline)."""
    out = tmp_path_factory.mktemp("trl_ranks_replays") / "baseline"
    assert main(["replay", str(ranks_capture["toml"]), "--out", str(out), "--nproc", "2"]) == 0
    return out


def _metrics(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(path.read_text())
    return out


def _adapter(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = load_file(path)
    return out


def test_two_process_capture_writes_one_root_over_both_parts(ranks_capture: dict[str, Any]) -> None:
    d, src = ranks_capture["dir"], ranks_capture["source"]
    assert src["num_processes"] == 2  # the source run really ran on two processes (torchrun, gloo)
    root = _metrics(Path(src["manifest"]))
    assert root["schema"] == "replayjob.capture_manifest/v3" and root["framework"] == "trl"
    assert root["world_size"] == 2 and root["step"] == STEP
    assert [e["dir"] for e in root["ranks"]] == ["rank-0", "rank-1"]
    assert root["config"]["resolved"]["distributed"] == {"num_processes": 2}
    for r in (0, 1):
        part = _metrics(d / f"rank-{r}" / f"optimizer_batch_step_{STEP:06d}.manifest.json")
        assert len(part["micro_batches"]) == 2 and part["micro_batches"][1]["sync_gradients"] is True
        assert json.loads((d / f"COMPLETE.{r}").read_text())["manifest_sha256"] == root["ranks"][r]["manifest_sha256"]
    parts = [_metrics(d / f"rank-{r}" / f"optimizer_batch_step_{STEP:06d}.manifest.json") for r in (0, 1)]
    assert parts[0]["logical_batch_sha256"] != parts[1]["logical_batch_sha256"]  # each process its own rows
    metrics = _metrics(d / "metrics.json")
    assert metrics["optimizer_batch/manifest_sha256"] == src["manifest_sha256"]
    assert metrics["optimizer/logical_batch_sha256"] == root["logical_batch_sha256"]
    log = [h for h in src["log"] if "grad_norm" in h]
    assert metrics["loss"] == log[STEP]["loss"] and metrics["grad_norm"] == log[STEP]["grad_norm"]
    assert metrics["optimizer_batch/final_adapter_sha256"] != metrics["optimizer_batch/initial_adapter_sha256"]


def test_two_process_replay_is_bitwise(ranks_capture: dict[str, Any], two_process_replay: Path) -> None:
    out = two_process_replay
    assert sorted(p.name for p in out.glob("replay_metrics*.json")) == [
        "replay_metrics.json", "replay_metrics.rank-0.json", "replay_metrics.rank-1.json"]
    r, s = _metrics(out / "replay_metrics.json"), _metrics(ranks_capture["dir"] / "metrics.json")
    assert r["optimizer_batch/final_adapter_sha256"] == s["optimizer_batch/final_adapter_sha256"]
    assert r["loss"] == s["loss"] and r["grad_norm"] == s["grad_norm"]
    assert r["optimizer/logical_batch_sha256"] == s["optimizer/logical_batch_sha256"]
    assert r["distributed"]["world_size"] == 2 and [e["rows"] for e in r["distributed"]["ranks"]] == [[0, 8], [8, 16]]
    assert r["arm"] == "baseline"


def test_one_process_replay_of_dapo_keeps_the_ratio(ranks_capture: dict[str, Any], two_process_replay: Path,
                                                    tmp_path: Path) -> None:
    out = tmp_path / "one"
    assert main(["replay", str(ranks_capture["toml"]), "--out", str(out), *ONE_PROCESS]) == 0
    r, s = _metrics(out / "replay_metrics.json"), _metrics(ranks_capture["dir"] / "metrics.json")
    assert "distributed" not in r and r["padding"]["micro_batches"] == 4
    assert r["optimizer/logical_batch_sha256"] == s["optimizer/logical_batch_sha256"]
    assert r["arm"] == "num_processes=1+gradient_accumulation_steps=4+steps_per_generation=4"
    got, want = _adapter(out / "final_adapter/adapter_model.safetensors"), _adapter(
        ranks_capture["dir"] / "final_adapter/adapter_model.safetensors")
    start = _adapter(ranks_capture["dir"] / "rank-0" / f"optimizer_batch_step_{STEP:06d}.adapter.safetensors")
    moved = max(float((want[k] - start[k]).abs().max()) for k in want)
    off = max(float((want[k] - got[k]).abs().max()) for k in want)
    assert off < 1e-4 * moved  # the same update; only the order of the sums differs
    assert r["runtime"]["distributed.num_processes"] == 1 and r["runtime"]["trl.steps_per_generation"] == 4
    # exact-input: the same inputs, every difference a registered knob in effect (one repeat per arm here)
    assert main(["reduce", str(two_process_replay), str(out), "--claim", "exact-input", "--source",
                 str(ranks_capture["dir"]), "--baseline", "baseline", "--arms", f"baseline,{r['arm']}",
                 "--min-repeats", "1", "--out", str(tmp_path / "verdict.json")]) == 0


@pytest.mark.parametrize(("sets", "cause"), [
    (["--set", "trl.gradient_accumulation_steps=4", "--set", 'optimizer_batch.allow_config_differences='
      '["distributed.num_processes", "trl.gradient_accumulation_steps"]'],
     "captured 2/2, replay 4/2 would scale it by 0.5; set trl.steps_per_generation = 4"),
    (["--set", 'optimizer_batch.allow_config_differences=["distributed.num_processes"]'],
     "would run 2, so each would not be run exactly once"),
    ([], "undeclared difference 'distributed.num_processes'"),
    (["--set", "trl.gradient_accumulation_steps=4", "--set",
      'optimizer_batch.allow_config_differences=["trl.gradient_accumulation_steps"]'],
     "trl.gradient_accumulation_steps is admitted only with distributed.num_processes"),
])
def test_one_process_replay_is_refused_where_the_gradient_would_change(
        sets: list[str], cause: str, ranks_capture: dict[str, Any], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["explain", str(ranks_capture["toml"]), *sets]) == 2
    text = capsys.readouterr()
    assert cause in text.out + text.err
    assert main(["replay", str(ranks_capture["toml"]), "--out", str(tmp_path / "r"), *sets]) == 2
    assert not (tmp_path / "r" / "replay_metrics.json").exists()


@pytest.mark.parametrize(("case", "cause"), [("missing landing", "lacks COMPLETE.1"),
                                             ("payload byte", "payload"),
                                             ("linked part", "'rank-1' is a symbolic link"),
                                             ("linked adapter", "process 1's adapter file"),
                                             ("linked optimizer", "is a symbolic link"),
                                             ("short optimizer", "process 1's optimizer file is")])
def test_a_damaged_part_is_refused(case: str, cause: str, ranks_capture: dict[str, Any], tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "cap"
    shutil.copytree(ranks_capture["dir"], d, ignore=shutil.ignore_patterns("trainer"))
    names = imanifest.file_names(STEP)
    if case == "missing landing":
        (d / "COMPLETE.1").unlink()
    elif case == "linked part":  # the whole part directory moved out and linked back
        shutil.move(d / "rank-1", tmp_path / "elsewhere")
        (d / "rank-1").symlink_to(tmp_path / "elsewhere")
    elif case in ("linked adapter", "linked optimizer", "short optimizer"):  # files a replay never reads
        f = d / "rank-1" / names["adapter" if case == "linked adapter" else "optimizer"]  # (process 0's are read)
        shutil.move(f, tmp_path / f.name)
        if case.startswith("linked"):
            f.symlink_to(tmp_path / f.name)
        else:
            f.write_bytes((tmp_path / f.name).read_bytes()[:-1])
    else:
        p = d / "rank-1" / f"optimizer_batch_step_{STEP:06d}.safetensors"
        data = bytearray(p.read_bytes())
        data[-3] ^= 0x01
        p.write_bytes(bytes(data))
    sets = ["--set", f'optimizer_batch.replay_path="{d / f"optimizer_batch_step_{STEP:06d}.manifest.json"}"']
    capsys.readouterr()
    assert main(["explain", str(ranks_capture["toml"]), *sets, *ONE_PROCESS]) == 2
    text = capsys.readouterr()
    assert cause in text.out + text.err and "Traceback" not in text.out + text.err


def test_the_cluster_steps_refuse_a_capture_over_several_processes(ranks_capture: dict[str, Any], tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A spec naming a two-process capture is refused at plan (never misread as another kind of capture)."""
    from conftest import capture_spec

    spec = tmp_path / "spec.toml"
    spec.write_text(capture_spec(ranks_capture["toml"].parent, arms="[arms.baseline]\n"))
    capsys.readouterr()
    assert main(["step", "plan", "--spec", str(spec)]) == 2
    assert "ran on 2 processes" in capsys.readouterr().err


@pytest.mark.parametrize(("field", "change"), [("rows", 1), ("micro_batches", 1), ("bytes", -4), ("tensors", 1),
                                               ("elements", -1), ("nonfinite_inputs", None)])
def test_a_root_whose_rows_summary_lies_is_refused_even_when_pinned(field: str, change: int | None,
                                                                    ranks_capture: dict[str, Any], tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The root is rewritten with a false summary of its parts' micro-batches and re-pinned: recomputed, refused."""
    def lie(doc: dict[str, Any]) -> None:
        rows = doc["rows"]
        rows[field] = (not rows[field]) if change is None else rows[field] + change

    text = _explain_rewritten_root(lie, ranks_capture, tmp_path, capsys)
    assert f"rows.{field} is" in text and "Traceback" not in text, text


def _explain_rewritten_root(edit: Any, ranks_capture: dict[str, Any], tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> str:
    """``explain`` (exit 2 asserted) of a copy of the capture whose root manifest is ``edit``-ed and re-pinned, as
    someone rewriting both would; what it printed."""
    import json

    from replayjob.digest import sha256_bytes
    from replayjob.jsonio import canonical_bytes
    d = tmp_path / "cap"
    shutil.copytree(ranks_capture["dir"], d, ignore=shutil.ignore_patterns("trainer"))
    root = d / f"optimizer_batch_step_{STEP:06d}.manifest.json"
    doc = json.loads(root.read_text())
    edit(doc)
    raw = canonical_bytes(doc) + b"\n"
    root.write_bytes(raw)
    sets = ["--set", f'optimizer_batch.replay_path="{root}"',
            "--set", f'optimizer_batch.expected_manifest_sha256="{sha256_bytes(raw)}"']
    capsys.readouterr()
    assert main(["explain", str(ranks_capture["toml"]), *sets, *ONE_PROCESS]) == 2
    text = capsys.readouterr()
    return text.out + text.err


def _bigger(doc: dict[str, Any], *path: Any) -> None:
    for k in path[:-1]:
        doc = doc[k]
    doc[path[-1]] = 2**64  # 20 digits: the strict JSON reader still parses it


@pytest.mark.parametrize(("edit", "named"), [
    (lambda d: d.update(payload_sha256="0" * 64), "payload_sha256 is not the digest of its parts' payloads"),
    (lambda d: d["ranks"][1].update(micro_batches=d["ranks"][1]["micro_batches"] + 1), "rows.micro_batches is"),
    (lambda d: d.update(world_size=2.0), "field `world_size`: expected `int`, got `float`"),
    (lambda d: d["ranks"][0].update(rank=False), "field `ranks[0].rank`: expected `int`, got `bool`"),
    (lambda d: d["rows"].update(trust_me=1), "field `rows`: object contains unknown field `trust_me`"),
    (lambda d: _bigger(d, "framework_state", "huge"), "`framework_state.huge` is 18446744073709551616, an integer "
                                                      "beyond 64 bits"),
    (lambda d: _bigger(d, "step"), "field `step`: expected `int` <= 9223372036854775807"),
])
def test_a_malformed_or_contradicting_root_is_refused_even_when_pinned(
        edit: Any, named: str, ranks_capture: dict[str, Any], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The root is rewritten (a summary that is not its parts', a wrong type, an unknown key, an integer beyond 64
    bits) and re-pinned: refused with exit 2, naming the field, never a traceback."""
    text = _explain_rewritten_root(edit, ranks_capture, tmp_path, capsys)
    assert named in text and "Traceback" not in text, text


def test_the_documented_accelerate_line_captures_over_two_cpu_processes(trl_base: Path, tmp_path: Path) -> None:
    """docs/capture-api.md's CPU line, ``accelerate launch --multi_gpu --num_processes 2 train.py`` (on a machine
    without a GPU accelerate then runs gloo processes; ``--cpu --num_processes 2`` would start one), really starts two
    processes, and the capture records the process count the launcher was asked for."""
    out = tmp_path / "cap"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", "0", str(SCRIPT), str(trl_base), str(out), "0", "lora_dropout=0.0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # the CPU line, on any machine
    assert proc.returncode == 0, proc.stderr[-4000:]
    source = json.loads((out / "source.json").read_text())
    assert source["num_processes"] == 2
    root = _metrics(Path(source["manifest"]))
    assert root["world_size"] == 2 and root["framework_state"]["launch"] == {"requested_processes": 2,
                                                                            "processes": 2}


def test_one_process_part_replayed_as_a_capture_of_its_own_is_refused(ranks_capture: dict[str, Any], tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Process 0's part (its own manifest, pinned) named as the capture, with the process count declared: admitted
    as a one-process capture (its micro-batches are half the step's, so the replay ran half the step as the whole
    against the whole step's outcome).  Refused (exit 2) naming the field that says it is a part, nothing built."""
    from replayjob.artifacts.api_manifest import file_names
    from replayjob.digest import sha256_bytes
    part = ranks_capture["dir"] / "rank-0" / file_names(STEP)["manifest"]
    doc = json.loads(part.read_text())
    sets = ["--set", f'optimizer_batch.replay_path="{part}"',
            "--set", f'optimizer_batch.expected_manifest_sha256="{sha256_bytes(part.read_bytes())}"',
            "--set", f'optimizer_batch.expected_logical_sha256="{doc["logical_batch_sha256"]}"',
            "--set", 'optimizer_batch.allow_config_differences=["distributed.num_processes"]']
    for argv in (["explain", str(ranks_capture["toml"]), *sets],
                 ["replay", str(ranks_capture["toml"]), *sets, "--out", str(tmp_path / "r")]):
        capsys.readouterr()
        assert main(argv) == 2, argv[0]
        out = capsys.readouterr()
        text = out.out + out.err
        assert "`config.resolved.distributed.num_processes` is 2: this is one process's part" in text, text
        assert "Traceback" not in text
    assert not (tmp_path / "r").exists()
