"""The stand-in tokenizer and the tiny Qwen3-VL the demo, the tests and the synthetic writers share.

Real H3 weights and MiniMaxAI's tokenizer cannot be fetched here. A byte-level BPE over the 256 byte symbols,
a few merges and Qwen3-VL's special tokens stands in for the tokenizer (its vision tokens get the ids the model
splices vision features into), and transformers' Qwen3-VL processors make the vision tokens. It lives beside
the text encoder so that `text/synthetic.py` (make-checkpoint's writer) and `engine/demo.py` both import it
downwards.
"""

from __future__ import annotations

SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<d>", "</d>"]
MERGES = [("Ġ", "a"), ("t", "h"), ("th", "e"), ("Ġ", "the"), ("e", "r"), ("<", "P"), ("Ġ", "s"), ("e", "c")]
TEXT_HIDDEN = 32
TEXT_LAYERS = 4
TEXT_READ_LAYER = 2  # the tiny model is read at hidden_states[2] the way the released model is at [50]


def make_tokenizer():
    """Byte-level BPE over the 256 byte symbols plus a few merges and Qwen3-VL's special tokens."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2TokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for pair in MERGES:
        vocab["".join(pair)] = len(vocab)
    tok = Qwen2TokenizerFast(vocab=vocab, merges=MERGES)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    return tok


def make_processor(tokenizer, patch_size: int = 4, image_pixels: tuple[int, int] = (64, 64 * 64),
                   video_pixels: tuple[int, int] = (64, 48 * 48 * 4)):
    """transformers' Qwen3-VL processors; the demo's 4-pixel patch makes few tokens from small images,
    the released geometry is a 16-pixel patch (32 px per merged vision token)."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    common = dict(patch_size=patch_size, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                  image_std=[0.5] * 3)
    images = Qwen2VLImageProcessor(size={"shortest_edge": image_pixels[0], "longest_edge": image_pixels[1]}, **common)
    videos = Qwen3VLVideoProcessor(size={"shortest_edge": video_pixels[0], "longest_edge": video_pixels[1]}, **common)
    return Qwen3VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=videos)


TINY_TEXT = dict(hidden_size=TEXT_HIDDEN, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, rms_norm_eps=1e-6,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                  "mrope_interleaved": True})
TINY_VISION = dict(depth=3, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4, temporal_patch_size=2,
                   spatial_merge_size=2, out_hidden_size=TEXT_HIDDEN, num_position_embeddings=16,
                   deepstack_visual_indexes=[0, 1])


def text_config(tokenizer, layers: int = TEXT_LAYERS, text: dict | None = None, vision: dict | None = None,
                vocab_size: int | None = None):
    """A Qwen3-VL config whose special-token ids are this tokenizer's; `text`/`vision` give the sizes
    (the tiny demo's by default)."""
    from transformers import Qwen3VLConfig

    ids = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    text = dict(text or TINY_TEXT, vocab_size=vocab_size or len(tokenizer), num_hidden_layers=layers)
    return Qwen3VLConfig(text_config=text, vision_config=dict(vision or TINY_VISION), image_token_id=ids[0],
                         video_token_id=ids[1], vision_start_token_id=ids[2], vision_end_token_id=ids[3])
