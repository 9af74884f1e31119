"""GenerationRequest.validate: which prompts a mode takes, checked before anything loads."""

import pytest
import torch

from h3_spark.errors import InputError
from h3_spark.h3_model.pipeline.generation import GenerationRequest
from h3_spark.h3_model.media.refs import ImageReference, VideoReference


def _image(seed):
    return torch.randint(0, 256, (48, 80, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _request(mode, prompt):
    if mode == "fl2va":
        return GenerationRequest("fl2va", prompt, last_frame=_image(1))
    if mode == "ref2va":
        clip = torch.randint(0, 256, (13, 36, 64, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
        return GenerationRequest("ref2va", prompt, references=[ImageReference(_image(3)), VideoReference(clip)])
    return GenerationRequest("t2va", prompt)


@pytest.mark.parametrize("mode, prompt", [("fl2va", ""), ("ref2va", ""), ("fl2va", "  "), ("t2va", " "),
                                          ("t2va", "\n"), ("ref2va", "<Picture 1> walks")])
def test_prompts_the_reference_pipeline_takes_are_taken(mode, prompt):
    _request(mode, prompt).validate()


@pytest.mark.parametrize("mode, prompt, message", [
    ("t2va", "", r"t2va needs a prompt: it is all the text encoder reads \(fl2va and ref2va may leave it empty"),
    ("fl2va", None, "the prompt must be a string, got NoneType"),
    ("ref2va", ["a", "cat"], "the prompt must be a string, got list"),
    ("ref2va", "<Picture 2> walks", r"names <Picture 2>, but this request gives 1 image reference"),
    ("ref2va", "<Audio 1> plays", r"names <Audio 1>, but this request gives no audio reference"),  # silent video
    ("fl2va", "<Picture 2> ends it", r"names <Picture 2>, but this request gives 1 keyframe"),
    ("t2va", "a fox as in <Video 1>", r"gives no video reference \(t2va takes none\)"),
])
def test_prompts_it_cannot_use_are_refused(mode, prompt, message):
    with pytest.raises(InputError, match=message):
        _request(mode, prompt).validate()
