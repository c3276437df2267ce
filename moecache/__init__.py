"""moecache: run Mixture-of-Experts GGUF models larger than GPU memory.

Layout (../shared/design.md): ``gguf_file`` and ``arch`` read and validate GGUF files;
``quants`` holds the block-format table and the Numba CPU kernels; ``testing`` the synthetic GGUF
writer and a float64 reference forward pass used by the tests.
"""

__version__ = "0.1.0"
