"""``replayjob trace-diff A B``: where two traced replays of one capture first differ, and by how much.

A and B are replay output directories (``DIR/replay_metrics.json`` pinning ``DIR/trace/index.json``)
or arm directories whose ``repeat-NNN`` children are such replays; the first repeat of each is
compared, the others are same-condition repeats for the noise envelope (:mod:`.envelope`).  Sites
are matched by module name and compared row by row over unpadded tokens, so arms with different
micro-batch sizes line up and a padding or shape difference is never a divergence.

Both traces must hold the same sites (forward, backward, parameters), each name once; a site in one
trace only is refused (exit 2), except output gradients that only one side of a pair differing in
gradient checkpointing records (listed as ``unmatched``), and so is a pair with no site in common.
The report says how many sites it compared (``compared``).

Each site gets ``equal`` (every row's SHA-256 equal), ``noise`` (relative error within its envelope)
or ``beyond``; a site holding a NaN or an infinity in either trace is ``beyond`` (its error is the
non-finite marker, written ``null`` with ``non_finite: true``; the JSON never holds NaN).
The first divergent site in forward order and in backward order (output gradients,
then parameter gradients, then updates) are named, with per-layer curves of the largest relative
error.  Exit code: 0 trace-identical, 1 divergent (whatever the classification), 2 refused (traces of
different captures, tampered or incomplete).  Nothing here imports transformers or peft.

Example:
    $ replayjob trace-diff runs/replays/mb4 runs/replays/mb1 --json
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replayjob.artifacts.metrics import REPLAY_FILE, ROUTING, Replay, read_replay
from replayjob.artifacts.trace_store import (
    IDENTITY_KEYS,
    INDEX_FILE,
    PAYLOAD_FILE,
    TRACE_DIR,
    Site,
    Trace,
    dtype_name,
    read_trace,
)
from replayjob.errors import ContractError, IntegrityError, RefusedError, UsageError
from replayjob.fsio import check_no_symlinks
from replayjob.model import moe
from replayjob.model.moe import RoutingTable
from replayjob.runtime import knobs
from replayjob.trace.envelope import (
    UNIT_ROUNDOFF,
    Bound,
    all_finite,
    cosine,
    envelope,
    finite_or_none,
    relative_error,
    rounding_bound,
)

DIFF_SCHEMA = "replayjob.trace_diff/v1"
# How two MoE replays' difference relates to their routing (``routing.attribution``), in human terms.
ATTRIBUTIONS = {
    "identical": "identical routing and identical traces",
    "identical-routing": "differs with identical routing: every token went to the same experts, so the "
                         "difference is numerical (a kernel, a dtype, a summation order), not a routing flip",
    "downstream-of-flips": "differs only downstream of routing flips: every traced output before the MoE block "
                           "of the first flip is bitwise equal",
    "upstream-of-flips": "differs upstream of the first routing flip: a numerical difference reached the "
                         "router first, and the flips follow from it",
    "flips-only": "routing flips with bitwise equal traced outputs",
}
# replay_metrics.json's provenance.compute_dtype (replayjob.producers.api.precision) as a traced dtype's name
COMPUTE_DTYPES = {"float64": "F64", "float32": "F32", "tf32": "F16", "float16": "F16", "bfloat16": "BF16"}
SAME_CAPTURE = ("manifest_sha256", "logical_batch_sha256", "initial_adapter_sha256")
_LAYER = re.compile(r"\.layers\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class Side:
    """One named trace: where it came from and the verified trace."""

    path: Path
    trace: Trace
    routing: RoutingTable | None = None  # an MoE model's routing evidence, as replay_metrics.json pins it
    compute_dtype: str | None = None  # the traced tensors' dtype name of the precision the matmuls ran in (BF16 under
    #                                   bf16 autocast), as replay_metrics.json's provenance records it
    knobs: dict[str, Any] | None = None  # the knob values the replay observed (replay_metrics.json), its condition

    @property
    def label(self) -> str:
        i = self.trace.identity
        return f"{i['arm']}#{i['repeat_index']}"


def _replay_dirs(path: Path) -> list[Path]:
    if (path / REPLAY_FILE).is_file() or (path / TRACE_DIR).is_dir():
        return [path]
    reps = sorted(p for p in path.glob("repeat-*") if p.is_dir())
    if not path.is_dir() or not reps:
        raise RefusedError("neither a replay directory nor an arm directory of repeat-NNN replays", where=path,
                           hint="pass the --out directory of `replayjob replay --trace`")
    return reps


def load_side(path: str | Path) -> list[Side]:
    """The traces of a replay directory (one) or of an arm directory (its repeats, in order), verified
    against the index SHA-256 their replay_metrics.json pins."""
    out = []
    for d in _replay_dirs(Path(path)):
        metrics = check_no_symlinks(path, d / REPLAY_FILE, what="replay")  # e.g. a linked repeat-NNN/
        if not metrics.is_file():
            raise RefusedError(f"no {REPLAY_FILE} (written last) beside the trace: the replay is "
                               "incomplete", where=d, hint="rerun the replay with --trace into a new --out")
        rep = read_replay(metrics)
        pin = rep.trace_index_sha256
        if pin is None:
            raise RefusedError(f"this replay was not traced ({REPLAY_FILE} has no trace)", where=metrics,
                               hint="replay with --trace (or optimizer_batch.trace = true)")
        entry = moe.evidence_entry(rep.doc.get(ROUTING), metrics)
        if entry is not None:
            check_no_symlinks(path, entry[0], what="routing")
        routing = None if entry is None else replay_routing(rep, entry)
        compute = COMPUTE_DTYPES.get(str((rep.doc.get("provenance") or {}).get("compute_dtype")))
        trace = replay_trace(rep, d)
        if routing is not None and not routing.row_tokens.equal(trace.row_tokens):
            raise IntegrityError(f"the routing file and the trace of one replay count different tokens per row "
                                 f"({routing.tokens} and {int(trace.row_tokens.sum())} tokens over "
                                 f"{routing.row_tokens.numel()} and {trace.rows} rows): both were recorded on the "
                                 "update's real tokens, so one is not this replay's",
                                 where=entry[0] if entry is not None else metrics,
                                 hint="a replay's trace and routing file are written by that replay; rerun the replay")
        out.append(Side(d, trace, routing, compute, rep.knobs))
    _one_condition(out)
    return out


CONDITION = ("arm", "micro_batch_size", "gradient_checkpointing", "device", "torch_version", "fault")


def _one_condition(sides: list[Side]) -> None:
    """An arm directory's repeats are replays of one condition (arm, knobs, micro-batching, checkpointing,
    device, build, planted fault): their differences are the noise envelope, so a "repeat" of another condition
    would widen it until a divergence read as noise."""
    first = sides[0]
    for side in sides[1:]:
        said = _first_difference(CONDITION, first.trace.identity, side.trace.identity)
        if said is None and side.knobs != first.knobs:
            said = ("knobs", first.knobs, side.knobs)
        if said is not None:
            what, mine, theirs = said
            raise ContractError(f"the repeats of one arm directory are replays of another condition: {what} is "
                                f"{theirs!r} in {side.path.name}, {mine!r} in {first.path.name}",
                                where=side.path.parent,
                                hint="an arm directory holds repeats of one arm only; compare other conditions as "
                                     "the two sides of trace-diff")


def _reference_pair(a: Side, b: Side, ref: list[Side]) -> None:
    """The ``--reference`` pair is two other replays that differ only by noise: not one replay twice, not a compared
    replay (a pair holding A or B measures the very difference it is asked to judge, so every divergence reads as
    noise), and not a pair whose planted faults differ (a planted fault is a real change, never noise)."""
    _distinct(ref[:1], ref[1:], "a reference pair of one replay is equal")
    _distinct([a, b], ref, "a reference pair holding a compared replay judges its difference by itself")
    mine, theirs = ref[0].trace.identity["fault"], ref[1].trace.identity["fault"]
    if mine != theirs:
        raise ContractError(f"the reference pair differs in its planted fault: identity.fault is {theirs!r} in "
                            f"{ref[1].path}, {mine!r} in {ref[0].path}; a planted fault is a real change, not noise",
                            where=ref[1].path, hint="pass two replays that differ only by noise as --reference")


def replay_routing(rep: Replay, entry: tuple[Path, str]) -> RoutingTable:
    """The routing file ``entry`` (path, pin: :func:`replayjob.model.moe.evidence_entry`) of the replay ``rep``: read
    through its pin, and that replay's own (its logical batch, manifest and routing mode), whoever reads it
    (trace-diff, reduce)."""
    return moe.check_replay_table(moe.read_table(*entry), rep.path, logical=rep.logical, manifest=rep.manifest,
                                  mode=rep.runtime.get("model.routing"))


def replay_trace(rep: Replay, d: Path) -> Trace:
    """The trace of the replay ``rep`` (its directory ``d``): read through the index SHA-256 its replay_metrics.json
    pins, and that replay's own (:func:`_same_replay`), whoever reads it (trace-diff, reduce)."""
    trace = read_trace(d, expected_index_sha256=rep.trace_index_sha256)
    _same_replay(trace, rep, d)
    return trace


