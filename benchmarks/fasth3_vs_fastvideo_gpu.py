"""A FastH3 forward, ours against FastVideo's, on the same synthetic weights and inputs in one process; JSON to --out.

Usage (GPU machine, repository root), with the wheels FastVideo's DiT module needs beyond the CUDA image
(fastvideo 0.2.1, diffusers 0.42.1: fastvideo/utils.py imports diffusers.loaders, remote-pdb 2.1.0; the image
already holds torch, torchvision, triton, einops, cloudpickle, imageio, pillow, pyyaml, huggingface-hub,
requests) and fa3-fwd for H3_ATTENTION=fa3, each installed with --no-deps:
    python3 -m pip install -q --no-deps --target /tmp/site fastvideo-0.2.1-py3-none-any.whl \
        diffusers-0.42.1-py3-none-any.whl remote_pdb-2.1.0-py2.py3-none-any.whl fa3_fwd-0.0.3-*.whl
    PYTHONPATH=/tmp/site H3_ATTENTION=fa3 python3 benchmarks/fasth3_vs_fastvideo_gpu.py \
        --out $OUT/fasth3_vs_fastvideo.json [--contracts t2va-960x544-124f,t2va-1344x768-124f] [--sparsity 0.9]
(FASTVIDEO_MINIMAX_H3_FUSIONS=all runs FastVideo's Triton fusions, its fastest eager profile; its regional
torch.compile belongs to its loader and is not run here.) The CPU check of the weight and input mappings
(tiny model, seconds; tests/test_fasth3_vs_fastvideo.py runs it where fastvideo imports):
    PYTHONPATH=/tmp/site python3 benchmarks/fasth3_vs_fastvideo_gpu.py --preset tiny --device cpu --out tiny.json

One synthetic FastH3 DiT (measure/synthetic.synthetic_dit of checkpoint/fasth3.fasth3_config: random weights,
the VSA gates non-zero) is built on the device; FastVideo's MiniMaxH3Transformer3DModel is built on the meta
device and handed the very same parameter tensors (no second copy: 68 GB of bf16 weights fit once), named by
FastVideo's own diffusers-to-FastVideo rules (MiniMaxH3ArchConfig.param_names_mapping). Per contract, on the
inputs measure/runner.make_inputs makes (mid-schedule step), each engine runs:
- vsa: its VSA at --sparsity with 64-row tiles, FastVideo's default "exempt" mode (text and audio rows attend
  densely and are always attended to), the gated coarse branch on; ours bound as the sampler binds it
  (engine/recipes.py fasth3_schedule(...).for_layout), theirs through its metadata builder and forward context
  as its MiniMax-H3 denoising stage does;
- vsa_dense: the same at sparsity 0 (every tile kept: dense fine attention plus the gated coarse branch);
- dense: each engine's dense attention without the gate branch (ours: the model's attention, H3_ATTENTION;
  theirs: a second FastVideo module on the same tensors, its automatic backend choice).
Reported: median seconds (one warm-up, --repeats CUDA-timed calls), velocity rel L2 ours vs theirs per run (video
and audio rows together and apart), each engine's sparse run against its own dense VSA, and the attention
kernels each used. The noise floor is ours vs theirs at sparsity 0 and in the dense run: two implementations of
one function in bf16. Ours in fp32 is run as a third floor only where both models fit (the tiny preset; the
full model's fp32 weights alone are 137 GB). Timing is each engine as its sampler calls it: ours with the
refined text and the step's AdaLN tables computed once, theirs with its text cache (per prompt tensor) warm.

FastVideo's package __init__ imports its whole pipeline API (VideoGenerator and every model family's
dependencies); the DiT module needs none of it, so the package is registered without running __init__ and its
submodules import as usual. fastvideo-kernel 0.3.5 is published as a CUDA source build only; the fastvideo
wheel ships its Python package (Triton kernels) under fastvideo-kernel/python, which is put on the path when
no fastvideo_kernel is installed.

--device cpu: FastVideo's CPU platform names no attention backend (platforms/cpu.py has no
get_attn_backend_cls: building any of its DiTs raises "Invalid attention backend for CPU"), and its VSA fine
attention is a CUDA-only kernel. For the CPU check only, the platform answers with FastVideo's own SDPA and
MiniMax-H3 VSA backend classes, and the fine attention is a masked PyTorch attention over the same tile buffer
and block mask (FastVideo's tiling, pooling, top-k selection, gate branch and untiling all run as shipped).
The JSON says so. Random weights do not make H3's attention maps: speed and error at sparsity 0.9 will differ
on the released weights.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import socket
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import import_package  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("vsa", "vsa_dense", "dense")
# The tiny preset's request: 2 x 2 x 2 video tiles of 64 patches, so that sparsity 0.9 keeps one of eight.
TINY_SHAPE = {"text_tokens": 70, "latent_frames": 8, "latent_height": 16, "latent_width": 16, "audio_latents": 9,
              "steps": 4}


class Unrunnable(Exception):
    """This comparison cannot run here; the message is the one-line reason."""


# ------------------------------------------------------------------------------------------ FastVideo's modules
def fastvideo_root() -> Path:
    """Where the installed fastvideo package lies, found without importing it."""
    spec = importlib.util.find_spec("fastvideo")
    if spec is None or not spec.submodule_search_locations:
        raise Unrunnable("fastvideo is not importable: install fastvideo==0.2.1 with --no-deps into a folder on "
                         "PYTHONPATH (e.g. pip install --no-deps --target /tmp/site fastvideo-0.2.1-py3-none-any.whl)")
    return Path(list(spec.submodule_search_locations)[0])


def register_package(root: Path) -> None:
    """`fastvideo` as a package whose submodules import normally, without its __init__ (see the docstring)."""
    if "fastvideo" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location("fastvideo", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    sys.modules["fastvideo"] = importlib.util.module_from_spec(spec)


def kernel_package_path(root: Path) -> str | None:
    """The fastvideo_kernel the wheel ships as Python sources, when none is installed; None when one is."""
    if importlib.util.find_spec("fastvideo_kernel") is not None:
        return None
    shipped = root.parent / "fastvideo-kernel" / "python"
    if not (shipped / "fastvideo_kernel" / "__init__.py").is_file():
        raise Unrunnable(f"fastvideo_kernel is neither installed nor at {shipped} (the fastvideo 0.2.1 wheel ships "
                         f"it there): FastVideo's VSA has no kernel")
    sys.path.append(str(shipped))
    return str(shipped)


def fv_import(name: str):
    try:
        return importlib.import_module(name)
    # A missing wheel raises ImportError; a kernel module that cannot start here (Triton without a driver) others.
    except Exception as exc:  # noqa: BLE001
        detail = (str(exc).splitlines() or [""])[0]
        raise Unrunnable(f"FastVideo's {name} does not import ({type(exc).__name__}: {detail}); install the "
                         f"wheels this script's docstring lists") from None


def cpu_platform(fv) -> object:
    """FastVideo's CPU platform answering with its own SDPA and MiniMax-H3 VSA backend classes (CPU check only)."""
    enum = fv["platforms"].AttentionBackendEnum
    names = {None: "fastvideo.attention.backends.sdpa.SDPABackend",
             enum.TORCH_SDPA: "fastvideo.attention.backends.sdpa.SDPABackend",
             enum.VIDEO_SPARSE_ATTN_H3: "fastvideo.attention.backends.video_sparse_attn_h3.MiniMaxH3VSABackend"}
    base = fv_import("fastvideo.platforms.cpu").CpuPlatform

    class CpuWithBackends(base):
        @classmethod
        def get_attn_backend_cls(cls, selected_backend, head_size, dtype) -> str:
            if selected_backend not in names:
                raise Unrunnable(f"the CPU check maps FastVideo attention backends {sorted(map(str, names))}, "
                                 f"not {selected_backend}")
            return names[selected_backend]

    return CpuWithBackends()


