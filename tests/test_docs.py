"""The documentation: the site builds with Sphinx in nitpicky mode with warnings as errors (a broken reference in a
docstring or a page fails here), the options page lists every option of ``fit``, and the snippets are well-formed
(tests/test_snippets.py runs them)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest
from snippets import NOT_RUN, PAGES, ROOT, blocks, runnable

pytest.importorskip("sphinx", reason="the docs extra: pip install -e '.[docs]'")


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-E", "-q", "-b", "html", "docs", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    assert (tmp_path / "index.html").exists() and (tmp_path / "api" / "driver.html").exists()


def test_the_options_page_lists_every_option_of_fit():
    from raympi.driver.config import FitConfig

    page = (ROOT / "docs" / "options.md").read_text()
    listed = set(re.findall(r"^\| `(\w+)` \|", page, re.M))
    assert listed == set(FitConfig.model_fields), {
        "missing": sorted(set(FitConfig.model_fields) - listed),
        "not options": sorted(listed - set(FitConfig.model_fields)),
    }


def test_every_python_snippet_parses_and_is_run_or_marked():
    """A Python block either runs in tests/test_snippets.py or says on its first line why it does not."""
    count = 0
    for page in PAGES:
        for line, lang, code in blocks(page):
            if lang != "python":
                continue
            count += 1
            ast.parse(code, filename=f"{page.name}:{line}")
            marked = code.startswith(NOT_RUN)
            assert marked or (line, code) in runnable(page), f"{page.name}:{line}"
    assert count >= 15, count


def test_user_docs_hold_no_issue_numbers_or_run_logs():
    for page in PAGES:
        text = page.read_text()
        assert not re.search(r"(?<!mpich )\b[Ii]ssue \d+|#\d{2,}\b|\btoday\b|this session", text), page.name
