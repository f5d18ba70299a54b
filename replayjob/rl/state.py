"""Resume states and checkpoints: adapter, optimizer state, RNG states and the step counter.

Layout of a state directory::

    trainer_state.json          {"schema": ..., "step": S, "model": {...}, "files": {name: sha256}}
    adapter_model.safetensors   adapter weights (peft naming)
    adapter_config.json
    optimizer.safetensors       AdamW moments and step per parameter (checkpoints only)
    rng.safetensors             Torch CPU and CUDA RNG states (checkpoints only)

``step`` is the last completed step; ``-1`` is an initialisation state (nothing trained yet).
Every file listed in ``files`` is verified by SHA-256 before it is used; nothing is pickled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from replayjob import tensorfile
from replayjob.digest import normalize_digest, sha256_bytes, sha256_file
from replayjob.errors import ContractError, IntegrityError, RefusedError
from replayjob.fsio import atomic_write_bytes
from replayjob.jsonio import pretty_bytes, read_json_object

STATE_SCHEMA = "replayjob.trainer_state/v1"
STATE_FILE = "trainer_state.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"


@dataclass(frozen=True)
class ResumeState:
    path: Path
    step: int
    model: dict[str, Any]
    adapter_file: Path
    adapter_sha256: str
    files: dict[str, str]

    @property
    def has_optimizer(self) -> bool:
        return OPTIMIZER_FILE in self.files

    @property
    def has_rng(self) -> bool:
        return RNG_FILE in self.files


def read_state(path: str | Path) -> ResumeState:
    """Read and verify a resume state directory, or refuse naming what is wrong."""
    d = Path(path)
    if not d.is_dir():
        raise RefusedError("resume state is not a directory", where=d,
                           hint="run `replayjob init DIR` and point resume.from at DIR/init_resume")
    doc = read_json_object(d / STATE_FILE)
    if doc.get("schema") != STATE_SCHEMA:
        raise IntegrityError(f"unknown trainer state schema {doc.get('schema')!r}", where=d / STATE_FILE)
    step = doc.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < -1:
        raise IntegrityError(f"'step' must be an integer >= -1, found {step!r}", where=d / STATE_FILE)
    files = doc.get("files")
    model = doc.get("model")
    if not isinstance(files, dict) or ADAPTER_WEIGHTS not in files or not isinstance(model, dict):
        raise IntegrityError("'files' must list adapter_model.safetensors and 'model' must be an object",
                             where=d / STATE_FILE)
    for name, digest in sorted(files.items()):
        if "/" in name or "\\" in name or name.startswith(".") or not isinstance(digest, str):
            raise IntegrityError(f"bad file entry {name!r}", where=d / STATE_FILE)
        if not name.endswith(".safetensors"):
            raise IntegrityError(f"file entry {name!r} is not a .safetensors file; pickle is never loaded",
                                 where=d / STATE_FILE, hint="resume states hold safetensors files only")
        if normalize_digest(digest, what=f"the pin of {name}") != digest:
            raise IntegrityError(f"the pin of {name} is not a lowercase hex SHA-256", where=d / STATE_FILE)
        f = d / name
        if f.is_symlink() or not f.is_file():
            raise IntegrityError(f"{name} is missing or not a regular file", where=d)
        actual = sha256_file(f)
        if actual != digest:
            raise IntegrityError(f"{name} has SHA-256 {actual}, trainer_state.json pins {digest}",
                                 where=d, hint="the state was modified after it was written; recreate it")
        tensorfile.read_header(f, follow_symlinks=False)  # structure checked before anything loads it
    return ResumeState(d, step, model, d / ADAPTER_WEIGHTS, files[ADAPTER_WEIGHTS], dict(files))


def write_state(d: Path, step: int, model_ref: dict[str, Any], extra_files: dict[str, bytes],
                adapter_sha256: str | None = None) -> dict[str, str]:
    """Write extra files, hash everything present, then ``trainer_state.json`` last; return the pinned
    digests.  ``adapter_sha256``: the digest of the adapter file's bytes when the caller already holds
    them (it wrote them), so the file is not read back."""
    files = {ADAPTER_WEIGHTS: adapter_sha256 or sha256_file(d / ADAPTER_WEIGHTS)}
    for name, data in extra_files.items():
        atomic_write_bytes(d / name, data)
        files[name] = sha256_bytes(data)  # the bytes just written, not read back
    files = dict(sorted(files.items()))
    doc = {"schema": STATE_SCHEMA, "step": step, "model": model_ref, "files": files}
    atomic_write_bytes(d / STATE_FILE, pretty_bytes(doc))
    return files


def check_model(state: ResumeState, model_ref: dict[str, Any]) -> None:
    if state.model != model_ref:
        raise ContractError(f"resume state was made for model {state.model}, this config builds {model_ref}",
                            where=state.path / STATE_FILE, hint="use the [model] section the state was made with")


def adapter_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """The adapter weight file's bytes (``adapter_model.safetensors``): one serialisation for every
    writer, so a captured adapter and a saved one with equal tensors have equal SHA-256."""
    from safetensors.torch import save

    return bytes(save({k: tensors[k] for k in sorted(tensors)}, metadata={"format": "pt"}))


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as ``"{index}.{name}"`` CPU tensors (views of the live state)."""
    tensors: dict[str, torch.Tensor] = {}
    params = [p for group in opt.param_groups for p in group["params"]]  # state_dict()'s index order
    for idx, p in enumerate(params):
        for k, v in opt.state.get(p, {}).items():
            t = v if torch.is_tensor(v) else torch.tensor(v)
            tensors[f"{idx}.{k}"] = t.detach().to("cpu").contiguous()
    return tensors


