"""``auto``'s randomized holdout and outcome feedback through the real app (issue 92,
docs/outcomes.md): arms the server draws whatever the caller sends, the outcome reported on a
server-made ``feedback_id`` by the caller served only, once, in [0, 1], the uplift in
``/info`` and ``/metrics``, and ``outcome_policy`` ``act`` switching a key to the retriever's
order and back. ``auto`` places by an operator's named profile here (the ``profile`` path,
no model call), so every request is on a placed path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from service.state.profile_store import ProfileStore, StoredProfile
from tests.app.conftest import PASSAGES, QUERY, TRUTH, Harness, serving

N = len(PASSAGES)
# The retriever's order: by the caller's scores, best first.
RETRIEVER = sorted(range(N), key=lambda i: -TRUTH[PASSAGES[i]])


def _profile(folder: Path) -> StoredProfile:
    """A generator's 4-slot recency profile (the placement differs from the input order)."""
    return ProfileStore(folder).put(
        model="big/generator",
        template="qa_default",
        coefficients=[0.1, 0.2, 0.3, 0.4],
        identification="full",
        runs=1,
        prompts=4,
        r2=1.0,
        source="test",
    )


def _settings(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    prof = _profile(tmp_path / "profiles")
    return {
        "bias_profile_dir": tmp_path / "profiles",
        "placement_profile": prof.id,
        "generator_model": "answering-generator",
        "feedback_max_requests": 1000,
        "auto_caller_header": "X-Tenant",
        **extra,
    }


def body(**extra: Any) -> dict[str, Any]:
    scores = {p: 10.0 + TRUTH[p] for p in PASSAGES}
    return {
        "query": QUERY,
        "passages": [{"text": p, "score": scores[p]} for p in PASSAGES],
        **extra,
    }


async def serve(h: Harness, tenant: str = "a", **extra: Any) -> dict[str, Any]:
    r = await h.client.post(
        "/v1/reorder", json=body(**extra), headers={"X-Tenant": tenant, "X-Request-Id": "fixed"}
    )
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


async def report(h: Harness, token: str, outcome: Any, tenant: str = "a") -> httpx.Response:
    return await h.client.post(
        "/v1/feedback", json={"id": token, "outcome": outcome}, headers={"X-Tenant": tenant}
    )


async def test_arms_are_drawn_by_the_server_whatever_the_request_id(tmp_path: Path) -> None:
    """The same body, the same X-Request-Id and caller, 40 times: both arms come (all one arm
    has chance 2 * 0.5**40). The holdout serves the retriever's order and says so; an exempt
    request is always placed and in no arm."""
    async with serving(tmp_path, **_settings(tmp_path, holdout_rate=0.5)) as h:
        seen = []
        for _ in range(40):
            r = await serve(h)
            auto = r["auto"]
            seen.append(auto["arm"])
            if auto["arm"] == "holdout":
                assert auto["path"] == "holdout" and r["order"] == RETRIEVER
                assert "randomized holdout" in auto["reason"] and auto["ranker"] == "retriever"
            else:
                assert auto["path"] == "profile" and auto["arm"] == "placed"
            assert r["id"] == "fixed" and len(r["feedback_id"]) >= 24
        assert {"placed", "holdout"} == set(seen), seen
        assert len({(await serve(h))["feedback_id"] for _ in range(5)}) == 5
        for _ in range(10):
            auto = (await serve(h, holdout=False))["auto"]
            assert (auto["path"], auto["arm"]) == ("profile", None)
        info = (await h.client.get("/info")).json()["auto"]["outcomes"]
        assert info["holdout_rate"] == 0.5 and info["policy"] == "report"
        assert h.metric("rag_reorder_holdout_draws_total", {"arm": "exempt"}) == 10
    # The rate at 0: nothing changes (no arm, the placement every time, no outcomes section).
    async with serving(tmp_path, **_settings(tmp_path, holdout_rate=0.0)) as h:
        for _ in range(10):
            auto = (await serve(h))["auto"]
            assert (auto["path"], auto["arm"]) == ("profile", None)
        assert (await h.client.get("/info")).json()["auto"]["outcomes"] is None


async def test_outcomes_are_counted_once_by_the_caller_served_and_bad_ones_refused(
    tmp_path: Path,
) -> None:
    async with serving(tmp_path, **_settings(tmp_path, holdout_rate=0.5)) as h:
        first = await serve(h, "a")
        token = first["feedback_id"]
        # Another caller naming the token: unknown under its name (404), nothing counted.
        stolen = await report(h, token, 1.0, tenant="b")
        assert stolen.status_code == 404 and stolen.json()["error"]["param"] == "id"
        # Out of range, not a number, nothing to report: 422 naming the field.
        for bad in (1.5, -0.1, "yes"):
            r = await report(h, token, bad)
            assert r.status_code == 422 and "outcome" in r.text, (bad, r.text)
        r = await h.client.post("/v1/feedback", json={"id": token}, headers={"X-Tenant": "a"})
        assert r.status_code == 422 and "send an `outcome`" in r.text
        # The caller's own X-Request-Id is no token.
        assert (await report(h, "fixed", 1.0)).status_code == 404
        # A boolean is 1 or 0; counted in its arm.
        ok = await report(h, token, True)
        assert ok.status_code == 200, ok.text
        out = ok.json()["outcome"]
        assert out["counted"] is True and out["arm"] == first["auto"]["arm"]
        assert sum(out["uplift"]["outcomes"].values()) == 1
        assert out["uplift"]["verdict"] == "not_enough" and out["uplift"]["needed"] >= 1
        # A second report on the same id: 409, whatever it says.
        again = await report(h, token, 0.0)
        assert again.status_code == 409 and again.json()["error"]["code"] == "already_reported"
        # An unknown id: 404.
        assert (await report(h, "x" * 24, 1.0)).status_code == 404
        # A request not in the experiment (exempt): reported, not counted.
        exempt = await serve(h, holdout=False)
        r = await report(h, exempt["feedback_id"], 1.0)
        assert r.status_code == 200 and r.json()["outcome"]["counted"] is False
        [key] = (await h.client.get("/info")).json()["auto"]["outcomes"]["keys"]
        assert key["key"].endswith(f"|{N}") and sum(key["outcomes"].values()) == 1
        arm = {"key": key["key"], "arm": first["auto"]["arm"]}
        assert h.metric("rag_reorder_outcomes", arm) == 1


async def test_act_switches_a_key_to_the_retrievers_order_and_back(tmp_path: Path) -> None:
    """Outcomes that say the placement hurts (placed 0, holdout 1): with ``act`` the key is
    served the retriever's order but for the kept placed share; outcomes that then say it
    helps (placed 1, holdout 0) bring the placement back. Each switch shows in the response,
    ``/info`` and the metrics."""
    settings = _settings(tmp_path, holdout_rate=0.5, outcome_policy="act", outcome_placed_share=0.5)
    async with serving(tmp_path, **settings) as h:

        async def until(path: str, placed: float, held: float) -> dict[str, Any]:
            for _ in range(400):
                r = await serve(h)
                auto = r["auto"]
                act = "outcome_policy act" in auto["reason"]
                if auto["path"] == path and (path == "pass_through" or not act):
                    return r
                outcome = placed if auto["arm"] == "placed" else held
                assert (await report(h, r["feedback_id"], outcome)).status_code == 200
            raise AssertionError(f"never switched to {path}")

        passed = await until("pass_through", placed=0.0, held=1.0)
        auto = passed["auto"]
        assert passed["order"] == RETRIEVER and "outcome_policy act" in auto["reason"]
        assert "hurts" in auto["reason"] and auto["ranker"] == "retriever"
        [key] = (await h.client.get("/info")).json()["auto"]["outcomes"]["keys"]
        assert key["verdict"] == "hurts" and key["pass_through"] and key["upper"] < 0
        assert h.metric("rag_reorder_outcome_pass_through", {"key": key["key"]}) == 1
        # The placed share is kept: the placement is still served, and measured.
        kept = [(await serve(h))["auto"] for _ in range(30)]
        assert {a["arm"] for a in kept} == {"placed", "holdout"}
        placed = next(a for a in kept if a["arm"] == "placed")
        assert placed["path"] == "profile" and "placed share kept" in placed["reason"]
        back = await until("profile", placed=1.0, held=0.0)
        assert back["auto"]["arm"] == "placed"
        [key] = (await h.client.get("/info")).json()["auto"]["outcomes"]["keys"]
        assert not key["pass_through"] and key["verdict"] != "hurts"
        assert h.metric("rag_reorder_outcome_pass_through", {"key": key["key"]}) == 0
        assert h.metric("rag_reorder_outcome_policy_switches_total") == 2


async def test_a_holdout_shuffle_with_its_answer_feeds_the_generators_profile(
    tmp_path: Path,
) -> None:
    """Item 5: with ``holdout_order`` ``shuffle`` the holdout is a uniformly random placement
    the server drew, so the answer sent with its outcome is pooled into the generator's
    label-free profile (``used``), attributed to the slot it was served in; a placed request's
    answer is not (its order came from the passages' scores)."""
    settings = _settings(tmp_path, holdout_rate=0.5, holdout_order="shuffle")
    async with serving(tmp_path, **settings) as h:
        used = {"placed": 0, "holdout": 0}
        for _ in range(60):
            r = await serve(h)
            arm = r["auto"]["arm"]
            first = r["order"][0]
            fb = await h.client.post(
                "/v1/feedback",
                json={"id": r["feedback_id"], "outcome": 1.0, "answer": PASSAGES[first]},
                headers={"X-Tenant": "a"},
            )
            assert fb.status_code == 200, fb.text
            out = fb.json()
            assert out["outcome"]["counted"] is True and out["outcome"]["arm"] == arm
            if out["used"]:
                assert arm == "holdout" and out["slots"] == [0]
                used[arm] += 1
            else:
                assert arm == "placed" and "not a random placement" in out["reason"]
        assert used["holdout"] > 0
        info = (await h.client.get("/info")).json()["auto"]["generator_online"]
        assert info["feedback"]["used"] == used["holdout"]


async def test_outcomes_need_no_generator_name_when_the_scorer_answers(tmp_path: Path) -> None:
    """The embedded default (the scoring model is the generator) measures its uplift with
    feedback on alone: before, the settings refused RAG_REORDER_FEEDBACK_MAX_REQUESTS without
    another model named as the generator, so a team had to invent one. Outcomes are counted;
    an answer is not learned from (the scorer's log-probs are its profile) and says why; a
    holdout's shuffle keeps no query or passages; auto places by the scorer's side, never by
    a generator profile of its own name."""
    settings = {**_settings(tmp_path, holdout_rate=0.5, holdout_order="shuffle")}
    del settings["generator_model"]
    async with serving(tmp_path, **settings) as h:
        sampler = h.ctx.engine.learner.generator
        assert sampler is not None and not sampler.learns_answers
        arms: dict[str, list[str]] = {"placed": [], "holdout": []}
        for _ in range(40):
            r = await serve(h)
            arms[r["auto"]["arm"]].append(r["feedback_id"])
            assert r["auto"]["path"] in ("profile", "holdout")
        assert arms["placed"] and arms["holdout"], arms
        for arm, tokens in arms.items():
            r = await h.client.post(
                "/v1/feedback",
                json={"id": tokens[0], "outcome": True, "answer": "Paris"},
                headers={"X-Tenant": "a"},
            )
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["outcome"]["counted"] and out["outcome"]["arm"] == arm
            assert not out["used"] and "scoring model is the generator" in out["reason"]
        # Nothing of a request's content is kept: a holdout shuffle's record has no passages.
        for token in arms["holdout"][1:]:
            kept = await sampler.served.get(token, "header:a")
            assert kept is not None and kept.strategy == "shuffle", kept
            assert (kept.query, kept.shown) == ("", ()), kept
        info = (await h.client.get("/info")).json()["auto"]
        assert info["scorer_is_generator"] and info["outcomes"]["keys"][0]["outcomes"] == {
            "placed": 1,
            "holdout": 1,
            "pass_through": 0,
        }
        assert sampler.counters.feedback["used"] == 0
