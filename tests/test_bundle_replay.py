"""Offline recompute and the first-divergence report on bundles built with BundleWriter.

Fixtures are written by :mod:`replayjob.bundle.synthetic`, whose recorded outputs come from the
trainer's own stage functions; faults are injected into exactly one recorded value or stage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from replayjob.bundle import replay_bundle
from replayjob.bundle.synthetic import make, write_rollout, write_step
from replayjob.cli import main


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    rc, out = _cli(capsys, *argv, "--json")
    return rc, json.loads(out)


def _status(report: dict[str, Any]) -> dict[str, str]:
    return {s["stage"]: s["status"] for s in report["stages"]}


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_every_estimator_replays_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str], estimator: str) -> None:
    extra = {"batch_adv_norm": True, "adv_clip": 1.5, "kl_reward_coef": 0.05, "token_cap": 25,
             "loss_agg": "seq-mean-token-mean", "kl_loss_coef": 0.1, "kl_kind": "k3"}
    for kw in ({}, extra):
        tag = "x" if kw else "d"
        rc, rep = _json(capsys, "bundle", "replay", str(write_rollout(tmp_path / f"r{tag}", estimator=estimator, **kw)))
        assert rc == 0 and rep["verdict"] == "pass"
        assert _status(rep) == {"sample": "skipped", "reward.raw": "pass", "reward.post_process": "pass",
                                "advantage.kl": "pass", "advantage.estimate": "pass"}
        rc, rep = _json(capsys, "bundle", "replay", str(write_step(tmp_path / f"s{tag}", estimator=estimator, **kw)))
        assert rc == 0 and _status(rep) == {"sample": "skipped", "loss.policy": "pass"}


def test_streaming_bug_is_reported_at_reward_post_process(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Groups split across two consumer batches, normalised against the physical batch."""
    p = write_rollout(tmp_path / "stream", streaming_bug=True, consumer_batches=2)
    rc, out = _cli(capsys, "bundle", "replay", str(p))
    assert rc == 1
    assert "first divergent stage: reward.post_process" in out
    rc, rep = _json(capsys, "bundle", "replay", str(p))
    assert rc == 1 and _status(rep)["reward.raw"] == "pass" and _status(rep)["reward.post_process"] == "fail"
    assert _status(rep)["advantage.estimate"] == "pass"  # it consumed the recorded (buggy) scores
    first = rep["first_divergence"]
    assert first["stage"] == "reward.post_process" and first["field"] == "scores"
    buggy, good = make(streaming_bug=True, consumer_batches=2), make()
    assert first["sample"] == "s-0" and first["token_offset"] is None
    assert first["expected"] == float(buggy.t["scores"][0]) and first["actual"] == float(good.t["scores"][0])
    field = rep["stages"][2]["fields"][0]
    affected = int((buggy.t["scores"] != good.t["scores"]).sum())
    assert field["mismatches"] == affected > 0
    assert len(field["examples"]) == 5 and all(e["abs_err"] > 0 for e in field["examples"])
    for ex in field["examples"]:
        i = int(ex["sample"].split("-")[1])
        assert (ex["expected"], ex["actual"]) == (float(buggy.t["scores"][i]), float(good.t["scores"][i]))
    rc, rep = _json(capsys, "bundle", "replay", str(p), "--examples", "8")
    assert len(rep["stages"][2]["fields"][0]["examples"]) == affected


