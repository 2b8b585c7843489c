"""Helpers shared by several test modules."""

import importlib.util
from pathlib import Path


def load_app(path: Path):
    """An app's module, loaded in this process (a subprocess each is slow)."""
    spec = importlib.util.spec_from_file_location(path.stem + "_app", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
