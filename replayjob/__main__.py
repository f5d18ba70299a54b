"""``python -m replayjob``: the command line.

As an srun task (:data:`~replayjob.runtime.slurm_ranks.SRUN_TASK_ENV`, set by
:func:`~replayjob.runtime.slurm_ranks.srun_command`) the task's Slurm variables are first mapped to the ones
torch.distributed reads; a task whose
variables are refused exits 2 and records that code where the launch collects its ranks' codes.
"""

import os
import sys

from replayjob.cli import console_main
from replayjob.errors import ReplayjobError
from replayjob.runtime import distributed
from replayjob.runtime import slurm_ranks as launch

if os.environ.get(launch.SRUN_TASK_ENV):
    try:
        os.environ.update(launch.rank_env(os.environ))
    except ReplayjobError as exc:
        print(f"replayjob launch: {exc.diagnostics()}", file=sys.stderr)
        # recorded, so the step reports the refusal (2), not a killed rank (3, which Slurm would requeue)
        distributed.record_exit(exc.exit_code, os.environ.get("SLURM_PROCID", "0"))
        sys.exit(exc.exit_code)
console_main()
