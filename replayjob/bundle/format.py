"""The trajectory-bundle format: names, stage table, capability matrix and schema checks.

A bundle is a directory of three files: ``payloads.safetensors`` (every tensor of the bundle, named
after its payload), ``manifest.json`` (identity, samples, config, expected outputs, and the SHA-256
of the payload file's header and of each tensor's bytes) and ``COMPLETE`` (last).  This module holds
what the writer and the reader must agree on, so the two cannot drift apart; ``docs/bundle-format.md`` describes it for
people.  Every check raises :class:`~replayjob.errors.IntegrityError` (or ``ContractError`` for an
unsupported topology) with a sentence naming the field.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

from replayjob import tensorfile
from replayjob.digest import is_sha256_hex
from replayjob.errors import ContractError, IntegrityError
from replayjob.rl.stages import ESTIMATORS

if TYPE_CHECKING:
    pass

# The payload dtypes a bundle may hold, by their safetensors names (the one list every part uses; the torch
# dtype of each is tensorfile.torch_dtype(name)).
DTYPES = ("F64", "F32", "F16", "BF16", "I64", "I32", "U8", "BOOL")

FORMAT = "replayjob.bundle"
# The version each kind appeared in: a writer writes the oldest minor version that holds its bundle.
KIND_VERSIONS = {"rollout": "2.0.0", "step": "2.0.0", "update": "2.1.0"}
# 2.2.0 added the run id of a multi-rank bundle (manifest ``multi_rank.run_id``, ``COMPLETE.<r>`` and the
# root ``COMPLETE``): a rank directory is written as 2.2.0 whatever its kind; a single bundle keeps its kind's.
MULTI_RANK_VERSION = "2.2.0"
FORMAT_VERSION = max([*KIND_VERSIONS.values(), MULTI_RANK_VERSION],
                     key=lambda v: tuple(int(x) for x in v.split(".")))  # reads 2.x
STAGE_VERSION = "v1"

MANIFEST = "manifest.json"
PAYLOAD_FILE = "payloads.safetensors"
COMPLETE = "COMPLETE"
INDEX = f"{MANIFEST}: index"  # the manifest's sections, as places named in messages
EXPECTED = f"{MANIFEST}: expected"
# Top-level entries of a format 1.x bundle (one payload file per tensor, separate documents): a
# bundle holding any of them is refused by version (:func:`version_error`), never half-read.
V1_ENTRIES = ("index.json", "expected.json", "payloads")
# Suffixes of formats that can carry pickle (or arbitrary code); refused anywhere in a bundle.
PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt", ".npy", ".npz", ".joblib")

KINDS = ("rollout", "step", "update")
STAGE_ORDER = ("sample", "reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate",
               "loss.policy")
KIND_STAGES = {
    "rollout": ("sample", "reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate"),
    "step": ("sample", "loss.policy"),
    "update": STAGE_ORDER,  # a rollout and the one actor step that consumed it, in one bundle
}
STEP_KINDS = tuple(k for k, s in KIND_STAGES.items() if "loss.policy" in s)  # identity: (rollout_id, step_id)
ROLLOUT_KINDS = tuple(k for k, s in KIND_STAGES.items() if "advantage.estimate" in s)  # a rollout's stages
CAPABILITIES = ("recompute", "recorded-only", "inspect-only", "unsupported")

# stage -> (output field -> "sample" | "token" | "scalar"); token fields live in payloads.
OUTPUTS: dict[str, dict[str, str]] = {
    "sample": {},
    "reward.raw": {"raw": "sample"},
    "reward.post_process": {"scores": "sample"},
    "advantage.kl": {"kl": "token"},
    "advantage.estimate": {"advantages": "token"},
    "loss.policy": {"loss": "scalar", "loss_weights": "token"},
}
# stage -> input payloads a `recompute` contract needs (besides recorded upstream outputs).
INPUT_PAYLOADS: dict[str, tuple[str, ...]] = {
    "sample": (),
    "reward.raw": ("mask", "response_ids", "label_ids"),
    "reward.post_process": (),
    "advantage.kl": ("mask", "old_logprobs", "ref_logprobs"),
    "advantage.estimate": ("mask",),
    "loss.policy": ("mask", "logprobs", "old_logprobs", "ref_logprobs", "advantages"),
}
# stage -> recorded upstream outputs (stage, field) a `recompute` contract consumes.
UPSTREAM: dict[str, tuple[tuple[str, str], ...]] = {
    "reward.post_process": (("reward.raw", "raw"),),
    "advantage.estimate": (("reward.post_process", "scores"), ("advantage.kl", "kl")),
}
IMPLEMENTATION = {
    "sample": "replayjob.rl.sampling.sample (not recomputed: needs the model)",
    "reward.raw": "replayjob.rl.stages.reward_raw + replayjob.rl.task.Task.score",
    "reward.post_process": "replayjob.rl.stages.post_process",
    "advantage.kl": "replayjob.rl.stages.token_kl",
    "advantage.estimate": "replayjob.rl.stages.advantage_estimate, batch_normalize, clip_advantages",
    "loss.policy": "replayjob.rl.stages.token_cap, loss_weights, policy_loss",
}

DEFAULT_COMPARISON: dict[str, dict[str, float]] = {
    "reward.raw": {"atol": 0.0, "rtol": 0.0},
    "reward.post_process": {"atol": 1e-12, "rtol": 1e-9},
    "advantage.kl": {"atol": 1e-12, "rtol": 1e-9},
    "advantage.estimate": {"atol": 1e-12, "rtol": 1e-9},
    "loss.policy": {"atol": 1e-10, "rtol": 1e-9},
}

TEXT_FIELDS = ("prompt", "completion", "label")
ID_FIELDS = ("response_ids", "label_ids")
FIXED_DROPS = ("paths", "endpoints", "environment", "secrets")
DEFAULT_REDACTION: dict[str, str] = {"prompt": "hash", "completion": "hash", "label": "hash",
                                     "response_ids": "keep", "label_ids": "keep",
                                     **{k: "drop" for k in FIXED_DROPS}}

CONFIG_KEYS: dict[str, type | tuple[type, ...]] = {
    "estimator": str, "samples_per_prompt": int, "std_eps": float, "kl_kind": str,
    "kl_reward_coef": float, "batch_adv_norm": bool, "adv_clip": float, "token_cap": int,
    "loss_agg": str, "clip_low": float, "clip_high": float, "kl_loss_coef": float,
    "context_parallel": int, "task": (dict, type(None)), "tokenizer": (str, type(None)),
}
# Payloads a stage computes with, by the dtypes it needs: token ids are integers (a float id cannot be
# decoded), log-probabilities, KL, advantages and loss weights are floating point.
INTEGER_DTYPES = ("I64", "I32", "U8")
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
PAYLOAD_DTYPES: dict[str, tuple[str, ...]] = {
    **{name: INTEGER_DTYPES for name in ("response_ids", "label_ids")},
    **{name: FLOAT_DTYPES for name in ("logprobs", "old_logprobs", "ref_logprobs", "kl", "advantages",
                                       "loss_weights")}}
# Config values the trainer refuses below 0 (``replayjob.config.schema.AlgorithmConfig``): a bundle whose
# producer recorded one is refused too, never recomputed with it.
NON_NEGATIVE = ("std_eps", "kl_reward_coef", "adv_clip", "clip_low", "clip_high", "kl_loss_coef", "token_cap")
_TRAINER_KEYS = {"clip_low": "clip_eps_low", "clip_high": "clip_eps_high"}  # where the trainer's config differs
KL_KINDS = ("k1", "k3")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean")
TASKS = ("arithmetic", "reverse")

SAMPLE_KEYS = {"sample_id", "group", "cohort", "prompt_length", "response_length", "label_length",
               "partition", "consumer_batch", "micro_batch", "rank", "weight_version",
               *(f"{t}_sha256" for t in TEXT_FIELDS), *(f"{t}_prefix" for t in TEXT_FIELDS)}
_SAMPLE_IDS = ("sample_id", "cohort", "partition", "consumer_batch", "micro_batch", "group")  # checked in order
_TEXT_KEYS = {t: (f"{t}_sha256", f"{t}_prefix") for t in TEXT_FIELDS}
_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def check_payload_name(name: object) -> str:
    """A payload name is a short lowercase identifier (a tensor name in the payload file)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise IntegrityError(f"payload name {name!r} is not allowed: use [a-z][a-z0-9_]* (at most 64 "
                             "characters)",
                             where=MANIFEST)
    return name


