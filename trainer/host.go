package trainer

import (
	"math"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/internal/comm"
	"github.com/deepstates/dos/offload"
	"github.com/deepstates/dos/safetensors"
)

// hostReplica is forward and backward in Go on the host (Model, fp32) for
// rows rows of the batch; its weights come from, and its gradients go
// to, the optimizer through weights.
type hostReplica struct {
	cfg     *TrainConfig
	rows    int
	weights hostWeights
	model   *Model[float32] // the batch's rows', made by bind
	sampler *Model[float32] // B = 1, made by the first next
	toks    []int32         // the sampler's window, padded to NCtx
	// params and grads are what the model reads and writes, one fp32
	// slice per tensor (weights.bind's: the optimizer's own buffers
	// where the dtypes allow).
	params, grads [][]float32
	// The last forward's loss and loss scale, for backward.
	lossNow float64
	scale   float32
}

// hostWeights is where a host replica's weights come from and its
// gradients go: its optimizer (hostLocal) or the ranks' pieces
// (hostGathered).
type hostWeights interface {
	// bind returns the model's fp32 parameters and gradients for opt.
	bind(opt *offload.Optimizer) (params, grads [][]float32)
	// pull brings the current weights into params.
	pull(params [][]float32) error
	// push hands grads to the optimizer.
	push(grads [][]float32) error
}

func (h *hostReplica) bind(opt *offload.Optimizer) error {
	h.model = NewModel[float32](h.cfg.Model, h.rows, h.cfg.Model.NCtx)
	h.params, h.grads = h.weights.bind(opt)
	return nil
}

func (h *hostReplica) refresh() error { return h.weights.pull(h.params) }

func (h *hostReplica) forward(inputs, targets []int32, scale float32, mark func()) error {
	if err := h.weights.pull(h.params); err != nil {
		return err
	}
	h.lossNow, h.scale = float64(h.model.Forward(h.params, inputs, targets)), scale
	if mark != nil {
		mark()
	}
	return nil
}

func (h *hostReplica) backward() (float64, error) {
	loss := h.lossNow
	if math.IsNaN(loss) || math.IsInf(loss, 0) {
		for _, g := range h.grads {
			clear(g)
		}
		h.grads[0][0] = float32(math.NaN())
	} else {
		h.model.Backward(h.params, h.grads, h.scale)
	}
	return loss, h.weights.push(h.grads)
}

// overlapsUpdate: yes, trivially: a host replica's optimizer steps
// without StepArgs.GradOnDevice, so its StepAsync is Step (the working
// copy comes back to the host whole before it returns), and the next
// forward that runs before WaitStep reads the step's weights.
func (h *hostReplica) overlapsUpdate() bool { return true }

func (h *hostReplica) loss(inputs, targets []int32) (float64, error) {
	return float64(h.model.Forward(h.params, inputs, targets)), nil
}

func (h *hostReplica) next(window []int32) ([]float32, error) {
	T, V := h.cfg.Model.NCtx, h.cfg.Model.VocabSize
	if h.sampler == nil {
		h.sampler, h.toks = NewModel[float32](h.cfg.Model, 1, T), make([]int32, T)
	}
	clear(h.toks)
	copy(h.toks, window)
	h.sampler.Forward(h.params, h.toks, nil)
	row := (len(window) - 1) * V
	return h.sampler.Logits()[row : row+V], nil
}

func (h *hostReplica) memory() (used, total int64)  { return 0, 0 }
func (h *hostReplica) describe(*TrainConfig) string { return "" }
func (h *hostReplica) close() error                 { return nil }

// hostLocal is one rank's weights alone: the optimizer's working copy,
// read in place in fp32 (no copy) or widened from 16 bits, and its
// gradient buffers, written in place in fp32 or rounded into 16 bits (an
// overflow becomes Inf, which skips the step).
type hostLocal struct {
	cfg *TrainConfig
	opt *offload.Optimizer
}

