package offload

import (
	"errors"
	"fmt"
)

// StateKind names one of a parameter's fp32 state tensors, as torch.optim's
// AdamW state names them (and the master weights).
type StateKind int

const (
	MasterWeights StateKind = iota // the fp32 master weights (PyTorch's param.data)
	ExpAvg                         // exp_avg, the first moment
	ExpAvgSq                       // exp_avg_sq, the second moment
	MaxExpAvgSq                    // max_exp_avg_sq (amsgrad only)
)

func (k StateKind) String() string {
	switch k {
	case MasterWeights:
		return "master"
	case ExpAvg:
		return "exp_avg"
	case ExpAvgSq:
		return "exp_avg_sq"
	case MaxExpAvgSq:
		return "max_exp_avg_sq"
	}
	return fmt.Sprintf("StateKind(%d)", int(k))
}

// slice returns kind's state of the parameter span [lo, hi), or an error
// for an unknown kind or max_exp_avg_sq without amsgrad.
func (o *Optimizer) stateOf(kind StateKind, lo, hi int) ([]float32, error) {
	var s []float32
	switch kind {
	case MasterWeights:
		s = o.state.Param
	case ExpAvg:
		s = o.state.ExpAvg
	case ExpAvgSq:
		s = o.state.ExpAvgSq
	case MaxExpAvgSq:
		if !o.opts.Hyper.AMSGrad {
			return nil, errors.New("offload: max_exp_avg_sq: the optimizer has no amsgrad")
		}
		s = o.state.MaxExpAvgSq
	default:
		return nil, fmt.Errorf("offload: unknown %v", kind)
	}
	return s[lo:hi], nil
}

// ReadState copies parameter i's state of kind (its Len elements, fp32)
// into dst: what torch.optim.AdamW.state_dict holds for it. With a device
// the state is brought to the host first.
//
// Errors: ErrClosed, i or len(dst) out of range, an unknown kind or
// max_exp_avg_sq without amsgrad, a device that failed.
func (o *Optimizer) ReadState(i int, kind StateKind, dst []float32) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	lo, hi, err := o.stateSpan(i, len(dst), "ReadState")
	if err != nil {
		return err
	}
	if err := o.syncHost(); err != nil {
		return err
	}
	s, err := o.stateOf(kind, lo, hi)
	if err != nil {
		return err
	}
	copy(dst, s)
	return nil
}

// WriteState sets parameter i's state of kind from src (its Len elements):
// what torch.optim.AdamW.load_state_dict restores. Writing the master
// weights refreshes the working copy, as SetParam does. With a device the
// state goes back to it before the next step.
//
// Errors: those of ReadState.
func (o *Optimizer) WriteState(i int, kind StateKind, src []float32) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	lo, hi, err := o.stateSpan(i, len(src), "WriteState")
	if err != nil {
		return err
	}
	return o.writeState(kind, lo, hi, src)
}

// stateSpan checks i and n for ReadState and WriteState and returns the
// parameter's span.
func (o *Optimizer) stateSpan(i, n int, what string) (lo, hi int, err error) {
	if o.pool == nil {
		return 0, 0, ErrClosed
	}
	if i < 0 || i >= len(o.params) {
		return 0, 0, fmt.Errorf("offload: %s: parameter %d of %d", what, i, len(o.params))
	}
	if o.opts.Device != nil && o.dev == devBroken {
		return 0, 0, fmt.Errorf("offload: %s: the state is torn (LoadCheckpoint restores one)", what)
	}
	lo, hi = o.span(i)
	if n != hi-lo {
		return 0, 0, fmt.Errorf("offload: %s %q: %d elements, want %d", what, o.params[i].Name, n, hi-lo)
	}
	return lo, hi, nil
}

// SetStepCount sets the step counter, the t of the bias corrections, as
// loading a torch.optim.AdamW state dict's "step" does (>= 0).
//
// Errors: ErrClosed, a negative step.
func (o *Optimizer) SetStepCount(step int64) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.pool == nil {
		return ErrClosed
	}
	if step < 0 {
		return fmt.Errorf("offload: SetStepCount(%d): want >= 0", step)
	}
	o.step = step
	o.stepAt.Store(step)
	return nil
}
