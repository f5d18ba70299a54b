"""The registry of systems-only knobs: config keys a replay may change without changing the math.

A replay may differ from its source only in keys listed here, each declared in
``optimizer_batch.allow_config_differences``.  Each knob carries a one-line justification of why
it cannot change the update in exact arithmetic, and an optional condition under which that
argument holds (checked on both configs; when it fails the difference is refused).

Some keys differ between any source and its replay by construction and are never compared
(:data:`IGNORED`): the runner, the ``[optimizer_batch]`` section itself, output locations and
labels, and the resume path, whose content is pinned by the adapter SHA-256 instead.

Example:
    >>> sorted(KNOBS)[:2]
    ['backend.options.attn_implementation', 'backend.options.gradient_checkpointing']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from replayjob.config import Config

# Keys (or whole sections) that are never compared between source and replay, with the reason.
IGNORED: dict[str, str] = {
    "training.trainer": "the runner differs by construction (grpo -> optimizer_replay)",
    "optimizer_batch": "capture/replay settings and pins describe the run, not its math",
    "logging.dir": "output location",
    "logging.run_name": "free-form label",
    "logging.metadata": "free-form labels",
    "resume.from": "a path; its content is pinned by the initial adapter SHA-256 instead",
    "training.max_steps": "the run's length; a capture pins its one update's start state and learning rate",
    "training.save_every": "checkpoint cadence; it never changes an update",
}

Condition = Callable[[Config, Config], str | None]


@dataclass(frozen=True)
class Knob:
    key: str
    justification: str
    condition: Condition | None = None

    def refusal(self, source: Config, replay: Config) -> str | None:
        """Why this knob may not differ between these two configs, or None when it may."""
        return self.condition(source, replay) if self.condition else None


def _no_dropout(source: Config, replay: Config) -> str | None:
    if source.lora.dropout or replay.lora.dropout:
        return ("lora.dropout > 0 draws one random mask per micro-batch, so regrouping rows changes "
                "which random numbers each row sees")
    return None


def _not_strict(source: Config, replay: Config) -> str | None:
    if source.backend.options.strict_deterministic or replay.backend.options.strict_deterministic:
        return "strict_deterministic requires the eager attention implementation on both sides"
    return None


_KNOBS = (
    Knob("backend.options.gradient_checkpointing",
         "recomputes the same forward operations on the same inputs during backward (the Torch RNG "
         "state is preserved for the recomputation), so gradients are those of the plain forward"),
    Knob("training.micro_batch_size",
         "loss weights already carry the batch normalisation, padded positions carry zero weight and "
         "are masked from attention, and gradients of a sum of micro-batch losses are the sum of "
         "their gradients", _no_dropout),
    Knob("backend.options.attn_implementation",
         "eager and sdpa compute the same softmax(QK^T / sqrt(d) + mask) V; only the kernel "
         "differs", _not_strict),
)

KNOBS: dict[str, Knob] = {k.key: k for k in _KNOBS}


def is_ignored(key: str) -> bool:
    return any(key == i or key.startswith(i + ".") for i in IGNORED)


def lookup(cfg_dict: dict[str, Any], key: str) -> Any:
    """The value at a dotted key of a resolved config dict (None when absent)."""
    node: Any = cfg_dict
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def arm_name(declared: list[str], replay_resolved: dict[str, Any]) -> str:
    """``baseline`` with no declared differences, else ``leaf=value`` pairs joined by ``+``."""
    if not declared:
        return "baseline"
    parts = []
    for key in sorted(declared):
        value = lookup(replay_resolved, key)
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        parts.append(f"{key.rsplit('.', 1)[-1]}={text}")
    return "+".join(parts)
