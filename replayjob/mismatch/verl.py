"""The recompute for a verl actor-update capture (:mod:`replayjob.producers.verl.producer`).

verl's engine is rebuilt at step K exactly as a replay rebuilds it (admission, the verl session, the captured
parameters loaded and re-hashed); then the trainer's per-token logprobs of the captured responses are recomputed
by verl's own log-prob path, as ``RayPPOTrainer._compute_old_log_prob`` computes ``old_log_probs`` (the engine's
``infer_batch`` in eval mode with ``compute_loss=False``, then ``no_padding_2_padding``), and a plain forward of
each row alone gives the logits the temperature and truncation hypotheses need.  No generation, no update.

Sources, by what produced them (verl's batch keys in parentheses):

* ``sampler`` (``rollout_log_probs``): the rollout engine's logprobs of the tokens it drew, present when the run
  sets ``actor_rollout_ref.rollout.calculate_log_probs=True``;
* ``trainer_old`` (``old_log_probs``): the actor's own logprobs of the batch before the update, by the same path.

Policy lag: verl computes both before an update's first optimizer step (a synchronous rollout is assumed), and the
update runs ``ppo_epochs`` x mini-batches steps, so the captured step (``framework_state.position``: epoch ``e``,
mini-batch ``j`` of ``M``) sees weights ``e * M + j`` steps newer.  The report carries verl's own metrics
(``training/rollout_probs_diff_*``, ``training/rollout_actor_probs_pearson_corr``, by verl's
``calculate_debug_metrics``) for the sampler against ``old_log_probs``, as verl logs them, and against the
recompute, under ``capture.verl_metrics``.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replayjob.artifacts.capture_manifest import PinnedManifest
from replayjob.errors import UsageError
from replayjob.mismatch import admitted
from replayjob.mismatch.report import Report, build
from replayjob.mismatch.views import Collector, Side, Source, Views, check_token_aligned
from replayjob.producers import producer_module
from replayjob.producers.api import microbatch as _microbatch
from replayjob.producers.verl.producer import decode_batch
from replayjob.runtime import determinism

if TYPE_CHECKING:
    from torch import Tensor

FRAMEWORK = "verl"
TRAINER_LAYOUTS = {True: "verl, remove-padding: each micro-batch's rows packed into one sequence",
                   False: "verl, padded: each micro-batch's rows right-padded to its longest"}
SAMPLER_LAYOUT = "each sequence alone, unpadded (the rollout engine's layout; assumed)"
NAMES = {"rollout_log_probs": "sampler", "old_log_probs": "trainer_old"}
DESCRIPTIONS = {
    "sampler": "the rollout engine's log-probability of each token it drew (verl's rollout_log_probs)",
    "trainer_old": "the actor's own logprobs of the batch before the update (verl's old_log_probs)",
}
NO_SOURCE_HINT = ("verl keeps the rollout's logprobs only with actor_rollout_ref.rollout.calculate_log_probs=True "
                  "(rollout_log_probs), and the actor's old_log_probs unless the loss needs none: capture a step of a "
                  "run with them")
# verl's debug metrics (verl.utils.debug.metrics.calculate_debug_metrics): sampler against trainer, verl's names
METRIC_PAIRS = {"rollout_log_probs vs old_log_probs": "old_log_probs",
                "rollout_log_probs vs the recompute": "recompute"}


def check(config: Path, overrides: list[str], bound: str | Path | None, allow_lag: bool,
          manifest: PinnedManifest | None = None) -> Report:
    """``replayjob mismatch`` for a verl capture's replay config (see the module docstring)."""
    adm, declared = admitted.admit(config, overrides, bound, manifest, FRAMEWORK,
                                   "a {framework!r} capture is not a verl capture")
    m = adm.manifest
    assert m is not None and adm.micro_batches is not None and adm.resolved is not None
    t0 = time.perf_counter()
    # verl prints its progress on stdout while it builds the engine: to stderr, so that --json stays one document
    with tempfile.TemporaryDirectory(prefix="replayjob-mismatch-") as tmp, contextlib.redirect_stdout(sys.stderr):
        determinism.establish(strict=False, seed=None)
        session = producer_module(FRAMEWORK).build_replay(adm, Path(tmp)).bind(adm)
        determinism.mark_model_built(False)
        session.restore()
        views, verl_metrics = recompute(session, adm.micro_batches, m.doc["framework_state"], m.step)
    capture_doc = {"config": str(config), "manifest": str(m.path), "manifest_sha256": m.sha256,
                   "framework": FRAMEWORK, "step": m.step, "verl_metrics": verl_metrics}
    rep = build(capture_doc, views, declared, allow_lag, time.perf_counter() - t0)
    if not rep.sources:
        rep.decision = {**rep.decision, "hint": NO_SOURCE_HINT}
    return rep


