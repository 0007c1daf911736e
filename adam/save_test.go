package adam

import (
	"fmt"
	"testing"
)

// TestStepSaveRestore: StepSave's step is Pool.Step's bit for bit, what it
// saved is the state and working copy before the step, and Restore puts
// them back exactly, at sizes around the chunk boundaries, with and
// without amsgrad and a working copy.
func TestStepSaveRestore(t *testing.T) {
	pool := NewPool(4)
	defer pool.Close()
	h := DefaultHyper()
	for _, n := range []int{0, 1, 17, MinChunk - 1, MinChunk + 1, 3*MinChunk + 5, MaxChunk*3 + 7} {
		for _, amsgrad := range []bool{false, true} {
			for _, out := range []DType{0, BF16, F16} {
				t.Run(fmt.Sprintf("n=%d/amsgrad=%t/out=%v", n, amsgrad, out), func(t *testing.T) {
					hh := h
					hh.AMSGrad = amsgrad
					s, g := randomProblem(n, BF16, amsgrad, uint64(n)+3)
					before := s.Clone()
					ref := s.Clone()
					var o, oref Copy16
					var saveOut []uint16
					if out != 0 {
						o, oref = Copy16{out, make([]uint16, n)}, Copy16{out, make([]uint16, n)}
						for i := range n {
							o.Data[i] = uint16(i * 7)
							oref.Data[i] = uint16(i * 7)
						}
						saveOut = make([]uint16, n)
					}
					save := State{Param: make([]float32, n), ExpAvg: make([]float32, n), ExpAvgSq: make([]float32, n)}
					if amsgrad {
						save.MaxExpAvgSq = make([]float32, n)
					}
					c := hh.Coeffs(4, 0.5, 1)
					pool.Step(&c, ref, g, oref)
					pool.StepSave(&c, s, g, o, save, saveOut)
					sameStateBits(t, "", ref, s, amsgrad)
					sameStateBits(t, "saved ", before, save, amsgrad)
					for i := range o.Data {
						if o.Data[i] != oref.Data[i] || saveOut[i] != uint16(i*7) {
							t.Fatalf("copy[%d] = %#x (want %#x), saved %#x (want %#x)", i, o.Data[i], oref.Data[i], saveOut[i], uint16(i*7))
						}
					}
					if n > 0 && out != 0 && ref.Param[0] == before.Param[0] {
						t.Fatal("the step changed nothing: the test proves nothing")
					}
					pool.Restore(s, o.Data, save, saveOut)
					sameStateBits(t, "restored ", before, s, amsgrad)
					for i := range o.Data {
						if o.Data[i] != uint16(i*7) {
							t.Fatalf("restored copy[%d] = %#x, want %#x", i, o.Data[i], uint16(i*7))
						}
					}
				})
			}
		}
	}
}

// TestStepSaveOutNotSaved: a working copy written but not saved (saveOut
// empty: the scheduler's CPU subgroups write their new copy into a buffer
// of their own) is written as Step writes it, and Restore with no working
// copy restores the state alone.
func TestStepSaveOutNotSaved(t *testing.T) {
	pool := NewPool(4)
	defer pool.Close()
	n := 3*MinChunk + 5
	s, g := randomProblem(n, BF16, false, 21)
	before, ref := s.Clone(), s.Clone()
	out, oref := Copy16{BF16, make([]uint16, n)}, Copy16{BF16, make([]uint16, n)}
	save := State{Param: make([]float32, n), ExpAvg: make([]float32, n), ExpAvgSq: make([]float32, n)}
	c := DefaultHyper().Coeffs(2, 1, 1)
	pool.Step(&c, ref, g, oref)
	pool.StepSave(&c, s, g, out, save, nil)
	sameBits(t, "param", ref.Param, s.Param)
	for i := range out.Data {
		if out.Data[i] != oref.Data[i] {
			t.Fatalf("copy[%d] = %#x, want %#x", i, out.Data[i], oref.Data[i])
		}
	}
	pool.Restore(s, nil, save, nil)
	sameBits(t, "restored param", before.Param, s.Param)
	sameBits(t, "restored exp_avg", before.ExpAvg, s.ExpAvg)
	sameBits(t, "restored exp_avg_sq", before.ExpAvgSq, s.ExpAvgSq)
}

// TestStepSaveLengthsPanic: a save of another length panics before
// anything is written.
func TestStepSaveLengthsPanic(t *testing.T) {
	pool := NewPool(2)
	defer pool.Close()
	s, g := randomProblem(10, F32, false, 1)
	save := State{Param: make([]float32, 9), ExpAvg: make([]float32, 10), ExpAvgSq: make([]float32, 10)}
	c := DefaultHyper().Coeffs(1, 1, 1)
	before := s.Clone()
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("no panic for a save of 9 elements")
			}
		}()
		pool.StepSave(&c, s, g, Copy16{}, save, nil)
	}()
	sameBits(t, "param", before.Param, s.Param)
}

