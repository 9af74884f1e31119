"""`h3-spark bench`: measure a benchmark contract and write a stamped result (a receipt)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..h3_model.engine.flags import host_budget
from ..h3_model.engine.options import MODELS_HELP, add_budget_flags, add_dtype_flag, add_kernel_flags


def add_parser(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="measure a benchmark contract (GPU) and write a stamped result",
                       description="Measure the DiT of a benchmark contract; optionally diffusers side by side.")
    p.add_argument("--contract", required=True, help="benchmarks/<name>.json")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="DiT checkpoint (any format the engine reads)")
    src.add_argument("--models", type=Path,
                     help=MODELS_HELP + "; also measures a full warm generation per stage")
    src.add_argument("--synthetic", action="store_true",
                     help="random full-size weights built on the device (timing is weight-independent; "
                          "the result says so)")
    p.add_argument("--preset", choices=["full", "tiny"], default="full", help="model size for --synthetic")
    p.add_argument("--synthetic-init", choices=["fan_in", "normal_0.02"], default="fan_in",
                   help="random DiT weights for --synthetic: fan_in (unit-gain linears, like make-checkpoint's and "
                        "a trained network's) or normal_0.02 (the first receipts'; amplifies rounding differences)")
    p.add_argument("--fasth3", action="store_true",
                   help="with --synthetic: the DiT is a FastH3 model (random non-zero VSA gates, "
                        "attn.to_gate_compress), so --recipe fasth3 runs its VSA attention")
    add_dtype_flag(p, default="bfloat16")
    p.add_argument("--device", default=None,
                   help="cuda[:N] (the default) or cpu; without a CUDA GPU only a tiny --synthetic model runs on the "
                        "CPU unless --device cpu is given")
    p.add_argument("--vs", choices=["diffusers", "exact"], default=None,
                   help="diffusers: diffusers on the same weights; exact: our exact path against the requested fast "
                        "path, with per-block errors and the budget of h3_spark/measure/quality_budget.json")
    p.add_argument("--diffusers-backends", default="native",
                   help="comma-separated diffusers attention backends; the first is the parity reference, "
                        "another exact one gives the noise floor (default: native plus a second exact backend)")
    p.add_argument("--diffusers-compile", action="store_true",
                   help="regional torch.compile on the last diffusers backend (diffusers' best set-up)")
    add_kernel_flags(p)
    p.add_argument("--repeats", type=int, default=None, help="override the contract's repeat count")
    p.add_argument("--warmup", type=int, default=None, help="override the contract's warm-up forwards")
    p.add_argument("--steps", type=int, default=None,
                   help="override the contract's steps (the generation's and the measured evaluation's)")
    p.add_argument("--text-encoder-layer", type=int, default=50, help="with --models: the Qwen3-VL layer read")
    p.add_argument("--generation", action="store_true",
                   help="with --synthetic: also build the text encoder and both VAEs (random weights) and measure a "
                        "full warm generation per stage (--models always does)")
    p.add_argument("--cache-modes", default="",
                   help="with a generation: comma-separated step caches (easycache,h3_cache) to measure against "
                        "the uncached run: steps reused, sampling time, latent error")
    p.add_argument("--recipe", action="append", default=None, metavar="NAME[:key=value,...]",
                   help="with --vs exact: the fast side runs the sparse recipe's attention schedule at the first "
                        "evaluation it makes sparse (per-block and final drift from the exact path); with a "
                        "generation: the measured render runs with the recipes (repeatable; any recipe)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one warm forward: CUDA time per kernel group and the slowest kernels (CUDA only)")
    add_budget_flags(p)
    p.add_argument("--out", required=True, help="result JSON path")
    return p


def _run_vs_exact(args, contract, model, settings, device, weights, record, out: Path, loaded: dict) -> int:
    from ..h3_model.pipeline.scheduler import JointSchedule
    from ..measure import runner, stamp
    from ..measure.budget import quality_budget
    from ..measure.contract import contract_shape

    budget = quality_budget()
    shape = contract_shape(contract, model.config)
    schedule = JointSchedule.create(contract["steps"])
    step = len(schedule) // 2
    fast_schedule = None
    if args.recipes:
        from ..h3_model.engine.recipes import sparse_schedule

        step = min(args.recipes[0].params["dense_steps"], len(schedule) - 1)  # the first evaluation it makes sparse

        def fast_schedule():  # after the fast kernels are applied: dense blocks keep their attention
            return sparse_schedule(args.recipes, model, device, settings), step
    inputs = runner.make_inputs(shape, model.config, device, contract["seed"], step, schedule)
    result = {"contract": contract["name"], "sequence_length": shape.layout.sequence_length, "weights": weights,
              "device": device, "dtype": args.dtype, "evaluation": step,
              "vs_exact": runner.bench_vs_exact(model, settings, inputs, contract, device, budget,
                                                fast_schedule=fast_schedule)}
    if args.recipes:
        result["recipes"] = [r.describe() for r in args.recipes]
    runner.add_host_memory(result, loaded)
    result["stamp"] = stamp.stamp_after(record)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    v = result["vs_exact"]
    print(json.dumps({"contract": contract["name"], "speedup_vs_exact": v["speedup_vs_exact"],
                      "final_velocity_rel_l2_vs_exact": v["final_velocity_rel_l2_vs_exact"], "verdict": v["verdict"],
                      "out": str(out)}))
    return 0


def bench_device(args) -> str:
    """The device to measure on. Without --device: CUDA, or the CPU only for a tiny synthetic model (a smoke
    test of the bench itself); a full-size run on the CPU is never what someone asking for a benchmark meant."""
    import torch

    from ..errors import InputError
    from ..h3_model.engine.flags import check_device

    if args.device is not None:
        return check_device(args.device)
    if torch.cuda.is_available():
        return "cuda"
    if args.synthetic and args.preset == "tiny":
        return "cpu"
    raise InputError("bench measures on a CUDA GPU and this machine has none; pass --device cpu to measure on "
                     "the CPU anyway")


def check_out(path: str) -> Path:
    """The result path, checked before measuring: found only when writing, a bad path loses the whole run."""
    from ..errors import InputError
    from ..h3_model.engine.flags import file_in_the_way

    out = Path(path)
    if out.is_dir():
        raise InputError(f"--out {out} is a folder; give the path of the result JSON to write")
    blocking = file_in_the_way(out.parent)
    if blocking is not None:
        raise InputError(f"--out {out}: {blocking} is a file, not a folder")
    return out


def generation_flags(args) -> tuple[str, ...]:
    """The step caches to measure; refuses flag combinations that the measurement would ignore."""
    from ..errors import InputError
    from ..h3_model.pipeline.step_cache import MODES as CACHE_MODES

    cache_modes = tuple(m for m in args.cache_modes.split(",") if m)
    if args.generation and not args.synthetic:
        raise InputError("--generation builds synthetic components: use it with --synthetic (--models measures a "
                         "generation anyway)")
    if args.fasth3 and not args.synthetic:
        raise InputError("--fasth3 makes the synthetic DiT a FastH3 model: use it with --synthetic (a FastH3 "
                         "checkpoint or model folder says so itself)")
    generation = args.generation or bool(args.models)
    if cache_modes and not generation:
        raise InputError("--cache-modes needs a generation: add --generation (with --synthetic) or use --models")
    unknown = [m for m in cache_modes if m not in CACHE_MODES or m == "off"]
    if unknown:
        raise InputError(f"--cache-modes: unknown cache mode(s) {unknown}; choose from easycache, h3_cache")
    if generation and args.vs == "exact":
        raise InputError("--vs exact measures DiT forwards only: run the generation (--generation or --models) "
                         "without it")
    return cache_modes


def preflight(args) -> tuple:
    """Everything that can be checked without loading a model, so a mistake costs seconds, not a
    measurement: (device, contract, settings, cache modes, out path)."""
    from ..errors import InputError
    from ..kernels.settings import kernel_settings
    from ..measure.contract import load_contract

    device = bench_device(args)
    contract = load_contract(args.contract)
    if args.repeats is not None:
        if args.repeats < 1:
            raise InputError(f"--repeats must be at least 1, got {args.repeats}")
        contract.data["repeats"] = args.repeats
    for flag, key, least in (("warmup", "warmup", 0), ("steps", "steps", 2)):
        value = getattr(args, flag)
        if value is not None:
            if value < least:
                raise InputError(f"--{flag} must be at least {least}, got {value}")
            contract.data[key] = value
    cache_modes = generation_flags(args)
    out = check_out(args.out)
    if args.profile and not device.startswith("cuda"):
        raise InputError("--profile reports CUDA kernel time: it needs a CUDA device, not the CPU")
    settings = kernel_settings(args.attention, args.linear)
    args.settings = settings
    check_budget_flags(args)
    args.recipes = check_bench_recipe(args, device, settings, generation=bool(args.generation or args.models))
    if args.vs == "diffusers":
        from ..measure.diffusers_ref import diffusers_transformer_class

        diffusers_transformer_class()
    if args.checkpoint and not Path(args.checkpoint).exists():  # else the engine's loader names its own flag, --dit
        raise InputError(f"--checkpoint {args.checkpoint}: no such file or folder")
    return device, contract, settings, cache_modes, out


def check_bench_recipe(args, device: str, settings, generation: bool) -> list:
    """--recipe: with --vs exact only the recipe that changes a forward (sparse); with a generation, any."""
    from ..errors import InputError
    from ..h3_model.engine.recipes import check_recipes, parse_recipes

    if not args.recipe:
        return []
    recipes = parse_recipes(args.recipe)
    if generation:
        check_recipes(recipes, device, settings, explicit_steps=args.steps is not None,
                      steps_fix="leave --steps out")
        if args.cache_modes:
            raise InputError("--recipe with --cache-modes: the recipes' render is measured on its own; "
                             "leave --cache-modes out")
        return recipes
    if args.vs != "exact":
        raise InputError("--recipe measures a recipe's drift from the exact path (add --vs exact) or a render "
                         "with the recipes (add --generation with --synthetic, or --models)")
    if [r.name for r in recipes] != ["sparse"]:
        raise InputError("bench --recipe takes sparse, the recipe that changes a forward; turbo and "
                         "first-block-cache change the sampling (measure them with a generation)")
    check_recipes(recipes, device, settings)
    return recipes


def check_budget_flags(args) -> None:
    """--vram-budget measures the DiT's forward streamed under the budget; refuses what it cannot combine with."""
    from ..errors import InputError
    from ..h3_model.engine.flags import check_depth, vram_budget

    # A whole render (--generation) is placed as generate places it: auto by default, so a card too small to hold
    # every model resident (an 80 GB H100) plans its own streaming; the DiT forwards alone measure a given budget.
    args.budget = vram_budget(args.vram_budget, default="auto" if args.generation and not args.vs else None)
    if args.budget == "auto" and not args.generation:
        raise InputError("bench measures a given --vram-budget (a size such as 24GB) for DiT forwards; auto "
                         "(generate's placement) only with --generation")
    if args.budget == "auto" and args.vs:
        raise InputError("--vram-budget auto does not combine with --vs: the reference would sit beside the model")
    # Under any budget (auto too) the engine applies the kernels and places the models it loads.
    args.engine_places = args.budget is not None
    check_depth(args.prefetch_depth)
    args.plan_rows = None
    if args.budget is not None and args.vs:
        raise InputError("--vram-budget does not combine with --vs: the reference would sit beside the model")


