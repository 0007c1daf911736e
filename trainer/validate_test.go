package trainer

import (
	"math"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
)

// setMemAvailable makes Validate see avail bytes of available memory (ok
// false: none reported) until the test ends.
func setMemAvailable(t *testing.T, avail int64, ok bool) {
	t.Helper()
	old := memAvailable
	memAvailable = func() (int64, bool) { return avail, ok }
	t.Cleanup(func() { memAvailable = old })
}

// wantErr fails the test unless err is non-nil and contains every string
// of want.
func wantErr(t *testing.T, what string, err error, want ...string) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: Validate() = nil, want an error containing %q", what, want)
		return
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%s: Validate() = %q, want it to contain %q", what, err, w)
		}
	}
}

// TestValidateThreads: --threads is bounded by MaxThreads (4 × NumCPU), so
// that a typo cannot size the pool's channel or start 10,000 goroutines.
func TestValidateThreads(t *testing.T) {
	setMemAvailable(t, 0, false)
	if got, want := MaxThreads(), 4*runtime.NumCPU(); got != want {
		t.Fatalf("MaxThreads() = %d, want %d", got, want)
	}
	for _, n := range []int{0, 1, MaxThreads()} {
		c := DefaultTrainConfig()
		c.Threads = n
		if err := c.Validate(); err != nil {
			t.Errorf("threads %d: %v", n, err)
		}
	}
	for _, n := range []int{-1, MaxThreads() + 1, 10000, 100000000} {
		c := DefaultTrainConfig()
		c.Threads = n
		wantErr(t, "threads "+strconv.Itoa(n), c.Validate(), "--threads "+strconv.Itoa(n)+":", "0.."+strconv.Itoa(MaxThreads()), "4 × the CPUs")
	}
}

// TestValidateMemory: the estimate is checked against the available memory
// (injected here) or --max-memory, before anything is allocated.
func TestValidateMemory(t *testing.T) {
	const gib = 1 << 30
	c := DefaultTrainConfig()
	need := c.MemoryBytes()

	// The model on a 20 GiB machine: refused, naming the estimate,
	// what is available and the override.
	big := DefaultTrainConfig()
	big.Model.NEmbd, big.Model.NLayer, big.Model.NHead = 2048, 24, 16
	setMemAvailable(t, 20*gib, true)
	wantErr(t, "embd 2048 layers 24", big.Validate(), "--layers 24 --embd 2048 --ctx 64 --batch 16 need about 21.8 GiB",
		"over the 20.0 GiB available (MemAvailable in /proc/meminfo)", "--max-memory")

	// The default model with less available than it needs: refused.
	setMemAvailable(t, int64(need)-1, true)
	wantErr(t, "default, little available", c.Validate(), "GiB available", "pass --max-memory GiB")
	// ... unless --max-memory allows it.
	c.MaxMemory = 1
	if err := c.Validate(); err != nil {
		t.Errorf("--max-memory 1: %v", err)
	}
	// --max-memory below the estimate refuses even with memory to spare.
	setMemAvailable(t, 1<<40, true)
	c.MaxMemory = need / gib / 2
	wantErr(t, "max-memory below the need", c.Validate(), "over --max-memory", "raise --max-memory")
	c.MaxMemory = 0
	if err := c.Validate(); err != nil {
		t.Errorf("enough available: %v", err)
	}
	// Enough available.
	setMemAvailable(t, int64(need)+1, true)
	if err := c.Validate(); err != nil {
		t.Errorf("just enough available: %v", err)
	}
	// Nothing reported: only MaxMemoryBytes.
	setMemAvailable(t, 0, false)
	if err := c.Validate(); err != nil {
		t.Errorf("no figure: %v", err)
	}
	if err := big.Validate(); err != nil {
		t.Errorf("no figure, 26 GiB model: %v", err)
	}
	huge := DefaultTrainConfig()
	huge.Model.NEmbd, huge.Model.NLayer, huge.Model.NHead = 16384, 96, 128 // 309B parameters: over 6 TiB
	wantErr(t, "over MaxMemoryBytes", huge.Validate(), "over dos's limit of 1024 GiB")
	huge.MaxMemory = 1024
	wantErr(t, "over MaxMemoryBytes with --max-memory 1024", huge.Validate(), "over --max-memory 1024 GiB")
	gpu4b := DefaultTrainConfig() // the 4.2B GPT-2 of BENCHMARKS' e2e table (byte-level vocabulary): about 61 GiB with --device cuda
	gpu4b.Model.NEmbd, gpu4b.Model.NLayer, gpu4b.Model.NHead, gpu4b.Model.NCtx, gpu4b.Batch, gpu4b.Device = 3072, 36, 24, 1024, 8, "cuda"
	gpu4b.WorkingDType, gpu4b.GradDType = adam.BF16, adam.BF16
	if got := gpu4b.MemoryBytes() / (1 << 30); got < 55 || got > 70 {
		t.Errorf("4.2B on cuda: MemoryBytes %.1f GiB, want about 61 (16 bytes a parameter and the largest tensor)", got)
	}
	if err := gpu4b.Validate(); err != nil {
		t.Errorf("no figure, 4.2B on cuda (61 GiB, under MaxMemoryBytes): %v", err)
	}

	for _, v := range []float64{-1, math.NaN(), math.Inf(1), 1025} {
		c := DefaultTrainConfig()
		c.MaxMemory = v
		wantErr(t, "max-memory "+strconv.FormatFloat(v, 'g', -1, 64), c.Validate(), "--max-memory", "want 0 (the available memory) to 1024")
	}
}

