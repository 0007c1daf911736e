package scheduler

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// gateCheck is a lazy capture's stand-in: a copy of the host state at
// install; gate(i) checks that subgroup i's host state is still that copy
// (nothing wrote it before its gate), once.
type gateCheck struct {
	mu       sync.Mutex
	e        *Engine
	snap     adam.State
	released []bool
	skip     []bool
	errs     []string
}

func installGate(e *Engine) *gateCheck {
	g := &gateCheck{e: e, snap: e.state.Clone(), released: make([]bool, len(e.sizes)), skip: make([]bool, len(e.sizes))}
	for i := range e.sizes {
		g.skip[i] = e.plan.Roles[i] == Resident
	}
	e.Hold(g.gate)
	return g
}

func (g *gateCheck) same(i int) bool {
	lo, hi := int(g.e.off[i]), int(g.e.off[i]+g.e.sizes[i])
	a, b := g.e.state.Slice(lo, hi), g.snap.Slice(lo, hi)
	for k, x := range [][2][]float32{{a.Param, b.Param}, {a.ExpAvg, b.ExpAvg}, {a.ExpAvgSq, b.ExpAvgSq}, {a.MaxExpAvgSq, b.MaxExpAvgSq}} {
		for j := range x[0] {
			if math.Float32bits(x[0][j]) != math.Float32bits(x[1][j]) {
				_ = k
				return false
			}
		}
	}
	return true
}

func (g *gateCheck) gate(i int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.released[i] || g.skip[i] {
		return
	}
	if !g.same(i) {
		g.errs = append(g.errs, fmt.Sprintf("subgroup %d's host state written before its gate", i))
	}
	g.released[i] = true
}

func (g *gateCheck) finish(t *testing.T) {
	t.Helper()
	g.e.Hold(nil)
	g.mu.Lock()
	defer g.mu.Unlock()
	for i := range g.released {
		if !g.released[i] && !g.skip[i] && !g.same(i) {
			g.errs = append(g.errs, fmt.Sprintf("subgroup %d's host state written without its gate", i))
		}
	}
	if len(g.errs) > 0 {
		t.Fatal(g.errs)
	}
}

func randSched(r *rand.Rand, n int) perfmodel.Schedule {
	c := r.IntN(n + 1)
	g := r.IntN(n - c + 1)
	return perfmodel.Schedule{CPU: c, GPU: g, Resident: n - c - g, UpcastOnGPU: r.IntN(4) == 0}
}

// fuzzPair is a bkPair with how to re-plan it and where its gradients go.
type fuzzPair struct {
	*bkPair
	held  []bool // nil: none
	nDev  int    // subgroups a schedule places
	plan  func(s perfmodel.Schedule) *Plan
	putG  func(k int)
	check func(k int)
}

