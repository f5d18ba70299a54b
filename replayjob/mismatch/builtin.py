"""The recompute for a capture of replayjob's own trainer.

The model is rebuilt exactly as a replay rebuilds it (admission, determinism controls, the backend,
the pinned start adapter re-hashed as it loads) and runs in eval mode under ``torch.no_grad``: no
sampling, no update.  The trainer's view is :func:`replayjob.rl.logprobs.token_logprobs` at the
temperature the trainer applies, over the update's own right-padded micro-batches.  The sampler's
view is the capture's ``sampler_logprobs``; the trainer's own ``old_logprobs`` (same step, same
function) are the second source.  Both were produced with the weights of step K: no policy lag.

Passes (each a forward over every captured token):

* ``trainer``: the update's layout in the model's dtype (the trainer's values, and from its logits the
  temperature and truncation hypotheses);
* ``precision``: the same layout with the forward under the sampler's autocast dtype (only when the
  sampler ran in another dtype);
* ``padding``: the sampler's layout -- every row's prompt left-padded to the longest prompt of the
  step, the response after it, positions counted from the attention mask -- in the model's dtype;
* ``position``: the sampler's layout with positions counted over the padding (0, 1, 2, ... from the
  first column), the classic left-padding bug;
* ``combined``: the sampler's layout and dtype with its temperature and truncation: the sampler's
  computation, recomputed in one forward;
* ``routing`` (a mixture-of-experts model whose ``combined`` pass routed some token to another expert set
  than the ``trainer`` pass): the trainer's computation with the ``combined`` pass's experts forced
  (:meth:`replayjob.model.moe.Routing.forcing`): the trainer as it would compute with the sampler's routing.

The extra passes run only when some source differs from the trainer's values at all.  On an MoE model every
pass records its routing (:attr:`Views.routing`, one table per pass); the ``combined`` pass is the sampler's
side and routes without the test-only router fault (``REPLAYJOB_ROUTING_FAULT``), which stands for a trainer
whose router differs from the sampler's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from replayjob.config import Config
from replayjob.errors import ContractError
from replayjob.mismatch.views import Collector, Side, Source, Views
from replayjob.model import moe
from replayjob.model.backend import Policy, load_backend
from replayjob.producers.builtin.admission import Admission
from replayjob.rl.batch import OptimizerBatch, micro_batches
from replayjob.rl.logprobs import logprob_temperature, logprobs_of, response_logits, truncate
from replayjob.rl.sampling import precision
from replayjob.rl.state import check_model
from replayjob.runtime import determinism

if TYPE_CHECKING:
    import torch
    from torch import Tensor

TRAINER_LAYOUT = "right-padded micro-batches of training.micro_batch_size rows, positions from the mask"
SAMPLER_LAYOUT = "every row's prompt left-padded to the step's longest prompt, positions from the mask"


def build_policy(cfg: Config, adm: Admission) -> Policy:
    """The policy at the captured step, built as a replay builds it (the start adapter re-hashed)."""
    assert adm.manifest is not None and adm.state is not None
    strict = cfg.backend.options.strict_deterministic
    determinism.establish(strict=strict, seed=cfg.training.seed)
    policy = load_backend(cfg.backend.name).build(cfg)
    determinism.mark_model_built(strict)
    check_model(adm.state, policy.model_reference())
    policy.load_adapter(adm.state.adapter_file, adm.manifest.initial_adapter_sha256)
    return policy


def sides(cfg: Config) -> tuple[Side, Side]:
    """The trainer's and the sampler's settings as the capture's config records them."""
    inf = cfg.inference
    trainer = Side(temperature=logprob_temperature(cfg), dtype="model", layout=TRAINER_LAYOUT)
    sampler = Side(temperature=inf.temperature, top_k=inf.top_k, top_p=inf.top_p, dtype=inf.sampling_dtype,
                   layout=SAMPLER_LAYOUT)
    return trainer, sampler


def sources(batch: OptimizerBatch, trainer: Side, sampler: Side) -> list[Source]:
    lag_reason = "sampled at step K with the weights of step K: the reference trainer samples, then updates"
    out = []
    if batch.sampler_logprobs is not None:
        out.append(Source("sampler", "sampler_logprobs", "the sampler's log-probability of each token it drew, "
                          "under the distribution it drew from", sampler, 0, lag_reason,
                          batch.sampler_logprobs.double()))
    out.append(Source("trainer_old", "old_logprobs", "the trainer's own logprobs at sampling time (eval mode), "
                      "the PPO ratio's denominator", trainer, 0, lag_reason, batch.old_logprobs.double()))
    return out


