"""Test set-up: the Triton interpreter when there is no GPU, a private kernel cache."""

import os
import tempfile

# CPU threads: each pytest-xdist worker gets its share of the cores.  torch's default (every core in
# every worker, and in every subprocess a test starts) oversubscribes the CPU: with `-n 2` on the
# 2-core CI machine, OpenMP's waiting threads made tests/runtime/test_mutations.py take 76 s instead of 30.
# Set before torch is imported (OpenMP reads the variable once); subprocesses inherit it.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _workers > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))

# Must happen before anything imports triton.
try:
    import torch

    _cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The maintenance tools (tools/patchdsl_tools, outside the wheel) for the tests' subprocesses too (the
# bench scripts the tests run): pyproject's pytest `pythonpath` puts them on this process's path only.
_tools = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
if _tools not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_tools, os.environ.get("PYTHONPATH", "")) if p)
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
