"""The memory planner: what one GPU holds during a training run, whether it fits, the largest batches that do.

``sizing`` is the memory model (``plan(cfg, shape, gpu_gib)``, the library call), ``inputs``
reads the config through Kedro's loader and resolves the model's shape, ``cli`` prints plans
(``python -m qerl_pipeline.planner``).
"""
