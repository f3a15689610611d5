"""The log-probability pass of a GRPO or RLOO step on a CPU: TRL's fused LM head in fewer passes over the
logits, with bf16 matmuls (`grpo.cpu_log_probs`).

TRL 1.16 scores a sampling step's tokens through its fused LM head (`trl/kernels/chunked_logprob.py`): the
logits in tiles of 32,768 vocabulary entries, folded into log-probabilities and entropies without keeping
them. Off a GPU it folds each tile with torch ops written after its Triton kernel, and it accumulates the
hidden state's gradient with `addmm` in fp32, since a bf16 matmul with an fp32 output exists only on CUDA:
on a CPU those are fp32 matmuls (5x a bf16 one on an Intel Xeon with AMX), plus ~10 element-wise passes over
the [tokens, vocabulary] tile forward and backward.

Ours computes the same function where the vocabulary is one tile (every model with a vocabulary of at most
32,768; TRL's own way otherwise), on the positions with a label only, as TRL does on a GPU:
- forward: the tile, `logsumexp`, the target's logit, and the entropy from the probabilities;
- backward: the probabilities in place, the target's 1 added by `scatter_add_` (not a [tokens, vocabulary]
  comparison), one bf16 matmul for the hidden state's gradient. oneDNN accumulates a bf16 matmul in fp32
  and rounds once, as TRL's fp32 `addmm` followed by its cast to the hidden state's dtype does: with one tile the
  two differ only in the order of the sum.
"""

from __future__ import annotations

import contextlib

import torch
from trl.kernels import chunked_logprob
from trl.trainer import utils as trl_utils

OUTPUTS = ("log_probs", "entropy")  # what a sampling step asks of the fused head (GRPOTrainer, RLOOTrainer)


def handles(hidden, weight, bias, chunk_size, final_logit_softcapping, outputs) -> bool:
    """Where this path computes the fused head: a CPU, one vocabulary tile, no bias or soft cap, and only
    log-probabilities and entropies asked for; TRL's own path everywhere else."""
    return (
        hidden.device.type == "cpu"
        and weight.shape[0] <= chunk_size
        and bias is None
        and final_logit_softcapping is None
        and set(outputs) <= {"entropy", "log_probs"}
    )


class CpuLogProbs(torch.autograd.Function):
    """TRL's ChunkedLogProbFunction (same arguments and outputs), on a CPU with one vocabulary tile."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs):
        ctx.set_materialize_grads(False)
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else hidden.dtype
        scale = logit_scale / temperature
        z = torch.mm(hidden.to(dtype), weight.to(dtype).t()).float()
        if scale != 1:
            z.mul_(scale)
        log_z = torch.logsumexp(z, dim=-1)
        logprobs = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z
        entropy = None
        if "entropy" in outputs:  # H = log Z - sum_j p_j z_j
            entropy = log_z - torch.linalg.vecdot((z - log_z.unsqueeze(-1)).exp_(), z)
        ctx.save_for_backward(hidden, weight, targets, log_z, log_z if entropy is None else entropy)
        ctx.dtype, ctx.scale = dtype, scale
        return logprobs, entropy, None, None, None

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_):
        hidden, weight, targets, log_z, entropy = ctx.saved_tensors
        w = weight.to(ctx.dtype)
        z = torch.mm(hidden.to(ctx.dtype), w.t()).float()
        if ctx.scale != 1:
            z.mul_(ctx.scale)
        log_p = z.sub_(log_z.unsqueeze(-1))
        p = log_p.exp()
        grad = torch.zeros_like(p)
        if grad_logprobs is not None:  # d log p_target / dz_j = 1[j = target] - p_j
            g = grad_logprobs.float().unsqueeze(-1)
            grad.sub_(p * g).scatter_add_(-1, targets.unsqueeze(-1), g)
        if grad_entropy is not None:  # dH / dz_j = -p_j (log p_j + H)
            grad.sub_(p * log_p.add_(entropy.unsqueeze(-1)) * grad_entropy.float().unsqueeze(-1))
        if ctx.scale != 1:
            grad.mul_(ctx.scale)
        grad = grad.to(ctx.dtype)
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = torch.mm(grad, w).to(hidden.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = torch.mm(grad.t(), hidden.to(ctx.dtype)).to(weight.dtype)
        return grad_hidden, grad_weight, *([None] * 7)


class _Dispatch:
    """Stands where TRL's fused head looks up its function: ours where it `handles`, TRL's otherwise."""

    @staticmethod
    def apply(
        hidden, weight, bias, targets, temperature, chunk_size, softcap=None, logit_scale=1.0, outputs=()
    ):
        chosen = (
            CpuLogProbs
            if handles(hidden, weight, bias, chunk_size, softcap, outputs)
            else chunked_logprob.ChunkedLogProbFunction
        )
        return chosen.apply(
            hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs
        )


def scores_labelled_positions_only(device: torch.device) -> bool:
    """TRL's fused head scores only the positions with a label where this says so (TRL: with Triton). Off a
    GPU TRL scores every position, the prompt's too, so that a Neuron device compiles one tile shape; a CPU
    compiles nothing, and our path takes any number of rows."""
    return device.type == "cpu" or chunked_logprob._use_triton(device)


@contextlib.contextmanager
def cpu_log_probs():
    """TRL's fused LM head computes through `_Dispatch` inside the block (the log-probability passes), on
    the labelled positions only."""
    originals = trl_utils._ChunkedLogProbFunction, trl_utils._use_triton
    trl_utils._ChunkedLogProbFunction, trl_utils._use_triton = _Dispatch, scores_labelled_positions_only
    try:
        yield
    finally:
        trl_utils._ChunkedLogProbFunction, trl_utils._use_triton = originals
