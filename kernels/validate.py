"""Input checks and normalisation shared by every attention entry point.

Every check runs before any compute and raises a ``ValueError`` or ``TypeError`` that names the
argument and the form it should have. What the checks learn is returned as an
:class:`AttentionProblem`: host-side facts about the call (layout, heads, sequence boundaries,
resolved options) that the fallback and the kernels read instead of deriving them again.

Checking values needs them on the host: for CUDA tensors the sequence boundaries cost one
transfer; block-sparse lists are checked by ``sparsity.validate_block_sparse`` (a few more).
Each transfer stalls the host until the GPU catches up, so a caller that has already checked the
sequence boundaries, holds them on the host and built the block-sparse lists with ``sparsity``'s
builders (nsa's branches, up to nine attention calls per layer) uses the ``trusted`` variants:
the same checks and messages, no device read; only those values are taken on trust.

The backward's ``deterministic`` switch is checked here too (a bool) but is not part of the
problem: it chooses how a kernel sums dQ, never which function it computes.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

# The fallback computes in any of these; the CuTe kernels accept a subset (their `can_run` says
# which). float64 exists for oracles and gradcheck.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Sequence bounds are int32 (cu_seqlens), so no sequence is longer than this and a larger
# max_seqlen_* describes nothing; the kernels take it as an Int32.
INT32_MAX = 2**31 - 1
# The kernels scale scores in float32 (the fallback too, for half inputs): a larger scale is inf.
FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class AttentionProblem:
    """One validated attention call, normalised; host values only, so it is hashable.

    A padded batch is described as ``B`` sequences of equal length, so code that walks
    sequences never needs to know the layout; ``varlen`` says which layout the tensors have.
    """

    varlen: bool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    cu_seqlens_q: tuple[int, ...]  # (S+1,) sequence starts in the packed row order
    cu_seqlens_k: tuple[int, ...]
    max_seqlen_q: int
    max_seqlen_k: int
    softmax_scale: float
    causal: bool
    compress_factor: int
    window_size: tuple[int, int]
    block_sparse_heads: int | None  # Hs of the compact lists; None without block sparsity
    # Per sequence, the token position of its first query row (the causal, window and
    # compressed rules read row i as position q_start + i); None: every sequence starts at 0.
    q_start_positions: tuple[int, ...] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens_q) - 1

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def q_start(self, s: int) -> int:
        """The position of sequence s's first query row (0 unless q_start_positions)."""
        return 0 if self.q_start_positions is None else self.q_start_positions[s]

    def sequences(self) -> Iterator[tuple[int, int, int, int, int]]:
        """Yield ``(s, q_start, q_end, k_start, k_end)`` for every sequence, in packed rows."""
        for s in range(self.num_seqs):
            yield (s, self.cu_seqlens_q[s], self.cu_seqlens_q[s + 1],
                   self.cu_seqlens_k[s], self.cu_seqlens_k[s + 1])

    def key_block_offsets(self, block_size: int) -> tuple[int, ...]:
        """(S+1,) ``block_offsets`` of the keys: the rows of the transposed block-sparse lists."""
        return block_offsets(self.cu_seqlens_k, block_size)


def validate_attention_forward(
    q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    softmax_scale=None, causal=False, compress_factor=1, window_size=(-1, -1), block_sparse=None,
    q_start_positions=None,
) -> AttentionProblem:
    """Check the arguments of ``attention_forward`` and describe the call."""
    return _validate_forward(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
        compress_factor=compress_factor, window_size=window_size, block_sparse=block_sparse,
        q_start_positions=q_start_positions, host_cu_seqlens=None)


