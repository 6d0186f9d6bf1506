"""RemoteBackend's protocol handling against a scripted OpenAI-compatible server.

The scripted server speaks vLLM's wire format (``prompt_logprobs`` rows keyed by token-id
strings, ``return_token_ids``) with made-up numbers, so these tests see exactly what was sent
and how answers and refusals are read; that the numbers equal the in-process backend's is
checked against a real vLLM server in test_remote_vllm.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
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
from service.backends.engines.remote_backend import RemoteBackend, span_from_rows
from service.backends.tokenizers.tokenizer_files import load_prompt_tokenizer
from service.backends.transport.engine_client import EngineClient
from service.errors import EngineMismatch, EngineUnavailable, LimitExceeded
from tests.support.prompt_contract import Limits, check_contract


class ScriptedServer:
    """vLLM's OpenAI routes with a fixed rule: token t at position p scores -(t % 7 + p) / 10."""

    def __init__(self, tokenizer: Any, *, served: str = "smol", context: int = 512) -> None:
        self.tokenizer = tokenizer
        self.served = served
        self.context = context
        self.bodies: list[dict[str, Any]] = []
        self.tokenize_extra: list[int] = []
        self.ignore_ids = False
        self.paths: list[str] = []
        self.status: dict[str, int] = {}
        """Paths answered with this status (and an error body) instead."""
        self.text_noise: list[float] = []
        """Added to the log-probs of each prompt sent as text, one entry per call (a shared
        bf16 engine batching the probe's two calls differently)."""
        self.shift = 0.0
        """Subtracted from every log-prob (other weights under the same name)."""
        self.metrics: Callable[[], str] | None = None
        """``GET /metrics``'s Prometheus text (``None``: 404, a server without it)."""

    def value(self, token: int, pos: int) -> float:
        return -((token % 7) + pos) / 10 - self.shift

    def rows(self, ids: list[int], noise: float = 0.0) -> list[Any]:
        return [None] + [
            {str(t): {"logprob": self.value(t, p) - noise, "rank": 1}}
            for p, t in enumerate(ids)
            if p
        ]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.paths.append(path)
        if path in self.status:
            error = {"error": {"message": "scripted refusal"}}
            return httpx.Response(self.status[path], json=error)
        if path == "/metrics":
            if self.metrics is None:
                return httpx.Response(404, text="Not Found")
            return httpx.Response(200, text=self.metrics())
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
        noise = 0.0
        if isinstance(prompts, str):
            prompts = [list(self.tokenizer.encode(prompts).ids)]
            noise = self.text_noise.pop(0) if self.text_noise else 0.0
        choices = []
        for i, sent in enumerate(prompts):
            ids = [t + 1 for t in sent] if self.ignore_ids else sent
            choice: dict[str, Any] = {"index": i, "text": "x", "finish_reason": "length"}
            if body.get("prompt_logprobs") is not None:
                choice["prompt_logprobs"] = self.rows(ids, noise)
            if body.get("return_token_ids"):
                n = body["max_tokens"]
                choice["token_ids"] = [11] * n
                choice["logprobs"] = {"token_logprobs": [-0.5] * n}
            choices.append(choice)
        return httpx.Response(200, json={"choices": choices})


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_prompt_tokenizer(tiny_model_dir, name="tiny")


def backend(
    server: Any, tokenizer: Any, *, url: str = "http://engine:8000", **kwargs: Any
) -> RemoteBackend:
    client = EngineClient(url, transport=httpx.MockTransport(server), retries=0)
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


async def test_probe_noise_within_the_tolerance_connects(tokenizer: Any) -> None:
    # A shared bf16 engine scores the probe's two calls in different batches (0.127 nats
    # measured): not another model.
    server = ScriptedServer(tokenizer)
    server.text_noise = [0.127]
    b = backend(server, tokenizer)
    await b.connect()
    assert b.connected


