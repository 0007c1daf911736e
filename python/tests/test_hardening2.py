"""dos.torch.AdamW against a second adversary's findings (repro-adv2/01..09): a fork()ed child calling into
dos, a checkpoint's step beyond 2**53, parameters tied after construction, Ctrl-C landing right after dos's
step returns, a group-count mismatch on load, save's ring_bytes range, a failed lazy save failing the next
step, and a checkpoint's foreign "torch" object."""
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

import dos
import dos.torch as dt
from dos import _native
from test_hardening import _stepped  # the tests' directory is on sys.path (pytest's rootdir insertion)


def _step_count(o):
    return int(o.state_dict()["state"][0]["step"].item())


# 1
def test_fork_child_refuses_calls_into_dos(tmp_path):
    """A fork()ed child's step() (a parameter large enough that dos copies it on several goroutines) and
    save().wait() hung for ever: Go's runtime does not survive fork(). Every call into dos in the child raises
    DosError naming the building process and the remedy; close() and collection there do not call into Go;
    the parent goes on."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        import torch
        import dos, dos.torch as dt
        N = 3_000_000
        p = torch.nn.Parameter(torch.randn(N))
        o = dt.AdamW([p], lr=1e-2)
        p.grad = torch.randn(N)
        o.step()
        h = o.save({str(tmp_path / "parent")!r})
        h.wait()
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a hang ends the child with SIGALRM
            bad = []
            for what, f in [("step", o.step), ("save", lambda: o.save({str(tmp_path / "child")!r}).wait()),
                            ("state_dict", o.state_dict), ("load", lambda: o.load({str(tmp_path / "parent")!r})),
                            ("master_weights", lambda: o.master_weights(0)), ("state", lambda: o.state[p]["step"]),
                            ("wait", h.wait), ("done", h.done),
                            ("a new optimizer", lambda: dt.AdamW([torch.nn.Parameter(torch.randn(8))], lr=1e-2))]:
                try:
                    f()
                    bad.append(what + ": no error")
                except dos.DosError as e:
                    if "fork()" not in str(e) or f"process {{os.getppid()}}" not in str(e) or "spawn" not in str(e):
                        bad.append(what + ": " + str(e))
            o.close()
            del o, h
            print("CHILD", bad, flush=True)
            os._exit(0 if not bad else 3)
        _, st = os.waitpid(pid, 0)
        print("STATUS", os.WIFEXITED(st) and os.WEXITSTATUS(st), os.WIFSIGNALED(st) and os.WTERMSIG(st), flush=True)
        p.grad = torch.randn(N)
        o.step()  # the parent's optimizer is whole
        print("PARENT", int(o.state_dict()["state"][0]["step"].item()), flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(dos.__file__))] + sys.path))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CHILD []" in r.stdout, r.stdout + r.stderr
    assert "STATUS 0 False" in r.stdout, r.stdout + r.stderr
    assert "PARENT 2" in r.stdout, r.stdout + r.stderr


# 2
def test_load_refuses_step_above_2_53_before_anything_changes(tmp_path):
    """load() took a checkpoint at step 2**63 - 1 (the next step overflowed dos's counter); a step above 2**53
    (the bound of load_state_dict and opt.state) is refused, naming the checkpoint and the step, and the
    optimizer is as it was."""
    p, o = _stepped()
    big = 2**53 + 1
    _native.call("dos_adamw_set_step", o._h, big)
    d = o.save(tmp_path).wait()
    o.close()
    torch.manual_seed(1)
    q = torch.nn.Parameter(torch.randn(4))
    o2 = dt.AdamW([q], lr=1e-2)
    q.grad = torch.randn(4)
    o2.step()
    before, master = q.detach().clone(), o2.master_weights(0)
    with pytest.raises(dos.DosError) as e:
        o2.load(tmp_path)
    assert str(big) in str(e.value) and d in str(e.value) and "2**53" in str(e.value)
    assert _step_count(o2) == 1
    assert torch.equal(q.detach(), before) and torch.equal(o2.master_weights(0), master)
    q.grad = torch.randn(4)
    o2.step()
    assert _step_count(o2) == 2


def test_load_takes_step_2_53(tmp_path):
    """The bound itself loads (as load_state_dict takes it)."""
    p, o = _stepped()
    _native.call("dos_adamw_set_step", o._h, 2**53)
    o.save(tmp_path).wait()
    o.close()
    q = torch.nn.Parameter(torch.zeros(4))
    o2 = dt.AdamW([q], lr=1e-2)
    o2.load(tmp_path)
    assert _step_count(o2) == 2**53


# 3
def test_tie_after_construction_refused_by_step_and_save(tmp_path):
    """p1.data = p0.data after construction: step() updated both from one storage and p0's update was lost,
    silently. step() and save() refuse it as the constructor does, before anything changes."""
    torch.manual_seed(0)
    p0, p1 = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    o = dt.AdamW([p0, p1], lr=1e-2)
    p0.grad, p1.grad = torch.randn(4), torch.randn(4)
    o.step()
    p1.data = p0.data
    p0.grad, p1.grad = torch.randn(4), torch.randn(4)
    before = p0.detach().clone()
    with pytest.raises(ValueError, match=r"parameters 0 \(4,\) and 1 \(4,\) share memory.*p1.data = p0.data"):
        o.step()
    assert _step_count(o) == 1 and torch.equal(p0.detach(), before)
    with pytest.raises(ValueError, match="share memory"):
        o.save(tmp_path)
    assert not os.path.exists(tmp_path / "latest")
    p1.data = p0.data.clone()  # untied: steps go on
    o.step()
    assert _step_count(o) == 2


def test_partial_overlap_after_construction_refused():
    """A view into another parameter's storage (p1.data = p0.data[2:]) overlaps it too."""
    torch.manual_seed(0)
    p0, p1 = torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(4))
    o = dt.AdamW([p0, p1], lr=1e-2)
    p1.data = p0.data[2:]
    p0.grad, p1.grad = torch.randn(6), torch.randn(4)
    with pytest.raises(ValueError, match="share memory"):
        o.step()
    assert _step_count(o) == 0


