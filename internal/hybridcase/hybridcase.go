// Package hybridcase replays the PyTorch reference cases (internal/adamcase)
// through the interleaved engine (package scheduler) on a device: the hybrid
// backend of dos selftest and of the engine's numerics tests.
package hybridcase

import (
	"errors"
	"fmt"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// Backend replays the PyTorch reference cases (internal/adamcase) through
// the whole hybrid engine on a device: each step cuts the case's
// parameters into up to five subgroups, some updated by the CPU workers
// (with and without the GPU upcast), some streamed through the GPU, one
// resident (Schedule), and moves the state, gradient and copy between
// the case and the engine. It implements adamcase.Backend.
type Backend struct {
	// Label names the device in Name ("sim", "H200").
	Label string
	// NewDevice returns the device to run on (called once per step).
	NewDevice func() scheduler.Device
	// Pool is the CPU workers (nil: a pool per step).
	Pool *adam.Pool
}

// Name returns "hybrid/" + Label.
func (b Backend) Name() string { return "hybrid/" + b.Label }

// Schedule returns the mixed schedule Backend uses for n
// parameters, and the subgroup sizes: min(n, 5) subgroups, one resident
// when there are five, then as many streamed GPU as CPU ones (the CPU
// taking the odd one); the upcast on the GPU for odd n.
func Schedule(n int) ([]int, perfmodel.Schedule) {
	k := min(n, 5)
	sizes := make([]int, k)
	for i := range sizes {
		sizes[i] = n/k + boolInt(i < n%k)
	}
	s := perfmodel.Schedule{Resident: k / 5, UpcastOnGPU: n%2 == 1}
	s.GPU = (k - s.Resident) / 2
	s.CPU = k - s.Resident - s.GPU
	return sizes, s
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

func (b Backend) engine(n int, gd, od adam.DType, amsgrad bool) (*scheduler.Engine, error) {
	sizes, s := Schedule(n)
	plan, err := scheduler.NewPlan(len(sizes), s)
	if err != nil {
		return nil, err
	}
	return scheduler.New(scheduler.Options{Device: b.NewDevice(), Sizes: sizes, GradDType: gd, WorkingDType: od, AMSGrad: amsgrad, Pool: b.Pool, Plan: plan})
}

// AllFinite runs the engine's global check (Engine.Stats) on g.
func (b Backend) AllFinite(g adam.Grad) (bool, error) {
	if g.Len() == 0 {
		return true, nil
	}
	e, err := b.engine(g.Len(), g.DType, adam.BF16, false)
	if err != nil {
		return false, err
	}
	defer e.Close()
	if err := e.SetGrad(g); err != nil {
		return false, err
	}
	finite, _, err := e.Stats(1)
	return finite, err
}

// Step runs one update phase over st with gradient g, writing out when it
// has a dtype.
func (b Backend) Step(c *adam.Coeffs, st adam.State, g adam.Grad, out adam.Copy16) error {
	n := st.Len()
	if n == 0 {
		return nil
	}
	od := out.DType
	if od == 0 {
		od = adam.BF16 // the engine always writes a copy; this one is dropped
	}
	e, err := b.engine(n, g.DType, od, c.AMSGrad)
	if err != nil {
		return err
	}
	defer e.Close()
	hs := e.HostState()
	copy(hs.Param, st.Param)
	copy(hs.ExpAvg, st.ExpAvg)
	copy(hs.ExpAvgSq, st.ExpAvgSq)
	copy(hs.MaxExpAvgSq, st.MaxExpAvgSq)
	if err := errors.Join(e.Load(), e.SetGrad(g)); err != nil {
		return err
	}
	if err := e.Update(c); err != nil {
		return err
	}
	if err := e.Download(); err != nil {
		return err
	}
	copy(st.Param, hs.Param)
	copy(st.ExpAvg, hs.ExpAvg)
	copy(st.ExpAvgSq, hs.ExpAvgSq)
	copy(st.MaxExpAvgSq, hs.MaxExpAvgSq)
	if out.DType != 0 {
		if len(out.Data) != n {
			return fmt.Errorf("scheduler: case copy of %d elements for %d parameters", len(out.Data), n)
		}
		return e.GetWorking(out.Data)
	}
	return nil
}
