package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/offload"
	"github.com/deepstates/dos/trainer"
)

const h200 = "../../testdata/profiles/h200.json"

// TestParseSize: a size is an integer, e notation or a decimal suffix,
// exactly; anything else, a fraction, a negative or an overflow is refused.
func TestParseSize(t *testing.T) {
	for s, want := range map[string]int64{
		"0": 0, "1": 1, "834304": 834304, "1_000_000": 1e6, "1e9": 1e9, "1E9": 1e9, "3.91e9": 3.91e9, "7B": 7e9, "7b": 7e9,
		"7G": 7e9, "50M": 50e6, "50m": 50e6, "834K": 834e3, "1.5K": 1500, "2T": 2e12, "0.5M": 5e5, ".5K": 500, "4.35M": 4.35e6,
		"1e3K": 1e6, "1e12": 1e12, "9223372036854775807": 1<<63 - 1, "20B": 20e9, "1e+3": 1000,
	} {
		if got, err := parseSize(s); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", s, got, err, want)
		}
	}
	for _, s := range []string{"", "-1", "1.5", "1e-1", "x", "1/2", "0x10", "1__0", "_1", "1_", "1e19", "9223372036854775808",
		"7BB", "7 B", "1e", "B", "1.2345K", "inf", "NaN", "1Ki"} {
		if got, err := parseSize(s); err == nil {
			t.Errorf("parseSize(%q) = %d, want an error", s, got)
		}
	}
	for _, n := range []int64{0, 1, 999, 1000, 1500, 834304, 50e6, 1e9, 3.91e9, 2e12, 1<<63 - 1} {
		if got, err := parseSize(formatSize(n)); err != nil || got != n {
			t.Errorf("formatSize(%d) = %q reads back as %d, %v", n, formatSize(n), got, err)
		}
	}
}

// allCommands are the command lines of every subcommand, for the tests of
// what every one of them does alike.
var allCommands = [][]string{{"train"}, {"selftest"}, {"calibrate"}, {"bench"}, {"plan"}, {"export"}, {"eval"}, {"version"},
	{"ckpt", "ls"}, {"ckpt", "verify"}, {"ckpt", "recover"}, {"ckpt", "inspect"}, {"ckpt", "reshard"}}

// TestHelp: -h, -help and --help print the command's help to stdout (its
// synopsis and flags, or "(no flags)" under a command without any: dos ckpt
// ls printed a Flags header over nothing) and exit 0, for every command.
func TestHelp(t *testing.T) {
	for _, cmd := range allCommands {
		for _, h := range []string{"-h", "-help", "--help"} {
			rc, out, errs := runCLI(append(cmd, h)...)
			name := "dos " + strings.Join(cmd, " ")
			if rc != 0 || errs != "" || !strings.HasPrefix(out, "Usage: "+name) || !(strings.Contains(out, "Flags (") || strings.HasSuffix(out, "\n\n(no flags)\n")) {
				t.Errorf("%s %s: rc %d, stdout %q, stderr %q", name, h, rc, out, errs)
			}
		}
	}
	for _, args := range [][]string{{"-h"}, {"--help"}, {"help"}, {"ckpt", "-h"}, {"ckpt", "--help"}} {
		if rc, out, errs := runCLI(args...); rc != 0 || errs != "" || !strings.Contains(out, "Usage") {
			t.Errorf("dos %v: rc %d, stdout %q, stderr %q", args, rc, out, errs)
		}
	}
}