# 4
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keyboard_interrupt_right_after_native_step_still_applies_it(monkeypatch, dtype):
    """A SIGINT during step() is raised as soon as dos's call returns: dos had taken the step but p.data kept
    the old weights, and a save-on-Ctrl-C re-took them. The interrupt is made to arrive exactly there: the
    copy-back still runs, then the KeyboardInterrupt propagates."""
    p, o = _stepped(dtype=dtype, steps=1)
    before = p.detach().clone()
    real = _native.call

    def interrupted(name, *args):
        r = real(name, *args)
        if name == "dos_adamw_step":
            raise KeyboardInterrupt
        return r
    monkeypatch.setattr(_native, "call", interrupted)
    p.grad = torch.randn(4).to(dtype)
    with pytest.raises(KeyboardInterrupt):
        o.step()
    monkeypatch.setattr(_native, "call", real)
    assert _step_count(o) == 2
    assert not torch.equal(p.detach(), before)
    assert torch.equal(p.detach(), o.master_weights(0).to(dtype))
    assert o.skipped is False


def test_keyboard_interrupt_before_native_step_takes_nothing(monkeypatch):
    """An interrupt that lands before dos steps takes nothing: p.data and the step count stay."""
    p, o = _stepped(steps=1)
    before = p.detach().clone()
    real = _native.call

    def interrupted(name, *args):
        if name == "dos_adamw_step":
            raise KeyboardInterrupt
        return real(name, *args)
    monkeypatch.setattr(_native, "call", interrupted)
    p.grad = torch.randn(4)
    with pytest.raises(KeyboardInterrupt):
        o.step()
    monkeypatch.setattr(_native, "call", real)
    assert _step_count(o) == 1 and torch.equal(p.detach(), before)


