"""Checkpoint roots and paths of dos.torch.AdamW (issue 29, items 2 and 3)."""
import os

import pytest
import torch

import dos
import dos.torch as dt


def trained(seed, steps=3):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(16, generator=g))]
    opt = dt.AdamW(ps, lr=1e-2)
    for _ in range(steps):
        ps[0].grad = torch.randn(16, generator=g)
        opt.step()
    return ps, opt


def test_second_optimizer_refused_on_a_root(tmp_path):
    """Within one process a root written by one optimizer refuses another's save (whatever the spelling:
    relative, through a link); the first one's checkpoint stays and loads its own weights; after close()
    the other may save there."""
    root = tmp_path / "r"
    pa, a = trained(1)
    pb, b = trained(2)
    a.save(root).wait()
    want = pa[0].data.clone()
    with pytest.raises(dos.DosError, match=r"r is written by another dos optimizer of this process.*another root, or close\(\)"):
        b.save(root, keep=1)
    os.symlink(root, tmp_path / "link")
    with pytest.raises(dos.DosError, match="another dos optimizer"):
        b.save(tmp_path / "link", keep=1)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(dos.DosError, match="another dos optimizer"):
            b.save("./r/../r", keep=1)
    finally:
        os.chdir(cwd)
    assert sorted(f for f in os.listdir(root) if f.startswith("step-")) == ["step-000000003"]
    pa[0].data.zero_()
    a.load(root)  # A's own weights, not B's
    assert torch.equal(pa[0].data, want) and not torch.equal(pb[0].data, want)
    b.load(root)  # loading is reading: allowed
    assert torch.equal(pb[0].data, want)
    pb[0].grad = torch.ones(16)
    b.step()
    a.close()
    assert b.save(root, keep=1).wait().endswith("step-000000004")
    assert sorted(f for f in os.listdir(root) if f.startswith("step-")) == ["step-000000004"]


def test_optimizer_moves_to_another_root(tmp_path):
    """An optimizer that saves into another root gives up the first: another optimizer may then save there."""
    _, a = trained(1)
    _, b = trained(2, steps=4)
    a.save(tmp_path / "r").wait()
    a.save(tmp_path / "s").wait()
    b.save(tmp_path / "r").wait()
    with pytest.raises(dos.DosError, match="another dos optimizer"):
        a.save(tmp_path / "r")


def test_paths_with_a_null_byte(tmp_path):
    """A path with an embedded null byte raises ValueError, as os does (C cut it there: r2\\0zzz saved into
    r2), and nothing is written."""
    _, a = trained(1)
    with pytest.raises(ValueError):
        os.stat(str(tmp_path / "r2\0zzz"))  # os's own refusal
    for path in (str(tmp_path / "r2\0zzz"), os.fsencode(tmp_path / "r2\0zzz")):
        with pytest.raises(ValueError, match="embedded null byte"):
            a.save(path)
        with pytest.raises(ValueError, match="embedded null byte"):
            a.load(path)
    assert not os.path.exists(tmp_path / "r2")
    with pytest.raises(ValueError, match="embedded null byte"):
        dt.AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], device="sim", profile=str(tmp_path / "p\0x"))
    assert a.save(os.fsencode(tmp_path / "r2")).wait().endswith("step-000000003")  # bytes paths work


def test_dropped_optimizer_frees_its_root(tmp_path):
    """An optimizer let go of is freed at once (no reference cycle holds it until a collection), and its root
    with it."""
    import gc
    import weakref

    _, a = trained(1)
    a.save(tmp_path / "r").wait()
    ref = weakref.ref(a)
    gc.disable()
    try:
        del a
        assert ref() is None
        _, b = trained(2, steps=4)
        assert b.save(tmp_path / "r").wait().endswith("step-000000004")
    finally:
        gc.enable()


def test_load_of_a_damaged_root_names_recover(tmp_path):
    """load() of a root whose latest checkpoint has a flipped byte names `dos ckpt recover` (the fresh-user walk:
    the CLI named it, the binding did not); once recover (here its library call, through a root left with only
    set-aside checkpoints) has set it aside, load() says the root holds only damaged checkpoints."""
    ps, opt = trained(1)
    root = tmp_path / "r"
    opt.save(str(root)).wait()
    step = next(d for d in os.listdir(root) if d.startswith("step-"))
    f = root / step / "rank-00000.safetensors"
    b = bytearray(f.read_bytes())
    b[-5] ^= 0x40
    f.write_bytes(bytes(b))
    with pytest.raises(dos.DosError, match=r"dos ckpt recover .*sets a checkpoint that does not verify aside"):
        opt.load(str(root))
    os.rename(root / step, root / ("damaged-" + step))
    os.remove(root / "latest")
    with pytest.raises(dos.DosError, match=r"holds only checkpoints set aside as damaged \(damaged-step-"):
        opt.load(str(root))
    opt.close()


def test_forked_child_does_not_pin_the_root(tmp_path):
    """A fork()ed child that never touches dos (a DataLoader worker) inherited the root's flock(2) lock: after the
    parent closed its optimizer, a new optimizer's save into that root was refused ("locked by PID <parent>") while
    the child lived (the third binding adversary). The child closes the inherited lock descriptors at fork, in an
    after-fork hook, which runs when the child is scheduled and after the hooks registered before dos's: the parent
    often goes on first (its save was refused in 1 run of 10 on a busy machine). Here such a hook holds the child
    until the parent has saved, every time: the parent's close releases the lock whatever copies its children
    hold still; then the child closes its copies (none is left open in it), so it would not hold the lock past the
    parent's end."""
    import subprocess
    import sys
    import textwrap
    root = str(tmp_path / "r")
    script = textwrap.dedent(f"""
        import os, torch
        r, w = os.pipe()
        def hold():  # registered before dos's hooks: runs before them, in the child
            os.close(w)
            os.read(r, 1)  # until the parent has saved (it closes w)
        os.register_at_fork(after_in_child=hold)
        import dos.torch as dt
        p = torch.nn.Parameter(torch.randn(8)); p.grad = torch.randn(8)
        o = dt.AdamW([p], lr=1e-2); o.step(); o.save({root!r}).wait()
        pid = os.fork()
        if pid == 0:  # dos's hook has run
            locks = []
            for fd in os.listdir("/proc/self/fd"):
                try:
                    if os.readlink(f"/proc/self/fd/{{fd}}").endswith("/.lock"):
                        locks.append(fd)
                except OSError:  # listdir's own descriptor, closed by now
                    pass
            os._exit(3 if locks else 0)
        os.close(r)
        o.close()
        q = torch.nn.Parameter(torch.randn(8)); q.grad = torch.randn(8)
        o2 = dt.AdamW([q], lr=1e-2); o2.step(); o2.step()
        try:
            o2.save({root!r}).wait()
            print("SAVED", flush=True)
        finally:
            os.close(w)
            _, st = os.waitpid(pid, 0)
            print("CHILD", os.waitstatus_to_exitcode(st), flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(dos.__file__))] + sys.path))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SAVED" in r.stdout, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-2000:]}"
    assert "CHILD 0" in r.stdout, f"the child kept a root lock's descriptor open\n{r.stdout}"
