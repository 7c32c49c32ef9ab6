"""Which decoder layers each pipeline rank builds, read from the parsed arguments without Megatron.

The memory model prices the busiest pipeline rank, so it needs each rank's layers, and Megatron
does not always split them evenly. It knows four ways (``--pipeline-model-parallel-size`` PP,
N layers), and this module reads each from the flags alone:

- even: N / PP layers per rank. ``--account-for-embedding-in-pipeline-split`` and
  ``--account-for-loss-in-pipeline-split`` count the embedding (the loss) as one more layer, so
  every rank gets (N + 1 [+ 1]) / PP and the first (last) rank builds one transformer layer less;
- ``--decoder-first-pipeline-num-layers F`` / ``--decoder-last-pipeline-num-layers L``: the first
  (last) rank builds F (L), the ranks between them share the rest equally;
- ``--pipeline-model-parallel-layout``: a string naming every stage's layers (``E`` the embedding,
  ``t`` a transformer layer, ``m`` a multi-token-prediction layer, ``L`` the loss; ``|`` ends a
  stage; ``(...)*n`` and ``x*n`` repeat; commas are decoration). Its stages count PP x V: stage
  ``k`` is chunk ``k // PP`` of rank ``k % PP``.

With V virtual pipeline stages (``--num-layers-per-virtual-pipeline-stage``,
``--num-virtual-stages-per-pipeline-rank``, or a layout of PP x V stages) each rank holds V chunks,
and the layers are numbered chunk by chunk: chunk 0 of every rank in rank order, then chunk 1, and
so on. That numbering is what places the MoE layers of a ``--moe-layer-freq`` pattern on a rank.

Where the flags do not describe a split Megatron would build (it refuses the combination, or the
layout is not one its grammar reads), ``SplitUnknown`` says why in one line: the memory model then
gives no estimate rather than an even split that is not the job's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The layout's letters (Megatron's LayerType names for them, for a layout given as a list).
LETTERS = {"E": "embedding", "t": "decoder", "m": "mtp", "L": "loss"}
_BY_NAME = {name: letter for letter, name in LETTERS.items()}
# No real layout unrolls to more letters than this (a model has at most a few thousand layers and
# stages); a string that would is refused before it is unrolled, so a plan stays instant.
MAX_UNROLLED = 100_000
MAX_REPEAT_DIGITS = 6

Split = tuple[tuple[int, ...], ...]  # per pipeline rank, the decoder layers it builds (Megatron's numbering)
Grid = list[list[int]]  # layer counts, grid[chunk][rank]


class SplitUnknown(ValueError):
    """The flags do not describe a pipeline split the memory model can read; the message says why."""


def _shown(layout: str) -> str:
    """The layout as a message quotes it: whole where short, its start where long (one line)."""
    return repr(layout) if len(layout) <= 60 else repr(layout[:57] + "...")


def _times(text: str, at: int, kind: str, layout: str) -> tuple[int, int]:
    """The repeat count ``*n`` at ``text[at:]`` (1 where none follows a letter), and where it ends."""
    if at >= len(text) or text[at] != "*":
        if kind == "group":
            raise SplitUnknown(f"--pipeline-model-parallel-layout {_shown(layout)}: a (...) group needs a *n repeat")
        return 1, at
    end = at + 1
    while end < len(text) and text[end].isdigit():
        end += 1
    digits = text[at + 1:end]
    if not digits or len(digits) > MAX_REPEAT_DIGITS:
        raise SplitUnknown(f"--pipeline-model-parallel-layout {_shown(layout)}: a repeat needs a count of 1 to "
                           f"{MAX_REPEAT_DIGITS} digits after *")
    return int(digits), end


Piece = tuple["str | list[Piece]", int]  # a letter, or a group's own pieces, with its repeat


def _pieces(text: str, layout: str, inside: bool = False) -> list[Piece]:
    """``text`` as pieces in order: a (...) group (its body read as letters, each with its own
    repeat) or one character, each with its repeat. A group inside a group is not read (Megatron
    refuses it too)."""
    out: list[Piece] = []
    at = 0
    while at < len(text):
        if text[at] == "(":
            close = text.find(")", at)
            if inside or close < 0 or "(" in text[at + 1:close]:
                raise SplitUnknown(f"--pipeline-model-parallel-layout {_shown(layout)}: an unclosed or nested (...) group")
            body: str | list[Piece] = _pieces(text[at + 1:close], layout, inside=True)
            kind, at = "group", close + 1
        else:
            body, kind, at = text[at], "letter", at + 1
        times, at = _times(text, at, kind, layout)
        out.append((body, times))
    return out


def _size(pieces: list[Piece]) -> int:
    """How many letters ``pieces`` unroll to, counted without unrolling them."""
    return sum((len(body) if isinstance(body, str) else _size(body)) * times for body, times in pieces)


def _unrolled(pieces: list[Piece]) -> str:
    return "".join((body if isinstance(body, str) else _unrolled(body)) * times for body, times in pieces)


def parse_layout(text: str) -> list[str]:
    """A ``--pipeline-model-parallel-layout`` string as its stages, each a string of the letters
    E, t, m and L, in the order the string gives them (``|`` ends a stage; ``(...)*n`` and ``x*n``
    repeat; commas are decoration). Its size is counted from the pieces before anything is
    unrolled, so a string that would unroll past any real model's is refused at once."""
    pieces = _pieces(text.replace(",", ""), text)
    if _size(pieces) > MAX_UNROLLED:
        raise SplitUnknown(f"--pipeline-model-parallel-layout unrolls to more than {MAX_UNROLLED} letters: "
                           "not a layout the memory model reads")
    stages = _unrolled(pieces).split("|")
    for stage in stages:
        odd = sorted(set(stage) - set(LETTERS))
        if odd:
            raise SplitUnknown(f"--pipeline-model-parallel-layout {_shown(text)} holds {''.join(odd)!r}, outside the "
                               "layout's letters E, t, m, L once its repeats unroll (Megatron refuses it)")
    return stages


