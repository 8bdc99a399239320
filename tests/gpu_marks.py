"""The skip mark of tests that need our sm_90 kernels on a GPU (they also carry the `gpu` mark,
which CI deselects), and a recorder of the backward kernels launched. One definition for
tests/kernels and tests/nsa."""
import pytest
import torch


def sm90_available() -> bool:
    """A CUDA device of compute capability 9.0 (Hopper) is present."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


requires_sm90 = pytest.mark.skipif(not sm90_available(), reason="needs an sm_90 GPU")


def record_backward_launches(monkeypatch) -> list:
    """The `BwdSpec` of every sm90 backward kernel launch from here on, in order (wraps
    kernels.sm90.backward._launch): GPU tests assert the variant the dispatcher picked ran."""
    from kernels.sm90 import backward

    launched = []
    launch = backward._launch
    monkeypatch.setattr(backward, "_launch",
                        lambda spec, *args: (launched.append(spec), launch(spec, *args))[1])
    return launched
