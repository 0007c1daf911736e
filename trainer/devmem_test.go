package trainer

import (
	"math"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/gpt"
	"github.com/deepstates/dos/offload"
)

// gpuConfig is the 4.24B GPT-2-shaped model (36 × 3072, GPT-2's
// vocabulary, context 1024) at batch 8 on one GPU under capGiB.
func gpuConfig(t *testing.T, capGiB float64) TrainConfig {
	t.Helper()
	c := DefaultTrainConfig()
	m, err := gpt.Preset("gpt2")
	if err != nil {
		t.Fatal(err)
	}
	m.NLayer, m.NEmbd, m.NHead = 36, 3072, 24
	c.Model, c.Batch, c.Device, c.GPUMemory, c.GradDType, c.WorkingDType = m, 8, "cuda", capGiB, adam.BF16, adam.BF16
	c.Tokenizer, c.MaxMemory = "gpt2", 1000 // the host's check is not this test's
	return c
}

// TestDeviceMemoryParts: DeviceMemory's parts are offload's and gptcuda's
// own counts (4 B per parameter with bf16 gradients, the fp32 masters of
// gptcuda.FP32Tensors) and grow with the batch; --sample 0 drops the
// sampler, BF16Params the masters.
func TestDeviceMemoryParts(t *testing.T) {
	c := gpuConfig(t, 24)
	m := c.DeviceMemory(8)
	if n := int64(c.Model.NumParams()); m.WeightsGrads != 4*n {
		t.Errorf("WeightsGrads %d, want 4 × %d", m.WeightsGrads, n)
	}
	C, V, T := int64(c.Model.NEmbd), int64(c.Model.VocabSize), int64(c.Model.NCtx)
	if want := 4 * (V*C + T*C + int64(c.Model.NLayer)*4*C + 2*C); m.Masters != want {
		t.Errorf("Masters %d, want %d (wte, wpe, the LayerNorms in fp32)", m.Masters, want)
	}
	if m4 := c.DeviceMemory(4); !(m4.Activations > 0 && m4.Activations < m.Activations) || m4.Sampler != m.Sampler || m.Sampler == 0 {
		t.Errorf("batch 4: %+v, batch 8: %+v", m4, m)
	}
	c.SampleBytes, c.BF16Params = 0, true
	if m := c.DeviceMemory(8); m.Sampler != 0 || m.Masters != 0 || m.Total() != m.Activations+m.WeightsGrads {
		t.Errorf("--sample 0 --bf16-params: %+v", m)
	}
}

// TestDeviceMemoryCalibration: the start-up calibration's floor
// (offload.MinCalibrationBytes) counts in Total only where it is more
// than the weights, gradients, masters and sampler it runs before (a
// small model's), and not at all with --profile; a run that fits only
// without it is refused.
func TestDeviceMemoryCalibration(t *testing.T) {
	c := gpuConfig(t, 24)
	c.Model.NLayer, c.Model.NEmbd, c.Model.NHead, c.Model.VocabSize, c.Tokenizer = 2, 128, 2, 256, "byte"
	c.SampleBytes = 0
	m := c.DeviceMemory(8)
	rest := m.WeightsGrads + m.Masters
	if m.BudgetLeft(1<<30) != 1<<30-CapMargin-m.Activations-rest {
		t.Errorf("BudgetLeft %d: the calibration, freed before the budget is taken, counted", m.BudgetLeft(1<<30))
	}
	if m.Calibration != offload.MinCalibrationBytes || rest >= m.Calibration || m.Total() != m.Activations+m.Calibration {
		t.Errorf("a small model: %+v, Total %d, want the activations and the calibration's %d", m, m.Total(), offload.MinCalibrationBytes)
	}
	c.Profile = "h200.json"
	if p := c.DeviceMemory(8); p.Calibration != 0 || p.Total() != p.Activations+rest {
		t.Errorf("--profile: %+v, want no calibration", p)
	}
	// A cap the activations and weights fit in, the calibration not.
	c.Profile = ""
	c.GPUMemory = float64(CapMargin+m.Activations+rest+(m.Calibration-rest)/2) / gibBytes
	if err := c.checkDeviceMemory(); err == nil || !strings.Contains(err.Error(), "the start-up calibration 0.11 (") {
		t.Errorf("under %.4f GiB: %v, want a refusal naming the calibration", c.GPUMemory, err)
	}
	big := gpuConfig(t, 24)
	if m := big.DeviceMemory(8); m.Total() != m.Activations+m.Sampler+m.WeightsGrads+m.Masters+m.Slots {
		t.Errorf("the 4.24B model: %+v: the calibration counted where the weights are larger", m)
	}
}

