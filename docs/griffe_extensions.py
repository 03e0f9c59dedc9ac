"""Griffe extension of the API reference build (``mkdocs.yml``; not part of the package).

The docstrings of lightning-dp are Google style, whose example section is written ``Example:``
or ``Examples:`` (both are accepted by Napoleon and the Google style guide). Griffe's Google
parser knows only ``Examples:`` and would render ``Example:`` as an admonition of plain
Markdown, where ``>>>`` lines become block quotes and ``rows[-1][1]`` a reference link. This
extension renames the section header before the docstring is parsed, so that doctests render
as code.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_EXAMPLE_HEADER = re.compile(r"^(\s*)Example:[ \t]*$", flags=re.MULTILINE)


class ExampleSections(Extension):
    """Treat a Google-style ``Example:`` section like ``Examples:``."""

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE_HEADER.sub(r"\1Examples:", obj.docstring.value)
