"""TRL capture overhead: a GRPOTrainer run with ``capture_optimizer_batch`` (one chosen step) against the same run
without it.

Each run trains a tiny Qwen2 built from a config (LoRA, 4 rows per micro-batch, gradient accumulation 2) for
``--steps`` optimizer steps in this process; "on" instruments the trainer with
``capture_optimizer_batch(trainer, out, step=K)`` before ``train()``, "off" does not.  Runs alternate (off, on,
off, ...) and each pair shares the machine's state.  A ``TrainerCallback`` times every step (wall and the
process's CPU seconds, from ``on_step_begin`` to ``on_step_end``, which bracket the capture's own callbacks).

Steady state: the steps after the first ``--warmup`` and other than the captured step K, where capture costs only
its wrappers' checks.  Ratio: the median over pairs of (the "on" run's steady CPU seconds / its partner's, summed
over the same steps), with a 95% interval that resamples pairs (:func:`benchmarks.capture_overhead.pair_bootstrap`);
target <= 1.02.  Also reported: the same ratio in wall time, and the captured step's own cost (its seconds in the
"on" run over the same step in the "off" run: the adapter, optimizer and payload written, the base model hashed).

Run: ``python -m benchmarks.trl_capture_overhead [--smoke] [--pairs N] [--steps N]``.
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.capture_overhead import pair_bootstrap
from benchmarks.trl_precision_floor import build_base, reward

CAPTURED = 2  # the chosen step K (0-based)


def run(base: Path, out: Path, steps: int, capture: bool) -> tuple[list[float], list[float]]:
    """One training run; per step its wall and CPU seconds."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from replayjob.producers.trl.producer import capture_optimizer_batch

    wall: list[float] = []
    cpu: list[float] = []

    started: list[tuple[float, float]] = []

    class Start(TrainerCallback):  # added before the capture's callback: runs before its on_step_begin
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            started.append((time.perf_counter(), time.process_time()))

    class Stop(TrainerCallback):  # added after it: runs after its on_step_end (which writes the captured step)
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            t, c = started[-1]
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    args = GRPOConfig(output_dir=str(out / "trainer"), per_device_train_batch_size=4, num_generations=4,
                      gradient_accumulation_steps=2, num_iterations=2, beta=0.04, max_completion_length=6,
                      max_steps=steps, logging_steps=1, report_to=[], use_cpu=True, seed=7, save_strategy="no",
                      learning_rate=1e-2, disable_tqdm=True, bf16=False, gradient_checkpointing=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": [f"{i}+{i + 1}=" for i in range(64)]}),
                          processing_class=AutoTokenizer.from_pretrained(base),
                          peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                 target_modules=["q_proj", "v_proj"]))
    trainer.add_callback(Start())
    if capture:
        capture_optimizer_batch(trainer, out / "cap", step=CAPTURED)
    trainer.add_callback(Stop())
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=8, help="pairs of runs (off, on), alternating")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps of a run left out of the steady state")
    a = p.parse_args(argv)
    pairs, steps = (1, 4) if a.smoke else (a.pairs, a.steps)
    warmup = min(a.warmup, CAPTURED)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)  # as the funnel's CPU steps: one intra-op thread, so a step's time is its own work
    steady = [i for i in range(warmup, steps) if i != CAPTURED]
    on_cpu: list[list[float]] = []
    off_cpu: list[list[float]] = []
    on_wall: list[list[float]] = []
    off_wall: list[list[float]] = []
    captured_ratio: list[float] = []
    with tempfile.TemporaryDirectory(prefix="replayjob-trl-overhead-") as d:
        tmp = Path(d)
        base = build_base(tmp / "base", 32)
        run(base, tmp / "warm", 2, False)  # imports and first-call costs out of the first pair
        for i in range(pairs):
            ow, oc = run(base, tmp / f"off{i}", steps, False)
            nw, nc = run(base, tmp / f"on{i}", steps, True)
            off_wall.append([ow[j] for j in steady])
            off_cpu.append([oc[j] for j in steady])
            on_wall.append([nw[j] for j in steady])
            on_cpu.append([nc[j] for j in steady])
            captured_ratio.append(nw[CAPTURED] / ow[CAPTURED])

    def summed(on: list[list[float]], off: list[list[float]]) -> float:
        return statistics.median(sum(x) / sum(y) for x, y in zip(on, off, strict=True))

    cpu_ratio, wall_ratio = summed(on_cpu, off_cpu), summed(on_wall, off_wall)
    low, high = pair_bootstrap(on_cpu, off_cpu, statistic=summed)
    wlow, whigh = pair_bootstrap(on_wall, off_wall, statistic=summed)
    target = common.Target("<=", 1.02, cpu_ratio)
    step_off = statistics.median(x for r in off_cpu for x in r)
    detail = (f"steady CPU s per-pair {cpu_ratio:.3f}x [95% {low:.3f}, {high:.3f}], wall {wall_ratio:.3f}x "
              f"[{wlow:.3f}, {whigh:.3f}] ({pairs} pairs x {len(steady)} steady steps, median step "
              f"{step_off:.3f} CPU s off); captured step {statistics.median(captured_ratio):.2f}x its 'off' twin")
    print(common.summary_line("trl_capture_overhead", cpu_ratio, target, detail, smoke=a.smoke))
    common.write_result(
        "trl_capture_overhead", smoke=a.smoke, results=a.results, ratio_value=cpu_ratio,
        ratio_definition="median over pairs of runs of (steady steps' CPU seconds with capture on / the same steps' "
                         "with it off); steady: after the warm-up steps, the captured step left out",
        baseline="the same GRPOTrainer run without capture_optimizer_batch, alternating run by run", target=target,
        measurements={"cpu_ratio_interval": {"low": low, "high": high}, "wall_ratio": wall_ratio,
                      "wall_ratio_interval": {"low": wlow, "high": whigh},
                      "captured_step_ratio": {"median": statistics.median(captured_ratio), "values": captured_ratio},
                      "steady_steps": steady, "on_cpu": on_cpu, "off_cpu": off_cpu, "on_wall": on_wall,
                      "off_wall": off_wall},
        parameters={"pairs": pairs, "steps": steps, "warmup": warmup, "captured_step": CAPTURED, "threads": 1})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
