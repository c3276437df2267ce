"""llama.cpp's built-in chat formats (``--chat-template NAME``) and its template-name detection.

Source of every format and of the detection: llama.cpp b11434 ``src/llama-chat.cpp``
(``llm_chat_apply_template``, ``llm_chat_detect_template``, the 54 names of
``llama_chat_builtin_templates``). tests/data/llamacpp/chat_templates.json holds that code's output,
recorded for the tests. Like llama.cpp, the formats never write the BOS token (the tokenizer adds
it), and a format that has no generation prompt ignores ``add_generation_prompt``.

A message here is ``(role, content)``, both str. Most formats are data (:class:`_Format`: text per
role, a generation prompt); the few with state across messages are functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Turns = Sequence[tuple[str, str]]
Renderer = Callable[[Turns, bool], str]

_ASCII_UPPER = {c: c - 32 for c in range(ord("a"), ord("z") + 1)}


def trim(s: str) -> str:
    """llama.cpp's ``trim()``: strip C ``isspace`` characters (ASCII whitespace) at both ends."""
    return s.strip(" \t\n\v\f\r")


@dataclass(frozen=True)
class _Format:
    """A format written message by message.

    ``roles`` maps a role to the text written for one message of that role, with the fields
    ``{role}``, ``{Role}`` (first letter upper-cased), ``{ROLE}`` (ASCII upper-cased), ``{content}``
    and ``{trimmed}`` (content through :func:`trim`); ``"*"`` is for any other role, and a role
    without an entry writes nothing. ``head`` opens the text, ``gen`` is the generation prompt.
    """

    roles: dict[str, str]
    gen: str = ""
    head: str = ""

    def __call__(self, turns: Turns, add_gen: bool) -> str:
        out = [self.head]
        for role, content in turns:
            fmt = self.roles.get(role, self.roles.get("*"))
            if fmt is not None:
                out.append(fmt.format(role=role, Role=role[:1].translate(_ASCII_UPPER) + role[1:],
                                      ROLE=role.translate(_ASCII_UPPER), content=content, trimmed=trim(content)))
        if add_gen:
            out.append(self.gen)
        return "".join(out)


def _any(fmt: str, gen: str = "", head: str = "") -> _Format:
    return _Format({"*": fmt}, gen, head)


@dataclass(frozen=True)
class _Mistral:
    """Mistral v1 / v3 / v3-tekken: ``[INST]`` opens a turn, an assistant message closes it."""

    lead: str        # " " before [INST] and [/INST] (v1)
    trail: str       # " " after [INST] and before the assistant text (v1, v3)
    trim_reply: bool  # v3 trims the assistant text

    def __call__(self, turns: Turns, add_gen: bool) -> str:
        out, inside = [], False
        for role, content in turns:
            if not inside:
                out.append(f"{self.lead}[INST]{self.trail}")
                inside = True
            if role == "system":
                out.append(content + "\n\n")
            elif role == "user":
                out.append(f"{content}{self.lead}[/INST]")
            else:
                out.append(self.trail + (trim(content) if self.trim_reply else content) + "</s>")
                inside = False
        return "".join(out)


@dataclass(frozen=True)
class _Llama2:
    """Llama 2 chat and its variants: system in ``<<SYS>>`` tags (or plain text, ``llama2``), a
    ``<s>`` before each later ``[INST]`` (``-bos``), messages trimmed (``-strip``)."""

    sys_tags: bool
    bos_inside: bool = False
    strip: bool = False

    def __call__(self, turns: Turns, add_gen: bool) -> str:
        out, inside = ["[INST] "], True
        for role, content in turns:
            if self.strip:
                content = trim(content)
            if not inside:
                out.append("<s>[INST] " if self.bos_inside else "[INST] ")
                inside = True
            if role == "system":
                out.append(f"<<SYS>>\n{content}\n<</SYS>>\n\n" if self.sys_tags else content + "\n")
            elif role == "user":
                out.append(content + " [/INST]")
            else:
                out.append(content + "</s>")
                inside = False
        return "".join(out)


def _gemma(turns: Turns, add_gen: bool) -> str:
    """No system role: the system texts (trimmed) open the next user turn, then a blank line."""
    out, system = [], ""
    for role, content in turns:
        if role == "system":
            system += trim(content)
            continue
        role = "model" if role == "assistant" else role
        out.append(f"<start_of_turn>{role}\n")
        if system and role != "model":
            out.append(system + "\n\n")
            system = ""
        out.append(trim(content) + "<end_of_turn>\n")
    if add_gen:
        out.append("<start_of_turn>model\n")
    return "".join(out)


