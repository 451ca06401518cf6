"""BF16: the identity "codec", the plain base of the LoRA baselines.

Nothing is quantized: every linear keeps its bf16 weight (the master precision every base is
written in), the base folder is a plain Hugging Face model, and the policy holds ordinary
frozen ``nn.Linear`` layers. It is a codec so that the checkpoint writer, the policy, serving
and the planner treat every format alike (``quantization/codec.py``): on CPU an engine serves
the ``serving/`` copy (the same weights in the serving dtype), on CUDA the base folder itself.
"""

from __future__ import annotations

from qerl_pipeline.quantization.codec import Codec, Served, register


class BF16Codec(Codec):
    """The plain base: no tensors of its own, served as it is."""

    name = "bf16"
    label = "BF16"
    cuda = Served(".", "bf16", True)


CODEC = register(BF16Codec())