def validate_trusted_attention_forward(q, k, v, *, host_cu_seqlens, **kwargs) -> AttentionProblem:
    """``validate_attention_forward`` without a device read, for internal callers only.

    ``host_cu_seqlens = (cu_q, cu_k)``: the values of ``cu_seqlens_q/k`` that the caller read and
    checked itself (None for the padded layout). They are taken to equal the tensors, and the
    contents of ``block_sparse`` (counts, indices, offsets) to be valid, as ``sparsity``'s
    builders make them. Everything else is checked as the public path checks it, with the same
    messages, including the host values themselves (start, order, end, ``max_seqlen_*``).
    """
    return _validate_forward(q, k, v, host_cu_seqlens=_host_pair(host_cu_seqlens), trusted=True,
                             **kwargs)


def _validate_forward(
    q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    softmax_scale=None, causal=False, compress_factor=1, window_size=(-1, -1), block_sparse=None,
    q_start_positions=None, host_cu_seqlens, trusted: bool = False,
) -> AttentionProblem:
    varlen = _check_layout_and_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k)
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_kv_heads = k.shape[-2]
    if varlen:
        cu_q, cu_k = _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k, host_cu_seqlens)
        max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_q, "cu_seqlens_q")
        max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k, cu_k, "cu_seqlens_k")
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        cu_q = tuple(range(0, batch * seqlen_q + 1, seqlen_q)) if seqlen_q else (0,) * (batch + 1)
        cu_k = tuple(range(0, batch * seqlen_k + 1, seqlen_k)) if seqlen_k else (0,) * (batch + 1)
        max_q = _check_padded_max_seqlen("max_seqlen_q", max_seqlen_q, seqlen_q, "q")
        max_k = _check_padded_max_seqlen("max_seqlen_k", max_seqlen_k, seqlen_k, "k")

    problem = AttentionProblem(
        varlen=varlen,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        softmax_scale=check_softmax_scale(softmax_scale, head_dim),
        causal=check_bool("causal", causal),
        compress_factor=_check_compress_factor(compress_factor),
        window_size=_check_window_size(window_size),
        block_sparse_heads=None,
        q_start_positions=_check_q_start_positions(q_start_positions, varlen, len(cu_q) - 1,
                                                   max_q),
    )
    if block_sparse is not None:
        heads = _check_block_sparse("block_sparse", block_sparse, num_heads=num_heads,
                                    num_kv_heads=num_kv_heads, cu_rows=cu_q, cu_cols=cu_k,
                                    device=q.device, check_contents=not trusted)
        problem = _replace_block_sparse_heads(problem, heads)
    return problem


def validate_attention_backward(
    dout, q, k, v, out, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
    max_seqlen_k=None, softmax_scale=None, causal=False, compress_factor=1, window_size=(-1, -1),
    block_sparse=None, block_sparse_transposed=None, deterministic=False, q_start_positions=None,
) -> AttentionProblem:
    """Check the arguments of ``attention_backward`` and describe the call."""
    return _validate_backward(
        dout, q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
        causal=causal, compress_factor=compress_factor, window_size=window_size,
        block_sparse=block_sparse, block_sparse_transposed=block_sparse_transposed,
        deterministic=deterministic, q_start_positions=q_start_positions,
        host_cu_seqlens=None)


def validate_trusted_attention_backward(dout, q, k, v, out, lse, *, host_cu_seqlens,
                                        **kwargs) -> AttentionProblem:
    """``validate_attention_backward`` without a device read, for internal callers only; trusts
    what :func:`validate_trusted_attention_forward` trusts (``block_sparse_transposed`` too)."""
    return _validate_backward(dout, q, k, v, out, lse,
                              host_cu_seqlens=_host_pair(host_cu_seqlens), trusted=True, **kwargs)


def _validate_backward(
    dout, q, k, v, out, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
    max_seqlen_k=None, softmax_scale=None, causal=False, compress_factor=1, window_size=(-1, -1),
    block_sparse=None, block_sparse_transposed=None, deterministic=False, q_start_positions=None,
    host_cu_seqlens, trusted: bool = False,
) -> AttentionProblem:
    problem = _validate_forward(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
        compress_factor=compress_factor, window_size=window_size, block_sparse=block_sparse,
        q_start_positions=q_start_positions, host_cu_seqlens=host_cu_seqlens, trusted=trusted,
    )
    check_backward_tensors(problem, q, dout, out, lse)
    check_deterministic(deterministic)
    if block_sparse_transposed is not None:
        check_block_sparse_transposed(block_sparse_transposed, block_sparse, problem,
                                      device=q.device, check_contents=not trusted)
    return problem