// TestCopyNT: Path.copyNT copies exactly src into dst on every path, for
// destinations at every alignment within a vector and lengths around the
// kernel's multiple, and writes nothing past dst.
func TestCopyNT(t *testing.T) {
	for _, path := range Paths() {
		for _, n := range []int{0, 1, 63, 64, 65, 127, 128, 200, 4096 + 3} {
			for off := range 17 {
				src := make([]float32, n)
				for i := range src {
					src[i] = float32(i) + 0.5
				}
				buf := make([]float32, off+n+40)
				for i := range buf {
					buf[i] = -1
				}
				path.copyNT(buf[off:off+n], src)
				for i, x := range buf {
					want := float32(-1)
					if i >= off && i < off+n {
						want = src[i-off]
					}
					if x != want {
						t.Fatalf("%s n=%d off=%d: buf[%d] = %v, want %v", path, n, off, i, x, want)
					}
				}
			}
		}
	}
}

// TestStepTo: StepTo writes Pool.Step's new state, bit for bit, into to
// and leaves s as it was, on every path, at sizes around the block and
// chunk boundaries, with and without amsgrad, a working copy and a
// gradient that needs scaling; with to = s it is Step.
func TestStepTo(t *testing.T) {
	h := DefaultHyper()
	for _, path := range Paths() {
		pool := NewPoolPath(3, path)
		for _, n := range []int{0, 1, 17, saveBlock - 1, saveBlock + 3, MinChunk + 1, 3*MinChunk + 5, MaxChunk*2 + 7} {
			for _, amsgrad := range []bool{false, true} {
				for _, gd := range []DType{BF16, F32} {
					for _, out := range []DType{0, BF16} {
						name := fmt.Sprintf("%s/n=%d/amsgrad=%t/grad=%v/out=%v", path, n, amsgrad, gd, out)
						hh := h
						hh.AMSGrad = amsgrad
						s, g := randomProblem(n, gd, amsgrad, uint64(n)+11)
						before, ref := s.Clone(), s.Clone()
						var o, oref Copy16
						if out != 0 {
							o, oref = Copy16{out, make([]uint16, n)}, Copy16{out, make([]uint16, n)}
						}
						to := State{Param: make([]float32, n), ExpAvg: make([]float32, n), ExpAvgSq: make([]float32, n)}
						if amsgrad {
							to.MaxExpAvgSq = make([]float32, n)
						}
						for _, clip := range []float32{1, 0.5} {
							c := hh.Coeffs(4, clip, 1)
							copyState(ref, before, nil, nil, 0, 0)
							pool.Step(&c, ref, g, oref)
							pool.StepTo(&c, s, g, o, to)
							what := fmt.Sprintf("%s/clip=%v", name, clip)
							sameStateBits(t, what+" ", ref, to, amsgrad)
							sameStateBits(t, what+" s's ", before, s, amsgrad)
							for i := range o.Data {
								if o.Data[i] != oref.Data[i] {
									t.Fatalf("%s: copy[%d] = %#x, want %#x", what, i, o.Data[i], oref.Data[i])
								}
							}
							if n > 0 && ref.Param[0] == before.Param[0] {
								t.Fatalf("%s: the step changed nothing: the test proves nothing", what)
							}
						}
						// In place: to = s.
						c := hh.Coeffs(5, 1, 1)
						copyState(ref, before, nil, nil, 0, 0)
						pool.Step(&c, ref, g, oref)
						pool.StepTo(&c, s, g, o, s)
						sameBits(t, name+" in place param", ref.Param, s.Param)
						sameBits(t, name+" in place exp_avg_sq", ref.ExpAvgSq, s.ExpAvgSq)
					}
				}
			}
		}
		pool.Close()
	}
}

// TestStepToAlignment: StepTo's results do not depend on where to's
// arrays start: aligned alike at any offset (a reference head, then the
// non-temporal kernel), or each at another offset (the reference
// throughout), on every path.
func TestStepToAlignment(t *testing.T) {
	const n = 3*block + 37
	for _, path := range Paths() {
		for _, offs := range [][3]int{{0, 0, 0}, {5, 5, 5}, {15, 15, 15}, {1, 2, 3}, {0, 8, 0}} {
			s, g := randomProblem(n, BF16, false, 7)
			ref := s.Clone()
			c := DefaultHyper().Coeffs(3, 0.75, 1)
			out, oref := Copy16{BF16, make([]uint16, n)}, Copy16{BF16, make([]uint16, n)}
			path.Step(&c, ref, g, oref)
			// One buffer, the arrays 1024 elements (a multiple of any
			// vector) apart: aligned alike exactly when their offsets are.
			all := make([]float32, 3*1024)
			buf := func(k, off int) []float32 { return all[k*1024+off : k*1024+off+n] }
			to := State{Param: buf(0, offs[0]), ExpAvg: buf(1, offs[1]), ExpAvgSq: buf(2, offs[2])}
			path.StepTo(&c, s, g, out, to)
			what := fmt.Sprintf("%s/offsets=%v", path, offs)
			sameStateBits(t, what+" ", ref, to, false)
			for i := range out.Data {
				if out.Data[i] != oref.Data[i] {
					t.Fatalf("%s: copy[%d] = %#x, want %#x", what, i, out.Data[i], oref.Data[i])
				}
			}
		}
	}
}
