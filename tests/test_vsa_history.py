"""VSA in a window that goes on from a history (kernels/vsa_reference.py, kernels/vsa.py, dit/layout.py): the
history's video and the film's first-frame guide are 3-D context tiles selected like the target's, within the
target's budget; the text and the sound stay dense tiles; a first window's tiling is what it was.

Error budget: the reference against a dense attention over exactly the hand-selected pairs, 1e-5 (fp32, values
of order 1); the Triton kernels (CPU interpreter here, compiled on a GPU) against the reference as in test_vsa.py.
"""

import math

import pytest
import torch

from h3_spark.errors import InputError
from h3_spark.h3_model.dit.layout import GuideBlock, HistoryBlock, build_t2va, segments_before_video
from h3_spark.kernels._triton import triton
from h3_spark.kernels.attention import math_reference
from h3_spark.kernels.vsa_reference import (VideoRun, coarse_scores, fine_reference, select_tiles, tile_map,
                                            tiles_selected, video_tiles_kept, vsa_reference)

needs_triton = pytest.mark.skipif(triton is None, reason="needs Triton (its CPU interpreter runs these)")

TEXT = 5


def _going_on(guides=(GuideBlock(0, 1, 0),)):
    """A tiny window that goes on: 5 text rows, a 2-latent-frame history (5 frames) with 3 audio latents, the
    first-frame guide, a target of 7 latent frames on an 8x8 latent (4x4 patches) with 12 audio latents."""
    layout = build_t2va(torch.zeros(TEXT, dtype=torch.long), 7, 8, 8, 12, guides=guides, history=HistoryBlock(2, 3))
    return layout, (7, 4, 4)


def _qkv(s, heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, s, heads, dim, generator=g) for _ in range(3)]


# ------------------------------------------------------------------------------------------ tiling
def test_a_going_on_window_tiles_its_history_and_guide_as_one_video_by_hand():
    layout, patches = _going_on()
    # Rows: text 0..4, history video 5..36 (2 frames x 16), its sound 37..42 (3 x 2 channels), the guide's still
    # 43..58, the target's sound 59..82 (12 x 2), the target's video 83..194 (7 frames x 16).
    assert layout.context_video == ((5, 32, 2, False), (43, 16, 1, True))
    assert segments_before_video(layout) == (5, VideoRun(2), 6, VideoRun(1, follows=True), 24)
    tiles = tile_map(segments_before_video(layout), patches, 64)
    assert (tiles.num_prefix_tiles, tiles.num_context_tiles, tiles.num_target_tiles) == (3, 1, 2)
    assert tiles.sizes.tolist() == [5, 6, 24, 48, 64, 48]
    rows = [r[r >= 0].tolist() for r in tiles.rows]
    assert rows[:3] == [list(range(0, 5)), list(range(37, 43)), list(range(59, 83))]
    # The history's two frames and the guide's one make one 3-frame slab (4x4 patches: one tile), in time order.
    assert rows[3] == list(range(5, 37)) + list(range(43, 59))
    assert rows[4] == list(range(83, 83 + 64)) and rows[5] == list(range(147, 195))
    assert sorted(sum(rows, [])) == list(range(layout.sequence_length))
    assert torch.equal(tiles.row_tile[43:59], torch.full((16,), 3))


def test_only_the_first_guide_at_frame_0_goes_on_from_the_history():
    layout, patches = _going_on((GuideBlock(3, 1, 0), GuideBlock(0, 1, 0)))
    segments = segments_before_video(layout)
    assert segments == (5, VideoRun(2), 6, VideoRun(1), VideoRun(1, follows=True), 24)
    tiles = tile_map(segments, patches, 64)
    # The frame-3 guide a tile of its own (16 rows), the history with the frame-0 guide one of 48.
    assert tiles.sizes[3:5].tolist() == [48, 16] and tiles.num_context_tiles == 2
    first_guide = slice(43, 59)  # the frame-3 guide's rows come first in the packing
    assert torch.equal(tiles.row_tile[first_guide], torch.full((16,), 4))


def test_a_first_window_and_guides_without_a_history_keep_their_dense_tiles():
    """Nothing changes where there is no history: a first window, FL2VA's keyframes, guides at any frame."""
    plain = build_t2va(torch.zeros(TEXT, dtype=torch.long), 7, 8, 8, 12)
    guided = build_t2va(torch.zeros(TEXT, dtype=torch.long), 7, 8, 8, 12, keyframes=("first", "last"),
                        guides=(GuideBlock(0, 1, 0),))
    assert plain.context_video == guided.context_video == ()
    assert segments_before_video(plain) == (5, 24) and segments_before_video(guided) == (5, 48, 24)
    assert tile_map(segments_before_video(guided), (7, 4, 4), 64).num_context_tiles == 0