def budget_report(engine, key: str, model, emulation: str | None) -> dict:
    """The engine's plan for the DiT and what its stream copied, read after every run (forwards and any
    generation) so the counts are the whole bench's; `emulation`: emulate_card's line."""
    report = {**engine.memory_report(key), "emulation": emulation}
    stats = model.block_stream.stats if model.block_stream is not None else None
    report["forwards_streamed"] = stats.forwards if stats else 0
    report["bytes_copied_per_forward"] = stats.bytes_copied // max(1, stats.forwards) if stats else 0
    # The "full" forwards recompute the AdaLN tables, so they copy every projection each time; sampling
    # copies them once per schedule.
    report["adaln_bytes_copied"] = stats.adaln_bytes_copied if stats else 0
    return report


def emulate_card(budget: int, device: str) -> str | None:
    """Cap this process at `budget` bytes of the GPU (a smaller card); the returned line goes in the receipt."""
    import torch

    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, budget / total)
    index = torch.device(device).index
    torch.cuda.set_per_process_memory_fraction(fraction, torch.cuda.current_device() if index is None else index)
    return (f"a smaller card emulated on this {torch.cuda.get_device_name(device)}: "
            f"torch.cuda.set_per_process_memory_fraction({fraction:.4f}) caps this process at {budget / 1e9:.2f} GB "
            f"of its {total / 1e9:.2f} GB")


