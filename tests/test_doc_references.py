"""Docs that cannot go stale silently.

Every name in backticks in README.md, BENCHMARKS.md, docs/ and the package's docstrings that looks like a reference
resolves: a dotted ``hf_zenflow.`` name imports, a ``Class.member`` of a package class exists, a private ``_name`` is
defined somewhere in the package, a repository path exists (a glob matches), a file named by its bare name exists in
the repository. Named sections (``docs/page.md "Section"``, ``*Section* below``) are headings. Docstrings carry no
issue numbers, dates or measurements of a particular machine (figures live in BENCHMARKS.md, which they may name), and
no document speaks of the workshop that builds the product (issues, sessions, helpers, lent machines).
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_zenflow"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MARKDOWN = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *DOCS]

#: Folders a path in the docs may start with (the repository's and the package's).
REPO_DIRS = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith((".venv", "__"))} | {".ci"}
PACKAGE_DIRS = {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__")}
FILE_SUFFIXES = (".py", ".md", ".c", ".sh", ".ipynb", ".toml", ".yml", ".pt")
#: Files that commands write (named in the docs as outputs, not as files of the repository).
OUTPUTS = {"results.md", "results.json", "tune.md", "tune.json", "recommended.py", "train_log.json",
           "all_results.json", "optimizer.pt", "step.json", "training_args.bin", "fsdp2.yaml", "zf_config.json",
           "notes.jsonl", "hamlet.txt", "config.json", "trainer_state.json", "scheduler.pt", "rng_state.pth",
           "optimizer.bin", "model.safetensors", "data.pkl", "my_box.json", "f.json", "pareto.png",
           "optimizer.zenflow.pt", "model_card.md", "zenflow_optimizer_rank0_of_2.pt",
           "zenflow_optimizer_rank1_of_2.pt"}
#: Top-level modules whose dotted names in the docs are checked by importing them.
CHECKED_LIBRARIES = {"hf_zenflow", "torch", "transformers", "accelerate", "trl"}
#: Paths .gitignore names (what the examples write): named in the docs as outputs.
IGNORED = [line.strip().rstrip("/") for line in (ROOT / ".gitignore").read_text().splitlines()
           if line.strip() and not line.startswith(("#", "!"))]


@dataclass(frozen=True)
class Reference:
    where: str  # file (and object, for a docstring)
    text: str


# ---------------------------------------------------------------------------------------------------------------------
# What the documents name
# ---------------------------------------------------------------------------------------------------------------------
def _without_fences(text: str) -> str:
    """Markdown outside fenced blocks (commands and raw outputs are checked elsewhere)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def _backticked(text: str) -> list[str]:
    return [m.group(2).strip() for m in re.finditer(r"(`+)([^`\n]+?)\1(?!`)", text)]


@functools.cache
def _docstrings() -> list[tuple[str, str]]:
    """(where, docstring) of every module, class and function of the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    name = getattr(node, "name", "module")
                    found.append((f"{path.relative_to(ROOT)}:{name}", doc))
    return found


def _comments() -> list[tuple[str, str]]:
    """(file, comment) of every ``#`` comment of the package's Python files and every C file."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        with tokenize.open(path) as f:
            found += [(str(path.relative_to(ROOT)), tok.string) for tok in tokenize.generate_tokens(f.readline)
                      if tok.type == tokenize.COMMENT]
    for path in sorted(PACKAGE.rglob("*.c")):
        text = path.read_text()
        # a C comment names files without backticks: quote each file name so that it is checked
        found.append((str(path.relative_to(ROOT)), re.sub(r"(?<![`\w])([\w]+\.(?:py|c|md))\b", r"`\1`", text)))
    return found


@functools.cache
def references() -> list[Reference]:
    refs = [Reference(str(p.relative_to(ROOT)), t)
            for p in MARKDOWN for t in _backticked(_without_fences(p.read_text()))]
    refs += [Reference(where, t) for where, doc in _docstrings() + _comments() for t in _backticked(doc)]
    return sorted(set(refs), key=lambda r: (r.where, r.text))


