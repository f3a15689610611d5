"""The tiny offline Kimi K2.5 (`demo:tiny-kimi-k2.5`): a byte-level BPE split by Kimi's tiktoken pattern, Kimi's
special tokens after it (a TokenizersBackend, transformers' class for kimi_k25), Kimi_K25Processor (14 px
patches merged 2x2), a MoonViT tower (learned positions resampled to each image, 2-D RoPE), the patch-merger
projector and a DeepSeek-V3 text model (MLA, a dense first layer, then routed experts beside a shared one)."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.tiny import TinyModel, byte_level_bpe, generation_ids, save_tiny_model
from vlm_recipes.demo.tiny.dims import TINY_MOE_DIMS, TINY_TEXT_DIMS, deepseek_moe_fields, tiny_text_config

MIRRORS = "moonshotai/Kimi-K2.5"  # the published checkpoint this tiny build mirrors

# tokenizer_config.json's added tokens in its order after the 163584 tiktoken ranks ([BOS] 163584 .. [PAD]
# 163839, the <|reserved_token_n|> fillers left out); the tool-call tokens and <think> are not special there.
# It lacks <|kimi_k25_video_placeholder|> (the remote processor expands it first): Kimi_K25Processor needs
# it, one past the rest as transformers' video_token_id (163840) has it.
KIMI_SPECIAL_TOKENS = (
    *("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>"),
    *("<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>", "<|media_begin|>", "<|media_content|>"),
    *("<|media_end|>", "<|media_pad|>", "[UNK]", "[PAD]", "<|kimi_k25_video_placeholder|>"),
)
KIMI_ADDED_TOKENS = (
    *("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>"),
    *("<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>"),
)
# Kimi's pre-tokenizer pattern (tokenization_kimi.py's `pat_str`: Han runs apart, letters without Han)
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?" + _UPPER + "*" + _LOWER + "+" + _CONTRACTIONS,
        r"[^\r\n\p{L}\p{N}]?" + _UPPER + "+" + _LOWER + "*" + _CONTRACTIONS,
        *(r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"),
    ]
)
# moonshotai/Kimi-K2.5's chat_template.jinja, byte for byte, as vendored in lightseekorg/smg
# (crates/tokenizer/tests/fixtures/kimi_k25/chat_template.jinja at 977f149c; a later commit there fixed the
# comment's "assisitant"). No default system prompt; the generation prompt ends "<think>"; `tools_ts_str`
# (TypeScript tool declarations) comes from the remote tokenizer code only.
KIMI_K25_CHAT_TEMPLATE = """{%- macro render_content(msg) -%}
    {%- set c = msg.get('content') -%}
    {%- if c is string -%}
      {{ c }}
    {%- elif c is not none -%}
      {% for content in c -%}
        {% if content['type'] == 'image' or content['type'] == 'image_url' -%}
          <|media_begin|>image<|media_content|><|media_pad|><|media_end|>
        {% elif content['type'] == 'video' or content['type']== 'video_url'-%}
          <|kimi_k25_video_placeholder|>
        {% else -%}
          {{ content['text'] }}
        {%- endif -%}
      {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}

{% macro set_roles(message) -%}
  {%- set role_name =  message.get('name') or  message['role'] -%}
  {%- if message['role'] == 'user' -%}
    <|im_user|>{{role_name}}<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}
    <|im_assistant|>{{role_name}}<|im_middle|>
  {%- else -%}
    <|im_system|>{{role_name}}<|im_middle|>
  {%- endif -%}
{%- endmacro -%}


{%- macro render_toolcalls(message) -%}
  <|tool_calls_section_begin|>
  {%- for tool_call in message['tool_calls'] -%}
    {%- set formatted_id = tool_call['id'] -%}
    <|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>{% if tool_call['function']['arguments'] is string %}{{ tool_call['function']['arguments'] }}{% else %}{{ tool_call['function']['arguments'] | tojson }}{% endif %}<|tool_call_end|>
  {%- endfor -%}
  <|tool_calls_section_end|>
{%- endmacro -%}


{# Find last non-tool-call assisitant message #}
{%- set ns = namespace(last_non_tool_call_assistant_msg=-1) -%}
{%- for idx in range(messages|length-1, -1, -1) -%}
    {%- if messages[idx]['role'] == 'assistant' and not messages[idx].get('tool_calls') -%}
        {%- set ns.last_non_tool_call_assistant_msg = idx -%}
        {%- break -%}
    {%- endif -%}
{%- endfor -%}

{# split all messages into history & suffix, reasoning_content in suffix should be reserved.#}
{%- set hist_msgs = messages[:ns.last_non_tool_call_assistant_msg+1] -%}
{%- set suffix_msgs = messages[ns.last_non_tool_call_assistant_msg+1:] -%}

{%- if tools -%}
  {%- if tools_ts_str -%}
    <|im_system|>tool_declare<|im_middle|>{{ tools_ts_str }}<|im_end|>
  {%- else -%}
    <|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
  {%- endif -%}
{%- endif -%}

{%- for message in hist_msgs -%}
  {{set_roles(message)}}
  {%- if message['role'] == 'assistant' -%}
    <think></think>{{render_content(message)}}
    {%- if message.get('tool_calls') -%}
      {{render_toolcalls(message)}}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {%- set tool_call_id = message.tool_call_id -%}
    ## Return of {{ tool_call_id }}
{{render_content(message)}}
  {%- elif message['content'] is not none -%}
    {{render_content(message)}}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}

{%- for message in suffix_msgs -%}
  {{set_roles(message)}}
  {%- if message['role'] == 'assistant' -%}
    {%- if thinking is defined and thinking is false -%}
    <think></think>{{render_content(message)}}
    {%- else -%}
    {%- set rc = message.get('reasoning_content', '') -%}
    <think>{{rc}}</think>{{render_content(message)}}
    {%- endif -%}
    {%- if message.get('tool_calls') -%}
     {{render_toolcalls(message)}}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {%- set tool_call_id = message.tool_call_id -%}
    ## Return of {{ tool_call_id }}
{{render_content(message)}}
  {%- elif message['content'] is not none -%}
    {{render_content(message)}}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}


