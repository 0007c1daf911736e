package trainer

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/deepstates/dos/gpt"
)

// tiny is the gradient-check configuration: T = 4 < NCtx = 5 leaves wpe row 4
// unused.
var tiny = Config{VocabSize: 11, NCtx: 5, NLayer: 2, NHead: 2, NEmbd: 8}

// randomParams returns params for c with every tensor random and well away
// from GPT-2's near-zero init, so that every path carries gradient: weights
// ~ N(0, std), LayerNorm weights ~ 1 + N(0, 0.1), biases ~ N(0, 0.1).
func randomParams(c Config, seed uint64, std float64) [][]float64 {
	r := rand.New(rand.NewPCG(seed, 99))
	var out [][]float64
	for _, p := range c.Tensors() {
		x := make([]float64, p.Numel())
		for i := range x {
			switch {
			case strings.Contains(p.Name, "ln_") && strings.HasSuffix(p.Name, ".weight"):
				x[i] = 1 + 0.1*r.NormFloat64()
			case strings.HasSuffix(p.Name, ".bias"):
				x[i] = 0.1 * r.NormFloat64()
			default:
				x[i] = std * r.NormFloat64()
			}
		}
		out = append(out, x)
	}
	return out
}

func randomTokens(n, V int, seed uint64) []int32 {
	r := rand.New(rand.NewPCG(seed, 7))
	t := make([]int32, n)
	for i := range t {
		t[i] = int32(r.IntN(V))
	}
	return t
}

func toF64(ps [][]float32) [][]float64 {
	out := make([][]float64, len(ps))
	for i, p := range ps {
		out[i] = make([]float64, len(p))
		for j, v := range p {
			out[i][j] = float64(v)
		}
	}
	return out
}

func toF32(ps [][]float64) [][]float32 {
	out := make([][]float32, len(ps))
	for i, p := range ps {
		out[i] = make([]float32, len(p))
		for j, v := range p {
			out[i][j] = float32(v)
		}
	}
	return out
}

func zerosLike[F float32 | float64](ps [][]F) [][]F {
	out := make([][]F, len(ps))
	for i, p := range ps {
		out[i] = make([]F, len(p))
	}
	return out
}

