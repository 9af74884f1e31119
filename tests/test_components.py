"""Components loaded one by one are checked to belong together before anything runs."""

import types

import pytest

from h3_spark.h3_model.engine.loading import check_fit
from h3_spark.h3_model.pipeline.generation import Components
from h3_spark.h3_model.dit.config import TINY
from h3_spark.errors import InputError


def _parts(text_width=TINY.text_dim, video_channels=TINY.in_channels, audio_channels=TINY.audio_in_channels):
    return Components(dit=types.SimpleNamespace(config=TINY),
                      text_encoder=types.SimpleNamespace(hidden_size=text_width),
                      vae=types.SimpleNamespace(config=types.SimpleNamespace(latent_channels=video_channels)),
                      audio_vae=types.SimpleNamespace(config=types.SimpleNamespace(latent_channels=audio_channels)))


def test_matching_components_pass():
    check_fit(_parts())


@pytest.mark.parametrize("change, message", [
    ({"text_width": 32}, r"the text encoder hidden size is 32 but the DiT \(dit\) reads 24 \(text_dim\)"),
    ({"video_channels": 16}, r"the video VAE latent channels is 16 but the DiT \(dit\) reads 4 \(in_channels\)"),
    ({"audio_channels": 64}, r"the audio VAE latent channels is 64 but the DiT \(dit\) reads 8 \(audio_in_channels\)"),
])
def test_mismatched_components_are_named(change, message):
    with pytest.raises(InputError, match=message + ": these components do not belong together"):
        check_fit(_parts(**change))