def masked_tile_attention(q, k, v, block_map, variable_block_sizes):
    """The fine step FastVideo's block-sparse kernel computes, as masked PyTorch attention (CPU check only):
    q, k, v (B, H, n x 64, D) in tile order, block_map (B, H, n, n) bool, each tile's real rows; fp32 math."""
    import torch

    n = variable_block_sizes.numel()
    tile = q.shape[2] // n
    within = torch.arange(tile, device=q.device)
    key_real = (within[None, :] < variable_block_sizes[:, None]).reshape(-1)  # (n x tile,)
    tile_of = torch.arange(n, device=q.device).repeat_interleave(tile)
    allowed = block_map[:, :, tile_of][..., tile_of] & key_real  # (B, H, rows, rows)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) / q.shape[-1] ** 0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bhqd", probs, v.float()).to(q.dtype), None


def load_fastvideo(device: str) -> dict:
    root = fastvideo_root()
    register_package(root)
    # On the CPU the kernel package is left out: its Triton modules ask for a GPU driver as they import.
    shipped_kernels = kernel_package_path(root) if device != "cpu" else None
    fv = {"root": root, "shipped_kernels": shipped_kernels, "platforms": fv_import("fastvideo.platforms")}
    if device == "cpu":
        fv["platforms"]._current_platform = cpu_platform(fv)
    for key, name in (("dit", "fastvideo.models.dits.minimax_h3"),
                      ("config", "fastvideo.configs.models.dits.minimax_h3"),
                      ("forward_context", "fastvideo.forward_context"), ("selector", "fastvideo.attention.selector"),
                      ("parallel", "fastvideo.distributed.parallel_state"),
                      ("vsa", "fastvideo.attention.backends.video_sparse_attn_h3")):
        fv[key] = fv_import(name)
    if device == "cpu":
        fv["vsa"].block_sparse_attn_64_bhsd = masked_tile_attention
    elif fv["vsa"].block_sparse_attn_64_bhsd is None:
        raise Unrunnable("fastvideo_kernel.block_sparse_attn does not import here (FastVideo's VSA-H3 tile-64 "
                         "kernel); it needs Triton and the fastvideo_kernel package")
    return fv


