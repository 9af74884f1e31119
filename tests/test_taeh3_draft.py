"""TAEH3 as a draft decoder (`--decoder taeh3`, `decode_draft`), its synthetic file and its benchmark script.

Claims:
- make-checkpoint --component taeh3 writes the published layout: 128 fp16 tensors (64 encoder, 64 decoder);
- `decode_draft` gives the full VAE's frame count and size for the same latents (5n+2 latents, 17n+5 frames, 16x
  space) and equals a plain-PyTorch reference built here: the causal frame-by-frame decoder of
  test_tiny_decoder.py, of whose four frames per clip-opening latent only the last is kept (within 1 uint8 level:
  fp32 convolutions over all frames or one at a time round differently);
- decoding in chunks of latent frames, each memory block carrying the last input it saw, gives the whole-clip
  pass's uint8 frames: the same bits for chunks of 2 or more (fp32, CPU), within 1 level when a chunk holds one
  frame (another CPU convolution kernel, see test_tiny_decoder.py); the frames stream out chunk by chunk, in
  order, equal to the returned ones, and no layer sees more than the chunk's frames (the memory bound);
- generate --decoder taeh3 writes the clip (124 frames, the VAE's size) and reports the decoder as approximate;
- bad inputs, one line each: a 2D per-frame TAEH3 file (Kijai's kind), a latent length the VAE does not make,
  the flags without each other, a chunk that is not a whole number of latent frames; the benchmark's argument
  checks and a tiny CPU run of both modes.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from h3_spark.cli import main
from h3_spark.errors import CheckpointError, InputError
from h3_spark.h3_model.engine.demo import DEMO_VAE
from h3_spark.h3_model.vae.tiny_decoder import DRAFT_CHUNK, decode_draft, load_tiny_decoder
from h3_spark.h3_model.vae.video_tiling import decoded_num_frames
from test_tiny_decoder import _frame_by_frame

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def taeh3(tmp_path_factory):
    path = tmp_path_factory.mktemp("taeh3") / "taeh3.safetensors"
    assert main(["make-checkpoint", "--component", "taeh3", "--seed", "1", str(path)]) == 0
    return path


def test_the_synthetic_file_has_the_published_layout(taeh3):
    with safe_open(str(taeh3), "pt") as f:
        names = list(f.keys())
        dtypes = {f.get_tensor(n).dtype for n in names}
    assert len(names) == 128 and dtypes == {torch.float16}
    assert sum(n.startswith("encoder.") for n in names) == 64 and sum(n.startswith("decoder.") for n in names) == 64
    assert load_tiny_decoder(taeh3).latent_channels == 4  # the demo VAE's


def test_decode_draft_is_the_causal_decoder_with_the_vaes_frames(taeh3):
    decoder = load_tiny_decoder(taeh3)
    t, h, w = 12, 2, 3
    latents = torch.randn(1, 4, t, h, w, generator=torch.Generator().manual_seed(4))
    got = decode_draft(latents, decoder, DEMO_VAE)
    assert got.shape == (decoded_num_frames(DEMO_VAE, t), 16 * h, 16 * w, 3) == (39, 32, 48, 3)
    with torch.no_grad():
        reference = _frame_by_frame(decoder, latents[0].transpose(0, 1))  # (4t - 3, 3, H, W), the start-up dropped
    # The stream's clips open at latents 0, 2 and 7 (5 latents a clip, the first 3 dropped): keep their last frame.
    per_latent = [[4 * i - 3 + k for k in range(4) if 4 * i - 3 + k >= 0] for i in range(t)]
    keep = [f for i, frames in enumerate(per_latent) for f in (frames[-1:] if i in (0, 2, 7) else frames)]
    want = (reference[keep].clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    assert got.shape == want.shape
    assert (got.int() - want.int()).abs().max() <= 1
    assert got.float().std() > 5  # varied pixels: the comparison means something


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, DRAFT_CHUNK, 12, 40])
def test_a_chunked_draft_streams_the_whole_clip_passs_frames(taeh3, chunk):
    # 12 latents (5n + 2): 2, 3 and 12 divide it, 5 and 8 do not (last chunks of 2 and 4), 40 is one chunk.
    decoder = load_tiny_decoder(taeh3)
    t, h, w = 12, 2, 3
    latents = torch.randn(1, 4, t, h, w, generator=torch.Generator().manual_seed(7))
    whole = decode_draft(latents, decoder, DEMO_VAE, chunk=None)
    streamed = []
    got = decode_draft(latents, decoder, DEMO_VAE, chunk=chunk,
                       on_frames=lambda frames: streamed.append(frames.clone()))
    assert got.shape == whole.shape == (decoded_num_frames(DEMO_VAE, t), 32, 48, 3)
    if chunk == 1:
        assert (got.int() - whole.int()).abs().max() <= 1
    else:
        assert torch.equal(got, whole)
    assert whole.float().std() > 5  # varied pixels: the comparison means something
    assert len(streamed) == -(-t // chunk) and torch.equal(torch.cat(streamed), got)
    # Each chunk's frames as the clip's openings leave them (latents 0, 2 and 7 keep one frame of four).
    sizes = [sum(1 if i in (0, 2, 7) else 4 for i in range(s, min(t, s + chunk))) for s in range(0, t, chunk)]
    assert [len(frames) for frames in streamed] == sizes


def test_the_whole_clip_pass_streams_once(taeh3):
    latents = torch.randn(1, 4, 7, 2, 2, generator=torch.Generator().manual_seed(8))
    streamed = []
    got = decode_draft(latents, load_tiny_decoder(taeh3), DEMO_VAE, chunk=None, on_frames=streamed.append)
    assert len(streamed) == 1 and streamed[0].shape == got.shape == (22, 32, 32, 3)


@pytest.mark.parametrize("chunk, most", [(2, 8), (5, 20), (None, 48)])
def test_no_layer_sees_more_than_the_chunks_frames(taeh3, chunk, most):
    decoder = load_tiny_decoder(taeh3)
    seen = []
    hooks = [layer.register_forward_hook(lambda module, args, out: seen.append(out.shape[0]))
             for layer in decoder.decoder]
    try:
        decode_draft(torch.randn(1, 4, 12, 2, 2, generator=torch.Generator().manual_seed(9)), decoder, DEMO_VAE,
                     chunk=chunk)
    finally:
        for hook in hooks:
            hook.remove()
    assert max(seen) == most  # 4 frames a latent frame after the time grows


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True, "8"])
def test_a_bad_chunk_is_refused(taeh3, chunk):
    with pytest.raises(InputError) as err:
        decode_draft(torch.randn(1, 4, 7, 2, 2), load_tiny_decoder(taeh3), DEMO_VAE, chunk=chunk)
    assert str(err.value) == ("decode_draft chunk must be a whole number of latent frames, 1 or more (or None for "
                              f"the whole clip at once), got {chunk!r}")


def test_a_2d_per_frame_decoder_is_refused(tmp_path):
    # TAESD-style: blocks that see one frame (conv [64, 64, 3, 3]) and no time growth.
    tensors = {"decoder.1.weight": torch.randn(64, 24, 3, 3), "decoder.3.conv.0.weight": torch.randn(64, 64, 3, 3)}
    path = tmp_path / "taeh3.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError) as err:
        load_tiny_decoder(path)
    assert str(err.value) == (f"{path}: not the temporal TAEH3 decoder (madebyollin/taehv's taeh3.safetensors): "
                              "decoder.3.conv.0.weight is [64, 64, 3, 3], a memory block's first conv is [N, 2N, 3, "
                              "3] (this frame and the last); a per-frame 2D decoder cannot decode the clip in time")


def test_a_length_the_vae_does_not_make_is_refused(taeh3):
    with pytest.raises(InputError) as err:
        decode_draft(torch.randn(1, 4, 8, 2, 2), load_tiny_decoder(taeh3), DEMO_VAE)
    assert str(err.value) == ("8 latent frames: TAEH3 would make 23 frames, the video VAE 26; drafts take the "
                              "lengths the pipeline makes (5n + 2)")


@pytest.fixture
def _reference_kernels(monkeypatch):
    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")


def test_generate_with_the_taeh3_decoder(taeh3, demo_models, tmp_path, capsys, _reference_kernels):
    pytest.importorskip("av")
    from h3_spark.h3_model.media import files as media

    out = tmp_path / "draft.mp4"
    assert main(["generate", "--demo", "--demo-dir", str(demo_models), "--steps", "2", "--width", "64", "--height",
                 "64", "--decoder", "taeh3", "--taeh3", str(taeh3), "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["decoder"] == "taeh3" and summary["frames"] == 124 and summary["exact"] is False
    assert "decoder taeh3" in summary["approximate_paths"]
    info = media.probe(out)
    assert info["frames"] == 124 and (info["width"], info["height"]) == (64, 64)
    # A film's windows decode with it too, and its summary says so.
    film = tmp_path / "draft-film.mp4"
    assert main(["generate", "--demo", "--demo-dir", str(demo_models), "--steps", "2", "--width", "64", "--height",
                 "64", "--seconds", "16", "--decoder", "taeh3", "--taeh3", str(taeh3), "--out", str(film)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["decoder"] == "taeh3" and summary["frames"] == 384 and summary["exact"] is False
    assert "decoder taeh3" in summary["approximate_paths"] and len(summary["windows"]) == 2


@pytest.mark.parametrize("argv, message", [
    (["--decoder", "taeh3"], "--decoder taeh3 needs --taeh3 PATH (madebyollin/taehv's taeh3.safetensors)"),
    (["--taeh3", "x.safetensors"], "--taeh3 x.safetensors is read only with --decoder taeh3"),
    (["--decoder", "taeh3", "--taeh3", "missing.safetensors"], "--taeh3 missing.safetensors: no such file"),
])
def test_the_decoder_flags_are_checked(demo_models, tmp_path, capsys, argv, message):
    code = main(["generate", "--demo", "--demo-dir", str(demo_models), "--out", str(tmp_path / "x.mp4"), *argv])
    assert code != 0 and f"error: {message}\n" in capsys.readouterr().err


def test_the_benchmark_checks_its_arguments_and_runs_tiny_on_the_cpu(tmp_path, capsys):
    sys.path.insert(0, str(BENCH))
    import taeh3_gpu

    with pytest.raises(SystemExit):
        taeh3_gpu.parse(["--out", "x.json", "--latent", "8,2,2"])
    assert "with 5n+2 frames" in capsys.readouterr().err
    args = taeh3_gpu.parse(["--out", "x.json"])
    assert args.latent_shape == (37, 48, 84) and args.preset == "full"
    out = tmp_path / "taeh3.json"
    with pytest.raises(SystemExit):
        taeh3_gpu.parse(["--out", "x.json", "--chunk", "0"])
    assert "--chunk must be at least 1 latent frame, got 0" in capsys.readouterr().err
    assert taeh3_gpu.main(["--out", str(out), "--preset", "tiny", "--device", "cpu", "--latent", "7,2,2",
                           "--repeats", "1", "--chunk", "5"]) == 0
    result = json.loads(out.read_text())
    runs = result["taeh3_runs"]
    assert result["same_frame_shape"] is True and result["chunked_equals_whole"] is True
    assert runs["chunked"]["frames_shape"] == runs["whole"]["frames_shape"] == [22, 32, 32, 3]
    assert runs["chunked"]["chunk"] == 5 and set(result["taeh3_speedup"]) == {"chunked", "whole"}
    # 128 x H x W values a latent frame, 4 bytes each in fp32: 5 latent frames of 32x32, and all 7.
    assert runs["chunked"]["predicted_activation_gb"] == 5 * 128 * 32 * 32 * 4 / 1e9
    assert runs["whole"]["predicted_activation_gb"] == 7 * 128 * 32 * 32 * 4 / 1e9
