"""Budgets: reduce --budgets over synthetic, paired evidence (docs/verdict-format.md, "Budgets").

The replays are replayjob.gate.synthetic's files with a schedule slot, host, device, budget pin and
chosen step times written in; each decision (pass / fail / inconclusive with an estimate / not
measurable on CPU) is checked with its exit code, and every refusal of the pairing is named.
The real slowdown (micro-batch 1 against the default) is exercised end to end in test_funnel.py.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from replayjob.artifacts.schedule import parse_slot, plan
from replayjob.artifacts.verdict import outcome
from replayjob.cli import main
from replayjob.errors import IntegrityError, UsageError
from replayjob.gate import synthetic
from replayjob.gate.budgets import more_blocks, read_budgets
from replayjob.jsonio import pretty_bytes

BASE, SLOW = "mb-default", "mb-1"
MB = "training.micro_batch_size"


def budget_file(tmp_path: Path, text: str, name: str = "budgets.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def paired(tmp_path: Path, budgets: Path | None, walls: dict[str, list[float]], *,
           hosts: dict[str, list[str]] | None = None, slots: bool = True,
           edit: Callable[[dict[str, Any], str, int], None] | None = None,
           arms: dict[str, dict[str, Any]] | None = None) -> synthetic.Evidence:
    """Synthetic evidence with ``walls[arm][block]`` as step times, run as an ABBA schedule."""
    return synthetic.paired(tmp_path / "ev", arms or {BASE: {}, SLOW: {MB: 1}}, walls, budgets=budgets, hosts=hosts,
                            slots=slots, edit=edit)


def reduce(ev: synthetic.Evidence, budgets: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    out = ev.root.parent / "verdict.json"
    code = main(["reduce", str(ev.root / "replays"), "--claim", "exact-input", "--source", str(ev.source),
                 "--out", str(out), "--baseline", BASE, "--budgets", str(budgets), *extra])
    doc = json.loads(out.read_text())
    assert doc["exit_code"] == code
    return code, doc


def bound(doc: dict[str, Any], metric: str = "local_train_wall_s") -> dict[str, Any]:
    (row,) = [b for b in doc["budgets"]["bounds"] if b["metric"] == metric]
    return row


SLOWDOWN = {BASE: [1.0, 1.1, 0.9], SLOW: [3.0, 3.4, 2.6]}


def test_violated_budget_fails_generous_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tight = budget_file(tmp_path, f'[{SLOW}]\nlocal_train_wall_s = {{ max_ratio = 1.5 }}\n')
    code, doc = reduce(paired(tmp_path / "a", tight, SLOWDOWN), tight)
    assert code == 1 and doc["status"] == "fail"
    b = bound(doc)
    assert b["decision"] == "fail" and b["pairs"] == 3 and b["low"] > 1.5
    assert math.isclose(b["ratio"], 3.0, rel_tol=0.01)
    assert doc["budgets"]["procedure"]["name"] == "bonferroni-alpha-spending"
    assert doc["budgets"]["design"]["schedules"] == [{"design": "abba", "seed": 5}]
    generous = budget_file(tmp_path, f'[{SLOW}]\nlocal_train_wall_s = {{ max_ratio = 10 }}\n', "gen.toml")
    code, doc = reduce(paired(tmp_path / "b", generous, SLOWDOWN), generous)
    assert code == 0 and bound(doc)["decision"] == "pass", doc["failed_checks"]
    assert "budgets pass 1" in capsys.readouterr().out


def test_too_close_to_call_is_inconclusive_with_an_estimate(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    close = budget_file(tmp_path, f'[{SLOW}]\nlocal_train_wall_s = {{ max_ratio = 3.0 }}\n')
    code, doc = reduce(paired(tmp_path, close, {BASE: [1.0, 1.0], SLOW: [2.8, 3.3]}), close, "--min-repeats", "2",
                       "--report", str(tmp_path / "report.md"))
    assert code == 2 and doc["status"] == "inconclusive" and doc["refusal"] is None
    report = (tmp_path / "report.md").read_text()
    assert "## Budgets" in report and "| INCONCLUSIVE |" in report
    b = bound(doc)
    assert b["decision"] == "inconclusive" and b["low"] < 3.0 < b["high"]
    assert isinstance(b["more_blocks"], int) and b["more_blocks"] >= 1
    err = capsys.readouterr().err
    assert "not decided yet" in err and "more paired block" in err and "Traceback" not in err


def test_more_looks_widen_each_interval(tmp_path: Path) -> None:
    """Bonferroni spending: a look among at most 20 is decided at 1 - 0.05/20."""
    f = budget_file(tmp_path, f'[{SLOW}]\nlocal_train_wall_s = {{ max_ratio = 10 }}\n')
    walls = {BASE: [1.0, 1.2, 0.8, 1.1, 0.9], SLOW: [3.0, 2.9, 3.6, 2.2, 3.1]}
    _, one = reduce(paired(tmp_path / "a", f, walls), f)
    _, many = reduce(paired(tmp_path / "b", f, walls), f, "--max-looks", "20")
    assert many["budgets"]["procedure"]["look_confidence"] == pytest.approx(0.9975)
    assert bound(many)["low"] <= bound(one)["low"] and bound(many)["high"] >= bound(one)["high"]


def test_estimate_formula() -> None:
    # n = 4, estimate 1.0, interval [0.8, 1.25], limit 1.1: h = ln 1.25, d = ln 1.1
    assert more_blocks(4, 1.0, 0.8, 1.25, 1.1) == math.ceil(4 * (math.log(1.25) / math.log(1.1)) ** 2) - 4
    assert more_blocks(1, 1.0, 1.0, 1.0, 2.0) == 1
    assert more_blocks(3, 2.0, 1.5, 2.5, 2.0) is None


def test_memory_bound_is_not_measurable_on_cpu(tmp_path: Path) -> None:
    f = budget_file(tmp_path, f'[{SLOW}]\npeak_memory_bytes = {{ max_ratio = 0.8 }}\n')
    code, doc = reduce(paired(tmp_path, f, SLOWDOWN), f)
    assert code == 0 and bound(doc, "peak_memory_bytes")["decision"] == "not_measurable"


@pytest.mark.parametrize("case, needle", [
    ("unpinned", "inputs.budgets_pinned"),
    ("no_slots", "no schedule slot"),
    ("cross_node", "allow_cross_node"),
])
def test_pairing_and_pin_refusals(tmp_path: Path, case: str, needle: str) -> None:
    f = budget_file(tmp_path, f'[{SLOW}]\nlocal_train_wall_s = {{ max_ratio = 10 }}\n')
    hosts = {BASE: ["a", "a", "a"], SLOW: ["a", "b", "a"]} if case == "cross_node" else None
    ev = paired(tmp_path, None if case == "unpinned" else f, SLOWDOWN, hosts=hosts, slots=case != "no_slots")
    code, doc = reduce(ev, f)
    assert code == 2 and doc["status"] == "refused"
    assert needle in json.dumps(doc["checks"])
    if case == "cross_node":  # declared before the runs (the declaration is in the pinned file)
        g = budget_file(tmp_path, f'allow_cross_node = true\n[{SLOW}]\nlocal_train_wall_s = {{ max_ratio = 10 }}\n',
                        "cross.toml")
        code, doc = reduce(paired(tmp_path / "x", g, SLOWDOWN, hosts=hosts), g)
        assert code == 0, doc["failed_checks"]


@pytest.mark.parametrize("text, needle", [
    ("[mb-1]\nlocal_train_wall_s = { max_ratio = -1 }\n", "positive finite"),
    ("[mb-1]\nwall = { max_ratio = 1 }\n", "unknown metric"),
    ("[mb-1]\nlocal_train_wall_s = { below = 1 }\n", "max_ratio and/or min_ratio"),
    ("baseline = 3\n", "baseline must be"),
    ("", "no bound"),
])
def test_malformed_budget_files_are_refused(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(IntegrityError, match=needle):
        read_budgets(budget_file(tmp_path, text))


OK = "[mb-1]\nlocal_train_wall_s = { max_ratio = 2 }\n"


@pytest.mark.parametrize("text, where, needle", [
    ("[mb-1]\nlocal_train_wall_s = { max_ratio = true }\n", "mb-1.local_train_wall_s.max_ratio",
     "max_ratio must be a positive finite number, got `bool`"),
    ('[mb-1]\nlocal_train_wall_s = { min_ratio = "0.5" }\n', "mb-1.local_train_wall_s.min_ratio",
     "min_ratio must be a positive finite number, got `str`"),
    ("[mb-1]\nlocal_train_wall_s = { max_ratio = 1e400 }\n", "mb-1.local_train_wall_s.max_ratio",
     "max_ratio must be a positive finite number"),
    ("[mb-1]\nlocal_train_wall_s = { max_ratio = inf }\n", "mb-1.local_train_wall_s.max_ratio",
     "max_ratio must be a positive finite number"),
    ("[mb-1]\nlocal_train_wall_s = { max_ratio = 0 }\n", "mb-1.local_train_wall_s.max_ratio",
     "max_ratio must be a positive finite number"),
    ("[mb-1]\nwall = { max_ratio = 1 }\n", "mb-1", "unknown metric 'wall'"),
    ("[mb-1]\nlocal_train_wall_s = {}\n", "mb-1.local_train_wall_s", "declares no bound"),
    ("[mb-1]\nlocal_train_wall_s = 2.0\n", "mb-1.local_train_wall_s", "must be an inline table"),
    ("[mb-1]\n", "mb-1", "bounds no metric"),
    ("[mb-1]\nlocal_train_wall_s = { min_ratio = 3, max_ratio = 2 }\n", "mb-1.local_train_wall_s",
     "min_ratio 3.0 is above max_ratio 2.0"),
    ('basline = "mb-default"\n' + OK, None, "unknown top-level key 'basline'"),
    ("mb-2 = 1.5\n" + OK, None, "unknown top-level key 'mb-2'"),
    ('baseline = ""\n' + OK, "baseline", "baseline must be an arm name"),
    ('allow_cross_node = "yes"\n' + OK, "allow_cross_node", "allow_cross_node must be true or false, got `str`"),
])
def test_each_budget_rule_is_refused_naming_arm_and_metric(tmp_path: Path, text: str, where: str | None,
                                                           needle: str) -> None:
    """Every rule of the declaration (replayjob.artifacts.budgets_file) refuses, located as the file reads."""
    p = budget_file(tmp_path, text)
    with pytest.raises(IntegrityError) as info:
        read_budgets(p)
    assert needle in info.value.message, info.value.message
    assert str(info.value.where) == (f"{p}: {where}" if where else str(p))


def test_a_sound_budget_file_reads_every_bound(tmp_path: Path) -> None:
    """Every bound, in the file's order of arms and metrics (the verdict lists them so)."""
    p = budget_file(tmp_path, 'baseline = "mb-default"\nallow_cross_node = true\n[mb-1]\n'
                              "peak_memory_bytes = { max_ratio = 2 }\n"
                              "local_train_wall_s = { max_ratio = 1.5, min_ratio = 1 }\n[mb-2]\n"
                              "in_process_train_wall_s = { min_ratio = 0.5 }\n")
    got = read_budgets(p)
    assert got.baseline == "mb-default" and got.allow_cross_node
    assert [(b.arm, b.metric, b.kind, b.limit) for b in got.bounds] == [
        ("mb-1", "peak_memory_bytes", "max_ratio", 2.0), ("mb-1", "local_train_wall_s", "max_ratio", 1.5),
        ("mb-1", "local_train_wall_s", "min_ratio", 1.0), ("mb-2", "in_process_train_wall_s", "min_ratio", 0.5)]
    assert all(type(b.limit) is float for b in got.bounds)


