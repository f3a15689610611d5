"""The tiny offline Llama 4 (`demo:tiny-llama4`, after Llama-4-Scout-17B-16E-Instruct): a tiktoken-style byte-level
BPE (Llama 4's o200k pre-tokenizer regex, the BOS the published tokenizer.json adds to every text) with
Llama 4's named special tokens, Llama4Processor tiling each image into square tiles plus a global one, a
Llama 4 vision tower (2-D RoPE, pixel-shuffle adapter), a Llama 4 text model with a dense RoPE layer of
chunked attention beside an MoE NoPE layer of full attention (routed experts and a shared one)."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.tiny import TinyModel, byte_level_bpe, generation_ids, save_tiny_model
from vlm_recipes.demo.tiny.dims import TINY_TEXT_DIMS, tiny_text_config

MIRRORS = "meta-llama/Llama-4-Scout-17B-16E-Instruct"

# Llama 4's pre-tokenizer pattern (tiktoken's o200k: Tokenizer.O200K_PATTERN in meta-llama/llama-models
# models/llama4/tokenizer.py, which transformers' convert_llama4_weights_to_hf.py writes into tokenizer.json)
LLAMA4_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The named special tokens in the published order (200000.. there: the five basic ones, then from 200005
# the chat tokens, from 200080 the image tokens), appended after the BPE vocab here; the ~1100 reserved
# ones between them are left out.
LLAMA4_SPECIAL_TOKENS = (
    *("<|begin_of_text|>", "<|end_of_text|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"),
    *("<|header_start|>", "<|header_end|>", "<|eom|>", "<|eot|>", "<|step|>", "<|python_start|>"),
    *("<|python_end|>", "<|finetune_right_pad|>"),  # 200018: config.json's pad_token_id
    *("<|image_start|>", "<|image_end|>", "<|tile_x_separator|>", "<|tile_y_separator|>", "<|image|>"),
    "<|patch|>",  # 200092: config.json's image_token_index, the token the image features replace
)
# The published tokenizer's pad_token is spelled <|finetune_right_pad_id|> (Llama 3's name), a token the
# conversion adds after all the others (201134 there, so len(tokenizer) is 201135); config.json and
# generation_config.json pad with <|finetune_right_pad|> instead. Both kept, as published.
LLAMA4_TOKENIZER_PAD = "<|finetune_right_pad_id|>"

# The Llama 4 Instruct checkpoints' chat template as converted for transformers (the `chat_template`
# convert_llama4_weights_to_hf.py writes with --instruct, and Llama4Processor's default: transformers 5.24
# models/llama4/processing_llama4.py), byte for byte. The hub's chat_template.jinja was later revised by
# Meta for pythonic tool calls; that revision could not be read here.
LLAMA4_CHAT_TEMPLATE = (
    "{{- bos_token }}\n{%- if custom_tools is defined %}\n    {%- set tools = custom_tools %}\n"
    "{%- endif %}\n{%- if not tools_in_user_message is defined %}\n"
    "    {%- set tools_in_user_message = true %}\n{%- endif %}\n{%- if not date_string is defined %}\n"
    '    {%- if strftime_now is defined %}\n        {%- set date_string = strftime_now("%d %b %Y") %}\n'
    '    {%- else %}\n        {%- set date_string = "26 Jul 2024" %}\n    {%- endif %}\n{%- endif %}\n'
    "{%- if not tools is defined %}\n    {%- set tools = none %}\n{%- endif %}\n\n"
    "{#- This block extracts the system message, so we can slot it into the right place. #}\n"
    "{%- if messages[0]['role'] == 'system' %}    \n    {%- if messages[0]['content'] is string %}\n"
    "        {%- set system_message = messages[0]['content']|trim %}\n    {%- else %}\n"
    "        {#- FIXME: The processor requires an array, always. #}\n"
    "        {%- set system_message = messages[0]['content'][0]['text']|trim %}\n    {%- endif %}\n"
    "    {%- set messages = messages[1:] %}\n    {%- set user_supplied_system_message = true %}\n"
    '{%- else %}\n    {%- set system_message = "" %}\n'
    "    {%- set user_supplied_system_message = false %}\n{%- endif %}\n\n"
    "{#- System message if the user supplied one #}\n{%- if user_supplied_system_message %}\n"
    '    {{- "<|header_start|>system<|header_end|>\n\n" }}\n    {%- if tools is not none %}\n'
    '        {{- "Environment: ipython\n" }}\n    {%- endif %}\n'
    "    {%- if tools is not none and not tools_in_user_message %}\n"
    '        {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}\n'
    '        {{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}\n'
    '        {{- "Do not use variables.\n\n" }}\n        {%- for t in tools %}\n'
    '            {{- t | tojson(indent=4) }}\n            {{- "\n\n" }}\n        {%- endfor %}\n'
    '    {%- endif %}\n    {{- system_message }}\n    {{- "<|eot|>" }}\n{%- endif %}\n\n'
    "{#- Custom tools are passed in a user message with some extra guidance #}\n"
    "{%- if tools_in_user_message and not tools is none %}\n"
    "    {#- Extract the first user message so we can plug it in here #}\n"
    "    {%- if messages | length != 0 %}\n"
    "        {%- set first_user_message = messages[0]['content']|trim %}\n"
    "        {%- set messages = messages[1:] %}\n    {%- else %}\n"
    '        {{- raise_exception("Cannot put tools in the first user message when there\'s no first user message!") }}\n'
    "{%- endif %}\n    {{- '<|header_start|>user<|header_end|>\n\n' -}}\n"
    '    {{- "Given the following functions, please respond with a JSON for a function call " }}\n'
    '    {{- "with its proper arguments that best answers the given prompt.\n\n" }}\n'
    '    {{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}\n'
    '    {{- "Do not use variables.\n\n" }}\n    {%- for t in tools %}\n'
    '        {{- t | tojson(indent=4) }}\n        {{- "\n\n" }}\n    {%- endfor %}\n'
    '    {{- first_user_message + "<|eot|>"}}\n{%- endif %}\n\n{%- for message in messages %}\n'
    "    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}\n"
    "    {{- '<|header_start|>' + message['role'] + '<|header_end|>\n\n' }}\n"
    "        {%- if message['content'] is string %}\n            {{- message['content'] }}\n"
    "        {%- else %}\n            {%- for content in message['content'] %}\n"
    "                {%- if content['type'] == 'image' %}\n                    {{- '<|image|>' }}\n"
    "                {%- elif content['type'] == 'text' %}\n                    {{- content['text'] }}\n"
    "                {%- endif %}\n            {%- endfor %}\n        {%- endif %}\n"
    '        {{- "<|eot|>" }}\n'
    "    {%- elif 'tool_calls' in message and message.tool_calls|length > 0 %}\n"
    "       {{- '<|header_start|>assistant<|header_end|>\n\n' -}}\n       {{- '<|python_start|>' }}\n"
    "        {%- if message['content'] is string %}\n            {{- message['content'] }}\n"
    "        {%- else %}\n            {%- for content in message['content'] %}\n"
    "                {%- if content['type'] == 'image' %}\n                    {{- '<|image|>' }}\n"
    "                {%- elif content['type'] == 'text' %}\n                    {{- content['text'] }}\n"
    "                {%- endif %}\n            {%- endfor %}\n        {%- endif %}\n"
    "       {{- '<|python_end|>' }}\n        {%- for tool_call in message.tool_calls %}\n"
    "           {{- '{\"name\": \"' + tool_call.function.name + '\", ' }}\n"
    "           {{- '\"parameters\": ' }}\n           {{- tool_call.function.arguments | tojson }}\n"
    '           {{- "}" }}\n        {%- endfor %}\n       {{- "<|eot|>" }}\n'
    '    {%- elif message.role == "tool" or message.role == "ipython" %}\n'
    '        {{- "<|header_start|>ipython<|header_end|>\n\n" }}\n'
    "        {%- if message.content is mapping or message.content is iterable %}\n"
    "            {{- message.content | tojson }}\n        {%- else %}\n            {{- message.content }}\n"
    '        {%- endif %}\n        {{- "<|eot|>" }}\n    {%- endif %}\n{%- endfor %}\n'
    "{%- if add_generation_prompt %}\n    {{- '<|header_start|>assistant<|header_end|>\n\n' }}\n"
    "{%- endif %}\n"
)


def llama4_tokenizer(corpus: list[str]):
    """A TokenizersBackend (the published PreTrainedTokenizerFast) built the way transformers converts
    Llama 4's tiktoken file (convert_llama4_weights_to_hf.py: Llama4Converter): a byte-level BPE trained on
    `corpus` with Llama 4's pattern, ByteLevel decoding, the special tokens, <|begin_of_text|> prepended to
    every encoded text; eos <|eot|> (the Instruct checkpoints')."""
    from tokenizers import AddedToken, processors
    from transformers import TokenizersBackend

    specials = (*LLAMA4_SPECIAL_TOKENS, LLAMA4_TOKENIZER_PAD)
    bpe = byte_level_bpe(corpus, LLAMA4_PATTERN, last=specials, ignore_merges=True)
    bpe.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in specials])
    bos = "<|begin_of_text|>"
    bpe.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos} $A",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, bpe.token_to_id(bos))],
            ),
        ]
    )
    return TokenizersBackend(
        tokenizer_object=bpe,
        bos_token=bos,
        eos_token="<|eot|>",
        pad_token=LLAMA4_TOKENIZER_PAD,
        model_input_names=["input_ids", "attention_mask"],
        model_max_length=4096,
    )


