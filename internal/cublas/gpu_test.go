package cublas

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/deepstates/dos/internal/cuda"
)

// gpu is device 0 with a stream and a Handle on it, or the test skips with
// the reason; with DOS_REQUIRE_GPU=1 a missing GPU or cuBLASLt fails it.
type gpu struct {
	d *cuda.Device
	s *cuda.Stream
	h *Handle
}

func newGPU(t testing.TB) *gpu {
	t.Helper()
	if err := Available(); err != nil {
		if os.Getenv("DOS_REQUIRE_GPU") == "1" {
			t.Fatalf("DOS_REQUIRE_GPU=1 but no GPU or no cuBLASLt: %v", err)
		}
		t.Skipf("no GPU or no cuBLASLt: %v", err)
	}
	d, err := cuda.Open(0)
	if err != nil {
		t.Fatal(err)
	}
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	h, err := New(d, s)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := h.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		s.Free()
		d.Close()
	})
	return &gpu{d: d, s: s, h: h}
}

// bf16 rounds to the nearest bfloat16, ties to even (NaN stays NaN).
func bf16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 {
		return uint16(b>>16) | 0x40
	}
	return uint16((b + 0x7fff + (b>>16)&1) >> 16)
}

func fromBF16(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// round returns v as stored in t, in float64.
func round(v []float32, t DType) []float64 {
	out := make([]float64, len(v))
	for i, x := range v {
		if t == BF16 {
			x = fromBF16(bf16(x))
		}
		out[i] = float64(x)
	}
	return out
}

// random returns n values uniform in [lo, hi).
func random(r *rand.Rand, n int, lo, hi float32) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = lo + (hi-lo)*r.Float32()
	}
	return v
}

// buffer is device memory holding n elements of type t.
type buffer struct {
	b *cuda.Buffer
	t DType
	n int
}

func (g *gpu) alloc(t testing.TB, dt DType, n int) *buffer {
	t.Helper()
	b, err := g.d.Alloc(int64(n) * dt.Size())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Free() })
	return &buffer{b, dt, n}
}

// upload copies v, converted to dt, into a new device buffer and returns
// it with the values as stored.
func (g *gpu) upload(t testing.TB, v []float32, dt DType) (*buffer, []float64) {
	t.Helper()
	buf := g.alloc(t, dt, len(v))
	g.write(t, buf, v)
	return buf, round(v, dt)
}

func (g *gpu) write(t testing.TB, buf *buffer, v []float32) {
	t.Helper()
	host, err := g.d.HostAlloc(int64(len(v)) * buf.t.Size())
	if err != nil {
		t.Fatal(err)
	}
	defer host.Free()
	m := host.Bytes()
	for i, x := range v {
		if buf.t == BF16 {
			binary.LittleEndian.PutUint16(m[2*i:], bf16(x))
		} else {
			binary.LittleEndian.PutUint32(m[4*i:], math.Float32bits(x))
		}
	}
	if err := g.s.CopyHtoD(buf.b, 0, host, 0, host.Len()); err != nil {
		t.Fatal(err)
	}
	if err := g.s.Sync(); err != nil {
		t.Fatal(err)
	}
}

// read waits for the stream and copies buf back.
func (g *gpu) read(t testing.TB, buf *buffer) []float64 {
	t.Helper()
	host, err := g.d.HostAlloc(int64(buf.n) * buf.t.Size())
	if err != nil {
		t.Fatal(err)
	}
	defer host.Free()
	if err := g.s.CopyDtoH(host, 0, buf.b, 0, host.Len()); err != nil {
		t.Fatal(err)
	}
	if err := g.s.Sync(); err != nil {
		t.Fatal(err)
	}
	m := host.Bytes()
	out := make([]float64, buf.n)
	for i := range out {
		if buf.t == BF16 {
			out[i] = float64(fromBF16(binary.LittleEndian.Uint16(m[2*i:])))
		} else {
			out[i] = float64(math.Float32frombits(binary.LittleEndian.Uint32(m[4*i:])))
		}
	}
	return out
}

