"""A refusal during a planning parse is said once: the plugin's own line is not wrapped as Megatron's,
and argparse's own prog is not said twice."""

from __future__ import annotations

import pytest

from megatron_perf_toggles.tools.planning import parse_refusal


@pytest.mark.parametrize(("output", "expected"), [
    ("Megatron chatter\n[perf-toggles] error: --x was requested, but this Megatron cannot (pass --no-x)\n",
     "--x was requested, but this Megatron cannot (pass --no-x)"),
    ("usage: pretrain_gpt.py ...\npretrain_gpt.py: error: unrecognized arguments: --bogus\n\n",
     "Megatron's parser: unrecognized arguments: --bogus (--bogus is not a flag of this Megatron version; "
     "the script's --help lists Megatron's flags)"),
    ("", "Megatron's parser: exit 2 (the script's --help lists Megatron's flags)"),
])
def test_the_last_line_is_said_once(output, expected):
    assert str(parse_refusal(output, 2)) == expected
