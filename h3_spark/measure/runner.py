"""Measure one contract: DiT forward speed, memory and, optionally, diffusers side by side.

Every number comes from this process on this device: medians of warm repeats timed with CUDA
events (host clock on the CPU), warm-up excluded; ratios compare runs made here, one after the
other, on the same weights and inputs.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from typing import Callable

import torch

from ..h3_model.dit.config import DiTConfig
from ..h3_model.engine import host_memory
from ..h3_model.pipeline.sampler import schedule_timestep_values
from ..h3_model.pipeline.scheduler import CONDITION_AUDIO_T, CONDITION_VIDEO_T, JointSchedule
from .contract import BenchShape, Contract, check_limits, contract_shape


def say(message: str) -> None:
    """A progress line on stderr: a full-size bench runs for minutes, and its JSON comes only at the end."""
    print(f"bench: {message}", file=sys.stderr, flush=True)


def time_call(fn: Callable[[], object], device: str, warmup: int, repeats: int,
              what: str | None = None) -> list[float]:
    """Seconds per call for `repeats` warm calls; with `what`, a progress line per call."""
    for i in range(warmup):
        t0 = time.perf_counter()
        fn()
        if what:
            say(f"{what}: warm-up {i + 1}/{warmup} ({time.perf_counter() - t0:.2f} s)")
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        if what:
            say(f"{what}: {len(times)}/{repeats} {times[-1]:.3f} s")
    return times


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_inputs(shape: BenchShape, config: DiTConfig, device: str, seed: int, step: int,
                schedule: JointSchedule) -> dict:
    """Random latents and prompt embeddings for one step of the contract's schedule."""
    lay = shape.layout
    gen = torch.Generator().manual_seed(seed)
    tv, ta = schedule.step_timesteps(step)
    ts, tidx = lay.row_timesteps(tv, ta, max(tv, CONDITION_VIDEO_T), CONDITION_AUDIO_T)
    host = dict(
        hidden_states=torch.randn(1, lay.video_indices.numel(), config.video_patch_dim, generator=gen),
        audio_hidden_states=torch.randn(1, lay.audio_indices.numel(), config.audio_in_channels, generator=gen),
        encoder_hidden_states=torch.randn(1, lay.num_text, config.text_dim, generator=gen).to(torch.bfloat16),
        timestep=ts, timestep_indices=tidx, token_tags=lay.token_tags, position_ids=lay.position_ids.float(),
        video_indices=lay.video_indices, audio_indices=lay.audio_indices, text_indices=lay.text_indices)
    return {k: v.to(device) for k, v in host.items()}


