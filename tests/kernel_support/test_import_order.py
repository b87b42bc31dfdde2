"""patchdsl works whatever was imported first (on a machine without a GPU: the interpreter switch).

Each case runs in a fresh interpreter, since which modules are imported, and when TRITON_INTERPRET is
read, is process state.  The child patches an RMSNorm, runs the fused kernel forward and backward and
compares with the module's own output.
"""

import os
import subprocess
import sys

import pytest
import torch

# (the usual order, patchdsl before triton, is what every other test runs)
FIRST = {
    "transformers Trainer": "from transformers import Trainer",   # imports triton on the way
    "triton.language": "import triton.language as tl",
}

CHILD = """
{first}
import torch
import patchdsl
from patchdsl.runtime import patch_module
from transformers.models.llama.modeling_llama import LlamaRMSNorm
torch.manual_seed(0)
n = LlamaRMSNorm(32)
with torch.no_grad():
    n.weight.uniform_(0.5, 1.5)
x = torch.randn(4, 32, requires_grad=True)
ref = n(x)
h = patch_module(n, "fused_rmsnorm")
y = n(x)
y.sum().backward()
torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
assert "forward" in n.__dict__
print("OK")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter switch only happens without a GPU")
@pytest.mark.parametrize("first", list(FIRST), ids=list(FIRST))
def test_any_import_order_works(first):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", CHILD.format(first=FIRST[first])], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
