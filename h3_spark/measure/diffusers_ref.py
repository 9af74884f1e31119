"""diffusers' MiniMaxH3Transformer3DModel on the very tensors our model holds (no second copy).

Used only by `bench --vs diffusers`; diffusers is imported here lazily and is not a dependency
of the package.
"""

from __future__ import annotations

import torch

from ..errors import H3Error


def diffusers_transformer_class():
    """diffusers' H3 transformer class, or an H3Error saying why it cannot be imported."""
    try:
        from diffusers import MiniMaxH3Transformer3DModel
    # A broken install fails in more ways than ImportError (a bad dependency raises AttributeError,
    # RuntimeError, OSError...); every one of them is the user's install to fix, not a bug here.
    except Exception as exc:  # noqa: BLE001
        detail = (str(exc).splitlines() or [""])[0]
        raise H3Error(f"--vs diffusers needs diffusers==0.42.1 installed and importable "
                      f"({type(exc).__name__}: {detail})") from None
    return MiniMaxH3Transformer3DModel


def diffusers_twin(model):
    """A diffusers transformer whose parameters are our model's parameter objects."""
    MiniMaxH3Transformer3DModel = diffusers_transformer_class()
    cfg = model.config.to_dict()
    if model.config.curve_form:
        raise H3Error("diffusers cannot run pruned (curve-form) checkpoints; compare a full checkpoint")
    with torch.device("meta"):
        twin = MiniMaxH3Transformer3DModel(**cfg)
    ours = dict(model.named_parameters())
    theirs = dict(twin.named_parameters())
    if set(ours) != set(theirs):
        diff = sorted(set(ours) ^ set(theirs))
        raise H3Error(f"parameter names differ from diffusers': {diff[:3]}")
    for name, param in ours.items():
        owner_name, _, attr = name.rpartition(".")
        setattr(twin.get_submodule(owner_name) if owner_name else twin, attr, param)
    device = model.proj_in.weight.device
    rope = twin.rope
    rope.inv_freq = 1.0 / (rope_theta(model) ** (torch.arange(0, 2 * rope.rope_freq_dim, 2, dtype=torch.float32,
                                                              device=device) / (2 * rope.rope_freq_dim)))
    return twin.eval()


def rope_theta(model) -> float:
    return float(model.config.rope_theta)


def forward_kwargs(inputs: dict) -> dict:
    return {k: inputs[k] for k in ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep",
                                  "timestep_indices", "token_tags", "position_ids", "video_indices", "audio_indices",
                                  "text_indices")}


def set_backend(twin, backend: str) -> None:
    try:
        twin.set_attention_backend(backend)
    except Exception as exc:  # diffusers raises several types for an unavailable backend
        raise H3Error(f"diffusers attention backend {backend!r} is not available here: {exc}") from None
