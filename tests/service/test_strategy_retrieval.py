"""``bm25`` and ``dense``: scores checked against the formula by hand and against a toy set;
placement of their rankings (and every ranker's) by the request's ``placement``."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from service.backends.fakes.fake import FakeBackend
from service.config.settings import Settings
from service.errors import InvalidRequest, UnidentifiableRequest
from service.passage import Passage
from service.pipeline import Reorderer, ReorderRequest
from service.state.profile_store import ProfileStore
from service.strategies.retrieval import bm25_scores, cosine_scores

DOCS = ["the cat sat on the mat", "dogs chase cats", "the stock market fell today"]


def test_bm25_matches_the_lucene_formula_by_hand() -> None:
    """Query "cat on a mat": stop words (on, a) go; "cat" and "mat" occur once, in doc 0 only.

    N = 3, df = 1: idf = ln(1 + (3 - 1 + 0.5) / (1 + 0.5)) = ln(8/3) = 0.98083.
    Lengths after stop words: 3 (cat sat mat), 3 (dogs chase cats), 4: avgdl = 10/3.
    tf = 1 in a 3-token doc: 1 / (1 + 1.5 (0.25 + 0.75 * 3 / (10/3))) = 1 / 2.3875.
    Doc 0: 2 * 0.98083 / 2.3875 = 0.82164; docs 1 and 2 share no term ("cats" != "cat"): 0.
    """
    idf = math.log(1 + 2.5 / 1.5)
    tf_part = 1 / (1 + 1.5 * (1 - 0.75 + 0.75 * 3 / (10 / 3)))
    got = bm25_scores("cat on a mat", DOCS)
    assert got == pytest.approx([2 * idf * tf_part, 0.0, 0.0], rel=1e-6)
    assert got[0] == pytest.approx(0.82164, abs=1e-5)
    # Length normalisation: "cats" (doc 1, 3 tokens) and "stock" (doc 2, 4 tokens) have the
    # same idf; the shorter document scores higher: 1 / (1 + 1.5 (0.25 + 0.75 * 4 / (10/3))).
    s = bm25_scores("stock cats", DOCS)
    assert s[1] == pytest.approx(idf * tf_part, rel=1e-6) and s[0] == 0.0
    assert s[2] == pytest.approx(idf / (1 + 1.5 * (0.25 + 0.75 * 4 / (10 / 3))), rel=1e-6)
    # No known query term, or only stop words: every document scores 0.
    assert list(bm25_scores("zebra", DOCS)) == [0.0, 0.0, 0.0]
    assert list(bm25_scores("the of a", DOCS)) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "docs", [["a b", "c d"], ["the of", "and a"], ["x", "y"], ["\U0001f600", "\U0001f389"]]
)
def test_bm25_scores_zeros_when_no_passage_has_an_indexable_token(docs: list[str]) -> None:
    # bm25s cannot index an empty vocabulary (it raised "max() arg is an empty sequence").
    assert bm25_scores("what is the river", docs).tolist() == [0.0] * len(docs)
    # One indexable passage among them still scores.
    assert bm25_scores("river", [*docs, "river flows"])[-1] > 0


def test_dense_ranks_a_toy_set_by_meaning() -> None:
    """all-MiniLM-L6-v2 from the vendored wheel: paraphrases beat unrelated text, with no
    word in common with the query ("feline" vs "cat")."""
    docs = [
        "Stock prices dropped sharply on Wall Street.",
        "A feline was resting on the rug.",
        "Paris is the capital of France.",
    ]
    s = cosine_scores("Where did the cat sleep?", docs)
    assert int(np.argmax(s)) == 1 and s.shape == (3,)
    assert all(-1.0 <= v <= 1.0 for v in s)
    # Unit-norm embeddings: a text is its own nearest neighbour at cosine 1.
    assert cosine_scores(docs[2], docs)[2] == pytest.approx(1.0, abs=1e-5)


# --- placement of any ranking through the pipeline -------------------------------------------


def _reorderer(tmp_path: Path, **settings: object) -> Reorderer:
    backend = FakeBackend({})
    s = Settings(cache_dir=tmp_path, **settings)  # type: ignore[arg-type]
    return Reorderer(backend, s, ProfileStore(tmp_path / "profiles"))


PASSAGES = [
    Passage(text="the cat sat on the mat"),  # BM25 for "cat mat": best
    Passage(text="a mat for sale"),  # one term: second
    Passage(text="stock market news"),  # none: tied at 0, input order
    Passage(text="weather report"),
]
QUERY = "cat mat"


def _store_profile(r: Reorderer, model: str, coef: list[float]) -> str:
    return r.profiles.put(
        model=model,
        template=r.settings.chat_template,
        coefficients=coef,
        identification="full",
        runs=1,
        prompts=1,
        r2=1.0,
        source="test",
    ).id


async def test_bm25_placements_by_hand(tmp_path: Path) -> None:
    r = _reorderer(tmp_path)
    plain = await r.reorder(ReorderRequest(QUERY, PASSAGES, strategy="bm25"))
    assert plain.ranking == plain.order == [0, 1, 2, 3] and plain.placement is None
    assert plain.usage.prompts_scored == 0 and plain.score_name == "bm25"
    litm = await r.reorder(ReorderRequest(QUERY, PASSAGES, strategy="bm25", placement="litm"))
    assert litm.ranking == [0, 1, 2, 3] and litm.order == [0, 2, 3, 1]
    assert litm.placement == "litm"
    # The generator's profile (another model than the scorer): recency, slot 3 strongest,
    # then 0, 2, 1. Ranks 0..3 -> slots 3, 0, 2, 1: order [1, 3, 2, 0].
    pid = _store_profile(r, "big/generator", [0.3, 0.1, 0.2, 0.4])
    placed = await r.reorder(
        ReorderRequest(QUERY, PASSAGES, strategy="bm25", placement="bias_matched", bias_profile=pid)
    )
    assert placed.order == [1, 3, 2, 0] and placed.placement == "bias_matched"
    assert placed.details["placement_profile"] == pid


async def test_bias_matched_falls_back_to_the_setting_then_the_scorers_profile(
    tmp_path: Path,
) -> None:
    r = _reorderer(tmp_path)
    req = ReorderRequest(QUERY, PASSAGES, strategy="retriever", placement="bias_matched")
    with pytest.raises(UnidentifiableRequest) as exc:
        await r.reorder(req)
    assert exc.value.param == "bias_profile" and "calibrate" in exc.value.message
    # The scoring model's own stored profile, 2 slots resampled to 4: [.8, .2] is primacy,
    # so the ranking stays in place.
    _store_profile(r, r.backend.model_id, [0.8, 0.2])
    assert (await r.reorder(req)).order == [0, 1, 2, 3]
    # The setting names the generator's profile: it wins over the scorer's.
    gen = _store_profile(r, "big/generator", [0.1, 0.2, 0.3, 0.4])
    r2 = _reorderer(tmp_path, placement_profile=gen)
    out = await r2.reorder(req)
    assert out.order == [3, 2, 1, 0] and out.details["placement_profile"] == gen


async def test_placement_errors_name_the_parameter_and_the_known_values(tmp_path: Path) -> None:
    r = _reorderer(tmp_path)
    pid = _store_profile(r, "big/generator", [0.5, 0.5])
    with pytest.raises(InvalidRequest) as exc:
        await r.reorder(
            ReorderRequest(
                QUERY, PASSAGES, strategy="bm25", placement="bias_matched", bias_profile="nope"
            )
        )
    assert exc.value.param == "bias_profile"
    assert "'nope'" in exc.value.message and pid in exc.value.message
    with pytest.raises(InvalidRequest) as exc:
        await r.reorder(ReorderRequest(QUERY, PASSAGES, strategy="bm25", bias_profile=pid))
    assert exc.value.param == "bias_profile"
    for name in ("shuffle", "inverse", "litm"):
        with pytest.raises(InvalidRequest) as exc:
            await r.reorder(ReorderRequest(QUERY, PASSAGES, strategy=name, placement="litm"))
        assert exc.value.param == "placement" and "bm25" in exc.value.message