// TestUsageErrors: an unknown flag, a bad size or an extra argument is a
// usage error for every command: exit 2, the message and the synopsis on
// stderr, nothing on stdout.
func TestUsageErrors(t *testing.T) {
	for _, cmd := range allCommands {
		name := "dos " + strings.Join(cmd, " ")
		for _, bad := range [][]string{{"--bogus"}, {"--bogus=1", "x"}} {
			rc, out, errs := runCLI(append(cmd, bad...)...)
			if rc != 2 || out != "" || !strings.Contains(errs, name+": flag provided but not defined: -bogus") || !strings.Contains(errs, "Usage: "+name) {
				t.Errorf("%s %v: rc %d, stdout %q, stderr %q", name, bad, rc, out, errs)
			}
		}
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"bench", "--params", "1.5"}, "--params 1.5: want a whole number"},
		{[]string{"bench", "--params", "-1"}, "--params -1: want a count >= 0"},
		{[]string{"plan", "--params", "7X"}, "--params 7X: want a count: an integer, 1e9"},
		{[]string{"train", "--subgroup-size", "1e99"}, "--subgroup-size 1e99: want at most"},
		{[]string{"calibrate", "--subgroup-size", "0"}, "--subgroup-size 0: want 1 to"},
		{[]string{"plan", "--profile", h200, "--ranks", "0"}, "--ranks 0: want 1 to 1024"},
		{[]string{"plan", "--profile", h200, "extra"}, `unexpected argument "extra"`},
		{[]string{"plan", "--profile", h200, "--plot", "x.txt"}, "--plot x.txt: want a .svg, .png or .pdf file"},
		{[]string{"eval"}, "want --ckpt PATH"},
		{[]string{"export", "--ckpt", "x"}, "want --ckpt PATH and --hf DIR"},
		{[]string{"version", "extra"}, `unexpected argument "extra"`},
		{[]string{"train", "--resident-first", "false"}, `unexpected argument "false" (a switch takes its value after an equals sign: --resident-first=false)`},
		{[]string{"train", "--resident-first=no"}, "--resident-first=no: want true or false"},
		{[]string{"train", "--batch", "1e3"}, "--batch 1e3: write the whole number in digits (1000)"},
		{[]string{"train", "--batch", "1.5"}, "--batch 1.5: not a whole number"},
		{[]string{"train", "--seed", "-1"}, "--seed -1: want a whole number >= 0"},
		{[]string{"train", "--batch", "1e400"}, "--batch 1e400: out of range for the flag"},
		{[]string{"train", "--batch", "16x"}, "--batch 16x: not a number"},
		{[]string{"train", "--speculate", "1e400"}, "--speculate 1e400: want GiB from 0 to 1024, or auto"},
		{[]string{"ckpt", "verify", "a", "b"}, "want one directory, got 2 arguments"},
		{[]string{"train", "--heads", "3"}, "--heads 3 must divide --embd"},
	} {
		rc, out, errs := runCLI(tc.args...)
		if rc != 2 || out != "" || !strings.Contains(errs, tc.want) || !strings.Contains(errs, "\nUsage: dos "+tc.args[0]) {
			t.Errorf("dos %v: rc %d, stdout %q, stderr %q; want 2 and %q with the usage", tc.args, rc, out, errs, tc.want)
		}
	}
}

// TestRuntimeFailures: a failure that is not the command line's (a missing
// file, no GPU) exits 1 with one line on stderr.
func TestRuntimeFailures(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "nope")
	cases := [][]string{
		{"plan", "--profile", missing},
		{"plan", "--profile", h200, "--json", filepath.Join(missing, "p.json")},
		{"plan", "--profile", h200, "--plot", filepath.Join(missing, "p.svg")},
		{"eval", "--ckpt", missing},
		{"export", "--ckpt", missing, "--hf", t.TempDir()},
		{"selftest", "--cases", missing},
		{"ckpt", "ls", missing},
		{"train", "--text", missing},
	}
	if cuda.Available() != nil {
		cases = append(cases, []string{"bench"}, []string{"calibrate"})
	}
	for _, args := range cases {
		rc, _, errs := runCLI(args...)
		if rc != 1 || strings.Count(errs, "\n") != 1 || !strings.HasPrefix(errs, "dos "+args[0]) {
			t.Errorf("dos %v: rc %d, stderr %q; want 1 and one line", args, rc, errs)
		}
	}
}

