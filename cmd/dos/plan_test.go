package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestPlan: dos plan on the H200 machine's profile for the dos bench run
// (3.91B parameters, 50M subgroups, 16 GiB) chooses that run's schedule
// (28 CPU, 25 GPU, 26 resident: the fastest measured there) and refuses
// bad flags.
func TestPlan(t *testing.T) {
	var out, errb bytes.Buffer
	rc := run([]string{"plan", "--profile", "../../testdata/profiles/h200.json", "--params", "3.91e9", "--subgroup-size", "50000000"}, &out, &errb)
	if rc != 0 {
		t.Fatalf("rc %d: %s", rc, errb.String())
	}
	if !strings.Contains(out.String(), "k = 1.12 (28 CPU, 25 GPU, 26 resident subgroups per rank), 0.542 s") {
		t.Errorf("%s", out.String())
	}
	// The fluid limit, a little below the model's choice (its fill and
	// drain, whole subgroups).
	if !strings.Contains(out.String(), "machine limit: 0.539 s, the performance model's fluid limit") {
		t.Errorf("no machine limit of 0.539 s:\n%s", out.String())
	}
	// The lower bound, under both: the copies (12 B of state each way for
	// a streamed subgroup, 2 B up and down for a CPU one) at their rates
	// alone.
	if !strings.Contains(out.String(), "lower bound: 0.365 s, pcie-bound") {
		t.Errorf("no lower bound of 0.365 s:\n%s", out.String())
	}
	out.Reset()
	if rc := run([]string{"plan", "--profile", "../../testdata/profiles/h200.json", "--threads", "2", "--ranks", "4", "--sweep", "0"}, &out, &errb); rc != 0 ||
		!strings.Contains(out.String(), "note: 2 CPU workers over 4 ranks: 1 worker per rank, 4 in all") {
		t.Errorf("fewer threads than ranks: rc %d, no note:\n%s", rc, out.String())
	}
	// What a new user typed first, each refused in words that say what to
	// give.
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"plan"}, "say what to plan: --profile PATH"},
		{[]string{"plan", "--model", "gpt2-xl"}, "the model's flags need --gpu-memory GiB"},
		{[]string{"plan", "--model", "gpt2-xl", "--gpu-memory", "24", "--profile", "../../testdata/profiles/h200.json", "--forward-ms", "60ms", "--backward-ms", "100"}, "--forward-ms 60ms: not a number"},
		{[]string{"plan", "--profile", "../../testdata/profiles/h200.json", "--ranks", "1.5"}, "--ranks 1.5: not a whole number"},
	} {
		out.Reset()
		errb.Reset()
		if rc := run(c.args, &out, &errb); rc != 2 || !strings.Contains(errb.String(), c.want) {
			t.Errorf("%v: rc %d, stderr %q, want %q", c.args, rc, errb.String(), c.want)
		}
	}
	for _, args := range [][]string{{"plan"}, {"plan", "--profile", "x", "--params", "-1"}, {"plan", "--profile", "../../testdata/profiles/h200.json", "--ranks", "0"},
		{"plan", "--profile", "../../testdata/profiles/h200.json", "--gpu-budget", "NaN"}, {"plan", "--profile", "../../testdata/profiles/h200.json", "--subgroup-size", "1"}} {
		out.Reset()
		errb.Reset()
		if rc := run(args, &out, &errb); rc != 2 || errb.Len() == 0 {
			t.Errorf("%v: rc %d, stderr %q", args, rc, errb.String())
		}
	}
}

