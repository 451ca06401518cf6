"""The base store: the one home for "a base folder of format fmt for this model and these settings".

A base folder (``quantization/checkpoint.py`` layout: config.json, weights) is expensive to
write and deterministic given its inputs, so it is written once and reused:

* ``base_fingerprint(model, quantize, fmt)``: a JSON-able description of everything that
  decides the folder's bytes, and a short ``digest`` (sha256 of its canonical JSON):

  - the model's identity: ``name``, configured ``source`` and the source it resolves to
    (``auto`` may give a local folder, the Hub or the bundled GGUF: different weights),
    ``revision``, ``trust_remote_code``; for a local folder the identity of its files
    (sha256 of every small file such as config.json and the tokenizer, name and size of
    each weight file), so an edited local model is not reused; for a GGUF its file name and
    size; for ``source: random`` its ``random_init`` shape and seed, ``max_seq_len``
    (written as ``max_position_embeddings``) and the GGUF the tokenizer comes from;
  - the dtypes the folder is written in (``checkpoint.BASE_DTYPE`` for the base, the
    serving dtype ``models.resolve_dtype(model)`` its ``serving/`` copy is decoded in);
  - only the quantize settings that change this format's bytes, as its codec declares them
    (``Codec.settings``): nvfp4 ``ignore`` and ``nvfp4_algorithm`` (+ for awq/gptq the
    calibration texts' sha256, their count, the truncation length ``max_seq_len`` and
    llmcompressor's version); nf4 ``ignore``, ``nf4_blocksize``, ``nf4_double_quant``; mxfp4 and
    fp8 ``ignore``; bf16 none (every linear stays dense). So ``nf4_blocksize`` does not
    invalidate an NVFP4 base, nor a moved calibration file with the same rows an AWQ one;
  - the codec's ``version``: bumped by hand whenever the code writes different bytes for the
    same inputs (a codec fix, a layout change), so old folders are rewritten, not reused.

  A Hub model without ``revision`` is identified by its name only (the Hub's default branch
  as of the first quantize): pin ``model.revision`` to a commit, or set ``quantize.force``,
  to pick up upstream changes.
* ``STAMP`` (``<folder>/qerl_base.json``): the fingerprint, the size and sha256 of every file
  written (``atomic.file_manifest``) and the quantize report. ``stored_fingerprint(folder)`` /
  ``read_stamp(folder)`` read it.
* ``ensure_base(model, quantize, fmt, folder, force=...)``: reuse the folder when its
  stamp's digest equals the new one and every file it lists is there with its size and
  sha256 (no file is opened for writing: mtimes and inodes stay as they were); else load the
  model, quantize it into a stage beside ``folder``, write the stamp last and swap the folder
  in (``atomic.staged_dir``). Either way one INFO line says which and why (no base / no stamp
  / the differing fingerprint keys / damaged, naming the file and what differs /
  ``quantize.force``). Files added later by readers (``nf4/bnb/``, written on demand for
  CUDA serving; ``serving/``, below) are allowed: only the listed files are checked.
* ``ensure_serving(folder)``: the dense ``serving/`` copy (``checkpoint.write_serving``), written
  on first use by the engines that serve it (rollout/serving.py: every format on CPU, NF4 on
  CUDA without bitsandbytes), never where the base is served packed. It carries its own stamp
  (``serving/qerl_serving.json``: the base's digest, the dtype, its files' sizes and sha256),
  is staged and swapped in whole, and is reused while its stamp names this base and dtype and
  its files have their sizes (a ``serving/`` without its own stamp, one the base's stamp lists
  or one made by hand, is served as it is).

Verification (``quantize.verify``). The sizes catch a truncated or missing file; the hashes
catch damage at the same size (a garbled safetensors header, garbled weights that would train to
NaN). Hashing reads the whole base once per reuse at about 1 GB/s (0.5-2 GB/s by CPU): a
135M-parameter model's NVFP4 base with its ``serving/`` copy is a few hundred MB, well under a
second; a 7B one's ~10 GB, about ten seconds (``sizes`` skips it). ``requantize`` (default): a
damaged base is re-quantized, the log naming the file; ``fail``: ``BaseDamaged`` names it and
nothing is written (``quantize.force`` still re-quantizes). A ``serving/`` copy with its own
stamp is checked the same way; a damaged one is removed under ``requantize`` (it is decoded
again from the base on its next use) and named by ``BaseDamaged`` under ``fail``. A stamp
written before hashes were recorded (file sizes only) cannot prove its content, so under
``requantize`` and ``fail`` such a base is re-quantized once (the log says so); ``sizes`` reuses
it by its sizes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qerl_pipeline.atomic import file_manifest, manifest_damage, sha256_file, staged_dir, write_atomic
from qerl_pipeline.config import ModelConfig, QuantizeConfig, parse
from qerl_pipeline.models import _gguf_file, load_base_model, resolve_dtype, resolve_source
from qerl_pipeline.quantization import checkpoint, formats

log = logging.getLogger(__name__)

#: The fingerprint file inside a base folder (written last).
STAMP = "qerl_base.json"
#: The stamp of a ``serving/`` copy written on first use (inside it, written last).
SERVING_STAMP = "qerl_serving.json"
#: 2: ``files`` maps each file to its size and sha256 (1: to its size).
STAMP_SCHEMA = 2
#: Files of a local model folder identified by name and size (hashing them would cost a
#: full read of the weights per run); every other top-level file is hashed.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
HASH_LIMIT_BYTES = 64 * 2**20
CALIBRATION_FIELDS = ("text", "prompt", "question", "problem")


# ------------------------------------------------------------------------------ inputs
def calibration_texts(path: str | Path, n: int) -> list[str]:
    """The first ``n`` texts of a JSONL file (field text / prompt / question / problem)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"quantize.calibration_path: {path} does not exist")
    texts = []
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            field = next((f for f in CALIBRATION_FIELDS if isinstance(row.get(f), str)), None)
            if field is None:
                raise ValueError(f"{path}:{lineno}: no text field (one of {CALIBRATION_FIELDS})")
            texts.append(row[field])
            if len(texts) >= n:
                break
    return texts


