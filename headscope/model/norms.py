"""A norm as the maps attribution reads it: frozen (its scale held at the rows it was given: a linear map), its full
Jacobian carried back (`FrozenNorm.back`, `norm_back`), and its Jacobian forward (`norm_jvp`). LayerNorm's
g (x - mean x) / sigma and an RMS norm's g x / rms (g or 1 + w, whichever reproduces the module) are known by form,
checked against the module's own output; any other norm is run again."""

from __future__ import annotations

import torch

from headscope.errors import ModelLoadError

# Relative error up to which a linearised norm must reproduce the model's own (float32 rounding of a norm).
NORM_CHECK = 1e-4


def through(norm: torch.nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    """norm(x), or x where there is no norm."""
    return x if norm is None else norm(x)


class FrozenNorm:
    """A norm as a linear map, its scale frozen at the rows it was given: LayerNorm's g (x - mean x) / sigma or an
    RMS norm's g x / rms (g or 1 + w, whichever reproduces the module), its bias kept apart; and its full Jacobian
    there, transposed (`back`)."""

    @classmethod
    def found(cls, norm: torch.nn.Module, residual: torch.Tensor) -> FrozenNorm | None:
        """The norm at every row of `residual` (its form told by the first row, its scale kept in float32 for
        `back`), or None for a norm of neither form."""
        first = residual.detach()[:1]
        with torch.no_grad():
            try:
                frozen = cls(norm, first, norm(first))
            except ModelLoadError:
                return None
        frozen.x = residual.detach().float()
        if frozen.centre:
            frozen.x = frozen.x - frozen.x.mean(-1, keepdim=True)
        frozen.scale = frozen.x.square().mean(-1, keepdim=True).add(frozen.eps).rsqrt()
        return frozen

    def __init__(self, norm: torch.nn.Module, residual: torch.Tensor, output: torch.Tensor) -> None:
        x = residual.detach().double()
        want = output.detach().double()
        weight = getattr(norm, "weight", None)
        bias = getattr(norm, "bias", None)
        self.eps = eps = float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))
        w = torch.ones(x.shape[-1], dtype=torch.float64) if weight is None else weight.detach().double().cpu()
        w = w.to(x.device)
        b = torch.zeros_like(w) if bias is None else bias.detach().double().to(x.device)
        centred = x - x.mean(-1, keepdim=True)
        candidates = {
            "layer": (True, w, centred.square().mean(-1, keepdim=True).add(eps).rsqrt()),
            "rms": (False, w, x.square().mean(-1, keepdim=True).add(eps).rsqrt()),
            "rms 1 + w": (False, 1 + w, x.square().mean(-1, keepdim=True).add(eps).rsqrt()),
        }
        # a module computing in bfloat16 or float16 rounds what it gives to its dtype: the check allows that much
        tolerance = max(NORM_CHECK, 8 * torch.finfo(output.dtype).eps) if output.is_floating_point() else NORM_CHECK
        for centre, gain, scale in candidates.values():
            got = (centred if centre else x) * scale * gain + b
            if (got - want).abs().max() <= tolerance * want.abs().max() + 1e-30:
                self.centre, self.gain, self.scale, self.bias = centre, gain, scale, b
                self.x = centred if centre else x  # the input less its mean, for a LayerNorm
                return
        raise ModelLoadError(
            f"circuit cannot linearise a norm ({type(norm).__name__}): neither a LayerNorm nor an RMS norm"
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (rows, n, hidden), writes at the one position per row the scale was frozen at; or, for a norm found at
        one row of t positions, (n, t, hidden) writes at each of them."""
        x = x.double()
        if self.centre:
            x = x - x.mean(-1, keepdim=True)
        return x * self.scale * self.gain

    def back(self, grads: torch.Tensor) -> torch.Tensor:
        """(rows, t, n, hidden): each of `grads` (rows, t, n, hidden), gradients at the norm's output (x: rows, t,
        hidden), carried back to its input through the full Jacobian: with u = g * grad (less its mean, for a
        LayerNorm), c = x (less its mean) and s the scale, s u - s^3 c mean(u c). In the dtype of the rows it was
        found at."""
        c, s = self.x[..., None, :], self.scale[..., None, :]
        u = grads.to(c.dtype) * self.gain.to(c.dtype)
        if self.centre:
            u -= u.mean(-1, keepdim=True)
        along = torch.linalg.vecdot(u, c)[..., None] / c.shape[-1]  # mean(u c)
        return u.mul_(s).sub_(along * (s**3 * c))


def norm_jvp(norm: torch.nn.Module, at: torch.Tensor, changes: torch.Tensor) -> torch.Tensor:
    """(n, *at.shape) float32: the norm's Jacobian at `at` (rows, t, hidden) times each of `changes` (n, rows, t,
    hidden): what each change, alone, would change the norm's output by, to first order."""
    point = at.detach().float().expand_as(changes).contiguous()
    with torch.enable_grad():
        _, moved = torch.func.jvp(lambda x: norm(x).float(), (point,), (changes.float(),))
    return moved.detach()


def norm_back(norm: torch.nn.Module | None, x: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """(rows, t, n, hidden) float32: each of `grads` (rows, t, n, hidden), gradients at norm(x) (x: rows, t, hidden),
    carried back to x: by the Jacobian of a LayerNorm or an RMS norm, any other norm run again on n copies of x (one
    backward); as they are where there is no norm."""
    if norm is None:
        return grads.float()
    known = FrozenNorm.found(norm, x)
    if known is not None:
        return known.back(grads)
    with torch.enable_grad():
        copies = x.detach()[:, :, None].expand(grads.shape).contiguous().requires_grad_()
        normed = norm(copies)
        (back,) = torch.autograd.grad(normed, copies, grad_outputs=grads.to(normed.dtype))
    return back.float()
