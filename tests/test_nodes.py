"""The ComfyUI nodes on CPU, without ComfyUI: node FUNCTIONs called in graph order on tiny synthetic models.

ComfyUI's own modules are replaced by minimal fakes in sys.modules (folder_paths, comfy.utils.ProgressBar,
comfy.model_management's interruption calls). Qwen3-VL needs torchvision, which CI does not have, so a
stand-in encoder keeps the real prompt presentation (tiny tokenizer, PIL image processor) and maps
token ids through a fixed random table; everything else is the real engine. The reference for the
graph is `Pipeline.generate` on the same components: latents, frames and audio must be identical.
"""

import dataclasses
import logging
import sys
import types

import pytest
import torch

from fixtures import qwen_tiny as Q
from h3_spark import NODE_CLASS_MAPPINGS
from h3_spark.h3_model.dit.config import TINY
from h3_spark.errors import H3Error, InputError

W = H = 64  # multiples of 32; latent 4 x 4 with the 16x test VAE
FRAMES = 124  # the shortest generation (5 s)
STEPS = 2  # sampler node steps = model evaluations (pipeline steps = grid points = STEPS + 1)


def node(name):
    return NODE_CLASS_MAPPINGS[name]()


# ------------------------------------------------------------------------------------------ fake ComfyUI
class FakeFolders(types.ModuleType):
    def __init__(self, root):
        super().__init__("folder_paths")
        self.root = root

    def get_folder_paths(self, folder):
        return [str(self.root / "models" / folder)]

    def get_filename_list(self, folder):
        base = self.root / "models" / folder
        return sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())

    def get_full_path_or_raise(self, folder, name):
        path = self.root / "models" / folder / name
        if not path.is_file():
            raise FileNotFoundError(name)
        return str(path)

    def get_output_directory(self):
        return str(self.root / "output")


class Interrupted(Exception):
    pass


def fake_comfy(monkeypatch, root, interrupt_after=None, preview_method="none"):
    """Install fake folder_paths / comfy.utils / comfy.model_management / comfy.cli_args; returns the progress
    log (the previews sent go to comfy.utils.previews)."""
    log = []
    utils = types.ModuleType("comfy.utils")
    utils.previews = []

    class ProgressBar:
        def __init__(self, total):
            self.total = total

        def update_absolute(self, value, total=None, preview=None):
            log.append((value, total))
            if preview is not None:
                utils.previews.append(preview)

    utils.ProgressBar = ProgressBar
    mm = types.ModuleType("comfy.model_management")
    mm.get_torch_device = lambda: torch.device("cpu")
    mm.unet_offload_device = lambda: torch.device("cpu")
    mm.processing_interrupted = lambda: interrupt_after is not None and len(log) >= interrupt_after

    def throw():
        if mm.processing_interrupted():
            raise Interrupted("Processing interrupted")

    mm.throw_exception_if_processing_interrupted = throw
    cli_args = types.ModuleType("comfy.cli_args")
    cli_args.args = types.SimpleNamespace(preview_method=types.SimpleNamespace(value=preview_method))
    comfy = types.ModuleType("comfy")
    comfy.utils, comfy.model_management, comfy.cli_args = utils, mm, cli_args
    for name, module in (("comfy", comfy), ("comfy.utils", utils), ("comfy.model_management", mm),
                         ("comfy.cli_args", cli_args), ("folder_paths", FakeFolders(root))):
        monkeypatch.setitem(sys.modules, name, module)
    # The exact reference kernels, so the graph and the pipeline compute the same numbers.
    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")
    return log


