"""Process-wide thread settings a command applies before any OpenMP runtime loads.

:func:`short_openmp_spin` makes idle OpenMP (GNU libgomp) threads spin 10k rounds, not the default
300k, before they sleep. With the default, Numba's worker threads keep spinning after each parallel
kernel and starve the OpenBLAS threads of the next call: on 2 cores, gemma3-270m's prefill
(dequantize a weight tile, then sgemm) ran at 36 instead of ~100 t/s; fully passive threads
(``OMP_WAIT_POLICY=PASSIVE``) cost decode 15% instead. It changes the process environment, so the
commands (``moecache/cli/main.py``, ``bench/``) call it, not the library; a user's own setting wins. It has
no effect once an OpenMP runtime is loaded (``gguf`` may load one through sentencepiece: call it
first).

:func:`openmp_wait_for_args` chooses between that and active waiting from a command line: with
``--cpu-moe`` / ``--n-cpu-moe`` (``-cmoe`` / ``-ncmoe``) every decode step calls the CPU expert
kernel once per MoE layer, between two GPU stretches, and threads that went to sleep in between
cost ~0.3 ms per layer to wake (H200 machine, 16 threads, Qwen3-30B-A3B-shaped model, op by op,
``bench/cpu_moe_step.py``: the kernel 1046 -> 748 µs per layer, decode 80.3 -> 64.0 ms per token
with ``OMP_WAIT_POLICY=ACTIVE``). ``--miss-split`` calls it the same way (a share of each layer's
misses); before the twenty-seventh session it got the short spin, under which ``moecache bench
--miss-split`` lost 15% at 8 GiB uniform routing while ``bench/miss_split.py``, in libgomp's
default 300k-round spin, saw the split level with share 0 (bench/results/miss-split-h200.md). With
active waiting (twenty-eighth session, run h200-s28b) the split made -1% at uniform routing and -17%
at low-locality against the default: it still does not pay. ``--cache-plan layer`` (a share of some
layers' misses, by the layer plan) waits actively too.

``--cache-plan auto`` (the default) is decided only when the settings are resolved: the model and
the machine say whether it becomes "layer". So on a machine with the GPU stack a command line that
leaves it to auto sets nothing at start (:func:`openmp_wait_for_args` returns "deferred"), and the
command calls :func:`settle_openmp_wait` with the resolved values before the engine loads: Numba
starts its OpenMP runtime at the first parallel kernel, which the load runs, and libgomp reads the
environment once, when it loads (:func:`openmp_runtime_loaded` checks that it has not). Only the
commands that load a model defer (:data:`DEFERRING_COMMANDS`); the others get the short spin at once.

Active waiting here is ``OMP_WAIT_POLICY=ACTIVE`` with ``GOMP_SPINCOUNT`` :data:`ACTIVE_SPINCOUNT`
(libgomp's ``initialize_env``: a given spin count replaces ACTIVE's own of 3e10 rounds, minutes;
``KMP_BLOCKTIME`` 300 ms bounds LLVM's and Intel's runtimes the same way): a decode step's gaps between CPU layers are
micro- to milliseconds, while an interactive chat waiting for its user would otherwise keep every
Numba thread at 100% of a core. On the development VM the idle workers stopped spinning ~0.3 s after
the last parallel call with it (2 s of CPU in 2 s idle with libgomp's count); gaps of 2 ms between
calls kept them busy-waiting either way. Not yet measured on the H200.
"""

from __future__ import annotations

import os

SPINCOUNT = "10000"
ACTIVE_SPINCOUNT = "30000000"  # spin rounds before an idle thread sleeps: ~0.3 s on the development VM (libgomp guesses ~100k a ms)
DEFERRING_COMMANDS = ("run", "bench", "serve", "perplexity", "profile")  # they resolve settings and load a model


def short_openmp_spin() -> None:
    """Set ``GOMP_SPINCOUNT`` unless ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` is already set."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", SPINCOUNT)


def waits_actively(environ=None) -> bool:
    """Whether this process's OpenMP threads wait actively (``OMP_WAIT_POLICY=ACTIVE``: set by
    :func:`openmp_wait_for_args`, or the user's), by ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    return env.get("OMP_WAIT_POLICY", "").strip().upper() == "ACTIVE"


