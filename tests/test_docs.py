"""The documentation: generated references are current, the site builds offline with --strict, and the two
READMEs stay short, in step with each other, and point at files that exist."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300  # the hard limit; the aim is about 250


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen_docs():
    return _gen_docs()


# ---------------------------------------------------------------------------------------------------------
# Generated references


def test_committed_references_are_current(gen_docs):
    for rel, text in gen_docs.pages().items():
        path = ROOT / rel
        assert path.exists(), f"{rel} is missing; generate it with {gen_docs.REGENERATE}"
        assert path.read_text(encoding="utf-8") == text, (
            f"{rel} is stale (the config models or the CLI changed); regenerate it with {gen_docs.REGENERATE} "
            "and commit it"
        )


def _page_tables(page: str) -> dict[str, set[str]]:
    """Heading -> the field names in the first column of the table under it."""
    out: dict[str, set[str]] = {}
    heading = None
    for line in page.splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
            out[heading] = set()
        elif heading and line.startswith("| `"):
            out[heading].add(line.split("`")[1])
    return out


def test_config_reference_covers_every_field_of_every_layer(gen_docs):
    """Walked independently of the generator: each layer, each nested model, each field has its row."""
    from docgen import config_ref
    from pydantic import BaseModel

    from enlace.config import resolve

    tables = _page_tables(gen_docs.config_reference())
    missing = []

    def walk(path: str, model: type[BaseModel]) -> None:
        rows = next((v for k, v in tables.items() if k == path or k.startswith(f"{path} (")), None)
        if rows is None:
            missing.append(f"section {path}")
            return
        for name, info in model.model_fields.items():
            if name not in rows:
                missing.append(f"{path}.{name}")
            many = "list[" in str(info.annotation)
            for child in config_ref.nested_models(info.annotation):
                tag = config_ref.discriminators(child)
                child_path = f"{path}.{name}" + ("[]" if many else "")
                walk(f"{child_path} ({tag})" if tag else child_path, child)

    for layer, model in resolve.LAYERS.items():
        walk(layer, model)
    assert not missing, f"fields without a row in the configuration reference: {missing}"


def test_config_reference_reads_comments_from_the_source(tmp_path, monkeypatch, gen_docs):
    """Comments above a field, beside it, on a base class and opening a class body each land where they belong;
    a field without a comment is listed too."""
    pkg = tmp_path / "demo_cfg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "layers.py").write_text(
        textwrap.dedent(
            """
            from typing import Literal
            from pydantic import BaseModel, Field

            class Inner(BaseModel):
                # The whole section is about retries.
                tries: int = Field(default=3, ge=0)
                wait_s: float = 0.5  # seconds | between tries

            class _Base(BaseModel):
                # Every variant has these.
                name: str
                # Who wrote it.
                owner: str = "me"

            class Leaf(_Base):
                kind: Literal["leaf"]
                inner: Inner = Inner()
                plain: bool = True

            LAYERS = {"leaf": Leaf}
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    page = gen_docs.config_reference("demo_cfg")
    assert "## leaf" in page and "### leaf.inner" in page
    assert "_Base" not in page.split("## leaf", 1)[1].split("\n| field")[0]  # a base is not its own section
    assert "| `name` | `str` | **required** |  |" in page
    assert '| `owner` | `str` | `"me"` | Who wrote it. |' in page
    assert "Every variant has these." in page.split("## leaf", 1)[1].split("| field")[0]
    assert "| `plain` | `bool` | `true` |  |" in page
    assert "| `wait_s` | `float` | `0.5` | seconds \\| between tries |" in page
    inner = page.split("### leaf.inner", 1)[1]
    assert "The whole section is about retries." in inner.split("| field")[0]
    assert "| `tries` | `int` (&gt;= 0) | `3` |  |" in inner
    assert "| `inner` | [`Inner`](#leafinner) | (section below) |" in page


