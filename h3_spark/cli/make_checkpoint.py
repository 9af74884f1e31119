"""`h3-spark make-checkpoint`: a random-weight checkpoint with the real names, layout and format."""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import shutil
import sys
import time
from pathlib import Path

# Which model a checkpoint is made for.
COMPONENTS = ("dit", "vae", "audio_vae", "text_encoder", "taeh3", "pdd", "turbo", "embedding", "controlnet")
# --format values per component (the VAEs are written as published; the video VAE also as int8_convrot).
DIT_FORMATS = ("bf16", "fp8_scaled", "nvfp4", "int8_convrot", "int4_convrot", "w4a8", "w4a8_sym", "w4a8_asym")
# A GGUF DiT: gguf:<GGML type>, the writable types checked by the writer (h3_model/checkpoint/gguf_writer.py).
GGUF_FORMAT = "gguf:"
TEXT_ENCODER_FORMATS = ("bf16", "fp8_scaled", "int8_convrot", "nvfp4_awq", "int4_convrot", "w4a8", "w4a8_sym",
                        "w4a8_asym")
# What a text encoder's tokenizer folder holds; --force replaces only these.
TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.j*", "processor_config.json",
                   "preprocessor_config.json", "video_preprocessor_config.json")
# What a checkpoint folder holds; --force removes only these from an existing folder.
CHECKPOINT_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json", "config.yaml", "metadata.json")
# --format per VAE: "float" is as published (the default, --format bf16 on the command line); the video VAE also as
# ComfyUI's minimax_h3_video_vae_int8_convrot (its decoder blocks' linears int8 + ConvRot).
VAE_FORMATS = {"vae": ("float", "int8_convrot"), "audio_vae": ("float",)}
# MiniMaxAI's video_vae/ keeps its weights in this subfolder.
SOURCE_FOLDER = "source"


class _FormatChoices(tuple):
    """argparse choices: the listed formats, and any gguf:<TYPE> (its type is checked when the file is planned,
    with the list of writable types)."""

    def __contains__(self, value) -> bool:
        return tuple.__contains__(self, value) or (isinstance(value, str) and value.startswith(GGUF_FORMAT))


