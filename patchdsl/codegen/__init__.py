"""Codegen: KernelKey -> rendered Triton source (pure) -> cached file -> imported module."""

from .env import ensure_triton, target
from .keys import KernelKey
from .render import render
from .cache import CacheError, cache_dir, load_kernel, write_kernel
from .render import CodegenError

__all__ = ["CacheError", "CodegenError", "KernelKey", "cache_dir", "ensure_triton", "load_kernel", "render", "target", "write_kernel"]
