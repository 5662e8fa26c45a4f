"""Test set-up: kernels run in Triton's interpreter on the CPU unless a GPU test asks for CUDA.

TRITON_INTERPRET must be set before Triton decorates any kernel, so it is set here, at collection time.
The kernel cache and the tuned-table directory are redirected to temporary folders for the whole session.
"""

import os
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("LIGER_GEN_CACHE_DIR", tempfile.mkdtemp(prefix="liger_gen_kernels_"))
os.makedirs(os.environ["LIGER_GEN_CACHE_DIR"], mode=0o700, exist_ok=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """The device kernel tests run on: CUDA when present, else the CPU through the interpreter."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
