"""job.custom_import: the module that registers a model (or dataset) from outside the repository.

It is a .py file path, or a module name found on the Python path, in the working directory or
beside the config file, so a model folder needs no PYTHONPATH.
"""

import importlib
import importlib.util
import os
import sys
from pathlib import Path

from components.runtime.errors import KilnError


def import_custom(name: str, config_dir: str | Path = "") -> None:
    """Import job.custom_import `name`: a .py file (relative to the working directory, else to the
    config file's folder) or a module name (also searched in both folders)."""
    folders = [Path(os.getcwd())] + ([Path(config_dir)] if config_dir else [])
    try:
        if name.endswith(".py"):
            _import_file(name, folders)
        else:
            for folder in reversed(folders):
                if str(folder) not in sys.path:
                    sys.path.insert(0, str(folder))
            importlib.import_module(name)
    except ImportError as e:
        raise KilnError(f"job.custom_import {name!r} cannot be imported: {e} (give a .py file path, or a "
                        f"module in the working directory or beside the config file)") from None


def _import_file(name: str, folders: list[Path]) -> None:
    """Run a .py file as the module named by its stem (so a second import of that name finds it)."""
    given = Path(name).expanduser()
    candidates = [given] if given.is_absolute() else [folder / given for folder in folders]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise KilnError(f"job.custom_import {name!r}: no such file (looked in "
                        f"{', '.join(str(p) for p in candidates)})")
    if path.stem in sys.modules and getattr(sys.modules[path.stem], "__file__", None) == str(path):
        return
    sys.path.insert(0, str(path.parent))  # the file may import its neighbours
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[path.stem] = module
    module_spec.loader.exec_module(module)
