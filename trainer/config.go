package trainer

import (
	"bytes"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"runtime"
	"strconv"
	"strings"

	"github.com/deepstates/dos/offload"
)

// Config is a GPT-2 configuration. The JSON names are those of Hugging Face's
// GPT2Config (config.json), so a Config marshals into the fields a
// GPT2LMHeadModel export needs; the other GPT2Config fields keep their defaults
// there (layer_norm_epsilon 1e-5, activation_function "gelu_new", no dropout
// in eval mode, tied embeddings).
type Config struct {
	VocabSize int `json:"vocab_size"`  // V: rows of wte, columns of the logits
	NCtx      int `json:"n_positions"` // maximum sequence length: rows of wpe
	NLayer    int `json:"n_layer"`     // L: transformer blocks
	NHead     int `json:"n_head"`      // attention heads; NEmbd/NHead is the head size
	NEmbd     int `json:"n_embd"`      // C: width of the residual stream
}

// Upper bounds Validate enforces. They keep every activation and parameter
// count well inside int, and token ids inside int32.
const (
	MaxVocabSize = 1 << 24
	MaxNCtx      = 1 << 20
	MaxNLayer    = 1 << 10
	MaxNEmbd     = 1 << 16
)

// Validate reports the first field out of range, named as in config.json
// (it also checks the configs of checkpoints): every field must be at least
// 1 and at most its Max constant, and NEmbd must be a multiple of NHead.
// TrainConfig.Validate checks the same fields first under the names of
// their `dos train` flags.
func (c Config) Validate() error {
	check := func(name string, v, hi int) error {
		if v < 1 || v > hi {
			return fmt.Errorf("trainer: %s = %d, want 1..%d", name, v, hi)
		}
		return nil
	}
	if err := check("vocab_size", c.VocabSize, MaxVocabSize); err != nil {
		return err
	}
	if err := check("n_positions", c.NCtx, MaxNCtx); err != nil {
		return err
	}
	if err := check("n_layer", c.NLayer, MaxNLayer); err != nil {
		return err
	}
	if err := check("n_embd", c.NEmbd, MaxNEmbd); err != nil {
		return err
	}
	if err := check("n_head", c.NHead, c.NEmbd); err != nil {
		return err
	}
	if c.NEmbd%c.NHead != 0 {
		return fmt.Errorf("trainer: n_embd = %d is not a multiple of n_head = %d", c.NEmbd, c.NHead)
	}
	return nil
}

// Indices into Params() of the tensors outside the blocks, and offsets of a
// block's tensors from layerBase(l).
const (
	pWte = 0
	pWpe = 1

	pLn1W      = 0
	pLn1B      = 1
	pAttnW     = 2
	pAttnB     = 3
	pAttnProjW = 4
	pAttnProjB = 5
	pLn2W      = 6
	pLn2B      = 7
	pFcW       = 8
	pFcB       = 9
	pFcProjW   = 10
	pFcProjB   = 11
	perLayer   = 12
)

func layerBase(l int) int { return 2 + perLayer*l }

// Params returns the model's parameter tensors with Hugging Face GPT-2 names
// (GPT2Model's state_dict without the "transformer." prefix) and row-major
// shapes in elements, in this order:
//
//	wte.weight [V, C], wpe.weight [NCtx, C],
//	for each layer l in 0..NLayer-1:
//	  h.l.ln_1.weight [C], h.l.ln_1.bias [C],
//	  h.l.attn.c_attn.weight [C, 3C], h.l.attn.c_attn.bias [3C],
//	  h.l.attn.c_proj.weight [C, C], h.l.attn.c_proj.bias [C],
//	  h.l.ln_2.weight [C], h.l.ln_2.bias [C],
//	  h.l.mlp.c_fc.weight [C, 4C], h.l.mlp.c_fc.bias [4C],
//	  h.l.mlp.c_proj.weight [4C, C], h.l.mlp.c_proj.bias [C],
//	ln_f.weight [C], ln_f.bias [C].
//
// Linear weights are stored [in, out] as HF's Conv1D (y = x @ W + b). The LM
// head is tied to wte (logits = x @ wteᵀ), so there is no lm_head tensor. The
// order is the one Forward and Backward index their params and grads by.
// Params does not validate c.
func (c Config) Params() []offload.Param {
	C := c.NEmbd
	ps := make([]offload.Param, 0, 4+perLayer*c.NLayer)
	ps = append(ps,
		offload.Param{Name: "wte.weight", Shape: []int{c.VocabSize, C}},
		offload.Param{Name: "wpe.weight", Shape: []int{c.NCtx, C}})
	for l := 0; l < c.NLayer; l++ {
		p := fmt.Sprintf("h.%d.", l)
		ps = append(ps,
			offload.Param{Name: p + "ln_1.weight", Shape: []int{C}},
			offload.Param{Name: p + "ln_1.bias", Shape: []int{C}},
			offload.Param{Name: p + "attn.c_attn.weight", Shape: []int{C, 3 * C}},
			offload.Param{Name: p + "attn.c_attn.bias", Shape: []int{3 * C}},
			offload.Param{Name: p + "attn.c_proj.weight", Shape: []int{C, C}},
			offload.Param{Name: p + "attn.c_proj.bias", Shape: []int{C}},
			offload.Param{Name: p + "ln_2.weight", Shape: []int{C}},
			offload.Param{Name: p + "ln_2.bias", Shape: []int{C}},
			offload.Param{Name: p + "mlp.c_fc.weight", Shape: []int{C, 4 * C}},
			offload.Param{Name: p + "mlp.c_fc.bias", Shape: []int{4 * C}},
			offload.Param{Name: p + "mlp.c_proj.weight", Shape: []int{4 * C, C}},
			offload.Param{Name: p + "mlp.c_proj.bias", Shape: []int{C}})
	}
	ps = append(ps,
		offload.Param{Name: "ln_f.weight", Shape: []int{C}},
		offload.Param{Name: "ln_f.bias", Shape: []int{C}})
	return ps
}

