"""``reorder.results_order`` on the rerank routes: `results` in the prompt order on request.

The fake backend is built with a recency bias (the direction SmolLM2 has): `bias_matched`
then puts the best passage last, so the placement is the ranking reversed and the two
orders cannot be mistaken for each other.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.app.conftest import BEST_FIRST, TRUTH, TrackingBackend, rerank_body, serving

# Best first: passage 1 (utility 2.0), 2 (0.8), 3 (-0.4), 0 (-1.0).
assert BEST_FIRST == [1, 2, 3, 0]
PLACED = [0, 3, 2, 1]  # bias grows towards the end: the best passage goes last


def recency_bias(n_slots: int) -> tuple[float, ...]:
    total = n_slots * (n_slots + 1) / 2
    return tuple((j + 1) / total for j in range(n_slots))


def _backend() -> TrackingBackend:
    return TrackingBackend(TRUTH, bias=recency_bias)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
async def test_placement_returns_the_prompt_order_with_the_same_scores(
    tmp_path: Path, path: str
) -> None:
    async with serving(tmp_path, backend=_backend()) as served:
        ranked = (await served.client.post(path, json=rerank_body())).json()
        placed = await served.client.post(
            path, json=rerank_body(reorder={"results_order": "placement"})
        )
    assert placed.status_code == 200, placed.text
    body = placed.json()
    assert [x["index"] for x in ranked["results"]] == BEST_FIRST
    assert ranked["meta"]["results_order"] == "ranking"
    assert [x["index"] for x in body["results"]] == PLACED == body["meta"]["reorder"]["order"]
    assert body["meta"]["results_order"] == "placement"
    # relevance_score is still the utility's monotone map: re-sorting by it gives the ranking.
    by_score = sorted(body["results"], key=lambda x: -x["relevance_score"])
    assert [x["index"] for x in by_score] == BEST_FIRST
    assert body["results"][-1]["document"] == {"text": rerank_body()["documents"][1]}


async def test_top_n_keeps_the_best_n_in_their_placement_order(tmp_path: Path) -> None:
    async with serving(tmp_path, backend=_backend()) as served:
        r = await served.client.post(
            "/v1/rerank", json=rerank_body(top_n=2, reorder={"results_order": "placement"})
        )
    body = r.json()
    # The best two are 1 and 2; the placement puts 2 before 1.
    assert [x["index"] for x in body["results"]] == [2, 1] == body["meta"]["reorder"]["order"]


async def test_descending_utility_placement_is_the_ranking(tmp_path: Path) -> None:
    async with serving(tmp_path, backend=_backend()) as served:
        r = await served.client.post(
            "/v1/rerank",
            json=rerank_body(
                reorder={"results_order": "placement", "placement": "descending_utility"}
            ),
        )
    assert [x["index"] for x in r.json()["results"]] == BEST_FIRST


async def test_the_server_default_applies_and_a_request_overrides_it(tmp_path: Path) -> None:
    async with serving(tmp_path, backend=_backend(), rerank_results_order="placement") as served:
        default = (await served.client.post("/v1/rerank", json=rerank_body())).json()
        ranked = (
            await served.client.post(
                "/v1/rerank", json=rerank_body(reorder={"results_order": "ranking"})
            )
        ).json()
        info = (await served.client.get("/info")).json()
    assert [x["index"] for x in default["results"]] == PLACED
    assert default["meta"]["results_order"] == "placement"
    assert [x["index"] for x in ranked["results"]] == BEST_FIRST
    assert info["default_results_order"] == "placement"


async def test_an_unknown_value_is_a_422_naming_the_parameter(tmp_path: Path) -> None:
    async with serving(tmp_path) as served:
        r = await served.client.post(
            "/v1/rerank", json=rerank_body(reorder={"results_order": "prompt"})
        )
        native = await served.client.post(
            "/v1/reorder",
            json={"query": "q", "passages": ["a", "b"], "results_order": "placement"},
        )
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["param"] == "reorder.results_order" and err["code"] == "validation_error"
    assert "'prompt'" in err["message"]
    # The native route has `order` for the placement and no such option.
    assert native.status_code == 422 and native.json()["error"]["param"] == "results_order"
