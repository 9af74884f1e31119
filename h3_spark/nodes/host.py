"""What the nodes take from ComfyUI, imported lazily and only when present.

ComfyUI is optional: the package (and its tests) import without it. This module imports torch, so
node classes import it inside their methods, never at module import. Each ComfyUI service
is looked up where it is used, so a missing one is either not needed (model management outside
ComfyUI: the nodes then hold plain modules) or a clear error (model folders).

- Model management: our DiT, text encoder and VAEs are wrapped in `comfy.model_patcher.ModelPatcher`
  (inside a `Held` container) so ComfyUI loads them onto the GPU, offloads them when another model
  needs the memory, and frees them with its "free memory" button like any native model. The DiT's and
  the text encoder's patchers (patcher.py) load partially by streaming what ComfyUI has no room for; the
  VAEs' (vae.py) load whole, each stage declaring its working memory as ComfyUI's own VAE does.
- Progress: `comfy.utils.ProgressBar` feeds the websocket `progress` messages.
- Interruption: `comfy.model_management.processing_interrupted()` is polled by the engine's cancel
  checks (between steps and between blocks); the node then raises ComfyUI's own interrupt exception.
"""

from __future__ import annotations

import importlib
import os
import threading
from pathlib import Path

import torch

from ..errors import H3Error, InputError


