"""A DiT re-placed while loaded (ComfyUI gives and takes GPU memory): every placement runs the resident forward
bit for bit, streamed blocks keep their host buffers across re-plans, and a room below the minimum is refused.

On the CPU the "device" is the CPU itself; tests/test_gpu_streaming_budget.py moves a DiT on a GPU.
"""

import dataclasses

import pytest
import torch

from h3_spark.errors import InputError
from h3_spark.h3_model.dit import layout
from h3_spark.h3_model.dit.config import TINY
from h3_spark.h3_model.dit.streaming import UNITS
from h3_spark.h3_model.engine.placement import Placement
from h3_spark.measure.synthetic import synthetic_dit
from oracle import forward_args, text_tags

CONFIG = dataclasses.replace(TINY, num_layers=5)


def _model():
    return synthetic_dit(CONFIG, torch.float32, "cpu", seed=11)


@pytest.fixture(scope="module")
def inputs():
    return forward_args(CONFIG, layout.build_t2va(text_tags(9, (1, 5)), 7, 4, 6, 10, CONFIG.patch_size), seed=8)


@pytest.fixture(scope="module")
def reference(inputs):
    with torch.no_grad():
        return _model()(**inputs)


def _room(placement: Placement, resident: int) -> int:
    """The least weight room that keeps exactly `resident` blocks resident."""
    plan = placement.weights_plan(None)
    plan.resident_blocks, plan.adaln_on_host = resident, True
    return plan.device_bytes


def _check(model, inputs, reference):
    with torch.no_grad():
        got = model(**inputs)
    assert torch.equal(got[0], reference[0]) and torch.equal(got[1], reference[1])


def test_every_placement_runs_the_resident_forward(inputs, reference):
    model = _model()
    placement = Placement.of(model)
    assert Placement.of(model) is placement  # clones of one ComfyUI model share the DiT's placement
    for resident in (2, 0, 4, 1):
        plan = placement.place("cpu", _room(placement, resident))
        assert plan.resident_blocks == resident and plan.streamed == list(range(resident, CONFIG.num_layers))
        assert placement.loaded() <= _room(placement, resident)
        _check(model, inputs, reference)
    plan = placement.place("cpu", None)  # no limit: resident, no stream left behind
    assert not plan.streaming and model.block_stream is None
    _check(model, inputs, reference)
    assert not any(m.__dict__.get(UNITS) for m in model.modules())  # resident blocks gave their host buffers back


def test_blocks_that_stream_again_keep_their_host_buffers(inputs, reference):
    model = _model()
    placement = Placement.of(model)
    placement.place("cpu", _room(placement, 1))
    before = {i: u.host.data_ptr() for i, u in model.block_stream.units.items()}
    placement.place("cpu", _room(placement, 3))  # blocks 1 and 2 become resident, 3 and 4 still stream
    after = {i: u.host.data_ptr() for i, u in model.block_stream.units.items()}
    assert sorted(after) == [3, 4] and all(after[i] == before[i] for i in after)
    _check(model, inputs, reference)


def test_the_same_room_places_nothing_anew():
    model = _model()
    placement = Placement.of(model)
    first = placement.place("cpu", _room(placement, 2))
    stream = model.block_stream
    assert placement.place("cpu", _room(placement, 2) + 1) is first and model.block_stream is stream


def test_a_room_below_a_streamed_forward_is_refused_naming_the_minimum():
    model = _model()
    placement = Placement.of(model)
    minimum = placement.minimum()
    assert minimum == _room(placement, 0)
    with pytest.raises(InputError, match=r"of GPU memory for the H3 DiT's weights is below the [\d.]+ [GM]B a streamed "
                                         r"DiT needs \([\d.]+ [GM]B outside the blocks and 2 block slots of"):
        placement.place("cpu", minimum - 1)
    assert placement.device is None and model.block_stream is None  # refused before anything moved


def test_shrinking_below_the_minimum_unloads_everything(inputs, reference):
    model = _model()
    placement = Placement.of(model)
    placement.place("cpu", _room(placement, 3))
    assert placement.shrink(_room(placement, 1)).resident_blocks == 1
    _check(model, inputs, reference)
    assert placement.shrink(placement.minimum() - 1) is None
    assert placement.device is None and placement.loaded() == 0 and model.block_stream is None
    assert placement.size() == Placement(_model()).size()  # nothing lost on the way down
    placement.place("cpu", None)
    _check(model, inputs, reference)


def test_unstream_puts_every_weight_back_for_a_merge(inputs):
    """Merging a LoRA needs every weight in its module: unstream, change a streamed block's weight in place, and
    the next placement streams the changed weight (its host buffer is the one the module now views)."""
    model, want = _model(), _model()
    placement = Placement.of(model)
    placement.place("cpu", _room(placement, 1))
    placement.unstream()
    assert model.block_stream is None and all(p.numel() > 0 for p in model.parameters())
    with torch.no_grad():
        for m in (model, want):
            m.transformer_blocks[3].ff.net[0].proj.weight.mul_(1.5)
        placement.place("cpu", _room(placement, 1))
        got, ref = model(**inputs), want(**inputs)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


# ------------------------------------------------------------------------------------------ the text encoder
@pytest.fixture(scope="module")
def text_folder(tmp_path_factory):
    from h3_spark.h3_model.engine.demo import write_text_encoder

    return write_text_encoder(tmp_path_factory.mktemp("qwen") / "text_encoder", seed=5)


def _encoder(folder):
    from h3_spark.h3_model.engine.demo import TEXT_READ_LAYER
    from h3_spark.h3_model.text.encoder import TextEncoder

    return TextEncoder.from_pretrained(folder, dtype=torch.float32, device="cpu", layer=TEXT_READ_LAYER)


PROMPT = "A lighthouse keeper hums while waves break on the rocks below."


def test_a_text_encoder_streams_its_layers_when_the_room_is_short_and_encodes_the_same(text_folder):
    from h3_spark.h3_model.engine.placement import TextPlacement

    want = _encoder(text_folder).encode(PROMPT).embeds
    te = _encoder(text_folder)
    placement = TextPlacement.of(te, depth=1)  # the demo keeps two decoder layers: one streams while one waits
    size, minimum = placement.size(), placement.minimum()
    assert minimum < size
    assert placement.place("cpu", minimum) is True and te.layer_stream is not None
    assert placement.loaded() <= minimum
    assert torch.equal(te.encode(PROMPT).embeds, want)
    te.clear_cache()
    assert placement.place("cpu", None) is False and te.layer_stream is None  # resident again
    assert placement.size() == size
    assert torch.equal(te.encode(PROMPT).embeds, want)


def test_a_text_encoder_room_below_its_streamed_minimum_is_refused(text_folder):
    from h3_spark.h3_model.engine.placement import TextPlacement

    te = _encoder(text_folder)
    placement = TextPlacement.of(te, depth=1)
    with pytest.raises(InputError, match=r"of GPU memory for the text encoder is below the [\d.]+ [GM]B it needs "
                                         r"with its decoder layers streamed \(1 layer slot\)"):
        placement.place("cpu", placement.minimum() - 1)
    assert te.layer_stream is None and placement.device is None
