package adam

import (
	"fmt"
	"math"
	"testing"
)

// TestStepSaveEveryPath: on every path (generic, AVX2, AVX-512) and thread
// count, StepSave on state, save and working-copy arrays that are
// sub-slices of larger arrays at odd offsets (so that Path.copyNT's
// unaligned head, its non-temporal body and its tail all run, at block
// and chunk boundaries) steps bit for bit as the generic Step does, saves
// the state's exact bits (NaN payloads, -0 and subnormals included),
// writes nothing around its arrays, and Restore puts everything back.
func TestStepSaveEveryPath(t *testing.T) {
	const guard, sentinel = 70, 0x7fc0dead
	// arrays returns n-element sub-slices at the offsets, each in a buffer
	// of sentinels, and a check that the sentinels are intact.
	arrays := func(n int, offs ...int) (s [][]float32, intact func() bool) {
		var bufs [][]float32
		for _, off := range offs {
			b := make([]float32, off+n+guard)
			for i := range b {
				b[i] = math.Float32frombits(sentinel)
			}
			bufs, s = append(bufs, b), append(s, b[off:off+n])
		}
		return s, func() bool {
			for k, b := range bufs {
				for i, x := range b {
					if (i < offs[k] || i >= offs[k]+n) && math.Float32bits(x) != sentinel {
						return false
					}
				}
			}
			return true
		}
	}
	ns := []int{0, 1, 63, 64, 65, 4097, 2*MinChunk + 3*saveBlock + 33}
	offsets := [][4]int{{0, 0, 0, 0}, {1, 2, 3, 5}, {13, 7, 6, 15}}
	ref := NewPoolPath(1, Generic)
	defer ref.Close()
	for _, path := range Paths() {
		for _, threads := range []int{1, 3} {
			pool := NewPoolPath(threads, path)
			for _, n := range ns {
				for oi, offs := range offsets {
					for _, amsgrad := range []bool{false, true} {
						for _, saved := range []bool{false, true} { // the working copy saved
							name := fmt.Sprintf("%s/threads=%d/n=%d/offsets=%v/amsgrad=%t/saveOut=%t", path, threads, n, offs, amsgrad, saved)
							h := DefaultHyper()
							h.AMSGrad = amsgrad
							base, g := randomProblem(n, BF16, amsgrad, uint64(n)*31+uint64(oi))
							for i := 0; i < n; i += 97 {
								base.Param[i] = math.Float32frombits(0x7f800001 + uint32(i)) // a signalling NaN's payload
								if i+1 < n {
									base.ExpAvg[i+1] = float32(math.Copysign(0, -1))
								}
								if i+2 < n {
									base.ExpAvgSq[i+2] = math.Float32frombits(1 + uint32(i)) // subnormal
								}
							}
							sa, sIntact := arrays(n, offs[0], offs[1], offs[2], offs[3])
							va, vIntact := arrays(n, offs[3], offs[0]+5, offs[1]+11, offs[2]+1)
							s := State{Param: sa[0], ExpAvg: sa[1], ExpAvgSq: sa[2]}
							save := State{Param: va[0], ExpAvg: va[1], ExpAvgSq: va[2]}
							copy(s.Param, base.Param)
							copy(s.ExpAvg, base.ExpAvg)
							copy(s.ExpAvgSq, base.ExpAvgSq)
							if amsgrad {
								s.MaxExpAvgSq, save.MaxExpAvgSq = sa[3], va[3]
								copy(s.MaxExpAvgSq, base.MaxExpAvgSq)
							}
							want := base.Clone()
							out := Copy16{BF16, make([]uint16, n+3)[3:]}
							outRef := Copy16{BF16, make([]uint16, n)}
							old := make([]uint16, n)
							for i := range n {
								out.Data[i], outRef.Data[i], old[i] = uint16(i*7+1), uint16(i*7+1), uint16(i*7+1)
							}
							var saveOut []uint16
							if saved {
								saveOut = make([]uint16, n+5)[1 : n+1]
							}
							c := h.Coeffs(4, 0.5, 1)
							ref.Step(&c, want, g, outRef)
							pool.StepSave(&c, s, g, out, save, saveOut)
							sameStateBits(t, name+": ", want, s, amsgrad)
							sameStateBits(t, name+": saved ", base, save, amsgrad)
							for i := range n {
								if out.Data[i] != outRef.Data[i] || saved && saveOut[i] != old[i] {
									t.Fatalf("%s: copy[%d] %#x (want %#x)", name, i, out.Data[i], outRef.Data[i])
								}
							}
							if !sIntact() || !vIntact() {
								t.Fatalf("%s: a write outside the arrays", name)
							}
							pool.Restore(s, out.Data, save, saveOut)
							sameStateBits(t, name+": restored ", base, s, amsgrad)
							for i := range n {
								if saved && out.Data[i] != old[i] {
									t.Fatalf("%s: restored copy[%d] %#x, want %#x", name, i, out.Data[i], old[i])
								}
							}
							if !sIntact() {
								t.Fatalf("%s: Restore wrote outside the arrays", name)
							}
						}
					}
				}
			}
			pool.Close()
		}
	}
}