def add_parser(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="write a deterministic random-weight checkpoint (tests, demos, benchmarks)",
                       description="Write random weights (normal / sqrt(fan_in), norms around 1) under the real "
                                   "tensor names, in a published layout and format, streamed tensor by tensor "
                                   "(the full preset never needs its 66 GB in RAM). --component text_encoder "
                                   "writes ComfyUI's Qwen3-VL single file (the 50 decoder layers the DiT reads, "
                                   "tiny: the demo's 2) and, beside it, the tokenizer folder that loading it needs. "
                                   "--component pdd writes a PDD acceleration LoRA for the preset's DiT: the trunk "
                                   "LoRA pairs and the 32-head bank per modality under the published names (rank 64 "
                                   "full, 4 tiny; bf16), or with --layout comfy the same values as ComfyUI's converted "
                                   "file holds them, for --lora with --recipe pdd. --component turbo writes a Turbo "
                                   "LoRA (the few-step LoRAs of ComfyUI's H3 templates: attention and feed-forward "
                                   "pairs of every DiT and refiner block, rank 128 full, 4 tiny, no AdaLN adapter, so "
                                   "it fits the pruned DiT too): --layout comfy (default) as the templates download "
                                   "it, released as LightX2V publishes it.")
    p.add_argument("out", help="output: a .safetensors file (comfy layouts), a .gguf file (gguf:<TYPE> formats) or "
                               "a folder (diffusers, released)")
    p.add_argument("--component", choices=COMPONENTS, default="dit", help="which model to write")
    p.add_argument("--preset", choices=["tiny", "full"], default="tiny")
    p.add_argument("--format", choices=_FormatChoices(sorted(set(DIT_FORMATS) | set(TEXT_ENCODER_FORMATS))
                                                     + [GGUF_FORMAT + "<TYPE>"]), default=None,
                   help="DiT (bf16|fp8_scaled|nvfp4|int8_convrot|int4_convrot|w4a8|w4a8_sym|w4a8_asym): storage "
                        "of the 4 linears of every block; everything else stays bf16/fp32. int4_convrot is ComfyUI's "
                        "convrot_w4a4; w4a8 is asym_w4a8_int8 in its codebook variant (as published), w4a8_sym and "
                        "w4a8_asym its symmetric and asymmetric ones (group 16, ConvRot 256); a linear whose input "
                        "width a 4-bit format cannot hold stays bf16. DiT gguf:<TYPE> (Q8_0, Q5_1, Q5_0, Q4_1, Q4_0: bit for bit "
                        "the gguf package's quantizers; Q6_K, Q5_K, Q4_K, Q3_K, Q2_K: our own K-quant quantizer; "
                        "F16, BF16, F32; quantized on --device): a .gguf file as the published GGUFs hold it, the "
                        "comfy or comfy-pruned layout's names, every 2-D weight in TYPE where its rows are whole "
                        "blocks (else F16), 1-D tensors, the curve table and the patch projections F32. "
                        "text_encoder (bf16|fp8_scaled|int8_convrot|nvfp4_awq|int4_convrot|w4a8|w4a8_sym|"
                        "w4a8_asym): "
                        "storage of the 7 linears of every decoder layer, the rest as Comfy-Org's files keep it "
                        "(nvfp4_awq: AWQ pre_quant_scale on o_proj/down_proj, the other scales folded into the "
                        "norms, int8 embedding); text_encoder gguf:<TYPE> (the DiT's GGUF types) or the llama.cpp "
                        "mixes gguf:Q4_K_M / gguf:Q2_K_M: a .gguf file as llama.cpp converts Qwen3-VL's text model "
                        "(llama.cpp's names, no vision tower: text prompts only). VAEs are written as published "
                        "(video fp16 comfy / fp32 diffusers, audio fp32); vae int8_convrot: ComfyUI's "
                        "minimax_h3_video_vae_int8_convrot single file (the decoder blocks' 4 linears int8 + ConvRot "
                        "256, 144 at full size, each with its .comfy_quant; the rest fp16 as the fp16 file of the "
                        "same seed)")
    p.add_argument("--layout", choices=["comfy", "comfy-pruned", "diffusers", "released"], default=None,
                   help="default comfy (pdd: released; turbo: comfy, or released for LightX2V's PEFT file). "
                        "released: the folder MiniMaxAI's per-mode download holds "
                        "(transformer/, video_vae/ or audio_vae/ of FL2VA/ and Ref2VA/); for --component pdd the "
                        "file Alibaba PAI published, and comfy ComfyUI's converted file (trunk on ComfyUI's names, "
                        "the head bank as flattened set_weight / set_bias, later heads as offsets from head 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu",
                   help="draw and quantize the DiT's or text encoder's tensors there (cuda: minutes instead of an "
                        "hour for --preset full); the random stream is the device's, so cpu and cuda files of one "
                        "seed differ")
    p.add_argument("--tokenizer-out", default=None, metavar="DIR",
                   help="text_encoder: where to write the tokenizer + processor folder the single file needs "
                        "(TextEncoder.from_pretrained(file, tokenizer=DIR), CLI --tokenizer); default <out>.tokenizer/ "
                        "beside the file (x.safetensors -> x.tokenizer/). It holds a byte-level stand-in tokenizer "
                        "with Qwen3-VL's special tokens (tiny: also the model's config.json); a full file loads with "
                        "the real one (MiniMaxAI/MiniMax-H3's tokenizer/ and processor/) as well")
    p.add_argument("--mmproj", action="store_true",
                   help="text_encoder gguf:<X>: also write the vision tower as llama.cpp's separate vision file, "
                        "mmproj-<name>.gguf beside the text GGUF (F16; F32/BF16 with those text types), which generate "
                        "finds there (or takes with --text-encoder-vision) for FL2VA keyframes and Ref2VA images")
    p.add_argument("--fasth3", action="store_true",
                   help="DiT: a FastH3 model (FastVideo's distilled student): the base DiT plus one random, non-zero "
                        "VSA gate per block (attn.to_gate_compress, bf16), in the diffusers, comfy or comfy-pruned "
                        "layout (the templates' FastH3 V2 and OmniRef files: --layout comfy-pruned --format "
                        "int8_convrot --quantize-gates)")
    p.add_argument("--quantize-gates", action="store_true",
                   help="--fasth3 in a comfy layout: store the VSA gates in --format too, as the published FastH3 "
                        "ComfyUI files do (else bf16)")
    p.add_argument("--quantize-refiner", action="store_true",
                   help="also quantize the token refiner's linears (ComfyUI files keep them bf16)")
    p.add_argument("--curve-grid", type=int, default=None,
                   help="comfy-pruned: rows of adaln_t_table (default 1025 full, 33 tiny)")
    p.add_argument("--curve-rank", type=int, default=None,
                   help="comfy-pruned: width k of adaln_t_table (default 8 full, 4 tiny)")
    p.add_argument("--union2", action="store_true",
                   help="controlnet: the Fun ControlNet Union 2.0 (10 blocks every 5 layers, mid-gray inpaint fill) "
                        "instead of v1 (5 blocks every 10 layers); the tiny DiT's 2 layers take 2 blocks either way. "
                        "--component controlnet writes one .safetensors file: --layout comfy (default) as ComfyUI's "
                        "converted file (pruned AdaLN reading --curve-rank basis values, the block linears int8_convrot, "
                        "or --format bf16), --layout released as Alibaba PAI's (bf16, full AdaLN)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing output: the file, or a folder's old checkpoint files (config.json, "
                        "*.safetensors, *.safetensors.index.json; a folder holding anything else is still "
                        "refused), removed once the new checkpoint is written. Without it, a non-empty output is "
                        "refused")
    return p


