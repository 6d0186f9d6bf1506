"""Start-up, warm-up, canary and watchdog, shutdown: what /health and /ready report."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from app.main import create_app
from service.backends.engines.score_mode_check import ScoreModeCheck
from service.backends.tokenizers.byte_tokenizer import ByteTokenizer
from service.config.settings import Settings
from service.errors import BackendUnavailable
from serving import supervisor
from tests.app.conftest import TRUTH, TrackingBackend, serving, wait_until


async def test_warm_up_scores_once_before_ready_and_shutdown_closes_the_backend(
    tmp_path: Path,
) -> None:
    backend = TrackingBackend(TRUTH)
    async with serving(tmp_path, backend=backend) as h:
        assert backend.started == 1 and backend.request_ids[0].startswith("warmup-")
        assert h.ctx.lifecycle.phase == "ready" and h.ctx.lifecycle.last_success is not None
        assert not backend.closed
    assert backend.closed


@pytest.mark.parametrize("template", ["qa_completion", "qa_default"])
async def test_warm_up_finds_a_completion_templates_line_breaks(
    tmp_path: Path, template: str
) -> None:
    backend = TrackingBackend(TRUTH)
    asked: list[int] = []

    class Counting(ByteTokenizer):
        @property
        def line_break_ids(self) -> frozenset[int]:
            asked.append(1)
            return super().line_break_ids

    backend._tokenizer = Counting()
    async with serving(tmp_path, backend=backend, chat_template=template):
        # Looked up once before ready when answers stop at line breaks, else never.
        assert len(asked) == (1 if template == "qa_completion" else 0)


async def test_warm_up_refuses_a_default_strategy_that_cannot_run(tmp_path: Path) -> None:
    # bm25 placed bias_matched with no generator profile stored or named: every request that
    # names no strategy would be a 422, so the service does not become ready.
    backend = TrackingBackend(TRUTH)
    async with serving(tmp_path, backend=backend, strategy="bm25", ready=False) as h:
        await wait_until(lambda: h.ctx.lifecycle.fatal is not None)
        fatal = str(h.ctx.lifecycle.fatal)
        assert "warm-up failed: the default 'bm25' request is refused" in fatal
        assert "position-bias profile" in fatal and "bias_profile" in fatal
        assert (await h.client.get("/ready")).status_code == 503
    # Placed by litm it needs no profile: ready, after MoI's probe and bm25's (no model call).
    fresh = TrackingBackend(TRUTH)
    async with serving(tmp_path, backend=fresh, strategy="bm25", placement="litm") as h:
        assert h.ctx.lifecycle.phase == "ready"


async def test_without_warm_up_ready_follows_the_load(tmp_path: Path) -> None:
    backend = TrackingBackend(TRUTH)
    async with serving(tmp_path, backend=backend, warmup=False):
        assert backend.started == 0


async def test_failed_warm_up_is_fatal(tmp_path: Path) -> None:
    backend = TrackingBackend(TRUTH, fail_rule=lambda p: True)
    async with serving(tmp_path, backend=backend, ready=False) as h:
        await wait_until(lambda: h.ctx.lifecycle.fatal is not None)
        assert "warm-up failed" in str(h.ctx.lifecycle.fatal)
        assert (await h.client.get("/health")).status_code == 503
        assert (await h.client.get("/ready")).status_code == 503


async def test_failed_model_load_is_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(settings: Settings) -> None:
        raise OSError("no model at /opt/models/missing")

    monkeypatch.setattr(supervisor, "create_backend", broken)
    fatal: list[str] = []
    application = create_app(Settings(cache_dir=tmp_path))
    application.state.ctx.lifecycle.on_fatal = fatal.append
    async with application.router.lifespan_context(application):
        # Before the load, size_threads imports torch: seconds in a fresh process (this module
        # run alone), none inside the suite where torch is loaded already.
        await wait_until(lambda: bool(fatal), timeout=60.0)
    assert fatal == ["loading the model failed (OSError)"]  # no path leaks into probes


async def test_canary_failing_repeatedly_fails_liveness(tmp_path: Path) -> None:
    async with serving(tmp_path, canary_interval_s=0.02, canary_failures_fatal=3) as h:
        assert (await h.client.get("/health")).status_code == 200
        h.backend.fail_rule = lambda p: p.request_id.startswith("canary-")
        await wait_until(lambda: h.ctx.lifecycle.fatal is not None)
        assert h.ctx.lifecycle.canary_failures == 3
        assert h.metric("rag_reorder_canary_failures_total") == 3
        r = await h.client.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "unhealthy"


async def test_one_canary_failure_is_forgiven(tmp_path: Path) -> None:
    async with serving(tmp_path, canary_interval_s=0.02, canary_failures_fatal=3) as h:
        failed = {"n": 0}

        def once(p: object) -> bool:
            rid = getattr(p, "request_id", "")
            if rid.startswith("canary-") and failed["n"] == 0:
                failed["n"] = 1
                return True
            return False

        h.backend.fail_rule = once
        await wait_until(lambda: h.metric("rag_reorder_canary_failures_total") == 1)
        await wait_until(lambda: h.ctx.lifecycle.canary_failures == 0)
        assert h.ctx.lifecycle.alive


async def test_successful_requests_stand_in_for_the_canary(tmp_path: Path) -> None:
    # A 1 s interval and 3.2 s of traffic (three canary ticks): a request may take up to ~1 s
    # before a canary is due. With 0.2 s, one slow request on a loaded CI machine let a canary
    # through (2026-11-27), which says nothing about the rule under test.
    # MoI named: every request must reach the engine (auto stops calling it once it trusts a
    # profile learned from these very requests).
    body = {"query": "q?", "passages": list(TRUTH), "strategy": "moi"}
    async with serving(tmp_path, canary_interval_s=1.0) as h:
        # First-request costs (lazy imports, first forward) paid before counting.
        assert (await h.client.post("/v1/reorder", json=body)).status_code == 200
        calls = h.backend.started
        sent = 0
        end = anyio.current_time() + 3.2
        while anyio.current_time() < end:  # whole requests only: none cut off in flight
            r = await h.client.post("/v1/reorder", json=body)
            assert r.status_code == 200
            sent += 1
            await anyio.sleep(0.02)
        # Each request proved the engine alive: no canary was needed.
        assert sent >= 30
        assert h.backend.started == calls + sent
        assert not any(i.startswith("canary-") for i in h.backend.request_ids)


class CheckedBackend(TrackingBackend):
    """A backend with vLLM's start-up score-mode check, its outcome given."""

    def __init__(self, check: ScoreModeCheck | Exception) -> None:
        super().__init__(TRUTH)
        self.check = check

    async def check_score_mode(self) -> ScoreModeCheck:
        if isinstance(self.check, Exception):
            raise self.check
        return self.check


