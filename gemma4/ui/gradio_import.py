"""Import gradio without rewriting its type-stub files: half of its import time, on the start-up's
critical path.

Every time gradio is imported, each component class (81 of them) re-derives its `.pyi` stub:
it re-reads and parses its own source file (`ast`), renders a jinja2 template and rewrites the
stub in site-packages when it differs. Those stubs exist for editors, not for running: nothing
reads them at run time. Measured on a 2-core Intel Xeon @ 2.80GHz (Ice Lake), gradio 6.31: it is
about half of `import gradio` (4.1 of 7.8 s under a profiler), and while the app starts it
competes for the interpreter with the engine's load.

`install()` puts a one-shot import hook in front of `gradio.component_meta`: once that module has
run, its `create_or_modify_pyi` is replaced by a function that does nothing. A gradio without that
function is imported as it is (the hook then changes nothing). `GEMMA4_GRADIO_STUBS=on` keeps
gradio's own behaviour.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType

TARGET = "gradio.component_meta"
STUB_WRITER = "create_or_modify_pyi"


def _leave_stubs_alone(*_args, **_kwargs) -> None:
    """Stands in for gradio's stub writer: the stubs are for editors, and stay as installed."""


class _PatchAfterExec(importlib.abc.Loader):
    """Runs the real loader, then swaps the stub writer out of the fresh module."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        if callable(getattr(module, STUB_WRITER, None)):
            setattr(module, STUB_WRITER, _leave_stubs_alone)


class _StubSkipper(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        uninstall()  # one-shot: whatever happens next, the hook is gone
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchAfterExec(spec.loader)
        return spec


_hook = _StubSkipper()


def wanted() -> bool:
    return os.environ.get("GEMMA4_GRADIO_STUBS", "").strip().lower() not in ("1", "on", "true", "yes")


def install() -> bool:
    """Put the hook in place before gradio is first imported. False (and nothing done) when gradio
    is already imported or GEMMA4_GRADIO_STUBS=on."""
    if not wanted() or TARGET in sys.modules or _hook in sys.meta_path:
        return False
    sys.meta_path.insert(0, _hook)
    return True


def pending() -> bool:
    """Is the hook still waiting for gradio's import?"""
    return _hook in sys.meta_path


def uninstall() -> None:
    if _hook in sys.meta_path:
        sys.meta_path.remove(_hook)
