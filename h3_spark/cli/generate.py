"""`h3-spark generate`: prompt (+ references or keyframes) -> mp4 with sound, or a still (one frame) -> PNG."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..h3_model.engine.options import (add_budget_flags, add_kernel_flags, add_model_flags, add_parallel_flags,
                                       add_precision_flags)
from ..h3_model.engine.recipes import check_recipe_mode
from .control import add_control_flags, check_control_flags, parse_control
from .compose import (add_compose_flags, check_flags, film_summary, is_film, parse_guides, parse_repaint,
                      plan_film_flags, render_film_out)

REF_KINDS = ("image", "video", "audio")
DEFAULT_STEPS = 50
DEMO_STEPS = 9  # the demo's output is noise: a few steps check the install as well as fifty


def add_parser(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="generate a video with sound (T2VA, FL2VA, Ref2VA), or a still image (--image)",
                       description="Generate a video with sound from a prompt, references or keyframes, or a still "
                                   "image from a prompt (--image: one frame, a PNG).")
    p.add_argument("--mode", choices=["t2va", "fl2va", "ref2va"], default=None,
                   help="default: ref2va with --ref, fl2va with keyframes, else t2va")
    p.add_argument("--prompt", help="the prompt (required unless --demo; '' for none with keyframes or references)")
    p.add_argument("--ref", action="append", default=[], metavar="KIND:PATH",
                   help="a reference, in order: image:PATH, video:PATH (its soundtrack is used when present) "
                        "or audio:PATH; repeatable (9 images, 3 videos, 3 audio, 12 in all)")
    p.add_argument("--first-frame", type=Path, help="FL2VA first keyframe image")
    p.add_argument("--last-frame", type=Path, help="FL2VA last keyframe image")
    p.add_argument("--width", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--frames", type=int, default=None,
                   help="snapped up to 17n+5, 124..345 (5-15 s at 24 fps; default 124), or 1: a still image (text "
                        "to image, written as a PNG)")
    p.add_argument("--image", action="store_true",
                   help="a still image: --frames 1 (t2va; one latent frame, decoded by the video VAE alone; the audio "
                        "VAE is not loaded); --out names a .png")
    p.add_argument("--steps", type=int, default=None,
                   help=f"sigma grid points incl. the final 0 (steps-1 DiT forwards; default {DEFAULT_STEPS}, "
                        f"{DEMO_STEPS} with --demo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--video-shift", type=float, default=None,
                   help="flow shift of the video schedule (default: the model folder's model_index.json, "
                        "_minimax_h3.sigma_shift_scales.video; 12 when it does not say)")
    p.add_argument("--audio-shift", type=float, default=None,
                   help="flow shift of the audio schedule (default: the model folder's model_index.json; 3 when it "
                        "does not say)")
    p.add_argument("--sigmas", default=None,
                   help="explicit sigma schedule for video and audio, comma-separated, strictly decreasing to 0 "
                        "(e.g. 4-step Turbo LoRAs: 1,0.75,0.5,0.25,0); overrides --steps and the shifts")
    from ..h3_model.pipeline.scheduler import schedulers_help
    from ..h3_model.pipeline.solvers import samplers_help

    p.add_argument("--sampler", default=None, metavar="NAME",
                   help="the step rule (default euler): " + samplers_help())
    p.add_argument("--scheduler", default=None, metavar="NAME",
                   help="the sigma grid over --steps points (default h3; not with --sigmas): " + schedulers_help())
    p.add_argument("--image-ref-size", choices=["match", "max", "diffusers"], default="match",
                   help="image references: scaled down to the canvas area (match, ComfyUI's default), to a 2048 px "
                        "short edge (max), or resized to 2048 px like diffusers")
    add_model_flags(p)
    p.add_argument("--embeddings", type=Path, default=None, metavar="DIR",
                   help="the folder `embedding:NAME` in the prompt is found in (NAME or NAME.safetensors; "
                        "safetensors only): its vectors go into the text encoder's input at that place")
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:STRENGTH]", help="merged at load; repeatable")
    add_precision_flags(p)
    add_budget_flags(p)
    add_kernel_flags(p)
    cache = p.add_argument_group("step cache (opt-in, approximate)")
    cache.add_argument("--cache-mode", choices=["off", "easycache", "h3_cache", "first_block"], default="off")
    cache.add_argument("--cache-threshold", type=float, default=None, help="default: the mode's own")
    cache.add_argument("--cache-start-percent", type=float, default=0.2)
    cache.add_argument("--cache-end-percent", type=float, default=0.9)
    cache.add_argument("--cache-subsample-factor", type=int, default=1)
    p.add_argument("--decoder", choices=["vae", "taeh3"], default="vae",
                   help="video decoder: vae (the full video VAE) or taeh3 (a draft: the whole clip through the tiny "
                        "temporal TAEH3, madebyollin/taehv's taeh3.safetensors given with --taeh3; the same frames "
                        "and size, much faster and lighter, approximate; audio still through the audio VAE)")
    p.add_argument("--taeh3", type=Path, default=None, metavar="PATH", help="the TAEH3 file for --decoder taeh3")
    p.add_argument("--preview", type=Path, default=None, metavar="DIR",
                   help="write a small strip of the clip as it forms (false-colour latent view, 4 frames) to "
                        "DIR/step-NNN.png every --preview-every steps")
    p.add_argument("--preview-every", type=int, default=5, metavar="N")
    from ..h3_model.engine.recipes import recipes_help

    p.add_argument("--recipe", action="append", default=[], metavar="NAME[:key=value,...]",
                   help="an opt-in speed recipe (approximate), repeatable (a Turbo or PDD LoRA with --lora): "
                        + recipes_help())
    add_parallel_flags(p)
    add_compose_flags(p)
    add_control_flags(p)
    p.add_argument("--demo", action="store_true",
                   help="tiny synthetic models made on the spot (the output is noise): checks an install end to end "
                        "on any machine; the default when no model is given, refused together with model paths")
    p.add_argument("--demo-dir", type=Path, default=None, help="where --demo keeps its models")
    p.add_argument("--offload-text-encoder", action="store_true", help="move Qwen to the CPU after encoding")
    p.add_argument("--keep-adaln", action="store_true",
                   help="keep the DiT's AdaLN weights after precomputing this schedule's tables (by default they are "
                        "released: exact, and 26 GB less at full size)")
    p.add_argument("--save-latents", type=Path, help="also save the final latents (for `h3-spark decode`)")
    p.add_argument("--ffmpeg-loglevel", default=None)
    p.add_argument("--out", "--output", dest="out", type=Path, default=None,
                   help="mp4 to write, or the .png of a still (required with real models; the demo defaults to "
                        "h3-spark-demo.mp4 / .png)")
    p.add_argument("--progress", action="store_true", help="print stages and per-step sampler timing on stderr")
    p.add_argument("--profile-memory", action="store_true", help="print memory checkpoints per stage on stderr")
    p.add_argument("--quiet", action="store_true", help="print nothing, not even the JSON summary")
    return p


def parse_refs(items: list[str]):
    from ..errors import InputError
    from ..h3_model.media.refs import load_reference

    refs = []
    for item in items:
        kind, sep, path = item.partition(":")
        if not sep or kind not in REF_KINDS or not path:
            raise InputError(f"--ref must be KIND:PATH with KIND in {', '.join(REF_KINDS)}, got {item!r}")
        refs.append(load_reference(kind, path))
    return refs


def run(args) -> int:
    from ..h3_model.engine.options import check_placement
    from .distributed import command_argv, relaunch_with_torchrun

    world_size = check_placement(args)
    if world_size > 1 and "WORLD_SIZE" not in os.environ:
        return relaunch_with_torchrun(args.gpus, command_argv(args), args.nnodes, args.node_rank, args.rdzv_endpoint)
    rank, world, device = join_ranks(args, world_size)
    log = stderr_log(args, rank)
    engine, req, options, film_plan = prepare(args, device, world_size, rank, world, log)
    if film_plan is not None:
        return run_film(args, engine, req, film_plan, progress_hook(args, device, log), rank, options)
    if rank:
        engine.generate(req, on_progress=progress_hook(args, device, log))
        return 0
    result = render(args, engine, req, progress_hook(args, device, log))
    if not args.quiet:
        print(json.dumps(summarize(args, engine, req, result, options, world)))
    return 0


def prepare(args, device: str, world_size: int, rank: int, world: int, log):
    """(engine, request, LoadOptions, film plan or None): the flags checked, every refusal made before any weight
    is read, then the models loaded and the request's recipes applied; what `run` renders (and benchmarks time)."""
    still = resolve_frames(args)
    use_demo_models(args, log)
    film = is_film(args)  # before the request: a length within one generation becomes --frames
    check_output_flags(args)
    options, settings = engine_options(args, device, world_size)
    recipes = recipe_flags(args, options)
    req = build_request(args, settings)
    check_recipe_mode(recipes, req.mode)  # a FastH3 checkpoint distilled for other modes, before any weight loads
    embeddings = prompt_embeddings(args, options)  # found and checked before any weight loads
    film_plan = plan_film_flags(args, req) if film else None  # its windows, before any weight loads
    check_flags(args, req, film_plan, rank)  # every refusal the flags allow, before any weight is read
    engine = load_engine(args, options, req.mode, log, audio=not still)
    if embeddings is not None:
        engine.components.text_encoder.prompts.embeddings = embeddings
    return engine, prepare_for(engine, req, recipes, options, world, log), options, film_plan


