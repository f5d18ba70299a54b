"""Layer-level tracing at replay and trace-diff, on real traced replays of the shared capture (CPU).

Every replay here is a real one (tiny Llama + peft LoRA built from config), run in-process through
``replayjob.cli.main``; the planted fault is the test-only ``REPLAYJOB_TRACE_FAULT`` hook armed
in-process with :func:`replayjob.producers.trace_fault.configure`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import replay_pins

from replayjob.artifacts.trace_store import read_trace
from replayjob.cli import main
from replayjob.jsonio import pretty_bytes
from replayjob.producers import trace_fault as fault
from replayjob.trace.envelope import Bound, envelope, relative_error, rounding_bound

FAULT_MODULE = "base_model.model.model.layers.1.mlp.down_proj"
MB1 = ["--set", "training.micro_batch_size=1",
       "--set", 'optimizer_batch.allow_config_differences=["training.micro_batch_size"]']
GC = ["--set", "backend.options.gradient_checkpointing=true",
      "--set", 'optimizer_batch.allow_config_differences=["backend.options.gradient_checkpointing"]']


@pytest.fixture(scope="module")
def runs(workspace: Path, capture_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("trace")
    cfg = str(workspace / "replay.toml")
    tol = d / "tolerances.toml"
    tol.write_text("update_cosine_min = 0.99\nrelative_delta_l2_max = 0.1\n")
    pin = ["--set", f'optimizer_batch.tolerances_sha256="{hashlib.sha256(tol.read_bytes()).hexdigest()}"']

    def replay(name: str, index: int, *extra: str) -> Path:
        assert main(["replay", cfg, "--out", str(d / name), "--repeat-index", str(index), *replay_pins(capture_dir),
                     *pin, *extra]) == 0
        return d / name

    out = {"a": replay("a", 0, "--trace"), "b": replay("b", 1, "--trace"), "mb1": replay("mb1", 0, "--trace", *MB1),
           "gc": replay("gc", 0, "--trace", *GC), "plain": replay("plain", 3), "tolerances": tol, "source": capture_dir,
           "mb1b": replay("mb1b", 1, "--trace", *MB1)}
    fault.configure(f"{FAULT_MODULE}:1e-3")
    try:
        out["fault"] = replay("fault", 2, "--trace")
    finally:
        fault.configure()
    return out


def diff(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main(["trace-diff", *args, "--json"])
    text = capsys.readouterr().out
    return rc, (json.loads(text) if rc in (0, 1) else {})


def test_tracing_is_off_by_default(runs: dict[str, Path]) -> None:
    assert not (runs["plain"] / "trace").exists()
    assert "trace" not in json.loads((runs["plain"] / "replay_metrics.json").read_text())


def test_replay_metrics_pin_the_trace_index(runs: dict[str, Path]) -> None:
    m = json.loads((runs["a"] / "replay_metrics.json").read_text())
    index = runs["a"] / m["trace"]["index_path"]
    assert m["trace"]["index_sha256"] == hashlib.sha256(index.read_bytes()).hexdigest()
    t = read_trace(runs["a"], expected_index_sha256=m["trace"]["index_sha256"])
    assert t.identity["logical_batch_sha256"] == m["optimizer/logical_batch_sha256"]
    assert t.identity["fault"] is None and t.identity["micro_batch_size"] == 4
    assert t.forward[0].name.endswith("embed_tokens") and t.forward[-1].name == "(root)"
    assert int(t.row_tokens.sum()) == t.forward[0].values.shape[0]
    assert sorted(set(t.row_micro_batch.tolist())) == [0, 1, 2, 3]
    assert {p.name.rsplit(".", 3)[-3] for p in t.params} == {"lora_A", "lora_B"}
    assert all(float(p.update.abs().sum()) > 0 for p in t.params if p.name.count("lora_B"))


def test_same_condition_replays_are_trace_identical(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    rc, rep = diff(capsys, str(runs["a"]), str(runs["b"]))
    assert rc == 0 and rep["identical"] and rep["classification"] == "equal"
    assert rep["first_divergence"] == {"forward": None, "backward": None}


def test_micro_batch_arm_is_localised_as_rounding_noise(runs: dict[str, Path],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    rc, rep = diff(capsys, str(runs["a"]), str(runs["mb1"]))
    assert rc == 1 and not rep["identical"]
    assert rep["classification"] == "noise", [r for r in rep["forward"] + rep["backward"] if r["status"] == "beyond"]
    first = rep["first_divergence"]["forward"] or rep["first_divergence"]["backward"]
    assert first is not None and first["status"] == "noise" and first["envelope_source"] == "rounding"
    assert rep["b"]["micro_batch_size"] == 1 and rep["unmatched"] == {"only_a": [], "only_b": []}
    # row by row: every site was compared over the same unpadded tokens whatever the micro-batching
    assert len(rep["forward"]) == len(read_trace(runs["a"]).forward)


def test_planted_fault_is_located_at_its_module(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    rc, rep = diff(capsys, str(runs["a"]), str(runs["fault"]))
    assert rc == 1 and rep["classification"] == "beyond"
    fwd = rep["first_divergence"]["forward"]
    assert fwd["name"] == FAULT_MODULE and fwd["status"] == "beyond"
    assert fwd["rel_l2"] == pytest.approx(1e-3, rel=1e-3)
    before = [r for r in rep["forward"] if r["position"] < fwd["position"]]
    assert before and all(r["status"] == "equal" for r in before)
    bwd = rep["first_divergence"]["backward"]
    assert bwd is not None and bwd["position"] > max(r["position"] for r in rep["forward"])
    assert rep["b"]["fault"] == f"{FAULT_MODULE}:0.001"


def test_gradient_checkpointing_records_each_forward_once(runs: dict[str, Path],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    rc, rep = diff(capsys, str(runs["a"]), str(runs["gc"]))
    assert rep["classification"] in ("equal", "noise") and rc in (0, 1)
    assert not [n for n in rep["unmatched"]["only_b"] if n.startswith("forward:")]
    assert len(rep["backward"]) >= 50 and len(rep["params"]) == 16


def test_repeats_and_reference_pair_set_the_envelope(runs: dict[str, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    arm = tmp_path / "arm"
    shutil.copytree(runs["a"], arm / "repeat-000")
    shutil.copytree(runs["b"], arm / "repeat-001")  # a same-condition repeat: its errors (none on CPU) are noise
    rc, rep = diff(capsys, str(arm), str(runs["mb1"]))
    assert rc == 1 and rep["envelope"]["repeat_pairs"] == 1
    mixed = tmp_path / "mixed"
    shutil.copytree(runs["a"], mixed / "repeat-000")
    shutil.copytree(runs["mb1"], mixed / "repeat-001")  # a "repeat" of another condition would widen the envelope
    capsys.readouterr()
    assert main(["trace-diff", str(mixed), str(runs["fault"])]) == 2
    err = capsys.readouterr().err
    assert "another condition: identity.arm is 'micro_batch_size=1' in repeat-001, 'baseline' in " in err, err
    rc, rep = diff(capsys, str(runs["a"]), str(runs["mb1"]), "--reference", str(runs["b"]),
                   "--reference", str(runs["mb1b"]))  # two other replays, asserted to differ by noise only
    judged = [p["grad"] for p in rep["params"] if p["grad"]["status"] != "equal"]
    assert judged and all(r["envelope_source"] == "reference" and r["status"] == "noise" for r in judged)


@pytest.mark.parametrize(("reference", "named"), [
    (("a", "fault"), "a reference pair holding a compared replay judges its difference by itself"),
    (("fault", "b"), "a reference pair holding a compared replay judges its difference by itself"),
    (("b", "b"), "a reference pair of one replay is equal"),
    (("b", "fault_b"), "the reference pair differs in its planted fault: identity.fault is"),
])
def test_a_reference_pair_that_measures_the_judged_difference_is_refused(
        reference: tuple[str, str], named: str, runs: dict[str, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The compared pair named as its own reference (or one of its replays in it), and a clean replay paired with a
    faulted one: the envelope was the very difference judged (twice it), so a planted fault read as noise (exit 1,
    classification noise).  One replay named twice as the pair (a zero reference) proves nothing either.  Refused
    (exit 2), naming the reason."""
    fault_b = tmp_path / "fault_b"
    if "fault_b" in reference:
        shutil.copytree(runs["fault"], fault_b)
    paths = {**{k: str(v) for k, v in runs.items()}, "fault_b": str(fault_b)}
    rc, rep = diff(capsys, str(runs["a"]), str(runs["fault"]))
    assert rc == 1 and rep["classification"] == "beyond"  # the control: the fault is beyond the envelope
    capsys.readouterr()
    assert main(["trace-diff", str(runs["a"]), str(runs["fault"]), "--reference", paths[reference[0]],
                 "--reference", paths[reference[1]]]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err, err


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_refusals(runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = str(runs["a"])
    assert main(["trace-diff", a, str(runs["plain"])]) == 2
    assert "was not traced" in capsys.readouterr().err
    t = _copy(runs["b"], tmp_path / "tampered")
    payload = t / "trace" / "trace.safetensors"
    data = bytearray(payload.read_bytes())
    data[-5] ^= 1
    payload.write_bytes(bytes(data))
    assert main(["trace-diff", a, str(t)]) == 2
    err = capsys.readouterr().err
    assert "SHA-256" in err and "Traceback" not in err
    inc = _copy(runs["b"], tmp_path / "incomplete")
    (inc / "trace" / "index.json").unlink()
    assert main(["trace-diff", a, str(inc)]) == 2
    assert "incomplete" in capsys.readouterr().err
    # a self-consistent trace of another capture (index and its pin rewritten) is refused as such
    other = _copy(runs["b"], tmp_path / "other")
    index = other / "trace" / "index.json"
    doc = json.loads(index.read_text())
    doc["identity"]["logical_batch_sha256"] = "0" * 64
    index.write_bytes(pretty_bytes(doc))
    m = json.loads((other / "replay_metrics.json").read_text())
    m["trace"]["index_sha256"] = hashlib.sha256(index.read_bytes()).hexdigest()
    (other / "replay_metrics.json").write_bytes(pretty_bytes(m))
    assert main(["trace-diff", a, str(other)]) == 2  # the replay's own record names the capture it replayed
    assert "the trace is not this replay's: its identity.logical_batch_sha256" in capsys.readouterr().err
    m["optimizer/logical_batch_sha256"] = m["pins"]["expected_logical_sha256"] = "0" * 64
    (other / "replay_metrics.json").write_bytes(pretty_bytes(m))
    assert main(["trace-diff", a, str(other)]) == 2
    assert "different captures" in capsys.readouterr().err
    assert main(["trace-diff", a, str(runs["b"]), "--reference", a]) == 2


def test_fault_spec_and_envelope_rules() -> None:
    with pytest.raises(Exception, match="MODULE"):
        fault.parse("x:nan")
    assert fault.parse("m").scale == fault.DEFAULT_SCALE
    assert envelope([0.0, 0.0], None, 1e-5) == Bound(1e-5, "rounding")
    assert envelope([0.0, 3e-7], 1e-3, 1e-5) == Bound(6e-7, "repeats")
    assert envelope([], 1e-3, 1e-5) == Bound(2e-3, "reference")
    assert Bound(1e-5, "rounding").judge(2e-5, False) == "beyond"
    assert Bound(1e-5, "rounding").judge(0.0, True) == "equal"
    assert rounding_bound("F32", 256, 2) == pytest.approx(4 * 2 ** -24 * 16 * 2)
    import torch

    assert relative_error(torch.zeros(3), torch.zeros(3)) == 0.0
    assert relative_error(torch.ones(4), torch.ones(4) * 1.5) == pytest.approx(1 / 3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_row_stats_match_per_row_reductions(dtype: str) -> None:
    import torch

    from replayjob.artifacts.trace_store import row_stats

    v = torch.randn(10, 7, generator=torch.Generator().manual_seed(0)).to(getattr(torch, dtype))
    st, dg = row_stats(v, torch.tensor([3, 0, 7]))
    x = v.double()
    for row, part in ((0, x[:3]), (2, x[3:])):
        expected = torch.tensor([part.norm(), part.abs().max(), part.mean()], dtype=torch.float64)
        assert torch.allclose(st[row], expected)
    assert st[1].tolist() == [0.0, 0.0, 0.0] and dg[1] == hashlib.sha256(b"").hexdigest()
    assert dg[2] == hashlib.sha256(v[3:].contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _reduce(runs: dict[str, Path], out: Path, claim: str, *names: str) -> tuple[int, dict]:
    extra = ["--tolerances", str(runs["tolerances"])] if claim == "approximate" else []
    rc = main(["reduce", *(str(runs[n]) for n in names), "--claim", claim, "--source", str(runs["source"]),
               "--min-repeats", "1", "--out", str(out / "verdict.json"), "--report", str(out / "report.md"), *extra])
    return rc, json.loads((out / "verdict.json").read_text())


def _check(doc: dict, name: str) -> dict:
    return next(c for c in doc["checks"] if c["name"] == name)


def test_failed_bitwise_claim_names_the_first_divergent_module(runs: dict[str, Path], tmp_path: Path) -> None:
    rc, doc = _reduce(runs, tmp_path, "bitwise", "a", "b", "fault")
    assert rc == 1
    c = _check(doc, "bitwise.first_divergent_module")
    assert c["status"] == "fail" and c["observed"]["pair"] == "baseline#0 ~ baseline#2"
    assert c["observed"]["forward"]["name"] == FAULT_MODULE and c["observed"]["forward"]["status"] == "beyond"
    assert FAULT_MODULE in c["detail"] and c["observed"]["backward"] is not None
    report = (tmp_path / "report.md").read_text()
    assert "## First divergent module (traces)" in report and FAULT_MODULE in report
    if "Plot skipped" not in report:
        assert (tmp_path / "report.layers.png").read_bytes()[:4] == b"\x89PNG"


def test_passing_bitwise_claim_adds_no_localisation(runs: dict[str, Path], tmp_path: Path) -> None:
    rc, doc = _reduce(runs, tmp_path, "bitwise", "a", "b")
    assert rc == 0 and not [c for c in doc["checks"] if c["name"] == "bitwise.first_divergent_module"]


def test_approximate_claim_judges_gradients_against_the_envelope(runs: dict[str, Path], tmp_path: Path) -> None:
    rc, doc = _reduce(runs, tmp_path, "approximate", "a", "b", "mb1")
    rel = _check(doc, "approximate.gradient_relative_l2")
    assert rel["status"] == "pass" and _check(doc, "approximate.gradient_cosine")["status"] == "pass"
    rows = rel["observed"]["parameters"]
    assert len(rows) == 16 and {r["arms"] for r in rows} == {"baseline ~ micro_batch_size=1"}
    lora_b = [r for r in rows if "lora_B" in r["parameter"]]
    assert all(0 < r["relative_l2"]["median"] <= r["relative_l2"]["high"] <= r["envelope"] for r in lora_b)
    assert all(r["envelope_source"] == "rounding" and r["cosine"]["low"] > 1 - 1e-9 for r in lora_b)
    assert rc == 0, doc["failed_checks"]


def test_approximate_gradients_need_traces_in_two_arms(runs: dict[str, Path], tmp_path: Path) -> None:
    _rc, doc = _reduce(runs, tmp_path, "approximate", "a", "b")
    assert _check(doc, "approximate.gradient_relative_l2")["status"] == "not_applicable"


def test_reduce_refuses_a_tampered_trace(runs: dict[str, Path], tmp_path: Path) -> None:
    t = _copy(runs["fault"], tmp_path / "fault")
    index = t / "trace" / "index.json"
    index.write_bytes(index.read_bytes().replace(b'"rows"', b'"rows" ', 1))
    rc = main(["reduce", str(runs["a"]), str(t), "--claim", "bitwise", "--source", str(runs["source"]),
               "--min-repeats", "1", "--out", str(tmp_path / "v.json")])
    # refused where the replay is read, whatever the claim (a pin to other bytes is no evidence)
    message = json.loads((tmp_path / "v.json").read_text())["refusal"]["message"]
    assert rc == 2 and "pins 'trace/index.json' at SHA-256" in message, message
    assert main(["reduce", str(runs["a"]), str(t), "--claim", "exact-input", "--source", str(runs["source"]),
                 "--min-repeats", "1", "--out", str(tmp_path / "x.json")]) == 2
    (t / "trace" / "index.json").unlink()  # a pin to nothing
    assert main(["reduce", str(runs["a"]), str(t), "--claim", "exact-input", "--source", str(runs["source"]),
                 "--min-repeats", "1", "--out", str(tmp_path / "y.json")]) == 2
    assert "index.json" in json.loads((tmp_path / "y.json").read_text())["refusal"]["where"]


class _Toy:
    """A two-module model called like the policy (input_ids/attention_mask keywords)."""

    @staticmethod
    def build() -> object:
        import torch

        class Toy(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.emb = torch.nn.Embedding(10, 4)
                self.lin = torch.nn.Linear(4, 3)
                self.emb.weight.requires_grad_(False)

            def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
                return self.lin(self.emb(input_ids))

        torch.manual_seed(0)
        return Toy()


def _toy_batch() -> object:
    import torch

    from replayjob.rl.batch import OptimizerBatch

    seqs, prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]], [1, 1, 2]
    resp = [len(s) - p for s, p in zip(seqs, prompts, strict=True)]
    mask = torch.zeros(3, 3)
    for i, n in enumerate(resp):
        mask[i, :n] = 1
    return OptimizerBatch.from_padded(seqs, prompts, {k: mask.clone() for k in (
        "old_logprobs", "ref_logprobs", "advantages", "loss_weights")}, mask)


def test_recorder_keys_rows_logically_and_refuses_an_unplanned_forward() -> None:
    import torch

    from replayjob.errors import ContractError
    from replayjob.producers.session import MicroStep
    from replayjob.producers.trace_recorder import Recorder
    from replayjob.rl.batch import micro_batches

    model: torch.nn.Module = _Toy.build()  # type: ignore[assignment]
    batch = _toy_batch()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.SGD([p for _, p in params], lr=0.1)
    plan = [MicroStep(tuple(mb.rows), None, mb, mb.input_ids, mb.attention_mask)
            for mb in micro_batches(batch, 2, 0)]  # type: ignore[arg-type]
    rec = Recorder(model, plan, params, opt)
    with rec.attached():
        for mb in micro_batches(batch, 2, 0):  # type: ignore[arg-type]
            out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask)
            (out * mb.attention_mask.unsqueeze(-1)).sum().backward()
        grad = model.lin.weight.grad.clone()  # type: ignore[union-attr]
        before = model.lin.weight.detach().clone()  # type: ignore[union-attr]
        expected = model.lin(model.emb(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9]))).detach()  # type: ignore[operator]
        opt.step()
    t = rec.trace({})
    assert [s.name for s in t.forward] == ["emb", "lin", "(root)"] and t.row_micro_batch.tolist() == [0, 0, 1]
    assert t.forward[1].values.shape == (9, 3)  # 3 + 2 + 4 unpadded tokens, no padding
    assert torch.allclose(t.forward[1].values, expected, rtol=0, atol=1e-6)
    assert [p.name for p in t.params] == ["lin.weight", "lin.bias"] and torch.equal(t.params[0].grad, grad)
    assert torch.equal(t.params[0].update, model.lin.weight.detach() - before)  # type: ignore[union-attr]
    assert model.lin._forward_hooks == {}  # type: ignore[union-attr]  # detached afterwards
    rec2 = Recorder(model, plan, params, opt)
    with rec2.attached(), pytest.raises(ContractError, match="not micro-batch 0"):
        model(input_ids=torch.tensor([[9, 9]]), attention_mask=torch.ones(1, 2))


