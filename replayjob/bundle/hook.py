"""Bundle capture from the source trainer: a step hook with a background writer thread.

Off by default; on only through the environment (no config or CLI change):

* ``REPLAYJOB_BUNDLE_CAPTURE=1`` turns it on (``0`` or unset: off; anything else is refused);
* ``REPLAYJOB_BUNDLE_DIR`` is the capture directory (required when on);
* ``REPLAYJOB_BUNDLE_STEPS`` (``R:S,...``) and ``REPLAYJOB_BUNDLE_ROLLOUTS`` (``R,...``) limit
  which actor steps and rollouts are captured; unset means all.

The source trainer runs one actor update per rollout, so step ``k`` is rollout ``k``, actor step
``(k, 0)``, weight version ``k``.  A step whose rollout and actor step are both captured is written
as one ``update`` bundle (every stage, one set of files); a step with only one of them captured, as
a ``rollout`` or a ``step`` bundle; a rollout whose update never returned, as a rollout bundle.

``on_rollout`` and ``after_update`` copy CPU tensors, and the disk work (staging, ``fsync``,
rename) is the hook's :class:`~replayjob.rl.hooks.BackgroundWriter`'s (started idle with the hook):
the training thread never waits on disk.  Who builds a bundle
(redacts text, checks what the reader will check, serializes the payload file and the JSON) depends
on where the step computes, which ``on_train_begin`` reads from the trained parameters' devices:

* on a GPU, the writer thread builds and writes, beside the device's work: ``after_update`` hands it
  the step's snapshots once the update has returned;
* on the CPU, the training thread builds them at the start of the next step's ``on_rollout`` (or in
  ``finish``), and only the writing goes to the writer thread.  There the step's own compute holds
  every core, so a thread building beside it costs its own CPU time and slows the step as well;
  in line the building costs its CPU time only, and the captured step itself pays for its copies
  alone (measured in ``benchmarks/README.md``, capture_overhead).

``finish`` (training has finished) builds what is left, drains the writer and raises the first
capture error; ``abandon`` (training failed) does the same quietly.
Capture never changes training numerics: it reads tensors and consumes no random numbers.
"""

from __future__ import annotations

import array
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import replayjob
from replayjob.bundle import format as fmt
from replayjob.bundle.writer import BundleWriter, PreparedBundle
from replayjob.config import Config, config_sha256
from replayjob.errors import ConfigError, RefusedError, ReplayjobError
from replayjob.model.tokenizer import ByteTokenizer
from replayjob.rl.hooks import BackgroundWriter, StepHook, StepRollout, TrainerView
from replayjob.rl.update import UpdateResult

if TYPE_CHECKING:
    from torch import Tensor


ENV_CAPTURE = "REPLAYJOB_BUNDLE_CAPTURE"
ENV_DIR = "REPLAYJOB_BUNDLE_DIR"
ENV_STEPS = "REPLAYJOB_BUNDLE_STEPS"
ENV_ROLLOUTS = "REPLAYJOB_BUNDLE_ROLLOUTS"
WRITER_THREAD = "bundle-writer"  # the name of the hook's writer thread (benchmarks read its CPU clock)


def capture_from_env(cfg: Config, environ: Mapping[str, str] | None = None) -> BundleCapture | None:
    """The capture hook the environment asks for, or None when capture is off."""
    env = os.environ if environ is None else environ
    flag = env.get(ENV_CAPTURE, "").strip()
    if flag in ("", "0"):
        return None
    if flag != "1":
        raise ConfigError(f"{ENV_CAPTURE} must be 1 or 0, not {flag!r}", where=ENV_CAPTURE)
    directory = env.get(ENV_DIR, "").strip()
    if not directory:
        raise ConfigError(f"{ENV_CAPTURE}=1 needs {ENV_DIR}", where=ENV_DIR, hint=f"export {ENV_DIR}=captures")
    steps = rollouts = None
    try:
        if env.get(ENV_STEPS, "").strip():
            steps = {fmt.parse_step(x) for x in env[ENV_STEPS].split(",") if x.strip()}
        if env.get(ENV_ROLLOUTS, "").strip():
            rollouts = {int(x) for x in env[ENV_ROLLOUTS].split(",") if x.strip()}
    except (ReplayjobError, ValueError):
        raise ConfigError(f"{ENV_STEPS} is R:S[,R:S...] and {ENV_ROLLOUTS} is R[,R...]",
                          where=f"{ENV_STEPS}/{ENV_ROLLOUTS}") from None
    return BundleCapture(cfg, Path(directory), steps, rollouts)


