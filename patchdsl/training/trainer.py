"""patchdsl in a training script: the Trainer callback and ``patch_for_training``.

    from patchdsl import PatchdslArguments, PatchdslCallback
    training_args, kpatch_args = HfArgumentParser((TrainingArguments, PatchdslArguments)).parse_args_into_dataclasses()
    trainer = Trainer(model, training_args, ..., callbacks=[PatchdslCallback.from_args(kpatch_args)])

``PatchdslCallback.from_args(args)`` takes either ``PatchdslArguments`` or ``patchdsl.TrainingArguments``
(see :mod:`patchdsl.training.args`).  The older form ``PatchdslCallback(config)`` takes a spec
path / shipped name / Spec, or a mapping with exactly these keys:

    spec:   path or shipped name of a .kpatch file            (this, or rules)
    rules:  list of rule lines (spec text, one statement each) (this, or spec)
    dtype:  list of dtypes to specialise for                   (optional, with rules)
    strict: refuse to start training if any site is refused    (optional, default true)

Unknown keys are errors with a did-you-mean, never silently dropped.

What happens, and when (docs/training.md says the same for users):

* ``on_init_end`` (inside ``Trainer.__init__``): with ``kpatch_from_liger``, the callback takes
  ``use_liger_kernel`` / ``liger_kernel_config`` over from the training arguments and switches
  ``use_liger_kernel`` off, so that the Trainer does not apply Liger as well.
* ``on_train_begin`` (after the model is built, re-built by ``model_init``, loaded from a checkpoint,
  set up for gradient checkpointing, and before the first step): the spec is planned against the
  model (the PEFT base model, as ``use_liger_kernel`` does), optionally verified, and applied.  A
  refused site stops training here when ``strict``; a failed verification exits with status 1.  The
  plan's totals are logged once (``transformers.trainer``'s logger and ``state.log_history``).
* The patch stays on for evaluation and prediction inside training, and is undone at
  ``on_train_end``, so a standalone ``evaluate()`` runs the original model.

``kpatch_cuda_graphs``: the callback refuses it when it is built (``TrainerGraphsRefused``, the
reasons in ``TRAINER_GRAPHS_REASONS``); ``patch_for_training`` accepts it for loops you write and
gives ``handle.graph_step`` (:func:`patchdsl.graph_step` bound to the model).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..syntax import SpecError, load_spec, parse_spec
from ..syntax.ast import Spec
from ..syntax.errors import did_you_mean

CONFIG_KEYS = ("spec", "rules", "dtype", "strict")
LOSS_OPS = ("fused_linear_cross_entropy", "fused_cross_entropy")
LIGER_SPEC_NAME = "<liger_kernel_config>"


def spec_from_config(config: Any) -> tuple[Spec, bool]:
    """(spec, strict) from a path / shipped name / Spec / mapping (see the module docstring)."""
    if isinstance(config, Spec):
        return config, True
    if isinstance(config, (str, Path)):
        return load_spec(config), True
    if not isinstance(config, Mapping):
        raise SpecError(f"patchdsl config must be a spec path or a mapping, got {type(config).__name__}")
    for k in config:
        if k not in CONFIG_KEYS:
            raise SpecError(f"unknown patchdsl config key '{k}'",
                            hint=did_you_mean(str(k), CONFIG_KEYS) or f"keys: {', '.join(CONFIG_KEYS)}")
    strict = config.get("strict", True)
    if not isinstance(strict, bool):
        raise SpecError(f"patchdsl config 'strict' must be true or false, got {strict!r}")
    if ("spec" in config) == ("rules" in config):
        raise SpecError("patchdsl config needs exactly one of 'spec' (a file) or 'rules' (a list of lines)")
    if "spec" in config:
        if "dtype" in config:
            raise SpecError("'dtype' goes in the spec file when 'spec' is given")
        return load_spec(config["spec"]), strict
    rules = config["rules"]
    # a list (or tuple) of strings, nothing else: a mapping would be read as its keys and a
    # generator used up by the check (a spec of 0 rules)
    if not isinstance(rules, (list, tuple)) or not all(isinstance(r, str) for r in rules):
        raise SpecError(f"patchdsl config 'rules' must be a list of strings (one statement each), "
                        f"got {type(rules).__name__}")
    if not rules:
        raise SpecError("patchdsl config 'rules' is empty: give at least one rule")
    for i, r in enumerate(rules):
        if "\n" in r or "\r" in r:
            raise SpecError(f"patchdsl config 'rules'[{i}] holds a line break: one statement per entry")
    lines = []
    if "dtype" in config:
        dts = config["dtype"]
        dts = [dts] if isinstance(dts, str) else dts
        if (not isinstance(dts, (list, tuple)) or not dts
                or not all(isinstance(d, str) and d.replace(".", "").isalnum() for d in dts)):
            raise SpecError(f"patchdsl config 'dtype' must be a dtype name or a list of them (fp32, bf16, fp16), "
                            f"got {config['dtype']!r:.80}")
        lines.append("dtype " + ", ".join(dts))
    lines.extend(rules)
    return parse_spec("\n".join(lines) + "\n", "<config>"), strict


# ------------------------------------------------------------------ errors
# Why the Trainer's step cannot be one CUDA graph (transformers 5.17-5.24, trainer.py): each is a
# host-side change between or inside steps that a replayed graph would not see.
TRAINER_GRAPHS_REASONS = (
    "the learning-rate scheduler writes a new Python float into the optimizer every step "
    "(lr_scheduler.step()), which a captured optimizer step would never read",
    "the batches come from a data collator that pads to each batch's longest sequence and adds an "
    "attention_mask, so shapes change from batch to batch and transformers checks the mask on the host",
    "num_items_in_batch is counted from the labels on the host side of the loop and passed to the loss "
    "as a new value each step",
    "gradient accumulation, loss scaling and gradient clipping run in accelerate's code between the "
    "forward, the backward and the optimizer step, with callbacks and logging (.item()) in between",
)


class TrainerGraphsRefused(ValueError):
    """``kpatch_cuda_graphs`` with the Trainer: refused when the callback is built, with the reasons."""

    def __init__(self) -> None:
        super().__init__(
            "patchdsl: kpatch_cuda_graphs is not supported with the Trainer, because its training loop cannot be "
            "captured as a CUDA graph safely:\n" + "\n".join(f"  - {r}" for r in TRAINER_GRAPHS_REASONS)
            + "\n  hint: set kpatch_cuda_graphs: false for the Trainer (the patched kernels still apply), or write "
              "the loop yourself with patchdsl.graph_step(model, optimizer, example_batch) (docs/cuda-graphs.md)")


class KpatchRefused(RuntimeError):
    """``kpatch_strict``: sites of the spec were refused by the model; nothing was patched."""

    def __init__(self, refused: list[Any], spec: str):
        self.refused = list(refused)
        lines = [f"patchdsl: {len(self.refused)} site(s) of {spec} refused by the model, so training stops "
                 f"before the first step (kpatch_strict):"]
        lines += [f"  {r}" for r in self.refused]
        lines.append("  hint: fix the spec (`patchdsl plan SPEC --model M` shows every site), or set "
                     "kpatch_strict: false to train with these sites unpatched")
        super().__init__("\n".join(lines))


class KpatchVerifyFailed(SystemExit):
    """``kpatch_verify``: the parity check failed.  A SystemExit with status 1 (the report is printed
    to stderr first and kept in ``.report``), so a training script stops as ``patchdsl verify`` does."""

    def __init__(self, report: Any):
        self.report = report
        super().__init__(1)

    def __str__(self) -> str:
        return f"patchdsl verify failed before training: {self.report.verdict}"


# ------------------------------------------------------------------ options
@dataclass(frozen=True)
class KpatchOptions:
    """What to patch and how strictly: the ``kpatch_*`` fields, resolved."""

    spec: Spec | None                  # None when translating from Liger
    strict: bool = True
    verify: bool = False
    from_liger: bool = False
    dtypes: tuple[str, ...] | None = None
    log: str = "totals"
    cuda_graphs: bool = False

    @property
    def enabled(self) -> bool:
        return self.spec is not None or self.from_liger

    @classmethod
    def from_args(cls, args: Any) -> "KpatchOptions":
        from .args import KPATCH_FIELDS, validate_kpatch_fields

        missing = [f for f in KPATCH_FIELDS if not hasattr(args, f)]
        if missing:
            raise TypeError(f"{type(args).__name__} has no {', '.join(missing)}: pass patchdsl.PatchdslArguments "
                            f"or patchdsl.TrainingArguments")
        validate_kpatch_fields(args)
        spec = load_spec(args.kpatch_spec) if args.kpatch_spec else None
        return cls(spec, args.kpatch_strict, args.kpatch_verify, args.kpatch_from_liger,
                   tuple(args.kpatch_dtype) if args.kpatch_dtype else None, args.kpatch_log, args.kpatch_cuda_graphs)


def liger_switches(training_args: Any) -> tuple[bool, Any]:
    """(use_liger_kernel, liger_kernel_config) of a TrainingArguments-like object (a JSON string config is read)."""
    use = bool(getattr(training_args, "use_liger_kernel", False))
    cfg = getattr(training_args, "liger_kernel_config", None)
    if isinstance(cfg, str):
        from ..interop.liger import LigerConfigError

        from ..util.files import FileReadError, LIMITS, parse_json

        if len(cfg) > LIMITS["json"]:
            raise LigerConfigError(f"liger_kernel_config is too large ({len(cfg):,} characters)")
        try:
            cfg = parse_json(cfg, "liger_kernel_config")
        except FileReadError as e:
            raise LigerConfigError(str(e)) from None
    return use, cfg


# ------------------------------------------------------------------ the model
def _base_model(model: Any) -> Any:
    """The model to plan against: PEFT's base model (as Trainer does for Liger), torch.compile's original."""
    model = getattr(model, "_orig_mod", model)
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _trl_fused_head(model: Any) -> bool:
    """True when TRL's ``add_fused_lm_head`` replaced this model's forward (SFTTrainer does, from TRL 1.x):
    TRL then computes the loss itself from the backbone and lm_head's weight, bypassing the causal LM's
    forward, so a patchdsl loss op on lm_head would never run (and would hide TRL's outputs)."""
    d = getattr(model, "__dict__", {})
    todo = [d.get("forward"), d.get("_original_forward")]     # accelerate's fp32-output wrapper keeps the original
    seen = 0
    while todo and seen < 16:
        fwd = todo.pop()
        if fwd is None:
            continue
        seen += 1
        fn = getattr(fwd, "__func__", fwd)
        code = getattr(fn, "__code__", None)
        if code is not None and "fused_lm_head" in code.co_varnames:
            return True
        todo.append(getattr(fn, "__wrapped__", None))           # functools.wraps chains (accelerate, TRL)
    return False


def _model_dtype_names(model: Any, training_args: Any) -> tuple[str, ...]:
    from ..util.vocab import DTYPES, dtype_name

    out = []
    p = next(model.parameters(), None)
    if p is not None:
        out.append(dtype_name(p.dtype))
    if training_args is not None and getattr(training_args, "bf16", False):
        out.append("bf16")
    if training_args is not None and getattr(training_args, "fp16", False):
        out.append("fp16")
    return tuple(dict.fromkeys(d for d in out if d in DTYPES)) or ("fp32",)


def _verify_dtype(model: Any, training_args: Any) -> str:
    if training_args is not None and getattr(training_args, "bf16", False):
        return "bf16"
    if training_args is not None and getattr(training_args, "fp16", False):
        return "fp16"
    return _model_dtype_names(model, None)[0]


def _leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1] if path else "<root>"


