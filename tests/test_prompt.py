"""Prompt presentation (h3_model/prompt.py) against diffusers 0.42.1's own text-encoder steps.

The oracle is diffusers' MiniMaxH3{,FL2VA,Ref2VA}TextEncoderStep run standalone on the tiny
tokenizer and processor (tests/fixtures/qwen_tiny.py): token ids, tags and vision inputs must be
identical, not merely close. Label text and numbering are also checked by hand.
"""

import pytest
import torch

from fixtures import qwen_tiny as Q
from h3_spark.errors import InputError
from h3_spark.h3_model.text.prompt import AudioRef, ImageRef, PresentationBuilder, VideoRef, presentation_hash

pytestmark = pytest.mark.skipif(not Q.HAS_TORCHVISION, reason="transformers' Qwen3-VL processor needs torchvision")

KEYFRAMES = [Q.image(40, 56, 1), Q.image(40, 56, 2)]
# Image, video with a soundtrack (30 frames: 3 sampled, padded to 2 blocks), audio, image, silent
# video of the minimum length (13 frames: 2 sampled, 1 block).
REFERENCES = [("image", Q.image(32, 48, 3)), ("video", Q.video(30, 32, 40, 4), True), ("audio",),
              ("image", Q.image(48, 32, 5)), ("video", Q.video(13, 24, 40, 6), False)]
PROMPT = "the cat <d>says</d> the end"


@pytest.fixture(scope="module")
def tiny():
    tok = Q.make_tokenizer()
    proc = Q.make_processor(tok)
    model = Q.make_reference_model(tok)
    return tok, proc, model, PresentationBuilder(tok, proc)


def _ours(builder, mode, prompt=PROMPT):
    if mode == "t2va":
        return builder.t2va(prompt)
    if mode == "fl2va":
        return builder.fl2va(prompt, KEYFRAMES)
    return builder.ref2va(prompt, [Q.ours_reference(r) for r in REFERENCES])


@pytest.mark.parametrize("mode", ["t2va", "fl2va", "ref2va"])
def test_presentation_equals_diffusers(tiny, mode):
    tok, proc, model, builder = tiny
    theirs = Q.diffusers_run(mode, model, tok, proc, PROMPT, keyframes=KEYFRAMES, references=REFERENCES)
    ours = _ours(builder, mode)
    assert ours.token_ids.tolist() == theirs["token_ids"]
    assert torch.equal(ours.tags, theirs["tags"])
    assert sorted(ours.vision) == sorted(theirs["vision"])
    for key, value in theirs["vision"].items():
        assert torch.equal(ours.vision[key], value), key


@pytest.mark.parametrize("mode, prompt", [("fl2va", ""), ("ref2va", ""), ("fl2va", " \n"), ("ref2va", "\t"),
                                          ("t2va", " "), ("t2va", "\n\n")])
def test_prompts_without_words_present_as_diffusers_does(tiny, mode, prompt):
    """diffusers tokenizes the prompt verbatim and appends it, so an empty one leaves the labelled keyframes or
    references alone, and whitespace is kept as tokens."""
    tok, proc, model, builder = tiny
    theirs = Q.diffusers_run(mode, model, tok, proc, prompt, keyframes=KEYFRAMES, references=REFERENCES)
    ours = _ours(builder, mode, prompt)
    assert ours.token_ids.tolist() == theirs["token_ids"]
    assert torch.equal(ours.tags, theirs["tags"])
    assert sorted(ours.vision) == sorted(theirs["vision"])
    for key, value in theirs["vision"].items():
        assert torch.equal(ours.vision[key], value), key
    if prompt == "":
        assert ours.token_ids[-1] == tok.convert_tokens_to_ids("<|vision_end|>")


def test_an_empty_t2va_prompt_is_refused_where_diffusers_fails(tiny):
    """With nothing to present diffusers hands Qwen an empty sequence, which fails inside transformers; ours
    refuses it by name before the text encoder runs."""
    tok, proc, model, builder = tiny
    with pytest.raises(RuntimeError, match="0 elements"):
        Q.diffusers_run("t2va", model, tok, proc, "")
    with pytest.raises(InputError, match="t2va needs a prompt"):
        builder.t2va("")