def test_contradictory_bounds_are_refused_not_graded(tmp_path: Path) -> None:
    """min_ratio above max_ratio: no ratio meets both, so the file contradicts itself; it is refused (2), never
    graded fail (the ratio, about 3, is above max_ratio = 2)."""
    f = budget_file(tmp_path, f'[{SLOW}]\nlocal_train_wall_s = {{ min_ratio = 4.0, max_ratio = 2.0 }}\n')
    code, doc = reduce(paired(tmp_path, f, SLOWDOWN), f)
    assert code == 2 and doc["status"] == "refused", doc["failed_checks"]
    assert "min_ratio 4.0 is above max_ratio 2.0" in doc["refusal"]["message"]
    assert doc["refusal"]["where"].endswith(f"{SLOW}.local_train_wall_s")
    equal = budget_file(tmp_path, f'[{SLOW}]\nlocal_train_wall_s = {{ min_ratio = 2.0, max_ratio = 2.0 }}\n',
                        "equal.toml")
    assert len(read_budgets(equal).bounds) == 2  # a point is a bound, not a contradiction


def test_budgets_need_a_baseline(tmp_path: Path) -> None:
    f = budget_file(tmp_path, f'[{SLOW}]\nlocal_train_wall_s = {{ max_ratio = 10 }}\n')
    ev = paired(tmp_path, f, SLOWDOWN)
    out = tmp_path / "v.json"
    code = main(["reduce", str(ev.root / "replays"), "--claim", "exact-input", "--source", str(ev.source),
                 "--out", str(out), "--budgets", str(f)])
    assert code == 2 and json.loads(out.read_text())["refusal"]["message"].startswith("budgets are ratios")


