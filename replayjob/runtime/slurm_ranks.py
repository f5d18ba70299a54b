"""Ranks inside a Slurm allocation: ``srun`` starts the tasks, each mapped to torch.distributed's env.

``replayjob step capture|replay`` runs once per job (layout, run record, set-aside logic in one
process); a run that needs ``N`` ranks starts them through :func:`replayjob.runtime.distributed.launch_command`.
By default that is ``torchrun --standalone`` in the step's own process tree (a Kubernetes pod, a
workstation).  Under Slurm (``step --launcher srun``, what ``scripts/slurm/*.sbatch`` pass) the ranks
are the allocation's tasks instead: :func:`srun_command` runs ``srun --ntasks N`` with
``python -m replayjob ARGV...`` as each task, marked by :data:`SRUN_TASK_ENV`; the entry point
(``replayjob/__main__.py``) maps the task's Slurm variables to the ones ``torch.distributed`` reads
(:func:`rank_env`, written once here), then runs ``replayjob ARGV`` in that process:

* ``RANK`` = ``SLURM_PROCID``, ``WORLD_SIZE`` = ``SLURM_NTASKS``, ``LOCAL_RANK`` = ``SLURM_LOCALID``;
* ``MASTER_ADDR`` = the first host of the allocation (:func:`first_host` of ``SLURM_JOB_NODELIST``);
* ``MASTER_PORT`` = :func:`master_port` of ``SLURM_JOB_ID``: one port per job (an array task has its
  own job id), so two jobs sharing a node do not collide.

The ranks of one run share one node (``srun --nodes 1``; the sbatch scripts request ``--nodes=1``),
as under torchrun, so ``LOCAL_RANK`` names the rank's GPU among the job's; a run that needs more GPUs
than a node has (the spec's ``node_gpus``) gets ``--nodes=K --ntasks-per-node=N/K`` from the sbatch
scripts, and :func:`srun_command` spreads its tasks over every node of the allocation
(:func:`allocation_nodes`): ``LOCAL_RANK`` is then the task's GPU on its own node, and ``MASTER_ADDR``
the allocation's first node, which hosts rank 0 (Slurm numbers tasks node by node, block distribution).

Example:
    >>> rank_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
    ...           "SLURM_JOB_NODELIST": "gpu[003-004]", "SLURM_JOB_ID": "4242"})["MASTER_ADDR"]
    'gpu003'
    >>> first_host("a-1,b[2-3]"), master_port("4242")
    ('a-1', 24242)
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence

from replayjob.errors import ConfigError, UsageError

LAUNCHERS = ("torchrun", "srun")
SRUN_TASK_ENV = "REPLAYJOB_SRUN_TASK"  # set on each srun task: ``python -m replayjob`` maps its Slurm variables
PORT_BASE = 20000  # MASTER_PORT = PORT_BASE + job id % PORT_SPAN: above the well-known and below
PORT_SPAN = 30000  # the ephemeral ports Linux hands out (32768..60999)
SLURM_KEYS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_JOB_ID")
_HOST = re.compile(r"[A-Za-z0-9._-]+")


def check_launcher(launcher: str) -> None:
    """The launchers a step or a launch may name (:data:`LAUNCHERS`); anything else is a usage error."""
    if launcher not in LAUNCHERS:
        raise UsageError(f"--launcher {launcher!r} is not a launcher; use one of: " + ", ".join(LAUNCHERS))


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list (``node[01-04,07],other`` -> ``node01``)."""
    text = nodelist.strip()
    out, depth, i = "", 0, 0
    while i < len(text):
        ch = text[i]
        if ch == "," and depth == 0:
            break
        if ch == "[":
            close = text.find("]", i)
            if close < 0:
                raise ConfigError(f"malformed Slurm host list {nodelist!r}", where="SLURM_JOB_NODELIST")
            first = text[i + 1:close].split(",")[0].split("-")[0]
            out += first
            i = close + 1
            continue
        out += ch
        i += 1
    if not _HOST.fullmatch(out):
        raise ConfigError(f"malformed Slurm host list {nodelist!r}", where="SLURM_JOB_NODELIST")
    return out


def master_port(job_id: str) -> int:
    """The rendezvous port of one Slurm job."""
    if not job_id.isdigit():
        raise ConfigError(f"SLURM_JOB_ID {job_id!r} is not a job id", where="environment")
    return PORT_BASE + int(job_id) % PORT_SPAN


def rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` of
    one srun task, from its Slurm variables (refused when one is missing or malformed)."""
    missing = [k for k in SLURM_KEYS if not environ.get(k)]
    if missing:
        raise ConfigError("not an srun task: " + ", ".join(missing) + " missing", where="environment",
                          hint=f"{SRUN_TASK_ENV} marks the task of `srun --ntasks N` (step --launcher srun); "
                               "unset it to run replayjob outside an allocation")
    rank, world, local = (environ[k] for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
    if not (rank.isdigit() and world.isdigit() and local.isdigit()) or not int(rank) < int(world):
        raise ConfigError(f"SLURM_PROCID {rank} / SLURM_NTASKS {world} / SLURM_LOCALID {local} do not describe "
                          "a task", where="environment")
    return {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": local,
            "MASTER_ADDR": first_host(environ["SLURM_JOB_NODELIST"]),
            "MASTER_PORT": str(master_port(environ["SLURM_JOB_ID"]))}


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def rank_thread_env(environ: Mapping[str, str], nproc: int, launcher: str) -> dict[str, str]:
    """Each rank's share of the threads: under torchrun the ranks share one pod, whose
    ``OMP_NUM_THREADS`` (its CPU limit, or this machine's CPUs) is divided among them; an srun task's
    is already its own (``SLURM_CPUS_PER_TASK``), left as it is."""
    if launcher != "torchrun" or nproc <= 1:
        return {}
    out = {}
    for name in THREAD_VARS:
        raw = environ.get(name, "")
        total = int(raw) if raw.isdigit() and int(raw) > 0 else (os.cpu_count() or 1)
        out[name] = str(max(1, total // nproc))
    return out


def allocation_nodes(environ: Mapping[str, str] | None = None) -> int:
    """How many nodes this allocation has (``SLURM_JOB_NUM_NODES``, else ``SLURM_NNODES``; 1 outside one)."""
    env = os.environ if environ is None else environ
    raw = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"SLURM_JOB_NUM_NODES {raw!r} is not a node count", where="environment")
    return int(raw)


def srun_command(nproc: int, argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """``nproc`` tasks of ``replayjob ARGV`` on every node of this allocation (one node, or the nodes the
    job asked for when a run needs more GPUs than one has), the same number on each, one rank each."""
    if nproc < 1:
        raise UsageError(f"a launch needs at least one rank, found {nproc}")
    nodes = allocation_nodes(environ)
    if nproc % nodes:
        raise ConfigError(f"{nproc} ranks do not split evenly over the allocation's {nodes} nodes",
                          where="environment", hint="submit again from the spec (scripts/slurm/submit.sh)")
    spread = ["--nodes", str(nodes)] + (["--ntasks-per-node", str(nproc // nodes)] if nodes > 1 else [])
    return ["srun", "--ntasks", str(nproc), *spread, "--kill-on-bad-exit=1",
            f"--export=ALL,{SRUN_TASK_ENV}=1", sys.executable, "-m", "replayjob", *argv]
