"""The recompute for a TRL ``GRPOTrainer`` capture.

The trainer is stood at step K exactly as a replay stands it (:mod:`replayjob.producers.api.admission`,
the framework's session, the captured adapter loaded and re-hashed); then, per captured micro-batch,
TRL's own per-token logprob function (``GRPOTrainer._get_per_token_logps_and_entropies``: the
fused LM head at ``args.temperature``) recomputes the completions' logprobs in eval mode under
``torch.no_grad``, and a plain forward of the same model gives the logits the temperature and
truncation hypotheses need.  No generation, no reward, no update.

Sources, by what produced them (TRL's input names in parentheses):

* ``sampler`` (``sampling_per_token_logps``): the inference engine's logprobs, present only with vLLM
  (or a ``rollout_func``);
* ``trainer_old`` (``old_per_token_logps``): the trainer's own logprobs at generation time, computed
  in train mode (LoRA dropout active), present only when generations are reused
  (``num_iterations > 1``, or ``steps_per_generation`` not matching the accumulation) or the vLLM
  importance-sampling correction is on.

Policy lag: TRL generates every ``steps_per_generation * num_iterations`` micro-steps and reuses the
buffer in between, so a micro-batch of step K was generated at micro-step ``g = s - s % every``
(``s`` its own micro-step) with the weights of optimizer step ``g // gradient_accumulation_steps``;
the lag is K minus that step.  A capture records ``s`` at the step's start
(``framework_state.logprobs.micro_step``); without it ``s = K * gradient_accumulation_steps`` (a run
that started at step 0) is assumed and said.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replayjob.artifacts.capture_manifest import PinnedManifest
from replayjob.errors import UsageError
from replayjob.mismatch import admitted
from replayjob.mismatch.builtin import routing_pass
from replayjob.mismatch.report import Report, build
from replayjob.mismatch.views import Collector, Side, Source, Views, check_token_aligned
from replayjob.model import moe
from replayjob.producers import producer_module
from replayjob.producers.api import microbatch as _microbatch
from replayjob.producers.api.replay import load_state
from replayjob.rl.logprobs import logprobs_of, truncate
from replayjob.runtime import determinism

if TYPE_CHECKING:
    import torch
    from torch import Tensor

TRAINER_LAYOUT = "TRL: prompts left-padded, completions right-padded, no position ids"
SAMPLER_LAYOUT = "each sequence alone, unpadded (an inference engine's layout; assumed)"
NAMES = {"sampling_per_token_logps": "sampler", "old_per_token_logps": "trainer_old"}
DESCRIPTIONS = {
    "sampler": "the inference engine's log-probability of each token it drew (TRL's sampling_per_token_logps)",
    "trainer_old": "the trainer's own logprobs at generation time, in train mode with LoRA dropout active "
                   "(TRL's old_per_token_logps), not the sampler's",
}


def check(config: Path, overrides: list[str], bound: str | Path | None, allow_lag: bool,
          manifest: PinnedManifest | None = None) -> Report:
    """``replayjob mismatch`` for an integration replay config (see the module docstring)."""
    adm, declared = admitted.admit(config, overrides, bound, manifest, "trl",
                                   "a {framework!r} capture records no sampler or old logprobs replayjob can name",
                                   hint="replayjob mismatch reads replayjob's own captures, TRL's and verl's")
    m = adm.manifest
    assert m is not None and adm.micro_batches is not None and adm.resolved is not None
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="replayjob-mismatch-") as tmp:
        determinism.establish(strict=False, seed=None)
        session = producer_module("trl").build_replay(adm, Path(tmp))
        determinism.mark_model_built(False)
        load_state(adm, session)
        views = recompute(session, adm.micro_batches, adm.resolved, m.doc["framework_state"], m.step)
    capture_doc = {"config": str(config), "manifest": str(m.path), "manifest_sha256": m.sha256,
                   "framework": "trl", "step": m.step}
    rep = build(capture_doc, views, declared, allow_lag, time.perf_counter() - t0)
    if not rep.sources:  # the built-in hint (capture again: its sampler records logprobs) does not hold for TRL
        rep.decision = {**rep.decision, "hint": NO_SOURCE_HINT}
    return rep


# What makes a TRL run keep a logprob source replayjob can compare with the trainer (logprob_record's rule).
NO_SOURCE_HINT = ("TRL keeps the sampler's logprobs only with use_vllm=True (or a rollout_func) and its own old "
                  "logprobs only when generations are reused (num_iterations > 1, or steps_per_generation > "
                  "gradient_accumulation_steps) or the vLLM correction is on: capture a step of a run with one of "
                  "these")


def sides(trl: dict[str, Any], state: dict[str, Any] | None = None) -> tuple[Side, Side]:
    """The trainer's side runs in the precision the capture recorded (``framework_state.precision``: the autocast
    dtype of the loss's forward, bf16 under TRL's default ``bf16=True``), the sampler's is not recorded."""
    t = float(trl.get("temperature") or 1.0)
    autocast = ((state or {}).get("precision") or {}).get("autocast") or {}
    dtype = str(autocast["dtype"]) if autocast.get("enabled") and autocast.get("dtype") else "model"
    trainer = Side(temperature=t, dtype=dtype, layout=TRAINER_LAYOUT)
    sampler = Side(temperature=t, top_k=int(trl.get("top_k") or 0), top_p=float(trl.get("top_p") or 1.0),
                   dtype="model", layout=SAMPLER_LAYOUT, recorded=False)
    return trainer, sampler


