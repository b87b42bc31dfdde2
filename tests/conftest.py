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