def check_payload_dtype(name: str, dtype: str) -> None:
    """A payload a stage computes with has a dtype of its class (:data:`PAYLOAD_DTYPES`)."""
    allowed = PAYLOAD_DTYPES.get(name)
    if allowed is not None and dtype not in allowed:
        what = "token ids are integers" if allowed is INTEGER_DTYPES else "it holds real numbers"
        raise IntegrityError(f"payload {name!r} is {dtype}: {what}, so its dtype must be one of {list(allowed)}",
                             where=f"{MANIFEST}: payloads.{name}",
                             hint="write it with an integer tensor" if allowed is INTEGER_DTYPES else
                             "write it with a floating-point tensor")


def check_id(value: object, what: str) -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise IntegrityError(f"{what} must be a short identifier ([A-Za-z0-9._:-]), found {value!r}",
                             where=INDEX)
    return value


def check_run_id(value: object, where: object = None) -> str:
    """The id of the run a rank of a multi-rank bundle belongs to: a short identifier, chosen once per run."""
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise IntegrityError(f"run_id must be a short identifier ([A-Za-z0-9][A-Za-z0-9._:-]*, at most 128 "
                             f"characters), found {value!r}", where=str(where) if where is not None else None,
                             hint="pass the one id of the run every rank writes (replayjob.bundle.writer."
                                  "shared_run_id)")
    return value


