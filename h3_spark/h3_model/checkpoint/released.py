"""Write a synthetic model folder in MiniMaxAI's per-mode layout, the one `hf download` fetches today.

    <root>/modular_model_index.json
    <root>/FL2VA/   model_index.json, transformer/, text_encoder/, tokenizer/, processor/, video_vae/, audio_vae/
    <root>/Ref2VA/  the same names, with the Ref2VA DiT

transformer/ holds the original tensor names (fused qkv rows per head, fc1 = [gate; value]) in shards listed
by model.safetensors.index.json, fp32 patch/time/output layers and bf16 elsewhere, next to a config.json
naming MiniMaxH3DiTModel; the VAE folders are vae/synthetic.py's "released" layout. The weights are our
deterministic random ones, so the real loaders can be tested on the real layout without 290 GB of files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

from ..dit.config import ADALN_VECTORS, NUM_MODALITIES, DiTConfig
from . import ORIGINAL_DIT_CLASS
from .comfy_layout import comfy_groups
from .synthetic import random_param
from .writer import write_groups

INDEX_NAME = "model.safetensors.index.json"
MODE_FOLDERS = {"t2va": "FL2VA", "ref2va": "Ref2VA"}
MODE_INDEX = {"t2va": ("fl2va", ["t2va", "fl2va"]), "ref2va": ("ref2va", ["ref2va"])}


def original_config_json(config: DiTConfig) -> dict:
    """transformer/config.json in the original trainer's field names (the loader sizes the model from shapes)."""
    return {"_class_name": ORIGINAL_DIT_CLASS, "hidden_size": config.hidden_size, "num_layers": config.num_layers,
            "token_refiner_num_layers": config.num_refiner_layers, "num_attention_heads": config.num_attention_heads,
            "attention_head_dim": config.attention_head_dim, "ffn_hidden_size": config.ffn_dim,
            "latents_dim": config.in_channels, "audio_latents_dim": config.audio_in_channels,
            "patch_size": list(config.patch_size), "text_dim": config.text_dim,
            "timestep_input_dim": config.freq_dim, "time_embed_hidden_size": config.time_embed_hidden_dim,
            "time_embed_dim": config.time_embed_dim, "rope_inv_freq_len": config.rope_freq_dim,
            "norm_eps": config.norm_eps, "qk_norm_eps": config.qk_norm_eps, "final_norm_eps": config.final_norm_eps,
            # The published file records its AdaLN projections' widths too (96768 and 10752).
            "adaln_out_features": ADALN_VECTORS * NUM_MODALITIES * config.hidden_size,
            "final_adaln_out_features": 2 * config.hidden_size}


def write_released_dit(out: Path, config: DiTConfig, seed: int = 0, shards: int = 2) -> int:
    """A transformer/ folder: config.json, `shards` safetensors shards and their index. Returns the bytes."""
    from .dit_reader import expected_shapes

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = expected_shapes(config)
    groups = comfy_groups(config, lambda name: random_param(name, shapes[name], seed), "bf16",
                          qkv_layout="interleaved")
    per_shard = -(-len(groups) // shards)
    weight_map, total = {}, 0
    for i in range(shards):
        part = groups[i * per_shard:(i + 1) * per_shard]
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        total += write_groups(out / name, part, {"format": "pt"})
        weight_map.update({entry[0]: name for group in part for entry in group.entries})
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(original_config_json(config), indent=2) + "\n")
    return total


def model_index(partition: str) -> dict:
    name, tasks = MODE_INDEX[partition]
    return {"_class_name": "MiniMaxH3Pipeline", "_diffusers_version": "0.32.2",
            "text_encoder": ["transformers", "MiniMaxH3Qwen3VLHFEncoder"],
            "tokenizer": ["transformers", "Qwen2TokenizerFast"], "video_vae": ["diffusers", "MiniMaxH3VideoVAE"],
            "audio_vae": ["diffusers", "MiniMaxH3AudioVAE"], "scheduler": None,
            "transformer": ["diffusers", "MiniMaxH3DiTModel"], "processor": ["transformers", "Qwen3VLProcessor"],
            "_minimax_h3": {"schema_version": 1, "partition": name, "tasks": tasks, "task_aliases": {},
                            "sigma_shift_scales": {"video": 12.0, "audio": 3.0}}}


def write_released_models(root: Path, dit_config: DiTConfig, vae_config, audio_config,
                          write_text_encoder: Callable[[Path], None], *, seed: int = 0,
                          partitions: tuple[str, ...] = ("t2va", "ref2va")) -> Path:
    """The whole per-mode download: each mode folder with its own DiT and the shared text encoder and VAEs."""
    from ..vae.synthetic import write_audio_vae_checkpoint, write_vae_checkpoint

    root = Path(root)
    shared = None
    for offset, partition in enumerate(partitions):
        folder = root / MODE_FOLDERS[partition]
        write_released_dit(folder / "transformer", dit_config, seed + offset)
        if shared is None:
            write_text_encoder(folder / "text_encoder")
            write_vae_checkpoint(folder / "video_vae", vae_config, "released", seed)
            write_audio_vae_checkpoint(folder / "audio_vae", audio_config, "released", seed)
            _tokenizer_folders(folder)
            shared = folder
        else:
            for name in ("text_encoder", "tokenizer", "processor", "video_vae", "audio_vae"):
                shutil.copytree(shared / name, folder / name, dirs_exist_ok=True)
        (folder / "model_index.json").write_text(json.dumps(model_index(partition), indent=2) + "\n")
    (root / "modular_model_index.json").write_text(json.dumps(
        {"_class_name": "MiniMaxH3ModularPipeline", "_blocks_class_name": "MiniMaxH3Blocks"}, indent=2) + "\n")
    return root


def _tokenizer_folders(folder: Path) -> None:
    """tokenizer/ and processor/ hold copies of the text encoder folder's tokenizer and processor files."""
    text = folder / "text_encoder"
    for name, suffixes in (("tokenizer", ("tokenizer", "vocab", "merges", "special_tokens", "added_tokens")),
                           ("processor", ("tokenizer", "vocab", "merges", "special_tokens", "added_tokens",
                                          "processor", "preprocessor", "video_preprocessor", "chat_template"))):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for path in text.iterdir():
            if path.is_file() and path.name.startswith(suffixes):
                shutil.copy2(path, folder / name / path.name)
