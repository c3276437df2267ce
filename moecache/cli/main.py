"""The ``moecache`` command: llama.cpp-style subcommands.

Heavy imports (numba, cupy, the kernels) happen inside the commands so ``--help`` is instant.
Errors meant for the user (:class:`moecache.errors.MoecacheError`) print one line on stderr and
exit 1; usage errors (a flag out of its range, an unknown flag) one line too, exit 2, as Click's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from moecache.cli.flags import INT32_MAX, SEED_MAX, OneLineErrorsGroup, frange, minus_one_or_at_least, version_option
from moecache.threads import openmp_wait_for_args

openmp_wait_for_args(sys.argv[1:])  # before any OpenMP runtime loads (see moecache/threads.py)
# GPU ordinals in PCI bus order (CUDA's default is fastest first): -sm layer keeps layers in bus
# order and -mg / -ts index GPUs as nvidia-smi lists them. A user's own setting wins.
os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")

app = typer.Typer(
    name="moecache",
    help="Run Mixture-of-Experts GGUF models larger than GPU memory: hot experts cached in VRAM, "
         "misses computed on the CPU at the same time.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # usage errors as plain lines, not a box
    cls=OneLineErrorsGroup,  # ... each one line: `error: -n/--n-predict: input should be greater than ...`
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command
)

VersionOpt = Annotated[Optional[bool], version_option()]


@app.callback()
def _main(version: VersionOpt = None) -> None:
    """Run Mixture-of-Experts GGUF models larger than GPU memory: hot experts cached in VRAM,
    misses computed on the CPU at the same time."""


_PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def fail(message: str, code: int = 1) -> None:
    """Print ``error: message`` on stderr and exit with ``code``."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


# ---- options shared by the commands (llama.cpp names) -------------------------------------------
ModelOpt = Annotated[Optional[Path], typer.Option("-m", "--model", help="GGUF model file (first shard of a split model). "
                                                  "Default: the gemma3-270m package's model (the demo extra).")]
CtxOpt = Annotated[Optional[int], typer.Option("-c", "--ctx-size", min=0, max=INT32_MAX, help="Context size in tokens (0 = the model's "
                                               "trained context); default: resolved at startup (printed).")]
BatchOpt = Annotated[Optional[int], typer.Option("-b", "--batch-size", min=1, max=INT32_MAX, help="Logical batch size "
                                                 "(default 2048, raised to a larger resolved -ub).")]
UBatchOpt = Annotated[Optional[int], typer.Option("-ub", "--ubatch-size", min=1, max=INT32_MAX, help="Physical batch size (tokens per "
                                                  "forward pass); default: resolved at startup (printed).")]
ThreadsOpt = Annotated[Optional[int], typer.Option("-t", "--threads", min=0, max=INT32_MAX, help="CPU threads (0 = physical cores); "
                                                   "default: resolved at startup (printed).")]
LoadModeOpt = Annotated[Optional[str], typer.Option("--load-mode", help="mmap: map the file; pin: copy the weights "
                                                    "into page-locked RAM at load; auto (default): pin when it fits "
                                                    "in RAM and the experts go to host RAM (or for serve), else "
                                                    "map.")]
CacheTypeKOpt = Annotated[Optional[str], typer.Option("-ctk", "--cache-type-k", help="KV cache type: f16 (default, "
                                                       "as llama.cpp) or f32 (twice the memory). K and V take the "
                                                       "same type: -ctk or -ctv alone sets both.")]
CacheTypeVOpt = Annotated[Optional[str], typer.Option("-ctv", "--cache-type-v", help="KV cache type for V (sets K too); "
                                                       "see -ctk.")]
VerboseOpt = Annotated[bool, typer.Option("-v", "--verbose", help="Print every resolved setting with its reason.")]
MoeCacheOpt = Annotated[Optional[str], typer.Option("--moe-cache", help="Expert cache per GPU: -1 = fill free VRAM "
                                                    "(default when the model does not fit), 0 = off, or at most this "
                                                    "size (12GB, 8GiB, 8000 = MiB).")]
