"""Sphinx configuration for jattn's documentation site.

Build (offline, warnings as errors):
    pip install -e '.[docs]'
    sphinx-build -W --keep-going -b html docs docs/_build/html
"""

import inspect
import os
import re
import sys
from pathlib import Path

import sphinx.ext.autosummary as _autosummary
from sphinx.util.inspect import stringify_signature

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # document the checkout, not an installed copy

import jattn  # noqa: E402

project = "jattn"
author = "jattn contributors"
copyright = "jattn contributors, Apache-2.0"
release = jattn.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
# docs/README.md says how to build the site (for readers of the repository, not a page);
# docs/examples/ holds the example scripts' pictures, embedded from the pages.
exclude_patterns = ["_build", "README.md", "Thumbs.db", ".DS_Store"]

# MyST: ```{directive} fences, :::{note} blocks, heading anchors for #links. No math
# extension: MathJax would load from a CDN when a page is viewed, and the site works offline.
myst_enable_extensions = ["colon_fence", "deflist", "fieldlist"]
myst_heading_anchors = 3

# Docstrings are Google style ("Args:", "Returns:", "Raises:").
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True
napoleon_use_ivar = True  # NamedTuple fields are documented once, as members

autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False
autosummary_generate = False  # one hand-written page per module, no generated stubs
add_module_names = False
python_use_unqualified_type_names = True

# No intersphinx: the build must work offline (CI has no network), so references to jax,
# flax and numpy stay plain code rather than links.

html_theme = "sphinx_book_theme"
html_title = f"jattn {release}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "navbar_persistent": [],  # one search box (the sidebar's), not a second one in the header
}
html_last_updated_fmt = None
html_show_sourcelink = False

# matplotlib (jattn.viz, jattn.toy) draws off-screen when autodoc imports those modules.
os.environ.setdefault("MPLBACKEND", "Agg")


# Data (module constants) have no docstring of their own: autodoc would show the docstring
# of their type (int's, dict's, ndarray's). The pages describe them instead.
def _drop_type_docstrings(app, what, name, obj, options, lines):
    if what in ("data", "attribute") and lines:
        type_doc = inspect.getdoc(type(obj)) or ""
        first = next(line.strip() for line in lines if line.strip())
        if first and (first in type_doc or first in (getattr(obj, "__doc__", None) or "")):
            lines.clear()


# autosummary's one-line summary is the docstring's first sentence, split at ". "; it cuts
# through a literal such as ``i-left ... i+right`` (Sphinx checks the split on the whole
# paragraph, not on the piece it keeps). Split only outside ``literals``.
_LITERAL_OR_PERIOD = re.compile(r"``.*?``|\.(?=\s)", re.DOTALL)


def _extract_summary(doc, settings):
    summary = _sphinx_extract_summary(doc, settings)
    if summary.count("``") % 2 == 0:
        return summary
    stanza = []
    for line in doc:
        if not line.strip():
            if stanza:
                break
            continue
        stanza.append(line.strip())
    text = " ".join(stanza)
    for match in _LITERAL_OR_PERIOD.finditer(text):
        if match.group() == ".":
            return text[: match.end()]
    return text


_sphinx_extract_summary = _autosummary.extract_summary
_autosummary.extract_summary = _extract_summary


# Linen modules are dataclasses: their generated __init__ lists flax's own `parent` and
# `name` fields and shows defaults by repr (`<function variance_scaling.<locals>.init>`).
# Keep the signature to the module's own fields, with readable defaults.
_FLAX_FIELD = re.compile(r",\s*(parent|name): [^,=]*(=\s*(<[^>]*>|None))?(?=[,)])")
_ARGS_KWARGS = re.compile(r"\(\*args(: \w+)?, \*\*kwargs(: \w+)?\)")
_REPRS = [
    (re.compile(r"<function (\w+)\.<locals>\.\w+>"), r"\1(...)"),
    (re.compile(r"<function (\w+)[^>]*>"), r"\1"),
    (re.compile(r"<class '([\w.]+)'>"), r"\1"),
]


def _tidy_signature(app, what, name, obj, options, signature, return_annotation):
    if signature is None:
        return None
    if what == "class" and _ARGS_KWARGS.fullmatch(signature) and "__init__" in vars(obj):
        # NNX modules: the metaclass's __call__ hides the constructor's signature.
        init = inspect.signature(obj.__init__)
        params = list(init.parameters.values())[1:]  # without self
        signature = stringify_signature(
            init.replace(parameters=params),
            show_return_annotation=False,
            unqualified_typehints=True,
        )
    if what == "class" and "parent" in signature:
        signature = _FLAX_FIELD.sub("", signature)
    for pattern, repl in _REPRS:
        signature = pattern.sub(repl, signature)
    return signature, return_annotation


def setup(app):
    app.connect("autodoc-process-docstring", _drop_type_docstrings, priority=100)  # before napoleon
    app.connect("autodoc-process-signature", _tidy_signature)
