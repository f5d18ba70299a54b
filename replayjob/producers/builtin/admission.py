"""The built-in trainer's part of the one admission (:mod:`replayjob.producers.admission`), and its report.

Its kind of capture holds the optimizer batch's rows and the Torch RNG state (one payload, or one per rank
under a root), and starts from a resume state.  :data:`KIND` checks, in the one order: the runner settings
(``optimizer_replay``, one step, no save, no capture); the payload bytes against the manifest (before
deserialising), its ragged structure and finite rows (a captured step's ``state.nonfinite_inputs`` recomputed
from them), the logical and effective row digests, every rank of a capture over ranks; a captured step's start
state directory next to its manifest (present, no link in it); the resume adapter's weight-file SHA-256 and size
and the start state a captured step pins;
the resume state's base model against the one the config builds (the built-in backend's); a forced routing
file; the optimizer contract and the config differences against the declared, registered systems-only knobs
(stale declarations included).  It never imports transformers or peft and never touches a device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from replayjob.artifacts import capture_payload as payload
from replayjob.artifacts import capture_root as ranks
from replayjob.artifacts.capture_manifest import Manifest, PinnedManifest
from replayjob.artifacts.capture_payload import read_payload
from replayjob.artifacts.metrics import EFFECTIVE, LOGICAL, SKIPPED
from replayjob.config import Config, from_dict, resolved
from replayjob.config.load import to_dict
from replayjob.config.schema import DistributedConfig, OptimizerBatchConfig
from replayjob.errors import IntegrityError, RefusedError
from replayjob.fsio import check_no_symlinks
from replayjob.model import moe
from replayjob.model.backend import load_backend
from replayjob.producers import admission as shared
from replayjob.producers.admission import check_contract, check_differences
from replayjob.producers.builtin import ranks as rankrows
from replayjob.producers.builtin import steps as stepcapture
from replayjob.producers.contract import contract_sha256, optimizer_contract
from replayjob.redact import redact_text
from replayjob.rl.batch import OptimizerBatch
from replayjob.rl.state import ResumeState, check_model, read_state
from replayjob.runtime import knobs

if TYPE_CHECKING:
    from torch import Tensor


@dataclass
class Admission(shared.Admission):
    """The outcome of :func:`admit`: what was verified, what was found, and every refusal reason."""

    cfg: Config = field(default_factory=Config)
    keep_rows: bool = True  # False: verify streaming, holding no payload rows (explain)
    manifest: Manifest | None = None
    batch: OptimizerBatch | None = None
    rng: dict[str, Tensor] | None = None
    rank_rngs: list[dict[str, Tensor]] | None = None  # a capture over ranks: each captured rank's RNG state
    digests: tuple[str, str] | None = None  # (logical, effective) of the payload's rows, computed once
    rows: dict[str, int | float] | None = None  # the payload's row counts (payload.summary's keys)
    top_token: int | None = None  # the rows' largest token id
    state: ResumeState | None = None

    def optimizer_batch(self) -> OptimizerBatchConfig:
        return self.cfg.optimizer_batch

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


def _check_payload(adm: Admission) -> None:
    m = adm.manifest
    assert m is not None
    if isinstance(m, ranks.RootManifest):
        _check_ranks(adm, m)
        return
    scan = _read_checking_nonfinite(adm, m)
    if scan is None:
        return
    adm.batch, adm.rng, adm.rows, adm.top_token = scan.batch, scan.rng, scan.rows, scan.top_token
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


def _read_checking_nonfinite(adm: Admission, m: Manifest) -> payload.Scanned | None:
    """The payload read and verified, its non-finite flag recomputed from its rows (``None``: refused).

    A chosen-step capture's ``state.nonfinite_inputs`` says whether its rows hold NaN/Inf: its payload is read
    admitting them (in the logprobs and advantages, never the loss weights), and the scan says whether they are
    there.  A flag that differs from the rows either way is refused; flagged rows replay only under
    ``optimizer_batch.allow_nonfinite_inputs``.  A step-zero capture (no ``state``) never holds them."""
    try:
        scan = read_payload(m, keep=adm.keep_rows, allow_nonfinite=m.state is not None)
    except IntegrityError as exc:
        adm.refuse(exc.message, integrity=True)
        return None
    flagged = m.state is not None and bool(m.state["nonfinite_inputs"])
    found = scan.nonfinite
    if found is not None and not flagged:
        adm.refuse(f"{m.path}: field `state.nonfinite_inputs` is false, but the payload's rows hold non-finite "
                   f"values ({found}); recapture the step (the flag is recomputed from the rows)", integrity=True)
        return None
    if found is None and flagged:
        adm.refuse(f"{m.path}: field `state.nonfinite_inputs` is true, but the payload's rows hold no non-finite "
                   f"value (recomputed from {m.payload_path.name}); the flag was edited: recapture the step or use "
                   "its unedited manifest", integrity=True)
    elif found is not None and not adm.cfg.optimizer_batch.allow_nonfinite_inputs:
        adm.refuse(f"the capture's rows hold non-finite values (flagged nonfinite_inputs in the manifest's `state`; "
                   f"{found}); replay them only with optimizer_batch.allow_nonfinite_inputs = true")
        return None
    return scan


def _check_world(adm: Admission) -> None:
    """The captured logical batch bears some loss (a rank's shard of it may bear none), and the replay's world size
    fits the captured rows: every rank replays a contiguous shard of at least one row
    (:func:`replayjob.runtime.distributed.shard_bounds`, which the replay would refuse it with once launched)."""
    if adm.rows is not None and not adm.rows["loss_bearing_tokens"]:
        adm.refuse("the captured batch bears no loss: every loss weight is 0 (rows.loss_bearing_tokens, recomputed "
                   "from the payload), which no source step holds; its update changes nothing, so every arm's replay "
                   "would equal every other's; fix: recapture the source step", integrity=True)
    world = adm.cfg.distributed.world_size
    if adm.rows is not None and world is not None and world > int(adm.rows["rows"]):
        adm.refuse(f"{int(adm.rows['rows'])} logical rows cannot be split over {world} ranks (each needs at least "
                   "one; distributed.world_size); fix: launch fewer ranks or capture a larger batch")


def _check_ranks(adm: Admission, m: ranks.RootManifest) -> None:
    """A capture over ranks: every rank verified and the logical batch rebuilt (:func:`rankrows.verify`; the rows
    are held, also for explain)."""
    try:
        v = rankrows.verify(m)  # step zero: rows holding NaN/Inf are never admitted
    except RefusedError as exc:
        adm.refuse(exc.diagnostics().replace("\n  fix:", "; fix:"), integrity=True)
        return
    adm.batch, adm.rank_rngs, adm.rng = v.batch, v.rngs, v.rngs[0]
    adm.rows, adm.digests = payload.summary(v.batch), v.digests
    adm.top_token = int(v.batch.tokens.max())


def _check_routing(adm: Admission) -> None:
    """A forced routing file (``model.routing = "forced"``): present, pinned, of this capture's rows and this
    model's routers (:func:`replayjob.model.moe.forced_file_reasons`), before any model is built."""
    b, m = adm.batch, adm.manifest
    shared.check_routing_settings(adm.cfg.model.routing, adm.cfg.optimizer_batch, adm)
    per_row = None if b is None else (b.token_offsets[1:] - b.token_offsets[:-1]).tolist()
    n, t = (int(adm.rows["rows"]), int(adm.rows["tokens"])) if adm.rows else (None, None)
    for reason in moe.forced_file_reasons(adm.cfg, m.logical_sha256 if m is not None else None, per_row, n, t):
        adm.refuse(reason, integrity=True)


def _check_state_dir(adm: Admission) -> None:
    """A chosen-step or ring-buffer capture keeps its start state next to its manifest, in the directory its step
    names (``state.dir``, :func:`replayjob.artifacts.capture_manifest.state_dir_name`, checked by the manifest's
    reader): it must be there, a directory, and neither it nor a file in it a symbolic link, device, FIFO or
    socket (:func:`replayjob.fsio.check_no_symlinks`), whether or not ``resume.from`` reads it (the config loader
    resolves that path, links and all)."""
    m = adm.manifest
    if m is None or isinstance(m, ranks.RootManifest) or m.state is None:
        return
    d = m.path.parent
    sdir = d / str(m.state["dir"])
    what = f"step {m.step}'s start state (manifest field `state.dir`)"
    try:
        check_no_symlinks(d, sdir, what=what)
        if not sdir.is_dir():
            raise IntegrityError(f"{what} is missing: a captured step keeps it next to its manifest", where=sdir,
                                 hint="copy the whole capture directory, state included")
        for name in sorted(os.listdir(sdir)):
            check_no_symlinks(d, sdir / name, what=what)
    except IntegrityError as exc:
        adm.refuse(exc.diagnostics().replace("\n  fix:", "; fix:"), integrity=True)
    except OSError as exc:
        adm.refuse(f"{sdir}: cannot list {what}: {exc.strerror}", integrity=True)


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
    m = adm.manifest
    if m is None:
        return
    if st.adapter_sha256 != m.initial_adapter_sha256:
        adm.refuse(f"adapter hash mismatch: {st.adapter_file} has SHA-256 {st.adapter_sha256}, the source "
                   f"started from {m.initial_adapter_sha256}")
        return
    try:  # the file the pin matched: its size is the one the manifest records beside the pin
        size = st.adapter_file.stat().st_size
    except OSError as exc:
        adm.refuse(f"{st.adapter_file}: cannot read the initial adapter: {exc.strerror}", integrity=True)
        return
    if size != m.initial_adapter_size:
        adm.refuse(f"{m.path}: initial_adapter.size is {m.initial_adapter_size}, but the adapter its sha256 pins "
                   f"({st.adapter_file}) is {size} bytes (a contradictory manifest; recapture the source step)",
                   integrity=True)


def _check_model_reference(adm: Admission) -> None:
    """The captured token ids against the vocabulary of the model this config builds (the backend's ``vocab_size``,
    where it tells it from the config alone), the resume state's adapter layout against the adapter this config
    attaches (the backend's
    ``adapter_reasons``: for ``hf``, LoRA weights of the target modules, of the model's dtype and rank ``lora.r``),
    and its ``model`` against the base model this config builds: the comparison the replay makes
    once the model is built (:func:`replayjob.rl.state.check_model`), made here from the config alone by a backend
    that can tell its model's reference without building it (``model_reference``, :class:`replayjob.model.backend.
    Backend`; the built-in ``hf`` one can); another backend's is known only once it builds its model, so the
    replay alone compares it."""
    if adm.state is None:
        return
    try:
        backend = load_backend(adm.cfg.backend.name)
    except RefusedError as exc:
        adm.refuse(exc.diagnostics().replace("\n  fix:", "; fix:"))
        return
    vocab = getattr(backend, "vocab_size", None)  # the captured token ids against the model's vocabulary
    size = vocab(adm.cfg) if vocab is not None else None
    if size is not None and adm.top_token is not None and adm.top_token >= size and adm.manifest is not None:
        adm.refuse(f"{adm.manifest.payload_path}: captured token id {adm.top_token} is outside this model's "
                   f"vocabulary ({size}); fix: replay with the [model] section the source ran with", integrity=True)
    adapter = getattr(backend, "adapter_reasons", None)  # the pinned adapter against the one the config attaches
    reasons = adapter(adm.cfg, adm.state.adapter_layout) if adapter is not None else []
    if reasons:
        adm.refuse(f"{adm.state.adapter_file}: the adapter cannot load into the model this config builds: "
                   + "; ".join(reasons[:4]) + (f" (and {len(reasons) - 4} more)" if len(reasons) > 4 else "")
                   + "; fix: resume from the state the source started from, with its [model] and [lora] sections")
    reference = getattr(backend, "model_reference", None)
    if reference is None:
        return
    try:
        check_model(adm.state, reference(adm.cfg))
    except RefusedError as exc:
        adm.refuse(exc.diagnostics().replace("\n  fix:", "; fix:"))
    except OSError as exc:
        adm.refuse(f"{adm.cfg.model.path}: cannot read the base model's config.json: {exc.strerror}")


def source_config(m: Manifest) -> dict[str, Any]:
    """The source's resolved config as the manifest records it, read as what the capture ran.

    A capture from before ``[distributed]`` existed ran on one process, so that section reads as the
    defaults with ``world_size = 1``; a root over ranks reads its world size, strategy and bucket size from its
    ``distributed`` block (its reader refuses a config section that says otherwise,
    :func:`replayjob.artifacts.capture_root.check_layout`).  One from before the sampler's truncation and dtype settings
    sampled without truncation in the model's dtype (``top_p = 1``, ``top_k = 0``, ``sampling_dtype =
    "model"``), and its trainer applied no temperature to its logprobs: ``algorithm.logprob_temperature``
    reads ``"none"``, or ``"sampling"`` at temperature 1, where the two are the same computation.
    """
    out = dict(m.config)
    if isinstance(m, ranks.RootManifest):  # the root's block, which its reader tied to its ranks and its config
        d = m.doc["distributed"]
        recorded = out.get("distributed")
        out["distributed"] = {**(recorded if isinstance(recorded, dict) else to_dict(DistributedConfig())),
                              "world_size": d["world_size"], "strategy": d["strategy"],
                              "bucket_cap_mb": d["bucket_cap_mb"]}
    elif "distributed" not in out:
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
    try:  # read through the config schema whatever is declared: keys it compares nothing by (ignored) included
        source_cfg = from_dict(source_config(m))
    except RefusedError as exc:
        adm.refuse(f"the source config in the manifest cannot be read back: {exc.diagnostics()}", integrity=True)
        return
    if source_cfg.training.trainer != "grpo":
        adm.refuse(f"{m.path}: the source config in the manifest says training.trainer = "
                   f"{source_cfg.training.trainer!r}, but a capture is written by the source trainer ('grpo'); "
                   "fix: replay the source run's capture", integrity=True)
    for key in (k for k in adm.allowed if k in registered and k in adm.observed):
        why = registered[key].refusal(source_cfg, adm.cfg)
        if why:
            adm.refuse(f"difference {key!r} is not systems-only here: {why}")


@dataclass(frozen=True)
class BuiltinKind:
    """The built-in trainer's captures, as :func:`replayjob.producers.admission.admit` checks them."""

    manifest_type: tuple[type, ...] = (Manifest,)  # a root over ranks is a Manifest too
    manifest_name: str = "optimizer_batch_step_000000.manifest.json"
    writer: str = "the built-in trainer"

    def runner(self, adm: Admission) -> None:
        _check_runner(adm)

    def payload(self, adm: Admission) -> None:
        _check_payload(adm)
        _check_world(adm)

    def state(self, adm: Admission) -> None:
        _check_state_dir(adm)
        _check_adapter(adm)

    def model(self, adm: Admission) -> None:
        _check_model_reference(adm)
        _check_routing(adm)

    def config(self, adm: Admission) -> None:
        _check_contract_and_config(adm)


KIND = BuiltinKind()


def admit(cfg: Config, keep_rows: bool = True, manifest: PinnedManifest | None = None) -> Admission:
    """Run every admission check on a replay config (:func:`replayjob.producers.admission.admit`, this kind's
    checks); never raises for a failed check.

    With ``keep_rows`` the admitted rows are kept (``batch``, for a replay); without, the payload is
    verified streaming and memory stays bounded (``explain``).  ``manifest``: the capture's manifest as the
    caller already verified it (:func:`replayjob.artifacts.capture_reader.producer_of`), used when it is the one
    the config pins, so its bytes are read once.  ``cfg`` is resolved once, at the entry point
    (:func:`replayjob.runtime.distributed.observe`: the world size this process runs, or the one a replay would
    have).
    """
    adm = Admission(cfg=cfg, keep_rows=keep_rows, given=manifest)
    shared.admit(adm, KIND)
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
