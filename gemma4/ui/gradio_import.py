"""Import gradio without the work it does for editors: over half of its import time, on the
start-up's critical path.

Every time gradio is imported it does two things that only an editor or `help()` reads:
- each component class (81 of them) re-derives its `.pyi` type stub: it re-reads and parses its
  own source file (`ast`), renders a jinja2 template and rewrites the stub in site-packages when
  it differs (`gradio.component_meta.create_or_modify_pyi`);
- each event listener's docstring is compiled and rendered as a jinja2 template (216 of them,
  `gradio.events.EventListener.set_doc`).
Nothing reads either at run time. Measured on a 2-core Intel Xeon @ 2.80GHz (Ice Lake), gradio
6.31: under a profiler, 4.1 and 0.45 s of `import gradio`'s 7.8 s; unprofiled, `import gradio`
4.4 → 2.3 s. While the app starts, gradio's import competes for the interpreter with the engine's
load.

`install()` puts a one-shot import hook in front of those two modules: once each has run, its
chore is replaced by a function that does nothing (the stubs stay as installed; the listeners'
docstrings keep their `{{ component }}` placeholders). A gradio without those names is imported
as it is. `GEMMA4_GRADIO_STUBS=on` keeps gradio's own behaviour (read from the settings the app
starts with, `gemma4.env.Settings`, which `app.main` passes in).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

from gemma4.env import Settings


def _nothing(*_args, **_kwargs) -> None:
    """Stands in for an editor-only chore."""


def _skip_stub_writer(module: ModuleType) -> None:
    if callable(getattr(module, "create_or_modify_pyi", None)):
        module.create_or_modify_pyi = _nothing


def _skip_doc_rendering(module: ModuleType) -> None:
    listener = getattr(module, "EventListener", None)
    if listener is not None and callable(getattr(listener, "set_doc", None)):
        listener.set_doc = _nothing


# module → what to disarm in it once it has run
CHORES = {"gradio.component_meta": _skip_stub_writer, "gradio.events": _skip_doc_rendering}


class _DisarmAfterExec(importlib.abc.Loader):
    """Runs the real loader, then disarms the chore in the fresh module."""

    def __init__(self, loader: importlib.abc.Loader, disarm):
        self.loader, self.disarm = loader, disarm

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.disarm(module)


class _Hook(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.waiting: set[str] = set()

    def find_spec(self, name, path, target=None):
        if name not in self.waiting:
            return None
        self.waiting.discard(name)
        if not self.waiting:
            uninstall()  # one-shot: gone once both modules were found
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _DisarmAfterExec(spec.loader, CHORES[name])
        return spec


_hook = _Hook()


def wanted(settings: Settings) -> bool:
    """Whether to skip gradio's editor-only work (GEMMA4_GRADIO_STUBS off, the default)."""
    return not settings.get("GEMMA4_GRADIO_STUBS")


def install(settings: Settings) -> bool:
    """Put the hook in place before gradio is first imported. False (and nothing done) when gradio
    is already imported or `settings` has GEMMA4_GRADIO_STUBS=on."""
    if not wanted(settings) or any(name in sys.modules for name in CHORES) or pending():
        return False
    _hook.waiting = set(CHORES)
    sys.meta_path.insert(0, _hook)
    return True


def pending() -> bool:
    """Is the hook still waiting for gradio's import?"""
    return _hook in sys.meta_path


def uninstall() -> None:
    if _hook in sys.meta_path:
        sys.meta_path.remove(_hook)