def init_single_process(fv) -> None:
    """FastVideo's layers ask its sequence-parallel group for their rank: one process, one rank, on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fv["parallel"].maybe_init_distributed_environment_and_model_parallel(
        1, 1, distributed_init_method=f"tcp://127.0.0.1:{port}")


# ------------------------------------------------------------------------------------------ weights
def fastvideo_name(name: str, rules: dict) -> str:
    """FastVideo's name for a diffusers parameter name, by its own loader's rules (the first that matches)."""
    import re

    for pattern, replacement in rules.items():
        if re.match(pattern, name):
            return re.sub(pattern, replacement, name)
    return name


def fastvideo_twin(fv, ours, backend, device: str):
    """FastVideo's H3 DiT of our config, built on the meta device under `backend` (None: its automatic choice),
    holding our parameter tensors."""
    import torch

    c = ours.config
    arch_fields = {k: getattr(c, k) for k in (
        "num_attention_heads", "attention_head_dim", "hidden_size", "num_layers", "num_refiner_layers", "ffn_dim",
        "in_channels", "audio_in_channels", "patch_size", "text_dim", "freq_dim", "time_embed_hidden_dim",
        "time_embed_dim", "rope_freq_dim", "rope_theta", "norm_eps", "qk_norm_eps", "final_norm_eps")}
    cfg = fv["config"].MiniMaxH3Config(arch_config=fv["config"].MiniMaxH3ArchConfig(**arch_fields))
    scope = fv["selector"]._component_attention_backend_scope
    with torch.device("meta"), scope(backend, "transformer"):
        twin = fv["dit"].MiniMaxH3Transformer3DModel(cfg, hf_config={})
    rules = cfg.arch_config.param_names_mapping
    theirs = dict(twin.named_parameters())
    mapped = {fastvideo_name(n, rules): p for n, p in ours.named_parameters()}
    if backend is None:  # without VSA FastVideo builds no gates; the dense run leaves ours unused too
        mapped = {n: p for n, p in mapped.items() if not n.endswith("attn.to_gate_compress.weight")}
    if set(mapped) != set(theirs):
        raise Unrunnable(f"parameter names differ after FastVideo's mapping: only ours "
                         f"{sorted(set(mapped) - set(theirs))[:3]}, "
                         f"only theirs {sorted(set(theirs) - set(mapped))[:3]}")
    for name, param in mapped.items():
        if tuple(param.shape) != tuple(theirs[name].shape):
            raise Unrunnable(f"{name}: our shape {tuple(param.shape)}, FastVideo's {tuple(theirs[name].shape)}")
        owner, _, attr = name.rpartition(".")
        setattr(twin.get_submodule(owner), attr, param)
    twin.materialize_non_persistent_buffers(torch.device(device))
    left = [n for n, t in [*twin.named_parameters(), *twin.named_buffers()] if t.is_meta]
    if left:
        raise Unrunnable(f"FastVideo's DiT kept meta tensors after the mapping: {left[:3]}")
    return twin.eval()


def attention_kernels(fv, twin) -> dict:
    """Which attention FastVideo's blocks and text refiner resolved to, and the VSA fine kernel it calls."""
    block = twin.transformer_blocks[0].attn.distributed_attention.attn_impl
    out = {"blocks": type(block).__name__,
           "refiner": type(twin.token_refiner.refiner_blocks[0].attn.distributed_attention.attn_impl).__name__}
    if type(block).__name__ == "MiniMaxH3VSAImpl":
        fine = fv["vsa"].block_sparse_attn_64_bhsd
        if fine is masked_tile_attention:
            out["vsa_fine"] = "CPU check: masked PyTorch attention in place of fastvideo_kernel's CUDA kernel"
        else:
            bsa = sys.modules.get(fine.__module__)
            sm90 = None not in bsa._get_sm90_ops() and bsa._is_sm90()
            out["vsa_fine"] = ("fastvideo_kernel sm90 (ThunderKittens, compiled _C)" if sm90 and not bsa._force_triton()
                               else "fastvideo_kernel Triton block_sparse_attn_triton (no compiled _C for this GPU)")
            out["vsa_sm100a_requested"] = os.environ.get("FASTVIDEO_VSA_SM100A", "0") == "1"
        out["gate_branch_active"] = bool(twin.transformer_blocks[0].attn.to_gate_compress is not None)
    out["h3_fusions"] = sorted(twin.enabled_fusions)
    return out


