"""diag-diff on handmade JSONL pairs: leaf paths, tolerance rules, alignment, refusals, CLI output."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replayjob.check.diagdiff import diff_files
from replayjob.check.leafdiff import Tolerance, compare_leaves, number_diff
from replayjob.check.leaves import DEFAULT_IGNORES, MISSING, IgnoreSet, flatten, get_leaf, parse_path
from replayjob.cli import __doc__ as CLI_DOC
from replayjob.cli import main
from replayjob.errors import IntegrityError, UsageError


def row(step: int, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "step": step,
        "loss": {"policy": 0.5 + step, "ratio_mean": 1.0},
        "grad_norm_ema": {"q": 64.8 + step},
        "units": {"trail_distance": [0.25, 0.5, 0.75]},
        "tag": "run",
        "ok": True,
        "timing": {"elapsed_s": 1.0 + step, "sample_wall_s": 0.1},
        "memory": {"peak_rss_bytes": 1000},
    }
    base.update(extra)
    return base


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pair(tmp_path: Path, a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[Path, Path]:
    return write(tmp_path / "a.jsonl", a), write(tmp_path / "b.jsonl", b)


# -- leaves -----------------------------------------------------------------------------------

def test_flatten_paths_and_empty_containers() -> None:
    leaves = flatten({"units": {"trail": [1, 2]}, "e": {}, "l": [], "n": None})
    assert leaves == {"units.trail[0]": 1, "units.trail[1]": 2, "e": {}, "l": [], "n": None}


def test_keys_that_read_as_path_syntax_are_quoted() -> None:
    # joined with "." and "[i]", these keys collided with the nested paths: one value overwrote the other
    row_ = {"loss.policy": 1.0, "loss": {"policy": 2.0}, "g[0]": 5.0, "g": [1.0], "": 3, "a]": {"": 4},
            "q": {"x\"y.z": 6}}
    assert flatten(row_) == {'["loss.policy"]': 1.0, "loss.policy": 2.0, '["g[0]"]': 5.0, "g[0]": 1.0,
                             '[""]': 3, '["a]"][""]': 4, 'q["x\\"y.z"]': 6}


def test_keys_holding_unprintable_characters_are_quoted_and_escaped(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A newline or an escape in a key was printed as is: the report showed a line the files never held."""
    row_ = {"x\nrow 2: EQUAL": 1, "e\x1b[2J": 2, "d\x7f": 3, "c\u202e": 4, "caf\u00e9": 5}
    assert flatten(row_) == {'["x\\nrow 2: EQUAL"]': 1, '["e\\u001b[2J"]': 2, '["d\\u007f"]': 3,
                             '["c\\u202e"]': 4, "caf\u00e9": 5}
    a, b = pair(tmp_path, [{"step": 0, "x\nEQUAL": 1.0}], [{"step": 0, "x\nEQUAL": 2.0}])
    assert main(["diag-diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert '["x\\nEQUAL"]' in out and not any(line.startswith("EQUAL") for line in out.splitlines())


_KEYS = st.sampled_from(["", ".", "a", "a.b", "b", "[0]", "a[0]", "]", '"', "\\", '["a"]', "0", "\n", "a\n", "\x7f"])
_TREES = st.recursive(st.integers(0, 3) | st.just({}) | st.just([]),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=4),
                      max_leaves=20)


def _count_leaves(node: Any) -> int:
    if isinstance(node, dict) and node:
        return sum(_count_leaves(v) for v in node.values())
    if isinstance(node, list) and node:
        return sum(_count_leaves(v) for v in node)
    return 1


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_KEYS, _TREES, max_size=5))
def test_flatten_never_merges_two_leaves(row_: dict[str, Any]) -> None:
    """Every leaf keeps a path of its own: no key, however it is spelled, can hide another leaf."""
    assert len(flatten(row_)) == _count_leaves(row_)


def test_a_value_under_a_colliding_key_is_compared(tmp_path: Path) -> None:
    for key, nested in (("loss.policy", {"loss": {"policy": 2.0}}), ("g[0]", {"g": [2.0]})):
        a, b = pair(tmp_path, [{"step": 0, key: 1.0, **nested}], [{"step": 0, key: 999.0, **nested}])
        rep = diff_files(a, b)
        assert rep.first is not None and [(d.path, d.a, d.b) for d in rep.first.top] == [(f'["{key}"]', 1.0, 999.0)]
    # a flat dotted key and the nested leaf of the same name are different leaves, not one
    a, b = pair(tmp_path, [{"step": 0, "loss.policy": 1.0}], [{"step": 0, "loss": {"policy": 1.0}}])
    rep = diff_files(a, b)
    assert rep.first is not None
    assert {(d.path, d.kind) for d in rep.first.top} == {('["loss.policy"]', "only_in_a"), ("loss.policy", "only_in_b")}


