package trainer

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/internal/comm"
	"github.com/deepstates/dos/internal/nccl"
	"github.com/deepstates/dos/offload"
	"github.com/deepstates/dos/safetensors"
)

// ZeRO-3 data parallelism in one process (TrainConfig.GPUs > 1, on the host
// or --device sim): rank r of N holds piece r of every tensor (its
// ceil(numel/N) elements from r·ceil(numel/N): the last pieces shorter, or
// empty for a tensor of fewer than (N-1)·ceil(numel/N) elements) and
// that piece's optimizer state in its own offload.Optimizer, with its own
// device and its share of the CPU workers. Each iteration, every rank, on
// its own goroutine:
//
//  1. all-gathers each tensor's working copy from the ranks' pieces
//     (comm.AllGather) into its replica of the model's parameters;
//  2. runs forward and backward on its B/N rows of the global batch;
//  3. reduce-scatters each tensor's gradient (comm.ReduceScatter, Avg: the
//     gradient of the mean loss over the global batch) into its piece;
//  4. steps its optimizer, the gradient norm and the non-finite check made
//     global by an all-reduce of the sums of squares (offload.StepArgs
//     Reduce), so that every rank clips and skips alike.
//
// The loss reported is the ranks' mean (an all-reduce). The communicator is
// comm.Local; with NCCL (planned) the same calls run between GPUs. The
// trajectory matches one rank's with the same global batch within float
// tolerance: the ranks' partial sums associate differently
// (TestZeROMatchesOneRank).

// zeroRanks is the ranks of a ZeRO-3 run.
type zeroRanks struct {
	n     int
	lens  []int // each tensor's elements
	piece []int // each tensor's elements per rank's piece: ceil(len/n)
	// failed is set by the first rank that fails (each): the GPU ranks
	// then stop waiting on their streams and issuing collectives.
	failed atomic.Bool
	ranks  []*zeroRank
	// Lazy saves (saveLazily): each rank's engine on its rank root, made
	// at the first save, and the handles of the last save, whose step the
	// job commits once all are durable (commitLazy).
	engines  []*checkpoint.Engine
	last     []*checkpoint.Handle
	lastStep int64
	// For the retention at close: the job root, --ckpt-keep, and the
	// step the job last committed (-1: none yet).
	root      string
	keep      int
	committed int64
	// abandoned says which lazy save failed ("" for none): the rank
	// roots that wrote it hold a step the job never committed, and each
	// engine keeps only --ckpt-keep+1 steps, so a later save would make
	// a rank's retention retire the job's committed step (before the
	// job commits the later one, or for good if it fails too). No lazy
	// save is started after it: --resume rewinds the rank roots first.
	abandoned string
}

// zeroRank is one rank: its end of the communicator, its optimizer over
// its pieces, its replica of the model (B/N rows) and the buffers of the
// collectives.
type zeroRank struct {
	r        int
	c        comm.Comm
	gpu      *gpuRank // with Device "cuda" (zerogpu.go): model, replicas and collectives there
	opt      *offload.Optimizer
	closeDev func()
	model    *Model[float32]
	params   [][]float32 // the whole tensors, all-gathered
	grads    [][]float32 // the whole tensors' gradients, before the reduce-scatter
	// One piece padded to ceil(len/n) elements, and one whole tensor
	// padded to n pieces, in fp32 and in 16 bits: the collectives'
	// buffers.
	piece32, full32 []float32
	piece16, full16 []uint16
	scalar          [8]byte // the loss's and the sum of squares' all-reduce
	loss            float64 // this iteration's loss, the ranks' mean
	res             offload.StepResult
	err             error
}

// shardParams returns rank r's pieces of c's tensors as the optimizer's
// parameters: each tensor's name, one dimension of its piece's length.
func shardParams(c Config, n, r int) []offload.Param {
	ts := c.Tensors()
	ps := make([]offload.Param, len(ts))
	for i, t := range ts {
		lo, hi := pieceOf(t.Numel(), n, r)
		ps[i] = offload.Param{Name: t.Name, Shape: []int{hi - lo}}
	}
	return ps
}