def _orion(turns: Turns, add_gen: bool) -> str:
    """No system role: the system texts open the next ``Human:`` turn; no generation prompt (each
    user turn ends with ``Assistant: </s>``)."""
    out, system = [], ""
    for role, content in turns:
        if role == "system":
            system += content
        elif role == "user":
            out.append("Human: " + (system + "\n\n" if system else "") + content + "\n\nAssistant: </s>")
            system = ""
        else:
            out.append(content + "</s>")
    return "".join(out)


def _monarch(turns: Turns, add_gen: bool) -> str:
    """``<s>`` before every message but the first."""
    out = [f"{'<s>' if i else ''}{role}\n{content}</s>\n" for i, (role, content) in enumerate(turns)]
    if add_gen:
        out.append("<s>assistant\n")
    return "".join(out)


def _rwkv_world(turns: Turns, add_gen: bool) -> str:
    """``Assistant:`` after the last message when it is a user message, whatever ``add_gen``."""
    out = []
    for i, (role, content) in enumerate(turns):
        if role == "system":
            out.append(f"System: {trim(content)}\n\n")
        elif role == "user":
            out.append(f"User: {trim(content)}\n\n" + ("Assistant:" if i == len(turns) - 1 else ""))
        elif role == "assistant":
            out.append(f"Assistant: {trim(content)}\n\n")
    return "".join(out)


def _gigachat(turns: Turns, add_gen: bool) -> str:
    """A first system message goes right after ``<s>``; later system messages are dropped."""
    has_system = bool(turns) and turns[0][0] == "system"
    out = ["<s>" + (turns[0][1] + "<|message_sep|>" if has_system else "")]
    for role, content in turns[1 if has_system else 0:]:
        if role == "user":
            out.append(f"user<|role_sep|>{content}<|message_sep|>available functions<|role_sep|>[]<|message_sep|>")
        elif role == "assistant":
            out.append(f"assistant<|role_sep|>{content}<|message_sep|>")
    if add_gen:
        out.append("assistant<|role_sep|>")
    return "".join(out)


_BAILING2 = _Format({"user": "<role>HUMAN</role>{content}<|role_end|>", "*": "<role>{ROLE}</role>{content}<|role_end|>"},
                    "<role>ASSISTANT</role>")


def _bailing2(turns: Turns, add_gen: bool) -> str:
    """Without a first system message, a default one (``detailed thinking off``) comes first."""
    head = "" if turns and turns[0][0] == "system" else "<role>SYSTEM</role>detailed thinking off<|role_end|>"
    return head + _BAILING2(turns, add_gen)


def _hunyuan_dense(turns: Turns, add_gen: bool) -> str:
    """Only a first system message is written; a user turn ends with the assistant marker."""
    out = []
    for i, (role, content) in enumerate(turns):
        if i == 0 and role == "system":
            out.append(content + "<｜hy_place▁holder▁no▁3｜>")
        if role == "assistant":
            out.append(f"<｜hy_Assistant｜>{content}<｜hy_place▁holder▁no▁2｜>")
        elif role == "user":
            out.append(f"<｜hy_User｜>{content}<｜hy_Assistant｜>")
    return "".join(out)


def _hunyuan_vl(turns: Turns, add_gen: bool) -> str:
    """Markers after the text; only a first system message is written."""
    out = ["<｜hy_begin▁of▁sentence｜>"]
    for i, (role, content) in enumerate(turns):
        if i == 0 and role == "system":
            out.append(content + "<｜hy_place▁holder▁no▁3｜>")
        elif role == "user":
            out.append(content + "<｜hy_User｜>")
        elif role == "assistant":
            out.append(content + "<｜hy_Assistant｜>")
    return "".join(out)


_PANGU = _Format({r: f"[unused9]{zh}：{{content}}[unused10]" for r, zh in
                  (("system", "系统"), ("user", "用户"), ("assistant", "助手"), ("tool", "工具"), ("function", "方法"))},
                 "[unused9]助手：")


def _pangu(turns: Turns, add_gen: bool) -> str:
    """An empty system message first when the conversation does not start with one."""
    head = "" if turns and turns[0][0] == "system" else ("[unused9]系统：[unused10]" if turns else "")
    return head + _PANGU(turns, add_gen)


_V7 = {"system": "[SYSTEM_PROMPT]{sp}{{content}}[/SYSTEM_PROMPT]", "user": "[INST]{sp}{{content}}[/INST]",
       "*": "{sp}{{content}}</s>"}
