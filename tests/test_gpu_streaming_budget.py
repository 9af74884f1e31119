"""On a GPU: forwards with blocks streamed under a VRAM budget are bit-identical to resident ones.

Real side-stream copies from pinned host memory, events between the streams, the exact kernels `auto` picks
here (and the FP8 linears where the GPU has them); a model of 8 blocks at 1/4 of the released width, so the
copies overlap real GEMMs.
"""

import dataclasses

import pytest
import torch

from h3_spark.h3_model.dit import layout
from h3_spark.h3_model.dit.config import FULL
from h3_spark.h3_model.engine import memory
from h3_spark.h3_model.engine.placement import place_dit
from h3_spark.h3_model.pipeline.scheduler import CONDITION_VIDEO_T
from h3_spark.h3_model.engine.kernel_plan import apply_kernels
from h3_spark.kernels.settings import KernelSettings
from h3_spark.measure.synthetic import synthetic_dit
from oracle import text_tags

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CONFIG = dataclasses.replace(FULL, num_layers=8, num_attention_heads=14, hidden_size=1344, ffn_dim=3584,
                             time_embed_hidden_dim=1344, time_embed_dim=672)


def _inputs():
    lay = layout.build_t2va(text_tags(64, (1, 6)), 12, 16, 28, 80, CONFIG.patch_size)
    gen = torch.Generator().manual_seed(5)
    ts, idx = lay.row_timesteps(0.3, 0.6, CONDITION_VIDEO_T)
    cpu = dict(hidden_states=torch.randn(1, lay.video_indices.numel(), CONFIG.video_patch_dim, generator=gen),
               audio_hidden_states=torch.randn(1, lay.audio_indices.numel(), CONFIG.audio_in_channels, generator=gen),
               encoder_hidden_states=torch.randn(1, lay.num_text, CONFIG.text_dim, generator=gen),
               token_tags=lay.token_tags, position_ids=lay.position_ids.float(), video_indices=lay.video_indices,
               audio_indices=lay.audio_indices, text_indices=lay.text_indices, timestep=ts, timestep_indices=idx)
    out = {k: v.cuda() for k, v in cpu.items()}
    for k in ("hidden_states", "audio_hidden_states", "encoder_hidden_states"):
        out[k] = out[k].bfloat16()
    return out, lay.sequence_length


@pytest.mark.parametrize("linear", ["bf16", "fp8"])
@pytest.mark.parametrize("resident", [0, 3])
def test_streamed_forward_equals_resident_on_the_gpu(linear, resident):
    if linear == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 linears need sm_89 or newer")
    settings = KernelSettings(linear=linear)
    inputs, rows = _inputs()
    a = synthetic_dit(CONFIG, torch.bfloat16, "cuda", seed=1)
    b = synthetic_dit(CONFIG, torch.bfloat16, "cuda", seed=1)
    apply_kernels(a, settings)
    apply_kernels(b, settings)
    plan = memory.plan_dit(b, None, rows)
    plan.resident_blocks, plan.adaln_on_host = resident, True
    stream = place_dit(b, plan, "cuda")
    with torch.no_grad():
        want = a(**inputs)
        for _ in range(3):
            got = b(**inputs)
            torch.cuda.synchronize()
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert stream.stats.forwards == 3 and stream.stats.copies >= 3 * (CONFIG.num_layers - resident)
    assert stream.units[resident].pinned and _registered(stream.units[resident].host)


