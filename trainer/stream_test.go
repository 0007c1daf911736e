package trainer

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
)

// TestStreamedNames: the streamed tensors of the first n blocks are their
// matrices and biases, 8 a block, never a LayerNorm; a block slot holds
// them 256-byte aligned.
func TestStreamedNames(t *testing.T) {
	c := Config{VocabSize: 256, NCtx: 16, NLayer: 3, NHead: 2, NEmbd: 8}
	names := streamedNames(c, 2)
	if len(names) != 16 || names[0] != "h.0.attn.c_attn.weight" || names[15] != "h.1.mlp.c_proj.bias" {
		t.Fatalf("streamed tensors of 2 blocks: %v", names)
	}
	for _, n := range names {
		if strings.Contains(n, "ln_") {
			t.Errorf("%s streams", n)
		}
	}
	C := 8
	if got, want := blockStreamedElems(c), 12*C*C+9*C; got != want {
		t.Errorf("a block's streamed elements: %d, want %d", got, want)
	}
	off, bytes := slotLayout(c)
	for j, o := range off {
		if o%replicaAlign != 0 || (j > 0 && o <= off[j-1]) {
			t.Errorf("slot offsets %v", off)
		}
	}
	if bytes < 2*int64(blockStreamedElems(c)) || bytes%replicaAlign != 0 {
		t.Errorf("slot bytes %d", bytes)
	}
}

