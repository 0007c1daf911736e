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
	"sync"
	"sync/atomic"

	"github.com/deepstates/dos/gpt"
	"github.com/deepstates/dos/offload"
)

// Config is a GPT-2 configuration: gpt.Config, the model description the
// CPU and GPU trainers share (an alias, so its JSON and its methods are
// gpt's: Validate, Tensors, NumParams, FLOPsPerToken).
type Config = gpt.Config

// Upper bounds Config.Validate enforces (gpt's).
const (
	MaxVocabSize = gpt.MaxVocabSize
	MaxNCtx      = gpt.MaxNCtx
	MaxNLayer    = gpt.MaxNLayer
	MaxNEmbd     = gpt.MaxNEmbd
)

// offloadParams returns the model's parameters for offload.New: c.Tensors()
// (gpt's names, shapes and order, which Forward and Backward index their
// params and grads by) as offload.Params. It does not validate c.
func offloadParams(c Config) []offload.Param {
	ts := c.Tensors()
	ps := make([]offload.Param, len(ts))
	for i, t := range ts {
		ps[i] = offload.Param{Name: t.Name, Shape: t.Shape}
	}
	return ps
}

// InitParams returns GPT-2's initialisation of every tensor of c.Tensors(), in
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
	params := c.Tensors()
	out := make([][]float32, len(params))
	for i, p := range params {
		out[i] = make([]float32, p.Numel())
		InitParamInto(c, seed, i, out[i])
	}
	return out
}

// InitParamInto writes tensor i of InitParams(c, seed) into dst (its
// Numel() elements, overwritten), one tensor at a time: New hands the
// optimizer the initial weights through one buffer of the largest
// tensor's size instead of the whole model's. Panics if c is invalid, i
// is out of range or dst has another length.
func InitParamInto(c Config, seed uint64, i int, dst []float32) {
	params := c.Tensors()
	if i < 0 || i >= len(params) || len(dst) != params[i].Numel() {
		panic(fmt.Sprintf("trainer: InitParamInto: tensor %d of %d, %d elements given", i, len(params), len(dst)))
	}
	projStd := 0.02 / math.Sqrt(2*float64(c.NLayer))
	var std float64
	switch {
	case i == gpt.Wte:
		std = 0.02
	case i == gpt.Wpe:
		std = 0.01
	case i >= gpt.LayerBase(c.NLayer):
		fill(dst, 0)
		if i == gpt.LayerBase(c.NLayer)+gpt.LnfW {
			fill(dst, 1)
		}
		return
	default:
		switch (i - gpt.LayerBase(0)) % gpt.PerLayer {
		case gpt.AttnW, gpt.FcW:
			std = 0.02
		case gpt.AttnProjW, gpt.FcProjW:
			std = projStd
		case gpt.Ln1W, gpt.Ln2W:
			fill(dst, 1)
			return
		default: // biases
			fill(dst, 0)
			return
		}
	}
	r := rand.New(rand.NewPCG(seed, uint64(i)))
	for j := range dst {
		dst[j] = float32(r.NormFloat64() * std)
	}
}

// initWindow is the most bytes of initial weights initWeights draws at
// once, in each of its two windows (more when the largest tensor is:
// then a window is that tensor's).
const initWindow = 256 << 20

// initWindows cuts c.Tensors() into initWeights's windows, [lo, hi) of
// consecutive tensors with at most max(window/4, the largest tensor's)
// elements each, and returns them with the fullest window's elements.
func initWindows(c Config, window int) (windows [][2]int, most int) {
	ts := c.Tensors()
	size := window / 4
	for _, p := range ts {
		size = max(size, p.Numel())
	}
	for lo := 0; lo < len(ts); {
		hi, n := lo, 0
		for hi < len(ts) && n+ts[hi].Numel() <= size {
			n += ts[hi].Numel()
			hi++
		}
		windows = append(windows, [2]int{lo, hi})
		most = max(most, n)
		lo = hi
	}
	return windows, most
}

// initBufferElems is the fp32 elements initWeights allocates for c: one
// window's slab when one window holds the model, else two.
func initBufferElems(c Config) int {
	windows, most := initWindows(c, initWindow)
	return min(len(windows), 2) * most
}

// initWeights draws InitParams(c, seed) and hands tensor i to set (in
// the order of c.Tensors(), one call at a time, its values valid only
// during the call): the same bits as InitParamInto tensor by tensor, each
// tensor from its own stream, but drawn on workers goroutines a window of
// tensors at a time while set takes the window before. A large model's
// fp32 copy is never whole in memory: two windows of max(window, the
// largest tensor) bytes are, one when it holds the model (initBufferElems;
// window: initWindow, or a test's). A 4.24B model's NormFloat64 draws take
// about half a minute on one core. Returns set's first error; no tensor
// after it is handed to set.
func initWeights(c Config, seed uint64, workers, window int, set func(i int, v []float32) error) error {
	ts := c.Tensors()
	windows, most := initWindows(c, window)
	slabs := [2][]float32{make([]float32, most)}
	if len(windows) > 1 {
		slabs[1] = make([]float32, most)
	}
	views := make([][][]float32, len(windows)) // window w's tensors, in slab w mod 2
	for w, win := range windows {
		off := 0
		for i := win[0]; i < win[1]; i++ {
			views[w] = append(views[w], slabs[w%2][off:off+ts[i].Numel()])
			off += ts[i].Numel()
		}
	}
	// draw starts window w's tensors on at most workers goroutines, each
	// taking the next tensor not yet taken, and returns what to wait on.
	draw := func(w int) *sync.WaitGroup {
		var wg sync.WaitGroup
		var taken atomic.Int64
		for range min(max(workers, 1), len(views[w])) {
			wg.Go(func() {
				for j := int(taken.Add(1)) - 1; j < len(views[w]); j = int(taken.Add(1)) - 1 {
					InitParamInto(c, seed, windows[w][0]+j, views[w][j])
				}
			})
		}
		return &wg
	}
	next := draw(0)
	for w := range windows {
		next.Wait()
		if w+1 < len(windows) {
			next = draw(w + 1) // into the other slab, while set takes this one
		}
		for j, v := range views[w] {
			if err := set(windows[w][0]+j, v); err != nil {
				next.Wait()
				return err
			}
		}
	}
	return nil
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
