#!/usr/bin/env python
"""Compare runs: python scripts/compare_recipes.py [RUN_DIR ...|--latest] [--output-dir runs]"""

import sys

from vlm_recipes.cli.compare import main

if __name__ == "__main__":
    sys.exit(main())
