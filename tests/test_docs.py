"""The docs' links resolve: every figure in the docs names its record file, so a record that was never
kept (or was renamed) must fail here rather than leave a dead link behind (issue 62); every link to a
section names a heading the target page has, so a section moved to another page (the benchmark log)
takes its links with it; and the README and the benchmark reference stay short enough for a newcomer
to read, with the README's first screen saying how to run the project (issue 63)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "benchmarks").glob("*.md")),
        *sorted((ROOT / "docs" / "results").glob("*.md"))]
README = ROOT / "README.md"
#: the README's budget, the share of it a first screen shows, and the benchmark reference's budget
README_MAX_LINES, README_FIRST_SCREEN, BENCHMARKS_MAX_LINES = 350, 60, 400

#: a Markdown link's target: ``[text](target)`` / ``![alt](target)``
_LINK = re.compile(r"\]\(([^)\s]+)\)")
#: a path into the docs written out: the whole of an inline code span (``docs/...``), or bare in the
#: text (``docs/``, ``results/`` or ``benchmarks/`` to a record or page; the doc's own folder is where a
#: bare one resolves). A path inside a command (a code span with spaces, a fenced block) is what the
#: command writes, not a link.
_CODE_PATH = re.compile(r"`((?:\.\./)*docs/[^`\s]+)`")
_BARE_PATH = re.compile(r"(?<![\w/.])((?:docs|results|benchmarks)/[\w./-]+\.(?:md|jsonl|json|png|csv|txt|gz))(?![\w.])")
_CODE = re.compile(r"```.*?```|`[^`]*`", re.S)
#: a pattern, not a path: ``docs/benchmarks/x.{jsonl,md}``, ``docs/<run>.json``, ``$OUT/...``
_PATTERN = set("{}*<>$")


def linked_paths(doc: Path) -> list[tuple[str, list[Path]]]:
    """Every local path ``doc`` links or names, with the places it may resolve to (a Markdown link
    resolves against the doc's folder; a named ``docs/...`` path against the repository root too)."""
    text = doc.read_text(encoding="utf-8")
    found: list[tuple[str, list[Path]]] = []
    for m in _LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue   # a URL or an anchor in the same page
        path = target.split("#", 1)[0]
        if path and not _PATTERN.intersection(path):
            found.append((target, [doc.parent / path]))
    prose = _LINK.sub("](", _CODE.sub(" ", text))   # links checked above; code is not prose
    named = [m.group(1) for m in _CODE_PATH.finditer(text)] + [m.group(1) for m in _BARE_PATH.finditer(prose)]
    for path in named:
        path = path.rstrip(".,;:)")
        if not _PATTERN.intersection(path):
            found.append((path, [ROOT / path, doc.parent / path]))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_docs_path_the_docs_link_exists(doc):
    missing = sorted({name for name, places in linked_paths(doc) if not any(p.exists() for p in places)})
    assert not missing, f"{doc.relative_to(ROOT)} links paths that do not exist: {missing}"


def test_the_check_finds_links_and_named_paths(tmp_path):
    doc = tmp_path / "X.md"
    doc.write_text("See [the table](results/a.md#top), ![plot](b.png), `docs/c.jsonl`, d/e.json, "
                   "[web](https://example.com), [here](#anchor), `docs/f.{jsonl,md}`, benchmarks/g.md and "
                   "`sgl-tts run --output docs/h.jsonl`.\n```bash\nsgl-tts quality --out docs/i.json\n```\n")
    names = [name for name, _ in linked_paths(doc)]
    assert names == ["results/a.md#top", "b.png", "docs/c.jsonl", "benchmarks/g.md"]


#: an ATX heading (``## Title``) outside fenced code; its closing ``#``s are not part of its text
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", re.M)
_FENCE = re.compile(r"^ {0,3}```.*?^ {0,3}```", re.M | re.S)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text (a link's text, no Markdown marks),
    lower-cased, every character but letters, digits, spaces, ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


@functools.cache
def anchors(doc: Path) -> frozenset[str]:
    """Every heading anchor of ``doc``, a repeated one numbered as GitHub numbers it (-1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for m in _HEADING.finditer(_FENCE.sub("", doc.read_text(encoding="utf-8"))):
        slug = github_slug(m.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(found)


def anchored_links(doc: Path) -> list[tuple[str, Path, str]]:
    """Every link from ``doc`` to a section of a Markdown page (``page.md#anchor``, or ``#anchor`` in
    ``doc`` itself): the link as written, the page and the anchor. Code is not a link."""
    found = []
    for m in _LINK.finditer(_CODE.sub(" ", doc.read_text(encoding="utf-8"))):
        target = m.group(1)
        if "#" not in target or re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue
        path, anchor = target.split("#", 1)
        if path.endswith(".md") or not path:
            found.append((target, (doc.parent / path) if path else doc, anchor))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_link_to_a_section_names_a_heading_of_its_page(doc):
    broken = sorted({target for target, page, anchor in anchored_links(doc)
                     if not page.exists() or anchor not in anchors(page)})
    assert not broken, f"{doc.relative_to(ROOT)} links sections that are not headings of their page: {broken}"


def test_the_section_check_reads_headings_as_github_does(tmp_path):
    page = tmp_path / "P.md"
    page.write_text("# Goodput: stock vs sgl-tts (H200, 2026-11-27)\n## Whole families (`--tts-x families`)\n"
                    "## n = 64, 1.5x\n## Notes\n## Notes\n```\n# not a heading\n```\n## [Linked](x.md) *title* ##\n")
    assert anchors(page) == {"goodput-stock-vs-sgl-tts-h200-2026-11-27", "whole-families---tts-x-families",
                             "n--64-15x", "notes", "notes-1", "linked-title"}
    doc = tmp_path / "D.md"
    doc.write_text("[a](P.md#notes-1) [b](P.md#notes-2) [c](#here) [d](https://x.org/a.md#y) `[e](P.md#f)`\n# Here\n")
    links = anchored_links(doc)
    assert [(t, a) for t, _, a in links] == [("P.md#notes-1", "notes-1"), ("P.md#notes-2", "notes-2"), ("#here", "here")]
    assert [a in anchors(p) for _, p, a in links] == [True, False, True]


#: a commit hash as prose names one: 7-40 lower-case hex digits, at least one a letter and one a digit,
#: a word of its own (a file name that carries a hash, ``frontend_cpu_c87dc22.md``, is a record's name)
_COMMIT = re.compile(r"(?<!\w)(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?!\w)")
_FILE_NAME = re.compile(r"[\w./{},*-]*\.(?:md|jsonl|json|png|csv|txt|gz|log|py|ipynb)\b")


def commit_hashes(text: str) -> list[str]:
    """The commit hashes ``text`` names in its prose, code and link texts (link targets and file names
    are paths, not hashes)."""
    return _COMMIT.findall(_FILE_NAME.sub(" ", _LINK.sub("](", text)))


def test_the_readme_is_a_first_screen_not_a_manual():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): reference material goes to docs/")
    first_screen = "\n".join(lines[:README_FIRST_SCREEN])
    for command in ("./dev.sh demo", "./dev.sh test"):
        assert command in first_screen, f"README.md's first {README_FIRST_SCREEN} lines do not show `{command}`"
    hashes = commit_hashes(text)
    assert not hashes, f"README.md names commits {hashes}: they belong with their runs in docs/"


def test_the_hash_check_tells_commits_from_record_names():
    assert commit_hashes("at 71b3440 (c87dc22), 680e4b3-3c88a0f and `git show 41d0f89^`") == [
        "71b3440", "c87dc22", "680e4b3", "3c88a0f", "41d0f89"]
    assert commit_hashes("[figures](docs/benchmarks/frontend_cpu_c87dc22.md), frontend_cpu_c87dc22.md, "
                         "`x_{7c33d93,ebfb046}.jsonl`, 2026-11-27, 1234567 tokens, decade, 0.5.15") == []


def test_the_benchmark_reference_stays_a_reference():
    lines = (ROOT / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= BENCHMARKS_MAX_LINES, (
        f"docs/BENCHMARKS.md has {len(lines)} lines (at most {BENCHMARKS_MAX_LINES}): dated runs go to "
        "docs/benchmarks/LOG.md")
