"""Test set-up: the Triton interpreter when there is no GPU, a private kernel cache."""

import os
import tempfile

# Must happen before anything imports triton.
try:
    import torch

    _cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("PATCHDSL_CACHE", tempfile.mkdtemp(prefix="patchdsl-test-cache-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


if _cuda:
    import gc

    import pytest

    @pytest.fixture(autouse=True)
    def _release_gpu_memory():
        """Kernel tests at real sizes hold GBs of float64 references; several pytest-xdist workers
        share one GPU, and each one's caching allocator would otherwise keep what it freed."""
        yield
        gc.collect()
        torch.cuda.empty_cache()
