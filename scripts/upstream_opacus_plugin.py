"""A pytest plugin: upstream Opacus's own tests, with our ``PrivacyEngine`` in place of theirs.

Loaded by ``scripts/upstream_opacus_tests.sh`` (``-p upstream_opacus_plugin``) before the tests
are collected, so that their ``from opacus import PrivacyEngine`` imports ours. Environment:

- ``UPSTREAM_ENGINE``: ``ours`` (default) or ``opacus`` (the baseline: nothing swapped).
- ``UPSTREAM_SEED_BRIDGE``: ``1`` (default) or ``0``. Upstream draws noise and Poisson batches
  from torch's global generator, and its tests fix them with ``torch.manual_seed``; ours draws
  them from OS entropy unless ``dp_seed`` is given. With the bridge, every engine the tests
  build without a ``dp_seed`` gets one drawn from torch's global generator at construction, so
  that the same ``torch.manual_seed`` gives the same draws (only in this harness: it makes the
  DP randomness as public as the test's seed).

It also lets a CUDA build of torchvision import on a CPU torch: its ``_meta_registrations`` and
``_autograd_registrations`` register kernels for the compiled ``torchvision::`` operators,
which a CPU torch without them refuses; the tests use models, transforms and ``FakeData`` only.
"""

from __future__ import annotations

import importlib
import os
import sys
import types


def _stub_torchvision_registrations() -> None:
    """Imports torchvision, with the two operator-registration modules stubbed if it fails."""
    try:
        importlib.import_module("torchvision")
    except ImportError:
        return  # not installed: the tests that need it fail to import, as they would upstream
    except RuntimeError:  # "operator torchvision::nms does not exist"
        for name in list(sys.modules):
            if name == "torchvision" or name.startswith("torchvision."):
                del sys.modules[name]
        for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
            sys.modules[name] = types.ModuleType(name)
        importlib.import_module("torchvision")


def _harness_engine(ours: type) -> type:
    """Our engine, with the seed bridge (see the module docstring) when asked for."""
    import torch

    if os.environ.get("UPSTREAM_SEED_BRIDGE", "1") != "1":
        return ours

    class PrivacyEngine(ours):
        """Ours; ``dp_seed`` drawn from torch's global generator unless given."""

        def __init__(self, *args, dp_seed=None, secure_mode=False, **kwargs):
            if dp_seed is None and not secure_mode:
                dp_seed = int(torch.randint(0, 2**62, (1,)).item())
            super().__init__(*args, dp_seed=dp_seed, secure_mode=secure_mode, **kwargs)

    return PrivacyEngine


def pytest_configure(config) -> None:
    """Swaps the engine in before collection imports the tests."""
    _stub_torchvision_registrations()
    if os.environ.get("UPSTREAM_ENGINE", "ours") == "opacus":
        return
    import opacus
    import opacus.privacy_engine

    from opacus_fsdp_sync import PrivacyEngine as Ours

    engine = _harness_engine(Ours)
    opacus.PrivacyEngine = engine
    opacus.privacy_engine.PrivacyEngine = engine
