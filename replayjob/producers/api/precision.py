"""The effective compute precision of a captured update: what the forward and backward really computed in.

A TRL run's config says ``bf16=True`` (``GRPOConfig``'s default) or not, but what decides the rounding of the
update is the precision in effect when the model runs: accelerate's mixed-precision policy wraps the model's
forward in ``torch.autocast`` (bfloat16 or float16, on CPU too), the parameters keep their own dtype, and on CUDA
float32 matmuls may run in TF32.  A capture records all of it as one fact (:func:`record`), observed on the
model's first forward of the captured step (:class:`Probe`: whether autocast was on, and in which dtype), and
names the lowest precision the matmuls ran in (``compute_dtype``).  Everything that bounds floating-point noise
reads that dtype instead of the dtype of the tensors it holds (parameters and activations outside autocast
regions stay float32): :func:`unit_roundoff`, and :func:`suggested_tolerances`, a starting point for the
approximate claim's tolerance file (docs/precision.md says where it holds and where it does not).

Example:
    >>> compute_dtype({"autocast": {"enabled": True, "dtype": "bfloat16"}, "param_dtype": "float32"})
    'bfloat16'
    >>> unit_roundoff("bfloat16") == 2 ** -8
    True
"""

from __future__ import annotations

from typing import Any

# Unit roundoff u = 2^-(mantissa bits + 1) of each dtype a matmul can run in (TF32 keeps 10 mantissa bits).
UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "tf32": 2.0 ** -11, "float16": 2.0 ** -11,
                 "bfloat16": 2.0 ** -8}
# The approximate claim's tolerance a systems change is held to: the adapter update's relative L2 distance from the
# baseline's within TOLERANCE_UNITS unit roundoffs of the compute dtype, and the cosine that distance implies
# (cos >= sqrt(1 - d^2) >= 1 - d^2 / 2 for an update at relative distance d from the baseline's).  A starting point,
# not a bound: measured floors (docs/precision.md, benchmarks/trl_precision_floor.py) are within it for the tests'
# hidden size 32 (at most 0.18 of it) and up to 8.7 times beyond it for hidden size 128, in both precisions (Adam's
# first steps turn near-zero gradient coordinates' rounding into whole-step differences), so a claim's tolerance
# should come from the floor measured on the model at hand.
TOLERANCE_UNITS = 8.0


def unit_roundoff(dtype: str) -> float:
    """The unit roundoff of a dtype name (``bfloat16``, ``float16``, ``tf32``, ``float32``, ``float64``)."""
    try:
        return UNIT_ROUNDOFF[dtype]
    except KeyError:
        raise ValueError(f"unknown compute dtype {dtype!r} (known: {', '.join(UNIT_ROUNDOFF)})") from None


def compute_dtype(precision: dict[str, Any]) -> str:
    """The lowest precision the update's matmuls ran in: the autocast dtype when autocast was on, else TF32 where
    float32 matmuls were allowed to use it (CUDA), else the parameters' dtype."""
    autocast = precision.get("autocast") or {}
    if autocast.get("enabled") and autocast.get("dtype"):
        return str(autocast["dtype"])
    param = str(precision.get("param_dtype") or "float32")
    if param == "float32" and precision.get("tf32_matmul"):
        return "tf32"
    return param


def suggested_tolerances(precision: dict[str, Any]) -> dict[str, float]:
    """The tolerance file (``update_cosine_min``, ``relative_delta_l2_max``) the approximate claim suggests for
    systems changes replayed from a capture of this precision."""
    d = TOLERANCE_UNITS * unit_roundoff(compute_dtype(precision))
    return {"update_cosine_min": 1.0 - d * d / 2.0, "relative_delta_l2_max": d}


def _dtype_name(dtype: Any) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


class Probe:
    """Records, on the first forward of ``module`` after :meth:`arm`, whether autocast was on for ``device_type``
    and in which dtype (a forward pre-hook: it reads state, changes nothing, consumes no random numbers)."""

    def __init__(self, module: Any, device_type: str):
        self.device_type = device_type
        self.seen: dict[str, Any] | None = None
        self._armed = False
        self._handle = module.register_forward_pre_hook(self._hook)

    def arm(self) -> None:
        self.seen, self._armed = None, True

    def _hook(self, module: Any, args: Any) -> None:
        if not self._armed:
            return
        import torch

        self._armed = False
        on = bool(torch.is_autocast_enabled(self.device_type))
        self.seen = {"enabled": on, "device_type": self.device_type,
                     "dtype": _dtype_name(torch.get_autocast_dtype(self.device_type)) if on else None}

    def close(self) -> None:
        self._handle.remove()


def record(*, mixed_precision: str, param_dtype: str, trainable_dtype: str | None,
           autocast: dict[str, Any] | None, device_type: str) -> dict[str, Any]:
    """The precision record a capture writes (``framework_state.precision``): the mixed-precision policy, the
    autocast state observed on the step's first forward (``None``: no forward was observed), the parameters' and
    the trainable parameters' dtypes, TF32 (CUDA only) and the resulting ``compute_dtype``."""
    import torch

    cuda = device_type == "cuda"
    out: dict[str, Any] = {
        "mixed_precision": mixed_precision, "autocast": autocast, "param_dtype": param_dtype,
        "trainable_dtype": trainable_dtype, "device_type": device_type,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "tf32_matmul": bool(cuda and (torch.backends.cuda.matmul.allow_tf32
                                      or torch.get_float32_matmul_precision() != "highest")),
        "tf32_cudnn": bool(cuda and torch.backends.cudnn.allow_tf32),
    }
    out["compute_dtype"] = compute_dtype(out)
    out["unit_roundoff"] = unit_roundoff(out["compute_dtype"])
    return out


def of_trainer(trainer: Any, autocast: dict[str, Any] | None) -> dict[str, Any]:
    """:func:`record` for a transformers ``Trainer`` (TRL's trainers): accelerate's policy, the model's dtypes."""
    model = trainer.model
    trainable = sorted({_dtype_name(p.dtype) or "" for p in model.parameters() if p.requires_grad})
    device = trainer.args.device
    return record(mixed_precision=str(getattr(trainer.accelerator, "mixed_precision", "no")),
                  param_dtype=_dtype_name(getattr(model, "dtype", None)) or "float32",
                  trainable_dtype=trainable[0] if len(trainable) == 1 else ",".join(trainable) or None,
                  autocast=autocast, device_type=getattr(device, "type", str(device)))