def test_outcome_order() -> None:
    checks = [{"name": "a", "status": "inconclusive"}, {"name": "b", "status": "pass"}]
    assert outcome(checks, None) == ("inconclusive", 2, ["a"])
    assert outcome([*checks, {"name": "c", "status": "fail"}], None)[0] == "fail"


def test_schedule_is_interleaved_and_extendable() -> None:
    full = plan(["a", "b"], 4, "abba", seed=3)
    assert [a for a, _ in full[:2]] == [a for a, _ in full[2:4]][::-1]  # alternating order
    assert plan(["a", "b"], 2, "abba", seed=3, first_block=2) == full[4:]  # blocks added later continue it
    rnd = plan(["a", "b", "c"], 3, "random", seed=1)
    assert all(sorted(a for a, s in rnd if s.block == b) == ["a", "b", "c"] for b in range(3))
    assert parse_slot(full[3][1].arg()) == full[3][1]
    with pytest.raises(UsageError):
        parse_slot("abba:1:2")


GENEROUS = f"[{SLOW}]\nlocal_train_wall_s = {{ max_ratio = 1.5 }}\n"
EVEN = {BASE: [1.0, 1.1, 0.9], SLOW: [1.0, 1.05, 0.95]}


def copy_replay(ev: synthetic.Evidence, arm: str, block: int, wall: float) -> str:
    """One more replay of ``arm``, copied from its block 0 into block ``block`` with step time ``wall``."""
    src = next(f for f in ev.replay_files if f.parent.parent.name == arm and '"block": 0' in f.read_text())
    dst = src.parent.parent / f"repeat-{block:03d}"
    shutil.copytree(src.parent, dst)
    doc = json.loads((dst / src.name).read_text())
    doc["repeat_index"] = block
    doc["schedule"]["block"] = block
    timing = doc["timing"]  # its parts scaled with the whole, and the run around the update longer than it
    timing.update({k: v * wall / timing["local_train_wall_s"] for k, v in timing.items()})
    doc["wall_s"] = max(doc["wall_s"], wall + 1.0)
    (dst / src.name).write_bytes(pretty_bytes(doc))
    return f"{arm}#{block}"


