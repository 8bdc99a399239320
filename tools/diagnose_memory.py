"""Memory of NSA forward+backward against dense attention, and the size of the sparsity metadata.

Per sequence length N it reports, all measured on real tensors of the run:
  metadata      bytes of the selected branch's compact block lists (forward layout), of their
                transpose (what the backward kernel reads), of the sparse compressed branch's
                lists when enabled, and of the raw selection; beside them the bytes a dense
                (tiles x blocks x Hkv) boolean mask would take, the layout the compact one avoids
  saved         bytes autograd keeps from forward to backward (torch.autograd.graph
                saved_tensors_hooks; each storage counted once; q, k, v included)
  peak (GPU)    torch.cuda.max_memory_allocated over forward+backward, less what was allocated
                before (inputs and gradients of earlier runs freed); CUDA only, "-" on the CPU

    python tools/diagnose_memory.py                       # per-device default sizes
    python tools/diagnose_memory.py --seqlens 65536,262144 --json memory.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernels  # noqa: E402
from nsa import CMP_KV_BLOCK, SELECTION_Q_TILE, nsa  # noqa: E402
from nsa.branches import compressed_branch, selected_branch  # noqa: E402
from nsa.compression import compress, compressed_block_rows, compressed_cu_seqlens  # noqa: E402
from nsa.selection import select_blocks  # noqa: E402
from nsa.validation import validate_nsa_arguments  # noqa: E402
from sparsity import row_block_offsets_from_cu_seqlens, transpose_block_sparse  # noqa: E402
from _common import (  # noqa: E402
    add_problem_arguments, describe_device, measure_seqlens, nsa_options, positive_int,
    problem_defaults_epilog, problem_summary, random_gate, random_qkv, resolve_problem_arguments)

MiB = 2 ** 20


def metadata_bytes(q, k, cu_seqlens, max_seqlen, args) -> dict[str, int]:
    """Bytes of the block-sparse metadata one nsa() call builds for these inputs."""
    config, max_seqlen = validate_nsa_arguments(
        q, k, k, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, W_k=None, W_v=None, W_gate=None,
        causal=True, softmax_scale=None, num_cmp_selected_blocks=args.num_cmp_selected_blocks,
        q_tile=SELECTION_Q_TILE, cmp_kv_block=CMP_KV_BLOCK, **nsa_options(args))
    l = config.compress_block_size
    cu_cmp = compressed_cu_seqlens(cu_seqlens, l)
    k_cmp = compress(k, compressed_block_rows(cu_seqlens, cu_cmp, l, int(cu_cmp[-1])))
    selection = select_blocks(q, k_cmp, cu_seqlens, cu_cmp, **config.selection_kwargs())
    selected = selected_branch(cu_seqlens, selection.selected,
                               selected_block_size=config.selected_block_size,
                               softmax_scale=config.softmax_scale, causal=True,
                               q_tile=config.q_tile, max_seqlen=max_seqlen)
    lists = selected.kernel_kwargs["block_sparse"]
    transposed = transpose_block_sparse(
        lists, row_block_offsets_from_cu_seqlens(cu_seqlens, config.selected_block_size))
    result = {
        "selection": selection.selected.nbytes,
        "selected_lists": lists.nbytes,
        "selected_lists_transposed": transposed.nbytes,
    }
    if args.num_cmp_selected_blocks is not None:
        compressed = compressed_branch(
            cu_seqlens, cu_cmp, compress_block_size=l, softmax_scale=config.softmax_scale,
            causal=True, cmp_selected=selection.cmp_selected, q_tile=config.q_tile,
            cmp_kv_block=config.cmp_kv_block, max_seqlen=max_seqlen)
        result["compressed_lists"] = compressed.kernel_kwargs["block_sparse"].nbytes
    tiles = lists.full_count.shape[0]
    blocks = int(row_block_offsets_from_cu_seqlens(cu_seqlens, config.selected_block_size)[-1])
    # A dense mask keeps one byte per (tile, KV block) pair for every KV head, and each
    # sequence's tiles only meet its own blocks: count those pairs.
    lengths = cu_seqlens.diff().tolist()
    dense_pairs = sum(-(-n // config.q_tile) * -(-n // config.selected_block_size)
                      for n in lengths)
    result["dense_mask_equivalent"] = dense_pairs * args.kv_heads
    result["tiles"], result["kv_blocks"] = tiles, blocks
    return result


def saved_for_backward_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while fn() runs its forward."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    del out
    return sum(storages.values())


def peak_bytes(fn, dout, device) -> int | None:
    """Extra CUDA memory at the peak of fn().backward(dout); None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn().backward(dout)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def diagnose(seqlen: int, args) -> dict:
    shape_q = (args.batch, seqlen, args.heads, args.head_dim)
    shape_kv = (args.batch, seqlen, args.kv_heads, args.head_dim)
    q, k, v = random_qkv(shape_q, shape_kv, args.torch_dtype, args.device, requires_grad=True)
    dout = torch.randn(shape_q, generator=torch.Generator().manual_seed(7)).to(
        device=args.device, dtype=args.torch_dtype)
    W_gate = random_gate(args.heads, args.head_dim, args.torch_dtype, args.device,
                         requires_grad=True) if args.gate else None

    def run_nsa():
        return nsa(q, k, v, W_gate=W_gate, num_cmp_selected_blocks=args.num_cmp_selected_blocks,
                   **nsa_options(args))

    def run_dense():
        return kernels.flash_attn_func(q, k, v, causal=True)

    packed = [t.detach().reshape(-1, *t.shape[2:]) for t in (q, k)]
    cu_seqlens = torch.arange(args.batch + 1, dtype=torch.int32, device=args.device) * seqlen
    with torch.no_grad():
        metadata = metadata_bytes(*packed, cu_seqlens, seqlen, args)

    result = {"seqlen": seqlen, "inputs": sum(t.nbytes for t in (q, k, v)),
              "metadata": metadata}
    for name, fn in (("nsa", run_nsa), ("dense", run_dense)):
        result[name] = {"saved_for_backward": saved_for_backward_bytes(fn),
                        "peak_fwd_bwd": peak_bytes(fn, dout, args.device)}
        q.grad = k.grad = v.grad = None
    return result


