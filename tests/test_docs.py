"""The docs' links resolve: every figure in the docs names its record file, so a record that was never
kept (or was renamed) must fail here rather than leave a dead link behind (issue 62)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "results").glob("*.md"))]

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