def test_ignore_patterns_select_quoted_keys_by_their_bare_name(tmp_path: Path) -> None:
    a, b = pair(tmp_path, [{"step": 0, "v": 1, "timing.elapsed_s": 1.0, "x.y": {"z": 1}}],
                [{"step": 0, "v": 1, "timing.elapsed_s": 2.0, "x.y": {"z": 2}}])
    rep = diff_files(a, b)  # the default ignores still match the flat key's last part
    assert rep.first is not None and [d.path for d in rep.first.top] == ['["x.y"].z']
    assert diff_files(a, b, ignore=["x.y.z"]).equal


def test_parse_and_get_leaf() -> None:
    steps = parse_path("units.trail_distance[2]")
    assert steps == ("units", "trail_distance", 2)
    assert get_leaf(row(0), steps) == 0.75
    assert get_leaf(row(0), parse_path("units.trail_distance[9]")) is MISSING
    assert get_leaf(row(0), parse_path("loss.nope")) is MISSING
    with pytest.raises(UsageError):
        parse_path("a..b")
    for other_digits in ("a[\u0663]", "a[\uff13]", "a[\U0001d7d1]"):  # Arabic-Indic, full-width, math digits 3
        with pytest.raises(UsageError, match="malformed"):  # no alias of a[3]: positions are ASCII digits
            parse_path(other_digits)


def test_ignore_patterns_match_path_last_key_and_indexed_key() -> None:
    ig = IgnoreSet(DEFAULT_IGNORES)
    for path in ("timing.elapsed_s", "timing.sample_wall_s", "phase_wall_s[2]", "memory.peak_rss_bytes",
                 "memory.cuda_max_allocated_bytes", "meta.start_timestamp", "throughput.sps"):
        assert ig.matches(path), path
    for path in ("loss.policy", "grad_norm", "checksums.adapter.sha256", "timing_total"):
        assert not ig.matches(path), path
    literal = IgnoreSet(["units.trail_distance[1]"])  # brackets are literal, not a character class
    assert literal.matches("units.trail_distance[1]") and not literal.matches("units.trail_distance1")


def test_number_rules() -> None:
    tol = Tolerance(rtol=1e-5, atol=1e-7)
    assert number_diff(1.0, 1.0 + 1e-6, tol) is None
    assert number_diff(1.0, 1.0 + 1e-4, tol) == pytest.approx(1e-4)
    assert number_diff(0.0, 5e-8, tol) is None and number_diff(0.0, 5e-7, tol) is not None
    assert number_diff(math.nan, math.nan, tol) is None
    assert number_diff(math.nan, 1.0, tol) == math.inf
    assert number_diff(math.inf, math.inf, tol) is None
    assert number_diff(math.inf, -math.inf, tol) == math.inf
    assert number_diff(10**12, 10**12 + 1, tol) == 1.0  # integers compare exactly
    assert number_diff(2, 2.0, tol) is None  # JSON numbers: an integer and a float may be equal


def test_integer_beyond_the_float_range_is_no_infinity() -> None:
    tol = Tolerance()
    assert number_diff(10 ** 400, math.inf, tol) == math.inf  # read as +inf, it equalled Infinity
    assert number_diff(-math.inf, -(10 ** 400), tol) == math.inf
    assert number_diff(10 ** 400, 1.0, tol) == math.inf
    assert number_diff(10 ** 400, 10 ** 400, tol) is None


def test_compare_leaves_kinds_and_order() -> None:
    drifts = compare_leaves({"a": 1.0, "b": True, "c": "x", "d": 3.0, "e": 1},
                            {"a": 2.0, "b": 1, "c": "y", "d": 30.0, "f": 1}, Tolerance())
    assert [(d.path, d.kind) for d in drifts] == [
        ("b", "type"), ("e", "only_in_a"), ("f", "only_in_b"), ("d", "value"), ("a", "value"), ("c", "value")]


# -- the handmade pairs -----------------------------------------------------------------------

