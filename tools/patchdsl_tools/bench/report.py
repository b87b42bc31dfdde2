"""Compact text summaries of the ops / e2e JSON documents, and the issue's targets checked against them."""

from __future__ import annotations

import math
from typing import Any

MiB = 2 ** 20
GiB = 2 ** 30
PEERS = ("hf", "compile", "liger", "cce")
HOST_US, HOST_US_LCE = 30.0, 150.0       # issue 15 item 2: CPU time to issue one forward

# (op, shape label, field, limit, what): the issue's targets, judged on the patchdsl row.
TARGETS = [
    ("rmsnorm", "16384x1024", "fwd_bwd_ms", 0.045, "RMSNorm 16384x1024 fwd+bwd <= 0.045 ms"),
    ("swiglu", "16384x3072", "fwd_bwd_ms", 0.19, "SiLU*mul 16384x3072 fwd+bwd <= 0.19 ms"),
    ("swiglu", "16384x3072", "fwd_ms", 0.19, "SiLU*mul 16384x3072 fwd <= 0.19 ms"),
    ("swiglu", "16384x3072", "fwd_resident_bytes<hf", None, "SiLU*mul saves less for backward than HF"),
    ("rope", "8x2048 q16/kv8 d128", "fwd_bwd_ms", 0.10, "RoPE q,k 8x2048 (Qwen3 heads) fwd+bwd <= 0.10 ms"),
    ("qk_norm_rope", "8x2048 q16/kv8 d128", "fwd_bwd_ms", 0.10, "qk-norm+RoPE 8x2048 fwd+bwd <= 0.10 ms (RoPE target)"),
    ("cross_entropy", "8192x151936", "fwd_bwd_ms", 1.9, "CE 8192x151936 fwd+bwd <= 1.9 ms"),
    ("linear_cross_entropy", "16384x1024x151936", "fwd_bwd_ms", 23.0, "linear CE 16384x1024x151936 fwd+bwd <= 23 ms"),
    ("linear_cross_entropy", "16384x1024x151936", "extra_peak_bytes", 64 * MiB, "linear CE extra peak <= 64 MB"),
    ("linear_cross_entropy", "16384x1024x151936", "no_host_sync", None, "linear CE: no host synchronisation"),
    ("linear_cross_entropy_fused", "16384x1024x151936", "fwd_bwd_ms", 23.0, "linear CE mode=fused fwd+bwd <= 23 ms"),
    ("linear_cross_entropy_fused", "16384x1024x151936", "extra_peak_bytes", 64 * MiB, "linear CE mode=fused extra peak <= 64 MB"),
    ("linear_cross_entropy_fused", "16384x1024x151936", "no_host_sync", None, "linear CE mode=fused: no host synchronisation"),
]


def _f(x: Any, fmt: str = ".4f", none: str = "-") -> str:
    if x is None:
        return none
    if isinstance(x, str):
        return x
    if isinstance(x, float) and not math.isfinite(x):
        return "inf"
    return format(x, fmt)


def _ms(x: Any) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:.1f}"
    if x >= 10:
        return f"{x:.2f}"
    if x >= 1:
        return f"{x:.3f}"
    return f"{x:.4f}"


def _ratio(a: Any, b: Any) -> str:
    if not a or not b:
        return "-"
    return f"{a / b:.2f}x"


def _table(rows: list[list[str]], header: list[str]) -> str:
    w = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w[i]) if i < 3 else str(c).rjust(w[i]) for i, c in enumerate(header))]
    for r in rows:
        lines.append("  ".join(str(c).ljust(w[i]) if i < 3 else str(c).rjust(w[i]) for i, c in enumerate(r)))
    return "\n".join(lines)


def _err(r: dict) -> str:
    e = r.get("err_max")
    if e is None:
        return "-"
    s = _f(e, ".1e") if not isinstance(e, str) else e
    return s if r.get("correct") else s + " BAD"


CPU_NOTE = ("(CPU: the kernels ran in Triton's interpreter, so every time, tokens/s and ratio below says nothing "
            "about speed; only the correctness columns count here)")


def _on_cpu(env: dict) -> bool:
    return str(env.get("device", "")).startswith("cpu") and not env.get("gpu")