def run_mix(run_ids: dict[int, object]) -> str:
    """The refusal of ranks that do not carry one run id (``rank -> run id``, None: none recorded)."""
    first = next(iter(run_ids.items()))
    other = next(((r, v) for r, v in run_ids.items() if v != first[1]), first)
    if first[1] is None or other[1] is None:
        r = first[0] if first[1] is None else other[0]
        return (f"rank {r} records no run id (written before bundle format {MULTI_RANK_VERSION}): it cannot be "
                "shown to belong to the same run as the other ranks")
    return (f"the ranks come from different runs: rank {first[0]} carries run id {first[1]!r}, rank {other[0]} "
            f"carries run id {other[1]!r}; a multi-rank bundle is one run's ranks")


def version_error(version: object) -> ContractError:
    """The refusal of a bundle whose format version this reader does not read (exit 2)."""
    return ContractError(f"bundle format_version {version!r} is not read by this replayjob, which reads bundle "
                         f"format {FORMAT_VERSION} (one {PAYLOAD_FILE}, samples and expected outputs inside "
                         f"{MANIFEST})", where=MANIFEST,
                         hint="capture the bundle again with this replayjob, or read it with the replayjob "
                              "release that wrote it")


def reads_version(version: object) -> bool:
    """Whether this reader reads a bundle of ``format_version`` (the same major version)."""
    return isinstance(version, str) and version.split(".")[0] == FORMAT_VERSION.split(".")[0]


def check_version(version: object, kind: object = None, multi_rank: bool = False) -> None:
    """Refuse another major version, and a ``kind`` (or a rank of a multi-rank bundle) newer than the
    minor version that claims it."""
    if not reads_version(version):
        raise version_error(version)
    problem = kind_version_problem(version, kind, multi_rank)
    if problem is not None:
        raise IntegrityError(problem, where=MANIFEST,
                             hint="capture the bundle again with this replayjob" if multi_rank else None)


