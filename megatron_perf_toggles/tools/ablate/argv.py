"""Megatron arguments, each once: what an arm's command line is made of.

An arm's settings, its per-run paths and a candidate's additions replace the common arguments'
own, so that no flag is given twice with two values (Megatron would take the last, silently).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .design import Arm


def _flag_key(word: str) -> str:
    return word.split("=", 1)[0].replace("_", "-")


def set_args(argv: Sequence[str], values: Mapping[str, str | None]) -> list[str]:
    """``argv`` with every ``--flag [values...]`` / ``--flag=value`` of ``values`` removed (a flag's
    values are the words after it up to the next ``--`` word, so switches and lists go whole), then
    each flag whose value is not None appended once with that value."""
    keys = {_flag_key(f) for f in values}
    out: list[str] = []
    skipping = False
    for word in argv:
        if word.startswith("--"):
            skipping = _flag_key(word) in keys
            if skipping:
                continue
        elif skipping:
            continue
        out.append(word)
    for flag, value in values.items():
        if value is not None:
            out += [flag, value]
    return out


def with_added(argv: Sequence[str], added: Sequence[str]) -> list[str]:
    """``argv`` with the flags of ``added`` (a candidate's arguments) replaced by ``added``: each
    Megatron argument once, the candidate's value winning."""
    flags = {_flag_key(w): None for w in added if w.startswith("--")}
    return [*set_args(argv, flags), *added]


def repeated_flags(argv: Sequence[str]) -> list[str]:
    """Flags given more than once (Megatron takes the last): worth a note before anything runs."""
    seen: dict[str, int] = {}
    for word in argv:
        if word.startswith("--"):
            seen[_flag_key(word)] = seen.get(_flag_key(word), 0) + 1
    return sorted(k for k, n in seen.items() if n > 1)


def _settings_args(arm: Arm) -> dict[str, str | None]:
    words = arm.extra_args()
    return dict(zip(words[::2], words[1::2], strict=True))


def arm_args(megatron_args: Sequence[str], arm: Arm, paths: Mapping[str, str | None] | None = None) -> list[str]:
    """The arm's Megatron arguments, each once: the common ones, the arm's settings and paths
    replacing their own, and a candidate's arguments added."""
    return with_added(set_args(megatron_args, {**_settings_args(arm), **(paths or {})}), arm.added_args())


def after_separator(words: Sequence[str]) -> list[str]:
    """The Megatron arguments as given after the script: argparse keeps the ``--`` that separates
    them from ours, and only that first one is ours to drop."""
    args = list(words)
    return args[1:] if args[:1] == ["--"] else args
