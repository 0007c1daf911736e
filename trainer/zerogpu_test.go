package trainer

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/internal/nccl"
)

// zeroGPUConfig is a small GPT-2 on the GPU (head size 64: flash
// attention) with a batch of 6 rows (1, 2, 3 or 6 ranks), clipping
// active; 4 blocks, so that the backward gathers blocks 1 and 0 into the
// slots blocks 3 and 2 held.
func zeroGPUConfig() TrainConfig {
	c := DefaultTrainConfig()
	serialSchedule(&c)
	c.Model = Config{VocabSize: 256, NCtx: 64, NLayer: 4, NHead: 2, NEmbd: 128}
	c.Batch, c.Device, c.Steps, c.DecaySteps = 6, "cuda", 8, 8
	c.WorkingDType, c.GradDType = adam.BF16, adam.BF16
	c.SubgroupSize = 40_000
	c.SampleBytes, c.EvalBatches, c.LogEvery, c.CkptDir = 0, 2, 0, ""
	c.MaxGradNorm = 0.5
	return c
}

// zeroGPUTokens is token data for zeroGPUConfig.
func zeroGPUTokens() []uint16 {
	toks := make([]uint16, 12000)
	for i := range toks {
		toks[i] = uint16((i*7 + i/13 + i/101) % 256)
	}
	return toks
}

// TestZeROGPUMatchesOneGPU: ZeRO-3 on the GPU (--device cuda --gpus N)
// over 2 and 3 ranks, on the same global batch, follows the single-GPU
// trainer's trajectory within bf16 tolerance: every step's loss and
// gradient norm (clipping active), and the final validation loss. Three
// ranks make short pieces (width 128 and vocabulary 256 are not multiples
// of 3), which go through the staging piece, also for the blocks gathered
// again in the backward; the fp32 master weights of the embeddings and
// LayerNorms are gathered too; --no-overlap starts nothing of the update
// phase during the backward (GradsFinal), and --schedule cpu updates every
// rank's shard on the CPU (the gradients D2H as each block's are final).
// The staged reductions add in float64; NCCL's in bf16 hop by hop, so its
// differences may be somewhat larger than these. With one GPU the ranks share
// it through --collectives staged;
// with two or more, NCCL runs too.
func TestZeROGPUMatchesOneGPU(t *testing.T) {
	gpuEnv(t)
	setMemAvailable(t, 0, false)
	toks := zeroGPUTokens()
	c := zeroGPUConfig()
	one, s1 := zeroRun(t, c, 1, toks)
	if !(s1.FinalLoss < s1.InitialLoss) {
		t.Fatalf("one GPU: loss %v -> %v, want it to fall", s1.InitialLoss, s1.FinalLoss)
	}
	gpus, err := cuda.DeviceCount()
	if err != nil {
		t.Fatal(err)
	}
	type variant struct {
		ranks       int
		collectives string
		noOverlap   bool
		schedule    string
	}
	vs := []variant{{2, "staged", false, ""}, {3, "staged", false, ""}, {2, "staged", true, ""}, {2, "staged", false, "cpu"}}
	if gpus >= 2 && nccl.Available() == nil {
		vs = append(vs, variant{2, "nccl", false, ""})
		if gpus >= 3 {
			vs = append(vs, variant{3, "nccl", false, ""})
		}
	} else {
		t.Logf("NCCL between GPUs not run: %d GPU(s), NCCL: %v", gpus, nccl.Available())
	}
	clipped := false
	for _, v := range vs {
		name := fmt.Sprintf("gpus=%d/%s/no-overlap=%v/schedule=%s", v.ranks, v.collectives, v.noOverlap, v.schedule)
		t.Run(name, func(t *testing.T) {
			cc := c
			cc.Collectives, cc.NoOverlap, cc.Schedule = v.collectives, v.noOverlap, v.schedule
			got, s := zeroRun(t, cc, v.ranks, toks)
			if len(got) != len(one) {
				t.Fatalf("%d steps, one GPU %d", len(got), len(one))
			}
			worst := [2]float64{}
			for i := range one {
				for j, what := range []string{"loss", "grad_norm"} {
					d := math.Abs(got[i][j]-one[i][j]) / math.Abs(one[i][j])
					worst[j] = max(worst[j], d)
					// bf16 gradients averaged in another order: a few
					// bf16 ulps (2^-8) on the norm; the loss follows the
					// weights, which move by lr-sized steps.
					if tol := []float64{5e-4, 5e-3}[j]; d > tol {
						t.Errorf("step %d: %s %v, one GPU %v (relative %.2g > %.2g)", i+1, what, got[i][j], one[i][j], d, tol)
					}
				}
				clipped = clipped || one[i][1] > c.MaxGradNorm
			}
			if d := math.Abs(s.ValLoss-s1.ValLoss) / s1.ValLoss; d > 5e-4 || s.Params != s1.Params {
				t.Errorf("val_loss %v, params %d; one GPU %v, %d", s.ValLoss, s.Params, s1.ValLoss, s1.Params)
			}
			t.Logf("8 steps: loss %.5f -> %.5f (one GPU %.5f -> %.5f); worst relative difference: loss %.2g, grad_norm %.2g; val_loss %.5f (%.5f); %.0f tokens/s",
				got[0][0], got[len(got)-1][0], one[0][0], one[len(one)-1][0], worst[0], worst[1], s.ValLoss, s1.ValLoss, s.TokensPerS)
		})
	}
	if !clipped {
		t.Error("no step clipped: the global norm is not tested")
	}
}

