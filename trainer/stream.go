package trainer

import (
	"errors"
	"fmt"

	"github.com/deepstates/dos/gpt"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/offload"
)

// Blocks streamed from host memory (TrainConfig.StreamBlocks), on one GPU:
// blocks 0..n-1 keep the bf16 working copy and the gradients of their
// matrices and biases (streamedOffsets, the tensors ZeRO-3's ranks gather
// block by block) in the optimizer's pinned host memory
// (offload.Options.OffloadParam), and the GPU holds two block slots of
// them, which the streamed blocks take in turn (block l slot l mod 2).
// Each iteration, on a copy stream of each direction, ordered against the
// model's stream by events:
//
//   - before block l's forward (gptcuda.Model.BeforeBlock), its weights
//     are in slot l mod 2 (copied H2D now unless they are there already),
//     and block l+1's copy into the other slot is enqueued, which runs
//     while block l computes, once block l-1 (the slot's last reader) is
//     done;
//   - before block l's backward (and recomputation), the same with block
//     l-1 next; the last two streamed blocks of the forward are still in
//     their slots;
//   - as block l's backward ends (OnBlockBackward), the GPU takes the
//     global gradient checks' partial sums of its gradients in slot l mod 2
//     (offload.Optimizer.HostGradOnDevice), then they go D2H into the
//     optimizer's host gradients (offload.Optimizer.HostGrad); block
//     l-2's backward, which writes the same slot, waits for both;
//   - when the backward ends, the model's stream waits for the last
//     gradient copy, so the gradients are on the host when Loss returns.
//
// The update phase then updates the streamed blocks on the CPU in place
// (scheduler.Options.HostHeld), and the next forward copies their new
// weights. DeepSpeed ZeRO-Infinity's offload_param and FSDP2's
// CPUOffloadPolicy move parameters the same way; the numerics are those
// of the resident run, bit for bit.

// StreamAuto is TrainConfig.StreamBlocks's automatic choice (--stream-blocks
// auto): as few blocks as the cap needs.
const StreamAuto = -1

// StreamReserve is the device memory, in bytes, that StreamAuto leaves the
// update phase under GPUMemory when streaming can: 2 GiB, room for some
// resident subgroups and the staging of the streamed ones.
const StreamReserve = 2 << 30

// Streamed returns how many blocks stream their weights from host memory
// (the first ones): StreamBlocks, or with StreamAuto none when the run fits
// under GPUMemory less CapMargin without (or there is no cap), else the
// count the performance model chose once the run has a profile
// (StreamSweep), else the fewest that leave the update phase
// StreamReserve, else the fewest that fit, else none (checkDeviceMemory
// refuses the run). 0 off the GPU and for ZeRO-3's ranks.
func (c *TrainConfig) Streamed() int { return c.streamedAt(c.Batch) }

// ChooseStreamed makes StreamAuto's count the one StreamSweep picks with
// profile p at threads CPU workers, where the run streams (Streamed > 0
// under StreamAuto), and returns StreamSweep's list and the index of the
// count taken; nil and -1, changing nothing, where it does not stream,
// StreamBlocks is a count, or no count fits. Streamed, DeviceMemory and
// MemoryBytes at c.Batch then count it. dos train does this once it has
// its profile, before it allocates.
//
// Errors: StreamSweep's.
func (c *TrainConfig) ChooseStreamed(p *offload.Profile, threads int) ([]StreamChoice, int, error) {
	if c.StreamBlocks != StreamAuto || c.Streamed() == 0 {
		return nil, -1, nil
	}
	sweep, pick, err := c.StreamSweep(p, threads)
	if err != nil || pick < 0 {
		return nil, -1, err
	}
	c.streamModel, c.streamKey = sweep[pick].Blocks, c.streamKeyNow()
	return sweep, pick, nil
}

// streamKey is what ChooseStreamed's count was chosen for: a copy of
// the config that differs in any of it counts its own.
type streamKey struct {
	batch     int
	gpuMemory float64
	recompute bool
	model     Config
	gpuBudget float64
	sample    int
}

func (c *TrainConfig) streamKeyNow() streamKey {
	return streamKey{batch: c.Batch, gpuMemory: c.GPUMemory, recompute: c.Recompute, model: c.Model, gpuBudget: c.GPUBudget, sample: c.SampleBytes}
}

