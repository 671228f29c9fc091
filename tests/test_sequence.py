"""Sequence (jllm/sequence.py): the KV cache and its token ids move together through sync, keep, rollback,
load and export; sync evaluates only what the held prefix does not cover."""

import pytest
import torch

from fake_model import FakeModel
from jllm.sequence import Sequence, common_prefix


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2]) == 2


def test_sync_reuses_the_held_prefix_and_evaluates_at_least_one_token():
    model = FakeModel()
    seq = Sequence(model, 64)
    logits = seq.sync([1, 2, 3, 4])
    assert seq.ids == [1, 2, 3, 4] and seq.cache.length == 4 and seq.evaluated == 4
    assert torch.equal(logits, model.logits_after(3, 4))
    seq.sync([1, 2, 3, 4, 5, 6])
    assert seq.evaluated == 2 and model.calls[-1] == 2
    seq.sync([1, 2, 3, 4, 5, 6])                 # all held: the last token runs again, for its logits
    assert seq.evaluated == 1 and seq.ids == [1, 2, 3, 4, 5, 6]
    seq.sync([1, 2, 9])                          # diverges after two: cut back, evaluate one
    assert seq.ids == [1, 2, 9] and seq.cache.length == 3 and seq.evaluated == 1


def test_sync_runs_long_contexts_in_chunks():
    model = FakeModel()
    seq = Sequence(model, 1024)
    seq.sync(list(range(40)) * 15)               # 600 tokens: 256 + 256 + 88
    assert model.calls == [256, 256, 88] and len(seq) == 600


def test_keep_after_a_verify_block_and_a_moved_side_leaf():
    model = FakeModel()
    seq = Sequence(model, 64)
    seq.sync([1, 2, 3])
    before = len(seq)
    seq.forward([4, 5, 6, 7, 8], tree=[0])            # last row: an alternative (8) to 5, the child of row 0
    seq.keep(before, [4, 8], rows=[0, 4])
    assert seq.ids == [1, 2, 3, 4, 8] and seq.cache.length == 5
    assert seq.cache.k[0, 0, :5, 0].long().tolist() == [1, 2, 3, 4, 8]
    with pytest.raises(ValueError):
        seq.keep(2, [1, 2, 3, 4, 5])


def test_rollback_reset_load_export():
    model = FakeModel()
    seq = Sequence(model, 64)
    seq.sync([5, 6, 7, 8])
    seq.rollback(2)
    assert seq.ids == [5, 6] and seq.cache.length == 2
    ids, k, v = seq.export()
    other = Sequence(model, 64)
    other.load(ids, k, v)
    assert other.ids == [5, 6] and torch.equal(other.cache.k[:, :, :2], seq.cache.k[:, :, :2])
    with pytest.raises(ValueError):
        other.load([1], k, v)
    seq.reset()
    assert seq.ids == [] and seq.cache.length == 0
