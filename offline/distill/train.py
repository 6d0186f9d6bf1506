"""Training the student: a LoRA adapter fitted to the teacher's permutation preferences.

The one offline module that imports torch, transformers and peft (an import-linter contract
names it beside the transformers backend): it needs gradients, which the serving backend never
computes.

Objective (the MoI paper, Figure 5): for a question with teacher scores ``s`` over K permutations,
each step samples K' of them, scores them with the student (``s~``: the query's log-likelihood
after the passages in that order, built with the student's own tokenizer and template by
``service.prompting.prompts.build_prompts``, the serving prompt builder), and minimises
``KL(softmax(s) || softmax(s~))``. Only differences between permutations of one question
matter (the softmax is shift-invariant), so the student is taught which orders help, not the
query's absolute likelihood. Gradients of ``batch_questions`` questions are accumulated per
AdamW step.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from scipy.stats import kendalltau
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from offline.distill.preferences import Preference, PreferenceMeta
from service.backends.engines.transformers_backend import token_logprobs
from service.backends.tokenizers.hf_tokenizer import HFPromptTokenizer
from service.errors import InvalidRequest
from service.model_assets.adapter import (
    CARD,
    AdapterManifest,
    Agreement,
    model_card,
    write_manifest,
)
from service.prompting.prompts import BuiltPrompt, build_prompts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistillConfig:
    """Hyperparameters; the defaults are the MoI paper's (appendix), K' excepted (unstated)."""

    lora_r: int = 8
    lora_alpha: int = 32
    lora_dropout: float = 0.1
    learning_rate: float = 1e-4
    weight_decay: float = 0.01
    epochs: int = 5
    batch_questions: int = 4
    """Questions per optimiser step (the paper's effective batch size)."""
    permutations_per_step: int = 4
    """K': permutations of a question sampled for each of its steps."""
    seed: int = 0
    device: str = "auto"


def preference_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """``KL(softmax(teacher) || softmax(student))`` over the last axis, averaged over the rest.

    Args:
        student: scores, ``(..., K')``; gradients flow through them.
        teacher: the teacher's scores of the same permutations, same shape.

    Returns:
        A scalar, in nats.
    """
    log_p = torch.log_softmax(teacher.to(student.dtype), dim=-1)
    log_q = torch.log_softmax(student, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1).mean()


class StudentScorer:
    """The student's query log-likelihood of permutations, with gradients when enabled."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: HFPromptTokenizer,
        template: str,
        *,
        batch_tokens: int = 16384,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.template = template
        self.batch_tokens = batch_tokens
        """Padded tokens per forward: a step's prompts share forwards up to this budget."""
        self.device = next(model.parameters()).device
        self.prompt_tokens = 0

    def prompts(self, pref: Preference, orders: Sequence[Sequence[int]]) -> list[BuiltPrompt]:
        return build_prompts(self.tokenizer, self.template, pref.question, pref.passages, orders)

    def scores(self, prompts: Sequence[BuiltPrompt]) -> torch.Tensor:
        """``(len(prompts),)`` query log-likelihoods, the prompts packed into shared forwards.

        One forward per prompt left a GPU idle between small kernels (a step is K' prompts of a
        few hundred tokens), so prompts go in left-padded batches of up to ``batch_tokens``
        padded tokens. Tokens after the query are cut (they cannot change a causal model's
        query log-probs), so every row ends with its query and the LM head runs only on the
        last rows (``logits_to_keep``). Left padding is masked and positions restart at each
        row's first real token, so a row scores as it would alone.
        """
        # Shortest first, so each forward's rows are of similar length (little padding).
        order = sorted(range(len(prompts)), key=lambda i: prompts[i].query_span[1])
        parts: list[torch.Tensor] = []
        batch: list[int] = []
        for i in order:
            rows = len(batch) + 1
            if batch and prompts[i].query_span[1] * rows > self.batch_tokens:
                parts.append(self._forward([prompts[j] for j in batch]))
                batch = []
            batch.append(i)
        if batch:
            parts.append(self._forward([prompts[j] for j in batch]))
        packed = torch.cat(parts)
        # Back to the callers' order.
        where = torch.empty(len(order), dtype=torch.long)
        where[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
        return packed[where.to(packed.device)]

    def _forward(self, prompts: Sequence[BuiltPrompt]) -> torch.Tensor:
        width = max(p.query_span[1] for p in prompts)
        longest_query = max(end - start for start, end in (p.query_span for p in prompts))
        keep = longest_query + 1
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            end = prompt.query_span[1]
            ids[row, width - end :] = torch.tensor(prompt.token_ids[:end], dtype=torch.long)
            mask[row, width - end :] = 1
            self.prompt_tokens += end
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=keep,
        ).logits
        rows: list[torch.Tensor] = []
        for row, prompt in enumerate(prompts):
            start, end = prompt.query_span
            n = end - start
            # The kept logits are positions width-keep .. width-1; position t predicts t + 1,
            # so the query's n tokens (the row's last) are predicted by kept rows keep-1-n ..
            # keep-2.
            rows.append(token_logprobs(logits[row, keep - 1 - n : keep - 1], ids[row, -n:]).sum())
        return torch.stack(rows)


def load_student(
    folder: Path, config: DistillConfig
) -> tuple[PreTrainedModel, HFPromptTokenizer, torch.device]:
    """The student in float32 on the CPU, bfloat16 on CUDA (the paper trained in bf16)."""
    cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, device_map=str(device))
    tokenizer = HFPromptTokenizer(AutoTokenizer.from_pretrained(str(folder)))
    return model, tokenizer, device


