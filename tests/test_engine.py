"""The engine object: what it plans, how it reports loading, what it configures once, and its errors."""

from __future__ import annotations

import pytest
import torch

from h3_spark.errors import CheckpointError, InputError
from h3_spark.h3_model.engine.engine import Engine
from h3_spark.h3_model.engine.loading import LoadOptions
from h3_spark.h3_model.engine.paths import ComponentPaths
from h3_spark.kernels.settings import KernelSettings
from h3_spark.measure import synthetic

from benchmark_scripts import load_benchmark

# The PyTorch references (Triton's CPU interpreter would spend seconds per fused pass).
REFERENCE_KERNELS = KernelSettings(modulation_fusion="off", q_rms_rope_int8_fusion="off")


@pytest.fixture(scope="module")
def builders():
    from h3_spark.h3_model.text.torchvision_compat import ensure_importable

    if not ensure_importable():
        pytest.skip("the Qwen3-VL processors need torchvision")
    return synthetic.component_builders("tiny", ["t2va", "ref2va"], "cpu", torch.float32, torch.float32,
                                        text_layer=2)


def _engine(builders, **changes) -> Engine:
    options = LoadOptions(device="cpu", dtype=torch.float32, vae_dtype=torch.float32, text_layer=2,
                          kernels=REFERENCE_KERNELS)
    return Engine(options=options, overrides={**builders, **changes})


def test_load_reports_each_component_and_configures_it_once(builders):
    events = []
    engine = _engine(builders).load(on_progress=events.append)
    names = ["dit", "dit_ref", "text_encoder", "vae", "audio_vae"]
    assert [(e.component, e.state) for e in events] == [(n, s) for n in names for s in ("loading", "resident")]
    assert all(e.seconds is not None and e.seconds >= 0 for e in events if e.state == "resident")
    assert set(engine.load_seconds) == set(names) and engine.modes == ["t2va", "fl2va", "ref2va"]
    # Kernels once per DiT and for the video VAE, with the attention each DiT was given kept for job switches.
    assert set(engine.kernel_reports) == {"dit", "dit_ref", "vae"}
    assert engine.kernel_reports["dit"]["attention"]["chosen"] == "sdpa"
    assert engine.default_attention["dit"] == (engine.components.dit.attention, engine.components.dit.qk_prep)
    assert engine.components.vae.tile_batch == engine.options.vae_tile_batch


def test_one_jobs_attention_runs_inside_the_switch_and_the_load_time_one_comes_back(builders):
    from h3_spark.kernels.capability import KernelUnavailable

    engine = _engine(builders).load(["fl2va"])
    dit = engine.components.dit
    loaded = (dit.attention, dit.qk_prep)
    choice = engine.choose_attention("dit", "kj_head_sliced")
    assert engine.choose_attention("dit", None) is None
    with pytest.raises(RuntimeError, match="the job failed"):
        with engine.job_attention("dit", choice) as report:
            assert dit.attention is choice.backend and report["attention"]["chosen"] == "kj_head_sliced(sdpa)"
            raise RuntimeError("the job failed")
    assert (dit.attention, dit.qk_prep) == loaded
    with engine.job_attention("dit", None) as report:
        assert dit.attention is loaded[0] and report["attention"] == engine.kernel_reports["dit"]["attention"]
    with pytest.raises(KernelUnavailable, match="fa3 needs sm_90"):
        engine.choose_attention("dit", "fa3")


def test_only_the_partitions_the_modes_need_are_loaded(builders):
    engine = _engine(builders).load(["fl2va"])
    assert engine.components.dit is not None and engine.components.dit_ref is None
    assert engine.modes == ["t2va", "fl2va"]
    with pytest.raises(Exception, match="ref2va needs the ref2va partition"):
        engine.components.dit_for("ref2va")


def test_a_component_that_fails_is_reported_and_stops_the_load(builders):
    def broken():
        raise CheckpointError("text_encoder/: shard 3 is missing")

    events = []
    with pytest.raises(CheckpointError, match="shard 3 is missing"):
        _engine(builders, text_encoder=broken).load(["t2va"], on_progress=events.append)
    assert [(e.component, e.state) for e in events] == [
        ("dit", "loading"), ("dit", "resident"), ("text_encoder", "loading"), ("text_encoder", "failed")]
    assert events[-1].error == "text_encoder/: shard 3 is missing"


@pytest.mark.parametrize("paths, modes, message", [
    (ComponentPaths(), ["t2va"], "t2va needs the transformer/ DiT: pass --models or --dit"),
    (ComponentPaths(), None, "no DiT to serve: pass --models"),
    (ComponentPaths(), ["t3va"], r"unknown mode\(s\) \['t3va'\]"),
])
def test_plan_names_what_is_missing(paths, modes, message):
    with pytest.raises(InputError, match=message):
        Engine(paths).plan(modes)


