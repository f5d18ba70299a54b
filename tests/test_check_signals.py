"""signals: rules loading, every reducer, KILL / WARN / OK grading, consistency rules, refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from replayjob.check.rules import REDUCERS, load_rules, parse_rules
from replayjob.check.signals import evaluate, reduce_values
from replayjob.cli import main
from replayjob.errors import ConfigError, IntegrityError, RefusedError


def run_dir(tmp_path: Path, rows: list[dict[str, Any]], metrics: dict[str, Any] | None = None) -> Path:
    d = tmp_path / "run"
    d.mkdir(exist_ok=True)
    (d / "diag.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if metrics is not None:
        (d / "metrics.json").write_text(json.dumps(metrics))
    return d


def healthy(n: int) -> list[dict[str, Any]]:
    """Rows shaped like the source trainer's, with a rising reward and stable gradients."""
    return [{"step": i, "loss": {"policy": 0.1 - 0.01 * i}, "reward": {"mean": 0.1 + 0.02 * i},
             "advantage": {"std": 0.7}, "grad_norm": 0.2 + 0.01 * (i % 2), "kl": {"mean": 0.001},
             "tokens": {"padding_fraction": 0.05}} for i in range(n)]


def rules(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "rules.toml"
    p.write_text(text)
    return p


def test_reducers() -> None:
    data = [(float(x), v, w) for x, v, w in [(0, 1.0, 10.0), (1, 3.0, 11.0), (2, 5.0, 13.0), (3, 7.0, 16.0)]]
    assert reduce_values("last", data) == 7.0
    assert reduce_values("mean", data) == 4.0
    assert reduce_values("min", data) == 1.0
    assert reduce_values("max", data) == 7.0
    assert reduce_values("slope", data) == pytest.approx(2.0)
    assert reduce_values("cv", data) == pytest.approx(math.sqrt(5.0) / 4.0)
    # pearson correlates the value with its partner, the per-row change the collector computed
    assert reduce_values("pearson", [(1.0, 3.0, 1.0), (2.0, 5.0, 2.0), (3.0, 7.0, 3.0)]) == pytest.approx(1.0)
    assert reduce_values("cv", [(0.0, 0.0, 0.0), (1.0, 0.0, 0.0)]) == 0.0
    assert reduce_values("cv", [(0.0, -1.0, 0.0), (1.0, 1.0, 0.0)]) == math.inf
    assert math.isnan(reduce_values("pearson", [(0.0, 1.0, 1.0), (1.0, 1.0, 1.0), (2.0, 1.0, 1.0)]))
    assert math.isnan(reduce_values("mean", [(0.0, 1.0, 0.0), (1.0, math.nan, 0.0)]))
    assert set(REDUCERS) == {"last", "mean", "min", "max", "cv", "slope", "pearson"}


def test_default_rules_ok_on_a_healthy_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = healthy(12)
    d = run_dir(tmp_path, rows, {"loss": rows[-1]["loss"]["policy"], "grad_norm": rows[-1]["grad_norm"]})
    assert main(["signals", str(d)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("signals OK") and "STATUS  SIGNAL" in out
    assert "final_loss_matches_metrics" in out and "WARN" not in out
    report = evaluate(d / "diag.jsonl", load_rules(None))  # a diag file finds metrics.json beside it
    assert report.verdict == "OK" and len(report.results) == 9


def test_kill_warn_ok_and_output_modes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = healthy(6)
    rows[3]["grad_norm"] = 5000.0  # grad_norm_bounded KILL
    for r in rows:
        r["reward"]["mean"] = 1.0 - 0.1 * r["step"]  # reward_mean_rising WARN
    d = run_dir(tmp_path, rows, {"loss": rows[-1]["loss"]["policy"], "grad_norm": rows[-1]["grad_norm"]})
    assert main(["signals", str(d), "--quiet"]) == 1
    assert capsys.readouterr().out.strip() == \
        "signals KILL; kill: grad_norm_bounded; warn: reward_mean_rising, grad_norm_stable"
    assert main(["signals", str(d), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    by_name = {s["name"]: s for s in doc["signals"]}
    assert doc["verdict"] == "KILL" and doc["rows"] == 6
    assert by_name["grad_norm_bounded"]["status"] == "KILL" and by_name["grad_norm_bounded"]["value"] == 5000.0
    assert by_name["reward_mean_rising"]["status"] == "WARN"
    assert by_name["reward_mean_rising"]["value"] == pytest.approx(-0.1)
    assert by_name["kl_bounded"]["status"] == "OK"
    assert by_name["grad_norm_bounded"]["meaning"]


def test_warnings_alone_exit_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = healthy(5)
    d = run_dir(tmp_path, rows, {"loss": 0.123, "grad_norm": rows[-1]["grad_norm"]})  # loss gap -> WARN
    assert main(["signals", str(d), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == "signals WARN; warn: final_loss_matches_metrics"


def test_nonfinite_is_kill(tmp_path: Path) -> None:
    rows = healthy(5)
    rows[2]["loss"]["policy"] = math.nan
    d = run_dir(tmp_path, rows, {"loss": rows[-1]["loss"]["policy"], "grad_norm": rows[-1]["grad_norm"]})
    report = evaluate(d, load_rules(None))
    assert report.verdict == "KILL" and report.names("KILL") == ["loss_finite"]


def test_too_few_rows_names_the_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = run_dir(tmp_path, healthy(2), {"loss": 0.09, "grad_norm": 0.21})
    assert main(["signals", str(d)]) == 2
    err = capsys.readouterr().err
    assert "'reward_mean_rising' needs at least 3 rows with reward.mean, found 2" in err
    assert "grad_norm_stable" not in err  # cv needs 2 rows and has them


PEARSON_RULE = '''
[[signal]]
name = "reward_tracks_pnl"
leaf = "r"
reducer = "pearson"
delta_of = "pnl"
kill_below = 0.3
warn_below = 0.5
meaning = "reward moves with the change in pnl"
'''


def test_pearson_rule_and_window(tmp_path: Path) -> None:
    rows = [{"step": i, "r": float(i % 3), "pnl": float(sum(j % 3 for j in range(i + 1)))} for i in range(30)]
    rows[1]["r"] = 100.0  # the first pair (row 0 has no pnl change); outside the trailing window of 20
    rule = PEARSON_RULE
    unwindowed = evaluate(run_dir(tmp_path, rows), load_rules(rules(tmp_path, rule)))
    assert unwindowed.verdict == "KILL"  # the outlier counts when every pair does
    p = rules(tmp_path, rule + "window = 20\n")
    report = evaluate(run_dir(tmp_path, rows), load_rules(p))
    res = report.results[0]
    assert res.status == "OK" and res.value == pytest.approx(1.0) and "over 20 pairs" in res.explanation
    for r in rows:
        r["pnl"] = -r["pnl"]
    assert evaluate(run_dir(tmp_path, rows), load_rules(p)).verdict == "KILL"



@pytest.mark.parametrize("missing", ["r", "pnl"])
def test_pearson_changes_never_span_a_row_missing_a_leaf(tmp_path: Path, missing: str) -> None:
    # r equals the per-row change of pnl exactly; one row lacks a leaf.  Spanning that row would pair
    # r=7 with a two-row change (3 + 7 = 10) and r=3 with nothing, breaking the perfect correlation.
    steps = [1.0, 2.0, 3.0, 7.0, 1.0, 4.0, 2.0, 5.0]
    rows: list[dict[str, Any]] = []
    pnl = 0.0
    for i, d in enumerate(steps):
        pnl += d
        rows.append({"step": i, "r": d, "pnl": pnl})
    del rows[2][missing]
    report = evaluate(run_dir(tmp_path, rows), load_rules(rules(tmp_path, PEARSON_RULE)))
    res = report.results[0]
    assert res.value == pytest.approx(1.0), res.explanation
    # rows 1..7 give 7 pairs; the gap removes row 2's pair, and row 3's when pnl is the missing leaf
    assert f"over {5 if missing == 'pnl' else 6} pairs" in res.explanation


def test_consistency_rule(tmp_path: Path) -> None:
    p = rules(tmp_path, '''
[[consistency]]
name = "pnl_matches_summary"
leaf = "trading.pnl"
summary = "eval_summary.json"
field = "totals.pnl"
warn_above = 0.05
kill_above = 0.5
''')
    rows = [{"step": i, "trading": {"pnl": 100.0 + i}} for i in range(3)]
    d = run_dir(tmp_path, rows)
    for ref, status in ((102.0, "OK"), (110.0, "WARN"), (-4000.0, "KILL")):
        (d / "eval_summary.json").write_text(json.dumps({"totals": {"pnl": ref}}))
        assert evaluate(d, load_rules(p)).results[0].status == status
    (d / "eval_summary.json").unlink()
    with pytest.raises(RefusedError, match=r"needs eval_summary\.json"):
        evaluate(d, load_rules(p))
    optional = rules(tmp_path, p.read_text().replace("kill_above = 0.5", "kill_above = 0.5\noptional = true"))
    assert evaluate(d, load_rules(optional)).results[0].status == "SKIP"


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(IntegrityError, match="file not found"):
        evaluate(tmp_path / "nothing", load_rules(None))
    rows = healthy(5)
    rows[1]["grad_norm"] = "high"
    with pytest.raises(IntegrityError, match="line 2: leaf grad_norm is str"):
        evaluate(run_dir(tmp_path, rows), load_rules(None))


@pytest.mark.parametrize("text, message", [
    ('[[signal]]\nname="a"\nleaf="x"\nreducer="median"\nkill_above=1\n', "unknown reducer"),
    ('[[signal]]\nname="a"\nleaf="x"\nreducer="last"\nkill_above=1\ncolour="red"\n', "unknown key"),
    ('[[signal]]\nname="a"\nleaf="x"\nreducer="last"\n', "at least one threshold"),
    ('[[signal]]\nname="a"\nleaf="x"\nreducer="pearson"\nkill_below=0\n', "delta_of is required"),
    ('[[signal]]\nname="a"\nleaf="x"\nreducer="slope"\nwindow=2\nwarn_below=0\n', "smaller than min_rows"),
    ('[[signal]]\nname="a"\nleaf="x"\nreducer="last"\nkill_above=1\n'
     '[[signal]]\nname="a"\nleaf="y"\nreducer="last"\nkill_above=1\n', "duplicate rule name"),
    ('schema = "other/2"\n', "is not"),
    ('', "defines no"),
])
def test_rules_validation(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_rules(text, "rules.toml")


def test_missing_rules_file_exit_two(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = run_dir(tmp_path, healthy(3))
    assert main(["signals", str(d), "--rules", str(tmp_path / "none.toml")]) == 2
    assert "rules file not found" in capsys.readouterr().err


def test_docs_example_rules_parse() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "signals.md").read_text()
    example = text.split("```toml\n", 1)[1].split("```", 1)[0]
    parsed = parse_rules(example, "docs/signals.md")
    assert [r.reducer for r in parsed.signals] == ["pearson", "slope"] and len(parsed.consistency) == 1