def run_film(args, engine, req, film_plan, progress, rank: int, options) -> int:
    """A film past one generation (compose.py): windows into --out, and its summary."""
    step_cache, req.step_cache = req.step_cache, None
    fresh = None if step_cache is None else (lambda: _step_cache(args))
    result = render_film_out(args, engine, req, film_plan, progress, rank, fresh)
    if result is not None and not args.quiet:
        kernels = engine.kernel_reports[_dit_key(req.mode)]
        print(json.dumps(film_summary(args, engine, result, kernels,
                                      exactness(kernels, step_cache is not None, req.recipes, req.decoder),
                                      options)))
    return 0


def join_ranks(args, world_size: int) -> tuple[int, int, str]:
    """(rank, world, device): this process's place among torchrun's ranks, or the only one."""
    if world_size > 1:
        from .distributed import init_distributed

        return init_distributed(args.gpus, args.device, args.nnodes)
    from ..h3_model.engine.options import default_device

    return 0, 1, args.device or default_device()


def stderr_log(args, rank: int):
    """h3-spark's own progress lines on stderr (rank 0, with --progress or --profile-memory, unless --quiet)."""
    verbose = (args.progress or args.profile_memory) and not args.quiet and not rank
    if not verbose:
        _silence_library_progress()
        return lambda message: None
    return lambda message: print(f"h3-spark: {message}", file=sys.stderr, flush=True)


