"""What ``bundle validate`` passes, ``bundle replay`` recomputes: the structural and range checks both share,
and the run id that ties a multi-rank bundle's ranks to one run (docs/bundle-format.md).

Every bundle here is synthetic (:mod:`replayjob.bundle.synthetic`) and is made bad the way a buggy producer or
a reused capture directory would make it: the manifest or the payload file rewritten and every digest that
pins it re-sealed, or two runs' ranks landing in one root.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from replayjob import tensorfile
from replayjob.bundle import format as fmt
from replayjob.bundle import inspect_path
from replayjob.bundle.reader import load_bundle
from replayjob.bundle.synthetic import _writer, make, write_rollout, write_step
from replayjob.bundle.writer import ENV_RUN_ID, BundleWriter, default_config, shared_run_id
from replayjob.cli import main
from replayjob.digest import sha256_bytes
from replayjob.errors import ConfigError, IntegrityError
from replayjob.jsonio import pretty_bytes


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


def _refused_by_both(capsys: pytest.CaptureFixture[str], target: Path, *needles: str) -> None:
    """``bundle validate`` and ``bundle replay`` refuse ``target`` with exit 2, one message naming every needle
    (and a hint), never a traceback."""
    for cmd in ("validate", "replay"):
        rc, out = _cli(capsys, "bundle", cmd, str(target))
        assert rc == 2, (cmd, rc, out)
        assert "Traceback" not in out and "error (exit 3" not in out, (cmd, out)
        assert "fix:" in out, (cmd, out)
        for needle in needles:
            assert needle in out, (cmd, needle, out)


def _seal(p: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest`` and a COMPLETE that records its digest."""
    data = pretty_bytes(manifest)
    (p / fmt.MANIFEST).write_bytes(data)
    c = json.loads((p / fmt.COMPLETE).read_text())
    (p / fmt.COMPLETE).write_bytes(pretty_bytes({**c, "manifest_sha256": sha256_bytes(data)}))


def _forge(p: Path, edit: Callable[[dict[str, Any]], None] | None = None,
           tensors: Callable[[dict[str, Tensor]], None] | None = None) -> None:
    """Rewrite a single bundle as a producer without the reader's checks would have written it: the manifest
    edited, the payload file re-encoded with edited tensors, every digest re-sealed."""
    m = json.loads((p / fmt.MANIFEST).read_text())
    if tensors is not None:
        payloads = {k: v.clone() for k, v in load_bundle(p).payloads.items()}
        tensors(payloads)
        enc = tensorfile.encode(payloads)
        (p / fmt.PAYLOAD_FILE).write_bytes(enc.data)
        for name, t in payloads.items():
            m["payloads"][name].update(dtype=tensorfile.safetensors_name(t.dtype), shape=list(t.shape),
                                       sha256=enc.tensor_sha256[name].hex())
        m["payload_file"].update(bytes=len(enc.data), header_sha256=enc.header_sha256.hex())
    if edit is not None:
        edit(m)
    _seal(p, m)


# ------------------------------------------- a root's records about its ranks are compared with every rank
def _two_rank_root(tmp_path: Path, kind: str) -> Path:
    root = tmp_path / "mr"
    for r in (1, 0):
        (write_rollout if kind == "rollout" else write_step)(root, rank=r, ranks=[0, 1], groups=4, run_id="run-a")
    return root


def _root_files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}


def _substitute(tmp_path: Path, root: Path, rank: int, kind: str) -> str:
    """``rank-<rank>/`` replaced by a single bundle (``multi_rank`` null) of other rows, sealed by its own COMPLETE
    and made to look like the root's wherever a rank is compared with a rank (format 2.2.0, the root's bundle id,
    sample and group ids of its own); the root and its landing records are left as they landed.  Returns the
    substitute's manifest SHA-256."""
    other = tmp_path / f"other-{rank}"
    (write_rollout if kind == "rollout" else write_step)(other, groups=2, seed=7 + rank)
    bundle_id = json.loads((root / fmt.COMPLETE).read_text())["bundle_id"]
    m = json.loads((other / fmt.MANIFEST).read_text())
    m.update(format_version=fmt.MULTI_RANK_VERSION, bundle_id=bundle_id)
    m["index"]["bundle_id"] = bundle_id
    for s in m["index"]["samples"]:
        s.update(sample_id=f"x{rank}-{s['sample_id']}", group=f"x{rank}-{s['group']}")
    c = json.loads((other / fmt.COMPLETE).read_text())
    (other / fmt.COMPLETE).write_bytes(pretty_bytes({**c, "bundle_id": bundle_id}))
    _seal(other, m)
    assert load_bundle(other).manifest["multi_rank"] is None  # a valid bundle on its own
    shutil.rmtree(root / f"rank-{rank}")
    shutil.copytree(other, root / f"rank-{rank}")
    return sha256_bytes((root / f"rank-{rank}" / fmt.MANIFEST).read_bytes())


