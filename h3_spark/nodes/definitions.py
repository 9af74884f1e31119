"""The h3-spark nodes (ComfyUI's V1 node API): loaders, conditioning, sampler, decode, save, patches.

Importing this module must stay cheap and must not need torch or ComfyUI (ComfyUI imports the pack at
start-up; tests introspect it): the classes only describe inputs and outputs, and each FUNCTION
imports the engine when it runs. Custom wire types: H3_TEXT_ENCODER and H3_VAE (our encoders are not
ComfyUI's CLIP/VAE objects); MODEL, CONDITIONING, LATENT, IMAGE and AUDIO are ComfyUI's own, in the
native MiniMax H3 formats (payload.py), so native and h3-spark nodes mix.
"""

from __future__ import annotations

import inspect
import re

from ..h3_model import geometry

CATEGORY = "h3-spark"
TEXT_LAYER = 50  # h3_model.text_encoder.DEFAULT_LAYER (not imported: that module imports torch)
MAX_SEED = 2 ** 63 - 1  # the engine's generator takes seeds below 2^63
# The h3-spark DiT runs on our engine, not as a ComfyUI BaseModel: its own type keeps it out of native MODEL
# nodes (KSampler, LoraLoaderModelOnly), which would fail on it.
H3_MODEL = "H3_MODEL"
LENGTH = ("INT", {"default": geometry.DEFAULT_FRAMES, "min": 124, "max": 345, "step": 17,
                  "tooltip": "Frames at 24 fps, snapped up to 17n+5; H3 generates 5 to 15 seconds (124..345)."})
WIDTH = ("INT", {"default": 1344, "min": 32, "max": 4096, "step": 32,
                 "tooltip": "Canvas width in pixels, a multiple of 32. H3 is released for 1344x768 (16:9)."})
HEIGHT = ("INT", {"default": 768, "min": 32, "max": 4096, "step": 32,
                  "tooltip": "Canvas height in pixels, a multiple of 32. H3 is released for 1344x768 (16:9)."})
PROMPT = ("STRING", {"multiline": True, "dynamicPrompts": True,
                     "tooltip": "Refer to references as <Picture i>, <Video k>, <Audio j> (1-based per type); "
                                "naming one that is not connected is an error."})
T2VA_PROMPT = ("STRING", {"multiline": True, "dynamicPrompts": True,
                          "tooltip": "What the clip shows and sounds like: scene, action, camera, dialogue, sound."})
FL2VA_PROMPT = ("STRING", {"multiline": True, "dynamicPrompts": True,
                           "tooltip": "What happens between the keyframes; they are <Picture 1> (the first one "
                                      "given) and <Picture 2>. May be empty."})
NATIVE_MODEL_TOOLTIP = ("ComfyUI's native MiniMax H3 MODEL (from its own loader, e.g. Load Diffusion Model); an "
                        "h3-spark H3_MODEL takes H3 Attention Patch instead.")
# Tooltips of inputs that several nodes share, or whose node declares them without one (_described fills them).
TOOLTIPS = {
    "model": "The H3 DiT from H3 Model Loader (or H3 LoRA Loader / H3 Attention Patch).",
    "text_encoder": "The Qwen3-VL text encoder from H3 Text Encoder Loader.",
    "vae": "The video and audio VAEs from H3 VAE Loader.",
    "dit_name": "The H3 DiT: a file or a diffusers folder under models/diffusion_models (pick the folder, not the "
                "file inside it).",
    "weight_dtype": "The dtype the DiT's weights are held in; quantized files keep their stored form for the "
                    "linears the kernels run.",
    "lora_name": "A LoRA file under models/loras (H3 LoRAs in any published key layout, Turbo LoRAs included).",
    "strength": "How much of the LoRA is merged: 1 is as trained, 0 is none.",
    "text_encoder_name": "Qwen3-VL: a ComfyUI single file under models/text_encoders or a transformers folder.",
    "dtype": "The dtype the text encoder computes in.",
    "vae_name": "The video VAE: a file or folder under models/vae (the H3 video VAEs are listed first).",
    "audio_vae_name": "The audio VAE: a file or folder under models/vae (the H3 audio VAEs are listed first).",
    "first_frame": "The clip's first frame (stretched onto the canvas). Connect it, the last frame or both.",
    "last_frame": "The clip's last frame (cover-cropped onto the canvas).",
    "video_fps": "Frame rate of the reference videos' frames (the model reads them at 24 fps).",
    "positive": "The conditioning from an H3 ... to Video node (or ComfyUI's native MiniMax H3 nodes).",
    "latent_image": "Only its shape is read: the canvas and length. Sampling starts from the seed's noise.",
    "seed": "The noise seed: the same seed and settings give the same clip as the h3-spark CLI.",
    "shift_video": "Flow shift of the video schedule (the released model: 12; Turbo LoRAs at 768p: 6).",
    "shift_audio": "Flow shift of the audio schedule (the released model: 3).",
    "cache_start": "Share of the evaluations before which no step is reused.",
    "cache_end": "Share of the evaluations from which no step is reused.",
    "cache_subsample": "Measure the step-to-step change on every n-th row (cheaper; the estimate covers all rows).",
    "samples": "The LATENT from H3 Sampler.",
    "images": "The frames to save (IMAGE), e.g. from H3 Decode.",
    "audio": "The soundtrack to mux (AUDIO), e.g. from H3 Decode; without it the mp4 is silent.",
    "filename_prefix": "File name inside ComfyUI's output folder; a subfolder may be given (h3-spark/clip).",
    "fps": "Frame rate of the mp4 (H3 makes 24 fps).",
    "backend": "The attention kernel to run; one this GPU cannot run is an error when the node runs.",
}


