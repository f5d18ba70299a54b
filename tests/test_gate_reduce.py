"""reduce over synthetic evidence (docs/replay-metrics.md files written by replayjob.gate.synthetic):
each claim's pass, and each failing case with its exit code and the failing check named."""

from __future__ import annotations

import dataclasses
import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from replayjob.cli import main
from replayjob.gate import synthetic
from replayjob.gate.reducer import Request, reduce_evidence
from replayjob.jsonio import pretty_bytes
from replayjob.runtime.knobs import GRADIENT_CHECKPOINTING as GC_KEY

OFF, ON = "baseline", "gradient_checkpointing=true"
ARMS: dict[str, dict[str, Any]] = {OFF: {}, ON: {GC_KEY: True}}


@pytest.fixture
def ev(tmp_path: Path) -> synthetic.Evidence:
    return synthetic.build(tmp_path / "ev", ARMS, 3)


def reduce(ev: synthetic.Evidence, claim: str, *extra: str, source: bool = True) -> tuple[int, dict[str, Any]]:
    out = ev.root.parent / "out" / f"{claim}.json"
    argv = ["reduce", str(ev.root / "replays"), "--claim", claim, "--out", str(out), *extra]
    if source:
        argv += ["--source", str(ev.source)]
    code = main(argv)
    doc = json.loads(out.read_text())
    assert doc["exit_code"] == code
    return code, doc


def check(doc: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in doc["checks"] if c["name"] == name]
    assert len(found) == 1, name
    return found[0]


