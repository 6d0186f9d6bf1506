"""The prompt's context (issue 93) on both routes, in process on the fake backend: a token
budget never exceeded and every drop reported, a budget below the best passage a 422 naming
the parameter, the tokens needed and the budget, near-duplicates merged before scoring (fewer
prompts), the distractor rule by the fit's errors, and document order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.backends.tokenizers.byte_tokenizer import ByteTokenizer
from service.passage import Passage
from service.prompting.templates import get_template
from tests.app.conftest import PASSAGES, QUERY, TRUTH, TrackingBackend, serving


def block_tokens(order: list[int], passages: list[str], template: str = "qa_default") -> int:
    """The documents block as the prompt renders it, counted by the fake's byte tokenizer."""
    tpl = get_template(template)
    text = tpl.separator.join(
        tpl.render_document(k, Passage(text=passages[i]))[0] for k, i in enumerate(order)
    )
    return len(ByteTokenizer().encode(text).ids)


async def post(tmp_path: Path, route: str, *bodies: dict[str, Any], **kw: Any) -> Any:
    """Each body's (status, JSON) from one server on the fake backend (``kw`` its options)."""
    async with serving(tmp_path, backend=TrackingBackend(TRUTH, **kw)) as h:
        out = []
        for body in bodies:
            r = await h.client.post(route, json=body)
            out.append((r.status_code, r.json(), h.backend))
        return out[0] if len(out) == 1 else out


async def test_budget_keeps_the_best_that_fit_and_reports_every_drop(tmp_path: Path) -> None:
    budget = block_tokens([1, 2], PASSAGES) + 5
    code, out, _ = await post(
        tmp_path,
        "/v1/reorder",
        {
            "query": QUERY,
            "passages": PASSAGES,
            "strategy": "moi",
            "context": {"max_context_tokens": budget},
        },
    )
    assert code == 200, out
    ctx = out["context"]
    assert sorted(out["order"]) == [1, 2]  # the two best by utility
    assert ctx["order"] == out["order"]
    assert ctx["tokens_used"] == block_tokens(out["order"], PASSAGES) <= budget
    assert ctx["budget"] == budget
    assert {d["index"]: d["reason"] for d in ctx["dropped"]} == {0: "budget", 3: "budget"}
    assert ctx["tokenizer"] == out["model"]  # the scoring model's: no generator configured
    assert ctx["tokenizer_is_generator"] is True
    assert "qa_default" in ctx["counted"]
    # Every passage is either placed or dropped with a reason, never both, never neither.
    assert sorted(out["order"] + [d["index"] for d in ctx["dropped"]]) == [0, 1, 2, 3]


async def test_budget_below_the_best_passage_is_a_422(tmp_path: Path) -> None:
    code, out, _ = await post(
        tmp_path,
        "/v1/reorder",
        {
            "query": QUERY,
            "passages": PASSAGES,
            "strategy": "moi",
            "context": {"max_context_tokens": 5},
        },
    )
    assert code == 422
    err = out["error"]
    assert err["code"] == "context_budget_too_small"
    assert err["param"] == "context.max_context_tokens"
    assert err["value"] == 5
    assert err["limit"] == block_tokens([1], PASSAGES)  # the best passage's own tokens
    code, out, _ = await post(
        tmp_path,
        "/v1/rerank",
        {
            "query": QUERY,
            "documents": PASSAGES,
            "reorder": {"strategy": "moi", "context": {"max_context_tokens": 5}},
        },
    )
    assert code == 422
    assert out["error"]["param"] == "reorder.context.max_context_tokens"


async def test_rerank_returns_only_the_kept_documents(tmp_path: Path) -> None:
    budget = block_tokens([1, 2], PASSAGES) + 5
    code, out, _ = await post(
        tmp_path,
        "/v1/rerank",
        {
            "query": QUERY,
            "documents": PASSAGES,
            "reorder": {"strategy": "moi", "context": {"max_context_tokens": budget}},
        },
    )
    assert code == 200, out
    assert [r["index"] for r in out["results"]] == [1, 2]  # best first
    ctx = out["meta"]["reorder"]["context"]
    assert {d["index"] for d in ctx["dropped"]} == {0, 3}
    assert ctx["tokens_used"] <= budget


async def test_duplicates_are_merged_before_scoring_and_reported(tmp_path: Path) -> None:
    # Passage 4 repeats passage 1 with other case and punctuation; passage 5 repeats 2 exactly.
    passages = [*PASSAGES, PASSAGES[1].upper().replace(".", "!"), PASSAGES[2]]
    body = {
        "query": QUERY,
        "passages": passages,
        "strategy": "moi",
        "design": {"kind": "random", "num_prompts": 12, "seed": 3},
    }
    (_, plain, _), (code, out, _) = await post(
        tmp_path, "/v1/reorder", body, {**body, "context": {"dedup": True}}
    )
    # Without dedup, the repeated texts are scored as passages of their own.
    assert len(plain["ranking"]) == 6
    assert code == 200, out
    ctx = out["context"]
    assert {(m["index"], m["into"]) for m in ctx["merged"]} == {(4, 1), (5, 2)}
    assert all(m["similarity"] == 1.0 for m in ctx["merged"])
    assert {d["index"]: d["into"] for d in ctx["dropped"] if d["reason"] == "duplicate"} == {
        4: 1,
        5: 2,
    }
    assert sorted(out["order"]) == [0, 1, 2, 3]
    assert sorted(out["ranking"]) == [0, 1, 2, 3]
    assert out["ranking"][0] == 1
    # Scored once: the prompts carried four passages, not six.
    assert out["usage"]["prompt_tokens"] < plain["usage"]["prompt_tokens"]