def bundle_version(kind: str, multi_rank: bool) -> str:
    """The oldest format version that holds a ``kind`` bundle (a rank directory when ``multi_rank``)."""
    return max(KIND_VERSIONS[kind], MULTI_RANK_VERSION if multi_rank else "0.0.0", key=lambda v: _minor(v))


def kind_version_problem(version: object, kind: object, multi_rank: bool = False) -> str | None:
    """Why a ``kind`` bundle (a rank directory when ``multi_rank``) cannot be of ``version`` (a 2.x version
    older than what it holds), or None."""
    since = KIND_VERSIONS.get(kind) if isinstance(kind, str) else None
    if since is not None and _minor(since) > 0 and _minor(str(version)) < _minor(since):  # "2", "2.x": no minor
        return f"{kind} bundles need format_version {since} or later; this manifest says {version!r}"
    if multi_rank and _minor(str(version)) < _minor(MULTI_RANK_VERSION):
        return (f"multi-rank bundles (multi_rank set) need format_version {MULTI_RANK_VERSION} or later (every "
                f"rank records the run id that ties the ranks to one run); this manifest says {version!r}")
    return None


def _minor(version: str) -> int:
    parts = version.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1


def payload_where(name: str) -> str:
    """Where a payload lives, as messages name it: ``payloads.safetensors: <name>``."""
    return f"{PAYLOAD_FILE}: {name}"


def payload_schema(dtypes: dict[str, str]) -> tensorfile.Schema:
    """The payload file holds exactly the declared payloads, each a ``[samples, tokens]`` tensor named
    after it, of its declared dtype."""
    return tensorfile.Schema("bundle payload file", {name: (dtype, 2) for name, dtype in dtypes.items()})


def check_redaction(policy: object) -> dict[str, str]:
    """The redaction policy: text is hashed, truncated or dropped; token ids kept or dropped."""
    if not isinstance(policy, dict):
        raise IntegrityError("redaction policy must be an object", where=f"{MANIFEST}: redaction")
    expected = set(TEXT_FIELDS) | set(ID_FIELDS) | set(FIXED_DROPS)
    if set(policy) != expected:
        raise IntegrityError(f"redaction policy must name exactly {sorted(expected)}; "
                             f"found {sorted(policy)}", where=f"{MANIFEST}: redaction")
    for key, value in policy.items():
        ok = (value in ("hash", "drop") or (isinstance(value, str) and re.fullmatch(r"truncate:[1-9]\d{0,3}",
                                                                                   value)))
        if key in ID_FIELDS:
            ok = value in ("keep", "drop")
        elif key in FIXED_DROPS:
            ok = value == "drop"
        if not ok:
            raise IntegrityError(f"redaction of {key!r} cannot be {value!r}",
                                 where=f"{MANIFEST}: redaction",
                                 hint="text: hash | truncate:N | drop; token ids: keep | drop; "
                                      "paths, endpoints, environment and secrets: drop")
    return dict(policy)


