"""dos.torch.AdamW against an adversary's findings (repro-adv/01..12): out-of-range steps and save options,
edited param groups, dos reading or writing user memory with the GIL released, stale saves, close() racing
save(), lazy negation bits, parameters sharing storage, a branch's save replacing a committed checkpoint, a
replaced parameter at the old address, group sizes of a loaded state dict, torch's state_dict hooks."""
import collections
import ctypes
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import dos
import dos.torch as dt
from dos import _native

HERE = os.path.dirname(os.path.abspath(__file__))


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE)] + sys.path))


def _stepped(n=4, steps=3, dtype=torch.float32, lr=1e-2):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n).to(dtype))
    o = dt.AdamW([p], lr=lr)
    for _ in range(steps):
        p.grad = torch.randn(n).to(dtype)
        o.step()
    return p, o


# 1
@pytest.mark.parametrize("step", [float(2**64), 1e300, float(2**63), 2**64 + 7, 2**53 + 1, -1])
def test_step_out_of_range_refused_before_anything_changes(step):
    """A step beyond 2**53 (ctypes wrapped 2**64 and 1e300 to 0; 2**63 was refused by Go after the moments were
    written) is refused by load_state_dict and by opt.state[p]["step"], and a failed load changes nothing."""
    p, o = _stepped()
    before = o.state_dict()
    bad = o.state_dict()
    bad["state"][0]["exp_avg"] = torch.full((4,), 123.0)
    bad["state"][0]["step"] = torch.tensor(step) if isinstance(step, float) else step
    with pytest.raises(ValueError, match="parameter 0's step"):
        o.load_state_dict(bad)
    with pytest.raises(ValueError, match="parameter 0's step"):
        o.state[p]["step"] = step
    after = o.state_dict()
    assert torch.equal(after["state"][0]["exp_avg"], before["state"][0]["exp_avg"])
    assert after["state"][0]["step"].item() == 3.0
    o.state[p]["step"] = 2**53  # the bound itself is taken
    assert o.state[p]["step"].item() == float(2**53)


