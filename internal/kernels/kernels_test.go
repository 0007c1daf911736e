package kernels

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"regexp"
	"runtime"
	"sync"
	"testing"
	"unsafe"

	dos "github.com/deepstates/dos"
	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/internal/adamcase"
	"github.com/deepstates/dos/internal/cuda"
)

// TestStamp runs everywhere (CI included): the committed PTX was built from
// the committed adamw.cu. After editing adamw.cu, run
// scripts/build-kernels.sh on the GPU machine and commit adamw.ptx.
func TestStamp(t *testing.T) {
	src, err := os.ReadFile("adamw.cu")
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(src)
	if got, want := Stamp(), hex.EncodeToString(sum[:]); got != want {
		t.Fatalf("adamw.ptx is stamped %q but adamw.cu hashes to %s: rebuild the PTX (scripts/build-kernels.sh on the GPU machine)", got, want)
	}
	// Every kernel the launchers look up is in the PTX.
	entries := map[string]bool{}
	for _, m := range regexp.MustCompile(`\.entry\s+(\w+)\(`).FindAllSubmatch(adamwPTX, -1) {
		entries[string(m[1])] = true
	}
	var names []string
	for gi := range 3 {
		for oi := range 3 {
			n := dtypeSuffix[gi]
			if oi > 0 {
				n += "_" + dtypeSuffix[oi]
			}
			names = append(names, "dos_adamw_"+n, "dos_adamw_multi_"+n)
		}
		names = append(names, "dos_grad_stats_"+dtypeSuffix[gi])
		if gi > 0 {
			names = append(names, "dos_widen_"+dtypeSuffix[gi], "dos_round_"+dtypeSuffix[gi])
		}
	}
	for _, n := range names {
		if !entries[n] {
			t.Errorf("kernel %s missing from adamw.ptx", n)
		}
	}
	if !bytes.Contains(adamwPTX, []byte(".target sm_80")) {
		t.Error("adamw.ptx does not target sm_80")
	}
}

type env struct {
	d *cuda.Device
	k *Kernels
	s *cuda.Stream
	b CaseBackend
}

var (
	envOnce sync.Once
	theEnv  *env
	envErr  error
)

// gpu returns the shared device, kernels and stream, or skips (fails with
// DOS_REQUIRE_GPU=1) when there is no GPU.
func gpu(t testing.TB) *env {
	t.Helper()
	if err := cuda.Available(); err != nil {
		if os.Getenv("DOS_REQUIRE_GPU") == "1" {
			t.Fatalf("DOS_REQUIRE_GPU=1 but no GPU: %v", err)
		}
		t.Skipf("no GPU: %v", err)
	}
	envOnce.Do(func() {
		e := &env{}
		if e.d, envErr = cuda.Open(0); envErr != nil {
			return
		}
		if e.k, envErr = Load(e.d); envErr != nil {
			return
		}
		if e.s, envErr = e.d.NewStream(); envErr != nil {
			return
		}
		e.b = CaseBackend{K: e.k, S: e.s, D: e.d}
		theEnv = e
	})
	if envErr != nil {
		t.Fatal(envErr)
	}
	return theEnv
}

// TestCases replays every reference case on the GPU.
func TestCases(t *testing.T) {
	e := gpu(t)
	cases, err := adamcase.LoadFS(dos.AdamCases, dos.AdamCasesDir)
	if err != nil {
		t.Fatal(err)
	}
	if dir := "../../../shared/adam-cases"; dirExists(dir) {
		more, err := adamcase.LoadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		cases = append(cases, more...)
	}
	for _, c := range cases {
		r := adamcase.Run(c, e.b)
		if !r.Passed() {
			t.Errorf("%s on %s: %v", r.Case, r.Backend, r.Err)
		}
	}
	t.Logf("%d cases passed on %s", len(cases), e.b.Name())
}

func dirExists(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.IsDir()
}

