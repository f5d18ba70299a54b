"""The human-readable report: a markdown file of the verdict's checks and statistics, plus a PNG.

Built from the verdict document alone (it carries each replay's measures), so a report can be
redrawn from any verdict.json.  The PNG (per-arm distributions of timing, memory and padding) needs
matplotlib, an optional extra: without it the report says the plot was skipped and how to enable it.
Both files are written atomically, before the verdict.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from replayjob.artifacts.verdict import few
from replayjob.fsio import atomic_write_bytes, atomic_write_text
from replayjob.gate.evidence import MEASURES

PLOT_HINT = "pip install 'replayjob[plot]'"
_CELL = 100


def _num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _cell(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= _CELL else text[: _CELL - 1] + "…"


def _checks(doc: dict[str, Any]) -> list[str]:
    lines = ["## Checks", "", "| check | group | status | expected | observed | offenders |",
             "|---|---|---|---|---|---|"]
    for c in doc["checks"]:
        status = c["status"].upper() if c["status"] in ("fail", "refused") else c["status"]
        lines.append(f"| `{c['name']}` | {c['group']} | {status} | {_cell(c['expected'])} | "
                     f"{_cell(c['observed'])} | {_cell(few(c['offenders'], 5))} |")
    return [*lines, ""]


def _spread(doc: dict[str, Any]) -> list[str]:
    lines = ["## Spread per arm", "", "| metric | arm | n | median | min | max | IQR |",
             "|---|---|---|---|---|---|---|"]
    for m in MEASURES:
        for arm, info in doc["arms"].items():
            s = info["stats"][m]
            lines.append(f"| {m} | {arm} | {s['n']} | {_num(s['median'])} | {_num(s['min'])} | "
                         f"{_num(s['max'])} | {_num(s['iqr'])} |")
    return [*lines, ""]


def _comparisons(doc: dict[str, Any]) -> list[str]:
    comp = doc["comparisons"]
    if comp["baseline"] is None:
        return ["## Comparisons", "", "No `--baseline` arm given; no ratios computed.", ""]
    if not comp["ratios"]:
        return [f"## Comparisons against `{comp['baseline']}` ({comp['admission']})", "",
                "No ratios: no other arm was read.", ""]
    boot = doc["parameters"]["bootstrap"]
    lines = [f"## Comparisons against `{comp['baseline']}` ({comp['admission']})", ""]
    if comp["admission"] == "not admitted (contended)":
        names = ", ".join(f"{c['arm']}#{c['repeat_index']} ({'; '.join(c['reasons'])})"
                          for c in (doc.get("contention") or {}).get("contended", []))
        lines += [f"**Timing conclusions: not admitted (contended).** Something contended with replay(s) {names} "
                  "while their updates were timed; the timing ratios carry no interval.", ""]
    elif comp["admission"] != "admitted":
        lines += ["**Timing and memory conclusions: not admitted.** The exact-input gate did not pass, "
                  "so these ratios are not evidence of a systems difference.", ""]
    lines += [f"{comp['statistic']}; {int(boot['confidence'] * 100)}% {boot['interval']} bootstrap "
              f"interval, {boot['resamples']} resamples, seed {boot['seed']}.", "",
              "| arm | metric | ratio | interval | excludes 1 | note |", "|---|---|---|---|---|---|"]
    for arm, per in comp["ratios"].items():
        for m, r in per.items():
            lines.append(f"| {arm} | {m} | {_num(r['ratio'])} | [{_num(r['low'])}, {_num(r['high'])}] | "
                         f"{_num(r['excludes_1'])} | {r['note']} |")
    return [*lines, ""]


def _updates(doc: dict[str, Any]) -> list[str]:
    up = doc.get("updates")
    if not up:
        return []
    lines = ["## Update geometry (approximate claim)", "",
             "| pairs | ordered pairs | cosine min / median / max | relative delta-L2 min / median / max |",
             "|---|---|---|---|"]
    for name, g in [("all", up["all"]), *up["groups"].items()]:
        c, d = g["cosine"], g["relative_delta_l2"]
        lines.append(f"| {name} | {g['ordered_pairs']} | {_num(c['min'])} / {_num(c['median'])} / "
                     f"{_num(c['max'])} | {_num(d['min'])} / {_num(d['median'])} / {_num(d['max'])} |")
    return [*lines, ""]


def _budgets(doc: dict[str, Any]) -> list[str]:
    """Declared bounds and their decisions (present only with reduce --budgets)."""
    b = doc.get("budgets")
    if not b:
        return []
    proc = b["procedure"]
    lines = ["## Budgets", "",
             f"Bounds on arm / `{b['baseline']}` ratios from `{b['file']['path']}` (SHA-256 "
             f"`{b['file']['sha256'][:16]}…`). {proc['statistic']}; {proc['interval']} at "
             f"{_num(proc['look_confidence'])} per look ({proc['name']}, alpha {proc['alpha']} over at most "
             f"{proc['max_looks']} look(s)). Pass: the interval lies inside the bound; fail: wholly outside; "
             f"inconclusive: it straddles the bound ({proc['estimate']}).", "",
             "| arm | metric | bound | pairs | ratio | interval | decision | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in b["bounds"]:
        lines.append(f"| {r['arm']} | {r['metric']} | {r['kind']} {_num(r['limit'])} | {_num(r.get('pairs'))} | "
                     f"{_num(r.get('ratio'))} | [{_num(r.get('low'))}, {_num(r.get('high'))}] | "
                     f"{r['decision'].upper() if r['decision'] in ('fail', 'inconclusive') else r['decision']} | "
                     f"{_cell(r['note'])} |")
    return [*lines, ""]


def _in_process(doc: dict[str, Any]) -> list[str]:
    ip = doc.get("in_process")
    if not ip:
        return []
    lines = ["## In-process repeats (same restored state, after warm-up; apart from fresh-process timing)", "",
             "| arm | n | median local_train_wall_s | IQR | loss equal to the fresh update |", "|---|---|---|---|---|"]
    for arm, info in ip.items():
        s = info["local_train_wall_s"] or {}
        lines.append(f"| {arm} | {_num(s.get('n'))} | {_num(s.get('median'))} | {_num(s.get('iqr'))} | "
                     f"{_num(info['loss_equal'])} |")
    return [*lines, ""]


LOCALISATION = "bitwise.first_divergent_module"


def _localisation(doc: dict[str, Any]) -> dict[str, Any] | None:
    return next((c for c in doc["checks"] if c["name"] == LOCALISATION and isinstance(c["observed"], dict)), None)


def _layers(doc: dict[str, Any], plot_name: str | None) -> list[str]:
    """Where the traced replays first diverge (bitwise claim) and the per-layer error table."""
    c = _localisation(doc)
    if c is None:
        return []
    obs = c["observed"]
    lines = ["## First divergent module (traces)", "", f"Pair {obs['pair']}: {obs['classification']}.", ""]
    for d in ("forward", "backward"):
        r = obs[d]
        lines.append(f"- {d}: " + ("bitwise equal" if r is None else
                                   f"`{r['name']}` ({r['kind']}, position {r['position']}): {r['status']}, "
                                   f"relative error {_num(r['rel_l2'])} vs envelope {_num(r['envelope'])} "
                                   f"({r['envelope_source']})"))
    lines += ["", "| direction | layer | largest relative error | envelope | sites beyond |", "|---|---|---|---|---|"]
    for d in ("forward", "backward", "gradients"):
        for layer in obs["layers"][d]:
            lines.append(f"| {d} | {layer['layer']} | {_num(layer['max_rel_l2'])} | {_num(layer['envelope'])} | "
                         f"{layer['beyond']} of {layer['sites']} |")
    lines.append("")
    if plot_name is not None:
        lines += [f"![per-site relative error against the noise envelope]({plot_name})", ""]
    return lines


ROUTING = "approximate.routing_agreement"


def _routing(doc: dict[str, Any]) -> list[str]:
    """The routing of a mixture-of-experts model's arms, in words (from ``approximate.routing_agreement``)."""
    c = next((c for c in doc["checks"] if c["name"] == ROUTING and c["status"] == "pass"), None)
    if c is None:
        return []
    obs = c["observed"]
    lines = ["## Routing (mixture-of-experts)", "",
             f"Each arm's expert choices against {obs['reference']}'s, token by token, over {len(obs['layers'])} "
             f"router(s) (top-{obs['top_k']} of {obs['num_experts']} experts).", "",
             "| arm | tokens whose experts changed | first change | between its repeats | how it differs |",
             "|---|---|---|---|---|"]
    for arm, a in obs["arms"].items():
        f = a["first_flip"]
        first = "-" if f is None else (f"`{f['layer']}`, row {f['row']}, token {f['token']}: experts "
                                       f"{f['experts_a']} -> {f['experts_b']} (margin {_num(f['margin_a'])})")
        repeats = "-" if a["repeat_flipped"] is None else f"{a['repeat_flipped']} token(s)"
        where = a["first_forward_divergence"]
        how = a["summary"] + ("" if where is None else f"; first differing output `{where['name']}`")
        lines.append(f"| {arm} | {a['flipped']} of {a['tokens']} ({100 * a['share']:.2f}%) | {first} | {repeats} | "
                     f"{how} |")
    lines += [""] + [f"- {arm}: {a['text']}." for arm, a in obs["arms"].items()]
    return [*lines, ""]