async def test_probe_noise_is_retried_then_unavailable_never_fatal(tokenizer: Any) -> None:
    server = ScriptedServer(tokenizer)
    server.text_noise = [3.0, 0.1]  # apart once, then within the tolerance
    b = backend(server, tokenizer)
    await b.connect()
    assert b.connected and server.paths.count("/v1/completions") == 4
    server.text_noise = [3.0, 3.0, 3.0]
    server.paths.clear()
    with pytest.raises(EngineUnavailable, match=r"differ by 3 nats .* in 3 attempts") as raised:
        await b.connect()
    assert "RAG_REORDER_ENGINE_PROBE_TOLERANCE (0.5)" in raised.value.message
    assert server.paths.count("/v1/completions") == 6 and not b.connected
    # A tighter tolerance is the operator's to choose.
    server.text_noise = [0.127] * 3
    with pytest.raises(EngineUnavailable, match=r"differ by 0\.127"):
        await backend(server, tokenizer, probe_tolerance=0.05).connect()


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("/v1/models", 401, r"refused the credentials \(HTTP 401.*RAG_REORDER_ENGINE_API_KEY"),
        ("/v1/models", 403, r"refused the credentials \(HTTP 403"),
        ("/v1/models", 404, r"answered /v1/models with HTTP 404"),
        ("/v1/models", 500, r"answered /v1/models with HTTP 500"),
        ("/v1/models", 502, r"HTTP 502"),
        ("/v1/models", 503, r"HTTP 503"),
        ("/tokenize", 500, r"answered /tokenize with HTTP 500"),
        ("/tokenize", 401, r"refused the credentials \(HTTP 401 to /tokenize"),
        ("/v1/completions", 500, r"answered /v1/completions with HTTP 500"),
        ("/v1/completions", 403, r"refused the credentials"),
    ],
)
async def test_a_refusal_at_connect_is_unavailable_not_a_mismatch(
    tokenizer: Any, path: str, status: int, message: str
) -> None:
    # A rotated key or a gateway during a rollout: retry later, do not refuse to start.
    server = ScriptedServer(tokenizer)
    server.status[path] = status
    b = backend(server, tokenizer)
    with pytest.raises(EngineUnavailable, match=message) as raised:
        await b.connect()
    assert "engine:8000" not in raised.value.message
    assert not b.connected
    del server.status[path]
    await b.connect()
    assert b.connected


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (
            httpx.Response(200, text="<html>Sign in</html>", headers={"content-type": "text/html"}),
            r"not a JSON object \(content-type text/html\)",
        ),
        (httpx.Response(200, json=["smol"]), "not a JSON object"),
        (httpx.Response(200, json={"data": "smol"}), "without a list of models"),
    ],
)
async def test_models_answered_with_something_else_than_a_list_is_unavailable(
    tokenizer: Any, answer: httpx.Response, message: str
) -> None:
    b = backend(lambda request: answer, tokenizer)
    with pytest.raises(EngineUnavailable, match=message):
        await b.connect()


async def test_an_engine_at_fault_at_run_time_raises_a_refused_prompt_fails_alone(
    tokenizer: Any,
) -> None:
    server = ScriptedServer(tokenizer)
    b = backend(server, tokenizer)
    await b.connect()
    reqs = [SpanRequest("a", tuple(range(10, 30)), 3, 8)]
    for status in (500, 502, 401, 403):
        server.status["/v1/completions"] = status
        with pytest.raises(EngineUnavailable):
            await b.score(reqs)
    # A prompt the engine refuses is that prompt's failure (the caller degrades, not fails).
    server.status["/v1/completions"] = 400
    (result,) = await b.score(reqs)
    assert isinstance(result, PromptFailure) and "scripted refusal" in result.reason
    gen = await b.generate([GenerationRequest("g", tuple(range(10, 30)), 3)])
    assert isinstance(gen[0], PromptFailure)
    server.status["/v1/completions"] = 503
    with pytest.raises(EngineUnavailable):
        await b.generate([GenerationRequest("g", tuple(range(10, 30)), 3)])


