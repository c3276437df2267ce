"""The library's entry point: ``moecache.load(path, **settings)`` -> an :class:`LLM` that completes and chats.

``load`` resolves the settings exactly as the CLI does (the same :class:`moecache.settings.Settings`
record, the startup probe, :func:`moecache.settings.resolve`), builds the :class:`moecache.engine.Engine`
and says what it resolved through ``log`` (the lines the CLI prints on stderr)::

    import moecache
    with moecache.load("model.gguf", n_ctx=256, n_threads=2) as llm:
        out = llm.complete("def add(a, b):", n_predict=8, temperature=0)
        print(out.text, out.tokens, out.timings)
        reply = llm.chat([{"role": "user", "content": "hi"}], n_predict=8)

``moecache run -m model.gguf -p "def add(a, b):" -n 8 --temp 0 --json`` gives the same tokens.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moecache.settings import Resolved, Settings

Log = Callable[[str], None]


@dataclass(frozen=True)
class Completion:
    """What :meth:`LLM.complete` and :meth:`LLM.chat` produced.

    Attributes:
        text: the generated text as `run` prints it (the tokens' pieces joined; special tokens left out
            unless ``special``).
        tokens: the generated ids (the end-of-generation token excluded).
        stop: "eog", "length" (``n_predict`` reached), "context" (the context is full) or "interrupted".
        timings: :class:`moecache.engine.Timings` (prompt and generation counts and seconds).
        prompt_tokens: ids the prompt was tokenized into (BOS included where the model adds it).
    """

    text: str
    tokens: list[int]
    stop: str
    timings: Any
    prompt_tokens: int


def ineffective_flag_notes(eng, settings: Settings) -> list[str]:
    """One note per group of flags that cannot take effect in this run (an expert cache needs a GPU
    and a model with routed experts, and is made only when the experts do not all fit in VRAM)."""
    placement = settings.placement_options()
    cache_flags = [f for f, given in (("--moe-cache", placement.moe_cache is not None),
                                      ("--vram-budget", bool(placement.vram_budget)),
                                      ("--moe-cache-window", settings.moe_cache_window is not None),
                                      ("--moe-cache-stats", bool(settings.moe_cache_stats)),
                                      ("--deterministic", bool(settings.deterministic)),
                                      ("--miss-split", bool(settings.miss_split)),
                                      ("--elastic-slots" if settings.elastic_slots else "--no-elastic-slots", settings.elastic_slots is not None),
                                      ("--cache-plan", settings.cache_plan != "auto"),
                                      ("--moe-profile", settings.moe_profile is not None)) if given]
    moe_flags = [f for f, given in (("--cpu-moe", placement.cpu_moe),
                                    ("--n-cpu-moe", bool(placement.n_cpu_moe))) if given]
    pl = eng.placement
    on_gpu = pl is not None and bool(pl.devices)
    dense = not eng.gguf.config.is_moe
    out = []
    gpu_flags = [f for f, given in (("-mg", bool(placement.main_gpu)), ("-ts", bool(placement.tensor_split)),
                                    ("-sm", placement.split_mode != "layer")) if given]
    if gpu_flags and not on_gpu:
        out.append(f"note: {', '.join(gpu_flags)} ignored: this run is on the CPU only (they place layers on GPUs)")
    if dense or not on_gpu:
        flags = [f for f in cache_flags + moe_flags if not (on_gpu and f == "--vram-budget")]  # it bounds a GPU run
        why = ([f"{eng.gguf.path.name} is a dense model (no routed experts)"] if dense else []) + (
            [] if on_gpu else ["this run is on the CPU only (the expert cache and expert placement need a GPU)"])
        if flags:
            out.append(f"note: {', '.join(flags)} ignored: {'; '.join(why)}")
    elif not eng.caches:
        cache_flags = [f for f in cache_flags if not (f == "--moe-cache" and placement.moe_cache == 0)
                       and f != "--vram-budget"]  # the budget still bounds the placement
        if cache_flags:
            out.append(f"note: {', '.join(cache_flags)} ignored: no expert cache was made in this run "
                       f"({pl.summary()})")
    return out


class LLM:
    """A loaded model (it owns its :class:`moecache.engine.Engine`): complete text, chat, close.

    Attributes:
        engine: the engine (one sequence; :meth:`complete` and :meth:`chat` start it from empty).
        resolved: the values it runs with and their reasons (:class:`moecache.settings.Resolved`).
        probe: the machine as the startup probe saw it.
    """

    def __init__(self, engine, resolved: Resolved, probe, hot_set=None, log: Log | None = None):
        self.engine = engine
        self.resolved = resolved
        self.probe = probe
        self.hot_set = hot_set  # moecache.moe.profile.HotSet: the expert usage saved at close
        self._log = log or (lambda s: None)

    def close(self) -> None:
        """Save the expert usage (``run``/``serve`` with an expert cache), release the model file and
        the expert caches' threads (idempotent)."""
        hs, self.hot_set = self.hot_set, None
        try:
            if hs is not None:
                try:
                    hs.save(self.engine, self._log)
                except Exception as e:  # noqa: BLE001 - closing must not replace the error being unwound
                    self._log(f"note: expert usage not saved: {type(e).__name__}: {e}")
        finally:
            self.engine.close()

    def drop_hot_set(self, why: str) -> None:
        """Do not save the expert usage at :meth:`close` (a note says why)."""
        if self.hot_set is not None:
            self._log(f"note: expert usage not saved: {why}")
            self.hot_set = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sampler(self, *, temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                repeat_penalty: float = 1.0, repeat_last_n: int = 64, presence_penalty: float = 0.0,
                frequency_penalty: float = 0.0, seed: int = -1):
        """llama.cpp's sampler chain with these settings (its defaults; ``temperature`` <= 0 is
        greedy, ``seed`` -1 draws a random seed). Raises ValueError naming a bad value's flag."""
        from moecache.sampling import DEFAULT_SEED, Sampler, SamplingParams

        sp = SamplingParams(temp=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                            repeat_last_n=repeat_last_n, frequency_penalty=frequency_penalty,
                            presence_penalty=presence_penalty, seed=DEFAULT_SEED if seed == -1 else seed)
        sp.validate()
        return Sampler(sp, self.engine.n_ctx)

    def tokenize(self, prompt: str) -> list[int]:
        """``prompt``'s ids as ``moecache run -p`` makes them (the model's BOS rules, special-token
        text parsed). Raises ValueError when they leave no room to generate in the context."""
        eng = self.engine
        ids = eng.tokenizer.encode(prompt)
        if len(ids) >= eng.n_ctx:
            raise ValueError(f"the prompt is {len(ids)} tokens, the context is {eng.n_ctx} (-c): "
                             f"nothing left to generate into")
        return ids

    def complete(self, prompt: str | list[int], *, n_predict: int = -1, sampler=None,
                 on_token: Callable[[int], None] | None = None, special: bool = False, **sampling: Any) -> Completion:
        """Complete ``prompt`` as ``moecache run -p`` does: tokenized by :meth:`tokenize` (or given
        as ids), then up to ``n_predict`` tokens sampled (-1: until the end of generation or a full
        context), from an empty sequence.

        Args:
            sampler: a :class:`moecache.sampling.Sampler`; default: :meth:`sampler` of ``sampling``
                (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repeat_penalty``, ``seed``, ...).
            on_token: called with each generated id as it is sampled (streaming).
            special: keep special (control) tokens in ``text``.

        Raises:
            ValueError: the prompt leaves no room in the context, or a sampling value is out of range.
            ContextFullError: the prompt does not fit.
        """
        eng = self.engine
        _check_n_predict(n_predict)
        sampler = sampler or self.sampler(**sampling)
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        eng.reset()
        res = eng.generate(ids, sampler, n_predict, on_token)
        return Completion(_continuation(eng.tokenizer, res.tokens, special), res.tokens, res.stop,
                          res.timings, len(ids))

    def chat(self, messages: list[dict[str, Any]], *, n_predict: int = -1, chat_template: str | None = None,
             sampler=None, on_token: Callable[[int], None] | None = None, special: bool = False,
             **sampling: Any) -> Completion:
        """The assistant's reply to ``messages`` (``{"role": ..., "content": ...}`` dicts), rendered
        with the model's chat template (:func:`moecache.chat.resolve_chat_template`; ``chat_template``:
        a built-in name or a Jinja template instead) and completed as :meth:`complete` does.

        Raises:
            ValueError: an unknown template name, a template that fails on these messages, or a
                sampling value out of range.
            ContextFullError: the rendered conversation does not fit.
        """
        from moecache.chat import resolve_chat_template

        eng = self.engine
        _check_n_predict(n_predict)
        tmpl = resolve_chat_template(eng.gguf, eng.tokenizer, chat_template)
        sampler = sampler or self.sampler(**sampling)
        eng.reset()
        ids = eng.tokenizer.encode(tmpl.render(messages, add_generation_prompt=True))
        eng.kv.check_room(len(ids))
        res = eng.generate(ids, sampler, n_predict, on_token)
        return Completion(_continuation(eng.tokenizer, res.tokens, special), res.tokens, res.stop,
                          res.timings, len(ids))