// problem is a random subgroup on the host, its values of mixed magnitude
// with special values sprinkled in.
func problem(n int, gd adam.DType, amsgrad bool, seed uint64) (adam.State, adam.Grad) {
	s := adam.State{Param: make([]float32, n), ExpAvg: make([]float32, n), ExpAvgSq: make([]float32, n)}
	if amsgrad {
		s.MaxExpAvgSq = make([]float32, n)
	}
	g32 := make([]float32, n)
	var gu []uint16
	if gd != adam.F32 {
		gu = make([]uint16, n)
	}
	workers := runtime.GOMAXPROCS(0)
	var wg sync.WaitGroup
	per := (n + workers - 1) / workers
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(seed, uint64(w)))
			for i := w * per; i < min(n, (w+1)*per); i++ {
				s.Param[i] = float32(r.NormFloat64())
				s.ExpAvg[i] = float32(r.NormFloat64() * 1e-2)
				s.ExpAvgSq[i] = float32(r.Float64() * 1e-4)
				if amsgrad {
					s.MaxExpAvgSq[i] = s.ExpAvgSq[i] * float32(0.5+r.Float64())
				}
				g32[i] = float32(r.NormFloat64() * math.Pow(10, float64(r.IntN(8)-5)))
				if r.IntN(1000) == 0 {
					g32[i] = []float32{1e-40, -1e-42, 0, float32(math.Copysign(0, -1)), 3e38, 1e-45}[r.IntN(6)]
				}
				switch gd {
				case adam.BF16:
					gu[i] = adam.F32ToBF16(g32[i])
				case adam.F16:
					gu[i] = adam.F32ToF16(g32[i])
				}
			}
		}()
	}
	wg.Wait()
	if gd == adam.F32 {
		return s, adam.GradF32(g32)
	}
	return s, adam.Grad16(gd, gu)
}

func sameValue(a, b float32) bool {
	return math.Float32bits(a) == math.Float32bits(b) || (a != a && b != b)
}

// compare runs one step on the CPU (adam.Pool) and on the GPU (with the
// device buffers offset by off elements, to exercise the unaligned path)
// and reports mismatches.
func compare(t *testing.T, e *env, n, off int, gd, od adam.DType, h adam.Hyper, unscale, clip float32, seed uint64) {
	t.Helper()
	s, g := problem(n, gd, h.AMSGrad, seed)
	c := h.Coeffs(7, unscale, clip)
	gpuState := s.Clone()
	var out, gpuOut adam.Copy16
	if od != 0 {
		out = adam.Copy16{DType: od, Data: make([]uint16, n)}
		gpuOut = adam.Copy16{DType: od, Data: make([]uint16, n)}
	}
	pool := adam.NewPool(0)
	pool.Step(&c, s, g, out)
	pool.Close()
	if err := offsetStep(e, &c, gpuState, g, gpuOut, int64(off)); err != nil {
		t.Fatal(err)
	}
	bad := 0
	for _, x := range []struct {
		name      string
		cpu, gpu_ []float32
	}{{"param", s.Param, gpuState.Param}, {"exp_avg", s.ExpAvg, gpuState.ExpAvg}, {"exp_avg_sq", s.ExpAvgSq, gpuState.ExpAvgSq}, {"max_exp_avg_sq", s.MaxExpAvgSq, gpuState.MaxExpAvgSq}} {
		for i := range x.cpu {
			if !sameValue(x.cpu[i], x.gpu_[i]) {
				if bad < 5 {
					t.Errorf("%s[%d]: CPU %g (%#08x), GPU %g (%#08x)", x.name, i, x.cpu[i], math.Float32bits(x.cpu[i]), x.gpu_[i], math.Float32bits(x.gpu_[i]))
				}
				bad++
			}
		}
	}
	nanMasters := 0
	for i := range s.Param {
		if s.Param[i] != s.Param[i] {
			nanMasters++
		}
	}
	for i := range out.Data {
		// Where both masters are NaN, both copies must be NaN: which NaN is
		// open (the GPU's arithmetic makes the canonical 0x7fffffff).
		if out.Data[i] != gpuOut.Data[i] && !(isNaN16(od, out.Data[i]) && isNaN16(od, gpuOut.Data[i]) && s.Param[i] != s.Param[i]) {
			if bad < 5 {
				t.Errorf("copy[%d]: CPU %#04x, GPU %#04x (master %g)", i, out.Data[i], gpuOut.Data[i], s.Param[i])
			}
			bad++
		}
	}
	if bad > 0 {
		t.Fatalf("%d elements differ", bad)
	}
	if n >= 1<<20 {
		t.Logf("n=%d: p, m, v%s bitwise equal to the CPU's (%d NaN masters, from Inf gradients, equal as NaN)",
			n, map[bool]string{true: " and the 16-bit copy", false: ""}[od != 0], nanMasters)
	}
}

