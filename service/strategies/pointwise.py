"""Pointwise baselines of the MoI paper (Table 1, section 4.1): ``query_generation``,
``bayes_saliency``, ``longllmlingua``.

Each scores one prompt per passage, built with the request's scoring template showing that
passage alone (order ``[i]``), and reads the query's per-token log-probs
``log P(q_l | p, q_<l)`` (``Work.score_prompts``). The passage's utility ``u_p`` is a function of
those alone (plus, for Bayes saliency, the passage's own tokens in the same prompt); no passage
sees another, so no position bias enters and none is measured. That is what the MoI paper argues
against: pointwise scores cannot see how passages work together or where they sit.

Shared rules:

- order = ranking = passages by descending ``u_p``, ties by retriever order
  (``retriever_ranking``); ``scores`` are the ``u_p``.
- A failed prompt leaves its passage without a score: NaN, ranked after every scored passage
  (by retriever order among themselves), with a warning. All failed: ``ScoringFailed``.
- Passages with identical text give identical prompts, scored once.

Cost: N scored prompts of one passage each; no generation. No option applies.
"""

from __future__ import annotations

import numpy as np

from service.config.settings import Settings
from service.strategies.protocol import Reference
from service.strategies.request import (
    Calls,
    Cost,
    Outcome,
    PromptScore,
    ReorderRequest,
    descending,
    need_scores,
    retriever_ranking,
)
from service.strategies.work import Work


class _Pointwise:
    options: frozenset[str] = frozenset()
    uses_design = False
    ranks = True
    score_name: str
    joint = False
    """Also score the passage's own tokens (``PromptScore.passages``)."""

    def cost(self, request: ReorderRequest, settings: Settings) -> Cost:
        return Cost((Calls(len(request.passages), 1),))

    def utility(self, score: PromptScore) -> float:
        raise NotImplementedError

    async def run(self, work: Work, request: ReorderRequest) -> Outcome:
        passages = request.passages
        n = len(passages)
        prompts = await work.scoring_prompts(request.query, passages, [(i,) for i in range(n)])
        scored = await work.score_prompts(prompts, joint=self.joint)
        need_scores(scored, "passage prompts")
        u = np.asarray([np.nan if s is None else self.utility(s) for s in scored], dtype=np.float64)
        ranking = descending(u, retriever_ranking(passages))
        missing = sum(s is None for s in scored)
        warnings = (
            (f"{missing} of {n} passage prompts failed to score; those passages are ranked last",)
            if missing
            else ()
        )
        return Outcome(
            order=list(ranking),
            ranking=ranking,
            score_name=self.score_name,
            scores=u,
            warnings=warnings,
        )


class QueryGeneration(_Pointwise):
    """``query_generation`` (QG; Sachan et al., the MoI paper section 4.1):
    ``u_p = log P(q | p)``, the sum of the query tokens' log-probs given the passage alone.

    The sum, not a per-token mean: the query's tokens are the same in every prompt, so both rank
    alike, and the sum is the log of the paper's ``P(q | p)``. ``score_name="log_p_query"``.
    """

    name = "query_generation"
    reference = Reference(
        source="MoI paper, Table 1",
        rule="descending log P(q | p), each passage alone",
        calls="N scored prompts of 1 passage",
        returns="`passages[].score`",
    )
    score_name = "log_p_query"

    def utility(self, score: PromptScore) -> float:
        return float(score.query.sum())


class BayesSaliency(_Pointwise):
    """``bayes_saliency`` (Merth et al., the MoI paper eq. 1): ``u_p = log P(q | p) + log P(p)``.

    ``log P(p)`` is the sum of the log-probs of the passage text's own tokens in the same prompt
    (``joint`` scoring), so it is conditioned on what precedes it there: the chat template, the
    instruction and the document header. As in the paper it is a total, not a per-token mean:
    a longer passage has a lower ``log P(p)`` (a length penalty the paper's definition carries).
    The document header (title, "Document [1]") is not part of the passage: its tokens count
    in neither term. ``score_name="bayes_saliency"``.
    """

    name = "bayes_saliency"
    reference = Reference(
        source="MoI paper, Eq. 1",
        rule="descending log P(q | p) + log P(p)",
        calls="N scored prompts of 1 passage (its tokens scored too)",
        returns="`passages[].score`",
    )
    score_name = "bayes_saliency"
    joint = True

    def utility(self, score: PromptScore) -> float:
        return float(score.query.sum()) + score.passages


class LongLLMLingua(_Pointwise):
    """``longllmlingua`` as the MoI paper writes it (section 4.1)::

        u_p = sum_l P(q_l | p, q_<l) log P(q_l | p, q_<l)

    over the query tokens, ranked by descending ``u_p``. ``score_name="longllmlingua"``.

    How this relates to LongLLMLingua itself (Jiang et al. 2023): its document-level
    (coarse-grained) score is the question's perplexity given the document, ``r_k = -(1/N_c)
    sum_i log p(x_i | x_doc_k)`` over the question plus the restrictive statement "We can get the
    answer to this question in the given documents.", and its released code ranks documents by
    ascending ``r_k``: lowest question perplexity first, i.e. QG per token. Its *contrastive*
    perplexity, ``ppl(x_i | x_<i) - ppl(x_i | x_que, x_<i)``, scores the context's tokens for
    the fine-grained token-level compression, not documents, and is not used here. The MoI paper's
    formula weights each token's log-prob by its probability and drops the restrictive
    statement; it is implemented exactly as written.

    Direction: ``P log P`` is not monotone in ``P``. It is 0 at P = 0 and at P = 1 and lowest
    (-1/e) at P = 1/e, so a higher ``u_p`` means the query tokens are *either* very likely or
    very unlikely given the passage. Where the query's tokens mostly have P < 1/e (log-prob
    below -1 nat, common for questions), a passage that makes the query more likely *lowers*
    ``u_p``, and this baseline can rank close to the reverse of QG; where they mostly have
    P > 1/e it ranks like QG. That is a property of the published formula, kept on purpose.
    """

    name = "longllmlingua"
    reference = Reference(
        source="MoI paper, Table 1",
        rule="descending sum_l P(q_l | p, q_<l) log P(q_l | p, q_<l)",
        calls="N scored prompts of 1 passage",
        returns="`passages[].score`",
    )
    score_name = "longllmlingua"

    def utility(self, score: PromptScore) -> float:
        return float(np.sum(np.exp(score.query) * score.query))
