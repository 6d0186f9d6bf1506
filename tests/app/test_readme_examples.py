"""The curl examples of the HTTP API guide (docs/api.md) and of the README are valid requests
(run here against the fake backend)."""

from __future__ import annotations

import re
from pathlib import Path

from service.config.settings import Settings
from service.state.profile_store import profile_id
from tests.app.conftest import Harness, serving

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "api.md"
README = ROOT / "README.md"
_CURL = re.compile(
    r"curl -s localhost:8000(\S+) -H 'content-type: application/json' (?:\\\n\s*)?-d '(.*?)'",
    re.S,
)


def _http_block(page: Path = GUIDE) -> str:
    text = page.read_text()
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
        "/v1/reorder/batch",
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
    for path in paths - {"/v1/reorder", "/v1/reorder/batch", "/v1/rerank", "/rerank", "/v2/rerank"}:
        assert (await served.client.get(path)).status_code == 200, path


async def test_the_readme_calls_every_route_and_each_call_answers(tmp_path: Path) -> None:
    # The README's "Call it" block, in its order on one server: the profile it reads by id is
    # the one its calibration example stores.
    block = _http_block(README)
    posts = _CURL.findall(block)
    found = re.findall(r"curl -s\S* localhost:8000(/[\w/.-]+)\s*(?:\||$|-H|#)", block, re.M)
    gets = [p for p in found if p not in {path for path, _ in posts}]
    routes = {path for path, _ in posts} | {
        "/v1/bias-profiles/{profile_id}" if p.startswith("/v1/bias-profiles/") else p for p in gets
    }
    assert routes >= {
        "/v1/reorder",
        "/v1/reorder/batch",
        "/v1/rerank",
        "/v1/bias-profiles/calibrate",
        "/v1/bias-profiles",
        "/v1/bias-profiles/{profile_id}",
        "/v1/models",
        "/info",
        "/metrics",
        "/health",
        "/ready",
    }
    # The id shown is the embedded model's; the fake backend has a model id of its own, so the
    # id is checked against the rule and then read as the fake backend's calibration stored it.
    (shown,) = [p for p in gets if p.startswith("/v1/bias-profiles/")]
    default = Settings.model_fields["model"].default
    assert shown.rsplit("/", 1)[1] == profile_id(default, "qa_default", 3)
    stored: list[str] = []
    async with serving(tmp_path) as served:
        for path, body in posts:
            r = await served.client.post(
                path, content=body, headers={"content-type": "application/json"}
            )
            assert r.status_code == 200, (path, r.text)
            if path.endswith("/calibrate"):
                stored.append(r.json()["profile"]["id"])
        (pid,) = stored
        for path in gets:
            url = f"/v1/bias-profiles/{pid}" if path == shown else path
            assert (await served.client.get(url)).status_code == 200, url


def test_the_readme_is_a_guide_whose_links_resolve() -> None:
    # Issue 24: the README is the newcomer's guide (at most ~250 lines); everything longer
    # lives in the docs site, which `mkdocs build --strict` checks. The site does not build
    # the README, so its relative links are checked here.
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
    assert links, "the README links into docs/"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, missing