def test_identical_modulo_wall_clock_is_equal(tmp_path: Path) -> None:
    a, b = pair(tmp_path, [row(i) for i in range(5)],
                [row(i, timing={"elapsed_s": 9.0 * i, "sample_wall_s": 0.3},
                     memory={"peak_rss_bytes": 7}) for i in range(5)])
    rep = diff_files(a, b)
    assert rep.equal and rep.exit_code == 0
    assert rep.rows_compared == 5 and rep.aligned_by == "step"


def test_first_divergence_at_row_zero(tmp_path: Path) -> None:
    rows_b = [row(i) for i in range(4)]
    for r in rows_b:
        r["grad_norm_ema"]["q"] += 4.5
    a, b = pair(tmp_path, [row(i) for i in range(4)], rows_b)
    rep = diff_files(a, b)
    assert rep.first is not None and rep.first.step == 0 and rep.first.line_a == 1
    assert [d.path for d in rep.first.top] == ["grad_norm_ema.q"]
    assert rep.first.top[0].abs_diff == pytest.approx(4.5)
    assert rep.rows_diverging == 4 and [r.step for r in rep.first_rows] == [0, 1, 2, 3]


def test_first_divergence_at_middle_row_sorted_by_magnitude(tmp_path: Path) -> None:
    rows_b = [row(i) for i in range(10)]
    for r in rows_b[5:]:
        r["loss"]["policy"] += 0.01
        r["units"]["trail_distance"][1] += 3.0
    a, b = pair(tmp_path, [row(i) for i in range(10)], rows_b)
    rep = diff_files(a, b, top=1)
    assert rep.first is not None and rep.first.step == 5 and rep.first.diverging_leaves == 2
    assert [d.path for d in rep.first.top] == ["units.trail_distance[1]"]  # top 1, the largest
    assert rep.last_row is not None and rep.last_row.step == 9 and rep.last_row.diverging_leaves == 2
    assert rep.rows_compared == 10 and rep.rows_diverging == 5


def test_divergence_only_in_ignored_leaf(tmp_path: Path) -> None:
    a, b = pair(tmp_path, [row(i, extra={"x": 1.0, "y": 2.0}) for i in range(3)],
                [row(i, extra={"x": 1.0, "y": 99.0}) for i in range(3)])
    assert not diff_files(a, b).equal
    assert diff_files(a, b, ignore=["extra.y"]).equal
    assert diff_files(a, b, ignore=["y"]).equal  # last key


def test_type_change(tmp_path: Path) -> None:
    a, b = pair(tmp_path, [row(0), row(1)], [row(0), row(1, ok=1)])  # true -> 1: equal under ==, not here
    rep = diff_files(a, b)
    assert rep.first is not None and rep.first.step == 1
    assert [(d.path, d.kind) for d in rep.first.top] == [("ok", "type")]


def test_missing_and_extra_leaf(tmp_path: Path) -> None:
    rb = row(0)
    del rb["loss"]["ratio_mean"]
    rb["loss"]["extra"] = 1
    a, b = pair(tmp_path, [row(0)], [rb])
    rep = diff_files(a, b)
    assert rep.first is not None
    assert {(d.path, d.kind) for d in rep.first.top} == {("loss.ratio_mean", "only_in_a"),
                                                         ("loss.extra", "only_in_b")}


def test_nan_on_both_sides_is_equal(tmp_path: Path) -> None:
    a, b = pair(tmp_path, [row(0, loss={"policy": math.nan})], [row(0, loss={"policy": math.nan})])
    assert diff_files(a, b).equal
    a, b = pair(tmp_path, [row(0, loss={"policy": math.nan})], [row(0, loss={"policy": 0.0})])
    rep = diff_files(a, b)
    assert rep.first is not None and rep.first.top[0].abs_diff == math.inf


def test_malformed_line_refused_with_its_number(tmp_path: Path) -> None:
    a = write(tmp_path / "a.jsonl", [row(0), row(1), row(2)])
    b = tmp_path / "b.jsonl"
    b.write_text(json.dumps(row(0)) + "\n" + json.dumps(row(1)) + "\n" + '{"step": 2, "loss": \n')
    with pytest.raises(IntegrityError, match="line 3: malformed JSON"):
        diff_files(a, b)
    b.write_text(json.dumps(row(0)) + "\n[1, 2]\n")
    with pytest.raises(IntegrityError, match="line 2: expected a JSON object"):
        diff_files(a, b)