def ops_summary(doc: dict) -> str:
    """The issue's shapes: every implementation, one row each."""
    env, ceil = doc.get("env", {}), doc.get("ceilings", {})
    copy = ceil.get("copy", {}).get("gbps")
    mm = ceil.get("matmul_bf16", {}).get("tflops")
    out = [f"== ops: {doc.get('options', {}).get('dtype', '?')} on {env.get('gpu', env.get('device', '?'))}; "
           f"copy {_f(copy, '.0f')} GB/s, bf16 matmul {_f(mm, '.0f')} TFLOP/s; torch {env.get('torch')}, "
           f"triton {env.get('triton')}, transformers {env.get('transformers')}, liger {env.get('liger_kernel')}, "
           f"cce {env.get('cut_cross_entropy')}; {env.get('date', '')}"
           + ("" if doc.get("complete") else "  [INCOMPLETE: run stopped early]")]
    if _on_cpu(env):
        out.append(CPU_NOTE)
    results = doc.get("results", [])
    by = {(r["op"], r["label"], r["impl"]): r for r in results}
    from .cases import families
    src_of = {n: f.peers_from for n, f in families().items() if f.peers_from}   # another mode's family
    header = ["op", "shape", "impl", "fwd ms", "bwd ms", "f+b ms", "%copy", "floor", "err", "peak MiB",
              "extra MiB", "host us", "vs hf", "vs comp", "vs liger"]
    rows: list[list[str]] = []
    notes: list[str] = []
    seen = []
    for r in results:
        if r["group"] == "sweep" or (r["op"], r["label"]) in seen:
            continue
        seen.append((r["op"], r["label"]))
    op_order = list(dict.fromkeys(r["op"] for r in results))
    pos = {t: i for i, t in enumerate(seen)}
    seen = sorted(seen, key=lambda t: (op_order.index(t[0]), pos[t]))
    for op, label in seen:
        first = True
        for impl in ("patchdsl",) + PEERS:
            r = by.get((op, label, impl))
            if r is None:
                continue
            name = (op if first else "")
            shape = (label if first else "")
            first = False
            if r["status"] != "ok":
                notes.append(f"  [{len(notes) + 1}] {op} {label} {impl}: {r['status']}: {str(r.get('error', ''))[:160]}")
                rows.append([name, shape, impl, f"[{len(notes)}]", r["status"]] + [""] * 10)
                continue
            pd = by.get((op, label, "patchdsl"))
            pdf = pd.get("fwd_bwd_ms") if pd and pd.get("status") == "ok" else None

            def vs(peer):
                if impl != "patchdsl":
                    return ""
                p = by.get((op, label, peer)) or by.get((src_of.get(op), label, peer))
                return _ratio(pdf, p.get("fwd_bwd_ms")) if p and p.get("status") == "ok" else "-"

            pc = r.get("pct_copy", {}).get("fwd_bwd")
            tf = r.get("tflops", {}).get("fwd_bwd")
            util = f"{r['pct_matmul']['fwd_bwd']:.0f}%mm" if r.get("pct_matmul") else (f"{pc:.0f}%" if pc else "-")
            rows.append([name, shape, impl + (" (sync)" if r.get("host_sync") else ""),
                         _ms(r.get("fwd_ms")), _ms(r.get("bwd_ms")) + ("d" if "bwd_derived" in r else ""),
                         _ms(r.get("fwd_bwd_ms")), util,
                         _ms(r.get("floor_ms", {}).get("fwd_bwd")), _err(r),
                         _f(r["peak_bytes"] / MiB, ".0f") if r.get("peak_bytes") is not None else "-",
                         _f(r["extra_peak_bytes"] / MiB, ".0f") if r.get("extra_peak_bytes") is not None else "-",
                         _f(r.get("host_fwd_us"), ".0f"), vs("hf"), vs("compile"), vs("liger")])
            if tf is not None and impl == "patchdsl":
                rows[-1][6] += f" {tf:.0f}TF"
    out.append(_table(rows, header))
    out.extend(notes)
    out.append("f+b = forward+backward GPU time per call (CUDA-graph replay, L2-cold rotation); %copy = bytes moved "
               "(minimum) / time over the measured copy bandwidth (%mm: FLOPs over the matmul rate); floor = that "
               "minimum time; err = max rel. error of outputs and grads vs float64 (BAD > tol); extra = peak "
               "minus outputs and grads; host us = CPU time to issue one forward; vs X = patchdsl f+b / X f+b; "
               "bwd d = derived as f+b - fwd (a backward that consumes its buffers cannot be replayed alone); "
               "(sync) = the call synchronises with the host, timed with events around eager calls.")
    counts: dict[str, int] = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    out.append("units: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
               + f"; {doc.get('elapsed_s', 0):.0f} s")
    return "\n".join(out)