// pieceOf returns the elements [lo, hi) of a tensor of numel elements that
// rank r of n holds.
func pieceOf(numel, n, r int) (lo, hi int) {
	p := (numel + n - 1) / n
	return min(r*p, numel), min((r+1)*p, numel)
}

// newZero builds the n ranks' optimizers (each with its own device from
// cfg.Device and profile, GOMAXPROCS/n CPU workers unless cfg.Threads
// says, and, on a device without a profile or a --schedule, its own
// subgroups a third each on the CPU, streamed and resident) and the
// communicator. With Device "cuda" each rank's GPU, model and replicas
// come first (openGPUs), then one calibration (said on out) when there is
// neither --profile nor --schedule, whose profile every rank plans its
// own shard with, and each rank's update-phase budget from what its GPU
// has left, split between the ranks on it. The host's models come with
// bind.
//
// Errors: the device's, the profile's or the optimizer's.
func newZero(cfg *TrainConfig, n int, out io.Writer) (*zeroRanks, error) {
	z := &zeroRanks{n: n}
	for _, t := range cfg.Model.Tensors() {
		z.lens = append(z.lens, t.Numel())
		z.piece = append(z.piece, (t.Numel()+n-1)/n)
	}
	for r, end := range comm.NewLocal(n) {
		z.ranks = append(z.ranks, &zeroRank{r: r, c: end})
	}
	fail := func(err error) (*zeroRanks, error) { return nil, errors.Join(err, z.close()) }
	if cfg.Device == "cuda" {
		if err := z.openGPUs(cfg); err != nil {
			return fail(err)
		}
	}
	var calibrated *offload.Profile
	opts, params := make([]offload.Options, n), make([][]offload.Param, n)
	for _, rk := range z.ranks {
		oo := cfg.optimizerOptions()
		if cfg.Threads == 0 {
			oo.Threads = max(1, runtime.GOMAXPROCS(0)/n)
		}
		spec := cfg.Device
		if rk.gpu != nil {
			spec = fmt.Sprintf("cuda:%d", rk.gpu.g.dev.Ordinal)
		}
		closeDev, err := cfg.deviceOn(oo, spec)
		if err != nil {
			return fail(err)
		}
		rk.closeDev = closeDev
		params[rk.r] = shardParams(cfg.Model, n, rk.r)
		if oo.Schedule != nil && cfg.Schedule == "" {
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
		if g := rk.gpu; g != nil {
			deviceMasters(cfg, oo)
			if cfg.Profile == "" && cfg.Schedule == "" {
				if calibrated == nil {
					if calibrated, err = g.g.calibrate(oo, n, out); err != nil {
						return fail(err)
					}
				}
				oo.Profile, oo.Schedule = calibrated, nil
			}
			oo.OverlapBackward = !cfg.NoOverlap
		}
		oo.Replan = cfg.Replan
		opts[rk.r] = *oo
	}
	// The budgets once every rank's model and replicas are allocated and
	// before any optimizer's: each rank's share of its GPU.
	for _, rk := range z.ranks {
		if rk.gpu != nil && cfg.GPUBudget == 0 {
			b, err := rk.gpu.g.budget(cfg, &opts[rk.r], params[rk.r], z.share(rk.r))
			if err != nil {
				return fail(err)
			}
			opts[rk.r].GPUBudget = b
		}
	}
	for _, rk := range z.ranks {
		var err error
		if rk.opt, err = offload.New(params[rk.r], opts[rk.r]); err != nil {
			return fail(fmt.Errorf("trainer: rank %d: %w", rk.r, err))
		}
	}
	return z, nil
}

// setParam writes tensor i's values into every rank's piece.
func (z *zeroRanks) setParam(i int, name string, v []float32) error {
	for _, rk := range z.ranks {
		lo, hi := pieceOf(z.lens[i], z.n, rk.r)
		if err := rk.opt.SetParam(name, v[lo:hi]); err != nil {
			return fmt.Errorf("trainer: rank %d: %w", rk.r, err)
		}
	}
	return nil
}

// bind gives every rank its replica of the model for B/n rows and the
// collectives' buffers, or on GPUs binds each rank's model to its
// optimizer's device memory (gpuRank.bind).
func (z *zeroRanks) bind(cfg *TrainConfig) error {
	if z.ranks[0].gpu != nil {
		for _, rk := range z.ranks {
			if err := rk.gpu.bind(rk.opt, cfg); err != nil {
				return fmt.Errorf("trainer: rank %d: %w", rk.r, err)
			}
		}
		return nil
	}
	largest := 0
	for i := range z.lens {
		largest = max(largest, z.n*z.piece[i])
	}
	for _, rk := range z.ranks {
		rk.model = NewModel[float32](cfg.Model, cfg.Batch/z.n, cfg.Model.NCtx)
		rk.params, rk.grads = make([][]float32, len(z.lens)), make([][]float32, len(z.lens))
		for i, l := range z.lens {
			rk.params[i], rk.grads[i] = make([]float32, l), make([]float32, l)
		}
		rk.full32, rk.piece32 = make([]float32, largest), make([]float32, largest/z.n)
		if cfg.WorkingDType != 0 {
			rk.full16, rk.piece16 = make([]uint16, largest), make([]uint16, largest/z.n)
		}
	}
	return nil
}

// gather writes the whole working copy into params (one fp32 slice per
// tensor) from the ranks' pieces, read in place: Evaluate's and Sample's
// weights, outside the iteration.
func (z *zeroRanks) gather(params [][]float32, wd adam.DType) {
	for _, rk := range z.ranks {
		for i := range z.lens {
			lo, hi := pieceOf(z.lens[i], z.n, rk.r)
			w := rk.opt.Working(i)
			if wd == 0 {
				copy(params[i][lo:hi], w.Float32())
			} else {
				adam.Widen16(wd, params[i][lo:hi], w.Uint16())
			}
		}
	}
}

// each runs f on every rank, one goroutine each, and returns the error of
// the rank that failed first. A rank that fails sets z.failed, which ends
// the other GPU ranks' waits on their streams (gpuRank.wait) and refuses
// their next collectives, and aborts its own end of the host communicator
// (internal/comm's Local) and of a staged one, which releases every rank
// from its collectives on the host. NCCL's ends are aborted all together
// once every rank's goroutine has returned (NCCL wants every rank of a
// node to abort, and its abort frees what a rank still inside NCCL, or a
// peer's kernels, may use), and then no collective queued on a stream
// waits for a rank that stopped. After a failure the run stops: a failed
// save too.
func (z *zeroRanks) each(f func(rk *zeroRank) error) error {
	var wg sync.WaitGroup
	var first atomic.Pointer[zeroRank]
	for _, rk := range z.ranks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if rk.err = f(rk); rk.err != nil {
				first.CompareAndSwap(nil, rk)
				z.failed.Store(true)
				rk.c.Abort(rk.err)
				if rk.gpu != nil && rk.gpu.c != nil {
					if _, isNCCL := rk.gpu.c.(*nccl.Comm); !isNCCL {
						rk.gpu.c.Abort(rk.err)
					}
				}
			}
		}()
	}
	wg.Wait()
	fr := first.Load()
	if fr == nil {
		return nil
	}
	for _, rk := range z.ranks {
		if rk.gpu != nil && rk.gpu.c != nil {
			rk.gpu.c.Abort(fr.err)
		}
	}
	return fmt.Errorf("trainer: rank %d: %w", fr.r, fr.err)
}

