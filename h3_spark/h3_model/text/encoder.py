"""The Qwen3-VL text encoder of MiniMax H3, run only as far as the layer the DiT reads.

The DiT conditions on `hidden_states[layer]` (50 for the released model): the residual stream
after decoder layer `layer`, before any final norm. So the language
model is cut at load: decoder layers past `layer`, the final norm and the LM head are never built
or read. The vision tower and DeepStack stay whole; DeepStack only adds to the first few layers'
outputs, and the value taken is the last kept decoder layer's own output, exactly what
transformers records as `hidden_states[layer]`.

The model, tokenizer and processor are transformers' Qwen3-VL classes (`Qwen3VLModel`,
`Qwen3VLProcessor`, `Qwen2TokenizerFast`). Accepted checkpoints (safetensors only):
- a transformers Qwen3-VL folder (config.json + safetensors + tokenizer + processor files);
- a diffusers MiniMax-H3 folder (`text_encoder/`, `tokenizer/`, `processor/`);
- a ComfyUI single file (bf16, or fp8_scaled / int8_convrot / NVFP4 (+ AWQ) layers: dequantized at load, or
  kept as stored with `stored=True`, StoredLinear dequantizing them at use to the same bits),
  with `tokenizer=` naming a folder that holds the tokenizer and processor files;
- a GGUF file, read the same way (each tensor F32/F16/BF16 or GGML blocks: a block linear kept as its blocks
  with `stored=True`), in ComfyUI's names or in llama.cpp's Qwen3-VL names (`blk.N.attn_q.weight`, ...:
  checkpoint/gguf_source.py maps them). llama.cpp keeps the vision tower in a separate mmproj file
  (text/mmproj.py): given (`vision=`, CLI --text-encoder-vision) or the one `mmproj*.gguf` beside the text GGUF,
  it is read into the tower (dequantized at load) and `vision_note` says which file it was; without one the GGUF
  loads without the tower (`vision_tower` False) and encodes text presentations only (T2VA, Ref2VA with audio
  references only); one with images or videos raises.
A single file's tensors are read by `single_file.py`, by the rules every checkpoint reader shares.
"""

from __future__ import annotations

import copy
import importlib
import itertools
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ...errors import CheckpointError, H3Error, InputError
from ...kernels.stored_linear import StoredForm, StoredLinear
from ..checkpoint.gguf_source import GgufSource
from ..dit.streaming import hold_on_host, move_except, place_held
from ..checkpoint.source import open_source
from .mmproj import Mmproj, find_beside
from .single_file import LM_LAYER, SingleFile, target_name
from .prompt import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, Presentation, PresentationBuilder

DEFAULT_LAYER = 50
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json")
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
# Facts of the Qwen3-VL family that tensor shapes do not show, for a ComfyUI single file that comes
# without a config.json (the values ComfyUI builds its Qwen3-VL-32B with).
QWEN3VL_ROPE = {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                "mrope_interleaved": True}
QWEN3VL_VISION_HEADS = 16
QWEN3VL_DEEPSTACK = [8, 16, 24]


@dataclass(frozen=True, eq=False)
class EncodedPrompt:
    """Qwen's hidden states for one presentation: embeds (1, L, hidden) in the encoder dtype, tags (L,).

    `embeds` is shared with the encoder's cache: treat it as read-only.
    """

    embeds: torch.Tensor
    tags: torch.Tensor
    token_hash: str


# ---------------------------------------------------------------------------- environment
def _transformers():
    """transformers, after checking that torchvision imports (its Qwen3-VL processors need it)."""
    from .torchvision_compat import ensure_importable

    try:
        ensure_importable()
        importlib.import_module("torchvision")
    except ImportError:
        raise H3Error("the Qwen3-VL text encoder needs torchvision (transformers' Qwen3-VL video processor "
                      "requires it): pip install torchvision matching your torch") from None
    except Exception as exc:  # a torchvision built for another torch fails here, not with ImportError
        raise H3Error(f"torchvision does not import ({type(exc).__name__}: {exc}); it must be the build that "
                      f"matches torch {torch.__version__} (a CUDA torchvision next to a CPU-only torch fails "
                      "this way)") from None
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise H3Error("the Qwen3-VL text encoder needs transformers>=5: pip install 'transformers>=5'") from None


