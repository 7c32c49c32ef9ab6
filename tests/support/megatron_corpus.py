"""The real-command-line corpus: Megatron-LM's own functional-test configurations, as command lines.

Every tree in MEGATRON_LM_TREES ships ``tests/functional_tests/test_cases/<family>/<case>/model_config.yaml``
whose ``MODEL_ARGS`` mapping Megatron's CI turns into a training command line. This module finds
those configs, keeps the ones pretrain_gpt.py runs, turns each into argv the way the CI does, and
runs every tree's corpus (or fuzz samples) as one batch on the tree's worker (tests/tree_driver.py,
tests/corpus_cases.py).

How a config becomes argv (Megatron's CI, tests/functional_tests/shell_test_utils/_run_training.sh,
which is not part of source exports): ``${VAR}`` placeholders are substituted from the environment
(envsubst), ``ENV_VARS`` are exported, and each ``MODEL_ARGS`` entry becomes words with yq's text
of the value: ``true`` a bare flag; an empty string drops the entry; anything else, ``false`` and
``null`` included, is ``KEY VALUE`` (CI passes ``false`` on as a word; no GPT-family config has one);
a ``[a, b]`` value is split into words. Then, for a CPU box without data, this module:

- points every path placeholder at a fresh temporary directory (``${REPEAT}`` becomes 1);
- replaces the data and tokenizer arguments by ``--mock-data --tokenizer-type NullTokenizer
  --vocab-size 32000`` (validate_args never opens tokenizer files, and NullTokenizer only needs a
  vocab size; ``--data-path``, ``--vocab-file``, ``--merge-file``, ``--tokenizer-model`` and the
  like are dropped);
- sets ``WORLD_SIZE`` to the least common multiple of 8 (the GPUs of one CI node) and the
  config's model-parallel layouts (TP*PP*CP and ETP*EP*PP).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import tree_driver
import yaml

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parents[1]
TREES_ENV = "MEGATRON_LM_TREES"

# Model families pretrain_gpt.py trains (GPT, MoE, Mixtral/DeepSeek proxies). Other families run
# other entry points: bert, t5 (their own pretrain scripts), hybrid and nemotron (Mamba hybrids),
# multimodal-llava and mimo (multimodal examples), gpt-nemo (NeMo), common (checkpoint converter,
# perf harness).
GPT_FAMILIES = ("gpt", "moe", "mixtral")
# Cases inside those families that CI runs through another script (inference examples, RL
# training, ModelOpt distillation), recognised by their directory name.
OTHER_SCRIPT_CASES = {
    "inference": "inference example scripts (static/dynamic/offline inference, inference server)",
    "grpo": "reinforcement-learning training script (GRPO)",
    "modelopt": "ModelOpt post-training script",
}

# Placeholders the CI substitutes, and what they become here (directories are created empty).
PATH_PLACEHOLDERS = ("CHECKPOINT_SAVE_PATH", "CHECKPOINT_LOAD_PATH", "TENSORBOARD_PATH", "DATA_CACHE_PATH",
                     "OUTPUT_PATH", "WANDB_SAVE_PATH", "INFERENCE_OUTPUT_PATH", "CHECKPOINT_DIR")
VALUE_PLACEHOLDERS = {"REPEAT": "1", "WANDB_EXPERIMENT": "corpus", "DATA_PATH": "/nonexistent/data",
                      "DATA_BLEND": "/nonexistent/data"}
# Data and tokenizer arguments, replaced by mock data and a NullTokenizer; each is dropped with
# its value words. The fill-in-the-middle dataset (--fim-*) reads real data: Megatron refuses it
# with mock data.
DATA_ARGS = frozenset({
    "--data-path", "--train-data-path", "--valid-data-path", "--test-data-path", "--data-args-path",
    "--per-split-data-args-path", "--vocab-file", "--merge-file", "--tokenizer-model", "--tokenizer-type",
    "--vocab-size", "--mock-data", "--tiktoken-pattern", "--legacy-tokenizer",
})
DATA_ARG_PREFIXES = ("--fim-",)
MOCK_DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000"]
CI_GPUS_PER_NODE = 8


trees, tree_id = tree_driver.trees, tree_driver.tree_id


# --- YAML the way yq reads it: scalars keep their text, only true/false/null are typed -----------


class _TextLoader(yaml.SafeLoader):
    """Keeps ``3e-4``, ``1.0``, ``0.10`` as written (yq prints the scalar's own text)."""


_TextLoader.yaml_implicit_resolvers = {}
_TextLoader.add_implicit_resolver("tag:yaml.org,2002:merge", re.compile(r"^(?:<<)$"), ["<"])
_TextLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                  list("tTfF"))
_TextLoader.add_implicit_resolver("tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"),
                                  ["~", "n", "N", ""])


