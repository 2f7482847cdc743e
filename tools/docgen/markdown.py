"""Markdown that both GitHub and MkDocs (Python-Markdown) render the same: anchors, table cells, code."""

from __future__ import annotations

import re


def slug(text: str) -> str:
    """The anchor both Python-Markdown's toc (MkDocs) and GitHub give a plain-text heading."""
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def cell(text: str) -> str:
    """Text for a table cell: no line breaks, and nothing Markdown would read as a tag, a column or emphasis."""
    text = " ".join(text.split())
    return text.replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|").replace("*", "\\*")


def code(text: str) -> str:
    """An inline code span for a table cell.

    A pipe inside backticks splits a Python-Markdown table cell, and an escaped one shows its backslash there
    (GitHub hides it), so a span with a pipe is written as HTML, which both render the same.
    """
    text = " ".join(str(text).split())
    if not text:
        return ""
    if "|" in text:
        escaped = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "&#124;")
        return f"<code>{escaped}</code>"
    fence = "``" if "`" in text else "`"
    return f"{fence}{text}{fence}"
