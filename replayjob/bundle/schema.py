"""Document checks shared by the writer (before writing) and the reader (before using).

``check_manifest``, ``check_index`` and ``check_expected`` check the manifest and its ``index`` and
``expected`` sections;
``check_closure`` checks that every stage declared ``recompute`` has its inputs, its recorded
upstream outputs and its own expected outputs, and that ``recorded-only`` stages have outputs.  An
input payload is an ``input`` payload, or in an ``update`` bundle the token output an earlier stage
recorded (the policy loss reads the advantages ``advantage.estimate`` recorded).
Each returns ``None`` or raises naming the field.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from replayjob.bundle import format as fmt
from replayjob.digest import is_sha256_hex
from replayjob.errors import ContractError, IntegrityError

_MANIFEST_KEYS = {"format", "format_version", "bundle_id", "kind", "producer", "stages", "payloads",
                  "payload_file", "comparison", "redaction", "index", "expected", "multi_rank"}
_SPEC_KEYS = {"dtype", "shape", "sha256", "role"}
_FILE_KEYS = {"file", "bytes", "header_sha256"}
W = fmt.MANIFEST


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_payload_file(pf: object, names: list[str]) -> None:
    """``payload_file`` is ``null`` when there are no payloads, else exactly ``payloads.safetensors`` with its
    size and the SHA-256 of its header block (the tensors' own digests are in ``payloads``)."""
    where = f"{W}: payload_file"
    if pf is None:
        if names:
            raise IntegrityError(f"payloads {names} are declared but payload_file is null", where=where)
        return
    if not isinstance(pf, dict) or set(pf) != _FILE_KEYS:
        raise IntegrityError(f"payload_file must be null or have exactly {sorted(_FILE_KEYS)}", where=where)
    if not names:
        raise IntegrityError("payload_file must be null when no payload is declared", where=where)
    if pf["file"] != fmt.PAYLOAD_FILE:
        raise IntegrityError(f"payload file {pf['file']!r} must be {fmt.PAYLOAD_FILE!r}", where=where,
                             hint="a bundle holds its tensors in one safetensors file; nothing else is read")
    if not _int(pf["bytes"]) or not is_sha256_hex(pf["header_sha256"]):
        raise IntegrityError("bytes and header_sha256 must be an integer and a 64-hex (lowercase) digest",
                             where=where)


def check_manifest(m: dict[str, Any]) -> None:
    """The manifest, its ``index`` and ``expected`` sections aside (:func:`check_index`, :func:`check_expected`).

    Format and version come first, so that a bundle of another format version is refused by version."""
    if m.get("format") != fmt.FORMAT:
        raise IntegrityError(f"not a trajectory bundle (format {m.get('format')!r})", where=W)
    fmt.check_version(m.get("format_version"), m.get("kind"), multi_rank=isinstance(m.get("multi_rank"), dict))
    if set(m) != _MANIFEST_KEYS:
        raise IntegrityError(f"manifest keys: missing {sorted(_MANIFEST_KEYS - set(m))}, unknown "
                             f"{sorted(set(m) - _MANIFEST_KEYS)}", where=W)
    fmt.check_id(m["bundle_id"], "bundle_id")
    if m["kind"] not in fmt.KINDS:
        raise IntegrityError(f"kind must be one of {list(fmt.KINDS)}", where=W)
    prod = m["producer"]
    if not isinstance(prod, dict) or not all(isinstance(k, str) and (v is None or isinstance(v, str | int | float))
                                             for k, v in prod.items()):
        raise IntegrityError("producer must map names to strings or numbers", where=f"{W}: producer")
    stages = m["stages"]
    want = fmt.KIND_STAGES[m["kind"]]
    if not isinstance(stages, dict) or set(stages) != set(want):
        raise IntegrityError(f"a {m['kind']} bundle declares exactly the stages {list(want)}",
                             where=f"{W}: stages")
    for s in want:
        fmt.check_contract(s, stages[s], m["kind"])
    payloads = m["payloads"]
    if not isinstance(payloads, dict):
        raise IntegrityError("payloads must be an object", where=f"{W}: payloads")
    for name, spec in payloads.items():
        fmt.check_payload_name(name)
        if not isinstance(spec, dict) or set(spec) != _SPEC_KEYS:
            raise IntegrityError(f"payload spec must have exactly {sorted(_SPEC_KEYS)}",
                                 where=f"{W}: payloads.{name}")
        if spec["dtype"] not in fmt.DTYPES or spec["role"] not in ("input", "expected"):
            raise IntegrityError(f"dtype must be one of {list(fmt.DTYPES)}, role input or expected",
                                 where=f"{W}: payloads.{name}")
        fmt.check_payload_dtype(name, spec["dtype"])
        if not isinstance(spec["shape"], list) or not all(_int(d) for d in spec["shape"]):
            raise IntegrityError("shape must be a list of integers >= 0", where=f"{W}: payloads.{name}")
        if not is_sha256_hex(spec["sha256"]):
            raise IntegrityError("sha256 (of the tensor's bytes) must be a 64-hex (lowercase) digest",
                                 where=f"{W}: payloads.{name}")
    check_payload_file(m["payload_file"], sorted(payloads))
    comp = m["comparison"]
    if not isinstance(comp, dict) or set(comp) != {s for s in want if s != "sample"}:
        raise IntegrityError("comparison must give atol and rtol for every compared stage",
                             where=f"{W}: comparison")
    for s, tol in comp.items():
        if not (isinstance(tol, dict) and set(tol) == {"atol", "rtol"} and all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                for v in tol.values())):
            raise IntegrityError("atol and rtol must be finite numbers >= 0", where=f"{W}: comparison.{s}")
    fmt.check_redaction(m["redaction"])
    for key in ("index", "expected"):
        if not isinstance(m[key], dict):
            raise IntegrityError(f"{key} must be an object", where=f"{W}: {key}")
    mr = m["multi_rank"]
    if mr is not None and not (isinstance(mr, dict) and set(mr) == {"rank", "expected_ranks", "run_id"}
                               and _int(mr["rank"]) and isinstance(mr["expected_ranks"], list)
                               and mr["expected_ranks"] and all(_int(r) for r in mr["expected_ranks"])
                               and mr["rank"] in mr["expected_ranks"]
                               and len(set(mr["expected_ranks"])) == len(mr["expected_ranks"])):
        raise IntegrityError("multi_rank must be null or {rank, expected_ranks, run_id} with rank listed",
                             where=f"{W}: multi_rank")
    if mr is not None:
        fmt.check_run_id(mr["run_id"], where=f"{W}: multi_rank.run_id")


