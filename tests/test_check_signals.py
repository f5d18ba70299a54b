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


CONSISTENCY_RULE = '''
[[consistency]]
name = "loss_matches_summary"
leaf = "loss"
summary = "summary.json"
field = "loss"
'''


@pytest.mark.parametrize("last", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("bounds, status", [("kill_above = 1e-9\nwarn_above = 1e-12\n", "KILL"),
                                            ("warn_above = 1e-9\n", "WARN")])
def test_consistency_nonfinite_last_value_is_beyond_bounds(tmp_path: Path, last: float, bounds: str,
                                                           status: str) -> None:
    # an infinite last value made the gap inf / inf = NaN, and NaN > kill_above is false: graded OK
    d = run_dir(tmp_path, [{"step": 0, "loss": 0.5}, {"step": 1, "loss": last}])
    (d / "summary.json").write_text(json.dumps({"loss": 0.25}))
    res = evaluate(d, load_rules(rules(tmp_path, CONSISTENCY_RULE + bounds))).results[0]
    assert res.status == status and not math.isfinite(res.value or 0.0)
    assert "non-finite, never within bounds" in res.explanation


def test_consistency_gap_of_values_near_the_float_range_end(tmp_path: Path) -> None:
    d = run_dir(tmp_path, [{"step": 0, "loss": 1.7e308}])
    (d / "summary.json").write_text(json.dumps({"loss": -1.7e308}))
    res = evaluate(d, load_rules(rules(tmp_path, CONSISTENCY_RULE + "kill_above = 0.5\n"))).results[0]
    assert res.status == "KILL" and res.value == 2.0  # the difference overflows; the relative gap does not


@pytest.mark.parametrize("line", ["kill_above = nan", "warn_below = inf", "kill_below = -inf"])
def test_nonfinite_signal_thresholds_refused(line: str) -> None:
    with pytest.raises(ConfigError, match="must be a finite number"):
        parse_rules(f'[[signal]]\nname="a"\nleaf="x"\nreducer="last"\nwarn_above=1\n{line}\n', "rules.toml")


@pytest.mark.parametrize("bounds", ["kill_above = nan", "warn_above = nan",
                                    "kill_above = 0.1\nfloor = inf", "kill_above = 0.1\nfloor = nan"])
def test_nonfinite_consistency_bounds_refused(bounds: str) -> None:
    # kill_above = nan never fired; floor = inf made every gap 0
    with pytest.raises(ConfigError, match="must be a finite number"):
        parse_rules(CONSISTENCY_RULE + bounds + "\n", "rules.toml")


def test_statistics_of_large_values_never_overflow() -> None:
    def data(vs: list[float], xs: list[float] | None = None) -> list[tuple[float, float, float]]:
        return [(float(i) if xs is None else xs[i], v, 0.0) for i, v in enumerate(vs)]

    assert reduce_values("mean", data([1.7e308] * 3)) == pytest.approx(1.7e308)  # fsum overflowed
    assert reduce_values("mean", data([1.7e308, -1.7e308, 1.7e308])) == pytest.approx(1.7e308 / 3)
    assert reduce_values("cv", data([1e200] * 4)) == 0.0
    big = [1e200 * (i + 1) for i in range(4)]  # (v - m) ** 2 overflowed
    assert reduce_values("cv", data(big)) == pytest.approx(reduce_values("cv", data([1.0, 2.0, 3.0, 4.0])))
    assert reduce_values("slope", data(big)) == pytest.approx(1e200)
    assert reduce_values("slope", data([1.0, 2.0, 3.0], [1e200, 2e200, 3e200])) == pytest.approx(1e-200)
    assert reduce_values("slope", data([0.0, 1e300, 2e300], [0.0, 1e-300, 2e-300])) == math.inf  # 1e600
    pairs = [(float(i), v, v) for i, v in enumerate(big)]
    assert reduce_values("pearson", pairs) == pytest.approx(1.0)
    tiny = [(float(i), v, v) for i, v in enumerate([1e-200, 3e-200, 2e-200])]  # sxx * syy underflowed to 0
    assert reduce_values("pearson", tiny) == pytest.approx(1.0)


def test_statistics_unchanged_in_the_normal_range() -> None:
    """Scaling by a power of two is exact: the scaled statistics equal the direct formulas bit for bit."""
    import random
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(3, 30)
        vs = [rng.gauss(0, 1) * 10.0 ** rng.randint(-6, 6) for _ in range(n)]
        xs = [float(i * rng.randint(1, 3)) for i in range(n)]
        mean = math.fsum(vs) / n
        mx = math.fsum(xs) / n
        cv = math.sqrt(math.fsum((v - mean) ** 2 for v in vs) / n) / abs(mean)
        slope = (math.fsum((x - mx) * (v - mean) for x, v in zip(xs, vs, strict=True))
                 / math.fsum((x - mx) ** 2 for x in xs))
        data = [(x, v, 0.0) for x, v in zip(xs, vs, strict=True)]
        assert reduce_values("mean", data) == mean
        assert reduce_values("cv", data) == cv
        assert reduce_values("slope", data) == slope


def test_large_finite_values_graded_not_crashed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = healthy(5)
    for i, r in enumerate(rows):
        r["tokens"]["padding_fraction"] = 1.7e308
        r["grad_norm"] = 1e200 * (i + 1)
    d = run_dir(tmp_path, rows, {"loss": rows[-1]["loss"]["policy"], "grad_norm": rows[-1]["grad_norm"]})
    assert main(["signals", str(d), "--quiet"]) == 1
    assert capsys.readouterr().out.strip() == \
        "signals KILL; kill: grad_norm_bounded, padding_fraction_bounded"  # cv 0.47: 1e200 to 5e200


@pytest.mark.parametrize("where", ["leaf", "step"])
def test_integer_too_large_for_a_float_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               where: str) -> None:
    rows = healthy(5)
    if where == "leaf":
        rows[3]["kl"]["mean"] = 10 ** 400
    else:
        rows[3]["step"] = 10 ** 400
    d = run_dir(tmp_path, rows, {"loss": rows[-1]["loss"]["policy"], "grad_norm": rows[-1]["grad_norm"]})
    assert main(["signals", str(d)]) == 2
    err = capsys.readouterr().err
    what = "leaf kl.mean" if where == "leaf" else "step"
    assert f"diag.jsonl: line 4: {what} is an integer of 401 digits, too large for a float" in err
    assert "fix:" in err and "Traceback" not in err