def check_config(cfg: object) -> dict[str, Any]:
    """The recompute config; an unsupported topology is a contract error, never guessed around."""
    where = f"{INDEX}: config"
    if not isinstance(cfg, dict):
        raise IntegrityError("config must be an object", where=where)
    missing = sorted(set(CONFIG_KEYS) - set(cfg))
    unknown = sorted(set(cfg) - set(CONFIG_KEYS))
    if missing or unknown:
        raise IntegrityError(f"config keys: missing {missing}, unknown {unknown}", where=where)
    for key, typ in CONFIG_KEYS.items():
        v = cfg[key]
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            continue
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise IntegrityError(f"config.{key} has the wrong type ({type(v).__name__})", where=where)
    if cfg["estimator"] not in ESTIMATORS:
        raise ContractError(f"unsupported topology: estimator {cfg['estimator']!r}; bundles support "
                            f"{list(ESTIMATORS)} only", where=f"{where}.estimator",
                            hint="PPO value loss, GAE and other estimators are not recomputed")
    if cfg["context_parallel"] != 1:
        raise ContractError(f"unsupported topology: context_parallel={cfg['context_parallel']}; "
                            "only 1 is supported", where=f"{where}.context_parallel")
    if cfg["kl_kind"] not in KL_KINDS:
        raise ContractError(f"unsupported KL estimator {cfg['kl_kind']!r}", where=f"{where}.kl_kind")
    if cfg["loss_agg"] not in LOSS_AGGS:
        raise ContractError(f"unsupported loss aggregation {cfg['loss_agg']!r}", where=f"{where}.loss_agg")
    for key, typ in CONFIG_KEYS.items():
        if typ is float and not math.isfinite(cfg[key]):
            raise IntegrityError(f"config.{key} must be a finite number, found {cfg[key]!r}", where=f"{where}.{key}",
                                 hint="fix the producer's config and capture again")
    if cfg["samples_per_prompt"] < 1:
        raise IntegrityError(f"config.samples_per_prompt must be an integer >= 1, found {cfg['samples_per_prompt']}",
                             where=f"{where}.samples_per_prompt", hint="record the trainer's group size")
    if cfg["estimator"] == "rloo" and cfg["samples_per_prompt"] < 2:
        raise IntegrityError("config.samples_per_prompt must be >= 2 for estimator 'rloo' (its baseline is the "
                             f"mean of the other samples), found {cfg['samples_per_prompt']}",
                             where=f"{where}.samples_per_prompt", hint="record the trainer's group size")
    for key in NON_NEGATIVE:  # clip_low, clip_high >= 0 keep the ratio bounds in order: 1 - low <= 1 <= 1 + high
        if cfg[key] < 0:
            low, high = 1 - cfg["clip_low"], 1 + cfg["clip_high"]
            order = (f" (the ratio clip bounds [1 - clip_low, 1 + clip_high] = [{low!r}, {high!r}] are out of order)"
                     if key in ("clip_low", "clip_high") and low > high else "")
            raise IntegrityError(f"config.{key} must be >= 0, found {cfg[key]!r}{order}", where=f"{where}.{key}",
                                 hint=f"the trainer refuses a negative algorithm.{_TRAINER_KEYS.get(key, key)}; "
                                      "record the producer's real value (capture again)")
    task = cfg["task"]
    if task is not None and (not isinstance(task, dict) or set(task) != {"name", "max_operand"}
                             or task["name"] not in TASKS or not isinstance(task["max_operand"], int)
                             or isinstance(task["max_operand"], bool)):
        raise ContractError(f"config.task must be null or {{name: one of {list(TASKS)}, max_operand: int}}",
                            where=f"{where}.task")
    if task is not None and task["max_operand"] < 1:
        raise IntegrityError(f"config.task.max_operand must be an integer >= 1, found {task['max_operand']}",
                             where=f"{where}.task.max_operand",
                             hint="the trainer refuses environment.max_operand < 1; record the trainer's value")
    if cfg["tokenizer"] not in (None, "byte"):
        raise ContractError(f"tokenizer {cfg['tokenizer']!r} cannot be rebuilt offline; only 'byte' can",
                            where=f"{where}.tokenizer", hint="declare reward.raw recorded-only")
    return dict(cfg)