# ---------------------------------------------------------------------------------------------------------------------
# What the package defines
# ---------------------------------------------------------------------------------------------------------------------
@functools.cache
def defined_names() -> frozenset[str]:
    """Every name the package defines: modules, classes, functions, methods, assignments, attributes set on
    objects, parameters."""
    names = {p.stem for p in PACKAGE.rglob("*.py")} | {p.name for p in PACKAGE.rglob("*") if p.is_dir()}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return frozenset(names)


@functools.cache
def package_classes() -> dict[str, set[str]]:
    """Class name -> the members its body defines and the attributes its methods set on ``self``, with those of its
    bases defined in the package."""
    classes: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            bases.setdefault(node.name, set()).update(b.id for b in node.bases if isinstance(b, ast.Name))
            members = classes.setdefault(node.name, set())
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and item is not node:
                    members.add(item.name)
                elif isinstance(item, ast.Name) and isinstance(item.ctx, ast.Store):
                    members.add(item.id)
                elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store):
                    members.add(item.attr)

    def inherited(name: str, seen: frozenset[str]) -> set[str]:
        own = set(classes.get(name, ()))
        for base in bases.get(name, set()) - seen:
            own |= inherited(base, seen | {base})
        return own

    return {name: inherited(name, frozenset({name})) for name in classes}