// errRankFailed is a GPU rank's error when it stopped because another
// rank failed (zeroRanks.failed).
var errRankFailed = errors.New("stopped: another rank failed")

// forwardBackward runs steps 1-3 of the iteration on every rank over its
// rows of inputs and targets and returns the ranks' mean loss. A rank
// whose loss is not finite still takes part in every collective (its
// gradient then carries the NaN to the Step, which skips).
func (z *zeroRanks) forwardBackward(cfg *TrainConfig, inputs, targets []int32, scale float32) (float64, error) {
	err := z.each(func(rk *zeroRank) error {
		in, tg := z.rows(inputs, rk.r), z.rows(targets, rk.r)
		if rk.gpu != nil {
			loss, err := rk.gpu.forwardBackward(in, tg, scale)
			if err != nil {
				return err
			}
			return rk.allReduceLoss(loss)
		}
		wd := cfg.WorkingDType
		for i, l := range z.lens {
			p := z.piece[i]
			w := rk.opt.Working(i)
			if wd == 0 {
				send, full := rk.piece32[:p], rk.full32[:p*z.n]
				clear(send[copy(send, w.Float32()):]) // the last piece's padding
				if err := rk.c.AllGather(safetensors.Float32View(send), safetensors.Float32View(full), comm.F32); err != nil {
					return err
				}
				copy(rk.params[i], full[:l])
				continue
			}
			send, full := rk.piece16[:p], rk.full16[:p*z.n]
			clear(send[copy(send, w.Uint16()):])
			if err := rk.c.AllGather(safetensors.Uint16View(send), safetensors.Uint16View(full), comm.BF16); err != nil {
				return err
			}
			adam.Widen16(wd, rk.params[i], full[:l])
		}
		loss := float64(rk.model.Forward(rk.params, in, tg))
		if math.IsNaN(loss) || math.IsInf(loss, 0) {
			for _, g := range rk.grads {
				clear(g)
			}
			rk.grads[0][0] = float32(math.NaN())
		} else {
			rk.model.Backward(rk.params, rk.grads, scale)
		}
		for i, l := range z.lens {
			p := z.piece[i]
			lo, hi := pieceOf(l, z.n, rk.r)
			full, piece := rk.full32[:p*z.n], rk.piece32[:p]
			clear(full[copy(full, rk.grads[i]):])
			if err := rk.c.ReduceScatter(safetensors.Float32View(full), safetensors.Float32View(piece), comm.F32, comm.Avg); err != nil {
				return err
			}
			g := rk.opt.Grad(i)
			if cfg.GradDType == adam.F32 {
				copy(g.Float32(), piece[:hi-lo])
			} else {
				adam.Round16(cfg.GradDType, g.Uint16(), piece[:hi-lo])
			}
		}
		return rk.allReduceLoss(loss)
	})
	if err != nil {
		return 0, err
	}
	return z.ranks[0].loss, nil
}