def _check_n_predict(n: int) -> None:
    """``n_predict`` as ``-n`` takes it: -1 (until the end) or >= 0; ValueError naming the flag."""
    if not isinstance(n, int) or isinstance(n, bool) or n < -1:
        raise ValueError(f"-n/--n-predict (n_predict) must be -1 (until the end of generation) or >= 0, got {n!r}")


def resolve_file(path: str | Path, settings: Settings, *, command: str = "run",
                 environ: Mapping[str, str] | None = None, omp_active: bool | None = None) -> Resolved:
    """What :func:`open_llm` would resolve for the model at ``path`` (no engine is built): its facts,
    the startup probe and :func:`moecache.settings.resolve` with the same arguments (``environ``
    default ``os.environ``). Raises as :func:`open_llm` does before it loads."""
    from moecache.gguf_file import open_gguf
    from moecache.probe import startup_probe
    from moecache.settings import model_facts, resolve

    settings.check()
    with open_gguf(path) as gguf:
        facts = model_facts(gguf, settings.kv_type())
    probe = startup_probe(with_gpus=settings.placement_options().n_gpu_layers != 0)
    return resolve(settings, facts, probe, command=command, environ=os.environ if environ is None else environ,
                   omp_active=omp_active)


def open_llm(path: str | Path, settings: Settings, *, command: str = "run", log: Log | None = None,
             log_once: Log | None = None, verbose: bool = False,
             pin_progress: Callable[[], Callable[[int, int, float], None]] | None = None,
             environ: Mapping[str, str] | None = None, omp_active: bool | None = None) -> LLM:
    """Resolve ``settings`` against the model and the startup probe, say what was resolved, build
    the engine, say what it placed where (the lines ``moecache run`` prints on stderr).

    The GGUF is opened once: its facts, the ``--routing`` check, the kernels to compile and the
    engine read the same :class:`moecache.gguf_file.GGUFModel`.

    Args:
        command: "run", "perplexity", "bench" or "serve" (see :func:`moecache.settings.resolve`).
        log: each line (resolved values, notes, the model line); default: discard.
        log_once: the engine's notes and the ignored-flag notes (a caller that loads several engines
            says each once); default: ``log``.
        verbose: every resolved value with its reason.
        pin_progress: makes the callback (bytes done, total, seconds) that sees ``--load-mode pin``'s copy.
        environ: the environment (``MOECACHE_DETERMINISTIC``); default: ``os.environ``.
        omp_active: see :func:`moecache.settings.resolve` (None: from ``OMP_WAIT_POLICY``).

    Raises:
        ValueError: a setting is impossible (the message names the flag), or ``--routing`` on a
            model without routed experts.
        GGUFError and the other :class:`moecache.errors.MoecacheError`: the model cannot be run.
        MemoryError: an allocation failed.
    """
    from moecache.cpu_kernels import count_compiles, cpu_kernel_names, uncompiled_kernels, warm_prompt_path
    from moecache.engine import Engine
    from moecache.gguf_file import open_gguf
    from moecache.probe import startup_probe
    from moecache.settings import model_facts, resolve

    log = log or (lambda s: None)
    once = log_once or log
    settings.check()
    if settings.flash_attn == "on":
        log(f"note: -fa {settings.flash_attn} ignored: one attention implementation per backend for now")
    gguf = open_gguf(path)
    counting = ExitStack()
    try:
        facts = model_facts(gguf, settings.kv_type())
        placement = settings.placement_options()
        probe = startup_probe(with_gpus=placement.n_gpu_layers != 0)
        env = os.environ if environ is None else environ
        res = resolve(settings, facts, probe, command=command, environ=env, omp_active=omp_active)
        for line in res.summary_lines(probe, verbose):
            log(line)
        override = None
        if res.routing:  # checked before the (possibly long) load
            from moecache.moe.routing_process import make_routing

            c = gguf.config
            if not c.n_expert:
                raise ValueError(f"--routing: {Path(path).name} has no routed experts")
            override = make_routing(res.routing, c.n_layer, c.n_expert, c.n_expert_used)
        # a CPU-only run calls every kernel of cpu_kernel_names at load; a GPU run calls the MoE kernel
        # only where the CPU computes experts (mmap misses, host experts), so a missing one proves nothing
        cpu_only = not probe.gpus or placement.n_gpu_layers == 0
        cold = uncompiled_kernels(cpu_kernel_names(gguf)) if cpu_only else set()
        if cold:
            log(f"compiling CPU kernels, first run only ({len(cold)} to compile; cached for later runs)...")
        t0 = time.perf_counter()
        compiled = counting.enter_context(count_compiles())  # the load's and the warm-up's compilations
        eng = Engine(gguf, res.engine_config(), log=once, placement=res.placement, load_mode=res.load_mode,
                     pin_progress=pin_progress() if pin_progress is not None and res.load_mode == "pin" else None,
                     policy_config=res.policy, miss_split=bool(settings.miss_split))
    except BaseException:
        counting.close()
        gguf.close()
        raise
    try:
        if eng.placement is None or not eng.placement.devices:
            warm_prompt_path(eng)
    except BaseException:
        eng.close()
        raise
    finally:
        counting.close()
    if cold or compiled.count:
        why = "" if cold else (" (Numba's cache held them for other argument types only, e.g. a test run's; "
                               "cached now for later runs)")
        log(f"compiled {compiled.count} CPU kernel specialization(s) (a kernel and the helpers it calls, per argument "
            f"types){why}: load and compile took {time.perf_counter() - t0:.1f} s "
            f"in all (not counted in any speed below; the model line's load time includes the decode kernels' "
            f"compile, not the prompt path's)")
    det = bool(settings.deterministic) or env.get("MOECACHE_DETERMINISTIC") == "1"
    if det and any(getattr(c, "handoff", None) is not None and not c.policy.layer_plan for c in eng.caches):
        once("note: --miss-split with --deterministic: the CPU's share of the misses is refit from measured "
             "waits, so which misses the CPU computes (8-bit activations) varies between runs; the cache's "
             "admissions stay deterministic")
    for line in ineffective_flag_notes(eng, settings):
        once(line)
    if override is not None:
        eng.model.routing_override = override
        pl = eng.placement
        if pl is not None and pl.n_gpu_layers == len(pl.layer_device) and hasattr(override, "draw_passes_ahead"):
            override.draw_passes_ahead = True  # every layer on a GPU: the CPU draws the next pass meanwhile
        log(f"note: --routing {res.routing}: the router runs but its choice is replaced: the output text is "
            f"meaningless (for speed, hit-rate and upload measurements)")
    log(model_line(eng, res))
    hot = None
    # run and serve keep the hot set; bench and perplexity never (their numbers must not depend on an
    # earlier run), nor a --routing run (its synthetic routes are not the model's usage)
    if command in ("run", "serve") and not settings.no_moe_profile and not res.routing:
        from moecache.moe.profile import HotSet

        try:
            hot = HotSet.start(eng, settings.moe_profile, once)
        except BaseException:
            eng.close()
            raise
    return LLM(eng, res, probe, hot, once)