# ---------------------------------------------------------------------------- where things are
@dataclass(frozen=True)
class _Sources:
    weights: Path  # a model folder, or a single .safetensors file
    single_file: bool
    processor_dir: Path
    tokenizer_dir: Path
    config_path: Path | None  # config.json of the model, when one exists


def _resolve(path: str | Path, tokenizer: str | Path | None) -> _Sources:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if path.is_file():
        return _resolve_single_file(path, tokenizer)
    weights = path / "text_encoder" if (path / "text_encoder").is_dir() else path
    _check_weight_folder(weights)
    config = weights / "config.json"
    if not config.exists():
        raise CheckpointError(f"{weights}: no config.json (a transformers Qwen3-VL folder has one)")
    processor_dir, tokenizer_dir = _tokenizer_dirs(Path(tokenizer) if tokenizer is not None else path)
    return _Sources(weights, False, processor_dir, tokenizer_dir, config)


def _resolve_single_file(path: Path, tokenizer: str | Path | None) -> _Sources:
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise CheckpointError(f"{path}: pickle checkpoints are not loaded (they can run code); "
                              "convert it to .safetensors")
    if tokenizer is None:
        raise InputError(f"{path} is a single-file text encoder and holds no tokenizer or processor: pass "
                         "tokenizer=<folder> (CLI: --tokenizer) with the Qwen3-VL tokenizer and processor "
                         "config files")
    folder = Path(tokenizer)
    processor_dir, tokenizer_dir = _tokenizer_dirs(folder)
    configs = [folder / "config.json", folder / "text_encoder" / "config.json",
               folder.parent / "text_encoder" / "config.json"]
    config = next((c for c in configs if c.exists()), None)
    return _Sources(path, True, processor_dir, tokenizer_dir, config)


def _check_weight_folder(folder: Path) -> None:
    if any(folder.glob("*.safetensors")) or any(folder.glob("*.safetensors.index.json")):
        return
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(f"{folder}: only pickle weights ({', '.join(pickles[:3])}); pickle files are not "
                              "loaded (they can run code): convert them to .safetensors")
    raise CheckpointError(f"{folder}: no .safetensors weights")


def _tokenizer_dirs(folder: Path) -> tuple[Path, Path]:
    """(processor folder, tokenizer folder) for a model folder, a diffusers root or one of its subfolders.

    A diffusers MiniMax-H3 folder keeps them in `processor/` and `tokenizer/` beside `text_encoder/`,
    so a caller may name the root, `text_encoder/` or `tokenizer/`; a transformers folder or a
    plain tokenizer folder holds both itself.
    """
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such tokenizer folder")
    processor = _first_with([folder / "processor", folder, folder.parent / "processor"], PROCESSOR_FILES)
    if processor is None:
        raise CheckpointError(f"{folder}: no Qwen3-VL processor config ({' or '.join(PROCESSOR_FILES)}); the "
                              "tokenizer folder needs the tokenizer files and the processor config files")
    tok = _first_with([folder / "tokenizer", folder, folder.parent / "tokenizer", processor], TOKENIZER_FILES)
    if tok is None:
        raise CheckpointError(f"{folder}: no tokenizer files ({' or '.join(TOKENIZER_FILES)} + merges.txt)")
    return processor, tok


def _first_with(folders: list[Path], names: tuple[str, ...]) -> Path | None:
    return next((f for f in folders if _has_any(f, names)), None)


def _has_any(folder: Path, names: tuple[str, ...]) -> bool:
    return folder.is_dir() and any((folder / n).exists() for n in names)


# ---------------------------------------------------------------------------- tokenizer, processor
def _load_processing(tf, sources: _Sources):
    """(tokenizer, processor); a diffusers tokenizer/ folder is what diffusers tokenizes with."""
    try:
        processor = tf.Qwen3VLProcessor.from_pretrained(str(sources.processor_dir))
        tokenizer = processor.tokenizer
        if sources.tokenizer_dir != sources.processor_dir:
            tokenizer = tf.AutoTokenizer.from_pretrained(str(sources.tokenizer_dir))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"{sources.processor_dir}: cannot load the Qwen3-VL tokenizer/processor "
                              f"({type(exc).__name__}: {exc})") from None
    return tokenizer, processor


