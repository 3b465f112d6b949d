"""The documentation stays true to the code: the CLI reference is generated, links resolve, the README is short."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_is_short() -> None:
    assert (ROOT / "README.md").stat().st_size <= 16 * 1024


def test_cli_reference_is_current() -> None:
    """docs/cli.md is what docs/gen_cli.py writes from the commands' --help today."""
    script = ROOT / "docs" / "gen_cli.py"
    done = subprocess.run([sys.executable, str(script), "--check"], check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    """Every relative link points at a file of the repository (anchors within a page are not used)."""
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path = target.split("#", 1)[0]
        if not path or not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


def test_every_doc_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    unlinked = [p.name for p in DOCS if f"docs/{p.name}" not in readme]
    assert not unlinked