// TestSizeFlags: 7B, 7e9 and 7000000000 are one size to every flag that
// takes one (bench, plan and calibrate --params and --subgroup-size, train
// --subgroup-size and --sample).
func TestSizeFlags(t *testing.T) {
	var first string
	for _, args := range [][]string{{"--params", "7B", "--subgroup-size", "50M"}, {"--params", "7e9", "--subgroup-size", "5e7"},
		{"--subgroup-size", "50_000_000", "--params", "7000000000"}} {
		rc, out, errs := runCLI(append([]string{"plan", "--profile", h200}, args...)...)
		if rc != 0 || !strings.Contains(out, "dos plan: 7B parameters over 1 rank(s): 7B per rank in 140 subgroups of up to 50M") {
			t.Fatalf("plan %v: rc %d\n%s%s", args, rc, out, errs)
		}
		if first == "" {
			first = out
		} else if out != first {
			t.Errorf("plan %v printed another plan:\n%s\nwant\n%s", args, out, first)
		}
	}
	if rc, out, errs := runCLI("plan", "--profile", h200, "--params", "1e12"); rc != 0 || !strings.Contains(out, "1e+03B parameters") {
		t.Errorf("plan --params 1e12: rc %d\n%s%s", rc, out, errs)
	}
	// bench parses its sizes before it looks for a GPU: a bad --steps
	// after good sizes is the error reported, on any machine.
	for _, p := range []string{"1e6", "7B", "50M"} {
		rc, _, errs := runCLI("bench", "--params", p, "--subgroup-size", "1e6", "--steps", "0")
		if rc != 2 || !strings.Contains(errs, "--steps 0: want >= 1") {
			t.Errorf("bench --params %s: rc %d %q", p, rc, errs)
		}
	}
	if rc, _, errs := runCLI("calibrate", "--subgroup-size", "50M", "--gpu-budget", "-1"); rc != 2 || !strings.Contains(errs, "--gpu-budget -1") {
		t.Errorf("calibrate --subgroup-size 50M: rc %d %q", rc, errs)
	}
	if rc, _, errs := runCLI(append(append([]string{"train"}, tiny...), "--subgroup-size", "1K", "--sample", "1K", "--steps", "-1")...); rc != 2 || !strings.Contains(errs, "--steps -1") {
		t.Errorf("train --subgroup-size 1K --sample 1K: rc %d %q", rc, errs)
	}
}

// TestOutputFlags: bench, plan and calibrate spell their outputs alike
// (--json, --trace, --plot), and plan writes each of them; --timeline, the
// old name of --plot, still works and is not in the help.
func TestOutputFlags(t *testing.T) {
	for cmd, want := range map[string][]string{"bench": {"--json PATH", "--trace PATH", "--plot PATH"},
		"plan": {"--json PATH", "--trace PATH", "--plot PATH"}, "calibrate": {"--json PATH", "--plot PATH"}} {
		_, out, _ := runCLI(cmd, "-h")
		for _, w := range want {
			if !strings.Contains(out, "\n  "+w+"\n") {
				t.Errorf("dos %s -h does not list %s:\n%s", cmd, w, out)
			}
		}
		if strings.Contains(out, "--timeline") {
			t.Errorf("dos %s -h lists --timeline:\n%s", cmd, out)
		}
	}
	dir := t.TempDir()
	js, tr, svg, old := filepath.Join(dir, "p.json"), filepath.Join(dir, "p.trace.json"), filepath.Join(dir, "p.svg"), filepath.Join(dir, "old.svg")
	rc, out, errs := runCLI("plan", "--profile", h200, "--params", "3.91B", "--subgroup-size", "50M", "--json", js, "--trace", tr, "--plot", svg)
	if rc != 0 {
		t.Fatalf("rc %d\n%s%s", rc, out, errs)
	}
	var res struct {
		Params int64 `json:"params"`
		Choice struct {
			CPU, GPU, Resident int
			Predicted          float64 `json:"predicted_s"`
		} `json:"choice"`
		Results []planResult `json:"results"`
		Limit   float64      `json:"limit_s"`
	}
	b, err := os.ReadFile(js)
	if err == nil {
		err = json.Unmarshal(b, &res)
	}
	if err != nil || res.Params != 3.91e9 || res.Choice.Predicted <= 0 || len(res.Results) < 3 || res.Results[0].Name != "cpu-only" ||
		!(res.Limit > 0 && res.Limit <= res.Choice.Predicted) {
		t.Errorf("--json: %v %+v", err, res)
	}
	for _, p := range []string{tr, svg} {
		if st, err := os.Stat(p); err != nil || st.Size() == 0 {
			t.Errorf("%s: %v", p, err)
		}
	}
	if rc, _, errs := runCLI("plan", "--profile", h200, "--params", "1B", "--timeline", old); rc != 0 {
		t.Errorf("--timeline: rc %d %s", rc, errs)
	} else if _, err := os.Stat(old); err != nil {
		t.Errorf("--timeline wrote nothing: %v", err)
	}
}

