"""Every per-token or per-row array of a captured step has a declared domain (a log-probability <= 0, a weight >= 0, a
mask 0/1), enforced by the payload's reader for every producer: a payload rewritten by a forger who recomputes every
digest and pin (the payload's span digest and size, the rows summary, the logical and effective digests, the
manifest pin and the logical pin) is refused by ``explain`` and ``replay`` alike (exit 2, one line naming the file,
the field and the rule, no traceback); what a real step holds (a log-probability of exactly 0) stays admitted."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from replayjob import tensorfile
from replayjob.artifacts import api_manifest
from replayjob.artifacts import capture_payload as payload
from replayjob.artifacts.capture_manifest import LOGPROB, MASK, WEIGHT
from replayjob.cli import main
from replayjob.digest import sha256_bytes
from replayjob.jsonio import canonical_bytes
from replayjob.producers.api import microbatch as _microbatch
from replayjob.rl.batch import OptimizerBatch
from replayjob.rl.state import safetensors_bytes

MANIFEST = "optimizer_batch_step_000000.manifest.json"
PAYLOAD = "optimizer_batch_step_000000.safetensors"


def _outcome(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out + out.err


def _reseal_builtin(capture_dir: Path, d: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> list[str]:
    """The built-in capture copied to ``d``, its payload's arrays edited and everything re-sealed as a forger
    would: payload bytes, size and span digest, rows summary, row digests, manifest pin and logical pin."""
    shutil.copytree(capture_dir, d)
    batch, rng = payload.decode((d / PAYLOAD).read_bytes())
    tensors = {k: v.clone() for k, v in batch.tensors().items()}
    edit(tensors)
    forged = OptimizerBatch(**tensors)
    data = payload.encode(forged, rng)
    (d / PAYLOAD).write_bytes(data)
    logical, effective = forged.digests()
    doc = json.loads((d / MANIFEST).read_text())
    doc["payload"].update(size=len(data), spans_sha256=payload.digest_bytes(data))
    doc["rows"] = payload.summary(forged)
    doc.update(logical_batch_sha256=logical, local_effective_rows_sha256=effective)
    raw = canonical_bytes(doc) + b"\n"
    (d / MANIFEST).write_bytes(raw)
    return ["--set", f'optimizer_batch.replay_path="{d / MANIFEST}"',
            "--set", f'optimizer_batch.expected_manifest_sha256="{sha256_bytes(raw)}"',
            "--set", f'optimizer_batch.expected_logical_sha256="{logical}"']


def _set(field: str, value: float, at: int = 0) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[field][at] = value
    return edit


@pytest.mark.parametrize(("edit", "named"), [
    (_set("old_logprobs", 0.5), "old_logprobs holds 0.5 at row 0, response token 0, outside its domain: "
                                "a log-probability is <= 0"),
    (_set("ref_logprobs", 1e-9, 1), "ref_logprobs holds 1e-09 at row 0, response token 1"),
    (_set("sampler_logprobs", 3.0), "sampler_logprobs holds 3.0"),
    (_set("loss_weights", -0.25), "loss_weights holds -0.25 at row 0, response token 0, outside its domain: "
                                  "a weight is >= 0"),
])
def test_a_resealed_builtin_payload_outside_its_domain_is_refused(
        edit: Callable[[dict[str, torch.Tensor]], None], named: str, workspace: Path, capture_dir: Path,
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sets = _reseal_builtin(capture_dir, tmp_path / "src", edit)
    for argv in (["explain", str(workspace / "replay.toml"), *sets],
                 ["replay", str(workspace / "replay.toml"), *sets, "--out", str(tmp_path / "o")]):
        code, text = _outcome(argv, capsys)
        assert code == 2 and named in text and PAYLOAD in text and "Traceback" not in text, (argv[0], text)
    assert not (tmp_path / "o").exists()


def test_a_resealed_builtin_payload_inside_its_domain_is_admitted(
        workspace: Path, capture_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A log-probability of exactly 0 (or -0.0) and a weight of 0 are values a real step holds: the same forger's
    re-seal with them is admitted (the domain refuses what no step holds, not what differs)."""
    def edit(t: dict[str, torch.Tensor]) -> None:
        t["old_logprobs"][0], t["ref_logprobs"][0], t["loss_weights"][1] = 0.0, -0.0, 0.0
    sets = _reseal_builtin(capture_dir, tmp_path / "src", edit)
    code, text = _outcome(["explain", str(workspace / "replay.toml"), *sets], capsys)
    assert code == 0, text


def test_domains_are_declared_for_every_float_field_of_the_builtin_payload() -> None:
    assert set(payload.FIELD_DOMAINS) == {*payload.FLOAT_FIELDS, *payload.OPTIONAL_FLOAT_FIELDS}
    assert payload.FIELD_DOMAINS["old_logprobs"] is LOGPROB and payload.FIELD_DOMAINS["loss_weights"] is WEIGHT


