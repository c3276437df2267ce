"""moecache.chat: which template is chosen, and the exact text each one renders.

The expected texts of the built-in formats and of the name detection are llama.cpp b11434's own
output (``src/llama-chat.cpp`` compiled and run: tests/data/llamacpp/chat_templates.json, see the
README there).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest

from moecache.chat import (BUILTIN_TEMPLATES, ChatTemplate, builtin_renderer, fold_system, jinja_renderer,
                           resolve_chat_template)
from moecache.chat_builtin import detect_template, render_builtin
from moecache.errors import ChatTemplateError
from moecache.gguf_file import open_gguf
from moecache.testing.synth import SynthConfig, write_model
from moecache.tokenizer import Tokenizer

CONVERSATION = [
    {"role": "system", "content": "You are helpful. "},
    {"role": "user", "content": " Hi\n"},
    {"role": "assistant", "content": "Hello! "},
    {"role": "user", "content": "How are you?"},
]

_TOKS: dict[Path, Tokenizer] = {}


def _load(path: Path) -> tuple:
    if path not in _TOKS:
        _TOKS[path] = Tokenizer.from_gguf(open_gguf(path))
    return open_gguf(path), _TOKS[path]


def _with_keys(src: Path, dst: Path, keys: dict[str, tuple[object, gguf.GGUFValueType]]) -> Path:
    """A copy of the GGUF ``src`` with metadata ``keys`` added or replaced."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF.") or f.name in keys:
            continue
        vtype = f.types[0]
        w.add_key_value(f.name, f.contents(), vtype,
                        sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for k, (v, vtype) in keys.items():
        w.add_key_value(k, v, vtype)
    for t in r.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in r.tensors:
        w.write_tensor_data(t.data)
    w.close()
    return dst


@pytest.fixture(scope="module")
def synth_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("chat") / "tiny.gguf"
    write_model(p, SynthConfig())
    return p


# a template of the kind GGUFs carry: BOS first, role markers, the generation prompt
GGUF_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('system message must come first') }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def templated_path(synth_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("chat") / "templated.gguf"
    return _with_keys(synth_path, dst, {"tokenizer.chat_template": (GGUF_TEMPLATE, gguf.GGUFValueType.STRING)})


# ---- gemma ------------------------------------------------------------------------------------

GEMMA_EXPECTED = ("<start_of_turn>user\nYou are helpful.\n\nHi<end_of_turn>\n"
                  "<start_of_turn>model\nHello!<end_of_turn>\n"
                  "<start_of_turn>user\nHow are you?<end_of_turn>\n"
                  "<start_of_turn>model\n")


def test_gemma3_uses_gemma_format(gemma3_270m: Path) -> None:
    model, tok = _load(gemma3_270m)
    assert model.tokenizer.chat_template is None
    t = resolve_chat_template(model, tok)
    assert t.name == "gemma"
    assert t.source == "gemma3 has no tokenizer.chat_template: using gemma's <start_of_turn> format"
    text = t.render(CONVERSATION)
    assert text == GEMMA_EXPECTED
    ids = tok.encode(text)
    assert ids[:4] == [2, 105, 2364, 107]  # one <bos> (the tokenizer's), <start_of_turn>, user, \n
    assert ids.count(2) == 1
    assert ids[-3:] == [105, 4368, 107]  # <start_of_turn> model \n
    assert [ids.count(105), ids.count(106)] == [4, 3]
    assert t.render(CONVERSATION, add_generation_prompt=False) == GEMMA_EXPECTED.removesuffix("<start_of_turn>model\n")


def test_gemma_system_only_before_a_user_turn() -> None:
    render = builtin_renderer("gemma")
    msgs = [{"role": "system", "content": "s1"}, {"role": "system", "content": " s2"},
            {"role": "user", "content": [{"type": "text", "text": "u"}, {"type": "image"},
                                         {"type": "text", "text": "v"}]}]
    assert render(msgs, True) == "<start_of_turn>user\ns1s2\n\nuv<end_of_turn>\n<start_of_turn>model\n"


# ---- every built-in format and the name detection, against llama.cpp's recorded output ---------

LLAMACPP = json.loads((Path(__file__).parent / "data" / "llamacpp" / "chat_templates.json").read_text())
RENDERINGS = LLAMACPP["renderings"]


def test_recorded_conversation_is_this_one() -> None:
    assert LLAMACPP["conversations"][0] == CONVERSATION


def test_every_llamacpp_name_is_built_in() -> None:
    names = {r["name"] for r in RENDERINGS} - {"dots1"}
    assert len(names) == 54 and set(BUILTIN_TEMPLATES) == names


@pytest.mark.parametrize("case", [r for r in RENDERINGS if r["conversation"] == 0 and r["name"] != "dots1"],
                         ids=lambda r: f"{r['name']}-{'gen' if r['add_generation_prompt'] else 'nogen'}")
def test_builtin_format_renders_as_llamacpp(synth_path: Path, case: dict) -> None:
    """The fixed conversation (system, user, assistant, user) through --chat-template NAME."""
    model, tok = _load(synth_path)
    t = resolve_chat_template(model, tok, override=case["name"])
    assert (t.name, t.source, t.folds_system) == (case["name"], f"--chat-template {case['name']}", False)
    assert t.render(CONVERSATION, add_generation_prompt=case["add_generation_prompt"]) == case["text"]


def test_builtin_formats_other_conversations() -> None:
    """No system message; a tool message; and the detect-only dots1 format."""
    done = 0
    for case in RENDERINGS:
        turns = [(m["role"], m["content"]) for m in LLAMACPP["conversations"][case["conversation"]]]
        assert render_builtin(case["name"], turns, case["add_generation_prompt"]) == case["text"], case
        done += 1
    assert done == 55 * 3 * 2


def test_detection_as_llamacpp() -> None:
    cases = LLAMACPP["detections"]
    assert len(cases) == 120
    for case in cases:
        assert (detect_template(case["template"]) or "unknown") == case["detected"], case["template"]


# a GGUF template that jinja2 cannot parse (a llama.cpp-only construct), with Phi-3's markers
BROKEN_PHI3 = ("{% for message in messages %}{{'<|' + message['role'] + '|>' + '\\n' + message['content'] + "
               "'<|end|>\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
               "{% generation_unknown %}")


def test_unusable_gguf_template_falls_back_to_llamacpp_detection(synth_path: Path, tmp_path: Path) -> None:
    src = _with_keys(synth_path, tmp_path / "broken.gguf",
                     {"tokenizer.chat_template": (BROKEN_PHI3, gguf.GGUFValueType.STRING)})
    model, tok = _load(src)
    t = resolve_chat_template(model, tok)
    assert t.name == "phi3"
    assert t.source.startswith("tokenizer.chat_template from the GGUF is unusable in Jinja (chat template (gguf) "
                               "does not compile: line 1: ")
    assert t.source.endswith("llama.cpp detects the built-in format 'phi3' in it")
    expected = next(r["text"] for r in RENDERINGS if r["name"] == "phi3" and r["conversation"] == 0
                    and r["add_generation_prompt"])
    assert t.render(CONVERSATION) == expected
    # unknown to the detection too: one error naming both failures
    src = _with_keys(synth_path, tmp_path / "unknown.gguf",
                     {"tokenizer.chat_template": ("{% if %}", gguf.GGUFValueType.STRING)})
    model, tok = _load(src)
    with pytest.raises(ValueError, match=r"^chat template \(gguf\) does not compile: line 1: .*; llama.cpp's "
                                         r"template detection does not recognize it either: choose a format with "
                                         r"--chat-template NAME$"):
        resolve_chat_template(model, tok)


def test_chatml_is_the_qwen_default(code_moe_tiny: Path) -> None:
    model, tok = _load(code_moe_tiny)
    t = resolve_chat_template(model, tok)
    assert t.name == "chatml" and t.source == "qwen3moe has no tokenizer.chat_template: using ChatML, the Qwen format"
    assert t.render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert t.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == \
        "<|im_start|>user\nhi<|im_end|>\n"


def test_fallbacks(synth_path: Path, gemma3_270m: Path) -> None:
    _, synth_tok = _load(synth_path)
    _, gemma_tok = _load(gemma3_270m)
    no_template = SimpleNamespace(chat_template=None)
    t = resolve_chat_template(SimpleNamespace(arch="mystery", tokenizer=no_template), synth_tok)
    assert t.name == "chatml"
    assert t.source == "no template and no known format for arch mystery: ChatML (llama.cpp's fallback)"
    t = resolve_chat_template(SimpleNamespace(arch="llama", tokenizer=no_template), gemma_tok)
    assert t.name == "gemma" and "its vocabulary has <start_of_turn>" in t.source


# ---- templates from the GGUF and from --chat-template -----------------------------------------

def test_gguf_template(templated_path: Path) -> None:
    model, tok = _load(templated_path)
    assert tok.add_bos and tok.bos_id == 1
    t = resolve_chat_template(model, tok)
    assert (t.name, t.source) == ("gguf", "tokenizer.chat_template from the GGUF")
    text = t.render(CONVERSATION[1:])
    # bos_token "<s>" was rendered first and cut off, since the tokenizer adds BOS itself
    assert text == "<|user|>\nHi</s>\n<|assistant|>\nHello!</s>\n<|user|>\nHow are you?</s>\n<|assistant|>\n"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids.count(1) == 1
    assert ids.count(2) == 3  # each </s> text is the EOS token
    with pytest.raises(ValueError, match=r"template \(gguf\) refused the messages: system message must come first"):
        t.render(CONVERSATION[1:] + CONVERSATION[:1])


def test_bos_kept_when_the_tokenizer_does_not_add_it() -> None:
    src = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}"
    assert jinja_renderer(src, "t", "<s>", "</s>")([{"role": "user", "content": "x"}], True) == "<s>x</s>"
    assert jinja_renderer(src, "t", "<s>", "</s>", strip_bos=True, strip_eos=True)(
        [{"role": "user", "content": "x"}], True) == "x"


