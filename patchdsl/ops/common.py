"""Small pure helpers every op module uses: block sizes, ``auto`` flags, binding a forward's arguments."""

from __future__ import annotations

from typing import Any, Callable, Mapping


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def row_block(n: int, target: str, max_block: int = 16384, interp_max: int = 1024) -> tuple[int, bool]:
    """(BLOCK, single_pass) for a row of ``n`` elements."""
    cap = interp_max if target == "interpreter" else max_block
    b = next_pow2(n)
    if b <= cap:
        return b, True
    return cap, False


def row_warps(block: int) -> int:
    return 1 if block <= 256 else 2 if block <= 1024 else 4 if block <= 4096 else 8 if block <= 8192 else 16


def resolve_auto(flags: Mapping[str, Any], name: str, detected: Any) -> Any:
    v = flags.get(name, "auto")
    return detected if v == "auto" else v


def signature_binder(sig: Any) -> Callable[..., dict]:
    """``bind(*args, **kwargs) -> {name: value}``: what ``sig.bind(...)`` + ``apply_defaults()``
    give (``*args`` as a tuple, ``**kwargs`` as a dict under their parameter names), raising
    TypeError for a call the signature does not accept.

    Replacement forwards bind their arguments with this on every call: it is plain dict and loop
    work that Dynamo traces (``inspect.Signature.bind`` is not traceable on every supported torch)
    and a few times cheaper in eager mode.
    """
    import inspect

    P = inspect.Parameter
    params = list(sig.parameters.values())
    positional = [p.name for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    by_keyword = {p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    var_pos = next((p.name for p in params if p.kind is P.VAR_POSITIONAL), None)
    var_kw = next((p.name for p in params if p.kind is P.VAR_KEYWORD), None)
    defaults = [(p.name, p.default) for p in params
                if p.default is not P.empty and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]
    required = [p.name for p in params if p.default is P.empty and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]
    n_pos = len(positional)

    def bind(*args: Any, **kwargs: Any) -> dict:
        if len(args) > n_pos and var_pos is None:
            raise TypeError(f"takes {n_pos} positional arguments but {len(args)} were given")
        out = dict(zip(positional, args))
        if var_pos is not None:
            out[var_pos] = tuple(args[n_pos:])
        extra = {}
        for k, v in kwargs.items():
            if k in by_keyword:
                if k in out:
                    raise TypeError(f"got multiple values for argument {k!r}")
                out[k] = v
            elif var_kw is not None:
                extra[k] = v
            else:
                raise TypeError(f"got an unexpected keyword argument {k!r}")
        for n in required:
            if n not in out:
                raise TypeError(f"missing a required argument: {n!r}")
        for n, d in defaults:
            if n not in out:
                out[n] = d
        if var_kw is not None:
            out[var_kw] = extra
        return out

    return bind