// referenceLogits is GPT2LMHeadModel's forward written as plainly as
// possible from modeling_gpt2.py, in float64 with no BLAS, no goroutines and
// no shared code with Model: it checks the architecture (q/k/v split, heads,
// causal mask, GELU, tied head) that a gradient check cannot.
func referenceLogits(c Config, params [][]float64, tokens []int32, B, T int) []float64 {
	C, V, NH := c.NEmbd, c.VocabSize, c.NHead
	hs := C / NH
	layerNorm := func(x, w, b []float64) []float64 {
		mean, variance := 0.0, 0.0
		for _, v := range x {
			mean += v
		}
		mean /= float64(C)
		for _, v := range x {
			variance += (v - mean) * (v - mean)
		}
		variance /= float64(C)
		y := make([]float64, C)
		for i, v := range x {
			y[i] = (v-mean)/math.Sqrt(variance+1e-5)*w[i] + b[i]
		}
		return y
	}
	conv1D := func(x, w, b []float64, out int) []float64 { // x @ w + b, w [len(x), out]
		y := make([]float64, out)
		for j := range y {
			s := b[j]
			for i, v := range x {
				s += v * w[i*out+j]
			}
			y[j] = s
		}
		return y
	}
	var logits []float64
	for b := 0; b < B; b++ {
		x := make([][]float64, T)
		for t := range x {
			x[t] = make([]float64, C)
			for i := range x[t] {
				x[t][i] = params[0][int(tokens[b*T+t])*C+i] + params[1][t*C+i]
			}
		}
		for l := 0; l < c.NLayer; l++ {
			p := params[2+12*l:]
			qkv := make([][]float64, T)
			for t := range x {
				qkv[t] = conv1D(layerNorm(x[t], p[0], p[1]), p[2], p[3], 3*C)
			}
			y := make([][]float64, T)
			for t := range y {
				y[t] = make([]float64, C)
			}
			for h := 0; h < NH; h++ {
				for t := 0; t < T; t++ {
					w := make([]float64, T)
					for t2 := range w {
						if t2 > t {
							w[t2] = math.Inf(-1)
							continue
						}
						for i := 0; i < hs; i++ {
							w[t2] += qkv[t][h*hs+i] * qkv[t2][C+h*hs+i]
						}
						w[t2] /= math.Sqrt(float64(hs))
					}
					mx, sum := math.Inf(-1), 0.0
					for _, v := range w {
						mx = math.Max(mx, v)
					}
					for t2, v := range w {
						w[t2] = math.Exp(v - mx)
						sum += w[t2]
					}
					for t2 := range w {
						for i := 0; i < hs; i++ {
							y[t][h*hs+i] += w[t2] / sum * qkv[t2][2*C+h*hs+i]
						}
					}
				}
			}
			for t := range x {
				a := conv1D(y[t], p[4], p[5], C)
				for i := range x[t] {
					x[t][i] += a[i]
				}
				f := conv1D(layerNorm(x[t], p[6], p[7]), p[8], p[9], 4*C)
				for i, v := range f {
					f[i] = 0.5 * v * (1 + math.Tanh(math.Sqrt(2/math.Pi)*(v+0.044715*math.Pow(v, 3))))
				}
				o := conv1D(f, p[10], p[11], C)
				for i := range x[t] {
					x[t][i] += o[i]
				}
			}
		}
		for t := range x {
			h := layerNorm(x[t], params[len(params)-2], params[len(params)-1])
			for v := 0; v < V; v++ {
				s := 0.0
				for i := range h {
					s += h[i] * params[0][v*C+i]
				}
				logits = append(logits, s)
			}
		}
	}
	return logits
}

func TestForwardMatchesReference(t *testing.T) {
	for _, tc := range []struct {
		c    Config
		B, T int
	}{
		{Config{VocabSize: 13, NCtx: 7, NLayer: 2, NHead: 3, NEmbd: 12}, 2, 6},
		// T = 37: attention's row blocks 16, 16, 5; V = 70 > tileN.
		{Config{VocabSize: 70, NCtx: 40, NLayer: 1, NHead: 2, NEmbd: 8}, 1, 37},
	} {
		t.Run(fmt.Sprintf("V=%d,T=%d", tc.c.VocabSize, tc.T), func(t *testing.T) {
			c, B, T := tc.c, tc.B, tc.T
			params := randomParams(c, 1, 0.3)
			tokens := randomTokens(B*T, c.VocabSize, 2)
			m := NewModel[float64](c, B, T)
			if loss := m.Forward(params, tokens, nil); loss != 0 {
				t.Errorf("Forward without targets = %v, want 0", loss)
			}
			want := referenceLogits(c, params, tokens, B, T)
			got := m.Logits()
			if len(got) != len(want) {
				t.Fatalf("len(Logits) = %d, want %d", len(got), len(want))
			}
			for i := range got {
				if d := math.Abs(got[i] - want[i]); d > 1e-12*(1+math.Abs(want[i])) {
					t.Fatalf("logit %d = %v, reference %v", i, got[i], want[i])
				}
			}
			// The loss is the mean of lse - logit[target] over positions.
			targets := randomTokens(B*T, c.VocabSize, 3)
			loss := m.Forward(params, tokens, targets)
			var wantLoss float64
			for r := 0; r < B*T; r++ {
				row := want[r*c.VocabSize : (r+1)*c.VocabSize]
				s := 0.0
				for _, v := range row {
					s += math.Exp(v)
				}
				wantLoss += math.Log(s) - row[targets[r]]
			}
			wantLoss /= float64(B * T)
			if math.Abs(loss-wantLoss) > 1e-12 {
				t.Errorf("loss = %v, reference %v", loss, wantLoss)
			}
		})
	}
}

