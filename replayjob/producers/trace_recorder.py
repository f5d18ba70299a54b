"""Recording a trace while one update runs: module hooks attached only at replay with tracing on.

:class:`Recorder` wraps a producer's update from outside (the replay driver attaches it around
:func:`replayjob.producers.driver.update`), so the update itself is unchanged and costs nothing
extra when tracing is off.  It works from the session's plan (each micro-batch's logical rows, the
``input_ids`` its root module receives and the producer's token mask), so every producer's rows are
keyed the same way.  While attached:

* a forward pre-hook on the root model starts each micro-batch and checks that its ``input_ids``
  are exactly the next micro-batch of the captured rows (so rows are mapped to their logical index);
* a forward hook on every module records the first tensor of its output whose leading dimensions
  are ``[rows, padded length]`` (others are listed as untraced), in the order outputs are produced
  (a module called twice in one forward gets ``NAME#1`` for its second call); once the root has
  returned, later calls (gradient-checkpointing recomputation in backward) are not recorded again;
* a tensor hook on each recorded output that requires grad records the gradient of that output, in
  the order backward produces them (with reentrant checkpointing the hook goes on the recomputed
  output, the one backward differentiates);
* a post-accumulate-grad hook on each trainable parameter keeps its gradient before clipping, and
  optimizer step hooks take the update ``after - before``.

After each micro-batch only each row's real tokens (where the producer's token mask is nonzero) are
kept (on the CPU), keyed by logical row, so traces of arms with different micro-batch sizes line up
row by row.  A micro-batch the model receives packed into one sequence (``[1, tokens]``, the rows one
after the other: :attr:`~replayjob.producers.session.MicroStep.trace_offsets`) is cut back into its rows
at the producer's offsets, so a packed arm lines up with a padded one too.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replayjob.artifacts import metrics as metrics_io
from replayjob.artifacts.trace_store import Param, Site, Trace, make_param, row_stats, write_trace
from replayjob.errors import ContractError
from replayjob.producers.session import MicroStep
from replayjob.producers.trace_fault import Fault, install

if TYPE_CHECKING:
    import torch


def _first_tensor(output: Any) -> torch.Tensor | None:
    import torch
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    to_tuple = getattr(output, "to_tuple", None)  # transformers ModelOutput: its first non-None field
    if callable(to_tuple):
        first = to_tuple()[:1]
        return first[0] if first and isinstance(first[0], torch.Tensor) else None
    return None


def _check_packed(step: MicroStep) -> None:
    """A packed micro-batch's offsets: one more than its rows, from 0, never decreasing, inside its one sequence."""
    ids, off = step.trace_ids, step.trace_offsets
    assert ids is not None and off is not None
    bounds = [int(o) for o in off]
    if (ids.dim() != 2 or ids.shape[0] != 1 or len(bounds) != len(step.rows) + 1 or bounds[0] != 0
            or any(b < a for a, b in itertools.pairwise(bounds)) or bounds[-1] > ids.shape[1]):
        raise ContractError("a packed micro-batch's row offsets do not cut its one sequence into its rows",
                            hint="the producer's trace_offsets must hold rows + 1 non-decreasing positions from 0")


