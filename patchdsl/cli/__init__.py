"""The ``patchdsl`` command line.  It only calls the pipeline's stages.

Exit codes: 0 success, 1 a check failed (verify), 2 bad input (spec or model errors).
Spec errors never print a Python traceback.
"""

from . import commands, run  # noqa: F401  (each registers its commands on main)
from .app import main

__all__ = ["main"]