def _engine():
    from . import engine

    return engine


def _host():
    from . import host

    return host


def _step_cache():
    from ..h3_model.pipeline import step_cache

    return step_cache


def _settings():
    from ..kernels import settings

    return settings


def _attention():
    from ..kernels import attention

    return attention


def _recipes():
    from ..h3_model.engine import recipes

    return recipes


# ------------------------------------------------------------------------------------------ loaders
class H3ModelLoader:
    """The H3 DiT from models/diffusion_models (ComfyUI single file, any published format, or a diffusers
    folder), under ComfyUI's model management."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "dit_name": (_host().model_choices("diffusion_models", folders=True),),
            "partition": (["auto", "ref2va", "t2va/fl2va"], {
                "tooltip": "Which released DiT this is; auto reads the folder layout or the file name."}),
            "weight_dtype": (["bfloat16", "float32"],),
            "linear": (list(_settings().LINEAR_FORMATS), {
                "tooltip": "auto = exact bf16 (NVFP4 natively on Blackwell with an NVFP4 file); fp8/nvfp4 are "
                           "faster and approximate; w4a8 runs a w4a8 file's layers as int8 GEMMs (approximate, "
                           "its speed unmeasured)."}),
            "attention": (list(_attention().ATTENTION_BACKENDS), {"tooltip": _attention().attention_help()}),
        }}

    RETURN_TYPES = (H3_MODEL,)
    FUNCTION = "load"
    CATEGORY = f"{CATEGORY}/loaders"
    TITLE = "H3 Model Loader"

    def load(self, dit_name, partition, weight_dtype, linear, attention):
        path = _host().resolve_model("diffusion_models", dit_name)
        return (_engine().load_model(path, partition, weight_dtype, linear, attention),)


class H3LoraLoader:
    """A LoRA for an h3-spark MODEL (any published H3 LoRA key style), merged when the sampler runs and
    taken out again when a later run asks for another set."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": (H3_MODEL,),
            "lora_name": (_host().model_choices("loras"),),
            "strength": ("FLOAT", {"default": 1.0, "min": -10.0, "max": 10.0, "step": 0.01}),
        }}

    RETURN_TYPES = (H3_MODEL,)
    FUNCTION = "load"
    CATEGORY = f"{CATEGORY}/loaders"
    TITLE = "H3 LoRA Loader"

    def load(self, model, lora_name, strength):
        return (_engine().add_lora(model, _host().resolve_model("loras", lora_name), strength),)


