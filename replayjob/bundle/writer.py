"""``BundleWriter``: build a trajectory bundle by hand or from a trainer, atomically.

The writer checks everything the reader will check before it writes a byte (names, redaction,
config and its ranges, payload dtypes, token ids, group closure, dependency closure), stages the
bundle in a temporary sibling directory, writes
``payloads.safetensors`` (every tensor, hashed once: its header block and each tensor's bytes),
``manifest.json`` and ``COMPLETE`` (last), one ``fsync`` each, syncs the staging directory once and
renames it into place (``finalize``; ``prepare`` is the checks and the three files' bytes in
memory, ``write`` the disk part, for callers that do them on different threads).  With
``rank``/``ranks``/``run_id`` it writes ``<path>/rank-<r>/`` and ``<path>/COMPLETE.<r>``; whichever rank
lands last writes the final ``<path>/COMPLETE``, unless the landed ranks carry different run ids
(two runs' ranks in one directory: refused, :func:`shared_run_id` chooses one id per run).

Example (a two-sample GRPO rollout bundle whose reward stages are recomputed)::

    >>> import tempfile, torch
    >>> from replayjob.bundle import BundleWriter, default_config
    >>> w = BundleWriter(tempfile.mkdtemp() + "/b", kind="rollout", rollout_id=7,
    ...                  config=default_config(samples_per_prompt=2))
    >>> for i, text in enumerate(["2", "3"]):   # text is hashed by the default redaction policy
    ...     w.add_sample(f"s-{i}", group="g-0", prompt_length=6, response_length=2,
    ...                  prompt="Q:1+1=", completion=text, label="2")
    >>> w.set_expected("reward.raw", "raw", [1.0, 0.0])
    >>> w.set_expected("reward.post_process", "scores", [0.7071057811879616, -0.7071057811879616])
    >>> for stage in ("reward.raw", "advantage.kl", "advantage.estimate"):
    ...     w.set_capability(stage, "inspect-only", "not captured in this example")
    >>> w.finalize().name
    'b'
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import replayjob
from replayjob import tensorfile
from replayjob.artifacts.bundle import RankComplete
from replayjob.bundle import format as fmt
from replayjob.bundle.reader import FinitePadding, InDomain, TokenIds
from replayjob.bundle.schema import check_closure, check_groups, check_manifest, check_tokens
from replayjob.crashpoints import point
from replayjob.declaration import decode
from replayjob.digest import sha256_bytes
from replayjob.errors import ArtifactExistsError, ConfigError, IntegrityError
from replayjob.fsio import atomic_write_bytes, fsync_dir, write_failure
from replayjob.jsonio import canonical_bytes, pretty_bytes, read_json_object
from replayjob.runtime import distributed

if TYPE_CHECKING:
    from torch import Tensor

ENV_RUN_ID = "REPLAYJOB_BUNDLE_RUN_ID"  # a multi-rank bundle's run id, set by the launcher (one per launch)
ENV_ELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"  # torchrun's rendezvous id (a fresh UUID with --standalone)
ENV_ELASTIC_RESTART = "TORCHELASTIC_RESTART_COUNT"  # torchrun's restart of the workers (an attempt: another run)


def new_run_id() -> str:
    """A fresh random run id (128 bits, hex)."""
    return secrets.token_hex(16)


def shared_run_id(environ: Mapping[str, str] | None = None) -> str:
    """The run id every rank of this run passes to its :class:`BundleWriter` (``run_id=``); call it once per
    run, on every rank.

    In order: ``REPLAYJOB_BUNDLE_RUN_ID`` (the launcher sets one fresh value per launch, the same on every
    rank); with torch.distributed initialised, a random id rank 0 draws and every rank receives (a
    collective: every rank must call it, at the same point); under torchrun (``TORCHELASTIC_RUN_ID``, not
    its default ``none``), the rendezvous id and restart count (an elastic restart is another run: its ranks
    must not complete a root the failed attempt began).  Anything else is refused: a run id drawn by each
    process alone would tie nothing.
    """
    env = os.environ if environ is None else environ
    explicit = env.get(ENV_RUN_ID, "").strip()
    if explicit:
        return fmt.check_run_id(explicit, where=ENV_RUN_ID)
    if distributed.group_active():
        mine = new_run_id() if distributed.rank() == distributed.ROOT_RANK else None
        return fmt.check_run_id(distributed.gather_objects(mine)[distributed.ROOT_RANK], where="torch.distributed")
    elastic = env.get(ENV_ELASTIC_RUN_ID, "").strip()
    if elastic and elastic != "none":
        return fmt.check_run_id(f"{elastic}.{env.get(ENV_ELASTIC_RESTART, '0').strip() or '0'}",
                                where=ENV_ELASTIC_RUN_ID)
    raise ConfigError("no run id is shared by every rank of this run", where=ENV_RUN_ID,
                      hint=f"set {ENV_RUN_ID} in the launcher (one fresh value per launch, e.g. "
                           "`python -c 'import secrets; print(secrets.token_hex(16))'`), or call shared_run_id() "
                           "once torch.distributed is initialised")


def default_config(**overrides: Any) -> dict[str, Any]:
    """A recompute config with the source trainer's defaults; keyword arguments override keys."""
    cfg: dict[str, Any] = {"estimator": "grpo", "samples_per_prompt": 4, "std_eps": 1e-6, "kl_kind": "k1",
                           "kl_reward_coef": 0.0, "batch_adv_norm": False, "adv_clip": 0.0, "token_cap": 0,
                           "loss_agg": "token-mean", "clip_low": 0.2, "clip_high": 0.2, "kl_loss_coef": 0.0,
                           "context_parallel": 1, "task": None, "tokenizer": "byte"}
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise IntegrityError(f"unknown config key(s) {sorted(unknown)}")
    cfg.update(overrides)
    return cfg


