"""Opt-in truncation (issue 94, item 4): a passage over the per-passage token limit is a 422
by default; with `truncate: "end"` it is cut to the limit in the scoring model's tokens, the
model scores the cut text, and the response lists every cut. In process, on the paced engine
with SmolLM2's real tokenizer (its log-probs a hash of each prompt's tokens, so two requests
whose prompts are the same get the same answer)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.main import create_app
from service.backends.base import PromptTokenizer, ScoreResult, SpanRequest
from service.backends.fakes.paced import PacedBackend, PacedProfile
from service.backends.tokenizers.tokenizer_files import load_prompt_tokenizer
from tests.app.conftest import PASSAGES, QUERY, settings_for, wait_ready

LONG = (
    "The river Loire rises in the Massif Central and flows north, then west, for about a "
    "thousand kilometres to the Atlantic at Saint-Nazaire. Its valley holds the chateaux of "
    "Chambord and Chenonceau, and its floods, fed by the Cevennes' autumn storms, have shaped "
    "the towns along it since Roman times. " * 4
)
LIMIT = 40


class RecordingBackend(PacedBackend):
    """The paced engine, keeping every scored prompt's token ids."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(
            tokenizer,
            PacedProfile("t", 1e6, 0.0, padded=False, decode_step_s=0.0, source="test"),
            model="smollm2",
            max_model_len=8192,
            vocab_size=len(tokenizer.hf_tokenizer),
            batch_token_budget=16384,
        )
        self.prompts: list[tuple[int, ...]] = []

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        self.prompts.extend(r.token_ids for r in requests)
        return await super().score(requests)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return load_prompt_tokenizer(smollm2_dir, name="smollm2")


@asynccontextmanager
async def serving(
    tmp_path: Path, tokenizer: Any, **overrides: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, RecordingBackend]]:
    backend = RecordingBackend(tokenizer)
    app = create_app(settings_for(tmp_path, **overrides), backend=backend)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        await wait_ready(client, timeout=60)  # the warm-up on a loaded 2-core machine
        backend.prompts.clear()  # the warm-up's
        yield client, backend


def passages_with_long(text: str = LONG) -> list[str]:
    return [PASSAGES[0], text, PASSAGES[2], PASSAGES[3]]


def first_tokens(tokenizer: PromptTokenizer, text: str, n: int) -> str:
    """What the cut must keep: the text up to the end of its ``n``-th token."""
    return text[: tokenizer.encode(text).offsets[n - 1][1]]