def check_index(ix: dict[str, Any], m: dict[str, Any]) -> None:
    where = fmt.INDEX
    keys = {"format", "bundle_id", "kind", "identity", "config", "samples"}
    if set(ix) != keys:
        raise IntegrityError(f"index keys must be exactly {sorted(keys)}", where=where)
    if ix["format"] != fmt.FORMAT or ix["bundle_id"] != m["bundle_id"] or ix["kind"] != m["kind"]:
        raise IntegrityError("index format, bundle_id or kind disagrees with the manifest", where=where)
    ident = ix["identity"]
    if not isinstance(ident, dict) or set(ident) != {"rollout_id", "step_id", "physical"}:
        raise IntegrityError("identity must have rollout_id, step_id, physical", where=f"{where}: identity")
    if not _int(ident["rollout_id"]):
        raise IntegrityError("identity.rollout_id must be an integer >= 0", where=f"{where}: identity")
    if m["kind"] in fmt.STEP_KINDS and not _int(ident["step_id"]):
        raise IntegrityError(f"a {m['kind']} bundle's identity needs step_id (an integer >= 0)", where=where)
    if m["kind"] == "rollout" and ident["step_id"] is not None:
        raise IntegrityError("a rollout bundle's identity has step_id null", where=where)
    phys = ident["physical"]
    if not (isinstance(phys, dict) and set(phys) == {"rank", "world_size", "weight_version"}
            and all(_int(v) for v in phys.values()) and phys["world_size"] >= 1):
        raise IntegrityError("identity.physical must be {rank, world_size >= 1, weight_version}",
                             where=f"{where}: identity.physical")
    mr = m["multi_rank"]
    if mr is not None and (phys["rank"] != mr["rank"] or phys["world_size"] != len(mr["expected_ranks"])):
        raise IntegrityError("identity.physical disagrees with manifest multi_rank", where=where)
    if mr is None and phys["world_size"] != 1:
        raise IntegrityError("world_size > 1 needs a multi-rank bundle layout", where=where)
    fmt.check_config(ix["config"])
    samples = ix["samples"]
    if not isinstance(samples, list) or not samples:
        raise IntegrityError("samples must be a non-empty list", where=where)
    red = m["redaction"]
    ids = [fmt.check_sample(s, i, red)["sample_id"] for i, s in enumerate(samples)]
    if len(set(ids)) != len(ids):
        raise IntegrityError("sample ids must be unique", where=where)


def check_expected(ex: dict[str, Any], m: dict[str, Any], n: int) -> None:
    where = fmt.EXPECTED
    allowed = set(fmt.KIND_STAGES[m["kind"]]) - {"sample"}
    if not isinstance(ex, dict) or not set(ex) <= allowed:
        raise IntegrityError(f"expected outputs may name only {sorted(allowed)}", where=where)
    for stage, fields in ex.items():
        if not isinstance(fields, dict) or not set(fields) <= set(fmt.OUTPUTS[stage]):
            raise IntegrityError(f"{stage} outputs are {sorted(fmt.OUTPUTS[stage])}", where=where)
        for field, value in fields.items():
            shape = fmt.OUTPUTS[stage][field]
            w = f"{where}: {stage}.{field}"
            if shape == "sample":
                if not (isinstance(value, list) and len(value) == n and all(
                        isinstance(v, int | float) and not isinstance(v, bool) for v in value)):
                    raise IntegrityError(f"must be a list of {n} numbers (one per sample)", where=w)
            elif shape == "scalar":
                if not isinstance(value, int | float) or isinstance(value, bool):
                    raise IntegrityError("must be a number", where=w)
            elif value != {"payload": field} or m["payloads"].get(field, {}).get("role") != "expected":
                raise IntegrityError(f"must be {{\"payload\": \"{field}\"}} naming an expected payload",
                                     where=w)


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


def check_closure(m: dict[str, Any], ix: dict[str, Any], ex: dict[str, Any],
                  shapes: dict[str, tuple[str, list[int]]]) -> None:
    """Dependency closure: what each declared capability needs is present and shaped right."""
    n = len(ix["samples"])
    cfg = ix["config"]
    t_len: int | None = None
    for name, (_, shape) in shapes.items():
        if name == "label_ids":
            ok = len(shape) == 2 and shape[0] == n
        else:
            ok = len(shape) == 2 and shape[0] == n and (t_len is None or shape[1] == t_len)
            t_len = shape[1] if ok else t_len
        if not ok:
            raise IntegrityError(f"payload {name!r} has shape {shape}; per-token payloads are [N={n}, T] "
                                 "with one T", where=f"{W}: payloads.{name}")
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
