"""Sphinx configuration: the user guide and the API reference built from the docstrings."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "mpidist"
author = "the mpidist developers"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "none"
exclude_patterns = ["_build"]
html_theme = "alabaster"
