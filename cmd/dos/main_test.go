package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/perfmodel"
)

func runCLI(args ...string) (int, string, string) {
	var out, errb bytes.Buffer
	rc := run(args, &out, &errb)
	return rc, out.String(), errb.String()
}

func TestSelftestEmbedded(t *testing.T) {
	rc, out, errs := runCLI("selftest")
	if rc != 0 {
		t.Fatalf("rc %d\n%s\n%s", rc, out, errs)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	// A header, the reason there is no GPU backend (when there is none), one
	// line per case and backend, a summary.
	pass := strings.Count(out, "\nPASS ")
	header := 1
	if strings.Contains(out, "no GPU backend: ") {
		header = 2
		if os.Getenv("DOS_REQUIRE_GPU") == "1" {
			t.Fatalf("DOS_REQUIRE_GPU=1 but selftest has no GPU backend:\n%s", out)
		}
	} else if !strings.Contains(out, "PASS cuda/") {
		t.Fatalf("neither a GPU backend nor the reason for its absence:\n%s", out)
	}
	if pass < 2*25 || len(lines) != pass+header+1 || !strings.Contains(lines[len(lines)-1], "passed, 0 failed") {
		t.Fatalf("unexpected output (%d PASS lines):\n%s", pass, out)
	}
	for _, p := range adam.Paths() {
		name := "cpu/" + p.Name()
		if p == adam.Generic {
			name = "cpu/scalar"
		}
		if !strings.Contains(out, "PASS "+name+" ") {
			t.Errorf("path %s missing:\n%s", name, out)
		}
	}
	if !strings.Contains(out, "cpu/pool-") {
		t.Fatalf("pool backend missing:\n%s", out)
	}
}

func TestSelftestErrors(t *testing.T) {
	empty := t.TempDir()
	if rc, _, errs := runCLI("selftest", "--cases", empty); rc != 1 || !strings.Contains(errs, "no *.safetensors") {
		t.Errorf("empty dir: rc %d, %q", rc, errs)
	}
	if rc, _, _ := runCLI("selftest", "--cases", filepath.Join(empty, "nope")); rc != 1 {
		t.Errorf("missing dir: rc %d", rc)
	}
	bad := t.TempDir()
	os.WriteFile(filepath.Join(bad, "junk.safetensors"), []byte("not a safetensors file"), 0o644)
	if rc, _, errs := runCLI("selftest", "--cases", bad); rc != 1 || !strings.Contains(errs, "junk.safetensors") {
		t.Errorf("junk file: rc %d, %q", rc, errs)
	}
	if rc, _, _ := runCLI("selftest", "--cases="); rc != 2 {
		t.Errorf("empty --cases: rc %d", rc)
	}
	if rc, _, errs := runCLI("selftest", "--cases", filepath.Join(bad, "junk.safetensors")); rc != 1 || !strings.Contains(errs, "not a directory") {
		t.Errorf("--cases FILE: rc %d %q", rc, errs)
	}
	if rc, _, _ := runCLI("selftest", "--bogus"); rc != 2 {
		t.Errorf("unknown flag: rc %d", rc)
	}
	if rc, _, _ := runCLI("frobnicate"); rc != 2 {
		t.Errorf("unknown command: rc %d", rc)
	}
	if rc, out, _ := runCLI("help"); rc != 0 || !strings.Contains(out, "selftest") {
		t.Errorf("help: rc %d %q", rc, out)
	}
}

// A case whose expectation is wrong makes selftest fail with rc 1 and a FAIL line.
func TestSelftestFailure(t *testing.T) {
	src, err := os.ReadFile(filepath.Join("..", "..", "testdata", "adam-cases", "odd_7.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	// Flip a low mantissa bit of the last fp32 value in the file; the last
	// tensor of the data section is an expected.* tensor of fp32 or 16-bit.
	src[len(src)-2] ^= 0x40
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "odd_7.safetensors"), src, 0o644)
	rc, out, _ := runCLI("selftest", "--cases", dir)
	if rc != 1 || !strings.Contains(out, "FAIL") || !strings.Contains(out, "selftest: 0 passed, ") || strings.Contains(out, ", 0 failed") {
		t.Fatalf("rc %d\n%s", rc, out)
	}
}

func TestCkpt(t *testing.T) {
	root := t.TempDir()
	if rc, out, _ := runCLI("ckpt", "ls", root); rc != 0 || !strings.Contains(out, "no committed") {
		t.Errorf("ls of an empty root: rc %d %q", rc, out)
	}
	if rc, _, _ := runCLI("ckpt", "verify", root); rc != 1 {
		t.Errorf("verify of an empty root: rc %d", rc)
	}
	if rc, _, _ := runCLI("ckpt", "frob", root); rc != 2 {
		t.Errorf("unknown subcommand: rc %d", rc)
	}
	if rc, _, _ := runCLI("ckpt", "ls"); rc != 2 {
		t.Errorf("missing argument: rc %d", rc)
	}
	if rc, _, errs := runCLI("ckpt", "ls", root+"/typo"); rc != 1 || !strings.Contains(errs, "no such file") {
		t.Errorf("missing root: rc %d %q", rc, errs)
	}
	if rc, _, _ := runCLI("ckpt", "ls", "--rank", "1", root); rc != 2 {
		t.Errorf("ls takes no --rank: rc %d", rc)
	}
	// Flags after the directory, and -h, for verify.
	if rc, _, errs := runCLI("ckpt", "verify", root, "--rank", "0"); rc != 1 || strings.Contains(errs, "arguments") {
		t.Errorf("verify ROOT --rank 0: rc %d %q", rc, errs)
	}
	for _, args := range [][]string{{"ckpt", "-h"}, {"ckpt", "verify", "-h"}, {"selftest", "-h"}} {
		if rc, _, _ := runCLI(args...); rc != 0 {
			t.Errorf("%v: rc %d, want 0", args, rc)
		}
	}
}

func TestCalibrateUsage(t *testing.T) {
	// Without a GPU, calibrate without --cpu-only says so, a runtime
	// failure (with one it would calibrate: dos calibrate's run is
	// bench/calibrate.sh's).
	if cuda.Available() != nil {
		if rc, _, errs := runCLI("calibrate"); rc != 1 || !strings.Contains(errs, "--cpu-only") {
			t.Errorf("calibrate without --cpu-only: rc %d %q", rc, errs)
		}
	}
	if rc, _, _ := runCLI("calibrate", "--cpu-only", "extra"); rc != 2 {
		t.Errorf("extra argument: rc %d", rc)
	}
	if rc, _, _ := runCLI("calibrate", "-h"); rc != 0 {
		t.Errorf("-h: rc %d", rc)
	}
}

// TestPlotProfile draws a profile with CPU and GPU fits in every format.
func TestPlotProfile(t *testing.T) {
	fit := func(rate, lat float64, sizes ...float64) perfmodel.Fit {
		f := perfmodel.Fit{Rate: rate, LatencyS: lat}
		for _, s := range sizes {
			f.Points = append(f.Points, perfmodel.Point{Size: s, Seconds: lat + s/rate*1.02})
		}
		return f
	}
	p := &perfmodel.Profile{Machine: perfmodel.Machine{CPU: "test CPU", GPU: "test GPU"},
		CPU: []perfmodel.CPUFit{{Threads: 2, GradDType: adam.BF16, Fit: fit(1.3e9, 0, 16e6, 32e6, 64e6)}},
		GPU: &perfmodel.GPUProfile{Update: fit(1.5e11, 5e-6, 16e6, 64e6, 128e6), Convert: fit(4e11, 3e-6, 16e6, 64e6, 128e6),
			H2D: fit(5.5e10, 1e-5, 8<<20, 64<<20, 1<<30), D2H: fit(5.5e10, 1e-5, 8<<20, 64<<20, 1<<30),
			H2DBoth: fit(4.8e10, 1e-5, 8<<20, 64<<20, 1<<30), D2HBoth: fit(4.8e10, 1e-5, 8<<20, 64<<20, 1<<30)}}
	dir := t.TempDir()
	for _, ext := range []string{".svg", ".png", ".pdf"} {
		path := filepath.Join(dir, "p"+ext)
		if err := plotProfile(p, path); err != nil {
			t.Fatal(err)
		}
		if st, err := os.Stat(path); err != nil || st.Size() < 1000 {
			t.Fatalf("%s: %v %v", path, st, err)
		}
	}
	if os.Getenv("DOS_PLOT_OUT") != "" {
		plotProfile(p, os.Getenv("DOS_PLOT_OUT"))
	}
}

// TestUnknownCommandSuggests: a command name a letter off names the
// command; one near none names none; both exit 2 with the list.
func TestUnknownCommandSuggests(t *testing.T) {
	for args, want := range map[string]string{
		"trian": `dos: unknown command "trian" (did you mean train?)`, "tokenise": `"tokenise" (did you mean tokenize?)`,
		"ckp": `"ckp" (did you mean ckpt?)`, "frobnicate": `dos: unknown command "frobnicate"` + "\n",
	} {
		rc, out, errs := runCLI(args)
		if rc != 2 || out != "" || !strings.Contains(errs, want) || !strings.Contains(errs, "Commands:") {
			t.Errorf("dos %s: rc %d, stdout %q, stderr %q; want 2 and %q", args, rc, out, errs, want)
		}
	}
}

// TestVersionStamped: a binary built as the Makefile builds bin/dos (make
// demo, make gpu-bins: -ldflags -X main.version=$(git describe --always
// --dirty)) prints that revision, whatever -buildvcs is (GOFLAGS here has
// -buildvcs=false); and both targets stamp it.
func TestVersionStamped(t *testing.T) {
	if testing.Short() {
		t.Skip("builds dos")
	}
	bin := filepath.Join(t.TempDir(), "dos")
	build := exec.Command("go", "build", "-buildvcs=false", "-ldflags", "-X main.version=v9.9.9-1-gabcdef0-dirty", "-o", bin, ".")
	if out, err := build.CombinedOutput(); err != nil {
		t.Skipf("go build: %v\n%s", err, out)
	}
	out, err := exec.Command(bin, "version").Output()
	if want := " git v9.9.9-1-gabcdef0-dirty "; err != nil || !strings.Contains(string(out), want) {
		t.Errorf("dos version of a stamped build: %q, %v; want it to contain %q", out, err, want)
	}
	describe, err := exec.Command("git", "describe", "--always", "--dirty").Output()
	if err != nil {
		t.Skipf("git describe: %v (not a git checkout)", err)
	}
	rev := strings.TrimSpace(string(describe))
	for target, want := range map[string]string{
		"demo":     "go build -ldflags '-X main.version=" + rev + "' -o bin/dos ./cmd/dos\n",
		"gpu-bins": "go build -ldflags='-s -w -X main.version=" + rev + "' -o bin/dos ./cmd/dos\n",
	} {
		out, err := exec.Command("make", "-n", "-C", "../..", "--no-print-directory", target, "GO=go").Output()
		if err != nil {
			t.Skipf("make -n %s: %v", target, err)
		}
		if !strings.Contains(string(out), want) {
			t.Errorf("make -n %s:\n%s\nwant a line %q", target, out, want)
		}
	}
}
