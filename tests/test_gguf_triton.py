"""The fused GGUF dequantization kernels (kernels/gguf_triton.py) against gguf's NumPy dequantizer, and the
dispatch in kernels/gguf_codec.py that picks them.

Oracle: `gguf.quants.dequantize` (as in tests/test_gguf_codec.py, whose random valid blocks these reuse: every
quant bit random, fp16 fields of every finite exponent, subnormals included). Budget: bit for bit (torch.equal)
in fp32, and in bf16 / fp16 against the same cast of gguf's fp32 values, for every type the kernels have.
On the CPU the kernels run in Triton's interpreter (tests/conftest.py), at shapes of a few blocks: a partial last
program, several rows, rows at a stride wider than their data. The `gpu` tests compile them for CUDA (where a
fused multiply-add would change the affine types' values) at a larger shape and through the codec's dispatch.
"""

import numpy as np
import pytest
import torch
from gguf import quants

from h3_spark.errors import CheckpointError
from h3_spark.kernels import gguf_codec, gguf_triton
from h3_spark.kernels._triton import triton

from test_gguf_codec import _qtype, gguf_values, random_blocks, random_raw

# fp16 outputs of values beyond its range are Inf, as the cast of gguf's fp32 is; the interpreter warns about it
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
needs_triton = pytest.mark.skipif(triton is None, reason="needs Triton (its CPU interpreter runs these)")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FIRST_SET = ("Q8_0", "Q4_K", "Q6_K", "Q2_K", "Q5_0")  # what the published H3 files mostly use


def _values_per_block(name):
    return gguf_codec.block_size(name)


def _kernel(raw, name, k, dtype, device="cpu"):
    out = torch.empty(raw.shape[0], k, dtype=dtype, device=device)
    return gguf_triton.dequantize_into(out, torch.from_numpy(raw).to(device), name)


def _assert_kernel_exact(raw, name, k, device="cpu"):
    ref = gguf_values(raw, name).reshape(raw.shape[0], k)
    for dtype in DTYPES:
        got = _kernel(raw, name, k, dtype, device).cpu()
        want = ref.to(dtype)
        assert torch.equal(got, want), f"{name} in {dtype}: {(got != want).sum().item()} of {want.numel()} differ"


def test_the_kernels_cover_the_published_types():
    assert set(FIRST_SET) <= set(gguf_triton.TYPES)
    assert set(gguf_triton.TYPES) == {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K",
                                      "Q5_K", "Q6_K", "IQ4_XS"}
    assert set(gguf_triton.TYPES) <= set(gguf_codec.SUPPORTED)


# --------------------------------------------------------------------------------------------- bit for bit
@needs_triton
@pytest.mark.parametrize("name", gguf_triton.TYPES)
def test_random_blocks_bit_exact(name):
    """7 rows of 2 blocks (14: one partial program of 64 blocks of 32, two of 8 super-blocks) and 3 rows of 3."""
    rng = np.random.default_rng(100 + sum(map(ord, name)))
    block = _values_per_block(name)
    for rows, k in [(7, 2 * block), (3, 3 * block)]:
        _assert_kernel_exact(random_raw(name, rows, k, rng), name, k)