def dit_key(contract) -> str:
    """The engine's name for the contract's DiT: ref2va runs the transformer_ref partition, t2va and fl2va the
    transformer one."""
    return "dit_ref" if contract["mode"] == "ref2va" else "dit"


def _contract_rows(args, contract) -> int:
    """The packed rows a budget plans activations for: the contract's, at the DiT's patch size (a checkpoint's
    header says it, read before loading; the synthetic and model-folder DiTs are the preset's)."""
    from ..h3_model.dit.config import preset
    from ..h3_model.engine.loading import MODE_PARTITIONS
    from ..measure.contract import contract_shape

    if args.checkpoint:
        from ..h3_model.checkpoint import read_dit_config

        config = read_dit_config(args.checkpoint, partition=MODE_PARTITIONS[contract["mode"]])
    else:
        config = preset(args.preset)
    return contract_shape(contract, config).layout.sequence_length


def _engine_budget(args) -> dict:
    """Under a budget the engine itself applies the kernels and places the models (the whole render fits);
    otherwise the bench applies them after its diffusers twin is built."""
    if args.budget is None:
        return {"kernels": None}
    return {"kernels": args.settings, "vram_budget": args.budget, "prefetch_depth": args.prefetch_depth,
            "plan_rows": args.plan_rows, "host_budget": host_budget(args.host_budget)}


