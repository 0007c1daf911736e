package trainer

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
)

// zeroRun trains c with gpus ranks on the same tokens and returns each
// step's loss and gradient norm from --log-json, and the summary.
func zeroRun(t *testing.T, c TrainConfig, gpus int, toks []uint16) ([][2]float64, Summary) {
	t.Helper()
	c.GPUs = gpus
	c.LogJSON = filepath.Join(t.TempDir(), "log.jsonl")
	tr, err := NewTokens(c, toks, nil, nil)
	if err != nil {
		t.Fatalf("--gpus %d: %v", gpus, err)
	}
	sum, err := tr.Run()
	if err != nil {
		t.Fatalf("--gpus %d: %v", gpus, err)
	}
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(c.LogJSON)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out [][2]float64
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var rec stepRecord
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			t.Fatal(err)
		}
		out = append(out, [2]float64{rec.Loss, rec.GradNorm})
	}
	return out, sum
}

// TestZeROMatchesOneRank: ZeRO-3 over 2 and 4 ranks (TrainConfig.GPUs) on
// the same global batch follows one rank's trajectory, on the host (fp32)
// and on the simulated device (bf16 working copy and gradients), with
// clipping active: every step's loss and gradient norm within float
// tolerance (the ranks' sums associate differently), the final
// validation loss too. A wrong shard, reduction or norm moves them by far
// more (the test fails with the gradients summed instead of averaged).
func TestZeROMatchesOneRank(t *testing.T) {
	setMemAvailable(t, 0, false)
	toks := make([]uint16, 6000)
	for i := range toks {
		toks[i] = uint16((i*7 + i/13) % 256)
	}
	for _, dev := range []string{"", "sim"} {
		t.Run("device="+dev, func(t *testing.T) {
			c := DefaultTrainConfig()
			c.Model.NLayer, c.Model.NEmbd, c.Model.NHead, c.Model.NCtx = 2, 32, 2, 16
			c.Batch, c.Steps, c.SampleBytes, c.EvalBatches, c.LogEvery = 4, 6, 0, 2, 0
			c.Device, c.MaxGradNorm = dev, 0.5
			tol := 2e-5
			if dev == "sim" {
				c.WorkingDType, c.GradDType = adam.BF16, adam.BF16
				c.SubgroupSize = 1000 // each rank's share in several subgroups, a third each CPU, streamed, resident
				tol = 2e-3            // bf16 gradients round at another point of the sum
			}
			one, s1 := zeroRun(t, c, 1, toks)
			clipped := false
			for _, gpus := range []int{2, 4} {
				got, s := zeroRun(t, c, gpus, toks)
				if len(got) != len(one) {
					t.Fatalf("--gpus %d: %d steps, one rank %d", gpus, len(got), len(one))
				}
				for i := range one {
					for j, what := range []string{"loss", "grad_norm"} {
						if d := math.Abs(got[i][j] - one[i][j]); d > tol*math.Abs(one[i][j]) {
							t.Errorf("--gpus %d step %d: %s %v, one rank %v", gpus, i+1, what, got[i][j], one[i][j])
						}
					}
					clipped = clipped || one[i][1] > c.MaxGradNorm
				}
				if d := math.Abs(s.ValLoss - s1.ValLoss); d > tol*s1.ValLoss || s.Params != s1.Params {
					t.Errorf("--gpus %d: val_loss %v, params %d; one rank %v, %d", gpus, s.ValLoss, s.Params, s1.ValLoss, s1.Params)
				}
			}
			if !clipped {
				t.Error("no step clipped: the global norm is not tested")
			}
		})
	}
}

