"""Evidence that cannot support a verdict, on tiny synthetic traces built in-process (fast, no replay).

Class 1, non-finite evidence: a NaN or an infinity in compared evidence is never within a bound, in
either argument order, and no ``--json`` output holds a bare ``NaN``/``Infinity``.
Class 2, comparisons over nothing: missing, extra, duplicate or no common sites are refused, every
recorded digest is recomputed from the bytes, and a comparison says how much it compared.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from replayjob.artifacts.trace_store import IDENTITY_KEYS, Site, Trace, make_param, read_trace, row_stats, write_trace
from replayjob.cli import main
from replayjob.digest import sha256_bytes
from replayjob.errors import ContractError, IntegrityError, RefusedError
from replayjob.jsonio import pretty_bytes
from replayjob.runtime import knobs
from replayjob.trace import diff as trace_diff_mod
from replayjob.trace.diff import Side, TraceDiff
from replayjob.trace.envelope import Bound, cosine, envelope, relative_error

ROWS = torch.tensor([2, 3])  # two logical rows: 5 tokens
NON_FINITE = [math.nan, math.inf, -math.inf]
ORDERS = ["finite_first", "non_finite_first"]
ARMS: Any = {"x": None, "y": None}  # only the arm names are read


def _fake(**fields: Any) -> Any:
    """A stand-in for a Replay: only the fields the code under test reads."""
    return SimpleNamespace(**fields)


def _identity(**over: Any) -> dict[str, Any]:
    ident: dict[str, Any] = {k: None for k in IDENTITY_KEYS}
    ident.update(manifest_sha256="a" * 64, logical_batch_sha256="b" * 64, initial_adapter_sha256="c" * 64,
                 arm="baseline", repeat_index=0, micro_batch_size=1, gradient_checkpointing=False, device="cpu",
                 torch_version=torch.__version__)
    ident.update(over)
    return ident


def _site(name: str, values: torch.Tensor) -> Site:
    stats, digests = row_stats(values, ROWS)
    return Site(name, "Linear", values, stats, tuple(digests))


def _trace(forward: tuple[str, ...] = ("m.0", "m.1"), backward: tuple[str, ...] = ("m.1",),
           params: tuple[str, ...] = ("m.0.weight",), poison: float | None = None, **ident: Any) -> Trace:
    """A tiny trace; ``poison`` replaces one element of every site value, gradient and update."""
    def values(k: int) -> torch.Tensor:
        v = torch.arange(20, dtype=torch.float32).reshape(5, 4) / (k + 1) + 1
        if poison is not None:
            v[3, 1] = poison
        return v

    g = torch.linspace(0.5, 1.5, 6).reshape(2, 3)
    if poison is not None:
        g = g.clone()
        g[0, 2] = poison
    return Trace(identity=_identity(**ident), row_tokens=ROWS.clone(),
                 row_micro_batch=torch.zeros(2, dtype=torch.int64),
                 forward=[_site(n, values(k)) for k, n in enumerate(forward)],
                 backward=[_site(n, values(k) * 0.01) for k, n in enumerate(backward)],
                 params=[make_param(n, g.clone(), -0.1 * g) for n in params])


def _side(tmp: Path, name: str, t: Trace) -> Side:
    """Written with the real writer and read back through the verifying reader."""
    write_trace(tmp / name, t)
    return Side(tmp / name, read_trace(tmp / name))


def _strict(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"non-strict JSON literal {name}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def cli_diff(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str]) -> Any:
    """``trace-diff A B --json`` through the CLI on synthetic traces (the replay_metrics pin step skipped)."""
    monkeypatch.setattr(trace_diff_mod, "load_side", lambda p: [Side(Path(p), read_trace(p))])

    def run(a: Trace, b: Trace) -> tuple[int, Any, str]:
        for name, t in (("a", a), ("b", b)):
            if not (tmp_path / name).exists():
                write_trace(tmp_path / name, t)
        capsys.readouterr()
        rc = main(["trace-diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"])
        out = capsys.readouterr()
        return rc, (_strict(out.out) if rc in (0, 1) else None), out.err
    return run


# ---------------------------------------------------------------------------------- class 1: non-finite

@pytest.mark.parametrize("bad", NON_FINITE)
@pytest.mark.parametrize("order", ORDERS)
def test_non_finite_evidence_is_never_within_a_bound(bad: float, order: str, cli_diff: Any) -> None:
    ok = torch.ones(6)
    poisoned = ok.clone()
    poisoned[2] = bad
    x, y = (ok, poisoned) if order == "finite_first" else (poisoned, ok)
    rel, cos = relative_error(x, y), cosine(x, y)
    assert math.isnan(rel) and cos is not None and math.isnan(cos)
    assert math.isnan(relative_error(poisoned, poisoned))  # bitwise equal NaNs are no agreement either
    assert Bound(1e-3, "rounding").judge(rel, False) == "beyond"
    assert Bound(1e-3, "rounding").judge(math.nan, True) == "beyond"
    assert Bound(math.nan, "repeats").judge(0.0, False) == "beyond"
    assert math.isnan(envelope([bad, 0.0][:: 1 if order == "finite_first" else -1], None, 1e-5).value)
    assert math.isnan(envelope([], bad, 1e-5).value)

    # trace-diff through the CLI: beyond in both argument orders, strict JSON with an explicit marker
    a, b = _trace(), _trace(poison=bad)
    rc, rep, _ = cli_diff(*((a, b) if order == "finite_first" else (b, a)))
    assert rc == 1 and rep["classification"] == "beyond" and not rep["identical"]
    site = rep["forward"][0]
    assert site["status"] == "beyond" and site["rel_l2"] is None and site["non_finite"] is True
    grad = rep["params"][0]["grad"]
    assert grad["status"] == "beyond" and grad["rel_l2"] is None and grad["cosine"] is None and grad["non_finite"]
    assert rep["non_finite_sites"] == rep["compared"]["sites"] == 5
    assert rep["layers"]["forward"][0]["max_rel_l2"] is None and rep["layers"]["forward"][0]["non_finite"] == 2
    assert "non-finite" in trace_diff_mod.render(rep)


@pytest.mark.parametrize("bad", NON_FINITE)
def test_identical_non_finite_traces_are_not_trace_identical(bad: float, tmp_path: Path) -> None:
    t = _trace(poison=bad)
    rep = TraceDiff([_side(tmp_path, "a", t)], [_side(tmp_path, "b", t)]).report()
    assert rep["classification"] == "beyond" and rep["exit_code"] == 1
    assert all(r["status"] == "beyond" and r["non_finite"] for r in rep["forward"] + rep["backward"])
    pretty_bytes(rep)  # strict: would raise on a NaN


@pytest.mark.parametrize("bad", NON_FINITE)
@pytest.mark.parametrize("order", ORDERS)
def test_non_finite_gradients_fail_the_approximate_claim(bad: float, order: str) -> None:
    from replayjob.gate.gradients import _param_rows

    traces = [_trace(), _trace(), _trace(poison=bad)]
    arms = ["x", "x", "y"] if order == "finite_first" else ["y", "y", "x"]
    traced = [(_fake(arm=arm), t) for arm, t in zip(arms, traces, strict=True)]
    rows, bad_rel, bad_cos = _param_rows(traced, ARMS)
    assert bad_rel and bad_cos and rows[0]["non_finite"] is True
    assert rows[0]["relative_l2"] == {"median": None, "low": None, "high": None}
    pretty_bytes(rows)
    # a non-finite repeat inside one arm makes the envelope non-finite: never a wider bound
    traced = [(_fake(arm="x"), _trace()), (_fake(arm="x"), _trace(poison=bad)),
              (_fake(arm="y"), _trace())]
    rows, bad_rel, _ = _param_rows(traced, ARMS)
    assert bad_rel and rows[0]["envelope"] is None


@pytest.mark.parametrize("bad", NON_FINITE)
def test_non_finite_updates_budgets_and_ratios_are_never_within_a_bound(bad: float, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from replayjob.gate import budgets, stats, updates

    init = tmp_path / "init.safetensors"
    save_file({"w": torch.zeros(4)}, str(init))
    members = []
    for i, u in enumerate([torch.ones(4), torch.tensor([1.0, 1.0, bad, 1.0])]):
        save_file({"w": u}, str(tmp_path / f"{i}.safetensors"))
        members.append(updates.Member(f"r{i}", "x", tmp_path / f"{i}.safetensors"))
    pairs = updates.pairwise(init, members)
    for p in pairs:  # both orders
        assert p.cosine is not None and p.relative_delta_l2 is not None
        assert not math.isfinite(p.cosine) and not math.isfinite(p.relative_delta_l2)
    s = updates.summarize(pairs)["all"]
    assert s["cosine"]["non_finite"] == 2 and s["cosine"]["median"] is None
    pretty_bytes(s)
    bad_cos, bad_rel = updates.offenders(pairs, -1.0, 1e9)  # the loosest tolerances still fail them
    assert len(bad_cos) == len(bad_rel) == 2

    r = stats.bootstrap_ratio([1.0, bad, 1.0], [1.0, 1.0, 1.0], resamples=50)
    assert r["ratio"] is None and r["excludes_1"] is None
    r = stats.bootstrap_ratio([1.0, 1.0, 1.0], [1.0, bad, 1.0], resamples=50)
    assert r["ratio"] is None and r["excludes_1"] is None

    def replay(v: float) -> Any:
        return _fake(measures={"local_train_wall_s": v})

    bound = budgets.Bound("on", "local_train_wall_s", "max_ratio", 1.5)
    for pair in ((replay(1.0), replay(bad)), (replay(bad), replay(1.0))):
        out = budgets._decide(bound, [pair, (replay(1.0), replay(1.0))], 0.95)
        assert out["decision"] == "refused" and "not finite" in out["note"]


def test_cli_json_writer_never_emits_nan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from replayjob.bundle.synthetic import write_rollout
    from replayjob.jsonio import non_finite_as_strings

    with pytest.raises(IntegrityError):
        pretty_bytes({"x": math.nan})
    assert non_finite_as_strings({"a": [math.nan, math.inf, -math.inf, 1.0]}) == \
        {"a": ["NaN", "Infinity", "-Infinity", 1.0]}
    p = write_rollout(tmp_path / "nan", inject={"kl": (1, 0, float("nan"))})
    capsys.readouterr()
    assert main(["bundle", "replay", str(p), "--json"]) == 1
    rep = _strict(capsys.readouterr().out)
    assert rep["verdict"] == "diverged"


# ------------------------------------------------------------------------- class 2: over nothing

@pytest.mark.parametrize(("a_kw", "b_kw", "named"), [
    ({"forward": ("m.0",), "backward": (), "params": ()},
     {"forward": ("n.0",), "backward": (), "params": ()}, "forward:m.0"),  # nothing in common
    ({}, {"forward": ("m.0", "m.1", "m.2")}, "forward:m.2"),              # extra site
    ({}, {"backward": ()}, "backward:m.1"),                                  # missing site
    ({}, {"params": ("m.0.weight", "m.1.weight")}, "param:m.1.weight"),      # extra parameter
])
@pytest.mark.parametrize("order", ORDERS)
def test_trace_diff_refuses_unmatched_sites(a_kw: dict[str, Any], b_kw: dict[str, Any], named: str, order: str,
                                            cli_diff: Any) -> None:
    a, b = _trace(**a_kw), _trace(**b_kw)
    rc, _, err = cli_diff(*((a, b) if order == "finite_first" else (b, a)))
    assert rc == 2 and named in err and "fix:" in err and "Traceback" not in err


def test_trace_diff_says_what_it_compared_and_admits_checkpointing_gradients(tmp_path: Path) -> None:
    rep = TraceDiff([_side(tmp_path, "a", _trace())], [_side(tmp_path, "b", _trace())]).report()
    assert rep["identical"] and rep["compared"] == {"forward": 2, "backward": 1, "params": 1, "sites": 5}
    assert "compared 5 sites" in trace_diff_mod.render(rep)
    gc = _side(tmp_path, "gc", _trace(backward=("m.0", "m.1"), gradient_checkpointing=True))
    rep = TraceDiff([_side(tmp_path, "a2", _trace())], [gc]).report()
    assert rep["unmatched"] == {"only_a": [], "only_b": ["backward:m.0"]} and rep["compared"]["backward"] == 1
    with pytest.raises(ContractError, match=r"backward:m\.0"):  # the same extra site without the knob
        TraceDiff([_side(tmp_path, "a3", _trace())], [_side(tmp_path, "b3", _trace(backward=("m.0", "m.1")))])


def _traced_replay(d: Path, t: Trace) -> Any:
    """A stand-in for the replay in ``d`` whose trace ``t`` is written there: its metrics record what the trace's
    identity says (as a replay's own trace does)."""
    _, sha = write_trace(d, t)
    i = t.identity
    return _fake(arm=i["arm"], repeat_index=i["repeat_index"], label=f"{i['arm']}#{i['repeat_index']}",
                 trace_index_sha256=sha, path=d / "replay_metrics.json", manifest=i["manifest_sha256"],
                 logical=i["logical_batch_sha256"], initial_adapter=i["initial_adapter_sha256"], device=i["device"],
                 doc={"torch_version": i["torch_version"]}, framework=knobs.BUILTIN,
                 runtime={knobs.GRADIENT_CHECKPOINTING: i["gradient_checkpointing"],
                          "training.micro_batch_size": i["micro_batch_size"]})


def test_approximate_claim_over_no_parameter_is_refused(tmp_path: Path) -> None:
    from replayjob.gate.checks import REFUSED
    from replayjob.gate.gradients import approximate_checks

    replays = [_traced_replay(tmp_path / arm, _trace(params=(), arm=arm, repeat_index=i))
               for i, arm in enumerate(("x", "y"))]
    checks = approximate_checks(replays, ARMS)
    assert [c.status for c in checks] == [REFUSED, REFUSED] and "no trainable parameter" in checks[0].detail


def test_reduce_reads_only_a_replays_own_trace(tmp_path: Path) -> None:
    """Another replay's trace re-pinned in a replay's metrics (arm y holding arm x's trace, so its gradients are x's)
    is refused by reduce's gradient checks and localisation, as trace-diff refuses it: never compared as y's."""
    from replayjob.gate.gradients import approximate_checks, localise

    x = _traced_replay(tmp_path / "x", _trace(arm="x"))
    y = _traced_replay(tmp_path / "y", _trace(arm="y", repeat_index=1))
    y.final_adapter, x.final_adapter = "1" * 64, "2" * 64
    assert [c.status for c in approximate_checks([x, y], ARMS)] == ["pass", "pass"]
    (tmp_path / "y" / "trace").rename(tmp_path / "y-own")
    write_trace(tmp_path / "y", _trace(arm="x"))  # x's trace in y's place, its index re-pinned in y's metrics
    y.trace_index_sha256 = sha256_bytes((tmp_path / "y" / "trace" / "index.json").read_bytes())
    for run in (lambda: approximate_checks([x, y], ARMS), lambda: localise([x, y], "1" * 64)):
        with pytest.raises(IntegrityError, match=r"the trace is not this replay's: its identity\.arm is 'x'"):
            run()


@pytest.mark.parametrize(("field", "value"), [("gradient_checkpointing", True), ("micro_batch_size", 2)])
def test_a_trace_of_another_condition_is_not_the_replays(tmp_path: Path, field: str, value: Any) -> None:
    """A trace whose checkpointing or micro-batch size is not what its replay's observed knobs say (a trace of the
    same replay's checkpointed twin, re-pinned) is refused by every reader of a replay's trace, as another arm's is."""
    from replayjob.trace.diff import replay_trace

    x = _traced_replay(tmp_path / "x", _trace(arm="x"))
    assert knobs.trace_condition(x.framework, x.runtime) == {"gradient_checkpointing": False, "micro_batch_size": 1}
    write_trace(tmp_path / "x-other", _trace(arm="x", **{field: value}))
    (tmp_path / "x" / "trace").rename(tmp_path / "x-own")
    (tmp_path / "x-other" / "trace").rename(tmp_path / "x" / "trace")
    x.trace_index_sha256 = sha256_bytes((tmp_path / "x" / "trace" / "index.json").read_bytes())
    with pytest.raises(IntegrityError, match=rf"the trace is not this replay's: its identity\.{field} is {value!r}"):
        replay_trace(x, tmp_path / "x")
    x.runtime = {**x.runtime, "training.micro_batch_size": True}  # a flag is not the count 1
    (tmp_path / "x" / "trace").rename(tmp_path / "x-other" / "trace")
    (tmp_path / "x-own").rename(tmp_path / "x" / "trace")
    x.trace_index_sha256 = sha256_bytes((tmp_path / "x" / "trace" / "index.json").read_bytes())
    with pytest.raises(IntegrityError, match=r"its identity\.micro_batch_size is 1"):
        replay_trace(x, tmp_path / "x")


def test_duplicate_site_names_are_refused(tmp_path: Path) -> None:
    dup = _trace(forward=("m.0", "m.0"))
    write_trace(tmp_path / "dup", dup)
    with pytest.raises(IntegrityError, match="more than once"):
        read_trace(tmp_path / "dup")
    with pytest.raises(IntegrityError, match=r"forward:m\.0"):  # in-memory traces too (last must not win)
        TraceDiff([Side(tmp_path / "x", dup)], [Side(tmp_path / "y", dup)])


def _reseal(d: Path, change: Any) -> None:
    """Rewrite the payload with ``change(tensors)``, then re-pin it in the index (a re-sealed forgery)."""
    from safetensors.torch import load, save

    pay, index = d / "trace" / "trace.safetensors", d / "trace" / "index.json"
    tensors = load(pay.read_bytes())
    change(tensors)
    data = save(tensors, metadata={"format": "replayjob.trace/v1"})
    pay.chmod(0o644)
    pay.write_bytes(data)
    doc = json.loads(index.read_text())
    doc["payload"].update(sha256=sha256_bytes(data), bytes=len(data))
    index.chmod(0o644)
    index.write_bytes(pretty_bytes(doc))


def test_the_payload_size_the_index_records_is_the_payloads(tmp_path: Path) -> None:
    write_trace(tmp_path / "t", _trace())
    index = tmp_path / "t" / "trace" / "index.json"
    doc = json.loads(index.read_text())
    doc["payload"]["bytes"] += 7  # re-sealed: the payload's own digest, another size
    index.chmod(0o644)
    index.write_bytes(pretty_bytes(doc))
    with pytest.raises(IntegrityError, match="records a payload of"):
        read_trace(tmp_path / "t")


def test_a_scalar_parameter_is_digested_not_crashed(tmp_path: Path) -> None:
    """A 0-dimensional parameter (the index allows shape ``[]``) is written, read and its recorded digests are
    recomputed; a re-sealed one whose digest is not its bytes is refused (exit 2), never a crash (exit 3)."""
    t = _trace(params=())
    t.params.append(make_param("scale", torch.tensor(1.5), torch.tensor(-0.25)))
    write_trace(tmp_path / "t", t)
    assert float(read_trace(tmp_path / "t").params[0].grad) == 1.5

    def change(x: dict[str, torch.Tensor]) -> None:
        x["param.0000.grad"] = torch.tensor(2.5)
    _reseal(tmp_path / "t", change)
    with pytest.raises(IntegrityError, match="'scale': the recorded gradient or update SHA-256 does not match"):
        read_trace(tmp_path / "t")


def _swap_sites(t: dict[str, torch.Tensor]) -> None:
    t["forward.0000.values"], t["forward.0001.values"] = t["forward.0001.values"], t["forward.0000.values"]


def _swap_params(t: dict[str, torch.Tensor]) -> None:
    t["param.0000.grad"], t["param.0000.update"] = t["param.0000.update"], t["param.0000.grad"]


@pytest.mark.parametrize(("change", "message"), [(_swap_sites, "forward site 'm.0'"),
                                                 (_swap_params, "parameter 'm.0.weight'")])
def test_recorded_digests_are_recomputed_from_the_bytes(change: Any, message: str, tmp_path: Path) -> None:
    write_trace(tmp_path / "t", _trace())
    read_trace(tmp_path / "t")
    _reseal(tmp_path / "t", change)
    with pytest.raises(IntegrityError, match=message) as exc:
        read_trace(tmp_path / "t")
    assert "does not match" in exc.value.message


def _nan_stats(t: dict[str, torch.Tensor]) -> None:
    t["forward.stats"] = torch.full_like(t["forward.stats"], float("nan"))


def _empty_param_stats(t: dict[str, torch.Tensor]) -> None:
    t["param.stats"] = torch.zeros(0, dtype=torch.float64)


def _scaled_param_stats(t: dict[str, torch.Tensor]) -> None:
    t["param.stats"] = t["param.stats"] * 2


@pytest.mark.parametrize(("change", "message"), [(_nan_stats, "forward site 'm.0': the recorded statistics"),
                                                 (_empty_param_stats, "param.stats"),
                                                 (_scaled_param_stats, "param.stats")])
def test_recorded_statistics_are_recomputed_from_the_values(change: Any, message: str, tmp_path: Path) -> None:
    """The statistics tables are the values' (like the digests): a re-sealed table of NaNs, of another shape or of
    other numbers is refused, though no comparison reads them today."""
    write_trace(tmp_path / "t", _trace())
    read_trace(tmp_path / "t")
    _reseal(tmp_path / "t", change)
    with pytest.raises(IntegrityError, match=message):
        read_trace(tmp_path / "t")


def test_diag_diff_refuses_to_call_nothing_equal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"step": 0, "wall_s": 1.0}\n{"step": 1, "wall_s": 2.0}\n')
    b.write_text('{"step": 0, "wall_s": 3.0}\n{"step": 1, "wall_s": 4.0}\n')
    assert main(["diag-diff", str(a), str(b), "--ignore", "step"]) == 2  # every leaf ignored: refused
    assert "nothing compared" in capsys.readouterr().err
    assert main(["diag-diff", str(a), str(b)]) == 2  # the steps only aligned the rows: nothing compared
    assert "but the step that aligned them" in capsys.readouterr().err
    b.write_text('{"step": 0, "wall_s": 1.0}\n{"step": 1, "wall_s": 2.0}\n')
    assert main(["diag-diff", str(a), str(b), "--ignore", "step"]) == 2  # byte-equal rows, nothing compared
    with pytest.raises(RefusedError, match="nothing compared"):
        from replayjob.check.diagdiff import diff_files
        diff_files(a, b, ignore=["step"])


