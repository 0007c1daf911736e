"""``dos.torch.AdamW``: a ``torch.optim.Optimizer`` backed by dos's Go runtime.

Each ``step()`` hands the gradients to dos's offloaded AdamW (PyTorch-exact numerics, SIMD CPU workers,
fp32 master weights and ``exp_avg``/``exp_avg_sq`` in dos's memory, the update phase interleaved with the
GPU when ``device="cuda"``) and writes the new weights into ``p.data`` in place. Parameters may be CPU
tensors or tensors on one GPU (float32, bfloat16, float16), whole (DDP, one GPU) or
FSDP2's local shards (``DTensor.to_local()``).
"""
import atexit
import ctypes
import json
from collections import Counter
from collections.abc import MutableMapping
import math
import numbers
import os
import shlex
import sys
import threading
import weakref

import torch

from . import _native

__all__ = ["AdamW", "SaveHandle"]

_SHARED = ("betas", "eps", "amsgrad", "maximize")
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
MIN_RING_BYTES = 32 << 20  # save's smallest ring_bytes but 0: two of the checkpointer's 16 MiB chunks
MAX_STEP = 2 ** 53  # the largest step count taken: a float (torch keeps the step as one) holds it exactly


class _CudaArray:
    """n elements of device memory at ptr, for torch.as_tensor: float32 ("<f4"), or 16-bit ones as int16
    ("<i2": __cuda_array_interface__ has no bfloat16)."""

    def __init__(self, ptr, n, typestr):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": typestr, "data": (ptr, False), "version": 2}


def _alias(ptr, n, dtype, device):
    """A flat CUDA tensor of n elements of dtype that aliases dos's memory at ptr on device (a CUDA device)."""
    if dtype == torch.float32:
        return torch.as_tensor(_CudaArray(ptr, n, "<f4"), device=device)
    return torch.as_tensor(_CudaArray(ptr, n, "<i2"), device=device).view(dtype)


def _spec_device(d):
    """dos's device spec for a CUDA torch.device: "cuda" for GPU 0 (offload.OpenDevice's), "cuda:N" else."""
    return "cuda" if d.index in (None, 0) else f"cuda:{d.index}"


def _is_dtensor(t):
    """Whether t is a DTensor (FSDP2's fully_shard parameters and gradients): it has to_local and placements."""
    return t is not None and hasattr(t, "to_local") and hasattr(t, "placements")


def _local(t):
    """The tensor dos reads and writes for t: the rank's local shard of a DTensor (FSDP2's fully_shard
    parameters and gradients, DTensor.to_local(), which shares the shard's storage), else t itself (DDP's
    and single-GPU parameters: every rank holds them whole)."""
    return t.to_local() if _is_dtensor(t) else t


