"""The optimizer contract: everything that defines the math of one update, and its SHA-256.

Source and replay must agree on it exactly; a systems-only knob (micro-batch size, gradient
checkpointing, attention kernel) is deliberately absent.  The contract covers the optimizer and
its hyper-parameters, gradient clipping, the loss and its coefficients, the parameter dtype, the
adapter's shape, the base model, the update rule, strict determinism and the math mode (TF32 or
not changes the arithmetic).  It is redacted before it is hashed or written.

Example:
    >>> from replayjob.config import load_config
    >>> c = optimizer_contract(load_config(None, ["training.seed=1"]))
    >>> c["optimizer"]["name"], c["loss"]["kind"], len(contract_sha256(c))
    ('adamw', 'ppo-clip+k3-kl', 64)
"""

from __future__ import annotations

from typing import Any

from replayjob.config import Config, redact
from replayjob.config.differences import differences
from replayjob.config.load import to_dict
from replayjob.digest import sha256_json
from replayjob.runtime import determinism

CONTRACT_SCHEMA = "replayjob.optimizer_contract/v1"
INTEGRATION_CONTRACT_SCHEMA = "replayjob.integration_contract/v1"  # a producer other than the built-in trainer


def _model_reference(cfg: Config) -> dict[str, Any]:
    """The base model as the contract sees it (no model is built: explain stays model-free)."""
    m = to_dict(cfg.model)
    if cfg.model.path:
        return {"kind": "local", "path": cfg.model.path}
    keys: tuple[str, ...] = ("init_seed", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                             "num_kv_heads", "max_position_embeddings")
    if cfg.model.architecture != "llama":  # a mixture-of-experts model (docs/moe.md); a dense one's is unchanged
        keys += ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    return {"kind": "builtin-tiny", **{k: m[k] for k in keys}}


def optimizer_contract(cfg: Config) -> dict[str, Any]:
    """The redacted optimizer contract of ``cfg``."""
    o, a, opts = cfg.optimizer, cfg.algorithm, cfg.backend.options
    contract = {
        "schema": CONTRACT_SCHEMA,
        "optimizer": {"name": o.name, "lr": o.lr, "betas": list(o.betas), "eps": o.eps,
                      "weight_decay": o.weight_decay, "foreach": False},
        "gradient_clipping": {"max_grad_norm": o.max_grad_norm, "norm_type": 2.0},
        "loss": {"kind": "ppo-clip+k3-kl", "clip_eps_low": a.clip_eps_low, "clip_eps_high": a.clip_eps_high,
                 "kl_loss_coef": a.kl_loss_coef, "loss_agg": a.loss_agg,
                 "reduction": "sum of loss_weights * token_loss over micro-batches"},
        "update": {"optimizer_steps": 1, "zero_grad": "set_to_none", "fresh_optimizer_state": True},
        "dtype": cfg.model.dtype,
        "adapter": {"r": cfg.lora.r, "alpha": cfg.lora.alpha, "dropout": cfg.lora.dropout,
                    "target_modules": list(cfg.lora.target_modules)},
        "model": _model_reference(cfg),
        "backend": cfg.backend.name,
        "strict_deterministic": opts.strict_deterministic,
        "math_mode": determinism.math_mode_from_env(opts.strict_deterministic),
    }
    if cfg.model.architecture != "llama" or cfg.model.router_aux_loss_coef:  # the router loss (docs/moe.md)
        loss: dict[str, Any] = contract["loss"]  # type: ignore[assignment]
        loss["router_aux_loss_coef"] = cfg.model.router_aux_loss_coef
    out: dict[str, Any] = redact(contract)
    return out


def integration_contract(framework: str, update: dict[str, Any], sequence: str, **fields: Any) -> dict[str, Any]:
    """The contract of a producer other than the built-in trainer: ``update``, the part of its config that
    defines the math of one update; ``sequence``, the calls one update makes; ``fields``, what else the
    producer pins (dtype, adapter); and the math mode the environment sets (pure: nothing imported)."""
    return {"schema": INTEGRATION_CONTRACT_SCHEMA, "framework": framework, "update": update, "sequence": sequence,
            **fields, "math_mode": determinism.math_mode_from_env(False)}


def contract_sha256(contract: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of a (redacted) contract."""
    return sha256_json(contract)


def contract_differences(source: dict[str, Any], replay: dict[str, Any]) -> list[str]:
    """Dotted keys where two contracts differ (empty when they match exactly)."""

    return differences(source, replay)
