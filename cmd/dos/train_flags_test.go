package main

import (
	"bytes"
	"strconv"
	"strings"
	"testing"

	"github.com/deepstates/dos/trainer"
)

// TestTrainFlagLimits: dos train refuses absurd --threads and a run over
// --max-memory before allocating anything, with messages that name the
// flags as typed; --max-memory lets a run through.
func TestTrainFlagLimits(t *testing.T) {
	over := strconv.Itoa(trainer.MaxThreads() + 1)
	limit := "want 0.." + strconv.Itoa(trainer.MaxThreads())
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"--threads", over}, []string{"--threads " + over + ": " + limit, "4 × the CPUs"}},
		{[]string{"--threads", "10000"}, []string{"--threads 10000: " + limit}},
		{[]string{"--threads", "-1"}, []string{"--threads -1: " + limit}},
		{[]string{"--max-memory", "1e-6"}, []string{"--layers 1 --embd 16 --ctx 16 --batch 4 need about", "over --max-memory 1e-06 GiB", "raise --max-memory"}},
		{[]string{"--max-memory", "1025"}, []string{"--max-memory 1025 GiB: want 0 (the available memory) to 1024"}},
		{[]string{"--max-memory", "-1"}, []string{"--max-memory -1 GiB"}},
		{[]string{"--ckpt-ring", "-1"}, []string{"--ckpt-ring -1 GiB: want 0 (the default) to 1024"}},
		{[]string{"--ckpt-ring", "NaN"}, []string{"--ckpt-ring NaN GiB"}},
		{[]string{"--ckpt-dir", "ck", "--ckpt-ring", "2", "--max-memory", "1"}, []string{"--ckpt-ring 2 need about 2", "over --max-memory 1 GiB", "--batch or --ckpt-ring smaller"}},
		{[]string{"--ckpt-ring", "1"}, []string{"--ckpt-ring sizes the lazy checkpointer's ring: it needs --ckpt-dir"}},
		{[]string{"--embd", "3"}, []string{"--heads 2 must divide --embd 3"}},
		{[]string{"--heads", "5"}, []string{"--heads 5 must divide --embd 16"}},
		{[]string{"--ctx", "0"}, []string{"--ctx 0: want 1.."}},
		{[]string{"--layers", "0"}, []string{"--layers 0: want 1.."}},
		{[]string{"--warmup", "-1"}, []string{"--warmup -1: want >= 0"}},
		{[]string{"--sample", "-1"}, []string{"--sample -1"}},
		{[]string{"--min-lr-ratio", "2"}, []string{"--min-lr-ratio 2"}},
		{[]string{"--clip", "-1"}, []string{"--clip -1"}},
		{[]string{"--eps", "0"}, []string{"--eps 0"}},
	} {
		var stdout, stderr bytes.Buffer
		args := append(append([]string{}, tiny...), "--steps", "1")
		rc := runTrain(append(args, tc.args...), &stdout, &stderr)
		if rc != 2 {
			t.Errorf("dos train %v: rc %d, want 2:\n%s%s", tc.args, rc, stdout.String(), stderr.String())
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(stderr.String(), w) {
				t.Errorf("dos train %v: %q, want it to contain %q", tc.args, stderr.String(), w)
			}
		}
		if strings.Contains(stderr.String(), "n_head") || strings.Contains(stderr.String(), "n_embd") {
			t.Errorf("dos train %v: %q names config fields, not flags", tc.args, stderr.String())
		}
	}

	// The override: a run that --max-memory allows goes through.
	var stdout, stderr bytes.Buffer
	args := append(append([]string{}, tiny...), "--steps", "1", "--max-memory", "1", "--threads", strconv.Itoa(trainer.MaxThreads()))
	if rc := runTrain(args, &stdout, &stderr); rc != 0 {
		t.Errorf("dos train %v: rc %d, want 0:\n%s%s", args, rc, stdout.String(), stderr.String())
	}
}

// TestBenchThreads: dos bench bounds --threads like dos train, before it
// looks for a GPU.
func TestBenchThreads(t *testing.T) {
	for _, n := range []string{"-1", strconv.Itoa(trainer.MaxThreads() + 1), "10000"} {
		var stdout, stderr bytes.Buffer
		rc := runBench([]string{"--threads", n}, &stdout, &stderr)
		want := "--threads " + n + ": want 0.." + strconv.Itoa(trainer.MaxThreads())
		if rc != 2 || !strings.Contains(stderr.String(), want) {
			t.Errorf("dos bench --threads %s: rc %d, %q; want rc 2 and %q", n, rc, stderr.String(), want)
		}
	}
}
