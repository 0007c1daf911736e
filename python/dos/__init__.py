"""dos: offloaded AdamW (Deep Optimizer States) and lazy checkpoints, from Go, for PyTorch.

``dos.torch.AdamW`` is a ``torch.optim.Optimizer`` backed by dos's Go runtime (the shared library
``libdos.so`` built by ``make python``). See the repository's README.
"""

__all__ = ["DosError", "library_path"]

from ._native import DosError, library_path  # noqa: E402
