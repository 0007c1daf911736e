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

// gpuReplica is forward and backward on one GPU (gptcuda): the model
// reads each block's weights where its weightSource puts them and writes
// its gradients where the source takes them to the optimizer.
type gpuReplica struct {
	dev     *cuda.Device
	s       *cuda.Stream
	k       *gptcuda.Kernels
	m       *gptcuda.Model // the training batch's
	sampler *gptcuda.Model // B = 1, made by the first next
	cfg     *TrainConfig
	src     weightSource
	// w, g are the tensors' device addresses the model reads and writes
	// (gpt.Config.Tensors order) and masters its fp32 master weights (0
	// for the others), all set by src.bind.
	w, g    []uint64
	masters []uint64
	logits  []float32 // one row, for sampling
	toks    []int32   // the sampler's window, padded to NCtx
	// activations is the model's device memory (gptcuda.MemoryBytes).
	activations int64
	// beforeBlock is the training model's BeforeBlock (src.bind's), the
	// sampler's too.
	beforeBlock func(l int, backward bool) error
}

// weightSource is where a GPU replica's weights come from, block by
// block, and where its gradients go: resident in the optimizer's device
// memory or streamed from pinned host memory (localSource), or
// all-gathered from the ZeRO-3 ranks' pieces (gatherSource).
type weightSource interface {
	// bind sets the replica's w, g and masters for opt, and the model's
	// hooks.
	bind(opt *offload.Optimizer) error
	// refresh enqueues what brings the current weights in before a
	// pass (the tensors outside the blocks, for a job).
	refresh() error
	// end enqueues what the backward's end hands to the optimizer (the
	// gradients outside the blocks, the streamed blocks' last copies).
	end() error
	// wait returns once the model's stream is done with what is
	// enqueued on it where a bare Sync could wait for ever (a job's peer
	// stopped); nil at once where gptcuda's own syncs do.
	wait() error
	// streamed returns how many blocks stream from host memory.
	streamed() int
	// overlapsUpdate says whether the forward waits for each block's
	// weights of a StepAsync phase under way (Optimizer.WaitParams), so
	// that it may run before WaitStep.
	overlapsUpdate() bool
	// describe returns the header's line of the blocks streamed ("" for
	// none) and a note on the replica's own device memory for the GPU
	// memory line ("" for none).
	describe(cfg *TrainConfig) (line, memNote string)
	close() error
}

