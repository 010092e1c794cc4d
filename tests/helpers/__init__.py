"""Helpers and fixtures that several test modules share, one concept a module: test modules
import from here (or from tests/conftest.py, tests/tiny_models.py), never from each other."""
