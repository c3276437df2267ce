"""``moecache run``: one-shot completion (``-p``/``-f``) or an interactive chat, like llama-cli."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import typer

from moecache.cli.common import UserError, cache_stats_lines, load_engine, note, read_text_arg, resolve_model, timing_lines


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """The parsed ``run`` flags (llama-cli names) other than the engine's settings."""

    model: Path | None
    prompt: str | None = None
    file: Path | None = None
    n_predict: int = -1
    conversation: bool | None = None
    system: str | None = None
    chat_template: str | None = None
    as_json: bool = False
    escape: bool = True
    special: bool = False
    verbose: bool = False
    display_prompt: bool = True  # -p/-f: echo the prompt before the generated text, as llama-cli does


def read_prompt(opts: RunOptions) -> str | None:
    """``-p`` or the contents of ``-f`` (not both), as llama.cpp reads them (see
    :func:`moecache.cli.common.read_text_arg`); None when neither is given."""
    if opts.prompt is not None and opts.file is not None:
        raise UserError("give -p PROMPT or -f FILE, not both")
    if opts.prompt is None and opts.file is None:
        return None
    return read_text_arg(opts.prompt, opts.file, opts.escape)


def check_chat_template_name(name: str | None) -> None:
    """Fail before loading the model when ``--chat-template`` names no built-in template."""
    from moecache.chat_builtin import BUILTIN_TEMPLATES

    if name is not None and "{%" not in name and "{{" not in name and name not in BUILTIN_TEMPLATES:
        raise UserError(f"unknown chat template {name!r}: use one of {', '.join(BUILTIN_TEMPLATES)}, "
                        f"or a Jinja template")


def run_command(opts: RunOptions, settings, sampling) -> None:
    """Validate, load (:func:`moecache.llm.open_llm` with ``settings``, a
    :class:`moecache.settings.Settings`), then complete once or chat. Raises UserError /
    MoecacheError / ValueError for the caller."""
    from moecache.sampling import Sampler

    if opts.n_predict < -1:
        raise UserError(f"-n must be >= -1 (-1 = until the end of generation), got {opts.n_predict}")
    try:
        sampling.validate()
    except ValueError as e:
        raise UserError(str(e)) from None
    prompt = read_prompt(opts)
    chat = opts.conversation if opts.conversation is not None else prompt is None
    if prompt is not None and not chat and prompt == "":
        raise UserError("the prompt is empty: give text with -p or a non-empty -f file")
    if chat and opts.as_json:
        raise UserError("--json is for one-shot runs (-p/-f without -cnv)")
    check_chat_template_name(opts.chat_template)
    if not chat and (opts.system is not None or opts.chat_template is not None):
        note("note: -sys and --chat-template apply to chat (-cnv); this one-shot run completes the raw prompt")
    llm = load_engine(resolve_model(opts.model), settings, "run", opts.verbose)
    eng = llm.engine
    stats_every = settings.moe_cache_stats or 0
    try:
        sampler = Sampler(sampling, eng.n_ctx)
        if sampling.temp > 0:
            note(f"sampling: temp {sampling.temp}, top-k {sampling.top_k}, top-p {sampling.top_p}, "
                 f"min-p {sampling.min_p}, repeat-penalty {sampling.repeat_penalty}, seed {sampler.seed}")
        else:
            note(f"sampling: greedy (--temp {sampling.temp:g}: <= 0 is greedy)")
        if chat:
            _chat(eng, sampler, opts, prompt)
        else:
            _complete(llm, sampler, opts, prompt, stats_every)
        if eng.caches and stats_every:
            for line in cache_stats_lines(eng):
                note(line)
    finally:
        llm.close()


def _complete(llm, sampler, opts: RunOptions, prompt: str, every: int) -> None:
    from moecache.kv_cache import ContextFullError

    eng = llm.engine
    ids = llm.tokenize(prompt)
    stream = eng.tokenizer.streamer(skip_special=not opts.special)
    out = sys.stdout
    if opts.display_prompt and not opts.as_json:
        out.write(prompt)
        out.flush()

    n_done = [0]

    def on_token(t: int) -> None:
        if not opts.as_json:
            out.write(stream.push(t))
            out.flush()
        n_done[0] += 1
        if every > 0 and eng.caches and n_done[0] % every == 0:
            for line in cache_stats_lines(eng):
                note(line)
    try:
        res = llm.complete(ids, n_predict=opts.n_predict, sampler=sampler, on_token=on_token, special=opts.special)
    except ContextFullError as e:
        raise UserError(str(e)) from None
    if opts.as_json:
        t = res.timings
        for c in eng.caches:
            c.flush()  # the zero-copy path accounts a pass one pass late
        json.dump({"model": str(eng.gguf.path), "prompt": prompt, "prompt_tokens": res.prompt_tokens, "text": res.text,
                   "tokens": res.tokens, "stop": res.stop,
                   "timings": {"prompt_n": t.n_prompt, "prompt_ms": t.t_prompt * 1e3, "prompt_per_second": t.pp_tps,
                               "predicted_n": t.n_gen, "eval_runs": t.n_eval, "predicted_ms": t.t_eval * 1e3,
                               "predicted_per_second": t.tg_tps},
                   **({"moe_cache": [{"hit_rate": c.stats.hit_rate, "uploads": c.stats.uploads,
                                      "uploaded_bytes": c.stats.uploaded_bytes,
                                      "misses": "zero-copy" if c.zero_copy else "cpu"} for c in eng.caches]}
                      if eng.caches else {})}, out, ensure_ascii=False)
        out.write("\n")
    else:
        out.write(stream.flush() + "\n")
    out.flush()
    _end_note(res)
    for line in timing_lines(res.timings):
        note(line)


