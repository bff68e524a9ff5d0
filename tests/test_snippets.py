"""Every runnable snippet of README.md and docs/ runs as written, the blocks of a page in order in one namespace, as
a script would (tests/snippets.py says which; those that need a Ray cluster or GPUs are marked and left out).  They
run in this test process on the shared local Ray, so that the fits of one shape reuse their workers."""

from __future__ import annotations

import os

import pytest
import torch
from snippets import PAGES, runnable

FASHION = "/usr/share/datasets/fashion-mnist"


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=lambda p: p.name)
def test_snippets_run(ray_session, page, tmp_path, monkeypatch):
    code = "\n".join(c for _, c in runnable(page))
    if FASHION in code and not os.path.isdir(FASHION):
        pytest.fail(f"{page.name} trains on Fashion-MNIST: apt-get install dataset-fashion-mnist")
    monkeypatch.chdir(tmp_path)  # checkpoints and runs/ land here
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    namespace = {"__name__": "__main__"}  # classes defined in a snippet travel to the workers by value
    try:
        for line, snippet in runnable(page):
            exec(compile(snippet, f"{page.name}, the block at line {line}", "exec"), namespace)
    finally:
        torch.set_num_threads(threads)
