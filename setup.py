"""Only the build step that copies recipes/ and configs/ into the wheel; pyproject.toml holds the metadata.

The shipped recipes and accelerate/DeepSpeed configs live once, at the repository's top level, where a user
reads, copies and edits them. setuptools' package-data only takes files inside the package folder, so the
wheel gets them here: copied into the built package where vlm_recipes/shipped.py looks for them in an
installed package. An editable install needs no copy (shipped.py reads the repository's folders).
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# top-level folder → folder inside the built package (the same table as vlm_recipes/shipped.py's SHIPPED_KINDS)
SHIPPED = {"recipes": "vlm_recipes/recipes/builtin", "configs": "vlm_recipes/launch/configs"}


class BuildPyWithShippedFiles(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        for folder, inside in SHIPPED.items():
            target = Path(self.build_lib) / inside
            shutil.rmtree(target, ignore_errors=True)  # a recipe deleted since the last build must not ship
            target.mkdir(parents=True)
            for path in sorted((ROOT / folder).glob("*.yaml")):
                shutil.copy2(path, target / path.name)


setup(cmdclass={"build_py": BuildPyWithShippedFiles})
