"""The caches, all keyed by one digest (keys.py): token counts, preprocessed samples, their storage with a
size cap. The vision feature cache is a speed-up (speedups/frozen_vision.py) that stores here too."""
