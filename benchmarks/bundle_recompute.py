"""Bundle recompute cost: the GRPO stages through ``bundle replay`` against the same math inline.

One synthetic step of about ``--tokens`` response tokens (default 1,048,576: about 10,900 samples of
64-128 tokens, groups of 8; ``--smoke``: 1,024 tokens of width 16) is held in memory as a
:class:`Bundle`.

* Arm: what ``bundle replay`` does per stage after validation -- recompute ``reward.post_process``,
  ``advantage.kl``, ``advantage.estimate`` and ``loss.policy`` through
  :mod:`replayjob.bundle.recompute` and compare every output with the recorded one
  (:func:`replayjob.bundle.report.compare`).
* Baseline: the same :mod:`replayjob.rl.stages` tensor expressions called inline on the same
  tensors, as the trainer calls them (no bundle, no comparison).

Ratio: median arm seconds / median baseline seconds.  Target: <= 1.3.  Disk reads are excluded on
both sides (``verify_throughput`` measures validation I/O).  The recorded outputs are bitwise what
the stages produce (as in a clean capture replayed on the same machine), so comparison takes its
one-pass equality route; a second arm whose recorded values are each moved by one ulp forces the
element-wise tolerance route, and its ratio is reported alongside (not judged).

Run: ``python -m benchmarks.bundle_recompute [--smoke] [--tokens N] [--repeats N]``
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks import common
from replayjob.bundle import format as fmt
from replayjob.bundle.reader import Bundle, LossCohort
from replayjob.bundle.replay import run_stage
from replayjob.bundle.select import Selection
from replayjob.bundle.writer import default_config
from replayjob.rl import stages

NAME = "bundle_recompute"
TARGET = 1.3
GROUP = 8
WIDTH = 128
STAGES = ("reward.post_process", "advantage.kl", "advantage.estimate", "loss.policy")


def build(n: int, width: int, seed: int = 0) -> tuple[Bundle, dict[str, Any]]:
    """A bundle in memory whose recorded outputs come from the stage functions themselves."""
    gen = torch.Generator().manual_seed(seed)
    cfg = default_config(samples_per_prompt=GROUP, kl_reward_coef=0.01, kl_loss_coef=0.05)
    lengths = torch.randint(width // 2, width + 1, (n,), generator=gen)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).to(torch.float64)
    group = torch.arange(n) // GROUP
    raw = torch.rand(n, generator=gen, dtype=torch.float64)
    old = -torch.rand((n, width), generator=gen, dtype=torch.float64) * 3 * mask
    ref = (old - 0.05 * torch.randn((n, width), generator=gen, dtype=torch.float64)) * mask
    logp = ((old + 0.02 * torch.randn((n, width), generator=gen, dtype=torch.float64)) * mask).float()
    t = {"raw": raw, "group": group, "mask": mask, "old": old, "ref": ref, "logp": logp}
    out = inline(t, cfg)
    samples = [{"sample_id": f"s-{i}", "group": f"g-{int(group[i])}", "cohort": "c-0"} for i in range(n)]
    manifest = {"kind": "rollout", "bundle_id": "bench",
                "stages": {s: {"capability": "recompute", "reason": ""} for s in fmt.STAGE_ORDER},
                "comparison": fmt.DEFAULT_COMPARISON}
    index = {"samples": samples, "config": cfg, "identity": {"rollout_id": 0, "step_id": None}}
    expected = {"reward.raw": {"raw": raw.tolist()}, "reward.post_process": {"scores": out["scores"].tolist()},
                "advantage.kl": {"kl": {"payload": "kl"}},
                "advantage.estimate": {"advantages": {"payload": "advantages"}},
                "loss.policy": {"loss": float(out["loss"]), "loss_weights": {"payload": "loss_weights"}}}
    payloads = {"mask": mask, "old_logprobs": old, "ref_logprobs": ref, "logprobs": logp, "kl": out["kl"],
                "advantages": out["advantages"], "loss_weights": out["loss_weights"]}
    b = Bundle(Path("<memory>"), manifest, index, expected, payloads,
               loss_cohorts=[LossCohort(0, list(range(n)), float(out["loss"]))])
    return b, t


def inline(t: dict[str, Any], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The baseline: the trainer's stage calls, in the trainer's order, on plain tensors."""
    scores = stages.post_process(t["raw"], t["group"], cfg["estimator"], cfg["std_eps"])
    kl = stages.token_kl(t["old"], t["ref"], t["mask"], cfg["kl_kind"])
    adv = stages.clip_advantages(stages.advantage_estimate(scores, kl, t["mask"], cfg["kl_reward_coef"]),
                                 cfg["adv_clip"])
    weights = stages.loss_weights(stages.token_cap(t["mask"], cfg["token_cap"]), cfg["loss_agg"])
    loss = stages.policy_loss(t["logp"], t["old"], adv, weights, clip_low=cfg["clip_low"],
                              clip_high=cfg["clip_high"], ref_logp=t["ref"], kl_coef=cfg["kl_loss_coef"])
    return {"scores": scores, "kl": kl, "advantages": adv, "loss_weights": weights, "loss": loss}