def target_rows(ops: dict | None, e2e: dict | None) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) for each of the issue's targets that the documents can answer."""
    rows: list[tuple[str, str, str]] = []
    if ops:
        by = {(r["op"], r["label"], r["impl"]): r for r in ops.get("results", [])}
        # the CPU run goes through Triton's interpreter: its results are checked, its times mean nothing
        cpu = str((ops.get("env") or {}).get("device") or ops.get("options", {}).get("device") or "").startswith("cpu")
        for op, label, fld, limit, what in TARGETS:
            r = by.get((op, label, "patchdsl"))
            if r is None or r.get("status") != "ok":
                rows.append((what, "not measured" if r is None else r["status"], "n/a"))
                continue
            if cpu and fld != "fwd_resident_bytes<hf":
                rows.append((what, "not judged on the CPU (interpreter times)", "n/a"))
                if r.get("correct") is False:
                    rows[-1] = (what, f"WRONG: err {r.get('err_max')}", "FAIL")
                continue
            if fld == "no_host_sync":
                rows.append((what, "syncs: " + r["host_sync"] if r.get("host_sync") else "none seen",
                             "FAIL" if r.get("host_sync") else "PASS"))
            elif fld == "fwd_resident_bytes<hf":
                h = by.get((op, label, "hf"))
                a, b = r.get("fwd_resident_bytes"), (h or {}).get("fwd_resident_bytes")
                if a is None or b is None:
                    rows.append((what, "n/a", "n/a"))
                else:
                    rows.append((what, f"{a / MiB:.0f} MiB vs HF {b / MiB:.0f} MiB", "PASS" if a < b else "FAIL"))
            else:
                v = r.get(fld)
                if v is None:
                    rows.append((what, "n/a", "n/a"))
                elif fld.endswith("bytes"):
                    rows.append((what, f"{v / MiB:.1f} MiB", "PASS" if v <= limit else "FAIL"))
                else:
                    rows.append((what, f"{_ms(v)} ms", "PASS" if v <= limit else "FAIL"))
            if r.get("correct") is False:
                rows[-1] = (rows[-1][0], rows[-1][1] + f" (WRONG: err {r.get('err_max')})", "FAIL")
        pd = [r for r in ops.get("results", []) if r["impl"] == "patchdsl" and r["group"] != "sweep"
              and r.get("status") == "ok" and r.get("host_fwd_us") is not None]
        # issue 15 item 2: CPU time to issue one forward, <= 30 us for a norm/GLU/RoPE op (every memory-bound
        # op is held to it), <= 150 us for the matmul-bound linear cross entropy; one row per op and shape
        if cpu:
            wrong = [r for r in ops.get("results", []) if r["impl"] == "patchdsl" and r.get("correct") is False]
            rows.append(("host time to issue one forward", "not judged on the CPU (interpreter times)", "n/a"))
            rows.extend((f"result of {r['op']} {r['label']}", f"WRONG: err {r.get('err_max')}", "FAIL") for r in wrong)
            pd = []
        for r in pd:
            lim = HOST_US_LCE if r.get("flops") else HOST_US
            rows.append((f"host time to issue one forward <= {lim:.0f} us: {r['op']} {r['label']}",
                         f"{r['host_fwd_us']:.0f} us (GPU {1000 * (r.get('fwd_ms') or 0):.0f} us)",
                         "PASS" if r["host_fwd_us"] <= lim else "FAIL"))
    if e2e:
        rows.extend(e2e_target_rows(e2e))
    return rows


def targets_summary(ops: dict | None, e2e: dict | None) -> str:
    rows = target_rows(ops, e2e)
    if not rows:
        return ""
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    return "\n".join(["== targets (patchdsl) =="] + [f"{a.ljust(w0)}  {b.ljust(w1)}  {c}" for a, b, c in rows])


# (model_type, batch, seq, minimum patchdsl/Liger tokens/s): issue 15 item 3, at <= Liger's peak + 1 GiB
E2E_TARGETS = [("qwen3", 16, 2048, 1.20), ("llama", 8, 2048, 1.10), ("gemma3_text", 8, 2048, 1.50)]
E2E_STEP_TARGETS = [("qwen3", 1, 2048, 45.0)]     # issue 15 item 2: step time (ms) at batch 1


