"""moecache command-line interface (Typer). Thin: parse flags, call the library, print."""