def live_totals(plan: Any, patched: list[str]) -> list[tuple[str, int, int]]:
    """The plan's totals counting only sites the handle really patched (a refused site is not patched)."""
    done = set(patched)
    count: dict[str, int] = {}
    for s in plan.sites:
        if s.path in done:
            count[_leaf(s.path)] = count.get(_leaf(s.path), 0) + 1
            for c in s.covers:
                count[_leaf(c)] = count.get(_leaf(c), 0) + 1
    return [(name, count.get(name, 0), present) for name, _, present in plan.totals]


def _logger() -> Any:
    try:
        from transformers.utils import logging as hf_logging

        return hf_logging.get_logger("transformers.trainer")
    except Exception:  # pragma: no cover - transformers is a dependency
        import logging

        return logging.getLogger("patchdsl")


def prepare(model: Any, opts: KpatchOptions, training_args: Any = None, *, liger: tuple[bool, Any] | None = None,
            logger: Any = None) -> Any:
    """Plan, (verify,) apply: the PatchHandle of ``opts`` on ``model``; the callback and
    ``patch_for_training`` both call this.  The handle carries ``.plan``, ``.patched``, ``.refused``
    and, added here, ``.totals`` (live) and ``.notes`` (sites left out and why)."""
    from ..planning.planner import plan as make_plan
    from ..runtime import PatchHandle, apply

    log = logger or _logger()
    base = _base_model(model)
    notes: list[str] = []
    spec = opts.spec
    if opts.from_liger:
        spec = _spec_from_liger(base, opts, training_args, liger, log, notes)
    if spec is None:
        return PatchHandle(None, active=False)
    dtypes = opts.dtypes or spec.dtypes or _model_dtype_names(base, training_args)
    p = make_plan(spec, base, dtypes=tuple(dtypes))
    trl = _trl_fused_head(base)
    if trl:
        dropped = [s for s in p.sites if s.op in LOSS_OPS]
        if dropped:
            p = dataclasses.replace(p, sites=tuple(s for s in p.sites if s.op not in LOSS_OPS))
            for s in dropped:
                notes.append(f"{s.rule}: {s.op} on {s.path} left out: TRL's fused LM head (SFTTrainer) computes "
                             f"the loss from lm_head's weight itself, without the causal LM's forward")
    if opts.verify:
        _verify(base, p, training_args, trl, log)
    handle = apply(p, base, strict=False)
    if handle.refused and opts.strict:
        handle.undo()
        raise KpatchRefused(handle.refused, p.spec)
    handle.totals = live_totals(p, handle.patched)
    handle.notes = notes
    return handle


