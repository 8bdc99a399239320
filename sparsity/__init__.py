"""Compact block-sparse index tensors for block-sparse attention kernels.

Pure PyTorch, independent of any kernel: the BlockSparseTensors layout and its validation,
builders (from selected blocks, for a compressed causal branch, from a dense mask) and the
transposes the backward consumes (padded, and BlockSparseCSR: O(listed entries)). Varlen aware
throughout; a padded batch is S equal-length sequences (`uniform_cu_seqlens`). The layout
contract is docs/interfaces.md.
"""
from sparsity._geometry import QueryRows
from sparsity.block_sparse import (BlockSparseTensors, row_block_offsets_from_cu_seqlens,
                                   uniform_cu_seqlens, validate_block_sparse)
from sparsity.builders import (build_block_sparse_from_mask,
                               build_block_sparse_from_tile_classes, build_compressed_block_sparse,
                               build_compressed_block_sparse_trusted,
                               build_selected_block_sparse, build_selected_block_sparse_trusted,
                               selected_block_sparse_from_lists, selected_list_classes)
from sparsity.csr import (BlockSparseCSR, check_csr_matches, transpose_block_sparse_csr,
                          validate_block_sparse_csr)
from sparsity.transpose import transpose_block_sparse, transposed_list_lengths

__all__ = [
    "BlockSparseCSR",
    "BlockSparseTensors",
    "QueryRows",
    "build_block_sparse_from_mask",
    "build_block_sparse_from_tile_classes",
    "build_compressed_block_sparse",
    "build_compressed_block_sparse_trusted",
    "build_selected_block_sparse",
    "build_selected_block_sparse_trusted",
    "check_csr_matches",
    "row_block_offsets_from_cu_seqlens",
    "selected_block_sparse_from_lists",
    "selected_list_classes",
    "transpose_block_sparse",
    "transpose_block_sparse_csr",
    "transposed_list_lengths",
    "uniform_cu_seqlens",
    "validate_block_sparse",
    "validate_block_sparse_csr",
]
