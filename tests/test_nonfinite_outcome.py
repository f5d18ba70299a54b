"""A replayed update that ends with a NaN or infinite loss or gradient norm: a finding, not input to refuse.

A knob that breaks the update's numbers (an overflow in a narrower dtype, a kernel) is exactly what the gate is
for.  The replay records the non-finite values as null and names them in ``nonfinite_outcome``
(docs/replay-metrics.md), and ``exact.finite_outcome`` fails the claim (exit 1).  Before, the replay refused
itself (exit 2, nothing written), so a cluster run read it as missing evidence ("incomplete", exit 3, retried)
and no verdict ever said the knob broke the update.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from replayjob.artifacts import metrics as metrics_io
from replayjob.cli import main
from replayjob.gate import checks as claims
from replayjob.gate import evidence, synthetic
from tests.test_gate_reduce import ARMS, OFF, ON, check, edit, reduce
from tests.test_hostile_start_states import _resealed_rows


def _broken(d: dict[str, Any], named: list[str]) -> None:
    d.update({k: None for k in named}, nonfinite_outcome=named)


def test_a_replay_whose_loss_is_not_finite_is_written_with_the_values_named(
        workspace: Path, capture_dir: Path, tmp_path: Path) -> None:
    # an old log-probability of -1e30 makes the importance ratio overflow: the loss and the norm are NaN
    cfg, logical, pin = _resealed_rows(workspace, capture_dir, tmp_path, "old_logprobs", lambda t: t.fill_(-1e30))
    out = tmp_path / "r"
    assert main(["replay", str(cfg), "--out", str(out), "--set", f'optimizer_batch.expected_logical_sha256="{logical}"',
                 "--set", f'optimizer_batch.expected_manifest_sha256="{pin}"']) == 0
    doc = json.loads((out / "replay_metrics.json").read_text())
    assert doc["loss"] is None and doc["grad_norm"] is None and doc["nonfinite_outcome"] == ["grad_norm", "loss"]
    replay = evidence.read_replay(out / "replay_metrics.json")  # the reader takes it, and the gate sees it
    assert replay.loss is None and replay.nonfinite == ("grad_norm", "loss")
    assert (out / doc[metrics_io.FINAL_ADAPTER_PATH]).is_file()


@pytest.mark.parametrize("claim", ["exact-input", "bitwise"])
def test_a_knob_that_breaks_the_update_fails_the_claim(tmp_path: Path, claim: str) -> None:
    ev = synthetic.build(tmp_path / "ev", ARMS, 3)
    edit(ev.replay_files[4], lambda d: _broken(d, ["grad_norm", "loss"]))  # the checkpointing arm's second replay
    code, doc = reduce(ev, claim)
    c = check(doc, "exact.finite_outcome")
    assert code == 1 and doc["status"] == "fail" and c["status"] == "fail", c
    assert c["offenders"] == [f"{ON}#1"] and c["observed"] == {"nonfinite": {f"{ON}#1": ["grad_norm", "loss"]}}


def test_a_nonfinite_loss_in_the_same_condition_also_fails_the_loss_comparison(tmp_path: Path) -> None:
    ev = synthetic.build(tmp_path / "ev", ARMS, 3)
    edit(ev.replay_files[0], lambda d: _broken(d, ["loss"]))
    code, doc = reduce(ev, "exact-input")
    assert code == 1 and check(doc, "exact.loss_same_condition")["offenders"] == [f"{OFF}#0"]
    assert check(doc, "exact.finite_outcome")["offenders"] == [f"{OFF}#0"]


def test_a_nonfinite_gradient_norm_is_judged_only_beside_a_finite_source_norm(tmp_path: Path) -> None:
    ev = synthetic.build(tmp_path / "ev", ARMS, 3)
    edit(ev.replay_files[3], lambda d: _broken(d, ["grad_norm"]))
    source = evidence.read_source(ev.source)
    replays = [evidence.read_replay(f) for f in ev.replay_files]
    assert claims.finite_outcome_check(replays, source).offenders == (f"{ON}#0",)
    assert claims.finite_outcome_check(replays, None).offenders == (f"{ON}#0",)
    # a source with no finite norm may have skipped its own update (an overflow a loss scaler skips)
    unrecorded = claims.finite_outcome_check(replays, dataclasses.replace(source, grad_norm=None))
    assert unrecorded.status == "pass" and unrecorded.expected == "a finite loss in every replay"
    assert check(reduce(ev, "exact-input")[1], "exact.finite_outcome")["status"] == "fail"


@pytest.mark.parametrize("change, says", [
    (lambda d: d.update(loss=None), "`loss` is null exactly when `nonfinite_outcome` names it"),
    (lambda d: d.update(nonfinite_outcome=["loss"]), "`loss` is null exactly when `nonfinite_outcome` names it"),
    (lambda d: d.update(nonfinite_outcome=["grad_norm"]), "`grad_norm` is null exactly when `nonfinite_outcome` names"),
    # a null norm not named: no producer writes it (each reports a norm), and exact-input passed it as "not recorded"
    (lambda d: d.update(grad_norm=None), "`grad_norm` is null exactly when `nonfinite_outcome` names it"),
    (lambda d: _broken(d, ["loss", "grad_norm"]), "at most once, sorted"),
    (lambda d: d.update(loss=None, grad_norm=None, nonfinite_outcome=["grad_norm", "loss", "loss"]),
     "nonfinite_outcome"),
    (lambda d: d.update(nonfinite_outcome=["timing"]), "nonfinite_outcome"),
    (lambda d: d.update(nonfinite_outcome="loss"), "nonfinite_outcome"),
])
def test_a_record_whose_nonfinite_names_disagree_with_its_values_is_refused(
        tmp_path: Path, change: Any, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    ev = synthetic.build(tmp_path / "ev", ARMS, 3)
    edit(ev.replay_files[2], change)
    capsys.readouterr()
    code, doc = reduce(ev, "exact-input")
    err = capsys.readouterr().err
    assert code == 2 and doc["status"] == "refused" and says in err and "Traceback" not in err, err


def test_ranks_merge_a_nonfinite_loss_as_null_and_name_it() -> None:
    docs = [{"loss": 0.25, "timing": {"a": 1.0}, "memory": {"peak_bytes": 1, "kind": "max_rss"},
             "padding": {"real_tokens": 1, "padded_tokens": 2, "micro_batches": 1}} for _ in range(2)]
    assert metrics_io.merge_ranks(docs)["loss"] == 0.5 and metrics_io.merge_ranks(docs)["nonfinite_outcome"] == []
    docs[1]["loss"] = None
    merged = metrics_io.merge_ranks(docs, ["grad_norm"])
    assert merged["loss"] is None and merged["nonfinite_outcome"] == ["grad_norm", "loss"]
    docs[0]["loss"], docs[1]["loss"] = 1e308, 1e308  # each finite, the sum is not
    assert metrics_io.merge_ranks(docs)["nonfinite_outcome"] == ["loss"]
    assert metrics_io.outcome_fields(float("nan"), float("inf")) == {
        "loss": None, "grad_norm": None, "nonfinite_outcome": ["grad_norm", "loss"]}
    assert metrics_io.outcome_fields(0.5, 0.25) == {"loss": 0.5, "grad_norm": 0.25, "nonfinite_outcome": []}


def test_a_rank_whose_loss_is_not_finite_makes_its_replay_fail_not_refused(tmp_path: Path) -> None:
    from replayjob.digest import sha256_bytes
    from tests.test_gate_reduce import TWO, TWO_KNOBS, _over_two_ranks

    ev = synthetic.build(tmp_path / "ev", {OFF: {}, TWO: TWO_KNOBS}, 3)
    for f in ev.replay_files[3:]:
        _over_two_ranks(f)
    f = ev.replay_files[3]
    rank1 = f.parent / metrics_io.rank_file(1)
    edit(rank1, lambda d: d.update(loss=None))
    edit(f, lambda d: d["distributed"]["ranks"][1].update(sha256=sha256_bytes(rank1.read_bytes())))
    code, doc = reduce(ev, "exact-input")  # the replay still says its loss is the ranks' finite sum
    assert code == 2 and "the replay's loss, nonfinite_outcome are not the merge of its ranks' figures" in \
        doc["refusal"]["message"], doc["refusal"]
    edit(f, lambda d: _broken(d, ["loss"]))  # as the replay writes it: null, and named
    code, doc = reduce(ev, "exact-input")
    assert code == 1 and check(doc, "exact.finite_outcome")["offenders"] == [f"{TWO}#0"]