// TestGradientCheck compares Backward with central differences of Forward's
// loss for every element of every tensor, in float64.
//
// The difference is the five-point stencil (-L(x+2h) + 8L(x+h) - 8L(x-h) +
// L(x-2h)) / 12h with h = 1e-4: its truncation error h⁴/30·|d⁵L/dx⁵| and its
// rounding error about 1.5·eps·|L|/h (L ≈ 2.5) are both near 1e-11. (The
// three-point quotient's h²/6·|d³L/dx³| reached 4e-9 at h = 1e-5 for a wpe
// element of the 4-wide config, whose LayerNorms curve sharply.) An element
// passes when |numeric - analytic| <= 1e-6·|analytic| + 1e-9: relative error
// under 1e-6 for every gradient above 1e-3, and an absolute floor well above
// the stencil's noise for the small ones.
func TestGradientCheck(t *testing.T) {
	for _, tc := range []struct {
		c    Config
		B, T int
	}{
		{tiny, 2, 4},
		// T = 19: attention's row blocks 16 and 3; wpe rows 19, 20 unused.
		{Config{VocabSize: 5, NCtx: 21, NLayer: 1, NHead: 2, NEmbd: 4}, 2, 19},
	} {
		t.Run(fmt.Sprintf("L=%d,T=%d", tc.c.NLayer, tc.T), func(t *testing.T) { gradientCheck(t, tc.c, tc.B, tc.T) })
	}
}

func gradientCheck(t *testing.T, c Config, B, T int) {
	params := randomParams(c, 3, 0.4)
	tokens := randomTokens(B*T, c.VocabSize, 4)
	targets := randomTokens(B*T, c.VocabSize, 5)
	m := NewModel[float64](c, B, T)
	grads := zerosLike(params)
	m.Forward(params, tokens, targets)
	m.Backward(params, grads, 1)

	const h = 1e-4
	names := c.Tensors()
	worstRel, worstAbs := 0.0, 0.0
	for pi, p := range params {
		for i := range p {
			orig := p[i]
			loss := func(x float64) float64 {
				p[i] = x
				return m.Forward(params, tokens, targets)
			}
			num := (-loss(orig+2*h) + 8*loss(orig+h) - 8*loss(orig-h) + loss(orig-2*h)) / (12 * h)
			p[i] = orig
			ana := grads[pi][i]
			d := math.Abs(num - ana)
			if d > 1e-7*math.Abs(ana)+1e-10 {
				t.Errorf("%s[%d]: analytic %.12g, numeric %.12g", names[pi].Name, i, ana, num)
			}
			worstAbs = math.Max(worstAbs, d)
			if math.Abs(ana) > 1e-3 {
				worstRel = math.Max(worstRel, d/math.Abs(ana))
			}
		}
	}
	t.Logf("worst |numeric - analytic|: %.2g; worst relative error over gradients > 1e-3: %.2g", worstAbs, worstRel)

	// wpe rows T..NCtx-1 are unused: exactly zero. Every wte row feeds the
	// tied head, so none is zero.
	C := c.NEmbd
	for i, g := range grads[gpt.Wpe][T*C:] {
		if g != 0 {
			t.Errorf("wpe.weight[%d] grad = %v, want 0 (row >= T)", T*C+i, g)
		}
	}
	for v := 0; v < c.VocabSize; v++ {
		zero := true
		for _, g := range grads[gpt.Wte][v*C : (v+1)*C] {
			zero = zero && g == 0
		}
		if zero {
			t.Errorf("wte row %d has zero gradient; the tied head should reach every row", v)
		}
	}
}