# ---------------------------------------------------------------------------- config
def _read_config(tf, config_path: Path):
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_path}: not a readable JSON config ({exc})") from None
    if raw.get("model_type") != "qwen3_vl":
        raise CheckpointError(f"{config_path}: model_type is {raw.get('model_type')!r}, not 'qwen3_vl' "
                              "(the MiniMax H3 text encoder is Qwen3-VL)")
    return tf.Qwen3VLConfig.from_pretrained(str(config_path.parent))


def _truncated(config, layer: int, available: int, where: object):
    """A copy of `config` whose language model stops after decoder layer `layer`."""
    if layer < 1:
        raise InputError(f"layer must be at least 1 (hidden_states[0] is the token embedding), got {layer}")
    if available < layer:
        raise CheckpointError(f"{where}: the language model has {available} decoder layers; reading "
                              f"hidden_states[{layer}] needs at least {layer}")
    config = copy.deepcopy(config)
    config.text_config.num_hidden_layers = layer
    return config


def _check_token_ids(config, tokenizer, where: object) -> None:
    """The tokenizer's vision tokens must be the ids the model splices vision features into."""
    ids = tokenizer.convert_tokens_to_ids([IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END])
    want = [config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]
    if ids != want:
        raise CheckpointError(f"{where}: the tokenizer's vision token ids {ids} differ from the model config's "
                              f"{want}; the tokenizer belongs to another model")


# ---------------------------------------------------------------------------- transformers folder
def _load_folder(tf, sources: _Sources, layer: int, dtype: torch.dtype, device: torch.device):
    config = _read_config(tf, sources.config_path)
    config = _truncated(config, layer, config.text_config.num_hidden_layers, sources.weights)
    verbosity = tf.logging.get_verbosity()
    # Layers past `layer` and the LM head are in the file on purpose; transformers would list each.
    tf.logging.set_verbosity_error()
    try:
        model, info = tf.Qwen3VLModel.from_pretrained(
            str(sources.weights), config=config, use_safetensors=True, dtype=dtype, device_map=str(device),
            output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{sources.weights}: cannot load the Qwen3-VL weights ({type(exc).__name__}: "
                              f"{exc})") from None
    finally:
        tf.logging.set_verbosity(verbosity)
    missing = sorted(k for k in info["missing_keys"] if not k.startswith("language_model.norm."))
    if missing or info.get("mismatched_keys"):
        bad = missing or [str(m) for m in info["mismatched_keys"]]
        raise CheckpointError(f"{sources.weights}: {len(bad)} tensors missing or of the wrong shape, "
                              f"e.g. {', '.join(bad[:3])}")
    return model, config


def _config_from_shapes(tf, weights: SingleFile, tokenizer):
    """A Qwen3VLConfig from tensor shapes plus the Qwen3-VL family's fixed settings (QWEN3VL_*)."""
    def need(name: str) -> tuple[int, ...]:
        shape = weights.shape(name)
        if shape is None:
            raise CheckpointError(f"{weights.path}: no {name}; cannot read the model size from the file "
                                  "(put the model's config.json in the tokenizer folder)")
        return shape

    rope, eps = _gguf_rope(weights)
    head_dim = need("language_model.layers.0.self_attn.q_norm.weight")[0]
    if sum(rope["mrope_section"]) * 2 != head_dim:
        raise CheckpointError(f"{weights.path}: head size {head_dim} is not Qwen3-VL's 128; put the model's "
                              "config.json in the tokenizer folder")
    text = dict(vocab_size=need("language_model.embed_tokens.weight")[0],
                hidden_size=need("language_model.layers.0.input_layernorm.weight")[0],
                intermediate_size=need("language_model.layers.0.mlp.up_proj.weight")[0],
                num_hidden_layers=weights.num_layers, head_dim=head_dim,
                num_attention_heads=need("language_model.layers.0.self_attn.q_proj.weight")[0] // head_dim,
                num_key_value_heads=need("language_model.layers.0.self_attn.k_proj.weight")[0] // head_dim,
                rms_norm_eps=eps, rope_parameters=rope)
    # A file without the tower (llama.cpp's text GGUF) gets a placeholder tower config; the loader puts an
    # _AbsentVisionTower in its place.
    has_tower = bool(weights.count(r"^visual\.blocks\.(\d+)\."))
    vision = _vision_from_shapes(weights, need) if has_tower else \
        dict(out_hidden_size=text["hidden_size"], deepstack_visual_indexes=list(QWEN3VL_DEEPSTACK))
    ids = tokenizer.convert_tokens_to_ids([IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END])
    return tf.Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=ids[0], video_token_id=ids[1],
                            vision_start_token_id=ids[2], vision_end_token_id=ids[3])


