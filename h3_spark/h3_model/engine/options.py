"""The engine's flags, each declared once, in the groups a front door adds (`h3-spark generate`, `serve`, `bench`,
`calibrate`, `trace-dit`, `fleet`), and the parsed flags turned into `LoadOptions` and the request settings, with
the rules that span flags (a VRAM budget and --gpus) written once. The checks of single values are flags.py's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODELS_HELP = ("a model folder: today's official download (FL2VA/ and/or Ref2VA/, or one of them), or the older "
               "layout (transformer/, transformer_ref/, text_encoder/, vae/, audio_vae/)")
# The flags naming model files (as argparse dests), in ComponentPaths' order.
MODEL_FLAGS = ("models", "dit", "dit_ref", "text_encoder", "tokenizer", "vae", "audio_vae")
DTYPES = ("bfloat16", "float32")
VAE_DTYPES = ("float16", "float32")
RELEASED_TEXT_LAYER = 50  # the Qwen3-VL hidden state the released DiT reads
ATTENTION_HELP = "attention backend (default: $H3_ATTENTION or auto)"
LINEAR_HELP = "block linear format: auto, bf16, fp8, nvfp4, w4a8 (default: $H3_LINEAR or auto)"
DTYPE_HELP = "DiT/text dtype"
GPUS_HELP = ("split each DiT forward over N GPUs (Ulysses sequence parallel, via torchrun; N must divide the 56 "
             "heads: 2, 4, 7 or 8)")


# ---------------------------------------------------------------------------------------------- the groups
def add_model_flags(parser, text_layer_help: str = f"Qwen3-VL hidden state the DiT reads (released model: "
                                                   f"{RELEASED_TEXT_LAYER})"):
    """--models (or each component), --text-encoder-layer, --qkv-layout; returns the group (a door adds its own)."""
    models = parser.add_argument_group("models (a released-layout folder, or each component)")
    models.add_argument("--models", "--models-dir", dest="models", type=Path, help=MODELS_HELP)
    for flag in ("dit", "dit-ref", "text-encoder", "tokenizer", "vae", "audio-vae"):
        models.add_argument(f"--{flag}", type=Path)
    models.add_argument("--text-encoder-layer", type=int, default=None, help=text_layer_help)
    models.add_argument("--text-encoder-vision", type=Path, default=None, metavar="MMPROJ",
                        help="a llama.cpp text encoder GGUF's vision file (mmproj*.gguf), for FL2VA keyframes and "
                             "Ref2VA images; default: the one mmproj*.gguf of that model beside the text GGUF, if any (the summary's "
                             "load_notes says which)")
    models.add_argument("--qkv-layout", choices=["auto", "stacked", "interleaved"], default="auto",
                        help="fused qkv order of original-named DiT files: auto (interleaved for MiniMaxAI's own "
                             "transformer/ folders, stacked for single files), stacked (Comfy-Org) or interleaved")
    return models


def add_dtype_flag(parser, default: str | None = None, help: str | None = None) -> None:
    """--dtype; `default` None means by device (bfloat16 on CUDA, float32 on the CPU)."""
    parser.add_argument("--dtype", choices=list(DTYPES), default=default,
                        help=help or (f"{DTYPE_HELP} (cuda: bfloat16)" if default is None
                                      else f"{DTYPE_HELP} (default {default})"))


def add_kernel_flags(parser, attention_note: str = "", linear_note: str = "") -> None:
    """--attention and --linear (checked by kernels.settings.kernel_settings, naming the flag); a door's note
    says what its own use adds (the service: per job, fixed at load)."""
    parser.add_argument("--attention", default=None, help=ATTENTION_HELP + attention_note)
    parser.add_argument("--linear", default=None, help=LINEAR_HELP + linear_note)


def add_precision_flags(parser) -> None:
    """Device, dtypes, the VAE decode tile and the SwiGLU chunks of a door that generates."""
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when present, else cpu)")
    add_dtype_flag(parser)
    parser.add_argument("--vae-dtype", choices=list(VAE_DTYPES), default=None,
                        help="video VAE decode dtype (default: $H3_VAE_DTYPE, else float16 on CUDA and float32 on "
                             "the CPU)")
    parser.add_argument("--vae-tile-size", type=int, default=None,
                        help="video VAE decode tile in pixels (default: $H3_VAE_TILE_SIZE or 256; 0 = untiled)")
    parser.add_argument("--mlp-chunks", type=int, default=1,
                        help="run the SwiGLU in N row chunks (exact; less memory)")


def add_budget_flags(parser) -> None:
    parser.add_argument("--vram-budget", default=None, metavar="GB",
                        help="GPU memory the models may hold, activations included (default: $H3_VRAM_BUDGET, "
                             "else auto: resident when the files fit the free GPU memory, streaming when they do "
                             "not). DiT blocks and text-encoder layers that do not fit stream from pinned host "
                             "memory, prefetched on a side stream (bit-identical forwards); the VAEs visit the GPU "
                             "for their stages. auto, 24, 24GB, 22.5GiB (docs/vram-budget.md)")
    parser.add_argument("--prefetch-depth", type=int, default=2,
                        help="streamed blocks copied ahead of use under --vram-budget (GPU slots; default 2)")
    parser.add_argument("--host-budget", default=None, metavar="GB",
                        help="host memory the models may hold under --vram-budget (streamed DiT blocks, the text "
                             "encoder outside its layers, parked VAEs; default: $H3_HOST_BUDGET, else unchecked): a "
                             "plan that needs more is refused before anything is packed, naming the minimum. "
                             "24, 24GB, 22.5GiB")


def add_node_flags(parser) -> None:
    """--nnodes / --node-rank / --rdzv-endpoint: sequence parallelism across hosts (torchrun's rendezvous)."""
    parser.add_argument("--nnodes", type=int, default=1,
                        help="hosts taking part, each running this same command with its own --node-rank; the ranks "
                             "are --gpus per host x --nnodes")
    parser.add_argument("--node-rank", type=int, default=0, help="this host's place, 0..nnodes-1 (0 serves/writes)")
    parser.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                        help="node 0's address and a free port every node reaches (needed with --nnodes > 1)")


