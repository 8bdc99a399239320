"""BlockSparseTensors: helpers, bookkeeping, and validation errors that name the field."""
import dataclasses

import pytest
import torch

from sparsity import (BlockSparseTensors, row_block_offsets_from_cu_seqlens, uniform_cu_seqlens,
                      validate_block_sparse)
from sparsity_oracle import from_dense_classes


def example() -> BlockSparseTensors:
    # Sequences of 2 and 1 q tiles; 2 heads; 3 KV blocks per sequence at most.
    classes = torch.tensor([[[2, 1, 0], [0, 2, 2]],
                            [[2, 2, 1], [1, 0, 0]],
                            [[0, 1, 0], [2, 0, 0]]], dtype=torch.int8)
    return from_dense_classes(classes, [0, 2, 3], row_block_size=64, col_block_size=32)


CU_Q = torch.tensor([0, 100, 130], dtype=torch.int32)  # 2 + 1 tiles of 64
CU_K = torch.tensor([0, 96, 60], dtype=torch.int32).cumsum(0).to(torch.int32)  # 3 + 2 blocks


def test_row_block_offsets_round_up_per_sequence():
    cu = torch.tensor([0, 5, 5, 17, 18], dtype=torch.int32)
    offsets = row_block_offsets_from_cu_seqlens(cu, 4)
    assert offsets.tolist() == [0, 2, 2, 5, 6] and offsets.dtype == torch.int32
    assert uniform_cu_seqlens(3, 7).tolist() == [0, 7, 14, 21]
    with pytest.raises(ValueError, match="block_size"):
        row_block_offsets_from_cu_seqlens(cu, 0)
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        row_block_offsets_from_cu_seqlens(torch.tensor([0, 5, 4], dtype=torch.int32), 4)


def test_bookkeeping():
    bs = example()
    validate_block_sparse(bs, num_heads=8, num_kv_heads=2, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K)
    assert (bs.num_rows, bs.num_heads, bs.num_sequences) == (3, 2, 2)
    assert bs.full_index.shape == (3, 2, 2) and bs.mask_index.shape == (3, 2, 1)
    assert bs.nbytes == 4 * (6 + 12 + 6 + 6 + 3)
    moved = bs.to("meta")
    assert moved.full_index.is_meta and moved.row_block_size == 64
    assert bs.to("cpu").equals(bs)
    other = dataclasses.replace(bs, full_count=bs.full_count.clone())
    assert other.equals(bs)
    assert not dataclasses.replace(bs, col_block_size=16).equals(bs)
    assert "rows=3" in repr(bs) and "nbytes=132" in repr(bs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        bs.row_block_size = 128


def broken(**changes):
    return dataclasses.replace(example(), **changes)


def swap_first(index):
    index = index.clone()
    index[1, 0, :2] = index[1, 0, :2].flip(0)
    return index


@pytest.mark.parametrize("bs, kwargs, match", [
    (broken(full_count=example().full_count.long()), {}, r"block_sparse\.full_count must be int32"),
    (broken(full_index=example().full_index.transpose(0, 1).contiguous().transpose(0, 1)), {},
     r"block_sparse\.full_index must be contiguous"),
    (broken(mask_index=example().mask_index[:2].contiguous()), {},
     r"block_sparse\.mask_index must have shape \(R, Hs, K\)"),
    (broken(mask_count=example().mask_count[:, :1].contiguous()), {},
     r"block_sparse\.mask_count must have shape"),
    (broken(full_count=example().full_count[0].contiguous()), {},
     r"block_sparse\.full_count must have shape \(R, Hs\)"),
    (broken(row_block_size=0), {}, r"block_sparse\.row_block_size must be a positive int"),
    (broken(col_block_size=32.0), {}, r"block_sparse\.col_block_size"),
    (broken(mask_index=[[[0]]]), {}, r"block_sparse\.mask_index must be a torch\.Tensor"),
    (broken(full_index=example().full_index.to("meta")), {},
     r"block_sparse\.full_index is on meta"),
    (example(), dict(num_heads=8, num_kv_heads=4), r"block_sparse\.full_count has 2 heads"),
    (broken(row_block_offsets=torch.tensor([0, 2, 4], dtype=torch.int32)), {},
     r"block_sparse\.row_block_offsets must start at 0.*end at"),
    (broken(row_block_offsets=torch.tensor([0, 3], dtype=torch.int32)), dict(cu_seqlens_q=CU_Q),
     r"block_sparse\.row_block_offsets has 1 sequences but cu_seqlens_q"),
    (broken(row_block_offsets=torch.tensor([0, 1, 3], dtype=torch.int32)),
     dict(cu_seqlens_q=CU_Q), r"block_sparse\.row_block_offsets does not match cu_seqlens_q"),
    (broken(full_count=torch.full((3, 2), 3, dtype=torch.int32)), {},
     r"block_sparse\.full_count entries must lie in \[0, 2\]"),
    (broken(mask_count=torch.zeros(3, 2, dtype=torch.int32)), {},
     r"block_sparse\.mask_index must hold -1 after mask_count"),
    (broken(full_index=swap_first(example().full_index)), {},
     r"block_sparse\.full_index lists must be strictly ascending"),
    (broken(mask_index=torch.tensor([[[0], [0]], [[2], [0]], [[1], [1]]], dtype=torch.int32),
            mask_count=torch.ones(3, 2, dtype=torch.int32)), {},
     r"block_sparse\.full_index and block_sparse\.mask_index must be disjoint"),
    (example(), dict(cu_seqlens_k=torch.tensor([0, 64, 100], dtype=torch.int32)),
     r"block_sparse\.full_index names column blocks past the end"),
])
def test_validation_names_the_field(bs, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        validate_block_sparse(bs, **kwargs)


def test_validation_prefix_and_not_a_dataclass():
    with pytest.raises(ValueError, match=r"block_sparse_transposed\.full_count must be int32"):
        validate_block_sparse(broken(full_count=example().full_count.long()),
                              name="block_sparse_transposed")
    with pytest.raises(TypeError, match="block_sparse must be a BlockSparseTensors"):
        validate_block_sparse({"full_count": None})
    # Without check_contents nothing is read: bad contents pass, bad metadata does not.
    validate_block_sparse(broken(full_count=torch.full((3, 2), 9, dtype=torch.int32)),
                          check_contents=False)