# ------------------------------------------------------------------------------------------ requests
def tiny_shape(config):
    import torch

    from h3_spark.h3_model.dit.config import TEXT_TAG
    from h3_spark.h3_model.dit.layout import build_t2va
    from h3_spark.measure.contract import BenchShape

    s = TINY_SHAPE
    lay = build_t2va(torch.full((s["text_tokens"],), TEXT_TAG, dtype=torch.long), s["latent_frames"],
                     s["latent_height"], s["latent_width"], s["audio_latents"], config.patch_size)
    return BenchShape(lay, s["latent_frames"], s["latent_height"], s["latent_width"], s["audio_latents"], [])


def requests(args, config) -> list[tuple[str, object, int, int]]:
    """(name, BenchShape, seed, steps) per request of the run."""
    from h3_spark.measure.contract import contract_shape, load_contract

    if args.preset == "tiny":
        return [("tiny-t2va", tiny_shape(config), 0, TINY_SHAPE["steps"])]
    out = []
    for name in args.contracts.split(","):
        contract = load_contract(ROOT / "benchmarks" / f"{name}.json")
        if contract["mode"] != "t2va":
            raise Unrunnable(f"{name}: this comparison takes t2va contracts (FastVideo's VSA prefix is text | "
                             f"keyframes | audio)")
        out.append((name, contract_shape(contract, config), contract["seed"], contract["steps"]))
    return out


def prefix_segments(lay) -> tuple[int, ...]:
    """FastVideo's VSA prefix (its denoising stage's text, condition-video and audio row counts), checked against
    the runs our tiling cuts (dit/layout.segments_before_video)."""
    from h3_spark.h3_model.dit.layout import segments_before_video

    theirs = (int(lay.text_indices.numel()), int(lay.num_condition_video_rows), int(lay.audio_indices.numel()))
    if tuple(s for s in theirs if s) != segments_before_video(lay):
        raise Unrunnable(f"FastVideo's VSA prefix {theirs} is not our tiling's {segments_before_video(lay)}")
    return theirs


