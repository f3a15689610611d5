"""The tiny offline Qwen3-Omni thinker (`qwen3_omni_moe_thinker`) of Qwen3-Omni-30B-A3B-Instruct: its
Qwen3OmniMoeProcessor (Qwen2VLImageProcessor, Qwen2VLVideoProcessor, WhisperFeatureExtractor, a Qwen2Tokenizer
with the audio and TTS tokens) and chat template, a Qwen3-VL-style tower (16 px patches merged 2x2,
DeepStack), a Whisper-style audio tower, a Qwen3 MoE text model with interleaved mRoPE. The thinker alone, as
AutoModelForImageTextToText loads it: the published `qwen3_omni_moe` adds the talker and code2wav that speak,
and Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained reads only its thinker."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.tiny import (
    TinyModel,
    qwen_generation,
    qwen_tokenizer_from,
    save_tiny_model,
    train_qwen_bpe,
)
from vlm_recipes.demo.tiny.dims import TINY_MOE_DIMS, TINY_TEXT_DIMS, tiny_text_config
from vlm_recipes.demo.tiny.qwen2_vl import QWEN_VL_SPECIAL_TOKENS
from vlm_recipes.demo.tiny.qwen3_vl import QWEN3_ADDED_TOKENS, qwen3_vision_config

MIRRORS = "Qwen/Qwen3-Omni-30B-A3B-Instruct"

# After Qwen3's ids, the published tokenizer adds its audio and TTS tokens (151669..151675), all special.
QWEN3_OMNI_AUDIO_TOKENS = (
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
SPECIAL_TOKENS = (*QWEN_VL_SPECIAL_TOKENS, *QWEN3_OMNI_AUDIO_TOKENS)
# The tokenizer_config.json's named tokens, which Qwen3OmniMoeProcessor reads off the tokenizer.
NAMED_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "audio_token": "<|audio_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}

# Qwen3-Omni-30B-A3B-Instruct's chat template (its chat_template.json), byte for byte as copied in two public
# repos that agree: github.com/kyr0/qwen3-omni-vllm-docker chat-template.jinja2 (d8aab12, served with the
# Instruct checkpoint) and github.com/TheDoctor-JI/Qwen3-Omni tests/fixtures/thinking_chat_template.json
# (the Thinking checkpoint's, fetched from its repo): the Instruct and Thinking templates are identical.
QWEN3_OMNI_CHAT_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}\n"
    '    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are '
    'provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n'
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n{%- else %}\n'
    "    {%- if messages[0].role == 'system' %}\n        {%- if messages[0].content is string %}\n"
    "            {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "        {%- else %}\n            {%- for content in messages[0].content %}\n"
    "                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}\n"
    "                    {{- '<|im_start|>system\\n' +\"<|vision_start|><|image_pad|><|vision_end|>\"+ "
    "'<|im_end|>\\n' }}\n"
    "                {%- elif content.type == 'audio' or 'audio' in content or 'audio_url' in content %}\n"
    "                    {{- '<|im_start|>system\\n' +\"<|audio_start|><|audio_pad|><|audio_end|>\"+ "
    "'<|im_end|>\\n' }}\n                {%- elif content.type == 'video' or 'video' in content %}\n"
    "                    {{- '<|im_start|>system\\n' +\"<|vision_start|><|video_pad|><|vision_end|>\"+ "
    "'<|im_end|>\\n' }}\n                {%- elif content.type == 'text' %}\n"
    "                    {{- '<|im_start|>system\\n' +content.text+ '<|im_end|>\\n' }}\n"
    "                {%- endif %}\n            {%- endfor %}\n        {%- endif %}\n    {%- endif %}\n"
    "{%- endif %}\n{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    '    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and '
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) "
    "%}\n        {%- set ns.multi_step_tool = false %}\n        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n{%- endfor %}\n{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n        {%- set content = message.content %}\n"
    '    {%- else %}\n        {%- set content = namespace(text="") %}\n'
    "        {%- for mcontent in message.content %}\n"
    "            {%- if mcontent.type == 'image' or 'image' in mcontent or 'image_url' in mcontent %}\n"
    '                {%- set content.text = content.text~"<|vision_start|><|image_pad|><|vision_end|>" %}\n'
    "            {%- elif mcontent.type == 'audio' or 'audio' in mcontent or 'audio_url' in mcontent %}\n"
    '                {%- set content.text = content.text~"<|audio_start|><|audio_pad|><|audio_end|>" %}\n'
    "            {%- elif mcontent.type == 'video' or 'video' in mcontent %}\n"
    '                {%- set content.text = content.text~"<|vision_start|><|video_pad|><|vision_end|>" %}\n'
    "            {%- elif mcontent.type == 'text' %}\n"
    "                {%- set content.text = content.text~mcontent.text %}\n            {%- endif %}\n"
    "        {%- endfor %}\n        {%- set content = content.text %}\n    {%- endif %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n        {%- set reasoning_content = "" %}\n'
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n        {%- else %}\n"
    "            {%- if '</think>' in content %}\n            {%- set reasoning_content = "
    "content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n"
    "            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n        {%- endif %}\n"
    "    {%- endif %}\n    {%- if loop.index0 > ns.last_query_index %}\n"
    "        {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip(\"\\n\") "
    "+ '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}\n"
    "    {%- else %}\n        {{- '<|im_start|>' + message.role + '\\n' + content }}\n    {%- endif %}\n"
    "    {%- if message.tool_calls %}\n        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}\n"
    "            {%- if tool_call.function %}\n                {%- set tool_call = tool_call.function %}\n"
    '            {%- endif %}\n            {{- \'<tool_call>\\n{"name": "\' }}\n'
    '            {{- tool_call.name }}\n            {{- \'", "arguments": \' }}\n'
    "            {%- if tool_call.arguments is string %}\n                {{- tool_call.arguments }}\n"
    "            {%- else %}\n                {{- tool_call.arguments | tojson }}\n"
    "            {%- endif %}\n            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n"
    "    {%- endif %}\n    {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' "
    "}}{%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n        {{- content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- "
    "endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}{{- "
    "'<think>\\n\\n</think>\\n\\n' }}{%- endif %}\n{%- endif %}\n"
)


def qwen3_omni_tokenizer(corpus: list[str]):
    """Qwen3-Omni's Qwen2Tokenizer around a BPE trained on `corpus` with Qwen's pre-tokenizer: the special
    tokens, Qwen3's added ones (not special) and the audio/TTS ones, numbered in the published order, and the
    named image/video/audio tokens of its tokenizer_config.json."""
    vocab, merges = train_qwen_bpe(
        corpus, (*QWEN_VL_SPECIAL_TOKENS, *QWEN3_ADDED_TOKENS, *QWEN3_OMNI_AUDIO_TOKENS)
    )
    extra_special = [t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|im_end|>")]
    return qwen_tokenizer_from(vocab, merges, extra_special, QWEN3_ADDED_TOKENS, **NAMED_TOKENS)


def build_tiny_qwen3_omni(out: Path, dims: dict, corpus: list[str]) -> None:
    """The thinker, with the published processor settings but for the image size bounds (dims' max_pixels)."""
    import transformers

    tok = qwen3_omni_tokenizer(corpus)
    tok.chat_template = QWEN3_OMNI_CHAT_TEMPLATE
    # as its preprocessor_config.json: 16 px patches merged 2x2, mean and std 0.5, min_pixels 56x56; Whisper
    # log-mel features, 128 bins, 16 kHz, 300 s windows
    size = {"shortest_edge": 3136, "longest_edge": dims["max_pixels"]}
    vision = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "size": size}
    vision |= {"image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    processor = transformers.Qwen3OmniMoeProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(**vision),
        video_processor=transformers.Qwen2VLVideoProcessor(**vision),
        feature_extractor=transformers.WhisperFeatureExtractor(
            feature_size=128, chunk_length=300, return_attention_mask=True
        ),
        tokenizer=tok,
        chat_template=QWEN3_OMNI_CHAT_TEMPLATE,
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in (*SPECIAL_TOKENS, "user")}
    config = transformers.Qwen3OmniMoeThinkerConfig(
        text_config=tiny_text_config(
            tok,
            dims,
            model_type="qwen3_omni_moe_text",
            head_dim=dims["hidden"] // dims["heads"],
            num_experts=dims["experts"],
            num_experts_per_tok=dims["experts_per_token"],
            moe_intermediate_size=dims["expert_intermediate"],
            decoder_sparse_step=1,  # every layer sparse, as published
            norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": dims["mrope"]}
            | {"interleaved": True, "mrope_interleaved": True},
            tie_word_embeddings=False,
        ),
        vision_config=qwen3_vision_config(dims, deepstack_visual_indexes=dims["deepstack"]),
        audio_config={
            "encoder_layers": dims["audio_layers"],
            "d_model": dims["audio_dim"],
            "encoder_attention_heads": dims["audio_heads"],
            "encoder_ffn_dim": dims["audio_intermediate"],
            "downsample_hidden_size": dims["audio_downsample"],
            "num_mel_bins": 128,
            "output_dim": dims["hidden"],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        audio_token_id=ids["<|audio_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],  # read by get_rope_index, though no declared field
        vision_end_token_id=ids["<|vision_end|>"],
        audio_start_token_id=ids["<|audio_start|>"],
        audio_end_token_id=ids["<|audio_end|>"],
        user_token_id=ids["user"],
        position_id_per_seconds=13,
        seconds_per_chunk=2,
        tie_word_embeddings=False,
    )
    # generation stops at <|im_end|>, the template's end of turn; pads with <|endoftext|>; no bos
    save_tiny_model(
        out,
        transformers.Qwen3OmniMoeThinkerForConditionalGeneration,
        config,
        processor,
        dims,
        **qwen_generation(ids),
    )


# What build_tiny_qwen3_omni builds, one dict per demo model (BUILDS below)
TINY = {
    **TINY_TEXT_DIMS,
    "mrope": [4, 2, 2],  # 8 rotary frequencies, interleaved t/h/w: the published [24, 20, 20] of 64, scaled
    **TINY_MOE_DIMS,  # the published: 128 experts, 8 per token, 768 wide
    "vision_depth": 2,
    "vision_dim": 32,
    "vision_intermediate": 64,
    "vision_heads": 2,
    "vision_positions": 64,  # an 8x8 learned grid (the published: 48x48 = 2304)
    # one DeepStack level, after vision block 0, added after text layer 0: never after the last text layer,
    # whose image positions' logits are unlabelled (the published: [8, 16, 24] of 27 blocks, 48 layers)
    "deepstack": [0],
    "audio_layers": 2,
    "audio_dim": 32,
    "audio_intermediate": 64,
    "audio_heads": 2,
    "audio_downsample": 8,  # the conv stem's channels (the published: 480)
    "max_pixels": 32 * 32 * 64,  # at most 64 merged image tokens per image (one per 32x32 px)
}


# The demo models this module builds: demo id -> what it builds (demo/models.py finds them here)
BUILDS = {
    "demo:tiny-qwen3-omni-thinker": TinyModel("qwen3_omni_moe_thinker", build_tiny_qwen3_omni, TINY),
}
