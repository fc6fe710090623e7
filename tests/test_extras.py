"""Optional dependencies (`hf_zenflow._extras`): a missing module of the ``compare`` extra stops `hf-zenflow compare`,
`hf-zenflow tune`, `hf_zenflow.tune` and the plots with a message naming the extra; `--help` needs none of them;
pyproject's extras agree with `EXTRAS`, and the README's install command still brings the compare extra.

A module is made missing by a ``None`` entry in `sys.modules`, which makes ``import`` raise `ModuleNotFoundError`
exactly as for an uninstalled package.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import tomllib

from hf_zenflow._extras import EXTRAS, MissingExtraError, missing_modules, require


REPO_ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
EXTRA_MESSAGE = "pip install 'hf_zenflow[compare]'"


def block(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def test_require_names_the_missing_modules_and_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    require("compare", "hf-zenflow compare")  # the test environment has the extra: no error
    block(monkeypatch, "matplotlib", "psutil")
    assert missing_modules(EXTRAS["compare"]) == ["matplotlib", "psutil"]
    with pytest.raises(MissingExtraError) as info:
        require("compare", "hf-zenflow compare")
    assert str(info.value) == f"hf-zenflow compare needs matplotlib, psutil: {EXTRA_MESSAGE}"
    assert isinstance(info.value, ImportError)  # callers that catch ImportError keep working
    require("compare", "reading the data", modules=["datasets"])  # only the modules asked for are checked


def test_require_rejects_an_unknown_extra() -> None:
    with pytest.raises(ValueError, match=r"extra='plots' is not an extra of hf_zenflow; allowed: compare"):
        require("plots", "plotting")


@pytest.mark.parametrize(("command", "module", "entry"), [("compare", "hf_zenflow.compare.runner", "run_compare"),
                                                       ("tune", "hf_zenflow.tuning.tune", "run_tune")])
def test_cli_without_the_extra_says_which_extra_to_install(command: str, module: str, entry: str,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    from hf_zenflow.cli import main

    def must_not_run(*args: object) -> None:
        raise AssertionError(f"{entry} started although the compare extra is missing")

    monkeypatch.setattr(importlib.import_module(module), entry, must_not_run)
    block(monkeypatch, "evaluate")
    assert main([command, "--steps", "1"]) == 2
    assert capsys.readouterr().err.strip() == f"hf-zenflow {command} needs evaluate: {EXTRA_MESSAGE}"


def test_tune_api_without_the_extra_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import hf_zenflow
    import hf_zenflow.tuning.tune as tune_module

    def must_not_run(*args: object) -> None:
        raise AssertionError("run_tune started although the compare extra is missing")

    monkeypatch.setattr(tune_module, "run_tune", must_not_run)
    block(monkeypatch, "psutil")
    with pytest.raises(MissingExtraError, match=re.escape(f"hf_zenflow.tune needs psutil: {EXTRA_MESSAGE}")):
        hf_zenflow.tune(budget_minutes=1)


def test_plots_without_matplotlib_name_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from hf_zenflow.compare.plots import plot_loss_curves, plot_time_breakdown
    from hf_zenflow.tuning.tune import plot_pareto

    block(monkeypatch, "matplotlib", "matplotlib.pyplot")
    needs = re.escape(f"plotting (hf_zenflow.compare.plots) needs matplotlib: {EXTRA_MESSAGE}")
    with pytest.raises(MissingExtraError, match=needs):
        plot_loss_curves({}, tmp_path / "plot.png", "title")
    with pytest.raises(MissingExtraError, match=needs):
        plot_time_breakdown({}, tmp_path / "plot.png", "title", skip=0)
    with pytest.raises(MissingExtraError, match=needs):
        plot_pareto({"trials": []}, tmp_path / "plot.png")
    assert not (tmp_path / "plot.png").exists()


@pytest.mark.parametrize("command", ["compare", "tune", "estimate"])
def test_help_needs_no_optional_module(command: str, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI and the compare modules it loads to build its parser import afresh with the extra missing."""
    for name in [m for m in sys.modules if m == "hf_zenflow.cli" or m.startswith("hf_zenflow.compare")]:
        monkeypatch.delitem(sys.modules, name)  # restored after the test
    block(monkeypatch, *EXTRAS["compare"])
    from hf_zenflow.cli import main

    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert f"usage: hf-zenflow {command}" in capsys.readouterr().out


def test_pyproject_extras_match_the_module_table() -> None:
    """`EXTRAS` names what `require` checks; pyproject.toml is what pip installs: the two must list the same
    packages, and none of them may be a core dependency (the point of the extra)."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    core = {re.split(r"[<>=!\[ ;]", d, maxsplit=1)[0].lower() for d in PYPROJECT["project"]["dependencies"]}
    for extra, modules in EXTRAS.items():
        assert sorted(re.split(r"[<>=!\[ ;]", d, maxsplit=1)[0] for d in extras[extra]) == sorted(modules)
        assert not core & set(modules)


def closure(extras: set[str]) -> set[str]:
    """The extras `extras` pull in through pyproject's ``hf_zenflow[...]`` self-references, themselves included."""
    table = PYPROJECT["project"]["optional-dependencies"]
    seen: set[str] = set()
    todo = list(extras)
    while todo:
        extra = todo.pop()
        if extra not in seen:
            seen.add(extra)
            for requirement in table[extra]:
                match = re.fullmatch(r"hf_zenflow\[(.*)\]", requirement)
                if match:
                    todo.extend(e.strip() for e in match.group(1).split(","))
    return seen


def test_readme_install_command_brings_the_compare_extra() -> None:
    """The README's install block sets up everything `hf-zenflow compare` and the tests import, and `.ci/run`
    installs the same extras."""
    readme = (REPO_ROOT / "README.md").read_text()
    match = re.search(r'pip install -e "\.\[([a-z,]+)\]"', readme)
    assert match, "README has no `pip install -e \".[...]\"` line"
    installed = closure(set(match.group(1).split(",")))
    assert {"compare", "demo", "test"} <= installed
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert f'pip install -q -e ".[{match.group(1)}]"' in ci  # .ci/run installs what the README says