def test_plan_wants_the_text_encoder_and_both_vaes(tmp_path):
    dit = tmp_path / "dit.safetensors"
    dit.write_bytes(b"")
    with pytest.raises(InputError, match="the text encoder is needed: pass --models or --text-encoder"):
        Engine(ComponentPaths(dit=dit)).plan(["t2va"])
    with pytest.raises(InputError, match="no such model folder"):
        Engine(ComponentPaths(models=tmp_path / "nowhere")).plan(["t2va"])


def test_unknown_overrides_are_refused():
    with pytest.raises(InputError, match=r"unknown component override\(s\) \['unet'\]"):
        Engine(overrides={"unet": lambda: None})


def test_asked_for_kernels_that_cannot_run_fail_before_any_weights(builders):
    read = []
    engine = _engine({**builders, "dit": lambda: read.append("dit")})
    engine.options.kernels = KernelSettings(attention="fa3")
    with pytest.raises(Exception, match="fa3"):
        engine.load(["t2va"])
    assert read == []


def test_stages_of_an_engine_over_components_in_memory(builders):
    """`Engine.of` (the ComfyUI nodes' way in) runs the same stage code: the decode of its latents matches the
    resident engine's whole generation."""
    from h3_spark.h3_model.pipeline.generation import GenerationRequest

    engine = _engine(builders).load(["t2va"])
    req = GenerationRequest(mode="t2va", prompt="a boat", width=64, height=64, frames=124, steps=3)
    result = engine.generate(req)
    held = Engine.of(text_encoder=engine.components.text_encoder, vae=engine.components.vae,
                     audio_vae=engine.components.audio_vae)
    text = held.encode_text("t2va", "a boat")
    assert text.tags.numel() == result.info["text_tokens"]
    assert torch.equal(held.decode_video(result.video_latents), result.video)
    assert torch.equal(held.decode_audio(result.audio_latents), result.audio)


def test_a_budget_streams_the_dit_and_generates_the_same_latents(builders):
    """The engine's budget path on the CPU (budget emulated): the DiT is configured in host memory, the blocks
    that do not fit stream, and the generation equals the resident engine's bit for bit."""
    from h3_spark.h3_model.engine import memory
    from h3_spark.h3_model.pipeline.generation import GenerationRequest

    req = GenerationRequest(mode="t2va", prompt="a boat", width=64, height=64, frames=124, steps=3)
    resident = _engine(builders).load(["t2va"])
    want = resident.generate(req)
    probe = memory.plan_dit(resident.components.dit, None, 4096)
    probe.resident_blocks, probe.adaln_on_host = 0, True
    def options(budget):
        return LoadOptions(device="cpu", dtype=torch.float32, vae_dtype=torch.float32, text_layer=2,
                           kernels=REFERENCE_KERNELS, vram_budget=budget, plan_rows=4096)

    # What the text encode and the VAE stages need beyond the DiT's activations comes first (they take turns with
    # them); the DiT streams within the rest: the least budget that holds every block streamed.
    reserve = max(Engine(options=options(100 * memory.GB), overrides=builders).load(["t2va"]).stage_reserve.values())
    least = probe.device_bytes + max(0, reserve - probe.activations)
    streamed = Engine(options=options(memory.budget_for(least)), overrides=builders)
    streamed.load(["t2va"])
    assert streamed.components.text_encoder.layer_stream is not None and streamed.pipeline.offload_text_encoder
    got = streamed.generate(req)
    assert torch.equal(got.video_latents, want.video_latents) and torch.equal(got.audio_latents, want.audio_latents)
    report = streamed.memory_report("dit")
    assert report["streamed_blocks"] == streamed.components.dit.config.num_layers and report["forwards"] == 2
    assert report["bytes_copied_per_forward"] >= sum(probe.blocks)
    # A request longer than the budget was planned for is refused before it samples.
    plan = streamed.memory_plans["dit"]
    plan.rows, plan.activations = 16, memory.activation_bytes(streamed.components.dit.config, 16, torch.float32)
    plan.budget = memory.budget_for(plan.device_bytes)
    with pytest.raises(InputError, match="this request packs .* rows, whose activations bring the DiT"):
        streamed.generate(req)


def test_bad_budget_flags_are_refused(capsys):
    from h3_spark.cli import main

    assert main(["generate", "--demo", "--vram-budget", "lots", "--out", "x.mp4"]) == 2
    assert ("--vram-budget 'lots' is not a size; use auto, or a size in GB: 24, 24GB, 22.5GiB or 800MB"
            in capsys.readouterr().err)
    assert main(["generate", "--demo", "--vram-budget", "24", "--gpus", "2", "--out", "x.mp4"]) == 2
    assert "does not combine with --gpus" in capsys.readouterr().err
    assert main(["generate", "--demo", "--prefetch-depth", "0", "--out", "x.mp4"]) == 2
    assert "--prefetch-depth must be at least 1, got 0" in capsys.readouterr().err
    assert main(["generate", "--demo", "--host-budget", "plenty", "--out", "x.mp4"]) == 2
    assert "--host-budget 'plenty' is not a size; use 24, 24GB, 22.5GiB or 800MB" in capsys.readouterr().err
    assert main(["generate", "--demo", "--host-budget", "auto", "--out", "x.mp4"]) == 2
    assert "--host-budget takes a size (24, 24GB, 22.5GiB), not auto" in capsys.readouterr().err