async def test_a_non_json_completion_answer_is_unavailable(tokenizer: Any) -> None:
    server = ScriptedServer(tokenizer)
    html = False

    def maybe_html(request: httpx.Request) -> httpx.Response:
        if html:
            return httpx.Response(200, text="<html>", headers={"content-type": "text/html"})
        return server(request)

    b = backend(maybe_html, tokenizer)
    await b.connect()
    html = True
    with pytest.raises(EngineUnavailable, match="not a JSON object"):
        await b.score([SpanRequest("a", tuple(range(10, 30)), 3, 8)])


async def test_every_connect_checks_again_and_notes_changed_weights(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = ScriptedServer(tokenizer)
    b = backend(server, tokenizer)
    await b.connect()
    assert b.max_model_len == 512 and not b.weights_changed_at_reconnect
    # Found down: no scores until the engine is checked again (it may be another deployment).
    b.mark_down("connection refused")
    assert not b.connected
    with pytest.raises(EngineUnavailable, match="found down \\(connection refused\\)"):
        await b.score([SpanRequest("a", (1, 2, 3), 1, 3)])
    # Redeployed with a smaller context and other weights under the same name.
    server.context = 256
    server.shift = 1.0
    server.paths.clear()
    await b.connect()
    assert server.paths[:2] == ["/v1/models", "/tokenize"]
    assert b.connected and b.max_model_len == 256
    assert b.weights_changed_at_reconnect
    assert "the engine's weights changed under the same name" in caplog.text
    with pytest.raises(LimitExceeded, match="over the limit of 255"):
        await b.score([SpanRequest("long", tuple(range(1, 300)), 1, 299)])
    # A connect that finds the same weights again clears it; one that fails disconnects.
    server.paths.clear()
    await b.connect()
    assert server.paths and not b.weights_changed_at_reconnect
    server.tokenize_extra.append(5)
    with pytest.raises(EngineMismatch):
        await b.connect()
    assert not b.connected
    with pytest.raises(EngineUnavailable, match="failed its last check"):
        await b.score([SpanRequest("a", (1, 2, 3), 1, 3)])


async def test_generation_caps_each_prompt_at_its_own_room(tokenizer: Any) -> None:
    # A long prompt near the context's end must not cut its batch-mates' answers short.
    server = ScriptedServer(tokenizer, context=64)
    b = backend(server, tokenizer)
    await b.connect()
    server.bodies.clear()
    short = GenerationRequest("short", tuple(range(10, 30)), 4)
    long = GenerationRequest("long", tuple(range(1, 62)), 4)
    out = await b.generate([short, long, short])
    assert [len(g.token_ids) for g in out if isinstance(g, Generation)] == [4, 3, 4]
    gen = {body["max_tokens"]: len(body["prompt"]) for body in server.bodies}
    assert gen == {4: 2, 3: 1}


async def test_credentials_in_the_engine_url_stay_out_of_messages(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = ScriptedServer(tokenizer, served="other-model")
    url = "http://user:s3cret@engine:8000"
    b = backend(server, tokenizer, url=url, served_model="smol")
    with pytest.raises(EngineMismatch, match=r"http://\*\*\*@engine:8000 serves") as raised:
        await b.connect()
    assert "s3cret" not in raised.value.message
    server.served = "smol"
    server.status["/tokenize"] = 500
    with pytest.raises(EngineUnavailable) as unavailable:
        await b.connect()
    assert "engine:8000" not in unavailable.value.message
    del server.status["/tokenize"]
    await b.connect()
    assert "s3cret" not in caplog.text and "***@engine:8000" in caplog.text


async def test_the_prompt_contract_of_every_backend(tokenizer: Any) -> None:
    server = ScriptedServer(tokenizer, context=64)
    b = backend(server, tokenizer)
    await b.connect()
    # vLLM keeps one token of the context for the one it must generate.
    limits = Limits(prompt=63, generation=63, scored=63, vocab=b._vocab_size)
    await check_contract(b.score, b.generate, limits, sent=lambda: len(server.bodies))
