"""Install h3-spark's dependencies into the Python that runs ComfyUI, without bash.

    python install.py [--dry-run]

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
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="check and print the pip command, change nothing")
    args = p.parse_args(argv)
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
