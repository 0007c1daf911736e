package trainer

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/gpt"
	"github.com/deepstates/dos/internal/cublas"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/internal/gptcuda"
	"github.com/deepstates/dos/internal/kernels"
)

// gpuEnv opens GPU 0, a stream and the GPT kernels, or skips the test (fails
// it with DOS_REQUIRE_GPU=1) when there is no GPU or no cuBLASLt.
func gpuEnv(t testing.TB) (*cuda.Stream, *kernels.GPT) {
	t.Helper()
	need := os.Getenv("DOS_REQUIRE_GPU") == "1"
	for _, err := range []error{cuda.Available(), cublas.Available()} {
		if err != nil {
			if need {
				t.Fatalf("DOS_REQUIRE_GPU=1 but: %v", err)
			}
			t.Skipf("no GPU: %v", err)
		}
	}
	d, err := cuda.Open(0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Free() })
	k, err := kernels.LoadGPT(d)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { k.Close() })
	return s, k
}

// devTensors holds bf16 tensors on the device, one buffer each, and a
// pinned staging buffer for moving them.
type devTensors struct {
	s     *cuda.Stream
	bufs  []*cuda.Buffer
	ptrs  []uint64
	stage *cuda.HostBuffer
}

func newDevTensors(t testing.TB, s *cuda.Stream, c Config) *devTensors {
	t.Helper()
	dt := &devTensors{s: s}
	most := 0
	for _, p := range c.Tensors() {
		b, err := s.Device().Alloc(int64(2 * p.Numel()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Free() })
		dt.bufs = append(dt.bufs, b)
		dt.ptrs = append(dt.ptrs, b.Ptr())
		most = max(most, p.Numel())
	}
	h, err := s.Device().HostAlloc(int64(2 * most))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Free() })
	dt.stage = h
	return dt
}

func (dt *devTensors) host16(n int) []uint16 {
	return unsafe.Slice((*uint16)(unsafe.Pointer(&dt.stage.Bytes()[0])), n)
}

// set uploads vals (rounded to bf16) into tensor i.
func (dt *devTensors) set(t testing.TB, i int, vals []float64) {
	h := dt.host16(len(vals))
	for j, v := range vals {
		h[j] = adam.F32ToBF16(float32(v))
	}
	if err := dt.s.CopyHtoD(dt.bufs[i], 0, dt.stage, 0, int64(2*len(vals))); err != nil {
		t.Fatal(err)
	}
	if err := dt.s.Sync(); err != nil {
		t.Fatal(err)
	}
}

// get downloads tensor i (n elements) as float64.
func (dt *devTensors) get(t testing.TB, i, n int) []float64 {
	if err := dt.s.CopyDtoH(dt.stage, 0, dt.bufs[i], 0, int64(2*n)); err != nil {
		t.Fatal(err)
	}
	if err := dt.s.Sync(); err != nil {
		t.Fatal(err)
	}
	out := make([]float64, n)
	for j, x := range dt.host16(n) {
		out[j] = float64(adam.BF16ToF32(x))
	}
	return out
}

// bf16Params returns InitParams(c, seed) rounded to bf16, as float64: the
// weights both sides compute with.
func bf16Params(c Config, seed uint64) [][]float64 {
	p := InitParams(c, seed)
	out := make([][]float64, len(p))
	for i, ts := range p {
		out[i] = make([]float64, len(ts))
		for j, x := range ts {
			out[i][j] = float64(adam.BF16ToF32(adam.F32ToBF16(x)))
		}
	}
	return out
}

// relL2 returns ‖got − want‖ / ‖want‖ (or ‖got‖ when want is zero).
func relL2(got, want []float64) float64 {
	var d, n float64
	for i := range want {
		d += (got[i] - want[i]) * (got[i] - want[i])
		n += want[i] * want[i]
	}
	if n == 0 {
		return math.Sqrt(d)
	}
	return math.Sqrt(d / n)
}

