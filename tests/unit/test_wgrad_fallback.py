"""The APEX fused-wgrad stand-in: contract on CPU tensors, dispatch, installation, policy."""

from __future__ import annotations

import sys
import types

import pytest
from conftest import LLAMA_ARGS, full_caps

from megatron_perf_toggles.core.decision.decide import decide
from megatron_perf_toggles.core.env import read_env
from megatron_perf_toggles.runtime import wgrad_fallback

torch = pytest.importorskip("torch", reason="torch is not installed: the CPU GEMM checks need it")


def _reference(x, dy, g0):
    return g0.double() + dy.double().reshape(-1, dy.shape[-1]).t() @ x.double().reshape(-1, x.shape[-1])


@pytest.mark.parametrize("shape", [(64, 48), (8, 4, 48)])  # 2-D and Megatron's [s, b, h]
def test_fp32_buffer_accumulates_over_steps(shape):
    gen = torch.Generator().manual_seed(0)
    out = 32
    g = torch.randn(out, shape[-1], generator=gen)
    ref = g.double().clone()
    for _ in range(4):
        x = torch.randn(*shape, generator=gen).to(torch.bfloat16)
        dy = torch.randn(*shape[:-1], out, generator=gen).to(torch.bfloat16)
        ref = _reference(x, dy, ref)
        wgrad_fallback.wgrad_gemm_accum_fp32(x, dy, g)
    rel = ((g.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-5 and g.dtype == torch.float32


def test_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(48, 16, generator=gen).to(torch.bfloat16).t()  # [16, 48], a transposed view
    dy = torch.randn(32, 16, generator=gen).to(torch.bfloat16).t()
    assert not x.is_contiguous()
    g = torch.zeros(32, 48)
    wgrad_fallback.wgrad_gemm_accum_fp32(x, dy, g)
    assert torch.allclose(g.double(), _reference(x, dy, torch.zeros(32, 48)), rtol=1e-5, atol=1e-5)


def test_bf16_buffer_within_bf16_rounding():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(128, 64, generator=gen).to(torch.bfloat16)
    dy = torch.randn(128, 32, generator=gen).to(torch.bfloat16)
    g = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
    ref = _reference(x, dy, g)
    wgrad_fallback.wgrad_gemm_accum_fp16(x, dy, g)
    assert g.dtype == torch.bfloat16
    rel = ((g.double() - ref).abs() / ref.abs().clamp_min(1e-3)).max().item()
    assert rel < 2 ** -7  # bf16 keeps 8 significant bits


def test_every_element_written():
    x = torch.ones(4, 3, dtype=torch.bfloat16)
    dy = torch.ones(4, 5, dtype=torch.bfloat16)
    g = torch.full((5, 3), float("nan"))
    g.zero_()
    wgrad_fallback.wgrad_gemm_accum_fp32(x, dy, g)
    assert torch.equal(g, torch.full((5, 3), 4.0))


def test_install_never_replaces_real_apex(monkeypatch):
    real = types.ModuleType(wgrad_fallback.MODULE_NAME)
    monkeypatch.setitem(sys.modules, wgrad_fallback.MODULE_NAME, real)
    assert wgrad_fallback.activate() == []
    assert sys.modules[wgrad_fallback.MODULE_NAME] is real


def test_install_patches_megatron_sites(monkeypatch):
    site = types.ModuleType("megatron.core.tensor_parallel.layers")
    site._grad_accum_fusion_available = False
    monkeypatch.setitem(sys.modules, "megatron.core.tensor_parallel.layers", site)
    monkeypatch.delitem(sys.modules, wgrad_fallback.MODULE_NAME, raising=False)
    patched = wgrad_fallback.activate()
    assert site._grad_accum_fusion_available is True
    assert wgrad_fallback.is_fallback(site.fused_weight_gradient_mlp_cuda)
    assert "megatron.core.tensor_parallel.layers.fused_weight_gradient_mlp_cuda" in patched
    monkeypatch.delitem(sys.modules, wgrad_fallback.MODULE_NAME)


@pytest.mark.parametrize(("path", "assumed", "usable", "goes_in"), [
    ("fallback", False, False, True),  # detected here: the plan's choice stands
    ("fallback", True, True, True),
    ("fallback", True, False, False),  # only assumed, and it cannot run here
    ("apex", False, True, False),
    ("off", False, True, False),
    ("missing", False, True, False),
])
def test_a_run_installs_the_fallback_where_its_plan_chose_it(monkeypatch, path, assumed, usable, goes_in):
    """The one rule the controller's apply and the layer check both follow (install_for)."""
    calls = []
    monkeypatch.setattr(wgrad_fallback, "usable", lambda: (usable, "why"))
    monkeypatch.setattr(wgrad_fallback, "activate", lambda: calls.append(1) or ["here"])
    assert wgrad_fallback.install_for(path, assumed) == (["here"] if goes_in else [])
    assert calls == ([1] if goes_in else [])


def test_usable_follows_the_device():
    ok, why = wgrad_fallback.usable()
    has_dtype_out = hasattr(torch.ops.aten.addmm, "dtype_out")
    assert ok == (torch.cuda.is_available() and has_dtype_out)
    if not torch.cuda.is_available():
        assert "device" in why


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here: bench/wgrad_gpu.py covers the CUDA path")
def test_cuda_path_matches_float64():
    g = torch.randn(256, 512, device="cuda")
    x = torch.randn(1024, 512, device="cuda").to(torch.bfloat16)
    dy = torch.randn(1024, 256, device="cuda").to(torch.bfloat16)
    ref = g.double() + dy.double().t() @ x.double()
    wgrad_fallback.wgrad_gemm_accum_fp32(x, dy, g)
    assert ((g.double() - ref).norm() / ref.norm()).item() < 1e-5


def _plan(caps, **env):
    return decide(dict(LLAMA_ARGS), {}, read_env({k: str(v) for k, v in env.items()}), caps)


def test_policy_fallback_keeps_fusion_on():
    plan = _plan(full_caps(apex_fused_wgrad=False, wgrad_fallback=True))
    d = plan.decisions["gradient_accumulation_fusion"]
    assert d.value is True and d.source == "default" and "torch fallback" in d.reason
    assert plan.wgrad_path == "fallback"


def test_policy_opt_out_turns_fusion_off():
    plan = _plan(full_caps(apex_fused_wgrad=False, wgrad_fallback=True), MEGATRON_PERF_TOGGLES_WGRAD_FALLBACK=0)
    d = plan.decisions["gradient_accumulation_fusion"]
    assert (d.value, d.source) == (False, "guard") and "MEGATRON_PERF_TOGGLES_WGRAD_FALLBACK=0" in d.reason
    assert plan.wgrad_path == "off"


def test_policy_apex_wins():
    plan = _plan(full_caps(apex_fused_wgrad=True, wgrad_fallback=True))
    assert plan.wgrad_path == "apex" and "fallback" not in plan.decisions["gradient_accumulation_fusion"].reason


def test_policy_no_fallback_possible():
    caps = full_caps(apex_fused_wgrad=False, wgrad_fallback=False, notes={"wgrad_fallback": "no CUDA or ROCm device is visible"})
    d = _plan(caps).decisions["gradient_accumulation_fusion"]
    assert d.value is False and "no CUDA or ROCm device" in d.reason


def test_usable_without_a_gpu_driver_is_no_without_importing_torch(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch")
    from megatron_perf_toggles.runtime.machine import probe

    monkeypatch.setattr(probe, "no_gpu_here", lambda: True)
    monkeypatch.setattr(wgrad_fallback, "torch_module", lambda import_it=True: pytest.fail("torch was asked"))
    assert wgrad_fallback.usable() == (False, "no CUDA or ROCm device is visible")
    monkeypatch.setattr(wgrad_fallback, "installed", lambda name: False)
    assert wgrad_fallback.usable() == (False, "torch is not installed")
    assert "torch" not in sys.modules
