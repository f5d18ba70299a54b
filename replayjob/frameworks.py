"""The producer registry: every framework name a capture may record, and the module that replays it.

A capture manifest and a ``replay_metrics.json`` name their producer in ``framework``; the readers of both
(:mod:`replayjob.artifacts`) check the name against this table, the knob registry says which producers each
knob belongs to, and :func:`replayjob.producers.producer_module` imports the module a name maps to when a
replay needs it.  The table is data (module names as strings), so every layer may read it without importing
a producer.  Adding a producer is one entry here (docs/extending.md).
"""

from __future__ import annotations

BUILTIN = "replayjob"  # replayjob's own reference trainer

# producer name (as a capture manifest records it) -> the module that replays its captures
PRODUCERS: dict[str, str] = {
    BUILTIN: "replayjob.producers.builtin.replay",
    "trl": "replayjob.producers.trl.producer",
    "torch": "replayjob.producers.torch_loop",
    "verl": "replayjob.producers.verl.producer",
}

# the producers the public capture API records (every one but the built-in trainer)
EXTERNAL = tuple(name for name in PRODUCERS if name != BUILTIN)
