"""Memory a build will take against what the machine has: one check, made before anything large is
allocated, so that a model too large for the machine is refused at once with the numbers (it took
minutes and 18 GB of a 16 GB machine before), and a large build says what it builds first."""

from __future__ import annotations

from typing import Any

GIB = 2 ** 30


class MemoryTooSmall(ValueError):
    """The estimated memory of a build exceeds what the device has free."""


def free_memory(device: Any) -> int | None:
    """Free bytes on ``device`` (CUDA: the driver's count; CPU: MemAvailable), None if unknown."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(dev)[0])
        except Exception:
            return None
    if dev.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def count_params(model: Any) -> int:
    """Parameters of ``model`` (tied ones once); works on the meta device."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def human_params(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def check_fits(need_bytes: int, device: Any, doing: str, hint: str = "") -> str:
    """One line saying what ``doing`` is estimated to take on ``device`` and what the device has free;
    :class:`MemoryTooSmall` with that line (and ``hint``) when the estimate exceeds the free memory."""
    free = free_memory(device)
    dev = "this machine" if str(device).startswith("cpu") else str(device)
    line = (f"{doing}: estimated ~{need_bytes / GIB:,.1f} GiB, "
            + (f"{free / GIB:,.1f} GiB available on {dev}" if free is not None else f"free memory of {dev} unknown"))
    if free is not None and need_bytes > free:
        raise MemoryTooSmall(f"{line}: not started, it would not fit" + (f"; {hint}" if hint else ""))
    return line
