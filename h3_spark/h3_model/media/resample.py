"""Band-limited audio resampling: a Hann-windowed sinc filter bank applied as a strided convolution.

H3's reference pipeline puts a reference soundtrack on the audio VAE's 32 kHz with torchaudio's default
resampler (the reference resamples to 32 kHz with torchaudio): sinc interpolation under a Hann window
six zero crossings wide, cut off at 99 % of the lower of the two Nyquist frequencies. This module is that
filter, so the audio conditioning matches the reference (tests/test_resample.py checks it against a direct
evaluation of the interpolation sum, and against torchaudio where torchaudio is installed).

With the rates reduced by their common divisor to `orig` -> `new`, output sample j of every block of `new`
sits j / new input samples into the block; its weights over the input samples k around it are
    w(t) = (c / orig) * sinc(t) * cos^2(pi t / 12),   t = c (k / orig - j / new) clamped to +-6,
where c = 0.99 * min(orig, new) is the cut-off in the reduced units. The `new` rows of weights are built
once per rate pair in float64 (but for the phases j / new, float32 like the reference's) and applied in
float32.
"""

from __future__ import annotations

import math
import operator
from functools import lru_cache

import torch
import torch.nn.functional as F

from ...errors import InputError

ZERO_CROSSINGS = 6
ROLLOFF = 0.99
# A rate pair with no large common divisor (44,099 Hz -> 32 kHz) would need tens of thousands of filter rows.
MAX_BANK_ELEMENTS = 1 << 24


def _hz(name: str, value) -> int:
    """A rate as a positive int; integer types other than int (numpy's) are taken, floats and bools are not."""
    try:
        hz = operator.index(value) if not isinstance(value, bool) else -1
    except TypeError:
        hz = -1
    if hz <= 0:
        raise InputError(f"{name} must be a positive integer number of Hz, got {value!r}")
    return hz


def _reduced(rate, target) -> tuple[int, int]:
    rate, target = _hz("sample rate", rate), _hz("target sample rate", target)
    g = math.gcd(rate, target)
    return rate // g, target // g


@lru_cache(maxsize=8)
def filter_bank(orig: int, new: int) -> tuple[torch.Tensor, int]:
    """(new, 1, taps) float32 weights for reduced rates orig -> new, and how many samples pad each side."""
    cutoff = ROLLOFF * min(orig, new)
    width = math.ceil(ZERO_CROSSINGS * orig / cutoff)
    taps = 2 * width + orig
    if new * taps > MAX_BANK_ELEMENTS:
        raise InputError(f"resampling {orig} -> {new} (after dividing out their common factor) needs a "
                         f"{new} x {taps} filter bank; convert the audio to a standard rate (48000 or 44100 Hz) "
                         f"first")
    k = torch.arange(-width, width + orig, dtype=torch.float64) / orig
    # The output phases j / new are rounded to float32, the rest is float64: how the reference's filter comes
    # out (torchaudio builds that one term in the default dtype), up to 1.4e-5 away from exact phases.
    j = (torch.arange(new, dtype=torch.float32) / new).double()[:, None]
    t = ((k - j) * cutoff).clamp(-ZERO_CROSSINGS, ZERO_CROSSINGS)
    window = torch.cos(t * (math.pi / (2 * ZERO_CROSSINGS))) ** 2
    x = t * math.pi
    sinc = torch.where(x == 0, torch.ones_like(x), torch.sin(x) / x)
    return (sinc * window * (cutoff / orig)).to(torch.float32)[:, None, :], width


def resample(audio: torch.Tensor, rate: int, target: int) -> torch.Tensor:
    """float (..., N) at `rate` Hz -> float32 (..., ceil(N * target / rate)) at `target` Hz."""
    orig, new = _reduced(rate, target)
    audio = torch.as_tensor(audio)
    if not audio.is_floating_point():
        raise InputError(f"audio must be a floating-point waveform, got {audio.dtype}")
    if audio.ndim == 0:
        raise InputError("audio must have a time axis")
    audio = audio.to(torch.float32)
    if orig == new:
        return audio.clone()
    bank, width = filter_bank(orig, new)
    lead, n = audio.shape[:-1], audio.shape[-1]
    rows = audio.reshape(-1, n)
    out = F.conv1d(F.pad(rows, (width, width + orig))[:, None], bank.to(rows.device), stride=orig)
    out = out.transpose(1, 2).reshape(rows.shape[0], -1)[:, : -(-new * n // orig)]
    return out.reshape(*lead, -1)