def test_the_host_budget_flag_and_its_variable(monkeypatch):
    from h3_spark.h3_model.engine.flags import host_budget

    monkeypatch.delenv("H3_HOST_BUDGET", raising=False)
    assert host_budget(None) is None and host_budget("32") == 32 * 10 ** 9
    monkeypatch.setenv("H3_HOST_BUDGET", "16GiB")
    assert host_budget(None) == 16 * 2 ** 30 and host_budget("8GB") == 8 * 10 ** 9
    monkeypatch.setenv("H3_HOST_BUDGET", "-3")
    with pytest.raises(InputError, match="H3_HOST_BUDGET '-3' is not a size"):
        host_budget(None)


def test_auto_on_the_cpu_stays_resident(builders):
    options = LoadOptions(device="cpu", dtype=torch.float32, vae_dtype=torch.float32, text_layer=2,
                          kernels=REFERENCE_KERNELS, vram_budget="auto")
    engine = Engine(options=options, overrides=builders).load(["t2va"])
    assert engine.options.vram_budget is None and engine.memory_plans == {} and engine.auto_budget is None
    assert engine.components.dit.block_stream is None


@pytest.fixture(scope="module")
def int8_dit(builders, tmp_path_factory):
    """The builders' DiT written as a Comfy-Org int8_convrot file by our make-checkpoint."""
    from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint

    path = tmp_path_factory.mktemp("int8") / "dit.safetensors"
    make_dit_checkpoint(path, builders["dit"]().config, "int8_convrot", "comfy", seed=5)
    return path


def _file_engine(builders, dit, **options) -> Engine:
    others = {k: v for k, v in builders.items() if k not in ("dit", "dit_ref")}
    base = dict(device="cpu", dtype=torch.float32, vae_dtype=torch.float32, text_layer=2, kernels=REFERENCE_KERNELS)
    return Engine(ComponentPaths(dit=dit), LoadOptions(**{**base, **options}), overrides=others)


def test_a_quantized_file_runs_in_its_stored_form_resident_and_streamed(builders, int8_dit):
    """The engine keeps an int8_convrot file's layers as stored (StoredLinear) by default; resident or streamed under
    a budget, it generates the latents of the same file dequantized at load, bit for bit, and what streams is packed
    as int8 codes."""
    from h3_spark.h3_model.engine import memory
    from h3_spark.h3_model.pipeline.generation import GenerationRequest
    from h3_spark.kernels.stored_linear import StoredLinear

    req = GenerationRequest(mode="t2va", prompt="a boat", width=64, height=64, frames=124, steps=3)
    dense = _file_engine(builders, int8_dit, stored_weights=False).load(["t2va"])
    want = dense.generate(req)
    assert not any(isinstance(m, StoredLinear) for m in dense.components.dit.modules())
    stored = _file_engine(builders, int8_dit).load(["t2va"])
    linears = [m for m in stored.components.dit.modules() if isinstance(m, StoredLinear)]
    assert linears and {m.weight.dtype for m in linears} == {torch.int8}
    got = stored.generate(req)
    assert torch.equal(got.video_latents, want.video_latents) and torch.equal(got.audio_latents, want.audio_latents)

    probe = memory.plan_dit(stored.components.dit, None, 4096)
    probe.resident_blocks, probe.adaln_on_host = 0, True
    reserve = max(_file_engine(builders, int8_dit, vram_budget=100 * memory.GB, plan_rows=4096)
                  .load(["t2va"]).stage_reserve.values())
    least = probe.device_bytes + max(0, reserve - probe.activations)
    streamed = _file_engine(builders, int8_dit, vram_budget=memory.budget_for(least), plan_rows=4096).load(["t2va"])
    stream = streamed.components.dit.block_stream
    assert stream is not None and len(stream.units) == streamed.components.dit.config.num_layers
    packed = {e.dtype for u in stream.units.values() for e in u.entries}
    assert torch.int8 in packed and torch.bfloat16 not in packed and torch.float32 in packed  # codes, scales, norms
    got = streamed.generate(req)
    assert torch.equal(got.video_latents, want.video_latents) and torch.equal(got.audio_latents, want.audio_latents)
    host = streamed.memory_report("dit")["host"]
    assert host["dit_streamed_bytes"] == stream.host_bytes and host["held_bytes"] >= stream.host_bytes