def wait_chosen() -> bool:
    """``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is set (the user's, or a choice made already):
    nothing here changes it; neither set means the command line deferred it
    (:func:`openmp_wait_for_args`)."""
    return "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ


def one_thread_if_active() -> None:
    """For a helper thread that calls Numba's parallel kernels beside the main thread's (the routing
    process's draws ahead): run them on this thread alone while OpenMP waits actively.

    GNU OpenMP gives each thread that opens a parallel region its own team, and the helper's team
    stays alive with the helper. Measured on the development VM (2 cores, 2 Numba threads,
    ``OMP_WAIT_POLICY=ACTIVE``): once a helper thread's 2-thread team existed, the main team's
    worker stopped spinning between calls (the idle process's CPU time fell from 1.0 to 0.0 s per
    second, so it slept and had to be woken for every call); with the helper at one thread it kept
    spinning. Decode with CPU experts calls the kernel once per layer and relies on that spin
    (``openmp_wait_for_args``: ~0.3 ms per layer to wake sleeping threads on the H200). Not measured
    on the H200, where the evidence of a slower decode after a ``--routing`` prompt is mixed
    (``bench/results/static-h200-s28.md``). Call it in the helper thread (Numba's thread count is per
    thread)."""
    if waits_actively():
        from numba import set_num_threads

        set_num_threads(1)


def bind_numba_threads(n: int) -> None:
    """Make ``n`` the calling thread's Numba thread count (the threads its parallel kernels run on).

    Numba keeps that count per thread: ``numba.set_num_threads`` sets it for the calling thread
    only, and a thread that never set it runs on ``NUMBA_NUM_THREADS`` (all CPUs). An engine
    loaded on one thread and used from another (``serve`` loads on a thread, its engine thread
    decodes; a library user's own threads) would run its CPU kernels on every CPU, whatever ``-t``
    says; the engine's entry points call this. The count stays set on the calling thread
    afterwards (its own Numba work then runs at the engine's ``-t`` too). Costs one
    ``numba.get_num_threads`` call (~0.7 µs on the development VM) when the count is right."""
    import numba

    if numba.get_num_threads() != n:
        numba.set_num_threads(n)


def _values(argv: list[str], names: tuple[str, ...], attached: str | None = None) -> list[str]:
    """The values given to the flags ``names`` (``-x V``, ``-x=V``; ``attached``: also ``-xV`` with V
    digits and commas), in command-line order."""
    out = []
    for i, a in enumerate(argv):
        name, eq, val = a.partition("=")
        if name in names:
            out.append(val if eq else (argv[i + 1] if i + 1 < len(argv) else ""))
        elif attached is not None and a.startswith(attached) and len(a) > len(attached) \
                and all(c.isdigit() or c == "," for c in a[len(attached):]):
            out.append(a[len(attached):])
    return out


def _ints(v: str) -> list[int] | None:
    """A value or comma list (``bench``'s ``-t 8,16``) as ints; None if any part is not one."""
    try:
        return [int(p) for p in v.split(",")]
    except ValueError:
        return None


def experts_on_cpu(argv: list[str]) -> bool:
    """True if ``argv`` asks for routed experts on the CPU in every decode step: ``--cpu-moe``/``-cmoe``,
    ``--n-cpu-moe``/``-ncmoe`` with a value other than 0 (the last one given; a list: any of it), or
    ``--miss-split`` (the expert cache hands a share of each layer's misses to the CPU) or
    ``--cache-plan layer`` (the layer plan hands a share of some layers' misses to it; the last
    ``--cache-plan`` given)."""
    plans = _values(argv, ("--cache-plan",))
    if any(a in ("--cpu-moe", "-cmoe", "--miss-split") for a in argv) or (plans and plans[-1] == "layer"):
        return True
    vals = _values(argv, ("--n-cpu-moe", "-ncmoe"))
    n = _ints(vals[-1]) if vals else None
    return bool(n) and any(v != 0 for v in n)


def threads_flag(argv: list[str]) -> int | None:
    """The largest ``-t``/``--threads`` of ``argv`` (the last one given; ``-t N``, ``-t=N``, ``-tN``,
    a list ``8,16``: its largest); None if absent, 0 (physical cores) or not numbers (the command
    reports a bad value itself)."""
    vals = _values(argv, ("-t", "--threads"), attached="-t")
    n = _ints(vals[-1]) if vals else None
    if not n or 0 in n:
        return None
    return max(n)