func TestFloat32MatchesFloat64(t *testing.T) {
	c := Config{VocabSize: 96, NCtx: 32, NLayer: 2, NHead: 4, NEmbd: 32}
	B, T := 2, 32
	p32 := InitParams(c, 11)
	// Scale wte up so the logits are O(1), not GPT-2 init's O(0.1).
	for j := range p32[gpt.Wte] {
		p32[gpt.Wte][j] *= 5
	}
	p64 := toF64(p32)
	tokens := randomTokens(B*T, c.VocabSize, 12)
	targets := randomTokens(B*T, c.VocabSize, 13)
	m32, m64 := NewModel[float32](c, B, T), NewModel[float64](c, B, T)
	l32 := m32.Forward(p32, tokens, targets)
	l64 := m64.Forward(p64, tokens, targets)
	if rel := math.Abs(float64(l32)-l64) / l64; rel > 1e-5 {
		t.Errorf("float32 loss %v, float64 loss %v: relative difference %.2g > 1e-5", l32, l64, rel)
	}
	worst := 0.0
	for i, x := range m32.Logits() {
		worst = math.Max(worst, math.Abs(float64(x)-m64.Logits()[i]))
	}
	if worst > 1e-5 {
		t.Errorf("float32 and float64 logits differ by up to %.2g > 1e-5", worst)
	}
	t.Logf("float32 loss %.9g, float64 loss %.9g, logits differ by up to %.2g", l32, l64, worst)
}

func TestDeterministicAcrossGOMAXPROCS(t *testing.T) {
	// Large enough that products span several tiles (BT = 256 rows, V = 256
	// and 4C = 256 columns), attention has two row blocks, and every kernel
	// has several tasks.
	c := Config{VocabSize: 256, NCtx: 32, NLayer: 2, NHead: 4, NEmbd: 64}
	B, T := 8, 32
	p64 := randomParams(c, 21, 0.1)
	p32 := toF32(p64)
	tokens := randomTokens(B*T, c.VocabSize, 22)
	targets := randomTokens(B*T, c.VocabSize, 23)
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	t.Run("float32", func(t *testing.T) { checkDeterminism(t, c, B, T, p32, tokens, targets) })
	t.Run("float64", func(t *testing.T) { checkDeterminism(t, c, B, T, p64, tokens, targets) })
}

func checkDeterminism[F float32 | float64](t *testing.T, c Config, B, T int, params [][]F, tokens, targets []int32) {
	var refLoss F
	var refGrads [][]F
	for _, procs := range []int{1, 2, 4, 3} {
		runtime.GOMAXPROCS(procs)
		m := NewModel[F](c, B, T)
		grads := zerosLike(params)
		loss := m.Forward(params, tokens, targets)
		m.Backward(params, grads, 1)
		if refGrads == nil {
			refLoss, refGrads = loss, grads
			continue
		}
		if loss != refLoss {
			t.Errorf("GOMAXPROCS=%d: loss %v, GOMAXPROCS=1: %v", procs, loss, refLoss)
		}
		for i := range grads {
			for j := range grads[i] {
				if grads[i][j] != refGrads[i][j] {
					t.Fatalf("GOMAXPROCS=%d: grad %s[%d] = %v, GOMAXPROCS=1: %v",
						procs, c.Tensors()[i].Name, j, grads[i][j], refGrads[i][j])
				}
			}
		}
	}
}

func TestBackwardOverwritesAndScales(t *testing.T) {
	c := Config{VocabSize: 50, NCtx: 16, NLayer: 2, NHead: 2, NEmbd: 16}
	B, T := 3, 10 // BT = 30: scale/BT is not a power of two
	p64 := randomParams(c, 31, 0.2)
	tokens := randomTokens(B*T, c.VocabSize, 32)
	targets := randomTokens(B*T, c.VocabSize, 33)
	t.Run("float64", func(t *testing.T) { checkOverwriteScale(t, c, B, T, p64, tokens, targets) })
	t.Run("float32", func(t *testing.T) { checkOverwriteScale(t, c, B, T, toF32(p64), tokens, targets) })
}