// isNaN16 reports whether h is a NaN of the 16-bit dtype d.
func isNaN16(d adam.DType, h uint16) bool {
	if d == adam.BF16 {
		return h&0x7f80 == 0x7f80 && h&0x7f != 0
	}
	return h&0x7c00 == 0x7c00 && h&0x3ff != 0
}

// offsetStep is CaseBackend.Step with every device array placed off
// elements into a larger buffer.
func offsetStep(e *env, c *adam.Coeffs, s adam.State, g adam.Grad, out adam.Copy16, off int64) error {
	n := int64(len(s.Param))
	var bufs []*cuda.Buffer
	defer func() {
		for _, b := range bufs {
			b.Free()
		}
	}()
	place := func(raw []byte, elem int64) (Vec, error) {
		if raw == nil {
			return Vec{}, nil
		}
		padded := make([]byte, int64(len(raw))+elem*off)
		copy(padded[elem*off:], raw)
		b, err := e.b.put(padded)
		if err != nil {
			return Vec{}, err
		}
		bufs = append(bufs, b)
		return Vec{Buf: b, Off: off, N: n}, nil
	}
	var st State
	var err error
	for _, x := range []struct {
		dst *Vec
		src []float32
	}{{&st.Param, s.Param}, {&st.ExpAvg, s.ExpAvg}, {&st.ExpAvgSq, s.ExpAvgSq}, {&st.MaxExpAvgSq, s.MaxExpAvgSq}} {
		if *x.dst, err = place(bytesOf32(x.src), 4); err != nil {
			return err
		}
	}
	dg := Grad{DType: g.DType}
	if g.DType == adam.F32 {
		dg.Vec, err = place(bytesOf32(g.F32), 4)
	} else {
		dg.Vec, err = place(bytesOf16(g.U16), 2)
	}
	if err != nil {
		return err
	}
	var dout Copy16
	if out.DType != 0 {
		dout.DType = out.DType
		if dout.Vec, err = place(bytesOf16(out.Data), 2); err != nil {
			return err
		}
	}
	if err := e.k.AdamW(e.s, c, st, dg, dout); err != nil {
		return err
	}
	fetch := func(dst []byte, v Vec, elem int64) error {
		if v.Buf == nil {
			return nil
		}
		tmp := make([]byte, v.Buf.Len())
		if err := e.b.get(tmp, v.Buf); err != nil {
			return err
		}
		copy(dst, tmp[elem*off:])
		return nil
	}
	for _, x := range []struct {
		dst []byte
		v   Vec
	}{{bytesOf32(s.Param), st.Param}, {bytesOf32(s.ExpAvg), st.ExpAvg}, {bytesOf32(s.ExpAvgSq), st.ExpAvgSq}, {bytesOf32(s.MaxExpAvgSq), st.MaxExpAvgSq}} {
		if err := fetch(x.dst, x.v, 4); err != nil {
			return err
		}
	}
	return fetch(bytesOf16(out.Data), dout.Vec, 2)
}

var dtypes = []adam.DType{adam.F32, adam.BF16, adam.F16}

// TestAdamWMatchesCPU: every gradient and copy dtype, both modes, amsgrad,
// maximize, unscale and clip, aligned and unaligned, sizes around the
// vector width: bitwise the CPU result.
func TestAdamWMatchesCPU(t *testing.T) {
	e := gpu(t)
	variants := []struct {
		mode           adam.Mode
		amsgrad, maxim bool
		wd, beta1      float64
		unscale, clip  float32
	}{
		{adam.AdamW, false, false, 0.01, 0.9, 1, 1},
		{adam.Adam, true, false, 0.1, 0.9, 1.0 / 1024, 0.5},
		{adam.AdamW, true, true, 0.01, 0.3, 1, 0.25},
	}
	for _, gd := range dtypes {
		for _, od := range []adam.DType{0, adam.BF16, adam.F16} {
			for vi, v := range variants {
				for _, n := range []int{1, 3, 4, 5, 1023, 4099, 1<<20 + 3} {
					for _, off := range []int{0, 1} {
						t.Run(fmt.Sprintf("grad=%v/copy=%v/variant=%d/n=%d/off=%d", gd, od, vi, n, off), func(t *testing.T) {
							h := adam.DefaultHyper()
							h.Mode, h.AMSGrad, h.Maximize, h.WeightDecay, h.Betas[0] = v.mode, v.amsgrad, v.maxim, v.wd, v.beta1
							compare(t, e, n, off, gd, od, h, v.unscale, v.clip, uint64(n+vi))
						})
					}
				}
			}
		}
	}
}

