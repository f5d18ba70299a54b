"""Routing flips between the recompute's passes on a mixture-of-experts model (docs/mismatch.md).

Every pass of the recompute records, per router, the experts each real token of every logical row went to
(:class:`replayjob.model.moe.RoutingTable`, tokens in logical row order, so every layout lines up).  The
``combined`` pass recomputes the sampler's computation (its layout, dtype and router): it stands for the
sampler's routing, and the ``trainer`` pass for the trainer's.  A token whose expert *set* differs between the
two in some router is a **routing flip**.

A response token's log-probability comes from the logits of the token before it (its *context* token: prompt
length + position - 1 among its row's tokens).  It is **at** a flip when its context token flipped in some
router, and **downstream** of one when its context token lies at or after the first flipped token of its row:
causal attention carries a flip to every later token of the row, and to no other row.  The share of a source's
``|log-ratio|`` mass those tokens carry says how much of the gap the flips can account for; the ``routing``
attribution test (:mod:`~replayjob.mismatch.attribution`) measures it by recomputing the trainer with the
sampler-side experts forced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from replayjob.mismatch.views import Views
from replayjob.model import moe

if TYPE_CHECKING:
    from torch import Tensor

TRAINER = "trainer"
SAMPLER_SIDE = "combined"
FLIPS_SHOWN = 10  # flips listed by location (all are counted)


def agreement(v: Views) -> dict[str, Any] | None:
    """The report's ``routing`` section: per pass other than the trainer's, its routing against the trainer
    pass's (:func:`replayjob.model.moe.compare`, side ``a`` the trainer's); ``None`` without routing (a dense
    model, or a recompute that does not observe it)."""
    base = v.routing.get(TRAINER)
    if base is None:
        return None
    passes = {}
    for name, table in v.routing.items():
        if name == TRAINER:
            continue
        c = moe.compare(base, table)
        passes[name] = {"mode": table.mode, "flipped": c["flipped"], "identical": c["identical"],
                        "layers": c["layers"], "first_flip": c["first_flip"]}
    return {"layers": [lay.name for lay in base.layers], "tokens": base.tokens, "top_k": base.top_k,
            "num_experts": base.num_experts, "fault": base.fault,
            "sampler_pass": SAMPLER_SIDE if SAMPLER_SIDE in v.routing else None, "passes": passes}


def _first_in_row(flipped: Tensor, row_of: Tensor, starts: Tensor, rows: int) -> Tensor:
    """Per row, the index (among all tokens) of its first flipped token; one past the last token where none."""
    import torch
    n = int(flipped.numel())
    cand = torch.where(flipped, torch.arange(n), n)
    return torch.full((rows,), n, dtype=torch.int64).scatter_reduce(0, row_of, cand, "amin", include_self=True)


def reach(v: Views, ok: Tensor, lr: Tensor) -> dict[str, Any] | None:
    """Where the sampler-side pass's routing flips reach one source's finite tokens (``ok``; ``lr`` their
    log-ratios), and the share of the ``|log-ratio|`` mass the tokens at and downstream of them carry: over all
    routers, then per router; the first :data:`FLIPS_SHOWN` flips located by router, logical row and token.
    ``None`` when the recompute holds no trainer and sampler-side routing to compare."""
    import torch
    base, side = v.routing.get(TRAINER), v.routing.get(SAMPLER_SIDE)
    if base is None or side is None or v.prompt_len is None:
        return None
    rows = int(base.row_tokens.numel())
    starts = torch.cumsum(base.row_tokens, 0) - base.row_tokens
    row_of = base.row_of_token()
    row = v.row[ok]
    context = starts[row] + v.prompt_len[row] + v.position[ok] - 1
    mass = lr.abs()
    total = float(mass.sum())

    def share(sel: Tensor) -> float:
        return float(mass[sel].sum()) / total if total > 0 else 0.0

    def summary(flipped: Tensor) -> dict[str, Any]:
        at = flipped[context]
        down = context >= _first_in_row(flipped, row_of, starts, rows)[row]
        return {"flipped": int(flipped.sum()), "response_tokens_at_flips": int(at.sum()), "mass_at_flips": share(at),
                "response_tokens_downstream": int(down.sum()), "mass_downstream": share(down)}

    layers, located = [], []
    every = torch.zeros(base.tokens, dtype=torch.bool)
    for la, lb in zip(base.layers, side.layers, strict=True):
        flipped = (la.expert_sets() != lb.expert_sets()).any(dim=-1)
        every |= flipped
        layers.append({"layer": la.name, **summary(flipped)})
        for t in flipped.nonzero().flatten().tolist():
            r = int(row_of[t])
            token = t - int(starts[r])
            p = token - int(v.prompt_len[r])
            located.append({"layer": la.name, "row": r, "token": token, "response_position": p if p >= 0 else None,
                            "experts_trainer": la.experts[t].tolist(), "experts_sampler": lb.experts[t].tolist(),
                            "margin_trainer": float(la.margin[t]), "margin_sampler": float(lb.margin[t]), "_at": t})
    located.sort(key=lambda f: f["_at"])  # logical order; layers in model order among a token's flips
    for f in located:
        del f["_at"]
    return {"pass": SAMPLER_SIDE, "response_tokens": int(ok.sum()), **summary(every), "layers": layers,
            "flips": located[:FLIPS_SHOWN]}


def evidence(r: dict[str, Any]) -> list[str]:
    """The routing test's evidence lines from :func:`reach`."""
    out = [f"{r['flipped']} token(s) go to another expert set in the sampler-side pass than in the trainer's ("
           + ", ".join(f"{lay['layer']}: {lay['flipped']}" for lay in r["layers"]) + ")"]
    if r["flips"]:
        f = r["flips"][0]
        where = "prompt" if f["response_position"] is None else f"response position {f['response_position']}"
        out.append(f"first flip: {f['layer']}, row {f['row']}, token {f['token']} ({where}), experts "
                   f"{f['experts_trainer']} (trainer) -> {f['experts_sampler']} (sampler side), router-logit margins "
                   f"{f['margin_trainer']:.3g} / {f['margin_sampler']:.3g}")
    out.append(f"the response tokens at or after a flip in their row carry {100 * r['mass_downstream']:.1f}% of the "
               f"|log-ratio| mass ({r['response_tokens_downstream']} of {r['response_tokens']} tokens); those right at "
               f"a flip {100 * r['mass_at_flips']:.1f}% ({r['response_tokens_at_flips']})")
    return out
