"""Static NVFP4 activation scales in the linear (kernels/nvfp4.py, kernels/nvfp4_static.py).

Oracles: the dynamic path itself (a static scale equal to the call's own amax / (448 * 6) must give the very
same bytes and outputs), and the plain-PyTorch `reference_quantize_nvfp4` with an explicit global scale for
an input beyond the static range (saturation), with `saturated_blocks` as the count's definition.
"""

import sys

import pytest
import torch
from torch import nn

from h3_spark.kernels import nvfp4 as nv
from h3_spark.h3_model.engine.block_linears import emulate_nvfp4
from h3_spark.kernels import nvfp4_static as ns


def rand(m: int, k: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen) * 3).to(dtype)


def linear(n: int, k: int, seed: int) -> nv.Nvfp4Linear:
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) / k ** 0.5)
    return nv.Nvfp4Linear.from_linear(lin)


def same(a: nv.Nvfp4Activation, b: nv.Nvfp4Activation) -> bool:
    return (torch.equal(a.packed, b.packed) and torch.equal(a.block_scales.view(torch.uint8), b.block_scales.view(
        torch.uint8)) and torch.equal(a.global_scale, b.global_scale))


# ------------------------------------------------------------------------------------------ reference emulation
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_emulated_static_equals_dynamic_when_the_scale_is_the_calls_own(seed):
    x = rand(37, 64, seed)
    dyn = nv.reference_activation(x)
    st = nv.StaticInput.of(float(dyn.global_scale), "cpu")
    assert same(nv.reference_activation(x, st), dyn)
    lin = linear(48, 64, seed + 10)
    lin.emulate = True
    out_dyn = lin(x)
    lin.static = st
    out_static = lin(x)
    assert out_static.dtype == torch.bfloat16 and out_static.abs().sum() > 0
    assert torch.equal(out_static, out_dyn)
    assert int(st.saturated) == 0
    # Off for a request: the layer measures its own amax again, whatever the static scale says.
    lin.static = nv.StaticInput.of(float(dyn.global_scale) * 0.25, "cpu")
    with _off(lin):
        assert torch.equal(lin(x), out_dyn)
    assert int(lin.static.saturated) == 0


class _off:
    def __init__(self, lin):
        self.lin = lin

    def __enter__(self):
        self.lin.static_on = False

    def __exit__(self, *exc):
        self.lin.static_on = True


def test_input_beyond_the_static_range_saturates_and_is_counted():
    x = rand(40, 64, 3)
    g_own = nv.global_scale_for(x.float().abs().amax())
    g = g_own * 0.1  # range a tenth of the input's amax
    st = nv.StaticInput(g.clone(), torch.zeros(1, dtype=torch.int32))
    a = nv.reference_activation(x, st)
    packed, scales = nv.reference_quantize_nvfp4(x, g)
    assert torch.equal(a.packed, packed) and torch.equal(a.block_scales.view(torch.uint8), scales.view(torch.uint8))
    want = int(nv.saturated_blocks(x, g))
    # Blocks whose amax is over range: counted, each value clamped to +-6 x 448 x g.
    block_amax = x.float().reshape(40, 4, 16).abs().amax(-1)
    assert want == int((block_amax > ns.static_range(float(g))).sum()) and want > 0
    assert int(st.saturated) == want
    deq = a.dequantize(torch.float32)
    assert deq.abs().max() <= ns.static_range(float(g)) * (1 + 1e-6)
    nv.reference_activation(x, st)
    assert int(st.saturated) == 2 * want  # accumulates over calls


# ------------------------------------------------------------------------------------------ the Triton encoders
triton_needed = pytest.mark.skipif(nv.triton is None, reason="needs triton (its interpreter on the CPU)")


@triton_needed
@pytest.mark.parametrize("seed", [0, 1])
def test_triton_static_equals_dynamic_and_counts_saturation(seed):
    x = rand(9, 64, seed)
    dyn = nv.quantize_nvfp4(x)
    assert same(dyn, nv.reference_activation(x))  # the two dynamic paths agree, so the oracles agree
    st = nv.StaticInput.of(float(dyn.global_scale), "cpu")
    assert same(nv.quantize_nvfp4(x, st), dyn) and int(st.saturated) == 0
    small = nv.StaticInput.of(float(dyn.global_scale) * 0.2, "cpu")
    got = nv.quantize_nvfp4(x, small)
    ref = nv.reference_activation(x, nv.StaticInput.of(float(dyn.global_scale) * 0.2, "cpu"))
    assert same(got, ref)
    assert int(small.saturated) == int(nv.saturated_blocks(x, small.scale)) > 0


@triton_needed
def test_triton_fused_producers_take_the_static_scale():
    fc1_out = rand(7, 64, 5)
    dyn = nv.swiglu_quantize_nvfp4(fc1_out)
    st = nv.StaticInput.of(float(dyn.global_scale), "cpu")
    assert same(nv.swiglu_quantize_nvfp4(fc1_out, st), dyn)
    x = rand(7, 32, 6).reshape(1, 7, 32)
    norm = nn.RMSNorm(32, eps=1e-6, dtype=torch.bfloat16)
    shift, scale = rand(2, 32, 7), rand(2, 32, 8) * 0.1
    rows = torch.tensor([0, 1, 1, 0, 1, 0, 0], dtype=torch.int32)
    dyn = nv.rms_adaln_quantize_nvfp4(x, norm, shift, scale, rows)
    st = nv.StaticInput.of(float(dyn.global_scale), "cpu")
    assert same(nv.rms_adaln_quantize_nvfp4(x, norm, shift, scale, rows, st), dyn)


