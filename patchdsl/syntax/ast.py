"""The syntax tree of a .kpatch spec: frozen dataclasses, every node carries its Span."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Span:
    """A location in a spec file (1-based line and column), plus the source line for carets."""

    file: str
    line: int
    col: int
    end_col: int | None = None
    source_line: str = field(default="", compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"

    @property
    def short(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Selector:
    """One module-path glob; ``negated`` for ``!sel`` exclusions."""

    text: str
    negated: bool
    span: Span


@dataclass(frozen=True)
class ClassPattern:
    """``RMSNorm`` (a structural kind), ``Qwen3RMSNorm``, ``*RMSNorm``, ``LlamaMLP|Qwen2MLP``."""

    alternatives: tuple[str, ...]
    span: Span

    @property
    def text(self) -> str:
        return "|".join(self.alternatives)


@dataclass(frozen=True)
class Flag:
    name: str
    value: Any
    span: Span


@dataclass(frozen=True)
class Arg:
    """A positional value of an op call: ``hub("org/repo", "Layer", version=1)``."""

    value: Any
    span: Span


@dataclass(frozen=True)
class OpCall:
    name: str                       # ``fused_rmsnorm``, ``liger.rms_norm``, ``hub``
    flags: tuple[Flag, ...]
    span: Span
    args: tuple[Arg, ...] = ()      # positional values (external sources)


@dataclass(frozen=True)
class Rule:
    selectors: tuple[Selector, ...]
    class_pattern: ClassPattern
    op: OpCall
    optional: bool
    span: Span
    index: int = 0  # position in the flattened rule list (file order, includes expanded)

    @property
    def text(self) -> str:
        sels = ", ".join(("!" if s.negated else "") + s.text for s in self.selectors)
        return f"{'optional ' if self.optional else ''}{sels}: {self.class_pattern.text} -> {self.op.name}"


@dataclass(frozen=True)
class DefaultDirective:
    """``default OP(flag=value, ...)``: flag defaults for every rule using OP after this line."""

    op: str
    flags: tuple[Flag, ...]
    span: Span


@dataclass(frozen=True)
class AttentionDirective:
    """``attention sdpa``: the model's attention implementation (per model instance)."""

    impl: str
    flags: tuple[Flag, ...]
    span: Span


@dataclass(frozen=True)
class Spec:
    """A parsed spec with includes expanded in place (file order is preserved)."""

    path: str
    dtypes: tuple[str, ...]
    rules: tuple[Rule, ...]
    defaults: tuple[DefaultDirective, ...]
    dtype_span: Span | None = None
    includes: tuple[str, ...] = ()
    attention: AttentionDirective | None = None
