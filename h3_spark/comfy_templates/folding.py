"""The helper nodes of newer ComfyUI templates, folded into the values they compute: Resolution Selector,
Math Expression, If/Else Switch and the Primitive nodes. Each is evaluated here as the node computes it, so the
converted graph holds plain numbers and runs on a ComfyUI without these nodes."""

from __future__ import annotations

import math

from ..errors import InputError
from . import expression
from .ui_graph import FlatGraph, Out, Value

PRIMITIVES = {"PrimitiveInt", "PrimitiveFloat", "PrimitiveString", "PrimitiveStringMultiline", "PrimitiveBoolean"}
FOLDED = PRIMITIVES | {"ResolutionSelector", "ComfyMathExpression", "ComfySwitchNode"}
# Resolution Selector's aspect ratios (its combo's labels) as width:height.
ASPECT_RATIOS = {"1:1 (Square)": (1, 1), "3:2 (Photo)": (3, 2), "4:3 (Standard)": (4, 3),
                 "16:9 (Widescreen)": (16, 9), "21:9 (Ultrawide)": (21, 9), "2:3 (Portrait Photo)": (2, 3),
                 "3:4 (Portrait Standard)": (3, 4), "9:16 (Portrait Widescreen)": (9, 16)}


def resolution(aspect_ratio: str, megapixels: float, multiple: int, minimum: int | None = None) -> tuple[int, int]:
    """Resolution Selector's canvas: the ratio scaled to `megapixels` (of 2^20 pixels), each side rounded to the
    nearest `multiple`; below `minimum` (when the node has that setting) the smallest ratio-exact size above it."""
    if aspect_ratio not in ASPECT_RATIOS:
        raise InputError(f"Resolution Selector: unknown aspect ratio {aspect_ratio!r}; known: "
                         f"{', '.join(ASPECT_RATIOS)}")
    w_ratio, h_ratio = ASPECT_RATIOS[aspect_ratio]
    scale = math.sqrt(megapixels * 1024 * 1024 / (w_ratio * h_ratio))
    width = round(w_ratio * scale / multiple) * multiple
    height = round(h_ratio * scale / multiple) * multiple
    if minimum is not None and (width < minimum or height < minimum):
        step_w, step_h = multiple // math.gcd(w_ratio, multiple), multiple // math.gcd(h_ratio, multiple)
        k_step = step_w * step_h // math.gcd(step_w, step_h)
        k = math.ceil(math.ceil(max(minimum / w_ratio, minimum / h_ratio)) / k_step) * k_step
        width, height = w_ratio * k, h_ratio * k
    return width, height


class Folder:
    """Follows a setting's source through the helper nodes to a value, or to the real node it comes from."""

    def __init__(self, graph: FlatGraph):
        self.graph = graph
        self.folded: dict[str, str] = {}  # node key -> what it gave

    def follow(self, source):
        seen = set()
        while isinstance(source, Out):
            node = self.graph.nodes[source.key]
            if node.key in seen:
                raise InputError(f"{self.graph.name}: {node.describe()} feeds itself through its switches")
            seen.add(node.key)
            if node.type == "ComfySwitchNode":
                chosen = bool(self.value(self.graph.param(node.key, "switch"), f"{node.describe()}.switch"))
                self.folded.setdefault(node.key, f"switch {chosen}: takes on_{str(chosen).lower()}")
                source = self.graph.param(node.key, "on_true" if chosen else "on_false")
                continue
            if node.type in FOLDED:
                value = self._compute(node, source.slot)
                if node.type == "ResolutionSelector":
                    self.folded[node.key] = "= {} x {}".format(self._compute(node, 0), self._compute(node, 1))
                else:
                    self.folded.setdefault(node.key, f"= {value!r}")
                return Value(value)
            return source
        return source

    def value(self, source, where: str):
        """The value a setting has, or InputError naming the node that keeps it from being known."""
        followed = self.follow(source)
        if isinstance(followed, Value):
            return followed.value
        if followed is None:
            raise InputError(f"{self.graph.name}: {where} has no value (nothing connected, no widget)")
        raise InputError(f"{self.graph.name}: {where} comes from {self.graph.nodes[followed.key].describe()}, "
                         f"which is not known before the graph runs")

    def _setting(self, node, name):
        return self.value(self.graph.param(node.key, name), f"{node.describe()}.{name}")

    def _compute(self, node, slot: int):
        if node.type in PRIMITIVES:
            return self._setting(node, "value")
        if node.type == "ResolutionSelector":
            minimum = self._setting(node, "minimum") if "minimum" in node.widgets else None
            size = resolution(self._setting(node, "aspect_ratio"), float(self._setting(node, "megapixels")),
                              int(self._setting(node, "multiple")), minimum)
            return size[slot]
        if node.type == "ComfyMathExpression":
            names = {}
            for item in node.raw.get("inputs") or []:
                name = item.get("name", "")
                if name.startswith("values.") and item.get("link") is not None:
                    names[name.split(".", 1)[1]] = self._setting(node, name)
            return expression.outputs(str(self._setting(node, "expression")), names)[slot]
        raise AssertionError(node.type)
