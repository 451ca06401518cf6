"""A Hugging Face Hub the tests can reach or not, never the real one: ``HF_ENDPOINT`` at a local address.

``hub_at(monkeypatch, url)`` points every Hub client of this process at ``url`` (the variable and
the values ``huggingface_hub`` and ``datasets`` read from it at import), with offline mode off,
and forgets what ``qerl_pipeline.hub`` decided before; the test's monkeypatch puts everything
back. ``closed_port_url()`` is an address nothing listens on (an unreachable Hub: connection
refused at once); ``answering_hub()`` serves 404 to every request (a reachable Hub).
"""

from __future__ import annotations

import importlib
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from qerl_pipeline import hub

#: The values the Hub's clients derive from HF_ENDPOINT at import: module -> {name: template over the endpoint}.
ENDPOINT_VALUES = {
    "huggingface_hub.constants": {
        "ENDPOINT": "{url}",
        "HUGGINGFACE_CO_URL_TEMPLATE": "{url}/{{repo_id}}/resolve/{{revision}}/{{filename}}",
    },
    "datasets.config": {
        "HF_ENDPOINT": "{url}",
        "HUB_DATASETS_URL": "{url}/datasets/{{repo_id}}/resolve/{{revision}}/{{path}}",
    },
}


def hub_at(monkeypatch, url: str) -> None:
    """Every Hub client of this process at ``url``, offline mode off, ``qerl_pipeline.hub`` undecided."""
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # set (not deleted), so the teardown also undoes hub.go_offline
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    for module, values in ENDPOINT_VALUES.items():
        loaded = importlib.import_module(module)
        for name, template in values.items():
            monkeypatch.setattr(loaded, name, template.format(url=url))
    for module, names in hub.OFFLINE_SWITCHES.items():
        loaded = importlib.import_module(module)
        for name in names:
            monkeypatch.setattr(loaded, name, False)
    monkeypatch.setattr(hub, "_said", set())
    monkeypatch.setattr(hub, "_probed", {})


def closed_port_url() -> str:
    """``http://127.0.0.1:<port>`` with nothing listening there."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class _NotFound(BaseHTTPRequestHandler):
    def do_HEAD(self) -> None:  # http.server's name
        self.send_response(404)
        self.end_headers()

    do_GET = do_HEAD

    def log_message(self, *args) -> None:
        pass


@contextmanager
def answering_hub() -> Iterator[str]:
    """The URL of a local server answering 404 to everything (reachable, knows no repository)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