def test_no_rows_missing_file_and_bad_steps_refused(tmp_path: Path) -> None:
    a = write(tmp_path / "a.jsonl", [row(0)])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(IntegrityError, match="no rows"):
        diff_files(a, empty)
    with pytest.raises(IntegrityError, match="file not found"):
        diff_files(a, tmp_path / "nope.jsonl")
    back = write(tmp_path / "back.jsonl", [row(0), row(2), row(1)])
    with pytest.raises(IntegrityError, match="line 3: step 1 does not increase"):
        diff_files(a, back)


def test_rows_aligned_by_step_report_missing_rows(tmp_path: Path) -> None:
    a, b = pair(tmp_path, [row(0), row(1), row(2), row(3)], [row(0), row(2), row(3), row(4)])
    rep = diff_files(a, b)
    assert rep.rows_compared == 3 and rep.rows_only_in_a == 1 and rep.rows_only_in_b == 1
    assert rep.first is not None and rep.first.kind == "only_in_a" and rep.first.step == 1
    assert rep.first.line_a == 2 and rep.first.line_b is None


def test_rows_without_step_align_by_position(tmp_path: Path) -> None:
    a, b = pair(tmp_path, [{"v": 1.0}, {"v": 2.0}], [{"v": 1.0}, {"v": 2.5}, {"v": 3.0}])
    rep = diff_files(a, b)
    assert rep.aligned_by == "position" and rep.rows_only_in_b == 1
    assert rep.first is not None and rep.first.row == 1 and rep.first.step is None


def test_key_order_does_not_matter(tmp_path: Path) -> None:
    r = row(0)
    a, b = pair(tmp_path, [r], [dict(reversed(list(r.items())))])
    assert diff_files(a, b).equal


def test_new_ignored_leaf_after_the_first_row(tmp_path: Path) -> None:
    # the ignored-leaf plan is learned as rows go; a late wall-clock leaf must not count
    a, b = pair(tmp_path, [row(0), row(1, phase={"x_wall_s": 1.0}), row(2, phase={"x_wall_s": 1.0})],
                [row(0), row(1, phase={"x_wall_s": 5.0}), row(2, phase={"x_wall_s": 6.0})])
    assert diff_files(a, b).equal


def test_ignored_array_elements(tmp_path: Path) -> None:
    a, b = pair(tmp_path, [row(i, phase_wall_s=[0.1 * i, 0.2], n=[1, 2]) for i in range(4)],
                [row(i, phase_wall_s=[0.3 * i, 0.4], n=[1, 2]) for i in range(4)])
    assert diff_files(a, b).equal
    a, b = pair(tmp_path, [row(i, phase_wall_s=[0.1, 0.2], n=[1, 2]) for i in range(4)],
                [row(i, phase_wall_s=[0.3, 0.4], n=[1, 2 + (i == 3)]) for i in range(4)])
    rep = diff_files(a, b)
    assert rep.first is not None and rep.first.step == 3 and [d.path for d in rep.first.top] == ["n[1]"]


def test_bad_options_refused(tmp_path: Path) -> None:
    a = write(tmp_path / "a.jsonl", [row(0)])
    with pytest.raises(UsageError):
        diff_files(a, a, tol=Tolerance(rtol=-1.0))
    for tol in (Tolerance(rtol=math.inf), Tolerance(atol=math.inf), Tolerance(atol=math.nan)):
        with pytest.raises(UsageError, match="finite non-negative"):  # inf made any two numbers equal
            diff_files(a, a, tol=tol)
    with pytest.raises(UsageError):
        diff_files(a, a, ignore=[" "])


# -- CLI --------------------------------------------------------------------------------------

