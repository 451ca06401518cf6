"""Whether the Hub can be reached, decided once before the first Hub call and said in one line (``hub.py``).

The real Hub is never asked: ``tests/helpers/hub.py`` points every Hub client of the process at
a local address, one nothing listens on (unreachable) or a server that answers 404 (reachable).
Unreachable, the Hub's clients would retry each request for ~25 s with a warning a try
("Retrying in 1s [Retry 1/5]" ... "8s [Retry 5/5]"); here nothing is retried: the probe fails
at once, the process goes offline, and a Hub-only source is unavailable at once.
"""

from __future__ import annotations

import logging
import os

import pytest

from qerl_pipeline import hub
from qerl_pipeline.config import ModelConfig, SourceConfig, UserSetConfig
from qerl_pipeline.data import user_sets
from qerl_pipeline.data.sources import SourceUnavailable, read_raw
from qerl_pipeline.models import BUNDLED_MODEL, resolve_source
from tests.helpers.hub import answering_hub, closed_port_url, hub_at


def _hub_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == hub.__name__]


def test_an_unreachable_hub_is_found_once_said_once_and_never_retried(monkeypatch, caplog):
    import datasets
    import huggingface_hub

    url = closed_port_url()
    hub_at(monkeypatch, url)
    caplog.set_level(logging.INFO)
    aime25 = SourceConfig(hub_id="math-ai/aime25", split="test")  # no local copy: the Hub or nothing
    with pytest.raises(
        SourceUnavailable, match=r"not in the local cache and the Hub is offline \(http://127\.0\.0\.1:\d+"
    ):
        read_raw("aime25", aime25)
    with pytest.raises(SourceUnavailable, match="the Hub is offline"):  # a user's Hub set: the same decision
        user_sets.read_user_rows(UserSetConfig(hub_id="me/my-set", split="train"))
    assert resolve_source(ModelConfig(name=BUNDLED_MODEL, source="auto"))[0] == "gguf"  # the base: no Hub call either
    assert list(hub._probed) == [url]  # one probe for the process
    lines = _hub_lines(caplog)
    assert (
        len(lines) == 1 and lines[0].startswith(f"Hugging Face Hub unreachable ({url}: ") and "no retries" in lines[0]
    )
    assert not [r for r in caplog.records if "Retry" in r.getMessage() or "thrown while requesting" in r.getMessage()]
    # the rest of the process and its children are offline, as with HF_HUB_OFFLINE=1 from the start
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert huggingface_hub.constants.HF_HUB_OFFLINE is True and datasets.config.HF_HUB_OFFLINE is True


def test_hf_hub_offline_is_taken_without_a_probe(monkeypatch, caplog):
    hub_at(monkeypatch, closed_port_url())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    caplog.set_level(logging.INFO)
    assert hub.offline_reason() == hub.offline_reason() == "HF_HUB_OFFLINE is set"
    assert hub._probed == {}
    assert _hub_lines(caplog) == ["Hugging Face Hub: offline (HF_HUB_OFFLINE is set); local copies and caches only"]


def test_a_hub_that_answers_is_reachable_even_with_an_error_status(monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    with answering_hub() as url:
        hub_at(monkeypatch, url)
        assert hub.offline_reason() is None
    assert os.environ["HF_HUB_OFFLINE"] == "0" and not _hub_lines(caplog)


def test_a_failed_load_from_a_reachable_hub_names_its_error(monkeypatch, tmp_path):
    from qerl_pipeline.data import sources

    def failing(hub_id, hub_config, split):
        raise ConnectionError("the set's files are gone")

    monkeypatch.setattr(sources, "load_hub_rows", failing)
    with answering_hub() as url:
        hub_at(monkeypatch, url)
        with pytest.raises(SourceUnavailable, match="from the Hub failed: ConnectionError: the set's files are gone"):
            read_raw(
                "aime25", SourceConfig(hub_id="math-ai/aime25", split="test", local_path=str(tmp_path / "absent"))
            )
