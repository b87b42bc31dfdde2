"""The specialisation key of one generated kernel module."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class KernelKey:
    """Op + template + parameters.  ``params`` is a sorted tuple of (name, value) pairs."""

    op: str
    template: str
    name: str
    params: tuple[tuple[str, Any], ...]

    @classmethod
    def make(cls, op: str, template: str, name: str, params: Mapping[str, Any]) -> "KernelKey":
        return cls(op, template, name, tuple(sorted(params.items())))

    @classmethod
    def for_op(cls, op: Any, params: Mapping[str, Any]) -> "KernelKey":
        """The key of ``op``'s kernel for ``params`` (what its ``key_params`` returned): the op's name,
        its template and the name it gives a kernel of those parameters."""
        return cls.make(op.name, op.template, op.kernel_name(params), params)

    @property
    def param_dict(self) -> dict[str, Any]:
        return dict(self.params)

    def params_json(self) -> str:
        return json.dumps(self.param_dict, sort_keys=True, separators=(",", ":"))

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "template": self.template, "name": self.name, "params": self.param_dict}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "KernelKey":
        return cls.make(d["op"], d["template"], d["name"], d["params"])


def content_hash(template_text: str, key: KernelKey, package_version: str, triton_version: str) -> str:
    h = hashlib.sha256()
    for part in (template_text, key.params_json(), package_version, triton_version):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()
