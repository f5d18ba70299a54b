"""Capture and replay for trainers other than replayjob's own: one module per framework.

The framework-neutral part lives in :mod:`~replayjob.integrations.capture` (the public capture API
any PyTorch loop can call), :mod:`~replayjob.integrations.manifest` (the capture's schema),
:mod:`~replayjob.integrations.admission` (explain: the shared admission rules, no model) and
:mod:`~replayjob.integrations.replay` (one update from a verified capture).  A framework module
(``trl.py``) adds only what is specific to it: how to instrument its trainer and how to rebuild it
and run one captured micro-batch through its own training step.

The one producer registry (:data:`replayjob.producers.PRODUCERS`) maps the framework name a manifest
records to the module that replays it; a second framework (verl, OpenRLHF) is one more entry there
and one more module here.  Importing this package imports no framework.
"""

from __future__ import annotations