def _spec_from_liger(base: Any, opts: KpatchOptions, training_args: Any, liger: tuple[bool, Any] | None,
                     log: Any, notes: list[str]) -> Spec:
    from ..model.index import build_index
    from ..interop.liger import LigerConfigError, text_model_type_of, translate_liger

    use, cfg = liger if liger is not None else liger_switches(training_args)
    if not use and cfg is None:
        raise LigerConfigError("kpatch_from_liger is set but the training arguments have neither use_liger_kernel "
                               "nor liger_kernel_config",
                               hint="set use_liger_kernel: true (Liger's defaults for the model) or give "
                                    "liger_kernel_config, or use kpatch_spec")
    index = build_index(base)
    text_type = text_model_type_of(base)
    t = translate_liger(cfg, index, use_liger_kernel=use, text_model_type=text_type)
    if t.problems:
        if opts.strict:
            import json

            from ..interop.liger import fitting_config

            fixed = fitting_config(t, index, text_type)
            raise LigerConfigError("the Liger config asks for kernels that do not fit this model:\n  "
                                   + "\n  ".join(t.problems),
                                   hint=(f"liger_kernel_config: {json.dumps(fixed)} translates what fits this model; "
                                         if fixed is not None else "turn those keys off in liger_kernel_config; ")
                                   + "or set kpatch_strict: false to train without them")
        for pr in t.problems:
            log.warning(f"patchdsl: Liger key not applied: {pr}")
        notes.extend(f"Liger key not applied: {pr}" for pr in t.problems)
    if not t.rules:
        raise LigerConfigError("nothing of the Liger config fits this model")
    log.info("patchdsl: liger_kernel_config translated to\n" + t.text.rstrip())
    return parse_spec(t.text, LIGER_SPEC_NAME)


