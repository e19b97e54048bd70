"""The settings registry (gemma4/env.py): every GEMMA4_* name the code reads is declared, each value
is read one way, an unknown name is reported at start, and docs/settings.md is the registry's table."""

from __future__ import annotations

import dataclasses
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gemma4 import env as registry
from gemma4.env import FOLDER_OFF, SETTINGS, SWITCH, EnvError, parse_setting, setting

ROOT = Path(__file__).resolve().parent.parent
# A GEMMA4_* name as written in code or docs; an f-string prefix ("GEMMA4_MAX_{kind}") or a
# wildcard ("GEMMA4_MAX_*") is not one.
NAME = re.compile(r"\bGEMMA4_[A-Z0-9]+(?:_[A-Z0-9]+)*\b")
# Python constants spelled like settings (gemma4/model/config.py's token ids), never variables.
NOT_SETTINGS = {"GEMMA4_MEDIA_TOKEN_IDS", "GEMMA4_AUDIO_TOKEN_IDS"}
DECLARED = {s.name for s in SETTINGS}


def _names_in(files: list[Path]) -> dict[str, set[str]]:
    """{name: the files that write it} for every GEMMA4_* name in `files`."""
    found: dict[str, set[str]] = {}
    for path in files:
        for name in NAME.findall(path.read_text(encoding="utf-8")):
            found.setdefault(name, set()).add(path.relative_to(ROOT).as_posix())
    return found


def _code_files() -> list[Path]:
    """The Python and shell files that may read a setting (C++ macros share the prefix: left out)."""
    files = sorted((ROOT / "gemma4").rglob("*.py")) + sorted((ROOT / "bench").rglob("*.py"))
    files += [ROOT / "app.py", ROOT / "run.sh", ROOT / "test.sh"] + sorted((ROOT / "scripts").glob("*.sh"))
    return [f for f in files if f.exists()]


def test_every_name_the_code_writes_is_declared():
    found = _names_in(_code_files())
    assert len(found) > 50 and "GEMMA4_KV" in found and "GEMMA4_JAX_CACHE" in found, sorted(found)  # the scan saw them
    undeclared = {name: sorted(where) for name, where in found.items() if name not in DECLARED | NOT_SETTINGS}
    assert not undeclared, f"declare these in gemma4/env.py GROUPS: {undeclared}"


# A read of a GEMMA4_* variable that bypasses `setting` (its own default, its own vocabulary): a
# mapping named env or environ, or os.environ (`x.settings.env.get`: a `gemma4.env.Settings`).
RAW_READ = re.compile(r"""((?<![.\w])(environ|env)|os\.environ)(\.get\(|\[)\s*["']GEMMA4_"""
                      r"""|env_(int|float)\([^)]*["']GEMMA4_""")


def test_the_package_reads_settings_only_through_the_registry():
    assert RAW_READ.search('os.environ.get("GEMMA4_X", "on")') and RAW_READ.search("env_int(env, 'GEMMA4_X')")
    assert RAW_READ.search('env["GEMMA4_X"]') and not RAW_READ.search('engine.settings.env.get("GEMMA4_X")')
    files = sorted((ROOT / "gemma4").rglob("*.py")) + [ROOT / "app.py"]
    raw = {f.relative_to(ROOT).as_posix() for f in files if RAW_READ.search(f.read_text(encoding="utf-8"))}
    assert not raw, sorted(raw)


def test_every_declared_setting_is_used_somewhere():
    files = [f for f in _code_files() + sorted((ROOT / "tests").rglob("*.py"))
             if f.name not in ("env.py", "test_env.py")]
    found = _names_in(files)
    assert "GEMMA4_MIXED_STEP" in found  # the scan saw them
    assert sorted(DECLARED - set(found)) == []


def test_each_name_is_declared_once_with_a_one_line_doc():
    names = [s.name for s in SETTINGS]
    assert len(names) == len(set(names)) and len(names) > 50
    for s in SETTINGS:
        assert s.name.startswith("GEMMA4_") and s.doc and "\n" not in s.doc, s


def test_every_default_reads_back_from_the_text_the_docs_show():
    for s in SETTINGS:
        if s.default is not None:
            assert parse_setting(s.name, registry.shown_default(s)) == s.default, s.name
        assert parse_setting(s.name, None) == s.default and parse_setting(s.name, "  ") == s.default


