"""Chat messages -> prompt text, with the model's chat template or a built-in format.

:func:`resolve_chat_template` picks the template the way it says in :attr:`ChatTemplate.source`:

1. ``override`` (``--chat-template``): a built-in name (:data:`BUILTIN_TEMPLATES`) or a Jinja
   template (any text containing ``{%`` or ``{{``);
2. the GGUF's ``tokenizer.chat_template`` (Jinja);
3. a built-in format known for the architecture (gemma3 GGUFs often carry no template: gemma's
   ``<start_of_turn>`` format; Qwen architectures: ChatML), or for the vocabulary (a
   ``<start_of_turn>``, ``<|start_header_id|>`` or ``<|im_start|>`` token);
4. ChatML, llama.cpp's fallback when a model has no template.

The rendered text is meant for ``Tokenizer.encode(text)`` with the model's defaults
(``parse_special=True``, BOS added when the model says so). It never carries the BOS text when the
tokenizer adds BOS itself, so a prompt starts with exactly one BOS:

- the built-in formats never write BOS (as llama.cpp's ``llm_chat_apply_template``);
- a Jinja template gets ``bos_token``/``eos_token`` (the tokens' texts, e.g. ``<bos>``) and may
  write them; as llama.cpp's ``common_chat_templates_apply`` does, a leading BOS text is cut off
  when the tokenizer adds BOS (``add_bos``) and a trailing EOS text when it adds EOS.

Jinja templates run in ``jinja2.sandbox.ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks`` and the ``loopcontrols`` extension (the settings of transformers'
``apply_chat_template``), with ``raise_exception(msg)``, ``strftime_now(fmt)`` and a ``tojson``
filter that keeps non-ASCII text. Built-in formats give llama.cpp's ``llm_chat_apply_template``
output (``src/llama-chat.cpp``, b11434) byte for byte, under the same names (checked against
libllama's ``llama_chat_apply_template``; tests/test_chat.py holds the strings).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moecache.gguf_file import GGUFModel
    from moecache.tokenizer import Tokenizer

Messages = Sequence[dict[str, Any]]


@dataclass(frozen=True)
class ChatTemplate:
    """A chat format, ready to render.

    Attributes:
        name: ``"gguf"`` (the GGUF's ``tokenizer.chat_template``), ``"jinja"`` (a template given as
            an override) or a key of :data:`BUILTIN_TEMPLATES` (``"gemma"``, ``"chatml"``, ...).
        source: one line saying why this template was chosen.
        renderer: ``(messages, add_generation_prompt) -> str``; call :meth:`render` instead.
    """

    name: str
    source: str
    renderer: Callable[[Messages, bool], str] = field(repr=False, compare=False)

    def render(self, messages: Messages, add_generation_prompt: bool = True) -> str:
        """Prompt text for ``messages``.

        Args:
            messages: dicts with ``role`` (``"system"``, ``"user"``, ``"assistant"``, ...) and
                ``content`` (a str, or a list of ``{"type": "text", "text": ...}`` parts).
            add_generation_prompt: end with the opening of an assistant turn.

        Raises ValueError for malformed messages and for any error inside a Jinja template
        (including its own ``raise_exception``), with the template's name in the message.
        """
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ValueError(f"messages must be a list of dicts, not {type(messages).__name__}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                raise ValueError(f"message {i} must be a dict with a 'role' str and a 'content': {m!r:.80}")
        return self.renderer(messages, add_generation_prompt)


# ---- built-in formats (llama.cpp src/llama-chat.cpp llm_chat_apply_template) -------------------

def _text(content: Any) -> str:
    """A message's content as text: a str, or the ``text`` of each text part, joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    raise ValueError(f"message content must be a str or a list of text parts, not {type(content).__name__}")


def _trim(s: str) -> str:
    """llama.cpp's trim(): strip ASCII whitespace (C ``isspace``) at both ends."""
    return s.strip(" \t\n\v\f\r")


def _chatml(messages: Messages, add_gen: bool) -> str:
    out = [f"<|im_start|>{m['role']}\n{_text(m['content'])}<|im_end|>\n" for m in messages]
    if add_gen:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def _gemma(messages: Messages, add_gen: bool) -> str:
    """Gemma has no system role: system text (trimmed) opens the next user turn, then a blank line."""
    out, system = [], ""
    for m in messages:
        role = m["role"]
        if role == "system":
            system += _trim(_text(m["content"]))
            continue
        role = "model" if role == "assistant" else role
        out.append(f"<start_of_turn>{role}\n")
        if system and role != "model":
            out.append(system + "\n\n")
            system = ""
        out.append(_trim(_text(m["content"])) + "<end_of_turn>\n")
    if add_gen:
        out.append("<start_of_turn>model\n")
    return "".join(out)