VramBudgetOpt = Annotated[Optional[str], typer.Option("--vram-budget", help="Use at most this much of each GPU "
                                                      "(e.g. 8GiB, 12GB, 12000 = MiB): emulates a smaller card; "
                                                      "memory already in use on it (the CUDA context) counts.")]
MoeWindowOpt = Annotated[Optional[int], typer.Option("--moe-cache-window", min=1, max=INT32_MAX, help="Tokens of expert-usage history the cache "
                                           "policy weighs (default 64).")]
MoeStatsOpt = Annotated[int, typer.Option("--moe-cache-stats", min=-1, max=INT32_MAX, help="Print the cache's hit rate and uploads every N "
                                          "tokens and at exit (0 = off, -1 = at exit only).")]
RoutingOpt = Annotated[Optional[str], typer.Option("--routing", help="Benchmarks only: replace the router's choice by "
                                                   "a routing process (uniform, qwen3-moe, olmoe, low-locality) or a "
                                                   "recorded trace (.npz); the text becomes meaningless.")]
DeterministicOpt = Annotated[bool, typer.Option("--deterministic", help="Cache decisions from fixed costs, not "
                                                "measured timings (also MOECACHE_DETERMINISTIC=1).")]
MoeProfileOpt = Annotated[Optional[Path], typer.Option("--moe-profile", help="Saved expert usage to preload into the "
                                                       "expert cache at start and add to at exit (default: the "
                                                       "model's file under $XDG_CACHE_HOME or ~/.cache, "
                                                       "moecache/profiles/).")]
NoMoeProfileOpt = Annotated[bool, typer.Option("--no-moe-profile", help="Neither preload nor save the expert usage.")]
MissSplitOpt = Annotated[bool, typer.Option("--miss-split", help="Expert cache with --load-mode pin: decode steps "
                                            "hand a share of each layer's misses to the CPU inside the CUDA graph, "
                                            "the share refit per layer from the measured wait (opt-in; "
                                            "measured slower on the H200).")]
CachePlanOpt = Annotated[str, typer.Option("--cache-plan", help="Expert cache with --load-mode pin: expert = slots "
                                           "follow each expert's usage; layer = slots follow a plan per layer, "
                                           "remade every --moe-cache-window tokens: whole layers at flat "
                                           "routing, hot sets with local routing, and per layer the share of "
                                           "each token's misses the CPU computes while the GPU reads the rest "
                                           "over PCIe, as predicted fastest; auto = layer for run, bench and serve when the "
                                           "experts are page-locked behind one GPU's cache and -t leaves a CPU "
                                           "free (the Numba threads then wait actively), else expert (the "
                                           "resolved value and why: -v).")]
ElasticOpt = Annotated[Optional[bool], typer.Option("--elastic-slots/--no-elastic-slots", show_default=False,
                                                    help="Expert cache filling the free VRAM: the part of "
                                          "the reserve that only prompts use (all of it but 384 MiB) becomes "
                                          "elastic slots, experts while decoding; their memory goes back to the "
                                          "driver for each prompt, and decode maps again as many as fit 128 MiB "
                                          "under --vram-budget (or the GPU's usable share) (default: on; +9-17% "
                                          "tg128 at 8 GiB on the H200, peaks within the budget).")]


NglOpt = Annotated[int, typer.Option("-ngl", "--n-gpu-layers", "--gpu-layers", min=-1, max=INT32_MAX, help="Layers on the GPU, counted from the "
                                     "last (> n_layer: the output layer too); -1 = all that fit; 0 = CPU only.")]
CpuMoeOpt = Annotated[bool, typer.Option("-cmoe", "--cpu-moe", help="Keep every layer's routed experts in host RAM "
                                         "(computed on the CPU; prompt ubatches of 32+ tokens on the GPU).")]
NCpuMoeOpt = Annotated[int, typer.Option("-ncmoe", "--n-cpu-moe", min=0, max=INT32_MAX, help="Keep the routed experts of the first N "
                                         "layers in host RAM.")]
SplitOpt = Annotated[str, typer.Option("-sm", "--split-mode", help="layer: split layers over the GPUs; none: -mg only.")]
TsOpt = Annotated[Optional[str], typer.Option("-ts", "--tensor-split", help="Proportions of layers per GPU, e.g. 3,1 "
                                              "(default: by free memory).")]
