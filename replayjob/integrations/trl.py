"""TRL integration: capture a real ``trl.GRPOTrainer`` step, and replay it with TRL's own training step.

Capture (``pip install 'replayjob[trl]'``)::

    from replayjob.integrations.trl import capture_optimizer_batch
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained("/models/base"), ...,
                          peft_config=LoraConfig(...))
    cap = capture_optimizer_batch(trainer, "runs/cap", step=1)   # before train()
    trainer.train()
    cap.result.replay_toml                                          # runs/cap/replay.toml, pins filled in

``steps=[K1, K2, ...]`` instead captures several steps of the run
(:class:`~replayjob.integrations.capture.ChosenSteps`): per step its files and
``replay_step_<K:06d>.toml``, and ``metrics.json`` once training ends (``cap.steps_result``).

How it plugs in: a ``TrainerCallback`` snapshots the adapter, optimizer and LR-scheduler state at
``on_step_begin`` of (each chosen) global step K and finishes the capture at ``on_step_end``, after the
transformers loop's clip, ``optimizer.step()``, ``lr_scheduler.step()`` and ``zero_grad()``;
the trainer's ``compute_loss`` is wrapped so every micro-batch's inputs (exactly the dict TRL's
loss receives, after generation and buffering) and the Torch RNG state are recorded right before
the loss call, and ``training_step`` so its reported loss is summed.  Nothing else changes: the
wrappers read state and consume no random numbers.

Replay (:func:`build_replay`) loads the base model from its directory, builds a ``GRPOTrainer``
with the captured ``GRPOConfig`` values (plus declared systems-only overrides), a reward function
and a dataset that refuse to be used, and generation disabled; it stands the trainer at step K
(``_prepare_for_training``, the scheduler built for the captured ``max_steps``) and runs each
micro-batch through ``trainer.training_step`` (TRL's ``compute_loss``), then the transformers
loop's ``_clip_grad_norm`` / ``_get_grad_norm``, ``optimizer.step()``, ``lr_scheduler.step()``
and ``model.zero_grad()``.  This module imports TRL, transformers and peft only inside functions,
so ``explain`` can use :func:`contract` without them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from replayjob import determinism
from replayjob.config.redact import REDACTED
from replayjob.errors import RefusedError, UsageError
from replayjob.integrations import capture as cap
from replayjob.integrations.replay import ReplaySession
from replayjob.optbatch import knobs

if TYPE_CHECKING:
    from replayjob.integrations.admission import Admission

FRAMEWORK = "trl"
TESTED = {"trl": "1.16.0"}
# GRPOConfig fields that define the update's math (absent ones in another TRL version are recorded as None).
CONTRACT_KEYS = (
    "loss_type", "beta", "epsilon", "epsilon_high", "delta", "importance_sampling_level", "scale_rewards",
    "num_iterations", "top_entropy_quantile", "mask_truncated_completions", "use_bias_correction_kl",
    "max_grad_norm", "optim", "optim_args", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2",
    "adam_epsilon", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio", "max_steps",
    "gradient_accumulation_steps", "per_device_train_batch_size", "steps_per_generation", "num_generations",
    "bf16", "fp16", "tf32", "entropy_coef", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
    "vespo_k_neg", "vespo_lambda_pos", "vespo_lambda_neg", "off_policy_mask_threshold",
)


class _Refused(RuntimeError):
    """Raised if a replay ever reaches generation, a reward function or the dataset."""


def jsonable(value: Any) -> Any:
    """A framework config value as JSON: enums by value, sets sorted, tuples as lists, others by repr."""
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, set | frozenset):
        return sorted(jsonable(v) for v in value)
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return repr(value)


def _trl_config(args: Any) -> dict[str, Any]:
    d = jsonable(args.to_dict())
    for key in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        if key in d and isinstance(d[key] or {}, dict):
            # None, {} and {"use_reentrant": None} all mean the library default; recording the key
            # explicitly makes the reentrant variant one addressable knob (use_reentrant = true/false).
            d[key] = {"use_reentrant": None, **(d[key] or {})}
    out: dict[str, Any] = d
    return out


def contract(resolved: dict[str, Any]) -> dict[str, Any]:
    """The TRL update's contract from a resolved config (pure: no TRL import)."""
    t = resolved.get(FRAMEWORK, {})
    return {
        "schema": "replayjob.integration_contract/v1",
        "framework": FRAMEWORK,
        "update": {k: t.get(k) for k in CONTRACT_KEYS},
        "sequence": "training_step per captured micro-batch; clip (max_grad_norm > 0); optimizer.step; "
                    "lr_scheduler.step unless skipped; zero_grad",
        "dtype": resolved.get("model", {}).get("dtype"),
        "adapter": resolved.get("peft"),
        "math_mode": determinism.math_mode_from_env(False),
    }


