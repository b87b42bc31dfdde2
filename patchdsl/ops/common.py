"""Small pure helpers every op module uses: dtype names, block sizes, ``auto`` flags."""

from __future__ import annotations

from typing import Any, Mapping

DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def dtype_name(dt: Any) -> str:
    return DTYPE_NAMES.get(str(dt), str(dt).replace("torch.", ""))


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
