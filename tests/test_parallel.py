"""Ulysses sequence parallelism on CPU with gloo: velocities equal the single-process forward.

Tolerance: rel L2 <= 1e-5 in fp32 (the split changes no arithmetic order inside a head).
"""

import dataclasses
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from h3_spark.h3_model.dit import layout
from h3_spark.h3_model.dit.config import TINY
from h3_spark.h3_model.dit.model import H3DiT
from h3_spark.errors import InputError
from h3_spark.h3_model.dit.parallel import SequenceParallelDiT, SequenceShards

CONFIG = dataclasses.replace(TINY, num_attention_heads=4, attention_head_dim=16)


def _model(seed=0):
    torch.manual_seed(seed)
    model = H3DiT(CONFIG).eval()
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


def _worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        sp = SequenceParallelDiT(_model())
        results = []
        for lay in _layouts():
            args = _inputs(lay)
            target_v = torch.arange(lay.num_condition_video_rows, lay.video_indices.numel())
            results.append(sp(**args))
            results.append(sp(**args, output_video_rows=target_v))
        if rank == 0:
            # numpy arrays travel by value; a tensor on an mp queue is a shared-memory handle that
            # the parent must fetch from this process, which may already have exited (a CI flake).
            queue.put([(v.numpy().copy(), a.numpy().copy()) for v, a in results])
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_equals_single_process(world):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    got = queue.get(timeout=240)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    model = _model()
    expected = []
    with torch.no_grad():
        for lay in _layouts():
            args = _inputs(lay)
            target_v = torch.arange(lay.num_condition_video_rows, lay.video_indices.numel())
            expected.append(model(**args))
            expected.append(model(**args, output_video_rows=target_v))
    assert any(lay.sequence_length % world for lay in _layouts())
    for (v, a), (ev, ea) in zip(got, expected):
        v, a = torch.from_numpy(v), torch.from_numpy(a)
        assert v.shape == ev.shape
        assert ((v - ev).norm() / ev.norm()).item() <= 1e-5
        assert ((a - ea).norm() / ea.norm()).item() <= 1e-5


def test_shards_cover_the_sequence_unevenly():
    shards = [SequenceShards.split(10, r, 4) for r in range(4)]
    assert [s.sizes for s in shards][0] == [3, 3, 2, 2]
    assert [(s.start, s.end) for s in shards] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    with pytest.raises(InputError, match="cannot be split over 4 ranks"):
        SequenceShards.split(3, 0, 4)


def test_needs_initialised_process_group():
    from h3_spark.errors import H3Error

    with pytest.raises(H3Error, match="needs torch.distributed to be initialised"):
        SequenceParallelDiT(_model())


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
