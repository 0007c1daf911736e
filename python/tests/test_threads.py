"""dos.torch.AdamW when another thread replaces p.data while steps run (issue 29, item 1)."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replace_data_while_stepping(dtype):
    """One thread steps in a loop for 3 s, another keeps replacing p.data with tensors of other sizes, dtypes
    and layouts (and back): the process does not crash, and every step succeeds or raises ValueError or
    DosError (replace_worker.py, in a subprocess so that a segfault fails this test)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE)] + sys.path))
    r = subprocess.run([sys.executable, os.path.join(HERE, "replace_worker.py"), dtype, "3"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    ok, steps, errors = r.stdout.split()
    assert ok == "ok" and int(steps) > 0 and int(errors) > 0, r.stdout


def test_calls_touch_the_users_tensors_only_with_the_gil_held():
    """step(), save(), load(), state_dict() and load_state_dict() apply to the user's parameters and gradients only
    what torch runs with the GIL held, as it runs another thread's p.data = t: attribute reads (p.data, p.grad,
    p._version) and basic indexing (p[None]; torch may skip the mode for a Parameter's), never a method
    such as p.as_strided or p.grad.detach, which read the tensor with the GIL released: another thread's
    p.data = t or p.grad.data = t meanwhile freed the storage they were taking, a segfault (a new user's trial
    saw test_replace_data_while_stepping exit -11; a loop of p.as_strided, or of p.grad.detach(), beside a loop
    of p.data = t, or p.grad.data = t, segfaulted in 6 runs of 8, and 2 of 3, of 5 s). A race is rare in a
    test's seconds: every operation on a tensor passes torch's function mode, which records those on the
    user's."""
    import tempfile

    import torch
    from torch.overrides import TorchFunctionMode

    import dos.torch as dt

    def what(func):
        name, owner = getattr(func, "__name__", ""), getattr(func, "__self__", None)
        if name == "__get__" and owner is not None:  # an attribute read: Tensor.data.__get__
            return "read " + getattr(owner, "__name__", "?")
        if name == "__getitem__":  # indexing (a Parameter's skips the mode)
            return "read []"
        return getattr(func, "__qualname__", None) or name or repr(func)

    for dtype in (torch.float32, torch.bfloat16):
        ps = [torch.nn.Parameter(torch.randn(5).to(dtype)), torch.nn.Parameter(torch.randn(2, 3).to(dtype)),
              torch.nn.Parameter(torch.tensor(0.5).to(dtype))]
        for p in ps:
            p.grad = torch.full_like(p, 0.01)
        opt = dt.AdamW(ps, lr=1e-2)
        users = {id(t) for p in ps for t in (p, p.grad)}
        applied = {}

        class Record(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if any(id(a) in users for a in (*args, *kwargs.values())):
                    applied.setdefault(what(func), set()).add(call)
                return func(*args, **kwargs)

        versions = [p._version for p in ps]
        with tempfile.TemporaryDirectory() as root, Record():
            call = "step"
            opt.step()
            call = "save"
            opt.save(root).wait()
            call = "state_dict"
            sd = opt.state_dict()
            call = "load_state_dict"
            opt.load_state_dict(sd)
            call = "load"
            opt.load(root)
        methods = {f: sorted(calls) for f, calls in applied.items() if not f.startswith("read ")}
        assert not methods, f"{dtype}: methods applied to the user's tensors: {methods}"
        assert "read data" in applied and "read grad" in applied, applied  # the mode saw the calls' reads
        assert all(p._version > v for p, v in zip(ps, versions)), "dos's writes bumped no version"


def test_step_refuses_buffers_of_another_size():
    """capi's dos_adamw_step takes each buffer's element count and refuses one that is not the parameter's,
    before reading any (it copied the parameter's length from and into whatever the pointer held)."""
    import ctypes

    import torch

    import dos
    import dos.torch as dt
    from dos import _native

    ps = [torch.nn.Parameter(torch.ones(8)), torch.nn.Parameter(torch.ones(3))]
    opt = dt.AdamW(ps, lr=0.1)
    small = [torch.zeros(1), torch.zeros(3)]
    grads = [torch.ones(8), torch.ones(3)]
    params, gp = (ctypes.c_void_p * 2)(*[t.data_ptr() for t in small]), (ctypes.c_void_p * 2)(*[t.data_ptr() for t in grads])
    lens = lambda ts: (ctypes.c_int64 * 2)(*[t.numel() for t in ts])
    lrs = (ctypes.c_double * 1)(0.1)
    with pytest.raises(dos.DosError, match="p0: a data buffer of 1 elements and a gradient of 8; the parameter has 8"):
        _native.call("dos_adamw_step", opt._h, 2, params, lens(small), gp, lens(grads), lrs, 1, 0.0, _native.REDUCE_FN())
    with pytest.raises(dos.DosError, match="1 parameters' buffers for an optimizer of 2"):
        _native.call("dos_adamw_step", opt._h, 1, params, lens(small), gp, lens(grads), lrs, 1, 0.0, _native.REDUCE_FN())
    assert torch.equal(small[0], torch.zeros(1)) and _native.call("dos_adamw_get_step", opt._h) == 0
