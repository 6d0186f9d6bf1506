"""The serving path with a distilled adapter: the real transformers backend on a tiny random
model with an adapter trained in the test, through the HTTP routes."""

from __future__ import annotations

from pathlib import Path

import httpx

from app.main import create_app
from service.offline.distill.train import DistillConfig, distill
from tests.app.conftest import reorder_body, rerank_body, settings_for, wait_ready
from tests.support.distill import META, PREFS


async def test_a_distilled_adapter_is_served_and_reported(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "tiny-distilled"
    distill(
        tiny_model_dir,
        student_id=str(tiny_model_dir),
        student_template="qa_default",
        meta=META,
        train=PREFS[:1],
        held_back=PREFS[1:],
        out=out,
        config=DistillConfig(epochs=1, batch_questions=1),
    )
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