# ------------------------------------------------------------------------------------------ tiny models
class StandInQwen:
    """Qwen3-VL's interface (prompts, encode, model, device, cache_hits) without torchvision."""

    def __init__(self, width):
        from transformers import Qwen2VLImageProcessor

        from h3_spark.h3_model.text.prompt import PresentationBuilder

        tok = Q.make_tokenizer()
        images = Qwen2VLImageProcessor(size={"shortest_edge": 64, "longest_edge": 64 * 64}, patch_size=4,
                                       temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
        self.prompts = PresentationBuilder(tok, types.SimpleNamespace(image_processor=images))
        self.model = torch.nn.Embedding(len(tok), width)
        torch.nn.init.normal_(self.model.weight, generator=torch.Generator().manual_seed(5))
        self.device = torch.device("cpu")
        self.cache_hits = 0

    @torch.no_grad()
    def encode(self, presentation):
        from h3_spark.h3_model.text.encoder import EncodedPrompt

        embeds = self.model(presentation.token_ids.to(self.device))[None].to(torch.bfloat16)
        if "pixel_values" in presentation.vision:  # let the pictures reach the embeddings too
            embeds = embeds + presentation.vision["pixel_values"].float().mean().to(embeds)
        return EncodedPrompt(embeds, presentation.tags.clone(), presentation.token_hash)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from h3_spark.h3_model.vae import video_config
    from h3_spark.h3_model.vae import synthetic as vae_synthetic
    from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint

    root = tmp_path_factory.mktemp("comfyui")
    m = root / "models"
    for sub in ("diffusion_models", "vae", "loras", "text_encoders"):
        (m / sub).mkdir(parents=True)
    (root / "output").mkdir()
    make_dit_checkpoint(m / "diffusion_models" / "tiny-t2va.safetensors", TINY, "bf16", "comfy", seed=3)
    make_dit_checkpoint(m / "diffusion_models" / "tiny-ref2va.safetensors", TINY, "bf16", "comfy", seed=4)
    # The engine's geometry is 16x spatial (the released VAE), so the test VAE is 16x too.
    vae16 = dataclasses.replace(video_config.TINY, block_out_channels=(8, 8, 16, 16), spatial_downsample_factors=(2,) * 4,
                                temporal_downsample_factors=(2, 2, 1, 1))
    vae_synthetic.write_vae_checkpoint(m / "vae" / "tiny-video-vae.safetensors", vae16, layout="comfy", seed=1)
    vae_synthetic.write_audio_vae_checkpoint(m / "vae" / "tiny-audio-vae.safetensors", "tiny", layout="comfy", seed=2)
    return root


def load_all(models, partition="auto", dit="tiny-t2va.safetensors"):
    from h3_spark.nodes import engine, host

    model = node("H3SparkModelLoader").load(dit, partition, "float32", "auto", "sdpa")[0]
    vae = node("H3SparkVAELoader").load("tiny-video-vae.safetensors", "tiny-audio-vae.safetensors", "float32", 256)[0]
    qwen = StandInQwen(TINY.text_dim)
    te = engine.TextEncoderHandle(qwen, host.make_held("text_encoder", qwen.model))
    return model, te, vae


def pipeline_for(model, te, vae, mode):
    from h3_spark.h3_model.pipeline.generation import Components, Pipeline
    from h3_spark.nodes import engine

    dit = engine.dit_of(model)
    c = Components(text_encoder=te.encoder, vae=vae.video, audio_vae=vae.audio,
                   **({"dit_ref": dit} if mode == "ref2va" else {"dit": dit}))
    return Pipeline(c)


def image(seed, h=64, w=64):
    """ComfyUI IMAGE (1, H, W, 3) in [0, 1] on the uint8 grid (so the u8 round trip is exact)."""
    return Q.image(h, w, seed)[None].float() / 255


def sound(seconds, rate=32000, channels=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"waveform": 0.1 * torch.randn(1, channels, int(seconds * rate), generator=g), "sample_rate": rate}


# ------------------------------------------------------------------------------------------ tests
def test_every_node_describes_itself():
    assert len(NODE_CLASS_MAPPINGS) == 17
    for key, cls in NODE_CLASS_MAPPINGS.items():
        spec = cls.INPUT_TYPES()
        assert set(spec) <= {"required", "optional", "hidden"}, key
        # ComfyUI's MODEL only where the node works on ComfyUI's native model; ours is H3_MODEL.
        types = {t[0] for group in spec.values() for t in group.values() if isinstance(t[0], str)}
        uses_model = "MODEL" in types | set(cls.RETURN_TYPES)
        assert uses_model == (key == "H3SparkNativeAttentionPatch"), key
        assert callable(getattr(cls, cls.FUNCTION)), key
        assert key.startswith("H3Spark") and cls.TITLE.startswith("H3 ") and cls.CATEGORY.startswith("h3-spark")
        # What ComfyUI shows: the node's description and a tooltip on every input.
        assert len(cls.DESCRIPTION) > 40, key
        for group in spec.values():
            for name, entry in group.items():
                assert len(entry) > 1 and len(entry[1].get("tooltip", "")) > 15, (key, name)
    t2va_prompt = NODE_CLASS_MAPPINGS["H3SparkTextToVideo"].INPUT_TYPES()["required"]["prompt"][1]["tooltip"]
    assert "<Picture" not in t2va_prompt  # T2VA takes no references


def test_t2va_graph_to_mp4(models, monkeypatch):
    pytest.importorskip("av")  # PyAV writes the mp4
    progress = fake_comfy(monkeypatch, models)
    model, te, vae = load_all(models)
    cond, latent = node("H3SparkTextToVideo").encode(te, "the cat says hello", W, H, FRAMES)
    video, audio = latent["samples"]
    # Without a VAE the empty latent has the released widths (as ComfyUI's); only its shape is read.
    assert video.shape == (1, 24, 37, 4, 4) and audio.shape == (1, 32, 2, 207)
    assert cond[0][1]["minimax_token_tags"].numel() == cond[0][0].shape[1]
    out = node("H3SparkSampler").sample(model, cond, latent, 7, STEPS, 12.0, 3.0)[0]
    assert progress == [(1, STEPS), (2, STEPS)]
    images, sound_out = node("H3SparkDecode").decode(vae, out)
    assert images.shape == (FRAMES, H, W, 3) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1
    assert sound_out["sample_rate"] == 32000 and sound_out["waveform"].shape == (1, 2, 207 * 800)
    ui = node("H3SparkSaveVideo").save(images, "clips/t2va", 24, 23, audio=sound_out)["ui"]
    saved = ui["images"][0]
    assert saved["subfolder"] == "clips" and saved["type"] == "output" and saved["filename"].endswith(".mp4")
    from h3_spark.h3_model.media.files import probe

    info = probe(models / "output" / "clips" / saved["filename"])
    assert (info["width"], info["height"], info["audio_codec"], info["channels"]) == (W, H, "aac", 2)
    second = node("H3SparkSaveVideo").save(images, "clips/t2va", 24, 23)["ui"]["images"][0]
    assert second["filename"] != saved["filename"]  # never overwrites


def test_pipeline_refuses_settings_before_the_expensive_stages(models, monkeypatch):
    """A bad schedule or VAE tile is refused before the text encoder runs, not after the sampling."""
    from h3_spark.h3_model.pipeline.generation import GenerationRequest

    fake_comfy(monkeypatch, models)
    model, te, vae = load_all(models)
    pipe = pipeline_for(model, te, vae, "t2va")
    encoded = []
    monkeypatch.setattr(pipe, "encode_text", lambda *a: encoded.append(1) or (_ for _ in ()).throw(AssertionError))
    for change, message in (({"video_shift": float("nan")}, "shift must be a positive finite number, got nan"),
                            ({"sigmas": [0.5, 0.7, 0.0]}, "strictly decreasing"),
                            ({"vae_tile_size": 40}, "tile size 40 px must be a multiple of 16")):
        req = GenerationRequest("t2va", "a cat", width=W, height=H, frames=FRAMES, steps=STEPS + 1, **change)
        with pytest.raises(InputError, match=message):
            pipe.generate(req)
    assert encoded == []


@pytest.mark.parametrize("mode, prompt", [("fl2va", "<Picture 1> the cat <d>says</d> the end"), ("fl2va", ""),
                                          ("ref2va", "<Picture 1> the cat <d>says</d> the end"), ("ref2va", "")])
def test_graph_equals_pipeline(models, monkeypatch, mode, prompt):
    from h3_spark.h3_model.pipeline.generation import GenerationRequest
    from h3_spark.h3_model.media.refs import AudioReference, ImageReference

    fake_comfy(monkeypatch, models)
    model, te, vae = load_all(models, dit=f"tiny-{'ref2va' if mode == 'ref2va' else 't2va'}.safetensors")
    first, last = image(1), image(2, 96, 64)  # the last keyframe is cover-cropped
    ref_image, ref_audio = image(3, 80, 48), sound(2.0, rate=32000, seed=4)
    if mode == "fl2va":
        cond, latent = node("H3SparkFirstLastFrameToVideo").encode(te, vae, prompt, W, H, FRAMES, first, last)
        req = GenerationRequest("fl2va", prompt, first_frame=Q.image(64, 64, 1), last_frame=Q.image(96, 64, 2),
                                width=W, height=H)
    else:
        cond, latent = node("H3SparkReferenceToVideo").encode(te, vae, prompt, W, H, FRAMES, "match", 24.0,
                                                              image_1=ref_image, audio_1=ref_audio)
        req = GenerationRequest("ref2va", prompt, references=[ImageReference(Q.image(80, 48, 3)),
                                                               AudioReference(ref_audio["waveform"][0])],
                                width=W, height=H)
    out = node("H3SparkSampler").sample(model, cond, latent, 11, STEPS, 12.0, 3.0)[0]
    images, audio = node("H3SparkDecode").decode(vae, out)

    req.frames, req.steps, req.seed = FRAMES, STEPS + 1, 11
    theirs = pipeline_for(model, te, vae, mode).generate(req)
    video, audio_latents = out["samples"]
    assert torch.equal(video, theirs.video_latents)
    assert torch.equal(audio_latents[0].permute(1, 0, 2), theirs.audio_latents)
    assert torch.equal((images * 255).round().to(torch.uint8), theirs.video)
    assert torch.equal(audio["waveform"][0], theirs.audio)


def test_native_payload_interop(models, monkeypatch):
    """ComfyUI's native nodes' CONDITIONING and NestedTensor LATENT run on the h3-spark sampler."""
    fake_comfy(monkeypatch, models)

    class NestedTensor:  # comfy.nested_tensor.NestedTensor's interface the nodes use
        def __init__(self, tensors):
            self.tensors = list(tensors)
            self.is_nested = True

    nested = types.ModuleType("comfy.nested_tensor")
    nested.NestedTensor = NestedTensor
    monkeypatch.setitem(sys.modules, "comfy.nested_tensor", nested)
    model, te, vae = load_all(models)
    cond, latent = node("H3SparkFirstLastFrameToVideo").encode(te, vae, "a cat", W, H, FRAMES, image(1), image(2))
    assert isinstance(latent["samples"], NestedTensor)
    ours = node("H3SparkSampler").sample(model, cond, latent, 3, STEPS, 12.0, 3.0)[0]
    assert isinstance(ours["samples"], NestedTensor)
    # What MiniMaxH3ImageToVideo builds: plain dict copies, keyframes listed last-first, a zero latent.
    embeds, extras = cond[0]
    kfs = [dict(k) for k in reversed(extras["minimax_keyframes"])]
    native = [[embeds.clone(), {"minimax_token_tags": extras["minimax_token_tags"][None], "minimax_keyframes": kfs,
                                "pooled_output": None}]]
    video, audio = latent["samples"].tensors
    theirs = node("H3SparkSampler").sample(model, native, {"samples": NestedTensor((video.clone(), audio.clone()))},
                                           3, STEPS, 12.0, 3.0)[0]
    assert all(torch.equal(a, b) for a, b in zip(ours["samples"].tensors, theirs["samples"].tensors))
    # MiniMaxH3AddGuide's guides run too: a still moved to frame 40 is a guide there (its rows move in time, so
    # the result changes), a sound guide beside it adds its rows; a frame outside the clip fails closed.
    moved = [{**kfs[0], "resolved_frame_index": 40}, kfs[1],
             {"resolved_frame_index": 24, "audio_latent": torch.randn(1, audio.shape[1], 2, 20)}]
    native[0][1]["minimax_keyframes"] = moved
    guided = node("H3SparkSampler").sample(model, native, {"samples": NestedTensor((video.clone(), audio.clone()))},
                                           3, STEPS, 12.0, 3.0)[0]
    assert not torch.equal(guided["samples"].tensors[0], ours["samples"].tensors[0])
    native[0][1]["minimax_keyframes"] = [{**kfs[0], "resolved_frame_index": 4000}]
    with pytest.raises(InputError, match="guide 1 \\(frame 4000\\): a guide's resolved_frame_index is a frame of"):
        node("H3SparkSampler").sample(model, native, latent, 3, STEPS, 12.0, 3.0)


def test_interrupt_stops_sampling(models, monkeypatch):
    progress = fake_comfy(monkeypatch, models, interrupt_after=1)
    model, te, vae = load_all(models)
    cond, latent = node("H3SparkTextToVideo").encode(te, "a cat", W, H, FRAMES)
    with pytest.raises(Interrupted):
        node("H3SparkSampler").sample(model, cond, latent, 1, 5, 12.0, 3.0)
    assert progress == [(1, 5)]


def test_wrong_partition_and_unknown_partition(models, monkeypatch):
    fake_comfy(monkeypatch, models)
    model, te, vae = load_all(models, dit="tiny-ref2va.safetensors")
    cond, latent = node("H3SparkTextToVideo").encode(te, "a cat", W, H, FRAMES)
    with pytest.raises(InputError, match="ref2va partition"):
        node("H3SparkSampler").sample(model, cond, latent, 1, STEPS, 12.0, 3.0)
    (models / "models" / "diffusion_models" / "mystery.safetensors").symlink_to(
        models / "models" / "diffusion_models" / "tiny-t2va.safetensors")
    with pytest.raises(InputError, match="cannot tell"):
        node("H3SparkModelLoader").load("mystery.safetensors", "auto", "float32", "auto", "sdpa")
    assert node("H3SparkModelLoader").load("mystery.safetensors", "t2va/fl2va", "float32", "auto", "sdpa")


@pytest.mark.parametrize("name, partition", [
    ("h3_ref2va_bf16.safetensors", "ref2va"), ("minimax-h3-t2va.safetensors", "t2va"), ("H3_FL2VA.safetensors", "t2va"),
    ("h3_t2va_refined.safetensors", "t2va"), ("h3-ref-fp8.safetensors", "ref2va"), ("h3_t2v_vs_r2v.safetensors", None),
    ("prefix_t2vax.safetensors", None)])
def test_partition_from_whole_name_tokens(tmp_path, name, partition):
    from h3_spark.nodes import engine

    if partition:
        assert engine.detect_partition(tmp_path / name, "auto") == partition
    else:
        with pytest.raises(InputError, match="cannot tell whether .* is the ref2va or the t2va/fl2va partition"):
            engine.detect_partition(tmp_path / name, "auto")


def test_partition_of_the_per_mode_download(tmp_path):
    """FL2VA/ and Ref2VA/ both hold a transformer/ folder: their model_index.json tells them apart."""
    import json

    from h3_spark.h3_model.checkpoint.released import model_index
    from h3_spark.nodes import engine

    for name, partition in (("FL2VA", "t2va"), ("Ref2VA", "ref2va")):
        (tmp_path / name / "transformer").mkdir(parents=True)
        (tmp_path / name / "model_index.json").write_text(json.dumps(model_index(partition)))
        assert engine.detect_partition(tmp_path / name, "auto") == partition
    # A folder named otherwise is judged by its index, not its name.
    (tmp_path / "FL2VA").rename(tmp_path / "mode-a")
    assert engine.detect_partition(tmp_path / "mode-a", "auto") == "t2va"
    (tmp_path / "mode-a").rename(tmp_path / "FL2VA")
    with pytest.raises(InputError, match="holds both FL2VA/ .* and Ref2VA/ .*choose the partition"):
        engine.detect_partition(tmp_path, "auto")


def test_lora_is_merged_per_run_and_taken_out(models, monkeypatch):
    from safetensors.torch import save_file

    fake_comfy(monkeypatch, models)
    g = torch.Generator().manual_seed(9)
    c = TINY
    save_file({"blocks.0.attn.out_proj.lora_A.weight": torch.randn(2, c.inner_dim, generator=g),
               "blocks.0.attn.out_proj.lora_B.weight": torch.randn(c.hidden_size, 2, generator=g),
               "blocks.1.mlp.fc2.lora_A.weight": torch.randn(2, c.ffn_dim, generator=g),
               "blocks.1.mlp.fc2.lora_B.weight": torch.randn(c.hidden_size, 2, generator=g)},
              str(models / "models" / "loras" / "tiny-lora.safetensors"))
    model, te, vae = load_all(models)
    cond, latent = node("H3SparkTextToVideo").encode(te, "a cat", W, H, FRAMES)
    sampler = node("H3SparkSampler")
    base = sampler.sample(model, cond, latent, 5, STEPS, 12.0, 3.0)[0]["samples"][0]
    weights = {n: p.clone() for n, p in model.model.inner.named_parameters()}
    lora = node("H3SparkLoraLoader").load(model, "tiny-lora.safetensors", 0.5)[0]
    with_lora = sampler.sample(lora, cond, latent, 5, STEPS, 12.0, 3.0)[0]["samples"][0]
    assert not torch.equal(with_lora, base)
    again = sampler.sample(model, cond, latent, 5, STEPS, 12.0, 3.0)[0]["samples"][0]
    assert torch.equal(again, base)  # the base MODEL gets its weights back
    assert all(torch.equal(p, weights[n]) for n, p in model.model.inner.named_parameters())


def test_pdd_lora_through_the_lora_loader_samples_with_recipe_pdd(models, monkeypatch):
    """The stock LoRA loader takes a PDD file whole: its trunk merges, its head bank rides on the DiT for the run
    and leaves with it; the sampler needs recipe pdd for it, and recipe pdd needs it."""
    from h3_spark.h3_model.checkpoint.pdd import make_pdd_lora
    from h3_spark.h3_model.dit.head_bank import HeadBank
    from h3_spark.nodes import engine

    fake_comfy(monkeypatch, models)
    make_pdd_lora(models / "models" / "loras" / "pdd.safetensors", TINY, rank=4, seed=1)
    model, te, vae = load_all(models)
    cond, latent = node("H3SparkTextToVideo").encode(te, "a cat", W, H, FRAMES)
    sampler = node("H3SparkSampler")
    base = sampler.sample(model, cond, latent, 5, STEPS, 12.0, 3.0)[0]["samples"][0]
    with pytest.raises(InputError, match="no LoRA carries one"):
        sampler.sample(model, cond, latent, 5, STEPS, 12.0, 3.0, recipe="pdd")
    pdd = node("H3SparkLoraLoader").load(model, "pdd.safetensors", 1.0)[0]
    with pytest.raises(InputError, match="pdd.safetensors is a PDD LoRA .* sample it with recipe pdd"):
        sampler.sample(pdd, cond, latent, 5, STEPS, 12.0, 3.0)
    mixes = []
    mixed = HeadBank.mixed
    monkeypatch.setattr(HeadBank, "mixed", lambda self, mix: mixes.append(mix) or mixed(self, mix))
    with_pdd = sampler.sample(pdd, cond, latent, 5, STEPS, 12.0, 3.0, recipe="pdd")[0]["samples"][0]
    assert len(mixes) == 8 and not torch.equal(with_pdd, base)
    assert engine.dit_of(pdd).head_bank is not None
    again = sampler.sample(model, cond, latent, 5, STEPS, 12.0, 3.0)[0]["samples"][0]
    assert torch.equal(again, base) and engine.dit_of(model).head_bank is None


def test_vae_loader_refuses_a_tile_size_the_decoder_cannot_use(models, monkeypatch):
    fake_comfy(monkeypatch, models)
    loader = node("H3SparkVAELoader")
    with pytest.raises(InputError, match="tile size 70 px must be a multiple of 16 and larger than the 64 px"):
        loader.load("tiny-video-vae.safetensors", "tiny-audio-vae.safetensors", "float32", 70)
    with pytest.raises(InputError, match="larger than the 64 px"):
        loader.load("tiny-video-vae.safetensors", "tiny-audio-vae.safetensors", "float32", 64)
    assert loader.load("tiny-video-vae.safetensors", "tiny-audio-vae.safetensors", "float32", 0)[0].tile_size is None


def test_vae_loader_reads_comfyuis_int8_convrot_video_vae(models, tmp_path, monkeypatch):
    """ComfyUI's minimax_h3_video_vae_int8_convrot through H3 VAE Loader and its video decode: the decoder linears
    held as stored, the frames those of the same file dequantized at load and decoded by the engine, bit for bit."""
    from h3_spark.h3_model.engine.engine import Engine
    from h3_spark.h3_model.vae import synthetic as vae_synthetic
    from h3_spark.h3_model.vae import video_config
    from h3_spark.h3_model.vae.loading import load_video_vae
    from h3_spark.kernels.stored_linear import StoredLinear

    folder = tmp_path / "models" / "vae"
    folder.mkdir(parents=True)
    vae16 = dataclasses.replace(video_config.TINY, block_out_channels=(8, 8, 16, 16), spatial_downsample_factors=(2,) * 4,
                                temporal_downsample_factors=(2, 2, 1, 1))
    path = vae_synthetic.write_vae_checkpoint(folder / "video-int8.safetensors", vae16, "comfy", 1, fmt="int8_convrot")
    (folder / "audio.safetensors").symlink_to(models / "models" / "vae" / "tiny-audio-vae.safetensors")
    fake_comfy(monkeypatch, tmp_path)
    vae = node("H3SparkVAELoader").load("video-int8.safetensors", "audio.safetensors", "float32", 0)[0]
    assert isinstance(vae.video.decoder.transformer_blocks[0].attn.to_q, StoredLinear)
    latents = torch.randn(1, vae16.latent_channels, 3, 2, 2, generator=torch.Generator().manual_seed(7))
    frames = vae.decode_video(latents)  # what H3 Decode runs for the video
    reference = Engine.of(vae=load_video_vae(path, decode_dtype=torch.float32, stored=False)).decode_video(latents,
                                                                                                            None)
    assert frames.dtype == torch.uint8 and frames.float().std() > 5
    assert torch.equal(frames, reference)


def test_lora_change_on_converted_linears_is_refused(models, monkeypatch):
    """fp8/nvfp4 linears are converted in place at the first run: a later LoRA set cannot be merged, so it is
    refused with what to do instead of failing inside the merge."""
    from safetensors.torch import save_file

    from h3_spark.nodes import engine

    fake_comfy(monkeypatch, models)
    g = torch.Generator().manual_seed(3)
    save_file({"blocks.0.attn.out_proj.lora_A.weight": torch.randn(2, TINY.inner_dim, generator=g),
               "blocks.0.attn.out_proj.lora_B.weight": torch.randn(TINY.hidden_size, 2, generator=g)},
              str(models / "models" / "loras" / "l.safetensors"))
    model, te, vae = load_all(models)
    cond, latent = node("H3SparkTextToVideo").encode(te, "a cat", W, H, FRAMES)
    sampler = node("H3SparkSampler")
    lora = node("H3SparkLoraLoader").load(model, "l.safetensors", 0.5)[0]
    sampler.sample(lora, cond, latent, 5, STEPS, 12.0, 3.0)
    dit = engine.dit_of(model)
    # What a run with linear fp8 leaves behind (the conversion itself needs a Hopper GPU).
    dit.__dict__["_h3_spark_kernels"]["report"]["linear"] = {"format": "fp8", "exact": False}
    sampler.sample(lora, cond, latent, 5, STEPS, 12.0, 3.0)  # the same set still runs
    with pytest.raises(InputError, match=r"linears already run as fp8 with l.safetensors at 0.5; another LoRA "
                                         r"set \(no LoRA\) needs its bf16 weights"):
        sampler.sample(model, cond, latent, 5, STEPS, 12.0, 3.0)


def test_sampler_logs_what_the_kernels_resolved_to(models, monkeypatch, caplog):
    import logging

    fake_comfy(monkeypatch, models)
    model, te, vae = load_all(models)
    cond, latent = node("H3SparkTextToVideo").encode(te, "a cat", W, H, FRAMES)
    sampler = node("H3SparkSampler")
    from h3_spark.nodes import engine

    with caplog.at_level(logging.INFO, logger="h3_spark"):
        sampler.sample(model, cond, latent, 5, STEPS, 12.0, 3.0)
        sampler.sample(model, cond, latent, 5, STEPS, 12.0, 3.0)
        dit = engine.dit_of(model)
        configured = dit.attention
        patched = node("H3SparkAttentionPatch").patch(model, "auto")[0]
        sampler.sample(patched, cond, latent, 5, STEPS, 12.0, 3.0)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("h3-spark kernels")]
    assert len(lines) == 2, lines  # once per change, not per run
    assert lines[0].startswith("h3-spark kernels: attention sdpa (asked sdpa), linear ") and lines[0].endswith("exact")
    assert "(asked auto)" in lines[1]
    # auto says why it passed over each faster backend; the run's switch is undone after it.
    assert "; auto refused fa3: fa3 needs sm_90" in lines[1] and "; cudnn_sdpa: cudnn_sdpa needs sm_80" in lines[1]
    assert dit.attention is configured