def _dtensor_type():
    """torch's DTensor class: torch.distributed.tensor's, else (older torch) torch.distributed._tensor's."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        from torch.distributed._tensor import DTensor
    return DTensor


def _as_param(P, t):
    """t, this rank's values of a moment of parameter P, as torch.optim.AdamW holds it: for a DTensor P
    (FSDP2's) a DTensor of P's device mesh, placements, shape and stride whose local tensor is t (moved to the
    mesh's device type, as from_local does), so that torch.distributed.checkpoint saves and loads each rank's
    shard (a plain tensor it takes for a replicated one and keeps one rank's); else t."""
    if not _is_dtensor(P):
        return t
    return _dtensor_type().from_local(t, P.device_mesh, P.placements, run_check=False, shape=P.shape, stride=P.stride())


def _shard_group(params, process_group):
    """The process group over which params are sharded, whose ranks must agree on the gradient norm and the
    skip of a non-finite step: process_group when given, else the mesh of FSDP2's sharded DTensors (a 1-D
    mesh), else None (every rank holds its parameters whole, as with DDP, or there is one rank)."""
    import torch.distributed as dist
    if process_group is None:
        # fully_shard makes a mesh per call: meshes over the same ranks are one group
        groups = {}
        sharded = [P for P in params if hasattr(P, "placements") and hasattr(P, "device_mesh")
                   and any(pl.is_shard() for pl in P.placements)]
        if sharded and len(sharded) != len(params):
            raise ValueError(f"dos.torch.AdamW: {len(sharded)} of the {len(params)} parameters are sharded DTensors and the "
                             "others are not: the norm would count those whole tensors once per rank; give dos only the sharded ones, "
                             "or pass process_group= when the plain tensors are this rank's shards too")
        for P in sharded:
            mesh = P.device_mesh
            if mesh.ndim != 1:
                raise ValueError(f"dos.torch.AdamW: the parameters are sharded over a {mesh.ndim}-D device mesh "
                                 "(HSDP); pass process_group= (the group whose ranks hold the shards of one replica)")
            g = mesh.get_group()
            groups.setdefault(tuple(dist.get_process_group_ranks(g)), g)
        if len(groups) > 1:
            raise ValueError(f"dos.torch.AdamW: the parameters are sharded over different ranks {sorted(groups)}; pass "
                             "process_group= (the group whose ranks hold the shards of one model)")
        if not groups:
            return None
        process_group = groups.popitem()[1]
    return process_group if dist.get_world_size(process_group) > 1 else None


def _path(path, what):
    """path (str, bytes or os.PathLike) as the bytes dos takes; a ValueError for an embedded null byte, as os
    raises (C would cut the path there)."""
    b = os.fsencode(path)
    if b"\0" in b:
        raise ValueError(f"dos.torch.AdamW{what}: embedded null byte in the path {os.fsdecode(b)!r}")
    return b


def _refuse_overlaps(ts, what=""):
    """Refuses (ValueError) tensors whose memory overlaps (distinct Parameters over one storage, such as
    nn.Parameter(a.data)): dos reads every parameter before the step and writes each back after it, so one's
    write would undo the other's update. The tensors are contiguous: each spans [data_ptr, + numel x size)."""
    spans = sorted((t.device.type, t.device.index or 0, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i)
                   for i, t in enumerate(ts))
    for a, b in zip(spans, spans[1:]):
        if a[:2] == b[:2] and b[2] < a[3]:
            i, j = sorted((a[4], b[4]))
            raise ValueError(f"dos.torch.AdamW{what}: parameters {i} {tuple(ts[i].shape)} and {j} {tuple(ts[j].shape)} share memory "
                             f"(one storage, e.g. nn.Parameter(a.data){', or p1.data = p0.data after construction' if what else ''}); dos keeps one state per parameter and would undo one's "
                             "update with the other's: tie them as one Parameter (pass it once), or give each its own storage (.clone())")


@torch.no_grad()
def _write(p, d, src):
    """Writes src into d, parameter p's data (p local), and bumps p's version counter as torch.optim's in-place
    update does (d.copy_ alone, a write through p.data, bumps none): another optimizer over p (a second
    dos.torch.AdamW, which takes a 16-bit parameter whose _version changed) sees the new weights. The bump is
    an in-place op on an empty view of p (p[None][:0]: of any shape and layout, p.data replaced by another
    thread included): a view shares p's version counter, and nothing is written. The view is taken by basic
    indexing, which torch does with the GIL held, as it replaces p.data (p.data = t) with it held: a method
    of p (p.as_strided) reads p's storage with the GIL released, and another thread's p.data = t meanwhile
    freed the storage it was taking (a segfault, test_threads). The caller records p's version after it
    (_mark_seen), so dos's own write is not taken as a change."""
    d.copy_(src)
    p[None][:0].zero_()


_saving = weakref.WeakSet()  # the live optimizers that saved: _wait_saves_at_exit waits for their last save
# _wait_saves_at_exit: registered at the first save; ran, once it has (a save after it waits in save itself)
_exit_hook = {"registered": False, "ran": False}


def _wait_saves_at_exit():
    """At interpreter exit (atexit): waits for the last save of every live optimizer (one held by a daemon
    thread is never collected, so its close() never waits, and the process would end with the save half
    written) unless its handle reported it already; a failure is named on stderr in one line."""
    if _native.forked():
        return  # the parent's saves
    _exit_hook["ran"] = True  # a save after this (an exit hook registered before dos's runs after it) waits itself
    for opt in list(_saving):
        h = opt.__dict__.get("_last_save")
        if h is None or h._reported:
            continue
        try:
            h.wait()
        except Exception as e:  # noqa: B902 (reported here: nothing else will)
            path, step = h._saved
            msg = (str(e).splitlines() or [type(e).__name__])[0]
            print(f"dos.torch.AdamW: at exit, the save of step {step} into {os.fsdecode(path)} failed: {msg}",
                  file=sys.stderr, flush=True)


def _lr(v, where):
    """A group's lr as dos takes it: a real number (an int, a float, a NumPy scalar; not a bool), or a 0-dim real tensor (torch >= 2 takes a
    Tensor lr), finite and >= 0 (torch.optim.AdamW's "Invalid learning rate"); ValueError naming where."""
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool)
    if isinstance(v, torch.Tensor):
        ok = v.numel() == 1 and v.dim() == 0 and not v.is_complex() and v.dtype != torch.bool
    elif getattr(v, "ndim", None) == 0 and getattr(getattr(v, "dtype", None), "kind", "") in "iuf":
        ok = True  # a 0-dim NumPy array of ints or floats, which torch.optim takes too
    try:
        x = float(v) if ok else math.nan
    except OverflowError:  # an int beyond float's range
        x = math.inf
    if not (math.isfinite(x) and x >= 0):
        raise ValueError(f"dos.torch.AdamW{where}: invalid lr {v!r}: want a finite number >= 0 (an int, a float or a "
                         "0-dim tensor)")
    return x


def _norm(v):
    return tuple(v) if isinstance(v, (list, tuple)) else v


class _Call:
    """Entered inside ``with opt._lock`` (a threading.RLock, entered by the with statement itself, so that no
    interrupt falls between its acquire and the block, nor between the block and its release): one call into
    the optimizer at a time per thread too. A second call from the thread that holds the lock, while the
    first's frame is still on its stack, comes from a signal handler or a hook that interrupted it: refused
    with RuntimeError (a plain lock would wait for itself for ever, and the first call's change is half done
    under it). Then the rest of a change an exception cut short is finished (_settle). The frame is held,
    not its id() (which later frames reuse), until the call's exit; one that an exception kept from running
    leaves a frame no longer on the stack, which counts for nothing and is replaced by the next call's."""

    __slots__ = ("_o", "_quiet")

    def __init__(self, o, quiet=False):
        self._o, self._quiet = o, quiet  # quiet: close's, where what _settle raises is dropped

    def __enter__(self):
        o = self._o
        held = o._call_frame
        if held is not None:
            f = sys._getframe(1)
            while f is not None:
                if f is held:
                    raise RuntimeError("dos.torch.AdamW: called while this thread is inside another call of the same "
                                       "optimizer (from a signal handler, or a hook, that interrupted it): dos takes one "
                                       "call at a time; set a flag in the handler and call the optimizer once the "
                                       "interrupted call has returned")
                f = f.f_back
        o._call_frame = sys._getframe(1)  # the frame itself: an id() is reused by later frames
        if not self._quiet:
            o._settle()
        elif getattr(o, "_h", 0) and o.__dict__.get("_unsettled") is not None:
            try:
                o._settle()  # the parameters' data as dos left them
            except Exception:
                pass
        return self

    def __exit__(self, typ, e, tb):
        self._o._call_frame = None
        if isinstance(e, _native.DosError) and not self._quiet:
            self._o._reported(e)  # whichever call raised the last save's failure, it is reported now
        return False


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's signature and defaults, updated by dos.

    Every parameter group may set its own ``lr`` and ``weight_decay``; ``betas``, ``eps``, ``amsgrad`` and
    ``maximize`` are shared by all groups (a ValueError otherwise). ``param_groups[i]["lr"]`` is read at every
    step, so ``torch.optim.lr_scheduler`` works. DeepSpeed's names for the offload options:
    ``sub_group_size`` (elements per subgroup), ``threads`` (CPU workers, 0: all), and ``max_grad_norm``
    (global clipping as ``clip_grad_norm_``, 0: off).

    Where the update phase runs (16-bit parameters on the CPU, any on a GPU): ``device=None`` (the default for
    CPU parameters) updates every subgroup on
    the CPU workers; ``device="cuda"`` (torch's current GPU) or ``"cuda:N"`` runs dos's interleaved engine there, the state in pinned host
    memory (``pin_memory`` must stay True), with ``gpu_budget`` bytes of device memory for resident state and
    staging (default 0: none, so every subgroup on the CPU; PyTorch's own memory use is not known at
    construction, so set it to what your model leaves) and ``schedule``: ``"auto"`` (the performance model's
    choice from ``profile``, a ``dos calibrate --json`` file of this machine, or else a few seconds of
    measurement at construction), ``"cpu"`` (ZeRO-Offload's placement), ``"static"`` (as many subgroups
    resident as the budget holds, the rest on the CPU: ZeRO-Offload++'s and TwinFlow's) or ``"C,G,R"`` counts
    of CPU, streamed and resident subgroups. ``device="sim"`` runs the same engine on dos's simulated device
    (for tests). ``placement()`` says what was chosen.

    dos keeps fp32 master weights: for float32 parameters on the CPU they are ``p.data``, read at every step,
    so a parameter changed between steps (``fill_``, ``model.load_state_dict``, clamping) steps on from its
    new values as with torch; for float32 parameters on a GPU ``p.data`` is their copy, and a change is
    taken as for 16-bit ones (below); for bfloat16 or float16 parameters ``p.data`` is their 16-bit rounding
    (``master_weights(i)`` reads them), the gradients are 16-bit, and a parameter replaced or changed in
    place (seen by its data pointer and ``_version``; not a change through ``p.data``) is taken into the
    master weights at the next step, losing their low bits. dos's own writes of the new weights (step, load)
    bump ``p._version`` as torch.optim's in-place update does, so that another optimizer over the same
    parameter (a second dos.torch.AdamW, one per loss) takes them. An optimizer built under
    ``torch.inference_mode()`` steps outside it (and inside), as torch.optim's does.

    As dos's update phase does, a step whose gradients hold an Inf or a NaN is skipped whole: nothing
    changes, the step count stays, and ``self.skipped`` is True until the next step that is taken (torch
    would write NaNs).

    ``state_dict``/``load_state_dict`` use torch.optim.AdamW's format, so state moves between the two (the
    moments in fp32). ``state`` is a view of dos's state holding every parameter from construction on (step 0,
    zero moments): read, a value is a copy (changing it in place does not reach dos); set, it is written into
    dos. So torch.distributed.checkpoint's ``get_optimizer_state_dict``/``set_optimizer_state_dict``, which
    step an optimizer whose ``state`` is empty, never step it. For DTensor parameters (FSDP2's) both give the
    moments as DTensors of the parameter's placements, as torch.optim.AdamW holds them (``step`` stays a plain
    tensor), so DCP's ``save``/``load`` keep each rank's shard. ``save``/``load`` checkpoint lazily in dos's
    format, master weights included; one optimizer of a process writes a root (another's save raises).
    CUDA parameters (float32, bfloat16 or float16, all on one GPU, e.g. an FSDP2 rank's; ``device="cuda"`` on
    that GPU is then implied): ``step()``
    copies each gradient into dos's device gradient buffer on PyTorch's current stream, waits on an event of
    that stream (this thread only, no device-wide synchronisation), runs dos's update phase, and copies the
    new weights back on the current stream: for float32 parameters (with autocast, as torch.optim.AdamW
    users train) the fp32 master weights that dos keeps on the device for them, bit for bit torch's fp32
    AdamW; for 16-bit ones dos's 16-bit working copy. ``torch.amp.GradScaler`` works as with torch.optim (it
    unscales and skips the step itself). FSDP2 (``fully_shard``) parameters are DTensors: dos takes each
    rank's local shard and its gradient's, so each rank's optimizer holds only its shards, and every step
    all-reduces the ranks' gradient sums of squares over the shards' process group (the 1-D device mesh's;
    ``process_group=`` names it for other sharded parameters or an HSDP mesh), so that every rank clips by
    the whole model's norm, as ``clip_grad_norm_`` over DTensors does, and skips a non-finite step alike; an
    exception on one rank during ``step()`` leaves the others waiting in that all-reduce, as any collective
    would. With DDP every rank holds the whole state and no reduction is needed. dos's device memory (a gradient buffer and a working copy beside PyTorch's
    tensors: 4 bytes per parameter for 16-bit ones, 8 for float32; and ``gpu_budget``) is not PyTorch's
    allocator's: count it against any cap.

    Limits: parameters of one dtype and one device, each once, none empty, all requiring gradients; every
    parameter needs a gradient (of its shape) at every step; each group's lr is read at every step, its other
    hyperparameters (weight_decay, betas, eps, amsgrad, maximize) are fixed at construction: a step after a
    change raises (``OneCycleLR`` cycles betas unless ``cycle_momentum=False``), and a loaded state dict's
    groups must agree with them; no param group can be added later. Errors from Go are raised as
    ``dos.DosError`` with Go's message.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 sub_group_size=1_000_000_000, threads=0, max_grad_norm=0.0, device=None,
                 gpu_budget=0, profile=None, schedule="auto", pin_memory=True, process_group=None):
        # torch.optim.AdamW's implementation switches: dos has one implementation, so foreach and fused
        # change nothing (code that passes them swaps in as it is); capture into a CUDA graph and
        # differentiating through the step it cannot do.
        if capturable:
            raise ValueError("dos.torch.AdamW: capturable=True (CUDA graph capture of step()) is not supported: dos's "
                             "update phase runs on the CPU workers and its own streams; leave it False")
        if differentiable:
            raise ValueError("dos.torch.AdamW: differentiable=True is not supported: dos's update runs outside autograd")
        for name, v in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay), ("max_grad_norm", max_grad_norm),
                        ("betas[0]", betas[0]), ("betas[1]", betas[1])):
            if not math.isfinite(float(v)):
                raise ValueError(f"dos.torch.AdamW: invalid {name}: {v}")
        # torch.optim.AdamW's own checks, with its exception type
        for name, v in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay), ("max_grad_norm", max_grad_norm)):
            if float(v) < 0:
                raise ValueError(f"dos.torch.AdamW: invalid {name}: {v} (want >= 0)")
        if len(tuple(betas)) == 2 and not all(0 <= float(b) < 1 for b in betas):
            raise ValueError(f"dos.torch.AdamW: invalid betas: {tuple(betas)} (want each in [0, 1))")
        if len(tuple(betas)) != 2:
            raise ValueError(f"dos.torch.AdamW: betas {betas!r}: want two values")
        for name, v in (("amsgrad", amsgrad), ("maximize", maximize), ("pin_memory", pin_memory)):
            if not isinstance(v, bool):
                raise TypeError(f"dos.torch.AdamW: {name}={v!r}: want True or False")
        for name, v, lo in (("sub_group_size", sub_group_size, 1), ("threads", threads, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"dos.torch.AdamW: {name}={v!r}: want an int >= {lo}")
        if threads > 4 * (os.cpu_count() or 1):
            raise ValueError(f"dos.torch.AdamW: threads={threads}: want at most 4 x the {os.cpu_count()} CPUs (0: one per CPU)")
        if profile:
            _path(profile, ": profile")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        self._h = 0
        super().__init__(params, defaults)
        first = self.param_groups[0]
        for i, g in enumerate(self.param_groups):
            for k in ("lr", "eps", "weight_decay"):
                if not math.isfinite(float(g[k])):
                    raise ValueError(f"dos.torch.AdamW: param group {i}: invalid {k}: {g[k]}")
        for i, g in enumerate(self.param_groups):
            for k in _SHARED:
                if _norm(g[k]) != _norm(first[k]):
                    raise ValueError(f"dos.torch.AdamW: param group {i} sets {k}={g[k]!r}; dos shares {k} across groups "
                                     f"(group 0: {first[k]!r})")
        self._params = []
        seen = set()  # ids of the parameters taken
        spec_params = []
        dtypes = {_local(p).dtype for g in self.param_groups for p in g["params"]}
        if len(dtypes) > 1:
            raise ValueError(f"dos.torch.AdamW: the parameters mix dtypes {sorted(str(d) for d in dtypes)}; this version takes one")
        self._dtype = dtypes.pop() if dtypes else torch.float32
        if isinstance(device, str) and device.startswith("cuda"):
            try:
                device = torch.device(device)
            except RuntimeError:
                raise ValueError(f"dos.torch.AdamW: device={device!r}: want None (the CPU workers), \"cuda\" or "
                                 "\"cuda:N\" (a GPU), or \"sim\" (dos's simulated device, for tests)") from None
        asked = None  # the GPU device= names, if it names one ("cuda" alone: the parameters', or torch's current one)
        if isinstance(device, torch.device):
            if device.type == "cuda" and device.index is not None:
                asked = device
            elif device.type == "cuda" and torch.cuda.is_available():
                device = torch.device("cuda", torch.cuda.current_device())  # as torch reads "cuda"
            device = None if device.type == "cpu" else _spec_device(device) if device.type == "cuda" else device.type
        if device == "cpu":
            device = None
        if device not in (None, "sim") and not (isinstance(device, str) and device.startswith("cuda")):
            raise ValueError(f"dos.torch.AdamW: device={device!r}: want None (the CPU workers), \"cuda\" or "
                             "\"cuda:N\" (a GPU), or \"sim\" (dos's simulated device, for tests)")
        devices = {_local(p).device for g in self.param_groups for p in g["params"]}
        self._cuda = any(d.type == "cuda" for d in devices)
        self._dev = None  # the parameters' GPU
        if self._cuda:
            if len(devices) != 1:
                raise ValueError(f"dos.torch.AdamW: the parameters are on {sorted(str(d) for d in devices)}; dos updates "
                                 "the parameters of one device (an FSDP2 rank's: its GPU)")
            d = devices.pop()
            self._dev = torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device())
            if device == "sim" or asked not in (None, self._dev):
                raise ValueError(f"dos.torch.AdamW: the parameters are on {self._dev}, device={device!r}: want "
                                 f"\"{self._dev}\" (or None)")
            device = _spec_device(self._dev)
        for gi, g in enumerate(self.param_groups):
            for P in g["params"]:
                p = _local(P)  # the local shard of an FSDP2 parameter
                self._check(len(self._params), p)
                if id(P) in seen:
                    raise ValueError(f"dos.torch.AdamW: parameter {len(self._params)} {tuple(p.shape)} is given twice; "
                                     "dos keeps one state per parameter: pass each once")
                if not P.requires_grad:
                    raise ValueError(f"dos.torch.AdamW: parameter {len(self._params)} {tuple(p.shape)} does not require "
                                     "gradients (frozen); leave it out: [p for p in model.parameters() if p.requires_grad]")
                if p.numel() == 0:
                    raise ValueError(f"dos.torch.AdamW: parameter {len(self._params)} is empty {tuple(p.shape)}; "
                                     "leave it out of the optimizer")
                spec_params.append({"name": f"p{len(self._params)}", "shape": list(p.shape) or [1], "group": gi})
                self._params.append(P)
                seen.add(id(P))
        spec = {"params": spec_params,
                "groups": [{"lr": float(g["lr"]), "weight_decay": float(g["weight_decay"])} for g in self.param_groups],
                "betas": [float(first["betas"][0]), float(first["betas"][1])], "eps": float(first["eps"]),
                "amsgrad": bool(first["amsgrad"]), "maximize": bool(first["maximize"]),
                "max_grad_norm": float(max_grad_norm), "sub_group_size": int(sub_group_size), "threads": int(threads),
                "dtype": _DTYPES[self._dtype], "device": device or "", "gpu_budget": int(gpu_budget),
                "profile": os.fsdecode(_path(profile, ": profile")) if profile else "", "schedule": schedule or "auto",
                "pin_memory": bool(pin_memory), "device_params": self._cuda}
        _refuse_overlaps([_local(P) for P in self._params])
        self._shapes = [_local(p).shape for p in self._params]
        self._fixed = [self._hyper(g) for g in self.param_groups]
        # the parameters of each group as dos laid them out: step(), state_dict(), load_state_dict() and save()
        # refuse groups whose "params" were edited since (_check_layout)
        self._layout = [tuple(g["params"]) for g in self.param_groups]
        self._h = _native.call("dos_adamw_new", json.dumps(spec).encode())
        # (data_ptr, _version, the data tensor) of each parameter as dos last left it; holding the tensor keeps
        # its storage alive, so that no new buffer can take its address unseen (_changed)
        self._seen = [None] * len(self._params)
        # The private tensors below are normal ones even when the optimizer is built under
        # torch.inference_mode() (inference tensors cannot be changed in place outside it, and every step does),
        # as torch.optim's state, made at its first step, is.
        with torch.inference_mode(False), torch.no_grad():
            self._views = self._device_views() if self._cuda else None
            # CPU parameters: each one's private gradient and weights buffers (flat, of the parameters' dtype),
            # which only this optimizer holds: dos reads the gradients from and writes the new weights into them,
            # while the GIL is released, and torch's copy_ moves them from and into the user's tensors, so that no
            # other thread's change of a user's tensor (p.data.resize_(), p.grad = ...) can free memory that dos
            # is reading or writing. (torch's copy_ releases the GIL too: a resize during it is the user's data
            # race, as during torch.optim's in-place update; seen faulting in copy_ on the H200.) For float32 the
            # weights buffer also carries the master weights taken in.
            self._gbuf = self._wbuf = None
            if not self._cuda:
                self._gbuf = [torch.empty(_local(P).numel(), dtype=self._dtype) for P in self._params]
                self._wbuf = [torch.empty(_local(P).numel(), dtype=self._dtype) for P in self._params]
        self._saved_step = None
        self._last_save = None  # the SaveHandle of the last save()
        self._unsettled = None  # a change cut short by an exception, finished by the next call (_settle)
        # one step, save or load at a time: they share dos's gradient buffers. An RLock entered by a C-level
        # with statement (its acquire and release cannot be cut from the with block by an interrupt), with
        # _Call inside it refusing a second call of the same thread (a signal handler's, a hook's)
        self._lock = threading.RLock()
        self._call_frame = None  # the frame of the call that holds _lock (_Call)
        self.skipped = False
        # Sharded parameters (FSDP2's, or process_group's): every step all-reduces the ranks' gradient sums
        # of squares through _reduce, so that each rank clips by the whole model's norm and skips alike.
        self._group = _shard_group(self._params, process_group)
        self._reduce = self._reducer() if self._group is not None else _native.REDUCE_FN()
        self._reduce_error = None
        for i, P in enumerate(self._params):
            p = _local(P)
            self._take(i, p, self._data(i, p))
        self._state_view = _State(self)

    def _device_views(self):
        """Each parameter's gradient and weights in dos's device memory (the 16-bit working copy, or for
        float32 parameters the fp32 master weights' device copy), as flat CUDA tensors that alias it
        (through __cuda_array_interface__)."""
        views = []
        for i, p in enumerate(self._params):
            g, w = ctypes.c_uint64(), ctypes.c_uint64()
            _native.call("dos_adamw_device_ptrs", self._h, i, ctypes.byref(g), ctypes.byref(w))
            n = _local(p).numel()
            views.append((_alias(g.value, n, self._dtype, self._dev), _alias(w.value, n, self._dtype, self._dev)))
        return views

    def _reducer(self):
        """dos's StepArgs.Reduce as a C callback: an all-reduce (sum) of the sum of squares over self._group,
        on the device its backend needs (NCCL: CUDA). A NaN (a non-finite gradient on a rank) stays NaN, so
        every rank skips. dos calls it on the thread that called step()."""
        import torch.distributed as dist
        nccl = dist.get_backend(self._group) == "nccl"
        cuda_params = [_local(P).device for P in self._params if _local(P).device.type == "cuda"]

        def reduce(x):
            try:
                # NCCL needs a CUDA tensor: the parameters' device, else the current one at this step
                dev = None
                if nccl:
                    dev = cuda_params[0] if cuda_params else torch.device("cuda", torch.cuda.current_device())
                t = torch.tensor([x[0]], dtype=torch.float64, device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._group)
                x[0] = float(t.item())
                return 0
            except BaseException as e:  # raised by step() once dos returns
                self._reduce_error = e
                return 1
        return _native.REDUCE_FN(reduce)

    def _call_step(self, name, *args):
        self._reduce_error = None
        try:
            return _native.call(name, *args, self._reduce)
        except _native.DosError as e:
            if self._reduce_error is not None:
                raise self._reduce_error from e
            raise

    @staticmethod
    def _hyper(g):
        """A group's hyperparameters that dos fixes at construction."""
        return (float(g["weight_decay"]), tuple(float(b) for b in g["betas"]), float(g["eps"]), bool(g["amsgrad"]),
                bool(g.get("maximize", False)))

    def _take(self, i, p, d):
        """Sets parameter i's fp32 master weights from d, p's data as _data checked it (p local), and records
        p as seen. dos reads a private fp32 copy (torch's copy_ resolves a lazy negation or conjugation)."""
        v = self._wbuf[i] if self._dtype == torch.float32 and not self._cuda else torch.empty(d.numel(), dtype=torch.float32)
        v.view(d.shape).copy_(d)
        _native.call("dos_adamw_state_set", self._handle(), i, 0, v.data_ptr(), v.numel())
        self._mark_seen(i, p, d)

    def _mark_seen(self, i, p, d):
        """Records p (parameter i, local) with its data d as what dos's master weights hold. 16-bit and CUDA
        parameters keep d, so that its storage cannot be freed and a new buffer put at its address unseen."""
        if self._dtype == torch.float32 and not self._cuda:
            return  # taken at every step: nothing to compare
        self._seen[i] = (d.data_ptr(), p._version, d)

    def _data(self, i, p):
        """p.data (p parameter i, local), read once and checked: the tensor whose pointer and element count go
        to dos. Another thread may replace p.data meanwhile; this tensor stays whole while it is held."""
        d = p.data
        self._check(i, d)
        if d.shape != self._shapes[i]:
            raise ValueError(f"dos.torch.AdamW: parameter {i} changed shape from {tuple(self._shapes[i])} to {tuple(d.shape)}")
        if d.dtype != self._dtype:
            raise ValueError(f"dos.torch.AdamW: parameter {i} changed dtype from {self._dtype} to {d.dtype} "
                             "(model.half() or .to(dtype) after the optimizer was built: build it after)")
        if (d.device.type == "cuda") != self._cuda or (self._cuda and d.device != self._dev):
            raise ValueError(f"dos.torch.AdamW: parameter {i} is on {d.device}; the optimizer was built for "
                             f"{self._dev if self._cuda else 'the CPU'}")
        return d

    def _changed(self, i, p, d):
        """Whether parameter i may differ from dos's master weights: always for float32 on the CPU (the
        master is p.data itself, taken every step, cheaply: an in-place change through p.data bumps no
        version), and otherwise when p was replaced or changed in place (its data pointer or _version:
        ``model.load_state_dict`` and in-place ops under no_grad bump it; a change through ``p.data`` is not
        seen). On a GPU taking one sends the state through the host, so it is not done every step."""
        if self._dtype == torch.float32 and not self._cuda:
            return True
        seen = self._seen[i]
        # the storage seen is held (_mark_seen), so a buffer at its address is that storage's
        return seen is None or (d.data_ptr(), p._version) != seen[:2]

    def _check_layout(self, what):
        """Refuses param groups whose "params" are no longer the parameters dos laid out at construction
        (appended, removed, swapped or replaced: dos would ignore the change, and state_dict() would number
        its state by the edited groups)."""
        groups = self.param_groups
        ok = len(groups) == len(self._layout) and all(
            isinstance(g.get("params"), (list, tuple)) and len(g["params"]) == len(ps) and all(a is b for a, b in zip(g["params"], ps))
            for g, ps in zip(groups, self._layout))
        if not ok:
            raise ValueError(f"dos.torch.AdamW.{what}: the param groups' \"params\" were changed after construction "
                             f"(groups of {[len(ps) for ps in self._layout]} parameters then, "
                             f"{[len(g.get('params') or ()) for g in groups]} now): dos lays the parameters out once; put them "
                             "back as they were, or build a new optimizer over the new groups (load_state_dict carries the state)")

    def __reduce_ex__(self, protocol):
        raise TypeError("dos.torch.AdamW cannot be pickled or copied: its state lives in dos's memory; use "
                        "state_dict() (torch.optim.AdamW's format) or save(root)")

    def _handle(self):
        _native.check_process()  # before any lock: one held at fork() stays held in the child
        if not self._h:
            raise _native.DosError("dos.torch.AdamW: the optimizer is closed")
        return self._h

    def add_param_group(self, param_group):
        if getattr(self, "_h", 0):
            raise NotImplementedError("dos.torch.AdamW: a param group cannot be added after construction "
                                      "(dos lays the parameters out once); build the optimizer with every group")
        super().add_param_group(param_group)

    @staticmethod
    def _check(i, p):
        if p.device.type not in ("cpu", "cuda") or p.dtype not in _DTYPES:
            raise ValueError(f"dos.torch.AdamW: parameter {i} is {p.dtype} on {p.device}; dos takes float32, bfloat16 or "
                             "float16 tensors on the CPU or a GPU")
        if not p.data.is_contiguous():
            raise ValueError(f"dos.torch.AdamW: parameter {i} is not contiguous")

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter (torch.optim.AdamW's semantics). Returns the closure's loss.
        Steps from several threads run one after the other; a parameter or gradient another thread replaces
        meanwhile is read once per step and checked (ValueError if it no longer fits), as are parameters that
        share memory (a tie made after construction, ``p1.data = p0.data``: a ValueError, as at construction).
        A background ``save`` that failed and was not yet reported by its handle's ``wait()`` makes this step
        raise its DosError instead, the step not taken (the step count stays; the next step is taken). The step
        is applied whole or not at all: an exception that arrives once dos has stepped (a Ctrl-C's
        KeyboardInterrupt) still gets the new weights into ``p.data``, then propagates (the copy-back goes on
        through two more), and one that cuts even that short leaves the rest to the next call (step, save,
        load, state_dict, state, master_weights), which finishes it first. A call from a signal handler or a
        hook that interrupted a call of the same optimizer on this thread raises RuntimeError (torch.optim's
        would see the state half updated): set a flag there and call once the interrupted call returns."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._handle()
        with self._lock, self._locked():
            self._step()
        return loss

    def _reported(self, e):
        """After a call raised e (_Call's exit: a step, state read or write, load_state_dict, load, save): when
        e is the failure of this optimizer's last save (dos reports it once, by the next step, state write,
        save or load), that save is reported: its handle's wait() has said so (which forgets the step saved,
        so that it can be saved again, and drops the engine, which would report it again at the next save, at
        close and at exit)."""
        h = self._last_save
        if h is None or h._reported or not h.done():
            return
        try:
            h.wait()
        except _native.DosError as we:
            if str(we) not in str(e):  # another failure: the save's is still to be reported by its wait()
                h._reported = False

    def _save_failure_first(self):
        """Before a change made of several writes into dos (load_state_dict, a state[p] = {...}): waits for the
        last save and raises its failure, if it failed and was not reported (reported then, as step() reports
        it), so that dos's first write does not raise it after the change began: the change would then be
        finished whole (_settle) and raise, applied. Nothing has changed when it raises."""
        h = self._last_save
        if h is not None and not h._reported:
            try:
                h.wait()
            except _native.DosError as e:
                raise _native.DosError(f"dos.torch.AdamW: the last save (step {h._saved[1]} into "
                                       f"{os.fsdecode(h._saved[0])}) failed, nothing was changed now: {e}") from e

    def _locked(self):
        """The context inside ``with self._lock`` of one step, save, load or state read or change (_Call): it
        refuses a call from a signal handler or a hook that interrupted this thread's call (which would
        otherwise wait for itself), then finishes what an exception cut short of an earlier change (_settle).
        Callers check the handle first (_handle: a lock held at fork() by another thread stays held in the
        child)."""
        return _Call(self)

    def _settle(self):
        """Finishes self._unsettled, the change that an exception (a Ctrl-C's KeyboardInterrupt, another
        signal handler's, a MemoryError) cut short after dos's state changed and before the parameters' data or the
        groups followed: a step's copy-back, a load's, a load_state_dict's. Each such change is set as
        _unsettled before it starts, is resumable (each part idempotent) and clears _unsettled once whole; every
        call that reads or writes dos's state finishes it first, so none sees it half done. An exception
        meanwhile resumes it, and the first is raised once it is whole; one that comes back twice more (not an
        interrupt) is raised, the rest left to the next call."""
        pending, tries = None, 0
        while self._unsettled is not None:
            try:
                self._unsettled()
            except BaseException as e:  # noqa: B902 (an interrupt too: raised below)
                if pending is None:
                    pending = e
                tries += 1
                if tries >= 3:
                    raise
        if pending is not None:
            raise pending

    def _step(self):
        h = self._handle()
        self._check_layout("step")
        n = len(self._params)
        # One snapshot of each parameter's data and gradient, checked; CPU gradients go into the private buffers
        # that dos reads (torch's copy_, with the GIL held), and the new weights come back through them.
        held, grads = [], []
        for i, P in enumerate(self._params):
            p = _local(P)  # an FSDP2 parameter's local shard
            d = self._data(i, p)
            grad = _local(P.grad)
            if grad is None:
                raise ValueError(f"dos.torch.AdamW: parameter {i} {tuple(d.shape)} has no gradient at this step; dos "
                                 "updates every parameter at every step: leave parameters that take no part in the loss "
                                 "out of the optimizer, or give them zero gradients")
            # its own shape and storage, which p.grad.data = ... does not change, taken with the GIL held (.data,
            # as _data takes p's): grad.detach() reads the gradient with the GIL released, and another thread's
            # p.grad.data = t meanwhile freed the storage it was taking (a segfault, test_threads)
            grad = grad.data
            if grad.is_sparse:
                raise ValueError(f"dos.torch.AdamW: parameter {i} has a sparse gradient")
            if grad.shape != d.shape or not (grad.is_floating_point() and grad.dtype in _DTYPES):
                raise ValueError(f"dos.torch.AdamW: parameter {i} {tuple(d.shape)} has a {grad.dtype} gradient of shape "
                                 f"{tuple(grad.shape)}; want float32, bfloat16 or float16 of the parameter's shape")
            if grad.device != d.device:
                raise ValueError(f"dos.torch.AdamW: parameter {i} is on {d.device} with its gradient on {grad.device}")
            held.append((p, d))
            grads.append(grad)
        # a tie made after construction (p1.data = p0.data): one's write-back would undo the other's update
        _refuse_overlaps([d for _, d in held], ".step")
        for i, ((p, d), grad) in enumerate(zip(held, grads)):
            if self._changed(i, p, d):  # changed or replaced since dos wrote it: take it
                self._take(i, p, d)
            if self._cuda:  # into dos's device gradient, on PyTorch's current stream
                self._views[i][0].copy_(grad.reshape(-1))
            else:
                self._gbuf[i].view(d.shape).copy_(grad)  # converts the dtype, resolves a lazy negation
        lrs = []
        for gi, (g, fixed) in enumerate(zip(self.param_groups, self._fixed)):
            lrs.append(_lr(g["lr"], f": param group {gi}"))
            now = self._hyper(g)
            if now != fixed:
                names = ("weight_decay", "betas", "eps", "amsgrad", "maximize")
                what = ", ".join(f"{k} {b!r} -> {a!r}" for k, a, b in zip(names, now, fixed) if a != b)
                raise ValueError(f"dos.torch.AdamW: param group {gi} changed {what} after construction; dos reads only lr "
                                 "at every step (OneCycleLR cycles betas unless cycle_momentum=False)")
        lrs = (ctypes.c_double * len(lrs))(*lrs)
        if not self._cuda:
            params, grads = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)()
            plens, glens = (ctypes.c_int64 * n)(), (ctypes.c_int64 * n)()
            for i, (w, g) in enumerate(zip(self._wbuf, self._gbuf)):  # private: no other thread reaches them
                params[i], plens[i], grads[i], glens[i] = w.data_ptr(), w.numel(), g.data_ptr(), g.numel()
            self._native_step(h, held, "dos_adamw_step", h, n, params, plens, grads, glens, lrs, len(self.param_groups), 0.0)
            return
        # dos's update reads the gradients once PyTorch's stream has written them: an event on that stream,
        # waited for by this thread only (no device-wide synchronisation). The step returns when dos's update
        # is complete on the device, so the copies out, on PyTorch's stream, read the new weights.
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self._dev))
        ev.synchronize()
        self._native_step(h, held, "dos_adamw_step_device", h, lrs, len(self.param_groups), 0.0)

    def _native_step(self, h, held, name, *args):
        """Calls dos's step (name, args) and, once it is taken, copies the new weights into the parameters'
        data (held: each parameter's (p, d) of this step) and records them. The step is applied whole: the
        copy-back is set as unsettled before dos steps (_settle), so an exception that arrives once dos has
        taken the step (one that lands as the native call returns, before Python could assign its result, or
        during the copy-back) still gets the copy-back and the bookkeeping, then propagates; dos's step count
        says whether the step was taken."""
        before = _native.call("dos_adamw_get_step", h)
        if before >= MAX_STEP:
            raise ValueError(f"dos.torch.AdamW.step: the step count is {before}, the largest taken ({MAX_STEP}, 2**53: "
                             "a float, as torch keeps the step, holds no larger one exactly); a checkpoint of a larger "
                             "one could not be loaded")
        taken, done = [None], [0]  # dos's answer (1 taken, 0 skipped, -1 not taken); parameters copied back

        def back():
            if taken[0] is None:  # an exception: was the step taken before it arrived?
                taken[0] = 1 if _native.call("dos_adamw_get_step", h) > before else -1
            if taken[0] >= 0:
                self.skipped = taken[0] == 0
            while taken[0] == 1 and done[0] < len(held):
                i = done[0]
                p, d = held[i]
                _write(p, d, self._views[i][1].view(d.shape) if self._cuda else self._wbuf[i].view(d.shape))
                self._mark_seen(i, p, d)
                done[0] += 1
            self._unsettled = None
        self._unsettled = back
        try:
            taken[0] = self._call_step(name, *args)
        finally:
            self._settle()

    _KINDS = {"exp_avg": 1, "exp_avg_sq": 2, "max_exp_avg_sq": 3}

    def state_dict(self):
        """torch.optim.AdamW's state dict: per parameter ``step`` (a float tensor, as torch keeps it),
        ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad), copied out of dos, and the
        param groups. For DTensor parameters (FSDP2's) the moments are DTensors of the parameter's mesh,
        placements and shape holding this rank's shard, as torch's are, so torch.distributed.checkpoint saves
        and loads every rank's shard (on a CUDA mesh they are copied to the GPU, as ``from_local`` places them:
        while the dict is held it takes 8 bytes of device memory per local element, 12 with amsgrad). Every
        parameter has state, from construction on (step 0, zero moments; torch's has none before its first
        step, and starts from the same). ``torch.optim.AdamW.load_state_dict`` loads it, and
        ``load_state_dict`` here loads one of torch's."""
        # torch's state_dict hooks (torch >= 2) run as torch.optim.Optimizer.state_dict runs them, outside the
        # lock: a hook may read opt.state
        for hook in list(getattr(self, "_optimizer_state_dict_pre_hooks", {}).values()):
            hook(self)
        self._handle()
        with self._lock, self._locked():  # not beside a step: the moments and the step count of one step
            sd = self._state_dict()
        for hook in list(getattr(self, "_optimizer_state_dict_post_hooks", {}).values()):
            r = hook(self, sd)
            if r is not None:
                sd = r
        return sd

    def _state_dict(self):
        self._check_layout("state_dict")
        step = _native.call("dos_adamw_get_step", self._handle())
        groups, k = [], 0  # torch's packing: each group's settings, its parameters numbered in order
        for g in self.param_groups:
            packed = {key: v for key, v in g.items() if key != "params"}
            packed["params"] = list(range(k, k + len(g["params"])))
            k += len(g["params"])
            groups.append(packed)
        return {"state": {i: self._fetch_all(i, step) for i in range(len(self._params))}, "param_groups": groups}

    def _keys(self):
        """The state's names of every parameter, as torch.optim.AdamW's."""
        return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.param_groups[0]["amsgrad"] else ())

    def _fetch(self, i, k, step=None):
        """Parameter i's state k, a copy out of dos: step as a plain float tensor, a moment in fp32 (for a DTensor
        parameter, FSDP2's, a DTensor of its placements whose local tensor is this rank's shard)."""
        if k == "step":
            return torch.tensor(float(_native.call("dos_adamw_get_step", self._handle()) if step is None else step))
        t = torch.empty(self._shapes[i], dtype=torch.float32)
        _native.call("dos_adamw_state_get", self._handle(), i, self._KINDS[k], t.data_ptr(), t.numel())
        return _as_param(self._params[i], t)

    def _fetch_all(self, i, step):
        return {k: self._fetch(i, k, step) for k in self._keys()}

    def _checked_state(self, i, k, v, what):
        """v, parameter i's state k from a state dict, checked and as dos takes it: a whole number for step, an
        fp32 CPU tensor of the parameter's (local) shape for a moment; a DTensor moment must have the
        parameter's shape and placements, and its local shard this rank's shard's shape (ValueError)."""
        if k == "step":
            if isinstance(v, int) and not isinstance(v, bool):
                step = v  # exact: a float would round 2**64 + 7
            else:
                step = float(v)
                if not (math.isfinite(step) and step == int(step)):
                    raise ValueError(f"dos.torch.AdamW.{what}: parameter {i}'s step {v}: want a whole number >= 0")
                step = int(step)
            if not 0 <= step <= MAX_STEP:
                raise ValueError(f"dos.torch.AdamW.{what}: parameter {i}'s step {step}: want a whole number from 0 to "
                                 f"{MAX_STEP} (2**53, the largest a float, as torch keeps the step, holds exactly)")
            return step
        if k not in self._keys():
            raise KeyError(f"dos.torch.AdamW.{what}: parameter {i}: no state {k!r}; dos keeps {', '.join(self._keys())}")
        if _is_dtensor(v):  # as _fetch gives it for a DTensor parameter: its placements, this rank's shard
            P = self._params[i]
            if v.shape != P.shape or (_is_dtensor(P) and tuple(v.placements) != tuple(P.placements)):
                raise ValueError(f"dos.torch.AdamW.{what}: parameter {i}'s {k} is a DTensor of shape {tuple(v.shape)} "
                                 f"placed {tuple(v.placements)}, the parameter {tuple(P.shape)} placed "
                                 f"{tuple(P.placements) if _is_dtensor(P) else 'whole on every rank'}")
            if _local(v).shape != self._shapes[i]:
                raise ValueError(f"dos.torch.AdamW.{what}: parameter {i}'s {k} is a DTensor whose local shard has shape "
                                 f"{tuple(_local(v).shape)}, this rank's shard of the parameter {tuple(self._shapes[i])}")
        src = torch.as_tensor(_local(v)).detach()
        if src.is_complex() or src.dtype == torch.bool:
            raise ValueError(f"dos.torch.AdamW.{what}: parameter {i}'s {k} is {src.dtype}: want real values (it is copied "
                             "into float32)")
        if src.shape != self._shapes[i]:
            raise ValueError(f"dos.torch.AdamW.{what}: parameter {i}'s {k} has shape {tuple(src.shape)}, "
                             f"the parameter {tuple(self._shapes[i])}")
        # a private fp32 copy, which dos reads (never the caller's memory); copy_ resolves a lazy negation
        t = torch.empty(self._shapes[i], dtype=torch.float32).copy_(src)
        if not bool(torch.isfinite(t).all()) or (k != "exp_avg" and bool((t < 0).any())):
            raise ValueError(f"dos.torch.AdamW.{what}: parameter {i}'s {k} holds "
                             f"{'negative or ' if k != 'exp_avg' else ''}non-finite values")
        return t

    def _put(self, i, k, v):
        """Writes parameter i's state k (checked by _checked_state) into dos: step is every parameter's."""
        if k == "step":
            _native.call("dos_adamw_set_step", self._handle(), v)
        else:
            _native.call("dos_adamw_state_set", self._handle(), i, self._KINDS[k], v.data_ptr(), v.numel())

    @property
    def state(self):
        """Every parameter's state in dos, as torch.optim's ``state`` (keyed by parameter): ``state[p]`` is a
        mapping of ``step``, ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``) whose values are copied out
        of dos when read (an in-place change of one does not reach dos) and written into dos when set
        (``state[p]["exp_avg"] = t``, checked as ``load_state_dict`` checks; setting ``step`` sets every
        parameter's: dos keeps one). It holds every parameter from construction on, so tools that take an
        empty state for an optimizer never stepped (torch.distributed.checkpoint's ``get_optimizer_state_dict``
        and ``set_optimizer_state_dict``) take no step of their own. Entries cannot be deleted."""
        view = self.__dict__.get("_state_view")
        return view if view is not None else self.__dict__.get("_torch_state")

    @state.setter
    def state(self, value):
        if self.__dict__.get("_state_view") is not None:
            raise TypeError("dos.torch.AdamW.state cannot be replaced: it is a view of dos's state; use "
                            "load_state_dict(), or set opt.state[p][name]")
        self.__dict__["_torch_state"] = value  # torch.optim.Optimizer.__init__'s, until dos's view replaces it

    def load_state_dict(self, state_dict):
        """Loads a state dict of this class or of torch.optim.AdamW (same parameters, same shapes) into
        dos: the moments (in fp32, as the dict holds them), the step (every parameter's must be the same:
        dos keeps one) and the groups' lr. The master weights are the parameters' (load the model first):
        taken from those changed since dos wrote them, as a step takes them; float32 ones on the CPU always.
        It checks everything before changing anything: on error the optimizer is as it was; then it applies
        the dict whole (an exception meanwhile, a Ctrl-C's, propagates once it is applied, as in ``step``): never part old, part new. A dict
        without state (torch's before its first step) starts every parameter from zero moments; one where some
        parameters have state and others none (torch gives state at a parameter's first gradient) is refused,
        naming them: dos keeps one step count for all. The groups' other
        settings (``initial_lr`` and the like) are restored as torch restores them. torch's load_state_dict
        hooks (torch >= 2) run as torch runs them."""
        state_dict = dict(state_dict)  # shallow, as torch's: a pre hook may change it
        for hook in list(getattr(self, "_optimizer_load_state_dict_pre_hooks", {}).values()):
            r = hook(self, state_dict)
            if r is not None:
                state_dict = r
        self._handle()
        with self._lock, self._locked():
            self._load_state_dict(state_dict)
        for hook in list(getattr(self, "_optimizer_load_state_dict_post_hooks", {}).values()):
            hook(self)

    def _load_state_dict(self, state_dict):
        self._handle()
        self._check_layout("load_state_dict")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"dos.torch.AdamW.load_state_dict: {len(groups)} param groups, this optimizer has {len(self.param_groups)}")
        for gi, (g, mine) in enumerate(zip(groups, self.param_groups)):
            if len(g["params"]) != len(mine["params"]):  # torch refuses it so too
                raise ValueError(f"dos.torch.AdamW.load_state_dict: the state dict's param group {gi} has {len(g['params'])} "
                                 f"parameters, this optimizer's {len(mine['params'])}: the loaded state dict contains a "
                                 "parameter group that doesn't match the size of optimizer's group")
        index = [i for g in groups for i in g["params"]]
        if len(index) != len(self._params):
            raise ValueError(f"dos.torch.AdamW.load_state_dict: {len(index)} parameters, this optimizer has {len(self._params)}")
        twice = sorted((k for k, c in Counter(index).items() if c > 1), key=repr)
        if twice:  # torch gives the state to the last parameter listing it; dos would give it to each
            raise ValueError(f"dos.torch.AdamW.load_state_dict: the state dict's param groups list {twice[:8]!r} more than "
                             "once: each parameter has its own index")
        stray = [k for k in state_dict["state"] if k not in set(index)]
        if stray:  # torch parks them under keys no parameter uses; dos would start those parameters from zero
            raise ValueError(f"dos.torch.AdamW.load_state_dict: the state dict's state has keys {stray[:8]!r} that its "
                             f"param groups do not list ({index[:8]!r}...): keys changed on the way (a JSON round trip "
                             "makes them strings?); its state would be lost")
        for gi, (g, fixed) in enumerate(zip(groups, self._fixed)):
            now = self._hyper(g)
            if now != fixed:
                raise ValueError(f"dos.torch.AdamW.load_state_dict: group {gi}'s (weight_decay, betas, eps, amsgrad, maximize) "
                                 f"are {now} in the state dict, {fixed} in this optimizer: dos fixes them at construction")
            _lr(g["lr"], f".load_state_dict: group {gi}")
        moments, steps, data, stateless = [], set(), [], []
        for i, (key, P) in enumerate(zip(index, self._params)):
            st = state_dict["state"].get(key, {})
            if "step" not in st:
                moment = [k for k in self._keys()[1:] if k in st]
                if moment:  # dos would take step 0, and restart bias correction on moments that are not zero
                    raise ValueError(f"dos.torch.AdamW.load_state_dict: parameter {i} has {', '.join(moment)} but no step "
                                     "in the state dict: the step count goes with the moments (torch.optim's step "
                                     "refuses it too)")
                stateless.append(i)
            steps.add(self._checked_state(i, "step", st["step"] if "step" in st else 0, "load_state_dict"))
            m = {}
            for k in self._keys()[1:]:
                if k not in st:  # no state for this parameter yet: zero moments, as torch's first step starts from
                    m[k] = torch.zeros(self._shapes[i], dtype=torch.float32)
                else:
                    m[k] = self._checked_state(i, k, st[k], "load_state_dict")
            moments.append(m)
            p = _local(P)
            data.append((p, self._data(i, p)))  # checked before anything changes
        if len(steps) > 1:
            why = ""
            if stateless:  # torch's optimizer gives state to a parameter at its first gradient
                why = (f": parameters {stateless[:8]}{' ...' if len(stateless) > 8 else ''} have no state in the dict "
                       "(torch's had no gradient for them yet), the others have; give every parameter a gradient "
                       "(zeros) at every step, or leave those out of the optimizer")
            raise ValueError(f"dos.torch.AdamW.load_state_dict: the parameters' steps differ ({sorted(steps)}); "
                             f"dos keeps one step count for all{why}")
        step = steps.pop()
        settings = [{k: v for k, v in sg.items() if k != "params"} for sg in groups]
        self._save_failure_first()
        for i, (p, d) in enumerate(data):  # as a step takes them: dos's master weights are p.data either way
            if self._changed(i, p, d):
                self._take(i, p, d)
        done = [0]  # parameters whose moments are written

        def apply():  # the whole dict, resumable (_settle): never part old, part new
            while done[0] < len(moments):
                for k, t in moments[done[0]].items():
                    self._put(done[0], k, t)
                done[0] += 1
            self._put(0, "step", step)
            for g, sg in zip(self.param_groups, settings):  # as torch: the saved settings, the parameters stay
                g.update(sg)
            self._unsettled = None
        self._unsettled = apply
        self._settle()

    def save(self, root, keep=0, ring_bytes=0):
        """Checkpoints the optimizer lazily into the checkpoint root directory ``root`` (dos's format:
        safetensors files of every parameter's master weights, exp_avg, exp_avg_sq and max_exp_avg_sq, a
        manifest, crash-consistent commit) and returns at once: the state is captured and written in the
        background while training goes on (DataStates-LLM). The returned SaveHandle says when it is durable.
        A relative ``root`` is taken from the current directory at this call (``os.path.abspath``: a later
        ``os.chdir`` changes neither this save nor the directory ``wait()`` returns, which is absolute).
        The param groups' lr values ride along, and ``load`` restores them. ``keep`` > 0 keeps only the newest
        ``keep`` checkpoints under ``root`` (the older ones are retired after each commit; 0 keeps all).
        ``ring_bytes`` is the checkpointer's staging memory between capture and flush (0: 256 MiB; else at least
        ``MIN_RING_BYTES``, 32 MiB, two of its 16 MiB chunks, and at most 2**62; a ValueError otherwise): the step
        after a save waits for the capture of the state it updates on the host (the CPU and streamed
        subgroups'), at the disk's pace through a small ring; a ring that holds that state (12 bytes a
        parameter) captures it at memory speed (on the H200 a gpt2-xl step waited 6.9 s with the default).
        A state that ``load`` would refuse (a master weight or moment gone Inf or NaN, which finite but huge
        gradients can cause) is never committed: ``wait()`` raises DosError naming the tensor, and the previous
        checkpoint stays the latest. A background save that failed is also reported by the next ``step()``, which
        raises that DosError and is not taken (the step count stays; call it again to take it), whether or not
        ``wait()`` was called; once ``wait()`` or a ``step()`` has reported it, steps go on (each failure is
        reported by one step at most), and the same step may be saved again (nothing was committed). A root that another optimizer of this process writes (its retention would
        retire this one's checkpoints) raises DosError: save into another root, or ``close()`` that one first. So does
        a root whose latest committed checkpoint is at this optimizer's step or above (a run resumed from an older
        checkpoint: its save would retire the newer ones): a checkpoint is never replaced or lost. The parameters
        are saved as they are now: those changed since the last step are taken first, as a step takes them.
        At interpreter exit (atexit) the last save of every optimizer still alive then (one held by a daemon
        thread, say) is waited for, unless its handle was waited for already, so a save that ``save`` returned
        commits before the process ends (an optimizer collected earlier waits in ``close``; a save made after
        that wait, from an exit hook registered before dos's, which runs after it, waits in ``save``); one that fails
        there, or in the ``close`` of a collected optimizer, is named on stderr in one line (the exit status
        stays the program's: wait() on the handle is how to fail a run on it)."""
        self._handle()
        with self._lock, self._locked():
            return self._save(root, keep, ring_bytes)

    def _save(self, root, keep, ring_bytes):
        h = self._handle()
        self._check_layout("save")
        # the root as the current directory names it now (not following links): a relative root saved again
        # after os.chdir is another root, and the checkpoint's directory stays right after a chdir
        path = os.path.abspath(_path(root, ".save"))
        step = _native.call("dos_adamw_get_step", h)
        if self._saved_step == (path, step):
            raise ValueError(f"dos.torch.AdamW.save: step {step} is saved into {os.fsdecode(path)} already "
                             "(a checkpoint is never replaced)")
        if isinstance(keep, bool) or not isinstance(keep, int) or not 0 <= keep <= 2**31 - 1:
            raise ValueError(f"dos.torch.AdamW.save: keep={keep!r}: want an int from 0 (0 keeps every checkpoint) to 2**31 - 1")
        if isinstance(ring_bytes, bool) or not isinstance(ring_bytes, int) or not (
                ring_bytes == 0 or MIN_RING_BYTES <= ring_bytes <= 2**62):
            raise ValueError(f"dos.torch.AdamW.save: ring_bytes={ring_bytes!r}: want 0 (the default, 256 MiB) or an int from "
                             f"{MIN_RING_BYTES} (32 MiB: the checkpointer's ring holds at least two 16 MiB chunks) to 2**62 bytes")
        # the parameters as they are now are what is saved: those changed since dos wrote them are taken first,
        # as a step takes them (every one checked before any is taken)
        data = [(_local(P), self._data(i, _local(P))) for i, P in enumerate(self._params)]
        _refuse_overlaps([d for _, d in data], ".save")  # a tie made after construction (p1.data = p0.data)
        for i, (p, d) in enumerate(data):
            if self._changed(i, p, d):
                self._take(i, p, d)
        objects = json.dumps({"torch": {"lrs": [float(g["lr"]) for g in self.param_groups]}}).encode()
        handle = SaveHandle(_native.call("dos_adamw_save", h, path, objects, int(keep), int(ring_bytes)))
        self._saved_step = handle._saved = (path, step)
        handle._opt = weakref.ref(self)  # a failed save forgets the step, so that it can be saved again
        self._last_save = handle
        _saving.add(self)
        if not _exit_hook["registered"]:
            atexit.register(_wait_saves_at_exit)
            _exit_hook["registered"] = True
        elif _exit_hook["ran"]:  # a save from a later exit hook (or a daemon thread at exit): nothing
            handle.wait()  # would wait for it now, so it is durable when save returns (its failure raised)
        return handle

    def load(self, path):
        """Restores the state of a checkpoint written by ``save``: ``path`` is a root (its latest
        checkpoint) or one step directory. The parameters' data is set to the loaded master weights, and the
        groups' lr to the saved ones, whole once dos has loaded (an exception meanwhile propagates after, as in ``step``)."""
        self._handle()
        with self._lock, self._locked():
            self._load(path)

    def _load(self, path):
        self._check_layout("load")
        path = _path(path, ".load")
        data = [(_local(P), self._data(i, _local(P))) for i, P in enumerate(self._params)]  # checked first
        objects = ctypes.c_void_p()
        # set before dos loads (_settle): once dos has loaded (objects set), the parameters' data and the lrs
        # follow whole, whatever arrives meanwhile
        self._unsettled = self._apply_load(data, objects)
        try:
            try:
                _native.call("dos_adamw_load", self._handle(), path, ctypes.byref(objects))
            except _native.DosError as e:
                shown = os.fsdecode(path)
                root = os.path.dirname(os.path.normpath(shown)) if os.path.exists(os.path.join(path, b"manifest.json")) else shown
                if "corrupt" in str(e):
                    raise _native.DosError(f"{e}; `dos ckpt recover {shlex.quote(root)}` sets a checkpoint that does not "
                                           "verify aside (kept whole, as damaged-step-*) and points latest at the newest "
                                           "that does") from e
                aside = sorted(os.fsdecode(n) for n in os.listdir(path) if n.startswith(b"damaged-")) if os.path.isdir(path) else []
                if aside:
                    raise _native.DosError(f"{e}; {shown} holds only checkpoints set aside as damaged ({', '.join(aside)}: "
                                           "they did not verify), none to load") from e
                raise
        finally:
            self._settle()

    def _apply_load(self, data, objects):
        """The unsettled change (_settle) of a load: once dos has loaded (objects, dos's C string of the
        checkpoint's objects, is set), the parameters' data set from the loaded master weights and the groups'
        lr from the checkpoint's torch object, and the C string freed; nothing when dos did not load."""
        done = [0]  # parameters written

        def apply():
            if objects.value:
                self._saved_step = None  # dos refuses a save at or below a root's latest committed step
                while done[0] < len(data):
                    i = done[0]
                    p, d = data[i]
                    _write(p, d, self._master_weights(i).view(d.shape))
                    self._mark_seen(i, p, d)
                    done[0] += 1
                objs = json.loads(ctypes.string_at(objects.value).decode("utf-8", "replace") or "{}")
                t = objs.get("torch")  # dos checked it before loading: an object, lrs finite numbers >= 0, one per group
                lrs = t.get("lrs") if isinstance(t, dict) else None
                if lrs and len(lrs) == len(self.param_groups):
                    for g, lr in zip(self.param_groups, lrs):
                        g["lr"] = lr
                ptr = objects.value
                objects.value = None
                _native.lib().dos_free(ctypes.c_void_p(ptr))
            self._unsettled = None
        return apply

    def placement(self):
        """Where the update phase runs, as a dict: ``device`` (its name, "" for the CPU workers only),
        ``gpu_budget`` (bytes), ``subgroups`` and how many are updated on the ``cpu``, streamed through the
        ``gpu`` or ``resident`` there, ``upcast_on_gpu``, and ``predicted_s``, the performance model's
        predicted update phase in seconds (0 without a profile or calibration)."""
        out = ctypes.c_void_p()
        _native.call("dos_adamw_placement", self._handle(), ctypes.byref(out))
        return json.loads(_native.take_string(out))

    def master_weights(self, i):
        """Parameter i's fp32 master weights (a copy): the parameter itself for float32, the weights its
        16-bit values are rounded from otherwise."""
        if not 0 <= i < len(self._params):
            raise IndexError(f"dos.torch.AdamW.master_weights: parameter {i} of {len(self._params)}")
        self._handle()
        with self._lock, self._locked():  # a change cut short finished first, as every call does
            return self._master_weights(i)

    def _master_weights(self, i):
        """master_weights(i), for a caller that holds the lock."""
        t = torch.empty(self._shapes[i], dtype=torch.float32)
        _native.call("dos_adamw_state_get", self._handle(), i, 0, t.data_ptr(), t.numel())
        return t

    def close(self):
        """Frees dos's optimizer state (first finishing a change an exception cut short, as every call does);
        later steps raise. Called when the optimizer is collected. In a fork()ed
        child it only forgets the handle (dos's runtime does not survive fork(); the parent's state is the
        parent's)."""
        if _native.forked():
            self._h = 0
            return
        lock = self.__dict__.get("_lock")
        if lock is None:  # construction failed before the lock: nothing runs beside this
            h = getattr(self, "_h", 0)
        else:
            with lock, _Call(self, quiet=True):  # after a step, save or load of another thread, never inside one
                h = getattr(self, "_h", 0)
                if h:
                    self._close(h)
                return
        if h:
            self._close(h)

    def _close(self, h):
        """dos_adamw_close, which waits for the last save and raises its failure: that save is reported then
        (the exit hook does not report it again). The handle is forgotten only once dos has closed it: an
        interrupt before leaves it for the next close() (it was forgotten first, and the state and its root's
        ownership lived on for the process)."""
        closed = False
        try:
            _native.call("dos_adamw_close", h)  # closed when it returns or raises (a save's failure)
            closed = True
        except _native.DosError:
            closed = True
            raise
        finally:
            if closed:  # closing a handle dos closed already is nothing: an interrupt just after is harmless
                self._h = 0
                last = self.__dict__.get("_last_save")
                if last is not None:
                    last._reported = True
                _saving.discard(self)

    def __del__(self):
        """close() of a collected optimizer, whose last save's failure nothing else would report: printed on
        stderr in one line. An interrupt during close (a Ctrl-C while it waits for the save) would end the
        finalizer with the failure unread: close is called again (dos kept the first close's error for a
        second one), up to three times, and the interrupt is raised after, which Python prints and ignores, as
        for any finalizer (it cannot reach the program)."""
        interrupted = None
        for _ in range(3):
            try:
                self.close()
            except _native.DosError as e:  # a collected optimizer's last save failed: nothing else will say so
                try:
                    msg = (str(e).splitlines() or [type(e).__name__])[0]
                    print(f"dos.torch.AdamW: collected with its last save failed: {msg}", file=sys.stderr, flush=True)
                except Exception:
                    pass
            except Exception:
                pass
            except BaseException as e:  # noqa: B902 (an interrupt: close again, then raise it)
                interrupted = interrupted or e
                continue
            break
        if interrupted is not None:
            raise interrupted  # Python prints it ("Exception ignored in"): a finalizer cannot pass it on