func (g *gpu) matmul(t testing.TB, gm *GEMM, c, a, b, bias, aux *buffer) {
	t.Helper()
	ptr := func(b *buffer) uint64 {
		if b == nil {
			return 0
		}
		return b.b.Ptr()
	}
	if err := g.h.Matmul(gm, ptr(c), ptr(a), ptr(b), ptr(bias), ptr(aux)); err != nil {
		t.Fatal(err)
	}
}

// The tanh GELU and its derivative.
func gelu(x float64) float64 {
	s := math.Sqrt(2 / math.Pi)
	return 0.5 * x * (1 + math.Tanh(s*(x+0.044715*x*x*x)))
}

func dgelu(x float64) float64 {
	s := math.Sqrt(2 / math.Pi)
	th := math.Tanh(s * (x + 0.044715*x*x*x))
	return 0.5*(1+th) + 0.5*x*(1-th*th)*s*(1+3*0.044715*x*x)
}

// reference computes g in float64 from the stored inputs: c0 is C before
// (read with Accumulate), bias and aux as the epilogue needs. It returns C
// (len(c0) elements; a batch's gaps keep c0's values) and, for
// GELUAuxBias, the pre-activation.
func reference(g *GEMM, c0, a, b, bias, aux []float64) (c, pre []float64) {
	M, N, K := g.M, g.N, g.K
	c = append([]float64(nil), c0...)
	if g.Epilogue == GELUAuxBias {
		pre = make([]float64, M*N)
	}
	alpha := float64(g.Alpha)
	if alpha == 0 {
		alpha = 1
	}
	batch := max(g.Batch, 1)
	rows := make(chan [2]int, 64)
	var wg sync.WaitGroup
	for range runtime.NumCPU() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range rows {
				bi, i := r[0], r[1]
				ao, bo, co := int64(bi)*g.StrideA, int64(bi)*g.StrideB, int64(bi)*g.StrideC
				for j := range N {
					var sum float64
					for k := range K {
						var x, y float64
						if g.TransA {
							x = a[ao+int64(k*M+i)]
						} else {
							x = a[ao+int64(i*K+k)]
						}
						if g.TransB {
							y = b[bo+int64(j*K+k)]
						} else {
							y = b[bo+int64(k*N+j)]
						}
						sum += x * y
					}
					v := alpha * sum
					if g.Accumulate {
						v += c0[co+int64(i*N+j)]
					}
					switch g.Epilogue {
					case Bias:
						v += bias[j]
					case GELUAuxBias:
						v += bias[j]
						pre[i*N+j] = v
						v = gelu(v)
					case DGELU:
						v *= dgelu(aux[i*N+j])
					}
					c[co+int64(i*N+j)] = v
				}
			}
		}()
	}
	for bi := range batch {
		for i := range M {
			rows <- [2]int{bi, i}
		}
	}
	close(rows)
	wg.Wait()
	return c, pre
}

// compare checks max|got-want| <= rel·max|want| over the batch members'
// elements (the gaps between members must be unchanged: exactly equal).
func compare(t testing.TB, name string, g *GEMM, got, want []float64, rel float64) {
	t.Helper()
	inside := make([]bool, len(got))
	for bi := range max(g.Batch, 1) {
		for i := range g.M * g.N {
			inside[int64(bi)*g.StrideC+int64(i)] = true
		}
	}
	var maxRef, maxDiff float64
	worst := 0
	for i := range got {
		if !inside[i] {
			if got[i] != want[i] {
				t.Fatalf("%s: element %d outside the batch's members changed: %g, was %g", name, i, got[i], want[i])
			}
			continue
		}
		if math.IsNaN(got[i]) {
			t.Fatalf("%s: element %d is NaN", name, i)
		}
		maxRef = max(maxRef, math.Abs(want[i]))
		if d := math.Abs(got[i] - want[i]); d > maxDiff {
			maxDiff, worst = d, i
		}
	}
	t.Logf("%s: max|diff| %.3g = %.2g·max|ref| (max|ref| %.3g)", name, maxDiff, maxDiff/maxRef, maxRef)
	if maxDiff > rel*maxRef || maxRef == 0 {
		t.Errorf("%s: max|diff| %.4g at %d (got %g, want %g) > %g·max|ref| %.4g", name, maxDiff, worst, got[worst], want[worst], rel, maxRef)
	}
}

