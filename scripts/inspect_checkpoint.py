#!/usr/bin/env python
"""Print what the guards see in a model: python scripts/inspect_checkpoint.py PATH [--quantization 4bit]"""

import sys

from vlm_recipes.cli.inspect_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