// TestFlagsAnywhere: flags may follow positional arguments, and -- ends the
// flags.
func TestFlagsAnywhere(t *testing.T) {
	root := t.TempDir()
	for _, args := range [][]string{{"ckpt", "inspect", "--rank", "0", root}, {"ckpt", "inspect", root, "--rank", "0"},
		{"ckpt", "inspect", root, "--tensors", "--rank=0"}} {
		if rc, _, errs := runCLI(args...); rc != 1 || !strings.Contains(errs, "no checkpoint") {
			t.Errorf("dos %v: rc %d %q", args, rc, errs)
		}
	}
	dash := filepath.Join(root, "-d")
	os.Mkdir(dash, 0o755)
	if rc, out, errs := runCLI("ckpt", "ls", "--", dash); rc != 0 || !strings.Contains(out, "no committed checkpoints in "+dash) {
		t.Errorf("ckpt ls -- %s: rc %d %q %q", dash, rc, out, errs)
	}
	if rc, _, errs := runCLI("plan", "--params", "1B", "--profile", h200, "--", "x"); rc != 2 || !strings.Contains(errs, `unexpected argument "x"`) {
		t.Errorf("plan -- x: rc %d %q", rc, errs)
	}
}

// TestVersion: dos --version and dos version print the module version and
// the Go version, and the VCS revision where the build stamped one.
func TestVersion(t *testing.T) {
	rc, out, errs := runCLI("--version")
	rc2, out2, _ := runCLI("version")
	if rc != 0 || rc2 != 0 || out != out2 || !strings.HasPrefix(out, "dos ") || !strings.Contains(out, runtime.Version()) {
		t.Fatalf("--version: rc %d %q %q; version: rc %d %q", rc, out, errs, rc2, out2)
	}
	bi := &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Path: "github.com/deepstates/dos", Version: "v0.3.0"},
		Settings: []debug.BuildSetting{{Key: "GOOS", Value: "linux"}, {Key: "GOARCH", Value: "amd64"}, {Key: "vcs", Value: "git"},
			{Key: "vcs.revision", Value: "747f399abc"}, {Key: "vcs.time", Value: "2026-12-01T07:00:00Z"}, {Key: "vcs.modified", Value: "true"}}}
	if got, want := versionOf(bi, ""), "dos v0.3.0 go1.26.8 git 747f399abc 2026-12-01T07:00:00Z modified linux/amd64"; got != want {
		t.Errorf("stamped: %q, want %q", got, want)
	}
	// The Makefile's -X main.version wins over the build information's.
	if got, want := versionOf(bi, "v0.3.0-2-g0921c9f-dirty"), "dos v0.3.0 go1.26.8 git v0.3.0-2-g0921c9f-dirty linux/amd64"; got != want {
		t.Errorf("stamped by make: %q, want %q", got, want)
	}
	bi.Settings = bi.Settings[:2]
	bi.Main.Version = "(devel)"
	if got, want := versionOf(bi, ""), "dos (devel) go1.26.8 (no VCS revision stamped: make builds it stamped) linux/amd64"; got != want {
		t.Errorf("unstamped: %q, want %q", got, want)
	}
	if got, want := versionOf(bi, "0921c9f"), "dos (devel) go1.26.8 git 0921c9f linux/amd64"; got != want {
		t.Errorf("unstamped but by make: %q, want %q", got, want)
	}
}