def _is_empty(out: Path) -> bool:
    return not out.exists() or (out.is_dir() and not any(out.iterdir())) or (out.is_file() and not out.stat().st_size)


def check_output(out: Path, layout: str, force: bool) -> list[Path]:
    """The files --force replaces. Writing into a non-empty output silently mixes two checkpoints: a
    sharded folder's old index would still be read instead of the new weights."""
    from ..errors import InputError

    folder = layout in ("diffusers", "released")
    if out.exists() and out.is_dir() != folder:
        raise InputError(f"{out} is {'a file' if folder else 'a folder'}; the {layout} layout writes "
                         f"{'a folder' if folder else 'one .safetensors file'}")
    if _is_empty(out):
        return []
    if not force:
        raise InputError(f"{out} exists and is not empty; pass --force to replace it")
    if not folder:
        return [out]
    others = [p.name for p in out.iterdir() if not (p.is_file() and _checkpoint_file(p.name) or _source_folder(p))]
    if others:
        raise InputError(f"--force replaces checkpoint files only, and {out} also holds {', '.join(sorted(others))}; "
                         "choose another folder")
    return sorted(out.iterdir())


def _checkpoint_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in CHECKPOINT_FILES)


def _source_folder(path: Path) -> bool:
    return path.is_dir() and path.name == SOURCE_FOLDER and all(p.is_file() and _checkpoint_file(p.name)
                                                               for p in path.iterdir())


def check_curve(grid: int | None, rank: int | None) -> None:
    """An explicit 0 is a value, not "use the default": a table needs 2 rows (both ends) and 1 column."""
    from ..errors import InputError

    if grid is not None and grid < 2:
        raise InputError(f"--curve-grid must be at least 2 (rows of adaln_t_table), got {grid}")
    if rank is not None and rank < 1:
        raise InputError(f"--curve-rank must be at least 1 (columns of adaln_t_table), got {rank}")


@contextlib.contextmanager
def replacing(stale: list[Path]):
    """The old files are moved aside while the new checkpoint is written, removed once it is, and put back
    if writing fails: a request the writer refuses must not cost the old checkpoint."""
    aside = [(path, path.with_name(f".{path.name}.replaced")) for path in stale]
    for path, moved in aside:
        os.replace(path, moved)
    try:
        yield
    except BaseException:
        for path, moved in aside:
            os.replace(moved, path)
        raise
    for _, moved in aside:
        if moved.is_dir():
            shutil.rmtree(moved)  # MiniMaxAI's source/ folder
        else:
            moved.unlink()


