"""``bundle inspect``: what a bundle (or a capture directory) holds, tolerant of incomplete ones.

Unlike the reader this never refuses: it reports identity, producer, the capability per stage,
a payload summary and a list of what is missing or wrong, so an unfinished capture can be looked
at.  It performs no numerics and trusts nothing it shows (use ``bundle validate`` for that): a
field of the wrong type is a problem listed, never a traceback; a linked ``rank-<r>/`` or bundle
is named and not read through; a rank directory holding no rank manifest of its root, or one
whose manifest is not the one the root COMPLETE records, is listed with both digests.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from replayjob.bundle import format as fmt
from replayjob.bundle.reader import is_bundle, is_multi_rank_root
from replayjob.bundle.schema import decode_manifest
from replayjob.digest import sha256_bytes
from replayjob.errors import IntegrityError, ReplayjobError
from replayjob.fsio import read_regular_bytes
from replayjob.jsonio import DEFAULT_MAX_BYTES, read_json_object


def _doc(p: Path, problems: list[str]) -> dict[str, Any] | None:
    if not p.exists():
        problems.append(f"{p.name} is missing")
        return None
    try:
        return read_json_object(p)
    except ReplayjobError as exc:
        problems.append(f"{p.name}: {exc.message}")
        return None


def _single(p: Path) -> dict[str, Any]:
    problems: list[str] = []
    seal = p / fmt.COMPLETE
    out: dict[str, Any] = {"path": str(p), "layout": "bundle", "complete": seal.is_file() and not seal.is_symlink()}
    if not out["complete"]:
        problems.append("COMPLETE is missing: the bundle is incomplete")
    m = _doc(p / fmt.MANIFEST, problems) or {}
    ix: dict[str, Any] = m["index"] if isinstance(m.get("index"), dict) else {}
    version = m.get("format_version")
    if m and not fmt.reads_version(version):
        problems.append(f"bundle format {version} is not read by this replayjob (it reads {fmt.FORMAT_VERSION})")
    elif m and (kind_problem := fmt.kind_version_problem(version, m.get("kind"),
                                                         isinstance(m.get("multi_rank"), dict))):
        problems.append(kind_problem)
    elif m and not ix:
        problems.append("the manifest has no index section")
    elif m:
        try:  # what validate would refuse the manifest for, shown rather than refused
            decode_manifest(m, p / fmt.MANIFEST)
        except ReplayjobError as exc:
            problems.append(f"{fmt.MANIFEST}: {exc.message}")
    out.update(bundle_id=m.get("bundle_id"), kind=m.get("kind"), format_version=m.get("format_version"),
               producer=m.get("producer"), redaction=m.get("redaction"), multi_rank=m.get("multi_rank"))
    stages: dict[str, Any] = m["stages"] if isinstance(m.get("stages"), dict) else {}
    out["stages"] = {s: {"capability": c.get("capability"), "reason": c.get("reason")}
                     for s, c in stages.items() if isinstance(c, dict)}
    payloads = []
    specs: dict[str, Any] = m["payloads"] if isinstance(m.get("payloads"), dict) else {}
    f = p / fmt.PAYLOAD_FILE
    present = f.is_file() and not f.is_symlink()
    if specs and not present:
        problems.append(f"the payload file {fmt.PAYLOAD_FILE} is missing")
    for name, spec in sorted(specs.items()):
        if not isinstance(spec, dict):
            continue
        payloads.append({"name": name, "role": spec.get("role"), "dtype": spec.get("dtype"),
                         "shape": spec.get("shape"), "present": present})
    out["payloads"] = payloads
    ident = ix.get("identity") if isinstance(ix.get("identity"), dict) else {}
    out["identity"] = ident
    samples: list[Any] = ix["samples"] if isinstance(ix.get("samples"), list) else []
    recs = [s for s in samples if isinstance(s, dict)]
    out["samples"] = len(recs)
    odd = [i for i, s in enumerate(samples) if not isinstance(s, dict) or not isinstance(s.get("group"), str | None)]
    if odd:  # listed, never hashed: a group id is a string (validate refuses anything else)
        problems.append(f"index.samples{odd[:5]}{' ...' if len(odd) > 5 else ''}: not a sample record with a "
                        "string (or null) group")
    out["groups"] = len({s["group"] for s in recs if isinstance(s.get("group"), str)})
    out["ungrouped_samples"] = sum(1 for s in recs if s.get("group") is None)
    out["consumer_batches"] = dict(sorted(Counter(str(s.get("consumer_batch")) for s in recs).items()))
    out["micro_batches"] = dict(sorted(Counter(str(s.get("micro_batch")) for s in recs).items()))
    cfg = ix.get("config") if isinstance(ix.get("config"), dict) else {}
    out["config"] = cfg
    out["problems"] = problems
    return out


def inspect_path(path: str | Path) -> dict[str, Any]:
    """Summarise a bundle, a multi-rank root or a capture directory of bundles."""
    p = Path(path)
    if not p.is_dir():
        raise IntegrityError("not a directory", where=p, hint="pass a bundle or capture directory")
    if (p / fmt.MANIFEST).exists() or ((p / fmt.COMPLETE).exists() and not is_multi_rank_root(p)):
        return _single(p)
    if is_multi_rank_root(p):
        return _root(p)
    entries = sorted(c for c in p.iterdir() if not c.name.startswith("."))
    linked = [c.name for c in entries if c.is_symlink() and c.is_dir()]  # never read through (validate refuses)
    children = [inspect_path(c) for c in entries if not c.is_symlink() and c.is_dir() and is_bundle(c)]
    problems = [f"{name} is a symbolic link: not read (a bundle must be a directory, never a link)" for name in linked]
    return {"path": str(p), "layout": "capture-dir", "bundles": children,
            "problems": problems + ([] if children else ["no bundle in this directory"])}


def _rank_list(value: object) -> list[int] | None:
    """``value`` when it is a list of ranks (integers >= 0, no booleans), else None."""
    if isinstance(value, list) and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in value):
        return list(value)
    return None


def _root(p: Path) -> dict[str, Any]:
    """A multi-rank root: its records, each ``rank-*`` directory (a link is named, never read through) and what
    the records say about each rank compared with what the rank holds."""
    problems: list[str] = []
    landed = sorted(x.name.split(".", 1)[1] for x in p.glob(f"{fmt.COMPLETE}.*"))
    root_doc: dict[str, Any] | None = None
    if (p / fmt.COMPLETE).exists() or (p / fmt.COMPLETE).is_symlink():
        root_doc = _doc(p / fmt.COMPLETE, problems)
    else:
        problems.append(f"root COMPLETE is missing: landed ranks {landed}; a rank-local bundle is refused until "
                        "every expected rank lands")
    pinned = root_doc.get("rank_manifests") if root_doc is not None else None
    pinned = pinned if isinstance(pinned, dict) else {}
    ranks = []
    for r in sorted(p.glob("rank-*")):
        if r.is_symlink():
            problems.append(f"{r.name} is a symbolic link: not read through (validate refuses it)")
            continue
        if not r.is_dir():
            problems.append(f"{r.name} is not a directory")
            continue
        info = _single(r)
        ranks.append(info)
        number = r.name.split("-", 1)[1]
        mr = info.get("multi_rank")
        if mr is None:
            problems.append(f"{r.name} holds a single bundle (multi_rank null), not a rank of this root")
        elif not isinstance(mr, dict) or _rank_list(mr.get("expected_ranks")) is None:
            problems.append(f"{r.name}: multi_rank records no list of expected ranks")
        elif str(mr.get("rank")) != number:
            problems.append(f"{r.name}: its manifest says rank {mr.get('rank')!r}")
        sha = _manifest_sha256(r)
        if isinstance(pinned.get(number), str) and sha is not None and pinned[number] != sha:
            problems.append(f"rank {number}'s manifest.json has SHA-256 {sha}, the root COMPLETE records "
                            f"{pinned[number]}")
    expected = next((_rank_list(r["multi_rank"].get("expected_ranks")) for r in ranks
                     if isinstance(r.get("multi_rank"), dict) and _rank_list(r["multi_rank"].get("expected_ranks"))
                     is not None), None)
    missing = [f"rank {r} has not landed" for r in expected or [] if str(r) not in landed]
    return {"path": str(p), "layout": "multi-rank", "complete": root_doc is not None and not missing,
            "landed_ranks": landed, "expected_ranks": expected, "ranks": ranks, "problems": problems + missing}


def _manifest_sha256(bundle: Path) -> str | None:
    try:
        return sha256_bytes(read_regular_bytes(bundle / fmt.MANIFEST, max_bytes=DEFAULT_MAX_BYTES,
                                               follow_symlinks=False, what="manifest.json"))
    except ReplayjobError:
        return None  # listed by _single


def render(info: dict[str, Any], indent: str = "") -> str:
    """The human form of :func:`inspect_path`; every line's unprintable characters escaped (:func:`_printable`)."""
    lines = []
    if info["layout"] == "capture-dir":
        lines.append(_printable(f"{indent}capture directory {info['path']}: {len(info['bundles'])} bundle(s)"))
        lines += [render(b, indent + "  ") for b in info["bundles"]]
    elif info["layout"] == "multi-rank":
        lines.append(_printable(f"{indent}multi-rank bundle {info['path']}: landed {info['landed_ranks']} of "
                                f"{info['expected_ranks']}{'' if info['complete'] else ' (INCOMPLETE)'}"))
        lines += [render(r, indent + "  ") for r in info["ranks"]]
    else:
        own = []
        ident = info.get("identity") or {}
        own.append(f"{indent}bundle {info.get('bundle_id')} ({info.get('kind')}) at {info['path']}"
                   f"{'' if info['complete'] else ' (INCOMPLETE)'}")
        own.append(f"{indent}  identity: rollout {ident.get('rollout_id')} step {ident.get('step_id')} "
                   f"physical {ident.get('physical')}")
        own.append(f"{indent}  producer: {info.get('producer')}")
        cfg = info.get("config") or {}
        own.append(f"{indent}  samples {info['samples']} in {info['groups']} group(s) (estimator "
                   f"{cfg.get('estimator')}, samples_per_prompt {cfg.get('samples_per_prompt')}); "
                   f"consumer batches {info['consumer_batches']}; micro-batches {len(info['micro_batches'])}")
        for s, c in sorted(info["stages"].items(), key=lambda kv: fmt.STAGE_ORDER.index(kv[0])
                           if kv[0] in fmt.STAGE_ORDER else len(fmt.STAGE_ORDER)):
            reason = f" — {c['reason']}" if c.get("reason") else ""
            own.append(f"{indent}  stage {s}: {c['capability']}{reason}")
        for pl in info["payloads"]:
            own.append(f"{indent}  payload {pl['name']} [{pl['role']}] {pl['dtype']} {pl['shape']} "
                       f"{'' if pl['present'] else ' MISSING'}".rstrip())
        lines += [_printable(line) for line in own]
    lines += [_printable(f"{indent}  problem: {x}") for x in info.get("problems", [])]
    return "\n".join(lines)


def _printable(line: str) -> str:
    """``line`` with every character that is not printable escaped as JSON writes it (``\\n``, ``\\u202e``):
    inspect reads documents it has not validated, and a newline or an escape in a field would print text of its
    own (a stage line no stage has)."""
    if line.isprintable():
        return line
    return "".join(c if c.isprintable() else json.dumps(c)[1:-1] for c in line)
