"""A Comfy-Org MiniMax H3 template (UI workflow, subgraphs included) rebuilt on h3-spark nodes.

The walk starts at the template's outputs (Save Video / Save Image) and goes back through decode, sampler,
model chain and conditioning, so every node the result depends on is met once and given a fate in the report:
`converted` (an h3-spark node does its work), `absorbed` (its work is part of an h3-spark node's: guider,
noise, sampler select, scheduler, audio decode, video assembly), `folded` (a helper node evaluated into a
value), `kept` (a ComfyUI core node of 0.3.64, carried as it is), `unused` (a branch a switch did not take, a
bypassed node, a note) or `not_carried` (what the h3-spark graph cannot do yet: the result differs from the
template's, and the report says so by node id and type)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import InputError
from ..h3_model import geometry
from ..nodes.definitions import TEXT_LAYER
from .folding import FOLDED, Folder
from .ui_graph import BYPASSED, MUTED, FlatGraph, Out, Value

H3_TYPE_PREFIX = "MiniMaxH3"
# Defaults the h3-spark loaders take where the template has no counterpart (our shipped workflows' choices).
TOKENIZER = "qwen3vl_tokenizer/"
AUDIO_VAE = "minimax_h3_audio_vae_fp32.safetensors"
# Where ComfyUI's missing-models dialog fetches it (the address Comfy-Org's video templates give).
AUDIO_VAE_DOWNLOAD = {"name": AUDIO_VAE, "directory": "vae",
                      "url": f"https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main/vae/{AUDIO_VAE}"}
ATTENTION = {"comfy kitchen attention": "ck_int8", "pytorch attention": "sdpa"}
WEIGHT_DTYPES = {"default": "bfloat16"}
SAMPLERS = ("euler", "res_multistep")
SCHEDULERS = ("h3", "simple", "beta", "normal")
# BlockSparseAttention's settings that the VSA recipes run with; another value is not carried.
VSA_FIXED = {"end_percent": 1, "dense_blocks": "", "min_tokens": 12288, "sink_conditioning": "exact_kv_and_rows"}
NOTES = {"MarkdownNote", "Note"}
UNUSED_WHEN_UNREACHED = FOLDED | {"LoraLoaderModelOnly"}


@dataclass
class Link:
    node: int
    slot: int


@dataclass
class TargetNode:
    id: int
    class_type: str
    inputs: dict
    title: str
    mode: int = 0
    properties: dict = field(default_factory=dict)


@dataclass
class Conversion:
    """The converted graph, the fate of every template node, and the settings carried (for reading and tests)."""
    template: str
    nodes: list[TargetNode]
    report: list[dict]
    settings: dict

    @property
    def not_carried(self) -> list[dict]:
        return [entry for entry in self.report if entry["fate"] == "not_carried"]

    @property
    def complete(self) -> bool:
        return not self.not_carried

    def report_json(self) -> dict:
        return {"template": self.template, "complete": self.complete, "settings": self.settings,
                "not_carried": self.not_carried, "nodes": self.report}


def check_is_h3(graph: FlatGraph) -> None:
    """InputError in one line unless the workflow runs MiniMax H3 locally."""
    types = {node.type for node in graph.nodes.values()}
    if any(t.startswith(H3_TYPE_PREFIX) for t in types):
        return
    clip_types = {str(node.widgets.get("type")) for node in graph.nodes.values() if node.type == "CLIPLoader"}
    if "minimax" in clip_types:
        return
    cloud = sorted(t for t in types if t.startswith("Minimax"))
    if cloud:
        raise InputError(f"{graph.name}: not a local MiniMax H3 template: it calls MiniMax's cloud API "
                         f"({', '.join(cloud)}), which has no h3-spark counterpart")
    raise InputError(f"{graph.name}: not a MiniMax H3 template (no MiniMaxH3 node and no CLIPLoader of type "
                     f"minimax)")


class Converter:
    def __init__(self, graph: FlatGraph):
        self.graph = graph
        self.fold = Folder(graph)
        self.nodes: list[TargetNode] = []
        self.fates: dict[str, tuple[str, str, list[int]]] = {}
        self.made: dict[tuple, object] = {}
        self.settings: dict = {"guides": [], "references": [], "images": [], "loras": []}
        self.vae_files: dict[str, str] = {}
        self.vae_properties: list = []
        self.bypassed_loras: list[TargetNode] = []

    # ---------------------------------------------------------------- bookkeeping
    def add(self, class_type: str, inputs: dict, title: str, source=None, **extra) -> TargetNode:
        if class_type.startswith("H3Spark"):
            # Every setting written, the ones the template has no word on at the node's declared defaults, so
            # the UI graph's widget values line up with the node's widgets.
            given = inputs
            inputs = {k: v for k, v in given.items() if isinstance(v, Link)}
            inputs.update({k: v for k, v in declared_defaults(class_type).items() if k not in inputs})
            inputs.update(given)
        node = TargetNode(len(self.nodes) + 1, class_type, inputs, title, **extra)
        self.nodes.append(node)
        if source is not None:
            self.fate(source, "converted", f"-> {title}", node.id)
        return node

    def fate(self, key: str, fate: str, detail: str = "", target: int | None = None) -> None:
        old = self.fates.get(key)
        if old is not None and old[0] == "not_carried" and fate != "not_carried":
            return
        targets = list(old[2]) if old else []
        if target is not None and target not in targets:
            targets.append(target)
        self.fates[key] = (fate, detail or (old[1] if old else ""), targets)

    def not_carried(self, key: str, reason: str) -> None:
        self.fates[key] = ("not_carried", reason, [])

    def node(self, source, *types: str, where: str):
        """The flat node a source leads to (helpers folded), checked to be one of `types`."""
        followed = self.fold.follow(source)
        if not isinstance(followed, Out):
            raise InputError(f"{self.graph.name}: {where} is not connected to a node")
        node = self.graph.nodes[followed.key]
        if types and node.type not in types:
            raise InputError(f"{self.graph.name}: {where} comes from {node.describe()}; expected "
                             f"{' or '.join(types)}")
        return node, followed.slot

    def setting(self, node, name: str, default=None):
        source = self.graph.param(node.key, name)
        if source is None and default is not None:
            return default
        return self.fold.value(source, f"{node.describe()}.{name}")

    # ---------------------------------------------------------------- outputs
    def convert(self) -> None:
        outputs = [n for n in self.graph.nodes.values() if n.type in ("SaveVideo", "SaveImage") and n.mode == 0]
        if not outputs:
            raise InputError(f"{self.graph.name}: no Save Video or Save Image node: nothing to convert to")
        for out in outputs:
            try:
                if out.type == "SaveVideo":
                    self.save_video(out)
                else:
                    self.save_image(out)
            except _NotCarried as exc:
                self.not_carried(out.key, f"its input is not carried ({exc})")
        self.finish()

    def save_video(self, out) -> None:
        create, _ = self.node(self.graph.param(out.key, "video"), "CreateVideo", where=f"{out.describe()}.video")
        images, _ = self.node(self.graph.param(create.key, "images"), where=f"{create.describe()}.images")
        if images.type != "VAEDecode":
            raise _NotCarried(self.not_carried_node(images, "frames from a node h3-spark does not run"))
        decode = self.decode(images)
        audio_source = self.graph.param(create.key, "audio")
        audio = None
        if audio_source is not None:
            audio_node, _ = self.node(audio_source, "VAEDecodeAudio", where=f"{create.describe()}.audio")
            self.fate(audio_node.key, "absorbed", "H3 Decode gives the sound", decode.id)
            self.note_vae(audio_node, "vae", "audio")
            audio = Link(decode.id, 1)
        fps = self.setting(create, "fps", 24)
        self.fate(create.key, "absorbed", "H3 Save Video muxes frames and sound", decode.id)
        prefix = self.setting(out, "filename_prefix", "h3-spark/H3")
        inputs = {"images": Link(decode.id, 0), "filename_prefix": prefix, "fps": int(round(fps)), "crf": 18}
        if audio is not None:
            inputs["audio"] = audio
        self.add("H3SparkSaveVideo", inputs, "H3 Save Video", out.key)
        self.settings.update(filename_prefix=prefix, fps=fps)
        if float(fps) != round(float(fps)):
            self.not_carried(create.key, f"fps {fps} is not a whole number (H3 Save Video takes an INT)")
        for name in ("format", "codec"):
            if out.widgets.get(name, "auto") not in ("auto", "mp4", "h264"):
                self.not_carried_setting(out, f"{name} {out.widgets[name]!r}: H3 Save Video writes H.264 + AAC mp4")

    def save_image(self, out) -> None:
        images, _ = self.node(self.graph.param(out.key, "images"), where=f"{out.describe()}.images")
        if images.type != "VAEDecode":
            raise _NotCarried(self.not_carried_node(images, "pictures from a node h3-spark does not run"))
        decode = self.decode(images)
        prefix = self.setting(out, "filename_prefix", "ComfyUI")
        self.add("SaveImage", {"images": Link(decode.id, 0), "filename_prefix": prefix}, "Save Image")
        self.fate(out.key, "kept", "core node", self.nodes[-1].id)
        self.settings.update(filename_prefix=prefix)

    def not_carried_node(self, node, reason: str) -> str:
        self.not_carried(node.key, reason)
        return node.describe()

    def decode(self, vae_decode) -> TargetNode:
        key = ("decode", vae_decode.key)
        if key in self.made:
            return self.made[key]
        samples, slot = self.node(self.graph.param(vae_decode.key, "samples"),
                                  where=f"{vae_decode.describe()}.samples")
        if samples.type == "LTXVSeparateAVLatent":
            # H3 Decode reads the video part of the latent itself: the split is its first step.
            self.fate(samples.key, "absorbed", "H3 Decode takes the video latent out of the audio-video latent")
            samples, slot = self.node(self.graph.param(samples.key, "av_latent"),
                                      where=f"{samples.describe()}.av_latent")
        if samples.type != "SamplerCustomAdvanced":
            raise _NotCarried(self.not_carried_node(samples, "latents from a sampler h3-spark does not replace"))
        latent = self.sampler(samples)
        self.note_vae(vae_decode, "vae", "video")
        node = self.add("H3SparkDecode", {"vae": Link(self.vae_loader().id, 0), "samples": latent}, "H3 Decode",
                        vae_decode.key)
        self.made[key] = node
        return node

    # ---------------------------------------------------------------- loaders
    def note_vae(self, node, name: str, kind: str) -> None:
        loader, _ = self.node(self.graph.param(node.key, name), "VAELoader", where=f"{node.describe()}.{name}")
        file = self.setting(loader, "vae_name")
        if self.vae_files.setdefault(kind, file) != file:
            self.not_carried(loader.key, f"a second {kind} VAE ({file}; the graph runs one: "
                                         f"{self.vae_files[kind]})")
        models = loader.properties.get("models")
        if models:
            self.vae_properties.extend(m for m in models if m not in self.vae_properties)
        self.fate(loader.key, "converted", f"-> H3 VAE Loader ({kind})", self.vae_loader().id)

    def vae_loader(self) -> TargetNode:
        if "vae" not in self.made:
            self.made["vae"] = self.add("H3SparkVAELoader", {}, "H3 VAE Loader")
        return self.made["vae"]

    def text_encoder(self, clip_source, where: str) -> TargetNode:
        loader, _ = self.node(clip_source, "CLIPLoader", where=where)
        if loader.key in self.made:
            return self.made[loader.key]
        clip_type = self.setting(loader, "type", "minimax")
        if clip_type != "minimax":
            self.not_carried(loader.key, f"CLIPLoader type {clip_type!r}: H3's text encoder is type minimax")
        name = self.setting(loader, "clip_name")
        node = self.add("H3SparkTextEncoderLoader", {"text_encoder_name": name, "tokenizer": TOKENIZER,
                                                     "dtype": "bfloat16", "layer": TEXT_LAYER},
                        "H3 Text Encoder Loader", loader.key, properties=_models(loader))
        self.settings["text_encoder"] = name
        self.made[loader.key] = node
        return node

    # ---------------------------------------------------------------- sampler
    def sampler(self, sca) -> Link:
        key = ("sampler", sca.key)
        if key in self.made:
            return self.made[key]
        where = sca.describe()
        noise, _ = self.node(self.graph.param(sca.key, "noise"), "RandomNoise", where=f"{where}.noise")
        select, _ = self.node(self.graph.param(sca.key, "sampler"), "KSamplerSelect", where=f"{where}.sampler")
        sigmas, _ = self.node(self.graph.param(sca.key, "sigmas"), "BasicScheduler", where=f"{where}.sigmas")
        guider, _ = self.node(self.graph.param(sca.key, "guider"), where=f"{where}.guider")
        if guider.type != "BasicGuider":
            self.not_carried(guider.key, "only BasicGuider (no CFG, no negative prompt) has an H3 Sampler "
                                         "counterpart")
        for absorbed in (sca, noise, select, sigmas, guider):
            if self.fates.get(absorbed.key, ("",))[0] != "not_carried":
                self.fate(absorbed.key, "absorbed", "H3 Sampler")
        seed = int(self.setting(noise, "noise_seed"))
        control = noise.widgets.get("control_after_generate", "fixed")
        sampler_name = self.setting(select, "sampler_name")
        scheduler = self.setting(sigmas, "scheduler")
        steps = int(self.setting(sigmas, "steps"))
        denoise = float(self.setting(sigmas, "denoise", 1.0))
        if sampler_name not in SAMPLERS:
            self.not_carried(select.key, f"sampler {sampler_name!r}: H3 Sampler runs {' or '.join(SAMPLERS)}")
        if scheduler not in SCHEDULERS:
            self.not_carried(sigmas.key, f"scheduler {scheduler!r}: H3 Sampler runs {', '.join(SCHEDULERS)}")
        if denoise != 1.0:
            self.not_carried(sigmas.key, f"denoise {denoise}: H3 Sampler always starts from noise (1.0)")

        model = self.model_chain(self.graph.param(guider.key, "model"), f"{guider.describe()}.model")
        # The scheduler's model decides the sigmas: its sigma shift is the one that counts.
        shift_chain = self.shifts(self.graph.param(sigmas.key, "model"))
        shifts = shift_chain or model["shifts"] or released_shifts()
        positive, latent = self.conditioning(guider, sca)
        self.set_partition(model["loader"])
        recipe = model["recipe"]
        inputs = {"model": model["link"], "positive": positive, "latent_image": latent, "seed": seed,
                  "steps": steps, "shift_video": float(shifts[0]), "shift_audio": float(shifts[1]),
                  "recipe": recipe, "sampler_name": sampler_name, "scheduler": scheduler}
        node = self.add("H3SparkSampler", inputs, "H3 Sampler", sca.key, properties={"seed_control": control})
        other_steps = self.steps_when_switched(self.graph.param(sigmas.key, "steps"))
        if other_steps is not None:
            self.settings["steps_when_switched"] = other_steps
            for lora in self.bypassed_loras:  # what turning it on asks of the sampler, where the user sees it
                lora.title = f"H3 LoRA Loader (off as in the template; on: H3 Sampler steps {other_steps})"
        self.settings.update(seed=seed, seed_control=control, steps=steps, sampler_name=sampler_name,
                             scheduler=scheduler, shift_video=float(shifts[0]), shift_audio=float(shifts[1]),
                             recipe=recipe, shifts_from_template=bool(shift_chain or model["shifts"]))
        self.made[key] = Link(node.id, 0)
        return self.made[key]

    def shifts(self, source):
        seen = set()
        while source is not None:
            followed = self.fold.follow(source)
            if not isinstance(followed, Out) or followed.key in seen:
                return None
            seen.add(followed.key)
            node = self.graph.nodes[followed.key]
            if node.type == "MiniMaxH3SigmaShift":
                self.fate(node.key, "converted", "-> H3 Sampler shift_video / shift_audio")
                return float(self.setting(node, "shift_video")), float(self.setting(node, "shift_audio"))
            if node.type == "UNETLoader":
                return None
            source = self.graph.param(node.key, "model")
        return None

    def model_chain(self, source, where: str) -> dict:
        """UNETLoader -> [LoRA] -> [sigma shift] -> [attention backend] -> [sparse attention], read from the
        guider back to the loader."""
        found = {"shifts": None, "attention": None, "vsa": None, "loras": []}
        chain = []
        while True:
            node, _ = self.node(source, where=where)
            if node in chain:
                raise InputError(f"{self.graph.name}: the model chain runs through {node.describe()} twice")
            chain.append(node)
            if node.type == "UNETLoader":
                break
            if node.type == "MiniMaxH3SigmaShift":
                found["shifts"] = (float(self.setting(node, "shift_video")), float(self.setting(node, "shift_audio")))
                self.fate(node.key, "converted", "-> H3 Sampler shift_video / shift_audio")
            elif node.type == "ModelAttentionBackend":
                found["attention"] = node
            elif node.type == "BlockSparseAttention":
                found["vsa"] = node
            elif node.type == "LoraLoaderModelOnly":
                found["loras"].insert(0, node)
            else:
                self.not_carried(node.key, "a model patch h3-spark does not have (the model runs without it)")
            if node.input("model") is None:
                raise InputError(f"{self.graph.name}: the model chain ends at {node.describe()}, not at a "
                                 f"UNETLoader")
            source, where = self.graph.param(node.key, "model"), f"{node.describe()}.model"
        unet = chain[-1]
        dit = self.setting(unet, "unet_name")
        dtype = self.setting(unet, "weight_dtype", "default")
        if dtype not in WEIGHT_DTYPES:
            self.not_carried(unet.key, f"weight_dtype {dtype!r}: H3 Model Loader keeps a quantized file's own "
                                       f"format and computes in bfloat16")
        loader = self.add("H3SparkModelLoader", {"dit_name": dit, "partition": "auto",
                                                 "weight_dtype": WEIGHT_DTYPES.get(dtype, "bfloat16"),
                                                 "linear": "auto", "attention": "auto"},
                          "H3 Model Loader", unet.key, properties=_models(unet))
        self.settings["dit"] = dit
        link = Link(loader.id, 0)
        for lora in found["loras"]:
            link = self.lora(lora, link, active=True)
        for lora in self.unused_loras(unet, found["loras"]):
            link = self.lora(lora, link, active=False)
        if found["attention"] is not None:
            node = found["attention"]
            backend = self.setting(node, "attention")
            if backend not in ATTENTION:
                self.not_carried(node.key, f"attention {backend!r} has no h3-spark backend")
            patch = self.add("H3SparkAttentionPatch", {"model": link, "backend": ATTENTION.get(backend, "auto")},
                             "H3 Attention Patch", node.key)
            self.settings["attention"] = ATTENTION.get(backend, "auto")
            link = Link(patch.id, 0)
        recipe = self.vsa_recipe(found["vsa"], dit) if found["vsa"] is not None else ""
        return {"link": link, "shifts": found["shifts"], "recipe": recipe, "loader": loader}

    def set_partition(self, loader: TargetNode) -> None:
        """The DiT partition the conditioning runs (FastH3 file names say neither, so `auto` could not tell)."""
        partition = "ref2va" if self.settings.get("mode") == "ref2va" else "t2va/fl2va"
        loader.inputs["partition"] = partition
        tokens = set(re.split(r"[^a-z0-9]+", loader.inputs["dit_name"].lower()))
        other = {"ref2va": {"t2va", "fl2va", "i2v", "t2v"}, "t2va/fl2va": {"ref2va", "r2v"}}[partition]
        if tokens & other:
            self.settings.setdefault("warnings", []).append(
                f"{loader.inputs['dit_name']} reads as the other partition, but the graph's conditioning runs "
                f"{partition}")

    def lora(self, node, link: Link, active: bool) -> Link:
        name = self.setting(node, "lora_name")
        strength = float(self.setting(node, "strength_model", 1.0))
        loader = self.add("H3SparkLoraLoader", {"model": link, "lora_name": name, "strength": strength},
                          "H3 LoRA Loader", mode=0 if active else BYPASSED, properties=_models(node))
        if active:
            self.fate(node.key, "converted", "-> H3 LoRA Loader", loader.id)
        else:
            self.fate(node.key, "unused", "the LoRA switch is off: an H3 LoRA Loader carries it bypassed",
                      loader.id)
        self.settings["loras"].append({"name": name, "strength": strength, "enabled": active})
        if not active:
            self.bypassed_loras.append(loader)
        return Link(loader.id, 0)

    def steps_when_switched(self, source) -> int | None:
        """The steps a switch in front of the scheduler gives on its other branch (the LoRA's steps, when the
        template's "Enable ... LoRA" is off), or None when no switch decides them."""
        while isinstance(source, Out):
            node = self.graph.nodes[source.key]
            if node.type != "ComfySwitchNode":
                return None
            chosen = bool(self.fold.value(self.graph.param(node.key, "switch"), f"{node.describe()}.switch"))
            other = self.fold.follow(self.graph.param(node.key, "on_false" if chosen else "on_true"))
            return int(other.value) if isinstance(other, Value) else None
        return None

    def unused_loras(self, unet, active) -> list:
        """LoRA loaders on the model that a switch left out: carried bypassed, so turning them on is one click."""
        unused = []
        for node in self.graph.nodes.values():
            if node.type != "LoraLoaderModelOnly" or node in active or node.mode != 0:
                continue
            followed = self.fold.follow(self.graph.param(node.key, "model"))
            if isinstance(followed, Out) and followed.key == unet.key:
                unused.append(node)
        return unused

    def vsa_recipe(self, node, dit: str) -> str:
        method = self.setting(node, "selection")
        if method != "vsa":
            self.not_carried(node.key, f"sparse attention {method!r}: h3-spark's FastH3 recipes run vsa only")
            return ""
        name = dit.lower()
        if "omniref" in name:
            recipe = "omniref"
        elif "fasth3" in name:
            recipe = "fasth3-v2"
        else:
            self.not_carried(node.key, f"VSA on {dit}, which is not a FastH3 checkpoint")
            return ""
        keep = float(self.setting(node, "selection.keep_percent"))
        start = float(self.setting(node, "start_percent"))
        for name, fixed in VSA_FIXED.items():
            if name in node.widgets and self.setting(node, name) != fixed:
                self.not_carried(node.key, f"{name} {self.setting(node, name)!r}: the {recipe} recipe runs "
                                           f"{fixed!r}")
        self.fate(node.key, "converted", f"-> H3 Sampler recipe {recipe}")
        sparsity = round(1 - keep / 100, 6)
        self.settings["vsa"] = {"keep_percent": keep, "start_percent": start}
        return f"{recipe}:sparsity={sparsity:g},start={start:g}"

    # ---------------------------------------------------------------- conditioning
    def conditioning(self, guider, sca) -> tuple[Link, Link]:
        source = self.graph.param(guider.key, "conditioning")
        latent_node, latent_slot = self.node(self.graph.param(sca.key, "latent_image"),
                                             where=f"{sca.describe()}.latent_image")
        cond_node, _ = self.node(source, where=f"{guider.describe()}.conditioning")
        if cond_node.type == "CLIPTextEncode":
            return self.text_to_image(cond_node, latent_node)
        positive = self.positive(source, f"{guider.describe()}.conditioning")
        if latent_node.key + ":latent" not in self.made:
            raise InputError(f"{self.graph.name}: the sampler's latent comes from {latent_node.describe()}, which "
                             f"is not one of the conditioning nodes")
        target = self.made[latent_node.key + ":latent"]
        return positive, Link(target, latent_slot)

    def positive(self, source, where: str) -> Link:
        node, slot = self.node(source, where=where)
        if node.key in self.made:
            return Link(self.made[node.key], 0)
        if node.type == "MiniMaxH3AddGuide":
            target = self.add_guide(node)
        elif node.type == "MiniMaxH3ImageToVideo":
            target = self.image_to_video(node)
        elif node.type == "MiniMaxH3ReferenceToVideo":
            target = self.reference_to_video(node)
        else:
            raise _NotCarried(self.not_carried_node(node, "a conditioning node h3-spark does not have"))
        self.made[node.key] = target
        self.made[node.key + ":latent"] = target
        return Link(target, 0)

    def canvas(self, node, names=("width", "height", "length")) -> dict:
        values, at_run_time = {}, {}
        for name in names:
            followed = self.fold.follow(self.graph.param(node.key, name))
            if isinstance(followed, Value):
                values[name] = int(followed.value)
                continue
            # Known only when the graph runs (a size read off an image): the node's own widget value stands in.
            values[name] = int(node.widgets.get(name) or 0)
            if isinstance(followed, Out):
                at_run_time.setdefault(followed.key, []).append(name)
            self.not_carried_setting(node, f"{name} is not known before the graph runs; set to {values[name]}")
        for key, which in at_run_time.items():
            fixed = ", ".join(f"{name} {values[name]}" for name in which)
            self.not_carried(key, f"gives {node.describe()} its {' and '.join(which)} when the graph runs; the "
                                  f"converted graph has a fixed {fixed}")
        off_grid = {k: v for k, v in values.items() if k != "length" and v % 32}
        if off_grid:
            # h3-spark's canvas is on H3's 32-pixel grid: the nearest size on it, the template's kept in the report.
            self.settings["canvas_from_template"] = [values.get("width"), values.get("height")]
            for name, value in off_grid.items():
                values[name] = max(32, round(value / 32) * 32)
                self.not_carried_setting(node, f"{name} {value} is off H3's 32-pixel grid; set to {values[name]}")
        self.settings.update(width=values["width"], height=values["height"])
        if "length" in values:
            self.settings["length"] = values["length"]
        return values

    def not_carried_setting(self, node, reason: str) -> None:
        self.settings.setdefault("settings_not_carried", []).append(f"{node.describe()}: {reason}")

    def prompt(self, node, name: str) -> str:
        prompt = str(self.setting(node, name, ""))
        self.settings["prompt"] = prompt
        return prompt

    def check_mentions(self, node, prompt: str, pictures: int) -> None:
        """Warn when the prompt names a <Picture i> the text encoder is not given: ComfyUI's own nodes and ours read
        such a label as plain words (ours log it when they run); the h3-spark CLI and service refuse it."""
        named = sorted({int(n) for n in re.findall(r"<Picture (\d+)>", prompt)} - set(range(1, pictures + 1)))
        if named:
            labels = ", ".join(f"<Picture {n}>" for n in named)
            self.settings.setdefault("warnings", []).append(
                f"{node.describe()}: the prompt names {labels}, but the text encoder is given {pictures} "
                f"picture(s) (guide pictures are not shown to it): read as plain text, as ComfyUI reads it")

    def image(self, source, where: str) -> Link | None:
        followed = self.fold.follow(source)
        if followed is None:
            return None
        if not isinstance(followed, Out):
            raise InputError(f"{self.graph.name}: {where} is a value, not an image")
        node = self.graph.nodes[followed.key]
        if node.key in self.made:
            return Link(self.made[node.key], followed.slot)
        if node.type == "LoadImage":
            file = self.setting(node, "image")
            target = self.add("LoadImage", {"image": file}, "Load Image")
            self.fate(node.key, "kept", "core node", target.id)
            self.settings["images"].append(file)
        elif node.type == "ImageScaleToTotalPixels":
            # The conditioning node resizes its pictures onto the canvas itself: a rescale before it only
            # changes the resampling, so it is absorbed rather than carried (0.3.64's node has no 32 px steps).
            self.fate(node.key, "absorbed", "the h3-spark conditioning node resizes the picture onto the canvas")
            return self.image(self.graph.param(node.key, "image"), f"{node.describe()}.image")
        else:
            raise _NotCarried(self.not_carried_node(node, "an image from a node h3-spark does not carry"))
        self.made[node.key] = target.id
        return Link(target.id, followed.slot)

    def image_to_video(self, node) -> int:
        where = node.describe()
        encoder = self.text_encoder(self.graph.param(node.key, "clip"), f"{where}.clip")
        canvas = self.canvas(node)
        prompt = self.prompt(node, "prompt")
        frames = {name: self.image(self.graph.param(node.key, name), f"{where}.{name}")
                  for name in ("first_frame", "last_frame")}
        frames = {k: v for k, v in frames.items() if v is not None}
        if not frames:
            inputs = {"text_encoder": Link(encoder.id, 0), "prompt": prompt, **canvas}
            self.settings["mode"] = "t2va"
            return self.add("H3SparkTextToVideo", inputs, "H3 Text to Video", node.key).id
        self.note_vae(node, "vae", "video")
        inputs = {"text_encoder": Link(encoder.id, 0), "vae": Link(self.vae_loader().id, 0), "prompt": prompt,
                  **canvas, **frames}
        self.settings["keyframes"] = sorted(frames)
        self.settings["mode"] = "fl2va"
        self.check_mentions(node, prompt, len(frames))
        return self.add("H3SparkFirstLastFrameToVideo", inputs, "H3 First-Last Frame to Video", node.key).id

    def reference_to_video(self, node) -> int:
        where = node.describe()
        encoder = self.text_encoder(self.graph.param(node.key, "clip"), f"{where}.clip")
        self.note_vae(node, "vae", "video")
        if node.input("audio_vae") is not None and node.input("audio_vae").get("link") is not None:
            self.note_vae(node, "audio_vae", "audio")
        canvas = self.canvas(node)
        prompt = self.prompt(node, "prompt")
        size = self.setting(node, "ref_image_size", "match")
        if size not in geometry.REFERENCE_POLICIES:
            self.not_carried_setting(node, f"ref_image_size {size!r} is not one of "
                                           f"{', '.join(geometry.REFERENCE_POLICIES)}; match used")
            self.not_carried(node.key, f"ref_image_size {size!r} has no h3-spark counterpart")
            size = "match"
        inputs = {"text_encoder": Link(encoder.id, 0), "vae": Link(self.vae_loader().id, 0), "prompt": prompt,
                  **canvas, "reference_size": size, "video_fps": 24.0}
        refs = []
        for item in node.raw.get("inputs") or []:
            name = item.get("name", "")
            if item.get("link") is None or not name.startswith("ref_"):
                continue
            if not name.startswith("ref_images."):
                self.not_carried(node.key, f"reference input {name}: only reference images are carried")
                continue
            refs.append((int(name.rsplit("_", 1)[1]), self.image(self.graph.param(node.key, name), f"{where}.{name}")))
        if len(refs) > 4:
            self.not_carried(node.key, f"{len(refs)} reference images; H3 Reference to Video takes 4")
        for index, (_, link) in enumerate(sorted(refs, key=lambda r: r[0])[:4], start=1):
            inputs[f"image_{index}"] = link
            self.settings["references"].append(self.file_of(link))
        self.settings["reference_size"] = size
        self.settings["mode"] = "ref2va"
        self.check_mentions(node, prompt, min(len(refs), 4))
        return self.add("H3SparkReferenceToVideo", inputs, "H3 Reference to Video", node.key).id

    def add_guide(self, node) -> int:
        where = node.describe()
        positive = self.positive(self.graph.param(node.key, "positive"), f"{where}.positive")
        latent_node, latent_slot = self.node(self.graph.param(node.key, "latent"), where=f"{where}.latent")
        self.positive(Out(latent_node.key, 0), f"{where}.latent")
        latent = Link(self.made[latent_node.key + ":latent"], latent_slot)
        self.note_vae(node, "vae", "video")
        if node.input("audio_vae") is not None and node.input("audio_vae").get("link") is not None:
            self.note_vae(node, "audio_vae", "audio")
        frame_idx = int(self.setting(node, "frame_idx", 0))
        inputs = {"positive": positive, "latent": latent, "vae": Link(self.vae_loader().id, 0),
                  "frame_idx": frame_idx}
        image = self.image(self.graph.param(node.key, "image"), f"{where}.image")
        if image is not None:
            inputs["image"] = image
        if self.graph.param(node.key, "audio") is not None:
            self.not_carried(node.key, "an audio guide (only picture guides are carried)")
        for name in node.widgets:
            if name not in ("frame_idx",):
                self.not_carried(node.key, f"setting {name} is not carried")
        self.settings["guides"].append({"frame_idx": frame_idx, "image": self.file_of(image) if image else None})
        return self.add("H3SparkAddGuide", inputs, "H3 Add Guide", node.key).id

    def file_of(self, link: Link | None):
        for target in self.nodes:
            if link is not None and target.id == link.node and target.class_type == "LoadImage":
                return target.inputs["image"]
        return None

    def text_to_image(self, encode, latent_node) -> tuple[Link, Link]:
        """Text to image: CLIPTextEncode + an Empty Latent Image become H3 Text to Video at one frame."""
        where = encode.describe()
        if latent_node.type != "EmptyLatentImage":
            raise InputError(f"{self.graph.name}: text to image needs an Empty Latent Image; the latent comes from "
                             f"{latent_node.describe()}")
        encoder = self.text_encoder(self.graph.param(encode.key, "clip"), f"{where}.clip")
        canvas = self.canvas(latent_node, ("width", "height"))
        batch = int(self.setting(latent_node, "batch_size", 1))
        if batch != 1:
            self.not_carried(latent_node.key, f"batch_size {batch}: the H3 graph makes one picture")
        prompt = self.prompt(encode, "text")
        inputs = {"text_encoder": Link(encoder.id, 0), "prompt": prompt, "width": canvas["width"],
                  "height": canvas["height"], "length": 1}
        node = self.add("H3SparkTextToVideo", inputs, "H3 Text to Video (one frame)", encode.key)
        self.fate(latent_node.key, "absorbed", "H3 Text to Video makes the one-frame latent", node.id)
        self.settings["mode"] = "t2va"
        self.settings["length"] = 1
        return Link(node.id, 0), Link(node.id, 1)

    # ---------------------------------------------------------------- the end
    def finish(self) -> None:
        if "vae" in self.made:
            node = self.made["vae"]
            if "audio" not in self.vae_files:
                self.vae_files["audio"] = AUDIO_VAE
                self.settings["audio_vae_added"] = AUDIO_VAE  # H3 VAE Loader loads both; the template has none
                if self.vae_properties:
                    self.vae_properties.append(AUDIO_VAE_DOWNLOAD)
            node.inputs.update(vae_name=self.vae_files.get("video", ""), audio_vae_name=self.vae_files["audio"],
                               decode_dtype="float32", tile_size=256)
            if self.vae_properties:
                node.properties["models"] = self.vae_properties
            self.settings["vae"] = self.vae_files.get("video")
            self.settings["audio_vae"] = self.vae_files["audio"]
        for key, value in self.fold.folded.items():
            if key not in self.fates:
                self.fate(key, "folded", value)
        instances = {n.key for n in self.graph.subgraph_instances()}
        unreached = [n for n in self.graph.nodes.values() if n.key not in self.fates]
        # What a node the result cannot do without depends on is not carried either; the rest changes nothing.
        pending = [n.key for n in self.graph.nodes.values() if self.fates.get(n.key, ("",))[0] == "not_carried"]
        pending += [n.key for n in unreached if _is_output(n) and n.mode == 0 and n.key not in instances]
        blocked = set()
        while pending:
            key = pending.pop()
            for upstream in self.upstream(key):
                if upstream not in blocked:
                    blocked.add(upstream)
                    pending.append(upstream)
        for node in unreached:
            if node.type in NOTES:
                self.fate(node.key, "unused", "a note")
            elif node.key in instances:
                self.fate(node.key, "unused", "subgraph instance: its nodes are listed one by one")
            elif node.mode in (BYPASSED, MUTED):
                self.fate(node.key, "unused", "bypassed" if node.mode == BYPASSED else "muted")
            elif _is_output(node):
                self.not_carried(node.key, "an output the converted graph does not make")
            elif node.key in blocked:
                self.not_carried(node.key, "feeds a node that is not carried")
            elif node.type in UNUSED_WHEN_UNREACHED:
                self.fate(node.key, "unused", "a setting of a branch the switch does not take")
            else:
                self.fate(node.key, "unused", "nothing the outputs depend on")

    def upstream(self, key: str) -> set[str]:
        found = set()
        for item in self.graph.nodes[key].raw.get("inputs") or []:
            if item.get("link") is None:
                continue
            try:
                source = self.graph.param(key, item["name"])
            except InputError:
                continue
            if isinstance(source, Out):
                found.add(source.key)
        return found

    def result(self) -> Conversion:
        report = []
        for key, node in self.graph.nodes.items():
            fate, detail, targets = self.fates[key]
            report.append({"id": key, "type": node.type, "title": node.title, "fate": fate, "detail": detail,
                           "into": targets})
        return Conversion(self.graph.name, self.nodes, report, self.settings)


class _NotCarried(Exception):
    """A branch of the template stops at a node h3-spark cannot run (already named in the report)."""


def declared_defaults(class_type: str) -> dict:
    """An h3-spark node's settings at their declared defaults (a combo at its first choice)."""
    from ..nodes.definitions import NODE_CLASS_MAPPINGS

    spec = NODE_CLASS_MAPPINGS[class_type].INPUT_TYPES()
    defaults = {}
    for group in ("required", "optional"):
        for name, entry in spec.get(group, {}).items():
            options = entry[1] if len(entry) > 1 else {}
            if isinstance(entry[0], list) and entry[0]:
                defaults[name] = options.get("default", entry[0][0])
            elif "default" in options:
                defaults[name] = options["default"]
    return defaults


def released_shifts() -> tuple[float, float]:
    """The model's own shifts, which run when a template installs no MiniMaxH3SigmaShift."""
    from ..h3_model.pipeline import scheduler

    return scheduler.VIDEO_SHIFT, scheduler.AUDIO_SHIFT


def _is_output(node) -> bool:
    return node.type.startswith(("Save", "Preview")) or node.raw.get("outputs") == []


def _models(node) -> dict:
    models = node.properties.get("models")
    return {"models": models} if models else {}


def convert(graph: FlatGraph) -> Conversion:
    """The template `graph` on h3-spark nodes, with its report; InputError for a graph that is not H3's."""
    check_is_h3(graph)
    converter = Converter(graph)
    converter.convert()
    return converter.result()