# 5
def test_load_group_count_mismatch_says_so(tmp_path):
    """A one-group checkpoint loaded into a two-group optimizer blamed the hyperparameters; the message says
    the param group counts differ."""
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    o = dt.AdamW([a, b], lr=1e-2)
    a.grad, b.grad = torch.randn(3), torch.randn(2)
    o.step()
    d = o.save(tmp_path).wait()
    o.close()
    o2 = dt.AdamW([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=1e-2)
    with pytest.raises(dos.DosError, match=r"saved with 1 parameter groups; this optimizer has 2") as e:
        o2.load(d)
    assert d in str(e.value) and "betas" not in str(e.value)
    assert _step_count(o2) == 0


# 6 (07)
def test_ring_bytes_range_is_gos(tmp_path):
    """ring_bytes from 1 to 32 MiB - 1 passed the binding's check (documented 0..2**62) and Go refused it; the
    binding refuses it first (ValueError naming the bound), and 32 MiB and 0 save."""
    p, o = _stepped()
    for bad in (1, 1 << 20, 33554432 - 1, 2**62 + 1, -1):
        with pytest.raises(ValueError, match=r"ring_bytes=.*33554432"):
            o.save(tmp_path / "a", ring_bytes=bad)
    assert o.save(tmp_path / "b", ring_bytes=33554432).wait().endswith("step-000000003")


# 7 (08)
@pytest.mark.parametrize("wait_first", [False, True])
def test_failed_lazy_save_fails_next_step_once(tmp_path, wait_first):
    """A background save that failed (exp_avg_sq overflowed to Inf) is reported by the next step(), which is
    not taken (the step count and p.data stay), unless wait() reported it first; either way the step after is
    taken, and wait() reports it too."""
    p = torch.nn.Parameter(torch.randn(4))
    o = dt.AdamW([p], lr=1e-2)
    p.grad = torch.full((4,), 1e38)
    o.step()
    h = o.save(tmp_path)
    while not h.done():
        time.sleep(0.01)
    p.grad = torch.ones(4)
    if wait_first:
        with pytest.raises(dos.DosError, match="exp_avg_sq"):
            h.wait()
    else:
        before = p.detach().clone()
        with pytest.raises(dos.DosError, match="exp_avg_sq"):
            o.step()
        assert _step_count(o) == 1 and torch.equal(p.detach(), before)
        with pytest.raises(dos.DosError, match="exp_avg_sq"):
            h.wait()
    o.step()
    assert _step_count(o) == 2
    o.step()
    assert _step_count(o) == 3


# 8 (09)
@pytest.mark.parametrize("objects,what", [
    (b'{"torch": 5}', 'the "torch" object is 5'),
    (b'{"torch": null}', 'the "torch" object is null'),
    (b'{"torch": {"lrs": ["x"]}}', '"lrs"\\[0\\] is "x"'),
    (b'{"torch": {"lrs": [-1]}}', '"lrs"\\[0\\] is -1'),
    (b'{"torch": {"lrs": 0.5}}', '"lrs" is 0.5'),
    (b'{"torch": {"lrs": [0.1, 0.2]}}', 'want a list of 1 lr'),
])
def test_load_refuses_foreign_torch_object_before_anything_changes(tmp_path, objects, what):
    """A checkpoint whose "torch" object is not the binding's: "torch": 5 raised AttributeError after state,
    step and p.data were replaced; "lrs": ["x"] put "x" into param_groups' lr. It is refused first, naming the
    checkpoint, and nothing changes."""
    p, o = _stepped()
    d = dt.SaveHandle(_native.call("dos_adamw_save", o._h, os.fsencode(tmp_path), objects, 0, 0)).wait()
    o.close()
    q = torch.nn.Parameter(torch.zeros(4))
    o2 = dt.AdamW([q], lr=1e-2)
    with pytest.raises(dos.DosError, match=what) as e:
        o2.load(tmp_path)
    assert d in str(e.value)
    assert _step_count(o2) == 0 and torch.equal(q.detach(), torch.zeros(4)) and o2.param_groups[0]["lr"] == 1e-2


def test_load_takes_binding_torch_object(tmp_path):
    p, o = _stepped()
    o.param_groups[0]["lr"] = 0.25
    o.save(tmp_path).wait()
    o.close()
    q = torch.nn.Parameter(torch.zeros(4))
    o2 = dt.AdamW([q], lr=1e-2)
    o2.load(tmp_path)
    assert o2.param_groups[0]["lr"] == 0.25 and _step_count(o2) == 3 and torch.equal(q.detach(), p.detach())


@pytest.mark.parametrize("where", ["step", "load"])
def test_interrupt_inside_the_copy_back_still_applies_it_whole(tmp_path, where):
    """A KeyboardInterrupt between two parameters' copies (Ctrl-C lands between any two bytecodes) ended the
    copy-back loop of step() or load(): some parameters kept their old weights while dos had the new state, and
    the next step took them as the master weights (the third binding adversary). Every parameter is applied, then
    the interrupt propagates."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    o = dt.AdamW(ps, lr=1e-2)
    for p in ps:
        p.grad = torch.randn(5)
    o.step()
    if where == "load":
        root = str(tmp_path / "r")
        o.save(root).wait()
        for p in ps:
            p.data.zero_()
    real, fired = o._mark_seen, []

    def interrupted(i, p, d):
        real(i, p, d)
        if i == 0 and not fired:
            fired.append(i)
            raise KeyboardInterrupt
    o._mark_seen = interrupted
    for p in ps:
        p.grad = torch.randn(5)
    with pytest.raises(KeyboardInterrupt):
        o.step() if where == "step" else o.load(root)
    o._mark_seen = real
    assert fired
    for i, p in enumerate(ps):
        assert torch.equal(p.data, o.master_weights(i)), f"parameter {i} was not applied"
    o.close()


def test_step_stops_at_2_53(tmp_path):
    """A step count set to 2**53 was stepped past it, and the checkpoint of 2**53+1 saved durable could not be
    loaded (the third binding adversary): step() refuses at 2**53, nothing changed, and the save of 2**53 loads."""
    p, o = _stepped()
    o.state[p]["step"] = 2 ** 53
    before = p.data.clone()
    p.grad = torch.randn(4)
    with pytest.raises(ValueError, match="the largest taken"):
        o.step()
    assert torch.equal(p.data, before) and int(o.state_dict()["state"][0]["step"].item()) == 2 ** 53
    o.save(str(tmp_path / "r")).wait()
    o.load(str(tmp_path / "r"))
    o.close()
