"""The fenced blocks of the README and of the docs pages, for the tests that run them.

A page is ``README.md`` or a ``docs/*.md`` file, named by its path from the repository root. A
block is (language, body, section): the section is the last ``## `` heading above it ("" before
any). ``python`` blocks run in one namespace per page (``tests/test_readme.py``); ``py`` blocks
need an optional framework and names the reader supplies, and run in the tests named in
``RUN_ELSEWHERE``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)

RUN_ELSEWHERE = {
    "README.md": ("## Trainers",),
    "docs/trainers.md": ("## Hugging Face Trainer", "## Lightning", "## accelerate", "## Traces", "## Metrics"),
}
"""Per page, the sections whose ```py blocks other tests run, each with the names it supplies
prepared: tests/test_integrations_readme.py (the trainers and metrics) and tests/test_otel.py
(traces)."""


def pages() -> list[str]:
    """The README, then every docs page, as paths from the repository root."""
    return ["README.md", *(p.relative_to(ROOT).as_posix() for p in sorted(DOCS.glob("*.md")))]


def text(page: str) -> str:
    return (ROOT / page).read_text()


def blocks(page: str) -> list[tuple[str, str, str]]:
    """(language, body, section heading) of every fenced block of ``page``, in order."""
    source = text(page)
    out = []
    for match in FENCE.finditer(source):
        headings = re.findall(r"^## .*$", source[: match.start()], flags=re.M)
        out.append((match.group(1), match.group(2), headings[-1] if headings else ""))
    return out


def python_blocks(page: str) -> list[str]:
    """The ```python blocks of ``page``: run as written, in order, in one namespace."""
    return [body for lang, body, _ in blocks(page) if lang == "python"]


def py_blocks(page: str, *, section: str | None = None, needle: str = "") -> list[str]:
    """The ```py blocks of ``page`` (of one ``## `` section, where given) that contain ``needle``."""
    return [
        body
        for lang, body, heading in blocks(page)
        if lang == "py" and (section is None or heading == section) and needle in body
    ]
