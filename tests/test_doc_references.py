"""No dangling doc references: every `README "Section"` named in the code, the packaging or the docs, and every
`*Section* below/above` inside the README, is a heading (or a bold paragraph lead) of the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SECTIONS = [m.strip() for m in re.findall(r"^#+ (.+)$", README, re.MULTILINE)]
SECTIONS += re.findall(r"^\*\*([^*]+?)\.?\*\*", README, re.MULTILINE)  # "**CPU device.** ..." paragraphs


def _files() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "pyproject.toml"]
    for folder, pattern in (("hf_zenflow", "**/*.py"), ("scripts", "*"), ("tests", "**/*.py")):
        found += [p for p in (ROOT / folder).glob(pattern) if p.is_file() and p.suffix in (".py", ".ipynb", ".sh")]
    return [p for p in found if p.is_file() and p.name != Path(__file__).name]


def _names_a_section(name: str) -> bool:
    return any(section.startswith(name) for section in SECTIONS)


REFERENCES = [(path.relative_to(ROOT), name) for path in _files()
              for name in re.findall(r"""README(?:\.md)?,? ["']([^"'\n]+)["']""", path.read_text(errors="replace"))]


@pytest.mark.parametrize(("path", "name"), REFERENCES, ids=[f"{p}:{n}" for p, n in REFERENCES])
def test_readme_sections_named_elsewhere_exist(path, name):
    assert _names_a_section(name), f'{path} names README "{name}", which has no such section: {SECTIONS}'


def test_cross_references_inside_the_readme_exist():
    names = re.findall(r"\*([A-Z][^*\n]*)\* (?:below|above)", " ".join(README.split()))
    assert names  # the README does cross-reference itself
    for name in names:
        assert _names_a_section(name), f"README refers to *{name}*, which is not a section"


def test_the_packaging_reference_is_found():
    assert any(path == Path("pyproject.toml") for path, _ in REFERENCES)


#: Where a path of the package or the tests is named for a reader (BENCHMARKS.md is left out: its raw outputs quote
#: the paths of their day).
PATH_DOCS = [ROOT / "README.md", ROOT / "pyproject.toml", ROOT / ".ci" / "run",
             *(p for p in (ROOT / "scripts").iterdir() if p.is_file()),
             *(p for p in (ROOT / "model_cards").rglob("*") if p.is_file())]
PATHS = sorted({(doc.relative_to(ROOT), found) for doc in PATH_DOCS
                for found in re.findall(r"(?<![\w/.-])((?:hf_zenflow|tests)/[\w/.-]*\w)", doc.read_text())})


@pytest.mark.parametrize(("doc", "path"), PATHS, ids=[f"{d}:{p}" for d, p in PATHS])
def test_paths_named_in_the_docs_exist(doc, path):
    # (a glob such as "hf_zenflow/metrics/*/*.py" names files that exist when one file matches it)
    assert (ROOT / path).exists() or any(ROOT.glob(path)), f"{doc} names {path}, which does not exist"


def test_the_package_paths_are_found():
    assert any(path.startswith("hf_zenflow/engine") for _, path in PATHS)