@pytest.mark.parametrize("steps", [[0, 1, math.nan, 3], [0, math.inf, -math.inf, 3]])
def test_slope_over_nonfinite_steps_is_nonfinite(tmp_path: Path, steps: list[float]) -> None:
    rows = [{"step": s, "r": float(i)} for i, s in enumerate(steps)]  # inf and -inf made fsum raise
    p = rules(tmp_path, '[[signal]]\nname="trend"\nleaf="r"\nreducer="slope"\nwarn_below=0\n')
    res = evaluate(run_dir(tmp_path, rows), load_rules(p)).results[0]
    assert res.status == "KILL" and "non-finite or undefined" in res.explanation


_CONSISTENCY = '[[consistency]]\nname="c"\nleaf="loss.policy"\nfield="loss"\nkill_above=0.1\n'


@pytest.mark.parametrize(("text", "message"), [
    # a name or meaning with a newline printed a line of its own ("KILL fake") in the verdict table
    ('[[signal]]\nname="a\\nKILL fake"\nleaf="x"\nreducer="last"\nkill_above=1\n', "holds a control character"),
    ('[[signal]]\nname="a\\u001b[2J"\nleaf="x"\nreducer="last"\nkill_above=1\n', "holds a control character"),
    ('[[signal]]\nname="a"\nleaf="x"\nreducer="last"\nkill_above=1\nmeaning="m\\r"\n', "holds a control character"),
    # a bidi override or a line separator reordered or broke the verdict table's line
    ('[[signal]]\nname="a\\u202e"\nleaf="x"\nreducer="last"\nkill_above=1\n', "bidi control"),
    ('[[signal]]\nname="a"\nleaf="x"\nreducer="last"\nkill_above=1\nmeaning="m\\u2028KILL"\n', "bidi control"),
    (_CONSISTENCY + 'summary="m\\u2066.json"\n', "bidi control"),
    # bounds whose band is empty graded every run KILL (or WARN), whatever it did
    ('[[signal]]\nname="a"\nleaf="x"\nreducer="last"\nkill_below=100\nkill_above=0\n',
     "kill_below 100.0 is above kill_above 0.0"),
    ('[[signal]]\nname="a"\nleaf="x"\nreducer="last"\nwarn_below=1\nwarn_above=0.5\n',
     "warn_below 1.0 is above warn_above 0.5"),
    # a summary outside the run directory compared the run with a file it never wrote
    (_CONSISTENCY + 'summary="/etc/metrics.json"\n', "relative to the run directory"),
    (_CONSISTENCY + 'summary="../other-run/metrics.json"\n', "relative to the run directory"),
    (_CONSISTENCY + 'summary="./metrics.json"\n', "relative to the run directory"),
    (_CONSISTENCY + 'summary="."\n', "relative to the run directory"),
    (_CONSISTENCY + 'summary="a//metrics.json"\n', "relative to the run directory"),
    (_CONSISTENCY + 'summary="a\\\\metrics.json"\n', "relative to the run directory"),
])
def test_rules_that_cannot_grade_a_run_honestly_are_refused(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_rules(text, "rules.toml")


def test_a_summary_reached_through_a_linked_directory_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Only the last component was opened without following a link: a linked directory on the way was read
    through, and the run graded against another run's summary."""
    d = run_dir(tmp_path, healthy(3))
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.json").write_text(json.dumps({"loss": healthy(3)[-1]["loss"]["policy"]}))
    (d / "sub").symlink_to(other)
    r = rules(tmp_path, _CONSISTENCY + 'summary="sub/metrics.json"\n')
    assert main(["signals", str(d), "--rules", str(r)]) == 2
    err = capsys.readouterr().err
    assert "'sub' is a symbolic link" in err and "Traceback" not in err
    (d / "sub").unlink()
    (d / "sub").mkdir()
    (d / "sub" / "metrics.json").write_text(json.dumps({"loss": healthy(3)[-1]["loss"]["policy"]}))
    assert main(["signals", str(d), "--rules", str(r)]) == 0


_TREND = '[[signal]]\nname="a"\nleaf="x"\nreducer="slope"\nkill_above=0.5\n' \
         '[[signal]]\nname="b"\nleaf="x"\nreducer="last"\nkill_above=5\n'


@pytest.mark.parametrize(("rows", "message"), [
    # a restarted run appended to the first one's rows: graded OK over the two runs mixed
    ([(0, 0), (1, 0), (2, 0), (0, 9), (1, 9), (2, 1)], "line 4: step 0 does not increase (previous 2)"),
    ([(2, 0), (1, 0), (0, 0)], "line 2: step 1 does not increase (previous 2)"),
    ([(0, 0), (0, 0), (0, 0)], "line 2: step 0 does not increase (previous 0)"),
    ([(0, 0), (None, 1), (2, 0)], "line 2: no 'step', but the first row has one"),
    ([(None, 0), (1, 1), (2, 0)], "line 2: a 'step', but the first row has none"),
    ([(True, 0), (False, 1), (2, 0)], "line 1: step is bool True, not a number"),
    ([("0", 0), ("1", 1), ("2", 0)], "line 1: step is str '0', not a number"),
])
def test_steps_that_start_over_or_come_and_go_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          rows: list[tuple[Any, float]], message: str) -> None:
    """diag-diff refuses these files; signals graded them (a trend and a last value over two runs mixed)."""
    d = run_dir(tmp_path, [{"x": x} if s is None else {"step": s, "x": x} for s, x in rows])
    assert main(["signals", str(d), "--rules", str(rules(tmp_path, _TREND))]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_summary_that_is_a_directory_is_refused_even_when_optional(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An optional rule's summary present as a directory was graded SKIP, as if the run had written none."""
    d = run_dir(tmp_path, healthy(3))
    (d / "metrics.json").mkdir()
    r = rules(tmp_path, _CONSISTENCY + 'summary="metrics.json"\noptional=true\n')
    assert main(["signals", str(d), "--rules", str(r)]) == 2
    err = capsys.readouterr().err
    assert "which is a directory, not a file" in err and "Traceback" not in err


@pytest.mark.parametrize("link", [False, True])
def test_a_consistency_summary_that_is_the_diagnostics_themselves_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], link: bool) -> None:
    """A one-row diag.jsonl is a JSON object: a consistency rule naming it (or a hard link to it) as its summary
    compared the run's last value with itself and graded it consistent (OK, exit 0) on no comparison."""
    d = run_dir(tmp_path, [{"step": 0, "loss": {"policy": 0.5}}])
    summary = "diag.jsonl"
    if link:
        (d / "summary.json").hardlink_to(d / "diag.jsonl")
        summary = "summary.json"
    text = f'[[consistency]]\nname="c"\nleaf="loss.policy"\nsummary="{summary}"\nfield="loss.policy"\nkill_above=0.1\n'
    assert main(["signals", str(d), "--rules", str(rules(tmp_path, text))]) == 2
    err = capsys.readouterr().err
    assert "is the same file" in err and "Traceback" not in err, err