// TestZeROGPUResumeBitwise: two GPU ranks (staged: one GPU does) trained
// 6 iterations straight, and 3 then resumed from the job's checkpoint to
// 6, log the same losses and gradient norms bit for bit; the job commits
// step 6 on both ranks.
func TestZeROGPUResumeBitwise(t *testing.T) {
	gpuEnv(t)
	setMemAvailable(t, 0, false)
	toks := zeroGPUTokens()
	c := zeroGPUConfig()
	c.Steps, c.DecaySteps, c.Collectives = 6, 6, "staged"
	c.CkptDir, c.CkptEvery = t.TempDir(), 3
	ref, _ := zeroRun(t, c, 2, toks)
	c.CkptDir, c.Steps = t.TempDir(), 3
	zeroRun(t, c, 2, toks)
	c.Steps, c.Resume = 6, true
	got, _ := zeroRun(t, c, 2, toks)
	if len(got) != 3 {
		t.Fatalf("the resumed run logged %d steps, want 3", len(got))
	}
	for i, g := range got {
		if want := ref[3+i]; g != want {
			t.Errorf("step %d after the resume: loss, norm %v; straight %v", 4+i, g, want)
		}
	}
	if step, world, err := checkpoint.JobLatest(checkpoint.OS, c.CkptDir); step != 6 || world != 2 || err != nil {
		t.Errorf("the job's latest: step %d of %d ranks, %v; want 6 of 2", step, world, err)
	}
}

// TestZeROGPUErrors: more ranks than GPUs over NCCL is refused naming
// --collectives staged; with staged ranks a deeper model trains, its
// blocks gathered two at a time, and Evaluate and Sample run (every rank
// forward, rank 0's logits drawn from).
func TestZeROGPUErrors(t *testing.T) {
	gpuEnv(t)
	setMemAvailable(t, 0, false)
	gpus, err := cuda.DeviceCount()
	if err != nil {
		t.Fatal(err)
	}
	c := zeroGPUConfig()
	c.Steps, c.GPUs, c.Batch = 2, gpus+1, 6*(gpus+1)
	if _, err := NewTokens(c, zeroGPUTokens(), nil, nil); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("--gpus %d", gpus+1)) || !strings.Contains(err.Error(), "--collectives staged") {
		t.Errorf("--gpus %d on %d GPUs over NCCL: %v", gpus+1, gpus, err)
	}
	c.Collectives, c.SampleBytes, c.Model.NLayer = "staged", 20, 6
	tr, err := NewTokens(c, zeroGPUTokens(), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	s, err := tr.Run()
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Sample) < 20 || !(s.ValLoss > 0) || !(s.FinalLoss < s.InitialLoss) || s.MFU <= 0 {
		t.Errorf("sample %q, loss %v -> %v, val_loss %v, MFU %v", s.Sample, s.InitialLoss, s.FinalLoss, s.ValLoss, s.MFU)
	}
	// Two of the six blocks' matrices are on a GPU at a time: the bf16
	// working copy's replica is well under the whole model's 2 B per
	// parameter (the blocks' matrices are 95 % of it here).
	src := tr.w.ranks[0].rep.(*gpuReplica).src.(*gatherSource)
	work, whole := src.work.Len(), 2*int64(s.Params)
	if work > whole/2 {
		t.Errorf("rank 0's working-copy replica is %d bytes, the whole model's %d: want under half", work, whole)
	}
	t.Logf("%d ranks on %d GPU(s): loss %.4f -> %.4f, sample %q; rank 0's replicas %d bytes (work %d; the whole model in bf16: %d)",
		c.GPUs, gpus, s.InitialLoss, s.FinalLoss, s.Sample, src.replicaBytes(), work, whole)
}

