"""docs/architecture.md states what the code does: its guard table is the declarations' own
rendering, and the modules it names exist."""

from __future__ import annotations

import re

from conftest import REPO

from megatron_perf_toggles.tools import readme_tables

PAGE = REPO / "docs" / "architecture.md"


def test_the_guard_table_is_generated_from_the_declarations():
    stale = "docs/architecture.md's guard table is stale: python -m megatron_perf_toggles.tools.readme_tables " \
            "--write docs/architecture.md"
    assert readme_tables.render_block("guard-rules") in PAGE.read_text(), stale


def test_the_modules_it_names_exist():
    text = PAGE.read_text()
    named = set(re.findall(r"`((?:core|runtime|launcher|tools)/[a-z_]+\.py)`", text))
    named |= {f"core/{m}" for m in re.findall(r"^\| `([a-z_]+\.py)`(?:, `[a-z_]+\.py`)? \|", text, re.M)}
    named |= {f"core/{m}" for m in re.findall(r"^\| `[a-z_]+\.py`, `([a-z_]+\.py)` \|", text, re.M)}
    assert {"core/plan.py", "core/guards_model.py", "runtime/process_changes.py"} <= named, named
    missing = sorted(n for n in named if not (REPO / "megatron_perf_toggles" / n).is_file())
    assert not missing


GLOSSARY = ("front end", "entry point", "hook", "patch", "plan", "record")


def test_the_glossary_defines_each_word_once():
    rows = re.findall(r"^\| \*\*([a-z ]+)\*\* \|", PAGE.read_text(), re.M)
    assert all(rows.count(word) == 1 for word in GLOSSARY), rows


def test_a_word_of_the_glossary_names_one_kind_of_module():
    """"patch" is a patch set for a checkout and "hook" a wrapper in the parse path: no other
    module takes either word for something else (the front ends' names are theirs to settle)."""
    package = REPO / "megatron_perf_toggles"
    names = sorted(str(p.relative_to(package)) for p in package.rglob("*.py"))
    assert [n for n in names if "patch" in n] == ["tools/patching.py"], names
    assert [n for n in names if "hook" in n and n != "primus_hook.py"] == ["hooks.py", "launcher/parse_hooks.py"]