// TestLarge: 10^8 random elements per gradient and copy dtype pair, GPU
// against CPU. Set DOS_KERNELS_LARGE=0 to skip.
func TestLarge(t *testing.T) {
	e := gpu(t)
	if os.Getenv("DOS_KERNELS_LARGE") == "0" {
		t.Skip("DOS_KERNELS_LARGE=0")
	}
	for _, gd := range dtypes {
		for _, od := range []adam.DType{0, adam.BF16, adam.F16} {
			t.Run(fmt.Sprintf("grad=%v/copy=%v/n=1e8", gd, od), func(t *testing.T) {
				compare(t, e, 100_000_000, 0, gd, od, adam.DefaultHyper(), 1.0/65536, 0.75, 42)
			})
		}
	}
}

// TestGradStats: the non-finite flag equals the CPU's, at every position of
// a small gradient and for every dtype; the sum of squares and each
// block's partial sum are the CPU's bit for bit (adam.Path.GradStats and
// GradPartials, on the generic and the SIMD path), at sizes that end inside
// a block, inside a thread block of 16 and past several, with an unscale
// that rounds.
func TestGradStats(t *testing.T) {
	e := gpu(t)
	for _, gd := range dtypes {
		for _, n := range []int{1, 100, StatsChunk + 7, 16*StatsChunk + 5, 37*StatsChunk - 3, 5 << 20} {
			for _, unscale := range []float32{0.5, 1.0 / 3} {
				_, g := problem(n, gd, false, uint64(n))
				okCPU, want := adam.Generic.GradStats(g, unscale)
				if ok, simd := adam.DefaultPath.GradStats(g, unscale); ok != okCPU || simd != want {
					t.Fatalf("%v n=%d: the CPU's paths differ: %v %v and %v %v", gd, n, okCPU, want, ok, simd)
				}
				wantP := make([]float64, (n+StatsChunk-1)/StatsChunk)
				adam.Generic.GradPartials(g, unscale, wantP)
				dg, free, err := e.b.upload16or32(g)
				if err != nil {
					t.Fatal(err)
				}
				ok, got, err := e.k.GradStats(e.s, dg, unscale)
				gotP := make([]float64, len(wantP)+1)
				okP, errP := e.k.GradPartials(e.s, dg, unscale, gotP)
				_, errShort := e.k.GradPartials(e.s, dg, unscale, gotP[:len(wantP)-1])
				free()
				if err != nil || ok != okCPU || got != want {
					t.Fatalf("%v n=%d unscale %g: GPU %v %v (%x) %v, CPU %v %v (%x)", gd, n, unscale, ok, got, math.Float64bits(got), err, okCPU, want, math.Float64bits(want))
				}
				if errP != nil || okP != okCPU {
					t.Fatalf("%v n=%d: GradPartials %v %v", gd, n, okP, errP)
				}
				for b := range wantP {
					if gotP[b] != wantP[b] {
						t.Fatalf("%v n=%d: partial %d: GPU %v, CPU %v", gd, n, b, gotP[b], wantP[b])
					}
				}
				if errShort == nil {
					t.Fatalf("%v n=%d: GradPartials into %d partials for %d blocks: no error", gd, n, len(wantP)-1, len(wantP))
				}
			}
		}
		for at := range 40 {
			_, g := problem(40, gd, false, 1)
			bad := []float32{float32(math.Inf(1)), float32(math.Inf(-1)), float32(math.NaN())}[at%3]
			switch gd {
			case adam.F32:
				g.F32[at] = bad
			case adam.BF16:
				g.U16[at] = adam.F32ToBF16(bad)
			case adam.F16:
				g.U16[at] = adam.F32ToF16(bad)
			}
			ok, err := e.b.AllFinite(g)
			if err != nil || ok {
				t.Fatalf("%v: %g at %d not found (%v)", gd, bad, at, err)
			}
		}
	}
}