def test_cli_exit_codes_and_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows_b = [row(i) for i in range(3)]
    rows_b[2]["grad_norm_ema"]["q"] = 60.3
    a, b = pair(tmp_path, [row(i) for i in range(3)], rows_b)
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(a.read_bytes())
    assert main(["diag-diff", str(a), str(copy)]) == 0
    assert "EQUAL" in capsys.readouterr().out
    assert main(["diag-diff", str(a), str(b), "--top", "3"]) == 1
    out = capsys.readouterr().out
    assert "first divergent row: step 2 (line 3 / 3): 1 diverging leaves" in out
    assert "grad_norm_ema.q" in out
    assert main(["diag-diff", str(a), str(b), "--ignore", "grad_norm_ema.*"]) == 0
    assert main(["diag-diff", str(a), str(b), "--rtol", "1"]) == 0
    capsys.readouterr()
    assert main(["diag-diff", str(a), str(tmp_path / "missing.jsonl")]) == 2
    assert "file not found" in capsys.readouterr().err
    assert main(["diag-diff", str(a), str(b), "--rtol", "x"]) == 2


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = pair(tmp_path, [row(0, loss={"policy": math.nan})], [row(0, loss={"policy": 1.0})])
    assert main(["diag-diff", str(a), str(b), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "replayjob.diag_diff/1" and doc["equal"] is False
    assert doc["first_divergence"]["step"] == 0
    assert doc["first_divergence"]["top"][0] == {"path": "loss.policy", "kind": "value", "a": "NaN", "b": 1.0,
                                                 "abs_diff": "Infinity"}
    assert doc["rows_compared"] == 1 and doc["last_row"]["diverging_leaves"] == 1


def test_help_lists_every_default_ignore() -> None:
    text = " ".join((CLI_DOC or "").split())
    for pattern in DEFAULT_IGNORES:
        assert pattern in text, pattern


@pytest.mark.parametrize("how", ["same path", "hard link", "symbolic link"])
def test_a_file_compared_with_itself_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str) -> None:
    """Two names of one file read EQUAL (exit 0), though nothing about two runs was compared; determinism-check
    refused this for its runs, diag-diff now refuses it too (exit 2)."""
    a = write(tmp_path / "a.jsonl", [row(i) for i in range(3)])
    b = {"same path": a, "hard link": tmp_path / "b.jsonl", "symbolic link": tmp_path / "c.jsonl"}[how]
    if how == "hard link":
        os.link(a, b)
    elif how == "symbolic link":
        b.symlink_to(a)
    assert main(["diag-diff", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert "are one file" in err and "Traceback" not in err


@pytest.mark.parametrize(("a", "b"), [(2**53 + 1, float(2**53)), (float(2**53), 2**53 + 1), (10**17 + 1, 1e17),
                                      (-(2**60) - 1, -float(2**60))])
def test_an_integer_and_a_float_are_compared_exactly(a: int | float, b: int | float, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The integer was rounded to a float before the difference: 2**53 + 1 against 2**53.0 read as no difference,
    EQUAL at zero tolerance where the rows differ."""
    exact = Tolerance(rtol=0.0, atol=0.0)
    assert number_diff(a, b, exact) == 1.0
    assert number_diff(a, b, Tolerance()) is None  # within the default relative tolerance
    assert number_diff(2**53, float(2**53), exact) is None
    pa, pb = pair(tmp_path, [{"step": 0, "x": a}], [{"step": 0, "x": b}])
    assert main(["diag-diff", str(pa), str(pb), "--rtol", "0", "--atol", "0"]) == 1
    assert "DRIFT" in capsys.readouterr().out


def test_an_exact_difference_beyond_the_float_range_is_an_infinite_drift(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """10**308 against -1.7e308: each is in the float range, their exact difference is not (an OverflowError
    traceback, exit 3); it is an infinite difference, never within any tolerance."""
    assert number_diff(10**308, -1.7e308, Tolerance()) == math.inf
    pa, pb = pair(tmp_path, [{"step": 0, "x": 10**308}], [{"step": 0, "x": -1.7e308}])
    assert main(["diag-diff", str(pa), str(pb)]) == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.err and "x" in out.out


@pytest.mark.parametrize("flag", [[], ["--json"]])
def test_a_lone_surrogate_in_a_row_is_refused_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              flag: list[str]) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_bytes(b'{"step":0,"x\\ud800":1}\n')
    b.write_bytes(b'{"step":0,"x\\ud800":2}\n')
    assert main(["diag-diff", str(a), str(b), *flag]) == 2
    err = capsys.readouterr().err
    assert "line 1: malformed JSON: a string holds a lone surrogate (\\ud800)" in err and "Traceback" not in err


def test_a_string_value_is_printed_escaped_when_not_printable(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """JSON escapes control characters below U+0020 only: a bidi override or a C1 control in a string leaf was
    printed raw in the report's table (text reordered on a terminal)."""
    a, b = pair(tmp_path, [{"step": 0, "v": "a\u202eb"}], [{"step": 0, "v": "a\x85b"}])
    assert main(["diag-diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert '"a\\u202eb"' in out and '"a\\u0085b"' in out and out.isprintable() is False  # newlines only
    assert all(line.isprintable() for line in out.splitlines())


@pytest.mark.parametrize(("a_rows", "b_rows"), [
    ([{"step": 1}, {"step": 2}], [{"step": 1}, {"step": 2}]),  # nothing but the step
    ([{"step": 1, "timing": {"elapsed_s": 1.0}}], [{"step": 1, "timing": {"elapsed_s": 9.0}}]),  # step + ignored
    ([{"step": 1, "x": 1.0}], [{"step": 1, "x": 1.0, "timing": {"elapsed_s": 2.0}}]),  # a leaf: compared
])
def test_the_step_that_aligned_rows_is_no_leaf_compared(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        a_rows: list[dict[str, Any]],
                                                        b_rows: list[dict[str, Any]]) -> None:
    """Rows aligned by step hold the same step by construction: files holding nothing but their steps (and ignored
    leaves) read EQUAL (exit 0) on no leaf compared; they are refused as a comparison of nothing (exit 2)."""
    a, b = pair(tmp_path, a_rows, b_rows)
    compared = any(k not in ("step", "timing") for r in a_rows for k in r)
    rc = main(["diag-diff", str(a), str(b)])
    out = capsys.readouterr()
    if compared:
        assert rc == 0 and diff_files(a, b).equal, out
        return
    assert rc == 2 and "nothing compared" in out.err and "but the step that aligned them" in out.err, out
    assert "Traceback" not in out.err


@pytest.mark.parametrize(("line", "said"), [
    (b'{"step":0,"x":"\xed\xa0\x80"}\n', "line 1: not valid UTF-8 at byte 15"),  # an encoded surrogate half
    (b'{"step":0,"\xed\xb0\x80":1}\n', "line 1: not valid UTF-8 at byte 11"),
    (b'\xef\xbb\xbf{"step":0,"x":1}\n', "line 1: malformed JSON: a byte-order mark (U+FEFF) begins the line"),
    (b'{"step":0,"x":1e400}\n', "line 1: malformed JSON: number 1e400 is beyond the float range"),
    (b'{"step":0,"x":-1e400}\n', "line 1: malformed JSON: number -1e400 is beyond the float range"),
    (b'{"step":0,"x":' + b"7" * 5000 + b'}\n', "line 1: malformed JSON: an integer of 5000 digits (at most 4300"),
])
def test_a_line_that_is_no_utf8_json_text_is_refused_by_both_commands(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str],
                                                                      line: bytes, said: str) -> None:
    """The standard library's parser of bytes took an encoded surrogate half (invalid UTF-8) and a byte-order mark
    at the start of any line as text, and read 1e400 as an infinity: both files compared EQUAL and signals graded
    them; an integer of more than 4300 digits was refused with the interpreter's own advice
    (sys.set_int_max_str_digits)."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for p in (a, b):
        p.write_bytes(b'{"step":0,"x":1}\n' + line.replace(b'"step":0', b'"step":1'))
    rules = tmp_path / "rules.toml"
    rules.write_text('[[signal]]\nname="x"\nleaf="x"\nreducer="last"\nkill_above=1e300\n')
    for argv in (["diag-diff", str(a), str(b)], ["signals", str(a), "--rules", str(rules)]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert said.replace("line 1", "line 2") in err and "Traceback" not in err and "sys.set_int" not in err, err


@pytest.mark.parametrize(("rows", "said"), [
    ([{"step": 1.0, "x": 1}, {"step": 0.0, "x": 2}], "line 2: step 0.0 does not increase (previous 1)"),
    ([{"x": 1}, {"step": 1, "x": 2}, {"step": 0, "x": 3}], "line 2: a 'step', but the first row has none"),
    ([{"step": "0", "x": 1}, {"step": "0", "x": 2}], "line 1: step is str '0', not a number"),
    ([{"step": True, "x": 1}, {"step": False, "x": 2}], "line 1: step is bool True, not a number"),
    ([{"step": None, "x": 1}, {"step": None, "x": 2}], "line 1: step is NoneType None, not a number"),
    ([{"step": {"k": 1}, "x": 1}], "line 1: step is dict {'k': 1}, not a number"),
    ([{"step": 10**400, "x": 1}], "line 1: step is an integer of 401 digits, too large for a float"),
    ([{"step": 0, "x": 1}, {"step": 1.5, "x": 2}], "line 2: step 1.5 is not an integer, but the first row's is"),
])
def test_steps_are_read_as_signals_reads_them(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              rows: list[dict[str, Any]], said: str) -> None:
    """diag-diff checked the steps only when both first rows held an integer one: a restarted run appended with
    float steps, a first row without a step, or steps that are strings, bools or null compared EQUAL (exit 0)
    where signals refused the same file."""
    a, b = pair(tmp_path, rows, rows)
    assert main(["diag-diff", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err