// TestGPUMatchesCPU runs the CUDA model and the float64 CPU model from the
// same bf16 weights and batch: the loss, the logits and every gradient
// agree within bf16 tolerance; a second pass gives the same bits; wpe's
// rows beyond T get exactly zero.
func TestGPUMatchesCPU(t *testing.T) {
	s, k := gpuEnv(t)
	for _, tc := range []struct {
		c    Config
		B, T int
		attn gptcuda.Attention
		sep  bool // Options.SeparateGELU
	}{
		{Config{VocabSize: 256, NCtx: 64, NLayer: 2, NHead: 4, NEmbd: 64}, 4, 64, gptcuda.AttentionCuBLAS, false},
		{Config{VocabSize: 256, NCtx: 64, NLayer: 2, NHead: 4, NEmbd: 64}, 4, 64, gptcuda.AttentionCuBLAS, true},
		{Config{VocabSize: 200, NCtx: 48, NLayer: 3, NHead: 3, NEmbd: 96}, 3, 40, gptcuda.AttentionCuBLAS, false},
		// Head size 64: flash attention, with a last tile of 22 rows,
		// and the cuBLAS path on the same model.
		{Config{VocabSize: 320, NCtx: 160, NLayer: 2, NHead: 2, NEmbd: 128}, 2, 150, gptcuda.AttentionFlash, false},
		{Config{VocabSize: 320, NCtx: 160, NLayer: 2, NHead: 2, NEmbd: 128}, 2, 150, gptcuda.AttentionCuBLAS, false},
		{Config{VocabSize: 256, NCtx: 128, NLayer: 2, NHead: 3, NEmbd: 192}, 3, 128, gptcuda.AttentionFlash, true},
	} {
		c, B, T := tc.c, tc.B, tc.T
		params := bf16Params(c, 7)
		// Larger embeddings, so the logits are O(1) and the loss's
		// gradient is not vanishingly small.
		for j := range params[gpt.Wte] {
			params[gpt.Wte][j] = float64(adam.BF16ToF32(adam.F32ToBF16(float32(params[gpt.Wte][j] * 8))))
		}
		tokens := randomTokens(B*T, c.VocabSize, 3)
		targets := randomTokens(B*T, c.VocabSize, 4)

		cpu := NewModel[float64](c, B, T)
		wantLoss := cpu.Forward(params, tokens, targets)
		wantLogits := append([]float64(nil), cpu.Logits()...)
		wantGrads := make([][]float64, len(params))
		for i, p := range params {
			wantGrads[i] = make([]float64, len(p))
		}
		cpu.Backward(params, wantGrads, 1)

		w, g := newDevTensors(t, s, c), newDevTensors(t, s, c)
		for i, p := range params {
			w.set(t, i, p)
		}
		m, err := gptcuda.New(s, k, c, B, T, gptcuda.Options{Attention: tc.attn, SeparateGELU: tc.sep})
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		if err := m.Forward(w.ptrs, tokens, targets, 0); err != nil {
			t.Fatal(err)
		}
		loss, err := m.Loss()
		if err != nil {
			t.Fatal(err)
		}
		logits := make([]float32, B*T*c.VocabSize)
		if err := m.Logits(logits); err != nil {
			t.Fatal(err)
		}
		worst, scale := 0.0, 0.0
		for i, x := range logits {
			worst = math.Max(worst, math.Abs(float64(x)-wantLogits[i]))
			scale = math.Max(scale, math.Abs(wantLogits[i]))
		}
		t.Logf("%+v B=%d T=%d %v attention, separate GELU %v: loss GPU %.6f CPU %.6f; logits max |diff| %.4f of max |logit| %.3f", c, B, T, m.Attention(), tc.sep, loss, wantLoss, worst, scale)
		if d := math.Abs(loss - wantLoss); d > 0.01*wantLoss {
			t.Errorf("loss GPU %v, CPU %v: differ by %.3g > 1%%", loss, wantLoss, d)
		}
		if worst > 0.03*scale {
			t.Errorf("logits differ by up to %.4g > 3%% of max |logit| %.4g", worst, scale)
		}

		grads := func() [][]float64 {
			if err := m.Forward(w.ptrs, tokens, targets, 1); err != nil {
				t.Fatal(err)
			}
			if err := m.Backward(w.ptrs, g.ptrs); err != nil {
				t.Fatal(err)
			}
			if err := s.Sync(); err != nil {
				t.Fatal(err)
			}
			out := make([][]float64, len(params))
			for i, p := range params {
				out[i] = g.get(t, i, len(p))
			}
			return out
		}
		got := grads()
		worstRel, worstName := 0.0, ""
		for i, p := range c.Tensors() {
			r := relL2(got[i], wantGrads[i])
			if r > worstRel {
				worstRel, worstName = r, p.Name
			}
			if r > 0.05 {
				t.Errorf("%s: gradient relative L2 error %.4f > 0.05", p.Name, r)
			}
		}
		t.Logf("gradients: worst relative L2 error %.4f (%s)", worstRel, worstName)
		for j := T * c.NEmbd; j < len(got[gpt.Wpe]); j++ {
			if got[gpt.Wpe][j] != 0 {
				t.Fatalf("wpe.weight grad[%d] = %v, want 0 (row >= T)", j, got[gpt.Wpe][j])
			}
		}
		again := grads()
		for i := range got {
			for j := range got[i] {
				if math.Float64bits(got[i][j]) != math.Float64bits(again[i][j]) {
					t.Fatalf("%s[%d]: second pass %v, first %v: not deterministic", c.Tensors()[i].Name, j, again[i][j], got[i][j])
				}
			}
		}
	}
}