def _base(v: dict) -> str:
    return v.get("base") or v["variant"].split(":")[0].split(" @")[0]


def e2e_target_rows(e2e: dict) -> list[tuple[str, str, str]]:
    """Issue 15's end-to-end targets, for each patchdsl row of a run at the targets' model and sizes."""
    rows: list[tuple[str, str, str]] = []
    mt = (e2e.get("model") or {}).get("type")
    seq = e2e.get("options", {}).get("seq")
    vs = e2e.get("variants", [])
    for t_mt, t_b, t_seq, ratio in E2E_TARGETS:
        if mt != t_mt or seq != t_seq:
            continue
        same = [v for v in vs if v.get("batch", e2e.get("options", {}).get("batch")) == t_b]
        lig = next((v for v in same if _base(v) == "liger" and v.get("status") == "ok"), None)
        for v in same:
            if not _base(v).startswith("patchdsl"):
                continue
            what = f"e2e {mt} {t_b}x{t_seq}: {v['variant']} >= {ratio:.2f}x Liger tokens/s at <= Liger + 1 GiB"
            if v.get("status") != "ok":
                rows.append((what, v.get("status", "?"), "n/a"))
            elif lig is None:
                rows.append((what, f"{v['tokens_per_s']:,.0f} tokens/s; Liger not measured", "n/a"))
            else:
                r = v["tokens_per_s"] / lig["tokens_per_s"]
                pk, lpk = v.get("peak_bytes"), lig.get("peak_bytes")
                mem_ok = pk is not None and lpk is not None and pk <= lpk + GiB
                mem = f", {pk / GiB:.1f} vs {lpk / GiB:.1f} GiB" if pk and lpk else ""
                rows.append((what, f"{r:.2f}x ({v['tokens_per_s']:,.0f} vs {lig['tokens_per_s']:,.0f}{mem})",
                             "PASS" if r >= ratio and mem_ok else "FAIL"))
    for t_mt, t_b, t_seq, ms in E2E_STEP_TARGETS:
        if mt != t_mt or seq != t_seq:
            continue
        for v in vs:
            if _base(v) not in ("patchdsl", "patchdsl+graphs") or v.get("batch", e2e.get("options", {}).get("batch")) != t_b:
                continue
            what = f"e2e {mt} {t_b}x{t_seq}: {v['variant']} step <= {ms:.0f} ms"
            if v.get("status") != "ok":
                rows.append((what, v.get("status", "?"), "n/a"))
                continue
            host = f", host issues it in {v['host_issue_ms']:.1f} ms" if v.get("host_issue_ms") is not None else ""
            rows.append((what, f"{v['step_ms']:.1f} ms{host}", "PASS" if v["step_ms"] <= ms else "FAIL"))
    return rows


