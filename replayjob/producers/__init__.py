"""Producers: the trainers whose optimizer steps replayjob captures and replays, behind one protocol.

A producer is a module registered in :data:`PRODUCERS` under the name its captures record
(``framework`` in the capture manifest and in ``replay_metrics.json``).  It provides:

* **capture**: it writes its capture files (replayjob's own trainer through
  :mod:`replayjob.optbatch.capture`, any other loop through the public capture API
  :mod:`replayjob.integrations.capture`);
* **contract and knobs**: what defines its update (``contract``) and its registered systems-only
  knobs (:mod:`replayjob.knobs`, each knob naming the producers it belongs to);
* **a replay session** (:class:`~replayjob.producers.session.Session`): its trainer rebuilt from a
  verified capture, which runs one captured micro-batch through its own loss and performs its own
  clip and optimizer step; and the observation of its knobs at run time.

The sequence of a replay (pins, RNG restored before each loss call, state, micro-batches, clip and
step, in-process repeats, trace, metrics) is owned by one driver, :mod:`replayjob.producers.driver`,
whatever the producer; :func:`replayjob.producers.manifests.producer_of` reads which producer wrote
a capture from its manifest.  A third framework is one more module and one more entry here.  This
module imports nothing but the error root: every layer may name producers.
"""

from __future__ import annotations

import importlib
from typing import Any

from replayjob.errors import ConfigError

BUILTIN = "replayjob"  # replayjob's own reference trainer

# producer name (as a capture manifest records it) -> the module that replays its captures
PRODUCERS: dict[str, str] = {
    BUILTIN: "replayjob.optbatch.replay",
    "trl": "replayjob.integrations.trl",
    "torch": "replayjob.integrations.torch_loop",
    "verl": "replayjob.integrations.verl",
}


# the producers the public capture API records (every one but the built-in trainer)
EXTERNAL = tuple(name for name in PRODUCERS if name != BUILTIN)


def producer_module(name: str) -> Any:
    """The module that replays captures of producer ``name`` (imported on demand)."""
    if name not in PRODUCERS:
        raise ConfigError(f"unknown producer {name!r}", where="framework",
                          hint="one of: " + ", ".join(sorted(PRODUCERS)))
    return importlib.import_module(PRODUCERS[name])