// tolerance for an output type: bf16 keeps 8 bits; f32 outputs see only
// float32 accumulation error.
func tolerance(t DType) float64 {
	if t == BF16 {
		return 1e-2
	}
	return 1e-4
}

// TestMatmulTransposes: bf16 GEMMs, every TransA/TransB, odd and GPT-2
// sizes, bf16 and f32 outputs, against float64.
func TestMatmulTransposes(t *testing.T) {
	g := newGPU(t)
	r := rand.New(rand.NewPCG(1, 2))
	for _, sz := range [][3]int{{37, 64, 48}, {1024, 2304, 768}} {
		M, N, K := sz[0], sz[1], sz[2]
		a, aRef := g.upload(t, random(r, M*K, -1, 1), BF16)
		b, bRef := g.upload(t, random(r, K*N, -1, 1), BF16)
		for _, ta := range []bool{false, true} {
			for _, tb := range []bool{false, true} {
				gm := GEMM{M: M, N: N, K: K, TransA: ta, TransB: tb}
				want, _ := reference(&gm, make([]float64, M*N), aRef, bRef, nil, nil)
				for _, ct := range []DType{BF16, F32} {
					gm.CType = ct
					c := g.alloc(t, ct, M*N)
					g.matmul(t, &gm, c, a, b, nil, nil)
					compare(t, gm.String(), &gm, g.read(t, c), want, tolerance(ct))
				}
			}
		}
	}
}

// TestMatmulF32Inputs: A and B in float32 (CUBLAS_COMPUTE_32F, no TF32).
func TestMatmulF32Inputs(t *testing.T) {
	g := newGPU(t)
	r := rand.New(rand.NewPCG(3, 4))
	const M, N, K = 37, 64, 48
	a, aRef := g.upload(t, random(r, M*K, -1, 1), F32)
	b, bRef := g.upload(t, random(r, K*N, -1, 1), F32)
	for _, ta := range []bool{false, true} {
		gm := GEMM{M: M, N: N, K: K, TransA: ta, AType: F32, CType: F32}
		want, _ := reference(&gm, make([]float64, M*N), aRef, bRef, nil, nil)
		c := g.alloc(t, F32, M*N)
		g.matmul(t, &gm, c, a, b, nil, nil)
		compare(t, gm.String(), &gm, g.read(t, c), want, 1e-5)
	}
}

// TestMatmulBatched: attention's two strided batched GEMMs for 12 heads,
// T=64, head size 64: att = alpha·Q·Kᵀ and y = att·V, the second with a
// padded output stride whose gaps must stay untouched.
func TestMatmulBatched(t *testing.T) {
	g := newGPU(t)
	r := rand.New(rand.NewPCG(5, 6))
	const H, T, HS = 12, 64, 64
	q, qRef := g.upload(t, random(r, H*T*HS, -1, 1), BF16)
	k, kRef := g.upload(t, random(r, H*T*HS, -1, 1), BF16)
	qk := GEMM{M: T, N: T, K: HS, TransB: true, Batch: H, StrideA: T * HS, StrideB: T * HS, StrideC: T * T, Alpha: float32(1 / math.Sqrt(HS))}
	att := g.alloc(t, BF16, H*T*T)
	g.matmul(t, &qk, att, q, k, nil, nil)
	want, _ := reference(&qk, make([]float64, H*T*T), qRef, kRef, nil, nil)
	compare(t, "QKᵀ "+qk.String(), &qk, g.read(t, att), want, 1e-2)

	const pad = 100
	attIn, attRef := g.upload(t, random(r, H*T*T, 0, 1.0/T*2), BF16)
	v, vRef := g.upload(t, random(r, H*T*HS, -1, 1), BF16)
	av := GEMM{M: T, N: HS, K: T, Batch: H, StrideA: T * T, StrideB: T * HS, StrideC: T*HS + pad, CType: F32}
	sentinel := make([]float32, H*(T*HS+pad))
	for i := range sentinel {
		sentinel[i] = 7
	}
	y, y0 := g.upload(t, sentinel, F32)
	g.matmul(t, &av, y, attIn, v, nil, nil)
	want, _ = reference(&av, y0, attRef, vRef, nil, nil)
	compare(t, "att·V "+av.String(), &av, g.read(t, y), want, 1e-4)
}