{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
  {%- if thinking is defined and thinking is false -%}
  <think></think>
  {%- else -%}
  <think>
  {%- endif -%}
{%- endif -%}
"""


def kimi_tokenizer(corpus: list[str]):
    """A TokenizersBackend around a byte-level BPE trained on `corpus` with Kimi's pattern, the special and
    added tokens after it; nothing added on encoding (the template writes no [BOS])."""
    from tokenizers import AddedToken
    from transformers import TokenizersBackend

    bpe = byte_level_bpe(corpus, KIMI_PATTERN, last=(*KIMI_SPECIAL_TOKENS, *KIMI_ADDED_TOKENS))
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in KIMI_SPECIAL_TOKENS])
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in KIMI_ADDED_TOKENS])
    named = {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"}
    return TokenizersBackend(tokenizer_object=bpe, model_max_length=4096, **named)


def build_tiny_kimi_k25(out: Path, dims: dict, corpus: list[str]) -> None:
    """With the published chat template (KIMI_K25_CHAT_TEMPLATE)."""
    import transformers

    tok = kimi_tokenizer(corpus)
    tok.chat_template = KIMI_K25_CHAT_TEMPLATE
    bounds = {"size": {"max_height": dims["max_side"], "max_width": dims["max_side"]}}  # patches on a side
    bounds |= {"max_patches": dims["max_patches"], "patch_size": 14, "merge_size": 2}
    processor = transformers.Kimi_K25Processor(
        image_processor=transformers.Kimi_K25ImageProcessor(**bounds),
        tokenizer=tok,
        video_processor=transformers.Kimi_K25VideoProcessor(**bounds),
        chat_template=KIMI_K25_CHAT_TEMPLATE,
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in KIMI_SPECIAL_TOKENS}
    text = tiny_text_config(
        tok,
        dims,
        model_type="deepseek_v3",
        **dims["mla"],
        v_head_dim=dims["v_head_dim"],
        # the published routing (sigmoid scores, one group, top-k renormalized and scaled), no MTP layer
        **deepseek_moe_fields(dims),
        routed_scaling_factor=2.827,
        num_mtp_layers=0,
        max_position_embeddings=262144,  # the published YaRN: x64 over 4096 positions
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0, "beta_fast": 32.0}
        | {"beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
        rms_norm_eps=1e-5,
        bos_token_id=ids["[BOS]"],
        eos_token_id=ids["[EOS]"],
        pad_token_id=ids["[PAD]"],
        tie_word_embeddings=False,
    )
    config = transformers.Kimi_K25Config(
        text_config=text,
        # 14 px patches merged 2x2 (the published geometry), 4 frames a video chunk
        vision_config={"model_type": "kimi_k25_vision", "patch_size": 14, "merge_kernel_size": [2, 2]}
        | {"pos_emb_time": 4, "pos_emb_height": dims["pos_grid"], "pos_emb_width": dims["pos_grid"]}
        | dims["vision"],
        projection_hidden_size=dims["vision"]["hidden_size"],  # the projector's pre-norm: the tower's width
        projection_layer_norm_eps=1e-5,
        image_token_id=ids["<|media_pad|>"],
        video_token_id=ids["<|kimi_k25_video_placeholder|>"],
        vision_start_token_id=ids["<|media_begin|>"],
        vision_end_token_id=ids["<|media_end|>"],
        tie_word_embeddings=False,  # the published lm_head is its own matrix (the class default ties it)
    )
    # generation stops at the end of a turn (the published generation_config's eos: <|im_end|>)
    generation = generation_ids(tok, eos="<|im_end|>", pad="[PAD]", bos="[BOS]")
    save_tiny_model(out, transformers.Kimi_K25ForConditionalGeneration, config, processor, dims, **generation)


# What build_tiny_kimi_k25 builds, one dict per demo model (BUILDS below)
TINY = {
    **TINY_TEXT_DIMS,
    "kv_heads": 4,  # MLA: every head its own key and value, decompressed from one latent
    # 4 heads of 16 + 8 rotary dims, latents of 32 and 16 (the real: 64 of 128 + 64, latents of 1536, 512)
    "mla": {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8},
    "v_head_dim": 16,
    # a dense first layer, then 4 routed experts, 2 a token (the real: 1 dense, then 60 of 384, 8)
    **TINY_MOE_DIMS,
    "dense_layers": 1,
    "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2},
    "pos_grid": 8,  # the real tower: 27 layers of 1152, a 64x64 position grid
    # at most 256 patches, 16 a side (the real 16384, 512): 128 px pads to 140, 10x10 patches, 25 tokens
    "max_patches": 256,
    "max_side": 16,
}


# The demo models this module builds: demo id -> what it builds (demo/models.py finds them here)
BUILDS = {
    "demo:tiny-kimi-k2.5": TinyModel("kimi_k25", build_tiny_kimi_k25, TINY),
}
