"""``moecache probe-pcie``: the machine's GPUs, links, RAM and cores, measured (moecache.probe)."""

from __future__ import annotations

import json

import typer


def _gbs(v: float) -> str:
    return f"{v / 1e9:.1f}" if v else "-"


def probe_command(as_json: bool, size_mib: int, reps: int) -> None:
    """Measure and print: a rich table by default, one JSON object with ``--json``. Without a GPU
    or CuPy the host part is printed with the reason; the exit status is 0 either way."""
    from moecache.probe import GiB, full_probe

    if size_mib < 1 or reps < 1:
        raise ValueError(f"--size must be >= 1 MiB and --reps >= 1, got {size_mib} and {reps}")
    p = full_probe(size_mib << 20, reps)
    if as_json:
        typer.echo(json.dumps({**p.to_json(), "size_mib": size_mib, "reps": reps}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    con = Console()
    h = p.host
    t = Table(title=f"host (median of {reps} over {size_mib} MiB)")
    for col in ("CPU", "cores phys/log", "RAM GiB", "avail GiB", "read 1 thr GB/s", "read all GB/s"):
        t.add_column(col, justify="left" if col == "CPU" else "right")
    t.add_row(h.cpu_model, f"{h.physical_cores}/{h.logical_cores}", f"{h.ram_total / GiB:.1f}",
              f"{h.ram_available / GiB:.1f}", _gbs(h.ram_read_1t), _gbs(h.ram_read_all))
    con.print(t)
    if not p.gpus:
        from rich.markup import escape

        con.print(f"GPU: none usable ({escape(p.no_gpu_reason)})")
        return
    g = Table(title="GPUs (GB/s; D2D counts bytes read + written)")
    for col in ("#", "name", "cc", "PCIe", "VRAM free/total GiB", "H2D pin", "H2D page", "D2H pin", "D2H page", "D2D"):
        g.add_column(col, justify="left" if col in ("name", "PCIe") else "right")
    for gi in p.gpus:
        link = f"gen{gi.pcie_gen} x{gi.pcie_width} ({gi.pcie_source})" if gi.pcie_gen else f"unknown ({gi.pcie_source})"
        g.add_row(str(gi.index), gi.name, gi.compute_capability, link,
                  f"{gi.vram_free / GiB:.1f}/{gi.vram_total / GiB:.1f}", _gbs(gi.h2d_pinned), _gbs(gi.h2d_pageable),
                  _gbs(gi.d2h_pinned), _gbs(gi.d2h_pageable), _gbs(gi.d2d_copy))
    con.print(g)