def _repin(root: Path, rank: int) -> None:
    """The root COMPLETE and COMPLETE.<rank> rewritten to record rank-<rank>/'s manifest as it now is."""
    sha = sha256_bytes((root / f"rank-{rank}" / fmt.MANIFEST).read_bytes())
    rec = json.loads((root / f"{fmt.COMPLETE}.{rank}").read_text())
    (root / f"{fmt.COMPLETE}.{rank}").write_bytes(pretty_bytes({**rec, "manifest_sha256": sha}))
    doc = json.loads((root / fmt.COMPLETE).read_text())
    doc["rank_manifests"][str(rank)] = sha
    (root / fmt.COMPLETE).write_bytes(pretty_bytes(doc))


@pytest.mark.parametrize("kind", ["rollout", "step"])
def test_a_rank_directory_replaced_by_another_bundle_is_refused_naming_both_digests(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    """The root COMPLETE and COMPLETE.<r> record every rank's manifest SHA-256: it is compared with every rank's
    manifest bytes, whatever that manifest says it is, so a rank directory swapped for an ordinary bundle (its own
    COMPLETE intact) is refused, the root passed or the rank alone."""
    root = _two_rank_root(tmp_path, kind)
    landed = _root_files(root)
    pinned = json.loads((root / fmt.COMPLETE).read_text())["rank_manifests"]["1"]
    actual = _substitute(tmp_path, root, 1, kind)
    assert _root_files(root) == landed and actual != pinned
    _refused_by_both(capsys, root, "rank 1's manifest is not the one its root recorded", actual, pinned)
    rc, out = _cli(capsys, "bundle", "validate", str(root / "rank-1"))
    assert rc == 2 and actual in out and pinned in out and "Traceback" not in out, out
    problems = inspect_path(root)["problems"]  # inspect never refuses: it lists what validate refuses
    assert f"rank 1's manifest.json has SHA-256 {actual}, the root COMPLETE records {pinned}" in problems, problems
    assert "rank-1 holds a single bundle (multi_rank null), not a rank of this root" in problems, problems


def _every_rank_renamed(root: Path) -> None:
    for r in (0, 1):
        d = root / f"rank-{r}"
        m = json.loads((d / fmt.MANIFEST).read_text())
        m["bundle_id"] = m["index"]["bundle_id"] = "another-bundle"
        c = json.loads((d / fmt.COMPLETE).read_text())
        (d / fmt.COMPLETE).write_bytes(pretty_bytes({**c, "bundle_id": "another-bundle"}))
        _seal(d, m)
        _repin(root, r)


@pytest.mark.parametrize(("kind", "tamper", "needles"), [
    ("rollout", "single", ("rank 1's directory holds a single bundle (multi_rank null)",)),
    ("step", "single", ("rank 1's directory holds a single bundle (multi_rank null)",)),
    ("rollout", "renamed", ("rank 0's manifest names bundle 'another-bundle'", "rollout-000003")),
])
def test_a_rank_manifest_must_be_its_root_s_rank_even_when_the_records_pin_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, tamper: str,
        needles: tuple[str, ...]) -> None:
    """Landing records rewritten to pin whatever the rank directories now hold: a rank directory whose manifest is
    not a rank manifest of this root (``multi_rank`` null; a bundle id that is not the root's) is still refused."""
    root = _two_rank_root(tmp_path, kind)
    if tamper == "single":
        _substitute(tmp_path, root, 1, kind)
        _repin(root, 1)
    else:
        _every_rank_renamed(root)
    _refused_by_both(capsys, root, *needles)
    rc, out = _cli(capsys, "bundle", "validate", str(root / f"rank-{1 if tamper == 'single' else 0}"))
    assert rc == 2 and needles[0] in out and "Traceback" not in out, out


# --------------------------------------------------------------------- class 5: validate == replay's checks
def _config(**values: Any) -> Callable[[dict[str, Any]], None]:
    return lambda m: m["index"]["config"].update(values)


