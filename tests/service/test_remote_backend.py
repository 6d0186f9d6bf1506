"""RemoteBackend's protocol handling against a scripted OpenAI-compatible server.

The scripted server speaks vLLM's wire format (``prompt_logprobs`` rows keyed by token-id
strings, ``return_token_ids``) with made-up numbers, so these tests see exactly what was sent
and how answers and refusals are read; that the numbers equal the in-process backend's is
checked against a real vLLM server in test_remote_vllm.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.backends.base import (
    Generation,
    GenerationRequest,
    PromptFailure,
    SpanLogprobs,
    SpanRequest,
)
from service.backends.engine_client import EngineClient
from service.backends.remote_backend import RemoteBackend, span_from_rows
from service.backends.tokenizer_files import load_prompt_tokenizer
from service.errors import EngineMismatch, EngineUnavailable, LimitExceeded


class ScriptedServer:
    """vLLM's OpenAI routes with a fixed rule: token t at position p scores -(t % 7 + p) / 10."""

    def __init__(self, tokenizer: Any, *, served: str = "smol", context: int = 512) -> None:
        self.tokenizer = tokenizer
        self.served = served
        self.context = context
        self.bodies: list[dict[str, Any]] = []
        self.tokenize_extra: list[int] = []
        self.ignore_ids = False

    def value(self, token: int, pos: int) -> float:
        return -((token % 7) + pos) / 10

    def rows(self, ids: list[int]) -> list[Any]:
        return [None] + [
            {str(t): {"logprob": self.value(t, p), "rank": 1}} for p, t in enumerate(ids) if p
        ]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            card = {"id": self.served, "object": "model", "max_model_len": self.context}
            return httpx.Response(200, json={"object": "list", "data": [card]})
        body = json.loads(request.content)
        self.bodies.append(body)
        if path == "/tokenize":
            ids = list(self.tokenizer.encode(body["prompt"]).ids) + self.tokenize_extra
            return httpx.Response(200, json={"tokens": ids, "count": len(ids)})
        assert path == "/v1/completions"
        prompts = body["prompt"]
        if isinstance(prompts, str):
            prompts = [list(self.tokenizer.encode(prompts).ids)]
        choices = []
        for i, sent in enumerate(prompts):
            ids = [t + 1 for t in sent] if self.ignore_ids else sent
            choice: dict[str, Any] = {"index": i, "text": "x", "finish_reason": "length"}
            if body.get("prompt_logprobs") is not None:
                choice["prompt_logprobs"] = self.rows(ids)
            if body.get("return_token_ids"):
                n = body["max_tokens"]
                choice["token_ids"] = [11] * n
                choice["logprobs"] = {"token_logprobs": [-0.5] * n}
            choices.append(choice)
        return httpx.Response(200, json={"choices": choices})


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_prompt_tokenizer(tiny_model_dir, name="tiny")


def backend(server: ScriptedServer, tokenizer: Any, **kwargs: Any) -> RemoteBackend:
    client = EngineClient("http://engine:8000", transport=httpx.MockTransport(server))
    return RemoteBackend(client, tokenizer, model_id="tiny", **kwargs)


