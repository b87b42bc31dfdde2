"""Gradient parity of a patched model against a float64 reference (``patchdsl verify``).

    report = patchdsl.verify("specs/qwen3.kpatch", model, dtype="bf16")
    report.render_table()          # rich table + one-line verdict
    report.to_json()               # {"passed", "sites": [...], "end_to_end": [...], "steps": [...], ...}
    sys.exit(report.exit_code())   # 0 pass, 1 fail

The tolerance rule is in :mod:`patchdsl.parity.compare` and docs/verify.md; the float64 reference
of models too large to copy whole in float64 is streamed layer by layer (:mod:`.stream`); the
Liger-style convergence test over real text is :mod:`.convergence`.
"""

from .compare import FACTOR, FLOORS, Tolerance, errors, tolerance_for
from .report import Check, ParityReport
from .run import verify
from .stream import VerifyError, VerifyOutOfMemory

__all__ = ["FACTOR", "FLOORS", "Check", "ParityReport", "Tolerance", "VerifyError", "VerifyOutOfMemory", "errors",
           "tolerance_for", "verify"]