class H3TextEncoderLoader:
    """The Qwen3-VL text encoder from models/text_encoders: a transformers/diffusers folder, or a ComfyUI
    single file plus a folder with the Qwen3-VL tokenizer and processor files."""

    @classmethod
    def INPUT_TYPES(cls):
        folders = [n for n in _host().model_choices("text_encoders", folders=True) if n.endswith("/")]
        return {"required": {
            "text_encoder_name": (_host().model_choices("text_encoders", folders=True),),
            "tokenizer": (["(inside the text encoder folder)", *folders], {
                "tooltip": "A single-file text encoder has no tokenizer: pick the folder holding tokenizer.json "
                           "and the processor config."}),
            "dtype": (["bfloat16", "float32"],),
        }, "optional": {
            # Optional so graphs saved before it existed stay valid; only small test models change it.
            "layer": ("INT", {"default": TEXT_LAYER, "min": 1, "max": 1000, "tooltip":
                              f"The Qwen3-VL hidden state the DiT reads: {TEXT_LAYER} for the released model; "
                              "tiny test/demo encoders have fewer layers."}),
        }}

    RETURN_TYPES = ("H3_TEXT_ENCODER",)
    FUNCTION = "load"
    CATEGORY = f"{CATEGORY}/loaders"
    TITLE = "H3 Text Encoder Loader"

    def load(self, text_encoder_name, tokenizer, dtype, layer=None):
        host = _host()
        path = host.resolve_model("text_encoders", text_encoder_name)
        tok = None if tokenizer.startswith("(") else host.resolve_model("text_encoders", tokenizer)
        return (_engine().load_text_encoder(path, tok, dtype, TEXT_LAYER if layer is None else int(layer)),)


class H3VAELoader:
    """The video VAE and the audio VAE from models/vae (ComfyUI single files or diffusers folders)."""

    @classmethod
    def INPUT_TYPES(cls):
        host = _host()
        return {"required": {
            "vae_name": (host.vae_choices("video"),),
            "audio_vae_name": (host.vae_choices("audio"),),
            "decode_dtype": (["float16", "float32"], {"tooltip": "float32 is the exact video decode."}),
            "tile_size": ("INT", {"default": 256, "min": 0, "max": 4096, "step": 16,
                                  "tooltip": "Spatial tile of the video VAE in pixels: 0 = whole frames, else a "
                                             "multiple of 16 above the 64 px overlap."}),
        }}

    RETURN_TYPES = ("H3_VAE",)
    FUNCTION = "load"
    CATEGORY = f"{CATEGORY}/loaders"
    TITLE = "H3 VAE Loader"

    def load(self, vae_name, audio_vae_name, decode_dtype, tile_size):
        host = _host()
        return (_engine().load_vaes(host.resolve_model("vae", vae_name), host.resolve_model("vae", audio_vae_name),
                                    decode_dtype, tile_size),)


# ------------------------------------------------------------------------------------------ conditioning
def _validate_canvas(cls, width=None, height=None):
    """VALIDATE_INPUTS of the conditioning nodes: ComfyUI refuses a canvas H3 cannot make before the prompt is
    queued (its own checks do not enforce the 32-pixel step). ComfyUI shows the returned message on every input
    this function reads, so it reads only width and height and its message names the one at fault; `length` is
    left to ComfyUI's own per-input range check (124..345; a length inside it only snaps up, said in the log).
    Values wired from other nodes are not known yet and are checked when the node runs."""
    from ..errors import H3Error

    if width is None or height is None:
        return True
    problems = []
    for name, value in (("width", width), ("height", height)):
        value = int(value)
        if not 32 <= value <= 4096:
            problems.append(f"{name} {value} is outside 32..4096")
        elif value % geometry.CANVAS_MULTIPLE:
            low = value - value % geometry.CANVAS_MULTIPLE
            problems.append(f"{name} {value} is not a multiple of {geometry.CANVAS_MULTIPLE} "
                            f"({low} or {low + geometry.CANVAS_MULTIPLE} is)")
    if problems:
        return "; ".join(problems)
    try:
        geometry.check_canvas(int(width), int(height))
    except H3Error as exc:
        return str(exc)
    return True


