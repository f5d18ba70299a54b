"""The mismatch report (schema ``replayjob.mismatch/v3``), its decision and its text form.

The decision, in order: no recorded source refuses (2: nothing to compare); no bound refuses for a
decision (2, ``no bound declared``), after the report; a source whose weights predate step K refuses
(2) unless the lag is allowed; then every source within the bound passes (0), any beyond it is a
negative verdict (1) naming the source, the figure and the attribution.  A token whose recorded or
recomputed logprob is NaN or infinite is never within a bound: such tokens are set apart from the
figures, counted and listed by row and position, and any one of them puts its source beyond the bound
(the check ``nonfinite_tokens``, limit 0).

On a mixture-of-experts model the report holds ``routing`` (each pass's routing against the trainer pass's)
and, per source, where the sampler-side pass's routing flips reach its tokens and the share of its
log-ratio mass they carry (:mod:`~replayjob.mismatch.routing`); both are ``null`` otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from replayjob.artifacts.mismatch_bound import Bound
from replayjob.errors import EXIT_NEGATIVE, EXIT_OK, EXIT_REFUSED, NegativeVerdict, RefusedError
from replayjob.jsonio import non_finite_as_strings
from replayjob.mismatch import routing, stats
from replayjob.mismatch.attribution import Attribution, attribute
from replayjob.mismatch.views import Source, Views

SCHEMA = "replayjob.mismatch/v3"
NO_BOUND = "no bound declared"
NONFINITE_SHOWN = 10  # non-finite tokens listed by position (all are counted)


def _number_text(x: float) -> float | str:
    """A logprob as strict JSON holds it: the number, or "NaN" / "Infinity" / "-Infinity"."""
    return x if math.isfinite(x) else ("NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity"))


@dataclass
class SourceReport:
    source: Source
    summary: dict[str, Any]
    worst_sequences: list[dict[str, Any]]
    worst_tokens: list[dict[str, Any]]
    profile: list[dict[str, Any]]
    by_pad_offset: dict[str, Any]
    attribution: Attribution
    nonfinite_tokens: int  # tokens whose recorded or recomputed logprob is NaN or infinite: never within a bound
    nonfinite_at: list[dict[str, Any]] = field(default_factory=list)  # the first few, by row and position
    bound: dict[str, Any] | None = None
    routing: dict[str, Any] | None = None  # an MoE model: where the sampler-side routing flips reach (routing.reach)

    @property
    def within(self) -> bool | None:
        return None if self.bound is None else bool(self.bound["within"])

    def to_json(self) -> dict[str, Any]:
        """This source's part of :meth:`Report.to_json` (which writes its non-finite figures as strings)."""
        s = self.source
        return {"name": s.name, "field": s.field, "description": s.description, "settings": s.side.to_json(),
                "policy_lag": {"steps": s.lag, "reason": s.lag_reason},
                "nonfinite": {"tokens": self.nonfinite_tokens, "first": self.nonfinite_at},
                "log_ratio": self.summary, "worst_sequences": self.worst_sequences,
                "worst_tokens": self.worst_tokens, "profile": self.profile, "by_pad_offset": self.by_pad_offset,
                "routing": self.routing, **self.attribution.to_json(), "bound": self.bound}


@dataclass
class Report:
    capture: dict[str, Any]
    views: Views
    sources: list[SourceReport]
    bound: Bound | None
    allow_lag: bool
    recompute_wall_s: float
    decision: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return int(self.decision["exit_code"])

    def to_json(self) -> dict[str, Any]:
        import torch
        v = self.views
        # A figure beyond a float (a ratio exp(log-ratio) past ~1.8e308 makes k3 infinite; sums of log-ratios near
        # the float limit overflow) is written as the strict JSON string "Infinity" (or "NaN"), never a bare value.
        return non_finite_as_strings({
            "schema": SCHEMA, "capture": self.capture,
            "trainer": v.trainer_side.to_json(), "sampler": v.sampler_side.to_json(),
            "rows": int(torch.unique(v.row).numel()), "tokens": v.tokens,
            "recompute": {"passes": list(v.passes), "wall_s": self.recompute_wall_s, "notes": list(v.notes)},
            "routing": routing.agreement(v),
            "sources": [s.to_json() for s in self.sources],
            "bound": self.bound.to_json() if self.bound else None,
            "allow_lag": self.allow_lag, "decision": self.decision})

    def raise_for_decision(self) -> None:
        """Return on a pass; raise the decision's refusal (2) or negative verdict (1) otherwise."""
        d = self.decision
        if d["exit_code"] == EXIT_NEGATIVE:
            raise NegativeVerdict(d["reason"], where=self.capture.get("manifest"))
        if d["exit_code"] == EXIT_REFUSED:
            raise RefusedError(d["reason"], where=self.capture.get("manifest"), hint=d.get("hint"))

    def render(self) -> str:
        import torch
        v = self.views
        c = self.capture
        lines = [f"mismatch: {c['framework']} capture of step {c['step']} ({c['manifest']}): {v.tokens} response "
                 f"tokens in {int(torch.unique(v.row).numel())} rows",
                 f"  trainer: {_side(v.trainer_side)}",
                 f"  sampler: {_side(v.sampler_side)}",
                 f"  recompute: {', '.join(v.passes)}; {self.recompute_wall_s:.2f} s"]
        lines.extend(f"  note: {n}" for n in v.notes)
        lines.extend(_render_routing(routing.agreement(v)))
        for s in self.sources:
            lines.extend(_render_source(s))
        d = self.decision
        lines.append(f"decision: {d['status']} (exit {d['exit_code']}): {d['reason']}")
        return "\n".join(lines)