// TestZeROGPUOneRank: one rank through the ZeRO-3 GPU path, over NCCL (a
// communicator of one GPU) and staged, logs every step's loss and gradient
// norm bit for bit as the single-GPU trainer does: the collectives over
// one rank are copies, so this checks the replicas' layout, the block
// slots, the borrowed optimizer memory and NCCL's groups on the model's
// stream where one GPU is all there is.
func TestZeROGPUOneRank(t *testing.T) {
	gpuEnv(t)
	setMemAvailable(t, 0, false)
	toks := zeroGPUTokens()
	c := zeroGPUConfig()
	c.Model.NLayer, c.Steps, c.DecaySteps = 4, 5, 5
	one, _ := zeroRun(t, c, 1, toks)
	defer func() { zeroOneRank = "" }()
	for _, coll := range []string{"nccl", "staged"} {
		if coll == "nccl" && nccl.Available() != nil {
			t.Errorf("no NCCL: %v", nccl.Available())
			continue
		}
		zeroOneRank = coll
		cc := c
		got, _ := zeroRun(t, cc, 1, toks)
		for i := range one {
			if got[i] != one[i] {
				t.Errorf("%s: step %d: loss, norm %v; the single-GPU trainer %v", coll, i+1, got[i], one[i])
			}
		}
		t.Logf("%s, one rank: %d steps equal to the single-GPU trainer's, bit for bit (loss %.5f -> %.5f)", coll, len(got), got[0][0], got[len(got)-1][0])
	}
}

// TestZeROGPURankFails: rank 1 fails before block 1's backward at the
// third iteration (zeroBlockFault): Run returns rank 1's error, not
// another rank's "stopped", rank 0 is released from its collectives, and
// Close returns (nothing waits for ever on a stream).
func TestZeROGPURankFails(t *testing.T) {
	gpuEnv(t)
	setMemAvailable(t, 0, false)
	c := zeroGPUConfig()
	c.Model.NLayer, c.Collectives, c.GPUs = 3, "staged", 2
	calls := 0
	zeroBlockFault = func(rank, l int, backward bool) error {
		if rank == 1 && l == 1 && backward {
			if calls++; calls == 3 {
				return errors.New("injected: rank 1's device fault")
			}
		}
		return nil
	}
	defer func() { zeroBlockFault = nil }()
	tr, err := NewTokens(c, zeroGPUTokens(), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := tr.Run()
		done <- errors.Join(err, tr.Close())
	}()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "rank 1: ") || !strings.Contains(err.Error(), "injected") {
			t.Fatalf("Run with rank 1 failing: %v", err)
		}
		t.Logf("Run: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("Run or Close still waiting 60 s after rank 1 failed")
	}
}

// TestZeROGPUEmptyPieces: 12 ranks of a model of width 32 (the LayerNorms'
// 32 elements in pieces of 3: rank 10's is 2 long, rank 11's empty)
// follow one GPU within the same tolerance as TestZeROGPUMatchesOneGPU:
// an empty piece sends and receives padding only.
func TestZeROGPUEmptyPieces(t *testing.T) {
	gpuEnv(t)
	setMemAvailable(t, 0, false)
	c := zeroGPUConfig()
	c.Model = Config{VocabSize: 256, NCtx: 16, NLayer: 3, NHead: 2, NEmbd: 32} // head size 16: cuBLAS attention
	c.Batch, c.Schedule = 12, "cpu"
	toks := zeroGPUTokens()
	one, _ := zeroRun(t, c, 1, toks)
	c.Collectives = "staged"
	got, _ := zeroRun(t, c, 12, toks)
	for i := range one {
		for j, what := range []string{"loss", "grad_norm"} {
			if d := math.Abs(got[i][j]-one[i][j]) / math.Abs(one[i][j]); d > []float64{5e-4, 5e-3}[j] {
				t.Errorf("step %d: %s %v, one GPU %v (relative %.2g)", i+1, what, got[i][j], one[i][j], d)
			}
		}
	}
	t.Logf("12 ranks, width 32: loss %.5f -> %.5f (one GPU %.5f -> %.5f)", got[0][0], got[len(got)-1][0], one[0][0], one[len(one)-1][0])
}
