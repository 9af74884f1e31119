import pytest

from h3_spark.measure.profile import kernel_group, profile_call, summarize


@pytest.mark.parametrize("name,group", [
    ("flash::FlashAttnFwdSm90<...>", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "gemm"),
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "gemm"),
    ("_norm_modulate_kernel", "triton (ours)"),
    ("_swiglu_fp8_kernel", "triton (ours)"),
    ("_add_norm_kernel", "triton (ours)"),
    ("_key_sum_kernel", "triton (ours)"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise / reduce"),
    ("void at::native::index_elementwise_kernel<...>", "copy / index"),
    ("something_else", "other"),
])
def test_kernel_groups(name, group):
    assert kernel_group(name) == group


def test_every_kernel_of_ours_is_grouped_as_ours():
    # A kernel missing from OUR_KERNELS lands in "other" and hides its time from the profile's own group.
    triton = pytest.importorskip("triton")
    import importlib
    import pkgutil

    import h3_spark.kernels as package

    names = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        names |= {n for n, v in vars(module).items()
                  if isinstance(v, triton.runtime.KernelInterface) and n.endswith("_kernel")}
    assert len(names) >= 10
    assert [n for n in sorted(names) if kernel_group(n) != "triton (ours)"] == []


def test_summary_totals_shares_and_ranking():
    kernels = {"sm90_xmma_gemm_a": [6.0, 3], "flash_fwd": [3.0, 1], "_swiglu_kernel": [1.0, 1]}
    s = summarize(kernels, top=2)
    assert s["cuda_ms_total"] == pytest.approx(10.0)
    assert s["groups"]["gemm"] == {"ms": 6.0, "share": pytest.approx(0.6)}
    assert list(s["groups"]) == ["gemm", "attention", "triton (ours)"]
    assert [k["name"] for k in s["top_kernels"]] == ["sm90_xmma_gemm_a", "flash_fwd"]
    assert s["top_kernels"][0]["calls"] == 3


def test_profiling_needs_cuda():
    with pytest.raises(ValueError, match="CUDA device"):
        profile_call(lambda: None, "cpu")
