"""Regenerate workflows/templates/ (UI graphs) and workflows/api/templates/ (API prompts, for the templates that
convert completely) from Comfy-Org's MiniMax H3 templates, with `h3-spark convert-workflow`'s converter, and
the table of what each could not carry (workflows/templates/README.md).

    python scripts/convert_comfy_templates.py            # from the installed comfyui-workflow-templates-json
    python scripts/convert_comfy_templates.py --check    # exit 1 when a committed file differs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from h3_spark.comfy_templates import convert_file  # noqa: E402

PACKAGE, PINNED = "comfyui-workflow-templates-json", "0.1.123"
# The local MiniMax H3 templates (the api_minimax_h3_* ones call MiniMax's cloud API instead).
TEMPLATES = ("video_minimax_h3_t2v", "video_minimax_h3_i2v", "video_minimax_h3_i2v_continuation",
             "video_minimax_h3_r2v", "video_minimax_h3_multiframe_reference",
             "video_minimax_h3_fun_controlnet_union", "video_fastvideo_fasth3_t2v", "video_fastvideo_fasth3_i2v",
             "video_fasth3_ominiref_r2v", "image_minimax_h3_t2i")
UI_DIR, API_DIR = ROOT / "workflows" / "templates", ROOT / "workflows" / "api" / "templates"


def templates_dir() -> Path:
    import comfyui_workflow_templates_json as package

    return Path(package.__file__).resolve().parent / "templates"


def outputs(source: Path) -> dict[Path, str]:
    """Each file this template gives, with its text."""
    def text(data) -> str:
        return json.dumps(data, indent=2, ensure_ascii=False) + "\n"

    conversion, ui = convert_file(source)
    files = {UI_DIR / source.name: text(ui)}
    if conversion.complete:
        files[API_DIR / source.name] = text(convert_file(source, api=True)[1])
    return files, conversion


def cell(text: str) -> str:
    """Table text as markdown shows it: a prompt's <Picture 2> is not an HTML tag."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def readme(conversions) -> str:
    lines = ["# Comfy-Org's MiniMax H3 templates on h3-spark nodes", "",
             f"Made by `scripts/convert_comfy_templates.py` from {PACKAGE} {PINNED} (`h3-spark convert-workflow`; "
             "docs/comfyui.md). The API prompts in `workflows/api/templates/` exist for the templates that convert "
             "completely.", "", "| template | converted | not carried (node id, type: why) | changed, warnings |", "|---|---|---|---|"]
    for name, conversion in conversions:
        missing = "<br>".join(cell(f"[{e['id']}] {e['type']}: {e['detail']}") for e in conversion.not_carried) or "-"
        notes = "<br>".join(map(cell, [*conversion.settings.get("settings_not_carried", []),
                                       *conversion.settings.get("warnings", [])])) or "-"
        lines.append(f"| `{name}` | {'complete' if conversion.complete else 'partly'} | {missing} | {notes} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--templates", type=Path, default=None, help=f"the templates folder (default: {PACKAGE}'s)")
    parser.add_argument("--check", action="store_true", help="compare with the committed files, write nothing")
    args = parser.parse_args(argv)
    folder = args.templates or templates_dir()
    files, conversions = {}, []
    for name in TEMPLATES:
        made, conversion = outputs(folder / f"{name}.json")
        files.update(made)
        conversions.append((name, conversion))
    files[UI_DIR / "README.md"] = readme(conversions)
    stale = [path for path, text in files.items() if not path.exists() or path.read_text(encoding="utf-8") != text]
    if args.check:
        for path in stale:
            print(f"out of date: {path.relative_to(ROOT)}", file=sys.stderr)
        return 1 if stale else 0
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    print(f"wrote {len(files)} files ({len(stale)} changed)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
