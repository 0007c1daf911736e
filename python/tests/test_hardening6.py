"""dos.torch.AdamW against the sixth binding adversary's findings (B1-B6): an interrupt as a collected optimizer's
close returns; a save from an exit hook that runs after dos's; a failed save reported by a call other than step()
(load_state_dict, a state write, a save into another root); the refusal of a save below or at a root's latest
step; load_state_dict's checks of lr, moments without a step and indices listed twice."""
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import dos
import dos.torch as dt

HERE = os.path.dirname(os.path.abspath(__file__))


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE)] + sys.path))


def _run(script, timeout=120):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _failed_save(tmp_path, dtype=torch.bfloat16, root="A"):
    """An optimizer whose save into tmp_path/root failed (exp_avg_sq gone +Inf), done, unreported."""
    p = torch.nn.Parameter(torch.randn(4).to(dtype))
    o = dt.AdamW([p], lr=1e-2)
    p.grad = torch.full((4,), 1e38).to(dtype)
    o.step()
    h = o.save(str(tmp_path / root))
    for _ in range(500):
        if h.done():
            break
        time.sleep(0.01)
    assert h.done()
    return p, o, h


def test_interrupt_as_collected_close_returns_still_reports():
    """B1: a KeyboardInterrupt landing as dos_adamw_close returns inside a collected optimizer's finalizer
    (a Ctrl-C while it waited for the save) lost the failed save's report for good (the finalizer caught only
    Exception); it closes again, dos returns the kept error, and the failure is printed."""
    r = _run(r"""
        import time, torch, dos.torch as dt
        from dos import _native
        import tempfile
        d = tempfile.mkdtemp()
        p = torch.nn.Parameter(torch.randn(4)); o = dt.AdamW([p], lr=1e-2)
        p.grad = torch.full((4,), 1e38); o.step()
        h = o.save(d + "/A")
        while not h.done():
            time.sleep(0.01)
        del h  # only the optimizer's close can report it now
        real, fired = _native.call, []
        def call(name, *args):
            if name != "dos_adamw_close" or fired:
                return real(name, *args)
            fired.append(1)
            try:
                real(name, *args)
            finally:
                raise KeyboardInterrupt  # as dos returned: its error (the save's failure) unread
        _native.call = call
        del o
        print("went on", fired)
    """)
    assert r.returncode == 0 and "went on [1]" in r.stdout, r.stdout + r.stderr
    assert "collected with its last save failed" in r.stderr and "exp_avg_sq" in r.stderr, r.stderr
    assert "KeyboardInterrupt" in r.stderr, r.stderr  # the interrupt is not hidden: Python prints it


@pytest.mark.parametrize("daemon", [True, False])
def test_save_from_exit_hook_after_dos_hook_commits(tmp_path, daemon):
    """B2: a user's exit hook registered before the first save runs after dos's (atexit is last in, first
    out); its save, with the optimizer held by a daemon thread (never collected), was never waited for: the
    process ended with the save half written, rc 0, nothing said. Such a save now waits in save()."""
    root = tmp_path / "R"
    r = _run(rf"""
        import atexit, threading, time, torch, dos.torch as dt
        N = 4_000_000
        p = torch.nn.Parameter(torch.randn(N)); o = dt.AdamW([p])
        def final_save():
            h = o.save({str(root)!r}); print("final save returned, done", h.done(), flush=True)
        atexit.register(final_save)
        if {daemon!r}:
            threading.Thread(target=lambda opt: time.sleep(1000), args=(o,), daemon=True).start()
        p.grad = torch.randn(N); o.step()
        o.save({str(root)!r}).wait()  # registers dos's exit hook
        o.step()
    """)
    assert r.returncode == 0 and "final save returned, done True" in r.stdout, r.stdout + r.stderr
    assert (root / "latest").read_text().strip() == "step-000000002"
    assert not [n for n in os.listdir(root) if n.startswith(".tmp")], os.listdir(root)


def test_load_state_dict_reports_failed_save_before_changing_anything(tmp_path):
    """B3: for 16-bit parameters the failed save surfaced at the first write of load_state_dict's apply, which
    was then finished whole and raised: applied and raised. It raises before anything changes now, reported
    (the next step is taken, the same dict loads)."""
    p, o, h = _failed_save(tmp_path)
    before = o.state_dict()["state"][0]
    new = {"state": {0: {"step": torch.tensor(7.), "exp_avg": torch.ones(4), "exp_avg_sq": torch.ones(4)}},
           "param_groups": o.state_dict()["param_groups"]}
    with pytest.raises(dos.DosError, match=r"the last save \(step 1 into .*A\) failed, nothing was changed now.*exp_avg_sq"):
        o.load_state_dict(new)
    after = o.state_dict()["state"][0]
    assert float(after["step"]) == 1 and torch.equal(after["exp_avg_sq"], before["exp_avg_sq"])
    o.load_state_dict(new)  # reported: it loads
    assert float(o.state_dict()["state"][0]["step"]) == 7
    o.close()  # nothing more to report


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_failed_save_reported_by_state_write_lets_the_step_be_saved_again(tmp_path, dtype):
    """B4a/c: a failure reported by a state write was never marked reported: a re-save of the step was refused
    with a false "saved already" (the root held only its lock), and close() and exit reported it again."""
    p, o, h = _failed_save(tmp_path, dtype)
    with pytest.raises(dos.DosError, match="exp_avg_sq"):
        o.state[p]["exp_avg_sq"] = torch.ones(4)
    o.state[p]["exp_avg_sq"] = torch.ones(4)
    d = o.save(str(tmp_path / "A")).wait()
    assert d.endswith("step-000000001") and (tmp_path / "A" / "latest").read_text().strip() == "step-000000001"
    o.close()  # no second report


