"""H3_* kernel flags: parsed once into KernelSettings, every bad value named in a clear error."""

import pytest

from h3_spark.errors import H3Error
from h3_spark.kernels.settings import KernelSettings, SettingsError, SolSettings


def test_defaults_from_empty_environment():
    s = KernelSettings.from_env({})
    assert s == KernelSettings()
    assert (s.attention, s.linear, s.modulation_fusion, s.q_rms_rope_int8_fusion) == ("auto", "auto", "auto", "auto")
    assert s.sol == SolSettings(tau=1.3, min_tokens=4096, thresh_type="diag", fallback="sage2", strict=True)
    assert s.head_slice_size == 8


def test_every_variable_is_read():
    env = {"H3_ATTENTION": "KJ_Head_Sliced", "H3_HEAD_SLICE_BACKEND": "cudnn_sdpa", "H3_HEAD_SLICE_SIZE": "4",
           "H3_SOL_TAU": "0.9", "H3_SOL_MIN_TOKENS": "100", "H3_SOL_THRESH_TYPE": "topk", "H3_SOL_TOPK_RATIO": "0.2",
           "H3_SOL_INT8_QK": "on", "H3_SOL_INT8_PV": "off", "H3_SOL_FALLBACK": "fa3", "H3_SOL_STRICT": "no",
           "H3_LINEAR": "fp8", "H3_SWIGLU_NVFP4_FUSION": "off", "H3_RMS_ADALN_NVFP4_FUSION": "off",
           "H3_MODULATION_FUSION": "exact", "H3_Q_RMS_ROPE_INT8_FUSION": "off", "H3_QK_SMOOTH_K": "0",
           "H3_QK_HADAMARD": "32", "H3_QK_GRANULARITY": "per_head", "UNRELATED": "x"}
    s = KernelSettings.from_env(env)
    assert s.attention == "kj_head_sliced" and s.head_slice_backend == "cudnn_sdpa" and s.head_slice_size == 4
    assert s.sol == SolSettings(0.9, 100, "topk", 0.2, "on", "off", "fa3", False)
    assert (s.linear, s.swiglu_nvfp4_fusion, s.rms_adaln_nvfp4_fusion) == ("fp8", "off", "off")
    assert (s.modulation_fusion, s.q_rms_rope_int8_fusion) == ("exact", "off")
    assert (s.qk_smooth_k, s.qk_hadamard, s.qk_granularity) == (False, 32, "per_head")
    assert s.to_dict()["sol"]["tau"] == 0.9


@pytest.mark.parametrize("env, message", [
    ({"H3_ATTENTION": "flash"}, r"H3_ATTENTION='flash' is not accepted; use one of: auto, sdpa, cudnn_sdpa, fa3"),
    ({"H3_HEAD_SLICE_BACKEND": "kj_head_sliced"}, r"H3_HEAD_SLICE_BACKEND='kj_head_sliced' is not accepted"),
    ({"H3_HEAD_SLICE_SIZE": "0"}, r"H3_HEAD_SLICE_SIZE must be a positive number of heads, got 0"),
    ({"H3_HEAD_SLICE_SIZE": "eight"}, r"H3_HEAD_SLICE_SIZE='eight' is not an integer"),
    ({"H3_LINEAR": "int8"}, r"H3_LINEAR='int8' is not accepted; use one of: auto, bf16, fp8, nvfp4"),
    ({"H3_SWIGLU_NVFP4_FUSION": "on"}, r"H3_SWIGLU_NVFP4_FUSION='on' is not accepted; use one of: auto, off"),
    ({"H3_RMS_ADALN_NVFP4_FUSION": "1"}, r"H3_RMS_ADALN_NVFP4_FUSION='1' is not accepted"),
    ({"H3_MODULATION_FUSION": "fast"}, r"H3_MODULATION_FUSION='fast' is not accepted; use one of: auto, exact, off"),
    ({"H3_Q_RMS_ROPE_INT8_FUSION": "yes"}, r"H3_Q_RMS_ROPE_INT8_FUSION='yes' is not accepted"),
    ({"H3_QK_HADAMARD": "48"}, r"H3_QK_HADAMARD must be one of 0, 16, 32, 64, 128 \(0 = no rotation\), got 48"),
    ({"H3_QK_GRANULARITY": "per_token"}, r"H3_QK_GRANULARITY='per_token' is not accepted"),
    ({"H3_QK_SMOOTH_K": "maybe"}, r"H3_QK_SMOOTH_K='maybe' is not a yes/no value"),
    ({"H3_SOL_TAU": "-1"}, r"H3_SOL_TAU must be > 0, got -1.0"),
    ({"H3_SOL_TAU": "high"}, r"H3_SOL_TAU='high' is not a number"),
    ({"H3_SOL_MIN_TOKENS": "-5"}, r"H3_SOL_MIN_TOKENS must be >= 0, got -5"),
    ({"H3_SOL_THRESH_TYPE": "sigma"}, r"H3_SOL_THRESH_TYPE='sigma' is not accepted; use one of: diag, topk"),
    ({"H3_SOL_TOPK_RATIO": "1.5"}, r"H3_SOL_TOPK_RATIO must lie in \(0, 1\), got 1.5"),
    ({"H3_SOL_INT8_QK": "true"}, r"H3_SOL_INT8_QK='true' is not accepted; use one of: auto, on, off"),
    ({"H3_SOL_INT8_PV": "yes"}, r"H3_SOL_INT8_PV='yes' is not accepted"),
    ({"H3_SOL_FALLBACK": "sol_attn"}, r"H3_SOL_FALLBACK='sol_attn' is not accepted"),
    ({"H3_SOL_STRICT": "2"}, r"H3_SOL_STRICT='2' is not a yes/no value"),
])
def test_bad_values(env, message):
    with pytest.raises(SettingsError, match=message):
        KernelSettings.from_env(env)
    assert issubclass(SettingsError, H3Error)


def test_blank_means_default_and_replace_validates():
    assert KernelSettings.from_env({"H3_ATTENTION": "  ", "H3_SOL_TAU": ""}) == KernelSettings()
    with pytest.raises(SettingsError, match="H3_ATTENTION='nope'"):
        KernelSettings().replace(attention="nope")
