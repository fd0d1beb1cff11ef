"""What a node tells the user besides its outputs.

* Warnings: every WARNING logged by klein_core or by the pack while a node runs (prompt cut at 512
  tokens, guidance ignored by a distilled model, a size rounded to 16...) is collected and shown on
  the node (ComfyUI's progress text) and returned in the node's UI output under ``"warnings"``, so
  API clients find it in ``/history/<prompt_id>``. The server log keeps its line too.
* Errors: messages that reach API clients carry file names, never absolute server paths (the
  server log keeps the original exception as the cause). Running out of memory gets the node's name and
  the memory_mode hint, here for every node.

Use :func:`reported` on a node's ``execute``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

from klein_core.errors import KleinOutOfMemory

from . import host

logger = logging.getLogger(__name__)

UI_KEY = "warnings"
_PACK_LOGGER = __name__.rsplit(".", 1)[0]  # the nodes package, whatever the pack folder is named
_WATCHED = ("klein_core", _PACK_LOGGER)

# An absolute path (POSIX, ~/, or a Windows drive) starting at a word boundary; group 1 is its last
# part. "models/loras/x" (relative) and "width/height" are left alone.
_SEP = r"[\\/]"
_PART = r"[^\\/\s'\"<>|,;()\[\]]+"
_ABSOLUTE = re.compile(rf"(?<![\w.~:/\\-])(?:[A-Za-z]:|~)?(?:{_SEP}{_PART})*{_SEP}({_PART})")
# A quoted absolute path may hold spaces ('C:\Program Files\...'): the whole quoted text goes.
_QUOTED = re.compile(r"""(['"])((?:[A-Za-z]:|~)?[\\/][^'"\n]*[\\/])([^'"\\/\n]*)\1""")


def scrub_paths(text: str) -> str:
    """``text`` with every absolute path replaced by its last part (the file or folder name)."""
    text = _QUOTED.sub(lambda m: m.group(1) + m.group(3) + m.group(1), text)
    return _ABSOLUTE.sub(lambda m: m.group(1), text)


_local = threading.local()  # per thread: logger names whose warnings are not collected now


@contextlib.contextmanager
def ignoring(*logger_names: str) -> Iterator[None]:
    """Leave out warnings of these loggers (and their children) while the block runs in this thread:
    for messages the node has already reported in its own words."""
    before = getattr(_local, "ignored", ())
    _local.ignored = before + logger_names
    try:
        yield
    finally:
        _local.ignored = before


class _Collector(logging.Handler):
    """Keeps the WARNING records logged by this thread (ComfyUI runs nodes in one worker thread)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.thread = threading.get_ident()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno != logging.WARNING or record.thread != self.thread:
            return  # errors are raised, not collected; other threads' records are not this node's
        if any(record.name == n or record.name.startswith(n + ".") for n in getattr(_local, "ignored", ())):
            return
        try:
            text = scrub_paths(record.getMessage())
        except (TypeError, ValueError):  # a log call whose arguments do not fit its format
            return
        if text not in self.messages:
            self.messages.append(text)


@contextlib.contextmanager
def collecting() -> Iterator[list[str]]:
    """Collect the warnings logged in this thread by klein_core and the pack while the block runs."""
    handler = _Collector()
    loggers = [logging.getLogger(name) for name in _WATCHED]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield handler.messages
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


def _without_paths(exc: BaseException) -> BaseException | None:
    """The same exception with absolute paths removed from its message, or None if it has none or
    cannot be rebuilt (its type takes other arguments)."""
    message = str(exc)
    clean = scrub_paths(message)
    if clean == message or len(exc.args) != 1:
        return None
    try:
        return type(exc)(clean)
    except (TypeError, ValueError):  # an exception type that needs other arguments: keep the original
        return None


def _ui_dict(ui: Any) -> dict:
    if ui is None:
        return {}
    return dict(ui.as_dict() if hasattr(ui, "as_dict") else ui)


def _show_on_node(messages: list[str]) -> None:
    """The warnings as the node's text in the ComfyUI frontend (else still in ui["warnings"] and the log)."""
    host.show_node_text("\n".join(f"\u26a0 {m}" for m in messages))


OOM_HINT = "In Klein Model Loader, memory_mode blocks or minimum needs the least GPU memory."


def _display_name(cls: type) -> str:
    try:
        return cls.define_schema().display_name or cls.__name__
    except Exception:  # a schema that cannot be built here: the class name still says which node
        return cls.__name__


def reported(execute: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a V3 node's ``execute`` (under ``@classmethod``): warnings logged while it runs
    reach the user (node text and ``ui["warnings"]``); errors lose absolute paths."""

    @functools.wraps(execute)
    def run(cls: type, *args: Any, **kwargs: Any) -> Any:
        with collecting() as messages:
            try:
                out = execute(cls, *args, **kwargs)
            except KleinOutOfMemory as exc:  # the engine explained it; the node says which widget helps
                raise KleinOutOfMemory(f"{_display_name(cls)}: {scrub_paths(str(exc))} {OOM_HINT}") from exc
            except Exception as exc:
                clean = _without_paths(exc)
                if clean is None:
                    raise
                raise clean from exc
        if messages:
            ui = _ui_dict(getattr(out, "ui", None))
            ui[UI_KEY] = list(ui.get(UI_KEY, [])) + messages  # lists: ComfyUI concatenates ui values
            out.ui = ui
            _show_on_node(messages)
        return out

    return run