def _gguf_rope(weights: SingleFile) -> tuple[dict, float]:
    """RoPE parameters and the RMSNorm epsilon: Qwen3-VL's fixed values, or what a llama.cpp GGUF records
    (qwen3vl.rope.freq_base, qwen3vl.rope.dimension_sections: the M-RoPE sections, zero-padded to 4)."""
    rope, eps = dict(QWEN3VL_ROPE), 1e-6
    source = getattr(weights, "source", None)
    if not isinstance(source, GgufSource):
        return rope, eps
    base = source.field("qwen3vl.rope.freq_base")
    sections = source.field("qwen3vl.rope.dimension_sections")
    given_eps = source.field("qwen3vl.attention.layer_norm_rms_epsilon")
    if base is not None:
        rope["rope_theta"] = float(base)
    if isinstance(sections, list) and len(sections) >= 3:
        rope["mrope_section"] = [int(v) for v in sections[:3]]
    return rope, float(given_eps) if given_eps is not None else eps


def _vision_from_shapes(weights: SingleFile, need) -> dict:
    deepstack = weights.count(r"^visual\.deepstack_merger_list\.(\d+)\.")
    if deepstack != len(QWEN3VL_DEEPSTACK):
        raise CheckpointError(f"{weights.path}: {deepstack} DeepStack mergers, not Qwen3-VL's "
                              f"{len(QWEN3VL_DEEPSTACK)}; put the model's config.json in the tokenizer folder")
    vision_hidden = need("visual.blocks.0.norm1.weight")[0]
    patch = need("visual.patch_embed.proj.weight")
    return dict(depth=weights.count(r"^visual\.blocks\.(\d+)\."), hidden_size=vision_hidden,
                intermediate_size=need("visual.blocks.0.mlp.linear_fc1.weight")[0],
                num_heads=QWEN3VL_VISION_HEADS, patch_size=patch[-1], temporal_patch_size=patch[2],
                spatial_merge_size=int(round((need("visual.merger.linear_fc1.weight")[1] / vision_hidden) ** 0.5)),
                out_hidden_size=need("visual.merger.linear_fc2.weight")[0],
                num_position_embeddings=need("visual.pos_embed.weight")[0],
                deepstack_visual_indexes=list(QWEN3VL_DEEPSTACK))


def _plan_single_file(tf, sources: _Sources, weights: SingleFile, tokenizer, layer: int, mmproj: Mmproj | None = None):
    """(config, model on the meta device, its parameter shapes) for a single file (and the mmproj that holds its
    vision tower), its names and shapes checked."""
    if sources.config_path is not None:
        config = _read_config(tf, sources.config_path)
    else:
        config = _config_from_shapes(tf, weights, tokenizer)
    config = _truncated(config, layer, weights.num_layers, sources.weights)
    if mmproj is not None:
        # The tower is the mmproj's: its header gives the sizes, and it must be this text model's.
        deepstack = weights.source.field("qwen3vl.n_deepstack_layers")
        mmproj.check_belongs(int(config.text_config.hidden_size), None if deepstack is None else int(deepstack))
        config.vision_config = type(config.vision_config)(**mmproj.vision)
    with torch.device("meta"):
        model = tf.Qwen3VLModel(config)
    _drop_final_norm(model)
    if weights.gguf and not weights.has_vision and mmproj is None:
        # llama.cpp keeps the tower in a separate mmproj file: this file is the language model alone.
        model.visual = _AbsentVisionTower(no_vision_tower_message(sources.weights))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if mmproj is not None:
        weights.check(_text_shapes(shapes))
        mmproj.plan(_vision_shapes(shapes))
    else:
        weights.check(shapes)
    return config, model, shapes


def _vision_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    return {n: s for n, s in shapes.items() if n.startswith("visual.")}


def _text_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    return {n: s for n, s in shapes.items() if not n.startswith("visual.")}