def recompute_config(cfg: Config) -> dict[str, Any]:
    a = cfg.algorithm
    return {"estimator": a.estimator, "samples_per_prompt": a.group_size, "std_eps": a.std_eps, "kl_kind": "k1",
            "kl_reward_coef": a.kl_reward_coef, "batch_adv_norm": a.batch_adv_norm, "adv_clip": a.adv_clip,
            "token_cap": a.token_cap, "loss_agg": a.loss_agg, "clip_low": a.clip_eps_low,
            "clip_high": a.clip_eps_high, "kl_loss_coef": a.kl_loss_coef, "context_parallel": 1,
            "task": {"name": cfg.environment.task, "max_operand": cfg.environment.max_operand},
            "tokenizer": "byte" if not cfg.model.path else None}


@dataclass
class _Snapshot:
    """What the training thread hands over: CPU tensor copies and Python lists, nothing shared."""

    step: int
    prompts: list[str]
    answers: list[str]
    completions: list[str]
    prompt_lengths: list[int]
    responses: list[list[int]]
    tensors: dict[str, Tensor]
    label_ids: list[list[int]] | None = None  # the answers' token ids (byte tokenizer), encoded once


class BundleCapture(StepHook):
    """A :class:`~replayjob.rl.hooks.StepHook` that writes update, rollout and step bundles."""

    wants_update_logprobs = True  # an update or step bundle records the logprobs the loss saw

    def __init__(self, cfg: Config, directory: Path, steps: set[tuple[int, int]] | None,
                 rollouts: set[int] | None, build_on_training_thread: bool | None = None):
        import torch
        self.directory = directory
        # None: decided in on_train_begin from where the trained parameters live (all on the CPU: yes)
        self.build_on_training_thread = build_on_training_thread
        self.steps, self.rollouts = steps, rollouts
        self.config = recompute_config(cfg)
        self.micro = cfg.training.micro_batch_size
        self.producer = {"name": "replayjob", "trainer": "grpo", "replayjob_version": replayjob.__version__,
                         "torch_version": torch.__version__, "config_sha256": config_sha256(cfg)}
        self._pending: _Snapshot | None = None
        self._held: list[tuple[str, _Snapshot, Tensor | None, float]] = []  # until the update has returned
        self._deferred: list[tuple[str, _Snapshot, Tensor | None, float]] = []  # CPU steps: built at the next rollout
        self.written: list[Path] = []
        self._writer = BackgroundWriter(WRITER_THREAD)  # idle until a step's update returned

    # StepHook ------------------------------------------------------------------------------
    def on_train_begin(self, view: TrainerView) -> None:
        """Where the step computes: the trained parameters' devices (the rollout's tensors are built
        on the CPU whatever the device, so they cannot tell)."""
        if self.build_on_training_thread is None:
            devices = {p.device.type for group in view.optimizer.param_groups for p in group["params"]}
            self.build_on_training_thread = devices <= {"cpu"}

    def on_rollout(self, rollout: StepRollout) -> None:
        self._build_deferred()  # the previous step's bundles, when it computed on the CPU
        names = ("group", "raw", "scores", "mask", "old_logprobs", "ref_logprobs", "kl", "advantages",
                 "loss_weights")
        snap = _Snapshot(rollout.step, list(rollout.prompts), list(rollout.answers), list(rollout.completions),
                         [len(p) for p in rollout.prompt_tokens], [list(r) for r in rollout.response_tokens],
                         {n: getattr(rollout, n).detach().to("cpu", copy=True) for n in names})
        self._pending = snap
        if self.rollouts is None or rollout.step in self.rollouts:
            self._held.append(("rollout", snap, None, 0.0))  # written once the update has returned

    def after_update(self, step: int, result: UpdateResult) -> None:
        snap, self._pending = self._pending, None
        try:
            if snap is None or snap.step != step or (self.steps is not None and (step, 0) not in self.steps):
                return
            logp = getattr(result, "logprobs", None)
            if logp is None:
                self._writer.fail(RefusedError(f"step {step}: the update did not expose its logprobs; its actor "
                                               "step is not bundled (a captured rollout is written alone)"))
                return
            tokens = int(snap.tensors["mask"].count_nonzero())
            if tokens != logp.numel():  # a rollout captured with this step is still written, alone
                self._writer.fail(RefusedError(f"step {step}: the update exposed {logp.numel()} logprobs for {tokens} "
                                               "response tokens; its actor step is not bundled (a captured rollout "
                                               "is written alone)"))
                return
            kept = (logp.detach().to("cpu", copy=True), float(result.loss))
            if self._held and self._held[-1][0] == "rollout" and self._held[-1][1] is snap:
                self._held[-1] = ("update", snap, *kept)  # the rollout and its one step: one bundle
            else:
                self._held.append(("step", snap, *kept))
        finally:
            self._release()

    def _release(self) -> None:
        """Hand the held bundles on, nothing here waits: to the writer thread, or (a step computed on
        the CPU) to the next step's rollout, where the training thread builds them."""
        for item in self._held:
            if self.build_on_training_thread is not False:  # None: not told by a trainer; build in line
                self._deferred.append(item)
            else:
                self._writer.submit(functools.partial(self._land, *item))
        self._held.clear()

    def _build_deferred(self) -> None:
        """The training thread: build (check and serialize) the deferred bundles and hand each to the
        writer thread to write.  A build error is kept for ``finish``; training goes on."""
        for kind, snap, logp, loss in self._deferred:
            try:
                w = self._build(kind, snap, logp, loss)
                prepared = w.prepare()
            except Exception as exc:  # a capture error never stops training; it surfaces at finish
                self._writer.fail(exc)
                continue
            self._writer.submit(functools.partial(self._write, w, prepared))
        self._deferred.clear()

    def _build(self, kind: str, snap: _Snapshot, logp: Tensor | None, loss: float) -> BundleWriter:
        w = self._bundle(snap, kind)
        if kind in fmt.ROLLOUT_KINDS:
            self._rollout(w, snap)
        if kind in fmt.STEP_KINDS:
            self._step(w, snap, logp, loss)
        return w

    def _land(self, kind: str, snap: _Snapshot, logp: Tensor | None, loss: float) -> None:
        """The writer thread: build and write one bundle."""
        w = self._build(kind, snap, logp, loss)
        self._write(w, w.prepare())

    def _write(self, w: BundleWriter, prepared: PreparedBundle) -> None:
        """The writer thread: the disk part (staging, ``fsync``, rename)."""
        self.written.append(w.write(prepared))

    def finish(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Training is over: build what is left, drain the writer, raise the first capture error;
        nothing joins metrics.json."""
        self.close()
        return {}

    def abandon(self) -> None:
        """Training failed: write what was captured, drain the writer, keep its errors to itself."""
        self._release()  # a rollout whose update never returned is still written
        self._build_deferred()
        self._writer.release()

    def close(self) -> list[Path]:
        """Build what is left, drain the writer thread (training is over); raise the first capture
        error; the bundles written."""
        self._release()  # a rollout whose update never returned is still written
        self._build_deferred()
        self._writer.drain()
        return list(self.written)

    # building (the writer thread, or the training thread for a step computed on the CPU) -----
    def _bundle(self, snap: _Snapshot, kind: str) -> BundleWriter:
        import torch
        rid = snap.step
        step_id = 0 if kind in fmt.STEP_KINDS else None
        w = BundleWriter(self.directory / fmt.bundle_name(kind, rid, step_id), kind=kind, rollout_id=rid,
                         step_id=step_id, config=self.config, producer=self.producer, weight_version=rid)
        mask = snap.tensors["mask"]
        group = snap.tensors["group"].tolist()
        lengths = mask.sum(dim=1).to(torch.int64).tolist()  # one reduction, not one per sample
        labels = _label_ids(snap)
        for i in range(len(snap.responses)):
            w.add_sample(f"s-{i:04d}", group=f"g-{int(group[i]):04d}", cohort=f"c-{rid:06d}",
                         prompt_length=snap.prompt_lengths[i], response_length=lengths[i],
                         label_length=len(labels[i]), partition=f"p-{rid:06d}",
                         consumer_batch="cb-0000", micro_batch=f"mb-{i // self.micro:04d}",
                         prompt=snap.prompts[i], completion=snap.completions[i], label=snap.answers[i])
        w.write_payload("mask", mask)
        return w

    def _rollout(self, w: BundleWriter, snap: _Snapshot) -> None:
        """The rollout's stages: rewards, KL and advantages, with the inputs that recompute them."""
        t = snap.tensors
        width = int(t["mask"].shape[1])
        if self.config["tokenizer"] == "byte":
            labels = _label_ids(snap)
            w.write_payload("response_ids", _padded(snap.responses, width))
            w.write_payload("label_ids", _padded(labels, max(1, max(len(x) for x in labels))))
        else:
            w.set_capability("reward.raw", "recorded-only", "the model's tokenizer cannot be rebuilt offline")
        w.write_payload("old_logprobs", t["old_logprobs"])
        w.write_payload("ref_logprobs", t["ref_logprobs"])
        w.set_expected("reward.raw", "raw", t["raw"])
        w.set_expected("reward.post_process", "scores", t["scores"])
        w.set_expected("advantage.kl", "kl", t["kl"])
        w.set_expected("advantage.estimate", "advantages", t["advantages"])

    def _step(self, w: BundleWriter, snap: _Snapshot, flat_logp: Tensor | None, loss: float) -> None:
        """The actor step's policy loss, with the logprobs it saw; in an update bundle its other inputs
        are already there (the advantages as ``advantage.estimate``'s recorded output)."""
        import torch
        assert flat_logp is not None
        t = snap.tensors
        mask = t["mask"]
        # Each mask row is its response's ones then zeros, so the row-major positions of the ones are
        # the flat (concatenated) order of the update's per-token logprobs.
        logp = torch.zeros(mask.shape, dtype=flat_logp.dtype)
        logp[mask != 0] = flat_logp.reshape(-1)  # as many as the mask's ones: checked in after_update
        w.write_payload("logprobs", logp)
        for name in ("old_logprobs", "ref_logprobs", "advantages"):
            if name not in w.payloads:  # an update bundle's rollout stages (built first) wrote them already
                w.write_payload(name, t[name])
        w.set_expected("loss.policy", "loss_weights", t["loss_weights"])
        w.set_expected("loss.policy", "loss", loss)


def _label_ids(snap: _Snapshot) -> list[list[int]]:
    """The answers' token ids (the byte tokenizer: what ``label_length`` counts), encoded once a step."""
    if snap.label_ids is None:
        tok = ByteTokenizer()
        snap.label_ids = [tok.encode(a) for a in snap.answers]
    return snap.label_ids


def _padded(rows: list[list[int]], width: int) -> Tensor:
    """``rows`` as an int64 ``[len(rows), width]`` tensor padded with 0 (one buffer, no per-row Torch call)."""
    import torch
    longest = max((len(r) for r in rows), default=0)
    if longest > width:
        raise RefusedError(f"a row of {longest} tokens does not fit the width {width}")
    flat = array.array("q")
    zeros = [0] * width
    for r in rows:
        flat.extend(r)
        flat.extend(zeros[len(r):])
    if not flat:
        return torch.zeros((len(rows), width), dtype=torch.int64)
    return torch.frombuffer(flat, dtype=torch.int64).reshape(len(rows), width)  # the tensor keeps the buffer alive