def resolve_frames(args) -> bool:
    """--frames and --image: the frame count (124 unless given), and whether it is a still (one frame, a PNG).
    A still is one generation: the flags of a film are refused with it."""
    from ..errors import InputError

    if args.image and args.frames not in (None, 1):
        raise InputError(f"--image is --frames 1 (a still); --frames {args.frames} makes a clip: drop one of them")
    args.frames = 1 if args.image else 124 if args.frames is None else args.frames
    still = args.frames == 1
    if still:
        film = [flag for flag, given in (("--seconds", args.seconds is not None), ("--shot", bool(args.shot)),
                                         ("--shots", bool(args.shots)), ("--continue", bool(args.continue_from)),
                                         ("--repaint", args.repaint is not None))
                if given]
        if film:
            raise InputError(f"a still (--frames 1 / --image) is one picture; {', '.join(film)} make a clip")
    return still


def use_demo_models(args, log) -> None:
    """No model given (or --demo): the built-in tiny set, with the demo's prompt, canvas and output; then the
    step count's default."""
    from ..errors import InputError
    from ..h3_model.engine.options import given_model_flags

    given = given_model_flags(args)
    if args.demo and given:
        raise InputError(f"--demo makes its own tiny models and would ignore {', '.join(given)}: drop one or the "
                         "other")
    args.demo = args.demo or not given
    if args.demo:
        from ..h3_model.engine.demo import DEMO_PROMPT, TEXT_READ_LAYER, build_demo_models, default_demo_dir

        args.models = build_demo_models(args.demo_dir or default_demo_dir(), log=log)
        args.prompt = DEMO_PROMPT if args.prompt is None else args.prompt
        args.out = args.out or Path("h3-spark-demo.png" if args.frames == 1 else "h3-spark-demo.mp4")
        if args.width is None and args.repaint is None and args.continue_from is None:  # those keep their clip's
            args.width, args.height = 128, 64
        if args.text_encoder_layer is None:
            args.text_encoder_layer = TEXT_READ_LAYER
    args.steps_given = args.steps is not None
    if args.steps is None:
        args.steps = DEMO_STEPS if args.demo else DEFAULT_STEPS


