"""`EngineRules`: the engine's finer rules, behind the few choices `ZenFlowConfig` offers.

A user sets a handful of settings (`ZenFlowConfig`); each choice among them stands for a set of rules the engine
follows, with the constants the project measured (docs/quality.md, docs/memory.md). The rules are not settings: no
flag, environment variable or Trainer field reaches them. Tests and studies that examine one rule on its own change it
on a config with `ZenFlowConfig.with_rules`, which validates the change like a setting and keeps it in the config's
`to_dict()`, so a checkpoint of such a run resumes under the same rules.

Example:
    >>> from hf_zenflow import ZenFlowConfig
    >>> ZenFlowConfig().rules.auto_max_interval
    16
    >>> ZenFlowConfig(update_interval="auto").with_rules(auto_max_interval=8).rules.auto_max_interval
    8
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any


#: The longest Zen-auto window (`update_interval="auto"`), in optimizer steps: the staleness bound of the host
#: columns when the gradient mass is slow to balance. DeepSpeed's ZenFlow bounds it the same way.
AUTO_MAX_INTERVAL = 16


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"EngineRules.{name}={value!r} is invalid: allowed is {allowed}.")


@dataclass(frozen=True)
class EngineRules:
    """The rules a `ZenFlowConfig` resolves to (`config.rules`).

    Each field's default is the rule the public choices stand for; `ZenFlowConfig.with_rules` changes one for a test
    or a study.
    """

    #: Zen-auto windows close after at most this many steps (`AUTO_MAX_INTERVAL`).
    auto_max_interval: int = AUTO_MAX_INTERVAL

    def __post_init__(self) -> None:
        if not _is_int(self.auto_max_interval) or self.auto_max_interval < 1:
            _fail("auto_max_interval", self.auto_max_interval, "an integer >= 1")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def resolve(cls, config: Any, changes: dict[str, Any]) -> EngineRules:
        """The rules `config`'s choices stand for (`config`: a `ZenFlowConfig`, whose module imports this one),
        with `changes` (a test's or a study's) applied. An unknown rule fails, naming the ones there are."""
        unknown = sorted(set(changes) - set(cls.names()))
        if unknown:
            raise ValueError(f"ZenFlowConfig.with_rules got unknown rule(s) {unknown}: allowed are "
                             f"{sorted(cls.names())}.")
        return replace(cls(), **changes)