def _open_vision(sources: _Sources, weights: SingleFile, vision: str | Path | None) -> tuple[Mmproj | None, str | None]:
    """(the mmproj holding the tower, a note saying which file it is): the one given, else the one `mmproj*.gguf`
    beside a text GGUF that has no tower and is this model's; (None, None) for a file that holds its own tower."""
    if vision is not None:
        vision = Path(vision)
        if not weights.gguf or weights.has_vision:
            raise InputError(f"--text-encoder-vision {vision}: the text encoder {sources.weights} holds its own "
                             "vision tower (only a llama.cpp text GGUF keeps it in a separate mmproj file)")
        if not vision.is_file():
            raise InputError(f"--text-encoder-vision {vision}: no such file")
        return Mmproj(vision), f"text encoder vision tower from {vision} (--text-encoder-vision)"
    if not weights.gguf or weights.has_vision:
        return None, None
    embedding = weights.shape("language_model.embed_tokens.weight")
    if embedding is None:
        return None, None  # _config_from_shapes names the missing tensor
    deepstack = weights.source.field("qwen3vl.n_deepstack_layers")
    found = find_beside(sources.weights, embedding[1], None if deepstack is None else int(deepstack))
    if found is None:
        return None, None
    return found, f"text encoder vision tower from {found.path.name}, found beside {sources.weights.name}"


def _load_single_file(tf, sources: _Sources, tokenizer, layer: int, dtype: torch.dtype, device: torch.device,
                      stored: bool = False, vision: str | Path | None = None):
    """(model, config, the vision note) of a single file (and its mmproj)."""
    weights = SingleFile(sources.weights, layer)
    mmproj = None
    try:
        mmproj, note = _open_vision(sources, weights, vision)
        config, model, shapes = _plan_single_file(tf, sources, weights, tokenizer, layer, mmproj)
        tensors = weights.tensors(shapes, dtype, device, stored)
        if mmproj is not None:
            tensors = itertools.chain(tensors, mmproj.tensors(_vision_shapes(shapes), dtype, device))
        _assign(model, tensors, shapes, sources.weights, dtype)
    finally:
        weights.source.close()
        if mmproj is not None:
            mmproj.close()
    _rebuild_rotary(model, config, device)
    return model, config, note


def no_vision_tower_message(source: object) -> str:
    return (f"the text encoder {source} has no vision tower (a GGUF without its mmproj): Ref2VA image and video "
            "references and FL2VA keyframes need Qwen3-VL's vision tower; give its llama.cpp vision file "
            "(--text-encoder-vision mmproj-....gguf, or one mmproj*.gguf beside it) or load a file that holds the "
            "tower (visual.*: ComfyUI's single file)")


class _AbsentVisionTower(torch.nn.Module):
    """Stands where Qwen3-VL's vision tower would be when the file has none; the encoder refuses vision inputs
    before they reach it (TextEncoder.encode), and reaching it anyway raises the same error."""

    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def forward(self, *args, **kwargs):
        raise InputError(self.message)


def has_vision_tower(model) -> bool:
    return not isinstance(getattr(model, "visual", None), _AbsentVisionTower)


def _assign(model: torch.nn.Module, tensors: Iterator[tuple[str, "torch.Tensor | StoredForm"]],
            shapes: dict[str, tuple[int, ...]], where: object, dtype: torch.dtype | None = None) -> None:
    """Put streamed tensors into the meta-built model; every parameter must be filled exactly once. A StoredForm
    replaces its nn.Linear by a StoredLinear computing in `dtype` (the bias, if any, comes after it)."""
    filled = set()
    for name, tensor in tensors:
        if name not in shapes:
            raise CheckpointError(f"{where}: {name} is not a parameter of this Qwen3-VL")
        if tuple(tensor.shape) != shapes[name]:
            raise CheckpointError(f"{where}: {name} is {list(tensor.shape)}, the model needs {list(shapes[name])}")
        module_name, _, param = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(tensor, StoredForm):
            model.set_submodule(module_name, StoredLinear(tensor, dtype, bias=None))
            if module.bias is not None:
                model.get_submodule(module_name).register_parameter("bias", module.bias)
        else:
            module._parameters[param] = torch.nn.Parameter(tensor, requires_grad=False)
        filled.add(name)
    missing = sorted(set(shapes) - filled)
    if missing:
        raise CheckpointError(f"{where}: {len(missing)} tensors missing, e.g. {', '.join(missing[:3])}")


def _rebuild_rotary(model, config, device: torch.device) -> None:
    """Rotary tables are computed, not stored: build them for real (fp32, as transformers keeps them)."""
    qwen = importlib.import_module("transformers.models.qwen3_vl.modeling_qwen3_vl")
    model.language_model.rotary_emb = qwen.Qwen3VLTextRotaryEmbedding(config.text_config).to(device)
    if has_vision_tower(model):
        model.visual.rotary_pos_emb = qwen.Qwen3VLVisionRotaryEmbedding(config.vision_config).to(device)


