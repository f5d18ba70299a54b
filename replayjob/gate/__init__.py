"""Evidence gates: reduce repeated replays to a verdict whose exit code gates submissions.

:mod:`.evidence` reads replay metrics strictly, :mod:`.claims` holds the checks of each claim,
:mod:`.stats` the spread statistics, :mod:`.updates` the adapter update geometry,
:mod:`.verdict` the verdict schema and its write, :mod:`.report` the markdown and plot, and
:mod:`.reducer` ties them together; :mod:`.synthetic` writes synthetic evidence for tests and the
benchmark.  Importing this package imports neither transformers nor peft.
"""
