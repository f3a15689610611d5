"""LoRA dropout that draws only the positions it drops.

`nn.Dropout` draws one random number per element. LoRA's dropout sits on the input of every adapted
linear layer, and at the usual p = 0.05 almost none of those numbers matter: on a CPU the mask costs
~20x the multiply, a fifth of a QLoRA step on the bench model.

`SparseDropout` draws the dropped positions directly. K ~ Poisson(n * rate) positions are picked
uniformly with replacement; by Poisson splitting each element's hit count is then an independent
Poisson(rate), so with rate = -log(1 - p) every element is dropped independently with probability
exactly p, as `nn.Dropout` drops it. Same distribution, ~n*p random numbers instead of n.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class SparseDropout(nn.Module):
    """Drop-in for `nn.Dropout(p)`: zeroes each element with probability p, scales the rest by 1/(1-p)."""

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.hits_per_element = -math.log1p(-p)  # Poisson rate giving P(at least one hit) = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        n = x.numel()
        # The count is drawn on the CPU generator: no device sync; the positions on x's device.
        hits = int(torch.poisson(torch.tensor(n * self.hits_per_element, dtype=torch.float64)))
        dropped = torch.randint(0, n, (hits,), device=x.device)
        out = (x * (1.0 / (1.0 - self.p))).contiguous()
        out.view(-1).index_fill_(0, dropped, 0.0)  # autograd zeroes the same positions of the gradient
        return out

    def extra_repr(self) -> str:
        return f"p={self.p}"


def use_sparse_lora_dropout(model: nn.Module) -> int:
    """Swap every PEFT LoRA dropout with p > 0 for `SparseDropout(p)`; returns how many were swapped.

    Dropout holds no weights, so saved adapters are unchanged."""
    swapped = 0
    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if not isinstance(dropouts, nn.ModuleDict):
            continue
        for adapter, dropout in dropouts.items():
            if isinstance(dropout, nn.Dropout) and dropout.p > 0:
                dropouts[adapter] = SparseDropout(dropout.p)
                swapped += 1
    return swapped
