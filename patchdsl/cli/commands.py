"""The commands that read specs and models: check, plan, codegen, translate, inspect, suggest, and the
maintenance tools (census, bench) of a checkout."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from ..util import files
from ..util.files import FileReadError
from .app import (DTYPE_CHOICE, EXIT_BAD_INPUT, EXIT_OK, TARGET_CHOICE, UsageFailure, _load_model, _read_spec,
                  include_dir_option, json_option, main)



# ---------------------------------------------------------------- check
@main.command()
@click.argument("spec")
@json_option
@include_dir_option
def check(spec: str, as_json: bool) -> None:
    """Check a spec's syntax, ops, flags and kinds (no model needed)."""
    from ..planning.check import check_spec

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
    from ..planning.planner import plan as make_plan

    sp = _read_spec(spec)
    loaded = _load_model(model, meta=True, tiny=tiny)
    dts = (dtype,) if dtype else None
    return make_plan(sp, loaded.model, target=target, dtypes=dts), loaded


def print_plan(p, console=None, *, sites: bool = False, err: bool = False) -> None:
    """The plan as plain fixed-column lines (patchdsl.planning.text): one per rule, or with ``sites`` one
    per site; refusals in yellow on a terminal.  ``console`` is accepted for old callers and unused."""
    from ..planning import text as plantext

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
@click.option("--out", "out", required=True, metavar="DIR", help="Folder for the generated kernels.")
@click.option("--dtype", type=DTYPE_CHOICE, help="Override the spec's dtype directive.")
@click.option("--target", type=TARGET_CHOICE,
              help="Kernel target (default: cuda with a GPU, else the Triton interpreter).")
@json_option
@include_dir_option
def codegen(spec: str, model: str, out: str, dtype: str | None, target: str | None, as_json: bool) -> None:
    """Write every kernel the plan needs into OUT, for reading."""
    from ..codegen.cache import write_kernel

    if files.exists(out):           # a file, FIFO or device there: refused before the plan
        files.check_folder(out, what="--out", create=False)
    p, _ = _plan(spec, model, dtype, target)
    files.check_folder(out, what="--out")
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
        from ..interop.translate import MappingError, load_mapping, translate as run_translate

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
    from ..model.index import build_index
    from ..interop.liger import parse_liger_argument, text_model_type_of, translate_liger

    use, cfg = parse_liger_argument(liger)
    loaded = _load_model(model, meta=True, log=lambda m: None)
    index = build_index(loaded.model)
    text_type = text_model_type_of(loaded.model)
    t = translate_liger(cfg, index, use_liger_kernel=use, text_model_type=text_type)
    if t.problems:
        # the hint is a command that works: the same keys with those that fit nothing off (or swapped for
        # the key their error names), tried here first; patchdsl does not drop keys silently
        from ..interop.liger import fitting_config

        import shlex

        fixed = fitting_config(t, index, text_type)
        changed = ", ".join([f"{k} off" for k, _ in t.misfits] + [f"{i} on" for _, i in t.misfits if i])
        hint = (f"hint: patchdsl translate --liger {shlex.quote(json.dumps(fixed))} --model {shlex.quote(model)} "
                f"translates the keys that fit this model ({changed})"
                if fixed is not None else f"hint: nothing of this Liger config fits {type(loaded.model).__name__}; "
                f"`patchdsl suggest --model {model}` writes the spec that patches what patchdsl can")
        raise UsageFailure("\nerror: ".join(t.problems) + "\n" + hint)
    emit(t.text)


# ---------------------------------------------------------------- inspect / suggest / census
@main.command("inspect")
@click.option("--model", "-m", required=True, help="Hub id, local folder with config.json, or path to a config.json (no weights: random, built from the config).")
@click.option("--all", "everything", is_flag=True, help="Every module, not only norms, MLPs, attention and the LM head.")
@click.option("--no-fold", "no_fold", is_flag=True, help="One row per module (repeated layers are folded by default).")
@json_option
def inspect_cmd(model: str, everything: bool, no_fold: bool, as_json: bool) -> None:
    """List a model's modules with their structural kinds and facts (sizes, eps, offset, activation, rotary)."""
    from ..model.index import build_index
    from ..model.inspection import inspect_model, render

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
@click.option("--out", "out", metavar="FILE", help="Write the spec to this file (default: print it).")
@click.option("--images/--text-only", "images", default=None,
              help="Vision-language models: include the vision tower's rules (verify feeds it an image batch) "
                   "or leave it out (default: included when an image batch can be built from the config).")
def suggest_cmd(model: str, out: str | None, images: bool | None) -> None:
    """Print the spec that patches everything patchdsl can on a model, with the reason for each module it cannot."""
    from ..parity.images import plan_recipe
    from ..planning.suggestion import suggest as run_suggest

    if out:
        files.check_writable(out, what="--out")       # before the work: a FIFO, device or folder is refused now
    loaded = _load_model(model, meta=True, log=lambda m: None)
    vision: bool | str | None = None
    if images is not False and getattr(loaded.model.config, "vision_config", None) is not None:
        # keep the vision tower's rules only where verify's image batch runs (tried on a tiny model of
        # this config: the layout depends on the family, not on the widths), unless --images insists
        recipe, why = plan_recipe(loaded.model)
        if recipe is not None and not images:
            from ..parity.images import image_batch_check

            # only where the image batch ran: a vision rule verify cannot feed would fail as "did not run"
            # (Qwen2-VL: its tiny vision tower was not tried, and verify of the suggestion FAILED)
            ok, why2 = image_batch_check(loaded.model.config)
            recipe, why = (recipe, "") if ok else (None, why2)
        vision = True if (recipe is not None or images) else why
    elif images:
        raise UsageFailure(f"--images: {type(loaded.model).__name__} is not a vision-language model "
                           "(its config has no vision_config)")
    s = run_suggest(loaded.model, name=model, images=vision)
    if out:
        files.write_text(out, s.text, what="--out")
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
    if out != "-":
        files.check_writable(out, what="--out")
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
