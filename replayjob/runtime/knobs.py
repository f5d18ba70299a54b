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

Every knob belongs to the producers it applies to (:attr:`Knob.frameworks`): replayjob's own trainer
(``replayjob``, keys of its config) or an external trainer of :mod:`replayjob.integrations` (``trl``:
keys of the captured framework config, observed on the rebuilt TRL trainer and model; ``torch`` has
none, its whole config is the contract).  A replay may declare only its producer's knobs and records
the observation of exactly those (:func:`knobs_for`).

Example:
    >>> sorted(knobs_for("replayjob"))[:2]
    ['backend.options.attn_implementation', 'backend.options.gradient_checkpointing']
    >>> sorted(knobs_for("trl"))[:3]
    ['distributed.num_processes', 'model.attn_implementation', 'model.routing']
    >>> sorted(knobs_for("trl"))[3:5]
    ['trl.gradient_accumulation_steps', 'trl.gradient_checkpointing']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from replayjob import frameworks
from replayjob.config import Config
from replayjob.errors import RefusedError
from replayjob.jsonio import read_json_object
from replayjob.model import moe
from replayjob.runtime.distributed import strategy_of

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
    "distributed.timeout_s": "how long a rank waits for another; it never changes an update",
}

Condition = Callable[[Config, Config], str | None]


@dataclass(frozen=True)
class Runtime:
    """What a replay observes knobs from: the built model, the update as it ran, and (an external
    trainer's replay) the framework's built trainer."""

    model: Any
    micro_batch_rows: tuple[int, ...]  # rows of each micro-batch the update processed, in order (every rank's)
    trainer: Any = None
    parallel: Any = None  # runtime.distributed.Parallel: the model as the ranks wrapped it (None: one process)
    world_size: int = 1  # ranks in the process group the update ran in


Observer = Callable[[Runtime], Any]
# (intended value, replayed rows, every intended knob value of the arm, the source's value of every knob) -> the
# observation it implies
Predictor = Callable[[Any, int, Mapping[str, Any], Mapping[str, Any]], Any]

BUILTIN = frameworks.BUILTIN  # the producer name of replayjob's own trainer (capture, replay)


@dataclass(frozen=True)
class Knob:
    """A systems-only config key: why it cannot change the update, when that holds, how it is observed.

    ``frameworks`` names the producers whose runs the key belongs to (:data:`replayjob.frameworks.PRODUCERS`): a replay
    may declare, and records the observation of, exactly its own producer's knobs.
    ``condition`` is checked on both configs at admission; ``model_condition`` on the built model
    before the update (a replay that declares the knob is refused when either gives a reason).
    ``observe`` reads the value in effect at run time (``None`` when the runtime does not report it,
    which never equals an intended value); ``predict`` maps the intended value, the replayed row
    count, the arm's other intended knob values and the source's knob values to the observation it implies
    (identity when absent).  A knob whose value the replay derives from another's (TRL's accumulation steps
    when the micro-batch size changes) predicts it with the very rule the replay applies, so the replay, the
    ``exact.knobs_in_effect`` check of ``reduce`` and the funnel expect one value.
    """

    key: str
    justification: str
    condition: Condition | None = None
    observe: Observer | None = None
    model_condition: Callable[[Any], str | None] | None = None
    predict: Predictor | None = None
    frameworks: tuple[str, ...] = (BUILTIN,)

    def refusal(self, source: Config, replay: Config) -> str | None:
        """Why this knob may not differ between these two configs, or None when it may."""
        return self.condition(source, replay) if self.condition else None

    def model_refusal(self, model: Any) -> str | None:
        """Why this knob may not differ on this built model, or None when it may."""
        return self.model_condition(model) if self.model_condition else None

    def expected(self, intended: Any, rows: int, arm: Mapping[str, Any] | None = None,
                 source: Mapping[str, Any] | None = None) -> Any:
        """The observation ``intended`` implies for a replay of ``rows`` rows whose other knobs are
        intended as in ``arm``, of a source whose knobs had the values ``source``."""
        return self.predict(intended, rows, arm or {}, source or {}) if self.predict else intended


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def config_dropouts(doc: Any, prefix: str = "") -> list[str]:
    """``key=p`` for every dropout probability > 0 in a model config document (any depth)."""
    found: list[str] = []
    if isinstance(doc, dict):
        for k, v in sorted(doc.items(), key=lambda kv: str(kv[0])):
            name = f"{prefix}{k}"
            if isinstance(v, dict):
                found += config_dropouts(v, name + ".")
            elif ("dropout" in str(k) or "pdrop" in str(k)) and _positive(v):
                found.append(f"{name}={v}")
    return found


