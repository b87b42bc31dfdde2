"""transformers' attention-mask decisions made as in an eager step, in the two places where they are not:
inside a torch.compile'd call (:func:`eager_mask_decisions`, for :mod:`.compile`) and during a CUDA-graph
capture and its checked warm-up (:func:`as_if_capturing`, :func:`mask_as_in_eager`, for :mod:`.graphs`).

The one place to look on a transformers upgrade: which of its functions decide (``find_packed_sequence_indices``,
:data:`MASK_SKIP_DECISIONS`, the signature :data:`SKIP_PARAMS` of the one reimplemented here), and what an eager
step answers.  Two of the decisions read tensor data (do the positions restart?  is the padding mask all ones?),
so while tracing (``is_tracing()``: Dynamo, or a CUDA stream capturing) transformers answers "build a mask".
Where the answer reads no data it is given as eager gives it: the model's own positions are never packed
(:func:`not_packed`); without a padding mask the causal skip depends on shapes only.  Under Dynamo that is
:func:`causal_skip_as_in_eager` (transformers' code minus its tracing exit: a flag cannot be toggled inside a
traced call); under a capture it is transformers' own function run with the capture flag off.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from typing import Any, Callable, Iterator

# the signature of transformers' _ignore_causal_mask_sdpa in 5.17-5.24 (another keeps its own answer)
SKIP_PARAMS = ("padding_mask", "q_length", "kv_length", "q_offset", "kv_offset", "local_attention_size")
# transformers decides whether SDPA may run with ``is_causal=True`` and no mask (the flash kernel) or
# needs a materialised (batch, 1, q, kv) mask (a slower kernel over every block) in these functions;
# their first argument is the 2-D padding mask or None.
MASK_SKIP_DECISIONS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")

_lock = threading.RLock()
_depth = 0
_saved: dict[str, Any] = {}
_ORIGINAL: dict[str, Any] = {}



def _torch():
    import torch

    return torch


def not_packed(position_ids: Any) -> None:
    """``find_packed_sequence_indices`` for the model's own positions (an ``arange``): not packed."""
    return None


def causal_skip_as_in_eager(padding_mask: Any, q_length: int, kv_length: int, q_offset: Any, kv_offset: Any,
                             local_attention_size: Any = None) -> bool:
    """``_ignore_causal_mask_sdpa`` without a padding mask and with int offsets: eager's answer, from
    shapes only (transformers' own code, minus its ``is_tracing`` early exit).  Anything that reads
    data goes to transformers' function."""
    torch = _torch()
    if padding_mask is not None or isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor):
        return _ORIGINAL["_ignore_causal_mask_sdpa"](padding_mask, q_length, kv_length, q_offset, kv_offset,
                                                     local_attention_size)
    if local_attention_size is not None and kv_length >= local_attention_size:
        return False
    if q_length == 1 or kv_length == q_length:
        return True
    return q_offset == 0


def _replacements(own_positions: bool) -> dict[str, Any]:
    mu = sys.modules.get("transformers.masking_utils")
    if mu is None:
        return {}
    out: dict[str, Any] = {}
    skip = getattr(mu, "_ignore_causal_mask_sdpa", None)
    if skip is not None and skip is not causal_skip_as_in_eager:
        try:
            names = tuple(inspect.signature(skip).parameters)
        except (TypeError, ValueError):
            names = ()
        if names == SKIP_PARAMS:          # the signature of 5.17-5.24; another one keeps its own answer
            _ORIGINAL.setdefault("_ignore_causal_mask_sdpa", skip)
            out["_ignore_causal_mask_sdpa"] = causal_skip_as_in_eager
    packed = getattr(mu, "find_packed_sequence_indices", None)
    if own_positions and packed is not None and packed is not not_packed:
        out["find_packed_sequence_indices"] = not_packed
    return out


@contextlib.contextmanager
def eager_mask_decisions(own_positions: bool = True) -> Iterator[list[str]]:
    """While inside, transformers' data-reading mask decisions give eager's answers where they read no
    data (see the module docstring).  Yields the names replaced.  Re-entrant."""
    global _depth
    mu = sys.modules.get("transformers.masking_utils")
    with _lock:
        if _depth == 0 and mu is not None:
            for name, fn in _replacements(own_positions).items():
                _saved[name] = getattr(mu, name)
                setattr(mu, name, fn)
        _depth += 1
        names = sorted(_saved)
    try:
        yield names
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for name, fn in _saved.items():
                    setattr(mu, name, fn)
                _saved.clear()


# ------------------------------------------------------------------ during a CUDA-graph capture
@contextlib.contextmanager
def as_if_capturing() -> Iterator[None]:
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
MASK_SKIP_DECISIONS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")


@contextlib.contextmanager
def mask_as_in_eager(model_positions: bool) -> Iterator[None]:
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
    originals = {name: getattr(mu, name) for name in MASK_SKIP_DECISIONS if callable(getattr(mu, name, None))}
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

    for name, orig in originals.items():
        setattr(mu, name, shape_only(orig))
    if callable(packed):
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
