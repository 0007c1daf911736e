package main

import (
	"bufio"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestTrainStepsZeroAndLogJSON: --steps 0 saves the initial weights as
// step 0, which dos export reads; --log-json writes one record per step
// with the loss the progress line prints, and a resumed run appends its
// steps to the same file.
func TestTrainStepsZeroAndLogJSON(t *testing.T) {
	dir := t.TempDir()
	ck, log := filepath.Join(dir, "ck"), filepath.Join(dir, "steps.jsonl")
	s := train(t, "--steps", "0", "--ckpt-dir", ck)
	if s.Steps != 0 {
		t.Fatalf("--steps 0 summary: steps %d, want 0", s.Steps)
	}
	if _, err := os.Stat(filepath.Join(ck, "step-000000000", "manifest.json")); err != nil {
		entries, _ := os.ReadDir(ck)
		t.Fatalf("--steps 0 saved no step-0 checkpoint (%v); the root holds %v", err, entries)
	}
	if out, err := dosCmd("export", "--ckpt", ck, "--hf", filepath.Join(dir, "hf")).CombinedOutput(); err != nil {
		t.Fatalf("dos export of step 0: %v\n%s", err, out)
	}
	train(t, "--steps", "3", "--ckpt-dir", ck, "--resume", "--log-json", log)
	train(t, "--steps", "5", "--ckpt-dir", ck, "--resume", "--log-json", log)
	f, err := os.Open(log)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var steps []int
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var rec struct {
			Step     int     `json:"step"`
			Loss     float64 `json:"loss"`
			LR       float64 `json:"lr"`
			GradNorm float64 `json:"grad_norm"`
			Pos      *int64  `json:"pos"`
			Skipped  bool    `json:"skipped"`
		}
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			t.Fatalf("--log-json line %q: %v", sc.Text(), err)
		}
		if !(rec.Loss > 0) || !(rec.LR > 0) || !(rec.GradNorm > 0) || rec.Pos == nil || rec.Skipped {
			t.Errorf("--log-json record %s: want a positive loss, lr and grad_norm, a pos, not skipped", sc.Text())
		}
		steps = append(steps, rec.Step)
	}
	if got := strings.Trim(strings.Join(strings.Fields(strings.Trim(fmtInts(steps), "[]")), ","), ","); got != "1,2,3,4,5" {
		t.Errorf("--log-json steps %v, want 1..5 across the two runs", steps)
	}
}

func fmtInts(v []int) string {
	b, _ := json.Marshal(v)
	return strings.ReplaceAll(string(b), ",", " ")
}

// TestExportGPT2Tokenizer: a gpt2-tokenized checkpoint exports GPT-2's
// tokenizer files beside the model (transformers loads them offline); a
// byte-level one does not.
func TestExportGPT2Tokenizer(t *testing.T) {
	dir := t.TempDir()
	ck := filepath.Join(dir, "ck")
	train(t, "--tokenizer", "gpt2", "--steps", "0", "--ckpt-dir", ck)
	out, err := dosCmd("export", "--ckpt", ck, "--hf", filepath.Join(dir, "hf")).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "merges.txt") {
		t.Fatalf("dos export: %v\n%s", err, out)
	}
	m, err := os.ReadFile(filepath.Join(dir, "hf", "merges.txt"))
	if err != nil || !strings.HasPrefix(string(m), "#version: 0.2\nĠ t\n") || strings.Count(string(m), "\n") != 50001 {
		t.Errorf("merges.txt: %v, %d lines, want GPT-2's 50000 merges after the version line", err, strings.Count(string(m), "\n"))
	}
	byteCk := filepath.Join(dir, "bck")
	train(t, "--steps", "0", "--ckpt-dir", byteCk)
	if out, err := dosCmd("export", "--ckpt", byteCk, "--hf", filepath.Join(dir, "bhf")).CombinedOutput(); err != nil || strings.Contains(string(out), "merges.txt") {
		t.Fatalf("byte-level export: %v\n%s", err, out)
	}
	if _, err := os.Stat(filepath.Join(dir, "bhf", "vocab.json")); err == nil {
		t.Error("a byte-level export wrote vocab.json")
	}
}
