"""Ulysses sequence parallelism on CPU with gloo: the one forward, split over ranks, equals the single process.

Tolerance: rel L2 <= 1e-5 in fp32, for single forwards and for whole sampler runs (the split changes no arithmetic
order inside a head; the projections over fewer rows may round differently in the last bit). Under the split the
block loop's hooks run as in one process: the first-block cache (its change measured over the whole sequence, the
same number on every rank, so the ranks reuse the same steps), an attention schedule that alternates two exact
backends per block, FastH3's VSA schedule (per head, over all rows: each rank's slice of heads), released AdaLN
weights, recipe pdd's per-step head mix (the heads run after the gather, on every rank alike), the sampler
res_multistep (its history, the previous step's estimates, the same on every rank) and the ControlNet's
tower (its stream split like the DiT's, its skips added to each rank's rows).
"""

import dataclasses
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from h3_spark.errors import H3Error, InputError
from h3_spark.h3_model.dit import layout
from h3_spark.h3_model.dit.config import TINY
from h3_spark.h3_model.dit.model import H3DiT
from h3_spark.h3_model.dit.parallel import ONE_PROCESS, SequenceParallel, SequenceShards, UlyssesAttention, \
    split_over_ranks
from h3_spark.h3_model.engine.recipes import VsaSchedule
from h3_spark.h3_model.dit.head_bank import HeadBank
from h3_spark.h3_model.pipeline.pdd import PddHeads
from h3_spark.h3_model.pipeline.sampler import SamplingRequest, sample
from h3_spark.h3_model.pipeline.scheduler import JointSchedule
from h3_spark.h3_model.pipeline.step_cache import make_step_cache
from h3_spark.kernels.attention import math_reference, sdpa

CONFIG = dataclasses.replace(TINY, num_attention_heads=4, attention_head_dim=16)
STEPS = 7  # 6 evaluations
CANVAS = (5, 8, 8, 10)  # latent frames, height, width, audio latents: 7 + 20 + 80 = 107 rows, split unevenly