MgOpt = Annotated[int, typer.Option("-mg", "--main-gpu", min=0, max=INT32_MAX, help="The GPU of -sm none.")]


FaOpt = Annotated[Optional[str], typer.Option("-fa", "--flash-attn", help="on|off|auto; accepted, no effect on the CPU.")]
# the sampling flags of run and serve (serve: the defaults of requests that leave them out)
TempOpt = Annotated[float, typer.Option("--temp", parser=frange(), help="Temperature (<= 0 = greedy).")]
TopKOpt = Annotated[int, typer.Option("--top-k", min=0, max=INT32_MAX, help="Top-k sampling (0 = off).")]
TopPOpt = Annotated[float, typer.Option("--top-p", parser=frange(0.0, 1.0), help="Top-p sampling (1.0 = off).")]
MinPOpt = Annotated[float, typer.Option("--min-p", parser=frange(0.0, 1.0), help="Min-p sampling (0.0 = off).")]
RepeatPenaltyOpt = Annotated[float, typer.Option("--repeat-penalty", parser=frange(1e-6), help="Repetition penalty (1.0 = off).")]
RepeatLastNOpt = Annotated[int, typer.Option("--repeat-last-n", min=-1, max=INT32_MAX, help="Tokens the penalties look at (-1 = context).")]
PresenceOpt = Annotated[float, typer.Option("--presence-penalty", parser=frange())]
FrequencyOpt = Annotated[float, typer.Option("--frequency-penalty", parser=frange())]
SeedOpt = Annotated[int, typer.Option("-s", "--seed", min=-1, max=SEED_MAX, help="RNG seed (-1 = random).")]
EscapeOpt = Annotated[bool, typer.Option("--escape/--no-escape", "-e", help="Process escapes (\\n, \\t, \\xHH, ...) "
                                         "in the prompt text, as llama.cpp does by default.")]


def _user_errors(fn, *args) -> None:
    """Run a command body; user and model errors become one `error:` line and exit 1
    (:func:`moecache.cli.common.error_line`); anything else propagates with its traceback."""
    from moecache.cli.common import error_line

    try:
        fn(*args)
    except Exception as e:
        line = error_line(e)
        if line is None:
            raise
        fail(line)


def _settings(*, ctx_size, batch_size, ubatch_size, threads, ngl, moe_profile: Path | None = None, **same):
    """The requested settings of run / perplexity / serve from their flags (the flags named as in
    :class:`moecache.settings.Settings` pass through), checked."""
    from moecache.settings import Settings

    s = Settings(n_ctx=ctx_size, n_batch=batch_size, n_ubatch=ubatch_size, n_threads=threads, n_gpu_layers=ngl,
                 moe_profile=None if moe_profile is None else str(moe_profile), **same)
    s.check()
    return s


def _sampling(*, seed: int, **same):
    """llama.cpp's sampler settings from the sampling flags (``--seed -1``: a random seed)."""
    from moecache.sampling import DEFAULT_SEED, SamplingParams

    return SamplingParams(seed=DEFAULT_SEED if seed == -1 else seed, **same)


