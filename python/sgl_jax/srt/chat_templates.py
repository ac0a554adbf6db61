"""Built-in chat templates, for models whose files carry none, and ``--chat-template``.

A GGUF file normally holds its chat template in ``tokenizer.chat_template``. Some do not (Gemma-3-270M's base
model file, for one); `prepare_gguf_hf_dir` then gives the tokenizer the built-in template of the file's
architecture (`BUILTIN_CHAT_TEMPLATES`, keyed by ``general.architecture``). ``--chat-template`` (SGLang's flag)
overrides any model's template with a built-in one by name or with a Jinja file.
"""

from __future__ import annotations

import os

# Gemma's turn format (Gemma 3's tokenizer_config.json renders the same text): BOS, then each turn as
# ``<start_of_turn>{user|model}\n{content, trimmed}<end_of_turn>\n``; a system message has no turn of its own and
# opens the first user turn, followed by a blank line; roles must alternate user / model; the generation
# prompt opens a model turn. Content given as parts renders its text parts, each trimmed.
GEMMA3_CHAT_TEMPLATE = """\
{%- macro text(content) -%}
  {%- if content is string -%}{{ content | trim }}
  {%- else -%}
    {%- for part in content -%}
      {%- if part['type'] == 'text' -%}{{ part['text'] | trim }}
      {%- else -%}{{ raise_exception('Gemma-3 text models take text content only') }}{%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set turns = messages -%}
{%- set system = '' -%}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set first = messages[0]['content'] -%}
  {%- set system = (first if first is string else first[0]['text']) + '\n\n' -%}
  {%- set turns = messages[1:] -%}
{%- endif -%}
{%- for message in turns -%}
  {%- if (message['role'] == 'user') != (loop.index0 is even) -%}
    {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
  {%- endif -%}
  {{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' -}}
  {{- system if loop.first else '' -}}
  {{- text(message['content']) + '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""

# GGUF ``general.architecture`` -> the template used when the file has none
BUILTIN_CHAT_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}


def resolve_chat_template(value: str) -> str:
    """The Jinja text ``--chat-template VALUE`` names: a built-in template (a key of BUILTIN_CHAT_TEMPLATES)
    or the path of a Jinja template file.

    Raises:
        ValueError: VALUE is neither a built-in name nor an existing file (the message names the flag and
            the built-in names).
    """
    if value in BUILTIN_CHAT_TEMPLATES:
        return BUILTIN_CHAT_TEMPLATES[value]
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    raise ValueError(f"--chat-template must be one of {sorted(BUILTIN_CHAT_TEMPLATES)} or the path of a Jinja "
                     f"template file, got {value!r}")