// rows returns rank r's rows of a batch's tokens x (B*T of them): the
// r-th of n equal parts.
func (z *zeroRanks) rows(x []int32, r int) []int32 {
	k := len(x) / z.n
	return x[r*k : (r+1)*k]
}

// allReduceLoss sets rk.loss to the ranks' mean of loss (every rank calls
// it).
func (rk *zeroRank) allReduceLoss(loss float64) error {
	binary.LittleEndian.PutUint64(rk.scalar[:], math.Float64bits(loss))
	if err := rk.c.AllReduce(rk.scalar[:], rk.scalar[:], comm.F64, comm.Avg); err != nil {
		return err
	}
	rk.loss = math.Float64frombits(binary.LittleEndian.Uint64(rk.scalar[:]))
	return nil
}

// gatherGPU all-gathers every GPU rank's replica of the tensors outside
// the blocks (whose the models gather as they reach them), for Evaluate's
// and Sample's forward outside the iteration.
func (z *zeroRanks) gatherGPU() error {
	return z.each(func(rk *zeroRank) error { return rk.gpu.gatherWhole() })
}

// nextGPU returns the logits after the tokens of window for sampling:
// every GPU rank runs its B = 1 model on window (their blocks' gathers
// are collectives), and rank 0's logits are returned.
func (z *zeroRanks) nextGPU(cfg *TrainConfig, window []int32) ([]float32, error) {
	err := z.each(func(rk *zeroRank) error {
		_, err := rk.gpu.g.next(cfg, window)
		return err
	})
	return z.ranks[0].gpu.g.logits, err
}