def _peak(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 1e9 if device.startswith("cuda") else None


def _reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


@torch.inference_mode()
def bench_ours(model, shape: BenchShape, inputs: dict, contract: Contract, device: str,
               profile: bool = False) -> dict:
    lay = shape.layout
    schedule = JointSchedule.create(contract["steps"])
    model.precompute_modulation(schedule_timestep_values(lay, schedule))
    text = model.encode_text(inputs["encoder_hidden_states"])
    target_v = torch.arange(lay.num_condition_video_rows, lay.video_indices.numel(), device=device)
    target_a = torch.arange(lay.num_condition_audio_rows, lay.audio_indices.numel(), device=device)
    step_kwargs = {**inputs, "encoder_hidden_states": None}

    def sampled():
        return model(**step_kwargs, text_embeds=text, output_video_rows=target_v, output_audio_rows=target_a)

    def full():
        return model(**inputs)

    warmup, repeats = contract["warmup"], contract["repeats"]
    _reset_peak(device)
    sampled_times = time_call(sampled, device, warmup, repeats, "DiT forward")
    peak = _peak(device)
    full_times = time_call(full, device, 1, max(1, repeats // 2), "full DiT forward")
    out = {
        "dit_forward_s_median": statistics.median(sampled_times),
        "dit_forward_s_all": sampled_times,
        "dit_forward_full_s_median": statistics.median(full_times),
        "peak_gpu_memory_gb": peak,
    }
    if profile:
        from .profile import profile_call

        out["profile"] = profile_call(sampled, device)
    return out


@torch.inference_mode()
def bench_diffusers(model, twin, inputs: dict, contract: Contract, device: str, backends: list[str],
                    compile_blocks: bool) -> dict:
    from .diffusers_ref import forward_kwargs, set_backend

    kwargs = forward_kwargs(inputs)
    # Parity runs the reference's work: AdaLN tables computed for this step alone, not from the
    # schedule-wide batched precompute (a different GEMM shape rounds differently in bf16).
    model.clear_modulation_cache()
    ours_v, ours_a = model(**inputs)
    out: dict = {"configs": {}}
    reference = None
    for backend in backends:
        set_backend(twin, backend)
        name = backend
        if compile_blocks and backend == backends[-1]:
            twin.compile_repeated_blocks(fullgraph=True)
            name = f"{backend}+compile"
        res = twin(**kwargs)
        times = time_call(lambda: twin(**kwargs), device, contract["warmup"] + (2 if "compile" in name else 0),
                          contract["repeats"])
        entry = {"forward_s_median": statistics.median(times), "forward_s_all": times}
        if reference is None:
            reference = (res.sample.float(), res.audio_sample.float())
            entry["role"] = "reference for velocity parity"
            # Before any compile: forward hooks and compiled blocks do not mix.
            out["blockwise_rel_l2"] = blockwise(model, twin, inputs)
        else:
            entry["rel_l2_vs_reference_backend"] = rel_l2(torch.cat([res.sample.flatten(), res.audio_sample.flatten()]),
                                                          torch.cat([reference[0].flatten(), reference[1].flatten()]))
        out["configs"][name] = entry
    ref_all = torch.cat([reference[0].flatten(), reference[1].flatten()])
    out["velocity_rel_l2_vs_diffusers"] = rel_l2(torch.cat([ours_v.flatten(), ours_a.flatten()]), ref_all)
    out["velocity_rel_l2_video"] = rel_l2(ours_v, reference[0])
    out["velocity_rel_l2_audio"] = rel_l2(ours_a, reference[1])
    floors = [e["rel_l2_vs_reference_backend"] for e in out["configs"].values() if "rel_l2_vs_reference_backend" in e]
    out["noise_floor_rel_l2"] = min(floors) if floors else None
    best = min(e["forward_s_median"] for e in out["configs"].values())
    out["diffusers_best_forward_s"] = best
    out["diffusers_default_forward_s"] = out["configs"][backends[0]]["forward_s_median"]
    return out


def blockwise(model, twin, inputs: dict) -> list[float]:
    # Hooks on our Block modules: a fast-linear or fused-modulation swap keeps the Block objects.
    """rel L2 of every block's output, ours vs diffusers, on the same inputs (cumulative)."""
    ours_out: list[torch.Tensor] = []
    hooks = [blk.register_forward_hook(lambda m, a, o: ours_out.append(o.detach())) for blk in model.transformer_blocks]
    try:
        model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    errors: list[float] = []

    def compare(module, args, output):
        errors.append(rel_l2(output.float(), ours_out[len(errors)].float()))
        ours_out[len(errors) - 1] = None  # free as we go

    hooks = [blk.register_forward_hook(compare) for blk in twin.transformer_blocks]
    try:
        from .diffusers_ref import forward_kwargs

        twin(**forward_kwargs(inputs))
    finally:
        for h in hooks:
            h.remove()
    return errors


def run(contract: Contract, model, device: str, *, twin, diffusers_backends: list[str],
        diffusers_compile: bool, weights: str, backends_used: dict, spatial: int = 16,
        profile: bool = False) -> dict:
    """`twin`: diffusers' model on the same weights (bench_diffusers), or None for ours alone.
    `spatial`: the video VAE's compression (16 when released) that turns the canvas into latents.
    `profile`: also profile one sampled forward's CUDA kernels (bench/profile.py)."""
    shape = contract_shape(contract, model.config, spatial)
    schedule = JointSchedule.create(contract["steps"])
    inputs = make_inputs(shape, model.config, device, contract["seed"], len(schedule) // 2, schedule)
    result = {"contract": contract["name"], "sequence_length": shape.layout.sequence_length,
              "contract_sequence_length": contract["sequence_length"], "weights": weights,
              "backends": backends_used, "device": device, "steps_evaluations": len(schedule),
              "measured_step": len(schedule) // 2}
    result.update(bench_ours(model, shape, inputs, contract, device, profile))
    if twin is not None:
        d = bench_diffusers(model, twin, inputs, contract, device, diffusers_backends, diffusers_compile)
        result["diffusers"] = d
        for key in ("velocity_rel_l2_vs_diffusers", "noise_floor_rel_l2"):
            result[key] = d[key]
        result["speedup_vs_diffusers"] = d["diffusers_best_forward_s"] / result["dit_forward_s_median"]
        result["speedup_vs_diffusers_default"] = d["diffusers_default_forward_s"] / result["dit_forward_s_median"]
        result["speedup_full_work_vs_diffusers"] = d["diffusers_best_forward_s"] / result["dit_forward_full_s_median"]
    result["limits"] = check_limits(contract, result)
    return result


def contract_request(contract: Contract):
    """The contract's request for the real pipeline; image references are seeded random pictures of the
    contract's source sizes (the timing depends on their size, not their content)."""
    from ..h3_model.media.refs import ImageReference
    from ..h3_model.pipeline.generation import GenerationRequest

    refs = []
    for i, ref in enumerate(contract.get("references", [])):
        gen = torch.Generator().manual_seed(contract["seed"] + i)
        refs.append(ImageReference(torch.randint(0, 256, (ref["source_height"], ref["source_width"], 3),
                                                 generator=gen, dtype=torch.uint8)))
    return GenerationRequest(mode=contract["mode"], prompt=contract.get("prompt", "benchmark"), references=refs,
                             width=contract["width"], height=contract["height"], frames=contract["frames"],
                             steps=contract["steps"], seed=contract["seed"],
                             reference_policy=(contract.get("references") or [{}])[0].get("policy", "match"))


# The warm-up render's length: every stage's kernels load on the shortest clip H3 makes (5 s); the DiT at the
# contract's length was warmed by the forwards measured before, and a 345-frame warm-up would cost a minute.
WARMUP_FRAMES = 124


def bench_generation(engine, contract: Contract, device: str, cache_modes: tuple[str, ...] = (),
                     recipes: list | None = None) -> dict:
    """One warm full generation (after a 2-step, short warm-up of every stage): seconds and peak GPU memory per
    stage, mux included, and the video decode's memory plan beside what it measured.

    With `recipes` the measured render runs with them (engine/recipes.py). Each of `cache_modes` then samples
    the same request again with that step cache (its default settings): steps computed and reused, the whole
    render's seconds per stage, and the final latents' rel L2 against the uncached run."""
    from ..h3_model.media import files as media

    req = contract_request(contract)
    warm = dataclasses.replace(req, steps=2, frames=min(req.frames, WARMUP_FRAMES))
    if recipes:
        from ..h3_model.engine.recipes import apply_recipes

        dit = engine.components.dit_for(contract["mode"])
        req = apply_recipes(recipes, req, dit, device, engine.settings)
        # The warm-up runs the recipes too (their steps, on the short request): a recipe's kernels (VSA's)
        # compile there, not inside the measured render's first evaluation.
        warm = apply_recipes(recipes, warm, dit, device, engine.settings)
    say(f"generation warm-up ({warm.steps} steps, {warm.frames} frames)")
    t0 = time.perf_counter()
    engine.generate(warm)
    say(f"generation warm-up done ({time.perf_counter() - t0:.1f} s); measured render "
        f"({req.frames} frames, {req.steps} steps)")
    # Warm kernels, cold caches: the measured request encodes its prompt and references like a new one.
    engine.clear_caches()
    memory = StageMemory(device)
    result, _, total = _timed_render(engine, req, on_progress=memory.on_progress)
    stage_peaks = memory.finish()
    say(f"measured render {total:.2f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in result.timings.items()))
    steps = result.info.get("step_seconds") or []
    out = {"stage_s": result.timings, "total_s": total, "sequence_length": result.info["sequence_length"],
           "text_tokens": result.info.get("text_tokens"), "evaluations": result.info["evaluations"],
           "step_s_median": statistics.median(steps) if steps else None, "step_s_all": steps,
           "frames": int(result.video.shape[0]),
           "peak_gpu_memory_gb": max((p["peak_gb"] for p in stage_peaks.values()), default=None),
           "stage_gpu_memory_gb": stage_peaks or None, "peak_host_rss_gb": _peak_rss(),
           "host_memory": host_memory.host_memory(),
           "video_decode_plan": _decode_plan(engine, req, result.video_latents),
           "latents_finite": bool(result.video_latents.isfinite().all()),
           "prompt_cache_hit": result.info.get("prompt_cache_hit"),
           "reference_cache_hits": result.info.get("reference_cache_hits"),
           "mp4": {"codec": media.VIDEO_CODEC, "preset": media.x264_preset(), "crf": media.DEFAULT_CRF,
                   "host_cpus": os.cpu_count()},
           "note": f"warm: every stage ran once before (2 steps, or the recipes' own, at most {WARMUP_FRAMES} frames, "
                   "the contract's canvas, the recipes applied); "
                   "prompt and reference caches cleared before this run"}
    if recipes:
        out["recipes"] = result.info.get("recipes")
        out["step_cache"] = result.info.get("step_cache")
    if cache_modes:
        out["step_caches"] = bench_step_caches(engine, req, result, cache_modes)
    return out


class StageMemory:
    """Peak GPU memory per pipeline stage, from the progress reports: at each new stage the previous stage's
    peak is read and the counter reset. CUDA only (empty elsewhere)."""

    def __init__(self, device: str):
        self.device = device
        self.cuda = device.startswith("cuda")
        self.stage: str | None = None
        self.start_gb = 0.0
        self.peaks: dict[str, dict] = {}
        _reset_peak(device)

    def on_progress(self, progress) -> None:
        if progress.stage != self.stage:
            self._close()
            self.stage = progress.stage
            if self.cuda:
                self.start_gb = torch.cuda.memory_allocated() / 1e9

    def _close(self) -> None:
        if self.stage is None or not self.cuda:
            return
        torch.cuda.synchronize()
        peak = _peak(self.device)
        self.peaks[self.stage] = {"peak_gb": round(peak, 3), "at_start_gb": round(self.start_gb, 3),
                                  "above_start_gb": round(peak - self.start_gb, 3)}
        _reset_peak(self.device)

    def finish(self) -> dict[str, dict]:
        self._close()
        self.stage = None
        return self.peaks


def _decode_plan(engine, req, video_latents: torch.Tensor) -> dict | None:
    """vae/video.py's computed peak of this decode (weights, largest transient, window), GB."""
    from ..h3_model.vae.video import decode_memory_estimate

    vae = engine.components.vae
    if vae is None:
        return None
    _, _, frames, height, width = video_latents.shape
    estimate = decode_memory_estimate(vae.config, frames, height, width, decode_dtype=vae.decode_dtype,
                                      tile_size=req.vae_tile_size,
                                      tile_batch=vae.tile_batch)
    return {"tile_size": req.vae_tile_size, "latent_frames": frames,
            **{k: round(v / 1e9, 3) for k, v in estimate.items()}}


def bench_step_caches(pipe, req, uncached, modes: tuple[str, ...]) -> dict:
    """Each step cache on the same request, measured like the uncached run: cold prompt/reference caches, then
    the whole render (decode and mux included), so `total_s` compares with the uncached `total_s`."""
    from ..h3_model.pipeline.step_cache import make_step_cache

    evaluations = uncached.info["evaluations"]
    base_sampling = uncached.timings["sampling"]
    report = {}
    for mode in modes:
        cache = make_step_cache(mode, evaluations=evaluations)
        pipe.clear_caches()
        res, timings, total = _timed_render(pipe, dataclasses.replace(req, step_cache=cache))
        info = cache.report()
        report[mode] = {
            "settings": {k: info[k] for k in ("threshold", "start_percent", "end_percent", "subsample_factor")},
            "computed_steps": len(info["computed"]), "reused_steps": len(info["reused"]),
            "reused": info["reused"], "sampling_s": timings["sampling"], "stage_s": timings, "total_s": total,
            "sampling_speedup_vs_uncached": base_sampling / timings["sampling"],
            "video_latents_rel_l2_vs_uncached": rel_l2(res.video_latents.float(), uncached.video_latents.float()),
            "audio_latents_rel_l2_vs_uncached": rel_l2(res.audio_latents.float(), uncached.audio_latents.float()),
        }
    return report


def _peak_rss() -> float | None:
    """This process's peak resident host memory so far (model building included), GB; None where the system
    does not say."""
    peak = host_memory.peak_rss_bytes()
    return None if peak is None else round(peak / 1e9, 2)


def loaded_facts(load_seconds: dict) -> dict:
    """Read right after loading: each component's load seconds and the host memory then, what the weights took
    before anything ran (under a VRAM budget the streamed blocks wait there)."""
    return {"load_s": dict(load_seconds), "host_memory_after_load": host_memory.host_memory()}


def add_host_memory(result: dict, loaded: dict) -> dict:
    """Every receipt's host side beside its GPU peak, read last so the peaks cover the whole bench: the process's
    peak resident set (`peak_host_memory_gb`), now and at its peak with its cgroup's limit and peak
    (`host_memory`), and `loaded_facts`."""
    result.update(loaded)
    result.update(host_memory.host_memory_report())
    return result


def _timed_render(pipe, req, on_progress=None) -> tuple[object, dict, float]:
    """One generation and its mux, as `h3-spark generate` runs them (frames encoded while later windows
    decode): (result, seconds per stage, total seconds). "mux" is what is left after the decode."""
    import tempfile

    from ..h3_model.media import files as media

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        with media.mp4_writer(f"{tmp}/bench.mp4") as stream:
            result = pipe.generate(req, on_frames=stream.add, on_progress=on_progress)
            t0 = time.perf_counter()
            stream.finish(result.audio)
            result.timings["mux"] = time.perf_counter() - t0
        total = time.perf_counter() - start
    return result, result.timings, total


def _capture(model, reference: dict, errors: dict | None):
    """Hooks on every block's attention, feed-forward and output: without `errors`, store the outputs in
    `reference`; with it, record each output's rel L2 against the stored one."""
    hooks = []
    for i, blk in enumerate(model.transformer_blocks):
        for part, module in (("attention", blk.attn), ("ffn", blk.ff), ("block", blk)):
            def hook(mod, args, out, i=i, part=part):
                if errors is None:
                    reference[(i, part)] = out.detach().clone()
                else:
                    errors.setdefault(i, {})[part] = rel_l2(out.float(), reference[(i, part)].float())
            hooks.append(module.register_forward_hook(hook))
    return hooks


def _timed_and_captured(model, inputs: dict, contract: Contract, device: str, reference: dict,
                        errors: dict | None) -> tuple[list[float], torch.Tensor]:
    """Warm timings of the model's current path, then one forward under `_capture`: (times, flat output)."""
    times = time_call(lambda: model(**inputs), device, contract["warmup"], contract["repeats"])
    hooks = _capture(model, reference, errors)
    try:
        out = torch.cat([t.flatten().float() for t in model(**inputs)])
    finally:
        for h in hooks:
            h.remove()
    return times, out


@torch.inference_mode()
def bench_vs_exact(model, fast_settings, inputs: dict, contract: Contract, device: str, budget: dict, *,
                   fast_schedule=None) -> dict:
    """Exact path first (on the model as loaded), then the requested fast path on the same weights and inputs:
    per-block attention / feed-forward / block-output errors, the final velocity error and both speeds.
    `fast_schedule() -> (attention schedule, evaluation)` adds a recipe's schedule to the fast side, made after
    the fast kernels are applied (engine.recipes.sparse_schedule)."""
    from ..h3_model.engine.kernel_plan import apply_kernels
    from ..kernels.settings import KernelSettings

    exact = dataclasses.replace(KernelSettings(), attention="sdpa", linear="bf16", modulation_fusion="off",
                                q_rms_rope_int8_fusion="off")
    apply_kernels(model, exact)
    model.clear_modulation_cache()
    reference: dict = {}
    errors: dict = {}
    exact_times, exact_out = _timed_and_captured(model, inputs, contract, device, reference, None)
    report = apply_kernels(model, fast_settings)
    approximate = list(report.get("approximate_paths", []))
    if fast_schedule is not None:
        model.attention_schedule, model.sampling_step = fast_schedule()
        approximate.append("recipe sparse")
    try:
        fast_times, fast_out = _timed_and_captured(model, inputs, contract, device, reference, errors)
    finally:
        model.attention_schedule, model.sampling_step = None, None
    reference.clear()
    final = rel_l2(fast_out, exact_out)
    worst_block = max(e["block"] for e in errors.values())
    return {
        "exact_forward_s_median": statistics.median(exact_times),
        "fast_forward_s_median": statistics.median(fast_times),
        "speedup_vs_exact": statistics.median(exact_times) / statistics.median(fast_times),
        "final_velocity_rel_l2_vs_exact": final,
        "per_block_rel_l2": [errors[i] for i in sorted(errors)],
        "budget": budget,
        "fast_path": report,
        "verdict": promotion_verdict(final, worst_block, approximate, budget),
        "approximate_paths": approximate,
    }


def promotion_verdict(final: float, worst_block: float, approximate: list[str], budget: dict) -> str:
    """What `auto` may do with this fast path: exact paths are always usable; approximate ones only inside
    the budget (and even then only when asked for: `auto` itself never picks an approximate path)."""
    if not approximate:
        return "exact path"
    inside = final <= budget["final_velocity_rel_l2"] and worst_block <= budget["block_output_rel_l2"]
    what = ", ".join(approximate)
    if inside:
        return f"eligible: {what} inside the budget"
    return (f"refused: {what} outside the budget (final {final:.4f} vs {budget['final_velocity_rel_l2']}, "
            f"worst block {worst_block:.4f} vs {budget['block_output_rel_l2']})")
