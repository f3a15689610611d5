"""The vision tower's patch embedding computed as the matrix product it is.

A ViT's patch embedding is a convolution whose stride is its kernel: the patches don't overlap, so each
output is one patch's pixels times the kernel, a linear layer over flattened patches. The Qwen line even
hands its Conv3d one patch per row (the processor has already cut the image into patches). PyTorch's CPU
convolution does not see that: on the bench model's tower (3x2x14x14 kernel, 256 channels) its forward
is ~2x and its weight gradient ~8x slower than the same product as a matmul, a tenth of a vision-training
step. GPU convolution kernels have the same blind spot for Conv3d, which is why vLLM also runs Qwen's
patch embedding as a linear layer.

The weights are the convolution's own, only viewed as a matrix: the state dict, checkpoints and saved
models are unchanged. The result differs only by the order of the sums (tests/test_speedups.py).
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F
from torch import nn


def is_patch_convolution(module: nn.Module) -> bool:
    """A convolution over non-overlapping patches: stride = kernel, no padding, dilation or groups."""
    return (
        isinstance(module, (nn.Conv2d, nn.Conv3d))
        and tuple(module.stride) == tuple(module.kernel_size)
        and (module.padding == "valid" or all(p == 0 for p in module.padding))
        and all(d == 1 for d in module.dilation)
        and module.groups == 1
    )


def patch_convolution_as_matmul(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The convolution's output, [batch, out, *grid], computed as patches [batch * grid, in * kernel] times
    the kernel viewed as [out, in * kernel]."""
    kernel = tuple(self.kernel_size)
    if x.dim() != len(kernel) + 2 or any(s % k for s, k in zip(x.shape[2:], kernel, strict=False)):
        return type(self).forward(self, x)  # a border the convolution would drop: not ours to redo
    batch, channels, sizes = x.shape[0], x.shape[1], x.shape[2:]
    grid = [s // k for s, k in zip(sizes, kernel, strict=True)]
    x = x.reshape(batch, channels, *[n for g, k in zip(grid, kernel, strict=True) for n in (g, k)])
    # [batch, channels, g0, k0, g1, k1, ...] -> [batch, g0, g1, ..., channels, k0, k1, ...]
    dims = len(kernel)
    order = [0, *range(2, 2 + 2 * dims, 2), 1, *range(3, 3 + 2 * dims, 2)]
    patches = x.permute(order).reshape(batch * math.prod(grid), channels * math.prod(kernel))
    out = F.linear(patches, self.weight.flatten(1), self.bias)
    return out.view(batch, *grid, -1).movedim(-1, 1)


def use_matmul_patch_embedding(tower: nn.Module) -> list[str]:
    """Switch every patch convolution in the tower to `patch_convolution_as_matmul`; their names."""
    switched = []
    for name, module in tower.named_modules():
        if is_patch_convolution(module):
            module.forward = types.MethodType(patch_convolution_as_matmul, module)
            switched.append(name)
    return switched