// TestMatmulAccumulate: C += alpha·A·B, into f32 (the weight gradient:
// dW += xᵀ·dy, TransA) and into bf16.
func TestMatmulAccumulate(t *testing.T) {
	g := newGPU(t)
	r := rand.New(rand.NewPCG(7, 8))
	const M, N, K = 48, 64, 37
	a, aRef := g.upload(t, random(r, K*M, -1, 1), BF16) // [K, M]: TransA
	b, bRef := g.upload(t, random(r, K*N, -1, 1), BF16)
	for _, ct := range []DType{F32, BF16} {
		gm := GEMM{M: M, N: N, K: K, TransA: true, CType: ct, Alpha: 0.5, Accumulate: true}
		c, c0 := g.upload(t, random(r, M*N, -4, 4), ct)
		g.matmul(t, &gm, c, a, b, nil, nil)
		want, _ := reference(&gm, c0, aRef, bRef, nil, nil)
		got := g.read(t, c)
		compare(t, gm.String(), &gm, got, want, tolerance(ct))
		// Twice more: C keeps accumulating.
		g.matmul(t, &gm, c, a, b, nil, nil)
		g.matmul(t, &gm, c, a, b, nil, nil)
		want, _ = reference(&gm, got, aRef, bRef, nil, nil)
		want, _ = reference(&gm, round32(want, ct), aRef, bRef, nil, nil)
		compare(t, gm.String()+" ×3", &gm, g.read(t, c), want, 2*tolerance(ct))
	}
}

// round32 rounds float64 values as C stores them.
func round32(v []float64, t DType) []float64 {
	f := make([]float32, len(v))
	for i, x := range v {
		f[i] = float32(x)
	}
	return round(f, t)
}

// TestMatmulEpilogues: Bias (bf16 and f32 C), GELUAuxBias and DGELU
// against the tanh GELU, at an odd size and at GPT-2's MLP size.
func TestMatmulEpilogues(t *testing.T) {
	g := newGPU(t)
	r := rand.New(rand.NewPCG(9, 10))
	for _, sz := range [][3]int{{37, 64, 48}, {256, 3072, 768}} {
		M, N, K := sz[0], sz[1], sz[2]
		a, aRef := g.upload(t, random(r, M*K, -1, 1), BF16)
		b, bRef := g.upload(t, random(r, K*N, -1, 1), BF16)
		scale := float32(1 / math.Sqrt(float64(K))) // pre-activations of order 1: GELU's curved part
		for _, ct := range []DType{BF16, F32} {
			gm := GEMM{M: M, N: N, K: K, CType: ct, Epilogue: Bias}
			bias, biasRef := g.upload(t, random(r, N, -2, 2), ct)
			c := g.alloc(t, ct, M*N)
			g.matmul(t, &gm, c, a, b, bias, nil)
			want, _ := reference(&gm, make([]float64, M*N), aRef, bRef, biasRef, nil)
			compare(t, gm.String(), &gm, g.read(t, c), want, tolerance(ct))
		}

		gm := GEMM{M: M, N: N, K: K, Alpha: scale, Epilogue: GELUAuxBias}
		bias, biasRef := g.upload(t, random(r, N, -1, 1), BF16)
		c, aux := g.alloc(t, BF16, M*N), g.alloc(t, BF16, M*N)
		g.matmul(t, &gm, c, a, b, bias, aux)
		want, pre := reference(&gm, make([]float64, M*N), aRef, bRef, biasRef, nil)
		got := g.read(t, c)
		compare(t, gm.String()+" C", &gm, got, want, 1e-2)
		compare(t, gm.String()+" aux", &gm, g.read(t, aux), pre, 1e-2)
		geluFlavour(t, got, pre)

		gm = GEMM{M: M, N: N, K: K, Alpha: scale, Epilogue: DGELU}
		aux2, auxRef := g.upload(t, random(r, M*N, -3, 3), BF16)
		c2 := g.alloc(t, BF16, M*N)
		g.matmul(t, &gm, c2, a, b, nil, aux2)
		want, _ = reference(&gm, make([]float64, M*N), aRef, bRef, nil, auxRef)
		compare(t, gm.String(), &gm, g.read(t, c2), want, 1e-2)
	}
}