def edit(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_bytes(pretty_bytes(doc))


def test_exact_input_and_bitwise_pass_with_spread(ev: synthetic.Evidence) -> None:
    for claim in ("exact-input", "bitwise"):
        code, doc = reduce(ev, claim, "--baseline", OFF)
        assert code == 0, doc["failed_checks"]
        assert doc["status"] == "pass" and doc["admission"] == "admitted"
        assert all(c["status"] in ("pass", "not_applicable") for c in doc["checks"])
    stats = doc["arms"][ON]["stats"]["local_train_wall_s"]
    assert stats["n"] == 3 and stats["min"] <= stats["median"] <= stats["max"] and stats["iqr"] >= 0
    ratio = doc["comparisons"]["ratios"][ON]["backward_wall_s"]
    assert ratio["low"] <= ratio["ratio"] <= ratio["high"] and ratio["excludes_1"] is True
    assert all(r["path"].startswith("../ev/replays/") for r in doc["inputs"]["replays"])
    assert doc["inputs"]["source"]["path"] == "../ev/source/metrics.json"


def test_every_claim_without_source_is_refused(ev: synthetic.Evidence) -> None:
    # the initial adapter and the same-condition loss are compared with the source run's
    for claim in ("exact-input", "bitwise", "approximate"):
        code, doc = reduce(ev, claim, source=False)
        assert code == 2 and doc["status"] == "refused"
        assert "--source" in doc["refusal"]["message"], claim


def test_edited_logical_digest_fails(ev: synthetic.Evidence) -> None:
    edit(ev.replay_files[4], lambda d: d.update({"optimizer/logical_batch_sha256": "ab" * 32}))
    code, doc = reduce(ev, "exact-input", "--baseline", OFF)
    assert code == 1 and doc["status"] == "fail"
    c = check(doc, "exact.logical_batch")
    assert c["status"] == "fail" and c["offenders"] == [f"{ON}#1"]
    assert doc["failed_checks"] == ["exact.logical_batch"]
    assert doc["admission"] == "not admitted" and doc["comparisons"]["admission"] == "not admitted"
    assert main(["reduce", str(ev.root / "replays"), "--claim", "exact-input", "--source", str(ev.source),
                 "--out", str(ev.root.parent / "cli.json")]) == 1


def test_missing_sampling_skip_fails(ev: synthetic.Evidence) -> None:
    edit(ev.replay_files[0], lambda d: d.update({"skipped": ["dataset", "environment", "rollout"]}))
    code, doc = reduce(ev, "exact-input")
    assert code == 1
    c = check(doc, "exact.skipped")
    assert c["status"] == "fail" and c["observed"]["missing"] == {f"{OFF}#0": ["sampling"]}


def test_too_few_repeats_is_refused_but_still_written(tmp_path: Path) -> None:
    ev = synthetic.build(tmp_path / "ev", ARMS, {OFF: 3, ON: 2})
    code, doc = reduce(ev, "exact-input", "--min-repeats", "3")
    assert code == 2 and doc["status"] == "refused"
    c = check(doc, "inputs.min_repeats")
    assert c["status"] == "refused" and c["offenders"] == [ON] and c["observed"] == {OFF: 3, ON: 2}
    assert doc["arms"][ON]["stats"]["local_train_wall_s"]["n"] == 2
    code, _ = reduce(ev, "exact-input", "--min-repeats", "2")
    assert code == 0


@pytest.mark.parametrize("claim", ["exact-input", "bitwise"])
@pytest.mark.parametrize("alter", ["append", "delete", "source"])
def test_an_altered_final_adapter_is_refused_under_every_claim(ev: synthetic.Evidence, claim: str, alter: str) -> None:
    """A file that does not match its run's recorded hash is not evidence: refused (2), never graded."""
    adapter = (ev.source if alter == "source" else ev.replay_files[1].parent) / synthetic.ADAPTER
    if alter == "delete":
        adapter.unlink()
    else:
        adapter.write_bytes(adapter.read_bytes() + b"tampered")
    code, doc = reduce(ev, claim)
    assert code == 2 and doc["status"] == "refused"
    c = check(doc, "inputs.final_adapter_on_disk")
    assert c["status"] == "refused" and c["offenders"] == ["source" if alter == "source" else f"{OFF}#1"]
    assert doc["failed_checks"] == ["inputs.final_adapter_on_disk"]
    assert doc["admission"] == "not admitted"


@pytest.mark.parametrize("claim", ["exact-input", "bitwise"])
@pytest.mark.parametrize("content, needle", [
    (b"final adapter weights", "header declares"),  # raw bytes, no header
    (b"\x80\x04" + b"\x00" * 30, "pickle"),
    (synthetic.adapter_file(b"x" * 16)[:-4], "data section"),  # a truncated body: its spans do not fit
])
def test_a_final_adapter_that_is_not_safetensors_is_refused(tmp_path: Path, claim: str, content: bytes,
                                                            needle: str) -> None:
    """The hash the run recorded matches, but the bytes are not a valid safetensors file: refused (2), read by
    the one reader (tensorfile) without building a tensor."""
    ev = synthetic.build(tmp_path / "ev", ARMS, 3, final=lambda arm, i: content if (arm, i) == (ON, 2)
                         else synthetic.FINAL)
    code, doc = reduce(ev, claim)
    assert code == 2 and doc["status"] == "refused" and "inputs.final_adapter_on_disk" in doc["failed_checks"]
    c = check(doc, "inputs.final_adapter_on_disk")
    assert c["offenders"] == [f"{ON}#2"] and c["observed"]["mismatched"] == {}
    assert needle in c["observed"]["invalid"][f"{ON}#2"]


def test_adapters_are_hashed_on_several_threads_when_large(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scanned here (no worker), above the size threshold the files are hashed on several threads; the verdict is
    the same, a bad file still named."""
    from replayjob.gate import adapter_scans

    monkeypatch.setattr(adapter_scans, "PARALLEL_HASH_BYTES", 1)
    monkeypatch.setattr(adapter_scans, "_can_fork", lambda: False)
    ev = synthetic.build(tmp_path / "ev", ARMS, 3)
    assert reduce(ev, "bitwise")[0] == 0
    (ev.replay_files[4].parent / synthetic.ADAPTER).write_bytes(b"tampered")
    code, doc = reduce(ev, "exact-input")
    assert code == 2 and check(doc, "inputs.final_adapter_on_disk")["offenders"] == [f"{ON}#1"]


def test_differing_final_hashes_fail_bitwise_only(tmp_path: Path) -> None:
    ev = synthetic.build(tmp_path / "ev", ARMS, 3,
                         final=lambda arm, i: synthetic.adapter_file(f"weights {arm} {i}".encode()))
    assert reduce(ev, "exact-input")[0] == 0
    code, doc = reduce(ev, "bitwise")
    assert code == 1
    assert {"bitwise.final_within_arm", "bitwise.final_vs_source", "bitwise.final_across_arms"} <= set(
        doc["failed_checks"])


def test_unpinned_tolerances_are_refused(ev: synthetic.Evidence, tmp_path: Path) -> None:
    tol = tmp_path / "tol.toml"
    tol.write_text("update_cosine_min = 0.99\nrelative_delta_l2_max = 0.1\n")
    code, doc = reduce(ev, "approximate", "--tolerances", str(tol))
    assert code == 2 and check(doc, "inputs.tolerances_pinned")["status"] == "refused"
    code, doc = reduce(ev, "approximate")
    assert code == 2 and "tolerance file" in doc["refusal"]["message"]


@pytest.mark.parametrize("change, check_name", [
    (lambda d: d["runtime"].update({GC_KEY: False}), "exact.knobs_in_effect"),
    (lambda d: d["runtime"].update({"backend.options.attn_implementation": "sdpa"}), "exact.knobs_in_effect"),
    (lambda d: d["runtime"].update({"training.micro_batch_size": 8}), "exact.knobs_in_effect"),
    (lambda d: d.update({"observed_config_differences": [GC_KEY, "training.micro_batch_size"]}),
     "exact.config_differences"),
    (lambda d: d.update({"allowed_config_differences": []}), "exact.config_differences"),
    (lambda d: d.update({"knobs": {GC_KEY: False}}), "exact.arm_knobs"),
    (lambda d: d.update({"optimizer/local_effective_rows_sha256": "cd" * 32}), "exact.effective_rows"),
    (lambda d: d.update({"optimizer_batch/initial_adapter_sha256": "ef" * 32}), "exact.initial_adapter"),
])
def test_each_exact_input_check_can_fail(ev: synthetic.Evidence, change: Callable[[dict[str, Any]], None],
                                         check_name: str) -> None:
    edit(ev.replay_files[3], change)
    code, doc = reduce(ev, "exact-input")
    assert code == 1 and check(doc, check_name)["status"] == "fail"
    assert f"{ON}#0" in check(doc, check_name)["offenders"]


def test_loss_compared_only_within_the_same_condition(ev: synthetic.Evidence) -> None:
    edit(ev.replay_files[3], lambda d: d.update({"loss": 0.25}))  # checkpointing arm: not same-condition
    assert reduce(ev, "exact-input")[0] == 0
    edit(ev.replay_files[0], lambda d: d.update({"loss": 0.5000000000000001}))  # exact equality
    code, doc = reduce(ev, "exact-input")
    assert code == 1 and check(doc, "exact.loss_same_condition")["offenders"] == [f"{OFF}#0"]


def test_the_gradient_norm_is_compared_exactly_within_the_same_condition(ev: synthetic.Evidence) -> None:
    """Under the bitwise claim a same-condition replay reports the source's gradient norm bit for bit; another arm's
    norm is not compared (a systems knob may reduce it in another order), and the exact-input claim reads none."""
    edit(ev.replay_files[3], lambda d: d.update({"grad_norm": 0.75}))  # checkpointing arm: not same-condition
    assert reduce(ev, "bitwise")[0] == 0
    edit(ev.replay_files[1], lambda d: d.update({"grad_norm": 0.25000000000000006}))
    assert reduce(ev, "exact-input")[0] == 0
    code, doc = reduce(ev, "bitwise")
    c = check(doc, "bitwise.grad_norm_same_condition")
    assert code == 1 and c["status"] == "fail" and c["offenders"] == [f"{OFF}#1"], c
    edit(ev.replay_files[1], lambda d: d.update({"grad_norm": None, "nonfinite_outcome": ["grad_norm"]}))  # NaN
    assert check(reduce(ev, "bitwise")[1], "bitwise.grad_norm_same_condition")["offenders"] == [f"{OFF}#1"]


def test_the_gradient_norm_check_needs_a_source_norm(ev: synthetic.Evidence) -> None:
    from replayjob.gate import checks as claims
    from replayjob.gate import evidence

    source = evidence.read_source(ev.source)
    replays = [evidence.read_replay(f) for f in ev.replay_files]
    arms = claims.group_arms(replays)
    assert claims.grad_norm_check(arms, source).status == "pass"
    unrecorded = claims.grad_norm_check(arms, dataclasses.replace(source, grad_norm=None))
    assert unrecorded.status == "not_applicable" and "no finite gradient norm" in unrecorded.detail
    only_on = {ON: arms[ON]}
    assert claims.grad_norm_check(only_on, source).status == "not_applicable"


@pytest.mark.parametrize("change, says", [
    (lambda d: d.update({"final_adapter_sha256": "ab" * 32}), "`final_adapter_sha256`"),
    (lambda d: d.update({"initial_adapter_sha256": "ab" * 32}), "`initial_adapter_sha256`"),
    (lambda d: d.update({"steps_run": 3, "last_step": 2}), "`steps_run` is 3"),
    (lambda d: d.update({"last_step": -1}), "`last_step` is -1"),
])
def test_a_source_whose_own_records_disagree_with_its_pins_is_refused(ev: synthetic.Evidence,
                                                                       change: Callable[[dict[str, Any]], None],
                                                                       says: str) -> None:
    """A one-step capture's run is the captured update: the trainer's own records of its adapters and steps
    describe the same files and step as the capture's pins, so a source metrics file that says otherwise was
    edited (or assembled from two runs) and is refused before any check, naming the field."""
    edit(ev.source / "metrics.json", change)
    code, doc = reduce(ev, "exact-input")
    assert code == 2 and says in doc["refusal"]["message"], doc["refusal"]


def test_unchanged_final_adapter_fails(tmp_path: Path) -> None:
    ev = synthetic.build(tmp_path / "ev", ARMS, 3, initial=synthetic.adapter_file(b"same"),
                         final=synthetic.adapter_file(b"same"))
    code, doc = reduce(ev, "exact-input")
    assert code == 1 and len(check(doc, "exact.final_adapter_changed")["offenders"]) == 6


@pytest.mark.parametrize("text, needle", [
    ('{"schema": "replayjob.replay_metrics/v2", "schema": "x"}', "duplicate key"),
    ('{"loss": NaN}', "non-finite"),
    ("not json", "malformed JSON"),
    ('["a list"]', "expected a JSON object"),
])
def test_malformed_metrics_are_refused(ev: synthetic.Evidence, text: str, needle: str) -> None:
    ev.replay_files[2].write_text(text)
    code, doc = reduce(ev, "exact-input")
    assert code == 2 and doc["status"] == "refused" and needle in doc["refusal"]["message"]
    assert doc["refusal"]["where"].endswith("replay_metrics.json")


@pytest.mark.parametrize("key", ["timing", "pins", "final_adapter_path", "arm", "repeat_index"])
def test_missing_fields_are_refused(ev: synthetic.Evidence, key: str) -> None:
    edit(ev.replay_files[0], lambda d: d.pop(key))
    code, doc = reduce(ev, "exact-input")
    assert code == 2 and f"missing required field `{key}`" in doc["refusal"]["message"]


def test_arm_named_source_is_refused(ev: synthetic.Evidence) -> None:
    edit(ev.replay_files[0], lambda d: d.update({"arm": "source"}))
    code, doc = reduce(ev, "exact-input")
    assert code == 2 and "may not be 'source'" in doc["refusal"]["message"]


def test_escaping_adapter_path_is_refused(ev: synthetic.Evidence) -> None:
    edit(ev.replay_files[0], lambda d: d.update({"final_adapter_path": "../../x.safetensors"}))
    code, doc = reduce(ev, "bitwise")
    assert code == 2 and "relative path inside" in doc["refusal"]["message"]


def test_mixed_sources_are_refused(ev: synthetic.Evidence) -> None:
    edit(ev.replay_files[5], lambda d: d.update({"optimizer_batch/manifest_sha256": "12" * 32}))
    code, doc = reduce(ev, "exact-input")
    assert code == 2 and check(doc, "inputs.single_source")["offenders"] == [f"{ON}#2"]


def test_duplicate_repeat_index_is_refused(ev: synthetic.Evidence) -> None:
    edit(ev.replay_files[1], lambda d: d.update({"repeat_index": 0}))
    code, doc = reduce(ev, "exact-input")
    assert code == 2 and check(doc, "inputs.unique_repeats")["offenders"] == [f"{OFF}#0", f"{OFF}#0"]


def test_expected_arms_name_an_arm_whose_replays_all_failed(ev: synthetic.Evidence) -> None:
    code, doc = reduce(ev, "exact-input", "--arms", f"{OFF},{ON}")
    assert code == 0 and check(doc, "inputs.expected_arms")["status"] == "pass"
    assert doc["parameters"]["arms"] == [OFF, ON]
    for f in ev.replay_files:  # every replay of one arm refused: it left no metrics at all
        if json.loads(f.read_text())["arm"] == ON:
            f.unlink()
    code, doc = reduce(ev, "exact-input")
    assert code == 0 and check(doc, "inputs.expected_arms")["status"] == "not_applicable"  # invisible
    code, doc = reduce(ev, "exact-input", "--arms", f"{OFF},{ON}")
    assert code == 2 and doc["status"] == "refused"
    assert check(doc, "inputs.expected_arms")["offenders"] == [ON]
    assert check(doc, "inputs.min_repeats")["observed"] == {OFF: 3, ON: 0}
    code, doc = reduce(ev, "exact-input", "--arms", f"{OFF},{ON}", "--baseline", ON)  # named, not a usage error
    assert code == 2 and doc["refusal"] is None and check(doc, "inputs.expected_arms")["offenders"] == [ON]
    code, doc = reduce(ev, "exact-input", "--arms", "other")  # and an arm nobody named
    assert code == 2 and check(doc, "inputs.expected_arms")["offenders"] == [OFF, "other"]


@pytest.mark.parametrize("extra, source, needle", [
    (["--baseline", "nope"], True, "baseline arm 'nope'"),
    ([], False, "pass --source DIR"),
    (["--min-repeats", "0"], True, "--min-repeats"),
    (["--arms", f"{OFF},{OFF}"], True, "--arms must name distinct"),
    (["--arms", f"{OFF},"], True, "--arms must name distinct"),
])
def test_usage_refusals_write_a_refused_verdict(ev: synthetic.Evidence, extra: list[str], source: bool,
                                                needle: str) -> None:
    code, doc = reduce(ev, "bitwise", *extra, source=source)
    assert code == 2 and needle in doc["refusal"]["message"]


def test_no_metrics_found_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    out = tmp_path / "v.json"
    assert main(["reduce", str(tmp_path / "empty"), "--claim", "exact-input", "--out", str(out)]) == 2
    assert json.loads(out.read_text())["status"] == "refused"
    assert main(["reduce", str(tmp_path / "missing"), "--claim", "bogus", "--out", str(out)]) == 2


def test_report_tables_and_plot(ev: synthetic.Evidence) -> None:
    report = ev.root.parent / "rep" / "report.md"
    code, _ = reduce(ev, "exact-input", "--baseline", OFF, "--report", str(report))
    text = report.read_text()
    assert code == 0 and "| `exact.logical_batch` | exact-input | pass |" in text
    assert f"| local_train_wall_s | {ON} | 3 |" in text and "(admitted)" in text
    assert report.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_without_matplotlib_says_how_to_enable(ev: synthetic.Evidence,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # matplotlib is installed here; hiding it from the import system is the only way to run this path.
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib.figure", None)
    edit(ev.replay_files[0], lambda d: d.update({"skipped": []}))
    report = ev.root.parent / "rep" / "report.md"
    code, _ = reduce(ev, "exact-input", "--baseline", OFF, "--report", str(report))
    text = report.read_text()
    assert code == 1 and "pip install 'replayjob[plot]'" in text and not report.with_suffix(".png").exists()
    assert "not admitted" in text and "| `exact.skipped` | exact-input | FAIL |" in text


# -- forged or partial evidence: pins against the capture, intent from the plan --------------------

_PIN_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("replay", lambda d: d["pins"].update({"payload_spans_sha256": "ab" * 32}), f"{ON}#0 payload pin"),
    ("replay", lambda d: d["pins"].update({"expected_manifest_sha256": "ab" * 32}), f"{ON}#0 manifest pin"),
    ("replay", lambda d: d["pins"].update({"expected_logical_sha256": "ab" * 32}), f"{ON}#0 logical pin"),
    ("source", lambda d: d.update({"optimizer/logical_batch_sha256": "ab" * 32}), "source logical"),
    # (the run's own adapter records changed with them: a one-step source whose two records disagree is refused first)
    ("source", lambda d: d.update({"optimizer_batch/initial_adapter_sha256": "ab" * 32,
                                   "initial_adapter_sha256": "ab" * 32}), "source initial_adapter"),
    ("source", lambda d: d.update({"optimizer/local_effective_rows_sha256": "ab" * 32}), "source effective"),
    ("replay", lambda d: d.update({"optimizer_batch/manifest_sha256": "ab" * 32}), f"{ON}#0 manifest"),
    # the numbers the claims compare replays with: sealed in the manifest's outcome, pinned by every replay
    ("source", lambda d: d.update({"loss": 0.25}), "source loss"),
    ("source", lambda d: d.update({"grad_norm": 1.5}), "source grad_norm"),
    ("source", lambda d: d.update({"optimizer_batch/final_adapter_sha256": "ab" * 32,
                                   "final_adapter_sha256": "ab" * 32}), "source final_adapter"),
    # a replay of another producer: torch registers no knobs, so its runtime record is empty
    ("replay", lambda d: d.update({"framework": "torch", "runtime": {}}), f"{ON}#0 framework"),
    # a replay of another row count than the capture's did not consume that capture
    ("replay", lambda d: d["rows"].update(rows=d["rows"]["rows"] + 1), f"{ON}#0 rows"),
    # a replay of another step, or source metrics naming another step than their manifest's
    ("replay", lambda d: d.update({"step": 1}), f"{ON}#0 step"),
    ("source", lambda d: d.update({"step": 1}), "source step"),
    ("source", lambda d: d.update({"optimizer_batch/steps_not_captured": [0]}), "source steps_not_captured"),
    # the source config decides which arm is same-condition: edited to match an arm, it would turn a refusal into
    # a pass, so it is the one the manifest pins
    ("source", lambda d: d["config"]["backend"]["options"].update({"gradient_checkpointing": True}),
     "source config"),
    # compared by type all the way down: 0 is not false, 4.0 is not 4 (Python's == says they are)
    ("source", lambda d: d["config"]["backend"]["options"].update({"gradient_checkpointing": 0}), "source config"),
    ("source", lambda d: d["config"]["training"].update({"micro_batch_size": float(d["config"]["training"]
                                                                                  ["micro_batch_size"])}),
     "source config"),
]


@pytest.mark.parametrize("target, change, offender", _PIN_CASES)
def test_recorded_pins_are_checked_against_the_capture_manifest(ev: synthetic.Evidence, target: str,
                                                                change: Callable[[dict[str, Any]], None],
                                                                offender: str) -> None:
    edit(ev.replay_files[3] if target == "replay" else ev.source / "metrics.json", change)
    code, doc = reduce(ev, "exact-input")
    assert code == 2 and offender in check(doc, "inputs.capture_pins")["offenders"]


def test_every_row_of_the_capture_pins_check_has_a_failing_case(ev: synthetic.Evidence) -> None:
    # against a capture that matches nothing, every row the check has is an offender: each of them must
    # be one that a case above makes fail on its own (a row compared with itself could never fail)
    from replayjob.gate import checks as claims
    from replayjob.gate import evidence

    replay = evidence.read_replay(ev.replay_files[3])
    edit(ev.source / "metrics.json", lambda d: d.update({"step": 0, "optimizer_batch/steps_not_captured": [7]}))
    other: dict[str, Any] = {k: "cd" * 32 for k in ("manifest", "payload", "logical", "effective", "initial_adapter")}
    other["outcome"] = {"loss": 9.0, "grad_norm": 9.0, "final_adapter_sha256": "cd" * 32}
    check = claims.capture_pins_check([replay], evidence.read_source(ev.source),
                                      {**other, "framework": "x", "rows": replay.rows + 1, "step": 7,
                                       "config": {"other": True}})
    assert set(check.offenders) == {offender for *_, offender in _PIN_CASES}


def test_a_replaced_capture_manifest_is_refused(ev: synthetic.Evidence) -> None:
    manifest = next(ev.source.glob("*.manifest.json"))
    manifest.write_bytes(manifest.read_bytes().replace(b'"step":0', b'"step": 0'))
    code, doc = reduce(ev, "exact-input")
    assert code == 2 and "optimizer_batch/manifest_sha256" in doc["refusal"]["message"]


def test_only_the_named_capture_manifest_is_read(ev: synthetic.Evidence) -> None:
    # a FIFO cannot be hashed (reading it would block): the reducer must not touch other manifests
    import os

    os.mkfifo(ev.source / "optimizer_batch_step_000009.manifest.json")
    code, doc = reduce(ev, "exact-input")
    assert code == 0, doc.get("refusal") or doc["failed_checks"]


def spec_file(tmp_path: Path, arms: dict[str, dict[str, Any]]) -> Path:
    lines = ['name = "t"', 'image = "replayjob:0.1.0"', 'gpu_product = "x"', 'device = "cpu"']
    for arm, overrides in arms.items():
        lines.append(f'[arms."{arm}"]')
        lines += [f'"{k}" = {json.dumps(v)}' for k, v in overrides.items()]
    p = tmp_path / "ablation.toml"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_intent_comes_from_the_spec(tmp_path: Path) -> None:
    arms: dict[str, dict[str, Any]] = {"off": {}, "on": {GC_KEY: True}}
    ev = synthetic.build(tmp_path / "ev", arms, 3)
    code, doc = reduce(ev, "exact-input", "--spec", str(spec_file(tmp_path, arms)))
    assert code == 0, doc["failed_checks"]
    assert check(doc, "inputs.arm_plan")["status"] == "pass"
    assert doc["arms"]["on"]["plan"] == {GC_KEY: True} and doc["arms"]["on"]["intended_knobs"][GC_KEY] is True


def test_an_arm_launched_without_its_override_is_refused(tmp_path: Path) -> None:
    """The replays of arm "on" ran without the override (and agree among themselves, so nothing else
    notices): the plan says gradient checkpointing is on, so the evidence is refused."""
    ev = synthetic.build(tmp_path / "ev", {"off": {}, "on": {}}, 3)
    assert reduce(ev, "exact-input")[0] == 0  # without the plan the arm's own declaration is its intent
    code, doc = reduce(ev, "exact-input", "--spec", str(spec_file(tmp_path, {"off": {}, "on": {GC_KEY: True}})))
    assert code == 2 and check(doc, "inputs.arm_plan")["offenders"] == ["on#0", "on#1", "on#2"]
    # and the runtime observation says checkpointing was off, against the plan's intent
    assert check(doc, "exact.knobs_in_effect")["offenders"] == ["on#0", "on#1", "on#2"]


def test_spec_and_arms_must_agree(tmp_path: Path) -> None:
    ev = synthetic.build(tmp_path / "ev", {"off": {}, "on": {GC_KEY: True}}, 3)
    spec = spec_file(tmp_path, {"off": {}, "on": {GC_KEY: True}, "third": {}})
    code, doc = reduce(ev, "exact-input", "--spec", str(spec))
    assert code == 2 and check(doc, "inputs.expected_arms")["offenders"] == ["third"]
    code, doc = reduce(ev, "exact-input", "--spec", str(spec), "--arms", "off,on")  # a subset of the plan
    assert code == 0 and check(doc, "inputs.arm_plan")["status"] == "pass"
    code, doc = reduce(ev, "exact-input", "--spec", str(spec), "--arms", "off,on,fourth")
    assert code == 2 and "fourth, not among the spec's arms" in doc["refusal"]["message"]


def test_a_replay_that_observed_no_knobs_is_refused(ev: synthetic.Evidence) -> None:
    edit(ev.replay_files[0], lambda d: d.update({"runtime": {"gradient_checkpointing": False}}))
    code, doc = reduce(ev, "exact-input")
    assert code == 2 and "observed value of every registered knob" in doc["refusal"]["message"]



def test_plot_panels_are_in_human_units_and_never_empty(ev: synthetic.Evidence) -> None:
    """ms and MiB, and a measure that is zero in every replay (no padding) gets no panel."""
    from replayjob.gate.report import plot_panels

    _, doc = reduce(ev, "exact-input", "--baseline", OFF)
    replays = doc["inputs"]["replays"]
    for r in replays:
        r["measures"]["padding_fraction"] = 0.0
    panels = {m: (label, data) for m, label, data in plot_panels(doc)}
    assert "padding_fraction" not in panels and set(panels) == {
        "local_train_wall_s", "forward_wall_s", "backward_wall_s", "optimizer_wall_s", "peak_memory_bytes"}
    label, data = panels["local_train_wall_s"]
    assert label.endswith("(ms)") and panels["peak_memory_bytes"][0].endswith("(MiB)")
    assert sorted(v for vals in data for v in vals) == sorted(r["measures"]["local_train_wall_s"] * 1e3
                                                              for r in replays)


# -- evidence that contradicts itself is refused, never graded --------------------------------------

TWO = "two-ranks"
TWO_KNOBS: dict[str, Any] = {"distributed.world_size": 2, "distributed.strategy": "ddp"}


def _over_two_ranks(f: Path) -> None:
    """Rewrite one synthetic replay as a replay over two ranks: each rank's figures in its rank file, the
    merged figures and the ``distributed`` record in replay_metrics.json (as
    replayjob.producers.builtin.replay writes)."""
    from replayjob.artifacts.metrics import merge_ranks, rank_document, rank_file
    from replayjob.digest import sha256_bytes

    doc = json.loads(f.read_text())
    ranks = []
    for r in range(2):
        pad = {"real_tokens": 240, "padded_tokens": 272, "padding_fraction": 1 - 240 / 272, "micro_batches": 2}
        timed = {**doc, "timing": {k: v * (1 + r / 10) for k, v in doc["timing"].items()}}
        ranks.append(rank_document(rank=r, world_size=2, replay=timed, rows=[8 * r, 8 * r + 8],
                                   shard_logical=f"{r}" * 64, shard_effective=f"{r + 2}" * 64, loss=doc["loss"] / 2,
                                   micro_batch_rows=[4, 4], padding=pad))
    shas = []
    for r, rdoc in enumerate(ranks):
        data = pretty_bytes(rdoc)
        (f.parent / rank_file(r)).write_bytes(data)
        shas.append(sha256_bytes(data))
    doc.update(merge_ranks(ranks))
    doc["distributed"] = {"world_size": 2, "strategy": "ddp", "sharding": "contiguous",
                          "ranks": [{"rank": r, "file": rank_file(r), "sha256": shas[r], "rows": ranks[r]["rows"]}
                                    for r in range(2)]}
    f.write_bytes(pretty_bytes(doc))


@pytest.fixture
def ranked(tmp_path: Path) -> synthetic.Evidence:
    """A same-condition arm and an arm whose replays each ran over two ranks (DDP)."""
    ev = synthetic.build(tmp_path / "ev", {OFF: {}, TWO: TWO_KNOBS}, 3)
    for f in ev.replay_files[3:]:
        _over_two_ranks(f)
    return ev


def _rank_file_copy(d: Path) -> None:
    (d / "replay_metrics.rank-2.json").write_bytes((d / "replay_metrics.rank-1.json").read_bytes())


@pytest.mark.parametrize("damage, needle", [
    # the record says two ranks, the runtime record one: graded on the runtime alone this failed (1)
    (lambda f: edit(f, lambda d: d["runtime"].update({"distributed.world_size": 1})),
     "'runtime.distributed.world_size' is 1, but the replay's 'distributed' record says 2 rank(s)"),
    (lambda f: edit(f, lambda d: d["runtime"].update({"distributed.strategy": "fsdp2"})),
     "'runtime.distributed.strategy' is 'fsdp2', but the replay's 'distributed' record says 'ddp'"),
    # the record deleted: its rank files were left unread and the replay passed (0)
    (lambda f: edit(f, lambda d: d.pop("distributed")),
     "'distributed' is absent (one process), but the rank files beside the replay are "
     "replay_metrics.rank-0.json, replay_metrics.rank-1.json"),
    # ... and the runtime record made to agree with the deletion: graded on the knobs (1)
    (lambda f: edit(f, lambda d: (d.pop("distributed"), d["runtime"].update({"distributed.world_size": 1}))),
     "'distributed' is absent (one process), but the rank files beside"),
    # a third rank file beside a two-rank replay
    (lambda f: _rank_file_copy(f.parent),
     "'distributed' records 2 ranks (replay_metrics.rank-0.json, replay_metrics.rank-1.json), but the rank files "
     "beside the replay are replay_metrics.rank-0.json, replay_metrics.rank-1.json, replay_metrics.rank-2.json"),
    # rank files beside a replay of one process
    (lambda f: (f.parent / "replay_metrics.rank-0.json").write_text("{}"),
     "'distributed' is absent (one process), but the rank files beside the replay are replay_metrics.rank-0.json"),
], ids=["runtime-world", "runtime-strategy", "record-deleted", "record-and-runtime", "extra-rank-file",
        "rank-file-beside-one-process"])
def test_a_replay_whose_world_size_contradicts_itself_is_refused(ranked: synthetic.Evidence,
                                                                 damage: Callable[[Path], Any], needle: str) -> None:
    assert reduce(ranked, "exact-input")[0] == 0  # intact: the ranks merge into each replay
    # replay_files: the baseline arm's three (one process each), then the two-rank arm's
    target = ranked.replay_files[1 if needle.endswith("are replay_metrics.rank-0.json") else 4]
    damage(target)
    code, doc = reduce(ranked, "exact-input")
    assert code == 2 and doc["status"] == "refused", doc["failed_checks"]
    assert needle in doc["refusal"]["message"] and "contradicts itself" in doc["refusal"]["message"]
    assert doc["refusal"]["where"] == str(target)


# -- the source numbers the claims compare with are pinned: sealed in the capture manifest -----------

def _cli(ev: synthetic.Evidence, claim: str, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    """reduce through the command line: exit code and what it printed (the refusal's message and hint)."""
    capsys.readouterr()
    code = main(["reduce", str(ev.root / "replays"), "--claim", claim, "--source", str(ev.source),
                 "--out", str(ev.root.parent / "cli.json"), *extra])
    out, err = capsys.readouterr()
    return code, out + err


def _replace_source_adapter(ev: synthetic.Evidence) -> None:
    """Another final adapter for the source, its file and the digest metrics.json reports changed together
    (consistent on disk, so inputs.final_adapter_on_disk cannot see it)."""
    from replayjob.digest import sha256_bytes

    data = b"another final adapter"
    (ev.source / synthetic.ADAPTER).write_bytes(data)
    edit(ev.source / "metrics.json", lambda d: d.update({"optimizer_batch/final_adapter_sha256": sha256_bytes(data),
                                                         "final_adapter_sha256": sha256_bytes(data)}))


@pytest.mark.parametrize("claim, change, field, before", [
    # graded before the seal: the loss edit failed exact.loss_same_condition (1), the gradient norm was never
    # compared (0), and a replaced final adapter failed bitwise.final_vs_source (1)
    ("exact-input", lambda ev: edit(ev.source / "metrics.json", lambda d: d.update({"loss": 0.25})),
     "metrics.json: loss is 0.25, the capture manifest seals 0.5", 1),
    ("exact-input", lambda ev: edit(ev.source / "metrics.json", lambda d: d.update({"grad_norm": 1.5})),
     "metrics.json: grad_norm is 1.5, the capture manifest seals 0.25", 0),
    ("exact-input", lambda ev: edit(ev.source / "metrics.json", lambda d: d.pop("grad_norm")),
     "metrics.json: grad_norm is None, the capture manifest seals 0.25", 0),
    ("bitwise", _replace_source_adapter, "metrics.json: optimizer_batch/final_adapter_sha256 is '", 1),
], ids=["loss", "grad-norm", "grad-norm-deleted", "final-adapter"])
def test_an_edited_source_number_is_refused_naming_the_file_and_field(
        ev: synthetic.Evidence, capsys: pytest.CaptureFixture[str], claim: str,
        change: Callable[[synthetic.Evidence], None], field: str, before: int) -> None:
    assert reduce(ev, claim)[0] == 0
    change(ev)
    code, doc = reduce(ev, claim)
    assert code == 2 and doc["status"] == "refused", (before, doc["failed_checks"])
    c = check(doc, "inputs.capture_pins")
    assert c["status"] == "refused" and len(c["offenders"]) == 1 and c["offenders"][0].startswith("source ")
    assert c["expected"]["outcome"]["loss"] == 0.5 and c["expected"]["outcome"]["grad_norm"] == 0.25
    code, text = _cli(ev, claim, capsys)
    assert code == 2 and field in text and "inputs.capture_pins" in text, text


def _as_steps_source(ev: synthetic.Evidence, steps: tuple[int, ...] = (0, 3)) -> None:
    """The source as a run that captured chosen steps (docs/optimizer-batch.md): its one-step pins moved into
    step 0's record under optimizer_batch/steps, and a record for another step beside it."""
    def move(d: dict[str, Any]) -> None:
        record = {"step": 0, "manifest_path": d.pop("optimizer_batch/manifest_path"),
                  "manifest_sha256": d.pop("optimizer_batch/manifest_sha256"),
                  "logical_batch_sha256": d.pop("optimizer/logical_batch_sha256"),
                  "local_effective_rows_sha256": d.pop("optimizer/local_effective_rows_sha256"),
                  "initial_adapter_sha256": d.pop("optimizer_batch/initial_adapter_sha256"),
                  "final_adapter_sha256": d.pop("optimizer_batch/final_adapter_sha256"),
                  "replay_config": "replay_step_000000.toml", "nonfinite_inputs": False,
                  "loss": d["loss"], "grad_norm": d["grad_norm"]}
        d["optimizer_batch/steps"] = [{**record, "step": k} for k in steps]
    edit(ev.source / "metrics.json", move)


def test_an_edited_step_record_is_refused_naming_the_record(ev: synthetic.Evidence,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    _as_steps_source(ev, (0,))
    assert reduce(ev, "bitwise", "--source-step", "0")[0] == 0
    edit(ev.source / "metrics.json", lambda d: d["optimizer_batch/steps"][0].update({"loss": 0.75}))
    code, doc = reduce(ev, "bitwise", "--source-step", "0")
    assert code == 2 and check(doc, "inputs.capture_pins")["offenders"] == ["source loss"]  # graded 1 before
    code, text = _cli(ev, "bitwise", capsys, "--source-step", "0")
    assert code == 2 and "metrics.json: optimizer_batch/steps[0].loss is 0.75, the capture manifest seals 0.5" in text


def test_a_capture_manifest_that_seals_nothing_is_refused(ev: synthetic.Evidence,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A manifest without ``outcome`` (written before the seal) pins none of the source numbers: the evidence is
    refused, whatever the numbers say (every pin renewed, so nothing else differs)."""
    from replayjob.artifacts import capture_manifest as mf
    from replayjob.digest import sha256_bytes
    from replayjob.jsonio import canonical_bytes

    path = ev.source / mf.manifest_name(0)
    doc = json.loads(path.read_bytes())
    doc.pop("outcome")
    data = canonical_bytes(doc) + b"\n"
    path.write_bytes(data)
    sha = sha256_bytes(data)
    edit(ev.source / "metrics.json", lambda d: d.update({"optimizer_batch/manifest_sha256": sha}))
    for f in ev.replay_files:
        edit(f, lambda d: (d.update({"optimizer_batch/manifest_sha256": sha}),
                           d["pins"].update({"expected_manifest_sha256": sha})))
    code, doc = reduce(ev, "exact-input")
    c = check(doc, "inputs.capture_pins")
    assert code == 2 and c["expected"]["outcome"] is None
    assert c["offenders"] == ["source loss", "source grad_norm", "source final_adapter"]
    code, text = _cli(ev, "exact-input", capsys)
    assert code == 2 and "metrics.json: loss, metrics.json: grad_norm, metrics.json: optimizer_batch/final_adapter_" \
        "sha256: pinned by nothing, the capture manifest seals no outcome" in text, text


# -- claims that cannot apply are refused, naming what would apply ----------------------------------

def test_a_declared_stack_difference_is_refused_under_exact_claims(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    ev = synthetic.build(tmp_path / "ev", {OFF: {}, "new-trl": {"stack.trl": "1.16.0"}}, 3)
    for claim in ("exact-input", "bitwise"):
        code, doc = reduce(ev, claim)  # graded 1 (exact.systems_only failed) before
        c = check(doc, "exact.systems_only")
        assert code == 2 and c["status"] == "refused" and "--claim approximate" in c["detail"], claim
        assert c["offenders"] == ["new-trl#0", "new-trl#1", "new-trl#2"]
        code, text = _cli(ev, claim, capsys)
        assert code == 2 and "reduce with --claim approximate" in text


def test_only_arms_off_the_source_conditions_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ev = synthetic.build(tmp_path / "ev", {ON: {GC_KEY: True}}, 3)
    code, doc = reduce(ev, "exact-input")  # graded 1 (exact.loss_same_condition failed) before
    c = check(doc, "exact.loss_same_condition")
    assert code == 2 and c["status"] == "refused" and c["observed"]["members"] == ["source"]
    assert "add an arm that replays under the source's own conditions" in c["detail"]
    code, text = _cli(ev, "exact-input", capsys)
    assert code == 2 and "add an arm replayed under the source's own conditions" in text


# -- hints point at the fix ------------------------------------------------------------------------

def test_an_unknown_arm_name_says_the_arm_does_not_exist(ev: synthetic.Evidence,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, text = _cli(ev, "exact-input", capsys, "--arms", f"{OFF},{ON},ckpt-of")
    assert code == 2
    assert f"--arms names ckpt-of, but no replay has that arm: it does not exist among the arms found ({OFF}, {ON})" \
        in text, text
    assert "run more fresh replays" not in text  # it was the only hint before
    edit(ev.replay_files[5], lambda d: d.update({"repeat_index": 7}))  # an arm that exists but is short stays so
    code, text = _cli(ev, "exact-input", capsys, "--min-repeats", "4", "--arms", f"{OFF},{ON}")
    assert code == 2 and "run more fresh replays" in text and "does not exist" not in text


def test_a_several_step_source_without_source_step_says_which_steps(ev: synthetic.Evidence,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    _as_steps_source(ev, (0, 3))
    code, doc = reduce(ev, "exact-input")
    msg, hint = doc["refusal"]["message"], doc["refusal"]["hint"]
    assert code == 2 and "captured several steps (0, 3)" in msg and "--source-step K" in msg
    assert hint == "pass --source-step K with K the step the replays replayed (captured: 0, 3)"
    assert "rerun the replay" not in msg + hint and "is missing" not in msg  # what it said before
    code, doc = reduce(ev, "exact-input", "--source-step", "5")
    assert code == 2 and "(captured: 0, 3)" in doc["refusal"]["hint"]
    assert reduce(ev, "exact-input", "--source-step", "0")[0] == 0


RECORD = {"step": 2, "manifest_path": "m.json", "manifest_sha256": "d" * 64, "logical_batch_sha256": "e" * 64,
          "local_effective_rows_sha256": "f" * 64, "initial_adapter_sha256": "1" * 64,
          "final_adapter_sha256": "2" * 64, "replay_config": "replay_step_000002.toml", "nonfinite_inputs": False,
          "loss": 0.5, "grad_norm": 0.25}


@pytest.mark.parametrize("change, step, needle", [
    (lambda d: d.update(trust_me=True), None, "unknown field `trust_me`"),
    (lambda d: d.update(loss="0.5"), None, "field `loss`: expected `float | null`, got `str`"),
    (lambda d: d.update(loss=None), None, "field `loss` is missing or null: a one-step capture records it"),
    (lambda d: d.update(steps_run=True), None, "field `steps_run`: expected `int`, got `bool`"),
    (lambda d: d.update({"optimizer/logical_batch_sha256": "E" * 64}), None,
     "field `optimizer/logical_batch_sha256`: expected a SHA-256"),
    (lambda d: d.pop("optimizer_batch/manifest_path"), None, "field `optimizer_batch/manifest_path` is missing"),
    (lambda d: d.update({"optimizer_batch/manifest_path": ".."}), None, "field `optimizer_batch/manifest_path`"),
    (lambda d: d.update(final_adapter_path="../elsewhere"), None,
     "field `final_adapter_path` must be a relative path inside the run directory"),
    (lambda d: d.update(config=[]), None, "field `config`: expected `object`, got `array`"),
    (lambda d: d.update({"optimizer_batch/steps": [{**RECORD, "trust_me": 1}]}), 2,
     "field `optimizer_batch/steps[0]`: object contains unknown field `trust_me`"),
    (lambda d: d.update({"optimizer_batch/steps": [{**RECORD, "step": True}]}), 2,
     "field `optimizer_batch/steps[0].step`: expected `int`, got `bool`"),
    (lambda d: d.update({"optimizer_batch/steps": [RECORD, RECORD]}), 2,
     "`optimizer_batch/steps` must list distinct steps in ascending order"),
    (lambda d: d.update({"optimizer_batch/steps": [{**RECORD, "replay_config": "/etc/replay.toml"}]}), 2,
     "field `optimizer_batch/steps[0].replay_config` must be a relative path inside the run directory"),
])
def test_the_source_metrics_are_read_through_their_declaration(ev: synthetic.Evidence, change: Any,
                                                                step: int | None, needle: str) -> None:
    """The source's metrics.json (replayjob.artifacts.source_metrics): a wrong type, an unknown key, a one-step
    file without its pins or numeric loss, a step record that breaks its declaration, a path outside the run:
    each refused naming the file and the field."""
    from replayjob.errors import IntegrityError
    from replayjob.gate.evidence import read_source

    assert read_source(ev.source).loss == 0.5  # as written
    edit(ev.source / "metrics.json", change)
    with pytest.raises(IntegrityError) as info:
        read_source(ev.source, step)
    assert needle in info.value.message, info.value.message
    assert str(info.value.where).endswith("metrics.json")


def test_a_step_record_read_from_the_source_metrics(ev: synthetic.Evidence) -> None:
    from replayjob.gate.evidence import read_source

    edit(ev.source / "metrics.json", lambda d: d.update({"optimizer_batch/steps": [RECORD, {**RECORD, "step": 4}]}))
    got = read_source(ev.source, 4)
    assert (got.loss, got.grad_norm, got.final_adapter, got.record) == (0.5, 0.25, "2" * 64, "optimizer_batch/steps[1]")
    assert got.final_adapter_file is None and got.manifest_file == ev.source / "m.json"


def test_replays_that_pinned_a_budget_file_are_refused_without_it(ev: synthetic.Evidence) -> None:
    """A budget file pinned before the runs decides: reducing the replays without ``--budgets`` would pass what its
    bounds fail, so it is refused, naming the pinned digest."""
    for f in ev.replay_files:
        edit(f, lambda d: d.update(budgets_sha256="ab" * 32))
    code, doc = reduce(ev, "exact-input")
    assert code == 2 and "inputs.budgets_pinned" in doc["failed_checks"]
    assert check(doc, "inputs.budgets_pinned")["observed"] == {"pinned": ["ab" * 32]}


@pytest.mark.parametrize(("change", "rule"), [
    (lambda d: d["padding"].update(padding_fraction=0.9), "padding_fraction"),
    (lambda d: d["padding"].update(real_tokens=d["padding"]["padded_tokens"] + 1), "real_tokens"),
    (lambda d: d["memory"].update(kind="cuda_max_allocated"), "memory.kind"),
    (lambda d: d.update(device="cuda:0"), "host.device_type"),
    # the update's parts are measured inside it, and the update inside the replay's run
    (lambda d: d["timing"].update(local_train_wall_s=0.0009), "is longer than the update it is part of"),
    (lambda d: d["timing"].update(local_train_wall_s=max(v for k, v in d["timing"].items()
                                                         if k != "local_train_wall_s") + 0.001), "add up to"),
    (lambda d: d.update(wall_s=0.0), "`wall_s` (0.0 s), the whole replay, is shorter than its update"),
])
def test_a_replays_summaries_and_its_device_are_recomputed(ev: synthetic.Evidence, change: Callable[[Any], None],
                                                           rule: str) -> None:
    """The padding fraction from its token counts, and the device told by the replay, its host, its memory measure
    (CUDA's allocator peak only on a CUDA device): a file that contradicts itself is refused, naming the field."""
    edit(ev.replay_files[0], change)
    code, doc = reduce(ev, "exact-input")
    assert code == 2 and rule in doc["refusal"]["message"], doc["refusal"]


def test_an_unreadable_spec_is_refused_in_a_verdict(ev: synthetic.Evidence, tmp_path: Path) -> None:
    """Like every refusal with a writable --out: the verdict records it (exit 2), it is not only a message."""
    code, doc = reduce(ev, "exact-input", "--spec", str(tmp_path / "nope.toml"))
    assert code == 2 and doc["status"] == "refused" and "nope.toml" in json.dumps(doc["refusal"])



@pytest.mark.parametrize(("change", "named"), [
    (lambda d: d["memory"].update(kind="cuda_max_allocated"), "['memory.kind']"),
    (lambda d: d.update(rows=[8, 15], micro_batch_rows=[4, 3]), "['rows']"),
    (lambda d: d.update(loss="0.25"), "field `loss`"),
    (lambda d: d.update(micro_batch_rows=[999]), "`micro_batch_rows` [999] add up to 999 rows"),
])
def test_a_rank_file_is_read_through_its_declaration_and_belongs_to_its_replay(
        ranked: synthetic.Evidence, change: Callable[[dict[str, Any]], None], named: str) -> None:
    """A rank file re-pinned in its replay's record after a change is still read through its declaration, and its
    rows and memory measure must be those of the replay that lists it."""
    from replayjob.artifacts.metrics import rank_file
    from replayjob.digest import sha256_bytes

    f = ranked.replay_files[3]
    rank1 = f.parent / rank_file(1)
    edit(rank1, change)
    edit(f, lambda d: d["distributed"]["ranks"][1].update(sha256=sha256_bytes(rank1.read_bytes())))
    code, doc = reduce(ranked, "exact-input")
    assert code == 2 and named in doc["refusal"]["message"], doc["refusal"]


@pytest.mark.parametrize("end", [12, 99])
def test_the_ranks_rows_cover_the_replays_rows_exactly(ranked: synthetic.Evidence, end: int) -> None:
    """The ranks' shares tile the replayed rows from 0 to their count: a last share that stops short of the replay's
    row count, or runs past it, is refused (with the rank file re-pinned, so only this rule can refuse it)."""
    from replayjob.artifacts.metrics import rank_file
    from replayjob.digest import sha256_bytes

    f = ranked.replay_files[3]
    rank1 = f.parent / rank_file(1)
    begin = json.loads(rank1.read_text())["rows"][0]
    edit(rank1, lambda d: d.update(rows=[begin, end], micro_batch_rows=[end - begin]))
    edit(f, lambda d: d["distributed"]["ranks"][1].update(sha256=sha256_bytes(rank1.read_bytes()), rows=[begin, end]))
    code, doc = reduce(ranked, "exact-input")
    assert code == 2 and f"holds rows [0, {end})" in doc["refusal"]["message"], doc["refusal"]


@pytest.mark.parametrize("change, needle", [
    (lambda d: d["host"].update(gpu_product="H100"),
     "rank 1 ran on other hardware than its replay records: gpu_product"),
    (lambda d: d["host"].update(device_type="cuda"), "device_type 'cuda'"),
    (lambda d: d["host"].update(torch_version="0.0.1"), "torch_version '0.0.1'"),
])
def test_a_rank_file_is_read_whole_its_host_and_loss_included(ranked: synthetic.Evidence,
                                                             change: Callable[[dict[str, Any]], None],
                                                             needle: str) -> None:
    """inputs.same_hardware compares the replays' own host records, so each rank's must be its replay's hardware (a
    rank on another GPU, torch or device went unseen)."""
    from replayjob.artifacts.metrics import rank_file
    from replayjob.digest import sha256_bytes

    f = ranked.replay_files[3]
    rank1 = f.parent / rank_file(1)
    edit(rank1, change)
    edit(f, lambda d: d["distributed"]["ranks"][1].update(sha256=sha256_bytes(rank1.read_bytes())))
    code, doc = reduce(ranked, "exact-input")
    assert code == 2 and needle in doc["refusal"]["message"] and rank_file(1) in doc["refusal"]["where"], \
        doc["refusal"]


@pytest.mark.parametrize("target", ["source", "replay", "adapter", "hardlink", "payload", "initial_adapter",
                                    "plot_path", "spec"])
def test_an_output_that_is_not_an_earlier_output_is_refused_and_the_file_kept(ev: synthetic.Evidence, tmp_path: Path,
                                                                             target: str) -> None:
    """--out or --report (or the plot beside it) naming a file reduce did not write -- evidence it reads (the capture
    payload and the initial adapter too, which no list of read files named), a hard link to some, or any other file
    -- is refused and the file left as it was; the two options naming one file are refused too."""
    import os

    spec = tmp_path / "spec.toml"
    spec.write_text('[experiment]\nname = "x"\n')
    victim = {"source": ev.source / "metrics.json", "replay": ev.replay_files[2],
              "adapter": ev.replay_files[2].parent / synthetic.ADAPTER, "hardlink": ev.replay_files[1],
              "payload": next(ev.source.glob("*.safetensors")), "initial_adapter": ev.initial_adapter,
              "plot_path": spec, "spec": spec}[target]
    out = victim
    if target == "hardlink":
        out = tmp_path / "verdict.json"
        os.link(victim, out)
    before = victim.read_bytes()
    option = "--report" if target in ("adapter", "initial_adapter", "plot_path") else "--out"
    argv = ["reduce", str(ev.root / "replays"), "--claim", "exact-input", "--source", str(ev.source)]
    if target == "plot_path":  # the report's plot would land on spec.png: make that the victim
        victim = tmp_path / "r.png"
        victim.write_bytes(before)
        out = tmp_path / "r.md"
    argv += ["--out", str(out)] if option == "--out" else ["--out", str(tmp_path / "v.json"), "--report", str(out)]
    assert main(argv) == 2
    assert victim.read_bytes() == before and not (tmp_path / "v.json").exists()
    same = ["reduce", str(ev.root / "replays"), "--claim", "exact-input", "--source", str(ev.source),
            "--out", str(tmp_path / "w.json"), "--report", str(tmp_path / "w.json")]
    assert main(same) == 2 and not (tmp_path / "w.json").exists()


def test_earlier_outputs_are_replaced_and_a_png_report_refused(ev: synthetic.Evidence, tmp_path: Path) -> None:
    """A verdict, report and plot of an earlier reduce are replaced by the next one (what --out and --report are for);
    a report named .png, the path of its own plot, is refused."""
    argv = ["reduce", str(ev.root / "replays"), "--claim", "exact-input", "--source", str(ev.source),
            "--out", str(tmp_path / "v.json"), "--report", str(tmp_path / "r.md")]
    assert main(argv) == 0
    (tmp_path / "v.json").write_text(json.dumps({"schema": "replayjob.verdict/v1", "status": "pass"}))  # older
    assert main(argv) == 0 and json.loads((tmp_path / "v.json").read_text())["status"] == "pass"
    assert (tmp_path / "r.md").read_text().startswith("# replayjob reduce: ")
    png = ["reduce", str(ev.root / "replays"), "--claim", "exact-input", "--source", str(ev.source),
           "--out", str(tmp_path / "w.json"), "--report", str(tmp_path / "r2.png")]
    assert main(png) == 2 and not (tmp_path / "w.json").exists() and not (tmp_path / "r2.png").exists()


@pytest.mark.parametrize(("content", "ours"), [
    (b'{"schema": "replayjob.verdict/v2", "checks": [{"a": 1}]}', True),
    (b'{"checks": [], "schema": "replayjob.verdict/v1"}', True),  # an older verdict: replaced too
    (b'{"schema": "replayjob.replay_metrics/v2"}', False),
    (b'{"schema": "replayjob.verdictx/v2"}', False),
    (b'{"schema": 2}', False),
    (b'["replayjob.verdict/v2"]', False),
    (b'{"schema": "replayjob.verdict/v2", ', False),  # cut short: not JSON
    (b'{"schema": "replayjob.verdict/v2", "x": \xff}', False),  # not UTF-8
    (b'', False),
])
def test_only_a_verdict_file_is_an_earlier_verdict(tmp_path: Path, content: bytes, ours: bool) -> None:
    """``is_verdict_file`` reads a file's ``schema`` alone (a verdict of 10,000 replays is megabytes): a JSON object
    of a verdict schema, any version, and nothing else."""
    from replayjob.artifacts.verdict import is_verdict_file

    f = tmp_path / "v.json"
    f.write_bytes(content)
    assert is_verdict_file(f) is ours
    link = tmp_path / "link.json"
    link.symlink_to(f)
    assert is_verdict_file(link) is False  # never through a link


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_an_output_that_is_not_a_regular_file_is_left_alone(ev: synthetic.Evidence, tmp_path: Path,
                                                            kind: str) -> None:
    """A rename would replace a FIFO, device or link with a file (``--out /dev/null`` as root turned the device
    into a file): refused, the node kept."""
    import os
    import stat

    out = tmp_path / "out"
    if kind == "fifo":
        os.mkfifo(out)
    else:
        (tmp_path / "target.json").write_text("{}")
        out.symlink_to(tmp_path / "target.json")
    assert main(["reduce", str(ev.root / "replays"), "--claim", "exact-input", "--source", str(ev.source),
                 "--out", str(out)]) == 2
    mode = os.lstat(out).st_mode
    assert (stat.S_ISFIFO(mode) if kind == "fifo" else stat.S_ISLNK(mode))


def test_a_negative_zero_is_not_the_same_loss_bit_for_bit(tmp_path: Path) -> None:
    """"Exactly the same" is bit for bit: -0.0 equals 0.0 as a number, not as the bits a loss was computed to."""
    from replayjob.gate import checks as claims

    assert claims._same(0.0, 0.0) and not claims._same(-0.0, 0.0) and not claims._same(1, 1.0)
    ev = synthetic.build(tmp_path / "ev", ARMS, 3, loss=0.0)
    assert reduce(ev, "exact-input")[0] == 0
    edit(ev.replay_files[0], lambda d: d.update({"loss": -0.0}))
    code, doc = reduce(ev, "exact-input")
    assert code == 1 and check(doc, "exact.loss_same_condition")["offenders"] == [f"{OFF}#0"]


def test_in_process_repeats_that_did_not_reproduce_the_loss_fail_bitwise(ev: synthetic.Evidence) -> None:
    """Warm in-process repeats are repeats: a replay whose repeats did not reproduce its loss bit for bit is not
    repeatable, so the bitwise claim fails on it (the exact-input claim, about inputs, does not)."""
    record = {"warmup_updates": 1, "measured_updates": 2, "local_train_wall_s": [0.5, 0.5], "peak_bytes": [1, 1],
              "loss_equal": True}
    for f in ev.replay_files:
        edit(f, lambda d: d.update({"in_process": record}))
    assert reduce(ev, "bitwise")[0] == 0
    edit(ev.replay_files[4], lambda d: d.update({"in_process": {**record, "loss_equal": False}}))
    assert reduce(ev, "exact-input")[0] == 0
    code, doc = reduce(ev, "bitwise")
    c = check(doc, "bitwise.final_within_arm")
    assert code == 1 and c["offenders"] == [f"{ON}#1"] and c["observed"]["in_process_loss_differs"] == [f"{ON}#1"]


@pytest.mark.parametrize("arm", [" ", "a ", " a", "base\nline", "\x1b[31mred", "tab\there", "base\u200bline",
                                 "baseline\u202e", "line\u2028break", "end\n"])
def test_an_arm_name_with_control_characters_is_refused(ev: synthetic.Evidence, arm: str) -> None:
    """Arm names are printed in verdicts, reports and terminals: a newline or an escape sequence in one, or a character
    that is invisible or turns the text around (which shows one arm under another's name), is refused by the replay's
    reader and, before any work, by the replay's admission."""
    from replayjob.config.schema import OptimizerBatchConfig
    from replayjob.producers.admission import Refusals, check_pins

    edit(ev.replay_files[0], lambda d: d.update(arm=arm))
    code, doc = reduce(ev, "exact-input")
    assert code == 2 and "field `arm`" in doc["refusal"]["message"], doc["refusal"]
    out = Refusals()
    check_pins(OptimizerBatchConfig(arm=arm), out, {}, "m.json")
    assert any("control characters" in r for r in out.reasons), out.reasons
    clean = Refusals()
    check_pins(OptimizerBatchConfig(arm="gradient_checkpointing=true+micro_batch_size=2"), clean, {}, "m.json")
    assert not any("optimizer_batch.arm" in r for r in clean.reasons)


@pytest.mark.parametrize("enabled", [True, False])
def test_reduce_leaves_the_garbage_collector_as_it_found_it(tmp_path: Path, enabled: bool) -> None:
    """reduce pauses the cyclic collector while it reads; after a pass and after a refusal alike it is on again,
    unless the caller had it off."""
    ev = synthetic.build(tmp_path / "ev", {"a": {}, "b": {GC_KEY: True}}, 3)
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        for paths, status in (([str(ev.root / "replays")], "pass"), ([str(tmp_path / "no-such-dir")], "refused")):
            v = reduce_evidence(Request(paths, "exact-input", tmp_path / "v.json", source=ev.source, baseline="a"))
            assert v.status == status and gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