def test_a_host_budget_below_what_must_be_held_fails_before_placing(builders, int8_dit):
    from h3_spark.h3_model.engine import memory

    # The smallest VRAM budget that runs streams every block: planned first, to size the host need.
    probe = _file_engine(builders, int8_dit, vram_budget=100 * memory.GB, plan_rows=4096).load(["t2va"])
    need = memory.plan_dit(probe.components.dit, None, 4096)
    need.resident_blocks, need.adaln_on_host = 0, True
    budget = memory.budget_for(need.device_bytes + max(0, max(probe.stage_reserve.values()) - need.activations))
    engine = _file_engine(builders, int8_dit, vram_budget=budget, plan_rows=4096, host_budget=1000)
    with pytest.raises(InputError, match=r"^the host memory budget of 0.0 MB is below what the models hold in host "
                                         r"memory under this VRAM budget, [\d.]+ [MG]B: [\d.]+ [MG]B of streamed DiT "
                                         r"blocks \(page-locked\), .* raise --host-budget, or raise --vram-budget"):
        engine.load(["t2va"])
    assert engine.components.dit.block_stream is None  # nothing was packed


def test_the_dits_activations_and_the_other_stages_take_turns_in_the_budget():
    """The text encode and the VAE decode run while the DiT's weights stay but its activations are gone: the
    DiT's plan is fitted to the budget less only what those stages need beyond its activations."""
    from h3_spark.h3_model.engine.memory import dit_budget

    gb = 10 ** 9
    assert dit_budget(16 * gb, 9 * gb, 6 * gb) == 13 * gb  # the decode needs 3 GB more than sampling's activations
    assert dit_budget(16 * gb, 4 * gb, 6 * gb) == 16 * gb  # smaller than the activations: nothing more to leave
    assert dit_budget(16 * gb, 0, 6 * gb) == 16 * gb


def test_the_spare_room_beside_resident_dits_keeps_the_vaes_then_the_text_encoder():
    """keep_on_device, on hand-worked sizes (GB): whatever is kept stays through every stage, and the stages take
    turns beside it (sampling's activations, the decode beyond what is kept, the text encode beyond its kept
    layers)."""
    from h3_spark.h3_model.engine.memory import TextSizes, keep_on_device

    gb = 10 ** 9
    # 4 layers of 2 GB; streamed, an encode needs 3 GB outside the layers and 2 slots of 2 GB while 2 or more layers
    # stream (7, 7, 7, 5, 3 for k = 0..4 kept); whole: 11 GB of weights and 1 GB beyond them.
    text = TextSizes([2 * gb] * 4, lambda k: 3 * gb + min(2, 4 - k) * 2 * gb, (11 * gb, gb))
    vaes = dict(activations=6 * gb, vae_weights=6 * gb, vae_stage=(9 * gb, 3 * gb))
    # 40 GB: VAEs (6) and the whole encoder (11) beside the largest stage (activations, 6) = 23.
    k = keep_on_device(40 * gb, text=text, **vaes)
    assert (k.vaes, k.text_whole, k.kept_bytes, k.peak_bytes) == (True, True, 17 * gb, 23 * gb)
    # 20 GB: VAEs, then layers while 6 + 2k + max(6, 3, stage(k)) <= 20: k = 4 gives 14 + 6 = 20 (stage(4) = 3).
    k = keep_on_device(20 * gb, text=text, **vaes)
    assert (k.vaes, k.text_whole, k.text_layers, k.peak_bytes) == (True, False, 4, 20 * gb)
    # 15 GB: k = 1 gives 6 + 2 + max(6, 3, 7) = 15; k = 2 gives 6 + 4 + 7 = 17.
    k = keep_on_device(15 * gb, text=text, **vaes)
    assert (k.vaes, k.text_layers, k.peak_bytes) == (True, 1, 15 * gb)
    # 12 GB: the VAEs alone need 6 + max(6, 3, 7) = 13; without them one layer fits, 2 + max(6, 9, 7) = 11.
    k = keep_on_device(12 * gb, text=text, **vaes)
    assert (k.vaes, k.text_whole, k.text_layers, k.kept_bytes) == (False, False, 1, 2 * gb)
    k = keep_on_device(10 * gb, text=text, **vaes)
    assert (k.vaes, k.text_layers, k.kept_bytes) == (False, 0, 0)
    # No text encoder (the DiT and VAEs of a decode-only engine) and no VAEs.
    assert keep_on_device(13 * gb, text=None, **vaes).vaes
    assert not keep_on_device(13 * gb, 6 * gb, 0, (0, 0), None).vaes


def test_weights_held_on_the_host_come_back_without_a_copy():
    """streaming.hold_on_host / place_held: after a visit elsewhere (stood in for by fresh tensors: the meta device
    cannot take `.data`), placing on the host points the held child's tensors at the very host copies again; the
    skipped child is not touched. tests/test_gpu_streaming.py visits a real GPU."""
    from h3_spark.h3_model.dit.streaming import hold_on_host, place_held

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4)))
    model.register_buffer("scale", torch.randn(4))
    outside = lambda: (model[0].weight, model[0].bias, model.scale)  # noqa: E731
    want = [t.clone() for t in outside()]
    held = hold_on_host(model, "1", pin=False)
    assert [(type(o).__name__, n, p) for o, n, p, _ in held] == [("Sequential", "scale", False),
                                                                  ("Linear", "weight", True), ("Linear", "bias", True)]
    inner = model[1][0].weight
    model[0].weight.data, model[0].bias.data = torch.zeros(4, 4), torch.zeros(4)  # what a visit leaves in place
    model._buffers["scale"] = torch.zeros(4)
    place_held(held, "cpu")
    assert {t.data_ptr() for t in outside()} == {h.data_ptr() for *_, h in held}
    assert all(torch.equal(a, b) for a, b in zip(outside(), want)) and model[1][0].weight is inner


