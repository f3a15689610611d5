"""The loaded model: building it (roles, LoRA, quantization), the guards that keep it trainable, its dtype
boundaries, the freeze audit, and what `vlm-recipes inspect` shows of it."""
