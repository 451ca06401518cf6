"""``python -m qerl_pipeline.planner``: the memory planner's CLI (``planner/cli.py``)."""

from qerl_pipeline.planner.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
