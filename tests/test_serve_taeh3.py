"""TAEH3 in the service (`serve --taeh3 PATH`): a per-request decoder for drafts, and decoded previews.

Models: test_serve.py's tiny set (CPU) with the demo's video VAE (16x space and 4x time, as released, which TAEH3
grows to), loaded by serve.models.load_models with a tiny synthetic TAEH3 (make-checkpoint's writer, the demo VAE's
4 latent channels).

Claims:
- load_models loads the TAEH3 file after the models and the loading state lists it; /ready names the file
  (`draft_decoder`), null on a service without one;
- a `decoder: "taeh3"` job's frames are bit for bit `decode_draft` of its own latents with a TAEH3 read here from the
  same file (fp32, CPU, the same chunks), and not the VAE's; its backends say `exact: false` with
  "decoder taeh3", its record's request and info say taeh3; a film decodes each of its windows that way;
- the default job is the VAE's decode of its latents, bit for bit (the path as it was), marked exact of the
  decoder; /v1/videos passes `decoder` on;
- with TAEH3 loaded the preview PNG is a decoded strip of the false-colour strip's size, each tile within 1 uint8
  level of a reference made here (the decoder's whole-window pass over the 3 latent frames up to the tile's, then
  the same resize), and different from the false-colour strip; without TAEH3 it is the false-colour strip, exactly;
- refusals, one line each: an unknown decoder (the request, the pipeline), taeh3 on a service without --taeh3 (400
  at acceptance naming the flag), taeh3 on an engine without it (before sampling), a 2D per-frame file and a
  missing file at `serve` start.
"""

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fixtures import qwen_tiny as Q
from test_serve import model_spec, request, serve, text_override, wait_job  # noqa: F401 - serve: a fixture

from h3_spark.cli import main
from h3_spark.errors import InputError
from h3_spark.h3_model.engine.demo import DEMO_VAE
from h3_spark.h3_model.pipeline.generation import GenerationRequest
from h3_spark.h3_model.pipeline.preview import preview_image, strip_factor, strip_picks
from h3_spark.h3_model.vae.taeh3_synthetic import write_taeh3
from h3_spark.h3_model.vae.tiny_decoder import decode_draft, load_tiny_decoder
from h3_spark.serve import openai_videos as ov
from h3_spark.serve.models import LoadTracker, load_models


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import dataclasses

    from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint
    from h3_spark.h3_model.dit.config import TINY
    from h3_spark.h3_model.vae.synthetic import write_audio_vae_checkpoint, write_vae_checkpoint

    root = tmp_path_factory.mktemp("models")
    make_dit_checkpoint(root / "transformer", dataclasses.replace(TINY, text_dim=32), "bf16", "diffusers", seed=1)
    write_vae_checkpoint(root / "vae", DEMO_VAE)
    write_audio_vae_checkpoint(root / "audio_vae")
    if Q.HAS_TORCHVISION:
        tok = Q.make_tokenizer()
        Q.save_hf_folder(root / "text_encoder", Q.make_reference_model(tok), Q.make_processor(tok))
    return root


@pytest.fixture(scope="module")
def taeh3(tmp_path_factory):
    return write_taeh3(tmp_path_factory.mktemp("taeh3") / "taeh3.safetensors", "tiny", 3)


@pytest.fixture(scope="module")
def loaded(model_dir, taeh3):
    tracker = LoadTracker()
    return load_models(*model_spec(model_dir), tracker, text_override(model_dir), taeh3), tracker


@pytest.fixture(scope="module")
def resident(loaded):
    return loaded[0]


@pytest.fixture
def results(resident, monkeypatch):
    """Every GenerationResult the service's jobs make (a film's one per window)."""
    made = []

    def generate(req, **kwargs):
        result = type(resident).generate(resident, req, **kwargs)
        made.append(result)
        return result

    monkeypatch.setattr(resident, "generate", generate)
    return made


@pytest.fixture
def without_taeh3(resident, monkeypatch):
    monkeypatch.setattr(resident.pipeline, "taeh3", None)


def _draft(taeh3, latents):
    return decode_draft(latents, load_tiny_decoder(taeh3), DEMO_VAE)


