"""How `hf-zenflow compare` shows its progress, on a terminal and in a log file alike.

On a terminal: one tqdm bar over every step of every run, with its ETA. Written to a file or a pipe (stderr not a
terminal): no bar, whose redraws would fill the file with carriage returns, but `LineProgress`, one whole line at
every tenth of the steps; the Hugging Face libraries' own bars (saving a model) are turned off there too. While either
is shown, the package's log lines (the thread split announced when an optimizer starts its worker) and warnings are
written above the bar as lines of their own (`lines_above`), never glued to it.

Example:
    >>> import io
    >>> out = io.StringIO()
    >>> bar = LineProgress(total=4, stream=out)
    >>> bar.set_description("[1/1] ZenFlow"); bar.update(4); bar.close()
    >>> "\\r" in out.getvalue(), out.getvalue().splitlines()[-1].startswith("[compare] 4/4 steps (100 %)")
    (False, True)
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import warnings
from collections.abc import Iterator
from typing import IO, Any


#: A `LineProgress` line every this share of the steps.
LINE_EVERY = 0.1


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class LineProgress:
    """The progress bar's lines for a file or a pipe: at every tenth of `total` steps (and at the last), one line
    with the steps done, the elapsed time, the time left at the pace so far, the bar's description and postfix.
    It takes the calls `compare` makes of a tqdm bar."""

    def __init__(self, total: int, stream: IO[str] | None = None) -> None:
        self.total, self.n = total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.every = max(1, round(total * LINE_EVERY))
        self.start = time.perf_counter()
        self.description = self.postfix = ""

    def set_description(self, description: str, refresh: bool = False) -> None:
        self.description = description

    def set_postfix_str(self, postfix: str, refresh: bool = False) -> None:
        self.postfix = postfix

    def update(self, n: int = 1) -> None:
        before, self.n = self.n, self.n + n
        if self.n // self.every > before // self.every or (self.n >= self.total > before):
            elapsed = time.perf_counter() - self.start
            left = elapsed / self.n * max(0, self.total - self.n) if self.n else 0.0
            line = (f"[compare] {self.n}/{self.total} steps ({100 * self.n / max(1, self.total):.0f} %), "
                    f"{_duration(elapsed)} elapsed, about {_duration(left)} left")
            detail = ": ".join(part for part in (self.description, self.postfix) if part)
            print(line + (f"; {detail}" if detail else ""), file=self.stream, flush=True)

    def write(self, text: str, file: IO[str] | None = None) -> None:
        """A line of its own (as `tqdm.write`: stdout unless `file`)."""
        print(text, file=file if file is not None else sys.stdout, flush=True)

    def close(self) -> None:
        pass


def progress_bar(total: int, show: bool) -> Any:
    """A tqdm bar on a terminal (redrawn at most every 0.5 s), `LineProgress` for a file or a pipe; None unless
    `show`."""
    if not show:
        return None
    if not sys.stderr.isatty():
        quiet_library_bars()
        return LineProgress(total, sys.stderr)
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="step", file=sys.stderr, mininterval=0.5, **_bar_width())


def _bar_width() -> dict[str, Any]:
    """Follow the terminal's size when it has one. A pseudo-terminal without a size (`script`, some CI runners)
    reports 0 x 0, and tqdm then draws nothing at all: give it $COLUMNS (or 120) x 24 there."""
    import os
    import shutil

    try:
        size = os.get_terminal_size(sys.stderr.fileno())
        if size.columns > 0 and size.lines > 0:
            return {"dynamic_ncols": True}
    except (OSError, ValueError):  # not a terminal
        pass
    return {"ncols": shutil.get_terminal_size((120, 24)).columns, "nrows": 24}


def quiet_library_bars() -> None:
    """Turn off the progress bars of transformers and huggingface_hub (saving a model draws one)."""
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    with contextlib.suppress(ImportError):
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


class _AboveTheBar(logging.Handler):
    def __init__(self, bar: Any) -> None:
        super().__init__(logging.WARNING)
        self.bar = bar

    def emit(self, record: logging.LogRecord) -> None:
        self.bar.write(self.format(record), file=sys.stderr)


@contextlib.contextmanager
def lines_above(bar: Any) -> Iterator[None]:
    """While `bar` is shown, the ``hf_zenflow`` logger's lines and Python warnings go through ``bar.write`` (a line
    above the bar), unless logging was set up by the program (then its handlers decide)."""
    logger = logging.getLogger("hf_zenflow")
    if bar is None or logger.handlers or logging.getLogger().handlers:
        yield
        return
    handler = _AboveTheBar(bar)
    logger.addHandler(handler)
    shown = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        bar.write(warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"), file=sys.stderr)

    warnings.showwarning = show
    try:
        yield
    finally:
        logger.removeHandler(handler)
        warnings.showwarning = shown


__all__ = ["LINE_EVERY", "LineProgress", "lines_above", "progress_bar", "quiet_library_bars"]
