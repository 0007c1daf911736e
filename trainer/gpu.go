package trainer

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/deepstates/dos/gpt"

	"github.com/deepstates/dos/internal/cublas"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/internal/gptcuda"
	"github.com/deepstates/dos/offload"
)

// samplerOptions are the sampler's: it runs forward only, so one block's
// activations do (Recompute).
var samplerOptions = gptcuda.Options{Recompute: true}

// gpuMargin is the device memory left free when the update phase's budget
// defaults to what the model leaves: cuBLASLt's and the driver's own
// allocations, fragmentation. Under --gpu-memory, which counts dos's own
// allocations only, capMargin.
const (
	gpuMargin = 2 << 30
	capMargin = 256 << 20
)

// gpuTrainer is forward and backward on the GPU (gptcuda) for a Trainer
// with Device "cuda": the model reads the optimizer's device working copy
// and writes its gradients where the update phase reads them.
type gpuTrainer struct {
	dev     *cuda.Device
	s       *cuda.Stream
	k       *gptcuda.Kernels
	m       *gptcuda.Model // the training batch's
	sampler *gptcuda.Model // B = 1, made by the first Sample
	w, g    []uint64       // the optimizer's device views, in gpt.Config.Tensors order
	masters []uint64       // its fp32 DeviceMasters (0 for the others), same order
	logits  []float32      // one row, for sampling
	toks    []int32        // the sampler's window, padded to NCtx
	// activations is the model's device memory (gptcuda.MemoryBytes).
	activations int64
	// With offload.Options.OverlapBackward: the parameters (the optimizer's
	// indices) whose gradients are final after block l's backward
	// (blocks[l], ln_f's with the last block) and after the whole backward
	// (rest: the embeddings), for Optimizer.GradsFinal.
	blocks [][]int
	rest   []int
	opt    *offload.Optimizer
	stream offload.Stream // s, for GradsFinal
	// beforeBlock, for a ZeRO-3 rank (gpuRank.beforeBlock), is the
	// sampler's gptcuda.Model.BeforeBlock too; wait (gpuRank.wait) waits
	// for the sampler's forward before its logits are read.
	beforeBlock func(l int, backward bool) error
	wait        func() error
	// bs is the blocks streamed from host memory (TrainConfig.Streamed;
	// nil for none).
	bs *blockStream
}

// openGPU opens GPU ordinal (it shares the primary context with the
// optimizer's device), loads the GPT kernels and allocates the model's
// activations for batch rows (cfg.Batch, or a ZeRO-3 rank's
// cfg.Batch/cfg.GPUs).
//
// Errors: no GPU or no cuBLASLt (their reasons), out of device memory.
func openGPU(cfg *TrainConfig, ordinal, batch int) (*gpuTrainer, error) {
	if err := gpuAvailable(); err != nil {
		return nil, err
	}
	// The cap covers every allocation from here on, the optimizer's too
	// (the same ordinal), and a process-wide limit outlives this run:
	// set it either way.
	if err := cuda.SetMemoryLimit(ordinal, int64(cfg.GPUMemory*(1<<30))); err != nil {
		return nil, fmt.Errorf("trainer: --gpu-memory: %w", err)
	}
	d, err := cuda.Open(ordinal)
	if err != nil {
		return nil, fmt.Errorf("trainer: --device cuda: %w", err)
	}
	g := &gpuTrainer{dev: d}
	fail := func(err error) (*gpuTrainer, error) {
		return nil, errors.Join(fmt.Errorf("trainer: --device cuda: %w", err), g.close())
	}
	if g.s, err = d.NewStream(); err != nil {
		return fail(err)
	}
	if g.k, err = gptcuda.LoadKernels(d); err != nil {
		return fail(err)
	}
	opts := gptcuda.Options{Recompute: cfg.Recompute}
	if g.m, err = gptcuda.New(g.s, g.k, cfg.Model, batch, cfg.Model.NCtx, opts); err != nil {
		return fail(err)
	}
	g.activations = gptcuda.MemoryBytes(cfg.Model, batch, cfg.Model.NCtx, opts)
	if n := cfg.Streamed(); n > 0 {
		if g.bs, err = newBlockStream(d, g.s, cfg.Model, n); err != nil {
			return fail(err)
		}
	}
	return g, nil
}