def load_model(args, contract, device: str, dtype):
    """(the contract's DiT, the engine that loaded it, weights description). Every source loads through an
    engine: a whole render's components for --models and --synthetic --generation, the DiT alone otherwise."""
    from ..h3_model.engine.engine import Engine
    from ..h3_model.engine.loading import LoadOptions
    from ..h3_model.engine.paths import ComponentPaths

    budget = _engine_budget(args)
    if args.synthetic and args.generation:
        import torch

        from ..measure.synthetic import describe, synthetic_components

        vae_dtype = torch.float16 if device.startswith("cuda") else torch.float32
        engine, _ = synthetic_components(args.preset, [contract["mode"]], device, dtype, vae_dtype,
                                         seed=contract["seed"], text_layer=args.text_encoder_layer,
                                         dit_init=args.synthetic_init, fasth3=args.fasth3, **budget)
        weights = describe(args.preset, args.synthetic_init, fasth3=args.fasth3)
    elif args.models:
        # Kernels are applied by `run`, after the diffusers twin is built from the bf16 weights.
        engine = Engine(ComponentPaths(models=args.models),
                        LoadOptions(device=device, dtype=dtype, text_layer=args.text_encoder_layer, **budget))
        engine.load([contract["mode"]])
        weights = f"model folder {args.models}"
    else:
        from ..h3_model.engine.loading import MODE_PARTITIONS

        engine = dit_engine(args, contract, device, dtype, budget)
        if args.synthetic:
            from ..measure.synthetic import describe

            weights = describe(args.preset, args.synthetic_init, text_encoder=False, fasth3=args.fasth3)
        else:
            weights = checkpoint_weights(args.checkpoint, MODE_PARTITIONS[contract["mode"]])
    return engine.components.dit_for(contract["mode"]), engine, weights


def dit_engine(args, contract, device: str, dtype, budget: dict):
    """An engine holding the contract's DiT alone: --checkpoint through the engine's loader (under a budget read
    into host memory, configured there and placed, so a file larger than the card never lands on it whole), or
    --synthetic's random weights as the engine's override."""
    from ..h3_model.engine.engine import Engine
    from ..h3_model.engine.loading import LoadOptions
    from ..h3_model.engine.paths import ComponentPaths

    key = dit_key(contract)
    # diffusers' twin shares our parameters, so a quantized file is dequantized at load for it; otherwise its
    # layers stay in their stored form, as generate and serve run them.
    options = LoadOptions(device=device, dtype=dtype, stored_weights=args.vs != "diffusers", **budget)
    if args.synthetic:
        from ..h3_model.dit.config import preset
        from ..measure import synthetic

        config = preset(args.preset)
        if args.fasth3:
            from ..h3_model.checkpoint.fasth3 import fasth3_config

            config = fasth3_config(config)

        def build():
            return synthetic.synthetic_dit(config, dtype, device, seed=contract["seed"], init=args.synthetic_init)

        engine = Engine(options=options, overrides={key: build})
    else:
        engine = Engine(ComponentPaths(**{key: Path(args.checkpoint)}), options)
    return engine.load([contract["mode"]], dit_only=True)