@needs_triton
@pytest.mark.parametrize("name", ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"))
def test_gguf_quantized_weights_bit_exact(name):
    """Blocks gguf quantizes itself from rows of very different magnitudes, one all-zero block (scale 0)."""
    rng = np.random.default_rng(200 + sum(map(ord, name)))
    weights = (rng.standard_normal((5, 96)) * np.exp(rng.uniform(-6, 3, (5, 1)))).astype(np.float32)
    weights[0, :32] = 0
    raw = np.ascontiguousarray(quants.quantize(weights, _qtype(name))).view(np.uint8).reshape(5, -1)
    _assert_kernel_exact(raw, name, 96)


@needs_triton
@pytest.mark.parametrize("name", ("Q5_1", "Q3_K"))
def test_rows_at_a_stride_and_a_corrupted_block(name):
    """Blocks and output as row slices of wider tensors (StoredLinear hands row ranges of its scratch): the
    values land in their rows and nothing else is written; replacing one block changes that block's values."""
    rng = np.random.default_rng(300 + sum(map(ord, name)))
    block = _values_per_block(name)
    k = 2 * block
    raw = random_raw(name, 5, k, rng)
    wide = np.concatenate([raw, random_raw(name, 5, block, rng)], axis=1)  # one more block per row, not read
    out = torch.full((5, k + 7), 3.5)
    got = gguf_triton.dequantize_into(out[:, :k], torch.from_numpy(wide)[:, :raw.shape[1]], name)
    assert torch.equal(got, gguf_values(raw, name).reshape(5, k))
    assert torch.equal(out[:, k:], torch.full((5, 7), 3.5))
    bad = raw.copy()
    per_block = raw.shape[1] // 2
    bad[3, per_block:] = random_blocks(name, 1, rng)[0]
    changed = _kernel(bad, name, k, torch.float32)
    assert not torch.equal(changed[3, block:], got[3, block:])
    changed[3, block:] = got[3, block:]
    assert torch.equal(changed, got)


@needs_triton
def test_an_empty_tensor_writes_nothing():
    out = torch.empty(0, 256)
    assert gguf_triton.dequantize_into(out, torch.empty(0, 144, dtype=torch.uint8), "Q4_K") is out


# --------------------------------------------------------------------------------------------- compiled form
# Compiles the kernel ahead of time for an H200 (sm_90) with the launch options dequantize_into uses, in a
# process without the interpreter (no GPU needed: the Triton wheel carries ptxas), and prints per type whether
# the PTX holds a fused multiply-add and whether the stores are 16-byte vectors.
_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from h3_spark.kernels import gguf_triton as G

signature = {"raw": "*u8", "out": "*bf16", "table": "*fp32", "n_blocks": "i32", "per_row": "i32",
             "raw_stride": "i32", "out_stride": "i32", "SUPER": "constexpr", "KIND": "constexpr", "SIZE": "constexpr",
             "VALUES": "constexpr", "BLOCKS": "constexpr", "RND": "constexpr"}
aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 5, 6)}
found = []
for name, extra in json.loads(sys.argv[1]):
    src = ASTSource(fn=G._gguf_dequantize_kernel, signature=signature, constexprs=dict(G.launch_plan(name), RND=1),
                    attrs=aligned)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(G.LAUNCH_OPTIONS, **extra)).asm["ptx"]
    found.append({"fma": "fma." in ptx, "vector_stores": "st.global.v4.b32" in ptx})
print(json.dumps(found))
"""


def _compiled(cases):
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_triton
def test_the_compiled_kernel_has_no_fused_multiply_add():
    """The affine types (d * q + m, dl * q - ml) compiled as dequantize_into launches them: no FMA, vector
    stores. Compiled with Triton's default (contraction on) the same kernels have FMAs: the check can fail."""
    found = _compiled([("Q4_1", {}), ("Q4_K", {}), ("Q4_K", {"enable_fp_fusion": True})])
    assert found == [{"fma": False, "vector_stores": True}] * 2 + [{"fma": True, "vector_stores": True}]


# --------------------------------------------------------------------------------------------- dispatch
def test_the_dispatch_picks_triton_on_cuda_for_the_kernels_types_only():
    for name in gguf_codec.SUPPORTED:
        assert gguf_codec.dequantizer(name, "cpu") == "torch"
        expected = "triton" if triton is not None and name in gguf_triton.TYPES else "torch"
        assert gguf_codec.dequantizer(name, torch.device("cuda", 0)) == expected, name
    assert gguf_codec.dequantizer("IQ2_XXS", "cuda") == "torch"  # a lattice i-quant: the torch codec


