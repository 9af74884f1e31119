"""Packaging: the root imports without ComfyUI, the CLI is wired, CI runs the README's command."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_root_imports_as_custom_node_folder_without_comfy():
    # ComfyUI imports the folder under its own name; it must not need torch, comfy or the installed package.
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('h3_spark_folder', r'{ROOT / '__init__.py'}', "
        f"submodule_search_locations=[r'{ROOT}'])\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['h3_spark_folder'] = m; spec.loader.exec_module(m)\n"
        "assert isinstance(m.NODE_CLASS_MAPPINGS, dict) and isinstance(m.NODE_DISPLAY_NAME_MAPPINGS, dict)\n"
        "assert 'comfy' not in sys.modules and 'torch' not in sys.modules\n"
        "import h3_spark_folder.h3_model.dit.layout\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_package_never_imports_the_oracle():
    for path in list(ROOT.glob("h3_model/**/*.py")) + list(ROOT.glob("kernels/**/*.py")) + list(ROOT.glob("cli/*.py")):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import)\s+(diffusers|comfy)\b", text, re.M), path


def test_cli_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "h3_spark.cli", "--help"], capture_output=True, text=True, check=True)
    assert "trace-dit" in out.stdout


def test_ci_runs_the_readme_command():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(pip install .*?)\n```", readme).group(1)
    assert block in (ROOT / ".ci" / "run").read_text()


def test_console_script_declared():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'h3-spark = "h3_spark.cli:main"' in text and "[tool.comfy]" in text
    assert importlib.util.find_spec("h3_spark.cli") is not None