def lags(trl: dict[str, Any], state: dict[str, Any], step: int, micro_batches: int) -> tuple[list[int], str]:
    """Per micro-batch, the optimizer steps between the weights that generated it and step K."""
    ga = int(trl.get("gradient_accumulation_steps") or 1)
    every = int(trl.get("steps_per_generation") or ga) * int(trl.get("num_iterations") or 1)
    raw = state.get("logprobs")
    record: dict[str, Any] = raw if isinstance(raw, dict) else {}
    first = record.get("micro_step")
    how = "recorded by the capture"
    if not isinstance(first, int):
        first, how = step * ga, "assumed: a run started at step 0"
    out = []
    for j in range(micro_batches):
        s = first + j
        out.append(step - (s - s % every) // ga)
    reason = (f"TRL generates every steps_per_generation x num_iterations = {every} micro-steps and reuses the "
              f"buffer; this step's micro-batches start at micro-step {first} ({how}), generated with the weights "
              f"of step(s) {sorted({step - lag for lag in out})}")
    return out, reason


def _forward_logits(model: torch.nn.Module, ids: Tensor, att: Tensor, keep: int) -> Tensor:
    return model(input_ids=ids, attention_mask=att).logits[:, -keep - 1:-1, :].float()


def recompute(session: Any, mbs: list[_microbatch.MicroBatch], resolved: dict[str, Any], state: dict[str, Any],
              step: int) -> Views:
    import torch
    trl = resolved.get("trl", {})
    trainer_side, sampler_side = sides(trl, state)
    trainer, model, dev = session.trainer, session.model, session.device
    for mb in mbs:
        missing = [k for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask") if k not in mb.inputs]
        if missing:
            raise UsageError(f"the captured micro-batches have no {missing}: not a GRPOTrainer's loss inputs",
                             where="payload")
    present = [name for name in NAMES if all(name in mb.inputs for mb in mbs)]
    lag, lag_reason = lags(trl, state, step, len(mbs))
    masks = [mb.inputs["completion_mask"].bool() for mb in mbs]
    row_parts: list[Tensor] = []
    pos_parts: list[Tensor] = []
    tok_parts: list[Tensor] = []
    pad_parts: list[Tensor] = []
    src_parts: dict[str, list[Tensor]] = {n: [] for n in present}
    base = 0
    for k, (mb, mask) in enumerate(zip(mbs, masks, strict=True)):
        check_token_aligned(k, mb.inputs, "completion_mask", ["completion_ids", *present],
                            ("prompt_ids", "prompt_mask"))
        b, c = mask.shape
        row_parts.append((torch.arange(b)[:, None].expand(b, c) + base)[mask])
        pos_parts.append(torch.arange(c)[None, :].expand(b, c)[mask])
        tok_parts.append(mb.inputs["completion_ids"][mask].to(torch.int64))
        pm = mb.inputs["prompt_mask"]
        pad_parts.append((pm.shape[1] - pm.sum(-1)).to(torch.int64)[:, None].expand(b, c)[mask])
        for n in present:
            src_parts[n].append(mb.inputs[n][mask].double())
        base += b
    sources = [Source(NAMES[n], n, DESCRIPTIONS[NAMES[n]], sampler_side if NAMES[n] == "sampler" else trainer_side,
                      max(lag), lag_reason, torch.cat(src_parts[n])) for n in present]
    col = Collector(torch.cat(row_parts), torch.cat(pos_parts), torch.cat(tok_parts), torch.cat(pad_parts),
                    trainer_side, sampler_side, sources)
    col.views.prompt_len = torch.cat([mb.inputs["prompt_mask"].sum(-1).to(torch.int64) for mb in mbs])
    routing = moe.observe(model) if getattr(session, "world", 1) == 1 else None  # an MoE model's routers
    was_training = model.training
    model.eval()
    timings: dict[str, float] = {}
    agree = 0.0
    with torch.no_grad():
        try:
            t0 = time.perf_counter()
            start, first = 0, 0
            with routing_pass(routing, "trainer", col.views.routing) as observe:
                for mb, mask in zip(mbs, masks, strict=True):
                    ids, att, keep = _inputs(mb, dev)
                    with observe(list(range(first, first + int(mask.shape[0]))), att):  # TRL's forward is recorded
                        lp, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, att, keep)
                        logits = _forward_logits(model, ids, att, keep)
                    first += int(mask.shape[0])
                    m = mask.to(dev)
                    values = lp[m]
                    y = ids[:, -keep:][m]
                    plain = logprobs_of(logits[m], y, trainer_side.temperature)
                    agree = max(agree, float((plain - values).abs().max()))
                    col.trainer_chunk(start, values, logits[m])
                    start += int(values.numel())
            timings["trainer"] = time.perf_counter() - t0
            if any(bool((s.values != col.views.trainer).any()) for s in sources):
                _alone(col, trainer, model, mbs, masks, dev, "padding", trainer_side, timings, routing)
                _alone(col, trainer, model, mbs, masks, dev, "combined", sampler_side, timings, routing)
                ours, theirs = col.views.routing.get("trainer"), col.views.routing.get("combined")
                if ours is not None and theirs is not None and moe.compare(ours, theirs)["flipped"]:
                    _forced(col, trainer, model, mbs, masks, dev, theirs, routing, timings)
        finally:
            model.train(was_training)
    views = col.finish()
    views.passes = [f"{name} ({seconds:.3f} s)" for name, seconds in timings.items()]
    views.notes.append(f"TRL's per-token function and log_softmax(logits / {trainer_side.temperature:g}) of a plain "
                       f"forward agree to {agree:.3g} (the temperature and truncation tests use the latter)")
    views.notes.append("the recompute runs in eval mode: no LoRA dropout, unlike TRL's train-mode logprobs")
    if not sources:
        views.notes.append("this run records no logprob source: TRL keeps sampling_per_token_logps only with vLLM "
                           "(or a rollout_func) and old_per_token_logps only when generations are reused or the vLLM "
                           "correction is on")
    return views


def _inputs(mb: _microbatch.MicroBatch, dev: torch.device) -> tuple[Tensor, Tensor, int]:
    import torch
    ins = mb.inputs
    ids = torch.cat([ins["prompt_ids"], ins["completion_ids"]], dim=1).to(dev)
    att = torch.cat([ins["prompt_mask"], ins["completion_mask"]], dim=1).to(dev)
    return ids, att, int(ins["completion_ids"].shape[1])


def _alone(col: Collector, trainer: Any, model: torch.nn.Module, mbs: list[_microbatch.MicroBatch], masks: list[Tensor],
           dev: torch.device, test: str, side: Side, timings: dict[str, float],
           routing: moe.Routing | None = None) -> None:
    """Each sequence alone and unpadded, through TRL's function (``padding``) or with every recorded sampler
    setting (``combined``: the sampler's side, its routing recorded as the sampler's)."""
    import torch
    t0 = time.perf_counter()
    start, row = 0, 0
    with routing_pass(routing, test, col.views.routing, sampler_side=test == "combined") as observe:
        for mb, mask in zip(mbs, masks, strict=True):
            ins = mb.inputs
            for r in range(mask.shape[0]):
                row += 1
                prompt = ins["prompt_ids"][r][ins["prompt_mask"][r].bool()]
                completion = ins["completion_ids"][r][mask[r]]
                n = int(completion.numel())
                if n == 0:
                    continue  # nothing to compare (and no routing table: not every row is routed)
                ids = torch.cat([prompt, completion])[None, :].to(dev)
                att = torch.ones_like(ids)
                with observe([row - 1], att):
                    if test == "padding":
                        values = trainer._get_per_token_logps_and_entropies(model, ids, att, n)[0][0]
                    else:
                        logits = truncate(_forward_logits(model, ids, att, n)[0] / side.temperature, side.top_k,
                                          side.top_p)
                        values = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, -n:, None]).squeeze(-1)
                col.hypothesis(test, "each sequence alone, unpadded (TRL's function)" if test == "padding" else
                               "every recorded sampler setting at once (unpadded, temperature, truncation)", start,
                               values)
                start += n
    timings[test] = time.perf_counter() - t0


def _forced(col: Collector, trainer: Any, model: torch.nn.Module, mbs: list[_microbatch.MicroBatch],
            masks: list[Tensor], dev: torch.device, table: moe.RoutingTable, routing: moe.Routing | None,
            timings: dict[str, float]) -> None:
    """The ``routing`` pass: TRL's function over the captured micro-batches with the sampler-side experts forced."""
    t0 = time.perf_counter()
    start, first = 0, 0
    with routing_pass(routing, "routing", col.views.routing, forced=table) as observe:
        for mb, mask in zip(mbs, masks, strict=True):
            ids, att, keep = _inputs(mb, dev)
            with observe(list(range(first, first + int(mask.shape[0]))), att):
                values = trainer._get_per_token_logps_and_entropies(model, ids, att, keep)[0][mask.to(dev)]
            first += int(mask.shape[0])
            col.hypothesis("routing", "TRL's function with the sampler-side pass's experts forced", start, values)
            start += int(values.numel())
    timings["routing"] = time.perf_counter() - t0
