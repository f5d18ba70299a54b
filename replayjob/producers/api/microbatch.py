"""Internals of the capture API: one recorded loss call (:class:`MicroBatch`), how its tensors are encoded,
and the digests and summaries of a list of them (the capture writes them, the admission recomputes them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from replayjob.digest import batch_part, batch_sha256, sha256_bytes
from replayjob.errors import CaptureError, RefusedError
from replayjob.rl.state import json_value

if TYPE_CHECKING:
    import torch


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements as bytes, in row-major order (the safetensors data layout)."""
    import torch
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).numpy().tobytes()) if flat.numel() else b""


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def captured_json(v: Any, where: str) -> Any:
    """``v`` as JSON (:func:`replayjob.rl.state.json_value`), refused as a :class:`CaptureError`."""
    try:
        return json_value(v, where)
    except RefusedError as exc:
        raise CaptureError(exc.message, where=exc.where, hint=exc.hint) from None


def split_group(values: Mapping[str, Any], where: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors (detached CPU copies in their own dtype) and JSON values of one input mapping."""
    import torch
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, Any] = {}
    for key, v in values.items():
        if not isinstance(key, str) or not key or "." in key:
            raise CaptureError(f"{where} key {key!r} must be a non-empty string without '.'", where=where)
        if isinstance(v, torch.Tensor):
            tensors[key] = v.detach().to("cpu", copy=True).contiguous()
        else:
            plain[key] = captured_json(v, f"{where}.{key}")
    return tensors, plain


def describe(tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any]) -> dict[str, Any]:
    """One micro-batch group as the manifest records it."""
    return {"tensors": {k: {"dtype": dtype_name(t), "shape": list(t.shape)} for k, t in sorted(tensors.items())},
            "values": dict(sorted(values.items()))}


@dataclass
class MicroBatch:
    """One recorded loss call: its inputs, keyword arguments, RNG and accumulation settings."""

    inputs: dict[str, torch.Tensor]
    input_values: dict[str, Any]
    call: dict[str, torch.Tensor]
    call_values: dict[str, Any]
    rng: dict[str, torch.Tensor]
    sync_gradients: bool
    accumulation_steps: int

    def entry(self) -> dict[str, Any]:
        return {"inputs": describe(self.inputs, self.input_values), "call": describe(self.call, self.call_values),
                "rng": sorted(self.rng), "sync_gradients": self.sync_gradients,
                "accumulation_steps": self.accumulation_steps}

    def payload(self, i: int) -> dict[str, torch.Tensor]:
        out = {f"mb{i:04d}.inputs.{k}": t for k, t in self.inputs.items()}
        out.update({f"mb{i:04d}.call.{k}": t for k, t in self.call.items()})
        out.update({f"mb{i:04d}.rng.{k}": t for k, t in self.rng.items()})
        return out


def _tensor(t: torch.Tensor) -> tuple[str, list[int], str]:
    return dtype_name(t), list(t.shape), sha256_bytes(tensor_bytes(t))


def logical_entries(mbs: list[MicroBatch]) -> list[dict[str, Any]]:
    """The parts :func:`logical_digest` hashes: per micro-batch, its ``inputs.<key>`` and ``call.<key>``
    tensors and values (:func:`replayjob.digest.batch_part`)."""
    return [batch_part({**{f"inputs.{k}": _tensor(t) for k, t in m.inputs.items()},
                        **{f"call.{k}": _tensor(t) for k, t in m.call.items()}},
                       {**{f"inputs.{k}": v for k, v in m.input_values.items()},
                        **{f"call.{k}": v for k, v in m.call_values.items()}}) for m in mbs]


def logical_digest(mbs: list[MicroBatch]) -> str:
    """The one batch digest (:func:`replayjob.digest.batch_sha256`, kind ``logical``) of every input (name,
    dtype, shape, bytes) and value of every micro-batch, in order."""
    return batch_sha256("logical", logical_entries(mbs))


def effective_entries(mbs: list[MicroBatch]) -> list[dict[str, Any]]:
    """The parts :func:`effective_digest` hashes: each micro-batch's logical part plus its ``rng.<device>``
    states and its ``sync_gradients`` and ``accumulation_steps``."""
    out = []
    for m, part in zip(mbs, logical_entries(mbs), strict=True):
        rng = {f"rng.{k}": _tensor(t) for k, t in m.rng.items()}
        values = {**part["values"], "sync_gradients": m.sync_gradients, "accumulation_steps": m.accumulation_steps}
        out.append(batch_part({**{k: tuple(v) for k, v in part["tensors"].items()}, **rng}, values))
    return out


def effective_digest(mbs: list[MicroBatch]) -> str:
    """The batch digest (kind ``effective``) of what each loss call consumed: its inputs, its RNG states and
    its accumulation settings."""
    return batch_sha256("effective", effective_entries(mbs))


def batch_rows(mbs: list[MicroBatch]) -> int:
    """Rows (sequences, samples) the micro-batches hold: per micro-batch the largest leading dimension of
    its input tensors (the batch dimension every per-row input shares), at least 1."""
    return sum(max([int(t.shape[0]) for t in m.inputs.values() if t.dim() > 0] + [1]) for m in mbs)


def has_nonfinite(mbs: list[MicroBatch]) -> bool:
    """True when a floating-point input tensor of a micro-batch holds NaN or Inf."""
    import torch
    return any(t.is_floating_point() and not bool(torch.isfinite(t).all())
               for m in mbs for t in (*m.inputs.values(), *m.call.values()))


def rows_summary(mbs: list[MicroBatch]) -> dict[str, int]:
    ts = [t for m in mbs for t in (*m.inputs.values(), *m.call.values())]
    return {"rows": batch_rows(mbs), "micro_batches": len(mbs), "tensors": len(ts),
            "elements": sum(t.numel() for t in ts), "bytes": sum(t.numel() * t.element_size() for t in ts)}