def with_lora(model: PreTrainedModel, config: DistillConfig) -> PeftModel:
    """``model`` wrapped with a fresh LoRA adapter (peft's default target modules for its
    architecture: the attention's query and value projections for Llama and Gemma 3)."""
    torch.manual_seed(config.seed)
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, lora)
    if not isinstance(peft_model, PeftModel):
        raise TypeError("peft returned no PeftModel")
    return peft_model


def agreement(scorer: StudentScorer, prefs: Sequence[Preference]) -> Agreement:
    """The student's agreement with the teacher over every permutation of ``prefs``."""
    taus: list[float] = []
    top1: list[float] = []
    kls: list[float] = []
    was_training = scorer.model.training
    scorer.model.train(False)
    try:
        with torch.inference_mode():
            for pref in prefs:
                student = scorer.scores(scorer.prompts(pref, pref.orders)).float().cpu()
                teacher = torch.tensor(pref.scores, dtype=torch.float32)
                tau = kendalltau(student.numpy(), teacher.numpy()).statistic
                taus.append(float(tau) if math.isfinite(tau) else 0.0)
                top1.append(float(int(student.argmax()) == int(teacher.argmax())))
                kls.append(float(preference_kl(student, teacher)))
    finally:
        scorer.model.train(was_training)
    return Agreement(
        questions=len(prefs),
        kendall_tau=float(np.mean(taus)) if taus else float("nan"),
        top1=float(np.mean(top1)) if top1 else float("nan"),
        kl=float(np.mean(kls)) if kls else float("nan"),
    )


@dataclass(frozen=True)
class TrainResult:
    steps: int
    seconds: float
    prompt_tokens: int
    losses: list[float]
    """Mean KL of each optimiser step's questions, in order."""