// TestPlanGPUMemory: dos plan --gpu-memory prints a model's device memory
// on one GPU (trainer.DeviceMemory, what dos train checks before it
// allocates), what is left for the update phase and the largest batches
// that fit; with --profile the update phase is planned within what is
// left. The 4.24B under 24 GiB does not fit at batch 8 with its
// weights all on the device (--stream-blocks 0; dos train refuses it:
// TestValidateDeviceMemory), at batch 5 with --recompute it does; by
// default 13 of its blocks stream from host memory and it fits with 2.39
// GiB left for the update phase.
func TestPlanGPUMemory(t *testing.T) {
	auto := []string{"plan", "--gpu-memory", "24", "--layers", "36", "--heads", "24", "--embd", "3072", "--ctx", "1024", "--tokenizer", "gpt2", "--batch", "8", "--recompute"}
	rc, out, errs := runCLI(auto...)
	for _, want := range []string{"weights and gradients (bf16)     10.29 GiB", "block slots (13/36 from host)     0.84 GiB (5.49 GiB of weights and gradients in host memory)",
		"before the update phase          21.36 GiB of 24 GiB", "left for the update phase         2.39 GiB", "largest batch with --recompute (256 MiB kept aside, 34 blocks from host memory): 20\n"} {
		if rc != 0 || !strings.Contains(out, want) {
			t.Errorf("dos plan %v: rc %d, want %q in\n%s%s", auto[1:], rc, want, out, errs)
		}
	}
	// With --profile auto takes the count dos train takes with it (16,
	// where without a profile it is 9: below), and the update phase is
	// planned over the blocks that stay on the GPU, the streamed ones
	// counted as the CPU's work first.
	if rc, out, _ := runCLI(append(auto, "--sample", "0")...); rc != 0 || !strings.Contains(out, "block slots (9/36 from host)") {
		t.Errorf("dos plan --sample 0 without a profile: rc %d, want 9 blocks streamed\n%s", rc, out)
	}
	rc, out, errs = runCLI(append(auto, "--sample", "0", "--profile", h200)...)
	// Without --subgroup-size, dos train's cut: the model's choice of
	// 100M, 50M or 25M (50M here).
	if rc != 0 || !strings.Contains(out, "block slots (16/36 from host)") || !strings.Contains(out, "and 1.81B parameters of the streamed blocks (--stream-blocks) in 37 more subgroups, updated by the CPU workers first") ||
		!strings.Contains(out, "dos plan: 2.42B parameters over 1 rank(s): 2.42B per rank in 49 subgroups of up to 50M") || !strings.Contains(out, "model            2    40     7    0.05   false     0.739") ||
		!strings.Contains(out, "largest batch with --recompute (256 MiB kept aside, 35 blocks from host memory): 22") {
		t.Errorf("dos plan --profile with streamed blocks: rc %d\n%s%s", rc, out, errs)
	}
	// The sweep over the blocks streamed: each count that fits, the
	// update phase the model predicts for it over the subgroups dos train
	// cuts (the size among 100M, 50M and 25M its plan prefers); the
	// model's fastest, 17 (the held blocks' in-place CPU work against the
	// budget they free), and what dos train's auto takes with this
	// profile, 16 (the fewest within 2 % of it), marked. Before the
	// profile (the memory table above) auto streams 9.
	for _, want := range []string{"the update phase by blocks from host memory", "\n      16       5.20        1.81B      0.742       7/106/16  <- --stream-blocks auto (dos train's, with this profile)\n",
		"\n      17       5.63        1.93B      0.733       0/109/18  <- the model's fastest\n", "\n      36      13.64        4.08B      1.073        0/64/10 \n"} {
		if !strings.Contains(out, want) {
			t.Errorf("dos plan --profile, the streamed blocks' sweep: want %q in\n%s", want, out)
		}
	}
	// --ranks N: each GPU of a ZeRO-3 job, as dos train --gpus N checks it.
	rc, out, errs = runCLI(append(auto, "--ranks", "2", "--stream-blocks", "auto")...)
	for _, want := range []string{"on each of 2 GPUs (ZeRO-3, a rank per GPU: batch 4 rows each)", "the rank's replicas               2.02 GiB",
		"weights and gradients (bf16)      7.89 GiB (the rank's 1/2", "activations (batch 8: 4 rows)", "left for the update phase         7.65 GiB"} {
		if rc != 0 || !strings.Contains(out, want) || strings.Contains(out, "block slots") {
			t.Errorf("dos plan --ranks 2: rc %d, want %q in\n%s%s", rc, want, out, errs)
		}
	}
	if rc, _, errs := runCLI(append(auto, "--ranks", "3")...); rc != 2 || !strings.Contains(errs, "--batch 8: with --ranks 3 it must be a multiple of the ranks") {
		t.Errorf("dos plan --ranks 3 --batch 8: rc %d %s", rc, errs)
	}
	big := append(auto, "--stream-blocks", "0")
	rc, out, errs = runCLI(big...)
	for _, want := range []string{"4.24B parameters", "weights and gradients (bf16)     15.78 GiB", "activations (batch 8)             8.08 GiB",
		"before the update phase          26.00 GiB of 24 GiB", "does not fit: over the cap by 2.00 GiB (dos train refuses it before allocating)", "largest batch with --recompute (256 MiB kept aside): 5\n"} {
		if rc != 0 || !strings.Contains(out, want) {
			t.Errorf("dos plan %v: rc %d, want %q in\n%s%s", big[1:], rc, want, out, errs)
		}
	}
	rc, out, errs = runCLI(append(big, "--batch", "5")...)
	if rc != 0 || !strings.Contains(out, "left for the update phase") || strings.Contains(out, "does not fit") {
		t.Errorf("--batch 5: rc %d\n%s%s", rc, out, errs)
	}
	rc, out, errs = runCLI("plan", "--gpu-memory", "24", "--model", "gpt2-xl", "--batch", "8", "--recompute", "--profile", h200)
	if rc != 0 || !strings.Contains(out, "left for the update phase        12.59 GiB") || !strings.Contains(out, "1.56B per rank in 63 subgroups of up to 25M, 16 CPU workers per rank, GPU budget 12.59 GiB") ||
		!strings.Contains(out, "the model's choice: k =") {
		t.Errorf("gpt2-xl with --profile: rc %d\n%s%s", rc, out, errs)
	}
	// The whole iteration from a measured forward and backward: the
	// overlap under the serial iteration, the speculation under that, the
	// schedule chosen for the iteration no slower, the bound under all.
	iter := []string{"plan", "--gpu-memory", "40", "--layers", "36", "--heads", "24", "--embd", "3072", "--ctx", "1024", "--tokenizer", "gpt2", "--batch", "8", "--recompute",
		"--profile", h200, "--forward-ms", "148", "--backward-ms", "405", "--speculate", "12", "--json", filepath.Join(t.TempDir(), "plan.json")}
	rc, out, errs = runCLI(iter...)
	if rc != 0 || !strings.Contains(out, "from a forward of 148.0 ms and a backward of 405.0 ms measured alone, 8 x 1024 tokens") {
		t.Fatalf("dos plan --forward-ms: rc %d\n%s%s", rc, out, errs)
	}
	raw, err := os.ReadFile(iter[len(iter)-1])
	if err != nil {
		t.Fatal(err)
	}
	var all map[string]any
	if err := json.Unmarshal(raw, &all); err != nil {
		t.Fatalf("%v: %s", err, raw)
	}
	m := map[string]float64{}
	for k, v := range all {
		if x, ok := v.(float64); ok {
			m[k] = x
		}
	}
	if !(m["iteration_bound_s"] > 0 && m["iteration_bound_s"] < m["iteration_speculate_s"] && m["iteration_speculate_s"] <= m["iteration_overlap_s"] && m["iteration_overlap_s"] < m["iteration_serial_s"]) ||
		!strings.Contains(out, "the schedule chosen for the iteration") {
		t.Errorf("dos plan --forward-ms: want bound < speculate <= overlap < serial: %v\n%s", m, out)
	}
	// The resident subgroups first (dos train's default): the forward
	// runs through them at the phase's start, never later than with them
	// last; and with the speculation, at most that.
	if !(m["iteration_overlap_first_s"] > 0 && m["iteration_overlap_first_s"] <= m["iteration_overlap_s"] && m["iteration_speculate_first_s"] <= m["iteration_overlap_first_s"]) ||
		all["iteration_chosen_first_schedule"] == nil {
		t.Errorf("dos plan --json: want 0 < overlap first <= overlap, speculate first <= overlap first, and the chosen first schedule: %v %v", m, all["iteration_chosen_first_schedule"])
	}
	if m := all["iteration_chosen_s"]; !(m.(float64) > 0 && m.(float64) <= all["iteration_speculate_s"].(float64)) || all["iteration_chosen_schedule"] == nil {
		t.Errorf("dos plan --json: the chosen schedule's iteration %v, schedule %v: want it at most the speculated one's %v", m, all["iteration_chosen_schedule"], all["iteration_speculate_s"])
	}
	// --speculate auto is dos train's auto: 24 GiB.
	auto = slices.Clone(iter[:len(iter)-2])
	auto[len(auto)-1] = "auto"
	if rc, out, errs = runCLI(auto...); rc != 0 || !strings.Contains(out, "and --speculate 24, the resident subgroups first") {
		t.Errorf("dos plan --speculate auto: rc %d\n%s%s", rc, out, errs)
	}
	for _, bad := range [][]string{{"--forward-ms", "1", "--backward-ms", "2"}, {"--gpu-memory", "24", "--model", "gpt2", "--forward-ms", "1"},
		{"--gpu-memory", "24", "--model", "gpt2", "--speculate", "4"}, {"--gpu-memory", "24", "--model", "gpt2", "--forward-ms", "0", "--backward-ms", "2"},
		{"--gpu-memory", "24", "--model", "gpt2", "--forward-ms", "-1", "--backward-ms", "2"}, {"--gpu-memory", "24", "--model", "gpt2", "--speculate", "NaN", "--forward-ms", "1", "--backward-ms", "2"}} {
		if rc, _, errs := runCLI(append([]string{"plan", "--profile", h200}, bad...)...); rc != 2 || !strings.Contains(errs, "--") {
			t.Errorf("dos plan %v: rc %d %s, want a usage error", bad, rc, errs)
		}
	}
	// The update phase's outputs without --profile: refused, nothing
	// written (they were ignored without a word).
	for _, f := range []string{"--json", "--trace", "--plot"} {
		path := filepath.Join(t.TempDir(), "out.svg")
		if rc, _, errs := runCLI("plan", "--gpu-memory", "24", "--model", "gpt2", f, path); rc != 2 || !strings.Contains(errs, f+" needs --profile") {
			t.Errorf("dos plan --gpu-memory 24 --model gpt2 %s, no --profile: rc %d %s, want a usage error naming %s", f, rc, errs, f)
		}
		if _, err := os.Stat(path); err == nil {
			t.Errorf("dos plan %s without --profile wrote %s", f, path)
		}
	}
	// The same flags give dos train's run: its defaults (batch 16, context
	// 64, the byte tokenizer without --model), and its refusal of what
	// fits under the cap but not outside the 256 MiB it keeps aside (with
	// every weight on the GPU: by default 6 blocks' weights come from
	// host memory and it fits outside the 256 MiB).
	rc, out, errs = runCLI("plan", "--gpu-memory", "24", "--model", "gpt2", "--batch", "52")
	if rc != 0 || !strings.Contains(out, "left for the update phase         0.01 GiB") || !strings.Contains(out, "largest batch without --recompute (256 MiB kept aside, 6 blocks from host memory): 52\n") {
		t.Errorf("gpt2 --batch 52 under 24 GiB, --stream-blocks auto: rc %d\n%s%s", rc, out, errs)
	}
	rc, out, errs = runCLI("plan", "--gpu-memory", "24", "--model", "gpt2", "--batch", "52", "--stream-blocks", "0")
	if rc != 0 || !strings.Contains(out, "--ctx 1024 --tokenizer gpt2 --batch 52") || !strings.Contains(out, "fits under the cap, but not outside the 256 MiB the run keeps aside") ||
		!strings.Contains(out, "largest batch without --recompute (256 MiB kept aside): 51\n") {
		t.Errorf("gpt2 --batch 52 under 24 GiB: rc %d\n%s%s", rc, out, errs)
	}
	train := []string{"train", "--device", "cuda", "--gpu-memory", "24", "--model", "gpt2", "--max-memory", "1000", "--steps", "1"}
	// A run that does not fit is refused without the usage lines (its
	// flags are each right).
	if rc, _, errs := runCLI(append(train, "--batch", "53", "--stream-blocks", "0")...); rc != 2 || !strings.Contains(errs, "what fits: --batch 51") || strings.Contains(errs, "Usage:") {
		t.Errorf("dos train --batch 53: rc %d %s", rc, errs)
	}
	if rc, _, errs := runCLI(append(train, "--batch", "52", "--stream-blocks", "0")...); rc != 2 || !strings.Contains(errs, "what fits: --stream-blocks 6, or --batch 51, or --recompute") {
		t.Errorf("dos train --batch 52 --stream-blocks 0 (within the 256 MiB kept aside): rc %d %s", rc, errs)
	}
	if rc, _, errs := runCLI(append(train, "--batch", "52")...); strings.Contains(errs, "of device memory before the update phase") {
		t.Errorf("dos train --batch 52 refused: rc %d %s", rc, errs)
	}
	rc, out, errs = runCLI("plan", "--gpu-memory", "24", "--layers", "2", "--heads", "2", "--embd", "128")
	if rc != 0 || !strings.Contains(out, "--ctx 64 --tokenizer byte --batch 16,") {
		t.Errorf("dos plan without --model: rc %d, want dos train's defaults\n%s%s", rc, out, errs)
	}
	// Sizes whose bytes an int64 would not hold are "too large", not
	// negative, and dos train refuses them too.
	rc, out, errs = runCLI("plan", "--gpu-memory", "80", "--model", "gpt2", "--batch", "100000000000")
	if rc != 0 || !strings.Contains(out, "too large to count (over 1 PiB): does not fit") || strings.Contains(out, "-") && strings.Contains(out, "GiB\n  -") {
		t.Errorf("--batch 1e11: rc %d\n%s%s", rc, out, errs)
	}
	if rc, _, errs := runCLI("train", "--device", "cuda", "--gpu-memory", "24", "--model", "gpt2", "--batch", "100000000000", "--steps", "1"); rc != 2 || !strings.Contains(errs, "need over 1 PiB of device memory") {
		t.Errorf("dos train --batch 1e11: rc %d %s", rc, errs)
	}
	for _, bad := range [][]string{
		{"--model", "gpt2"}, {"--gpu-memory", "24", "--model", "gpt2", "--ranks", "3"}, {"--gpu-memory", "24", "--model", "gpt2", "--ranks", "2", "--stream-blocks", "2"},
		{"--gpu-memory", "24", "--model", "gpt3"}, {"--gpu-memory", "24", "--model", "gpt2", "--heads", "7"},
		{"--gpu-memory", "24", "--model", "gpt2", "--params", "7B"}, {"--gpu-memory", "24", "--model", "gpt2", "--grad-dtype", "float32"},
		{"--gpu-memory", "24", "--model", "gpt2", "--gpu-budget", "100", "--profile", h200},
		{"--gpu-memory", "24", "--model", "gpt2", "--subgroup-size", "1000", "--profile", h200},
	} {
		if rc, out, errs := runCLI(append([]string{"plan"}, bad...)...); rc != 2 || errs == "" {
			t.Errorf("dos plan %v: rc %d, want a usage error\n%s%s", bad, rc, out, errs)
		}
	}
}