// TestMemoryBytesMeasured: MemoryBytes is within 10 % of what New really
// allocates (runtime.MemStats.TotalAlloc, the initial weights included)
// for a model whose parameters and activations both count.
func TestMemoryBytesMeasured(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates about 100 MB")
	}
	text := []byte(strings.Repeat("Of the Reflexions, Refractions, Inflexions and Colours of Light. ", 200))
	for _, tc := range []struct {
		dt   adam.DType
		gpus int
	}{{0, 1}, {adam.BF16, 1}, {0, 2}, {adam.BF16, 4}} {
		dt := tc.dt
		c := DefaultTrainConfig()
		c.Model = Config{VocabSize: VocabSize, NCtx: 64, NLayer: 3, NHead: 4, NEmbd: 256}
		c.Batch, c.GPUs = 8, tc.gpus
		if dt != 0 {
			c.GradDType, c.WorkingDType = dt, dt
		}
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		tr, err := New(c, text, nil)
		if err != nil {
			t.Fatal(err)
		}
		runtime.ReadMemStats(&after)
		if err := tr.Close(); err != nil {
			t.Fatal(err)
		}
		got, est := float64(after.TotalAlloc-before.TotalAlloc), c.MemoryBytes()
		t.Logf("grad/working %v/%v, %d rank(s): New allocated %.1f MiB, MemoryBytes %.1f MiB (%.3f)", c.GradDType, c.WorkingDType, c.GPUs, got/(1<<20), est/(1<<20), got/est)
		if r := got / est; r < 0.9 || r > 1.1 {
			t.Errorf("grad/working %v/%v, %d rank(s): New allocated %.0f bytes, MemoryBytes estimates %.0f (ratio %.2f)", c.GradDType, c.WorkingDType, c.GPUs, got, est, r)
		}
	}
}