def _move_sample_to_group_one(m: dict[str, Any]) -> None:
    m["index"]["samples"][0]["group"] = "g-1"  # groups of 3 and 5, samples_per_prompt 4


def _max_operand(value: int) -> Callable[[dict[str, Any]], None]:
    return lambda m: m["index"]["config"]["task"].update(max_operand=value)


def _fractional_response_ids(t: dict[str, Tensor]) -> None:
    t["response_ids"] = t["response_ids"].to(torch.float64) + 0.5


def _negative_label_id(t: dict[str, Tensor]) -> None:
    """Sample 0's label gets one more id, -1: the byte decoder would drop it and the reward pass."""
    labels = torch.nn.functional.pad(t["label_ids"], (0, 1))
    labels[0, 2] = -1  # the synthetic labels are two digits: position 2 is past the text
    t["label_ids"] = labels


def _label_length_plus_one(m: dict[str, Any]) -> None:
    m["index"]["samples"][0]["label_length"] += 1


@pytest.mark.parametrize(("edit", "tensors", "needles"), [
    pytest.param(_move_sample_to_group_one, None, ("group 'g-0' has 3 member(s)", "samples_per_prompt=4"),
                 id="groups-of-3-and-5"),
    pytest.param(_config(samples_per_prompt=3), None, ("group 'g-0' has 4 member(s)", "samples_per_prompt=3"),
                 id="groups-of-4-samples_per_prompt-3"),
    pytest.param(_config(std_eps=-1e-6), None, ("config.std_eps must be >= 0",), id="negative-std_eps"),
    pytest.param(_config(kl_loss_coef=-0.1), None, ("config.kl_loss_coef must be >= 0",), id="negative-kl_loss_coef"),
    pytest.param(_config(clip_low=-0.5), None, ("config.clip_low must be >= 0", "out of order"),
                 id="clip-bounds-out-of-order"),
    pytest.param(_max_operand(-5), None, ("config.task.max_operand must be an integer >= 1",),
                 id="negative-max_operand"),
    pytest.param(None, _fractional_response_ids, ("payload 'response_ids' is F64", "token ids are integers"),
                 id="fractional-token-ids"),
    pytest.param(_label_length_plus_one, _negative_label_id, ("payload 'label_ids' holds token id -1",
                                                              "sample 's-0'"), id="negative-label-id"),
])
def test_validate_refuses_what_replay_refuses_and_ranges_are_checked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Callable[[dict[str, Any]], None] | None,
        tensors: Callable[[dict[str, Tensor]], None] | None, needles: tuple[str, ...]) -> None:
    p = write_rollout(tmp_path / "b")
    assert _cli(capsys, "bundle", "replay", str(p))[0] == 0
    _forge(p, edit, tensors)
    _refused_by_both(capsys, p, *needles)


def _expect_every_stage(w: BundleWriter, s: Any) -> None:
    """The rollout's expected outputs of every recomputed stage, from the synthetic sample ``s``."""
    w.set_expected("reward.raw", "raw", s.t["raw"])
    w.set_expected("reward.post_process", "scores", s.t["scores"])
    w.set_expected("advantage.kl", "kl", s.t["kl"])
    w.set_expected("advantage.estimate", "advantages", s.t["advantages"])