// geluFlavour logs how far cuBLASLt's GELU is from the tanh and from the
// erf GELU, for the record (the bf16 output hides most of the difference).
func geluFlavour(t *testing.T, got, pre []float64) {
	var dTanh, dErf float64
	for i, x := range pre {
		dTanh = max(dTanh, math.Abs(got[i]-gelu(x)))
		dErf = max(dErf, math.Abs(got[i]-0.5*x*(1+math.Erf(x/math.Sqrt2))))
	}
	t.Logf("GELU epilogue: max|diff| from tanh GELU %.3g, from erf GELU %.3g", dTanh, dErf)
}

// TestMatmulPlans: a plan per shape and alignment, reused whatever alpha
// and beta; views 16 bytes into a buffer get their own plan and the right
// result.
func TestMatmulPlans(t *testing.T) {
	g := newGPU(t)
	r := rand.New(rand.NewPCG(11, 12))
	const M, N, K = 64, 128, 96
	a, aRef := g.upload(t, random(r, M*K+8, -1, 1), BF16)
	b, bRef := g.upload(t, random(r, K*N+8, -1, 1), BF16)
	c := g.alloc(t, BF16, M*N+8)
	gm := GEMM{M: M, N: N, K: K}
	for i := range 5 {
		gm.Alpha, gm.Accumulate = float32(i), i%2 == 1
		g.matmul(t, &gm, c, a, b, nil, nil)
	}
	if n := len(g.h.plans); n != 1 {
		t.Fatalf("%d plans for one shape", n)
	}
	gm = GEMM{M: M, N: N, K: K}
	if err := g.h.Matmul(&gm, c.b.Ptr()+16, a.b.Ptr()+16, b.b.Ptr()+16, 0, 0); err != nil {
		t.Fatal(err)
	}
	if n := len(g.h.plans); n != 2 {
		t.Fatalf("%d plans after a view aligned to 16 bytes, want 2", n)
	}
	want, _ := reference(&gm, make([]float64, M*N), aRef[8:], bRef[8:], nil, nil)
	compare(t, "views at +16 B", &gm, g.read(t, c)[8:], want, 1e-2)
}

