"""The single source of truth: every toggle and plugin setting, declared once.

Flags, env parsing, ``--help`` text, the README reference tables, the ``flags`` command and the
provenance schema are all derived from these records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .settings import SETTINGS, Setting

Kind = Literal["bool", "choice"]
Bucket = Literal["gpt", "extra"]


@dataclass(frozen=True, slots=True)
class Group:
    """Where Megatron keeps a kind of setting: a new flag joins the group of its neighbours."""

    key: str
    titles: tuple[str, ...]  # argparse group titles across Megatron versions, preferred first
    bucket: Bucket  # the launch-script argument bucket this group's flags belong to


GROUPS: dict[str, Group] = {
    g.key: g
    for g in (
        Group("transformer", ("transformer configuration",), "gpt"),
        Group("mixed_precision", ("mixed precision",), "gpt"),
        Group("distributed", ("distributed init", "distributed"), "extra"),
        Group("training", ("training",), "extra"),
        # Megatron's parser keeps the MoE flags in its "moe" group up to core 0.15; from 0.16 the
        # TransformerConfig fields become flags in "transformer configuration" (anchors find them).
        Group("moe", ("moe",), "gpt"),
    )
}

Scope = Literal["all", "moe"]


def is_moe(args: Mapping[str, Any]) -> bool:
    """A mixture-of-experts model: ``--num-experts`` (TransformerConfig's ``num_moe_experts``, as a
    configuration front end names it) is set above zero."""
    experts = args.get("num_experts") or args.get("num_moe_experts") or 0
    return isinstance(experts, int) and not isinstance(experts, bool) and experts > 0


@dataclass(frozen=True, slots=True)
class Capability:
    """Something a toggle can need (``Toggle.needs``) or a guard can rest on (``plan.Change``),
    declared once: ``core.facts.Capabilities`` answers it by name (False: missing, None: unknown),
    ``runtime.machine.capabilities`` detects it, and a plan for another machine assumes it, all from here.

    ``detected``, how this machine answers it:
      ``import:MODULE:ATTR``  the attribute is there once its package imports (where the package is
                              installed but not imported yet, Transformer Engine's version answers,
                              by ``assumed``'s bound, rather than pay for the import);
      ``installed:MODULE``    the module can be found (no import);
      ``probe:NAME``          a probe of its own in ``runtime.machine.capabilities.PROBES``;
      ``megatron:FIELD``      the ``MegatronFacts`` field of the Megatron at hand (not stored).
    ``assumed``, how ``MEGATRON_PERF_TOGGLES_ASSUME`` (and so a planned stack) sets it:
      ``apex`` (the ``apex`` entry), ``grouped_gemm`` (the ``grouped_gemm`` entry), ``gpu`` (a ``cuda``
      or ``rocm`` entry), ``te>=X.Y`` (a
      ``te=VERSION`` entry at least that recent), ``megatron`` (the Megatron planned for answers it).
    ``note``: why it is missing, as ``explain`` and a guard's reason say it (``{te_version}`` filled in).
    """

    name: str
    detected: str
    assumed: str
    note: str

    @property
    def stored(self) -> bool:
        """A value of the machine's own (the Megatron's facts answer the others)."""
        return not self.detected.startswith("megatron:")

    @property
    def te_minimum(self) -> tuple[int, ...] | None:
        """The earliest Transformer Engine that has it, where ``assumed`` is ``te>=X.Y``."""
        if not self.assumed.startswith("te>="):
            return None
        return tuple(int(p) for p in self.assumed.removeprefix("te>=").split("."))


CAPABILITY_RECORDS: tuple[Capability, ...] = (
    Capability("apex_fused_wgrad", "installed:fused_weight_gradient_mlp_cuda", "apex",
               "APEX's fused_weight_gradient_mlp_cuda is not importable"),
    # the torch stand-in for apex_fused_wgrad (runtime/wgrad_fallback.py): a GPU with a current torch
    Capability("wgrad_fallback", "probe:wgrad_fallback", "gpu", "the torch fallback cannot run here"),
    Capability("te_fused_qkv_rope", "import:transformer_engine.pytorch.attention.rope:apply_fused_qkv_rotary_pos_emb",
               "te>=2.8", "TE {te_version} has no fused QKV RoPE kernel"),
    Capability("te_cross_entropy", "import:transformer_engine.pytorch.cross_entropy:parallel_cross_entropy",
               "te>=2.0", "TE {te_version} has no parallel cross-entropy kernel"),
    Capability("megatron_fused_single_qkv_rope_field", "megatron:fused_single_qkv_rope_field", "megatron",
               "this Megatron's TransformerConfig has no fused_single_qkv_rope field"),
    # MoE: Megatron's TEGroupedMLP needs TE's GroupedLinear (Megatron builds it from TE 1.9); the fused
    # permutation it imports from TE >= 2.1; the fused router kernels it imports only from TE 2.7.
    Capability("te_grouped_linear", "import:transformer_engine.pytorch:GroupedLinear",
               "te>=1.9", "TE {te_version} has no GroupedLinear for grouped-GEMM experts"),
    Capability("te_fused_permute", "import:transformer_engine.pytorch.permutation:moe_sort_chunks_by_index_with_probs",
               "te>=2.1", "TE {te_version} has no fused MoE permutation kernels"),
    Capability("te_fused_router", "import:transformer_engine.pytorch.router:fused_topk_with_score_function",
               "te>=2.7", "TE {te_version} has no fused MoE router kernels"),
    # The legacy GroupedMLP (Megatron's local spec, --moe-use-legacy-grouped-gemm, up to core 0.16) runs
    # on the separate grouped_gemm package, which no current stack installs.
    Capability("grouped_gemm_package", "installed:grouped_gemm", "grouped_gemm",
               "the grouped_gemm package (for Megatron's legacy GroupedMLP) is not installed"),
    Capability("megatron_moe_router_fusion_field", "megatron:moe_router_fusion_field", "megatron",
               "this Megatron's TransformerConfig has no moe_router_fusion field"),
)
BY_CAPABILITY: dict[str, Capability] = {c.name: c for c in CAPABILITY_RECORDS}
CAPABILITIES = tuple(BY_CAPABILITY)  # the names, in declaration order


def format_value(value: object) -> str:
    """A toggle value as people read it: on/off for a bool, the word itself for a choice."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def flag_of(dest: str) -> str:
    """Megatron's spelling of the flag for an argparse dest: ``grad_reduce_in_bf16`` -> ``--grad-reduce-in-bf16``."""
    return "--" + dest.replace("_", "-")


