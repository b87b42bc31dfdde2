"""Runtime scalars as ``range()`` bounds under Triton's interpreter, whatever the NumPy.

Triton 3.6's interpreter turns a scalar tensor into a Python int with ``int(data)`` on a one-element
array, which NumPy 2.4 refuses; every kernel that loops ``for r0 in range(row_start, row_end, B)``
(the norms' backward, the experts op) failed on torch 2.11 / triton 3.6 on the CPU with a fresh
NumPy.  ``patchdsl.kernel_support.interp.index_scalars_like_newer_triton`` (applied by ``ensure_triton`` when the
interpreter is on) squeezes the array first, as later Tritons do.  These tests run a kernel with such
a loop against a float64 reference, check the probe on both behaviours, and that the replacement
happens only where the probe says it is needed.
"""

import numpy as np
import pytest
import torch

from patchdsl.kernel_support import interp as _interp
from patchdsl.codegen.env import ensure_triton, target

triton = ensure_triton()
import triton.language as tl  # noqa: E402

INTERP = target() == "interpreter"
DEVICE = "cpu" if INTERP else "cuda"
NUMPY_REFUSES = tuple(int(v) for v in np.__version__.split(".")[:2]) >= (2, 4)


@triton.jit
def _row_sums(X, OUT, n_rows, rows_per_prog, N: tl.constexpr, ROWS: tl.constexpr):
    # each program sums rows [row_start, row_end) in blocks of ROWS: range() over runtime scalars
    pid = tl.program_id(0)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, n_rows)
    cols = tl.arange(0, N)
    for r0 in range(row_start, row_end, ROWS):
        r = r0 + tl.arange(0, ROWS)
        x = tl.load(X + r[:, None] * N + cols[None, :], mask=(r < row_end)[:, None], other=0.0)
        tl.store(OUT + r, tl.sum(x, axis=1), mask=r < row_end)


@pytest.mark.parametrize("n_rows, rows_per_prog", [(1, 1), (7, 3), (33, 8), (64, 64)])
def test_a_loop_over_runtime_scalar_bounds_runs_and_is_right(n_rows, rows_per_prog):
    x = torch.randn(n_rows, 16, dtype=torch.float32)
    out = torch.full((n_rows,), float("nan"), device=DEVICE)
    _row_sums[(triton.cdiv(n_rows, rows_per_prog),)](x.to(DEVICE), out, n_rows, rows_per_prog, N=16, ROWS=4)
    torch.testing.assert_close(out.cpu().double(), x.double().sum(1), rtol=1e-6, atol=1e-5)


def _installs(index):
    """A stand-in for Triton's ``_patch_lang_tensor`` that installs ``index`` as ``__index__``."""
    def patch(tensor, scope):
        scope.set_attr(tensor, "__index__", index)
    return patch


PROBES = [   # (row, __index__ as a Triton installs it, does it fail on this NumPy)
    ("triton 3.6: int(data)", lambda self: int(self.handle.data), NUMPY_REFUSES),
    ("triton 3.9: int(data.squeeze())", lambda self: int(self.handle.data.squeeze()), False),
    ("a wrong value", lambda self: 0, True),
]


@pytest.mark.parametrize("row, index, fails", PROBES, ids=[p[0] for p in PROBES])
def test_the_probe_tells_a_failing_index_from_a_working_one(row, index, fails):
    assert _interp._index_fails(_installs(index)) is fails


@pytest.mark.skipif(not INTERP, reason="the fix is for Triton's interpreter only")
def test_replaced_only_where_the_probe_fails(monkeypatch):
    from triton.runtime import interpreter as ti
    assert _interp.index_scalars_like_newer_triton() is True
    now = ti._patch_lang_tensor
    assert not _interp._index_fails(now)
    orig = getattr(now, "__wrapped__", None)
    if orig is None:
        assert not _interp._index_fails(now)         # this Triton and NumPy work as they are
        pytest.skip("nothing to replace on this Triton / NumPy")
    assert _interp._index_fails(orig)                 # what Triton does on its own here
    # an untested Triton is left alone
    monkeypatch.setattr(ti, "_patch_lang_tensor", orig)
    monkeypatch.setattr(_interp, "_index_fixed", False)
    monkeypatch.setattr(triton, "__version__", "4.1.0")
    assert _interp.index_scalars_like_newer_triton() is False
    assert ti._patch_lang_tensor is orig