def test_override_with_jinja(templated_path: Path) -> None:
    model, tok = _load(templated_path)
    src = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    t = resolve_chat_template(model, tok, override=src)
    assert (t.name, t.source) == ("jinja", "--chat-template (a Jinja template)")
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert t.render(msgs) == "[user] a\n[assistant] b\n"
    t = resolve_chat_template(model, tok, override="chatml")  # a name wins over the GGUF's template
    assert t.name == "chatml"


def test_jinja_environment() -> None:
    """trim_blocks/lstrip_blocks, loop controls, tojson without ASCII escapes, a sandbox."""
    src = ("{% for m in messages %}\n    {% if loop.index > 1 %}{% break %}{% endif %}\n"
           "{{ m | tojson }}\n{% endfor %}")
    out = jinja_renderer(src, "t")([{"role": "user", "content": "é"}, {"role": "user", "content": "z"}], True)
    assert out == '{"role": "user", "content": "é"}\n'
    with pytest.raises(ValueError, match=r"chat template \(t\) failed: SecurityError"):
        jinja_renderer("{{ messages.append(1) }}", "t")([], True)


def test_errors(synth_path: Path) -> None:
    model, tok = _load(synth_path)
    with pytest.raises(ValueError, match=r"unknown chat template 'vicuna2': use one of chatml, llama2, llama2-sys, "):
        resolve_chat_template(model, tok, override="vicuna2")
    with pytest.raises(ValueError, match=r"chat template \(jinja\) does not compile: line 1"):
        resolve_chat_template(model, tok, override="{% for m in messages %}")
    with pytest.raises(ValueError, match=r"chat template \(jinja\) failed: TypeError"):  # probed with a user message
        resolve_chat_template(model, tok, override="{{ messages[0].content + 1 }}")
    chatml = resolve_chat_template(model, tok, override="chatml")
    for bad in ("hello", [{"content": "no role"}], [{"role": "user"}], [("user", "x")]):
        with pytest.raises(ValueError, match="message"):
            chatml.render(bad)
    with pytest.raises(ValueError, match="content must be a str or a list"):
        chatml.render([{"role": "user", "content": 5}])


