"""Symbolic links inside artifacts are refused (SECURITY.md, "Paths inside artifacts"), by the one rule in
:mod:`replayjob.fsio`: readers open no file through a link unless told to follow (a file the user names),
and :func:`~replayjob.fsio.check_no_symlinks` refuses a link anywhere below the artifact directory.

Each case moves one piece of valid synthetic evidence out of its artifact and leaves a link to it in its
place, so that without the rule the evidence would be read and would pass (the controls show it does).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from replayjob.artifacts import capture_manifest as mf
from replayjob.artifacts import capture_payload as payload
from replayjob.artifacts import capture_root as ranks
from replayjob.artifacts import metrics as M
from replayjob.cli import main
from replayjob.digest import sha256_bytes, sha256_file
from replayjob.errors import IntegrityError
from replayjob.fsio import check_no_symlinks, read_regular_bytes
from replayjob.gate import synthetic
from replayjob.jsonio import pretty_bytes, read_json
from replayjob.producers.builtin import ranks as rankrows
from replayjob.rl.batch import OptimizerBatch
from replayjob.runtime.knobs import WORLD_SIZE

ARMS: dict[str, dict[str, Any]] = {"one": {}, "two": {WORLD_SIZE: 2}}


def link_away(p: Path, outside: Path) -> Path:
    """Move ``p`` (a file or a directory) to ``outside`` and leave a symbolic link to it in its place."""
    outside.mkdir(parents=True, exist_ok=True)
    target = outside / f"{p.parent.name}-{p.name}"
    shutil.move(p, target)
    os.symlink(target, p)
    return p


def refused_for_the_link(code: int, message: str, link: Path) -> None:
    """Exit 2, and the message says a symbolic link was refused and names it (``where``: the link's path)."""
    assert code == 2, message
    assert "symbolic link" in message and f"{link}: " in message, message


# ------------------------------------------------------------------------------------------------ the rule
def test_check_no_symlinks_refuses_a_link_at_any_depth_below_the_root_only(tmp_path: Path) -> None:
    real = tmp_path / "real"
    (real / "run" / "final_adapter").mkdir(parents=True)
    f = real / "run" / "final_adapter" / "adapter_model.safetensors"
    f.write_bytes(b"x")
    os.symlink(real, tmp_path / "via")  # the root may be reached through links above it (/tmp on macOS)
    for root in (real / "run", tmp_path / "via" / "run"):
        assert check_no_symlinks(root, root / "final_adapter" / f.name) == root / "final_adapter" / f.name
        assert check_no_symlinks(root, root / "missing" / "file") == root / "missing" / "file"  # open reports it
    os.symlink(real / "run", tmp_path / "run-link")
    assert check_no_symlinks(tmp_path / "run-link", tmp_path / "run-link" / "final_adapter")  # the root itself
    d = real / "run2"
    shutil.copytree(real / "run", d)
    link_away(d / "final_adapter", tmp_path / "outside")
    with pytest.raises(IntegrityError, match="'final_adapter' is a symbolic link") as e:
        check_no_symlinks(d, d / "final_adapter" / f.name)
    assert e.value.exit_code == 2 and e.value.where == str(d / "final_adapter") and e.value.hint
    d = real / "run3"
    shutil.copytree(real / "run", d)
    link_away(d / "final_adapter" / f.name, tmp_path / "outside3")
    with pytest.raises(IntegrityError, match=r"'adapter_model\.safetensors' is a symbolic link"):
        check_no_symlinks(d, d / "final_adapter" / f.name)
    os.mkfifo(real / "run" / "fifo")
    with pytest.raises(IntegrityError, match="not a regular file or directory"):
        check_no_symlinks(real / "run", real / "run" / "fifo")
    with pytest.raises(IntegrityError, match=r"'adapter_model\.safetensors' is not a directory"):
        check_no_symlinks(real / "run", real / "run" / "final_adapter" / f.name / "below")
    for escape in (real / "run" / ".." / "run2" / "x", tmp_path / "elsewhere"):
        with pytest.raises(IntegrityError, match="artifact directory"):
            check_no_symlinks(real / "run", escape)


def test_readers_refuse_a_linked_file_unless_told_to_follow(tmp_path: Path) -> None:
    f = tmp_path / "doc.json"
    f.write_bytes(b'{"a": 1}')
    link = tmp_path / "link.json"
    os.symlink(f, link)
    for read in (lambda p, **k: read_regular_bytes(p, max_bytes=100, **k), lambda p, **k: sha256_file(p, **k),
                 lambda p, **k: read_json(p, **k)):
        with pytest.raises(IntegrityError, match="symbolic link"):
            read(link)  # the default: a file inside an artifact
        assert read(link, follow_symlinks=True) == read(f)  # a file the user names (a config) may be a link


# ------------------------------------------------------------------------------------------------ reduce
@pytest.fixture
def ev(tmp_path: Path) -> synthetic.Evidence:
    return synthetic.build(tmp_path / "ev", {"one": {}}, 3)


def reduce(ev: synthetic.Evidence, *extra: str) -> tuple[int, dict[str, Any]]:
    out = ev.root.parent / "out" / "verdict.json"
    code = main(["reduce", str(ev.root / "replays"), "--claim", "bitwise", "--source", str(ev.source),
                 "--out", str(out), *extra])
    doc = json.loads(out.read_text())
    assert doc["exit_code"] == code
    return code, doc


def refusal(doc: dict[str, Any]) -> str:
    """The verdict's refusal as the CLI prints it: ``where: message``."""
    r = doc["refusal"] or {}
    return f"{r.get('where')}: {r.get('message')}"


@pytest.mark.parametrize("what", ["adapter file", "adapter directory", "replay metrics"])
def test_reduce_refuses_a_linked_replay_file_or_directory(ev: synthetic.Evidence, what: str) -> None:
    assert reduce(ev)[0] == 0  # the control: this evidence passes
    run = ev.replay_files[1].parent
    p = {"adapter file": run / synthetic.ADAPTER, "adapter directory": (run / synthetic.ADAPTER).parent,
         "replay metrics": ev.replay_files[1]}[what]
    link_away(p, ev.root.parent / "outside")
    code, doc = reduce(ev)
    refused_for_the_link(code, refusal(doc), p)


def split_into_ranks(replay: Path) -> None:
    """Make ``replay`` a replay over two ranks (docs/replay-metrics.md): rank 0 did all the work, rank 1
    none, and the replay's figures are their merge, as a real one's are."""
    doc = json.loads(replay.read_text())
    rows = doc["rows"]["rows"]
    bounds = [[0, rows], [rows, rows]]
    docs = [M.rank_document(rank=r, world_size=2, replay=doc, rows=bounds[r], shard_logical=f"{r}" * 64,
                            shard_effective=f"{r + 2}" * 64, loss=doc["loss"],
                            micro_batch_rows=[rows] if r == 0 else []) for r in range(2)]
    docs[1].update(loss=0.0, padding={"real_tokens": 0, "padded_tokens": 0, "padding_fraction": 0.0,
                                      "micro_batches": 0})
    entries = []
    for r, d in enumerate(docs):
        data = pretty_bytes(d)
        (replay.parent / M.rank_file(r)).write_bytes(data)
        entries.append({"rank": r, "file": M.rank_file(r), "sha256": sha256_bytes(data), "rows": bounds[r]})
    doc.update(M.merge_ranks(docs))
    doc[M.DISTRIBUTED] = {"world_size": 2, "strategy": doc["runtime"].get("distributed.strategy"),
                          "sharding": "contiguous", "ranks": entries}
    replay.write_bytes(pretty_bytes(doc))


def test_reduce_refuses_a_linked_rank_metrics_file(tmp_path: Path) -> None:
    ev = synthetic.build(tmp_path / "ev", ARMS, 2)
    for f in ev.replay_files:
        if json.loads(f.read_text())["arm"] == "two":
            split_into_ranks(f)
    assert reduce(ev, "--min-repeats", "2")[0] == 0  # the control: replays over two ranks pass
    rank1 = ev.replay_files[-1].parent / M.rank_file(1)
    link_away(rank1, tmp_path / "outside")
    code, doc = reduce(ev, "--min-repeats", "2")
    refused_for_the_link(code, refusal(doc), rank1)


# ------------------------------------------------------------------------------------------------ trace-diff
def traced_replay(d: Path, index: int) -> Path:
    """A replay directory holding a tiny trace (written by the trace writer) and the replay_metrics.json
    that pins its index, as ``replay --trace`` leaves one."""
    from replayjob.artifacts.trace_store import IDENTITY_KEYS, Site, Trace, make_param, row_stats, write_trace

    row_tokens = torch.tensor([2, 3], dtype=torch.int64)
    values = torch.arange(10, dtype=torch.float32).reshape(5, 2)
    stats, digests = row_stats(values, row_tokens)
    def site() -> Site:
        return Site("layers.0", "module", values.clone(), stats.clone(), tuple(digests))

    identity: dict[str, Any] = {k: synthetic.digest_of(k) for k in IDENTITY_KEYS if k.endswith("sha256")}
    identity.update(arm="one", repeat_index=index, micro_batch_size=4, gradient_checkpointing=False, device="cpu",
                    torch_version="2.4.0", fault=None,  # what the replay_metrics.json below records of its replay
                    manifest_sha256=synthetic.digest_of("m"), logical_batch_sha256=synthetic.digest_of("logical"),
                    initial_adapter_sha256=synthetic.digest_of("i"))
    trace = Trace(identity, row_tokens, torch.zeros(2, dtype=torch.int64), [site()], [site()],
                  [make_param("layers.0.weight", torch.ones(2, 2), torch.full((2, 2), 0.5))])
    _, index_sha = write_trace(d, trace)
    doc = synthetic.replay_doc(arm="one", index=index, knobs={}, manifest_sha256=synthetic.digest_of("m"),
                               initial_sha256=synthetic.digest_of("i"), final_sha256=synthetic.digest_of("f"),
                               loss=0.5)
    doc[M.TRACE] = {M.TRACE_INDEX_PATH: M.TRACE_INDEX, M.TRACE_INDEX_SHA256: index_sha}
    (d / M.REPLAY_FILE).write_bytes(pretty_bytes(doc))
    return d


def test_trace_diff_refuses_one_trace_compared_with_itself(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The same replay named twice, through a link to its directory, or a copy whose trace files are hard links
    of its own: a trace compared with itself is equal, so it is refused (exit 2), not passed."""
    a = traced_replay(tmp_path / "a", 0)
    linked = tmp_path / "linked"
    linked.symlink_to(a, target_is_directory=True)
    hard = tmp_path / "hard"
    (hard / "trace").mkdir(parents=True)
    shutil.copyfile(a / M.REPLAY_FILE, hard / M.REPLAY_FILE)
    for f in (a / "trace").iterdir():
        os.link(f, hard / "trace" / f.name)
    for other in (a, linked, hard):
        capsys.readouterr()
        assert main(["trace-diff", str(a), str(other)]) == 2, other
        err = capsys.readouterr().err
        assert "one file" in err and "Traceback" not in err
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)  # the control: a copy is another file of the same bytes, compared as two traces
    assert main(["trace-diff", str(a), str(copy)]) == 0


def test_trace_diff_refuses_a_linked_trace_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = traced_replay(tmp_path / "a", 0), traced_replay(tmp_path / "b", 1)
    assert main(["trace-diff", str(a), str(b)]) == 0  # the control: two identical traces
    link = link_away(b / "trace", tmp_path / "outside")
    capsys.readouterr()
    code = main(["trace-diff", str(a), str(b)])
    refused_for_the_link(code, capsys.readouterr().err, link)


# ------------------------------------------------------------------------------------------------ a capture over ranks
def write_capture_over_two_ranks(out: Path, config: dict[str, Any] | None = None,
                                 adapter_sha256: str | None = None) -> tuple[Path, str]:
    """A capture over two ranks (synthetic rows), written by the capture's own writers: each rank's payload, manifest
    and landing record, then the root recording ``config`` (default: the synthetic source's); the root's path and
    SHA-256.  Nothing is read back, so a contradictory ``config`` is written as given."""
    rows = 4
    resp = [2 + i for i in range(rows)]
    mask = torch.zeros((rows, max(resp)), dtype=torch.float64)
    for i, n in enumerate(resp):
        mask[i, :n] = 1
    # each field in its declared domain (capture_payload.FIELD_DOMAINS: a log-probability is <= 0)
    fields = {k: torch.full_like(mask, -0.25 if k.endswith("logprobs") else 0.25) * mask
              for k in ("old_logprobs", "ref_logprobs", "advantages", "loss_weights")}
    batch = OptimizerBatch.from_padded([[5 + i] * 3 + [7] * n for i, n in enumerate(resp)], [3] * rows, fields, mask)
    rng = {"cpu": torch.get_rng_state()}
    for r, (begin, end) in enumerate([(0, 2), (2, 4)]):
        shard, where = batch.shard(begin, end), out / ranks.rank_dir(r)
        where.mkdir(parents=True)
        data = payload.encode(shard, rng)
        (where / mf.payload_name(0)).write_bytes(data)
        logical, effective = shard.digests()
        doc = mf.build(step=0, producer={"replayjob_version": "0.1.0"}, payload_file=mf.payload_name(0),
                       payload_size=len(data), payload_digest=payload.digest_bytes(data), rng_keys=list(rng),
                       rows=payload.summary(shard), logical=logical, effective=effective,
                       resolved_config=copy.deepcopy(synthetic.SOURCE_CONFIG if config is None else config),
                       contract={"schema": "synthetic"}, adapter_path=Path("adapter_model.safetensors"),
                       adapter_size=1, adapter_sha256=adapter_sha256 or synthetic.digest_of("initial"))
        ranks.land(out, r, 2, mf.write(where / mf.manifest_name(0), doc))
    *_, sha = rankrows.write_root(out, step=0, world=2, strategy="ddp", bucket_cap_mb=25.0, backend="gloo",
                               producer={"replayjob_version": "0.1.0"})
    return out / mf.manifest_name(0), sha


def capture_over_two_ranks(out: Path) -> ranks.RootManifest:
    """:func:`write_capture_over_two_ranks`, read back as explain and replay read it."""
    _, sha = write_capture_over_two_ranks(out)
    root = ranks.read_capture(out / mf.manifest_name(0), sha)
    assert isinstance(root, ranks.RootManifest)
    return root


def test_a_capture_whose_rank_directory_is_a_link_is_refused(tmp_path: Path) -> None:
    root = capture_over_two_ranks(tmp_path / "source")
    assert rankrows.verify(root).batch.rows == 4  # the control: every rank verifies
    link = link_away(tmp_path / "source" / ranks.rank_dir(1), tmp_path / "outside")
    with pytest.raises(IntegrityError) as e:
        rankrows.verify(root)  # what explain and replay run on a capture over ranks
    refused_for_the_link(e.value.exit_code, e.value.diagnostics(), link)


@pytest.mark.parametrize("name", ["replay.toml", "replay_step_000000.toml"])
def test_a_specs_capture_whose_replay_config_is_a_link_is_refused(ev: synthetic.Evidence, name: str,
                                                                  tmp_path: Path) -> None:
    """A spec's ``[capture]`` names a replay config inside the capture: read through no link (it was followed)."""
    from replayjob.launch.capture_ref import capture_pins
    config = ev.source / name
    config.write_text("# the capture's replay config\n")
    if name == "replay.toml":  # control: the regular file is the capture's own
        assert capture_pins(ev.source, name)[1] == ev.manifest_sha256
    link_away(config, tmp_path / "outside")
    with pytest.raises(IntegrityError, match="symbolic link"):
        capture_pins(ev.source, name)


@pytest.mark.parametrize(("make", "needle"), [
    ("file", "the output directory is not a directory"),
    ("below-file", "lies below something that is not a directory"),
    ("dangling", "the output directory is a link to nothing"),
    ("below-dangling", "lies below a link to nothing"),
])
def test_an_output_directory_that_is_no_directory_is_refused(tmp_path: Path, make: str, needle: str) -> None:
    """``refuse_unusable_out``: a file, a path below one, a link to nothing or a path below one is refused before
    any work; a directory, a path still to be made, and a link to a directory are not."""
    from replayjob.errors import UsageError
    from replayjob.fsio import refuse_unusable_out

    (tmp_path / "f").write_bytes(b"x")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    out = {"file": tmp_path / "f", "below-file": tmp_path / "f" / "a" / "b", "dangling": tmp_path / "gone",
           "below-dangling": tmp_path / "gone" / "a"}[make]
    with pytest.raises(UsageError, match=needle):
        refuse_unusable_out(out)
    (tmp_path / "d").mkdir()
    (tmp_path / "to-d").symlink_to(tmp_path / "d")
    for fine in (tmp_path / "d", tmp_path / "new" / "deeper", tmp_path / "to-d", tmp_path / "to-d" / "x"):
        refuse_unusable_out(fine)


def test_an_output_directory_another_rank_makes_meanwhile_is_no_file(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun every rank checks the output directory while rank 0 makes it: a look that found nothing, then
    (a second look) the new directory, read it as something that is not one and refused the run on one rank.  Each
    path is looked at once."""
    import os

    from replayjob import fsio

    out = tmp_path / "run"
    real, made = os.stat, []

    def stat_then_made(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return real(path, *args, **kwargs)
        finally:
            if os.fspath(path) == os.fspath(out) and not made:
                os.mkdir(out)  # the other rank, just after this rank looked
                made.append(out)

    monkeypatch.setattr(fsio.os, "stat", stat_then_made)
    fsio.refuse_unusable_out(out)
    assert out.is_dir()
