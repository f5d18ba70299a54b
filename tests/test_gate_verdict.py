"""The verdict file: golden bytes, same inputs -> same bytes, no model imports, the benchmark smoke."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_golden

from replayjob.artifacts.verdict import VERDICT_SCHEMA, incomplete, outcome, read_verdict
from replayjob.cli import main
from replayjob.errors import IntegrityError
from replayjob.gate import synthetic
from replayjob.runtime.knobs import GRADIENT_CHECKPOINTING as GC_KEY

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden" / "verdict_bitwise.json"  # the other goldens: tests/test_golden.py
ARMS = {"baseline": {}, "gradient_checkpointing=true": {GC_KEY: True}}


def _reduce(root: Path, claim: str = "bitwise") -> bytes:
    ev = synthetic.build(root / "ev", ARMS, 3, seed=7)
    out = root / "out" / "verdict.json"
    code = main(["reduce", str(ev.root / "replays"), "--claim", claim, "--out", str(out),
                 "--source", str(ev.source), "--baseline", "baseline"])
    assert code == 0
    return out.read_bytes()


def test_verdict_matches_the_golden_file(tmp_path: Path) -> None:
    """Regenerate on purpose only: REPLAYJOB_REGEN_GOLDEN=1 pytest tests/test_gate_verdict.py"""
    data = _reduce(tmp_path)
    assert_golden(GOLDEN, data)
    doc = json.loads(data)
    assert doc["schema"] == VERDICT_SCHEMA and doc["status"] == "pass"


def test_same_inputs_same_bytes_anywhere(tmp_path: Path) -> None:
    assert _reduce(tmp_path / "a", "exact-input") == _reduce(tmp_path / "elsewhere" / "b", "exact-input")


def test_outcome_precedence() -> None:
    assert outcome([{"name": "a", "status": "pass"}, {"name": "n", "status": "not_applicable"}], None) == (
        "pass", 0, [])
    assert outcome([{"name": "a", "status": "fail"}, {"name": "b", "status": "refused"}], None) == (
        "refused", 2, ["b", "a"])
    assert outcome([], {"message": "m", "where": None, "hint": None})[:2] == ("refused", 2)


def test_reduce_never_imports_the_model_stack(tmp_path: Path) -> None:
    """Neither the model stack nor torch: adapters are hashed and header-checked as files."""
    ev = synthetic.build(tmp_path / "ev", ARMS, 3)
    code = (
        "import sys\n"
        "from replayjob.cli import main\n"
        "codes = [main(['reduce', sys.argv[1], '--claim', c, '--out', sys.argv[2] + c, '--source', sys.argv[3],"
        " '--baseline', 'baseline']) for c in ('exact-input', 'bitwise')]\n"
        "print(codes, sorted(m for m in ('transformers', 'peft', 'torch') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(ev.root / "replays"), str(tmp_path / "v-"),
                           str(ev.source)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[0, 0] []"


def test_benchmark_smoke(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.reduce_many", "--smoke", "--results", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reduce_many: ratio ") and "20 files" in lines[0]
    res = json.loads((tmp_path / "reduce_many.smoke.json").read_text())
    run = res["measurements"]["runs"]["20"]
    assert res["mode"] == "smoke" and run["files"] == 20 and res["target_met"] is None
    assert run["exact_input_s"]["median"] > 0 and res["measurements"]["ms_per_file_above_floor"]["20"] > 0
    assert run["slowest"] in ("exact_input", "bitwise") and run["cli_process_above_fixed"]["fixed_s"] > 0


def test_reduce_prints_the_comparison_table_and_each_budget_decision(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The ratios and budget decisions are on the console, not only in the JSON and the report."""
    from replayjob.artifacts.verdict import console_table

    _reduce(tmp_path, "exact-input")
    out = capsys.readouterr().out.splitlines()
    doc = json.loads((tmp_path / "out" / "verdict.json").read_bytes())
    ratios = doc["comparisons"]["ratios"]["gradient_checkpointing=true"]
    assert out[0] == doc["summary"] and out[1].startswith("ratios against baseline")
    for metric, r in ratios.items():
        row = next(line for line in out if f" {metric} " in line)
        assert f"{r['ratio']:.3f}" in row
        if r["low"] is None:  # CPU memory: provenance, no interval
            assert r["note"] in row and " - " in row
        else:
            assert f"[{r['low']:.3f}, {r['high']:.3f}]" in row
            assert row.split()[-1] == ("yes" if r["excludes_1"] else "no")
    bound = {"arm": "ckpt-on", "metric": "local_train_wall_s", "kind": "max_ratio", "limit": 1.35, "ratio": 1.21,
             "low": 1.1, "high": 1.3, "decision": "pass", "note": ""}
    lines = console_table({"comparisons": None, "budgets": {"bounds": [bound]}})
    assert lines == ["budget ckpt-on.local_train_wall_s max_ratio 1.35: pass (ratio 1.210 [1.100, 1.300])"]


