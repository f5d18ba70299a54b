"""Mismatch recompute cost: ``replayjob mismatch``'s recompute against a plain forward of the same tokens.

One ``replayjob init`` workspace and one capture of the built-in tiny model (full size: 8 prompts x 8
completions of up to 64 new tokens, sampled at temperature 1.2 with top_p 0.9 so every attribution
pass runs; ``--smoke``: the default 16 rows of up to 8 tokens), admitted and built once.

* Arm: :func:`replayjob.mismatch.builtin.recompute` on the captured rows -- the trainer's pass (its
  logits kept per micro-batch for the temperature candidates, a 49-point temperature grid and the
  top-p renormalisation), then the padding, position and combined passes (each one more forward) --
  plus every source's figures and attribution (:func:`replayjob.mismatch.report.build`).
* Baseline: :func:`replayjob.rl.logprobs.token_logprobs` over the same right-padded micro-batches in
  eval mode under ``torch.no_grad``: one plain forward of the same tokens.

Ratio: median arm seconds / median baseline seconds, alternating.  Target: <= 8 (four forwards and
the per-token statistics).  Also reported, not judged: the trainer's pass alone (one forward plus the
logit-derived hypotheses) and the whole command (admission, model build, recompute) once.

Run: ``python -m benchmarks.mismatch_recompute [--smoke] [--repeats N]``
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import common
from replayjob.cli import main as cli_main
from replayjob.config import from_dict, load_config
from replayjob.mismatch import builtin, check_capture, report
from replayjob.mismatch.views import Collector
from replayjob.producers.builtin.admission import admit, source_config
from replayjob.rl.batch import micro_batches
from replayjob.rl.logprobs import logprob_temperature, token_logprobs
from replayjob.runtime.distributed import observe

NAME = "mismatch_recompute"
TARGET = 8.0
FULL = ["algorithm.prompts_per_step=8", "algorithm.group_size=8", "inference.max_new_tokens=64"]
SAMPLER = ["inference.temperature=1.2", "inference.top_p=0.9"]


def capture(root: Path, sets: list[str]) -> tuple[Path, list[str]]:
    """A workspace and one capture under ``root``; the mismatch command's arguments for it."""
    ws = root / "ws"
    out = ws / "cap"
    flags = [a for s in sets for a in ("--set", s)]
    with contextlib.redirect_stdout(io.StringIO()):  # the benchmark prints one line
        if cli_main(["init", str(ws)]) != 0:
            raise RuntimeError("replayjob init failed")
        if cli_main(["capture", str(ws / "source.toml"), "--out", str(out), *flags]) != 0:
            raise RuntimeError("replayjob capture failed")
    m = json.loads((out / "metrics.json").read_text())
    pins = [f'optimizer_batch.expected_logical_sha256="{m["optimizer/logical_batch_sha256"]}"',
            f'optimizer_batch.expected_manifest_sha256="{m["optimizer_batch/manifest_sha256"]}"',
            f'optimizer_batch.replay_path="{out / "optimizer_batch_step_000000.manifest.json"}"']
    return ws / "replay.toml", [*sets, *pins]


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0] if __doc__ else NAME)
    p.add_argument("--repeats", type=int, default=None, help="timed runs per side (default 7; smoke 2)")
    args = p.parse_args(argv)
    repeats = args.repeats or (2 if args.smoke else 7)
    sets = SAMPLER + ([] if args.smoke else FULL)
    with tempfile.TemporaryDirectory(prefix="replayjob-bench-mismatch-") as tmp:
        config, overrides = capture(Path(tmp), sets)
        t0 = time.perf_counter()
        whole = check_capture(config, overrides)
        command_s = time.perf_counter() - t0
        cfg = load_config(config, overrides)
        adm = admit(observe(cfg, running=False))  # resolved as the command resolves it
        adm.raise_if_refused()
        assert adm.manifest is not None and adm.batch is not None
        source_cfg = from_dict(source_config(adm.manifest))
        policy = builtin.build_policy(cfg, adm)
        batch = adm.batch
        mbs = micro_batches(batch, source_cfg.training.micro_batch_size, policy.tokenizer.pad_id)
        temperature = logprob_temperature(source_cfg)

        @torch.no_grad()
        def plain() -> None:
            policy.model.eval()
            for mb in mbs:
                token_logprobs(policy.model, mb.input_ids, mb.attention_mask, temperature)

        def arm() -> None:
            views = builtin.recompute(policy, batch, source_cfg)
            report.build({"framework": "replayjob", "step": 0, "manifest": ""}, views, None, False, 0.0)

        def trainer_pass() -> None:
            trainer, sampler = builtin.sides(source_cfg)
            row, position, token, pad = builtin.token_index(batch)
            col = Collector(row, position, token, pad, trainer, sampler, builtin.sources(batch, trainer, sampler))
            builtin.trainer_pass(col, policy.model, policy.device, batch, source_cfg.training.micro_batch_size,
                                 policy.tokenizer.pad_id)

        policy.model.eval()
        plain()
        arm()
        trainer_pass()
        base_t: list[float] = []
        arm_t: list[float] = []
        pass_t: list[float] = []
        for _ in range(repeats):  # alternate, so machine drift hits every side alike
            base_t += common.measure(plain, repeats=1, warmup=0)
            arm_t += common.measure(arm, repeats=1, warmup=0)
            pass_t += common.measure(trainer_pass, repeats=1, warmup=0)
    base, meas, first = common.stats(base_t), common.stats(arm_t), common.stats(pass_t)
    value = common.ratio(meas["median"], base["median"])
    pass_ratio = common.ratio(first["median"], base["median"])
    tokens, rows = int(batch.response_tokens()), batch.rows
    attribution = {s.source.name: s.attribution.attribution for s in whole.sources}
    common.report(
        NAME, smoke=args.smoke, results=args.results, ratio_value=value,
        ratio_definition="median seconds of the mismatch recompute (every pass, figures and attribution) / median "
                         "seconds of one plain forward of the same micro-batches",
        baseline="replayjob.rl.logprobs.token_logprobs over the capture's right-padded micro-batches, eval mode, "
                 "torch.no_grad",
        target=common.Target("<=", TARGET, value),
        detail=f"{tokens:,} response tokens in {rows} rows; recompute {meas['median'] * 1e3:.0f} ms vs forward "
               f"{base['median'] * 1e3:.0f} ms; trainer pass alone {pass_ratio:.2f}x; whole command {command_s:.2f} s",
        measurements={"arm_s": meas, "baseline_s": base, "trainer_pass_s": first, "trainer_pass_ratio": pass_ratio,
                      "command_s": command_s, "passes": list(whole.views.passes), "attribution": attribution},
        parameters=_parameters(sets, rows, tokens, repeats))
    return 0


def _parameters(sets: list[str], rows: int, tokens: int, repeats: int) -> dict[str, Any]:
    return {"sets": list(sets), "rows": rows, "response_tokens": tokens, "repeats": repeats,
            "torch_threads": torch.get_num_threads()}


if __name__ == "__main__":
    raise SystemExit(main())
