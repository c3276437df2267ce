"""moecache: run Mixture-of-Experts GGUF models larger than GPU memory.

Layout (../shared/design.md): ``gguf_file`` and ``arch`` read and validate GGUF files;
``quants`` holds the block-format table and the Numba CPU kernels; ``backends`` the array
operations the models use; ``models`` one file per architecture; ``moe`` expert execution;
``settings`` the requested settings and their resolution; ``llm`` the library entry point
(:func:`load`); ``kv_cache``, ``tokenizer``, ``chat``, ``sampling`` and ``engine`` what generation
needs; ``cli`` the ``moecache`` command; ``testing`` synthetic GGUFs and independent references
for the tests.

    import moecache
    with moecache.load("model.gguf", n_ctx=256, n_threads=2) as llm:
        print(llm.complete("def add(a, b):", n_predict=8, temperature=0).text)
"""

__version__ = "0.1.0"


def load(path, log=None, **settings):
    """:func:`moecache.llm.load` (imported on first use: ``import moecache`` stays light)."""
    from moecache.llm import load as _load

    return _load(path, log, **settings)
