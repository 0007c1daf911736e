package trainer

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/deepstates/dos/internal/comm"
	"github.com/deepstates/dos/offload"
)

// A run is a world of ranks (one, or ZeRO-3's TrainConfig.GPUs), and each
// rank is a replica of the model and the offload.Optimizer that owns its
// parameters (all of them alone, its pieces under ZeRO-3: shardParams).
// The trainer's loop (Run, Evaluate, Sample) steps the world and never
// asks where a replica runs: the replica constructors (newWorld) decide
// once, and each kind of replica has one forward and backward path.
//
//   - hostReplica: forward and backward in Go on the host (Model), its
//     weights read from its optimizer (hostLocal) or all-gathered from the
//     ranks' pieces over internal/comm (hostGathered, ZeRO-3 on the host).
//   - gpuReplica: forward and backward on one GPU (gptcuda), each block's
//     weights from its weightSource: resident in device memory or streamed
//     from pinned host memory block by block (localSource, one GPU), or
//     all-gathered from the peers over NCCL (gatherSource, ZeRO-3 on GPUs).

// replica is where forward and backward run for one rank: it is bound to
// the rank's optimizer once, then runs the iterations' passes. Every
// method but close runs on the rank's own goroutine (world.each).
type replica interface {
	// bind points the model at opt's buffers (its working copy and its
	// gradients, or the replica's own that it converts or gathers from
	// them) and brings opt's state to its device.
	bind(opt *offload.Optimizer) error
	// refresh brings in the current weights for a pass outside the
	// iteration (Evaluate, Sample): after an update the replica's
	// copies are stale.
	refresh() error
	// forward runs (enqueues) the forward of the rank's rows of a batch
	// for a backward of the loss scaled by scale. mark, when not nil,
	// runs once forward is done (the device synchronised first): the
	// traced iteration's time. While the optimizer's StepAsync phase
	// runs, a replica whose overlapsUpdate says so reads each block's
	// weights after Optimizer.WaitParams; the others are called only
	// after WaitStep.
	forward(inputs, targets []int32, scale float32, mark func()) error
	// backward runs the backward of the last forward and returns the
	// rows' mean loss; the gradients are where the optimizer reads them
	// when it returns (a non-finite loss leaves a NaN gradient, which
	// skips the step). Never while a StepAsync phase runs.
	backward() (float64, error)
	// overlapsUpdate says whether forward may run while the optimizer's
	// StepAsync phase runs (it waits for each block's weights).
	overlapsUpdate() bool
	// loss returns the rows' mean loss without gradients, the weights
	// refreshed before.
	loss(inputs, targets []int32) (float64, error)
	// next returns the logits (VocabSize of them) after the tokens of
	// window (at most NCtx) on a B = 1 model, the weights refreshed
	// before.
	next(window []int32) ([]float32, error)
	// memory returns the device memory in use and the total, in bytes
	// (0, 0 on the host).
	memory() (used, total int64)
	// describe returns the lines the run's header says of the replica
	// (its device memory, the blocks it streams), "" for none.
	describe(cfg *TrainConfig) string
	// close frees what the replica allocated; a second call does
	// nothing.
	close() error
}

// rank is one rank of the world: its replica, its optimizer and the
// device that optimizer's update phase runs on, and its end of the
// host communicator (nil alone) for the scalars (the loss, the
// gradient norm's sum of squares).
type rank struct {
	r            int
	rep          replica
	opt          *offload.Optimizer
	closeDev     func()
	c            comm.Comm
	gradOnDevice bool    // the replica writes the gradients into the optimizer's device memory
	scalar       [8]byte // the scalars' all-reduce
	loss         float64 // this iteration's loss, the ranks' mean
	res          offload.StepResult
	err          error
}