def _typed(
    model: ModelConfig | dict[str, Any], quantize: QuantizeConfig | dict[str, Any]
) -> tuple[ModelConfig, QuantizeConfig]:
    mcfg = model if isinstance(model, ModelConfig) else parse(ModelConfig, model, "model")
    qcfg = quantize if isinstance(quantize, QuantizeConfig) else parse(QuantizeConfig, quantize, "quantize")
    return mcfg, qcfg


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_identity(path: Path) -> dict[str, Any]:
    """``{size}`` for weights and large files, ``{sha256}`` for the rest (config, tokenizer)."""
    size = path.stat().st_size
    if path.name.endswith(WEIGHT_SUFFIXES) or size > HASH_LIMIT_BYTES:
        return {"size": size}
    return {"sha256": sha256_file(path)}


def local_model_identity(folder: str | Path) -> dict[str, dict[str, Any]]:
    """The identity of a local HF model folder's top-level files (what ``from_pretrained`` reads)."""
    folder = Path(folder)
    return {p.name: _file_identity(p) for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")}


def _model_identity(mcfg: ModelConfig) -> dict[str, Any]:
    kind, where = resolve_source(mcfg)
    ident: dict[str, Any] = {"source": mcfg.source, "resolved": kind}
    if kind == "random":
        gguf = _gguf_file(mcfg)
        ident.update(
            random_init=mcfg.random_init.model_dump(mode="json"),
            max_seq_len=mcfg.max_seq_len,
            tokenizer_gguf={"name": gguf.name, "size": gguf.stat().st_size},
        )
        return ident
    ident.update(name=mcfg.name, revision=mcfg.revision)
    if kind == "gguf":
        p = Path(where)
        ident["gguf"] = {"name": p.name, "size": p.stat().st_size}
    else:
        ident["trust_remote_code"] = mcfg.trust_remote_code
    if kind == "local":
        ident["files"] = local_model_identity(where)
    return ident


def _quantize_identity(mcfg: ModelConfig, qcfg: QuantizeConfig, fmt: str) -> dict[str, Any]:
    codec = formats.get(fmt)
    if not codec.quantizes:
        return {}
    settings = qcfg.model_dump()
    ident: dict[str, Any] = {f: sorted(set(settings[f])) if f == "ignore" else settings[f] for f in codec.settings}
    if codec.algorithm(settings) != "rtn":
        from importlib.metadata import PackageNotFoundError, version

        texts = calibration_texts(qcfg.calibration_path, qcfg.calibration_samples)
        try:
            llmc = version("llmcompressor")
        except PackageNotFoundError:
            llmc = None
        ident.update(
            calibration_texts_sha256=_sha256_bytes(json.dumps(texts, ensure_ascii=False).encode("utf-8")),
            calibration_count=len(texts),
            calibration_max_seq_len=mcfg.max_seq_len,
            llmcompressor=llmc,
        )
    return ident


def _digest(fingerprint: dict[str, Any]) -> str:
    body = {k: v for k, v in fingerprint.items() if k != "digest"}
    return _sha256_bytes(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())


def base_fingerprint(
    model: ModelConfig | dict[str, Any], quantize: QuantizeConfig | dict[str, Any], fmt: str
) -> dict[str, Any]:
    """Everything that decides the bytes of a ``fmt`` base of ``model`` under ``quantize``, + its ``digest``."""
    codec = formats.get(fmt)
    mcfg, qcfg = _typed(model, quantize)
    fp = {
        "format": fmt,
        "codec_version": codec.version,
        "model": _model_identity(mcfg),
        "base_dtype": str(checkpoint.BASE_DTYPE).removeprefix("torch."),
        "serving_dtype": str(resolve_dtype(mcfg)).removeprefix("torch."),
        "quantize": _quantize_identity(mcfg, qcfg, fmt),
    }
    fp["digest"] = _digest(fp)
    return fp


# ------------------------------------------------------------------------------ the stamp
def read_stamp(folder: str | Path) -> dict[str, Any] | None:
    """The whole stamp of a base folder (fingerprint, files, report), or None when there is none."""
    path = Path(folder) / STAMP
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if not isinstance(record, dict) or not isinstance(record.get("fingerprint"), dict):
        raise ValueError(f"{path}: not a base stamp (no 'fingerprint' object)")
    return record


def stored_fingerprint(folder: str | Path) -> dict[str, Any] | None:
    """The fingerprint a base folder was written with, or None (no stamp: unfinished or pre-fingerprint)."""
    record = read_stamp(folder)
    return None if record is None else record["fingerprint"]


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict) and d:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): d}