def layers_png(doc: dict[str, Any]) -> bytes | None:
    """PNG of the traced pair's relative error per site (execution order) against its envelope, or ``None``."""
    c = _localisation(doc)
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    if c is None:
        return None
    fig = Figure(figsize=(12, 5), dpi=100)
    ax = fig.subplots()
    floor = 1e-18  # bitwise-equal sites are drawn on the floor of the log axis
    for label, all_pts in c["observed"]["curve"].items():
        pts = [p for p in all_pts if p[1] is not None and p[2] is not None]  # a non-finite error is null
        if pts:
            ax.plot([p[0] for p in pts], [max(p[1], floor) for p in pts], ".-", label=f"{label} relative error")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], ":", color="grey")
    ax.set_yscale("log")
    ax.set_xlabel("site position (forward, then backward, then one per parameter gradient)")
    ax.set_ylabel("relative L2 error (envelope dotted)")
    ax.set_title(f"trace-diff {c['observed']['pair']}: {c['observed']['classification']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


# Each measure in human units: (axis label, factor from the recorded unit).  Every axis starts at zero
# so a small difference is not drawn as a large one.
_UNITS: dict[str, tuple[str, float]] = {
    "local_train_wall_s": ("update wall time (ms)", 1e3),
    "forward_wall_s": ("forward wall time (ms)", 1e3),
    "backward_wall_s": ("backward wall time (ms)", 1e3),
    "optimizer_wall_s": ("optimizer step wall time (ms)", 1e3),
    "peak_memory_bytes": ("peak memory (MiB)", 1 / 2**20),
    "padding_fraction": ("padding (% of tokens)", 100.0),
}


def plot_panels(doc: dict[str, Any]) -> list[tuple[str, str, list[list[float]]]]:
    """``(measure, axis label, per-arm values in human units)`` for every measure that has something to
    show: a measure that is zero (or absent) in every replay gets no panel."""
    arms = list(doc["arms"])
    panels = []
    for m in MEASURES:
        label, factor = _UNITS.get(m, (m, 1.0))
        data = [[r["measures"][m] * factor for r in doc["inputs"]["replays"]
                 if r["arm"] == a and m in r.get("measures", {})] for a in arms]
        if any(v for vals in data for v in vals):
            panels.append((m, label, data))
    return panels


def plot_png(doc: dict[str, Any]) -> bytes | None:
    """PNG bytes of per-arm distributions (ms, MiB, %; axes from zero; no empty panels), or ``None``
    when matplotlib is not installed or no measure has anything to show."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    arms = list(doc["arms"])
    panels = plot_panels(doc)
    if not panels:
        return None
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(4 * cols, 3.5 * rows), dpi=100)
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    for ax, (m, label, data) in zip(axes, panels, strict=False):
        ax.boxplot(data, whis=(0, 100))
        for i, vals in enumerate(data, start=1):
            offsets = [((k % 7) - 3) * 0.03 for k in range(len(vals))]
            ax.scatter([i + o for o in offsets], vals, s=12, alpha=0.7)
        ax.set_xticks(range(1, len(arms) + 1), arms, rotation=15, fontsize=8)
        ax.set_ylim(bottom=0, top=max(v for vals in data for v in vals) * 1.1)
        ax.set_ylabel(label, fontsize=9)
        ax.set_title(m, fontsize=10)
    for ax in axes[len(panels):]:
        ax.remove()
    fig.suptitle(f"replayjob reduce: {doc['claim']} {doc['status']} (timing {doc['admission']})")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def render(doc: dict[str, Any], plot_name: str | None, layers_name: str | None = None) -> str:
    """The markdown text; ``plot_name`` is the PNG's file name, or ``None`` when there is none."""
    lines = [f"{REPORT_HEAD}`{doc['claim']}` {doc['status'].upper()}", "",
             f"- exit code: {doc['exit_code']}",
             f"- timing and memory comparisons: {doc['admission']}",
             f"- replays: {len(doc['inputs']['replays'])} in {len(doc['arms'])} arm(s); "
             f"replayjob {doc['replayjob_version']}",
             f"- summary: {doc['summary']}"]
    if doc["refusal"]:
        r = doc["refusal"]
        lines.append(f"- refused: {r['message']}" + (f" ({r['where']})" if r["where"] else "")
                     + (f"; fix: {r['hint']}" if r["hint"] else ""))
    lines.append("")
    lines += (_checks(doc) + _routing(doc) + _layers(doc, layers_name) + _spread(doc) + _comparisons(doc)
              + _budgets(doc) + _in_process(doc) + _updates(doc))
    lines += ["## Plot", ""]
    if not doc["inputs"]["replays"]:
        lines.append("No replays were read; nothing to plot.")
    elif plot_name is None and not plot_panels(doc):
        lines.append("No measure is non-zero in any replay; nothing to plot.")
    elif plot_name is None:
        lines.append(f"Plot skipped: matplotlib is not installed. Enable it with `{PLOT_HINT}`.")
    else:
        lines.append(f"![per-arm timing, memory and padding]({plot_name})")
    return "\n".join(lines) + "\n"


REPORT_HEAD = "# replayjob reduce: "  # the first bytes of every report render() writes
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def report_files(path: Path) -> list[tuple[Path, bytes]]:
    """The files a report at ``path`` may write (the markdown, its plot and its layers plot), each with the bytes
    it begins with: an existing file there is replaced only when it begins so (:func:`written_here`).  A ``.png``
    report would be its own plot's path (``reduce`` refuses it)."""
    return [(path, REPORT_HEAD.encode()), (path.with_suffix(".png"), PNG_SIGNATURE),
            (path.with_name(path.stem + ".layers.png"), PNG_SIGNATURE)]


def written_here(path: Path, head: bytes) -> bool:
    """Whether the file at ``path`` begins with ``head`` (:func:`report_files`): one this report could have written."""
    try:
        with open(path, "rb") as f:
            return f.read(len(head)) == head
    except OSError:
        return False


def write_report(path: Path, doc: dict[str, Any]) -> Path | None:
    """Write the PNG (when matplotlib is available) then the markdown; return the PNG path or None."""
    (md, _), (png_path, _), (layers_path, _) = report_files(path)
    png = plot_png(doc) if doc["inputs"]["replays"] else None
    if png is not None:
        atomic_write_bytes(png_path, png)
    layers = layers_png(doc)
    if layers is not None:
        atomic_write_bytes(layers_path, layers)
    atomic_write_text(md, render(doc, png_path.name if png is not None else None,
                                 layers_path.name if layers is not None else None))
    return png_path if png is not None else None