// TestMatmulNoAllocs: once the plans exist, Matmul allocates nothing, with
// or without epilogues and batches (make test runs the NoAllocs tests
// without -race).
func TestMatmulNoAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race runtime allocates")
	}
	g := newGPU(t)
	const M, N, K = 128, 256, 64
	a, b := g.alloc(t, BF16, M*K), g.alloc(t, BF16, K*N)
	c, aux, bias := g.alloc(t, BF16, M*N), g.alloc(t, BF16, M*N), g.alloc(t, BF16, N)
	cf := g.alloc(t, F32, M*N)
	for _, buf := range []*buffer{a, b, c, aux, bias, cf} {
		if err := g.s.Memset(buf.b, 0, buf.b.Len(), 0); err != nil {
			t.Fatal(err)
		}
	}
	plain := GEMM{M: M, N: N, K: K, TransB: true}
	acc := GEMM{M: M, N: N, K: K, TransA: true, CType: F32, Accumulate: true, Alpha: 0.5}
	withBias := GEMM{M: M, N: N, K: K, Epilogue: Bias}
	fwd := GEMM{M: M, N: N, K: K, Epilogue: GELUAuxBias}
	bwd := GEMM{M: M, N: N, K: K, Epilogue: DGELU}
	batched := GEMM{M: 64, N: 64, K: 32, TransB: true, Batch: 4, StrideA: 64 * 32, StrideB: 64 * 32, StrideC: 64 * 64}
	h := g.h
	var err error
	keep := func(e error) {
		if err == nil {
			err = e
		}
	}
	f := func() {
		keep(h.Matmul(&plain, c.b.Ptr(), a.b.Ptr(), b.b.Ptr(), 0, 0))
		keep(h.Matmul(&acc, cf.b.Ptr(), a.b.Ptr(), b.b.Ptr(), 0, 0))
		keep(h.Matmul(&withBias, c.b.Ptr(), a.b.Ptr(), b.b.Ptr(), bias.b.Ptr(), 0))
		keep(h.Matmul(&fwd, c.b.Ptr(), a.b.Ptr(), b.b.Ptr(), bias.b.Ptr(), aux.b.Ptr()))
		keep(h.Matmul(&bwd, c.b.Ptr(), a.b.Ptr(), b.b.Ptr(), 0, aux.b.Ptr()))
		keep(h.Matmul(&batched, c.b.Ptr(), a.b.Ptr(), b.b.Ptr(), 0, 0))
	}
	f()
	if err != nil {
		t.Fatal(err)
	}
	if allocs := testing.AllocsPerRun(50, f); allocs != 0 {
		t.Errorf("Matmul allocates %v times per 6 calls", allocs)
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := g.s.Sync(); err != nil {
		t.Fatal(err)
	}
}

// TestMatmulConcurrent: goroutines share one Handle (its mutex serializes
// them) and each gets its own right result.
func TestMatmulConcurrent(t *testing.T) {
	g := newGPU(t)
	r := rand.New(rand.NewPCG(13, 14))
	const M, N, K, workers = 37, 64, 48, 4
	a, aRef := g.upload(t, random(r, M*K, -1, 1), BF16)
	b, bRef := g.upload(t, random(r, K*N, -1, 1), BF16)
	cs := make([]*buffer, workers)
	for w := range cs {
		cs[w] = g.alloc(t, F32, M*N)
	}
	var wg sync.WaitGroup
	errs := make([]error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			gm := GEMM{M: M, N: N, K: K, CType: F32, Alpha: float32(w + 1)}
			for range 20 {
				if err := g.h.Matmul(&gm, cs[w].b.Ptr(), a.b.Ptr(), b.b.Ptr(), 0, 0); err != nil {
					errs[w] = err
					return
				}
			}
		}()
	}
	wg.Wait()
	for w := range workers {
		if errs[w] != nil {
			t.Fatalf("worker %d: %v", w, errs[w])
		}
		gm := GEMM{M: M, N: N, K: K, CType: F32, Alpha: float32(w + 1)}
		want, _ := reference(&gm, make([]float64, M*N), aRef, bRef, nil, nil)
		compare(t, fmt.Sprintf("worker %d", w), &gm, g.read(t, cs[w]), want, 1e-4)
	}
}