// TestGradPartialsTo: the enqueued partial sums land in device memory at
// the offset asked, the CPU's bits; the non-finite flag is set by a
// gradient with a NaN and is never cleared by a finite one after it; a
// short destination is refused.
func TestGradPartialsTo(t *testing.T) {
	e := gpu(t)
	for _, gd := range dtypes {
		n := 5*StatsChunk + 11
		_, g := problem(n, gd, false, 9)
		if gd == adam.F16 {
			// problem's rare 3e38 is Inf in float16: 1 instead, so that
			// the gradient is finite (the NaN case is below).
			for i, u := range g.U16 {
				if u&0x7c00 == 0x7c00 {
					g.U16[i] = 0x3c00
				}
			}
		}
		want := make([]float64, (n+StatsChunk-1)/StatsChunk)
		okCPU := adam.Generic.GradPartials(g, 0.5, want)
		dg, free, err := e.b.upload16or32(g)
		if err != nil {
			t.Fatal(err)
		}
		const at = 3 // partials from element 3 of dst, the flag at element 1 of flag
		dst, err := e.d.Alloc(8 * int64(len(want)+at))
		if err != nil {
			t.Fatal(err)
		}
		flag, err := e.d.Alloc(8)
		if err != nil {
			t.Fatal(err)
		}
		if err := e.s.Memset(flag, 0, 8, 0); err != nil {
			t.Fatal(err)
		}
		dv, fv := Vec{Buf: dst, Off: at, N: int64(len(want))}, Vec{Buf: flag, Off: 1, N: 1}
		if err := e.k.GradPartialsTo(e.s, dg, 0.5, dv, fv); err != nil {
			t.Fatal(err)
		}
		got := make([]float64, len(want)+at)
		if err := e.b.get(unsafe.Slice((*byte)(unsafe.Pointer(&got[0])), 8*len(got)), dst); err != nil {
			t.Fatal(err)
		}
		fl := make([]int32, 2)
		if err := e.b.get(unsafe.Slice((*byte)(unsafe.Pointer(&fl[0])), 8), flag); err != nil {
			t.Fatal(err)
		}
		if !okCPU || fl[0] != 0 || fl[1] != 0 {
			t.Fatalf("%v: finite gradient: CPU finite %v, flags %v", gd, okCPU, fl)
		}
		for b := range want {
			if math.Float64bits(got[at+b]) != math.Float64bits(want[b]) {
				t.Fatalf("%v: partial %d: GPU %v, CPU %v", gd, b, got[at+b], want[b])
			}
		}
		if err := e.k.GradPartialsTo(e.s, dg, 0.5, Vec{Buf: dst, Off: at, N: int64(len(want)) - 1}, fv); err == nil {
			t.Fatalf("%v: %d partials for %d blocks: no error", gd, len(want)-1, len(want))
		}
		free()
		// A NaN sets the flag; a finite gradient after it leaves it set.
		_, bad := problem(100, gd, false, 10)
		if gd == adam.F32 {
			bad.F32[57] = float32(math.NaN())
		} else {
			bad.U16[57] = 0x7fc0 // a NaN in both 16-bit formats
		}
		db, freeBad, err := e.b.upload16or32(bad)
		if err != nil {
			t.Fatal(err)
		}
		_, fine := problem(100, gd, false, 11)
		df, freeFine, err := e.b.upload16or32(fine)
		if err != nil {
			t.Fatal(err)
		}
		if err := errors.Join(e.k.GradPartialsTo(e.s, db, 1, dv, fv), e.k.GradPartialsTo(e.s, df, 1, dv, fv)); err != nil {
			t.Fatal(err)
		}
		if err := e.b.get(unsafe.Slice((*byte)(unsafe.Pointer(&fl[0])), 8), flag); err != nil {
			t.Fatal(err)
		}
		if fl[0] != 0 || fl[1] != 1 {
			t.Fatalf("%v: flags after a NaN then a finite gradient: %v, want [0 1]", gd, fl)
		}
		freeBad()
		freeFine()
		dst.Free()
		flag.Free()
	}
}