// openGPU opens GPU ordinal (it shares the primary context with the
// optimizer's device), loads the GPT kernels and allocates the model's
// activations for batch rows (cfg.Batch, or a ZeRO-3 rank's
// cfg.Batch/cfg.GPUs). The caller sets its weight source.
//
// Errors: no GPU or no cuBLASLt (their reasons), out of device memory.
func openGPU(cfg *TrainConfig, ordinal, batch int) (*gpuReplica, error) {
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
	g := &gpuReplica{dev: d, cfg: cfg}
	fail := func(err error) (*gpuReplica, error) {
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
	return g, nil
}

// openLocal opens the one GPU of a run alone, its weights resident but
// for the first streamed blocks' (TrainConfig.Streamed), whose slots it
// allocates.
func openLocal(cfg *TrainConfig) (*gpuReplica, error) {
	g, err := openGPU(cfg, 0, cfg.Batch)
	if err != nil {
		return nil, err
	}
	src := &localSource{g: g}
	g.src = src
	if n := cfg.Streamed(); n > 0 {
		if src.bs, err = newBlockStream(g.dev, g.s, cfg.Model, n); err != nil {
			return nil, errors.Join(fmt.Errorf("trainer: --device cuda: %w", err), g.close())
		}
	}
	return g, nil
}

// profileFirst, on one GPU where --stream-blocks auto streams (cfg.Streamed
// > 0, no --schedule), opens the optimizer's device before the replica
// (w.early; rank 0 closes it), gets the performance model's profile (cfg.Profile's,
// or a calibration then, in the whole cap: w.profile) and sets the count of
// streamed blocks by it (TrainConfig.ChooseStreamed), said on out. Elsewhere it does
// nothing.
//
// Errors: no GPU, the device's, the profile's or the calibration's, the
// model's.
func (w *world) profileFirst(cfg *TrainConfig, out io.Writer) error {
	if cfg.StreamBlocks != StreamAuto || cfg.Schedule != "" || cfg.Streamed() == 0 {
		return nil
	}
	if err := gpuAvailable(); err != nil {
		return err
	}
	if err := cuda.SetMemoryLimit(0, int64(cfg.GPUMemory*(1<<30))); err != nil {
		return fmt.Errorf("trainer: --gpu-memory: %w", err)
	}
	o := cfg.optimizerOptions()
	dev, release, err := offload.OpenDevice("cuda")
	if err != nil {
		return fmt.Errorf("trainer: --device cuda: %w", err)
	}
	o.Device, w.early, w.ranks[0].closeDev = dev, o, release
	fewest := cfg.Streamed()
	var p *offload.Profile
	if cfg.Profile != "" {
		if p, err = offload.LoadProfile(cfg.Profile, dev); err != nil {
			return fmt.Errorf("trainer: --profile: %w", err)
		}
	} else {
		// Nothing is allocated yet: what the cap leaves (and the device
		// has free) less its margin.
		d, err := cuda.Open(0)
		if err != nil {
			return fmt.Errorf("trainer: --device cuda: %w", err)
		}
		room, err := deviceRoom(d) // the cap is set: what it leaves, at most what is free
		if cerr := d.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("trainer: --device cuda: %w", cerr)
		}
		if err != nil {
			return err
		}
		if p, err = calibrate(o, 1, room, out); err != nil {
			return err
		}
		w.profile = p
	}
	sweep, pick, err := cfg.ChooseStreamed(p, cpuThreads(o))
	if err != nil || pick < 0 {
		return err
	}
	n := sweep[pick].Blocks
	cfg.resolveSpeculate() // --speculate auto: half of what this count leaves
	if n == fewest {
		return nil
	}
	at, without := sweep[pick], ""
	for _, sc := range sweep {
		if sc.Blocks == fewest {
			without = fmt.Sprintf("; without the model %d: %.0f ms, %.2f GiB", fewest, 1e3*sc.Update.Makespan, float64(sc.Budget)/gibBytes)
		}
	}
	fmt.Fprintf(out, "--stream-blocks auto: %d blocks, the fewest within 2 %% of the performance model's fastest update phase (%.0f ms predicted, a %.2f GiB budget%s)\n",
		n, 1e3*at.Update.Makespan, float64(at.Budget)/gibBytes, without)
	return nil
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
// each with o's workers) calibrations of the CPU at once, in at most
// room bytes of device memory (gpuReplica.room before the optimizers
// allocate theirs; smaller sizes where it is short), and returns the
// profile.
func calibrate(o *offload.Options, ranks int, room int64, out io.Writer) (*offload.Profile, error) {
	start := time.Now()
	fmt.Fprintf(out, "calibrating the update phase (no --profile: dos calibrate writes one that skips this)...\n")
	if room < offload.CalibrationBytes {
		fmt.Fprintf(out, "  at reduced sizes: %d MiB of device memory free\n", max(room, 0)>>20)
	}
	p, err := offload.Calibrate(o.Device, cpuThreads(o), o.GradDType, max(ranks, 1), max(room, 1))
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
func (g *gpuReplica) budget(cfg *TrainConfig, o *offload.Options, params []offload.Param, share int) (int64, error) {
	room, err := g.room()
	if err != nil {
		return 0, err
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
	b := room/int64(share) - o.DeviceBytes(elems) - masters
	if cfg.SampleBytes > 0 { // room for the sampler's B = 1 model, made at the end (every rank samples)
		b -= gptcuda.MemoryBytes(cfg.Model, 1, cfg.Model.NCtx, samplerOptions)
	}
	return max(b, 1), nil // 1, not 0: offload reads 0 as no limit
}

// room returns the device memory, in bytes, that g's GPU has free now
// less a margin: under --gpu-memory what the cap leaves less capMargin,
// otherwise cuMemGetInfo's free memory less gpuMargin (negative when
// less is free).
func (g *gpuReplica) room() (int64, error) { return deviceRoom(g.dev) }

// deviceRoom is gpuReplica.room on d.
func deviceRoom(d *cuda.Device) (int64, error) {
	free, _, err := d.MemInfo()
	if err != nil {
		return 0, fmt.Errorf("trainer: --device cuda: %w", err)
	}
	if limit := cuda.MemoryLimit(d.Ordinal); limit > 0 {
		return min(free, limit-cuda.MemoryUsed(d.Ordinal)) - capMargin, nil
	}
	return free - gpuMargin, nil
}

// streamed returns how many blocks stream from host memory.
func (g *gpuReplica) streamed() int { return g.src.streamed() }

func (g *gpuReplica) bind(opt *offload.Optimizer) error {
	n := len(opt.Params())
	g.w, g.g, g.masters = make([]uint64, n), make([]uint64, n), make([]uint64, n)
	if err := g.src.bind(opt); err != nil {
		return err
	}
	if err := g.m.SetMasters(g.masters); err != nil {
		return err
	}
	g.m.BeforeBlock(g.beforeBlock)
	return opt.SyncDevice()
}

func (g *gpuReplica) refresh() error { return g.src.refresh() }

func (g *gpuReplica) forward(inputs, targets []int32, scale float32, mark func()) error {
	if err := g.src.refresh(); err != nil {
		return err
	}
	if err := g.src.wait(); err != nil { // Forward starts with its stream's Sync
		return err
	}
	if err := g.m.Forward(g.w, inputs, targets, scale); err != nil {
		return err
	}
	if mark != nil {
		if err := g.src.wait(); err != nil {
			return err
		}
		if err := g.s.Sync(); err != nil {
			return err
		}
		mark()
	}
	return nil
}

func (g *gpuReplica) backward() (float64, error) {
	if err := g.m.Backward(g.w, g.g); err != nil {
		return 0, err
	}
	if err := g.src.end(); err != nil {
		return 0, err
	}
	if err := g.src.wait(); err != nil {
		return 0, err
	}
	return g.m.Loss() // waits for the stream: the gradients are complete
}

func (g *gpuReplica) overlapsUpdate() bool { return g.src.overlapsUpdate() }

func (g *gpuReplica) loss(inputs, targets []int32) (float64, error) {
	if err := g.src.wait(); err != nil {
		return 0, err
	}
	if err := g.m.Forward(g.w, inputs, targets, 0); err != nil {
		return 0, err
	}
	if err := g.src.wait(); err != nil {
		return 0, err
	}
	return g.m.Loss()
}

func (g *gpuReplica) next(window []int32) ([]float32, error) {
	cfg := g.cfg
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
	if err := g.src.wait(); err != nil {
		return nil, err
	}
	if err := g.sampler.Forward(g.w, g.toks, nil, 0); err != nil {
		return nil, err
	}
	if err := g.src.wait(); err != nil {
		return nil, err
	}
	if err := g.sampler.LogitsAt(len(window)-1, g.logits); err != nil {
		return nil, err
	}
	return g.logits, nil
}

// memory returns the device memory in use, in bytes, and the total: under
// --gpu-memory what dos allocated and the cap.
func (g *gpuReplica) memory() (used, total int64) {
	if limit := cuda.MemoryLimit(g.dev.Ordinal); limit > 0 {
		return cuda.MemoryUsed(g.dev.Ordinal), limit
	}
	free, total, err := g.dev.MemInfo()
	if err != nil {
		return 0, 0
	}
	return total - free, total
}

func (g *gpuReplica) describe(cfg *TrainConfig) string {
	line, note := g.src.describe(cfg)
	used, total := g.memory()
	wait := "spin in the driver's scheduling"
	if g.s.Device().Sleeps {
		wait = "sleep (the context's blocking synchronization)"
	} else if cuda.CurrentHostWait() == cuda.WaitSleep {
		wait = "sleep on dos's events, spin on its streams (the context was made before dos's)"
	}
	return line + fmt.Sprintf("GPU memory: %.1f of %.1f GiB in use (model activations %.1f GiB%s)\nhost waits for the device: %s (%s=%v); host memory of the CPU workers: %s\n",
		float64(used)/(1<<30), float64(total)/(1<<30), float64(g.activations)/(1<<30), note, wait, cuda.WaitEnv, cuda.CurrentHostWait(), cuda.HugePages())
}

// close frees the weight source's buffers (after their streams' work),
// the models, the kernels, the stream and the device handle.
func (g *gpuReplica) close() error {
	if g == nil {
		return nil
	}
	var errs []error
	if g.src != nil {
		errs = append(errs, g.src.close())
		g.src = nil
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

// localSource is the weights of a GPU alone: resident in the optimizer's
// device memory (its working copy, gradients and fp32 masters, read and
// written in place), but for the first bs.n blocks' matrices and biases,
// which stream from its pinned host memory through two block slots
// (stream.go; nil bs: none). With offload.Options.OverlapBackward it
// tells the optimizer which gradients are final as the backward goes
// (gptcuda.Model.OnBlockBackward): block l's tensors after its backward
// (ln_f's with the last block's), the embeddings' at the end. The update
// phase's work that needs no global value then starts during the
// backward.
type localSource struct {
	g  *gpuReplica
	bs *blockStream
	// With the overlap: the parameters (the optimizer's indices) whose
	// gradients are final after block l's backward (blocks[l]) and after
	// the whole backward (rest), for Optimizer.GradsFinal.
	blocks [][]int
	rest   []int
	opt    *offload.Optimizer
	stream offload.Stream // the model's, for GradsFinal and WaitParams
}

func (l *localSource) bind(opt *offload.Optimizer) error {
	g, n := l.g, len(opt.Params())
	l.opt = opt
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
	streamed := make([]bool, n)
	if l.bs != nil {
		for b := range l.bs.n {
			for _, o := range streamedOffsets {
				streamed[gpt.LayerBase(b)+o] = true
			}
		}
		if err := l.bs.bind(opt, g.w, g.g); err != nil {
			return err
		}
		h2d := offload.CUDAStream(l.bs.h2d)
		l.bs.weightsReady = func(b int) error { return opt.WaitParams(h2d, gpt.LayerBase(b), gpt.LayerBase(b+1)) }
		l.bs.weightsReadyNow = func(b int) bool { return opt.ParamsReady(gpt.LayerBase(b), gpt.LayerBase(b+1)) }
	}
	l.stream = offload.CUDAStream(g.s)
	g.beforeBlock = l.before
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
	l.blocks, l.rest = nil, nil
	var final func(b int) error
	if opt.Options().OverlapBackward {
		l.blocks, l.rest = finalAfter(g.m.Config().NLayer)
		final = func(b int) error { return opt.GradsFinal(l.stream, l.blocks[b]...) }
		if l.bs != nil {
			// A streamed block's gradients are final once its D2H into the
			// host gradients is done (the d2h stream, after the model's
			// work so far): what a speculative update reads
			// (offload.Options.Speculate).
			d2h := offload.CUDAStream(l.bs.d2h)
			final = func(b int) error {
				if b < l.bs.n {
					return opt.GradsFinal(d2h, l.blocks[b]...)
				}
				return opt.GradsFinal(l.stream, l.blocks[b]...)
			}
		}
	}
	switch {
	case l.bs != nil && final != nil:
		g.m.OnBlockBackward(func(b int) error {
			if err := l.bs.after(b); err != nil {
				return err // its gradients did not move: nothing of it is final
			}
			return final(b)
		})
	case l.bs != nil:
		g.m.OnBlockBackward(l.bs.after)
	default:
		g.m.OnBlockBackward(final)
	}
	if l.bs != nil {
		l.bs.invalidate()
	}
	return nil
}

// refresh makes the model's stream wait for the weights of a StepAsync
// phase under way that the forward reads before block 0's BeforeBlock:
// wte, wpe and block 0's ln_1.
func (l *localSource) refresh() error { return l.opt.WaitParams(l.stream, 0, ln1End(0)) }

// ln1End is the index after block b's ln_1 parameters (gpt.Config.Tensors
// order): gptcuda's forward computes block b's ln_1 at the end of block
// b-1 (or after the embeddings), before block b's BeforeBlock.
func ln1End(b int) int { return gpt.LayerBase(b) + gpt.Ln1B + 1 }

// before is the model's BeforeBlock: in the forward, the model's stream
// waits for the weights of a StepAsync phase under way that block b reads
// (its own, and block b+1's ln_1, computed at its end; ln_f with the
// last); then the streamed blocks' slots (blockStream.before).
func (l *localSource) before(b int, backward bool) error {
	if !backward {
		hi := ln1End(b + 1)
		if b == l.g.m.Config().NLayer-1 {
			hi = len(l.g.w)
		}
		if err := l.opt.WaitParams(l.stream, gpt.LayerBase(b), hi); err != nil {
			return err
		}
	}
	if l.bs != nil {
		return l.bs.before(b, backward)
	}
	return nil
}

// overlapsUpdate: the forward waits for each block's weights (refresh,
// before, and blockStream.issue for a streamed block's copy).
func (l *localSource) overlapsUpdate() bool { return true }

func (l *localSource) end() error {
	if l.bs != nil {
		if err := l.bs.end(); err != nil {
			return err
		}
	}
	if l.rest != nil {
		return l.opt.GradsFinal(l.stream, l.rest...)
	}
	return nil
}

func (l *localSource) wait() error { return nil }

func (l *localSource) streamed() int {
	if l.bs == nil {
		return 0
	}
	return l.bs.n
}

func (l *localSource) describe(cfg *TrainConfig) (line, memNote string) {
	if l.bs == nil {
		return "", ""
	}
	held := 0
	for _, sg := range l.opt.Subgroups() {
		if sg.HostHeld {
			held++
		}
	}
	how := fmt.Sprint(l.bs.n)
	if cfg.StreamBlocks == StreamAuto {
		how = fmt.Sprintf("auto: %d", l.bs.n)
	}
	return fmt.Sprintf("weights from host memory: blocks 0..%d of %d (--stream-blocks %s): their matrices and biases, %.2f GiB of bf16 weights and gradients, in pinned host memory, copied to 2 block slots (%.2f GiB) before each forward and backward; their %d subgroups update on the CPU first, in place\n",
		l.bs.n-1, cfg.Model.NLayer, how, float64(int64(l.bs.n)*StreamedBlockBytes(cfg.Model))/(1<<30), float64(l.bs.bytes())/(1<<30), held), ""
}

func (l *localSource) close() error {
	err := l.bs.close()
	l.bs = nil
	return err
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