// TestResumeTakesConfig: dos train --resume takes the model, batch,
// dtypes and subgroup size from the checkpoint when not given, names by
// flag those given that differ, and refuses a different model or batch
// naming the flags.
func TestResumeTakesConfig(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "ck")
	model := tiny[:10] // --layers 1 --heads 2 --embd 16 --ctx 16 --batch 4
	rest := tiny[10:]
	args := append(append([]string{"train"}, rest...), "--ckpt-dir", dir, "--ckpt-every", "2")
	first := append(append(append([]string{}, args...), model...), "--steps", "2", "--grad-dtype", "bfloat16", "--working-dtype", "float16", "--subgroup-size", "1K")
	if rc, out, errs := runCLI(first...); rc != 0 {
		t.Fatalf("dos train: rc %d\n%s%s", rc, out, errs)
	}
	// No model flags: the checkpoint's, and nothing differs.
	rc, out, errs := runCLI(append(args, "--steps", "4", "--resume")...)
	want := "resume: from " + filepath.Join(dir, "step-000000002") + ": --layers 1 --heads 2 --embd 16 --ctx 16 --batch 4 --grad-dtype bfloat16 --working-dtype float16 --subgroup-size 1K\n"
	if rc != 0 || !strings.Contains(out, want) || strings.Contains(out, "differs") {
		t.Fatalf("resume without model flags: rc %d, want %q\n%s%s", rc, want, out, errs)
	}
	// Set flags: the same value is silent, a different dtype or subgroup
	// size is named and applies.
	rc, out, errs = runCLI(append(args, "--steps", "6", "--resume", "--layers", "1", "--grad-dtype", "float32", "--subgroup-size", "2000")...)
	for _, w := range []string{"resume: from " + filepath.Join(dir, "step-000000004") + ": --heads 2 --embd 16 --ctx 16 --batch 4 --working-dtype float16\n",
		"resume: --grad-dtype float32 differs from the checkpoint's bfloat16", "resume: --subgroup-size 2000 differs from the checkpoint's 1000"} {
		if rc != 0 || !strings.Contains(out, w) {
			t.Errorf("resume with --grad-dtype and --subgroup-size: rc %d, want %q\n%s%s", rc, w, out, errs)
		}
	}
	if strings.Contains(out, "--layers 1 differs") || strings.Contains(out, "{") {
		t.Errorf("resume names a flag that does not differ, or prints a struct:\n%s", out)
	}
	// A different shape or batch is refused, naming each flag.
	rc, out, errs = runCLI(append(args, "--steps", "8", "--resume", "--embd", "32", "--heads", "2", "--batch", "8")...)
	if rc != 1 || !strings.Contains(errs, "--embd 32 (the checkpoint's: 16), --batch 8 (the checkpoint's: 4)") || strings.Contains(errs, "--heads 2 (") {
		t.Errorf("resume with --embd 32 --batch 8: rc %d\n%s%s", rc, out, errs)
	}
}

// TestNotWrittenByTrain: dos eval and dos export on a checkpoint that dos
// train did not write (no trainer object, or another program's) say so.
func TestNotWrittenByTrain(t *testing.T) {
	opt, err := offload.New([]offload.Param{{Name: "w", Shape: []int{4}}}, offload.Options{Hyper: adam.DefaultHyper()})
	if err != nil {
		t.Fatal(err)
	}
	defer opt.Close()
	for name, objects := range map[string]map[string]any{
		"none":       nil,
		"quickstart": {"trainer": map[string]int64{"iteration": 3}},
	} {
		root := filepath.Join(t.TempDir(), name)
		if _, err := opt.SaveCheckpoint(checkpoint.OS, root, objects); err != nil {
			t.Fatal(err)
		}
		for _, args := range [][]string{{"eval", "--ckpt", root}, {"export", "--ckpt", root, "--hf", t.TempDir()}} {
			rc, _, errs := runCLI(args...)
			if rc != 1 || !strings.Contains(errs, "was not written by dos train") || strings.Count(errs, "\n") != 1 {
				t.Errorf("%s: dos %v: rc %d %q", name, args, rc, errs)
			}
		}
	}
}