def _drop_final_norm(model) -> None:
    # hidden_states[layer] is read before any final norm; the single files do not even carry it.
    model.language_model.norm = torch.nn.Identity()


# ---------------------------------------------------------------------------- checked before loading
# config.json fields of a transformers Qwen3-VL folder, with the tensor (transformers' name) and the dimension
# of its shape that shows each; head widths are multiplied by head_dim.
_FIELD_EVIDENCE = (
    ("text_config.hidden_size", "language_model.embed_tokens.weight", 1, False),
    ("text_config.vocab_size", "language_model.embed_tokens.weight", 0, False),
    ("text_config.head_dim", "language_model.layers.0.self_attn.q_norm.weight", 0, False),
    ("text_config.num_attention_heads", "language_model.layers.0.self_attn.q_proj.weight", 0, True),
    ("text_config.num_key_value_heads", "language_model.layers.0.self_attn.k_proj.weight", 0, True),
    ("text_config.intermediate_size", "language_model.layers.0.mlp.up_proj.weight", 0, False),
    ("vision_config.hidden_size", "visual.patch_embed.proj.weight", 0, False),
    ("vision_config.out_hidden_size", "visual.merger.linear_fc2.weight", 0, False),
)


def check_text_encoder(path: str | Path, *, tokenizer: str | Path | None = None, layer: int = DEFAULT_LAYER,
                       vision: str | Path | None = None) -> int:
    """The text encoder's hidden size, after checking from its config, tokenizer and safetensors headers alone
    (before any weight is read) what from_pretrained refuses: missing shards, a config.json whose sizes the
    tensors contradict (one line naming the file and the field), tensors the truncated model lacks or shapes it
    does not take, a tokenizer that belongs to another model."""
    sources = _resolve(path, tokenizer)
    tf = _transformers()
    tok, _ = _load_processing(tf, sources)
    if sources.single_file:
        weights = SingleFile(sources.weights, layer)
        mmproj = None
        try:
            mmproj, _ = _open_vision(sources, weights, vision)
            config, _, _ = _plan_single_file(tf, sources, weights, tok, layer, mmproj)
        finally:
            weights.source.close()
            if mmproj is not None:
                mmproj.close()
    else:
        _no_vision_file(path, vision)
        config = _check_folder(tf, sources, layer)
    _check_token_ids(config, tok, path)
    return int(config.text_config.hidden_size)


