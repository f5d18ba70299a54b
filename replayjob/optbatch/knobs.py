"""The registry of systems-only knobs: config keys a replay may change without changing the math.

A replay may differ from its source only in keys listed here, each declared in
``optimizer_batch.allow_config_differences``.  Each knob carries a one-line justification of why
it cannot change the update in exact arithmetic, and an optional condition under which that
argument holds (checked on both configs; when it fails the difference is refused).

Every knob also says how a replay observes the value in effect at run time (:attr:`Knob.observe`,
read from the built model or the update as it ran, never echoed from the config) and which
observation its intended value predicts (:meth:`Knob.expected`); ``replay_metrics.json`` records
the observation of every registered knob and ``reduce`` compares it with the intended value.

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
class Runtime:
    """What a replay observes knobs from: the built model and the update as it ran."""

    model: Any
    micro_batch_rows: tuple[int, ...]  # rows of each micro-batch the update processed, in order


Observer = Callable[[Runtime], Any]


@dataclass(frozen=True)
class Knob:
    """A systems-only config key: why it cannot change the update, when that holds, how it is observed.

    ``condition`` is checked on both configs at admission; ``model_condition`` on the built model
    before the update (a replay that declares the knob is refused when either gives a reason).
    ``observe`` reads the value in effect at run time (``None`` when the runtime does not report it,
    which never equals an intended value); ``predict`` maps the intended value and the replayed row
    count to the observation it implies (identity when absent).
    """

    key: str
    justification: str
    condition: Condition | None = None
    observe: Observer | None = None
    model_condition: Callable[[Any], str | None] | None = None
    predict: Callable[[Any, int], Any] | None = None

    def refusal(self, source: Config, replay: Config) -> str | None:
        """Why this knob may not differ between these two configs, or None when it may."""
        return self.condition(source, replay) if self.condition else None

    def model_refusal(self, model: Any) -> str | None:
        """Why this knob may not differ on this built model, or None when it may."""
        return self.model_condition(model) if self.model_condition else None

    def expected(self, intended: Any, rows: int) -> Any:
        """The observation ``intended`` implies for a replay of ``rows`` rows."""
        return self.predict(intended, rows) if self.predict else intended


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _config_dropouts(doc: Any, prefix: str = "") -> list[str]:
    """``key=p`` for every dropout probability > 0 in a model config document (any depth)."""
    found: list[str] = []
    if isinstance(doc, dict):
        for k, v in sorted(doc.items(), key=lambda kv: str(kv[0])):
            name = f"{prefix}{k}"
            if isinstance(v, dict):
                found += _config_dropouts(v, name + ".")
            elif ("dropout" in str(k) or "pdrop" in str(k)) and _positive(v):
                found.append(f"{name}={v}")
    return found


def _dropouts(cfg: Config) -> list[str]:
    """Every dropout the config switches on: LoRA's and any in a local base model's config.json
    (the built-in tiny model has none: its attention dropout is 0)."""
    from replayjob.errors import RefusedError
    from replayjob.jsonio import read_json_object

    found = [f"lora.dropout={cfg.lora.dropout}"] if cfg.lora.dropout else []
    if cfg.model.path:
        where = f"{cfg.model.path}/config.json"
        try:
            found += [f"{where}: {d}" for d in _config_dropouts(read_json_object(where))]
        except RefusedError as exc:
            found.append(f"{where} cannot be read to rule dropout out ({exc.message})")
    return found


def _no_dropout(source: Config, replay: Config) -> str | None:
    found = sorted(set(_dropouts(source) + _dropouts(replay)))
    if found:
        return ("dropout draws one random mask per micro-batch, so regrouping rows changes which random "
                "numbers each row sees: " + ", ".join(found))
    return None


def _no_dropout_in_model(model: Any) -> str | None:
    """Every dropout module with p > 0 and every ``*dropout*`` config attribute > 0 of the built model."""
    from torch.nn.modules.dropout import _DropoutNd

    found = [f"{name} (p={m.p})" for name, m in model.named_modules() if isinstance(m, _DropoutNd) and m.p > 0]
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        found += [f"config {d}" for d in _config_dropouts(to_dict())]
    if found:
        return ("the built model draws dropout masks per micro-batch: " + ", ".join(found[:5])
                + (f" and {len(found) - 5} more" if len(found) > 5 else ""))
    return None


def _not_strict(source: Config, replay: Config) -> str | None:
    if source.backend.options.strict_deterministic or replay.backend.options.strict_deterministic:
        return "strict_deterministic requires the eager attention implementation on both sides"
    return None


def _observe_checkpointing(rt: Runtime) -> bool | None:
    """The model's own report (transformers' ``is_gradient_checkpointing``), else any submodule that has
    checkpointing switched on."""
    flag = getattr(rt.model, "is_gradient_checkpointing", None)
    if isinstance(flag, bool):
        return flag
    modules = getattr(rt.model, "modules", None)
    if not callable(modules):
        return None
    return any(getattr(m, "gradient_checkpointing", False) is True for m in modules())


def _observe_micro_batch(rt: Runtime) -> int | None:
    """Rows of the largest micro-batch the update processed."""
    return max(rt.micro_batch_rows) if rt.micro_batch_rows else None


def _observe_attention(rt: Runtime) -> str | None:
    """The attention implementation the built model's config dispatches to."""
    value = getattr(getattr(rt.model, "config", None), "_attn_implementation", None)
    return value if isinstance(value, str) else None


GRADIENT_CHECKPOINTING = "backend.options.gradient_checkpointing"

_KNOBS = (
    Knob(GRADIENT_CHECKPOINTING,
         "recomputes the same forward operations on the same inputs during backward (the Torch RNG "
         "state is preserved for the recomputation), so gradients are those of the plain forward",
         observe=_observe_checkpointing),
    Knob("training.micro_batch_size",
         "loss weights already carry the batch normalisation, padded positions carry zero weight and "
         "are masked from attention, and gradients of a sum of micro-batch losses are the sum of "
         "their gradients", _no_dropout, observe=_observe_micro_batch, model_condition=_no_dropout_in_model,
         predict=lambda intended, rows: min(intended, rows) if isinstance(intended, int) else intended),
    Knob("backend.options.attn_implementation",
         "eager and sdpa compute the same softmax(QK^T / sqrt(d) + mask) V; only the kernel "
         "differs", _not_strict, observe=_observe_attention),
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


def observe_all(rt: Runtime) -> dict[str, Any]:
    """The value in effect at run time of every registered knob (``None``: not reported)."""
    return {key: knob.observe(rt) if knob.observe else None for key, knob in sorted(KNOBS.items())}
