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
