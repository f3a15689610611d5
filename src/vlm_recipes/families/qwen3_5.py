"""Qwen3.5: natively multimodal, a hybrid language model (the tiny offline builder of `demo:tiny-qwen3.5`
and `demo:tiny-qwen3.5-moe`: `demo/tiny/qwen3_5.py`).

What differs from Qwen3-VL (transformers' models/qwen3_5, models/qwen3_5_moe):
- the language model is hybrid: three Gated DeltaNet layers (`linear_attn`: linear attention with a
  recurrent state and a short causal convolution) to every full-attention layer (`self_attn`, whose
  output is gated by a sigmoid of a second half of `q_proj`); rotary positions on a quarter of each head,
  Qwen3-VL's interleaved 3-D M-RoPE;
- the tower is Qwen3-VL's without DeepStack: one merger, so `get_image_features` returns the merged tokens
  only; the processor is Qwen3VLProcessor, the tokenizer Qwen3_5Tokenizer (its own pre-tokenizer);
- the chat template thinks: the 4B and larger write `<think>\\n...\\n</think>\\n\\n` before every answer
  after the last question (TRL's training variant always does, so the loss covers it);
- the MoE (`qwen3_5_moe`: Qwen3.5-35B-A3B) replaces every MLP with a routed block: a router (`mlp.gate`,
  a bare matrix), experts as two fused 3-D parameters (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`,
  not `nn.Linear`), and a shared expert with its own sigmoid gate (`mlp.shared_expert`, `mlp.shared_expert_gate`).
"""

from __future__ import annotations

from vlm_recipes.families.qwen2_vl import QWEN_VL_ROLES, Qwen2VLFamily

# transformers#46093, ms-swift#9565: packed Qwen3.5 rows leaked the linear-attention state across samples.
LINEAR_ATTENTION_PACKING = (
    "Qwen3.5's Gated DeltaNet layers carry a recurrent state and a causal convolution along the whole row, "
    "so in a packed row each sample would start from the state the samples before it left "
    "(transformers#46093); transformers keeps packed samples apart only with the flash-linear-attention and "
    "causal-conv1d CUDA kernels, and refuses packed sequences without them. Set training.padding_free: false"
)


class Qwen3_5Family(Qwen2VLFamily):
    """Qwen3.5 and Qwen3.5-MoE: the Qwen-VL layout (`model.visual`, `model.language_model`), one merger."""

    # lmms-eval 0.7.3's --model for a stage's final/ (cli/lmms_eval.py), and why none loads the MoE
    lmms_eval_models = {"qwen3_5": "qwen3_5"}
    no_lmms_eval_model = {
        "qwen3_5_moe": "qwen3_5 loads the dense class unless the path names the size (`A3B`)"
    }

    # its linear-attention layers (Gated DeltaNet) carry a state along the row, which Ulysses' all-to-all
    # around softmax attention does not reach
    sequence_parallel_refusal = (
        "its linear-attention layers (Gated DeltaNet) carry a recurrent state along the whole row; the Ulysses "
        "all-to-all splits only softmax attention"
    )

    def video_encoder(self) -> str | None:
        return None  # get_video_features calls get_image_features, which the speed-ups already hook

    def padding_free_refusal(self) -> str | None:
        return LINEAR_ATTENTION_PACKING


QWEN3_5 = Qwen3_5Family(name="qwen3.5", model_types=("qwen3_5",), role_prefixes=QWEN_VL_ROLES)
QWEN3_5_MOE = Qwen3_5Family(name="qwen3.5-moe", model_types=("qwen3_5_moe",), role_prefixes=QWEN_VL_ROLES)
