"""The declaration-time checks of the registry (``registry._validate``): a malformed toggle, setting
or capability stops the package from loading with one line. Kept apart so the registry itself stays
the list of declarations. Pure: it reads the records it is given."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import RegistryError


def validate(toggles: Iterable[Any], settings: Iterable[Any], groups: Mapping[str, Any],
             capabilities: Mapping[str, Any], records: Iterable[Any]) -> None:
    """Every toggle, setting and capability is well formed and declared once."""
    seen_dest: set[str] = set()
    seen_env: set[str] = set()
    seen_flags: set[str] = set()
    for t in toggles:
        where = f"toggle {t.dest!r}"
        if t.dest in seen_dest or t.env in seen_env:
            raise RegistryError(f"{where}: duplicate dest or env var")
        seen_dest.add(t.dest)
        seen_env.add(t.env)
        if t.group not in groups:
            raise RegistryError(f"{where}: unknown group {t.group!r}")
        for need in t.needs:
            if need not in capabilities:
                raise RegistryError(f"{where}: unknown capability {need!r}")
        if t.kind == "bool":
            if not (isinstance(t.default, bool) and isinstance(t.stock_default, bool)):
                raise RegistryError(f"{where}: a bool toggle needs bool defaults")
            if not (t.flag and t.off_flag) or t.choices:
                raise RegistryError(f"{where}: a bool toggle needs flag and off_flag, no choices")
        else:
            if t.default not in t.choices or t.stock_default not in t.choices or t.off_flag:
                raise RegistryError(f"{where}: choice defaults must be among its choices")
        for f in t.flags:
            if not f.startswith("--") or f in seen_flags:
                raise RegistryError(f"{where}: flag {f!r} is malformed or declared twice")
            seen_flags.add(f)
        if t.scope not in ("all", "moe"):
            raise RegistryError(f"{where}: scope must be all or moe")
        if not t.help or "\n" in t.help:
            raise RegistryError(f"{where}: help must be one line")
        _validate_units(where, t.acts_in)
    _validate_capabilities(list(records))
    fields: set[str] = set()
    for s in settings:
        if s.env in seen_env or s.field in fields:
            raise RegistryError(f"setting {s.env!r}: env var or field declared twice")
        seen_env.add(s.env)
        fields.add(s.field)


def _validate_units(where: str, acts_in: Any) -> None:
    """``acts_in`` is a tuple of unit names, each once: a bare string would read as its letters."""
    if not isinstance(acts_in, tuple) or not all(isinstance(u, str) and u for u in acts_in) \
            or len(set(acts_in)) != len(acts_in):
        raise RegistryError(f"{where}: acts_in must be a tuple of distinct unit names (tools/layers/units.py)")


_DETECTED = ("import:", "installed:", "probe:", "megatron:")
_ASSUMED = ("apex", "gpu", "megatron", "grouped_gemm")


def _validate_capabilities(records: list[Any]) -> None:
    names = [c.name for c in records]
    if len(set(names)) != len(names):
        raise RegistryError("a capability is declared twice")
    for c in records:
        where = f"capability {c.name!r}"
        if not c.detected.startswith(_DETECTED) or (c.detected.startswith("import:") and c.detected.count(":") != 2):
            raise RegistryError(f"{where}: detected must be one of {', '.join(d + '...' for d in _DETECTED)}")
        if c.assumed not in _ASSUMED and not (c.assumed.startswith("te>=") and c.assumed[4:].replace(".", "").isdigit()):
            raise RegistryError(f"{where}: assumed must be apex, gpu, grouped_gemm, megatron or te>=X.Y")
        if (c.assumed == "megatron") != (not c.stored):
            raise RegistryError(f"{where}: a Megatron fact is detected and assumed as one (megatron:FIELD, megatron)")
        if not c.note or "\n" in c.note:
            raise RegistryError(f"{where}: the note must be one line")