def _run_vae(args) -> int:
    from ..errors import InputError
    from ..h3_model.vae.synthetic import write_audio_vae_checkpoint, write_vae_checkpoint

    if args.layout == "comfy-pruned" or args.quantize_refiner or args.curve_grid is not None \
            or args.curve_rank is not None:
        raise InputError(f"--component {args.component} takes only --preset, --layout comfy|diffusers|released, "
                         "--format (vae: int8_convrot), --seed and --force")
    fmt = "float" if args.format == "bf16" else args.format
    if fmt not in VAE_FORMATS.get(args.component, ()):
        raise InputError(f"--component {args.component} is written as published (leave --format out)"
                         + (f" or as {', '.join(VAE_FORMATS['vae'][1:])} (ComfyUI's quantized video VAE)"
                            if args.component == "vae" else "") + f", not --format {args.format}")
    if fmt != "float" and args.layout != "comfy":
        raise InputError(f"--format {args.format} writes ComfyUI's single-file video VAE (--layout comfy), not the "
                         f"{args.layout} layout")
    stale = check_output(Path(args.out), args.layout, args.force)
    start = time.perf_counter()
    with replacing(stale):
        if args.component == "vae":
            path = write_vae_checkpoint(args.out, args.preset, args.layout, args.seed, fmt=fmt)
        else:
            path = write_audio_vae_checkpoint(args.out, args.preset, args.layout, args.seed)
    size = sum(f.stat().st_size for f in ([path] if path.is_file() else path.rglob("*")) if f.is_file())
    print(json.dumps({"out": str(path), "component": args.component, "preset": args.preset, "layout": args.layout,
                      "format": args.format if fmt != "float" else "as published", "seed": args.seed,
                      "bytes": size, "seconds": round(time.perf_counter() - start, 3)}))
    return 0


def check_device(device: str) -> None:
    from ..errors import InputError

    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise InputError("--device cuda asked for, but this machine has no CUDA GPU")
    elif device != "cpu":
        raise InputError(f"--device must be cpu or cuda[:N], got {device!r}")


def check_tokenizer_out(folder: Path, force: bool) -> list[Path]:
    """The tokenizer files --force replaces; a folder holding anything else is never touched."""
    from ..errors import InputError

    if folder.exists() and not folder.is_dir():
        raise InputError(f"--tokenizer-out {folder} is a file; the tokenizer and processor files go into a folder")
    if not folder.exists() or not any(folder.iterdir()):
        return []
    if not force:
        raise InputError(f"{folder} (the tokenizer folder) exists and is not empty; pass --force to replace it")
    others = [p.name for p in folder.iterdir()
              if not (p.is_file() and any(fnmatch.fnmatchcase(p.name, pat) for pat in TOKENIZER_FILES))]
    if others:
        raise InputError(f"--force replaces tokenizer files only, and {folder} also holds "
                         f"{', '.join(sorted(others))}; choose another --tokenizer-out")
    return sorted(folder.iterdir())


def _run_text_encoder(args) -> int:
    from ..errors import InputError
    from ..h3_model.text.synthetic import default_tokenizer_dir, write_text_encoder

    gguf = args.format.startswith(GGUF_FORMAT)
    if not gguf and args.format not in TEXT_ENCODER_FORMATS:
        hint = " (the published NVFP4 text encoder is nvfp4_awq)" if args.format == "nvfp4" else ""
        raise InputError(f"--component text_encoder is written as {', '.join(TEXT_ENCODER_FORMATS)} or "
                         f"{GGUF_FORMAT}<TYPE>, not {args.format}{hint}")
    if args.layout != "comfy" or args.quantize_refiner or args.curve_grid is not None or args.curve_rank is not None:
        raise InputError("--component text_encoder takes only --preset, --format, --seed, --device, --tokenizer-out "
                         "and --force (it is written as ComfyUI's single file or llama.cpp's GGUF, --layout comfy)")
    check_device(args.device)
    out = Path(args.out)
    if gguf:
        from ..h3_model.text.gguf_writer import scheme_of, write_text_encoder_gguf

        scheme_of(args.format)
        if out.suffix.lower() != ".gguf":
            raise InputError(f"{out}: a GGUF text encoder is one file; give a path ending in .gguf")
        writer = write_text_encoder_gguf
    elif args.mmproj:
        raise InputError("--mmproj writes a llama.cpp text GGUF's vision file: it takes --format gguf:<X> (a ComfyUI "
                         "single file holds its own vision tower)")
    else:
        if out.suffix != ".safetensors":
            raise InputError(f"{out}: a ComfyUI text encoder is one file; give a path ending in .safetensors")
        writer = write_text_encoder
    tokenizer_dir = Path(args.tokenizer_out) if args.tokenizer_out is not None else default_tokenizer_dir(out)
    stale = check_output(out, "comfy", args.force) + check_tokenizer_out(tokenizer_dir, args.force)
    if args.mmproj:
        from ..h3_model.text.gguf_writer import mmproj_path

        stale += check_output(mmproj_path(out), "comfy", args.force)
    start = time.perf_counter()
    vision = None
    with replacing(stale):
        made = writer(out, args.preset, args.format, seed=args.seed, tokenizer_dir=tokenizer_dir,
                      device=args.device, progress=_progress_printer())
        if args.mmproj:
            from ..h3_model.text.gguf_writer import write_mmproj

            vision = write_mmproj(out, args.preset, scheme_of(args.format), seed=args.seed, device=args.device)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    summary = {"out": str(made.path), "component": args.component, "preset": args.preset,
               "format": args.format, "layout": "comfy", "seed": args.seed, "device": args.device,
               "tokenizer": str(made.tokenizer_dir), "layers": made.layers, "bytes": made.bytes,
               "seconds": round(time.perf_counter() - start, 3)}
    if vision is not None:
        summary["mmproj"] = str(vision)
    print(json.dumps(summary))
    return 0