// BenchmarkGPUForwardBackward times forward and backward of the CUDA model
// (no optimizer step) at GPT-2 sizes, T = 1024: tokens/s and the MFU of
// those two passes (bf16 dense peak 989 TFLOP/s, llm.c's FLOP count).
// DOS_BENCH_MODELS picks presets and batches, e.g. "gpt2:16,gpt2-xl:8".
func BenchmarkGPUForwardBackward(b *testing.B) {
	spec := os.Getenv("DOS_BENCH_MODELS")
	if spec == "" {
		spec = "gpt2:16"
	}
	for _, item := range splitList(spec) {
		name, batch := item[0], item[1]
		b.Run(name, func(b *testing.B) { benchGPU(b, name, batch) })
	}
}

// splitList parses "name:batch,name:batch".
func splitList(spec string) [][2]string {
	var out [][2]string
	for _, it := range strings.Split(spec, ",") {
		name, batch, _ := strings.Cut(strings.TrimSpace(it), ":")
		out = append(out, [2]string{name, batch})
	}
	return out
}

func benchGPU(b *testing.B, name, batch string) {
	s, k := gpuEnv(b)
	c, err := gpt.Preset(name)
	if err != nil {
		b.Fatal(err)
	}
	B, err := strconv.Atoi(batch)
	if err != nil {
		b.Fatal(err)
	}
	T := c.NCtx
	w, g := newDevTensors(b, s, c), newDevTensors(b, s, c)
	rng := rand.New(rand.NewPCG(1, 2))
	for i, p := range c.Tensors() {
		vals := make([]float64, p.Numel())
		for j := range vals {
			vals[j] = 0.02 * rng.NormFloat64()
		}
		if len(p.Shape) == 1 && strings.Contains(p.Name, "ln_") && strings.HasSuffix(p.Name, ".weight") {
			for j := range vals {
				vals[j] = 1
			}
		}
		w.set(b, i, vals)
	}
	var opts gptcuda.Options
	switch os.Getenv("DOS_BENCH_ATTN") {
	case "cublas":
		opts.Attention = gptcuda.AttentionCuBLAS
	case "flash":
		opts.Attention = gptcuda.AttentionFlash
	}
	opts.SeparateGELU = os.Getenv("DOS_BENCH_GELU") == "separate"
	opts.Recompute = os.Getenv("DOS_BENCH_RECOMPUTE") == "1"
	free0, _, err := s.Device().MemInfo()
	if err != nil {
		b.Fatal(err)
	}
	m, err := gptcuda.New(s, k, c, B, T, opts)
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()
	tokens := randomTokens(B*T, gpt.GPT2VocabSize, 5)
	targets := randomTokens(B*T, gpt.GPT2VocabSize, 6)
	step := func() {
		if err := m.Forward(w.ptrs, tokens, targets, 1); err != nil {
			b.Fatal(err)
		}
		if err := m.Backward(w.ptrs, g.ptrs); err != nil {
			b.Fatal(err)
		}
		if _, err := m.Loss(); err != nil {
			b.Fatal(err)
		}
	}
	step() // warm-up: cuBLASLt's heuristics, the first launches
	free1, _, err := s.Device().MemInfo()
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	start := time.Now()
	for range b.N {
		step()
	}
	sec := time.Since(start).Seconds() / float64(b.N)
	tok := float64(B*T) / sec
	b.ReportMetric(tok, "tokens/s")
	b.ReportMetric(100*tok*c.FLOPsPerToken(T)/989e12, "MFU%")
	b.Logf("%s B=%d T=%d %v attention, separate GELU %v, recompute %v: %.1f ms per forward+backward, %.0f tokens/s, MFU %.1f%%, activations %.2f GiB counted (MemoryBytes), %.2f GiB taken on the device by New and the first step (cuMemGetInfo)",
		name, B, T, m.Attention(), opts.SeparateGELU, opts.Recompute, 1e3*sec, tok, 100*tok*c.FLOPsPerToken(T)/989e12,
		float64(gptcuda.MemoryBytes(c, B, T, opts))/(1<<30), float64(free0-free1)/(1<<30))
}