def check_output_flags(args) -> None:
    """--out, --prompt, --save-latents and --preview, refused before anything loads."""
    from ..errors import InputError

    if args.out is None:
        raise InputError("--out is required")
    if args.prompt is None:  # an empty one is judged by the mode (GenerationRequest.validate)
        raise InputError("--prompt is required (--prompt '' gives none, for fl2va and ref2va)")
    still = args.frames == 1
    if still and args.out.suffix.lower() != ".png":
        raise InputError(f"--out must end in .png for a still (--frames 1 / --image), got {args.out}")
    if not still and args.out.suffix.lower() != ".mp4":
        hint = "; a .png is written for a still (--frames 1 / --image)" if args.out.suffix.lower() == ".png" else ""
        raise InputError(f"--out must end in .mp4 for a clip, got {args.out}{hint}")
    check_outputs(args.out, args.save_latents)
    check_preview(args.preview, args.preview_every)
    check_decoder(args.decoder, args.taeh3)
    check_control_flags(args)


def check_decoder(decoder: str, taeh3: Path | None) -> None:
    from ..errors import InputError

    if decoder == "taeh3" and taeh3 is None:
        raise InputError("--decoder taeh3 needs --taeh3 PATH (madebyollin/taehv's taeh3.safetensors)")
    if decoder != "taeh3" and taeh3 is not None:
        raise InputError(f"--taeh3 {taeh3} is read only with --decoder taeh3")
    if taeh3 is not None and not taeh3.is_file():
        raise InputError(f"--taeh3 {taeh3}: no such file")


def engine_options(args, device: str, world_size: int):
    """(LoadOptions, RequestSettings): the shared flags' (options.py) with --lora."""
    from ..h3_model.checkpoint.lora import LoraSpec
    from ..h3_model.engine.options import load_options

    return load_options(args, device, world_size, loras=[LoraSpec.parse(x) for x in args.lora])


def recipe_flags(args, options) -> list:
    """--recipe, parsed and checked against the device, kernels and the other flags."""
    from ..h3_model.engine.recipes import check_recipes, parse_recipes

    recipes = parse_recipes(args.recipe)
    check_recipes(recipes, options.device, options.kernels, step_cache=args.cache_mode != "off",
                  explicit_steps=args.sigmas is not None or args.steps_given, loras=options.loras,
                  explicit_sampler=args.sampler is not None, explicit_scheduler=args.scheduler is not None)
    return recipes


def build_request(args, settings):
    """The GenerationRequest of the flags (references and keyframes read), validated, with its step cache."""
    from ..h3_model.media import files as media
    from ..h3_model.pipeline.generation import GenerationRequest

    refs = parse_refs(args.ref)
    first = media.read_image(args.first_frame) if args.first_frame else None
    last = media.read_image(args.last_frame) if args.last_frame else None
    mode = args.mode or ("ref2va" if refs else "fl2va" if (first is not None or last is not None) else "t2va")
    req = GenerationRequest(mode=mode, prompt=args.prompt, references=refs, first_frame=first, last_frame=last,
                            guides=parse_guides(args.guide), guide_strength=args.guide_strength,
                            audio_guide_strength=args.audio_guide_strength,
                            **dict(zip(("source", "mask"), parse_repaint(args))),
                            width=args.width, height=args.height, frames=args.frames, steps=args.steps,
                            seed=args.seed, video_shift=args.video_shift, audio_shift=args.audio_shift,
                            reference_policy=args.image_ref_size, mlp_chunks=settings.mlp_chunks,
                            vae_tile_size=settings.vae_tile_size, sigmas=_parse_sigmas(args.sigmas),
                            sampler=args.sampler, scheduler=args.scheduler, decoder=args.decoder,
                            control=parse_control(args))
    req.validate()
    if req.sigmas is not None:
        args.steps = len(req.sigmas)  # grid points: the step cache counts len - 1 evaluations
    elif req.scheduler not in (None, "h3"):
        from ..h3_model.pipeline.generation import schedule_of

        args.steps = len(schedule_of(req)) + 1  # beta drops repeated table entries: fewer evaluations
    if args.cache_mode != "off":
        req.step_cache = _step_cache(args)
    return req


