"""``replayjob.runtime.slurm_ranks``: an srun task's Slurm variables mapped to torch.distributed's.

The mapping is checked value by value, its refusals by name, and for real: two processes given the
variables srun would give two tasks of one job form a gloo process group through the mapped
``MASTER_ADDR``/``MASTER_PORT`` and all-reduce a tensor.  The srun launch itself runs in
tests/test_slurm.py against a real scheduler.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from replayjob.errors import ConfigError, UsageError
from replayjob.runtime import slurm_ranks as launch

pytestmark = pytest.mark.alone  # two tasks form a gloo group on a fixed port: run alone on the host

TASK = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[003-004,9]",
        "SLURM_JOB_ID": "123456"}


def test_a_task_s_slurm_variables_become_torch_distributed_s() -> None:
    assert launch.rank_env(TASK) == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu003",
                                     "MASTER_PORT": str(20000 + 123456 % 30000)}


@pytest.mark.parametrize(("nodelist", "host"), [
    ("node1", "node1"), ("node[01-04]", "node01"), ("a-1,b[2-3]", "a-1"), ("gpu[7,9-10]", "gpu7"),
    ("rack[1-2]-n[05-06]", "rack1-n05"), ("h.example.org,h2", "h.example.org"),
])
def test_the_first_host_of_a_host_list(nodelist: str, host: str) -> None:
    assert launch.first_host(nodelist) == host


@pytest.mark.parametrize(("change", "message"), [
    ({"SLURM_PROCID": None}, "not an srun task: SLURM_PROCID missing"),
    ({"SLURM_JOB_ID": ""}, "SLURM_JOB_ID missing"),
    ({"SLURM_PROCID": "2"}, "do not describe a task"),
    ({"SLURM_NTASKS": "two"}, "do not describe a task"),
    ({"SLURM_JOB_NODELIST": "node[01-"}, "malformed Slurm host list"),
    ({"SLURM_JOB_NODELIST": "bad host"}, "malformed Slurm host list"),
    ({"SLURM_JOB_ID": "12_3"}, "is not a job id"),
])
def test_a_malformed_task_environment_is_refused(change: dict[str, str | None], message: str) -> None:
    env = {k: v for k, v in {**TASK, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        launch.rank_env(env)


def test_ports_differ_between_jobs_and_stay_below_the_ephemeral_range() -> None:
    ports = {launch.master_port(str(j)) for j in range(1000, 1100)}
    assert len(ports) == 100 and all(launch.PORT_BASE <= p < launch.PORT_BASE + launch.PORT_SPAN <= 50000
                                     for p in ports)


def test_srun_runs_each_rank_through_the_mapping_on_one_node() -> None:
    cmd = launch.srun_command(4, ["replay", "cfg.toml", "--out", "o"])
    assert cmd[:7] == ["srun", "--ntasks", "4", "--nodes", "1", "--kill-on-bad-exit=1",
                       f"--export=ALL,{launch.SRUN_TASK_ENV}=1"]
    assert cmd[7:] == [sys.executable, "-m", "replayjob", "replay", "cfg.toml", "--out", "o"]
    with pytest.raises(UsageError):
        launch.srun_command(0, ["replay"])


def test_the_entry_point_refuses_outside_an_srun_task_with_exit_2() -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, launch.SRUN_TASK_ENV: "1"}
    proc = subprocess.run([sys.executable, "-m", "replayjob", "--version"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not an srun task" in proc.stderr and "Traceback" not in proc.stderr


def _job_id_with_free_port() -> str:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if launch.PORT_BASE <= port < launch.PORT_BASE + launch.PORT_SPAN:
            return str(port - launch.PORT_BASE)
    pytest.skip("no free port in the mapped range")


RANK_PROGRAM = """
import os
from replayjob.runtime import slurm_ranks as launch
os.environ.update(launch.rank_env(os.environ))
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(dist.get_rank(), dist.get_world_size(), os.environ["LOCAL_RANK"], int(t.item()))
dist.destroy_process_group()
"""


def test_two_tasks_form_a_gloo_group_through_the_mapped_environment() -> None:
    job = _job_id_with_free_port()
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_PROGRAM], text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              env={**base, "SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r),
                                   "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": job})
             for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    assert sorted(o.strip() for o, _ in outs) == ["0 2 0 3", "1 2 1 3"]  # 1 + 2 summed on both ranks


def test_the_one_launch_function_picks_torchrun_or_srun() -> None:
    from replayjob.runtime import distributed

    argv = ["capture", "source.toml", "--out", "src"]
    assert distributed.launch_command(2, argv)[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                       "--nproc-per-node", "2"]
    assert distributed.launch_command(2, argv, "srun") == launch.srun_command(2, argv)
    with pytest.raises(UsageError, match="'mpirun' is not a launcher"):  # the step's own check, written once
        distributed.launch_command(2, argv, "mpirun")


def test_a_refused_srun_task_records_its_refusal(tmp_path: Path) -> None:
    """Its Slurm variables refused, a task (``python -m replayjob`` marked as one) records exit 2, so the
    launch reports the refusal, not a killed rank (3, which the Slurm scripts would requeue)."""
    from replayjob.runtime import distributed

    env = {k: v for k, v in os.environ.items()
           if k not in ("SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_JOB_ID", "RANK")}
    env.update({distributed.EXIT_DIR_ENV: str(tmp_path), "SLURM_PROCID": "1", launch.SRUN_TASK_ENV: "1"})
    proc = subprocess.run([sys.executable, "-m", "replayjob", "explain", "nowhere.toml"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not an srun task" in proc.stderr
    assert (tmp_path / "rank-1").read_text() == "2"
    assert distributed.merged_exit(1, [2], nproc=2) == 2
    assert distributed.merged_exit(1, [1], nproc=2) == 3  # a rank recorded nothing: not a verdict


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an exited child its parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_an_interrupted_launch_stops_the_launcher_s_whole_process_group(tmp_path: Path) -> None:
    """A SIGTERM to the waiting process (the CLI's handler raises, as for a preempted `step`) reaches the
    launcher and every process it started: a stand-in launcher (sh) and its 'rank' (sleep)."""
    import signal
    import threading

    from replayjob.runtime import distributed

    pids = tmp_path / "pids"
    cmd = ["sh", "-c", f'sleep 120 & echo "$$ $!" > {pids}; wait']

    class Terminated(Exception):
        pass

    def handler(signum: int, frame: object) -> None:
        raise Terminated

    def terminate_once_started() -> None:
        for _ in range(200):
            if pids.is_file() and len(pids.read_text().split()) == 2:
                break
            threading.Event().wait(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        threading.Thread(target=terminate_once_started, daemon=True).start()
        with pytest.raises(Terminated):
            distributed.run_group(cmd, dict(os.environ), timeout=60, grace_s=5)
    finally:
        signal.signal(signal.SIGTERM, previous)
    launcher, rank = (int(x) for x in pids.read_text().split())
    for _ in range(100):
        if not _alive(launcher) and not _alive(rank):
            break
        threading.Event().wait(0.05)
    assert not _alive(launcher) and not _alive(rank)


def test_a_finished_launch_returns_its_exit_code_and_output() -> None:
    from replayjob.runtime import distributed

    done = distributed.run_group([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], dict(os.environ))
    assert done.returncode == 3 and done.stdout.strip() == "out"