// TestValidateNamesFlags: every error names the dos train flag as the user
// types it, with the value, never a config.json field.
func TestValidateNamesFlags(t *testing.T) {
	setMemAvailable(t, 0, false)
	field := regexp.MustCompile(`\b[a-z]+_[a-z_]+\b`) // n_head, min_lr_ratio, ...
	for _, tc := range []struct {
		mod  func(*TrainConfig)
		want string
	}{
		{func(c *TrainConfig) { c.Model.NEmbd = 3 }, "--heads 4 must divide --embd 3"},
		{func(c *TrainConfig) { c.Model.NHead = 3 }, "--heads 3 must divide --embd 128"},
		{func(c *TrainConfig) { c.Model.NHead = 0 }, "--heads 0 must divide --embd 128"},
		{func(c *TrainConfig) { c.Model.NEmbd = 0 }, "--embd 0: want 1..65536"},
		{func(c *TrainConfig) { c.Model.NLayer = 0 }, "--layers 0: want 1..1024"},
		{func(c *TrainConfig) { c.Model.NCtx = -1 }, "--ctx -1: want 1..1048576"},
		{func(c *TrainConfig) { c.Steps = -1 }, "--steps -1: want >= 0"},
		{func(c *TrainConfig) { c.Batch = 0 }, "--batch 0: want >= 1"},
		{func(c *TrainConfig) { c.WarmupSteps = -1 }, "--warmup -1"},
		{func(c *TrainConfig) { c.DecaySteps = -1 }, "--decay-steps -1"},
		{func(c *TrainConfig) { c.SubgroupSize = -1 }, "--subgroup-size -1"},
		{func(c *TrainConfig) { c.CkptEvery = -1 }, "--ckpt-every -1"},
		{func(c *TrainConfig) { c.CkptKeep = -1 }, "--ckpt-keep -1"},
		{func(c *TrainConfig) { c.EvalEvery = -1 }, "--eval-every -1"},
		{func(c *TrainConfig) { c.EvalBatches = 1<<16 + 1 }, "--eval-batches 65537: want 0..65536"},
		{func(c *TrainConfig) { c.LogEvery = -1 }, "--log-every -1"},
		{func(c *TrainConfig) { c.SampleBytes = 1<<20 + 1 }, "--sample 1048577"},
		{func(c *TrainConfig) { c.LR = 0 }, "--lr 0"},
		{func(c *TrainConfig) { c.MinLRRatio = 2 }, "--min-lr-ratio 2"},
		{func(c *TrainConfig) { c.Betas[0] = 2 }, "--beta1 2"},
		{func(c *TrainConfig) { c.Betas[1] = 1 }, "--beta2 1"},
		{func(c *TrainConfig) { c.Eps = 0 }, "--eps 0"},
		{func(c *TrainConfig) { c.WeightDecay = -1 }, "--weight-decay -1"},
		{func(c *TrainConfig) { c.MaxGradNorm = math.NaN() }, "--clip NaN"},
		{func(c *TrainConfig) { c.LossScale = 1e-50 }, "--loss-scale 1e-50"},
		{func(c *TrainConfig) { c.GradDType = 0 }, "--grad-dtype none"},
		{func(c *TrainConfig) { c.WorkingDType = adam.F32 }, "--working-dtype float32"},
		{func(c *TrainConfig) { c.GPUBudget = -1; c.Device = "sim"; c.WorkingDType = adam.BF16 }, "--gpu-budget -1 GiB"},
		{func(c *TrainConfig) { c.Resume = true }, "--resume needs --ckpt-dir"},
		{func(c *TrainConfig) { c.BF16Params = true }, "--bf16-params needs --device cuda"},
		{func(c *TrainConfig) { c.Recompute = true }, "--recompute needs --device cuda"},
		{func(c *TrainConfig) { c.NoOverlap = true }, "--no-overlap needs --device cuda"},
		{func(c *TrainConfig) { c.NoOverlap, c.Device, c.WorkingDType = true, "sim", adam.BF16 }, "--no-overlap needs --device cuda"},
		{func(c *TrainConfig) { c.Speculate = -2 }, "--speculate -2: want GiB from 0"},
		{func(c *TrainConfig) { c.Speculate = 4 }, "--speculate updates the CPU's subgroups during the backward: it needs --device cuda on one GPU"},
		{func(c *TrainConfig) {
			c.Device, c.WorkingDType, c.GradDType, c.Speculate, c.NoOverlap = "cuda", adam.BF16, adam.BF16, 4, true
		}, "and not --no-overlap"},
		{func(c *TrainConfig) { c.GPUMemory = -1 }, "--gpu-memory -1 GiB"},
		{func(c *TrainConfig) { c.GPUMemory = 24 }, "--gpu-memory caps the GPU's memory: it needs --device cuda"},
		{func(c *TrainConfig) {
			c.Device, c.WorkingDType, c.GradDType, c.GPUMemory, c.GPUBudget = "cuda", adam.BF16, adam.BF16, 4, 8
		}, "--gpu-budget 8 GiB is over --gpu-memory 4 GiB"},
	} {
		c := DefaultTrainConfig()
		tc.mod(&c)
		err := c.Validate()
		wantErr(t, tc.want, err, tc.want)
		if err != nil && field.MatchString(err.Error()) {
			t.Errorf("%s: %q names a config field, not a flag", tc.want, err)
		}
	}
	// No flag sets the vocabulary: its error keeps the config.json name.
	c := DefaultTrainConfig()
	c.Model.VocabSize = 300
	wantErr(t, "vocab", c.Validate(), "vocab_size 300")
	// The model config's own check (checkpoints' config.json) keeps the
	// field names.
	wantErr(t, "Config.Validate", Config{VocabSize: 256, NCtx: 8, NLayer: 1, NHead: 4, NEmbd: 3}.Validate(), "n_head = 4")
}

