"""Ranks: the one place that reads the launcher's environment and owns the process group.

An update that needs more than one device runs under ``torchrun`` (``torch.distributed.run``), the
launcher PyTorch ships: ``torchrun --nproc-per-node N -m replayjob capture|replay ...``.  Each rank
is a process that finds ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``
in its environment (:func:`launch_env`).  ``[distributed]`` in the config says how the ranks share
the update (:data:`STRATEGIES`); its ``world_size`` is *observed* from the launcher and written into
the config every artifact records (:func:`observe`): a declared value that contradicts the launcher
is refused (exit 2).

:func:`process_group` initialises the group (gloo on CPU, nccl on CUDA, the config's timeout, so a
rank waiting on a failed one raises instead of hanging) and tears it down in a ``finally``.  Strategy
``none`` needs no group; ``ddp`` (or ``fsdp2``) outside a launcher runs as a group of one in this
process.  :class:`Parallel` is what one update needs from the ranks (:mod:`replayjob.rl.update`):
the wrapped model, gradient accumulation without communication until the last micro-batch,
gradients **summed** over ranks (DDP averages by default: a sum communication hook replaces it;
FSDP2's reduce-scatter gets divide factor 1 and a plain SUM; the loss weights are already
normalised over the whole logical batch), the global gradient norm for clipping (FSDP2: the
DTensor-aware clip), and the loss summed over ranks in rank order, in float64, on every rank.
Under FSDP2 the adapter is saved once, unsharded (:func:`save_adapter` gathers it on every rank).

Rows are split contiguously (:func:`shard_bounds`): rank ``r`` of ``W`` takes logical rows
``[r * N // W, (r + 1) * N // W)``, so concatenating the shards in rank order is the logical batch.

:func:`launch_command` is the one launch of ``N`` ranks (``python -m torch.distributed.run
--standalone --nproc-per-node N -m replayjob ...``; over ``K`` nodes, this node's ``N / K`` joining
torchrun's c10d rendezvous, :func:`rendezvous`) and :func:`run_launched` runs it and maps the
ranks' own exit codes (each rank records its code when :data:`EXIT_DIR_ENV` names a directory;
torchrun itself reports 1 for any failed rank): a refusal on any rank is 2, else an error 3.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replayjob.config import Config
from replayjob.errors import EXIT_ERROR, EXIT_NEGATIVE, EXIT_OK, EXIT_REFUSED, ConfigError, ContractError
from replayjob.runtime.slurm_ranks import check_launcher, rank_thread_env, srun_command

if TYPE_CHECKING:
    import torch


STRATEGIES = ("none", "ddp", "fsdp2")  # fsdp2: torch.distributed.fsdp.fully_shard
SHARDING = "contiguous"  # rank r of W takes rows [r * N // W, (r + 1) * N // W)
ROOT_RANK = 0
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
EXIT_DIR_ENV = "REPLAYJOB_RANK_EXIT_DIR"  # set by run_launched: each rank writes its exit code there


@dataclass(frozen=True)
class Launch:
    """This process's place among the ranks, as the launcher's environment says (``launched`` False:
    no launcher, one process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launched: bool = False


def launch_env(environ: dict[str, str] | None = None) -> Launch:
    """The launcher's rank variables, or a single process when none is set; malformed ones are refused."""
    env = os.environ if environ is None else environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return Launch()
    missing = [k for k in ENV_KEYS if not env.get(k)]
    if missing:
        raise ConfigError(f"launched with a partial rank environment: {', '.join(missing)} missing",
                          where="environment", hint="launch with torchrun (python -m torch.distributed.run)")
    try:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    except ValueError:
        raise ConfigError("RANK, WORLD_SIZE and LOCAL_RANK must be integers", where="environment") from None
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ConfigError(f"RANK {rank} / WORLD_SIZE {world} / LOCAL_RANK {local} do not describe a rank",
                          where="environment")
    return Launch(rank, world, local, True)


def observe(cfg: Config, *, running: bool = True, planned: int | None = None) -> Config:
    """``cfg`` with ``distributed.world_size`` as observed: the launcher's (1 without one).

    ``running``: this process will capture or replay (a declared world size it does not run is refused);
    without it (``explain``, or the parent that launches ``planned`` ranks) the declared value, else
    ``planned``, else 1, is the world size a run would have.
    """
    d = cfg.distributed
    launch = launch_env()
    if running:
        world = launch.world_size
        if d.world_size is not None and d.world_size != world:
            how = (f"torchrun launched {world} rank(s)" if launch.launched
                   else "this process was not launched by torchrun (1 rank)")
            raise ConfigError(f"distributed.world_size declares {d.world_size}, but {how}",
                              where="distributed.world_size",
                              hint=f"launch {d.world_size} ranks (torchrun --nproc-per-node {d.world_size}, or "
                                   f"replayjob replay --nproc {d.world_size}) or drop the declared value")
        if d.strategy == "fsdp2" and cfg.training.save_every:
            raise ConfigError("periodic checkpoints write one process's whole optimizer state; refused with "
                              "sharded parameters (fsdp2)", where="training.save_every",
                              hint='set training.save_every = 0, or use "ddp"')
        if world > 1 and ":" in cfg.backend.torch_device:
            raise ConfigError(f"backend.devices names one device ({cfg.backend.devices!r}) for {world} ranks",
                              where="backend.devices",
                              hint="use devices = \"cuda\": each rank takes cuda:LOCAL_RANK")
        if world > 1 and d.strategy == "none":
            raise ConfigError(f"torchrun launched {world} ranks but distributed.strategy is 'none'",
                              where="distributed.strategy", hint="set distributed.strategy = \"ddp\"")
    else:
        world = d.world_size or planned or 1
        if d.world_size is not None and planned is not None and d.world_size != planned:
            raise ConfigError(f"distributed.world_size declares {d.world_size}, --nproc launches {planned}",
                              where="distributed.world_size", hint="make them equal, or drop one")
    return replace(cfg, distributed=replace(d, world_size=world))


def group_active() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def rank() -> int:
    """This process's rank (0 without a process group)."""
    import torch.distributed as dist

    return int(dist.get_rank()) if group_active() else 0


def world_size() -> int:
    """Ranks in the process group (1 without one)."""
    import torch.distributed as dist

    return int(dist.get_world_size()) if group_active() else 1


def is_root() -> bool:
    return rank() == ROOT_RANK


def barrier() -> None:
    """Wait for every rank (nothing without a process group)."""
    import torch.distributed as dist

    if group_active():
        dist.barrier()


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


@contextlib.contextmanager
def process_group(cfg: Config) -> Iterator[None]:
    """Initialise the process group ``cfg`` asks for (none for strategy ``none``) and tear it down after.

    Under a launcher the group comes from its environment (``env://``); strategy ``ddp`` or ``fsdp2``
    without one runs as a group of one in this process (an in-memory store).  On CUDA each rank uses
    the device ``LOCAL_RANK`` names.
    """
    import torch
    import torch.distributed as dist

    d = cfg.distributed
    if d.strategy == "none" or group_active():
        yield
        return
    launch = launch_env()
    device = cfg.backend.torch_device
    backend = backend_for(device)
    if backend == "nccl":
        torch.cuda.set_device(launch.local_rank)
    timeout = datetime.timedelta(seconds=d.timeout_s)
    if launch.launched:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    try:
        yield
    except BaseException:
        dist.destroy_process_group()  # no barrier: the other ranks may never reach one
        raise
    leave_process_group(synchronize=True)


def leave_process_group(*, synchronize: bool) -> None:
    """Destroy the default process group when one is open (also one a framework's launcher opened, e.g.
    accelerate under torchrun): a group left to the interpreter's exit can abort a rank.

    ``synchronize`` (the work succeeded on this rank): every rank first meets at a barrier, so that no
    rank tears its connections down while a peer still has a collective in flight on them (gloo aborts
    that peer).  After an error there is no barrier: the other ranks may never reach it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if synchronize and dist.get_world_size() > 1:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def shard_bounds(rows: int, world: int) -> list[tuple[int, int]]:
    """Each rank's contiguous ``[begin, end)`` of ``rows`` logical rows (:data:`SHARDING`)."""
    if rows < world:
        raise ContractError(f"{rows} logical rows cannot be split over {world} ranks (each needs at least one)",
                            hint="launch fewer ranks or capture a larger batch")
    return [(r * rows // world, (r + 1) * rows // world) for r in range(world)]


def gather_floats(values: Sequence[float]) -> list[list[float]]:
    """Every rank's ``values`` (float64, the same length on every rank), in rank order, on every rank."""
    import torch
    import torch.distributed as dist

    if not group_active():
        return [[float(v) for v in values]]
    on = "cuda" if dist.get_backend() == "nccl" else "cpu"  # nccl moves CUDA tensors only (exact bytes either way)
    mine = torch.tensor(list(values), dtype=torch.float64, device=on)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)  # gloo and nccl both gather exact bytes
    return [t.tolist() for t in out]


def gather_objects(value: Any) -> list[Any]:
    """Every rank's JSON-like ``value`` in rank order, on every rank."""
    import torch.distributed as dist

    if not group_active():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def rank_sum(values: Sequence[float]) -> float:
    """The ranks' values summed in rank order, in float64: the one cross-rank sum (every rank and the
    reducer compute the same bits)."""
    return functools.reduce(lambda a, b: a + b, (float(v) for v in values))


def check_same(text: str, what: str) -> None:
    """Refuse unless every rank holds the same ``text`` (a digest): ranks must agree on the logical batch."""
    seen = gather_objects(text)
    if len(set(seen)) > 1:
        raise ContractError(f"ranks disagree on the {what}: "
                            + ", ".join(f"rank {r} {v[:12]}" for r, v in enumerate(seen)),
                            hint="the source must build the same logical batch on every rank (a nondeterministic "
                                 "observation cannot be split over ranks)")


# --------------------------------------------------------------------------------- one update
def _sum_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects annotations it cannot compare
    """DDP communication hook: sum the bucket over ranks (DDP's default divides by the world size)."""
    import torch.distributed as dist

    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


class Parallel:
    """The ranks' side of one update (see the module docstring); built by :func:`wrap`."""

    def __init__(self, strategy: str, module: torch.nn.Module, bucket_cap_mb: float | None) -> None:
        self.strategy = strategy
        self.module = module  # what the forward runs through
        self.bucket_cap_mb = bucket_cap_mb  # as the wrapper holds it (DDP), else None
        self.world_size = world_size()

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        """Accumulate locally; communicate gradients only with the last micro-batch's backward."""
        if self.strategy == "fsdp2":
            self.module.set_requires_gradient_sync(last)  # type: ignore[operator]
            yield
            return
        if last:
            yield
            return
        no_sync = getattr(self.module, "no_sync", None)
        with no_sync() if callable(no_sync) else contextlib.nullcontext():
            yield

    def check_micro_batches(self, count: int) -> None:
        """FSDP2 gathers parameters in every micro-batch's forward (a collective), so every rank must run
        the same number of micro-batches, or the ranks would pair unrelated collectives (a hang under gloo);
        DDP communicates only in the last backward.  Refused on every rank alike (the counts are gathered)."""
        if self.strategy != "fsdp2":
            return
        counts = [int(c[0]) for c in gather_floats([float(count)])]
        if len(set(counts)) > 1:
            raise ContractError(f"under fsdp2 every rank must run the same number of micro-batches; the shards "
                                f"give {counts}", where="distributed.strategy",
                                hint="choose a micro_batch_size that splits every rank's shard into as many "
                                     'micro-batches, another world size, or strategy "ddp"')

    def loss_and_ratio(self, loss: float, ratio_sum: float, ratio_n: int) -> tuple[float, float]:
        """The loss over all ranks (summed in rank order) and the mean ratio over every rank's tokens."""
        rows = gather_floats([loss, ratio_sum, float(ratio_n)])
        total = rank_sum([r[0] for r in rows])
        n = rank_sum([r[2] for r in rows])
        return total, rank_sum([r[1] for r in rows]) / max(n, 1.0)

    def clip(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """Clip to the global norm: DDP's gradients are identical on every rank after the sum; FSDP2's are
        shards, whose norm the DTensor-aware clip reduces over ranks."""
        import torch

        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
        return float(full(norm))


def full(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a sharded (DTensor) tensor is gathered from every rank (a collective: every rank calls it
    in the same order), any other tensor is returned as it is (no DTensor exists before its module is loaded)."""
    mod = sys.modules.get("torch.distributed.tensor")
    if mod is None or not isinstance(t, mod.DTensor):
        return t
    whole: torch.Tensor = t.full_tensor()
    return whole


def wrap(model: torch.nn.Module, cfg: Config, policy: Any = None) -> Parallel | None:
    """Wrap ``model`` for ``cfg``'s strategy (``None`` for ``none``); the group must exist.

    ``fsdp2`` shards ``model`` in place (``fully_shard``, its gradient divide factor set to 1 and a plain
    SUM reduction, so the reduce-scatter sums) and asks ``policy`` to read its parameters again
    (``rebind_parameters``: the sharded ones replace them); a backend without that method is refused."""
    import warnings

    import torch

    strategy = cfg.distributed.strategy
    if strategy == "none":
        return None
    device = cfg.backend.torch_device
    if strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        rebind = getattr(policy, "rebind_parameters", None)
        if not callable(rebind):
            raise ConfigError(f"backend {cfg.backend.name!r} cannot read its parameters again after fully_shard",
                              where="distributed.strategy", hint='use "ddp"')
        mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (world_size(),))
        sharded = fully_shard(model, mesh=mesh)
        sharded.set_gradient_divide_factor(1.0)  # a sum over ranks: the loss weights are normalised already
        sharded.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
        rebind()
        return Parallel("fsdp2", model, None)
    from torch.nn.parallel import DistributedDataParallel

    ids = [torch.cuda.current_device()] if device.startswith("cuda") else None  # cuda:LOCAL_RANK (process_group)
    with warnings.catch_warnings():  # broadcast_buffers' deprecation notice: the flag still does what we ask
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=cfg.distributed.bucket_cap_mb,
                                      broadcast_buffers=False, find_unused_parameters=False)
    ddp.register_comm_hook(None, _sum_hook)
    return Parallel("ddp", ddp, ddp.bucket_bytes_cap / (1024 * 1024))


def strategy_of(parallel: Parallel | None) -> str:
    """The strategy in effect, as the wrapped model shows it."""
    if parallel is None:
        return "none"
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(parallel.module, DistributedDataParallel):
        return "ddp"
    return "fsdp2" if isinstance(parallel.module, FSDPModule) else "unknown"


def save_adapter(policy: Any, directory: Path, parallel: Parallel | None) -> Path | None:
    """Rank 0 writes the adapter (one unsharded file) and returns its path; under FSDP2 every rank takes part
    in gathering the sharded tensors first (the backend's ``adapter_state`` gathers them, in one order)."""
    if is_root():
        path: Path = policy.save_adapter(directory)
        return path
    if parallel is not None and parallel.strategy == "fsdp2":
        policy.adapter_state()  # this rank's part of the gathers rank 0's save runs
    return None


# ------------------------------------------------------------------------------------- launching
# A launch over several nodes (a Kubernetes JobSet's pods: replayjob.launch.jobset renders these into
# every pod): how many nodes take part, the c10d rendezvous endpoint (HOST:PORT of the first node's
# stable name) and the rendezvous id (one per run and replay).  Unset: one node, torchrun --standalone.
NODES_ENV = "REPLAYJOB_NODES"
RDZV_ENDPOINT_ENV = "REPLAYJOB_RDZV_ENDPOINT"
RDZV_ID_ENV = "REPLAYJOB_RDZV_ID"
# This node's place among them, when the launcher knows it (a JobSet pod's completion index): node 0, the
# endpoint's host, hosts the rendezvous store and the others only connect, instead of each agent guessing
# from DNS whether the endpoint is itself (a name not resolvable yet would leave no host).
NODE_RANK_ENV = "REPLAYJOB_NODE_RANK"
RDZV_BACKEND = "c10d"  # torchrun's own rendezvous: a TCPStore on the endpoint's host, no etcd
_ENDPOINT = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?:[0-9]{1,5}")
_RDZV_ID = re.compile(r"[A-Za-z0-9][-A-Za-z0-9_.]{0,127}")


@dataclass(frozen=True)
class Rendezvous:
    """Where the agents of a launch over ``nodes`` nodes meet (torchrun's c10d rendezvous)."""

    nodes: int
    endpoint: str
    id: str
    node_rank: int | None = None


def rendezvous(environ: dict[str, str] | None = None) -> Rendezvous | None:
    """The launch's rendezvous over several nodes (:data:`NODES_ENV`, :data:`RDZV_ENDPOINT_ENV`,
    :data:`RDZV_ID_ENV`), or None for one node; a partial or malformed one is refused (2)."""
    env = os.environ if environ is None else environ
    raw = env.get(NODES_ENV, "")
    if not raw:
        if env.get(RDZV_ENDPOINT_ENV) or env.get(RDZV_ID_ENV):
            raise ConfigError(f"a rendezvous without {NODES_ENV}", where="environment",
                              hint=f"set {NODES_ENV}, {RDZV_ENDPOINT_ENV} and {RDZV_ID_ENV} together")
        return None
    if not raw.isdigit() or not 1 <= int(raw) <= 64:
        raise ConfigError(f"{NODES_ENV}={raw!r} is not a node count (1..64)", where="environment")
    if int(raw) == 1:
        return None
    endpoint, rid = env.get(RDZV_ENDPOINT_ENV, ""), env.get(RDZV_ID_ENV, "")
    if not _ENDPOINT.fullmatch(endpoint) or not 0 < int(endpoint.rsplit(":", 1)[1]) < 65536:
        raise ConfigError(f"{RDZV_ENDPOINT_ENV}={endpoint!r} is not HOST:PORT", where="environment",
                          hint="the first node's stable name and a port, e.g. run-replay-0-0.run:29400")
    if not _RDZV_ID.fullmatch(rid):
        raise ConfigError(f"{RDZV_ID_ENV}={rid!r} is not a rendezvous id (letters, digits, -_.)",
                          where="environment")
    rank = env.get(NODE_RANK_ENV, "")
    if rank and (not rank.isdigit() or int(rank) >= int(raw)):
        raise ConfigError(f"{NODE_RANK_ENV}={rank!r} is not a node of {raw} (0..{int(raw) - 1})", where="environment")
    return Rendezvous(int(raw), endpoint, rid, int(rank) if rank else None)


def local_ranks(nproc: int, launcher: str = "torchrun", environ: dict[str, str] | None = None) -> int:
    """How many of a launch's ``nproc`` ranks run on this node: all of them, or under a rendezvous over
    ``K`` nodes ``nproc / K`` (refused unless ``K`` divides ``nproc``); srun's tasks are the allocation's."""
    rdzv = rendezvous(environ) if launcher == "torchrun" else None
    if rdzv is None:
        return nproc
    if nproc % rdzv.nodes:
        raise ConfigError(f"{nproc} ranks do not split evenly over {NODES_ENV}={rdzv.nodes} nodes",
                          where="environment", hint="render the launcher's manifests again from the spec")
    return nproc // rdzv.nodes


def launch_command(nproc: int, argv: Sequence[str], launcher: str = "torchrun",
                   environ: dict[str, str] | None = None) -> list[str]:
    """The one launch of ``nproc`` ranks of ``replayjob ARGV``: torchrun (standalone, this node), or,
    under a :func:`rendezvous`, this node's share of them joining torchrun's c10d rendezvous with the
    other nodes' (``--nnodes K --nproc-per-node nproc/K``; ranks are numbered across the nodes); or
    with ``launcher="srun"`` the tasks of the Slurm allocation this process runs in (on every node of
    it), each mapped to the variables :func:`launch_env` reads (:mod:`replayjob.runtime.slurm_ranks`)."""

    check_launcher(launcher)
    if launcher == "srun":
        return srun_command(nproc, argv, environ)
    rdzv = rendezvous(environ)
    if rdzv is None:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                "-m", "replayjob", *argv]
    # --max-restarts 0: a failed rank fails the launch (exit 3, the engine retries the whole gang), as
    # --standalone does; every node's agent waits at torchrun's exit barrier for the others, so a node
    # returns only once every rank (rank 0 writing the replay's metrics included) has ended
    host = [] if rdzv.node_rank is None else ["--rdzv-conf", f"is_host={str(rdzv.node_rank == 0).lower()}"]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(rdzv.nodes),
            "--nproc-per-node", str(local_ranks(nproc, launcher, environ)), "--rdzv-backend", RDZV_BACKEND,
            "--rdzv-endpoint", rdzv.endpoint, "--rdzv-id", rdzv.id, *host, "--max-restarts", "0",
            "-m", "replayjob", *argv]


def record_exit(code: int, rank: str | None = None) -> None:
    """Under :func:`run_launched`, write this rank's exit code where the launcher collects it (``rank``:
    the rank when ``RANK`` is not set yet, e.g. an srun task whose Slurm variables were refused)."""
    where = os.environ.get(EXIT_DIR_ENV)
    r = os.environ.get("RANK") if rank is None else rank
    if not where or r is None or not r.isdigit():
        return
    with contextlib.suppress(OSError):
        Path(where, f"rank-{int(r)}").write_text(str(code), encoding="utf-8")


def merged_exit(launcher_code: int, rank_codes: Sequence[int], nproc: int | None = None) -> int:
    """One exit code for a launch: 0 when the launcher succeeded, else a refusal on any rank (2), else
    an error (3; also when a rank recorded no code, i.e. it was killed: nothing was decided), else a
    negative verdict (1) only when every one of the ``nproc`` ranks recorded its code."""
    if launcher_code == 0:
        return EXIT_OK
    codes = set(rank_codes)
    if EXIT_REFUSED in codes:
        return EXIT_REFUSED
    if EXIT_ERROR in codes or not codes - {EXIT_OK} or (nproc is not None and len(rank_codes) < nproc):
        return EXIT_ERROR
    return EXIT_NEGATIVE if EXIT_NEGATIVE in codes else EXIT_ERROR


def run_launched(nproc: int, argv: Sequence[str], timeout: float | None = None,
                 launcher: str = "torchrun") -> tuple[int, str]:
    """Run ``replayjob ARGV`` on ``nproc`` ranks (:func:`launch_command`); return the merged exit code and
    the output's tail."""

    local = local_ranks(nproc, launcher)  # this node's ranks: their codes are the ones recorded here
    with tempfile.TemporaryDirectory(prefix="replayjob-ranks-") as d:
        env = {**os.environ, EXIT_DIR_ENV: d}
        env.update(rank_thread_env(env, local, launcher))  # each rank's share of the pod's threads
        proc = run_group(launch_command(nproc, argv, launcher), env, timeout)
        codes = []
        for p in Path(d).glob("rank-*"):
            with contextlib.suppress(ValueError, OSError):
                codes.append(int(p.read_text(encoding="utf-8").strip()))
    text = (proc.stderr or "") + (proc.stdout or "")
    return merged_exit(proc.returncode, codes, local), (rank_diagnostics(text) or launch_failure(text))[-4000:]


STOP_GRACE_S = 20.0  # after SIGTERM, how long the launcher gets to stop its ranks before SIGKILL


def run_group(cmd: Sequence[str], env: dict[str, str], timeout: float | None = None,
              grace_s: float = STOP_GRACE_S) -> subprocess.CompletedProcess[str]:
    """Run a launcher in its own process group and capture its output.

    If this process is interrupted while it waits (a SIGTERM that the CLI turns into an error, Ctrl-C,
    ``timeout``), the whole group gets SIGTERM, so torchrun or srun stops its ranks as it does for a
    cancelled job; whatever is left after ``grace_s`` gets SIGKILL.  Nothing of a launch outlives it.
    """
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        _stop_group(proc, grace_s)
        raise
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def _stop_group(proc: subprocess.Popen[str], grace_s: float) -> None:
    import signal

    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher or a rank that ignored SIGTERM
    proc.wait()


_DIAGNOSTIC = re.compile(r"^replayjob [a-z][a-z-]*( [a-z][a-z-]*)?: ")


_LAUNCHER_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
_TRACEBACK = "Traceback (most recent call last):"


def launch_failure(text: str, keep: int = 1200) -> str:
    """What a failed launch's output says when no rank printed a diagnostic (a rank crashed): the ranks'
    last ``keep`` characters before torchrun's own traceback (where a crashed rank's message is, e.g.
    ``terminate called after throwing ...``), then torchrun's root-cause summary.  Output of another
    launcher is returned whole."""
    at = text.rfind(_LAUNCHER_FAILED)
    if at < 0:
        return text.strip()
    start = text.rfind(_TRACEBACK, 0, at)
    ranks = text[:start if start >= 0 else at].strip()
    root = text.find("Root Cause", at)
    summary = text[root if root >= 0 else at:].strip()
    return (f"{ranks[-keep:]}\n[torchrun] {summary}" if ranks else f"[torchrun] {summary}")


def rank_diagnostics(text: str) -> str:
    """The ranks' own diagnostics in a launch's output (``replayjob CMD: what`` and its indented ``fix:``
    lines), each once, in order: what a refusal says, without the launcher's traceback around it."""
    out: list[str] = []
    keep = False
    for line in text.splitlines():
        if _DIAGNOSTIC.match(line):
            keep = True
        elif not line.startswith("  "):
            keep = False
        if keep and line not in out:
            out.append(line)
    return "\n".join(out)
