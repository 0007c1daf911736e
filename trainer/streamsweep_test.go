package trainer

import (
	"testing"

	"github.com/deepstates/dos/perfmodel"
)

// TestStreamSweep: with the H200's profile, the 4.24B model at batch 8
// with --recompute under 24 GiB (dos train's CUDA defaults: subgroups of
// 100M, 50M or 25M) streams 9 blocks before the profile (the fewest that
// leave the update phase StreamReserve), and the performance model's
// sweep takes 16: the fastest predicted update phase is 17's, and 16 is
// the fewest within 2 % of it. Streamed and the device and host memory
// then count 16. A model that fits without streaming is not swept into
// streaming, and the host memory bounds the counts weighed.
func TestStreamSweep(t *testing.T) {
	p, err := perfmodel.Read("../testdata/profiles/h200.json")
	if err != nil {
		t.Fatal(err)
	}
	c := gpuConfig(t, 24)
	c.Recompute, c.SampleBytes, c.StreamBlocks = true, 0, StreamAuto
	c.SubgroupSize, c.SubgroupSizes = 100_000_000, []int{100_000_000, 50_000_000, 25_000_000}
	if n := c.Streamed(); n != 9 {
		t.Fatalf("before the profile: %d blocks, want 9", n)
	}
	hostBefore := c.MemoryBytes()
	sweep, pick, err := c.StreamSweep(p, 16)
	if err != nil || pick < 0 {
		t.Fatalf("pick %d, %v", pick, err)
	}
	fastest := 0
	for i, sc := range sweep {
		if sc.Update.Makespan < sweep[fastest].Update.Makespan {
			fastest = i
		}
		if sc.Budget <= 0 || sc.HostHeld != int64(sc.Blocks*blockStreamedElems(c.Model)) {
			t.Errorf("%d blocks: budget %d, host-held %d", sc.Blocks, sc.Budget, sc.HostHeld)
		}
	}
	if sweep[0].Blocks != 4 || sweep[len(sweep)-1].Blocks != 36 || sweep[fastest].Blocks != 17 || sweep[pick].Blocks != 16 ||
		sweep[pick].Update.Makespan > 1.02*sweep[fastest].Update.Makespan || sweep[pick-1].Update.Makespan <= 1.02*sweep[fastest].Update.Makespan {
		t.Errorf("counts %d..%d, fastest %d (%.3f s), picked %d (%.3f s)", sweep[0].Blocks, sweep[len(sweep)-1].Blocks,
			sweep[fastest].Blocks, sweep[fastest].Update.Makespan, sweep[pick].Blocks, sweep[pick].Update.Makespan)
	}
	c.streamModel, c.streamKey = sweep[pick].Blocks, c.streamKeyNow()
	if n, m := c.Streamed(), c.DeviceMemory(c.Batch); n != 16 || m.Streamed != 16 || m.BudgetLeft(24<<30) != sweep[pick].Budget {
		t.Errorf("after: Streamed %d, DeviceMemory %+v", n, m)
	}
	if d := c; true {
		d.Batch = 7 // a copy at another batch counts its own
		if n := d.Streamed(); n == 16 {
			t.Errorf("batch 7: %d blocks, the count chosen for batch 8", n)
		}
	}
	if grew := c.MemoryBytes() - hostBefore; grew != float64(4*7*blockStreamedElems(c.Model)) {
		t.Errorf("host memory grew by %.0f bytes, want 4 a parameter of the 7 more blocks", grew)
	}
	// The host memory the run may use bounds the counts: one that holds 12 blocks.
	c.streamModel, c.streamKey = 12, c.streamKeyNow()
	c.MaxMemory = c.MemoryBytes() / gibBytes
	c.streamModel = 0
	if sweep, _, err := c.StreamSweep(p, 16); err != nil || sweep[len(sweep)-1].Blocks != 12 {
		t.Errorf("under --max-memory %.2f: up to %d blocks, %v", c.MaxMemory, sweep[len(sweep)-1].Blocks, err)
	}
	// --gpu-budget: every count weighed leaves at least it, and plans with it.
	c.MaxMemory, c.streamModel, c.GPUBudget = 1000, 0, 2
	if sweep, pick, err := c.StreamSweep(p, 2); err != nil || pick < 0 {
		t.Errorf("--gpu-budget 2: pick %d, %v", pick, err)
	} else {
		for _, sc := range sweep {
			if m := c.deviceMemory(c.Batch, sc.Blocks); sc.Budget != 2<<30 || m.BudgetLeft(24<<30) < 2<<30 {
				t.Errorf("--gpu-budget 2, %d blocks: budget %d, %d left", sc.Blocks, sc.Budget, m.BudgetLeft(24<<30))
			}
		}
	}
	c.GPUBudget = 0
	xl := gpuConfig(t, 24)
	xl.Model.NLayer, xl.Model.NEmbd, xl.Model.NHead = 48, 1600, 25
	xl.Recompute, xl.StreamBlocks, xl.SampleBytes = true, StreamAuto, 0
	if _, pick, err := xl.StreamSweep(p, 16); err != nil || pick != -1 || xl.Streamed() != 0 {
		t.Errorf("gpt2-xl under 24 GiB: pick %d, %v: it fits without streaming", pick, err)
	}
}

// TestStreamSweepSpeculateAuto: --speculate auto's saves do not take part
// in --stream-blocks auto's choice (the 4.24B model under 24 GiB with 80
// GiB of host memory takes the count it takes with --speculate 0), and
// once the count is chosen they take half of what it leaves.
func TestStreamSweepSpeculateAuto(t *testing.T) {
	p, err := perfmodel.Read("../testdata/profiles/h200.json")
	if err != nil {
		t.Fatal(err)
	}
	setMemAvailable(t, 0, false)
	pick := func(spec float64) (TrainConfig, int) {
		c := gpuConfig(t, 24)
		c.Recompute, c.SampleBytes, c.StreamBlocks, c.MaxMemory, c.Speculate = true, 0, StreamAuto, 80, spec
		c.SubgroupSize, c.SubgroupSizes = 100_000_000, []int{100_000_000, 50_000_000, 25_000_000}
		if err := c.Validate(); err != nil {
			t.Fatal(err)
		}
		sweep, i, err := c.ChooseStreamed(p, 16)
		if err != nil || i < 0 {
			t.Fatalf("--speculate %v: pick %d, %v", spec, i, err)
		}
		return c, sweep[i].Blocks
	}
	_, off := pick(0)
	c, auto := pick(SpeculateAuto)
	if auto != off {
		t.Errorf("--stream-blocks auto: %d blocks with --speculate auto, %d with 0", auto, off)
	}
	c.resolveSpeculate()
	got := c.speculateBytes()
	c.specAuto = 0
	want := int64((80*gibBytes - c.MemoryBytes()) / 2)
	if want > SpeculateAutoGiB<<30 {
		want = SpeculateAutoGiB << 30
	}
	if got != want || got <= 0 {
		t.Errorf("after the count (%d blocks): %d bytes of saves, want %d (half of what is left)", auto, got, want)
	}
}