class Recorder:
    """Collects one trace of one update; see the module docstring for what is recorded."""

    def __init__(self, model: torch.nn.Module, plan: list[MicroStep],
                 params: list[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer,
                 fault: Fault | None = None):
        import torch
        self.model = model
        if any(s.trace_ids is None or s.trace_mask is None for s in plan):
            raise ContractError("the producer names no input_ids or token mask for its micro-batches",
                                hint="a traced replay needs both; drop --trace")
        self.plan = plan
        self.masks = [(s.trace_mask != 0).cpu() for s in plan]  # type: ignore[union-attr]
        rows = sorted(r for s in plan for r in s.rows)
        if rows != list(range(len(rows))):
            raise ContractError("the micro-batches do not hold each logical row once", hint="trace only replays")
        self.row_tokens = torch.zeros(len(rows), dtype=torch.int64)
        for s, mask in zip(plan, self.masks, strict=True):
            if s.trace_offsets is not None:
                _check_packed(s)
                for j, r in enumerate(s.rows):
                    self.row_tokens[r] = int(s.trace_offsets[j + 1] - s.trace_offsets[j])
                continue
            for j, r in enumerate(s.rows):
                self.row_tokens[r] = int(mask[j].sum())
        self.row_mb = torch.zeros(len(rows), dtype=torch.int64)
        self.params = params
        self.optimizer = optimizer
        self.fault = fault
        self.mb = -1
        self.forward_done = True
        self.kinds: dict[str, str] = {}
        self.fwd_order: list[str] = []
        self.bwd_order: list[str] = []
        self.fwd_rows: dict[str, dict[int, torch.Tensor]] = {}
        self.bwd_rows: dict[str, dict[int, torch.Tensor]] = {}
        self.untraced: set[str] = set()
        self._pending_fwd: dict[str, torch.Tensor] = {}
        self._pending_bwd: dict[str, torch.Tensor] = {}
        self._calls: dict[str, int] = {}
        self._recalls: dict[str, int] = {}
        self._grad_hooked: set[str] = set()
        self._grads: dict[str, torch.Tensor] = {}
        self._before: dict[str, torch.Tensor] = {}
        self._updates: dict[str, torch.Tensor] = {}

    # -- hooks ---------------------------------------------------------------------------------------
    def _begin(self, _m: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        import torch
        self._flush()
        self.mb += 1
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.mb >= len(self.plan) or not isinstance(ids, torch.Tensor) \
                or not torch.equal(ids.detach().cpu(), self.plan[self.mb].trace_ids.cpu()):  # type: ignore[union-attr]
            raise ContractError(f"traced forward {self.mb} is not micro-batch {self.mb} of the captured rows",
                                hint="tracing follows the replay's micro-batches, one forward each; trace only replays")
        for i in self.plan[self.mb].rows:
            self.row_mb[i] = self.mb
        self.forward_done = False
        self._calls, self._recalls, self._grad_hooked = {}, {}, set()

    def _key(self, name: str, counts: dict[str, int]) -> str:
        c = counts.get(name, 0)
        counts[name] = c + 1
        return name if c == 0 else f"{name}#{c}"

    def _output(self, name: str, module: torch.nn.Module, output: Any) -> None:
        if self.mb < 0:
            return
        recompute = self.forward_done
        key = self._key(name, self._recalls if recompute else self._calls)
        if module is self.model:  # the root returned: what runs now is recomputation in backward
            self.forward_done = True
        t = _first_tensor(output)
        ids = self.plan[self.mb].trace_ids
        assert ids is not None
        b, length = ids.shape
        if t is None or t.dim() < 2 or tuple(t.shape[:2]) != (b, length) or not t.is_floating_point():
            self.untraced.add(key)
            return
        self.kinds.setdefault(key, type(module).__name__)
        if not recompute:
            if key not in self.fwd_rows:
                self.fwd_rows[key] = {}
                self.fwd_order.append(key)
            self._pending_fwd[key] = t.detach().clone()
        if t.requires_grad and key not in self._grad_hooked:
            self._grad_hooked.add(key)
            t.register_hook(lambda g, key=key: self._grad(key, g))

    def _grad(self, key: str, g: torch.Tensor) -> None:
        if key not in self.bwd_rows:
            self.bwd_rows[key] = {}
            self.bwd_order.append(key)
        self._pending_bwd[key] = g.detach().clone()

    def _flush(self) -> None:
        """Keep the unpadded tokens of each row of the finished micro-batch, keyed by logical row."""
        if self.mb < 0:
            return
        mb, mask = self.plan[self.mb], self.masks[self.mb]
        offsets = None if mb.trace_offsets is None else [int(o) for o in mb.trace_offsets]
        for pending, store in ((self._pending_fwd, self.fwd_rows), (self._pending_bwd, self.bwd_rows)):
            for key, t in pending.items():
                rows = store.setdefault(key, {})
                flat = t.reshape(t.shape[0], t.shape[1], -1).to("cpu")
                for j, i in enumerate(mb.rows):
                    rows[i] = flat[j][mask[j]] if offsets is None else flat[0][offsets[j]:offsets[j + 1]]
            pending.clear()

    # -- attaching -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def attached(self) -> Iterator[Recorder]:
        handles: list[Any] = []
        try:
            if self.fault is not None:
                handles.append(install(self.model, self.fault))  # first: recording sees the perturbation
            handles.append(self.model.register_forward_pre_hook(self._begin, with_kwargs=True))
            for name, module in self.model.named_modules():
                handles.append(module.register_forward_hook(
                    lambda m, _a, out, name=name or "(root)": self._output(name, m, out)))
            for name, p in self.params:
                handles.append(p.register_post_accumulate_grad_hook(
                    lambda p, name=name: self._grads.__setitem__(name, p.grad.detach().clone())))
            handles.append(self.optimizer.register_step_pre_hook(lambda *_: self._step(before=True)))
            handles.append(self.optimizer.register_step_post_hook(lambda *_: self._step(before=False)))
            yield self
        finally:
            for h in handles:
                h.remove()

    def _step(self, *, before: bool) -> None:
        if before:
            self._flush()
            self._before = {n: p.detach().clone() for n, p in self.params}
        else:
            self._updates = {n: p.detach() - self._before[n] for n, p in self.params}

    # -- result --------------------------------------------------------------------------------------
    def _sites(self, order: list[str], store: dict[str, dict[int, torch.Tensor]]) -> list[Site]:
        import torch
        n = int(self.row_tokens.numel())
        out = []
        for key in order:
            rows = store.get(key, {})
            widths = {r.shape[1] for r in rows.values()}
            if len(rows) != n or len(widths) != 1:  # not seen for every row: not comparable row by row
                self.untraced.add(key)
                continue
            values = torch.cat([rows[i] for i in range(n)]).contiguous()
            stats, digests = row_stats(values, self.row_tokens)
            out.append(Site(key, self.kinds[key], values, stats, tuple(digests)))
        return out

    def trace(self, identity: dict[str, Any]) -> Trace:
        """The recorded trace; call after the update returned."""
        if self.mb != len(self.plan) - 1 or not self._updates:
            raise ContractError(f"the traced update ran {self.mb + 1} of {len(self.plan)} micro-batches "
                                "or no optimizer step", hint="trace a complete replay")
        params: list[Param] = []
        for name, _p in self.params:
            if name in self._grads:
                params.append(make_param(name, self._grads[name], self._updates[name]))
        fwd = self._sites(self.fwd_order, self.fwd_rows)
        bwd = self._sites(self.bwd_order, self.bwd_rows)
        return Trace(identity=identity, row_tokens=self.row_tokens.clone(), row_micro_batch=self.row_mb.clone(),
                     forward=fwd, backward=bwd, params=params, untraced=sorted(self.untraced - {s.name for s in fwd}))

    def write(self, out: Path, metrics: dict[str, Any], producer: dict[str, Any]) -> dict[str, str]:
        """Write ``OUT/trace/`` for the replay whose (not yet written) ``metrics`` are given (``producer``:
        its ``micro_batch_size`` and ``gradient_checkpointing``); return the ``trace`` entry of
        replay_metrics.json (the index's path and SHA-256)."""
        identity = {"manifest_sha256": metrics[metrics_io.MANIFEST],
                    "logical_batch_sha256": metrics[metrics_io.LOGICAL],
                    "initial_adapter_sha256": metrics[metrics_io.INITIAL_ADAPTER],
                    "arm": metrics["arm"], "repeat_index": metrics["repeat_index"],
                    "micro_batch_size": producer["micro_batch_size"],
                    "gradient_checkpointing": producer["gradient_checkpointing"],
                    "device": metrics["device"], "torch_version": metrics["torch_version"],
                    "fault": self.fault.spec if self.fault is not None else None}
        index, sha = write_trace(out, self.trace(identity))
        return {metrics_io.TRACE_INDEX_PATH: index.relative_to(out).as_posix(), metrics_io.TRACE_INDEX_SHA256: sha}
