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
kernel once per MoE layer, between two GPU stretches of ~0.4 ms, and threads that went to sleep in
between cost ~0.3 ms per layer to wake (H200 machine, 16 threads, Qwen3-30B-A3B-shaped model,
``bench/cpu_moe_step.py``: the kernel 1046 -> 748 µs per layer, decode 80.3 -> 64.0 ms per token
with ``OMP_WAIT_POLICY=ACTIVE``).
"""

from __future__ import annotations

import os

SPINCOUNT = "10000"


def short_openmp_spin() -> None:
    """Set ``GOMP_SPINCOUNT`` unless ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` is already set."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", SPINCOUNT)


# Flags that put routed experts on the CPU for every decode step (llama.cpp's names).
CPU_EXPERT_FLAGS = ("--cpu-moe", "-cmoe", "--n-cpu-moe", "-ncmoe")


def experts_on_cpu(argv: list[str]) -> bool:
    """True if ``argv`` asks for routed experts on the CPU: ``--cpu-moe``/``-cmoe``, or
    ``--n-cpu-moe``/``-ncmoe`` with a value other than 0 (``-ncmoe N`` or ``-ncmoe=N``)."""
    for i, a in enumerate(argv):
        name, eq, val = a.partition("=")
        if name in ("--cpu-moe", "-cmoe"):
            return True
        if name in ("--n-cpu-moe", "-ncmoe"):
            v = val if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if v.strip() not in ("", "0"):
                return True
    return False


def threads_flag(argv: list[str]) -> int | None:
    """The value of ``-t``/``--threads`` in ``argv`` (``-t N``, ``-t=N``), None if absent or not a
    number (the command reports a bad value itself)."""
    for i, a in enumerate(argv):
        name, eq, val = a.partition("=")
        if name in ("-t", "--threads"):
            v = val if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            try:
                return int(v)
            except ValueError:
                return None
    return None


def openmp_wait_for_args(argv: list[str], n_cpus: int | None = None) -> str:
    """Set the OpenMP wait policy a command line needs (a user's own ``OMP_WAIT_POLICY`` or
    ``GOMP_SPINCOUNT`` wins): active waiting when :func:`experts_on_cpu` and a core stays free of
    Numba's threads, else the short spin of :func:`short_openmp_spin`.

    Active waiting needs that free core: the main thread busy-waits on the GPU between two CPU
    kernels while the workers spin, and one thread more than there are cores made every MoE layer
    wait out a scheduler time slice (H200 machine, 16 threads on 16 cores: 4.7 ms per layer instead
    of ~0.75). The commands resolve ``-t`` to the physical cores minus one per GPU
    (moecache/settings.py); an explicit ``-t`` of ``n_cpus`` (default ``os.cpu_count()``) or more
    keeps the short spin.

    Returns what the process now has, for the log: "active", "short spin" or "user's"."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return "user's"
    t = threads_flag(argv)
    if experts_on_cpu(argv) and (t is None or 0 < t < (n_cpus or os.cpu_count() or 1)):
        os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
        return "active"
    short_openmp_spin()
    return "short spin"