def _verify(base: Any, plan: Any, training_args: Any, trl: bool, log: Any) -> None:
    from ..parity import verify as run_verify

    dev = next(base.parameters()).device
    dtype = _verify_dtype(base, training_args)
    stash = base.__dict__.pop("forward") if trl else None     # TRL's forward closes over the original model
    try:
        report = run_verify(plan, base, dtype=dtype, device=dev, batch=2, seq=16)
    finally:
        if stash is not None:
            base.forward = stash
    # the verdict is what kpatch_verify asked for: shown at transformers' default log level (warning), not
    # only with --log_level info -- a failure as an error with the report's table before the exit
    if not report.passed:
        from rich.console import Console

        report.render_table(Console(stderr=True, highlight=False, width=160))
        log.error(f"patchdsl verify (kpatch_verify): {report.verdict}; training stops before the first step")
        raise KpatchVerifyFailed(report)
    log.warning(f"patchdsl verify (kpatch_verify): {report.verdict}")


def summary_line(handle: Any) -> str:
    spec = handle.plan.spec if handle.plan is not None else "(no spec)"
    parts = [f"{p}/{n} {name} patched" for name, p, n in getattr(handle, "totals", [])]
    s = f"patchdsl: {spec}: " + (", ".join(parts) or "nothing patched")
    if handle.refused:
        s += f"; {len(handle.refused)} site(s) refused"
    return s


def log_handle(handle: Any, level: str, log: Any) -> None:
    """What ``kpatch_log`` asks for, at transformers' default log level (warning): the one totals line
    (``totals``, the default), every patched site too (``sites``), nothing (``none``).  A user who set
    kpatch_log asked to see it; ``--log_level error`` or kpatch_log none silences it."""
    if level == "none":
        return
    log.warning(summary_line(handle))
    for r in handle.refused:
        log.warning(f"patchdsl: {r}")
    for n in getattr(handle, "notes", []):
        log.warning(f"patchdsl: {n}")
    if level == "sites" and handle.plan is not None:
        done = set(handle.patched)
        for s in handle.plan.sites:
            if s.path in done:
                log.warning(f"patchdsl:   {s.path or '<model>'}: {s.op} ({s.rule})")


