"""patchdsl bench: per-op and end-to-end GPU benchmarks against HF eager, torch.compile, Liger-Kernel and CCE.

    patchdsl bench ops  [--out DIR] [--json-out F] [--ops rmsnorm,swiglu] [--impls patchdsl,hf,...] [--no-sweep] [--budget S]
    patchdsl bench e2e  [--model ID] [--spec S]... [--batch 16[,4]] [--variants hf,compile,liger,patchdsl,patchdsl+compile,patchdsl+graphs]
                        [--out DIR] [--name e2e] [--budget S]   # a fresh process per variant
    patchdsl bench summary FILE.json [FILE.json]   # print the tables (and the performance targets) again
    patchdsl bench plot FILE.json [FILE.json] --png F
    patchdsl bench specialise [--out DIR] [--json-out F] [--ops rmsnorm,rope] [--eager] [--budget S]   # specialised vs generic

Results go into --out (ops: ops.json, ops.png; e2e: NAME.json, NAME.txt, NAME.png), else $OUT when
it is set, else a new folder bench-results/<command>-<UTC time>/ under the current directory; the
folder is printed. --json-out F (old name --json) overrides the JSON's path, as apply's --json-out writes a file.

On a machine without a GPU the default is a tiny CPU run through the Triton interpreter: it checks
every kernel's result against float64, but its times mean nothing, so no timing target is judged.

Exit status: 0; 1 when a patchdsl kernel's result was wrong (relative error over its tolerance);
2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _out_dir(cmd: str, out: str | None = None) -> Path:
    """--out, else $OUT, else a new bench-results/<cmd>-<UTC time>/ here: never the current folder itself."""
    import time

    if out:
        d = Path(out)
    elif os.environ.get("OUT"):
        d = Path(os.environ["OUT"])
    else:
        d = Path("bench-results") / f"{cmd}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    from patchdsl.util import files

    return files.check_folder(d, what="--out")


def _csv(s: str | None) -> tuple[str, ...] | None:
    if not s:
        return None
    return tuple(x.strip() for x in s.split(",") if x.strip())


def _png_line(written: str | None, wanted: str) -> str:
    if written:
        return f"plot: {written}"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"no plot: matplotlib is not installed (pip install 'patchdsl[bench]'), so {wanted} was not written"
    return f"no plot: nothing to draw, so {wanted} was not written"


def _default_device() -> str:
    try:
        import torch

        if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            return "cuda"
    except Exception:
        pass
    return "cpu"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="patchdsl bench", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", metavar="{ops,e2e,specialise,summary,plot}")

    o = sub.add_parser("ops", help="per-op benchmarks against HF eager, torch.compile, Liger, CCE")
    o.add_argument("--out", help="output folder (default: $OUT, else a new bench-results/ops-<time>/)")
    o.add_argument("--json-out", "--json", dest="json", metavar="F",
                   help="write the results JSON here (default: OUT/ops.json); --json is its old name")
    o.add_argument("--png", help="also write a plot here (default: next to the JSON, ops.png)")
    o.add_argument("--no-png", action="store_true")
    o.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    o.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    o.add_argument("--ops", help="comma-separated op families (default: all)")
    o.add_argument("--impls", help="comma-separated: patchdsl,hf,compile,liger,cce (default: all)")
    o.add_argument("--no-sweep", action="store_true", help="only the headline shapes, no sweep")
    o.add_argument("--sweep-only", action="store_true", help="only the sweep shapes")
    o.add_argument("--tiny", action="store_true", help="tiny shapes (default on the CPU)")
    o.add_argument("--compile-sweep", action="store_true", help="torch.compile at the sweep shapes too")
    o.add_argument("--compile-backend", default="inductor")
    o.add_argument("--sweep-start", type=int, default=0,
                   help="start each op's sweep at its K-th shape (the earlier ones measured by an earlier run)")
    o.add_argument("--budget", type=float, default=1e9, help="seconds; units not started by then are skipped")
    o.add_argument("--target-ms", type=float, default=100.0, help="timed replays per measurement, in ms")
    o.add_argument("--seed", type=int, default=1234)
    o.add_argument("--quiet", action="store_true")

    e = sub.add_parser("e2e", help="end-to-end training throughput, a fresh process per variant",
                       description="End-to-end training of a causal LM with random weights: tokens/s, step time, "
                                   "host time per step, peak memory and every step's loss, per variant and spec, each "
                                   "in a fresh process. Writes NAME.json, NAME.txt (the table) and NAME.png into "
                                   "--out (else $OUT, else a new bench-results/e2e-<time>/).")
    e.add_argument("--out", help="output folder (default: $OUT, else a new bench-results/e2e-<time>/)")
    e.add_argument("--name", default="e2e", help="file stem of the outputs (default e2e)")
    e.add_argument("--json-out", "--json", dest="json", metavar="F",
                   help="write the results JSON here (overrides --out/--name for the JSON); --json is its old name")
    e.add_argument("--png")
    e.add_argument("--no-png", action="store_true")
    e.add_argument("--device")
    e.add_argument("--model", default="Qwen/Qwen3-0.6B",
                   help="Hub id with a shipped config (Qwen/Qwen3-0.6B, meta-llama/Llama-3.2-1B, "
                        "google/gemma-3-1b-pt, ...), a model folder or a config.json; random weights")
    e.add_argument("--spec", action="append",
                   help="spec path or name (shipped specs/NAME.kpatch or bench/specs/NAME.kpatch); repeat it for "
                        "a patchdsl row per spec (default: the shipped spec of the model's family)")
    e.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"], help="default bf16 (fp32 with --tiny on CPU)")
    e.add_argument("--batch", help="batch size, or several comma-separated (a row per batch size)")
    e.add_argument("--seq", type=int)
    e.add_argument("--micro-batch", type=int, help="split each batch (gradient accumulation)")
    e.add_argument("--steps", type=int, default=None, help="measured steps (default 5; 2 tiny)")
    e.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 2; 1 tiny)")
    e.add_argument("--variants", default="hf,patchdsl,liger",
                   help="comma-separated, run in this order: hf,compile,liger,patchdsl,patchdsl+compile "
                        "(patchdsl.compile_model),patchdsl+regional (patchdsl.compile_layers),patchdsl+plain_compile "
                        "(torch.compile of the patched model),patchdsl+graphs (the patched step as one CUDA graph; CUDA only)")
    e.add_argument("--tiny", action="store_true", help="tiny architecture (default on the CPU)")
    e.add_argument("--budget", type=float, default=1e9,
                   help="seconds for the whole run: rows not started by then are skipped, a running one is stopped")
    e.add_argument("--variant-timeout", type=float, default=1e9, help="seconds per row's process")
    e.add_argument("--no-oom-retry", action="store_true",
                   help="out of memory gives an error row instead of a retry at half the micro-batch")
    e.add_argument("--in-process", action="store_true", help="every row in this process (no isolation)")
    e.add_argument("--compile-backend", default="inductor")
    e.add_argument("--compile-mode", default=None, help="torch.compile mode (default: its default)")
    e.add_argument("--compile-warmup", type=int, default=None,
                   help="warm-up steps of the compiled rows (default: --warmup); the compile happens in them")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--quiet", action="store_true")

    s = sub.add_parser("summary", help="print the tables of result JSON files")
    s.add_argument("files", nargs="+")
    s.add_argument("--no-sweep", action="store_true")

    g = sub.add_parser("plot", help="plot result JSON files")
    g.add_argument("files", nargs="+")
    g.add_argument("--png", required=True)

    from .specialise import add_parser as add_specialise
    add_specialise(sub)
    return p


def _load(files: list[str]) -> tuple[dict | None, dict | None]:
    ops = e2e = None
    for f in files:
        try:
            d = json.loads(Path(f).read_text())
        except (OSError, ValueError) as ex:
            print(f"cannot read {f}: {ex}", file=sys.stderr)
            continue
        if d.get("kind") == "patchdsl-bench-ops":
            if ops is None:
                ops = d
            else:       # e.g. the issue shapes and the sweep from two runs: one table
                ops = dict(ops, results=ops.get("results", []) + d.get("results", []),
                           comparisons=ops.get("comparisons", []) + d.get("comparisons", []),
                           complete=bool(ops.get("complete")) and bool(d.get("complete")),
                           elapsed_s=ops.get("elapsed_s", 0) + d.get("elapsed_s", 0))
        elif d.get("kind") == "patchdsl-bench-e2e":
            e2e = d
        else:
            print(f"{f}: not a patchdsl bench result", file=sys.stderr)
    return ops, e2e


def _wrong(ops: dict | None) -> bool:
    return bool(ops) and any(r.get("impl") == "patchdsl" and r.get("correct") is False for r in ops.get("results", []))


def run(argv: list[str]) -> int:
    parser = _parser()
    try:
        a = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0) if e.code in (0, None) else 2
    from patchdsl.util import files

    try:
        # every output is written by patchdsl.util.files; the files named here are checked before the
        # benchmarks run (a FIFO, a device, a folder or an unwritable file: exit 2 now, not after the runs)
        for opt in ("json", "png", "txt"):
            f = getattr(a, opt, None)
            if f and (files.exists(f) or os.path.islink(f)):
                files.check_writable(f, what=f"--{'json-out' if opt == 'json' else opt}")
        if getattr(a, "out", None) and files.exists(a.out):
            files.check_folder(a.out, what="--out", create=False)
        return _run(parser, a)
    except files.FileWriteError as e:
        print(f"patchdsl bench: error: {e}", file=sys.stderr)
        return 2


def _run(parser: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    if a.cmd is None:
        parser.print_usage(sys.stderr)
        print("patchdsl bench: say which benchmark: ops, e2e, specialise, summary or plot "
              "(patchdsl bench --help)", file=sys.stderr)
        return 2
    from . import report

    if a.cmd == "summary":
        ops, e2e = _load(a.files)
        if ops and not a.no_sweep and report.sweep_summary(ops):
            print(report.sweep_summary(ops))
        if ops:
            print(report.ops_summary(ops))
        if e2e:
            print(report.e2e_summary(e2e))
        t = report.targets_summary(ops, e2e)
        if t:
            print(t)
        return 1 if _wrong(ops) else 0
    if a.cmd == "plot":
        from .plot import plot

        ops, e2e = _load(a.files)
        print(_png_line(plot(ops, e2e, a.png), a.png))
        return 0

    device = a.device or _default_device()
    cuda = device.startswith("cuda")
    if a.cmd == "specialise":
        from .specialise import main as specialise_main

        return specialise_main(a, device, _out_dir("specialise", a.out), ops=_csv(a.ops))
    if a.cmd == "ops":
        from .runner import IMPLS, Options, run_ops

        tiny = a.tiny or not cuda
        groups = ("tiny",) if tiny else (("sweep",) if a.sweep_only else ("issue",) if a.no_sweep else ("issue", "sweep"))
        path = a.json or str(_out_dir("ops", a.out) / "ops.json")
        impls = _csv(a.impls) or IMPLS
        bad = [i for i in impls if i not in IMPLS]
        if bad:
            print(f"unknown impl(s) {bad}; known: {', '.join(IMPLS)}", file=sys.stderr)
            return 2
        opts = Options(device=device, dtype=a.dtype, groups=groups, ops=_csv(a.ops), impls=impls,
                       budget_s=a.budget, compile_sweep=a.compile_sweep, compile_backend=a.compile_backend,
                       sweep_start=a.sweep_start,
                       target_ms=a.target_ms, json_path=path, seed=a.seed, quiet=a.quiet)
        try:
            doc = run_ops(opts)
        except ValueError as ex:
            print(str(ex), file=sys.stderr)
            return 2
        png_line = None
        if not a.no_png:
            from .plot import plot

            png = a.png or str(Path(path).with_suffix(".png"))
            png_line = _png_line(plot(doc, None, png), png)
        if report.sweep_summary(doc):
            print(report.sweep_summary(doc))
        print(report.ops_summary(doc))
        t = report.targets_summary(doc, None)
        if t:
            print(t)
        print(f"results: {path}")
        if png_line:
            print(png_line)
        if _wrong(doc):
            print("patchdsl bench: a patchdsl kernel's result was wrong (err over its tolerance; see the table)",
                  file=sys.stderr)
            return 1
        return 0
    if a.cmd == "e2e":
        from .e2e import E2EOptions, plan_rows, run_e2e

        tiny = a.tiny or not cuda
        try:
            batches = tuple(int(x) for x in _csv(a.batch)) if a.batch else ((2 if tiny else 16),)
        except ValueError:
            print(f"--batch: expected integers separated by commas, got {a.batch!r}", file=sys.stderr)
            return 2
        if a.json:
            path = a.json
        else:
            path = str(_out_dir("e2e", a.out) / f"{a.name}.json")
        o = E2EOptions(device=device, model=a.model, specs=tuple(a.spec or ()),
                       dtype=a.dtype or ("fp32" if tiny and not cuda else "bf16"),
                       batch=batches[0], batches=batches, seq=a.seq or (16 if tiny else 2048),
                       micro_batch=a.micro_batch, steps=a.steps if a.steps is not None else (2 if tiny else 5),
                       warmup=a.warmup if a.warmup is not None else (1 if tiny else 2),
                       variants=_csv(a.variants) or ("hf", "patchdsl"), tiny=tiny, budget_s=a.budget,
                       variant_timeout_s=a.variant_timeout, oom_retry=not a.no_oom_retry, isolate=not a.in_process,
                       compile_backend=a.compile_backend, compile_mode=a.compile_mode,
                       compile_warmup=a.compile_warmup, json_path=path, seed=a.seed, quiet=a.quiet)
        try:
            plan_rows(o)
        except ValueError as ex:
            print(f"patchdsl bench e2e: {ex}", file=sys.stderr)
            return 2
        doc = run_e2e(o)
        png_line = None
        if not a.no_png and not doc.get("terminated"):      # a terminated run has seconds left: JSON and table only
            from .plot import plot

            png = a.png or str(Path(path).with_suffix(".png"))
            png_line = _png_line(plot(None, doc, png), png)
        text = report.e2e_summary(doc)
        t = report.targets_summary(None, doc)
        if t:
            text += "\n" + t
        from patchdsl.util import files

        files.write_text(Path(path).with_suffix(".txt"), text + "\n", what="results table", parents=True)
        print(text)
        print(f"results: {path} (+ {Path(path).with_suffix('.txt').name})")
        if png_line:
            print(png_line)
        return 0
    return 2