func TestParseMemAvailable(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
		ok   bool
	}{
		{"MemTotal:       24684092 kB\nMemFree:        24156508 kB\nMemAvailable:   24387720 kB\nBuffers:  10944 kB\n", 24387720 << 10, true},
		{"MemAvailable: 0 kB", 0, true},
		{"MemTotal:       24684092 kB\nMemFree:        24156508 kB\n", 0, false}, // before Linux 3.14
		{"MemAvailable: 12 MB\n", 0, false},
		{"MemAvailable: -5 kB\n", 0, false},
		{"MemAvailable: 99999999999999999999 kB\n", 0, false},
		{"", 0, false},
	} {
		got, ok := parseMemAvailable([]byte(tc.in))
		if got != tc.want || ok != tc.ok {
			t.Errorf("parseMemAvailable(%q) = %d, %t; want %d, %t", tc.in, got, ok, tc.want, tc.ok)
		}
	}
	if runtime.GOOS == "linux" {
		if n, ok := readMemAvailable(); !ok || n <= 0 {
			t.Errorf("readMemAvailable() = %d, %t on Linux", n, ok)
		}
	}
}

// TestSpeculateMemory: --speculate's saves count in MemoryBytes, at most
// 14 bytes per parameter, and nothing with --no-overlap.
func TestSpeculateMemory(t *testing.T) {
	setMemAvailable(t, 0, false)
	c := DefaultTrainConfig()
	c.Device, c.WorkingDType, c.GradDType, c.StreamBlocks = "cuda", adam.BF16, adam.BF16, 2
	base := c.MemoryBytes()
	all := int64(c.Model.NumParams())
	for _, tc := range []struct {
		gib  float64
		want int64
	}{{0, 0}, {1.0 / 1024, 1 << 20}, {100, 14 * all}} {
		c.Speculate = tc.gib
		if got := c.MemoryBytes() - base; got != float64(tc.want) {
			t.Errorf("--speculate %g: MemoryBytes grew by %v, want %d (14 B x %d parameters at most)", tc.gib, got, tc.want, all)
		}
	}
	c.NoOverlap = true
	if got := c.speculateBytes(); got != 0 {
		t.Errorf("--speculate 100 with --no-overlap: %d bytes of saves", got)
	}
}

