#!/usr/bin/env python
"""Answer with a trained model: python scripts/predict.py --model RUN_DIR --image a.png --prompt "..." """

import sys

from vlm_recipes.cli.predict import main

if __name__ == "__main__":
    sys.exit(main())
