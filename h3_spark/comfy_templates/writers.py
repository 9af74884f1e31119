"""The converted graph written as ComfyUI reads it: the API prompt for `POST /prompt`, or a UI workflow laid
out left to right in the order it runs.

A node's widgets are written in the order its class declares them (required, then optional); inputs a class
does not declare yet are written after them, so a graph made before a node gains an input still opens."""

from __future__ import annotations

from .convert import Conversion, Link, TargetNode

WIRE_TYPES = {"H3_MODEL", "H3_TEXT_ENCODER", "H3_VAE", "MODEL", "CONDITIONING", "LATENT", "IMAGE", "AUDIO", "MASK"}
COLUMN, ROW_GAP, WIDTH = 500, 40, 360  # a column leaves room for a node the frontend widens (a long title)
# ComfyUI core nodes (0.3.64) the converted graphs carry unchanged: (wire inputs, widgets, output types).
CORE_NODES = {"LoadImage": ([], ["image"], ("IMAGE", "MASK")),
              "SaveImage": ([("images", "IMAGE")], ["filename_prefix"], ())}


def _classes():
    from ..nodes.definitions import NODE_CLASS_MAPPINGS

    return NODE_CLASS_MAPPINGS


def _declared(class_type: str) -> tuple[list, list, tuple]:
    """(wire inputs [(name, type)], widget inputs [(name, options)], output types) as the class declares them."""
    if class_type in CORE_NODES:
        wires, widgets, outputs = CORE_NODES[class_type]
        return wires, [(name, {}) for name in widgets], outputs
    cls = _classes()[class_type]
    spec = cls.INPUT_TYPES()
    wires, widgets = [], []
    for group in ("required", "optional"):
        for name, entry in spec.get(group, {}).items():
            kind = entry[0]
            options = entry[1] if len(entry) > 1 else {}
            if isinstance(kind, str) and kind in WIRE_TYPES:
                wires.append((name, kind))
            else:
                widgets.append((name, options))
    return wires, widgets, tuple(cls.RETURN_TYPES)


def _through_bypass(link: Link, nodes: dict[int, TargetNode]) -> Link:
    """A link out of a bypassed node is its same-typed input's link (the API prompt has no bypassed nodes)."""
    while nodes[link.node].mode == 4:
        node = nodes[link.node]
        wires, _, outputs = _declared(node.class_type)
        kind = outputs[link.slot]
        link = next(node.inputs[name] for name, t in wires if t == kind and isinstance(node.inputs.get(name), Link))
    return link


def api_prompt(conversion: Conversion) -> dict:
    nodes = {node.id: node for node in conversion.nodes}
    prompt = {}
    for node in conversion.nodes:
        if node.mode == 4:
            continue
        inputs = {}
        for name, value in node.inputs.items():
            if isinstance(value, Link):
                link = _through_bypass(value, nodes)
                value = [str(link.node), link.slot]
            inputs[name] = value
        prompt[str(node.id)] = {"class_type": node.class_type, "inputs": inputs, "_meta": {"title": node.title}}
    return prompt


def _depths(nodes: list[TargetNode]) -> dict[int, int]:
    by_id = {n.id: n for n in nodes}
    depth: dict[int, int] = {}

    def of(node_id: int) -> int:
        if node_id not in depth:
            links = [v for v in by_id[node_id].inputs.values() if isinstance(v, Link)]
            depth[node_id] = 1 + max((of(link.node) for link in links), default=-1)
        return depth[node_id]

    for node in nodes:
        of(node.id)
    return depth


# A Load Image node grows to show its picture once the file is there: room for ComfyUI's own default size.
IMAGE_NODE_HEIGHT = 320


def _height(node: TargetNode, wires: list, widgets: list, outputs: tuple) -> int:
    """The height the frontend draws `node` at: its slot rows (inputs beside outputs) and widgets, a prompt box."""
    prompt_rows = 120 if "prompt" in node.inputs else 0
    drawn = 60 + 24 * (max(len(wires), len(outputs)) + len(widgets)) + prompt_rows
    return max(drawn, IMAGE_NODE_HEIGHT) if node.class_type == "LoadImage" else drawn


def ui_workflow(conversion: Conversion, extra: dict | None = None) -> dict:
    depth = _depths(conversion.nodes)
    next_y: dict[int, int] = {}
    ui_nodes, links = [], []
    outputs_of: dict[int, list[list[int]]] = {}
    for node in conversion.nodes:
        _, _, outputs = _declared(node.class_type)
        outputs_of[node.id] = [[] for _ in outputs]
    for order, node in enumerate(sorted(conversion.nodes, key=lambda n: (depth[n.id], n.id))):
        wires, widgets, outputs = _declared(node.class_type)
        inputs = []
        for slot, (name, kind) in enumerate(wires):
            value = node.inputs.get(name)
            link_id = None
            if isinstance(value, Link):
                link_id = len(links) + 1
                links.append([link_id, value.node, value.slot, node.id, slot, kind])
                outputs_of[value.node][value.slot].append(link_id)
            inputs.append({"name": name, "type": kind, "link": link_id})
        values = []
        declared = {name for name, _ in widgets} | {name for name, _ in wires}
        for name, options in widgets:
            if name in node.inputs:
                values.append(node.inputs[name])
                if options.get("control_after_generate"):
                    values.append(node.properties.get("seed_control", "fixed"))
        # Inputs the class does not declare here yet (a newer pack's), after the declared ones.
        values.extend(v for k, v in node.inputs.items() if k not in declared and not isinstance(v, Link))
        column = depth[node.id]
        y = next_y.get(column, 60)
        height = _height(node, wires, widgets, outputs)
        next_y[column] = y + height + ROW_GAP
        properties = {"Node name for S&R": node.class_type,
                      **{k: v for k, v in node.properties.items() if k != "seed_control"}}
        ui_nodes.append({"id": node.id, "type": node.class_type, "pos": [40 + COLUMN * column, y],
                         "size": [WIDTH, height], "flags": {}, "order": order, "mode": node.mode, "inputs": inputs,
                         "outputs": [], "properties": properties, "widgets_values": values, "title": node.title,
                         "_outputs": outputs})
    for item in ui_nodes:
        item["outputs"] = [{"name": kind, "type": kind, "links": outputs_of[item["id"]][slot], "slot_index": slot}
                           for slot, kind in enumerate(item.pop("_outputs"))]
    ui_nodes.sort(key=lambda n: n["id"])
    return {"last_node_id": max(n["id"] for n in ui_nodes), "last_link_id": len(links), "nodes": ui_nodes,
            "links": links, "groups": [], "config": {}, "extra": {"ds": {"scale": 0.8, "offset": [0, 0]},
                                                                  **(extra or {})}, "version": 0.4}