def _side(s: Any) -> str:
    return (f"temperature {s.temperature:g}, top_k {s.top_k}, top_p {s.top_p:g}, dtype {s.dtype}"
            f"{'' if s.recorded else ' (not recorded: assumed)'}; {s.layout}")


def _render_routing(doc: dict[str, Any] | None) -> list[str]:
    if doc is None:
        return []
    out = [f"  routing: {len(doc['layers'])} router(s), top-{doc['top_k']} of {doc['num_experts']} experts, "
           f"{doc['tokens']} tokens" + (f" (test-only router fault {doc['fault']} on the trainer side)"
                                        if doc["fault"] else "")]
    for name, p in doc["passes"].items():
        per_layer = ", ".join(f"{lay['layer']}: {lay['flipped']}" for lay in p["layers"])
        out.append(f"    {name} pass ({p['mode']}): {p['flipped']} token(s) routed to another expert set than in the "
                   f"trainer pass ({per_layer})")
    return out


def _render_source(s: SourceReport) -> list[str]:
    src, m = s.source, s.summary
    lag = "unknown" if src.lag is None else f"{src.lag} step(s)"
    out = [f"source {src.name} ({src.field}): {src.description}",
           f"  policy lag: {lag} ({src.lag_reason})",
           f"  log-ratio (log pi_trainer - log pi_source) over {m['tokens']} tokens"
           + (f" ({s.nonfinite_tokens} non-finite token(s) set apart)" if s.nonfinite_tokens else "")
           + f": mean {m['mean']:.3g}, std {m['std']:.3g}; |.| p50 {m['abs_p50']:.3g}, p90 {m['abs_p90']:.3g}, "
             f"p99 {m['abs_p99']:.3g}, max {m['abs_max']:.3g}; bitwise equal {100 * m['bitwise_equal_share']:.1f}%",
           f"  KL estimates: k1 {m['k1']:.3g}, k3 {m['k3']:.3g}; ratio outside [1-d, 1+d]: "
           + ", ".join(f"d={d} {100 * share:.1f}%" for d, share in m["outside"].items())]
    if m["abs_max"] > 0:
        out.append("  worst sequences: " + "; ".join(
            f"row {w['row']} max {w['abs_max']:.3g} at position {w['at_position']} (sequence log-ratio "
            f"{w['sequence_log_ratio']:.3g})" for w in s.worst_sequences))
        out.append("  worst tokens: " + "; ".join(
            f"row {w['row']} pos {w['position']} token {w['token']}: {w['log_ratio']:.3g}" for w in s.worst_tokens[:5]))
        out.append("  by position: " + " | ".join(
            f"{p['positions'][0]}{'' if p['positions'][0] == p['positions'][1] else '-' + str(p['positions'][1])}: "
            f"{p['abs_mean']:.3g}" for p in s.profile))
    if s.nonfinite_tokens:
        out.append(f"  non-finite: {s.nonfinite_tokens} token(s), never within a bound; first: " + "; ".join(
            f"row {w['row']} pos {w['position']} (source {w['source']}, trainer {w['trainer']})"
            for w in s.nonfinite_at))
    for t in s.attribution.tests:
        if not t.applicable:
            out.append(f"  test {t.name}: not applicable ({t.reason})")
            continue
        share = "n/a" if t.explained is None else f"{100 * max(t.explained, 0.0):.1f}%"
        out.append(f"  test {t.name}: {'CLOSES the gap' if t.closes else 'does not close the gap'} ({share})")
        out.extend(f"    {e}" for e in t.evidence)
    if s.routing is not None and s.routing["flipped"]:
        r = s.routing
        out.append(f"  routing flips (sampler-side pass against the trainer's): {r['flipped']} token(s); the response "
                   f"tokens at or after them carry {100 * r['mass_downstream']:.1f}% of the |log-ratio| mass")
        out.extend(f"    {lay['layer']}: {lay['flipped']} flipped, {100 * lay['mass_downstream']:.1f}% of the mass "
                   "downstream" for lay in r["layers"])
        out.extend(f"    flip at {f['layer']} row {f['row']} token {f['token']}: experts {f['experts_trainer']} -> "
                   f"{f['experts_sampler']}" for f in r["flips"])
    out.append(f"  attribution: {s.attribution.attribution}")
    if s.bound is not None:
        checks = "; ".join(f"{k} {c['value']:.3g} {'<=' if c['ok'] else '>'} {c['limit']:g}"
                           for k, c in s.bound["checks"].items())
        out.append(f"  bound: {'within' if s.bound['within'] else 'BEYOND'} ({checks})")
    return out


