"""Read the plugin's environment variables against the registry: values, or one clear error.

One generic parse covers every registered variable: each toggle by its kind (bool or choice) and
each ``Setting`` by its kind into the ``EnvSettings`` field it names. A variable added to the
registry is read, validated and documented with no code here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ..errors import EnvValueError, RegistryError
from .memory.allocator import AllocConf, alloc_conf
from .registry import BOOL_ACCEPTED, BOOL_FALSE, BOOL_TRUE, SETTING_BY_ENV, SETTINGS, TOGGLES, Setting, Toggle


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


def parse_text(var: str, raw: str | None) -> str | None:
    """Free text (a list or a path) that the reader checks itself; blank is unset."""
    return raw if raw is not None and raw.strip() else None


PARSE_BY_KIND: dict[str, Callable[[str, str | None], bool | int | str | None]] = {
    "bool": parse_bool, "int": parse_count, "text": parse_text,
}
# The type each kind parses to, as an EnvSettings field spells it (less "| None").
TYPE_OF_KIND = {"bool": "bool", "int": "int", "text": "str"}


def parse_toggle(toggle: Toggle, raw: str | None) -> bool | str | None:
    if toggle.kind == "bool":
        return parse_bool(toggle.env, raw)
    return parse_choice(toggle.env, raw, toggle.choices)


def _registered(var: str, kind: str) -> None:
    if SETTING_BY_ENV[var].kind != kind:
        raise RegistryError(f"setting {var!r} is of kind {SETTING_BY_ENV[var].kind!r}, read as {kind!r}")


# One registered setting, parsed (``None`` when unset): for readers that need a single switch
# before the rest (the launcher's dry-run switch, the patch tool's directory, the planned machine).
def read_bool_setting(var: str, environ: Mapping[str, str]) -> bool | None:
    _registered(var, "bool")
    return parse_bool(var, environ.get(var))


def read_text_setting(var: str, environ: Mapping[str, str]) -> str | None:
    _registered(var, "text")
    return parse_text(var, environ.get(var))


@dataclass(frozen=True, slots=True)
class EnvSettings:
    """Everything the plugin takes from the environment, validated. ``None`` means unset.

    One field per ``registry.SETTINGS`` entry (its ``field``), with the value an unset variable
    means; ``rank`` is torchrun's, not ours, and only decides who prints."""

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
    dry_run: bool = False
    plan: str | None = None  # WORLD:GPU, parsed by runtime.machine.target.parse_plan
    dry_run_output: str | None = None  # summary | json | verbose (checked by the dry run)
    fail_if_no_fit: bool = False  # explain and the dry run exit 3 where the plan does not fit (errors.DoesNotFitError)
    patches_dir: str | None = None
    profile_path: str | None = None  # the file is read by the runtime, parsed by core.profile
    memory_headroom: str | None = None  # parsed by core.memory.memory_guard (a percentage or GB)
    # PyTorch's own allocator setting, read (never set) for the memory plan: not one of ours, so no
    # registry entry; core.memory.allocator says where torch reads it.
    alloc: AllocConf = field(default_factory=AllocConf)
    # Transformer Engine's switch for its CuTe DSL fused grouped MLP, read (never set) by the MoE
    # guards: Megatron's fused grouped MLP takes gated experts only where it is above 0.
    cutedsl_grouped_mlp: bool = False

    @property
    def expandable_segments(self) -> bool:
        """The allocator's need is the peak alone: expandable segments (or not the caching allocator)."""
        return self.alloc.expandable or self.alloc.async_backend

    def raw_for_record(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The plugin's variables as they were set, for the provenance record."""

        names = [t.env for t in TOGGLES] + [s.env for s in SETTINGS]
        return {n: environ[n] for n in names if n in environ}


def check_settings(settings: Iterable[Setting]) -> None:
    """A registry entry without a home in EnvSettings is a bug in this package: say so at import.
    The field's declared type must be what the kind parses to; read_env relies on it."""
    annotations = EnvSettings.__annotations__  # its fields, their types as strings (postponed evaluation)
    for setting in settings:
        declared = annotations.get(setting.field)
        if declared is None or setting.kind not in PARSE_BY_KIND:
            raise RegistryError(f"setting {setting.env!r}: no EnvSettings field {setting.field!r} "
                                f"or no parser for kind {setting.kind!r}")
        if declared.removesuffix(" | None") != TYPE_OF_KIND[setting.kind]:
            raise RegistryError(f"setting {setting.env!r}: kind {setting.kind!r} gives a "
                                f"{TYPE_OF_KIND[setting.kind]}, but EnvSettings.{setting.field} is {declared}")


check_settings(SETTINGS)


DRY_RUN_OUTPUTS = ("summary", "json", "verbose")


def rank_of(environ: Mapping[str, str]) -> int:
    """torchrun's RANK (0 when unset or unreadable): it decides only who prints."""
    try:
        return int(environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


def read_env(environ: Mapping[str, str]) -> EnvSettings:
    """Validate every variable first, so one bad value is reported before anything happens."""
    toggles: dict[str, bool | str] = {}
    for t in TOGGLES:
        value = parse_toggle(t, environ.get(t.env))
        if value is not None:
            toggles[t.dest] = value
    parsed = {s.field: PARSE_BY_KIND[s.kind](s.env, environ.get(s.env)) for s in SETTINGS}
    settings = {name: value for name, value in parsed.items() if value is not None}
    output = settings.get("dry_run_output")
    if isinstance(output, str) and output.strip().lower() not in DRY_RUN_OUTPUTS:
        raise EnvValueError("MEGATRON_PERF_TOGGLES_DRY_RUN_OUTPUT", output, ", ".join(DRY_RUN_OUTPUTS))
    if isinstance(output, str):
        settings["dry_run_output"] = output.strip().lower()
    # The fields are named by the registry, so a checker cannot match values to them: check_settings
    # has matched each setting's kind to its field's type at import.
    return EnvSettings(toggles=toggles, rank=rank_of(environ), alloc=alloc_conf(environ),
                       cutedsl_grouped_mlp=_above_zero(environ.get(CUTEDSL_GROUPED_MLP)),
                       **settings)  # type: ignore[arg-type]


CUTEDSL_GROUPED_MLP = "NVTE_CUTEDSL_FUSED_GROUPED_MLP"


def _above_zero(value: str | None) -> bool:
    """As Megatron reads the variable (an integer above 0); anything else is off."""
    try:
        return int((value or "0").strip()) > 0
    except ValueError:
        return False
