"""Backends: the array operations the model code is written against.

:class:`~moecache.backends.numpy_backend.NumpyBackend` is the CPU implementation (numpy + the Numba
quant kernels), used everywhere in CI; the GPU backend implements the same methods on CuPy.
The model files (``moecache/models/``) call only these methods plus arithmetic operators that numpy
and CuPy arrays share, so one forward pass serves both. The methods are declared in
:mod:`moecache.backends.contract` (``ArrayBackend``, and ``SlotBackend`` for the expert cache).
"""

from moecache.backends.numpy_backend import Linear, NumpyBackend

__all__ = ["Linear", "NumpyBackend"]
