"""Run the TRL test scenario (tests/conftest.py ``grpo``) in each process of a ``torchrun`` launch, capturing
one step over every process: ``python -m torch.distributed.run --nproc-per-node 2 tests/trl_ranks_source.py
BASE OUT STEP [GRPOConfig key=json ...]``.  Process 0 writes ``OUT/source.json``: the process count the
trainer saw and the capture's result."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repository: the scenario's tiny model (benchmarks)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import grpo


def main(argv: list[str]) -> None:
    faulthandler.enable()  # an abort (SIGABRT) prints where Python was
    base, out, step = Path(argv[0]), Path(argv[1]), int(argv[2])
    config = {k: json.loads(v) for k, v in (a.split("=", 1) for a in argv[3:])}
    trainer, handle = grpo(base, out, capture_step=step, max_steps=step + 1, **config)
    res = handle.result
    if trainer.accelerator.is_main_process:
        doc = {"num_processes": trainer.accelerator.num_processes, "manifest": str(res.manifest),
               "manifest_sha256": res.manifest_sha256, "logical_sha256": res.logical_sha256,
               "replay_toml": str(res.replay_toml), "log": trainer.state.log_history}
        (out / "source.json").write_text(json.dumps(doc))
    # leave the process group before the interpreter exits (a group torn down by exit can abort a rank)
    import torch.distributed as dist

    trainer.accelerator.wait_for_everyone()
    if dist.is_initialized():
        dist.destroy_process_group()
    # End here, the work written (every capture file was fsynced and renamed, COMPLETE last, and source.json
    # written): torch's C++ teardown at interpreter exit aborted a process now and then after the scenario had
    # passed ("terminate called without an active exception", SIGABRT, about one launch in ten under load).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
