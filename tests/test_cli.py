"""The CLI surface: help, version, usage errors, exit codes."""

from __future__ import annotations

import ast
import errno
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import replayjob
from replayjob.cli import COMMANDS, main, usage_for
from replayjob.errors import EXIT_ERROR, NegativeVerdict, OperationalError, RefusedError, error_for_exit_status


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert f"replayjob {name}" in out


def test_every_command_resolves_to_a_handler_of_the_commands_package() -> None:
    import importlib
    import inspect

    from replayjob.cli import handler
    for name, target in COMMANDS.items():
        module, _, function = target.partition(":")
        assert module.startswith("replayjob.commands.") and function.startswith("cmd_"), target
        found = handler(name)
        assert found is getattr(importlib.import_module(module), function)
        assert list(inspect.signature(found).parameters) == ["args"], target


# One valid command line per usage line of the CLI (every required argument and option given).
EXAMPLES = [
    ["init", "d"], ["train", "c.toml"], ["capture", "c.toml", "--out", "o"], ["explain", "c.toml", "--json"],
    ["replay", "c.toml", "--repeat", "3", "--set", "a=1", "--trace"],
    ["reduce", "r1", "r2", "--claim", "bitwise", "--out", "v.json", "--source", "s", "--source-step", "2"],
    ["funnel", "--out", "o", "--plant-kill", "--capture", "c", "--replay-config", "r.toml"],
    ["step", "plan", "--spec", "s.toml", "--plant", "p"], ["step", "prune", "--run-root", "r", "--older-than", "3"],
    ["step", "verdict", "--run-dir", "r", "--code", "0"],
    ["step", "capture", "--spec", "s.toml", "--run-dir", "r"],
    ["step", "replay", "--spec", "s.toml", "--run-dir", "r", "--position", "1", "--ranks", "2"],
    ["step", "reduce", "--spec", "s.toml", "--run-dir", "r", "--blocks", "2"],
    ["k8s", "render", "s.toml", "--out", "o"], ["k8s", "submit", "s.toml", "--wait"], ["k8s", "resume", "id"],
    ["k8s", "drive", "--spec", "s.toml"], ["argo", "wait", "wf"], ["trace-diff", "a", "b", "--reference", "r"],
    ["mismatch", "c", "--bound", "b.toml"], ["diag-diff", "a.jsonl", "b.jsonl", "--ignore", "x*"],
    ["determinism-check", "c.toml", "--runs", "2"], ["determinism-check", "--command", "run {out}"],
    ["signals", "run", "--quiet"], ["bundle", "inspect", "b"], ["bundle", "validate", "b", "--json"],
    ["bundle", "replay", "b", "--sample", "1", "--sample", "2", "--rollout", "0"],
]


def test_a_command_parses_with_its_own_usage_lines_exactly_as_with_the_whole_text() -> None:
    """What usage_for trims (every other command's lines) changes no value the command's parse yields."""
    from docopt import docopt

    whole = replayjob.cli.__doc__ or ""
    usage = whole.split("Usage:\n", 1)[1].split("\n\n", 1)[0]
    assert {argv[0] for argv in EXAMPLES} == set(COMMANDS)
    assert sum(line.startswith("  replayjob ") for line in usage.splitlines()) == len(EXAMPLES) + 2  # help, version
    for argv in EXAMPLES:
        own = usage_for(argv)
        assert own != whole and own.count("\n  replayjob ") < whole.count("\n  replayjob "), argv
        full, trimmed = docopt(whole, argv=argv), docopt(own, argv=argv)
        assert {k: full[k] for k in trimmed} == dict(trimmed), argv
    for argv in (["--help"], ["reduce", "--help"], ["--version"], ["nosuchcommand"], []):
        assert usage_for(argv) == whole


