"""The ``patchdsl`` command line.  It only calls the pipeline's stages.

Exit codes: 0 success, 1 a check failed (verify), 2 bad input (spec or model errors).
Spec errors never print a Python traceback.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path

import click

from ._version import __version__
from .util import files
from .util.files import FileReadError
from .syntax.errors import SpecError
from .util.vocab import DTYPES, TARGETS

# Exit codes, the same for every command (docs/reliability.md, "Exit codes"):
EXIT_OK = 0            # the command did what was asked
EXIT_FAILED = 1        # verify / apply: a comparison against the float64 reference failed
EXIT_BAD_INPUT = 2     # the input is unusable: spec, model, options, files, or a required site refused
EXIT_INTERNAL = 3      # an unexpected exception: a bug of patchdsl (PATCHDSL_DEBUG=1 re-raises it)


class UsageFailure(Exception):
    """Bad input that is not a spec error (unknown model, unreadable file): exit 2."""


def _console(stderr: bool = False):
    from rich.console import Console

    c = Console(stderr=stderr, highlight=False)
    if not c.is_terminal:
        c = Console(stderr=stderr, highlight=False, width=160)
    return c


EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT), as a shell reports it: never mistaken for verify's "failed"


def _json_wanted(ctx) -> bool:
    """--json was given to the command being run (parsed, or still in its raw arguments when the
    options themselves were bad)."""
    sub = ctx.meta.get("patchdsl.json")
    if sub is not None:
        return bool(sub)
    raw = getattr(ctx, "_protected_args", None)
    if raw is None:
        raw = getattr(ctx, "protected_args", None) or []
    return "--json" in list(raw) + list(ctx.args or [])


def _json_error(ctx, message: str, code: int, kind: str) -> None:
    """With --json, the error as a JSON document on stdout (the message goes to stderr as always)."""
    if _json_wanted(ctx):
        click.echo(json.dumps({"ok": False, "exit_code": code, "error": {"kind": kind, "message": message}},
                              indent=2))


def _fail(msg: str, code: int = EXIT_BAD_INPUT) -> None:
    """Stop with ``msg`` on stderr and exit ``code`` (2: bad input); under --json also the error document."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        _json_error(ctx, msg, code, "input")
    click.echo(msg, err=True)
    sys.exit(code)


class _Group(click.Group):
    def invoke(self, ctx):
        def fail(message: str, kind: str, code: int = EXIT_BAD_INPUT) -> None:
            _json_error(ctx, message, code, kind)
            click.echo(message, err=True)
            sys.exit(code)

        try:
            return super().invoke(ctx)
        except SpecError as e:
            fail(e.render(), "spec")
        except UsageFailure as e:
            fail(f"error: {e}", "input")
        except FileNotFoundError as e:
            fail(f"error: {e}", "input")
        except FileReadError as e:           # an untrusted file that cannot be read (patchdsl.util.files)
            fail(f"error: {e}", "input")
        except click.UsageError as e:        # a bad option: click's message, exit 2 (and the JSON document)
            _json_error(ctx, e.format_message(), EXIT_BAD_INPUT, "usage")
            raise
        except (KeyboardInterrupt, click.Abort):
            fail("interrupted", "interrupted", EXIT_INTERRUPTED)
        except Exception as e:
            # bad data that is not a spec error: a plan file, an unusable kernel cache, a value
            # that cannot go into generated code, a model the plan does not fit
            from .codegen import CacheError, CodegenError
            from .planning.plan_file import PlanError
            from .runtime import PatchError

            if isinstance(e, (CacheError, CodegenError, PlanError, PatchError)):
                fail(f"error: {e}", "input")
            if isinstance(e, (click.ClickException, click.exceptions.Exit, click.exceptions.Abort)):
                raise
            if os.environ.get("PATCHDSL_DEBUG"):
                raise
            # anything else is a bug of patchdsl, not the user's input or a failed verification:
            # its own exit status, one line that says where (PATCHDSL_DEBUG=1: the traceback)
            import traceback

            tb = traceback.extract_tb(e.__traceback__)
            where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
            msg = (str(e).splitlines() or [""])[0][:300]
            fail(f"internal error: {type(e).__name__}{where}: {msg}\n"
                 f"  this is a bug in patchdsl (not your input): please report it with the command; "
                 f"PATCHDSL_DEBUG=1 shows the traceback", "internal", EXIT_INTERNAL)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="patchdsl")
