"""The ZenFlow settings as they appear outside `ZenFlowConfig`, derived from `dataclasses.fields(ZenFlowConfig)`.

One source: each `ZenFlowConfig` field's type, default and metadata (``help``, and ``choices`` for the fields that
take one of a few strings) give the ``--zenflow_<field>`` fields of `ZenFlowTrainingArguments`, the arguments of
`ZenFlowPlugin` and their ``HF_ZENFLOW_<FIELD>`` environment variables, the flags of `examples/train_accelerate.py`,
and the parameter lists in their docstrings. A field added to `ZenFlowConfig`, or a default changed there, shows up
everywhere; nothing here names a field.

Text (a command line, an environment variable) is read the same way on every path: `parse_text`. Choice strings are
case-insensitive everywhere (``STEP``, ``Auto``, ``HOST``); `ZenFlowConfig` itself lower-cases them.

Example:
    >>> from hf_zenflow.settings.flags import SETTINGS, parse_text
    >>> [s.name for s in SETTINGS][:3]
    ['topk_ratio', 'update_interval', 'select_strategy']
    >>> parse_text(SETTINGS[0], "0.25"), parse_text(SETTINGS[2], " Step ")
    (0.25, 'step')
"""

from __future__ import annotations

import argparse
import re
import textwrap
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from .config import ZenFlowConfig, removed_settings_text


#: Words read as True / False from a command line or an environment variable (a superset of transformers'
#: `string_to_bool`, which the Trainer's own flags use).
TRUE_WORDS = ("1", "true", "yes", "on", "y", "t")
FALSE_WORDS = ("0", "false", "no", "off", "n", "f")

_KIND_DOC = {"bool": "`bool`", "int": "`int`", "float": "`float`", "choice": "`str`"}


class LowercaseChoice(str):
    """A command-line choice, lower-cased before argparse compares it with ``choices`` (so ``STEP`` is accepted).

    Example:
        >>> LowercaseChoice(" Step ")
        'step'
    """

    def __new__(cls, value: object) -> LowercaseChoice:
        return super().__new__(cls, str(value).strip().lower())


@dataclass(frozen=True)
class Setting:
    """One `ZenFlowConfig` field as the outside sees it.

    `kind` says how text is read: ``"bool"``, ``"int"``, ``"float"``, ``"choice"`` (one of `choices`, any case) or
    ``"text"`` (a value `ZenFlowConfig` parses itself: an int or ``"auto"``, a float or ``"interval"``).
    `optional`: None is allowed (and is the default).
    """

    name: str
    kind: str
    optional: bool
    default: Any
    help: str
    choices: tuple[str, ...] | None
    doc_type: str
    annotation: Any  # the field's type in `ZenFlowConfig`


def _setting(f: Field, annotation: Any) -> Setting:
    members = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    optional = type(None) in members
    members = tuple(m for m in members if m is not type(None))
    choices = f.metadata.get("choices")
    if choices:
        if members != (str,):
            raise TypeError(f"ZenFlowConfig.{f.name}: 'choices' needs a str field, not {annotation}")
        kind = "choice"
    elif members == (bool,):
        kind = "bool"
    elif str in members:
        kind = "text"
    elif members in ((int,), (float,)):
        kind = members[0].__name__
    else:
        raise TypeError(f"ZenFlowConfig.{f.name}: type {annotation} has no command-line form here; add one")
    if "help" not in f.metadata:
        raise TypeError(f"ZenFlowConfig.{f.name} has no metadata['help']")
    doc_type = _KIND_DOC.get(kind) or " or ".join(f"`{m.__name__}`" for m in members)
    return Setting(name=f.name, kind=kind, optional=optional, default=f.default, help=f.metadata["help"],
                   choices=tuple(choices) if choices else None, doc_type=doc_type, annotation=annotation)


def _derive() -> tuple[Setting, ...]:
    hints = typing.get_type_hints(ZenFlowConfig)
    return tuple(_setting(f, hints[f.name]) for f in fields(ZenFlowConfig))