def test_config_reference_takes_a_whole_config_model_as_the_layers(tmp_path, monkeypatch, gen_docs):
    """Without a LAYERS table, a model made only of sections (a typed whole config) gives the top level."""
    pkg = tmp_path / "demo_whole"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        textwrap.dedent(
            """
            from pydantic import BaseModel

            class Train(BaseModel):
                steps: int  # how many

            class Sampling(BaseModel):
                top_p: float = 0.9

            class Config(BaseModel):
                train: Train
                sampling: Sampling | None = None
            """
        )
    )
    (tmp_path / "demo_layers").mkdir()
    (tmp_path / "demo_layers" / "__init__.py").write_text(
        textwrap.dedent(
            """
            from pydantic import BaseModel

            class Train(BaseModel):
                steps: int  # how many

            class Data(BaseModel):
                name: str

            class Sampling(BaseModel):
                top_p: float = 0.9

            LAYERS = {"data": Data, "train": Train}

            class Config(BaseModel):  # the layers plus bookkeeping that no config file sets
                train: Train
                data: Data
                sampling: Sampling = Sampling()
                files: dict[str, str] = {}
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    page = gen_docs.config_reference("demo_whole")
    assert [line for line in page.splitlines() if line.startswith("#")][1:] == ["## train", "## sampling"]
    assert "| `steps` | `int` | **required** | how many |" in page
    assert "Config" not in page.split("## train", 1)[1]
    page = gen_docs.config_reference("demo_layers")
    headings = [line for line in page.splitlines() if line.startswith("#")][1:]
    assert headings == ["## data", "## train", "## sampling"], headings
    assert "`files`" not in page


def test_cli_reference_lists_every_command_and_option(gen_docs):
    import argparse

    from enlace.cli import build_parser

    page = gen_docs.cli_reference()

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
        if path:
            section = page.split(f"\n## enlace{path}\n", 1)
            assert len(section) == 2, f"no section for enlace{path}"
            usage = section[1].split("```text\n", 1)[1].split("```", 1)[0]
            for action in parser._actions:
                for opt in action.option_strings:
                    assert opt in usage or opt in ("-h", "--help") or action.help == argparse.SUPPRESS, (
                        f"enlace{path}: {opt} missing"
                    )

    walk(build_parser(), "")


# ---------------------------------------------------------------------------------------------------------
# The site


def test_site_builds_offline_with_strict(tmp_path):
    assert importlib.util.find_spec("mkdocs") and importlib.util.find_spec("material"), (
        "mkdocs and mkdocs-material are not installed: `make test` installs them from requirements-dev.txt"
    )
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    pages = list(site.rglob("*.html"))
    assert (site / "reference" / "config.html").exists() and (site / "reference" / "cli.html").exists()
    # Offline: no page loads a script, stylesheet, font or image from another host (links to read are fine).
    remote = re.compile(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=\"(?:https?:)?//[^\"]*\"")
    bad = {p.name: remote.findall(p.read_text(encoding="utf-8")) for p in pages}
    assert not any(bad.values()), f"pages that load remote assets: { {k: v for k, v in bad.items() if v} }"


# ---------------------------------------------------------------------------------------------------------
# The READMEs

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"(!?)\[[^\]]*\]\(([^)\s]+)\)")


def _readme(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def _without_code(text: str) -> str:
    return FENCE.sub("", text)


def _headings(text: str) -> list[int]:
    return [len(m.group(1)) for m in re.finditer(r"^(#+) ", _without_code(text), re.M)]


def _code_blocks(text: str) -> list[list[str]]:
    """Code blocks without their comments (those are translated): the commands themselves must be equal."""
    blocks = []
    for body in FENCE.findall(text):
        lines = [re.sub(r"(^|\s+)#(?![{!]).*$", "", line).rstrip() for line in body.splitlines()]
        blocks.append([line for line in lines if line])
    return blocks


def _links(text: str) -> list[tuple[str, str]]:
    """(kind, target) of every link and image outside code, except the links between the two languages."""
    out = []
    for bang, target in LINK.findall(_without_code(text)):
        if target in ("README.md", "README.es.md"):
            continue
        out.append(("image" if bang else "link", target))
    return out


@pytest.mark.parametrize("name", ["README.md", "README.es.md"])
def test_readme_is_short(name):
    lines = len(_readme(name).splitlines())
    assert lines <= README_MAX_LINES, (
        f"{name} has {lines} lines; keep it under {README_MAX_LINES} (details go in docs/)"
    )


def test_readmes_are_in_step():
    en, es = _readme("README.md"), _readme("README.es.md")
    assert _headings(en) == _headings(es), "README.md and README.es.md have different section structures"
    en_code, es_code = _code_blocks(en), _code_blocks(es)
    assert len(en_code) == len(es_code), (
        f"code blocks: {len(en_code)} in README.md, {len(es_code)} in README.es.md"
    )
    for i, (a, b) in enumerate(zip(en_code, es_code, strict=True)):
        assert a == b, f"code block {i + 1} differs between README.md and README.es.md:\n{a}\n{b}"
    assert sorted(set(_links(en))) == sorted(set(_links(es))), "the READMEs link to different pages or images"


def _anchors(page: Path, gen_docs) -> set[str]:
    from docgen import markdown

    return {
        markdown.slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", _without_code(page.read_text()), re.M)
    }


@pytest.mark.parametrize("name", ["README.md", "README.es.md"])
def test_readme_links_resolve(name, gen_docs):
    broken = []
    for _, target in _links(_readme(name)):
        if re.match(r"^[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path
        if not file.exists():
            broken.append(target)
        elif anchor and anchor not in _anchors(file, gen_docs):
            broken.append(target)
    assert not broken, f"{name} links to missing files or anchors: {broken}"
