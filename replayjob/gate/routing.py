"""Routing evidence of a mixture-of-experts model's replays for ``reduce`` (docs/moe.md, docs/verdict-format.md).

Each replay of an MoE model pins the routing its update used (``routing.safetensors``, under ``routing`` in
replay_metrics.json).  ``approximate.routing_agreement`` reads every replay's routing through its pin and
compares it, token by token (:func:`replayjob.model.moe.compare`), with a reference replay's: the first replay
of the first arm replayed under the source's own conditions (else the first replay).  Per arm: the share of
tokens whose expert set changed (the most over its replays), the first router and token where one did, the
flips between the arm's own repeats (the routing's noise at that condition), and how the arm's difference from
the reference relates to its routing:

* ``identical``: the same routing and the same final adapter;
* ``identical-routing``: the final adapter differs while every token went to the same experts: a numerical
  difference (a kernel, a dtype), not a routing flip;
* ``downstream-of-flips`` / ``upstream-of-flips`` / ``flips-only``: with both replays traced, where the traces'
  first forward divergence lies against the first flip (:data:`replayjob.trace.diff.ATTRIBUTIONS`);
* ``flips-untraced``: tokens flipped, and without traces nothing tells whether a numerical difference came
  first (replay with ``--trace``).

The check refuses when the evidence cannot be compared: only some replays recorded routing, a routing file
fails its pin, or two tables route different rows or routers.  It does not judge the update (the tolerance
and gradient checks do); it says in what way the arms differ.
"""

from __future__ import annotations

from typing import Any

from replayjob.artifacts.metrics import ROUTING
from replayjob.errors import RefusedError
from replayjob.gate import checks as C
from replayjob.gate.evidence import Replay, Source
from replayjob.model import moe
from replayjob.trace.diff import ATTRIBUTIONS, TraceDiff, load_side, replay_routing

NAME = "approximate.routing_agreement"
UNTRACED = "flips-untraced"
TEXT = {**ATTRIBUTIONS, "identical": "identical routing and the same final adapter",
        UNTRACED: "routing flips; whether a numerical difference came before them needs traces (replay --trace)"}
# the same in a few words (the report's table)
SHORT = {"identical": "identical routing, the same update",
         "identical-routing": "differs with identical routing (numerical: a kernel, a dtype, an order)",
         "downstream-of-flips": "differs only downstream of routing flips",
         "upstream-of-flips": "differs upstream of the first routing flip (numerical first, then flips)",
         "flips-only": "routing flips, traced outputs bitwise equal",
         UNTRACED: "routing flips; upstream unknown without traces"}


def _table(r: Replay) -> moe.RoutingTable:
    entry = moe.evidence_entry(r.doc.get(ROUTING), r.path)
    assert entry is not None
    return replay_routing(r, entry)


def _relation(ref: Replay, r: Replay, flipped: int) -> tuple[str, dict[str, Any] | None]:
    """How ``r`` differs from the reference, and the traces' first forward divergence when both are traced."""
    if ref.trace_index_sha256 is not None and r.trace_index_sha256 is not None:
        (a,), (b,) = load_side(ref.path.parent), load_side(r.path.parent)
        rep = TraceDiff([a], [b]).report()
        rt = rep["routing"]
        assert rt is not None  # both recorded routing
        first = rep["first_divergence"]["forward"]
        attribution = str(rt["attribution"])
        if attribution == "identical" and r.final_adapter != ref.final_adapter:
            attribution = "identical-routing"  # the traced outputs agree; the update differs after them
        return attribution, None if first is None else {"name": first["name"], "position": first["position"],
                                                        "status": first["status"]}
    if flipped:
        return UNTRACED, None
    return ("identical" if r.final_adapter == ref.final_adapter else "identical-routing"), None


def routing_check(replays: list[Replay], arms: dict[str, C.Arm], source: Source | None) -> C.Check:
    """``approximate.routing_agreement`` (see the module docstring)."""
    g = "approximate"
    expected = "every replay's routing read through its pin, over the same rows and routers"
    recorded = [r for r in replays if r.doc.get(ROUTING) is not None]
    if not recorded:
        return C.Check(NAME, g, C.NOT_APPLICABLE, None, None, "no replay recorded its routing (a dense model, or "
                       "replays over several ranks)")
    missing = tuple(r.label for r in replays if r.doc.get(ROUTING) is None)
    if missing:
        return C.Check(NAME, g, C.REFUSED, expected, {"missing": list(missing)}, "only some replays recorded their "
                       "routing: not replays of one mixture-of-experts model", missing)
    tables: dict[str, moe.RoutingTable] = {}
    try:
        for r in replays:
            tables[r.label] = _table(r)
    except RefusedError as exc:
        return C.Check(NAME, g, C.REFUSED, expected, None, f"routing evidence refused: {exc.message}",
                       (r.label,))
    same = [a for a in arms.values() if a.same_condition(source) and a.replays]
    ref = (same[0] if same else next(a for a in arms.values() if a.replays)).replays[0]
    base = tables[ref.label]
    per_arm: dict[str, Any] = {}
    try:
        for a in arms.values():
            comps = [(r, moe.compare(base, tables[r.label])) for r in a.replays]
            worst_r, worst = max(comps, key=lambda rc: (rc[1]["flipped"], -a.replays.index(rc[0])))
            head = a.replays[0] if a.replays[0] is not ref or len(a.replays) == 1 else a.replays[1]
            attribution, first = _relation(ref, head, next(c["flipped"] for r, c in comps if r is head))
            within = [moe.compare(tables[a.replays[0].label], tables[r.label])["flipped"] for r in a.replays[1:]]
            per_arm[a.name] = {
                "replays": len(a.replays), "tokens": base.tokens, "flipped": worst["flipped"],
                "share": worst["flipped"] / base.tokens if base.tokens else 0.0, "replay": worst_r.label,
                "layers": [{"layer": lay["layer"], "flipped": lay["flipped"], "share": lay["share"]}
                           for lay in worst["layers"]],
                "first_flip": worst["first_flip"], "repeat_flipped": max(within) if within else None,
                "compared": head.label, "attribution": attribution, "summary": SHORT[attribution],
                "text": TEXT[attribution],
                "first_forward_divergence": first}
    except RefusedError as exc:
        return C.Check(NAME, g, C.REFUSED, expected, None, f"routing evidence cannot be compared: {exc.message}",
                       tuple(r.label for r in replays))
    flips = {name: arm["flipped"] for name, arm in per_arm.items() if arm["flipped"]}
    detail = (f"against {ref.label}: " + ("every replay routes every token to the same experts" if not flips else
                                          "; ".join(f"{name}: {n} of {base.tokens} tokens flipped"
                                                    for name, n in flips.items())))
    return C.Check(NAME, g, C.PASS, expected, {"reference": ref.label, "layers": [lay.name for lay in base.layers],
                                               "top_k": base.top_k, "num_experts": base.num_experts,
                                               "arms": per_arm}, detail)