def _dropouts(cfg: Config) -> list[str]:
    """Every dropout the config switches on: LoRA's and any in a local base model's config.json
    (the built-in tiny model has none: its attention dropout is 0)."""

    found = [f"lora.dropout={cfg.lora.dropout}"] if cfg.lora.dropout else []
    if cfg.model.path:
        where = f"{cfg.model.path}/config.json"
        try:
            # a model directory the user names (a Hugging Face snapshot links its files): links followed
            found += [f"{where}: {d}" for d in config_dropouts(read_json_object(where, follow_symlinks=True))]
        except RefusedError as exc:
            found.append(f"{where} cannot be read to rule dropout out ({exc.message})")
    return found


def _no_dropout(source: Config, replay: Config) -> str | None:
    found = sorted(set(_dropouts(source) + _dropouts(replay)))
    if found:
        return ("dropout draws one random mask per micro-batch, so regrouping rows changes which random "
                "numbers each row sees: " + ", ".join(found))
    return None


def _regroupable(source: Config, replay: Config) -> str | None:
    """No dropout (:func:`_no_dropout`) and no router loss: an MoE model's load-balancing loss is a product of
    per-micro-batch means, so regrouping rows into other micro-batches or ranks changes it."""
    why = _no_dropout(source, replay)
    coefs = sorted({c.model.router_aux_loss_coef for c in (source, replay) if c.model.router_aux_loss_coef})
    if why is None and coefs:
        return (f"model.router_aux_loss_coef = {coefs[0]} adds a load-balancing loss computed per micro-batch (a "
                "product of the micro-batch's expert shares and mean router probabilities), which regrouping the rows "
                "changes")
    return why


def _no_dropout_in_model(model: Any) -> str | None:
    """Every dropout module with p > 0 and every ``*dropout*`` config attribute > 0 of the built model."""
    from torch.nn.modules.dropout import _DropoutNd

    found = [f"{name} (p={m.p})" for name, m in model.named_modules() if isinstance(m, _DropoutNd) and m.p > 0]
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        found += [f"config {d}" for d in config_dropouts(to_dict())]
    if found:
        return ("the built model draws dropout masks per micro-batch: " + ", ".join(found[:5])
                + (f" and {len(found) - 5} more" if len(found) > 5 else ""))
    return None


def _not_strict(source: Config, replay: Config) -> str | None:
    if source.backend.options.strict_deterministic or replay.backend.options.strict_deterministic:
        return "strict_deterministic requires the eager attention implementation on both sides"
    return None


def _checkpointed(model: Any) -> list[Any]:
    """The submodules of ``model`` that have checkpointing switched on (transformers' per-layer flag)."""
    modules = getattr(model, "modules", None)
    return [m for m in modules() if getattr(m, "gradient_checkpointing", False) is True] if callable(modules) else []


