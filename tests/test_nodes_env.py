"""config/h3_spark_serving.env: sourced by bash, parsed by the engine's settings parser, every flag
documented, every value valid, and the receipt it cites really ran those settings."""

import json
import os
import re
import subprocess
from pathlib import Path

from h3_spark.h3_model.vae.video_config import DECODE_DTYPES

from h3_spark.h3_model.vae.video_tiling import check_tiling
from h3_spark.kernels.settings import KernelSettings

ROOT = Path(__file__).resolve().parents[1]
ENV = ROOT / "config" / "h3_spark_serving.env"
REQUIRED = {"H3_ATTENTION", "H3_LINEAR", "H3_MODULATION_FUSION", "H3_Q_RMS_ROPE_INT8_FUSION", "H3_SWIGLU_NVFP4_FUSION",
            "H3_RMS_ADALN_NVFP4_FUSION", "H3_VAE_DTYPE", "H3_VAE_TILE_SIZE", "H3_VAE_TILE_BATCH", "H3_VAE_LINEAR",
            "H3_HEAD_SLICE_BACKEND", "H3_HEAD_SLICE_SIZE", "H3_SOL_TAU", "H3_SOL_MIN_TOKENS", "H3_SOL_THRESH_TYPE", "H3_SOL_INT8_QK",
            "H3_SOL_INT8_PV", "H3_SOL_FALLBACK", "H3_SOL_STRICT"}


def sourced() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("H3_")}
    out = subprocess.run(["bash", "-c", f"set -euo pipefail; set -a; . '{ENV}'; set +a; env -0"],
                         capture_output=True, env=clean, check=True).stdout.decode()
    pairs = (item.split("=", 1) for item in out.split("\0") if "=" in item)
    return {k: v for k, v in pairs if k.startswith("H3_")}


def test_sourcing_sets_every_flag_and_changes_the_parsed_settings():
    env = sourced()
    assert set(env) == REQUIRED
    parsed, default = KernelSettings.from_env(env), KernelSettings()
    # What the file documents as its choices, against the code's defaults.
    assert (parsed.attention, default.attention) == ("auto", "auto")
    # Sourcing changes what the code would do by default: bf16 pinned instead of auto, NVFP4 fusions off.
    assert (parsed.linear, default.linear) == ("bf16", "auto")
    assert parsed.modulation_fusion == parsed.q_rms_rope_int8_fusion == "auto"
    assert parsed.swiglu_nvfp4_fusion == parsed.rms_adaln_nvfp4_fusion == "off" != default.swiglu_nvfp4_fusion
    assert parsed.sol == default.sol and parsed.head_slice_size == default.head_slice_size == 8
    assert env["H3_VAE_DTYPE"] in DECODE_DTYPES
    from h3_spark.kernels.settings import vae_tile_batch
    from h3_spark.kernels.settings import DEFAULT_TILE_BATCH

    assert vae_tile_batch(env) == DEFAULT_TILE_BATCH
    check_tiling(int(env["H3_VAE_TILE_SIZE"]), 64, 16)
    assert parsed.vae_linear == default.vae_linear == "dense"  # the exact decode; fp8 is opt-in


def test_every_flag_is_documented_before_it_is_set():
    text = ENV.read_text()
    seen_comments = ""
    for line in text.splitlines():
        if line.startswith("#"):
            seen_comments += line + "\n"
            continue
        m = re.match(r"export (H3_[A-Z0-9_]+)=(\S+)$", line)
        if m:
            assert m.group(1) in seen_comments, f"{m.group(1)} is set before it is documented"
        else:
            assert not line.strip(), f"unexpected line: {line!r}"
    # The launch flags are a comment, not something sourcing runs.
    assert re.search(r"^# COMFYUI_ARGS=\".*--listen 127\.0\.0\.1", text, re.M)


def test_the_cited_receipt_ran_these_settings():
    text = ENV.read_text()
    cited = set(re.findall(r"receipts/[\w./\-]+\.json", text))
    assert cited
    env = sourced()
    for path in cited:
        receipt = json.loads((ROOT / path).read_text())
        if "backends" not in receipt:  # a kernel or VAE benchmark: measured on the H200 by our scripts
            gpu = receipt.get("stamp", {}).get("gpu_before", {}).get("name") or receipt.get("device", {}).get("name")
            assert gpu == "NVIDIA H200", path
            continue
        backends = receipt["backends"]
        parity = receipt["limits"]["velocity_rel_l2_vs_diffusers"]["ok"]
        if "settings" in backends:  # apply_kernels' report: the settings the run was given
            ran = backends["settings"]
            if not backends["exact"]:
                # An approximate path is cited as an opt-in alternative: the file must not run it, and where its
                # parity with diffusers was measured it misses the exact path's limit.
                assert (ran["linear"], ran["attention"]) != (env["H3_LINEAR"], env["H3_ATTENTION"]), path
                assert parity in (False, None), path
                continue
            for flag, key in (("H3_ATTENTION", "attention"), ("H3_MODULATION_FUSION", "modulation_fusion"),
                              ("H3_Q_RMS_ROPE_INT8_FUSION", "q_rms_rope_int8_fusion")):
                assert ran[key] == env[flag], (path, flag)
        else:  # the first baseline's plain form
            assert backends["attention"] == "sdpa" and backends["linear"] == "bfloat16"
        # the exact path: inside the noise floor wherever diffusers ran beside it (a generation has no twin)
        assert parity is True or (parity is None and "generation" in receipt), path
    # A fast path that is not receipted must say so.
    for name in ("H3_SWIGLU_NVFP4_FUSION", "H3_RMS_ADALN_NVFP4_FUSION", "H3_VAE_LINEAR"):
        block = text.split(f"# {name}:", 1)[1].split("export", 1)[0]
        assert "no receipt yet" in block, name
    # The VAE dtype set here is one its cited decode receipt ran, beside the float32 decode it is compared with.
    block = text.split("# H3_VAE_DTYPE:", 1)[1].split("export", 1)[0]
    runs = json.loads((ROOT / re.search(r"receipts/[\w./\-]+\.json", block).group(0)).read_text())["runs"]
    assert {env["H3_VAE_DTYPE"], "float32"} <= {run["dtype"] for run in runs}