def test_the_capture_api_domains_name_each_input_row_and_rule() -> None:
    ok = {"old_per_token_logps": torch.tensor([[-1.0, 0.0], [-0.0, -3.0]], dtype=torch.bfloat16),
          "completion_mask": torch.tensor([[1, 0], [1, 1]]), "advantages": torch.tensor([2.0, -2.0])}
    assert api_manifest.input_domain_reasons("trl", "inputs", ok) == []
    bad = {**ok, "old_per_token_logps": torch.tensor([[-1.0, -2.0], [0.5, -3.0]]),
           "completion_mask": torch.tensor([[1, 2], [1, 1]]), "importance_sampling_ratio": torch.tensor([[-1.0]])}
    assert api_manifest.input_domain_reasons("trl", "inputs", bad) == [
        "inputs.completion_mask holds 2 at row 0, position 1, outside its domain: a mask holds 0 or 1",
        "inputs.importance_sampling_ratio holds -1.0 at row 0, position 0, outside its domain: a weight is >= 0 "
        "(a negative weight turns its token's loss around)",
        "inputs.old_per_token_logps holds 0.5 at row 1, position 0, outside its domain: a log-probability is <= 0 "
        "(a probability of at most 1)"]
    nan = {"old_log_probs": torch.tensor([float("nan"), float("-inf"), -1.0]), "response_mask": torch.ones(3).bool()}
    assert api_manifest.input_domain_reasons("verl", "inputs", nan) == []  # non-finite: the non-finite rule's
    assert api_manifest.INPUT_DOMAINS["verl"]["response_mask"] is MASK
    assert set(api_manifest.INPUT_DOMAINS) == set(api_manifest.EXTERNAL)


def _reseal_api(d: Path, manifest: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> list[str]:
    """A capture API capture's payload edited and everything re-sealed: payload file SHA-256 and size, the logical
    and effective digests, the manifest pin and the logical pin."""
    doc = json.loads(manifest.read_text())
    p = manifest.parent / doc["files"]["payload"]["file"]
    tensors = {k: v.clone() for k, v in tensorfile.load(p).items()}
    edit(tensors)
    p.write_bytes(safetensors_bytes(tensors, "replayjob-payload"))  # as the capture API writes it
    mbs = []
    for i, e in enumerate(doc["micro_batches"]):
        ins = {k: tensors[f"mb{i:04d}.inputs.{k}"] for k in e["inputs"]["tensors"]}
        call = {k: tensors[f"mb{i:04d}.call.{k}"] for k in e["call"]["tensors"]}
        rng = {k: tensors[f"mb{i:04d}.rng.{k}"] for k in e["rng"]}
        mbs.append(_microbatch.MicroBatch(ins, dict(e["inputs"]["values"]), call, dict(e["call"]["values"]), rng,
                                          e["sync_gradients"], e["accumulation_steps"]))
    logical = _microbatch.logical_digest(mbs)
    doc["files"]["payload"].update(sha256=sha256_bytes(p.read_bytes()), size=p.stat().st_size)
    doc.update(logical_batch_sha256=logical, local_effective_rows_sha256=_microbatch.effective_digest(mbs))
    raw = (json.dumps(doc, sort_keys=True) + "\n").encode()
    manifest.write_bytes(raw)
    return ["--set", f'optimizer_batch.replay_path="{manifest}"',
            "--set", f'optimizer_batch.expected_manifest_sha256="{sha256_bytes(raw)}"',
            "--set", f'optimizer_batch.expected_logical_sha256="{logical}"']


def _first(suffix: str, value: Any) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        k = sorted(k for k in t if k.endswith(suffix))[0]
        t[k].view(-1)[0] = value
    return edit


@pytest.mark.parametrize(("edit", "named"), [
    (_first(".inputs.completion_mask", 2), "inputs.completion_mask holds 2 at row 0, position 0, outside its "
                                           "domain: a mask holds 0 or 1"),
    (_first(".inputs.completion_mask", -1), "inputs.completion_mask holds -1"),
])
def test_a_resealed_trl_payload_outside_its_domain_is_refused(
        edit: Callable[[dict[str, torch.Tensor]], None], named: str, trl_capture: dict[str, Any], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from conftest import TRL_STEP
    d = tmp_path / "cap"
    shutil.copytree(trl_capture["dir"], d, ignore=shutil.ignore_patterns("trainer"))
    manifest = d / api_manifest.file_names(TRL_STEP)["manifest"]
    sets = _reseal_api(d, manifest, edit)
    for argv in (["explain", str(d / "replay.toml"), *sets],
                 ["replay", str(d / "replay.toml"), *sets, "--out", str(tmp_path / "r")]):
        code, text = _outcome(argv, capsys)
        assert code == 2 and named in text and "Traceback" not in text, (argv[0], text)
        assert api_manifest.file_names(TRL_STEP)["payload"] in text, text
    assert not (tmp_path / "r" / "replay_metrics.json").exists()