def main() -> None:
    """Declarative fused Triton kernels for Hugging Face transformers models.

    SPEC, wherever a command takes one, is a path to a .kpatch file or the name of a shipped spec
    (qwen3, llama, mistral, qwen2, gemma3, phi3).  --json, wherever a command takes it, prints one
    JSON document on stdout (on an error too: {"ok": false, "exit_code": 2, "error": ...}).
    Exit status: 0 success, 1 a verification failed, 2 bad input (spec, model, options),
    3 an internal error (a bug of patchdsl), 130 interrupted (Ctrl-C).
    """


def _read_spec(path: str):
    """SPEC (a file or a shipped spec's name), its includes expanded; SpecError (exit 2) if bad.
    Folders given with ``--include-dir`` may be read by its includes."""
    from .planning.check import check_loaded
    from .syntax.parser import read_spec

    ctx = click.get_current_context(silent=True)
    dirs = ctx.meta.get("patchdsl.include_dirs", ()) if ctx is not None else ()
    checked = check_loaded(lambda: read_spec(path, include_dirs=dirs))
    if ctx is not None:
        ctx.meta["patchdsl.checked"] = checked       # its rules, for the plan's one-line-per-rule view
    return checked.spec


def include_dir_option(f):
    """``--include-dir DIR`` (repeatable), stored for :func:`_read_spec` (not a parameter of f)."""
    def store(ctx, _param, value):
        ctx.meta["patchdsl.include_dirs"] = tuple(value)

    return click.option("--include-dir", multiple=True, expose_value=False, callback=store,
                        type=click.Path(file_okay=False, exists=True),
                        help="A folder that `include` may read besides the spec's own folder and the "
                             "shipped specs (repeatable).")(f)


def json_option(f):
    """``--json``, the same for every command: one JSON document on stdout, an error document on
    failure (see :class:`_Group`); human-readable output then goes to stderr or is left out."""
    def store(ctx, _param, value):
        ctx.meta["patchdsl.json"] = bool(value)
        return bool(value)

    return click.option("--json", "as_json", is_flag=True, callback=store, is_eager=True,
                        help="Print one JSON document on stdout (an error document on failure).")(f)


DTYPE_CHOICE = click.Choice(list(DTYPES))
TARGET_CHOICE = click.Choice(list(TARGETS))


def _default_dtype(device: str) -> str:
    """The model dtype when --dtype is not given, the same for apply and verify: bf16 on a GPU, fp32 on the CPU."""
    return "bf16" if device.startswith("cuda") else "fp32"


def _load_model(model: str, *, meta: bool, dtype: str | None = None, device: str = "cpu", log=None, tiny=False,
                seed: int = 0):
    from .model import ModelLoadError, load_model

    try:
        return load_model(model, meta=meta, dtype=dtype, device=device, log=log or (lambda m: click.echo(m, err=True)),
                          tiny=tiny, seed=seed)
    except ModelLoadError as e:
        raise UsageFailure(str(e)) from None


# ---------------------------------------------------------------- check
@main.command()
@click.argument("spec")
@json_option
@include_dir_option
def check(spec: str, as_json: bool) -> None:
    """Check a spec's syntax, ops, flags and kinds (no model needed)."""
    from .planning.check import check_spec

    checked = check_spec(_read_spec(spec))
    if as_json:
        out = {"spec": spec, "ok": True, "dtypes": list(checked.spec.dtypes), "rules": [
            {"rule": cr.rule.span.short, "text": cr.rule.text, "op": cr.op, "optional": cr.rule.optional,
             "flags": {k: v.value for k, v in cr.explicit}} for cr in checked.rules]}
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(f"{spec}: ok ({len(checked.rules)} rule(s), dtypes {', '.join(checked.spec.dtypes) or 'from the model'})")