def test_chat_template_is_a_frozen_dataclass() -> None:
    t = ChatTemplate("x", "why", lambda m, g: "out")
    assert t.render([]) == "out"
    with pytest.raises(AttributeError):
        t.name = "y"  # type: ignore[misc]


def test_chat_session_cache_holds_exactly_the_rendered_conversation(code_moe_tiny):
    # after each turn the KV cache holds cached_ids, which decode to the rendered text; the last
    # sampled token of a reply cut by -n is not evaluated, so it must not be counted as cached
    from moecache.chat import ChatSession, resolve_chat_template
    from moecache.engine import Engine, EngineConfig
    from moecache.sampling import Sampler, SamplingParams

    with Engine(code_moe_tiny, EngineConfig(n_ctx=256)) as eng:
        s = ChatSession(eng, resolve_chat_template(eng.gguf, eng.tokenizer, "chatml"), system="Write Python.")
        for msg in ("def add(a, b):", "and subtract?"):
            res = s.turn(msg, Sampler(SamplingParams(temp=0.0)), n_predict=3)
            assert res.stop == "length" and len(res.tokens) == 3
            assert eng.n_past == len(s.cached_ids)
            assert s.cached_ids[0] == eng.tokenizer.bos_id  # added by the tokenizer, not in the text
            assert eng.tokenizer.decode(s.cached_ids[1:]) == s.rendered
            assert s.rendered.endswith(eng.tokenizer.decode(res.tokens[:2]))
        assert [m["role"] for m in s.messages] == ["system", "user", "assistant", "user", "assistant"]
        # the second turn's prompt starts with the first reply's unevaluated third token
        assert s.rendered.count("<|im_start|>user") == 2