def _model(seed=0, config=CONFIG):
    torch.manual_seed(seed)
    model = H3DiT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def _inputs(lay, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ts, idx = lay.row_timesteps(0.3, 0.6, 0.999)
    return dict(hidden_states=torch.randn(1, lay.video_indices.numel(), CONFIG.video_patch_dim, generator=gen),
                audio_hidden_states=torch.randn(1, lay.audio_indices.numel(), CONFIG.audio_in_channels, generator=gen),
                encoder_hidden_states=torch.randn(1, lay.num_text, CONFIG.text_dim, generator=gen),
                timestep=ts, timestep_indices=idx, token_tags=lay.token_tags, position_ids=lay.position_ids.float(),
                video_indices=lay.video_indices, audio_indices=lay.audio_indices, text_indices=lay.text_indices)


def _layouts():
    # Odd lengths so ranks get uneven row counts (S % world != 0).
    refs = [layout.ImageBlock(4, 6), layout.VideoBlock(2, 4, 4, 3), layout.AudioBlock(5)]
    return [layout.build_t2va(torch.ones(7, dtype=torch.long), 3, 4, 6, 5, keyframes=("first",)),
            layout.build_ref2va(torch.ones(9, dtype=torch.long), refs, 2, 4, 6, 4)]


def _forwards(model):
    results = []
    with torch.no_grad():
        for lay in _layouts():
            args = _inputs(lay)
            target_v = torch.arange(lay.num_condition_video_rows, lay.video_indices.numel())
            results.append(model(**args))
            results.append(model(**args, output_video_rows=target_v))
    return [(v.numpy().copy(), a.numpy().copy()) for v, a in results]


class Alternating:
    """An attention schedule: sdpa in even blocks, the fp32 formula in odd ones; counts what it hands out."""

    def __init__(self):
        self.asked = 0

    def at(self, step, block):
        self.asked += 1
        return sdpa if block % 2 == 0 else math_reference


def _sample(model, **kwargs):
    frames, height, width, audio = CANVAS
    prompt = torch.randn(1, 7, CONFIG.text_dim, generator=torch.Generator().manual_seed(2))
    lay = layout.build_t2va(torch.ones(7, dtype=torch.long), frames, height, width, audio, CONFIG.patch_size)
    req = SamplingRequest(lay, prompt, frames, height, width, audio)
    out = sample(model, req, JointSchedule.create(STEPS), torch.Generator().manual_seed(9), **kwargs)
    return out.video_latents.numpy().copy(), out.audio_latents.numpy().copy()


def _runs(split=lambda model: model):
    """Sampler runs through the block loop's hooks, each on a fresh model given to `split`: name -> (latents,
    what the run reports)."""
    out = {}
    cache = make_step_cache("first_block", 1e9, 0.3, 0.8, evaluations=STEPS - 1)
    out["first_block_cache"] = _sample(split(_model()), step_cache=cache), (cache.computed, cache.reused,
                                                                            cache.changes)
    alternating = Alternating()
    out["alternating_schedule"] = _sample(split(_model()), attention_schedule=alternating), alternating.asked
    gated = dataclasses.replace(CONFIG, gate_compress=True)
    vsa = VsaSchedule(0.5, 64, "pytorch", CONFIG.patch_size)
    out["vsa_schedule"] = _sample(split(_model(config=gated)), attention_schedule=vsa), None
    model = split(_model())
    out["released_adaln"] = _sample(model, release_adaln=True), model.adaln_released
    model = split(_model())
    model.head_bank = _head_bank()
    out["pdd_heads"] = _sample(model, head_schedule=PddHeads(8)), None
    out["res_multistep"] = _sample(split(_model()), sampler="res_multistep"), None
    model = split(_model())
    model.control = _control()
    out["controlnet"] = _sample(model), model.control.evaluations
    return out


def _control():
    """A ControlNet tower after both layers, random, with a random hint for the sampled canvas."""
    from h3_spark.h3_model.controlnet.tower import ControlInjection, ControlTower, config_for

    torch.manual_seed(5)
    tower = ControlTower(config_for(CONFIG, 2), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.3)
    frames, height, width, _ = CANVAS
    hint = torch.randn(frames * height * width // 4, 196, generator=torch.Generator().manual_seed(6))
    return ControlInjection(tower, hint, strength=0.8)


def _head_bank(count=8):
    gen = torch.Generator().manual_seed(4)
    c = CONFIG
    return HeadBank(0.3 * torch.randn(count, c.video_patch_dim, c.hidden_size, generator=gen),
                    0.3 * torch.randn(count, c.video_patch_dim, generator=gen),
                    0.3 * torch.randn(count, c.audio_in_channels, c.hidden_size, generator=gen),
                    0.3 * torch.randn(count, c.audio_in_channels, generator=gen))


def _worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        # numpy arrays travel by value; a tensor on an mp queue is a shared-memory handle that the parent must
        # fetch from this process, which may already have exited (a CI flake).
        payload = {"forwards": _forwards(split_over_ranks(_model()))}
        if world == 2:
            payload["runs"] = _runs(split_over_ranks)
            try:
                SequenceParallel(3)
            except InputError as exc:
                payload["three_heads"] = str(exc)
        queue.put((rank, payload))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=300) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


def _rel_l2(a, b):
    a, b = torch.from_numpy(a).double(), torch.from_numpy(b).double()
    assert a.shape == b.shape
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_equals_single_process(world):
    got = _spawn(world)
    assert any(lay.sequence_length % world for lay in _layouts())
    expected = _forwards(_model())
    for rank in range(world):
        for (v, a), (ev, ea) in zip(got[rank]["forwards"], expected):
            assert _rel_l2(v, ev) <= 1e-5 and _rel_l2(a, ea) <= 1e-5
    if world == 2:
        _check_runs(got)
        assert got[0]["three_heads"] == ("2 ranks do not divide the 3 attention heads; use a world size that does "
                                         "(for 56 heads: 2, 4, 7 or 8)")


def _check_runs(got):
    expected = _runs()
    for rank in (0, 1):
        runs = got[rank]["runs"]
        assert runs.keys() == expected.keys()
        for name, ((video, audio), _) in expected.items():
            (v, a), _ = runs[name]
            assert _rel_l2(v, video) <= 1e-5 and _rel_l2(a, audio) <= 1e-5, name
    # The cache measured the whole sequence's change (a rank's own rows give another number) and reused the
    # same steps as one process; both ranks took every decision from the same number.
    computed, reused, changes = expected["first_block_cache"][1]
    assert (computed, reused) == ([0, 1, 5], [2, 3, 4])
    for rank in (0, 1):
        got_computed, got_reused, got_changes = got[rank]["runs"]["first_block_cache"][1]
        assert (got_computed, got_reused) == (computed, reused) and got_changes.keys() == changes.keys()
        assert all(abs(got_changes[i] - changes[i]) <= 1e-5 * changes[i] for i in changes)
    assert got[0]["runs"]["first_block_cache"][1][2] == got[1]["runs"]["first_block_cache"][1][2]
    # Every evaluation asked the schedule for every block, on every rank; the AdaLN weights were released.
    assert got[0]["runs"]["alternating_schedule"][1] == expected["alternating_schedule"][1] == (STEPS - 1) * 2
    assert got[0]["runs"]["released_adaln"][1] is True
    # VSA at sparsity 0.5 is not the dense run: the schedule, not the model's attention, ran.
    dense = _sample(_model(config=dataclasses.replace(CONFIG, gate_compress=True)))
    assert _rel_l2(expected["vsa_schedule"][0][0], dense[0]) > 1e-3
    # The bank's heads, not the DiT's own, made the pdd run.
    plain = _sample(_model())
    (video, audio), _ = expected["pdd_heads"]
    assert _rel_l2(video, plain[0]) > 1e-3 and _rel_l2(audio, plain[1]) > 1e-3
    # res_multistep keeps its history on every rank alike: the split run equals one process's, not Euler's.
    (video, audio), _ = expected["res_multistep"]
    assert _rel_l2(video, plain[0]) > 1e-3 and _rel_l2(audio, plain[1]) > 1e-3
    # The ControlNet's tower ran in every evaluation, on each rank's rows, and steered the run.
    assert expected["controlnet"][1] == got[0]["runs"]["controlnet"][1] == STEPS - 1
    assert _rel_l2(expected["controlnet"][0][0], plain[0]) > 1e-3


def test_shards_cover_the_sequence_unevenly():
    shards = [SequenceShards.split(10, r, 4) for r in range(4)]
    assert [s.sizes for s in shards][0] == [3, 3, 2, 2]
    assert [(s.start, s.end) for s in shards] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    with pytest.raises(InputError, match="cannot be split over 4 ranks"):
        SequenceShards.split(3, 0, 4)


def test_needs_initialised_process_group():
    with pytest.raises(H3Error, match="needs torch.distributed to be initialised"):
        SequenceParallel(CONFIG.num_attention_heads)
    assert _model().sequence_parallel is ONE_PROCESS


def test_quantized_heads_are_not_traded_between_ranks():
    from h3_spark.kernels.qk_prep import QuantizedHeads

    heads = torch.randn(1, 4, 4, 16)
    quantized = QuantizedHeads(heads.to(torch.float8_e4m3fn), torch.ones(1, 4))
    attention = UlyssesAttention(sdpa, SequenceShards.split(8, 0, 2))
    with pytest.raises(H3Error, match=r"^sequence parallelism trades the rows of plain q, k, v between ranks, but "
                                      r"the Q/K preparation hands the attention quantized heads \(attention "
                                      r"fa3_fp8\): choose another attention, or run on one GPU$"):
        attention(quantized, quantized, heads)


def test_generate_gpus_2_equals_one_process(tmp_path):
    """`h3-spark generate --gpus 2` (torchrun + gloo on CPU) gives the one-process latents."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from h3_spark.h3_model.engine.demo import build_demo_models
    from h3_spark.h3_model.text.torchvision_compat import ensure_importable

    if not ensure_importable():
        pytest.skip("the Qwen3-VL processors need torchvision")
    models = build_demo_models(tmp_path / "demo")
    env = {**os.environ, "H3_MODULATION_FUSION": "off", "H3_Q_RMS_ROPE_INT8_FUSION": "off", "OMP_NUM_THREADS": "1"}
    latents = []
    for gpus in (1, 2):
        out = tmp_path / f"g{gpus}.mp4"
        cmd = [sys.executable, "-m", "h3_spark.cli", "generate", "--demo", "--demo-dir", str(models), "--quiet",
               "--device", "cpu", "--steps", "3", "--width", "64", "--height", "64", "--gpus", str(gpus),
               "--out", str(out), "--save-latents", str(tmp_path / f"g{gpus}.safetensors")]
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
        assert run.returncode == 0, run.stderr[-2000:]
        assert out.is_file()
        latents.append(load_file(str(tmp_path / f"g{gpus}.safetensors")))
    for key in ("video_latents", "audio_latents"):
        a, b = latents[1][key], latents[0][key]
        assert ((a - b).norm() / b.norm()).item() <= 1e-5, key


def _vae():
    from h3_spark.h3_model.vae import video as video_vae
    from h3_spark.h3_model.vae import video_config
    torch.manual_seed(0)
    vae = video_vae.VideoVAE(video_config.TINY).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.normal_(0, 0.2)
    return vae


def _vae_worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        z = torch.randn(1, 4, 17, 4, 6, generator=torch.Generator().manual_seed(3))
        out = _vae().decode_to_buffer(z, group=dist.group.WORLD, tile_size=16, tile_min_overlap=4)
        queue.put((rank, out.numpy().copy()))  # by value, as in _worker
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_vae_decode_split_over_ranks_is_bit_identical(world):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_vae_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    outs = dict(queue.get(timeout=240) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    z = torch.randn(1, 4, 17, 4, 6, generator=torch.Generator().manual_seed(3))
    expected = _vae().decode_to_buffer(z, tile_size=16, tile_min_overlap=4)
    for rank in range(world):
        assert torch.equal(torch.from_numpy(outs[rank]), expected), rank


def test_generate_across_two_nodes_on_loopback_equals_one_process(tmp_path):
    """`generate --nnodes 2 --node-rank R --rdzv-endpoint 127.0.0.1:PORT` on two "hosts" (two processes here,
    gloo on the CPU, one rank each): node 0 writes the one-process latents; node 1 writes nothing."""
    import socket
    import subprocess
    import sys

    from safetensors.torch import load_file

    from h3_spark.h3_model.engine.demo import build_demo_models
    from h3_spark.h3_model.text.torchvision_compat import ensure_importable

    if not ensure_importable():
        pytest.skip("the Qwen3-VL processors need torchvision")
    models = build_demo_models(tmp_path / "demo")
    env = {**os.environ, "H3_MODULATION_FUSION": "off", "H3_Q_RMS_ROPE_INT8_FUSION": "off", "OMP_NUM_THREADS": "1"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = [sys.executable, "-m", "h3_spark.cli", "generate", "--demo", "--demo-dir", str(models), "--quiet",
            "--device", "cpu", "--steps", "3", "--width", "64", "--height", "64"]
    nodes = [subprocess.Popen([*base, "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}",
                               "--out", str(tmp_path / f"node{rank}.mp4"),
                               "--save-latents", str(tmp_path / f"node{rank}.safetensors")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    for node in nodes:
        _, err = node.communicate(timeout=400)
        assert node.returncode == 0, err[-2000:]
    single = subprocess.run([*base, "--out", str(tmp_path / "one.mp4"), "--save-latents", str(tmp_path / "one.st")],
                            capture_output=True, text=True, env=env, timeout=400)
    assert single.returncode == 0, single.stderr[-2000:]
    assert (tmp_path / "node0.mp4").is_file() and not (tmp_path / "node1.mp4").exists()
    two, one = load_file(str(tmp_path / "node0.safetensors")), load_file(str(tmp_path / "one.st"))
    for key in ("video_latents", "audio_latents"):
        assert ((two[key] - one[key]).norm() / one[key].norm()).item() <= 1e-5, key


@pytest.mark.parametrize("extra, message", [
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "node0"],
     "needs --rdzv-endpoint HOST:PORT (node 0's address and a free port)"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank must be 0..1 with --nnodes 2"),
    (["--rdzv-endpoint", "h:1"], "--rdzv-endpoint joins hosts: it needs --nnodes 2 or more"),
    (["--nnodes", "0"], "--nnodes must be at least 1"),
])
def test_node_flag_errors(tmp_path, capsys, extra, message):
    from h3_spark.cli import main

    assert main(["generate", "--demo", "--out", str(tmp_path / "x.mp4"), *extra]) == 2
    assert message in capsys.readouterr().err
