"""The TRL config a capture records is read through its declaration (``replayjob.producers.trl.fields.DOMAINS``) and
against the rest of the capture: a manifest re-sealed by a forger who recomputes every digest and pin (the config's
and the contract's SHA-256, the manifest pin) with a field of the wrong type, out of its range, unknown or missing,
or contradicting the captured micro-batches, optimizer state or framework state was admitted and then replayed (exit
0) or failed while the trainer was built (exit 3).  Refused by ``explain`` and ``replay`` alike (exit 2), naming the
field and the rule, before any model is built."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from replayjob.digest import sha256_json
from replayjob.producers.trl import fields as trl_fields
from replayjob.redact import redact


def _config(**values: Any) -> Callable[[dict[str, Any], dict[str, Any]], None]:
    """Set (or, with ``...``, delete) recorded ``trl`` fields; the config's and the contract's digests recomputed."""
    def edit(tensors: dict[str, Any], doc: dict[str, Any]) -> None:
        from replayjob.producers.trl import producer
        t = doc["config"]["resolved"]["trl"]
        for k, v in values.items():
            if v is ...:
                t.pop(k)
            else:
                t[k] = v
        doc["config"]["sha256"] = sha256_json(doc["config"]["resolved"])
        contract = redact(producer.contract(doc["config"]["resolved"]))
        doc["contract"] = {"sha256": sha256_json(contract), "value": contract}
    return edit


@pytest.mark.parametrize(("values", "named"), [
    ({"loss_type": 123}, "trl.loss_type is 123; it takes one of 'grpo'"),
    ({"loss_type": "bogus"}, "trl.loss_type is 'bogus'"),
    ({"beta": "0.04"}, "trl.beta is '0.04'; it takes a finite number >= 0"),
    ({"epsilon": True}, "trl.epsilon is True"),
    ({"num_generations": 0}, "trl.num_generations is 0; it takes an integer >= 2"),
    ({"num_generations": 4.0}, "trl.num_generations is 4.0"),
    ({"num_generations": 3}, "is not whole groups of num_generations 3"),
    ({"importance_sampling_level": "bogus"}, "trl.importance_sampling_level is 'bogus'"),
    ({"temperature": 0.0}, "trl.temperature is 0.0; it takes a finite number > 0"),
    ({"max_steps": 10}, "trl.max_steps is 10, but framework_state.max_steps is 3"),
    ({"per_device_train_batch_size": 2}, "micro-batch 0 holds 4 rows, but trl.per_device_train_batch_size is 2"),
    ({"max_completion_length": 2}, "beyond trl.max_completion_length 2"),
    ({"lr_scheduler_type": "bogus"}, "trl.lr_scheduler_type is 'bogus'"),
    ({"optim": "sgd"}, "trl.optim is 'sgd', but the captured optimizer's param groups hold no 'momentum'"),
    ({"bf16": True}, "records mixed precision 'no'"),
    ({"warmup_steps": -1}, "trl.warmup_steps is -1"),
    ({"adam_beta1": 1.5}, "trl.adam_beta1 is 1.5; it takes a finite number in [0, 1)"),
    ({"gradient_checkpointing_kwargs": {"use_reentrant": "x"}}, "trl.gradient_checkpointing_kwargs is"),
    ({"activation_checkpointing": True}, "trl.activation_checkpointing is True, but trl.gradient_checkpointing"),
    ({"use_vllm": True}, "micro-batch 0 holds no importance_sampling_ratio"),
    ({"loss_type": "vespo", "use_vllm": True, "vllm_importance_sampling_correction": True,
      "vllm_importance_sampling_mode": "sequence_mask"}, "trl.loss_type 'vespo' with the vLLM correction takes"),
    ({"foo": 1}, "trl.foo is no field of TRL's"),
    ({"loss_type": ...}, "trl.loss_type is missing"),
    ({"lr_scheduler_kwargs": "x"}, "trl.lr_scheduler_kwargs is 'x'; it takes a table or null"),
])
def test_a_resealed_trl_config_no_trainer_resolves_to_is_refused(
        values: dict[str, Any], named: str, trl_capture: dict[str, Any], tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from test_capture_domains import refused_before_a_model

    refused_before_a_model(_config(**values), named, trl_capture, tmp_path, capsys, monkeypatch)


def test_the_declared_domains_cover_the_installed_trl() -> None:
    """Every contract and knob field has a domain; GRPO_ONLY is exactly the contract and knob fields RLOOConfig lacks;
    the scheduler names are the installed transformers'; and what the installed TRL resolves its defaults to is
    admitted."""
    trl = pytest.importorskip("trl")
    from transformers.trainer_utils import SchedulerType

    from replayjob.producers.trl.producer import _trl_config
    update = {n for n, f in trl_fields.FIELDS.items() if f.kind in (trl_fields.CONTRACT, trl_fields.KNOB)}
    assert set(trl_fields.DOMAINS) == update
    grpo = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    rloo = {f.name for f in dataclasses.fields(trl.RLOOConfig)}
    assert update & (grpo - rloo) == trl_fields.GRPO_ONLY and not update & (rloo - grpo)
    assert set(trl_fields.SCHEDULERS) == {s.value for s in SchedulerType}
    for cls, trainer in ((trl.GRPOConfig, "GRPOTrainer"), (trl.RLOOConfig, "RLOOTrainer")):
        values = _trl_config(cls(output_dir="unused", report_to=[], use_cpu=True))
        assert trl_fields.config_reasons(values, trainer) == [], cls


@pytest.mark.parametrize(("override", "named"), [
    ("trl.beta=nan", "trl.beta: nan is not a finite number"),
    ("trl.beta=1e400", "trl.beta: inf is not a finite number"),
    ("trl.gradient_checkpointing_kwargs={use_reentrant=-inf}",
     "trl.gradient_checkpointing_kwargs.use_reentrant: -inf is not a finite number"),
])
def test_a_non_finite_override_is_refused_naming_its_key(
        override: str, named: str, trl_capture: dict[str, Any], capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    """A NaN or Inf in a replay config's framework or model table: refused before admission, naming the key (it was
    refused by the JSON writer with a message naming neither the key nor the rule)."""
    from test_capture_domains import _outcome
    for argv in (["explain", str(trl_capture["dir"] / "replay.toml"), "--set", override],
                 ["replay", str(trl_capture["dir"] / "replay.toml"), "--set", override, "--out", str(tmp_path / "r")]):
        code, text = _outcome(argv, capsys)
        assert code == 2 and named in text and "Traceback" not in text, (argv[0], text)


def _state(change: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any], dict[str, Any]], None]:
    """Edit the recorded ``framework_state`` (no digest covers it but the manifest pin)."""
    def edit(tensors: dict[str, Any], doc: dict[str, Any]) -> None:
        change(doc["framework_state"])
    return edit


@pytest.mark.parametrize(("change", "named"), [
    (lambda s: s.update(foo=1), "framework_state.foo is no key a TRL capture writes"),
    (lambda s: s.update(precision="x"), "framework_state.precision is 'x', not a table"),
    (lambda s: s.update(launch={"requested_processes": 3, "processes": 1}), "framework_state.launch is"),
    (lambda s: s.update(launch={"processes": 1}), "framework_state.launch is"),
    (lambda s: s.update(launch={"requested_processes": None, "processes": True}), "framework_state.launch is"),
    (lambda s: s.pop("launch"), "framework_state.launch is None, not the record of a step run on 1 process"),
    (lambda s: s.update(logprobs="x"), "framework_state.logprobs is 'x', not the record of the step's logprob"),
    (lambda s: s["logprobs"].update(generate_every=0), "framework_state.logprobs is"),
    (lambda s: s["logprobs"]["sources"].update(old_per_token_logps="sampler"), "framework_state.logprobs is"),
])
def test_a_resealed_trl_framework_state_no_capture_writes_is_refused(
        change: Callable[[dict[str, Any]], None], named: str, trl_capture: dict[str, Any], tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorded framework_state typed as a TRL capture writes it: its keys, the launch record (the processes the
    manifest says ran the step) and the logprob record mismatch reads;
    a re-pinned manifest whose state was edited was admitted (and mismatch alone refused a malformed logprob record)."""
    from test_capture_domains import refused_before_a_model

    refused_before_a_model(_state(change), named, trl_capture, tmp_path, capsys, monkeypatch)
