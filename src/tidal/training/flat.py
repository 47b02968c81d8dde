"""Flat parameter and gradient vectors of a module, so weights travel as one contiguous buffer.

In: an ``nn.Module``. Out: a ``ParamLayout`` (names, shapes, offsets: the wire format every
transport and the satellite agree on) that copies parameters or gradients into one flat float32
tensor and back, in place. Keeps: the layout is derived from ``named_parameters`` order and is
checked by a fingerprint on both ends, so a satellite never loads a buffer of another model.
A flat vector may live on another device than the module (CPU for transports, the model's
device for gradient sums); copies in and out cross devices and cast dtypes as needed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn

from tidal.errors import TidalError


class LayoutMismatch(TidalError):
    """A flat buffer whose layout fingerprint differs from the local model's."""


@dataclass(frozen=True)
class ParamLayout:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int

    @classmethod
    def of(cls, module: nn.Module) -> ParamLayout:
        names, shapes, offsets, pos = [], [], [], 0
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            names.append(name)
            shapes.append(tuple(p.shape))
            offsets.append(pos)
            pos += p.numel()
        return cls(tuple(names), tuple(shapes), tuple(offsets), pos)

    @property
    def nbytes(self) -> int:
        return self.numel * 4

    def fingerprint(self) -> str:
        text = ";".join(f"{n}:{s}" for n, s in zip(self.names, self.shapes, strict=True))
        return hashlib.sha1(text.encode()).hexdigest()[:16]

    def params(self, module: nn.Module) -> list[nn.Parameter]:
        """The module's parameters in layout order."""
        named = dict(module.named_parameters())
        return [named[n] for n in self.names]

    _params = params

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Name -> view into ``flat`` with the parameter's shape (no copy)."""
        out = {}
        for name, shape, off in zip(self.names, self.shapes, self.offsets, strict=True):
            n = 1
            for d in shape:
                n *= d
            out[name] = flat[off : off + n].view(shape)
        return out

    def bind(self, module: nn.Module, flat: torch.Tensor | None = None) -> torch.Tensor:
        """Make the parameters views into one flat float32 vector and return it: ``flat`` (its
        values loaded into the parameters: a model moved to another device) or a new one on
        the parameters' device holding their values. Then a pull into the vector is a load,
        and the vector is the snapshot: no second copy of the weights exists."""
        params = self._params(module)
        if flat is None:
            flat = torch.empty(self.numel, dtype=torch.float32, device=params[0].device)
            self.params_to_flat(module, flat)
        if flat.numel() != self.numel:
            raise LayoutMismatch(f"flat buffer has {flat.numel()} values, model {self.numel}")
        for p, view in zip(params, self.views(flat).values(), strict=True):
            if p.dtype != torch.float32:
                raise LayoutMismatch(f"parameter of dtype {p.dtype}: only float32 binds")
            p.data = view
        return flat

    def is_bound(self, module: nn.Module, flat: torch.Tensor) -> bool:
        """Every parameter is still the view of ``flat`` that ``bind`` made."""
        base = flat.untyped_storage().data_ptr()
        return all(p.untyped_storage().data_ptr() == base for p in self._params(module))

    def params_to_flat(self, module: nn.Module, out: torch.Tensor | None = None) -> torch.Tensor:
        """Parameters into ``out`` (default: a new CPU float32 vector, what transports send)."""
        if out is None:
            out = torch.empty(self.numel, dtype=torch.float32)
        with torch.no_grad():
            for p, off in zip(self._params(module), self.offsets, strict=True):
                out[off : off + p.numel()].copy_(p.detach().reshape(-1))
        return out

    def flat_to_params_(self, module: nn.Module, flat: torch.Tensor) -> None:
        if flat.numel() != self.numel:
            raise LayoutMismatch(f"flat buffer has {flat.numel()} values, model {self.numel}")
        with torch.no_grad():
            for p, off in zip(self._params(module), self.offsets, strict=True):
                p.copy_(flat[off : off + p.numel()].view_as(p))

    def grads_to_flat(self, module: nn.Module, out: torch.Tensor) -> torch.Tensor:
        """Copy ``.grad`` into ``out`` (a parameter without gradient contributes zeros)."""
        for p, off in zip(self._params(module), self.offsets, strict=True):
            seg = out[off : off + p.numel()]
            if p.grad is None:
                seg.zero_()
            else:
                seg.copy_(p.grad.reshape(-1))
        return out

    def flat_to_grads_(self, module: nn.Module, flat: torch.Tensor) -> None:
        """``flat`` as the gradients: views of it where device and dtype match (no copy; the
        caller keeps ``flat`` unchanged until the optimizer stepped), else copies."""
        for p, off in zip(self._params(module), self.offsets, strict=True):
            g = flat[off : off + p.numel()].view_as(p)
            if g.device == p.device and g.dtype == p.dtype:
                p.grad = g
            elif p.grad is None:
                p.grad = g.to(device=p.device, dtype=p.dtype, copy=True)
            else:
                p.grad.copy_(g)