@app.command()
def run(
    model: ModelOpt = None,
    prompt: Annotated[Optional[str], typer.Option("-p", "--prompt", help="Prompt: complete it once and exit.")] = None,
    file: Annotated[Optional[Path], typer.Option("-f", "--file", help="Read the prompt from a file.")] = None,
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", min=-1, max=INT32_MAX, help="Tokens to generate (-1 = until end of generation).")] = -1,
    ctx_size: CtxOpt = None,
    batch_size: BatchOpt = None,
    ubatch_size: UBatchOpt = None,
    threads: ThreadsOpt = None,
    load_mode: LoadModeOpt = None,
    cache_type_k: CacheTypeKOpt = None,
    cache_type_v: CacheTypeVOpt = None,
    verbose: VerboseOpt = False,
    ngl: NglOpt = -1,
    cpu_moe: CpuMoeOpt = False,
    n_cpu_moe: NCpuMoeOpt = 0,
    split_mode: SplitOpt = "layer",
    tensor_split: TsOpt = None,
    main_gpu: MgOpt = 0,
    moe_cache: MoeCacheOpt = None,
    vram_budget: VramBudgetOpt = None,
    moe_cache_window: MoeWindowOpt = None,
    moe_cache_stats: MoeStatsOpt = 0,
    routing: RoutingOpt = None,
    deterministic: DeterministicOpt = False,
    moe_profile: MoeProfileOpt = None,
    no_moe_profile: NoMoeProfileOpt = False,
    miss_split: MissSplitOpt = False,
    cache_plan: CachePlanOpt = "auto",
    elastic_slots: ElasticOpt = None,
    flash_attn: FaOpt = None,
    temp: TempOpt = 0.8,
    top_k: TopKOpt = 40,
    top_p: TopPOpt = 0.95,
    min_p: MinPOpt = 0.05,
    repeat_penalty: RepeatPenaltyOpt = 1.0,
    repeat_last_n: RepeatLastNOpt = 64,
    presence_penalty: PresenceOpt = 0.0,
    frequency_penalty: FrequencyOpt = 0.0,
    seed: SeedOpt = -1,
    conversation: Annotated[Optional[bool], typer.Option("-cnv/-no-cnv", "--conversation/--no-conversation",
                                                         help="Interactive chat (default when no -p/-f).")] = None,
    system: Annotated[Optional[str], typer.Option("-sys", "--system-prompt", help="System prompt for chat.")] = None,
    chat_template: Annotated[Optional[str], typer.Option("--chat-template", help="Built-in template name or a "
                                                         "Jinja template (overrides the GGUF's).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with the text and timings.")] = False,
    escape: EscapeOpt = True,
    special: Annotated[bool, typer.Option("-sp", "--special", help="Print special (control) tokens.")] = False,
    no_display_prompt: Annotated[bool, typer.Option("--no-display-prompt", help="Print only the generated text, "
                                                    "not the prompt before it (-p/-f).")] = False,
    version: VersionOpt = None,
) -> None:
    """Generate text like llama-cli: one-shot with -p/-f, else an interactive chat."""
    def body() -> None:
        from moecache.cli.run import RunOptions, run_command

        sp = _sampling(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                       repeat_last_n=repeat_last_n, frequency_penalty=frequency_penalty,
                       presence_penalty=presence_penalty, seed=seed)
        settings = _settings(ctx_size=ctx_size, batch_size=batch_size, ubatch_size=ubatch_size, threads=threads,
                             ngl=ngl, cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe, split_mode=split_mode,
                             tensor_split=tensor_split, main_gpu=main_gpu, moe_cache=moe_cache, vram_budget=vram_budget,
                             cache_type_k=cache_type_k, cache_type_v=cache_type_v, load_mode=load_mode,
                             flash_attn=flash_attn, moe_cache_window=moe_cache_window, moe_cache_stats=moe_cache_stats,
                             routing=routing, deterministic=deterministic, moe_profile=moe_profile,
                             no_moe_profile=no_moe_profile, miss_split=miss_split, cache_plan=cache_plan, elastic_slots=elastic_slots)
        opts = RunOptions(model=model, prompt=prompt, file=file, n_predict=n_predict, conversation=conversation,
                          system=system, chat_template=chat_template, as_json=as_json, escape=escape, special=special,
                          verbose=verbose, display_prompt=not no_display_prompt)
        run_command(opts, settings, sp)
    _user_errors(body)


