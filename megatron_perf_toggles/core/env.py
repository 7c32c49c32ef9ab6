"""Read the plugin's environment variables against the registry: values, or one clear error."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import EnvValueError
from .registry import BOOL_ACCEPTED, BOOL_FALSE, BOOL_TRUE, SETTINGS, TOGGLES, Toggle


def parse_bool(var: str, raw: str | None) -> bool | None:
    """``None`` for unset or empty; otherwise the boolean, or EnvValueError naming ``var``."""
    if raw is None or raw.strip() == "":
        return None
    word = raw.strip().lower()
    if word in BOOL_TRUE:
        return True
    if word in BOOL_FALSE:
        return False
    raise EnvValueError(var, raw, BOOL_ACCEPTED)


def parse_choice(var: str, raw: str | None, choices: tuple[str, ...]) -> str | None:
    if raw is None or raw.strip() == "":
        return None
    word = raw.strip().lower()
    if word in choices:
        return word
    raise EnvValueError(var, raw, " or ".join(choices) + " (or unset for the default)")


def parse_count(var: str, raw: str | None) -> int | None:
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise EnvValueError(var, raw, "a whole number of layers, 0 or more (or unset)")
    return value


def parse_toggle(toggle: Toggle, raw: str | None) -> bool | str | None:
    if toggle.kind == "bool":
        return parse_bool(toggle.env, raw)
    return parse_choice(toggle.env, raw, toggle.choices)


@dataclass(frozen=True)
class EnvSettings:
    """Everything the plugin takes from the environment, validated. ``None`` means unset."""

    toggles: dict[str, bool | str] = field(default_factory=dict)  # dest -> value, set ones only
    plugin_enabled: bool = True
    tag_log_dir: bool = True
    assume: str | None = None
    fp4_selective_bf16: bool | None = None
    fp4_bf16_start: int | None = None
    fp4_bf16_end: int | None = None
    rank: int = 0
    wgrad_fallback: bool = True
    rank_check: bool = True

    def raw_for_record(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The plugin's variables as they were set, for the provenance record."""

        names = [t.env for t in TOGGLES] + [s.env for s in SETTINGS]
        return {n: environ[n] for n in names if n in environ}


def read_env(environ: Mapping[str, str]) -> EnvSettings:
    """Validate every variable first, so one bad value is reported before anything happens."""
    toggles: dict[str, bool | str] = {}
    for t in TOGGLES:
        value = parse_toggle(t, environ.get(t.env))
        if value is not None:
            toggles[t.dest] = value
    enabled = parse_bool("MEGATRON_PERF_TOGGLES", environ.get("MEGATRON_PERF_TOGGLES"))
    tag = parse_bool("MEGATRON_PERF_TOGGLES_TAG_LOG_DIR", environ.get("MEGATRON_PERF_TOGGLES_TAG_LOG_DIR"))
    assume = environ.get("MEGATRON_PERF_TOGGLES_ASSUME")
    try:
        rank = int(environ.get("RANK", "0") or 0)
    except ValueError:
        rank = 0
    return EnvSettings(
        toggles=toggles,
        plugin_enabled=enabled is not False,
        tag_log_dir=tag is not False,
        assume=assume if assume and assume.strip() else None,
        fp4_selective_bf16=parse_bool("FP4_SELECTIVE_BF16", environ.get("FP4_SELECTIVE_BF16")),
        fp4_bf16_start=parse_count("FP4_BF16_START", environ.get("FP4_BF16_START")),
        fp4_bf16_end=parse_count("FP4_BF16_END", environ.get("FP4_BF16_END")),
        rank=rank,
        rank_check=parse_bool(
            "MEGATRON_PERF_TOGGLES_RANK_CHECK", environ.get("MEGATRON_PERF_TOGGLES_RANK_CHECK")) is not False,
        wgrad_fallback=parse_bool(
            "MEGATRON_PERF_TOGGLES_WGRAD_FALLBACK", environ.get("MEGATRON_PERF_TOGGLES_WGRAD_FALLBACK")) is not False,
    )