def check_backward_tensors(problem: AttentionProblem, q, dout, out, lse, *,
                           reads_out: bool = True) -> None:
    """dout and out like q, lse as the forward returns it for `problem`. reads_out=False: a
    call that takes rowsum(dO * O) instead of out (out is not checked, and may be None)."""
    for name, tensor in (("out", out), ("dout", dout)):
        if name == "out" and not reads_out:
            continue
        _check_tensor(name, tensor)
        if tuple(tensor.shape) != tuple(q.shape):
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, "
                             f"got {tuple(tensor.shape)}")
        if tensor.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {tensor.dtype}")
        _check_same_device(name, tensor, q)
        _check_last_dim_contiguous(name, tensor)

    _check_tensor("lse", lse)
    expected = lse_shape(problem, q)
    if tuple(lse.shape) != expected:
        layout = "(H, Tq)" if problem.varlen else "(B, H, Nq)"
        raise ValueError(f"lse must have shape {layout} = {expected}, got {tuple(lse.shape)}")
    if lse.dtype != lse_dtype(q.dtype):
        raise TypeError(f"lse must be {lse_dtype(q.dtype)} for {q.dtype} inputs, got {lse.dtype}")
    _check_same_device("lse", lse, q)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, except float64 inputs keep float64 so gradcheck sees exact gradients."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def lse_shape(problem: AttentionProblem, q: torch.Tensor) -> tuple[int, ...]:
    """``(H, Tq)`` for packed varlen (flash-attn's convention), ``(B, H, Nq)`` for padded."""
    if problem.varlen:
        return (problem.num_heads, q.shape[0])
    return (q.shape[0], problem.num_heads, q.shape[1])


# --- tensors -------------------------------------------------------------------------------------

def _check_layout_and_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k) -> bool:
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, tensor)
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        given = "cu_seqlens_q" if cu_seqlens_k is None else "cu_seqlens_k"
        missing = "cu_seqlens_k" if cu_seqlens_k is None else "cu_seqlens_q"
        raise ValueError(f"{given} was given without {missing}: pass both (packed varlen) or "
                         "neither (padded)")
    varlen = cu_seqlens_q is not None
    rank, form_q, form_kv = (3, "(Tq, H, D)", "(Tk, Hkv, D)") if varlen else \
        (4, "(B, Nq, H, D)", "(B, Nk, Hkv, D)")
    layout = "packed varlen" if varlen else "padded"
    for name, tensor, form in (("q", q, form_q), ("k", k, form_kv), ("v", v, form_kv)):
        if tensor.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {form} for the {layout} layout, "
                             f"got shape {tuple(tensor.shape)}")

    if q.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"q must be one of {names}, got {q.dtype}")
    for name, tensor in (("k", k), ("v", v)):
        if tensor.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {tensor.dtype}")
        _check_same_device(name, tensor, q)

    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must have the head dim of q ({q.shape[-1]}), got {k.shape[-1]}")
    if v.shape[-1] != q.shape[-1]:
        # One head dim for q, k and v: the kernels tile them with the same D.
        raise ValueError(f"v must have the head dim of q ({q.shape[-1]}), got {v.shape[-1]}: "
                         "q, k and v share one head dim")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if not varlen and k.shape[0] != q.shape[0]:
        raise ValueError(f"k must have the batch size of q ({q.shape[0]}), got {k.shape[0]}")
    num_heads, num_kv_heads = q.shape[-2], k.shape[-2]
    if num_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"q and k need at least one head, got H={num_heads} (q), "
                         f"Hkv={num_kv_heads} (k)")
    if num_heads % num_kv_heads:
        raise ValueError(f"k's head count ({num_kv_heads}) must divide q's ({num_heads})")
    if q.shape[-1] < 1:
        raise ValueError(f"q must have a head dim >= 1, got {q.shape[-1]}")
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        _check_last_dim_contiguous(name, tensor)
    return varlen


