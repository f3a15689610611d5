"""The tiny offline MiniCPM-V 4.6 (`minicpmv4_6`): the published tokenizer's 50 added tokens after a
byte-level BPE split with Qwen3.5's pre-tokenizer (a TokenizersBackend, as AutoTokenizer loads it),
MiniCPMV4_6Processor with LLaVA-UHD slicing (`<image_id>0</image_id><image>…</image>` for the overview,
`<slice>…</slice>` rows), a SigLIP-style NaViT tower with the window-attention merger inserted after its
first layer, the 2x2 merger MLP, and a Qwen3.5 hybrid text model (Gated DeltaNet, then gated attention)."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.tiny import TinyModel, byte_level_bpe, generation_ids, save_tiny_model
from vlm_recipes.demo.tiny.dims import TINY_TEXT_DIMS, TINY_VISION_DIMS, tiny_text_config, tiny_vision_config
from vlm_recipes.demo.tiny.qwen3_5 import hybrid_attention_fields

MIRRORS = "openbmb/MiniCPM-V-4.6"  # the transformers docs also spell it openbmb/MiniCPM-V-4_6

# The published tokenizer.json's added tokens in its order (ids 248044..248093 there, after the BPE vocab);
# tokenizer_config.json names <|im_start|> bos, <|im_end|> eos, <|endoftext|> pad and <unk> unk.
MINICPM_V_ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>",
    "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>", "<unk>", "<image>",
    "</image>", "<ref>", "</ref>", "<box>", "</box>", "<quad>", "</quad>", "<point>", "</point>", "<slice>",
    "</slice>", "<image_id>", "</image_id>", "<timestamp>", "</timestamp>",
)  # fmt: skip
# <tool_call> .. </think>: never split but not special (decoding with skip_special_tokens keeps them)
MINICPM_V_NOT_SPECIAL = MINICPM_V_ADDED_TOKENS[14:26]
# The tokenizer's named tokens (tokenizer.image_token, ...): MiniCPMV4_6Processor reads the first eight
MINICPM_V_NAMED_TOKENS = {
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "image_start_token": "<image>",
    "image_end_token": "</image>", "slice_start_token": "<slice>", "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>", "image_id_end_token": "</image_id>",
    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>", "audio_token": "<|audio_pad|>",
}  # fmt: skip

# The published chat template, byte for byte: openbmb/MiniCPM-V-4.6's chat_template.jinja (the same text as
# its tokenizer_config's chat_template), read from the hub's model record (sha 8169864629825dc1d755a5aa1cd8b)
# as vendored in github.com/moderately-ai/lmbrrr, docs/research/models/minicpm-v-4.6/hf-model/api-model.json.
# Qwen3.5's template, each image or video a bare <|image_pad|> / <|video_pad|> (the processor expands it),
# parts joined by "\n", thinking off unless enable_thinking=True (the generation prompt then ends with an
# empty <think>\n\n</think>\n\n, and so does every assistant turn after the last user one).
MINICPM_V_CHAT_TEMPLATE = (
    "{%- if enable_thinking is not defined -%}\n    {%- set enable_thinking = false -%}\n{%- endif -%}\n"
    "{%- macro render_content(content, is_system_content=false) -%}\n    {%- if content is string -%}\n"
    "        {{- content -}}\n    {%- elif content is iterable and content is not mapping -%}\n"
    "        {%- set ns = namespace(parts=[]) -%}\n        {%- for item in content -%}\n"
    "            {%- if 'image' in item or 'image_url' in item or item.type == 'image' -%}\n"
    "                {%- if is_system_content -%}\n"
    "                    {{- raise_exception('System message cannot contain images.') -}}\n"
    "                {%- endif -%}\n                {%- set ns.parts = ns.parts + ['<|image_pad|>'] -%}\n"
    "            {%- elif 'video' in item or item.type == 'video' -%}\n"
    "                {%- if is_system_content -%}\n"
    "                    {{- raise_exception('System message cannot contain videos.') -}}\n"
    "                {%- endif -%}\n                {%- set ns.parts = ns.parts + ['<|video_pad|>'] -%}\n"
    "            {%- elif 'text' in item -%}\n                {%- set ns.parts = ns.parts + [item.text] -%}\n"
    "            {%- else -%}\n                {{- raise_exception('Unexpected item type in content.') -}}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n        {{- ns.parts | join('\\n') -}}\n"
    "    {%- elif content is none or content is undefined -%}\n        {{- '' -}}\n    {%- else -%}\n"
    "        {{- raise_exception('Unexpected content type.') -}}\n    {%- endif -%}\n{%- endmacro -%}\n"
    "{%- if not messages %}\n    {{- raise_exception('No messages provided.') }}\n{%- endif %}\n"
    "{%- if tools and tools is iterable and tools is not mapping %}\n    {{- '<|im_start|>system\\n' }}\n"
    '    {{- "# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n'
    '    {{- "\\n</tools>" }}\n'
    "    {{- '\\n\\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1"
    "\\n</parameter>\\n<parameter=example_parameter_2>\\nThis is the value for the second parameter\\nthat "
    "can span\\nmultiple lines\\n</parameter>\\n</function>\\n</tool_call>\\n\\n<IMPORTANT>\\nReminder:\\n- "
    "Function calls MUST follow the specified format: an inner <function=...></function> block must be "
    "nested within <tool_call></tool_call> XML tags\\n- Required parameters MUST be specified\\n- You may "
    "provide optional reasoning for your function call in natural language BEFORE the function call, but NOT "
    "after\\n- If there is no function call available, answer the question like normal with your current "
    "knowledge and do not tell the user about function calls\\n</IMPORTANT>' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {%- set content = render_content(messages[0].content, true)|trim %}\n        {%- if content %}\n"
    "            {{- '\\n\\n' + content }}\n        {%- endif %}\n    {%- endif %}\n"
    "    {{- '<|im_end|>\\n' }}\n{%- else %}\n    {%- if messages[0].role == 'system' %}\n"
    "        {%- set content = render_content(messages[0].content, true)|trim %}\n"
    "        {{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    '    {%- if ns.multi_step_tool and message.role == "user" %}\n'
    "        {%- set content = render_content(message.content)|trim %}\n"
    "        {%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}\n"
    "            {%- set ns.multi_step_tool = false %}\n            {%- set ns.last_query_index = index %}\n"
    "        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if ns.multi_step_tool %}\n"
    "    {{- raise_exception('No user query found in messages.') }}\n{%- endif %}\n"
    "{%- for message in messages %}\n    {%- set content = render_content(message.content)|trim %}\n"
    '    {%- if message.role == "system" %}\n        {%- if not loop.first %}\n'
    "            {{- raise_exception('System message must be at the beginning.') }}\n        {%- endif %}\n"
    '    {%- elif message.role == "user" %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n        {%- else %}\n"
    "            {%- if '</think>' in content %}\n                {%- set reasoning_content = "
    "content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n"
    "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n        {%- endif %}\n"
    "        {%- set reasoning_content = reasoning_content|trim %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content + "
    "'\\n</think>\\n\\n' + content }}\n        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}\n"
    "        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not "
    "mapping %}\n            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if tool_call.function is defined %}\n"
    "                    {%- set tool_call = tool_call.function %}\n                {%- endif %}\n"
    "                {%- if loop.first %}\n                    {%- if content|trim %}\n"
    "                        {{- '\\n\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}\n"
    "                    {%- else %}\n"
    "                        {{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}\n"
    "                    {%- endif %}\n                {%- else %}\n"
    "                    {{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}\n"
    "                {%- endif %}\n                {%- if tool_call.arguments is defined %}\n"
    "                    {%- for args_name, args_value in tool_call.arguments|items %}\n"
    "                        {{- '<parameter=' + args_name + '>\\n' }}\n"
    "                        {%- set args_value = args_value | tojson | safe if args_value is mapping or "
    "(args_value is sequence and args_value is not string) else args_value | string %}\n"
    "                        {{- args_value }}\n                        {{- '\\n</parameter>\\n' }}\n"
    "                    {%- endfor %}\n                {%- endif %}\n"
    "                {{- '</function>\\n</tool_call>' }}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n"
    '        {%- if loop.previtem and loop.previtem.role != "tool" %}\n'
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if not loop.last and loop.nextitem.role != \"tool\" %}\n            {{- '<|im_end|>\\n' }}\n"
    "        {%- elif loop.last %}\n            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n"
    "    {%- else %}\n        {{- raise_exception('Unexpected message role.') }}\n    {%- endif %}\n"
    "{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- else %}\n        {{- '<think>\\n' }}\n"
    "    {%- endif %}\n{%- endif %}\n"
)


def minicpm_v_tokenizer(corpus: list[str]):
    """A TokenizersBackend shaped as the published tokenizer.json: NFC, Qwen3.5's split regex then ByteLevel,
    a BPE trained on `corpus`, the 50 added tokens after it in the published order, no bos added."""
    import tokenizers as tk
    from transformers import TokenizersBackend
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX  # the published pattern

    bpe = byte_level_bpe(corpus, PRETOKENIZE_REGEX)
    bpe.normalizer = tk.normalizers.NFC()
    bpe.post_processor = tk.processors.ByteLevel(trim_offsets=False)
    special = {t: t not in MINICPM_V_NOT_SPECIAL for t in MINICPM_V_ADDED_TOKENS}
    bpe.add_tokens([tk.AddedToken(t, special=s, normalized=False) for t, s in special.items()])
    return TokenizersBackend(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        extra_special_tokens=MINICPM_V_NAMED_TOKENS,
        model_max_length=4096,
    )


def build_tiny_minicpm_v(out: Path, dims: dict, corpus: list[str]) -> None:
    """With the published checkpoint's chat template (MINICPM_V_CHAT_TEMPLATE)."""
    import transformers

    tok = minicpm_v_tokenizer(corpus)
    tok.chat_template = MINICPM_V_CHAT_TEMPLATE
    # preprocessor_config.json's settings (14 px patches, up to 9 slices, image ids, mean/std 0.5) but the
    # slice side: 112 px (the real: 448), 8x8 patches, 2x2 tokens after the two 2x2 merges ("16x")
    sizes = {"scale_resolution": dims["scale_resolution"], "patch_size": dims["patch"]}
    processor = transformers.MiniCPMV4_6Processor(
        image_processor=transformers.MiniCPMV4_6ImageProcessor(**sizes),
        video_processor=transformers.MiniCPMV4_6VideoProcessor(**sizes),
        tokenizer=tok,
        chat_template=MINICPM_V_CHAT_TEMPLATE,
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in MINICPM_V_ADDED_TOKENS}
    text = tiny_text_config(
        tok,
        dims,
        model_type="qwen3_5_text",
        head_dim=dims["head_dim"],
        **hybrid_attention_fields(dims),
        # a quarter of each head rotary over plain 1-D positions (no mrope_section, as published)
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=True,
    )
    config = transformers.MiniCPMV4_6Config(
        text_config=text,
        vision_config=tiny_vision_config(
            dims, image_size=dims["vision_image_size"], patch_size=dims["patch"]
        ),
        insert_layer_id=dims["insert_layer_id"],
        image_size=dims["scale_resolution"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        tie_word_embeddings=True,  # as published: lm_head is the embedding matrix
    )
    # <|im_end|> stops (the published generation config stops on <|endoftext|> too); bos as published
    generation = generation_ids(tok, eos="<|im_end|>", pad="<|endoftext|>", bos="<|im_start|>")
    save_tiny_model(
        out, transformers.MiniCPMV4_6ForConditionalGeneration, config, processor, dims, **generation
    )


# What build_tiny_minicpm_v builds, one dict per demo model (BUILDS below)
TINY = {
    **TINY_TEXT_DIMS,
    # Gated DeltaNet, then gated full attention: the real 3:1 pattern of 24 layers cut to one of each
    "layer_types": ["linear_attention", "full_attention"],
    "head_dim": 32,  # a quarter of it rotary (the real: 256, 8 query heads over 2)
    "linear_key_heads": 2,  # as many key as value heads, as published (16 of 128 dimensions there)
    "linear_value_heads": 2,
    "linear_head_dim": 16,
    **TINY_VISION_DIMS,
    "vision_image_size": 112,  # an 8x8 learned position grid (the real: 980 px, 70x70)
    "patch": 14,
    "insert_layer_id": 0,  # the window merger after the first of 2 layers (the real: after 7 of 27)
    # an image up to 112x112 px: 4 tokens; a larger one (the demo's 112x140) adds 2 slices
    "scale_resolution": 112,
}


# The demo models this module builds: demo id -> what it builds (demo/models.py finds them here)
BUILDS = {
    "demo:tiny-minicpm-v4.6": TinyModel("minicpmv4_6", build_tiny_minicpm_v, TINY),
}
