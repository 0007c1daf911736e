package scheduler

import (
	"errors"
	"math"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// TestEngineHeldPartials (heldPatterns 1, 3 and 5 have blocks wholly
// inside a held range, 2 and 4 none): the global checks' sums of host-held gradients
// taken on the device (HeldPartials, the ranges cut where a trainer's
// tensors would be) give Stats the bits it computes on the host alone, on
// every pattern of held subgroups; with a device copy that differs from
// HostGrad (zeros, a NaN) Stats shows that it took each block wholly inside
// a range from the device and every other block from the host; sums of
// another unscale are not used; ZeroGrad forgets them; a range that leaves
// a held run, and a second unscale, are refused.
func TestEngineHeldPartials(t *testing.T) { forDevices(t, testEngineHeldPartials) }

func testEngineHeldPartials(t *testing.T, newDev func() Device) {
	const mc = adam.MinChunk
	for pi, held := range heldPatterns {
		if countHeld(held) == 0 {
			continue
		}
		d := newDev()
		p := heldProblem(adam.BF16, 1, uint64(pi)+5, -1)
		e := setupHeld(t, d, p, held, perfmodel.Schedule{CPU: len(held) - countHeld(held)}, nil, false)
		n := e.total
		r := rand.New(rand.NewPCG(uint64(pi), 9))
		g := make([]uint16, n)
		for i := range g {
			g[i] = adam.F32ToBF16(float32(r.NormFloat64()))
		}
		if err := e.SetGrad(adam.Grad16(adam.BF16, g)); err != nil {
			t.Fatal(err)
		}
		okRef, ref := adam.Generic.GradStats(adam.Grad16(adam.BF16, g), 1)
		if ok, sum, err := e.Stats(1); err != nil || ok != okRef || sum != ref {
			t.Fatalf("pattern %d: Stats on the host %v %v %v, the flat sum %v %v", pi, ok, sum, err, okRef, ref)
		}
		dg, s := deviceCopy(t, d, n)
		// ranges cuts each held run in two at an odd element, as a
		// trainer's tensors would, and calls HeldPartials on each piece;
		// inside[b] marks the blocks wholly inside a piece.
		inside := make([]bool, (n+mc-1)/mc)
		ranges := func(unscale float32) {
			t.Helper()
			for _, sg := range e.segs {
				if !sg.held {
					continue
				}
				cut := sg.off + sg.n/2 + 1
				for _, pc := range [][2]int64{{sg.off, cut}, {cut, sg.off + sg.n}} {
					if err := e.HeldPartials(s, pc[0], Vec{Mem: dg, Off: pc[0], N: pc[1] - pc[0]}, unscale); err != nil {
						t.Fatal(err)
					}
					lo, hi := (pc[0]+mc-1)/mc*mc, pc[1]/mc*mc
					if pc[1] == n {
						hi = n
					}
					for b := lo / mc; b*mc < hi; b++ {
						inside[b] = true
					}
				}
			}
		}
		// The device copy is HostGrad's: the same bits.
		gb := unsafe.Slice((*byte)(unsafe.Pointer(&g[0])), 2*n)
		put(t, d, dg, 0, gb)
		ranges(1)
		if ok, sum, err := e.Stats(1); err != nil || ok != okRef || sum != ref {
			t.Fatalf("pattern %d: Stats with the device's sums %v %v (%x) %v, want %v %v (%x)", pi, ok, sum, math.Float64bits(sum), err, okRef, ref, math.Float64bits(ref))
		}
		// A zero device copy: the blocks inside a range count zero, the
		// others what HostGrad holds.
		put(t, d, dg, 0, make([]byte, 2*n))
		clear(inside)
		ranges(1)
		want := append([]uint16(nil), g...)
		used := 0
		for b, in := range inside {
			if in {
				clear(want[int64(b)*mc : min(int64(b+1)*mc, n)])
				used++
			}
		}
		_, wantSum := adam.Generic.GradStats(adam.Grad16(adam.BF16, want), 1)
		if ok, sum, err := e.Stats(1); err != nil || !ok || sum != wantSum || (used > 0) == (sum == ref) {
			t.Fatalf("pattern %d: zero device copy over %d blocks: Stats %v %v %v, want true %v (not %v)", pi, used, ok, sum, err, wantSum, ref)
		}
		// Sums of another unscale are not used.
		ranges(1)
		okHalf, refHalf := adam.Generic.GradStats(adam.Grad16(adam.BF16, g), 0.5)
		if ok, sum, err := e.Stats(0.5); err != nil || ok != okHalf || sum != refHalf {
			t.Fatalf("pattern %d: sums of unscale 1, Stats(0.5) %v %v %v, want %v %v", pi, ok, sum, err, okHalf, refHalf)
		}
		// A NaN in the device copy inside a range is seen; the same NaN
		// outside every range is not (HostGrad is finite).
		for b, in := range inside {
			nan := make([]byte, 2)
			*(*uint16)(unsafe.Pointer(&nan[0])) = 0x7fc0
			put(t, d, dg, 0, gb)
			put(t, d, dg, 2*int64(b)*mc, nan)
			ranges(1)
			if ok, _, err := e.Stats(1); err != nil || ok == in {
				t.Fatalf("pattern %d: a NaN in the device copy at block %d (inside a range: %v): finite %v, %v", pi, b, in, ok, err)
			}
		}
		// ZeroGrad forgets the sums.
		ranges(1)
		if err := e.ZeroGrad(); err != nil {
			t.Fatal(err)
		}
		if ok, sum, err := e.Stats(1); err != nil || !ok || sum != 0 {
			t.Fatalf("pattern %d: after ZeroGrad, Stats %v %v %v; want true 0", pi, ok, sum, err)
		}
		// Refusals.
		for _, sg := range e.segs {
			if sg.held && sg.off+sg.n < n {
				if err := e.HeldPartials(s, sg.off, Vec{Mem: dg, Off: sg.off, N: sg.n + 1}, 1); err == nil {
					t.Errorf("pattern %d: a range one past its held run: no error", pi)
				}
			}
			if !sg.held {
				if err := e.HeldPartials(s, sg.off, Vec{Mem: dg, Off: sg.off, N: 1}, 1); err == nil {
					t.Errorf("pattern %d: a range on the device's gradients: no error", pi)
				}
			}
		}
		for _, sg := range e.segs {
			if !sg.held || (sg.off+mc-1)/mc*mc+mc > sg.off+sg.n {
				continue // no sum to take: nothing to differ from
			}
			if err := e.HeldPartials(s, sg.off, Vec{Mem: dg, Off: sg.off, N: sg.n}, 1); err != nil {
				t.Fatal(err)
			}
			if err := e.HeldPartials(s, sg.off, Vec{Mem: dg, Off: sg.off, N: sg.n}, 2); err == nil {
				t.Errorf("pattern %d: a second unscale before Stats: no error", pi)
			}
			break
		}
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
		if err := firstErr(d.FreeStream(s), d.FreeMem(dg)); err != nil {
			t.Fatal(err)
		}
	}
}

// TestEngineHeldPartialsNoMemory: a device with no memory left for the
// sums when HeldPartials first needs it (a run at its cap) is no error:
// no sums are taken, then or later, Stats sums on the host with the same
// bits, and nothing leaks.
func TestEngineHeldPartialsNoMemory(t *testing.T) {
	d := NewSim(SimOptions{Capacity: 64 << 20})
	held := heldPatterns[5] // every subgroup held: one run over all blocks
	p := heldProblem(adam.BF16, 1, 3, -1)
	e := setupHeld(t, d, p, held, perfmodel.Schedule{}, nil, false)
	n := e.total
	dg, s := deviceCopy(t, d, n)
	fill, err := d.Alloc(64<<20 - d.Used()) // the device is full
	if err != nil {
		t.Fatal(err)
	}
	g := make([]uint16, n)
	for i := range g {
		g[i] = adam.F32ToBF16(float32(i%97) - 48)
	}
	if err := e.SetGrad(adam.Grad16(adam.BF16, g)); err != nil {
		t.Fatal(err)
	}
	put(t, d, dg, 0, make([]byte, 2*n)) // zeros: a sum taken from them would show
	okRef, ref := adam.Generic.GradStats(adam.Grad16(adam.BF16, g), 1)
	for range 2 {
		if err := e.HeldPartials(s, 0, Vec{Mem: dg, N: n}, 1); err != nil {
			t.Fatalf("HeldPartials with the device full: %v", err)
		}
		if ok, sum, err := e.Stats(1); err != nil || ok != okRef || sum != ref {
			t.Fatalf("Stats %v %v %v, want the host's %v %v", ok, sum, err, okRef, ref)
		}
	}
	if err := firstErr(d.FreeMem(fill), e.Close(), d.FreeMem(dg), d.FreeStream(s)); err != nil {
		t.Fatal(err)
	}
	if u := d.Used(); u != 0 {
		t.Errorf("%d bytes of device memory in use after Close", u)
	}
}

// TestEngineHeldPartialsOrder: calls on two streams before one Stats are
// ordered (the Sim's check passes) and give the host's bits; an Update
// without Stats forgets the sums, so the next gradients, written into
// HostGrad, are summed as they are; after Close HeldPartials says
// ErrEngineClosed.
func TestEngineHeldPartialsOrder(t *testing.T) {
	d := NewSim(SimOptions{})
	p := heldProblem(adam.BF16, 1, 4, -1)
	e := setupHeld(t, d, p, heldPatterns[5], perfmodel.Schedule{}, nil, false) // all held: HostGrad is the flat gradient
	n := e.total
	dg, s0 := deviceCopy(t, d, n)
	s1, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	st := [2]Stream{s0, s1}
	g := make([]uint16, n)
	for i := range g {
		g[i] = adam.F32ToBF16(float32(i%101) - 50)
	}
	gb := unsafe.Slice((*byte)(unsafe.Pointer(&g[0])), 2*n)
	if err := e.SetGrad(adam.Grad16(adam.BF16, g)); err != nil {
		t.Fatal(err)
	}
	put(t, d, dg, 0, gb)
	half := n / 2
	if err := firstErr(e.HeldPartials(st[0], 0, Vec{Mem: dg, N: half}, 1), e.HeldPartials(st[1], half, Vec{Mem: dg, Off: half, N: n - half}, 1)); err != nil {
		t.Fatal(err)
	}
	okRef, ref := adam.Generic.GradStats(adam.Grad16(adam.BF16, g), 1)
	if ok, sum, err := e.Stats(1); err != nil || ok != okRef || sum != ref {
		t.Fatalf("two streams: Stats %v %v %v, want %v %v", ok, sum, err, okRef, ref)
	}
	if err := d.OrderErr(); err != nil {
		t.Fatalf("two streams: %v", err)
	}
	// Sums of zeros, then an Update without Stats, then new gradients.
	put(t, d, dg, 0, make([]byte, 2*n))
	if err := e.HeldPartials(st[0], 0, Vec{Mem: dg, N: n}, 1); err != nil {
		t.Fatal(err)
	}
	c := adam.DefaultHyper().Coeffs(1, 1, 1)
	if err := e.Update(&c); err != nil {
		t.Fatal(err)
	}
	for i := range g {
		g[i] = adam.F32ToBF16(float32(i%13) - 6)
	}
	copy(e.HostGrad().Bytes(), gb)
	okRef, ref = adam.Generic.GradStats(adam.Grad16(adam.BF16, g), 1)
	if ok, sum, err := e.Stats(1); err != nil || ok != okRef || sum != ref {
		t.Fatalf("after an Update without Stats: Stats %v %v %v, want the new gradients' %v %v", ok, sum, err, okRef, ref)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	if err := e.HeldPartials(st[0], 0, Vec{Mem: dg, N: n}, 1); !errors.Is(err, ErrEngineClosed) {
		t.Errorf("after Close: %v, want ErrEngineClosed", err)
	}
	if err := firstErr(d.FreeMem(dg), d.FreeStream(st[0]), d.FreeStream(st[1])); err != nil {
		t.Fatal(err)
	}
}

// deviceCopy allocates room for n bf16 gradients on d, where a trainer's
// slot would hold them, and a stream for HeldPartials; the caller frees
// both.
func deviceCopy(t *testing.T, d Device, n int64) (Mem, Stream) {
	t.Helper()
	dg, err := d.Alloc(2 * n)
	if err != nil {
		t.Fatal(err)
	}
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	return dg, s
}
