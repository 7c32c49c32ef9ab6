"""The README's reference tables are the registry's and the recorded surfaces' own rendering."""

from __future__ import annotations

from conftest import REPO

from megatron_perf_toggles.tools import readme_tables as docs


def test_readme_tables_equal_the_generated_ones():
    readme = (REPO / "README.md").read_text()
    for name in docs.TABLES:
        stale = f"README table {name!r} is stale: python -m megatron_perf_toggles.tools.readme_tables"
        assert docs.render_block(name) in readme, stale


def test_compatibility_table_reflects_version_facts():
    table = docs.compatibility_table()
    row = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert "guard: te→native" in row["main"] and "guard: te→native" not in row["0.18.0"]
    assert "guard: off (no field)" in row["0.13.0"] and "guard: off (no field)" not in row["0.15.0"]
