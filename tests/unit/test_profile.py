"""Profiles: parsing, render -> parse, precedence, guards on profile values, environment checks, and
every malformed file as one line with exit status 2 (through the plugin and through explain)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace

import pytest
from conftest import LLAMA_ARGS, MOE_ARGS, REPO, full_caps
from sandbox import clean_environ

from megatron_perf_toggles.core.decision.decide import decide
from megatron_perf_toggles.core.env import read_env
from megatron_perf_toggles.core.profile import (
    FORMAT,
    SCHEMA,
    Choice,
    Environment,
    Evidence,
    Observed,
    Profile,
    check_environment,
    parse_profile,
    render_profile,
)
from megatron_perf_toggles.core.registry import SETTING_BY_ENV, TOGGLES
from megatron_perf_toggles.errors import ProfileError
from megatron_perf_toggles.runtime import profile_file, provider
from megatron_perf_toggles.tools.surfaces import replay

MEASURED_ON = Environment(megatron="0.20.0", transformer_engine="2.20.2", torch="2.11.0", gpu="NVIDIA H200",
                          world_size=8)


def sample(**toggles) -> Profile:
    chosen = toggles or {"grad_reduce_in_bf16": False, "cross_entropy_loss_fusion": True}
    choices = {dest: Choice(value, Evidence(against=not value if isinstance(value, bool) else "native",
                                            speedup=1.036, low=1.025, high=1.047, verdict="faster", confidence=0.95,
                                            blocks=3, design="leave-one-out", loss_ratio=1.0001,
                                            loss_verdict="equivalent within +-1 %", rule="kept: removing it is slower"))
               for dest, value in chosen.items()}
    return Profile(toggles=choices, environment=MEASURED_ON, created="2026-01-02T03:04:05Z",
                   made_by="megatron-perf-toggles tune", command="torchrun --nproc-per-node 8 pretrain_gpt.py --bf16")


def text_of(data: dict) -> str:
    return json.dumps(data)


def minimal(**toggles) -> dict:
    return {"format": FORMAT, "schema": SCHEMA, "toggles": {d: {"value": v} for d, v in toggles.items()}}


# --- parsing and rendering ----------------------------------------------------------------------


def test_render_then_parse_gives_the_same_profile():
    profile = sample(grad_reduce_in_bf16=False, cross_entropy_fusion_impl="te")
    text = render_profile(profile)
    assert text.startswith("{\n  ") and text.endswith("}\n")  # indented: one fact per line for review
    assert parse_profile(text, "p.json") == replace(profile, source="p.json")


def test_an_earlier_profile_s_loss_flag_is_read_and_dropped():
    """Profiles written before the loss test carried a noise-band flag: they still load."""
    data = json.loads(render_profile(sample(grad_reduce_in_bf16=False)))
    evidence = data["toggles"]["grad_reduce_in_bf16"]["evidence"]
    del evidence["loss_verdict"]
    evidence["loss_within_noise"] = True
    parsed = parse_profile(text_of(data), "old.json").toggles["grad_reduce_in_bf16"].evidence
    assert parsed is not None and parsed.loss_verdict == "" and parsed.loss_ratio == 1.0001
    evidence["loss_verdict"] = 1
    with pytest.raises(ProfileError, match="loss_verdict"):
        parse_profile(text_of(data), "bad.json")


def test_the_confirmation_round_trips():
    from megatron_perf_toggles.core.profile import Confirmation

    profile = replace(sample(), confirmation=Confirmation(1.02, 1.01, 1.03, 0.95, "faster", 3, "kept"))
    assert parse_profile(render_profile(profile), "p.json") == replace(profile, source="p.json")
    assert "confirmation" not in json.loads(render_profile(sample()))  # nothing to confirm: no key


def test_a_hand_written_profile_needs_only_format_schema_and_values():
    profile = parse_profile(text_of(minimal(ddp_average_in_collective=False)), "p.json")
    assert profile.toggles == {"ddp_average_in_collective": Choice(False)}
    assert profile.environment == Environment()
    assert profile.reason("ddp_average_in_collective") == "profile p.json (no measurement recorded)"


def test_the_reason_quotes_the_evidence_briefly():
    profile = replace(sample(cross_entropy_loss_fusion=True), source="team/llama.json")
    assert profile.reason("cross_entropy_loss_fusion") == "profile team/llama.json: x1.036 [1.025, 1.047] vs off, faster"


def test_the_profile_setting_is_registered():
    setting = SETTING_BY_ENV["MEGATRON_PERF_TOGGLES_PROFILE"]
    assert setting.field == "profile_path" and "profile" in setting.help
    assert read_env({"MEGATRON_PERF_TOGGLES_PROFILE": "x.json"}).profile_path == "x.json"


BAD_FILES = [
    ("{not json", "not valid JSON"),
    ("[]", "must be a JSON object"),
    (text_of({**minimal(), "format": "something-else"}), 'format is "something-else"'),
    (text_of({k: v for k, v in minimal().items() if k != "format"}), "format is null"),
    (text_of({**minimal(), "schema": 99}), "schema 99 is not one this version reads"),
    (text_of({**minimal(), "toggle": {}}), "unknown key 'toggle'"),
    (text_of({**minimal(), "toggles": []}), "'toggles' must be a JSON object"),
    (text_of(minimal(warp_drive=True)), "unknown toggle 'warp_drive'"),
    (text_of(minimal(grad_reduce_in_bf16_x=True)), "did you mean 'grad_reduce_in_bf16'"),
    (text_of(minimal(grad_reduce_in_bf16="yes")), 'toggles.grad_reduce_in_bf16.value is "yes", expected true or false'),
    (text_of(minimal(grad_reduce_in_bf16=1)), "expected true or false"),
    (text_of(minimal(cross_entropy_fusion_impl="fast")), 'expected one of "te", "native"'),
    (text_of(minimal(cross_entropy_fusion_impl=True)), 'expected one of "te", "native"'),
    (text_of({**minimal(), "toggles": {"grad_reduce_in_bf16": {"valeu": True}}}), "unknown key 'valeu'"),
    (text_of({**minimal(), "toggles": {"grad_reduce_in_bf16": {}}}), "has no 'value'"),
    (text_of({**minimal(), "toggles": {"grad_reduce_in_bf16": True}}), "must be a JSON object, not bool"),
    (text_of({**minimal(), "toggles": {"grad_reduce_in_bf16": {"value": True, "evidence": {"speedup": 1.1}}}}),
     "has no 'against'"),
    (text_of({**minimal(), "toggles": {"grad_reduce_in_bf16": {"value": True, "evidence": {
        "against": False, "speedup": "fast"}}}}), 'evidence.speedup is "fast", expected a number'),
    (text_of({**minimal(), "environment": {"world_size": 0}}), "world_size is 0"),
    (text_of({**minimal(), "environment": {"gpu": 100}}), "environment.gpu is 100"),
    (text_of({**minimal(), "confirmation": {"speedup": "x"}}), 'confirmation.speedup is "x"'),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"format": "' + FORMAT + '", "schema": 1, "toggles": {}, "toggles": {"grad_reduce_in_bf16": {"value": false}}}',
     "the key 'toggles' appears twice"),
    (text_of({**minimal(), "schema": True}), "schema true is not one this version reads"),
    (text_of({**minimal(), "schema": 1.0}), "schema 1.0 is not one this version reads"),
    (text_of({**minimal(), "environment": []}), "environment must be a JSON object"),
    (text_of({**minimal(), "environment": 0}), "environment must be a JSON object"),
    (text_of({**minimal(), "environment": ""}), "environment must be a JSON object"),
    (text_of({**minimal(), "environment": False}), "environment must be a JSON object"),
    (text_of({**minimal(), "toggles": {"grad_reduce_in_bf16": {"value": True, "evidence": {"against": True}}}}),
     "evidence.against is the chosen value"),
    (text_of({**minimal(), "toggles": {"grad_reduce_in_bf16": {"value": True, "evidence": {
        "against": False, "speedup": 1.0, "low": 1.1, "high": 0.9}}}}), "evidence.low 1.1 is above"),
    (text_of({**minimal(), "confirmation": {"low": 1.1, "high": 0.9}}), "confirmation.low 1.1 is above"),
    (text_of({**minimal(), "confirmation": {"verdicts": "faster"}}), "confirmation: unknown key 'verdicts'"),
]


@pytest.mark.parametrize("text, words", BAD_FILES)
def test_every_malformed_profile_is_one_clear_error(text, words):
    with pytest.raises(ProfileError) as info:
        parse_profile(text, "bad.json")
    message = str(info.value)
    assert words in message and "MEGATRON_PERF_TOGGLES_PROFILE=bad.json" in message and "\n" not in message


def test_an_unreadable_or_binary_file_is_one_clear_error(tmp_path):
    with pytest.raises(ProfileError, match="cannot read it"):
        profile_file.load(str(tmp_path / "missing.json"))
    with pytest.raises(ProfileError, match="cannot read it"):
        profile_file.load(str(tmp_path))  # a directory
    binary = tmp_path / "p.json"
    binary.write_bytes(b"\xff\xfe\x00junk")
    with pytest.raises(ProfileError, match="not a UTF-8 text file"):
        profile_file.load(str(binary))
    huge = tmp_path / "huge.json"
    huge.write_text(text_of(minimal()) + " " * profile_file.MAX_BYTES)
    with pytest.raises(ProfileError, match="too large for a profile"):
        profile_file.load(str(huge))


def test_the_source_is_the_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "p.json").write_text(text_of(minimal(grad_reduce_in_bf16=False)))
    monkeypatch.chdir(tmp_path)
    profile = profile_file.load("p.json")
    assert profile.source == str(tmp_path / "p.json")
    assert profile.reason("grad_reduce_in_bf16").startswith(f"profile {tmp_path / 'p.json'}")


def test_a_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "p.json"
    path.write_bytes(b"\xef\xbb\xbf" + text_of(minimal(grad_reduce_in_bf16=False)).encode())
    assert profile_file.load(str(path)).toggles == {"grad_reduce_in_bf16": Choice(False)}


# --- precedence and guards ------------------------------------------------------------------------


def plan_with(profile, explicit=None, environ=None, caps=None, args=None, observed=None):
    return decide({**LLAMA_ARGS, **(args or {})}, explicit or {}, read_env(environ or {}), caps or full_caps(),
                  profile=profile, observed=observed)


@pytest.mark.parametrize("t", TOGGLES, ids=lambda t: t.dest)
def test_precedence_cli_over_env_over_profile_over_default(t):
    other = (not t.default) if t.kind == "bool" else next(c for c in t.choices if c != t.default)
    env_word = str(t.default).lower() if t.kind == "choice" else str(int(t.default))
    profile = replace(sample(**{t.dest: other}), source="p.json")
    caps = full_caps(megatron=replace(full_caps().megatron, rules=("fqr_field", "moe_rf_field")))  # the fields; no rule in the way
    model = MOE_ARGS if t.scope == "moe" else None  # a MoE toggle applies to a MoE model only

    def got(**kw):
        d = plan_with(profile, caps=caps, args=model, **kw).decisions[t.dest]
        return d.value, d.source

    assert got() == (other, "profile")
    assert plan_with(profile, caps=caps, args=model).decisions[t.dest].reason.startswith("profile p.json: x1.036")
    assert got(environ={t.env: env_word}) == (t.default, "env")
    assert got(environ={t.env: env_word}, explicit={t.dest: other}) == (other, "cli")
    assert plan_with(None, caps=caps).decisions[t.dest].source == "default"


def test_a_profile_applies_with_the_plugin_switched_off_as_set_variables_do():
    plan = plan_with(sample(grad_reduce_in_bf16=True), environ={"MEGATRON_PERF_TOGGLES": "0"})
    assert (plan.decisions["grad_reduce_in_bf16"].value, plan.decisions["grad_reduce_in_bf16"].source) == (True, "profile")
    assert plan.decisions["ddp_average_in_collective"].source == "default"


def test_guards_turn_a_profile_value_off_as_they_do_an_environment_value():
    profile = sample(fused_single_qkv_rope=True, gradient_accumulation_fusion=True)
    plan = plan_with(profile, caps=full_caps(te_fused_qkv_rope=False), args={"use_torch_fsdp2": True})
    for dest in ("fused_single_qkv_rope", "gradient_accumulation_fusion"):
        d = plan.decisions[dest]
        assert (d.value, d.source) == (False, "guard"), dest  # changed, not refused as a flag would be
        assert any(m.level == "warning" and m.text.startswith(f"{dest}: True (profile") for m in plan.messages)
    same = plan_with(None, environ={"FUSED_SINGLE_QKV_ROPE": "1"}, caps=full_caps(te_fused_qkv_rope=False))
    assert same.decisions["fused_single_qkv_rope"].value is False


def test_the_safety_net_backs_off_profile_values_too():
    from megatron_perf_toggles.runtime.safety_net import BACKED_OFF_SOURCES

    assert "profile" in BACKED_OFF_SOURCES and "env" not in BACKED_OFF_SOURCES and "cli" not in BACKED_OFF_SOURCES


# --- what the profile was measured on, against this run ------------------------------------------


def test_a_matching_environment_gives_no_line():
    here = Observed(replace(MEASURED_ON, torch="2.11.0+cu128", gpu="NVIDIA H200"))
    plan = plan_with(sample(), observed=here)
    assert not [m for m in plan.messages if m.level == "profile"]
    assert plan.profile["mismatches"] == {} and plan.profile["unchecked"] == {}


@pytest.mark.parametrize("key, here_value", [
    ("megatron", "0.19.0"), ("transformer_engine", "2.8.0"), ("transformer_engine", None), ("torch", "2.9.1"),
    ("gpu", "NVIDIA H100 80GB HBM3"), ("world_size", 64),
])
def test_each_mismatch_is_one_profile_line_and_in_the_record(key, here_value):
    here = Observed(replace(MEASURED_ON, **{key: here_value}))
    plan = plan_with(replace(sample(), source="p.json"), observed=here)
    lines = [m for m in plan.messages if m.level == "profile"]
    assert len(lines) == 1 and "p.json was measured elsewhere" in lines[0].text
    assert f"{getattr(MEASURED_ON, key)} there" in lines[0].text
    assert set(plan.profile["mismatches"]) == {key}
    assert plan.profile["mismatches"][key] == {"profile": getattr(MEASURED_ON, key), "here": here_value}


def test_what_cannot_be_known_at_plan_time_is_said_not_warned():
    here = Observed(replace(MEASURED_ON, gpu=None, world_size=None),
                    {"gpu": "no GPU visible here", "world_size": "WORLD_SIZE is not set"})
    plan = plan_with(replace(sample(), source="p.json"), observed=here)
    (line,) = [m.text for m in plan.messages if m.level == "profile"]
    assert "measured elsewhere" not in line and "not checked, unknown at plan time" in line
    assert "GPU (no GPU visible here)" in line
    assert plan.profile["mismatches"] == {} and set(plan.profile["unchecked"]) == {"gpu", "world_size"}


def test_facts_the_profile_did_not_record_are_not_compared():
    check = check_environment(Environment(megatron="0.20"), Environment(megatron="0.20.1", torch="9"), {"gpu": "x"})
    assert check.mismatches == {} and check.unchecked == {}
    assert set(check_environment(Environment(megatron="0.20"), Environment(megatron="0.19.0"), {}).mismatches) == {
        "megatron"}


def test_observed_world_size_and_gpu_by_mode(monkeypatch):
    from megatron_perf_toggles.runtime import profile_file as pf

    monkeypatch.setattr(pf, "gpu_name_here", lambda: None)
    caps = full_caps(torch_version="2.11.0")
    assert pf.observed(caps, {"WORLD_SIZE": "16"}, "run").environment.world_size == 16
    assert pf.observed(caps, {}, "run").environment.world_size == 1  # Megatron's reading of no WORLD_SIZE
    assert "world_size" in pf.observed(caps, {}, "plan").unknown
    assert "gpu" in pf.observed(caps, {}, "run").unknown
    monkeypatch.setattr(pf, "gpu_name_here", lambda: "NVIDIA H200")
    assert pf.observed(caps, {}, "run").environment.gpu == "NVIDIA H200"
    assert "gpu" in pf.observed(caps, {}, "plan").unknown  # explain never asks this machine's GPU
    planned = full_caps(gpu_name="NVIDIA H100 80GB HBM3", gpu_source="--gpu h100")
    assert pf.observed(planned, {}, "plan").environment.gpu == "NVIDIA H100 80GB HBM3"


def test_a_plan_does_not_check_the_planning_machines_torch_and_te_unless_assumed(monkeypatch):
    from megatron_perf_toggles.runtime import profile_file as pf

    monkeypatch.setattr(pf, "gpu_name_here", lambda: None)
    caps = full_caps(torch_version="2.11.0", te_version="2.20.2")
    plan = pf.observed(caps, {}, "plan")
    assert {"torch", "transformer_engine"} <= set(plan.unknown)
    assert "transformer_engine" not in pf.observed(replace(caps, assumed=("te_version",)), {}, "plan").unknown
    assert not {"torch", "transformer_engine"} & set(pf.observed(caps, {}, "run").unknown)
    check = check_environment(MEASURED_ON, plan.environment, plan.unknown)
    assert not {"torch", "transformer_engine"} & set(check.mismatches)  # no "measured elsewhere" from a laptop


def test_the_gpu_is_not_probed_when_the_profile_records_none(monkeypatch):
    from megatron_perf_toggles.runtime import profile_file as pf

    asked = []
    monkeypatch.setattr(pf, "gpu_name_here", lambda: asked.append(1) or "NVIDIA H200")
    pf.observed(full_caps(), {}, "run", probe_gpu=False)
    assert not asked
    assert pf.observed(full_caps(), {}, "run").environment.gpu == "NVIDIA H200" and asked


# --- through the plugin ------------------------------------------------------------------------------


def write_profile(tmp_path, profile=None) -> str:
    path = tmp_path / "profile.json"
    path.write_text(render_profile(profile or sample()))
    return str(path)


def test_the_provider_announces_the_profile_once_on_rank_0_and_records_it(tmp_path, capsys, monkeypatch):
    from megatron_perf_toggles.runtime.controller import Controller

    monkeypatch.setattr(profile_file, "gpu_name_here", lambda: "NVIDIA H200")
    path = write_profile(tmp_path, replace(sample(), environment=replace(MEASURED_ON, megatron="0.13.0")))
    environ = {"MEGATRON_PERF_TOGGLES_PROFILE": path, "RANK": "0", "WORLD_SIZE": "8"}
    caps = full_caps(torch_version="2.11.0")  # Megatron 0.20.0, TE 2.20.2: only Megatron differs

    def attach(environ):
        parser = replay.parser_from_surface(replay.load_surface("main"))
        provider.attach(parser, controller=Controller(environ, mode="run", capabilities=caps))
        return parser

    parser = attach(environ)
    args = parser.parse_args(["--bf16", "--position-embedding-type", "rope", "--tensorboard-dir", str(tmp_path / "tb")])
    out = capsys.readouterr().out.splitlines()
    assert args.perf_toggles["grad_reduce_in_bf16"]["source"] == "profile" and args.grad_reduce_in_bf16 is False
    profile_lines = [ln for ln in out if ln.startswith("[perf-toggles] profile:")]
    assert len(profile_lines) == 1 and "(Megatron 0.13.0 there, 0.20.0 here)" in profile_lines[0]
    record = json.loads((tmp_path / "tb" / "bf16" / "perf_toggles.json").read_text())
    assert record["profile"]["path"] == path and "megatron" in record["profile"]["mismatches"]
    assert record["profile"]["measured_on"]["gpu"] == "NVIDIA H200"
    attach({**environ, "RANK": "3"}).parse_args(["--bf16"])
    assert capsys.readouterr().out == ""  # other ranks decide the same, and print nothing


def test_help_says_a_toggle_default_comes_from_the_profile(tmp_path, capsys):
    path = write_profile(tmp_path)  # grad_reduce_in_bf16 off, cross_entropy_loss_fusion on
    parser = replay.parser_from_surface(replay.load_surface("main"))
    provider.attach(parser, environ={"MEGATRON_PERF_TOGGLES_PROFILE": path, "CROSS_ENTROPY_LOSS_FUSION": "0"},
                    announce=False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    # grad_reduce_in_bf16 (argparse may wrap the path at its hyphens: its end is enough)
    assert "off (from the profile " in out and "profile.json)" in out
    assert "off (from CROSS_ENTROPY_LOSS_FUSION)" in out  # env over profile, as the plan decides
    assert "on (plugin default; env GRADIENT_ACCUMULATION_FUSION)" in out  # not in the profile


PLUGIN_SNIPPET = (
    "from megatron_perf_toggles.runtime import provider; from megatron_perf_toggles.tools.surfaces import replay; "
    "p = replay.parser_from_surface(replay.load_surface('main')); provider.attach(p, announce=False); "
    "p.parse_args(['--bf16']); print('parsed')"
)


def _clean_env(**extra):
    base = clean_environ(drop=("PYTHONPATH",))
    return {**base, "PYTHONPATH": str(REPO), **extra}


NESTED = next(bad for bad in BAD_FILES if bad[1] == "nested too deeply")


@pytest.mark.parametrize("text, words", [BAD_FILES[0], BAD_FILES[2], BAD_FILES[4], BAD_FILES[7], BAD_FILES[9],
                                          BAD_FILES[11], NESTED, (None, "cannot read it")])
@pytest.mark.parametrize("entry", ["plugin", "explain"])
def test_a_bad_profile_stops_the_plugin_and_explain_with_one_line(tmp_path, text, words, entry):
    path = tmp_path / "profile.json"
    if text is not None:
        path.write_text(text)
    argv = ["-c", PLUGIN_SNIPPET] if entry == "plugin" else ["-m", "megatron_perf_toggles", "explain"]
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env=_clean_env(MEGATRON_PERF_TOGGLES_PROFILE=str(path)))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[perf-toggles] error: MEGATRON_PERF_TOGGLES_PROFILE=")
    assert words in lines[0] and "Traceback" not in proc.stderr and "parsed" not in proc.stdout


def test_explain_shows_profile_values_and_the_check(tmp_path):
    path = write_profile(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "megatron_perf_toggles", "explain", "--gpu", "h100"],
                          capture_output=True, text=True, cwd=REPO, timeout=120,
                          env=_clean_env(MEGATRON_PERF_TOGGLES_PROFILE=path))
    assert proc.returncode == 0, proc.stderr
    row = next(ln for ln in proc.stdout.splitlines() if ln.startswith("grad_reduce_in_bf16 "))
    assert row.split()[1:3] == ["off", "profile"] and "x1.036 [1.025, 1.047]" in row
    assert f"Profile:  {path}: 2 toggle(s)" in proc.stdout
    profile_line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("profile: "))
    assert "GPU NVIDIA H200 there, NVIDIA H100 80GB HBM3 here" in profile_line  # planned with --gpu: known
    assert "world size" not in profile_line  # the built-in example plans its world, 8, as the profile's
    data = json.loads(subprocess.run(
        [sys.executable, "-m", "megatron_perf_toggles", "explain", "--json"], capture_output=True, text=True,
        cwd=REPO, timeout=120, env=_clean_env(MEGATRON_PERF_TOGGLES_PROFILE=path)).stdout)
    assert data["decisions"]["grad_reduce_in_bf16"]["source"] == "profile"
    assert "gpu" in data["profile"]["unchecked"] and "gpu" not in data["profile"]["mismatches"]


def test_doctor_shows_profile_values_and_checks_this_machine(tmp_path):
    """doctor looks at this machine: a profile's values show in its table, and its versions are
    compared with this machine's (Megatron's version here: none found, so said, not warned)."""
    path = write_profile(tmp_path, replace(sample(), environment=replace(MEASURED_ON, torch="1.0.0")))
    env = _clean_env(MEGATRON_PERF_TOGGLES_PROFILE=path)
    proc = subprocess.run([sys.executable, "-m", "megatron_perf_toggles", "doctor"], capture_output=True, text=True,
                          cwd=REPO, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"profile:            {path}: 2 toggle(s)" in proc.stdout
    row = next(ln for ln in proc.stdout.splitlines() if ln.startswith("grad_reduce_in_bf16 "))
    assert row.split()[1] == "off"
    has_torch = importlib.util.find_spec("torch") is not None
    assert ("torch 1.0.0 there, " in proc.stdout) is has_torch  # this machine is checked, where it has torch
    data = json.loads(subprocess.run([sys.executable, "-m", "megatron_perf_toggles", "doctor", "--json"],
                                     capture_output=True, text=True, cwd=REPO, timeout=120, env=env).stdout)
    assert data["toggles_here"]["grad_reduce_in_bf16"]["source"] == "profile"
    assert "world_size" in data["profile"]["unchecked"]  # doctor is no job: no world size to compare
    assert "torch" in data["profile"]["mismatches" if has_torch else "unchecked"]


def test_explain_help_names_the_profile_variable():
    proc = subprocess.run([sys.executable, "-m", "megatron_perf_toggles", "explain", "--help"], capture_output=True,
                          text=True, cwd=REPO, timeout=120, env=_clean_env())
    assert "MEGATRON_PERF_TOGGLES_PROFILE" in proc.stdout