def _vae(engine, latents):
    vae = engine.components.vae
    return vae.decode_to_buffer(vae.denormalize(latents), tile_size=256)[0]


def test_the_loader_loads_the_taeh3_and_ready_names_it(loaded, taeh3, serve):  # noqa: F811
    engine, tracker = loaded
    components = tracker.snapshot()["components"]
    assert list(components)[-1] == "taeh3" and components["taeh3"]["state"] == "resident"
    assert engine.taeh3.source == taeh3
    assert serve().get("/ready").json()["draft_decoder"] == "taeh3.safetensors"


def test_ready_says_null_without_it(serve, without_taeh3):  # noqa: F811
    assert serve().get("/ready").json()["draft_decoder"] is None


def test_a_taeh3_job_is_the_draft_of_its_latents(serve, results, resident, taeh3):  # noqa: F811
    client = serve()
    r = client.post("/generate", json=request("draft.mp4", steps=2, decoder="taeh3"))
    assert r.status_code == 202, r.text
    job = wait_job(client, r.json()["id"])
    assert job["state"] == "done", job["error"]
    assert job["request"]["decoder"] == "taeh3" and job["info"]["decoder"] == "taeh3"
    assert job["backends"]["exact"] is False and "decoder taeh3" in job["backends"]["approximate_paths"]
    [result] = results
    want = _draft(taeh3, result.video_latents)
    assert result.video.shape == want.shape == (124, 64, 64, 3)
    assert torch.equal(result.video, want)
    assert not torch.equal(result.video, _vae(resident, result.video_latents))  # the comparison can fail
    assert want.float().std() > 5


def test_the_default_job_decodes_with_the_vae(serve, results, resident):  # noqa: F811
    client = serve()
    r = client.post("/generate", json=request("full.mp4", steps=2))
    job = wait_job(client, r.json()["id"])
    assert job["state"] == "done", job["error"]
    assert job["request"]["decoder"] == "vae" and job["info"]["decoder"] == "vae"
    assert "decoder taeh3" not in job["backends"]["approximate_paths"]
    [result] = results
    assert torch.equal(result.video, _vae(resident, result.video_latents))
    assert result.video.float().std() > 5


def test_a_film_decodes_every_window_with_taeh3(serve, results, taeh3):  # noqa: F811
    client = serve()
    body = {k: v for k, v in request("film.mp4", steps=2, decoder="taeh3").items() if k != "frames"}
    r = client.post("/generate", json={**body, "seconds": 16})
    job = wait_job(client, r.json()["id"], timeout=120)
    assert job["state"] == "done", job["error"]
    assert job["info"]["decoder"] == "taeh3" and "decoder taeh3" in job["backends"]["approximate_paths"]
    assert len(results) == len(job["info"]["windows"]) == 2
    for result in results:
        assert torch.equal(result.video, _draft(taeh3, result.video_latents))


def test_v1_videos_passes_the_decoder_on(serve):  # noqa: F811
    assert ov.creation({"prompt": "p", "decoder": "taeh3"}, {}, "x.mp4").body["decoder"] == "taeh3"
    client = serve()
    r = client.post("/v1/videos", json={"prompt": "the cat", "size": "64x64", "steps": 2, "decoder": "taeh3"})
    assert r.status_code == 200, r.text
    job = wait_job(client, ov.job_id(r.json()["id"]))
    assert job["request"]["decoder"] == "taeh3" and job["backends"]["exact"] is False


def _reference_strip(decoder, latents, size, frames):
    """The strip made here: each tile the decoder's whole-window pass over the 3 latent frames up to it."""
    c, t, h, w = latents.shape
    picks = strip_picks(t, frames)
    factor = strip_factor(h, w, len(picks), size)
    tiles = []
    for i in picks:
        with torch.no_grad():
            picture = decoder(latents[:, max(0, i - 2):i + 1].permute(1, 0, 2, 3))[-1:]
        tiles.append(F.interpolate(picture, size=(h * factor, w * factor), mode="bilinear", antialias=True)[0])
    return (torch.cat(tiles, dim=2).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0)


def _png(content: bytes) -> torch.Tensor:
    from PIL import Image

    return torch.from_numpy(np.array(Image.open(io.BytesIO(content)).convert("RGB")))