def test_attention_patch(models, monkeypatch):
    from h3_spark.kernels.attention import math_reference
    from h3_spark.nodes import engine

    fake_comfy(monkeypatch, models)
    model, te, vae = load_all(models)
    patched = node("H3SparkAttentionPatch").patch(model, "auto")[0]
    assert engine.options(patched)["attention"] == "auto" and engine.options(model)["attention"] == "sdpa"
    with pytest.raises(H3Error, match="fa3"):
        node("H3SparkAttentionPatch").patch(model, "fa3")  # Hopper only: refused, not swapped for another

    # ComfyUI's native H3 model: a ModelPatcher whose diffusion_model lives in comfy.ldm.minimax.
    native_cls = type("MiniMaxH3Model", (), {"__module__": "comfy.ldm.minimax.model"})
    native = engine.host.LocalModel(types.SimpleNamespace(diffusion_model=native_cls()), torch.device("cpu"))
    with pytest.raises(InputError, match=r"takes an h3-spark H3_MODEL; for ComfyUI's native MiniMax H3 MODEL use "
                                         r"H3 Attention Patch \(native model\)"):
        node("H3SparkAttentionPatch").patch(native, "sdpa")
    with pytest.raises(InputError, match=r"takes ComfyUI's native MiniMax H3 MODEL; an h3-spark H3_MODEL takes"):
        node("H3SparkNativeAttentionPatch").patch(model, "sdpa")
    other = engine.host.LocalModel(types.SimpleNamespace(diffusion_model=torch.nn.Linear(2, 2)), torch.device("cpu"))
    with pytest.raises(InputError, match=r"native MiniMax H3 MODEL \(comfy.ldm.minimax\), got Linear"):
        node("H3SparkNativeAttentionPatch").patch(other, "sdpa")
    override = node("H3SparkNativeAttentionPatch").patch(native, "sdpa")[0].model_options["transformer_options"][
        "optimized_attention_override"]
    assert "optimized_attention_override" not in native.model_options["transformer_options"]
    q, k, v = (torch.randn(1, 2, 10, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    out = override(None, q, k, v, 2, skip_reshape=True, transformer_options={}, _inside_attn_wrapper=True)
    want = math_reference(*(t.transpose(1, 2) for t in (q, k, v))).reshape(1, 10, 32)
    assert out.shape == (1, 10, 32) and torch.allclose(out, want, atol=1e-5)
    flat = [t.transpose(1, 2).reshape(1, 10, 32) for t in (q, k, v)]
    assert torch.allclose(override(None, *flat, 2), want, atol=1e-5)
    with pytest.raises(H3Error, match="mask"):
        override(None, q, k, v, 2, torch.zeros(10, 10), skip_reshape=True)
    import copy

    assert isinstance(copy.deepcopy(override), engine.ComfyAttentionOverride)  # ComfyUI clones deep-copy options


def test_step_cache_options_reach_the_engine(models, monkeypatch, caplog):
    fake_comfy(monkeypatch, models)
    optional = NODE_CLASS_MAPPINGS["H3SparkSampler"].INPUT_TYPES()["optional"]
    assert optional["cache"][0][0] == "off" and "h3_cache" in optional["cache"][0]
    model, te, vae = load_all(models)
    cond, latent = node("H3SparkTextToVideo").encode(te, "a cat", W, H, FRAMES)
    sampler = node("H3SparkSampler")
    exact = sampler.sample(model, cond, latent, 1, 6, 12.0, 3.0)[0]["samples"][0]
    assert torch.equal(sampler.sample(model, cond, latent, 1, 6, 12.0, 3.0, "off")[0]["samples"][0], exact)
    with caplog.at_level("INFO", logger="h3_spark"):
        cached = sampler.sample(model, cond, latent, 1, 6, 12.0, 3.0, "h3_cache", 10.0, 0.0, 1.0, 1)[0]
    assert "'reused': [1, 2, 3, 4, 5]" in caplog.text  # threshold 10 reuses every step after the first
    assert not torch.equal(cached["samples"][0], exact)
    with pytest.raises(InputError):
        sampler.sample(model, cond, latent, 1, 6, 12.0, 3.0, "h3_cache", 0.1, 0.9, 0.1, 1)


def test_bad_inputs_fail_with_clear_messages(models, monkeypatch):
    fake_comfy(monkeypatch, models)
    model, te, vae = load_all(models)
    t2v = node("H3SparkTextToVideo")
    with pytest.raises(InputError, match="multiples of 32"):
        t2v.encode(te, "a cat", 70, 64, FRAMES)
    with pytest.raises(InputError, match="5-15 s"):
        t2v.encode(te, "a cat", W, H, 40)
    with pytest.raises(InputError, match="t2va needs a prompt: it is all the text encoder reads"):
        t2v.encode(te, "", W, H, FRAMES)
    with pytest.raises(InputError, match="needs a first and/or a last"):
        node("H3SparkFirstLastFrameToVideo").encode(te, vae, "a cat", W, H, FRAMES)
    with pytest.raises(InputError, match=r"the prompt writes <picture 1>; the model knows a reference only as "):
        node("H3SparkReferenceToVideo").encode(te, vae, "<picture 1> sings", W, H, FRAMES, "match", 24.0,
                                               image_1=image(1))
    with pytest.raises(InputError, match="soundtrack of video_1"):
        node("H3SparkReferenceToVideo").encode(te, vae, "a cat", W, H, FRAMES, "match", 24.0,
                                               video_1_audio=sound(1.0))
    cond, latent = t2v.encode(te, "a cat", W, H, FRAMES)
    with pytest.raises(InputError, match="one conditioning entry"):
        node("H3SparkSampler").sample(model, cond + cond, latent, 1, STEPS, 12.0, 3.0)
    with pytest.raises(InputError, match="not a MiniMax H3 audio-video latent"):
        node("H3SparkSampler").sample(model, cond, {"samples": torch.zeros(1, 4, 8, 8)}, 1, STEPS, 12.0, 3.0)
    save = node("H3SparkSaveVideo")
    for prefix in ("../escape", "/abs/path", "a/../../escape"):
        with pytest.raises(InputError, match="output folder"):
            save.save(torch.zeros(1, 32, 32, 3), prefix, 24, 18)


def test_sampler_recipes(models, monkeypatch, caplog):
    """turbo replaces steps and shifts (said in the log); first-block-cache at threshold 0 computes every step, so
    the latents equal a plain run with turbo's settings; what cannot run here is refused in one line."""
    import logging

    fake_comfy(monkeypatch, models)
    model, te, _ = load_all(models)
    cond, latent = node("H3SparkTextToVideo").encode(te, "a cat", W, H, FRAMES)
    sampler = node("H3SparkSampler")
    plain = sampler.sample(model, cond, latent, 5, 3, 6.0, 2.5)[0]["samples"]
    with caplog.at_level(logging.INFO, logger="h3_spark"):
        got = sampler.sample(model, cond, latent, 5, 49, 12.0, 3.0,
                             recipe="turbo:evaluations=3,audio_shift=2.5; first-block-cache:threshold=0")[0]["samples"]
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])
    assert "recipe turbo replaces steps 49 and shifts 12/3 with 3 and 6/2.5" in caplog.text
    assert "h3-spark recipes (approximate): name=turbo" in caplog.text
    with pytest.raises(InputError, match="recipe sparse needs Sol-Attn"):
        sampler.sample(model, cond, latent, 5, 3, 12.0, 3.0, recipe="sparse")
    with pytest.raises(InputError, match="unknown recipe 'fast'"):
        sampler.sample(model, cond, latent, 5, 3, 12.0, 3.0, recipe="fast")
    with pytest.raises(InputError, match="set the sampler's cache to off"):
        sampler.sample(model, cond, latent, 5, 3, 12.0, 3.0, cache="h3_cache", recipe="first-block-cache")


