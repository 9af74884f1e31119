"""Block streaming under a VRAM budget: the plan, its errors, and forwards bit-identical to resident ones.

The budget is emulated on the CPU: the same planner and the same BlockStream (host buffers, slots, views that
come and go per block) run with synchronous copies. tests/test_gpu_streaming_budget.py runs it on a GPU.
"""

import dataclasses

import pytest
import torch

from h3_spark.errors import InputError
from h3_spark.h3_model.dit import layout
from h3_spark.h3_model.dit.config import TINY
from h3_spark.h3_model.engine import memory
from h3_spark.h3_model.engine.placement import place_dit
from h3_spark.h3_model.pipeline.scheduler import CONDITION_VIDEO_T
from h3_spark.measure.synthetic import synthetic_dit
from oracle import text_tags


CONFIG = dataclasses.replace(TINY, num_layers=4)  # room for resident and streamed blocks side by side


def _model(seed=3):
    return synthetic_dit(CONFIG, torch.float32, "cpu", seed=seed)


@pytest.fixture(scope="module")
def inputs():
    lay = layout.build_t2va(text_tags(10, (1, 6)), 7, 4, 6, 12, CONFIG.patch_size)
    gen = torch.Generator().manual_seed(5)
    ts, idx = lay.row_timesteps(0.3, 0.6, CONDITION_VIDEO_T)
    return dict(hidden_states=torch.randn(1, lay.video_indices.numel(), TINY.video_patch_dim, generator=gen),
                audio_hidden_states=torch.randn(1, lay.audio_indices.numel(), TINY.audio_in_channels, generator=gen),
                encoder_hidden_states=torch.randn(1, lay.num_text, TINY.text_dim, generator=gen),
                token_tags=lay.token_tags, position_ids=lay.position_ids.float(), video_indices=lay.video_indices,
                audio_indices=lay.audio_indices, text_indices=lay.text_indices, timestep=ts, timestep_indices=idx)


def _budget_for(model, resident_blocks: int, rows: int = 64, depth: int = 2) -> int:
    """The smallest budget that keeps exactly `resident_blocks` blocks resident."""
    plan = memory.plan_dit(model, None, rows, depth=depth)
    plan.resident_blocks, plan.adaln_on_host = resident_blocks, True
    return memory.budget_for(plan.device_bytes)


@pytest.mark.parametrize("resident", [0, 1, 2])
def test_streamed_forward_is_bit_identical(inputs, resident):
    resident_model, streamed_model = _model(), _model()
    budget = _budget_for(streamed_model, resident)
    plan = memory.plan_dit(streamed_model, budget, 64)
    assert plan.resident_blocks == resident and plan.streamed == list(range(resident, CONFIG.num_layers))
    stream = place_dit(streamed_model, plan, "cpu")
    with torch.no_grad():
        want = resident_model(**inputs)
        for _ in range(3):  # the wrap-around prefetch serves the next forward
            got = streamed_model(**inputs)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    streamed_blocks = CONFIG.num_layers - resident
    assert stream.stats.forwards == 3 and stream.stats.copies >= 3 * streamed_blocks
    # Between turns a streamed block holds no weights: a stray use fails instead of reading another block's.
    block = streamed_model.transformer_blocks[resident]
    assert block.attn.to_q.weight.numel() == 0