def _letter(item: Any) -> str:
    """One layer of a layout given as a list, as its letter: a LayerType name in any case (Megatron
    reads a list's strings so), or an enum member with that name (a configuration object's layout)."""
    name = getattr(item, "name", item)
    if isinstance(name, str) and name.strip().lower() in _BY_NAME:
        return _BY_NAME[name.strip().lower()]
    raise SplitUnknown(f"the pipeline layout names a layer {item!r} the memory model does not read")


def layout_stages(value: Any, pp: int) -> list[str]:
    """The layout's stages in order (PP x V of them), from a string, a list of stages (each a list
    of layer names), or a layout object that keeps them per rank and chunk (``.layout[rank][chunk]``,
    as a TransformerConfig holds it once built)."""
    if isinstance(value, str):
        return parse_layout(value)
    grid = getattr(value, "layout", None)
    if isinstance(grid, list) and len(grid) == pp and all(isinstance(row, list) for row in grid):
        chunks = {len(row) for row in grid}
        if len(chunks) != 1:
            raise SplitUnknown("the pipeline layout object gives its ranks different numbers of chunks")
        return ["".join(_letter(x) for x in grid[rank][chunk]) for chunk in range(chunks.pop()) for rank in range(pp)]
    if isinstance(value, (list, tuple)) and all(isinstance(stage, (list, tuple)) for stage in value):
        return ["".join(_letter(x) for x in stage) for stage in value]
    raise SplitUnknown(f"a pipeline layout of type {type(value).__name__} is not read by the memory model")


def _count(args: Mapping[str, Any], *dests: str) -> int | None:
    """A layer count set on the command line (Megatron's flag) or a configuration object (its
    TransformerConfig field): None where neither is set."""
    for dest in dests:
        value = args.get(dest)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise SplitUnknown(f"--{dests[0].replace('_', '-')} is not a number of layers")
        return value
    return None