def test_one_on_off_vocabulary_for_every_switch():
    switches = [s.name for s in SETTINGS if s.kind == SWITCH]
    assert len(switches) > 10
    for name in switches:
        for word in ("1", "true", "Yes", "ON"):
            assert parse_setting(name, word) is True, (name, word)
        for word in ("0", "False", "no", "Off"):
            assert parse_setting(name, word) is False, (name, word)
        for word in ("of", "none", "2", "enabled"):  # a typo must not silently mean on (or off)
            with pytest.raises(EnvError, match=f"{name}='{word}': expected on or off"):
                parse_setting(name, word)


@pytest.mark.parametrize("name, value, allowed", [
    ("GEMMA4_MAX_USERS", "eight", "an integer at least 1"),
    ("GEMMA4_PORT", "0", "an integer from 1 to 65535"),
    ("GEMMA4_MEMORY_FRACTION", "1.5", "a number above 0, at most 1"),
    ("GEMMA4_FETCH_TIMEOUT_S", "nan", "a number above 0"),
    ("GEMMA4_KV", "fp4", "one of auto, native, int8, fp8"),
    ("GEMMA4_DECODE_BLOCK", "65", "an integer from 1 to 64, or auto"),
    ("GEMMA4_AUDIO_BUCKETS", "2,-4", "comma-separated positive seconds"),
    ("GEMMA4_PREFLIGHT", "maybe", "one of on, warn, off"),
])
def test_a_bad_value_names_the_variable_the_value_and_what_is_allowed(name, value, allowed):
    with pytest.raises(EnvError) as e:
        setting(name, {name: value})
    assert str(e.value).startswith(f"{name}={value!r}: expected {allowed}")


def test_kinds_read_their_values():
    assert setting("GEMMA4_MAX_USERS", {"GEMMA4_MAX_USERS": " 3 "}) == 3
    assert setting("GEMMA4_MEMORY_FRACTION", {"GEMMA4_MEMORY_FRACTION": "1"}) == 1.0
    assert setting("GEMMA4_DTYPE", {"GEMMA4_DTYPE": "BF16"}) == "bfloat16"  # an alias
    assert setting("GEMMA4_DECODE_BLOCK", {"GEMMA4_DECODE_BLOCK": "Auto"}) is None  # auto: the default
    assert setting("GEMMA4_EMPTY_THOUGHT", {"GEMMA4_EMPTY_THOUGHT": "auto"}) is None
    assert setting("GEMMA4_AUDIO_BUCKETS", {"GEMMA4_AUDIO_BUCKETS": "1, 5,60"}) == (1.0, 5.0, 60.0)
    for off in ("off", "None", "OFF"):  # "none" turns a cache off, as it always did
        assert setting("GEMMA4_PREPARED_CACHE", {"GEMMA4_PREPARED_CACHE": off}) == FOLDER_OFF
    assert setting("GEMMA4_PREPARED_CACHE", {"GEMMA4_PREPARED_CACHE": "~/p"}) == "~/p"
    with pytest.raises(KeyError, match="GEMMA4_NOT_A_SETTING is not declared"):
        setting("GEMMA4_NOT_A_SETTING", {})


def test_reads_are_lazy(monkeypatch):
    monkeypatch.delenv("GEMMA4_MIXED_STEP", raising=False)
    assert setting("GEMMA4_MIXED_STEP") is True
    monkeypatch.setenv("GEMMA4_MIXED_STEP", "off")
    assert setting("GEMMA4_MIXED_STEP") is False


def test_an_unknown_name_is_warned_about_with_the_closest_declared_one(caplog):
    env = {"GEMMA4_MAX_USER": "3", "GEMMA4_KV": "int8", "GEMMA4_QQQQQQQQ": "1", "PATH": "/bin"}
    assert registry.unknown_names(env) == ["GEMMA4_MAX_USER", "GEMMA4_QQQQQQQQ"]
    with caplog.at_level(logging.WARNING, logger="gemma4.env"):
        messages = registry.warn_unknown(env)
    assert len(messages) == 2 and [r.getMessage() for r in caplog.records] == messages
    assert messages[0].startswith("GEMMA4_MAX_USER is set but is not a gemma4 setting")
    assert "did you mean GEMMA4_MAX_USERS?" in messages[0] and "did you mean" not in messages[1]
    assert registry.warn_unknown({"GEMMA4_KV": "int8"}) == []


