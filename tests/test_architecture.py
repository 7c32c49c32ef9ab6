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
    assert {"core/plan.py", "core/guards_model.py", "runtime/patches.py"} <= named, named
    missing = sorted(n for n in named if not (REPO / "megatron_perf_toggles" / n).is_file())
    assert not missing
