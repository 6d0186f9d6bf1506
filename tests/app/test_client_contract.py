"""What the client distribution (clients/python) assumes about the server, checked against the
server's own settings: its default timeout outlasts the server's default deadline."""

from __future__ import annotations

from service.config.settings import Settings


def test_the_clients_timeout_outlasts_the_servers_deadline() -> None:
    # Imported here: the client is installed in .venv (make install), not in .venv-vllm,
    # which collects this module too (and deselects it).
    from rag_reorder._protocol import DEFAULT_TIMEOUT_S, SERVER_DEADLINE_S

    assert Settings().request_timeout_s == SERVER_DEADLINE_S
    assert DEFAULT_TIMEOUT_S >= SERVER_DEADLINE_S + 10