class H3TextToVideo:
    """T2VA: prompt -> CONDITIONING + the empty audio-video LATENT of the canvas."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"text_encoder": ("H3_TEXT_ENCODER",), "prompt": T2VA_PROMPT, "width": WIDTH,
                             "height": HEIGHT, "length": LENGTH}}

    VALIDATE_INPUTS = classmethod(_validate_canvas)
    RETURN_TYPES = ("CONDITIONING", "LATENT")
    RETURN_NAMES = ("positive", "latent")
    FUNCTION = "encode"
    CATEGORY = f"{CATEGORY}/conditioning"
    TITLE = "H3 Text to Video"

    def encode(self, text_encoder, prompt, width, height, length):
        return _engine().t2va(text_encoder, prompt, width, height, length)


class H3FirstLastFrameToVideo:
    """FL2VA: prompt + a first and/or a last frame -> CONDITIONING + LATENT. The first frame is stretched onto
    the canvas, the last one cover-cropped, as the released model saw them."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"text_encoder": ("H3_TEXT_ENCODER",), "vae": ("H3_VAE",), "prompt": FL2VA_PROMPT,
                             "width": WIDTH, "height": HEIGHT, "length": LENGTH},
                "optional": {"first_frame": ("IMAGE",), "last_frame": ("IMAGE",)}}

    VALIDATE_INPUTS = classmethod(_validate_canvas)
    RETURN_TYPES = ("CONDITIONING", "LATENT")
    RETURN_NAMES = ("positive", "latent")
    FUNCTION = "encode"
    CATEGORY = f"{CATEGORY}/conditioning"
    TITLE = "H3 First-Last Frame to Video"

    def encode(self, text_encoder, vae, prompt, width, height, length, first_frame=None, last_frame=None):
        return _engine().fl2va(text_encoder, vae, prompt, width, height, length, first_frame, last_frame)


class H3AddGuide:
    """Pin a still, a clip or a sound at any frame of the clip: appended to the conditioning's guides, which the
    H3 sampler (and ComfyUI's own MiniMax H3 sampling) reads. Chain several for several guides; on an H3 Reference
    to Video conditioning too."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"positive": ("CONDITIONING", {"tooltip": "An H3 conditioning (ours or ComfyUI's "
                                                                       "native; text, keyframes or references); the "
                                                                       "guide is appended to it."}),
                             "latent": ("LATENT", {"tooltip": "The clip's H3 audio-video latent: its length and "
                                                              "canvas place and size the guide."}),
                             "vae": ("H3_VAE", {"tooltip": "Encodes the guide's pictures and sound."}),
                             "frame_idx": ("INT", {"default": 0, "min": -9999, "max": 9999,
                                                   "tooltip": "The frame the guide starts at; negative counts from "
                                                              "the end (-1 is the last frame)."})},
                "optional": {"image": ("IMAGE", {"tooltip": "One frame: a still. 5 or more: a clip, cut to the "
                                                            "longest 17k+5 (5, 22, 39, ...); it must end in the "
                                                            "clip."}),
                             "audio": ("AUDIO", {"tooltip": "A sound from the guide's frame on, cropped to what "
                                                            "remains of the clip (as ComfyUI's AddGuide)."}),
                             "guide_strength": ("FLOAT", {
                                 "default": 0.999, "min": 0.001, "max": 1.0, "step": 0.001,
                                 "tooltip": "The level this conditioning's pictures (every guide and keyframe at "
                                            "once, as ComfyUI's minimax_visual_cond_noise_aug) are held at: 0.999 as "
                                            "released; lower holds them more loosely. Left at 0.999 it keeps what "
                                            "the conditioning already says."}),
                             "audio_guide_strength": ("FLOAT", {
                                 "default": 1.0, "min": 0.001, "max": 1.0, "step": 0.001,
                                 "tooltip": "The same for its sounds (minimax_audio_cond_noise_aug): 1.0, clean, as "
                                            "released."})}}

    RETURN_TYPES = ("CONDITIONING", "LATENT")
    RETURN_NAMES = ("positive", "latent")
    FUNCTION = "add"
    CATEGORY = f"{CATEGORY}/conditioning"
    TITLE = "H3 Add Guide"

    def add(self, positive, latent, vae, frame_idx, image=None, audio=None, guide_strength=0.999,
            audio_guide_strength=1.0):
        return _engine().add_guide(positive, latent, vae, frame_idx, image, audio, guide_strength,
                                   audio_guide_strength)


class H3ExtendVideo:
    """The next window of a clip past 15 s: the conditioning (from H3 Text to Video, at the clip's canvas) goes on
    from the clip's last frames and sound; sample it, decode it, then H3 Join Video drops the frame it repeats."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"positive": ("CONDITIONING", {"tooltip": "The new window's prompt (H3 Text to Video "
                                                                       "at the clip's width and height)."}),
                             "latent": ("LATENT", {"tooltip": "The new window's H3 latent: its length is what is "
                                                              "made, 5 to 14.4 s."}),
                             "vae": ("H3_VAE", {"tooltip": "Encodes the clip's tail."}),
                             "images": ("IMAGE", {"tooltip": "The clip so far (24 fps)."}),
                             "history_frames": ("INT", {"default": 22, "min": 5, "max": 107, "step": 17,
                                                        "tooltip": "Frames before the clip's last one that the new "
                                                                   "window goes on from (17k+5)."})},
                "optional": {"audio": ("AUDIO", {"tooltip": "The clip's sound; without it the history is "
                                                            "silent."})}}

    RETURN_TYPES = ("CONDITIONING", "LATENT")
    RETURN_NAMES = ("positive", "latent")
    FUNCTION = "extend"
    CATEGORY = f"{CATEGORY}/conditioning"
    TITLE = "H3 Extend Video"

    def extend(self, positive, latent, vae, images, history_frames, audio=None):
        return _engine().extend_video(positive, latent, vae, images, audio, history_frames)