// TestZeROConfig: what --gpus refuses, each with the flag and the reason.
func TestZeROConfig(t *testing.T) {
	for _, tc := range []struct {
		mut  func(*TrainConfig)
		want string
	}{
		{func(c *TrainConfig) { c.GPUs = -1 }, "--gpus -1: want 0..64"},
		{func(c *TrainConfig) { c.GPUs, c.Threads = 8, MaxThreads() }, "the ranks' workers"},
		{func(c *TrainConfig) { c.GPUs, c.Batch = 3, 16 }, "--batch 16 is not a multiple of --gpus 3"},
		{func(c *TrainConfig) {
			c.GPUs, c.Device, c.WorkingDType, c.GradDType, c.Collectives = 2, "cuda", adam.BF16, adam.BF16, "gloo"
		}, `--collectives "gloo": want nccl or staged`},
		{func(c *TrainConfig) { c.GPUs, c.Device, c.WorkingDType, c.Collectives = 2, "sim", adam.BF16, "staged" }, "--collectives staged picks how GPU ranks communicate: it needs --device cuda"},
		{func(c *TrainConfig) { c.GPUs, c.Collectives = 2, "nccl" }, "--collectives nccl picks how GPU ranks communicate: it needs --device cuda"},
		{func(c *TrainConfig) {
			c.Device, c.WorkingDType, c.GradDType, c.Collectives = "cuda", adam.BF16, adam.BF16, "staged"
		}, "--collectives staged moves the collectives of several GPU ranks through host memory: it needs --gpus 2 or more"},
		{func(c *TrainConfig) { c.GPUs, c.WorkingDType = 2, adam.F16 }, "--working-dtype float16 is not supported"},
		{func(c *TrainConfig) { c.GPUs, c.TimelineAt = 2, 3 }, "--timeline draws one rank's"},
	} {
		c := DefaultTrainConfig()
		c.CkptDir = ""
		tc.mut(&c)
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("got %v, want %q", err, tc.want)
		}
	}
	// --collectives nccl, the default, may be given with one GPU.
	oneGPU := DefaultTrainConfig()
	oneGPU.CkptDir, oneGPU.Device, oneGPU.WorkingDType, oneGPU.GradDType, oneGPU.Collectives = "", "cuda", adam.BF16, adam.BF16, "nccl"
	if err := oneGPU.Validate(); err != nil {
		t.Errorf("--device cuda --collectives nccl on one GPU: %v", err)
	}
	// A model so small that some ranks hold empty pieces of some tensors
	// (width 4 on 8 ranks) trains as one rank does.
	c := DefaultTrainConfig()
	c.Model.NLayer, c.Model.NEmbd, c.Model.NHead, c.Model.NCtx = 1, 4, 1, 8
	c.Batch, c.Steps, c.SampleBytes, c.EvalBatches, c.LogEvery, c.CkptDir = 8, 3, 0, 1, 0, ""
	toks := make([]uint16, 2000)
	for i := range toks {
		toks[i] = uint16(i * 5 % 256)
	}
	setMemAvailable(t, 0, false)
	one, _ := zeroRun(t, c, 1, toks)
	eight, _ := zeroRun(t, c, 8, toks)
	for i := range one {
		if d := math.Abs(eight[i][0] - one[i][0]); d > 1e-5*one[i][0] {
			t.Errorf("step %d: 8 ranks' loss %v, one rank's %v", i+1, eight[i][0], one[i][0])
		}
	}
}

// TestZeROMemoryBytes: the estimate counts each rank's fp32 replica of the
// parameters and gradients (8 B per parameter per rank) and its model, so
// that --max-memory refuses what the ranks would not fit in.
func TestZeROMemoryBytes(t *testing.T) {
	c := DefaultTrainConfig()
	c.CkptDir = ""
	one := c.MemoryBytes()
	c.GPUs = 8
	eight := c.MemoryBytes()
	if params := float64(c.Model.NumParams()); eight-one < 64*params {
		t.Errorf("8 ranks: %.0f B, one rank %.0f B: want at least %.0f B more (8 B per parameter per rank)", eight, one, 64*params)
	}
	c.MaxMemory = one / (1 << 30) * 1.5
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "--max-memory") {
		t.Errorf("8 ranks under one rank's memory x 1.5: %v", err)
	}
}

