"""Benchmarks: per-op (``patchdsl bench ops``) and end-to-end training (``patchdsl bench e2e``).

* :mod:`.cases`  - the op families: shapes, inputs, float64 references, bytes/FLOPs, peers
* :mod:`.timing` - CUDA-graph replay timing with L2-cold rotation, eager wall/host time, memory, ceilings
* :mod:`.runner` - runs (family, shape, implementation) units, each wrapped; writes the ops JSON
* :mod:`.e2e`    - Qwen3-0.6B training throughput: HF, patchdsl, torch.compile, Liger
* :mod:`.report` - the compact tables and the issue's targets
* :mod:`.plot`   - one PNG (matplotlib optional)
* :mod:`.cli`    - ``run(argv)``, called by ``patchdsl bench``

Nothing here imports torch at import time.
"""

__all__ = ["run"]


def run(argv):
    from .cli import run as _run

    return _run(list(argv))