// TestValidateDeviceMemory: a run on one GPU whose weights, gradients and
// activations are over --gpu-memory is refused by Validate, before
// anything is allocated, naming the parts and what fits; each thing it
// names does fit. The runs ANCHORS.md measures (gpt2-xl at batch 8 with
// --recompute under 24 GiB) pass, and so do runs without a cap or on
// several GPUs (not checked here).
func TestValidateDeviceMemory(t *testing.T) {
	c := gpuConfig(t, 24)
	err := c.Validate()
	// Streaming does not make batch 8 fit without --recompute: the
	// activations alone are 47 GiB.
	wantErr(t, "4.24B under 24 GiB", err, "--gpu-memory 24 GiB: --layers 36 --embd 3072 --ctx 1024 --batch 8 need 65.",
		"weights and gradients 15.78, fp32 masters 0.59, activations 47.", "what fits: --batch 3, or --recompute")
	// The advice: --recompute, with 13 blocks streamed (StreamAuto).
	auto := c
	auto.Recompute = true
	if err := auto.Validate(); err != nil || auto.Streamed() != 13 {
		t.Errorf("the advice --recompute: %v, %d blocks streamed, want 13", err, auto.Streamed())
	}
	if m := auto.DeviceMemory(8); m.BudgetLeft(24<<30) < StreamReserve || m.Streamed != 13 || m.Slots != 2*slotBytes(auto.Model) {
		t.Errorf("--recompute with 13 blocks streamed: %+v leaves %d bytes, want at least StreamReserve", m, m.BudgetLeft(24<<30))
	}
	auto.StreamBlocks = 12 // one fewer leaves the update phase less than StreamReserve
	if m := auto.DeviceMemory(8); m.BudgetLeft(24<<30) >= StreamReserve {
		t.Errorf("12 blocks streamed leave %d bytes: 13 was not the fewest", m.BudgetLeft(24<<30))
	}
	// Without streaming (--stream-blocks 0), the refusal, which
	// with --recompute names the blocks to stream.
	c.StreamBlocks = 0
	wantErr(t, "4.24B under 24 GiB, --stream-blocks 0", c.Validate(), "what fits: --recompute --batch 5")
	r := c
	r.Recompute = true
	wantErr(t, "4.24B --recompute under 24 GiB, --stream-blocks 0", r.Validate(), "(weights and gradients 15.78, fp32 masters 0.59, activations 8.08", "what fits: --stream-blocks 8, or --batch 5")
	r.StreamBlocks = 8
	if err := r.Validate(); err != nil {
		t.Errorf("the advice --stream-blocks 8: %v", err)
	}
	fit := c
	fit.Recompute, fit.Batch = true, 5
	if err := fit.Validate(); err != nil {
		t.Errorf("the advice --recompute --batch 5: %v", err)
	}
	// 5 is the largest batch with CapMargin aside (the advice is a batch
	// the run's budget holds, not one only Validate passes).
	fit.Batch = 6
	if m := fit.DeviceMemory(6); m.BudgetLeft(24<<30) >= 0 {
		t.Errorf("--recompute --batch 6 leaves %d bytes with CapMargin aside: 5 was not the largest batch", m.BudgetLeft(24<<30))
	}
	if m := fit.DeviceMemory(5); m.BudgetLeft(24<<30) < 0 {
		t.Errorf("--recompute --batch 5 is over the cap with CapMargin aside by %d bytes", -m.BudgetLeft(24<<30))
	}

	c = gpuConfig(t, 16)
	c.Recompute = true
	if err := c.Validate(); err != nil || c.Streamed() == 0 {
		t.Errorf("4.24B under 16 GiB with --recompute: %v, %d blocks streamed", err, c.Streamed())
	}
	c = gpuConfig(t, 3)
	c.Recompute = true
	wantErr(t, "4.24B under 3 GiB", c.Validate(), "no smaller --batch, --recompute or --stream-blocks fits")
	c.StreamBlocks = 37
	wantErr(t, "--stream-blocks 37", c.Validate(), "--stream-blocks 37: want 0..36")
	c.StreamBlocks, c.GPUs = 2, 2
	wantErr(t, "--stream-blocks 2 --gpus 2", c.Validate(), "built for one GPU only, not yet for ZeRO-3")

	// TestGPUMemoryCap's model under its 1 MiB cap, as New refuses it
	// there (on the GPU machine) before anything is allocated.
	tiny := DefaultTrainConfig()
	tiny.Model = Config{VocabSize: 256, NCtx: 64, NLayer: 2, NHead: 2, NEmbd: 128}
	tiny.Batch, tiny.Device, tiny.Steps = 4, "cuda", 3
	tiny.WorkingDType, tiny.GradDType = adam.BF16, adam.BF16
	tiny.SampleBytes, tiny.EvalBatches, tiny.LogEvery = 0, 1, 0
	tiny.Schedule, tiny.GPUMemory = "1,0,0", 1.0/1024
	wantErr(t, "TestGPUMemoryCap's 1 MiB", tiny.Validate(), "of device memory before the update phase's", "no smaller --batch, --recompute or --stream-blocks fits")
	tiny.GPUMemory = 1
	if err := tiny.Validate(); err != nil {
		t.Errorf("TestGPUMemoryCap's model under 1 GiB: %v", err)
	}

	xl, err := gpt.Preset("gpt2-xl")
	if err != nil {
		t.Fatal(err)
	}
	c = gpuConfig(t, 24)
	c.Model, c.Recompute = xl, true
	if err := c.Validate(); err != nil {
		t.Errorf("gpt2-xl --recompute --batch 8 under 24 GiB: %v", err)
	}
	c.Recompute = false
	wantErr(t, "gpt2-xl without --recompute", c.Validate(), "what fits: --batch 7, or --recompute")
	for _, f := range []func(*TrainConfig){
		func(c *TrainConfig) { c.GPUMemory = 0 },
		func(c *TrainConfig) { c.GPUs, c.Collectives = 2, "staged" }, // ranks may share a GPU: not checked
	} {
		d := gpuConfig(t, 24)
		f(&d)
		if err := d.Validate(); err != nil && strings.Contains(err.Error(), "of device memory before the update phase") {
			t.Errorf("%+v: %v", d.GPUs, err)
		}
	}
}

