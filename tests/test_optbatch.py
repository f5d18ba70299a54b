"""Optimizer-batch capture, explain and replay, in process on the session capture.

Each refusal test checks exit 2 and a message naming the cause.  Tampering happens on copies of
the session capture; "re-pinned" tampering rewrites the manifest and passes its new digest, as an
attacker who controls the files and the pin would, so the deeper check is the one that fires.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file, save_file

from replayjob.artifacts import capture_payload as payload
from replayjob.cli import main
from replayjob.digest import sha256_bytes, sha256_file
from replayjob.jsonio import canonical_bytes
from replayjob.producers.builtin.capture import METRIC_KEYS
from replayjob.rl.state import ADAPTER_WEIGHTS, read_state, write_state

MANIFEST = "optimizer_batch_step_000000.manifest.json"
PAYLOAD = "optimizer_batch_step_000000.safetensors"
GC = "backend.options.gradient_checkpointing"


def source_metrics(capture_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = json.loads((capture_dir / "metrics.json").read_text())
    return out


def pins(capture_dir: Path, *, logical: str | None = None, manifest: str | None = None,
         replay_path: Path | None = None) -> list[str]:
    m = source_metrics(capture_dir)
    sets = [f"optimizer_batch.expected_logical_sha256={logical or m['optimizer/logical_batch_sha256']}",
            f"optimizer_batch.expected_manifest_sha256={manifest or m['optimizer_batch/manifest_sha256']}"]
    if replay_path is not None:
        sets.append(f'optimizer_batch.replay_path="{replay_path}"')
    return sets


def run(cmd: str, config: Path, *sets: str, out: Path | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    argv = [cmd, str(config), *extra]
    if out is not None:
        argv += ["--out", str(out)]
    for s in sets:
        argv += ["--set", s]
    return argv


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    return err


def copy_capture(capture_dir: Path, tmp_path: Path) -> Path:
    d = tmp_path / "src"
    shutil.copytree(capture_dir, d)
    return d


def repin(d: Path, data: bytes) -> str:
    """Replace the payload and rewrite the manifest consistently; return the new manifest digest."""
    (d / PAYLOAD).write_bytes(data)
    doc = json.loads((d / MANIFEST).read_text())
    doc["payload"]["size"], doc["payload"]["spans_sha256"] = len(data), payload.digest_bytes(data)
    raw = canonical_bytes(doc) + b"\n"
    (d / MANIFEST).write_bytes(raw)
    return sha256_bytes(raw)


BUILT_IN_KNOBS = (GC, "backend.options.attn_implementation", "training.micro_batch_size")
ONE_PROCESS = {"distributed.world_size": 1, "distributed.strategy": "none", "distributed.bucket_cap_mb": None}
DENSE = {"model.routing": "free", "model.experts_implementation": "eager"}  # no router, experts as transformers reports


def observed(rm: dict[str, Any]) -> dict[str, Any]:
    """The runtime observations of the built-in trainer's knobs (exactly its producer's knobs are recorded)."""
    from replayjob.runtime.knobs import BUILTIN, knobs_for

    assert rm["framework"] == BUILTIN
    assert set(rm["runtime"]) == set(knobs_for(BUILTIN)) == {*BUILT_IN_KNOBS, *ONE_PROCESS, *DENSE}
    assert {k: rm["runtime"][k] for k in ONE_PROCESS} == ONE_PROCESS  # one process, no process group
    assert {k: rm["runtime"][k] for k in DENSE} == DENSE
    return {k: rm["runtime"][k] for k in BUILT_IN_KNOBS}


@pytest.fixture(scope="module")
def baseline(workspace: Path, capture_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("replay") / "baseline"
    assert main(run("replay", workspace / "replay.toml", *pins(capture_dir), out=out)) == 0
    return out


# -- capture -------------------------------------------------------------------------------------

def test_capture_writes_payload_manifest_and_pins(capture_dir: Path, workspace: Path) -> None:
    for name in (MANIFEST, PAYLOAD, "diag.jsonl", "metrics.json", "final_adapter/adapter_model.safetensors"):
        assert (capture_dir / name).is_file(), name
    m = source_metrics(capture_dir)
    for key in METRIC_KEYS:
        assert re.fullmatch(r"[0-9a-f]{64}", m[key]), key
    assert m["optimizer_batch/manifest_sha256"] == sha256_file(capture_dir / MANIFEST)
    init_sha = sha256_file(workspace / "init_resume" / ADAPTER_WEIGHTS)
    assert m["optimizer_batch/initial_adapter_sha256"] == init_sha
    assert m["optimizer_batch/final_adapter_sha256"] == sha256_file(capture_dir / m["final_adapter_path"])
    assert m["optimizer_batch/final_adapter_sha256"] != init_sha
    doc = json.loads((capture_dir / MANIFEST).read_text())
    assert doc["payload"]["spans_sha256"] == payload.digest_bytes((capture_dir / PAYLOAD).read_bytes())
    assert doc["schema"] == "replayjob.capture_manifest/v3" and doc["framework"] == "replayjob"
    assert doc["logical_batch_sha256"] == m["optimizer/logical_batch_sha256"]
    assert doc["initial_adapter"]["sha256"] == init_sha
    assert doc["initial_adapter"]["size"] == (workspace / "init_resume" / ADAPTER_WEIGHTS).stat().st_size
    assert doc["contract"]["value"]["strict_deterministic"] is True
    assert doc["producer"]["provenance"]["torch_deterministic_algorithms"] is True
    assert doc["config"]["resolved"]["optimizer_batch"]["capture"] is True
    batch, rng = payload.decode((capture_dir / PAYLOAD).read_bytes())
    assert batch.logical_sha256() == m["optimizer/logical_batch_sha256"]
    assert batch.effective_sha256() == m["optimizer/local_effective_rows_sha256"]
    assert batch.old_logprobs.dtype == batch.advantages.dtype == torch.float64
    assert sorted(rng) == ["cpu"] and rng["cpu"].dtype == torch.uint8
    # the capture point is after the estimate: advantages carry the loss, weights sum to one
    assert float(batch.advantages.abs().max()) > 0
    assert abs(float(batch.loss_weights.sum()) - 1.0) < 1e-12


def test_train_with_capture_on_captures_too(workspace: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(run("train", workspace / "source.toml", out=tmp_path)) == 0
    printed = capsys.readouterr().out
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["optimizer_batch/manifest_sha256"] == sha256_file(tmp_path / MANIFEST)
    assert f"optimizer/logical_batch_sha256 {m['optimizer/logical_batch_sha256']}" in printed


def test_capture_preconditions_are_checked_before_any_work(workspace: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, run("capture", workspace / "source.toml", "training.max_steps=2",
                        "training.save_every=1", out=tmp_path / "o"),
            "max_steps must be 1", "save_every must be 0")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("step, needles", [
    (0, ("state at step 0", "step -1")),
    (4, ("state at step 4", "logical step zero runs exactly once")),  # a completed checkpoint
    (-2, ("'step' must be an integer >= -1, found -2",)),  # an earlier value than initialisation
])
def test_one_step_capture_refuses_any_resume_state_but_initialisation(
        workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], step: int,
        needles: tuple[str, ...]) -> None:
    state = state_at_step(workspace, tmp_path, step)
    refused(capsys, run("capture", workspace / "source.toml", f'resume.from="{state}"', out=tmp_path / "o"),
            *needles)
    assert not (tmp_path / "o").exists()


def state_at_step(workspace: Path, tmp_path: Path, step: int) -> Path:
    """A copy of the initialisation state relabelled as step ``step`` (hashes kept consistent)."""
    d = tmp_path / f"step{step}"
    shutil.copytree(workspace / "init_resume", d)
    write_state(d, step, read_state(d).model, {})
    return d


def step_zero_state(workspace: Path, tmp_path: Path) -> Path:
    d = state_at_step(workspace, tmp_path, 0)
    assert read_state(d).step == 0
    return d


def test_existing_capture_is_never_overwritten(capture_dir: Path, workspace: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    d = copy_capture(capture_dir, tmp_path)
    before = {p.name: sha256_file(p) for p in d.iterdir() if p.is_file()}
    refused(capsys, run("capture", workspace / "source.toml", out=d), "already exists", PAYLOAD)
    assert {p.name: sha256_file(p) for p in d.iterdir() if p.is_file()} == before


def test_a_capture_writer_error_surfaces_before_metrics(workspace: Path, tmp_path: Path) -> None:
    """The writer thread's refusal is re-raised on the training thread, the same domain error."""
    from replayjob.config import load_config
    from replayjob.errors import ArtifactExistsError, RefusedError
    from replayjob.producers.builtin.capture import CaptureHook
    from replayjob.rl.batch import OptimizerBatch

    cfg = load_config(workspace / "source.toml", ["optimizer_batch.capture=true"])
    hook = CaptureHook.prepare(cfg, tmp_path)
    (tmp_path / PAYLOAD).write_bytes(b"appeared after the preconditions were checked")
    m = torch.ones((1, 2), dtype=torch.float64)
    rows = OptimizerBatch.from_padded([[1, 2, 3]], [1], {k: m for k in payload.FLOAT_FIELDS}, m)
    unfinished = CaptureHook.prepare(cfg, tmp_path / "other")
    unfinished.before_update(0, rows)
    with pytest.raises(RefusedError, match="update never returned"):  # the writer gets work after the update
        unfinished.finish({"final_adapter_sha256": "0" * 64})
    assert not (tmp_path / "other").exists()
    hook.before_update(0, rows)
    hook.after_update(0, None)
    with pytest.raises(ArtifactExistsError) as exc:
        hook.finish({"final_adapter_sha256": "0" * 64})
    assert exc.value.exit_code == 2 and PAYLOAD in str(exc.value.where)
    assert not (tmp_path / MANIFEST).exists()
    assert (tmp_path / PAYLOAD).read_bytes() == b"appeared after the preconditions were checked"