def test_weights_held_page_locked_share_one_buffer(monkeypatch):
    """pin: every held tensor is a view of one buffer (one registration; plain memory stands in for pinned_buffer
    on the CPU), each aligned, with the values it had."""
    from h3_spark.h3_model.dit import streaming

    made = []
    monkeypatch.setattr(streaming, "pinned_buffer",
                        lambda n: made.append(torch.empty(n, dtype=torch.uint8)) or made[-1])
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 7))
    model.register_buffer("steps", torch.arange(3))
    want = {name: t.clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    held = streaming.hold_on_host(model, None, pin=True)
    assert len(made) == 1 and len(held) == len(want)
    base = made[0].data_ptr()
    for _, _, _, host in held:
        assert host.untyped_storage().data_ptr() == base and (host.data_ptr() - base) % streaming.ALIGN == 0
    streaming.place_held(held, "cpu")
    got = dict([*model.named_parameters(), *model.named_buffers()])
    assert all(torch.equal(got[name], value) and got[name].dtype == value.dtype for name, value in want.items())
    assert {t.data_ptr() for t in got.values()} == {h.data_ptr() for *_, h in held}


def test_moving_a_model_but_its_kept_layers():
    """TextEncoder.move's helper: everything moves but the kept submodules (the meta device stands for the GPU)."""
    from h3_spark.h3_model.dit.streaming import move_except

    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), inner)
    model.register_buffer("scale", torch.randn(4))
    kept = [model[1][0]]
    move_except(model, "meta", kept)
    assert model[1][0].weight.device.type == "cpu" and model[1][0].bias.device.type == "cpu"
    assert {t.device.type for t in [model[0].weight, model[1][1].weight, model.scale]} == {"meta"}
    move_except(model, "meta", [])
    assert model[1][0].weight.device.type == "meta"


def _one_text_layer_budget(roomy: Engine) -> int:
    """A budget with the VAEs and exactly one text layer of room beside the DiT's weights, from an engine that kept
    everything."""
    from h3_spark.h3_model.engine import memory

    plan = roomy.memory_plans["dit"]
    te, vaes = roomy.components.text_encoder, [roomy.components.vae, roomy.components.audio_vae]
    kept = sum(memory.tensor_bytes(m) for m in vaes) + memory.text_layer_bytes(te)[0]
    stages = max(plan.activations, memory.vae_stage_bytes(*vaes, kept=True),
                 memory.text_stage_bytes(te, 2, kept_layers=1))
    room = plan.device_bytes - plan.activations + kept + stages
    return memory.budget_for(room) + memory.SLACK_MIN  # the kept room leaves a second slack (tiny: the minimum)


def test_a_budget_with_room_to_spare_keeps_the_vaes_and_text_layers_and_generates_the_same(builders):
    """The engine on the CPU (budget emulated) with the DiT resident whole and room for the VAEs and some of the text
    encoder's layers: the rest of the encoder streams, and the generation equals the resident engine's bit for bit."""
    from h3_spark.h3_model.engine import memory
    from h3_spark.h3_model.pipeline.generation import GenerationRequest

    req = GenerationRequest(mode="t2va", prompt="a boat", width=64, height=64, frames=124, steps=3)
    resident = _engine(builders).load(["t2va"])
    want = resident.generate(req)

    def engine(budget):
        return Engine(options=LoadOptions(device="cpu", dtype=torch.float32, vae_dtype=torch.float32, text_layer=2,
                                          kernels=REFERENCE_KERNELS, vram_budget=budget, plan_rows=4096),
                      overrides=builders)

    roomy = engine(100 * memory.GB).load(["t2va"])
    assert roomy.kept_on_device.vaes and roomy.kept_on_device.text_whole
    assert roomy.components.text_encoder.layer_stream is None and not roomy.pipeline.offload_text_encoder
    layers = memory.text_layer_bytes(roomy.components.text_encoder)
    budget = _one_text_layer_budget(roomy)
    got_engine = engine(budget).load(["t2va"])
    k = got_engine.kept_on_device
    assert k.vaes and not k.text_whole and k.text_layers == 1 and k.peak_bytes <= budget - memory.slack(budget)
    got_te = got_engine.components.text_encoder
    assert got_te.kept_layers == 1 and got_te.layer_stream.order == list(range(1, len(layers)))
    assert got_engine.pipeline.offload_text_encoder and got_engine.pipeline.visit.parked == []
    got = got_engine.generate(req)
    assert torch.equal(got.video_latents, want.video_latents) and torch.equal(got.audio_latents, want.audio_latents)
    report = got_engine.memory_report("dit")
    assert report["kept_on_device"]["text_encoder"] == f"1 of {len(layers)} layers" and report["streamed_blocks"] == 0