def _resolve_dotted(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, attr in enumerate(parts[cut:]):
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
                continue
            # an attribute set in __init__ or a dataclass field: look in the class's source
            owner = getattr(obj, "__name__", None)
            return i == len(parts[cut:]) - 1 and owner in package_classes() and attr in package_classes()[owner]
        return True
    return False


# ---------------------------------------------------------------------------------------------------------------------
# Which references are broken
# ---------------------------------------------------------------------------------------------------------------------
IDENTIFIER = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def _bare_files() -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for p in ROOT.rglob("*"):
        if p.is_file() and not any(part.startswith((".venv", ".git", "site")) for part in p.relative_to(ROOT).parts):
            found.setdefault(p.name, []).append(p)
    return found


BARE_FILES = _bare_files()


def _path_problem(ref: Reference, token: str) -> str | None:
    token = token.rstrip("/").split("::")[0].split(":")[0] if "://" not in token else token
    first = token.split("/")[0]
    if any(token == ignored or token.startswith(ignored + "/") for ignored in IGNORED):
        return None
    if first in REPO_DIRS and "/" in token:
        if (ROOT / token).exists() or any(ROOT.glob(token)):
            return None
        return f"{ref.where} names `{token}`, which does not exist"
    if first in PACKAGE_DIRS and "/" in token:
        candidates = [PACKAGE / token]
        if ref.where.startswith("hf_zenflow/"):  # relative to the docstring's own folder
            candidates.append(ROOT / ref.where.split(":")[0] / ".." / token)
        if any(c.exists() for c in candidates) or any(PACKAGE.glob(token)):
            return None
        return f"{ref.where} names `{token}`, which is not a path of the package"
    if "/" not in token and token.endswith(FILE_SUFFIXES) and token not in OUTPUTS and token[0] not in "*.":
        if token in BARE_FILES or any(ROOT.rglob(token) if "*" in token else ()):
            return None
        return f"{ref.where} names the file `{token}`, which is not in the repository"
    return None


def problem(ref: Reference) -> str | None:
    token = ref.text
    if " " in token or "<" in token or "{" in token or "://" in token:
        return None  # a command, a template or a URL
    if "/" in token or token.endswith(FILE_SUFFIXES):
        return _path_problem(ref, token)
    name = token.removesuffix("()")
    if not IDENTIFIER.fullmatch(name):
        return None
    parts = name.split(".")
    if parts[0] in CHECKED_LIBRARIES and len(parts) > 1:
        return None if _resolve_dotted(name) else f"{ref.where} names `{token}`, which does not resolve"
    if len(parts) == 2 and parts[0] in package_classes() and parts[0] not in dir(builtins):
        cls, member = parts
        if member in package_classes()[cls] or _resolve_inherited(cls, member):
            return None
        return f"{ref.where} names `{token}`: {cls} has no member {member}"
    if len(parts) == 1 and name.startswith("_") and not name.startswith("__"):
        return None if name in defined_names() else f"{ref.where} names `{token}`, which the package does not define"
    return None


def _resolve_inherited(cls: str, member: str) -> bool:
    """A member a package class inherits from a library base (`ZenFlowTrainer.train`)."""
    for module in ("hf_zenflow", "hf_zenflow.hf", "hf_zenflow.optimizer", "hf_zenflow.settings"):
        obj = getattr(importlib.import_module(module), cls, None)
        if obj is not None:
            return hasattr(obj, member)
    return False


# ---------------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------------
def test_every_reference_in_the_docs_and_docstrings_resolves():
    problems = [p for p in map(problem, references()) if p]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(("text", "broken"), [
    ("`hf_zenflow.optimizer.zenflow.ZenFlowAdamW`", False),
    ("`hf_zenflow.compare.hardware.HOST_MEMORY_SOURCES`", True),
    ("`hf_zenflow.layout`", True), ("`ZenFlowAdamW.flush`", False), ("`SplitMatrix.select`", True),
    ("`_close_window`", True), ("`engine/gradients.py`", False), ("`tests/test_fsdp.py`", True),
    ("`tests/distributed/test_fsdp.py`", False), ("`_native.py`", True), ("`zenflow.md`", True),
    ("`BENCHMARKS.md`", False), ("`emulator*.py`", True), ("`test_*.py`", False),
    ("`examples/zenflow_quickstart_run.ipynb`", False),
    ("`results.md`", False), ("`torch.optim.AdamW`", False), ("`torch.optim.Adamw`", True),
])
def test_the_checker_finds_a_broken_reference(text, broken):
    (found,) = _backticked(text)
    assert (problem(Reference("docs/x.md", found)) is not None) == broken


def test_the_checker_reads_the_package_and_the_docs():
    texts = {r.text for r in references()}
    assert "hf_zenflow.engine.amp" in texts  # from a doc page
    assert sum(r.where.startswith("hf_zenflow/") for r in references()) > 500  # from docstrings


# ---- named sections ---------------------------------------------------------------------------------------------
def _sections(page: Path) -> list[str]:
    text = page.read_text()
    found = [m.strip().strip("`") for m in re.findall(r"^#+ (.+)$", _without_fences(text), re.MULTILINE)]
    return found + re.findall(r"^\*\*([^*]+?)\.?\*\*", text, re.MULTILINE)  # "**CPU device.** ..." paragraphs


def _code_and_docs() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "pyproject.toml", *DOCS]
    for folder in ("hf_zenflow", "scripts", "examples", "tests"):
        found += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".ipynb", ".sh")]
    return [p for p in found if p.name != Path(__file__).name]


#: ``docs/page.md "Section"``, ``README.md's *Section*``, ``BENCHMARKS.md, section "Section"``; not a past version's
#: section (``git show abc1234:BENCHMARKS.md``, "Section"), which git keeps.
SECTION_REFERENCE = re.compile(
    r"""((?:docs/[\w-]+|README|(?<!:)BENCHMARKS)\.md)`?(?:'s)?,? (?:section )?["'*]([^"'*\n]+)["'*]""")


def _as_read(path: Path) -> str:
    """A page's text with its lines joined (a section's name may wrap); code as it is."""
    text = path.read_text(errors="replace")
    return " ".join(text.split()) if path.suffix == ".md" else text


SECTION_REFERENCES = [(path.relative_to(ROOT), page, name) for path in _code_and_docs()
                      for page, name in SECTION_REFERENCE.findall(_as_read(path))]


