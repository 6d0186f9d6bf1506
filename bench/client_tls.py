"""Client benchmark: what building one client (or framework adapter) costs, with httpx's
per-client TLS context and with the one the library now shares, side by side in one run.

A RAG backend that builds an adapter per request pays a client's construction on every
request. httpx builds a verification context for each client it makes, reading certifi's whole
CA bundle; ``rag_reorder`` clients now share one per process (``_protocol.tls_context``). In
alternating rounds (ABAB, so drift in the machine's load hits both alike) this builds and
closes ``--clients`` clients each way: ``before`` is ``httpx.Client`` as the library built it
(base URL and timeout only), ``after`` is ``rag_reorder.Client``, which wraps the same
``httpx.Client`` with the shared context. No request is sent: the figure is construction alone.
The headline is the ratio of the medians of the per-client times, before / after.

Usage: python -m bench.client_tls [--rounds 10] [--clients 50]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import httpx
from rag_reorder import Client
from rag_reorder._protocol import timeout_of

from bench import report

URL = "http://rag-reorder:8000"


def _before() -> None:
    httpx.Client(base_url=URL, timeout=timeout_of(135.0)).close()


def _after() -> None:
    Client(URL).close()


def _per_client_ms(build: Callable[[], None], clients: int) -> float:
    t0 = time.perf_counter()
    for _ in range(clients):
        build()
    return (time.perf_counter() - t0) / clients * 1e3


def run(args: argparse.Namespace) -> report.Result:
    _after()  # the shared context is built once, at the first client: not in the rounds
    before: list[float] = []
    after: list[float] = []
    for _ in range(args.rounds):
        before.append(_per_client_ms(_before, args.clients))
        after.append(_per_client_ms(_after, args.clients))
    b, a = statistics.median(before), statistics.median(after)
    print(f"per client: before {b:.2f} ms, after {a:.3f} ms, before/after {b / a:.0f}x")
    return {
        **report.provenance(),
        "httpx": httpx.__version__,
        "rounds": args.rounds,
        "clients_per_round": args.clients,
        "before_ms_per_client": before,
        "after_ms_per_client": after,
        "median_before_ms": b,
        "median_after_ms": a,
        "before_over_after": b / a,
    }


def main() -> int:
    ap = report.parser("client_tls", __doc__)
    ap.add_argument("--rounds", type=int, default=10, help="alternating rounds, each way")
    ap.add_argument("--clients", type=int, default=50, help="clients built a round, each way")
    return report.main(ap, run)


if __name__ == "__main__":
    raise SystemExit(main())