def test_the_writer_refuses_what_the_reader_refuses(tmp_path: Path) -> None:
    """Checked before a byte is written: the same checks, so a producer learns at capture time."""
    with pytest.raises(IntegrityError, match=r"config\.std_eps must be >= 0"):
        BundleWriter(tmp_path / "x", kind="rollout", rollout_id=0, config=default_config(std_eps=-1.0))
    with pytest.raises(IntegrityError, match=r"config\.task\.max_operand must be an integer >= 1"):
        BundleWriter(tmp_path / "x", kind="rollout", rollout_id=0,
                     config=default_config(task={"name": "arithmetic", "max_operand": 0}))
    s = make()
    w = _writer(tmp_path / "x", s, "rollout", list(range(8)), None, None, True, None)
    for name in ("old_logprobs", "ref_logprobs"):
        w.write_payload(name, s.t[name])
    w.write_payload("response_ids", s.t["response_ids"])
    labels = s.t["label_ids"].clone()
    labels[3, 0] = -7
    w.write_payload("label_ids", labels)
    _expect_every_stage(w, s)
    with pytest.raises(IntegrityError, match=r"payload 'label_ids' holds token id -7 \(sample 's-3', token 0\)"):
        w.finalize()
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------- class 4: one run per multi-rank root
def test_ranks_of_two_runs_never_complete_a_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Run A lands rank 0 and dies; run B's rank 1 lands in the same directory: the landing protocol refuses
    to write the root, naming both runs."""
    root = tmp_path / "mr"
    write_rollout(root, rank=0, ranks=[0, 1], groups=4, run_id="run-a")
    with pytest.raises(IntegrityError, match="rank 0 carries run id 'run-a', rank 1 carries run id 'run-b'"):
        write_rollout(root, rank=1, ranks=[0, 1], groups=4, run_id="run-b")
    assert not (root / fmt.COMPLETE).exists()
    for cmd in ("validate", "replay"):
        rc, out = _cli(capsys, "bundle", cmd, str(root))
        assert rc == 2 and "root COMPLETE is missing" in out and "Traceback" not in out, out


def _mixed_root(tmp_path: Path) -> Path:
    """Two runs' ranks under a root COMPLETE written as a landing protocol that does not compare run ids
    would write it (from the landing records)."""
    root = tmp_path / "mr"
    write_rollout(root, rank=0, ranks=[0, 1], groups=4, run_id="run-a")
    with pytest.raises(IntegrityError):
        write_rollout(root, rank=1, ranks=[0, 1], groups=4, run_id="run-b")
    recs = {r: json.loads((root / f"{fmt.COMPLETE}.{r}").read_text()) for r in (0, 1)}
    (root / fmt.COMPLETE).write_bytes(pretty_bytes({
        "format": fmt.FORMAT, "bundle_id": recs[0]["bundle_id"], "run_id": "run-a", "ranks": [0, 1],
        "rank_manifests": {str(r): recs[r]["manifest_sha256"] for r in (0, 1)}}))
    return root


def _records_agree(root: Path) -> None:
    """A landing record edited to the other run's id: rank 1's manifest still says run-b."""
    rec = json.loads((root / "COMPLETE.1").read_text())
    (root / "COMPLETE.1").write_bytes(pretty_bytes({**rec, "run_id": "run-a"}))


@pytest.mark.parametrize(("tamper", "needles"), [
    (None, ("rank 0 carries run id 'run-a', rank 1 carries run id 'run-b'",)),
    (_records_agree, ("rank 1's manifest carries run id 'run-b'", "run id 'run-a'")),
])
def test_a_root_mixing_two_runs_is_refused_naming_both(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       tamper: Callable[[Path], None] | None,
                                                       needles: tuple[str, ...]) -> None:
    root = _mixed_root(tmp_path)
    if tamper is not None:
        tamper(root)
    _refused_by_both(capsys, root, "different runs", *needles)
    rc, out = _cli(capsys, "bundle", "validate", str(root / "rank-1"))  # a rank passed alone: its root is read
    assert rc == 2 and "different runs" in out and "Traceback" not in out, out


def test_a_multi_rank_synthetic_bundle_needs_a_run_id_chosen_per_run(tmp_path: Path) -> None:
    """No default run id: two runs writing ranks into one root with a shared constant would complete it."""
    with pytest.raises(ConfigError, match="run id they share"):
        write_rollout(tmp_path / "mr", rank=0, ranks=[0, 1], groups=4)
    assert not (tmp_path / "mr").exists()


def test_a_multi_rank_root_without_run_ids_is_refused_by_version(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A 2.0/2.1 multi-rank bundle records no run id: its ranks cannot be shown to be one run's."""
    root = tmp_path / "mr"
    for r in (0, 1):
        write_rollout(root, rank=r, ranks=[0, 1], groups=4, run_id="run-a")
    assert load_bundle(root).manifest["format_version"] == fmt.MULTI_RANK_VERSION == "2.2.0"
    shas = {}
    for r in (0, 1):  # rewritten as replayjob 2.0 wrote it
        d = root / f"rank-{r}"
        m = json.loads((d / fmt.MANIFEST).read_text())
        del m["multi_rank"]["run_id"]
        _seal(d, {**m, "format_version": "2.0.0"})
        shas[str(r)] = sha256_bytes((d / fmt.MANIFEST).read_bytes())
        rec = json.loads((root / f"{fmt.COMPLETE}.{r}").read_text())
        del rec["run_id"]
        (root / f"{fmt.COMPLETE}.{r}").write_bytes(pretty_bytes({**rec, "manifest_sha256": shas[str(r)]}))
    final = json.loads((root / fmt.COMPLETE).read_text())
    del final["run_id"]
    (root / fmt.COMPLETE).write_bytes(pretty_bytes({**final, "rank_manifests": shas}))
    _refused_by_both(capsys, root, "records no run id (written before bundle format 2.2.0)")
    rc, out = _cli(capsys, "bundle", "validate", str(root / "rank-0"))  # its root is read before its manifest
    assert rc == 2 and "records no run id (written before bundle format 2.2.0)" in out, out
    for name in [f"{fmt.COMPLETE}.{r}" for r in (0, 1)] + [fmt.COMPLETE]:  # the records given a run id
        rec = json.loads((root / name).read_text())
        (root / name).write_bytes(pretty_bytes({**rec, "run_id": "run-a"}))
    for target in (root, root / "rank-0"):  # the 2.0 rank manifests themselves are refused by version
        rc, out = _cli(capsys, "bundle", "validate", str(target))
        assert rc == 2 and "multi-rank bundles (multi_rank set) need format_version 2.2.0 or later" in out, out


