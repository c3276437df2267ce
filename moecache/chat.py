"""Chat messages -> prompt text, with the model's chat template or a built-in format.

:func:`resolve_chat_template` picks the template the way it says in :attr:`ChatTemplate.source`:

1. ``override`` (``--chat-template``): a built-in name (:data:`BUILTIN_TEMPLATES`) or a Jinja
   template (any text containing ``{%`` or ``{{``);
2. the GGUF's ``tokenizer.chat_template`` (Jinja); when it does not compile or fails on a user
   message, the built-in format llama.cpp's name detection finds in its text
   (:func:`moecache.chat_builtin.detect_template`);
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

Jinja templates are untrusted code: they run in :class:`moecache.chat_jinja.LimitedEnvironment`
(jinja2's sandbox with limits on time, size and memory; transformers' settings and llama.cpp's
globals). As llama.cpp does, a template is first probed with a system and a user message; when it
does not read the system message (or refuses it), a first system message is folded into the next
message (:func:`fold_system`; :attr:`ChatTemplate.folds_system` says so). The fold depends only
on the messages, so each turn's rendering still starts with the previous one.

Built-in formats (:mod:`moecache.chat_builtin`) give llama.cpp b11434's ``llm_chat_apply_template``
output (``src/llama-chat.cpp``) byte for byte, under the same 54 names (checked against recorded
output of that code: tests/data/llamacpp/chat_templates.json).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moecache.chat_builtin import BUILTIN_TEMPLATES, detect_template, render_builtin
from moecache.chat_jinja import CompiledTemplate
from moecache.errors import ChatTemplateError

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
        folds_system: the template does not read a system message (or refuses one), so a first
            system message is put before the next message's text (:func:`fold_system`).
    """

    name: str
    source: str
    renderer: Callable[[Messages, bool], str] = field(repr=False, compare=False)
    folds_system: bool = False

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


# ---- built-in formats (moecache/chat_builtin.py) ---------------------------------------------

