"""Hostile bundles: what ``bundle replay`` relies on that ``bundle validate`` must refuse first.

Each bundle is synthetic (:mod:`replayjob.bundle.synthetic`) and rewritten the way a producer without the
reader's checks (or a forger) would, every digest re-sealed (``tests/test_bundle_checks._forge``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from replayjob import tensorfile
from replayjob.bundle import format as fmt
from replayjob.bundle.reader import load_bundle
from replayjob.bundle.synthetic import _writer, make, write_rollout, write_step
from replayjob.cli import main
from replayjob.digest import sha256_bytes
from replayjob.errors import IntegrityError
from replayjob.rl import stages
from tests.test_bundle_checks import _forge, _refused_by_both, _repin, _seal


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


def _short_row(p: Path) -> tuple[int, int, int]:
    """(row, its response_length, the payloads' width) of the first sample with padding."""
    m = json.loads((p / fmt.MANIFEST).read_text())
    width = m["payloads"]["mask"]["shape"][1]
    row = next(i for i, s in enumerate(m["index"]["samples"]) if s["response_length"] < width)
    return row, m["index"]["samples"][row]["response_length"], width


# ------------------------------------------------------------- padding is finite in every per-token float payload
@pytest.mark.parametrize(("kind", "name", "value", "dtype"), [
    ("rollout", "old_logprobs", float("nan"), None),
    ("rollout", "ref_logprobs", float("inf"), None),
    ("rollout", "kl", float("nan"), None),
    ("rollout", "advantages", float("-inf"), None),
    ("step", "logprobs", float("nan"), None),
    ("step", "old_logprobs", float("inf"), None),
    ("step", "ref_logprobs", float("nan"), None),  # never reaches the loss when kl_loss_coef is 0: refused anyway
    ("step", "advantages", float("nan"), None),
    ("step", "loss_weights", float("nan"), None),
    ("step", "logprobs", float("-inf"), torch.bfloat16),
    ("step", "old_logprobs", float("nan"), torch.float16),
])
def test_a_non_finite_pad_is_refused_by_validate_and_replay(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, name: str, value: float,
        dtype: torch.dtype | None) -> None:
    """A NaN or an infinity past a sample's response: the stages weigh it by the zero mask and 0 * NaN is NaN, so
    replay read a forged pad as a NaN loss (exit 1) or, unread, passed; both now refuse it (exit 2), naming the
    payload, the sample and the token."""
    p = (write_rollout if kind == "rollout" else write_step)(tmp_path / "b")
    row, length, width = _short_row(p)

    def pad(t: dict[str, Tensor]) -> None:
        if dtype is not None:
            t[name] = t[name].to(dtype)
        t[name][row, width - 1] = value

    _forge(p, None, pad)
    _refused_by_both(capsys, p, f"payload {name!r} holds", "at padding", f"sample 's-{row}'",
                     f"token {width - 1}", f"response_length={length}", "padding is finite")


def test_a_non_finite_value_inside_the_response_is_evidence_not_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Inside the response a NaN is what the trainer consumed: validate passes, replay reports it (exit 1)."""
    p = write_step(tmp_path / "b")

    def nan(t: dict[str, Tensor]) -> None:
        t["logprobs"][0, 0] = float("nan")

    _forge(p, None, nan)
    assert _cli(capsys, "bundle", "validate", str(p))[0] == 0
    rc, out = _cli(capsys, "bundle", "replay", str(p))
    assert rc == 1 and "nan" in out.lower(), out


def test_the_writer_refuses_a_non_finite_pad(tmp_path: Path) -> None:
    s = make()
    w = _writer(tmp_path / "x", s, "step", list(range(8)), None, None, True, None)
    row = next(i for i, n in enumerate(s.lengths) if n < max(s.lengths))
    logp = s.t["logprobs"].clone()
    logp[row, -1] = float("nan")
    w.write_payload("logprobs", logp)
    for name in ("old_logprobs", "ref_logprobs", "advantages"):
        w.write_payload(name, s.t[name])
    w.set_expected("loss.policy", "loss_weights", s.t["loss_weights"])
    w.set_expected("loss.policy", "loss", float(s.t["loss"]))
    with pytest.raises(IntegrityError, match=rf"payload 'logprobs' holds nan at padding \(sample 's-{row}'"):
        w.finalize()
    assert not (tmp_path / "x").exists()


# -------------------------------------------- an empty response (a zero mask row) is valid when it is recorded so
def test_a_zero_mask_row_recorded_consistently_replays_clean(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A sample with response_length 0 and a zero mask row is an empty response, not a structural fault: the
    stages handle it (no division by its zero count), so a bundle whose outputs were computed with it replays
    clean, and one whose outputs were computed with another mask diverges (exit 1, a valid verdict)."""
    p = write_step(tmp_path / "b")
    cfg = json.loads((p / fmt.MANIFEST).read_text())["index"]["config"]
    loss: dict[str, float] = {}

    def empty(t: dict[str, Tensor]) -> None:
        t["mask"][0] = 0
        w = stages.loss_weights(stages.token_cap(t["mask"], cfg["token_cap"]), cfg["loss_agg"])
        t["loss_weights"] = w
        loss["v"] = float(stages.policy_loss(t["logprobs"], t["old_logprobs"], t["advantages"], w,
                                             clip_low=cfg["clip_low"], clip_high=cfg["clip_high"],
                                             ref_logp=t["ref_logprobs"], kl_coef=cfg["kl_loss_coef"]))

    def lengths(m: dict[str, Any]) -> None:
        m["index"]["samples"][0]["response_length"] = 0
        m["expected"]["loss.policy"]["loss"] = loss["v"]

    _forge(p, lengths, empty)
    assert _cli(capsys, "bundle", "validate", str(p))[0] == 0
    assert _cli(capsys, "bundle", "replay", str(p))[0] == 0

    q = write_step(tmp_path / "c")

    def zero(t: dict[str, Tensor]) -> None:
        t["mask"][0] = 0

    _forge(q, lambda m: m["index"]["samples"][0].update(response_length=0), zero)
    assert _cli(capsys, "bundle", "validate", str(q))[0] == 0
    assert _cli(capsys, "bundle", "replay", str(q))[0] == 1


# ------------------------------------------------------------------ text a report prints is one printable line
@pytest.mark.parametrize(("field", "value"), [
    ("reason", "membership was not recorded\n[   pass] reward.post_process"),
    ("reason", "x\x1b[2J"),
    ("implementation", "replayjob.rl.stages.post_process\r"),
    ("reason", "x\u202e"),
])
def test_a_stage_reason_printed_by_replay_and_inspect_is_one_printable_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: str) -> None:
    """bundle replay prints a skipped stage's reason and bundle inspect every stage's: a newline in it printed a
    stage line of its own ("[   pass] ...") that no stage had."""
    p = write_rollout(tmp_path / "b", groups_recorded=False)
    _forge(p, lambda m: m["stages"]["reward.post_process"].update({field: value}))
    _refused_by_both(capsys, p, f"stages.reward.post_process.{field}", "printable characters")
    rc, out = _cli(capsys, "bundle", "inspect", str(p))
    assert rc == 0 and "Traceback" not in out and value not in out, out


