package offload

import (
	"errors"
	"fmt"
	"iter"
	"maps"
	"math"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// Param names one parameter tensor: its name (GPT-2 / Megatron style, such as
// "h.0.attn.c_attn.weight") and its row-major shape in elements.
type Param struct {
	Name  string
	Shape []int
	// Group is the index of the parameter's group in Options.Groups (its
	// own lr and weight_decay, as torch.optim's param_groups); 0 without
	// groups.
	Group int `json:"Group,omitempty"`
}

// ParamInfo is a Param with its place in the flat parameter space.
type ParamInfo struct {
	Param
	Offset int // first element in the flat space
	Len    int // number of elements, the product of Shape
}

// Subgroup is one ZeRO-3 subgroup: elements [Offset, Offset+Len) of the flat
// parameter space.
type Subgroup struct {
	Index  int
	Offset int
	Len    int
	Group  int // the parameter group of all its elements
	// HostHeld: its parameters are Options.OffloadParam's (all or none
	// of them), their gradients and working copy in pinned host memory.
	HostHeld bool
}

// Tensor is one parameter's buffer owned by the Optimizer: a gradient the
// trainer writes, or a working copy it reads. It is a view: it stays valid
// for the Optimizer's life, and its contents change with Step.
//
// Today every Tensor lives in host memory; Float32 and Uint16 give the host
// view. A trainer that asks the Optimizer for its buffers, rather than
// handing it slices of its own, keeps working when the Optimizer places them
// elsewhere.
type Tensor struct {
	Name  string
	Shape []int
	DType adam.DType
	f32   []float32
	u16   []uint16
}

// Len returns the number of elements.
func (t Tensor) Len() int {
	if t.DType == adam.F32 {
		return len(t.f32)
	}
	return len(t.u16)
}

// Float32 returns the host view of an F32 tensor. Panics for another dtype.
func (t Tensor) Float32() []float32 {
	if t.DType != adam.F32 {
		panic(fmt.Sprintf("offload: tensor %q is %v, not float32", t.Name, t.DType))
	}
	return t.f32
}

// Uint16 returns the host view of a BF16 or F16 tensor as bit patterns.
// Panics for F32.
func (t Tensor) Uint16() []uint16 {
	if t.DType == adam.F32 {
		panic(fmt.Sprintf("offload: tensor %q is float32, not 16-bit", t.Name))
	}
	return t.u16
}

// StepArgs are the per-step inputs of Step.
type StepArgs struct {
	// LossScale S: the gradients hold S times the true gradient and are
	// multiplied by 1/S (torch.amp.GradScaler.unscale_). 0 or 1 mean none.
	LossScale float64
	// GradOnDevice, with Options.Device, says the gradients are in the
	// device buffers (DeviceGrad), where a GPU trainer's backward wrote
	// them: Step reads them there instead of moving the host buffers
	// (Grad) to the device, and leaves the new working copy on the device
	// only (DeviceWorking), with no copy to the host: Working fetches it
	// when next called (the host copy is stale until then). The checks,
	// clipping and skip are Step's as without it.
	//
	// Order: before Step, every device write of the trainer to the
	// gradients and every read of the working copy must be complete
	// (synchronize the stream of the backward first: Step runs on the
	// engine's streams, which do not wait for the trainer's). When Step
	// returns, taken or skipped, no work of the optimizer on the device
	// buffers is in flight: every write of this step to the working copy
	// is complete, the CPU subgroups' copies H2D included, and the next
	// forward, on any stream, reads the new weights.
	//
	// Step refuses (the step not taken) when SyncDevice was due: after
	// New, SetParam or LoadCheckpoint the device working copy the
	// gradients came from was not the master weights'.
	GradOnDevice bool
	// Beside, with StepAsync, says the caller runs GPU work of its own
	// beside the update phase (a trainer's next forward): Options.Replan
	// then does not fit the GPU's rate from the phase, whose kernels
	// share the GPU with the caller's. Step ignores it.
	Beside bool
	// Reduce, for ZeRO-3 ranks that each step their own shard, combines
	// this rank's gradient statistics with the other ranks' (an
	// all-reduce: comm.Comm's AllReduce with Sum): it receives the sum of
	// squares of this shard's unscaled gradients, NaN when one of them is
	// not finite, and returns the whole model's. Step then clips and skips
	// on the returned sum (NaN or Inf: skipped), so every rank takes or
	// skips the step with the same clip coefficient, as
	// torch.nn.utils.clip_grad_norm_ does over FSDP's shards. Nil: this
	// optimizer holds the whole model.
	//
	// Step calls it once, after the checks of its arguments and the
	// device's state: a Step refused before it does not call it, so the
	// trainer must then abort the communicator (the other ranks would
	// wait in the all-reduce). An error from it fails the Step, nothing
	// changed.
	Reduce func(sumSquares float64) (float64, error)
}

// StepResult reports what Step did.
type StepResult struct {
	Step     int64         // the step counter after Step (unchanged if skipped)
	Skipped  bool          // a gradient held Inf or NaN: nothing changed
	GradNorm float64       // global L2 norm of the unscaled gradients, before clipping; 0 when clipping is off
	ClipCoef float64       // the factor the gradients were multiplied by (1 when not clipped)
	Elapsed  time.Duration // wall time of the update phase
	// With Options.Replan: the plan's predicted update phase (its
	// makespan) and the measured one (scheduler.Busy.Makespan), and
	// whether this step re-planned the schedule after its update (Plan
	// then says the new one). Zero on a skipped step and on one that
	// faulted.
	Predicted, Measured time.Duration
	Replanned           bool
	// Speculated is how many parameters (Options.Speculate) the CPU
	// workers updated during the backward and kept, their scalars being
	// the step's; SpeculatedGPU how many of the streamed subgroups the GPU
	// updated so (Options.SpeculateGPU).
	Speculated, SpeculatedGPU int64
}

// String describes the step for a log line: "step 12 grad_norm 1.234
// clip 0.810 in 3.2ms", or "skipped (non-finite gradient) at step 11".
func (r StepResult) String() string {
	if r.Skipped {
		return fmt.Sprintf("skipped (non-finite gradient) at step %d in %v", r.Step, r.Elapsed.Round(time.Microsecond))
	}
	s := fmt.Sprintf("step %d", r.Step)
	if r.GradNorm != 0 {
		s += fmt.Sprintf(" grad_norm %.4g clip %.3g", r.GradNorm, r.ClipCoef)
	}
	return s + fmt.Sprintf(" in %v", r.Elapsed.Round(time.Microsecond))
}

// ErrClosed is returned by methods of a closed Optimizer.
var ErrClosed = errors.New("offload: optimizer is closed")

// Optimizer is AdamW with the state in host memory, cut into subgroups.
//
// # Concurrency
//
// One mutex serializes the methods that read or write the optimizer state,
// the step counter, the hyperparameters, the worker pool or the engine:
// Step, ZeroGrad, SetParam, SetLR, Master, Options, Schedule,
// Snapshot, SaveAsync, SaveCheckpoint, LoadCheckpoint, SyncDevice,
// SyncHost, DeviceGrad, DeviceWorking, DeviceMaster, Plan, Bound,
// IterationBound, PredictIteration, PlanIteration, SpeculateLeave and
// Close. Each may be called from any goroutine at any time: two calls run
// one after the other, never interleaved (Step with Step, Step with
// SaveCheckpoint, ...), in an unspecified order. Close waits for the call in flight (a Step, a
// synchronous save, a load; and the capture of a SaveAsync's state), and
// the calls after it return ErrClosed: Step, SetParam, SetLR, Snapshot,
// SaveAsync, SaveCheckpoint, LoadCheckpoint. ZeroGrad, StepCount, Options
// and Schedule keep working after Close; Master returns ErrClosed after
// Close with Options.Device (its state was freed).
//
// StepAsync holds the lock from its call until its phase ends, on a
// goroutine of its own: a method called meanwhile waits for the phase.
// StepCount, WaitParams and WaitStep take no lock.
//
// Params, Subgroups, NumParams, Index, Grad and Working read only what
// New set, take no lock, and are safe with any call, Close included; but
// Working, after a Step with StepArgs.GradOnDevice, takes the lock to
// fetch the working copy from the device once.
//
// The memory behind the views is not synchronized: the Tensors that Grad and
// Working return, and a Snapshot's tensors. Step reads the gradients and
// writes the working copy (and the state); ZeroGrad writes the gradients;
// SetParam and LoadCheckpoint write the working copy and the state. Touching
// a view while one of those runs on another goroutine is a data race: the
// trainer writes the gradients and reads the working copy between its
// calls, ordered with them by its own synchronization (one goroutine, or a
// channel or WaitGroup between the two). A Snapshot's views hold until the
// next Step, SetParam or LoadCheckpoint, and with Options.Device until
// Close. After Close the views of Grad and Working stay readable (host
// memory; Close brings the working copy back from the device first).
//
// The device views (DeviceGrad, DeviceWorking, DeviceMaster) are device memory the
// optimizer's calls read and write on the engine's streams: the trainer's
// own device work on them must be complete before it calls Step,
// ZeroGrad, SyncDevice, Close or a LoadCheckpoint (synchronize its
// stream), and what those calls enqueue is complete when they return
// (StepArgs.GradOnDevice).
type Optimizer struct {
	// mu serializes the methods that use the state, the pool or the
	// engine (see Concurrency). A sync.Mutex costs Step no allocation.
	mu sync.Mutex

	opts      Options
	params    []ParamInfo
	layout    []int // the params' indices in the flat space's order (group after group)
	byName    map[string]int
	subgroups []Subgroup
	total     int
	offloaded []bool // per parameter: named in Options.OffloadParam

	step  int64
	state adam.State // flat, total elements each
	grad  adam.Grad  // flat gradient, total elements; with Options.Device made on first use (hostGrad)
	// gradOnce makes grad with Options.Device, where a trainer whose
	// gradients stay on the device (StepArgs.GradOnDevice) never uses it:
	// 2 or 4 bytes a parameter of host memory it need not hold.
	gradOnce sync.Once
	gradMade atomic.Bool // gradOnce ran: ZeroGrad need not make the buffers to clear them
	work     adam.Copy16
	pool     *adam.Pool

	pending  lazySave              // the lazy save whose capture may still read the state
	gcoeffs  []adam.Coeffs         // per parameter group: groupCoeffs's last (a step's, or a speculation's)
	sgcoeffs []adam.Coeffs         // per subgroup, this step's: its group's, for the engine
	plan     *perfmodel.Prediction // the model's schedule, with Options.Profile

	// With Options.Device: the engine owns the state (o.state views its
	// pinned memory); o.grad and o.work are host mirrors; dev says where
	// the current state is.
	eng *scheduler.Engine
	dev devState
	re  replanState // Options.Replan's
	// specRateSeen is the last rate specRate measured, in parameters a
	// second (0: none yet), and specKeptSeen the parameters that phase
	// kept.
	specRateSeen float64
	specKeptSeen int64
	// specLeave is what PlanIteration had the speculation leave to the
	// phase (SpeculateLeave).
	specLeave int64
	// mirrorAt: for each parameter in Options.DeviceMasters, its first
	// element in the engine's mirror (scheduler.Engine.Mirror).
	mirrorAt map[int]int64
	mirror   []scheduler.Span // the engine's Options.Mirror
	// workStale: a Step with GradOnDevice left the new working copy on
	// the device only; o.work (the host mirror) is behind until
	// syncWorking fetches it. Written under mu; Working reads it without.
	workStale atomic.Bool
	// Options.OverlapBackward's, for the next Step: the parameters whose
	// gradients GradsFinal was told are final, and the start of the flat
	// space's suffix they cover (total when none).
	final []bool
	ready int
	// Options.Speculate's: the scalars GradsFinal speculates with (one
	// per subgroup), the last Step's unscale, and whether the last Step
	// clipped or was skipped, or there was none yet, or a Snapshot was
	// taken since (then the next backward does not speculate: a run that
	// clips at every step never speculates).
	specCs      []adam.Coeffs
	specSet     bool // specCs is this step's (resetFinal clears it)
	lastUnscale float32
	specPaused  bool

	// StepAsync's: the step whose phase beginDevice began (under mu),
	// the engine while its phase runs (for WaitParams; set and cleared
	// under readyMu's write lock, so that no WaitParams is inside the
	// engine when the phase's end re-plans it), the step count with the
	// step under way (StepCount), and the results WaitStep has not taken
	// (asyncN, the caller's goroutine's alone).
	cur      curStep
	readyMu  sync.RWMutex
	phase    atomic.Pointer[scheduler.Engine]
	stepAt   atomic.Int64
	asyncRes chan asyncResult
	asyncN   int
}

// devState says, with Options.Device, where the optimizer's current state
// is: the one explicit state of the device path. Its transitions:
//
//	from          event                                          to
//	(new engine)  New, LoadCheckpoint after a fault              hostAhead
//	any but broken SetParam, LoadCheckpoint                      hostAhead
//	hostAhead     Step (Load: host -> device, then the update)   deviceAhead with resident subgroups, else synced
//	synced        Step                                           deviceAhead with resident subgroups, else synced
//	deviceAhead   Master, Snapshot, SaveCheckpoint, SetParam,    synced (syncHost: Download)
//	              SyncHost
//	deviceAhead   SaveAsync                                      synced (DownloadAsync; the capture waits for it: lazySave.d2h)
//	any           a device fault that leaves the state torn      broken
//	broken        LoadCheckpoint                                 hostAhead (a new engine; broken until the load succeeds)
//	hostAhead     SyncDevice (Load)                              synced
//	hostAhead     Step with GradOnDevice                         hostAhead (refused: the device copy was stale)
//	any but broken Step that re-plans (Options.Replan)           synced (Engine.Replan: Download, then the new resident state uploaded)
//
// Beside it, the working copy's host mirror has its own flag, workStale:
// set by a taken Step with GradOnDevice (the new copy stays on the
// device) and by a Step whose copy back failed; cleared when the copy
// comes back (syncWorking: Working, WorkingOf, SyncHost, SetParam, Close;
// a Step without GradOnDevice) and by LoadCheckpoint (the mirror is
// rounded from the loaded master weights).
type devState uint8

const (
	devHostAhead   devState = iota // the host state changed: Load it before the next update
	devSynced                      // host and device agree
	devDeviceAhead                 // resident subgroups advanced on the device: Download before reading the host state
	devBroken                      // a device fault left the state inconsistent: only LoadCheckpoint helps
)

// lazySave is the lazy checkpoint in flight (SaveAsync), if any.
type lazySave struct {
	h *checkpoint.Handle // nil: none
	// d2h: its Prepare moves the resident subgroups' state D2H into the
	// host state; the host state is current only once it is captured.
	d2h bool
}

// waitCapture waits until the save in flight, if any, has captured the
// state, so that the host state may change (or, with d2h, be read). The
// save's error is not dropped: settle reports it, once, from the next
// Step, SaveAsync, SetParam or LoadCheckpoint, and the handle keeps it.
func (s *lazySave) waitCapture() {
	if s.h != nil {
		_ = s.h.WaitCaptured() // its error: see above
	}
	s.d2h = false
}

// New builds an Optimizer over params, in order, with options opts (zero
// fields take their defaults). The master weights start at zero: set them
// with SetParam.
//
// Errors: no parameters, an empty or duplicate name, a negative dimension, a
// total over 2^40 elements, or invalid options.
func New(params []Param, opts Options) (*Optimizer, error) {
	o, err := layOut(params, opts)
	if err != nil {
		return nil, err
	}
	opts = o.opts
	if opts.OverlapBackward {
		o.final = make([]bool, len(o.params))
	}
	o.gcoeffs = make([]adam.Coeffs, len(opts.groups()))
	if opts.Device == nil {
		o.state = adam.State{Param: make([]float32, o.total), ExpAvg: make([]float32, o.total), ExpAvgSq: make([]float32, o.total)}
		if opts.Hyper.AMSGrad {
			o.state.MaxExpAvgSq = make([]float32, o.total)
		}
	}
	o.grad = adam.Grad{DType: opts.GradDType}
	if opts.Device == nil {
		o.hostGrad()
	}
	if opts.WorkingDType != 0 {
		o.work = adam.Copy16{DType: opts.WorkingDType, Data: make([]uint16, o.total)}
	}
	// Fault every page in now, so that the first Step does not pay for it
	// (on the 2-core machine, 130 MB of fresh state made the first step
	// 475 ms against 8-10 ms for the next ones).
	for _, s := range o.stateSlices() {
		prefault32(s)
	}
	prefault16(o.work.Data)
	o.pool = adam.NewPool(opts.Threads)
	if opts.Profile == nil && opts.Calibrate && opts.Schedule == nil && opts.Placement == "" {
		// Within what the optimizer will hold on the device (its budget,
		// the gradients and the working copy), not yet allocated.
		room := max(opts.GPUBudget+opts.DeviceBytes(o.total), MinCalibrationBytes)
		p, err := Calibrate(opts.Device, o.pool.Threads(), opts.GradDType, 1, room)
		if err != nil {
			o.pool.Close()
			return nil, err
		}
		opts.Profile = p
		o.opts.Profile = p
	}
	if opts.Device != nil {
		if len(opts.SubgroupSizes) > 0 {
			if err := o.chooseSubgroupSize(); err != nil {
				o.pool.Close()
				return nil, err
			}
		}
		if err := o.newEngine(); err != nil {
			o.pool.Close()
			return nil, err
		}
		return o, nil
	}
	if opts.Profile != nil {
		w := perfmodel.Workload{Params: int64(o.total), SubgroupSize: int64(opts.SubgroupSize), Sizes: o.subgroupSizes(), GradDType: opts.GradDType,
			AMSGrad: opts.Hyper.AMSGrad, Threads: o.pool.Threads()}
		if opts.WorkingDType != 0 {
			w.CopyBytes = 2
		}
		// This optimizer updates on the host, gradients included: plan
		// with the CPU rates only (a profile's GPU rates would charge
		// PCIe copies that do not happen).
		host := *opts.Profile
		host.GPU = nil
		plan, err := host.Choose(w)
		if err != nil {
			o.pool.Close()
			return nil, fmt.Errorf("offload: planning the update phase: %w", err)
		}
		o.plan = &plan
	}
	return o, nil
}

// layOut is New's first part, which allocates nothing large: opts with
// its defaults and validated, the parameters checked and laid out in the
// flat space, OffloadParam and DeviceMasters resolved, the subgroups cut
// at SubgroupSize. Errors: New's about the options and the parameters.
func layOut(params []Param, opts Options) (*Optimizer, error) {
	opts.EnsureDefaults()
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	if len(params) == 0 {
		return nil, errors.New("offload: no parameters")
	}
	opts.Groups = slices.Clone(opts.Groups) // the caller's slices are not the optimizer's
	opts.DeviceMasters = slices.Clone(opts.DeviceMasters)
	opts.SubgroupSizes = slices.Clone(opts.SubgroupSizes)
	opts.OffloadParam = slices.Clone(opts.OffloadParam)
	o := &Optimizer{opts: opts, byName: make(map[string]int, len(params)), lastUnscale: 1, specPaused: true, asyncRes: make(chan asyncResult, 1)}
	for i, p := range params {
		if p.Name == "" {
			return nil, fmt.Errorf("offload: parameter %d has an empty name", i)
		}
		if !utf8.ValidString(p.Name) {
			return nil, fmt.Errorf("offload: parameter %d: name %q is not valid UTF-8 (checkpoints store names as JSON)", i, p.Name)
		}
		if _, dup := o.byName[p.Name]; dup {
			return nil, fmt.Errorf("offload: duplicate parameter name %q", p.Name)
		}
		n := 1
		for _, d := range p.Shape {
			if d < 0 {
				return nil, fmt.Errorf("offload: parameter %q: negative dimension in shape %v", p.Name, p.Shape)
			}
			if d > 0 && n > (1<<40)/d {
				return nil, fmt.Errorf("offload: parameter %q: shape %v is too large", p.Name, p.Shape)
			}
			n *= d
		}
		if p.Group < 0 || p.Group >= len(opts.groups()) {
			return nil, fmt.Errorf("offload: parameter %q: group %d, but Options.Groups has %d", p.Name, p.Group, len(opts.Groups))
		}
		o.byName[p.Name] = i
		o.params = append(o.params, ParamInfo{Param: Param{Name: p.Name, Shape: append([]int(nil), p.Shape...), Group: p.Group}, Len: n})
		o.total += n
		if o.total > 1<<40 {
			return nil, fmt.Errorf("offload: more than 2^40 parameters")
		}
	}
	// The flat space holds the groups one after the other (each in the
	// parameters' order).
	off := 0
	for g := range opts.groups() {
		for i := range o.params {
			if o.params[i].Group == g {
				o.params[i].Offset = off
				off += o.params[i].Len
				o.layout = append(o.layout, i)
			}
		}
	}
	if err := o.offloadParams(); err != nil {
		return nil, err
	}
	o.cut(opts.SubgroupSize)
	if err := o.mirrorSpans(); err != nil {
		return nil, err
	}
	o.ready = o.total
	return o, nil
}

// PredictUpdate returns the update phase the performance model predicts
// for the optimizer New(params, opts) would make on a device (its
// schedule and time, perfmodel.Prediction; Makespan in seconds), without
// allocating its state: the subgroups cut as New cuts them (the
// SubgroupSizes candidate New keeps), OffloadParam's host-held, planned
// within GPUBudget as New plans them (the model's schedule, or Schedule's
// or Placement's). opts.Profile is required; Device is not used (nil
// is taken for a device, as a GPU trainer's options name one).
//
// Errors: no Profile, New's about the options and the parameters, the
// model's (a schedule that does not fit).
func PredictUpdate(params []Param, opts Options) (*Prediction, error) {
	if opts.Profile == nil {
		return nil, errors.New("offload: PredictUpdate needs Options.Profile")
	}
	opts.Calibrate = false
	if opts.Device == nil { // what needs a device is validated against one
		opts.Device = scheduler.NewSim(scheduler.SimOptions{})
	}
	o, err := layOut(params, opts)
	if err != nil {
		return nil, err
	}
	o.pool = adam.NewPool(o.opts.Threads)
	defer o.pool.Close()
	if len(o.opts.SubgroupSizes) > 0 {
		if err := o.chooseSubgroupSize(); err != nil {
			return nil, err
		}
	}
	_, pred, err := o.choosePlan()
	if err != nil {
		return nil, err
	}
	if pred == nil {
		return nil, errors.New("offload: PredictUpdate: the model made no prediction")
	}
	return pred, nil
}

// mirrorSpans resolves Options.DeviceMasters into the engine's mirror
// spans, in the flat space's order.
func (o *Optimizer) mirrorSpans() error {
	if len(o.opts.DeviceMasters) == 0 {
		return nil
	}
	o.mirrorAt = make(map[int]int64, len(o.opts.DeviceMasters))
	for _, name := range o.opts.DeviceMasters {
		i, ok := o.byName[name]
		if !ok {
			return fmt.Errorf("offload: Options.DeviceMasters: no parameter named %q", name)
		}
		if _, dup := o.mirrorAt[i]; dup {
			return fmt.Errorf("offload: Options.DeviceMasters: %q is named twice", name)
		}
		o.mirrorAt[i] = 0
	}
	var order []int
	for _, i := range o.layout {
		if _, ok := o.mirrorAt[i]; ok && o.params[i].Len > 0 {
			order = append(order, i)
			o.mirror = append(o.mirror, scheduler.Span{Off: int64(o.params[i].Offset), N: int64(o.params[i].Len)})
		}
	}
	at, _ := scheduler.MirrorLayout(o.mirror)
	for k, i := range order {
		o.mirrorAt[i] = at[k]
	}
	return nil
}

// offloadParams resolves Options.OffloadParam into o.offloaded.
func (o *Optimizer) offloadParams() error {
	o.offloaded = make([]bool, len(o.params))
	for _, name := range o.opts.OffloadParam {
		i, ok := o.byName[name]
		if !ok {
			return fmt.Errorf("offload: Options.OffloadParam: no parameter named %q", name)
		}
		if o.offloaded[i] {
			return fmt.Errorf("offload: Options.OffloadParam: %q is named twice", name)
		}
		if slices.Contains(o.opts.DeviceMasters, name) {
			return fmt.Errorf("offload: %q is in both Options.OffloadParam and Options.DeviceMasters: a host-held parameter has no device copy to refresh", name)
		}
		o.offloaded[i] = true
	}
	return nil
}

// newEngine builds the engine on Options.Device and makes it the
// optimizer's.
func (o *Optimizer) newEngine() error {
	eng, plan, err := o.buildEngine()
	if err != nil {
		return err
	}
	o.eng, o.state, o.dev = eng, eng.HostState(), devHostAhead
	if plan != nil {
		o.setPlan(plan)
	}
	return nil
}

// setPlan makes plan, a new engine's, the optimizer's, and starts
// Options.Replan's state over from it. The caller holds o.mu (or is New).
func (o *Optimizer) setPlan(plan *perfmodel.Prediction) {
	o.plan = plan
	if o.opts.Replan {
		o.re = newReplanState(o.opts.Profile, *plan, o.workload(), o.step)
	}
}

// workload is the update phase the performance model plans with a
// device: the subgroups that are not host-held in the model's lanes, the
// host-held ones (Options.OffloadParam's) as the CPU workers' work before
// them (perfmodel.Workload.HostHeld).
func (o *Optimizer) workload() perfmodel.Workload {
	sizes := o.deviceSizes()
	var n int64
	for _, x := range sizes {
		n += x
	}
	return perfmodel.Workload{Params: n, HostHeld: int64(o.total) - n, SubgroupSize: int64(o.opts.SubgroupSize), Sizes: sizes,
		GradDType: o.opts.GradDType, CopyBytes: 2, AMSGrad: o.opts.Hyper.AMSGrad, Threads: o.pool.Threads(), GPUBudget: o.opts.GPUBudget,
		Prefetch: o.opts.OverlapBackward}
}

// cut cuts the flat space into subgroups of at most size elements within
// each group (a subgroup is updated with one group's lr and
// weight_decay) and within each run of parameters that are all, or all
// not, Options.OffloadParam's, and sizes the per-subgroup coefficients.
func (o *Optimizer) cut(size int) {
	lens, groups := make([]int64, len(o.layout)), make([]int, len(o.layout))
	held := make([]bool, len(o.layout))
	for k, i := range o.layout {
		lens[k], groups[k], held[k] = int64(o.params[i].Len), o.params[i].Group, o.offloaded[i]
	}
	o.subgroups = cutRuns(lens, groups, held, size)
	o.opts.SubgroupSize = size
	o.sgcoeffs = make([]adam.Coeffs, len(o.subgroups))
	o.specCs = make([]adam.Coeffs, len(o.subgroups))
}

// cutRuns is New's cut of the flat space into its subgroups: the
// parameters in its order (lens, their groups and whether each is
// host-held), each run of them in one group and of one kind cut into
// subgroups of at most size (perfmodel.SubgroupSizes). An empty parameter
// joins the run it is in; a group of no elements has no subgroup.
func cutRuns(lens []int64, groups []int, held []bool, size int) []Subgroup {
	var out []Subgroup
	var run int64
	off := 0
	last := -1 // the last non-empty parameter of the current run
	flush := func() {
		for _, n := range perfmodel.SubgroupSizes(run, int64(size)) {
			out = append(out, Subgroup{Index: len(out), Offset: off, Len: int(n), Group: groups[last], HostHeld: held[last]})
			off += int(n)
		}
		run = 0
	}
	for k, n := range lens {
		if n == 0 {
			continue
		}
		if last >= 0 && (groups[k] != groups[last] || held[k] != held[last]) {
			flush()
		}
		run += n
		last = k
	}
	if last >= 0 {
		flush()
	}
	return out
}

// CutSizes returns the lengths, in order, of the subgroups New cuts params
// into with opts (CutSubgroups).
func CutSizes(params []Param, opts Options) []int64 {
	var sizes []int64
	for _, sg := range CutSubgroups(params, opts) {
		sizes = append(sizes, int64(sg.Len))
	}
	return sizes
}

// CutSubgroups returns the subgroups New cuts params into with opts (its
// Groups, SubgroupSize, 0 meaning the default, and OffloadParam), before
// New is called: Optimizer.Subgroups' values. A forced Options.Schedule
// counts those that are not HostHeld. A parameter whose group or shape
// New would refuse is left out.
func CutSubgroups(params []Param, opts Options) []Subgroup {
	opts.EnsureDefaults()
	var lens []int64
	var groups []int
	var held []bool
	for g := range opts.groups() {
		for _, p := range params {
			if p.Group != g {
				continue
			}
			n := int64(1)
			for _, d := range p.Shape {
				n *= int64(max(d, 0))
			}
			lens, groups, held = append(lens, n), append(groups, g), append(held, slices.Contains(opts.OffloadParam, p.Name))
		}
	}
	return cutRuns(lens, groups, held, opts.SubgroupSize)
}

// chooseSubgroupSize keeps the candidate of Options.SubgroupSizes whose
// plan is predicted fastest (see there) and cuts the subgroups at it.
func (o *Optimizer) chooseSubgroupSize() error {
	cands := o.opts.SubgroupSizes
	if o.opts.Profile == nil || o.opts.Schedule != nil {
		o.cut(cands[0])
		return nil
	}
	best := make([]float64, len(cands))
	for k, c := range cands {
		o.cut(c)
		_, pred, err := o.choosePlan()
		if err != nil {
			return fmt.Errorf("offload: SubgroupSizes: %d: %w", c, err)
		}
		best[k] = pred.Makespan
	}
	o.cut(cands[perfmodel.PickSubgroupSize(cands, best)])
	return nil
}

// choosePlan returns the update phase's schedule on Options.Device over
// the current subgroups: the forced one, the model's or all on the CPU,
// with the model's prediction of it (nil without a profile).
func (o *Optimizer) choosePlan() (perfmodel.Schedule, *perfmodel.Prediction, error) {
	var pred *perfmodel.Prediction
	opts := o.opts
	w := o.workload()
	n := len(w.Sizes)
	s := perfmodel.Schedule{CPU: n}
	forced := opts.Schedule
	switch opts.Placement {
	case "cpu":
		forced = &perfmodel.Schedule{CPU: n}
	case "static":
		st := perfmodel.StaticSplit(w)
		forced = &st
	}
	if n == 0 && opts.Profile == nil && (forced == nil || *forced == (perfmodel.Schedule{})) {
		return s, nil, nil // every subgroup host-held (OffloadParam): nothing to place
	}
	if forced != nil {
		s = *forced
		if s.CPU < 0 || s.GPU < 0 || s.Resident < 0 || s.CPU > n || s.GPU > n || s.Resident > n || s.CPU+s.GPU+s.Resident != n {
			return s, nil, fmt.Errorf("offload: Options.Schedule %d CPU + %d GPU + %d resident: the counts must add up to the %d subgroups (%d parameters in subgroups of %d%s)",
				s.CPU, s.GPU, s.Resident, n, w.Params, opts.SubgroupSize, o.heldNote())
		}
		if need := w.GPUMemory(s); opts.GPUBudget > 0 && need > opts.GPUBudget {
			return s, nil, fmt.Errorf("offload: Options.Schedule %+v needs %d bytes of device memory, over GPUBudget %d", s, need, opts.GPUBudget)
		}
		if opts.Profile != nil {
			if w.GPUBudget == 0 {
				w.GPUBudget = w.GPUMemory(s)
			}
			pr, err := opts.Profile.Predict(w, s)
			if err != nil {
				return s, nil, fmt.Errorf("offload: predicting Options.Schedule: %w", err)
			}
			pred = &pr
		}
	} else if opts.Profile != nil {
		pr, err := opts.Profile.Choose(w)
		if err != nil {
			return s, nil, fmt.Errorf("offload: planning the update phase: %w", err)
		}
		pred, s = &pr, pr.Schedule
	}
	return s, pred, nil
}

// buildEngine builds an engine on Options.Device with choosePlan's
// schedule and returns it with the model's prediction (nil without a
// profile); it changes nothing in o.
func (o *Optimizer) buildEngine() (*scheduler.Engine, *perfmodel.Prediction, error) {
	s, pred, err := o.choosePlan()
	if err != nil {
		return nil, nil, err
	}
	n, opts := len(o.subgroups), o.opts
	plan, err := scheduler.NewHeldPlanIn(o.held(), s, o.residentLayout())
	if err != nil {
		return nil, nil, fmt.Errorf("offload: %w", err)
	}
	sizes := make([]int, n)
	for i, sg := range o.subgroups {
		sizes[i] = sg.Len
	}
	eng, err := scheduler.New(scheduler.Options{Device: opts.Device, Sizes: sizes, GradDType: opts.GradDType, WorkingDType: opts.WorkingDType,
		AMSGrad: opts.Hyper.AMSGrad, Pool: o.pool, Plan: plan, Mirror: o.mirror, Prefetch: opts.OverlapBackward, HostHeld: o.held(),
		Speculate: opts.Speculate, SpeculateGPU: opts.SpeculateGPU})
	if err != nil {
		return nil, nil, fmt.Errorf("offload: %w", err)
	}
	return eng, pred, nil
}

// Schedule returns how the update phase splits the subgroups with
// Options.Device (ok false without one).
func (o *Optimizer) Schedule() (s perfmodel.Schedule, ok bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.eng == nil {
		return perfmodel.Schedule{}, false
	}
	return o.eng.Plan().Schedule, true
}

// syncHost makes the host state current: the resident subgroups' state
// comes back from the device. The caller holds o.mu.
func (o *Optimizer) syncHost() error {
	if o.eng != nil && o.dev != devBroken {
		// What Options.Speculate updated before the Step is not the
		// state yet: the last step's is read.
		o.eng.DropSpeculation()
	}
	if o.pending.d2h {
		// A lazy checkpoint's D2H of the resident state: the host state
		// is current once its capture is done.
		o.pending.waitCapture()
	}
	if o.eng == nil || o.dev != devDeviceAhead {
		return nil
	}
	// Download writes the resident subgroups' host state, which a lazy
	// checkpoint in capture may still be reading (the engine's gate
	// covers only Update).
	o.pending.waitCapture()
	if err := o.eng.Download(); err != nil {
		return o.engineErr(err)
	}
	o.dev = devSynced
	return nil
}

// Plan returns the performance model's schedule and predicted time of one
// update phase, when Options.Profile or Options.Calibrate was set (ok
// false otherwise). With Options.Replan it is the latest plan: after a
// refit, its Makespan is the corrected prediction (scaled by the measured
// overlap) while its Busy, Fill and Drain are the corrected profile's. The
// Busy map is the caller's copy.
func (o *Optimizer) Plan() (plan perfmodel.Prediction, ok bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.plan == nil {
		return perfmodel.Prediction{}, false
	}
	plan = *o.plan
	plan.Busy = maps.Clone(plan.Busy)
	return plan, true
}

// Limit returns the machine's limit for this optimizer's update phase on
// Options.Device: perfmodel.Profile.Limit of Options.Profile (the one
// measured at New, not Replan's corrected one) for its subgroups, GPU
// budget and OverlapBackward (ok false without a device or a profile, or
// when the model has no limit for them).
func (o *Optimizer) Limit() (limit perfmodel.Prediction, ok bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.eng == nil || o.opts.Profile == nil {
		return perfmodel.Prediction{}, false
	}
	lim, err := o.opts.Profile.Limit(o.workload())
	return lim, err == nil
}

// Bound returns a lower bound on this optimizer's update phase on
// Options.Device: perfmodel.Profile.Bound of Options.Profile for its
// subgroups, GPU budget and OverlapBackward, every resource at its rate
// alone with no latency or contention (ok false without a device or a
// profile, or when the model has none for them). Unlike Limit, which is a
// prediction, no phase should run under it, one that does says the
// profile's rates are off; but a phase that kept speculative updates
// (Options.Speculate) did part of its work before it and is not bounded.
func (o *Optimizer) Bound() (b Bound, ok bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.eng == nil || o.opts.Profile == nil {
		return Bound{}, false
	}
	b, err := o.opts.Profile.Bound(o.workload())
	return b, err == nil
}

// IterationBound returns a lower bound on a whole training iteration of
// this optimizer and it (perfmodel.Profile.IterationBound: Bound's work
// with it's forward and backward on the GPU and its copies on PCIe, the
// largest resource's time, every overlap the exact step allows taken as
// reached), with Options.Device and a profile (ok false otherwise, or for
// a negative field of it).
func (o *Optimizer) IterationBound(it Iteration) (b Bound, ok bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.eng == nil || o.opts.Profile == nil {
		return Bound{}, false
	}
	b, err := o.opts.Profile.IterationBound(o.workload(), it)
	return b, err == nil
}

// PredictIteration predicts one training iteration of this optimizer
// under its plan (perfmodel.Profile.PredictIteration), with
// Options.Device and a profile (ok false otherwise, before the first
// plan, or for bad fields of it). it's speculation fields and
// ResidentFirst are the optimizer's: Options.Speculate over
// SpeculateBytes' bytes a parameter at the rate the last phase that kept
// speculative updates measured (none before one has), and
// Options.ResidentFirst; the caller gives the forward's and backward's
// times, the blocks and whether the forward overlaps the phase.
func (o *Optimizer) PredictIteration(it IterationWork) (p IterationPrediction, ok bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.eng == nil || o.opts.Profile == nil || o.plan == nil {
		return IterationPrediction{}, false
	}
	p, err := o.opts.Profile.PredictIteration(o.workload(), o.plan.Schedule, o.iterationWork(it))
	return p, err == nil
}

// iterationWork is it with the optimizer's speculation and layout, and
// the speculation's rate as the last phase that kept some measured it
// (specRate); with no phase that kept some, no speculation. The caller
// holds o.mu.
func (o *Optimizer) iterationWork(it IterationWork) IterationWork {
	it.SpeculateParams, it.SpeculateRate, it.ResidentFirst = 0, 0, o.opts.ResidentFirst
	if o.opts.Speculate > 0 {
		if it.SpeculateRate = o.specRate(); it.SpeculateRate > 0 { // none kept yet: none predicted
			it.SpeculateParams = o.opts.Speculate / SpeculateBytes(1, o.opts.Hyper.AMSGrad)
		}
	}
	return it
}

// specRate returns the parameters a second the last phase's kept
// speculative updates ran at, from their first start to their last end
// (scheduler.Engine.Trace), or, when it kept none, the last such rate
// measured (0 before any). It allocates (the trace). The caller holds
// o.mu.
func (o *Optimizer) specRate() float64 {
	ops, err := o.eng.Trace()
	if err != nil {
		return o.specRateSeen
	}
	var params int64
	first, last := time.Duration(math.MaxInt64), time.Duration(math.MinInt64)
	for _, op := range ops {
		if op.What == scheduler.SpeculativeKept {
			params += op.Bytes
			first, last = min(first, op.Start), max(last, op.End)
		}
	}
	if params > 0 && last > first {
		o.specRateSeen, o.specKeptSeen = float64(params)/(last-first).Seconds(), params
	}
	return o.specRateSeen
}

// SpeculateLeave returns the parameters whose CPU updates the
// speculation leaves to the phase (scheduler.Engine.SetSpeculateLeave),
// as the last PlanIteration set them: 0 before it, without speculation,
// without Options.SpeculateLeave, or where the forward does not overlap the
// phase.
func (o *Optimizer) SpeculateLeave() int64 {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.specLeave
}

// speculateLeave returns the parameters the speculation leaves to the
// phase (scheduler.Engine.SetSpeculateLeave) for an iteration it (its
// speculation fields set by iterationWork) whose forward overlaps the
// phase (none without Options.SpeculateLeave): what the CPU updates, at the
// speculation's rate, in the time the next forward takes over the
// parameters after the last phase's own CPU work
// (scheduler.Engine.PhaseCPUEnd: the blocks the speculation, the GPU
// and the resident subgroups updated, their share of the forward), at
// most half of what that phase kept: without it the forward runs those
// blocks after the phase's last CPU update with the CPU idle (on an H100,
// 4.24B: 50 ms of a 720 ms iteration under 40 GiB, 104 to 132 ms of
// 1,078 to 1,143 streamed under 24 GiB; BENCHMARKS.md). 0 before a phase
// kept speculative updates; the last leave where no phase ran on the
// plan since a move. The caller holds o.mu.
func (o *Optimizer) speculateLeave(it IterationWork) int64 {
	if !o.opts.SpeculateLeave || !it.OverlapForward || it.SpeculateRate <= 0 || o.specKeptSeen <= 0 || o.total == 0 || !(it.Forward > 0) {
		return 0
	}
	end, ok := o.eng.PhaseCPUEnd()
	if !ok {
		return o.specLeave // no phase on this plan yet: the last one's
	}
	tail := 1 - float64(end)/float64(o.total)
	return int64(min(it.SpeculateRate*it.Forward*tail, float64(o.specKeptSeen/2)))
}

// Trace returns the last update phase's operations (scheduler.Engine.Trace:
// times from the phase's start) and the host time the phase began
// (scheduler.Engine.PhaseStart), to place it in an iteration's timeline.
// Errors: no Options.Device (the CPU workers' update has no engine to
// trace), no update phase since New, a re-plan or a load
// (scheduler.ErrNoPhase), the device's. Call it before the next GradsFinal
// or Step: they record the phase's events again.
func (o *Optimizer) Trace() (start time.Time, ops []TraceOp, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.eng == nil {
		return time.Time{}, nil, errors.New("offload: Trace: no update phase to trace without Options.Device")
	}
	if start, err = o.eng.PhaseStart(); err != nil {
		return time.Time{}, nil, fmt.Errorf("offload: Trace: %w", err)
	}
	if ops, err = o.eng.Trace(); err != nil {
		return time.Time{}, nil, fmt.Errorf("offload: Trace: %w", err)
	}
	return start, ops, nil
}

// Close waits for a call in flight on another goroutine (Step,
// SaveCheckpoint, LoadCheckpoint, ...: see Optimizer's Concurrency), then
// until a lazy checkpoint in flight has captured the state (its flush goes
// on in the engine), and stops the worker goroutines and the engine.
// Afterwards Step, SetParam, SetLR, Snapshot, SaveCheckpoint, SaveAsync and
// LoadCheckpoint return ErrClosed; the views of Grad and Working stay
// readable. Close may be called more than once, from any goroutine.
//
// Errors: the engine's failure to free device or pinned memory
// (scheduler.Engine.Close); everything is released whatever it says.
func (o *Optimizer) Close() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.pending.waitCapture()
	o.pending = lazySave{}
	var err error
	if o.eng != nil {
		// The views of Working outlive the engine: bring the device's
		// copy back first when a Step with GradOnDevice left it there.
		if o.dev != devBroken {
			err = o.syncWorking()
		}
		if cerr := o.eng.Close(); cerr != nil {
			err = errors.Join(err, fmt.Errorf("offload: closing the engine: %w", cerr))
		}
		o.eng = nil
	}
	if o.pool != nil {
		o.pool.Close()
		o.pool = nil
	}
	return err
}

