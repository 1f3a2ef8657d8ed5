"""Load a script of ``examples/`` as a module (examples are not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import ray

EXAMPLES = Path(__file__).parents[2] / "examples"


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as the module ``name``; its classes pickle by value, so the
    Ray actors it defines reach workers that cannot import it."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)
    return module
