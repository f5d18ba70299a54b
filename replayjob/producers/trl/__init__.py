"""TRL as a producer: ``GRPOTrainer`` / ``RLOOTrainer`` steps captured by one call and replayed in TRL's own loss.

* :mod:`.producer` -- :func:`~.producer.capture_optimizer_batch` (the one-liner, README "Using replayjob with
  TRL") and the replay session that rebuilds the trainer from a capture;
* :mod:`.fields` -- every ``GRPOConfig`` / ``RLOOConfig`` field classified (docs/trl-fields.md);
* :mod:`.vllm_standin` -- a vLLM-shaped generation stand-in for CPU runs of TRL's vLLM path.

Importing this package imports no framework.
"""