def test_a_bad_video_run_is_refused():
    with pytest.raises(InputError, match=r"^cannot tile a video of \(7, 4, 4\) patches after segments "
                                         r"\(5, VideoRun\(frames=-1, follows=False\)\)$"):
        tile_map((5, VideoRun(-1)), (7, 4, 4), 64)


# ------------------------------------------------------------------------------------------ selection
def test_the_budget_is_the_targets():
    """A query tile keeps the target's count of video tiles (FastVideo's rule on the target), chosen among the
    context tiles and the target's; a budget that keeps the whole target keeps every tile."""
    assert tiles_selected(0.9, 1452) == video_tiles_kept(0.9, 1452) == 146
    assert tiles_selected(0.9, 1452 + 132, 132) == 146  # 1344x768, 294 frames, a 22-frame history
    assert tiles_selected(0.0, 20, 5) == 20 and tiles_selected(0.5, 3, 1) == 1 and tiles_selected(0.5, 0) == 0


def _allowed_pairs(rows, mask):
    """(S, S) bool: query row i may attend to key row j iff j's tile is selected by i's tile (by hand)."""
    s = sum(len(r) for r in rows)
    allowed = torch.zeros(s, s, dtype=torch.bool)
    for qt, q_rows in enumerate(rows):
        for kt, k_rows in enumerate(rows):
            if mask[qt][kt]:
                for i in q_rows:
                    allowed[i, k_rows] = True
    return allowed


def test_the_reference_is_dense_attention_over_the_selected_pairs():
    layout, patches = _going_on()
    tiles = tile_map(segments_before_video(layout), patches, 64)
    rows = [r[r >= 0].tolist() for r in tiles.rows]
    q, k, v = _qkv(layout.sequence_length, heads=1, seed=3)
    scores = coarse_scores(q, k, tiles)[0, 0]
    # sparsity 0.5: the target's 2 tiles keep 1; each video query tile keeps its best of the 3 video tiles.
    mask = [[True] * 6 for _ in range(3)]
    for qt in range(3, 6):
        best = 3 + int(scores[qt, 3:].argmax())
        mask.append([kt < 3 or kt == best for kt in range(6)])
    assert torch.equal(select_tiles(coarse_scores(q, k, tiles), 3, 0.5, 1)[0, 0], torch.tensor(mask))
    allowed = _allowed_pairs(rows, mask)
    logits = torch.einsum("qd,kd->qk", q[0, :, 0], k[0, :, 0]) / math.sqrt(16)
    want = logits.masked_fill(~allowed, float("-inf")).softmax(-1) @ v[0, :, 0]
    got = vsa_reference(q, k, v, None, tiles, 0.5)[0, :, 0]
    assert (got - want).abs().max().item() <= 1e-5
    # The history and guide rows' query tile selected one video tile only: not every target row.
    assert not allowed[5, 83:].all()
    assert (vsa_reference(q, k, v, None, tiles, 0.0) - math_reference(q, k, v)).abs().max().item() <= 1e-5


def test_a_context_tile_is_chosen_where_its_coarse_score_wins():
    """Top-k by coarse score: a target query tile whose keys resemble the history's takes the history's tile
    over the other target tile; one whose keys do not leaves it out."""
    layout, patches = _going_on()
    tiles = tile_map(segments_before_video(layout), patches, 64)
    q, k, v = _qkv(layout.sequence_length, heads=1, seed=4)
    direction = torch.randn(16)
    k[0, tiles.rows[3][:48].long(), 0] += 4 * direction  # the context tile's keys lean one way
    q[0, tiles.rows[4][:64].long(), 0] += 4 * direction  # the first target tile's queries the same way
    q[0, tiles.rows[5][:48].long(), 0] -= 4 * direction  # the second's the other way
    mask = select_tiles(coarse_scores(q, k, tiles), 3, 0.5, 1)[0, 0]
    assert mask[4].tolist() == [True, True, True, True, False, False]
    assert not mask[5, 3]


