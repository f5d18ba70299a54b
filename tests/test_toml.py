"""One TOML reader (replayjob.config.load) and one writer (replayjob.config.dump): every config replayjob
writes reads back unchanged, whatever a path holds, and nothing else parses TOML."""

from __future__ import annotations

import ast
import hashlib
import math
import os
import types
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replayjob.cli import main
from replayjob.config import load_config
from replayjob.config.dump import dumps, toml_key, toml_value
from replayjob.config.load import (
    apply_overrides,
    parse_override,
    parse_overrides,
    read_toml,
    read_toml_bytes,
    read_toml_text,
)
from replayjob.errors import ConfigError, IntegrityError

REPO = Path(__file__).resolve().parents[1]
# a space, a double quote, a backslash, non-ASCII letters: every one must survive writing and reading
ODD = 'odd dir "q" back\\slash é ß'


def odd_dir(tmp_path: Path, name: str = ODD) -> Path:
    d = tmp_path / name
    d.mkdir(parents=True)
    return d.resolve()


# -- the writer --------------------------------------------------------------------------------------

@given(st.text())
def test_every_valid_unicode_string_round_trips(s: str) -> None:
    if any("\ud800" <= c <= "\udfff" for c in s):
        with pytest.raises(ConfigError, match="surrogate"):
            toml_value(s)
        return
    assert read_toml_text(f"v = {toml_value(s)}\n", "t")["v"] == s
    assert parse_override(f"a.b={toml_value(s)}") == (["a", "b"], s)
    assert read_toml_text(f"{toml_key(s or 'x')} = 1\n", "t") == {s or "x": 1}


@given(st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
                    | st.floats(allow_nan=False, allow_infinity=False) | st.text(st.characters(codec="utf-8")),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=8))
def test_values_lists_and_inline_tables_round_trip(v: Any) -> None:
    if v is None or (isinstance(v, list | dict) and "None" in repr(v)):
        return  # TOML has no null: None is left out of a table by dumps, never written as a value
    assert read_toml_text(f"v = {toml_value(v)}\n", "t")["v"] == v


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, [1.0, math.nan], {"x": math.inf}])
def test_a_non_finite_float_is_refused_not_written(bad: Any) -> None:
    with pytest.raises(ConfigError, match="must be finite"):
        toml_value(bad, "optimizer.lr")


def test_out_of_range_integers_none_and_objects_are_refused() -> None:
    for bad, needle in ((2**63, "64-bit"), (None, "NoneType"), (object(), "object")):
        with pytest.raises(ConfigError, match=needle):
            toml_value(bad)


def test_dumps_quotes_keys_and_strings() -> None:
    doc = {"a": {"b.c": ODD, "list": [ODD, 1], "t": {"x y": True}}}
    assert read_toml_text(dumps(doc), "t") == doc


# -- the reader --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "needle"), [
    ("a = 1\na = 2\n", "line 2"),
    ("[t]\nx = 1\n[t]\ny = 2\n", "line 3"),
    ("a = [\n", "invalid TOML"),
    ("a = " + "[" * 5000 + "\n", "nested too deeply"),
])
def test_invalid_toml_is_refused_naming_file_and_line(tmp_path: Path, text: str, needle: str) -> None:
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=needle) as exc:
        read_toml(p)
    assert exc.value.where == str(p)
    if "line 2" in needle or "line 3" in needle:
        assert exc.value.hint and "twice" in exc.value.hint


# dotted keys and table headers: the parser nests them without its own limit
@pytest.mark.parametrize("text", ["a" + ".a" * 20_000 + " = 1\n",
                                  "[" + ".".join(["t"] * 20_000) + "]\nx = 1\n",
                                  "a = " + "[" * 70 + "]" * 70 + "\n"])
