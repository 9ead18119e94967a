"""Hooks a test installs from outside the processes it starts (fault injection: engine/testing/).

The environment variable ENGINE_HOOKS names modules, comma-separated. At each hook point (an
actor coming up, the HTTP server loading a model) every named module that has a function
`install_<point>` is imported and called with the point's object, which it may change (give a
worker its step faults, wrap a served model's engine). The engine never sets the variable and
nothing a client sends can: without it nothing is imported and nothing runs. Who can set a
process's environment can run code in it anyway (PYTHONPATH, PYTHONSTARTUP).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping

HOOKS_ENV = "ENGINE_HOOKS"

log = logging.getLogger(__name__)


def install_hooks(point: str, target: object, environ: Mapping[str, str] = os.environ) -> None:
    """Run each hook module's `install_<point>(target)` (see the module doc)."""
    for name in filter(None, (part.strip() for part in environ.get(HOOKS_ENV, "").split(","))):
        install = getattr(importlib.import_module(name), f"install_{point}", None)
        if install is not None:
            log.warning("%s: %s installs its %s hook", HOOKS_ENV, name, point)
            install(target)
