"""The GPU side of the host handoff (:mod:`moecache.moe.handoff`): page-locked buffers and the two
kernel launches a captured decode step makes per handed-over layer."""

from __future__ import annotations

from typing import Any

import cupy as cp
import cupyx
import numpy as np

from moecache.moe.handoff import HandoffBuffers, check_request

NULL = np.uint64(0)
GPU_TIMEOUT_NS = 30_000_000_000  # the GPU's wait for an answer (the host's own timeout is the same 30 s)
POST_THREADS = 512


class CudaHandoff:
    """One handoff on ``be`` (a CupyBackend): buffers for ``n_layer`` layers, up to ``max_tok``
    tokens of ``n_embd`` floats and ``k`` routed experts each. The host pointers are passed to the
    kernels as they are (unified addressing: page-locked memory is readable from the GPU)."""

    def __init__(self, be: Any, n_layer: int, max_tok: int, n_embd: int, k: int):
        self.be, self.max_tok, self.n_embd, self.k = be, max_tok, n_embd, k
        self.buf = HandoffBuffers.allocate(n_layer, max_tok, n_embd, k, cupyx.empty_pinned)
        with cp.cuda.Device(be.device):
            self.seq = cp.zeros(1, cp.int64)  # the pass number, copied from buf.go before a launch
            self.dcount = cp.zeros(n_layer, cp.int32)
        self._p = {name: np.uint64(getattr(self.buf, name).ctypes.data)
                   for name in ("flag", "done", "count", "n_tok", "n_miss", "wait_ns", "h", "ids", "w", "out",
                                "err")}

    inline = False  # the GPU posts and waits; a host thread answers (moecache.moe.handoff.serve)

    def go(self, seq: int, stream: cp.cuda.Stream | None = None) -> None:
        """Set the pass number the next launch posts (queued on ``stream``, default the current one,
        before the launch)."""
        self.buf.go[0] = seq  # the previous copy from it finished: the last pass ended in a sync
        stream = stream if stream is not None else cp.cuda.get_current_stream()
        rt = cp.cuda.runtime
        rt.memcpyAsync(self.seq.data.ptr, self.buf.go.ctypes.data, 8, rt.memcpyHostToDevice, stream.ptr)

    def post(self, il: int, h: cp.ndarray, ids: cp.ndarray, w: cp.ndarray, slot_map: cp.ndarray | None = None,
             ncpu: cp.ndarray | None = None) -> cp.ndarray | None:
        """Queue layer ``il``'s request: ``h`` float32 (T, n_embd), ``ids`` int32 and ``w`` float32
        (T, k) on this GPU. Without ``slot_map`` every pair is the CPU's; with it (int32 (n_expert,),
        -1 = not in VRAM) and ``ncpu`` (int32 (n_layer,)) the CPU takes up to ``ncpu[il]`` misses of
        each token and the GPU's pairs come back as ids (T, k), -1 for the CPU's."""
        check_request(self.max_tok, self.n_embd, self.k, h.shape, ids.shape, slot_map, ncpu)
        t = h.shape[0]
        h = cp.ascontiguousarray(h, dtype=cp.float32)
        ids = cp.ascontiguousarray(ids, dtype=cp.int32)
        w = cp.ascontiguousarray(w, dtype=cp.float32)
        gids = cp.empty_like(ids) if slot_map is not None else None
        p = self._p
        self.be._fn("handoff_post")(
            (1,), (POST_THREADS,),
            (h, ids, w, slot_map if slot_map is not None else NULL, ncpu if ncpu is not None else NULL,
             np.int32(il), np.int32(t), np.int32(self.k), np.int64(self.n_embd), self.seq, p["h"], p["ids"],
             p["w"], gids if gids is not None else NULL, p["flag"], p["count"], p["n_tok"], p["n_miss"],
             self.dcount))
        return gids

    def wait(self, il: int, out: cp.ndarray, add: bool) -> cp.ndarray:
        """Queue the wait for layer ``il``'s answer: ``out`` float32 (T, n_embd), C-contiguous, gets
        the CPU's sum (``add``: added to it). Returns ``out``."""
        self.be._fn("handoff_wait")(
            (1,), (1024,),
            (self._p["done"], self.dcount, np.int32(il), self.seq, self._p["out"], out, np.int64(out.size),
             np.int32(bool(add)), np.int64(GPU_TIMEOUT_NS), self._p["err"], self._p["wait_ns"]))
        return out
