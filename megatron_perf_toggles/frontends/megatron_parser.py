"""The argparse front end: Megatron's own parser, reached by the provider a user names.

This is the front end every other one is measured against: Megatron parses its flags and calls
``extra_args_provider(parser)`` first, and the plugin reads what the command line set from the
parse itself. Its adapter is ``runtime/provider.py`` (registering the flags, handing each parse to
the ``Controller``) and, where a script or launcher puts it into the parse path without the user
naming a provider, the parse hooks of ``launcher/parse_hooks.py``. Both stay below this wing
because they run in every training process and must load nothing of the config front ends; this
module names them in one place, beside ``bridge/`` and ``primus/``, and is what ``hooks.py``
imports. The package's bare ``extra_args_provider`` loads ``runtime/provider.py`` alone: a provider
named in a training script should not pay for the parse hooks' import at start-up.
"""

from __future__ import annotations

from ..launcher.parse_hooks import install_from_argv, prepare_from_argv
from ..runtime.provider import attach, chain_providers, extra_args_provider

__all__ = ["attach", "chain_providers", "extra_args_provider", "install_from_argv", "prepare_from_argv"]