@pytest.mark.parametrize("resident", [0, 2])
def test_a_streamed_controlnet_tower_equals_the_resident_one_on_the_gpu(resident):
    """Beside a streamed DiT (two BlockStreams, each with its own copy stream), the control tower's blocks stream
    through their own slots: the same velocities, bit for bit, forward after forward."""
    import copy

    from h3_spark.h3_model.controlnet.tower import ControlInjection, ControlTower, config_for
    from h3_spark.h3_model.engine.placement import place_tower

    inputs, rows = _inputs()
    dit = synthetic_dit(CONFIG, torch.bfloat16, "cuda", seed=1)
    apply_kernels(dit, KernelSettings(linear="bf16"))
    plan = memory.plan_dit(dit, None, rows)
    plan.resident_blocks, plan.adaln_on_host = 3, True
    place_dit(dit, plan, "cuda")
    tower = ControlTower(config_for(CONFIG, 4, places=(0, 2, 4, 6)), dtype=torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in tower.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    streamed = copy.deepcopy(tower)
    tower.to("cuda")
    tower_plan = memory.plan_tower(streamed, None)
    tower_plan.resident_blocks, tower_plan.adaln_on_host = resident, True
    stream = place_tower(streamed, tower_plan, "cuda")
    n = inputs["video_indices"].numel()
    hint = torch.randn(n, tower.config.hint_dim, generator=gen).cuda()
    with torch.no_grad():
        dit.control = ControlInjection(tower, hint)
        want = dit(**inputs)
        dit.control = ControlInjection(streamed, hint)
        for _ in range(3):
            got = dit(**inputs)
            torch.cuda.synchronize()
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert stream.stats.copies >= 3 * (4 - resident) and stream.units[resident].pinned


def test_a_dit_read_into_host_memory_is_configured_block_by_block_and_placed(tmp_path):
    """The engine's path for a real small card: the DiT read into host memory, its linears converted block by
    block on the GPU (configure_in_host), then the blocks that fit placed; its forward equals a resident load."""
    from h3_spark.h3_model.checkpoint import load_dit
    from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint

    make_dit_checkpoint(tmp_path / "transformer", CONFIG, "bf16", "diffusers", seed=2)
    inputs, rows = _inputs()
    for linear in ("bf16", "fp8") if torch.cuda.get_device_capability() >= (8, 9) else ("bf16",):
        settings = KernelSettings(linear=linear)
        resident = load_dit(tmp_path / "transformer", dtype=torch.bfloat16, device="cuda")
        report_resident = apply_kernels(resident, settings)
        host = load_dit(tmp_path / "transformer", dtype=torch.bfloat16, device="cpu")
        report_host = memory.configure_in_host(host, settings, "cuda")
        assert report_host["linear"] == report_resident["linear"]
        assert report_host["attention"]["chosen"] == report_resident["attention"]["chosen"]
        plan = memory.plan_dit(host, None, rows)
        plan.resident_blocks, plan.adaln_on_host = 2, True
        place_dit(host, plan, "cuda")
        with torch.no_grad():
            want, got = resident(**inputs), host(**inputs)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), linear


@pytest.mark.parametrize("linear", ["bf16", "fp8"])
def test_a_dit_replaced_while_loaded_keeps_its_forward_and_its_gpu_bytes_are_counted(linear):
    """ComfyUI's partial loads on a GPU (engine/placement.py): resident -> 2 blocks -> 5 blocks -> host ->
    streamed again; each forward equals the resident one, what `loaded()` reports is what the allocator holds,
    and unloading gives it all back."""
    from h3_spark.h3_model.engine.placement import Placement

    if linear == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 linears need sm_89 or newer")
    settings = KernelSettings(linear=linear)
    inputs, _ = _inputs()
    a = synthetic_dit(CONFIG, torch.bfloat16, "cuda", seed=4)
    apply_kernels(a, settings)
    with torch.no_grad():
        want = [t.clone() for t in a(**inputs)]
    del a
    b = synthetic_dit(CONFIG, torch.bfloat16, "cuda", seed=4).to("cpu")  # the same weights, in host memory
    memory.configure_in_host(b, settings, "cuda")
    b.to("cpu")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    placement = Placement.of(b)
    full = placement.weights_plan(None)

    def room(resident):
        full.resident_blocks, full.adaln_on_host = resident, True
        return full.device_bytes

    for resident in (None, 2, 5, 0):
        plan = placement.place("cuda", None if resident is None else room(resident))
        assert plan.resident_blocks == (CONFIG.num_layers if resident is None else resident)
        with torch.no_grad():
            got = b(**inputs)
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (linear, resident)
        del got
        b.clear_rope_cache()  # derived tables, not weights
        held = torch.cuda.memory_allocated() - baseline
        # The caching allocator may hand a tensor up to 1 MiB more than it asked for (a remainder too small to
        # split off): that, and a few MiB of the kernels' own tables, is all that loaded() may miss.
        tensors = sum(1 for t in [*b.parameters(), *b.buffers()] if t.is_cuda and t.numel())
        slack = (tensors + 2) * (1 << 20) + (4 << 20)
        assert placement.loaded() <= held <= placement.loaded() + slack, (resident, held, placement.loaded(), slack)
        if resident is not None:
            assert placement.loaded() <= room(resident)
    placement.to_host()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - baseline <= 4 << 20 and placement.loaded() == 0


