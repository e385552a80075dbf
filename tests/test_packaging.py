"""The wheel must carry every package the editable install can import.

The editable finder resolves subpackages by path, so a package missing from pyproject's list
works in development and is silently absent from the built wheel (and so from the images).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_python_package_folder_is_listed_for_the_wheel() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    roots = {REPO / folder: package for package, folder in config["package-dir"].items()}
    found: set[str] = set()
    for root, package in roots.items():
        for init in root.rglob("__init__.py"):
            owner = roots.get(init.parent)
            if owner is not None and owner != package:
                continue  # a nested folder mapped to a package of its own
            found.add(".".join([package, *init.parent.relative_to(root).parts]))
    assert found - listed == set(), f"add these to [tool.setuptools] packages: {sorted(found - listed)}"


def test_nothing_is_importable_as_a_bare_operator_package() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(name.startswith("rlkube.") for name in config["packages"])
    assert all(name.startswith("rlkube.") for name in config["package-dir"])