class _State(MutableMapping):
    """AdamW.state: every parameter's state in dos, keyed by parameter (see AdamW.state)."""

    def __init__(self, opt):
        self._ref = weakref.ref(opt)  # no cycle: the optimizer is freed (and dos's state) when its last user lets go
        self._index = {id(P): i for i, P in enumerate(opt._params)}

    @property
    def _opt(self):
        opt = self._ref()
        if opt is None:
            raise _native.DosError("dos.torch.AdamW: the optimizer is closed")
        return opt

    def _i(self, P):
        i = self._index.get(id(P))
        if i is None or self._opt._params[i] is not P:
            raise KeyError("dos.torch.AdamW.state: not a parameter of this optimizer")
        return i

    def __getitem__(self, P):
        return _ParamState(self._opt, self._i(P))

    def __setitem__(self, P, value):
        """Writes the entries of value (step, exp_avg, ...) into dos, all checked first, then all of them (an
        exception meanwhile propagates after, as in AdamW.step); others stay."""
        i, opt = self._i(P), self._opt
        opt._handle()
        with opt._lock, opt._locked():
            checked = {k: opt._checked_state(i, k, v, "state") for k, v in value.items()}
            opt._save_failure_first()

            def apply():  # all of them, resumable (_settle): each put is idempotent
                for k, v in checked.items():
                    opt._put(i, k, v)
                opt._unsettled = None
            opt._unsettled = apply
            opt._settle()

    def __delitem__(self, P):
        raise TypeError("dos.torch.AdamW.state: a parameter's state cannot be deleted: dos keeps every parameter's")

    def __iter__(self):
        return iter(self._opt._params)

    def __len__(self):
        return len(self._opt._params)

    def __repr__(self):
        return f"<dos.torch.AdamW state of {len(self)} parameters>"

    def __reduce_ex__(self, protocol):
        raise TypeError("dos.torch.AdamW.state is a view of dos's state and cannot be pickled or copied; use state_dict()")