def _base_model(trainer: Any) -> Any:
    model = trainer.model
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def capture_optimizer_batch(trainer: Any, out_dir: str | Path, step: int | None = None, *,
                            steps: Iterable[int] | None = None) -> TRLCapture:
    """Instrument a ``trl.GRPOTrainer`` before ``train()`` so optimizer step ``step`` (or each of ``steps``)
    is captured.

    ``step=K`` writes one capture with ``replay.toml``, ``metrics.json`` and ``final_adapter/``
    (``result``); ``steps=[K1, K2, ...]`` writes per step its files and ``replay_step_<K:06d>.toml``,
    and when training ends one ``metrics.json`` with every captured step's pins (``steps_result``).
    With neither, step 0 is captured.
    Refused at once (nothing written): both ``step`` and ``steps``, a negative or
    repeated step, a step before the trainer's current step or at/after its ``max_steps``, a trainer
    that is not a GRPOTrainer, a model without a PEFT adapter, a base model not loaded from a local
    directory with safetensors weights, or an output directory that already holds one of the files.
    """
    from peft import PeftModel
    from trl import GRPOTrainer

    if step is not None and steps is not None:
        raise UsageError("give one of step=K (one step) and steps=[K, ...] (several steps), not both",
                         where="capture_optimizer_batch",
                         hint="e.g. capture_optimizer_batch(trainer, out, step=1) or (..., steps=[1, 3])")
    if step is None and steps is None:
        step = 0  # the first optimizer step, as before steps= existed
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise UsageError(f"step must be an integer >= 0, found {step!r}", where="step")
    chosen = (step,) if step is not None else cap.chosen_steps(steps)
    if not isinstance(trainer, GRPOTrainer):
        raise cap.CaptureError(f"expected a trl.GRPOTrainer, found {type(trainer).__name__}", where="trainer")
    if not isinstance(trainer.model, PeftModel):
        raise cap.CaptureError("the trainer's model has no PEFT adapter", where="trainer.model",
                               hint="pass peft_config=LoraConfig(...) to GRPOTrainer (replayjob replays adapters)")
    past = [k for k in chosen if k < trainer.state.global_step]
    if past:
        raise cap.CaptureError(f"the trainer is already past step(s) {past}", where="step" if step is not None
                               else "steps")
    late = [k for k in chosen if 0 < trainer.args.max_steps <= k]
    if late:
        raise cap.CaptureError(f"step(s) {late} are not reached: the trainer's max_steps is {trainer.args.max_steps} "
                               "(steps are 0-based)", where="step" if step is not None else "steps",
                               hint="raise max_steps or choose earlier steps")
    return TRLCapture(trainer, Path(out_dir), chosen, several=steps is not None)