def lag_of(state: dict[str, Any], step: int) -> tuple[int | None, str]:
    """Optimizer steps between the weights that computed the batch's logprobs and the captured step's."""
    pos = state.get("position")
    if not isinstance(pos, dict) or not all(isinstance(pos.get(k), int) for k in
                                            ("epoch", "mini_batch", "mini_batches_per_epoch")):
        return None, "the capture records no position within its update"
    lag = pos["epoch"] * pos["mini_batches_per_epoch"] + pos["mini_batch"]
    return lag, (f"verl computes rollout and old logprobs before an update's first optimizer step (a synchronous "
                 f"rollout assumed); step {step} is mini-batch {pos['mini_batch']} of {pos['mini_batches_per_epoch']} "
                 f"in epoch {pos['epoch']} of its update, {lag} step(s) later")


def sides(data: Any, observed: dict[str, Any], packed: bool) -> tuple[Side, Side]:
    """The trainer's side at the batch's temperature in the engine's compute dtype; the sampler's settings beyond
    the temperature (top-k, top-p) are the rollout's, which the actor's batch does not carry."""
    from verl.utils import tensordict_utils as tu

    t = float(tu.get_non_tensor_data(data, "temperature", 1.0) or 1.0)
    param = observed.get("mixed_precision.param_dtype")
    dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}.get(str(param), "model")
    return (Side(temperature=t, dtype=dtype, layout=TRAINER_LAYOUTS[packed]),
            Side(temperature=t, dtype="model", layout=SAMPLER_LAYOUT, recorded=False))