def _same_replay(trace: Trace, rep: Replay, where: Path) -> None:
    """The trace's identity is the replay's record of itself (the recorder copies it from the replay's metrics): a
    trace that names another capture, start state, arm, repeat, device or torch build than the replay_metrics.json
    pinning it is not that replay's trace, nor one whose checkpointing or micro-batch size is not what that replay's
    observed knobs say (where its producer declares them: :func:`replayjob.runtime.knobs.trace_condition`)."""
    recorded = {"manifest_sha256": rep.manifest, "logical_batch_sha256": rep.logical,
                "initial_adapter_sha256": rep.initial_adapter, "arm": rep.arm, "repeat_index": rep.repeat_index,
                "device": rep.device, "torch_version": rep.doc.get("torch_version"),
                **knobs.trace_condition(rep.framework, rep.runtime)}  # the condition its producer declares
    said = _first_difference(tuple(recorded), recorded, trace.identity)
    if said is not None:
        what, value, mine = said
        raise IntegrityError(f"the trace is not this replay's: its {what} is {mine!r}, {REPLAY_FILE} records "
                             f"{value!r}", where=where / TRACE_DIR / "index.json",
                             hint="a replay's trace is written by that replay; rerun the replay with --trace into a "
                                  "new --out")


def _first_difference(keys: tuple[str, ...], a: dict[str, Any], b: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """The first of ``keys`` whose values in the identities ``a`` and ``b`` differ (``identity.KEY``, a's, b's), or
    None: equal, and a flag only to a flag (``true`` is not the count 1)."""
    for k in keys:
        x, y = a[k], b[k]
        if not (bool(x == y) and (type(x) is bool) == (type(y) is bool)):
            return f"identity.{k}", x, y
    return None


def _same_capture(sides: list[Side]) -> None:
    first = sides[0]
    for s in sides[1:]:
        said = _first_difference(SAME_CAPTURE, first.trace.identity, s.trace.identity)
        if said is not None:
            what, mine, theirs = said
            raise ContractError(f"traces of different captures: {what} is {theirs} here and {mine} in {first.path}",
                                where=s.path, hint="compare replays of one capture (the same pins)")
        if not s.trace.row_tokens.equal(first.trace.row_tokens):
            raise ContractError("the traces' rows differ in length", where=s.path,
                                hint="compare replays of one capture (the same pins)")


@dataclass(frozen=True)
class SiteError:
    bitwise: bool
    rel: float
    max_abs: float
    equal_rows: int
    first_row: int | None


def _site_error(a: Site, b: Site, where: Path) -> SiteError:
    if a.width != b.width or a.dtype != b.dtype:
        raise ContractError(f"site {a.name!r} is {a.dtype} x {a.width} in one trace and {b.dtype} x {b.width} "
                            "in the other: not the same model", where=where)
    same = [x == y for x, y in zip(a.sha256, b.sha256, strict=True)]
    if all(same):  # bitwise equal, but a NaN or an infinity is never evidence of agreement
        zero = 0.0 if all_finite(a.values) else math.nan
        return SiteError(True, zero, zero, len(same), None)
    diff = (a.values.double() - b.values.double()).abs()
    return SiteError(False, relative_error(a.values, b.values), float(diff.max()), sum(same), same.index(False))


def _site_names(t: Trace) -> dict[str, list[str]]:
    return {"forward": [s.name for s in t.forward], "backward": [s.name for s in t.backward],
            "param": [p.name for p in t.params]}


def _check_sites(a: Trace, b: Trace, where: Path) -> None:
    """Refuse duplicate site names, sites in one trace only and a pair with nothing in common.

    Output gradients one trace only records are admitted when the two differ in gradient
    checkpointing (checkpointed segments make more outputs require grad); they stay ``unmatched``."""
    hint = "compare traces of one model and capture, each written by `replayjob replay --trace`"
    na, nb = _site_names(a), _site_names(b)
    for t, names in ((a, na), (b, nb)):
        dups = sorted({f"{k}:{n}" for k, ns in names.items() for n in ns if ns.count(n) > 1})
        if dups:
            raise IntegrityError(f"the trace names {len(dups)} site(s) more than once: {', '.join(dups[:5])}",
                                 where=t.path or where, hint=hint)
    gc_differs = a.identity.get("gradient_checkpointing") != b.identity.get("gradient_checkpointing")
    odd: list[str] = []
    for kind in ("forward", "backward", "param"):
        if kind == "backward" and gc_differs:
            continue
        only_a, only_b = sorted(set(na[kind]) - set(nb[kind])), sorted(set(nb[kind]) - set(na[kind]))
        odd += [f"{kind}:{n} (only in {a.path or 'A'})" for n in only_a]
        odd += [f"{kind}:{n} (only in {b.path or 'B'})" for n in only_b]
    if odd:
        raise ContractError(f"the traces do not hold the same sites ({len(odd)} unmatched): {'; '.join(odd[:5])}",
                            where=where, hint=hint)
    if not any(set(na[k]) & set(nb[k]) for k in na):
        raise ContractError("the traces have no site in common: nothing to compare", where=where, hint=hint)


def _errors(a: Trace, b: Trace, where: Path) -> dict[str, SiteError]:
    """Errors of every site both traces hold, keyed ``forward:NAME``, ``backward:NAME``, ``grad:``/``update:``.

    Refused (:func:`_check_sites`) unless both hold the same sites, each once."""
    _check_sites(a, b, where)
    out: dict[str, SiteError] = {}
    for prefix, xs, ys in (("forward", a.forward, b.forward), ("backward", a.backward, b.backward)):
        other = {s.name: s for s in ys}
        for s in xs:
            if s.name in other:
                out[f"{prefix}:{s.name}"] = _site_error(s, other[s.name], where)
    params = {p.name: p for p in b.params}
    for p in a.params:
        q = params[p.name]
        if p.grad.shape != q.grad.shape:
            raise ContractError(f"parameter {p.name!r} has different shapes in the two traces", where=where)
        for kind, x, y, hx, hy in (("grad", p.grad, q.grad, p.grad_sha256, q.grad_sha256),
                                   ("update", p.update, q.update, p.update_sha256, q.update_sha256)):
            eq = hx == hy
            zero = 0.0 if all_finite(x) else math.nan  # bitwise equal NaNs are no agreement either
            out[f"{kind}:{p.name}"] = SiteError(eq, zero if eq else relative_error(x, y),
                                                zero if eq else float((x.double() - y.double()).abs().max()),
                                                1 if eq else 0, None)
    return out


def rounding_scale(t: Trace) -> tuple[int, int, int]:
    """The rounding bound's reduction lengths for sites and for parameters, and the parameters' position.

    ``K`` for sites is the widest traced output or the longest row (attention reduces over it); for
    parameter gradients and updates also the total tokens they are summed over.  Parameters come
    after every forward and backward site.
    """
    k_sites = max([s.width for s in t.forward] + [int(t.row_tokens.max()) if t.rows else 1])
    return k_sites, max(k_sites, int(t.row_tokens.sum())), len(t.forward) + len(t.backward) + 1


def layer_of(name: str) -> str:
    """``layers.N`` -> ``N``; before the first layer ``embed``, after the last ``head``-side names as given."""
    m = _LAYER.search(name)
    return m.group(1) if m else ("embed" if "embed" in name or "rotary" in name else "head")


class TraceDiff:
    """Compare the first trace of ``a`` with the first of ``b``; judge against the envelope."""

    def __init__(self, a: list[Side], b: list[Side], reference: list[Side] | None = None):
        if reference is not None and len(reference) != 2:
            raise UsageError(f"--reference takes exactly two replays, got {len(reference)}")
        self.a, self.b, self.reference = a, b, reference
        _same_capture([*a, *b, *(reference or [])])
        self.main = _errors(a[0].trace, b[0].trace, b[0].path)
        self.repeats = [_errors(side[0].trace, r.trace, r.path) for side in (a, b) for r in side[1:]]
        self.ref = _errors(reference[0].trace, reference[1].trace, reference[1].path) if reference else None

    def _bound(self, key: str, dtype: str, k: int, position: int) -> Bound:
        reps = [e[key].rel for e in self.repeats if key in e]
        ref = self.ref[key].rel if self.ref is not None and key in self.ref else None
        # a tensor held in float32 that bf16 autocast computed rounds as bf16: the coarser of the two bounds it
        computed = [s.compute_dtype for s in (self.a[0], self.b[0]) if s.compute_dtype]
        dtype = max([dtype, *computed], key=lambda d: UNIT_ROUNDOFF[d])
        return envelope(reps, ref, rounding_bound(dtype, k, position))

    def _record(self, key: str, name: str, kind: str, dtype: str, k: int, position: int) -> dict[str, Any]:
        e = self.main[key]
        bound = self._bound(key, dtype, k, position)
        return {"position": position, "name": name, "kind": kind, "status": bound.judge(e.rel, e.bitwise),
                "rel_l2": finite_or_none(e.rel), "max_abs": finite_or_none(e.max_abs), "equal_rows": e.equal_rows,
                "first_row": e.first_row, "envelope": finite_or_none(bound.value), "envelope_source": bound.source,
                "non_finite": not all(math.isfinite(x) for x in (e.rel, e.max_abs, bound.value))}

    def report(self) -> dict[str, Any]:
        ta, tb = self.a[0].trace, self.b[0].trace
        k_sites, k_params, _ = rounding_scale(ta)
        fwd: list[dict[str, Any]] = []
        bwd: list[dict[str, Any]] = []
        params: list[dict[str, Any]] = []
        pos = 0
        for s in ta.forward:
            pos += 1
            if f"forward:{s.name}" in self.main:
                fwd.append(self._record(f"forward:{s.name}", s.name, s.kind, s.dtype, k_sites, pos))
        for s in ta.backward:
            pos += 1
            if f"backward:{s.name}" in self.main:
                bwd.append(self._record(f"backward:{s.name}", s.name, s.kind, s.dtype, k_sites, pos))
        pos += 1
        for p in ta.params:
            if f"grad:{p.name}" not in self.main:
                continue
            q = next(x for x in tb.params if x.name == p.name)
            rec: dict[str, Any] = {"name": p.name}
            for kind, x, y in (("grad", p.grad, q.grad), ("update", p.update, q.update)):
                r = self._record(f"{kind}:{p.name}", p.name, kind, dtype_name(x.dtype), k_params, pos)
                c = cosine(x, y)
                r["cosine"] = finite_or_none(c)
                r["non_finite"] = r["non_finite"] or (c is not None and not math.isfinite(c))
                rec[kind] = r
            params.append(rec)
        backward_chain = bwd + [p["grad"] for p in params] + [p["update"] for p in params]
        statuses = [r["status"] for r in fwd + backward_chain]
        worst = "beyond" if "beyond" in statuses else "noise" if "noise" in statuses else "equal"
        sources = [r["envelope_source"] for r in fwd + backward_chain]
        compared = {"forward": len(fwd), "backward": len(bwd), "params": len(params)}
        compared["sites"] = len(fwd) + len(bwd) + 2 * len(params)  # a parameter is two sites: grad, update
        if compared["sites"] == 0:  # _check_sites refuses this first; never report "identical" over nothing
            raise ContractError("no site compared", where=self.b[0].path)
        return {
            "schema": DIFF_SCHEMA,
            "a": self._side(self.a), "b": self._side(self.b),
            "reference": None if self.reference is None else [str(s.path) for s in self.reference],
            "identical": worst == "equal", "classification": worst,
            "exit_code": 0 if worst == "equal" else 1, "compared": compared,
            "non_finite_sites": sum(bool(r["non_finite"]) for r in fwd + backward_chain),
            "first_divergence": {"forward": _first(fwd), "backward": _first(backward_chain)},
            "envelope": {"repeat_pairs": len(self.repeats),
                         "sources": {k: sources.count(k) for k in ("repeats", "reference", "rounding")},
                         "rounding": {"formula": "C * u(dtype) * sqrt(K) * position", "C": 4.0,
                                      "K_sites": k_sites, "K_params": k_params}},
            "layers": {"forward": _layers(fwd), "backward": _layers(bwd),
                       "gradients": _layers([p["grad"] for p in params])},
            "unmatched": self._unmatched(ta, tb),
            "routing": self._routing(fwd),
            "forward": fwd, "backward": bwd, "params": params,
        }

    def _routing(self, fwd: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Routing agreement of an MoE model's two replays (:func:`replayjob.model.moe.compare`) and where the
        traces' first forward divergence lies against the first routing flip (:data:`ATTRIBUTIONS`); ``None``
        for a model without routers."""
        ra, rb = self.a[0].routing, self.b[0].routing
        if ra is None and rb is None:
            return None
        if ra is None or rb is None:
            raise ContractError("only one of the replays recorded its routing: not the same model",
                                where=self.b[0].path, hint="compare replays of one MoE capture")
        rep = moe.compare(ra, rb)
        # same-condition repeats (repeat-NNN of one arm) are the routing's own noise: flips between them
        pairs = [(side[0].routing, r.routing) for side in (self.a, self.b) for r in side[1:]]
        if any(x is None or y is None for x, y in pairs):
            raise ContractError("a repeat recorded no routing while the first replay of its arm did",
                                where=self.b[0].path, hint="compare repeats of one MoE capture")
        rep["repeat_pairs"] = len(pairs)
        rep["repeat_flipped"] = max((moe.compare(x, y)["flipped"] for x, y in pairs if x is not None and y is not None),
                                    default=None)
        first = _first(fwd)
        flip = rep["first_flip"]
        if flip is None:
            rep["attribution"], rep["flip_block"] = ("identical" if first is None else "identical-routing"), None
            return rep
        block = moe.block_of(flip["layer"])
        at = next((r["position"] for r in fwd if r["name"] == block), None)
        rep["flip_block"] = block
        if first is None:
            rep["attribution"] = "flips-only"
        elif at is not None and first["position"] >= at:
            rep["attribution"] = "downstream-of-flips"
        else:
            rep["attribution"] = "upstream-of-flips"
        return rep

    @staticmethod
    def _side(sides: list[Side]) -> dict[str, Any]:
        t = sides[0].trace
        return {"path": str(sides[0].path), "label": sides[0].label, "repeats": len(sides),
                **{k: t.identity[k] for k in IDENTITY_KEYS if k not in SAME_CAPTURE}}

    @staticmethod
    def _unmatched(a: Trace, b: Trace) -> dict[str, list[str]]:
        def names(t: Trace) -> set[str]:
            return {f"forward:{s.name}" for s in t.forward} | {f"backward:{s.name}" for s in t.backward} \
                | {f"param:{p.name}" for p in t.params}
        na, nb = names(a), names(b)
        return {"only_a": sorted(na - nb), "only_b": sorted(nb - na)}


def _first(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((r for r in records if r["status"] != "equal"), None)


def _layers(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Largest relative error and envelope per layer, in the order the layers appear."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        cur = out.setdefault(layer_of(r["name"]), {"layer": layer_of(r["name"]), "max_rel_l2": 0.0,
                                                    "envelope": r["envelope"], "beyond": 0, "sites": 0,
                                                    "non_finite": 0})
        cur["sites"] += 1
        cur["beyond"] += r["status"] == "beyond"
        cur["non_finite"] += bool(r["non_finite"])
        if cur["non_finite"] and cur["max_rel_l2"] is not None and r["rel_l2"] is None:
            cur["max_rel_l2"], cur["envelope"] = None, r["envelope"]  # a non-finite error is the largest
        elif cur["max_rel_l2"] is not None and r["rel_l2"] is not None and r["rel_l2"] >= cur["max_rel_l2"]:
            cur["max_rel_l2"], cur["envelope"] = r["rel_l2"], r["envelope"]
    return list(out.values())


def _g(x: float | None) -> str:
    return "non-finite" if x is None else f"{x:.3g}"


def _where(r: dict[str, Any] | None) -> str:
    if r is None:
        return "none (bitwise equal)"
    row = f", first differing row {r['first_row']}" if r["first_row"] is not None else ""
    return (f"{r['kind']} {r['name']} (position {r['position']}): {r['status']}, relative error "
            f"{_g(r['rel_l2'])} vs envelope {_g(r['envelope'])} ({r['envelope_source']}){row}")


def render(rep: dict[str, Any]) -> str:
    """The human-readable report."""
    lines = [f"trace-diff {rep['a']['label']} ({rep['a']['path']}) vs {rep['b']['label']} ({rep['b']['path']})",
             f"result: {'trace-identical' if rep['identical'] else 'divergent'}; classification "
             f"{rep['classification']} (equal | noise: within the envelope | beyond)",
             f"compared {rep['compared']['sites']} sites: {rep['compared']['forward']} forward, "
             f"{rep['compared']['backward']} backward, {rep['compared']['params']} parameters (gradient and "
             f"update); {rep['non_finite_sites']} hold a non-finite value",
             f"first divergence, forward:  {_where(rep['first_divergence']['forward'])}",
             f"first divergence, backward: {_where(rep['first_divergence']['backward'])}"]
    env = rep["envelope"]
    lines.append(f"envelope: {env['repeat_pairs']} same-condition repeat pair(s); sites judged by "
                 + ", ".join(f"{k} {v}" for k, v in env["sources"].items())
                 + f"; rounding bound {env['rounding']['formula']} with C={env['rounding']['C']}, "
                 f"K={env['rounding']['K_sites']} (parameters {env['rounding']['K_params']})")
    for direction in ("forward", "backward", "gradients"):
        lines.append(f"per-layer largest relative error ({direction}):")
        for layer in rep["layers"][direction]:
            lines.append(f"  {layer['layer']:>6}  {_g(layer['max_rel_l2'])}  (envelope {_g(layer['envelope'])}, "
                         f"{layer['beyond']} of {layer['sites']} sites beyond)")
    changed = [p for p in rep["params"] if p["grad"]["status"] != "equal" or p["update"]["status"] != "equal"]
    if changed:
        lines.append(f"parameters differing: {len(changed)} of {len(rep['params'])}")
        for p in changed[:8]:
            g, u = p["grad"], p["update"]
            lines.append(f"  {p['name']}: grad {g['status']} {_g(g['rel_l2'])} (cosine {g['cosine']}), "
                         f"update {u['status']} {_g(u['rel_l2'])}")
    for side, names in rep["unmatched"].items():
        if names:
            lines.append(f"{side}: {len(names)} site(s) not in the other trace, e.g. {names[0]}")
    lines += _render_routing(rep["routing"])
    return "\n".join(lines)


def _render_routing(rt: dict[str, Any] | None) -> list[str]:
    if rt is None:
        return []
    lines = [f"routing: {rt['flipped']} token-layer routing flip(s) (expert set changed); "
             f"{ATTRIBUTIONS[rt['attribution']]}"]
    if rt["repeat_pairs"]:
        lines.append(f"  same-condition repeats: at most {rt['repeat_flipped']} flip(s) over {rt['repeat_pairs']} "
                     "repeat pair(s)")
    for lay in rt["layers"]:
        lines.append(f"  {layer_of(lay['layer']):>6}  {lay['flipped']} of {lay['tokens']} tokens flipped "
                     f"({100 * lay['share']:.2f}%); largest weight difference elsewhere "
                     f"{lay['weights_max_abs_unflipped']:.3g}")
    f = rt["first_flip"]
    if f is not None:
        lines.append(f"first flip: layer {layer_of(f['layer'])} ({f['layer']}), row {f['row']}, token {f['token']}: "
                     f"experts {f['experts_a']} -> {f['experts_b']}, router-logit margin {f['margin_a']:.3g} "
                     f"(a) / {f['margin_b']:.3g} (b)")
    return lines


def _distinct(a: list[Side], b: list[Side], what: str = "a trace compared with itself is equal") -> None:
    """No trace file of one side is a trace file of the other (the same directory named twice, a hard link, a
    directory linked to it): a trace compared with itself is equal and says nothing about two replays."""
    seen: dict[tuple[int, int], Path] = {}
    for side, other in ((a, False), (b, True)):
        for s in side:
            for name in (INDEX_FILE, PAYLOAD_FILE):
                f = s.path / TRACE_DIR / name
                st = os.stat(f)  # both were just read through the validated reader
                hit = seen.get((st.st_dev, st.st_ino))
                if other and hit is not None:
                    raise RefusedError(f"{hit} and {f} are one file (the same replay named twice, a hard link or a "
                                       f"link to its directory): {what} and proves nothing", where=f"{hit} vs {f}",
                                       hint="compare the traces of two replays (another repeat, or another arm)")
                if not other:
                    seen[(st.st_dev, st.st_ino)] = f


def trace_diff(a: str | Path, b: str | Path, reference: list[str] | None = None) -> dict[str, Any]:
    """Load, verify and compare; return the report (``exit_code`` 0 or 1) or raise a refusal."""
    ref = [s for r in reference for s in load_side(r)[:1]] if reference else None
    side_a, side_b = load_side(a), load_side(b)
    _distinct(side_a, side_b)
    if ref is not None and len(ref) == 2:
        _reference_pair(side_a[0], side_b[0], ref)
    return TraceDiff(side_a, side_b, ref).report()