def human(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / MiB:.3f} MiB" if nbytes >= 2 ** 14 else f"{nbytes} B"


def format_result(result: dict) -> str:
    meta = result["metadata"]
    lines = [f"N={result['seqlen']}: {meta['tiles']} q tiles x {meta['kv_blocks']} KV blocks; "
             f"q, k, v {human(result['inputs'])}",
             f"  {'metadata':<34} {'bytes':>14}"]
    for key in ("selection", "selected_lists", "selected_lists_transposed", "compressed_lists",
                "dense_mask_equivalent"):
        if key in meta:
            lines.append(f"  {key:<34} {human(meta[key]):>14}")
    lines.append(f"  {'memory':<34} {'nsa':>14} {'dense':>14}")
    for key in ("saved_for_backward", "peak_fwd_bwd"):
        lines.append(f"  {key:<34} {human(result['nsa'][key]):>14} "
                     f"{human(result['dense'][key]):>14}")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Peak memory of NSA vs dense attention and the size of the sparsity "
                    "metadata, per sequence length.",
        epilog=problem_defaults_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_problem_arguments(parser)
    parser.add_argument("--num-cmp-selected-blocks", type=positive_int,
                        help="make the compressed branch block-sparse (default: dense)")
    parser.add_argument("--json", type=Path, help="write the results to this JSON file")
    args = parser.parse_args(argv)
    resolve_problem_arguments(args, parser)
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = describe_device(args.device)
    print(f"{device}, torch {torch.__version__}; B={args.batch} {problem_summary(args)}")
    if args.device.type != "cuda":
        print("CPU: peak memory needs CUDA's allocator statistics; saved-for-backward and "
              "metadata bytes are measured")
    measure_seqlens("diagnose_memory", argv, args, device, diagnose, format_result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
