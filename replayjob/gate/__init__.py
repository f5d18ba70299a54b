"""Evidence gates: reduce repeated replays to a verdict whose exit code gates submissions.

:mod:`.evidence` finds and reads the replays' metrics, :mod:`.checks` holds the checks of each claim (the
claims themselves are declared in :mod:`replayjob.artifacts.claims`), :mod:`.stats` the spread statistics,
:mod:`.updates` the adapter update geometry, :mod:`.gradients` the gradient evidence from traces,
:mod:`.routing` the routing agreement of mixture-of-experts replays, :mod:`.budgets` the performance
budgets, :mod:`.report` the markdown and plot, and :mod:`.reducer` ties them together into the verdict
document (declared, assembled and written by :mod:`replayjob.artifacts.verdict`); :mod:`.synthetic` writes
synthetic evidence for tests and the benchmark.  Importing this package imports neither transformers nor peft.
"""