def check_not_meta(name: str, tensor) -> None:
    """The entry points compute on values: a tensor on the meta device (a shape without values)
    is refused by name. The validation functions themselves accept meta tensors, so a call's
    shapes can be described (`AttentionProblem`) without memory."""
    if isinstance(tensor, torch.Tensor) and tensor.is_meta:
        raise ValueError(f"{name} is on the meta device (a shape without values); attention "
                         "computes on values: pass tensors on a CPU or CUDA device")


def _check_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _check_same_device(name: str, tensor: torch.Tensor, q: torch.Tensor) -> None:
    if tensor.device != q.device:
        raise ValueError(f"{name} must be on q's device ({q.device}), got {tensor.device}")


def _check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got strides "
                         f"{tuple(tensor.stride())}; call .contiguous() first")


# --- sequences -----------------------------------------------------------------------------------

def _host_pair(host_cu_seqlens) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The trusted callers' ``(cu_q, cu_k)`` as tuples of ints (None stays None: padded)."""
    if host_cu_seqlens is None:
        return None
    if not isinstance(host_cu_seqlens, (tuple, list)) or len(host_cu_seqlens) != 2:
        raise TypeError(f"host_cu_seqlens must be a pair (cu_q, cu_k) of int sequences, got "
                        f"{type(host_cu_seqlens).__name__}")
    return tuple(tuple(int(x) for x in cu) for cu in host_cu_seqlens)


def _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k,
                      host_cu_seqlens) -> tuple[tuple[int, ...], tuple[int, ...]]:
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_tensor(name, cu)
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name} must be 1-D (S+1,) with S >= 1, got shape {tuple(cu.shape)}")
        _check_same_device(name, cu, q)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_k must have the length of cu_seqlens_q (S+1 = "
                         f"{cu_seqlens_q.numel()}), got {cu_seqlens_k.numel()}")
    num = cu_seqlens_q.numel()
    if host_cu_seqlens is None:
        # One transfer for both: on CUDA the only synchronisation the sequence checks need.
        host = torch.cat([cu_seqlens_q, cu_seqlens_k]).tolist()
        cu_q, cu_k = tuple(host[:num]), tuple(host[num:])
    else:
        cu_q, cu_k = host_cu_seqlens
        if (len(cu_q), len(cu_k)) != (num, num):
            raise ValueError(f"host_cu_seqlens must hold the values of cu_seqlens_q and "
                             f"cu_seqlens_k ({num} each), got {len(cu_q)} and {len(cu_k)}")
    for name, cu, total, tensor_name in (("cu_seqlens_q", cu_q, q.shape[0], "q"),
                                         ("cu_seqlens_k", cu_k, k.shape[0], "k")):
        if cu[0] != 0:
            raise ValueError(f"{name} must start at 0, got {cu[0]}")
        if any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"{name} must be non-decreasing, got {list(cu)}")
        if cu[-1] != total:
            raise ValueError(f"{name} must end at the number of rows of {tensor_name} "
                             f"({total}), got {cu[-1]}")
    return cu_q, cu_k


def sequence_lengths(cu: Sequence[int]) -> list[int]:
    """Host values of sequence boundaries ``cu`` -> each sequence's length."""
    return [b - a for a, b in zip(cu, cu[1:])]


