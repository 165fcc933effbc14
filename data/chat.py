"""Render conversations with the target tokenizer's own chat template and mark assistant tokens for loss.

`apply_chat_template(return_assistant_tokens_mask=True)` only works for templates with
`{% generation %}` markers, which real templates mostly lack. So the mask is computed on the
full render F of the conversation (the text the target really sees) by locating each assistant turn:
  * the generation prompt (e.g. `<|im_start|>assistant\n`) is the render of messages[:i] with
    `add_generation_prompt=True` minus the render without it;
  * the turn's end marker (e.g. `<|im_end|>`, `<|eot_id|>`) is what the template writes after an
    assistant message's content, read once from a probe conversation;
  * turn i's loss span runs from after its generation prompt to the end of its end marker, and must
    contain the message's content. Everything the model generates in that turn (reasoning a template keeps,
    tool calls, the end marker) is trained; what the template drops from earlier turns is simply absent.
  * templates without an end-of-turn token (GLM-style: the next role tag ends the turn) run the span to where the
    render of the conversation through this turn ends, so tool-call blocks after the content are trained, plus
    the next turn's tag when it is a token the model stops on (`stop_tokens`: GLM-4 ends its turns by emitting
    <|user|> or <|observation|>, both eos ids in its generation_config); a turn the template writes with no header (DeepSeek-V3-style answers after a tool result) starts where the
    render of the history before it ends.
Because spans are searched in F itself rather than in prefix renders, templates that render earlier
turns differently (dropping their reasoning, say) get correct masks.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from .conversations import Conversation, MalformedSample, SkipReport


@dataclass
class TokenizedSample:
    id: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is produced by an assistant turn that carries loss


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def split_inline_reasoning(message: dict) -> dict:
    """An assistant message whose content starts with `<think>…</think>` and has no reasoning_content, as one
    with the reasoning in reasoning_content and the answer in content (what templates that render reasoning
    expect); any other message unchanged."""
    content = message.get("content") or ""
    head = content.lstrip()
    if message["role"] != "assistant" or message.get("reasoning_content") or not head.startswith("<think>") \
            or "</think>" not in head:
        return message
    reasoning, _, answer = head[len("<think>"):].partition("</think>")
    return message | {"reasoning_content": reasoning.strip(), "content": answer.lstrip()}


def parsed_tool_arguments(message: dict) -> dict:
    """A message whose tool calls carry JSON-string arguments (OpenAI's form), with them parsed into mappings;
    arguments that are not a JSON object stay as written."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        args = (call.get("function") or {}).get("arguments")
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except json.JSONDecodeError:
                parsed = None
            if isinstance(parsed, dict):
                call = call | {"function": call["function"] | {"arguments": parsed}}
        out.append(call)
    return message | {"tool_calls": out}


class ChatTokenizer:
    """Chat template render + assistant loss mask + tokenization, for one target tokenizer."""

    def __init__(self, tokenizer: Any, loss_on: str = "all", max_length: int = 2048, overflow: str = "truncate",
                 template_kwargs: dict[str, Any] | None = None, stop_tokens: list[str] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat_template")
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("a fast tokenizer is needed (character offsets locate assistant tokens)")
        self.tokenizer, self.loss_on = tokenizer, loss_on
        self.max_length, self.overflow = max_length, overflow
        self.template_kwargs = dict(template_kwargs or {})  # data.chat_template_kwargs, in every render
        self.template_name = f"the chat template of {getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'}"
        self.end_marker = self._probe_end_marker()
        # what the model emits to end a turn when the template writes no end-of-turn token (GLM-4: <|user|>,
        # <|observation|>, its generation_config's eos ids): trained where the render shows one after the turn
        self.stop_tokens = [t for t in stop_tokens or [] if t] if not self.end_marker else []
        # Templates that render `reasoning_content` (Qwen3, DeepSeek-R1, Kimi styles) expect reasoning there, and
        # move or drop reasoning written inline: such rows are split before rendering
        probe = [{"role": "user", "content": "ping"},
                 {"role": "assistant", "content": "pong", "reasoning_content": "probe-reasoning"}]
        self.renders_reasoning = "probe-reasoning" in self.render(probe)
        # Templates that JSON-encode tool arguments themselves (`arguments | tojson`, Qwen style) need a mapping;
        # OpenAI rows carry a JSON string, which they would write escaped, as a string
        call = [{"type": "function", "function": {"name": "probe_tool", "arguments": '{"probe_key": 1}'}}]
        probe = [probe[0], {"role": "assistant", "content": "pong", "tool_calls": call}]
        try:
            self.tool_arguments_as_mapping = '\\"probe_key\\"' in self.render(probe)
        except Exception:  # a template that refuses tool calls in this shape: nothing to adapt
            self.tool_arguments_as_mapping = False

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **self.template_kwargs)

    def _probe_end_marker(self) -> str:
        probe = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
        prompt, full = self.render(probe[:1], True), self.render(probe)
        if prompt == self.render(probe[:1], False):
            # Some published copies (Llama-3 ones among them) append the assistant header to every render: then
            # no render says where an assistant turn starts, and every sample would fail on its own
            raise ValueError(f"{self.template_name}: it ignores add_generation_prompt (a conversation ending with a "
                             "user turn renders the same with and without it, the assistant header appended either "
                             "way), so an assistant turn's start cannot be found; point target.tokenizer at a "
                             "tokenizer whose template adds the header only when asked (the model's original one)")
        if not full.startswith(prompt):
            raise ValueError("chat template: the generation prompt is not a prefix of the rendered reply; "
                             f"prompt={prompt!r} full={full!r}")
        reply = full[len(prompt):]
        return reply[reply.rfind("pong") + len("pong"):].strip()

    def assistant_spans(self, messages: list[dict], tools: list[dict] | None = None
                        ) -> tuple[str, list[tuple[int, int]]]:
        """The full render and the character span of every assistant turn in it."""
        text = self.render(messages, tools=tools)
        spans, cursor = [], 0
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            prompt, plain = self.render(messages[:i], True, tools), self.render(messages[:i], tools=tools)
            header = prompt[_common_prefix_len(prompt, plain):]
            if header:
                pos = text.find(header, cursor)
                if pos < 0:
                    raise ValueError(f"message {i}: the assistant generation prompt {header!r} is not in the render")
                start = pos + len(header)
            elif text.startswith(plain) and len(plain) >= cursor:
                # no header for this turn (DeepSeek-V3-style templates write the answer after a tool result
                # directly): it starts where the render of the history before it ends
                start = len(plain)
            else:
                raise ValueError(f"message {i}: the template writes no assistant header after a "
                                 f"{messages[i - 1]['role'] if i else 'first'} message and renders the earlier turns "
                                 "differently in the full conversation, so this turn's start cannot be found")
            content = msg.get("content", "").strip()
            content_end = start
            if content:
                found = text.find(content, start)
                if found < 0:
                    raise ValueError(f"message {i}: the assistant content is not in the render after its prompt")
                content_end = found + len(content)
            end = content_end
            if self.end_marker:
                found = text.find(self.end_marker, content_end)
                if found < 0:
                    raise ValueError(f"message {i}: no end marker {self.end_marker!r} after the assistant turn")
                end = found + len(self.end_marker)
            else:
                # no end-of-turn token (GLM-style templates: the next role tag ends the turn): the turn runs to where
                # the next turn's text begins, tool-call blocks written after the content included
                through = self.render(messages[:i + 1], tools=tools)
                if text.startswith(through) and len(through) >= content_end:
                    end = len(through)
                stop = next((t for t in self.stop_tokens if text.startswith(t, end)), "")
                end += len(stop)  # the next turn's tag, when it is the token the model stops on
            spans.append((start, end))
            cursor = end
        return text, spans

    def __call__(self, conv: Conversation, report: SkipReport | None = None) -> TokenizedSample:
        """Render + mask + tokenize (untruncated). Raises MalformedSample naming the sample. What the template
        leaves out of the text (reasoning it does not render, tool declarations it ignores) is counted in `report`."""
        messages = [split_inline_reasoning(m) for m in conv.messages] if self.renders_reasoning else conv.messages
        if self.tool_arguments_as_mapping:
            messages = [parsed_tool_arguments(m) for m in messages]
        conv = dataclasses.replace(conv, messages=messages)
        try:
            text, spans = self.assistant_spans(conv.messages, conv.tools)
        except Exception as e:  # jinja's raise_exception, role-order checks, span search failures
            raise MalformedSample(f"sample {conv.id}", f"chat template: {e}", "template_error") from None
        if report is not None:
            for reason in self.unrendered(conv, text):
                report.unrendered[reason] += 1
        if self.loss_on == "last":
            spans = spans[-1:]
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        mask, k = [], 0
        for a, b in enc["offset_mapping"]:
            while k < len(spans) and spans[k][1] <= a:
                k += 1
            mask.append(int(k < len(spans) and b > spans[k][0] and a < spans[k][1]))
        return TokenizedSample(conv.id, list(enc["input_ids"]), mask)

    def unrendered(self, conv: Conversation, text: str) -> list[str]:
        """What of the conversation the render does not contain: a message's reasoning_content, the tools."""
        name = self.template_name
        missing = [f"reasoning_content ({name})" for m in conv.messages
                   if (m.get("reasoning_content") or "").strip() and m["reasoning_content"].strip() not in text]
        names = [t.get("function", t).get("name") for t in conv.tools or []]
        if any(n and n not in text for n in names):
            missing.append(f"tools ({name})")
        return missing

    def fit(self, sample: TokenizedSample, report: SkipReport) -> TokenizedSample | None:
        """Apply the length budget; a dropped sample is counted in the report."""
        if len(sample.input_ids) > self.max_length:
            if self.overflow == "drop":
                report.skip("too_long", f"sample {sample.id}", f"{len(sample.input_ids)} tokens")
                return None
            report.truncated += 1
            sample = TokenizedSample(sample.id, sample.input_ids[:self.max_length], sample.loss_mask[:self.max_length])
        if not any(sample.loss_mask):
            report.skip("no_loss_tokens", f"sample {sample.id}")
            return None
        return sample
