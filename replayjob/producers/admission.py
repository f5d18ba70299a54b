"""The one admission every replay goes through, whoever produced its capture: every check, no model, no device.

:func:`admit` runs the same sequence for every producer, collecting every reason rather than stopping at the
first, and skipping a check whose input failed an earlier one:

1. the replay config's own settings (the producer kind's :meth:`Kind.runner`, and no source-run setting,
   :func:`check_source_settings`);
2. both external pins of ``[optimizer_batch]`` (the manifest's SHA-256 and the logical batch's), the manifest
   path, the arm name and the tolerance, budget and bound pins (:func:`check_pins`);
3. the manifest: its bytes against their pin before they are parsed (or the manifest a caller verified
   already, :func:`~replayjob.artifacts.capture_reader.reuse`), written by a producer of this kind, and its
   logical batch equal to the logical pin;
4. the payload against the manifest (:meth:`Kind.payload`: each file's size and SHA-256 before it is
   deserialised, no symlink, the rows or micro-batches and their digests and summaries recomputed,
   non-finite inputs only when flagged and opted into);
5. the state the update starts from (:meth:`Kind.state`: the resume state or the captured adapter and
   optimizer files, pinned by SHA-256, and what they hold against the step by the rules of
   :mod:`replayjob.rl.state` every start state is read with: finite tensors, non-negative second moments,
   per-parameter step counts of the steps before it, no optimizer or RNG state in an initialisation state, and
   for the capture API param groups that cover the trainable parameters and learning rates its LR scheduler
   set);
6. the model (:meth:`Kind.model`: the base model's files, a forced routing file);
7. the optimizer contract, recomputed from the replay config and equal to the source's, and every config
   difference declared, present and a registered systems-only knob of the producer whose condition holds
   (:meth:`Kind.config`, with :func:`check_contract` and :func:`check_differences`).

The two kinds are the built-in trainer's captures (:mod:`replayjob.producers.builtin.admission`) and the capture
API's, which every other producer writes (:mod:`replayjob.producers.api.admission`); a rule added here holds for
both, and for every producer added later.  ``replayjob explain`` and ``replayjob replay`` run the same function;
the replay refuses unless it admits.  :func:`render` is the one text form of an admission's report.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from replayjob.artifacts.capture_manifest import PinnedManifest
from replayjob.artifacts.capture_reader import reuse
from replayjob.artifacts.replay_metrics import ARM_NAME_PATTERN, ARM_NAME_RULE
from replayjob.config.differences import differences
from replayjob.config.schema import OptimizerBatchConfig
from replayjob.digest import normalize_digest
from replayjob.errors import ContractError, IntegrityError, RefusedError
from replayjob.producers.contract import contract_differences, contract_sha256
from replayjob.runtime import knobs


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
    """What every admission records; a producer kind's subclass adds its payload and state."""

    pins: dict[str, str] = field(default_factory=dict)
    given: PinnedManifest | None = None  # the manifest as a caller already verified it
    manifest: Any = None  # the kind's manifest class, once its pin and its producer were checked
    allowed: list[str] = field(default_factory=list)
    observed: list[str] = field(default_factory=list)
    contract: dict[str, Any] | None = None

    def optimizer_batch(self) -> OptimizerBatchConfig:
        """The replay config's ``[optimizer_batch]`` section."""
        raise NotImplementedError

    def raise_if_refused(self) -> None:
        self.raise_for(self.optimizer_batch().replay_path or "optimizer_batch.replay_path")


class Kind(Protocol):
    """A kind of capture's own checks, run by :func:`admit` in its order (each may refuse, none raises)."""

    @property
    def manifest_type(self) -> tuple[type, ...]:
        """The manifest classes this kind admits (a single capture; a root is a subclass)."""

    @property
    def manifest_name(self) -> str:
        """The manifest a replay config names, as a refusal spells it."""

    @property
    def writer(self) -> str:
        """Who writes this kind of capture, as a refusal names it."""

    def runner(self, adm: Any) -> None: ...

    def payload(self, adm: Any) -> None: ...

    def state(self, adm: Any) -> None: ...

    def model(self, adm: Any) -> None: ...

    def config(self, adm: Any) -> None: ...


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
    if ob.arm and not re.fullmatch(ARM_NAME_PATTERN, ob.arm):  # the reducer's reader refuses it: say so now
        out.refuse(f"optimizer_batch.arm {ob.arm!r} must be {ARM_NAME_RULE}")
    for key in ("tolerances_sha256", "budgets_sha256", "mismatch_bound_sha256"):  # each must be a digest
        if getattr(ob, key):
            try:
                normalize_digest(getattr(ob, key), what=f"optimizer_batch.{key}")
            except IntegrityError as exc:
                out.refuse(exc.message, integrity=True)