// StreamChoice is one count of streamed blocks that StreamSweep weighed.
type StreamChoice struct {
	// Blocks is the count: blocks 0..Blocks-1 stream from host memory.
	Blocks int
	// Budget is the update phase's device memory under GPUMemory with
	// them, in bytes (DeviceMemory.BudgetLeft), and HostHeld their
	// parameters, which the CPU workers update first, in place.
	Budget, HostHeld int64
	// Update is the performance model's plan of the update phase
	// (offload.PredictUpdate: its schedule and Makespan in seconds).
	Update offload.Prediction
}

// StreamSweep weighs, for c on one GPU under GPUMemory, each count of
// streamed blocks (0 to NLayer) that leaves the update phase some device
// memory (DeviceMemory.BudgetLeft > 0; with GPUBudget set, at least that,
// and the budget is then GPUBudget) and whose host memory
// (MemoryBytes) is within what the run may use, by the update phase the
// performance model predicts with profile p and c's optimizer options
// (offload.PredictUpdate over the subgroups New would cut, at threads CPU
// workers), and returns them by count with the index of the one
// StreamAuto takes (-1 for none): where the run does not fit without
// streaming, the fastest count from 1 on, or the fewest within 2 % of
// it, since the forward and backward, which the model does not plan,
// copy each streamed block twice more. Counts below the fewest that fit
// are not in the list.
//
// Errors: the model's (offload.PredictUpdate).
func (c *TrainConfig) StreamSweep(p *offload.Profile, threads int) ([]StreamChoice, int, error) {
	capBytes := int64(c.GPUMemory * gibBytes)
	limit, _, _ := c.hostLimit()
	params := offloadParams(c.Model)
	var out []StreamChoice
	for n := 0; n <= c.Model.NLayer; n++ {
		at := *c
		at.StreamBlocks, at.streamModel = n, 0
		if at.Speculate == SpeculateAuto {
			at.specAuto = 0 // auto's slots take their share of what the count leaves, once chosen (resolveSpeculate)
		}
		left := at.DeviceMemory(c.Batch).BudgetLeft(capBytes)
		if given := int64(c.GPUBudget * gibBytes); given > 0 { // --gpu-budget: what the run's update phase gets
			if left < given {
				continue
			}
			left = given
		}
		if left <= 0 || at.MemoryBytes() > limit {
			continue
		}
		o := at.optimizerOptions()
		deviceMasters(&at, o)
		o.OffloadParam = streamedNames(c.Model, n)
		o.Profile, o.GPUBudget, o.Threads, o.SubgroupSizes = p, left, threads, c.SubgroupSizes
		o.OverlapBackward = !c.NoOverlap
		pr, err := offload.PredictUpdate(params, *o)
		if err != nil {
			return nil, -1, fmt.Errorf("trainer: %d blocks streamed: %w", n, err)
		}
		out = append(out, StreamChoice{Blocks: n, Budget: left, HostHeld: int64(n * blockStreamedElems(c.Model)), Update: *pr})
	}
	pick := -1
	if auto := *c; auto.StreamBlocks == StreamAuto && auto.streamedAt(c.Batch) > 0 {
		fastest := -1
		for i, sc := range out {
			if sc.Blocks > 0 && (fastest < 0 || sc.Update.Makespan < out[fastest].Update.Makespan) {
				fastest = i
			}
		}
		for i, sc := range out {
			if fastest >= 0 && sc.Blocks > 0 && sc.Update.Makespan <= 1.02*out[fastest].Update.Makespan {
				pick = i
				break
			}
		}
	}
	return out, pick, nil
}