// NumParams returns the number of parameters (elements) of Params(), the LM
// head counted once since it is tied to wte: 124,439,808 for GPT-2 small
// (V 50257, NCtx 1024, L 12, H 12, C 768).
func (c Config) NumParams() int {
	V, C, L := c.VocabSize, c.NEmbd, c.NLayer
	return V*C + c.NCtx*C + L*(12*C*C+13*C) + 2*C
}

// numel returns the product of shape.
func numel(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}

// InitParams returns GPT-2's initialisation of every tensor of c.Params(), in
// that order, with lengths the products of the shapes. It follows HF's
// GPT2PreTrainedModel._init_weights with llm.c's wpe:
//
//   - weights (wte, c_attn, c_fc) ~ N(0, 0.02);
//   - the residual projections attn.c_proj.weight and mlp.c_proj.weight
//     ~ N(0, 0.02/sqrt(2*NLayer));
//   - wpe ~ N(0, 0.01);
//   - LayerNorm weights 1; LayerNorm biases and linear biases 0.
//
// Tensor i is drawn from its own math/rand/v2 PCG stream seeded (seed, i), by
// NormFloat64 rounded to float32, so the result depends only on c and seed.
// Panics if c is invalid.
//
// References: HF transformers models/gpt2/modeling_gpt2.py
// (GPT2PreTrainedModel._init_weights); karpathy/llm.c train_gpt2.py (wpe std).
func InitParams(c Config, seed uint64) [][]float32 {
	if err := c.Validate(); err != nil {
		panic(err)
	}
	params := c.Params()
	out := make([][]float32, len(params))
	projStd := 0.02 / math.Sqrt(2*float64(c.NLayer))
	for i, p := range params {
		x := make([]float32, numel(p.Shape))
		out[i] = x
		var std float64
		switch {
		case i == pWte:
			std = 0.02
		case i == pWpe:
			std = 0.01
		case i >= layerBase(c.NLayer):
			if i == layerBase(c.NLayer) { // ln_f.weight
				fill(x, 1)
			}
			continue
		default:
			switch (i - 2) % perLayer {
			case pAttnW, pFcW:
				std = 0.02
			case pAttnProjW, pFcProjW:
				std = projStd
			case pLn1W, pLn2W:
				fill(x, 1)
				continue
			default: // biases
				continue
			}
		}
		r := rand.New(rand.NewPCG(seed, uint64(i)))
		for j := range x {
			x[j] = float32(r.NormFloat64() * std)
		}
	}
	return out
}

func fill[F float32 | float64](x []F, v F) {
	for i := range x {
		x[i] = v
	}
}

// MaxThreads returns the most optimizer goroutines TrainConfig.Threads (and
// `dos bench --threads`) may ask for: 4 × runtime.NumCPU(). The update is
// bound by memory bandwidth, so workers beyond the cores only time-share
// them; 4× still leaves room to measure oversubscription, while a typo
// cannot start millions of goroutines or size the pool's task channel
// (a few hundred bytes per worker) by it.
func MaxThreads() int { return 4 * runtime.NumCPU() }

// memAvailable returns the bytes of memory available to a new process now,
// and false where the system does not say. Tests replace it.
var memAvailable = readMemAvailable

// readMemAvailable reads MemAvailable from /proc/meminfo (Linux 3.14 and
// later): the kernel's estimate of the memory that can be allocated without
// swapping, free plus reclaimable page cache. Elsewhere, or on any error,
// it returns false.
func readMemAvailable() (int64, bool) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, false
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, 64<<10))
	if err != nil {
		return 0, false
	}
	return parseMemAvailable(b)
}

// parseMemAvailable returns the bytes of the "MemAvailable: N kB" line of a
// /proc/meminfo text, and false when there is no such line or it does not
// parse.
func parseMemAvailable(meminfo []byte) (int64, bool) {
	for line := range bytes.Lines(meminfo) {
		rest, ok := bytes.CutPrefix(line, []byte("MemAvailable:"))
		if !ok {
			continue
		}
		f := strings.Fields(string(rest))
		if len(f) != 2 || f[1] != "kB" {
			return 0, false
		}
		kb, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil || kb < 0 || kb > math.MaxInt64>>10 {
			return 0, false
		}
		return kb << 10, true
	}
	return 0, false
}

// workers returns the goroutines the model's pool may run on:
// runtime.GOMAXPROCS(0).
func workers() int { return runtime.GOMAXPROCS(0) }
