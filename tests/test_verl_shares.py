"""A verl capture's processes' shares joined and split again for another process count
(replayjob.producers.verl.producer.regrouped), without verl: the shares are plain captured micro-batches."""

from __future__ import annotations

from typing import Any

import torch

from replayjob.producers.api.microbatch import MicroBatch
from replayjob.producers.verl.producer import OFFSETS, regrouped, shares_differ


def share(rows: list[list[int]], **non_tensor: Any) -> MicroBatch:
    """One process's train_batch: dense per-row advantages, jagged input_ids, a whole-batch index tensor."""
    lengths = [len(r) for r in rows]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    inputs = {"advantages": torch.tensor([[float(r[0])] * 2 for r in rows]),
              "input_ids": torch.tensor([t for r in rows for t in r]), f"input_ids{OFFSETS}": offsets,
              "indices": torch.arange(5)}
    batch = {"batch_size": [len(rows)], "nested": ["input_ids"], "non_tensor_tensors": ["indices"],
             "non_tensor": {"global_batch_size": 4, **non_tensor},
             "non_tensor_stacks": {"uid": [f"u{r[0]}" for r in rows]}}
    return MicroBatch(inputs, {"batch": batch}, {}, {}, {"cpu": torch.zeros(1)}, True, 1)


def test_two_shares_join_and_split_into_the_same_rows() -> None:
    shares = [share([[1, 2, 3], [4]]), share([[5, 6], [7, 8, 9]])]
    assert shares_differ(shares) is None
    one = regrouped(shares, 0, 1)  # both shares on one process
    assert one.input_values["batch"]["batch_size"] == [4]
    assert one.inputs["input_ids"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert one.inputs[f"input_ids{OFFSETS}"].tolist() == [0, 3, 4, 6, 9]
    assert one.inputs["advantages"][:, 0].tolist() == [1.0, 4.0, 5.0, 7.0]
    assert one.input_values["batch"]["non_tensor_stacks"]["uid"] == ["u1", "u4", "u5", "u7"]
    assert torch.equal(one.inputs["indices"], torch.arange(5))  # a whole-batch entry, kept once
    back = [regrouped([one], r, 2) for r in range(2)]  # and split again over two: the captured shares
    for got, want in zip(back, shares, strict=True):
        assert got.input_values == want.input_values
        assert got.inputs.keys() == want.inputs.keys()
        assert all(torch.equal(got.inputs[k], want.inputs[k]) for k in want.inputs)


def test_shares_that_differ_in_a_setting_or_a_width_are_not_joined() -> None:
    assert "non_tensor ['temperature']" in str(shares_differ([share([[1]], temperature=1.0),
                                                              share([[2]], temperature=0.7)]))
    wide = share([[2]])
    wide.inputs["advantages"] = torch.zeros(1, 3)
    assert "'advantages' is [1, 3]" in str(shares_differ([share([[1]]), wide]))
    other = share([[2]])
    other.inputs["indices"] = torch.arange(6)
    assert "whole-batch tensor 'indices'" in str(shares_differ([share([[1]]), other]))
