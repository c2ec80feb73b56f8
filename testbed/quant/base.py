"""The `Packed` contract and the quantizer registry.

A `Packed` holds every stored byte of a quantized tensor as named arrays (codes, scales,
zero-points, float32 windows, the 16-byte ``header`` with (N, D) as two int64). ``nbytes`` is the
sum of those arrays' ``nbytes`` and nothing else: there is no hidden state that a real cache
would have to store and the accounting would miss. Leading dimensions (heads) are metadata of the
model, recorded in ``shape`` but not in the payload.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..case import validate_tensor

__all__ = ["Packed", "Quantizer", "register", "get", "names", "kinds", "from_config", "make_header", "check_input"]


def make_header(n: int, d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The header (``constants.HEADER_BYTES``, 16 bytes): (N tokens, D features) as two little-endian int64."""
    return torch.tensor([n, d], dtype=torch.int64, device=device)


def check_input(x: torch.Tensor, name: str, *, finite: bool = True) -> torch.Tensor:
    """Shared input rules for every scheme: finite, non-empty, floating, at least [T, D].

    ``finite=False`` is for fused kernels that flag non-finite values in their own pass and call
    again with the default to raise the error naming the first bad index."""
    return validate_tensor(x, name, min_rank=2, finite=finite)


@dataclass
class Packed:
    """A quantized tensor: ``tensors`` are the stored payload (torch, on the input's device)."""

    scheme: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tensors: dict[str, torch.Tensor]
    config: dict = field(default_factory=dict)

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """Every stored byte as numpy arrays (zero-copy for CPU tensors)."""
        return {k: t.detach().cpu().numpy() for k, t in self.tensors.items()}

    @property
    def nbytes(self) -> int:
        return int(sum(t.numel() * t.element_size() for t in self.tensors.values()))


class Quantizer:
    """Base class: ``quantize(x) -> Packed`` and ``dequantize(Packed) -> x_hat``."""

    name: str = "abstract"

    def quantize(self, x: torch.Tensor, *, name: str = "x") -> Packed:
        """Quantize ``x [..., T, D]``: a scheme's fused kernel (``_quantize_fast``) serves large CPU
        tensors and must equal ``quantize_reference`` bit for bit; everything else takes the reference."""
        from . import kernels

        if hasattr(self, "_quantize_fast") and kernels.use_fast(x):
            return self._quantize_fast(x, name)
        return self.quantize_reference(x, name=name)

    def quantize_reference(self, x: torch.Tensor, *, name: str = "x") -> Packed:  # pragma: no cover - interface
        raise NotImplementedError

    def dequantize(self, p: Packed) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def config(self) -> dict:
        """JSON-serializable parameters; ``from_config(q.config())`` rebuilds the quantizer. A
        scheme is a frozen dataclass of its parameters (validated in ``__post_init__``): the
        config is ``{"kind": KIND, field: value, ...}`` in field order, and the repr is the
        dataclass's, so neither is written by hand."""
        if not dataclasses.is_dataclass(self):  # pragma: no cover - every registered scheme is one
            raise NotImplementedError
        return {"kind": self.KIND, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    @property
    def label(self) -> str:
        """The scheme's label in rows (the residual window's ``scheme``: its bits or element and its
        group or block, never the layout's axis), a property of each registered kind. There is no
        fallback: a kind without one raises rather than label its rows with the bare kind."""
        kind = getattr(self, "KIND", type(self).__name__)
        raise NotImplementedError(f"quantizer kind {kind!r} defines no label: give {type(self).__name__} a "
                                  "`label` property (and the audit its own in audit_checks/schemes.py, SCHEMES)")

    def _check_packed(self, p: Packed) -> None:
        if p.scheme != self.name:
            raise ValueError(f"{self.name}: cannot dequantize a Packed of scheme {p.scheme!r}")


_REGISTRY: dict[str, Callable[..., Quantizer]] = {}
_KINDS: dict[str, Callable[..., Quantizer]] = {}


def register(name: str, factory: Callable[[], Quantizer]) -> None:
    """Register a fully parametrized scheme under a stable name (used by the property matrix)."""
    if name in _REGISTRY:
        raise ValueError(f"scheme {name!r} registered twice")
    _REGISTRY[name] = factory


def register_kind(kind: str, cls: Callable[..., Quantizer]) -> None:
    """Register a quantizer class so that ``from_config`` can rebuild it from its config."""
    if kind in _KINDS and _KINDS[kind] is not cls:
        raise ValueError(f"quantizer kind {kind!r} registered twice")
    _KINDS[kind] = cls


def get(name: str) -> Quantizer:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown scheme {name!r}; registered: {', '.join(sorted(_REGISTRY))}") from None


def names() -> list[str]:
    return sorted(_REGISTRY)


def kinds() -> list[str]:
    """Every quantizer kind ``from_config`` knows (a config's ``"kind"``)."""
    return sorted(_KINDS)


def from_config(config: dict) -> Quantizer:
    cfg = dict(config)
    kind = cfg.pop("kind", None)
    if kind not in _KINDS:
        raise ValueError(f"unknown quantizer kind {kind!r}; known: {', '.join(sorted(_KINDS))}")
    return _KINDS[kind](**cfg)