// Options returns the options in effect, defaults filled in (Hyper as
// SetLR and LoadCheckpoint left it).
func (o *Optimizer) Options() Options {
	o.mu.Lock()
	defer o.mu.Unlock()
	opts := o.opts
	opts.Groups = slices.Clone(opts.Groups) // a copy: SetGroupLR changes them
	opts.DeviceMasters = slices.Clone(opts.DeviceMasters)
	opts.SubgroupSizes = slices.Clone(opts.SubgroupSizes)
	opts.OffloadParam = slices.Clone(opts.OffloadParam)
	return opts
}

// Params returns the parameters with their offsets, in order. The slice is
// shared: do not modify it.
func (o *Optimizer) Params() []ParamInfo { return o.params }

// Subgroups returns the subgroups, in order. The slice is shared.
func (o *Optimizer) Subgroups() []Subgroup { return o.subgroups }

// NumParams returns the total number of parameters (elements).
func (o *Optimizer) NumParams() int { return o.total }

// StepCount returns the step counter: the number of steps taken, skipped
// steps excluded, and the one StepAsync began (it counts from the phase's
// start: the weights are changing). It takes no lock.
func (o *Optimizer) StepCount() int64 { return o.stepAt.Load() }

// SetLR sets the learning rate of every parameter group for the next
// steps, as assigning each param_groups[g]["lr"] does in PyTorch (for
// schedules; SetGroupLR sets one group's).
//
// Errors: ErrClosed, or lr negative or not finite.
func (o *Optimizer) SetLR(lr float64) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.pool == nil {
		return ErrClosed
	}
	h := o.opts.Hyper
	h.LR = lr
	if err := h.Validate(); err != nil {
		return fmt.Errorf("offload: SetLR: %w", err)
	}
	o.opts.Hyper.LR = lr
	for g := range o.opts.Groups {
		o.opts.Groups[g].LR = lr
	}
	return nil
}

