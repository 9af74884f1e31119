"""Packaging: the root imports without ComfyUI, the CLI is wired, CI runs the README's command."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
        "import h3_spark_folder.h3_spark.h3_model.dit.layout\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_package_never_imports_the_oracle():
    # The engine, kernels and CLI; measure/ holds the diffusers twin of `bench --vs diffusers` on purpose.
    package = ROOT / "h3_spark"
    for path in [p for p in package.glob("**/*.py") if p.relative_to(package).parts[0] != "measure"]:
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


# ------------------------------------------------------------------ the checkout root shadows nothing
def _importable_from_root(root: Path) -> set[str]:
    """Top-level names `import X` finds in `root` when it is on sys.path ahead of site-packages: modules and
    regular packages. A folder without __init__.py is only a namespace portion, which never wins over another
    distribution's module, so it cannot shadow one."""
    names = set()
    for entry in root.iterdir():
        if entry.is_file() and entry.suffix == ".py" and entry.stem != "__init__":
            names.add(entry.stem)
        elif entry.is_dir() and entry.name.isidentifier() and (entry / "__init__.py").is_file():
            names.add(entry.name)
    return names


def _shadowed(names: set[str]) -> dict[str, list[str]]:
    """Which of `names` are also top-level modules of an installed distribution other than h3-spark itself."""
    from importlib import metadata

    owners = metadata.packages_distributions()
    return {name: dists for name in sorted(names)
            if (dists := sorted(d for d in owners.get(name, []) if d.replace("_", "-").lower() != "h3-spark"))}


def test_the_checkout_root_shadows_no_installed_module():
    # transformers 5.25 installs Hugging Face's `kernels`: when the root was the package, its kernels/ folder
    # shadowed that one for every `python -m ...` started here (the tests, the fleet's Ray workers).
    names = _importable_from_root(ROOT)
    assert "h3_spark" in names and "kernels" not in names and "nodes" not in names
    assert _shadowed(names) == {}, "a root module hides an installed distribution's module"


def test_the_shadow_check_sees_a_root_module_that_hides_an_installed_one(tmp_path):
    # The check itself, on a root that holds a module named like one pytest ships (`_pytest`) and one of ours.
    (tmp_path / "_pytest").mkdir()
    (tmp_path / "_pytest" / "__init__.py").write_text("")
    (tmp_path / "notes").mkdir()  # a plain folder: a namespace portion, never a shadow
    (tmp_path / "h3_spark").mkdir()
    (tmp_path / "h3_spark" / "__init__.py").write_text("")
    names = _importable_from_root(tmp_path)
    assert names == {"_pytest", "h3_spark"}
    assert _shadowed(names) == {"_pytest": ["pytest"]}


def test_tests_import_the_installed_package_not_the_root():
    from importlib import metadata

    import h3_spark

    # The README's `pip install -e .` maps `h3_spark` to the h3_spark/ folder; the root's ComfyUI entry is
    # another module (ComfyUI's, under the folder's path) and never stands in for the package.
    assert metadata.version("h3-spark") == h3_spark.__version__
    assert Path(h3_spark.__file__).resolve().parent.name == "h3_spark"
    assert Path(h3_spark.__file__).resolve() != (ROOT / "__init__.py").resolve()


# ------------------------------------------------------------------ without Triton
WITHOUT_TRITON = """
import importlib, pkgutil, sys
sys.modules["triton"] = None  # `import triton` raises ImportError, as on an install without it
import h3_spark
failed = []
for module in pkgutil.walk_packages(h3_spark.__path__, "h3_spark."):
    if module.name.rpartition(".")[2] == "__main__":
        continue
    try:
        importlib.import_module(module.name)
    except Exception as exc:  # noqa: BLE001 - every failure is reported
        failed.append(f"{module.name}: {exc!r}")
assert not failed, "\\n".join(failed)
from h3_spark.cli import main
sys.exit(main(["generate", "--demo", "--out", sys.argv[1]]))
"""


def test_every_module_imports_and_the_demo_runs_without_triton(tmp_path):
    # Windows and macOS torch never bring Triton and the package does not require it: a missing kernel library is
    # the reference path, never an ImportError (qk_prep once imported a helper only Triton's branch defined).
    out = tmp_path / "demo.mp4"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", WITHOUT_TRITON, str(out)], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["out"] == str(out) and out.stat().st_size > 0 and summary["exact"] is True


def test_the_files_the_package_reads_ship_inside_it():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from h3_spark.measure.budget import BUDGET_FILE, quality_budget

    assert BUDGET_FILE.parent == ROOT / "h3_spark" / "measure"
    assert 0 < quality_budget()["final_velocity_rel_l2"] < 1
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert data["package-data"]["h3_spark.measure"] == ["quality_budget.json"]
    assert data["packages"]["find"]["include"] == ["h3_spark", "h3_spark.*"]