// TestGPUStreamBitwise trains on the GPU for 6 iterations with clipping,
// evaluation and a sample, with none, one, three and all four blocks'
// weights streamed from host memory (--stream-blocks), with and without
// --recompute, and once streamed for 3 iterations then resumed to 6 with
// another count: the losses, the sample and every master weight are the
// same bits as the run with every weight on the device.
func TestGPUStreamBitwise(t *testing.T) {
	gpuEnv(t)
	setMemAvailable(t, 0, false)
	cfg := DefaultTrainConfig()
	serialSchedule(&cfg)
	cfg.Model = Config{VocabSize: 256, NCtx: 64, NLayer: 4, NHead: 2, NEmbd: 128}
	cfg.Batch, cfg.Device, cfg.Steps = 4, "cuda", 6
	cfg.WorkingDType, cfg.GradDType = adam.BF16, adam.BF16
	cfg.SubgroupSize = 60_000
	cfg.SampleBytes, cfg.EvalBatches, cfg.EvalEvery, cfg.LogEvery, cfg.DecaySteps = 40, 1, 3, 0, 6
	cfg.MaxGradNorm = 0.5
	text := []byte(strings.Repeat("Light is propagated in straight lines, and refracted at the surfaces of bodies. ", 400))
	type result struct {
		s       Summary
		masters map[string][]float32
	}
	// schedule splits the subgroups that stay on the device in thirds.
	schedule := func(c TrainConfig) string {
		n := c.subgroups()
		return fmt.Sprintf("%d,%d,%d", n-2*(n/3), n/3, n/3)
	}
	run := func(c TrainConfig) result {
		t.Helper()
		if c.Schedule == "" {
			c.Schedule = schedule(c)
		}
		tr, err := New(c, text, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tr.Close()
		if n := tr.w.ranks[0].rep.(*gpuReplica).streamed(); n != c.StreamBlocks {
			t.Fatalf("--stream-blocks %d: the trainer streams %d blocks", c.StreamBlocks, n)
		}
		s, err := tr.Run()
		if err != nil {
			t.Fatal(err)
		}
		r := result{s: s, masters: map[string][]float32{}}
		for _, p := range tr.opt.Params() {
			if r.masters[p.Name], err = tr.opt.MasterOf(p.Name); err != nil {
				t.Fatal(err)
			}
		}
		return r
	}
	same := func(what string, a, b result) {
		t.Helper()
		if a.s.FinalLoss != b.s.FinalLoss || a.s.ValLoss != b.s.ValLoss || a.s.InitialLoss != b.s.InitialLoss || a.s.Sample != b.s.Sample {
			t.Errorf("%s: losses %v %v %v, sample %q; resident %v %v %v, %q", what, b.s.InitialLoss, b.s.FinalLoss, b.s.ValLoss, b.s.Sample,
				a.s.InitialLoss, a.s.FinalLoss, a.s.ValLoss, a.s.Sample)
		}
		for name, x := range a.masters {
			for i := range x {
				if math.Float32bits(x[i]) != math.Float32bits(b.masters[name][i]) {
					t.Fatalf("%s: %s[%d] %v, resident %v", what, name, i, b.masters[name][i], x[i])
				}
			}
		}
	}
	for _, recompute := range []bool{false, true} {
		c := cfg
		c.Recompute, c.StreamBlocks = recompute, 0
		// The reference runs each forward after the update phase; every
		// other run overlaps it with the phase's tail (the default).
		c.NoOverlapForward = true
		ref := run(c)
		c.NoOverlapForward = false
		same(fmt.Sprintf("recompute %v, resident, the forward over the update's tail", recompute), ref, run(c))
		// Every subgroup on one CPU worker: the update phase is far slower
		// than this model's forward, which runs ahead and must wait for
		// each block (a missing wait reads the last step's weights).
		slow := c
		slow.Schedule, slow.Threads = "cpu", 1
		same(fmt.Sprintf("recompute %v, resident, the forward over a slow CPU update phase", recompute), ref, run(slow))
		slow.StreamBlocks = 3
		same(fmt.Sprintf("recompute %v, 3 blocks streamed, the forward over a slow CPU update phase", recompute), ref, run(slow))
		// The resident subgroups first (--resident-first), resident and
		// streamed, speculating.
		rf := c
		rf.ResidentFirst = true
		same(fmt.Sprintf("recompute %v, resident subgroups first", recompute), ref, run(rf))
		rf.StreamBlocks, rf.Speculate = 3, 1
		same(fmt.Sprintf("recompute %v, resident subgroups first, 3 blocks streamed, speculating", recompute), ref, run(rf))
		if !(ref.s.FinalLoss < ref.s.InitialLoss) || ref.s.Sample == "" {
			t.Fatalf("the resident run: %+v", ref.s)
		}
		for _, n := range []int{1, 3, 4} {
			c.StreamBlocks = n
			same(fmt.Sprintf("recompute %v, %d blocks streamed", recompute, n), ref, run(c))
		}
		// Speculative updates of the streamed blocks (--speculate): with
		// clipping at 0.5 (it binds in the first steps: restored, then
		// paused) and without clipping (kept at every step but the first,
		// which never speculates), bitwise the resident run's.
		c.StreamBlocks, c.Speculate = 3, 1
		same(fmt.Sprintf("recompute %v, 3 blocks streamed, speculating, clipping at 0.5", recompute), ref, run(c))
		nc := c
		nc.MaxGradNorm, nc.StreamBlocks, nc.Speculate, nc.NoOverlapForward = 0, 0, 0, true
		refNoClip := run(nc)
		nc.NoOverlapForward = false
		nc.StreamBlocks, nc.Speculate = 3, 1
		nc.LogJSON = filepath.Join(t.TempDir(), "steps.jsonl")
		same(fmt.Sprintf("recompute %v, 3 blocks streamed, speculating, no clipping", recompute), refNoClip, run(nc))
		if kept := speculatedSteps(t, nc.LogJSON); kept != nc.Steps-1 { // all but the first
			t.Errorf("recompute %v, no clipping: %d of %d steps kept a speculative update, want all but the first", recompute, kept, nc.Steps)
		}
		// Nothing streamed: the CPU subgroups speculated on, from their
		// gradients moved during the backward.
		nc.StreamBlocks = 0
		nc.LogJSON = filepath.Join(t.TempDir(), "steps.jsonl")
		same(fmt.Sprintf("recompute %v, nothing streamed, speculating, no clipping", recompute), refNoClip, run(nc))
		// A CPU subgroup is taken only once its gradient's copy is done,
		// and the step stops the workers where they are: on a backward
		// this small (a few ms) whether they took one before it ended
		// is timing (one H100 run of 2026-12-07 kept 4 of the 5).
		if kept := speculatedSteps(t, nc.LogJSON); kept < 1 {
			t.Errorf("recompute %v, nothing streamed, no clipping: %d of %d steps kept a speculative update, want some", recompute, kept, nc.Steps)
		}
		c.Speculate = 0
		if recompute {
			continue
		}
		// Streamed, checkpointed at 3, resumed with another count.
		dir := t.TempDir()
		c.CkptDir, c.Steps, c.StreamBlocks = dir, 3, 2
		run(c)
		c.Steps, c.Resume, c.StreamBlocks = 6, true, 3
		got := run(c)
		ref.s.InitialLoss, ref.s.Sample = got.s.InitialLoss, got.s.Sample // the resumed run's first iteration is 4
		same("2 blocks streamed to iteration 3, resumed with 3", ref, got)
	}
}

// speculatedSteps counts the steps of a --log-json file that kept a
// speculative update (speculated > 0).
func speculatedSteps(t *testing.T, path string) int {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		var r struct {
			Speculated int64 `json:"speculated"`
		}
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatal(err)
		}
		if r.Speculated > 0 {
			n++
		}
	}
	return n
}
