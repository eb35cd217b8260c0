"""Chat templates written for the tests, one per tool-call format, in the shape of its model
family's own: the system part names the tools and shows the call format, an assistant turn
renders its calls in the format, a tool result is rendered the family's way. Tools are listed by
name only: the tiny server test model's context is 256 tokens."""

from __future__ import annotations

QWEN3_CODER = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}"
    "<function><name>{{ t.function.name }}</name></function>{% endfor %}</tools>\n"
    "Call a function as <tool_call>\n<function=example_function_name>\n"
    "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls %}\n<tool_call>\n<function={{ c.function.name }}>\n"
    "{%- for k, v in c.function.arguments.items() %}\n<parameter={{ k }}>\n"
    "{{ v if v is string else v | tojson }}\n</parameter>{%- endfor %}\n</function>\n"
    "</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")

GLM45 = (
    "[gMASK]<sop>{%- if tools %}<|system|>\n# Tools {% for t in tools %}{{ t.function.name }} "
    "{% endfor %}\nCall one as <tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n"
    "<arg_value>{arg-value-1}</arg_value>\n</tool_call>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|assistant|>\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}\n"
    "{%- for k, v in c.function.arguments.items() %}<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v if v is string else v | tojson }}</arg_value>\n{%- endfor %}"
    "</tool_call>{%- endfor %}"
    "{%- elif m.role == 'tool' %}<|observation|>\n<tool_response>\n{{ m.content }}\n"
    "</tool_response>"
    "{%- else %}<|{{ m.role }}|>\n{{ m.content }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|assistant|>{%- endif %}")

_DEEPSEEK = (
    "{%- if tools %}## Tools\n{% for t in tools %}### {{ t.function.name }}\n{% endfor %}"
    "Call tools between <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<｜Assistant｜>{{ m.content or '' }}"
    "<｜tool▁calls▁begin｜>{%- for c in m.tool_calls %}<｜tool▁call▁begin｜>CALL"
    "<｜tool▁call▁end｜>{%- endfor %}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    "{%- elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>"
    "{%- else %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<｜Assistant｜>{%- endif %}")
# V3 and R1 write `function`, the name and fenced JSON; V3.1 the name and bare JSON.
DEEPSEEK_V3 = _DEEPSEEK.replace("CALL", "function<｜tool▁sep｜>{{ c.function.name }}\n```json\n"
                                        "{{ c.function.arguments | tojson }}\n```")
DEEPSEEK_V31 = _DEEPSEEK.replace("CALL", "{{ c.function.name }}<｜tool▁sep｜>"
                                         "{{ c.function.arguments | tojson }}")

KIMI_K2 = (
    "{%- if tools %}<|im_system|>tool_declare<|im_middle|>{% for t in tools %}"
    "{{ t.function.name }} {% endfor %}<|im_end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>{{ m.content or '' }}"
    "{%- if m.tool_calls %}<|tool_calls_section_begin|>{%- for c in m.tool_calls %}"
    "<|tool_call_begin|>{{ c.id }}<|tool_call_argument_begin|>"
    "{{ c.function.arguments | tojson }}<|tool_call_end|>{%- endfor %}"
    "<|tool_calls_section_end|>{%- endif %}<|im_end|>"
    "{%- elif m.role == 'tool' %}<|im_system|>tool<|im_middle|>## Return of "
    "{{ m.tool_call_id }}\n{{ m.content }}<|im_end|>"
    "{%- else %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>"
    "{%- endif %}")

GPT_OSS = (
    "<|start|>system<|message|>Valid channels: analysis, commentary, final.<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\nnamespace functions {\n"
    "{%- for t in tools %}\ntype {{ t.function.name }} = (_: object) => any;{%- endfor %}\n"
    "} // namespace functions<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{%- for c in m.tool_calls or [] %}"
    "<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary json<|message|>"
    "{{ c.function.arguments | tojson }}<|call|>{%- endfor %}"
    "{%- if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- endif %}"
    "{%- elif m.role == 'tool' %}<|start|>functions.{{ m.name or 'tool' }} to=assistant"
    "<|channel|>commentary<|message|>{{ m.content }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")

PYTHONIC = (
    "<|start_header_id|>system<|end_header_id|>\n\n{%- if tools %}Reply with "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]"
    " to call: {% for t in tools %}{{ t.function.name }} {% endfor %}{%- endif %}<|eot_id|>"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n[{%- for c in m.tool_calls %}"
    "{{ c.function.name }}({%- for k, v in c.function.arguments.items() %}{{ k }}="
    "{{ v | tojson }}{{ ', ' if not loop.last }}{%- endfor %}){{ ', ' if not loop.last }}"
    "{%- endfor %}]<|eot_id|>"
    "{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}"
    "<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- endif %}")

TEMPLATES = {"qwen3_coder": QWEN3_CODER, "glm45": GLM45, "deepseekv3": DEEPSEEK_V3,
             "deepseekv31": DEEPSEEK_V31, "kimi_k2": KIMI_K2, "gpt-oss": GPT_OSS,
             "pythonic": PYTHONIC}