class H3JoinVideo:
    """Two clips one after the other, the second without the frames it repeats (1 after H3 Extend Video), their
    sound cut on one sample grid so that it stays exactly as long as the picture."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"images_a": ("IMAGE", {"tooltip": "The clip so far."}),
                             "images_b": ("IMAGE", {"tooltip": "Its continuation."}),
                             "overlap": ("INT", {"default": 1, "min": 0, "max": 345,
                                                 "tooltip": "Frames of the second clip's start that repeat the "
                                                            "first's end (1 after H3 Extend Video)."})},
                "optional": {"audio_a": ("AUDIO", {"tooltip": "The first clip's sound (silence without it)."}),
                             "audio_b": ("AUDIO", {"tooltip": "The second clip's sound (silence without it)."})}}

    RETURN_TYPES = ("IMAGE", "AUDIO")
    RETURN_NAMES = ("images", "audio")
    FUNCTION = "join"
    CATEGORY = f"{CATEGORY}/video"
    TITLE = "H3 Join Video"

    def join(self, images_a, images_b, overlap, audio_a=None, audio_b=None):
        return _engine().join_video(images_a, audio_a, images_b, audio_b, overlap)


class H3ReferenceToVideo:
    """Ref2VA: prompt + reference images, videos (with optional soundtracks) and audio -> CONDITIONING + LATENT.

    References enter in the order images, videos, audio; the prompt names them <Picture i>, <Video k>,
    <Audio j>. Reference videos are frames at `video_fps` (default 24)."""

    IMAGES, VIDEOS, AUDIOS = 4, 3, 3

    @classmethod
    def INPUT_TYPES(cls):
        optional = {f"image_{i}": ("IMAGE",) for i in range(1, cls.IMAGES + 1)}
        for i in range(1, cls.VIDEOS + 1):
            optional[f"video_{i}"] = ("IMAGE",)
            optional[f"video_{i}_audio"] = ("AUDIO",)
        optional.update({f"audio_{i}": ("AUDIO",) for i in range(1, cls.AUDIOS + 1)})
        return {"required": {
            "text_encoder": ("H3_TEXT_ENCODER",), "vae": ("H3_VAE",), "prompt": PROMPT, "width": WIDTH,
            "height": HEIGHT, "length": LENGTH,
            "reference_size": (list(geometry.REFERENCE_POLICIES), {
                "tooltip": "match: shrink images to the canvas area (ComfyUI's default); max: shrink to a 2048 px "
                           "short edge; diffusers: resize to 2048 px, upscaling included."}),
            "video_fps": ("FLOAT", {"default": 24.0, "min": 1.0, "max": 240.0, "step": 0.001}),
        }, "optional": optional}

    VALIDATE_INPUTS = classmethod(_validate_canvas)
    RETURN_TYPES = ("CONDITIONING", "LATENT")
    RETURN_NAMES = ("positive", "latent")
    FUNCTION = "encode"
    CATEGORY = f"{CATEGORY}/conditioning"
    TITLE = "H3 Reference to Video"

    def encode(self, text_encoder, vae, prompt, width, height, length, reference_size, video_fps, **refs):
        known = set(self.INPUT_TYPES()["optional"])
        unknown = sorted(set(refs) - known)
        if unknown:
            # ComfyUI hands a node every linked input of the prompt, declared or not, so an API client that
            # wires image_5 reaches this point: say what the node takes instead of dropping the reference.
            from ..errors import InputError

            extra = [name for name in unknown if re.fullmatch(r"(image|video|audio)_\d+(_audio)?", name)]
            if extra:
                raise InputError(
                    f"too many references: H3 Reference to Video takes image_1..image_{self.IMAGES}, "
                    f"video_1..video_{self.VIDEOS} (each with video_N_audio) and audio_1..audio_{self.AUDIOS}; "
                    f"got {', '.join(extra)}")
            raise InputError(f"H3 Reference to Video has no input named {', '.join(unknown)}")
        images = [refs[f"image_{i}"] for i in range(1, self.IMAGES + 1) if refs.get(f"image_{i}") is not None]
        videos = []
        for i in range(1, self.VIDEOS + 1):
            if refs.get(f"video_{i}") is not None:
                videos.append((refs[f"video_{i}"], refs.get(f"video_{i}_audio")))
            elif refs.get(f"video_{i}_audio") is not None:
                from ..errors import InputError

                raise InputError(f"video_{i}_audio is the soundtrack of video_{i}, which is not connected; connect "
                                 f"standalone audio to an audio_N input")
        audios = [refs[f"audio_{i}"] for i in range(1, self.AUDIOS + 1) if refs.get(f"audio_{i}") is not None]
        return _engine().ref2va(text_encoder, vae, prompt, width, height, length, reference_size, images, videos,
                                audios, video_fps)


# ------------------------------------------------------------------------------------------ sampling
class H3Sampler:
    """Denoises an H3 LATENT under one CONDITIONING (from h3-spark or ComfyUI's native MiniMax H3 nodes).

    Seeded exactly like the h3-spark CLI: the same seed and settings give the same video. Shows ComfyUI's
    progress bar and stops at the next transformer block when the run is cancelled."""

    @classmethod
    def INPUT_TYPES(cls):
        types = {"required": {
            "model": (H3_MODEL,),
            "positive": ("CONDITIONING",),
            "latent_image": ("LATENT",),
            "seed": ("INT", {"default": 0, "min": 0, "max": MAX_SEED, "control_after_generate": True}),
            "steps": ("INT", {"default": 49, "min": 1, "max": 1000,
                              "tooltip": "Model evaluations (the released recipe: 50 grid points = 49)."}),
            "shift_video": ("FLOAT", {"default": 12.0, "min": 0.01, "max": 100.0, "step": 0.01}),
            "shift_audio": ("FLOAT", {"default": 3.0, "min": 0.01, "max": 100.0, "step": 0.01}),
        }}
        cache = _step_cache()
        types["optional"] = {
            "cache": (list(cache.MODES), {"tooltip": "Step cache: reuses DiT outputs between steps (approximate; "
                                                     "off is exact). The run's log lists the reused steps."}),
            "cache_threshold": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 10.0, "step": 0.001, "tooltip":
                                          "0 = the mode's default " + ", ".join(
                                              f"{m} {t}" for m, t in cache.DEFAULT_THRESHOLD.items() if m != "off")}),
            "cache_start": ("FLOAT", {"default": cache.DEFAULT_START_PERCENT, "min": 0.0, "max": 1.0, "step": 0.01}),
            "cache_end": ("FLOAT", {"default": cache.DEFAULT_END_PERCENT, "min": 0.0, "max": 1.0, "step": 0.01}),
            "cache_subsample": ("INT", {"default": cache.DEFAULT_SUBSAMPLE, "min": 1, "max": cache.MAX_SUBSAMPLE}),
            "recipe": ("STRING", {"default": "", "tooltip": (
                "Opt-in speed recipes (approximate), separated by ';' (a Turbo LoRA with H3 LoRA Loader): "
                + _recipes().recipes_help() + ". Empty: none.")}),
        }
        return types

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "sample"
    CATEGORY = f"{CATEGORY}/sampling"
    TITLE = "H3 Sampler"

    def sample(self, model, positive, latent_image, seed, steps, shift_video, shift_audio, cache="off",
               cache_threshold=0.0, cache_start=0.2, cache_end=0.9, cache_subsample=1, recipe=""):
        step_cache = None
        if cache != "off":
            step_cache = (cache, cache_threshold or None, cache_start, cache_end, cache_subsample)
        return (_engine().sample(model, positive, latent_image, seed, steps, shift_video, shift_audio,
                                 step_cache=step_cache, recipes=recipe),)


# ------------------------------------------------------------------------------------------ output
class H3Decode:
    """LATENT -> IMAGE frames and AUDIO (stereo, 32 kHz), ready for ComfyUI's CreateVideo / SaveVideo or
    H3 Save Video."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"vae": ("H3_VAE",), "samples": ("LATENT",)}}

    RETURN_TYPES = ("IMAGE", "AUDIO")
    RETURN_NAMES = ("images", "audio")
    FUNCTION = "decode"
    CATEGORY = f"{CATEGORY}/output"
    TITLE = "H3 Decode"

    def decode(self, vae, samples):
        return _engine().decode(vae, samples)


class H3SaveVideo:
    """Frames (+ audio) -> an H.264/AAC mp4 in ComfyUI's output folder (and nowhere else)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "images": ("IMAGE",),
            "filename_prefix": ("STRING", {"default": "h3-spark/H3"}),
            "fps": ("INT", {"default": geometry.FPS, "min": 1, "max": 120}),
            "crf": ("INT", {"default": 18, "min": 0, "max": 51, "tooltip": "H.264 quality (lower is better)."}),
        }, "optional": {"audio": ("AUDIO",)}}

    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "save"
    CATEGORY = f"{CATEGORY}/output"
    TITLE = "H3 Save Video"

    def save(self, images, filename_prefix, fps, crf, audio=None):
        saved = _engine().save_video(images, audio, filename_prefix, fps, crf)
        return {"ui": {"images": [saved], "animated": (True,)}}


# ------------------------------------------------------------------------------------------ patches
class H3AttentionPatch:
    """H3_MODEL -> H3_MODEL running the chosen attention backend, without reloading the weights. An
    unavailable backend is an error here, never a silent fallback."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": (H3_MODEL,), "backend": (list(_attention().ATTENTION_BACKENDS),
                                                                {"tooltip": _attention().attention_help()})}}

    RETURN_TYPES = (H3_MODEL,)
    FUNCTION = "patch"
    CATEGORY = f"{CATEGORY}/patches"
    TITLE = "H3 Attention Patch"

    def patch(self, model, backend):
        return (_engine().patch_attention(model, backend),)


