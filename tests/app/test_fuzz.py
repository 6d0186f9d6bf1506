"""Bad inputs, fuzzed: mutated bodies on every POST route never produce a 5xx.

Routes: the native reorder, one rerank path (all three share one handler) and the bias-profile
calibration, from queries and from sampled traffic.

A seeded, bounded fuzzer (not a property test framework): start from a valid body, apply a few
random mutations (drop, retype, oversize, nest, duplicate, surrogates, huge numbers), post, and
count. Prints ``tried`` and ``5xx`` so the figure is visible in the test log.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from service.strategies import strategy_names
from tests.app.conftest import PASSAGES, QUERY, Harness, serving

ROUNDS = 600  # about 150 per base body
OPTIONAL = [
    "design",
    "top_n",
    "placement",
    "extra",
    "reorder",
    "max_tokens_per_doc",
    "queries",
    "from_traffic",
    "slots",
    "num_prompts",
    "prompt_passages",
]
WEIRD: list[Any] = [
    None,
    True,
    0,
    -1,
    2**64,
    1e308,
    -1e308,
    "",
    " ",
    "\ud800",
    "x" * 5000,
    "é" * 50,
    [],
    {},
    [[[]]],
    {"text": None},
    {"text": "t", "score": 1e308},
    ["a", "a", "a"],
    # Passages with no indexable token (stop words, short words, emoji): bm25 gave a 500.
    ["the of", "and a"],
    ["a b", "c d"],
    ["\U0001f600", "\U0001f389"],
    {"kind": "cyclic", "num_prompts": 10**9},
    {"kind": "random", "prompt_passages": 2},
    {"kind": "pruned_random", "num_prompts": 1},
    {"kind": "pruned_random", "variable_pruning": True},
]


def _mutate(body: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    out = json.loads(json.dumps(body))
    for _ in range(rng.randint(1, 3)):
        keys = [*out, *OPTIONAL]
        key = rng.choice(keys)
        roll = rng.random()
        if roll < 0.2 and key in out:
            del out[key]
        elif roll < 0.35 and isinstance(out.get(key), list) and out[key]:
            lst = out[key]
            lst.append(lst[0])  # duplicated passages
            if rng.random() < 0.5:
                lst[rng.randrange(len(lst))] = rng.choice(WEIRD)
        else:
            out[key] = rng.choice(WEIRD)
    return out


async def test_fuzzed_bodies_never_5xx(tmp_path: Path) -> None:
    # Live-traffic sampling on, so the reorder bodies feed from_traffic calibrations.
    async with serving(tmp_path, traffic_sample_rate=1.0) as served:
        await _fuzz(served)


async def _fuzz(served: Harness) -> None:
    rng = random.Random(20240611)
    bases = {
        "/v1/reorder": {"query": QUERY, "passages": PASSAGES},
        "/v1/rerank": {"query": QUERY, "documents": PASSAGES},
        "/v1/bias-profiles/calibrate": {
            "queries": [{"query": QUERY, "passages": PASSAGES}] * 2,
            "design": "pruned_random",
        },
        "/v1/bias-profiles/calibrate#traffic": {
            "from_traffic": True,
            "design": "pruned_random",
            "slots": 2,
        },
    }
    tried = server_errors = 0
    statuses: dict[int, int] = {}
    names = strategy_names()
    for k in range(ROUNDS):
        path = rng.choice(list(bases))
        base = bases[path]
        # Every strategy in turn on the two reorder routes (issue 77): a mutation that only
        # one strategy's code path mishandles is found too.
        if path == "/v1/reorder":
            base = {**base, "strategy": names[k % len(names)]}
        elif path == "/v1/rerank":
            base = {**base, "reorder": {"strategy": names[k % len(names)]}}
        body = _mutate(base, rng)
        # json.dumps escapes the lone surrogate as \ud800, which JSON parsers accept.
        r = await served.client.post(
            path.split("#")[0],
            content=json.dumps(body),
            headers={"content-type": "application/json"},
        )
        tried += 1
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if r.status_code >= 500:
            server_errors += 1
            print("5xx:", path, json.dumps(body)[:300], r.text[:300])
        assert "error" in r.json() or r.status_code == 200
    print(f"fuzz: {tried} tried, {server_errors} 5xx, statuses {dict(sorted(statuses.items()))}")
    assert server_errors == 0
    assert served.ctx.admission.in_flight == 0


async def test_raw_garbage_bodies_never_5xx(served: Harness) -> None:
    rng = random.Random(7)
    for _ in range(100):
        raw = bytes(rng.randrange(256) for _ in range(rng.randint(0, 300)))
        for path in ("/v1/reorder", "/rerank", "/v1/bias-profiles/calibrate"):
            r = await served.client.post(
                path, content=raw, headers={"content-type": "application/json"}
            )
            assert 400 <= r.status_code < 500, (raw, r.text)


def _rare_characters(rng: random.Random, n: int) -> list[str]:
    """Characters from every plane, assigned or not, with the lone-ish ones a schema fuzz
    finds: noncharacters, tags, private use, a combining mark or a joiner on its own, a BOM,
    a bidi override, U+FFFD itself (surrogates excluded: they are a 422 before tokenising)."""
    fixed = [
        "\U00082e9e",  # issue 90: unassigned plane 8, a 500 prompt_misaligned
        "\U0010ffff",
        "\U000e0001",
        "\U000f0000",
        "\U0003134a",
        "\ufffe",
        "\uffff",
        "\u0378",
        "\u0301",
        "\u200d",
        "\ufeff",
        "\u202e",
        "\ufffd",
        "\ufe0f",
        "\x00",
        "\x7f",
        "\U0001f600",
        "\U0001f468\u200d\U0001f469",
    ]
    drawn: list[str] = []
    while len(drawn) < n:
        plane = rng.randrange(17)
        cp = plane * 0x10000 + rng.randrange(0x10000)
        if not 0xD800 <= cp <= 0xDFFF:
            drawn.append(chr(cp))
    return fixed + drawn


async def test_rare_characters_with_smollm2s_tokenizer_never_5xx(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    """Issue 90: a query with U+82E9E got a 500 on /v1/reorder and /v1/rerank on the paced
    backend with SmolLM2's tokenizer (it drops the character's lead byte). Every plane's
    characters, in the query, a passage and a title: never a 5xx, and a 422 that fails on
    the query names the character it cannot take."""
    import httpx

    from app.main import create_app
    from service.backends.fakes.paced import PacedBackend, PacedProfile
    from service.backends.tokenizers.tokenizer_files import load_prompt_tokenizer
    from tests.app.conftest import settings_for, wait_ready

    tokenizer = load_prompt_tokenizer(smollm2_dir, name="smollm2")
    backend = PacedBackend(
        tokenizer,
        PacedProfile("t", 1e6, 0.0, padded=False, decode_step_s=0.0, source="test"),
        model="smollm2",
        max_model_len=8192,
        vocab_size=len(tokenizer.hf_tokenizer),
        batch_token_budget=16384,
    )
    app = create_app(settings_for(tmp_path), backend=backend)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    rng = random.Random(90)
    statuses: dict[int, int] = {}
    refused: set[str] = set()
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        await wait_ready(client, timeout=60)  # the warm-up on a loaded 2-core machine
        for i, c in enumerate(_rare_characters(rng, 40)):
            where = "query" if i == 0 else rng.choice(["query", "text", "title", "all"])
            query = f"what is {c} here" if where in ("query", "all") else QUERY
            passages = [
                {
                    "text": f"{p} {c}" if where in ("text", "all") else p,
                    "title": f"T{c}" if where in ("title", "all") else "T",
                }
                for p in PASSAGES
            ]
            for path, body in (
                ("/v1/reorder", {"query": query, "passages": passages}),
                ("/v1/rerank", {"query": query, "documents": [p["text"] for p in passages]}),
            ):
                r = await client.post(path, json=body)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                assert r.status_code < 500, (hex(ord(c[0])), where, path, r.text[:400])
                if r.status_code == 422 and "tokenizer cannot represent" in r.text:
                    assert f"U+{ord(c[0]):04X}" in r.text, r.text
                    assert where in ("query", "all")
                    refused.add(f"U+{ord(c[0]):04X}")
    print(f"rare characters: statuses {dict(sorted(statuses.items()))}, refused {sorted(refused)}")
    assert "U+82E9E" in refused