def block_offsets(cu: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Host values of sequence boundaries ``cu`` -> the first global block of each sequence when
    every sequence is cut into blocks of ``block_size`` (the last one may be partial)."""
    offsets = [0]
    for length in sequence_lengths(cu):
        offsets.append(offsets[-1] + -(-length // block_size))
    return tuple(offsets)


def _check_max_seqlen(name: str, value, cu: tuple[int, ...], cu_name: str) -> int:
    longest = max(sequence_lengths(cu))
    if value is None:
        return longest
    value = _check_int(name, value)
    if value < longest:
        raise ValueError(f"{name} must be >= the longest sequence in {cu_name} ({longest}), "
                         f"got {value}")
    _check_int32_seqlen(name, value)
    return value


def _check_int32_seqlen(name: str, value: int) -> None:
    if value > INT32_MAX:
        raise ValueError(f"{name} must be <= 2**31 - 1 ({INT32_MAX}): sequence bounds are int32 "
                         f"and the kernels index rows in int32, got {value}")


def _check_padded_max_seqlen(name: str, value, seqlen: int, tensor_name: str) -> int:
    if value is None:
        return seqlen
    value = _check_int(name, value)
    _check_int32_seqlen(name, value)
    if value != seqlen:
        raise ValueError(f"{name} must be None or {tensor_name}.shape[1] ({seqlen}) for the "
                         f"padded layout, got {value}")
    return value


# --- options -------------------------------------------------------------------------------------

def _check_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def check_bool(name: str, value) -> bool:
    """A bool argument, strictly (a string such as "false" would be silently truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_deterministic(value) -> bool:
    """The backward's ``deterministic`` switch: a bool, so that a stray positional argument or
    a string such as "false" is an error, not a silently truthy mode."""
    return check_bool("deterministic", value)


def check_softmax_scale(value, head_dim: int) -> float:
    """softmax_scale: None (head_dim ** -0.5) or a positive float finite in float32."""
    if value is None:
        return head_dim ** -0.5
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"softmax_scale must be a float or None, got {type(value).__name__} "
                        f"{value!r}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"softmax_scale must be positive and finite, got {value}")
    if value > FLOAT32_MAX:
        raise ValueError(f"softmax_scale must be finite in float32 (<= {FLOAT32_MAX:.6e}), in "
                         f"which scores are scaled, got {value}")
    return value


def _check_compress_factor(value) -> int:
    value = _check_int("compress_factor", value)
    if value < 1:
        raise ValueError(f"compress_factor must be >= 1, got {value}")
    return value


def _check_window_size(value) -> tuple[int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints, got {value!r}")
    left, right = (_check_int("window_size", side) for side in value)
    if left < -1 or right < -1:
        raise ValueError(f"window_size sides must be >= -1 (-1 = unbounded), got {value!r}")
    return (left, right)


def _check_q_start_positions(value, varlen: bool, num_seqs: int,
                             max_seqlen_q: int) -> tuple[int, ...] | None:
    """q_start_positions: host ints, one per sequence, >= 0, packed varlen calls only; None
    where every one is 0 (the same call as without them)."""
    if value is None:
        return None
    if not varlen:
        raise ValueError("q_start_positions: packed varlen calls only (pass cu_seqlens_q/k); "
                         "a padded batch's rows start at position 0")
    if isinstance(value, torch.Tensor) or not isinstance(value, (tuple, list)):
        raise TypeError(f"q_start_positions must be a tuple or list of {num_seqs} ints on the "
                        f"host (one per sequence), got {type(value).__name__}")
    if len(value) != num_seqs:
        raise ValueError(f"q_start_positions must hold one int per sequence ({num_seqs}), got "
                         f"{len(value)}")
    for s, position in enumerate(value):
        if (isinstance(position, bool) or not isinstance(position, numbers.Integral)
                or position < 0 or position > INT32_MAX - max_seqlen_q):
            raise ValueError(f"q_start_positions[{s}] must be an int in [0, "
                             f"{INT32_MAX - max_seqlen_q}] (a row's position stays an int32), "
                             f"got {position!r}")
    positions = tuple(int(p) for p in value)
    return positions if any(positions) else None


def _replace_block_sparse_heads(problem: AttentionProblem, heads: int) -> AttentionProblem:
    fields = dict(problem.__dict__)
    fields["block_sparse_heads"] = heads
    return AttentionProblem(**fields)


# --- block sparsity ------------------------------------------------------------------------------

def _check_block_sparse(name, bs, *, num_heads, num_kv_heads, cu_rows, cu_cols, device,
                        check_contents: bool) -> int:
    """Check compact block-sparse lists against the sequences they index; return Hs.

    ``cu_rows`` are the sequence boundaries cut into row blocks (query tiles in the forward
    layout), ``cu_cols`` the ones cut into column blocks (KV blocks). The sparsity package owns
    the rules of the lists; this adds what only the attention call knows (heads, sequences).
    Without ``check_contents`` only what needs no device read is checked: types, shapes, dtypes,
    devices, heads and the number of sequences.
    """
    from sparsity import validate_block_sparse

    if not check_contents:
        validate_block_sparse(bs, name=name, num_heads=num_heads, num_kv_heads=num_kv_heads,
                              device=device, check_contents=False)
        if bs.row_block_offsets.numel() != len(cu_rows):
            raise ValueError(f"{name}.row_block_offsets has {bs.row_block_offsets.numel() - 1} "
                             "sequences but cu_seqlens_q does not describe the same number of "
                             "sequences")
        return bs.full_count.shape[1]
    as_tensor = lambda cu: torch.tensor(cu, dtype=torch.int32, device=device)  # noqa: E731
    validate_block_sparse(bs, name=name, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          device=device, cu_seqlens_q=as_tensor(cu_rows),
                          cu_seqlens_k=as_tensor(cu_cols))
    return bs.full_count.shape[1]


TRANSPOSED = "block_sparse_transposed"


def check_block_sparse_transposed(transposed, block_sparse, problem: AttentionProblem, *, device,
                                  check_contents: bool) -> None:
    """Check the backward's transposed lists, a ``sparsity.BlockSparseCSR``, against the forward
    lists ``block_sparse`` (already checked) and the sequences of ``problem``.

    Rows are the KV blocks of every sequence (``row_block_offsets`` from ``cu_seqlens_k``), columns
    its query tiles; the block sizes are the forward's, swapped. Without ``check_contents`` nothing
    is read from the device: the lists are taken to be the transpose of ``block_sparse``, and
    only their types, shapes, dtypes, devices, heads, block sizes and the numbers of rows and
    sequences are checked. With it, their entries must equal that transpose.
    """
    if block_sparse is None:
        raise ValueError(f"{TRANSPOSED} was given without block_sparse")
    from sparsity import BlockSparseCSR, check_csr_matches

    if not isinstance(transposed, BlockSparseCSR):
        raise TypeError(f"{TRANSPOSED} must be a sparsity.BlockSparseCSR (build it with "
                        f"sparsity.transpose_block_sparse_csr(block_sparse, ...)), got "
                        f"{type(transposed).__name__}")
    row_offsets = problem.key_block_offsets(block_sparse.col_block_size)
    # The sparsity package owns the rules of the layout: first the checks without device reads.
    check_csr_matches(transposed, block_sparse, num_col_blocks=row_offsets[-1], name=TRANSPOSED)
    if not check_contents:
        return
    # The contents check transposes block_sparse over the CSR's own row offsets, so first make
    # sure those are the sequences' KV blocks (else a kernel reads another sequence's keys).
    if tuple(transposed.row_block_offsets.tolist()) != row_offsets:
        raise ValueError(f"{TRANSPOSED}.row_block_offsets must be the first KV block of each "
                         f"sequence, {list(row_offsets)}, got "
                         f"{transposed.row_block_offsets.tolist()}")
    check_csr_matches(transposed, block_sparse, num_col_blocks=row_offsets[-1], name=TRANSPOSED,
                      check_contents=True)

