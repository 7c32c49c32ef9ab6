"""Documentation tables generated from the code: the registry, the guards and the recorded
surfaces (a test keeps every page equal to them, so no number or row can drift).

``python -m megatron_perf_toggles.tools.readme_tables`` prints them; ``--write`` rewrites every
generated block in the pages that hold them (``PAGES``).
"""

from __future__ import annotations

from ..core.registry import BY_CAPABILITY, SETTINGS, TOGGLES, format_value
from ..core.rules.guards import GUARDS, guards_table
from ..core.rules.megatron_rules import rules_table
from ..runtime import surface_replay as replay

BEGIN = "<!-- generated:{name} begin -->"
END = "<!-- generated:{name} end -->"


def _default_words(value: object) -> str:
    return format_value(value) if isinstance(value, bool) else f"`{format_value(value)}`"


def toggles_table() -> str:
    rows = ["| env var | Megatron dest | default | flags | group | script bucket | what it does |",
            "|---|---|---|---|---|---|---|"]
    for t in TOGGLES:
        flags = " / ".join(f"`{f}`" for f in t.flags)
        if t.kind == "choice":
            flags = f"`{t.flag} {{{','.join(t.choices)}}}`"
        rows.append(f"| `{t.env}` | `{t.dest}` | {_default_words(t.default)} | {flags} | {t.group} | "
                    f"{t.script_bucket} | {t.help} |")
    return "\n".join(rows)


def settings_table() -> str:
    rows = ["| env var | default | meaning |", "|---|---|---|"]
    for s in SETTINGS:
        rows.append(f"| `{s.env}` | {('`' + s.default + '`') if s.default else 'unset'} | {s.help} |")
    return "\n".join(rows)


def _cell(surface: dict, t) -> str:
    flags = {f for a in surface["actions"] for f in a["flags"]}
    facts = replay.surface_facts(surface)
    native = [f for f in t.flags if f in flags]
    # a toggle that needs a TransformerConfig field this Megatron lacks (fused single-QKV RoPE before
    # 0.15, MoE router fusion on 0.13): the plugin registers its flags, and its guard turns it off
    fields = [BY_CAPABILITY[c].detected.removeprefix("megatron:") for c in t.needs if not BY_CAPABILITY[c].stored]
    if any(facts.get(field) is False for field in fields):
        return "guard: off (no field)"
    if t.dest == "cross_entropy_fusion_impl" and facts.get("asserts_te_cross_entropy"):
        return "guard: te→native"
    if len(native) == len(t.flags):
        return "native"
    if not native:
        return "+on/off flags"
    return "+on flag" if t.flag not in flags else "+off flag"


def compatibility_table() -> str:
    """Per recorded Megatron: what the plugin adds or guards for each toggle, and its parse hook."""
    header = "| Megatron | " + " | ".join(f"`{t.dest}`" for t in TOGGLES) + " | parses via |"
    rows = [header, "|---|" + "---|" * (len(TOGGLES) + 1)]
    for name in replay.available():
        surface = replay.load_surface(name)
        facts = replay.surface_facts(surface)
        hook = "`parse_and_validate_args`" if facts.get("has_parse_and_validate_args") else "`pretrain(extra_args_provider=)`"
        cells = " | ".join(_cell(surface, t) for t in TOGGLES)
        rows.append(f"| {name.replace('core_v', '')} | {cells} | {hook} |")
    return "\n".join(rows)


def guards_list() -> str:
    """The guards in the order ``decide`` applies them, numbered, each with its docstring: the
    one list that names guards by number, generated so the numbers follow the code."""
    import inspect

    rows = []
    for number, guard in enumerate(GUARDS, 1):
        doc = " ".join((inspect.getdoc(guard.check) or "").split("\n\n", 1)[0].split())
        rows.append(f"{number}. `{guard.name}`: {doc or '(no description)'}")
    return "\n".join(rows)


TABLES = {"toggles": toggles_table, "settings": settings_table, "compatibility": compatibility_table,
          "megatron-rules": rules_table, "guards": guards_list, "guard-rules": guards_table}
# Where each generated block lives (paths from the repository's root).
PAGES = {"toggles": "README.md", "settings": "docs/reference.md", "compatibility": "docs/reference.md",
         "megatron-rules": "docs/guards.md", "guards": "docs/guards.md", "guard-rules": "docs/architecture.md"}


def render_block(name: str) -> str:
    return f"{BEGIN.format(name=name)}\n{TABLES[name]()}\n{END.format(name=name)}"


def _update_block(text: str, name: str) -> str:
    import re

    pattern = re.escape(BEGIN.format(name=name)) + r".*?" + re.escape(END.format(name=name))
    return re.sub(pattern, lambda _m: render_block(name), text, flags=re.S)


def update(text: str) -> str:
    """``text`` with every generated block replaced by its current rendering."""
    for name in TABLES:  # a block the file does not have is left alone
        text = _update_block(text, name)
    return text


def main(argv: list[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(description="Print the generated documentation tables, or rewrite them in place.")
    ap.add_argument("--write", metavar="FILE", nargs="?", const="",
                    help="rewrite the generated blocks inside FILE; with no FILE, in every page that holds one "
                         "(run from the repository's root)")
    ns = ap.parse_args(argv)
    if ns.write is not None:
        for page in [ns.write] if ns.write else sorted(set(PAGES.values())):
            path = Path(page)
            path.write_text(update(path.read_text()))
        return 0
    for table in TABLES:
        print(render_block(table))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
