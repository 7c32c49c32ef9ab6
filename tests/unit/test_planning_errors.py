"""A refusal during a planning parse is said once: the plugin's own line is not wrapped as Megatron's."""

from __future__ import annotations

import pytest

from megatron_perf_toggles.tools.planning import parse_refusal


@pytest.mark.parametrize(("output", "expected"), [
    ("Megatron chatter\n[perf-toggles] error: --x was requested, but this Megatron cannot (pass --no-x)\n",
     "--x was requested, but this Megatron cannot (pass --no-x)"),
    ("usage: pretrain_gpt.py ...\npretrain_gpt.py: error: unrecognized arguments: --bogus\n\n",
     "Megatron's parser: pretrain_gpt.py: error: unrecognized arguments: --bogus"),
    ("", "Megatron's parser: exit 2"),
])
def test_the_last_line_is_said_once(output, expected):
    assert parse_refusal(output, 2) == expected