def _end_note(res) -> None:
    if res.stop == "context":
        note("note: generation stopped: the context is full (raise -c)")
    elif res.stop == "interrupted":
        note("note: generation interrupted")


def _chat(eng, sampler, opts: RunOptions, first: str | None) -> None:
    from moecache.chat import ChatSession, resolve_chat_template
    from moecache.engine import Timings

    try:
        tmpl = resolve_chat_template(eng.gguf, eng.tokenizer, opts.chat_template)
    except ValueError as e:
        raise UserError(str(e)) from None
    note(f"chat template: {tmpl.name} ({tmpl.source})")
    if opts.system and tmpl.folds_system:
        note("note: the chat template has no system role: the system prompt is put before the first user "
             "message (as llama.cpp does)")
    try:
        _warn_plain_text_markers(eng, tmpl)
    except ValueError as e:
        raise UserError(str(e)) from None
    note("interactive chat: type a message and press Enter; /exit or Ctrl-D quits; Ctrl-C stops a reply")
    session = ChatSession(eng, tmpl, opts.system)
    total = Timings()
    pending = first
    if hasattr(sys.stdin, "reconfigure"):  # undecodable bytes reach _chat_turn (refused there), not a crash
        sys.stdin.reconfigure(errors="surrogateescape")
    try:
        while True:
            if pending is None:
                try:
                    pending = input("\n> ")
                except (EOFError, KeyboardInterrupt):
                    typer.echo("", err=True)
                    return
                if not sys.stdin.isatty():  # piped input: show what was read, as if typed (a bad byte as U+FFFD)
                    sys.stdout.write(pending.encode("utf-8", "surrogateescape").decode("utf-8", "replace") + "\n")
            user, pending = pending, None
            if user.strip() == "/exit":
                return
            if _chat_turn(eng, session, sampler, opts, user, total):
                return
    finally:
        for line in timing_lines(total):
            note(line)


def _warn_plain_text_markers(eng, tmpl) -> None:
    """Say so when the model has no chat template of its own (typically a base model, not an
    instruction-tuned one), or when the turn markers of the template in use are no special tokens
    of this vocabulary (the model then sees them as plain text). Nothing when the GGUF's own
    template is in use: its markers are what the model was trained on."""
    from moecache.tokenizer import CONTROL, USER_DEFINED

    if tmpl.name == "gguf":
        return
    tok = eng.tokenizer
    ids = tok.encode(tmpl.render([{"role": "user", "content": "hi"}], add_generation_prompt=True))
    special = [i for i in ids if i != tok.bos_id and tok.token_type[i] in (CONTROL, USER_DEFINED)
               and tok.decode([i]).strip()]
    if not eng.gguf.tokenizer.chat_template:
        note("note: this model has no chat template of its own" + ("" if special else
             " and the turn markers are plain text to it") + ": it may be a base model, not an "
             "instruction-tuned one; replies may not answer or end (-n limits them)")
    elif not special:
        note(f"note: the turn markers of chat template {tmpl.name} are plain text to this model (no special "
             f"tokens); its own template (tokenizer.chat_template) may suit it better")


def _chat_turn(eng, session, sampler, opts: RunOptions, user: str, total) -> bool:
    """One turn; True when the chat must end (context full)."""
    from moecache.kv_cache import ContextFullError

    if not user.strip():
        return False
    try:
        user.encode("utf-8")
    except UnicodeEncodeError as e:  # stdin's undecodable bytes arrive as lone surrogates
        note(f"error: this line is not valid UTF-8 (byte {e.object[e.start:e.end].encode('utf-8', 'surrogateescape')!r} "
             f"at character {e.start}): not sent; type it again")
        return False
    stream = eng.tokenizer.streamer(skip_special=not opts.special)

    def on_token(t: int) -> None:
        sys.stdout.write(stream.push(t))
        sys.stdout.flush()
    try:
        res = session.turn(user, sampler, opts.n_predict, on_token)
    except ValueError as e:
        raise UserError(str(e)) from None
    except ContextFullError as e:
        note(f"note: {e}: start a new chat with a larger -c")
        return True
    sys.stdout.write(stream.flush() + "\n")
    sys.stdout.flush()
    _end_note(res)
    t = res.timings
    total.n_prompt += t.n_prompt
    total.t_prompt += t.t_prompt
    total.n_gen += t.n_gen
    total.n_eval += t.n_eval
    total.t_eval += t.t_eval
    return res.stop == "context"
