"""``replayjob trace-diff A B``: where two traced replays of one capture first differ, and by how much.

A and B are replay output directories (``DIR/replay_metrics.json`` pinning ``DIR/trace/index.json``)
or arm directories whose ``repeat-NNN`` children are such replays; the first repeat of each is
compared, the others are same-condition repeats for the noise envelope (:mod:`.envelope`).  Sites
are matched by module name and compared row by row over unpadded tokens, so arms with different
micro-batch sizes line up and a padding or shape difference is never a divergence.

Each site gets ``equal`` (every row's SHA-256 equal), ``noise`` (relative error within its envelope)
or ``beyond``.  The first divergent site in forward order and in backward order (output gradients,
then parameter gradients, then updates) are named, with per-layer curves of the largest relative
error.  Exit code: 0 trace-identical, 1 divergent (whatever the classification), 2 refused (traces of
different captures, tampered or incomplete).  Nothing here imports transformers or peft.

Example:
    $ replayjob trace-diff runs/replays/mb4 runs/replays/mb1 --json
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replayjob.errors import ContractError, RefusedError, UsageError
from replayjob.metrics import REPLAY_FILE, read_replay
from replayjob.trace.envelope import Bound, cosine, envelope, relative_error, rounding_bound
from replayjob.trace.store import IDENTITY_KEYS, TRACE_DIR, Site, Trace, dtype_name, read_trace

DIFF_SCHEMA = "replayjob.trace_diff/v1"
SAME_CAPTURE = ("manifest_sha256", "logical_batch_sha256", "initial_adapter_sha256")
_LAYER = re.compile(r"\.layers\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class Side:
    """One named trace: where it came from and the verified trace."""

    path: Path
    trace: Trace

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
        metrics = d / REPLAY_FILE
        if not metrics.is_file():
            raise RefusedError(f"no {REPLAY_FILE} (written last) beside the trace: the replay is "
                               "incomplete", where=d, hint="rerun the replay with --trace into a new --out")
        pin = read_replay(metrics).trace_index_sha256
        if pin is None:
            raise RefusedError(f"this replay was not traced ({REPLAY_FILE} has no trace)", where=metrics,
                               hint="replay with --trace (or optimizer_batch.trace = true)")
        out.append(Side(d, read_trace(d, expected_index_sha256=pin)))
    return out


def _same_capture(sides: list[Side]) -> None:
    first = sides[0]
    for s in sides[1:]:
        for k in SAME_CAPTURE:
            if s.trace.identity[k] != first.trace.identity[k]:
                raise ContractError(f"traces of different captures: identity.{k} is {s.trace.identity[k]} here "
                                    f"and {first.trace.identity[k]} in {first.path}", where=s.path,
                                    hint="compare replays of one capture (the same pins)")
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
    if all(same):
        return SiteError(True, 0.0, 0.0, len(same), None)
    diff = (a.values.double() - b.values.double()).abs()
    return SiteError(False, relative_error(a.values, b.values), float(diff.max()), sum(same), same.index(False))


def _errors(a: Trace, b: Trace, where: Path) -> dict[str, SiteError]:
    """Errors of every site both traces hold, keyed ``forward:NAME``, ``backward:NAME``, ``grad:``/``update:``."""
    out: dict[str, SiteError] = {}
    for prefix, xs, ys in (("forward", a.forward, b.forward), ("backward", a.backward, b.backward)):
        other = {s.name: s for s in ys}
        for s in xs:
            if s.name in other:
                out[f"{prefix}:{s.name}"] = _site_error(s, other[s.name], where)
    params = {p.name: p for p in b.params}
    for p in a.params:
        q = params.get(p.name)
        if q is None:
            continue
        if p.grad.shape != q.grad.shape:
            raise ContractError(f"parameter {p.name!r} has different shapes in the two traces", where=where)
        for kind, x, y, hx, hy in (("grad", p.grad, q.grad, p.grad_sha256, q.grad_sha256),
                                   ("update", p.update, q.update, p.update_sha256, q.update_sha256)):
            eq = hx == hy
            out[f"{kind}:{p.name}"] = SiteError(eq, 0.0 if eq else relative_error(x, y),
                                                0.0 if eq else float((x.double() - y.double()).abs().max()),
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
        return envelope(reps, ref, rounding_bound(dtype, k, position))

    def _record(self, key: str, name: str, kind: str, dtype: str, k: int, position: int) -> dict[str, Any]:
        e = self.main[key]
        bound = self._bound(key, dtype, k, position)
        return {"position": position, "name": name, "kind": kind, "status": bound.judge(e.rel, e.bitwise),
                "rel_l2": e.rel, "max_abs": e.max_abs, "equal_rows": e.equal_rows, "first_row": e.first_row,
                "envelope": bound.value, "envelope_source": bound.source}

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
                r["cosine"] = cosine(x, y)
                rec[kind] = r
            params.append(rec)
        backward_chain = bwd + [p["grad"] for p in params] + [p["update"] for p in params]
        statuses = [r["status"] for r in fwd + backward_chain]
        worst = "beyond" if "beyond" in statuses else "noise" if "noise" in statuses else "equal"
        sources = [r["envelope_source"] for r in fwd + backward_chain]
        return {
            "schema": DIFF_SCHEMA,
            "a": self._side(self.a), "b": self._side(self.b),
            "reference": None if self.reference is None else [str(s.path) for s in self.reference],
            "identical": worst == "equal", "classification": worst,
            "exit_code": 0 if worst == "equal" else 1,
            "first_divergence": {"forward": _first(fwd), "backward": _first(backward_chain)},
            "envelope": {"repeat_pairs": len(self.repeats),
                         "sources": {k: sources.count(k) for k in ("repeats", "reference", "rounding")},
                         "rounding": {"formula": "C * u(dtype) * sqrt(K) * position", "C": 4.0,
                                      "K_sites": k_sites, "K_params": k_params}},
            "layers": {"forward": _layers(fwd), "backward": _layers(bwd),
                       "gradients": _layers([p["grad"] for p in params])},
            "unmatched": self._unmatched(ta, tb),
            "forward": fwd, "backward": bwd, "params": params,
        }

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
                                                    "envelope": r["envelope"], "beyond": 0, "sites": 0})
        cur["sites"] += 1
        cur["beyond"] += r["status"] == "beyond"
        if r["rel_l2"] >= cur["max_rel_l2"]:
            cur["max_rel_l2"], cur["envelope"] = r["rel_l2"], r["envelope"]
    return list(out.values())


def _where(r: dict[str, Any] | None) -> str:
    if r is None:
        return "none (bitwise equal)"
    row = f", first differing row {r['first_row']}" if r["first_row"] is not None else ""
    return (f"{r['kind']} {r['name']} (position {r['position']}): {r['status']}, relative error "
            f"{r['rel_l2']:.3g} vs envelope {r['envelope']:.3g} ({r['envelope_source']}){row}")


def render(rep: dict[str, Any]) -> str:
    """The human-readable report."""
    lines = [f"trace-diff {rep['a']['label']} ({rep['a']['path']}) vs {rep['b']['label']} ({rep['b']['path']})",
             f"result: {'trace-identical' if rep['identical'] else 'divergent'}; classification "
             f"{rep['classification']} (equal | noise: within the envelope | beyond)",
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
            lines.append(f"  {layer['layer']:>6}  {layer['max_rel_l2']:.3g}  (envelope {layer['envelope']:.3g}, "
                         f"{layer['beyond']} of {layer['sites']} sites beyond)")
    changed = [p for p in rep["params"] if p["grad"]["status"] != "equal" or p["update"]["status"] != "equal"]
    if changed:
        lines.append(f"parameters differing: {len(changed)} of {len(rep['params'])}")
        for p in changed[:8]:
            g, u = p["grad"], p["update"]
            lines.append(f"  {p['name']}: grad {g['status']} {g['rel_l2']:.3g} (cosine {g['cosine']}), "
                         f"update {u['status']} {u['rel_l2']:.3g}")
    for side, names in rep["unmatched"].items():
        if names:
            lines.append(f"{side}: {len(names)} site(s) not in the other trace, e.g. {names[0]}")
    return "\n".join(lines)


def trace_diff(a: str | Path, b: str | Path, reference: list[str] | None = None) -> dict[str, Any]:
    """Load, verify and compare; return the report (``exit_code`` 0 or 1) or raise a refusal."""
    ref = [s for r in reference for s in load_side(r)[:1]] if reference else None
    return TraceDiff(load_side(a), load_side(b), ref).report()
