"""Plain helpers the test modules share, one module per concept.

Tests import them from here (``from tests.helpers.project import run_kedro``), never from
another test module or from conftest.py; fixtures that several test files use live in
tests/conftest.py and build on these helpers.
"""