def optimizer_bytes_of(tensors: dict[str, torch.Tensor]) -> bytes:
    """``optimizer.safetensors`` bytes of :func:`optimizer_tensors`' result."""
    from safetensors.torch import save

    return bytes(save(tensors, metadata={"format": "replayjob-optimizer"}))


def optimizer_bytes(opt: torch.optim.Optimizer) -> bytes:
    return optimizer_bytes_of(optimizer_tensors(opt))


def load_optimizer(opt: torch.optim.Optimizer, path: Path, expected_sha256: str) -> None:
    """Load optimizer state from ``path``; the bytes loaded are the bytes checked against the pin."""
    flat = tensorfile.load(path, expected_sha256=expected_sha256, follow_symlinks=False)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        idx, _, name = key.partition(".")
        state.setdefault(int(idx), {})[name] = t
    sd = opt.state_dict()
    if set(state) - set(range(len(sd["param_groups"][0]["params"]))):
        raise ContractError("optimizer state does not match the adapter parameters", where=path)
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def rng_tensors(prefix: str = "") -> dict[str, torch.Tensor]:
    """Torch CPU and per-device CUDA RNG states, keyed ``{prefix}cpu`` / ``{prefix}cuda.N``."""
    out = {f"{prefix}cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            out[f"{prefix}cuda.{i}"] = torch.cuda.get_rng_state(i)
    return out


def rng_bytes() -> bytes:
    from safetensors.torch import save

    return bytes(save(rng_tensors(), metadata={"format": "replayjob-rng"}))


def restore_rng(tensors: dict[str, torch.Tensor], prefix: str = "") -> None:
    torch.set_rng_state(tensors[f"{prefix}cpu"])
    for key, t in tensors.items():
        if key.startswith(f"{prefix}cuda."):
            idx = int(key.rsplit(".", 1)[1])
            if idx >= torch.cuda.device_count():
                raise ContractError(f"captured RNG for CUDA device {idx}, but only "
                                    f"{torch.cuda.device_count()} are visible")
            torch.cuda.set_rng_state(t, idx)


def load_rng(path: Path, expected_sha256: str) -> None:
    """Restore the RNG states in ``path``; the bytes loaded are the bytes checked against the pin."""
    restore_rng(tensorfile.load(path, expected_sha256=expected_sha256, follow_symlinks=False))
