"""Every planned component's files and configs, checked before any weight is read.

A generation reads ~130 GB (the DiT, then the text encoder, then the VAEs); a missing shard, a config that
contradicts its tensors or two components that do not belong together must not be found after the first of
them has loaded. Each component's own check reads only its configs and safetensors / GGUF headers (the loaders
refuse the same things again when they read the weights); then the widths the DiT reads are compared with what
the text encoder and the VAEs give, naming the files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ...errors import InputError
from .loading import LoadOptions


@dataclass
class Checked:
    """What the checks learnt of the planned components (None: not planned, or built by an override)."""

    dits: dict  # "dit" / "dit_ref" -> (DiTConfig, the quantization formats its layers are stored in)
    text_hidden: int | None = None
    video_latents: int | None = None
    audio_latents: int | None = None


def check_files(plan: Mapping[str, object], options: LoadOptions, tokenizer: Path | None,
                skip: set[str] | frozenset = frozenset()) -> Checked:
    """Check each planned component in `plan` (name -> path) but those in `skip`; then that they fit together."""
    from ..checkpoint import open_dit, stored_formats
    from ..text.encoder import check_text_encoder
    from ..vae.loading import check_audio_vae, check_video_vae

    checked = Checked(dits={})
    for key in ("dit", "dit_ref"):
        if key in plan and key not in skip:
            reader = open_dit(plan[key], partition="t2va" if key == "dit" else "ref2va",
                              qkv_layout=options.qkv_layout)
            try:
                reader.check()
                checked.dits[key] = (reader.config, stored_formats(reader))
            finally:
                reader.source.close()
    if "text_encoder" in plan and "text_encoder" not in skip:
        checked.text_hidden = check_text_encoder(plan["text_encoder"], tokenizer=tokenizer, layer=options.text_layer,
                                                 vision=options.text_vision)
    if "vae" in plan and "vae" not in skip:
        checked.video_latents = check_video_vae(plan["vae"]).latent_channels
    if "audio_vae" in plan and "audio_vae" not in skip:
        checked.audio_latents = check_audio_vae(plan["audio_vae"]).latent_channels
    _check_widths(checked, plan)
    return checked


def _check_widths(checked: Checked, plan: Mapping[str, object]) -> None:
    """The widths each DiT reads against what the other components give (check_fit's test, before loading)."""
    for key, (config, _) in checked.dits.items():
        pairs = [("text_encoder", "hidden size", checked.text_hidden, "text_dim", config.text_dim),
                 ("vae", "latent channels", checked.video_latents, "in_channels", config.in_channels),
                 ("audio_vae", "latent channels", checked.audio_latents, "audio_in_channels",
                  config.audio_in_channels)]
        for name, what, have, field, want in pairs:
            if have is not None and have != want:
                raise InputError(f"the {name.replace('_', ' ')} {plan[name]} has {what} {have} but the DiT "
                                 f"{plan[key]} reads {want} ({field}): these components do not belong together")