def test_a_failed_capture_run_leaves_no_writer_thread_behind(workspace: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Writers start idle with their hooks; a run that fails anywhere releases them (and writes nothing)."""
    import threading

    from replayjob.config import load_config
    from replayjob.errors import ConfigError
    from replayjob.launch.source_run import train_source
    from replayjob.producers.builtin import trainer

    def writers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name in ("replayjob-capture-writer", "bundle-writer")]

    before = len(writers())
    cfg = load_config(workspace / "source.toml", ["optimizer_batch.capture=true"])
    monkeypatch.setenv("REPLAYJOB_BUNDLE_CAPTURE", "2")  # refused after the capture hook was built
    with pytest.raises(ConfigError):
        train_source(cfg, tmp_path / "a")
    monkeypatch.setenv("REPLAYJOB_BUNDLE_CAPTURE", "1")
    monkeypatch.setenv("REPLAYJOB_BUNDLE_DIR", str(tmp_path / "bundles"))

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the update failed")

    monkeypatch.setattr(trainer, "optimizer_update", broken)  # after both snapshots were taken
    with pytest.raises(RuntimeError, match="the update failed"):
        train_source(cfg, tmp_path / "b")
    assert len(writers()) == before
    assert not (tmp_path / "b" / PAYLOAD).exists() and not (tmp_path / "b" / MANIFEST).exists()


def test_secrets_in_the_config_are_redacted_in_every_capture_file(workspace: Path, tmp_path: Path) -> None:
    secret, password = "sk-live-0123456789abcdef", "hunter2pw"
    out = tmp_path / "secret"
    assert main(run("capture", workspace / "source.toml", f'logging.metadata.hf_token="{secret}"',
                    f'logging.metadata.endpoint="https://alice:{password}@example.org/x"', out=out)) == 0
    for f in out.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            assert secret.encode() not in data and password.encode() not in data, f
    meta = json.loads((out / MANIFEST).read_text())["config"]["resolved"]["logging"]["metadata"]
    assert meta == {"hf_token": "<redacted>", "endpoint": "https://<redacted>@example.org/x"}


# -- replay and explain ----------------------------------------------------------------------------

def test_same_condition_replay_matches_the_source_bitwise(baseline: Path, capture_dir: Path) -> None:
    src = source_metrics(capture_dir)
    rm = json.loads((baseline / "replay_metrics.json").read_text())
    assert rm["loss"] == src["loss"]
    assert rm["optimizer_batch/final_adapter_sha256"] == src["optimizer_batch/final_adapter_sha256"]
    assert sha256_file(baseline / rm["final_adapter_path"]) == rm["optimizer_batch/final_adapter_sha256"]
    assert rm["optimizer_batch/final_adapter_sha256"] != rm["optimizer_batch/initial_adapter_sha256"]
    for key in METRIC_KEYS[:4]:
        assert rm[key] == src[key], key
    assert rm["arm"] == "baseline" and rm["repeat_index"] == 0
    assert rm["skipped"] == ["dataset", "environment", "rollout", "sampling"]
    # every registered knob as observed at run time, not copied from the config
    assert observed(rm) == {GC: False, "backend.options.attn_implementation": "eager", "training.micro_batch_size": 4}
    assert rm["allowed_config_differences"] == rm["observed_config_differences"] == []
    assert rm["memory"]["kind"] == "max_rss" and rm["memory"]["peak_bytes"] > 0
    assert rm["padding"]["real_tokens"] <= rm["padding"]["padded_tokens"]
    assert all(rm["timing"][k] > 0 for k in ("local_train_wall_s", "forward_wall_s", "backward_wall_s"))


def test_replay_metrics_carry_every_documented_key(baseline: Path) -> None:
    rm = json.loads((baseline / "replay_metrics.json").read_text())
    doc = (REPO / "docs" / "replay-metrics.md").read_text()
    documented = set()
    for line in doc.split("\n### ")[0].splitlines():  # the top-level keys' table (subsections describe records)
        if line.startswith("| `"):
            documented.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
    assert documented and documented <= set(rm), sorted(documented - set(rm))
    assert set(rm) <= documented, sorted(set(rm) - documented)


def test_gradient_checkpointing_arm_records_the_flag_and_matches(baseline: Path, workspace: Path,
                                                                 capture_dir: Path, tmp_path: Path) -> None:
    assert main(run("replay", workspace / "replay.toml", *pins(capture_dir), f"{GC}=true",
                    f'optimizer_batch.allow_config_differences=["{GC}"]', out=tmp_path)) == 0
    rm = json.loads((tmp_path / "replay_metrics.json").read_text())
    base = json.loads((baseline / "replay_metrics.json").read_text())
    assert observed(rm) == {GC: True, "backend.options.attn_implementation": "eager", "training.micro_batch_size": 4}
    assert rm["arm"] == "gradient_checkpointing=true" and rm["knobs"] == {GC: True}
    assert rm["allowed_config_differences"] == rm["observed_config_differences"] == [GC]
    assert rm["loss"] == source_metrics(capture_dir)["loss"]
    # measured on CPU: recomputation replays the same kernels, so the update is bitwise equal too
    assert rm["optimizer_batch/final_adapter_sha256"] == base["optimizer_batch/final_adapter_sha256"]


def test_micro_batch_size_arm_is_admitted_and_close(baseline: Path, workspace: Path, capture_dir: Path,
                                                    tmp_path: Path) -> None:
    assert main(run("replay", workspace / "replay.toml", *pins(capture_dir), "training.micro_batch_size=3",
                    'optimizer_batch.allow_config_differences=["training.micro_batch_size"]',
                    'optimizer_batch.arm="mbs3"', out=tmp_path)) == 0
    rm = json.loads((tmp_path / "replay_metrics.json").read_text())
    assert rm["arm"] == "mbs3" and rm["knobs"] == {"training.micro_batch_size": 3}
    assert rm["padding"]["micro_batches"] == 6 and rm["runtime"]["training.micro_batch_size"] == 3
    # same math in exact arithmetic; regrouped float sums may differ in the last bits
    assert abs(rm["loss"] - source_metrics(capture_dir)["loss"]) < 1e-12


def test_explain_admits_and_reports_without_a_model(workspace: Path, capture_dir: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(run("explain", workspace / "replay.toml", *pins(capture_dir), extra=("--json",))) == 0
    rep = json.loads(capsys.readouterr().out)
    src = source_metrics(capture_dir)
    assert rep["admitted"] is True and rep["reasons"] == []
    assert rep["optimizer/logical_batch_sha256"] == src["optimizer/logical_batch_sha256"]
    assert rep["manifest"]["sha256"] == src["optimizer_batch/manifest_sha256"]
    assert rep["rows"]["rows"] == 16 and rep["rows"]["response_tokens"] > 0
    assert rep["observed_config_differences"] == [] and rep["arm"] == "baseline"
    assert main(run("explain", workspace / "replay.toml", *pins(capture_dir))) == 0
    assert "replay ADMITTED" in capsys.readouterr().out


def test_explain_lists_every_reason(workspace: Path, capture_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = run("explain", workspace / "replay.toml", *pins(capture_dir, logical="ab" * 32), f"{GC}=true",
               "optimizer.lr=0.5", 'optimizer_batch.allow_config_differences=["training.micro_batch_size"]',
               extra=("--json",))
    assert main(argv) == 2
    cap = capsys.readouterr()
    rep = json.loads(cap.out)
    text = "\n".join(rep["reasons"])
    for needle in ("wrong logical pin", f"undeclared difference '{GC}'", "optimizer contract differs",
                   "optimizer.lr", "'training.micro_batch_size' is not present"):
        assert needle in text, needle
    assert "replay refused (" in cap.err and rep["admitted"] is False


def test_replay_requires_both_pins(workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, run("replay", workspace / "replay.toml", out=tmp_path),
            "expected_logical_sha256 is required", "expected_manifest_sha256 is required")
    assert not tmp_path.joinpath("replay_metrics.json").exists()


# -- refusals, each with exit 2 and the cause named -----------------------------------------------

def test_flipped_payload_byte(capture_dir: Path, workspace: Path, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    d = copy_capture(capture_dir, tmp_path)
    data = bytearray((d / PAYLOAD).read_bytes())
    data[-3] ^= 0x01
    (d / PAYLOAD).write_bytes(bytes(data))
    refused(capsys, run("replay", workspace / "replay.toml", *pins(capture_dir, replay_path=d / MANIFEST),
                        out=tmp_path / "o"), "payload span digest", "nothing in it was used")


@pytest.mark.parametrize("flip", ["case", "control"])
def test_flipped_manifest_byte(capture_dir: Path, workspace: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str], flip: str) -> None:
    """A changed manifest is refused by its pin, whether or not the change leaves it valid JSON (the pin is
    checked over the bytes before anything parses them, the choice of producer included)."""
    d = copy_capture(capture_dir, tmp_path)
    data = bytearray((d / MANIFEST).read_bytes())
    i = data.index(b'"schema"') + 2  # a letter inside a key: a case flip stays valid JSON, a control byte does not
    data[i] = data[i] ^ 0x20 if flip == "case" else 0x01
    (d / MANIFEST).write_bytes(bytes(data))
    refused(capsys, run("replay", workspace / "replay.toml", *pins(capture_dir, replay_path=d / MANIFEST),
                        out=tmp_path / "o"), "manifest SHA-256 is", "expected_manifest_sha256")


def test_rng_only_payload_tamper_with_a_rewritten_manifest_is_refused_by_the_manifest_pin(
        capture_dir: Path, workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Only the captured RNG state changes (rows, logical digests and sizes stay exactly the same) and the
    manifest is rewritten to pin the new payload self-consistently: the external manifest pin refuses it."""
    d = copy_capture(capture_dir, tmp_path)
    data = bytearray((d / PAYLOAD).read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8:8 + header_len])["rng.cpu"]["data_offsets"]
    data[8 + header_len + start + (end - start) // 2] ^= 0x01
    new_manifest = repin(d, bytes(data))
    batch, rng = payload.decode(bytes(data))
    original_batch, original_rng = payload.decode((capture_dir / PAYLOAD).read_bytes())
    assert batch.logical_sha256() == original_batch.logical_sha256() and not torch.equal(rng["cpu"],
                                                                                         original_rng["cpu"])
    out = tmp_path / "o"
    refused(capsys, run("replay", workspace / "replay.toml", *pins(capture_dir, replay_path=d / MANIFEST), out=out),
            "manifest SHA-256 is", "expected_manifest_sha256")
    assert not out.exists()
    # the rewritten manifest is self-consistent: only the pin stands between it and a replay
    assert main(run("explain", workspace / "replay.toml",
                    *pins(capture_dir, manifest=new_manifest, replay_path=d / MANIFEST))) == 0


def test_wrong_logical_pin(capture_dir: Path, workspace: Path, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, run("replay", workspace / "replay.toml", *pins(capture_dir, logical="0" * 64),
                        out=tmp_path), "wrong logical pin")


def test_tampered_ragged_offsets(capture_dir: Path, workspace: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    d = copy_capture(capture_dir, tmp_path)
    data = bytearray((d / PAYLOAD).read_bytes())
    begin, _end, _n = payload.parse_header(bytes(data))["token_offsets"]
    data[begin + 8:begin + 16] = (10**6).to_bytes(8, "little")  # row 0 now ends far past the tokens
    (d / PAYLOAD).write_bytes(bytes(data))
    # unpinned: the payload digest refuses it before it is deserialised
    refused(capsys, run("replay", workspace / "replay.toml", *pins(capture_dir, replay_path=d / MANIFEST),
                        out=tmp_path / "o"), "payload span digest")
    # re-pinned: the structural check refuses it before any tensor is built
    new_pin = repin(d, bytes(data))
    refused(capsys, run("replay", workspace / "replay.toml",
                        *pins(capture_dir, manifest=new_pin, replay_path=d / MANIFEST), out=tmp_path / "o"),
            "payload refused", "token_offsets")


def test_non_finite_row(capture_dir: Path, workspace: Path, tmp_path: Path,
                        capsys: pytest.CaptureFixture[str]) -> None:
    d = copy_capture(capture_dir, tmp_path)
    batch, rng = payload.decode((d / PAYLOAD).read_bytes())
    adv = batch.advantages.clone()
    adv[int(batch.resp_offsets[5])] = float("nan")
    bad = payload.encode(type(batch)(**{**batch.tensors(), "advantages": adv}), rng)
    new_pin = repin(d, bad)
    refused(capsys, run("replay", workspace / "replay.toml",
                        *pins(capture_dir, manifest=new_pin, replay_path=d / MANIFEST), out=tmp_path / "o"),
            "row 5 holds a non-finite advantages value")


def test_undeclared_difference(capture_dir: Path, workspace: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, run("replay", workspace / "replay.toml", *pins(capture_dir), f"{GC}=true", out=tmp_path),
            f"undeclared difference '{GC}'")


def test_declared_difference_not_present(capture_dir: Path, workspace: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, run("replay", workspace / "replay.toml", *pins(capture_dir),
                        f'optimizer_batch.allow_config_differences=["{GC}"]', out=tmp_path),
            f"declared difference '{GC}' is not present", "stale allowlist")


def test_a_math_key_cannot_be_allowed(capture_dir: Path, workspace: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, run("replay", workspace / "replay.toml", *pins(capture_dir), "algorithm.clip_eps_high=0.3",
                        'optimizer_batch.allow_config_differences=["algorithm.clip_eps_high"]', out=tmp_path),
            "'algorithm.clip_eps_high' is not a registered systems-only knob", "optimizer contract differs")


def test_adapter_hash_mismatch(capture_dir: Path, workspace: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "other_init"
    shutil.copytree(workspace / "init_resume", d)
    tensors = load_file(str(d / ADAPTER_WEIGHTS))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, str(d / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    write_state(d, -1, read_state(workspace / "init_resume").model, {})  # a valid state, other weights
    refused(capsys, run("replay", workspace / "replay.toml", *pins(capture_dir), f'resume.from="{d}"',
                        out=tmp_path / "o"), "adapter hash mismatch")


def test_replay_refuses_a_resume_state_at_step_zero(capture_dir: Path, workspace: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    state = step_zero_state(workspace, tmp_path)
    refused(capsys, run("replay", workspace / "replay.toml", *pins(capture_dir), f'resume.from="{state}"',
                        out=tmp_path / "o"), "state at step 0")


def test_replay_never_overwrites_a_replay(baseline: Path, workspace: Path, capture_dir: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    before = sha256_file(baseline / "replay_metrics.json")
    refused(capsys, run("replay", workspace / "replay.toml", *pins(capture_dir), out=baseline),
            "already holds a replay")
    assert sha256_file(baseline / "replay_metrics.json") == before


@pytest.mark.parametrize("cmd", ["replay", "capture"])
@pytest.mark.parametrize("below", [False, True])
def test_an_output_directory_that_is_a_file_is_refused_before_anything_runs(
        cmd: str, below: bool, workspace: Path, capture_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--out`` naming a file (or a directory below one): refused, exit 2, before the model is built (it failed
    when the run wrote, exit 3 with a traceback)."""
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"mine")
    out = blocker / "sub" if below else blocker
    config, sets = ((workspace / "replay.toml", pins(capture_dir)) if cmd == "replay"
                    else (workspace / "source.toml", []))
    refused(capsys, run(cmd, config, *sets, out=out), "not a directory", "a-file")
    assert blocker.read_bytes() == b"mine" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize(("setting", "needle"), [
    ("optimizer_batch.arm='source'", "reserved for the capture run"),
    ("optimizer_batch.tolerances_sha256='zz'", "optimizer_batch.tolerances_sha256"),
])
def test_replay_settings_the_reducer_would_refuse_are_refused_at_admission(
        capture_dir: Path, setting: str, needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    from replayjob.jsonio import read_json_object

    m = read_json_object(capture_dir / "metrics.json")
    argv = ["explain", str(capture_dir.parent / "replay.toml"),
            "--set", f"optimizer_batch.expected_logical_sha256='{m['optimizer/logical_batch_sha256']}'",
            "--set", f"optimizer_batch.expected_manifest_sha256='{m['optimizer_batch/manifest_sha256']}'",
            "--set", setting]
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_in_process_repeats_and_slot_are_recorded_apart(baseline: Path, workspace: Path, capture_dir: Path,
                                                        tmp_path: Path) -> None:
    """Warm-up + measured updates from the same restored state reproduce the fresh update's loss;
    the fresh-process timing, the adapter and the slot are what a plain replay records."""
    out = tmp_path / "ip"
    argv = run("replay", workspace / "replay.toml", *pins(capture_dir), "optimizer_batch.warmup_updates=1",
               "optimizer_batch.measured_updates=2", out=out, extra=("--slot", "abba:7:1:0"))
    assert main(argv) == 0
    rm = json.loads((out / "replay_metrics.json").read_text())
    base = json.loads((baseline / "replay_metrics.json").read_text())
    ip = rm["in_process"]
    assert ip["warmup_updates"] == 1 and ip["measured_updates"] == 2 and ip["loss_equal"] is True
    assert len(ip["local_train_wall_s"]) == 2 and all(w > 0 for w in ip["local_train_wall_s"])
    assert rm["optimizer_batch/final_adapter_sha256"] == base["optimizer_batch/final_adapter_sha256"]
    assert rm["loss"] == base["loss"] and base["in_process"] is None and base["schedule"] is None
    assert rm["schedule"] == {"design": "abba", "seed": 7, "block": 1, "position": 0} and rm["host"]["node"]


def test_warmup_without_measured_updates_is_refused(workspace: Path, capture_dir: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, run("replay", workspace / "replay.toml", *pins(capture_dir), "optimizer_batch.warmup_updates=2",
                        out=tmp_path / "w"), "measured_updates")


# -- the micro-batch-size knob and dropout anywhere in the model ----------------------------------

def _mbs_configs(model_path: str = "", lora_dropout: float = 0.0) -> tuple[Any, Any]:
    from replayjob.config import load_config

    sets = [f'model.path="{model_path}"', f"lora.dropout={lora_dropout}"]
    return load_config(None, sets), load_config(None, [*sets, "training.micro_batch_size=2"])


@pytest.mark.parametrize("config_json, needle", [
    ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ({"hidden_dropout_prob": 0.0, "text_config": {"resid_pdrop": 0.2}}, "text_config.resid_pdrop=0.2"),
])
def test_micro_batch_knob_is_refused_for_any_dropout_in_a_local_model(tmp_path: Path, config_json: dict[str, Any],
                                                                      needle: str) -> None:
    from replayjob.runtime.knobs import KNOBS

    (tmp_path / "config.json").write_text(json.dumps(config_json))
    source, replay = _mbs_configs(str(tmp_path))
    why = KNOBS["training.micro_batch_size"].refusal(source, replay)
    assert why is not None and needle in why
    (tmp_path / "config.json").write_text(json.dumps({"attention_dropout": 0.0, "hidden_dropout_prob": 0}))
    assert KNOBS["training.micro_batch_size"].refusal(*_mbs_configs(str(tmp_path))) is None
    why = KNOBS["training.micro_batch_size"].refusal(*_mbs_configs(str(tmp_path), lora_dropout=0.05))
    assert why is not None and "lora.dropout=0.05" in why


def test_micro_batch_knob_is_refused_for_a_dropout_module_in_the_built_model() -> None:
    from replayjob.runtime.knobs import KNOBS

    knob = KNOBS["training.micro_batch_size"]
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0))
    assert knob.model_refusal(plain) is None
    dropping = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Dropout1d(0.3)))
    why = knob.model_refusal(dropping)
    assert why is not None and "1.0 (p=0.3)" in why


def test_every_registered_knob_is_observed_at_run_time() -> None:
    from replayjob.runtime.knobs import BUILTIN, KNOBS, Runtime, knobs_for, observe_all

    assert all(k.observe is not None for k in KNOBS.values()), "a knob without an observer cannot be checked"
    model = torch.nn.Linear(2, 2)
    model.gradient_checkpointing = True  # type: ignore[assignment]  # what transformers sets on a module
    seen = observe_all(Runtime(model, (4, 4, 2)))  # the built-in trainer's knobs by default
    assert set(seen) == set(knobs_for(BUILTIN))
    assert {k: seen[k] for k in BUILT_IN_KNOBS} == {GC: True, "backend.options.attn_implementation": None,
                                                    "training.micro_batch_size": 4}


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda doc: doc["rows"].update(rows=doc["rows"]["rows"] + 1), "rows.rows is"),
    (lambda doc: doc["rows"].update(loss_weight_sum=doc["rows"]["loss_weight_sum"] * 2), "rows.loss_weight_sum is"),
    (lambda doc: doc["rows"].update(loss_bearing_tokens=1), "rows.loss_bearing_tokens is"),
    (lambda doc: doc["rows"].update(tokens=float(doc["rows"]["tokens"])), "field `rows.tokens`: expected `int`"),
    (lambda doc: doc["rows"].pop("response_tokens"), "missing required field `response_tokens`"),
    (lambda doc: doc["rows"].update(extra=1), "unknown field `extra`"),
    (lambda doc: doc["outcome"].update(grad_norm=-1.0), "field `outcome.grad_norm`: expected `float` >= 0.0"),
])
def test_a_manifest_whose_summaries_disagree_with_its_payload_is_refused(
        edit: Any, needle: str, capture_dir: Path, workspace: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The manifest is rewritten self-consistently and re-pinned: only the summary recomputed from the payload
    (or the declared range of the sealed outcome) stands between it and a replay."""
    d = copy_capture(capture_dir, tmp_path)
    doc = json.loads((d / MANIFEST).read_text())
    edit(doc)
    raw = canonical_bytes(doc) + b"\n"
    (d / MANIFEST).write_bytes(raw)
    refused(capsys, run("explain", workspace / "replay.toml",
                        *pins(capture_dir, manifest=sha256_bytes(raw), replay_path=d / MANIFEST)), needle)