class TRLCapture:
    """The instrumentation :func:`capture_optimizer_batch` installs: ``result`` once step K finished
    (``step=K``), ``steps_result`` once training ended (``steps=[...]``)."""

    def __init__(self, trainer: Any, out_dir: Path, steps: tuple[int, ...], *, several: bool):
        from transformers import TrainerCallback

        base = _base_model(trainer)
        self.trainer, self.steps, self.several = trainer, steps, several
        self.step = steps[0]  # the one step of a step=K capture (the first chosen one otherwise)
        peft_cfg = trainer.model.peft_config[trainer.model.active_adapter]
        config = {
            FRAMEWORK: _trl_config(trainer.args),
            "model": {"path": str(Path(str(base.config._name_or_path)).resolve()) if base.config._name_or_path
                      else "", "attn_implementation": base.config._attn_implementation,
                      "dtype": str(base.dtype).removeprefix("torch.")},
            "peft": jsonable(peft_cfg.to_dict()),
        }
        self._cap: cap.StepCapture | None = None  # the step being captured (or the last one)
        self._config = config
        self._base_dir = str(base.config._name_or_path or "")
        self._out = out_dir
        self._chosen: cap.ChosenSteps | None = None
        self._base_model: dict[str, Any] | None = None  # step=K: hashed here, once
        if several:  # refused now, before training: existing files, a base model not in a local directory
            self._chosen = cap.ChosenSteps(out_dir, steps=steps, framework=FRAMEWORK, base_model_dir=self._base_dir,
                                           config=config)
        else:
            cap.refuse_existing(out_dir, cap.capture_file_names(self.step, several=False))
            self._base_model = cap.base_model_identity(self._base_dir)
        handle = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                handle._begin(state)

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                c = handle._cap
                if c is not None and c.active and state.global_step == c.step + 1:
                    c.finish(grad_norm=handle._grad_norm)

            def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                c = handle._cap
                if c is not None and c.active:
                    c.abandon()  # the step never completed: nothing was written for it
                if handle._chosen is not None:
                    handle._chosen.close()  # metrics.json, last

        self._grad_norm: float | None = None
        self._wrap()
        trainer.add_callback(_Callback())

    def _begin(self, state: Any) -> None:
        k, t = state.global_step, self.trainer
        live = {"model": t.model, "optimizer": t.optimizer, "scheduler": t.lr_scheduler,
                "framework_state": {"global_step": k, "max_steps": state.max_steps}}
        if self._chosen is not None:
            c = self._chosen.at(k, **live)
        elif k == self.step and self._cap is None:
            c = cap.StepCapture(self._out, step=k, framework=FRAMEWORK, base_model_dir=self._base_dir,
                                config=self._config, base_model=self._base_model, **live)
        else:
            c = None
        if c is not None:
            self._cap, self._grad_norm = c, None
            c.begin()

    def _wrap(self) -> None:
        t: Any = self.trainer
        compute_loss, training_step, get_grad_norm = t.compute_loss, t.training_step, t._get_grad_norm

        def recording_compute_loss(model: Any, inputs: dict[str, Any], *a: Any, **kw: Any) -> Any:
            c = self._cap
            if c is not None and c.active:
                c.record(inputs, {"num_items_in_batch": kw.get("num_items_in_batch")},
                         sync_gradients=bool(t.accelerator.sync_gradients),
                         accumulation_steps=int(t.current_gradient_accumulation_steps))
            return compute_loss(model, inputs, *a, **kw)

        def summing_training_step(*a: Any, **kw: Any) -> Any:
            loss = training_step(*a, **kw)
            c = self._cap
            if c is not None and c.active:
                c.add_loss(float(loss))
            return loss

        def noting_grad_norm(*a: Any, **kw: Any) -> Any:
            g = get_grad_norm(*a, **kw)
            c = self._cap
            if c is not None and c.active:
                self._grad_norm = float(g) if g is not None else None
            return g

        t.compute_loss, t.training_step, t._get_grad_norm = (recording_compute_loss, summing_training_step,
                                                             noting_grad_norm)

    @property
    def result(self) -> cap.CaptureResult:
        """The finished capture of ``step=K``; refused when step K has not run (train() ended earlier)."""
        if self._chosen is not None:
            raise cap.CaptureError("several steps were captured; their results are in steps_result",
                                   where=str(self._out), hint="use steps_result.step(K) or steps_result.captured")
        if self._cap is None or self._cap.result is None:
            raise cap.CaptureError(f"optimizer step {self.step} was not captured (training ended before it "
                                   "completed)", where=str(self._out), hint="train for at least step + 1 steps")
        return self._cap.result

    @property
    def steps_result(self) -> cap.StepsResult:
        """The capture of ``steps=[...]`` once training ended: captured steps, those never completed
        (``not_captured``; ``step(K)`` refuses them) and metrics.json; refused before ``train()`` ended."""
        if self._chosen is None:
            raise cap.CaptureError("one step was captured (step=K); its result is in result", where=str(self._out))
        if self._chosen.result is None:
            raise cap.CaptureError("training has not ended: metrics.json is written when train() returns",
                                   where=str(self._out), hint="read steps_result after trainer.train()")
        return self._chosen.result