// TestUnknownFlagSuggests: an unknown flag near a defined one (a letter
// off, or a prefix of it) names it in the usage error, in every command
// that parses flags alike; one near none names none. Usage errors still
// exit 2 with the synopsis.
func TestUnknownFlagSuggests(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"train", "--step", "10"}, "dos train: flag provided but not defined: -step (did you mean --steps?)\n"},
		{[]string{"train", "--steps=10", "--stpes=3"}, "-stpes (did you mean --steps?)\n"},
		{[]string{"train", "--bach", "4"}, "-bach (did you mean --batch?)\n"},
		{[]string{"train", "--sumary-jsn", "s.json"}, "-sumary-jsn (did you mean --summary-json?)\n"},
		{[]string{"train", "--ckpt", "d"}, "-ckpt (did you mean --ckpt-dir, --ckpt-every or --ckpt-keep?)\n"},
		{[]string{"train", "-gpu", "2"}, "-gpu (did you mean --gpus?)\n"},
		{[]string{"tokenize", "--output", "x.bin"}, "-output (did you mean --out?)\n"},
		{[]string{"bench", "--param", "1B"}, "-param (did you mean --params?)\n"},
		{[]string{"ckpt", "inspect", "--tensor", "x"}, "-tensor (did you mean --tensors?)\n"},
		{[]string{"ckpt", "verify", "--ranks", "1", "x"}, "-ranks (did you mean --rank?)\n"},
		{[]string{"train", "--bogus"}, "flag provided but not defined: -bogus\n"},
		{[]string{"version", "--xyz"}, "flag provided but not defined: -xyz\n"},
	} {
		rc, out, errs := runCLI(tc.args...)
		if rc != 2 || out != "" || !strings.Contains(errs, tc.want) || !strings.Contains(errs, "\nUsage: dos "+tc.args[0]) {
			t.Errorf("dos %v: rc %d, stdout %q, stderr %q; want 2 and %q with the usage", tc.args, rc, out, errs, tc.want)
		}
	}
}

// TestNearFlags: the distance and prefix rules, and their order.
func TestNearFlags(t *testing.T) {
	names := []string{"steps", "seed", "ckpt-dir", "ckpt-every", "ckpt-keep", "ckpt-ring", "ckpt-sync", "timeline", "gpus", "out"}
	for given, want := range map[string]string{
		"step": "steps", "Steps": "steps", "stepz=4": "steps", "ckpt": "ckpt-dir ckpt-every ckpt-keep",
		"ckpt-dri": "ckpt-dir", "gpu": "gpus", "timelines": "timeline", "outt": "out", "x": "", "": "", "zzzzzz": "",
	} {
		if got := strings.Join(nearFlags(given, names, map[string]bool{"timelines": true}), " "); got != want {
			t.Errorf("nearFlags(%q) = %q, want %q", given, got, want)
		}
	}
	if got := nearFlags("timelin", names, map[string]bool{"timeline": true}); len(got) != 0 {
		t.Errorf("a hidden alias was suggested: %v", got)
	}
	for _, tc := range []struct {
		a, b string
		d    int
	}{{"", "", 0}, {"a", "", 1}, {"", "abc", 3}, {"step", "steps", 1}, {"stpes", "steps", 1}, {"bogus", "gpus", 3}, {"ab", "ba", 1}, {"kitten", "sitting", 3}} {
		if got := editDistance(tc.a, tc.b); got != tc.d {
			t.Errorf("editDistance(%q, %q) = %d, want %d", tc.a, tc.b, got, tc.d)
		}
	}
}

