"""Packed layout, row timesteps and geometry against diffusers' builders (exact equality)."""

import pytest
import torch

from diffusers.modular_pipelines.minimax_h3 import modular_pipeline as dmp
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3Ref2VAPrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
    patchify_video_latents,
)

from h3_spark.h3_model import geometry
from h3_spark.h3_model.dit import layout
from h3_spark.errors import InputError
from oracle import ref_blocks, text_tags


def _same(ours: layout.Layout, theirs) -> None:
    pos, tags, vid, aud, txt, ncv, nca = theirs
    assert torch.equal(ours.position_ids, pos)  # bit-exact float64 coordinates
    assert torch.equal(ours.token_tags, tags)
    assert torch.equal(ours.video_indices, vid)
    assert torch.equal(ours.audio_indices, aud)
    assert torch.equal(ours.text_indices, txt)
    assert (ours.num_condition_video_rows, ours.num_condition_audio_rows) == (ncv, nca)


@pytest.mark.parametrize("anchors", [(), ("first",), ("last",), ("first", "last")])
@pytest.mark.parametrize("frames,h,w", [(3, 4, 6), (37, 34, 60), (22, 6, 4)])
def test_t2va_fl2va_layout_matches_diffusers(anchors, frames, h, w):
    tags = text_tags(11, (3, 7))
    audio = 2 * frames + 3
    ours = layout.build_t2va(tags, frames, h, w, audio, keyframes=anchors)
    theirs = MiniMaxH3PrepareLayoutStep.build_packed_sequence(tags, frames, h, w, audio, (1, 2, 2), 2, 2, 0, anchors)
    _same(ours, theirs)


@pytest.mark.parametrize("spec", [
    [("image", 8, 12)],
    [("image", 8, 12), ("image", 12, 8), ("audio", 9)],
    [("video", 17, 4, 6, 27), ("image", 6, 6)],
    [("video", 7, 4, 4, 0), ("audio", 5), ("video", 22, 6, 4, 40)],
    [("audio", 3), ("image", 4, 4)],
])
def test_ref2va_layout_matches_diffusers(spec):
    ours_refs, their_refs, cond, audio_cond = ref_blocks(spec)
    tags = text_tags(15, (2, 9))
    ours = layout.build_ref2va(tags, ours_refs, 22, 6, 8, 40)
    theirs = MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
        tags, their_refs, cond, audio_cond, 22, 6, 8, 40, (1, 2, 2), 2, 2, 0)
    _same(ours, theirs)


@pytest.mark.parametrize("t_video,t_audio", [(0.0, 0.0), (0.25, 0.4), (0.9995, 0.3), (0.5, 0.999)])
def test_row_timesteps_match_diffusers(t_video, t_audio):
    ours_refs, *_ = ref_blocks([("video", 7, 4, 4, 12), ("audio", 5), ("image", 4, 6)])
    lay = layout.build_ref2va(text_tags(6), ours_refs, 7, 4, 4, 12)
    cond_t = max(t_video, 0.999)
    ts, idx = lay.row_timesteps(t_video, t_audio, cond_t)
    ts2, idx2 = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        lay.video_indices, lay.audio_indices, lay.num_condition_video_rows, lay.num_condition_audio_rows,
        lay.num_text, t_video, t_audio, cond_t, 1.0)
    assert torch.equal(ts, ts2) and torch.equal(idx, idx2)


def test_segments_cover_rows_in_order():
    from h3_spark.kernels.references import segments

    rows = torch.tensor([3, 3, 4, 4, 4, 3, 0, 0, 2])
    segs = segments(rows)
    assert segs == [(0, 2, 3), (2, 5, 4), (5, 6, 3), (6, 8, 0), (8, 9, 2)]
    rebuilt = torch.cat([torch.full((e - s,), r) for s, e, r in segs])
    assert torch.equal(rebuilt, rows)


def test_patchify_matches_diffusers_and_inverts():
    x = torch.randn(1, 4, 3, 6, 8)
    rows = layout.patchify(x)
    assert torch.equal(rows, patchify_video_latents(x, (1, 2, 2)))
    assert torch.equal(layout.unpatchify(rows, 4, 3, 6, 8), x)