// SetGroupLR sets parameter group g's learning rate for the next steps, as
// assigning param_groups[g]["lr"] does in PyTorch (a schedule that scales
// each group's own base rate).
//
// Errors: ErrClosed; no group g; lr negative or not finite.
func (o *Optimizer) SetGroupLR(g int, lr float64) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.pool == nil {
		return ErrClosed
	}
	groups := o.opts.groups()
	if g < 0 || g >= len(groups) {
		return fmt.Errorf("offload: SetGroupLR: group %d: the optimizer has %d", g, len(groups))
	}
	if !(lr >= 0) || math.IsInf(lr, 0) {
		return fmt.Errorf("offload: SetGroupLR: group %d: lr %v: want a finite value >= 0", g, lr)
	}
	if len(o.opts.Groups) == 0 {
		o.opts.Hyper.LR = lr
		return nil
	}
	o.opts.Groups[g].LR = lr
	return nil
}

// Index returns the position of the parameter named name, or an error naming
// it when there is none.
func (o *Optimizer) Index(name string) (int, error) {
	i, ok := o.byName[name]
	if !ok {
		return 0, fmt.Errorf("offload: no parameter named %q", name)
	}
	return i, nil
}

func (o *Optimizer) span(i int) (lo, hi int) {
	p := o.params[i]
	return p.Offset, p.Offset + p.Len
}