def test_a_request_whose_activations_need_the_spare_room_takes_it_back(builders, monkeypatch):
    """Long requests (a film's windows) on an engine that kept the VAEs and the text encoder on the GPU: before one
    samples, the engine streams every text layer again, and parks the VAEs too only when that is not room enough;
    the report says which request did it, and the engine still generates the resident engine's latents bit for
    bit."""
    from h3_spark.h3_model.engine import memory
    from h3_spark.h3_model.pipeline.generation import GenerationRequest

    req = GenerationRequest(mode="t2va", prompt="a boat", width=64, height=64, frames=124, steps=3)
    want = _engine(builders).load(["t2va"]).generate(req)
    engine = Engine(options=LoadOptions(device="cpu", dtype=torch.float32, vae_dtype=torch.float32, text_layer=2,
                                        kernels=REFERENCE_KERNELS, vram_budget=100 * memory.GB, plan_rows=4096),
                    overrides=builders).load(["t2va"])
    keep, plan, dit = engine.kept_on_device, engine.memory_plans["dit"], engine.components.dit
    te, vaes = engine.components.text_encoder, [engine.components.vae, engine.components.audio_vae]
    vae_bytes = sum(memory.tensor_bytes(m) for m in vaes)
    assert keep.vaes and keep.text_whole and keep.text_bytes == memory.tensor_bytes(te.model) > 0
    assert keep.kept_bytes == vae_bytes + keep.text_bytes
    # Activations the plan's DiT budget still takes (the tiny model's own are bytes: stand-ins for a long window).
    limit = plan.budget - memory.slack(plan.budget) - (plan.device_bytes - plan.activations)
    text_short = keep.room_bytes - keep.kept_bytes + 1  # room enough once the text encoder streams
    vae_short = keep.room_bytes - vae_bytes + 1  # not even then
    assert text_short <= keep.room_bytes - vae_bytes < vae_short <= limit
    real = memory.activation_bytes

    def activations(need):
        monkeypatch.setattr(memory, "activation_bytes",
                            lambda config, rows, *a, **k: need if rows > plan.rows else real(config, rows, *a, **k))

    activations(text_short)
    engine._check_rows(dit, plan.rows)  # the planned length keeps the room
    assert engine.kept_on_device is keep
    engine._check_rows(dit, plan.rows + 1)
    now = engine.kept_on_device
    assert (now.vaes, now.text_whole, now.text_layers, now.kept_bytes) == (True, False, 0, vae_bytes)
    assert te.kept_layers == 0 and te.layer_stream.order == list(range(len(te.model.language_model.layers)))
    assert engine.pipeline.offload_text_encoder and engine.pipeline.visit.parked == []
    assert engine.memory_report("dit")["kept_on_device"]["why"] == (
        f"given back: a request of {plan.rows + 1} rows needs the room for its activations")
    activations(vae_short)
    engine._check_rows(dit, plan.rows + 2)
    now = engine.kept_on_device
    assert (now.vaes, now.kept_bytes) == (False, 0) and engine.pipeline.visit.parked == vaes
    monkeypatch.setattr(memory, "activation_bytes", real)
    got = engine.generate(req)
    assert torch.equal(got.video_latents, want.video_latents) and torch.equal(got.audio_latents, want.audio_latents)
    # Too long for the DiT's own budget: refused as before.
    monkeypatch.setattr(memory, "activation_bytes", lambda *a, **k: 2 * limit)
    with pytest.raises(InputError, match="this request packs"):
        engine._check_rows(dit, plan.rows + 1)