# ------------------------------------------------------------------------------------------ runs
def rel_l2_pair(a, b) -> dict:
    import torch

    from h3_spark.measure.runner import rel_l2

    return {"all": rel_l2(torch.cat([a[0].flatten(), a[1].flatten()]), torch.cat([b[0].flatten(), b[1].flatten()])),
            "video": rel_l2(a[0], b[0]), "audio": rel_l2(a[1], b[1])}


def timed(fn, device: str, repeats: int) -> tuple[list[float], float | None]:
    """Seconds of `repeats` warm calls and the peak GPU memory over them (GB; None on the CPU)."""
    import torch

    from h3_spark.measure.runner import time_call

    if not device.startswith("cuda"):
        return time_call(fn, device, 0, repeats), None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = time_call(fn, device, 0, repeats)
    return times, torch.cuda.max_memory_allocated() / 1e9


def our_schedule(model, sparsity: float, tile: int, device: str, settings, shape):
    from h3_spark.h3_model.engine.recipes import fasth3_schedule, parse_recipes

    recipe, = parse_recipes([f"fasth3:sparsity={sparsity},tile={tile}"])
    return fasth3_schedule(recipe, model, device, settings).for_layout(
        shape.layout, (shape.latent_frames, shape.latent_height, shape.latent_width))