_S = '[[signal]]\nname="a"\nleaf="x"\n'


@pytest.mark.parametrize(("text", "message"), [
    # a lower bound above an upper bound of the other status: no value is OK, every run KILL or WARN
    (_S + 'reducer="last"\nkill_below=10\nwarn_above=5\n', "kill_below 10.0 is above warn_above 5.0: no value"),
    (_S + 'reducer="last"\nwarn_below=10\nkill_above=5\n', "warn_below 10.0 is above kill_above 5.0: no value"),
    # a WARN bound beyond its KILL bound: a value past it is graded KILL first, the warning never applies
    (_S + 'reducer="last"\nkill_above=1\nwarn_above=5\n', "warn_above 5.0 is above kill_above 1.0"),
    (_S + 'reducer="last"\nkill_below=5\nwarn_below=1\n', "warn_below 1.0 is below kill_below 5.0"),
    (_CONSISTENCY.replace("kill_above=0.1", "kill_above=0.01\nwarn_above=0.5") + 'summary="m.json"\n',
     "warn_above 0.5 is above kill_above 0.01"),
    # a bound the reducer's values never reach (or always pass)
    (_S + 'reducer="pearson"\ndelta_of="y"\nkill_below=1.5\n', r"kill_below 1.5 is outside \[-1, 1\]"),
    (_S + 'reducer="pearson"\ndelta_of="y"\nwarn_above=-2\n', r"warn_above -2.0 is outside \[-1, 1\]"),
    (_S + 'reducer="cv"\nkill_below=-0.5\n', r"kill_below -0.5 is outside \[0, inf\]"),
    (_S + 'reducer="cv"\nkill_above=-1\n', r"kill_above -1.0 is outside \[0, inf\]"),
])
def test_thresholds_that_contradict_one_another_or_the_reducer_are_refused(text: str, message: str) -> None:
    """Only the bounds of one status were compared: bounds of KILL and WARN that left no value OK, a WARN bound no
    value could reach before the KILL bound, and a correlation or a coefficient of variation bounded outside the
    values it takes were graded, so a rule always fired or never did."""
    with pytest.raises(ConfigError, match=message):
        parse_rules(text, "rules.toml")


def test_thresholds_that_leave_a_band_for_each_status_are_read() -> None:
    rules = parse_rules(_S + 'reducer="pearson"\ndelta_of="y"\nkill_below=-1\nwarn_below=0.3\nwarn_above=1\n'
                        + '[[signal]]\nname="b"\nleaf="x"\nreducer="last"\nkill_below=0\nwarn_below=1\n'
                        + 'warn_above=5\nkill_above=9\n', "rules.toml")
    assert [r.name for r in rules.signals] == ["a", "b"]