// lossGPU returns the mean loss of a batch without gradients over the GPU
// ranks, each forward on its rows, the replicas gathered before
// (gatherGPU).
func (z *zeroRanks) lossGPU(inputs, targets []int32) (float64, error) {
	err := z.each(func(rk *zeroRank) error {
		loss, err := rk.gpu.loss(z.rows(inputs, rk.r), z.rows(targets, rk.r))
		if err != nil {
			return err
		}
		return rk.allReduceLoss(loss)
	})
	return z.ranks[0].loss, err
}

// step steps every rank's optimizer, the sums of squares all-reduced, and
// returns rank 0's result (the ranks agree on skipped, norm and clip).
func (z *zeroRanks) step(args offload.StepArgs) (offload.StepResult, error) {
	err := z.each(func(rk *zeroRank) error {
		a := args
		a.Reduce = func(ss float64) (float64, error) {
			binary.LittleEndian.PutUint64(rk.scalar[:], math.Float64bits(ss))
			if err := rk.c.AllReduce(rk.scalar[:], rk.scalar[:], comm.F64, comm.Sum); err != nil {
				return 0, err
			}
			return math.Float64frombits(binary.LittleEndian.Uint64(rk.scalar[:])), nil
		}
		var err error
		rk.res, err = rk.opt.Step(a)
		return err
	})
	return z.ranks[0].res, err
}

// rankObject is the object a rank's checkpoint records beside the
// trainer's: which piece of which job it holds, so that a rank root
// restored from another rank's files, or a rank root taken for a job's,
// is refused by name instead of loading another rank's pieces.
type rankObject struct {
	Rank  int `json:"rank"`
	Ranks int `json:"ranks"`
}

// rankObjectName is its name among the checkpoint's objects.
const rankObjectName = "zero"

// rankObjects returns objects with rank r of n's rankObject added.
func rankObjects(objects map[string]any, r, n int) map[string]any {
	out := make(map[string]any, len(objects)+1)
	for k, v := range objects {
		out[k] = v
	}
	out[rankObjectName] = rankObject{Rank: r, Ranks: n}
	return out
}

// CheckpointRank returns which rank of a job of ranks (dos train --gpus)
// the checkpoint c's pieces are, from the record dos train writes beside
// them (ok false for a checkpoint without it: a single rank's, or older).
// The manifest's rank and world size are the rank root's own, 0 of 1.
func CheckpointRank(c *checkpoint.Checkpoint) (rank, ranks int, ok bool) {
	var ro rankObject
	if err := c.Object(rankObjectName, &ro); err != nil {
		return 0, 0, false
	}
	return ro.Rank, ro.Ranks, true
}

// checkRank returns an error wrapping checkpoint.ErrCorrupt when the
// checkpoint whose objects are objs records another rank than r of n
// (rankObject); checkpoints without the record (older ones) pass.
func checkRank(objs map[string]json.RawMessage, dir string, r, n int) error {
	raw, ok := objs[rankObjectName]
	if !ok {
		return nil
	}
	var ro rankObject
	if err := json.Unmarshal(raw, &ro); err != nil {
		return fmt.Errorf("%s: object %q: %v: %w", dir, rankObjectName, err, checkpoint.ErrCorrupt)
	}
	if ro.Rank != r || ro.Ranks != n {
		return fmt.Errorf("%s holds rank %d's pieces of a job of %d ranks, where rank %d of %d is expected (rank directories moved or copied?): %w", dir, ro.Rank, ro.Ranks, r, n, checkpoint.ErrWrongRank)
	}
	return nil
}

