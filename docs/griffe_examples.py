"""A griffe extension for the API pages: jaxkv's docstrings title their doctests "Example:"
(or "Example (...):"), which Google-style parsing would render as Markdown prose; retitle
them "Examples:" so that they are rendered as code."""

from __future__ import annotations

import re
from typing import Any

import griffe

_TITLE = re.compile(r"^(\s*)Example(?:\s*\([^)]*\))?:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        del kwargs
        if obj.docstring is not None:
            obj.docstring.value = _TITLE.sub(r"\1Examples:", obj.docstring.value)