func newFuzzPlain(t *testing.T, ams bool, budget int64, gpu bool) *fuzzPair {
	n := len(testSizes)
	mirror := []Span{{Off: 3, N: 2000}, {Off: 2500, N: int64(testTotal()) - 2600}}
	bp := newBkPairSpec(t, adam.BF16, testSizes, perfmodel.Schedule{CPU: n}, ams, mirror, budget, gpu)
	fp := &fuzzPair{bkPair: bp, nDev: n}
	fp.plan = func(s perfmodel.Schedule) *Plan {
		p, err := NewPlan(n, s)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	fp.putG = func(k int) {
		g := bp.p.gradBytes(k)
		put(t, bp.da, bp.a.grad, 0, g)
		put(t, bp.dr, bp.r.grad, 0, g)
	}
	fp.check = bp.compare
	return fp
}

func newFuzzHeld(t *testing.T, ams bool, budget int64, held []bool, gpu bool) *fuzzPair {
	nd := len(heldSizes) - countHeld(held)
	total := 0
	for _, x := range heldSizes {
		total += x
	}
	bp := &bkPair{t: t, p: newProblem(total, adam.BF16, ams, 64, 9), sizes: heldSizes, h: adam.DefaultHyper()}
	bp.h.AMSGrad = ams
	bp.groupLR = [2]float64{1e-3, 3e-3}
	bp.da, bp.dr = NewSim(SimOptions{}), NewSim(SimOptions{})
	fp := &fuzzPair{bkPair: bp, held: held, nDev: nd}
	fp.plan = func(s perfmodel.Schedule) *Plan {
		p, err := NewHeldPlan(held, s)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	bp.engines(budget, Options{Sizes: heldSizes, GradDType: adam.BF16, WorkingDType: adam.BF16, AMSGrad: ams, HostHeld: held, Prefetch: true, SpeculateGPU: gpu},
		func() *Plan { return fp.plan(perfmodel.Schedule{CPU: nd}) })
	fp.putG = func(k int) {
		g := bp.p.gradBytes(k)
		putHeld(t, bp.da, bp.a, g)
		putHeld(t, bp.dr, bp.r, g)
	}
	fp.check = func(k int) {
		bp.compare(k)
		// the host-held working copies too
		ha, hr := bp.a.hwork, bp.r.hwork
		if ha != nil && string(ha.Bytes()) != string(hr.Bytes()) {
			t.Fatalf("step %d: host-held working copy differs", k)
		}
	}
	return fp
}

func (fp *fuzzPair) replanTo(s perfmodel.Schedule) {
	t := fp.t
	t.Helper()
	for _, e := range []*Engine{fp.a, fp.r} {
		if err := e.Replan(fp.plan(s)); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSpeculateRandomHeld is TestSpeculateRandom with host-held
// subgroups, over heldPatterns.
func TestSpeculateRandomHeld(t *testing.T) {
	for seed := range randomSeeds(6, 2) {
		ams := seed%2 == 1
		held := heldPatterns[1+seed%5]
		budgets := []int64{1 << 24, SpeculateBytes(50000, ams), SpeculateBytes(90000, ams), SpeculateBytes(150000, ams)}
		budget := budgets[(seed/5)%len(budgets)]
		for _, gpu := range []bool{false, true} {
			t.Run(fmt.Sprintf("seed=%d/ams=%v/held=%v/budget=%d/gpu=%v", seed, ams, held, budget, gpu), func(t *testing.T) {
				fuzzRun(t, seed, newFuzzHeld(t, ams, budget, held, gpu))
			})
		}
	}
}

// TestSpeculateRandom: random sequences of the engine's calls around the
// speculation (Replan before, during and after it, DropSpeculation and
// StopSpeculation anywhere, late Speculates, EndSpeculation twice,
// DropPrefetch, skipped, clipped and rescaled steps, faults in the phase,
// StartUpdatePer and FinishUpdate with WaitReady beside them, Load of a
// written HostState, amsgrad, slots small enough to fragment, mirror
// spans) against an engine that never speculates: the state, the working
// copy and the mirror bit for bit after every step, and no write into the
// host state before its Hold gate. DOS_SPECULATE_SEEDS sets the number of
// sequences (8; 3 under the race detector).
func TestSpeculateRandom(t *testing.T) {
	for seed := range randomSeeds(8, 3) {
		ams := seed%2 == 1
		budgets := []int64{1 << 20, SpeculateBytes(1100, ams), SpeculateBytes(2100, ams), SpeculateBytes(4000, ams)}
		budget := budgets[seed%len(budgets)]
		for _, gpu := range []bool{false, true} {
			t.Run(fmt.Sprintf("seed=%d/ams=%v/budget=%d/gpu=%v", seed, ams, budget, gpu), func(t *testing.T) {
				fuzzRun(t, seed, newFuzzPlain(t, ams, budget, gpu))
			})
		}
	}
}

// randomSeeds is a random test's number of sequences: n, or race under
// the race detector, or DOS_SPECULATE_SEEDS where set.
func randomSeeds(n, race int) int {
	if raceEnabled {
		n = race
	}
	if v, err := strconv.Atoi(os.Getenv("DOS_SPECULATE_SEEDS")); err == nil {
		n = v
	}
	return n
}

func fuzzRun(t *testing.T, seed int, bp *fuzzPair) {
	n := len(bp.sizes)
	r := rand.New(rand.NewPCG(uint64(seed), 99))
	var gc *gateCheck
	rp := 7
	if seed%3 != 0 {
		rp = 25
	}
	var totalKept, inSlots int64
	defer func() { t.Logf("kept %d, subgroup-steps in slots %d", totalKept, inSlots) }()
	var log []string
	defer func() {
		if t.Failed() {
			t.Logf("ops: %v", log)
		}
	}()
	replan := func(what string) {
		if gc != nil {
			return
		}
		s := randSched(r, bp.nDev)
		log = append(log, fmt.Sprintf("%s %+v", what, s))
		bp.replanTo(s)
	}
	for k := 0; k < 60; k++ {
		log = append(log, fmt.Sprintf("|step %d", k))
		if r.IntN(rp) == 0 {
			replan("replan")
		}
		if r.IntN(6) == 0 {
			if gc != nil {
				gc.finish(t)
				gc = nil
				log = append(log, "gate off")
			} else {
				bp.a.DropSpeculation()
				log = append(log, "gate on")
				gc = installGate(bp.a)
			}
		}
		if gc == nil && r.IntN(15) == 0 {
			// The caller writes the whole host state (a checkpoint's), then Load.
			if err := bp.r.Download(); err != nil {
				t.Fatal(err)
			}
			src := bp.r.current()
			hs := bp.a.HostState()
			copy(hs.Param, src.Param)
			copy(hs.ExpAvg, src.ExpAvg)
			copy(hs.ExpAvgSq, src.ExpAvgSq)
			copy(hs.MaxExpAvgSq, src.MaxExpAvgSq)
			if err := firstErr(bp.a.Load(), bp.r.Load()); err != nil {
				t.Fatal(err)
			}
			log = append(log, "load")
		}
		bp.putG(k)
		spec := bp.coeffs(bp.step+1, 1, 1, bp.groupLR)
		half := r.IntN(5) == 0
		for i := n - 1; i >= 0; i-- {
			if half && i < n/2 {
				break
			}
			if err := firstErr(bp.a.Prefetch(bp.bwdA, bp.a.off[i]), bp.a.Speculate(bp.bwdA, bp.a.off[i], spec)); err != nil {
				t.Fatal(err)
			}
			if err := bp.r.Prefetch(bp.bwdR, bp.r.off[i]); err != nil {
				t.Fatal(err)
			}
		}
		if r.IntN(3) != 0 {
			bp.a.WaitSpeculation()
		}
		switch r.IntN(10) {
		case 0:
			log = append(log, "dropspec mid")
			bp.a.DropSpeculation()
		case 1:
			log = append(log, "stop mid")
			bp.a.StopSpeculation()
			_ = bp.a.Speculate(bp.bwdA, 0, spec)
		case 2:
			if seed%3 == 0 {
				replan("replan mid")
			}
		}
		if _, _, err := bp.a.Stats(1); err != nil {
			t.Fatal(err)
		}
		if r.IntN(10) == 0 {
			log = append(log, "skip")
			bp.skip()
			bp.check(k)
			continue
		}
		lr := bp.groupLR
		if r.IntN(8) == 0 {
			lr[1] *= 1.5
			bp.groupLR = lr
			log = append(log, "lr")
		}
		clip := float32(1)
		if r.IntN(8) == 0 {
			clip = 0.5
			log = append(log, "clip")
		}
		cs := bp.coeffs(bp.step+1, 1, clip, lr)
		kept, err := bp.a.EndSpeculation(cs)
		if err != nil {
			t.Fatal(err)
		}
		log = append(log, fmt.Sprintf("kept %d", kept))
		totalKept += kept
		for _, l := range bp.a.loc {
			if l != homeLoc {
				inSlots++
			}
		}
		switch r.IntN(10) {
		case 0:
			log = append(log, "late")
			if err := bp.a.Speculate(bp.bwdA, 0, bp.coeffs(bp.step+5, 1, 1, lr)); err != nil {
				t.Fatal(err)
			}
			if r.IntN(2) == 0 {
				bp.a.WaitSpeculation()
			}
		case 1:
			log = append(log, "late same")
			if err := bp.a.Speculate(bp.bwdA, 0, cs); err != nil {
				t.Fatal(err)
			}
		case 2:
			log = append(log, "drop")
			if err := bp.a.DropPrefetch(); err != nil {
				t.Fatal(err)
			}
		case 3:
			log = append(log, "dropspec end")
			bp.a.DropSpeculation()
		case 4:
			if seed%3 == 0 {
				replan("replan end")
			}
		case 5:
			log = append(log, "endspec twice")
			if _, err := bp.a.EndSpeculation(cs); err != nil {
				t.Fatal(err)
			}
		}
		bp.step++
		failAt := 0
		if r.IntN(8) == 0 {
			failAt = 1 + r.IntN(40)
			log = append(log, fmt.Sprintf("failAt %d", failAt))
			bp.da.FailAfter(failAt)
		}
		var errA error
		if r.IntN(3) == 0 {
			log = append(log, "split")
			if errA = bp.a.StartUpdatePer(cs); errA == nil {
				var wg sync.WaitGroup
				for i := range n {
					wg.Go(func() { _ = bp.a.WaitReady(nil, i) })
				}
				errA = bp.a.FinishUpdate()
				wg.Wait()
			}
		} else {
			errA = bp.a.UpdatePer(cs)
		}
		bp.da.FailAfter(0)
		if bp.a.Broken() {
			t.Logf("step %d: broken (an injected fault in a restore's copy), Update said %v", k, errA)
			return
		}
		var fe *FaultError
		if errA != nil && !errors.As(errA, &fe) {
			t.Fatalf("step %d: a's Update: %v", k, errA)
		}
		if err := bp.r.UpdatePer(cs); err != nil {
			t.Fatal(err)
		}
		if gc != nil {
			// a capture reads: nothing else
		}
		bp.check(k)
	}
	if gc != nil {
		gc.finish(t)
	}
	// Finally every state home: HostState must equal the serial one.
	bp.a.DropSpeculation()
	if err := firstErr(bp.a.Download(), bp.r.Download()); err != nil {
		t.Fatal(err)
	}
	sameState(t, "after DropSpeculation: HostState", bp.a.HostState(), bp.r.HostState())
	if err := bp.da.OrderErr(); err != nil {
		t.Fatal(err)
	}
}
