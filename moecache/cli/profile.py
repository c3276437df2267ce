"""``moecache profile``: run prompts, record the routing, show it, and predict speed per cache budget.

The work is in :mod:`moecache.moe.profile`; this module reads the flags, runs the model through the
library (:func:`moecache.cli.common.load_engine`, greedy by default) and prints. Results go to
stdout (heatmap, skew lines, what-if table); notes and the files written go to stderr.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moecache.cli.common import UserError, load_engine, note, read_text_arg, resolve_model

SHADES = " ░▒▓█"
MAX_COLUMNS = 128  # experts per heatmap row; more are summed in groups
CURVE_FRACTIONS = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]


@dataclass(frozen=True)
class ProfileOptions:
    """The flags of ``moecache profile`` (see ``moecache profile --help``)."""

    model: Path | None = None
    prompts: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    n_predict: int = 32
    temp: float = 0.0
    trace_out: Path | None = None
    trace_in: Path | None = None
    plot: Path | None = None
    what_if: str | None = None
    save: bool = False
    load_profile: Path | None = None
    step_ms: float | None = None
    link_gbps: float | None = None
    expert_mib: float | None = None
    max_tokens: int | None = None
    calibrate: Path | None = None
    n_gen_warmup: int = 0
    what_if_vram: str | None = None
    escape: bool = True
    verbose: bool = False


def parse_budgets(text: str, flag: str = "--what-if") -> list[int]:
    """``4GiB,8GiB,...`` -> bytes each (MiB when unitless); ValueError naming ``flag``."""
    from moecache.sizes import parse_size

    out = []
    for part in text.split(","):
        b = parse_size(part, flag)
        if b <= 0:
            raise ValueError(f"{flag} {text!r}: each size must be > 0, e.g. 4GiB,8GiB")
        out.append(b)
    return out


def _need_matplotlib() -> Any:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'moecache[plot]'") from None
    return plt


def record(llm, texts: list[str], n_predict: int, temp: float):
    """Run each prompt (from an empty sequence) with generation and record the routing of every
    token fed to the model: returns the :class:`moecache.moe.profile.Trace`."""
    from moecache.moe.profile import RouteRecorder, expert_bytes_of

    eng = llm.engine
    rec = RouteRecorder()
    fed: list[int] = []
    eng.model.route_observers.append(rec)
    try:
        for text in texts:
            out = llm.complete(text, n_predict=n_predict, temperature=temp, seed=0)
            ids = llm.tokenize(text)
            # the last sampled token is fed only when generation went on past it (an end token is)
            fed += ids + (out.tokens if out.stop == "eog" else out.tokens[:-1])
    finally:
        eng.model.route_observers.remove(rec)
    return rec.trace(eng.gguf.config.n_expert, expert_bytes_of(eng.gguf), fed)


def profile_command(o: ProfileOptions, settings) -> None:
    """Validate, record or read a trace, print the pictures and the what-if, write the files."""
    from moecache.moe.profile import Trace, UsageProfile, model_key, usage_counts

    texts = [read_text_arg(t, None, o.escape) for t in o.prompts] + [read_text_arg(None, f, o.escape) for f in o.files]
    if texts and o.trace_in is not None:
        raise UserError("give prompts (-p/-f) or --trace-in FILE, not both")
    if not texts and o.trace_in is None and o.load_profile is None:
        raise UserError("profile needs prompts (-p TEXT or -f FILE), --trace-in FILE or --load-profile FILE")
    if o.trace_in is not None and settings.routing:
        raise UserError("--routing profiles a model run; with --trace-in the trace is the routing")
    budgets = parse_budgets(o.what_if) if o.what_if else []
    vram = parse_budgets(o.what_if_vram, "--what-if-vram") if o.what_if_vram else []
    if vram and o.model is None:
        raise UserError("--what-if-vram needs the model to place: give -m MODEL")
    calibration = read_calibration(o.calibrate) if o.calibrate is not None else None  # before a long recording
    if calibration is not None:
        from moecache.moe.profile import calibration_points

        try:
            calibration_points(calibration, 1, 1)  # every record's numbers, checked before any work
        except ValueError as e:
            raise UserError(f"--calibrate {o.calibrate}: {e}") from None
        if o.model is not None:
            _same_model(calibration, resolve_model(o.model), o.calibrate)
    if not (budgets or vram):
        for flag, given in (("--calibrate", o.calibrate is not None), ("--n-gen-warmup", o.n_gen_warmup > 0)):
            if given:
                note(f"note: {flag} ignored: it sets up the what-if (--what-if or --what-if-vram)")
    plt = _need_matplotlib() if o.plot is not None else None
    if o.n_predict < 0:
        raise UserError(f"-n/--n-predict must be >= 0 for profile, got {o.n_predict}")

    trace: Trace | None = None
    key: str | None = None
    shape: tuple[int, int] | None = None  # the model's MoE layers x experts
    probe = None
    if texts:
        # the hot set of run/serve is neither loaded nor saved here: the recorded usage is its own
        llm = load_engine(resolve_model(o.model), dataclasses.replace(settings, moe_profile=None, no_moe_profile=True),
                          "run", o.verbose)
        try:
            c = llm.engine.gguf.config
            if not c.n_expert:
                raise UserError(f"{llm.engine.gguf.path.name} has no routed experts: nothing to profile")
            trace = record(llm, texts, o.n_predict, o.temp)
            key, probe = model_key(llm.engine.gguf), llm.probe
            shape = (trace.n_layer, trace.n_expert)
        finally:
            llm.close()
    else:
        if o.trace_in is not None:
            trace = Trace.load(o.trace_in)
            if o.max_tokens is not None:
                trace = trace.head(o.max_tokens)
        if o.model is not None:
            key, ebytes, shape = _model_facts(o.model)
            if trace is not None and not trace.expert_bytes:
                trace = Trace(trace.routes, trace.weights, trace.n_expert, ebytes, trace.tokens)
    if trace is not None and o.expert_mib is not None:
        trace = Trace(trace.routes, trace.weights, trace.n_expert, int(o.expert_mib * 2**20), trace.tokens)

    if (budgets or vram) and trace is None:
        raise UserError("--what-if/--what-if-vram need a trace: prompts (-p/-f) or --trace-in FILE")
    counts = usage_counts(trace.routes, trace.n_expert) if trace is not None else None
    n_tokens = trace.n_tokens if trace is not None else 0
    if o.load_profile is not None:
        prof = UsageProfile.load(o.load_profile)
        if key is None:
            raise UserError("--load-profile needs the model it belongs to: give -m MODEL")
        why = prof.check_model(key, counts.shape if counts is not None else shape)
        if why is not None:
            note(f"note: --load-profile {o.load_profile} refused: {why}")
            if counts is None:
                raise UserError("nothing to profile: the only input was a refused profile")
        else:
            counts = prof.counts if counts is None else counts + prof.counts
            n_tokens += prof.tokens
            note(f"note: --load-profile {o.load_profile}: {prof.tokens} tokens of usage added")

    if o.trace_out is not None and trace is not None:  # first: a failing what-if keeps the recording
        trace.save(o.trace_out)
        note(f"trace: {trace.n_layer} layers x {trace.n_tokens} tokens x top-{trace.routes.shape[2]} written to "
             f"{o.trace_out} (replay it with --routing {o.trace_out})")
    print_heatmap(counts, n_tokens)
    print_skew(counts)
    if budgets or vram:
        placed = vram_caches(o.model, vram, settings, probe) if vram else []
        print_what_if(trace, budgets + [v.cache_bytes for v in placed], o, probe, placed, calibration)
    if o.save:
        if key is None:
            raise UserError("--save needs the model: give -m MODEL")
        p = UsageProfile(key, counts, n_tokens).save()
        note(f"profile: usage of {n_tokens} tokens saved to {p}")
    if plt is not None:
        write_plot(plt, o.plot, counts, trace)
        note(f"plot: written to {o.plot}")


def _model_facts(model: Path) -> tuple[str, int, tuple[int, int]]:
    """(model key, bytes of one expert, (MoE layers, experts)) of a GGUF, read without loading the model."""
    from moecache.gguf_file import open_gguf
    from moecache.moe.profile import expert_bytes_of, model_key

    g = open_gguf(model)
    try:
        c = g.config
        n_moe = sum(f"blk.{il}.ffn_gate_exps.weight" in g.tensors for il in range(c.n_layer))
        return model_key(g), expert_bytes_of(g), (n_moe, c.n_expert)
    finally:
        g.close()


def _columns(row: np.ndarray) -> np.ndarray:
    """A layer's counts in at most :data:`MAX_COLUMNS` columns (consecutive experts summed)."""
    g = -(-row.size // MAX_COLUMNS)
    if g == 1:
        return row
    pad = np.zeros(g * -(-row.size // g) - row.size, row.dtype)
    return np.concatenate([row, pad]).reshape(-1, g).sum(axis=1)


def print_heatmap(counts: np.ndarray, n_tokens: int) -> None:
    """Layers x experts, each cell shaded by its count relative to the layer's most used expert."""
    from rich.console import Console
    from rich.text import Text

    con = Console(highlight=False, soft_wrap=True)
    n_layer, n_expert = counts.shape
    g = -(-n_expert // MAX_COLUMNS)
    per = f", {g} experts per column" if g > 1 else ""
    con.print(f"expert usage per layer ({n_layer} layers x {n_expert} experts{per}, {n_tokens} tokens; "
              f"shade = count / the layer's most used: ' ' 0 .. '█' max)")
    for il in range(n_layer):
        row = _columns(counts[il]).astype(np.float64)
        top = row.max() if row.max() > 0 else 1.0
        line = Text(f"{il:>4} ")
        for v in row / top:
            level = int(round(v * (len(SHADES) - 1)))
            shade = int(55 + 200 * v)
            line.append(SHADES[level], style=f"rgb({shade},{shade // 3},0)")
        con.print(line)


def print_skew(counts: np.ndarray) -> None:
    """One line per layer: top-10% share, entropy, experts for 90%, top expert."""
    from moecache.moe.profile import layer_skew

    n_expert = counts.shape[1]
    print(f"skew per layer (uniform routing: top-10% share ~{max(1, -(-n_expert // 10)) / n_expert:.2f}, "
          f"entropy 1.00, 90% of pairs on ~90% of experts)")
    for s in layer_skew(counts):
        print(f"  layer {s.layer:>3}: top-10% experts take {100 * s.top10_share:5.1f}% of routed pairs | "
              f"entropy {s.entropy:.2f} | 90% of pairs on {100 * s.experts_90:5.1f}% of experts | "
              f"top expert {s.top_expert}")


def _link_rate(o: ProfileOptions, probe) -> tuple[float, str]:
    """(bytes/s, where it came from): --link-gbps, else the startup probe's pinned host->GPU rate,
    else the placeholder :data:`moecache.moe.profile.DEFAULT_LINK_GBPS`."""
    from moecache.moe.profile import DEFAULT_LINK_GBPS

    if o.link_gbps is not None:
        return o.link_gbps * 1e9, "--link-gbps"
    if probe is None:
        from moecache.probe import startup_probe

        probe = startup_probe()
    rates = [g.h2d_pinned for g in probe.gpus if g.h2d_pinned > 0]
    if rates:
        return min(rates), "the startup probe (pinned host->GPU)"
    return DEFAULT_LINK_GBPS * 1e9, "a placeholder: no GPU was probed (set --link-gbps)"


def read_calibration(path: Path) -> list[dict]:
    """The records of a ``moecache bench -o jsonl`` file (``--calibrate``); UserError naming the
    flag for an unreadable file or a line that is not a JSON object."""
    import json

    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--calibrate {path}: {getattr(e, 'strerror', None) or e}") from None
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError:
            r = None
        if not isinstance(r, dict):
            raise UserError(f"--calibrate {path}: line {i} is not a JSON object (expected moecache bench -o jsonl)")
        rows.append(r)
    return rows


def _same_model(rows: list[dict], model: Path, path: Path) -> None:
    """UserError when a ``--calibrate`` record was measured on another model than ``-m`` (its
    ``model_size``, the tensor bytes ``bench`` reports, differs): its miss counts would be read with
    the wrong shape."""
    from moecache.gguf_file import open_gguf

    with open_gguf(model) as g:
        size = g.n_bytes
    for i, r in enumerate(rows, 1):
        if r.get("model_size") not in (None, size):
            raise UserError(f"--calibrate {path}: record {i} was measured on {r.get('model_filename', 'another model')} "
                            f"({r['model_size']} bytes of tensors), not on {model.name} ({size}): calibrate with "
                            f"runs of this model")


def what_if_cost(trace, o: ProfileOptions, probe, calibration: list[dict] | None = None):
    """The what-if's :class:`moecache.moe.profile.CostModel`: fitted to ``--calibrate`` runs, or
    ``--step-ms`` / the placeholder step with misses and uploads at the link rate; and the line
    that says which."""
    from moecache.moe.profile import DEFAULT_STEP_MS, CostModel, calibrate, calibration_points

    link, src = _link_rate(o, probe)
    mib = trace.expert_bytes / 2**20
    if o.calibrate is not None:
        rows = calibration if calibration is not None else read_calibration(o.calibrate)
        try:
            cost = calibrate(calibration_points(rows, trace.n_layer, trace.routes.shape[2]), trace.expert_bytes, link)
        except ValueError as e:
            raise UserError(f"--calibrate {o.calibrate}: {e}") from None
        line = (f"cost model: s/token = {cost.step_s * 1e3:.3f} ms step + misses/token x {cost.miss_s * 1e6:.1f} us + "
                f"uploads/token x {cost.upload_s * 1e6:.1f} us ({mib:.2f} MiB at {link / 1e9:.1f} GB/s, link: {src}); "
                f"{cost.source} of --calibrate {o.calibrate}")
        return cost, line
    step_ms = o.step_ms if o.step_ms is not None else DEFAULT_STEP_MS
    cost = CostModel.from_link(step_ms / 1e3, link, trace.expert_bytes)
    step_src = "--step-ms" if o.step_ms is not None else "a placeholder: calibrate with --calibrate BENCH.jsonl"
    line = (f"cost model: s/token = {step_ms:g} ms step ({step_src}) + (misses + uploads)/token x {mib:.2f} MiB / "
            f"{link / 1e9:.1f} GB/s (link: {src}); predicted t/s UNCALIBRATED")
    return cost, line


def what_if_policy(trace, o: ProfileOptions, probe):
    """The policy costs a run on this machine resolves (:func:`moecache.settings.policy_config`: the
    expert size, physical cores less one per GPU, the link; fixed values under
    ``MOECACHE_DETERMINISTIC=1``), fixed budget (a replay has no token times); the link of
    ``--link-gbps`` when given (no GPU is probed then)."""
    import dataclasses as dc
    import os

    from moecache.probe import Probe, host_info, startup_probe
    from moecache.settings import policy_config

    if probe is None:  # --link-gbps gives the link: the GPUs are not probed for it
        probe = Probe(host_info()) if o.link_gbps is not None else startup_probe()
    threads = max(1, probe.host.physical_cores - len(probe.gpus))
    det = os.environ.get("MOECACHE_DETERMINISTIC") == "1"
    cfg = policy_config(trace.expert_bytes, probe, window=None, deterministic=det, n_threads=threads, prompt_gpu=0)
    cfg = dc.replace(cfg, adaptive=False)
    if o.link_gbps is not None:
        cfg = dc.replace(cfg, t_upload=trace.expert_bytes / (o.link_gbps * 1e9))
    return cfg, probe


def vram_caches(model: Path, vram: list[int], settings, probe) -> list:
    """Per VRAM size, the expert cache ``run --vram-budget SIZE`` would get on this host
    (:func:`moecache.moe.profile.cache_at_vram`: the resolution and the placement)."""
    from moecache.gguf_file import open_gguf
    from moecache.moe.profile import cache_at_vram
    from moecache.probe import host_info
    from moecache.settings import model_facts

    host = probe.host if probe is not None else host_info()
    with open_gguf(resolve_model(model)) as g:
        facts = model_facts(g, settings.kv_type())
    if not facts.expert_each:
        raise UserError(f"--what-if-vram: {Path(model).name} has no routed experts")
    try:
        return [cache_at_vram(facts, v, settings, host) for v in vram]
    except ValueError as e:
        raise UserError(f"--what-if-vram: {e}") from None


def print_what_if(trace, budgets: list[int], o: ProfileOptions, probe, placed: list | None = None,
                  calibration: list[dict] | None = None) -> None:
    """The what-if table: per expert-cache size (``--what-if``, then the caches of ``placed``, the
    :class:`moecache.moe.profile.VramCache` of each ``--what-if-vram`` size), slots, hit rates
    (ours, LRU, best static) and the predicted t/s (calibrated with ``--calibrate``)."""
    from moecache.moe.profile import what_if

    if trace is None:
        raise UserError("--what-if needs a trace: prompts (-p/-f) or --trace-in FILE")
    if not trace.expert_bytes:
        raise UserError("--what-if: the expert size is unknown: give -m MODEL or --expert-mib N")
    if o.n_gen_warmup >= trace.n_tokens:
        raise UserError(f"--n-gen-warmup {o.n_gen_warmup}: the trace has {trace.n_tokens} tokens, none would be counted")
    cfg, probe = what_if_policy(trace, o, probe)
    cost, line = what_if_cost(trace, o, probe, calibration)
    warm = f", the first {o.n_gen_warmup} only fill the cache" if o.n_gen_warmup else ""
    print(f"what-if on {trace.n_tokens} tokens ({trace.n_layer} layers x {trace.n_expert} experts, "
          f"{trace.expert_bytes / 2**20:.2f} MiB each); every token replayed as one decode step{warm}")
    print(line)
    placed = placed or []
    n_given = len(budgets) - len(placed)
    if placed:
        print("VRAM: the expert cache run --vram-budget SIZE gets (the resolution and the placement, with the KV "
              "cache of the context it resolves; -c sets it)")
    print("| VRAM | -c | cache | slots | % of experts | hit rate (ours) | hit rate (LRU) | hit rate (best static) | "
          "misses/token | uploads/token | predicted t/s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    total = trace.n_layer * trace.n_expert
    for i, r in enumerate(what_if(trace, budgets, cost, cfg, warmup=o.n_gen_warmup)):
        v = placed[i - n_given] if i >= n_given else None
        if v is not None and not v.on_gpu:
            print(f"| {_size(v.vram_bytes)} | {v.n_ctx} | no layer fits: runs on the CPU | | | | | | | | |")
            continue
        if v is not None and v.fits:  # every expert resident: no misses, no uploads
            print(f"| {_size(v.vram_bytes)} | {v.n_ctx} | all experts fit | {total} | 100.0% | 100.0% | 100.0% | "
                  f"100.0% | 0.00 | 0.00 | {1.0 / cost.step_s:.1f} |")
            continue
        per = max(1, r.ours.tokens)
        where = f"| {_size(v.vram_bytes)} | {v.n_ctx} " if v is not None else "| | "
        print(f"{where}| {_size(r.budget_bytes)} | {r.n_slots} | {100 * r.n_slots / total:.1f}% | "
              f"{100 * r.ours.hit_rate:.1f}% | {100 * r.lru.hit_rate:.1f}% | {100 * r.static_hit_rate:.1f}% | "
              f"{r.ours.misses / per:.2f} | {r.ours.uploads / per:.2f} | {r.tokens_per_s:.1f} |")


def _size(b: int) -> str:
    for unit, s in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if b >= 1 << s:
            return f"{b / (1 << s):g}{unit}"
    return f"{b}B"


def write_plot(plt, path: Path, counts: np.ndarray, trace) -> None:
    """A PNG: the usage heatmap (layers x experts) and, with a trace, hit rate against cache size
    (our policy and per-layer LRU, by :func:`moecache.moe.profile.hit_rate_curve`)."""
    from moecache.moe.profile import hit_rate_curve

    n = 2 if trace is not None else 1
    fig, axes = plt.subplots(1, n, figsize=(6 * n + 1, 4.5), squeeze=False)
    ax = axes[0][0]
    share = counts / np.maximum(1, counts.sum(axis=1, keepdims=True))
    im = ax.imshow(share, aspect="auto", cmap="magma", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_title("share of each layer's routed pairs")
    fig.colorbar(im, ax=ax)
    if trace is not None:
        ax = axes[0][1]
        curve = hit_rate_curve(trace, CURVE_FRACTIONS)
        x = [100 * f for f, _, _ in curve]
        ax.plot(x, [100 * h for _, h, _ in curve], "o-", label="ours (moecache policy)")
        ax.plot(x, [100 * h for _, _, h in curve], "s--", label="per-layer LRU")
        ax.set_xlabel("cache size (% of all experts)")
        ax.set_ylabel("hit rate (%)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(f"hit rate vs cache size ({trace.n_tokens} tokens replayed)")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise UserError(f"--plot {path}: {e}") from None
    finally:
        plt.close(fig)