_ABSENT = object()


def fingerprint_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for each dotted key whose value differs (digest left out)."""
    a = _flatten({k: v for k, v in old.items() if k != "digest"})
    b = _flatten({k: v for k, v in new.items() if k != "digest"})

    def short(v: Any) -> str:
        s = "(absent)" if v is _ABSENT else repr(v)
        return s if len(s) <= 60 else s[:57] + "..."

    return [
        f"{k}: {short(a.get(k, _ABSENT))} -> {short(b.get(k, _ABSENT))}"
        for k in sorted(set(a) | set(b))
        if a.get(k, _ABSENT) != b.get(k, _ABSENT)
    ]


class BaseDamaged(ValueError):
    """A stored base's file differs from its stamp and ``quantize.verify`` is ``fail``."""


def _stamp_problem(record: dict[str, Any]) -> str | None:
    """Why the stamp cannot describe a complete base (it lists too little), or None."""
    files = record.get("files")
    if not isinstance(files, dict) or not files:
        return "its stamp lists no files"
    if "config.json" not in files:
        return "its stamp does not list config.json"
    if not any(n.endswith(".safetensors") and "/" not in n for n in files):
        return "its stamp lists no weights"
    if not all(isinstance(v, (int, dict)) for v in files.values()):
        return "its stamp's file list is malformed"
    return None


def _damage(folder: Path, files: dict[str, Any], verify: str) -> str | None:
    """``<file>: <what differs>`` for the first listed file that is missing or differs from the stamp, or None.

    A stamp with sizes only (schema 1; ``check_base`` lets it this far under ``verify: sizes``
    alone) is checked by size."""
    legacy = all(isinstance(v, int) for v in files.values())
    manifest = {n: {"size": v} for n, v in files.items()} if legacy else files
    found = manifest_damage(folder, manifest, hashes=verify != "sizes")
    return None if found is None else f"{found[0]}: {found[1]}"


@dataclass(frozen=True)
class Decision:
    """What ``ensure_base`` will do with a folder: reuse it (``reason`` None) or write it (why).

    ``damage``: the file that differs from the stamp and how (None when none does);
    ``serving_damage``: likewise for a ``serving/`` copy with its own stamp."""

    fingerprint: dict[str, Any]
    record: dict[str, Any] | None
    reason: str | None
    damage: str | None = None
    serving_damage: str | None = None

    @property
    def reuse(self) -> bool:
        return self.reason is None


