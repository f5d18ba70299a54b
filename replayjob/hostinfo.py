"""Where a replay ran: node, accelerator, driver, CUDA and image (``replay_metrics.json``'s ``host``).

Read once per replay by :func:`host_provenance`, from the launcher's environment and the device:

==================== =================================================================================
``node``             ``REPLAYJOB_NODE_NAME`` (Kubernetes downward API ``spec.nodeName``), else
                     ``SLURMD_NODENAME``, else the host name
``pod``, ``slurm_job`` ``REPLAYJOB_POD_NAME`` (downward API ``metadata.name``); ``SLURM_JOB_ID``
``image_ref``        ``REPLAYJOB_IMAGE_REF`` (set by the manifests and the Slurm jobs), or null
``image_digest``     the ``@sha256:...`` part of the reference, else ``REPLAYJOB_IMAGE_DIGEST``, or null
``device_type``      ``cuda`` or ``cpu``
``gpu_product``, ``gpu_uuid`` the device's name and UUID (CUDA only)
``driver_version``   the NVIDIA kernel module's version (``/proc/driver/nvidia/version``), or null
``cuda_version``     the CUDA runtime torch was built with
``cuda_visible_devices`` the ``CUDA_VISIBLE_DEVICES`` the process saw (a Slurm or container launcher
                     that drops it would expose every GPU of the node)
``cpu_model``        ``/proc/cpuinfo``'s model name
==================== =================================================================================

:func:`hardware_identity` is the part the reducer compares across every replay (``inputs.same_hardware``):
device type, GPU product, driver, CUDA, torch and the image (its digest, else its reference); on a
CPU, the CPU model.  Node
names and GPU UUIDs differ between identical machines and are recorded, not compared there;
:func:`placement` (node and GPU) is what a paired performance budget requires its two replays of one
block to share.  This module
imports no torch itself; :func:`host_provenance` takes the device and reads torch lazily.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any

IDENTITY_KEYS = ("device_type", "gpu_product", "driver_version", "cuda_version", "torch_version", "image")
_DRIVER = re.compile(r"Kernel Module\s+([0-9][0-9.]*)")


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def driver_version() -> str | None:
    """The NVIDIA kernel module's version, or None where there is none (or it is not visible)."""
    m = _DRIVER.search(_read("/proc/driver/nvidia/version"))
    return m.group(1) if m else None


def _cpu_model() -> str | None:
    m = re.search(r"(?m)^model name\s*:\s*(.+)$", _read("/proc/cpuinfo"))
    return m.group(1).strip() if m else None


def image_provenance() -> tuple[str | None, str | None]:
    ref = os.environ.get("REPLAYJOB_IMAGE_REF") or None
    digest = ref.split("@", 1)[1] if ref and "@sha256:" in ref else None
    return ref, digest or os.environ.get("REPLAYJOB_IMAGE_DIGEST") or None


def host_provenance(device: Any) -> dict[str, Any]:
    """The ``host`` record of one replay on ``device`` (a ``torch.device``)."""
    import torch

    ref, digest = image_provenance()
    host: dict[str, Any] = {
        "node": os.environ.get("REPLAYJOB_NODE_NAME") or os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "pod": os.environ.get("REPLAYJOB_POD_NAME") or None,
        "slurm_job": os.environ.get("SLURM_JOB_ID") or None,
        "image_ref": ref, "image_digest": digest, "device_type": device.type,
        "gpu_product": None, "gpu_uuid": None, "driver_version": None, "cuda_version": torch.version.cuda,
        "torch_version": torch.__version__,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "cpu_model": _cpu_model(),
    }
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        host.update(gpu_product=props.name, gpu_uuid=str(getattr(props, "uuid", "")) or None,
                    driver_version=driver_version())
    return host


def hardware_identity(host: dict[str, Any]) -> dict[str, Any]:
    """What must be equal across the replays of one verdict unless mixed hardware is declared."""
    ident = {k: host.get(k) for k in IDENTITY_KEYS if k != "image"}
    ident["image"] = host.get("image_digest") or host.get("image_ref")
    if host.get("device_type") == "cpu":
        ident["cpu_model"] = host.get("cpu_model")
    return ident


def placement(host: dict[str, Any], device: str = "") -> str:
    """``node/device`` of one replay, the place two replays of a paired block must share.

    The device is the GPU's UUID where there is one (a ``cuda:0`` names different GPUs under
    different ``CUDA_VISIBLE_DEVICES``), else the replay's device string (``cpu``, ``cuda:1``).
    ``""`` when the node is unknown, so nothing unknown pairs.
    """
    node = host.get("node")
    if not node:
        return ""
    return f"{node}/{host.get('gpu_uuid') or device or host.get('device_type') or '?'}"