def run_request(args, fv, ours, twins, shape, seed, steps, settings, ours32) -> dict:
    import torch

    from h3_spark.h3_model.pipeline.scheduler import JointSchedule
    from h3_spark.measure.runner import make_inputs

    device, lay = args.device, shape.layout
    schedule = JointSchedule.create(steps)
    step = len(schedule) // 2
    inputs = make_inputs(shape, ours.config, device, seed, step, schedule)
    segments = prefix_segments(lay)
    builder = fv["vsa"].MiniMaxH3VSAMetadataBuilder()
    set_context = fv["forward_context"].set_forward_context
    latent = (shape.latent_frames, shape.latent_height, shape.latent_width)

    def metadata(sparsity):
        return builder.build(current_timestep=step, raw_latent_shape=latent, patch_size=ours.config.patch_size,
                             VSA_sparsity=sparsity, prefix_segments=segments, device=torch.device(device),
                             exempt=True, tile_size=args.tile)

    def theirs_call(twin, meta):
        def call():
            with set_context(current_timestep=step, attn_metadata=meta):
                return twin(**inputs)
        return call

    def ours_call(model, schedule_attn):
        text = model.encode_text(inputs["encoder_hidden_states"])
        kwargs = {**inputs, "encoder_hidden_states": None, "text_embeds": text}

        def call():
            model.attention_schedule, model.sampling_step = schedule_attn, step
            try:
                return model(**kwargs)
            finally:
                model.attention_schedule, model.sampling_step = None, None
        return call

    sparse = our_schedule(ours, args.sparsity, args.tile, device, settings, shape)
    calls = {
        "vsa": (ours_call(ours, sparse), theirs_call(twins["vsa"], metadata(args.sparsity))),
        "vsa_dense": (ours_call(ours, our_schedule(ours, 0.0, args.tile, device, settings, shape)),
                      theirs_call(twins["vsa"], metadata(0.0))),
        "dense": (ours_call(ours, None), theirs_call(twins["dense"], None)),
    }
    out: dict = {"sequence_length": lay.sequence_length, "evaluation": step, "prefix_segments": list(segments),
                 "video_tiles": int(fv["vsa"]._h3_tile_geometry(tuple(s for s in segments if s), (
                     latent[0] // ours.config.patch_size[0], latent[1] // ours.config.patch_size[1],
                     latent[2] // ours.config.patch_size[2]), torch.device(device),
                     fv["vsa"].VSA_H3_TILE_SHAPES[args.tile])[4]),
                 "runs": {}}
    velocities = {}
    with torch.inference_mode():
        ours.clear_modulation_cache()
        ours.precompute_modulation(inputs["timestep"].tolist())  # this step's tables, as the sampler's loop has them
        for run in RUNS:
            ours_fn, theirs_fn = calls[run]
            ours_v, theirs_v = ours_fn(), theirs_fn()  # the warm-up calls, whose velocities are compared
            ours_t, ours_peak = timed(ours_fn, device, args.repeats)
            theirs_t, theirs_peak = timed(theirs_fn, device, args.repeats)
            velocities[run] = (ours_v, theirs_v)
            entry = {"ours_s_median": statistics.median(ours_t), "ours_s_all": ours_t,
                     "fastvideo_s_median": statistics.median(theirs_t), "fastvideo_s_all": theirs_t,
                     "ours_peak_gpu_memory_gb": ours_peak, "fastvideo_peak_gpu_memory_gb": theirs_peak,
                     "speedup_vs_fastvideo": statistics.median(theirs_t) / statistics.median(ours_t),
                     "velocity_rel_l2_ours_vs_fastvideo": rel_l2_pair(ours_v, theirs_v)}
            out["runs"][run] = entry
            print(json.dumps({"run": run, "S": lay.sequence_length, "ours_s": round(entry["ours_s_median"], 4),
                              "fastvideo_s": round(entry["fastvideo_s_median"], 4),
                              "speedup": round(entry["speedup_vs_fastvideo"], 3),
                              "rel_l2": float(f'{entry["velocity_rel_l2_ours_vs_fastvideo"]["all"]:.3g}')}),
                  flush=True)
        if ours32 is not None:
            ours32.clear_modulation_cache()
            ours32.precompute_modulation(inputs["timestep"].tolist())
            v32 = ours_call(ours32, our_schedule(ours32, 0.0, args.tile, device, settings, shape))()
            out["fp32_floor"] = {"ours_bf16_vs_ours_fp32": rel_l2_pair(velocities["vsa_dense"][0], v32),
                                 "fastvideo_bf16_vs_ours_fp32": rel_l2_pair(velocities["vsa_dense"][1], v32)}
    out["ours_vsa"] = sparse.attention.describe()
    floors = [out["runs"][r]["velocity_rel_l2_ours_vs_fastvideo"]["all"] for r in ("vsa_dense", "dense")]
    out["noise_floor_rel_l2"] = max(floors)
    vsa = out["runs"]["vsa"]["velocity_rel_l2_ours_vs_fastvideo"]["all"]
    # None where the floor is exactly 0 (bit-equal dense runs): the sparse run's own value then says it all.
    out["vsa_rel_l2_ratio_to_floor"] = vsa / out["noise_floor_rel_l2"] if out["noise_floor_rel_l2"] else None
    (ours_s, theirs_s), (ours_d, theirs_d) = velocities["vsa"], velocities["vsa_dense"]
    out["sparsity_effect"] = {"ours_vsa_vs_ours_vsa_dense": rel_l2_pair(ours_s, ours_d),
                              "fastvideo_vsa_vs_fastvideo_vsa_dense": rel_l2_pair(theirs_s, theirs_d)}
    return out


# ------------------------------------------------------------------------------------------ main
def build_ours(args, dtype):
    from h3_spark.h3_model.checkpoint.fasth3 import fasth3_config
    from h3_spark.h3_model.dit.config import preset
    from h3_spark.measure.synthetic import synthetic_dit

    model = synthetic_dit(fasth3_config(preset(args.preset)), dtype, args.device, seed=args.seed)
    gates = [blk.attn.to_gate_compress.weight for blk in model.transformer_blocks]
    if not all(bool(g.any()) for g in gates):
        raise Unrunnable("a synthetic FastH3 gate is all zero: the gate branch would not be compared")
    del gates
    return model


def fp32_copy(model, device: str):
    """Ours in fp32 on the bf16 model's very weights (upcast): the floor compares one function at two precisions."""
    import torch

    from h3_spark.h3_model.dit.model import H3DiT

    copy = H3DiT(model.config, dtype=torch.float32, device="meta")
    copy.load_state(((n, p.float()) for n, p in model.named_parameters()), device=device)
    return copy.eval()


def fp32_fits(args, model) -> tuple[bool, str]:
    """Whether ours in fp32 fits beside both bf16-sharing models (the floor's third engine)."""
    import torch

    params = sum(p.numel() for p in model.parameters())
    if args.device == "cpu":
        return True, "tiny preset on the CPU"
    free = torch.cuda.mem_get_info()[0]
    need = params * 4
    if need < 0.7 * free:
        return True, f"fp32 weights {need / 1e9:.1f} GB of {free / 1e9:.1f} GB free"
    return False, f"not run: fp32 weights {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free beside the bf16 model"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--preset", choices=("full", "tiny"), default="full")
    p.add_argument("--device", default="cuda", help="cuda (the receipt) or cpu (the tiny mapping check)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="the models' dtype (default: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--contracts", default="t2va-960x544-124f,t2va-1344x768-124f")
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--tile", type=int, choices=(64,), default=64, help="rows per VSA tile (FastH3's 64)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    args = p.parse_args(argv)
    try:
        return run(args)
    except Unrunnable as exc:
        print(f"fasth3_vs_fastvideo: cannot run: {exc}", file=sys.stderr)
        return 2


def run(args) -> int:
    import_package()
    import torch

    from h3_spark.h3_model.engine.kernel_plan import apply_kernels
    from h3_spark.kernels.settings import KernelSettings
    from h3_spark.measure import stamp
    from h3_spark.measure.synthetic import describe

    if not 0.0 <= args.sparsity < 1.0:
        raise Unrunnable(f"--sparsity must lie in [0, 1), got {args.sparsity}")
    if args.repeats < 1:
        raise Unrunnable(f"--repeats must be at least 1, got {args.repeats}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise Unrunnable("--device cuda: no CUDA device here (the CPU check is --preset tiny --device cpu)")
    if args.device == "cpu" and args.preset != "tiny":
        raise Unrunnable("--device cpu runs the tiny preset only (the full model is 68 GB and its VSA needs CUDA)")
    if args.device not in ("cpu",) and not args.device.startswith("cuda"):
        raise Unrunnable(f"--device must be cuda or cpu, got {args.device!r}")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("fp32" if args.device == "cpu" else "bf16")]

    record = stamp.stamp_before()
    fv = load_fastvideo(args.device)
    init_single_process(fv)
    ours = build_ours(args, dtype)
    enum = fv["platforms"].AttentionBackendEnum
    # Built before our kernels are applied and checked after: both engines must keep reading one set of tensors.
    twins = {"vsa": fastvideo_twin(fv, ours, enum.VIDEO_SPARSE_ATTN_H3, args.device),
             "dense": fastvideo_twin(fv, ours, None, args.device)}
    shared = {id(p) for p in twins["vsa"].parameters()}
    settings = KernelSettings.from_env()
    report = apply_kernels(ours, settings)
    if not {id(p) for p in ours.parameters()} >= shared:
        raise Unrunnable("our kernels replaced weights the FastVideo module shares (H3_LINEAR other than bf16?): "
                         "this comparison runs both engines on one copy of the bf16 weights")
    ours32, fp32_note = None, "fp32 floor: ours at dtype fp32 already"
    if dtype != torch.float32:
        fits, fp32_note = fp32_fits(args, ours)
        if fits:
            ours32 = fp32_copy(ours, args.device)
            apply_kernels(ours32, settings)

    result = {"benchmark": "fasth3_vs_fastvideo", "preset": args.preset, "device": args.device,
              "dtype": str(dtype).removeprefix("torch."), "sparsity": args.sparsity, "tile": args.tile,
              "vsa_mode": "exempt", "weights": describe(args.preset) + " (FastH3: VSA gates random, non-zero)",
              "ours": {"backends": report}, "fastvideo": {
                  "package": str(fv["root"]), "fastvideo_kernel_from_wheel": fv["shipped_kernels"],
                  "version": stamp._version("fastvideo"),
                  "vsa": attention_kernels(fv, twins["vsa"]), "dense": attention_kernels(fv, twins["dense"]),
                  "cpu_check_overrides": None if args.device != "cpu" else [
                      "platform: FastVideo's CpuPlatform answering with its SDPA and MiniMax-H3 VSA backend classes",
                      "VSA fine attention: masked PyTorch attention in place of the CUDA block-sparse kernel"]},
              "fp32_floor": fp32_note, "requests": {}}
    for name, shape, seed, steps in requests(args, ours.config):
        result["requests"][name] = run_request(args, fv, ours, twins, shape, seed, steps, settings, ours32)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    result["stamp"] = stamp.stamp_after(record)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