// TestCasts: Widen16 on all 2^16 inputs and Round16 on random bit patterns
// and specials equal the CPU conversions bit for bit.
func TestCasts(t *testing.T) {
	e := gpu(t)
	all := make([]uint16, 1<<16)
	for i := range all {
		all[i] = uint16(i)
	}
	r := rand.New(rand.NewPCG(3, 3))
	src := make([]float32, 1<<20)
	for i := range src {
		src[i] = math.Float32frombits(r.Uint32())
	}
	for _, d := range []adam.DType{adam.BF16, adam.F16} {
		in, _ := e.b.put(bytesOf16(all))
		out, _ := e.d.Alloc(4 << 16)
		if err := e.k.Widen16(e.s, d, Vec{Buf: out, N: 1 << 16}, Vec{Buf: in, N: 1 << 16}); err != nil {
			t.Fatal(err)
		}
		got := make([]float32, 1<<16)
		if err := e.b.get(bytesOf32(got), out); err != nil {
			t.Fatal(err)
		}
		want := make([]float32, 1<<16)
		adam.Generic.Widen16(d, want, all)
		for i := range got {
			if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
				t.Fatalf("Widen16 %v %#04x: GPU %#08x, CPU %#08x", d, i, math.Float32bits(got[i]), math.Float32bits(want[i]))
			}
		}
		in.Free()
		out.Free()
		in, _ = e.b.put(bytesOf32(src))
		out, _ = e.d.Alloc(int64(2 * len(src)))
		if err := e.k.Round16(e.s, d, Vec{Buf: out, N: int64(len(src))}, Vec{Buf: in, N: int64(len(src))}); err != nil {
			t.Fatal(err)
		}
		got16 := make([]uint16, len(src))
		if err := e.b.get(bytesOf16(got16), out); err != nil {
			t.Fatal(err)
		}
		want16 := make([]uint16, len(src))
		adam.Generic.Round16(d, want16, src)
		for i := range got16 {
			if got16[i] != want16[i] {
				t.Fatalf("Round16 %v %#08x: GPU %#04x, CPU %#04x", d, math.Float32bits(src[i]), got16[i], want16[i])
			}
		}
		in.Free()
		out.Free()
	}
}

// TestMulti: 128 tensors of assorted sizes in one launch equal 128 CPU
// steps.
func TestMulti(t *testing.T) {
	e := gpu(t)
	for _, gd := range dtypes {
		for _, od := range []adam.DType{0, adam.BF16} {
			h := adam.DefaultHyper()
			h.AMSGrad = gd == adam.F16
			c := h.Coeffs(3, 0.5, 1)
			r := rand.New(rand.NewPCG(9, 9))
			var tensors []Tensor
			var cpu []adam.State
			var gpuSide []adam.State
			var outs [][]uint16
			var cpuOuts [][]uint16
			var bufs []*cuda.Buffer
			for i := range 128 {
				n := 1 + r.IntN(200000)
				s, g := problem(n, gd, h.AMSGrad, uint64(i))
				var out adam.Copy16
				if od != 0 {
					out = adam.Copy16{DType: od, Data: make([]uint16, n)}
				}
				gs := s.Clone()
				adam.Generic.Step(&c, s, g, out)
				cpu = append(cpu, s)
				cpuOuts = append(cpuOuts, out.Data)
				gpuSide = append(gpuSide, gs)
				var tt Tensor
				up := func(raw []byte) Vec {
					b, err := e.b.put(raw)
					if err != nil {
						t.Fatal(err)
					}
					bufs = append(bufs, b)
					return Vec{Buf: b, N: int64(n)}
				}
				tt.Param, tt.ExpAvg, tt.ExpAvgSq = up(bytesOf32(gs.Param)), up(bytesOf32(gs.ExpAvg)), up(bytesOf32(gs.ExpAvgSq))
				if h.AMSGrad {
					tt.MaxExpAvgSq = up(bytesOf32(gs.MaxExpAvgSq))
				}
				if gd == adam.F32 {
					tt.Grad = up(bytesOf32(g.F32))
				} else {
					tt.Grad = up(bytesOf16(g.U16))
				}
				o := make([]uint16, n)
				outs = append(outs, o)
				if od != 0 {
					tt.Copy16 = up(bytesOf16(o))
				}
				tensors = append(tensors, tt)
			}
			if err := e.k.AdamWMulti(e.s, &c, tensors, gd, od); err != nil {
				t.Fatal(err)
			}
			for i, tt := range tensors {
				gs := gpuSide[i]
				for _, x := range []struct {
					dst []float32
					v   Vec
				}{{gs.Param, tt.Param}, {gs.ExpAvg, tt.ExpAvg}, {gs.ExpAvgSq, tt.ExpAvgSq}, {gs.MaxExpAvgSq, tt.MaxExpAvgSq}} {
					if x.v.Buf != nil {
						if err := e.b.get(bytesOf32(x.dst), x.v.Buf); err != nil {
							t.Fatal(err)
						}
					}
				}
				if od != 0 {
					if err := e.b.get(bytesOf16(outs[i]), tt.Copy16.Buf); err != nil {
						t.Fatal(err)
					}
				}
				for j := range gs.Param {
					if !sameValue(gs.Param[j], cpu[i].Param[j]) || !sameValue(gs.ExpAvg[j], cpu[i].ExpAvg[j]) || !sameValue(gs.ExpAvgSq[j], cpu[i].ExpAvgSq[j]) {
						t.Fatalf("grad=%v copy=%v tensor %d element %d differs", gd, od, i, j)
					}
					if od != 0 && outs[i][j] != cpuOuts[i][j] && !(isNaN16(od, outs[i][j]) && isNaN16(od, cpuOuts[i][j])) {
						t.Fatalf("grad=%v copy=%v tensor %d copy %d differs", gd, od, i, j)
					}
				}
			}
			for _, b := range bufs {
				b.Free()
			}
		}
	}
}