// world is a run's ranks. Alone (job false) its one rank reads and writes
// its optimizer's buffers directly; in a ZeRO-3 job (TrainConfig.GPUs > 1,
// or one rank through that path: zeroOneRank) rank r of n holds piece r of
// every tensor (pieceOf) and the replicas gather and reduce-scatter.
type world struct {
	cfg   TrainConfig // the run's, as the replicas read it (newWorld's copy)
	n     int
	job   bool
	lens  []int // each tensor's elements
	piece []int // each tensor's elements per rank's piece: ceil(len/n)
	ranks []*rank
	// gpus is how many GPUs the replicas run on (0 on the host);
	// collectives says how a job's replicas communicate, for the
	// header.
	gpus        int
	collectives string
	// early, on one GPU where StreamAuto streams, holds the optimizer's
	// device, opened before the replica (profileFirst; rank 0 closes
	// it), and profile the calibration made then; nil otherwise.
	early   *offload.Options
	profile *offload.Profile
	// failed is set by the first rank that fails (each): the GPU ranks
	// then stop waiting on their streams and issuing collectives.
	failed atomic.Bool
	// abort, for a job, aborts what a failed rank's peers could wait on
	// (each): the collectives' ends but NCCL's (first), then after
	// every goroutine returned all of them (all).
	abort func(rk *rank, err error, all bool)
}