def test_recorder_cuts_a_packed_micro_batch_back_into_its_rows() -> None:
    """Rows the model receives packed into one sequence are recorded at the producer's offsets, keyed by logical
    row like padded rows; offsets that do not cut the sequence into the rows are refused before any hook runs."""
    import torch

    from replayjob.errors import ContractError
    from replayjob.producers.session import MicroStep
    from replayjob.producers.trace_recorder import Recorder

    model: torch.nn.Module = _Toy.build()  # type: ignore[assignment]
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.SGD([p for _, p in params], lr=0.1)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 0]])  # three rows of 3, 2 and 4 tokens, then one pad
    mask = torch.ones_like(ids)
    offsets = torch.tensor([0, 3, 5, 9])
    rec = Recorder(model, [MicroStep((0, 1, 2), None, None, ids, mask, offsets)], params, opt)
    want = model.lin(model.emb(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9]))).detach()  # type: ignore[operator]
    with rec.attached():
        model(input_ids=ids, attention_mask=mask).sum().backward()
        opt.step()
    t = rec.trace({})
    assert t.row_tokens.tolist() == [3, 2, 4] and t.row_micro_batch.tolist() == [0, 0, 0]
    lin = next(s for s in t.forward if s.name == "lin")
    assert lin.values.shape == (9, 3) and torch.allclose(lin.values, want, rtol=0, atol=1e-6)  # the pad dropped
    for bad in ([0, 3, 5], [1, 3, 5, 9], [0, 5, 3, 9], [0, 3, 5, 11]):
        with pytest.raises(ContractError, match="offsets"):
            Recorder(model, [MicroStep((0, 1, 2), None, None, ids, mask, torch.tensor(bad))], params, opt)