// TestZeROCheckpoint: checkpoints of 2 ranks, lazy (each rank its own
// engine) and synchronous (--ckpt-sync). Rank 1's save of step 6 fails (as
// a killed write would): the run stops with that error and the job's
// latest stays at step 4, although rank 0 committed step 6 in its root;
// --resume continues from step 4 on both ranks (rank 0 rewound) and
// reaches step 8 with the losses of an uninterrupted run, bit for bit.
// Each rank root keeps --ckpt-keep 2 steps at the end (one more while
// lazy saves run: the job's latest is one save behind a rank's until all
// are durable).
func TestZeROCheckpoint(t *testing.T) {
	for _, sync := range []bool{false, true} {
		t.Run(fmt.Sprintf("sync=%v", sync), func(t *testing.T) { zeroCheckpoint(t, sync) })
	}
}

func zeroCheckpoint(t *testing.T, sync bool) {
	setMemAvailable(t, 0, false)
	toks := make([]uint16, 6000)
	for i := range toks {
		toks[i] = uint16((i*11 + i/7) % 256)
	}
	c := DefaultTrainConfig()
	c.Model.NLayer, c.Model.NEmbd, c.Model.NHead, c.Model.NCtx = 1, 16, 2, 8
	c.Batch, c.Steps, c.SampleBytes, c.EvalBatches, c.LogEvery = 4, 8, 0, 1, 0
	ref, _ := zeroRun(t, c, 2, toks)

	c.CkptDir, c.CkptEvery, c.CkptKeep, c.GPUs, c.CkptSync = t.TempDir(), 2, 2, 2, sync
	zeroSaveFault = func(rank int, step int64) error {
		if rank == 1 && step == 6 {
			return errors.New("injected: rank 1's write killed")
		}
		return nil
	}
	defer func() { zeroSaveFault = nil }()
	tr, err := NewTokens(c, toks, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	_, err = tr.Run()
	tr.Close()
	if err == nil || !strings.Contains(err.Error(), "rank 1: injected") || !strings.Contains(err.Error(), "latest checkpoint is unchanged") {
		t.Fatalf("Run with rank 1's save failing: %v", err)
	}
	zeroSaveFault = nil
	if step, world, err := checkpoint.JobLatest(checkpoint.OS, c.CkptDir); step != 4 || world != 2 || err != nil {
		t.Fatalf("the job's latest after the failure: step %d, %d ranks, %v; want 4, 2", step, world, err)
	}
	if d, _ := checkpoint.Latest(checkpoint.OS, checkpoint.RankRoot(c.CkptDir, 0)); filepath.Base(d) != "step-000000006" {
		t.Fatalf("rank 0's own latest %s: the test wants it ahead of the job", d)
	}
	c.Resume = true
	got, _ := zeroRun(t, c, 2, toks)
	if len(got) != 4 {
		t.Fatalf("the resumed run logged %d steps, want 4 (5..8)", len(got))
	}
	for i, g := range got {
		if want := ref[4+i]; g != want {
			t.Errorf("step %d after the resume: loss, norm %v; uninterrupted %v", 5+i, g, want)
		}
	}
	if step, _, err := checkpoint.JobLatest(checkpoint.OS, c.CkptDir); step != 8 || err != nil {
		t.Errorf("the job's latest at the end: %d, %v; want 8", step, err)
	}
	keep := c.CkptKeep // the lazy engines' one more step is retired at the end
	for r := range 2 {
		info, err := checkpoint.Inspect(checkpoint.OS, checkpoint.RankRoot(c.CkptDir, r))
		if err != nil || len(info.Steps) != keep || filepath.Base(info.Latest) != "step-000000008" {
			t.Errorf("rank %d's root: %d steps, latest %s, %v; want %d, step 8", r, len(info.Steps), info.Latest, err, keep)
		}
	}
	// Another rank count is refused, by name.
	c.GPUs = 4
	if _, err := NewTokens(c, toks, nil, nil); err == nil || !strings.Contains(err.Error(), "hold 2 ranks' pieces, this run has --gpus 4") {
		t.Errorf("resume on 4 ranks: %v", err)
	}
}

// TestZeROFirstSaveFails: rank 1's very first save fails: the job never
// committed, and --resume starts over (what rank 0 wrote kept whole beside the job)
// instead of being refused at its first save; then the run completes.
// A single-rank root is refused under --gpus and a job's root without it.
func TestZeROFirstSaveFails(t *testing.T) {
	setMemAvailable(t, 0, false)
	toks := make([]uint16, 4000)
	for i := range toks {
		toks[i] = uint16(i * 13 % 256)
	}
	c := DefaultTrainConfig()
	c.Model.NLayer, c.Model.NEmbd, c.Model.NHead, c.Model.NCtx = 1, 16, 2, 8
	c.Batch, c.Steps, c.SampleBytes, c.EvalBatches, c.LogEvery = 4, 4, 0, 1, 0
	c.CkptDir, c.CkptEvery, c.GPUs = t.TempDir(), 2, 2
	zeroSaveFault = func(rank int, step int64) error {
		if rank == 1 && step == 2 {
			return errors.New("injected")
		}
		return nil
	}
	defer func() { zeroSaveFault = nil }()
	tr, err := NewTokens(c, toks, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Run(); err == nil || !strings.Contains(err.Error(), "rank 1: injected") {
		t.Fatalf("Run: %v", err)
	}
	tr.Close()
	zeroSaveFault = nil
	c.Resume = true
	got, sum := zeroRun(t, c, 2, toks)
	if len(got) != 4 || sum.Steps != 4 {
		t.Fatalf("the resumed run: %d steps logged, ended at %d; want a fresh run of 4", len(got), sum.Steps)
	}
	if step, _, err := checkpoint.JobLatest(checkpoint.OS, c.CkptDir); step != 4 || err != nil {
		t.Errorf("the job's latest: %d, %v; want 4", step, err)
	}
	// One rank's checkpoint is not a model to export or evaluate.
	if _, _, _, err := LoadWeights(checkpoint.RankRoot(c.CkptDir, 1)); err == nil || !strings.Contains(err.Error(), "one rank's pieces of a job of 2 ranks") {
		t.Errorf("LoadWeights of a rank's root: %v", err)
	}
	c.GPUs = 1
	if _, err := NewTokens(c, toks, nil, nil); err == nil || !strings.Contains(err.Error(), "job of ranks") {
		t.Errorf("a job's root resumed on one rank: %v", err)
	}
	// One rank's root given as a job's (the --gpus the checkpoint says):
	// the error names the job's root, not a re-shard of the rank root.
	rc := c
	rc.GPUs, rc.CkptDir = 2, checkpoint.RankRoot(c.CkptDir, 1)
	if _, err := NewTokens(rc, toks, nil, nil); err == nil || !strings.Contains(err.Error(), "one rank's root of the job "+c.CkptDir+": resume the job, --ckpt-dir "+c.CkptDir) || strings.Contains(err.Error(), "reshard") {
		t.Errorf("a rank's root resumed as a job: %v", err)
	}
	single := DefaultTrainConfig()
	single.Model = c.Model
	single.Batch, single.Steps, single.SampleBytes, single.CkptDir, single.CkptSync = 4, 2, 0, t.TempDir(), true
	tr, err = NewTokens(single, toks, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Run(); err != nil {
		t.Fatal(err)
	}
	tr.Close()
	single.GPUs, single.Resume, single.CkptSync = 2, true, false
	if _, err := NewTokens(single, toks, nil, nil); err == nil || !strings.Contains(err.Error(), "one rank's checkpoints") {
		t.Errorf("a single-rank root resumed on 2 ranks: %v", err)
	}
}

// TestZeROOneRankBitwise: one rank through the ZeRO-3 path on the host
// and on the simulated device (zeroOneRank) logs the single-rank
// trainer's losses and gradient norms bit for bit: over one rank the
// collectives are copies.
func TestZeROOneRankBitwise(t *testing.T) {
	setMemAvailable(t, 0, false)
	toks := make([]uint16, 4000)
	for i := range toks {
		toks[i] = uint16((i*5 + i/11) % 256)
	}
	for _, dev := range []string{"", "sim"} {
		c := DefaultTrainConfig()
		c.Model.NLayer, c.Model.NEmbd, c.Model.NHead, c.Model.NCtx = 2, 32, 2, 16
		c.Batch, c.Steps, c.SampleBytes, c.EvalBatches, c.LogEvery, c.CkptDir = 4, 4, 0, 1, 0, ""
		c.Device, c.MaxGradNorm = dev, 0.5
		if dev == "sim" {
			c.WorkingDType, c.GradDType, c.SubgroupSize = adam.BF16, adam.BF16, 1000
		}
		one, _ := zeroRun(t, c, 1, toks)
		zeroOneRank = "local"
		t.Cleanup(func() { zeroOneRank = "" })
		got, _ := zeroRun(t, c, 1, toks)
		zeroOneRank = ""
		for i := range one {
			if got[i] != one[i] {
				t.Errorf("device %q step %d: loss, norm %v through the ZeRO-3 path; %v without", dev, i+1, got[i], one[i])
			}
		}
	}
}

// TestZeROSaveAfterFailedLazySave: rank 1's lazy save of step 4 fails and
// the caller runs the trainer on (Run again): no later lazy save starts,
// so that rank 0's engine, which keeps --ckpt-keep+1 steps, never retires
// the job's committed step 2 (the save of 6 would have left rank 0 with 4
// and 6, neither committed for the job, had rank 1's save of 6 failed
// too). The job then resumes from step 2.
func TestZeROSaveAfterFailedLazySave(t *testing.T) {
	setMemAvailable(t, 0, false)
	toks := make([]uint16, 6000)
	for i := range toks {
		toks[i] = uint16((i*11 + i/7) % 256)
	}
	c := DefaultTrainConfig()
	c.Model.NLayer, c.Model.NEmbd, c.Model.NHead, c.Model.NCtx = 1, 16, 2, 8
	c.Batch, c.Steps, c.SampleBytes, c.EvalBatches, c.LogEvery = 4, 6, 0, 1, 0
	c.CkptDir, c.CkptEvery, c.CkptKeep, c.GPUs = t.TempDir(), 2, 1, 2
	zeroSaveFault = func(rank int, step int64) error {
		if rank == 1 && step >= 4 {
			return errors.New("injected: rank 1's write failed")
		}
		return nil
	}
	defer func() { zeroSaveFault = nil }()
	tr, err := NewTokens(c, toks, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Run(); err == nil || !strings.Contains(err.Error(), "rank 1: injected") {
		t.Fatalf("Run with rank 1's save of step 4 failing: %v", err)
	}
	_, runErr := tr.Run() // on: trains 5..6, then saves (or refuses to)
	tr.Close()
	if runErr == nil {
		t.Fatal("the second Run: no error, want the save of step 6 refused or failed")
	}
	zeroSaveFault = nil
	if step, _, err := checkpoint.JobLatest(checkpoint.OS, c.CkptDir); step != 2 || err != nil {
		t.Fatalf("the job's latest: %d, %v; want 2", step, err)
	}
	for r := range 2 {
		if _, err := os.Stat(filepath.Join(checkpoint.StepDir(checkpoint.RankRoot(c.CkptDir, r), 2), checkpoint.ManifestFile)); err != nil {
			t.Errorf("rank %d lost the job's committed step 2 (second Run: %v): %v", r, runErr, err)
		}
	}
	// A resumed job whose first save fails says the job's latest is the
	// step it resumed from (it said -1, the first run's none).
	c.Resume = true
	zeroSaveFault = func(rank int, step int64) error {
		if rank == 1 {
			return errors.New("injected: rank 1's write failed")
		}
		return nil
	}
	tr, err = NewTokens(c, toks, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Run(); err == nil || !strings.Contains(err.Error(), "rank 1: injected") {
		t.Fatalf("the resumed Run with rank 1's save of step 4 failing: %v", err)
	}
	if _, err := tr.Run(); err == nil || !strings.Contains(err.Error(), "the job's latest is still step 2") {
		t.Errorf("the resumed job's second Run: %v, want the save refused naming step 2", err)
	}
	tr.Close()
	zeroSaveFault = nil
	if got, sum := zeroRun(t, c, 2, toks); len(got) != 4 || sum.Steps != 6 {
		t.Errorf("the resumed run: %d steps logged, ended at %d; want 3..6", len(got), sum.Steps)
	}
}
