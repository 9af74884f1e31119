"""The TAEHV-style preview decoder (h3_model/vae/tiny_decoder.py): its all-frames-at-once forward against a
frame-by-frame reference written here in plain PyTorch (the causal design it must equal), reading a
taeh3.safetensors under the published key names, and refusing what is not one."""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from h3_spark.errors import CheckpointError
from h3_spark.h3_model.vae.tiny_decoder import MemoryBlock, TimeGrow, TinyVideoDecoder, load_tiny_decoder


def _random(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p[0].numel()) ** 0.5)
    return model


def _frame_by_frame(model, latents):
    """One latent frame at a time: each memory block keeps the input it saw for the previous frame."""
    layers = list(model.decoder)
    memory = {}
    outputs = []

    def run(x, start):
        for i in range(start, len(layers)):
            layer = layers[i]
            if isinstance(layer, MemoryBlock):
                past = memory.get(i, torch.zeros_like(x))
                memory[i] = x
                x = layer(x, past)
            elif isinstance(layer, TimeGrow):
                grown = layer.conv(x).reshape(layer.stride, *x.shape[1:])  # frames in time order
                for frame in grown:
                    run(frame[None], i + 1)
                return
            else:
                x = layer(x)
        outputs.append(F.pixel_shuffle(x, 2).clamp(0, 1))

    for t in range(latents.shape[0]):
        run(latents[t:t + 1], 0)
    return torch.cat(outputs)[model.startup_frames:]


def test_the_all_frames_forward_is_the_causal_frame_by_frame_decoder():
    model = _random(TinyVideoDecoder(latent_channels=6)).eval()
    latents = torch.randn(3, 6, 3, 5, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(latents)
        want = _frame_by_frame(model, latents)
    assert got.shape == (4 * 3 - 3, 3, 48, 80)
    # fp32 convolutions over 9 frames at once or 1 at a time round differently: 1e-4 of a [0, 1] pixel.
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    unsaturated = ((got > 0.001) & (got < 0.999)).float().mean()
    assert unsaturated > 0.1 and got.std() > 0.01  # thousands of pixels inside (0, 1): the check means something


def test_a_taeh3_file_loads_under_the_published_names(tmp_path):
    model = _random(TinyVideoDecoder(latent_channels=24), seed=2)
    tensors = {f"decoder.{k}": v for k, v in model.decoder.state_dict().items()}
    tensors["encoder.0.weight"] = torch.randn(64, 12, 3, 3)  # the encoder half is ignored
    grown = tensors["decoder.7.conv.weight"]
    tensors["decoder.7.conv.weight"] = torch.cat([torch.randn_like(grown), grown])  # trained for x2 in time
    save_file(tensors, str(tmp_path / "taeh3.safetensors"))
    loaded = load_tiny_decoder(tmp_path / "taeh3.safetensors")
    latents = torch.randn(2, 24, 2, 3, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(latents), model.eval()(latents))


def test_what_is_not_a_tiny_decoder_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="read from .safetensors only"):
        load_tiny_decoder(tmp_path / "taeh3.pth")
    save_file({"encoder.0.weight": torch.zeros(1)}, str(tmp_path / "enc.safetensors"))
    with pytest.raises(CheckpointError, match="holds no TAEHV decoder"):
        load_tiny_decoder(tmp_path / "enc.safetensors")
    tensors = {f"decoder.{k}": v for k, v in TinyVideoDecoder(24).decoder.state_dict().items()}
    del tensors["decoder.22.weight"]
    save_file(tensors, str(tmp_path / "half.safetensors"))
    with pytest.raises(CheckpointError, match=r"is not an H3 TAEHV decoder: missing \['22.weight'\]"):
        load_tiny_decoder(tmp_path / "half.safetensors")


def _in_chunks(model, latents, chunk):
    memory = {}
    return torch.cat([model.decode_chunk(latents[s:s + chunk], memory) for s in range(0, latents.shape[0], chunk)])


@pytest.mark.parametrize("chunk", [2, 3, 5, 7, 12, 20])
def test_chunks_carrying_each_blocks_last_input_are_the_whole_pass_bit_for_bit(chunk):
    # 12 latent frames: 2, 3 and 12 divide it, 5 and 7 do not (last chunks of 2 and 5), 20 is one chunk.
    model = _random(TinyVideoDecoder(latent_channels=6), seed=4).eval()
    latents = torch.randn(12, 6, 2, 3, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = model.decode_chunk(latents, {})
        got = _in_chunks(model, latents, chunk)
    assert got.shape == whole.shape == (48, 3, 32, 48)
    # Each frame's convolutions are the same sums over fewer frames: fp32 on the CPU gives the same bits.
    assert torch.equal(got, whole)
    assert ((whole > 0.001) & (whole < 0.999)).float().mean() > 0.1  # pixels inside (0, 1): equality means something


@pytest.mark.parametrize("chunk", [1, 11])
def test_one_frame_chunks_round_within_5e5(chunk):
    # A one-frame convolution takes another CPU kernel for the small early layers (chunk 11 leaves one frame
    # last): its sums round differently, measured 6e-6 of a [0, 1] pixel on one CPU and 1.05e-5 on an AMD EPYC
    # (the kernel the CPU library picks differs); a wrong carried frame changes pixels by far more.
    model = _random(TinyVideoDecoder(latent_channels=6), seed=4).eval()
    latents = torch.randn(12, 6, 2, 3, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = model.decode_chunk(latents, {})
        got = _in_chunks(model, latents, chunk)
    assert got.shape == whole.shape
    assert (got - whole).abs().max() <= 5e-5


def test_the_carried_memory_is_one_frame_per_block_not_a_view_of_the_chunk():
    model = _random(TinyVideoDecoder(latent_channels=6), seed=4).eval()
    latents = torch.randn(5, 6, 2, 3, generator=torch.Generator().manual_seed(6))
    memory = {}
    with torch.no_grad():
        model.decode_chunk(latents, memory)
    blocks = [i for i, layer in enumerate(model.decoder) if isinstance(layer, MemoryBlock)]
    assert sorted(memory) == blocks
    for frame in memory.values():
        # One frame of its own storage: a view would keep the chunk's whole input alive until the next chunk.
        assert frame.shape[0] == 1 and frame.untyped_storage().nbytes() == frame.numel() * frame.element_size()