def _set(doc: dict, path: str, value: object) -> None:
    *head, last = path.split(".")
    for k in head:
        doc = doc[int(k)] if isinstance(doc, list) else doc[k]
    if value is _DELETE:
        del doc[last]
    else:
        doc[last] = value


_DELETE = object()
INDEX_MUTATIONS = {
    "extra key": ("extra", 1), "schema": ("schema", "replayjob.trace/v0"), "width": ("forward.3.width", 7),
    "dtype": ("forward.0.dtype", "F16"), "site key missing": ("backward.0.kind", _DELETE),
    "payload digest": ("payload.sha256", "1" * 64), "rows": ("rows", -1), "tokens": ("tokens", 5),
    "identity digest case": ("identity.manifest_sha256", "A" * 64), "param shape": ("params.0.shape", [1]),
    "untraced type": ("untraced", "x"), "fewer sites": ("forward", []),
}


def _re_pinned(src: Path, dst: Path, edit: Callable[[dict[str, Any]], object]) -> Path:
    """A copy of replay ``src`` whose trace index ``edit`` changed, and its replay_metrics.json pinning the new
    index (what a forger who rewrites both writes)."""
    d = _copy(src, dst)
    index = d / "trace" / "index.json"
    doc = json.loads(index.read_text())
    edit(doc)
    index.chmod(0o644)
    index.write_bytes(pretty_bytes(doc))
    m = json.loads((d / "replay_metrics.json").read_text())
    m["trace"]["index_sha256"] = hashlib.sha256(index.read_bytes()).hexdigest()
    (d / "replay_metrics.json").write_bytes(pretty_bytes(m))
    return d