def _observe_checkpointing(rt: Runtime) -> bool | None:
    """The model's own report (transformers' ``is_activation_checkpointing``, or its older name
    ``is_gradient_checkpointing``), else whether any submodule has checkpointing switched on."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        flag = getattr(rt.model, name, None)
        if isinstance(flag, bool):
            return flag
    if not callable(getattr(rt.model, "modules", None)):
        return None
    return bool(_checkpointed(rt.model))


def _observe_reentrant(rt: Runtime) -> bool | None:
    """``use_reentrant`` of the checkpoint function the checkpointed layers call (transformers installs
    ``functools.partial(torch.utils.checkpoint.checkpoint, **kwargs)`` on each); ``None`` when no layer is
    checkpointed, so no checkpoint function is in effect."""
    flags = set()
    for m in _checkpointed(rt.model):
        fn = getattr(m, "_gradient_checkpointing_func", None)
        keywords = getattr(fn, "keywords", None)
        if fn is not None:
            flags.add(keywords.get("use_reentrant") if isinstance(keywords, dict) else None)
    if len(flags) != 1:
        return None  # none in effect, or layers disagree: reported as not observed
    flag = flags.pop()
    return flag if isinstance(flag, bool) else None


# transformers' activation_checkpointing_enable passes use_reentrant=False when no kwargs are given
# (transformers 5, the tested stack; a version with another default shows up as a mismatch, not a pass).
_DEFAULT_USE_REENTRANT = False


def _predict_reentrant(intended: Any, rows: int, arm: Mapping[str, Any], source: Mapping[str, Any]) -> Any:
    if arm.get(TRL_GRADIENT_CHECKPOINTING) is not True:
        return None  # no checkpoint function in effect
    return _DEFAULT_USE_REENTRANT if intended is None else intended


def _observe_micro_batch(rt: Runtime) -> int | None:
    """Rows of the largest micro-batch the update processed."""
    return max(rt.micro_batch_rows) if rt.micro_batch_rows else None


def _observe_attention(rt: Runtime) -> str | None:
    """The attention implementation the built model's config dispatches to."""
    value = getattr(getattr(rt.model, "config", None), "_attn_implementation", None)
    return value if isinstance(value, str) else None


def _observe_world_size(rt: Runtime) -> int:
    """Ranks in the process group the update ran in (1 without one)."""
    return rt.world_size


def _observe_strategy(rt: Runtime) -> str:
    """How the model was wrapped: ``ddp`` (a DistributedDataParallel module), ``fsdp2`` (a module sharded by
    ``fully_shard``), else ``none``."""

    return strategy_of(rt.parallel)


def _observe_bucket(rt: Runtime) -> float | None:
    """DDP's gradient bucket cap in MiB as the wrapper holds it; ``None`` when DDP is not in effect."""
    return getattr(rt.parallel, "bucket_cap_mb", None) if rt.parallel is not None else None


def _predict_world_size(intended: Any, rows: int, arm: Mapping[str, Any], source: Mapping[str, Any]) -> Any:
    return 1 if intended is None else intended  # a capture from before [distributed] ran on one process


def _predict_strategy(intended: Any, rows: int, arm: Mapping[str, Any], source: Mapping[str, Any]) -> Any:
    return "none" if intended is None else intended


def _predict_bucket(intended: Any, rows: int, arm: Mapping[str, Any], source: Mapping[str, Any]) -> Any:
    return intended if arm.get(STRATEGY) == "ddp" else None  # no buckets without DDP


