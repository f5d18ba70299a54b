"""Per-step diagnostics: one JSON object per step in ``diag.jsonl``, nested leaves.

Leaves under ``timing`` (``*_wall_s``, ``elapsed_s``) and ``memory`` vary between identical runs;
everything else is a deterministic function of the run's inputs on CPU.  Checksums come as a
SHA-256 (bitwise identity) and as sum / L2 (how far apart, when not identical).
"""

from __future__ import annotations

import hashlib
import resource
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from replayjob.runtime.distributed import full

if TYPE_CHECKING:
    import torch
    from torch import Tensor


def tensor_checksum(named: Iterable[tuple[str, Tensor | None]]) -> dict[str, Any]:
    import torch
    h = hashlib.sha256()
    total = 0.0
    sq = 0.0
    for name, t in named:
        h.update(name.encode())
        if t is None:
            h.update(b"<none>")
            continue
        c = full(t.detach()).to("cpu").contiguous()  # a sharded tensor whole (every rank computes the row)
        h.update(str(c.dtype).encode())
        h.update(c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b"")
        d = c.double()
        total += float(d.sum())
        sq += float((d * d).sum())
    return {"sha256": h.hexdigest(), "sum": total, "l2": sq ** 0.5}


def optimizer_checksum(opt: torch.optim.Optimizer) -> dict[str, Any]:
    import torch
    items: list[tuple[str, Tensor | None]] = []
    for idx, st in sorted(opt.state_dict()["state"].items()):
        for k in sorted(st):
            v = st[k]
            items.append((f"{idx}.{k}", v if torch.is_tensor(v) else torch.tensor(v)))
    return tensor_checksum(items)


def stats(x: Tensor, mask: Tensor | None = None) -> dict[str, float]:
    v = x.double().reshape(-1)
    if mask is not None:
        v = v[mask.reshape(-1) > 0]
    if v.numel() == 0:
        return {"mean": 0.0, "std": 0.0, "min": 0.0, "max": 0.0}
    return {"mean": float(v.mean()), "std": float(v.std(unbiased=False)), "min": float(v.min()),
            "max": float(v.max())}


def peak_memory_bytes(device: torch.device) -> dict[str, int]:
    import torch
    out = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        out["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return out


def peak_memory_value(device: torch.device) -> int:
    """The figure reports compare: CUDA max allocated on GPU, max RSS on CPU."""
    m = peak_memory_bytes(device)
    return m.get("cuda_max_allocated_bytes", m["peak_rss_bytes"])