@app.command()
def perplexity(
    model: ModelOpt = None,
    file: Annotated[Optional[Path], typer.Option("-f", "--file", help="Text file to score.")] = None,
    ctx_size: Annotated[int, typer.Option("-c", "--ctx-size", min=4, max=INT32_MAX, help="Chunk size in tokens.")] = 512,
    batch_size: BatchOpt = None,
    ubatch_size: UBatchOpt = None,
    threads: ThreadsOpt = None,
    load_mode: LoadModeOpt = None,
    cache_type_k: CacheTypeKOpt = None,
    cache_type_v: CacheTypeVOpt = None,
    verbose: VerboseOpt = False,
    chunks: Annotated[int, typer.Option("--chunks", parser=minus_one_or_at_least(1, "all"),
                                        help="Score at most this many chunks (-1 = all).")] = -1,
    ngl: NglOpt = -1,
    cpu_moe: CpuMoeOpt = False,
    n_cpu_moe: NCpuMoeOpt = 0,
    split_mode: SplitOpt = "layer",
    tensor_split: TsOpt = None,
    main_gpu: MgOpt = 0,
    moe_cache: MoeCacheOpt = None,
    vram_budget: VramBudgetOpt = None,
    moe_cache_window: MoeWindowOpt = None,
    moe_cache_stats: MoeStatsOpt = 0,
    deterministic: DeterministicOpt = False,
    flash_attn: FaOpt = None,
    escape: Annotated[bool, typer.Option("--escape/--no-escape", "-e", help="Process escapes (\\n, \\t, ...) in "
                                         "the text; off by default, as in llama-perplexity.")] = False,
    version: VersionOpt = None,
) -> None:
    """Perplexity over a text file, chunked as llama-perplexity does (second half of each -c chunk scored)."""
    def body() -> None:
        from moecache.cli.common import UserError
        from moecache.cli.perplexity import perplexity_command

        if file is None:
            raise UserError("perplexity needs a text file: -f FILE")
        settings = _settings(ctx_size=ctx_size, batch_size=batch_size, ubatch_size=ubatch_size, threads=threads,
                             ngl=ngl, cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe, split_mode=split_mode,
                             tensor_split=tensor_split, main_gpu=main_gpu, moe_cache=moe_cache, vram_budget=vram_budget,
                             cache_type_k=cache_type_k, cache_type_v=cache_type_v, load_mode=load_mode,
                             flash_attn=flash_attn, moe_cache_window=moe_cache_window, moe_cache_stats=moe_cache_stats,
                             deterministic=deterministic)
        perplexity_command(model, file, settings, chunks, escape, verbose)
    _user_errors(body)