def build_tiny_llama4(out: Path, dims: dict, corpus: list[str]) -> None:
    """With the Instruct checkpoints' chat template (LLAMA4_CHAT_TEMPLATE)."""
    import transformers

    tok = llama4_tokenizer(corpus)
    tok.chat_template = LLAMA4_CHAT_TEMPLATE
    tile, patch = dims["tile"], dims["patch"]
    # as the published preprocessor_config.json (Llama4ImageProcessorFast there, this class in transformers
    # 5.x): square tiles, at most max_patches of them and a global one, mean/std 0.5, bilinear
    tiles = transformers.Llama4ImageProcessor(
        size={"height": tile, "width": tile}, max_patches=dims["max_tiles"]
    )
    processor = transformers.Llama4Processor(
        image_processor=tiles,
        tokenizer=tok,
        patch_size=patch,
        pixel_shuffle_ratio=0.5,
        chat_template=LLAMA4_CHAT_TEMPLATE,
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in LLAMA4_SPECIAL_TOKENS}
    text = tiny_text_config(
        tok,
        dims,
        model_type="llama4_text",
        head_dim=dims["hidden"] // dims["heads"],
        intermediate_size_mlp=dims["dense_intermediate"],  # the dense layers' MLP (16384 there)
        num_local_experts=dims["experts"],
        num_experts_per_tok=1,
        # layer 0 dense, layer 1 MoE (Scout: every layer MoE; Maverick: every other one)
        interleave_moe_layer_step=2,
        # layer 0 RoPE with chunked attention, layer 1 NoPE with full attention (3 to 1 there)
        no_rope_layers=[1, 0],
        attention_chunk_size=dims["attention_chunk"],
        use_qk_norm=True,
        attn_temperature_tuning=True,
        floor_scale=8192,
        attn_scale=0.1,
        # Scout-Instruct's context and llama3 rope scaling (transformers warns that high_freq_factor is
        # not above low_freq_factor, as it does for the published config)
        max_position_embeddings=10485760,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0}
        | {"high_freq_factor": 1.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192},
        bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=[ids["<|end_of_text|>"], ids["<|eom|>"], ids["<|eot|>"]],
        pad_token_id=ids["<|finetune_right_pad|>"],
        tie_word_embeddings=False,
    )
    vision = dims["vision_dim"]
    config = transformers.Llama4Config(
        text_config=text,
        vision_config={
            "model_type": "llama4_vision_model",
            "hidden_size": vision,
            # the pixel shuffle folds 2x2 patches into one of 4x the width, which the adapter's first
            # layer takes as intermediate_size wide: 4 x hidden_size, as 5632 = 4 x 1408 there
            "intermediate_size": 4 * vision,
            "num_hidden_layers": dims["vision_layers"],
            "num_attention_heads": dims["vision_heads"],
            "image_size": tile,
            "patch_size": patch,
            "pixel_shuffle_ratio": 0.5,
            "projector_input_dim": dims["projector_dim"],
            "projector_output_dim": dims["projector_dim"],
            "vision_output_dim": dims["projector_dim"],
            "rope_parameters": {"rope_theta": 10000.0},
            "vision_feature_layer": -1,
            "vision_feature_select_strategy": "default",
        },
        boi_token_index=ids["<|image_start|>"],
        eoi_token_index=ids["<|image_end|>"],
        image_token_index=ids["<|patch|>"],
        tie_word_embeddings=False,
    )
    # the generation config as published, but stopping at <|eot|> only ([200001, 200007, 200008] there)
    generation = generation_ids(tok, eos="<|eot|>", pad="<|finetune_right_pad|>", bos="<|begin_of_text|>")
    save_tiny_model(out, transformers.Llama4ForConditionalGeneration, config, processor, dims, **generation)


# What build_tiny_llama4 builds, one dict per demo model (BUILDS below)
TINY = {
    **TINY_TEXT_DIMS,
    "dense_intermediate": 256,  # the dense layer's MLP: 2x the experts', as 16384 to 8192 there
    "experts": 4,  # routed experts, top-1, beside a shared one (16 there)
    "attention_chunk": 64,  # the RoPE layers attend within chunks of this many tokens (8192 there)
    "vision_layers": 2,
    "vision_dim": 32,
    "vision_heads": 2,
    "projector_dim": 64,  # the adapter's and projector's width (4096 there)
    "patch": 14,  # the real tower's 14 px patches
    "tile": 56,  # 4x4 patches, pixel-shuffled to 2x2 = 4 tokens a tile (336 px, 144 tokens there)
    # up to 4 tiles and a global one: an image is at most 20 <|patch|> tokens and 7 markers (16 tiles there)
    "max_tiles": 4,
}


# The demo models this module builds: demo id -> what it builds (demo/models.py finds them here)
BUILDS = {
    "demo:tiny-llama4": TinyModel("llama4", build_tiny_llama4, TINY),
}
