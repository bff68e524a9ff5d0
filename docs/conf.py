"""Sphinx configuration of raympi's documentation (``sphinx-build -W --keep-going -n docs docs/_build/html``)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "raympi"
author = "raympi contributors"
copyright = "raympi contributors"

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
# Links to a page's sections (``options.md#checkpoints``) name the section's heading, as on GitHub.
myst_heading_anchors = 3
exclude_patterns = ["_build"]
html_theme = "furo"
nitpicky = True
# No intersphinx (only PyPI is reachable from where the docs are built): names of other libraries, which the
# signatures' types name, stay unlinked.  Only other libraries' names go here: a broken reference to raympi's own
# names is fixed in the docstring.
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|ray|numpy|np|mpi4py|pydantic|fsspec|transformers|torchvision|psutil)(\..*)?"),
    (r"py:.*", r"(types|typing|collections|contextlib|concurrent|threading|pathlib|os|enum|dataclasses)\..*"),
]

# Google-style sections (Args:, Returns:, Attributes:) as in the docstrings.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# ``Attributes:`` as fields of the class's text: autodoc documents each attribute (a target for :attr:) itself.
napoleon_use_ivar = True
autodoc_member_order = "bysource"


def _skip(app, what, name, obj, skip, options):
    """Leave out what is not raympi's to document: a NamedTuple's generated field aliases (its docstring's
    ``Attributes:`` documents the fields), pydantic's ``model_config``, and names a module re-exports from
    another library (``raympi.core.pytree`` hands on torch's ``TreeSpec``)."""
    doc = getattr(obj, "__doc__", None) or ""
    if doc.startswith("Alias for field number") or name == "model_config":
        return True
    module = getattr(obj, "__module__", None)
    if getattr(obj, "__name__", None) == name and isinstance(module, str) and not module.startswith("raympi"):
        return True
    return None


def _canonical(target: str) -> str | None:
    """Where the object that ``target`` names is defined (``raympi.comm.Communicator`` ->
    ``raympi.comm.communicator.Communicator``), by importing it; None when it cannot be found."""
    import importlib
    import inspect

    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        rest = parts[cut:]
        try:
            for name in rest[:-1]:
                obj = getattr(obj, name)
            last = getattr(obj, rest[-1])
        except AttributeError:
            return None
        if inspect.ismodule(last):  # raympi.optim is raympi.core.optim
            return last.__name__
        module = getattr(last, "__module__", None)
        qualname = getattr(last, "__qualname__", None)
        if module and qualname and isinstance(module, str):
            return f"{module}.{qualname}"
        owner_module, owner_qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if owner_module and owner_qual:  # an attribute of a class
            return f"{owner_module}.{owner_qual}.{rest[-1]}"
        return None
    return None


def _resolve(app, env, node, contnode):
    """Resolve a Python reference that the domain's exact lookup missed: a name re-exported by a package
    (``raympi.comm.Communicator``) goes to where it is defined, and a short name (``:class:`Communicator``` in
    another module's docstring) to the one documented object whose full name ends with it.  Two or more
    candidates, or none, leave the reference unresolved, so that nitpicky mode reports it."""
    from sphinx.util.nodes import make_refnode

    if node.get("refdomain") != "py":
        return None
    domain = env.get_domain("py")
    target = node["reftarget"].lstrip("~.")
    matches = []
    canonical = _canonical(target) if "." in target else None
    if canonical and canonical in domain.objects:
        matches = [(canonical, domain.objects[canonical])]
    if not matches:
        matches = [(name, obj) for name, obj in domain.objects.items() if name.endswith("." + target)]
        if len(matches) > 1:  # prefer the reference's own module, then its package
            module = node.get("py:module") or ""
            for scope in (module, module.rpartition(".")[0]):
                inside = [(n, o) for n, o in matches if scope and n.startswith(scope + ".")]
                if len(inside) == 1:
                    matches = inside
                    break
    if len(matches) != 1:
        return None
    name, obj = matches[0]
    return make_refnode(app.builder, node["refdoc"], obj.docname, obj.node_id, contnode, name)


def setup(app):
    app.connect("autodoc-skip-member", _skip)
    app.connect("missing-reference", _resolve)