def nudged(b: Bundle) -> Bundle:
    """The same bundle with every recorded output moved by one ulp (still within tolerance)."""
    up = torch.tensor(float("inf"), dtype=torch.float64)
    ex = {s: dict(f) for s, f in b.expected.items()}
    for stage, field in (("reward.post_process", "scores"),):
        ex[stage][field] = torch.nextafter(torch.tensor(ex[stage][field], dtype=torch.float64), up).tolist()
    ex["loss.policy"]["loss"] = float(torch.nextafter(torch.tensor(ex["loss.policy"]["loss"], dtype=torch.float64), up))
    pay = dict(b.payloads)
    for name in ("kl", "advantages", "loss_weights"):
        pay[name] = torch.nextafter(pay[name], up)
    cohorts = [LossCohort(c.rank, c.rows, ex["loss.policy"]["loss"]) for c in b.loss_cohorts]
    return Bundle(b.path, b.manifest, b.index, ex, pay, loss_cohorts=cohorts)


def arm(b: Bundle) -> None:
    sel = Selection(list(range(len(b.samples))), False, {})
    for s in STAGES:
        res = run_stage(b, s, sel, "all", 5)
        if res.status != "pass":
            raise RuntimeError(f"{s} did not pass on a clean bundle: {res}")


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0] if __doc__ else NAME)
    p.add_argument("--tokens", type=int, default=None, help="response tokens (default 1,048,576; smoke 1,024)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per side (default 11; smoke 2)")
    args = p.parse_args(argv)
    width = 16 if args.smoke else WIDTH
    tokens = args.tokens or (1024 if args.smoke else 1 << 20)
    n = max(GROUP, -(-tokens * 4 // (3 * width) // GROUP) * GROUP)  # lengths average 3/4 of the width
    repeats = args.repeats or (2 if args.smoke else 11)
    b, t = build(n, width)
    cfg = b.config
    arm(b)
    inline(t, cfg)
    slow = nudged(b)
    arm(slow)
    base_t, arm_t, slow_t = [], [], []
    for _ in range(repeats):  # alternate, so machine drift hits every side alike
        base_t += common.measure(lambda: inline(t, cfg), repeats=1, warmup=0)
        arm_t += common.measure(lambda: arm(b), repeats=1, warmup=0)
        slow_t += common.measure(lambda: arm(slow), repeats=1, warmup=0)
    base, meas, tol = common.stats(base_t), common.stats(arm_t), common.stats(slow_t)
    value = common.ratio(meas["median"], base["median"])
    tol_ratio = common.ratio(tol["median"], base["median"])
    common.report(
        NAME, smoke=args.smoke, results=args.results, ratio_value=value,
        ratio_definition="median seconds of the four recompute+compare stages / median seconds of the "
                         "same stage functions inline",
        baseline="replayjob.rl.stages post_process, token_kl, advantage_estimate, clip_advantages, token_cap, "
                 "loss_weights, policy_loss called inline on the same tensors",
        target=common.Target("<=", TARGET, value),
        detail=f"{int(b.payloads['mask'].sum()):,} response tokens ({n} samples x {width}); "
               f"arm {meas['median'] * 1e3:.1f} ms vs inline {base['median'] * 1e3:.1f} ms; "
               f"tolerance route {tol_ratio:.2f}x",
        measurements={"arm_s": meas, "baseline_s": base, "arm_tolerance_route_s": tol,
                      "tolerance_route_ratio": tol_ratio},
        parameters={"samples": n, "width": width, "group_size": GROUP, "repeats": repeats,
                    "response_tokens": int(b.payloads["mask"].sum())})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