// TestErrors: misuse comes back as errors naming what is wrong.
func TestErrors(t *testing.T) {
	e := gpu(t)
	b, _ := e.d.Alloc(4096)
	v := Vec{Buf: b, N: 256}
	st := State{Param: v, ExpAvg: v, ExpAvgSq: v}
	c := adam.DefaultHyper().Coeffs(1, 1, 1)
	if err := e.k.AdamW(e.s, &c, st, Grad{DType: adam.F32, Vec: Vec{Buf: b, N: 255}}, Copy16{}); err == nil {
		t.Error("length mismatch accepted")
	}
	if err := e.k.AdamW(e.s, &c, st, Grad{DType: adam.F32, Vec: Vec{Buf: b, Off: 900, N: 256}}, Copy16{}); err == nil {
		t.Error("range past the buffer accepted")
	}
	c.AMSGrad = true
	if err := e.k.AdamW(e.s, &c, st, Grad{DType: adam.F32, Vec: v}, Copy16{}); err == nil {
		t.Error("amsgrad without max_exp_avg_sq accepted")
	}
	c.AMSGrad = false
	b.Free()
	err := e.k.AdamW(e.s, &c, st, Grad{DType: adam.F32, Vec: v}, Copy16{})
	if !errors.Is(err, cuda.ErrFreed) {
		t.Errorf("launch on a freed buffer: %v", err)
	}
	t.Logf("launch on a freed buffer: %v", err)
	if err := e.s.Sync(); err != nil {
		t.Fatalf("stream unusable after refused launches: %v", err)
	}
}

// TestVecCheck runs everywhere: element counts that would overflow the
// byte arithmetic are refused.
func TestVecCheck(t *testing.T) {
	var b cuda.Buffer // zero bytes
	for _, v := range []Vec{{Buf: &b, N: 1 << 62}, {Buf: &b, N: 1<<62 + 1}, {Buf: &b, Off: 1 << 62, N: 1 << 62}, {Buf: &b, Off: -1}} {
		for _, elem := range []int64{2, 4} {
			if err := v.check("x", elem, v.N); err == nil {
				t.Errorf("Vec{Off %d, N %d} (%d-byte elements) accepted over a 0-byte buffer", v.Off, v.N, elem)
			}
		}
	}
	p := PTX()
	p[0] = 'X'
	if Stamp() == "" {
		t.Error("PTX() returned the embedded bytes themselves")
	}
}