def flag_words(dest: str, value: object) -> str:
    """The command-line words that ask for ``value`` of ``dest``: a toggle's own flag (``--no-x`` for
    off), else Megatron's spelling of the dest's flag."""
    toggle = BY_DEST.get(dest)
    if toggle is not None:
        return " ".join(toggle.flag_for(value))  # type: ignore[arg-type]
    return flag_of(dest)


@dataclass(frozen=True, slots=True)
class Toggle:
    """One Megatron setting the plugin turns on by default. ``flag`` and ``off_flag`` follow from
    ``dest`` (``--x`` / ``--no-x``, as Megatron spells them) unless declared."""

    dest: str  # Megatron's argparse dest, also the TransformerConfig / DDP config field
    env: str
    title: str
    kind: Kind
    default: bool | str  # the plugin default: the fast setting
    group: str  # key into GROUPS
    help: str  # one line: what it does and why it is fast
    flag: str = ""  # the positive flag (bool) or the valued flag (choice); derived from dest if empty
    off_flag: str = ""  # the negative flag of a bool toggle; derived from dest if empty
    choices: tuple[str, ...] = ()
    stock_default: bool | str = False  # Megatron's default where its parser has no flag for it
    needs: tuple[str, ...] = ()  # capability names from CAPABILITIES
    anchors: tuple[str, ...] = ()  # Megatron flags whose group a new flag should join, in order
    bucket: Bucket | None = None  # launch-script bucket, where the originating scripts differ from the group's
    scope: Scope = "all"  # the models it applies to: "moe" only where --num-experts is set (is_moe)
    # On, it draws the initial weights in another order than off under one seed (a loss test cannot
    # pair its runs by seed: ablate compares them unpaired)
    redraws_init: bool = False
    # the units `megatron-perf-toggles layers` times it in (tools/layers/units.py; (): a choice)
    acts_in: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.flag:
            object.__setattr__(self, "flag", flag_of(self.dest))
        if not self.off_flag and self.kind == "bool":
            object.__setattr__(self, "off_flag", flag_of("no_" + self.dest))

    def applies(self, args: Mapping[str, Any]) -> bool:
        """Whether the toggle means anything for the model ``args`` describe (elsewhere Megatron's own
        value stands and the tables leave it out)."""
        return self.scope == "all" or is_moe(args)

    @property
    def script_bucket(self) -> Bucket:
        return self.bucket or GROUPS[self.group].bucket

    @property
    def flags(self) -> tuple[str, ...]:
        return tuple(f for f in (self.flag, self.off_flag) if f)

    def flag_for(self, value: bool | str) -> list[str]:
        """The command-line words that request ``value`` explicitly."""
        if self.kind == "choice":
            return [self.flag, str(value)]
        return [self.flag if value else self.off_flag]


