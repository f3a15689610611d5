"""The offline demo: tiny models built per family on first use, and the synthetic datasets."""
