"""Offline recompute of each stage with the trainer's own functions (:mod:`replayjob.rl.stages`).

Each stage is recomputed in isolation from its recorded inputs: the payloads it consumed and the
recorded outputs of the stages before it.  A fault therefore shows up at the stage that made it
and does not cascade, which is what lets the report name the first divergent stage.

Per stage (``rows`` are bundle rows, always whole semantic groups):

* ``reward.raw``: decode the response token ids with the byte tokenizer (EOS dropped, as the
  trainer does) and the label ids, score with the built-in task's verifier.
* ``reward.post_process``: :func:`stages.post_process` over the recorded raw rewards with each
  sample's recorded group; every group must hold exactly ``samples_per_prompt`` members.
* ``advantage.kl``: :func:`stages.token_kl` of old vs reference logprobs.
* ``advantage.estimate``: :func:`stages.advantage_estimate` of the recorded scores and KL, then
  :func:`stages.batch_normalize` per normalisation cohort (when enabled) and
  :func:`stages.clip_advantages`.
* ``loss.policy``: per loss cohort (one rank's rows) :func:`stages.token_cap`,
  :func:`stages.loss_weights` and :func:`stages.policy_loss` on the logprobs the loss saw.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from replayjob.bundle.reader import Bundle
from replayjob.bundle.schema import check_groups
from replayjob.errors import ContractError
from replayjob.model.tokenizer import ByteTokenizer
from replayjob.rl import stages
from replayjob.rl.task import Task

if TYPE_CHECKING:
    from torch import Tensor


def take_rows(t: Tensor, rows: list[int]) -> Tensor:
    """``t[rows]``, without a gather copy when ``rows`` is every row in order (the common case)."""
    if len(rows) == t.shape[0] and rows[0] == 0 and rows[-1] == len(rows) - 1:
        return t
    return t[rows]


def _group_ids(b: Bundle, rows: list[int]) -> Tensor:
    import torch
    recs = b.samples
    check_groups(b.manifest, [recs[i] for i in rows], b.config)  # the reader's check, on the rows selected
    labels = [recs[i]["group"] for i in rows]
    order = {g: k for k, g in enumerate(dict.fromkeys(labels))}
    return torch.tensor([order[g] for g in labels], dtype=torch.int64)


def reward_raw(b: Bundle, rows: list[int]) -> dict[str, Tensor]:
    cfg = b.config
    task = Task(cfg["task"]["name"], cfg["task"]["max_operand"])
    tok = ByteTokenizer()
    recs = b.samples
    resp, lab = b.payloads["response_ids"], b.payloads["label_ids"]
    completions, labels = [], []
    for i in rows:
        ids = resp[i, : recs[i]["response_length"]].tolist()
        completions.append(tok.decode([t for t in ids if t != tok.eos_id]))
        labels.append(tok.decode(lab[i, : recs[i]["label_length"]].tolist()))
    return {"raw": stages.reward_raw(completions, labels, task.score)}


def post_process(b: Bundle, rows: list[int]) -> dict[str, Tensor]:
    import torch
    cfg = b.config
    raw = take_rows(torch.tensor(b.expected["reward.raw"]["raw"], dtype=torch.float64), rows)
    try:
        scores = stages.post_process(raw, _group_ids(b, rows), cfg["estimator"], float(cfg["std_eps"]))
    except ValueError as exc:
        raise ContractError(f"reward.post_process cannot run: {exc}") from None
    return {"scores": scores}


def token_kl(b: Bundle, rows: list[int]) -> dict[str, Tensor]:
    p = b.payloads
    return {"kl": stages.token_kl(take_rows(p["old_logprobs"], rows), take_rows(p["ref_logprobs"], rows),
                                  take_rows(p["mask"], rows), b.config["kl_kind"])}


def advantage_estimate(b: Bundle, rows: list[int]) -> dict[str, Tensor]:
    import torch
    cfg = b.config
    scores = take_rows(torch.tensor(b.expected["reward.post_process"]["scores"], dtype=torch.float64), rows)
    kl, mask = take_rows(b.payloads["kl"], rows), take_rows(b.payloads["mask"], rows)
    adv = stages.advantage_estimate(scores, kl, mask, float(cfg["kl_reward_coef"]))
    if cfg["batch_adv_norm"]:
        recs = b.samples
        cohorts = [recs[i]["cohort"] for i in rows]
        out = torch.zeros_like(adv)
        for c in dict.fromkeys(cohorts):
            sel = torch.tensor([k for k, x in enumerate(cohorts) if x == c], dtype=torch.int64)
            out[sel] = stages.batch_normalize(adv[sel], mask[sel])
        adv = out
    return {"advantages": stages.clip_advantages(adv, float(cfg["adv_clip"]))}


def policy_loss(b: Bundle, rows: list[int]) -> dict[str, Any]:
    """Returns ``loss_weights`` [rows, T] and ``loss``: one float64 scalar per loss cohort."""
    import torch
    cfg = b.config
    p = b.payloads
    weights = []
    losses = []
    if [r for c in b.loss_cohorts for r in c.rows] != rows:
        raise ContractError("loss.policy needs every row of every loss cohort, in order")
    for cohort in b.loss_cohorts:
        c = cohort.rows
        loss_mask = stages.token_cap(take_rows(p["mask"], c), int(cfg["token_cap"]))
        w = stages.loss_weights(loss_mask, cfg["loss_agg"])
        losses.append(stages.policy_loss(
            take_rows(p["logprobs"], c), take_rows(p["old_logprobs"], c), take_rows(p["advantages"], c), w,
            clip_low=float(cfg["clip_low"]), clip_high=float(cfg["clip_high"]),
            ref_logp=take_rows(p["ref_logprobs"], c), kl_coef=float(cfg["kl_loss_coef"])))
        weights.append(w)
    return {"loss_weights": weights[0] if len(weights) == 1 else torch.cat(weights), "loss": torch.stack(losses)}


RECOMPUTE = {"reward.raw": reward_raw, "reward.post_process": post_process, "advantage.kl": token_kl,
             "advantage.estimate": advantage_estimate, "loss.policy": policy_loss}
# Stages whose math spans a whole cohort rather than a group: skipped under a partial selection.
COHORT_LEVEL = {"loss.policy"}


def cohort_level(stage: str, b: Bundle) -> bool:
    return stage in COHORT_LEVEL or (stage == "advantage.estimate" and bool(b.config["batch_adv_norm"]))