// newWorld opens the run's ranks for cfg: each rank's replica (on the
// GPU first, so that the update phase's budget is taken from what the
// model leaves: on one GPU its activations, the block slots of
// TrainConfig.Streamed's blocks; under ZeRO-3 also its replicas of the
// whole tensors) and each rank's optimizer, on its own device (cfg.Device,
// a ZeRO-3 GPU rank's "cuda:N"), with its share of the CPU workers, and
// on the GPU its fp32 masters on the device (deviceMasters), its budget
// (gpuReplica.budget, when cfg.GPUBudget is 0) and, with neither
// --profile nor --schedule, the profile of one calibration of this
// machine (said on out) every rank plans its own subgroups with. The host
// replicas' models come with bind.
//
// Errors: the device's, the profile's, the replica's (out of device
// memory) or the optimizer's; everything opened is closed again.
func newWorld(cfg *TrainConfig, out io.Writer) (*world, error) {
	w := &world{cfg: *cfg, n: 1, job: cfg.GPUs > 1 || zeroOneRank != ""}
	cfg = &w.cfg
	if w.job {
		w.n = max(cfg.GPUs, 1)
	}
	for _, t := range cfg.Model.Tensors() {
		w.lens = append(w.lens, t.Numel())
		w.piece = append(w.piece, (t.Numel()+w.n-1)/w.n)
	}
	if w.job {
		for r, end := range comm.NewLocal(w.n) {
			w.ranks = append(w.ranks, &rank{r: r, c: end})
		}
	} else {
		w.ranks = []*rank{{r: 0}}
	}
	fail := func(err error) (*world, error) { return nil, errors.Join(err, w.close()) }
	// The replicas. ordinals[r] is rank r's GPU (-1 on the host).
	ordinals := make([]int, w.n)
	var gpus []*gpuReplica
	switch {
	case cfg.Device == "cuda" && w.job:
		gs, err := w.openGPUs(cfg)
		if err != nil {
			return fail(err)
		}
		gpus = gs
	case cfg.Device == "cuda":
		if err := w.profileFirst(cfg, out); err != nil {
			return fail(err)
		}
		g, err := openLocal(cfg)
		if err != nil {
			return fail(err)
		}
		w.ranks[0].rep, w.ranks[0].gradOnDevice = g, true
		gpus = []*gpuReplica{g}
	case w.job:
		w.collectives = "an in-process communicator"
		for _, rk := range w.ranks {
			rk.rep = &hostReplica{cfg: cfg, rows: cfg.Batch / w.n, weights: &hostGathered{w: w, rk: rk, cfg: cfg}}
		}
	default:
		w.ranks[0].rep = &hostReplica{cfg: cfg, rows: cfg.Batch, weights: &hostLocal{cfg: cfg}}
	}
	seen := map[int]bool{}
	for r := range ordinals {
		ordinals[r] = -1
		if gpus != nil {
			ordinals[r] = gpus[r].dev.Ordinal
			seen[ordinals[r]] = true
		}
	}
	w.gpus = len(seen)
	// The optimizers' options, rank by rank.
	opts, params := make([]offload.Options, w.n), make([][]offload.Param, w.n)
	for _, rk := range w.ranks {
		oo := cfg.optimizerOptions()
		spec := cfg.Device
		params[rk.r] = offloadParams(cfg.Model)
		if w.job {
			if cfg.Threads == 0 {
				oo.Threads = max(1, runtime.GOMAXPROCS(0)/w.n)
			}
			if ordinals[rk.r] >= 0 {
				spec = fmt.Sprintf("cuda:%d", ordinals[rk.r])
			}
			params[rk.r] = shardParams(cfg.Model, w.n, rk.r)
		}
		if rk.r == 0 && w.early != nil { // opened before the replica, and closed with the rank
			oo.Device = w.early.Device
			if err := cfg.configureDevice(oo); err != nil {
				return fail(err)
			}
		} else {
			closeDev, err := cfg.deviceOn(oo, spec)
			if err != nil {
				return fail(err)
			}
			rk.closeDev = closeDev
		}
		if w.job && oo.Schedule != nil && cfg.Schedule == "" {
			// cfg.device's default split counts the whole model's
			// subgroups: this rank's share has fewer.
			var elems int
			for _, p := range params[rk.r] {
				elems += p.Shape[0]
			}
			s := offload.MixedSchedule(offload.SubgroupCount(elems, oo.SubgroupSize))
			oo.Schedule = &s
		}
		if cfg.Profile != "" {
			p, err := offload.LoadProfile(cfg.Profile, oo.Device)
			if err != nil {
				return fail(fmt.Errorf("trainer: --profile: %w", err))
			}
			oo.Profile = p
		}
		if gpus != nil {
			deviceMasters(cfg, oo)
			oo.OffloadParam = streamedNames(cfg.Model, gpus[rk.r].streamed())
			oo.OverlapBackward = !cfg.NoOverlap
			oo.Speculate = cfg.speculateBytes()
			oo.SpeculateLeave = cfg.SpeculateLeave
			oo.SpeculateGPU = cfg.SpeculateGPU
		}
		oo.Replan = cfg.Replan
		oo.ResidentFirst = cfg.ResidentFirst && oo.Device != nil
		opts[rk.r] = *oo
	}
	// The budgets once every rank's replica is allocated and before any
	// optimizer's: each rank's share of its GPU.
	for r, g := range gpus {
		if cfg.GPUBudget != 0 {
			break
		}
		share := 0
		for _, o := range ordinals {
			if o == ordinals[r] {
				share++
			}
		}
		b, err := g.budget(cfg, &opts[r], params[r], share)
		if err != nil {
			return fail(err)
		}
		opts[r].GPUBudget = b
	}
	if gpus != nil && cfg.Profile == "" && cfg.Schedule == "" {
		p := w.profile // profileFirst's calibration, before the replica
		if p == nil {
			room, err := gpus[0].room()
			if err != nil {
				return fail(err)
			}
			if p, err = calibrate(&opts[0], w.n, room, out); err != nil {
				return fail(err)
			}
		}
		for r := range opts {
			opts[r].Profile, opts[r].Schedule = p, nil
		}
	}
	started := time.Now()
	for _, rk := range w.ranks {
		var err error
		if rk.opt, err = offload.New(params[rk.r], opts[rk.r]); err != nil {
			if w.job {
				err = fmt.Errorf("trainer: rank %d: %w", rk.r, err)
			}
			return fail(err)
		}
	}
	if el := time.Since(started); el > time.Second { // a large model's pinned host memory: said, as the calibration is
		fmt.Fprintf(out, "the optimizer's state allocated in %.1f s\n", el.Seconds())
	}
	return w, nil
}

// setParam writes tensor i's values (all its elements) into every rank's
// optimizer: alone the whole tensor, in a job each rank's piece.
func (w *world) setParam(i int, name string, v []float32) error {
	for _, rk := range w.ranks {
		lo, hi := pieceOf(w.lens[i], w.n, rk.r)
		if err := rk.opt.SetParam(name, v[lo:hi]); err != nil {
			if w.job {
				return fmt.Errorf("trainer: rank %d: %w", rk.r, err)
			}
			return err
		}
	}
	return nil
}

// bind binds every rank's replica to its optimizer.
func (w *world) bind() error {
	return w.each(func(rk *rank) error { return rk.rep.bind(rk.opt) })
}