def test_cpu_memory_is_provenance_never_a_ratio_with_an_interval(tmp_path: Path) -> None:
    """On CPU the replay's peak memory is the process's max RSS: shown, never an interval that 'excludes 1'."""
    doc = json.loads(_reduce(tmp_path, "exact-input"))
    memory = doc["comparisons"]["ratios"]["gradient_checkpointing=true"]["peak_memory_bytes"]
    assert memory["ratio"] is not None and (memory["low"], memory["high"], memory["excludes_1"]) == (None,) * 3
    assert "provenance only" in memory["note"]


def test_a_refusal_for_want_of_evidence_a_stage_did_not_produce_is_incomplete(tmp_path: Path) -> None:
    """Only a refusal resting on missing evidence becomes incomplete (3); any other outcome stands."""
    ev = synthetic.build(tmp_path / "ev", ARMS, 3, seed=7)
    ev.replay_files[0].unlink()
    out = tmp_path / "verdict.json"
    assert main(["reduce", str(ev.root / "replays"), "--claim", "bitwise", "--out", str(out), "--source",
                 str(ev.source), "--baseline", "baseline"]) == 2
    doc = json.loads(out.read_bytes())
    assert doc["status"] == "refused" and set(doc["failed_checks"]) == {"inputs.min_repeats"}
    got = incomplete(doc, ["replays/baseline/0"])
    assert (got["status"], got["exit_code"], got["missing"]) == ("incomplete", 3, ["replays/baseline/0"])
    assert read_verdict(json.dumps(got).encode(), where="v").exit_code == 3  # the reader accepts it
    assert got["summary"].endswith("1 stage output(s) missing; not passed: inputs.min_repeats")
    assert incomplete(doc, []) is doc  # nothing missing: the refusal is the input's
    other = {**doc, "checks": [*doc["checks"], {"name": "inputs.capture_pins", "status": "refused"}]}
    assert incomplete(other, ["replays/baseline/0"]) is other  # refused for another reason too: stands
    tampered = {**doc, "refusal": {"message": "m", "where": "w", "hint": None}}
    assert incomplete(tampered, ["replays/baseline/0"]) is tampered  # a refusal of a replay that is there
    assert incomplete({**tampered, "inputs": {**doc["inputs"], "replays": []}}, ["replays/x/0"])["exit_code"] == 3
    failed = {**doc, "status": "fail", "exit_code": 1}
    assert incomplete(failed, ["replays/baseline/0"]) is failed


def test_the_verdict_reader_reads_what_the_reducer_writes_and_refuses_every_mutation(tmp_path: Path) -> None:
    """One reader (read_verdict) for every launcher's outcome: each top-level field absent, of the wrong
    type, or unknown, and a duplicated key, is refused (IntegrityError, exit 2) naming the field."""
    data = GOLDEN.read_bytes()
    verdict = read_verdict(GOLDEN)
    assert (verdict.status, verdict.exit_code) == ("pass", 0)
    assert read_verdict(data, where="param").doc == json.loads(data)
    doc = json.loads(data)
    wrong = {str: 7, int: "0", list: {}, dict: [], type(None): 1.5}
    for key, value in doc.items():
        if key == "updates":
            continue  # null or an object: checked with an object below
        for mutated in ({k: v for k, v in doc.items() if k != key}, {**doc, key: wrong[type(value)]}):
            with pytest.raises(IntegrityError):
                read_verdict(json.dumps(mutated).encode(), where="v")
    with pytest.raises(IntegrityError, match="`updates`"):
        read_verdict(json.dumps({**doc, "updates": []}).encode(), where="v")
    with pytest.raises(IntegrityError, match="unknown field `extra`"):
        read_verdict(json.dumps({**doc, "extra": 1}).encode(), where="v")
    with pytest.raises(IntegrityError, match="duplicate key 'status'"):
        read_verdict(data.rstrip()[:-1] + b', "status": "pass"}', where="v")
    for code in (False, 0.0, 1, "0"):
        with pytest.raises(IntegrityError, match="exit_code"):
            read_verdict(json.dumps({**doc, "exit_code": code}).encode(), where="v")
    with pytest.raises(IntegrityError, match="failed_checks"):
        read_verdict(json.dumps({**doc, "failed_checks": ["exact.loss"]}).encode(), where="v")
    with pytest.raises(IntegrityError, match="incomplete"):  # incomplete without missing evidence
        read_verdict(json.dumps({**doc, "status": "incomplete", "exit_code": 3, "missing": ["source"]}).encode())