@pytest.mark.parametrize(("path", "page", "name"), SECTION_REFERENCES,
                         ids=[f"{p}:{g}:{n}" for p, g, n in SECTION_REFERENCES])
def test_sections_named_elsewhere_exist(path, page, name):
    sections = _sections(ROOT / page)
    assert any(s.startswith(name) for s in sections), f'{path} names {page} "{name}": no such section in {sections}'


def test_section_references_are_found():
    assert any(str(path) == "pyproject.toml" for path, _, _ in SECTION_REFERENCES)
    assert any(page == "BENCHMARKS.md" for _, page, _ in SECTION_REFERENCES)
    found = SECTION_REFERENCE.findall('BENCHMARKS.md, section "Reliability"; abdbd43:BENCHMARKS.md, "1. Optimizer"')
    assert found == [("BENCHMARKS.md", "Reliability")]  # (a past version's sections are git's to keep)


def test_benchmarks_sections_are_named_not_numbered():
    """BENCHMARKS.md's sections have names, not numbers: a "BENCHMARKS.md §4b" would point nowhere. Numbers are for a
    past version (``git show abc1234:BENCHMARKS.md`` §4b)."""
    found = [f"{path.relative_to(ROOT)}: {m.group(0)!r}" for path in _code_and_docs()
             for m in re.finditer(r"(?<![:\w])BENCHMARKS(?:\.md)?`?,?\s+§", path.read_text(errors="replace"))]
    assert found == [], "name the section instead:\n" + "\n".join(found)


def test_references_below_and_above_name_a_section_of_the_same_page():
    """(Other pages are linked, which mkdocs --strict checks.)"""
    for page in [ROOT / "README.md", *DOCS]:
        for name in re.findall(r"\*([A-Z][^*\n]*)\* (?:below|above)", " ".join(page.read_text().split())):
            assert any(s.startswith(name) for s in _sections(page)), f"{page.name}: *{name}* is not a section of it"


# ---- what docstrings and documents may say ----------------------------------------------------------------------
ANECDOTE = re.compile(r"\bissues? #?\d+|\(#\d+\)|\b20\d\d-\d\d-\d\d\b"
                      r"|\b(?:this|the|a|on a) (?:loaded |busy |quiet )?\d+-core machine\b", re.IGNORECASE)


def test_docstrings_carry_no_issue_numbers_dates_or_machine_anecdotes():
    found = [f"{where}: {m.group(0)!r}" for where, doc in _docstrings()
             for m in ANECDOTE.finditer(" ".join(doc.split()))]
    assert found == [], "figures and history belong in BENCHMARKS.md:\n" + "\n".join(found)


def test_docstrings_and_comments_name_no_document_outside_the_repository():
    found = [f"{where}: {name}" for where, text in _docstrings() + _comments()
             for name in re.findall(r"(?<![\w/.-])([\w-]+\.md)\b", text)
             if name not in BARE_FILES and name not in OUTPUTS]
    assert found == [], "\n".join(found)


WORKSHOP = re.compile(r"\bissues? \d+|\bsessions?\b|\blent\b|\bhelpers? `|\bhelper [a-z]+\b(?= \()", re.IGNORECASE)


def _product_files() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *DOCS]
    for folder in ("hf_zenflow", "scripts", "examples"):
        found += [p for p in (ROOT / folder).rglob("*")
                  if p.is_file() and p.suffix in (".py", ".ipynb", ".sh", ".md", ".c")]
    return found


@pytest.mark.parametrize("path", _product_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_workshop_words_in_the_product(path):
    found = [m.group(0) for m in WORKSHOP.finditer(" ".join(path.read_text().split()))]
    assert found == [], f"{path.relative_to(ROOT)} speaks of the workshop: {found}"


def test_markdown_fences_are_paired():
    for page in MARKDOWN:
        fences = re.findall(r"^\s*```", page.read_text(), re.MULTILINE)
        assert len(fences) % 2 == 0, f"{page.relative_to(ROOT)}: {len(fences)} code fences, one is unclosed"
