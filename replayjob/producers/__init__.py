"""Producers: the trainers whose optimizer steps replayjob captures and replays, behind one protocol.

A producer is a module registered in :data:`PRODUCERS` under the name its captures record
(``framework`` in the capture manifest and in ``replay_metrics.json``).  It provides:

* **capture**: it writes its capture files (replayjob's own trainer through
  :mod:`replayjob.producers.builtin.capture`, any other loop through the public capture API
  :mod:`replayjob.producers.api.capture`);
* **contract and knobs**: what defines its update (``contract``) and its registered systems-only
  knobs (:mod:`replayjob.runtime.knobs`, each knob naming the producers it belongs to);
* **a replay session** (:class:`~replayjob.producers.session.Session`): its trainer rebuilt from a
  verified capture, which runs one captured micro-batch through its own loss and performs its own
  clip and optimizer step; and the observation of its knobs at run time.

The sequence of a replay (pins, RNG restored before each loss call, state, micro-batches, clip and
step, in-process repeats, trace, metrics) is owned by one driver, :mod:`replayjob.producers.driver`,
whatever the producer; :func:`replayjob.artifacts.capture_reader.producer_of` reads which producer wrote
a capture from its manifest.  The registry itself is :mod:`replayjob.frameworks` (data every layer may read);
a new framework is one more module or folder here and one more entry there (docs/extending.md).

The folders: :mod:`.builtin` (replayjob's own trainer), :mod:`.api` (the public capture API every other
producer shares: capture, its files, admission, the replay session), :mod:`.trl`, :mod:`.torch_loop` and
:mod:`.verl`; beside them the protocol (:mod:`.session`), the one replay driver (:mod:`.driver`), the
optimizer contract (:mod:`.contract`), explain's dispatch (:mod:`.explain`) and the trace recorder.
"""

from __future__ import annotations

import importlib
from typing import Any

from replayjob.errors import ConfigError
from replayjob.frameworks import BUILTIN, EXTERNAL, PRODUCERS

__all__ = ["BUILTIN", "EXTERNAL", "PRODUCERS", "producer_module"]


def producer_module(name: str) -> Any:
    """The module that replays captures of producer ``name`` (imported on demand)."""
    if name not in PRODUCERS:
        raise ConfigError(f"unknown producer {name!r}", where="framework",
                          hint="one of: " + ", ".join(sorted(PRODUCERS)))
    return importlib.import_module(PRODUCERS[name])
