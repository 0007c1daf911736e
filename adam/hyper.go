package adam

import (
	"errors"
	"fmt"
	"math"
)

// Mode selects how weight decay enters the update.
type Mode string

const (
	// AdamW decays the parameters directly, p *= 1 - lr*weight_decay, as
	// torch.optim.AdamW (decoupled weight decay).
	AdamW Mode = "adamw"
	// Adam adds weight_decay*p to the gradient (L2 regularisation), as
	// torch.optim.Adam.
	Adam Mode = "adam"
)

// ErrHyper is wrapped by every error of Hyper.Validate.
var ErrHyper = errors.New("adam: invalid hyperparameter")

// Hyper holds the hyperparameters, named and defaulted as PyTorch names them.
// The JSON names are PyTorch's too, so a Hyper round-trips through a
// checkpoint's manifest.
type Hyper struct {
	Mode        Mode       `json:"mode"`         // AdamW or Adam
	LR          float64    `json:"lr"`           // learning rate, >= 0
	Betas       [2]float64 `json:"betas"`        // beta1, beta2, each in [0, 1)
	Eps         float64    `json:"eps"`          // > 0, added to the denominator
	WeightDecay float64    `json:"weight_decay"` // >= 0
	AMSGrad     bool       `json:"amsgrad"`      // keep max_exp_avg_sq
	Maximize    bool       `json:"maximize"`     // ascend instead of descend
}

// DefaultHyper returns torch.optim.AdamW's defaults: lr 1e-3, betas
// (0.9, 0.999), eps 1e-8, weight_decay 1e-2, mode AdamW.
func DefaultHyper() Hyper {
	return Hyper{Mode: AdamW, LR: 1e-3, Betas: [2]float64{0.9, 0.999}, Eps: 1e-8, WeightDecay: 1e-2}
}

// Validate reports the first invalid field with its value. It accepts what
// torch.optim.AdamW accepts, except eps, which must be strictly positive.
//
// Errors wrap ErrHyper.
func (h Hyper) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrHyper, fmt.Sprintf(format, args...))
	}
	switch {
	case h.Mode != AdamW && h.Mode != Adam:
		return bad("mode %q: want %q or %q (start from DefaultHyper() to get PyTorch's defaults)", h.Mode, AdamW, Adam)
	case !(h.LR >= 0) || math.IsInf(h.LR, 0):
		return bad("lr %v: want a finite value >= 0", h.LR)
	case !(h.Betas[0] >= 0 && h.Betas[0] < 1):
		return bad("betas[0] (beta1) %v: want a value in [0, 1)", h.Betas[0])
	case !(h.Betas[1] >= 0 && h.Betas[1] < 1):
		return bad("betas[1] (beta2) %v: want a value in [0, 1)", h.Betas[1])
	case !(h.Eps > 0) || math.IsInf(h.Eps, 0) || float32(h.Eps) == 0 || math.IsInf(float64(float32(h.Eps)), 0):
		return bad("eps %v: want a finite value > 0 that stays so in fp32 (>= 1e-45)", h.Eps)
	case !(h.WeightDecay >= 0) || math.IsInf(h.WeightDecay, 0):
		return bad("weight_decay %v: want a finite value >= 0", h.WeightDecay)
	}
	return nil
}

// String formats h as PyTorch's keyword arguments, each number to 10
// significant digits (a scheduled lr such as 3e-4 computed as
// 0.00030000000000000003 reads 0.0003).
func (h Hyper) String() string {
	return fmt.Sprintf("mode=%s lr=%.10g betas=(%.10g, %.10g) eps=%.10g weight_decay=%.10g amsgrad=%t maximize=%t",
		h.Mode, h.LR, h.Betas[0], h.Betas[1], h.Eps, h.WeightDecay, h.AMSGrad, h.Maximize)
}

// Coeffs are the per-step scalars of one update, each rounded to fp32 once,
// as ATen rounds a Python float that meets an fp32 tensor. Every subgroup of
// a step uses the same Coeffs: one step counter for the whole optimizer.
type Coeffs struct {
	Step        int64   // t, the step counter after it advanced (>= 1)
	Unscale     float32 // gradient multiplier 1/S for loss scale S; 1 for none
	Clip        float32 // gradient multiplier from norm clipping, in (0, 1]; 1 for none
	Decay       float32 // 1 - lr*weight_decay in Mode AdamW; 1 otherwise
	L2          float32 // weight_decay in Mode Adam; 0 otherwise
	Beta1Weight float32 // 1 - beta1, the lerp weight of exp_avg
	Beta2       float32 // beta2
	OneMinusB2  float32 // 1 - beta2
	BC2Sqrt     float32 // sqrt(1 - beta2^t)
	Eps         float32 // eps
	NegStepSize float32 // -lr / (1 - beta1^t)
	AMSGrad     bool
	Maximize    bool
}

// Coeffs returns the scalars of step t (t >= 1, the counter after it
// advanced) with gradient multipliers unscale (1/S, or 1) and clip (or 1).
// The bias corrections are computed in float64, as PyTorch computes them in
// Python floats, then rounded.
//
// Panics if t < 1. h is not validated here; call Validate once beforehand.
func (h Hyper) Coeffs(t int64, unscale, clip float32) Coeffs {
	if t < 1 {
		panic(fmt.Sprintf("adam: Coeffs step %d < 1", t))
	}
	b1, b2 := h.Betas[0], h.Betas[1]
	bc1 := 1 - math.Pow(b1, float64(t))
	bc2 := 1 - math.Pow(b2, float64(t))
	c := Coeffs{
		Step:        t,
		Unscale:     unscale,
		Clip:        clip,
		Decay:       1,
		Beta1Weight: float32(1 - b1),
		Beta2:       float32(b2),
		OneMinusB2:  float32(1 - b2),
		BC2Sqrt:     float32(math.Sqrt(bc2)),
		Eps:         float32(h.Eps),
		NegStepSize: float32(-(h.LR / bc1)),
		AMSGrad:     h.AMSGrad,
		Maximize:    h.Maximize,
	}
	if h.WeightDecay != 0 {
		if h.Mode == Adam {
			c.L2 = float32(h.WeightDecay)
		} else {
			c.Decay = float32(1 - float64(h.LR*h.WeightDecay)) // no FMA: Python rounds the product
		}
	}
	return c
}
