"""A plain PyTorch training loop handing replayjob the batch its optimizer consumes (docs/capture-api.md).

The model: a tiny causal LM (embedding -> linear head, frozen base weights loaded from safetensors)
with a trainable low-rank adapter and dropout; the loss: advantage-weighted next-token
log-likelihood over masked positions; two micro-batches per optimizer step, AdamW, a linear LR
decay, gradient clipping.  Step 1 of 3 is captured (``main(out, capture_steps=[0, 2])`` captures
several steps with :class:`~replayjob.producers.api.capture.ChosenSteps` instead: one
``replay_step_<K:06d>.toml`` per step and one metrics.json).

    python examples/plain_torch_loop.py OUT          # writes OUT/base (the base model) and OUT/capture
    replayjob explain OUT/capture/replay.toml        # 0: a replay would be admitted
    replayjob replay OUT/capture/replay.toml --out OUT/replay
    # OUT/replay/replay_metrics.json's final adapter SHA-256 equals OUT/capture/metrics.json's

``replay_target`` is what ``replayjob replay`` calls to rebuild the loop without data.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from replayjob import ChosenSteps, StepCapture, Target, optimizer_step

CONFIG = {"vocab": 32, "hidden": 16, "rank": 4, "dropout": 0.1, "lr": 1e-2, "steps": 3,
          "accumulation": 2, "max_grad_norm": 1.0, "seed": 3}


class TinyLM(torch.nn.Module):
    """Frozen embedding and head from the base model; a trainable low-rank adapter between them."""

    def __init__(self, base: Path, rank: int, dropout: float):
        super().__init__()
        cfg = json.loads((base / "config.json").read_text())
        weights = load_file(base / "model.safetensors")
        self.embed = torch.nn.Embedding(cfg["vocab"], cfg["hidden"])
        self.head = torch.nn.Linear(cfg["hidden"], cfg["vocab"], bias=False)
        self.embed.weight.data.copy_(weights["embed.weight"])
        self.head.weight.data.copy_(weights["head.weight"])
        self.embed.requires_grad_(False)
        self.head.requires_grad_(False)
        self.lora_a = torch.nn.Parameter(torch.randn(cfg["hidden"], rank) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.zeros(rank, cfg["hidden"]))
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(h + self.dropout(h) @ self.lora_a @ self.lora_b)


def loss_fn(model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """Advantage-weighted next-token log-likelihood, averaged over masked positions, scaled for accumulation."""
    logits = model(inputs["ids"][:, :-1]) / inputs["temperature"]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, inputs["ids"][:, 1:, None]).squeeze(-1)
    mask = inputs["mask"][:, 1:].float()
    per_row = (logp * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return -(per_row * inputs["advantages"]).mean() / inputs["accumulation"]


def build(base: Path, device: torch.device) -> tuple[TinyLM, torch.optim.Optimizer, Any]:
    model = TinyLM(base, CONFIG["rank"], CONFIG["dropout"]).to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=CONFIG["lr"], foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / CONFIG["steps"])
    return model, opt, sched


def replay_target(base: Path, device: torch.device) -> Target:
    """Rebuild the loop for `replayjob replay` (the adapter and optimizer state are loaded by replayjob)."""
    model, opt, sched = build(base, device)
    return Target(model=model, optimizer=opt, scheduler=sched, loss=loss_fn, max_grad_norm=CONFIG["max_grad_norm"])


def write_base(d: Path) -> Path:
    """The base model: config.json and safetensors weights in a local directory."""
    d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    (d / "config.json").write_text(json.dumps({"vocab": CONFIG["vocab"], "hidden": CONFIG["hidden"]}))
    shape = (CONFIG["vocab"], CONFIG["hidden"])
    save_file({"embed.weight": torch.randn(shape, generator=g), "head.weight": torch.randn(shape, generator=g)},
              str(d / "model.safetensors"))
    return d


def micro_batches(step: int) -> list[dict[str, Any]]:
    """The data of one step: ragged rows padded with a mask, and per-row advantages (any loop's own data)."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(CONFIG["accumulation"]):
        ids = torch.randint(1, CONFIG["vocab"], (4, 9), generator=g)
        mask = (torch.arange(9)[None, :] < torch.randint(4, 10, (4, 1), generator=g)).long()
        out.append({"ids": ids * mask, "mask": mask, "advantages": torch.randn(4, generator=g),
                    "temperature": 1.0, "accumulation": CONFIG["accumulation"]})
    return out


def main(out: Path, capture_step: int | None = 1, capture_steps: list[int] | None = None) -> dict[str, Any]:
    base = write_base(out / "base")
    torch.manual_seed(CONFIG["seed"])
    model, opt, sched = build(base, torch.device("cpu"))
    common: dict[str, Any] = {"framework": "torch", "base_model_dir": base, "entry": f"{Path(__file__).resolve()}:"
                              "replay_target", "config": {"torch": CONFIG, "model": {"path": str(base)}}}
    cap: StepCapture | None = None
    chosen: ChosenSteps | None = None
    if capture_steps is not None:
        chosen = ChosenSteps(out / "capture", steps=capture_steps, **common)
    elif capture_step is not None:
        cap = StepCapture(out / "capture", step=capture_step, model=model, optimizer=opt, scheduler=sched, **common)
    losses = []
    for step in range(CONFIG["steps"]):
        if chosen is not None:  # the chosen step's capture, None for the others
            c = chosen.at(step, model=model, optimizer=opt, scheduler=sched)
        else:
            c = cap if cap is not None and step == cap.step else None
        if c is not None:
            c.begin()                                      # adapter, optimizer and scheduler state before the step
        total = 0.0
        for inputs in micro_batches(step):
            if c is not None:
                c.record(inputs)                           # the inputs and the RNG right before the loss call
            loss = loss_fn(model, inputs)
            loss.backward()
            total += float(loss.detach())
            if c is not None:
                c.add_loss(float(loss.detach()))
        grad_norm = optimizer_step(model, opt, sched, CONFIG["max_grad_norm"])
        if c is not None:
            c.finish(grad_norm=grad_norm)                  # files, manifest last, (metrics.json, replay.toml)
        losses.append(total)
    if chosen is not None:
        chosen.close()                                     # several steps: metrics.json, last
    return {"losses": losses, "capture": str(out / "capture") if cap or chosen else None}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(json.dumps(main(Path(sys.argv[1]))))