def source_report(v: Views, src: Source, bound: Bound | None, allow_lag: bool) -> SourceReport:
    import torch
    ok = torch.isfinite(src.values) & torch.isfinite(v.trainer)
    bad = (~ok).nonzero().flatten()[:NONFINITE_SHOWN].tolist()
    nonfinite_at = [{"row": int(v.row[i]), "position": int(v.position[i]), "token": int(v.token[i]),
                     "source": _number_text(float(src.values[i])), "trainer": _number_text(float(v.trainer[i]))}
                    for i in bad]
    lr = v.trainer[ok] - src.values[ok]
    bands = tuple(sorted({*stats.BANDS, *((bound.band,) if bound else ())}))
    summary = stats.summary(lr, bands)
    row, pos = v.row[ok], v.position[ok]
    rep = SourceReport(
        src, summary, stats.worst_sequences(lr, row, pos),
        stats.worst_tokens(lr, row, pos, v.token[ok], src.values[ok], v.trainer[ok]),
        stats.profile(lr, pos), stats.by_pad_offset(lr, row, v.pad_offset[ok]), attribute(v, src, allow_lag),
        nonfinite_tokens=int((~ok).sum()), nonfinite_at=nonfinite_at, routing=routing.reach(v, ok, lr))
    if bound is not None:
        share = stats.outside_share(lr, bound.band)
        checks = {"nonfinite_tokens": {"value": rep.nonfinite_tokens, "limit": 0},
                  "abs_log_ratio_max": {"value": summary["abs_max"], "limit": bound.max_abs_log_ratio},
                  "kl_k3": {"value": summary["k3"], "limit": bound.max_kl},
                  f"outside_share_d={bound.band:g}": {"value": share, "limit": bound.max_outside_share}}
        for c in checks.values():
            c["ok"] = c["value"] <= c["limit"]
        rep.bound = {"within": all(c["ok"] for c in checks.values()), "checks": checks}
    return rep


def decide(sources: list[SourceReport], bound: Bound | None, allow_lag: bool) -> dict[str, Any]:
    """The decision document (see the module docstring)."""
    if not sources:
        return {"status": "refused", "exit_code": EXIT_REFUSED,
                "reason": "the capture records no logprob source to compare with the trainer",
                "hint": "capture the step again with this release (the sampler records its logprobs)"}
    if all(s.summary["tokens"] == 0 and s.nonfinite_tokens == 0 for s in sources):  # every figure of nothing is 0
        return {"status": "refused", "exit_code": EXIT_REFUSED,
                "reason": "the capture holds no response token to compare: every figure would be 0 and within any "
                          "bound",
                "hint": "capture a step whose samples hold responses (every response mask row was zero)"}
    lagged = [s for s in sources if s.source.lag and not allow_lag]
    lag_text = "; ".join(f"{s.source.name}'s weights predate step K by {s.source.lag} step(s)" for s in lagged)
    if bound is None:
        return {"status": NO_BOUND, "exit_code": EXIT_REFUSED,
                "reason": f"{NO_BOUND}: the figures above decide nothing" + (f" ({lag_text})" if lagged else ""),
                "hint": "declare a bound file (docs/mismatch.md), pin its SHA-256 in optimizer_batch."
                        "mismatch_bound_sha256 and pass --bound FILE"}
    if lagged:
        return {"status": "refused", "exit_code": EXIT_REFUSED,
                "reason": f"policy lag: {lag_text}; the gap mixes the update(s) in between with the mismatch",
                "hint": "pass --allow-lag to decide and attribute across the lag, or capture a step whose "
                        "samples were drawn with its own weights"}
    beyond = [s for s in sources if s.within is False]
    if beyond:
        parts = []
        for s in beyond:
            assert s.bound is not None
            failed = ", ".join(f"{k} {c['value']:.3g} > {c['limit']:g}" for k, c in s.bound["checks"].items()
                               if not c["ok"])
            parts.append(f"{s.source.name} beyond the bound ({failed}); attributed to {s.attribution.attribution}")
        return {"status": "beyond", "exit_code": EXIT_NEGATIVE, "reason": "; ".join(parts)}
    return {"status": "within", "exit_code": EXIT_OK,
            "reason": "every source is within the bound: " + ", ".join(s.source.name for s in sources)}


def build(capture: dict[str, Any], views: Views, bound: Bound | None, allow_lag: bool, wall_s: float) -> Report:
    """The report of one recompute: every source's figures and attribution, then the decision."""
    sources = [source_report(views, s, bound, allow_lag) for s in views.sources]
    rep = Report(dict(capture), views, sources, bound, allow_lag, wall_s)
    rep.decision = decide(sources, bound, allow_lag)
    return rep
