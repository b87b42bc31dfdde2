"""Codegen: KernelKey -> rendered Triton source (pure) -> cached file -> imported module."""

from .env import ensure_triton, target
from .keys import KernelKey
from .render import render
from .cache import cache_dir, load_kernel, write_kernel

__all__ = ["KernelKey", "cache_dir", "ensure_triton", "load_kernel", "render", "target", "write_kernel"]