def e2e_summary(doc: dict) -> str:
    env = doc.get("env", {})
    o = doc.get("options", {})
    m = doc.get("model", {})
    bs = o.get("batches") or [o.get("batch")]
    head = (f"== e2e: {m.get('name', o.get('model', '?'))} ({m.get('type', '?')}, {m.get('layers', '?')} layers, "
            f"{m.get('params', 0) / 1e6:.0f}M params), batch {'/'.join(map(str, bs))} x {o.get('seq')}, "
            f"{o.get('dtype')}, {o.get('steps')} steps after {o.get('warmup')} warm-up, "
            f"{env.get('gpu', env.get('device'))}; {doc.get('isolation', '')}"
            + ("" if doc.get("complete") else "  [INCOMPLETE]"))
    if _on_cpu(env):
        head += "\n" + CPU_NOTE
    if doc.get("error"):
        return head + "\n" + doc["error"]
    vs = doc.get("variants", [])
    agree = doc.get("loss_agreement", {})
    rows, notes = [], []
    for v in vs:
        same = [x for x in vs if x.get("batch") == v.get("batch") and x.get("status") == "ok"]
        lig = next((x for x in same if _base(x) == "liger"), None)
        hf = next((x for x in same if _base(x) == "hf"), None)
        if v.get("status") != "ok":
            notes.append(f"  [{len(notes) + 1}] {v['variant']}: {v.get('status')}: {str(v.get('error', ''))[:300]}")
            rows.append([v["variant"], f"[{len(notes)}] {v.get('status')}"] + [""] * 8)
            continue
        d = agree.get(v["variant"], {})
        host = v.get("host_issue_ms")
        rows.append([v["variant"], f"{v['tokens_per_s']:,.0f}", f"{v['step_ms']:.1f}",
                     f"{host:.1f}" if host is not None else "-",
                     f"{v['peak_bytes'] / GiB:.2f}" if v.get("peak_bytes") else "-",
                     f"{v['micro_batch']}", _f(d.get("max_abs_diff"), ".1e") if d else "ref",
                     _ratio(v["tokens_per_s"], lig["tokens_per_s"]) if lig else "-",
                     _ratio(v["tokens_per_s"], hf["tokens_per_s"]) if hf else "-",
                     f"{sum(v.get('warmup_step_s') or [0]):.1f}"])
        if _base(v).startswith("patchdsl") and (v.get("dropped_rules") or v.get("refused")):
            notes.append(f"  [{len(notes) + 1}] {v['variant']}: dropped {len(v.get('dropped_rules', []))} rule(s), "
                         f"refused {len(v.get('refused', []))} site(s): "
                         + "; ".join((v.get("dropped_rules", []) + v.get("refused", []))[:4])[:300])
            rows[-1][0] += f" [{len(notes)}]"
        if v.get("oom_retries"):
            notes.append(f"  [{len(notes) + 1}] {v['variant']}: out of memory first, ran at micro-batch "
                         f"{v['micro_batch']}")
            rows[-1][0] += f" [{len(notes)}]"
    out = [head, _table(rows, ["variant", "tokens/s", "step ms", "host ms", "peak GiB", "micro", "max|dloss|",
                               "vs liger", "vs hf", "warm-up s"])]
    out.extend(notes)
    ok = [v for v in vs if v.get("status") == "ok" and v.get("losses")]
    if ok:
        w = max(len(v["variant"]) for v in ok)
        out.append(f"-- loss per step (warm-up included; reference for max|dloss|: {doc.get('loss_reference', 'hf')}) --")
        for v in ok:
            out.append(f"{v['variant'].ljust(w)}  " + " ".join(f"{x:.4f}" for x in v["losses"]))
    out.append("host ms = CPU time to issue one training step after a sync (close to step ms: the CPU bounds the "
               "step); peak = torch.cuda.max_memory_allocated; max|dloss| = largest loss difference from the "
               "reference over all steps; warm-up s = wall time of the warm-up steps (compilation)")
    return "\n".join(out)


def sweep_summary(doc: dict) -> str:
    """The sweep shapes: patchdsl's fwd+bwd time against each peer's."""
    results = doc.get("results", [])
    by = {(r["op"], r["label"], r["impl"]): r for r in results}
    order = [x["op"] for x in results]
    sw = sorted({(r["op"], r["label"]) for r in results if r["group"] == "sweep"},
                key=lambda t: (order.index(t[0]), t[1]))
    if not sw:
        return ""
    rows = []
    for op, label in sw:
        r = by.get((op, label, "patchdsl"))

        def pms(p, op=op, label=label):
            x = by.get((op, label, p))
            return x.get("fwd_bwd_ms") if x and x.get("status") == "ok" else None

        if r is None or r.get("status") != "ok":
            rows.append([op, label, "missing" if r is None else r["status"], "", "", _ms(pms("hf")),
                         _ms(pms("compile")), _ms(pms("liger")), "", "", ""])
            continue
        pc = r.get("pct_copy", {}).get("fwd_bwd")
        pf = r.get("fwd_bwd_ms")
        util = f"{r['pct_matmul']['fwd_bwd']:.0f}%mm" if r.get("pct_matmul") else (f"{pc:.0f}%" if pc else "-")
        rows.append([op, label, _ms(pf), util, _err(r), _ms(pms("hf")), _ms(pms("compile")),
                     _ms(pms("liger")), _ratio(pf, pms("hf")), _ratio(pf, pms("compile")), _ratio(pf, pms("liger"))])
    return "-- sweep: fwd+bwd ms, patchdsl vs peers --\n" + _table(
        rows, ["op", "shape", "patchdsl", "%copy", "err", "hf", "compile", "liger", "vs hf", "vs comp", "vs liger"])
