"""The reference soundtrack resampler (h3_model/resample.py).

Oracles: a direct evaluation of the windowed-sinc interpolation sum, output sample by output sample (no filter
bank, no padding, no strides), within 1e-6 absolute on unit-scale noise; torchaudio's Resample (what the
reference pipeline runs) within 1e-6 where torchaudio is installed (not in CI, whose torch has no torchaudio;
run on the GPU machine's image); a band-limited tone, which resampling must
carry to the new rate (1e-3 away from the ends).
"""

import math

import numpy as np
import pytest
import torch

from h3_spark.errors import InputError
from h3_spark.h3_model.media.resample import ROLLOFF, ZERO_CROSSINGS, filter_bank, resample

RATES = [(48000, 32000), (44100, 32000), (16000, 32000), (22050, 32000), (96000, 32000), (8000, 32000)]


def direct(x: torch.Tensor, rate: int, target: int) -> torch.Tensor:
    """y[J] = sum_K x[K] w(t), t = c (K / orig - b - p) in the reduced rates: output J = b new + j sits
    b + p input blocks in, p = j / new rounded to float32 (as the reference filter rounds it); float64."""
    g = math.gcd(rate, target)
    orig, new = rate // g, target // g
    c = ROLLOFF * min(orig, new)
    n = x.shape[-1]
    out = torch.arange(-(-new * n // orig))
    p = ((out % new).float() / new).double()
    at = (out // new).double() + p
    k = torch.arange(n, dtype=torch.float64)
    t = ((k[None, :] / orig - at[:, None]) * c).clamp(-ZERO_CROSSINGS, ZERO_CROSSINGS)
    w = torch.where(t == 0, 1.0, torch.sin(math.pi * t) / (math.pi * t)) * torch.cos(math.pi * t / 12) ** 2 * c / orig
    return x.double() @ w.T


@pytest.mark.parametrize("rate, target", RATES)
def test_matches_the_interpolation_sum(rate, target):
    x = torch.randn(2, 1500, generator=torch.Generator().manual_seed(rate))
    got = resample(x, rate, target)
    want = direct(x, rate, target)
    assert got.shape == want.shape == (2, math.ceil(1500 * target / rate))
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() <= 1e-6


@pytest.mark.parametrize("rate, target", RATES[:4])
def test_matches_torchaudio(rate, target):
    torchaudio = pytest.importorskip("torchaudio")
    x = torch.randn(2, 24011, generator=torch.Generator().manual_seed(1))
    want = torchaudio.transforms.Resample(rate, target)(x)
    got = resample(x, rate, target)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-6


def test_carries_a_tone_to_the_new_rate():
    f, n = 1000.0, 48000
    x = torch.sin(2 * math.pi * f * torch.arange(n, dtype=torch.float64) / 48000).float()
    y = resample(x, 48000, 32000)
    want = torch.sin(2 * math.pi * f * torch.arange(y.shape[-1], dtype=torch.float64) / 32000).float()
    inner = slice(200, -200)
    assert (y[inner] - want[inner]).abs().max().item() <= 1e-3


def test_shapes_and_the_identity():
    x = torch.randn(3, 2, 777)
    assert resample(x, 44100, 32000).shape == (3, 2, math.ceil(777 * 320 / 441))
    assert torch.equal(resample(x, np.int64(44100), 32000), resample(x, 44100, 32000))  # rates from numpy
    same = resample(x.double(), 32000, 32000)
    assert same.dtype == torch.float32 and torch.equal(same, x)


def test_filter_bank_rows_sum_to_one():
    # Each output sample is a weighted average of its neighbours: the weights of a row add up to ~1 (DC passes).
    bank, _ = filter_bank(441, 320)
    sums = bank[:, 0].double().sum(-1)
    assert (sums - 1).abs().max().item() <= 2e-3


@pytest.mark.parametrize("args, message", [
    ((0, 32000), "sample rate must be a positive integer"),
    ((48000.0, 32000), "sample rate must be a positive integer"),
    ((48000, -1), "target sample rate must be a positive integer"),
    ((True, 32000), "sample rate must be a positive integer"),
    ((44099, 32000), "convert the audio to a standard rate"),
])
def test_bad_rates(args, message):
    with pytest.raises(InputError, match=message):
        resample(torch.randn(2, 100), *args)


def test_bad_waveforms():
    with pytest.raises(InputError, match="floating-point waveform"):
        resample(torch.ones(2, 10, dtype=torch.int16), 48000, 32000)
    with pytest.raises(InputError, match="time axis"):
        resample(torch.tensor(1.0), 48000, 32000)