def check_sample(rec: object, i: int, redaction: dict[str, str]) -> dict[str, Any]:
    """One per-sample record: identity, lengths, physical provenance, redacted text only.

    Runs once per sample on every write and read, so messages are built only when a check fails."""
    where = f"{INDEX}: samples[{i}]" if not isinstance(rec, dict) or not SAMPLE_KEYS.issuperset(rec) else ""
    if not isinstance(rec, dict):
        raise IntegrityError("sample record must be an object", where=where)
    if where:
        raise IntegrityError(f"unknown sample field(s) {sorted(set(rec) - SAMPLE_KEYS)} (raw text is never stored)",
                             where=where)
    for key in _SAMPLE_IDS:
        if key not in rec:
            raise IntegrityError(f"sample field {key!r} is missing" + (
                " (use null when membership is unknown)" if key == "group" else ""), where=f"{INDEX}: samples[{i}]")
        v = rec[key]
        if not (isinstance(v, str) and _ID.fullmatch(v)) and not (v is None and key == "group"):
            check_id(v, f"samples[{i}].{key}")
    for key in ("prompt_length", "response_length", "rank", "weight_version"):
        v = rec.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise IntegrityError(f"sample field {key!r} must be an integer >= 0, found {v!r}",
                                 where=f"{INDEX}: samples[{i}]")
    ll = rec.get("label_length")
    if ll is not None and (not isinstance(ll, int) or isinstance(ll, bool) or ll < 0):
        raise IntegrityError(f"label_length must be null or an integer >= 0, found {ll!r}",
                             where=f"{INDEX}: samples[{i}]")
    for field in TEXT_FIELDS:
        policy = redaction[field]
        sha_key, prefix_key = _TEXT_KEYS[field]
        has_hash, has_prefix = sha_key in rec, prefix_key in rec
        if has_hash != (policy == "hash") or has_prefix != policy.startswith("truncate:"):
            raise IntegrityError(f"{field} text does not follow the redaction policy {policy!r}",
                                 where=f"{INDEX}: samples[{i}]")
        if has_hash and not is_sha256_hex(rec[sha_key]):
            raise IntegrityError(f"{field}_sha256 is not a SHA-256 digest", where=f"{INDEX}: samples[{i}]")
        if has_prefix:
            limit = int(policy.split(":")[1])
            prefix = rec[prefix_key]
            if not isinstance(prefix, str) or len(prefix) > limit:
                raise IntegrityError(f"{field}_prefix is longer than the policy's {limit} characters",
                                     where=f"{INDEX}: samples[{i}]")
    return dict(rec)


def check_contract(stage: str, contract: object, kind: str) -> dict[str, Any]:
    where = f"{MANIFEST}: stages.{stage}"
    if not isinstance(contract, dict) or set(contract) != {"version", "capability", "implementation",
                                                          "reason"}:
        raise IntegrityError("stage contract must have exactly version, capability, implementation, "
                             "reason", where=where)
    if contract["version"] != STAGE_VERSION:
        raise ContractError(f"stage version {contract['version']!r} is not supported (this reader: "
                            f"{STAGE_VERSION})", where=where)
    if contract["capability"] not in CAPABILITIES:
        raise IntegrityError(f"capability must be one of {list(CAPABILITIES)}", where=where)
    if stage == "sample" and contract["capability"] == "recompute":
        raise ContractError("the sample stage cannot be recomputed offline (it needs the model)", where=where)
    if not isinstance(contract["reason"], str):
        raise IntegrityError("reason must be a string", where=where)
    return dict(contract)


def parse_step(text: str) -> tuple[int, int]:
    """``R:S`` -> (rollout_id, step_id)."""
    m = re.fullmatch(r"(\d{1,12}):(\d{1,12})", text.strip())
    if not m:
        raise ContractError(f"actor step {text!r} must be ROLLOUT_ID:STEP_ID (two integers)")
    return int(m.group(1)), int(m.group(2))


def bundle_name(kind: str, rollout_id: int, step_id: int | None) -> str:
    """Directory name of a captured bundle: ``rollout-000012``, ``step-000012-000000`` or
    ``update-000012-000000``."""
    return f"rollout-{rollout_id:06d}" if kind == "rollout" else f"{kind}-{rollout_id:06d}-{step_id or 0:06d}"


def recorded_upstream(kind: str, stage: str, payload: str) -> str | None:
    """The earlier stage of a ``kind`` bundle whose recorded output ``payload`` is, or None.

    In an ``update`` bundle the policy loss consumes the advantages ``advantage.estimate`` recorded:
    one payload, an expected output of one stage and an input of a later one."""
    stages = KIND_STAGES[kind]
    for earlier in stages[: stages.index(stage)]:
        if OUTPUTS[earlier].get(payload) == "token":
            return earlier
    return None
