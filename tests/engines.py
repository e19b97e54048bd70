"""The engines several test modules share, built once per test run.

tests/conftest.py closes every engine when a module ends (each compiled shape holds memory
mappings: gemma4/serve/engine/compiled.py's mapping limit) except the ones `shared` handed out:
loading and compiling them again in every module that uses them cost the suite minutes. A
module that uses one leaves it as it found it (idle, no patch left on it, overrides put back).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from gemma4.serve.engine.engine import Engine, get_engine
from gemma4.serve.shape_keys import ShapeKey

# The bundled Gemma 3 270M in float32 (weights and compute, native KV cache): batched rows equal
# solo ones bit for bit and greedy ids equal transformers' float32 ids. tests/test_engine.py,
# test_api.py, test_soak.py and test_vision_serve.py use it.
BUNDLED_F32 = dict(max_batch=8, context_limit=256, buckets=(16, 64),
                   overrides={"weights": "none", "dtype": "float32", "kv": "native"})

_shared: list[Engine] = []


def shared(model: str, **settings) -> Engine:
    """get_engine's engine for (model, settings), kept open across test modules."""
    eng = get_engine(model, **settings)
    if all(e is not eng for e in _shared):
        _shared.append(eng)
    return eng


def shared_engines() -> list[Engine]:
    """The engines `shared` handed out (conftest leaves them open between modules)."""
    return list(_shared)


@contextlib.contextmanager
def only_usable(engine: Engine, keys: set[ShapeKey]) -> Iterator[None]:
    """Within the block, `engine`'s compiled shapes outside `keys` look not compiled yet (as if still
    compiling): its scheduler plans around them and waits for them, and they come back after."""
    shapes = engine.shapes
    usable, usable_keys, get, wait_any = shapes.usable, shapes.usable_keys, shapes.get, shapes.wait_any
    shapes.usable = lambda key: key in keys and usable(key)
    shapes.usable_keys = lambda: [k for k in usable_keys() if k in keys]
    shapes.get = lambda key: get(key) if key in keys else None
    shapes.wait_any = lambda waited, timeout=None: wait_any([k for k in waited if k in keys], timeout)
    try:
        yield
    finally:
        for name in ("usable", "usable_keys", "get", "wait_any"):
            delattr(shapes, name)


def bundled_f32(timeout: float = 1200) -> Engine:
    """The shared float32 bundled engine, ready."""
    return shared("bundled", **BUNDLED_F32).wait_ready(timeout=timeout)


def started_with(monkeypatch, engine: Engine, env: dict[str, str]) -> None:
    """`engine` as if started with these GEMMA4_* variables (its `settings.env`: what its request
    path reads) until the test ends: an engine's settings are read once, when it is built."""
    import dataclasses  # (tests only)

    from gemma4.env import Settings

    monkeypatch.setattr(engine, "settings", dataclasses.replace(engine.settings, env=Settings.from_env(env)))
