"""The capture runs the code paths an eager step runs: transformers' tracing-dependent decisions
(``is_tracing()`` includes "a CUDA stream is capturing") made as in eager for the warm-up and the
capture.  Used by :mod:`.graphs`."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

from .graph_checks import _torch

@contextlib.contextmanager
def _as_if_capturing() -> Iterator[None]:
    """The checked warm-up takes the code paths the capture will take.  transformers skips its
    data-dependent host checks (``find_packed_sequence_indices``'s ``.all()``, the "can the mask be
    dropped" test) when ``is_tracing()`` is true, which includes "a CUDA stream is capturing" in the
    versions whose ``is_tracing`` consults ``is_cuda_stream_capturing``; only there is that answer
    made true for the warm-up (elsewhere the capture would hit the same sync, so it must be refused).
    Batches with ``position_ids`` are refused before this (packed sequences would not be detected)."""
    mod = sys.modules.get("transformers.utils.import_utils")
    fn = getattr(mod, "is_tracing", None) if mod is not None else None
    if fn is None or "is_cuda_stream_capturing" not in getattr(getattr(fn, "__code__", None), "co_names", ()) \
            or not callable(getattr(mod, "is_cuda_stream_capturing", None)):
        yield
        return
    orig = mod.is_cuda_stream_capturing
    mod.is_cuda_stream_capturing = lambda: True
    try:
        yield
    finally:
        mod.is_cuda_stream_capturing = orig


# transformers decides whether SDPA may run with ``is_causal=True`` and no mask (the flash kernel) or
# needs a materialised (batch, 1, q, kv) mask (a slower kernel over every block) in these functions;
# their first argument is the 2-D padding mask or None.
_MASK_SKIP_DECISIONS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")


@contextlib.contextmanager
def _mask_as_in_eager(model_positions: bool) -> Iterator[None]:
    """During the capture (and the checked warm-up that stands for it), let transformers build the
    attention mask an eager step builds: none, for an unpadded causal batch.

    Two of transformers' mask decisions read tensor data, so they answer "keep a mask" whenever
    ``is_tracing()`` is true, and ``is_tracing()`` includes "a CUDA stream is capturing":

    * ``find_packed_sequence_indices(position_ids)`` checks on the host whether the positions restart
      (packed sequences); in a capture it returns its per-token sequence index instead of None, and a
      full mask is built from it.  ``graph_step`` refuses batches with ``position_ids``, so with the
      default loss (``model(**batch)``) the positions are the model's own ``arange``, which never
      restart: for those (``model_positions``) the answer is eager's, None.  With a custom
      ``loss_fn`` the positions could be anything, so the in-capture answer is kept.
    * ``_ignore_causal_mask_sdpa`` (5.17; 5.24 only with a padding mask): without a padding mask the
      decision reads no tensor data (the query / key lengths, an int offset, the sliding window, all
      fixed for one captured shape), so it is made with the capture flag off.  Calls with a padding
      mask, or with a tensor offset (a static cache), keep the in-capture answer.

    Measured on the H200 (a kernel-by-kernel profile, bench/NOTES.md; Qwen3-0.6B 4 x 2048): with the mask, cuDNN's SDPA
    forward and backward took 44.7 ms of a 108 ms replay against 14.6 ms eagerly."""
    mu = sys.modules.get("transformers.masking_utils")
    iu = sys.modules.get("transformers.utils.import_utils")
    if mu is None or iu is None or not callable(getattr(iu, "is_cuda_stream_capturing", None)):
        yield
        return
    originals = {name: getattr(mu, name) for name in _MASK_SKIP_DECISIONS if callable(getattr(mu, name, None))}
    packed = getattr(mu, "find_packed_sequence_indices", None) if model_positions else None
    torch = _torch()

    def shape_only(orig: Callable) -> Callable:
        def decide(padding_mask: Any = None, *args: Any, **kwargs: Any) -> Any:
            if padding_mask is not None or any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
                return orig(padding_mask, *args, **kwargs)
            flag = iu.is_cuda_stream_capturing
            iu.is_cuda_stream_capturing = _not_capturing
            try:
                return orig(padding_mask, *args, **kwargs)
            finally:
                iu.is_cuda_stream_capturing = flag

        decide.__wrapped__ = orig
        return decide

    def not_packed(position_ids: Any) -> None:
        return None

    for name, orig in originals.items():
        setattr(mu, name, shape_only(orig))
    if callable(packed):
        not_packed.__wrapped__ = packed
        mu.find_packed_sequence_indices = not_packed
    try:
        yield
    finally:
        for name, orig in originals.items():
            setattr(mu, name, orig)
        if callable(packed):
            mu.find_packed_sequence_indices = packed


def _not_capturing() -> bool:
    return False
