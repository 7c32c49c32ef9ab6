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
    named = set(re.findall(r"`((?:core|runtime|launcher|frontends|tools)/[a-z_/]+\.py)`", text))
    assert {"core/decision/plan.py", "core/rules/guards_model.py", "runtime/process_changes.py",
            "frontends/adapter.py"} <= named, named
    missing = sorted(n for n in named if not (REPO / "megatron_perf_toggles" / n).is_file())
    assert not missing


GLOSSARY = ("front end", "entry point", "hook", "patch", "plan", "record", "context", "adapter", "toggle", "guard",
            "rule", "capability", "target", "mode", "wing")


def test_the_glossary_defines_each_word_once():
    rows = re.findall(r"^\| \*\*([a-z ]+)\*\* \|", PAGE.read_text(), re.M)
    assert all(rows.count(word) == 1 for word in GLOSSARY), rows


def test_a_word_of_the_glossary_names_one_kind_of_module():
    """"patch" is a patch set for a checkout and "hook" a wrapper in the parse path: no other
    module takes either word for something else (the front ends' names are theirs to settle)."""
    package = REPO / "megatron_perf_toggles"
    names = sorted(str(p.relative_to(package)) for p in package.rglob("*.py"))
    assert [n for n in names if "patch" in n] == ["tools/patching.py"], names
    primus_hook = {"primus_hook.py", "frontends/primus/hook.py"}  # Primus's own word for its extension point
    assert [n for n in names if "hook" in n and n not in primus_hook] == ["hooks.py", "launcher/parse_hooks.py"]


def test_every_module_is_on_the_page():
    """The wings table names every module of the package by its path (the package top, tools/ablate
    and tools/tune aside: their folders are described as a whole), so a move shows on the page."""
    text = PAGE.read_text()
    package = REPO / "megatron_perf_toggles"
    modules = sorted(str(p.relative_to(package)) for p in package.rglob("*.py")
                     if p.name != "__init__.py" and len(p.relative_to(package).parts) > 1
                     and p.parent.name not in ("ablate", "tune", "surfaces"))
    assert [m for m in modules if f"`{m}`" not in text] == []


def test_the_readmes_package_map_matches_the_folders():
    """The README's short map names every folder of the package (data aside), and the wings in the
    order docs/architecture.md ranks them."""
    readme = (REPO / "README.md").read_text()
    rows = readme.split("**Package map**", 1)[1].split("\n\n", 2)[1]
    package = REPO / "megatron_perf_toggles"
    folders = sorted(str(p.relative_to(package)) + "/" for p in package.rglob("*") if (p / "__init__.py").is_file())
    assert [f for f in folders if f"`{f}`" not in rows] == []
    wings = [line.split("`")[1] for line in rows.splitlines()[2:]]
    assert wings == ["core/", "runtime/", "launcher/", "frontends/", "tools/"]
    assert "`tools` → `frontends` → `launcher` → `runtime` → `core`" in PAGE.read_text()
