"""The serving path with a distilled adapter: the real transformers backend on a tiny random
model with an adapter trained in the test, through the HTTP routes."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from app.main import create_app
from service.config.settings import Settings
from service.model_assets.adapter import write_manifest
from serving import supervisor
from tests.app.conftest import reorder_body, rerank_body, settings_for, wait_ready
from tests.support.distill import distill_tiny, manifest


async def test_a_distilled_adapter_is_served_and_reported(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "tiny-distilled"
    distill_tiny(tiny_model_dir, out)
    settings = settings_for(
        tmp_path, model=str(tiny_model_dir), adapter=out, backend="transformers", device="cpu"
    )
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        await wait_ready(client, timeout=60)
        adapted = f"{tiny_model_dir}+tiny-distilled"
        card = (await client.get("/v1/models")).json()["data"][0]
        assert card["id"] == adapted and card["parent"] == str(tiny_model_dir)
        info = (await client.get("/info")).json()
        assert info["model"] == adapted
        assert info["adapter"]["name"] == "tiny-distilled"
        assert info["adapter"]["teacher"] == "teacher/fixed" and info["adapter"]["lora_r"] == 8
        assert info["adapter"]["after"]["questions"] == 1

        r = await client.post("/v1/reorder", json=reorder_body())
        assert r.status_code == 200 and r.json()["model"] == adapted
        # A request cannot choose an adapter: the native API has no such field (422), and the
        # rerank routes' `model` is accepted for compatibility but never switches the model.
        r = await client.post("/v1/reorder", json=reorder_body(adapter="other"))
        assert r.status_code == 422
        r = await client.post("/v1/rerank", json=rerank_body(model="HuggingFaceTB/other"))
        assert r.status_code == 200 and r.json()["model"] == adapted


async def test_the_adapted_model_id_is_reported_while_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A client that reads /v1/models during the load must get the id the responses will
    # carry, not the base model's: the load is held until the routes have been read.
    folder = tmp_path / "adapted"
    folder.mkdir()
    write_manifest(folder, manifest(Path("base/model"), "adapted"))
    release = threading.Event()

    def held_load(settings: Settings) -> None:
        release.wait(timeout=30)
        raise OSError("load released by the test")

    monkeypatch.setattr(supervisor, "create_backend", held_load)
    application = create_app(settings_for(tmp_path, model="base/model", adapter=folder))
    transport = httpx.ASGITransport(app=application, raise_app_exceptions=False)
    try:
        async with (
            application.router.lifespan_context(application),
            httpx.AsyncClient(transport=transport, base_url="http://test") as client,
        ):
            card = (await client.get("/v1/models")).json()["data"][0]
            assert card == {
                "id": "base/model+adapted",
                "object": "model",
                "owned_by": "rag-reorder",
                "max_model_len": None,
                "parent": "base/model",
            }
            assert (await client.get("/info")).json()["model"] == "base/model+adapted"
            release.set()
    finally:
        release.set()