def load_config(path: Path) -> dict[str, Any]:
    return yaml.load(path.read_text(encoding="utf-8"), Loader=_TextLoader) or {}


def _yq_text(value: Any) -> str:
    if value is False:
        return "false"
    if value is None:
        return "null"
    return str(value)


def ci_words(model_args: dict[str, Any]) -> list[str]:
    """MODEL_ARGS -> argv words, as the CI's training wrapper builds them."""
    words: list[str] = []
    for key, value in model_args.items():
        if value is True:
            words.append(key)
        elif isinstance(value, list):
            words.extend([key, *(_yq_text(v) for v in value)])
        elif value == "":
            continue
        else:
            text = _yq_text(value).strip()
            if re.fullmatch(r"\[[^]]+\]", text):
                words.extend([key, *text[1:-1].split()])
            else:
                words.extend([key, text])  # a value with spaces stays one word (the CI quotes it)
    return words


def substitute(text: str, values: dict[str, str]) -> str:
    """envsubst: ``${VAR}`` / ``$VAR`` of a set variable is replaced, others stay as written."""
    def repl(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return values.get(name, match.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, text)


def _drop_data_args(words: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(words):
        key = words[i].split("=", 1)[0]
        if key in DATA_ARGS or key.startswith(DATA_ARG_PREFIXES):
            i += 1
            while i < len(words) and not words[i].startswith("--"):  # its value(s), nargs='*' included
                i += 1
            continue
        out.append(words[i])
        i += 1
    return out


def _size(words: list[str], flag: str, default: int | None) -> int | None:
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            try:
                return int(words[i + 1])
            except ValueError:
                return default
        if word.startswith(flag + "="):
            return int(word.split("=", 1)[1])
    return default


def world_size(words: list[str], gpus: int = CI_GPUS_PER_NODE) -> int:
    """The least common multiple of one CI node's GPUs and the config's model-parallel layouts."""
    tp = _size(words, "--tensor-model-parallel-size", 1) or 1
    pp = _size(words, "--pipeline-model-parallel-size", 1) or 1
    cp = _size(words, "--context-parallel-size", 1) or 1
    ep = _size(words, "--expert-model-parallel-size", 1) or 1
    etp = _size(words, "--expert-tensor-parallel-size", tp) or tp
    return math.lcm(gpus, tp * pp * cp, etp * ep * pp)


def command_line(model_args: dict[str, Any], env_vars: dict[str, Any], root: Path) -> tuple[list[str], dict[str, str],
                                                                                                list[str]]:
    """(argv, environment, directories to create) for one config under the temporary ``root``."""
    values = dict(VALUE_PLACEHOLDERS)
    dirs = []
    for name in PATH_PLACEHOLDERS:
        values[name] = str(root / name.lower())
        dirs.append(values[name])
    words = [substitute(w, values) for w in ci_words(model_args)]
    words = _drop_data_args(words) + MOCK_DATA
    env = {str(k): substitute(_yq_text(v), values) for k, v in (env_vars or {}).items()}
    env["WORLD_SIZE"] = str(world_size(words))
    env.setdefault("RANK", "0")
    env.setdefault("LOCAL_RANK", "0")
    return words, env, dirs


# --- the corpus of one tree -----------------------------------------------------------------------


def find_configs(tree: str) -> tuple[list[Path], Counter[str]]:
    """(configs pretrain_gpt.py runs, excluded counts by reason)."""
    base = Path(tree) / "tests" / "functional_tests" / "test_cases"
    kept: list[Path] = []
    excluded: Counter[str] = Counter()
    for path in sorted(base.glob("*/*/model_config.yaml")):
        family, case = path.parts[-3], path.parts[-2]
        if family not in GPT_FAMILIES:
            excluded[f"family {family}: not a pretrain_gpt.py model"] += 1
            continue
        word = next((w for w in OTHER_SCRIPT_CASES if w in case), None)
        if word:
            excluded[f"{family}/*{word}*: {OTHER_SCRIPT_CASES[word]}"] += 1
            continue
        if "MODEL_ARGS" not in (load_config(path) or {}):
            excluded[f"{family}: no MODEL_ARGS"] += 1
            continue
        kept.append(path)
    return kept, excluded


def corpus_cases(tree: str, work: Path) -> tuple[list[dict[str, Any]], Counter[str], int]:
    configs, excluded = find_configs(tree)
    base = Path(tree) / "tests" / "functional_tests" / "test_cases"
    cases = []
    for i, path in enumerate(configs):
        cfg = load_config(path)
        argv, env, dirs = command_line(cfg["MODEL_ARGS"], cfg.get("ENV_VARS") or {}, work / f"c{i}")
        cases.append({"id": str(path.relative_to(base).parent), "argv": argv, "env": env, "dirs": dirs})
    total = len(configs) + sum(excluded.values())
    return cases, excluded, total


# --- running on the trees' workers ----------------------------------------------------------------


class Batch:
    """A suite of one ``corpus`` batch per tree: ``plan(tree, work)`` gives (the batch, what the
    judging needs besides the results); ``get(tree)`` the worker's payload with that added."""

    def __init__(self, name: str, plan: Any, owner: str, weight: Any = None) -> None:
        self.plan = plan
        self.extras: dict[str, dict[str, Any]] = {}
        self.name = tree_driver.SESSION.suite(name, self._build, owners=(owner,), weight=weight)

    def _build(self, tree: str, work: Path) -> list[dict[str, Any]]:
        batch, self.extras[str(Path(tree).resolve())] = self.plan(tree, work)
        te_version = tree_driver.SESSION.environ.get("PTT_TE_VERSION", "")
        return [{"tree": tree, "cases": [{"name": self.name, "kind": "corpus", "te_version": te_version, **batch}]}]

    def get(self, tree: str) -> dict[str, Any]:
        found = tree_driver.SESSION.results(self.name, tree)[self.name]
        assert "driver_error" not in found, found["driver_error"]
        payload = {**found, **self.extras[str(Path(tree).resolve())]}
        if "samples" in found:
            payload["cases"] = found["samples"]
        return payload


def _corpus_plan(tree: str, work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    cases, excluded, total = corpus_cases(tree, work)
    return {"cases": cases}, {"found": total, "excluded": dict(excluded), "cases": cases}


def _corpus_size(tree: str) -> float:
    """The tree's functional-test configs, found without reading them: the corpus's work there."""
    return float(sum(1 for _ in (Path(tree) / "tests" / "functional_tests" / "test_cases").glob("*/*/model_config.yaml")))


CORPUS = Batch("corpus", _corpus_plan, "test_megatron_corpus", weight=_corpus_size)


# --- judging --------------------------------------------------------------------------------------


def requested_toggles(argv: list[str]) -> dict[str, Any]:
    """Toggle values the command line sets explicitly (last word wins, as in argparse)."""
    from megatron_perf_toggles.core.registry import TOGGLES

    out: dict[str, Any] = {}
    for i, word in enumerate(argv):
        flag, eq, inline = word.partition("=")
        for t in TOGGLES:
            if t.kind == "bool" and flag in (t.flag, t.off_flag) and not eq:
                out[t.dest] = flag == t.flag
            elif t.kind == "choice" and flag == t.flag:
                value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else None)
                if value is not None:
                    out[t.dest] = value
    return out


def explicit_problems(case: dict[str, Any], a: dict[str, Any], result: dict[str, Any]) -> list[str]:
    """An explicit toggle flag keeps the command line's value, with source cli; any other setting
    the command line names ends as it ends in stock Megatron."""
    from megatron_perf_toggles.core.registry import TOGGLES

    toggle_dests = {t.dest for t in TOGGLES}
    problems = []
    for dest, stock in (a.get("explicit") or {}).items():
        mine = (result.get("explicit") or {}).get(dest)
        if dest not in toggle_dests and mine != stock:
            problems.append(f"explicit {dest}: ends as {mine} with the plugin, as {stock} in stock Megatron")
    records = result.get("perf_toggles") or {}
    for dest, value in requested_toggles(case["argv"]).items():
        rec = records.get(dest)
        if rec is None:
            problems.append(f"{dest}: no decision recorded for an explicit {value!r}")
            continue
        if rec.get("source") != "cli" or rec.get("value") != value:
            problems.append(f"{dest}: explicit {value!r} became {rec.get('value')!r} (source {rec.get('source')}; "
                            f"{rec.get('reason')})")
        final_a, final = (a.get("final") or {}).get(dest), (result.get("final") or {}).get(dest)
        if final != final_a:
            problems.append(f"{dest}: explicit {value!r} ends as {final!r} after validate_args, stock ends as {final_a!r}")
    return problems


def capability_refusal(res: dict[str, Any], mode: str) -> bool:
    """C2 (nothing installed) may stop with the plugin's own one line where the same command line
    holds on a GPU box (C1): the refusal rests on what this machine lacks (APEX, TE), where stock
    Megatron would accept the arguments and fail at the first step instead."""
    r, capable = res["modes"].get(mode) or {}, res["modes"].get("C1") or {}
    return mode == "C2" and plugin_refusal(r) and bool(capable.get("ok"))


def judge(payload: dict[str, Any]) -> dict[str, Any]:
    """Counts for the summary line and the failures, for one tree's corpus run."""
    cases = {c["id"]: c for c in payload["cases"]}
    stats: dict[str, Any] = {"found": payload["found"], "run": len(payload["results"]), "accepted": 0, "rejected": 0,
                             "held": Counter(), "guards": 0, "net": 0, "reasons": Counter(), "failures": [],
                             "capability_refusals": 0}
    for res in payload["results"]:
        cid = res["id"]
        if "driver_error" in res:
            stats["failures"].append((cid, "driver", res["driver_error"]))
            continue
        a = res["modes"]["A"]
        if not a["ok"]:
            stats["rejected"] += 1
            stats["reasons"][_reason(a["error"])] += 1
            continue
        stats["accepted"] += 1
        by_net, held_all = False, True
        for mode in ("B", "C1", "C2"):
            r = res["modes"].get(mode)
            if r is None:
                continue
            problems = []
            if not r["ok"] and capability_refusal(res, mode):
                stats["held"][mode] += 1
                stats["capability_refusals"] += 1
                continue
            if not r["ok"]:
                problems.append(f"rejected at {r['stage']}: {r['error']}")
            elif mode == "B" and r.get("diff"):
                problems.append("namespace differs from stock: " + "; ".join(r["diff"][:6]))
            if r.get("perf_toggles") is not None:
                problems += explicit_problems(cases[cid], a, r)
            if problems:
                stats["failures"].extend((cid, mode, p) for p in problems)
                held_all = False
            else:
                stats["held"][mode] += 1
                by_net = by_net or bool(r.get("net"))
        if held_all:
            stats["net" if by_net else "guards"] += 1
    return stats


def _reason(error: str) -> str:
    """Group stock rejections: the error line without the config's own numbers and paths."""
    text = re.sub(r" \((megatron|megatron_perf_toggles)/[^)]*\)$", "", error)
    text = re.sub(r"(?<![\w.])/[^\s,'\"]+", "PATH", text)
    text = re.sub(r"\{.*\}", "{...}", text)
    return re.sub(r"\b\d+(\.\d+)?\b", "N", text)[:200]


def summary_lines(tree: str, payload: dict[str, Any], stats: dict[str, Any]) -> list[str]:
    held = stats["held"]
    lines = [
        f"{tree_id(tree)} (core {payload['version']}): configs found {stats['found']}, run {stats['run']}, "
        f"stock accepted {stats['accepted']}, stock rejected {stats['rejected']}; held in B {held['B']}, "
        f"C1 {held['C1']}, C2 {held['C2']} of {stats['accepted']} (C2 counts {stats['capability_refusals']} one-line "
        f"refusals for a capability this machine lacks, each held in C1); held in all modes by guards "
        f"{stats['guards']}, by the run-time net {stats['net']}; {payload['seconds']:.0f} s",
    ]
    for reason, count in sorted(payload["excluded"].items()):
        lines.append(f"    excluded {count}: {reason}")
    for reason, count in stats["reasons"].most_common():
        lines.append(f"    stock rejected {count}: {reason}")
    return lines


# --- the fuzz suite -------------------------------------------------------------------------------

FUZZ_SEED_ENV, FUZZ_COUNT_ENV = "PTT_FUZZ_SEED", "PTT_FUZZ_COUNT"
FUZZ_SEED, FUZZ_COUNT = 20251130, 100  # CI: a fixed seed; 100 samples keep a tree under a minute


def fuzz_params() -> tuple[int, int]:
    environ = tree_driver.SESSION.environ  # as the session started (builds run beside the tests)
    return (int(environ.get(FUZZ_SEED_ENV, "") or FUZZ_SEED), int(environ.get(FUZZ_COUNT_ENV, "") or FUZZ_COUNT))


def _fuzz_plan(tree: str, work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    seed, count = fuzz_params()
    return {"fuzz": {"seed": seed, "count": count, "workdir": str(work / "samples")}}, {"seed": seed, "count": count}


FUZZ = Batch("fuzz", _fuzz_plan, "test_megatron_fuzz")


def plugin_refusal(result: dict[str, Any]) -> bool:
    """The plugin's own one-line error: SystemExit(2) with a line that starts with its prefix."""
    return result.get("exit_code") == 2 and str(result.get("error", "")).startswith("SystemExit(2): [perf-toggles]")


def _explicit_flag_words(argv: list[str]) -> list[str]:
    """The toggle flags a sample sets explicitly, as a refusal of one of them would name it."""
    from megatron_perf_toggles.core.registry import BY_DEST

    return [" ".join(BY_DEST[dest].flag_for(value)) for dest, value in requested_toggles(argv).items()]


def judge_fuzz(payload: dict[str, Any]) -> dict[str, Any]:
    samples = {c["id"]: c for c in payload["cases"]}
    stats: dict[str, Any] = {"samples": len(payload["results"]), "accepted": 0, "held": 0, "refused": 0, "net": 0,
                             "failures": []}
    for res in payload["results"]:
        sample = samples[res["id"]]
        if "driver_error" in res:
            stats["failures"].append({"sample": sample, "errors": [f"driver: {res['driver_error']}"]})
            continue
        a = res["modes"]["A"]
        if not a["ok"]:
            continue
        stats["accepted"] += 1
        explicit_flags = _explicit_flag_words(sample["argv"])
        errors, refused, net = [], False, False
        for mode in ("B", "C1", "C2"):
            r = res["modes"].get(mode)
            if r is None:
                continue
            if not r["ok"]:
                refusing_explicit = plugin_refusal(r) and any(w in str(r.get("error", "")) for w in explicit_flags)
                if refusing_explicit or capability_refusal(res, mode):
                    refused = True
                    continue
                errors.append(f"[{mode}] rejected at {r['stage']}: {r['error']}")
                continue
            if mode == "B" and r.get("diff"):
                errors.append("[B] namespace differs from stock: " + "; ".join(r["diff"][:6]))
            errors += [f"[{mode}] {p}" for p in explicit_problems(sample, a, r)]
            net = net or bool(r.get("net"))
        if errors:
            stats["failures"].append({"sample": sample, "errors": errors})
        else:
            stats["held"] += 1
            stats["refused"] += int(refused)
            stats["net"] += int(net)
    return stats


def fuzz_summary(tree: str, payload: dict[str, Any], stats: dict[str, Any]) -> str:
    return (f"{tree_id(tree)} (core {payload['version']}): fuzz seed {payload['seed']}, samples {stats['samples']}, "
            f"stock accepted {stats['accepted']}, held {stats['held']} (of which refused with the plugin's own error "
            f"for an explicit toggle or a capability missing here {stats['refused']}, held by the run-time net "
            f"{stats['net']}), "
            f"failed {len(stats['failures'])}; {payload['seconds']:.0f} s")


def fuzz_failure_text(tree: str, payload: dict[str, Any], failures: list[dict[str, Any]]) -> str:
    lines = [f"{len(failures)} fuzz failure(s) on {tree_id(tree)}; reproduce with "
             f"{FUZZ_SEED_ENV}={payload['seed']} {FUZZ_COUNT_ENV}={payload['count']} {TREES_ENV}={tree}"]
    for f in failures[:25]:
        s = f["sample"]
        env = " ".join(f"{k}={v}" for k, v in sorted(s["env"].items()))
        lines.append(f"- {s['id']}: {env} pretrain_gpt.py {' '.join(s['argv'])}")
        lines += [f"    {e}" for e in f["errors"]]
    if len(failures) > 25:
        lines.append(f"... and {len(failures) - 25} more")
    return "\n".join(lines)