def _wrapping_row_tokens(t: dict[str, torch.Tensor]) -> None:
    """Four rows whose token counts sum, in int64, to 5 (2**64 + 5 wraps): every table re-shaped to four rows."""
    t["rows.tokens"] = torch.tensor([2**62, 2**62, 2**62, 2**62 + 5], dtype=torch.int64)
    t["rows.micro_batch"] = torch.zeros(4, dtype=torch.int64)
    for prefix in ("forward", "backward"):
        n = t[f"{prefix}.stats"].shape[0]
        t[f"{prefix}.stats"] = torch.zeros((n, 4, 3), dtype=torch.float64)
        t[f"{prefix}.sha256"] = torch.zeros((n, 4, 32), dtype=torch.uint8)


def _negative_micro_batch(t: dict[str, torch.Tensor]) -> None:
    t["rows.micro_batch"] = torch.tensor([-5, 0], dtype=torch.int64)


def _wide_param_digests(t: dict[str, torch.Tensor]) -> None:
    t["param.sha256"] = t["param.sha256"].to(torch.int64)


@pytest.mark.parametrize(("change", "rows", "message"), [
    # the int64 sum wrapped to the index's token count and the row statistics crashed (IndexError, exit 3)
    (_wrapping_row_tokens, 4, "rows.tokens does not match the index"),
    (_negative_micro_batch, None, "rows.micro_batch is not one micro-batch index"),
    (_wide_param_digests, None, "param.sha256 is torch.int64"),
])
def test_a_re_sealed_row_table_is_refused_not_crashed(change: Any, rows: int | None, message: str,
                                                      tmp_path: Path) -> None:
    write_trace(tmp_path / "t", _trace())
    _reseal(tmp_path / "t", change)
    if rows is not None:
        index = tmp_path / "t" / "trace" / "index.json"
        index.write_bytes(pretty_bytes({**json.loads(index.read_text()), "rows": rows}))
    with pytest.raises(IntegrityError, match=message):
        read_trace(tmp_path / "t")