# -- replay -----------------------------------------------------------------------------------------

def _placeholder_dataset() -> Any:
    """The dataset a replay's trainer is built with (GRPOTrainer requires one): one empty in-memory
    row whose every read raises (a transform), because a replay reads no dataset."""
    from datasets import Dataset

    ds = Dataset.from_dict({"prompt": [""]})
    ds.set_transform(_no_dataset)
    return ds


def _no_dataset(*args: Any, **kwargs: Any) -> Any:
    raise _Refused("a replay read the dataset")


def _no_reward(*args: Any, **kwargs: Any) -> list[float | None]:
    raise _Refused("a replay called a reward function")


def _no_generation(*args: Any, **kwargs: Any) -> Any:
    raise _Refused("a replay tried to generate completions")


_ALIASES = {"activation_checkpointing": "gradient_checkpointing",
            "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs"}
_DERIVED = ("generation_batch_size",)  # GRPOConfig derives it from steps_per_generation (both may not be passed)
_LOCAL = ("output_dir", "logging_dir", "report_to")  # where the replay's trainer would write; never used


def _grpo_config(values: dict[str, Any], out: Path) -> Any:
    """A GRPOConfig built from the captured (and overridden) values, checked to come out equal.

    transformers' deprecated ``gradient_checkpointing*`` names are the ones replayjob records and
    overrides; their ``activation_checkpointing*`` twins are set from them.  Redacted values are not
    passed.  Any field the installed TRL resolves to another value than the capture's is refused.
    """
    from trl import GRPOConfig

    fields = {f.name for f in dataclasses.fields(GRPOConfig) if f.init}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise RefusedError(f"captured GRPOConfig keys {unknown[:5]} are unknown to the installed TRL",
                           where="trl", hint="replay with the TRL version the capture recorded")
    kwargs = {k: v for k, v in values.items() if k not in (*_DERIVED, *_LOCAL) and v != REDACTED}
    for alias, name in _ALIASES.items():
        if name in values:
            kwargs[alias] = values[name]
    for key in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        kwargs[key] = {k: v for k, v in (kwargs.get(key) or {}).items() if v is not None} or None
    args = GRPOConfig(output_dir=str(out / "trainer"), report_to=[], **kwargs)
    built = _trl_config(args)
    off = sorted(k for k, v in values.items()
                 if k not in (*_LOCAL, *_ALIASES) and v != REDACTED and built.get(k) != v)
    if off:
        raise RefusedError(f"the installed TRL resolves GRPOConfig {off[:5]} to other values than the capture "
                           f"({[built.get(k) for k in off[:5]]} vs {[values[k] for k in off[:5]]})", where="trl",
                           hint="replay with the TRL version the capture recorded")
    return args


