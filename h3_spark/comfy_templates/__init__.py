"""Comfy-Org's MiniMax H3 workflow templates rebuilt on h3-spark nodes (`h3-spark convert-workflow`).

`ui_graph` reads a UI workflow with its subgraphs opened, `folding` evaluates the helper nodes of newer ComfyUI
releases into plain values (`expression` is the Math Expression node's arithmetic, without eval), `convert`
maps the graph onto h3-spark nodes and gives every template node its fate in a report, `writers` writes the
result as an API prompt or a UI workflow (node classes read from the pack's own definitions). ComfyUI is not
imported: the converter runs wherever h3-spark is installed."""

from __future__ import annotations

from pathlib import Path


def convert_file(path, api: bool = False):
    """(Conversion, the graph to write) for the template at `path`: a UI workflow, or with `api` the prompt."""
    from . import convert, ui_graph, writers

    path = Path(path)
    conversion = convert.convert(ui_graph.FlatGraph(ui_graph.load(path), path.stem))
    if api:
        return conversion, writers.api_prompt(conversion)
    return conversion, writers.ui_workflow(conversion, {"h3_spark_converted_from": path.name})