def _check_folder(tf, sources: _Sources, layer: int):
    """A transformers folder's config against its shards' headers (open_source checks the index and the shards)."""
    weights = open_source(sources.weights)
    try:
        stored = {}
        for key in weights.keys:
            name = target_name(key, 1 << 30)
            if name is not None:
                stored[name] = (key, tuple(weights.entry(key).shape))
    finally:
        weights.close()
    config = _read_config(tf, sources.config_path)
    raw = json.loads(sources.config_path.read_text())
    for field_path, tensor, dim, per_head in _FIELD_EVIDENCE:
        section, _, name = field_path.partition(".")
        value = (raw.get(section) or {}).get(name)
        if value is None or tensor not in stored:
            continue
        key, shape = stored[tensor]
        have = shape[dim] // config.text_config.head_dim if per_head else shape[dim]
        if value != have:
            raise CheckpointError(f"{sources.config_path}: {field_path} is {value!r} but the weights say {have} "
                                  f"({key} is {list(shape)})")
    layers = len({int(m.group(1)) for n in stored if (m := LM_LAYER.match(n))})
    declared = config.text_config.num_hidden_layers
    if layers < min(declared, layer):
        raise CheckpointError(f"{sources.config_path}: text_config.num_hidden_layers is {declared} but the weights "
                              f"hold {layers} decoder layers")
    config = _truncated(config, layer, declared, sources.weights)
    with torch.device("meta"):
        model = tf.Qwen3VLModel(config)
    _drop_final_norm(model)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    kept = {n: v for n, v in stored.items() if target_name(v[0], layer) is not None}
    for name, want in expected.items():
        if name not in kept:
            raise CheckpointError(f"{sources.weights}: {name} is missing (the model {sources.config_path.name} "
                                  f"describes needs it)")
        if kept[name][1] != want:
            raise CheckpointError(f"{sources.weights}: {kept[name][0]} is {list(kept[name][1])}, the model "
                                  f"{sources.config_path.name} describes needs {list(want)}")
    extra = sorted(n for n in kept if n not in expected)
    if extra:
        raise CheckpointError(f"{sources.weights}: {extra[0]} is not a parameter of this Qwen3-VL"
                              + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    return config


def _no_vision_file(path: object, vision: str | Path | None) -> None:
    if vision is not None:
        raise InputError(f"--text-encoder-vision {vision}: the text encoder {path} is a model folder, which holds "
                         "its own vision tower (only a llama.cpp text GGUF keeps it in a separate mmproj file)")


# ---------------------------------------------------------------------------- the encoder
LAYERS = "language_model.layers"  # the decoder layers' place in the model (they stream under a budget)


class TextEncoder:
    """Qwen3-VL cut after decoder layer `layer`, with its tokenizer, processor and a prompt cache.

    Build it with `from_pretrained`; make presentations with `prompts` (a `PresentationBuilder`:
    `t2va`, `fl2va`, `ref2va`) and encode them with `encode`. `offload()` moves the weights to the
    CPU after encoding (`resident` turns False); the next cache miss moves them back.
    """

    def __init__(self, model, tokenizer, processor, *, layer: int, dtype: torch.dtype, device: torch.device,
                 source: str, cache_size: int = 8):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.processor = processor
        self.prompts = PresentationBuilder(tokenizer, processor)
        self.prompts.text_width = int(model.config.text_config.hidden_size)
        self.layer = layer
        self.dtype = dtype
        self.device = torch.device(device)
        self.source = source
        self.cache_size = cache_size
        self.cache_hits = 0
        self._cache: OrderedDict[str, EncodedPrompt] = OrderedDict()
        self._resident = True
        self.vision_note: str | None = None  # which mmproj gave a GGUF's vision tower
        # Under a VRAM budget the decoder layers stream (engine/memory.py) and the rest visits per encode; the
        # first `kept_layers` of them stay on the device when the budget has room to spare.
        self.layer_stream = None
        self.kept_layers = 0
        # The weights outside the decoder layers, held in host memory for good once `hold_outside_on_host` ran.
        self._held = None  # streaming.Held

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype, device: str | torch.device,
                        layer: int = DEFAULT_LAYER, tokenizer: str | Path | None = None,
                        cache_size: int = 8, stored: bool = False, vision: str | Path | None = None) -> "TextEncoder":
        """Load a transformers/diffusers folder or a ComfyUI single file (which needs `tokenizer`). `stored`: a
        single file's quantized layers stay as stored (StoredLinear, dequantized at use to the same bits).
        `vision`: the mmproj of a llama.cpp text GGUF (default: the one mmproj*.gguf beside it, if any)."""
        sources = _resolve(path, tokenizer)
        tf = _transformers()
        tok, processor = _load_processing(tf, sources)
        device = torch.device(device)
        note = None
        if sources.single_file:
            model, config, note = _load_single_file(tf, sources, tok, layer, dtype, device, stored, vision)
        else:
            _no_vision_file(path, vision)
            model, config = _load_folder(tf, sources, layer, dtype, device)
            _drop_final_norm(model)
        _check_token_ids(config, tok, path)
        encoder = cls(model, tok, processor, layer=layer, dtype=dtype, device=device, source=str(path),
                      cache_size=cache_size)
        encoder.vision_note = note
        return encoder

    # ------------------------------------------------------------------ state
    @property
    def resident(self) -> bool:
        """True while the weights sit on the compute device."""
        return self._resident

    @property
    def vision_tower(self) -> bool:
        """False for a text encoder loaded without Qwen3-VL's vision tower (a llama.cpp GGUF without its mmproj):
        it encodes text presentations only."""
        return has_vision_tower(self.model)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.text_config.hidden_size)

    def offload(self) -> None:
        """Move weights and cached embeddings to the CPU and release the GPU's cached blocks.

        On a CPU encoder there is nothing to free: it stays resident.
        """
        if self.device.type == "cpu":
            return
        self.move("cpu")
        if self.layer_stream is not None:
            self.layer_stream.park()
        for key, hit in self._cache.items():
            self._cache[key] = EncodedPrompt(hit.embeds.to("cpu"), hit.tags, hit.token_hash)
        self._resident = False
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def mark_offloaded(self) -> None:
        """The weights were moved off the compute device by someone else (the budget's placement)."""
        self._resident = False

    def ensure_resident(self) -> None:
        """Move offloaded weights back to the compute device (encode does this on a cache miss)."""
        if not self._resident:
            self.move(self.device)
            self._resident = True

    def move(self, device: torch.device | str) -> None:
        """`model.to(device)` but for the kept decoder layers, which stay where they are (and, once held on the
        host, the weights outside the layers come from their host copies)."""
        kept = list(self.model.language_model.layers[:self.kept_layers]) if self.kept_layers else []
        if self._held is None:
            move_except(self.model, device, kept)
            return
        move_except(self.model.language_model.layers, device, kept)
        place_held(self._held, device)

    def hold_outside_on_host(self, pin: bool) -> int:
        """Keep the weights outside the decoder layers (embeddings, vision tower, final parts) in host memory for
        good, page-locked when `pin`: each visit then copies them up at the pinned rate and each offload drops the
        device copies instead of copying 2.7 GB (the released encoder's) back down. For an encoder whose layers
        stream (engine/memory.py); returns the bytes held."""
        self._held = hold_on_host(self.model, LAYERS, pin)
        place_held(self._held, "cpu" if not self._resident else self.device)
        return sum(host.numel() * host.element_size() for *_, host in self._held)

    def clear_cache(self) -> None:
        self._cache.clear()

    # ------------------------------------------------------------------ encoding
    def encode(self, presentation: Presentation | str) -> EncodedPrompt:
        """Hidden state `layer` for a presentation (a plain string is a T2VA prompt)."""
        if isinstance(presentation, str):
            presentation = self.prompts.t2va(presentation)
        if not isinstance(presentation, Presentation):
            raise InputError(f"encode takes a Presentation (from .prompts) or a prompt string, "
                             f"got {type(presentation).__name__}")
        if presentation.vision and not self.vision_tower:
            raise InputError(no_vision_tower_message(self.source))
        hit = self._cache.get(presentation.token_hash)
        if hit is not None:
            self._cache.move_to_end(presentation.token_hash)
            self.cache_hits += 1
            return EncodedPrompt(hit.embeds.to(self.device), hit.tags, hit.token_hash)
        self.ensure_resident()
        embeds = self._forward(presentation)
        out = EncodedPrompt(embeds, presentation.tags.clone(), presentation.token_hash)
        if self.cache_size > 0:
            self._cache[presentation.token_hash] = out
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return out

    def _forward(self, presentation: Presentation) -> torch.Tensor:
        ids = presentation.token_ids.to(self.device)[None]
        types = self.processor.create_mm_token_type_ids([presentation.token_ids.tolist()])
        vision = {k: v.to(self.device, self.dtype) if k.startswith("pixel_") else v.to(self.device)
                  for k, v in presentation.vision.items()}
        captured: list[torch.Tensor] = []

        def keep(module, args, output):
            captured.append(output[0] if isinstance(output, tuple) else output)

        # The last kept decoder layer's own output is hidden_states[layer]; DeepStack's addition
        # after it (when layer <= the number of DeepStack levels) is not part of that state.
        handle = self.model.language_model.layers[-1].register_forward_hook(keep)
        # Prompt embeddings replace their placeholders' input embeddings (the ids still place the vision
        # features and the positions, so nothing else of the forward changes).
        splice = None if not presentation.spliced else self.model.get_input_embeddings().register_forward_hook(
            lambda module, args, output: splice_rows(output, presentation.spliced))
        try:
            # no_grad rather than inference_mode: the embeddings leave this class, and inference
            # tensors refuse in-place use outside inference mode.
            with torch.no_grad():
                self.model(input_ids=ids, attention_mask=torch.ones_like(ids),
                           mm_token_type_ids=torch.tensor(types, dtype=torch.long, device=self.device),
                           use_cache=False, **vision)
        finally:
            handle.remove()
            if splice is not None:
                splice.remove()
        return captured[-1]


def splice_rows(embeds: torch.Tensor, spliced) -> torch.Tensor:
    """Input embeddings (1, L, width) with each (start, rows) of a presentation's embeddings in place of its
    placeholders, in the embeddings' dtype."""
    out = embeds.clone()
    for start, rows in spliced:
        out[0, start:start + rows.shape[0]] = rows.to(out.device, out.dtype)
    return out
