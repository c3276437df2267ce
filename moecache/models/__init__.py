"""Model architectures, one file each, and :func:`build_model` that picks the class for a GGUF.

Adding an architecture: a row in :data:`moecache.arch.ARCHS` (keys and tensors), a file here with a
:class:`~moecache.models.base.DecoderLM` subclass, an entry in :func:`model_class`, and tests.
"""

from __future__ import annotations

from typing import Any

from moecache.errors import UnsupportedArchError
from moecache.gguf_file import GGUFModel
from moecache.models.base import DecoderLM
from moecache.models.gemma3 import Gemma3
from moecache.models.llama import Llama
from moecache.models.mixtral import Mixtral
from moecache.models.olmoe import Olmoe
from moecache.models.qwen2moe import Qwen2Moe
from moecache.models.qwen3 import Qwen3
from moecache.models.qwen3moe import Qwen3Moe
from moecache.moe.executor import ExpertExecutor

CLASSES: dict[str, type[DecoderLM]] = {
    "qwen3moe": Qwen3Moe, "qwen2moe": Qwen2Moe, "olmoe": Olmoe, "llama": Llama, "qwen3": Qwen3, "gemma3": Gemma3,
}


def model_class(model: GGUFModel) -> type[DecoderLM]:
    """The class for ``model``'s architecture (``llama`` with experts is Mixtral).

    Raises UnsupportedArchError naming the supported architectures.
    """
    arch = model.config.arch
    if arch == "llama" and model.config.n_expert > 0:
        return Mixtral
    if arch not in CLASSES:
        raise UnsupportedArchError(f"no forward pass for architecture '{arch}' "
                                   f"(supported: {', '.join(sorted(CLASSES))})")
    return CLASSES[arch]


def build_model(model: GGUFModel, backend: Any, experts: ExpertExecutor | None = None,
                layer_backends: list[Any] | None = None, output_backend: Any = None, *, pass_hooks: Any = (),
                routing_override: Any = None) -> DecoderLM:
    """The forward pass of ``model`` on ``backend`` (see :class:`DecoderLM` for the arguments)."""
    return model_class(model)(model, backend, experts, layer_backends, output_backend, pass_hooks=pass_hooks,
                              routing_override=routing_override)


__all__ = ["CLASSES", "DecoderLM", "build_model", "model_class"]