def same_fit(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two native responses placed and scored alike (ids and timings aside)."""
    for key in ("order", "ranking", "passages", "position_bias", "usage"):
        assert a[key] == b[key], key


async def test_a_long_passage_is_refused_by_default(tmp_path: Path, tokenizer: Any) -> None:
    tokens = len(tokenizer.encode(LONG).ids)
    assert tokens > LIMIT
    async with serving(tmp_path, tokenizer) as (client, backend):
        r = await client.post(
            "/v1/reorder",
            json={"query": QUERY, "passages": passages_with_long(), "max_passage_tokens": LIMIT},
        )
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["param"] == "passages[1]" and err["limit"] == LIMIT
        assert err["value"] == tokens and 'truncate "end"' in err["message"]
        r = await client.post(
            "/v1/rerank",
            json={"query": QUERY, "documents": passages_with_long(), "max_tokens_per_doc": LIMIT},
        )
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["param"] == "documents[1]" and err["limit"] == LIMIT
        assert err["value"] == tokens
        assert backend.prompts == []  # refused before any scoring


async def test_truncate_end_cuts_scores_the_cut_text_and_reports_it(
    tmp_path: Path, tokenizer: Any
) -> None:
    tokens = len(tokenizer.encode(LONG).ids)
    kept = first_tokens(tokenizer, LONG, LIMIT)
    body = {"query": QUERY, "strategy": "moi", "passages": passages_with_long()}
    async with serving(tmp_path, tokenizer) as (client, backend):
        r = await client.post(
            "/v1/reorder", json={**body, "truncate": "end", "max_passage_tokens": LIMIT}
        )
        assert r.status_code == 200, r.text
        cut = r.json()
        assert cut["truncated"] == [
            {
                "index": 1,
                "tokens": tokens,
                "tokens_kept": LIMIT,
                "tokens_cut": tokens - LIMIT,
                "chars_kept": len(kept),
            }
        ]
        # The model read the cut text, and never what was cut off.
        read = [tokenizer.decode(p) for p in backend.prompts]
        assert read and any(kept in text for text in read)
        assert not any(LONG[len(kept) : len(kept) + 30] in text for text in read)
        # Everything else is as for the caller sending the cut text itself.
        backend.prompts.clear()
        pre_cut = await client.post(
            "/v1/reorder", json={**body, "passages": passages_with_long(kept)}
        )
        assert pre_cut.status_code == 200, pre_cut.text
        assert pre_cut.json()["truncated"] == []
        same_fit(cut, pre_cut.json())
        # Passages under the limit are not cut, and nothing is listed.
        r = await client.post(
            "/v1/reorder", json={**body, "truncate": "end", "max_passage_tokens": tokens}
        )
        assert r.status_code == 200 and r.json()["truncated"] == []


async def test_rerank_truncates_as_cohere_when_asked(tmp_path: Path, tokenizer: Any) -> None:
    tokens = len(tokenizer.encode(LONG).ids)
    kept = first_tokens(tokenizer, LONG, LIMIT)
    body = {"query": QUERY, "documents": passages_with_long(), "max_tokens_per_doc": LIMIT}
    async with serving(tmp_path, tokenizer) as (client, backend):
        r = await client.post(
            "/v1/rerank", json={**body, "reorder": {"strategy": "moi", "truncate": "end"}}
        )
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta"]["reorder"]["truncated"] == [
            {
                "index": 1,
                "tokens": tokens,
                "tokens_kept": LIMIT,
                "tokens_cut": tokens - LIMIT,
                "chars_kept": len(kept),
            }
        ]
        # The caller's documents come back whole; the model read the cut one.
        assert {x["index"]: x["document"]["text"] for x in out["results"]}[1] == LONG
        assert any(kept in tokenizer.decode(p) for p in backend.prompts)
        assert not any(LONG[len(kept) :][:30] in tokenizer.decode(p) for p in backend.prompts)
        pre_cut = await client.post(
            "/v1/rerank",
            json={
                "query": QUERY,
                "documents": passages_with_long(kept),
                "reorder": {"strategy": "moi"},
            },
        )
        assert [x["relevance_score"] for x in pre_cut.json()["results"]] == [
            x["relevance_score"] for x in out["results"]
        ]


async def test_the_lower_limit_applies_and_is_named(tmp_path: Path, tokenizer: Any) -> None:
    async with serving(tmp_path, tokenizer, max_passage_tokens=LIMIT) as (client, _):
        info = (await client.get("/info")).json()
        assert info["limits"]["max_passage_tokens"] == LIMIT
        # The server's limit refuses without any field in the request...
        r = await client.post(
            "/v1/reorder", json={"query": QUERY, "passages": passages_with_long()}
        )
        err = r.json()["error"]
        assert r.status_code == 422 and err["param"] == "passages[1]" and err["limit"] == LIMIT
        assert "RAG_REORDER_MAX_PASSAGE_TOKENS" in err["message"]
        # ...and a request may lower it, not raise it.
        for asked, applied in ((LIMIT * 2, LIMIT), (LIMIT // 2, LIMIT // 2)):
            r = await client.post(
                "/v1/rerank",
                json={
                    "query": QUERY,
                    "documents": passages_with_long(),
                    "max_tokens_per_doc": asked,
                    "reorder": {"truncate": "end"},
                },
            )
            assert r.status_code == 200, r.text
            assert r.json()["meta"]["reorder"]["truncated"][0]["tokens_kept"] == applied


async def test_what_truncation_never_does(tmp_path: Path, tokenizer: Any) -> None:
    async with serving(
        tmp_path, tokenizer, max_query_chars=64, max_prompt_tokens_x_prompts=300
    ) as (client, backend):
        # No limit to cut to: a 422, not a silent no-op.
        r = await client.post(
            "/v1/reorder", json={"query": QUERY, "passages": PASSAGES, "truncate": "end"}
        )
        assert r.status_code == 422 and r.json()["error"]["param"] == "truncate", r.text
        r = await client.post(
            "/v1/rerank",
            json={"query": QUERY, "documents": PASSAGES, "reorder": {"truncate": "end"}},
        )
        assert r.status_code == 422 and r.json()["error"]["param"] == "reorder.truncate", r.text
        # A query over its limit is refused, never cut.
        long_query = "which passage answers " * 5
        r = await client.post(
            "/v1/reorder",
            json={
                "query": long_query,
                "passages": passages_with_long(),
                "truncate": "end",
                "max_passage_tokens": LIMIT,
            },
        )
        err = r.json()["error"]
        assert r.status_code == 422 and err["param"] == "query" and err["value"] == len(long_query)
        # Cut passages whose prompts are still over the request's limit: a 422 with figures.
        r = await client.post(
            "/v1/reorder",
            json={
                "query": QUERY,
                "strategy": "moi",
                "passages": passages_with_long(),
                "truncate": "end",
                "max_passage_tokens": LIMIT,
            },
        )
        err = r.json()["error"]
        assert r.status_code == 422 and err["param"] == "prompt_tokens_x_prompts", r.text
        assert err["limit"] == 300 and err["value"] > 300
        assert backend.prompts == []
