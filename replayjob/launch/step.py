"""The one launch implementation: ``replayjob step plan|capture|replay|reduce --spec SPEC --run-dir DIR``.

Kubernetes Jobs, the Argo workflow, the Slurm jobs and ``scripts/local-mid-smoke.sh`` each run one
``replayjob step`` command per stage and hold no logic of their own.  This module owns, once:

* **the selection**: the spec, optionally restricted (``--arms``, in file order), with another
  repeat count, device or claim (:func:`select`), validated like the spec itself;
* **the run record and its fingerprint**: ``RUN/run.json`` holds the SHA-256 of the selected spec and
  the image's identity (:func:`image_identity`: the digest of ``REPLAYJOB_IMAGE_REF``, or of an
  Apptainer ``.sif`` file, ``REPLAYJOB_IMAGE_DIGEST``; a tag alone only under ``image_policy =
  "local"``), and records both; the first step writes it (exclusively), every later step compares, so
  a run directory never mixes two runs' artifacts, nor two images (exit 2);
* **the render-time fields**: a step launched from rendered manifests (``REPLAYJOB_RENDERED``)
  refuses a spec whose resources, parallelism, claim, deadlines or number of replays differ from
  those the manifests were rendered with (:func:`check_rendered`);
* **the output layout** (:class:`Layout`)::

      RUN/run.json                 the run record (fingerprint)
      RUN/workspace/               replayjob init (unless --workspace names an existing one)
      RUN/source/                  the capture (metrics.json written last), unless --source
                                   or the spec's [capture] names an existing one (any producer)
      RUN/capture.json             an existing capture, verified by step capture (no training)
      RUN/replays/ARM/REPEAT/      one replay each (replay_metrics.json written last)
      RUN/verdict.json             the reducer's verdict
      RUN/attempts/                partial outputs of interrupted attempts, moved aside

* **the partial-output policy**: a stage whose completion file exists is reused (a retry or a requeue
  is idempotent); a partial output of an interrupted attempt is moved to ``RUN/attempts/``, never
  deleted and never read by the reducer;
* **strict pins**: a replay reads the capture's two pins from ``source/metrics.json`` with the strict
  JSON reader (two 64-digit hex digests or exit 2); pins handed over by a workflow controller
  (``--pins``) must equal them;
* **index -> (arm, repeat)**: arms in file order, repeats innermost
  (:meth:`~replayjob.artifacts.spec.AblationSpec.run_for_index`); with a paired ``schedule`` in the
  spec, index -> (block, position, arm) in the schedule's run order, the repeat is the block and the
  replay records its slot (``replay --slot``), so every launcher's replays can be paired;
* **budgets**: a spec's ``budgets`` file is pinned (``optimizer_batch.budgets_sha256``) in every
  replay and decided by the reduce (``--budgets``; the first arm is always the baseline of the ratios);
* **one reduce**: the reducer's request comes from the spec alone (``mixed_hardware`` included), plus
  what a sequential experiment adds (``--blocks N``: the first N blocks, one look; ``--max-looks N``;
  ``--report FILE``), so the funnel and the cluster launchers reduce alike;
* **the expected arms**: the reducer is told every arm of the selection and the spec's minimum
  repeats, so a failed replay is missing evidence that is refused by name, never dropped; the reducer
  always runs once the fan-out has ended and always writes a verdict;
* **the determinism environment**: a step started without the spec's
  (:meth:`~replayjob.artifacts.spec.AblationSpec.determinism_env`: ``DETERMINISM_ENV`` with the math
  mode of the spec's existing capture) re-executes itself with it (before torch is imported); a
  contradicting value is refused;
* **ranks**: the step runs once per job; a capture or replay of N > 1 ranks (the spec's ``ranks``, an
  arm's ``distributed.world_size``: :meth:`~replayjob.artifacts.spec.AblationSpec.ranks_for_index`)
  is a child launch of N ranks through :func:`replayjob.runtime.distributed.launch_command` (``--launcher
  torchrun``: in this process tree; ``srun``: the tasks of this Slurm allocation,
  :mod:`replayjob.runtime.slurm_ranks`), whose ranks' exit codes are merged; a launcher that names the
  ranks it provisioned (``--ranks N``) is refused when the spec needs another number, and one with a
  Job per rank count names a replay by its position among that count's (``--position``).

* **retention**: ``step prune --run-root DIR --older-than DAYS`` deletes the run directories in which
  nothing was written for that long (:func:`prune_runs`).

Example:
    $ replayjob step capture --spec ablation.toml --run-dir /shared/runs/ab1
    $ replayjob step replay --spec ablation.toml --run-dir /shared/runs/ab1 --index 4
    $ replayjob step reduce --spec ablation.toml --run-dir /shared/runs/ab1
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replayjob.artifacts import metrics, run_end
from replayjob.artifacts import run_record as runrecord
from replayjob.artifacts.capture_manifest import REPLAY_CONFIG
from replayjob.artifacts.cluster_status import judge
from replayjob.artifacts.pods import to_dict as pods_to_dict
from replayjob.artifacts.spec import DETERMINISM_ENV, RENDERED_ENV, AblationSpec, Run, is_digest_ref, quantity_value
from replayjob.artifacts.verdict import MAX_VERDICT_BYTES, Verdict, read_verdict
from replayjob.config.dump import replay_pins, set_args
from replayjob.digest import is_sha256_hex, sha256_file, sha256_json
from replayjob.errors import (
    EXIT_OK,
    ConfigError,
    ContractError,
    RefusedError,
    ReplayjobError,
    UsageError,
    error_for_exit_status,
)
from replayjob.fsio import atomic_write_bytes, atomic_write_text, read_regular_bytes
from replayjob.gate import reducer
from replayjob.jsonio import pretty_bytes
from replayjob.launch import capture_ref as external
from replayjob.launch.capture_ref import capture_pins, replay_sets
from replayjob.launch.source_run import capture
from replayjob.launch.workspace import init_workspace
from replayjob.producers.builtin.replay import replay_command
from replayjob.runtime import distributed
from replayjob.runtime.determinism import NCCL_NUMERICS
from replayjob.runtime.slurm_ranks import check_launcher

RUN_RECORD = runrecord.FILE
IMAGE_ENV = "REPLAYJOB_IMAGE_REF"
DIGEST_ENV = "REPLAYJOB_IMAGE_DIGEST"


def select(spec: AblationSpec, arms: str | None = None, repeats: int | None = None,
           device: str | None = None, claim: str | None = None) -> AblationSpec:
    """The spec restricted to ``arms`` (comma-separated names, kept in file order), with another
    repeat count, device or claim.  A ``min_repeats`` above a smaller repeat count is lowered to it."""
    changes: dict[str, object] = {}
    if arms is not None:
        names = [n.strip() for n in arms.split(",") if n.strip()]
        if not names:
            raise UsageError("--arms names no arm", hint="e.g. --arms ckpt-off,ckpt-on")
        if len(set(names)) != len(names):
            raise UsageError(f"--arms {arms!r} names an arm twice")
        for name in names:
            spec.arm(name)  # refuses an unknown name, listing the spec's arms
        changes["arms"] = tuple(a for a in spec.arms if a.name in names)
    if repeats is not None:
        if repeats < 1:
            raise UsageError(f"--repeats must be >= 1, found {repeats}")
        changes["repeats"] = repeats
        changes["min_repeats"] = min(spec.min_repeats, repeats)
    if device is not None:
        changes["device"] = device
    if claim is not None:
        changes["claim"] = claim
    try:
        return dataclasses.replace(spec, **changes)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise ConfigError(exc.message, where=f"selection: {exc.where or ''}", hint=exc.hint) from None


def slurm_resources(spec: AblationSpec) -> tuple[int, int, int]:
    """(CPUs per rank, MiB of memory per rank, minutes) a Slurm capture or replay task asks for: the spec's
    ``cpu`` and ``memory`` (or 1 CPU and 4 GiB without GPUs, as the Kubernetes pods), rounded up, and its
    ``deadline_s``.  The quantities are read by the spec's own reader (:func:`~replayjob.artifacts.spec.
    quantity_value`), exactly."""
    cpu, memory = (spec.cpu, spec.memory) if spec.gpu else ("1", "4Gi")
    cores = math.ceil(quantity_value(cpu))
    mib = math.ceil(quantity_value(memory) / 2**20)
    return max(1, cores), max(1, mib), -(-spec.deadline_s // 60)


def plan_lines(spec: AblationSpec) -> list[str]:
    """What a submitting script needs (Slurm's array size and throttle): one ``key=value`` each;
    one ``env=NAME=VALUE`` line per variable of the spec's determinism environment
    (:meth:`~replayjob.artifacts.spec.AblationSpec.determinism_env`, which every job pins: its math
    mode is the existing capture's); ``ranks`` is the capture's, and one ``replays=N:INDEXES`` line
    per rank count names the array indexes (Slurm's ``--array`` syntax) whose replays run N ranks;
    ``cpus``, ``mem_mib`` (per rank), ``time_min`` and ``node_gpus`` are the resources every capture
    and replay task asks for (:func:`slurm_resources`); one ``nodes=N:K`` line per rank count N whose runs
    span K > 1 nodes (:meth:`~replayjob.artifacts.spec.AblationSpec.nodes_for`: more ranks than
    ``node_gpus``), none when every run fits one node."""
    cpus, mem_mib, minutes = slurm_resources(spec)
    counts = sorted({spec.ranks, *spec.rank_groups()})
    return [f"size={spec.size}", f"parallelism={spec.parallelism}",
            f"cpus={cpus}", f"mem_mib={mem_mib}", f"time_min={minutes}", f"node_gpus={spec.node_gpus}",
            "arms=" + ",".join(a.name for a in spec.arms), f"claim={spec.claim}",
            f"min_repeats={spec.effective_min_repeats}", f"device={spec.device}",
            f"schedule={spec.schedule or 'none'}",
            *(f"env={name}={value}" for name, value in spec.determinism_env().items()), f"ranks={spec.ranks}",
            *(f"replays={n}:{index_ranges(ix)}" for n, ix in spec.rank_groups().items()),
            *(f"nodes={n}:{spec.nodes_for(n)[0]}" for n in counts if spec.nodes_for(n)[0] > 1)]


def index_ranges(indexes: Sequence[int]) -> str:
    """Ascending indexes as ranges: ``[0, 1, 2, 5]`` -> ``0-2,5``."""
    runs: list[list[int]] = []
    for i in indexes:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def plan_file(ranks: int | None = None) -> str:
    """The ``--outputs`` file listing every array index (``plan.json``), or those whose replays run
    ``ranks`` ranks (``plan-rN.json``; what a launcher with one replay template per count fans out)."""
    return "plan.json" if ranks is None else f"plan-r{ranks}.json"


def _check_ranks(what: str, needed: int, provisioned: int | None) -> None:
    if provisioned is not None and provisioned != needed:
        raise ContractError(f"{what} runs {needed} rank(s) by the spec, but the launcher provisioned {provisioned}",
                            where="--ranks", hint="render the launcher's manifests or jobs again from this spec "
                                                  "(replayjob k8s render; scripts/slurm/submit.sh)")


def resolve_index(spec: AblationSpec, index: int | None, position: int | None, ranks: int | None) -> int:
    """The array index of one replay: ``index``, or the ``position``-th of those that run ``ranks``
    ranks; refused unless that replay runs exactly ``ranks`` ranks (when given)."""
    if position is not None:
        groups = spec.rank_groups()
        if ranks is None:
            raise UsageError("--position counts among the replays of --ranks N ranks: give --ranks")
        if ranks not in groups:
            raise ContractError(f"no replay of this spec runs {ranks} rank(s); its replays run "
                                + ", ".join(str(n) for n in groups), where="--ranks",
                                hint="render the launcher's manifests again from this spec (replayjob k8s render)")
        if not 0 <= position < len(groups[ranks]):
            raise UsageError(f"--position {position} is outside 0..{len(groups[ranks]) - 1} "
                             f"(the replays of {ranks} rank(s))")
        return groups[ranks][position]
    if index is None:
        raise UsageError("step replay needs --index I (or --position K with --ranks N)")
    run = spec.run_for_index(index)
    _check_ranks(f"index {index} (arm {run.arm})", spec.ranks_for_index(index), ranks)
    return index


def launch_ranks(nproc: int, argv: Sequence[str], launcher: str, where: Path) -> None:
    """``replayjob ARGV`` on ``nproc`` ranks (:func:`replayjob.runtime.distributed.run_launched`); a failed
    launch is raised with the merged exit code of its ranks."""

    code, tail = distributed.run_launched(nproc, argv, launcher=launcher)
    if code != 0:
        raise error_for_exit_status(code)(f"{nproc} ranks of `replayjob {argv[0]}` exited with status {code}: "
                                          f"{tail}", where=where)


VERDICT_FILE = "verdict.json"  # RUN/verdict.json, and the file of the same name under --outputs
# The last line `step verdict` prints on stdout: its outcome, which a launcher requires beside the exit status (an
# image whose replayjob predates the command answers a usage error, exit 2, and would read as "refused").
OUTCOME_LINE = "replayjob step verdict: outcome "


@dataclass(frozen=True)
class Layout:
    """Where every artifact of one run lives (see the module docstring)."""

    run: Path
    workspace: Path
    source: Path

    @classmethod
    def of(cls, run_dir: str | Path, workspace: str | Path | None = None,
           source: str | Path | None = None) -> Layout:
        run = Path(run_dir).absolute()
        return cls(run, Path(workspace).absolute() if workspace else run / "workspace",
                   Path(source).absolute() if source else run / "source")

    @property
    def replays(self) -> Path:
        return self.run / "replays"

    def replay(self, arm: str, repeat: int) -> Path:
        return self.replays / arm / str(repeat)

    @property
    def verdict(self) -> Path:
        return self.run / VERDICT_FILE

    @property
    def owns_workspace(self) -> bool:
        return self.workspace == self.run / "workspace"

    @property
    def owns_source(self) -> bool:
        return self.source == self.run / "source"


def layout_for(spec: AblationSpec, run_dir: str | Path, workspace: str | Path | None = None,
               source: str | Path | None = None) -> Layout:
    """The run's layout; with the spec's ``[capture]`` its source is that capture (no workspace): a
    ``--workspace`` is refused, a ``--source`` must name the same directory."""
    if spec.capture is None:
        return Layout.of(run_dir, workspace, source)
    if workspace:
        raise UsageError("--workspace: the spec names an existing capture ([capture]), so no workspace is used",
                         hint="drop --workspace")
    if source and Path(source).absolute() != Path(spec.capture.dir):
        raise ContractError(f"--source {source} contradicts the spec's capture.dir {spec.capture.dir}",
                            where="--source", hint="drop --source: the spec names the capture")
    return Layout.of(run_dir, None, spec.capture.dir)


def image_identity(spec: AblationSpec) -> tuple[str, str | None]:
    """The image this step runs from: its reference (``REPLAYJOB_IMAGE_REF``, "" outside a container)
    and its digest: the reference's ``@sha256:`` part, else ``REPLAYJOB_IMAGE_DIGEST`` (the SHA-256 of
    an Apptainer ``.sif`` file, set by the Slurm jobs).  A reference without a digest is refused unless
    the spec declares ``image_policy = "local"``: a tag can move between two steps of one run."""
    ref = os.environ.get(IMAGE_ENV, "")
    digest = ref.split("@", 1)[1] if is_digest_ref(ref) else None
    given = os.environ.get(DIGEST_ENV, "")
    if given:
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", given):
            raise ConfigError(f"{DIGEST_ENV}={given[:80]!r} is not sha256: and 64 lowercase hex digits",
                              where="environment")
        if digest is not None and given != digest:
            raise ContractError(f"{DIGEST_ENV} ({given}) contradicts the digest of {IMAGE_ENV} ({ref})",
                                where="environment")
        digest = given
    if ref and digest is None and spec.image_policy != "local":
        raise ConfigError(f"the image {ref!r} is not named by its digest, so this run could not tell it from "
                          "another image under the same tag", where=IMAGE_ENV,
                          hint="run REGISTRY/replayjob@sha256:... (render the manifests from a spec whose image "
                               "is pinned), or declare image_policy = \"local\" in the spec for local development")
    return ref, digest


def check_rendered(spec: AblationSpec) -> None:
    """Refuse a spec whose render-time fields (:meth:`AblationSpec.render_fields`) differ from those the
    launcher's manifests were rendered with (``REPLAYJOB_RENDERED``, set in every rendered container):
    an edited ConfigMap or an Argo ``spec`` parameter cannot change parallelism, resources, the claim
    or the number of replays after the fact, while the run record would claim it did."""
    import json

    raw = os.environ.get(RENDERED_ENV)
    if raw is None:
        return  # not launched from rendered manifests (Slurm, the funnel, a workstation)
    try:
        rendered = json.loads(raw)
        if not isinstance(rendered, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        raise ConfigError(f"{RENDERED_ENV} is not a JSON object: {exc}", where="environment") from None
    mine = json.loads(json.dumps(spec.render_fields()))
    differ = [f"{k} = {json.dumps(rendered.get(k))} rendered, {json.dumps(mine.get(k))} here"
              for k in sorted(set(rendered) | set(mine)) if rendered.get(k) != mine.get(k)]
    if differ:
        raise ContractError("the spec differs from the one the manifests were rendered with in fields fixed at "
                            "render time: " + "; ".join(differ), where=RENDERED_ENV,
                            hint="render the manifests again from this spec (replayjob k8s render); Argo's spec "
                                 "parameter may change arms, repeats' knobs and config, not these fields")


def run_environment() -> dict[str, str | None]:
    """The determinism environment and the NCCL settings that change numerics, as the first step of
    the run saw them (recorded in ``run.json``; every replay records its own in its provenance)."""
    return {name: os.environ.get(name) for name in dict.fromkeys([*DETERMINISM_ENV, *NCCL_NUMERICS])}


def spec_document(spec: AblationSpec) -> dict[str, Any]:
    """The selected spec as plain JSON-able data (the run record's ``spec``; its ``[pods]`` table as data)."""
    doc = dataclasses.asdict(spec)
    doc["pods"] = pods_to_dict(spec.pods) if spec.pods is not None else None
    return doc


def fingerprint(spec: AblationSpec, image: str) -> str:
    """SHA-256 of the selected spec and the image (its digest where there is one, else its reference):
    what makes two runs the same run."""
    return sha256_json({"spec": spec_document(spec), "image": image})


def check_run_record(layout: Layout, spec: AblationSpec, *, create: bool = True) -> None:
    """Write ``RUN/run.json`` if it is absent (exactly one concurrent writer wins), else refuse a run
    directory whose fingerprint is not this run's."""
    image, digest = image_identity(spec)
    fp = fingerprint(spec, digest or image)
    path = layout.run / RUN_RECORD
    if not path.exists() and create:
        try:
            layout.run.mkdir(parents=True, exist_ok=True)
        except PermissionError as exc:
            raise RefusedError(f"cannot create the run directory: {exc.strerror}", where=layout.run,
                               hint=f"the image runs as uid 10001: create {layout.run.parent.parent} on the claim, "
                                    "owned by that uid, once (docs/cluster.md, 'Storage')") from None
        try:
            runrecord.write(path, runrecord.RunRecord(schema=runrecord.SCHEMA, fingerprint=fp, image=image,
                                                      image_digest=digest, environment=run_environment(),
                                                      spec=spec_document(spec)))
            return
        except RefusedError:
            if not path.exists():
                raise
    if not path.exists():
        return
    there = runrecord.read(path).fingerprint
    if there != fp:
        raise ContractError("this run directory holds another run's artifacts (the spec, the selection or "
                            f"the image differ: fingerprint {there[:12]} there, {fp[:12]} here)",
                            where=layout.run, hint="give every submission its own run directory (a new run id)")


def prune_runs(root: Path, older_than_days: int, *, dry_run: bool = False, now: float | None = None,
               log: Any = print) -> list[Path]:
    """Retention: delete every run directory under ``root`` (a directory holding ``run.json``, at any
    depth: ``runs/NAME/RUNID``) in which nothing was written for ``older_than_days`` days (the newest
    modification time of anything in it).  Symbolic links are never followed; ``dry_run`` lists only.
    Returns the directories (to be) deleted."""
    import shutil

    if older_than_days < 1:
        raise UsageError(f"--older-than must be at least 1 day, found {older_than_days}")
    if not root.is_dir() or root.is_symlink():
        raise RefusedError("not a directory of runs", where=root, hint="e.g. /artifacts/runs on the claim")
    cutoff = (time.time() if now is None else now) - older_than_days * 86400
    runs: list[Path] = []
    for top, dirs, files in os.walk(root):
        if RUN_RECORD in files:
            runs.append(Path(top))
            dirs.clear()  # a run's own tree holds no other run
    out = []
    for run in sorted(runs):
        newest = run.lstat().st_mtime
        for top, dirs, files in os.walk(run):
            for name in (*dirs, *files):
                with contextlib.suppress(OSError):
                    newest = max(newest, os.lstat(os.path.join(top, name)).st_mtime)
        if newest >= cutoff:
            continue
        age = (cutoff + older_than_days * 86400 - newest) / 86400
        log(f"prune: {'would delete' if dry_run else 'deleting'} {run} (nothing written for {age:.0f} days)")
        if not dry_run:
            shutil.rmtree(run)
        out.append(run)
    log(f"prune: {len(out)} of {len(runs)} run(s) {'would be ' if dry_run else ''}deleted under {root}")
    return out


def ensure_determinism_env(argv: Sequence[str], *, reexec: bool, spec: AblationSpec | None = None) -> None:
    """Pin ``spec``'s determinism environment (:meth:`~replayjob.artifacts.spec.AblationSpec.determinism_env`;
    without a spec, the built-in capture stage's :data:`DETERMINISM_ENV`) in this process; refuse a value
    that contradicts it.

    Some of it is read only at interpreter start (``PYTHONHASHSEED``), so with ``reexec`` (the console
    script) a process that lacks any of it re-executes ``replayjob argv`` with it; otherwise (in-process
    callers) the missing values are set in ``os.environ`` before torch is imported.
    """
    missing = {}
    pinned = spec.determinism_env() if spec is not None else DETERMINISM_ENV
    for key, value in pinned.items():
        have = os.environ.get(key)
        if have is None:
            missing[key] = value
        elif have != value:
            rendered = RENDERED_ENV in os.environ  # launched from manifests rendered from another spec
            raise ConfigError(f"{key}={have!r} contradicts the pinned determinism environment ({value!r})",
                              where="environment",
                              hint="render the manifests again from this spec (replayjob k8s render)" if rendered
                              else f"unset {key} or set it to {value!r}")
    if missing and reexec:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "replayjob", *argv], {**os.environ, **missing})
    os.environ.update({k: v for k, v in missing.items() if k != "PYTHONHASHSEED"})


def _set_aside(path: Path, layout: Layout, log: Any) -> None:
    """Move an interrupted attempt's partial output to ``RUN/attempts/`` (never deleted, never reduced)."""
    if not path.exists() and not path.is_symlink():
        return
    attempts = layout.run / "attempts"
    attempts.mkdir(parents=True, exist_ok=True)
    rel = path.relative_to(layout.run) if path.is_relative_to(layout.run) else Path(path.name)
    aside = attempts / f"{'-'.join(rel.parts)}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.{os.getpid()}"
    try:
        os.replace(path, aside)
    except FileNotFoundError:  # the step of another node of the same replay (a multi-node run) moved it first
        return
    log(f"step: moved a previous attempt's partial output {path} to {aside}")


def _wait_for(path: Path, wait_s: float, what: str, log: Any) -> bool:
    """Wait up to ``wait_s`` seconds for ``path`` (an earlier stage's completion file) to be there, whatever it is:
    its reader refuses what is not a regular file."""
    deadline = time.monotonic() + wait_s
    announced = False
    while not os.path.lexists(path):
        if time.monotonic() >= deadline:
            return False
        if not announced:
            log(f"step: waiting up to {wait_s:.0f} s for {what} ({path})")
            announced = True
        time.sleep(min(10.0, max(0.1, deadline - time.monotonic())))
    return True


def read_pins(source: Path) -> tuple[str, str, Path]:
    """The capture's two pins and its manifest file, read strictly from ``source/metrics.json``
    (:func:`replayjob.artifacts.metrics.read_pins`)."""
    if not (source / metrics.SOURCE_FILE).is_file():
        raise RefusedError(f"the capture is not complete (no {metrics.SOURCE_FILE})", where=source,
                           hint="run `replayjob step capture` first; replays start after it succeeded")
    return metrics.read_pins(source)


def _parse_pins(text: str) -> tuple[str, str]:
    parts = [p.strip().lower() for p in text.split(",")]
    if len(parts) != 2 or not all(is_sha256_hex(p) for p in parts):
        raise UsageError(f"--pins expects LOGICAL,MANIFEST (two 64-digit hex digests), got {text[:140]!r}")
    return parts[0], parts[1]


def parse_plants(spec: AblationSpec, plants: Sequence[str]) -> dict[str, list[str]]:
    """``--plant ARM:SETTING=VALUE``: negative controls, an undeclared override in one arm's replays.

    The one check of them: ``step replay`` applies them, ``step plan`` validates them for a submitting
    script (``scripts/slurm/submit.sh``) before anything is submitted (a bad one is exit 2)."""
    out: dict[str, list[str]] = {}
    for plant in plants:
        arm, sep, kv = plant.partition(":")
        if not sep or not re.fullmatch(r"[a-z_][a-z0-9_.]*=.+", kv):
            raise UsageError(f"--plant expects ARM:SETTING=VALUE, got {plant!r}")
        spec.arm(arm)
        out.setdefault(arm, []).append(kv)
    return out


def capture_step(spec: AblationSpec, layout: Layout, outputs: Path | None = None, log: Any = print, *,
                 ranks: int | None = None, launcher: str = "torchrun") -> None:
    """Init the workspace (when the run owns it), capture into ``RUN/source`` unless it is complete
    (on the spec's ``ranks`` ranks), or, for the spec's ``[capture]``, verify that existing capture
    (:func:`replayjob.launch.capture_ref.verify`: no training, no workspace), and publish the pins and
    the fan-out plan under ``outputs`` (Argo output parameters)."""
    check_launcher(launcher)
    check_rendered(spec)
    _check_ranks("the capture", spec.ranks, ranks)
    check_run_record(layout, spec)
    if spec.capture is not None:  # an existing capture: verified and recorded, nothing trained

        found = external.verify(spec, layout.run, log)
        _publish(spec, found.logical, found.manifest_sha256, outputs, log)
        return
    if not (layout.workspace / REPLAY_CONFIG).is_file():
        if not layout.owns_workspace:
            raise RefusedError("not a `replayjob init` workspace (no replay.toml)", where=layout.workspace)
        _set_aside(layout.workspace, layout, log)  # replay.toml is init's last file: no replay.toml, partial
        init_workspace(layout.workspace, spec.seed)
        log(f"step: initialised {layout.workspace}")
    if (layout.source / metrics.SOURCE_FILE).is_file():
        log(f"step: {layout.source} is complete; reusing it")
    elif not layout.owns_source:
        raise RefusedError(f"the capture given with --source is not complete (no {metrics.SOURCE_FILE})",
                           where=layout.source)
    else:
        _set_aside(layout.source, layout, log)
        sets = [*spec.config_sets()]
        if spec.ranks == 1:
            capture(layout.workspace / "source.toml", sets, layout.source)
        else:
            launch_ranks(spec.ranks, ["capture", str(layout.workspace / "source.toml"), "--out", str(layout.source),
                                      *(w for kv in sets for w in ("--set", kv))], launcher, layout.source)
        log(f"step: captured into {layout.source}" + (f" on {spec.ranks} ranks ({launcher})" if spec.ranks > 1 else ""))
    logical, manifest, _ = read_pins(layout.source)
    _publish(spec, logical, manifest, outputs, log)


def _publish(spec: AblationSpec, logical: str, manifest: str, outputs: Path | None, log: Any) -> None:
    """Print the capture's pins; under ``outputs`` (Argo output parameters) also the pins and the plan."""
    log(f"{metrics.LOGICAL} {logical}\n{metrics.MANIFEST} {manifest}")
    if outputs is not None:
        atomic_write_text(outputs / "logical_sha256", logical)
        atomic_write_text(outputs / "manifest_sha256", manifest)
        atomic_write_text(outputs / "pins", f"{logical},{manifest}")
        atomic_write_text(outputs / plan_file(), "[" + ", ".join(str(r.index) for r in spec.runs()) + "]")
        for n, indexes in spec.rank_groups().items():
            atomic_write_text(outputs / plan_file(n), "[" + ", ".join(map(str, indexes)) + "]")


def replay_args(spec: AblationSpec, layout: Layout, run: Run, logical: str, manifest: str,
                manifest_file: Path, planted: Sequence[str] = ()) -> list[str]:
    """The ``--set`` overrides of one replay: common, the arm's knobs and their declaration, pins."""
    return [*spec.config_sets(), *spec.arm(run.arm).set_args(), *planted, *budget_sets(spec),
            *set_args(replay_pins(manifest_file, logical, manifest)), *arm_declaration(spec, run)]


def budget_sets(spec: AblationSpec) -> list[str]:
    """The budget file's pin, when the spec declares budgets."""
    return set_args({"optimizer_batch.budgets_sha256": budgets_pin(spec)}) if spec.budgets else []


def arm_declaration(spec: AblationSpec, run: Run) -> list[str]:
    """A replay's arm name and its declared differences (the arm's override keys)."""
    return set_args({"optimizer_batch.arm": run.arm,
                     "optimizer_batch.allow_config_differences": sorted(spec.arm(run.arm).overrides)})


def budgets_pin(spec: AblationSpec) -> str:
    """SHA-256 of the spec's budget file (refused when it is not a regular file)."""

    path = Path(spec.budgets)
    if not path.is_file():
        raise RefusedError("the spec's budget file is missing", where=path,
                           hint="budgets must name a file every step can read (a shared path)")
    return sha256_file(path, follow_symlinks=True)  # a file the spec names, not an artifact


def replay_step(spec: AblationSpec, layout: Layout, index: int, *, pins: str | None = None,
                plants: Sequence[str] = (), wait_s: float = 0, log: Any = print, launcher: str = "torchrun") -> None:
    """One replay: index -> (arm, repeat), strict pins, ``RUN/replays/ARM/REPEAT`` (reused if complete),
    on the ranks its arm runs."""
    check_launcher(launcher)
    check_rendered(spec)
    run = spec.run_for_index(index)
    nproc = spec.ranks_for_index(index)
    planted = parse_plants(spec, plants).get(run.arm, [])
    check_run_record(layout, spec)
    config, found = layout.workspace / REPLAY_CONFIG, None
    if spec.capture is not None:  # an existing capture: its own replay config, once step capture verified it

        if not _wait_for(layout.run / external.CAPTURE_RECORD, wait_s, "the capture's verification", log):
            raise RefusedError(f"the capture was not verified (no {external.CAPTURE_RECORD})", where=layout.run,
                               hint="run `replayjob step capture` first; replays start after it succeeded")
        found = external.locate(spec)
        config, logical, manifest, manifest_file = found.config, found.logical, found.manifest_sha256, found.manifest
    else:
        _wait_for(layout.source / metrics.SOURCE_FILE, wait_s, "the capture", log)
        logical, manifest, manifest_file = read_pins(layout.source)
    if pins is not None and _parse_pins(pins) != (logical, manifest):
        raise ContractError(f"the pins handed over by the launcher differ from the capture's {metrics.SOURCE_FILE}",
                            where=layout.source / metrics.SOURCE_FILE,
                            hint="the run directory holds another capture; give the run a new run directory")
    out = layout.replay(run.arm, run.repeat)
    where = f" (schedule slot {run.slot.arg()})" if run.slot is not None else ""
    on = f" on {nproc} ranks ({launcher})" if nproc > 1 else ""
    log(f"step: index {index} is arm {run.arm} repeat {run.repeat}{where}{on} -> {out}")
    if (out / metrics.REPLAY_FILE).is_file():
        log(f"step: {out} is complete; reusing it")
        return
    _set_aside(out, layout, log)
    for kv in planted:
        log(f"step: planted undeclared override {kv} in arm {run.arm}")
    if found is not None:

        args = [*replay_sets(spec, found), *spec.arm(run.arm).set_args(), *planted, *budget_sets(spec),
                *arm_declaration(spec, run)]
    else:
        args = replay_args(spec, layout, run, logical, manifest, manifest_file, planted)
    for path, m in replay_command(config, args, out, None, run.repeat, run.slot, nproc=nproc, launcher=launcher):
        log(f"step: replayed arm {m['arm']} repeat {m['repeat_index']}: loss {metrics.loss_text(m)}; wrote "
            f"{path}/{metrics.REPLAY_FILE}")


def expected_files(spec: AblationSpec, layout: Layout, blocks: int | None = None) -> Iterator[Path]:
    """Every replay's metrics file, or those of the first ``blocks`` repeats (paired blocks) of each arm."""
    for run in spec.runs():
        if blocks is None or run.repeat < blocks:
            yield layout.replay(run.arm, run.repeat) / metrics.REPLAY_FILE


def confirm_verdict(run: Path, code: int) -> int:
    """``step verdict``: a launcher's outcome of run directory ``run`` whose reducer ended with ``code``, as the
    launcher saw it (Slurm's accounting).  ``RUN/verdict.json`` is read through the one verdict reader without
    following a link, and the two are judged by the rule ``argo wait`` and the driver apply
    (:func:`replayjob.artifacts.cluster_status.judge`): the code when they agree, 3 when the verdict is missing or
    unreadable or says another code (a verdict edited after the reducer wrote it decides nothing).  Its last line
    on stdout is :data:`OUTCOME_LINE` and the outcome, which scripts/slurm/lib.sh ``confirm_verdict`` requires."""
    path = run / VERDICT_FILE
    step = f"reduce exited {code}"
    verdict: Verdict | None = None
    unreadable: str | None = None
    try:
        if os.path.lexists(path):  # none there: no verdict (a link, even a dangling one, is unreadable)
            verdict = read_verdict(read_regular_bytes(path, max_bytes=MAX_VERDICT_BYTES, what="verdict"),
                                   where=str(path))
    except ReplayjobError as exc:
        unreadable = exc.message
    except OSError as exc:
        unreadable = f"{path}: {exc.strerror or exc}"
    outcome, line = judge(verdict, unreadable, code, step, need_code=True)
    print(f"{path}: {line}", file=sys.stdout if outcome == EXIT_OK else sys.stderr)
    print(f"{OUTCOME_LINE}{outcome}", flush=True)
    return outcome


def reduce_step(spec: AblationSpec, layout: Layout, *, wait_s: float = 0, outputs: Path | None = None,
                blocks: int | None = None, report: Path | None = None, max_looks: int = 1,
                ended: tuple[str, str] | None = None, log: Any = print) -> Any:
    """Reduce every replay of the run against the capture, for every arm of the selection; always
    writes ``RUN/verdict.json`` (refused when evidence is missing).  Returns the verdict.

    Everything the reducer is told comes from the spec (claim, arms and their plan, minimum repeats,
    ``mixed_hardware``, budgets; the first arm is the baseline of the ratios), so every launcher
    reduces alike.  ``blocks`` reduces only the first N repeats of each arm (one look of a sequential
    experiment, ``funnel --until-decided``); ``report`` also writes the markdown report (and PNG);
    ``max_looks`` is the budgets' alpha spending (the most looks the experiment may take).  ``ended``
    (Argo's exit handler: the workflow's status and failed nodes) first writes ``RUN/ended.json``, naming
    what ended the run (:mod:`replayjob.artifacts.run_end`), also to ``outputs``."""

    if blocks is not None and not 1 <= blocks <= spec.repeats:
        raise UsageError(f"--blocks must be between 1 and the selection's {spec.repeats} repeats, got {blocks}")
    check_rendered(spec)
    check_run_record(layout, spec, create=False)
    if ended is not None:  # before the verdict: what ended the run is known whatever the reduce finds
        layout.run.mkdir(parents=True, exist_ok=True)  # a run stopped before its first step has no directory yet
        record = run_end.write_run_end(layout.run / run_end.RUN_END_FILE, run_end.run_end(*ended))
        log(f"step: {record.line}; recorded in {layout.run / run_end.RUN_END_FILE}")
        if outputs is not None:
            atomic_write_bytes(outputs / run_end.RUN_END_FILE, (layout.run / run_end.RUN_END_FILE).read_bytes())
    deadline = time.monotonic() + wait_s
    expected = list(expected_files(spec, layout, blocks))
    for path in expected:
        if not _wait_for(path, max(0.0, deadline - time.monotonic()), "every replay", log):
            break
    # missing: nothing at all there (a file that is not a regular one, or not readable, is there: the reducer
    # refuses it, and that refusal stands, never an incomplete verdict that a retry would only repeat)
    missing = [str(p.parent.relative_to(layout.run)) for p in expected if not os.path.lexists(p)]
    there = [str(p.parent.relative_to(layout.run)) for p in expected if os.path.lexists(p)]
    no_capture = not os.path.lexists(layout.source / metrics.SOURCE_FILE)
    if no_capture:
        log(f"step: no capture: {layout.source} holds no {metrics.SOURCE_FILE} (the capture failed or never ran); "
            "nothing can be decided")
    if missing:
        log(f"step: {len(missing)} replay(s) left no {metrics.REPLAY_FILE}: {', '.join(missing)}")
    layout.replays.mkdir(parents=True, exist_ok=True)
    source_step = None
    if spec.capture is not None:  # one of several chosen steps: compared with that step's record
        try:
            source_step = capture_pins(layout.source, spec.capture.replay_config)[3]
        except ReplayjobError as exc:  # the reducer refuses the source itself, in the verdict it always writes
            log(f"step: the capture cannot be read: {exc.message}")
    # one look reads only its blocks' replays, even where later blocks already ran
    paths = [str(layout.replays)] if blocks is None else [str(p) for p in expected if os.path.lexists(p)]
    verdict = reducer.reduce_evidence(reducer.Request(
        paths=paths, claim=spec.claim, out=layout.verdict, source=layout.source,
        min_repeats=spec.effective_min_repeats, arms=tuple(a.name for a in spec.arms), spec=spec,
        mixed_hardware=spec.mixed_hardware, budgets=Path(spec.budgets) if spec.budgets else None,
        baseline=spec.arms[0].name, report=report, max_looks=max_looks, source_step=source_step,
        missing=tuple(missing) + (("source",) if no_capture else ()), there=tuple(there)))
    log(verdict.summary())
    log(f"step: wrote {layout.verdict}")
    if outputs is not None:  # the bytes the reducer wrote, not a second read of the shared volume's file
        atomic_write_bytes(outputs / VERDICT_FILE, pretty_bytes(verdict.doc))
    return verdict