def verl_logprobs(session: Any, data: Any) -> Tensor:
    """verl's own old-logprob path on the captured batch: ``[rows, max_response_len]``."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    tu.assign_non_tensor(data, calculate_entropy=False, compute_loss=False)
    with session.engine.eval_mode(disable_auto_offload=True):
        out = session.engine.infer_batch(data, loss_function=None)
    return no_padding_2_padding(out["model_output"]["log_probs"], data).float()


def recompute(session: Any, mbs: list[_microbatch.MicroBatch], state: dict[str, Any],
              step: int) -> tuple[Views, dict[str, Any]]:
    import torch

    lag, lag_reason = lag_of(state, step)
    observed = session.observed
    row_parts: list[Tensor] = []
    pos_parts: list[Tensor] = []
    tok_parts: list[Tensor] = []
    src_parts: dict[str, list[Tensor]] = {n: [] for n in NAMES}
    batches = []
    for k, mb in enumerate(mbs):
        for key in ("responses", "response_mask", "prompts"):
            if key not in mb.inputs:
                raise UsageError(f"the captured batch has no {key!r}: not a verl actor update's batch", where="payload")
        check_token_aligned(k, mb.inputs, "response_mask",
                            ["responses", *(n for n in NAMES if n in mb.inputs)])
        batches.append(decode_batch({**mb.inputs, **mb.input_values}, session.engine_values))
    present = [n for n in NAMES if all(n in mb.inputs for mb in mbs)]
    trainer_side, sampler_side = sides(batches[0], observed, bool(session.engine_values.get("use_remove_padding")))
    base = 0
    for mb in mbs:
        mask = mb.inputs["response_mask"].bool()
        b, r = mask.shape
        row_parts.append((torch.arange(b)[:, None].expand(b, r) + base)[mask])
        pos_parts.append(torch.arange(r)[None, :].expand(b, r)[mask])
        tok_parts.append(mb.inputs["responses"][mask].to(torch.int64))
        for n in present:
            src_parts[n].append(mb.inputs[n][mask].double())
        base += b
    sources = [Source(NAMES[n], n, DESCRIPTIONS[NAMES[n]], sampler_side if NAMES[n] == "sampler" else trainer_side,
                      lag, lag_reason, torch.cat(src_parts[n])) for n in present]
    tokens = torch.cat(tok_parts)
    col = Collector(torch.cat(row_parts), torch.cat(pos_parts), tokens, torch.zeros_like(tokens), trainer_side,
                    sampler_side, sources)
    timings: dict[str, float] = {}
    agree = 0.0
    recomputed: list[Tensor] = []
    t0 = time.perf_counter()
    start = 0
    for mb, data in zip(mbs, batches, strict=True):
        lp = verl_logprobs(session, data)
        recomputed.append(lp)
        mask = mb.inputs["response_mask"].bool()
        logits = row_logits(session, mb, trainer_side.temperature)
        values = lp[mask]
        plain = torch.log_softmax(logits / trainer_side.temperature, dim=-1).gather(
            -1, tokens[start:start + values.numel(), None]).squeeze(-1)
        agree = max(agree, float((plain - values).abs().max())) if values.numel() else agree
        col.trainer_chunk(start, values, logits)
        start += int(values.numel())
    timings["trainer"] = time.perf_counter() - t0
    views = col.finish()
    views.passes = [f"{name} ({seconds:.3f} s)" for name, seconds in timings.items()]
    views.notes.append(f"verl's log-prob path (the engine's infer_batch, as old_log_probs are computed) and "
                       f"log_softmax(logits / {trainer_side.temperature:g}) of a forward of each row alone agree to "
                       f"{agree:.3g} (the temperature and truncation tests use the latter)")
    views.notes.append("the sampler's top-k and top-p are the rollout's settings, which the actor's batch does not "
                       "carry: assumed off")
    metrics = debug_metrics(mbs, recomputed) if "rollout_log_probs" in present else {}
    for pair, figures in metrics.items():
        views.notes.append(f"verl's metrics, {pair}: " + ", ".join(f"{k} = {v:.6g}" for k, v in figures.items()))
    if not sources:
        views.notes.append("this capture records no logprob source: " + NO_SOURCE_HINT)
    return views, metrics


def row_logits(session: Any, mb: _microbatch.MicroBatch, temperature: float) -> Tensor:
    """Float32 logits ``[response tokens, vocab]`` (undivided) of each row's response, from a forward of the row
    alone (its prompt and response unpadded, positions from 0) in the engine's autocast dtype."""
    import contextlib

    import torch

    ids = mb.inputs["input_ids"]
    offsets = mb.inputs["input_ids" + "__offsets"]
    mask = mb.inputs["response_mask"].bool()
    autocast = getattr(session.engine, "_autocast_dtype", torch.float32)
    ctx = (contextlib.nullcontext() if autocast == torch.float32
           else torch.autocast(device_type=session.device.type, dtype=autocast))
    model = session.model
    was = model.training
    model.eval()
    out = []
    try:
        with torch.no_grad(), ctx:
            for r in range(mask.shape[0]):
                seq = ids[int(offsets[r]):int(offsets[r + 1])].to(session.device)
                n = int(mask[r].sum())
                if n == 0:
                    continue
                logits = model(input_ids=seq[None], position_ids=torch.arange(seq.numel(), device=seq.device)[None],
                               use_cache=False).logits[0].float()
                out.append(logits[seq.numel() - n - 1:seq.numel() - 1])
    finally:
        model.train(was)
    return torch.cat(out).cpu()


def debug_metrics(mbs: list[_microbatch.MicroBatch], recomputed: list[Tensor]) -> dict[str, dict[str, float]]:
    """verl's own rollout-vs-actor metrics (``calculate_debug_metrics``) for the sampler against ``old_log_probs``
    (what verl logs) and against the recompute, over the captured batch."""
    import torch
    from verl import DataProto
    from verl.utils.debug.metrics import calculate_debug_metrics

    cat = {k: torch.cat([mb.inputs[k] for mb in mbs]) for k in ("rollout_log_probs", "old_log_probs",
                                                                "response_mask", "responses")}
    out = {}
    for pair, trainer in METRIC_PAIRS.items():
        actor = cat["old_log_probs"] if trainer == "old_log_probs" else torch.cat(recomputed)
        data = DataProto.from_dict(tensors={"rollout_log_probs": cat["rollout_log_probs"].float(),
                                            "old_log_probs": actor.float(), "response_mask": cat["response_mask"],
                                            "responses": cat["responses"]})
        out[pair] = {k: float(v) for k, v in calculate_debug_metrics(data).items()}
    return out