@needs_triton
def test_the_codec_runs_the_kernel_when_the_dispatch_says_triton(monkeypatch):
    """Routed through gguf_codec.dequantize_into (here with the CPU taken for a GPU, the kernel interpreted):
    the kernel is what runs (a spy sees the call) and gives gguf's values."""
    monkeypatch.setattr(gguf_codec, "dequantizer", lambda name, device: "triton")
    calls = []
    kernel = gguf_triton.dequantize_into
    monkeypatch.setattr(gguf_triton, "dequantize_into", lambda *a: calls.append(a[2]) or kernel(*a))
    rng = np.random.default_rng(400)
    raw = random_raw("Q6_K", 3, 512, rng)
    out = gguf_codec.dequantize_into(torch.empty(3, 512, dtype=torch.bfloat16), torch.from_numpy(raw), "Q6_K")
    assert calls == ["Q6_K"]
    assert torch.equal(out, gguf_values(raw, "Q6_K").reshape(3, 512).to(torch.bfloat16))


# --------------------------------------------------------------------------------------------- errors
def test_blocks_on_another_device_are_named():
    raw = torch.zeros(2, 34, dtype=torch.uint8, device="meta")
    with pytest.raises(CheckpointError) as err:
        gguf_codec.dequantize_into(torch.empty(2, 32), raw, "Q8_0")
    assert str(err.value) == "GGUF Q8_0 blocks on meta cannot be dequantized into cpu"


@needs_triton
def test_kernel_refuses_what_it_cannot_take():
    with pytest.raises(ValueError) as err:
        gguf_triton.dequantize_into(torch.empty(2, 256), torch.zeros(2, 66, dtype=torch.uint8), "IQ2_XXS")
    assert str(err.value) == ("the GGUF Triton kernel has no IQ2_XXS (it has Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, "
                              "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS)")
    with pytest.raises(ValueError) as err:
        gguf_triton.dequantize_into(torch.empty(64, 2).t(), torch.zeros(2, 68, dtype=torch.uint8), "Q8_0")
    assert str(err.value) == ("GGUF Q8_0: blocks and output need contiguous rows, got strides (68, 1) and "
                              "(1, 2)")
    huge = torch.empty(2 ** 26, 1024, device="meta")  # 2^31 blocks of 32: shapes only, nothing allocated
    with pytest.raises(ValueError) as err:
        gguf_triton.dequantize_into(huge, torch.empty(2 ** 26, 1088, dtype=torch.uint8, device="meta"), "Q8_0")
    assert str(err.value) == ("GGUF Q8_0: 2147483648 blocks in one call, more than the kernel counts (2^31 - 1)")


# --------------------------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name", gguf_triton.TYPES)
def test_compiled_kernels_are_ggufs_bit_for_bit(name):
    """Compiled for CUDA (no FMA contraction: the affine types' d * q + m would round once), 96 rows of 21
    super-blocks or 168 blocks of 32 (5,376 values, the DiT's hidden width), all three output dtypes, and the
    same through gguf_codec.dequantize_into, which must report and take the Triton path."""
    rng = np.random.default_rng(500 + sum(map(ord, name)))
    raw = random_raw(name, 96, 5376, rng)
    _assert_kernel_exact(raw, name, 5376, device="cuda")
    assert gguf_codec.dequantizer(name, "cuda") == "triton"
    out = torch.empty(96, 5376, dtype=torch.bfloat16, device="cuda")
    gguf_codec.dequantize_into(out, torch.from_numpy(raw).cuda(), name)
    assert torch.equal(out.cpu(), gguf_values(raw, name).reshape(96, 5376).to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("name", gguf_triton.TYPES)
def test_compiled_kernels_match_the_torch_codec_on_a_large_tensor(name, monkeypatch):
    """4,096 x 5,376 of random bytes as blocks (gguf would take minutes; fp16 fields of any pattern, Inf and NaN
    included) against the torch codec on the same GPU: the same values, NaN where it has NaN (a NaN's payload
    may differ between torch's cast and the kernel's)."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    raw = torch.randint(0, 256, (4096, gguf_codec.row_bytes(name, 5376)), dtype=torch.uint8, device="cuda",
                        generator=gen)
    for dtype in DTYPES:
        got = gguf_triton.dequantize_into(torch.empty(4096, 5376, dtype=dtype, device="cuda"), raw, name)
        with monkeypatch.context() as patch:
            patch.setattr(gguf_codec, "dequantizer", lambda n, d: "torch")
            want = gguf_codec.dequantize_into(torch.empty_like(got), raw, name)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=f"{name} in {dtype}")
