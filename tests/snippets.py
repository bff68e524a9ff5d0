"""The runnable snippets of README.md and docs/: every ```python block, except those whose first line says they need
a Ray cluster or GPUs (``# Needs a Ray cluster``, ``# Needs GPUs``).  Used by tests/test_docs.py (the parsing) and
tests/test_snippets.py (running them)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = ("# Needs a Ray cluster", "# Needs GPUs")
_BLOCK = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)


def blocks(page: Path) -> list[tuple[int, str, str]]:
    """``(line, language, code)`` of every fenced block of ``page``, in order."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1), m.group(2)) for m in _BLOCK.finditer(text)]


def runnable(page: Path) -> list[tuple[int, str]]:
    """``(line, code)`` of the page's Python blocks that run: all but those marked as needing a cluster or GPUs."""
    return [(line, code) for line, lang, code in blocks(page) if lang == "python" and not code.startswith(NOT_RUN)]
