"""The runtime a replay and a source run stand on: ranks, determinism controls, the systems-only knobs.

* :mod:`.distributed` -- ranks and world size (torchrun, gloo/NCCL), the one rank-launch command;
* :mod:`.slurm_ranks` -- the ranks of a step inside a Slurm allocation (``srun``), mapped to torch's env;
* :mod:`.determinism` -- every determinism control, set before any CUDA context, and its provenance record;
* :mod:`.knobs` -- the registry of systems-only knobs (what a replay may change without changing the math);
* :mod:`.contention_probe` -- what contended with a replay's timed updates (load, CPU, GPU processes).

With :mod:`replayjob.model` (the policy backends) and :mod:`replayjob.rl` (the reference GRPO algorithm's
stages, batches, hooks and resume states) this is the runtime layer: below the artifacts, above the config.
"""