def train_steps(
    model: PeftModel,
    scorer: StudentScorer,
    train: Sequence[Preference],
    config: DistillConfig,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> TrainResult:
    """Fit the adapter of ``model`` (module docstring); the base weights stay frozen.

    Raises:
        InvalidRequest: no training question, or K' below 2.
    """
    if not train:
        raise InvalidRequest("no training question", param="preferences")
    if config.permutations_per_step < 2:
        raise InvalidRequest(
            "permutations per step must be at least 2", param="permutations_per_step"
        )
    rng = np.random.default_rng(config.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    per_epoch = math.ceil(len(train) / config.batch_questions)
    total = per_epoch * config.epochs
    losses: list[float] = []
    tokens_before = scorer.prompt_tokens
    t0 = time.perf_counter()
    model.train(True)
    step = 0
    for _ in range(config.epochs):
        order = rng.permutation(len(train))
        for b in range(per_epoch):
            size = config.batch_questions
            batch = [train[int(i)] for i in order[b * size : (b + 1) * size]]
            optimizer.zero_grad(set_to_none=True)
            batch_loss = 0.0
            for pref in batch:
                k = min(config.permutations_per_step, len(pref.orders))
                pick = rng.choice(len(pref.orders), size=k, replace=False)
                prompts = scorer.prompts(pref, [pref.orders[int(i)] for i in pick])
                student = scorer.scores(prompts)
                teacher = torch.tensor([pref.scores[int(i)] for i in pick], device=student.device)
                loss = preference_kl(student.float(), teacher.float()) / len(batch)
                loss.backward()  # type: ignore[no-untyped-call]
                batch_loss += float(loss.detach())
            optimizer.step()
            losses.append(batch_loss)
            step += 1
            if progress is not None:
                progress(step, total)
    model.train(False)
    return TrainResult(
        steps=step,
        seconds=time.perf_counter() - t0,
        prompt_tokens=scorer.prompt_tokens - tokens_before,
        losses=losses,
    )


def distill(
    student_folder: Path,
    *,
    student_id: str,
    student_template: str,
    meta: PreferenceMeta,
    train: Sequence[Preference],
    held_back: Sequence[Preference],
    out: Path,
    config: DistillConfig,
    name: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> AdapterManifest:
    """Train an adapter on ``train``, measure agreement on ``held_back`` before and after, and
    write the adapter and its manifest into ``out``.

    Args:
        student_folder: the student's model folder.
        student_id: the student's model id as ``RAG_REORDER_MODEL`` names it.
        student_template: the student's scoring template (the one it will serve with).
        meta: the preference set's meta line (teacher, N, K, data).
        train: training questions.
        held_back: questions kept out of training, for the manifest's agreement.
        out: the adapter folder (created).
        config: hyperparameters.
        name: the adapter's name in the model id (default: ``out``'s name).
        progress: called with (step, steps).

    Returns:
        The manifest written.

    Raises:
        InvalidRequest: no training question or a bad hyperparameter.
    """
    base, tokenizer, device = load_student(student_folder, config)
    model = with_lora(base, config)
    scorer = StudentScorer(model, tokenizer, student_template)
    before = agreement(scorer, held_back)
    log.info("held-back agreement before: %s", before)
    result = train_steps(model, scorer, train, config, progress=progress)
    after = agreement(scorer, held_back)
    log.info(
        "trained %d steps in %.0f s (%d prompt tokens); held-back agreement after: %s",
        result.steps,
        result.seconds,
        result.prompt_tokens,
        after,
    )
    out.mkdir(parents=True, exist_ok=True)
    # peft records the folder the base was loaded from (this machine's model cache); the
    # model id travels with the adapter instead, so its files name what it applies to.
    model.peft_config["default"].base_model_name_or_path = student_id
    model.save_pretrained(str(out))
    targets = getattr(model.peft_config["default"], "target_modules", None)
    manifest = AdapterManifest(
        name=name or out.name,
        base_model=student_id,
        template=student_template,
        teacher=meta.teacher,
        teacher_template=meta.template,
        data=meta.data,
        passages=meta.passages,
        permutations=meta.permutations,
        permutations_per_step=config.permutations_per_step,
        lora_r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=tuple(sorted(targets)) if targets is not None else (),
        learning_rate=config.learning_rate,
        weight_decay=config.weight_decay,
        epochs=config.epochs,
        batch_questions=config.batch_questions,
        train_questions=len(train),
        steps=result.steps,
        train_seconds=round(result.seconds, 1),
        train_prompt_tokens=result.prompt_tokens,
        device=_device_name(device),
        before=before,
        after=after,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    write_manifest(out, manifest)
    (out / CARD).write_text(model_card(manifest), encoding="utf-8")  # replaces peft's template
    return manifest


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"