// Grad returns the gradient buffer of parameter i (in New's order), of
// Options.GradDType. The trainer writes the gradient there before Step,
// never while Step or ZeroGrad runs (see Optimizer's Concurrency). With
// Options.Device the buffers (every parameter's) are made, zeroed, at the
// first Grad or Step without StepArgs.GradOnDevice: a trainer whose
// gradients stay on the device never holds them.
// Panics if i is out of range.
func (o *Optimizer) Grad(i int) Tensor {
	lo, hi := o.span(i)
	g := o.hostGrad()
	t := Tensor{Name: o.params[i].Name, Shape: o.params[i].Shape, DType: g.DType}
	if t.DType == adam.F32 {
		t.f32 = g.F32[lo:hi:hi]
	} else {
		t.u16 = g.U16[lo:hi:hi]
	}
	return t
}

// hostGrad returns the host gradient buffers (Grad's), made and faulted in
// at the first call: New's without Options.Device, with one the first
// Grad's or Step's without StepArgs.GradOnDevice (ZeroGrad clears them
// only once made), zeros until written.
func (o *Optimizer) hostGrad() adam.Grad {
	o.gradOnce.Do(func() {
		if o.grad.DType == adam.F32 {
			o.grad.F32 = make([]float32, o.total)
			prefault32(o.grad.F32)
		} else {
			o.grad.U16 = make([]uint16, o.total)
			prefault16(o.grad.U16)
		}
		o.gradMade.Store(true)
	})
	return o.grad
}

