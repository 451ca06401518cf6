"""A Kedro dataset for Hugging Face model folders (weights, config, tokenizer): atomic, versionable.

What a node returns and what the dataset does with it:

* a folder path (``str`` / ``Path``): that folder becomes the dataset's folder;
* a mapping ``{name: folder path}``: each folder becomes the subfolder ``<filepath>/<name>``,
  other subfolders already there are left alone. The quantize pipeline uses this to put
  ``base_<format>`` under ``data/06_models`` for whichever method it was run for.

Nodes build model folders themselves (``qerl_pipeline.models.save_model_folder`` or
``quantization.checkpoint.write_base`` into a temporary folder) and hand over the path, so
the dataset never imports transformers and never holds a model in memory. With
``move: true`` (default) the handed-over folder is moved (a rename when on the same
filesystem, else a copy then delete); ``move: false`` copies and leaves it.

Every write goes to a temporary sibling of its destination first and is swapped in with
``os.replace``: a crash never leaves a half-written model where a reader would find it.
With ``versioned: true`` each save goes to ``<filepath>/<version>/<name>``, Kedro's layout.

``load()`` returns the folder's ``Path`` (for a mapping save, the parent folder); readers
pick what they need (``from_pretrained(path)``, ``path / "base_nvfp4"``). A missing folder
is an error, unless ``missing_ok: true``: then ``load()`` returns the path all the same.
That is how a node is handed the folder it will update in place (the quantize node gets
``existing_base_models``, the same path as its output ``base_models``, and reuses or
rewrites ``base_<format>`` there through ``quantization.store``). Saving a folder onto
itself (the node returns the path it was given) changes nothing on disk.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from kedro.io.core import AbstractVersionedDataset, DatasetError, Version

from qerl_pipeline.atomic import staged_dir


def _place(src: Path, dst: Path, move: bool) -> None:
    """Put folder ``src`` at ``dst`` atomically (replacing an existing ``dst``; ``atomic.staged_dir``)."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise DatasetError(f"HFModelFolderDataset: {src} is not a folder")
    if src.resolve() == dst.resolve():
        return
    with staged_dir(dst, create=False) as stage:  # move/copytree create it, keeping src's permissions
        if move:
            shutil.move(str(src), str(stage))
        else:
            shutil.copytree(src, stage)


class HFModelFolderDataset(AbstractVersionedDataset[Any, Path]):
    """A Hugging Face model folder (or a folder of them) in the Kedro catalog.

    Example ``catalog.yml`` entry::

        base_models:
          type: qerl_pipeline.datasets.hf_model_folder.HFModelFolderDataset
          filepath: data/06_models
          versioned: false
    """

    def __init__(
        self,
        filepath: str,
        version: Version | None = None,
        move: bool = True,
        missing_ok: bool = False,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(PurePosixPath(Path(filepath).as_posix()), version)
        if missing_ok and version is not None:
            raise DatasetError(
                f"HFModelFolderDataset {filepath}: missing_ok is for unversioned folders (versioned: false)"
            )
        self._move = move
        self._missing_ok = missing_ok
        self.metadata = metadata

    def load(self) -> Path:
        path = Path(self._get_load_path().as_posix())
        if not path.is_dir():
            if self._missing_ok:
                return path
            raise DatasetError(f"HFModelFolderDataset: {path} does not exist; run the pipeline that writes it first")
        return path

    def save(self, data: str | os.PathLike | Mapping[str, str | os.PathLike]) -> None:
        dst = Path(self._get_save_path().as_posix())
        if isinstance(data, Mapping):
            for name, folder in data.items():
                if not name or name in (".", "..") or "/" in name or "\\" in name:
                    raise DatasetError(f"HFModelFolderDataset: subfolder name {name!r} must be one path component")
                _place(Path(folder), dst / name, self._move)
            dst.mkdir(parents=True, exist_ok=True)
        elif isinstance(data, (str, os.PathLike)):
            _place(Path(data), dst, self._move)
        else:
            raise DatasetError(
                f"HFModelFolderDataset saves a folder path or a mapping name -> folder path, got {type(data).__name__}"
            )

    def _exists(self) -> bool:
        try:
            return Path(self._get_load_path().as_posix()).is_dir()
        except DatasetError:
            return False

    def _describe(self) -> dict[str, Any]:
        return {
            "filepath": str(self._filepath),
            "version": self._version,
            "move": self._move,
            "missing_ok": self._missing_ok,
        }


def folder_of(base: Any) -> Path:
    """The folder of a model as a dataset or node hands it over: a path, or an object/dict with one."""
    if isinstance(base, (str, Path)):
        return Path(base)
    for attr in ("path", "folder", "base_dir"):
        if isinstance(getattr(base, attr, None), (str, Path)):
            return Path(getattr(base, attr))
    if isinstance(base, dict) and "path" in base:
        return Path(base["path"])
    raise TypeError(f"cannot tell the model folder from a {type(base).__name__}")
