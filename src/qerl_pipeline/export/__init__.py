"""The trained policy, out of the project: folders that transformers, PEFT, vLLM and MLflow load without this code.

One export per training (a method's ``trained_adapters/<method>``, or a compare branch's
``seed-<k>``), written into one folder (``folders.write_export``; layout in ``folders``):

* ``adapter/`` + ``base/``: the trained LoRA as a standard PEFT folder over a dense base decoded
  from the very codes the training used; trained RMSNorm weights travel as PEFT
  ``modules_to_save``, so ``PeftModel.from_pretrained`` applies them;
* ``merged/``: ``W + scale * B @ A`` (float32, then ``export.dtype``) with the trained norms, a
  plain dense Hugging Face folder;
* ``merged_nvfp4/`` (every method) and ``merged_nf4/`` (qlora): the merged policy quantized again
  (``quantized.requantize``: compressed-tensors NVFP4 as llmcompressor writes it, bitsandbytes NF4);
* ``vllm_lora/`` (only with trained norms): the base with the trained norms written in and a
  LoRA-only adapter, what ``vllm serve --enable-lora`` takes (vLLM refuses norm weights in an adapter).

``serve.served_export`` serves any such folder through the project's engine (a compressed one
decoded to dense on CPU, where vLLM has no FP4 kernel); ``accuracy`` scores ``merged_nvfp4/``
beside base + adapter on the same problems and seeds and states the 4-bit cost with intervals;
``registry`` logs the export into the training's MLflow run and registers a model version.

Errors a user makes are one ``Error:`` line (a ``click.ClickException``, no traceback), raised before
any model loads: no training for the method or seed (``adapter.MissingTraining``, what evaluate says
too); a missing base, another base than the training's, a folder that is not a model (``ExportInputError``).
"""

from __future__ import annotations

import click


class ExportInputError(click.ClickException, FileNotFoundError):
    """What the export (or the evaluation of an exported folder) needs is not there: one line naming it and
    the command that makes it; ``kedro run`` prints it as ``Error: ...`` with exit code 1."""
