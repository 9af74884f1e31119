"""scripts/install_comfyui_overlay.sh against a fake ComfyUI tree and a fake Python that prints versions.

The fake Python answers the script's probe with the versions the test sets in its environment and
logs `-m pip ...` calls instead of installing anything.
"""

import os
import sys
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install_comfyui_overlay.sh"

FAKE_PYTHON = """#!/usr/bin/env bash
if [ "${1:-}" = "-c" ]; then  # "does it import ComfyUI's requirements?"
    [ -z "${FAKE_NOT_COMFY:-}" ]
    exit $?
fi
if [ "${1:-}" = "-m" ] && [ "${2:-}" = "pip" ]; then
    line="$*"
    prev=""
    for a in "$@"; do
        if [ "$prev" = "--constraint" ]; then line="$line | $(tr '\n' ' ' < "$a")"; fi
        prev="$a"
    done
    echo "$line" >> "$FAKE_PIP_LOG"
    exit 0
fi
cat > /dev/null  # the probe script on stdin
echo "python=${FAKE_PYTHON_VERSION:-3.12.3}"
echo "transformers=${FAKE_TRANSFORMERS-}"
if [ -n "${FAKE_NO_TORCH:-}" ]; then
    echo "torch="
    echo "torch_error=No module named 'torch'"
    exit 0
fi
echo "torch=${FAKE_TORCH:-2.11.0+cu130}"
echo "torch_dist=${FAKE_TORCH_DIST-2.11.0}"
echo "gpu=${FAKE_GPU-NVIDIA H200}"
echo "sm=${FAKE_SM-9.0}"
"""


@pytest.fixture
def comfy(tmp_path):
    root = tmp_path / "ComfyUI"
    (root / "custom_nodes").mkdir(parents=True)
    (root / "comfy" / "ldm" / "minimax").mkdir(parents=True)
    (root / "comfy" / "ldm" / "minimax" / "model.py").write_text("# H3\n")
    (root / "comfyui_version.py").write_text('__version__ = "0.4.2"\n')
    (root / "venv" / "bin").mkdir(parents=True)
    py = root / "venv" / "bin" / "python"
    py.write_text(FAKE_PYTHON)
    py.chmod(0o755)
    return root


def run(comfy, *args, **env):
    # No activated environment and no python on PATH but the system's, unless a test gives them.
    base = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    base["PATH"] = "/usr/bin:/bin"
    full = {**base, "FAKE_PIP_LOG": str(comfy.parent / "pip.log"), **env}
    return subprocess.run(["bash", str(SCRIPT), *args, str(comfy)], capture_output=True, text=True, env=full)


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.is_symlink(), p.stat().st_mtime_ns if not p.is_symlink() else 0)
            for p in sorted(root.rglob("*"))}


