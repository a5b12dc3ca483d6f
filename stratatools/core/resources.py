"""Packaged data: the release registry and allocation maps (``stratatools.allocations``, the repository's
``allocations/``) and the prompt suites, demo inputs and reference profiles (``stratatools.data``, the
repository's ``data/``). Both ship in the wheel and are read through :mod:`importlib.resources`, so an
installed stratatools works with no repository beside it.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def packaged(package: str, *parts: str) -> Path:
    """Path of a packaged file, e.g. ``packaged("allocations", "releases.toml")``.

    Args:
        package: ``"allocations"`` or ``"data"``.
        parts: path components inside that package.
    Returns:
        a filesystem path (wheels and editable installs are plain folders; zip imports are not supported).
    An editable install (``pip install -e``, as ``make`` does) maps only the ``stratatools`` folder, not the
    top-level folders that the wheel renames into it; there the repository's own folder is used.
    """
    try:
        root = Path(str(resources.files(f"stratatools.{package}")))
    except ModuleNotFoundError:
        root = Path(__file__).resolve().parents[2] / package
    return root.joinpath(*parts)