def patch_for_training(model: Any, args: Any, training_args: Any = None, *, logger: Any = None) -> Any:
    """Apply ``args``'s spec to ``model`` for a training loop without a Trainer; returns the PatchHandle
    (``handle.undo()`` or ``with patch_for_training(...):`` restores the model).

    ``args``: PatchdslArguments or patchdsl.TrainingArguments.  ``training_args``: where
    ``kpatch_from_liger`` reads ``use_liger_kernel`` / ``liger_kernel_config`` and the bf16/fp16
    switches (default: ``args`` itself).  With no spec (and no Liger translation) nothing is patched
    and an inactive, empty handle is returned.

    With ``kpatch_cuda_graphs`` the model must be on a CUDA device (``GraphStepError`` otherwise,
    before anything is patched), and the handle has ``graph_step(optimizer, example_batch, **options)``:
    :func:`patchdsl.graph_step` for this model (docs/cuda-graphs.md).
    """
    opts = KpatchOptions.from_args(args)
    if opts.cuda_graphs:
        from .graphs import _cuda_device

        _cuda_device(_base_model(model))       # refuse before patching: no CUDA, or the model is not on it
    handle = prepare(model, opts, training_args if training_args is not None else args, logger=logger)
    if handle.plan is not None:
        log_handle(handle, opts.log, logger or _logger())
    if opts.cuda_graphs:
        import functools

        from .graphs import graph_step

        handle.graph_step = functools.partial(graph_step, model)
    return handle


# ------------------------------------------------------------------ the callback
try:  # transformers is a dependency, but keep the syntax-only import path light
    from transformers import TrainerCallback as _Base
except Exception:  # pragma: no cover
    _Base = object


class PatchdslCallback(_Base):
    """Apply a patch plan for the duration of ``Trainer.train()``."""

    def __init__(self, config: Any = None, *, options: KpatchOptions | None = None):
        if options is None:
            if config is None:
                raise TypeError("PatchdslCallback needs a spec config, or use PatchdslCallback.from_args(args)")
            spec, strict = spec_from_config(config)
            options = KpatchOptions(spec, strict)
        elif config is not None:
            raise TypeError("give PatchdslCallback a config or options, not both")
        if options.cuda_graphs:
            raise TrainerGraphsRefused()
        self.options = options
        self.spec = options.spec
        self.strict = options.strict
        self.handle = None
        self.liger: tuple[bool, Any] | None = None
        self.history: list[dict[str, Any]] = []      # one entry per train() that patched

    @classmethod
    def from_args(cls, args: Any) -> "PatchdslCallback":
        """The callback for ``args`` (PatchdslArguments or patchdsl.TrainingArguments).  With neither
        kpatch_spec nor kpatch_from_liger set it does nothing, so it can always be passed."""
        return cls(options=KpatchOptions.from_args(args))

    # -- events -------------------------------------------------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        if self.options.from_liger and self.liger is None:
            self.liger = liger_switches(args)
            if getattr(args, "use_liger_kernel", False):
                args.use_liger_kernel = False
                _logger().info("patchdsl: kpatch_from_liger: use_liger_kernel switched off; patchdsl applies "
                               "the translated spec when training starts")
        return control

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not self.options.enabled:
            return control
        if model is None:
            raise RuntimeError("PatchdslCallback needs the model (Trainer passes it to callbacks)")
        if self.handle is not None:          # a previous train() that did not reach on_train_end
            self.handle.undo()
            self.handle = None
        liger = self.liger
        if self.options.from_liger and liger is None:
            if getattr(args, "use_liger_kernel", False):
                raise RuntimeError("kpatch_from_liger: the Trainer has already applied Liger (use_liger_kernel) "
                                   "because the callback was added after Trainer.__init__; pass it in "
                                   "Trainer(callbacks=[...]) or set use_liger_kernel to false")
            liger = liger_switches(args)
        log = _logger()
        handle = prepare(model, self.options, args, liger=liger, logger=log)
        self.handle = handle
        if handle.plan is None:
            return control
        log_handle(handle, self.options.log, log)
        entry = {"patchdsl": summary_line(handle).removeprefix("patchdsl: "),
                 "patchdsl_sites_patched": len(handle.patched), "patchdsl_sites_refused": len(handle.refused),
                 "step": state.global_step}
        state.log_history.append(entry)
        self.history.append(entry)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.undo()
            self.handle = None
        return control
