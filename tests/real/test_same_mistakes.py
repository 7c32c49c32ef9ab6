"""The same mistake gets the same fix from every way of planning a command line.

A new user met a misspelt flag in a dry run with "(the script's --help lists Megatron's flags)"
where ``explain`` said "did you mean '--grad-reduce-in-bf16'?". Each mistake below goes through
``explain`` on a recorded surface, ``explain --megatron`` (the checkout's own parse and
validate_args) and the launcher's dry run, on the oldest and the newest tree (both parse paths):
each says it in one ``[perf-toggles] error:`` line, exit 2, naming the fix written here.
"""

from __future__ import annotations

import launcher_cases as runs
import pytest

WAYS = ("explain", "explain-megatron", "dry-run")
PLAN = ["--world-size", "8", "--gpu", "h100"]

# (name, Megatron arguments added, environment, planning options, the fix every way must name)
MISTAKES = [
    ("misspelt-flag", ["--grad-reduce-in-bf17"], {}, PLAN, "did you mean '--grad-reduce-in-bf16'?"),
    ("bad-choice", ["--cross-entropy-fusion-impl", "tee"], {}, PLAN, "did you mean 'te'?"),
    ("bad-number", ["--micro-batch-size", "two"], {}, PLAN, "give --micro-batch-size a value of type int"),
    ("missing-value", ["--micro-batch-size"], {}, PLAN, "give --micro-batch-size a value"),
    ("bad-env-value", [], {"GRAD_REDUCE_IN_BF16": "maybe"}, PLAN, "accepted values: 1/0, true/false"),
    ("impossible-layout", ["--pipeline-model-parallel-size", "3"], {}, PLAN,
     "plan a world that is a multiple of 3 (--world-size N)"),
    ("both-forms", ["--grad-reduce-in-bf16", "--no-grad-reduce-in-bf16"], {}, PLAN, "keep one"),
    ("unknown-gpu", [], {}, ["--world-size", "8", "--gpu", "h1000"], "did you mean 'h100'?"),
]


def _cases(tree: str) -> list[dict]:
    base = [*runs.BASE_ARGS, *runs.TOKENIZER]
    out = []
    for name, extra, env, plan, _ in MISTAKES:
        args = [*base, *extra]
        out += [
            {"name": f"{name}:explain", "mode": "cli", "env": env, "argv": ["explain", *plan, "--", *args]},
            {"name": f"{name}:explain-megatron", "mode": "cli", "env": env,
             "argv": ["explain", "--megatron", tree, *plan, "--", *args]},
            {"name": f"{name}:dry-run", "mode": "launcher", "env": env,  # the summary, as users run it
             "unset": ["MEGATRON_PERF_TOGGLES_DRY_RUN_OUTPUT"], "argv": ["--dry-run", *plan, f"{tree}/pretrain_gpt.py", *args]},
        ]
    return out


TREES = list(dict.fromkeys(runs.trees()[:1] + runs.trees()[-1:]))
PARAMS = [pytest.param(t, id=runs.tree_id(t)) for t in TREES] or [pytest.param(None, id="no-trees")]
_FOUND: dict[str, dict] = {}


def _found(tree: str) -> dict:
    if tree not in _FOUND:
        _FOUND[tree] = runs.run_cases(tree, _cases(tree))
    return _FOUND[tree]


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", PARAMS)
@pytest.mark.parametrize(("name", "fix"), [(m[0], m[4]) for m in MISTAKES])
def test_each_way_says_the_mistake_in_one_line_with_the_same_fix(tree: str, name: str, fix: str) -> None:
    found = _found(tree)
    for way in WAYS:
        result = found[f"{name}:{way}"]
        assert result["error"] is None, result["error"]
        said = [line for line in result["stderr"].splitlines() if line.strip()]
        assert result["code"] == 2 and len(said) == 1, (way, result["stderr"][-2000:])
        assert said[0].startswith("[perf-toggles] error: ") and fix in said[0], (way, said[0])
        assert "usage:" not in result["stderr"] and "Traceback" not in result["stderr"]