def prompt_embeddings(args, options):
    """--embeddings: the library the prompts' `embedding:NAME` are read from, each one the prompts name found and
    checked from its header against the text encoder's hidden size (read from its config and headers). A prompt
    naming one without --embeddings is refused."""
    from ..errors import InputError
    from ..h3_model.text.embeddings import EmbeddingLibrary, names_in, no_library_message

    prompts = [args.prompt] + [shot.prompt for shot in _shots(args)]
    if args.embeddings is None:
        for prompt in prompts:
            refused = no_library_message(prompt)
            if refused is not None:
                raise InputError(refused)
        return None
    library = EmbeddingLibrary([args.embeddings])
    if any(names_in(p) for p in prompts):
        width = _text_width(args, options)
        for prompt in prompts:
            library.check_prompt(prompt, width)
    return library


def _shots(args) -> list:
    from .compose import parse_shots

    return parse_shots(args) if (args.shot or args.shots) else []


def _text_width(args, options) -> int | None:
    """The text encoder's hidden size from its config and headers (no weight read); None for the demo's models,
    checked when the prompt is encoded."""
    from ..h3_model.engine.options import component_paths
    from ..h3_model.text.encoder import check_text_encoder

    paths = component_paths(args)
    path = paths.resolve("text_encoder")
    if path is None:
        return None
    return check_text_encoder(path, tokenizer=paths.resolve("tokenizer"), layer=options.text_layer,
                              vision=options.text_vision)


def _step_cache(args):
    from ..h3_model.pipeline.step_cache import make_step_cache

    return make_step_cache(args.cache_mode, args.cache_threshold, args.cache_start_percent, args.cache_end_percent,
                           args.cache_subsample_factor, evaluations=args.steps - 1)


def load_engine(args, options, mode: str, log, audio: bool = True):
    """The engine with what `mode` needs; `audio` False (a still): without the audio VAE."""
    from ..h3_model.engine.engine import Engine
    from ..h3_model.engine.options import component_paths

    engine = Engine(component_paths(args), options, offload_text_encoder=args.offload_text_encoder,
                    release_adaln=not args.keep_adaln)
    if args.controlnet is not None:  # the ControlNet against the DiT's header, before any weight loads
        engine.check_controlnet(args.controlnet, [mode])
    engine.load([mode], on_progress=lambda event: event.state == "loading" and log(f"loading {event.component}"),
                audio=audio)
    if args.controlnet is not None:
        log("loading controlnet")
        engine.load_controlnet(args.controlnet)
    if args.decoder == "taeh3":
        engine.load_taeh3(args.taeh3)
    if not args.quiet:
        for note in load_notes(engine):
            print(f"h3-spark: note: {note}", file=sys.stderr, flush=True)
    return engine


def load_notes(engine) -> list[str]:
    """What the readers said about the files they loaded (a GGUF declaring another architecture, the vision file a
    GGUF text encoder took), one line each."""
    from ..h3_model.engine.loading import LOADED

    notes = []
    for name in LOADED:
        component = getattr(engine.components, name, None)
        for note in (getattr(getattr(component, "checkpoint_origin", None), "note", None),
                     getattr(component, "vision_note", None)):
            if note:
                notes.append(note)
    return notes


def prepare_for(engine, req, recipes: list, options, world: int, log):
    """The request with its recipes applied to the loaded DiT; the DiT split over the ranks under --gpus."""
    if recipes:
        from ..h3_model.engine.recipes import apply_recipes

        req = apply_recipes(recipes, req, getattr(engine.components, _dit_key(req.mode)), options.device,
                            options.kernels)
        log("recipes: " + "; ".join(", ".join(f"{k}={v}" for k, v in r.items()) for r in req.recipes))
    if world > 1:
        import torch.distributed as dist

        engine.distribute(None, dist.group.WORLD)
    return req