func checkOverwriteScale[F float32 | float64](t *testing.T, c Config, B, T int, params [][]F, tokens, targets []int32) {
	m := NewModel[F](c, B, T)
	g1, g2, g8 := zerosLike(params), zerosLike(params), zerosLike(params)
	for _, g := range g2 { // garbage that must be overwritten
		fill(g, F(math.NaN()))
	}
	m.Forward(params, tokens, targets)
	m.Backward(params, g1, 1)
	m.Forward(params, tokens, targets)
	m.Backward(params, g2, 1)
	m.Backward(params, g2, 1) // twice without a new Forward: still overwrites
	m.Backward(params, g8, 8)
	for i := range g1 {
		for j := range g1[i] {
			if g2[i][j] != g1[i][j] {
				t.Fatalf("%s[%d]: second Backward %v, first %v", c.Tensors()[i].Name, j, g2[i][j], g1[i][j])
			}
			if g8[i][j] != 8*g1[i][j] {
				t.Fatalf("%s[%d]: scale 8 gives %v, 8 * scale 1 = %v", c.Tensors()[i].Name, j, g8[i][j], 8*g1[i][j])
			}
		}
	}
}

func TestNoAllocs(t *testing.T) {
	c := Config{VocabSize: 256, NCtx: 32, NLayer: 2, NHead: 4, NEmbd: 64}
	B, T := 4, 32
	params := toF32(randomParams(c, 41, 0.1))
	grads := zerosLike(params)
	tokens := randomTokens(B*T, c.VocabSize, 42)
	targets := randomTokens(B*T, c.VocabSize, 43)
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	for _, procs := range []int{1, 2, 4} {
		runtime.GOMAXPROCS(procs)
		m := NewModel[float32](c, B, T)
		step := func() {
			m.Forward(params, tokens, targets)
			m.Backward(params, grads, 1)
		}
		step() // starts the workers
		if n := testing.AllocsPerRun(5, step); n != 0 {
			t.Errorf("GOMAXPROCS=%d: Forward+Backward allocates %v times per step", procs, n)
		}
	}
}