@pytest.mark.parametrize("bad,message", [
    ([("audio", 4)], "audio-only references are not supported"),
    ([("image", 4, 4)] * 10, "at most 9 image references"),
    ([("video", 2, 4, 4, 0)] * 4, "at most 3 video references"),
    ([("audio", 2)] * 4 + [("image", 4, 4)], "at most 3 audio references"),
    ([("image", 4, 4)] * 9 + [("video", 2, 4, 4, 0)] * 3 + [("audio", 2)], "at most 12 references in total"),
    ([], "at least one reference"),
    ([("image", 5, 4)], "not divisible by the patch"),
])
def test_ref2va_limits(bad, message):
    refs, *_ = ref_blocks(bad)
    with pytest.raises(InputError, match=message):
        layout.build_ref2va(text_tags(3), refs, 2, 4, 4, 4)


def test_layout_input_errors():
    with pytest.raises(InputError, match="keyframe anchor must be 'first' or 'last'"):
        layout.build_t2va(text_tags(3), 2, 4, 4, 4, keyframes=("middle",))
    with pytest.raises(InputError, match="first and/or a last keyframe"):
        layout.build_t2va(text_tags(3), 2, 4, 4, 4, keyframes=("first", "first"))
    with pytest.raises(InputError, match="no text tokens"):
        layout.build_t2va(torch.ones(0, dtype=torch.long), 2, 4, 4, 4)
    with pytest.raises(InputError, match="text token tags must be"):
        layout.build_t2va(torch.full((3,), 2), 2, 4, 4, 4)
    with pytest.raises(InputError, match="not divisible by the patch"):
        layout.build_t2va(text_tags(3), 2, 5, 4, 4)
    with pytest.raises(InputError, match="at least one latent frame"):
        layout.build_t2va(text_tags(3), 0, 4, 4, 4)


@pytest.mark.parametrize("aspect", [(16, 9), (9, 16), (1, 1), (4, 1), (1, 4), (1920, 1080), (720, 1280), (3, 2)])
def test_canvas_matches_diffusers(aspect):
    assert geometry.resolve_canvas(*aspect) == dmp.resolve_canvas_size(*aspect, 32, 768, 768 * 1344)


def test_geometry_frames_and_latents():
    assert geometry.resolve_canvas(16, 9) == (768, 1344)
    for n in range(1, 400):
        aligned = geometry.align_frames(n)
        assert aligned == dmp.align_num_frames(n, 17, 5)
        assert geometry.video_latent_frames(aligned) == dmp.video_latent_num_frames(aligned, 17, 5)
        assert geometry.audio_latent_frames(n) == dmp.audio_latent_num_frames(n)
    assert geometry.snap_frames(100 + 24) == 124 and geometry.video_latent_frames(124) == 37
    assert geometry.audio_latent_frames(124) == 207
    assert geometry.snap_frames(345) == 345 and geometry.snap_frames(125) == 141
    assert geometry.snap_frames_down(130) == 124
    assert geometry.video_latent_frames(1) == 1


@pytest.mark.parametrize("call,message", [
    (lambda: geometry.snap_frames(100), "H3 generates 124..345 frames"),
    (lambda: geometry.snap_frames(346), "H3 generates 124..345 frames"),
    (lambda: geometry.snap_frames(96), "nearest valid: 124 frames, 5.17 s"),
    (lambda: geometry.snap_frames(400), "nearest valid: 345 frames, 14.38 s"),
    (lambda: geometry.check_canvas(1280, 720), "got 1280x720 \\(nearest valid: 1280x704\\)"),
    (lambda: geometry.check_canvas(1344, 1344, max_pixels=768 * 1344), "nearest valid: 992x992"),
    (lambda: geometry.align_frames(0), "frame count must be positive"),
    (lambda: geometry.video_latent_frames(30), "frame count must be 17n\\+5"),
    (lambda: geometry.resolve_canvas(5, 1), "outside 1:4 .. 4:1"),
    (lambda: geometry.resolve_canvas(0, 1), "aspect ratio must be positive"),
    (lambda: geometry.check_canvas(960, 540), "multiples of 32"),
    (lambda: geometry.check_canvas(160, 32), "outside 1:4 .. 4:1"),
    (lambda: geometry.check_canvas(1344, 1344, max_pixels=768 * 1344), "exceeds"),
    (lambda: geometry.snap_frames_down(3), "at least 5 frames"),
])
def test_geometry_errors(call, message):
    with pytest.raises(InputError, match=message):
        call()