# ---- templates without a system role: the system message is folded into the first user message --

NO_SYSTEM_ROLE = ("{% for m in messages %}{% if m['role'] == 'user' %}<u>{{ m['content'] }}</u>"
                  "{% else %}<a>{{ m['content'] }}</a>{% endif %}{% endfor %}")
REFUSES_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                  "supported') }}{% endif %}<u>{{ m['content'] }}</u>{% endfor %}")
# Phi-3-mini's kind: never reads a system message
IGNORES_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|>\n{{ m['content'] }}<|end|>\n"
                  "{% elif m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}<|end|>\n{% endif %}"
                  "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# Mistral-7B-Instruct v0.2's kind: roles must alternate from a user message
ALTERNATES = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
              "{% endif %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %}"
              "{{ m['content'] }}</s>{% endif %}{% endfor %}")


@pytest.mark.parametrize("src", [NO_SYSTEM_ROLE, REFUSES_SYSTEM], ids=["never-reads-system", "raises-on-system"])
def test_system_folded_into_first_user_message(synth_path: Path, src: str) -> None:
    model, tok = _load(synth_path)
    t = resolve_chat_template(model, tok, override=src)
    assert t.folds_system
    assert t.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]) == "<u>S\nU</u>"


def test_fold_on_real_template_kinds(synth_path: Path) -> None:
    model, tok = _load(synth_path)
    phi3 = resolve_chat_template(model, tok, override=IGNORES_SYSTEM)
    assert phi3.folds_system
    assert phi3.render(CONVERSATION) == ("<|user|>\nYou are helpful. \n Hi\n<|end|>\n<|assistant|>\nHello! <|end|>\n"
                                         "<|user|>\nHow are you?<|end|>\n<|assistant|>\n")
    mistral = resolve_chat_template(model, tok, override=ALTERNATES)
    assert mistral.folds_system
    assert mistral.render(CONVERSATION) == "[INST] You are helpful. \n Hi\n [/INST]Hello! </s>[INST] How are you? [/INST]"
    # a template with a system role is left alone
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    t = resolve_chat_template(model, tok, override=chatml)
    assert not t.folds_system
    assert t.render(CONVERSATION[:2]) == "<|im_start|>system\nYou are helpful. <|im_end|>\n<|im_start|>user\n Hi\n<|im_end|>\n"


