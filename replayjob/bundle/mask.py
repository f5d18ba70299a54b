"""The mask-row check, run on a ``mask`` payload's bytes as they stream past the hash.

Row ``i`` of the ``[N, T]`` mask must hold ``response_length`` ones then zeros.  The reader hands a
:class:`MaskRows` to :func:`replayjob.tensorfile.scan` as its ``visit`` callback, so each chunk is
checked while it is still in cache, right after it was hashed: no second pass over the payload and,
for ``bundle validate``, no copy of it kept in memory.  Rows are compared exactly with the
expected pattern (``torch.equal`` of each piece of a long row against a slice of one
ones-then-zeros template, one vectorised comparison per block of short rows), in pieces small
enough to stay on the calling thread; NaN never matches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from replayjob.bundle import format as fmt
from replayjob.errors import IntegrityError
from replayjob.tensorfile import TensorSpec, torch_dtype

if TYPE_CHECKING:
    from torch import Tensor


_LONG_ROW = 1024  # from this width on, rows are compared piece by piece against the template
# Torch runs an operation on more elements than this in its intra-op thread pool; on a busy machine
# waking (and spinning) those threads for each chunk costs more than the comparison itself, so every
# comparison here stays below it and runs on the calling thread.
_GRAIN = 32768


class MaskRows:
    """A ``scan`` visitor that checks mask rows against the recorded response lengths.

    After the scan, :attr:`checked` is the number of elements checked; the reader requires it to be
    ``N * T`` once the header's dtype and shape have been matched against the manifest.
    """

    def __init__(self, lengths: list[int], sample_ids: list[str]):
        import torch
        self.lengths = lengths
        self.sample_ids = sample_ids
        self.lengths_t = torch.tensor(lengths, dtype=torch.int64)
        self.checked = 0
        self._template: Tensor | None = None
        self._cols: Tensor | None = None

    def _fail(self, row: int) -> IntegrityError:
        return IntegrityError(f"mask row of sample {self.sample_ids[row]!r} does not match response_length="
                              f"{self.lengths[row]}", where=fmt.payload_where("mask"))

    def __call__(self, spec: TensorSpec, piece: memoryview, first: int) -> None:
        """Check ``piece``: elements ``first ..`` of the mask tensor, just read and hashed."""
        import torch
        if spec.name != "mask" or len(spec.shape) != 2 or spec.shape[0] != len(self.lengths):
            return  # the reader refuses this file by its header; nothing here is checked
        width, dtype = spec.shape[1], torch_dtype(spec.dtype)
        if self._template is None:
            too_long = [i for i, n in enumerate(self.lengths) if n > width]
            if too_long:
                raise self._fail(too_long[0])
            self._template = torch.cat([torch.ones(_GRAIN, dtype=dtype), torch.zeros(_GRAIN, dtype=dtype)])
            self._cols = torch.arange(min(width, _LONG_ROW))
        count = len(piece) // dtype.itemsize
        if count == 0:
            return
        self._check(torch.frombuffer(piece, dtype=dtype, count=count), first, width)
        self.checked += count

    def _check(self, values: Tensor, first: int, width: int) -> None:
        """Elements ``first ..`` of the row-major ``[N, width]`` mask, in pieces of at most ``_GRAIN``."""
        import torch
        assert self._template is not None and self._cols is not None
        pos, n = 0, values.numel()
        while pos < n:
            row, col = divmod(first + pos, width)
            if width < _LONG_ROW and col == 0 and n - pos >= width:  # a block of whole short rows
                rows = min((n - pos) // width, max(1, _GRAIN // width))
                block = values[pos:pos + rows * width].view(rows, width)
                want = self._cols[None, :] < self.lengths_t[row:row + rows, None]
                ok = torch.where(want, block == 1, block == 0).all(dim=1)
                if not bool(ok.all()):
                    raise self._fail(row + int((~ok).nonzero()[0, 0]))
                pos += rows * width
                continue
            # Part of one row: ``ones`` of its values must be 1, the rest 0 -- a slice of the template.
            k = min(width - col, n - pos, _GRAIN)
            ones = min(max(self.lengths[row] - col, 0), _GRAIN)
            if not torch.equal(values[pos:pos + k], self._template[_GRAIN - ones:_GRAIN - ones + k]):
                raise self._fail(row)
            pos += k