// TestMatmulErrors: a closed Handle, a freed stream, a combination
// cuBLASLt may refuse (its error names the status and the call).
func TestMatmulErrors(t *testing.T) {
	g := newGPU(t)
	a, b, c, cf := g.alloc(t, F32, 64*64), g.alloc(t, F32, 64*64), g.alloc(t, BF16, 64*64), g.alloc(t, F32, 64*64)
	// f32 inputs into a bf16 C: not in cuBLASLt's table of COMPUTE_32F
	// combinations as far as we know; either way the outcome is logged.
	gm := GEMM{M: 64, N: 64, K: 64, AType: F32, CType: BF16}
	err := g.h.Matmul(&gm, c.b.Ptr(), a.b.Ptr(), b.b.Ptr(), 0, 0)
	t.Logf("f32 x f32 -> bf16: %v", err)
	var e *Error
	if err != nil && (!errors.As(err, &e) || !strings.HasPrefix(e.Name, "CUBLAS_STATUS_") || !strings.Contains(err.Error(), "cublasLt")) {
		t.Errorf("refusal is not a named *Error: %v", err)
	}
	if err := g.s.Sync(); err != nil {
		t.Fatal(err)
	}

	s2, err := g.d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	h2, err := New(g.d, s2)
	if err != nil {
		t.Fatal(err)
	}
	ok := GEMM{M: 64, N: 64, K: 64, AType: F32, CType: F32}
	if err := h2.Matmul(&ok, cf.b.Ptr(), a.b.Ptr(), b.b.Ptr(), 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := s2.Free(); err != nil {
		t.Fatal(err)
	}
	if err := h2.Matmul(&ok, cf.b.Ptr(), a.b.Ptr(), b.b.Ptr(), 0, 0); !errors.Is(err, cuda.ErrFreed) {
		t.Errorf("Matmul on a freed stream: %v", err)
	}
	if err := h2.Close(); err != nil {
		t.Errorf("Close after the stream's Free: %v", err)
	}
	if err := h2.Matmul(&ok, cf.b.Ptr(), a.b.Ptr(), b.b.Ptr(), 0, 0); !errors.Is(err, ErrClosed) {
		t.Errorf("Matmul on a closed Handle: %v", err)
	}
	if err := h2.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// BenchmarkMatmul: GPT-2 small's MLP up-projection over 8192 tokens, bf16:
// M=8192, N=3072, K=768, plain and with the GELU epilogue.
func BenchmarkMatmul(b *testing.B) {
	g := newGPU(b)
	const M, N, K = 8192, 768 * 4, 768
	x, w := g.alloc(b, BF16, M*K), g.alloc(b, BF16, K*N)
	c, aux, bias := g.alloc(b, BF16, M*N), g.alloc(b, BF16, M*N), g.alloc(b, BF16, N)
	for _, buf := range []*buffer{x, w, c, aux, bias} {
		if err := g.s.Memset(buf.b, 0, buf.b.Len(), 0x3c); err != nil { // bf16 0x3c3c ≈ 0.0115
			b.Fatal(err)
		}
	}
	for _, bc := range []struct {
		name      string
		g         GEMM
		bias, aux uint64
	}{
		{"plain", GEMM{M: M, N: N, K: K}, 0, 0},
		{"gelu_aux_bias", GEMM{M: M, N: N, K: K, Epilogue: GELUAuxBias}, bias.b.Ptr(), aux.b.Ptr()},
	} {
		b.Run(bc.name, func(b *testing.B) {
			run := func() {
				if err := g.h.Matmul(&bc.g, c.b.Ptr(), x.b.Ptr(), w.b.Ptr(), bc.bias, bc.aux); err != nil {
					b.Fatal(err)
				}
			}
			run()
			if err := g.s.Sync(); err != nil {
				b.Fatal(err)
			}
			n, start := 0, time.Now()
			for b.Loop() {
				run()
				n++
			}
			if err := g.s.Sync(); err != nil {
				b.Fatal(err)
			}
			secs := time.Since(start).Seconds()
			b.ReportMetric(2*M*N*K*float64(n)/secs/1e12, "TFLOP/s")
		})
	}
}
