"""The docs hold together: every relative link and anchor in README.md, CONTRIBUTING.md and
docs/ resolves, every file in docs/bench/ is cited by a page, and the README stays short.

Guards against the drift of a growing README and a folder of benchmark files nobody cites.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 220

# [text](target) and <img src="target">, outside fenced code blocks.
LINK = re.compile(r"\]\(([^)\s]+)\)|<img[^>]*\ssrc=\"([^\"]+)\"")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def _links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [a or b for a, b in LINK.findall(text)]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_anchor(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for page in _pages():
        for link in _links(page):
            if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_file_in_docs_bench_is_cited_by_a_page() -> None:
    text = "\n".join(p.read_text() for p in _pages())
    uncited = [
        p.name for p in sorted((ROOT / "docs" / "bench").glob("*")) if f"bench/{p.name}" not in text
    ]
    assert not uncited, f"files in docs/bench/ no page cites: {uncited}"


def test_the_readme_is_short() -> None:
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail into docs/"


def test_anchor_follows_githubs_rule() -> None:
    assert _anchor("The live lab (`serve --lab`)") == "the-live-lab-serve---lab"
    assert _anchor("Concept → file") == "concept--file"