def redact_text(field: str, text: str, policy: str) -> dict[str, str]:
    """Apply the redaction policy to one text field: ``hash`` -> SHA-256, ``truncate:N`` -> prefix."""
    if policy == "hash":
        return {f"{field}_sha256": sha256_bytes(text.encode("utf-8"))}
    if policy.startswith("truncate:"):
        return {f"{field}_prefix": text[: int(policy.split(":")[1])]}
    return {}


@dataclass(frozen=True)
class PreparedBundle:
    """A bundle checked and serialized in memory (:meth:`BundleWriter.prepare`), not yet on disk."""

    final: Path  # the directory it will be renamed to
    payload: bytes | None  # payloads.safetensors (None: no payloads)
    manifest: bytes  # manifest.json (canonical JSON)
    complete: bytes  # COMPLETE
    manifest_sha256: str


class BundleWriter:
    """Collect samples, payloads and expected outputs; :meth:`finalize` writes the bundle.

    Args:
        path: the bundle directory to create (for a multi-rank bundle, its root).
        kind: ``"rollout"`` (reward and advantage stages), ``"step"`` (loss.policy) or ``"update"``
            (all of them: a rollout and the one actor step that consumed it).
        rollout_id, step_id: the logical actor step; ``step_id`` is required for ``"step"`` and
            ``"update"``.
        config: the recompute config (see :func:`default_config`).
        rank, ranks: this producer's rank and every rank expected to land (multi-producer only).
        run_id: the id of the run (multi-producer only, then required): chosen once per run and passed to
            every rank's writer, e.g. :func:`shared_run_id`.  Every rank records it (manifest
            ``multi_rank.run_id``, ``COMPLETE.<r>``); the root is written, and read, only when all agree.
    """

    def __init__(self, path: str | Path, *, kind: str, rollout_id: int, config: dict[str, Any],
                 step_id: int | None = None, bundle_id: str | None = None,
                 producer: dict[str, Any] | None = None, redaction: dict[str, str] | None = None,
                 comparison: dict[str, dict[str, float]] | None = None, weight_version: int = 0,
                 rank: int | None = None, ranks: Sequence[int] | None = None, run_id: str | None = None):
        import torch
        if kind not in fmt.KINDS:
            raise IntegrityError(f"bundle kind must be one of {list(fmt.KINDS)}, not {kind!r}")
        if (kind in fmt.STEP_KINDS) != (step_id is not None):
            raise IntegrityError("a step or update bundle needs step_id; a rollout bundle must not have one")
        if (rank is None) != (ranks is None) or (ranks is not None and rank not in ranks):
            raise IntegrityError("pass rank and ranks together, with rank among ranks")
        if ranks is None and run_id is not None:
            raise IntegrityError("run_id ties the ranks of a multi-rank bundle to one run: pass it with rank and ranks")
        if ranks is not None and run_id is None:
            raise IntegrityError("a multi-rank bundle needs run_id: one id chosen once per run and passed to every "
                                 "rank's writer", hint="pass run_id=shared_run_id() (replayjob.bundle.writer), or "
                                                       f"set {ENV_RUN_ID} in the launcher")
        self.run_id = None if run_id is None else fmt.check_run_id(run_id, where="run_id")
        self.root = Path(path)
        self.kind = kind
        self.rank = rank
        self.ranks = sorted(set(ranks)) if ranks is not None else None
        self.bundle_id = bundle_id or fmt.bundle_name(kind, rollout_id, step_id)
        self.redaction = dict(redaction or fmt.DEFAULT_REDACTION)
        fmt.decode_redaction(self.redaction)  # as the manifest declares it; written as given
        self.identity: dict[str, Any] = {
            "rollout_id": rollout_id, "step_id": step_id,
            "physical": {"rank": rank or 0, "world_size": len(self.ranks) if self.ranks else 1,
                         "weight_version": weight_version}}
        fmt.decode_config(config, where="config")  # as the index declares it; written as given
        self.config = dict(config)
        self.producer = producer or {"name": "replayjob", "replayjob_version": replayjob.__version__,
                                     "torch_version": torch.__version__}
        self.comparison = {s: dict(v) for s, v in fmt.DEFAULT_COMPARISON.items()}
        for stage, tol in (comparison or {}).items():
            self.comparison[stage] = dict(tol)
        self.stages = {s: {"version": fmt.STAGE_VERSION, "capability": "recompute",
                           "implementation": fmt.IMPLEMENTATION[s], "reason": ""}
                       for s in fmt.KIND_STAGES[kind]}
        self.stages["sample"].update(capability="inspect-only",
                                     reason="sampling needs the model; lengths, token ids and redacted text "
                                            "are recorded")
        self.samples: list[dict[str, Any]] = []
        self.payloads: dict[str, Tensor] = {}
        self.roles: dict[str, str] = {}
        self.expected: dict[str, dict[str, Any]] = {}

    def set_capability(self, stage: str, capability: str, reason: str = "") -> None:
        if stage not in self.stages:
            raise IntegrityError(f"stage {stage!r} is not part of a {self.kind} bundle "
                                 f"({list(self.stages)})")
        self.stages[stage].update(capability=capability, reason=reason)

    def add_sample(self, sample_id: str, *, group: str | None, prompt_length: int, response_length: int,
                   cohort: str = "c-0", label_length: int | None = None, partition: str = "p-0",
                   consumer_batch: str = "cb-0000", micro_batch: str = "mb-0000",
                   weight_version: int | None = None, prompt: str | None = None,
                   completion: str | None = None, label: str | None = None) -> None:
        """Add one sample; text arguments are redacted here and never stored raw."""
        rec: dict[str, Any] = {
            "sample_id": sample_id, "group": group, "cohort": cohort, "prompt_length": prompt_length,
            "response_length": response_length, "label_length": label_length, "partition": partition,
            "consumer_batch": consumer_batch, "micro_batch": micro_batch, "rank": self.rank or 0,
            "weight_version": self.identity["physical"]["weight_version"] if weight_version is None
            else weight_version}
        for field, text in (("prompt", prompt), ("completion", completion), ("label", label)):
            policy = self.redaction[field]
            if policy != "drop" and text is None:
                raise IntegrityError(f"sample {sample_id!r}: the redaction policy {policy!r} for {field} "
                                     f"needs the {field} text", hint=f"pass {field}= or set its policy to drop")
            if text is not None:
                rec.update(redact_text(field, text, policy))
        self.samples.append(rec)  # checked with every other sample by prepare (decode_manifest, as the reader does)

    def write_payload(self, name: str, tensor: Tensor, *, role: str = "input") -> None:
        """Add a tensor payload (``role`` "input" or "expected"); stored as tensor ``<name>`` of the payload file."""
        from torch import Tensor
        fmt.check_payload_name(name)
        if not isinstance(tensor, Tensor):
            raise IntegrityError(f"payload {name!r} must be a torch.Tensor, not {type(tensor).__name__}",
                                 hint="bundles hold tensors only; put metadata in the index")
        if tensorfile.safetensors_name(tensor.dtype) not in fmt.DTYPES:
            raise IntegrityError(f"payload {name!r}: dtype {tensor.dtype} is not supported")
        if name in self.payloads:
            raise IntegrityError(f"payload {name!r} was already written")
        self.payloads[name] = tensor.detach().to("cpu").contiguous()
        self.roles[name] = role

    def set_expected(self, stage: str, field: str, value: Tensor | Sequence[float] | float) -> None:
        """Record a stage output: token fields as tensor payloads, others as JSON numbers."""
        from torch import Tensor
        shape = fmt.OUTPUTS.get(stage, {}).get(field)
        if shape is None:
            raise IntegrityError(f"stage {stage!r} has no output field {field!r}")
        if shape == "token":
            if not isinstance(value, Tensor):
                raise IntegrityError(f"{stage}.{field} is per-token: pass a [N, T] tensor")
            self.write_payload(field, value, role="expected")
            self.expected.setdefault(stage, {})[field] = {"payload": field}
        elif shape == "sample":
            vals = value.tolist() if isinstance(value, Tensor) else list(value)  # type: ignore[arg-type]
            self.expected.setdefault(stage, {})[field] = [float(v) for v in vals]
        else:
            self.expected.setdefault(stage, {})[field] = float(value.item() if isinstance(value, Tensor)
                                                              else value)  # type: ignore[arg-type]

    def _documents(self) -> tuple[dict[str, Any], bytes | None]:
        """The manifest (index and expected outputs inside) and the payload file's bytes (None: no payloads).

        The payload file is built and hashed in one pass (:func:`replayjob.tensorfile.encode`: its
        header block and each tensor's bytes), its header checked against the payload schema."""
        index = {"format": fmt.FORMAT, "bundle_id": self.bundle_id, "kind": self.kind,
                 "identity": self.identity, "config": self.config, "samples": self.samples}
        names = sorted(self.payloads)
        dtypes = {name: str(tensorfile.safetensors_name(self.payloads[name].dtype)) for name in names}
        blob: bytes | None = None
        payload_file: dict[str, Any] | None = None
        digests: dict[str, str] = {}
        if names:
            encoded = tensorfile.encode({name: self.payloads[name] for name in names},
                                        schema=fmt.payload_schema(dtypes), where=fmt.PAYLOAD_FILE)
            blob = encoded.data
            digests = {name: encoded.tensor_sha256[name].hex() for name in names}
            payload_file = {"file": fmt.PAYLOAD_FILE, "bytes": len(blob), "header_sha256": encoded.header_sha256.hex()}
        specs = {name: {"dtype": dtypes[name], "shape": list(self.payloads[name].shape), "sha256": digests[name],
                        "role": self.roles[name]} for name in names}
        manifest = {"format": fmt.FORMAT, "format_version": fmt.bundle_version(self.kind, self.ranks is not None),
                    "bundle_id": self.bundle_id,
                    "kind": self.kind, "producer": self.producer, "stages": self.stages, "payloads": specs,
                    "payload_file": payload_file,
                    "comparison": {s: self.comparison[s] for s in self.stages if s in self.comparison},
                    "redaction": self.redaction, "index": index, "expected": self.expected,
                    "multi_rank": None if self.ranks is None else {"rank": self.rank, "expected_ranks": self.ranks,
                                                                   "run_id": self.run_id}}
        return manifest, blob

    def finalize(self) -> Path:
        """Check, stage, write (``COMPLETE`` last), rename into place; return the bundle path."""
        return self.write(self.prepare())

    def prepare(self) -> PreparedBundle:
        """Everything but the disk: check what the reader will check, then serialize the three files.

        No file is touched; :meth:`write` writes the result.  Bundle capture on a CPU-only trainer
        prepares on the training thread and writes on its writer thread (:mod:`replayjob.bundle.hook`)."""
        manifest, blob = self._documents()
        check_manifest(manifest)  # through the declaration the reader reads it with
        fmt.check_supported(self.config)
        check_closure(manifest, manifest["index"], manifest["expected"],
                      {n: (s["dtype"], s["shape"]) for n, s in manifest["payloads"].items()})
        if self.ranks is None:  # a rank's groups close only with the other ranks' (checked by the reader)
            check_groups(manifest, self.samples, self.config)
            check_tokens(manifest, self.samples)
        ids = TokenIds(self.config["tokenizer"], [s["sample_id"] for s in self.samples])
        for name in fmt.ID_FIELDS:
            if name in self.payloads:
                ids.check_tensor(name, self.payloads[name])
        lengths, sample_ids = [s["response_length"] for s in self.samples], [s["sample_id"] for s in self.samples]
        pads, domains = FinitePadding(lengths, sample_ids), InDomain(lengths, sample_ids)
        for name in sorted(self.payloads):
            pads.check_tensor(name, self.payloads[name])
            domains.check_tensor(name, self.payloads[name])
        final = self.root if self.ranks is None else self.root / f"rank-{self.rank}"
        manifest_bytes = canonical_bytes(manifest)
        manifest_sha = sha256_bytes(manifest_bytes)
        complete = {"format": fmt.FORMAT, "bundle_id": self.bundle_id, "manifest_sha256": manifest_sha}
        return PreparedBundle(final, blob, manifest_bytes, pretty_bytes(complete), manifest_sha)

    def write(self, prepared: PreparedBundle) -> Path:
        """Stage the prepared files (``COMPLETE`` last), rename into place; return the bundle path."""
        final = prepared.final
        if final != (self.root if self.ranks is None else self.root / f"rank-{self.rank}"):
            raise IntegrityError("this bundle was prepared by another writer", where=final,
                                 hint="write a PreparedBundle with the writer whose prepare() made it")
        if final.exists():
            raise ArtifactExistsError("bundle directory already exists", where=final,
                                      hint="capture into a new directory")
        try:
            if not final.parent.is_dir():
                final.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        except OSError as exc:
            raise write_failure(exc, final.parent, "cannot create the bundle") from None
        try:
            try:
                dfd = os.open(tmp, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                raise write_failure(exc, tmp, "cannot open the staging directory") from None
            try:  # the files are created relative to the staging directory's descriptor, which is synced last
                if prepared.payload is not None:
                    _write_new(dfd, tmp, fmt.PAYLOAD_FILE, prepared.payload)
                _write_new(dfd, tmp, fmt.MANIFEST, prepared.manifest)
                _write_new(dfd, tmp, fmt.COMPLETE, prepared.complete)
                with contextlib.suppress(OSError):
                    os.fsync(dfd)  # every name in place and durable before the rename publishes them
            finally:
                os.close(dfd)
            point(f"bundle.staged/{final.name}")
            try:
                os.rename(tmp, final)
            except OSError:
                raise ArtifactExistsError("bundle directory appeared while writing", where=final) from None
            point(f"bundle.renamed/{final.name}")
            fsync_dir(final.parent)
        except BaseException:
            with contextlib.suppress(OSError):
                shutil.rmtree(tmp)
            raise
        if self.ranks is not None:
            self._land_rank(prepared.manifest_sha256)
        return self.root

    def landing_record(self, manifest_sha: str) -> dict[str, Any]:
        """``COMPLETE.<r>`` of this rank (:class:`replayjob.artifacts.bundle.RankComplete`)."""
        return {"format": fmt.FORMAT, "bundle_id": self.bundle_id, "rank": self.rank,
                "expected_ranks": self.ranks, "run_id": self.run_id, "manifest_sha256": manifest_sha}

    def _land_rank(self, manifest_sha: str) -> None:
        doc = self.landing_record(manifest_sha)
        atomic_write_bytes(self.root / f"{fmt.COMPLETE}.{self.rank}", pretty_bytes(doc), exclusive=True)
        try_finalize(self.root)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


def _write_new(dfd: int, staging: Path, name: str, data: bytes) -> None:
    """Create one file of a private staging directory (open as ``dfd``): exclusive create, write, one ``fsync``.

    No temporary name and no directory ``fsync`` per file: the staging directory is invisible to
    readers until it is renamed into place, and it is synced once, after its last file.
    """
    point(f"bundle.open/{name}")
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644, dir_fd=dfd)
    except OSError as exc:
        raise write_failure(exc, staging / name, "cannot create a bundle file") from None
    try:
        view, half = memoryview(data), len(data) // 2  # no copy of large payloads
        _write_all(fd, view[:half])
        point(f"bundle.half/{name}")  # a crash here leaves a partial file in staging
        _write_all(fd, view[half:])
        os.fsync(fd)
    except OSError as exc:
        raise write_failure(exc, staging / name, "cannot write a bundle file") from None
    finally:
        os.close(fd)
    point(f"bundle.synced/{name}")