def test_sampler_name_and_scheduler_inputs(models, monkeypatch):
    """The H3 Sampler's optional sampler_name (euler, res_multistep) and scheduler (h3, simple, beta, normal): the
    defaults are today's run bit for bit; the others sample as the pipeline does; a bad value or one a recipe
    overrides is refused in one line."""
    from h3_spark.h3_model.pipeline.generation import GenerationRequest, Pipeline, schedule_of

    fake_comfy(monkeypatch, models)
    optional = NODE_CLASS_MAPPINGS["H3SparkSampler"].INPUT_TYPES()["optional"]
    assert optional["sampler_name"][0] == ["euler", "res_multistep"] and optional["sampler_name"][1]["default"] == "euler"
    assert optional["scheduler"][0] == ["h3", "simple", "beta", "normal"] and optional["scheduler"][1]["default"] == "h3"
    assert "res_multistep: ComfyUI's second-order" in optional["sampler_name"][1]["tooltip"]
    assert "beta: ComfyUI's beta" in optional["scheduler"][1]["tooltip"]
    model, te, _ = load_all(models)
    cond, latent = node("H3SparkTextToVideo").encode(te, "a cat", W, H, FRAMES)
    sampler = node("H3SparkSampler")
    plain = sampler.sample(model, cond, latent, 5, 3, 12.0, 3.0)[0]["samples"]
    named = sampler.sample(model, cond, latent, 5, 3, 12.0, 3.0, sampler_name="euler", scheduler="h3")[0]["samples"]
    assert torch.equal(plain[0], named[0]) and torch.equal(plain[1], named[1])
    seen = []
    original = Pipeline.sample
    monkeypatch.setattr(Pipeline, "sample", lambda self, *a, **k: seen.append((a[2], k["sampler"])) or
                        original(self, *a, **k))
    res = sampler.sample(model, cond, latent, 5, 3, 12.0, 3.0, sampler_name="res_multistep",
                         scheduler="simple")[0]["samples"]
    schedule, used = seen[-1]
    want = schedule_of(GenerationRequest(mode="t2va", prompt="a", steps=4, scheduler="simple"))
    assert used == "res_multistep" and torch.equal(schedule.video.sigmas, want.video.sigmas)
    assert torch.equal(schedule.audio.sigmas, want.audio.sigmas) and not torch.equal(res[0], plain[0])
    with pytest.raises(InputError, match=r"^unknown sampler 'heun'; the samplers are euler, res_multistep$"):
        sampler.sample(model, cond, latent, 5, 3, 12.0, 3.0, sampler_name="heun")
    with pytest.raises(InputError, match=r"^unknown scheduler 'karras'"):
        sampler.sample(model, cond, latent, 5, 3, 12.0, 3.0, scheduler="karras")
    with pytest.raises(InputError, match=r"^recipe turbo samples its own grid \(h3\), not scheduler beta: set the "
                                         r"sampler node's scheduler to h3$"):
        sampler.sample(model, cond, latent, 5, 3, 12.0, 3.0, recipe="turbo", scheduler="beta")


@pytest.mark.parametrize("name", ["H3SparkTextToVideo", "H3SparkFirstLastFrameToVideo", "H3SparkReferenceToVideo"])
def test_canvas_and_length_are_checked_before_the_queue(name):
    cls = type(node(name))
    assert cls.VALIDATE_INPUTS(width=1344, height=768) is True
    assert cls.VALIDATE_INPUTS(width=None, height=None) is True  # wired from other nodes: later
    assert cls.VALIDATE_INPUTS(width=1000, height=768) == "width 1000 is not a multiple of 32 (992 or 1024 is)"
    assert cls.VALIDATE_INPUTS(width=8192, height=700) == ("width 8192 is outside 32..4096; height 700 is not a "
                                                           "multiple of 32 (672 or 704 is)")
    assert "outside 1:4 .. 4:1" in cls.VALIDATE_INPUTS(width=2048, height=256)
    # The length is ComfyUI's own range check (its min and max), every length inside it from 124 snaps to one H3
    # makes; H3 Text to Video also takes 1, a still (lengths between are refused when the node runs).
    length = cls.INPUT_TYPES()["required"]["length"][1]
    from h3_spark.h3_model import geometry

    assert (length["min"], length["max"]) == (1 if name == "H3SparkTextToVideo" else 124, 345)
    assert all(geometry.snap_frames(n) for n in [1, *range(124, 346)])