// TestWorkersStop checks that a Model's worker goroutines are told to end
// (its pool's wake channel is closed, ending their range loop) once the Model
// is garbage collected.
func TestWorkersStop(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(4))
	p := func() *pool {
		params := randomParams(tiny, 1, 0.1)
		m := NewModel[float64](tiny, 4, 4)
		m.Forward(params, randomTokens(16, tiny.VocabSize, 1), nil)
		if m.pool.workers != 3 {
			t.Fatalf("%d workers after Forward on GOMAXPROCS=4, want 3", m.pool.workers)
		}
		return m.pool
	}()
	for range 200 {
		runtime.GC()
		select {
		case _, ok := <-p.wake:
			if ok {
				t.Fatal("a wake token was left in the channel")
			}
			return
		default:
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Error("the pool is still open 2 s after its Model became garbage")
}

func TestInitLoss(t *testing.T) {
	c := Config{VocabSize: 256, NCtx: 64, NLayer: 2, NHead: 4, NEmbd: 64}
	B, T := 4, 64
	m := NewModel[float32](c, B, T)
	loss := m.Forward(InitParams(c, 1), randomTokens(B*T, c.VocabSize, 1), randomTokens(B*T, c.VocabSize, 2))
	if want := math.Log(float64(c.VocabSize)); math.Abs(float64(loss)-want) > 0.1 {
		t.Errorf("loss at init = %v, want ln(%d) = %v within 0.1", loss, c.VocabSize, want)
	}
}

func TestInitParams(t *testing.T) {
	c := Config{VocabSize: 300, NCtx: 64, NLayer: 3, NHead: 4, NEmbd: 64}
	a, b := InitParams(c, 5), InitParams(c, 5)
	other := InitParams(c, 6)
	ps := c.Tensors()
	if len(a) != len(ps) {
		t.Fatalf("%d tensors, want %d", len(a), len(ps))
	}
	std := func(x []float32) float64 {
		s := 0.0
		for _, v := range x {
			s += float64(v) * float64(v)
		}
		return math.Sqrt(s / float64(len(x)))
	}
	for i, p := range ps {
		if len(a[i]) != p.Numel() {
			t.Fatalf("%s: %d elements, want %d", p.Name, len(a[i]), p.Numel())
		}
		for j := range a[i] {
			if a[i][j] != b[i][j] {
				t.Fatalf("%s: not deterministic", p.Name)
			}
		}
		var want float64
		switch {
		case strings.HasSuffix(p.Name, "c_proj.weight"):
			want = 0.02 / math.Sqrt(2*float64(c.NLayer))
		case p.Name == "wpe.weight":
			want = 0.01
		case strings.HasPrefix(p.Name, "ln_") || strings.Contains(p.Name, ".ln_"):
			want = -1 // weight all 1, bias all 0
		case strings.HasSuffix(p.Name, ".bias"):
			want = 0
		default:
			want = 0.02
		}
		switch want {
		case -1:
			v := float32(0)
			if strings.HasSuffix(p.Name, ".weight") {
				v = 1
			}
			for _, x := range a[i] {
				if x != v {
					t.Fatalf("%s has %v, want all %v", p.Name, x, v)
				}
			}
		case 0:
			if s := std(a[i]); s != 0 {
				t.Errorf("%s: rms %v, want 0", p.Name, s)
			}
		default:
			if s := std(a[i]); math.Abs(s-want) > 0.05*want {
				t.Errorf("%s: std %v, want %v", p.Name, s, want)
			}
			if a[i][0] == other[i][0] {
				t.Errorf("%s: seeds 5 and 6 give the same first element", p.Name)
			}
		}
	}
}

func TestGPT2SmallParams(t *testing.T) {
	c := Config{VocabSize: 50257, NCtx: 1024, NLayer: 12, NHead: 12, NEmbd: 768}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	ps := c.Tensors()
	if len(ps) != 2+12*12+2 {
		t.Fatalf("%d tensors, want %d", len(ps), 2+12*12+2)
	}
	total := 0
	for _, p := range ps {
		total += p.Numel()
	}
	const want = 124_439_808
	if total != want || c.NumParams() != want {
		t.Errorf("sum of shapes %d, NumParams %d, want %d", total, c.NumParams(), want)
	}
	got := func(i int) string { return fmt.Sprint(ps[i].Name, ps[i].Shape) }
	for i, w := range map[int]string{
		0:   "wte.weight[50257 768]",
		1:   "wpe.weight[1024 768]",
		2:   "h.0.ln_1.weight[768]",
		3:   "h.0.ln_1.bias[768]",
		4:   "h.0.attn.c_attn.weight[768 2304]",
		5:   "h.0.attn.c_attn.bias[2304]",
		6:   "h.0.attn.c_proj.weight[768 768]",
		7:   "h.0.attn.c_proj.bias[768]",
		8:   "h.0.ln_2.weight[768]",
		9:   "h.0.ln_2.bias[768]",
		10:  "h.0.mlp.c_fc.weight[768 3072]",
		11:  "h.0.mlp.c_fc.bias[3072]",
		12:  "h.0.mlp.c_proj.weight[3072 768]",
		13:  "h.0.mlp.c_proj.bias[768]",
		14:  "h.1.ln_1.weight[768]",
		145: "h.11.mlp.c_proj.bias[768]",
		146: "ln_f.weight[768]",
		147: "ln_f.bias[768]",
	} {
		if got(i) != w {
			t.Errorf("Params()[%d] = %s, want %s", i, got(i), w)
		}
	}
}

func TestPanics(t *testing.T) {
	c := tiny
	params := randomParams(c, 1, 0.1)
	tokens := randomTokens(8, c.VocabSize, 1)
	expectPanic := func(name, want string, f func()) {
		t.Helper()
		defer func() {
			r := recover()
			if r == nil || !strings.Contains(fmt.Sprint(r), want) {
				t.Errorf("%s: panic %v, want one containing %q", name, r, want)
			}
		}()
		f()
	}
	m := NewModel[float64](c, 2, 4)
	expectPanic("T > NCtx", "T = 6", func() { NewModel[float64](c, 1, 6) })
	expectPanic("Backward first", "without a Forward", func() { m.Backward(params, zerosLike(params), 1) })
	bad := append([]int32(nil), tokens...)
	bad[3] = int32(c.VocabSize)
	expectPanic("token", "token 11 at position 3", func() { m.Forward(params, bad, nil) })
	bad[3] = -1
	expectPanic("target", "target -1 at position 3", func() { m.Forward(params, tokens, bad) })
	expectPanic("short tokens", "7 tokens", func() { m.Forward(params, tokens[:7], nil) })
	expectPanic("short param", "h.0.ln_1.bias", func() {
		p := append([][]float64(nil), params...)
		p[3] = p[3][:1]
		m.Forward(p, tokens, nil)
	})
	m.Forward(params, tokens, nil)
	expectPanic("Backward without targets", "without a Forward with targets", func() { m.Backward(params, zerosLike(params), 1) })
}

// BenchmarkTrainStep times Forward+Backward in float32 on the example
// trainer's default shape.
func BenchmarkTrainStep(b *testing.B) {
	c := Config{VocabSize: 256, NCtx: 64, NLayer: 4, NHead: 4, NEmbd: 128}
	B, T := 16, 64
	b.Run(fmt.Sprintf("f32/V=%d,L=%d,C=%d,B=%d,T=%d", c.VocabSize, c.NLayer, c.NEmbd, B, T), func(b *testing.B) {
		params := InitParams(c, 1)
		grads := zerosLike(params)
		tokens := randomTokens(B*T, c.VocabSize, 1)
		targets := randomTokens(B*T, c.VocabSize, 2)
		m := NewModel[float32](c, B, T)
		b.ReportAllocs()
		for b.Loop() {
			m.Forward(params, tokens, targets)
			m.Backward(params, grads, 1)
		}
		b.ReportMetric(float64(b.N*B*T)/b.Elapsed().Seconds(), "tokens/s")
	})
}

// TestInitWeightsParallel: the windows drawn on several goroutines give
// InitParams's bits, tensor by tensor in order, whatever the window (one
// tensor, several, the whole model) and the workers; set's error stops
// the drawing and is returned.
func TestInitWeightsParallel(t *testing.T) {
	c := Config{VocabSize: 97, NCtx: 16, NLayer: 3, NHead: 2, NEmbd: 8}
	want := InitParams(c, 5)
	for _, window := range []int{4, 4 * 200, 4 * 2000, 1 << 30} {
		for _, workers := range []int{1, 3, 16} {
			next := 0
			err := initWeights(c, 5, workers, window, func(i int, v []float32) error {
				if i != next {
					t.Fatalf("window %d, workers %d: tensor %d handed before %d", window, workers, i, next)
				}
				next++
				if !slices.Equal(v, want[i]) {
					t.Fatalf("window %d, workers %d: tensor %d differs from InitParams", window, workers, i)
				}
				return nil
			})
			if err != nil || next != len(want) {
				t.Fatalf("window %d, workers %d: %d of %d tensors, err %v", window, workers, next, len(want), err)
			}
		}
	}
	stop := errors.New("full")
	calls := 0
	err := initWeights(c, 5, 4, 4*200, func(i int, v []float32) error {
		calls++
		if i == 4 {
			return stop
		}
		return nil
	})
	if !errors.Is(err, stop) || calls != 5 {
		t.Fatalf("set's error: %v after %d calls, want %v after 5", err, calls, stop)
	}
}