// plan sets the update phase's budget and schedule in o: GPUBudget, when
// cfg leaves it 0, to what the model left (budget), less the sampler's
// model when the run samples; with neither --profile
// nor --schedule, the performance model's schedule from a short
// calibration of this machine's CPU and GPU rates (calibrate).
func (g *gpuTrainer) plan(cfg *TrainConfig, o *offload.Options, out io.Writer) error {
	deviceMasters(cfg, o)
	if g.bs != nil {
		o.OffloadParam = streamedNames(cfg.Model, g.bs.n)
	}
	if cfg.GPUBudget == 0 {
		b, err := g.budget(cfg, o, offloadParams(cfg.Model), 1)
		if err != nil {
			return err
		}
		o.GPUBudget = b
	}
	if cfg.Profile != "" || cfg.Schedule != "" {
		return nil
	}
	p, err := g.calibrate(o, 1, out)
	o.Profile, o.Schedule = p, nil
	return err
}

// deviceMasters names in o.DeviceMasters the tensors the GPU model reads
// in fp32 (gptcuda.FP32Tensors), unless cfg.BF16Params.
func deviceMasters(cfg *TrainConfig, o *offload.Options) {
	if cfg.BF16Params {
		return
	}
	ts := cfg.Model.Tensors()
	for _, i := range gptcuda.FP32Tensors(cfg.Model) {
		o.DeviceMasters = append(o.DeviceMasters, ts[i].Name)
	}
}

// calibrate measures this machine's CPU and GPU rates for the performance
// model at reduced sizes (offload.Calibrate on o's device, a few seconds,
// said on out) with o's CPU workers and gradient dtype, ranks (ZeRO-3's,
// each with o's workers) calibrations of the CPU at once, and returns the
// profile.
func (g *gpuTrainer) calibrate(o *offload.Options, ranks int, out io.Writer) (*offload.Profile, error) {
	start := time.Now()
	fmt.Fprintf(out, "calibrating the update phase (no --profile: dos calibrate writes one that skips this)...\n")
	p, err := offload.Calibrate(o.Device, cpuThreads(o), o.GradDType, max(ranks, 1))
	if err != nil {
		return nil, fmt.Errorf("trainer: %w", err)
	}
	fmt.Fprintf(out, "calibrated in %.1f s\n", time.Since(start).Seconds())
	return p, nil
}

// cpuThreads is the optimizer's worker count: Options.Threads, or
// GOMAXPROCS.
func cpuThreads(o *offload.Options) int {
	if o.Threads > 0 {
		return o.Threads
	}
	return workers()
}

// gpuAvailable says why --device cuda cannot train here: no CUDA driver or
// device first (cuda.Available), then no cuBLASLt.
func gpuAvailable() error {
	if err := cuda.Available(); err != nil {
		return fmt.Errorf("trainer: --device cuda: no GPU: %w", err)
	}
	if err := cublas.Available(); err != nil {
		return fmt.Errorf("trainer: --device cuda: %w", err)
	}
	return nil
}