// each runs f on every rank and returns the error of the rank that
// failed first. Alone it runs f here and returns its error as it is. In a
// job each rank runs on its own goroutine; a rank that fails sets
// w.failed, which ends the other GPU ranks' waits on their streams
// (gatherSource.wait) and refuses their next collectives, and aborts its
// own end of the host communicator (internal/comm's Local) and of a
// staged device one, which releases every rank from its collectives on
// the host. NCCL's ends are aborted all together once every rank's
// goroutine has returned (NCCL wants every rank of a node to abort, and
// its abort frees what a rank still inside NCCL, or a peer's kernels,
// may use), and then no collective queued on a stream waits for a rank
// that stopped. After a failure the run stops: a failed save too.
func (w *world) each(f func(rk *rank) error) error {
	if !w.job {
		rk := w.ranks[0]
		rk.err = f(rk)
		return rk.err
	}
	var wg sync.WaitGroup
	var first atomic.Pointer[rank]
	for _, rk := range w.ranks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if rk.err = f(rk); rk.err != nil {
				first.CompareAndSwap(nil, rk)
				w.failed.Store(true)
				rk.c.Abort(rk.err)
				if w.abort != nil {
					w.abort(rk, rk.err, false)
				}
			}
		}()
	}
	wg.Wait()
	fr := first.Load()
	if fr == nil {
		return nil
	}
	if w.abort != nil {
		w.abort(fr, fr.err, true)
	}
	return fmt.Errorf("trainer: rank %d: %w", fr.r, fr.err)
}

// errRankFailed is a GPU rank's error when it stopped because another
// rank failed (world.failed).
var errRankFailed = errors.New("stopped: another rank failed")

// rows returns rank r's rows of a batch's tokens x (B*T of them): the
// r-th of n equal parts.
func (w *world) rows(x []int32, r int) []int32 {
	k := len(x) / w.n
	return x[r*k : (r+1)*k]
}

// allReduce returns the ranks' op (comm.Avg, comm.Sum) of v (every rank
// calls it); alone, v.
func (rk *rank) allReduce(v float64, op comm.Op) (float64, error) {
	if rk.c == nil {
		return v, nil
	}
	binary.LittleEndian.PutUint64(rk.scalar[:], math.Float64bits(v))
	if err := rk.c.AllReduce(rk.scalar[:], rk.scalar[:], comm.F64, op); err != nil {
		return 0, err
	}
	return math.Float64frombits(binary.LittleEndian.Uint64(rk.scalar[:])), nil
}

// forward runs the forward of every rank over its rows of inputs and
// targets; mark (the traced iteration's) runs on rank 0.
func (w *world) forward(inputs, targets []int32, scale float32, mark func()) error {
	return w.each(func(rk *rank) error {
		m := mark
		if rk.r != 0 {
			m = nil
		}
		return rk.rep.forward(w.rows(inputs, rk.r), w.rows(targets, rk.r), scale, m)
	})
}

// backward runs every rank's backward of its last forward and returns
// the ranks' mean loss. A rank whose loss is not finite still takes part
// in every collective (its gradient then carries the NaN to the step,
// which skips).
func (w *world) backward() (float64, error) {
	err := w.each(func(rk *rank) error {
		loss, err := rk.rep.backward()
		if err != nil {
			return err
		}
		rk.loss, err = rk.allReduce(loss, comm.Avg)
		return err
	})
	return w.ranks[0].loss, err
}

// overlapsUpdate says whether every rank's forward may run while its
// optimizer's StepAsync phase runs.
func (w *world) overlapsUpdate() bool {
	for _, rk := range w.ranks {
		if !rk.rep.overlapsUpdate() {
			return false
		}
	}
	return true
}

// refresh brings every replica's weights in for the passes outside the
// iteration (Evaluate's, Sample's).
func (w *world) refresh() error {
	return w.each(func(rk *rank) error { return rk.rep.refresh() })
}

// loss returns the ranks' mean loss of a batch without gradients, each
// rank's forward on its rows.
func (w *world) loss(inputs, targets []int32) (float64, error) {
	return w.meanLoss(inputs, targets, func(rk *rank, in, tg []int32) (float64, error) { return rk.rep.loss(in, tg) })
}