// TestSpeculateAuto: --speculate auto takes SpeculateAutoGiB where the
// host memory allows, what every parameter needs for a small model, half
// of what the run leaves of the memory it may use where that is less, and
// nothing where that is under 256 MiB, off one GPU or on the host.
func TestSpeculateAuto(t *testing.T) {
	c := DefaultTrainConfig()
	c.Device, c.WorkingDType, c.GradDType, c.StreamBlocks, c.Speculate, c.Tokenizer = "cuda", adam.BF16, adam.BF16, 0, SpeculateAuto, "gpt2"
	c.Model = Config{VocabSize: 50304, NCtx: 1024, NLayer: 36, NHead: 24, NEmbd: 3072} // 4.24B: 12 GiB is 0.92B parameters
	setMemAvailable(t, 0, false)
	c.MaxMemory = 200
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if got := c.speculateBytes(); got != SpeculateAutoGiB<<30 {
		t.Errorf("4.24B with 200 GiB: %d bytes of saves, want %d", got, int64(SpeculateAutoGiB)<<30)
	}
	c.specAuto = 0
	base := c.MemoryBytes()
	c.MaxMemory = math.Ceil((base + 8<<30) / (1 << 30)) // 8 to 9 GiB left: half of it
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	limit := c.MaxMemory * (1 << 30)
	if got, want := c.speculateBytes(), int64((limit-base)/2); got != want {
		t.Errorf("%.2f GiB left: %d bytes of saves, want %d (half)", (limit-base)/(1<<30), got, want)
	}
	if got := c.MemoryBytes(); got > limit {
		t.Errorf("MemoryBytes %v with the saves, over the %v allowed", got, limit)
	}
	c.MaxMemory = (base + 400<<20) / (1 << 30) // 400 MiB left: 200 of saves, under 256
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if got := c.speculateBytes(); got != 0 {
		t.Errorf("%.2f GiB left: %d bytes of saves, want none", c.MaxMemory-base/(1<<30), got)
	}
	small := DefaultTrainConfig()
	small.Device, small.WorkingDType, small.GradDType, small.Speculate, small.MaxMemory, small.Tokenizer = "cuda", adam.BF16, adam.BF16, SpeculateAuto, 200, "gpt2"
	small.Model = Config{VocabSize: 50304, NCtx: 1024, NLayer: 12, NHead: 12, NEmbd: 768}
	if err := small.Validate(); err != nil {
		t.Fatal(err)
	}
	if got, want := small.speculateBytes(), 14*int64(small.Model.NumParams()); got != want {
		t.Errorf("gpt2: %d bytes of saves, want %d (14 B a parameter)", got, want)
	}
	host := DefaultTrainConfig()
	host.Speculate = SpeculateAuto
	if err := host.Validate(); err != nil {
		t.Fatal(err)
	}
	if got := host.speculateBytes(); got != 0 {
		t.Errorf("on the host: %d bytes of saves", got)
	}
}

// TestIterations: the header and the last line say "1 iteration", not "1
// iterations".
func TestIterations(t *testing.T) {
	for n, want := range map[int]string{0: "0 iterations", 1: "1 iteration", 2: "2 iterations"} {
		if got := Iterations(n); got != want {
			t.Errorf("Iterations(%d) = %q, want %q", n, got, want)
		}
	}
}

// TestStreamedCopyBytes: an iteration moves each streamed block's weights
// twice but the two the slots keep from the forward, and its gradients
// once.
func TestStreamedCopyBytes(t *testing.T) {
	cfg := Config{VocabSize: 256, NCtx: 64, NLayer: 6, NHead: 2, NEmbd: 128}
	per := 2 * float64(blockStreamedElems(cfg))
	for n, want := range map[int][2]float64{0: {0, 0}, 1: {per, per}, 2: {2 * per, 2 * per}, 5: {8 * per, 5 * per}} {
		if h, d := StreamedCopyBytes(cfg, n); h != want[0] || d != want[1] {
			t.Errorf("%d blocks: %v bytes H2D, %v D2H; want %v, %v", n, h, d, want[0], want[1])
		}
	}
}
