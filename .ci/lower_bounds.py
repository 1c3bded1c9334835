"""The lower bounds of pyproject.toml as pins, and whether this environment has exactly them.

    python .ci/lower_bounds.py --check        # exit 0: every bound installed at its version
    python .ci/lower_bounds.py --write FILE   # pip constraints: name==bound, one per line

Bounds are read from ``[project] dependencies`` and the ``toy`` and ``test`` extras (the
packages the test command installs); ``jaxlib`` is pinned with ``jax``, which it is
released with. ``.ci/run`` uses this to test the lower bounds whenever the newest versions
pip resolves have moved past them.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("toy", "test")


def bounds() -> dict[str, str]:
    """``{distribution name: lower bound}`` of every ``name>=version`` requirement."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in EXTRAS:
        requirements += project["optional-dependencies"][extra]
    found = {}
    for requirement in requirements:
        match = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)\s*", requirement)
        if match:
            found[match[1].lower()] = match[2]
    if "jax" in found:
        found.setdefault("jaxlib", found["jax"])
    return found


def mismatches(pins: dict[str, str]) -> list[str]:
    """``'name: installed X, bound Y'`` for every pinned package not installed at its bound."""
    out = []
    for name, bound in sorted(pins.items()):
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = "none"
        if installed != bound:
            out.append(f"{name}: installed {installed}, lower bound {bound}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument(
        "--check", action="store_true", help="exit 1 unless all bounds are installed"
    )
    group.add_argument("--write", metavar="FILE", help="write pip constraints pinning the bounds")
    args = parser.parse_args(argv)
    pins = bounds()
    if args.write:
        Path(args.write).write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
        return 0
    differ = mismatches(pins)
    for line in differ:
        print(f"lower bounds: {line}")
    if not differ:
        print(f"lower bounds: all {len(pins)} installed at their bound")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