@pytest.mark.parametrize(("path", "value"), [("forward.0.name", "m.0\nEQUAL m.1"), ("forward.0.kind", "Linear\x1b[2J"),
                                             ("params.0.name", "w\u202e"), ("identity.arm", "a\rb"),
                                             ("untraced", ["x\n"])])
def test_index_strings_trace_diff_prints_are_printable(path: str, value: Any, tmp_path: Path) -> None:
    """A site, parameter or arm name is printed as is by trace-diff: one holding a newline, an escape or a bidi
    control printed lines (or text) the trace never held."""
    write_trace(tmp_path / "t", _trace())
    index = tmp_path / "t" / "trace" / "index.json"
    doc = json.loads(index.read_text())
    node: Any = doc
    *head, last = path.split(".")
    for k in head:
        node = node[int(k)] if isinstance(node, list) else node[k]
    node[last] = value
    index.chmod(0o644)
    index.write_bytes(pretty_bytes(doc))
    with pytest.raises(IntegrityError, match=last):
        read_trace(tmp_path / "t")


def _no_tokens(t: dict[str, torch.Tensor]) -> None:
    t["rows.tokens"] = torch.zeros(2, dtype=torch.int64)
    for k in list(t):
        if k.endswith(".values"):
            t[k] = torch.zeros((0, t[k].shape[1]), dtype=t[k].dtype)


def test_a_trace_of_no_token_is_refused_not_crashed_or_compared(tmp_path: Path) -> None:
    """Sites of zero tokens: the row statistics crashed (a reshape of an empty array, exit 3), and a trace sealed
    with them and no parameter compared nothing and read as equal."""
    stats, digests = row_stats(torch.zeros((0, 4)), torch.tensor([0, 0]))  # no crash on empty values
    assert stats.shape == (2, 3) and not bool(stats.any()) and digests == [sha256_bytes(b"")] * 2
    write_trace(tmp_path / "t", _trace())
    _reseal(tmp_path / "t", _no_tokens)
    index = tmp_path / "t" / "trace" / "index.json"
    index.write_bytes(pretty_bytes({**json.loads(index.read_text()), "tokens": 0}))
    with pytest.raises(IntegrityError, match="tokens"):
        read_trace(tmp_path / "t")