def test_tables_nested_past_the_limit_are_refused_by_every_reader(tmp_path: Path, text: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Every later walk of the tables recursed (``explain`` ended in a RecursionError traceback, exit 3)."""
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match="nested more than 64 tables or arrays deep"):
        read_toml(p)
    assert main(["explain", str(p)]) == 2
    err = capsys.readouterr().err
    assert "nested more than 64" in err and "Traceback" not in err


def test_bytes_that_are_not_utf8_are_refused_with_their_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"not valid UTF-8 \(at line 3\)"):
        read_toml_bytes(b"a = 1\nb = 2\nc = '\xff'\n", tmp_path / "c.toml")


def test_only_regular_files_of_bounded_size_are_read(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        read_toml(fifo)  # refused without blocking
    with pytest.raises(ConfigError, match="not found"):
        read_toml(tmp_path / "missing.toml")
    big = tmp_path / "big.toml"
    big.write_text("a = 1\n" * 100)
    with pytest.raises(IntegrityError, match="byte limit"):
        read_toml(big, max_bytes=64, error=IntegrityError)
    with pytest.raises(ConfigError, match="byte limit"):
        read_toml_bytes(b"a = 1\n" * 100, big, max_bytes=64)


def test_a_pinned_file_is_checked_against_its_pin_before_it_is_parsed(tmp_path: Path) -> None:
    from replayjob.gate.evidence import read_pinned_toml

    p = tmp_path / "budgets.toml"
    p.write_bytes(b"[ckpt-on\n")  # not TOML: the wrong pin is what is reported
    with pytest.raises(IntegrityError, match="the pin is"):
        read_pinned_toml(p, "budget", expected_sha256="0" * 64)
    good = b"baseline = \"ckpt-off\"\n"
    p.write_bytes(good)
    doc, sha = read_pinned_toml(p, "budget", expected_sha256=hashlib.sha256(good).hexdigest())
    assert doc == {"baseline": "ckpt-off"} and sha == hashlib.sha256(good).hexdigest()
    p.write_bytes(b"a = 1\na = 2\n")
    with pytest.raises(IntegrityError, match="line 2"):
        read_pinned_toml(p, "budget")


def test_set_is_parsed_once() -> None:
    assert parse_overrides(["a.b=1", "a.c='x'", "a.d=plain words", "a.b=2"]) == {"a.b": 2, "a.c": "x",
                                                                                 "a.d": "plain words"}
    # a value followed by more TOML is one string, not a value and a smuggled key
    assert parse_override("a.b=1\nc = 2") == (["a", "b"], "1\nc = 2")


def test_only_the_loader_imports_a_toml_parser() -> None:
    offenders = []
    for path in sorted((REPO / "replayjob").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] in ("tomllib", "tomli", "toml", "tomlkit") for n in names):
                offenders.append(str(path.relative_to(REPO)))
    assert offenders == ["replayjob/config/load.py"]


# -- every config replayjob writes, in a directory whose name needs escaping ------------------------

@pytest.mark.usefixtures("fresh_determinism_mode")
def test_init_workspace_configs_read_back_in_an_odd_directory(tmp_path: Path) -> None:
    from replayjob.launch.workspace import init_workspace

    d = odd_dir(tmp_path)
    init_workspace(d, seed=5)
    for name in ("train.toml", "source.toml"):
        cfg = load_config(d / name)
        assert cfg.resume.from_ == str(d / "init_resume") and cfg.training.seed == 5
    cfg = load_config(d / "replay.toml")
    assert cfg.optimizer_batch.replay_path == str(d / "source" / "optimizer_batch_step_000000.manifest.json")


def test_workspace_comments_hold_any_directory_name() -> None:
    from replayjob.launch.workspace import _in_comment, example_configs

    d = "/tmp/a\nb\tc\x01\x7f " + ODD
    for text in example_configs().values():
        doc = read_toml_text(text.format(seed=1, dir=_in_comment(d)), "example")
        assert doc["training"]["seed"] == 1


def test_chosen_step_replay_config_reads_back(tmp_path: Path) -> None:
    from replayjob.producers.builtin.steps import replay_toml, state_dir_name

    d = odd_dir(tmp_path)
    model = str(odd_dir(tmp_path, "model " + ODD))
    cfg = load_config(None, [f"model.path={toml_value(model)}", "training.seed=3"])
    (d / "replay_step_000002.toml").write_text(replay_toml(cfg, 2, "a" * 64, "b" * 64), encoding="utf-8")
    back = load_config(d / "replay_step_000002.toml")
    assert back.model.path == model
    assert back.resume.from_ == str(d / state_dir_name(2))
    assert back.optimizer_batch.replay_path.startswith(str(d) + "/")
    assert back.optimizer_batch.expected_logical_sha256 == "a" * 64


def test_capture_api_replay_toml_reads_back(tmp_path: Path) -> None:
    from replayjob.producers.api import admission
    from replayjob.producers.api.capture import StepCapture

    d = odd_dir(tmp_path)
    base, manifest = odd_dir(tmp_path, "base " + ODD), d / "step.manifest.json"
    entry = f"{d / 'train script.py'}:main"
    me = types.SimpleNamespace(step=4, framework="torch", entry=entry, base_model_dir=base)
    (d / "replay.toml").write_text(StepCapture._replay_toml(me, manifest, "b" * 64, "a" * 64),  # type: ignore[arg-type]
                                   encoding="utf-8")
    doc = read_toml(d / "replay.toml")
    assert doc["integration"] == {"framework": "torch", "entry": entry}
    assert doc["model"]["path"] == str(base)
    assert doc["optimizer_batch"]["replay_path"] == str(manifest)
    rc = admission.load(d / "replay.toml", [])
    assert rc.document["optimizer_batch"]["replay_path"] == str(manifest)


def test_deploy_step_replay_sets_read_back(tmp_path: Path) -> None:
    from replayjob.artifacts.spec import spec_from_text
    from replayjob.launch import step

    spec = spec_from_text('name = "unit"\nimage = "replayjob:dev"\ngpu_product = "none"\ndevice = "cpu"\n'
                          'repeats = 1\n[arms.a]\n[arms.b]\n"backend.options.gradient_checkpointing" = true\n')
    d = odd_dir(tmp_path)
    manifest = d / "source" / "optimizer_batch_step_000000.manifest.json"
    args = step.replay_args(spec, step.Layout.of(d), spec.run_for_index(1), "a" * 64, "b" * 64, manifest)
    data = apply_overrides({}, args)
    assert data["optimizer_batch"]["replay_path"] == str(manifest)
    assert data["optimizer_batch"]["allow_config_differences"] == ["backend.options.gradient_checkpointing"]
    cfg = load_config(None, args)
    assert cfg.optimizer_batch.replay_path == str(manifest) and cfg.optimizer_batch.arm == "b"


def test_funnel_run_spec_reads_back(tmp_path: Path) -> None:
    from replayjob.launch.funnel import Funnel, Options

    spec = REPO / "examples" / "ablation-microbatch.toml"
    out = odd_dir(tmp_path, "out " + ODD)
    f = Funnel(Options(out=out, spec=spec, device="cpu", repeats=2, only_ablation=True, measured_updates=2),
               progress=lambda line: None)
    path = f.run_spec()
    assert f.run_plan.config["optimizer_batch.measured_updates"] == 2
    assert read_toml(path)["config"]["optimizer_batch.measured_updates"] == 2
    # a model directory whose name holds quotes is written correctly, then refused by the spec's own rule
    # (its values travel through shell words and workflow parameters), naming the key
    model = odd_dir(tmp_path, "model " + ODD)
    g = Funnel(Options(out=odd_dir(tmp_path, "out2 " + ODD), spec=spec, device="cpu", repeats=2,
                       only_ablation=True, model=model), progress=lambda line: None)
    assert parse_overrides(g.common)["model.path"] == str(model)
    with pytest.raises(ConfigError, match=r"model\.path") as exc:
        g.run_spec()
    assert "TOML" not in exc.value.message
    assert read_toml(g.out / "ablation.toml")["config"]["model.path"] == str(model)


def test_integers_outside_the_signed_64_bit_range_are_refused_wherever_they_sit() -> None:
    """TOML integers are 64-bit; Python's parser reads any size, so every TOML read checks them."""
    from replayjob.config.load import read_toml_text
    from replayjob.errors import ConfigError
    assert read_toml_text("a = 9223372036854775807\nb = -9223372036854775808\n", "t.toml") == {
        "a": 2**63 - 1, "b": -(2**63)}
    for text, at in (("a = 9223372036854775808", "at a "), ("[t]\nx = [1, -9223372036854775809]", "at t.x[1] "),
                     ("a = [{b = 0x1_0000_0000_0000_0000}]", "at a[0].b ")):
        with pytest.raises(ConfigError, match="outside the signed 64-bit range") as info:
            read_toml_text(text, "t.toml")
        assert at in info.value.message
