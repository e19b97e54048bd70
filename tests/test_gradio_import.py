"""gradio imported without its editor-only work (gemma4.ui.gradio_import), in fresh interpreters."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = """
from gemma4.env import Settings
from gemma4.ui import gradio_import
installed = gradio_import.install(Settings.from_env())
import gradio as gr
import gradio.component_meta as cm
with gr.Blocks() as demo:  # components still build and wire up
    box = gr.Textbox()
    box.submit(lambda s: s, box, box)
print(installed, cm.create_or_modify_pyi.__name__, gradio_import.pending(), gradio_import.install(Settings.from_env()),
      gr.events.EventListener.set_doc.__name__, "{{" in (gr.Textbox.submit.__doc__ or ""))
"""


def _probe(**env) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_stub_writer_is_skipped_and_the_hook_removes_itself():
    installed, writer, hook_left, again, doc, raw_doc = _probe(GEMMA4_GRADIO_STUBS="")
    assert (installed, writer, hook_left, again) == ("True", "_nothing", "False", "False")
    assert (doc, raw_doc) == ("_nothing", "True")  # listeners' docstrings left as templates


def test_gradio_stubs_on_keeps_gradios_own_behaviour():
    installed, writer, hook_left, _, doc, raw_doc = _probe(GEMMA4_GRADIO_STUBS="on")
    assert (installed, writer, hook_left, doc, raw_doc) == ("False", "create_or_modify_pyi", "False", "set_doc", "False")
