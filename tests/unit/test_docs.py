"""The README's reference tables are the registry's and the recorded surfaces' own rendering."""

from __future__ import annotations

from conftest import REPO

from megatron_perf_toggles.tools import readme_tables as docs


def test_generated_tables_equal_the_code():
    for name in docs.TABLES:
        page = (REPO / docs.PAGES[name]).read_text()
        stale = f"{docs.PAGES[name]}: table {name!r} is stale: python -m megatron_perf_toggles.tools.readme_tables --write"
        assert docs.render_block(name) in page, stale


def test_the_guard_list_follows_the_code_so_no_number_can_drift():
    from megatron_perf_toggles.core.decision.decide import GUARDS

    lines = docs.guards_list().splitlines()
    assert [line.split("`")[1] for line in lines] == [g.name for g in GUARDS]
    assert [line.split(".")[0] for line in lines] == [str(i) for i in range(1, len(GUARDS) + 1)]
    assert "(no description)" not in docs.guards_list()  # every guard says what it does (its docstring)
    # Guards are named, never numbered by hand, anywhere else in the documentation.
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    import re

    for page in pages:
        text = page.read_text().replace(docs.render_block("guards"), "")
        assert not re.search(r"\bguards? \d", text), f"{page.name} numbers a guard by hand"


def test_readme_is_a_front_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert (REPO / "CHANGELOG.md").is_file()
    for link in ("docs/guards.md", "docs/profiles-and-tune.md", "docs/ablate.md", "docs/benchmarks.md",
                 "docs/parity.md", "docs/architecture.md", "docs/contributing.md"):
        assert f"]({link})" in readme and (REPO / link).is_file(), link


def test_the_first_screen_has_exactly_two_commands():
    """What and why, then one command for the main job and one for the tests (the newcomer trial)."""
    readme = (REPO / "README.md").read_text()
    first = readme.split("\n## ", 1)[0]
    blocks = first.split("```bash\n")[1:]
    commands = [line for block in blocks for line in block.split("```")[0].splitlines() if line.strip()]
    assert commands == ["pip install . && megatron-perf-toggles explain",
                        'pip install -e ".[test]" && python -m pytest -q tests']


def test_compatibility_table_reflects_version_facts():
    table = docs.compatibility_table()
    row = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert "guard: te→native" in row["main"] and "guard: te→native" not in row["0.18.0"]
    assert "guard: off (no field)" in row["0.13.0"] and "guard: off (no field)" not in row["0.15.0"]
