"""Adding a toggle with a capability the package does not know yet: the recipe in
docs/contributing.md, and this test is its walk-through.

It declares what the recipe's files hold and nothing more: in ``core/registry.py`` a new
``Capability`` record and a ``Toggle`` that needs it, in a guard module one guard that consults that
need, and these tests. Everything else (the flags, the environment variable, ``--help``, the
capability's detection and its value on a planned machine, the decision and its provenance, the
generated tables) must follow with no other code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

import pytest
from conftest import REPO, full_caps

from megatron_perf_toggles.core import registry
from megatron_perf_toggles.core.decision import decide
from megatron_perf_toggles.core.env import read_env
from megatron_perf_toggles.core.facts import Capabilities, with_assumptions
from megatron_perf_toggles.core.rules import guards
from megatron_perf_toggles.errors import CannotHonourError, EnvValueError, RegistryError
from megatron_perf_toggles.runtime import provider
from megatron_perf_toggles.runtime.controller import Controller
from megatron_perf_toggles.runtime.machine import capabilities
from megatron_perf_toggles.tools import readme_tables

# 1. The registry: the capability, declared once (how this machine detects it, how a planned stack
# assumes it, why it is missing), and the toggle. Flags follow from dest: --fused-example-kernel /
# --no-fused-example-kernel.
KERNEL = registry.Capability("te_example_kernel", "import:transformer_engine.pytorch.example:example_kernel",
                             "te>=2.9", "TE {te_version} has no example kernel")
EXAMPLE = registry.Toggle(
    dest="fused_example_kernel",
    env="FUSED_EXAMPLE_KERNEL",
    title="fused example kernel",
    kind="bool",
    default=True,
    group="transformer",
    needs=(KERNEL.name,),
    help="An example of a fused kernel from Transformer Engine.",
)


# 2. Its guard, declared once: the toggle it may move (and the Megatron rules it answers: none here,
# it is about this machine); off where the kernel it needs is missing, naming the capability.
@decide.guard(moves=(EXAMPLE.dest,))
def example_kernel_missing(ctx: decide.Context) -> Iterator[decide.Change]:
    need = decide.lacking(ctx, EXAMPLE.dest) if ctx.values.get(EXAMPLE.dest) else None
    if need:
        yield decide.Change(EXAMPLE.dest, False, f"{need} is missing here", hint=f"pass {EXAMPLE.off_flag}",
                            capability=need)


@pytest.fixture
def with_example(monkeypatch: pytest.MonkeyPatch) -> None:
    """The entries appended to the registry (and to every module's view of it), the guard to GUARDS
    (as its module's declaration would put it there)."""
    monkeypatch.setitem(registry.BY_CAPABILITY, KERNEL.name, KERNEL)
    replaced = [(registry.TOGGLES, (*registry.TOGGLES, EXAMPLE)),
                (registry.BY_DEST, {**registry.BY_DEST, EXAMPLE.dest: EXAMPLE})]
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron_perf_toggles"):
            for attr, value in list(vars(module).items()):
                new = next((n for old, n in replaced if value is old), None)
                if new is not None:
                    monkeypatch.setattr(module, attr, new)
    monkeypatch.setattr(decide, "GUARDS", (*decide.GUARDS, example_kernel_missing))
    assert example_kernel_missing.name == "example_kernel_missing"
    registry._validate()  # the declaration-time checks accept it


def _parse(argv: list[str], environ: dict[str, str], **caps: object) -> tuple[argparse.Namespace, Controller]:
    controller = Controller(environ, mode="plan", capabilities=full_caps(**{KERNEL.name: True, **caps}))
    parser = provider.attach(argparse.ArgumentParser(prog="pretrain_gpt.py"), controller=controller)
    return parser.parse_args(argv), controller


def test_the_flags_and_the_variable_follow_from_the_entry(with_example: None) -> None:
    assert EXAMPLE.flags == ("--fused-example-kernel", "--no-fused-example-kernel")
    assert read_env({"FUSED_EXAMPLE_KERNEL": "off"}).toggles == {"fused_example_kernel": False}
    with pytest.raises(EnvValueError, match="FUSED_EXAMPLE_KERNEL"):
        read_env({"FUSED_EXAMPLE_KERNEL": "maybe"})
    parser = provider.attach(argparse.ArgumentParser(), environ={})
    assert {"--fused-example-kernel", "--no-fused-example-kernel"} <= set(parser._option_string_actions)
    assert "FUSED_EXAMPLE_KERNEL" in parser.format_help()


def test_the_decision_comes_from_command_line_environment_or_default(with_example: None) -> None:
    args, _ = _parse([], {})
    assert args.fused_example_kernel is True and args.perf_toggles["fused_example_kernel"]["source"] == "default"
    args, _ = _parse([], {"FUSED_EXAMPLE_KERNEL": "0"})
    assert args.perf_toggles["fused_example_kernel"] == {"value": False, "source": "env",
                                                         "reason": "FUSED_EXAMPLE_KERNEL=0",
                                                         "peak_memory_delta_mb": None}  # no term in core/memory/model.py
    args, _ = _parse(["--no-fused-example-kernel"], {"FUSED_EXAMPLE_KERNEL": "1"})
    assert args.perf_toggles["fused_example_kernel"]["source"] == "cli"


def test_the_guard_consults_what_the_registry_says_the_toggle_needs(with_example: None) -> None:
    args, controller = _parse([], {}, te_example_kernel=False)
    record = args.perf_toggles["fused_example_kernel"]
    assert (record["value"], record["source"]) == (False, "guard") and "te_example_kernel" in record["reason"]
    assert controller.last is not None and controller.last.plan.decisions["fused_example_kernel"].value is False
    with pytest.raises(CannotHonourError, match="--fused-example-kernel was requested"):
        decide.decide({}, {"fused_example_kernel": True}, read_env({}), full_caps(te_example_kernel=False))
    args, _ = _parse([], {}, te_example_kernel=True)
    assert args.perf_toggles["fused_example_kernel"]["value"] is True


def test_the_new_capability_is_detected_and_assumed_from_its_record(with_example: None) -> None:
    here = capabilities.detect()  # this machine: no Transformer Engine, so the kernel is missing
    assert here.te_example_kernel is False and "te_example_kernel" in here.to_record()
    assert with_assumptions(Capabilities(), "none,cuda,te=2.20").te_example_kernel is True  # a planned stack
    assert with_assumptions(Capabilities(), "te=2.8").te_example_kernel is False
    plan = decide.decide({}, {}, read_env({}), with_assumptions(full_caps(), "te=2.8"))
    assert plan.decisions["fused_example_kernel"].value is False


def test_a_guard_cannot_rest_on_an_undeclared_capability() -> None:
    with pytest.raises(RegistryError, match="the registry does not declare"):
        decide.Change("fused_example_kernel", False, "why", capability="warp_drive")


def test_the_readme_table_lists_it(with_example: None) -> None:
    assert "`FUSED_EXAMPLE_KERNEL`" in readme_tables.toggles_table()


def test_the_guard_table_lists_its_guard(with_example: None) -> None:
    row = next(line for line in guards.guards_table(decide.GUARDS).splitlines() if "example_kernel_missing" in line)
    assert "`fused_example_kernel`" in row and "none" in row


def test_the_recipe_touches_at_most_five_hand_written_files() -> None:
    """docs/contributing.md's recipe names the hand-written files a toggle with a new capability
    touches, one numbered step each: at most five, each of them there; this test declares what
    the first two hold (and is the third)."""
    text = (REPO / "docs" / "contributing.md").read_text()
    recipe = text.split("<!-- recipe: adding a toggle -->", 2)[1]
    steps = [line for line in recipe.splitlines() if line[:2] in {f"{n}." for n in range(1, 10)}]
    files = [line.split("`")[1] for line in steps]
    assert 2 <= len(files) <= 5, files
    for path in files:
        assert "<" in path or (REPO / path).is_file(), path
    assert files[0] == "megatron_perf_toggles/core/registry.py"  # KERNEL and EXAMPLE above
    assert files[1].startswith("megatron_perf_toggles/core/rules/guards_")  # example_kernel_missing above
    assert any(f.startswith("tests/unit/test_") for f in files)  # this file