async def test_connect_checks_model_tokenizer_and_scoring_then_scores(tokenizer: Any) -> None:
    server = ScriptedServer(tokenizer)
    b = backend(server, tokenizer, prompts_per_call=2)
    with pytest.raises(EngineUnavailable):
        await b.score([SpanRequest("a", (1, 2, 3), 1, 3)])  # not connected yet
    await b.connect()
    assert b.connected and b.max_model_len == 512
    server.bodies.clear()
    reqs = [SpanRequest(f"r{i}", tuple(range(10 + i, 30 + i)), 3, 8) for i in range(5)]
    results = await b.score(reqs)
    assert [r.request_id for r in results] == [r.request_id for r in reqs]
    for req, res in zip(reqs, results, strict=True):
        assert isinstance(res, SpanLogprobs)
        assert res.logprobs == tuple(
            server.value(req.token_ids[p], p) for p in range(req.span_start, req.span_end)
        )
    # Two prompts per call, each cut at its span's end, one token generated, log-probs asked.
    assert [len(b["prompt"]) for b in server.bodies] == [2, 2, 1]
    assert all(len(p) == 8 for body in server.bodies for p in body["prompt"])
    assert all(body["max_tokens"] == 1 and body["prompt_logprobs"] == 0 for body in server.bodies)
    assert all(body["model"] == "smol" for body in server.bodies)


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (lambda s: setattr(s, "served", "other-model"), "serves \\['other-model'\\]"),
        (lambda s: s.tokenize_extra.append(5), "tokenizer of 'tiny' here and of 'smol'"),
        (lambda s: setattr(s, "ignore_ids", True), "does not score our ids|no usable prompt"),
    ],
)
async def test_a_server_that_does_not_match_is_refused_naming_both(
    tokenizer: Any, break_it: Any, message: str
) -> None:
    server = ScriptedServer(tokenizer)
    break_it(server)
    b = backend(server, tokenizer, served_model="smol")
    with pytest.raises(EngineMismatch, match=message):
        await b.connect()
    assert not b.connected


async def test_generation_reads_ids_and_logprobs_and_scores_score_ids(tokenizer: Any) -> None:
    server = ScriptedServer(tokenizer)
    b = backend(server, tokenizer)
    await b.connect()
    server.bodies.clear()
    prompt = tuple(range(20, 40))
    reqs = [
        GenerationRequest("g1", prompt, 4, stop_token_ids=frozenset({9})),
        GenerationRequest("g2", prompt, 4, stop_token_ids=frozenset({9}), score_ids=(50, 51)),
        GenerationRequest("g3", prompt, 2),
    ]
    out = await b.generate(reqs)
    assert [o.request_id for o in out] == ["g1", "g2", "g3"]
    g1, g2, g3 = out
    assert isinstance(g1, Generation) and g1.token_ids == (11,) * 4 and g1.score_logprobs is None
    assert isinstance(g2, Generation) and g2.score_logprobs == (
        server.value(50, 20),
        server.value(51, 21),
    )
    assert isinstance(g3, Generation) and len(g3.token_ids) == 2
    gen_bodies = [body for body in server.bodies if body.get("return_token_ids")]
    assert sorted(len(body["prompt"]) for body in gen_bodies) == [1, 2]  # grouped by budget
    stops = next(body for body in gen_bodies if body["max_tokens"] == 4)["stop_token_ids"]
    assert 9 in stops and set(tokenizer.eos_token_ids) <= set(stops)


async def test_limits_are_checked_before_any_call(tokenizer: Any) -> None:
    server = ScriptedServer(tokenizer, context=64)
    b = backend(server, tokenizer)
    await b.connect()
    server.bodies.clear()
    with pytest.raises(LimitExceeded, match="token_ids is 64, over the limit of 63"):
        await b.score([SpanRequest("long", tuple(range(1, 65)), 1, 64)])
    assert server.bodies == []


def test_rows_that_miss_the_prompt_token_fail_the_prompt_alone() -> None:
    req = SpanRequest("a", (5, 6, 7), 1, 3)
    assert isinstance(
        span_from_rows(req, [None, {"6": {"logprob": -1.0}}, {"7": -2.0}]), SpanLogprobs
    )
    for rows, why in (
        (None, "no prompt log-probs"),
        ([None, {"6": -1.0}], "2 prompt rows, need 3"),
        ([None, {"8": -1.0}, {"7": -2.0}], "no log-prob for its token 6"),
        ([None, {"6": {"logprob": 0.5}}, {"7": -2.0}], "positive"),
    ):
        result = span_from_rows(req, rows)
        assert isinstance(result, PromptFailure) and why in result.reason