def test_the_text_layers_are_pinned_when_the_host_has_room(monkeypatch):
    """memory.text_pinning on hand-worked sizes (GB): 4 layers of 2 GB, 10 GB held on the host already."""
    from h3_spark.h3_model.engine import memory

    gb = 10 ** 9
    monkeypatch.setattr(memory, "text_layer_bytes", lambda te: [2 * gb] * 4)
    pin = memory.text_pinning(None, "auto", 10 * gb, None, 16 * gb)  # 16 - 8 leaves the 8 GB headroom
    assert pin.pinned and pin.describe() == {
        "pinned": True, "layer_bytes": 8 * gb, "available_bytes": 16 * gb,
        "why": "16.00 GB available on the host holds 8.00 GB of text layers with 8.00 GB to spare"}
    pin = memory.text_pinning(None, "auto", 10 * gb, None, 16 * gb - 1)
    assert not pin.pinned and pin.why == ("16.00 GB available on the host, not 8.00 GB of text layers and 8.00 GB to "
                                          "spare: copied from pageable memory")
    assert memory.text_pinning(None, "auto", 10 * gb, 18 * gb, 16 * gb).pinned  # 10 + 8 within the host budget
    pin = memory.text_pinning(None, "auto", 10 * gb, 18 * gb - 1, 16 * gb)
    assert not pin.pinned and pin.why == ("the host budget of 18.00 GB holds 10.00 GB already, not 8.00 GB more of "
                                          "text layers: copied from pageable memory")
    pin = memory.text_pinning(None, "auto", 10 * gb, None, None)
    assert not pin.pinned and pin.why == "the host's available memory is unknown: copied from pageable memory"
    assert memory.text_pinning(None, "on", 10 * gb, None, gb).pinned  # on: whatever is available
    with pytest.raises(InputError, match=r"^H3_TEXT_PIN=on: the host budget of 12.00 GB holds 10.00 GB already, not "
                                         r"8.00 GB more of text layers; raise --host-budget or set H3_TEXT_PIN=auto$"):
        memory.text_pinning(None, "on", 10 * gb, 12 * gb, 100 * gb)
    pin = memory.text_pinning(None, "off", 0, None, 100 * gb)
    assert not pin.pinned and pin.why == "off (H3_TEXT_PIN=off): copied from pageable memory"


def test_the_text_pin_variable(monkeypatch):
    from h3_spark.h3_model.engine.flags import text_pin

    assert text_pin({}) == "auto" and text_pin({"H3_TEXT_PIN": " ON "}) == "on" and text_pin({"H3_TEXT_PIN": ""}) == "auto"
    with pytest.raises(InputError, match=r"^H3_TEXT_PIN must be one of auto, on, off, got 'pinned'$"):
        text_pin({"H3_TEXT_PIN": "pinned"})
    monkeypatch.setenv("H3_TEXT_PIN", "off")
    assert text_pin() == "off"