// streamedAt is Streamed at batch rows (the model's count only at
// c.Batch, the batch it was chosen for).
func (c *TrainConfig) streamedAt(batch int) int {
	if c.Device != "cuda" || c.GPUs > 1 || c.StreamBlocks == 0 {
		return 0
	}
	if c.StreamBlocks > 0 {
		return min(c.StreamBlocks, c.Model.NLayer)
	}
	if c.GPUMemory <= 0 {
		return 0
	}
	// Every threshold is the cap less CapMargin, what the run keeps
	// aside: then a batch fits (DeviceMemory within it) exactly when some
	// count of blocks makes it fit, which grows with the batch, so
	// LargestBatch's bisection holds.
	safe := int64(c.GPUMemory*gibBytes) - CapMargin
	zero := c.deviceMemory(batch, 0)
	if zero.Total() <= safe {
		return 0 // it fits as it is
	}
	if c.streamModel > 0 && c.streamKey == c.streamKeyNow() && batch == c.Batch { // the performance model's count (ChooseStreamed)
		return c.streamModel
	}
	for _, room := range []int64{safe - StreamReserve, safe} {
		if n, ok := c.fewestStreamed(batch, zero, room); ok {
			return n
		}
	}
	return 0 // nothing fits: checkDeviceMemory says what would
}

// fewestStreamed returns the fewest blocks (1 to NLayer) whose weights
// from host memory make batch rows fit in room bytes of device memory,
// false for none; zero is deviceMemory(batch, 0). From one block on, each
// saves the same bytes (its weights and gradients; the slots are there
// from the first), so the count follows in closed form.
func (c *TrainConfig) fewestStreamed(batch int, zero DeviceMemory, room int64) (int, bool) {
	one := c.deviceMemory(batch, 1)
	per := zero.WeightsGrads - one.WeightsGrads
	n := 1
	if over := one.Total() - room; over > 0 {
		if per <= 0 {
			return 0, false
		}
		n += int((over + per - 1) / per)
	}
	// Where the calibration's floor is more than what stays (a tiny
	// model's), each block saves less than per: count on.
	for n <= c.Model.NLayer && c.deviceMemory(batch, n).Total() > room {
		n++
	}
	return n, n <= c.Model.NLayer
}

// streamedNames returns the names of the streamed tensors of blocks
// 0..n-1 (offload.Options.OffloadParam).
func streamedNames(cfg Config, n int) []string {
	ts := cfg.Tensors()
	var names []string
	for l := range n {
		for _, o := range streamedOffsets {
			names = append(names, ts[gpt.LayerBase(l)+o].Name)
		}
	}
	return names
}

// blockStreamedElems returns the elements of one block's streamed
// tensors.
func blockStreamedElems(cfg Config) int {
	ts := cfg.Tensors()
	n := 0
	for _, o := range streamedOffsets {
		n += ts[gpt.LayerBase(0)+o].Numel()
	}
	return n
}

// slotLayout returns where each streamed tensor (by its index in
// streamedOffsets) starts in a block slot of bf16 elements, in bytes, each
// replicaAlign-aligned, and the slot's bytes.
func slotLayout(cfg Config) (off []int64, bytes int64) {
	ts := cfg.Tensors()
	for _, o := range streamedOffsets {
		off = append(off, bytes)
		bytes = alignUp(bytes+2*int64(ts[gpt.LayerBase(0)+o].Numel()), replicaAlign)
	}
	return off, bytes
}

// slotBytes returns one block slot's device memory: the weights' and the
// gradients' (both bf16).
func slotBytes(cfg Config) int64 {
	_, b := slotLayout(cfg)
	return 2 * b
}

// blockStream is the GPU trainer's streamed blocks (see above).
type blockStream struct {
	n          int          // blocks 0..n-1 stream
	h2d, d2h   *cuda.Stream // the copy streams
	work, grad *cuda.Buffer // the two slots of weights, of gradients
	slot       int64        // bytes of one slot in work and grad
	off        []int64      // slotLayout's, by streamedOffsets index
	// ready orders a copy stream after the model's stream's work so far;
	// loaded[s] is slot s's last H2D, drained[s] its gradients' last
	// D2H, done the end of the backward's copies.
	ready, done     *cuda.Event
	loaded, drained [2]*cuda.Event
	holds           [2]int       // the block whose weights slot s holds (-1: none, or stale)
	at              int64        // the optimizer's step count when holds was last valid
	hw, hg          [][]hostSpan // per streamed block, per streamedOffsets: its host working copy and gradient
	opt             *offload.Optimizer
	d2hStream       offload.Stream // d2h as the optimizer names it
	model           *cuda.Stream   // the model's stream
	// weightsReady waits for block l's weights of a StepAsync phase under way
	// (Optimizer.WaitParams, the h2d stream's device waits and the host
	// wait for the CPU's updates of its host working copy) before issue
	// copies them; nil: none.
	weightsReady func(l int) error
	// weightsReadyNow says, without waiting, whether weightsReady(l)
	// would return at once (Optimizer.ParamsReady); nil: always.
	weightsReadyNow func(l int) bool
}

