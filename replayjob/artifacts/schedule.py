"""Paired, interleaved replay schedules: which arm runs when, block by block, on one device.

A *block* runs every arm once, back to back, in one place (one node, one device); the pairs a
budget decision uses are (baseline, arm) within a block, so drift over time and node-to-node
variance cancel inside each pair instead of being confounded with the arm.  Two designs:

* ``abba``: the order of the arms alternates from block to block (A B, B A, A B, ... for two arms;
  the whole order reversed every other block for more), and the seed decides which order block 0
  starts with;
* ``random``: each block's order is a random permutation drawn from ``Random(f"{seed}:{block}")``.

A block's order is a function of ``(design, seed, block)`` only, so a launcher that adds blocks
later (``--until-decided``) continues the same schedule.  Each replay records its :class:`Slot`
(``replayjob replay --slot DESIGN:SEED:BLOCK:POSITION``), and the reducer pairs by it.

Example:
    >>> [(arm, s.block, s.position) for arm, s in plan(["a", "b"], 2, "abba", seed=1)]
    [('b', 0, 0), ('a', 0, 1), ('a', 1, 0), ('b', 1, 1)]
    >>> parse_slot("abba:0:1:0")
    Slot(design='abba', seed=0, block=1, position=0)
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from replayjob.errors import UsageError

DESIGNS = ("abba", "random")
_SLOT = re.compile(r"(abba|random):([0-9]{1,18}):([0-9]{1,9}):([0-9]{1,4})")


@dataclass(frozen=True)
class Slot:
    """Where one replay sits in a schedule: its design and seed, its block and its position in it."""

    design: str
    seed: int
    block: int
    position: int

    def arg(self) -> str:
        """The ``--slot`` text of this slot."""
        return f"{self.design}:{self.seed}:{self.block}:{self.position}"

    def to_json(self) -> dict[str, Any]:
        return {"design": self.design, "seed": self.seed, "block": self.block, "position": self.position}


def parse_slot(text: str) -> Slot:
    """``DESIGN:SEED:BLOCK:POSITION`` (what :meth:`Slot.arg` writes), or a usage refusal."""
    m = _SLOT.fullmatch(text)
    if not m:
        raise UsageError(f"--slot expects DESIGN:SEED:BLOCK:POSITION with DESIGN one of "
                         f"{', '.join(DESIGNS)}, got {text!r}", hint="e.g. --slot abba:7:0:1")
    return Slot(m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)))


def block_order(arms: Sequence[str], design: str, seed: int, block: int) -> list[str]:
    """The order in which block ``block`` runs ``arms``."""
    if design not in DESIGNS:
        raise UsageError(f"unknown schedule design {design!r}; use one of {', '.join(DESIGNS)}")
    order = list(arms)
    if design == "random":
        random.Random(f"{seed}:{block}").shuffle(order)
        return order
    first_reversed = random.Random(f"{seed}:abba").random() < 0.5
    return order[::-1] if (block % 2 == 1) != first_reversed else order


def plan(arms: Sequence[str], blocks: int, design: str = "abba", seed: int = 0,
         first_block: int = 0) -> list[tuple[str, Slot]]:
    """Blocks ``first_block .. first_block + blocks - 1``: every arm once per block, in run order."""
    if not arms or len(set(arms)) != len(arms):
        raise UsageError("a schedule needs distinct arms")
    if blocks < 0 or first_block < 0:
        raise UsageError("blocks and first_block must be >= 0")
    out: list[tuple[str, Slot]] = []
    for b in range(first_block, first_block + blocks):
        for pos, arm in enumerate(block_order(arms, design, seed, b)):
            out.append((arm, Slot(design, seed, b, pos)))
    return out