# ------------------------------------------------------------ a per-token stage needs a response token somewhere
@pytest.mark.parametrize("kind", ["rollout", "step"])
def test_a_bundle_of_empty_responses_is_refused_not_passed_on_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    """Every mask row zero (every response_length 0) and every per-token output zero: replay compared zeros with
    zeros and passed (exit 0) on no token at all."""
    p = (write_rollout if kind == "rollout" else write_step)(tmp_path / "b")

    def empty(t: dict[str, Tensor]) -> None:
        for name in ("mask", "kl", "advantages", "loss_weights"):
            if name in t:
                t[name] = torch.zeros_like(t[name])

    def lengths(m: dict[str, Any]) -> None:
        for s in m["index"]["samples"]:
            s["response_length"] = 0
        if kind == "step":
            m["expected"]["loss.policy"]["loss"] = 0.0
        else:
            m["stages"]["advantage.estimate"].update(capability="recorded-only", reason="x")
            m["stages"]["reward.post_process"].update(capability="recorded-only", reason="x")
            m["stages"]["reward.raw"].update(capability="recorded-only", reason="x")

    _forge(p, lengths, empty)
    _refused_by_both(capsys, p, "no sample has a response token", "would compare nothing")


# ------------------------------------------------------------------ the payload file holds only what the writer writes
def _reheader(p: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """The payload file's JSON header edited in place (the tensors' bytes kept) and every digest that pins it
    re-sealed: the payload file's size and header SHA-256 in the manifest, the manifest's in COMPLETE."""
    data = (p / fmt.PAYLOAD_FILE).read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    edit(header)
    block = json.dumps(header, separators=(",", ":")).encode()
    block += b" " * (-len(block) % 8)
    new = len(block).to_bytes(8, "little") + block + data[8 + length:]
    (p / fmt.PAYLOAD_FILE).write_bytes(new)
    m = json.loads((p / fmt.MANIFEST).read_text())
    m["payload_file"].update(bytes=len(new), header_sha256=sha256_bytes(new[:8 + len(block)]))
    _seal(p, m)


def test_a_payload_file_carrying_metadata_the_writer_never_writes_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The writer's payload file has no ``__metadata__``; a re-sealed one whose header carries a metadata block
    (content no reader looks at, and no declaration names) was validated and replayed as the writer's."""
    p = write_rollout(tmp_path / "b")
    _reheader(p, lambda h: h.update(__metadata__={"note": "anything"}))
    _refused_by_both(capsys, p, "bundle payload file metadata {'note': 'anything'} is not {}")


@pytest.mark.parametrize("name", ["mask", "old_logprobs"])
def test_a_payload_of_another_row_count_is_refused_naming_its_shape(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    """A payload re-sealed with one row fewer than the bundle has samples (its manifest shape agreeing): a mask
    of 7 rows for 8 samples was refused as "only 0 values were checked", naming no shape and no rule."""
    p = write_rollout(tmp_path / "b")

    def drop_a_row(t: dict[str, Tensor]) -> None:
        t[name] = t[name][:-1]

    _forge(p, None, drop_a_row)
    _refused_by_both(capsys, p, f"payload {name!r} has shape [7, 6]", "[N=8, T]")


# -------------------------------------------------- a refusal names the file it found the fault in, and the fix
def _two_ranks(root: Path) -> Path:
    for r in (1, 0):
        write_rollout(root, rank=r, ranks=[0, 1], groups=4, run_id="run-a")
    return root


def _unknown_token(t: dict[str, Tensor]) -> None:
    t["response_ids"][0, 0] = 300


def _longer_response(m: dict[str, Any]) -> None:
    m["index"]["samples"][0]["response_length"] -= 1


def _no_old_logprobs(t: dict[str, Tensor]) -> None:
    del t["old_logprobs"]


def _drop_spec(m: dict[str, Any]) -> None:
    m["payloads"].pop("old_logprobs", None)


@pytest.mark.parametrize(("edit", "tensors", "file", "needle"), [
    pytest.param(None, _unknown_token, fmt.PAYLOAD_FILE, "holds token id 300", id="token-id"),
    pytest.param(_longer_response, None, fmt.PAYLOAD_FILE, "does not match response_length", id="mask-row"),
    pytest.param(_drop_spec, _no_old_logprobs, fmt.MANIFEST, "input payload 'old_logprobs' is missing",
                 id="closure"),
    pytest.param(lambda m: m["index"]["config"].update(kl_kind="k2"), None, fmt.MANIFEST,
                 "unsupported KL estimator 'k2'", id="topology"),
    pytest.param(lambda m: m.update(format_version="3.0.0"), None, fmt.MANIFEST, "format_version '3.0.0'",
                 id="version"),
])
def test_a_refusal_inside_a_rank_names_that_rank_s_file_and_the_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Callable[[dict[str, Any]], None] | None,
        tensors: Callable[[dict[str, Tensor]], None] | None, file: str, needle: str) -> None:
    """Rank 1 of a two-rank root re-sealed with one fault: the refusal named ``payloads.safetensors`` or
    ``manifest.json`` alone (which of the ranks' files?) and often no fix."""
    root = _two_ranks(tmp_path / "mr")
    m = json.loads((root / "rank-1" / fmt.MANIFEST).read_text())
    if tensors is not None:
        payloads = {k: v.clone() for k, v in load_bundle(root / "rank-1").payloads.items()}
        tensors(payloads)
        enc = tensorfile.encode(payloads)
        (root / "rank-1" / fmt.PAYLOAD_FILE).write_bytes(enc.data)
        for name, t in payloads.items():
            m["payloads"][name].update(sha256=enc.tensor_sha256[name].hex(), shape=list(t.shape))
        m["payload_file"].update(bytes=len(enc.data), header_sha256=enc.header_sha256.hex())
    if edit is not None:
        edit(m)
    _seal(root / "rank-1", m)
    _repin(root, 1)
    _refused_by_both(capsys, root, f"{root / 'rank-1' / file}", needle)


def test_a_refusal_of_the_ranks_together_names_the_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Group closure is checked over every rank: a group of 3 and one of 5 across the ranks is the root's fault."""
    root = _two_ranks(tmp_path / "mr")

    def move(m: dict[str, Any]) -> None:
        s = m["index"]["samples"][0]
        s["group"] = "g-0" if s["group"] != "g-0" else "g-1"

    m = json.loads((root / "rank-1" / fmt.MANIFEST).read_text())
    move(m)
    _seal(root / "rank-1", m)
    _repin(root, 1)
    _refused_by_both(capsys, root, f"{root}: {fmt.MANIFEST}: index: samples", "member(s)")


@pytest.mark.parametrize("kind", ["link", "directory", "fifo"])
def test_a_root_complete_that_is_no_file_is_refused_as_what_it_is(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    """A multi-rank root whose ``COMPLETE`` is a link (to the very record every rank wrote), a directory or a FIFO:
    refused as "incomplete ... the root COMPLETE is missing", with the fix to wait for the ranks to land, which no
    wait would ever bring.  It is refused naming what it is (the FIFO without blocking)."""
    root = _two_ranks(tmp_path / "mr")
    record = root / fmt.COMPLETE
    data = record.read_bytes()
    record.unlink()
    if kind == "link":
        (tmp_path / "elsewhere").write_bytes(data)
        record.symlink_to(tmp_path / "elsewhere")
    elif kind == "directory":
        record.mkdir()
    else:
        os.mkfifo(record)
    for cmd in ("validate", "replay"):
        rc, out = _cli(capsys, "bundle", cmd, str(root))
        assert rc == 2 and "Traceback" not in out and f"{record}:" in out, (cmd, out)
        assert ("symbolic link" if kind == "link" else "not a regular file") in out and "missing" not in out, out


def test_a_rank_that_is_a_file_is_named_as_such_not_as_missing(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A multi-rank root whose rank-1 is a plain file: refused (exit 2) as no directory, naming it, not as a rank that
    did not land (whose fix, waiting for it, would never help)."""
    import shutil
    root = _two_ranks(tmp_path / "mr")
    shutil.rmtree(root / "rank-1")
    (root / "rank-1").write_text("not a rank\n")
    _refused_by_both(capsys, root, "rank 1's rank-1 is not a directory", str(root / "rank-1"))
