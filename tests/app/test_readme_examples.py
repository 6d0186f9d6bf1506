"""The README's curl examples are valid requests (run here against the fake backend)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.app.conftest import Harness, serving

README = Path(__file__).resolve().parents[2] / "README.md"
_CURL = re.compile(
    r"curl -s localhost:8000(\S+) -H 'content-type: application/json' (?:\\\n\s*)?-d '(.*?)'",
    re.S,
)


def _http_block() -> str:
    text = README.read_text()
    return text[text.index("<!-- http:begin -->") : text.index("<!-- http:end -->")]


async def test_every_curl_body_in_the_readme_is_accepted(tmp_path: Path) -> None:
    # In the README's order, with live-traffic sampling on: the from_traffic example pools
    # the runs the reorder and rerank examples before it scored.
    async with serving(tmp_path, traffic_sample_rate=1.0) as served:
        await _post_examples(served)


async def _post_examples(served: Harness) -> None:
    examples = _CURL.findall(_http_block())
    assert {path for path, _ in examples} == {
        "/v1/reorder",
        "/v1/rerank",
        "/rerank",
        "/v2/rerank",
        "/v1/bias-profiles/calibrate",
    }
    for path, body in examples:
        r = await served.client.post(
            path, content=body, headers={"content-type": "application/json"}
        )
        assert r.status_code == 200, (path, r.text)


async def test_every_get_route_in_the_readme_answers(served: Harness) -> None:
    paths = set(
        re.findall(r"curl -s\S* localhost:8000(/[\w/]+)\s*(?:\||$|-H)", _http_block(), re.M)
    )
    assert {"/v1/models", "/info", "/metrics", "/health", "/ready"} <= paths
    for path in paths - {"/v1/reorder", "/v1/rerank", "/rerank", "/v2/rerank"}:
        assert (await served.client.get(path)).status_code == 200, path
