"""The skip mark of tests that need our sm_90 kernels on a GPU (they also carry the `gpu` mark,
which CI deselects). One definition for tests/kernels and tests/nsa."""
import pytest
import torch


def sm90_available() -> bool:
    """A CUDA device of compute capability 9.0 (Hopper) is present."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


requires_sm90 = pytest.mark.skipif(not sm90_available(), reason="needs an sm_90 GPU")
