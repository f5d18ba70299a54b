"""``discover`` finds exactly what a walk with :func:`os.walk` finds, in pathlib's order, with one listing per
directory; except that an entry named replay_metrics.json counts whatever it is (its reader refuses a directory
or a FIFO there: malformed evidence, never missing evidence) and is not entered."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from replayjob.errors import RefusedError
from replayjob.gate.evidence import REPLAY_FILE, discover


def _walked(paths: list[str | Path]) -> list[Path]:
    """The reference: :func:`os.walk` below each directory, ``Path`` keys, pathlib's sort."""
    found: dict[Path, None] = {}
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            found.setdefault(Path(os.path.abspath(p)), None)
        else:
            for d, dirs, names in os.walk(os.path.abspath(p)):
                if REPLAY_FILE in names or REPLAY_FILE in dirs:
                    found.setdefault(Path(d) / REPLAY_FILE, None)
                if REPLAY_FILE in dirs:
                    dirs.remove(REPLAY_FILE)  # counted, not entered
    return sorted(found)


def test_discover_finds_what_os_walk_finds(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    for rel in ("a/r-1", "a/r-2", "a-b/r-1", "a/r-1/final_adapter", "deep/x/y/z", "a.b/r"):
        (root / rel).mkdir(parents=True)
        (root / rel / REPLAY_FILE).write_text("{}")
    (root / "a" / "r-2" / "other.json").write_text("{}")
    (root / "named" / REPLAY_FILE).mkdir(parents=True)  # a directory of that name is counted, not entered
    (root / "named" / REPLAY_FILE / REPLAY_FILE).write_text("{}")
    outside = tmp_path / "outside"
    (outside / "r").mkdir(parents=True)
    (outside / "r" / REPLAY_FILE).write_text("{}")
    (root / "file-link").mkdir()
    (root / "file-link" / REPLAY_FILE).symlink_to(outside / "r" / REPLAY_FILE)  # a link to a file counts
    (root / "dangling").mkdir()
    (root / "dangling" / REPLAY_FILE).symlink_to(tmp_path / "missing")  # as os.walk: a name, not a directory
    got = discover([str(root)])
    assert got == _walked([root])
    assert [p.relative_to(root).as_posix() for p in got] == [
        "a/r-1/final_adapter/replay_metrics.json", "a/r-1/replay_metrics.json", "a/r-2/replay_metrics.json",
        "a-b/r-1/replay_metrics.json", "a.b/r/replay_metrics.json", "dangling/replay_metrics.json",
        "deep/x/y/z/replay_metrics.json", "file-link/replay_metrics.json",
        "named/replay_metrics.json"]
    again = discover([str(root / "a"), root, root / "a" / "r-1" / REPLAY_FILE])  # each file once
    assert again == got == _walked([root / "a", root, root / "a" / "r-1" / REPLAY_FILE])
    assert all(type(p) is type(root) for p in got)


@pytest.mark.parametrize("where", ["linked-dir", "a/r-1/linked-repeat", f"dir-link/{REPLAY_FILE}"])
def test_a_linked_directory_or_an_unreadable_one_is_refused_not_passed_over(tmp_path: Path, where: str) -> None:
    """A walk would pass over a directory reached through a link, or one it cannot list, in silence: a replay
    hidden there would drop out of the evidence unseen, so discovery refuses it, naming it."""
    root = tmp_path / "runs"
    (root / "a" / "r-1").mkdir(parents=True)
    (root / "a" / "r-1" / REPLAY_FILE).write_text("{}")
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / where).parent.mkdir(parents=True, exist_ok=True)
    (root / where).symlink_to(outside)
    with pytest.raises(RefusedError, match="symbolic link to a directory") as info:
        discover([root])
    assert str(info.value.where).endswith(where)
    (root / where).unlink()
    locked = root / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        if os.access(locked, os.R_OK):  # root reads what it likes: nothing to refuse
            return
        with pytest.raises(RefusedError, match="cannot list"):
            discover([root])
    finally:
        locked.chmod(0o755)


def test_discover_listed_hands_each_replay_its_directory_listing(tmp_path: Path) -> None:
    """The names a search listed go with each file it found (rank files included); a file named directly has
    none, so its reader lists its directory itself."""
    from replayjob.gate.evidence import discover_listed

    for rel in ("a", "b"):
        (tmp_path / rel).mkdir()
        (tmp_path / rel / REPLAY_FILE).write_text("{}")
    (tmp_path / "a" / "replay_metrics.rank-1.json").write_text("{}")
    (tmp_path / "a" / "final_adapter").mkdir()
    got = discover_listed([tmp_path / "b" / REPLAY_FILE, tmp_path])
    assert [p for p, _ in got] == discover([tmp_path]) == _walked([tmp_path])
    listings = {p.parent.name: names for p, names in got}
    assert listings["b"] is None  # named directly: found first as a file
    assert sorted(listings["a"] or ()) == ["final_adapter", REPLAY_FILE, "replay_metrics.rank-1.json"]


def test_verdict_paths_are_relpaths(tmp_path: Path) -> None:
    """A verdict names each input relative to the verdict's directory exactly as os.path.relpath would."""
    from replayjob.gate.reducer import _rel

    cases = [("/a/b/c", "/a"), ("/a/b", "/a/b"), ("/a/bc", "/a/b"), ("/x", "/"), ("/a/b/../c/d", "/a"),
             ("rel/x", str(tmp_path)), ("/a", "/a/b/c"), ("//a/b", "//a"), (str(tmp_path / "r" / REPLAY_FILE), "/")]
    for path, base in cases:
        assert _rel(Path(path), Path(base)) == os.path.relpath(os.path.abspath(path), Path(base)), (path, base)
