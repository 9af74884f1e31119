"""benchmarks/fasth3_vs_fastvideo_gpu.py on the CPU: its stand-in for FastVideo's CUDA block-sparse kernel against our
VSA reference, its one-line refusals, and (where fastvideo 0.2.1 is importable) the tiny end-to-end comparison."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from h3_spark.kernels.vsa_reference import fine_reference, tile_map

ROOT = Path(__file__).resolve().parents[1]


def _padded(x, tiles):
    """x (B, S, H, D) -> (B, n x tile, H, D) tile by tile, zeros in the padding (FastVideo's layout)."""
    b, _, h, d = x.shape
    return x.new_zeros(b, tiles.num_tiles * tiles.tile, h, d).index_copy_(1, tiles.slot, x)


def script():
    spec = importlib.util.spec_from_file_location("fasth3_vs_fastvideo_gpu",
                                                  ROOT / "benchmarks" / "fasth3_vs_fastvideo_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_masked_tile_attention_is_the_fine_step_of_our_reference():
    gen = torch.Generator().manual_seed(3)
    tiles = tile_map((70, 18), (8, 6, 7), 64)  # short prefix tiles and partial video tiles at the far edges
    b, h, d = 1, 2, 16
    q, k, v = (torch.randn(b, tiles.sequence_length, h, d, generator=gen) for _ in range(3))
    n = tiles.num_tiles
    mask = torch.rand(b, h, n, n, generator=gen) < 0.3
    mask |= torch.eye(n, dtype=torch.bool)  # every query tile keeps at least its own rows
    qp, kp, vp = (_padded(x, tiles).transpose(1, 2) for x in (q, k, v))
    out, _ = script().masked_tile_attention(qp, kp, vp, mask, tiles.sizes)
    ours = fine_reference(q, k, v, mask, tiles)
    assert out.shape == qp.shape
    torch.testing.assert_close(out.transpose(1, 2)[:, tiles.slot], ours, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("argv, message", [
    (["--preset", "full", "--device", "cpu"], "--device cpu runs the tiny preset only"),
    (["--preset", "tiny", "--device", "cpu", "--sparsity", "1.0"], "--sparsity must lie in [0, 1), got 1.0"),
    (["--preset", "tiny", "--device", "cpu", "--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["--preset", "tiny", "--device", "tpu"], "--device must be cuda or cpu, got 'tpu'"),
])
def test_refusals_are_one_line(argv, message, tmp_path, capsys):
    assert script().main([*argv, "--out", str(tmp_path / "out.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fasth3_vs_fastvideo: cannot run: {message}") and "\n" not in err
    assert not (tmp_path / "out.json").exists()


def test_without_fastvideo_the_reason_names_the_install(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastvideo" else real(name, *a))
    assert script().main(["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path / "out.json")]) == 2
    assert "fastvideo is not importable: install fastvideo==0.2.1 with --no-deps" in capsys.readouterr().err


def test_tiny_forwards_agree_with_fastvideo(tmp_path):
    """The weight mapping (FastVideo's own rules), the inputs and the VSA tiling, exempt mode and gate: ours and
    FastVideo's forwards equal in fp32 on the tiny model, at sparsity 0.9, 0 and dense."""
    if importlib.util.find_spec("fastvideo") is None:
        pytest.skip("fastvideo 0.2.1 is not importable here (it is no dependency of the package)")
    out = tmp_path / "tiny.json"
    assert script().main(["--preset", "tiny", "--device", "cpu", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    request = result["requests"]["tiny-t2va"]
    for run in ("vsa", "vsa_dense", "dense"):
        assert request["runs"][run]["velocity_rel_l2_ours_vs_fastvideo"]["all"] < 1e-6, run
    # The comparison means something only where sparsity 0.9 changes the output and the gates are read.
    assert request["sparsity_effect"]["ours_vsa_vs_ours_vsa_dense"]["all"] > 1e-3
    assert request["ours_vsa"]["calls_with_gate"] > 0 and result["fastvideo"]["vsa"]["gate_branch_active"]