def _text(content: Any) -> str:
    """A message's content as text: a str, or the ``text`` of each text part, joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    raise ValueError(f"message content must be a str or a list of text parts, not {type(content).__name__}")


def builtin_renderer(name: str) -> Callable[[Messages, bool], str]:
    """``(messages, add_generation_prompt) -> str`` for a built-in (or detect-only) format of
    :mod:`moecache.chat_builtin` (llama.cpp b11434 ``src/llama-chat.cpp``)."""
    def render(messages: Messages, add_generation_prompt: bool) -> str:
        return render_builtin(name, [(m["role"], _text(m["content"])) for m in messages], add_generation_prompt)
    return render


# architecture (general.architecture) -> built-in format, for GGUFs without a template
ARCH_TEMPLATES: dict[str, tuple[str, str]] = {
    **dict.fromkeys(("gemma", "gemma2", "gemma3", "gemma3n"), ("gemma", "gemma's <start_of_turn> format")),
    **dict.fromkeys(("qwen2", "qwen2moe", "qwen3", "qwen3moe"), ("chatml", "ChatML, the Qwen format")),
}

# a token of the vocabulary that identifies a format
_VOCAB_MARKERS = (("<start_of_turn>", "gemma"), ("<|start_header_id|>", "llama3"), ("<|im_start|>", "chatml"))


# ---- Jinja templates (sandboxed with limits: moecache/chat_jinja.py) -----------------------------

_PROBE_SYSTEM, _PROBE_USER = "System message", "User message"


def fold_system(messages: Messages) -> list[dict[str, Any]]:
    """llama.cpp's fold for templates without a system role (b11434 ``common/chat.cpp``,
    ``system_message_not_supported``): a first system message goes before the next message's text,
    joined by a newline; a system message alone is dropped. Other messages are unchanged."""
    msgs = [dict(m) for m in messages]
    if msgs and msgs[0].get("role") == "system":
        first = msgs.pop(0)
        if msgs:
            msgs[0]["content"] = _text(first["content"]) + "\n" + _text(msgs[0]["content"])
    return msgs


class _Probe(dict):
    """A message that records whether a template read its ``content``."""

    def __init__(self, role: str, content: str):
        super().__init__(role=role, content=content)
        self.content_read = False

    def __getitem__(self, key: Any) -> Any:
        self.content_read |= key == "content"
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.content_read |= key == "content"
        return super().get(key, default)


def has_system_role(compiled: CompiledTemplate, **variables: Any) -> bool:
    """Whether the template takes a system message as such; when not, :func:`fold_system` applies.

    As llama.cpp b11434 (``common/jinja/caps.cpp``: ``supports_system_role``), ``[system, user]``
    is rendered: no system role when that raises, or when the system message's content is neither
    read nor found in the output. Beyond llama.cpp, also none when the output is the same with the
    system message given the role ``assistant`` or ``user`` (a template that knows only user and
    assistant turns and renders a system message as one of them). Raises ChatTemplateError when the
    probe breaks a limit of the sandbox.
    """
    def render(role: str) -> tuple[str | None, bool]:
        msgs = [_Probe(role, _PROBE_SYSTEM), _Probe("user", _PROBE_USER)]
        try:
            return compiled.render(messages=msgs, add_generation_prompt=True, **variables), msgs[0].content_read
        except ChatTemplateError:
            raise
        except ValueError:
            return None, False

    out, read = render("system")
    if out is None or not (read or _PROBE_SYSTEM in out):
        return False
    return all(render(other)[0] != out for other in ("assistant", "user"))


def jinja_renderer(source: str, name: str, bos_token: str = "", eos_token: str = "", strip_bos: bool = False,
                   strip_eos: bool = False, fold: bool = False) -> Callable[[Messages, bool], str]:
    """Compile a Jinja chat template; returns ``(messages, add_generation_prompt) -> str``.

    ``bos_token``/``eos_token`` are passed to the template; ``strip_bos``/``strip_eos`` cut one
    leading BOS / trailing EOS text off the result (for a tokenizer that adds them itself);
    ``fold``: apply :func:`fold_system` to the messages first. The template runs in
    :class:`moecache.chat_jinja.LimitedEnvironment`. Raises ValueError when the template does not
    compile; the renderer raises ValueError when it fails (``raise_exception`` included) and
    :class:`moecache.errors.ChatTemplateError` (a ValueError) when it breaks a limit.
    """
    return _renderer(CompiledTemplate(source, name), bos_token, eos_token, strip_bos, strip_eos, fold)


def _renderer(compiled: CompiledTemplate, bos_token: str, eos_token: str, strip_bos: bool, strip_eos: bool,
              fold: bool) -> Callable[[Messages, bool], str]:
    def render(messages: Messages, add_generation_prompt: bool) -> str:
        msgs = fold_system(messages) if fold else list(messages)
        text = compiled.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token)
        if strip_bos and bos_token and text.startswith(bos_token):
            text = text[len(bos_token):]
        if strip_eos and eos_token and text.endswith(eos_token):
            text = text[:-len(eos_token)]
        return text
    return render


def _token_text(tok: Tokenizer, id: int | None) -> str:
    return "" if id is None else tok.token_bytes(id).decode("utf-8", errors="replace")


def _jinja(tok: Tokenizer, source: str, name: str, why: str) -> ChatTemplate:
    """A Jinja template, folding the system message when the template does not read it."""
    bos, eos = _token_text(tok, tok.bos_id), _token_text(tok, tok.eos_id)
    compiled = CompiledTemplate(source, name)
    fold = not has_system_role(compiled, bos_token=bos, eos_token=eos)
    render = _renderer(compiled, bos, eos, tok.add_bos, tok.add_eos, fold)
    render([{"role": "user", "content": _PROBE_USER}], True)  # ValueError when unusable
    return ChatTemplate(name, why, render, folds_system=fold)


def _builtin(name: str, why: str) -> ChatTemplate:
    return ChatTemplate(name, why, builtin_renderer(name))


def _gguf_template(tok: Tokenizer, source: str) -> ChatTemplate:
    """The GGUF's template; when Jinja cannot use it, the built-in format llama.cpp detects in it."""
    try:
        return _jinja(tok, source, "gguf", "tokenizer.chat_template from the GGUF")
    except ChatTemplateError:
        raise
    except ValueError as e:
        name = detect_template(source)
        if name is None:
            raise ValueError(f"{e}; llama.cpp's template detection does not recognize it either: "
                             f"choose a format with --chat-template NAME") from None
        return _builtin(name, f"tokenizer.chat_template from the GGUF is unusable in Jinja ({e}); llama.cpp "
                              f"detects the built-in format {name!r} in it")


def resolve_chat_template(model: GGUFModel, tok: Tokenizer, override: str | None = None) -> ChatTemplate:
    """The chat template for ``model``; see the module docstring for the order of choices.

    Args:
        model: the opened GGUF (``tokenizer.chat_template``, ``general.architecture``).
        tok: its tokenizer (BOS/EOS texts, whether it adds BOS/EOS, its vocabulary).
        override: ``--chat-template``: a name of :data:`BUILTIN_TEMPLATES` or a Jinja template.

    Raises ValueError for an unknown override name (listing the valid ones), for a given template
    that does not compile or fails on a user message, and for a GGUF template that does so and is
    not recognized by llama.cpp's name detection; ChatTemplateError (a ValueError) when a template
    breaks a limit of the sandbox while being compiled or probed.
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
        return _gguf_template(tok, source)
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