func (l *hostLocal) bind(opt *offload.Optimizer) (params, grads [][]float32) {
	l.opt = opt
	n := len(opt.Params())
	params, grads = make([][]float32, n), make([][]float32, n)
	for i, p := range opt.Params() {
		if l.cfg.WorkingDType != 0 {
			params[i] = make([]float32, p.Len)
		} else {
			params[i] = opt.Working(i).Float32()
		}
		if l.cfg.GradDType == adam.F32 {
			grads[i] = opt.Grad(i).Float32()
		} else {
			grads[i] = make([]float32, p.Len)
		}
	}
	return params, grads
}

func (l *hostLocal) pull(params [][]float32) error {
	if l.cfg.WorkingDType == 0 {
		return nil
	}
	for i, dst := range params {
		adam.Widen16(l.cfg.WorkingDType, dst, l.opt.Working(i).Uint16())
	}
	return nil
}

func (l *hostLocal) push(grads [][]float32) error {
	if l.cfg.GradDType == adam.F32 {
		return nil
	}
	for i, g := range grads {
		adam.Round16(l.cfg.GradDType, l.opt.Grad(i).Uint16(), g)
	}
	return nil
}

// hostGathered is a ZeRO-3 rank's weights on the host (zero.go): the
// whole tensors all-gathered from the ranks' pieces of the working copy
// (comm.AllGather), and the whole gradients reduce-scattered (comm.Avg:
// the gradient of the mean loss over the global batch) into the rank's
// piece of the optimizer's gradients.
type hostGathered struct {
	w   *world
	rk  *rank
	cfg *TrainConfig
	// One piece padded to ceil(len/n) elements, and one whole tensor
	// padded to n pieces, in fp32 and in 16 bits: the collectives'
	// buffers.
	piece32, full32 []float32
	piece16, full16 []uint16
}

func (g *hostGathered) bind(opt *offload.Optimizer) (params, grads [][]float32) {
	w := g.w
	largest := 0
	for i := range w.lens {
		largest = max(largest, w.n*w.piece[i])
	}
	params, grads = make([][]float32, len(w.lens)), make([][]float32, len(w.lens))
	for i, l := range w.lens {
		params[i], grads[i] = make([]float32, l), make([]float32, l)
	}
	g.full32, g.piece32 = make([]float32, largest), make([]float32, largest/w.n)
	if g.cfg.WorkingDType != 0 {
		g.full16, g.piece16 = make([]uint16, largest), make([]uint16, largest/w.n)
	}
	return params, grads
}

func (g *hostGathered) pull(params [][]float32) error {
	w, rk, wd := g.w, g.rk, g.cfg.WorkingDType
	for i, l := range w.lens {
		p := w.piece[i]
		wk := rk.opt.Working(i)
		if wd == 0 {
			send, full := g.piece32[:p], g.full32[:p*w.n]
			clear(send[copy(send, wk.Float32()):]) // the last piece's padding
			if err := rk.c.AllGather(safetensors.Float32View(send), safetensors.Float32View(full), comm.F32); err != nil {
				return err
			}
			copy(params[i], full[:l])
			continue
		}
		send, full := g.piece16[:p], g.full16[:p*w.n]
		clear(send[copy(send, wk.Uint16()):])
		if err := rk.c.AllGather(safetensors.Uint16View(send), safetensors.Uint16View(full), comm.BF16); err != nil {
			return err
		}
		adam.Widen16(wd, params[i], full[:l])
	}
	return nil
}

func (g *hostGathered) push(grads [][]float32) error {
	w, rk := g.w, g.rk
	for i, l := range w.lens {
		p := w.piece[i]
		lo, hi := pieceOf(l, w.n, rk.r)
		full, piece := g.full32[:p*w.n], g.piece32[:p]
		clear(full[copy(full, grads[i]):])
		if err := rk.c.ReduceScatter(safetensors.Float32View(full), safetensors.Float32View(piece), comm.F32, comm.Avg); err != nil {
			return err
		}
		gr := rk.opt.Grad(i)
		if g.cfg.GradDType == adam.F32 {
			copy(gr.Float32(), piece[:hi-lo])
		} else {
			adam.Round16(g.cfg.GradDType, gr.Uint16(), piece[:hi-lo])
		}
	}
	return nil
}
