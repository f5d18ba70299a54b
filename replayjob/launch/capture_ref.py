"""An ablation over an existing capture: the spec's ``[capture]`` table, from any producer.

A capture written by replayjob's own trainer (``replay_step_<K>.toml`` of its chosen steps), by TRL
(:func:`replayjob.producers.trl.producer.capture_optimizer_batch`) or by a plain PyTorch loop
(:class:`replayjob.producers.api.capture.StepCapture`) gets the same fan-out as the built-in capture
stage: ``replayjob step capture`` verifies it instead of training, ``step replay`` runs the
capture's own replay config with the arm's overrides and the pins, ``step reduce`` reduces against
it.  This module holds what is specific to an existing capture, once:

* :func:`locate`: the capture's pins and manifest file from its ``metrics.json`` (the one-step pins,
  or the record of the step whose replay config the spec names), compared with the spec's pins, and
  the producer read from the manifest (hashed against its pin before it is parsed), never guessed
  from the replay config;
* :func:`check`: every arm key a systems-only knob of that producer
  (:func:`replayjob.runtime.knobs.knobs_for`), the spec's ``[capture] math_mode`` (the mode every
  step pins) the one the capture's contract records, and one rank for an external trainer's capture
  (its replay runs in one process); run by ``step plan``, ``k8s render``, the funnel and ``step
  capture`` before anything starts;
* :func:`verify`: the full admission without a model (the integration rules of
  :mod:`replayjob.producers.api.admission`, or the built-in explain), recorded as ``RUN/capture.json``;
* :func:`replay_sets`: the ``--set`` overrides every replay of the capture gets.

Every refusal is exit 2.  Example::

    [capture]
    dir = "/shared/captures/grpo-step5"
    logical_sha256 = "..."       # optimizer/logical_batch_sha256 it printed
    manifest_sha256 = "..."      # optimizer_batch/manifest_sha256
    # replay_config = "replay_step_000005.toml"   (one of several chosen steps; default replay.toml)
    # math_mode = "default"   REPLAYJOB_MATH_MODE of the capture's process ("default": it set none)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replayjob.artifacts import api_manifest as external_manifest
from replayjob.artifacts import capture_reader as manifests
from replayjob.artifacts import metrics
from replayjob.artifacts.capture_manifest import REPLAY_CONFIG
from replayjob.artifacts.capture_reader import CaptureManifest
from replayjob.artifacts.spec import AblationSpec
from replayjob.config.dump import replay_pins, set_args
from replayjob.errors import ConfigError, ContractError, IntegrityError, RefusedError
from replayjob.fsio import atomic_write_bytes, check_no_symlinks
from replayjob.jsonio import pretty_bytes, read_json_object
from replayjob.producers.explain import explain
from replayjob.runtime.determinism import ENV_MATH_MODE
from replayjob.runtime.knobs import BUILTIN, WORLD_SIZE, knobs_for

CAPTURE_RECORD = "capture.json"  # RUN/capture.json: the verified capture (step capture writes it)
CAPTURE_SCHEMA = "replayjob.run_capture/v1"


@dataclass(frozen=True)
class Located:
    """An existing capture, its pins checked against the spec and its producer read from the manifest."""

    dir: Path
    config: Path  # the replay config the capture wrote
    manifest: Path  # its manifest file
    logical: str
    manifest_sha256: str
    producer: str  # replayjob.runtime.knobs.PRODUCERS: from the manifest
    step: int | None  # the chosen step whose record pins it (reduce --source-step); None: a one-step capture
    math_mode: str | None = None  # the math mode the capture's contract records (None: it records none)
    record: CaptureManifest | None = field(default=None, compare=False, repr=False)  # the verified manifest


def capture_pins(directory: Path, replay_config: str) -> tuple[str, str, Path, int | None]:
    """The pins a capture recorded for ``replay_config``, its manifest file and the chosen step (or
    ``None`` for a one-step capture's ``replay.toml``), read strictly from ``directory/metrics.json``."""
    if not (directory / metrics.SOURCE_FILE).is_file():
        raise RefusedError(f"not a finished capture (no {metrics.SOURCE_FILE})", where=directory,
                           hint="capture.dir must name the directory a capture wrote (metrics.json is its last "
                                "file), reachable at the same path from every step (the shared volume)")
    config = check_no_symlinks(directory, directory / replay_config, what=f"the capture's {replay_config}")
    if replay_config == REPLAY_CONFIG:
        logical, manifest, path = metrics.read_pins(directory)
        if not config.is_file():
            raise RefusedError(f"the capture holds no {replay_config}", where=directory,
                               hint="a capture by `replayjob capture` replays with its workspace's replay.toml: "
                                    "run `replayjob step capture --workspace WS --source DIR` without [capture]")
        return logical, manifest, path, None
    try:
        steps = metrics.read_steps(directory)
    except IntegrityError:
        if metrics.STEPS in read_json_object(directory / metrics.SOURCE_FILE):
            raise
        raise RefusedError(f"{replay_config}: this capture records one step, not several chosen steps",
                           where=directory, hint=f"capture.replay_config = \"{REPLAY_CONFIG}\"") from None
    records = [s for s in steps if s.replay_config.resolve() == config.resolve()]
    if len(records) != 1:
        listed = ", ".join(s.replay_config.name for s in steps) or "none"
        raise RefusedError(f"{replay_config} is not a captured step's replay config in {metrics.SOURCE_FILE}",
                           where=directory, hint=f"capture.replay_config: one of {listed}")
    if not config.is_file():
        raise RefusedError(f"the capture's {replay_config} is missing", where=config)
    return records[0].logical, records[0].manifest, records[0].manifest_path, records[0].step


def locate(spec: AblationSpec) -> Located:
    """The spec's capture: pins compared (both), the manifest hashed against its pin, then its producer."""
    ref = spec.capture
    assert ref is not None
    d = Path(ref.dir)
    logical, manifest, path, step = capture_pins(d, ref.replay_config)
    for key, want, have in (("logical_sha256", ref.logical_sha256, logical),
                            ("manifest_sha256", ref.manifest_sha256, manifest)):
        if want != have:
            raise ContractError(f"capture.{key} is {want}, but the capture's {metrics.SOURCE_FILE} records {have}",
                                where=d / metrics.SOURCE_FILE,
                                hint="the directory holds another capture, or the pin is from another run: pin the "
                                     "digests this capture printed")
    m, mode = read_manifest(path, manifest)
    return Located(d, d / ref.replay_config, m.path, logical, manifest, m.framework, step, mode, m)


def read_manifest(path: Path, manifest_sha256: str) -> tuple[CaptureManifest, str | None]:
    """A capture's manifest through the one reader (hashed against its pin before it is parsed, validated by its
    producer's rules) and the math mode its optimizer contract records (``None`` where it records none)."""

    m = manifests.read(path, manifest_sha256, pin_name="capture.manifest_sha256",
                       hint="keep the capture directory as the capture wrote it")
    if isinstance(m, external_manifest.RootManifest):
        # a capture over several processes: its replay launches that many (`replayjob replay --nproc N`);
        # the steps run an external trainer's replay in one process, so they refuse it rather than misread it
        raise ContractError(f"the capture ran on {m.world_size} processes; the cluster steps replay an "
                            "external trainer's capture on one process", where=m.path,
                            hint="replay it with `replayjob replay CONFIG --nproc N` on one node, or capture the "
                                 "step on one process for the cluster path")
    mode = m.contract.get("math_mode")
    return m, mode if isinstance(mode, str) else None


def check(spec: AblationSpec, *, reachable_only: bool = False, log: Any = print) -> Located | None:
    """Refuse arm keys that are not knobs of the capture's producer and what its replay cannot run.

    ``reachable_only`` (a render on a machine without the shared volume): a capture directory that does
    not exist here is left to ``step capture`` (the first stage, before any replay) with a note."""

    if spec.capture is None:
        return None
    if reachable_only and not Path(spec.capture.dir).exists():
        log(f"note: the capture directory {spec.capture.dir} is not reachable here; its pins and the arms' knobs are "
            "checked by `replayjob step capture`, before any replay")
        return None
    found = locate(spec)
    registered = knobs_for(found.producer)
    for arm in spec.arms:
        for key in arm.overrides:
            if key not in registered:
                raise ConfigError(f"{key!r} is not a systems-only knob of {found.producer}, the capture's producer "
                                  f"(its manifest {found.manifest.name})", where=f"arms.{arm.name}",
                                  hint=f"knobs of {found.producer}: " + ", ".join(sorted(registered)))
    if found.math_mode is not None and found.math_mode != spec.math_mode:
        raise ContractError(f"the capture ran in math mode {found.math_mode!r}, but the spec's capture.math_mode is "
                            f"{spec.math_mode!r}, which every step pins ({ENV_MATH_MODE}={spec.math_mode}); the math "
                            "mode is part of the update's contract", where=found.manifest,
                            hint=f'write math_mode = "{found.math_mode}" in the spec\'s [capture] table')
    if found.producer != BUILTIN and (spec.ranks != 1 or any(WORLD_SIZE in a.overrides for a in spec.arms)):
        raise ConfigError(f"a {found.producer} capture replays in one process", where="ranks", hint="ranks = 1")
    return found


def replay_sets(spec: AblationSpec, found: Located) -> list[str]:
    """The ``--set`` overrides of every replay of the capture (and of its verification): the manifest
    in the capture directory (wherever the capture was moved), both pins, the base model directory
    (``model_path``), the device for replayjob's own trainer, and ``[config]``'s replay settings.  An
    external trainer's replay runs where its captured config puts it (TRL's ``use_cpu``, a plain loop's
    device): the spec's ``device`` is then only what the launchers provision."""

    sets = set_args(replay_pins(found.manifest, found.logical, found.manifest_sha256))
    if found.producer == BUILTIN:
        sets += set_args({"backend.devices": spec.device})
    if spec.model_path:
        sets += set_args({"model.path": spec.model_path})
    return sets + set_args(dict(sorted(spec.config.items())))


def verify(spec: AblationSpec, run: Path, log: Any = print) -> Located:
    """``step capture`` for an existing capture: no training, no workspace; the knobs and pins checked
    (:func:`check`), the whole admission run without a model (the producer's rules: every file against
    its pin, the base model's files, the optimizer contract), and ``RUN/capture.json`` written."""

    found = check(spec)
    assert found is not None
    sets = replay_sets(spec, found)
    adm, rep = explain(found.config, sets, found.record)
    adm.raise_for(str(found.config))
    atomic_write_bytes(run / CAPTURE_RECORD, pretty_bytes({
        "schema": CAPTURE_SCHEMA, "dir": str(found.dir), "replay_config": found.config.name,
        "producer": found.producer, "step": found.step, "manifest": str(found.manifest),
        metrics.LOGICAL: found.logical, metrics.MANIFEST: found.manifest_sha256, "admission": rep}))
    log(f"step: verified the {found.producer} capture {found.dir} ({found.config.name}); no training")
    return found