def test_the_app_and_the_cli_report_unknown_names_at_start(caplog, monkeypatch):
    from gemma4.cli import commands
    from gemma4.web.settings import parse_settings

    with caplog.at_level(logging.WARNING, logger="gemma4.env"):
        parse_settings([], environ={"GEMMA4_CONTXT": "2048"})
    assert any("GEMMA4_CONTXT" in r.getMessage() and "GEMMA4_CONTEXT?" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.setenv("GEMMA4_WEIGHT", "int8")
    with caplog.at_level(logging.WARNING, logger="gemma4.env"), pytest.raises(SystemExit):
        commands.main(["generate"])  # a usage error (no --prompt), after the report
    assert any("GEMMA4_WEIGHT " in r.getMessage() and "GEMMA4_WEIGHTS?" in r.getMessage() for r in caplog.records)


def test_the_app_stops_on_a_bad_value_with_its_message():
    from gemma4.web.settings import parse_settings

    with pytest.raises(SystemExit, match="GEMMA4_SHARE='maybe': expected on or off"):
        parse_settings([], environ={"GEMMA4_SHARE": "maybe"})


def test_the_policy_reads_its_overrides_through_the_registry():
    from gemma4.plan.hardware import PolicyError, normalize_overrides

    assert normalize_overrides({"dtype": "bf16", "GEMMA4_ALLOW_FALLBACK": True}, env={"GEMMA4_KV": "INT8"}) == {
        "dtype": "bfloat16", "kv": "int8", "allow_fallback": True}
    assert normalize_overrides({"weights": "auto", "decode_block": "auto"}, env={"GEMMA4_WEIGHTS": "int8"}) == {}
    with pytest.raises(PolicyError, match="GEMMA4_ALLOW_FALLBACK='sometimes': expected on or off"):
        normalize_overrides(env={"GEMMA4_ALLOW_FALLBACK": "sometimes"})


def test_the_policy_takes_its_overrides_from_the_settings_handed_down(monkeypatch):
    from gemma4.plan.hardware import normalize_overrides

    monkeypatch.setenv("GEMMA4_KV", "fp8")  # the environment is the start-ups' to read, not the policy's
    assert normalize_overrides() == {}
    settings = registry.Settings.from_env({"GEMMA4_KV": "int8"}, {"GEMMA4_WEIGHTS": "int4"})
    assert normalize_overrides(env=settings) == {"kv": "int8", "weights": "int4"}
    assert normalize_overrides({"kv": "native"}, env=settings) == {"kv": "native", "weights": "int4"}  # the dict wins


def test_defaults_that_mirror_a_library_agree_with_it():
    from PIL import Image

    assert registry.default_of("GEMMA4_MAX_IMAGE_PIXELS") == Image.MAX_IMAGE_PIXELS


def test_docs_settings_md_is_the_registry_table():
    text = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert text == registry.markdown(), "run: python -m gemma4.env > docs/settings.md"
    assert set(NAME.findall(text)) == DECLARED  # every setting has its row


def test_the_docs_name_only_declared_settings():
    docs = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "bench" / "README.md"]
    docs += sorted((ROOT / "spaces_config").glob("*.md"))
    found = _names_in(docs)
    assert "GEMMA4_MODEL" in found  # the scan saw them
    assert {n: sorted(w) for n, w in found.items() if n not in DECLARED} == {}


def test_the_registry_loads_no_jax_and_prints_the_docs_table():
    code = "import sys, runpy; runpy.run_module('gemma4.env', run_name='__main__'); assert 'jax' not in sys.modules"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")