def _predict_micro_batch(intended: Any, rows: int, arm: Mapping[str, Any], source: Mapping[str, Any]) -> Any:
    """The largest micro-batch: the size, or fewer rows when the largest rank's shard is smaller."""
    world = arm.get(WORLD_SIZE) or 1
    shard = -(-rows // world) if isinstance(world, int) and world > 0 else rows
    return min(intended, shard) if isinstance(intended, int) else intended


GRADIENT_CHECKPOINTING = "backend.options.gradient_checkpointing"
WORLD_SIZE = "distributed.world_size"
STRATEGY = "distributed.strategy"
BUCKET_CAP_MB = "distributed.bucket_cap_mb"
TRL_GRADIENT_CHECKPOINTING = "trl.gradient_checkpointing"
TRL_USE_REENTRANT = "trl.gradient_checkpointing_kwargs.use_reentrant"
TRL_MICRO_BATCH = "trl.per_device_train_batch_size"
NUM_PROCESSES = "distributed.num_processes"  # an external trainer's process count (TRL's DDP, verl's data parallelism)
TRL_ACCUMULATION = "trl.gradient_accumulation_steps"
TRL_STEPS_PER_GENERATION = "trl.steps_per_generation"


def _observe_processes(rt: Runtime) -> int | None:
    """The processes the external trainer ran the update on: its accelerator's (TRL), else the replay session's
    data-parallel world (verl)."""
    accelerator = getattr(rt.trainer, "accelerator", None)
    n = getattr(accelerator, "num_processes", None) if accelerator is not None else getattr(rt.trainer, "world", None)
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _predict_processes(intended: Any, rows: int, arm: Mapping[str, Any], source: Mapping[str, Any]) -> Any:
    """A capture that records no process count ran on one process."""
    return 1 if intended is None else intended


TRL_GEOMETRY = (TRL_MICRO_BATCH, TRL_ACCUMULATION, TRL_STEPS_PER_GENERATION)


def trl_geometry(source: Mapping[str, Any], arm: Mapping[str, Any], rows: int) -> dict[str, Any]:
    """The batch geometry a TRL replay of ``rows`` captured rows runs, by key of :data:`TRL_GEOMETRY`.

    ``source`` holds the capture's values of the three keys, ``arm`` the replay's intended ones.  With the
    micro-batch size kept, the arm's own values (a process-count change declares the accumulation steps and the
    generation period itself).  With another size (only ever declared alone, on a one-process capture), the
    captured rows are re-split into micro-batches of that size: as many accumulation steps as that makes, and
    ``steps_per_generation`` scaled with them, so the generation batch and the ratio TRL's ``dapo`` normaliser
    reads (``current_gradient_accumulation_steps / steps_per_generation``) are kept.  The replay builds its
    trainer with these values and the ``predict`` hooks of the two derived knobs return them, so the replay and
    the knobs-in-effect check of ``reduce`` (and the funnel) expect the same values.

    >>> trl_geometry({TRL_MICRO_BATCH: 4, TRL_ACCUMULATION: 2, TRL_STEPS_PER_GENERATION: 2},
    ...              {TRL_MICRO_BATCH: 2, TRL_ACCUMULATION: 2, TRL_STEPS_PER_GENERATION: 2}, 8)[TRL_ACCUMULATION]
    4
    """
    kept = {k: arm.get(k) for k in TRL_GEOMETRY}
    counts = [source.get(k) for k in TRL_GEOMETRY] + [arm.get(TRL_MICRO_BATCH), rows]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in counts):
        return kept  # a source that records no geometry (not a TRL capture)
    size, acc, spg, new, _ = (int(v) for v in counts)
    if new == size:
        return kept
    new_acc = rows // new
    return {TRL_MICRO_BATCH: new, TRL_ACCUMULATION: new_acc, TRL_STEPS_PER_GENERATION: spg * new_acc // acc}


def _predict_geometry(key: str) -> Predictor:
    """The predict hook of a TRL knob the replay derives from the micro-batch size (:func:`trl_geometry`)."""
    def predict(intended: Any, rows: int, arm: Mapping[str, Any], source: Mapping[str, Any]) -> Any:
        return trl_geometry(source, {**arm, key: intended}, rows)[key]
    return predict


def _trainer_arg(name: str) -> Observer:
    """An observer of the external trainer's own argument ``name`` (as its training step reads it)."""
    def observe(rt: Runtime) -> Any:
        return getattr(getattr(rt.trainer, "args", None), name, None)
    return observe

_KNOBS = (
    Knob(GRADIENT_CHECKPOINTING,
         "recomputes the same forward operations on the same inputs during backward (the Torch RNG "
         "state is preserved for the recomputation), so gradients are those of the plain forward",
         observe=_observe_checkpointing),
    Knob("training.micro_batch_size",
         "loss weights already carry the batch normalisation, padded positions carry zero weight and "
         "are masked from attention, and gradients of a sum of micro-batch losses are the sum of "
         "their gradients", _regroupable, observe=_observe_micro_batch, model_condition=_no_dropout_in_model,
         predict=_predict_micro_batch),
    Knob("backend.options.attn_implementation",
         "eager and sdpa compute the same softmax(QK^T / sqrt(d) + mask) V; only the kernel "
         "differs", _not_strict, observe=_observe_attention),
    # Several ranks (replayjob.runtime.distributed): the same logical rows split contiguously over the ranks.
    Knob(WORLD_SIZE,
         "every rank processes a disjoint shard of the same logical rows and the loss weights are normalised over "
         "the whole logical batch, so the gradient is the sum of the same per-row gradients however the rows are "
         "split; only the floating-point summation order changes", _regroupable, observe=_observe_world_size,
         model_condition=_no_dropout_in_model, predict=_predict_world_size),
    Knob(STRATEGY,
         "one process accumulates the per-row gradients itself, DDP sums the ranks' accumulated gradients with an "
         "all-reduce (a sum hook replaces DDP's average, the loss weights being normalised already), FSDP2 "
         "reduce-scatters the same sums into parameter shards (divide factor 1) and clips on the global norm; the "
         "same rows and weights, only where and in which order the sums are taken changes", _regroupable,
         observe=_observe_strategy, model_condition=_no_dropout_in_model, predict=_predict_strategy),
    Knob(BUCKET_CAP_MB,
         "groups gradient elements into all-reduce messages; each element is still the sum of the same per-rank "
         "values", observe=_observe_bucket, predict=_predict_bucket),
    # External trainers (replayjob.integrations): keys of the captured framework config, observed on the
    # framework's built trainer and model.
    Knob(TRL_GRADIENT_CHECKPOINTING,
         "transformers recomputes each layer's forward on the same inputs during backward, restoring the "
         "Torch RNG state for the recomputation (LoRA dropout masks repeat), so gradients are the plain forward's",
         observe=_observe_checkpointing, frameworks=("trl",)),
    Knob(TRL_USE_REENTRANT,
         "the reentrant and non-reentrant torch.utils.checkpoint variants recompute the same operations "
         "with the RNG state preserved; they differ only in how autograd re-enters the recomputation",
         observe=_observe_reentrant, predict=_predict_reentrant, frameworks=("trl",)),
    Knob(TRL_MICRO_BATCH,
         "the step's captured rows are re-split into micro-batches of this size, the accumulation steps (and, for "
         "dapo, steps_per_generation) scaled so each row keeps its loss weight; admitted only for the loss types "
         "whose normalisation makes that exact (grpo, dr_grpo, sapo, luspo, dapo; equal micro-batch sizes) and "
         "without dropout, whose masks would be redrawn (checked by the TRL integration at admission)",
         observe=_observe_micro_batch, model_condition=_no_dropout_in_model, predict=_predict_micro_batch,
         frameworks=("trl",)),
    Knob("model.attn_implementation",
         "eager and sdpa compute the same softmax(QK^T / sqrt(d) + mask) V for the model the replay "
         "loads from the base model directory; only the kernel differs",
         observe=_observe_attention, frameworks=("trl",)),
    # An external trainer over several processes: the process count (TRL: with it only, the accumulation that runs
    # every captured micro-batch once; the per-loss rules are checked by each integration at admission).
    Knob(NUM_PROCESSES,
         "TRL: each process runs a contiguous run of the captured micro-batches whole, restoring each one's captured "
         "RNG state, and DDP averages the processes' gradients; with processes x gradient_accumulation_steps kept, "
         "each micro-batch's weight is kept, and for dapo/cispo/vespo (whose normaliser divides by the process count) "
         "gradient_accumulation_steps / steps_per_generation too. verl: the captured processes' shares are joined "
         "into the mini-batch and each process takes a contiguous share of its rows; verl's loss divides each "
         "process's sum by the whole mini-batch's tokens (or rows), all-reduced, times the process count, and FSDP "
         "averages the processes' gradients, so each token's weight is kept. Only the summation order changes",
         observe=_observe_processes, predict=_predict_processes, frameworks=("trl", "verl")),
    Knob(TRL_ACCUMULATION,
         "the accumulation steps of a process-count change (admitted only with distributed.num_processes): "
         "processes x accumulation steps runs every captured micro-batch exactly once; derived (trl_geometry) "
         "when trl.per_device_train_batch_size changes",
         observe=_trainer_arg("gradient_accumulation_steps"), predict=_predict_geometry(TRL_ACCUMULATION),
         frameworks=("trl",)),
    Knob(TRL_STEPS_PER_GENERATION,
         "the generation period of a process-count change (admitted only with distributed.num_processes): it keeps "
         "the generation batch and, for dapo/cispo/vespo, the accumulation ratio of the loss's normaliser; derived "
         "(trl_geometry) when trl.per_device_train_batch_size changes",
         observe=_trainer_arg("steps_per_generation"), predict=_predict_geometry(TRL_STEPS_PER_GENERATION),
         frameworks=("trl",)),
)

# Mixture-of-experts models (replayjob.model.moe, docs/moe.md).
MOE_ROUTING = "model.routing"
MOE_EXPERTS_IMPLEMENTATION = "model.experts_implementation"


def _observe_routing(rt: Runtime) -> str:
    """``forced`` or ``free``, as the model's routers run (a model without routers routes nothing: ``free``)."""
    routing = moe.attached(rt.model)
    return "free" if routing is None else routing.mode


def _observe_experts(rt: Runtime) -> str | None:
    """The experts kernel the built model's config dispatches to (transformers reports ``eager`` for a model
    without experts)."""
    value = getattr(getattr(rt.model, "config", None), "_experts_implementation", None)
    return value if isinstance(value, str) else None


def _predict_routing(intended: Any, rows: int, arm: Mapping[str, Any], source: Mapping[str, Any]) -> Any:
    """A source that records no routing setting (a TRL capture: a trainer routes freely) routed ``free``."""
    return "free" if intended is None else intended


_MOE_KNOBS = (
    Knob(MOE_ROUTING,
         "forcing the experts an update of the same rows chose (the source step's routing_step_<K> file or a "
         "same-condition replay's routing.safetensors, pinned) selects for every real token the experts the router's "
         "top-k selects there, with the weights gathered from the same live softmax, so the forward and its gradient "
         "are the free forward's; only where a changed arm's router would choose other experts (a routing flip) "
         "does forcing keep the recorded choice",
         observe=_observe_routing, predict=_predict_routing, frameworks=(BUILTIN, "trl")),
    Knob(MOE_EXPERTS_IMPLEMENTATION,
         "eager, batched_mm and grouped_mm compute the same sum over each token's top-k experts of routing weight "
         "x expert MLP; only the kernel and its summation order differ",
         observe=_observe_experts),
)

KNOBS: dict[str, Knob] = {k.key: k for k in _KNOBS}
KNOBS.update({k.key: k for k in _MOE_KNOBS})


def knobs_for(framework: str) -> dict[str, Knob]:
    """The registered knobs of one producer (``replayjob``, ``trl``, ``torch``), by key."""
    return {k: knob for k, knob in KNOBS.items() if framework in knob.frameworks}


STACK_PREFIX = "stack."
STACK_JUSTIFICATION = ("a different framework or library version may change the arithmetic of the update; "
                       "declared, it is admitted for the approximate claim only, never exact-input or bitwise")


def stack_keys(source_resolved: dict[str, Any]) -> list[str]:
    """The version keys (``stack.<package>``) of an external trainer's captured config."""
    stack = source_resolved.get("stack")
    return [STACK_PREFIX + k for k in sorted(stack)] if isinstance(stack, dict) else []


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


def observe_all(rt: Runtime, framework: str = BUILTIN) -> dict[str, Any]:
    """The value in effect at run time of every registered knob of ``framework`` (``None``: not reported)."""
    return {key: knob.observe(rt) if knob.observe else None for key, knob in sorted(knobs_for(framework).items())}


# verl (replayjob.producers.verl.producer): settings of verl's engine in the captured actor update, observed on the
# replay's engine (its session records what the engine ran in ``observed``).
VERL_MICRO_BATCH = "verl.engine.micro_batch_size_per_gpu"
VERL_GRADIENT_CHECKPOINTING = "verl.model.enable_gradient_checkpointing"
VERL_DYNAMIC_BSZ = "verl.engine.use_dynamic_bsz"
VERL_MAX_TOKENS = "verl.engine.max_token_len_per_gpu"
VERL_REMOVE_PADDING = "verl.engine.use_remove_padding"  # with its twin in the model section, declared together
VERL_REMOVE_PADDING_MODEL = "verl.model.use_remove_padding"
VERL_PARAM_DTYPE = "verl.engine.mixed_precision.param_dtype"  # entries of verl's mixed_precision table
VERL_REDUCE_DTYPE = "verl.engine.mixed_precision.reduce_dtype"
# The replay's condition a trace's identity records (docs/trace-format.md), declared once per producer as the knob
# whose observed value it is: the producer writes it from the replay's observed knobs, and whoever reads a trace as
# a replay's own (replayjob.trace.diff.replay_trace) derives it again from that replay's record.  A producer without
# such a knob (a plain loop: no registered knobs) records its own view, which no record can confirm.
TRACE_CONDITION: dict[str, dict[str, str]] = {
    frameworks.BUILTIN: {"gradient_checkpointing": GRADIENT_CHECKPOINTING,
                         "micro_batch_size": "training.micro_batch_size"},
    "trl": {"gradient_checkpointing": TRL_GRADIENT_CHECKPOINTING, "micro_batch_size": TRL_MICRO_BATCH},
    "verl": {"gradient_checkpointing": VERL_GRADIENT_CHECKPOINTING, "micro_batch_size": VERL_MICRO_BATCH},
}


def trace_condition(framework: str, runtime: Mapping[str, Any]) -> dict[str, bool | int]:
    """The trace identity's ``gradient_checkpointing`` and ``micro_batch_size`` of a replay of ``framework`` whose
    observed knobs are ``runtime`` (:data:`TRACE_CONDITION`; only the fields that producer declares): checkpointing
    as a flag (not observed: off), the largest micro-batch's rows (not observed, as under verl's dynamic batch
    sizes: 0)."""
    out: dict[str, bool | int] = {}
    for field, key in TRACE_CONDITION.get(framework, {}).items():
        value = runtime.get(key)
        if field == "gradient_checkpointing":
            out[field] = value is True
        else:
            out[field] = value if type(value) is int and value >= 0 else 0
    return out


# verl's precision names (verl.utils.torch_dtypes.PrecisionType) by the name verl reports (PrecisionType.to_str)
VERL_PRECISIONS = {"fp16": ("16", "fp16", "float16", "torch.float16"),
                   "fp32": ("32", "fp32", "float32", "torch.float32"),
                   "bf16": ("bf16", "bfloat16", "torch.bfloat16")}


def verl_precision(intended: Any, *_: Any) -> Any:
    """A verl precision name as verl reports the dtype it builds (``bfloat16`` -> ``bf16``); others unchanged."""
    return next((name for name, spellings in VERL_PRECISIONS.items() if str(intended) in spellings), intended)


def _verl_observed(name: str) -> Observer:
    def observe(rt: Runtime) -> Any:
        seen = getattr(rt.trainer, "observed", None)
        return seen.get(name) if isinstance(seen, dict) else None
    return observe


_VERL_KNOBS = (
    Knob(VERL_MICRO_BATCH,
         "verl's ppo_loss normalises every micro-batch's loss by the whole mini-batch (batch_num_tokens, "
         "global_batch_size and dp_size are computed before the engine splits it), so the gradient is the sum of the "
         "same per-token terms however the rows are split; only the summation order changes, so bitwise equality is "
         "not expected (exact-input or approximate judge it); refused with dropout (masks redrawn), with dynamic "
         "batch sizes (the size is not used) and for policy losses that select tokens by micro-batch statistics "
         "(clip_cov, kl_cov; checked by the verl integration at admission)",
         observe=_verl_observed("micro_batch_size_per_gpu"), model_condition=_no_dropout_in_model,
         frameworks=("verl",)),
    Knob(VERL_GRADIENT_CHECKPOINTING,
         "transformers recomputes each layer's forward on the same inputs during backward, restoring the Torch RNG "
         "state for the recomputation, so the gradients are the plain forward's",
         observe=_observe_checkpointing, frameworks=("verl",)),
    Knob(VERL_DYNAMIC_BSZ,
         "the engine groups the mini-batch's rows into micro-batches by a token budget instead of a row count (and "
         "puts the outputs back in row order); the loss is normalised by the whole mini-batch as with fixed "
         "micro-batches, so only the grouping and the summation order change (not bitwise); refused with dropout "
         "and without a token budget (checked by the verl integration at admission)",
         observe=_verl_observed("use_dynamic_bsz"), model_condition=_no_dropout_in_model, frameworks=("verl",)),
    Knob(VERL_MAX_TOKENS,
         "the token budget of a micro-batch under dynamic batch sizes: another grouping of the same rows, the loss "
         "normalised by the whole mini-batch; admitted only where use_dynamic_bsz is on (checked by the verl "
         "integration at admission)",
         observe=_verl_observed("max_token_len_per_gpu"), model_condition=_no_dropout_in_model,
         frameworks=("verl",)),
    Knob(VERL_REMOVE_PADDING,
         "packs each micro-batch's rows into one sequence (position ids restarting per row) instead of padding them "
         "to a rectangle: attention stays within each row and padded positions carry no loss either way, so only "
         "the kernels' shapes and the summation order change (not bitwise); declared together with "
         "verl.model.use_remove_padding, which the engine reads when it builds the model (checked by the verl "
         "integration at admission)",
         observe=_verl_observed("use_remove_padding"), frameworks=("verl",)),
    Knob(VERL_REMOVE_PADDING_MODEL,
         "the model-side switch of verl.engine.use_remove_padding (the attention patch applied when the engine "
         "builds the model); the same rule, declared together with it",
         observe=_verl_observed("model.use_remove_padding"), frameworks=("verl",)),
    Knob(VERL_PARAM_DTYPE,
         "the dtype FSDP2 casts the parameters to for forward and backward, and verl's autocast dtype: the same "
         "operations rounded at another precision, so the update's bits change beyond summation order (bf16 against "
         "fp32 moved a tiny model's update by 2.2e-2 relative, micro-batch 1 by 7e-7); the exact-input claim checks "
         "only that the inputs are the same, and the approximate claim with a measured tolerance judges the result "
         "(approximate claim only for the result); fp16 is "
         "refused (verl's gradient scaler is not captured; checked by the verl integration at admission)",
         observe=_verl_observed("mixed_precision.param_dtype"), predict=verl_precision, frameworks=("verl",)),
    Knob(VERL_REDUCE_DTYPE,
         "the dtype FSDP2 reduces (and accumulates) gradients in: the same sum rounded at another precision, so "
         "the bits change (bf16 against fp32: 8e-4 relative on the same update; approximate claim, as "
         "verl.engine.mixed_precision.param_dtype)",
         observe=_verl_observed("mixed_precision.reduce_dtype"), predict=verl_precision, frameworks=("verl",)),
)
KNOBS.update({k.key: k for k in _VERL_KNOBS})
