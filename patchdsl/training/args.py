"""patchdsl's settings as training-script arguments: ``PatchdslArguments`` and ``TrainingArguments``.

    parser = HfArgumentParser((TrainingArguments, PatchdslArguments, ScriptArguments))
    training_args, kpatch_args, script_args = parser.parse_args_into_dataclasses()
    # or parser.parse_yaml_file("train.yaml") / parser.parse_json_file("train.json")
    trainer = Trainer(..., args=training_args, callbacks=[PatchdslCallback.from_args(kpatch_args)])

``patchdsl.TrainingArguments`` is transformers' ``TrainingArguments`` with the same ``kpatch_*``
fields, for scripts that parse one dataclass.  This module imports transformers only when
``TrainingArguments`` is first asked for (``patchdsl/__init__.py`` resolves both names lazily).

No ``from __future__ import annotations`` here: ``HfArgumentParser`` reads the field types.
"""

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from ..syntax.errors import SpecError
from ..syntax.includes import shipped_names
from ..util.vocab import DTYPES, canonical_dtype, dtype_hint

LOG_LEVELS = ("totals", "sites", "none")


@dataclass
class PatchdslArguments:
    """patchdsl's fields for ``HfArgumentParser`` (command line, YAML, JSON)."""

    kpatch_spec: Optional[str] = field(default=None, metadata={
        "help": f"The patchdsl spec: a .kpatch path, a shipped name ({', '.join(shipped_names())}) "
                "or spec text. Unset: patchdsl is off (unless kpatch_from_liger)."})
    kpatch_strict: bool = field(default=True, metadata={
        "help": "Stop before the first training step when a site of the spec is refused by the model "
                "(false: train with those sites unpatched and log why)."})
    kpatch_verify: bool = field(default=False, metadata={
        "help": "Before training, check gradient parity of every patched site on the model in hand against "
                "float64 (patchdsl verify); stop with exit status 1 and the report when it fails."})
    kpatch_from_liger: bool = field(default=False, metadata={
        "help": "Translate use_liger_kernel / liger_kernel_config of the training arguments into a spec instead "
                "of kpatch_spec (Liger itself is then not applied)."})
    kpatch_dtype: Optional[list[str]] = field(default=None, metadata={
        "help": "Dtypes to generate kernels for before the first step (fp32, bf16, fp16); default: the spec's "
                "dtype directive, else the model's dtype and the bf16/fp16 mixed-precision dtype."})
    kpatch_log: Literal["totals", "sites", "none"] = field(default="totals", metadata={
        "help": "What to log when the plan is applied: totals (one line, e.g. '28/28 mlp patched'), sites "
                "(also every patched and refused site) or none (only trainer.state.log_history)."})
    kpatch_cuda_graphs: bool = field(default=False, metadata={
        "help": "Capture each training step as one CUDA graph (docs/cuda-graphs.md). With patch_for_training "
                "(your own loop) it checks for a CUDA model and gives handle.graph_step; with the Trainer "
                "(PatchdslCallback) it is refused at setup, with the reasons: the Trainer's loop cannot be "
                "captured safely."})

    def __post_init__(self) -> None:
        validate_kpatch_fields(self)


KPATCH_FIELDS = tuple(f.name for f in dataclasses.fields(PatchdslArguments))


class KpatchSpecError(SpecError, SystemExit):
    """A bad ``kpatch_spec`` in a training script's arguments: the located error is printed to stderr
    when raised and the script ends with status 2, as argparse ends on a bad argument -- no traceback.
    Still a :class:`~patchdsl.SpecError` (``except SpecError`` catches it, ``render()`` shows it)."""

    def __init__(self, error: SpecError):
        SpecError.__init__(self, error.message, error.span, hint=error.hint, notes=error.notes)
        if len(error.errors) > 1 or error.more:
            self.errors, self.more = error.errors, error.more
        self.args = (self.render(),)
        self.code = 2
        print(self.render(), file=sys.stderr)


def validate_kpatch_fields(args: Any) -> None:
    """Check and normalise the ``kpatch_*`` fields of ``args`` (either dataclass); a bad value is a
    ValueError (or the spec's own SpecError) when the arguments are parsed, not after the model loads."""
    dts = args.kpatch_dtype
    if isinstance(dts, str):
        dts = [d for d in dts.replace(",", " ").split() if d]
    if dts is not None:
        # a list (or tuple) of names, nothing else: a mapping would be read as its keys, a number
        # is no dtype, a generator would be used up
        if not isinstance(dts, (list, tuple)):
            raise ValueError(f"kpatch_dtype must be a dtype name or a list of them (fp32, bf16, fp16), "
                             f"got {type(dts).__name__} {dts!r:.80}")
        if len(dts) > 16:
            raise ValueError(f"kpatch_dtype: {len(dts)} entries; give at most the three dtypes fp32, bf16, fp16")
        out = []
        for d in dts:
            if not isinstance(d, str):
                raise ValueError(f"kpatch_dtype: each entry is a dtype name (fp32, bf16, fp16), got {d!r:.80}")
            name = canonical_dtype(d.strip().lower())
            if name not in DTYPES:
                raise ValueError(f"kpatch_dtype: unknown dtype {d!r}; {dtype_hint(d)}")
            if name not in out:
                out.append(name)
        args.kpatch_dtype = out or None
    if not isinstance(args.kpatch_log, str) or args.kpatch_log not in LOG_LEVELS:
        raise ValueError(f"kpatch_log must be one of {', '.join(LOG_LEVELS)}, got {args.kpatch_log!r}")
    for name in ("kpatch_strict", "kpatch_verify", "kpatch_from_liger", "kpatch_cuda_graphs"):
        if not isinstance(getattr(args, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(args, name)!r}")
    if args.kpatch_spec is not None and not isinstance(args.kpatch_spec, str):
        raise ValueError(f"kpatch_spec must be a path, a shipped spec name or spec text, got {args.kpatch_spec!r}")
    if args.kpatch_spec is not None and not args.kpatch_spec.strip():
        args.kpatch_spec = None
    if args.kpatch_spec and args.kpatch_from_liger:
        raise ValueError("kpatch_spec and kpatch_from_liger are both set: give a spec, or translate the Liger "
                         "config, not both")
    if args.kpatch_spec:
        from ..planning.check import check_spec
        from ..syntax import load_spec

        # a missing file, a syntax error, an unknown op or flag fails here, located (no model needed), and
        # as a command-line error: the located message, no traceback (KpatchSpecError)
        try:
            check_spec(load_spec(args.kpatch_spec))
        except SpecError as e:
            raise KpatchSpecError(e) from None


def kpatch_enabled(args: Any) -> bool:
    return bool(getattr(args, "kpatch_spec", None) or getattr(args, "kpatch_from_liger", False))


_TA: Any = None


def training_arguments_class() -> type:
    """``patchdsl.TrainingArguments``: transformers' TrainingArguments plus the ``kpatch_*`` fields."""
    global _TA
    if _TA is not None:
        return _TA
    from transformers import TrainingArguments as _HF

    def __post_init__(self) -> None:
        _HF.__post_init__(self)
        validate_kpatch_fields(self)

    fields = [(f.name, f.type, field(default=f.default, metadata=dict(f.metadata)))
              for f in dataclasses.fields(PatchdslArguments)]
    cls = dataclasses.make_dataclass(
        "TrainingArguments", fields, bases=(_HF,),
        namespace={"__post_init__": __post_init__, "__module__": "patchdsl",
                   "__doc__": "transformers.TrainingArguments with patchdsl's kpatch_* fields "
                              "(see patchdsl.PatchdslArguments)."})
    _TA = cls
    return cls