# ------------------------------------------------------------------------------ the settings in force
def test_settings_hold_every_setting_with_where_it_came_from():
    s = registry.Settings.from_env({"GEMMA4_KV": "INT8", "GEMMA4_MAX_USERS": " 3 ", "GEMMA4_DTYPE": "  ", "PATH": "/"})
    assert [name for name, _, _ in s.rows()] == [x.name for x in SETTINGS]
    assert (s.get("GEMMA4_KV"), s.source("GEMMA4_KV")) == ("int8", "environment")
    assert (s.get("GEMMA4_MAX_USERS"), s.source("GEMMA4_MAX_USERS")) == (3, "environment")
    assert (s.get("GEMMA4_DTYPE"), s.source("GEMMA4_DTYPE")) == ("auto", "default")  # blank: the default
    assert s.get("GEMMA4_MIXED_STEP") is True and s.source("GEMMA4_MIXED_STEP") == "default"
    flagged = s.with_flags({"GEMMA4_KV": "fp8", "GEMMA4_MODEL": "random:tiny-e2b"})
    assert (flagged.get("GEMMA4_KV"), flagged.source("GEMMA4_KV")) == ("fp8", "flag")
    assert flagged.source("GEMMA4_MODEL") == "flag" and flagged.source("GEMMA4_MAX_USERS") == "environment"
    assert s.get("GEMMA4_KV") == "int8"  # immutable: with_flags made a new one
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.entries = ()
    with pytest.raises(KeyError, match="GEMMA4_NOPE is not declared"):
        s.get("GEMMA4_NOPE")
    with pytest.raises(KeyError, match="GEMMA4_NOPE is not declared"):
        s.with_flags({"GEMMA4_NOPE": 1})
    with pytest.raises(EnvError, match="GEMMA4_MAX_USERS='0'"):
        registry.Settings.from_env({"GEMMA4_MAX_USERS": "0"})
    assert registry.Settings.defaults() == registry.Settings.from_env({})


def test_settings_describe_themselves_without_secrets():
    s = registry.Settings.from_env({"GEMMA4_API_KEY": "sk-secret", "GEMMA4_AUTH": "me:pw", "GEMMA4_KV": "int8",
                                    "GEMMA4_AUDIO_BUCKETS": "2,4.5"})
    text = s.describe()
    assert len(text.splitlines()) == len(SETTINGS) and "sk-secret" not in text and "me:pw" not in text
    assert "sk-secret" not in repr(s) and "pw" not in str(s.rows())
    lines = {line.split("=")[0].strip(): line.split("=", 1)[1].strip() for line in text.splitlines()}
    assert lines["GEMMA4_API_KEY"] == "(set, hidden) (environment)" and lines["GEMMA4_KV"] == "int8 (environment)"
    assert lines["GEMMA4_AUDIO_BUCKETS"] == "2,4.5 (environment)" and lines["GEMMA4_MIXED_STEP"] == "on (default)"
    assert lines["GEMMA4_PORT"] == "unset (default)"
    changed = s.describe(changed_only=True).splitlines()
    assert len(changed) == 5 and changed[-1] == f"({len(SETTINGS) - 4} other settings at their defaults)"
    assert repr(s).startswith("Settings(GEMMA4_AUTH='(set, hidden)' (environment)")


def test_flags_given_tells_a_given_flag_from_a_default():
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--model", default="bundled")
    dests = ("port", "share", "model")
    assert registry.flags_given(p, [], dests) == set()
    assert registry.flags_given(p, ["--port", "7860", "--no-share"], dests) == {"port", "share"}  # even at its default


def test_the_app_and_the_cli_keep_one_settings_object_with_sources(monkeypatch):
    from gemma4.cli import commands
    from gemma4.web.settings import parse_settings

    app = parse_settings(["--model", "random:tiny-e2b", "--no-share", "--coordinator", "h:1", "--num-processes",
                          "2", "--process-id", "0"], environ={"GEMMA4_KV": "int8", "GEMMA4_MODEL": "bundled"}).env
    assert (app.get("GEMMA4_MODEL"), app.source("GEMMA4_MODEL")) == ("random:tiny-e2b", "flag")
    assert (app.get("GEMMA4_SHARE"), app.source("GEMMA4_SHARE")) == (False, "flag")
    assert (app.get("GEMMA4_NUM_PROCESSES"), app.source("GEMMA4_NUM_PROCESSES")) == (2, "flag")
    assert app.source("GEMMA4_KV") == "environment" and app.source("GEMMA4_CONTEXT") == "default"
    settings = registry.Settings.from_env({"GEMMA4_MESH": "none"})
    argv = ["generate", "--prompt", "hi", "--weights", "int8", "--max-new-tokens", "3"]
    args = commands._parser(settings).parse_args(argv)
    assert commands._given(argv[1:], args, settings) == {"GEMMA4_WEIGHTS": "int8"}