// budget returns the update phase's default GPU budget in bytes for an
// optimizer over params on g's GPU, which share ranks (ZeRO-3's; 1 alone)
// split evenly: the device memory free now (after the models' activations
// and, with ranks, their replicas) over share, less what offload.New
// allocates outside the budget (the gradients, the working copy and the
// fp32 DeviceMasters of params, but for o.OffloadParam's, which are in
// host memory), less the sampler's model when the run samples, less a
// margin.
func (g *gpuTrainer) budget(cfg *TrainConfig, o *offload.Options, params []offload.Param, share int) (int64, error) {
	free, _, err := g.dev.MemInfo()
	if err != nil {
		return 0, fmt.Errorf("trainer: --device cuda: %w", err)
	}
	margin := int64(gpuMargin)
	if limit := cuda.MemoryLimit(g.dev.Ordinal); limit > 0 { // --gpu-memory: what the cap leaves
		free, margin = min(free, limit-cuda.MemoryUsed(g.dev.Ordinal)), capMargin
	}
	elems, masters := 0, int64(0)
	for _, p := range params {
		n := 1
		for _, d := range p.Shape {
			n *= d
		}
		if slices.Contains(o.OffloadParam, p.Name) {
			continue
		}
		elems += n
		if slices.Contains(o.DeviceMasters, p.Name) {
			masters += 4 * int64(n)
		}
	}
	b := (free-margin)/int64(share) - o.DeviceBytes(elems) - masters
	if cfg.SampleBytes > 0 { // room for the sampler's B = 1 model, made at the end (every rank samples)
		b -= gptcuda.MemoryBytes(cfg.Model, 1, cfg.Model.NCtx, samplerOptions)
	}
	return max(b, 1), nil // 1, not 0: offload reads 0 as no limit
}

// bind takes the optimizer's device views (and its fp32 DeviceMasters,
// which the model then reads) and brings its state to the device.
func (g *gpuTrainer) bind(opt *offload.Optimizer) error {
	n := len(opt.Params())
	g.w, g.g, g.masters = make([]uint64, n), make([]uint64, n), make([]uint64, n)
	for _, name := range opt.Options().DeviceMasters {
		i, err := opt.Index(name)
		if err != nil {
			return err
		}
		m, err := opt.DeviceMaster(i)
		if err != nil {
			return err
		}
		g.masters[i] = m.Ptr
	}
	if err := g.m.SetMasters(g.masters); err != nil {
		return err
	}
	streamed := make([]bool, n)
	if g.bs != nil {
		for _, name := range opt.Options().OffloadParam {
			i, err := opt.Index(name)
			if err != nil {
				return err
			}
			streamed[i] = true
		}
		if err := g.bs.bind(opt, g.w, g.g); err != nil {
			return err
		}
		g.beforeBlock = g.bs.before
		g.m.BeforeBlock(g.bs.before)
	}
	for i := range n {
		if streamed[i] {
			continue
		}
		w, err := opt.DeviceWorking(i)
		if err != nil {
			return err
		}
		gr, err := opt.DeviceGrad(i)
		if err != nil {
			return err
		}
		g.w[i], g.g[i] = w.Ptr, gr.Ptr
	}
	g.overlap(opt)
	if g.bs != nil {
		g.bs.invalidate()
	}
	return opt.SyncDevice()
}

// overlap tells opt, with Options.OverlapBackward, which gradients are
// final as the backward goes (gptcuda.Model.OnBlockBackward): block l's
// tensors after its backward (ln_f's with the last block's), the
// embeddings' at the end (step). The update phase's work that needs no
// global value then starts during the backward.
func (g *gpuTrainer) overlap(opt *offload.Optimizer) {
	g.blocks, g.rest = nil, nil
	var final func(l int) error
	if opt.Options().OverlapBackward {
		g.blocks, g.rest = finalAfter(g.m.Config().NLayer)
		g.opt, g.stream = opt, offload.CUDAStream(g.s)
		final = func(l int) error { return opt.GradsFinal(g.stream, g.blocks[l]...) }
	}
	switch {
	case g.bs != nil && final != nil:
		g.m.OnBlockBackward(func(l int) error { return errors.Join(g.bs.after(l), final(l)) })
	case g.bs != nil:
		g.m.OnBlockBackward(g.bs.after)
	default:
		g.m.OnBlockBackward(final)
	}
}

// step runs forward and backward on a batch with the loss scaled by scale
// and returns the mean loss; the gradients are complete on the device when
// it returns (Loss waits for the stream). afterForward, when not nil, runs
// between the two (the traced iteration's mark).
func (g *gpuTrainer) step(inputs, targets []int32, scale float32, afterForward func() error) (float64, error) {
	if err := g.m.Forward(g.w, inputs, targets, scale); err != nil {
		return 0, err
	}
	if afterForward != nil {
		if err := afterForward(); err != nil {
			return 0, err
		}
	}
	if err := g.m.Backward(g.w, g.g); err != nil {
		return 0, err
	}
	if g.bs != nil {
		if err := g.bs.end(); err != nil {
			return 0, err
		}
	}
	if g.rest != nil {
		if err := g.opt.GradsFinal(g.stream, g.rest...); err != nil {
			return 0, err
		}
	}
	return g.m.Loss()
}

