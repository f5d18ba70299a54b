"""Bundle writer and strict reader: atomic layout, redaction, multi-rank landing, fail-closed cases.

Every refusal is checked through the real CLI (`bundle validate` / `bundle replay`, in-process)
for exit code 2 and a message naming the cause.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save

from replayjob import tensorfile
from replayjob.bundle import BundleWriter, default_config, inspect_path, load_bundle
from replayjob.bundle import format as fmt
from replayjob.bundle.synthetic import make, write_rollout, write_step
from replayjob.bundle.writer import new_run_id
from replayjob.cli import main
from replayjob.digest import sha256_bytes, sha256_json
from replayjob.errors import ArtifactExistsError, ContractError, IntegrityError
from replayjob.jsonio import pretty_bytes


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


def _rewrite(p: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Tamper with the manifest the way a crafted bundle would: re-sealing the digest in COMPLETE."""
    m = json.loads((p / "manifest.json").read_text())
    edit(m)
    (p / "manifest.json").write_bytes(pretty_bytes(m))
    c = json.loads((p / "COMPLETE").read_text())
    c["manifest_sha256"] = sha256_bytes((p / "manifest.json").read_bytes())
    (p / "COMPLETE").write_bytes(pretty_bytes(c))


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    return write_rollout(tmp_path / "b")


