"""The public capture API, shared by every producer but replayjob's own trainer.

* :mod:`.capture` -- :class:`~.capture.StepCapture` and :class:`~.capture.ChosenSteps`, what any PyTorch
  loop calls (``replayjob.StepCapture``, docs/capture-api.md);
* :mod:`.files` and :mod:`.microbatch` -- the files a capture writes, the identities it records, and one
  recorded loss call with its digests;
* :mod:`.parts` -- a step captured over several processes: one part per rank, then the root;
* :mod:`.admission` -- explain for these captures: the shared admission rules, no model;
* :mod:`.replay` -- :class:`~.replay.ReplaySession`, a framework's trainer stood at the captured step;
* :mod:`.precision` -- the effective compute precision of a captured update (autocast, TF32).

A framework's folder beside this one (:mod:`replayjob.producers.trl`, :mod:`replayjob.producers.verl`,
:mod:`replayjob.producers.torch_loop`) adds only how to instrument its trainer and how to rebuild it and run
one captured micro-batch through its own training step.  The capture's manifest is declared in
:mod:`replayjob.artifacts.api_manifest`.  Importing this package imports no framework.
"""