SOURCE_SETTINGS = ("capture", "capture_steps", "ring_size", "ring_grad_norm_above", "ring_grad_norm_median_multiple",
                   "ring_loss_spike_multiple")  # what a training run captures: no replay reads them


def check_source_settings(ob: OptimizerBatchConfig, out: Refusals) -> None:
    """``[optimizer_batch]``'s source-run settings (which steps a training run captures, its ring buffer and the
    ring's triggers) left unset in a replay config, whoever produced the capture: a replay captures nothing, so
    a value there would be read by nothing."""
    found = [f"{k} = {json.dumps(getattr(ob, k))}" for k in SOURCE_SETTINGS if getattr(ob, k)]
    if found:
        out.refuse(f"optimizer_batch.{', '.join(found)}: source-run settings (what a training run captures); a replay "
                   "config leaves them unset, since a replay captures nothing")


ROUTING_SETTINGS = ("routing_path", "routing_sha256")  # the routing file a forced replay reads, and its pin


def check_routing_settings(routing: Any, ob: OptimizerBatchConfig, out: Refusals) -> None:
    """A routing file is read by forced routing only: ``optimizer_batch.routing_path`` (or its ``routing_sha256``)
    beside ``model.routing = "free"`` would be ignored -- the replay routes each token itself, whatever file the
    config names -- so the contradiction is refused, whoever produced the capture.  Forced routing without both
    settings is refused by the routing file's own check (:func:`replayjob.model.moe.file_reasons`)."""
    if routing == "forced":
        return
    named = [k for k in ROUTING_SETTINGS if getattr(ob, k)]
    if named:
        shown = f" ({str(ob.routing_path)[:200]!r})" if ob.routing_path else ""
        out.refuse(f"optimizer_batch.{' and '.join(named)}: a routing file{shown} is named, but model.routing is "
                   f"{str(routing)[:20]!r}: only forced routing reads it (a free replay routes each token itself and "
                   "would ignore the file); set model.routing = \"forced\" to replay that routing, or remove "
                   "optimizer_batch.routing_path and routing_sha256")


def _check_manifest(adm: Admission, kind: Kind) -> None:
    """The manifest the config pins: verified against the pin before it is parsed, of this kind, and holding
    the logical batch the config pins."""
    ob = adm.optimizer_batch()
    if "expected_manifest_sha256" not in adm.pins or not ob.replay_path:
        return
    try:
        m = reuse(adm.given, ob.replay_path, adm.pins["expected_manifest_sha256"])
        if not isinstance(m, kind.manifest_type):
            raise IntegrityError(f"the capture was written by {m.framework!r}, not {kind.writer}", where=m.path)
    except RefusedError as exc:
        adm.refuse(exc.diagnostics().replace("\n  fix:", "; fix:"), integrity=True)
        return
    adm.manifest = m
    pin = adm.pins.get("expected_logical_sha256")
    if pin is not None and pin != m.logical_sha256:
        adm.refuse(f"wrong logical pin: expected_logical_sha256 is {pin}, the manifest's logical batch is "
                   f"{m.logical_sha256}", integrity=True)


def admit(adm: Admission, kind: Kind) -> Admission:
    """Run every admission check on ``adm`` (a kind's :class:`Admission` holding its replay config) in the one
    order; never raises for a failed check (see :meth:`Refusals.raise_for`)."""
    kind.runner(adm)
    check_source_settings(adm.optimizer_batch(), adm)
    check_pins(adm.optimizer_batch(), adm, adm.pins, kind.manifest_name)
    _check_manifest(adm, kind)
    if adm.manifest is not None:
        kind.payload(adm)
    kind.state(adm)
    kind.model(adm)
    kind.config(adm)
    return adm


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


def render(rep: dict[str, Any]) -> str:
    """The human-readable form of an admission's report (either kind's ``report``)."""
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
    if rep.get("micro_batches"):  # a capture API capture (another producer's)
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


__all__ = ["SOURCE_SETTINGS", "Admission", "Kind", "Refusals", "admit", "check_contract", "check_differences",
           "check_pins", "check_routing_settings", "check_source_settings", "render"]
