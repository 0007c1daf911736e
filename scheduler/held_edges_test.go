package scheduler

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// Edge cases of host-held subgroups found by an adversarial review: the
// MinChunk blocks cut every way, F16, AMSGrad, faults in the transfers.

// edgeSizes: MinChunk edge cases, each with host-held patterns.
var edgeSizes = []struct {
	sizes []int
	held  [][]bool
}{
	// three segments inside one block, a one-element held subgroup
	{[]int{100, 1, 200, 32768 - 301, 5}, [][]bool{{false, true, false, false, false}, {true, false, true, false, true}, {false, true, false, true, false}}},
	// whole flat space shorter than a block
	{[]int{10, 20, 30}, [][]bool{{false, true, false}, {true, false, false}, {false, false, true}, {true, false, true}}},
	// last block partial, held subgroup only in the partial tail
	{[]int{32768, 32768, 7}, [][]bool{{false, false, true}, {true, false, true}, {false, true, false}, {true, true, false}}},
	// one-element held at the very end and at the very start
	{[]int{1, 65535, 1}, [][]bool{{true, false, true}, {false, false, true}, {true, false, false}}},
	// many tiny subgroups alternating within two blocks
	{[]int{32760, 3, 3, 3, 3, 3, 3, 3, 3, 32760, 1}, [][]bool{
		{false, true, false, true, false, true, false, true, false, true, false},
		{true, false, true, false, true, false, true, false, true, false, true}}},
	// exact multiples, held blocks aligned
	{[]int{32768, 32768, 32768}, [][]bool{{false, true, false}, {true, false, true}}},
}

// TestHeldEdges: every edge case, pattern, gradient dtype, clipping on
// and off and schedule gives the whole flat update's state and working
// copy bitwise over three steps, with the simulated device's ordering
// check clean. (Under -race the F32 gradients only.)
func TestHeldEdges(t *testing.T) {
	saved := heldSizes
	defer func() { heldSizes = saved }()
	h := adam.DefaultHyper()
	for ci, c := range edgeSizes {
		heldSizes = c.sizes
		n := 0
		for _, s := range c.sizes {
			n += s
		}
		for hi, held := range c.held {
			dtypes := []adam.DType{adam.F32, adam.BF16, adam.F16}
			if raceEnabled {
				dtypes = dtypes[:1]
			}
			for _, gd := range dtypes {
				p := newProblem(n, gd, false, 3, uint64(100+ci*10+hi))
				for _, maxNorm := range []float64{0, 1} {
					want, wantCopy := heldReference(p, h, 3, maxNorm)
					for _, s := range heldSchedules(len(c.sizes) - countHeld(held)) {
						t.Run(fmt.Sprintf("c%d/h%d/%v/clip%g/%+v", ci, hi, gd, maxNorm, s), func(t *testing.T) {
							d := NewSim(SimOptions{})
							e := setupHeld(t, d, p, held, s, nil, false)
							defer e.Close()
							runHeld(t, d, e, p, h, 3, maxNorm)
							checkHeldRun(t, d, e, want, wantCopy)
							if err := d.OrderErr(); err != nil {
								t.Fatal(err)
							}
						})
					}
				}
			}
		}
	}
}

// TestHeldStatsRandom: over random sizes and held patterns (200, 40 under
// -race), with a NaN in every fifth, Stats equals the whole gradient's
// GradStats bitwise, at two unscale factors.
func TestHeldStatsRandom(t *testing.T) {
	saved := heldSizes
	defer func() { heldSizes = saved }()
	r := rand.New(rand.NewPCG(7, 7))
	iters := 200
	if raceEnabled {
		iters = 40
	}
	for it := range iters {
		k := 1 + r.IntN(9)
		sizes := make([]int, k)
		held := make([]bool, k)
		n := 0
		for i := range sizes {
			switch r.IntN(4) {
			case 0:
				sizes[i] = 1 + r.IntN(4)
			case 1:
				sizes[i] = 32768
			case 2:
				sizes[i] = 1 + r.IntN(40000)
			default:
				sizes[i] = 32768 - r.IntN(3) + r.IntN(3)
			}
			n += sizes[i]
			held[i] = r.IntN(2) == 0
		}
		heldSizes = sizes
		gd := []adam.DType{adam.F32, adam.BF16, adam.F16}[it%3]
		inf := -1
		if it%5 == 0 {
			inf = r.IntN(n)
		}
		p := newProblem(n, gd, false, 1, uint64(it))
		if inf >= 0 {
			p.g32[0][inf] = float32(math.NaN())
			p.g16[0][inf] = 0x7fc0
			if gd == adam.F16 {
				p.g16[0][inf] = 0x7e00
			}
		}
		d := NewSim(SimOptions{})
		s := perfmodel.Schedule{CPU: len(sizes) - countHeld(held)}
		e := setupHeld(t, d, p, held, s, nil, false)
		putHeld(t, d, e, p.gradBytes(0))
		for _, unscale := range []float32{1, 0.125} {
			finite, sum, err := e.Stats(unscale)
			if err != nil {
				t.Fatal(err)
			}
			wf, ws := adam.DefaultPath.GradStats(p.grad(0), unscale)
			if finite != wf || (wf && math.Float64bits(sum) != math.Float64bits(ws)) {
				t.Fatalf("it %d sizes %v held %v %v: Stats %v %v, want %v %v", it, sizes, held, gd, finite, sum, wf, ws)
			}
		}
		e.Close()
	}
}