def test_a_snapped_length_is_reported(models, monkeypatch, caplog):
    import logging

    fake_comfy(monkeypatch, models)
    _, te, _ = load_all(models)
    with caplog.at_level(logging.WARNING, logger="h3_spark"):
        _, latent = node("H3SparkTextToVideo").encode(te, "a cat", W, H, 130)
    assert "length 130 snaps up to 141 frames (5.88 s): H3 makes 17n+5 frames" in caplog.text


def test_the_sampler_sends_a_live_preview_when_comfyui_shows_previews(models, monkeypatch):
    fake_comfy(monkeypatch, models, preview_method="auto")
    model, te, _ = load_all(models)
    cond, latent = node("H3SparkTextToVideo").encode(te, "a cat", W, H, FRAMES)
    node("H3SparkSampler").sample(model, cond, latent, 5, 3, 12.0, 3.0)
    previews = sys.modules["comfy.utils"].previews
    assert len(previews) == 3  # one per step
    kind, image, size = previews[-1]
    assert kind == "JPEG" and size == 512 and image.mode == "RGB" and max(image.size) <= 512
    assert len(set(image.getdata())) > 8  # a picture, not a flat colour
    fake_comfy(monkeypatch, models, preview_method="none")
    model, te, _ = load_all(models)
    node("H3SparkSampler").sample(model, cond, latent, 5, 3, 12.0, 3.0)
    assert sys.modules["comfy.utils"].previews == []  # ComfyUI's setting says none


def test_a_model_folder_is_offered_once_and_its_files_are_not(tmp_path, monkeypatch):
    """The loaders list a diffusers folder as `name/`, not also the weights inside it (picking one of those
    loaded a part of the model and failed with a message that did not say to pick the folder)."""
    base = tmp_path / "models" / "diffusion_models"
    (base / "h3-t2va").mkdir(parents=True)
    (base / "h3-t2va" / "config.json").write_text("{}")
    (base / "h3-t2va" / "diffusion_pytorch_model.safetensors").write_bytes(b"x")
    (base / "single.safetensors").write_bytes(b"x")
    from h3_spark.nodes import host

    monkeypatch.setitem(sys.modules, "folder_paths", FakeFolders(tmp_path))
    assert host.model_choices("diffusion_models", folders=True) == ["h3-t2va/", "single.safetensors"]
    assert host.model_choices("diffusion_models") == ["h3-t2va/diffusion_pytorch_model.safetensors",
                                                      "single.safetensors"]  # files-only lists keep them


def test_previews_use_the_tiny_decoder_when_models_vae_approx_has_taeh3(models, monkeypatch):
    from safetensors.torch import save_file

    from h3_spark.h3_model.vae.tiny_decoder import TinyVideoDecoder
    from h3_spark.nodes import host

    fake_comfy(monkeypatch, models, preview_method="auto")
    model, te, _ = load_all(models)
    channels = model.model.inner.config.in_channels
    folder = models / "models" / "vae_approx"
    folder.mkdir(parents=True, exist_ok=True)
    tiny = TinyVideoDecoder(latent_channels=channels)
    save_file({f"decoder.{k}": v.contiguous() for k, v in tiny.decoder.state_dict().items()},
              str(folder / "taeh3.safetensors"))
    monkeypatch.setattr(host, "_tiny_decoders", {})
    try:
        cond, latent = node("H3SparkTextToVideo").encode(te, "a cat", W, H, FRAMES)
        node("H3SparkSampler").sample(model, cond, latent, 5, 2, 12.0, 3.0)
        _, image, _ = sys.modules["comfy.utils"].previews[-1]
        assert image.size == (W, H)  # 16 pixels per latent cell: the decoded frame, at the canvas size
        assert list(host._tiny_decoders.values())[0].latent_channels == channels
    finally:
        (folder / "taeh3.safetensors").unlink()


# ------------------------------------------------------------------------------------------ VAEs under model management
GiB = 2 ** 30
CUDA = torch.device("cuda", 0)


class FakeModelPatcher:
    """comfy.model_patcher.ModelPatcher's members the VAEs' patcher builds on."""

    def __init__(self, model, load_device, offload_device, size=0, weight_inplace_update=False):
        self.model, self.load_device, self.offload_device, self.size = model, load_device, offload_device, size
        self.model_options = {"transformer_options": {}}
        model.device, model.model_loaded_weight_memory, model.model_lowvram = offload_device, 0, False

    def model_size(self):
        return self.size or sum(t.numel() * t.element_size() for t in self.model.state_dict().values())

    def loaded_size(self):
        return self.model.model_loaded_weight_memory

    def detach(self, unpatch_all=True):
        self.unpatch_model(self.offload_device, unpatch_all)
        return self.model

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        if unpatch_weights and device_to is not None:
            self.model.to(device_to)
            self.model.device = device_to
        self.model.model_loaded_weight_memory = 0


class FakeDiT(FakeModelPatcher):
    """What our DiT's patcher offers ComfyUI, in bytes alone: it gives up what it is asked to (blocks stream)."""

    def __init__(self, size):
        from h3_spark.nodes import host

        super().__init__(host.Held("dit", torch.nn.Linear(1, 1)), CUDA, torch.device("cpu"), size)
        self.loaded = 0

    def loaded_size(self):
        return self.loaded

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        added, self.loaded = self.size - self.loaded, self.size
        return added

    def partially_unload(self, device_to, memory_to_free=0):
        freed = min(memory_to_free, self.loaded)
        self.loaded -= freed
        return freed

    def detach(self, unpatch_all=True):
        self.loaded = 0
        return self.model


class FakeGPU:
    """ComfyUI's model management over a GPU of `total` bytes, `taken` of them held by other programs: the
    loaded models, each load_models_gpu call, and each move of a held module (recorded, not made: this machine
    has no GPU, so the VAEs compute where they are)."""

    def __init__(self, mm, total, taken):
        self.mm, self.total, self.taken = mm, total, taken
        self.loaded, self.calls, self.moves = [], [], []

    def free(self):
        return self.total - self.taken - sum(m.loaded_size() for m in self.loaded)

    def load_models_gpu(self, models, memory_required=0, force_patch_weights=False, minimum_memory_required=None,
                        force_full_load=False):
        self.calls.append({"models": [m.model.kind for m in models], "memory_required": memory_required,
                           "minimum_memory_required": minimum_memory_required, "force_full_load": force_full_load})
        keep = max(self.mm.minimum_inference_memory(), memory_required + self.mm.extra_reserved_memory())
        for model in models:
            self.make_room(model.model_size() - model.loaded_size() + keep, model)
            model.partially_load(model.load_device, 1e32)
            if model not in self.loaded:
                self.loaded.insert(0, model)

    def make_room(self, required, keep):
        # As ComfyUI: the models with the most already offloaded go first, each partially when that is enough.
        for other in sorted((m for m in self.loaded if m is not keep), key=lambda m: m.loaded_size() - m.model_size()):
            if self.free() >= required:
                return
            short = required - self.free()
            if short < other.loaded_size() and other.partially_unload(other.offload_device, short) >= short:
                continue
            other.detach()
            self.loaded.remove(other)

    def unload_all_models(self):
        for model in self.loaded:
            model.detach()
        self.loaded.clear()

    def moved(self, kind):
        return [device for k, device in self.moves if k == kind]


def fake_model_management(monkeypatch, root, total, taken=0, reserve=0.4 * GiB):
    """fake_comfy with ComfyUI's ModelPatcher and a GPU's model management (FakeGPU, returned)."""
    import functools

    from h3_spark.nodes import host
    from h3_spark.nodes import vae as vaes

    fake_comfy(monkeypatch, root)
    mm = sys.modules["comfy.model_management"]
    gpu = FakeGPU(mm, total, taken)
    mm.get_torch_device = mm.vae_device = lambda: CUDA
    mm.vae_offload_device = lambda: torch.device("cpu")
    mm.extra_reserved_memory = lambda: reserve
    mm.minimum_inference_memory = lambda: 0.8 * GiB + reserve
    mm.get_free_memory = lambda dev=None, torch_free_too=False: gpu.free()
    mm.load_models_gpu, mm.unload_all_models = gpu.load_models_gpu, gpu.unload_all_models
    mm.soft_empty_cache = lambda force=False: None
    patcher = types.ModuleType("comfy.model_patcher")
    patcher.ModelPatcher = FakeModelPatcher
    monkeypatch.setitem(sys.modules, "comfy.model_patcher", patcher)
    # The VAEs' patcher class is made once per ComfyUI: a fresh cache over this fake's ModelPatcher.
    monkeypatch.setattr(vaes, "vae_patcher_class", functools.cache(vaes.vae_patcher_class.__wrapped__))
    monkeypatch.setattr(host.Held, "to", lambda self, device: gpu.moves.append((self.kind, torch.device(device).type))
                        or self)
    return gpu


def decode_latent(vae, seed=0):
    """A LATENT the tiny VAEs decode at 256x256 px: 3 x 3 tiles of 128 px per window, so tiles per call matter."""
    from h3_spark.nodes import payload

    g = torch.Generator().manual_seed(seed)
    video = torch.randn(1, vae.video.config.latent_channels, 7, 16, 16, generator=g)
    audio = torch.randn(2, vae.audio.config.latent_channels, 40, generator=g)
    return payload.pack_latent(video, payload.audio_to_comfy(audio))


def load_vae(tile_size=128):
    return node("H3SparkVAELoader").load("tiny-video-vae.safetensors", "tiny-audio-vae.safetensors", "float32",
                                         tile_size)[0]


def record_decodes(vae, gpu):
    """(tiles per decoder call, load_models_gpu calls so far) at each video decode."""
    runs, decode = [], vae.video.decode_to_buffer

    def recorded(*args, **kwargs):
        runs.append((vae.video.tile_batch, len(gpu.calls)))
        return decode(*args, **kwargs)

    vae.video.decode_to_buffer = recorded
    return runs


def margin(gpu):
    return int(gpu.mm.minimum_inference_memory() - gpu.mm.extra_reserved_memory())