def progress_hook(args, device: str, log):
    """Each stage and sampling step: the preview strip, and a log line (with memory under --profile-memory)."""
    write_preview = preview_writer(args.preview, args.preview_every)

    def progress(p):
        write_preview(p)
        memory = f" [{_memory(device)}]" if args.profile_memory else ""
        if p.stage == "sampling" and p.total:
            log(f"step {p.step}/{p.total}" + (f" ({p.seconds:.2f} s)" if p.step else "") + memory)
        else:
            log(p.stage.replace("_", " ") + memory)

    return progress


def render(args, engine, req, progress):
    """Generate into the mp4 (encoded while the VAE decodes later windows; "mux" is what is left after the
    decode), and --save-latents."""
    import time

    from ..h3_model.media import files as media

    if req.still:  # one picture: a PNG, written once it is decoded
        result = engine.generate(req, on_progress=progress)
        save_latents(args, req, result)
        start = time.perf_counter()
        media.write_png(args.out, result.video[0])
        result.timings["png"] = time.perf_counter() - start
        return result
    with media.mp4_writer(args.out, loglevel=args.ffmpeg_loglevel) as stream:
        result = engine.generate(req, on_progress=progress, on_frames=stream.add)
        save_latents(args, req, result)
        start = time.perf_counter()
        stream.finish(result.audio)
        result.timings["mux"] = time.perf_counter() - start
    return result


def save_latents(args, req, result) -> None:
    """--save-latents: the final normalised latents (for `h3-spark decode`)."""
    if args.save_latents:
        from safetensors.torch import save_file

        save_file({"video_latents": result.video_latents.contiguous(), "audio_latents": result.audio_latents},
                  str(args.save_latents), metadata={"latents": "normalized", "mode": req.mode})


def summarize(args, engine, req, result, options, world: int) -> dict:
    """The JSON summary printed on stdout."""
    from ..h3_model.engine.host_memory import host_memory_report
    from ..kernels.dispatch import attention_counts

    key, device = _dit_key(req.mode), options.device
    kernels = engine.kernel_reports[key]
    vae_kernels = engine.kernel_reports.get("vae")
    summary = {"out": str(args.out), "mode": req.mode, "device": device, "gpus": world,
               "dtype": str(options.dtype).removeprefix("torch."),
               "width": result.info["width"], "height": result.info["height"], "frames": int(result.video.shape[0]),
               "audio_samples": int(result.audio.shape[1]), "sequence_length": result.info["sequence_length"],
               "evaluations": result.info["evaluations"],
               **{k: result.info[k] for k in ("sampler", "scheduler") if result.info.get(k) is not None},
               **{k: result.info[k] for k in ("video_shift", "audio_shift") if k in result.info},
               "timings_s": {k: round(v, 4) for k, v in result.timings.items()},
               "load_s": {k: round(v, 3) for k, v in engine.load_seconds.items()},
               "attention": kernels.get("attention", {}).get("chosen"),
               "linear": kernels.get("linear", {}).get("format"),
               **exactness(kernels, req.step_cache is not None, req.recipes, result.info["decoder"]),
               "decoder": result.info["decoder"],
               "vae_attention": (vae_kernels or {}).get("attention", {}).get("chosen")}
    if "step_cache" in result.info:
        summary["step_cache"] = result.info["step_cache"]
    if "notes" in result.info:  # what was taken with a change (a sound guide cropped to the clip)
        summary["notes"] = result.info["notes"]
    if "control" in result.info:  # --controlnet: the version, blocks, window and the evaluations it ran in
        summary["control"] = result.info["control"]
    if "kept_rows" in result.info:  # --repaint: the DiT rows held at the clip's latents
        summary["kept_rows"] = result.info["kept_rows"]
    if "nvfp4_static_scales" in result.info:  # static or, outside the calibrated shapes, dynamic (and why)
        summary["nvfp4_static_scales"] = result.info["nvfp4_static_scales"]
    if engine.memory_report(key) is not None:
        summary["vram_budget"] = engine.memory_report(key)
    if engine.auto_budget is not None:
        summary["vram_budget_auto"] = engine.auto_budget
    dit = getattr(engine.components, key)
    counts = attention_counts(dit)
    if counts:  # calls a backend made on another kernel (H3_SOL_MIN_TOKENS, H3_SOL_STRICT=0, ...)
        summary["attention_calls"] = counts
    summary["peak_memory_gb"] = _peak_gb(device)
    # Beside the GPU's: under a VRAM budget the streamed weights wait in host memory, and a container is
    # stopped on its cgroup's count (page cache and pinned buffers included), not on the GPU's.
    summary.update(host_memory_report())
    notes = load_notes(engine)
    if notes:
        summary["load_notes"] = notes
    if args.demo:
        summary["note"] = "demo: tiny synthetic random weights, the video and sound are noise"
    return summary