def test_streamed_text_layers_go_into_packed_host_buffers_when_the_host_has_room(builders, monkeypatch):
    """A budget that streams the text encoder's layers: with room on the host they are packed (page-locked on CUDA;
    plain buffers stand in on the CPU) after the DiT is placed, the host plan counts them, and the engine still
    generates the resident engine's latents bit for bit, also after the spare room is given back (every layer then
    packed). Off, or without room, they stream in place and the plan says why."""
    from h3_spark.h3_model.engine import host_memory, memory
    from h3_spark.h3_model.pipeline.generation import GenerationRequest

    req = GenerationRequest(mode="t2va", prompt="a boat", width=64, height=64, frames=124, steps=3)
    want = _engine(builders).load(["t2va"]).generate(req)

    def engine(budget, pin, threads=0):
        return Engine(options=LoadOptions(device="cpu", dtype=torch.float32, vae_dtype=torch.float32, text_layer=2,
                                          kernels=REFERENCE_KERNELS, vram_budget=budget, plan_rows=4096,
                                          text_pin=pin, read_threads=threads), overrides=builders)

    roomy = engine(100 * memory.GB, "auto").load(["t2va"])
    budget, layers = _one_text_layer_budget(roomy), memory.text_layer_bytes(roomy.components.text_encoder)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 1000 * memory.GB)
    pinned = engine(budget, "auto").load(["t2va"])
    te = pinned.components.text_encoder
    stream, host = te.layer_stream, pinned.host_plan
    assert pinned.load_seconds["placement"] >= 0 and "placement" not in _engine(builders).load().load_seconds
    assert not stream.in_place and stream.host_bytes == sum(layers[1:]) and te.kept_layers == 1
    assert host["text_layers"]["pinned"] and host["text_layers"]["layer_bytes"] == sum(layers)
    assert host["text_layers_pinned_bytes"] == stream.host_bytes
    parts = ("dit_streamed_bytes", "text_encoder_outside_layers_bytes", "parked_vaes_bytes", "text_layers_pinned_bytes")
    assert host["held_bytes"] == sum(host[k] for k in parts)
    # The encoder outside its layers stays on the host for good: after an encode, its tensors are the held copies.
    held = {id(host): host for *_, host in te._held}
    outside = [t for name, t in [*te.model.named_parameters(), *te.model.named_buffers()]
               if not name.startswith("language_model.layers.")]
    assert host["text_layers"]["outside_layers_held_bytes"] == sum(t.numel() * t.element_size() for t in outside) > 0
    got = pinned.generate(req)
    assert torch.equal(got.video_latents, want.video_latents) and torch.equal(got.audio_latents, want.audio_latents)
    outside = [t for name, t in [*te.model.named_parameters(), *te.model.named_buffers()]
               if not name.startswith("language_model.layers.")]
    assert {t.data_ptr() for t in outside} == {h.data_ptr() for h in held.values()}
    pinned._give_back_kept("a long request", 0)
    assert te.kept_layers == 0 and not te.layer_stream.in_place and te.layer_stream.host_bytes == sum(layers)
    assert pinned.host_plan["text_layers_pinned_bytes"] == sum(layers)
    assert pinned.host_plan["held_bytes"] == sum(pinned.host_plan[k] for k in parts)
    got = pinned.generate(req)
    assert torch.equal(got.video_latents, want.video_latents) and torch.equal(got.audio_latents, want.audio_latents)

    off = engine(budget, "off").load(["t2va"])
    assert off.components.text_encoder.layer_stream.in_place and off.host_plan["text_layers_pinned_bytes"] == 0
    assert off.components.text_encoder._held is None
    assert off.host_plan["text_layers"]["why"] == "off (H3_TEXT_PIN=off): copied from pageable memory"
    unread = engine(budget, "off").load(["t2va"])  # the default: no reader
    assert unread.host_plan["text_layers"]["read_ahead"] == {
        "threads": 0, "why": "H3_READ_THREADS=0: the kernel reads the next layer ahead (madvise)"}
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 0)
    cramped = engine(budget, "auto", threads=8).load(["t2va"])
    assert cramped.components.text_encoder.layer_stream.in_place
    assert cramped.host_plan["text_layers"]["why"].startswith("0.0 MB available on the host, not ")
    # Streamed in place, its layers are read ahead by a page reader, one layer beyond the slots on a full host.
    ahead = cramped.host_plan["text_layers"]["read_ahead"]
    assert (ahead["threads"], ahead["window_layers"]) == (8, 1) and cramped.components.text_encoder.layer_stream.reader
    assert ahead["why"].startswith("0.0 MB available on the host holds 1 of ")
    # Waiting as a service idles after its load: the primed units (depth 2 + window 1) are read, and /ready's
    # report says so live while the plan stays as it was made.
    stream = cramped.components.text_encoder.layer_stream
    primed = stream.order[:min(len(stream.order), 3)]
    waited = cramped.wait_text_read_ahead()
    assert (waited["layers_read"], waited["layers_reading"], waited["threads"]) == (len(primed), 0, 8)
    assert waited["bytes_read"] == sum(t.numel() * t.element_size() for i in primed for t in stream.units[i].sources)
    assert waited["waited_s"] >= 0
    live = cramped.memory_report("dit")["host"]["text_layers"]["read_ahead"]
    assert live == {k: v for k, v in waited.items() if k != "waited_s"}
    assert cramped.host_plan["text_layers"]["read_ahead"] == ahead
    assert load_benchmark("consumer_box_gpu").idle_until_read(cramped)["layers_read"] == len(primed)
    assert unread.text_read_ahead() is None and unread.wait_text_read_ahead() is None
    assert "layers_read" not in unread.memory_report("dit")["host"]["text_layers"]["read_ahead"]
    got = cramped.generate(req)
    assert torch.equal(got.video_latents, want.video_latents)
    # A give-back streams the kept layer too, in place as before: the new stream is weighed for a reader again.
    assert cramped.components.text_encoder.kept_layers == 1
    del cramped.host_plan["text_layers"]["read_ahead"]
    cramped._give_back_kept("a long request", 0)
    assert cramped.components.text_encoder.kept_layers == 0
    assert cramped.host_plan["text_layers"]["read_ahead"]["threads"] == 8
    assert cramped.components.text_encoder.layer_stream.reader is not None
    got = cramped.generate(req)
    assert torch.equal(got.video_latents, want.video_latents)


def test_a_controlnet_tower_takes_the_spare_room(builders, tmp_path):
    """The tower's blocks run in every evaluation of its window, the kept models' once a stage: checked before the
    load, nothing is kept beside the DiTs; loaded onto an engine that kept the VAEs and the text encoder, it takes
    that room back before its own plan is made."""
    from h3_spark.h3_model.checkpoint.controlnet import random_getter, synthetic_config, write_controlnet
    from h3_spark.h3_model.engine import memory

    def engine():
        return Engine(options=LoadOptions(device="cpu", dtype=torch.float32, vae_dtype=torch.float32, text_layer=2,
                                          kernels=REFERENCE_KERNELS, vram_budget=100 * memory.GB, plan_rows=4096),
                      overrides=builders)

    config = synthetic_config(builders["dit"]().config, union2=False, comfy=False)
    path = tmp_path / "controlnet.safetensors"
    write_controlnet(path, config, random_getter(config, 5), "released")
    checked = engine()
    checked.check_controlnet(path, ["t2va"])
    checked.load(["t2va"])
    assert checked.kept_on_device.kept_bytes == 0
    assert checked.kept_on_device.why == "nothing: the ControlNet tower takes the room beside the DiTs"
    assert checked.pipeline.visit.parked == [checked.components.vae, checked.components.audio_vae]
    late = engine().load(["t2va"])
    assert late.kept_on_device.vaes and late.kept_on_device.text_whole
    late.load_controlnet(path)
    assert (late.kept_on_device.vaes, late.kept_on_device.kept_bytes) == (False, 0)
    assert late.kept_on_device.why == "given back: a ControlNet tower takes the room beside the DiTs"
    assert late.components.controlnet is not None and late.components.text_encoder.layer_stream is not None