def model_line(eng, res: Resolved) -> str:
    """``model: NAME (arch, layers, MiB) | backend: ... | n_ctx ... | n_ubatch ... | load mode ... | loaded in ...``."""
    c = eng.gguf.config
    pl = eng.placement
    ctx_src = f"-c {res.n_ctx}" if res.n_ctx else "the model's trained context"
    if pl is not None and pl.devices:
        from moecache.devices import gpu_name

        gpus = ", ".join(f"{d}: {gpu_name(d)}" for d in pl.devices)
        where = f"cuda [{gpus}] + {eng.n_threads} CPU threads | {pl.summary()}"
    else:
        where = f"cpu, {eng.n_threads} thread{'' if eng.n_threads == 1 else 's'}"
    return (f"model: {eng.gguf.path.name} ({c.arch}, {c.n_layer} layers, {eng.gguf.n_bytes / 2**20:.0f} MiB) | "
            f"backend: {where} | n_ctx {eng.n_ctx} ({ctx_src}) | n_ubatch {eng.n_ubatch} | "
            f"load mode {eng.load_mode} | loaded in {eng.load_seconds:.2f} s")


def _continuation(tok, ids: list[int], special: bool) -> str:
    """The generated text as ``moecache run`` prints it and ``serve`` sends it: the tokens' pieces
    joined (a SentencePiece vocabulary's leading space kept: it separates the text from the
    prompt), control tokens left out unless ``special``."""
    stream = tok.streamer(skip_special=not special)
    return "".join(stream.push(i) for i in ids) + stream.flush()


def load(path: str | Path, log: Log | None = None, *, verbose: bool = False, **settings: Any) -> LLM:
    """Load a GGUF model, resolving ``settings`` exactly as ``moecache run`` does.

    Args:
        path: the GGUF file (first shard of a split model).
        log: where the resolved settings and notes go, one line per call (default: discard).
        verbose: every resolved value with its reason.
        **settings: :class:`moecache.settings.Settings` fields under llama.cpp's names (``n_ctx``,
            ``n_batch``, ``n_ubatch``, ``n_threads``, ``n_gpu_layers``, ``cpu_moe``, ``n_cpu_moe``,
            ``moe_cache``, ``vram_budget``, ``cache_type``, ``load_mode``, ``routing``, ...); the
            ones not given are resolved from the model and a probe of the machine.

    Returns:
        an :class:`LLM` (a context manager; ``close()`` releases the model).

    Raises:
        TypeError: an unknown setting name. ValueError: an impossible value (the message names the
        flag). :class:`moecache.errors.MoecacheError`: the model cannot be run (missing file,
        invalid GGUF, unsupported architecture or quant, not enough memory).
    """
    return open_llm(path, Settings(**settings), log=log, verbose=verbose)