@app.command()
def serve(
    model: ModelOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (127.0.0.1: this machine only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Port to listen on.")] = 8080,
    n_parallel: Annotated[int, typer.Option("-np", "--parallel", min=1, max=4096, help="Slots: requests decoded "
                                            "together, each with -c / -np positions (llama-server's split); as many "
                                            "more may wait (beyond: 503).")] = 4,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="MOECACHE_API_KEY", help="Require "
                                                   "'Authorization: Bearer KEY' (also MOECACHE_API_KEY).")] = None,
    alias: Annotated[Optional[str], typer.Option("-a", "--alias", help="Model name in the API (default: the file name).")] = None,
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", min=-1, max=INT32_MAX, help="Default max_tokens "
                                           "(-1 = until the end of generation or a full context).")] = -1,
    ctx_size: CtxOpt = None,
    batch_size: BatchOpt = None,
    ubatch_size: UBatchOpt = None,
    threads: ThreadsOpt = None,
    load_mode: LoadModeOpt = None,
    cache_type_k: CacheTypeKOpt = None,
    cache_type_v: CacheTypeVOpt = None,
    verbose: VerboseOpt = False,
    ngl: NglOpt = -1,
    cpu_moe: CpuMoeOpt = False,
    n_cpu_moe: NCpuMoeOpt = 0,
    split_mode: SplitOpt = "layer",
    tensor_split: TsOpt = None,
    main_gpu: MgOpt = 0,
    moe_cache: MoeCacheOpt = None,
    vram_budget: VramBudgetOpt = None,
    moe_cache_window: MoeWindowOpt = None,
    moe_cache_stats: MoeStatsOpt = 0,
    routing: RoutingOpt = None,
    deterministic: DeterministicOpt = False,
    moe_profile: MoeProfileOpt = None,
    no_moe_profile: NoMoeProfileOpt = False,
    miss_split: MissSplitOpt = False,
    cache_plan: CachePlanOpt = "auto",
    elastic_slots: ElasticOpt = None,
    flash_attn: FaOpt = None,
    temp: TempOpt = 0.8,
    top_k: TopKOpt = 40,
    top_p: TopPOpt = 0.95,
    min_p: MinPOpt = 0.05,
    repeat_penalty: RepeatPenaltyOpt = 1.0,
    repeat_last_n: RepeatLastNOpt = 64,
    presence_penalty: PresenceOpt = 0.0,
    frequency_penalty: FrequencyOpt = 0.0,
    seed: SeedOpt = -1,
    chat_template: Annotated[Optional[str], typer.Option("--chat-template", help="Built-in template name or a "
                                                         "Jinja template (overrides the GGUF's).")] = None,
    timeout: Annotated[int, typer.Option("-to", "--timeout", min=1, max=86400, help="Seconds a request's body may "
                                         "take to arrive, else 408 (llama-server's read timeout).")] = 600,
    engine_process: Annotated[bool, typer.Option("--engine-process/--no-engine-process", help="Run the model in a "
                                                 "process of its own, so that the HTTP server's Python and a decode "
                                                 "step never wait for each other's GIL. An experiment, not "
                                                 "recommended yet: the default (the engine in a thread of the "
                                                 "server's process) was as fast or faster in every run so far "
                                                 "(bench/results/serve-h200.md).")] = False,
    version: VersionOpt = None,
) -> None:
    """OpenAI-compatible HTTP server like llama-server (/v1/chat/completions, /v1/completions, ...)."""
    def body() -> None:
        from moecache.cli.serve import ServeOptions, serve_command

        sp = _sampling(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                       repeat_last_n=repeat_last_n, frequency_penalty=frequency_penalty,
                       presence_penalty=presence_penalty, seed=seed)
        settings = _settings(ctx_size=ctx_size, batch_size=batch_size, ubatch_size=ubatch_size, threads=threads,
                             ngl=ngl, cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe, split_mode=split_mode,
                             tensor_split=tensor_split, main_gpu=main_gpu, moe_cache=moe_cache, vram_budget=vram_budget,
                             cache_type_k=cache_type_k, cache_type_v=cache_type_v, load_mode=load_mode,
                             flash_attn=flash_attn, moe_cache_window=moe_cache_window, moe_cache_stats=moe_cache_stats,
                             routing=routing, deterministic=deterministic, moe_profile=moe_profile,
                             no_moe_profile=no_moe_profile, miss_split=miss_split, cache_plan=cache_plan,
                             elastic_slots=elastic_slots)
        serve_command(ServeOptions(model=model, host=host, port=port, n_parallel=n_parallel, api_key=api_key,
                                   alias=alias, n_predict=n_predict, chat_template=chat_template, verbose=verbose,
                                   timeout=timeout, engine_process=engine_process),
                      settings, sp)
    _user_errors(body)