def _llama3(messages: Messages, add_gen: bool) -> str:
    out = [f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{_trim(_text(m['content']))}<|eot_id|>"
           for m in messages]
    if add_gen:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)


def _llama2_format(messages: Messages, sys_tags: bool) -> str:
    out, inside = ["[INST] "], True
    for m in messages:
        role, content = m["role"], _text(m["content"])
        if not inside:
            out.append("[INST] ")
            inside = True
        if role == "system":
            out.append(f"<<SYS>>\n{content}\n<</SYS>>\n\n" if sys_tags else content + "\n")
        elif role == "user":
            out.append(content + " [/INST]")
        else:
            out.append(content + "</s>")
            inside = False
    return "".join(out)


def _llama2(messages: Messages, add_gen: bool) -> str:
    """Llama 2 chat, system text put as is before the first user text; ``add_gen`` is implicit."""
    return _llama2_format(messages, False)


def _llama2_sys(messages: Messages, add_gen: bool) -> str:
    """Llama 2 chat with the system text in ``<<SYS>>`` tags (Meta's format)."""
    return _llama2_format(messages, True)


def _mistral_v7(messages: Messages, add_gen: bool) -> str:
    """Mistral's v7 format (``[SYSTEM_PROMPT]``, ``[INST]``); ``add_gen`` is implicit."""
    out = []
    for m in messages:
        role, content = m["role"], _text(m["content"])
        if role == "system":
            out.append(f"[SYSTEM_PROMPT] {content}[/SYSTEM_PROMPT]")
        elif role == "user":
            out.append(f"[INST] {content}[/INST]")
        else:
            out.append(f" {content}</s>")
    return "".join(out)


# name -> (renderer, one-line description); the names are llama.cpp's --chat-template names
BUILTIN_TEMPLATES: dict[str, tuple[Callable[[Messages, bool], str], str]] = {
    "chatml": (_chatml, "ChatML: <|im_start|>role\\n...<|im_end|> (Qwen, many others)"),
    "gemma": (_gemma, "Gemma: <start_of_turn>user\\n...<end_of_turn>, assistant is 'model', no system role"),
    "llama3": (_llama3, "Llama 3: <|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>"),
    "llama2": (_llama2, "Llama 2 chat: [INST] system\\n... [/INST] ...</s>"),
    "llama2-sys": (_llama2_sys, "Llama 2 chat: [INST] <<SYS>>\\n...\\n<</SYS>>\\n\\n... [/INST] ...</s>"),
    "mistral-v7": (_mistral_v7, "Mistral v7: [SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST] ...[/INST]"),
}

# architecture (general.architecture) -> built-in format, for GGUFs without a template
ARCH_TEMPLATES: dict[str, tuple[str, str]] = {
    **dict.fromkeys(("gemma", "gemma2", "gemma3", "gemma3n"), ("gemma", "gemma's <start_of_turn> format")),
    **dict.fromkeys(("qwen2", "qwen2moe", "qwen3", "qwen3moe"), ("chatml", "ChatML, the Qwen format")),
}

# a token of the vocabulary that identifies a format
_VOCAB_MARKERS = (("<start_of_turn>", "gemma"), ("<|start_header_id|>", "llama3"), ("<|im_start|>", "chatml"))


# ---- Jinja templates ---------------------------------------------------------------------------