def _dit_key(mode: str) -> str:
    return "dit_ref" if mode == "ref2va" else "dit"


def check_outputs(out: Path, latents: Path | None) -> None:
    """Both outputs are written only after the whole generation: a path that cannot be written must fail now."""
    from ..errors import InputError

    for flag, path in (("--out", out), ("--save-latents", latents)):
        if path is None:
            continue
        if path.is_dir():
            raise InputError(f"{flag} {path} is a folder; give a file path")
        if not path.parent.is_dir():
            raise InputError(f"{flag} {path}: no such folder {path.parent}")
    if latents is not None and latents.resolve() == out.resolve():
        raise InputError(f"--save-latents and --out both name {out}: the mp4 would replace the latents")


def check_preview(folder: Path | None, every: int) -> None:
    from ..errors import InputError

    if every < 1:
        raise InputError(f"--preview-every must be at least 1, got {every}")
    if folder is not None and folder.exists() and not folder.is_dir():
        raise InputError(f"--preview {folder} is a file; give a folder")
    if folder is not None and not folder.parent.is_dir():
        raise InputError(f"--preview {folder}: no such folder {folder.parent}")


def preview_writer(folder: Path | None, every: int):
    """A progress hook writing the preview strip of every `every`-th step (and the last) into `folder`."""
    if folder is None:
        return lambda p: None
    from ..h3_model.pipeline.preview import png_bytes, preview_image

    folder.mkdir(exist_ok=True)

    def write(p) -> None:
        if p.stage == "sampling" and p.latents is not None and (p.step % every == 0 or p.step == p.total):
            (folder / f"step-{p.step:03d}.png").write_bytes(png_bytes(preview_image(p.latents(), 768, frames=4)))

    return write


def exactness(kernels: dict, step_cache: bool, recipes: list[dict] = (), decoder: str = "vae") -> dict:
    """The summary's "exact" and "approximate_paths": a step cache, a recipe or the TAEH3 draft decoder is
    approximate whatever the kernels are; the recipes are listed with their values."""
    approximate = list(kernels.get("approximate_paths", [])) + (["step_cache"] if step_cache else [])
    approximate += [f"recipe {r['name']}" for r in recipes]
    approximate += ["decoder taeh3"] if decoder == "taeh3" else []
    out = {"exact": kernels.get("exact") is True and not approximate, "approximate_paths": approximate}
    if recipes:
        out["recipes"] = list(recipes)
    return out


def _parse_sigmas(text: str | None) -> list[float] | None:
    from ..errors import InputError
    from ..h3_model.pipeline.scheduler import custom_sigmas

    if text is None:
        return None
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--sigmas must be comma-separated numbers, got {text!r}") from None
    return custom_sigmas(values).tolist()


def _silence_library_progress() -> None:
    """transformers draws its own progress bars while loading; quiet means quiet."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def _peak_gb(device: str) -> float:
    """Peak GPU memory on CUDA; the process's peak resident memory on the CPU."""
    import resource

    import torch

    if device.startswith("cuda"):
        return round(torch.cuda.max_memory_allocated() / 1e9, 3)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 3)


def _memory(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return (f"allocated {torch.cuda.memory_allocated() / 1e9:.2f} GB, "
                f"peak {torch.cuda.max_memory_allocated() / 1e9:.2f} GB")
    return f"peak RSS {_peak_gb(device):.2f} GB"
