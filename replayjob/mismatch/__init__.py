"""``replayjob mismatch``: where the sampler disagrees with the trainer, localised and attributed.

From a capture (its replay config, the file ``explain`` and ``replay`` take, or a capture directory
holding exactly one), the trainer's per-token logprobs of the captured completions are recomputed
from the pinned model state of that step -- no sampling, no update -- and compared with every
logprob source the capture records, named by what produced it (``sampler``: the sampler's own view;
``trainer_old``: the trainer's own logprobs at sampling time).  Per source: the log-ratio
distribution, the k1 and k3 KL estimates, the share of ratios outside ``[1 - d, 1 + d]``, the worst
sequences and positions, a profile along the position, the policy lag, and the attribution tests
(:mod:`~replayjob.mismatch.attribution`).  The decision against a declared, pinned bound
(:mod:`~replayjob.artifacts.mismatch_bound`) is the exit code (:mod:`~replayjob.mismatch.report`).

Modules: ``views`` (per-token data, the collector), ``builtin`` and ``external`` (the recompute for
replayjob's own trainer and for a TRL capture), ``stats``, ``attribution``, ``bound``, ``report``.

Example:
    $ replayjob mismatch ws/source/replay_step_000000.toml --bound bound.toml \\
          --set optimizer_batch.mismatch_bound_sha256=<sha256 of bound.toml>
"""

from __future__ import annotations

import time
from pathlib import Path

from replayjob.artifacts.capture_manifest import REPLAY_CONFIG
from replayjob.artifacts.capture_reader import producer_of
from replayjob.artifacts.mismatch_bound import Bound, read_bound
from replayjob.config import from_dict, load_config
from replayjob.errors import UsageError
from replayjob.mismatch import builtin
from replayjob.mismatch import trl as external
from replayjob.mismatch import verl as verl_recompute
from replayjob.mismatch.report import Report, build
from replayjob.producers import BUILTIN
from replayjob.producers.builtin.admission import admit, source_config
from replayjob.runtime.distributed import observe

__all__ = ["Bound", "Report", "check_capture", "read_bound", "resolve_capture"]


def resolve_capture(path: str | Path) -> Path:
    """The replay config of ``path``: the file itself, or the one replay config in a capture directory."""
    p = Path(path)
    if not p.is_dir():
        return p
    found = sorted(p.glob(REPLAY_CONFIG)) or sorted(p.glob("replay_step_*.toml"))
    if len(found) != 1:
        raise UsageError(f"{'no' if not found else len(found)} replay config(s) in the capture directory",
                         where=p, hint="name the capture's replay config (replay.toml, replay_step_<K>.toml, or "
                                       "the workspace's replay.toml with --set pins)")
    return found[0]


def check_capture(capture: str | Path, overrides: list[str], bound: str | Path | None = None,
                  allow_lag: bool = False) -> Report:
    """Recompute, compare, attribute and decide (the report's ``decision`` holds the exit code)."""
    config = resolve_capture(capture)
    producer, manifest = producer_of(config, overrides)
    if producer == verl_recompute.FRAMEWORK:
        return verl_recompute.check(config, overrides, bound, allow_lag, manifest)
    if producer != BUILTIN:
        return external.check(config, overrides, bound, allow_lag, manifest)
    cfg = observe(load_config(config, overrides), running=False)  # one process: the declared world size, or 1
    declared = read_bound(bound, cfg.optimizer_batch.mismatch_bound_sha256) if bound is not None else None
    adm = admit(cfg, manifest=manifest)
    adm.raise_if_refused()
    assert adm.manifest is not None and adm.batch is not None
    source_cfg = from_dict(source_config(adm.manifest))  # the settings the capture ran with
    t0 = time.perf_counter()
    policy = builtin.build_policy(cfg, adm)
    builtin.check_vocabulary(policy, adm.batch, str(adm.manifest.payload_path))
    views = builtin.recompute(policy, adm.batch, source_cfg)
    wall = time.perf_counter() - t0
    capture_doc = {"config": str(config), "manifest": str(adm.manifest.path), "manifest_sha256": adm.manifest.sha256,
                   "framework": "replayjob", "step": adm.manifest.step}
    return build(capture_doc, views, declared, allow_lag, wall)