def _run_taeh3(args) -> int:
    """TAEH3 (madebyollin/taehv's taeh3.safetensors: encoder and temporal decoder, fp16), random weights."""
    from ..errors import InputError
    from ..h3_model.vae.taeh3_synthetic import write_taeh3

    if args.format != "bf16" or args.layout != "comfy" or args.device != "cpu" or args.tokenizer_out is not None \
            or args.fasth3 or args.mmproj or args.quantize_refiner or args.curve_grid is not None \
            or args.curve_rank is not None:
        raise InputError("--component taeh3 takes only --preset (tiny: the demo VAE's 4 latent channels, full: 24), "
                         "--seed and --force (it is written as published: one fp16 .safetensors file)")
    out = Path(args.out)
    stale = check_output(out, "comfy", args.force)
    start = time.perf_counter()
    with replacing(stale):
        path = write_taeh3(out, args.preset, args.seed)
    print(json.dumps({"out": str(path), "component": "taeh3", "preset": args.preset, "seed": args.seed,
                      "bytes": path.stat().st_size, "seconds": round(time.perf_counter() - start, 3)}))
    return 0


def _progress_printer():
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        if sys.stderr.isatty() and (now - last[0] > 1.0 or done == total):
            last[0] = now
            print(f"\r  {done / 2 ** 30:.2f} / {total / 2 ** 30:.2f} GiB", end="", file=sys.stderr, flush=True)

    return progress


def _run_pdd(args) -> int:
    """A PDD LoRA: one .safetensors file, the published (or ComfyUI's converted) names and shapes for the preset's
    DiT."""
    from ..h3_model.checkpoint.pdd import LAYOUTS, PDD_RANK, make_pdd_lora

    return _run_lora_file(args, LAYOUTS, PDD_RANK, make_pdd_lora, "released|comfy",
                          "the published PDD files are one .safetensors file")


def _run_turbo(args) -> int:
    """A Turbo LoRA: one .safetensors file, ComfyUI's converted names or LightX2V's, for the preset's DiT."""
    from ..h3_model.checkpoint.turbo import LAYOUTS, TURBO_RANK, make_turbo_lora

    return _run_lora_file(args, LAYOUTS, TURBO_RANK, make_turbo_lora, "comfy|released",
                          "the published Turbo LoRAs are one bf16 .safetensors file")