def _registered(host: torch.Tensor) -> bool:
    """Whether CUDA sees the pages as page-locked host memory (cudaPointerGetAttributes of the libcudart torch
    loaded; torch's own is_pinned() knows only its allocator's blocks)."""
    import ctypes

    path = next((line.split()[-1] for line in open("/proc/self/maps") if "libcudart.so" in line), None)
    if path is None:
        pytest.skip("libcudart is not a shared library in this process")

    class Attributes(ctypes.Structure):
        # CUDA 12 and later append reserved words: room for them, so the call never writes past the struct.
        _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("device_pointer", ctypes.c_void_p),
                    ("host_pointer", ctypes.c_void_p), ("reserved", ctypes.c_long * 32)]

    attributes = Attributes()
    err = ctypes.CDLL(path).cudaPointerGetAttributes(ctypes.byref(attributes), ctypes.c_void_p(host.data_ptr()))
    assert err == 0, err
    return attributes.type == 1  # cudaMemoryTypeHost


def test_pinned_buffers_are_page_locked_and_hold_exactly_their_bytes():
    from h3_spark.h3_model.dit.streaming import pinned_buffer

    nbytes = 3 * 2 ** 20 + 123
    host = pinned_buffer(nbytes)
    assert _registered(host) and host.numel() == nbytes and host.data_ptr() % 4096 == 0
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    host.copy_(source)
    on_gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    on_gpu.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.cpu(), source)
    assert not _registered(torch.empty(nbytes, dtype=torch.uint8))  # the check tells pageable memory apart
    del host  # unregistered, then freed: fresh memory registers again
    assert _registered(pinned_buffer(nbytes))


def test_weights_held_on_the_host_visit_the_gpu_from_page_locked_copies_and_come_back_without_a_copy():
    from h3_spark.h3_model.dit.streaming import hold_on_host, place_held

    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Sequential(torch.nn.Linear(64, 64)))
    model.register_buffer("scale", torch.randn(64))
    want = [t.clone() for t in (model[0].weight, model[0].bias, model.scale)]
    held = hold_on_host(model, "1", pin=True)
    assert all(_registered(h) for *_, h in held)
    for _ in range(2):
        place_held(held, "cuda")
        got = (model[0].weight, model[0].bias, model.scale)
        assert {t.device.type for t in got} == {"cuda"} and model[1][0].weight.device.type == "cpu"
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
        place_held(held, "cpu")
        assert {t.data_ptr() for t in (model[0].weight, model[0].bias, model.scale)} == {
            h.data_ptr() for *_, h in held}


def test_a_parked_vae_visits_from_page_locked_memory_and_decodes_the_same():
    """A parked module on a GPU: its host copy is page-locked (registered), a visit copies it up and its end
    drops the device copy (no copy back: the host tensors are the same), and what it computes on the device
    equals what it computes there when moved plainly."""
    from h3_spark.h3_model.engine.memory import Visits

    torch.manual_seed(4)
    module = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))
    x = torch.randn(32, 256, device="cuda")
    want = module.to("cuda")(x)
    visits = Visits("cuda")
    visits.park(module)
    host = [p.data_ptr() for p in module.parameters()]
    assert {p.device.type for p in module.parameters()} == {"cpu"}
    assert all(_registered(p) for p in module.parameters())
    with visits(module):
        got = module(x)
    assert torch.equal(got, want)
    assert [p.data_ptr() for p in module.parameters()] == host
