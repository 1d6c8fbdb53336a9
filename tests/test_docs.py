"""The documentation: the MkDocs site builds strictly (every page in the nav, every internal link
and anchor resolves), and README.md stays a short front door whose relative links all exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def test_mkdocs_builds_strictly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        print(proc.stdout)
        print(proc.stderr)
    assert proc.returncode == 0, proc.stderr


def relative_links(markdown: str) -> list[str]:
    """Targets of the markdown links and images outside fenced code that are not URLs or anchors."""
    text = _FENCE.sub("", markdown)
    targets = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http:, https:, mailto:, ... or a heading of the same file
        targets.append(target)
    return targets


def test_readme_is_short_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = readme.count("\n") + (0 if readme.endswith("\n") else 1)
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"
    links = relative_links(readme)
    assert links, "README.md links to no docs page"
    missing = [t for t in links if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_relative_links_parser():
    text = ("[a](docs/x.md#y) ![b](docs/i.png) [c](https://e.org) [d](#top) [e](mailto:a@b)\n"
            "```bash\n[f](in/code.md)\n```\n")
    assert relative_links(text) == ["docs/x.md#y", "docs/i.png"]