def test_failed_save_surfaced_by_save_into_another_root_names_it(tmp_path):
    """B4b: a save into B that closed A's engine raised A's failure with no root named (as if B's state were
    +Inf); it names A and says nothing went into B, and counts as reported (the next step is taken)."""
    p, o, h = _failed_save(tmp_path)
    with pytest.raises(dos.DosError, match=r"the previous save, into .*A, failed \(nothing is saved into .*B now"):
        o.save(str(tmp_path / "B"))
    p.grad = torch.zeros(4, dtype=torch.bfloat16)
    o.step()  # taken: the failure is reported
    assert o.state_dict()["state"][0]["step"] == 2
    o.state[p]["exp_avg_sq"] = torch.ones(4)
    assert o.save(str(tmp_path / "B")).wait().endswith("step-000000002")
    o.close()


def test_refused_save_lets_go_of_the_root_and_names_recover(tmp_path):
    """B5: the refusal of a save below a root's latest step told the user to remove the newer checkpoints
    (which leaves latest naming a removed step: the root refused as corrupt) and kept the root locked; a save
    of the step saved already (with a save into another root between) got the same advice, which would
    delete the good checkpoint. Now: recover is named, the root is let go of, and a repeat says so."""
    root, other = str(tmp_path / "R"), str(tmp_path / "S")
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4))
    o = dt.AdamW([p], lr=1e-2)
    for s in range(1, 7):
        p.grad = torch.randn(4)
        o.step()
        if s in (3, 6):
            o.save(root).wait()
    o.save(other).wait()  # step 6 into S: R's engine closed
    with pytest.raises(dos.DosError, match=rf"step 6 is saved into {root} already .*step first, or save into another root"):
        o.save(root)
    o.load(os.path.join(root, "step-000000003"))
    p.grad = torch.randn(4)
    o.step()
    with pytest.raises(dos.DosError, match=rf"at step 6, and this optimizer is at step 4.*run `dos ckpt recover {root}`"):
        o.save(root)
    # R is not held by the refused save: another process saves into it (at step 10)
    r = _run(rf"""
        import torch, dos.torch as dt
        p = torch.nn.Parameter(torch.zeros(4)); o = dt.AdamW([p], lr=1e-2)
        o.state[p]["step"] = 10
        print(o.save({root!r}).wait())
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("step-000000010"), r.stdout + r.stderr


def _numpy_lrs():
    """0-dim NumPy arrays of floats and ints are lrs (torch.optim takes them; the seventh round's F1), an
    ndarray of bools is not; none without NumPy."""
    try:
        import numpy as np
    except ImportError:
        return []
    return [(np.array(0.01), True), (np.array(1), True), (np.float32(0.5), True), (np.array(True), False)]


@pytest.mark.parametrize("lr, ok", [(-1.0, False), ("0.1", False), (None, False), (float("inf"), False),
                                    (True, False), (torch.tensor([0.5, 0.5]), False), (0.5, True), (1, True),
                                    (10**400, False), (torch.tensor(0.5), True)] + _numpy_lrs())
def test_load_state_dict_checks_lr(lr, ok):
    """B6: a negative or string lr loaded, and every later step failed in dos (or took float("0.1"))."""
    p = torch.nn.Parameter(torch.randn(3))
    o = dt.AdamW([p], lr=1e-2)
    p.grad = torch.ones(3)
    o.step()
    sd = o.state_dict()
    sd["param_groups"][0]["lr"] = lr
    if not ok:
        with pytest.raises(ValueError, match="group 0: invalid lr"):
            o.load_state_dict(sd)
        assert o.param_groups[0]["lr"] == 1e-2
        o.step()
        return
    o.load_state_dict(sd)
    o.step()
    assert float(o.state_dict()["state"][0]["step"]) == 2


def test_load_state_dict_refuses_moments_without_step_and_indices_twice():
    """B6: moments without any step loaded as step 0 (bias correction restarted on non-zero moments); a
    param group listing an index twice gave both parameters its state; complex moments lost their imaginary
    part with a warning. Each is refused, the optimizer unchanged."""
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    o = dt.AdamW([a, b], lr=1e-2)
    a.grad, b.grad = torch.ones(3), torch.ones(3)
    o.step()
    good = o.state_dict()
    sd = o.state_dict()
    for st in sd["state"].values():
        del st["step"]
    with pytest.raises(ValueError, match="parameter 0 has exp_avg, exp_avg_sq but no step"):
        o.load_state_dict(sd)
    sd = o.state_dict()
    sd["param_groups"][0]["params"] = [0, 0]
    with pytest.raises(ValueError, match=r"list \[0\] more than once"):
        o.load_state_dict(sd)
    sd = o.state_dict()
    sd["state"][1]["exp_avg"] = torch.ones(3, dtype=torch.complex64)
    with pytest.raises(ValueError, match="parameter 1's exp_avg is torch.complex64: want real values"):
        o.load_state_dict(sd)
    now = o.state_dict()
    assert all(torch.equal(now["state"][i][k], good["state"][i][k]) for i in (0, 1) for k in ("exp_avg", "exp_avg_sq"))
    assert float(now["state"][0]["step"]) == 1
