"""The golds of the five benchmark sets, read from the offline copies in ../shared/data through
``data.sources.normalise_row``: exactly the golds training and evaluation score against."""

from __future__ import annotations

import json

import pytest

from qerl_pipeline.data.sources import normalise_row
from tests.helpers.project import SHARED

#: set name -> (folder under ../shared/data, source kind, split)
SETS = {
    "gsm8k": ("gsm8k", "gsm8k", "test"),
    "math500": ("math500", "math500", "test"),
    "aime24": ("aime24", "aime", "test"),
    "aime25": ("aime25", "aime", "test"),
    "amc23": ("amc23", "amc", "test"),
}


def all_golds() -> dict[str, list[str]]:
    """The golds of each set, as the project normalises them (skips when ../shared is absent)."""
    out = {}
    for name, (folder, kind, split) in SETS.items():
        path = SHARED / "data" / folder / f"{split}.jsonl"
        if not path.is_file():
            pytest.skip(f"offline data copy not found at {path} (../shared beside the checkout)")
        rows = [normalise_row(kind, name, split, i, json.loads(line)) for i, line in enumerate(path.open())]
        out[name] = [r["gold"] for r in rows]
        assert all(out[name]), f"{path}: a row without a gold"
    return out