async def test_a_score_mode_that_fell_back_is_reported_and_served(tmp_path: Path) -> None:
    check = ScoreModeCheck(
        "disagreed", "prompt_logprobs", 0.4, 3.7, "probe-end: token 0 of the span: ..."
    )
    async with serving(tmp_path, backend=CheckedBackend(check)) as h:
        info = (await h.client.get("/info")).json()
        assert info["score_mode"] == {
            "mode": "prompt_logprobs",
            "check": "disagreed",
            "tolerance_nats": 0.4,
            "max_abs_diff_nats": 3.7,
            "detail": "probe-end: token 0 of the span: ...",
        }
        metrics = (await h.client.get("/metrics")).text
        assert 'rag_reorder_score_mode{check="disagreed",mode="prompt_logprobs"} 1.0' in metrics


async def test_token_ids_set_and_disagreeing_fails_the_start(tmp_path: Path) -> None:
    backend = CheckedBackend(BackendUnavailable("score_mode 'token_ids' disagrees ..."))
    async with serving(tmp_path, backend=backend, ready=False) as h:
        await wait_until(lambda: h.ctx.lifecycle.fatal is not None)
        assert "score mode check failed: score_mode 'token_ids' disagrees" in str(
            h.ctx.lifecycle.fatal
        )
        assert (await h.client.get("/ready")).status_code == 503


async def test_engines_without_the_check_report_no_score_mode(tmp_path: Path) -> None:
    async with serving(tmp_path) as h:
        assert (await h.client.get("/info")).json()["score_mode"] is None