@pytest.mark.parametrize("count", [13, 21])
def test_a_prepared_reference_of_the_shortest_lengths_presents_as_diffusers(tiny, count):
    """The shortest accepted references (one vision block; 21 frames, still under one VAE chunk) through
    prepare_references, with no prompt, against diffusers' set-up step and text encoder."""
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep

    from h3_spark.h3_model.media import refs

    tok, proc, model, builder = tiny
    frames = Q.video(count, 1344 // 8, 768 // 8, 9)
    prepared = refs.prepare_references([refs.VideoReference(frames, fps=24.0)], width=1344, height=768, frames=124)
    assert prepared[0].pixels.shape[0] == prepared[0].prompt_pixels.shape[0] == count
    theirs_frames = MiniMaxH3Ref2VASetupStep._normalize_video_condition(frames.numpy(), 24.0, 124, 32, 768,
                                                                       768 * 1344, 24.0)
    theirs = Q.diffusers_run("ref2va", model, tok, proc, "", references=[("video", torch.from_numpy(theirs_frames),
                                                                           False)])
    ours = builder.ref2va("", refs.prompt_references(prepared))
    assert ours.token_ids.tolist() == theirs["token_ids"]
    assert torch.equal(ours.tags, theirs["tags"])
    for key, value in theirs["vision"].items():
        assert torch.equal(ours.vision[key], value), key


def test_a_prepared_short_video_reference_shows_qwen_every_frame(tiny):
    """A reference shorter than the generation: the VAE takes it snapped down to 17n+5, but Qwen sees all its
    frames, as diffusers' set-up step normalises them (the oracle here)."""
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep

    from h3_spark.h3_model.media import refs

    tok, proc, model, builder = tiny
    frames = Q.video(100, 1344 // 8, 768 // 8, 3)
    prepared = refs.prepare_references([refs.VideoReference(frames, fps=24.0)], width=1344, height=768, frames=124)
    assert prepared[0].pixels.shape[0] == 90 and prepared[0].prompt_pixels.shape[0] == 100  # 17 * 5 + 5 for the VAE
    theirs_frames = MiniMaxH3Ref2VASetupStep._normalize_video_condition(frames.numpy(), 24.0, 124, 32, 768,
                                                                       768 * 1344, 24.0)
    theirs = Q.diffusers_run("ref2va", model, tok, proc, "go",
                             references=[("video", torch.from_numpy(theirs_frames), False)])
    ours = builder.ref2va("go", refs.prompt_references(prepared))
    assert ours.token_ids.tolist() == theirs["token_ids"]
    for key, value in theirs["vision"].items():
        assert torch.equal(ours.vision[key], value), key


def test_t2va_is_the_prompt_verbatim_with_dialogue_tokens_kept(tiny):
    tok, _, _, builder = tiny
    p = builder.t2va(PROMPT)
    assert p.token_ids.tolist() == tok(PROMPT, add_special_tokens=False)["input_ids"]
    assert p.tags.tolist() == [1] * len(p)
    assert p.vision == {}
    # <d> is one added token in the MiniMax tokenizer; it stays in the stream, and nothing is added.
    assert tok.convert_tokens_to_ids("<d>") in p.token_ids.tolist()
    assert tok.decode(p.token_ids.tolist()) == PROMPT


def _segments(tok, p):
    """The presentation as (text, tag) runs with vision blocks summarised as [pad x N]."""
    out, ids, tags = [], p.token_ids.tolist(), p.tags.tolist()
    i = 0
    while i < len(ids):
        j = i
        while j < len(ids) and tags[j] == tags[i]:
            j += 1
        if tags[i] == 0:
            run = tok.convert_ids_to_tokens(ids[i:j])
            blocks = "".join(f"[{run[k + 1]} x {run.index('<|vision_end|>', k) - k - 1}]"
                             for k in range(len(run)) if run[k] == "<|vision_start|>")
            out.append(blocks)
        else:
            out.append(tok.decode(ids[i:j]))
        i = j
    return out


def test_ref2va_labels_by_hand(tiny):
    tok, _, _, builder = tiny
    p = builder.ref2va("go", [Q.ours_reference(r) for r in REFERENCES])
    # 32x48 -> 8x12 patches -> 24 tokens; 48x32 likewise; video frames 32x40 -> 20 tokens per block,
    # 24x40 -> 15. Timestamps: 2 fps frames 0, .5, 1 (+1 repeated) -> blocks at .25 and 1.0; ".1f"
    # rounds .25 to "0.2".
    assert _segments(tok, p) == [
        "<Picture 1>: ", "[<|image_pad|> x 24]",
        "<Audio 1>: <Video 1>: <0.2 seconds>", "[<|video_pad|> x 20]", "<1.0 seconds>", "[<|video_pad|> x 20]",
        "<Audio 2>: <Picture 2>: ", "[<|image_pad|> x 24]",
        "<Video 2>: <0.2 seconds>", "[<|video_pad|> x 15]",
        "go"]
    assert p.vision["image_grid_thw"].tolist() == [[1, 8, 12], [1, 12, 8]]
    assert p.vision["video_grid_thw"].tolist() == [[2, 8, 10], [1, 6, 10]]


def test_fl2va_labels_by_hand(tiny):
    tok, proc, _, builder = tiny
    p = builder.fl2va("x", KEYFRAMES)
    # A 40x56 keyframe fits the processor's pixel budget, so it keeps its size: 10x14 patches, 35 tokens.
    assert _segments(tok, p) == ["<Picture 1>: ", "[<|image_pad|> x 35]", "<Picture 2>: ", "[<|image_pad|> x 35]",
                                 "x"]
    assert p.vision["image_grid_thw"].tolist() == [[1, 10, 14]] * 2
    assert _segments(tok, builder.fl2va("x", KEYFRAMES[:1])) == ["<Picture 1>: ", "[<|image_pad|> x 35]", "x"]


def test_video_sampling_at_2_fps(tiny):
    builder = tiny[3]
    frames = Q.video(49, 8, 8, 7)
    picked, times = builder.sample_video(frames)
    assert torch.equal(picked, frames[[0, 12, 24, 36, 48]])
    assert times == [0.25, 1.25, 2.0]  # pairs (0, .5), (1, 1.5), (2, 2 repeated)
    assert builder.sample_video(Q.video(13, 8, 8, 7))[1] == [0.25]
    with pytest.raises(InputError, match="needs at least 13 frames at 24 fps; got 12"):
        builder.sample_video(Q.video(12, 8, 8, 7))


def test_token_hash_identifies_ids_tags_and_pixels(tiny):
    builder = tiny[3]
    a = builder.fl2va("x", KEYFRAMES)
    assert builder.fl2va("x", [k.clone() for k in KEYFRAMES]).token_hash == a.token_hash
    changed = KEYFRAMES[1].clone()
    changed[0, 0, 0] ^= 1
    assert builder.fl2va("x", [KEYFRAMES[0], changed]).token_hash != a.token_hash
    assert builder.fl2va("y", KEYFRAMES).token_hash != a.token_hash
    assert presentation_hash(a.token_ids, a.tags, a.vision) == a.token_hash
    assert presentation_hash(a.token_ids, 1 - a.tags, a.vision) != a.token_hash


@pytest.mark.parametrize("call, message", [
    (lambda b: b.ref2va("x", ["a string"]), r"reference 1: unsupported reference kind str; use ImageRef"),
    (lambda b: b.ref2va("x", [AudioRef(), {"kind": "image"}]), r"reference 2: unsupported reference kind dict"),
    (lambda b: b.ref2va("x", [ImageRef(Q.image(8, 8, 0).float())]), r"reference 1 \(image\) must be a uint8 tensor"),
    (lambda b: b.ref2va("x", [ImageRef(Q.image(8, 8, 0).permute(2, 0, 1))]), r"\(H, W, 3\) \(channels last\)"),
    (lambda b: b.ref2va("x", [VideoRef(Q.image(8, 8, 0))]),
     r"reference 1 \(video\) must be a uint8 tensor \(T, H, W, 3\)"),
    (lambda b: b.ref2va("x", [VideoRef(Q.video(5, 8, 8, 0))]), r"needs at least 13 frames"),
    (lambda b: b.fl2va("x", KEYFRAMES * 2), r"at most 2 keyframes \(first, last\), got 4"),
    (lambda b: b.fl2va("x", [KEYFRAMES[0].numpy()]), r"keyframe 1 must be a uint8 torch tensor"),
    (lambda b: b.t2va(None), r"the prompt must be a string, got NoneType"),
    (lambda b: b.t2va(""), r"t2va needs a prompt: it is all the text encoder reads \(fl2va and ref2va may leave "
                           r"it empty"),
    (lambda b: b.fl2va(None, KEYFRAMES), r"the prompt must be a string, got NoneType"),
    (lambda b: b.ref2va(b"x", [AudioRef()]), r"the prompt must be a string, got bytes"),
    (lambda b: b.fl2va("a <|image_pad|> cat", KEYFRAMES), r"the prompt contains <\|image_pad\|>: vision markers are "
                                                          r"placed by h3-spark, not typed"),
    (lambda b: b.t2va("<|vision_start|>x<|video_pad|>"), r"contains <\|vision_start\|>, <\|video_pad\|>"),
])
def test_bad_inputs(tiny, call, message):
    with pytest.raises(InputError, match=message):
        call(tiny[3])


def test_audio_only_and_empty_prompt_is_labels_only(tiny):
    tok, _, _, builder = tiny
    p = builder.ref2va("", [AudioRef(), AudioRef()])
    assert tok.decode(p.token_ids.tolist()) == "<Audio 1>: <Audio 2>: "
    assert p.vision == {}


# ------------------------------------------------------------------------------------------ named references
from h3_spark.h3_model.text.prompt import check_mentions  # noqa: E402


@pytest.mark.parametrize("mode, prompt, counts, message", [
    ("ref2va", "the singer of <Picture 3> dances", (1, 0, 0),
     r"the prompt names <Picture 3>, but this request gives 1 image reference \(<Picture 1>\)$"),
    ("ref2va", "<Picture 1> sings <Video 2>", (2, 1, 0),
     r"names <Video 2>, but this request gives 1 video reference \(<Video 1>\)$"),
    ("ref2va", "<Audio 3> plays", (0, 1, 2), r"names <Audio 3>, but this request gives 2 audio references "
                                             r"\(<Audio 1>..<Audio 2>\)$"),
    ("ref2va", "<Video 1> at night", (3, 0, 0), r"names <Video 1>, but this request gives no video reference$"),
    ("t2va", "a fox like <Picture 1>", (0, 0, 0), r"gives no image reference \(t2va takes none\)$"),
    ("fl2va", "from <Picture 1> to <Picture 2>", (1, 0, 0),
     r"names <Picture 2>, but this request gives 1 keyframe \(<Picture 1>\)$"),
    ("ref2va", "<Picture 0> is the dog", (1, 0, 0), r"names <Picture 0>"),
    # A near miss of a label the request does give reaches the model as plain text: the reference would be ignored.
    ("ref2va", "<picture 1> is the dog", (1, 0, 0), r"writes <picture 1>; the model knows a reference only as "
                                                    r"<Picture 1> \(capital letter, one space\)$"),
    ("t2va", "a fox < Video 2 >", (0, 0, 0), r"writes < Video 2 >; the model knows a reference only as <Video 2>"),
])
def test_a_prompt_naming_a_reference_that_is_not_given_is_refused(mode, prompt, counts, message):
    with pytest.raises(InputError, match=message):
        check_mentions(mode, prompt, *counts)


def test_prompts_naming_what_is_given_pass():
    check_mentions("ref2va", "<Picture 1> and <Picture 2> dance to <Audio 1>; <Video 1> is the street", 2, 1, 1)
    check_mentions("t2va", "a picture of a fox <Picture> and <picture>")  # no number: not a label, left to the model
    check_mentions("fl2va", "<Picture 1> turns into <Picture 2>", 2)
