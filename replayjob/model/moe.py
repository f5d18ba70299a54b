"""Mixture-of-experts routing: the built-in tiny MoE model, routing observed per token, and routing forced.

A transformers MoE layer (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral) asks its router (``*TopKRouter``) for
``(router_logits, top-k weights, top-k expert indices)`` over the flattened ``[rows x length]`` tokens and
sends each token to those experts.  :class:`Routing` wraps every router of a built model:

* **observed** -- while the update runs a micro-batch (:meth:`Routing.micro_batch`, opened by
  :class:`replayjob.rl.update.Update`), each router's first call records, for every real token (attention
  mask nonzero) of every logical row, the experts used, their weights, and the router-logit margin (the
  k-th largest logit less the (k+1)-th: how far the token is from choosing another expert set).  Later
  calls in the same micro-batch (gradient-checkpointing recomputation) are not recorded again.  One
  update's records make one :class:`RoutingTable` (keyed like a trace: every row's tokens concatenated in
  logical row order, so micro-batching does not change the layout);
* **forced** (``model.routing = "forced"``) -- the router computes its logits and softmax as usual, but the
  expert indices of real tokens come from a recorded table (``optimizer_batch.routing_path``, pinned by
  ``optimizer_batch.routing_sha256``); the weights are the live probabilities gathered at those indices
  and normalised as the router does, so the gradient through the router is kept.  Padding tokens keep the
  router's own choice.  When the recorded indices are the router's own, every value is bitwise the free
  forward's (``torch.gather`` selects the same values ``torch.topk`` returns, and its backward scatters the
  same gradients).

The table is written as safetensors (:data:`SCHEMA`, through :mod:`replayjob.tensorfile`, never pickle):
``routing.safetensors`` beside a replay's ``replay_metrics.json`` (which pins it under ``routing``), or
``routing_step_<K>.safetensors`` beside a source run's ``metrics.json`` (``routing/steps``).

``REPLAYJOB_ROUTING_FAULT=SCALE`` (tests only, read when a model is built) makes each router *choose* its
experts from logits shifted by ``+SCALE`` on even and ``-SCALE`` on odd experts, while the weights are
still the unshifted probabilities: its only effect is to flip the expert set of the tokens whose margin is
below about ``2 * SCALE``.  It is recorded in the table's metadata (``fault``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from replayjob import tensorfile
from replayjob.config import Config
from replayjob.declaration import Digest, Document, OneLine, Printable, decode
from replayjob.digest import is_sha256_hex, normalize_digest, sha256_bytes
from replayjob.errors import ConfigError, ContractError, IntegrityError, RefusedError
from replayjob.fsio import atomic_write_bytes, read_regular_bytes
from replayjob.jsonio import loads_strict
from replayjob.model.tokenizer import ByteTokenizer

if TYPE_CHECKING:
    import torch

ROUTING_SCHEMA = "replayjob.routing/v1"
ROUTING_FILE = "routing.safetensors"
MAX_ROUTING_BYTES = 2 * 1024 ** 3  # one read: the pin is checked over the bytes the tables are built from
FAULT_ENV = "REPLAYJOB_ROUTING_FAULT"
_FIELDS = ("experts", "weights", "margin", "forced")
_METADATA = ("format", "layers", "top_k", "num_experts", "mode", "fault", "identity")
# router classes whose forward is reproduced under forcing -> whether the top-k weights are cast back to
# the logits' dtype (Mixtral keeps them in float32)
_FORCEABLE = {"Qwen3MoeTopKRouter": True, "Qwen2MoeTopKRouter": True, "OlmoeTopKRouter": True,
              "MixtralTopKRouter": False}
_HINT = "record the routing again (a replay of an MoE model writes routing.safetensors)"


def tiny_model(cfg: Config, attn: str) -> Any:
    """The built-in tiny Qwen3-MoE causal LM (random weights from the caller's seeded RNG): every decoder
    layer's MLP is a sparse MoE block of ``model.num_experts`` experts, top-``model.num_experts_per_tok``
    routing with normalised top-k weights (as Qwen3-MoE ships), no auxiliary loss."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok, mc = ByteTokenizer(), cfg.model
    qcfg = Qwen3MoeConfig(vocab_size=tok.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
                          num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads,
                          num_key_value_heads=mc.num_kv_heads,
                          max_position_embeddings=mc.max_position_embeddings, num_experts=mc.num_experts,
                          num_experts_per_tok=mc.num_experts_per_tok, moe_intermediate_size=mc.moe_intermediate_size,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                          router_aux_loss_coef=0.0, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id,
                          eos_token_id=tok.eos_id, tie_word_embeddings=False, attn_implementation=attn,
                          experts_implementation=mc.experts_implementation)  # type: ignore[call-arg]
    return Qwen3MoeForCausalLM(qcfg)


def routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The MoE routers of ``model`` by module name, in module order (top-k routers of transformers' MoE
    classes: a ``*TopKRouter`` with ``top_k``, ``num_experts`` and a ``weight``)."""
    return [(n, m) for n, m in model.named_modules()
            if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "num_experts")
            and hasattr(m, "weight")]


def set_experts_implementation(model: Any, name: str) -> None:
    """Switch a loaded model's experts kernel (``model.experts_implementation``); a model without experts
    accepts only the default."""
    if not routers(model):
        if name != "eager":
            raise ConfigError(f"the model has no MoE experts to run with {name!r}",
                              where="model.experts_implementation", hint="leave it at 'eager' for a dense model")
        return
    try:
        model.set_experts_implementation(name)
    except (ValueError, KeyError, ImportError) as exc:
        raise ConfigError(f"transformers cannot run this model's experts with {name!r}: {exc}",
                          where="model.experts_implementation", hint="use 'eager'") from None


def experts_implementation(model: Any) -> str | None:
    """The experts kernel the built model dispatches to (``None``: the model has no experts)."""
    if not routers(model):
        return None
    value = getattr(getattr(model, "config", None), "_experts_implementation", None)
    return value if isinstance(value, str) else None


# -------------------------------------------------------------------------------------------- the table

@dataclass(frozen=True)
class LayerRouting:
    """One router's record over every logical row's real tokens (``T`` tokens, top-``k``)."""

    name: str
    experts: torch.Tensor   # int64 [T, k]: the experts used, in the router's order
    weights: torch.Tensor   # float32 [T, k]: their weights
    margin: torch.Tensor    # float32 [T]: k-th largest router logit less the (k+1)-th (live router)
    forced: torch.Tensor    # bool [T]: the experts used are not the live router's top-k set

    def expert_sets(self) -> torch.Tensor:
        """The experts used per token, sorted (a set, comparable across tables)."""
        return self.experts.sort(dim=-1).values

    def weights_by_expert(self) -> torch.Tensor:
        """The weights in the order of :meth:`expert_sets` (each expert's weight, whatever the router's order)."""
        return self.weights.gather(-1, self.experts.argsort(dim=-1))


@dataclass(frozen=True)
class RoutingTable:
    """One update's routing: per router, per real token of every logical row."""

    row_tokens: torch.Tensor  # int64 [rows]
    layers: list[LayerRouting]
    top_k: int
    num_experts: int
    mode: str                 # "free" | "forced"
    fault: str | None
    identity: dict[str, str]  # logical_batch_sha256 (and the manifest's) of the rows it was recorded on

    @property
    def tokens(self) -> int:
        return int(self.row_tokens.sum())

    def row_of_token(self) -> torch.Tensor:
        """The logical row of each token position (int64 [T])."""
        import torch
        return torch.repeat_interleave(torch.arange(self.row_tokens.numel()), self.row_tokens)

    def encode(self) -> bytes:
        import torch
        tensors: dict[str, torch.Tensor] = {"rows.tokens": self.row_tokens.to(torch.int64).contiguous()}
        for k, lay in enumerate(self.layers):
            tensors[f"layer.{k:04d}.experts"] = lay.experts.to(torch.int64).contiguous()
            tensors[f"layer.{k:04d}.weights"] = lay.weights.to(torch.float32).contiguous()
            tensors[f"layer.{k:04d}.margin"] = lay.margin.to(torch.float32).contiguous()
            tensors[f"layer.{k:04d}.forced"] = lay.forced.to(torch.bool).contiguous()
        meta = {"format": ROUTING_SCHEMA, "layers": json.dumps([lay.name for lay in self.layers]),
                "top_k": str(self.top_k), "num_experts": str(self.num_experts), "mode": self.mode,
                "fault": self.fault or "", "identity": json.dumps(self.identity, sort_keys=True)}
        return tensorfile.encode(tensors, metadata=meta, schema=_schema(len(self.layers))).data


def _schema(n_layers: int) -> tensorfile.Schema:
    layer = r"layer\.[0-9]{4}\."
    return tensorfile.Schema(what="routing file", tensors={"rows.tokens": ("I64", 1)},
                             optional=((layer + "experts", "I64", 2), (layer + "weights", "F32", 2),
                                       (layer + "margin", "F32", 1), (layer + "forced", "BOOL", 1)),
                             max_header_bytes=16 * 1024 * 1024)


def write_table(path: Path, table: RoutingTable) -> str:
    """Write ``table`` to ``path`` atomically and exclusively; its SHA-256."""
    data = table.encode()
    atomic_write_bytes(path, data, exclusive=True)
    return sha256_bytes(data)


def _fail(where: Path, message: str) -> IntegrityError:
    return IntegrityError(f"routing file refused: {message}", where=where, hint=_HINT)


class RoutingIdentity(Document, frozen=True):
    """The rows a routing file was recorded on: the capture's logical batch, and for a replay its manifest."""

    logical_batch_sha256: Digest
    manifest_sha256: Digest | None = None


class RoutingMeta(Document, frozen=True):
    """A routing file's metadata, declared (``layers`` and ``identity`` are JSON inside the metadata strings; the
    router names and the fault are printed as they are, so they are printable)."""

    layers: Annotated[list[Printable], msgspec.Meta(min_length=1)]
    top_k: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    num_experts: Annotated[int, msgspec.Meta(ge=2, le=1 << 20)]
    mode: Literal["free", "forced"]
    fault: OneLine
    identity: RoutingIdentity

    def __post_init__(self) -> None:
        if self.top_k >= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be fewer than num_experts {self.num_experts}")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError("layers must be distinct router names")


_COUNT = re.compile(r"[1-9][0-9]{0,6}")


def _meta(meta: dict[str, str], p: Path) -> RoutingMeta:
    """The metadata strings as :class:`RoutingMeta` (JSON strictly parsed, counts in canonical decimal)."""
    if sorted(meta) != sorted(_METADATA) or meta.get("format") != ROUTING_SCHEMA:
        raise _fail(p, f"metadata must hold exactly {sorted(_METADATA)} with format {ROUTING_SCHEMA!r}")
    for key in ("top_k", "num_experts"):
        if not _COUNT.fullmatch(meta[key]):
            raise _fail(p, f"metadata {key} {meta[key][:40]!r} is not a count in decimal")
    try:
        obj = {"layers": loads_strict(meta["layers"], where=p), "top_k": int(meta["top_k"]),
               "num_experts": int(meta["num_experts"]), "mode": meta["mode"], "fault": meta["fault"],
               "identity": loads_strict(meta["identity"], where=p)}
    except IntegrityError as exc:
        raise _fail(p, f"metadata layers or identity is not strict JSON: {exc.message}") from None
    try:
        return decode(obj, RoutingMeta, where=p, hint=_HINT)
    except IntegrityError as exc:
        raise _fail(p, f"metadata {exc.message}") from None


def read_table(path: str | Path, expected_sha256: str | None, *, follow_symlinks: bool = False) -> RoutingTable:
    """Read and verify a routing file (pinned by ``expected_sha256`` when given): the safetensors checks,
    the exact tensors of :data:`ROUTING_SCHEMA`, every shape, expert indices in range and finite weights.
    ``follow_symlinks``: the file is one the user names (``optimizer_batch.routing_path``), not one inside an
    artifact."""
    import torch
    p = Path(path)
    if not p.is_file():
        raise RefusedError("no routing file here", where=p, hint=_HINT)
    data = read_regular_bytes(p, max_bytes=MAX_ROUTING_BYTES, follow_symlinks=follow_symlinks, what="routing file")
    header, tensors = tensorfile.load_bytes(data, where=p, expected_sha256=expected_sha256, schema=_schema(0))
    meta = _meta(header.metadata, p)
    names, top_k, n_exp = meta.layers, meta.top_k, meta.num_experts
    identity = {k: v for k, v in msgspec.structs.asdict(meta.identity).items() if v is not None}
    expected = {"rows.tokens"} | {f"layer.{k:04d}.{f}" for k in range(len(names)) for f in _FIELDS}
    if set(tensors) != expected:
        raise _fail(p, f"tensors do not match the {len(names)} layers the metadata names")
    rt = tensors["rows.tokens"]
    if bool((rt < 0).any()):
        raise _fail(p, "rows.tokens holds a negative count")
    t = sum(rt.tolist())  # in Python integers: a sum past 64 bits is never wrapped into a small count
    layers = []
    for k, name in enumerate(names):
        e, w, m, f = (tensors[f"layer.{k:04d}.{x}"] for x in _FIELDS)
        if tuple(e.shape) != (t, top_k) or tuple(w.shape) != (t, top_k) or tuple(m.shape) != (t,) \
                or tuple(f.shape) != (t,):
            raise _fail(p, f"layer {name!r} does not hold {t} tokens x top-{top_k}")
        if t and (int(e.min()) < 0 or int(e.max()) >= n_exp):
            raise _fail(p, f"layer {name!r} names an expert outside [0, {n_exp})")
        if t and bool((e.sort(dim=-1).values[:, 1:] == e.sort(dim=-1).values[:, :-1]).any()):
            raise _fail(p, f"layer {name!r} routes a token to one expert twice")
        if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
            raise _fail(p, f"layer {name!r} holds a negative or non-finite weight")
        if not bool(torch.isfinite(m).all()) or bool((m < 0).any()):
            # the k-th largest logit less the (k+1)-th: >= 0 and finite wherever the weights are
            raise _fail(p, f"layer {name!r} holds a negative or non-finite router-logit margin")
        if meta.mode == "free" and bool(f.any()):
            raise _fail(p, f"layer {name!r} marks forced tokens in a file of free routing")
        layers.append(LayerRouting(name, e, w, m, f))
    return RoutingTable(rt, layers, top_k, n_exp, meta.mode, meta.fault or None, identity)


def compare(a: RoutingTable, b: RoutingTable) -> dict[str, Any]:
    """Routing agreement of two tables of the same rows: per layer the tokens whose expert *set* differs (a
    routing flip), their share, the first flipped token (logical row, token within the row) with both sides'
    router-logit margins there, and the largest weight difference over the tokens that did not flip; the first
    flip over all layers (layers in model order, tokens in logical order).  Refused unless both tables route the
    same rows through the same routers."""
    import torch
    if not torch.equal(a.row_tokens, b.row_tokens):
        raise ContractError("the routing tables hold different rows", hint="compare routing of one capture")
    if [lay.name for lay in a.layers] != [lay.name for lay in b.layers] or a.top_k != b.top_k \
            or a.num_experts != b.num_experts:
        raise ContractError("the routing tables route different layers or top-k", hint="compare one model's routing")
    row = a.row_of_token()
    starts = torch.cumsum(a.row_tokens, 0) - a.row_tokens
    layers, first = [], None
    for la, lb in zip(a.layers, b.layers, strict=True):
        flipped = (la.expert_sets() != lb.expert_sets()).any(dim=-1)
        n = int(flipped.sum())
        kept = ~flipped
        wa, wb = la.weights_by_expert()[kept].double(), lb.weights_by_expert()[kept].double()
        wdiff = float((wa - wb).abs().max()) if bool(kept.any()) else 0.0
        rec: dict[str, Any] = {"layer": la.name, "tokens": a.tokens, "flipped": n,
                               "share": n / a.tokens if a.tokens else 0.0, "weights_max_abs_unflipped": wdiff,
                               "first": None}
        if n:
            t = int(flipped.nonzero()[0, 0])
            r = int(row[t])
            rec["first"] = {"row": r, "token": t - int(starts[r]), "position": t,
                            "experts_a": la.experts[t].tolist(), "experts_b": lb.experts[t].tolist(),
                            "margin_a": float(la.margin[t]), "margin_b": float(lb.margin[t])}
            if first is None:
                first = {"layer": la.name, **rec["first"]}
        layers.append(rec)
    total = sum(rec["flipped"] for rec in layers)
    return {"layers": layers, "flipped": total, "identical": total == 0 and all(
        rec["weights_max_abs_unflipped"] == 0 for rec in layers),
            "first_flip": first, "mode_a": a.mode, "mode_b": b.mode, "fault_a": a.fault, "fault_b": b.fault}


def forced_file_reasons(cfg: Config, logical_sha256: str | None, row_tokens: list[int] | None,
                        rows: int | None, tokens: int | None) -> list[str]:
    """Why a built-in replay's forced routing file cannot be used, checked before any model is built (``explain`` and
    a replay's admission): :func:`file_reasons`, with, for the built-in MoE model, its routers (one per decoder layer,
    top-``num_experts_per_tok`` of ``num_experts``).  Empty: admitted (or the routing is free)."""
    if cfg.model.routing != "forced":
        return []
    mc = cfg.model
    shape = (mc.num_layers, mc.num_experts_per_tok, mc.num_experts) if not mc.path and mc.architecture == "qwen3_moe" \
        else None
    return file_reasons(cfg.optimizer_batch, logical_sha256, row_tokens, rows, tokens, shape)


def file_reasons(ob: Any, logical_sha256: str | None, row_tokens: list[int] | None, rows: int | None,
                 tokens: int | None, shape: tuple[int, int, int] | None) -> list[str]:
    """Why a forced routing file cannot be used (any producer's replay under ``model.routing = "forced"``; ``ob``: its
    ``[optimizer_batch]``): both settings given, the file present and pinned (its SHA-256), its rows recorded on the
    replay's logical batch, its shape that of the captured rows (``row_tokens`` per row when the rows are held, else
    the ``rows`` and ``tokens`` counts) and, when ``shape`` is known, of the model's routers (MoE layers, top-k,
    experts).  Empty: admitted."""
    if not ob.routing_path or not ob.routing_sha256:
        return ["model.routing = 'forced' needs optimizer_batch.routing_path and its routing_sha256 (a routing file "
                "recorded on this capture: the source run's routing_step_<K>.safetensors or a replay's "
                "routing.safetensors, and its pin from metrics.json or replay_metrics.json)"]
    try:
        table = read_table(ob.routing_path, normalize_digest(ob.routing_sha256, what="optimizer_batch.routing_sha256"),
                           follow_symlinks=True)
    except RefusedError as exc:
        return [f"forced routing: {exc.diagnostics()}".replace("\n  fix:", "; fix:")]
    out = []
    recorded = table.identity.get("logical_batch_sha256")
    if logical_sha256 is not None and recorded != logical_sha256:
        out.append(f"the forced routing file {ob.routing_path} was recorded on logical batch {recorded}, this "
                   f"replay's is {logical_sha256}: force routing recorded on this capture's rows")
    have = [int(n) for n in table.row_tokens.tolist()]
    if row_tokens is not None and have != row_tokens:
        out.append(f"the forced routing file {ob.routing_path} holds {len(have)} rows of {sum(have)} tokens that are "
                   f"not the captured rows' {len(row_tokens)} rows of {sum(row_tokens)} tokens")
    elif row_tokens is None and rows is not None and tokens is not None and (len(have), sum(have)) != (rows, tokens):
        out.append(f"the forced routing file {ob.routing_path} holds {len(have)} rows of {sum(have)} tokens, the "
                   f"capture {rows} rows of {tokens} tokens")
    if shape is not None and (len(table.layers), table.top_k, table.num_experts) != shape:
        out.append(f"the forced routing file {ob.routing_path} routes {len(table.layers)} layers top-{table.top_k} "
                   f"of {table.num_experts} experts; this model has {shape[0]} MoE layers, top-{shape[1]} of "
                   f"{shape[2]}")
    return out


# the model types whose routers config_routers counts (their expert count is saved as num_experts or
# num_local_experts, depending on the transformers version)
_CONFIG_TYPES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral")


def config_routers(doc: dict[str, Any]) -> tuple[int, int, int] | None:
    """The routers a transformers MoE model's ``config.json`` builds: (MoE layers, top-k, experts), for the model
    types whose routing can be forced (Qwen3-MoE and Qwen2-MoE: the layers not in ``mlp_only_layers`` whose index + 1
    is a multiple of ``decoder_sparse_step``; OLMoE, Mixtral: every layer); ``None`` for any other config."""
    def count(key: str) -> int | None:
        v = doc.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    n, k = count("num_hidden_layers"), count("num_experts_per_tok")
    e = count("num_experts") if count("num_experts") is not None else count("num_local_experts")
    if doc.get("model_type") not in _CONFIG_TYPES or n is None or k is None or e is None:
        return None
    if doc.get("model_type") in ("qwen3_moe", "qwen2_moe"):
        step, dense = doc.get("decoder_sparse_step", 1), doc.get("mlp_only_layers") or []
        if not isinstance(step, int) or step < 1 or not isinstance(dense, list):
            return None
        n = sum(1 for i in range(n) if i not in dense and e > 0 and (i + 1) % step == 0)
    return n, k, e


def forced_table(ob: Any, logical_sha256: str | None) -> RoutingTable:
    """The routing a replay forces (``ob``: its ``[optimizer_batch]``): ``routing_path`` read and verified against
    ``routing_sha256`` (both required) and recorded on the replay's logical batch (``logical_sha256``, when given)."""
    if not ob.routing_path or not ob.routing_sha256:
        raise ConfigError("model.routing = 'forced' needs optimizer_batch.routing_path and its routing_sha256",
                          where="optimizer_batch.routing_path",
                          hint="point it at a routing file recorded on this capture (the source run's "
                               "routing_step_<K>.safetensors or a replay's routing.safetensors) with its pin")
    table = read_table(ob.routing_path, normalize_digest(ob.routing_sha256, what="optimizer_batch.routing_sha256"),
                       follow_symlinks=True)
    recorded = table.identity.get("logical_batch_sha256")
    if logical_sha256 and recorded != logical_sha256:
        raise ContractError(f"the routing file was recorded on logical batch {recorded}, this replay pins "
                            f"{logical_sha256}", where=ob.routing_path,
                            hint="force routing recorded on this capture's rows")
    return table


def block_of(router_name: str) -> str:
    """The MoE block a router belongs to (its parent module: ``...layers.N.mlp`` for ``...layers.N.mlp.gate``)."""
    return router_name.rsplit(".", 1)[0]


def evidence_entry(doc: dict[str, Any] | None, where: Path) -> tuple[Path, str] | None:
    """The routing file and SHA-256 a ``routing`` entry of replay_metrics.json pins (``None``: no entry)."""
    if doc is None:
        return None
    if not isinstance(doc, dict) or set(doc) != {"path", "sha256"} or doc["path"] != ROUTING_FILE \
            or not is_sha256_hex(doc["sha256"]):
        raise IntegrityError(f"field 'routing' must be {{\"path\": {ROUTING_FILE!r}, \"sha256\": <SHA-256>}}",
                             where=where, hint="rerun the replay")
    return where.parent / ROUTING_FILE, doc["sha256"]


def check_replay_table(table: RoutingTable, where: Path, *, logical: str, manifest: str, mode: Any) -> RoutingTable:
    """``table`` is the routing of the replay whose replay_metrics.json (``where``) pins it: recorded on that
    replay's logical batch and manifest, and in the routing mode its runtime records (``mode``: ``model.routing``
    as the routers ran, when recorded).  A replay's own file, re-pinned from another capture or another mode, would
    put another run's routing in its place."""
    said = [("identity.logical_batch_sha256", table.identity.get("logical_batch_sha256"), logical),
            ("identity.manifest_sha256", table.identity.get("manifest_sha256"), manifest)]
    if mode is not None:
        said.append(("mode", table.mode, mode))
    for what, mine, theirs in said:
        if mine != theirs:
            raise IntegrityError(f"the routing file is not this replay's: its {what} is {mine!r}, the replay records "
                                 f"{theirs!r}", where=where.parent / ROUTING_FILE,
                                 hint="a replay's routing file is written by that replay; rerun the replay")
    return table


# ---------------------------------------------------------------------------------------- the controller

@dataclass
class _MicroBatch:
    rows: tuple[int, ...]
    mask: torch.Tensor        # bool [B, L] on the CPU
    real: torch.Tensor        # bool [B * L] on the model's device
    index: torch.Tensor       # int64: the positions of ``real`` (the real tokens in row order)
    counts: list[int]         # real tokens per row
    seen: set[int]
    forced: dict[int, torch.Tensor]  # router index -> int64 [real tokens, k] on the device
    sampler_side: bool = False  # a recompute of the sampler's forward: observed, never perturbed by the fault


class Routing:
    """Every router of one built model, observed (and forced, under ``model.routing = "forced"``); see the
    module docstring."""

    def __init__(self, model: torch.nn.Module, found: list[tuple[str, torch.nn.Module]], mode: str,
                 table: RoutingTable | None, fault: float | None):
        self.names = [n for n, _ in found]
        self.modules: list[Any] = [m for _, m in found]
        self.top_k = int(self.modules[0].top_k)
        self.num_experts = int(self.modules[0].num_experts)
        self.mode, self.table, self.fault = mode, table, fault
        self._mb: _MicroBatch | None = None
        # router index -> one (rows, tokens per row, (experts, weights, margin, forced)) per micro-batch
        self._records: dict[int, list[tuple[tuple[int, ...], list[int], tuple[torch.Tensor, ...]]]] = {}
        self.first: RoutingTable | None = None  # the first complete update's routing (a replay's evidence)
        self.last: RoutingTable | None = None   # the latest complete update's (a source step's)
        self._row_offsets: list[int] = []
        if table is not None:
            self._check_table(table)
            self._row_offsets = [0, *table.row_tokens.cumsum(0).tolist()]
        for i, m in enumerate(self.modules):
            if mode == "forced" or fault is not None:
                m.forward = types.MethodType(lambda mod, hs, i=i: self._routed(i, mod, hs), m)
            else:
                m.register_forward_hook(lambda _m, _a, out, i=i: self._observed(i, out))

    def _check_table(self, table: RoutingTable) -> None:
        if table.top_k != self.top_k or table.num_experts != self.num_experts or \
                [lay.name for lay in table.layers] != self.names:
            raise ContractError(f"the routing file routes {len(table.layers)} layers top-{table.top_k} of "
                                f"{table.num_experts} experts; this model has {len(self.names)} routers, top-"
                                f"{self.top_k} of {self.num_experts}", where="optimizer_batch.routing_path",
                                hint="force routing recorded on this model and capture")

    @contextlib.contextmanager
    def forcing(self, table: RoutingTable) -> Iterator[None]:
        """Force ``table``'s experts for the updates run inside (as ``model.routing = "forced"`` does for a whole
        replay): the routers' forwards are swapped for the forcing one and restored afterwards."""
        unknown = sorted({type(m).__name__ for m in self.modules} - set(_FORCEABLE))
        if unknown:
            raise ConfigError(f"routing of {unknown[0]} cannot be forced (known routers: "
                              f"{', '.join(sorted(_FORCEABLE))})", where="model.routing", hint="leave routing free")
        self._check_table(table)
        saved = (self.mode, self.table, self._row_offsets)
        swapped = [m for m in self.modules if "forward" not in vars(m)]  # observed by a hook: swap its forward
        for i, m in enumerate(self.modules):
            if m in swapped:
                m.forward = types.MethodType(lambda mod, hs, i=i: self._routed(i, mod, hs), m)
        self.mode, self.table, self._row_offsets = "forced", table, [0, *table.row_tokens.cumsum(0).tolist()]
        try:
            yield
        finally:
            self.mode, self.table, self._row_offsets = saved
            for m in swapped:
                del m.forward

    # -- the update's micro-batches ------------------------------------------------------------------
    def begin_update(self) -> None:
        self._records = {i: [] for i in range(len(self.modules))}

    def end_update(self) -> None:
        """Close one update: its records become :attr:`last` (and :attr:`first`, the first time)."""
        import torch
        records0 = self._records.get(0, [])
        flat = [r for mb_rows, _, _ in records0 for r in mb_rows]
        if flat and flat == list(range(len(flat))) and all(  # micro-batches of consecutive rows, in order
                [rec[0] for rec in records] == [rec[0] for rec in records0] for records in self._records.values()):
            self._close(torch.tensor([n for _, per_row, _ in records0 for n in per_row], dtype=torch.int64),
                        [LayerRouting(name, *(torch.cat([rec[2][f] for rec in self._records[i]]) for f in range(4)))
                         for i, name in enumerate(self.names)])
            return
        by_layer: list[dict[int, tuple[torch.Tensor, ...]]] = []
        for records in self._records.values():
            rows: dict[int, tuple[torch.Tensor, ...]] = {}
            for mb_rows, per_row, parts in records:
                pieces = [p.split(per_row) for p in parts]
                for j, r in enumerate(mb_rows):
                    rows[r] = tuple(pc[j] for pc in pieces)
            by_layer.append(rows)
        order = sorted(by_layer[0]) if by_layer else []
        if not order or order != list(range(len(order))) or any(sorted(r) != order for r in by_layer):
            return  # not every row seen by every router (e.g. several ranks): no table
        counts = torch.tensor([int(by_layer[0][r][0].shape[0]) for r in order], dtype=torch.int64)
        self._close(counts, [LayerRouting(name, *(torch.cat([rows[r][f] for r in order]) for f in range(4)))
                             for name, rows in zip(self.names, by_layer, strict=True)])

    def _close(self, counts: torch.Tensor, layers: list[LayerRouting]) -> None:
        self.last = RoutingTable(counts, layers, self.top_k, self.num_experts, self.mode,
                                 None if self.fault is None else repr(self.fault), {})
        if self.first is None:
            self.first = self.last

    @contextlib.contextmanager
    def micro_batch(self, rows: list[int] | tuple[int, ...], attention_mask: torch.Tensor, *,
                    sampler_side: bool = False) -> Iterator[None]:
        """Route (and record) the forward and backward of one micro-batch of logical ``rows``.  ``sampler_side``:
        the forward recomputes the sampler's (``replayjob mismatch``), which the test-only fault never perturbs:
        the fault stands for a trainer whose router differs from the sampler's."""
        mask = attention_mask.detach().to("cpu") != 0
        device = self.modules[0].weight.device
        real = mask.reshape(-1).to(device)
        self._mb = _MicroBatch(tuple(rows), mask, real, real.nonzero().squeeze(-1), mask.sum(dim=1).tolist(), set(), {},
                               sampler_side)
        if self.table is not None:
            for j, r in enumerate(rows):
                have = int(self.table.row_tokens[r]) if r < self.table.row_tokens.numel() else -1
                if have != int(mask[j].sum()):
                    raise ContractError(f"the forced routing holds {have} tokens for logical row {r}, the "
                                        f"replay's row has {int(mask[j].sum())}", where="optimizer_batch.routing_path",
                                        hint="force routing recorded on this capture's rows")
        try:
            yield
        finally:
            self._mb = None

    # -- the routers ---------------------------------------------------------------------------------
    def _observed(self, i: int, output: Any) -> None:
        mb = self._mb
        if mb is None or i in mb.seen:
            return
        mb.seen.add(i)
        if not (isinstance(output, tuple) and len(output) == 3):
            raise ContractError(f"router {self.names[i]} ({type(self.modules[i]).__name__}) does not return "
                                "(logits, top-k weights, top-k experts): its routing cannot be recorded",
                                hint="use a transformers MoE class with a *TopKRouter (Qwen3-MoE, Mixtral, OLMoE)")
        logits, weights, experts = output
        self._keep(i, mb, logits, weights, experts, None)

    def _keep(self, i: int, mb: _MicroBatch, logits: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
              live: torch.Tensor | None) -> None:
        """Keep the micro-batch's real tokens of one router's call (split by row when the update ends)."""
        import torch
        with torch.no_grad():
            idx = mb.index
            top = torch.topk(logits.detach().index_select(0, idx).float(), self.top_k + 1, dim=-1).values
            margin = top[:, self.top_k - 1] - top[:, self.top_k]
            used = experts.detach().index_select(0, idx)
            if live is None:
                forced = torch.zeros(used.shape[0], dtype=torch.bool, device=used.device)
            else:
                forced = (used.sort(dim=-1).values != live.index_select(0, idx).sort(dim=-1).values).any(dim=-1)
            parts = (used.to("cpu", torch.int64), weights.detach().index_select(0, idx).to("cpu", torch.float32),
                     margin.to("cpu"), forced.to("cpu"))
        self._records[i].append((mb.rows, mb.counts, parts))

    def _forced_indices(self, i: int, mb: _MicroBatch) -> torch.Tensor:
        import torch
        got = mb.forced.get(i)
        if got is None:
            assert self.table is not None
            lay = self.table.layers[i]
            got = torch.cat([lay.experts[self._row_offsets[r]:self._row_offsets[r + 1]] for r in mb.rows])
            got = mb.forced[i] = got.to(mb.real.device)
        return got

    def _routed(self, i: int, router: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The router's forward with the expert choice replaced (forced routing, or the test-only fault)."""
        import torch
        import torch.nn.functional as F
        hs = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(hs, router.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        live = torch.topk(probs.detach(), self.top_k, dim=-1).indices
        mb = self._mb
        if self.fault is not None and mb is not None and not mb.sampler_side:  # real tokens choose from shifted
            # logits (tests only)
            shift = torch.tensor([self.fault if e % 2 == 0 else -self.fault for e in range(self.num_experts)],
                                 dtype=logits.dtype, device=logits.device)
            shifted = torch.topk(torch.softmax(logits.detach() + shift, dtype=torch.float, dim=-1), self.top_k,
                                 dim=-1).indices
            live = torch.where(mb.real.unsqueeze(-1), shifted, live)
        experts = live
        if self.mode == "forced" and mb is not None:
            experts = live.clone()
            experts[mb.real] = self._forced_indices(i, mb)
        weights = probs.gather(-1, experts)
        if getattr(router, "norm_topk_prob", True):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if _FORCEABLE[type(router).__name__]:
            weights = weights.to(logits.dtype)
        if mb is not None and i not in mb.seen:
            mb.seen.add(i)
            self._keep(i, mb, logits, weights, experts, live if self.mode == "forced" else None)
        return logits, weights, experts


def _fault() -> float | None:
    raw = os.environ.get(FAULT_ENV, "")
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{FAULT_ENV}={raw!r} is not a positive number", where=FAULT_ENV, hint="unset it")
    return value


_ATTACHED: weakref.WeakKeyDictionary[Any, Routing] = weakref.WeakKeyDictionary()


def attached(model: Any) -> Routing | None:
    """The :class:`Routing` :func:`attach` put on ``model`` (``None``: not an MoE model)."""
    try:
        return _ATTACHED.get(model)
    except TypeError:  # not weakly referenceable: never attached
        return None


def observe(model: Any, forced: RoutingTable | None = None) -> Routing | None:
    """The routing observer of any built model with routers (an external trainer's replay, TRL's): the one
    already attached, else a new one routing freely (the test-only fault honoured), or forcing ``forced``'s experts
    (``model.routing = "forced"`` in an external trainer's replay); ``None``: no router."""
    got = attached(model)
    if got is not None:
        if forced is not None and got.table is not forced:
            raise ContractError("this model's routers are attached already; forcing needs a freshly built model",
                                where="model.routing", hint="build the model again for a forced replay")
        return got
    found = routers(model)
    if not found:
        if forced is not None:
            raise ConfigError("model.routing = 'forced' needs a mixture-of-experts model; this one has no router",
                              where="model.routing", hint="leave routing free for a dense model")
        return None
    fault = _fault()
    unknown = sorted({type(m).__name__ for _, m in found} - set(_FORCEABLE))
    if (fault is not None or forced is not None) and unknown:
        where = "model.routing" if forced is not None else FAULT_ENV
        raise ConfigError(f"routing of {unknown[0]} cannot be {'forced' if forced is not None else 'perturbed'} "
                          f"(known routers: {', '.join(sorted(_FORCEABLE))})", where=where,
                          hint="leave routing free" if forced is not None else "unset it")
    routing = _ATTACHED[model] = Routing(model, found, "free" if forced is None else "forced", forced, fault)
    return routing


def record(model: Any) -> Routing | None:
    """A routing observer of a source run's model (an external trainer's captured step): the one already attached, else
    a new one routing freely that only records (the test-only fault never perturbs a source); ``None``: no router."""
    got = attached(model)
    if got is not None:
        return got
    found = routers(model)
    if not found:
        return None
    routing = _ATTACHED[model] = Routing(model, found, "free", None, None)
    return routing


def replay_evidence(model: Any, out: Path, identity: dict[str, str]) -> dict[str, str] | None:
    """Write the first update's routing of ``model`` to ``OUT/routing.safetensors`` (``identity``: the
    capture's digests it was recorded on); the ``routing`` entry of replay_metrics.json that pins it, or
    ``None`` when the model has no router or no complete update was recorded (several ranks)."""
    routing = attached(model)
    if routing is None or routing.first is None:
        return None
    sha = write_table(out / ROUTING_FILE, dataclasses.replace(routing.first, identity=dict(identity)))
    return {"path": ROUTING_FILE, "sha256": sha}


def source_step_file(step: int) -> str:
    """A source run's routing file for step ``step`` (beside its metrics.json)."""
    return f"routing_step_{step:06d}.safetensors"


def attach(model: torch.nn.Module, cfg: Config) -> Routing | None:
    """The :class:`Routing` of a built model (``None`` when it has no router); under ``model.routing =
    "forced"`` the pinned routing file is read and verified first."""
    found = routers(model)
    mode = cfg.model.routing
    if not found:
        if cfg.model.router_aux_loss_coef:
            raise ConfigError("a router loss needs a mixture-of-experts model; this one has no router",
                              where="model.router_aux_loss_coef", hint="set it to 0 for a dense model")
        if mode == "forced":
            raise ConfigError("model.routing = 'forced' needs a mixture-of-experts model; this one has no router",
                              where="model.routing", hint="set model.architecture = 'qwen3_moe' or leave routing free")
        return None
    unknown = sorted({type(m).__name__ for _, m in found} - set(_FORCEABLE))
    fault = _fault()
    if (mode == "forced" or fault is not None) and unknown:
        raise ConfigError(f"routing of {unknown[0]} cannot be forced (known routers: {', '.join(sorted(_FORCEABLE))})",
                          where="model.routing", hint="leave model.routing = 'free'")
    table = None
    if mode == "forced":
        if cfg.training.trainer != "optimizer_replay":
            raise ConfigError("forced routing applies to replays; a source run routes freely", where="model.routing",
                              hint="set model.routing = 'free' in the source config")
        table = forced_table(cfg.optimizer_batch, cfg.optimizer_batch.expected_logical_sha256.strip().lower())
    routing = _ATTACHED[model] = Routing(model, found, mode, table, fault)
    return routing
