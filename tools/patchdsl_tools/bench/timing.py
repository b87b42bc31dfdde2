"""Timing and memory primitives for the benchmarks.

On a CUDA device:

* GPU time is the median over many replays of a CUDA graph.  The graph holds one call per
  input set (K sets, rotated so their bytes exceed the L2 several times), so each call starts
  with cold caches for its own data; time per call = replay time / K.  Code that cannot be
  captured (a host synchronisation, ``.item()``, a pageable copy) is detected first with
  ``torch.cuda.set_sync_debug_mode("error")`` and timed with CUDA events around an eager loop
  instead; the record says which method was used.
* Eager per-call wall time: N calls issued back to back after a sync, then a sync; ``host_us``
  is the time to issue them (the CPU cost of one call while the GPU is busy), ``eager_ms`` the
  wall time per call.
* Peak memory: ``torch.cuda.max_memory_allocated`` minus the allocation before the call.

On the CPU (``--device cpu``, used by the tests) the same functions time with
``time.perf_counter``; no graphs, no memory numbers.  Timing never decides a test's outcome.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence


def is_cuda(device: Any) -> bool:
    return str(device).startswith("cuda")


def device_index(device: Any) -> int:
    """The CUDA device index of ``device`` ("cuda" alone means the current device)."""
    import torch

    d = torch.device(device)
    return d.index if d.index is not None else torch.cuda.current_device()


def sync(device: Any) -> None:
    if is_cuda(device):
        import torch

        torch.cuda.synchronize()


@dataclass
class Timed:
    """A per-call time in ms with its spread (20th and 80th percentile) and how it was measured."""

    ms: float
    p20: float
    p80: float
    method: str
    reps: int

    def to_json(self) -> dict[str, Any]:
        return {"ms": self.ms, "p20": self.p20, "p80": self.p80, "method": self.method, "reps": self.reps}


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    i = min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))
    return s[i]


def _summary(per_call: list[float], method: str) -> Timed:
    return Timed(statistics.median(per_call), _quantile(per_call, 0.2), _quantile(per_call, 0.8), method,
                 len(per_call))


def _reps_for(est_ms: float, target_ms: float, lo: int, hi: int) -> int:
    if est_ms <= 0:
        return hi
    return int(max(lo, min(hi, target_ms / est_ms)))


# ----------------------------------------------------------------------------- host-sync probe
def makes_host_sync(fn: Callable[[], Any], device: Any) -> str | None:
    """Run ``fn`` once with synchronising CUDA calls turned into errors; return the error text if it syncs."""
    if not is_cuda(device):
        return None
    import torch

    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return None
    except RuntimeError as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        return msg[:200]
    finally:
        torch.cuda.set_sync_debug_mode(old)
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- CUDA graph timing
def capture_graph(calls: Sequence[Callable[[], Any]], stream: Any, prepare: Callable[[], Any] | None = None):
    """Capture one graph running ``calls`` in order on ``stream``; returns (graph, keep-alive).

    ``prepare`` runs on ``stream`` before capture (not captured): e.g. the forward whose backward
    is captured, so autograd runs the backward on the same stream.
    """
    import torch

    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        if prepare is not None:
            prepare()
        for c in calls:          # warm-up on the capture stream (allocator, lazy init)
            c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    keep: list[Any] = []
    # What torch.cuda.graph() does, minus its gc.collect() (slow with a large heap, once per capture).
    with torch.cuda.stream(stream):
        g.capture_begin()
        try:
            for c in calls:
                keep.append(c())
        finally:
            g.capture_end()
    torch.cuda.synchronize()
    return g, keep


def time_graph(g: Any, k: int, target_ms: float = 150.0, min_reps: int = 5, max_reps: int = 200) -> Timed:
    """Median replay time of ``g`` divided by ``k`` (the calls it holds)."""
    import torch

    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(3):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    est = s.elapsed_time(e) / 3
    reps = _reps_for(est, target_ms, min_reps, max_reps)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        g.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return _summary([a.elapsed_time(b) / k for a, b in zip(starts, ends)], "cuda_graph")


def time_events(calls: Sequence[Callable[[], Any]], target_ms: float = 150.0, min_reps: int = 3,
                max_reps: int = 100) -> Timed:
    """CUDA events around eager loops over ``calls`` (for code a graph cannot capture)."""
    import torch

    k = len(calls)
    for c in calls:
        c()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for c in calls:
        c()
    e.record()
    torch.cuda.synchronize()
    reps = _reps_for(s.elapsed_time(e), target_ms, min_reps, max_reps)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        for c in calls:
            c()
        ends[i].record()
    torch.cuda.synchronize()
    return _summary([a.elapsed_time(b) / k for a, b in zip(starts, ends)], "cuda_events_eager")


def time_cpu(calls: Sequence[Callable[[], Any]], target_ms: float = 50.0, min_reps: int = 2,
             max_reps: int = 20) -> Timed:
    """perf_counter around loops over ``calls`` (CPU device)."""
    k = len(calls)
    t0 = time.perf_counter()
    for c in calls:
        c()
    est = (time.perf_counter() - t0) * 1000
    reps = _reps_for(est, target_ms, min_reps, max_reps)
    per = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for c in calls:
            c()
        per.append((time.perf_counter() - t0) * 1000 / k)
    return _summary(per, "perf_counter")


# ----------------------------------------------------------------------------- eager wall / host
def eager_wall(calls: Sequence[Callable[[], Any]], device: Any, target_ms: float = 60.0, lo: int = 5,
               hi: int = 200) -> dict[str, float]:
    """Issue N calls (rotating over ``calls``) after a sync; returns eager_ms (wall per call, synced
    at the end) and host_us (time to issue one call: the CPU cost while the GPU is busy)."""
    k = len(calls)
    sync(device)
    t0 = time.perf_counter()
    for c in calls:
        c()
    sync(device)
    est = (time.perf_counter() - t0) * 1000 / k
    n = _reps_for(est, target_ms, lo, hi)
    n = max(n, k)
    sync(device)
    t0 = time.perf_counter()
    for i in range(n):
        calls[i % k]()
    t1 = time.perf_counter()
    sync(device)
    t2 = time.perf_counter()
    return {"eager_ms": (t2 - t0) * 1000 / n, "host_us": (t1 - t0) * 1e6 / n, "n": n}


# ----------------------------------------------------------------------------- memory
def memory_of(forward: Callable[[], Any], backward: Callable[[Any], Any], device: Any) -> dict[str, int] | None:
    """Bytes allocated by ``forward`` and still held after it (outputs + what it saved for backward),
    and the peak over forward + ``backward(outs)``, both relative to the allocation before."""
    if not is_cuda(device):
        return None
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outs = forward()
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated() - base
    grads = backward(outs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del outs, grads
    return {"fwd_resident_bytes": int(resident), "peak_bytes": int(peak)}


# ----------------------------------------------------------------------------- ceilings
def measure_ceilings(device: Any, small: bool = False) -> dict[str, Any]:
    """Device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate, on random data."""
    import torch

    out: dict[str, Any] = {}
    if is_cuda(device):
        n = (1 << 30) if not small else (1 << 24)          # 2 GiB of bf16 per buffer
        src = torch.randn(n, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        t = time_events([lambda: dst.copy_(src)], target_ms=100, min_reps=10, max_reps=50)
        nbytes = 2 * src.numel() * src.element_size()
        out["copy"] = {"bytes": nbytes, **t.to_json(), "gbps": nbytes / (t.ms * 1e-3) / 1e9}
        del src, dst
        m = 8192 if not small else 1024
        a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
        b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
        t = time_events([lambda: a @ b], target_ms=100, min_reps=10, max_reps=50)
        out["matmul_bf16"] = {"m": m, **t.to_json(), "tflops": 2 * m ** 3 / (t.ms * 1e-3) / 1e12}
        del a, b
        torch.cuda.empty_cache()
    else:
        n = 1 << 23
        src = torch.randn(n)
        dst = torch.empty_like(src)
        t = time_cpu([lambda: dst.copy_(src)], target_ms=30, max_reps=10)
        nbytes = 2 * src.numel() * src.element_size()
        out["copy"] = {"bytes": nbytes, **t.to_json(), "gbps": nbytes / (t.ms * 1e-3) / 1e9}
        m = 256
        a, b = torch.randn(m, m), torch.randn(m, m)
        t = time_cpu([lambda: a @ b], target_ms=30, max_reps=10)
        out["matmul_bf16"] = {"m": m, **t.to_json(), "tflops": 2 * m ** 3 / (t.ms * 1e-3) / 1e12,
                              "note": "fp32 on the CPU"}
    return out


def kernel_profile(step: Callable[[], Any], reps: int = 3, width: int = 70, most: int = 14) -> dict[str, float]:
    """GPU milliseconds per call of ``step`` by kernel name (torch.profiler, ``reps`` calls after one
    warm-up), the ``most`` largest; names cut to ``width`` characters, kernels that share a cut name
    (CUTLASS's) summed."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        if us:
            out[e.key[:width]] = out.get(e.key[:width], 0.0) + us / reps / 1e3
    return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])[:most]}