class _ParamState(MutableMapping):
    """One parameter's state in dos: each value copied out when read, written into dos when set."""

    def __init__(self, opt, i):
        self._opt, self._i = opt, i

    def __getitem__(self, k):
        if k not in self._opt._keys():
            raise KeyError(k)
        self._opt._handle()
        with self._opt._lock, self._opt._locked():
            return self._opt._fetch(self._i, k)

    def __setitem__(self, k, v):
        self._opt._handle()
        with self._opt._lock, self._opt._locked():
            self._opt._put(self._i, k, self._opt._checked_state(self._i, k, v, "state"))

    def __delitem__(self, k):
        raise TypeError(f"dos.torch.AdamW.state: {k!r} cannot be deleted: dos keeps it")

    def __iter__(self):
        return iter(self._opt._keys())

    def __len__(self):
        return len(self._opt._keys())

    def __repr__(self):
        return repr(dict(self))

    def __reduce_ex__(self, protocol):
        raise TypeError("dos.torch.AdamW.state[p] is a view of dos's state and cannot be pickled or copied; "
                        "use dict(opt.state[p]) or state_dict()")


class SaveHandle:
    """A lazy save of ``AdamW.save``: ``done()`` without waiting, ``wait()`` until it is durable (returns
    the checkpoint's directory; raises dos.DosError if it failed: the previous checkpoint stays the latest)."""

    def __init__(self, h):
        self._h = h
        self._reported = False  # whether wait() returned or raised (or step() reported its failure)

    def done(self):
        return bool(_native.lib().dos_save_done(self._h))

    def wait(self):
        d = ctypes.c_void_p()
        try:
            _native.call("dos_save_wait", self._h, ctypes.byref(d))
        except _native.DosError:
            self._reported = True
            ref = getattr(self, "_opt", None)
            opt = ref() if ref is not None else None
            if opt is not None and opt._saved_step == getattr(self, "_saved", None):
                opt._saved_step = None  # nothing was committed: the same step may be saved again
            raise
        self._reported = True
        return os.fsdecode(_native.take_bytes(d))

    def __del__(self):
        try:
            if _native.forked():
                return  # dos's runtime is the parent's
            _native.lib().dos_save_free(self._h)
        except Exception:
            pass