def checkpoint_weights(path, partition: str | None = None) -> str:
    """The result's `weights`: a file our make-checkpoint wrote says so (its random weights are not H3's).
    `partition`: the one loaded, for a folder that holds both DiTs."""
    from ..h3_model.checkpoint import open_source

    source = open_source(path, partition=partition)  # headers only: the model was loaded already
    try:
        made = source.metadata.get("h3_spark")
    finally:
        source.close()
    if made is None:
        return f"checkpoint {path}"
    try:
        info = json.loads(made)
    except ValueError:
        info = {}
    return (f"checkpoint {path}: synthetic random weights written by h3-spark make-checkpoint (seed "
            f"{info.get('seed', '?')}, format {info.get('format', '?')}, layout {info.get('layout', '?')}); "
            "real H3 weights are not available here")


def run(args) -> int:
    import torch

    from ..h3_model.engine import cuda_allocator
    from ..measure import runner, stamp

    device, contract, settings, cache_modes, out = preflight(args)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    record = stamp.stamp_before()
    if args.budget is not None:
        args.plan_rows = _contract_rows(args, contract)  # the budget plans for this contract's length
    runner.say(f"building/loading the models for {contract['name']}")
    model, engine, weights = load_model(args, contract, device, dtype)
    auto = engine.auto_budget if args.budget == "auto" else None
    runner.say("loaded: " + ", ".join(f"{k} {v:.1f} s" for k, v in engine.load_seconds.items())
               + (f"; auto placement chose {auto.get('chose')}" if auto else ""))
    if auto is not None or args.budget == "auto":  # what auto chose: a budget in bytes, or None (resident)
        args.budget = engine.options.vram_budget
    loaded = runner.loaded_facts(engine.load_seconds)
    from ..h3_model.engine.kernel_plan import apply_kernels

    twin = None
    if args.vs == "diffusers":
        from ..measure.diffusers_ref import diffusers_twin

        # Built on our bf16 parameters before any fast linear replaces the modules that hold them.
        twin = diffusers_twin(model)
    if args.vs == "exact":
        return _run_vs_exact(args, contract, model, settings, device, weights, record, out, loaded)
    emulation = None
    if args.engine_places:  # the engine applied the kernels and placed everything it loaded
        backends = engine.kernel_reports[dit_key(contract)]
        if args.budget is not None and auto is None:  # a given budget stands for a smaller card; auto is this one
            emulation = emulate_card(args.budget, device)
    else:
        backends = apply_kernels(model, settings)
    renders = engine.components.vae is not None  # --models and --synthetic --generation: a whole render
    diff_backends = [b for b in args.diffusers_backends.split(",") if b]
    if args.vs and len(diff_backends) == 1:
        diff_backends.append("_native_flash" if device.startswith("cuda") else "_native_math")
    result = runner.run(contract, model, device, twin=twin, diffusers_backends=diff_backends,
                        diffusers_compile=args.diffusers_compile, weights=weights, backends_used=backends,
                        spatial=engine.components.vae.config.spatial_ratio if renders else 16,
                        profile=args.profile)
    if renders:
        from ..kernels.settings import vae_tile_batch
        from ..h3_model.engine.kernel_plan import apply_vae_kernels

        if args.engine_places:  # configured at load (under a budget it now waits in host memory)
            result["vae_kernels"] = engine.kernel_reports.get("vae")
        else:
            engine.components.vae.tile_batch = vae_tile_batch()
            result["vae_kernels"] = apply_vae_kernels(engine.components.vae, settings)
        result["generation"] = runner.bench_generation(engine, contract, device, cache_modes, args.recipes)
        if args.synthetic:
            result["generation"]["component_build_s"] = dict(engine.load_seconds)
    from ..kernels.dispatch import attention_counts

    result["backends"]["attention"].update(attention_counts(model))  # the fallbacks, counted after the runs
    if args.budget is not None:
        result["vram_budget"] = budget_report(engine, dit_key(contract), model, emulation)
    if auto is not None:
        result["auto_budget"] = auto  # what --vram-budget auto saw and chose (resident or streaming)
    result["dtype"] = args.dtype
    if (allocator := cuda_allocator.chosen()) is not None:
        result["cuda_allocator"] = allocator
    runner.add_host_memory(result, loaded)
    result["stamp"] = stamp.stamp_after(record)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: result.get(k) for k in ("contract", "sequence_length", "dit_forward_s_median",
                                          "dit_forward_full_s_median", "peak_gpu_memory_gb", "peak_host_memory_gb",
                                          "speedup_vs_diffusers", "velocity_rel_l2_vs_diffusers",
                                          "noise_floor_rel_l2")}
    summary["out"] = str(out)
    print(json.dumps(summary))
    return 0