def test_written_bundle_validates_and_has_the_documented_layout(bundle: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert sorted(x.name for x in bundle.iterdir()) == ["COMPLETE", "manifest.json", "payloads.safetensors"]
    m = json.loads((bundle / "manifest.json").read_bytes())
    assert m["format_version"] == "2.0.0" and "samples" in m["index"] and "reward.raw" in m["expected"]
    data = (bundle / "payloads.safetensors").read_bytes()
    header = tensorfile.read_header(bundle / "payloads.safetensors")
    assert sorted(header.tensors) == sorted(m["payloads"])
    assert m["payload_file"] == {"file": "payloads.safetensors", "bytes": len(data),
                                 "header_sha256": sha256_bytes(data[:header.data_start])}
    for name, spec in header.tensors.items():  # every byte pinned: header block, then each tensor's span
        span = data[header.data_start + spec.begin:header.data_start + spec.end]
        assert m["payloads"][name]["sha256"] == sha256_bytes(span)
    assert not [x for x in bundle.parent.iterdir() if x.name.startswith(".")]  # no staging left over
    rc, out = _cli(capsys, "bundle", "validate", str(bundle))
    assert rc == 0 and "valid: rollout bundle rollout-000003 (8 samples" in out
    b = load_bundle(bundle)
    assert b.kind == "rollout" and b.capability("reward.post_process") == "recompute"
    assert b.capability("sample") == "inspect-only"


def test_writes_are_byte_stable(tmp_path: Path) -> None:
    a, b = write_rollout(tmp_path / "a"), write_rollout(tmp_path / "b")
    for name in ("manifest.json", "payloads.safetensors", "COMPLETE"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_writer_never_overwrites(bundle: Path) -> None:
    with pytest.raises(ArtifactExistsError):
        write_rollout(bundle)


def test_raw_text_never_enters_a_bundle(tmp_path: Path) -> None:
    w = BundleWriter(tmp_path / "t", kind="rollout", rollout_id=0, config=default_config(samples_per_prompt=1),
                     redaction={"prompt": "truncate:4", "completion": "hash", "label": "drop",
                                "response_ids": "drop", "label_ids": "drop", "paths": "drop",
                                "endpoints": "drop", "environment": "drop", "secrets": "drop"})
    w.add_sample("s-0", group="g-0", prompt_length=9, response_length=1, prompt="Q:SECRETPROMPT",
                 completion="SECRETANSWER", label="SECRETLABEL")
    for stage in ("reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate"):
        w.set_capability(stage, "unsupported", "not captured")
    path = w.finalize()
    blob = b"".join(p.read_bytes() for p in path.rglob("*") if p.is_file())
    assert b"SECRET" not in blob
    rec = load_bundle(path).samples[0]
    assert rec["prompt_prefix"] == "Q:SE" and rec["completion_sha256"] == sha256_bytes(b"SECRETANSWER")
    assert "label_sha256" not in rec


def test_an_update_bundle_s_loss_reads_the_advantages_its_estimate_recorded(tmp_path: Path) -> None:
    """In an update bundle the policy loss may take the advantages as ``advantage.estimate``'s
    recorded output (an expected payload), and only if that stage recorded them."""
    s = make(groups=1, group_size=2)
    n = len(s.group)

    def update(name: str, record_advantages: bool) -> BundleWriter:
        w = BundleWriter(tmp_path / name, kind="update", rollout_id=0, step_id=0, config=s.config)
        for i in range(n):
            w.add_sample(f"s-{i}", group="g-0", prompt_length=3, response_length=s.lengths[i],
                         prompt="Q", completion=s.completions[i], label=s.labels[i])
        for stage in ("reward.raw", "reward.post_process", "advantage.kl"):
            w.set_capability(stage, "inspect-only", "not captured here")
        for name_ in ("mask", "logprobs", "old_logprobs", "ref_logprobs"):
            w.write_payload(name_, s.t[name_])
        if record_advantages:
            w.set_capability("advantage.estimate", "recorded-only", "its inputs are not captured here")
            w.set_expected("advantage.estimate", "advantages", s.t["advantages"])
        else:
            w.set_capability("advantage.estimate", "unsupported", "not captured here")
            w.write_payload("advantages", s.t["advantages"], role="expected")
        w.set_expected("loss.policy", "loss_weights", s.t["loss_weights"])
        w.set_expected("loss.policy", "loss", float(s.t["loss"]))
        return w

    with pytest.raises(IntegrityError, match="only an earlier stage's recorded output of the same bundle may feed it"):
        update("orphan", record_advantages=False).finalize()
    assert not (tmp_path / "orphan").exists()
    b = load_bundle(update("ok", record_advantages=True).finalize())
    assert b.kind == "update" and b.manifest["payloads"]["advantages"]["role"] == "expected"
    assert b.manifest["format_version"] == "2.1.0"  # the kind's version; rollout and step bundles stay 2.0.0
    assert main(["bundle", "replay", str(b.path)]) == 0  # the loss recomputes from those advantages
    with pytest.raises(IntegrityError, match="needs step_id"):
        BundleWriter(tmp_path / "x", kind="update", rollout_id=0, config=s.config)


def test_a_step_bundle_s_loss_cannot_read_an_expected_payload(tmp_path: Path) -> None:
    """Only an update bundle records the advantages upstream of the loss: a step bundle whose
    advantages are marked expected is refused, not read as the loss's input."""
    s = make(groups=1, group_size=2)
    w = BundleWriter(tmp_path / "s", kind="step", rollout_id=0, step_id=0, config=s.config)
    for i in range(len(s.group)):
        w.add_sample(f"s-{i}", group="g-0", prompt_length=3, response_length=s.lengths[i],
                     prompt="Q", completion=s.completions[i], label=s.labels[i])
    for name in ("mask", "logprobs", "old_logprobs", "ref_logprobs"):
        w.write_payload(name, s.t[name])
    w.write_payload("advantages", s.t["advantages"], role="expected")
    w.set_expected("loss.policy", "loss_weights", s.t["loss_weights"])
    w.set_expected("loss.policy", "loss", float(s.t["loss"]))
    with pytest.raises(IntegrityError, match=r"'advantages' is an expected output, not an input of loss\.policy"):
        w.finalize()
    assert not (tmp_path / "s").exists()


def test_a_kind_needs_the_version_it_appeared_in() -> None:
    assert fmt.kind_version_problem("2.1.0", "update") is None and fmt.kind_version_problem("2.7.3", "update") is None
    for version in ("2.0.0", "2", "2.x"):
        assert "update bundles need format_version 2.1.0" in str(fmt.kind_version_problem(version, "update"))
    for version in ("2.0.0", "2", "2.x", "2.1.0"):
        assert fmt.kind_version_problem(version, "rollout") is None


def test_a_prepared_bundle_is_written_only_by_the_writer_that_prepared_it(tmp_path: Path) -> None:
    cfg = default_config(samples_per_prompt=1)
    writers = []
    for name in ("a", "b"):
        w = BundleWriter(tmp_path / name, kind="step", rollout_id=0, step_id=0, config=cfg)
        w.add_sample("s-0", group="g-0", prompt_length=3, response_length=1, prompt="Q", completion="1", label="1")
        w.write_payload("mask", torch.ones((1, 1), dtype=torch.bool))
        w.set_capability("loss.policy", "inspect-only", "not captured here")
        writers.append(w)
    prepared = writers[0].prepare()
    with pytest.raises(IntegrityError, match="prepared by another writer"):
        writers[1].write(prepared)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert writers[0].write(prepared) == tmp_path / "a" and load_bundle(tmp_path / "a").samples[0]["sample_id"] == "s-0"


def test_unsupported_topology_fails_loudly(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ContractError, match="unsupported topology"):
        BundleWriter(bundle.parent / "x", kind="rollout", rollout_id=0, config=default_config(estimator="ppo"))
    _rewrite(bundle, lambda m: m["index"]["config"].update(estimator="gae"))
    rc, out = _cli(capsys, "bundle", "validate", str(bundle))
    assert rc == 2 and "unsupported topology: estimator 'gae'" in out


def _missing_complete(p: Path) -> None:
    (p / "COMPLETE").unlink()


def _missing_payload(p: Path) -> None:
    (p / "payloads.safetensors").unlink()


def _flip_tensor_byte(p: Path, name: str) -> None:
    """Flip the last byte of tensor ``name`` inside payloads.safetensors."""
    f = p / "payloads.safetensors"
    header = tensorfile.read_header(f)
    data = bytearray(f.read_bytes())
    data[header.data_start + header.tensors[name].end - 1] ^= 0x01
    f.write_bytes(bytes(data))


def _checksum(p: Path) -> None:
    _flip_tensor_byte(p, "old_logprobs")


def _header_edit(p: Path) -> None:
    f = p / "payloads.safetensors"
    f.write_bytes(f.read_bytes().replace(b'"F64"', b'"I64"', 1))


def _stray_pickle(p: Path) -> None:
    (p / "extra.pt").write_bytes(b"\x80\x04not-loaded")


def _declared_pickle(p: Path) -> None:
    _rewrite(p, lambda m: m["payload_file"].update(file="payloads.pt"))


def _escape(p: Path) -> None:
    os.rename(p / "payloads.safetensors", p.parent / "payloads.safetensors")
    _rewrite(p, lambda m: m["payload_file"].update(file="../payloads.safetensors"))


def _escape_name(p: Path) -> None:
    _rewrite(p, lambda m: m["payloads"].update({"../../etc": m["payloads"].pop("kl")}))


def _symlink(p: Path) -> None:
    f = p / "payloads.safetensors"
    outside = p.parent / "outside.safetensors"
    os.rename(f, outside)
    os.symlink(outside, f)


def _undeclared(p: Path) -> None:
    (p / "notes.safetensors").write_bytes(b"{}")


def _subdirectory(p: Path) -> None:
    (p / "extra").mkdir()


def _manifest_edit(p: Path) -> None:
    m = json.loads((p / "manifest.json").read_text())
    m["comparison"]["reward.raw"]["atol"] = 1.0
    (p / "manifest.json").write_bytes(pretty_bytes(m))


@pytest.mark.parametrize(("tamper", "cause"), [
    (_missing_complete, "COMPLETE is missing"),
    (_missing_payload, "the payload file payloads.safetensors is missing"),
    (_checksum, "checksum mismatch for payload 'old_logprobs'"),
    (_header_edit, "checksum mismatch for payloads.safetensors"),
    (_manifest_edit, "checksum mismatch: manifest.json"),
    (_stray_pickle, "pickle-capable file"),
    (_declared_pickle, "payload file 'payloads.pt' must be 'payloads.safetensors'"),
    (_escape, "payload file '../payloads.safetensors' must be 'payloads.safetensors'"),
    (_escape_name, "payload name '../../etc' is not allowed"),
    (_symlink, "symlink"),
    (_undeclared, "unknown entries ['notes.safetensors']"),
    (_subdirectory, "unknown entries ['extra']"),
])
def test_fail_closed(bundle: Path, capsys: pytest.CaptureFixture[str], tamper: Callable[[Path], None],
                     cause: str) -> None:
    tamper(bundle)
    for cmd in ("validate", "replay"):
        rc, out = _cli(capsys, "bundle", cmd, str(bundle))
        assert rc == 2, out
        assert cause in out


def test_inspect_works_on_an_incomplete_bundle(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _missing_complete(bundle)
    _missing_payload(bundle)
    rc, out = _cli(capsys, "bundle", "inspect", str(bundle))
    assert rc == 0 and "(INCOMPLETE)" in out and "payload kl [expected] F64" in out
    info = inspect_path(bundle)
    assert info["problems"] == ["COMPLETE is missing: the bundle is incomplete",
                                "the payload file payloads.safetensors is missing"]
    assert info["stages"]["advantage.estimate"]["capability"] == "recompute"
    rc, out = _cli(capsys, "bundle", "inspect", str(bundle), "--json")
    assert rc == 0 and json.loads(out)["identity"]["rollout_id"] == 3


def test_multi_rank_landing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "mr"
    run = new_run_id()
    write_rollout(root, rank=1, ranks=[0, 1], groups=4, run_id=run)
    assert sorted(x.name for x in root.iterdir()) == ["COMPLETE.1", "rank-1"]
    for target in (root, root / "rank-1"):  # the rank directory does not bypass the root check
        rc, out = _cli(capsys, "bundle", "validate", str(target))
        assert rc == 2 and "COMPLETE is missing" in out
    rc, out = _cli(capsys, "bundle", "inspect", str(root))
    assert rc == 0 and "rank 0 has not landed" in out
    write_rollout(root, rank=0, ranks=[0, 1], groups=4, run_id=run)  # the last rank to land writes COMPLETE
    final = json.loads((root / "COMPLETE").read_text())
    assert final["ranks"] == [0, 1] and set(final["rank_manifests"]) == {"0", "1"}
    b = load_bundle(root)
    assert b.ranks == [0, 1] and len(b.samples) == 16 and [c.rank for c in b.loss_cohorts] == [0, 1]
    assert _cli(capsys, "bundle", "replay", str(root))[0] == 0
    assert _cli(capsys, "bundle", "replay", str(root / "rank-0"))[0] == 0
    step = tmp_path / "mr-step"
    run = new_run_id()
    for r in (0, 1):
        write_step(step, rank=r, ranks=[0, 1], groups=4, run_id=run, inject={"loss": (0, 0, 0.5)} if r == 1 else None)
    rc, out = _cli(capsys, "bundle", "replay", str(step))
    assert rc == 1 and "loss <rank 1>: expected=" in out and "loss: 1/2 mismatched" in out
    os.rename(root / "rank-1", tmp_path / "elsewhere")
    rc, out = _cli(capsys, "bundle", "replay", str(root))
    assert rc == 2 and "rank 1 is missing" in out


def _edit_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_bytes(pretty_bytes(doc))


def _drop_rank_one(root: Path) -> None:
    """A root rewritten to list rank 0 only, rank 1's directory and landing record deleted."""
    shutil.rmtree(root / "rank-1")
    (root / "COMPLETE.1").unlink()
    _edit_json(root / "COMPLETE", lambda d: d.update(ranks=[0], rank_manifests={"0": d["rank_manifests"]["0"]}))


def _drop_rank_one_and_its_expectation(root: Path) -> None:
    """As above, and rank 0's landing record rewritten to expect rank 0 only (its manifest still expects both)."""
    _drop_rank_one(root)
    _edit_json(root / "COMPLETE.0", lambda d: d.update(expected_ranks=[0]))


def _record_names_another_manifest(root: Path) -> None:
    _edit_json(root / "COMPLETE.1", lambda d: d.update(manifest_sha256="0" * 64))


def _root_lists_ranks_out_of_order(root: Path) -> None:
    _edit_json(root / "COMPLETE", lambda d: d.update(ranks=[1, 0]))


def _root_carries_an_extra_key(root: Path) -> None:
    _edit_json(root / "COMPLETE", lambda d: d.update(note="x"))


def _landing_record_is_a_fifo(root: Path) -> None:
    (root / "COMPLETE.1").unlink()
    os.mkfifo(root / "COMPLETE.1")


@pytest.mark.parametrize(("tamper", "needle"), [
    (_drop_rank_one, "rank 0's producer expected ranks [0, 1]"),
    (_drop_rank_one_and_its_expectation, "this rank's manifest expects ranks [0, 1], the root COMPLETE lists [0]"),
    (_record_names_another_manifest, "COMPLETE.1 disagrees with the root COMPLETE"),
    (_root_lists_ranks_out_of_order, "distinct integers >= 0 in order"),
    (_root_carries_an_extra_key, "must record exactly format"),
    (_landing_record_is_a_fifo, "COMPLETE.1: JSON file is not a regular file"),
])
def test_a_partial_or_inconsistent_multi_rank_root_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              tamper: Callable[[Path], None], needle: str) -> None:
    root = tmp_path / "mr"
    run = new_run_id()
    for r in (0, 1):
        write_rollout(root, rank=r, ranks=[0, 1], groups=4, run_id=run)
    assert load_bundle(root).ranks == [0, 1]
    tamper(root)
    for target in (root, root / "rank-0"):
        rc, out = _cli(capsys, "bundle", "validate", str(target))
        assert rc == 2 and needle in out and "Traceback" not in out, out


def test_writer_checks_closure_before_writing(tmp_path: Path) -> None:
    w = BundleWriter(tmp_path / "c", kind="rollout", rollout_id=1, config=default_config(samples_per_prompt=1))
    w.add_sample("s-0", group=None, prompt_length=1, response_length=1, prompt="p", completion="c", label="l")
    with pytest.raises(IntegrityError, match="dependency closure"):
        w.finalize()
    assert not (tmp_path / "c").exists() and not list(tmp_path.iterdir())
    with pytest.raises(IntegrityError, match=r"must be a torch\.Tensor"):
        w.write_payload("mask", [1.0])  # type: ignore[arg-type]


def test_documented_writer_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "bundle-format.md").read_text()
    code = doc.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/bundle-format.md", "exec"), {})
    assert load_bundle(tmp_path / "b-0001").kind == "rollout"


def test_a_capture_directory_is_not_a_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_rollout(tmp_path / "cap" / "rollout-000003")
    rc, out = _cli(capsys, "bundle", "validate", str(tmp_path / "cap"))
    assert rc == 2 and "capture directory holding 1 bundle(s) ['rollout-000003']" in out
    (tmp_path / "cap" / "notes").mkdir()  # not a bundle: inspect lists bundles only
    rc, out = _cli(capsys, "bundle", "inspect", str(tmp_path / "cap"), "--json")
    assert rc == 0 and [b["bundle_id"] for b in json.loads(out)["bundles"]] == ["rollout-000003"]


def test_payloads_read_in_parallel_give_the_same_bundle_and_the_first_failure_by_name(
        bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from replayjob.bundle import reader

    serial = load_bundle(bundle)
    monkeypatch.setattr(reader, "PARALLEL_MIN_BYTES", 0)  # the threaded path on a small bundle
    monkeypatch.setattr(reader, "PARALLEL_FILES", 4)
    monkeypatch.setattr(tensorfile, "CHUNK", 64)  # small chunks, so the file counts as big enough for threads
    monkeypatch.setattr(reader.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(tensorfile.os, "cpu_count", lambda: 4)
    parallel = load_bundle(bundle)
    assert sorted(parallel.payloads) == sorted(serial.payloads)
    for name, t in serial.payloads.items():
        assert t.dtype == parallel.payloads[name].dtype and t.equal(parallel.payloads[name]), name
    for name in ("ref_logprobs", "old_logprobs"):  # two bad tensors: the first in name order is named
        _flip_tensor_byte(bundle, name)
    with pytest.raises(IntegrityError, match="checksum mismatch for payload 'old_logprobs'"):
        load_bundle(bundle)


def _as_format_1(p: Path) -> None:
    """Rewrite a bundle in the format 1.0.0 layout, as that version's writer wrote it: index.json,
    expected.json and one payloads/<name>.safetensors per tensor, pinned by the manifest."""
    m = json.loads((p / "manifest.json").read_bytes())
    tensors = load_bundle(p).payloads
    (p / "payloads").mkdir()
    specs = {}
    for name, t in sorted(tensors.items()):
        blob = save({name: t.contiguous()})
        (p / "payloads" / f"{name}.safetensors").write_bytes(blob)
        specs[name] = {"file": f"payloads/{name}.safetensors", "dtype": m["payloads"][name]["dtype"],
                       "shape": list(t.shape), "bytes": len(blob), "sha256": sha256_bytes(blob),
                       "role": m["payloads"][name]["role"]}
    (p / "payloads.safetensors").unlink()
    (p / "index.json").write_bytes(pretty_bytes(m["index"]))
    (p / "expected.json").write_bytes(pretty_bytes(m["expected"]))
    old = {k: v for k, v in m.items() if k not in ("index", "expected", "payload_file")}
    old.update(format_version="1.0.0", payloads=specs, index_sha256=sha256_json(m["index"]),
               expected_sha256=sha256_json(m["expected"]))
    (p / "manifest.json").write_bytes(pretty_bytes(old))
    c = json.loads((p / "COMPLETE").read_text())
    c["manifest_sha256"] = sha256_bytes((p / "manifest.json").read_bytes())
    (p / "COMPLETE").write_bytes(pretty_bytes(c))


@pytest.mark.parametrize("damage", ["none", "manifest", "no-manifest"])
def test_a_format_1_bundle_is_refused_by_version(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 damage: str) -> None:
    """docs/bundle-format.md: a 1.x bundle is refused (exit 2) naming both versions and what to do."""
    p = write_rollout(tmp_path / "v1")
    _as_format_1(p)
    if damage == "manifest":
        (p / "manifest.json").write_bytes(b"{not json")
    elif damage == "no-manifest":
        (p / "manifest.json").unlink()
    want = "'1.0.0'" if damage == "none" else "'1.x'"
    for cmd in ("validate", "replay"):
        rc, out = _cli(capsys, "bundle", cmd, str(p))
        assert rc == 2 and "Traceback" not in out, out
        assert f"bundle format_version {want} is not read by this replayjob, which reads bundle format 2.2.0" in out
        assert "capture the bundle again with this replayjob" in out
    rc, out = _cli(capsys, "bundle", "inspect", str(p))  # inspect never refuses: it says what it found
    assert rc == 0 and ("format 1.0.0" in out or damage != "none"), out


def test_a_manifest_of_another_major_version_is_refused_by_version(bundle: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    for version in ("1.0.0", "3.0.0"):
        _rewrite(bundle, lambda m, v=version: m.update(format_version=v))
        rc, out = _cli(capsys, "bundle", "validate", str(bundle))
        assert rc == 2 and f"bundle format_version {version!r} is not read by this replayjob" in out, out


def test_an_update_bundle_claiming_2_0_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The update kind appeared in 2.1.0: a manifest that says 2.0.0 contradicts itself."""
    s = make(groups=1, group_size=2)
    w = BundleWriter(tmp_path / "u", kind="update", rollout_id=0, step_id=0, config=s.config)
    w.add_sample("s-0", group="g-0", prompt_length=3, response_length=1, prompt="Q", completion="1", label="1")
    for stage in fmt.KIND_STAGES["update"][1:]:
        w.set_capability(stage, "inspect-only", "not captured here")
    path = w.finalize()
    _rewrite(path, lambda m: m.update(format_version="2.0.0"))
    rc, out = _cli(capsys, "bundle", "validate", str(path))
    assert rc == 2 and "update bundles need format_version 2.1.0 or later; this manifest says '2.0.0'" in out, out
    rc, out = _cli(capsys, "bundle", "inspect", str(path))  # inspect shows it, with the version as a problem
    assert "update bundles need format_version 2.1.0" in out, out


def test_inspect_shows_what_the_declaration_refuses(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """inspect never refuses, but it names what validate would refuse the manifest for (read the same way)."""
    assert inspect_path(bundle)["problems"] == []
    _rewrite(bundle, lambda m: m["index"]["samples"][0].update(prompt_length=-1))
    assert inspect_path(bundle)["problems"] == [
        "manifest.json: field `index.samples[0].prompt_length`: expected `int` >= 0"]
    rc, out = _cli(capsys, "bundle", "validate", str(bundle))
    assert rc == 2 and "field `index.samples[0].prompt_length`: expected `int` >= 0" in out, out
    rc, out = _cli(capsys, "bundle", "inspect", str(bundle))
    assert rc == 0 and "prompt_length" in out, out



@pytest.mark.parametrize("group", [[1, 2], {"g": 0}])
def test_inspect_lists_a_sample_group_that_is_no_id_as_a_problem(bundle: Path, capsys: pytest.CaptureFixture[str],
                                                                 group: object) -> None:
    """A group that is a list or an object (unhashable) is listed among the problems, never a traceback."""
    _rewrite(bundle, lambda m: m["index"]["samples"][0].update(group=group))
    info = inspect_path(bundle)
    assert "index.samples[0]: not a sample record with a string (or null) group" in info["problems"], info
    assert info["samples"] == 8 and info["groups"] == 2
    rc, out = _cli(capsys, "bundle", "inspect", str(bundle))
    assert rc == 0 and "index.samples[0].group" in out and "Traceback" not in out, out


@pytest.mark.parametrize(("multi_rank", "needle"), [
    ({"rank": 0}, "object missing required field `expected_ranks`"),
    ({"rank": 0, "expected_ranks": 5, "run_id": "run-a"}, "field `multi_rank.expected_ranks`: expected `array`"),
    (True, "field `multi_rank`"),
])
def test_inspect_lists_a_malformed_rank_record_as_a_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            multi_rank: object, needle: str) -> None:
    root, run = tmp_path / "mr", new_run_id()
    for r in (1, 0):
        write_rollout(root, rank=r, ranks=[0, 1], groups=4, run_id=run)
    _edit_json(root / "rank-0" / "manifest.json", lambda m: m.update(multi_rank=multi_rank))
    info = inspect_path(root)
    assert "rank-0: multi_rank records no list of expected ranks" in info["problems"], info
    assert any("rank 0's manifest.json has SHA-256" in x for x in info["problems"]), info
    assert any(needle in x for x in info["ranks"][0]["problems"]), info
    assert info["expected_ranks"] == [0, 1]  # read from the rank whose record is well-formed
    rc, out = _cli(capsys, "bundle", "inspect", str(root))
    assert rc == 0 and needle in out and "Traceback" not in out, out


def test_inspect_names_a_linked_rank_directory_and_does_not_read_through_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``rank-1`` linked to a bundle elsewhere: listed as a problem, the bundle it points at never read (validate
    refuses it); a linked bundle in a capture directory likewise."""
    root, run = tmp_path / "mr", new_run_id()
    for r in (1, 0):
        write_rollout(root, rank=r, ranks=[0, 1], groups=4, run_id=run)
    elsewhere = write_rollout(tmp_path / "elsewhere", groups=2, seed=9)
    shutil.rmtree(root / "rank-1")
    os.symlink(elsewhere, root / "rank-1")
    info = inspect_path(root)
    assert "rank-1 is a symbolic link: not read through (validate refuses it)" in info["problems"], info
    assert [r["path"] for r in info["ranks"]] == [str(root / "rank-0")]
    rc, out = _cli(capsys, "bundle", "inspect", str(root))
    assert rc == 0 and "rank-1 is a symbolic link" in out and f"at {root / 'rank-1'}" not in out, out
    assert _cli(capsys, "bundle", "validate", str(root))[0] == 2
    cap = tmp_path / "cap"
    write_rollout(cap / "rollout-000003", groups=2)
    os.symlink(elsewhere, cap / "rollout-000004")
    info = inspect_path(cap)
    assert [b["path"] for b in info["bundles"]] == [str(cap / "rollout-000003")]
    assert info["problems"] == ["rollout-000004 is a symbolic link: not read (a bundle must be a directory, never "
                                "a link)"]

def _resealed(bundle: Path, edit: Callable[[dict[str, Any]], None], root: Path | None = None) -> None:
    """``bundle``'s manifest changed by ``edit`` and every landing record re-pinned to it: only the manifest's own
    rules can refuse it."""
    m = json.loads((bundle / "manifest.json").read_text())
    edit(m)
    data = json.dumps(m, sort_keys=True, separators=(",", ":")).encode()
    (bundle / "manifest.json").write_bytes(data)
    _edit_json(bundle / "COMPLETE", lambda d: d.update(manifest_sha256=sha256_bytes(data)))
    if root is not None:
        rank = int(bundle.name.split("-")[1])
        _edit_json(root / f"COMPLETE.{rank}", lambda d: d.update(manifest_sha256=sha256_bytes(data)))
        _edit_json(root / "COMPLETE", lambda d: d["rank_manifests"].update({str(rank): sha256_bytes(data)}))


def test_a_bundle_holds_its_own_ranks_samples(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every sample of a bundle is its own rank's, and its rank lies below its world size: a single bundle claiming
    rank 3 of 1, or a rank whose samples all name rank 0, is refused by validate and replay alike."""
    single = write_step(tmp_path / "single")
    _resealed(single, lambda m: m["index"]["identity"]["physical"].update(rank=3))
    for command in ("validate", "replay"):
        rc, out = _cli(capsys, "bundle", command, str(single))
        assert rc == 2 and "`index.identity.physical.rank` 3 is not below its world_size 1" in out, out
    root, run = tmp_path / "mr", new_run_id()
    for r in (0, 1):
        write_rollout(root, rank=r, ranks=[0, 1], groups=4, run_id=run)
    _resealed(root / "rank-1", lambda m: [s.update(rank=0) for s in m["index"]["samples"]], root)
    for command in ("validate", "replay"):
        rc, out = _cli(capsys, "bundle", command, str(root))
        assert rc == 2 and "`index.samples[0].rank` is 0, but this bundle is rank 1's" in out, out
