"""Where each toggle lives outside argparse: the one mapping the config front ends share.

The argparse path reads and writes a toggle under its Megatron dest. Megatron-Bridge keeps the
same settings in the sections of a ``ConfigContainer`` (``cfg.model``, ``cfg.ddp``,
``cfg.mixed_precision``), sometimes under another name or the other way up
(``grad_reduce_in_fp32`` is ``not grad_reduce_in_bf16``), and sometimes in two places at once.
Primus builds Megatron's own namespace, so its fields are the dests themselves; what it needs
is where its shipped defaults are declared, to tell them from an experiment's choices.

Derived from the registry: a toggle with no entry in ``BRIDGE_OVERRIDES`` lives in
``cfg.model.<dest>`` (``TransformerConfig`` carries most of them under their argparse name), so
a new toggle needs an entry here only when Bridge keeps it elsewhere. :func:`check` fails
loudly at import if a toggle or FP4 layer field has no home. Pure data: nothing is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RegistryError
from .decision.decide import FP4_LAYER_DESTS
from .registry import TOGGLES


@dataclass(frozen=True, slots=True)
class Home:
    """One field that holds a toggle: ``path`` below the config root (``model.fused_single_qkv_rope``),
    and whether the field holds the opposite of the toggle's value."""

    path: str
    inverted: bool = False

    def to_field(self, value: object) -> object:
        return (not value) if self.inverted else value

    def from_field(self, value: object) -> object:
        return (not value) if self.inverted else value


# Bridge fields that are not ``model.<dest>``. ``mixed_precision`` is listed first where it takes
# part: ``runtime_config_update`` copies every MixedPrecisionConfig field onto the model, DDP and
# optimizer configs that have one, so its value is the one that reaches Megatron.
BRIDGE_OVERRIDES: dict[str, tuple[Home, ...]] = {
    "grad_reduce_in_bf16": (Home("mixed_precision.grad_reduce_in_fp32", inverted=True),
                            Home("ddp.grad_reduce_in_fp32", inverted=True)),
    "ddp_average_in_collective": (Home("ddp.average_in_collective"),),
    **{dest: (Home(f"mixed_precision.{dest}"), Home(f"model.{dest}")) for dest in FP4_LAYER_DESTS},
}

# The sections whose fields the guards may read as parsed arguments, by field name; where two
# sections share a name, the earlier one wins (mixed precision over the model, as Bridge copies it).
BRIDGE_SECTIONS = ("mixed_precision", "model", "ddp", "optimizer", "train", "checkpoint", "logger", "dist",
                   "dataset")

# Where a field's declared default is Megatron's or Bridge's generic one (module prefixes). A model
# provider that redeclares a toggle field (Bridge's Falcon-H1 turns cross-entropy fusion off, its
# audio and omni models gradient-accumulation fusion) made a choice for that model, even where it
# equals the generic default: its value counts as set. So does the default of any class not listed.
BRIDGE_GENERIC_MODULES = ("megatron.core.", "megatron.bridge.training.", "megatron.bridge.models.gpt_provider",
                          "megatron.bridge.models.hybrid.hybrid_provider")

# Fields Bridge fills in only in runtime_config_update, after the plugin: placeholders before it
# (the dataset's data_parallel_size is 1 until then), so they are not read as arguments.
BRIDGE_RUNTIME_FIELDS = ("data_parallel_size",)

# Arguments a guard reads that Bridge spells differently: (dest, the field whose truth sets it), any
# of a dest's fields; a number is true above zero (Bridge's -1 means off). Packed (THD) sequences:
# Bridge 0.6 turns offline or in-batch packing on by name, Bridge 0.5 and older gave the packed
# size; Megatron's argparse path knows them from --sft, the blocker the fused-QKV-RoPE guard names.
BRIDGE_DERIVED: tuple[tuple[str, Home], ...] = (
    ("sft", Home("dataset.enable_offline_packing")),
    ("sft", Home("dataset.enable_in_batch_packing")),
    ("sft", Home("dataset.packed_sequence_specs.packed_sequence_size")),
    # The memory model's shape of the model, as Megatron's flags give it on the argparse path.
    ("swiglu", Home("model.gated_linear_unit")),
    ("group_query_attention", Home("model.num_query_groups")),
    ("untie_embeddings_and_output_weights", Home("model.share_embeddings_and_output_weights", inverted=True)),
)

# Primus's namespace is Megatron's: each toggle is its own dest there.
PRIMUS_HOMES: dict[str, tuple[Home, ...]] = {dest: (Home(dest),) for dest in (*(t.dest for t in TOGGLES),
                                                                              *FP4_LAYER_DESTS)}
# Primus's own defaults for Megatron's arguments, relative to its package directory: its base
# trainer module and the language-model family every GPT model file extends. A value equal to the
# one declared here is Primus's default, not an experiment's choice.
PRIMUS_DEFAULT_FILES = ("configs/modules/megatron/trainer_base.yaml",
                        "configs/models/megatron/language_model.yaml")


def bridge_homes() -> dict[str, tuple[Home, ...]]:
    """Every toggle and FP4 layer field, and the Bridge fields it is written to (first: read from)."""
    out = {t.dest: BRIDGE_OVERRIDES.get(t.dest, (Home(f"model.{t.dest}"),)) for t in TOGGLES}
    out.update({dest: BRIDGE_OVERRIDES[dest] for dest in FP4_LAYER_DESTS})
    return out


def check() -> None:
    """Every override names a registered toggle or FP4 field, and every path has a section."""
    known = {t.dest for t in TOGGLES} | set(FP4_LAYER_DESTS)
    for dest, homes in BRIDGE_OVERRIDES.items():
        if dest not in known:
            raise RegistryError(f"config_fields: {dest!r} is not a registered toggle")
        for home in homes:
            if home.path.split(".", 1)[0] not in BRIDGE_SECTIONS:
                raise RegistryError(f"config_fields: {home.path!r} is in no known Bridge section")


check()