// GradOf is Grad of the parameter named name.
//
// Errors: no such parameter (the error names it).
func (o *Optimizer) GradOf(name string) (Tensor, error) {
	i, err := o.Index(name)
	if err != nil {
		return Tensor{}, err
	}
	return o.Grad(i), nil
}

// WorkingOf is Working of the parameter named name.
//
// Errors: no such parameter (the error names it).
func (o *Optimizer) WorkingOf(name string) (Tensor, error) {
	i, err := o.Index(name)
	if err != nil {
		return Tensor{}, err
	}
	return o.Working(i), nil
}

// MasterOf is Master of the parameter named name.
//
// Errors: no such parameter (the error names it); those of Master.
func (o *Optimizer) MasterOf(name string) ([]float32, error) {
	i, err := o.Index(name)
	if err != nil {
		return nil, err
	}
	return o.Master(i)
}

// Working returns the working copy of parameter i that forward and backward
// read: the 16-bit copy when Options.WorkingDType is set, else the fp32
// master weights themselves (read-only by convention: write with SetParam).
// Its contents change with Step, SetParam and LoadCheckpoint: read it
// between those calls, not during them (see Optimizer's Concurrency).
// Panics if i is out of range.
//
// After a Step with StepArgs.GradOnDevice the new copy is on the device
// only: Working then first fetches the whole copy into the host buffers
// (scheduler.Engine.GetWorking, under the lock the other calls take), so
// that the views it returns, and those it returned before, hold the
// post-step values; until then a view returned earlier holds the values
// as of the last fetch. Working cannot report a failed fetch (a device
// fault): the views then keep the last values fetched, and SyncHost
// returns the error.
func (o *Optimizer) Working(i int) Tensor {
	lo, hi := o.span(i)
	if o.workStale.Load() {
		o.mu.Lock()
		_ = o.syncWorking() // its error: see above
		o.mu.Unlock()
	}
	if o.work.DType == 0 {
		return Tensor{Name: o.params[i].Name, Shape: o.params[i].Shape, DType: adam.F32, f32: o.state.Param[lo:hi:hi]}
	}
	return Tensor{Name: o.params[i].Name, Shape: o.params[i].Shape, DType: o.work.DType, u16: o.work.Data[lo:hi:hi]}
}

// Master returns a copy of the fp32 master weights of parameter i (with
// Options.Device, fetched from the device first when i is resident there;
// after a device fault they may be a step behind).
// Panics if i is out of range, or with Options.Device after Close.
func (o *Optimizer) Master(i int) ([]float32, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	lo, hi := o.span(i)
	if o.opts.Device != nil {
		switch {
		case o.pool == nil:
			return nil, ErrClosed // its pinned state is freed
		case o.dev == devBroken:
			return nil, fmt.Errorf("offload: %w: the master weights are torn (LoadCheckpoint restores them)", scheduler.ErrBroken)
		}
		if err := o.syncHost(); err != nil {
			return nil, err
		}
	}
	return append([]float32(nil), o.state.Param[lo:hi]...), nil
}