def try_finalize(root: Path) -> bool:
    """Write the root ``COMPLETE`` once every expected rank has landed; True if it now exists."""
    landed: dict[int, RankComplete] = {}
    run_ids: dict[int, str | None] = {}
    expected: list[int] | None = None
    for p in sorted(root.glob(f"{fmt.COMPLETE}.*")):
        if p.name.startswith(".") or not p.name.split(".", 1)[1].isdigit():
            continue
        doc = read_json_object(p)
        if "run_id" not in doc:  # a rank written before format 2.2.0: nothing ties it to this run
            run_ids[int(p.name.split(".", 1)[1])] = None
            continue
        rec = decode(doc, RankComplete, where=p, hint="a rank landing record is written by the rank's BundleWriter; "
                                                      "capture into a new directory")
        landed[rec.rank] = rec
        run_ids[rec.rank] = rec.run_id
        expected = list(rec.expected_ranks)
    run_ids = dict(sorted(run_ids.items()))
    if len(set(run_ids.values())) > 1 or None in run_ids.values():  # before anything is final: refuse loudly
        raise IntegrityError(fmt.run_mix(run_ids), where=root,
                             hint="capture into a new directory; a directory reused after a failed run keeps the "
                                  "dead run's ranks")
    if expected is None or sorted(landed) != sorted(expected):
        return (root / fmt.COMPLETE).exists()
    first = next(iter(landed.values()))
    final = root_record(first.bundle_id, first.run_id, {r: landed[r].manifest_sha256 for r in sorted(landed)})
    with contextlib.suppress(ArtifactExistsError):
        atomic_write_bytes(root / fmt.COMPLETE, pretty_bytes(final), exclusive=True)
    return True


def root_record(bundle_id: str, run_id: str, manifests: dict[int, str]) -> dict[str, Any]:
    """The root ``COMPLETE`` of a multi-rank bundle whose ranks (rank -> manifest SHA-256) have all landed
    (:class:`replayjob.artifacts.bundle.RootComplete`)."""
    return {"format": fmt.FORMAT, "bundle_id": bundle_id, "run_id": run_id, "ranks": sorted(manifests),
            "rank_manifests": {str(r): manifests[r] for r in sorted(manifests)}}
