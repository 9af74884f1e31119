"""A ComfyUI UI workflow read as one flat graph: subgraph instances opened up (their inner nodes keyed
`instance:inner`, nested ones `a:b:c`), subgraph inputs and outputs followed through to the nodes on either
side, and each node's settings by name.

A setting's value is its link's source when one is wired (a subgraph input's link, or the instance's own widget
value when the instance leaves it unwired), else the node's widget value. Bypassed nodes (mode 4) pass their
input of the output's type through, as ComfyUI runs them; muted nodes (mode 2) give nothing."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError

SUBGRAPH_INPUT, SUBGRAPH_OUTPUT = -10, -20
MAX_NESTING = 16  # subgraphs inside subgraphs; deeper is a graph that holds itself
BYPASSED, MUTED = 4, 2
# Wire types: a subgraph input of one of these is a connection, any other type is a widget.
WIRES = {"MODEL", "CLIP", "VAE", "CONDITIONING", "LATENT", "IMAGE", "MASK", "AUDIO", "VIDEO", "NOISE", "GUIDER",
         "SAMPLER", "SIGMAS", "MODEL_PATCH", "BBOX", "POSE_KEYPOINT", "*"}
# Widget names by position, for graphs saved without `widgets_values_named` (the packaged templates carry it;
# a graph saved by the frontend does not). Only the node types the converter reads.
WIDGET_NAMES = {
    "ResolutionSelector": ("aspect_ratio", "megapixels", "multiple", "minimum"),
    "ComfyMathExpression": ("expression",),
    "PrimitiveInt": ("value", "control_after_generate"),
    "PrimitiveFloat": ("value",), "PrimitiveString": ("value",), "PrimitiveStringMultiline": ("value",),
    "PrimitiveBoolean": ("value",), "ComfySwitchNode": ("switch",),
    "KSamplerSelect": ("sampler_name",), "BasicScheduler": ("scheduler", "steps", "denoise"),
    "RandomNoise": ("noise_seed", "control_after_generate"),
    "UNETLoader": ("unet_name", "weight_dtype"), "CLIPLoader": ("clip_name", "type", "device"),
    "VAELoader": ("vae_name",), "LoraLoaderModelOnly": ("lora_name", "strength_model"),
    "MiniMaxH3SigmaShift": ("shift_video", "shift_audio"), "ModelAttentionBackend": ("attention",),
    "BlockSparseAttention": ("selection", "selection.keep_percent", "start_percent", "end_percent", "dense_blocks",
                             "min_tokens", "extra_tokens", "sink_conditioning", "verbose"),
    "MiniMaxH3ImageToVideo": ("prompt", "width", "height", "length"),
    "MiniMaxH3ReferenceToVideo": ("prompt", "width", "height", "length", "ref_image_size"),
    "MiniMaxH3AddGuide": ("frame_idx",),
    "LoadImage": ("image", "upload"), "CLIPTextEncode": ("text",),
    "EmptyLatentImage": ("width", "height", "batch_size"), "SaveImage": ("filename_prefix",),
    "SaveVideo": ("filename_prefix", "format", "codec"), "CreateVideo": ("fps",),
    "ImageScaleToTotalPixels": ("upscale_method", "megapixels", "resolution_steps"),
}


@dataclass(frozen=True)
class Out:
    """Output `slot` of the flat node `key`."""
    key: str
    slot: int


@dataclass(frozen=True)
class Value:
    """A setting known when the graph is read (a widget, or what a folded helper node computes)."""
    value: object


@dataclass
class _Scope:
    prefix: str
    links: dict  # link id -> (origin_id, origin_slot, target_id, target_slot)
    nodes: dict  # raw node id -> raw node
    definition: dict | None = None  # the subgraph this scope opens
    parent: "_Scope | None" = None
    instance: dict | None = None  # the instance node, in the parent scope


@dataclass
class Node:
    key: str
    type: str
    title: str
    mode: int
    raw: dict
    scope: _Scope = field(repr=False)
    widgets: dict = field(default_factory=dict)
    properties: dict = field(default_factory=dict)

    def input(self, name: str) -> dict | None:
        for item in self.raw.get("inputs") or []:
            if item.get("name") == name:
                return item
        return None

    def output_type(self, slot: int) -> str | None:
        outputs = self.raw.get("outputs") or []
        return outputs[slot].get("type") if slot < len(outputs) else None

    def describe(self) -> str:
        return f"[{self.key}] {self.type}" + (f" ({self.title})" if self.title and self.title != self.type else "")


def load(path: str | Path) -> dict:
    """The UI workflow in `path`, or InputError naming the file and what is wrong with it."""
    path = Path(path)
    try:
        graph = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not a JSON workflow ({exc})") from None
    if isinstance(graph, dict) and graph and all(isinstance(v, dict) and "class_type" in v for v in graph.values()):
        raise InputError(f"{path}: an API-format prompt; convert-workflow reads UI workflows (with nodes and links)")
    if not (isinstance(graph, dict) and isinstance(graph.get("nodes"), list) and isinstance(graph.get("links"), list)):
        raise InputError(f"{path}: not a ComfyUI UI workflow (no 'nodes' and 'links' lists)")
    return graph


class FlatGraph:
    """The workflow's nodes with subgraphs opened, and the sources of their settings."""

    def __init__(self, graph: dict, name: str = "workflow"):
        self.name = name
        definitions = graph.get("definitions") or {}
        self.subgraphs = {sg["id"]: sg for sg in definitions.get("subgraphs") or [] if isinstance(sg, dict)}
        self.nodes: dict[str, Node] = {}
        self._inner: dict[str, _Scope] = {}
        self._open(_Scope("", _links(graph["links"], name), _by_id(graph["nodes"], name)))

    # ---------------------------------------------------------------- reading
    def _open(self, scope: _Scope) -> None:
        for raw in scope.nodes.values():
            key = f"{scope.prefix}{raw['id']}"
            if raw.get("type") in self.subgraphs:
                if key.count(":") >= MAX_NESTING:
                    raise InputError(f"{self.name}: subgraph {raw['type']} is nested more than {MAX_NESTING} deep "
                                     f"(at node {key}): a subgraph that holds itself")
                definition = self.subgraphs[raw["type"]]
                inner = _Scope(f"{key}:", _links(definition.get("links") or [], self.name),
                               _by_id(definition.get("nodes") or [], self.name), definition, scope, raw)
                self._inner[key] = inner
                self.nodes[key] = Node(key, raw["type"], definition.get("name") or "", raw.get("mode") or 0, raw,
                                       scope, self._widgets(raw, definition))
                self._open(inner)
            else:
                self.nodes[key] = Node(key, str(raw.get("type")), raw.get("title") or "", raw.get("mode") or 0,
                                       raw, scope, self._widgets(raw), raw.get("properties") or {})

    def _widgets(self, raw: dict, definition: dict | None = None) -> dict:
        named = raw.get("widgets_values_named")
        if isinstance(named, dict):
            return dict(named)
        values = raw.get("widgets_values")
        if isinstance(values, dict):
            return dict(values)
        values = list(values or [])
        if definition is not None:  # an instance shows its subgraph's widget inputs, in order
            names = [i["name"] for i in definition.get("inputs") or [] if i.get("type") not in WIRES]
        else:
            names = WIDGET_NAMES.get(raw.get("type"), ())
        return dict(zip(names, values))

    def subgraph_instances(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.key in self._inner]

    # ---------------------------------------------------------------- sources
    def param(self, key: str, name: str) -> Out | Value | None:
        """Where setting or input `name` of node `key` comes from: its link, else its widget value."""
        node = self.nodes[key]
        item = node.input(name)
        if item is not None and item.get("link") is not None:
            return self._link(node.scope, item["link"], f"{node.describe()}.{name}")
        if name in node.widgets:  # for an instance: its unwired subgraph input's own value
            return Value(node.widgets[name])
        return None

    def _link(self, scope: _Scope, link_id: int, where: str) -> Out | Value | None:
        if link_id not in scope.links:
            raise InputError(f"{self.name}: {where} names link {link_id}, which the graph does not have")
        origin, slot = scope.links[link_id][:2]
        if origin == SUBGRAPH_INPUT:
            inputs = (scope.definition or {}).get("inputs") or []
            if scope.instance is None or slot >= len(inputs):
                raise InputError(f"{self.name}: {where} comes from subgraph input {slot}, which does not exist")
            instance_key = scope.prefix[:-1]
            return self.param(instance_key, inputs[slot]["name"])
        if origin not in scope.nodes:
            raise InputError(f"{self.name}: link {link_id} into {where} starts at node {origin}, which the graph "
                             f"does not have")
        key = f"{scope.prefix}{origin}"
        if key in self._inner:  # out of a subgraph: the link into its output node
            inner = self._inner[key]
            for link, (o, s, target, target_slot) in inner.links.items():
                if target == SUBGRAPH_OUTPUT and target_slot == slot:
                    return self._link(inner, link, where)
            return None
        return self._through(Out(key, slot), where)

    def _through(self, out: Out, where: str) -> Out | Value | None:
        node = self.nodes[out.key]
        if node.mode == MUTED:
            return None
        if node.mode == BYPASSED:
            kind = node.output_type(out.slot)
            for item in node.raw.get("inputs") or []:
                if item.get("type") == kind and item.get("link") is not None:
                    return self._link(node.scope, item["link"], where)
            return None
        return out


def _by_id(nodes, name: str) -> dict:
    table = {}
    for raw in nodes:
        if not (isinstance(raw, dict) and "id" in raw and "type" in raw):
            raise InputError(f"{name}: a node without an id and a type: {str(raw)[:80]}")
        table[raw["id"]] = raw
    return table


def _links(links, name: str) -> dict:
    """Links by id, from the top level's lists or a subgraph's objects."""
    table = {}
    for link in links:
        if isinstance(link, dict):
            try:
                table[link["id"]] = (link["origin_id"], link["origin_slot"], link["target_id"], link["target_slot"])
            except KeyError as exc:
                raise InputError(f"{name}: a link without {exc.args[0]}: {str(link)[:80]}") from None
        elif isinstance(link, list) and len(link) >= 5:
            table[link[0]] = tuple(link[1:5])
        else:
            raise InputError(f"{name}: a link that is neither [id, from, slot, to, slot, type] nor an object: "
                             f"{str(link)[:80]}")
    return table
