"""A Kedro dataset that saves any single-file dataset atomically.

kedro-datasets' file datasets open their destination for writing and write into it, so a
reader (a browser showing ``report.html``, a script reading a CSV) can see a half-written
file while a save is under way or after a crash. ``AtomicFileDataset`` lets the wrapped
dataset write into a temporary folder, then puts the finished bytes in place with
``atomic.write_atomic`` (temporary sibling, ``os.replace``).

Example ``catalog.yml`` entry, wrapped in turn by kedro-mlflow where the file belongs in MLflow::

    report_page:
      type: kedro_mlflow.io.artifacts.MlflowArtifactDataset
      artifact_path: report
      dataset:
        type: qerl_pipeline.datasets.atomic_file.AtomicFileDataset
        filepath: data/08_reporting/compare/report.html
        dataset: {type: text.TextDataset}

``filepath`` is local; the wrapped dataset's own ``filepath`` is set by this dataset (to the
temporary file on save, to ``filepath`` on load). Versioning is not supported.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from kedro.io.core import AbstractDataset, parse_dataset_definition

from qerl_pipeline.atomic import write_atomic


class AtomicFileDataset(AbstractDataset[Any, Any]):
    """``dataset`` (a single-file dataset's definition, without ``filepath``) saved atomically at ``filepath``."""

    def __init__(self, *, filepath: str, dataset: dict[str, Any] | str, metadata: dict[str, Any] | None = None):
        self._filepath = Path(filepath)
        self._dataset = dataset
        self.metadata = metadata

    def _inner(self, filepath: Path) -> AbstractDataset:
        cls, args = parse_dataset_definition(
            self._dataset if isinstance(self._dataset, dict) else {"type": self._dataset}
        )
        return cls(**args, filepath=str(filepath))

    def save(self, data: Any) -> None:
        with tempfile.TemporaryDirectory(prefix="qerl-atomic-") as tmp:
            staged = Path(tmp) / self._filepath.name  # the same name: datasets that read the format from it
            self._inner(staged).save(data)
            write_atomic(self._filepath, staged.read_bytes())

    def load(self) -> Any:
        return self._inner(self._filepath).load()

    def _exists(self) -> bool:
        return self._filepath.is_file()

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(self._filepath), "dataset": self._dataset}
