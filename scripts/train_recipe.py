#!/usr/bin/env python
"""Run a recipe: python scripts/train_recipe.py --recipe r3-two-stage [--dry-run] [key=value ...]"""

import sys

from vlm_recipes.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