TOGGLES: tuple[Toggle, ...] = (
    Toggle(
        dest="gradient_accumulation_fusion", acts_in=("layer_wgrad", "output_wgrad"),
        env="GRADIENT_ACCUMULATION_FUSION",
        title="gradient accumulation fusion",
        kind="bool",
        default=True,
        stock_default=True,
        group="training",
        needs=("apex_fused_wgrad",),
        anchors=("--no-gradient-accumulation-fusion",),
        bucket="gpt",  # the originating train_llama3.sh put it with the model (GPT_ARGS) flags
        help="Weight-gradient GEMMs accumulate straight into the main_grad buffer (needs APEX's "
        "fused_weight_gradient_mlp_cuda).",
    ),
    Toggle(
        dest="grad_reduce_in_bf16", acts_in=("dp_reduce",),
        env="GRAD_REDUCE_IN_BF16",
        title="gradient reduce in bf16",
        kind="bool",
        default=True,
        group="mixed_precision",
        anchors=("--grad-reduce-in-bf16", "--bf16"),
        help="Keep the gradient buffer and the data-parallel reduction in bf16 instead of fp32.",
    ),
    Toggle(
        dest="ddp_average_in_collective", acts_in=("dp_reduce",),
        env="DDP_AVERAGE_IN_COLLECTIVE",
        title="DDP average in collective",
        kind="bool",
        default=True,
        group="distributed",
        anchors=("--ddp-average-in-collective", "--overlap-grad-reduce"),
        help="Divide by the data-parallel size inside the reduction collective, not before it.",
    ),
    Toggle(
        dest="cross_entropy_loss_fusion", acts_in=("output_loss",),
        env="CROSS_ENTROPY_LOSS_FUSION",
        title="cross-entropy loss fusion",
        kind="bool",
        default=True,
        group="transformer",
        anchors=("--cross-entropy-loss-fusion",),
        help="Fused vocab-parallel cross entropy (implementation chosen by "
        "--cross-entropy-fusion-impl).",
    ),
    Toggle(
        dest="cross_entropy_fusion_impl",
        env="CROSS_ENTROPY_FUSION_IMPL",
        title="cross-entropy fusion implementation",
        kind="choice",
        default="te",
        stock_default="native",
        choices=("te", "native"),
        group="transformer",
        needs=("te_cross_entropy",),
        anchors=("--cross-entropy-fusion-impl", "--cross-entropy-loss-fusion"),
        help="Which fused cross-entropy kernel to use: Transformer Engine's (te) or Megatron's "
        "own (native).",
    ),
    Toggle(
        dest="fused_single_qkv_rope", acts_in=("attention",),
        env="FUSED_SINGLE_QKV_ROPE",
        title="fused single-QKV RoPE",
        kind="bool",
        default=True,
        group="transformer",
        needs=("megatron_fused_single_qkv_rope_field", "te_fused_qkv_rope"),
        anchors=("--fused-single-qkv-rope", "--qk-layernorm", "--no-rope-fusion"),
        help="Apply RoPE to the packed QKV tensor in one TE kernel, with no split and concat.",
    ),
    Toggle(
        dest="moe_grouped_gemm", acts_in=("moe_layer",),
        env="MOE_GROUPED_GEMM",
        title="MoE grouped GEMM",
        kind="bool",
        default=True,
        group="moe",
        scope="moe",
        redraws_init=True,  # TE's grouped experts draw all first layers, then all second layers
        needs=("te_grouped_linear",),
        anchors=("--moe-grouped-gemm", "--moe-token-dispatcher-type"),
        help="Run a rank's local experts as one grouped GEMM (TE's GroupedLinear) instead of one GEMM "
        "per expert (MoE models only).",
    ),
    Toggle(
        dest="moe_permute_fusion", acts_in=("dispatcher",),
        env="MOE_PERMUTE_FUSION",
        title="MoE permute fusion",
        kind="bool",
        default=True,
        group="moe",
        scope="moe",
        needs=("te_fused_permute",),
        anchors=("--moe-permute-fusion", "--moe-grouped-gemm", "--moe-token-dispatcher-type"),
        help="Fuse the token permutation and unpermutation around the experts into TE kernels "
        "(MoE models only).",
    ),
    Toggle(
        dest="moe_router_fusion", acts_in=("router",),
        env="MOE_ROUTER_FUSION",
        title="MoE router fusion",
        kind="bool",
        default=True,
        group="moe",
        scope="moe",
        needs=("megatron_moe_router_fusion_field", "te_fused_router"),
        anchors=("--moe-router-fusion", "--moe-permute-fusion", "--moe-grouped-gemm"),
        help="Fuse the router's top-k, score function and aux-loss scores into TE kernels "
        "(MoE models only).",
    ),
)


BOOL_TRUE = ("1", "true", "yes", "on")
BOOL_FALSE = ("0", "false", "no", "off")
BOOL_ACCEPTED = "1/0, true/false, yes/no, on/off (any case), or unset for the default"

def _validate() -> None:
    from .registry_check import validate  # the checks live apart; the declarations stay here

    validate(TOGGLES, SETTINGS, GROUPS, BY_CAPABILITY, CAPABILITY_RECORDS)


_validate()

BY_DEST: dict[str, Toggle] = {t.dest: t for t in TOGGLES}
SETTING_BY_ENV: dict[str, Setting] = {s.env: s for s in SETTINGS}