def test_the_decode_declares_its_working_memory_and_comfyui_makes_room_for_it(models, monkeypatch):
    """ComfyUI is asked for the decode's working memory (its memory plan at H3_VAE_TILE_BATCH tiles per call, and
    at one) before the decode runs, and takes that room from the DiT; the VAE then stays loaded, as ComfyUI's own
    does, until the DiT's next load, or the free-memory button, sends it back whole."""
    from h3_spark.nodes import vae as vaes

    gpu = fake_model_management(monkeypatch, models, total=4 * GiB)
    dit = FakeDiT(3 * GiB)
    gpu.load_models_gpu([dit])
    vae = load_vae()
    assert (vae.video_patcher.load_device, vae.video_patcher.offload_device) == (CUDA, torch.device("cpu"))
    runs = record_decodes(vae, gpu)
    latent = decode_latent(vae)
    free_before = gpu.free()
    images, audio = node("H3SparkDecode").decode(vae, latent)

    work = vaes.decode_work(vae.video, latent["samples"][0].shape, 128, vae.tile_batch)
    sound_work = vaes.audio_work(vae.audio)
    assert work.wanted > work.least > 0  # nine tiles a window: a batch of them needs more than one
    assert gpu.calls[1:] == [{"models": ["vae"], "memory_required": work.wanted + margin(gpu),
                              "minimum_memory_required": work.least + margin(gpu), "force_full_load": True},
                             {"models": ["audio_vae"], "memory_required": sound_work.wanted + margin(gpu),
                              "minimum_memory_required": sound_work.least + margin(gpu), "force_full_load": True}]
    assert runs == [(vae.tile_batch, 2)]  # after the video VAE's load, before the audio VAE's, at the most tiles
    # The DiT gave up the weights, the working memory and ComfyUI's reserve, not the weights alone.
    video_weights = vae.video_patcher.model_size()
    assert 3 * GiB - dit.loaded >= video_weights + work.wanted + int(gpu.mm.minimum_inference_memory()) - free_before
    assert gpu.moved("vae") == ["cuda"] and gpu.moved("audio_vae") == ["cuda"]  # each whole, once
    assert vae.video_patcher.loaded_size() == video_weights and vae.video.tile_batch == vae.tile_batch
    assert images.shape == (22, 256, 256, 3) and audio["waveform"].shape[:2] == (1, 2)

    gpu.load_models_gpu([dit], memory_required=int(3.5 * GiB))  # the sampler's next load takes the room back
    assert gpu.moved("vae") == ["cuda", "cpu"] and vae.video_patcher.loaded_size() == 0
    node("H3SparkDecode").decode(vae, latent)
    gpu.unload_all_models()  # "Free model and node cache"
    assert gpu.moved("vae")[-2:] == ["cuda", "cpu"] and gpu.moved("audio_vae")[-1] == "cpu"
    assert vae.video_patcher.loaded_size() == vae.audio_patcher.loaded_size() == 0


def test_the_decode_takes_as_many_tiles_per_call_as_the_free_memory_holds(models, monkeypatch):
    from h3_spark.nodes import vae as vaes

    gpu = fake_model_management(monkeypatch, models, total=16 * GiB)
    vae = load_vae()
    latent = decode_latent(vae)
    size = tuple(latent["samples"][0].shape[2:])
    need = {b: vaes.decode_bytes(vae.video, size, 128, b) for b in (1, 4, 5)}
    assert need[1] < need[4] < need[5]
    # What stays free once the weights are loaded: four tiles' working memory and ComfyUI's reserve, not five.
    gpu.taken = gpu.total - vae.video_patcher.model_size() - int(gpu.mm.minimum_inference_memory()) - need[4]
    runs = record_decodes(vae, gpu)
    images, _ = node("H3SparkDecode").decode(vae, latent)
    assert runs == [(4, 1)] and vae.video.tile_batch == vae.tile_batch == 16
    # Tiles decoded together change only the kernels' rounding.
    gpu.taken = 0
    gpu.unload_all_models()
    wide, _ = node("H3SparkDecode").decode(vae, latent)
    assert runs[-1] == (16, 3) and (wide - images).abs().max() <= 1 / 255


def test_a_vae_stage_that_cannot_fit_fails_in_one_line(models, monkeypatch):
    """Not even one tile's working memory beside the weights: a one-line error naming the memory and what lowers
    it, before anything moves; CUDA running out inside the decode all the same retries at one tile per call,
    then fails in one line too."""
    from h3_spark.nodes import vae as vaes

    gpu = fake_model_management(monkeypatch, models, total=16 * GiB)
    vae = load_vae()
    latent = decode_latent(vae)
    work = vaes.decode_work(vae.video, latent["samples"][0].shape, 128, vae.tile_batch)
    weights = vae.video_patcher.model_size()
    gpu.taken = gpu.total - weights - int(gpu.mm.minimum_inference_memory()) - work.least + 1
    with pytest.raises(InputError) as failed:
        node("H3SparkDecode").decode(vae, latent)
    message = str(failed.value)
    assert "\n" not in message and message.startswith("the H3 video VAE decode needs ")
    assert f"to work in, beside ComfyUI's reserve of {vaes.gb(int(gpu.mm.minimum_inference_memory()))}" in message
    assert "lower tile_size on H3 VAE Loader" in message and "float16" in message and "--cpu-vae" in message
    assert gpu.moved("vae") == [] and vae.video_patcher.loaded_size() == 0

    first, last = image(1), image(2)
    te = qwen_handle()
    need = vaes.encode_bytes(vae.video.config, 1, H, W, 128)
    gpu.taken = gpu.total - weights - int(gpu.mm.minimum_inference_memory()) - need + 1
    with pytest.raises(InputError, match=r"^the H3 video VAE encode needs .*: lower tile_size .*, use smaller or "
                                         r"shorter images and videos, or start ComfyUI with --cpu-vae \(slow\)$"):
        node("H3SparkFirstLastFrameToVideo").encode(te, vae, "a cat", W, H, FRAMES, first, last)

    gpu.taken = 0
    runs, decode = [], vae.video.decode_to_buffer

    def out_of_memory_above_one_tile(*args, **kwargs):
        runs.append(vae.video.tile_batch)
        if vae.video.tile_batch > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        return decode(*args, **kwargs)

    vae.video.decode_to_buffer = out_of_memory_above_one_tile
    images, _ = node("H3SparkDecode").decode(vae, latent)
    assert runs == [16, 1] and images.shape[0] == 22

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory.")

    vae.video.decode_to_buffer = out_of_memory
    with pytest.raises(InputError, match=r"^the H3 video VAE decode ran out of GPU memory \(planned .* beside the "
                                         r"weights\): lower tile_size"):
        node("H3SparkDecode").decode(vae, latent)


def qwen_handle():
    from h3_spark.nodes import engine, host

    qwen = StandInQwen(TINY.text_dim)
    return engine.TextEncoderHandle(qwen, host.LocalModel(host.Held("text_encoder", qwen.model), torch.device("cpu")))


def test_the_encodes_declare_their_bound_one_vae_at_a_time(models, monkeypatch):
    """Keyframes and references: the video VAE is loaded once for the largest image or video it encodes (the
    encode bound), then the audio VAE for the sounds; never both in one load, so neither pushes the other out
    between its load and its use."""
    from h3_spark.nodes import vae as vaes

    gpu = fake_model_management(monkeypatch, models, total=16 * GiB)
    vae, te = load_vae(), qwen_handle()
    node("H3SparkFirstLastFrameToVideo").encode(te, vae, "a cat", W, H, FRAMES, image(1), image(2))
    keyframe = vaes.encode_bytes(vae.video.config, 1, H, W, 128)
    assert gpu.calls == [{"models": ["vae"], "memory_required": keyframe + margin(gpu),
                          "minimum_memory_required": keyframe + margin(gpu), "force_full_load": True}]
    from h3_spark.h3_model.media.refs import ImageReference, prepare_references

    node("H3SparkReferenceToVideo").encode(te, vae, "a cat", W, H, FRAMES, "match", 24.0, image_1=image(3, 80, 48),
                                           image_2=image(4), audio_1=sound(2.0))
    prepared = prepare_references([ImageReference(Q.image(80, 48, 3)), ImageReference(Q.image(64, 64, 4))],
                                  width=W, height=H, frames=FRAMES, policy="match")
    largest = max(vaes.encode_bytes(vae.video.config, 1, *p.pixels.shape[:2], 128) for p in prepared)
    assert [c["models"] for c in gpu.calls[1:]] == [["vae"], ["audio_vae"]]
    assert gpu.calls[1]["memory_required"] == largest + margin(gpu) == gpu.calls[1]["minimum_memory_required"]
    assert gpu.calls[2]["memory_required"] == vaes.audio_work(vae.audio).wanted + margin(gpu)


def test_the_model_loader_keeps_a_quantized_file_in_its_stored_form(tmp_path):
    """ComfyUI's share of the GPU gets stored bytes: the H3 Model Loader reads an int8_convrot file through the
    engine's loader, whose quantized layers stay int8 codes (StoredLinear) until their GEMM."""
    from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint
    from h3_spark.kernels.stored_linear import StoredLinear
    from h3_spark.nodes import engine

    path = tmp_path / "tiny-int8.safetensors"
    make_dit_checkpoint(path, TINY, "int8_convrot", "comfy", seed=3)
    dit = engine.dit_of(engine.load_model(path, "t2va/fl2va", "float32", "auto", "sdpa"))
    stored = [m for m in dit.transformer_blocks.modules() if isinstance(m, StoredLinear)]
    assert len(stored) == 6 * TINY.num_layers and {m.weight.dtype for m in stored} == {torch.int8}