def token_index(batch: OptimizerBatch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per response token: its row, position, token id and the sampler's left padding of its row."""
    import torch
    resp = (batch.resp_offsets[1:] - batch.resp_offsets[:-1]).to(torch.int64)
    rows = torch.repeat_interleave(torch.arange(batch.rows), resp)
    starts = torch.repeat_interleave(batch.resp_offsets[:-1], resp)
    position = torch.arange(batch.response_tokens()) - starts
    token = torch.cat([batch.row_tokens(i)[int(batch.prompt_lens[i]):] for i in range(batch.rows)])
    longest = int(batch.prompt_lens.max())
    pad = (longest - batch.prompt_lens)[rows]
    return rows, position, token.to(torch.int64), pad.to(torch.int64)


def _trainer_layout(batch: OptimizerBatch, size: int, pad_id: int
                    ) -> Iterator[tuple[list[int], Tensor, Tensor, Tensor]]:
    for mb in micro_batches(batch, size, pad_id):
        yield mb.rows, mb.input_ids, mb.attention_mask, mb.resp_mask > 0


def _sampler_layout(batch: OptimizerBatch, size: int, pad_id: int,
                    plain_positions: bool = False) -> Iterator[tuple[list[int], Tensor, Tensor, Tensor, Tensor]]:
    """Rows as the sampler held them (logical rows first): prompts left-padded to the step's longest,
    responses after."""
    import torch
    longest = int(batch.prompt_lens.max())
    for start in range(0, batch.rows, size):
        rows = list(range(start, min(start + size, batch.rows)))
        resp = [int(batch.resp_offsets[i + 1] - batch.resp_offsets[i]) for i in rows]
        width = longest + max(resp)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
        att = torch.zeros((len(rows), width), dtype=torch.int64)
        mask = torch.zeros((len(rows), width - 1), dtype=torch.bool)
        for j, i in enumerate(rows):
            p, n = int(batch.prompt_lens[i]), resp[j]
            ids[j, longest - p:longest + n] = batch.row_tokens(i)
            att[j, longest - p:longest + n] = 1
            mask[j, longest - 1:longest - 1 + n] = True
        pos = (torch.arange(width).expand(len(rows), width) if plain_positions
               else (att.cumsum(-1) - 1).clamp_min(0))
        yield rows, ids, att, pos, mask


Observe = Callable[[list[int], "Tensor"], contextlib.AbstractContextManager[object]]


@contextlib.contextmanager
def routing_pass(routing: moe.Routing | None, name: str, tables: dict[str, moe.RoutingTable], *,
                  sampler_side: bool = False, forced: moe.RoutingTable | None = None) -> Iterator[Observe]:
    """One pass's micro-batches with the routing recorded (into ``tables[name]``) on an MoE model, the
    ``forced`` table's experts forced when given; a context per micro-batch (nothing on a dense model)."""
    if routing is None:
        yield lambda rows, att: contextlib.nullcontext()
        return
    with contextlib.nullcontext() if forced is None else routing.forcing(forced):
        routing.last = None
        routing.begin_update()
        yield lambda rows, att: routing.micro_batch(rows, att, sampler_side=sampler_side)
        routing.end_update()
    if routing.last is not None:
        tables[name] = routing.last


def _forward(model: torch.nn.Module, ids: Tensor, att: Tensor, pos: Tensor) -> Tensor:
    return model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=False).logits[:, :-1, :].float()


def recompute(policy: Policy, batch: OptimizerBatch, cfg: Config) -> Views:
    """Every pass of the module docstring over the captured rows; the per-token views."""
    import torch
    trainer, sampler = sides(cfg)
    srcs = sources(batch, trainer, sampler)
    row, position, token, pad = token_index(batch)
    col = Collector(row, position, token, pad, trainer, sampler, srcs)
    col.views.prompt_len = batch.prompt_lens.to(torch.int64).clone()
    model, dev = policy.model, policy.device
    routing = moe.attached(model)
    size, pad_id = cfg.training.micro_batch_size, policy.tokenizer.pad_id
    was_training = model.training
    model.eval()
    timings: dict[str, float] = {}
    with torch.no_grad():
        try:
            t0 = time.perf_counter()
            with routing_pass(routing, "trainer", col.views.routing) as observe:
                trainer_pass(col, model, dev, batch, size, pad_id, observe)
            timings["trainer"] = time.perf_counter() - t0
            if any(bool((s.values != col.views.trainer).any()) for s in srcs):
                _extra_passes(col, model, dev, batch, size, pad_id, trainer, sampler, timings, routing)
        finally:
            model.train(was_training)
    views = col.finish()
    views.passes = [f"{name} ({seconds:.3f} s)" for name, seconds in timings.items()]
    return views


