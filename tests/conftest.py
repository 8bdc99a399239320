"""Shared test configuration: GPU tests carry the `gpu` marker and skip without CUDA."""
import os

# CuTe DSL kernels compile for Hopper on any machine (no GPU needed); see test_sm90_compile.py.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