# ------------------------------------------------------------------------------------------ issue 32: first-run edges
def test_each_vae_slot_offers_its_own_kind_first(models, tmp_path, monkeypatch):
    """models/vae holds both H3 VAEs and other models' VAEs; each slot lists its own kind first (ComfyUI's
    frontend preselects the first), what is neither next, the other kind last: all names stay valid."""
    import shutil

    from h3_spark.h3_model.vae import synthetic as vae_synthetic
    from safetensors.torch import save_file

    vae = tmp_path / "models" / "vae"
    vae.mkdir(parents=True)
    for name in ("tiny-video-vae.safetensors", "tiny-audio-vae.safetensors"):
        shutil.copy(models / "models" / "vae" / name, vae / name)
    vae_synthetic.write_vae_checkpoint(vae / "b-video-folder", "tiny", layout="diffusers", seed=3)
    g = torch.Generator().manual_seed(0)  # an image model's VAE in ComfyUI's names: neither kind
    save_file({"encoder.down.0.block.0.conv1.weight": torch.randn(4, 3, 3, 3, generator=g),
               "decoder.conv_in.weight": torch.randn(4, 4, 3, 3, generator=g)}, str(vae / "a-sdxl-vae.safetensors"))
    fake_comfy(monkeypatch, tmp_path)
    spec = type(node("H3SparkVAELoader")).INPUT_TYPES()["required"]
    assert spec["vae_name"][0] == ["b-video-folder/", "tiny-video-vae.safetensors", "a-sdxl-vae.safetensors",
                                   "tiny-audio-vae.safetensors"]
    assert spec["audio_vae_name"][0] == ["tiny-audio-vae.safetensors", "a-sdxl-vae.safetensors", "b-video-folder/",
                                         "tiny-video-vae.safetensors"]


def test_a_vae_in_the_wrong_slot_is_named_before_it_loads(models, monkeypatch):
    fake_comfy(monkeypatch, models)
    loader = node("H3SparkVAELoader")
    with pytest.raises(InputError, match=r"^tiny-video-vae.safetensors: this is the video VAE, in the audio slot "
                                         r"\(audio_vae_name\); pick it as vae_name"):
        loader.load("tiny-video-vae.safetensors", "tiny-video-vae.safetensors", "float32", 256)
    with pytest.raises(InputError, match=r"^tiny-audio-vae.safetensors: this is the audio VAE, in the video slot "
                                         r"\(vae_name\); pick it as audio_vae_name"):
        loader.load("tiny-audio-vae.safetensors", "tiny-audio-vae.safetensors", "float32", 256)


def test_comfyui_logs_name_our_models_and_their_device():
    """ComfyUI logs "Requested to load <class name>" for every load: it names which of ours; our placement lines
    name the device they load on (ComfyUI's --cpu runs them on the CPU, not a GPU)."""
    from h3_spark.h3_model.dit.model import H3DiT
    from h3_spark.h3_model.engine.placement import Placement
    from h3_spark.nodes import host, patcher

    names = {kind: type(host.make_held(kind, torch.nn.Linear(1, 1)).model).__name__
             for kind in ("dit", "text_encoder", "vae", "audio_vae")}
    assert names == {"dit": "H3SparkDiT", "text_encoder": "H3SparkTextEncoder", "vae": "H3SparkVideoVAE",
                     "audio_vae": "H3SparkAudioVAE"}
    torch.manual_seed(0)
    placement = Placement.of(H3DiT(TINY))
    line = patcher._line(placement.place(torch.device("cpu"), None), placement)
    assert line.startswith("resident, ") and line.endswith(" on cpu") and "GPU" not in line


def test_the_native_patch_says_it_takes_comfyuis_model():
    spec = NODE_CLASS_MAPPINGS["H3SparkNativeAttentionPatch"].INPUT_TYPES()["required"]["model"]
    assert spec[0] == "MODEL" and "native MiniMax H3 MODEL" in spec[1]["tooltip"]
    assert "H3 Model Loader" not in spec[1]["tooltip"]
    ours = NODE_CLASS_MAPPINGS["H3SparkAttentionPatch"].INPUT_TYPES()["required"]["model"]
    assert ours[0] == "H3_MODEL" and "H3 Model Loader" in ours[1]["tooltip"]


def comfyui_custom_validation(cls, inputs: dict) -> dict:
    """ComfyUI 0.3.64's custom validation (execution.validate_inputs): VALIDATE_INPUTS gets the inputs it names,
    and a message it returns is put on every one of them; the others get ComfyUI's own range checks."""
    import inspect

    spec = {**cls.INPUT_TYPES()["required"], **cls.INPUT_TYPES().get("optional", {})}
    names = inspect.getfullargspec(cls.VALIDATE_INPUTS).args
    errors = {}
    for name, value in inputs.items():
        options = spec[name][1]
        if name not in names and not options.get("min", value) <= value <= options.get("max", value):
            errors[name] = f"Value {value} out of {options['min']}..{options['max']}"
    result = cls.VALIDATE_INPUTS(**{k: v for k, v in inputs.items() if k in names})
    if result is not True:
        errors.update({name: result for name in inputs if name in names})
    return errors


@pytest.mark.parametrize("name", ["H3SparkTextToVideo", "H3SparkFirstLastFrameToVideo", "H3SparkReferenceToVideo"])
def test_a_bad_canvas_or_length_is_said_on_its_own_input(name):
    cls = type(node(name))
    good = {"width": 1344, "height": 768, "length": 124}
    assert comfyui_custom_validation(cls, good) == {}
    low = 1 if name == "H3SparkTextToVideo" else 124  # 1: a still
    assert comfyui_custom_validation(cls, {**good, "length": low - 1}) == {"length": f"Value {low - 1} out of {low}..345"}
    errors = comfyui_custom_validation(cls, {**good, "width": 1000})
    assert set(errors) <= {"width", "height"} and errors["width"] == "width 1000 is not a multiple of 32 (992 or 1024 is)"
    assert "height" not in errors["width"] and "length" not in errors["width"]