def _run_lora_file(args, layouts, ranks: dict, make, layout_help: str, why: str) -> int:
    """One LoRA file of the preset's rank written by `make` (PDD's or Turbo's writer); the flags a DiT takes are
    refused."""
    from ..errors import InputError
    from ..h3_model.dit.config import preset

    if args.format != "bf16" or args.layout not in layouts or args.quantize_refiner or args.fasth3 \
            or args.curve_grid is not None or args.curve_rank is not None or args.device != "cpu":
        raise InputError(f"--component {args.component} takes only --preset, --layout {layout_help}, --seed and "
                         f"--force ({why})")
    out = Path(args.out)
    stale = check_output(out, "comfy", args.force)
    start = time.perf_counter()
    rank = ranks[args.preset]
    with replacing(stale):
        size = make(out, preset(args.preset), rank=rank, seed=args.seed, layout=args.layout,
                    progress=_progress_printer())
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(json.dumps({"out": str(out), "component": args.component, "preset": args.preset, "layout": args.layout,
                      "rank": rank, "seed": args.seed, "bytes": size,
                      "seconds": round(time.perf_counter() - start, 3)}))
    return 0


def _run_controlnet(args) -> int:
    """An H3 Fun ControlNet Union file for the preset's DiT (tiny: the demo's), ComfyUI's or Alibaba PAI's layout."""
    from ..errors import InputError
    from ..h3_model.checkpoint.controlnet import random_getter, synthetic_config, write_controlnet
    from ..h3_model.checkpoint.make import CURVE_DEFAULTS
    from ..h3_model.dit.config import preset

    if args.layout not in ("comfy", "released") or args.quantize_refiner or args.fasth3 \
            or args.curve_grid is not None or args.format not in (None, "bf16", "int8_convrot") \
            or (args.layout == "released" and (args.curve_rank is not None or args.format not in (None, "bf16"))):
        raise InputError("--component controlnet takes only --preset, --layout comfy|released, --union2, --seed, "
                         "--device, --force, and for comfy --curve-rank and --format int8_convrot (default, as published) "
                         "or bf16")
    check_device(args.device)
    check_curve(None, args.curve_rank)
    comfy = args.layout == "comfy"
    rank = args.curve_rank if args.curve_rank is not None else CURVE_DEFAULTS[args.preset][1]
    config = synthetic_config(preset(args.preset), union2=args.union2, comfy=comfy, curve_rank=rank)
    out = Path(args.out)
    stale = check_output(out, "comfy", args.force)
    fmt = "bf16" if comfy and args.format == "bf16" else "int8_convrot"
    start = time.perf_counter()
    with replacing(stale):
        size = write_controlnet(out, config, random_getter(config, args.seed, args.device), args.layout, fmt=fmt,
                                progress=_progress_printer())
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(json.dumps({"out": str(out), "component": args.component, "preset": args.preset, "layout": args.layout,
                      "version": config.version, "blocks": config.blocks, "places": list(config.places),
                      "format": fmt if comfy else "bf16", "seed": args.seed, "bytes": size,
                      "seconds": round(time.perf_counter() - start, 3)}))
    return 0


def _fasth3(args, config, curve):
    """A FastH3 checkpoint: the layouts and formats FastVideo's students are published in."""
    from ..errors import InputError
    from ..h3_model.checkpoint.fasth3 import LAYOUTS, make_fasth3_checkpoint

    if args.layout not in LAYOUTS:
        raise InputError(f"--fasth3 writes the {', '.join(LAYOUTS)} layout, not {args.layout}")
    if args.quantize_gates and (args.layout == "diffusers" or args.format == "bf16"):
        raise InputError("--quantize-gates stores the gates in --format: it takes a comfy layout and a quantized "
                         "--format (int8_convrot for the published files)")
    return make_fasth3_checkpoint(args.out, config, layout=args.layout, fmt=args.format, seed=args.seed,
                                  progress=_progress_printer(), device=args.device,
                                  curve=curve if args.layout == "comfy-pruned" else None,
                                  quantize_gates=args.quantize_gates)


def _run_embedding(args) -> int:
    """A prompt embedding (`embedding:NAME`, text/embeddings.py): two random vectors as wide as the preset's text
    encoder (tiny: the demo's, full: Qwen3-VL-32B's 5120), float32 under `emb_params`."""
    from ..errors import InputError
    from ..h3_model.dit.config import preset
    from ..h3_model.engine.demo import DIT_CONFIG
    from ..h3_model.text.embeddings import write_embedding

    if args.format != "bf16" or args.layout != "comfy" or args.device != "cpu" or args.tokenizer_out is not None \
            or args.fasth3 or args.mmproj or args.quantize_refiner or args.curve_grid is not None \
            or args.curve_rank is not None:
        raise InputError("--component embedding takes only --preset (tiny: the demo text encoder's width, full: "
                         "5120), --seed and --force (one float32 .safetensors file)")
    out = Path(args.out)
    if out.exists() and not args.force:
        raise InputError(f"{out} exists; pass --force to replace it")
    width = DIT_CONFIG.text_dim if args.preset == "tiny" else preset("full").text_dim
    path = write_embedding(out, width, seed=args.seed)
    print(json.dumps({"out": str(path), "component": "embedding", "preset": args.preset, "width": width, "rows": 2,
                      "seed": args.seed, "bytes": path.stat().st_size}))
    return 0