#: Every `ZenFlowConfig` field, in declaration order.
SETTINGS: tuple[Setting, ...] = _derive()
SETTINGS_BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def _allowed(setting: Setting) -> str:
    if setting.kind == "bool":
        return "true or false (also 1/0, yes/no, on/off)"
    if setting.kind == "int":
        return "an integer"
    if setting.kind == "float":
        return "a number"
    return "text"


def parse_text(setting: Setting, raw: str) -> Any:
    """Read `raw` (a command-line or environment value) as `setting`'s Python value; `ZenFlowConfig` validates it.

    Raises `ValueError("allowed is ...")` when the text cannot be read at all (callers add the variable's name).

    Example:
        >>> parse_text(SETTINGS_BY_NAME["overlap_step"], "Off"), parse_text(SETTINGS_BY_NAME["update_interval"], "8")
        (False, '8')
    """
    text = raw.strip()
    try:
        if setting.kind == "bool":
            if text.lower() in TRUE_WORDS:
                return True
            if text.lower() in FALSE_WORDS:
                return False
            raise ValueError
        if setting.kind == "int":
            return int(text)
        if setting.kind == "float":
            return float(text)
    except ValueError:
        raise ValueError(f"allowed is {_allowed(setting)}") from None
    if setting.kind == "choice":
        return text.lower()
    return text  # "text": an int or a keyword, ZenFlowConfig parses it


def rename_fields(message: str, name: Callable[[str], str]) -> str:
    """Rewrite ``ZenFlowConfig.<field>`` in an error message into the caller's own name for that field.

    Example:
        >>> rename_fields("ZenFlowConfig.topk_ratio=2 is invalid", lambda f: f"--zenflow_{f}")
        '--zenflow_topk_ratio=2 is invalid'
    """
    return re.sub(r"ZenFlowConfig\.(\w+)", lambda m: name(m.group(1)), message)


def invalid_flags_message(argv: Iterable[str], prefix: str = "zenflow_") -> str | None:
    """What is wrong with the ``--<prefix><setting>`` flags among `argv` (their values together, every other setting
    at its default), named by flag; None when they are valid or `argv` takes its settings from elsewhere (a JSON file
    of arguments, ``--<prefix>from_deepspeed``). For a script to answer a bad value before it imports torch; flags
    this reading cannot place (an unknown name, a missing value) are left to the script's own parser, but for one
    that names a removed setting (`REMOVED_SETTINGS`), which is named as such.

    Example:
        >>> invalid_flags_message(["--output_dir", "out", "--zenflow_topk_ratio", "2"])
        '--zenflow_topk_ratio=2.0 is invalid: allowed is a float in [0, 1] (0.1 is typical).'
        >>> invalid_flags_message(["--no_zenflow_overlap_step", "--zenflow_update_interval=8"]) is None
        True
    """
    words = list(argv)
    if any(w.endswith(".json") and not w.startswith("-") for w in words[:1]) or any(
            w.split("=", 1)[0] == f"--{prefix}from_deepspeed" for w in words):
        return None
    values: dict[str, Any] = {}
    for i, word in enumerate(words):
        flag, given, raw = word.partition("=")
        negated = flag.startswith(f"--no_{prefix}")
        name = flag[len(f"--no_{prefix}"):] if negated else flag[len(f"--{prefix}"):]
        setting = SETTINGS_BY_NAME.get(name) if flag.startswith(("--" + prefix, f"--no_{prefix}")) else None
        if setting is None:
            removed = removed_settings_text([name]) if flag.startswith(("--" + prefix, f"--no_{prefix}")) else None
            if removed:
                return f"{flag}: the {removed} in this version of hf_zenflow."
            continue
        if negated:
            values[name] = False
            continue
        if not given:
            following = words[i + 1] if i + 1 < len(words) else None
            if following is None or following.startswith("--"):
                if setting.kind == "bool":
                    values[name] = True
                continue  # (a missing value: the script's parser says so)
            raw = following
        try:
            values[name] = parse_text(setting, raw)
        except ValueError as err:
            return f"--{prefix}{name}={raw} is invalid: {err}."
    try:
        ZenFlowConfig(**values)
    except ValueError as err:
        return rename_fields(str(err), lambda field_name: f"--{prefix}{field_name}")
    return None