def trainer_pass(col: Collector, model: torch.nn.Module, dev: torch.device, batch: OptimizerBatch, size: int,
                 pad_id: int, observe: Observe | None = None) -> None:
    """The trainer's values over the update's micro-batches, with the hypotheses its logits give
    (``observe``: each micro-batch's routing context, on an MoE model)."""
    import torch
    with torch.no_grad():
        start = 0
        for rows, ids, att, mask in _trainer_layout(batch, size, pad_id):
            ids, att, mask = ids.to(dev), att.to(dev), mask.to(dev)
            with contextlib.nullcontext() if observe is None else observe(rows, att):
                logits = response_logits(model, ids, att)  # what token_logprobs computes, kept for the hypotheses
            values = logprobs_of(logits, ids[:, 1:], col.views.trainer_side.temperature)[mask]
            col.trainer_chunk(start, values, logits[mask])
            start += int(values.numel())


def _extra_passes(col: Collector, model: torch.nn.Module, dev: torch.device, batch: OptimizerBatch, size: int,
                  pad_id: int, trainer: Side, sampler: Side, timings: dict[str, float],
                  routing: moe.Routing | None = None) -> None:
    import torch
    tables = col.views.routing

    def run(name: str, test: str, label: str, chunks: Iterator[Any], dtype: str, side: Side,
            sampler_side: bool = False, forced: moe.RoutingTable | None = None) -> None:
        t0 = time.perf_counter()
        start = 0
        with routing_pass(routing, name, tables, sampler_side=sampler_side, forced=forced) as observe:
            for chunk in chunks:
                rows, rest = chunk[0], chunk[1:]
                if len(rest) == 3:
                    ids, att, mask = (t.to(dev) for t in rest)
                    pos = (att.cumsum(-1) - 1).clamp_min(0)
                else:
                    ids, att, pos, mask = (t.to(dev) for t in rest)
                with precision(dtype, dev), observe(rows, att):
                    logits = _forward(model, ids, att, pos)
                if side.truncates:
                    kept = truncate(logits / side.temperature, side.top_k, side.top_p)
                    values = torch.log_softmax(kept, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)[mask]
                else:
                    values = logprobs_of(logits, ids[:, 1:], side.temperature)[mask]
                col.hypothesis(test, label, start, values)
                start += int(values.numel())
        timings[name] = time.perf_counter() - t0

    if sampler.dtype != "model":
        run("precision", "precision", f"the trainer's computation with its forward under {sampler.dtype} autocast",
            _trainer_layout(batch, size, pad_id), sampler.dtype, trainer)
    run("padding", "padding", "the trainer's computation in the sampler's layout (prompts left-padded)",
        _sampler_layout(batch, size, pad_id), "model", trainer)
    run("position", "padding", "the sampler's layout with positions counted over the padding",
        _sampler_layout(batch, size, pad_id, plain_positions=True), "model", trainer)
    run("combined", "combined", "every recorded sampler setting at once (layout, dtype, temperature, truncation)",
        _sampler_layout(batch, size, pad_id), sampler.dtype, sampler, sampler_side=True)
    base, theirs = tables.get("trainer"), tables.get("combined")
    if base is not None and theirs is not None and moe.compare(base, theirs)["flipped"]:
        run("routing", "routing", "the trainer's computation with the sampler-side pass's experts forced",
            _trainer_layout(batch, size, pad_id), "model", trainer, forced=theirs)


def check_vocabulary(policy: Policy, batch: OptimizerBatch, where: str) -> None:
    """A captured token id must index this model's vocabulary (as a replay checks)."""
    get = getattr(policy.model, "get_input_embeddings", None)
    n = getattr(get(), "num_embeddings", None) if callable(get) else None
    vocab = n if isinstance(n, int) else policy.tokenizer.vocab_size
    top = int(batch.tokens.max())
    if top >= vocab:
        raise ContractError(f"captured token id {top} is outside this model's vocabulary ({vocab})", where=where)
