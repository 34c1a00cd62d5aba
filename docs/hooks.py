"""MkDocs hooks: publish benchmarks/RESULTS.md as a page of the site ("results.md"), and point
the pages' repository-relative links to it (``../benchmarks/RESULTS.md``, which works when
the Markdown is read in the repository) at that page."""

from __future__ import annotations

import os
from typing import Any

from mkdocs.structure.files import File, Files

_RESULTS = os.path.join("benchmarks", "RESULTS.md")
_LINK = "](../benchmarks/RESULTS.md"


def on_files(files: Files, config: Any) -> Files:
    root = os.path.dirname(config["config_file_path"])
    with open(os.path.join(root, _RESULTS), encoding="utf-8") as f:
        files.append(File.generated(config, "results.md", content=f.read()))
    return files


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    del kwargs
    if page.file.src_uri.count("/") == 0:  # pages directly under docs/
        return markdown.replace(_LINK, "](results.md")
    return markdown