def add_parallel_flags(parser, gpus_note: str = "") -> None:
    """--gpus and the node flags."""
    parser.add_argument("--gpus", type=int, default=1, help=GPUS_HELP + gpus_note)
    add_node_flags(parser)


# ---------------------------------------------------------------------------------------------- flags -> options
def world_size(args) -> int:
    """The ranks asked for (--gpus x --nnodes), after checking --gpus and the node flags."""
    from ...errors import InputError
    from .flags import check_nodes

    if args.gpus < 1:
        raise InputError(f"--gpus must be at least 1, got {args.gpus}")
    return check_nodes(args)


def placement_budget(args, world: int) -> int | str | None:
    """The VRAM budget (bytes, "auto" or None) for `world` ranks: streaming is one GPU's, so under --gpus an
    explicit budget is refused and auto means resident."""
    from ...errors import InputError
    from .flags import vram_budget

    budget = vram_budget(args.vram_budget)
    if world > 1:
        if budget not in (None, "auto"):
            raise InputError("--vram-budget streams blocks on one GPU; it does not combine with --gpus yet")
        return None
    return budget


def check_placement(args) -> int:
    """The world size, after every placement flag is checked (--gpus, the nodes, the budgets, --device): a door
    calls it before it relaunches itself under torchrun, so a bad flag stops it once, not on every rank."""
    from .flags import check_depth, check_device

    world = world_size(args)
    placement_budget(args, world)
    check_depth(args.prefetch_depth)
    if args.device is not None:
        check_device(args.device)
    return world


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class RequestSettings:
    """What the flags set on every request: the VAE decode tile (None: untiled) and the SwiGLU chunks."""
    vae_tile_size: int | None
    mlp_chunks: int


def load_options(args, device: str, world: int = 1, loras: list | None = None):
    """(LoadOptions, RequestSettings) from the parsed flags, checked, for this rank's `device` out of `world`."""
    import torch

    from ...kernels.settings import kernel_settings, vae_tile_batch
    from .flags import check_depth, host_budget, read_threads, text_pin
    from .loading import LoadOptions
    from .vae_flags import vae_options

    cuda = device.startswith("cuda")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    vae_dtype, tile = vae_options(args.vae_dtype, args.vae_tile_size, "float16" if cuda else "float32")
    settings = kernel_settings(args.attention, args.linear)  # a bad flag is named as the flag, not H3_*
    text_layer = RELEASED_TEXT_LAYER if args.text_encoder_layer is None else args.text_encoder_layer
    options = LoadOptions(device=device, dtype=dtype, vae_dtype=getattr(torch, vae_dtype), loras=list(loras or ()),
                          qkv_layout=args.qkv_layout, text_layer=text_layer, kernels=settings,
                          text_vision=getattr(args, "text_encoder_vision", None),
                          vae_tile_batch=vae_tile_batch(), vram_budget=placement_budget(args, world),
                          prefetch_depth=check_depth(args.prefetch_depth), host_budget=host_budget(args.host_budget),
                          text_pin=text_pin(), read_threads=read_threads())
    return options, RequestSettings(vae_tile_size=tile or None, mlp_chunks=args.mlp_chunks)


def component_paths(args):
    from .paths import ComponentPaths

    return ComponentPaths(*(getattr(args, name) for name in MODEL_FLAGS))


def given_model_flags(args) -> list[str]:
    """The model flags given, as typed (--dit-ref); a door that builds its own models refuses them."""
    return [f"--{name.replace('_', '-')}" for name in MODEL_FLAGS if getattr(args, name) is not None]
