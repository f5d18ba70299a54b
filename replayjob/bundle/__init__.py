"""Trajectory bundles: capture what a step consumed, recompute reward -> advantage -> loss
offline with the trainer's own stage functions, and report the first divergence.

Public API: :class:`BundleWriter` and :func:`default_config` (build bundles), :func:`load_bundle`
(strict reader and validator), :func:`inspect_path` (tolerant summary), :func:`replay_bundle`
(recompute and compare).  The format is described in ``docs/bundle-format.md``.
"""

from replayjob.bundle.reader import Bundle, load_bundle
from replayjob.bundle.replay import replay_bundle
from replayjob.bundle.summary import inspect_path
from replayjob.bundle.writer import BundleWriter, default_config, try_finalize

__all__ = ["Bundle", "BundleWriter", "default_config", "inspect_path", "load_bundle", "replay_bundle",
           "try_finalize"]