def render_help(setting: Setting, name: Callable[[str], str] = lambda n: f"`{n}`") -> str:
    """`setting`'s help with every backticked field name (``select_interval``) written as `name` renders it."""
    return re.sub(r"`(\w+)`", lambda m: name(m.group(1)) if m.group(1) in SETTINGS_BY_NAME else m.group(0),
                  setting.help)


# -- dataclass fields -----------------------------------------------------------------------------------------------
def cli_annotation(setting: Setting) -> Any:
    """The type `HfArgumentParser` turns into a working flag for `setting`.

    `HfArgumentParser` maps ``int | str`` to ``type=int`` (``--zenflow_update_interval auto`` would be rejected), so
    "text" settings are `str` (their default keeps its own type, e.g. the int 4); choices are `LowercaseChoice`.
    """
    base = {"bool": bool, "int": int, "float": float, "text": str, "choice": LowercaseChoice}[setting.kind]
    return base | None if setting.optional else base


def trainer_fields(prefix: str) -> list[tuple[str, Any, Field]]:
    """``(name, type, field)`` triples for `dataclasses.make_dataclass`: one command-line field per setting, named
    ``<prefix><setting>``, with the setting's true default, help (``%`` escaped for argparse) and choices."""
    specs = []
    for s in SETTINGS:
        metadata: dict[str, Any] = {"help": render_help(s, lambda n: f"--{prefix}{n}").replace("%", "%%")}
        if s.choices:
            metadata["choices"] = list(s.choices)
        specs.append((prefix + s.name, cli_annotation(s), field(default=s.default, metadata=metadata)))
    return specs


def optional_fields() -> list[tuple[str, Any, Field]]:
    """``(name, type, field)`` triples for `dataclasses.make_dataclass`: every setting under its own name, optional
    (None = not given), for `ZenFlowPlugin`."""
    return [(s.name, s.annotation | None, field(default=None, metadata={"help": s.help})) for s in SETTINGS]


def add_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """Add ``--<prefix><setting>`` for every setting to a plain argparse parser; each defaults to None (not given)
    and reads its text with `parse_text`."""
    for s in SETTINGS:
        def read(raw: str, s: Setting = s) -> Any:
            try:
                return parse_text(s, raw)
            except ValueError as err:
                raise argparse.ArgumentTypeError(f"{raw!r}: {err}") from None

        parser.add_argument(f"--{prefix}{s.name}", type=read, default=None, choices=s.choices,
                            help=render_help(s, lambda n: f"--{prefix}{n}").replace("%", "%%")
                            + f" (default: {format_default(s.default)})")


# -- docs -----------------------------------------------------------------------------------------------------------
def format_default(value: Any) -> str:
    """A default as the docs write it: strings quoted, everything else as Python prints it."""
    return f'"{value}"' if isinstance(value, str) else str(value)


def wrap(text: str, indent: int, hanging: int = 0, width: int = 119) -> str:
    """`text` on lines of at most `width` columns, indented by `indent` (continuation lines by `indent + hanging`)."""
    return textwrap.fill(" ".join(text.split()), width=width, initial_indent=" " * indent,
                         subsequent_indent=" " * (indent + hanging))


def hf_parameter_doc(name: str, doc_type: str, default: Any, help: str, indent: int = 4) -> str:
    """One parameter in transformers' docstring style::

        name (`type`, *optional*, defaults to `default`):
            help
    """
    head = " " * indent + f"{name} ({doc_type}, *optional*, defaults to `{format_default(default)}`):"
    return head + "\n" + wrap(help.replace("%%", "%"), indent + 4)


def field_default(f: Field) -> Any:
    return f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default
