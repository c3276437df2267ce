"""``moecache info``: validate a GGUF and print what the engine will see."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table


def show_info(path: Path, list_tensors: bool) -> None:
    """Open and validate ``path`` (raises GGUFError & co.), then print a summary on stdout."""
    from moecache.gguf_file import open_gguf
    from moecache.sizes import format_size

    out = Console(soft_wrap=True)  # no hard wraps at 80 columns when piped
    with open_gguf(path) as m:
        c = m.config
        out.print(f"[bold]{m.path.name}[/bold]: GGUF v{m.version}, {len(m.paths)} file(s), "
                  f"{format_size(m.n_bytes)} of tensors, architecture [bold]{m.arch}[/bold]")
        hp = Table("key", "value", title="hyperparameters", show_lines=False)
        for f in dataclasses.fields(c):
            v = getattr(c, f.name)
            if v is not None:
                hp.add_row(f.name, str(v))
        out.print(hp)
        tok = m.tokenizer
        out.print(f"tokenizer: model={tok.model} pre={tok.pre} n_tokens={tok.n_tokens} "
                  f"bos={tok.bos_id} eos={tok.eos_id} chat_template={'yes' if tok.chat_template else 'no'}")
        types = Counter()
        for t in m.tensors.values():
            types[t.type_name] += t.n_bytes
        out.print("tensor bytes by type: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in types.most_common()))
        if c.is_moe:
            exp = sum(t.n_bytes for n, t in m.tensors.items() if "_exps" in n)
            out.print(f"experts: {format_size(exp)} ({100 * exp / max(1, m.n_bytes):.0f}% of the model), "
                      f"{format_size(exp / max(1, c.n_layer * c.n_expert))} per expert")
        if m.tied_output:
            out.print("output: tied to token_embd")
        if list_tensors:
            tt = Table("name", "type", "shape", "MiB")
            for t in m.tensors.values():
                tt.add_row(t.name, t.type_name, str(t.shape), f"{t.n_bytes / 2**20:.2f}")
            out.print(tt)
