"""Seeded synthetic bundles built with :class:`BundleWriter`: fixtures, injected faults, benchmarks.

Every recorded output is produced by the same stage functions the trainer uses, so a synthetic
bundle replays clean unless a fault is asked for:

* ``streaming_bug=True`` reproduces the classic streaming bug: each prompt group arrives split
  across ``consumer_batches`` and the producer normalises rewards against the physical consumer
  batch instead of the semantic group.  ``reward.post_process`` is then the first divergent stage.
* ``inject`` adds a value to one recorded tensor, e.g. ``{"advantages": (5, 2, 0.5)}`` adds 0.5
  to sample row 5, token offset 2 of ``advantage.estimate``'s output (and nothing else) in a
  rollout bundle; ``{"loss": (0, 0, 0.5)}`` adds 0.5 to a step bundle's recorded loss.

Example:
    >>> import tempfile
    >>> p = write_rollout(tempfile.mkdtemp() + "/b", estimator="rloo")
    >>> from replayjob.bundle import replay_bundle
    >>> replay_bundle(p).diverged
    False
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replayjob.bundle import format as fmt
from replayjob.bundle.writer import BundleWriter, default_config, root_record
from replayjob.errors import ConfigError
from replayjob.model.tokenizer import ByteTokenizer
from replayjob.rl import stages
from replayjob.rl.task import Task

if TYPE_CHECKING:
    from torch import Tensor

Inject = dict[str, tuple[int, int, float]]


@dataclass
class Synthetic:
    """The tensors of one synthetic step (padded ``[N, T]``), all float64 except token ids."""

    config: dict[str, Any]
    group: list[int]
    consumer_batch: list[int]
    lengths: list[int]
    completions: list[str]
    labels: list[str]
    t: dict[str, Tensor] = field(default_factory=dict)


def make(*, estimator: str = "grpo", groups: int = 2, group_size: int = 4, max_len: int = 6, seed: int = 0,
         consumer_batches: int = 1, streaming_bug: bool = False, **config: Any) -> Synthetic:
    """Generate inputs and run the stages; see the module docstring for ``streaming_bug``."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    cfg = default_config(estimator=estimator, samples_per_prompt=group_size,
                         task={"name": "arithmetic", "max_operand": 99}, **config)
    task = Task("arithmetic", 99)
    tok = ByteTokenizer()
    n = groups * group_size
    labels, completions, resp_ids, lengths = [], [], [], []
    for _g in range(groups):
        a, b = (int(x) for x in torch.randint(0, 100, (2,), generator=gen))
        for j in range(group_size):
            digits = "".join(str(int(x)) for x in torch.randint(0, 10, (max_len - 1,), generator=gen))
            text = str(a + b) if j == 0 else digits[: 1 + int(torch.randint(0, max_len - 1, (1,),
                                                                               generator=gen))]
            ids = [*tok.encode(text)[:max_len - 1], tok.eos_id]
            labels.append(str(a + b))
            completions.append(tok.decode([i for i in ids if i != tok.eos_id]))
            resp_ids.append(ids)
            lengths.append(len(ids))
    width = max(lengths)
    mask = torch.zeros((n, width), dtype=torch.float64)
    ids_t = torch.zeros((n, width), dtype=torch.int64)
    for i, ids in enumerate(resp_ids):
        mask[i, : len(ids)] = 1.0
        ids_t[i, : len(ids)] = torch.tensor(ids)
    group = [i // group_size for i in range(n)]
    cb = [(i % group_size) * consumer_batches // group_size for i in range(n)]
    raw = stages.reward_raw(completions, labels, task.score)
    if streaming_bug:
        scores = torch.zeros(n, dtype=torch.float64)
        for c in range(consumer_batches):
            rows = torch.tensor([i for i in range(n) if cb[i] == c])
            scores[rows] = stages.post_process(raw[rows], torch.zeros(len(rows), dtype=torch.int64),
                                               estimator, cfg["std_eps"])
    else:
        scores = stages.post_process(raw, torch.tensor(group), estimator, cfg["std_eps"])
    old = -torch.rand((n, width), generator=gen, dtype=torch.float64) * 3 * mask
    ref = (old - 0.05 * torch.randn((n, width), generator=gen, dtype=torch.float64)).clamp(max=0.0) * mask
    kl = stages.token_kl(old, ref, mask, cfg["kl_kind"])
    adv = stages.advantage_estimate(scores, kl, mask, cfg["kl_reward_coef"])
    if cfg["batch_adv_norm"]:
        adv = stages.batch_normalize(adv, mask)
    adv = stages.clip_advantages(adv, cfg["adv_clip"])
    logp = (old + 0.02 * torch.randn((n, width), generator=gen, dtype=torch.float64)).clamp(max=0.0)
    logp = logp.float() * mask.float()
    weights = stages.loss_weights(stages.token_cap(mask, cfg["token_cap"]), cfg["loss_agg"])
    loss = stages.policy_loss(logp, old, adv, weights, clip_low=cfg["clip_low"], clip_high=cfg["clip_high"],
                              ref_logp=ref, kl_coef=cfg["kl_loss_coef"])
    label_ids = torch.zeros((n, max(len(x) for x in labels)), dtype=torch.int64)
    for i, lab in enumerate(labels):
        label_ids[i, : len(lab)] = torch.tensor(tok.encode(lab))
    t = {"mask": mask, "response_ids": ids_t, "label_ids": label_ids, "raw": raw, "scores": scores,
         "old_logprobs": old, "ref_logprobs": ref, "kl": kl, "advantages": adv, "logprobs": logp,
         "loss_weights": weights, "loss": loss}
    return Synthetic(cfg, group, cb, lengths, completions, labels, t)


# Synthetic bundles are built from fixed inputs: their provenance is fixed too, so their bytes (and the
# golden files made of them) do not depend on the torch build or the release that wrote them.
PRODUCER = {"name": "replayjob", "replayjob_version": "synthetic", "torch_version": "synthetic"}


def _writer(path: Path, s: Synthetic, kind: str, rows: list[int], rank: int | None, ranks: list[int] | None,
            groups: bool, run_id: str | None) -> BundleWriter:
    if ranks is not None and run_id is None:  # no default: two runs' ranks could then complete one root
        raise ConfigError("a multi-rank bundle's ranks record the run id they share: pass run_id", where="run_id",
                          hint="draw one per run (replayjob.bundle.writer.new_run_id()) and pass it to every rank")
    w = BundleWriter(path, kind=kind, rollout_id=3, step_id=0 if kind in fmt.STEP_KINDS else None, config=s.config,
                     rank=rank, ranks=ranks, run_id=run_id if ranks is not None else None, weight_version=3,
                     producer=PRODUCER)
    size = max(1, len(s.group) // 4)
    for i in rows:
        w.add_sample(f"s-{i}", group=f"g-{s.group[i]}" if groups else None, prompt_length=5,
                     response_length=s.lengths[i], label_length=len(s.labels[i]),
                     consumer_batch=f"cb-{s.consumer_batch[i]}",
                     micro_batch=f"mb-{i // size:04d}", prompt=f"Q:{i}=", completion=s.completions[i],
                     label=s.labels[i])
    w.write_payload("mask", s.t["mask"][rows])
    return w


def _take(t: Tensor, rows: list[int], name: str, inject: Inject) -> Tensor:
    out = t[rows].clone()
    if name in inject:
        r, k, delta = inject[name]
        if r in rows:
            out[rows.index(r), k] += delta
    return out


def write_rollout(path: str | Path, *, inject: Inject | None = None, groups_recorded: bool = True,
                  rank: int | None = None, ranks: list[int] | None = None, run_id: str | None = None,
                  **spec: Any) -> Path:
    """A rollout bundle (all stages ``recompute``); with ``ranks``, rank ``r`` holds groups ``r::len``
    (and records ``run_id``, which the caller draws once per run and passes to every rank)."""
    s = make(**spec)
    inject = inject or {}
    n = len(s.group)
    rows = list(range(n)) if ranks is None else [i for i in range(n)
                                                 if s.group[i] % len(ranks) == ranks.index(rank or 0)]
    w = _writer(Path(path), s, "rollout", rows, rank, ranks, groups_recorded, run_id)
    for name in ("response_ids", "label_ids", "old_logprobs", "ref_logprobs"):
        w.write_payload(name, s.t[name][rows])
    w.set_expected("reward.raw", "raw", s.t["raw"][rows])
    w.set_expected("reward.post_process", "scores", _take(s.t["scores"][:, None], rows, "scores", inject)[:, 0])
    w.set_expected("advantage.kl", "kl", _take(s.t["kl"], rows, "kl", inject))
    w.set_expected("advantage.estimate", "advantages", _take(s.t["advantages"], rows, "advantages", inject))
    if not groups_recorded:
        w.set_capability("reward.post_process", "recorded-only", "membership was not recorded")
    return w.finalize()


def write_step(path: str | Path, *, inject: Inject | None = None, rank: int | None = None,
               ranks: list[int] | None = None, run_id: str | None = None, **spec: Any) -> Path:
    """A step bundle (``loss.policy`` recompute); with ``ranks``, rank ``r`` holds groups ``r::len``
    and records the loss of its own rows (each rank's loss is over what it consumed) and ``run_id``."""
    s = make(**spec)
    n = len(s.group)
    rows = list(range(n)) if ranks is None else [i for i in range(n)
                                                 if s.group[i] % len(ranks) == ranks.index(rank or 0)]
    w = _writer(Path(path), s, "step", rows, rank, ranks, True, run_id)
    t = {k: s.t[k][rows] for k in ("mask", "logprobs", "old_logprobs", "ref_logprobs")}
    t["advantages"] = _take(s.t["advantages"], rows, "advantages", inject or {})
    for name in ("logprobs", "old_logprobs", "ref_logprobs", "advantages"):
        w.write_payload(name, t[name])
    cfg = s.config
    weights = stages.loss_weights(stages.token_cap(t["mask"], cfg["token_cap"]), cfg["loss_agg"])
    loss = stages.policy_loss(t["logprobs"], t["old_logprobs"], t["advantages"], weights, clip_low=cfg["clip_low"],
                              clip_high=cfg["clip_high"], ref_logp=t["ref_logprobs"], kl_coef=cfg["kl_loss_coef"])
    if inject and "loss" in inject:
        loss = loss + inject["loss"][2]
    w.set_expected("loss.policy", "loss_weights", weights)
    w.set_expected("loss.policy", "loss", float(loss))
    return w.finalize()


def example_documents() -> dict[str, dict[str, Any]]:
    """One valid document of each kind a bundle holds, built in memory (nothing is written): rank 0 of a two-rank
    update bundle (every optional section present: a task, a truncated text, every kind of expected output), its
    ``COMPLETE``, its landing record and the root ``COMPLETE`` (the declarations' fuzz tests start from these)."""
    import json

    s = make(groups=2, group_size=2)
    rows = [0, 1]  # group 0: rank 0's
    redaction = {**fmt.DEFAULT_REDACTION, "completion": "truncate:8"}
    w = BundleWriter("example-root", kind="update", rollout_id=3, step_id=0, config=s.config, rank=0, ranks=[0, 1],
                     run_id="run-a", weight_version=3, producer=PRODUCER, redaction=redaction)
    for i in rows:
        w.add_sample(f"s-{i}", group="g-0", prompt_length=5, response_length=s.lengths[i],
                     label_length=len(s.labels[i]), prompt=f"Q:{i}=", completion=s.completions[i], label=s.labels[i])
    for name in ("mask", "response_ids", "label_ids", "old_logprobs", "ref_logprobs", "logprobs"):
        w.write_payload(name, s.t[name][rows])
    w.set_expected("reward.raw", "raw", s.t["raw"][rows])
    w.set_expected("reward.post_process", "scores", s.t["scores"][rows])
    w.set_expected("advantage.kl", "kl", s.t["kl"][rows])
    w.set_expected("advantage.estimate", "advantages", s.t["advantages"][rows])
    w.set_capability("loss.policy", "recorded-only", "each rank's loss is over its own rows; recorded here")
    w.set_expected("loss.policy", "loss_weights", s.t["loss_weights"][rows])
    w.set_expected("loss.policy", "loss", float(s.t["loss"]))
    prepared = w.prepare()
    record = w.landing_record(prepared.manifest_sha256)
    return {"BundleManifest": json.loads(prepared.manifest), "BundleComplete": json.loads(prepared.complete),
            "RankComplete": record,
            "RootComplete": root_record(w.bundle_id, "run-a", {0: prepared.manifest_sha256, 1: "0" * 64})}
