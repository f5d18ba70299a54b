"""Admission of a replay, and ``replayjob explain``: every check, no model, no device.

:func:`admit` verifies, in order and collecting every reason rather than stopping at the first:
the runner settings; both external pins; the manifest bytes against their pin (before parsing);
the payload bytes against the manifest (before deserialising), its ragged structure and finite
rows; the logical and effective row digests; the resume adapter's weight-file SHA-256; the
optimizer contract; and the config differences against the declared, registered systems-only
knobs (stale declarations included).  A check whose input failed an earlier check is skipped.

Replay calls the same function and refuses unless it admits.  ``explain`` prints the result and
what a replay would do; it never imports transformers or peft and never touches a device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from replayjob.artifacts import capture_payload as payload
from replayjob.artifacts import capture_root as ranks
from replayjob.artifacts.capture_manifest import Manifest, PinnedManifest
from replayjob.artifacts.capture_payload import read_payload
from replayjob.artifacts.capture_reader import reuse
from replayjob.artifacts.metrics import EFFECTIVE, LOGICAL, SKIPPED
from replayjob.config import Config, from_dict, resolved
from replayjob.config.diff import differences
from replayjob.config.load import to_dict
from replayjob.config.schema import DistributedConfig, OptimizerBatchConfig
from replayjob.digest import normalize_digest
from replayjob.errors import ContractError, IntegrityError, RefusedError
from replayjob.model import moe
from replayjob.producers.builtin import rows as rankrows
from replayjob.producers.builtin import steps as stepcapture
from replayjob.producers.contract import contract_differences, contract_sha256, optimizer_contract
from replayjob.redact import redact_text
from replayjob.rl.batch import OptimizerBatch
from replayjob.rl.state import ResumeState, read_state
from replayjob.runtime import knobs

if TYPE_CHECKING:
    from torch import Tensor


@dataclass
class Refusals:
    """Reasons a replay is refused, collected rather than raised one by one (shared by every producer)."""

    reasons: list[str] = field(default_factory=list)
    integrity_failed: bool = False

    @property
    def admitted(self) -> bool:
        return not self.reasons

    def refuse(self, reason: str, *, integrity: bool = False) -> None:
        self.reasons.append(reason)
        self.integrity_failed = self.integrity_failed or integrity

    def raise_if_refused(self) -> None:
        self.raise_for("replay config")

    def raise_for(self, where: str) -> None:
        """Raise one refusal listing every reason (integrity first in the exit class), or return."""
        if self.reasons:
            cls = IntegrityError if self.integrity_failed else ContractError
            raise cls(f"replay refused ({len(self.reasons)} reason{'s' * (len(self.reasons) > 1)}):\n  - "
                      + "\n  - ".join(self.reasons), where=where,
                      hint="fix every listed reason; `replayjob explain CONFIG` re-checks without a model")


@dataclass
class Admission(Refusals):
    """The outcome of :func:`admit`: what was verified, what was found, and every refusal reason."""

    cfg: Config = field(default_factory=Config)
    keep_rows: bool = True  # False: verify streaming, holding no payload rows (explain)
    pins: dict[str, str] = field(default_factory=dict)
    given: PinnedManifest | None = None  # the manifest as a caller already verified it
    manifest: Manifest | None = None
    batch: OptimizerBatch | None = None
    rng: dict[str, Tensor] | None = None
    rank_rngs: list[dict[str, Tensor]] | None = None  # a capture over ranks: each captured rank's RNG state
    digests: tuple[str, str] | None = None  # (logical, effective) of the payload's rows, computed once
    rows: dict[str, int | float] | None = None  # the payload's row counts (payload.summary's keys)
    state: ResumeState | None = None
    allowed: list[str] = field(default_factory=list)
    observed: list[str] = field(default_factory=list)
    contract: dict[str, Any] | None = None

    def raise_if_refused(self) -> None:
        self.raise_for(self.cfg.optimizer_batch.replay_path or "optimizer_batch.replay_path")

    @property
    def arm(self) -> str:
        return redact_text(self.cfg.optimizer_batch.arm) or knobs.arm_name(self.allowed, resolved(self.cfg))

    def rng_for(self, rank: int) -> dict[str, Tensor]:
        """The RNG state rank ``rank`` restores: that captured rank's, else the capture's (rank 0's)."""
        if self.rank_rngs is not None and rank < len(self.rank_rngs):
            return self.rank_rngs[rank]
        assert self.rng is not None
        return self.rng

    def knob_values(self) -> dict[str, Any]:
        r = resolved(self.cfg)
        return {k: knobs.lookup(r, k) for k in sorted(self.allowed)}


def _check_runner(adm: Admission) -> None:
    t = adm.cfg.training
    if t.trainer != "optimizer_replay":
        adm.refuse(f"training.trainer must be 'optimizer_replay', found {t.trainer!r}")
    if t.max_steps != 1:
        adm.refuse(f"training.max_steps must be 1 (one update), found {t.max_steps}")
    if t.save_every != 0:
        adm.refuse(f"training.save_every must be 0, found {t.save_every}")
    if adm.cfg.optimizer_batch.capture:
        adm.refuse("optimizer_batch.capture must be false in a replay config")


def check_pins(ob: OptimizerBatchConfig, out: Refusals, pins: dict[str, str], manifest_name: str) -> None:
    """Both external pins, the manifest path, the arm name and the tolerance pin of ``[optimizer_batch]``."""
    for key in ("expected_logical_sha256", "expected_manifest_sha256"):
        raw = getattr(ob, key)
        if not raw:
            out.refuse(f"optimizer_batch.{key} is required (copy it from the source run's metrics.json)")
            continue
        try:
            pins[key] = normalize_digest(raw, what=f"optimizer_batch.{key}")
        except IntegrityError as exc:
            out.refuse(exc.message, integrity=True)
    if not ob.replay_path:
        out.refuse(f"optimizer_batch.replay_path is required (the source's {manifest_name})")
    if ob.arm == "source":  # the reducer reserves it for the capture run
        out.refuse("optimizer_batch.arm 'source' is reserved for the capture run; pick another name")
    for key in ("tolerances_sha256", "budgets_sha256", "mismatch_bound_sha256"):  # each must be a digest
        if getattr(ob, key):
            try:
                normalize_digest(getattr(ob, key), what=f"optimizer_batch.{key}")
            except IntegrityError as exc:
                out.refuse(exc.message, integrity=True)


def _check_pins(adm: Admission) -> None:
    check_pins(adm.cfg.optimizer_batch, adm, adm.pins, "optimizer_batch_step_000000.manifest.json")


def _check_artifacts(adm: Admission) -> None:
    ob = adm.cfg.optimizer_batch
    if "expected_manifest_sha256" not in adm.pins or not ob.replay_path:
        return
    try:
        m = reuse(adm.given, ob.replay_path, adm.pins["expected_manifest_sha256"])
        if not isinstance(m, Manifest):
            raise IntegrityError(f"the capture was written by {m.framework!r}, not the built-in trainer",
                                 where=m.path)
        adm.manifest = m
    except RefusedError as exc:
        adm.refuse(exc.diagnostics().replace("\n  fix:", "; fix:"), integrity=True)
        return
    pin = adm.pins.get("expected_logical_sha256")
    if pin is not None and pin != m.logical_sha256:
        adm.refuse(f"wrong logical pin: expected_logical_sha256 is {pin}, the manifest's logical batch is "
                   f"{m.logical_sha256}", integrity=True)
    if isinstance(m, ranks.RootManifest):
        _check_ranks(adm, m)
        return
    try:
        scan = read_payload(m, keep=adm.keep_rows, allow_nonfinite=stepcapture.nonfinite_admitted(m, adm.cfg))
    except IntegrityError as exc:
        adm.refuse(exc.message, integrity=True)
        return
    adm.batch, adm.rng, adm.rows = scan.batch, scan.rng, scan.rows
    if sorted(adm.rng) != sorted(m.doc["payload"]["rng_keys"]):
        adm.refuse(f"payload RNG states {sorted(adm.rng)} differ from the manifest's "
                   f"{m.doc['payload']['rng_keys']}", integrity=True)
    digests = scan.row_digests()
    assert digests is not None  # kept when the span hashes alone do not give them
    logical, effective = adm.digests = digests
    if logical != m.logical_sha256:
        adm.refuse(f"payload rows hash to {logical}, the manifest says {m.logical_sha256}", integrity=True)
    if effective != m.effective_sha256:
        adm.refuse(f"payload loss-bearing rows hash to {effective}, the manifest says {m.effective_sha256}",
                   integrity=True)


def _check_ranks(adm: Admission, m: ranks.RootManifest) -> None:
    """A capture over ranks: every rank verified and the logical batch rebuilt (:func:`rankrows.verify`; the rows
    are held, also for explain)."""
    try:
        v = rankrows.verify(m, allow_nonfinite=stepcapture.nonfinite_admitted(m, adm.cfg))
    except RefusedError as exc:
        adm.refuse(exc.diagnostics().replace("\n  fix:", "; fix:"), integrity=True)
        return
    adm.batch, adm.rank_rngs, adm.rng = v.batch, v.rngs, v.rngs[0]
    adm.rows, adm.digests = payload.summary(v.batch), v.digests


def _check_routing(adm: Admission) -> None:
    """A forced routing file (``model.routing = "forced"``): present, pinned, of this capture's rows and this
    model's routers (:func:`replayjob.model.moe.forced_file_reasons`), before any model is built."""
    b, m = adm.batch, adm.manifest
    per_row = None if b is None else (b.token_offsets[1:] - b.token_offsets[:-1]).tolist()
    n, t = (int(adm.rows["rows"]), int(adm.rows["tokens"])) if adm.rows else (None, None)
    for reason in moe.forced_file_reasons(adm.cfg, m.logical_sha256 if m is not None else None, per_row, n, t):
        adm.refuse(reason, integrity=True)


def _check_adapter(adm: Admission) -> None:
    src = adm.cfg.resume.from_
    if not src:
        adm.refuse("resume.from is required: the initialisation state the source started from")
        return
    try:
        st = adm.state = read_state(src)
    except RefusedError as exc:
        adm.refuse(exc.diagnostics().replace("\n  fix:", "; fix:"), integrity=True)
        return
    for reason in stepcapture.state_reasons(adm.manifest, st, adm.cfg):
        adm.refuse(reason)  # the start state a captured step pins (step -1 for a step-zero capture)
    if adm.manifest is not None and st.adapter_sha256 != adm.manifest.initial_adapter_sha256:
        adm.refuse(f"adapter hash mismatch: {st.adapter_file} has SHA-256 {st.adapter_sha256}, the source "
                   f"started from {adm.manifest.initial_adapter_sha256}")


def check_differences(out: Refusals, source: dict[str, Any], replay: dict[str, Any], allowed: list[str],
                      admissible: Mapping[str, str], ignored: Callable[[str], bool] = knobs.is_ignored) -> list[str]:
    """Compare two resolved configs against the declared differences; return the observed ones.

    Every declared key must be admissible (a registered systems-only knob, or a key in
    ``admissible``) and present; every observed difference must be declared.  ``admissible`` maps
    each admissible key to what it is (named in refusals).
    """
    observed = [k for k in differences(source, replay) if not ignored(k)]
    for key in allowed:
        if key not in admissible:
            out.refuse(f"declared difference {key!r} is not a registered systems-only knob (allowed: "
                       + ", ".join(sorted(admissible)) + ")")
        elif key not in observed:
            out.refuse(f"declared difference {key!r} is not present: source and replay agree on it "
                       "(a stale allowlist; remove it or change the value)")
    for key in observed:
        if key not in allowed:
            kind = admissible.get(key, "key that may change the math")
            out.refuse(f"undeclared difference {key!r} ({kind}): source "
                       f"{knobs.lookup(source, key)!r}, replay {knobs.lookup(replay, key)!r}")
    return observed


def check_contract(out: Refusals, source: dict[str, Any], source_sha: str, replay: dict[str, Any]) -> None:
    """The replay's optimizer contract must equal the source's exactly."""
    diff = contract_differences(source, replay)
    if diff:
        out.refuse("optimizer contract differs from the source's at " + ", ".join(diff)
                   + f" (source {source_sha}, replay {contract_sha256(replay)})")


def source_config(m: Manifest) -> dict[str, Any]:
    """The source's resolved config as the manifest records it, read as what the capture ran.

    A capture from before ``[distributed]`` existed ran on one process, so that section reads as the
    defaults with ``world_size = 1``.  One from before the sampler's truncation and dtype settings
    sampled without truncation in the model's dtype (``top_p = 1``, ``top_k = 0``, ``sampling_dtype =
    "model"``), and its trainer applied no temperature to its logprobs: ``algorithm.logprob_temperature``
    reads ``"none"``, or ``"sampling"`` at temperature 1, where the two are the same computation.
    """
    out = dict(m.config)
    if "distributed" not in out:
        out["distributed"] = to_dict(DistributedConfig(world_size=1))
    inference = out.get("inference")
    if isinstance(inference, dict) and "sampling_dtype" not in inference:
        out["inference"] = {**inference, "top_p": 1.0, "top_k": 0, "sampling_dtype": "model"}
    algorithm = out.get("algorithm")
    if isinstance(algorithm, dict) and "logprob_temperature" not in algorithm:
        at_one = isinstance(inference, dict) and inference.get("temperature") == 1.0
        out["algorithm"] = {**algorithm, "logprob_temperature": "sampling" if at_one else "none"}
    return out


def _check_contract_and_config(adm: Admission) -> None:
    try:
        adm.contract = optimizer_contract(adm.cfg)
    except RefusedError as exc:
        adm.refuse(exc.diagnostics())
        return
    m = adm.manifest
    adm.allowed = sorted(set(adm.cfg.optimizer_batch.allow_config_differences))
    if m is None:
        return
    check_contract(adm, m.contract, m.doc["contract"]["sha256"], adm.contract)
    registered = knobs.knobs_for(knobs.BUILTIN)
    admissible = {k: "systems-only knob" for k in registered}
    adm.observed = check_differences(adm, source_config(m), resolved(adm.cfg), adm.allowed, admissible)
    declared_knobs = [k for k in adm.allowed if k in registered and k in adm.observed]
    if declared_knobs:
        try:
            source_cfg = from_dict(source_config(m))
        except RefusedError as exc:
            adm.refuse(f"the source config in the manifest cannot be read back: {exc.diagnostics()}")
            return
        for key in declared_knobs:
            why = registered[key].refusal(source_cfg, adm.cfg)
            if why:
                adm.refuse(f"difference {key!r} is not systems-only here: {why}")


def admit(cfg: Config, keep_rows: bool = True, manifest: PinnedManifest | None = None) -> Admission:
    """Run every admission check on a replay config; never raises for a failed check.

    With ``keep_rows`` the admitted rows are kept (``batch``, for a replay); without, the payload is
    verified streaming and memory stays bounded (``explain``).  ``manifest``: the capture's manifest as the
    caller already verified it (:func:`replayjob.artifacts.capture_reader.producer_of`), used when it is the one
    the config pins, so its bytes are read once.  ``cfg`` is resolved once, at the entry point
    (:func:`replayjob.runtime.distributed.observe`: the world size this process runs, or the one a replay would have).
    """

    adm = Admission(cfg=cfg, keep_rows=keep_rows, given=manifest)
    _check_runner(adm)
    _check_pins(adm)
    _check_artifacts(adm)
    _check_routing(adm)
    _check_adapter(adm)
    _check_contract_and_config(adm)
    return adm


def report(adm: Admission) -> dict[str, Any]:
    """What was verified and what a replay would do (the ``--json`` output)."""
    m = adm.manifest
    out: dict[str, Any] = {
        "admitted": adm.admitted,
        "reasons": list(adm.reasons),
        "pins": dict(adm.pins),
        "manifest": {"path": str(m.path), "sha256": m.sha256} if m else None,
        "payload": ({"path": str(m.payload_path), "size": m.payload_size, "spans_sha256": m.payload_digest}
                    if m else None),
        "rows": adm.rows,
        "distributed": ({**m.doc["distributed"], "ranks": [{"rank": e["rank"], "rows": e["rows"]} for e in m.ranks]}
                        if isinstance(m, ranks.RootManifest) else None),  # a capture over ranks
        LOGICAL: adm.digests[0] if adm.digests is not None else None,
        EFFECTIVE: adm.digests[1] if adm.digests is not None else None,
        "initial_adapter": ({"path": str(adm.state.adapter_file), "sha256": adm.state.adapter_sha256}
                            if adm.state else None),
        "contract_sha256": contract_sha256(adm.contract) if adm.contract is not None else None,
        "allowed_config_differences": list(adm.allowed),
        "observed_config_differences": list(adm.observed),
        "knobs": adm.knob_values(),
        "arm": adm.arm,
        "rng_states": sorted(adm.rng) if adm.rng is not None else None,
        "world_size": adm.cfg.distributed.world_size,  # as a replay would have it (declared, else 1)
        "skipped": list(SKIPPED),
        "would": [
            f"establish determinism (strict={adm.cfg.backend.options.strict_deterministic})",
            f"build backend {adm.cfg.backend.name!r} on {adm.cfg.backend.torch_device}",
            "load the pinned initial adapter",
            "restore the captured Torch RNG states " + ", ".join(sorted(adm.rng or {})),
            f"one optimizer update on the captured rows (micro_batch_size="
            f"{adm.cfg.training.micro_batch_size}, gradient_checkpointing="
            f"{str(adm.cfg.backend.options.gradient_checkpointing).lower()})",
            "save final_adapter/ and replay_metrics.json",
        ],
    }
    return out


def render(rep: dict[str, Any]) -> str:
    """The human-readable form of :func:`report`."""
    lines = [f"replay {'ADMITTED' if rep['admitted'] else 'REFUSED'} (arm {rep['arm']})"]
    for reason in rep["reasons"]:
        lines.append(f"  refused: {reason}")
    for k, v in rep["pins"].items():
        lines.append(f"  pin {k}: {v}")
    if rep["manifest"]:
        lines.append(f"  manifest: {rep['manifest']['path']} ({rep['manifest']['sha256']})")
    if rep["rows"]:
        r = rep["rows"]
        lines.append(f"  rows: {r['rows']}, tokens: {r['tokens']}, response tokens: {r['response_tokens']}, "
                     f"loss-bearing: {r['loss_bearing_tokens']}")
    if rep.get("distributed"):  # a capture over ranks
        d = rep["distributed"]
        lines.append(f"  captured on {d['world_size']} ranks ({d['strategy']}, {d['sharding']} rows: "
                     + ", ".join(f"rank {e['rank']} [{e['rows'][0]}, {e['rows'][1]})" for e in d["ranks"])
                     + f"); replayed on {rep['world_size']} rank(s)")
    if rep.get("micro_batches"):  # an external trainer's capture (integrations.admission.report)
        mb = rep["micro_batches"]
        lines.append(f"  {rep.get('framework')} step {rep['manifest']['step']}: {mb['micro_batches']} micro-batch(es), "
                     f"{mb['tensors']} input tensors, {mb['bytes']} bytes")
    lines.append("  allowed differences: " + (", ".join(rep["allowed_config_differences"]) or "none"))
    lines.append("  observed differences: " + (", ".join(rep["observed_config_differences"]) or "none"))
    lines.append("  skipped: " + ", ".join(rep["skipped"]))
    if rep["admitted"]:
        lines.append("  a replay would:")
        lines.extend(f"    - {step}" for step in rep["would"])
    return "\n".join(lines)