def test_injected_advantage_error_names_sample_and_token(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    p = write_rollout(tmp_path / "inj", inject={"advantages": (5, 2, 0.5)})
    rc, rep = _json(capsys, "bundle", "replay", str(p))
    assert rc == 1
    assert _status(rep) == {"sample": "skipped", "reward.raw": "pass", "reward.post_process": "pass",
                            "advantage.kl": "pass", "advantage.estimate": "fail"}
    first = rep["first_divergence"]
    assert (first["stage"], first["sample"], first["field"], first["token_offset"]) == (
        "advantage.estimate", "s-5", "advantages", 2)
    assert first["abs_err"] == pytest.approx(0.5)
    rc, out = _cli(capsys, "bundle", "replay", str(p))
    assert "advantages s-5 token 2: expected=" in out
    assert _cli(capsys, "bundle", "replay", str(p), "--stage", "advantage.kl")[0] == 0  # others skipped


def test_non_finite_values_are_counted_never_matched(tmp_path: Path) -> None:
    p = write_rollout(tmp_path / "nan", inject={"kl": (1, 0, float("nan"))})
    rep = replay_bundle(p)
    first = rep.first_divergent
    assert first is not None and first.stage == "advantage.kl"
    assert first.fields[0].nonfinite == 1 and first.fields[0].mismatches == 1


def test_selection_expands_to_whole_groups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write_rollout(tmp_path / "sel", groups=3, inject={"scores": (7, 0, 1.0)})
    rc, rep = _json(capsys, "bundle", "replay", str(p), "--sample", "s-1")
    assert rc == 0 and rep["selection"]["rows"] == 4 and rep["selection"]["partial"]
    assert rep["stages"][1]["fields"][0]["compared"] == 4
    rc, rep = _json(capsys, "bundle", "replay", str(p), "--batch", "mb-0002")  # rows 6-8: groups g-1, g-2
    assert rc == 1 and rep["first_divergence"]["sample"] == "s-7" and rep["selection"]["rows"] == 8
    rc, rep = _json(capsys, "bundle", "replay", str(p), "--group", "g-2")
    assert rc == 0 and rep["selection"]["rows"] == 4
    s = write_step(tmp_path / "step", groups=3)
    rc, out = _cli(capsys, "bundle", "replay", str(s), "--group", "g-0")  # nothing left to compare: refused
    assert rc == 2 and "nothing to recompute" in out and "cohort-level stage under a partial selection" in out
    assert _json(capsys, "bundle", "replay", str(s), "--group", "g-0", "--group", "g-1", "--group", "g-2")[1][
        "stages"][1]["status"] == "pass"
    for argv, cause in ((["--sample", "s-99"], "no sample 's-99'"), (["--group", "g-9"], "no group 'g-9'"),
                        (["--batch", "mb-0099"], "no micro-batch 'mb-0099'"),
                        (["--stage", "loss.value"], "--stage must be")):
        rc, out = _cli(capsys, "bundle", "replay", str(p), *argv)
        assert rc == 2 and cause in out


def test_missing_group_membership_fails_closed_under_selection(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    p = write_rollout(tmp_path / "nogroup", groups_recorded=False)
    assert _cli(capsys, "bundle", "validate", str(p))[0] == 0
    rc, rep = _json(capsys, "bundle", "replay", str(p))
    assert rc == 0 and _status(rep)["reward.post_process"] == "skipped"
    rc, out = _cli(capsys, "bundle", "replay", str(p), "--sample", "s-1")
    assert rc == 2 and "missing group membership: sample 's-1'" in out
    rc, out = _cli(capsys, "bundle", "replay", str(p), "--batch", "mb-0000")
    assert rc == 2 and "missing group membership" in out


def test_capture_directory_picks_by_exact_identity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cap = tmp_path / "cap"
    write_rollout(cap / "rollout-000003")
    write_step(cap / "step-000003-000000", inject={"loss": (0, 0, 0.25)})
    rc, rep = _json(capsys, "bundle", "replay", str(cap), "--rollout", "3")
    assert rc == 0 and rep["kind"] == "rollout"
    rc, rep = _json(capsys, "bundle", "replay", str(cap), "--step", "3:0")
    assert rc == 1 and rep["kind"] == "step" and rep["first_divergence"]["stage"] == "loss.policy"
    for argv, cause in (([], "holds 2 matching bundles"), (["--step", "3:1"], "no bundle in the capture"),
                        (["--rollout", "4"], "no bundle in the capture"), (["--step", "3"], "ROLLOUT_ID:STEP_ID")):
        rc, out = _cli(capsys, "bundle", "replay", str(cap), *argv)
        assert rc == 2 and cause in out, out
    rc, out = _cli(capsys, "bundle", "replay", str(cap / "step-000003-000000"), "--rollout", "3")
    assert rc == 2 and "--rollout 3 does not match this step bundle" in out



@pytest.mark.parametrize(("damage", "cause"), [
    (b'{"index": ', "malformed JSON"),                      # truncated
    (b'{"index": {"kind": "rollout"}}', "KeyError"),       # no identity to match
    (None, "manifest.json is missing"),                     # missing: COMPLETE alone marks it a bundle
    # identities of the wrong type matched nothing and the candidate was skipped (a bool is not rollout 1)
    (b'{"index": {"kind": "rollout", "identity": {"rollout_id": true, "step_id": null}}}', "rollout_id True"),
    (b'{"index": {"kind": "Rollout", "identity": {"rollout_id": 3, "step_id": null}}}', "index.kind 'Rollout'"),
    (b'{"index": {"kind": "rollout", "identity": {"rollout_id": 3, "step_id": "0"}}}', "step_id '0'"),
])
def test_a_candidate_bundle_that_cannot_be_read_refuses_the_selector(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: bytes | None, cause: str) -> None:
    """Two bundles of rollout 3, one of which cannot be read: ``--rollout 3`` is refused naming it, never resolved
    to the other (skipping it would turn an ambiguous selector into an unambiguous pick)."""
    cap = tmp_path / "cap"
    write_rollout(cap / "rollout-000003", groups=2)
    write_rollout(cap / "rollout-000003-retry", groups=2, seed=5)
    manifest = cap / "rollout-000003-retry" / "manifest.json"
    if damage is None:
        manifest.unlink()
    else:
        manifest.write_bytes(damage)
    for selector in (["--rollout", "3"], ["--step", "3:0"]):
        rc, out = _cli(capsys, "bundle", "replay", str(cap), *selector)
        assert rc == 2 and "bundle 'rollout-000003-retry', whose manifest cannot be read" in out, out
        assert cause in out and "Traceback" not in out, out
    assert _cli(capsys, "bundle", "replay", str(cap / "rollout-000003"))[0] == 0  # its directory still replays

def test_incomplete_group_closure_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank shard holding half of a group cannot be normalised: refused, never guessed."""
    from replayjob.bundle.synthetic import Synthetic, _writer

    s: Synthetic = make()
    w = _writer(tmp_path / "half", s, "rollout", [0, 1, 2, 4, 5, 6, 7], None, None, True, None)
    rows = [0, 1, 2, 4, 5, 6, 7]
    for name in ("response_ids", "label_ids", "old_logprobs", "ref_logprobs"):
        w.write_payload(name, s.t[name][rows])
    w.set_expected("reward.raw", "raw", s.t["raw"][rows])
    w.set_expected("reward.post_process", "scores", s.t["scores"][rows])
    w.set_expected("advantage.kl", "kl", s.t["kl"][rows])
    w.set_expected("advantage.estimate", "advantages", s.t["advantages"][rows])
    from replayjob.errors import ContractError

    with pytest.raises(ContractError, match=r"group 'g-0' has 3 member\(s\)"):
        w.finalize()  # the writer runs the reader's group closure before it writes a byte
    assert not (tmp_path / "half").exists()  # a crafted one: test_bundle_checks.py, validate and replay refuse it



def test_a_linked_directory_in_a_capture_directory_is_never_read_to_match_a_selector(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A link to a bundle elsewhere beside the capture's own bundle: its manifest was read through the link to be
    matched (and, not matching, skipped in silence); a bundle is never read through a link, so the selection
    is refused, naming the link, as for any candidate whose manifest cannot be read."""
    cap = tmp_path / "cap"
    write_rollout(cap / "rollout-000003")
    elsewhere = write_rollout(tmp_path / "elsewhere" / "b")
    (cap / "linked").symlink_to(elsewhere, target_is_directory=True)
    rc, out = _cli(capsys, "bundle", "replay", str(cap), "--rollout", "3")
    assert rc == 2 and "Traceback" not in out and f"{cap / 'linked'}:" in out and "symbolic link" in out, out
    (cap / "linked").unlink()
    assert _cli(capsys, "bundle", "replay", str(cap), "--rollout", "3")[0] == 0
