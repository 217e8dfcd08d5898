"""Links into the documentation resolve: a markdown link to a page names a page that exists and, with an anchor, a
heading on it; a section cited by name (docs/bench.md, "Quantizer quality") is on the page cited, from the README,
the docs, the toolkit's and engine's sources, the scripts and the tests. Results move between docs/bench.md (the
current ones) and docs/history.md (what they replaced); a citation left behind would send a reader nowhere."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITING = ("README.md", "docs", "powerinfer_tools", "engine", "csrc", "scripts", "tests")
CITATION = re.compile(r"(?:docs/)?(\w[\w-]*)\.md,? \(?\"([^\"]+)\"")
LINK = re.compile(r"\]\(([^)\s]+\.md)?(?:#([^)\s]+))?\)")


def flat(text: str) -> str:
    """Text with each line break, and the comment marker or indent after it, as one space (citations wrap)."""
    return re.sub(r"\s*\n\s*(?:(?://|#|\*)\s*)?", " ", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped but hyphens and underscores, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", page.read_text(), re.M)}


def citing_files():
    for name in CITING:
        path = ROOT / name
        for f in [path] if path.is_file() else sorted(path.rglob("*")):
            if f.suffix in (".md", ".py", ".cpp", ".h", ".cu", ".sh", ".c", ".toml") and f.is_file():
                yield f


def test_markdown_links_reach_a_page_and_a_heading():
    broken = []
    for page in PAGES:
        for target, anchor in LINK.findall(page.read_text()):
            if target.startswith("http"):
                continue
            dest = (page.parent / target).resolve() if target else page
            if not dest.is_file():
                broken.append(f"{page.name}: {target}")
            elif anchor and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target}#{anchor}")
    assert not broken, broken


def test_sections_cited_by_name_are_on_the_page_cited():
    pages = {p.stem: flat(p.read_text()) for p in PAGES if p.parent.name == "docs"}
    broken, seen = [], 0
    for f in citing_files():
        for page, section in CITATION.findall(flat(f.read_text(errors="replace"))):
            if page not in pages:
                continue
            seen += 1
            if section not in pages[page]:
                broken.append(f"{f.relative_to(ROOT)}: {page}.md, {section!r}")
    assert seen > 20  # the pattern still finds the citations
    assert not broken, broken
