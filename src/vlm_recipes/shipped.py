"""Where the files shipped beside the code are: the recipes and the accelerate/DeepSpeed configs.

They live once, at the repository's top level (recipes/, configs/), where a reader finds, copies and edits
them. A wheel carries copies inside the package (setup.py's build_py puts them there), so an installed
package finds its own. Import-light on purpose: `--recipe` is resolved before torch is imported.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SHIPPED_KINDS", "shipped_dir"]

PACKAGE_DIR = Path(__file__).resolve().parent
# top-level folder of the repository → where the wheel puts it inside the package (setup.py copies them)
SHIPPED_KINDS = {"recipes": "recipes/builtin", "configs": "launch/configs"}


def shipped_dir(kind: str) -> Path:
    """The folder of a shipped kind ("recipes" or "configs"): the repository's top-level folder when the
    package runs from a checkout (src layout: <root>/src/vlm_recipes, editable install or scripts/), else
    the copy inside the installed package."""
    if kind not in SHIPPED_KINDS:
        raise KeyError(f"no shipped kind {kind!r}: one of {', '.join(SHIPPED_KINDS)}")
    root = PACKAGE_DIR.parents[1]
    if PACKAGE_DIR.parent.name == "src" and (root / "pyproject.toml").is_file() and (root / kind).is_dir():
        return root / kind
    return PACKAGE_DIR / SHIPPED_KINDS[kind]
