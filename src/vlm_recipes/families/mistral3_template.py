"""Mistral 3's chat template (mistralai/Mistral-Small-3.1-24B-Instruct-2503) and the variant stages train with.

The published text is the one transformers' tests/models/mistral3/test_processing_mistral3.py quotes for that
checkpoint (its `prepare_processor_dict`, huggingface/transformers 043bb8d), byte for byte: the release's own
quirks kept (`messages[0] is string` tests the message, not its content, so a system turn is read as a list of
blocks; a stray space after one `else`). Without a system turn it writes Mistral Small 3's default system
prompt, dated today (`strftime_now`). It has no `add_generation_prompt` branch: a prompt ends with `[/INST]`.

TRL ships neither this template nor a training variant of it. `MISTRAL3_TRAINING_CHAT_TEMPLATE` is the same
text with `{% generation %}` around each assistant turn, its `</s>` included, so the assistant-only loss
trains the answer and the stop token and renders exactly what the published template renders
(tests/test_family_mistral3.py).
"""

from __future__ import annotations

from vlm_recipes.families.training_templates import cut_at

MISTRAL3_CHAT_TEMPLATE = (
    '{%- set today = strftime_now("%Y-%m-%d") %}\n'
    '{%- set default_system_message = "You are Mistral Small 3, a Large Language Model (LLM)'
    " created by Mistral AI, a French startup headquartered in Paris.\\nYour knowledge base was"
    ' last updated on 2023-10-01. The current date is " + today + ".\\n\\nWhen you\'re not sure'
    " about some information, you say that you don't have the information and don't make up"
    " anything.\\nIf the user's question is not clear, ambiguous, or does not provide enough"
    " context for you to accurately answer the question, you do not try to answer it right"
    ' away and you rather ask the user to clarify their request (e.g. \\"What are some good'
    ' restaurants around me?\\" => \\"Where are you?\\" or \\"When is the next flight to'
    ' Tokyo\\" => \\"Where do you travel from?\\")" %}\n'
    "\n"
    "{{- bos_token }}\n"
    "\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- if messages[0] is string %}\n"
    "        {%- set system_message = messages[0]['content'] %}\n"
    "        {%- set loop_messages = messages[1:] %}\n"
    "    {%- else %} \n"
    "        {%- set system_message = messages[0]['content'][0]['text'] %}\n"
    "        {%- set loop_messages = messages[1:] %}\n"
    "    {%- endif %}\n"
    "{%- else %}\n"
    "    {%- set system_message = default_system_message %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}\n"
    "\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "            {%- if message['content'] is string %}\n"
    "            {{- '[INST]' + message['content'] + '[/INST]' }}\n"
    "            {%- else %}\n"
    "                    {{- '[INST]' }}\n"
    "                    {%- for block in message['content'] %}\n"
    "                            {%- if block['type'] == 'text' %}\n"
    "                                    {{- block['text'] }}\n"
    "                            {%- elif block['type'] == 'image' or block['type'] == 'image_url' %}\n"
    "                                    {{- '[IMG]' }}\n"
    "                                {%- else %}\n"
    "                                    {{- raise_exception('Only text and image blocks are"
    " supported in message content!') }}\n"
    "                                {%- endif %}\n"
    "                        {%- endfor %}\n"
    "                    {{- '[/INST]' }}\n"
    "                {%- endif %}\n"
    "    {%- elif message['role'] == 'system' %}\n"
    "        {{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {%- if message['content'] is string %}\n"
    "            {{- message['content'] + eos_token }}\n"
    "        {%- else %}\n"
    "            {{- message['content'][0]['text'] + eos_token }}\n"
    "        {%- endif %}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user, system and assistant roles are supported!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}"
)

# The assistant turn runs from its branch to the next one
_ASSISTANT_BRANCH = "    {%- elif message['role'] == 'assistant' %}\n"
_NEXT_BRANCH = "    {%- else %}\n        {{- raise_exception('Only user, system and assistant roles"
_BEFORE, _ASSISTANT_TURN, _AFTER = cut_at(MISTRAL3_CHAT_TEMPLATE, _ASSISTANT_BRANCH, _NEXT_BRANCH)
MISTRAL3_TRAINING_CHAT_TEMPLATE = (
    _BEFORE
    + _ASSISTANT_BRANCH
    + "        {%- generation %}\n"
    + _ASSISTANT_TURN
    + "        {%- endgeneration %}\n"
    + _NEXT_BRANCH
    + _AFTER
)

# The default system prompt the template writes, as rendered on some day (the tiny tokenizer learns its words)
DEFAULT_SYSTEM_PROMPT_EXAMPLE = (
    "You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI, a French startup "
    "headquartered in Paris.\nYour knowledge base was last updated on 2023-10-01. The current date is "
    "2026-01-01.\n\nWhen you're not sure about some information, you say that you don't have the information "
    "and don't make up anything.\nIf the user's question is not clear, ambiguous, or does not provide enough "
    "context for you to accurately answer the question, you do not try to answer it right away and you rather "
    'ask the user to clarify their request (e.g. "What are some good restaurants around me?" => "Where are '
    'you?" or "When is the next flight to Tokyo" => "Where do you travel from?")'
)