@app.command()
def bench(
    model: Annotated[Optional[list[Path]], typer.Option("-m", "--model", help="GGUF model (repeat -m for several); "
                                                         "default: the gemma3-270m package's model.")] = None,
    n_prompt: Annotated[str, typer.Option("-p", "--n-prompt", help="Prompt lengths (pp tests).")] = "512",
    n_gen: Annotated[str, typer.Option("-n", "--n-gen", help="Generated tokens (tg tests).")] = "128",
    pg: Annotated[Optional[str], typer.Option("-pg", help="pp,tg pairs timed together, e.g. 512,128.")] = None,
    depth: Annotated[str, typer.Option("-d", "--n-depth", help="Tokens already in the context, evaluated untimed "
                                       "before each timed run (their own t/s: the depth_ts field).")] = "0",
    reps: Annotated[int, typer.Option("-r", "--repetitions", min=1, max=INT32_MAX, help="Timed runs per test.")] = 5,
    threads: Annotated[Optional[str], typer.Option("-t", "--threads", help="CPU threads.")] = None,
    batch_size: Annotated[str, typer.Option("-b", "--batch-size")] = "2048",
    ubatch_size: Annotated[Optional[str], typer.Option("-ub", "--ubatch-size", help="Physical batch sizes; default: "
                                                       "the resolved -ub, as run has it (llama-bench: 512).")] = None,
    ngl: Annotated[str, typer.Option("-ngl", "--n-gpu-layers", help="GPU layers (-1 = all that fit).")] = "99",
    n_cpu_moe: Annotated[str, typer.Option("-ncmoe", "--n-cpu-moe")] = "0",
    moe_cache: Annotated[Optional[str], typer.Option("--moe-cache", help="Expert cache per GPU: -1 fill, 0 off, or "
                                                     "sizes, e.g. 4GiB,8GiB (MiB when unitless).")] = None,
    vram_budget: Annotated[Optional[str], typer.Option("--vram-budget", help="VRAM per GPU, e.g. 8GiB,12GiB (MiB when "
                                                       "unitless).")] = None,
    moe_cache_window: Annotated[Optional[str], typer.Option("--moe-cache-window", help="Policy windows (default 64).")] = None,
    routing: Annotated[Optional[str], typer.Option("--routing", help="Routing processes/traces (see run --help).")] = None,
    n_gen_warmup: Annotated[int, typer.Option("--n-gen-warmup", min=0, max=INT32_MAX, help="Generate N tokens before "
                                              "timing: an expert cache starts cold and needs warming.")] = 0,
    ctx_size: Annotated[Optional[int], typer.Option("-c", "--ctx-size", min=1, max=INT32_MAX,
                                                    help="Context size (its KV cache takes VRAM); "
                                                    "default: what the tests need.")] = None,
    no_warmup: Annotated[bool, typer.Option("--no-warmup", help="Skip the untimed warm-up run of each test.")] = False,
    load_mode: LoadModeOpt = None,
    cache_type_k: CacheTypeKOpt = None,
    cache_type_v: CacheTypeVOpt = None,
    output: Annotated[str, typer.Option("-o", "--output", help="md, csv, json or jsonl.")] = "md",
    miss_split: MissSplitOpt = False,
    cache_plan: CachePlanOpt = "auto",
    elastic_slots: ElasticOpt = None,
    version: VersionOpt = None,
) -> None:
    """Benchmark pp/tg speed like llama-bench (comma lists and first-last+step ranges everywhere),
    with the expert cache's parameters."""
    def body() -> None:
        from moecache.cli.bench import BenchOptions, bench_command

        bench_command(BenchOptions(models=model, n_prompt=n_prompt, n_gen=n_gen, pg=pg, depth=depth, reps=reps,
                                   threads=threads, batch=batch_size, ubatch=ubatch_size, ngl=ngl, n_cpu_moe=n_cpu_moe,
                                   moe_cache=moe_cache, vram_budget=vram_budget, window=moe_cache_window,
                                   routing=routing, n_gen_warmup=n_gen_warmup, warmup=not no_warmup,
                                   load_mode=load_mode, output=output, ctx_size=ctx_size, cache_type_k=cache_type_k,
                                   cache_type_v=cache_type_v, miss_split=miss_split, cache_plan=cache_plan, elastic_slots=elastic_slots))
    _user_errors(body)


@app.command("probe-pcie")
def probe_pcie(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object instead of tables.")] = False,
    size: Annotated[int, typer.Option("--size", min=1, max=1 << 20, help="Test buffer size in MiB.")] = 256,
    reps: Annotated[int, typer.Option("--reps", min=1, max=10_000, help="Repetitions; the median is reported.")] = 5,
    version: VersionOpt = None,
) -> None:
    """Measure GPU links (PCIe generation/width, copy bandwidths), VRAM, host RAM bandwidth and cores."""
    def body() -> None:
        from moecache.cli.probe import probe_command

        probe_command(as_json, size, reps)
    _user_errors(body)


