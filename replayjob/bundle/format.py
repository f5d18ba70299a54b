"""The trajectory-bundle format: names, stage table, capability matrix and what the bundle layer adds to the
documents' declarations.

A bundle is a directory of three files: ``payloads.safetensors`` (every tensor of the bundle, named
after its payload), ``manifest.json`` (identity, samples, config, expected outputs, and the SHA-256
of the payload file's header and of each tensor's bytes) and ``COMPLETE`` (last).  The documents are
declared in :mod:`replayjob.artifacts.bundle` (with the names and versions they share, re-exported
here); this module holds the rest of what the writer and the reader must agree on (the stages'
inputs, the defaults, the topologies this replayjob recomputes), so the two cannot drift apart;
``docs/bundle-format.md`` describes it for people.  Every check raises
:class:`~replayjob.errors.IntegrityError` (or ``ContractError`` for an unsupported topology) with a
sentence naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from replayjob import tensorfile
from replayjob.artifacts.bundle import (
    COMPLETE,
    DTYPES,
    FIXED_DROPS,
    FORMAT,
    FORMAT_VERSION,
    ID_FIELDS,
    IDENTIFIER,
    INTEGER_DTYPES,
    KIND_STAGES,
    KIND_VERSIONS,
    KINDS,
    MANIFEST,
    MULTI_RANK_VERSION,
    OUTPUTS,
    PAYLOAD_FILE,
    PAYLOAD_NAME,
    STAGE_ORDER,
    STAGE_VERSION,
    STEP_KINDS,
    TEXT_FIELDS,
    RecomputeConfig,
    Redaction,
    bundle_version,
    check_version,
    kind_version_problem,
    reads_version,
    version_error,
)
from replayjob.declaration import decode, to_builtins
from replayjob.errors import ContractError, IntegrityError
from replayjob.rl.stages import ESTIMATORS

# The names the bundle's documents and their declarations share (replayjob.artifacts.bundle), for the bundle
# layer's modules, which read them from here.
__all__ = ["COMPLETE", "DTYPES", "FIXED_DROPS", "FORMAT", "FORMAT_VERSION", "ID_FIELDS", "INTEGER_DTYPES", "KINDS",
           "KIND_STAGES", "KIND_VERSIONS", "MANIFEST", "MULTI_RANK_VERSION", "OUTPUTS", "PAYLOAD_FILE", "STAGE_ORDER",
           "STAGE_VERSION", "STEP_KINDS", "TEXT_FIELDS", "bundle_version", "check_version", "kind_version_problem",
           "reads_version", "version_error"]

INDEX = f"{MANIFEST}: index"  # the manifest's sections, as places named in messages
EXPECTED = f"{MANIFEST}: expected"
# Top-level entries of a format 1.x bundle (one payload file per tensor, separate documents): a
# bundle holding any of them is refused by version (:func:`version_error`), never half-read.
V1_ENTRIES = ("index.json", "expected.json", "payloads")
# Suffixes of formats that can carry pickle (or arbitrary code); refused anywhere in a bundle.
PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt", ".npy", ".npz", ".joblib")

ROLLOUT_KINDS = tuple(k for k, s in KIND_STAGES.items() if "advantage.estimate" in s)  # a rollout's stages
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

DEFAULT_REDACTION: dict[str, str] = {"prompt": "hash", "completion": "hash", "label": "hash",
                                     "response_ids": "keep", "label_ids": "keep",
                                     **{k: "drop" for k in FIXED_DROPS}}

KL_KINDS = ("k1", "k3")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean")
_ID = re.compile(IDENTIFIER)


def check_payload_name(name: object) -> str:
    """A payload name the writer is given is a short lowercase identifier (a tensor name in the payload file)."""
    if not isinstance(name, str) or not PAYLOAD_NAME.fullmatch(name):
        raise IntegrityError(f"payload name {name!r} is not allowed: use [a-z][a-z0-9_]* (at most 64 characters)")
    return name


def check_run_id(value: object, where: object = None) -> str:
    """The id of the run a rank of a multi-rank bundle belongs to: a short identifier, chosen once per run."""
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise IntegrityError(f"run_id must be a short identifier ([A-Za-z0-9][A-Za-z0-9._:-]*, at most 128 "
                             f"characters), found {value!r}", where=str(where) if where is not None else None,
                             hint="pass the one id of the run every rank writes (replayjob.bundle.writer."
                                  "shared_run_id)")
    return value


def run_mix(run_ids: Mapping[int, object]) -> str:
    """The refusal of ranks that do not carry one run id (``rank -> run id``, None: none recorded)."""
    first = next(iter(run_ids.items()))
    other = next(((r, v) for r, v in run_ids.items() if v != first[1]), first)
    if first[1] is None or other[1] is None:
        r = first[0] if first[1] is None else other[0]
        return (f"rank {r} records no run id (written before bundle format {MULTI_RANK_VERSION}): it cannot be "
                "shown to belong to the same run as the other ranks")
    return (f"the ranks come from different runs: rank {first[0]} carries run id {first[1]!r}, rank {other[0]} "
            f"carries run id {other[1]!r}; a multi-rank bundle is one run's ranks")


def payload_where(name: str) -> str:
    """Where a payload lives, as messages name it: ``payloads.safetensors: <name>``."""
    return f"{PAYLOAD_FILE}: {name}"


def payload_schema(dtypes: dict[str, str]) -> tensorfile.Schema:
    """The payload file holds exactly the declared payloads, each a ``[samples, tokens]`` tensor named
    after it, of its declared dtype, and no ``__metadata__`` (the writer writes none: a metadata block is
    content nothing declares, pinned only by a digest whoever added it could recompute)."""
    return tensorfile.Schema("bundle payload file", {name: (dtype, 2) for name, dtype in dtypes.items()},
                             metadata={})


def decode_redaction(policy: object) -> dict[str, str]:
    """A redaction policy (``BundleWriter(redaction=...)``), as the manifest declares it (:class:`Redaction`)."""
    return {k: str(v) for k, v in to_builtins(decode(policy, Redaction, where="redaction",
                                                      hint="text: hash | truncate:N | drop; token ids: keep | drop; "
                                                           "paths, endpoints, environment and secrets: drop")).items()}


def decode_config(cfg: object, where: str = f"{INDEX}: config") -> dict[str, Any]:
    """A recompute config as the index declares it (:class:`RecomputeConfig`), then :func:`check_supported`."""
    out = to_builtins(decode(cfg, RecomputeConfig, where=where,
                             hint="fix the producer's config (the trainer's own ranges) and capture again"))
    check_supported(out)
    return out


def check_supported(cfg: dict[str, Any]) -> None:
    """The recompute config names what this replayjob recomputes with; an unsupported topology is a contract
    error (exit 2), never guessed around.  ``cfg`` was read through :class:`RecomputeConfig`."""
    where = f"{INDEX}: config"
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
    if cfg["tokenizer"] not in (None, "byte"):
        raise ContractError(f"tokenizer {cfg['tokenizer']!r} cannot be rebuilt offline; only 'byte' can",
                            where=f"{where}.tokenizer", hint="declare reward.raw recorded-only")


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