@pytest.mark.parametrize(("key", "value"), [("arm", "other-arm"), ("repeat_index", 7), ("device", "cuda:0"),
                                            ("manifest_sha256", "0" * 64), ("initial_adapter_sha256", "0" * 64),
                                            ("torch_version", "0.0.0")])
def test_a_trace_is_its_replay_s_own(key: str, value: object, runs: dict[str, Path], tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A trace whose identity is not what the replay_metrics.json pinning it records (another replay's trace, its
    pin rewritten) was compared under the trace's own labels; it is refused naming both."""
    d = _re_pinned(runs["b"], tmp_path / "b", lambda doc: doc["identity"].__setitem__(key, value))
    assert main(["trace-diff", str(runs["a"]), str(d)]) == 2
    err = capsys.readouterr().err
    assert f"the trace is not this replay's: its identity.{key} is {value!r}" in err and "Traceback" not in err


@pytest.mark.parametrize("mutation", sorted(INDEX_MUTATIONS))
def test_a_re_pinned_but_inconsistent_index_is_refused(mutation: str, runs: dict[str, Path], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Past the pin (replay_metrics.json rewritten to match), the index itself must still hold."""
    d = _re_pinned(runs["b"], tmp_path / "b", lambda doc: _set(doc, *INDEX_MUTATIONS[mutation]))
    assert main(["trace-diff", str(runs["a"]), str(d)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(d) in err