def test_adaln_tables_and_their_release_under_streaming(inputs):
    a, b = _model(), _model()
    place_dit(b, memory.plan_dit(b, _budget_for(b, 0), 64), "cpu")
    values = [*inputs["timestep"].flatten().tolist(), 1.0]
    with torch.no_grad():
        a.precompute_modulation(values)
        b.precompute_modulation(values)
        for v in values:
            assert all(torch.equal(x, y) for x, y in zip(a._modulation_cache[v][0], b._modulation_cache[v][0]))
        host_before = b.block_stream.host_bytes
        freed = b.release_adaln()
        a.release_adaln()
        assert freed > 0 and b.block_stream.host_bytes < host_before
        got, want = b(**inputs), a(**inputs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_everything_resident_when_it_fits():
    model = _model()
    plan = memory.plan_dit(model, 10 * memory.GB, 64)
    assert plan.streamed == [] and place_dit(model, plan, "cpu") is None and model.block_stream is None


def test_a_budget_below_one_streamed_forward_names_the_minimum():
    model = _model()
    minimum = _budget_for(model, 0)
    with pytest.raises(InputError, match=r"below what a streamed DiT forward needs, [\d.]+ [GM]B: .* 2 block slots .*allocator slack; .*--prefetch-depth"):
        memory.plan_dit(model, minimum - 1, 64)
    assert memory.plan_dit(model, minimum, 64).resident_blocks == 0


def test_a_longer_request_than_planned_is_checked():
    model = _model()
    plan = memory.plan_dit(model, _budget_for(model, 0, rows=64), 64)
    memory.check_rows(plan, model.config, 64, torch.float32)
    with pytest.raises(InputError, match="this request packs 100000 rows"):
        memory.check_rows(plan, model.config, 100000, torch.float32)


@pytest.mark.parametrize("text, value", [("24", 24 * 10 ** 9), ("24GB", 24 * 10 ** 9), ("22.5 GiB", int(22.5 * 2 ** 30)),
                                         ("800MB", 800 * 10 ** 6), ("", None), (None, None), ("Auto", "auto")])
def test_budget_sizes(text, value):
    assert memory.parse_budget(text) == value


@pytest.mark.parametrize("text, message", [("lots", "is not a size; use auto, or a size in GB: 24, 24GB"),
                                           ("0", "must be positive"), ("-3", "is not a size"),
                                           ("24 TB", "is not a size")])
def test_bad_budgets(text, message):
    with pytest.raises(InputError, match=message):
        memory.parse_budget(text)


def test_all_blocks_resident_with_the_adaln_projections_in_host_memory(inputs):
    """A budget that holds every block's forward weights but not the AdaLN projections too: the blocks stay, the
    projections wait in host memory and visit only for the tables; no forward copies anything."""
    resident_model, model = _model(), _model()
    budget = _budget_for(model, CONFIG.num_layers)
    plan = memory.plan_dit(model, budget, 64)
    assert plan.resident_blocks == CONFIG.num_layers and plan.adaln_on_host and plan.streamed == []
    stream = place_dit(model, plan, "cpu")
    values = inputs["timestep"].flatten().tolist()
    with torch.no_grad():
        model.precompute_modulation(values)
        resident_model.precompute_modulation(values)
        got, want = model(**inputs), resident_model(**inputs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert stream.stats.forwards == 1 and stream.stats.bytes_copied == 0 and stream.stats.adaln_bytes_copied > 0


def test_auto_is_resident_when_the_files_fit_and_a_budget_of_the_free_memory_when_not():
    assert memory.auto_budget(10 * memory.GB, 24 * memory.GB) is None
    assert memory.auto_budget(30 * memory.GB, 24 * memory.GB) == int(24 * memory.GB * memory.AUTO_FREE_FRACTION)
    assert memory.auto_budget(None, 24 * memory.GB) is None  # components built in memory: nothing to size


def test_planned_bytes_come_from_the_files(tmp_path):
    from h3_spark.h3_model.checkpoint.dit_config import logical_param_count
    from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint
    from h3_spark.h3_model.engine.loading import LoadOptions
    from h3_spark.h3_model.vae.synthetic import write_vae_checkpoint

    make_dit_checkpoint(tmp_path / "transformer", CONFIG, "bf16", "diffusers", seed=0)
    vae = write_vae_checkpoint(tmp_path / "vae", "tiny", "diffusers", seed=0)
    options = LoadOptions(dtype=torch.bfloat16)
    need = memory.planned_bytes({"dit": tmp_path / "transformer", "vae": vae}, options)
    from h3_spark.h3_model.vae.loading import load_video_vae
    from h3_spark.h3_model.vae.video import parameter_bytes

    # bf16 weights but the fp32 islands (patch embeddings, time MLP, heads), which load in fp32.
    from h3_spark.h3_model.checkpoint import load_dit

    loaded = load_dit(tmp_path / "transformer", dtype=torch.bfloat16)
    dit = sum(p.numel() * p.element_size() for p in loaded.parameters())
    assert dit > logical_param_count(CONFIG) * 2
    video = parameter_bytes(load_video_vae(vae).config, torch.float16)  # fp32 encoder, fp16 decoder
    assert need == dit + video + memory.activation_bytes(CONFIG, memory.default_rows(CONFIG), torch.bfloat16)
    # An int8 file is planned at its stored bytes (plus the dequantization scratch), not at bf16's.
    make_dit_checkpoint(tmp_path / "int8.safetensors", CONFIG, "int8_convrot", "comfy", seed=0)
    stored = load_dit(tmp_path / "int8.safetensors", dtype=torch.bfloat16, stored=True)
    from h3_spark.kernels.stored_linear import scratch_bytes

    held = sum(t.numel() * t.element_size() for t in [*stored.parameters(), *stored.buffers()])
    weights = memory.planned_bytes({"dit": tmp_path / "int8.safetensors"}, options) - memory.activation_bytes(
        CONFIG, memory.default_rows(CONFIG), torch.bfloat16)
    assert held < dit and held <= weights <= held + scratch_bytes(stored)
    assert memory.planned_bytes({"dit": lambda: None}, options) is None


def test_the_front_doors_default_to_auto(monkeypatch):
    from h3_spark.h3_model.engine.flags import vram_budget

    monkeypatch.delenv("H3_VRAM_BUDGET", raising=False)
    assert vram_budget(None) == "auto" and vram_budget(None, default=None) is None
    monkeypatch.setenv("H3_VRAM_BUDGET", "32")
    assert vram_budget(None) == 32 * memory.GB and vram_budget("24GB") == 24 * memory.GB
    monkeypatch.setenv("H3_VRAM_BUDGET", "much")
    with pytest.raises(InputError, match="H3_VRAM_BUDGET 'much' is not a size"):
        vram_budget(None)


def test_text_encoder_bytes_count_the_layers_it_keeps(tmp_path):
    import json

    from safetensors.torch import save_file

    save_file({"w": torch.randn(1000)}, str(tmp_path / "model.safetensors"))
    size = (tmp_path / "model.safetensors").stat().st_size
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 64}}))
    assert memory._text_encoder_bytes(tmp_path, 50) == size * 50 // 64
    assert memory._text_encoder_bytes(tmp_path, 80) == size
    assert memory._text_encoder_bytes(tmp_path / "model.safetensors", 50) == size  # a lone file: all of it