// TestOnePrefix: the trainer's errors reach the command line under one
// prefix, the command's ("dos train: --lr -1: ...", not "dos train:
// trainer: --lr -1: ..."), usage errors and runtime failures alike, while
// the library's own errors keep "trainer: ".
func TestOnePrefix(t *testing.T) {
	cfg := trainer.DefaultTrainConfig()
	cfg.LR = -1
	if err := cfg.Validate(); err == nil || !strings.HasPrefix(err.Error(), "trainer: --lr -1") {
		t.Fatalf("the library's error lost its prefix: %v", err)
	}
	ck := filepath.Join(t.TempDir(), "ck")
	if rc, out, errs := runCLI(append([]string{"train", "--steps", "0", "--ckpt-dir", ck}, zeroTiny...)...); rc != 0 {
		t.Fatalf("--steps 0: rc %d\n%s%s", rc, out, errs)
	}
	for _, tc := range []struct {
		args []string
		rc   int
		want string
	}{
		{[]string{"train", "--lr", "-1"}, 2, "dos train: --lr -1: want a finite value > 0\n"},
		{[]string{"train", "--heads", "3"}, 2, "dos train: --heads 3 must divide --embd"},
		{append([]string{"train", "--steps", "0", "--ckpt-dir", ck}, zeroTiny...), 1, "dos train: --ckpt-dir " + ck + " already holds checkpoints"},
		{append([]string{"train", "--steps", "1", "--ckpt-dir", ck, "--resume"}, append(zeroTiny, "--embd", "16")...), 1, "dos train: resume from " + ck},
	} {
		rc, _, errs := runCLI(tc.args...)
		if rc != tc.rc || !strings.HasPrefix(errs, tc.want) && !strings.Contains(errs, "\n"+tc.want) || strings.Contains(errs, "trainer: ") {
			t.Errorf("dos %v: rc %d, stderr %q; want %d and %q, one prefix", tc.args, rc, errs, tc.rc, tc.want)
		}
	}
	for msg, want := range map[string]string{
		"trainer: --lr -1: want > 0":                      "--lr -1: want > 0",
		"trainer: the validation data: trainer: 3 tokens": "the validation data: 3 tokens",
		"--profile: trainer: x; trainer: y":               "--profile: x; y",
		"--ckpt-dir: checkpoint: root x is a file":        "--ckpt-dir: checkpoint: root x is a file",
		"the old trainer: a word inside a clause stays":   "the old trainer: a word inside a clause stays",
	} {
		if got := unprefixed(msg); got != want {
			t.Errorf("unprefixed(%q) = %q, want %q", msg, got, want)
		}
	}
}

// TestOutputPathNamed: an output that cannot be written is refused before
// any work, naming the path given (not the temporary file that probes its
// directory, ".p.json.check123", ".dos-probe-123"); dos train --timeline
// is refused before training (it trained, then failed writing).
func TestOutputPathNamed(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"train", "--summary-json", filepath.Join(missing, "s.json")}, "dos train: --summary-json: " + filepath.Join(missing, "s.json")},
		{append([]string{"train", "--steps", "1", "--timeline", filepath.Join(missing, "t.svg")}, zeroTiny...), "dos train: --timeline: " + filepath.Join(missing, "t.svg")},
		{[]string{"plan", "--profile", h200, "--trace", filepath.Join(missing, "p.json")}, "dos plan: --trace: " + filepath.Join(missing, "p.json")},
		{[]string{"plan", "--profile", h200, "--json", filepath.Join(missing, "p.json")}, "dos plan: --json: " + filepath.Join(missing, "p.json")},
	} {
		rc, out, errs := runCLI(tc.args...)
		if want := tc.want + ": cannot create a file in its directory " + missing + ": no such file or directory\n"; rc != 1 || out != "" || errs != want {
			t.Errorf("dos %v: rc %d, stdout %q, stderr %q; want 1, nothing on stdout, and %q", tc.args, rc, out, errs, want)
		}
	}
}