// hostSpan is a streamed tensor's place in pinned host memory.
type hostSpan struct {
	buf   *cuda.HostBuffer
	off   int64
	bytes int64
}

// newBlockStream allocates n streamed blocks' slots, streams and events
// on d for cfg's model, which runs on model.
func newBlockStream(d *cuda.Device, model *cuda.Stream, cfg Config, n int) (*blockStream, error) {
	b := &blockStream{n: n, model: model, holds: [2]int{-1, -1}, at: -1}
	b.off, b.slot = slotLayout(cfg)
	var err error
	fail := func(err error) (*blockStream, error) { return nil, errors.Join(err, b.close()) }
	if b.h2d, err = d.NewStream(); err != nil {
		return fail(err)
	}
	if b.d2h, err = d.NewStream(); err != nil {
		return fail(err)
	}
	for _, e := range b.events() {
		if *e, err = d.NewEvent(false); err != nil {
			return fail(err)
		}
	}
	if b.work, err = d.Alloc(2 * b.slot); err != nil {
		return fail(fmt.Errorf("the streamed blocks' weight slots: %w", err))
	}
	if b.grad, err = d.Alloc(2 * b.slot); err != nil {
		return fail(fmt.Errorf("the streamed blocks' gradient slots: %w", err))
	}
	return b, nil
}

func (b *blockStream) events() []**cuda.Event {
	return []**cuda.Event{&b.ready, &b.done, &b.loaded[0], &b.loaded[1], &b.drained[0], &b.drained[1]}
}

// bind points the model's weights and gradients of the streamed tensors
// (w, g: gpt.Config.Tensors order) at their slots and takes their host
// buffers from opt.
func (b *blockStream) bind(opt *offload.Optimizer, w, g []uint64) error {
	b.opt, b.d2hStream = opt, offload.CUDAStream(b.d2h)
	b.hw, b.hg = make([][]hostSpan, b.n), make([][]hostSpan, b.n)
	for l := range b.n {
		for j, o := range streamedOffsets {
			i := gpt.LayerBase(l) + o
			w[i] = b.work.Ptr() + uint64(int64(l%2)*b.slot+b.off[j])
			g[i] = b.grad.Ptr() + uint64(int64(l%2)*b.slot+b.off[j])
			hw, err := hostSpanOf(opt.HostWorking(i))
			if err != nil {
				return err
			}
			hg, err := hostSpanOf(opt.HostGrad(i))
			if err != nil {
				return err
			}
			b.hw[l], b.hg[l] = append(b.hw[l], hw), append(b.hg[l], hg)
		}
	}
	b.holds = [2]int{-1, -1}
	return nil
}

// hostSpanOf is t's pinned memory, which must be a CUDA device's.
func hostSpanOf(t offload.HostTensor, err error) (hostSpan, error) {
	if err != nil {
		return hostSpan{}, err
	}
	h, ok := t.Host.(*cuda.HostBuffer)
	if !ok {
		return hostSpan{}, fmt.Errorf("trainer: %s's host buffer is not a CUDA device's pinned memory (%T)", t.Name, t.Host)
	}
	return hostSpan{buf: h, off: t.Off, bytes: int64(len(t.Bytes))}, nil
}

// fresh forgets what the slots hold when the optimizer stepped since they
// were filled (the weights changed).
func (b *blockStream) fresh() {
	if at := b.opt.StepCount(); at != b.at {
		b.holds, b.at = [2]int{-1, -1}, at
	}
}

// invalidate forgets what the slots hold (SyncDevice, LoadCheckpoint or
// SetParam changed the weights).
func (b *blockStream) invalidate() { b.holds, b.at = [2]int{-1, -1}, -1 }