def check_base(
    model: ModelConfig | dict[str, Any],
    quantize: QuantizeConfig | dict[str, Any],
    fmt: str,
    folder: str | Path,
    *,
    force: bool = False,
) -> Decision:
    """Whether ``folder`` holds the ``fmt`` base for these settings (``force`` or ``quantize.force``: never)."""
    mcfg, qcfg = _typed(model, quantize)
    fp = base_fingerprint(mcfg, qcfg, fmt)
    record, why = _why_not_reusable(Path(folder), fp)
    damage = None
    if why is None:
        files = record["files"]
        if qcfg.verify != "sizes" and all(isinstance(v, int) for v in files.values()):
            why = (
                "its stamp records no content hashes (written before bases were hashed; "
                f"quantize.verify={qcfg.verify} re-quantizes it once, quantize.verify=sizes reuses it by its sizes)"
            )
        elif (damage := _damage(Path(folder), files, qcfg.verify)) is not None:
            why = f"damaged folder: {damage}"
    serving = None
    if why is None:
        serving = _serving_damage(Path(folder), hashes=qcfg.verify != "sizes")
    if force or qcfg.force:
        why = "quantize.force=true" if why is None else f"{why} (and quantize.force=true)"
    return Decision(fp, record, why, damage, serving)


def _why_not_reusable(folder: Path, fp: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    try:
        record = read_stamp(folder)
    except (ValueError, OSError) as err:  # unreadable / not ours: rewrite it, saying so
        return None, f"its stamp is unreadable ({err})"
    if record is None:
        if not folder.exists():
            return None, "no base there yet"
        return None, f"no fingerprint file ({STAMP}): unfinished or written before fingerprints"
    old = record["fingerprint"]
    if old.get("digest") != fp["digest"]:
        diff = fingerprint_diff(old, fp) or ["stored digest does not match its content"]
        return record, "different fingerprint: " + "; ".join(diff)
    why = _stamp_problem(record)
    if why is not None:
        return record, f"incomplete folder: {why}"
    if not isinstance(record.get("report"), dict):
        return record, "its stamp holds no quantize report"
    return record, None


# ------------------------------------------------------------------------------ writing
def write_new_base(mcfg: ModelConfig, qcfg: QuantizeConfig, fmt: str, out: Path) -> dict[str, Any]:
    """Load the model and write its ``fmt`` base to ``out`` (must not exist); the quantize report."""
    t0 = time.perf_counter()
    # bf16 is the base's master precision (checkpoint.BASE_DTYPE): loading in it halves the
    # memory of a float32 load, and the reported errors are those of the 4-bit format alone.
    base, tokenizer = load_base_model(mcfg, dtype=checkpoint.BASE_DTYPE)
    t_load = time.perf_counter() - t0
    serving_dtype = resolve_dtype(mcfg)
    settings = qcfg.model_dump()
    algorithm = formats.get(fmt).algorithm(settings)
    t1 = time.perf_counter()
    if algorithm != "rtn":
        texts = calibration_texts(qcfg.calibration_path, qcfg.calibration_samples)
        report = checkpoint.calibrated_base(
            base,
            tokenizer,
            fmt,
            out,
            algorithm=algorithm,
            texts=texts,
            ignore=list(qcfg.ignore),
            max_seq_len=mcfg.max_seq_len,
        )
    else:
        report = checkpoint.write_base(base, tokenizer, fmt, out, ignore=qcfg.ignore, settings=settings, progress=True)
    report.update(
        algorithm=algorithm,
        model=mcfg.name if mcfg.source != "random" else "random",
        load_seconds=t_load,
        quantize_seconds=time.perf_counter() - t1,
        serving_dtype=str(serving_dtype).removeprefix("torch."),
    )
    return report


def ensure_base(
    model: ModelConfig | dict[str, Any],
    quantize: QuantizeConfig | dict[str, Any],
    fmt: str,
    folder: str | Path,
    *,
    force: bool = False,
) -> tuple[Path, dict[str, Any], bool]:
    """``(folder, report, reused)``: the ``fmt`` base at ``folder``, reused when its fingerprint matches.

    ``force`` (or ``quantize.force``) rewrites it regardless. The report is the stored one on
    reuse; it carries ``reused`` and ``fingerprint`` (the digest) either way.
    """
    codec = formats.get(fmt)
    mcfg, qcfg = _typed(model, quantize)
    codec.check_settings(qcfg.model_dump())
    folder = Path(folder)
    decision = check_base(mcfg, qcfg, fmt, folder, force=force)
    digest = decision.fingerprint["digest"]
    if decision.damage is not None and qcfg.verify == "fail" and not (force or qcfg.force):
        raise BaseDamaged(
            f"base_{fmt} in {folder} is damaged: {decision.damage} (quantize.verify=fail: not re-quantized; "
            "quantize.verify=requantize or quantize.force=true rewrites it)"
        )
    if decision.reuse:
        if decision.serving_damage is not None:
            if qcfg.verify == "fail":
                raise BaseDamaged(
                    f"base_{fmt} in {folder} has a damaged serving copy: {decision.serving_damage} "
                    "(quantize.verify=fail: not removed; quantize.verify=requantize removes it, and it is "
                    "decoded again from the base on its next use)"
                )
            log.info(
                "base_%s: damaged serving copy removed (%s); it is decoded again on its next use",
                fmt,
                decision.serving_damage,
            )
            shutil.rmtree(checkpoint.serving_dir(folder))
        log.info(
            "base_%s reused: %s (fingerprint %s, same model and quantize settings; quantize.force=true redoes it)",
            fmt,
            folder,
            digest[:12],
        )
        return folder, {**decision.record["report"], "reused": True, "fingerprint": digest}, True
    log.info("base_%s quantized into %s: %s (fingerprint %s)", fmt, folder, decision.reason, digest[:12])
    with staged_dir(folder, create=False, what="base") as stage:  # the writers create the folder themselves
        report = write_new_base(mcfg, qcfg, fmt, stage)
        record = {
            "schema": STAMP_SCHEMA,
            "fingerprint": decision.fingerprint,
            "files": file_manifest(stage, skip=(STAMP,)),
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "report": report,
        }
        write_atomic(stage / STAMP, record, as_json=True)  # last: a folder without it is never reused
    log.info(
        "base_%s: %d linears, ratio %.4f vs bf16, mean rel. error %.4f, %.1f s",
        fmt,
        report["n_quantized_linears"],
        report["linear_bytes_ratio"],
        report["rel_error_mean"],
        report["quantize_seconds"],
    )
    return folder, {**report, "reused": False, "fingerprint": digest}, False


# ------------------------------------------------------------------------------ the serving copy
def _serving_record(folder: Path) -> dict[str, Any] | None:
    """The stamp of ``folder``'s ``serving/`` copy, or None (no copy, or one without its own stamp)."""
    path = checkpoint.serving_dir(folder) / SERVING_STAMP
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (ValueError, OSError):
        return {}
    return record if isinstance(record, dict) else {}


def _serving_damage(folder: Path, *, hashes: bool) -> str | None:
    """``serving/<file>: <what differs>`` for a ``serving/`` copy whose own stamp it no longer matches, else None."""
    record = _serving_record(folder)
    if record is None:
        return None
    files = record.get("files")
    if not isinstance(files, dict) or not files:
        return f"{checkpoint.SERVING_SUBDIR}/{SERVING_STAMP}: unreadable or lists no files"
    found = manifest_damage(checkpoint.serving_dir(folder), files, hashes=hashes)
    return None if found is None else f"{checkpoint.SERVING_SUBDIR}/{found[0]}: {found[1]}"


def ensure_serving(folder: str | Path) -> Path:
    """``<folder>/serving``, the dense copy of the base ``folder``, written first when it is not there or stale.

    The dtype is the base stamp's ``serving_dtype`` (float32 for a folder without a stamp). Reused
    when it has config.json and no stamp of its own (then the base's stamp lists it, or it was made
    by hand), or when its stamp names this base's digest and dtype and every file has its size.
    Written into a stage swapped in whole; a copy another process finished meanwhile is kept."""
    folder = Path(folder)
    out = checkpoint.serving_dir(folder)
    base = read_stamp(folder)
    fingerprint = (base or {}).get("fingerprint", {})
    dtype = str(fingerprint.get("serving_dtype", "float32"))
    want = {"base": fingerprint.get("digest"), "dtype": dtype}
    record = _serving_record(folder)
    if (out / "config.json").is_file():
        if record is None:
            return out
        made = {k: record.get(k) for k in want}
        why = f"decoded for {made}, this base is {want}" if made != want else _serving_damage(folder, hashes=False)
        if why is None:
            return out
        log.info("serving copy %s: %s; decoding it again", out, why)
    log.info("writing the dense serving copy of %s (%s) to %s", folder, dtype, out)
    try:
        with staged_dir(out, create=False, replace=out.exists(), what="serving copy") as stage:
            checkpoint.write_serving(folder, stage, getattr(torch, dtype))
            write_atomic(stage / SERVING_STAMP, {**want, "files": file_manifest(stage)}, as_json=True)
    except FileExistsError:
        if not (out / "config.json").is_file():
            raise
        log.info("%s: written meanwhile by another process; keeping it", out)
    return out
