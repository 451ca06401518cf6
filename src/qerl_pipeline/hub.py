"""Whether the Hugging Face Hub can be reached: decided once per process, before the first Hub call.

Machines without the Hub (CI, most first runs) are the common case, and Hub clients retry an
unreachable Hub for tens of seconds, a warning per try (``huggingface_hub``'s HTTP backoff:
"Retrying in 1s ... 8s [Retry 5/5]"). So every part that may call the Hub (the data sources,
the user's Hub sets, the base model's resolution) asks ``offline_reason`` first:

- ``HF_HUB_OFFLINE`` set (1, on, yes, true): offline, no probe;
- else one probe: an HTTP HEAD of the Hub's endpoint (``HF_ENDPOINT``, default
  https://huggingface.co; proxies from the environment apply), bounded by ``PROBE_TIMEOUT_S``
  whatever DNS does. Any HTTP answer, an error status included, means reachable.

The answer is said in one log line, once per process, and kept. When the probe finds the Hub
unreachable, the process goes offline as if ``HF_HUB_OFFLINE=1`` had been set: the variables
``HF_HUB_OFFLINE`` and ``HF_DATASETS_OFFLINE`` are set (child processes inherit them) and the
offline switches that ``huggingface_hub`` and ``datasets`` read at import are set where those are
imported already. Hub clients then fail at once, or read their local caches, without retries.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import urllib.error
import urllib.request

log = logging.getLogger(__name__)

#: Seconds the probe waits for the Hub's endpoint (DNS included) before calling it unreachable.
PROBE_TIMEOUT_S = 3.0
DEFAULT_ENDPOINT = "https://huggingface.co"
_TRUE = ("1", "on", "yes", "true")  # huggingface_hub's reading of the variable
#: The offline switches of the Hub's clients, by module: read from the environment once, at import
#: (transformers asks ``huggingface_hub.constants``).
OFFLINE_SWITCHES = {
    "huggingface_hub.constants": ("HF_HUB_OFFLINE",),
    "datasets.config": ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"),
}
#: The probe's answer per endpoint (None: reachable), once per process.
_probed: dict[str, str | None] = {}
_said: set[str] = set()


def endpoint() -> str:
    """The Hub's address: ``HF_ENDPOINT``, else https://huggingface.co."""
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or DEFAULT_ENDPOINT


def offline_by_env() -> bool:
    """Whether ``HF_HUB_OFFLINE`` asks for offline mode (1, on, yes, true: as huggingface_hub reads it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def offline_reason() -> str | None:
    """Why the Hub cannot be used in this process (``HF_HUB_OFFLINE``, or the probe's failure), or None.

    Said in one log line the first time; the probe runs at most once per process.
    """
    url = endpoint()
    if url in _probed:  # decided by the probe (which may have set HF_HUB_OFFLINE itself)
        return _probed[url]
    if offline_by_env():
        _say(
            "HF_HUB_OFFLINE is set", "Hugging Face Hub: offline (HF_HUB_OFFLINE is set); local copies and caches only"
        )
        return "HF_HUB_OFFLINE is set"
    reason = _probed[url] = _probe(url)
    if reason is not None:
        go_offline()
        _say(
            reason,
            f"Hugging Face Hub unreachable ({reason}): offline for this run (HF_HUB_OFFLINE=1), no retries; "
            "local copies and caches only",
        )
    return reason


def _probe(url: str) -> str | None:
    """One HEAD request to ``url``: None when anything answers, else why not (bounded by ``PROBE_TIMEOUT_S``)."""
    result: list[str | None] = []

    def ask() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=PROBE_TIMEOUT_S).close()
            result.append(None)
        except urllib.error.HTTPError:  # an answer (401, 404, 5xx): the Hub is there
            result.append(None)
        except (OSError, ValueError) as err:  # DNS, refused, timeout, TLS, a malformed HF_ENDPOINT
            reason = getattr(err, "reason", None) or err
            result.append(f"{url}: {reason}")

    thread = threading.Thread(target=ask, name="hub-probe", daemon=True)  # getaddrinfo ignores socket timeouts
    thread.start()
    thread.join(PROBE_TIMEOUT_S + 1.0)
    return result[0] if result else f"{url}: no answer within {PROBE_TIMEOUT_S:g} s"


def go_offline() -> None:
    """Offline mode for the rest of this process and its children, as ``HF_HUB_OFFLINE=1`` at start would give."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    for module, names in OFFLINE_SWITCHES.items():  # read from the environment when they were imported
        loaded = sys.modules.get(module)
        for name in names if loaded is not None else ():
            if hasattr(loaded, name):
                setattr(loaded, name, True)


def _say(key: str, line: str) -> None:
    if key not in _said:
        _said.add(key)
        log.info(line)
