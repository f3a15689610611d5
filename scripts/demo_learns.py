#!/usr/bin/env python
"""Does the demo teach? python scripts/demo_learns.py [--models ...] [--recipe r1-llm-only] [--seeds 0,1]"""

import sys

from vlm_recipes.cli.demo_learns import main

if __name__ == "__main__":
    sys.exit(main())