def test_error_types_are_named_as_the_package_when_comfyui_imports_the_pack_by_path():
    """ComfyUI imports custom_nodes/h3-spark under its path and reports module + class name in /history."""
    import importlib
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    # The name ComfyUI gives a pack: its folder's path, each dot written as "_x_" (a dot would split the name).
    name = str(root / "custom_nodes" / "h3-spark").replace(".", "_x_")
    spec = importlib.util.spec_from_file_location(name, root / "__init__.py", submodule_search_locations=[str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        errors = sys.modules[name + ".h3_spark.errors"]
        for cls in (errors.InputError, errors.CheckpointError, errors.H3Error):
            assert f"{cls.__module__}.{cls.__qualname__}" == f"h3_spark.errors.{cls.__name__}"
        capability = importlib.import_module(name + ".h3_spark.kernels.capability")  # an H3Error defined elsewhere
        assert capability.KernelUnavailable.__module__ == "h3_spark.kernels.capability"
        assert issubclass(capability.KernelUnavailable, errors.H3Error)
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


def test_a_near_miss_reference_label_is_refused(models, monkeypatch):
    fake_comfy(monkeypatch, models)
    _, te, vae = load_all(models)
    ref2va = node("H3SparkReferenceToVideo")
    for written, exact in (("<picture 1>", "<Picture 1>"), ("<Picture1>", "<Picture 1>"), ("<AUDIO 2>", "<Audio 2>")):
        with pytest.raises(InputError, match=f"the prompt writes {written}; the model knows a reference only as "
                                             f"{exact} \\(capital letter, one space\\)"):
            ref2va.encode(te, vae, f"{written} sings", W, H, FRAMES, "match", 24.0, image_1=image(1))

def test_the_model_loader_refuses_static_nvfp4_scales(tmp_path, monkeypatch):
    """H3_NVFP4_STATIC_SCALES in ComfyUI's environment was ignored (the nodes have no static path); now refused."""
    from h3_spark.nodes import engine

    monkeypatch.setenv("H3_NVFP4_STATIC_SCALES", str(tmp_path / "scales.safetensors"))
    with pytest.raises(InputError, match=r"^H3_NVFP4_STATIC_SCALES=.*scales.safetensors is set, but the ComfyUI "
                                         r"nodes do not take static NVFP4 scales \(they run dynamic ones\); unset it "
                                         r"for ComfyUI$"):
        engine.load_model(tmp_path / "tiny.safetensors", "t2va/fl2va", "float32", "auto", "sdpa")


def test_native_guides_become_guide_blocks_in_list_order():
    from h3_spark.h3_model.dit.layout import GuideBlock
    from h3_spark.nodes.payload import make_conditioning, pack_latent, read_conditions

    gen = torch.Generator().manual_seed(0)
    video, audio = torch.randn(1, 24, 37, 4, 4, generator=gen), torch.randn(1, 32, 2, 207, generator=gen)
    clip, still = torch.randn(1, 24, 7, 4, 4, generator=gen), torch.randn(1, 24, 1, 4, 4, generator=gen)
    sound = torch.randn(1, 32, 2, 30, generator=gen)
    cond = make_conditioning(torch.randn(1, 9, 16, generator=gen), torch.ones(9), keyframes=[
        {"resolved_frame_index": 102, "latent": clip}, {"resolved_frame_index": 48, "latent": still,
                                                        "audio_latent": sound}])
    out = read_conditions(cond, pack_latent(video, audio))
    assert out.blocks == [GuideBlock(102, 7, 0), GuideBlock(48, 1, 30)] and out.anchors == ()
    assert [z.shape[2] for z in out.condition_latents] == [7, 1]
    assert torch.equal(out.audio_condition_rows[0], sound[0].permute(1, 2, 0).reshape(-1, 32))
    assert (out.visual_level, out.audio_level) == (None, None)  # as released
    cond[0][1].update(minimax_visual_cond_noise_aug=0.8, minimax_audio_cond_noise_aug=0.9)
    out = read_conditions(cond, pack_latent(video, audio))
    assert (out.visual_level, out.audio_level) == (0.8, 0.9)
    cond[0][1]["minimax_audio_cond_noise_aug"] = 1.2
    with pytest.raises(InputError, match=r"^the conditioning's minimax_audio_cond_noise_aug is the level its "
                                         r"conditions are held at, in \(0, 1\], got 1.2$"):
        read_conditions(cond, pack_latent(video, audio))


def test_add_guide_chains_stills_clips_and_sounds_the_sampler_takes(models, monkeypatch):
    fake_comfy(monkeypatch, models)
    model, te, vae = load_all(models)
    cond, latent = node("H3SparkTextToVideo").encode(te, "a cat", W, H, FRAMES)
    add = node("H3SparkAddGuide").add
    cond, latent = add(cond, latent, vae, 48, image=image(3))
    clip = torch.cat([image(4 + i) for i in range(25)])  # 25 frames: cut to the longest 17k+5, 22
    cond, latent = add(cond, latent, vae, -22, image=clip, audio=sound(0.5))
    guides = cond[0][1]["minimax_keyframes"]
    assert [g["resolved_frame_index"] for g in guides] == [48, 102]
    assert guides[0]["latent"].shape[2] == 1 and guides[1]["latent"].shape[2] == 7
    assert guides[1]["audio_latent"].shape[-1] == 20 and "audio_latent" not in guides[0]
    out = node("H3SparkSampler").sample(model, cond, latent, 3, STEPS, 12.0, 3.0)[0]
    plain = node("H3SparkSampler").sample(model, *node("H3SparkTextToVideo").encode(te, "a cat", W, H, FRAMES), 3,
                                          STEPS, 12.0, 3.0)[0]
    assert not torch.equal(out["samples"][0], plain["samples"][0])  # the guides condition the clip
    # A pack's anchor strengths (ComfyUI's condition levels) loosen the guides: the sampler reads both.
    for key, index in (("minimax_visual_cond_noise_aug", 0), ("minimax_audio_cond_noise_aug", 1)):
        loose = [[cond[0][0], {**cond[0][1], key: 0.5}]]
        moved = node("H3SparkSampler").sample(model, loose, latent, 3, STEPS, 12.0, 3.0)[0]["samples"]
        assert not torch.equal(moved[index], out["samples"][index])
    # Our node sets them: a level other than the released one becomes the conditioning's; the released one
    # leaves what the conditioning said.
    assert "minimax_visual_cond_noise_aug" not in cond[0][1] and "minimax_audio_cond_noise_aug" not in cond[0][1]
    strong, _ = add(cond, latent, vae, 0, image=image(5), guide_strength=0.6, audio_guide_strength=0.7)
    assert (strong[0][1]["minimax_visual_cond_noise_aug"], strong[0][1]["minimax_audio_cond_noise_aug"]) == (0.6, 0.7)
    kept, _ = add(strong, latent, vae, 10, image=image(6))
    assert kept[0][1]["minimax_visual_cond_noise_aug"] == 0.6 and len(kept[0][1]["minimax_keyframes"]) == 4
    with pytest.raises(InputError, match="H3 Add Guide needs an image"):
        add(cond, latent, vae, 0)
    with pytest.raises(InputError, match=r"guide 1 \(image\): frame 200 is outside the 124-frame clip"):
        add(cond, latent, vae, 200, image=image(1))


def test_extend_and_join_make_a_longer_clip_whose_window_goes_on_from_the_first(models, monkeypatch):
    from h3_spark.h3_model.compose.windows import frame_sample

    fake_comfy(monkeypatch, models)
    model, te, vae = load_all(models)
    decode = node("H3SparkDecode").decode
    cond, latent = node("H3SparkTextToVideo").encode(te, "a cat", W, H, FRAMES)
    first_images, first_audio = decode(vae, node("H3SparkSampler").sample(model, cond, latent, 3, STEPS, 12.0, 3.0)[0])
    cond, latent = node("H3SparkTextToVideo").encode(te, "the cat jumps", W, H, FRAMES)
    cond, latent = node("H3SparkExtendVideo").extend(cond, latent, vae, first_images, 22, audio=first_audio)
    extras = cond[0][1]
    assert extras["h3_spark_history"]["latent"].shape[2] == 7  # 22 frames
    assert extras["h3_spark_history"]["audio_latent"].shape[-1] == 36  # whole latents under 22 frames
    assert extras["minimax_keyframes"][0]["resolved_frame_index"] == 0
    second = node("H3SparkSampler").sample(model, cond, latent, 3, STEPS, 12.0, 3.0)[0]
    images_b, audio_b = decode(vae, second)
    images, audio = node("H3SparkJoinVideo").join(first_images, images_b, 1, first_audio, audio_b)
    assert images.shape[0] == 124 + 123 and torch.equal(images[:124], first_images)
    assert torch.equal(images[124:], images_b[1:])
    assert audio["waveform"].shape == (1, 2, frame_sample(247))
    # The sound of the join: the first clip's up to its end, then the second's from its frame 1.
    assert torch.equal(audio["waveform"][0, :, :frame_sample(124)], first_audio["waveform"][0, :, :frame_sample(124)])
    start = frame_sample(123)
    assert torch.equal(audio["waveform"][0, :, frame_sample(124):],
                       audio_b["waveform"][0, :, frame_sample(124) - start:frame_sample(247) - start])
    with pytest.raises(InputError, match="the clip to extend is 32x64, the new latent 64x64"):
        node("H3SparkExtendVideo").extend(cond, latent, vae, first_images[:, :, :32], 22)
    with pytest.raises(InputError, match="going on from a clip takes its last frame and 22 before it; it has 20 frames"):
        node("H3SparkExtendVideo").extend(cond, latent, vae, first_images[:20], 22)
    with pytest.raises(InputError, match="overlap must be 0..123"):
        node("H3SparkJoinVideo").join(first_images, images_b, 124)


def test_add_guide_on_a_reference_conditioning_places_guides_before_the_references(models, monkeypatch):
    """The multiframe reference template: an H3 Reference to Video conditioning with three chained guides at 1.5,
    3 and 5 s (frames 36, 72, 120 of 124); the sampler packs them after the text, before the reference."""
    from h3_spark.h3_model.dit.layout import GuideBlock, ImageBlock
    from h3_spark.h3_model.pipeline.generation import Pipeline
    from h3_spark.nodes.payload import read_conditions

    fake_comfy(monkeypatch, models)
    model, te, vae = load_all(models, dit="tiny-ref2va.safetensors")
    cond, latent = node("H3SparkReferenceToVideo").encode(te, vae, "<Picture 1> walks", W, H, FRAMES, "match", 24.0,
                                                          image_1=image(1))
    plain = cond
    add = node("H3SparkAddGuide").add
    for seed, frame in ((2, 36), (3, 72), (4, 120)):
        cond, latent = add(cond, latent, vae, frame, image=image(seed))
    read = read_conditions(cond, latent)
    assert read.mode == "ref2va"
    assert read.blocks[:3] == [GuideBlock(36, 1, 0), GuideBlock(72, 1, 0), GuideBlock(120, 1, 0)]
    assert isinstance(read.blocks[3], ImageBlock) and len(read.blocks) == 4
    guides = cond[0][1]["minimax_keyframes"]
    refs = cond[0][1]["minimax_refs"]
    # Condition latents in packed order: the three guides, then the reference.
    assert all(torch.equal(a, b["latent"].float()) for a, b in zip(read.condition_latents, guides + refs))
    seen = {}
    real = Pipeline.sample
    monkeypatch.setattr(Pipeline, "sample", lambda self, dit, request, *a, **k: seen.setdefault("r", request)
                        and real(self, dit, request, *a, **k))
    out = node("H3SparkSampler").sample(model, cond, latent, 3, STEPS, 12.0, 3.0)[0]
    lay = seen["r"].layout
    text, grid = read.tags.numel(), 4  # a 4x4 latent: 2x2 patches
    origin = lay.position_ids[lay.target_video_indices[0], 0].item()
    assert origin == text + 1.0  # the text, then the image reference's one slot
    for i, frame in enumerate((36, 72, 120)):
        assert torch.all(lay.position_ids[text + i * grid:text + (i + 1) * grid, 0] == origin + 5.0 / 3.0 * frame)
    assert torch.all(lay.position_ids[text + 3 * grid:text + 4 * grid, 0] == float(text))  # the reference
    seen.clear()
    bare = node("H3SparkSampler").sample(model, plain, latent, 3, STEPS, 12.0, 3.0)[0]
    assert seen["r"].layout.sequence_length == lay.sequence_length - 3 * grid
    assert not torch.equal(out["samples"][0], bare["samples"][0])  # the guides condition the clip


def test_add_guide_crops_a_long_sound_at_comfyuis_count(models, monkeypatch, caplog):
    fake_comfy(monkeypatch, models)
    _, te, vae = load_all(models)
    cond, latent = node("H3SparkTextToVideo").encode(te, "a cat", W, H, FRAMES)
    with caplog.at_level("WARNING", logger="h3_spark"):
        cond, _ = node("H3SparkAddGuide").add(cond, latent, vae, 29, audio=sound(6.0))
    # floor(207 - 5/3 x 29) = 158 of the 240 latents of 6 s, the rest cut as ComfyUI's AddGuide cuts them.
    assert cond[0][1]["minimax_keyframes"][0]["audio_latent"].shape[-1] == 158
    assert ("guide 1 (audio): 6.000 s of sound from frame 29 runs past the clip's end; cropped to the 158 audio "
            "latents (3.950 s) that remain") in caplog.text


def test_a_label_with_no_reference_is_read_as_text_with_a_warning(models, monkeypatch, caplog):
    """ComfyUI's own H3 nodes read <Picture 3> with one picture as plain words (its multiframe template names its
    guide stills so); the node does too and says it, while the pipeline's own check (CLI, service) refuses it."""
    from h3_spark.h3_model.engine.engine import Engine
    from h3_spark.h3_model.text.prompt import check_mentions

    fake_comfy(monkeypatch, models)
    _, te, vae = load_all(models)
    with caplog.at_level(logging.WARNING, logger="h3_spark"):
        cond, _ = node("H3SparkReferenceToVideo").encode(te, vae, "<Picture 1> meets <Picture 3>", W, H, FRAMES,
                                                         "match", 24.0, image_1=image(1))
    assert "the prompt names <Picture 3> with no reference behind it: read as plain text" in caplog.text
    assert cond[0][0].isfinite().all() and cond[0][0].std() > 0
    with pytest.raises(InputError, match=r"the prompt names <Picture 3>, but this request gives 1 image reference"):
        check_mentions("ref2va", "<Picture 1> meets <Picture 3>", images=1)
    with pytest.raises(InputError, match="unnamed labels are read as one of refuse, text, got 'drop'"):
        check_mentions("t2va", "a cat", unnamed="drop")
    assert check_mentions("fl2va", "<Picture 2> ends it", images=1, unnamed="text") == ["<Picture 2>"]
    with pytest.raises(InputError, match=r"names <Picture 2>, but this request gives 1 keyframe"):
        Engine.of(text_encoder=te.ready()).encode_text("fl2va", "<Picture 2> ends it", [torch.zeros(64, 64, 3,
                                                                                                 dtype=torch.uint8)])