// SetParam sets the master weights of the parameter named name to values and
// refreshes its working copy. The optimizer state is not touched.
//
// Errors: ErrClosed, no such parameter, or len(values) differs from its
// size.
func (o *Optimizer) SetParam(name string, values []float32) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.pool == nil {
		return ErrClosed
	}
	i, err := o.Index(name)
	if err != nil {
		return err
	}
	lo, hi := o.span(i)
	if len(values) != hi-lo {
		return fmt.Errorf("offload: SetParam %q: %d values for shape %v (%d elements)", name, len(values), o.params[i].Shape, hi-lo)
	}
	return o.writeState(MasterWeights, lo, hi, values)
}

// writeState is SetParam's and WriteState's write of kind's state over
// [lo, hi) from src: after any save in capture, with the host state and
// working copy current (a device's brought back), refreshing the working
// copy when kind is the master weights, and leaving a device behind the
// host until its next Load. Hold o.mu.
func (o *Optimizer) writeState(kind StateKind, lo, hi int, src []float32) error {
	if err := o.settle(true); err != nil {
		return err
	}
	if err := o.dropPrefetch(); err != nil {
		return err
	}
	if o.opts.Device != nil && o.dev == devBroken {
		return fmt.Errorf("offload: %w: a write would mix one parameter into a torn state (LoadCheckpoint restores one)", scheduler.ErrBroken)
	}
	if err := o.syncHost(); err != nil {
		return err
	}
	// The other parameters' copy must be current in the host buffers
	// too: Load rounds every one from the master weights anyway, but
	// Working reads the host buffers.
	if err := o.syncWorking(); err != nil {
		return err
	}
	dst, err := o.stateOf(kind, lo, hi)
	if err != nil {
		return err
	}
	copy(dst, src)
	if kind == MasterWeights {
		o.refreshWorking(lo, hi)
	}
	if o.eng != nil {
		o.dev = devHostAhead
	}
	return nil
}

func (o *Optimizer) refreshWorking(lo, hi int) {
	if o.work.DType != 0 {
		adam.Round16(o.work.DType, o.work.Data[lo:hi], o.state.Param[lo:hi])
	}
}

// ZeroGrad sets every gradient to zero (optimizer.zero_grad(set_to_none=False)):
// the host buffers (Grad) and, with Options.Device, the device buffers
// (DeviceGrad) too, with a memset on the device that it waits for, so
// that either kind of Step (StepArgs.GradOnDevice) reads zeros where the
// trainer wrote nothing. No device work of the trainer on the gradients
// may be in flight. A GPU trainer whose backward overwrites every
// gradient need not call it. After Close it still clears the host
// buffers (and returns nil).
//
// Errors: with Options.Device, scheduler.ErrBroken (wrapped) after a
// device fault, or a memset that failed; the host buffers are cleared
// whatever it says.
func (o *Optimizer) ZeroGrad() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.gradMade.Load() { // else there is nothing to clear: the first use makes zeros
		clear(o.grad.F32)
		clear(o.grad.U16)
	}
	o.resetFinal() // the engine's ZeroGrad drops what was prefetched
	switch {
	case o.opts.Device == nil || o.pool == nil:
		return nil
	case o.dev == devBroken:
		return fmt.Errorf("offload: ZeroGrad: %w (the device gradients were not cleared)", scheduler.ErrBroken)
	}
	if err := o.eng.ZeroGrad(); err != nil {
		o.noteBroken()
		return fmt.Errorf("offload: ZeroGrad of the device gradients: %w", err)
	}
	return nil
}

// Step runs one update phase over every subgroup: the global non-finite
// check, the optional global norm clipping, one advance of the step counter,
// and the AdamW update of every subgroup with the same bias corrections
// (package doc). It allocates nothing. Steps on several goroutines run one
// after the other (see Optimizer's Concurrency); StepResult.Elapsed
// excludes the wait for another call in flight.
//
// With Options.Device an error may come after the step was taken: compare
// the StepResult's Step with StepCount before the call. A
// *scheduler.FaultError means a copy or launch failed and the step was
// completed subgroup by subgroup (taken); a failure to bring the working
// copy back after the update also comes with the step taken; errors before
// the update (moving the gradients, the checks) leave it not taken;
// scheduler.ErrBroken means the state is no longer consistent (restore
// from a checkpoint).
//
// While a lazy checkpoint (SaveAsync) is being captured, the update of each
// subgroup first waits for that subgroup's capture.
//
// With StepArgs.GradOnDevice it reads the gradients from the device
// buffers (DeviceGrad) and leaves the new working copy there
// (DeviceWorking), not in the host buffers until Working fetches it; the
// order of the trainer's device work around it is StepArgs.GradOnDevice's.
//
// Errors: ErrClosed; a LossScale that is negative, not finite, or so small
// or large that 1/LossScale is not a finite, non-zero float32; the failure
// of the last SaveAsync's background save (reported once; the step is not
// taken); GradOnDevice without Options.Device (ErrNoDevice) or when
// SyncDevice was due (the step is not taken). A skipped step is not an
// error: it is reported in StepResult.Skipped.
func (o *Optimizer) Step(args StepArgs) (StepResult, error) {
	o.mu.Lock()
	res, begun, err := o.beginStep(args)
	if !begun {
		o.endStep()
		return res, err
	}
	return o.finishStep()
}

// StepAsync is Step that returns once the update phase has begun, its
// tail running on a goroutine of the optimizer's: a trainer's next
// forward overlaps it, each block reading its weights after WaitParams
// (issue 31; DESIGN.md, the update hidden behind compute), and WaitStep
// then returns the step's whole result. It begins the phase with
// Options.Device and StepArgs.GradOnDevice when the step is neither
// skipped nor refused; otherwise it is Step, and WaitStep returns Step's
// result. The StepResult it returns has Step (the count once this step is
// taken), Skipped, GradNorm, ClipCoef and Speculated; WaitStep's has
// Elapsed and Options.Replan's fields too. Until the phase ends,
// o's lock is held: the methods that take it (see Concurrency) wait for
// the phase; StepCount, which takes none, counts the step under way at
// once. StepAsync and WaitStep are called from one goroutine,
// in turn: a StepAsync before the last one's WaitStep is an error. It
// allocates a goroutine's start per step and nothing else.
//
// Errors: Step's that come before the update phase (and all of Step's
// without the phase on a goroutine), which leave nothing for WaitStep; a
// StepAsync whose result WaitStep has not taken. The phase's own come
// from WaitStep.
func (o *Optimizer) StepAsync(args StepArgs) (StepResult, error) {
	if o.asyncN > 0 {
		return StepResult{}, errors.New("offload: StepAsync before WaitStep took the last one's result")
	}
	o.mu.Lock()
	res, begun, err := o.beginStep(args)
	switch {
	case !begun:
		o.endStep()
	case !args.GradOnDevice:
		// The working copy comes back into the host buffers at the
		// phase's end: a forward reading them must wait for all of it.
		res, err = o.finishStep()
	default:
		o.cur.shared = args.Beside // the caller's forward shares the GPU with the phase
		o.asyncN++
		go o.finishAsync()
		return res, nil
	}
	if err != nil {
		return res, err // nothing for WaitStep
	}
	o.asyncN++
	o.asyncRes <- asyncResult{res, nil}
	return res, nil
}

// WaitStep waits for the step StepAsync began and returns its result and
// error: those Step would have returned. With none (no StepAsync since
// the last WaitStep) it returns a zero StepResult and nil at once.
func (o *Optimizer) WaitStep() (StepResult, error) {
	if o.asyncN == 0 {
		return StepResult{}, nil
	}
	o.asyncN--
	r := <-o.asyncRes
	return r.res, r.err
}

// WaitParams makes s wait until the parameters with indices [lo, hi)
// (Params' order) have their new values in the update phase StepAsync
// began: their working copy (DeviceWorking, and an OffloadParam's
// HostWorking: then a wait on the host, for the copy the caller enqueues
// after it) and their fp32 copy (DeviceMaster). Work enqueued on s after
// it reads them; with no phase under way it returns at once. It takes no
// lock and may be called while StepAsync's phase runs, from the goroutine
// that called StepAsync (scheduler.Engine.WaitReady, per subgroup that
// holds the parameters). s may be nil for a host wait alone.
//
// Errors: lo, hi out of order or range; the phase stopped before it
// updated them (a fault, which WaitStep reports); the device's.
func (o *Optimizer) WaitParams(s Stream, lo, hi int) error {
	if lo < 0 || hi > len(o.params) || lo > hi {
		return fmt.Errorf("offload: WaitParams(%d, %d): want 0 <= lo <= hi <= %d", lo, hi, len(o.params))
	}
	if lo == hi {
		return nil
	}
	o.readyMu.RLock()
	defer o.readyMu.RUnlock()
	e := o.phase.Load()
	if e == nil {
		return nil
	}
	for k := range o.paramSubgroups(lo, hi) {
		if err := e.WaitReady(s, k); err != nil {
			return fmt.Errorf("offload: WaitParams: %w", err)
		}
	}
	return nil
}

// paramSubgroups yields the subgroups that hold the parameters [lo, hi)
// (valid indices), each parameter's own (with parameter groups the flat
// space is group after group: a span over several would take others'
// too), a subgroup shared by consecutive parameters once.
func (o *Optimizer) paramSubgroups(lo, hi int) iter.Seq[int] {
	return func(yield func(int) bool) {
		sgs, last := o.subgroups, -1
		for _, p := range o.params[lo:hi] {
			a, b := p.Offset, p.Offset+p.Len
			k := sort.Search(len(sgs), func(k int) bool { return sgs[k].Offset+sgs[k].Len > a })
			for ; k < len(sgs) && sgs[k].Offset < b; k++ {
				if k != last && !yield(k) {
					return
				}
				last = k
			}
		}
	}
}

// ParamsReady reports, without waiting, whether WaitParams(s, lo, hi)
// would find every subgroup of the parameters [lo, hi) issued: true with
// no phase under way; for an OffloadParam's HostWorking it means its new
// values are there. A trainer uses it to enqueue a copy ahead only when
// it would not wait (scheduler.Engine.Ready). It takes no lock; lo and hi
// out of range or order report false.
func (o *Optimizer) ParamsReady(lo, hi int) bool {
	if lo < 0 || hi > len(o.params) || lo > hi {
		return false
	}
	o.readyMu.RLock()
	defer o.readyMu.RUnlock()
	e := o.phase.Load()
	if e == nil {
		return true
	}
	for k := range o.paramSubgroups(lo, hi) {
		if !e.Ready(k) {
			return false
		}
	}
	return true
}