def test_fold_system_rules() -> None:
    """llama.cpp's rule: only a first system message, joined to the next by a newline; alone: dropped."""
    sys_, user = {"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}
    assert fold_system([sys_, user]) == [{"role": "user", "content": "S\nU"}]
    assert fold_system([sys_]) == []
    assert fold_system([user, sys_]) == [user, sys_]
    msgs = [sys_, user]
    fold_system(msgs)
    assert msgs == [sys_, user]  # the caller's messages are not changed


def test_fold_keeps_the_cache_in_step_across_turns(code_moe_tiny: Path) -> None:
    from moecache.chat import ChatSession
    from moecache.engine import Engine, EngineConfig
    from moecache.sampling import Sampler, SamplingParams

    chatml_no_system = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
                        "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with Engine(code_moe_tiny, EngineConfig(n_ctx=256)) as eng:
        t = resolve_chat_template(eng.gguf, eng.tokenizer, chatml_no_system)
        assert t.folds_system
        s = ChatSession(eng, t, system="Write Python.")
        resets = []
        real_reset = eng.reset
        eng.reset = lambda: (resets.append(1), real_reset())[1]
        prompt_tokens = []
        for msg in ("def add(a, b):", "and subtract?"):
            res = s.turn(msg, Sampler(SamplingParams(temp=0.0)), n_predict=3)
            prompt_tokens.append(res.timings.n_prompt)
            assert eng.n_past == len(s.cached_ids)
            assert eng.tokenizer.decode(s.cached_ids[1:]) == s.rendered
        assert resets == []  # the second turn continued the first: the fold gives a stable prefix
        assert s.rendered.startswith("<|im_start|>user\nWrite Python.\ndef add(a, b):<|im_end|>\n")
        assert s.rendered.count("<|im_start|>user") == 2 and "system" not in s.rendered
        assert prompt_tokens[1] < len(s.cached_ids) - prompt_tokens[0]  # only the new text was evaluated


# ---- the Jinja environment: llama.cpp's globals, {% generation %} ------------------------------

def test_llamacpp_globals_and_generation_tag() -> None:
    src = ("{{ tools is none }}|{{ enable_thinking }}|{{ strftime_now('%Y') }}|{% for m in messages %}"
           "{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>{% endgeneration %}"
           "{% else %}<u>{{ m.content }}</u>{% endif %}{% endfor %}")
    out = jinja_renderer(src, "t")([{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}], True)
    assert out == f"True|True|{time.strftime('%Y')}|<u>q</u><a>r</a>"
    with pytest.raises(ValueError, match=r"^chat template \(t\) refused the messages: no$"):
        jinja_renderer("{{ raise_exception('no') }}", "t")([], True)


# ---- templates are untrusted code: bounded time, output, arithmetic and memory -------------------

BREACH = r"^chat template \(t\) stopped: .+; it may be hostile or broken: use another one, e.g. --chat-template chatml$"
HOSTILE = {
    # the issue's two inputs
    "nested-loops-output": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "power-of-a-power": "{{ 10**(10**8) }}",
    # the same kinds, other ways
    "nested-loops-silent": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested-loops-over-a-string": "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "captured-block": ("{% set s %}{% for i in range(100000) %}{% for j in range(100000) %}xy{% endfor %}"
                       "{% endfor %}{% endset %}{{ s|length }}"),
    "power-of-variables": "{% set a = 10 %}{% set b = 100000000 %}{{ a ** b }}",
    "big-products": "{% set a = 7 ** 400 %}{{ a * a * a * a * a * a * a * a * a * a * a * a }}",
    "repeat-a-string": "{{ 'x' * 1000000000 }}",
    "repeat-a-list": "{{ (messages * 1000000000)|length }}",
    "center-filter": "{{ 'x'|center(1000000000) }}",
    "center-method": "{{ 'x'.center(1000000000) }}",
    "percent-format": "{{ '%0999999999d' % 1 }}",
    "percent-star-width": "{{ '%*d' % (10 ** 9, 1) }}",
    "format-method": "{{ '{:>999999999}'.format(1) }}",
    "format-filter": "{{ '%0999999999d'|format(1) }}",
    "replace-empty": "{{ ('x' * 1000000)|replace('', 'yyyyyyyyyy') }}",
    "join": "{{ (['x' * 1000000] * 1000000)|join(',') }}",
    "doubling-tilde": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling-plus": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "macro-fan-out": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "macro-recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template_stops_with_one_line(name: str) -> None:
    t0 = time.monotonic()
    render = jinja_renderer(HOSTILE[name], "t")  # compiling folds no constants: returns at once
    assert time.monotonic() - t0 < 1
    with pytest.raises(ChatTemplateError, match=BREACH) as e:
        render([{"role": "user", "content": "hi"}], True)
    assert "\n" not in str(e.value)
    assert time.monotonic() - t0 < 10  # the time limit is 5 s; the step and size limits end most far sooner


@pytest.mark.timeout(60)
def test_time_limit() -> None:
    from moecache.chat_jinja import CompiledTemplate

    slow = "{% for i in range(300) %}{% for j in range(300) %}{{ (i * j) ** 50 }}{% endfor %}{% endfor %}"
    t = CompiledTemplate(slow, "t", time_limit=0.05)
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"still running after 0.05 s"):
        t.render()
    assert time.monotonic() - t0 < 2


def test_output_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import moecache.chat_jinja as cj

    monkeypatch.setattr(cj, "MAX_OUTPUT", 1000)
    with pytest.raises(ChatTemplateError, match=r"more than 1000 characters of output"):
        jinja_renderer("{% for i in range(30) %}{{ 'x' * 50 }}{% endfor %}", "t")([], True)
    assert len(jinja_renderer("{% for i in range(20) %}{{ 'x' * 50 }}{% endfor %}", "t")([], True)) == 1000


def test_memory_limit_is_set_while_rendering_and_restored() -> None:
    import resource  # Linux (this project's platform): a missing module fails, as a missing input must

    from moecache.chat_jinja import MEMORY_HEADROOM, _memory_limit

    before = resource.getrlimit(resource.RLIMIT_AS)
    with _memory_limit(MEMORY_HEADROOM):
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        assert soft != resource.RLIM_INFINITY
        with pytest.raises(MemoryError):
            bytearray(2 * MEMORY_HEADROOM)
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    assert len(bytearray(2 * MEMORY_HEADROOM)) == 2 * MEMORY_HEADROOM  # allowed again


@pytest.mark.timeout(120)
def test_issue_inputs_bounded_in_a_fresh_process() -> None:
    """Time and peak memory of a fresh interpreter rendering the issue's two inputs."""
    import subprocess
    import sys

    code = ("import json, time\nfrom moecache.chat import jinja_renderer\nout = []\n"
            f"for src in {[HOSTILE['nested-loops-output'], HOSTILE['power-of-a-power']]!r}:\n"
            "    t = time.monotonic()\n    try:\n        jinja_renderer(src, 'gguf')([], True)\n"
            "    except ValueError as e:\n        out.append([str(e), time.monotonic() - t])\n"
            "hwm = [int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmHWM:')][0]\n"
            "print(json.dumps([out, hwm]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100,
                       cwd=Path(__file__).parents[1])
    assert r.returncode == 0, r.stderr
    results, peak_kib = json.loads(r.stdout)  # VmHWM: peak resident memory of this process image
    assert len(results) == 2
    for msg, seconds in results:
        assert msg.startswith("chat template (gguf) stopped: ") and msg.endswith("--chat-template chatml")
        assert seconds < 10
    assert peak_kib < 200 * 1024  # the whole interpreter and jinja2 included (measured ~30 MiB)


@pytest.mark.timeout(120)
def test_cli_hostile_gguf_template_is_one_error_line(synth_path: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from moecache.cli.main import app

    for src in (HOSTILE["nested-loops-output"], HOSTILE["power-of-a-power"]):
        path = _with_keys(synth_path, tmp_path / "hostile.gguf", {"tokenizer.chat_template": (src, gguf.GGUFValueType.STRING)})
        r = CliRunner().invoke(app, ["run", "-m", str(path), "-n", "2"], input="hi\n/exit\n")
        assert r.exit_code == 1, r.output
        errors = [line for line in r.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "chat template (gguf) stopped" in errors[0], r.output
        assert errors[0].endswith("--chat-template chatml") and "Traceback" not in r.output


def test_cli_says_only_true_things_about_the_models_template(templated_path: Path, synth_path: Path,
                                                            tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from moecache.cli.main import app

    r = CliRunner().invoke(app, ["run", "-m", str(templated_path), "-n", "2", "-sys", "be brief"], input="hi\n/exit\n")
    assert r.exit_code == 0, r.output
    assert "chat template: gguf" in r.output and "no chat template of its own" not in r.output
    assert "no system role" not in r.output  # this template reads system messages
    folding = _with_keys(synth_path, tmp_path / "fold.gguf",
                         {"tokenizer.chat_template": (IGNORES_SYSTEM, gguf.GGUFValueType.STRING)})
    r = CliRunner().invoke(app, ["run", "-m", str(folding), "-n", "2", "-sys", "be brief"], input="hi\n/exit\n")
    assert r.exit_code == 0, r.output
    assert r.output.count("the chat template has no system role: the system prompt is put before the first "
                          "user message") == 1
    r = CliRunner().invoke(app, ["run", "-m", str(synth_path), "-n", "2"], input="hi\n/exit\n")
    assert r.exit_code == 0, r.output
    assert "this model has no chat template of its own" in r.output  # true here


# the templates of the issue's models (as shipped in their tokenizer_config.json), with -sys
REAL_NO_SYSTEM = {
    "gemma-1": ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                "supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != "
                "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/"
                "user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
                "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' + "
                "message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                "{{'<start_of_turn>model\\n'}}{% endif %}",
                "<start_of_turn>user\nYou are helpful. \n Hi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
                "<start_of_turn>user\nHow are you?<end_of_turn>\n<start_of_turn>model\n"),
    "mistral-7b-instruct-v0.2": (
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] "
        "== 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
        "roles are supported!') }}{% endif %}{% endfor %}",
        "[INST] You are helpful. \n Hi\n [/INST]Hello! </s>[INST] How are you? [/INST]"),
    "phi-3-mini": ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') %}{{'<|user|>' + "
                   "'\\n' + message['content'] + '<|end|>' + '\\n' + '<|assistant|>' + '\\n'}}{% elif "
                   "(message['role'] == 'assistant') %}{{message['content'] + '<|end|>' + '\\n'}}{% endif %}"
                   "{% endfor %}",
                   "<|user|>\nYou are helpful. \n Hi\n<|end|>\n<|assistant|>\nHello! <|end|>\n<|user|>\nHow are you?"
                   "<|end|>\n<|assistant|>\n"),
    "orion": ("{% for message in messages %}{% if loop.first %}{{ bos_token }}{% endif %}{% if message['role'] == "
              "'user' %}{{ 'Human: ' + message['content'] + '\\n\\nAssistant: ' + eos_token }}{% elif "
              "message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}",
              "Human: You are helpful. \n Hi\n\n\nAssistant: </s>Hello! </s>Human: How are you?\n\nAssistant: </s>"),
}


@pytest.mark.parametrize("name", sorted(REAL_NO_SYSTEM))
def test_real_templates_without_a_system_role(synth_path: Path, name: str) -> None:
    model, tok = _load(synth_path)
    src, expected = REAL_NO_SYSTEM[name]
    t = resolve_chat_template(model, tok, override=src)
    assert t.folds_system
    text = t.render(CONVERSATION)
    assert text == expected.removesuffix("</s>" if tok.add_eos else "")  # cut when the tokenizer adds EOS


def test_cli_accepts_every_llamacpp_name() -> None:
    from moecache.cli.common import UserError
    from moecache.cli.run import check_chat_template_name

    for name in BUILTIN_TEMPLATES:
        check_chat_template_name(name)
    with pytest.raises(UserError, match=r"unknown chat template 'dots1': use one of chatml, llama2, .*, solar-open, "
                                        r"or a Jinja template"):
        check_chat_template_name("dots1")  # llama.cpp detects it but offers no such name


# ---- review findings: real templates' idioms pass, other hostile kinds stop ---------------------

@pytest.mark.parametrize("src,want", [
    ('{{ "%d tokens" % 128000 }}', "128000 tokens"),        # an ordinary large integer argument
    ('{{ "{:,}".format(200000) }}', "200,000"),
    ('{{ [1, {"a": 2}]|tojson(separators=(",", ":")) }}', '[1,{"a":2}]'),  # transformers' tojson signature
    ('{{ "%5d|" % 42 }}', "   42|"),
])
def test_real_template_idioms_render(src: str, want: str) -> None:
    assert jinja_renderer(src, "t")([], False) == want


@pytest.mark.timeout(60)
@pytest.mark.parametrize("src,match", [
    ("{{ ('a' * 3000000)|wordwrap(1) }}", "wordwrap given 3000000 characters"),   # quadratic in a long word
    ("{{ 'a'|center(10000000) }}", "center called with 10000000"),
    ("{{ '%*d' % (10000000, 1) }}", "called with 10000000"),
    ("x" * 300_000, "characters of template text"),                            # compile time grows with size
])
def test_other_hostile_kinds_stop_in_one_line(src: str, match: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=match):
        jinja_renderer(src, "t")([], False)
    assert time.perf_counter() - t0 < 5


def test_a_template_python_cannot_compile_is_a_value_error() -> None:
    """21 nested loops compile to Python that CPython refuses ("too many statically nested blocks")."""
    src = "".join("{%% for i%d in messages %%}" % i for i in range(21)) + "x" + "{% endfor %}" * 21
    with pytest.raises(ValueError, match="does not compile: SyntaxError"):
        jinja_renderer(src, "t")


def test_no_address_space_limit_while_another_thread_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """RLIMIT_AS is process-wide: with another Python thread alive (a server, the cache's workers) a
    render must not lower it under that thread's allocations."""
    import threading

    import moecache.chat_jinja as cj

    calls = []
    real = cj._memory_limit

    def spy(headroom: int):
        calls.append(headroom)
        return real(headroom)

    monkeypatch.setattr(cj, "_memory_limit", spy)
    jinja_renderer("{{ 1 }}", "t")([], False)
    alone = len(calls)
    stop = threading.Event()
    th = threading.Thread(target=stop.wait)
    th.start()
    try:
        jinja_renderer("{{ 1 }}", "t")([], False)
    finally:
        stop.set()
        th.join()
    assert alone >= 1 and len(calls) == alone
