"""Sphinx configuration of zjax's documentation (MyST Markdown pages, API reference from docstrings)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# importing zjax for autodoc must not look for accelerators or start a backend
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import zjax  # noqa: E402

project = "zjax"
author = "the zjax authors"
copyright = "2026, the zjax authors"
release = zjax.__version__
version = ".".join(release.split(".")[:2])

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md", "figures/*", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True

html_theme = "furo"
html_title = f"zjax {release}"
# offline: no external fonts, no remote assets
html_static_path: list[str] = []
nitpicky = False


def _describe_constant(app, what, name, obj, options, lines):
    """A registry or constant re-exported by a package has no docstring of its own: list what it holds."""
    doc = getattr(type(obj), "__doc__", None)
    type_doc = " ".join(doc.split()) if isinstance(doc, str) else ""
    if what != "data" or (lines and " ".join(" ".join(lines).split()) != type_doc):
        return
    lines.clear()
    if isinstance(obj, dict) or hasattr(obj, "keys"):
        keys = ", ".join(f"``{k!s}``" for k in obj)
        lines.append(f"A registry keyed by name: {keys}.")
    elif isinstance(obj, (tuple, list, frozenset, set)):
        items = ", ".join(f"``{v!r}``" for v in obj)
        lines.append(f"``{type(obj).__name__}`` of {len(obj)}: {items}.")
    else:
        lines.append(f"``{obj!r}``")


def setup(app):
    app.connect("autodoc-process-docstring", _describe_constant)
