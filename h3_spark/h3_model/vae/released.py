"""MiniMaxAI's own VAE folders (`video_vae/`, `audio_vae/` of the per-mode download), in our configs' terms.

video_vae/: `config.json` is a wrapper (`_class_name` MiniMaxH3VideoVAE) that names the weights
(`source_path` / `source_safetensors_path`: source/model.safetensors) and carries the latent statistics and
the temporal geometry (`vae_clip_length`, `vae_token_drop`); `source/config.json` (AutoencoderKLLegacy) holds
the architecture in the original trainer's field names. The weights use the original tensor names, the ones
ComfyUI's single file uses too (encoder.down.{i}.block.{j}, decoder.x_embedder, per-head interleaved to_qkv,
ff.w1 = [gate; value], an unused decoder.mask_token), all fp32, without latent statistics.

audio_vae/: `config.json` (MiniMaxH3AudioVAE) carries the latent statistics and names `config.yaml`,
`metadata.json` and the weights; `metadata.json` (`metadata.kwargs`) and `config.yaml` (`model_config`,
which the reference loader prefers for decoder_dim and the latent channels) hold the architecture. The
weights keep the weight_g / weight_v pairs, under the names diffusers' audio_vae/ folder uses too.

A few settings are constants of MiniMaxAI's code rather than fields of these files (the group norm's 32
groups, the decoder's 4 register tokens and 4x FFN, the BigVGAN kernel table of the released rates); our own
synthetic writer adds them as extra keys when it writes a model smaller than the released one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from ..json_file import read_json
from .audio import FULL as AUDIO_FULL
from .audio import AudioVAEConfig
from .video_config import FULL as VIDEO_FULL
from .video_config import VideoVAEConfig

VIDEO_CLASS = "MiniMaxH3VideoVAE"
VIDEO_SOURCE_CLASS = "AutoencoderKLLegacy"
AUDIO_CLASS = "MiniMaxH3AudioVAE"
ORIGINAL_DIFFUSERS_VERSION = "0.32.2"  # what MiniMaxAI's files say they were written with


def is_released(config: dict[str, Any]) -> bool:
    return config.get("_class_name") in (VIDEO_CLASS, AUDIO_CLASS)


def _need(data: dict[str, Any], key: str, where: Path) -> Any:
    if key not in data:
        raise CheckpointError(f"{where}: no {key!r}")
    return data[key]


def _expect(data: dict[str, Any], key: str, want: Any, where: Path) -> None:
    """A setting our model implements one way only: anything else would run another network silently."""
    if key in data and data[key] != want:
        raise CheckpointError(f"{where}: {key} is {data[key]!r}; the H3 video VAE this engine runs has {want!r}")


# ------------------------------------------------------------------------------------------ video
def weights_file(folder: Path, wrapper: dict[str, Any]) -> Path:
    """The safetensors file a wrapper config.json names: `source_path` (the video VAE's source/, none for the
    audio VAE) / `source_safetensors_path`."""
    source = folder / str(wrapper.get("source_path", "source" if wrapper.get("_class_name") == VIDEO_CLASS else ""))
    weights = source / str(wrapper.get("source_safetensors_path", "model.safetensors"))
    if weights.suffix != ".safetensors":
        raise CheckpointError(f"{folder / 'config.json'}: source_safetensors_path must name a .safetensors file "
                              f"(pickle files can run code), got {weights.name}")
    if not weights.is_file():
        raise CheckpointError(f"{folder / 'config.json'} names {weights}, which is missing")
    return weights


def video_config(folder: Path, wrapper: dict[str, Any]) -> VideoVAEConfig:
    """The video VAE config of a released video_vae/ folder (its wrapper config.json already read)."""
    where = folder / str(wrapper.get("source_path", "source")) / "config.json"
    if not where.parent.is_dir():
        raise CheckpointError(f"{folder / 'config.json'}: source_path names {where.parent.name}/, which is missing "
                              "(it holds the video VAE's config.json and weights)")
    source = read_json(where)
    if source.get("_class_name", VIDEO_SOURCE_CLASS) != VIDEO_SOURCE_CLASS:
        raise CheckpointError(f"{where}: _class_name {source['_class_name']!r}, expected {VIDEO_SOURCE_CLASS}")
    for key, want in (("use_3d_conv", True), ("use_vit_decoder", True), ("causal_encoder", True),
                      ("causal_decoder", False), ("use_t_isolated_gn", True), ("pixel_norm_type", "imagenet"),
                      ("scaling_factor", 1.0), ("shift_factor", 0.0)):
        _expect(source, key, want, where)
    vit = _need(source, "vit_decoder_kwargs", where)
    for key, want in (("norm_type", "rms_norm"), ("qk_norm_type", "rms_norm"), ("ffn_use_gated", True),
                      ("ffn_activation_fn", "silu")):
        _expect(vit, key, want, where)
    z = _need(source, "z_channels", where)
    if source.get("embed_dim", z) != z:
        raise CheckpointError(f"{where}: embed_dim is {source['embed_dim']} but z_channels is {z}; the latent "
                              "channels must agree")
    if wrapper.get("latent_channels", z) != z:
        raise CheckpointError(f"{folder / 'config.json'}: latent_channels is {wrapper['latent_channels']} but "
                              f"{where} says z_channels {z}")
    ch = _need(source, "ch", where)
    fields = {
        "in_channels": source.get("in_channels", 3), "out_channels": source.get("out_ch", 3), "latent_channels": z,
        "block_out_channels": [ch * m for m in _need(source, "ch_mult", where)],
        "layers_per_block": _need(source, "num_res_blocks", where),
        "spatial_downsample_factors": _need(source, "space_down", where),
        "temporal_downsample_factors": _need(source, "time_down", where),
        "spatial_padding_mode": source.get("padding_mode", VIDEO_FULL.spatial_padding_mode),
        "norm_num_groups": source.get("norm_num_groups", VIDEO_FULL.norm_num_groups),
        "decoder_num_layers": _need(vit, "num_layers", where),
        "decoder_num_attention_heads": _need(vit, "heads", where),
        "decoder_attention_head_dim": _need(vit, "dim_head", where),
        "decoder_num_register_tokens": vit.get("num_register_tokens", VIDEO_FULL.decoder_num_register_tokens),
        "decoder_ffn_mult": vit.get("mult", VIDEO_FULL.decoder_ffn_mult),
        "decoder_rope_theta": vit.get("rope_theta", VIDEO_FULL.decoder_rope_theta),
        "decoder_rope_dim_ratio": vit.get("rope_dim_ratio", VIDEO_FULL.decoder_rope_dim_ratio),
        "clip_length": wrapper.get("vae_clip_length", VIDEO_FULL.clip_length),
        "token_drop": wrapper.get("vae_token_drop", VIDEO_FULL.token_drop),
        "latents_mean": _need(wrapper, "latents_mean", folder / "config.json"),
        "latents_std": _need(wrapper, "latents_std", folder / "config.json"),
    }
    config = VideoVAEConfig.from_dict(fields)
    for key, want in (("vae_ratio", config.spatial_ratio), ("vae_ratio_t", config.temporal_ratio)):
        if key in source and source[key] != want:
            raise CheckpointError(f"{where}: {key} {source[key]} disagrees with the strides ({want})")
    return config


def video_files(config: VideoVAEConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(video_vae/config.json, video_vae/source/config.json) describing `config`, as MiniMaxAI writes them."""
    ch = config.block_out_channels[0]
    if any(c % ch for c in config.block_out_channels):
        raise CheckpointError(f"block_out_channels {config.block_out_channels} are not multiples of the first")
    wrapper = {"_class_name": VIDEO_CLASS, "_diffusers_version": ORIGINAL_DIFFUSERS_VERSION, "mode": "standalone",
               "source_path": "source", "source_class_name": VIDEO_SOURCE_CLASS,
               "source_safetensors_path": "model.safetensors", "vae_clip_length": config.clip_length,
               "vae_token_drop": config.token_drop, "vae_tile_size": 256, "vae_tile_overlap_min": 64,
               "latent_channels": config.latent_channels, "latents_mean": list(config.latents_mean),
               "latents_std": list(config.latents_std)}
    vit = {"dim_head": config.decoder_attention_head_dim, "ffn_activation_fn": "silu", "ffn_use_gated": True,
           "heads": config.decoder_num_attention_heads, "norm_affine": True, "norm_type": "rms_norm",
           "num_layers": config.decoder_num_layers, "qk_norm_affine": False, "qk_norm_type": "rms_norm",
           "rope_dim_ratio": config.decoder_rope_dim_ratio, "rope_theta": config.decoder_rope_theta}
    if config.decoder_num_register_tokens != VIDEO_FULL.decoder_num_register_tokens:
        vit["num_register_tokens"] = config.decoder_num_register_tokens
    if config.decoder_ffn_mult != VIDEO_FULL.decoder_ffn_mult:
        vit["mult"] = config.decoder_ffn_mult
    source = {"_class_name": VIDEO_SOURCE_CLASS, "_diffusers_version": ORIGINAL_DIFFUSERS_VERSION,
              "causal_decoder": False, "causal_encoder": True, "ch": ch,
              "ch_mult": [c // ch for c in config.block_out_channels], "embed_dim": config.latent_channels,
              "z_channels": config.latent_channels, "in_channels": config.in_channels,
              "out_ch": config.out_channels, "num_res_blocks": config.layers_per_block,
              "padding_mode": config.spatial_padding_mode, "pixel_norm_type": "imagenet", "scaling_factor": 1.0,
              "shift_factor": 0.0, "space_down": list(config.spatial_downsample_factors),
              "time_down": list(config.temporal_downsample_factors), "use_3d_conv": True,
              "use_t_isolated_gn": True, "use_vit_decoder": True, "vae_ratio": config.spatial_ratio,
              "vae_ratio_t": config.temporal_ratio, "vit_decoder_kwargs": vit}
    if config.norm_num_groups != VIDEO_FULL.norm_num_groups:
        source["norm_num_groups"] = config.norm_num_groups
    return wrapper, source


# ------------------------------------------------------------------------------------------ audio
def _yaml_model_config(path: Path) -> dict[str, Any]:
    """config.yaml's model_config mapping ({} when the folder has no config.yaml)."""
    if not path.is_file():
        return {}
    import yaml  # PyYAML comes with transformers

    try:
        model = (yaml.safe_load(path.read_text()) or {}).get("model_config")
    except (yaml.YAMLError, AttributeError) as exc:
        raise CheckpointError(f"{path}: not a YAML mapping ({exc})") from None
    if isinstance(model, dict):
        return model
    raise CheckpointError(f"{path}: expected a model_config mapping")


def audio_config(folder: Path, wrapper: dict[str, Any]) -> AudioVAEConfig:
    """The audio VAE config of a released audio_vae/ folder (its config.json already read)."""
    meta_path = folder / str(wrapper.get("source_metadata_path", "metadata.json"))
    meta = read_json(meta_path).get("metadata", {})
    kwargs = meta.get("kwargs") if isinstance(meta, dict) else None
    if not isinstance(kwargs, dict):
        raise CheckpointError(f"{meta_path}: expected metadata.kwargs")
    yaml_path = folder / str(wrapper.get("source_config_path", "config.yaml"))
    model = _yaml_model_config(yaml_path)
    for ours, theirs in (("decoder_dim", "decoder_dim"), ("vae_latent_channels", "vae_latent_channels"),
                         ("sample_rate", "sr")):
        if ours in kwargs and theirs in model and kwargs[ours] != model[theirs]:
            raise CheckpointError(f"{meta_path} says {ours} {kwargs[ours]} but {yaml_path} says {theirs} "
                                  f"{model[theirs]}")
    if kwargs.get("decoder_type", "bigvgan") != "bigvgan" or kwargs.get("attn_proj", True) is not True:
        raise CheckpointError(f"{meta_path}: decoder_type {kwargs.get('decoder_type')!r} / attn_proj "
                              f"{kwargs.get('attn_proj')!r}; the H3 audio VAE is bigvgan with attn_proj")
    if model.get("audio_channel", 1) != 1:
        raise CheckpointError(f"{yaml_path}: audio_channel {model['audio_channel']}; the H3 audio VAE is mono "
                              "(stereo runs as two items)")
    decoder_rates = tuple(_need(kwargs, "decoder_rates", meta_path))
    kernel_sizes = kwargs.get("upsample_kernel_sizes")
    if kernel_sizes is None:
        if decoder_rates != AUDIO_FULL.decoder_rates:
            raise CheckpointError(f"{meta_path}: decoder_rates {list(decoder_rates)} without upsample_kernel_sizes; "
                                  f"only the released rates {list(AUDIO_FULL.decoder_rates)} have a known table")
        kernel_sizes = AUDIO_FULL.decoder_kernel_sizes
    fields = {
        "encoder_dim": _need(kwargs, "encoder_dim", meta_path),
        "encoder_rates": _need(kwargs, "encoder_rates", meta_path),
        "latent_dim": _need(kwargs, "latent_dim", meta_path),
        "latent_channels": model.get("vae_latent_channels", _need(kwargs, "vae_latent_channels", meta_path)),
        "num_attention_heads": kwargs.get("attn_heads", AUDIO_FULL.num_attention_heads),
        "decoder_dim": model.get("decoder_dim", _need(kwargs, "decoder_dim", meta_path)),
        "decoder_rates": decoder_rates, "decoder_kernel_sizes": kernel_sizes,
        "resblock_kernel_sizes": kwargs.get("resblock_kernel_sizes", AUDIO_FULL.resblock_kernel_sizes),
        "resblock_dilation_sizes": kwargs.get("resblock_dilation_sizes", AUDIO_FULL.resblock_dilation_sizes),
        "sampling_rate": kwargs.get("sample_rate", wrapper.get("sample_rate", AUDIO_FULL.sampling_rate)),
        "latents_mean": _need(wrapper, "latents_mean", folder / "config.json"),
        "latents_std": _need(wrapper, "latents_std", folder / "config.json"),
    }
    try:
        config = AudioVAEConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{folder}: invalid audio VAE config ({exc})") from None
    if wrapper.get("latent_channels", config.latent_channels) != config.latent_channels:
        raise CheckpointError(f"{folder / 'config.json'}: latent_channels {wrapper['latent_channels']} but the "
                              f"model has {config.latent_channels}")
    return config


def audio_files(config: AudioVAEConfig) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """(audio_vae/config.json, config.yaml text, metadata.json) describing `config`, as MiniMaxAI writes them."""
    wrapper = {"_class_name": AUDIO_CLASS, "_diffusers_version": ORIGINAL_DIFFUSERS_VERSION, "output_channel": 2,
               "sample_rate": config.sampling_rate, "source_config_path": "config.yaml",
               "source_safetensors_path": "model.safetensors", "source_metadata_path": "metadata.json",
               "latent_channels": config.latent_channels, "latents_mean": list(config.latents_mean or ()),
               "latents_std": list(config.latents_std or ())}
    yaml_text = (f"model_config:\n  sr: {config.sampling_rate}\n  decoder_dim: {config.decoder_dim}\n"
                 f"  audio_channel: 1\n  vae_latent_channels: {config.latent_channels}\n")
    kwargs: dict[str, Any] = {"attn_proj": True, "decoder_dim": config.decoder_dim,
                              "decoder_rates": list(config.decoder_rates), "decoder_type": "bigvgan",
                              "encoder_dim": config.encoder_dim, "encoder_rates": list(config.encoder_rates),
                              "latent_dim": config.latent_dim, "sample_rate": config.sampling_rate,
                              "vae_latent_channels": config.latent_channels}
    if config.decoder_rates != AUDIO_FULL.decoder_rates or config.decoder_kernel_sizes != AUDIO_FULL.decoder_kernel_sizes:
        kwargs["upsample_kernel_sizes"] = list(config.decoder_kernel_sizes)
    if config.resblock_kernel_sizes != AUDIO_FULL.resblock_kernel_sizes:
        kwargs["resblock_kernel_sizes"] = list(config.resblock_kernel_sizes)
    if config.resblock_dilation_sizes != AUDIO_FULL.resblock_dilation_sizes:
        kwargs["resblock_dilation_sizes"] = [list(d) for d in config.resblock_dilation_sizes]
    if config.num_attention_heads != AUDIO_FULL.num_attention_heads:
        kwargs["attn_heads"] = config.num_attention_heads
    if math.prod(config.encoder_rates) != config.hop_length:
        raise CheckpointError("internal: encoder rates do not give the hop length")
    return wrapper, yaml_text, {"metadata": {"kwargs": kwargs}}