# 2
@pytest.mark.parametrize("edit", ["append", "swap", "replace", "new group"])
def test_edited_param_groups_refused(edit, tmp_path):
    """Editing param_groups[i]["params"] after construction (ignored by step() before, and state_dict() then
    numbered dos's state by the edited groups) raises at step, state_dict, load_state_dict and save; put back,
    everything works again."""
    torch.manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(4)) for _ in range(3))
    for p in (a, b, c):
        p.grad = torch.ones(4)
    o = dt.AdamW([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=1e-2)
    o.step()
    sd = o.state_dict()
    g0, g1 = o.param_groups[0]["params"], o.param_groups[1]["params"]
    if edit == "append":
        g0.append(c)
    elif edit == "swap":
        o.param_groups[0]["params"], o.param_groups[1]["params"] = g1, g0
    elif edit == "replace":
        o.param_groups[0]["params"] = [c]
    else:
        o.param_groups.append({"params": [c], "lr": 0.1})
    for call in (o.step, o.state_dict, lambda: o.load_state_dict(sd), lambda: o.save(str(tmp_path))):
        with pytest.raises(ValueError, match=r"param groups' \"params\" were changed after construction"):
            call()
    if edit == "new group":
        o.param_groups.pop()
    else:
        o.param_groups[0]["params"], o.param_groups[1]["params"] = g0, g1
        if edit == "append":
            g0.pop()
    o.step()
    assert o.state_dict()["state"][1]["step"].item() == 2.0


# 3
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dos_is_handed_only_private_buffers(dtype, monkeypatch):
    """With the GIL released dos reads and writes no user tensor's memory (another thread's p.data.resize_()
    could free it meanwhile: Go faulted in the step's copy-out): every pointer the step, the master weights'
    take, opt.state and load_state_dict hand dos lies outside every parameter's data, gradient and the values
    given. torch's copy_ moves them, with the GIL held."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in ((64,), (8, 9))]
    o = dt.AdamW(ps, lr=1e-2)
    given = []  # the user's tensors given besides the parameters and their gradients
    calls = []
    real = _native.call

    def spy(name, *args):  # checked at the call, against the user's tensors alive then
        ptrs = []
        if name == "dos_adamw_step":
            ptrs = [args[2][i] for i in range(args[1])] + [args[4][i] for i in range(args[1])]
        elif name == "dos_adamw_state_set":
            ptrs = [args[3]]
        if ptrs:
            calls.append(name)
            for t in [p.data for p in ps] + [p.grad for p in ps if p.grad is not None] + given:
                lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
                assert not any(lo <= q < hi for q in ptrs), f"{name} was handed memory of a user tensor {tuple(t.shape)}"
        return real(name, *args)

    monkeypatch.setattr(_native, "call", spy)
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn(p.shape).to(dtype)
        with torch.no_grad():
            ps[1].mul_(0.5)  # changed in place: its master weights are taken at the step
        o.step()
    given.append(torch.ones(64))
    o.state[ps[0]]["exp_avg"] = given[-1]
    sd = o.state_dict()
    given.extend(t for st in sd["state"].values() for t in st.values())
    o.load_state_dict(sd)
    assert calls.count("dos_adamw_step") == 2 and calls.count("dos_adamw_state_set") >= 2 + 1 + 2 * 2


def test_resize_during_native_step_does_not_crash():
    """repro-adv/03: another thread resizes p.data in place (freeing its 16 MiB buffer, unmapped at once) while
    dos's native step runs with the GIL released: dos reads and writes only its private buffers, so the step
    survives and its new weights land in the new buffer. (A resize *during* torch's own copy_, which releases
    the GIL too, is a data race in the user's program, as during torch.optim.AdamW's in-place update: seen on
    the H200, it faulted inside torch's copy_; no optimizer can guard it.) In a subprocess, so that a fault fails
    this test rather than ending pytest."""
    code = r"""
import threading, torch, dos.torch as dt
from dos import _native
N = 1 << 22
p = torch.nn.Parameter(torch.zeros(N)); p.grad = torch.ones(N)
o = dt.AdamW([p], lr=1e-3, threads=1)
o.step()
real, resized = _native.call, []
def call(name, *args):
    if name != "dos_adamw_step":
        return real(name, *args)
    def resize():
        with torch.no_grad():
            p.data.resize_(2 * N)
        resized.append(p.data.data_ptr())
    th = threading.Thread(target=resize); th.start()
    th.join()  # inside the native step's window: the old buffer is gone before dos's step begins
    return real(name, *args)
_native.call = call
for trial in range(3):
    p.data = torch.zeros(N)
    before = p.data.data_ptr()
    o.step()
    assert resized[-1] != before, "resize_ kept the buffer: the test proves nothing"
    # p keeps its shape over the new buffer, which got the step's new weights: -lr * sign(grad) from 0
    assert p.data_ptr() == resized[-1] and p.shape == (N,), (p.data_ptr(), resized[-1], p.shape)
    assert torch.equal(p.data, torch.full((N,), -1e-3)), p.data[:4]
print("survived")
"""
    r = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "survived" in r.stdout, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"


# 4
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_takes_parameters_changed_since_the_step(dtype, tmp_path):
    """A parameter clamped between step() and save() is saved as it is (it was saved as the step left it, and
    load() restored the stale weights): a save/load in between keeps the trajectory bit for bit."""
    def run(save_and_load):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(8).to(dtype))
        o = dt.AdamW([p], lr=1e-1)
        g = torch.Generator().manual_seed(1)
        for s in range(6):
            p.grad = torch.randn(8, generator=g).to(dtype)
            o.step()
            if s == 2:
                with torch.no_grad():
                    p.clamp_(-0.5, 0.5)
                if save_and_load:
                    root = str(tmp_path / f"r{dtype}")
                    o.save(root).wait()
                    o2 = dt.AdamW([p], lr=1e-1)
                    o.close()
                    o2.load(root)
                    o = o2
        return p.detach().clone()

    assert torch.equal(run(False), run(True))


# 5
def test_close_racing_save_leaves_no_root_owned(tmp_path):
    """close() in one thread while another's save() runs: the closed optimizer kept the root (and its engine)
    for the rest of the process; now a new optimizer saves into it."""
    for trial in range(20):
        root = str(tmp_path / f"r{trial}")
        p = torch.nn.Parameter(torch.zeros(1000))
        p.grad = torch.ones(1000)
        o = dt.AdamW([p], lr=1e-3)
        o.step()
        bar = threading.Barrier(2)

        def closer():
            bar.wait()
            time.sleep((trial % 10) * 20e-6)
            o.close()

        th = threading.Thread(target=closer)
        th.start()
        bar.wait()
        try:
            o.save(root, ring_bytes=64 << 20).wait()
        except dos.DosError as e:
            assert "closed" in str(e)
        th.join()
        del o
        q = torch.nn.Parameter(torch.zeros(1000))
        q.grad = torch.ones(1000)
        o2 = dt.AdamW([q], lr=1e-3)
        o2.step()
        o2.step()  # above the step the closed one may have committed
        assert o2.save(root, ring_bytes=64 << 20).wait().endswith("step-000000002")
        o2.close()


# 6
def test_lazy_negation_is_resolved():
    """A gradient with torch's lazy negation bit (_neg_view) stepped with the opposite sign, and
    opt.state[p]["exp_avg"] = a neg view stored the un-negated values."""
    def run(cls):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4))
        o = cls([p], lr=0.1)
        p.grad = torch.ones(4)._neg_view()
        o.step()
        return p.detach().clone()

    assert torch.allclose(run(dt.AdamW), run(torch.optim.AdamW))
    q = torch.nn.Parameter(torch.zeros(2))
    o = dt.AdamW([q])
    o.state[q]["exp_avg"] = torch.ones(2)._neg_view()
    assert o.state[q]["exp_avg"].tolist() == [-1.0, -1.0]


# 7
@pytest.mark.parametrize("view", ["whole", "slice"])
def test_parameters_sharing_storage_refused(view):
    """Two Parameters over one storage (dos read both before the step, so one's write undid the other's
    update) are refused at construction; adjacent slices of one storage are not."""
    base = torch.randn(8)
    a = torch.nn.Parameter(base)
    b = torch.nn.Parameter(base if view == "whole" else base[2:6])
    with pytest.raises(ValueError, match="parameters 0 .* and 1 .* share memory"):
        dt.AdamW([a, b], lr=0.1)
    dt.AdamW([torch.nn.Parameter(base[:4]), torch.nn.Parameter(base[4:])], lr=0.1).close()


# 8
def test_save_refused_below_the_roots_committed_step(tmp_path):
    """Resumed from an older checkpoint of a root, a save into that root (which made the newer, durable
    checkpoints uncommitted, and then replaced step 6) raises naming the root and both steps; the newer
    checkpoint stays the latest and loads."""
    root = str(tmp_path)
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4))
    o = dt.AdamW([p], lr=1e-2)
    for s in range(1, 7):
        p.grad = torch.randn(4)
        o.step()
        if s in (3, 6):
            o.save(root).wait()
    at6 = o.master_weights(0)
    o.load(os.path.join(root, "step-000000003"))
    p.grad = torch.randn(4)
    o.step()
    with pytest.raises(dos.DosError, match=rf"root {root} holds a committed checkpoint at step 6, and this optimizer is at step 4.*another root"):
        o.save(root)
    o.step()
    o.step()
    with pytest.raises(dos.DosError, match=rf"step 6 is saved into {root} already"):
        o.save(root)
    assert open(os.path.join(root, "latest")).read().strip() == "step-000000006"
    o2 = dt.AdamW([torch.nn.Parameter(torch.zeros(4))], lr=1e-2)
    o2.load(root)
    assert torch.equal(o2.master_weights(0), at6)
    o.step()
    assert o.save(root).wait().endswith("step-000000007")  # beyond the latest: taken


# 9
def test_replaced_parameter_at_the_old_address_is_taken():
    """bf16: p.data = t leaves p._version, and a new buffer may land at the old address; the replacement was
    missed and dos stepped on from its old master weights. The storage dos saw is held, so it cannot."""
    N = 1 << 24  # 32 MiB of bf16: glibc mmaps it
    p = torch.nn.Parameter(torch.zeros(N, dtype=torch.bfloat16))
    o = dt.AdamW([p], lr=1e-2)
    p.grad = torch.ones(N, dtype=torch.bfloat16)
    o.step()
    tmp = torch.empty(N, dtype=torch.bfloat16)
    p.data = tmp
    del tmp
    p.data = torch.full((N,), 7.0, dtype=torch.bfloat16)
    o.step()
    assert abs(p[0].item() - 7.0) < 0.1 and abs(o.master_weights(0)[0].item() - 7.0) < 0.1
    p.data = p.data.to(torch.float16)
    p.data = p.data.to(torch.bfloat16).fill_(3.0)
    o.step()
    assert abs(p[0].item() - 3.0) < 0.1


# 10
def test_load_state_dict_refuses_other_group_sizes():
    """torch refuses a state dict whose groups hold other numbers of parameters; dos loaded it, moving a
    parameter to another group's lr."""
    ps = [torch.nn.Parameter(torch.randn(3)) for _ in range(3)]
    src = dt.AdamW([{"params": ps[:2], "lr": 0.1}, {"params": ps[2:], "lr": 0.001}])
    sd = src.state_dict()
    d = dt.AdamW([{"params": ps[:1], "lr": 0.1}, {"params": ps[1:], "lr": 0.001}])
    before = [g["lr"] for g in d.param_groups]
    with pytest.raises(ValueError, match="param group 0 has 2 parameters, this optimizer's 1"):
        d.load_state_dict(sd)
    assert [g["lr"] for g in d.param_groups] == before


def test_load_state_dict_restores_group_settings():
    """load_state_dict restored only lr; torch restores every saved group setting (initial_lr of a scheduler)."""
    p = torch.nn.Parameter(torch.randn(3))
    src = dt.AdamW([p], lr=0.1)
    torch.optim.lr_scheduler.StepLR(src, 1)
    sd = src.state_dict()
    dst = dt.AdamW([torch.nn.Parameter(torch.randn(3))], lr=0.5)
    dst.load_state_dict(sd)
    assert dst.param_groups[0]["initial_lr"] == 0.1 and dst.param_groups[0]["lr"] == 0.1


def test_gradient_of_another_shape_refused():
    """A gradient with the parameter's element count but another shape was taken (torch errors)."""
    p = torch.nn.Parameter(torch.randn(4))
    o = dt.AdamW([p])
    p.grad = torch.ones(4)
    p.grad.data = torch.ones(2, 2)  # torch's setter checks the size; this goes around it
    with pytest.raises(ValueError, match=r"gradient of shape \(2, 2\)"):
        o.step()


# 11
@pytest.mark.parametrize("kw", [dict(keep=2**32 + 1), dict(keep=2**31), dict(ring_bytes=2**64), dict(ring_bytes=2**63)])
def test_save_options_out_of_range_refused(kw, tmp_path):
    """keep passed as a C int32 (2**32 + 1 wrapped to 1, and retention deleted every older checkpoint),
    ring_bytes as an int64: out of range, refused before dos is called."""
    p, o = _stepped()
    o.save(str(tmp_path)).wait()
    o.step()
    with pytest.raises(ValueError, match=r"want (an int from 0|0 \(the default)"):
        o.save(str(tmp_path), **kw)
    assert sorted(x for x in os.listdir(tmp_path) if x.startswith("step")) == ["step-000000003"]


def test_non_utf8_root(tmp_path):
    """wait() returned a non-UTF-8 root's directory with U+FFFD, which load() could not open."""
    root = os.path.join(os.fsencode(str(tmp_path)), b"r\xff")
    p, o = _stepped()
    d = o.save(root).wait()
    assert os.fsencode(d) == os.path.join(root, b"step-000000003")
    o.load(d)


# 12
HOOKS = r"""
import collections, torch, dos.torch as dt
p = torch.nn.Parameter(torch.randn(4)); p.grad = torch.randn(4)
o = dt.AdamW([p], lr=1e-2); o.step()
calls = []
def sd_pre(opt):
    calls.append(("sd_pre", opt.state[p]["exp_avg"].shape))  # reads opt.state: takes the optimizer's lock
def sd_post(opt, sd):
    calls.append("sd_post"); sd = dict(sd); sd["extra"] = 1; return sd
def ld_pre(opt, sd):
    calls.append(("ld_pre", opt.state[p]["step"].item())); sd = dict(sd); sd.pop("extra"); return sd
def ld_post(opt):
    calls.append(("ld_post", opt.state[p]["step"].item()))
if hasattr(o, "register_state_dict_pre_hook"):  # torch >= 2: its API
    o.register_state_dict_pre_hook(sd_pre); o.register_state_dict_post_hook(sd_post)
    o.register_load_state_dict_pre_hook(ld_pre); o.register_load_state_dict_post_hook(ld_post)
else:  # torch 1.13: the dicts torch 2 keeps them in
    o._optimizer_state_dict_pre_hooks = collections.OrderedDict({0: sd_pre})
    o._optimizer_state_dict_post_hooks = collections.OrderedDict({0: sd_post})
    o._optimizer_load_state_dict_pre_hooks = collections.OrderedDict({0: ld_pre})
    o._optimizer_load_state_dict_post_hooks = collections.OrderedDict({0: ld_post})
sd = o.state_dict()
assert sd["extra"] == 1, sd.keys()
sd["state"][0]["step"] = torch.tensor(5.0)
o.load_state_dict(sd)
print(calls)
assert calls == [("sd_pre", torch.Size([4])), "sd_post", ("ld_pre", 1.0), ("ld_post", 5.0)], calls
print("ok")
"""


def test_state_dict_hooks_run_outside_the_lock():
    """torch's optimizer state_dict and load_state_dict hooks run as torch runs them (load's never ran), and a
    hook that reads opt.state does not deadlock (state_dict held the non-reentrant lock across torch's
    state_dict, which runs the hooks). In a subprocess with a timeout, so that a deadlock fails the test."""
    try:
        r = subprocess.run([sys.executable, "-c", HOOKS], env=_env(), capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("state_dict() with a hook reading opt.state deadlocked")
    assert r.returncode == 0 and r.stdout.endswith("ok\n"), f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"


def test_torch_state_dict_machinery_never_runs_under_the_lock():
    """torch 1.13 too: torch.optim.Optimizer.state_dict (where torch >= 2 runs user hooks) calling back into
    opt.state deadlocked, as it ran under the optimizer's lock; dos builds the dict itself (subprocess, timeout)."""
    code = r"""
import torch, dos.torch as dt
orig = torch.optim.Optimizer.state_dict
def patched(self):
    for q in self.param_groups[0]["params"]:
        self.state[q]["exp_avg"]
    return orig(self)
torch.optim.Optimizer.state_dict = patched
p = torch.nn.Parameter(torch.randn(4)); p.grad = torch.randn(4)
o = dt.AdamW([p], lr=1e-2); o.step()
sd = o.state_dict()
assert sd["param_groups"][0]["params"] == [0] and sd["state"][0]["step"].item() == 1.0
t = torch.optim.AdamW([torch.nn.Parameter(torch.randn(4))], lr=1e-2)
torch.optim.Optimizer.state_dict = orig
t.load_state_dict(sd)
# torch's implementation switches, and decoupled_weight_decay (torch >= 2.6's AdamW, an Adam subclass,
# sets it True itself whenever state is loaded into it), are not dos's
missing = set(t.state_dict()["param_groups"][0]) - set(sd["param_groups"][0]) - {"foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay"}
assert not missing, f"dos's param group lacks torch's {sorted(missing)}"
print("ok")
"""
    try:
        r = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("state_dict() deadlocked on its own lock")
    assert r.returncode == 0 and r.stdout.endswith("ok\n"), f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