// TestHeldAMSGrad: AMSGrad with host-held subgroups, every schedule,
// bitwise against the whole flat update.
func TestHeldAMSGrad(t *testing.T) {
	h := adam.DefaultHyper()
	h.AMSGrad = true
	held := heldPatterns[1]
	n := 0
	for _, s := range heldSizes {
		n += s
	}
	p := newProblem(n, adam.BF16, true, 3, 77)
	want, wantCopy := heldReference(p, h, 3, 1)
	for _, s := range heldSchedules(len(heldSizes) - countHeld(held)) {
		t.Run(fmt.Sprintf("%+v", s), func(t *testing.T) {
			d := NewSim(SimOptions{})
			plan, err := NewHeldPlan(held, s)
			if err != nil {
				t.Fatal(err)
			}
			e, err := New(Options{Device: d, Sizes: heldSizes, GradDType: p.gd, WorkingDType: adam.BF16, Plan: plan, HostHeld: held, AMSGrad: true})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			loadProblem(t, e, p)
			runHeld(t, d, e, p, h, 3, 1)
			checkHeldRun(t, d, e, want, wantCopy)
		})
	}
}

// TestHeldTransferFaults: faults during Load, SetGrad and GetWorking with
// held segments: the error
// is returned and, after it, a retry works (or the engine says broken).
func TestHeldTransferFaults(t *testing.T) {
	held := heldPatterns[1]
	p := heldProblem(adam.BF16, 1, 5, -1)
	s := perfmodel.Schedule{CPU: 1, GPU: 1, Resident: 2}
	for _, which := range []string{"load", "setgrad", "getworking", "stats", "zerograd"} {
		for i := 1; i <= 12; i++ {
			t.Run(fmt.Sprintf("%s/%d", which, i), func(t *testing.T) {
				d := NewSim(SimOptions{})
				e := setupHeld(t, d, p, held, s, nil, false)
				defer e.Close()
				d.opts.FailAt = d.Ops() + i
				var err error
				switch which {
				case "load":
					err = e.Load()
				case "setgrad":
					err = e.SetGrad(p.grad(0))
				case "getworking":
					err = e.GetWorking(make([]uint16, e.total))
				case "stats":
					putHeldNoFault(t, d, e, p.gradBytes(0))
					d.opts.FailAt = d.Ops() + i
					_, _, err = e.Stats(1)
				case "zerograd":
					err = e.ZeroGrad()
				}
				d.opts.FailAt = 0
				t.Logf("err %v broken %v", err, e.Broken())
				if err == nil {
					return // the i-th op is past this call
				}
				if !errors.Is(err, ErrInjected) && !errors.Is(err, ErrBroken) {
					t.Fatalf("%s: %v", which, err)
				}
				if e.Broken() {
					return
				}
				// Retry the whole thing and check the result.
				if err := e.Load(); err != nil {
					t.Fatal(err)
				}
				w0 := make([]uint16, e.total)
				adam.Round16(adam.BF16, w0, p.state.Param)
				checkHeldRun(t, d, e, p.state, w0)
			})
		}
	}
}

func putHeldNoFault(t *testing.T, d *Sim, e *Engine, b []byte) {
	fa := d.opts.FailAt
	d.opts.FailAt = 0
	putHeld(t, d, e, b)
	d.opts.FailAt = fa
}

// pendDev is a Sim that counts the D2H copies enqueued and not yet waited
// for (any Sync waits for all, as the engine's tail event does), and fails
// the failD2H-th D2H.
type pendDev struct {
	*Sim
	pending, d2hs, failD2H int
}

func (p *pendDev) D2H(st Stream, dst Host, dstOff int64, src Mem, srcOff, n int64) error {
	p.d2hs++
	if p.failD2H > 0 && p.d2hs == p.failD2H {
		return fmt.Errorf("pendDev: %w", ErrInjected)
	}
	if err := p.Sim.D2H(st, dst, dstOff, src, srcOff, n); err != nil {
		return err
	}
	p.pending++
	return nil
}

func (p *pendDev) Sync(e Event) error {
	p.pending = 0
	return p.Sim.Sync(e)
}

// TestHeldMixedBlockError: a D2H that cannot be enqueued in Stats' gather
// of a block cut device|held|device returned with the first piece's copy
// into the gather buffer still in flight (not waited for, the engine not
// broken), so the next Stats reused that buffer unordered; now Stats
// waits for what it enqueued before it returns the error, as pieces does.
func TestHeldMixedBlockError(t *testing.T) {
	saved := heldSizes
	defer func() { heldSizes = saved }()
	heldSizes = []int{100, 50, 100}
	held := []bool{false, true, false}
	p := newProblem(250, adam.BF16, false, 1, 9)
	d := &pendDev{Sim: NewSim(SimOptions{})}
	e := setupHeld(t, d, p, held, perfmodel.Schedule{CPU: 2}, nil, false)
	defer e.Close()
	putHeld(t, d, e, p.gradBytes(0))
	d.d2hs, d.failD2H = 0, 2
	_, _, err := e.Stats(1)
	if err == nil {
		t.Fatal("Stats: no error")
	}
	if d.pending != 0 && !e.Broken() {
		t.Errorf("Stats returned %v with %d D2H copies into its gather buffer not waited for, and the engine not broken", err, d.pending)
	}
}