// TestGPUTrainResumeBitwise trains on the GPU (--device cuda) for 6
// iterations straight, and for 3 then resumed to 6, with the update phase
// split between the CPU and the GPU: the master weights and the optimizer
// state end bit for bit equal; and the GPU trainer's loss falls.
func TestGPUTrainResumeBitwise(t *testing.T) {
	gpuEnv(t)
	setMemAvailable(t, 0, false)
	cfg := DefaultTrainConfig()
	serialSchedule(&cfg)
	cfg.Model = Config{VocabSize: 256, NCtx: 64, NLayer: 2, NHead: 2, NEmbd: 128} // head size 64: flash attention
	cfg.Batch, cfg.Device = 4, "cuda"
	cfg.WorkingDType, cfg.GradDType = adam.BF16, adam.BF16
	cfg.SubgroupSize = 60_000 // 8 subgroups
	cfg.Schedule = "3,3,2"
	cfg.SampleBytes, cfg.EvalBatches, cfg.LogEvery, cfg.DecaySteps = 0, 1, 0, 6
	text := []byte(strings.Repeat("Light is propagated in straight lines, and refracted at the surfaces of bodies. ", 400))
	run := func(dir string, steps int, resume bool) Summary {
		c := cfg
		c.CkptDir, c.Steps, c.Resume = dir, steps, resume
		tr, err := New(c, text, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tr.Close()
		s, err := tr.Run()
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	a, b := t.TempDir(), t.TempDir()
	sa := run(a, 6, false)
	run(b, 3, false)
	sb := run(b, 6, true)
	if sa.FinalLoss != sb.FinalLoss || !(sa.FinalLoss < sa.InitialLoss) {
		t.Errorf("final loss straight %v, resumed %v (initial %v): want equal and lower", sa.FinalLoss, sb.FinalLoss, sa.InitialLoss)
	}
	load := func(dir string) map[string][]float32 {
		c := cfg
		c.CkptDir, c.Resume, c.Steps = dir, true, 6
		tr, err := New(c, text, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tr.Close()
		out := map[string][]float32{}
		for _, p := range tr.opt.Params() {
			m, err := tr.opt.MasterOf(p.Name)
			if err != nil {
				t.Fatal(err)
			}
			out[p.Name] = m
		}
		return out
	}
	ma, mb := load(a), load(b)
	for name, x := range ma {
		for i := range x {
			if math.Float32bits(x[i]) != math.Float32bits(mb[name][i]) {
				t.Fatalf("%s[%d]: straight %v, resumed %v", name, i, x[i], mb[name][i])
			}
		}
	}
	t.Logf("6 iterations on the GPU: loss %.4f -> %.4f, straight and resumed equal", sa.InitialLoss, sa.FinalLoss)
}

// TestGPURecomputeBitwise: with Options.Recompute (one block's activations
// kept, the others recomputed in backward) the loss and every gradient are
// the same bits as without, for flash and cuBLAS attention.
func TestGPURecomputeBitwise(t *testing.T) {
	s, k := gpuEnv(t)
	for _, tc := range []struct {
		c    Config
		B, T int
		attn gptcuda.Attention
	}{
		{Config{VocabSize: 320, NCtx: 160, NLayer: 3, NHead: 2, NEmbd: 128}, 2, 150, gptcuda.AttentionFlash},
		{Config{VocabSize: 256, NCtx: 64, NLayer: 3, NHead: 4, NEmbd: 64}, 4, 64, gptcuda.AttentionCuBLAS},
	} {
		c := tc.c
		params := bf16Params(c, 9)
		tokens := randomTokens(tc.B*tc.T, c.VocabSize, 5)
		targets := randomTokens(tc.B*tc.T, c.VocabSize, 6)
		w := newDevTensors(t, s, c)
		for i, p := range params {
			w.set(t, i, p)
		}
		var got [2][][]float64
		var loss [2]float64
		for r, recompute := range []bool{false, true} {
			m, err := gptcuda.New(s, k, c, tc.B, tc.T, gptcuda.Options{Attention: tc.attn, Recompute: recompute})
			if err != nil {
				t.Fatal(err)
			}
			g := newDevTensors(t, s, c)
			if err := m.Forward(w.ptrs, tokens, targets, 1); err != nil {
				t.Fatal(err)
			}
			if err := m.Backward(w.ptrs, g.ptrs); err != nil {
				t.Fatal(err)
			}
			if loss[r], err = m.Loss(); err != nil {
				t.Fatal(err)
			}
			for i, p := range params {
				got[r] = append(got[r], g.get(t, i, len(p)))
			}
			if err := m.Close(); err != nil {
				t.Fatal(err)
			}
		}
		if loss[0] != loss[1] {
			t.Errorf("%v: loss %v, recomputing %v", tc.attn, loss[0], loss[1])
		}
		for i := range got[0] {
			for j := range got[0][i] {
				if math.Float64bits(got[0][i][j]) != math.Float64bits(got[1][i][j]) {
					t.Fatalf("%v: %s[%d]: %v, recomputing %v", tc.attn, c.Tensors()[i].Name, j, got[0][i][j], got[1][i][j])
				}
			}
		}
		t.Logf("%v attention, %d blocks: recomputing gives the same loss (%.6f) and gradients, bit for bit", tc.attn, c.NLayer, loss[0])
	}
}

// TestGPUMasters: with SetMasters the embedding lookup and the LayerNorms
// read fp32 master weights. Masters holding the bf16 tensors' own values
// give the same bits as without them (loss and every gradient); masters
// moved by less than half a bf16 step (so the bf16 tensors do not change)
// move the loss, to within 1% (TestGPUMatchesCPU's bound) of the float64 CPU model run with those
// fp32 values (whose logits read the moved wte, the GPU's the bf16 one);
// a pair given half is refused.
func TestGPUMasters(t *testing.T) {
	s, k := gpuEnv(t)
	c := Config{VocabSize: 320, NCtx: 160, NLayer: 2, NHead: 2, NEmbd: 128}
	B, T := 2, 150
	params := bf16Params(c, 11)
	tokens := randomTokens(B*T, c.VocabSize, 5)
	targets := randomTokens(B*T, c.VocabSize, 6)
	w, g := newDevTensors(t, s, c), newDevTensors(t, s, c)
	for i, p := range params {
		w.set(t, i, p)
	}
	m, err := gptcuda.New(s, k, c, B, T, gptcuda.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	run := func() (float64, [][]float64) {
		t.Helper()
		if err := m.Forward(w.ptrs, tokens, targets, 1); err != nil {
			t.Fatal(err)
		}
		if err := m.Backward(w.ptrs, g.ptrs); err != nil {
			t.Fatal(err)
		}
		loss, err := m.Loss()
		if err != nil {
			t.Fatal(err)
		}
		out := make([][]float64, len(params))
		for i, p := range params {
			out[i] = g.get(t, i, len(p))
		}
		return loss, out
	}
	loss0, grads0 := run()

	// fp32 masters of the fp32-read tensors.
	fp32 := gptcuda.FP32Tensors(c)
	masters := make([]uint64, len(params))
	bufs := map[int]*cuda.Buffer{}
	for _, i := range fp32 {
		b, err := s.Device().Alloc(int64(4 * len(params[i])))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Free() })
		bufs[i], masters[i] = b, b.Ptr()
	}
	setMasters := func(vals [][]float64) {
		t.Helper()
		for _, i := range fp32 {
			h, err := s.Device().HostAlloc(int64(4 * len(vals[i])))
			if err != nil {
				t.Fatal(err)
			}
			f := unsafe.Slice((*float32)(unsafe.Pointer(&h.Bytes()[0])), len(vals[i]))
			for j, v := range vals[i] {
				f[j] = float32(v)
			}
			if err := s.CopyHtoD(bufs[i], 0, h, 0, int64(4*len(f))); err != nil {
				t.Fatal(err)
			}
			if err := s.Sync(); err != nil {
				t.Fatal(err)
			}
			h.Free()
		}
	}
	setMasters(params)
	if err := m.SetMasters(masters); err != nil {
		t.Fatal(err)
	}
	loss1, grads1 := run()
	if loss1 != loss0 {
		t.Errorf("masters equal to the bf16 values: loss %v, without masters %v", loss1, loss0)
	}
	for i := range grads0 {
		for j := range grads0[i] {
			if grads1[i][j] != grads0[i][j] {
				t.Fatalf("masters equal to the bf16 values: gradient %s[%d] %v, without masters %v", c.Tensors()[i].Name, j, grads1[i][j], grads0[i][j])
			}
		}
	}

	// Move the fp32 values by a third of a bf16 step: the bf16 tensors
	// stay, the model's result moves.
	moved := make([][]float64, len(params))
	for i := range params {
		moved[i] = slices.Clone(params[i])
	}
	for _, i := range fp32 {
		for j, v := range moved[i] {
			step := math.Max(math.Abs(v), 1e-3) / 256 // a bf16 step at v is 2^-7 of its binade: at least |v|/256
			moved[i][j] = v + step/3*float64(1-2*(j%2))
		}
	}
	setMasters(moved)
	loss2, _ := run()
	cpu := NewModel[float64](c, B, T)
	want := cpu.Forward(moved, tokens, targets)
	t.Logf("loss: bf16 %.6f, fp32 masters %.6f, CPU float64 with the fp32 values %.6f", loss0, loss2, want)
	if loss2 == loss0 {
		t.Error("moving the fp32 masters did not change the loss: the model does not read them")
	}
	if d := math.Abs(loss2 - want); d > 0.01*want {
		t.Errorf("loss with fp32 masters %v, CPU %v: differ by %.3g > 1%%", loss2, want, d)
	}

	half := slices.Clone(masters)
	half[gpt.Wpe] = 0
	if err := m.SetMasters(half); err == nil || !strings.Contains(err.Error(), "both or neither") {
		t.Errorf("SetMasters with wte but not wpe: %v", err)
	}
	bad := make([]uint64, len(params))
	bad[gpt.LayerBase(0)+gpt.AttnW] = masters[gpt.Wte]
	if err := m.SetMasters(bad); err == nil || !strings.Contains(err.Error(), "bf16 only") {
		t.Errorf("SetMasters of c_attn's weight: %v", err)
	}
}

// TestGPUMemoryCap: --gpu-memory caps what dos allocates on the GPU: a cap
// below the model's activations fails the run's construction as out of
// memory, naming the cap; a cap that holds it trains, with dos's device
// memory within the cap at the end and the update phase's default budget
// what the cap leaves.
func TestGPUMemoryCap(t *testing.T) {
	gpuEnv(t)
	setMemAvailable(t, 0, false)
	t.Cleanup(func() { _ = cuda.SetMemoryLimit(0, 0) })
	cfg := DefaultTrainConfig()
	serialSchedule(&cfg)
	cfg.Model = Config{VocabSize: 256, NCtx: 64, NLayer: 2, NHead: 2, NEmbd: 128}
	cfg.Batch, cfg.Device, cfg.Steps = 4, "cuda", 3
	cfg.WorkingDType, cfg.GradDType = adam.BF16, adam.BF16
	cfg.SampleBytes, cfg.EvalBatches, cfg.LogEvery = 0, 1, 0
	cfg.Schedule = "1,0,0"
	text := []byte(strings.Repeat("Light is propagated in straight lines. ", 400))
	small := cfg
	small.GPUMemory = 1.0 / 1024 // 1 MiB: not even the activations
	// Refused by Validate before anything is allocated (DeviceMemory:
	// TestValidateDeviceMemory), not out of memory inside New (the cap's
	// own refusal is internal/cuda's TestMemoryLimit).
	if tr, err := New(small, text, nil); err == nil || cuda.IsOutOfMemory(err) || !strings.Contains(err.Error(), "of device memory before the update phase's") {
		if tr != nil {
			tr.Close()
		}
		t.Fatalf("a 1 MiB cap: %v, want Validate's refusal", err)
	}
	cfg.GPUMemory = 1
	tr, err := New(cfg, text, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	if _, err := tr.Run(); err != nil {
		t.Fatal(err)
	}
	if used, limit := cuda.MemoryUsed(0), cuda.MemoryLimit(0); limit != 1<<30 || used <= 0 || used > limit {
		t.Fatalf("dos's device memory %d of the cap %d", used, limit)
	}
}

// serialSchedule turns off the defaults that reorder the update phase
// around the iteration (ResidentFirst, Speculate: DefaultTrainConfig's
// since issue 31), so that a GPU test's reference is the schedule its
// assertions were written for; a test of those options turns them on.
func serialSchedule(c *TrainConfig) { c.ResidentFirst, c.Speculate = false, 0 }

// smallGPURun skips without a GPU and returns the GPU tests' small run of
// steps iterations (4 blocks of width 128, context 64, batch 4, bf16
// working copy and gradients, subgroups of 60,000: 14 of them, no
// sample, one evaluation batch, quiet) and its text.
func smallGPURun(t *testing.T, steps int) (TrainConfig, []byte) {
	t.Helper()
	gpuEnv(t)
	setMemAvailable(t, 0, false)
	cfg := DefaultTrainConfig()
	serialSchedule(&cfg)
	cfg.Model = Config{VocabSize: 256, NCtx: 64, NLayer: 4, NHead: 2, NEmbd: 128}
	cfg.Batch, cfg.Device, cfg.Steps = 4, "cuda", steps
	cfg.WorkingDType, cfg.GradDType = adam.BF16, adam.BF16
	cfg.SubgroupSize = 60_000
	cfg.SampleBytes, cfg.EvalBatches, cfg.LogEvery = 0, 1, 0
	return cfg, []byte(strings.Repeat("Light is propagated in straight lines, and refracted at the surfaces of bodies. ", 400))
}

// TestGPUIterationModel: a run on the GPU with the start-up calibration
// (no --schedule, no --profile) reports its iteration's prediction and
// lower bound (the forward and backward measured alone: the overlap runs
// the second iteration's forward alone), with the next forward overlapped
// and without; a bound is under the measured iteration, and the
// prediction is finite and positive.
func TestGPUIterationModel(t *testing.T) {
	cfg, text := smallGPURun(t, 5)
	for _, noFwd := range []bool{false, true} {
		c := cfg
		c.NoOverlapForward = noFwd
		var log strings.Builder
		tr, err := New(c, text, &log)
		if err != nil {
			t.Fatal(err)
		}
		sum, err := tr.Run()
		tr.Close()
		if err != nil {
			t.Fatal(err)
		}
		if !(sum.IterationS > 0) || !(sum.IterationPredictedS > 0) || math.IsInf(sum.IterationPredictedS, 0) ||
			!(sum.IterationBoundS > 0) || sum.IterationBoundS > sum.IterationS {
			t.Errorf("--no-overlap-forward %v: iteration %v s measured, %v predicted, bound %v: want a positive prediction and a bound under the measured\n%s",
				noFwd, sum.IterationS, sum.IterationPredictedS, sum.IterationBoundS, log.String())
		}
		if !strings.Contains(log.String(), "ms predicted (") {
			t.Errorf("--no-overlap-forward %v: no iteration prediction in the log:\n%s", noFwd, log.String())
		}
		t.Logf("--no-overlap-forward %v: iteration %.2f ms measured, %.2f ms predicted, bound %.2f ms", noFwd, 1e3*sum.IterationS, 1e3*sum.IterationPredictedS, 1e3*sum.IterationBoundS)
	}
}

// TestGPUOverlapBitwise trains on the GPU for 6 iterations with the update
// phase split between the CPU, streamed and resident subgroups, with the
// overlap with backward (the default) and without (--no-overlap): the
// losses and the master weights end bit for bit equal, and with the
// overlap the last phase's trace holds the CPU subgroups' gradient D2H and
// the first streamed subgroups' state H2D before the phase (during the
// backward).
func TestGPUOverlapBitwise(t *testing.T) {
	cfg, text := smallGPURun(t, 6)
	cfg.Schedule = "6,5,3"
	cfg.DecaySteps = 6
	var sums [2]Summary
	var masters [2]map[string][]float32
	for r, noOverlap := range []bool{false, true} {
		c := cfg
		c.NoOverlap = noOverlap
		tr, err := New(c, text, nil)
		if err != nil {
			t.Fatal(err)
		}
		if sums[r], err = tr.Run(); err != nil {
			t.Fatal(err)
		}
		masters[r] = map[string][]float32{}
		for _, p := range tr.opt.Params() {
			if masters[r][p.Name], err = tr.opt.MasterOf(p.Name); err != nil {
				t.Fatal(err)
			}
		}
		_, ops, err := tr.opt.Trace()
		if err != nil {
			t.Fatal(err)
		}
		before := map[string]int{}
		for _, o := range ops {
			if o.Start < 0 {
				before[o.What]++
			}
		}
		want := map[string]int{"grad D2H": 6, "state H2D": 2}
		if noOverlap {
			want = map[string]int{}
		}
		if fmt.Sprint(before) != fmt.Sprint(want) {
			t.Errorf("overlap %v: operations before the phase %v, want %v", !noOverlap, before, want)
		}
		if err := tr.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if sums[0].FinalLoss != sums[1].FinalLoss || sums[0].ValLoss != sums[1].ValLoss || !(sums[0].FinalLoss < sums[0].InitialLoss) {
		t.Errorf("final loss with the overlap %v, without %v (initial %v): want equal and lower", sums[0].FinalLoss, sums[1].FinalLoss, sums[0].InitialLoss)
	}
	for name, x := range masters[0] {
		for i := range x {
			if math.Float32bits(x[i]) != math.Float32bits(masters[1][name][i]) {
				t.Fatalf("%s[%d]: with the overlap %v, without %v", name, i, x[i], masters[1][name][i])
			}
		}
	}
	t.Logf("6 iterations on the GPU, schedule %s: loss %.4f -> %.4f with and without the overlap", cfg.Schedule, sums[0].InitialLoss, sums[0].FinalLoss)
}

// TestGPUOnBlockBackward: Backward calls OnBlockBackward's function once
// per block, from the last to the first, and at each call (the stream's
// work so far done) the gradients of that block, every later one and ln_f
// already hold their final values, bit for bit; its error stops Backward.
func TestGPUOnBlockBackward(t *testing.T) {
	s, k := gpuEnv(t)
	c := Config{VocabSize: 256, NCtx: 64, NLayer: 3, NHead: 2, NEmbd: 128}
	B, T := 2, 64
	params := bf16Params(c, 4)
	tokens, targets := randomTokens(B*T, c.VocabSize, 7), randomTokens(B*T, c.VocabSize, 8)
	w := newDevTensors(t, s, c)
	for i, p := range params {
		w.set(t, i, p)
	}
	g := newDevTensors(t, s, c)
	m, err := gptcuda.New(s, k, c, B, T, gptcuda.Options{Recompute: true})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	final := func(i int, l int) bool { // tensor i is final after block l's backward
		name := c.Tensors()[i].Name
		var b int
		if _, err := fmt.Sscanf(name, "h.%d.", &b); err == nil {
			return b >= l
		}
		return strings.HasPrefix(name, "ln_f.")
	}
	var order []int
	seen := map[int][][]float64{} // block -> the final tensors' values then
	m.OnBlockBackward(func(l int) error {
		order = append(order, l)
		for i, p := range params {
			if final(i, l) {
				seen[l] = append(seen[l], g.get(t, i, len(p)))
			}
		}
		return nil
	})
	if err := errors.Join(m.Forward(w.ptrs, tokens, targets, 1), m.Backward(w.ptrs, g.ptrs)); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(order) != "[2 1 0]" {
		t.Fatalf("blocks called %v, want [2 1 0]", order)
	}
	for l, vals := range seen {
		j := 0
		for i, p := range params {
			if !final(i, l) {
				continue
			}
			end := g.get(t, i, len(p))
			for e := range end {
				if math.Float64bits(end[e]) != math.Float64bits(vals[j][e]) {
					t.Fatalf("after block %d: %s[%d] was %v, final %v", l, c.Tensors()[i].Name, e, vals[j][e], end[e])
				}
			}
			j++
		}
	}
	stop := errors.New("stop")
	m.OnBlockBackward(func(l int) error { return stop })
	if err := m.Forward(w.ptrs, tokens, targets, 1); err != nil {
		t.Fatal(err)
	}
	if err := m.Backward(w.ptrs, g.ptrs); !errors.Is(err, stop) {
		t.Fatalf("a hook's error: Backward returned %v", err)
	}
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
}

// TestGPUBeforeBlock: with BeforeBlock copying each block's matrices and
// biases (all but its LayerNorms) into one of two slots just before the
// block's forward and backward, and OnBlockBackward copying the block's
// gradients out of one of two gradient slots (which the hook fills with
// NaNs first), the loss and every gradient are the bits of the model with
// every tensor in place, with and without recomputation: what ZeRO-3's
// per-block all-gather relies on. The hook is called for blocks 0..3
// forward, then 3..0 backward.
func TestGPUBeforeBlock(t *testing.T) {
	s, k := gpuEnv(t)
	c := Config{VocabSize: 256, NCtx: 64, NLayer: 4, NHead: 2, NEmbd: 128}
	B, T := 2, 64
	params := bf16Params(c, 11)
	tokens, targets := randomTokens(B*T, c.VocabSize, 3), randomTokens(B*T, c.VocabSize, 4)
	w := newDevTensors(t, s, c)
	for i, p := range params {
		w.set(t, i, p)
	}
	streamed := []int{gpt.AttnW, gpt.AttnB, gpt.AttnProjW, gpt.AttnProjB, gpt.FcW, gpt.FcB, gpt.FcProjW, gpt.FcProjB}
	ts := c.Tensors()
	var wslot, gslot [2][]*cuda.Buffer
	for sl := range 2 {
		for _, off := range streamed {
			for _, set := range []*[]*cuda.Buffer{&wslot[sl], &gslot[sl]} {
				b, err := s.Device().Alloc(int64(2 * ts[gpt.LayerBase(0)+off].Numel()))
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { b.Free() })
				*set = append(*set, b)
			}
		}
	}
	for _, recompute := range []bool{false, true} {
		run := func(hooks bool) (float64, [][]float64, string) {
			m, err := gptcuda.New(s, k, c, B, T, gptcuda.Options{Recompute: recompute})
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			g := newDevTensors(t, s, c)
			wp, gp := slices.Clone(w.ptrs), slices.Clone(g.ptrs)
			var calls []string
			if hooks {
				for l := range c.NLayer {
					for j, off := range streamed {
						i := gpt.LayerBase(l) + off
						wp[i], gp[i] = wslot[l%2][j].Ptr(), gslot[l%2][j].Ptr()
					}
				}
				m.BeforeBlock(func(l int, backward bool) error {
					calls = append(calls, fmt.Sprintf("%d%v", l, map[bool]string{false: "f", true: "b"}[backward]))
					for j, off := range streamed {
						src := w.bufs[gpt.LayerBase(l)+off]
						if err := s.CopyDtoD(wslot[l%2][j], 0, src, 0, src.Len()); err != nil {
							return err
						}
						if backward {
							if err := s.Memset(gslot[l%2][j], 0, gslot[l%2][j].Len(), 0xff); err != nil {
								return err
							}
						}
					}
					return nil
				})
				m.OnBlockBackward(func(l int) error {
					for j, off := range streamed {
						dst := g.bufs[gpt.LayerBase(l)+off]
						if err := s.CopyDtoD(dst, 0, gslot[l%2][j], 0, dst.Len()); err != nil {
							return err
						}
					}
					return nil
				})
			}
			if err := errors.Join(m.Forward(wp, tokens, targets, 1), m.Backward(wp, gp)); err != nil {
				t.Fatal(err)
			}
			loss, err := m.Loss()
			if err != nil {
				t.Fatal(err)
			}
			var grads [][]float64
			for i, p := range params {
				grads = append(grads, g.get(t, i, len(p)))
			}
			return loss, grads, strings.Join(calls, " ")
		}
		l0, g0, _ := run(false)
		l1, g1, calls := run(true)
		if want := "0f 1f 2f 3f 3b 2b 1b 0b"; calls != want {
			t.Errorf("recompute %v: BeforeBlock called %s, want %s", recompute, calls, want)
		}
		if l0 != l1 {
			t.Errorf("recompute %v: loss %v, through the slots %v", recompute, l0, l1)
		}
		for i := range g0 {
			for j := range g0[i] {
				if math.Float64bits(g0[i][j]) != math.Float64bits(g1[i][j]) {
					t.Fatalf("recompute %v: %s[%d] %v, through the slots %v", recompute, ts[i].Name, j, g0[i][j], g1[i][j])
				}
			}
		}
		t.Logf("recompute %v: 4 blocks through 2 slots: the same loss (%.6f) and gradients, bit for bit", recompute, l0)
	}
}
