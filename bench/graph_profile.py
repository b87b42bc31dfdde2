"""Why is a graphed step slower than the eager one? Kernel by kernel, in one process.

    python3 bench/graph_profile.py [--batch 4] [--seq 2048] [--model Qwen/Qwen3-0.6B] [--top 18]

Builds the patched model (random weights, bf16, the shipped spec) as ``bench e2e`` does. Then, for
one eager training step and for one replay of ``patchdsl.graph_step``'s graph of the same step:

* GPU time of the step, from CUDA events (``patchdsl.bench.timing.time_events``): the median of 5;
* what SDPA was called with: ``attn_mask`` None or a tensor, ``is_causal``, the dtype. A spy
  wraps ``torch.nn.functional.scaled_dot_product_attention`` during one eager forward and during
  the capture;
* the CUDA kernels of one step (torch.profiler; kernels launched from a graph replay are traced as
  kernels too). The table gives the top kernels by total time in each mode, side by side, and the
  kernel names that appear in one mode only.

Nothing is pass/fail; the printout goes into bench/NOTES.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _kernels(fn) -> dict[str, tuple[float, int]]:
    """name -> (total ms, count) of the CUDA kernels that one call of ``fn`` ran."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    from torch.autograd import DeviceType

    acc: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if getattr(ev, "device_type", None) != DeviceType.CUDA:
            continue
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = getattr(ev, "cuda_time_total", 0.0)
        acc[ev.name][0] += t / 1000.0
        acc[ev.name][1] += 1
    return {k: (v[0], v[1]) for k, v in acc.items()}


def _spy():
    import torch

    real = torch.nn.functional.scaled_dot_product_attention
    calls: list[tuple] = []

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *args, **kwargs):
        calls.append((None if attn_mask is None else (tuple(attn_mask.shape), str(attn_mask.dtype)),
                      bool(is_causal), str(q.dtype), tuple(q.shape)))
        return real(q, k, v, attn_mask, dropout_p, is_causal, *args, **kwargs)

    return real, spy, calls


def _short(name: str, n: int = 78) -> str:
    return name if len(name) <= n else name[: n - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen/Qwen3-0.6B")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--top", type=int, default=18)
    o = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("graph_profile: needs a CUDA GPU")
        return 2
    from patchdsl.bench.e2e import E2EOptions, _prepare, _step, build_model, make_batches
    from patchdsl.bench.timing import time_events
    from patchdsl.runtime.graphs import graph_step

    eo = E2EOptions(model=o.model, batch=o.batch, seq=o.seq, steps=3, warmup=0, variants=("patchdsl",))
    model, source = build_model(eo)
    model, info = _prepare("patchdsl", model, eo)
    print(f"model: {source}; patched sites {info.get('patched_sites')}; batch {o.batch} x {o.seq}")
    batches = make_batches(model.config.vocab_size, eo, "cuda")
    b = batches[0]

    real, spy, calls = _spy()
    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        with torch.no_grad():
            model(**b)
    finally:
        torch.nn.functional.scaled_dot_product_attention = real
    eager_calls = list(calls)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    for _ in range(2):
        _step(model, opt, b, o.batch)
    eager_ms = time_events([lambda: _step(model, opt, b, o.batch)], min_reps=5, max_reps=5).ms
    eager_k = _kernels(lambda: _step(model, opt, b, o.batch))

    del opt
    model.zero_grad(set_to_none=True)
    gopt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True, capturable=True)
    real, spy, calls = _spy()
    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        step = graph_step(model, gopt, b)
    finally:
        torch.nn.functional.scaled_dot_product_attention = real
    graph_calls = list(calls)
    for _ in range(2):
        step(b)
    graph_ms = time_events([lambda: step(b)], min_reps=5, max_reps=5).ms
    graph_k = _kernels(lambda: step(b))

    def summary(cs):
        c = collections.Counter((x[0] is None, x[1]) for x in cs)
        return ", ".join(f"{n} x ({'no mask' if nm else 'mask'}, is_causal={ic})" for (nm, ic), n in sorted(c.items()))

    print(f"SDPA calls, eager forward: {summary(eager_calls)}; first: {eager_calls[:1]}")
    print(f"SDPA calls, in the capture (warm-up + capture): {summary(graph_calls)}; first: {graph_calls[:1]}")
    te, tg = sum(v[0] for v in eager_k.values()), sum(v[0] for v in graph_k.values())
    print(f"step GPU time (CUDA events, median of 5): eager {eager_ms:.1f} ms, graph replay {graph_ms:.1f} ms")
    print(f"kernel time summed (profiler): eager {te:.1f} ms in {sum(v[1] for v in eager_k.values())} kernels, "
          f"graph {tg:.1f} ms in {sum(v[1] for v in graph_k.values())} kernels")
    names = sorted(set(eager_k) | set(graph_k), key=lambda n: -max(eager_k.get(n, (0, 0))[0], graph_k.get(n, (0, 0))[0]))
    print(f"{'kernel':80s} {'eager ms':>9s} {'n':>5s} {'graph ms':>9s} {'n':>5s} {'delta':>8s}")
    for n in names[: o.top]:
        e, g = eager_k.get(n, (0.0, 0)), graph_k.get(n, (0.0, 0))
        print(f"{_short(n):80s} {e[0]:9.2f} {e[1]:5d} {g[0]:9.2f} {g[1]:5d} {g[0] - e[0]:+8.2f}")
    by_delta = sorted(names, key=lambda n: -(graph_k.get(n, (0, 0))[0] - eager_k.get(n, (0, 0))[0]))
    print("largest increases in the graph:")
    for n in by_delta[:8]:
        e, g = eager_k.get(n, (0.0, 0)), graph_k.get(n, (0.0, 0))
        print(f"  {_short(n):80s} {e[0]:9.2f} -> {g[0]:9.2f} ms ({e[1]} -> {g[1]} kernels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