# ------------------------------------------------------------------------------------------ the kernels
@needs_triton
def test_the_kernels_follow_the_same_tile_map_with_a_history():
    from h3_spark.kernels.vsa import _pooled, selected_lists, tile_lists, vsa_attention
    from h3_spark.kernels.vsa_reference import pooled

    layout = build_t2va(torch.zeros(TEXT, dtype=torch.long), 12, 16, 12, 20, guides=(GuideBlock(0, 1, 0),),
                        history=HistoryBlock(7, 5))
    tiles = tile_map(segments_before_video(layout), (12, 8, 6), 64)
    assert tiles.num_context_tiles == 8 and tiles.num_target_tiles == 12  # 2x2 tiles a slab; 8 and 12 frames
    q, k, v = _qkv(layout.sequence_length, heads=2, seed=5)
    assert torch.allclose(_pooled(q, tiles), pooled(q, tiles), atol=1e-6)
    scores = coarse_scores(q, k, tiles)
    idx, num = selected_lists(scores, tiles.num_prefix_tiles, 0.75, tiles.num_context_tiles)
    want_idx, want_num = tile_lists(select_tiles(scores, tiles.num_prefix_tiles, 0.75, tiles.num_context_tiles))
    assert torch.equal(num, want_num)
    assert int(num[0, 0, -1]) == tiles.num_prefix_tiles + 3  # the target's budget: ceil(0.25 x 12)
    for got_row, want_row, n in zip(idx.flatten(0, 2), want_idx.flatten(0, 2), num.flatten()):
        assert torch.equal(got_row[:n], want_row[:n])
    gate = torch.randn_like(v)
    got = vsa_attention(q, k, v, gate, tiles, 0.75)
    assert (got - vsa_reference(q, k, v, gate, tiles, 0.75)).abs().max().item() <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_kernels_match_the_reference_with_a_history(dtype):
    """On a GPU (TMA on sm_90 and later, and the gather walk): a going-on window's tiling (history and guide as
    context tiles) through the compiled kernels against the reference, at the DiT's head width."""
    from h3_spark.kernels.vsa import GATHER_LAUNCH, _fine, block_sparse_fine, tile_lists, vsa_attention

    layout = build_t2va(torch.zeros(37, dtype=torch.long), 12, 24, 28, 20, guides=(GuideBlock(0, 1, 0),),
                        history=HistoryBlock(7, 5))
    tiles = tile_map(segments_before_video(layout), (12, 12, 14), 64).to("cuda")
    assert tiles.num_context_tiles > 0
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, layout.sequence_length, 4, 128, generator=g).to(dtype).cuda() for _ in range(3))
    mask = select_tiles(coarse_scores(q, k, tiles), tiles.num_prefix_tiles, 0.8, tiles.num_context_tiles)
    want = fine_reference(q, k, v, mask, tiles).float()
    for got in (block_sparse_fine(q, k, v, mask, tiles).float(),
                _fine(q, k, v, *tile_lists(mask), tiles, launch=GATHER_LAUNCH).float()):
        if dtype == torch.float32:
            assert (got - want).abs().max().item() <= 1e-5
        else:
            assert ((got - want).abs() <= want.abs() * 2 ** -6 + 2 ** -8).all()
    if dtype == torch.float32:
        gate = torch.randn_like(v)
        whole = vsa_attention(q, k, v, gate, tiles, 0.8)
        assert (whole - vsa_reference(q, k, v, gate, tiles, 0.8)).abs().max().item() <= 1e-5


# ------------------------------------------------------------------------------------------ the pair counts
def test_the_pairs_receipt_is_what_the_benchmark_counts(tmp_path):
    """receipts/cpu/vsa-history-pairs.json is the script's output, not edited: counted again, it is the same;
    the dense-prefix tiling's count at 294 frames is the one measured before the context tiles (2.51x), and the
    60 s film's window that goes on now costs <= 1.15x a first window."""
    import json
    import runpy
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    receipt = json.loads((root / "receipts/cpu/vsa-history-pairs.json").read_text())
    main = runpy.run_path(str(root / "benchmarks/vsa_pairs_cpu.py"))["main"]
    argv = receipt["command"].split()[2:]
    argv[argv.index("--out") + 1] = str(tmp_path / "pairs.json")
    main(argv)
    again = json.loads((tmp_path / "pairs.json").read_text())
    assert again["films"] == receipt["films"]
    sixty = next(f for f in receipt["films"] if f["film_seconds"] == 60 and f["history_frames"] == 22)
    assert sixty["window_frames"] == 294 and sixty["first_window"]["computed_pairs"] == pytest.approx(9.994e8, rel=1e-3)
    assert sixty["going_on"]["dense_prefix"]["vs_first_window"]["computed_pairs"] == 2.515
    assert max(sixty["going_on"]["context_tiles"]["vs_first_window"].values()) <= 1.15