def _set_active() -> None:
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    os.environ["GOMP_SPINCOUNT"] = ACTIVE_SPINCOUNT
    os.environ.setdefault("KMP_BLOCKTIME", "300")  # the same bound (ms) for LLVM's and Intel's runtimes


def _command(argv: list[str]) -> str | None:
    """The subcommand of ``argv`` (its first word that is not a flag), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def plan_undecided(argv: list[str]) -> bool:
    """True if ``argv`` leaves ``--cache-plan`` to auto (not given, or the last one given is auto)."""
    plans = _values(argv, ("--cache-plan",))
    return not plans or plans[-1] == "auto"


def openmp_runtime_loaded(maps: str | None = None) -> bool:
    """Whether an OpenMP runtime (libgomp, LLVM's libomp, Intel's libiomp) is mapped into this
    process (``maps``: the text of ``/proc/self/maps``; read when None; False where it cannot be
    read, i.e. not Linux)."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return False
    return any(name in maps for name in ("libgomp", "libomp", "libiomp"))


def settle_openmp_wait(active: bool, n_threads: int, n_cpus: int | None = None, maps: str | None = None) -> str:
    """The wait policy of a command line whose choice :func:`openmp_wait_for_args` deferred, from
    the resolved settings: active waiting when ``active`` (CPU experts or a layer plan) and
    ``n_threads`` leaves a core free (below ``n_cpus``, default the CPUs this process may run on),
    else the short spin. Nothing changes when ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is already
    set (the user's, or the command line's own choice at start) or when an OpenMP runtime is
    already loaded (``maps``: see :func:`openmp_runtime_loaded`).

    Returns "active", "short spin", "no free core" (active waiting was wanted, but ``n_threads``
    takes every CPU: the short spin), "set before" or "too late" (the runtime keeps its defaults);
    the caller says so for the last two that concern it."""
    if wait_chosen():
        return "set before"
    if openmp_runtime_loaded(maps):
        return "too late"
    free = n_threads < (n_cpus or usable_cpus())
    if active and free:
        _set_active()
        return "active"
    short_openmp_spin()
    return "no free core" if active else "short spin"


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def openmp_wait_for_args(argv: list[str], n_cpus: int | None = None, gpu_stack: bool | None = None) -> str:
    """Set the OpenMP wait policy a command line needs (a user's own ``OMP_WAIT_POLICY`` or
    ``GOMP_SPINCOUNT`` wins): active waiting when :func:`experts_on_cpu`, the GPU stack is installed
    (``gpu_stack``; default: CuPy importable) and Numba's threads leave a core free, else the short
    spin of :func:`short_openmp_spin`.

    A free core: without ``-t`` the commands resolve it to the physical cores minus one per GPU
    when experts run on the CPU (moecache/settings.py); an explicit ``-t`` must be below ``n_cpus``
    (default: the CPUs this process may run on). On the H200 machine, 16 threads on 16 cores with
    active waiting and the cut decode graph took 234 ms/token, against 58 with ``-t 15`` (run
    ``h200-20261201c``) and 64 op by op at 16 threads; the cause was not isolated, so active
    waiting is only chosen where a core stays free. Without a GPU the flags change nothing and
    spinning workers would starve OpenBLAS (above).

    With the GPU stack, ``--cache-plan`` left to auto (:func:`plan_undecided`), a command that loads
    a model (:data:`DEFERRING_COMMANDS`) and no ``-t`` at or above ``n_cpus``, nothing is set: the
    command decides once the settings are resolved (:func:`settle_openmp_wait`).

    Returns what the process now has, for the log: "active", "short spin", "deferred" or "user's"."""
    if wait_chosen():
        return "user's"
    if gpu_stack is None:
        import importlib.util

        gpu_stack = importlib.util.find_spec("cupy") is not None
    t = threads_flag(argv)
    free_core = t is None or t < (n_cpus or usable_cpus())
    if experts_on_cpu(argv) and gpu_stack and free_core:
        _set_active()
        return "active"
    if gpu_stack and free_core and plan_undecided(argv) and _command(argv) in DEFERRING_COMMANDS:
        return "deferred"
    short_openmp_spin()
    return "short spin"
