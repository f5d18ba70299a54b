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
from replayjob.digest import sha256_bytes, sha256_json
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


def test_a_resealed_builtin_payload_bearing_no_loss_is_refused(
        workspace: Path, capture_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every loss weight 0 (each one inside its domain, the summary recomputed): no source step holds it, and its
    update changes nothing, so every arm's replay equalled every other's and a bitwise claim passed on nothing."""
    def edit(t: dict[str, torch.Tensor]) -> None:
        t["loss_weights"][:] = 0.0
    sets = _reseal_builtin(capture_dir, tmp_path / "src", edit)
    for argv in (["explain", str(workspace / "replay.toml"), *sets],
                 ["replay", str(workspace / "replay.toml"), *sets, "--out", str(tmp_path / "o")]):
        code, text = _outcome(argv, capsys)
        assert code == 2 and "the captured batch bears no loss" in text and "Traceback" not in text, (argv[0], text)
    assert not (tmp_path / "o").exists()


def _reseal_config(capture_dir: Path, d: Path, edit: Callable[[dict[str, Any]], None]) -> list[str]:
    """The built-in capture copied to ``d``, the source config its manifest records edited, its SHA-256 and the
    manifest pin recomputed."""
    sets = _reseal_builtin(capture_dir, d, lambda t: None)
    doc = json.loads((d / MANIFEST).read_text())
    edit(doc["config"]["resolved"])
    doc["config"]["sha256"] = sha256_json(doc["config"]["resolved"])
    raw = canonical_bytes(doc) + b"\n"
    (d / MANIFEST).write_bytes(raw)
    sets[3] = f'optimizer_batch.expected_manifest_sha256="{sha256_bytes(raw)}"'
    return sets


@pytest.mark.parametrize(("edit", "named"), [
    # keys the comparison with the replay's config ignores, read through the config schema all the same
    (lambda c: c["training"].update(max_steps=-5), "training.max_steps: must be >= 1"),
    (lambda c: c["optimizer_batch"].update(ring_size=-1), "optimizer_batch.ring_size: must be >= 0"),
    (lambda c: c["logging"].update(metadata={"a": 1}), "logging.metadata.a: expected a string"),
    # a dotted key flattens to the same comparison as the table it replaces
    (lambda c: c.update({"training.seed": c["training"].pop("seed")}), "unknown key 'training.seed'"),
    # a replay's config recorded as the source's
    (lambda c: c["training"].update(trainer="optimizer_replay"), "a capture is written by the source trainer"),
])
def test_a_resealed_source_config_no_source_run_holds_is_refused(
        edit: Callable[[dict[str, Any]], None], named: str, workspace: Path, capture_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    sets = _reseal_config(capture_dir, tmp_path / "src", edit)
    code, text = _outcome(["explain", str(workspace / "replay.toml"), *sets], capsys)
    assert code == 2 and named in text and "Traceback" not in text, text


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
    and effective digests, the manifest pin and the logical pin (:func:`_reseal_structure`, the entries as they
    were)."""
    return _reseal_structure(manifest, lambda tensors, doc: edit(tensors))


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


def _drop_last(t: dict[str, torch.Tensor], doc: dict[str, Any]) -> None:
    n = len(doc["micro_batches"]) - 1
    for k in [k for k in t if k.startswith(f"mb{n:04d}.")]:
        del t[k]
    doc["micro_batches"].pop()
    doc["micro_batches"][-1]["sync_gradients"] = True


def _retype(suffix: str, dtype: torch.dtype) -> Callable[[dict[str, torch.Tensor], dict[str, Any]], None]:
    def edit(t: dict[str, torch.Tensor], doc: dict[str, Any]) -> None:
        for k in [k for k in t if k.endswith(suffix)]:
            t[k] = t[k].to(dtype)
    return edit


def _narrow(suffix: str) -> Callable[[dict[str, torch.Tensor], dict[str, Any]], None]:
    def edit(t: dict[str, torch.Tensor], doc: dict[str, Any]) -> None:
        k = sorted(k for k in t if k.endswith(suffix))[0]
        t[k] = t[k][..., :-1].clone()
    return edit


def _unlisted(suffix: str) -> Callable[[dict[str, torch.Tensor], dict[str, Any]], None]:
    def edit(t: dict[str, torch.Tensor], doc: dict[str, Any]) -> None:
        for k in [k for k in t if k.endswith(suffix)]:
            del t[k]
    return edit


def _every_mb(**fields: Any) -> Callable[[dict[str, torch.Tensor], dict[str, Any]], None]:
    def edit(t: dict[str, torch.Tensor], doc: dict[str, Any]) -> None:
        for e in doc["micro_batches"]:
            e.update(fields)
    return edit


def _reseal_structure(manifest: Path, edit: Callable[[dict[str, torch.Tensor], dict[str, Any]], None]) -> list[str]:
    """As :func:`_reseal_api`, the forger also rewriting the manifest's micro-batch entries (their tensor specs
    recomputed from the edited tensors, the rows summary recomputed)."""
    doc = json.loads(manifest.read_text())
    p = manifest.parent / doc["files"]["payload"]["file"]
    tensors = {k: v.clone() for k, v in tensorfile.load(p).items()}
    edit(tensors, doc)
    p.write_bytes(safetensors_bytes(tensors, "replayjob-payload"))
    mbs = []
    for i, e in enumerate(doc["micro_batches"]):
        groups = []
        for g in ("inputs", "call"):
            held = {k[len(f"mb{i:04d}.{g}."):]: v for k, v in tensors.items() if k.startswith(f"mb{i:04d}.{g}.")}
            e[g]["tensors"] = {k: {"dtype": _microbatch.dtype_name(v), "shape": list(v.shape)} for k, v in held.items()}
            groups.append(held)
        rng = {k: tensors[f"mb{i:04d}.rng.{k}"] for k in e["rng"]}
        mbs.append(_microbatch.MicroBatch(groups[0], dict(e["inputs"]["values"]), groups[1], dict(e["call"]["values"]),
                                          rng, e["sync_gradients"], e["accumulation_steps"]))
    logical = _microbatch.logical_digest(mbs)
    doc["files"]["payload"].update(sha256=sha256_bytes(p.read_bytes()), size=p.stat().st_size)
    doc["rows"].update(_microbatch.rows_summary(mbs))
    doc.update(logical_batch_sha256=logical, local_effective_rows_sha256=_microbatch.effective_digest(mbs))
    raw = (json.dumps(doc, sort_keys=True) + "\n").encode()
    manifest.write_bytes(raw)
    return ["--set", f'optimizer_batch.replay_path="{manifest}"',
            "--set", f'optimizer_batch.expected_manifest_sha256="{sha256_bytes(raw)}"',
            "--set", f'optimizer_batch.expected_logical_sha256="{logical}"']


@pytest.mark.parametrize(("edit", "named"), [
    # one accumulation window: the loss divides by accumulation_steps, the gradients sync with the last call only
    (_every_mb(accumulation_steps=1, sync_gradients=True), "their accumulation_steps are [1] (each is the window's "
                                                           "length, 2)"),
    (_every_mb(sync_gradients=True), "synchronise gradients at [0, 1], but a window synchronises with its last"),
    (_drop_last, "lists 1 loss call(s) of one accumulation window, but their accumulation_steps are [2]"),
    # what TRL's loss reads: every required input, of its dtype kind, of shapes that fit together
    (_unlisted(".inputs.advantages"), "inputs.advantages is missing: the trl loss reads it from every micro-batch"),
    (_retype(".inputs.old_per_token_logps", torch.int64), "inputs.old_per_token_logps is int64, not one of"),
    (_retype(".inputs.completion_mask", torch.float32), "inputs.completion_mask is float32, not one of"),
    (_narrow(".inputs.completion_mask"), "inputs.completion_mask has shape [4, 5], not one of [R, C] (C=6, P=6, R=4)"),
    (_narrow(".inputs.advantages"), "inputs.advantages has shape [3], not one of [R] or [R, 1] or [R, C]"),
    # token ids index the vocabulary; a count is not negative
    (lambda t, d: _first(".inputs.completion_ids", -5)(t), "inputs.completion_ids holds -5 at row 0, position 0, "
                                                          "outside its domain: a token id is >= 0"),
    (lambda t, d: _first(".inputs.prompt_ids", 10**6)(t), "inputs.prompt_ids holds token id 1000000, beyond the base "
                                                         "model's vocabulary"),
    (lambda t, d: _first(".inputs.num_items_in_batch", -3)(t), "inputs.num_items_in_batch holds -3 at element 0, "
                                                               "outside its domain: a count is >= 0"),
    # the trainer's step counter: an integer the replay stands the trainer at
    (lambda t, d: d["framework_state"].update(global_step=1.0), "framework_state.global_step is 1.0"),
    (lambda t, d: d["framework_state"].pop("global_step"), "framework_state.global_step is missing"),
])
def test_a_resealed_trl_step_no_trainer_runs_is_refused_before_a_model_is_built(
        edit: Callable[[dict[str, torch.Tensor], dict[str, Any]], None], named: str, trl_capture: dict[str, Any],
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A TRL capture's micro-batches re-sealed into a step no GRPOTrainer runs (accumulation settings of another
    window, an input its loss reads missing or of another dtype or shape, token ids outside the vocabulary, a
    step counter of another type): admitted, the replay failed with exit 3 (a missing input, mismatched shapes,
    an id beyond the embedding) or replayed a gradient the step never had (accumulation steps of 1 doubled it).
    Refused by explain and replay alike (exit 2), no model built, nothing written."""
    refused_before_a_model(edit, named, trl_capture, tmp_path, capsys, monkeypatch)


def refused_before_a_model(edit: Callable[[dict[str, torch.Tensor], dict[str, Any]], None], named: str,
                           trl_capture: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the TRL capture re-sealed with ``edit`` (its tensors and manifest, every digest recomputed) is
    refused by explain and replay alike (exit 2, naming ``named``, no traceback), no model built, nothing written."""
    from conftest import TRL_STEP

    from replayjob.producers.trl import producer as trl_producer
    d = tmp_path / "cap"
    shutil.copytree(trl_capture["dir"], d, ignore=shutil.ignore_patterns("trainer"))
    sets = _reseal_structure(d / api_manifest.file_names(TRL_STEP)["manifest"], edit)

    def no_model(*a: Any, **k: Any) -> Any:
        raise AssertionError("a model was built")
    monkeypatch.setattr(trl_producer, "build_replay", no_model)
    for argv in (["explain", str(d / "replay.toml"), *sets],
                 ["replay", str(d / "replay.toml"), *sets, "--out", str(tmp_path / "r")]):
        code, text = _outcome(argv, capsys)
        assert code == 2 and named in text and "Traceback" not in text, (argv[0], text)
    assert not (tmp_path / "r" / "replay_metrics.json").exists()


def test_the_trl_layout_admits_what_trl_steps_hold() -> None:
    """Shapes a real step holds: per-token or per-row advantages, a sequence-level sampler ratio, boolean masks,
    RLOO's per-sequence old log-probabilities; a plain loop's inputs are its own loss's."""
    r, p, c = 3, 5, 7
    ok = {"prompt_ids": {"dtype": "int64", "shape": [r, p]}, "prompt_mask": {"dtype": "bool", "shape": [r, p]},
          "completion_ids": {"dtype": "int32", "shape": [r, c]}, "completion_mask": {"dtype": "int64", "shape": [r, c]},
          "advantages": {"dtype": "float32", "shape": [r]}, "num_items_in_batch": {"dtype": "int64", "shape": []},
          "importance_sampling_ratio": {"dtype": "float32", "shape": [r, 1]},
          "old_logps": {"dtype": "bfloat16", "shape": [r]}, "pixel_values": {"dtype": "float32", "shape": [9, 2]}}
    assert api_manifest.input_layout_reasons("trl", ok) == []
    assert api_manifest.input_layout_reasons("trl", {**ok, "advantages": {"dtype": "float32",
                                                                                   "shape": [r, c]}}) == []
    assert api_manifest.input_layout_reasons("torch", {"x": {"dtype": "float32", "shape": [1]}}) == []
    assert api_manifest.input_layout_reasons("trl", {**ok, "prompt_mask": {"dtype": "bool",
                                                                                    "shape": [r, p + 1]}}) == [
        f"inputs.prompt_mask has shape [{r}, {p + 1}], not one of [R, P] (P={p}, R={r})"]


def test_the_base_models_config_is_read_as_it_was_hashed(trl_capture: dict[str, Any], trl_base: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The base model's config.json, which the vocabulary and routing checks read, is the file hashed with the base
    model, read once: a config.json rewritten after the directory was hashed (another process changing it during
    the admission, simulated by rewriting it right after the real hashing) is refused (exit 2), never read as the
    captured one."""
    from replayjob.producers.api import admission as api_admission
    from replayjob.producers.api import files as api_files

    base = tmp_path / "base"
    shutil.copytree(trl_base, base)
    real = api_files.base_model_identity

    def hashed_then_rewritten(path: str | Path) -> dict[str, Any]:
        identity = real(path)
        doc = json.loads((base / "config.json").read_text())
        (base / "config.json").write_text(json.dumps({**doc, "vocab_size": 3}))  # every captured id beyond it
        return identity
    monkeypatch.setattr(api_admission._files, "base_model_identity", hashed_then_rewritten)
    code, text = _outcome(["explain", str(trl_capture["dir"] / "replay.toml"), "--set", f'model.path="{base}"'],
                          capsys)
    assert code == 2 and "changed while it was admitted" in text and "Traceback" not in text, text
    assert "beyond the base model's vocabulary" not in text  # the rewritten file was never read as the model's