async def test_distractors_dropped_by_the_fits_errors(tmp_path: Path) -> None:
    body = {
        "query": QUERY,
        "passages": PASSAGES,
        "strategy": "moi",
        "design": {"kind": "random", "num_prompts": 16, "seed": 1},
        "context": {"distractors": {"fraction": 1.0, "confidence": 0.9}},
    }
    code, out, _ = await post(tmp_path, "/v1/reorder", body, noise=0.02)
    assert code == 200, out
    ctx = out["context"]
    dropped = {d["index"]: d for d in ctx["dropped"]}
    # Utilities -1.0 and -0.4 sit credibly below the mean (0.35) at this noise; 2.0 and 0.8 not.
    assert set(dropped) == {0, 3}
    assert all(d["reason"] == "distractor" and d["probability"] >= 0.9 for d in dropped.values())
    assert "not_credibly_below" in ctx["distractor_rule"]
    # At a noise the design cannot resolve, nothing is dropped on it.
    code, noisy, _ = await post(tmp_path, "/v1/reorder", body, noise=20.0)
    assert code == 200
    assert noisy["context"]["dropped"] == [] or all(
        d["probability"] >= 0.9 for d in noisy["context"]["dropped"]
    )


async def test_distractors_without_errors_warn_and_drop_nothing(tmp_path: Path) -> None:
    body = {
        "query": QUERY,
        "passages": PASSAGES,
        "strategy": "retriever",
        "context": {"distractors": {}},
    }
    code, out, _ = await post(tmp_path, "/v1/reorder", body)
    assert code == 200, out
    assert out["context"]["dropped"] == []
    assert sorted(out["order"]) == [0, 1, 2, 3]
    assert any("no standard errors" in w for w in out["diagnostics"]["warnings"])


async def test_document_order_keeps_each_source_in_offset_order(tmp_path: Path) -> None:
    # Two sources, their chunks given out of order; the best passage (1) is doc-a's 2nd chunk.
    passages = [
        {"text": PASSAGES[0], "source": "doc-a", "offset": 300},
        {"text": PASSAGES[1], "source": "doc-a", "offset": 100},
        {"text": PASSAGES[2], "source": "doc-b", "offset": 50},
        {"text": PASSAGES[3], "source": "doc-b", "offset": 0},
    ]
    body = {
        "query": QUERY,
        "passages": passages,
        "strategy": "moi",
        "context": {"order": "document"},
    }
    (code, out, _), (_, placed, _) = await post(
        tmp_path, "/v1/reorder", body, {**body, "context": {}}
    )
    assert code == 200, out
    order = out["order"]
    # doc-a first (it holds the best passage), its chunks by offset, then doc-b's.
    assert order == [1, 0, 3, 2]
    assert placed["order"][0] == 1 and placed["order"] != order


@pytest.mark.parametrize("route", ["/v1/reorder", "/v1/rerank"])
async def test_without_context_nothing_changes(tmp_path: Path, route: str) -> None:
    key = "passages" if route == "/v1/reorder" else "documents"
    body: dict[str, Any] = {"query": QUERY, key: PASSAGES}
    code, out, _ = await post(tmp_path, route, body)
    assert code == 200
    meta = out if route == "/v1/reorder" else out["meta"]["reorder"]
    assert meta["context"] is None
    assert sorted(meta["order"]) == [0, 1, 2, 3]


async def test_the_generators_tokenizer_counts_when_configured(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    """`generator_tokenizer` set: SmolLM2's tokenizer counts the budget (the fake scorer's
    byte tokenizer would count ~4x more), and the response names it."""
    from service.backends.tokenizers.tokenizer_files import load_prompt_tokenizer

    smol = load_prompt_tokenizer(smollm2_dir, name="smollm2")
    tpl = get_template("qa_default")

    def smol_tokens(order: list[int]) -> int:
        text = tpl.separator.join(
            tpl.render_document(k, Passage(text=PASSAGES[i]))[0] for k, i in enumerate(order)
        )
        return len(smol.encode(text).ids)

    budget = smol_tokens([1, 2, 0, 3])  # all four fit in SmolLM2's tokens, not in bytes
    assert block_tokens([1], PASSAGES) > budget // 2
    body = {
        "query": QUERY,
        "passages": PASSAGES,
        "strategy": "moi",
        "context": {"max_context_tokens": budget},
    }
    async with serving(tmp_path, generator_tokenizer=str(smollm2_dir)) as h:
        r = await h.client.post("/v1/reorder", json=body)
    assert r.status_code == 200, r.json()
    ctx = r.json()["context"]
    assert ctx["tokenizer"] == str(smollm2_dir)
    assert ctx["tokenizer_is_generator"] is True
    assert sorted(r.json()["order"]) == [0, 1, 2, 3]
    assert ctx["tokens_used"] == smol_tokens(r.json()["order"]) <= budget
