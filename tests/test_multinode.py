"""Replays across nodes: one launch of N ranks over K nodes through torchrun's c10d rendezvous.

A Kubernetes JobSet's pods (``replayjob.launch.jobset``) each run ``replayjob step replay ...`` with
the rendezvous in their environment (``REPLAYJOB_NODES``, ``REPLAYJOB_RDZV_ENDPOINT``,
``REPLAYJOB_RDZV_ID``); each step starts its node's share of the ranks with torchrun, which meet at the
first node's endpoint.  Here two such steps run as two separate processes on this host ("two nodes":
two torchrun agents, one rank each, meeting at ``localhost:PORT``), on CPU over gloo, and replay a
real two-rank capture: the replay must equal, bitwise, the same replay run on one node
(``torchrun --standalone``) and the capture itself.  What only a cluster shows (NCCL between nodes, the
fabric, real placement) is in docs/cluster.md, "Multi-node replays".
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from replayjob.artifacts.metrics import FINAL_ADAPTER, rank_file
from replayjob.errors import ConfigError
from replayjob.runtime import distributed, slurm_ranks

SPEC = """\
name = "multinode"
image = "replayjob:dev"
image_policy = "local"
gpu_product = "none"
device = "cpu"
repeats = 2
ranks = 2

[config]
"distributed.strategy" = "ddp"