// TestValidateRankDeviceMemory: a ZeRO-3 job over NCCL (one rank per GPU)
// is checked per GPU before anything is allocated: the rank's rows'
// activations, its pieces of the weights, gradients and masters, and its
// replicas (replicaLayout, what gatherSource allocates); the refusal
// names what fits, and each does.
func TestValidateRankDeviceMemory(t *testing.T) {
	c := gpuConfig(t, 24)
	c.GPUs = 2
	one := gpuConfig(t, 24)
	m, m1 := c.DeviceMemory(8), one.deviceMemory(8, 0)
	// Half the weights and masters (the first rank's pieces round up),
	// and the replicas: the whole tensors outside the blocks' matrices
	// and two blocks', bf16 twice (working copy, gradients), their fp32
	// masters.
	if m.WeightsGrads < m1.WeightsGrads/2 || m.WeightsGrads > m1.WeightsGrads/2+1<<20 || m.Masters < m1.Masters/2 || m.Masters > m1.Masters/2+1<<20 {
		t.Errorf("--gpus 2: pieces %d and %d bytes, want half of one GPU's %d and %d", m.WeightsGrads, m.Masters, m1.WeightsGrads, m1.Masters)
	}
	C := int64(c.Model.NEmbd)
	block := int64(blockStreamedElems(c.Model))
	outside := int64(c.Model.NumParams()) - int64(c.Model.NLayer)*block
	if lo, hi := 2*2*(outside+2*block)+m1.Masters, 2*2*(outside+2*block)+m1.Masters+4<<20; m.Replicas < lo || m.Replicas > hi {
		t.Errorf("--gpus 2: replicas %d bytes, want %d..%d (C %d)", m.Replicas, lo, hi, C)
	}
	if rows := one.deviceMemory(4, 0).Activations; m.Activations != rows {
		t.Errorf("--gpus 2 at batch 8: activations %d, want one GPU's at 4 rows, %d", m.Activations, rows)
	}
	wantErr(t, "4.24B --gpus 2 under 24 GiB", c.Validate(), "the rank's replicas 2.02 (--gpus 2", "what fits: --batch 2, or --gpus 4, or --recompute")
	for _, f := range []func(*TrainConfig){
		func(c *TrainConfig) { c.Batch = 2 },
		func(c *TrainConfig) { c.GPUs = 4 },
		func(c *TrainConfig) { c.Recompute = true },
	} {
		d := c
		f(&d)
		if err := d.Validate(); err != nil {
			t.Errorf("the advice for --gpus 2 (now --gpus %d --batch %d --recompute %v): %v", d.GPUs, d.Batch, d.Recompute, err)
		}
	}
	// 2 is the largest batch (a multiple of the ranks) with CapMargin aside.
	if b := c.LargestBatch(24<<30-CapMargin, 64); b != 2 || c.DeviceMemory(4).BudgetLeft(24<<30) >= 0 {
		t.Errorf("LargestBatch for --gpus 2: %d, want 2", b)
	}
}