class H3NativeAttentionPatch:
    """ComfyUI's native MiniMax H3 MODEL -> MODEL running one of our attention backends (through
    transformer_options["optimized_attention_override"]). An unavailable backend is an error here."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL", {"tooltip": NATIVE_MODEL_TOOLTIP}),
                             "backend": (list(_attention().ATTENTION_BACKENDS),
                                         {"tooltip": _attention().attention_help()})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = f"{CATEGORY}/patches"
    TITLE = "H3 Attention Patch (native model)"

    def patch(self, model, backend):
        return (_engine().patch_native_attention(model, backend),)


def _tooltip(name: str) -> str | None:
    if name in TOOLTIPS:
        return TOOLTIPS[name]
    kind, _, rest = name.partition("_")
    if kind in ("image", "video", "audio") and rest.isdigit():
        label = {"image": "Picture", "video": "Video", "audio": "Audio"}[kind]
        return f"Reference {kind} {rest}: the prompt names it <{label} {rest}> (numbered among the connected ones)."
    if kind == "video" and rest.endswith("_audio"):
        return f"The soundtrack of video_{rest.split('_')[0]} (optional); it becomes an <Audio j> reference too."
    return None


def _described(node_class):
    """Every input gets a tooltip (its own, or the shared one) and the node its DESCRIPTION (the docstring)."""
    declared = node_class.INPUT_TYPES.__func__

    def input_types(cls):
        spec = declared(cls)
        for group in spec.values():
            for name, entry in list(group.items()):
                options = dict(entry[1]) if len(entry) > 1 else {}
                if not options.get("tooltip") and _tooltip(name):
                    options["tooltip"] = _tooltip(name)
                group[name] = (entry[0], options) if options else entry
        return spec

    node_class.INPUT_TYPES = classmethod(input_types)
    node_class.DESCRIPTION = inspect.cleandoc(node_class.__doc__ or "")
    return node_class


NODES = (H3ModelLoader, H3LoraLoader, H3TextEncoderLoader, H3VAELoader, H3TextToVideo, H3FirstLastFrameToVideo,
         H3ReferenceToVideo, H3AddGuide, H3ExtendVideo, H3JoinVideo, H3Sampler, H3Decode, H3SaveVideo, H3AttentionPatch, H3NativeAttentionPatch)
NODES = tuple(_described(cls) for cls in NODES)
NODE_CLASS_MAPPINGS = {f"H3Spark{cls.__name__[2:]}": cls for cls in NODES}
NODE_DISPLAY_NAME_MAPPINGS = {key: cls.TITLE for key, cls in NODE_CLASS_MAPPINGS.items()}
