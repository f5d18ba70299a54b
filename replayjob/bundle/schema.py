"""The bundle's documents as the writer (before writing) and the reader (before using) read them.

:func:`decode_manifest` reads a manifest through its declaration
(:class:`replayjob.artifacts.bundle.BundleManifest`: its ``index`` and ``expected`` sections inside),
after the version gate and before the topology check (:func:`replayjob.bundle.format.check_supported`);
``check_closure`` checks that every stage declared ``recompute`` has its inputs, its recorded
upstream outputs and its own expected outputs, and that ``recorded-only`` stages have outputs.  An
input payload is an ``input`` payload, or in an ``update`` bundle the token output an earlier stage
recorded (the policy loss reads the advantages ``advantage.estimate`` recorded).
Each returns or raises naming the field.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from replayjob.artifacts.bundle import BundleManifest, gate
from replayjob.bundle import format as fmt
from replayjob.declaration import decode, to_builtins
from replayjob.errors import ContractError, IntegrityError

W = fmt.MANIFEST
HINT = ("a bundle's manifest is what replayjob's BundleWriter wrote, checked before a byte was written; capture the "
        "bundle again rather than editing it")


def decode_manifest(doc: object, where: str | Path = W) -> dict[str, Any]:
    """``manifest.json`` (already parsed) read through its declaration: the version gate, the declaration (every
    field typed and ranged, every rule between fields), then the topology this replayjob recomputes.  Returns the
    plain form of what was declared (what the bundle layer reads)."""
    manifest = to_builtins(check_manifest(doc, where))
    fmt.check_supported(manifest["index"]["config"])
    return manifest


def check_manifest(doc: object, where: str | Path = W) -> BundleManifest:
    """The version gate, then the declaration (the writer checks what it is about to write with this)."""
    gate(doc, where)
    return decode(doc, BundleManifest, where=where, hint=HINT)


def check_groups(m: dict[str, Any], samples: list[dict[str, Any]], cfg: dict[str, Any]) -> None:
    """Group closure, when ``reward.post_process`` is recomputed: every sample names its semantic group and
    every group holds exactly ``samples_per_prompt`` members.

    The one implementation of the check: the writer runs it on a single bundle, the reader on the whole
    bundle (a multi-rank root's ranks merged, so ``bundle validate`` refuses what ``bundle replay`` would),
    and replay again on the rows it selected (always whole groups)."""
    if m["stages"].get("reward.post_process", {}).get("capability") != "recompute":
        return
    where = f"{fmt.INDEX}: samples"
    for s in samples:
        if s["group"] is None:
            raise ContractError(f"missing group membership for sample {s['sample_id']!r}", where=where,
                                hint="groups are never inferred from batch sizes")
    spp = cfg["samples_per_prompt"]
    for g, n in sorted(Counter(s["group"] for s in samples).items()):
        if n != spp:
            raise ContractError(f"group {g!r} has {n} member(s) here, the config says samples_per_prompt={spp}: "
                                "the group closure is incomplete", where=where,
                                hint="capture whole groups with the trainer's samples_per_prompt; a partial "
                                     "group cannot be normalised")


def check_tokens(m: dict[str, Any], samples: list[dict[str, Any]]) -> None:
    """A per-token stage recomputed (``advantage.kl``, ``advantage.estimate``, ``loss.policy``) needs a response token
    somewhere in the bundle: over masks that are all zero it compares zeros with zeros and passes on nothing.  Like
    :func:`check_groups`, run on the whole bundle (a multi-rank root's ranks merged) by the reader and the writer."""
    stages = [s for s, c in m["stages"].items()
              if c.get("capability") == "recompute" and "token" in fmt.OUTPUTS.get(s, {}).values()]
    if stages and not any(s["response_length"] for s in samples):
        raise IntegrityError(f"no sample has a response token (every response_length is 0, every mask row zero), so "
                             f"the per-token stage(s) {stages} would compare nothing", where=f"{fmt.INDEX}: samples",
                             hint="capture a step whose samples hold responses; a response ends with its EOS token, "
                                  "so a sampled response is never empty")


def check_shapes(n: int, shapes: dict[str, list[int]]) -> None:
    """Every payload is ``[N, T]``, one row per sample, with one ``T`` (``label_ids``: ``[N, L]``).  The reader runs
    it as soon as the payload file's header is known, before any summary of the rows (the mask's) is compared."""
    t_len: int | None = None
    for name, shape in shapes.items():
        if name == "label_ids":
            ok = len(shape) == 2 and shape[0] == n
        else:
            ok = len(shape) == 2 and shape[0] == n and (t_len is None or shape[1] == t_len)
            t_len = shape[1] if ok else t_len
        if not ok:
            raise IntegrityError(f"payload {name!r} has shape {shape}; per-token payloads are [N={n}, T] "
                                 "with one T", where=f"{W}: payloads.{name}",
                                 hint="every payload holds one row per sample of the index, every per-token "
                                      "payload the same width; capture the bundle again")


def check_closure(m: dict[str, Any], ix: dict[str, Any], ex: dict[str, Any],
                  shapes: dict[str, tuple[str, list[int]]]) -> None:
    """Dependency closure: what each declared capability needs is present and shaped right."""
    cfg = ix["config"]
    check_shapes(len(ix["samples"]), {name: shape for name, (_, shape) in shapes.items()})
    for name in fmt.ID_FIELDS:
        if m["redaction"][name] == "drop" and name in shapes:
            raise IntegrityError(f"payload {name!r} is present but the redaction policy drops it", where=W)
    for stage, contract in m["stages"].items():
        cap = contract["capability"]
        if cap not in ("recompute", "recorded-only"):
            continue
        where = f"{W}: stages.{stage} ({cap})"
        for field in fmt.OUTPUTS[stage]:
            if field not in ex.get(stage, {}):
                raise IntegrityError(f"dependency closure: expected output {stage}.{field} is missing",
                                     where=where)
        if cap != "recompute":
            continue
        for name in fmt.INPUT_PAYLOADS[stage]:
            if name not in shapes:
                raise IntegrityError(f"dependency closure: input payload {name!r} is missing", where=where,
                                     hint="capture it or declare the stage recorded-only")
            upstream = fmt.recorded_upstream(m["kind"], stage, name)
            if m["payloads"][name]["role"] != "input" and (upstream is None or name not in ex.get(upstream, {})):
                raise IntegrityError(f"dependency closure: payload {name!r} is an expected output, not an input "
                                     f"of {stage}; only an earlier stage's recorded output of the same bundle "
                                     "may feed it", where=where)
        for up_stage, field in fmt.UPSTREAM.get(stage, ()):
            if field not in ex.get(up_stage, {}):
                raise IntegrityError(f"dependency closure: recorded input {up_stage}.{field} is missing",
                                     where=where)
        if stage == "reward.raw":
            if cfg["task"] is None or cfg["tokenizer"] != "byte":
                raise ContractError("reward.raw recompute needs a built-in task and the byte tokenizer",
                                    where=where, hint="declare reward.raw recorded-only")
            if any(s["label_length"] is None for s in ix["samples"]):
                raise IntegrityError("reward.raw recompute needs label_length for every sample", where=where)
        if stage == "reward.post_process":
            for s in ix["samples"]:
                if s["group"] is None:
                    raise ContractError(f"sample {s['sample_id']!r} has no group membership; groups are "
                                        "never inferred from batch sizes", where=where,
                                        hint="record each sample's semantic group or declare the stage "
                                             "recorded-only")
