"""`h3-spark convert-workflow`: a Comfy-Org MiniMax H3 template rebuilt on h3-spark nodes, as a UI workflow or
(--api) the prompt for ComfyUI's /prompt, with a report of every template node it could not carry."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parser(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="turn a Comfy-Org MiniMax H3 workflow template into the same graph on h3-spark "
                                  "nodes",
                       description="Read a ComfyUI UI workflow of MiniMax H3 (Comfy-Org's templates: subgraphs, "
                                   "switches, primitives, math and resolution helpers included), and write the same "
                                   "graph on h3-spark nodes with every setting carried (canvas, length, seed, "
                                   "steps, sampler, scheduler, shifts, LoRA, sparse attention as a recipe, guides, "
                                   "references, prompts, image files). Nodes it cannot carry are listed on stderr "
                                   "by id and type (and in --report); the file is still written unless --strict.")
    p.add_argument("source", metavar="SRC.json", help="the template (a UI workflow)")
    p.add_argument("--out", required=True, metavar="DST.json", help="where to write the converted graph")
    p.add_argument("--api", action="store_true", help="write the API prompt for POST /prompt instead of a UI graph")
    p.add_argument("--report", metavar="REPORT.json", default=None,
                   help="also write the report: each template node's fate and the settings carried")
    p.add_argument("--strict", action="store_true",
                   help="write nothing (exit 2) when any template node cannot be carried")
    return p


def run(args) -> int:
    from ..comfy_templates import convert_file
    from ..errors import InputError

    source, out = Path(args.source), Path(args.out)
    if out.resolve() == source.resolve():
        raise InputError(f"--out {out} is the template itself; name another file")
    if args.report and Path(args.report).resolve() in (out.resolve(), source.resolve()):
        raise InputError(f"--report {args.report} is the template or the --out file; name another file")
    conversion, graph = convert_file(source, api=args.api)
    for entry in conversion.not_carried:
        print(f"not carried: [{entry['id']}] {entry['type']}: {entry['detail']}", file=sys.stderr)
    for change in conversion.settings.get("settings_not_carried", []):
        print(f"changed: {change}", file=sys.stderr)
    for warning in conversion.settings.get("warnings", []):
        print(f"warning: {warning}", file=sys.stderr)
    if args.strict and not conversion.complete:
        raise InputError(f"{source}: {len(conversion.not_carried)} node(s) cannot be carried (listed above); "
                         f"nothing written (--strict)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(graph, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if args.report:
        report = Path(args.report)
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps(conversion.report_json(), indent=2, ensure_ascii=False) + "\n",
                          encoding="utf-8")
    state = "complete" if conversion.complete else f"{len(conversion.not_carried)} node(s) not carried"
    print(f"{source.name} -> {out} ({'API prompt' if args.api else 'UI workflow'}, "
          f"{len(conversion.nodes)} nodes): {state}", file=sys.stderr)
    return 0