class _TemplateRaised(Exception):
    """raise_exception() called by a template."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def jinja_renderer(source: str, name: str, bos_token: str = "", eos_token: str = "", strip_bos: bool = False,
                   strip_eos: bool = False) -> Callable[[Messages, bool], str]:
    """Compile a Jinja chat template; returns ``(messages, add_generation_prompt) -> str``.

    ``bos_token``/``eos_token`` are passed to the template; ``strip_bos``/``strip_eos`` cut one
    leading BOS / trailing EOS text off the result (for a tokenizer that adds them itself).
    Raises ValueError when the template does not compile; the renderer raises ValueError when
    it fails (``raise_exception`` included).
    """
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        tmpl = env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template ({name}) does not compile: line {e.lineno}: {e.message}") from None

    def render(messages: Messages, add_generation_prompt: bool) -> str:
        try:
            text = tmpl.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token)
        except _TemplateRaised as e:
            raise ValueError(f"chat template ({name}) refused the messages: {e}") from None
        except Exception as e:  # jinja2 errors, and TypeError etc. from inside the template
            raise ValueError(f"chat template ({name}) failed: {type(e).__name__}: {e}") from None
        if strip_bos and bos_token and text.startswith(bos_token):
            text = text[len(bos_token):]
        if strip_eos and eos_token and text.endswith(eos_token):
            text = text[:-len(eos_token)]
        return text

    return render


def _token_text(tok: Tokenizer, id: int | None) -> str:
    return "" if id is None else tok.token_bytes(id).decode("utf-8", errors="replace")


def _jinja(tok: Tokenizer, source: str, name: str, why: str) -> ChatTemplate:
    fn = jinja_renderer(source, name, _token_text(tok, tok.bos_id), _token_text(tok, tok.eos_id),
                        strip_bos=tok.add_bos, strip_eos=tok.add_eos)
    return ChatTemplate(name, why, fn)


def _builtin(name: str, why: str) -> ChatTemplate:
    return ChatTemplate(name, why, BUILTIN_TEMPLATES[name][0])


def resolve_chat_template(model: GGUFModel, tok: Tokenizer, override: str | None = None) -> ChatTemplate:
    """The chat template for ``model``; see the module docstring for the order of choices.

    Args:
        model: the opened GGUF (``tokenizer.chat_template``, ``general.architecture``).
        tok: its tokenizer (BOS/EOS texts, whether it adds BOS/EOS, its vocabulary).
        override: ``--chat-template``: a name of :data:`BUILTIN_TEMPLATES` or a Jinja template.

    Raises ValueError for an unknown override name (listing the valid ones) and for a template
    (given or from the GGUF) that does not compile.
    """
    if override is not None:
        if "{%" in override or "{{" in override:
            return _jinja(tok, override, "jinja", "--chat-template (a Jinja template)")
        if override not in BUILTIN_TEMPLATES:
            raise ValueError(f"unknown chat template {override!r}: use one of {', '.join(BUILTIN_TEMPLATES)}, "
                             f"or a Jinja template")
        return _builtin(override, f"--chat-template {override}")
    source = model.tokenizer.chat_template
    if source:
        return _jinja(tok, source, "gguf", "tokenizer.chat_template from the GGUF")
    arch = model.arch
    if arch in ARCH_TEMPLATES:
        name, what = ARCH_TEMPLATES[arch]
        return _builtin(name, f"{arch} has no tokenizer.chat_template: using {what}")
    vocab = set(tok.tokens)
    for marker, name in _VOCAB_MARKERS:
        if marker in vocab:
            return _builtin(name, f"{arch} has no tokenizer.chat_template; its vocabulary has {marker}: using {name}")
    return _builtin("chatml", f"no template and no known format for arch {arch}: ChatML (llama.cpp's fallback)")


class ChatSession:
    """A multi-turn chat over one engine sequence, appending only what is new each turn.

    Each turn renders the whole conversation with the template, evaluates the text past what the
    KV cache already holds, and generates the reply (llama-cli's approach). Invariant after every
    turn: the cache holds exactly ``cached_ids`` and they decode to ``rendered``. A sampled token
    that was not evaluated (the last one of ``-n``, an end-of-turn, Ctrl-C) is not in the cache; the
    next render supplies its text again. If the template renders earlier turns differently, the
    sequence is re-evaluated from the start.

    Args:
        engine: a :class:`moecache.engine.Engine` (its sequence is used from empty).
        template: the chat template.
        system: optional system prompt.
    """

    def __init__(self, engine, template: ChatTemplate, system: str | None = None):
        self.engine = engine
        self.template = template
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        self.rendered = ""
        self.cached_ids: list[int] = []
        engine.reset()

    def turn(self, user: str, sampler, n_predict: int, on_token=None):
        """Add a user message and generate the reply.

        Returns the :class:`moecache.engine.Generation`; a Ctrl-C before the reply started leaves
        the conversation as it was. Raises ValueError (template error) and ContextFullError (the
        message does not fit; nothing changes then).
        """
        eng, tok = self.engine, self.engine.tokenizer
        full = self.template.render(self.messages + [{"role": "user", "content": user}], add_generation_prompt=True)
        if not full.startswith(self.rendered):
            eng.reset()
            self.rendered, self.cached_ids = "", []
        ids = tok.encode(full[len(self.rendered):], add_bos=None if eng.n_past == 0 else False)
        eng.kv.check_room(len(ids))
        n_before = eng.n_past
        reply: list[int] = []

        def collect(t: int) -> None:
            reply.append(t)
            if on_token is not None:
                on_token(t)
        res = eng.generate(ids, sampler, n_predict, collect)
        if res.stop == "interrupted" and res.timings.n_prompt == 0:
            return res  # the message was never read: as if not sent
        self.messages.append({"role": "user", "content": user})
        self.messages.append({"role": "assistant", "content": tok.decode(reply, skip_special=True)})
        in_cache = eng.n_past - n_before - len(ids)
        self.cached_ids += ids + reply[:in_cache]
        self.rendered = full + tok.decode(reply[:in_cache])
        return res
