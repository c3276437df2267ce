"""moecache: run Mixture-of-Experts GGUF models larger than GPU memory.

Layout (../shared/design.md): ``gguf_file`` and ``arch`` read and validate GGUF files;
``quants`` holds the block-format table and the Numba CPU kernels; ``backends`` the array
operations the models use; ``models`` one file per architecture; ``moe`` expert execution;
``kv_cache``, ``tokenizer``, ``chat``, ``sampling`` and ``engine`` what generation needs;
``testing`` synthetic GGUFs and independent references for the tests.
"""

__version__ = "0.1.0"
