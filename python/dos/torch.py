"""``dos.torch.AdamW``: a ``torch.optim.Optimizer`` backed by dos's Go runtime.

This first version (issue 18, in progress) covers CPU float32 parameters: each ``step()`` hands the
gradients to dos's offloaded AdamW (PyTorch-exact numerics, SIMD CPU workers, fp32 master weights and
``exp_avg``/``exp_avg_sq`` in dos's memory) and writes the new weights into ``p.data`` in place.
"""
import ctypes
import json

import torch

from . import _native

__all__ = ["AdamW"]

_SHARED = ("betas", "eps", "amsgrad", "maximize")


def _norm(v):
    return tuple(v) if isinstance(v, (list, tuple)) else v


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's signature and defaults, updated by dos.

    Every parameter group may set its own ``lr`` and ``weight_decay``; ``betas``, ``eps``, ``amsgrad`` and
    ``maximize`` are shared by all groups (a ValueError otherwise). ``param_groups[i]["lr"]`` is read at every
    step, so ``torch.optim.lr_scheduler`` works. DeepSpeed's names for the offload options:
    ``sub_group_size`` (elements per subgroup), ``threads`` (CPU workers, 0: all), and ``max_grad_norm``
    (global clipping as ``clip_grad_norm_``, 0: off).

    Limits of this version: CPU float32 tensors, every parameter needs a gradient at every step, and
    ``state_dict``/``load_state_dict`` raise NotImplementedError (dos's own checkpoints come next).
    Errors from Go are raised as ``dos.DosError`` with Go's message.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, sub_group_size=1_000_000_000, threads=0, max_grad_norm=0.0):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults)
        first = self.param_groups[0]
        for i, g in enumerate(self.param_groups):
            for k in _SHARED:
                if _norm(g[k]) != _norm(first[k]):
                    raise ValueError(f"dos.torch.AdamW: param group {i} sets {k}={g[k]!r}; dos shares {k} across groups "
                                     f"(group 0: {first[k]!r})")
        self._params = []
        spec_params = []
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                self._check(len(self._params), p)
                spec_params.append({"name": f"p{len(self._params)}", "shape": list(p.shape) or [1], "group": gi})
                self._params.append(p)
        spec = {"params": spec_params,
                "groups": [{"lr": float(g["lr"]), "weight_decay": float(g["weight_decay"])} for g in self.param_groups],
                "betas": [float(first["betas"][0]), float(first["betas"][1])], "eps": float(first["eps"]),
                "amsgrad": bool(first["amsgrad"]), "maximize": bool(first["maximize"]),
                "max_grad_norm": float(max_grad_norm), "sub_group_size": int(sub_group_size), "threads": int(threads)}
        self._shapes = [p.shape for p in self._params]
        self._h = _native.call("dos_adamw_new", json.dumps(spec).encode())
        for i, p in enumerate(self._params):
            _native.call("dos_adamw_set", self._h, i, p.data.data_ptr(), p.numel())

    @staticmethod
    def _check(i, p):
        if p.device.type != "cpu" or p.dtype != torch.float32:
            raise ValueError(f"dos.torch.AdamW: parameter {i} is {p.dtype} on {p.device}; this version takes CPU float32")
        if not p.data.is_contiguous():
            raise ValueError(f"dos.torch.AdamW: parameter {i} is not contiguous")

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter (torch.optim.AdamW's semantics). Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        n = len(self._params)
        params, grads, keep = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), []
        for i, p in enumerate(self._params):
            self._check(i, p)
            if p.shape != self._shapes[i]:
                raise ValueError(f"dos.torch.AdamW: parameter {i} changed shape from {tuple(self._shapes[i])} to {tuple(p.shape)}")
            if p.grad is None:
                raise ValueError(f"dos.torch.AdamW: parameter {i} has no gradient; dos updates every parameter at every step")
            if p.grad.is_sparse:
                raise ValueError(f"dos.torch.AdamW: parameter {i} has a sparse gradient")
            g = p.grad.detach().to(torch.float32).contiguous()
            keep.append(g)
            params[i], grads[i] = p.data.data_ptr(), g.data_ptr()
        lrs = (ctypes.c_double * len(self.param_groups))(*[float(g["lr"]) for g in self.param_groups])
        _native.call("dos_adamw_step", self._h, params, grads, lrs, len(self.param_groups), 0.0)
        return loss

    def state_dict(self):
        raise NotImplementedError("dos.torch.AdamW.state_dict: not implemented yet (issue 18 is in progress)")

    def load_state_dict(self, state_dict):
        raise NotImplementedError("dos.torch.AdamW.load_state_dict: not implemented yet (issue 18 is in progress)")

    def close(self):
        """Frees dos's optimizer state; later steps raise. Called when the optimizer is collected."""
        h, self._h = getattr(self, "_h", 0), 0
        if h:
            _native.call("dos_adamw_close", h)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
