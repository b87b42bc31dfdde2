"""patchdsl's maintenance tools, outside the product (not in the wheel): the coverage census
(:mod:`.census`, writes docs/coverage.md), the ops reference generator (:mod:`.docgen`, writes
docs/ops.md) and the GPU benchmarks (:mod:`.bench`).  They use patchdsl through its package like any
user; importable from a checkout (``pip install -e .`` puts ``tools/`` on the path; pytest's
``pythonpath`` setting does for the tests)."""
