"""Choosing what to replay: a bundle inside a capture directory, then samples inside a bundle.

A capture directory holds several bundles (``rollout-*``, ``step-*``, ``update-*``, multi-rank
roots); ``--step R:S`` picks the step or update bundle of exactly that actor step, ``--rollout R``
the rollout or update bundle of that rollout (an update bundle holds a rollout and its one step).
A candidate whose manifest cannot be read refuses the selection, named: it is never skipped.
Inside a bundle, ``--sample``, ``--group`` and ``--batch`` (micro-batch ids) select samples, and
the selection always expands to whole semantic groups, read from each sample's recorded
membership.  A selected sample without membership is refused: a group is never inferred from a
batch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replayjob.bundle import format as fmt
from replayjob.bundle.reader import Bundle, is_bundle
from replayjob.errors import ContractError, IntegrityError, ReplayjobError, UsageError
from replayjob.jsonio import read_json_object


@dataclass(frozen=True)
class Selection:
    rows: list[int]          # bundle rows to recompute, in bundle order (whole groups)
    partial: bool            # fewer rows than the bundle holds
    requested: dict[str, list[str]]


def _identity(p: Path) -> tuple[str, int, int | None]:
    """(kind, rollout_id, step_id) of a candidate, read for matching only (validated later).

    A candidate whose manifest cannot be read raises: skipping it could turn an ambiguous selector into an
    unambiguous pick of another bundle."""
    ranks = sorted(r for r in p.glob("rank-*") if r.is_dir() and not r.is_symlink())  # never read through a link
    first = p if (p / fmt.MANIFEST).exists() else next(iter(ranks), None)
    where = (first or p) / fmt.MANIFEST
    try:
        if first is None:
            raise IntegrityError("manifest.json is missing, and no rank-<r>/ directory holds one", where=p)
        ix: dict[str, Any] = read_json_object(where)["index"]
        kind, rid, sid = ix["kind"], ix["identity"]["rollout_id"], ix["identity"]["step_id"]
        if kind not in fmt.KINDS or type(rid) is not int or not (sid is None or type(sid) is int):
            # read as they are (a string "0", a bool, a float 3.0) they would match nothing: the candidate skipped
            raise ValueError(f"index.kind {kind!r}, index.identity.rollout_id {rid!r} and step_id {sid!r} are not a "
                             "kind, an integer and an integer or null")
        return kind, rid, sid
    except ReplayjobError as exc:
        cause = exc.message
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        cause = f"no index.kind and index.identity to match ({type(exc).__name__}: {exc})"
    raise IntegrityError(f"the capture directory holds bundle {p.name!r}, whose manifest cannot be read to match the "
                         f"selector ({cause}); it could be the bundle selected, so none is picked", where=where,
                         hint=f"pass the bundle's directory, or repair or move {p.name!r} out of the capture "
                              "directory")


def resolve(path: str | Path, step: tuple[int, int] | None, rollout: int | None) -> Path:
    """The bundle directory to replay: ``path`` itself, or the one child matching the selector."""
    p = Path(path)
    if step is not None and rollout is not None:
        raise UsageError("--step and --rollout are mutually exclusive")
    if not p.is_dir() or p.is_symlink():
        raise IntegrityError("bundle not found (or not a directory)", where=p)
    if is_bundle(p) or p.name.startswith("rank-"):
        return p
    entries = sorted(c for c in p.iterdir() if not c.name.startswith("."))
    linked = [c for c in entries if c.is_symlink() and c.is_dir()]
    if linked:  # never read through to be matched: it could be the bundle selected, so none is picked
        raise IntegrityError(f"the capture directory holds {linked[0].name!r}, a symbolic link to a directory: a "
                             "bundle is never read through a link, so it cannot be matched to the selector, and it "
                             "could be the bundle selected, so none is picked", where=linked[0],
                             hint="replace the link by the bundle's directory, or move it out of the capture directory")
    children = [c for c in entries if c.is_dir() and is_bundle(c)]
    if not children:
        raise IntegrityError("no bundle in this directory", where=p, hint="pass a bundle or capture directory")
    matches = []
    for c in children:
        kind, rid, sid = _identity(c)  # a candidate that cannot be read refuses the selection
        if _matches(kind, rid, sid, step, rollout):
            matches.append(c)
    if len(matches) == 1:
        return matches[0]
    names = [c.name for c in children]
    if not matches:
        raise ContractError(f"no bundle in the capture directory matches the selector; present: {names}",
                            where=p, hint="--step R:S matches a step or update bundle exactly; --rollout R a "
                                          "rollout or update bundle")
    raise UsageError(f"the capture directory holds {len(matches)} matching bundles: {[c.name for c in matches]}",
                     where=p, hint="choose one with --step R:S or --rollout R, or pass its directory")


def _matches(kind: str, rid: int, sid: int | None, step: tuple[int, int] | None, rollout: int | None) -> bool:
    """Whether a bundle of ``kind`` and identity ``(rid, sid)`` is what ``--step``/``--rollout`` select."""
    if step is not None:
        return kind in fmt.STEP_KINDS and (rid, sid) == step
    if rollout is not None:
        return kind in fmt.ROLLOUT_KINDS and rid == rollout
    return True


def check_identity(b: Bundle, step: tuple[int, int] | None, rollout: int | None) -> None:
    """``--step``/``--rollout`` given with a bundle directory must match its identity exactly."""
    ident = b.index["identity"]
    if step is not None and not _matches(b.kind, ident["rollout_id"], ident["step_id"], step, None):
        raise ContractError(f"--step {step[0]}:{step[1]} does not match this {b.kind} bundle "
                            f"(rollout {ident['rollout_id']}, step {ident['step_id']})", where=b.path)
    if rollout is not None and not _matches(b.kind, ident["rollout_id"], ident["step_id"], None, rollout):
        raise ContractError(f"--rollout {rollout} does not match this {b.kind} bundle "
                            f"(rollout {ident['rollout_id']})", where=b.path,
                            hint="--rollout selects rollout and update bundles; use --step R:S for step bundles")


def select(b: Bundle, samples: list[str], groups: list[str], batches: list[str]) -> Selection:
    """Expand sample, group and micro-batch selectors to whole semantic groups (fail closed)."""
    recs = b.samples
    requested = {"sample": list(samples), "group": list(groups), "batch": list(batches)}
    if not (samples or groups or batches):
        return Selection(list(range(len(recs))), False, requested)
    chosen: set[int] = set()
    by_id = {s["sample_id"]: i for i, s in enumerate(recs)}
    for sid in samples:
        if sid not in by_id:
            raise UsageError(f"no sample {sid!r} in this bundle", where=b.path)
        chosen.add(by_id[sid])
    for mb in batches:
        rows = [i for i, s in enumerate(recs) if s["micro_batch"] == mb]
        if not rows:
            raise UsageError(f"no micro-batch {mb!r} in this bundle (ids look like mb-0000)", where=b.path)
        chosen.update(rows)
    wanted = set(groups)
    for g in groups:
        if not any(s["group"] == g for s in recs):
            raise UsageError(f"no group {g!r} in this bundle", where=b.path)
    for i in sorted(chosen):
        g = recs[i]["group"]
        if g is None:
            raise ContractError(f"missing group membership: sample {recs[i]['sample_id']!r} has no recorded "
                                "group, so its group closure cannot be formed", where=b.path,
                                hint="groups are never inferred from batch sizes; record membership at capture")
        wanted.add(g)
    rows = [i for i, s in enumerate(recs) if s["group"] in wanted]
    return Selection(rows, len(rows) < len(recs), requested)