// TestDeviceMemoryTooLarge (the plan's adversary, F1): a batch or context
// whose bytes an int64 would not hold counted negative activations and
// passed Validate; now they are MaxDeviceBytes (TooLarge) and refused,
// and LargestBatch's bisection up to math.MaxInt does not overflow.
func TestDeviceMemoryTooLarge(t *testing.T) {
	c := gpuConfig(t, 24)
	c.Model.NLayer, c.Model.NEmbd, c.Model.NHead = 12, 768, 12
	for _, b := range []int{100_000_000_000, 1 << 62, math.MaxInt} {
		m := c.DeviceMemory(b)
		if !m.TooLarge() || m.Total() < MaxDeviceBytes {
			t.Errorf("batch %d: %+v, want TooLarge", b, m)
		}
	}
	c.Batch = 100_000_000_000
	wantErr(t, "batch 1e11", c.Validate(), "need over 1 PiB of device memory for the activations alone", "what fits: --batch 52")
	// 52 with 6 blocks' weights from host memory (StreamAuto), 51 without.
	if b := c.LargestBatch(24<<30-CapMargin, math.MaxInt); b != 52 {
		t.Errorf("LargestBatch up to MaxInt: %d, want 52", b)
	}
	huge := gpuConfig(t, 80)
	huge.Model.NLayer, huge.Model.NEmbd, huge.Model.NHead, huge.Model.NCtx = 1024, 1024, 512, 1<<20
	if m := huge.DeviceMemory(1); !m.TooLarge() {
		t.Errorf("context 2^20, 1024 layers: %+v, want TooLarge", m)
	}
}

// TestLargestBatchAuto (the adversary's find): with --stream-blocks auto,
// DeviceMemory had to grow with the batch for LargestBatch's bisection:
// a batch that fit the cap unstreamed but not the cap less CapMargin was
// followed by a larger one that streamed and fit, and bisection skipped
// it. Every threshold is now the cap less CapMargin; the bisection finds
// the largest batch a scan finds.
func TestLargestBatchAuto(t *testing.T) {
	for _, gib := range []float64{16, 24, 40} {
		for _, rc := range []bool{false, true} {
			c := gpuConfig(t, gib)
			c.Model.NLayer, c.Model.NEmbd, c.Model.NHead = 48, 1600, 25 // gpt2-xl's shape
			c.Recompute = rc
			capBytes := int64(gib*gibBytes) - CapMargin
			best := 0
			for b := 1; b <= 96; b++ {
				if c.DeviceMemory(b).Total() <= capBytes {
					best = b
				}
			}
			if got := c.LargestBatch(capBytes, 96); got != best {
				t.Errorf("%g GiB, --recompute %v: LargestBatch %d, the largest batch that fits %d", gib, rc, got, best)
			}
		}
	}
}

// TestStreamedFewest: StreamAuto's count (closed form) is the fewest
// blocks, counted one by one, that leave the update phase StreamReserve,
// else the fewest that fit, for the 4.24B model from 12 to 40 GiB.
func TestStreamedFewest(t *testing.T) {
	for gib := 12.0; gib <= 40; gib += 2 {
		c := gpuConfig(t, gib)
		c.Recompute = true
		safe := int64(gib*gibBytes) - CapMargin
		want := 0
		if c.deviceMemory(8, 0).Total() > safe {
		rooms:
			for _, room := range []int64{safe - StreamReserve, safe} {
				for n := 1; n <= c.Model.NLayer; n++ {
					if c.deviceMemory(8, n).Total() <= room {
						want = n
						break rooms
					}
				}
			}
		}
		if got := c.Streamed(); got != want {
			t.Errorf("%g GiB: %d blocks, want %d", gib, got, want)
		}
	}
}