@app.command()
def profile(
    model: ModelOpt = None,
    prompt: Annotated[Optional[list[str]], typer.Option("-p", "--prompt", help="A prompt to run (repeat for several).")] = None,
    file: Annotated[Optional[list[Path]], typer.Option("-f", "--file", help="A prompt file to run (repeat for several).")] = None,
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", min=0, max=INT32_MAX, help="Tokens to generate per prompt "
                                           "(their routing is recorded too).")] = 32,
    temp: Annotated[float, typer.Option("--temp", parser=frange(), help="Temperature (<= 0 = greedy, the default).")] = 0.0,
    trace: Annotated[Optional[Path], typer.Option("--trace", help="Write the routing trace (.npz, replayable with "
                                                  "--routing FILE).")] = None,
    trace_in: Annotated[Optional[Path], typer.Option("--trace-in", help="Read a trace instead of running the model.")] = None,
    routing: RoutingOpt = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG: usage heatmap and hit rate against cache "
                                                 "size (needs matplotlib: the plot extra).")] = None,
    what_if: Annotated[Optional[str], typer.Option("--what-if", help="Expert-cache sizes, e.g. 4GiB,8GiB: predicted hit "
                                                   "rate and decode t/s each.")] = None,
    what_if_vram: Annotated[Optional[str], typer.Option("--what-if-vram", help="VRAM sizes, e.g. 8GiB,12GiB: each "
                                                        "placed as run --vram-budget SIZE would (needs -m), then "
                                                        "the what-if of the expert cache it gets.")] = None,
    calibrate: Annotated[Optional[Path], typer.Option("--calibrate", help="What-if: fit the step and miss times to "
                                                      "decode runs of this machine (moecache bench -o jsonl with "
                                                      "an expert cache, -p 0 -n N).")] = None,
    n_gen_warmup: Annotated[int, typer.Option("--n-gen-warmup", min=0, max=INT32_MAX, help="What-if: the trace's "
                                              "first N tokens fill the cache and are not counted (as bench's).")] = 0,
    step_ms: Annotated[Optional[float], typer.Option("--step-ms", parser=frange(0.0), help="What-if: GPU time of one "
                                                     "decode step with every expert a hit, ms (default: a placeholder, 10).")] = None,
    link_gbps: Annotated[Optional[float], typer.Option("--link-gbps", parser=frange(1e-6), help="What-if: host->GPU "
                                                       "copy rate in GB/s (default: the startup probe's).")] = None,
    expert_mib: Annotated[Optional[float], typer.Option("--expert-mib", parser=frange(1e-9), help="What-if on "
                                                        "--trace-in without -m: bytes of one expert, in MiB.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", min=1, max=INT32_MAX, help="With --trace-in: "
                                                      "use only the trace's first N tokens.")] = None,
    save: Annotated[bool, typer.Option("--save", help="Save the usage counts under ~/.cache/moecache/profiles/.")] = False,
    load_profile: Annotated[Optional[Path], typer.Option("--load-profile", help="Add a saved usage profile of this "
                                                         "model (one of another model is refused).")] = None,
    ctx_size: CtxOpt = None,
    threads: ThreadsOpt = None,
    verbose: VerboseOpt = False,
    escape: EscapeOpt = True,
    version: VersionOpt = None,
) -> None:
    """Record and show expert routing (heatmap, skew), save it, and predict hit rate and speed per cache size."""
    def body() -> None:
        from moecache.cli.profile import ProfileOptions, profile_command
        from moecache.settings import Settings

        settings = Settings(n_ctx=ctx_size, n_threads=threads, routing=routing)
        settings.check()
        profile_command(ProfileOptions(model=model, prompts=prompt or [], files=file or [], n_predict=n_predict,
                                       temp=temp, trace_out=trace, trace_in=trace_in, plot=plot, what_if=what_if,
                                       save=save, load_profile=load_profile, step_ms=step_ms, link_gbps=link_gbps,
                                       expert_mib=expert_mib, max_tokens=max_tokens, calibrate=calibrate,
                                       n_gen_warmup=n_gen_warmup, what_if_vram=what_if_vram, escape=escape,
                                       verbose=verbose), settings)
    _user_errors(body)


@app.command()
def info(
    model: ModelOpt = None,
    tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor.")] = False,
    version: VersionOpt = None,
) -> None:
    """Validate a GGUF and print its architecture, hyperparameters and tensor summary."""
    def body() -> None:
        from moecache.cli.common import resolve_model
        from moecache.cli.info import show_info

        show_info(resolve_model(model), tensors)
    _user_errors(body)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