// asyncResult is a step's result, from StepAsync to WaitStep.
type asyncResult struct {
	res StepResult
	err error
}

// finishAsync is StepAsync's goroutine: the phase's end.
func (o *Optimizer) finishAsync() {
	res, err := o.finishStep()
	o.asyncRes <- asyncResult{res, err}
}

// endStep ends a Step that did not begin an update phase: what GradsFinal
// prefetched is dropped (endPrefetch), and o's lock released.
func (o *Optimizer) endStep() {
	o.endPrefetch()
	o.mu.Unlock()
}

// beginStep is Step up to its update phase, o.mu held: begun says the
// phase began (finishStep ends it); otherwise the step is over (res and
// err are Step's).
func (o *Optimizer) beginStep(args StepArgs) (res StepResult, begun bool, err error) {
	// What GradsFinal prefetched is this step's: the engine's Update takes
	// it; a Step that returns before that (skipped, refused, failed) drops
	// it (endStep), so that the next backward's gradients are moved again.
	start := time.Now()
	if o.pool == nil {
		return StepResult{}, false, ErrClosed
	}
	if o.dev == devBroken {
		return StepResult{}, false, fmt.Errorf("offload: %w (LoadCheckpoint restores one)", scheduler.ErrBroken)
	}
	if err := o.settle(false); err != nil {
		return StepResult{}, false, err
	}
	unscale := float32(1)
	switch s := args.LossScale; {
	case s == 0 || s == 1:
	case s > 0 && !math.IsInf(s, 0) && !math.IsInf(float64(float32(1/s)), 0) && float32(1/s) != 0:
		unscale = float32(1 / s)
	default:
		return StepResult{}, false, fmt.Errorf("offload: LossScale %v: want a finite value > 0 whose reciprocal is a finite, non-zero float32", s)
	}
	res = StepResult{Step: o.step, ClipCoef: 1}
	if o.eng != nil {
		return o.beginDevice(start, unscale, res, args.GradOnDevice, args.Reduce)
	}
	if args.GradOnDevice {
		return res, false, fmt.Errorf("offload: StepArgs.GradOnDevice: %w", ErrNoDevice)
	}
	// One pass over every gradient: the non-finite check and, when
	// clipping, the sum of squares (adam.Pool.GradStats).
	var ss float64
	finite := true
	for _, sg := range o.subgroups {
		f, s := o.pool.GradStats(o.grad.Slice(sg.Offset, sg.Offset+sg.Len), unscale)
		if finite = f; !finite {
			break
		}
		ss += s
	}
	ss, skip, err := globalStats(args.Reduce, finite, ss)
	if err != nil {
		return res, false, err
	}
	if skip {
		res.Skipped = true
		res.Elapsed = time.Since(start)
		return res, false, nil
	}
	clip := float32(1)
	if o.opts.MaxGradNorm > 0 {
		clip, res.GradNorm = clipCoef(ss, o.opts.MaxGradNorm)
		res.ClipCoef = float64(clip)
	}
	o.step++
	o.stepAt.Store(o.step)
	o.groupCoeffs(o.step, unscale, clip)
	for _, sg := range o.subgroups {
		lo, hi := sg.Offset, sg.Offset+sg.Len
		if o.pending.h != nil {
			// Copy-on-write: only this subgroup of the snapshot must be
			// captured. A failed save frees the memory too; its error
			// comes back from the handle and the next Step (settle).
			_ = o.pending.h.WaitGroup(sg.Index)
		}
		o.pool.Step(&o.gcoeffs[sg.Group], o.state.Slice(lo, hi), o.grad.Slice(lo, hi), o.work.Slice(lo, hi))
	}
	res.Step = o.step
	res.Elapsed = time.Since(start)
	return res, false, nil
}

// residentLayout is where the plans put the resident subgroups (Options.
// ResidentFirst).
func (o *Optimizer) residentLayout() scheduler.Layout {
	if o.opts.ResidentFirst {
		return scheduler.ResidentFirst
	}
	return scheduler.ResidentLast
}

// subgroupSizes returns the subgroups' sizes, for the performance model.
func (o *Optimizer) subgroupSizes() []int64 {
	sizes := make([]int64, len(o.subgroups))
	for i, sg := range o.subgroups {
		sizes[i] = int64(sg.Len)
	}
	return sizes
}

// deviceSizes returns the sizes of the subgroups that are not host-held,
// in order: those the engine's lanes place (scheduler.NewHeldPlan).
func (o *Optimizer) deviceSizes() []int64 {
	var sizes []int64
	for _, sg := range o.subgroups {
		if !sg.HostHeld {
			sizes = append(sizes, int64(sg.Len))
		}
	}
	return sizes
}

// cpuParams returns the parameters the plan in use updates on the CPU
// workers: its CPU subgroups' and the host-held ones'.
func (o *Optimizer) cpuParams() int64 {
	roles := o.eng.Plan().Roles
	var n int64
	for i, sg := range o.subgroups {
		if sg.HostHeld || (i < len(roles) && roles[i] == scheduler.OnCPU) {
			n += int64(sg.Len)
		}
	}
	return n
}

// held returns each subgroup's HostHeld: scheduler.Options.HostHeld
// (all false without OffloadParam, as nil is).
func (o *Optimizer) held() []bool {
	h := make([]bool, len(o.subgroups))
	for i, sg := range o.subgroups {
		h[i] = sg.HostHeld
	}
	return h
}

// heldNote says, for an error about the subgroup counts, how many
// subgroups OffloadParam leaves out of them.
func (o *Optimizer) heldNote() string {
	if n := len(o.subgroups) - len(o.deviceSizes()); n > 0 {
		return fmt.Sprintf("; %d more host-held subgroups of Options.OffloadParam are not counted", n)
	}
	return ""
}

// groupCoeffs computes every parameter group's scalars for step: Hyper
// with the group's lr and weight_decay. It allocates nothing.
func (o *Optimizer) groupCoeffs(step int64, unscale, clip float32) {
	if len(o.opts.Groups) == 0 {
		o.gcoeffs[0] = o.opts.Hyper.Coeffs(step, unscale, clip)
		return
	}
	for g, grp := range o.opts.Groups {
		h := o.opts.Hyper
		h.LR, h.WeightDecay = grp.LR, grp.WeightDecay
		o.gcoeffs[g] = h.Coeffs(step, unscale, clip)
	}
}

// subgroupCoeffs writes each subgroup's scalars of step into dst (one per
// subgroup): its parameter group's (groupCoeffs). It allocates nothing.
func (o *Optimizer) subgroupCoeffs(dst []adam.Coeffs, step int64, unscale, clip float32) {
	o.groupCoeffs(step, unscale, clip)
	for i, sg := range o.subgroups {
		dst[i] = o.gcoeffs[sg.Group]
	}
}

// engineErr wraps an error of the engine outside the update phase and,
// when the engine says it is broken (a wait failed with work in flight),
// makes the optimizer broken: only LoadCheckpoint, with a new engine,
// helps then.
func (o *Optimizer) engineErr(err error) error {
	o.noteBroken()
	return fmt.Errorf("offload: %w", err)
}

// noteBroken makes the optimizer broken when its engine is.
func (o *Optimizer) noteBroken() {
	if o.eng.Broken() {
		o.dev = devBroken
	}
}

// isFault reports whether err is a scheduler.FaultError: the phase
// completed after a device fault.
func isFault(err error) bool {
	var fault *scheduler.FaultError
	return errors.As(err, &fault)
}

// globalStats returns the sum of squares Step clips with and whether it
// skips: this optimizer's (ss, NaN when finite is false) passed through
// StepArgs.Reduce when set (the whole model's over ZeRO-3 ranks); NaN or
// Inf skips.
func globalStats(reduce func(float64) (float64, error), finite bool, ss float64) (float64, bool, error) {
	if !finite {
		ss = math.NaN()
	}
	if reduce != nil {
		var err error
		if ss, err = reduce(ss); err != nil {
			return 0, false, fmt.Errorf("offload: StepArgs.Reduce: %w", err)
		}
	}
	return ss, math.IsNaN(ss) || math.IsInf(ss, 0), nil
}

// stepDevice is Step through the engine on Options.Device: the gradients
// move to the device (unless onDevice: they are there), the global checks
// run there over every subgroup whatever its role, then the update phase,
// then the working copy comes back to the host mirror (unless onDevice:
// the mirror is then stale, workStale).
func (o *Optimizer) beginDevice(start time.Time, unscale float32, res StepResult, onDevice bool, reduce func(float64) (float64, error)) (StepResult, bool, error) {
	// The backward is over: what Options.Speculate did not reach is the
	// phase's, at half the memory traffic (no saves).
	o.eng.StopSpeculation()
	// A lazy checkpoint in capture: the engine waits per subgroup (Hold,
	// set by SaveAsync); the resident state's D2H is ordered before the
	// kernels on the device. o.pending.d2h stays: syncHost must still
	// wait for the capture before bringing resident state back.
	if o.dev == devHostAhead && onDevice {
		// The trainer's forward read a device copy that was not the
		// master weights' (SyncDevice was due): its gradients are not
		// theirs.
		return res, false, errors.New("offload: Step with GradOnDevice, but New, SetParam or LoadCheckpoint changed the master weights since the last SyncDevice: the gradients came from a stale device working copy (call SyncDevice before the forward)")
	}
	if err := o.loadDevice(); err != nil {
		return res, false, err
	}
	if !onDevice {
		if err := o.eng.SetGrad(o.hostGrad()); err != nil {
			return res, false, o.engineErr(err)
		}
	}
	finite, ss, err := o.eng.Stats(unscale)
	if err != nil {
		return res, false, o.engineErr(err)
	}
	ss, skip, err := globalStats(reduce, finite, ss)
	if err != nil {
		return res, false, err
	}
	o.lastUnscale = unscale
	if skip {
		o.specPaused = true // the drop (endPrefetch) restores what was speculated
		res.Skipped = true
		res.Elapsed = time.Since(start)
		return res, false, nil
	}
	clip := float32(1)
	if o.opts.MaxGradNorm > 0 {
		clip, res.GradNorm = clipCoef(ss, o.opts.MaxGradNorm)
		res.ClipCoef = float64(clip)
	}
	o.specPaused = clip != 1
	// In fields: the engine's lanes read the coefficients, so locals
	// would escape and cost an allocation per Step.
	o.subgroupCoeffs(o.sgcoeffs, o.step+1, unscale, clip)
	// The speculative updates of these very scalars are kept (the phase
	// skips them); the others are restored first (Options.Speculate).
	if res.Speculated, err = o.eng.EndSpeculation(o.sgcoeffs); err != nil {
		return res, false, o.engineErr(err)
	}
	res.SpeculatedGPU = o.eng.SpeculatedGPU()
	if err = o.eng.StartUpdatePer(o.sgcoeffs); err != nil {
		if o.eng.Broken() {
			o.dev = devBroken
		}
		return res, false, fmt.Errorf("offload: step %d: %w", o.step+1, err)
	}
	res.Step = o.step + 1
	o.stepAt.Store(o.step + 1)
	o.readyMu.Lock()
	o.phase.Store(o.eng)
	o.readyMu.Unlock()
	// A phase that may wait on a lazy checkpoint's capture (the engine's
	// per-subgroup holds) measures the capture too: Options.Replan leaves
	// it out of the fit.
	o.cur = curStep{start: start, res: res, onDevice: onDevice, held: o.pending.h != nil && !o.pending.h.Captured()}
	return res, true, nil
}

