"""Install h3-spark's dependencies into the Python that runs ComfyUI, without bash.

    python install.py [--dry-run]
    python install.py --demo [MODELS_DIR]

Run it with ComfyUI's own Python from the pack's folder (ComfyUI/custom_nodes/h3-spark), for example on the
Windows portable build:

    python_embeded\\python.exe -s ComfyUI\\custom_nodes\\h3-spark\\install.py

ComfyUI-Manager runs this file by itself after cloning the pack. What it does:
1. checks the Python (>= 3.10) and that torch imports (it never installs or changes torch: ComfyUI's build
   for the GPU is the user's choice), and reports the GPU (H3 runs bf16: sm_80 or newer);
2. pip-installs requirements.txt with torch held at the installed version, and says so first when
   transformers 4 is about to become 5 (other node packs share it).
`--dry-run` checks and prints the pip command without running it. The bash installer
(scripts/install_comfyui_overlay.sh) does the same for a checkout kept outside ComfyUI, and links it in.

`--demo` writes the tiny demo models (a few MB of random weights) into ComfyUI's models folder, the one two
levels above this file (ComfyUI/custom_nodes/h3-spark/install.py -> ComfyUI/models) unless MODELS_DIR is given:
the `h3-spark comfyui-demo` command for a ComfyUI whose Python has no `h3-spark` command (neither installer
gives one; `python -m pip install -e ComfyUI/custom_nodes/h3-spark` does).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Where it was run from, links kept: custom_nodes/h3-spark may be the overlay installer's link to a checkout.
PLACED = Path(__file__).absolute().parent


def say(message: str) -> None:
    print(f"h3-spark: {message}", flush=True)


def fail(message: str) -> int:
    print(f"h3-spark: error: {message}", file=sys.stderr, flush=True)
    return 1


def installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def requirements() -> Path:
    path = HERE / "requirements.txt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: this file must stay in the h3-spark folder")
    return path


def comfyui_models() -> Path | None:
    """ComfyUI's models folder when this pack sits in ComfyUI/custom_nodes/, else None."""
    comfy = PLACED.parent.parent
    if PLACED.parent.name == "custom_nodes" and (comfy / "comfyui_version.py").is_file():
        return comfy / "models"
    return None


def write_demo(models_dir: Path | None) -> int:
    models_dir = models_dir or comfyui_models()
    if models_dir is None:
        return fail(f"{PLACED} is not inside ComfyUI/custom_nodes/: give ComfyUI's models folder "
                    "(install.py --demo /path/to/ComfyUI/models)")
    # The pack's own package folder (h3_spark/ beside this file), without installing it.
    spec = importlib.util.spec_from_file_location("h3_spark", HERE / "h3_spark" / "__init__.py",
                                                  submodule_search_locations=[str(HERE / "h3_spark")])
    package = importlib.util.module_from_spec(spec)
    sys.modules["h3_spark"] = package
    spec.loader.exec_module(package)
    from h3_spark.errors import H3Error  # noqa: E402 - the package loaded just above

    try:
        demo = importlib.import_module("h3_spark.h3_model.engine.demo")
        written = demo.install_comfyui_demo(models_dir, 0, say)
    except H3Error as exc:
        return fail(str(exc))
    except ImportError as exc:
        return fail(f"{exc}: install the runtime dependencies first (python install.py)")
    say(f"demo models written under {models_dir} ({len(written)} folders); in ComfyUI open the template "
        "\"H3 Demo, Text to Video (no download)\" (workflows/): the video is noise, the graph is the real one")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="check and print the pip command, change nothing")
    p.add_argument("--demo", nargs="?", const="", metavar="MODELS_DIR", default=None,
                   help="write the tiny demo models into ComfyUI's models folder (default: the one this pack is in)")
    args = p.parse_args(argv)
    if args.demo is not None:
        return write_demo(Path(args.demo) if args.demo else None)
    if sys.version_info < (3, 10):
        return fail(f"this Python is {sys.version.split()[0]}; h3-spark needs Python >= 3.10")
    say(f"Python {sys.version.split()[0]} ({sys.executable})")
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - a broken torch install fails here too
        return fail(f"torch does not import in {sys.executable} ({exc}); install ComfyUI's requirements (with the "
                    "torch build for your GPU) first: h3-spark never installs torch")
    say(f"torch {torch.__version__}")
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        say(f"GPU {torch.cuda.get_device_name(0)}, sm_{major}{minor}")
        if major < 8:
            return fail(f"sm_{major}{minor} has no bf16 tensor cores; H3 runs in bf16 and needs sm_80 or newer")
    else:
        say("no CUDA GPU visible to torch: the nodes will run on the CPU (tiny models only)")
    transformers = installed("transformers")
    if transformers and int(transformers.split(".")[0]) < 5:
        say(f"warning: transformers {transformers} will be upgraded to >= 5 (the Qwen3-VL text encoder needs it); "
            "it is shared with ComfyUI and other custom nodes, and a node pack pinned to transformers 4 may stop "
            "working")
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(f"torch=={installed('torch') or torch.__version__.split('+')[0]}\n")
        command = [sys.executable, "-m", "pip", "install", "--upgrade-strategy", "only-if-needed",
                   "--constraint", str(constraints), "-r", str(requirements())]
        if args.dry_run:
            say("[dry-run] " + " ".join(command) + f"  (constraint: {constraints.read_text().strip()})")
            return 0
        say("+ " + " ".join(command))
        done = subprocess.run(command)
    if done.returncode:
        return fail(f"pip failed (exit {done.returncode}); nothing else was changed")
    say("done; restart ComfyUI. Recommended launch flags and engine defaults: config/h3_spark_serving.env")
    return 0


if __name__ == "__main__":
    sys.exit(main())