_VICUNA = {"user": "USER: {content}\n", "assistant": "ASSISTANT: {content}</s>\n"}
_EXAONE3 = {"system": "[|system|]{trimmed}[|endofturn|]\n", "user": "[|user|]{trimmed}\n",
            "assistant": "[|assistant|]{trimmed}[|endofturn|]\n"}
_GRANITE4 = {"assistant_tool_call": "<|start_of_role|>assistant<|end_of_role|><|tool_call|>{content}<|end_of_text|>\n",
             "*": "<|start_of_role|>{role}<|end_of_role|>{content}<|end_of_text|>\n"}
_BAILING = {"user": "<role>HUMAN</role>{content}", "*": "<role>{ROLE}</role>{content}"}

# name -> renderer; the names, in the order of llama.cpp's table
BUILTIN_TEMPLATES: dict[str, Renderer] = {
    "chatml": _any("<|im_start|>{role}\n{content}<|im_end|>\n", "<|im_start|>assistant\n"),
    "llama2": _Llama2(sys_tags=False),
    "llama2-sys": _Llama2(sys_tags=True),
    "llama2-sys-bos": _Llama2(sys_tags=True, bos_inside=True),
    "llama2-sys-strip": _Llama2(sys_tags=True, strip=True),
    "mistral-v1": _Mistral(" ", " ", False),
    "mistral-v3": _Mistral("", " ", True),
    "mistral-v3-tekken": _Mistral("", "", False),
    "mistral-v7": _Format({k: v.format(sp=" ") for k, v in _V7.items()}),
    "mistral-v7-tekken": _Format({k: v.format(sp="") for k, v in _V7.items()}),
    "phi3": _any("<|{role}|>\n{content}<|end|>\n", "<|assistant|>\n"),
    "phi4": _any("<|im_start|>{role}<|im_sep|>{content}<|im_end|>", "<|im_start|>assistant<|im_sep|>"),
    "falcon3": _any("<|{role}|>\n{content}\n", "<|assistant|>\n"),
    "zephyr": _any("<|{role}|>\n{content}<|endoftext|>\n", "<|assistant|>\n"),
    "monarch": _monarch,
    "gemma": _gemma,
    "orion": _orion,
    "openchat": _Format({"system": "{content}<|end_of_turn|>", "*": "GPT4 Correct {Role}: {content}<|end_of_turn|>"},
                        "GPT4 Correct Assistant:"),
    "vicuna": _Format({"system": "{content}\n\n", **_VICUNA}, "ASSISTANT:"),
    "vicuna-orca": _Format({"system": "SYSTEM: {content}\n", **_VICUNA}, "ASSISTANT:"),
    "deepseek": _Format({"system": "{content}", "user": "### Instruction:\n{content}\n",
                         "assistant": "### Response:\n{content}\n<|EOT|>\n"}, "### Response:\n"),
    "deepseek2": _Format({"system": "{content}\n\n", "user": "User: {content}\n\n",
                          "assistant": "Assistant: {content}<｜end▁of▁sentence｜>"}, "Assistant:"),
    "deepseek3": _Format({"system": "{content}\n\n", "user": "<｜User｜>{content}",
                          "assistant": "<｜Assistant｜>{content}<｜end▁of▁sentence｜>"}, "<｜Assistant｜>"),
    "deepseek-ocr": _any("{content}"),
    "command-r": _Format({r: f"<|START_OF_TURN_TOKEN|><|{tok}_TOKEN|>{{trimmed}}<|END_OF_TURN_TOKEN|>" for r, tok in
                          (("system", "SYSTEM"), ("user", "USER"), ("assistant", "CHATBOT"))},
                         "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"),
    "llama3": _any("<|start_header_id|>{role}<|end_header_id|>\n\n{trimmed}<|eot_id|>",
                   "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "chatglm3": _any("<|{role}|>\n {content}", "<|assistant|>", head="[gMASK]sop"),
    "chatglm4": _any("<|{role}|>\n{content}", "<|assistant|>\n", head="[gMASK]<sop>"),
    "glmedge": _any("<|{role}|>\n{content}", "<|assistant|>"),
    "minicpm": _Format({"user": "<用户>{trimmed}<AI>", "*": "{trimmed}"}),
    "exaone3": _Format(_EXAONE3, "[|assistant|]"),
    "exaone4": _Format({**_EXAONE3, "tool": "[|tool|]{trimmed}[|endofturn|]\n"}, "[|assistant|]"),
    "exaone-moe": _Format({r: f"<|{r}|>\n{{trimmed}}<|endofturn|>\n" for r in ("system", "user", "assistant", "tool")},
                          "<|assistant|>\n"),
    "rwkv-world": _rwkv_world,
    "granite": _Format({"assistant_tool_call": "<|start_of_role|>{role}<|end_of_role|><|tool_call|>{content}<|end_of_text|>\n",
                        "*": "<|start_of_role|>{role}<|end_of_role|>{content}<|end_of_text|>\n"},
                       "<|start_of_role|>assistant<|end_of_role|>"),
    "granite-4.0": _Format(_GRANITE4, "<|start_of_role|>assistant<|end_of_role|>"),
    "granite-4.1": _Format(_GRANITE4, "<|start_of_role|>assistant<|end_of_role|>"),
    "gigachat": _gigachat,
    "megrez": _any("<|role_start|>{role}<|role_end|>{content}<|turn_end|>", "<|role_start|>assistant<|role_end|>"),
    "yandex": _Format({"user": " Пользователь: {content}\n\n", "assistant": " Ассистент: {content}\n\n"},
                      " Ассистент:[SEP]"),
    "bailing": _Format(_BAILING, "<role>ASSISTANT</role>"),
    "bailing-think": _Format(_BAILING, "<role>ASSISTANT</role><think>"),
    "bailing2": _bailing2,
    "llama4": _any("<|header_start|>{role}<|header_end|>\n\n{trimmed}<|eot|>", "<|header_start|>assistant<|header_end|>\n\n"),
    "smolvlm": _Format({"system": "{content}\n\n", "user": "User: {content}<end_of_utterance>\n",
                        "*": "Assistant: {content}<end_of_utterance>\n"}, "Assistant:", head="<|im_start|>"),
    "hunyuan-moe": _Format({"system": "<|startoftext|>{content}<|extra_4|>", "assistant": "{content}<|eos|>",
                            "*": "<|startoftext|>{content}<|extra_0|>"}),
    "gpt-oss": _Format({"assistant": "<|start|>{role}<|message|>{content}<|return|>",
                        "*": "<|start|>{role}<|message|>{content}<|end|>"}, "<|start|>assistant"),
    "hunyuan-dense": _hunyuan_dense,
    "hunyuan-vl": _hunyuan_vl,
    "kimi-k2": _Format({"system": "<|im_system|>system<|im_middle|>{content}<|im_end|>",
                        "user": "<|im_user|>user<|im_middle|>{content}<|im_end|>",
                        "assistant": "<|im_assistant|>assistant<|im_middle|>{content}<|im_end|>",
                        "tool": "<|im_system|>tool<|im_middle|>{content}<|im_end|>", "*": "{content}<|im_end|>"},
                       "<|im_assistant|>assistant<|im_middle|>"),
    "seed_oss": _Format({"assistant": "<seed:bos>{role}\n{trimmed}<seed:eos>", "*": "<seed:bos>{role}\n{content}<seed:eos>"},
                        "<seed:bos>assistant\n"),
    "grok-2": _Format({"system": "System: {trimmed}<|separator|>\n\n", "user": "Human: {trimmed}<|separator|>\n\n",
                       "assistant": "Assistant: {content}<|separator|>\n\n"}, "Assistant:"),
    "pangu-embedded": _pangu,
    "solar-open": _any("<|begin|>{role}<|content|>{content}<|end|>", "<|begin|>assistant"),
}

# formats llama.cpp detects but offers under no name
DETECT_ONLY: dict[str, Renderer] = {
    "dots1": _Format({"system": "<|system|>{content}<|endofsystem|>", "user": "<|userprompt|>{content}<|endofuserprompt|>",
                      "*": "<|response|>{content}<|endofresponse|>"}, "<|response|>"),
}


def _detect_mistral(has: Callable[[str], bool]) -> str:
    if has("[SYSTEM_PROMPT]"):
        return "mistral-v7"
    if has("' [INST] ' + system_message") or has("[AVAILABLE_TOOLS]"):
        return "mistral-v1" if has(" [INST]") else "mistral-v3-tekken" if has('"[INST]"') else "mistral-v3"
    if has("content.strip()"):
        return "llama2-sys-strip"
    if has("bos_token + '[INST]"):
        return "llama2-sys-bos"
    return "llama2-sys" if has("<<SYS>>") else "llama2"


# (markers that must all be in the template, name), tried in order after the special cases of detect_template
_MARKERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<|assistant|>", "<|end|>"), "phi3"),
    (("[gMASK]<sop>",), "chatglm4"),
    (("<|assistant|>", "<|user|>", "<|tool_declare|>"), "exaone-moe"),
    (("<|assistant|>", "<|user|>", "</s>"), "falcon3"),
    (("<|assistant|>", "<|user|>"), "glmedge"),
    (("<|{{ item['role'] }}|>", "<|begin_of_image|>"), "glmedge"),
    (("<|user|>", "<|endoftext|>"), "zephyr"),
    (("bos_token + message['role']",), "monarch"),
    (("<start_of_turn>",), "gemma"),
    (("'\\n\\nAssistant: ' + eos_token",), "orion"),
    (("GPT4 Correct ",), "openchat"),
    (("USER: ", "ASSISTANT: ", "SYSTEM: "), "vicuna-orca"),
    (("USER: ", "ASSISTANT: "), "vicuna"),
    (("### Instruction:", "<|EOT|>"), "deepseek"),
    (("<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>"), "command-r"),
    (("<|start_header_id|>", "<|end_header_id|>"), "llama3"),
    (("[gMASK]sop",), "chatglm3"),
    (("<用户>",), "minicpm"),
    (("'Assistant: ' + message['content'] + eos_token",), "deepseek2"),
    (("<｜Assistant｜>", "<｜User｜>", "<｜end▁of▁sentence｜>"), "deepseek3"),
    (("[|system|]", "[|assistant|]", "[|endofturn|]", "[|tool|]"), "exaone4"),
    (("[|system|]", "[|assistant|]", "[|endofturn|]"), "exaone3"),
    (("rwkv-world",), "rwkv-world"),
    (("{{- 'User: ' + message['content']|trim + '\\n\\n' -}}",), "rwkv-world"),
    (("<|start_of_role|>", "<tool_call>", "g4_default_system_message"), "granite-4.0"),
    (("<|start_of_role|>", "<tools>", "g4_default_system_message"), "granite-4.0"),
    (("<|start_of_role|>", "<tool_call>"), "granite-4.1"),
    (("<|start_of_role|>", "<tools>"), "granite-4.1"),
    (("<|start_of_role|>",), "granite"),
    (("message['role'] + additional_special_tokens[0] + message['content'] + additional_special_tokens[1]",), "gigachat"),
    (("<|role_start|>",), "megrez"),
    ((" Ассистент:",), "yandex"),
    (("<role>ASSISTANT</role>", "'HUMAN'"), "bailing"),
    (("<role>ASSISTANT</role>", '"HUMAN"', "<think>"), "bailing-think"),
    (("<role>ASSISTANT</role>", "<role>HUMAN</role>", "<|role_end|>"), "bailing2"),
    (("<|header_start|>", "<|header_end|>"), "llama4"),
    (("<|endofuserprompt|>",), "dots1"),
    (("<|extra_0|>", "<|extra_4|>"), "hunyuan-moe"),
    (("<|start|>", "<|channel|>"), "gpt-oss"),
    (("<｜hy_Assistant｜>", "<｜hy_begin▁of▁sentence｜>"), "hunyuan-vl"),
    (("<｜hy_Assistant｜>", "<｜hy_place▁holder▁no▁3｜>"), "hunyuan-dense"),
    (("<|im_assistant|>assistant<|im_middle|>",), "kimi-k2"),
    (("<seed:bos>",), "seed_oss"),
    (("'Assistant: '  + message['content'] + '<|separator|>",), "grok-2"),
    (("[unused9]系统：[unused10]",), "pangu-embedded"),
    (("<|begin|>", "<|end|>", "<|content|>"), "solar-open"),
)


def detect_template(template: str) -> str | None:
    """The built-in format llama.cpp would use for a template string, or None (unknown).

    llama.cpp b11434 ``llm_chat_detect_template``: a built-in name is itself; otherwise substrings
    of the (Jinja) template text decide, in a fixed order. May return ``"dots1"``, a format
    llama.cpp renders but has no name for (in :data:`DETECT_ONLY`).
    """
    if template in BUILTIN_TEMPLATES:
        return template

    def has(s: str) -> bool:
        return s in template
    if has("<|im_start|>"):
        return "phi4" if has("<|im_sep|>") else "smolvlm" if has("<end_of_utterance>") else "chatml"
    if template.startswith("mistral") or has("[INST]"):
        return _detect_mistral(has)
    for markers, name in _MARKERS:
        if all(m in template for m in markers):
            return name
    return None


def render_builtin(name: str, turns: Turns, add_generation_prompt: bool) -> str:
    """Render ``turns`` (``(role, content)`` pairs) in the built-in (or detect-only) format ``name``."""
    return (BUILTIN_TEMPLATES.get(name) or DETECT_ONLY[name])(turns, add_generation_prompt)