def test_the_preview_is_a_decoded_strip_with_taeh3(serve, monkeypatch, resident, taeh3):  # noqa: F811
    client = serve()
    job_id = client.post("/generate", json=request("preview.mp4", steps=3)).json()["id"]
    assert wait_job(client, job_id)["state"] == "done"
    latents = client.service.queue.get(job_id).preview_latents
    decoded = _png(client.get(f"/jobs/{job_id}/preview").content)
    false_colour = preview_image(latents, 768, frames=4)
    assert decoded.shape == false_colour.shape == (192, 768, 3)  # 4 tiles of 4x4 latents, x48
    assert (decoded.float() - false_colour.float()).abs().mean() > 10
    want = _reference_strip(load_tiny_decoder(taeh3), latents, 768, 4)
    assert (decoded.int() - want.int()).abs().max() <= 1 and decoded.float().std() > 5
    monkeypatch.setattr(resident.pipeline, "taeh3", None)
    assert torch.equal(_png(client.get(f"/jobs/{job_id}/preview").content), false_colour)


# ------------------------------------------------------------------ refusals
def test_an_unknown_decoder_is_refused(serve, resident):  # noqa: F811
    r = serve().post("/generate", json=request("x.mp4", decoder="tae"))
    assert r.status_code == 400 and r.json()["error"] == "decoder must be one of vae, taeh3, got 'tae'"
    with pytest.raises(InputError) as err:
        GenerationRequest("t2va", "a cat", decoder="TAEH3").validate()
    assert str(err.value) == "decoder must be one of vae, taeh3, got 'TAEH3'"
    with pytest.raises(InputError) as err:
        resident.decode_video(torch.randn(1, 4, 2, 2, 2), decoder="taesd")
    assert str(err.value) == "decoder must be one of vae, taeh3, got 'taesd'"


NOT_LOADED = ("no TAEH3 decoder is loaded: decoder taeh3 needs the tiny temporal decoder's file (madebyollin/taehv's "
              "taeh3.safetensors) given at load (--taeh3 PATH)")


def test_taeh3_without_the_file_is_refused(serve, resident, without_taeh3):  # noqa: F811
    r = serve().post("/generate", json=request("x.mp4", decoder="taeh3"))
    assert r.status_code == 400 and r.json()["error"] == ("decoder taeh3 needs the TAEH3 file, and this service was "
                                                          "started without --taeh3 PATH; use decoder vae")
    steps = []
    with pytest.raises(InputError) as err:
        resident.generate(GenerationRequest("t2va", "a cat", width=64, height=64, steps=2, decoder="taeh3"),
                          on_progress=lambda p: steps.append(p.stage))
    assert str(err.value) == NOT_LOADED and steps == []  # before any stage runs
    with pytest.raises(InputError) as err:
        resident.decode_video(torch.randn(1, 4, 2, 2, 2), decoder="taeh3")
    assert str(err.value) == NOT_LOADED


@pytest.mark.parametrize("kind", ["2d", "missing"])
def test_serve_refuses_a_taeh3_file_that_is_not_the_temporal_decoder(tmp_path, capsys, kind):
    from safetensors.torch import save_file

    path = tmp_path / "taeh3.safetensors"
    if kind == "2d":  # Kijai's kind: blocks that see one frame
        save_file({"decoder.1.weight": torch.randn(64, 24, 3, 3), "decoder.3.conv.0.weight": torch.randn(64, 64, 3, 3)},
                  str(path))
    code = main(["serve", "--synthetic", "tiny", "--device", "cpu", "--output-dir", str(tmp_path), "--taeh3",
                 str(path)])
    err = capsys.readouterr().err
    assert code != 0 and len(err.strip().splitlines()) == 1
    if kind == "missing":
        assert f"error: --taeh3 {path}: no such file\n" in err
    else:
        assert (f"error: {path}: not the temporal TAEH3 decoder (madebyollin/taehv's taeh3.safetensors): "
                "decoder.3.conv.0.weight is [64, 64, 3, 3], a memory block's first conv is [N, 2N, 3, 3] (this "
                "frame and the last); a per-frame 2D decoder cannot decode the clip in time\n") in err
