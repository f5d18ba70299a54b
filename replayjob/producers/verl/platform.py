"""verl on a CPU: the platform, engine registration and process group verl's FSDP engine needs to run there.

verl 0.9.1 ships platforms for CUDA, ROCm and Ascend only; with no accelerator it falls back to ``nvidia`` and
its device calls fail.  :func:`use_cpu` registers a CPU platform through verl's own hook
(``verl.plugin.platform.set_platform``, before anything asks for the platform), registers verl's
``FSDPEngineWithLMHead`` for the device ``cpu`` in verl's ``EngineRegistry`` (which lists only cuda/npu), and
initialises ``torch.distributed`` with gloo when no process group exists (verl's engine calls collectives even
on one process; under ``torchrun`` the launcher's rendezvous is used, else a free local port; the environment is
left as it was).  On a machine with CUDA
nothing here is needed: verl picks its own platform.

What the platform reports: device ``cpu``, backend ``gloo``, no IPC, no profiler ranges, memory figures 0
(CPU has no allocator statistics), and ``mem_get_info`` from the host's memory.  Imported only by code that
runs verl (tests, a verl replay on CPU); importing this module imports neither torch nor verl.
"""

from __future__ import annotations

import os
from typing import Any

from replayjob.errors import ConfigError

_INSTALLED: dict[str, Any] = {}


def _platform() -> Any:
    """A ``verl.plugin.platform.PlatformBase`` for the CPU (built on first use: verl is imported lazily)."""
    import contextlib
    import types

    import torch
    from verl.plugin.platform import PlatformBase

    class CPUDeviceModule(types.ModuleType):
        """``torch.cpu`` with the allocator and device queries verl calls on its device module."""

        def __getattr__(self, name: str) -> Any:
            return getattr(torch.cpu, name)

        def max_memory_allocated(self, *args: Any, **kwargs: Any) -> int:
            return 0

        def max_memory_reserved(self, *args: Any, **kwargs: Any) -> int:
            return 0

        def memory_allocated(self, *args: Any, **kwargs: Any) -> int:
            return 0

        def memory_reserved(self, *args: Any, **kwargs: Any) -> int:
            return 0

        def reset_peak_memory_stats(self, *args: Any, **kwargs: Any) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_name(self, *args: Any, **kwargs: Any) -> str:
            return "CPU"

        def mem_get_info(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
            page = os.sysconf("SC_PAGE_SIZE")
            return int(os.sysconf("SC_AVPHYS_PAGES") * page), int(os.sysconf("SC_PHYS_PAGES") * page)

    module = CPUDeviceModule("replayjob_verl_cpu")

    class CPUPlatform(PlatformBase):
        """The host CPU as verl's device (gloo collectives)."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> Any:
            return module

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:
            return "cpu"  # verl moves modules and tensors with .to(get_device_id())

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "REPLAYJOB_VERL_CPU_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str) -> Any:
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return CPUPlatform()


def use_cpu() -> None:
    """Make verl run on this process's CPU (idempotent; see the module docstring).  Refused when another
    platform was already chosen in this process (verl caches it on first use)."""
    import torch.distributed as dist

    if "platform" not in _INSTALLED:
        from verl.plugin.platform import platform_manager, set_platform

        current = platform_manager._current_platform
        if current is not None and current.device_name != "cpu":
            raise ConfigError(f"verl already runs on platform {current.device_name!r} in this process",
                              where="verl platform", hint="choose the CPU before verl's first device call")
        _INSTALLED["platform"] = _platform()
        set_platform(_INSTALLED["platform"])
        from verl.workers.engine import EngineRegistry, FSDPEngineWithLMHead

        for backend in ("fsdp", "fsdp2"):
            registry = EngineRegistry._engines.setdefault("language_model", {}).setdefault(backend, {})
            if "cpu" not in registry:
                EngineRegistry.register(model_type="language_model", backend=backend, device="cpu")(
                    FSDPEngineWithLMHead)
    if not dist.is_initialized():  # a launcher's rendezvous (torchrun), else one process on a free local port
        launched = "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ
        dist.init_process_group("gloo", init_method=None if launched else f"tcp://127.0.0.1:{_free_port()}",
                                rank=int(os.environ.get("RANK", "0")),
                                world_size=int(os.environ.get("WORLD_SIZE", "1")))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
