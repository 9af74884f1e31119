"""The repository's texts stand on their own: no docstring, comment or document points at a file that is
not in the repository (the team's reference notes live outside it and a reader of a checkout has none)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Reference notes that exist only outside the repository.
OUTSIDE = ("kernels.md", "h3-model-spec", "comfyui-integration.md", "ARCHITECTURE.md", "h3-next.md", "peers.md",
           "peers-h3.md", "shared/docs")
TEXT = (".py", ".md", ".sh", ".toml", ".env", ".json", ".txt", ".cfg")


def _tracked_texts() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / n for n in names.splitlines() if n.endswith(TEXT) and n != "tests/test_docs.py"]


def _outside_references(paths, root: Path = ROOT) -> list[str]:
    pattern = re.compile("|".join(re.escape(name) for name in OUTSIDE))
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_no_text_points_outside_the_repository():
    paths = _tracked_texts()
    assert len(paths) > 100  # the listing really read the checkout
    assert _outside_references(paths) == []


def test_the_check_sees_an_outside_reference(tmp_path):
    (tmp_path / "a.py").write_text('"""Layout (kernels.md §2.4)."""\n')
    (tmp_path / "b.md").write_text("All in docs/architecture.md.\n")
    found = _outside_references([tmp_path / "a.py", tmp_path / "b.md"], tmp_path)
    assert len(found) == 1 and "kernels.md" in found[0]