def _positive(args: Mapping[str, Any], dest: str) -> int | None:
    value = args.get(dest)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SplitUnknown(f"--{dest.replace('_', '-')} is not a positive number")
    return value


def _number(grid: Grid) -> Split:
    """Each rank's layers from the layer counts per chunk and rank (``grid[chunk][rank]``),
    numbered chunk by chunk over the ranks, as Megatron numbers them."""
    ranks: list[list[int]] = [[] for _ in grid[0]]
    first = 0
    for chunk in grid:
        for rank, count in enumerate(chunk):
            ranks[rank].extend(range(first, first + count))
            first += count
    return tuple(tuple(r) for r in ranks)


def _from_layout(value: Any, layers: int, pp: int) -> Grid:
    stages = layout_stages(value, pp)
    if len(stages) % pp:
        raise SplitUnknown(f"the pipeline layout has {len(stages)} stages, not a multiple of the {pp} pipeline "
                           "stages (Megatron refuses it)")
    text = "".join(stages)
    if text.count("E") != 1 or text.count("L") != 1 or not text.startswith("E") or not text.endswith("L"):
        raise SplitUnknown("the pipeline layout must name the embedding (E) first and the loss (L) last, once each "
                           "(Megatron refuses it otherwise)")
    if not stages[0].startswith("E") or not stages[-1].endswith("L"):  # Megatron accepts an empty stage around them
        raise SplitUnknown("the memory model reads a pipeline layout whose first stage holds the embedding and whose "
                           "last stage holds the loss (an empty stage before the embedding or after the loss is not read)")
    if "m" in text:
        raise SplitUnknown("multi-token prediction layers are not in the memory model")
    if text.count("t") != layers:
        raise SplitUnknown(f"the pipeline layout names {text.count('t')} transformer layers, the model has {layers} "
                           "(Megatron refuses it)")
    counts = [stage.count("t") for stage in stages]
    return [counts[chunk * pp:(chunk + 1) * pp] for chunk in range(len(stages) // pp)]


def _virtual(args: Mapping[str, Any], per_rank: int | None) -> int:
    """Virtual pipeline stages per rank (1 without): from --num-virtual-stages-per-pipeline-rank,
    --num-layers-per-virtual-pipeline-stage (a rank's layers, ``per_rank``, over it), or the size
    validate_args derives from them (a namespace read after it, a configuration object)."""
    stages = _positive(args, "num_virtual_stages_per_pipeline_rank")
    if stages is not None:
        return stages
    layers_each = _positive(args, "num_layers_per_virtual_pipeline_stage")
    if layers_each is not None:
        if per_rank is None:
            raise SplitUnknown("--num-layers-per-virtual-pipeline-stage with an uneven first or last pipeline stage "
                               "(Megatron refuses it: use --num-virtual-stages-per-pipeline-rank)")
        if per_rank % layers_each:
            raise SplitUnknown(f"a pipeline rank's {per_rank} layers are not a multiple of "
                               f"--num-layers-per-virtual-pipeline-stage {layers_each} (Megatron refuses it)")
        return per_rank // layers_each
    return _positive(args, "virtual_pipeline_model_parallel_size") or 1


def _chunks(count: int, virtual: int, where: str) -> list[int]:
    if count % virtual:
        raise SplitUnknown(f"{where} holds {count} layers, not a multiple of {virtual} virtual pipeline stages "
                           "(Megatron refuses it)")
    return [count // virtual] * virtual


def _from_first_last(first: int | None, last: int | None, layers: int, pp: int,
                     args: Mapping[str, Any]) -> Grid:
    for count, flag in ((first, "--decoder-first-pipeline-num-layers"), (last, "--decoder-last-pipeline-num-layers")):
        if count is not None and count <= 0:
            raise SplitUnknown(f"{flag} {count}: Megatron needs 1 or more")
    middle_ranks = pp - (first is not None) - (last is not None)
    rest = layers - (first or 0) - (last or 0)
    if middle_ranks < 0 or rest < 0 or bool(rest) != bool(middle_ranks) or (middle_ranks and rest % middle_ranks):
        raise SplitUnknown(f"the first and last pipeline stages' layers leave {rest} layers for {max(middle_ranks, 0)} "
                           "middle stages, not an equal share each (Megatron's recent cores refuse it; the memory model "
                           "does not read it)")
    middle = rest // middle_ranks if middle_ranks else 0
    virtual = _virtual(args, None)
    per_rank = [middle] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    columns = [_chunks(count, virtual, f"pipeline rank {rank}") for rank, count in enumerate(per_rank)]
    return [[column[chunk] for column in columns] for chunk in range(virtual)]


def _even(layers: int, pp: int, args: Mapping[str, Any]) -> Grid:
    embedding = bool(args.get("account_for_embedding_in_pipeline_split"))
    loss = bool(args.get("account_for_loss_in_pipeline_split"))
    total = layers + embedding + loss
    if total % pp:
        counted = " (the embedding and the loss counted as layers)" if embedding or loss else ""
        raise SplitUnknown(f"{total} layers{counted} do not split evenly over {pp} pipeline stages (Megatron refuses "
                           "it; --decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers or "
                           "--pipeline-model-parallel-layout split unevenly)")
    per_rank = total // pp
    virtual = _virtual(args, per_rank) if pp > 1 else 1  # Megatron refuses virtual stages without a pipeline
    chunk = _chunks(per_rank, virtual, "each pipeline rank")[0]
    grid = [[chunk] * pp for _ in range(virtual)]
    if embedding:
        grid[0][0] -= 1
    if loss:
        grid[-1][-1] -= 1
    if min(min(row) for row in grid) < 0:
        raise SplitUnknown("a pipeline stage holding the embedding or the loss has no layer left for it "
                           "(Megatron refuses it)")
    return grid


def _grid(args: Mapping[str, Any], layers: int, pp: int) -> Grid:
    """The layer counts per chunk and rank the flags describe (a namespace's, or a configuration
    object's fields: TransformerConfig's names for the first and last counts). Raises SplitUnknown
    where Megatron would refuse the flags or the layout is not readable."""
    layout = args.get("pipeline_model_parallel_layout")
    first = _count(args, "decoder_first_pipeline_num_layers", "num_layers_in_first_pipeline_stage")
    last = _count(args, "decoder_last_pipeline_num_layers", "num_layers_in_last_pipeline_stage")
    accounted = [f for f in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
                 if args.get(f)]
    if layout is not None:
        if first is not None or last is not None or accounted:
            raise SplitUnknown("--pipeline-model-parallel-layout with other pipeline split flags (Megatron refuses it)")
        return _from_layout(layout, layers, pp)
    if first is not None or last is not None:
        if accounted:
            raise SplitUnknown("--decoder-first/last-pipeline-num-layers with --"
                               f"{accounted[0].replace('_', '-')} (Megatron refuses it)")
        return _from_first_last(first, last, layers, pp, args)
    return _even(layers, pp, args)


def read_split(args: Mapping[str, Any], layers: int, pp: int) -> tuple[Split, int]:
    """Each pipeline rank's decoder layers (:func:`rank_layers`) and how many model chunks (virtual
    pipeline stages) each rank holds, from one reading of the flags."""
    grid = _grid(args, layers, pp)
    return _number(grid), len(grid)


def rank_layers(args: Mapping[str, Any], layers: int, pp: int) -> Split:
    """Each pipeline rank's decoder layers for a parsed namespace (Megatron's flags) or a
    configuration object's fields. Raises SplitUnknown where Megatron would refuse the flags or the
    layout is not readable."""
    return _number(_grid(args, layers, pp))
