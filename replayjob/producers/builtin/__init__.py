"""Optimizer-batch capture, explain and replay: the exact optimizer inputs of one real RL step.

A source run captures, at the trainer's optimizer boundary, the rows the optimizer consumes and
the Torch RNG state (:mod:`~replayjob.artifacts.capture_payload`), pinned by a manifest written last
(:mod:`~replayjob.artifacts.capture_manifest`).  A replay verifies every pin, the optimizer contract
(:mod:`~replayjob.producers.contract`) and the declared systems-only differences
(:mod:`~replayjob.runtime.knobs`), then performs exactly one update on those rows without any
dataset, environment or sampling (:mod:`~replayjob.producers.builtin.replay`).

Importing this package imports neither transformers nor peft.
"""