# ---------------------------------------------------------------- plan
def _plan(spec: str, model: str, dtype: str | None, target: str | None, tiny: bool = False):
    from .planning.planner import plan as make_plan

    sp = _read_spec(spec)
    loaded = _load_model(model, meta=True, tiny=tiny)
    dts = (dtype,) if dtype else None
    return make_plan(sp, loaded.model, target=target, dtypes=dts), loaded


def print_plan(p, console=None, *, sites: bool = False, err: bool = False) -> None:
    """The plan as plain fixed-column lines (patchdsl.planning.text): one per rule, or with ``sites`` one
    per site; refusals in yellow on a terminal.  ``console`` is accepted for old callers and unused."""
    from .planning import text as plantext

    ctx = click.get_current_context(silent=True)
    checked = ctx.meta.get("patchdsl.checked") if ctx is not None else None
    rules = plantext.rule_texts(checked.rules) if checked is not None and checked.spec.path == p.spec else None
    lines = plantext.site_lines(p) if sites else plantext.short_lines(p, rules)
    refusals = set(plantext.refusal_lines(p))
    for line in lines:
        click.echo(click.style(line, fg="yellow") if line in refusals else line, err=err)


@main.command()
@click.argument("spec")
@click.option("--model", "-m", required=True, help="Hub id, local folder with config.json, or path to a config.json (no weights: random, built from the config).")
@click.option("--dtype", type=DTYPE_CHOICE, help="Override the spec's dtype directive.")
@click.option("--target", type=TARGET_CHOICE, help="Kernel target (default: detected).")
@click.option("--sites", is_flag=True, help="A line per site (path, class, op, flags, rule) instead of a line per rule.")
@json_option
@include_dir_option
def plan(spec: str, model: str, dtype: str | None, target: str | None, sites: bool, as_json: bool) -> None:
    """Resolve SPEC against a model's module tree and print what would be patched: a line per rule
    (sites patched, refused, present), the refusals, the totals; --sites for a line per site."""
    p, _ = _plan(spec, model, dtype, target)
    if as_json:
        click.echo(p.dumps())
    else:
        print_plan(p, sites=sites)
    # as apply and verify: a site the spec asks for (its rule is not `optional`) that the model
    # refuses is bad input, exit 2; the plan above still says what would be patched and why not
    required = [s for s in p.refused_sites if not s.optional]
    if required:
        click.echo(f"error: {len(required)} site(s) the spec asks for are refused by the model "
                   f"(first: {required[0].path or '<model>'}: {required[0].refused}); start the rule with "
                   f"'optional' to accept that", err=True)
        sys.exit(EXIT_BAD_INPUT)


# ---------------------------------------------------------------- codegen
@main.command()
@click.argument("spec")
@click.option("--model", "-m", required=True, help="Hub id, local folder with config.json, or path to a config.json (no weights: random, built from the config).")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="Folder for the generated kernels.")
@click.option("--dtype", type=DTYPE_CHOICE, help="Override the spec's dtype directive.")
@click.option("--target", type=TARGET_CHOICE,
              help="Kernel target (default: cuda with a GPU, else the Triton interpreter).")
@json_option
@include_dir_option
def codegen(spec: str, model: str, out: str, dtype: str | None, target: str | None, as_json: bool) -> None:
    """Write every kernel the plan needs into OUT, for reading."""
    from .codegen.cache import write_kernel

    p, _ = _plan(spec, model, dtype, target)
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageFailure(f"cannot create '{out}': {e.strerror or e}") from None
    umask = os.umask(0)
    os.umask(umask)
    written = []
    for key in p.kernel_keys():
        path = write_kernel(key, Path(out), flat=True)
        os.chmod(path, 0o666 & ~umask)      # a file for reading, as any file the user writes (0644 under umask 022)
        written.append(str(path))
        click.echo(f"wrote {path}", err=as_json)
    if as_json:
        click.echo(json.dumps({"ok": True, "exit_code": EXIT_OK, "out": out, "files": written}, indent=2))


# ---------------------------------------------------------------- apply
_DEVICE = re.compile(r"cpu|cuda(:\d{1,3})?")