def _keys_read(fn: object, table: dict[str, object], seen: set[str]) -> set[str]:
    """The docopt keys a handler reads (args["K"], args.get("K"), helper(args, "K")), following the calls it
    makes to functions of its module and of replayjob.commands._args."""
    tree = ast.parse(inspect.getsource(fn).strip() if not isinstance(fn, str) else fn)
    keys: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "args" \
                and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            keys.add(node.slice.value)
        elif isinstance(node, ast.Call):
            pos = [a for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            getter = isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
                and node.func.value.id == "args" and node.func.attr == "get"
            helper = bool(node.args) and isinstance(node.args[0], ast.Name) and node.args[0].id == "args"
            if pos and (getter or helper):
                keys.add(pos[0].value)
            name = node.func.id if isinstance(node.func, ast.Name) else None
            if name in table and name not in seen:
                seen.add(name)
                keys |= _keys_read(table[name], table, seen)
    return keys


def test_every_handler_reads_only_what_its_commands_usage_declares() -> None:
    """A command parses with its own usage lines only (usage_for), so a key of another command's lines is not
    in its arguments: every key a handler reads must be declared by its command's lines."""
    import importlib

    from replayjob.commands import _args

    for name, target in COMMANDS.items():
        module, _, function = target.partition(":")
        mod = importlib.import_module(module)
        table = {k: v for m in (mod, _args) for k, v in vars(m).items()
                 if inspect.isfunction(v) and v.__module__ == m.__name__}
        own = usage_for([name]).split("Usage:\n", 1)[1].split("\n\n", 1)[0]
        words = set(re.findall(r"<[^>]+>|--[a-z-]+|(?<![-<])\b[a-z][a-z-]*\b", own))
        read = _keys_read(getattr(mod, function), table, {function})
        assert read, target
        assert read <= words, f"{name}: {sorted(read - words)} not in its usage lines"
        if name == "reduce":  # planted: a key of diag-diff's lines read by reduce is reported
            planted = "def cmd_reduce(args):\n    return args['--rtol'], args.get('--claim'), integer(args, '--top')\n"
            assert _keys_read(planted, {}, set()) - words == {"--rtol", "--top"}


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == replayjob.__version__


@pytest.mark.parametrize("argv", [["nosuchcommand"], ["train"], ["init"], []])
def test_usage_errors_exit_2_without_traceback(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("raw", ["x", "1_000", " 7", "7 ", "\u0663", "+3", "1.0", "0x10", "1" * 21])
def test_bad_integer_option(capsys: pytest.CaptureFixture[str], tmp_path: object, raw: str) -> None:
    """Only ASCII decimal digits (an optional leading -): int() alone would read an underscore, spaces, a plus
    sign and other scripts' digits."""
    assert main(["init", str(tmp_path), "--seed", raw]) == 2
    assert "--seed expects an integer" in capsys.readouterr().err


def _raise(exc: BaseException) -> Any:
    def boom(*args: object, **kwargs: object) -> None:
        raise exc
    return boom


def test_unexpected_exception_exits_3_with_the_traceback_in_the_output_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import replayjob.gate.reducer as reducer

    monkeypatch.setattr(reducer, "reduce_evidence", _raise(OSError(errno.EIO, "Input/output error")))
    out = tmp_path / "gate"
    out.mkdir()
    code = main(["reduce", str(tmp_path), "--claim", "exact-input", "--out", str(out / "verdict.json")])
    assert code == EXIT_ERROR == 3
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line, no traceback on the terminal
    assert "error (exit 3, nothing was decided; retrying may help): OSError: [Errno 5] Input/output error" in err
    (trace,) = out.glob("replayjob-error-*.txt")
    assert str(trace) in lines[0]
    text = trace.read_text(encoding="utf-8")
    assert "Traceback (most recent call last)" in text and "Input/output error" in text
    assert not (out / "verdict.json").exists()  # nothing was decided, so no verdict


def test_memory_error_in_init_exits_3_and_a_retry_is_not_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import replayjob.commands.source as source

    monkeypatch.setattr(source, "init_workspace", _raise(MemoryError()))
    assert main(["init", str(tmp_path / "ws")]) == 3
    err = capsys.readouterr().err
    assert "MemoryError; traceback in" in err and "Traceback" not in err
    assert len(list((tmp_path / "ws").glob("replayjob-error-*.txt"))) == 1
    monkeypatch.undo()
    assert main(["init", str(tmp_path / "ws")]) == 0  # the traceback file is no artifact


@pytest.mark.parametrize("below", [False, True])
def test_init_into_a_file_is_refused_before_any_model_is_built(tmp_path: Path, below: bool,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``init`` naming a file (or a directory below one) as the workspace: refused (2) with one line, the file left
    as it was (it failed when the state was written: exit 3 with a traceback)."""
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"mine")
    assert main(["init", str(blocker / "ws" if below else blocker)]) == 2
    err = capsys.readouterr().err
    assert "not a directory" in err and "Traceback" not in err, err
    assert blocker.read_bytes() == b"mine" and [p.name for p in tmp_path.iterdir()] == ["a-file"]


def test_unexpected_exception_without_output_directory_goes_to_stderr(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import replayjob.check.diagdiff as diagdiff

    monkeypatch.setattr(diagdiff, "diff_files", _raise(RuntimeError("CUDA error: an illegal memory access")))
    assert main(["diag-diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 3
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.strip().splitlines()[-1].endswith(
        "RuntimeError: CUDA error: an illegal memory access; traceback above")


@pytest.mark.parametrize(("status", "cls"), [(1, NegativeVerdict), (2, RefusedError), (3, OperationalError),
                                             (137, OperationalError), (-9, OperationalError)])
def test_child_exit_status_keeps_its_meaning(status: int, cls: type) -> None:
    assert error_for_exit_status(status) is cls


@pytest.mark.parametrize(("code", "exit_code"), [(errno.ENOSPC, 3), (errno.EIO, 3), (errno.EACCES, 2),
                                                   (errno.EROFS, 2)])
def test_a_failing_write_is_an_error_only_when_the_device_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str], code: int,
                                                                 exit_code: int) -> None:
    """A full disk or an I/O error decided nothing (3, retryable); a path the user must change is refused (2).
    Either way nothing is left behind: no temp file, no artifact."""
    import os as _os

    def failing_fsync(fd: int) -> None:
        raise OSError(code, _os.strerror(code))

    monkeypatch.setattr("replayjob.fsio.os.fsync", failing_fsync)
    assert main(["init", str(tmp_path / "ws")]) == exit_code
    err = capsys.readouterr().err
    assert "Traceback" not in err.split("traceback")[0] and _os.strerror(code) in err
    assert not [p for p in (tmp_path / "ws").rglob("*") if p.is_file() and not p.name.startswith("replayjob-error-")]


def test_a_crash_in_step_reduce_exits_3_with_the_traceback_in_the_run_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`step reduce` also sets docopt's `reduce` key but has no --out: the error report must still land."""
    def boom(args: dict[str, Any]) -> int:
        raise RuntimeError("planted")

    import replayjob.commands.launch as deploy

    monkeypatch.setattr(deploy, "cmd_step", boom)
    run = tmp_path / "run"
    assert main(["step", "reduce", "--spec", str(tmp_path / "s.toml"), "--run-dir", str(run)]) == 3
    assert "RuntimeError: planted" in capsys.readouterr().err
    (report,) = run.iterdir()
    assert report.name.startswith("replayjob-error-") and "planted" in report.read_text()


def _run_with_closed(argv: list[str], closed: tuple[str, ...]) -> tuple[int, str]:
    """Run ``python -m replayjob argv`` with the named streams' readers already gone (a pipe whose read end
    is closed, as after ``| head -1`` has exited); returns the exit code and stderr when it is open."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    pipes = {}
    for name in closed:
        r, w = os.pipe()
        os.close(r)
        pipes[name] = w
    try:
        proc = subprocess.run([sys.executable, "-m", "replayjob", *argv], cwd=REPO, text=True, timeout=120,
                              stdout=pipes.get("stdout", subprocess.DEVNULL),
                              stderr=pipes.get("stderr", subprocess.PIPE))
    finally:
        for w in pipes.values():
            os.close(w)
    return proc.returncode, proc.stderr or ""


@pytest.mark.parametrize("closed", [("stdout",), ("stderr",), ("stdout", "stderr")])
@pytest.mark.parametrize(("argv", "code"), [(["step", "plan", "--spec", "examples/ablation.toml"], 0),
                                            (["explain", "/nonexistent/replay.toml"], 2)])
def test_a_closed_output_never_changes_the_exit_code(argv: list[str], code: int, closed: tuple[str, ...]) -> None:
    """`replayjob explain CONFIG | head -1`: the command's own code, no BrokenPipeError traceback, and no
    120 from the interpreter's final flush."""
    got, err = _run_with_closed(argv, closed)
    assert got == code, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err



def test_an_error_raised_into_a_user_s_script_reads_as_the_cli_prints_it(tmp_path: Path) -> None:
    """The capture API raises into training scripts: ``str(exc)`` names where and how to fix, as the CLI does."""
    from replayjob.errors import ArtifactExistsError
    from replayjob.producers.api.files import refuse_existing

    (tmp_path / "metrics.json").write_text("{}")
    with pytest.raises(ArtifactExistsError) as info:
        refuse_existing(tmp_path, ["metrics.json"])
    text = str(info.value)
    assert text == info.value.diagnostics()
    assert str(tmp_path / "metrics.json") in text and "fix: choose a new output directory" in text
    assert str(OperationalError("device lost", hint="retry")) == "device lost\n  fix: retry"


def test_every_integer_option_has_a_declared_range() -> None:
    """Each option a command reads through ``integer``/``integer_or`` is in OPTION_RANGES, and only those are."""
    from replayjob.commands import _args
    read = set()
    for path in (Path(replayjob.__file__).parent / "commands").glob("*.py"):
        read |= set(re.findall(r"integer(?:_or)?\(args, \"(--[a-z-]+)\"", path.read_text()))
    assert read == set(_args.OPTION_RANGES), (read ^ set(_args.OPTION_RANGES))


def test_every_number_option_has_a_declared_range() -> None:
    """Each option read through ``number`` is in NUMBER_RANGES, and no command reads an option with ``float()``."""
    from replayjob.commands import _args
    read = set()
    for path in (Path(replayjob.__file__).parent / "commands").glob("*.py"):
        text = path.read_text()
        read |= set(re.findall(r"number\(args, \"(--[a-z-]+)\"", text))
        assert not re.search(r"float\(args\[", text), path
    assert read == set(_args.NUMBER_RANGES), (read ^ set(_args.NUMBER_RANGES))


@pytest.mark.parametrize("raw", ["1_0", " 1", "1 ", "nan", "NaN", "inf", "-inf", "infinity", "\u0663", "0x10", "1e400",
                                 "-1e-5", "1e7", "", "1e", ".", "+-1", "1e-1000000"])
def test_a_number_option_must_be_a_plain_decimal_in_range(raw: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``--rtol 1_0`` read as ten and ``--atol nan`` as NaN through float(); each is refused before any file is
    read (the files here do not exist)."""
    from replayjob.commands._args import number
    with pytest.raises(RefusedError, match="--rtol"):
        number({"--rtol": raw}, "--rtol")
    code = main(["diag-diff", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--rtol", raw])
    err = capsys.readouterr().err
    assert code == 2 and "--rtol" in err and "Traceback" not in err


@pytest.mark.parametrize("raw,value", [("0", 0.0), ("1e-5", 1e-5), ("0.5", 0.5), (".5", 0.5), ("1.", 1.0),
                                       ("1E+3", 1000.0), ("-0", -0.0), ("1000000", 1e6)])
def test_a_plain_decimal_number_option_is_read(raw: str, value: float) -> None:
    from replayjob.commands._args import number
    assert number({"--rtol": raw}, "--rtol") == value


@pytest.mark.parametrize("key", sorted(__import__("replayjob.commands._args", fromlist=["_"]).OPTION_RANGES))
def test_an_integer_option_outside_its_range_is_refused(key: str) -> None:
    from replayjob.commands._args import OPTION_RANGES, integer
    lo, hi = OPTION_RANGES[key]
    assert integer({key: str(lo)}, key) == lo and integer({key: str(hi)}, key) == hi
    for bad in (lo - 1, hi + 1):
        with pytest.raises(RefusedError, match=f"{key} must be between"):
            integer({key: str(bad)}, key)


@pytest.mark.parametrize("looks", ["0", "-3", "1001", "99999999999999999999999"])
def test_reduce_refuses_an_absurd_max_looks_whatever_else_is_given(looks: str, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """No --budgets: the range holds anyway (a zero once reached the paired comparison and divided by it)."""
    out = tmp_path / "verdict.json"
    code = main(["reduce", str(tmp_path), "--claim", "exact-input", "--out", str(out), "--max-looks", looks])
    err = capsys.readouterr().err
    assert code == 2 and "--max-looks" in err and "Traceback" not in err