// curStep is the step whose update phase beginDevice began, for
// finishStep.
type curStep struct {
	start          time.Time
	res            StepResult
	onDevice, held bool
	// shared: StepAsync's phase with StepArgs.Beside, beside which the
	// caller runs its next forward on the same GPU (Options.Replan does
	// not fit the GPU's rate from it).
	shared bool
}

// finishStep ends the update phase beginDevice began (o.cur), completes
// the step as Step does, drops what it did not take of GradsFinal's, and
// releases o.mu.
func (o *Optimizer) finishStep() (StepResult, error) {
	defer o.mu.Unlock()
	defer o.endPrefetch()
	res := o.cur.res
	err := o.eng.FinishUpdate()
	o.readyMu.Lock()
	o.phase.Store(nil)
	o.readyMu.Unlock()
	if err != nil && !isFault(err) {
		if o.eng.Broken() {
			o.dev = devBroken
		}
		o.stepAt.Store(o.step)
		res.Step = o.step
		return res, fmt.Errorf("offload: step %d: %w", o.step+1, err)
	}
	// Done, or completed after a fault (err says which).
	o.step++
	o.stepAt.Store(o.step)
	if o.eng.Plan().Schedule.Resident > 0 {
		o.dev = devDeviceAhead
	}
	res.Step = o.step
	if o.cur.onDevice {
		o.workStale.Store(true) // Working fetches it
	} else if gerr := o.eng.GetWorking(o.work.Data); gerr != nil {
		o.workStale.Store(true) // Working tries again
		o.noteBroken()
		if err == nil {
			err = fmt.Errorf("offload: step %d was taken, but its working copy did not come back: %w", o.step, gerr)
		}
	} else {
		o.workStale.Store(false)
	}
	if o.re.base != nil && err == nil {
		// Options.Replan: after the working copy is where the caller
		// reads it, so that a failed re-plan leaves a consistent step.
		err = o.refit(&res, o.cur.held, o.cur.shared)
	}
	res.Elapsed = time.Since(o.cur.start)
	return res, err
}

// GradsFinal tells the optimizer, with Options.OverlapBackward, that the
// gradients of the parameters params (indices) are final once the work
// enqueued on s so far is done (DeviceGrad's, and with Options.Speculate
// HostGrad's too: copy an OffloadParam gradient into HostGrad on s, or
// before this call): a GPU trainer calls it
// during its backward, as each block's gradients are written (the last
// blocks' first). Once every parameter from some flat offset to the end of
// the flat space (Params' Offset; parameter order) is final, the update
// phase's work that needs no global value starts for that suffix, in the
// background (scheduler.Engine.Prefetch): the CPU subgroups' gradient D2H
// and the first streamed subgroups' state H2D. It waits for nothing on the
// device (only for o's lock, and on an error for what it had enqueued)
// and allocates nothing. The gradients it was told of must not change until
// the next Step, which uses what it started; ZeroGrad, a skipped or failed
// Step, SetParam, WriteState and LoadCheckpoint drop it (the Step then
// does that work itself). With Options.Speculate the OffloadParam
// subgroups and the CPU subgroups (whose gradients were moved) inside the
// final suffix are also updated speculatively, in the background
// (scheduler.Engine.Speculate), unless there was no Step yet, the last Step
// clipped or was skipped or a Snapshot was taken since. The update is the
// same, bit for bit. s is a stream of Options.Device (scheduler.CUDAStream
// wraps a CUDA stream).
//
// Errors: ErrClosed; ErrNoDevice without Options.Device; Options.
// OverlapBackward not set; an index out of range; scheduler.ErrBroken
// (wrapped) after a device fault; a copy that could not be enqueued (what
// was started is dropped).
func (o *Optimizer) GradsFinal(s Stream, params ...int) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	switch {
	case o.pool == nil:
		return ErrClosed
	case o.opts.Device == nil:
		return fmt.Errorf("offload: GradsFinal: %w", ErrNoDevice)
	case !o.opts.OverlapBackward:
		return errors.New("offload: GradsFinal needs Options.OverlapBackward")
	case o.dev == devBroken:
		return fmt.Errorf("offload: GradsFinal: %w (LoadCheckpoint restores one)", scheduler.ErrBroken)
	}
	for _, i := range params {
		if i < 0 || i >= len(o.params) {
			return fmt.Errorf("offload: GradsFinal: parameter index %d: want [0, %d)", i, len(o.params))
		}
		o.final[i] = true
	}
	r := o.ready
	for k := len(o.layout) - 1; k >= 0 && o.final[o.layout[k]]; k-- {
		r = min(r, o.params[o.layout[k]].Offset)
	}
	if r >= o.ready {
		return nil // no new suffix
	}
	o.ready = r
	if err := o.eng.Prefetch(s, int64(r)); err != nil {
		return o.engineErr(err)
	}
	if o.opts.Speculate > 0 && !o.specPaused {
		if !o.specSet {
			// The scalars of a step that neither clips nor is skipped,
			// with the last step's loss scale: what the Step keeps when it
			// has them. Once per step (the engine fixes them at its first
			// Speculate).
			o.subgroupCoeffs(o.specCs, o.step+1, o.lastUnscale, 1)
			o.specSet = true
		}
		if err := o.eng.Speculate(s, int64(r), o.specCs); err != nil {
			return o.engineErr(err)
		}
	}
	return nil
}

// endPrefetch ends a Step's use of what GradsFinal started: the engine's
// Update took it, or it is dropped (DropPrefetch does nothing when there
// is none). The caller holds o.mu.
func (o *Optimizer) endPrefetch() {
	o.resetFinal()
	if o.eng != nil && o.dev != devBroken {
		if err := o.eng.DropPrefetch(); err != nil {
			o.noteBroken()
		}
	}
}

// resetFinal forgets GradsFinal's parameters (the engine's prefetch is
// taken or dropped by the caller).
func (o *Optimizer) resetFinal() {
	clear(o.final)
	o.ready = o.total
	o.specSet = false
}

// dropPrefetch drops what GradsFinal started, before the host state
// changes (SetParam, WriteState, LoadCheckpoint): a prefetched state H2D
// may still read it. The caller holds o.mu.
func (o *Optimizer) dropPrefetch() error {
	o.resetFinal()
	if o.eng == nil || o.dev == devBroken {
		return nil
	}
	if err := o.eng.DropPrefetch(); err != nil {
		return o.engineErr(err)
	}
	return nil
}

// syncWorking brings the device working copy into the host buffers when a
// Step with GradOnDevice left them behind (workStale). The caller holds
// o.mu.
func (o *Optimizer) syncWorking() error {
	switch {
	case !o.workStale.Load():
		return nil
	case o.pool == nil:
		return fmt.Errorf("%w: the working copy did not come back from the device at Close; the host copy is a step or more behind", ErrClosed)
	case o.dev == devBroken || o.eng == nil:
		return fmt.Errorf("offload: %w: the host working copy is a step or more behind the device's, which cannot be read (LoadCheckpoint restores both)", scheduler.ErrBroken)
	}
	if err := o.eng.GetWorking(o.work.Data); err != nil {
		o.noteBroken()
		return fmt.Errorf("offload: fetching the working copy from the device: %w", err)
	}
	o.workStale.Store(false)
	return nil
}

// SyncHost makes every host view current after Steps with
// StepArgs.GradOnDevice: the working copy (Working, which fetches it on
// its own but cannot report an error) and, with resident subgroups, the
// master state (which Master, Snapshot and SaveCheckpoint fetch on their
// own). Without Options.Device, or when nothing is behind, it does
// nothing.
//
// Errors: ErrClosed; scheduler.ErrBroken (wrapped) after a device fault; a
// failed copy.
func (o *Optimizer) SyncHost() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	switch {
	case o.pool == nil:
		return ErrClosed
	case o.opts.Device == nil:
		return nil
	case o.dev == devBroken:
		return fmt.Errorf("offload: %w (LoadCheckpoint restores one)", scheduler.ErrBroken)
	}
	if err := o.syncHost(); err != nil {
		return err
	}
	return o.syncWorking()
}

// clipCoef follows torch.nn.utils.clip_grad_norm_ in fp32: the total norm is
// rounded to fp32, clip_coef = max_norm / (total_norm + 1e-6), clamped to 1.
// PyTorch evaluates float / tensor as tensor.reciprocal() * float
// (Tensor.__rdiv__), two roundings, and so does this. It returns the
// coefficient and the norm.
func clipCoef(sumSquares, maxNorm float64) (float32, float64) {
	norm := float32(math.Sqrt(sumSquares))
	coef := float32(1/(norm+float32(1e-6))) * float32(maxNorm)
	if coef > 1 {
		coef = 1
	}
	return coef, float64(norm)
}

// prefault32 and prefault16 write a zero into every 4 KiB page of s (fresh,
// all-zero memory): the kernel maps the page now instead of at the first
// write of the hot path.
func prefault32(s []float32) {
	for i := 0; i < len(s); i += 1024 {
		s[i] = 0
	}
}

func prefault16(s []uint16) {
	for i := 0; i < len(s); i += 2048 {
		s[i] = 0
	}
}