def test_a_parked_module_visits_from_its_one_host_copy_and_leaves_without_a_copy(monkeypatch):
    """Visits: a parked module's tensors are its host copies between visits; a visit places them on the device
    once (a nested visit of the same module places nothing, and the module stays there until the outer visit
    ends), its end points the module at the same host copies again, values untouched (nothing copied back); a
    module never parked does not move. The placements are counted here (this machine has one device; the GPU
    test moves them)."""
    from h3_spark.h3_model.engine.memory import Visits

    placed = []
    real = memory.place_held
    monkeypatch.setattr(memory, "place_held", lambda held, device: placed.append(str(device)) or real(held, device))
    torch.manual_seed(3)
    parked = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.LayerNorm(8))
    parked.register_buffer("table", torch.randn(5))
    other = torch.nn.Linear(4, 4)
    want = {k: v.clone() for k, v in parked.state_dict().items()}
    visits = Visits("cpu")
    visits.park(parked)
    host = {k: v.data_ptr() for k, v in parked.state_dict().items()}
    assert visits.parked == [parked] and placed == ["cpu"]
    for _ in range(2):
        placed.clear()
        with visits(parked) as module, visits(other):
            assert module is parked and placed == ["cpu"]
            with visits(parked):
                pass
            assert placed == ["cpu"]  # the outer visit still holds it
        assert placed == ["cpu", "cpu"]
        assert {k: v.data_ptr() for k, v in parked.state_dict().items()} == host
        assert all(torch.equal(parked.state_dict()[k], v) for k, v in want.items())
    visits.park(parked)  # parked again (a kept module given back): still one entry
    assert visits.parked == [parked]