// issue enqueues block l's weights H2D into slot l mod 2 once the model's
// work so far (the slot's last reader among it) is done.
func (b *blockStream) issue(l int) error {
	s := l % 2
	b.holds[s] = -1
	if b.weightsReady != nil {
		if err := b.weightsReady(l); err != nil {
			return err
		}
	}
	if err := b.ready.Record(b.model); err != nil {
		return err
	}
	if err := b.h2d.Wait(b.ready); err != nil {
		return err
	}
	for j, h := range b.hw[l] {
		if err := b.h2d.CopyHtoD(b.work, int64(s)*b.slot+b.off[j], h.buf, h.off, h.bytes); err != nil {
			return err
		}
	}
	if err := b.loaded[s].Record(b.h2d); err != nil {
		return err
	}
	b.holds[s] = l
	return nil
}

// before is the model's BeforeBlock: block l's weights in their slot, its
// gradient slot free in the backward, the next streamed block's copy
// enqueued (l+1 forward, l-1 backward).
func (b *blockStream) before(l int, backward bool) error {
	if l == 0 && !backward || l == b.n-1 && backward {
		b.fresh()
	}
	if l < b.n {
		s := l % 2
		if b.holds[s] != l {
			if err := b.issue(l); err != nil {
				return err
			}
		}
		if err := b.model.Wait(b.loaded[s]); err != nil {
			return err
		}
		if backward {
			if err := b.model.Wait(b.drained[s]); err != nil {
				return err
			}
		}
	}
	next := l + 1
	if backward {
		next = l - 1
	}
	if next >= 0 && next < b.n && b.holds[next%2] != next {
		if !backward && b.weightsReadyNow != nil && !b.weightsReadyNow(next) {
			// Its update is still running (a forward over the update
			// phase): copying it now would hold block l's kernels back
			// until then; before(next) copies it once it is written.
			return nil
		}
		return b.issue(next)
	}
	return nil
}

// after is the model's OnBlockBackward for a streamed block l: its
// gradients D2H into the host gradients once its backward is done.
func (b *blockStream) after(l int) error {
	if l >= b.n {
		return nil
	}
	s := l % 2
	if err := b.ready.Record(b.model); err != nil {
		return err
	}
	if err := b.d2h.Wait(b.ready); err != nil {
		return err
	}
	// The global checks' sums of these gradients, taken in the slot on
	// the d2h stream before it copies them out (the slot's next writer
	// waits for drained, after both).
	for j, o := range streamedOffsets {
		if err := b.opt.HostGradOnDevice(b.d2hStream, gpt.LayerBase(l)+o, b.grad, (int64(s)*b.slot+b.off[j])/2); err != nil {
			return err
		}
	}
	for j, h := range b.hg[l] {
		if err := b.d2h.CopyDtoH(h.buf, h.off, b.grad, int64(s)*b.slot+b.off[j], h.bytes); err != nil {
			return err
		}
	}
	return b.drained[s].Record(b.d2h)
}

// end orders the model's stream after every gradient copy of the
// backward.
func (b *blockStream) end() error {
	if err := b.done.Record(b.d2h); err != nil {
		return err
	}
	return b.model.Wait(b.done)
}

// bytes returns the slots' device memory.
func (b *blockStream) bytes() int64 { return 4 * b.slot }

// close frees the slots, events and streams after their work.
func (b *blockStream) close() error {
	if b == nil {
		return nil
	}
	var errs []error
	for _, st := range []*cuda.Stream{b.h2d, b.d2h} {
		if st != nil {
			errs = append(errs, st.Sync())
		}
	}
	for _, e := range b.events() {
		if *e != nil {
			errs = append(errs, (*e).Free())
			*e = nil
		}
	}
	for _, buf := range []**cuda.Buffer{&b.work, &b.grad} {
		if *buf != nil {
			errs = append(errs, (*buf).Free())
			*buf = nil
		}
	}
	for _, st := range []**cuda.Stream{&b.h2d, &b.d2h} {
		if *st != nil {
			errs = append(errs, (*st).Free())
			*st = nil
		}
	}
	return errors.Join(errs...)
}

// StreamedBlockBytes returns the bf16 weights and gradients of one block's
// streamed tensors, in bytes: what each streamed block moves out of device
// memory.
func StreamedBlockBytes(cfg Config) int64 { return 4 * int64(blockStreamedElems(cfg)) }