def _step_rank(root: Path, rank: int, logprobs_dtype: torch.dtype) -> None:
    s = make(groups=4)
    rows = [i for i in range(len(s.group)) if s.group[i] % 2 == rank]
    w = _writer(root, s, "step", rows, rank, [0, 1], True, "run-a")
    logp = s.t["logprobs"][rows].to(logprobs_dtype)
    w.write_payload("logprobs", logp)
    for name in ("old_logprobs", "ref_logprobs", "advantages"):
        w.write_payload(name, s.t[name][rows])
    cfg, mask = s.config, s.t["mask"][rows]
    from replayjob.rl import stages

    weights = stages.loss_weights(stages.token_cap(mask, cfg["token_cap"]), cfg["loss_agg"])
    loss = stages.policy_loss(logp, s.t["old_logprobs"][rows], s.t["advantages"][rows], weights,
                              clip_low=cfg["clip_low"], clip_high=cfg["clip_high"],
                              ref_logp=s.t["ref_logprobs"][rows], kl_coef=cfg["kl_loss_coef"])
    w.set_expected("loss.policy", "loss_weights", weights)
    w.set_expected("loss.policy", "loss", float(loss))
    w.finalize()


def test_ranks_of_different_payload_dtypes_are_refused_never_concatenated(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    same = tmp_path / "same"
    for r in (0, 1):
        _step_rank(same, r, torch.float32)
    assert _cli(capsys, "bundle", "replay", str(same))[0] == 0
    mixed = tmp_path / "mixed"
    _step_rank(mixed, 0, torch.float32)
    _step_rank(mixed, 1, torch.float64)  # one run, each rank valid alone
    _refused_by_both(capsys, mixed, "ranks disagree on payload 'logprobs': rank 0 has it F32 (input), rank 1 F64")


def test_a_multi_rank_writer_needs_the_run_s_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = default_config()
    with pytest.raises(IntegrityError, match="a multi-rank bundle needs run_id"):
        BundleWriter(tmp_path / "r", kind="rollout", rollout_id=0, config=cfg, rank=0, ranks=[0, 1])
    with pytest.raises(IntegrityError, match="run_id must be a short identifier"):
        BundleWriter(tmp_path / "r", kind="rollout", rollout_id=0, config=cfg, rank=0, ranks=[0, 1], run_id="a b")
    with pytest.raises(IntegrityError, match="pass it with rank and ranks"):
        BundleWriter(tmp_path / "r", kind="rollout", rollout_id=0, config=cfg, run_id="run-a")
    assert shared_run_id({ENV_RUN_ID: "launch-7"}) == "launch-7"
    assert shared_run_id({"TORCHELASTIC_RUN_ID": "3f1c", "TORCHELASTIC_RESTART_COUNT": "2"}) == "3f1c.2"
    for env in ({}, {"TORCHELASTIC_RUN_ID": "none"}):  # torchrun's default rendezvous id names no run
        with pytest.raises(ConfigError, match="no run id is shared by every rank"):
            shared_run_id(env)


# --------------------------------------------------------- every document read through its declaration
def _complete_of_another_format(p: Path) -> None:
    c = json.loads((p / fmt.COMPLETE).read_text())
    (p / fmt.COMPLETE).write_bytes(pretty_bytes({**c, "format": "other.bundle"}))


def _producer_flag(m: dict[str, Any]) -> None:
    m["producer"]["trusted"] = True  # a bool is no string and no number


def _hash_dropped(m: dict[str, Any]) -> None:
    del m["index"]["samples"][2]["prompt_sha256"]  # the policy hashes prompts: every sample records the digest


def _expected_loss_absent_from_raw(m: dict[str, Any]) -> None:
    m["expected"]["reward.raw"]["raw"] = m["expected"]["reward.raw"]["raw"][:-1]  # one number short


@pytest.mark.parametrize(("edit", "needles"), [
    pytest.param(_complete_of_another_format, ("COMPLETE", "field `format`"), id="complete-format"),
    pytest.param(lambda p: _forge(p, _producer_flag), ("field `producer.trusted`",), id="producer-bool"),
    pytest.param(lambda p: _forge(p, _hash_dropped), ("index.samples[2]", "redaction policy 'hash'"),
                 id="sample-text-against-policy"),
    pytest.param(lambda p: _forge(p, _expected_loss_absent_from_raw), ("expected.reward.raw.raw", "8 numbers"),
                 id="expected-length"),
])
def test_a_bundle_s_documents_are_read_through_their_declarations(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Callable[[Path], None],
        needles: tuple[str, ...]) -> None:
    p = write_rollout(tmp_path / "b")
    edit(p)
    _refused_by_both(capsys, p, *needles)


def _rank_as_bool(root: Path) -> None:
    rec = json.loads((root / "COMPLETE.1").read_text())
    (root / "COMPLETE.1").write_bytes(pretty_bytes({**rec, "rank": True}))  # True == 1, but no rank


def _root_rank_as_float(root: Path) -> None:
    doc = json.loads((root / fmt.COMPLETE).read_text())
    (root / fmt.COMPLETE).write_bytes(pretty_bytes({**doc, "ranks": [0, 1.0]}))


@pytest.mark.parametrize(("tamper", "needles"), [
    (_rank_as_bool, ("COMPLETE.1", "field `rank`: expected `int`, got `bool`")),
    (_root_rank_as_float, ("field `ranks[1]`: expected `int`, got `float`",)),
])
def test_landing_records_are_read_through_their_declarations(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            tamper: Callable[[Path], None],
                                                            needles: tuple[str, ...]) -> None:
    root = tmp_path / "mr"
    for r in (0, 1):
        write_rollout(root, rank=r, ranks=[0, 1], groups=4, run_id="run-a")
    tamper(root)
    _refused_by_both(capsys, root, *needles)


# ------------------------------------------- values no trainer consumed: log-probabilities above 0
@pytest.mark.parametrize("name", ["logprobs", "old_logprobs", "ref_logprobs"])
def test_a_log_probability_above_zero_inside_a_response_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   name: str) -> None:
    """A re-sealed step bundle whose log-probabilities were raised above 0 (probabilities above 1) was validated and
    recomputed like any other; the capture payload's reader already refused the same values.  Padding past a
    sample's response may hold any finite value, and 0 itself is a log-probability."""
    p = write_step(tmp_path / "b")
    lengths = [s["response_length"] for s in load_bundle(p).samples]
    row = next(i for i, n in enumerate(lengths) if 0 < n < max(lengths))

    def pad(t: dict[str, Tensor]) -> None:
        t[name][row, lengths[row]] = 0.5  # past the response: padding, any finite value
        t[name][row, 0] = 0.0

    _forge(p, tensors=pad)
    assert _cli(capsys, "bundle", "validate", str(p))[0] == 0

    def above(t: dict[str, Tensor]) -> None:
        t[name][row, lengths[row] - 1] = 0.5

    _forge(p, tensors=above)
    _refused_by_both(capsys, p, f"payload '{name}'", "token", "a log-probability is <= 0")


def test_the_writer_refuses_a_log_probability_above_zero_before_writing(tmp_path: Path) -> None:
    """The same domain as the reader's, checked by the writer before a byte is written."""
    s = make()
    w = _writer(tmp_path / "x", s, "rollout", list(range(8)), None, None, True, None)
    old = s.t["old_logprobs"].clone()
    old[2, 0] = 0.5  # inside sample 2's response
    w.write_payload("old_logprobs", old)
    w.write_payload("ref_logprobs", s.t["ref_logprobs"])
    w.write_payload("response_ids", s.t["response_ids"])
    w.write_payload("label_ids", s.t["label_ids"])
    _expect_every_stage(w, s)
    with pytest.raises(IntegrityError, match=r"payload 'old_logprobs'.*a log-probability is <= 0"):
        w.finalize()
    assert not (tmp_path / "x").exists()