// loss returns the mean loss of a batch without gradients.
func (g *gpuTrainer) loss(inputs, targets []int32) (float64, error) {
	if err := g.m.Forward(g.w, inputs, targets, 0); err != nil {
		return 0, err
	}
	return g.m.Loss()
}

// next returns the logits after the tokens of window (at most NCtx) for
// sampling, on a B = 1 model made at the first call.
func (g *gpuTrainer) next(cfg *TrainConfig, window []int32) ([]float32, error) {
	T := cfg.Model.NCtx
	if g.sampler == nil {
		m, err := gptcuda.New(g.s, g.k, cfg.Model, 1, T, samplerOptions)
		if err != nil {
			return nil, err
		}
		if err := m.SetMasters(g.masters); err != nil {
			m.Close()
			return nil, err
		}
		m.BeforeBlock(g.beforeBlock)
		g.sampler = m
		g.logits, g.toks = make([]float32, cfg.Model.VocabSize), make([]int32, T)
	}
	clear(g.toks)
	copy(g.toks, window)
	if g.wait != nil { // a ZeRO-3 rank: Forward starts with its stream's Sync
		if err := g.wait(); err != nil {
			return nil, err
		}
	}
	if err := g.sampler.Forward(g.w, g.toks, nil, 0); err != nil {
		return nil, err
	}
	if g.wait != nil {
		if err := g.wait(); err != nil {
			return nil, err
		}
	}
	if err := g.sampler.LogitsAt(len(window)-1, g.logits); err != nil {
		return nil, err
	}
	return g.logits, nil
}

// memory returns the device memory in use, in bytes, and the total: under
// --gpu-memory what dos allocated and the cap.
func (g *gpuTrainer) memory() (used, total int64) {
	if limit := cuda.MemoryLimit(g.dev.Ordinal); limit > 0 {
		return cuda.MemoryUsed(g.dev.Ordinal), limit
	}
	free, total, err := g.dev.MemInfo()
	if err != nil {
		return 0, 0
	}
	return total - free, total
}

// close frees the models, the kernels, the stream and the device handle.
func (g *gpuTrainer) close() error {
	if g == nil {
		return nil
	}
	var errs []error
	if g.bs != nil {
		errs = append(errs, g.bs.close())
		g.bs = nil
	}
	for _, m := range []**gptcuda.Model{&g.sampler, &g.m} {
		if *m != nil {
			errs = append(errs, (*m).Close())
			*m = nil
		}
	}
	if g.k != nil {
		errs = append(errs, g.k.Close())
		g.k = nil
	}
	if g.s != nil {
		errs = append(errs, g.s.Free())
		g.s = nil
	}
	if g.dev != nil {
		errs = append(errs, g.dev.Close())
		g.dev = nil
	}
	return errors.Join(errs...)
}

// finalAfter sorts GPT-2's tensors (gpt.Config.Tensors indices, which are
// the optimizer's: offloadParams) by when gptcuda's backward has written
// their final gradients: blocks[l] after block l's backward (its
// gpt.PerLayer tensors from gpt.LayerBase(l), and ln_f's with the last
// block, written before the blocks), rest after the whole backward (wte,
// whose gradient is summed at both ends, and wpe).
func finalAfter(layers int) (blocks [][]int, rest []int) {
	blocks = make([][]int, layers)
	for l := range blocks {
		for k := range gpt.PerLayer {
			blocks[l] = append(blocks[l], gpt.LayerBase(l)+k)
		}
	}
	if layers > 0 {
		blocks[layers-1] = append(blocks[layers-1], gpt.LayerBase(layers)+gpt.LnfW, gpt.LayerBase(layers)+gpt.LnfB)
	}
	return blocks, []int{gpt.Wte, gpt.Wpe}
}