def run(args) -> int:
    from ..errors import InputError
    from ..h3_model.checkpoint.make import CURVE_DEFAULTS, make_dit_checkpoint
    from ..h3_model.dit.config import preset

    if args.layout is None:  # a PDD file's published form is Alibaba PAI's, every other component's ComfyUI's
        args.layout = "released" if args.component == "pdd" else "comfy"
    if args.quantize_gates and not args.fasth3:
        raise InputError("--quantize-gates applies to --fasth3 (the VSA gates are a FastH3 model's)")
    if args.union2 and args.component != "controlnet":
        raise InputError("--union2 applies to --component controlnet")
    if args.component == "controlnet":  # its own default format (ComfyUI's file is int8_convrot)
        if args.tokenizer_out is not None or args.mmproj:
            raise InputError("--tokenizer-out and --mmproj apply to --component text_encoder")
        return _run_controlnet(args)
    if args.format is None:
        args.format = "bf16"
    if args.component == "text_encoder":
        return _run_text_encoder(args)
    if args.component == "taeh3":
        return _run_taeh3(args)
    if args.component == "embedding":
        return _run_embedding(args)
    if args.component in ("pdd", "turbo"):
        if args.tokenizer_out is not None:
            raise InputError("--tokenizer-out applies to --component text_encoder")
        return _run_pdd(args) if args.component == "pdd" else _run_turbo(args)
    if args.tokenizer_out is not None:
        raise InputError("--tokenizer-out applies to --component text_encoder")
    if args.mmproj:
        raise InputError("--mmproj applies to --component text_encoder --format gguf:<X>")
    if args.fasth3 and args.component != "dit":
        raise InputError("--fasth3 applies to --component dit")
    if args.component != "dit":
        if args.device != "cpu":
            raise InputError("--device applies to the DiT and the text encoder; VAE checkpoints are drawn on the CPU")
        return _run_vae(args)
    check_device(args.device)
    if args.format not in DIT_FORMATS and not args.format.startswith(GGUF_FORMAT):
        raise InputError(f"--format {args.format} is a text encoder format; the DiT is written as "
                         f"{', '.join(DIT_FORMATS)}, {GGUF_FORMAT}<TYPE>")

    if args.layout != "comfy-pruned" and (args.curve_grid is not None or args.curve_rank is not None):
        raise InputError("--curve-grid/--curve-rank only apply to --layout comfy-pruned")
    check_curve(args.curve_grid, args.curve_rank)
    grid, rank = CURVE_DEFAULTS[args.preset]
    curve = (grid if args.curve_grid is None else args.curve_grid, rank if args.curve_rank is None else args.curve_rank)
    stale = check_output(Path(args.out), args.layout, args.force)
    start = time.perf_counter()
    with replacing(stale):
        if args.fasth3:
            made = _fasth3(args, preset(args.preset), curve)
        else:
            made = make_dit_checkpoint(args.out, preset(args.preset), args.format, args.layout, seed=args.seed,
                                       quantize_refiner=args.quantize_refiner, curve=curve,
                                       progress=_progress_printer(), device=args.device)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    summary = {"out": str(made.path), "component": args.component, "preset": args.preset, "format": args.format,
               "layout": args.layout, "seed": args.seed, "device": args.device, "bytes": made.bytes,
               "seconds": round(time.perf_counter() - start, 3), "fasth3": args.fasth3}
    if made.curve_residual is not None:
        summary["curve_table"] = [made.config.adaln_curve_grid, made.config.time_embed_dim]
        summary["curve_fit_residual"] = made.curve_residual
    print(json.dumps(summary))
    return 0