def test_dry_run_prints_every_action_and_changes_nothing(comfy):
    before = snapshot(comfy)
    out = run(comfy, "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "ComfyUI 0.4.2" in out.stdout and "Python 3.12.3" in out.stdout and "sm_90" in out.stdout
    assert f"[dry-run] ln -s {ROOT} {comfy}/custom_nodes/h3-spark" in out.stdout
    assert "[dry-run] " + str(comfy / "venv/bin/python") + " -m pip install" in out.stdout
    assert "torch" not in out.stdout.split("pip install", 1)[1].split("\n")[0]  # never installs torch
    assert snapshot(comfy) == before and not (comfy.parent / "pip.log").exists()


def test_install_is_idempotent_and_uninstall_removes_only_ours(comfy):
    first = run(comfy)
    assert first.returncode == 0, first.stderr
    link = comfy / "custom_nodes" / "h3-spark"
    assert link.is_symlink() and link.resolve() == ROOT.resolve()
    assert (link / "h3_spark" / "nodes" / "definitions.py").is_file()
    again = run(comfy)
    assert again.returncode == 0 and "already linked" in again.stdout
    pip = (comfy.parent / "pip.log").read_text().splitlines()
    assert len(pip) == 2 and all(line.startswith("-m pip install") and "safetensors>=0.8" in line for line in pip)
    # torch is pinned to the build ComfyUI has (pip's version string, here without the "+cu130" torch shows)
    assert all(line.endswith("| torch==2.11.0 ") for line in pip), pip
    gone = run(comfy, "--uninstall")
    assert gone.returncode == 0 and not link.exists() and not link.is_symlink()
    assert ROOT.is_dir() and (ROOT / "h3_spark" / "nodes").is_dir()  # the link went, not the repository
    assert "nothing to remove" in run(comfy, "--uninstall").stdout


def _imports_outside(root: Path) -> list[str]:
    """Relative imports in the copied pack that name a module the copy lacks (e.g. one left in cli/)."""
    import ast

    missing = []
    for path in root.rglob("*.py"):
        package = path.parent.relative_to(root).parts
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                parts = [*base, *(node.module.split(".") if node.module else [])]
                target = root.joinpath(*parts)
                if not (target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()
                        or (not parts)):
                    missing.append(f"{path.relative_to(root)}: {'.' * node.level}{node.module or ''}")
    return missing


def test_copy_mode_and_its_marker(comfy):
    out = run(comfy, "--copy")
    assert out.returncode == 0, out.stderr
    target = comfy / "custom_nodes" / "h3-spark"
    assert not target.is_symlink() and (target / ".h3-spark-overlay").is_file()
    assert (target / "h3_spark" / "nodes" / "engine.py").is_file() and not (target / "tests").exists()
    assert _imports_outside(target) == []
    assert run(comfy, "--copy").returncode == 0  # made afresh
    assert run(comfy, "--uninstall").returncode == 0 and not target.exists()


def test_refuses_what_it_did_not_make(comfy):
    theirs = comfy / "custom_nodes" / "h3-spark"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("mine")
    for args in ((), ("--uninstall",)):
        out = run(comfy, *args)
        assert out.returncode != 0 and "not an h3-spark overlay" in out.stderr
    assert (theirs / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("env, change, message", [
    ({}, "no_version", "not a ComfyUI checkout"),
    ({"FAKE_PYTHON_VERSION": "3.9.18"}, None, "needs Python >= 3.10"),
    ({"FAKE_NO_TORCH": "1"}, None, "torch is not importable"),
    ({"FAKE_SM": "7.5", "FAKE_GPU": "Tesla T4"}, None, "sm_75 has no bf16"),
    ({}, "no_python", "cannot find ComfyUI's Python"),
])
def test_refusals_name_the_problem(comfy, env, change, message):
    if change == "no_version":
        (comfy / "comfyui_version.py").unlink()
    elif change == "no_python":
        shutil.rmtree(comfy / "venv")
    out = run(comfy, **env)
    assert out.returncode != 0 and message in out.stderr, out.stderr
    assert not (comfy / "custom_nodes" / "h3-spark").exists() and not (comfy.parent / "pip.log").exists()


def test_comfyui_without_native_h3_gets_a_warning_and_the_install(comfy):
    # The h3-spark nodes run on their own engine (ComfyUI 0.3.64 runs them); only mixing with the native
    # MiniMax H3 nodes needs comfy/ldm/minimax.
    shutil.rmtree(comfy / "comfy" / "ldm" / "minimax")
    out = run(comfy)
    assert out.returncode == 0, out.stderr
    assert "warning: ComfyUI 0.4.2 has no native MiniMax H3 support" in out.stdout
    assert (comfy / "custom_nodes" / "h3-spark").is_symlink()
    assert "transformers>=5" in (comfy.parent / "pip.log").read_text() and "accelerate" in (comfy.parent / "pip.log").read_text()


def test_a_major_transformers_upgrade_is_announced(comfy):
    out = run(comfy, "--dry-run", FAKE_TRANSFORMERS="4.57.1")
    assert out.returncode == 0, out.stderr
    assert "warning: transformers 4.57.1 will be upgraded to >= 5" in out.stdout
    for installed in ("5.1.0", ""):
        assert "will be upgraded" not in run(comfy, "--dry-run", FAKE_TRANSFORMERS=installed).stdout


def test_cpu_only_and_explicit_python(comfy, tmp_path):
    py = tmp_path / "elsewhere" / "python3"
    py.parent.mkdir()
    shutil.copy(comfy / "venv" / "bin" / "python", py)
    shutil.rmtree(comfy / "venv")
    out = run(comfy, "--dry-run", "--python", str(py), FAKE_SM="", FAKE_GPU="")
    assert out.returncode == 0, out.stderr
    assert "no CUDA GPU" in out.stdout and f"[dry-run] {py} -m pip install" in out.stdout


def test_script_is_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    subprocess.run(["shellcheck", str(SCRIPT), str(ROOT / "scripts" / "wheel_smoke.sh")], check=True)


def test_an_activated_environment_or_the_python_on_path_is_taken_when_it_runs_comfyui(comfy, tmp_path):
    shutil.rmtree(comfy / "venv")
    env_dir = tmp_path / "env"
    (env_dir / "bin").mkdir(parents=True)
    (env_dir / "bin" / "python").write_text(FAKE_PYTHON)
    (env_dir / "bin" / "python").chmod(0o755)
    out = run(comfy, "--dry-run", VIRTUAL_ENV=str(env_dir))
    assert out.returncode == 0, out.stderr
    assert f"using {env_dir}/bin/python (it imports ComfyUI's requirements)" in out.stdout
    on_path = tmp_path / "path"
    on_path.mkdir()
    (on_path / "python3").write_text(FAKE_PYTHON)
    (on_path / "python3").chmod(0o755)
    out = run(comfy, "--dry-run", PATH=f"{on_path}:/usr/bin:/bin")
    assert out.returncode == 0 and f"using {on_path}/python3" in out.stdout, out.stderr
    out = run(comfy, "--dry-run", PATH=f"{on_path}:/usr/bin:/bin", FAKE_NOT_COMFY="1")
    assert out.returncode != 0 and "a python on PATH that imports ComfyUI's requirements" in out.stderr


def test_requirements_txt_equals_the_runtime_dependencies():
    """ComfyUI-Manager and the Registry install requirements.txt; pip installs pyproject.toml's dependencies.
    They must agree, but for torch and torchvision, which ComfyUI brings."""
    import tomllib

    def names(lines):
        return {line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()}

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    required = names((ROOT / "requirements.txt").read_text().splitlines())
    assert required == names(project) - {"torch>=2.4", "torchvision"}
    assert not any(r.startswith(("torch", "torchvision")) for r in required)


# ------------------------------------------------------------------------------------------ install.py (no bash)
INSTALL_PY = ROOT / "install.py"


def _install_py(*args, prelude="pass"):
    code = (f"import sys, runpy; {prelude}; sys.argv = ['install.py', *{list(args)!r}]; "
            f"runpy.run_path({str(INSTALL_PY)!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_install_py_dry_run_prints_the_pip_command_holding_torch():
    import torch

    out = _install_py("--dry-run")
    assert out.returncode == 0, out.stderr
    assert f"torch {torch.__version__}" in out.stdout
    assert "-m pip install --upgrade-strategy only-if-needed --constraint" in out.stdout
    assert f"-r {ROOT / 'requirements.txt'}" in out.stdout
    assert f"(constraint: torch=={metadata_version('torch')})" in out.stdout


def test_install_py_refuses_without_torch_and_never_installs_it():
    out = _install_py("--dry-run", prelude="sys.modules['torch'] = None")
    assert out.returncode == 1
    assert "torch does not import" in out.stderr and "h3-spark never installs torch" in out.stderr
    assert "pip install" not in out.stdout


def test_install_py_writes_the_demo_into_the_comfyui_it_sits_in(tmp_path):
    """The demo command after either install path: install.py is in custom_nodes/h3-spark whether ComfyUI-Manager
    cloned it there or the overlay installer linked it, and ComfyUI's Python has no `h3-spark` command."""
    from h3_spark.h3_model.engine.demo import COMFY_FOLDERS

    comfy = tmp_path / "ComfyUI"
    (comfy / "custom_nodes").mkdir(parents=True)
    (comfy / "models").mkdir()
    (comfy / "comfyui_version.py").write_text('__version__ = "0.3.64"\n')
    (comfy / "custom_nodes" / "h3-spark").symlink_to(ROOT)  # as the overlay installer links it
    out = subprocess.run([sys.executable, "-s", str(comfy / "custom_nodes" / "h3-spark" / "install.py"), "--demo"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for folder, name in COMFY_FOLDERS.values():
        assert any((comfy / "models" / folder / name).glob("*.safetensors")), name
    assert f"demo models written under {comfy / 'models'}" in out.stdout and "H3 Demo, Text to Video (no download)" in out.stdout
    elsewhere = subprocess.run([sys.executable, str(INSTALL_PY), "--demo"], capture_output=True, text=True,
                               timeout=300)
    assert elsewhere.returncode == 1
    assert "is not inside ComfyUI/custom_nodes/: give ComfyUI's models folder" in elsewhere.stderr


def test_the_docs_give_demo_and_cli_commands_that_work_after_either_install():
    docs = (ROOT / "docs" / "comfyui.md").read_text()
    assert "custom_nodes/h3-spark/install.py --demo" in docs
    assert "-m pip install -e" in docs  # the `h3-spark` command itself, for those who want it
    assert "h3-spark comfyui-demo /path/to/ComfyUI/models" not in docs.split("pip install -e")[0]


def metadata_version(dist):
    from importlib.metadata import version

    return version(dist)


def test_registry_metadata_is_complete():
    """What the Comfy Registry shows: publisher, name, an icon that exists in the repository, a description."""
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    comfy, project = data["tool"]["comfy"], data["project"]
    assert comfy["PublisherId"] and comfy["DisplayName"]
    icon = comfy["Icon"]
    assert icon.startswith("https://raw.githubusercontent.com/") and icon.endswith("/main/docs/icon.png")
    assert (ROOT / "docs" / "icon.png").stat().st_size > 1000
    assert len(project["description"]) > 40 and project["license"] and project["urls"]["Repository"]