def optional_module(name: str):
    """The module, or None when it is not importable (ComfyUI absent)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


# ------------------------------------------------------------------------------------------ model folders
def folder_paths():
    module = optional_module("folder_paths")
    if module is None:
        raise H3Error("ComfyUI's folder_paths module is not importable: the h3-spark loader nodes run inside "
                      "ComfyUI (outside it, use the h3-spark CLI)")
    return module


# What the loaders offer: safetensors, and GGUF files (the DiT and text encoder GGUFs people run on small cards).
MODEL_SUFFIXES = (".safetensors", ".gguf")


def embedding_folders() -> list[Path]:
    """ComfyUI's embeddings folders (models/embeddings and any extra_model_paths give) that exist; none outside
    ComfyUI."""
    module = optional_module("folder_paths")
    if module is None:
        return []
    try:
        roots = module.get_folder_paths("embeddings")
    except KeyError:  # a folder_paths without the embeddings kind
        return []
    return [Path(root) for root in roots if Path(root).is_dir()]


def model_choices(folder: str, *, folders: bool = False) -> list[str]:
    """Files ComfyUI lists for a model folder key, plus (if asked) sub-folders holding a diffusers component.

    The keys cover ComfyUI's older folder names too: "diffusion_models" is models/diffusion_models and
    models/unet, "text_encoders" is models/text_encoders and models/clip. ComfyUI lists only its own model
    extensions, which leave out .gguf (ComfyUI-GGUF registers separate keys for them), so .gguf files are
    found under the same folders here. Called from INPUT_TYPES at run time; outside ComfyUI the list is empty
    rather than an error so the node classes can still be introspected (tests, workflow validation).
    """
    module = optional_module("folder_paths")
    if module is None:
        return []
    names = [n for n in module.get_filename_list(folder) if n.lower().endswith(MODEL_SUFFIXES)]
    names += _gguf_files(module, folder)
    if folders:
        offered = []
        for root in module.get_folder_paths(folder):
            base = Path(root)
            if base.is_dir():
                offered += sorted(p.name + "/" for p in base.iterdir() if p.is_dir() and _holds_model(p))
        # A model offered as its folder is not offered again as the files inside it: picking one of those
        # would load a part of it (a shard, or weights without the folder's config).
        names = [n for n in names
                 if not any(n.replace("\\", "/").startswith(folder_name) for folder_name in offered)]
        names += offered
    return sorted(set(names))


def vae_choices(kind: str) -> list[str]:
    """models/vae's names for one slot of H3 VAE Loader: that kind of H3 VAE first (by its config or header,
    h3_model/vae/kind.py), then what is neither (other models' VAEs, unreadable files), the other kind last. All
    stay listed, so a graph naming any of them stays valid and a wrong pick is named at load; ComfyUI's
    frontend preselects the first, which is now a file that fits the slot."""
    from ..h3_model.vae.kind import vae_kind

    names = model_choices("vae", folders=True)
    module = optional_module("folder_paths")
    if module is None:
        return names

    def rank(name: str) -> int:
        try:
            found = vae_kind(resolve_model("vae", name))
        except Exception:  # noqa: BLE001 - a name that does not resolve is listed last, and refused when picked
            return 2
        return 0 if found == kind else 2 if found is not None else 1

    return sorted(names, key=lambda name: (rank(name), name))


def _gguf_files(module, folder: str) -> list[str]:
    """The .gguf files under a model folder key's folders, named as ComfyUI names files (relative, "/")."""
    found = []
    for root in module.get_folder_paths(folder):
        base = Path(root)
        if base.is_dir():
            found += [p.relative_to(base).as_posix() for p in base.rglob("*.gguf") if p.is_file()]
    return found


def _holds_model(folder: Path) -> bool:
    return (any(folder.glob("*.safetensors")) or any(folder.glob("*/*.safetensors"))
            or (folder / "config.json").exists() or (folder / "tokenizer.json").exists())


def resolve_model(folder: str, name: str) -> Path:
    """Full path of a file or sub-folder chosen from `model_choices`, confined to that model folder."""
    module = folder_paths()
    if name.endswith("/"):
        for root in module.get_folder_paths(folder):
            candidate = (Path(root) / name.rstrip("/")).resolve()
            if candidate.is_dir() and Path(root).resolve() in candidate.parents:
                return candidate
        raise InputError(f"{name}: no such folder under models/{folder}")
    return Path(module.get_full_path_or_raise(folder, name))


def output_directory() -> Path:
    return Path(folder_paths().get_output_directory())


# ------------------------------------------------------------------------------------------ devices and memory
def compute_device():
    """ComfyUI's compute device, or CUDA / CPU outside ComfyUI."""
    mm = optional_module("comfy.model_management")
    if mm is not None and hasattr(mm, "get_torch_device"):
        return torch.device(mm.get_torch_device())
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def offload_device():
    mm = optional_module("comfy.model_management")
    if mm is not None and hasattr(mm, "unet_offload_device"):
        return torch.device(mm.unet_offload_device())
    return compute_device()


def vae_devices() -> tuple[torch.device, torch.device]:
    """Where ComfyUI runs a VAE and where it keeps it between uses: the CPU with --cpu-vae, the GPU throughout
    with --gpu-only (ComfyUI's own VAE takes these too)."""
    mm = optional_module("comfy.model_management")
    run, keep = getattr(mm, "vae_device", None), getattr(mm, "vae_offload_device", None)
    if run is None or keep is None:
        return compute_device(), offload_device()
    return torch.device(run()), torch.device(keep())


def _model_patcher_cls():
    module = optional_module("comfy.model_patcher")
    return None if module is None else module.ModelPatcher


class Held(torch.nn.Module):
    """A container ComfyUI's ModelPatcher can own: the patcher sets `.device` and load counters on the module
    it wraps, which our VAEs (a read-only `device` property) cannot take, and moves it with `.to()`."""

    def __init__(self, kind: str, inner: torch.nn.Module, owner=None):
        super().__init__()
        self.kind = kind
        self.inner = inner
        self.owner = owner  # the engine object `inner` belongs to (the TextEncoder of a text model), if any


class H3SparkDiT(Held):
    """ComfyUI logs a load as "Requested to load <class name>": these names say which of ours it is."""


class H3SparkTextEncoder(Held):
    pass


class H3SparkVideoVAE(Held):
    pass


class H3SparkAudioVAE(Held):
    pass


HELD_CLASSES = {"dit": H3SparkDiT, "text_encoder": H3SparkTextEncoder, "vae": H3SparkVideoVAE,
                "audio_vae": H3SparkAudioVAE}


def make_held(kind: str, inner, owner=None, patcher_class=None, devices=None):
    """Wrap an engine module for ComfyUI's model management (or hold it as is outside ComfyUI).
    `patcher_class()` gives a ModelPatcher subclass of our own (the DiT's and the text encoder's, whose partial
    loads stream what does not fit: nodes/patcher.py; the VAEs', loaded whole: nodes/vae.py); it is called only
    inside ComfyUI. `devices`: (load, offload), the compute and offload devices when not given."""
    class_ = _model_patcher_cls()
    held = HELD_CLASSES[kind](kind, inner, owner)
    load, offload = devices if devices is not None else (compute_device(), offload_device())
    if class_ is None:
        return LocalModel(held, load)
    if patcher_class is not None:
        class_ = patcher_class()
    return class_(held, load_device=load, offload_device=offload)


class LocalModel:
    """Outside ComfyUI: the three members of a ModelPatcher the nodes use (`model`, `model_options`, `clone`)."""

    def __init__(self, model, load_device, model_options: dict | None = None):
        self.model = model
        self.load_device = load_device
        self.model_options = model_options if model_options is not None else {"transformer_options": {}}

    def clone(self) -> "LocalModel":
        import copy

        return LocalModel(self.model, self.load_device, copy.deepcopy(self.model_options))


def held_inner(patcher, kind: str):
    """The engine module inside a MODEL-like object, or None when it is not an h3-spark one of `kind`."""
    model = getattr(patcher, "model", None)
    if isinstance(model, Held) and model.kind == kind:
        return model.inner
    return None


def load_for_compute(patcher):
    """Have ComfyUI put the module on its compute device (fully: our modules have no per-layer casting,
    so a partial load would leave some layers on the CPU); returns the device to run on."""
    mm = optional_module("comfy.model_management")
    if isinstance(patcher, LocalModel) or mm is None:
        device = patcher.load_device
        patcher.model.to(device)
        return device
    mm.load_models_gpu([patcher], force_full_load=True)
    return patcher.load_device


# ------------------------------------------------------------------------------------------ progress, interruption
class Progress:
    """comfy.utils.ProgressBar when ComfyUI is there; otherwise nothing to report to."""

    def __init__(self, total: int):
        utils = optional_module("comfy.utils")
        self.bar = utils.ProgressBar(total) if utils is not None and hasattr(utils, "ProgressBar") else None
        self.total = total

    def update(self, value: int, image=None) -> None:
        """`image`: uint8 (h, w, 3) shown as the node's live preview (ComfyUI sends it to the page)."""
        if self.bar is None:
            return
        preview = None
        if image is not None:
            from PIL import Image

            preview = ("JPEG", Image.fromarray(image.numpy()), PREVIEW_SIZE)
        self.bar.update_absolute(value, self.total, preview)


PREVIEW_SIZE = 512
TINY_DECODER = "taeh3"  # the published file name's stem (models/vae_approx/taeh3.safetensors)
_tiny_decoders: dict = {}


def tiny_preview_decoder(latent_channels: int):
    """The TAEHV-style preview decoder from models/vae_approx when a taeh3*.safetensors is there (loaded once),
    else None. A file that is there but unreadable is an error: it would otherwise fall back silently."""
    module = optional_module("folder_paths")
    if module is None:
        return None
    try:
        names = module.get_filename_list("vae_approx")
    except Exception:  # noqa: BLE001 - a ComfyUI without that folder key has no such file
        return None
    name = next((n for n in sorted(names) if Path(n).name.lower().startswith(TINY_DECODER)
                 and n.lower().endswith(".safetensors")), None)
    if name is None:
        return None
    path = module.get_full_path_or_raise("vae_approx", name)
    if path not in _tiny_decoders:
        from ..h3_model.vae.tiny_decoder import load_tiny_decoder

        device = compute_device()
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        decoder = load_tiny_decoder(path, device, dtype)
        if decoder.latent_channels != latent_channels:
            raise InputError(f"{name} decodes {decoder.latent_channels}-channel latents but this H3 model makes "
                             f"{latent_channels}; remove it from models/vae_approx or use the matching file")
        _tiny_decoders[path] = decoder
    return _tiny_decoders[path]


def previews_wanted() -> bool:
    """ComfyUI's own preview setting (`--preview-method`): any method but `none` shows our latent preview."""
    cli = optional_module("comfy.cli_args")
    method = getattr(getattr(cli, "args", None), "preview_method", None)
    return method is not None and getattr(method, "value", str(method)) != "none"


class InterruptFlag:
    """Duck-types the `threading.Event` the engine's cancel checks poll: set when ComfyUI's user presses
    Cancel (or POST /interrupt), or when `set()` is called."""

    def __init__(self):
        self._local = threading.Event()
        self._mm = optional_module("comfy.model_management")

    def set(self) -> None:
        self._local.set()

    def is_set(self) -> bool:
        if self._local.is_set():
            return True
        check = getattr(self._mm, "processing_interrupted", None)
        return bool(check()) if check is not None else False

    def raise_interrupted(self, cancelled: Exception) -> None:
        """Re-raise an engine cancellation as ComfyUI's interrupt (shown as "interrupted", not an error)."""
        throw = getattr(self._mm, "throw_exception_if_processing_interrupted", None)
        if throw is not None:
            throw()
        raise cancelled


def env_flag(name: str) -> str | None:
    value = os.environ.get(name)
    return value.strip() if value and value.strip() else None
