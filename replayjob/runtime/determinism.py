"""Every determinism control in one place, and the provenance record of what was set.

``establish`` runs before any CUDA context or model exists.  Under ``strict`` it sets
``torch.use_deterministic_algorithms(True)``, cuDNN deterministic without benchmarking, TF32 and
reduced-precision reductions off and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (an existing value must
be ``:4096:8`` or ``:16:8``).  ``REPLAYJOB_MATH_MODE`` picks ``prod`` (TF32 allowed),
``pedantic`` (the default under strict) or ``default`` (PyTorch's own defaults).

A process that already built a model without strict controls cannot become strict afterwards:
kernels may have been selected and cached.  Such a request is refused; run in a fresh process.
"""

from __future__ import annotations

import os
from typing import Any

from replayjob.errors import DeterminismError

MATH_MODES: tuple[str, ...] = ("prod", "pedantic", "default")
# NCCL settings that change the order (or the place) in which ranks' values are summed; recorded with
# the controls (ALGO and PROTO are pinned in replayjob.artifacts.spec.DETERMINISM_ENV).
NCCL_NUMERICS = ("NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_NVLS_ENABLE",
                 "NCCL_COLLNET_ENABLE", "NCCL_BUFFSIZE", "NCCL_NTHREADS")
CUBLAS_OK = (":4096:8", ":16:8")
ENV_MATH_MODE = "REPLAYJOB_MATH_MODE"

# What this process has done so far: None, "strict" or "relaxed" model work.
_process_mode: str | None = None


def math_mode_from_env(strict: bool) -> str:
    raw = os.environ.get(ENV_MATH_MODE, "")
    mode = raw.strip().lower() or ("pedantic" if strict else "default")
    if mode not in MATH_MODES:
        raise DeterminismError(f"{ENV_MATH_MODE}={raw!r} is not a math mode",
                               hint="use one of: " + ", ".join(MATH_MODES))
    if strict and mode == "prod":
        raise DeterminismError(f"{ENV_MATH_MODE}=prod allows TF32, which strict_deterministic forbids",
                               hint=f"unset {ENV_MATH_MODE} or set it to 'pedantic'")
    return mode


def establish(*, strict: bool, seed: int | None) -> dict[str, Any]:
    """Set the controls and return the provenance record written into manifests and diag rows."""
    global _process_mode
    import torch

    mode = math_mode_from_env(strict)
    if strict and _process_mode == "relaxed":
        raise DeterminismError("this process already built a model without strict determinism",
                               hint="run the strict job in a fresh process")
    if strict and seed is None:
        raise DeterminismError("strict_deterministic needs an explicit non-negative training.seed",
                               where="training.seed")
    prov: dict[str, Any] = {"strict_deterministic": strict, "math_mode": mode}
    if strict:
        cur = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        if cur is not None and cur not in CUBLAS_OK:
            raise DeterminismError(f"CUBLAS_WORKSPACE_CONFIG={cur!r} is not deterministic",
                                   hint="unset it or use :4096:8 or :16:8")
        if cur is None:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                raise DeterminismError("CUDA was initialised before CUBLAS_WORKSPACE_CONFIG was set",
                                       hint="run the strict job in a fresh process")
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    if mode == "pedantic":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.set_float32_matmul_precision("highest")
    elif mode == "prod":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
    if seed is not None:
        torch.manual_seed(seed)
    prov.update(snapshot())
    prov["attn_implementation_required"] = "eager" if strict else None
    return prov


def mark_model_built(strict: bool) -> None:
    """Record that model work happened in this process under the given mode."""
    global _process_mode
    if _process_mode != "relaxed":
        _process_mode = "strict" if strict else "relaxed"


def snapshot() -> dict[str, Any]:
    """The controls as they are now (recorded, never assumed)."""
    import torch

    return {
        "torch_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "fp16_reduced_precision_reduction":
            bool(torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction),
        "bf16_reduced_precision_reduction":
            bool(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "nvidia_tf32_override": os.environ.get("NVIDIA_TF32_OVERRIDE"),
        "pythonhashseed": os.environ.get("PYTHONHASHSEED"),
        **{name.lower(): os.environ.get(name) for name in NCCL_NUMERICS},
    }
