"""Imports the profiling harness's scripts (not a package) by path, for tests."""

import importlib.util
import sys
from pathlib import Path

SUITE = Path(__file__).resolve().parents[1] / "memory_test/fsdp_llama3_profiling"


def load_script(name: str):
    """Returns the module ``memory_test/fsdp_llama3_profiling/{name}.py``, imported once."""
    key = f"fsdp_llama3_profiling_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, SUITE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
