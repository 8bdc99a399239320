"""Launch plumbing shared by every sm90 launcher: torch tensors to CuTe DSL arguments, one
compile per kernel and spec per process, the launch on the current stream.

The attention launchers (`forward.py`, `backward.py`), the glue kernels (gated sum, row means,
block selection and ranking, list layouts) and the compile cache (`compile.py`) all go through
here, so there is one way a kernel is compiled and launched. Importing this module needs torch
only; the CuTe DSL is imported when a kernel is compiled or launched.
"""
from __future__ import annotations

import functools
import os

import torch

# apache-tvm-ffi launches cost far less host time than DLPack (docs/kernels.md); this turns it
# off (NSA_CUTE_TVM_FFI=0) to compare or to work around a tvm-ffi problem.
TVM_FFI_ENV = "NSA_CUTE_TVM_FFI"

_COMPILED: dict[tuple[type, object, bool], object] = {}


def as_cute(t: torch.Tensor | None, tvm_ffi: bool = False, assumed_align: int | None = None):
    """A cute tensor view of t with every extent and stride dynamic but the last (stride 1).
    Assumed 16-byte aligned for 16-bit elements and 4-byte otherwise, unless given."""
    from cutlass.cute.runtime import from_dlpack

    if t is None:
        return None
    if assumed_align is None:
        assumed_align = 16 if t.element_size() == 2 else 4
    return from_dlpack(t.detach(), assumed_align=assumed_align,
                       enable_tvm_ffi=tvm_ffi).mark_layout_dynamic(leading_dim=t.dim() - 1)


@functools.lru_cache(maxsize=1)
def tvm_ffi_available() -> bool:
    """Launch through apache-tvm-ffi when installed (NSA_CUTE_TVM_FFI=0 turns it off)."""
    if os.environ.get(TVM_FFI_ENV, "1") == "0":
        return False
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        return False
    return True


def has_aligned_rows(t: torch.Tensor) -> bool:
    """A unit last stride and 16-byte aligned rows (16-bit elements): what the kernels' TMA
    loads and paired stores assume."""
    return t.stride(-1) == 1 and not any(s % 8 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0


def aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """t itself when its rows are 16-byte aligned with a unit last stride, else a copy."""
    return t if has_aligned_rows(t) else t.contiguous()


@functools.lru_cache(maxsize=64)
def uniform_cu_seqlens(batch: int, seqlen: int, device: torch.device) -> torch.Tensor:
    """The bounds of a padded batch seen as `batch` packed sequences of `seqlen` rows, cached
    per shape so that a padded launch allocates nothing extra."""
    from sparsity import uniform_cu_seqlens as bounds

    return bounds(batch, seqlen, device=device)


@functools.lru_cache(maxsize=64)
def query_positions(positions: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """q_start_positions (host ints, one per sequence) as the (S,) int32 tensor the kernels
    read, cached per value: a layer's calls repeat them, and each new one is one small copy."""
    return torch.tensor(positions, dtype=torch.int32).to(device)


def compiled_once(kernel_class: type, spec, example_args, tvm_ffi: bool = False):
    """`kernel_class(spec)` compiled on first use with `example_args()` (dynamic-layout cute
    tensors, scalars, stream), then cached in memory by (class, spec, tvm_ffi).

    With `tvm_ffi` the result is called with torch tensors and Python scalars on the current
    stream (apache-tvm-ffi), which costs far less host time per launch than converting every
    argument through DLPack; the example arguments then end with a fake env stream.
    """
    key = (kernel_class, spec, tvm_ffi)
    kernel = _COMPILED.get(key)
    if kernel is None:
        import cutlass.cute as cute

        options = "--enable-tvm-ffi" if tvm_ffi else None
        kernel = cute.compile(kernel_class(spec), *example_args(), options=options)
        _COMPILED[key] = kernel
    return kernel


def _current_stream(device: torch.device):
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)


def launch_compiled(compiled, spec, tensors, scalars, typed_scalars, optional, as_cute_view=None):
    """Compile `spec` with `compiled` (`kernels.sm90.compile.compiled_*`) on first use, then
    launch on the current stream. `tensors` and `optional` are torch tensors (or None), passed
    around the Python `scalars`; `typed_scalars` turns those into DSL types (needed only to
    compile, or for a DLPack launch). `as_cute_view(t, tvm_ffi)` makes a tensor's cute view
    (default `as_cute`). The attention launchers' way in."""
    from cutlass.cute.runtime import make_fake_stream

    view = as_cute_view or as_cute
    if tvm_ffi_available():
        kernel = compiled(spec, lambda: (
            *(view(t, True) for t in tensors), *typed_scalars(scalars),
            *(view(t, True) for t in optional), make_fake_stream(use_tvm_ffi_env_stream=True),
        ), tvm_ffi=True)
        kernel(*tensors, *scalars, *optional)
        return
    args = (*(view(t) for t in tensors), *typed_scalars(scalars),
            *(view(t) for t in optional), _current_stream(tensors[0].device))
    compiled(spec, lambda: args)(*args)


def launch_on_current_stream(kernel_class: type, spec, fake_arguments, args, device):
    """`kernel_class(spec)`, compiled once per process (`compiled_once`) on
    `fake_arguments(spec)` plus a stream, launched on `args` on the device's current stream.
    args: torch tensors, None, and Python ints or floats where the fakes hold a DSL scalar
    (typed like it). The glue kernels' way in (gated sum, row means, selection, list layouts)."""
    if tvm_ffi_available():
        from cutlass.cute.runtime import make_fake_stream

        compiled_once(kernel_class, spec, lambda: (
            *fake_arguments(spec), make_fake_stream(use_tvm_ffi_env_stream=True)),
            tvm_ffi=True)(*args)
        return
    cute_args = tuple(
        as_cute(arg) if isinstance(arg, torch.Tensor)
        else type(fake)(arg) if isinstance(arg, (int, float)) else arg
        for arg, fake in zip(args, fake_arguments(spec))) + (_current_stream(device),)
    compiled_once(kernel_class, spec, lambda: cute_args)(*cute_args)