[arms.two]
"""

RDZV = {distributed.NODES_ENV: "2", distributed.RDZV_ENDPOINT_ENV: "rj-replay-0-0.rj:29400",
        distributed.RDZV_ID_ENV: "run1-replay-3"}


def test_a_rendezvous_over_nodes_launches_this_node_s_share_through_c10d() -> None:
    argv = ["replay", "r.toml", "--out", "o"]
    cmd = distributed.launch_command(4, argv, environ=RDZV)
    assert cmd == [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", "rj-replay-0-0.rj:29400", "--rdzv-id",
                   "run1-replay-3", "--max-restarts", "0", "-m", "replayjob", *argv]
    # a node that knows its place: node 0 hosts the rendezvous store, the others only connect to it
    for rank, host in (("0", "true"), ("1", "false")):
        ranked = distributed.launch_command(4, argv, environ={**RDZV, distributed.NODE_RANK_ENV: rank})
        assert ranked == [*cmd[:13], "--rdzv-conf", f"is_host={host}", *cmd[13:]]
    assert distributed.local_ranks(4, environ=RDZV) == 2 and distributed.local_ranks(4, environ={}) == 4
    assert distributed.local_ranks(4, "srun", RDZV) == 4  # srun's tasks are the allocation's
    # one node: the launch of today, byte for byte
    assert distributed.launch_command(4, argv, environ={})[3:6] == ["--standalone", "--nproc-per-node", "4"]
    assert distributed.launch_command(4, argv, environ={**RDZV, distributed.NODES_ENV: "1"}) == \
        distributed.launch_command(4, argv, environ={})


@pytest.mark.parametrize(("change", "message"), [
    ({distributed.NODES_ENV: "two"}, "is not a node count"),
    ({distributed.NODES_ENV: "0"}, "is not a node count"),
    ({distributed.NODES_ENV: None}, "a rendezvous without REPLAYJOB_NODES"),
    ({distributed.RDZV_ENDPOINT_ENV: "rj-replay-0-0.rj"}, "is not HOST:PORT"),
    ({distributed.RDZV_ENDPOINT_ENV: "rj:99999"}, "is not HOST:PORT"),
    ({distributed.RDZV_ENDPOINT_ENV: "a b:1"}, "is not HOST:PORT"),
    ({distributed.RDZV_ID_ENV: ""}, "is not a rendezvous id"),
    ({distributed.RDZV_ID_ENV: "id,with=comma"}, "is not a rendezvous id"),
    ({distributed.NODES_ENV: "3"}, "4 ranks do not split evenly over REPLAYJOB_NODES=3 nodes"),
    ({distributed.NODE_RANK_ENV: "2"}, "REPLAYJOB_NODE_RANK='2' is not a node of 2"),
    ({distributed.NODE_RANK_ENV: "-1"}, "is not a node of 2"),
])
def test_a_partial_or_malformed_rendezvous_is_refused(change: dict[str, str | None], message: str) -> None:
    env = {k: v for k, v in {**RDZV, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        distributed.launch_command(4, ["replay"], environ=env)


def test_srun_spreads_the_tasks_over_every_node_of_the_allocation() -> None:
    argv = ["replay", "r.toml"]
    assert slurm_ranks.srun_command(4, argv, {})[:5] == ["srun", "--ntasks", "4", "--nodes", "1"]
    cmd = slurm_ranks.srun_command(16, argv, {"SLURM_JOB_NUM_NODES": "2"})
    assert cmd[:8] == ["srun", "--ntasks", "16", "--nodes", "2", "--ntasks-per-node", "8", "--kill-on-bad-exit=1"]
    with pytest.raises(ConfigError, match="16 ranks do not split evenly over the allocation's 3 nodes"):
        slurm_ranks.srun_command(16, argv, {"SLURM_NNODES": "3"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _step(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "replayjob", "step", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def _ended(proc: subprocess.Popen[str]) -> tuple[int, str]:
    out, err = proc.communicate(timeout=900)
    return proc.returncode, out + err


@pytest.mark.slow  # a two-rank capture and two two-rank replays (torchrun), about two minutes on two cores
@pytest.mark.alone  # the ranks rendezvous (c10d, gloo) on ports of this host
def test_two_nodes_through_one_c10d_rendezvous_replay_like_one_node(tmp_path: Path) -> None:
    spec, run = tmp_path / "spec.toml", tmp_path / "run"
    spec.write_text(SPEC, encoding="utf-8")
    base = ["--spec", str(spec), "--run-dir", str(run), "--ranks", "2"]
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
             and not k.startswith(("SLURM_", "REPLAYJOB_"))}
    code, log = _ended(_step("capture", *base, env=clean))
    assert code == 0, log
    code, log = _ended(_step("replay", *base, "--index", "0", env=clean))  # one node: torchrun --standalone
    assert code == 0, log
    # index 1: the same replay as two nodes, each a `step replay` of its own with one rank, as a JobSet's
    # two pods run it; the first node's endpoint is this host's
    rdzv = {distributed.NODES_ENV: "2", distributed.RDZV_ENDPOINT_ENV: f"localhost:{_free_port()}",
            distributed.RDZV_ID_ENV: "multinode-test-replay-1"}
    nodes = [_step("replay", *base, "--index", "1", env={**clean, **rdzv, "REPLAYJOB_POD_NAME": f"node-{k}",
                                                         distributed.NODE_RANK_ENV: str(k)})
             for k in (1, 0)]  # node 1 first: it only connects, and waits for the store node 0 hosts
    ended = [_ended(p) for p in nodes]
    assert [c for c, _ in ended] == [0, 0], "\n".join(t[-3000:] for _, t in ended)
    for _, text in ended:  # each node's step read the finished replay once every rank had ended
        assert "step: replayed arm two repeat 1" in text
    out = run / "replays" / "two" / "1"
    # the two ranks ran under the two nodes' agents: each rank's record names its own "pod"
    assert sorted(json.loads((out / rank_file(r)).read_text())["host"]["pod"] for r in (0, 1)) == ["node-0", "node-1"]
    one, two = (json.loads((run / "replays" / "two" / str(r) / "replay_metrics.json").read_text())
                for r in (0, 1))
    source = json.loads((run / "source" / "metrics.json").read_text())
    assert two["runtime"]["distributed.world_size"] == 2 == one["runtime"]["distributed.world_size"]
    assert [e["rows"] for e in two["distributed"]["ranks"]] == [e["rows"] for e in one["distributed"]["ranks"]]
    assert two[FINAL_ADAPTER] == one[FINAL_ADAPTER] == source[FINAL_ADAPTER]  # bitwise: the final adapter
    assert two["loss"] == one["loss"] == source["loss"]
    code, log = _ended(_step("reduce", "--spec", str(spec), "--run-dir", str(run)))
    assert code == 0, log  # exact-input over both: the two-node replay is one repeat like the other