class TRLSession(ReplaySession):
    """A GRPOTrainer stood at the captured step (see the module docstring)."""

    def __init__(self, adm: Admission, out: Path):
        from peft import LoraConfig
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOTrainer

        m, r = adm.manifest, adm.resolved
        assert m is not None and r is not None
        base = str(r["model"]["path"])
        dtype = getattr(torch, str(r["model"]["dtype"]))
        model: Any = AutoModelForCausalLM.from_pretrained(
            base, dtype=dtype, local_files_only=True, use_safetensors=True,
            attn_implementation=r["model"]["attn_implementation"])
        try:
            tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise RefusedError(f"the base model directory has no loadable tokenizer ({exc})", where=base,
                               hint="save the tokenizer next to the weights (GRPOTrainer needs one to be "
                                    "built; the replay never tokenises)") from None
        peft = {k: v for k, v in r["peft"].items() if k in {f.name for f in dataclasses.fields(LoraConfig)}}
        args = _grpo_config(r[FRAMEWORK], out)
        trainer: Any = GRPOTrainer(model=model, reward_funcs=[_no_reward], args=args,
                                   train_dataset=_placeholder_dataset(), processing_class=tok,
                                   peft_config=LoraConfig(**peft))
        trainer._generate_and_score_completions = _no_generation
        trainer._generate = _no_generation
        trainer._prepare_inputs = lambda inputs: inputs  # the captured dict is what _prepare_inputs returned
        if args.activation_checkpointing:  # as Trainer.train() does before the loop
            gc_kwargs = dict(args.activation_checkpointing_kwargs or {})
            every, offload = gc_kwargs.pop("every_n_layers", 1), gc_kwargs.pop("offload", False)
            trainer.model.activation_checkpointing_enable(activation_checkpointing_kwargs=gc_kwargs or None,
                                                          every_n_layers=every, offload=offload)
        state = m.doc["framework_state"]
        trainer.state.max_steps = int(state["max_steps"])
        wrapped, _ = trainer._prepare_for_training(int(state["max_steps"]), None, None)
        trainer.state.global_step = int(state["global_step"])
        wrapped.zero_grad()
        self.trainer, self.model = trainer, wrapped
        self.optimizer, self.scheduler = trainer.optimizer, trainer.lr_scheduler
        self.device = trainer.args.device
        self._before_loss: Callable[[], None] = _no_generation
        compute_loss, backward = trainer.compute_loss, trainer.accelerator.backward

        def restoring_compute_loss(model: Any, inputs: dict[str, Any], *a: Any, **kw: Any) -> Any:
            self._before_loss()
            return compute_loss(model, inputs, *a, **kw)

        def timed_backward(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return backward(*a, **kw)
            finally:
                self.backward_wall_s += time.perf_counter() - t0

        trainer.compute_loss = restoring_compute_loss
        trainer.accelerator.backward = timed_backward

    def micro_batch(self, mb: cap.MicroBatch, inputs: dict[str, Any], call: dict[str, Any],
                    before_loss: Callable[[], None]) -> float:
        t = self.trainer
        t.accelerator.gradient_state._set_sync_gradients(mb.sync_gradients)
        t.current_gradient_accumulation_steps = mb.accumulation_steps
        self._before_loss = before_loss
        ctx = contextlib.nullcontext() if mb.sync_gradients else t.accelerator.no_sync(model=self.model)
        with ctx:
            loss = t.training_step(self.model, inputs, call.get("num_items_in_batch"))
        return float(loss)

    def step(self) -> float:
        from transformers.trainer import GreedyLR

        t = self.trainer
        grad_norm = t._clip_grad_norm(self.model) if t.args.max_grad_norm > 0 else None
        grad_norm = t._get_grad_norm(self.model, grad_norm=grad_norm)
        t.optimizer.step()
        if not t.accelerator.optimizer_step_was_skipped and not isinstance(
                t.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau | GreedyLR):
            t.lr_scheduler.step()
        self.model.zero_grad()
        return float(grad_norm)

    def runtime(self, rows: tuple[int, ...]) -> knobs.Runtime:
        """TRL's knobs are observed on the trainer's own (PEFT) model and the trainer."""
        return knobs.Runtime(self.trainer.model, rows, trainer=self.trainer)


def build_replay(adm: Admission, out: Path) -> TRLSession:
    """The integration registry's entry point: TRL's trainer stood at the captured step."""
    return TRLSession(adm, out)