// zeroSaveFault, when set (tests), runs before rank's save of step: an
// error fails that rank's save as a failed write would.
var zeroSaveFault func(rank int, step int64) error

// save writes every rank's pieces of step, with objects, into its root
// under the job root root (checkpoint.RankRoot), synchronously (--ckpt-sync; saveLazily otherwise), the ranks
// in parallel; once all are durable it commits the step for the job
// (checkpoint.CommitJob) and, with keep > 0, keeps the newest keep steps
// in every rank root. It returns the bytes written. A rank that fails
// leaves the job's latest at the previous step (its error, by rank); the
// ranks that wrote the step are rewound at the next resume.
func (z *zeroRanks) save(root string, step int64, objects map[string]any, keep int) (int, error) {
	if err := checkpoint.BeginJob(checkpoint.OS, root, z.n); err != nil {
		return 0, err
	}
	bytes := make([]int, z.n)
	err := z.each(func(rk *zeroRank) error {
		if f := zeroSaveFault; f != nil {
			if err := f(rk.r, step); err != nil {
				return err
			}
		}
		snap, err := rk.opt.Snapshot(rankObjects(objects, rk.r, z.n))
		if err != nil {
			return err
		}
		snap.Step = step
		if _, err := checkpoint.Save(checkpoint.OS, checkpoint.RankRoot(root, rk.r), snap); err != nil {
			return err
		}
		for _, tn := range snap.Tensors {
			for _, b := range tn.Data {
				bytes[rk.r] += len(b)
			}
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("%w (the job's latest checkpoint is unchanged)", err)
	}
	total := 0
	for _, b := range bytes {
		total += b
	}
	if err := checkpoint.CommitJob(checkpoint.OS, root, z.n, step); err != nil {
		return 0, err
	}
	if keep > 0 {
		for r := range z.n {
			if err := checkpoint.Retain(checkpoint.OS, checkpoint.RankRoot(root, r), keep); err != nil {
				return total, err
			}
		}
	}
	return total, nil
}

// saveLazily hands every rank's pieces of step, with objects, to the
// rank's own lazy engine (checkpoint.Engine on checkpoint.RankRoot(root,
// r), ringBytes of staging each) and returns once each rank's capture has
// started: the ranks' saves run in the background, and the job's latest
// moves to step only when all are durable (commitLazy, which the caller
// runs for the previous save first). Each rank root keeps keep+1 steps (0:
// all) while the saves run: its newest save is durable before the job
// commits it, and the job's latest, one save behind until then, must stay
// in every rank root (close retires the extra one).
//
// Errors: a previous save not yet committed (commitLazy first); a rank
// whose save cannot start (its error, by rank: the job's latest is
// unchanged, the other ranks' saves of step go on and are rewound at the
// next resume).
func (z *zeroRanks) saveLazily(root string, step int64, objects map[string]any, keep int, ringBytes int64) error {
	if z.last != nil {
		return fmt.Errorf("the lazy save of step %d is not committed yet (commitLazy first)", z.lastStep)
	}
	if z.abandoned != "" {
		return fmt.Errorf("no checkpoint of step %d saved: %s, and its ranks' rank roots keep one step more than --ckpt-keep, the job's committed one among them: a later save would let their retention retire it; resume the job (dos train --resume) to save again", step, z.abandoned)
	}
	if err := checkpoint.BeginJob(checkpoint.OS, root, z.n); err != nil {
		return err
	}
	if z.engines == nil {
		z.root, z.keep, z.committed = root, keep, -1
		if keep > 0 {
			keep++
		}
		for r := range z.n {
			e, err := checkpoint.NewEngine(checkpoint.OS, checkpoint.RankRoot(root, r),
				checkpoint.EngineOptions{ChunkBytes: checkpoint.DefaultChunkBytes, RingBytes: ringBytes, Keep: keep})
			if err != nil {
				return fmt.Errorf("rank %d: checkpoint engine: %w", r, err)
			}
			z.engines = append(z.engines, e)
		}
	}
	z.last, z.lastStep = make([]*checkpoint.Handle, z.n), step
	var errs []error
	for _, rk := range z.ranks {
		if f := zeroSaveFault; f != nil {
			if err := f(rk.r, step); err != nil {
				errs = append(errs, fmt.Errorf("rank %d: %w", rk.r, err))
				continue
			}
		}
		h, err := rk.opt.SaveAsync(z.engines[rk.r], step, rankObjects(objects, rk.r, z.n))
		if err != nil {
			errs = append(errs, fmt.Errorf("rank %d: %w", rk.r, err))
			continue
		}
		z.last[rk.r] = h
	}
	if len(errs) > 0 {
		z.last = nil // abandoned: the job never commits step
		z.abandoned = fmt.Sprintf("the lazy save of step %d failed (the job's latest is still step %d)", step, z.committed)
		return fmt.Errorf("%w (the job's latest checkpoint is unchanged)", errors.Join(errs...))
	}
	return nil
}

// commitLazy commits the last lazy save's step for the job
// (checkpoint.CommitJob) once every rank's save of it is durable: with
// wait it waits for them, without it returns -1 while one is in flight.
// It returns the step committed (-1 for none).
//
// Errors: a rank's save that failed or never started (by rank: the job's
// latest is unchanged); CommitJob's.
func (z *zeroRanks) commitLazy(root string, wait bool) (int64, error) {
	if z.last == nil {
		return -1, nil
	}
	if !wait {
		for _, h := range z.last {
			if h != nil && !h.Done() {
				return -1, nil
			}
		}
	}
	hs, step := z.last, z.lastStep
	z.last = nil
	var errs []error
	for r, h := range hs {
		if h == nil {
			errs = append(errs, fmt.Errorf("rank %d: its save of step %d did not start", r, step))
			continue
		}
		if _, err := h.Wait(); err != nil {
			errs = append(errs, fmt.Errorf("rank %d: %w", r, err))
		}
	}
	if len(errs) > 0 {
		z.abandoned = fmt.Sprintf("the lazy save of step %d failed (the job's latest is still step %d)", step, z.committed)
		return -1, fmt.Errorf("checkpoint at iteration %d: %w (the job's latest checkpoint is unchanged)", step, errors.Join(errs...))
	}
	if err := checkpoint.CommitJob(checkpoint.OS, root, z.n, step); err != nil {
		return -1, err
	}
	z.committed = step
	return step, nil
}

// setLR sets every rank's learning rate.
func (z *zeroRanks) setLR(lr float64) error {
	for _, rk := range z.ranks {
		if err := rk.opt.SetLR(lr); err != nil {
			return err
		}
	}
	return nil
}

// close closes every rank's optimizer, device and end of the
// communicator; a second call does nothing.
func (z *zeroRanks) close() error {
	var errs []error
	for _, rk := range z.ranks {
		// The model and collectives first: their stream's work reads
		// the optimizer's device memory.
		errs = append(errs, rk.gpu.close())
		rk.gpu = nil
		if rk.opt != nil {
			errs = append(errs, rk.opt.Close())
			rk.opt = nil
		}
		if rk.closeDev != nil {
			rk.closeDev()
			rk.closeDev = nil
		}
		rk.c.Close()
	}
	// After the optimizers: a lazy save's capture reads their state.
	for _, e := range z.engines {
		errs = append(errs, e.Close())
	}
	// The engines kept one step more than --ckpt-keep while the job's
	// commit lagged; once the last save is committed (and nothing newer
	// is in a rank root), the rank roots keep --ckpt-keep.
	if z.engines != nil && z.keep > 0 && z.last == nil && z.committed >= 0 && z.committed == z.lastStep {
		for r := range z.n {
			errs = append(errs, checkpoint.Retain(checkpoint.OS, checkpoint.RankRoot(z.root, r), z.keep))
		}
	}
	z.engines = nil
	return errors.Join(errs...)
}