def test_replays_in_blocks_without_their_pair_are_refused_not_dropped(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A block runs every arm once: three slow replays of the arm in blocks the baseline never ran are not
    silently left out of the pairs (the bound would pass on the 3 even pairs), the blocks are refused."""
    f = budget_file(tmp_path, GENEROUS)
    code, doc = reduce(paired(tmp_path / "even", f, EVEN), f)
    assert code == 0 and bound(doc)["decision"] == "pass" and bound(doc)["pairs"] == 3, doc["failed_checks"]
    ev = paired(tmp_path / "slow", f, EVEN)
    labels = [copy_replay(ev, SLOW, b, 9.0) for b in (10, 11, 12)]
    capsys.readouterr()
    code, doc = reduce(ev, f)
    assert code == 2 and doc["status"] == "refused" and doc["failed_checks"] == ["budgets.pairing"]
    assert bound(doc)["decision"] == "not_evaluated"
    (pairing,) = [c for c in doc["checks"] if c["name"] == "budgets.pairing"]
    assert pairing["offenders"] == [f"blocks 10, 11, 12 lack arm(s) {BASE} but hold {', '.join(labels)}: a block "
                                    "runs every arm once, so these replays have no pair (replay the missing arm(s) "
                                    "in those blocks, or take these replays out of the reduced evidence)"]
    err = capsys.readouterr().err
    assert "blocks 10, 11, 12 lack" in err and "Traceback" not in err
    # the reverse: a baseline replay whose block holds no replay of the arm
    ev = paired(tmp_path / "base", f, EVEN)
    label = copy_replay(ev, BASE, 7, 0.1)
    code, doc = reduce(ev, f)
    assert code == 2 and doc["status"] == "refused"
    assert f"block 7 lacks arm(s) {SLOW} but holds {label}:" in json.dumps(doc["checks"])


def set_position(changes: dict[tuple[str, int], int]) -> Callable[[dict[str, Any], str, int], None]:
    def edit(doc: dict[str, Any], arm: str, block: int) -> None:
        if (arm, block) in changes:
            doc["schedule"]["position"] = changes[(arm, block)]
    return edit


def swap_block(block: int) -> dict[tuple[str, int], int]:
    """Block ``block`` of the synthetic ABBA schedule (seed 5) with its two positions exchanged."""
    at = {arm: s.position for arm, s in plan([BASE, SLOW], block + 1, "abba", seed=5) if s.block == block}
    return {(BASE, block): at[SLOW], (SLOW, block): at[BASE]}


@pytest.mark.parametrize("changes, needle", [
    ({(BASE, 1): 0, (SLOW, 1): 0}, f"block 1: positions {SLOW}#1 at 0, {BASE}#1 at 0; the design gives its 2 "
                                   "arm(s) positions 0 .. 1, each once"),
    ({(BASE, 2): 99}, "block 2: positions "),
    (swap_block(1), "block 1: positions "),
])
def test_positions_that_contradict_the_design_are_refused(tmp_path: Path, changes: dict[tuple[str, int], int],
                                                          needle: str) -> None:
    f = budget_file(tmp_path, GENEROUS)
    code, doc = reduce(paired(tmp_path, f, EVEN, edit=set_position(changes)), f)
    assert code == 2 and doc["status"] == "refused" and doc["failed_checks"] == ["budgets.pairing"]
    (pairing,) = [c for c in doc["checks"] if c["name"] == "budgets.pairing"]
    assert len(pairing["offenders"]) == 1 and pairing["offenders"][0].startswith(needle), pairing["offenders"]
    if changes == swap_block(1):  # the order the design gives block 1, from blocks 0 and 2
        order = [a for a, s in plan([BASE, SLOW], 2, "abba", seed=5) if s.block == 1]
        assert pairing["offenders"][0].endswith(f"abba with seed 5 runs block 1 as {', '.join(order)} "
                                                "(the order of block(s) 0, 2)")


def test_a_random_schedule_is_recomputed_from_its_seed(tmp_path: Path) -> None:
    """Three arms in a seeded random order: the reducer does not know the launch order, but every block's order
    and the design give it back; the schedule as planned passes, one block in another order is refused."""
    arms = {BASE: {}, SLOW: {MB: 1}, "mb-2": {MB: 2}}
    walls = {**EVEN, "mb-2": [1.0, 1.0, 1.0, 1.0]}
    walls = {a: [*w, 1.0][:4] for a, w in walls.items()}
    slots = {(a, s.block): s for a, s in plan(list(arms), 4, "random", seed=11)}

    def random_schedule(doc: dict[str, Any], arm: str, block: int) -> None:
        doc["schedule"] = slots[(arm, block)].to_json()

    f = budget_file(tmp_path, GENEROUS)
    code, doc = reduce(paired(tmp_path / "ok", f, walls, arms=arms, edit=random_schedule), f)
    assert code == 0 and doc["budgets"]["design"]["schedules"] == [{"design": "random", "seed": 11}], \
        doc["failed_checks"]
    order = [a for a, s in plan(list(arms), 4, "random", seed=11) if s.block == 2]
    rotated = {a: (slots[(a, 2)].position + 1) % 3 for a in arms}

    def rotate_block_2(doc: dict[str, Any], arm: str, block: int) -> None:
        random_schedule(doc, arm, block)
        if block == 2:
            doc["schedule"]["position"] = rotated[arm]

    code, doc = reduce(paired(tmp_path / "bad", f, walls, arms=arms, edit=rotate_block_2), f)
    assert code == 2 and doc["status"] == "refused"
    (pairing,) = [c for c in doc["checks"] if c["name"] == "budgets.pairing"]
    assert pairing["offenders"] == [pairing["offenders"][0]] and pairing["offenders"][0].startswith("block 2: ")
    assert pairing["offenders"][0].endswith(f"random with seed 11 runs block 2 as {', '.join(order)} "
                                            "(the order of block(s) 0, 1, 3)")


@pytest.mark.parametrize("walls", [{BASE: [1e300] * 3, SLOW: [1e-300] * 3}, {BASE: [1e-300] * 3, SLOW: [1e300] * 3}],
                         ids=["underflow", "overflow"])
def test_finite_timings_whose_ratio_leaves_the_floats_decide_nothing(tmp_path: Path,
                                                                      walls: dict[str, list[float]]) -> None:
    """Two finite, positive step times can still give a ratio of 0 or infinity (1e300 / 1e-300): the bound is refused
    and the paired comparison not evaluated, each saying why, in a verdict that is written (no traceback, no NaN)."""
    f = budget_file(tmp_path, f'[{SLOW}]\nlocal_train_wall_s = {{ max_ratio = 10 }}\n')
    code, doc = reduce(paired(tmp_path / "a", f, walls), f)
    assert code == 2 and bound(doc)["decision"] == "refused" and "overflow or underflow" in bound(doc)["note"]
    ev = paired(tmp_path / "b", None, walls)
    out = tmp_path / "plain.json"
    code = main(["reduce", str(ev.root / "replays"), "--claim", "exact-input", "--source", str(ev.source),
                 "--out", str(out), "--baseline", BASE])
    row = json.loads(out.read_text())["comparisons"]["paired"]["arms"][SLOW]
    assert code == 0 and row["decision"] == "not_evaluated" and "overflow or underflow" in row["note"]
