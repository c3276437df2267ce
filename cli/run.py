"""``moecache run``: one-shot completion (``-p``/``-f``) or an interactive chat, like llama-cli."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import typer

from cli.common import UserError, load_engine, note, resolve_model, timing_lines


@dataclass(frozen=True)
class RunOptions:
    """The parsed ``run`` flags (llama-cli names)."""

    model: Path | None
    prompt: str | None
    file: Path | None
    n_predict: int
    conversation: bool | None
    system: str | None
    chat_template: str | None
    as_json: bool
    ngl: int | None
    flash_attn: str | None


def read_prompt(opts: RunOptions) -> str | None:
    """``-p`` or the contents of ``-f`` (not both); None when neither is given."""
    if opts.prompt is not None and opts.file is not None:
        raise UserError("give -p PROMPT or -f FILE, not both")
    if opts.file is not None:
        try:
            return opts.file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read prompt file {opts.file}: {e}") from None
    return opts.prompt


def run_command(opts: RunOptions, engine_config, sampling) -> None:
    """Validate, load, then complete once or chat. Raises UserError / MoecacheError for the caller."""
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
    eng = load_engine(resolve_model(opts.model), engine_config, opts.ngl, opts.flash_attn)
    try:
        sampler = Sampler(sampling, eng.n_ctx)
        if sampling.temp > 0:
            note(f"sampling: temp {sampling.temp}, top-k {sampling.top_k}, top-p {sampling.top_p}, "
                 f"min-p {sampling.min_p}, repeat-penalty {sampling.repeat_penalty}, seed {sampler.seed}")
        else:
            note("sampling: greedy (--temp 0)")
        if chat:
            _chat(eng, sampler, opts, prompt)
        else:
            _complete(eng, sampler, opts, prompt)
    finally:
        eng.close()


def _complete(eng, sampler, opts: RunOptions, prompt: str) -> None:
    from moecache.kv_cache import ContextFullError

    ids = eng.tokenizer.encode(prompt)
    if len(ids) >= eng.n_ctx:
        raise UserError(f"the prompt is {len(ids)} tokens, the context is {eng.n_ctx} (-c): "
                        f"nothing left to generate into")
    stream = eng.tokenizer.streamer()
    out = sys.stdout

    def on_token(t: int) -> None:
        if not opts.as_json:
            out.write(stream.push(t))
            out.flush()
    try:
        res = eng.generate(ids, sampler, opts.n_predict, on_token)
    except ContextFullError as e:
        raise UserError(str(e)) from None
    text = eng.tokenizer.decode(res.tokens)
    if opts.as_json:
        t = res.timings
        json.dump({"model": str(eng.gguf.path), "prompt": prompt, "prompt_tokens": len(ids), "text": text,
                   "tokens": res.tokens, "stop": res.stop,
                   "timings": {"prompt_n": t.n_prompt, "prompt_ms": t.t_prompt * 1e3, "prompt_per_second": t.pp_tps,
                               "predicted_n": t.n_gen, "predicted_ms": t.t_gen * 1e3,
                               "predicted_per_second": t.tg_tps}}, out, ensure_ascii=False)
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
    from moecache.chat import resolve_chat_template
    from moecache.kv_cache import ContextFullError

    try:
        tmpl = resolve_chat_template(eng.gguf, eng.tokenizer, opts.chat_template)
    except ValueError as e:
        raise UserError(str(e)) from None
    note(f"chat template: {tmpl.name} ({tmpl.source})")
    note("interactive chat: type a message and press Enter; /exit or Ctrl-D quits; Ctrl-C stops a reply")
    messages: list[dict] = []
    if opts.system:
        messages.append({"role": "system", "content": opts.system})
    rendered = ""  # the conversation text already in the KV cache
    pending = first
    while True:
        if pending is None:
            try:
                pending = input("\n> ")
            except (EOFError, KeyboardInterrupt):
                typer.echo("", err=True)
                return
        user, pending = pending, None
        if user.strip() == "/exit":
            return
        if not user.strip():
            continue
        messages.append({"role": "user", "content": user})
        try:
            full = tmpl.render(messages, add_generation_prompt=True)
        except ValueError as e:
            raise UserError(str(e)) from None
        if not full.startswith(rendered):  # the template re-rendered history differently: start over
            eng.reset()
            rendered = ""
        new_text = full[len(rendered):]
        ids = eng.tokenizer.encode(new_text, add_bos=None if eng.n_past == 0 else False)
        if eng.n_past + len(ids) >= eng.n_ctx:
            note(f"note: the context is full ({eng.n_past} + {len(ids)} tokens >= -c {eng.n_ctx}): "
                 f"start a new chat with a larger -c")
            return
        stream = eng.tokenizer.streamer()
        reply: list[int] = []

        def on_token(t: int) -> None:
            reply.append(t)
            sys.stdout.write(stream.push(t))
            sys.stdout.flush()
        try:
            res = eng.generate(ids, sampler, opts.n_predict, on_token)
        except ContextFullError as e:
            note(f"note: {e}")
            return
        sys.stdout.write(stream.flush() + "\n")
        sys.stdout.flush()
        _end_note(res)
        if res.stop == "interrupted" and res.timings.n_prompt == 0:
            messages.pop()  # interrupted while reading the message: as if it was never sent
            continue
        answer = eng.tokenizer.decode(reply, skip_special=True)
        messages.append({"role": "assistant", "content": answer})
        # the cache now holds the rendered prompt and the reply; a sampled end-of-turn token is not
        # evaluated, so the next render's closing of this turn is new text (llama-cli does the same)
        rendered = full + eng.tokenizer.decode(reply)
        if res.stop == "context":
            return
