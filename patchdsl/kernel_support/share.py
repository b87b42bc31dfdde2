"""Runtime support of generated kernel modules: one derived tensor computed once for its readers.

Sibling projections read the same activation: ``q_proj``, ``k_proj`` and ``v_proj`` of an
attention block all take the input norm's output, ``gate_proj`` and ``up_proj`` the post-attention
norm's.  fp8_linear quantises its input (forward) and the input transposed along tokens (backward);
done per projection, the same fp8 copy is made three times.  :func:`once` keeps the last few
derived values, keyed by the *identity* of the tensor they were derived from, so the second and
third sibling reuse the first one's.

Safe by construction:

* the key is the source tensor object (``id``) and a weak reference to it, checked on every hit: a
  value is returned only while its source is alive, so an id reused by a later tensor never matches;
* the source's ``_version`` (bumped by every in-place write) is part of the key: a tensor written
  in place since is a miss;
* the tag names what was derived (``"rows:e4m3"``, ``"cols:e4m3:pad16"`` ...); readers that derive
  something else do not share;
* a handful of entries (``SLOTS``), least recently used out first: siblings call one after the
  other, so a larger cache would only hold fp8 copies alive longer.

Torch keeps a tensor's Python object alive as long as autograd holds the tensor (PyObject
preservation), so a saved input unpacked in the backward of ``q_proj`` and of ``k_proj`` is the same
object: the backward's siblings share too.  ``PATCHDSL_SHARE=0`` turns sharing off (A/B runs).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable

SLOTS = 6
_lock = threading.Lock()
_entries: "OrderedDict[tuple[int, int, str], tuple[weakref.ref, Any]]" = OrderedDict()
stats = {"hits": 0, "misses": 0}


def enabled() -> bool:
    return os.environ.get("PATCHDSL_SHARE", "1") != "0"


def once(src: Any, tag: str, make: Callable[[], Any]) -> Any:
    """``make()``, or the value it returned for this same ``src`` (same object, not written since)
    and ``tag``."""
    if not enabled():
        return make()
    key = (id(src), int(src._version), tag)
    with _lock:
        hit = _entries.get(key)
        if hit is not None and hit[0]() is src:
            _entries.move_to_end(key)
            stats["hits"] += 1
            return hit[1]
    value = make()
    try:
        ref = weakref.ref(src)
    except TypeError:          # not weak-referenceable: not shared
        return value
    with _lock:
        _entries[key] = (ref, value)
        _entries.move_to_end(key)
        while len(_entries) > SLOTS:
            _entries.popitem(last=False)
        stats["misses"] += 1
    return value


def clear() -> None:
    with _lock:
        _entries.clear()
        stats.update(hits=0, misses=0)


@contextlib.contextmanager
def switched(on: bool):
    """Sharing on or off (``PATCHDSL_SHARE``) inside the block, as it was after it (A/B runs); the
    table and its stats cleared on entry and on exit."""
    before = os.environ.get("PATCHDSL_SHARE")
    os.environ["PATCHDSL_SHARE"] = "1" if on else "0"
    clear()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATCHDSL_SHARE", None)
        else:
            os.environ["PATCHDSL_SHARE"] = before
        clear()
