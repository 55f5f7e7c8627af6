"""Every workflow module imported: each registers its crash points at import, so the
list of them (`vigil crashpoints`, the docs, the crash matrix) is whole."""

from __future__ import annotations

import importlib
import pkgutil


def every_workflow() -> None:
    import workflows

    for info in pkgutil.walk_packages(workflows.__path__, "workflows."):
        importlib.import_module(info.name)