// meanLoss runs f on every rank over its rows of inputs and targets and
// returns the ranks' mean of what f returns (all-reduced in a job).
func (w *world) meanLoss(inputs, targets []int32, f func(rk *rank, in, tg []int32) (float64, error)) (float64, error) {
	err := w.each(func(rk *rank) error {
		loss, err := f(rk, w.rows(inputs, rk.r), w.rows(targets, rk.r))
		if err != nil {
			return err
		}
		rk.loss, err = rk.allReduce(loss, comm.Avg)
		return err
	})
	return w.ranks[0].loss, err
}

// next returns rank 0's logits after the tokens of window for sampling.
// On GPUs every rank runs its B = 1 model on window (a job's blocks'
// gathers are collectives); on the host a replica holds the whole weights
// once refreshed, and rank 0's alone runs.
func (w *world) next(window []int32) ([]float32, error) {
	if w.gpus == 0 {
		return w.ranks[0].rep.next(window)
	}
	var logits []float32
	err := w.each(func(rk *rank) error {
		l, err := rk.rep.next(window)
		if rk.r == 0 {
			logits = l
		}
		return err
	})
	return logits, err
}

// stepAsync begins every rank's optimizer step (offload.Optimizer.
// StepAsync), the sums of squares all-reduced in a job, and returns rank
// 0's result so far (the ranks agree on skipped, norm and clip); waitStep
// ends them.
func (w *world) stepAsync(args offload.StepArgs) (offload.StepResult, error) {
	err := w.each(func(rk *rank) error {
		a := args
		a.GradOnDevice = rk.gradOnDevice
		if rk.c != nil {
			a.Reduce = rk.reduce
		}
		var err error
		rk.res, err = rk.opt.StepAsync(a)
		return err
	})
	if err != nil {
		_, _ = w.waitStep() // the ranks whose step began
	}
	return w.ranks[0].res, err
}

// waitStep waits for every rank's step that stepAsync began and returns
// rank 0's result.
func (w *world) waitStep() (offload.StepResult, error) {
	err := w.each(func(rk *rank) error {
		var err error
		rk.res, err = rk.opt.WaitStep()
		return err
	})
	return w.ranks[0].res, err
}

// reduce is the rank's StepArgs.Reduce in a job: the sum of the ranks'
// sums of squares.
func (rk *rank) reduce(ss float64) (float64, error) { return rk.allReduce(ss, comm.Sum) }

// setLR sets every rank's learning rate.
func (w *world) setLR(lr float64) error {
	for _, rk := range w.ranks {
		if err := rk.opt.SetLR(lr); err != nil {
			return err
		}
	}
	return nil
}

// memory returns rank 0's device memory in use and its total (0, 0 on
// the host).
func (w *world) memory() (used, total int64) { return w.ranks[0].rep.memory() }

// where says where forward and backward run, for the run's first line.
func (w *world) where() string {
	switch {
	case w.job && w.gpus > 0:
		return fmt.Sprintf("GPUs, ZeRO-3 over %d ranks (each steps its 1/%d of every tensor; %s)", w.n, w.n, w.collectives)
	case w.job:
		return fmt.Sprintf("CPU, ZeRO-3 over %d ranks (each steps its 1/%d of every tensor; %s)", w.n, w.n, w.collectives)
	case w.gpus > 0:
		return "GPU"
	}
	return "CPU"
}

// close closes every rank's replica (first: its stream's work reads the
// optimizer's device memory), optimizer, device and end of the
// communicator; a second call does nothing.
func (w *world) close() error {
	var errs []error
	for _, rk := range w.ranks {
		if rk.rep != nil {
			errs = append(errs, rk.rep.close())
			rk.rep = nil
		}
	}
	for _, rk := range w.ranks {
		if rk.opt != nil {
			errs = append(errs, rk.opt.Close())
			rk.opt = nil
		}
		if rk.closeDev != nil {
			rk.closeDev()
			rk.closeDev = nil
		}
		if rk.c != nil {
			rk.c.Close()
			rk.c = nil
		}
	}
	return errors.Join(errs...)
}

var (
	_ replica = (*hostReplica)(nil)
	_ replica = (*gpuReplica)(nil)
)