def _device(device: str | None) -> str:
    """``--device`` checked against this machine: cpu, cuda or cuda:N (exit 2 otherwise)."""
    import torch

    if not device:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not _DEVICE.fullmatch(device):
        raise UsageFailure(f"--device {device[:40]!r}: expected cpu, cuda or cuda:N")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            why = ("this torch was built without CUDA" if torch.version.cuda is None
                   else "torch sees no CUDA device")
            raise UsageFailure(f"--device {device}: {why}; use --device cpu (kernels then run in Triton's interpreter)")
        n = torch.cuda.device_count()
        if ":" in device and int(device.split(":")[1]) >= n:
            raise UsageFailure(f"--device {device}: this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    return device


def _finite(ctx, param, value):
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


# upper bounds of the workload options (far above what a run of apply / verify takes)
MAX_BATCH, MAX_SEQ, MAX_STEPS = 65536, 1 << 20, 100_000
SEED = click.IntRange(0, 2 ** 63 - 1)


@main.command()
@click.argument("spec")
@click.option("--model", "-m", required=True, help="Hub id, local folder with config.json, or path to a config.json (no weights: random, built from the config).")
@click.option("--steps", type=click.IntRange(1, MAX_STEPS), help="Measured training steps (default: 3 on CPU, 20 on GPU).")
@click.option("--batch", type=click.IntRange(1, MAX_BATCH), help="Batch size (default: 1 on CPU, 16 on GPU).")
@click.option("--seq", type=click.IntRange(2, MAX_SEQ), help="Sequence length (default: 16 on CPU, 2048 on GPU).")
@click.option("--dtype", type=DTYPE_CHOICE, help="Model dtype (default: bf16 on GPU, fp32 on CPU, as verify).")
@click.option("--device", help="cpu or cuda[:N] (default: cuda when available).")
@click.option("--tiny/--full", default=None, help="Shrink the architecture (default: tiny on CPU, full on GPU).")
@click.option("--lr", type=click.FloatRange(0, 10, min_open=True), default=1e-4, show_default=True, callback=_finite,
              help="AdamW learning rate of both runs.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the weights and the batches.")
@json_option
@click.option("--json-out", "json_out", type=click.Path(dir_okay=False),
              help="Also write the JSON document to this file.")
@include_dir_option
def apply(spec, model, steps, batch, seq, dtype, device, tiny, lr, seed, as_json, json_out) -> None:
    """Patch a model and train it twice (unpatched, patched) side by side.

    Prints the plan (a line per rule), the loss of every measured step of both runs and, on a GPU,
    tokens/s, step time and peak memory.  On the CPU the kernels run in Triton's interpreter, so
    no speed is reported there: compare losses on the CPU, speed on a GPU.
    """
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .planning import text as plantext
    from .planning.planner import plan as make_plan
    from .training.workload import Workload, measured_steps, side_by_side

    console = _console(stderr=as_json)        # with --json, stdout carries the document only

    def say(line: str = "") -> None:
        click.echo(line, err=as_json)

    if json_out and files.exists(json_out) and not files.is_file(json_out):
        raise UsageFailure(f"--json-out {files.show(json_out)}: not a regular file (a FIFO or a device would block "
                           f"or swallow the results)")
    device = _device(device)
    on_gpu = device.startswith("cuda")
    dtype = dtype or _default_dtype(device)
    tiny = (not on_gpu) if tiny is None else tiny
    d = Workload.default(device)
    w = Workload(steps or d.steps, batch or d.batch, seq or d.seq, lr, seed, d.warmup)
    sp = _read_spec(spec)
    torch.manual_seed(seed)
    loaded = _load_model(model, meta=False, dtype=dtype, device=device, tiny=tiny, seed=seed)
    if tiny:
        tc = loaded.model.config.get_text_config()      # a vision-language model: its language tower
        say(f"CPU workload: tiny {loaded.model.config.model_type} architecture "
            f"(hidden {tc.hidden_size}, {tc.num_hidden_layers} layers); "
            f"pass --full for the real sizes")
    p = make_plan(sp, loaded.model, dtypes=(dtype,))
    print_plan(p, err=as_json)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as prog:
        kt = prog.add_task("generating kernels", total=len(p.kernel_keys()))
        from .codegen import load_kernel

        for key in p.kernel_keys():
            load_kernel(key)
            prog.advance(kt)

        def bar(label, total):
            # the bar counts the measured steps, as the table does; the warm-up steps before them
            # show as "(warm-up)" in the description and are not counted
            warm = total - w.steps
            t = prog.add_task(f"training {label} (warm-up)" if warm > 0 else f"training {label}", total=w.steps)
            seen = [0]

            def advance(n):
                before = seen[0]
                seen[0] += n
                counted = measured_steps(before, seen[0], warm)
                if before < warm <= seen[0]:
                    prog.update(t, description=f"training {label}")
                if counted:
                    prog.advance(t, counted)
            return advance

        run = side_by_side(loaded.model, p, w, dtype=dtype, device=device, seed=seed, progress_factory=bar)
    ref, pat, handle = run.unpatched, run.patched, run.handle
    for r in handle.refused:
        say(click.style(str(r), fg="yellow"))
    say(f"{w.steps} steps, batch {w.batch} x {w.seq}, {dtype}, {device}")
    rows = [[str(i + 1), f"{a:.5f}", f"{b:.5f}", f"{b - a:+.2e}"] for i, (a, b) in enumerate(zip(ref.losses, pat.losses))]
    for line in plantext.columns(["step", "loss unpatched", "loss patched", "diff"], rows, right=(0, 1, 2, 3)):
        say(line)
    if on_gpu:
        gib = 2 ** 30
        speed = [["tokens/s", f"{ref.tokens_per_s:,.0f}", f"{pat.tokens_per_s:,.0f}",
                  f"{pat.tokens_per_s / ref.tokens_per_s:.2f}x" if ref.tokens_per_s else "-"],
                 ["step time", f"{ref.step_ms:.1f} ms", f"{pat.step_ms:.1f} ms",
                  f"{pat.step_ms / ref.step_ms:.2f}x" if ref.step_ms else "-"]]
        if ref.peak_mem_bytes is not None and pat.peak_mem_bytes is not None:
            speed.append(["peak memory", f"{ref.peak_mem_bytes / gib:.2f} GiB", f"{pat.peak_mem_bytes / gib:.2f} GiB",
                          f"{pat.peak_mem_bytes / ref.peak_mem_bytes:.2f}x" if ref.peak_mem_bytes else "-"])
        for line in plantext.columns(["", "unpatched", "patched", "ratio"], speed, right=(1, 2, 3)):
            say(line)
    else:
        say("speed: not reported on the CPU (the patched kernels run in Triton's interpreter, so tokens/s and "
            "step times say nothing about them); compare losses here, speed on a GPU")
    totals, fused, parity = run.totals, run.fused, run.parity
    say(f"patched {len(handle.patched)} site(s)" + (f" (+{fused} module(s) fused into them)" if fused else "")
        + f", refused {len(handle.refused)}; " + "; ".join(f"{pt}/{pr} {n}" for n, pt, pr in totals))
    say(f"parity: {'passed' if parity['passed'] else 'FAILED'} -- {parity['verdict']}")
    code = EXIT_BAD_INPUT if run.refused_required else (EXIT_OK if run.passed else EXIT_FAILED)
    doc = {"ok": code == EXIT_OK, "exit_code": code,
           "spec": spec, "model": model, "device": device, "dtype": dtype, "tiny": tiny, **run.to_json(on_gpu)}
    if as_json:
        click.echo(json.dumps(doc, indent=2, default=str))
    if json_out:
        try:
            Path(json_out).write_text(json.dumps(doc, indent=2, default=str))
        except OSError as e:
            raise UsageFailure(f"cannot write --json-out {files.show(json_out)}: {e.strerror or e}") from None
    handle.undo()
    if code != EXIT_OK:
        sys.exit(code)


# ---------------------------------------------------------------- verify
@main.command()
@click.argument("spec")
@click.option("--model", "-m", required=True, help="Hub id, local folder with config.json, or path to a config.json (no weights: random, built from the config).")
@click.option("--dtype", type=DTYPE_CHOICE,
              help="Dtype of the model under test (default: bf16 on GPU, fp32 on CPU, as apply); the reference "
                   "runs in float64.")
@click.option("--batch", type=click.IntRange(1, MAX_BATCH), default=2, show_default=True,
              help="Batch size of the verification inputs.")
@click.option("--seq", type=click.IntRange(2, MAX_SEQ), default=16, show_default=True,
              help="Sequence length of the verification inputs.")
@click.option("--steps", type=click.IntRange(0, MAX_STEPS), default=0, show_default=True,
              help="Also compare N optimizer steps.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the weights and inputs.")
@click.option("--device", help="cpu or cuda[:N] (default: cuda when available).")
@click.option("--tiny/--full", default=None, help="Shrink the architecture (default: tiny on CPU, full on GPU).")
@click.option("--layers", type=click.IntRange(1, 100_000),
              help="Keep only the first N decoder layers: a quick check of a large model at its real widths "
                   "(the report says so).")
@click.option("--reference", type=click.Choice(["auto", "whole", "streamed"]), default="auto", show_default=True,
              help="The float64 reference: a copy of the whole model, or streamed one decoder layer at a time "
                   "(for models whose float64 copy does not fit); auto picks by a memory estimate.")
@click.option("--images/--text-only", "images", default=None,
              help="Vision-language models: feed an image batch built from the config, so the vision tower runs "
                   "and its sites are judged (default: images when a batch runs, else text only with the "
                   "reason; --images fails with the reason instead), or text only.")
@json_option
@click.option("--progress", is_flag=True, help="Say on stderr what runs, with elapsed seconds.")
@include_dir_option
def verify(spec, model, dtype, batch, seq, steps, seed, device, tiny, layers, reference, images, as_json,
           progress) -> None:
    """Prove gradient parity of the patched model against a float64 reference."""
    from .parity import verify as run_verify
    from .parity.stream import VerifyError, build_dtype

    device = _device(device)
    dtype = dtype or _default_dtype(device)
    tiny = (not device.startswith("cuda")) if tiny is None else tiny
    sp = _read_spec(spec)
    told = []
    # validate the model id early (exit 2) and say where it came from
    meta = _load_model(model, meta=True, tiny=tiny, log=lambda m: None).model   # quietly
    # on a GPU the model is built there (in fp32 when the whole float64 model fits beside it, else in the
    # run dtype: the reference then evaluates exactly the weights under test); on the CPU in fp32
    try:
        build_dt, build_dev = (("fp32", "cpu") if tiny or not device.startswith("cuda") else
                               (build_dtype(meta, dtype, batch, seq, steps, device, reference, layers), device))
    except VerifyError as e:
        raise UsageFailure(str(e)) from None
    del meta

    def factory():
        import torch

        torch.manual_seed(seed)
        # the first build says what verify runs on (random weights, seed); the others are the same model
        log = None if told else (lambda m: click.echo(m, err=True))
        told.append(True)
        return _load_model(model, meta=False, dtype=build_dt, device=build_dev, tiny=tiny, seed=seed,
                           log=log or (lambda m: None)).model

    t0 = time.perf_counter()

    def say(m: str) -> None:
        click.echo(f"[verify {time.perf_counter() - t0:7.1f}s] {m}", err=True)

    try:
        report = run_verify(sp, factory, dtype=dtype, batch=batch, seq=seq, steps=steps, seed=seed, device=device,
                            layers=layers, reference=reference, images=images, log=say if progress else None)
    except VerifyError as e:           # out of memory, or a reference that cannot run as asked
        raise UsageFailure(str(e)) from None
    if progress:
        say("done")
    if as_json:
        doc = {"ok": report.passed, "exit_code": report.exit_code(), **report.to_json()}
        click.echo(json.dumps(doc, indent=2, default=str))
    else:
        console = _console()
        if console.is_terminal:
            report.render_table(console)
        else:                 # a file, a pipe, grep: a whole line per check, never wrapped
            for line in report.plain_lines():
                click.echo(line)
    sys.exit(report.exit_code())


# ---------------------------------------------------------------- translate
@main.command()
@click.option("--liger", "liger", metavar="JSON|@FILE",
              help="Liger-Kernel's liger_kernel_config as JSON ('{\"rope\": true, ...}'), 'true' for "
                   "use_liger_kernel with Liger's defaults, or @file (JSON or YAML; a training config's "
                   "use_liger_kernel / liger_kernel_config keys are read).")
@click.option("--kernel-mapping", "kernel_mapping", type=click.Path(dir_okay=False),
              help="A transformers KernelConfig kernel_mapping as JSON: {\"RMSNorm\": \"org/repo:Layer\", ...}.")
@click.option("--model", "-m", help="Hub id, local folder, or path to config.json (the spec is written for it).")
@click.option("--device", default="cuda", show_default=True,
              help="With --kernel-mapping: which entry of per-device mapping values to take.")
@json_option
def translate(liger: str | None, kernel_mapping: str | None, model: str | None, device: str, as_json: bool) -> None:
    """Print the spec equivalent to another tool's kernel settings (--liger or --kernel-mapping) for --model."""
    def emit(text: str) -> None:
        if as_json:
            click.echo(json.dumps({"ok": True, "exit_code": EXIT_OK, "spec": text}, indent=2))
        else:
            click.echo(text, nl=False)

    if (liger is None) == (kernel_mapping is None):
        raise UsageFailure("say what to translate: --liger JSON|@FILE or --kernel-mapping FILE.json")
    if model is None:
        raise UsageFailure("translate needs --model M: the spec depends on the model's modules")
    if kernel_mapping:
        from .interop.translate import MappingError, load_mapping, translate as run_translate

        try:
            mapping = load_mapping(kernel_mapping)
        except FileReadError as e:
            raise UsageFailure(str(e) if e.reason in ("missing", "os", "not-regular", "too-large")
                               else f"cannot read the kernel mapping: {e}") from None
        loaded = _load_model(model, meta=True)
        try:
            emit(run_translate(mapping, loaded.model, device=device, source=kernel_mapping))
        except MappingError as e:
            raise UsageFailure(f"{kernel_mapping}: {e}") from None
        return
    from .model.index import build_index
    from .interop.liger import parse_liger_argument, translate_liger

    use, cfg = parse_liger_argument(liger)
    loaded = _load_model(model, meta=True, log=lambda m: None)
    t = translate_liger(cfg, build_index(loaded.model), use_liger_kernel=use)
    if t.problems:
        raise UsageFailure("\nerror: ".join(t.problems) + "\nhint: turn those keys off (false) in the Liger config, "
                           "or follow the 'use ...' above; patchdsl does not drop them silently")
    emit(t.text)


# ---------------------------------------------------------------- inspect / suggest / census
@main.command("inspect")
@click.option("--model", "-m", required=True, help="Hub id, local folder with config.json, or path to a config.json (no weights: random, built from the config).")
@click.option("--all", "everything", is_flag=True, help="Every module, not only norms, MLPs, attention and the LM head.")
@click.option("--no-fold", "no_fold", is_flag=True, help="One row per module (repeated layers are folded by default).")
@json_option
def inspect_cmd(model: str, everything: bool, no_fold: bool, as_json: bool) -> None:
    """List a model's modules with their structural kinds and facts (sizes, eps, offset, activation, rotary)."""
    from .model.index import build_index
    from .model.inspection import inspect_model, render

    loaded = _load_model(model, meta=True, log=lambda m: None)
    index = build_index(loaded.model)
    if as_json:
        click.echo(json.dumps({"ok": True, "exit_code": EXIT_OK,
                               **inspect_model(index, everything=everything, fold=not no_fold)},
                              indent=2, default=str))
    else:
        click.echo(render(index, everything=everything, fold=not no_fold), nl=False)


@main.command("suggest")
@click.option("--model", "-m", required=True, help="Hub id, local folder with config.json, or path to a config.json (no weights: random, built from the config).")
@click.option("--out", "out", type=click.Path(dir_okay=False), help="Write the spec to this file (default: print it).")
@click.option("--images/--text-only", "images", default=None,
              help="Vision-language models: include the vision tower's rules (verify feeds it an image batch) "
                   "or leave it out (default: included when an image batch can be built from the config).")
def suggest_cmd(model: str, out: str | None, images: bool | None) -> None:
    """Print the spec that patches everything patchdsl can on a model, with the reason for each module it cannot."""
    from .parity.images import plan_recipe
    from .planning.suggestion import suggest as run_suggest

    loaded = _load_model(model, meta=True, log=lambda m: None)
    vision: bool | str | None = None
    if images is not False and getattr(loaded.model.config, "vision_config", None) is not None:
        # keep the vision tower's rules only where verify's image batch runs (tried on a tiny model of
        # this config: the layout depends on the family, not on the widths), unless --images insists
        recipe, why = plan_recipe(loaded.model)
        if recipe is not None and not images:
            from .parity.images import image_batch_check

            ok, why2 = image_batch_check(loaded.model.config)
            recipe, why = (recipe, "") if ok is not False else (None, why2)
        vision = True if (recipe is not None or images) else why
    elif images:
        raise UsageFailure(f"--images: {type(loaded.model).__name__} is not a vision-language model "
                           "(its config has no vision_config)")
    s = run_suggest(loaded.model, name=model, images=vision)
    if out:
        try:
            Path(out).write_text(s.text)
        except OSError as e:
            raise UsageFailure(f"cannot write '{out}': {e.strerror or e}") from None
        a = s.counts()
        click.echo(f"wrote {out}: " + "; ".join(f"{p}/{n} {c}" for c, (p, n) in a.items() if n), err=True)
    else:
        click.echo(s.text, nl=False)


def maintenance_tool(module: str, command: str):
    """``patchdsl_tools.<module>``: a maintenance tool of a patchdsl checkout (``tools/``, not shipped in
    the wheel; ``pip install -e .`` puts it on the path)."""
    import importlib

    try:
        return importlib.import_module(f"patchdsl_tools.{module}")
    except ImportError as e:
        if not (e.name or "").startswith("patchdsl_tools"):
            raise
        raise UsageFailure(f"`patchdsl {command}` is a maintenance tool of a patchdsl checkout "
                           f"(tools/patchdsl_tools/), not part of the installed package: run it from a checkout "
                           f"installed with pip install -e .") from None


@main.command("census")
@click.argument("families", nargs=-1)
@click.option("--no-verify", "no_verify", is_flag=True, help="Suggest and plan only (fast); the verify column says '-'.")
@click.option("--out", "out", default="docs/coverage.md", show_default=True,
              help="The table's file ('-' prints it).")
@click.option("--sample", is_flag=True, help="Only the families CI checks (patchdsl_tools.census.CI_SAMPLE).")
def census_cmd(families, no_verify: bool, out: str, sample: bool) -> None:
    """Coverage census: every causal-LM family of the installed transformers (or FAMILIES), tiny config, suggest, plan, verify."""
    census_main = maintenance_tool("census", "census").main
    args = list(families) + (["--no-verify"] if no_verify else []) + ["--out", out] + (["--sample"] if sample else [])
    sys.exit(census_main(args))


# ---------------------------------------------------------------- bench
@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
              add_help_option=False)
@click.pass_context
def bench(ctx) -> None:
    """Benchmarks (GPU): ops, e2e, specialise, summary, plot; `patchdsl bench SUB --help` for each.

    \b
    patchdsl bench ops         per-op time and memory against HF eager, torch.compile, Liger, CCE
    patchdsl bench e2e         end-to-end training throughput, variants side by side
    patchdsl bench specialise  specialised vs generic kernels
    patchdsl bench summary F   print the tables of a results JSON again
    patchdsl bench plot F      plot a results JSON
    Results go into --out, else $OUT, else a new bench-results/<command>-<time>/ folder.
    """
    bench_run = maintenance_tool("bench.cli", "bench").run
    sys.exit(bench_run(ctx.args))


if __name__ == "__main__":  # pragma: no cover
    main()
