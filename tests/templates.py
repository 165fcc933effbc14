"""Chat templates in the styles of real model families, written out here because no hub is reachable."""

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# ChatML as Qwen3 writes it: a default system prompt, reasoning kept only after the last user turn.
CHATML_QWEN = (
    "{%- if messages[0].role != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user and m.reasoning_content %}"
    "{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{ m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Kimi-K2 style: role tags, <think> kept only for turns after the last user message (earlier turns get an
# empty <think></think>), tool calls in their own section, tool results as system-tagged turns.
KIMI = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'user' %}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 > ns.last_user %}<think>{{ m.reasoning_content or '' }}</think>{% else %}<think></think>{% endif %}"
    "{{ m.content }}"
    "{%- if m.tool_calls %}<|tool_calls_section_begin|>{% for tc in m.tool_calls %}<|tool_call_begin|>"
    "{{ tc.function.name }}<|tool_call_argument_begin|>{{ tc.function.arguments }}<|tool_call_end|>"
    "{% endfor %}<|tool_calls_section_end|>{% endif %}<|im_end|>"
    "{%- elif m.role == 'tool' %}<|im_system|>tool<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)

# GLM-4.x style: no end-of-turn token, the next role tag ends a turn.
GLM_STYLE = (
    "[gMASK]<sop>{% for m in messages %}"
    "{% if m.role == 'user' %}<|user|>\n{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|>\n{{ m.content }}"
    "{% for t in m.tool_calls or [] %}<tool_call>{{ t.function.name }}\n{{ t.function.arguments }}</tool_call>"
    "{% endfor %}"
    "{% elif m.role == 'tool' %}<|observation|>\n{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

# DeepSeek-V3.x style: no assistant header for the answer after a tool result.
DEEPSEEK_STYLE = (
    "{% set ns = namespace(after_tool=false) %}{% for m in messages %}"
    "{% if m.role == 'user' %}<|User|>{{ m.content }}{% set ns.after_tool = false %}"
    "{% elif m.role == 'assistant' %}{% if not ns.after_tool %}<|Assistant|>{% endif %}{{ m.content }}"
    "{% for t in m.tool_calls or [] %}<|tool_call|>{{ t.function.name }}:{{ t.function.arguments }}{% endfor %}"
    "<|end_of_sentence|>{% set ns.after_tool = false %}"
    "{% elif m.role == 'tool' %}<|tool_output|>{{ m.content }}<|tool_outputs_end|>{% set ns.after_tool = true %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt and not ns.after_tool %}<|Assistant|>{% endif %}")

SPECIALS = {
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>", "<|pad|>"], "<|begin_of_text|>", "<|eot_id|>"),
    "chatml": (CHATML_QWEN, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"], "<|endoftext|>", "<|im_end|>"),
    "kimi": (KIMI, ["[BOS]", "[EOS]", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
                    "<|im_end|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|pad|>"], "[BOS]", "<|im_end|>"),
}