@triton_needed
def test_native_linear_static_equals_dynamic_through_the_fp4_gemm(monkeypatch):
    ck = pytest.importorskip("comfy_kitchen")
    import types

    def scaled_mm(a, b, ta, tb, ba, bb, bias=None, out_dtype=None, alpha=None):
        da = ck.dequantize_nvfp4(a, ta, ba, torch.float32)[: a.shape[0]]
        db = ck.dequantize_nvfp4(b, tb, bb, torch.float32)[: b.shape[0]]
        return (da @ db.t()).to(out_dtype)

    monkeypatch.setitem(sys.modules, "comfy_kitchen", types.SimpleNamespace(scaled_mm_nvfp4=scaled_mm))
    x = rand(5, 64, 11)
    lin = linear(32, 64, 12)
    out_dyn = lin(x)
    lin.static = nv.StaticInput.of(float(nv.global_scale_for(x.float().abs().amax())), "cpu")
    assert torch.equal(lin(x), out_dyn)
    lin.emulate = True  # the emulation computes what the fake GEMM computes
    assert torch.equal(lin(x), out_dyn)


# ------------------------------------------------------------------------------------------ on a DiT
def emulated_dit():
    from h3_spark.h3_model.dit.model import H3DiT
    from oracle import EQUAL_WIDTH

    torch.manual_seed(0)
    model = H3DiT(EQUAL_WIDTH, dtype=torch.bfloat16).eval()
    sources = emulate_nvfp4(model)
    assert sources == {"bf16 weight quantized to NVFP4": 6 * EQUAL_WIDTH.num_layers}
    return model


def test_install_wires_every_consumer_and_excludes_a_shared_input_together():
    model = emulated_dit()
    layers = ns.nvfp4_linears(model)
    scales = {n: 0.01 * (i + 1) for i, n in enumerate(layers)}
    counts = ns.install(model, scales, {"transformer_blocks.1.attn.to_k"})
    assert counts == {"static": len(layers) - 3, "dynamic": 3}
    for q in ("to_q", "to_k", "to_v"):
        assert layers[f"transformer_blocks.1.attn.{q}"].static is None
    b0 = model.transformer_blocks[0]
    qkv = max(scales[f"transformer_blocks.0.attn.{n}"] for n in ("to_q", "to_k", "to_v"))
    assert float(b0.attn.to_q.static.scale) == float(b0.attn.to_v.static.scale) == pytest.approx(qkv)
    assert float(b0.ff.net[2].static.scale) == pytest.approx(scales["transformer_blocks.0.ff.net.2"])
    assert b0.norm1.nvfp4_static_of() is b0.attn.to_q.static and b0.norm2.nvfp4_static_of() is b0.ff.net[0].proj.static
    # Not a submodule: the model's names and state are those it had (an earlier version added a second name).
    assert [n for n, _ in b0.named_modules() if "nvfp4" in n] == [] and not any("nvfp4" in k for k in
                                                                                model.state_dict())
    with ns.dynamic(model):
        assert all(m.input_static() is None for m in layers.values())
    assert b0.attn.to_q.input_static() is b0.attn.to_q.static
    ns.clear(model)
    assert all(m.static is None for m in layers.values()) and not hasattr(b0.norm1, "nvfp4_static_of")


def test_install_refuses_layers_it_does_not_know_or_misses_and_bad_scales():
    model = emulated_dit()
    scales = {n: 0.01 for n in ns.nvfp4_linears(model)}
    with pytest.raises(ValueError, match=r"^static scales name 1 unknown layer\(s\) \['blocks.9.x'\] and miss 0 \[\]$"):
        ns.install(model, {**scales, "blocks.9.x": 0.1})
    with pytest.raises(ValueError, match=r"and miss 1 \['transformer_blocks.1.ff.net.2'\]$"):
        ns.install(model, {n: g for n, g in scales.items() if n != "transformer_blocks.1.ff.net.2"})
    with pytest.raises(ValueError, match=r"^static scale of transformer_blocks.0.ff.net.2 is -1.0; a global scale "
                                         r"must be > 0$"):
        ns.install(model, {**scales, "transformer_blocks.0.ff.net.2": -1.0})


@triton_needed
def test_the_fused_producers_encode_with_their_consumers_static_scale():
    model = emulated_dit()
    ns.install(model, {n: 0.002 for n in ns.nvfp4_linears(model)})
    blk = model.transformer_blocks[0]
    rows = torch.tensor([0, 1, 1, 0, 1], dtype=torch.int32)
    mod = nv.Nvfp4RowModulation(rows, False)
    x, shift, scale = rand(5, 32, 1).reshape(1, 5, 32), rand(2, 32, 2), rand(2, 32, 3) * 0.1
    act = mod.norm_modulate(blk.norm1, x, shift, scale)
    assert act.global_scale.item() == blk.attn.to_q.static.scale.item()
    with ns.dynamic(model):
        own = mod.norm_modulate(blk.norm1, x, shift, scale)
    assert same(own, nv.rms_adaln_quantize_nvfp4(x, blk.norm1, shift, scale, rows))
    seen = []
    blk.ff.net[2].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    ff = nv.Nvfp4SwiGLU.wrap(blk.ff)
    ff._rows(rand(5, 32, 4))
    assert isinstance(seen[0], nv.Nvfp4Activation) and seen[0].global_scale.item() == pytest.approx(0.002)
