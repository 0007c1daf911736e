"""The repository's helper scripts, run as a user would."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_check_safetensors_without_the_package_says_so(tmp_path):
    # Debian 12 does not package Python's safetensors: the script must say
    # what is missing and what checks a checkpoint without it, not print a
    # traceback. The package is hidden (sys.modules[...] = None makes its
    # import fail) so the test means the same where it is installed.
    script = os.path.join(ROOT, "scripts", "check_safetensors.py")
    code = ("import runpy, sys; sys.modules['safetensors'] = None; "
            "sys.argv = [sys.argv[1], sys.argv[2]]; runpy.run_path(sys.argv[0], run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code, script, str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert "safetensors package is not installed" in r.stderr, r.stderr
    assert "dos ckpt verify" in r.stderr, r.stderr
