package main

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

var zeroTiny = []string{"--batch", "2", "--ctx", "16", "--layers", "1", "--heads", "1", "--embd", "8", "--sample", "0"}

// TestStepsZeroResume: --steps 0 saves step 0, and the same command again
// with --resume has nothing to do and exits 0 (it used to save step 0
// again and fail on the existing step directory), as a resume at --steps
// does at any other iteration.
func TestStepsZeroResume(t *testing.T) {
	ck := filepath.Join(t.TempDir(), "ck")
	args := append([]string{"train", "--steps", "0", "--ckpt-dir", ck}, zeroTiny...)
	if rc, out, errs := runCLI(args...); rc != 0 {
		t.Fatalf("--steps 0: rc %d\n%s%s", rc, out, errs)
	}
	if rc, out, errs := runCLI(append(args, "--resume")...); rc != 0 {
		t.Errorf("--steps 0 --resume on a step-0 root: rc %d\n%s%s", rc, out, errs)
	}
	// With the sampler on (--sample 40 after zeroTiny's 0), --steps 0 saves
	// the initial weights and prints no sample of them.
	fresh := append([]string{"train", "--steps", "0", "--ckpt-dir", filepath.Join(t.TempDir(), "ck")}, append(zeroTiny, "--sample", "40")...)
	if rc, out, errs := runCLI(fresh...); rc != 0 || strings.Contains(out, "sample:") {
		t.Errorf("--steps 0 --sample 40: rc %d, want no sample\n%s%s", rc, out, errs)
	}
}

// TestTokenizeOutSpecial: --out naming a symlink or a device node is
// refused and left as it is (it used to be renamed over: the link
// replaced and its target left stale; as root, a device node such as
// /dev/null made a regular file).
func TestTokenizeOutSpecial(t *testing.T) {
	dir := t.TempDir()
	text := filepath.Join(dir, "t.txt")
	os.WriteFile(text, []byte("Hello world, hello tokens."), 0o644)
	target, link := filepath.Join(dir, "target.bin"), filepath.Join(dir, "link.bin")
	os.WriteFile(target, []byte("old"), 0o644)
	os.Symlink(target, link)
	if rc, _, errs := runCLI("tokenize", "--text", text, "--out", link); rc != 1 || !strings.Contains(errs, "a symlink") {
		t.Errorf("--out naming a symlink: rc %d, %q; want it refused, naming the symlink", rc, errs)
	}
	if fi, _ := os.Lstat(link); fi.Mode()&os.ModeSymlink == 0 {
		b, _ := os.ReadFile(target)
		t.Errorf("--out through a symlink replaced the link with a regular file; the target still holds %q", b)
	}
	dev := filepath.Join(dir, "null")
	if err := syscall.Mknod(dev, syscall.S_IFCHR|0o666, 1<<8|3); err != nil {
		t.Logf("mknod: %v (not root): device case skipped", err)
		return
	}
	rc, out, errs := runCLI("tokenize", "--text", text, "--out", dev)
	if fi, _ := os.Lstat(dev); fi.Mode()&os.ModeDevice == 0 {
		t.Errorf("--out naming a character device (as /dev/null): rc %d, the device node was replaced by a regular file %v\n%s%s", rc, fi.Mode(), out, strings.TrimSpace(errs))
	}
}
