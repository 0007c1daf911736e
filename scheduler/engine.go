package scheduler

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/deepstates/dos/adam"
)

// Options configures an Engine.
type Options struct {
	// Device runs the GPU side (NewCUDA, or NewSim in tests).
	Device Device
	// Sizes are the subgroups' lengths in elements, in order (> 0 each).
	Sizes []int
	// GradDType is the gradients' dtype on the device: F32, BF16 or F16.
	GradDType adam.DType
	// WorkingDType is the 16-bit working copy's dtype on the device: BF16
	// or F16.
	WorkingDType adam.DType
	// AMSGrad keeps max_exp_avg_sq too (16 B/param of state, not 12).
	AMSGrad bool
	// Pool is the CPU workers; the caller owns it. nil: a pool of
	// GOMAXPROCS goroutines, closed by Close.
	Pool *adam.Pool
	// Plan places the subgroups (NewPlan over len(Sizes) subgroups).
	Plan *Plan
	// Mirror lists spans of the flat element space (all subgroups in
	// order) whose fp32 master weights the engine also keeps in device
	// memory, current after every Load and Update (Mirror()): what a GPU
	// trainer reads where PyTorch's autocast reads fp32 parameters
	// (embedding lookups, LayerNorm). Sorted by Off, not overlapping,
	// N > 0 each. Span k occupies the mirror's elements from
	// MirrorLayout's at[k] (each span 16-byte aligned). Each update copies the new values of its
	// subgroup's part: a device-to-device copy after a GPU subgroup's
	// kernel, a copy H2D from the host state after a CPU subgroup's
	// working copy.
	Mirror []Span
	// Prefetch gives every CPU subgroup's gradient pinned host memory of
	// its own (gradient bytes per CPU parameter, with each plan), so that
	// Prefetch can move it D2H during the trainer's backward; without it
	// Prefetch moves only the first streamed subgroups' state. Plans that
	// upcast on the GPU do not use it.
	Prefetch bool
	// HostHeld marks the subgroups (nil, or one entry per subgroup) whose
	// gradient and 16-bit working copy live in pinned host memory, not
	// in device memory: a trainer that streams their weights to the
	// device block by block writes their gradients into HostGrad and
	// reads their working copy from HostWorking (DeepSpeed
	// ZeRO-Infinity's offload_param). The CPU workers update them in
	// place, first in each phase, with no copy; the plan must place them
	// on the CPU (OnCPU) and leave them out of its orders (NewHeldPlan),
	// and no Mirror span may touch them. The device gradients and
	// working copy then hold the other subgroups only (DeviceOffset).
	HostHeld []bool
	// Speculate is host memory in bytes for the slots of speculative
	// updates (Speculate: the host-held subgroups, and with Prefetch the
	// CPU subgroups, updated out of place during the trainer's backward,
	// kept or undone when the step's scalars are known):
	// SpeculateBytes(n, AMSGrad) holds n parameters' state, 6 bytes of
	// each pinned (all of it with SpeculateGPU). 0: none.
	// Ignored when nothing qualifies at New: no host-held subgroups, and
	// no Prefetch (or a plan that upcasts CPU gradients on the GPU).
	Speculate int64
	// SpeculateGPU speculates on the streamed GPU subgroups too (OnGPU,
	// not host-held), during the backward on the copy engines the
	// backward leaves idle: their state H2D into the device staging, the
	// kernel with the speculative scalars (its new working copy in place,
	// which an undo copies back), the new state D2H into a slot, on
	// streams of their own (speculate_gpu.go). Every slot array is then
	// pinned (SpeculateBytes' 14 bytes a parameter, not 6), and Prefetch
	// leaves the staging to the speculation (it moves no state). Ignored
	// without Speculate; the device staging is the phase's, so it takes
	// no device memory of its own.
	SpeculateGPU bool

	// copyChunk, when > 0, replaces CopyChunk (tests cut small states
	// into pieces with it).
	copyChunk int64
}

// Span is a range of elements, [Off, Off+N).
type Span struct{ Off, N int64 }

// ErrBroken is returned by an Engine whose state is no longer known to be
// consistent: a device fault surfaced while work was in flight (a CUDA
// fault poisons the context), or a fault came back while finishing a step
// after an earlier one. Restore from a checkpoint.
var ErrBroken = errors.New("scheduler: the optimizer state is inconsistent after a device fault; restore from a checkpoint")

// maxElems bounds the elements of an engine (offload's bound too).
const maxElems = 1 << 40

// ErrEngineClosed is Update's error after Close.
var ErrEngineClosed = errors.New("scheduler: the engine is closed")

// hostChecker is a device that checks the host's own accesses to its
// pinned memory against the device's operations (Sim.HostAccess).
type hostChecker interface {
	HostAccess(h Host, off, n int64, write bool) error
	// HostPublish and HostAcquire tell it of a Go synchronization between
	// goroutines (a channel, the lanes' issued counts): what the
	// publishing goroutine knew complete under key, the acquiring one
	// knows too (Sim.HostPublish).
	HostPublish(key handoff)
	HostAcquire(key handoff)
}

// handoff is a key of hostChecker's publications: an engine's step
// (issued), or one of its channels (a negative step).
type handoff struct {
	e    *Engine
	step int32
}

// Keys of the engine's channels' handoffs.
const (
	handPhase = -1 - iota // beginPhase to the issuers
	handSpec              // Speculate to the workers
	handAck               // a worker's stop answer to its caller
	handEnd               // endPhase's drain to WaitReady after the phase
)

// specKey is the handoff key of a Speculate request with event ev.
func specKey(ev int) int32 { return -100 - int32(ev) }

// publish and acquire are hostChecker's, when the device is one.
func (e *Engine) publish(step int32) {
	if e.hostCheck != nil {
		e.hostCheck.HostPublish(handoff{e, step})
	}
}

func (e *Engine) acquire(step int32) {
	if e.hostCheck != nil {
		e.hostCheck.HostAcquire(handoff{e, step})
	}
}

// Engine runs the update phase of one rank over Options.Plan: the CPU
// workers on the CPU subgroups while the device streams the GPU subgroups'
// state through staging slots and updates the resident ones (Deep
// Optimizer States, section 4; DESIGN.md, update phase). It executes the
// schedule core's steps (core.go) on its device: lanes.go issues them,
// faults.go completes a step after a fault, alloc.go and transfers.go hold
// its memory and the copies outside the update phase. It owns the master
// state in pinned host memory, the gradients and the 16-bit working copy
// in device memory, the resident state, two device staging slots, two
// host staging slots per lane, and the fp32 mirror (Options.Mirror). Its methods must not be called
// concurrently.
type Engine struct {
	o   Options
	dev Device
	// hostCheck is dev when it checks the host's own accesses to pinned
	// memory (the simulated device's HostAccess), else nil.
	hostCheck hostChecker
	pool      *adam.Pool
	own       bool // the pool is ours
	plan      *Plan
	core      *core   // the plan's steps
	sizes     []int64 // Options.Sizes
	off       []int64 // first element of each subgroup
	total     int64
	maxN      int64
	nArr      int // state arrays: 3, or 4 with amsgrad
	gb        int64

	host       [4]Host       // p, m, v, vmax in pinned host memory
	held       []bool        // Options.HostHeld, one per subgroup (all false without it)
	doff       []int64       // per subgroup: its first element in grad and work (-1: host-held)
	hoff       []int64       // per subgroup: its first element in hgrad and hwork (-1: on the device)
	devN       int64         // elements of grad and work: the subgroups not host-held
	heldN      int64         // elements of hgrad and hwork
	hgrad      Host          // host-held subgroups' gradients (Options.GradDType)
	hwork      Host          // their working copy (Options.WorkingDType)
	segs       []segment     // the flat space cut where the gradients' place changes (Stats)
	part       []float64     // Stats' partial sums, one per adam.MinChunk block, with HostHeld
	mix        Host          // Stats' gather of one block that lies in both places
	hp         heldParts     // HeldPartials' sums on the device, for Stats
	state      adam.State    // views of host
	grad       Mem           // device gradients
	work       Mem           // device working copy
	res        [4]Mem        // resident state
	resOff     []int64       // element offset of each resident subgroup in res
	stage      [4]Mem        // device staging: 2 slots of maxN per array
	scr        Mem           // device fp32 scratch for the upcast: 2 slots
	gst        Host          // host gradient staging: 2 slots
	cst        Host          // host copy staging: 2 slots
	cpuGD      adam.DType    // the gradient dtype the CPU workers read
	s          [4]Stream     // sH2D (the H2D lane), sKernel, sD2H (the D2H lane), sUpcast
	laneMu     [4]sync.Mutex // per stream: a copy with its waits and events together
	startEv    []Event       // per step: the start of its operation (first steps only)
	endEv      []Event       // per step on the device: its end
	base       Event
	xfer       Host // pinned staging for SetGrad and GetWorking
	tail       [4]Event
	dlEv       Event                       // DownloadAsync's
	gate       atomic.Pointer[func(i int)] // Hold's (nil: none); read by the lanes and the speculation worker
	mirror     Mem                         // Options.Mirror's fp32 master weights on the device
	mirrorN    int64                       // its elements
	mpieces    [][]mpiece                  // per subgroup: its parts of the mirror
	allocs     []any                       // freed by Close
	planAllocs []any                       // freed by Close (and by Replan, but for the pinned buffers the next plan takes)
	spare      []Host                      // during Replan: the old plan's pinned host buffers, for the new one
	leaked     error                       // Replan's failures to free a spare: Close returns them

	// Prefetch's (prefetch.go), for the next Update.
	pre     []uint8 // per subgroup: bit per operation Prefetch issued
	preLast []uint8 // the last Update's pre (Trace, Measure)
	preOn   bool    // a Prefetch since the last Update (preBase recorded)
	preEv   Event   // recorded on the caller's stream at each Prefetch
	preBase Event   // at the first Prefetch before a phase: the origin of preTime
	gpre    Host    // pinned: every CPU subgroup's gradient (Options.Prefetch)
	gpOff   []int64 // per CPU subgroup: its gradient's byte offset in gpre

	// Speculate's (speculate.go), for the next Update.
	slots                  adam.State     // the slots: specN elements per array, a subgroup's state where a kept speculative update moved it (Param pinned: slotsH[0])
	slotsH                 [4]Host        // the slots' pinned memory per array: Param's always (the mirror's H2D reads it), all with Options.SpeculateGPU (nil otherwise)
	specOut                []uint16       // per slot element: a speculated CPU subgroup's new working copy, for its H2D
	specOutH               Host           // specOut's pinned memory
	specN                  int64          // elements the slots hold (0: no speculation)
	loc                    []int64        // per subgroup: where its state is, homeLoc (the host state) or a slot's first element
	specTo                 []int64        // per subgroup: where its speculative update wrote the new state (homeLoc or a slot), noSpec when not speculated
	specC                  []adam.Coeffs  // per subgroup: the scalars speculated with
	specT                  [][2]time.Time // per subgroup: when its speculative update ran
	specUndo, specUndoLast []specUndo     // undone speculative updates since the last phase, and those of the last phase (Trace)
	specEv                 []Event        // recorded by Speculate on the trainer's stream, in turn
	specNext               int            // the next of specEv
	specReady              int64          // the lowest ready of this phase's Speculate calls
	specCovered            int            // the first subgroup inside [specReady, total)
	specCan                []bool         // per subgroup: may be speculated on in this phase (decided by Speculate)
	specLeave              []bool         // per subgroup: left to the phase (SetSpeculateLeave; marked by Speculate's first call of a phase)
	specLeaveN             int64          // SetSpeculateLeave's parameters
	specMarked             bool           // markLeave ran since the last phase began
	leftLast               []bool         // per subgroup: left to the last phase (PhaseCPUEnd)
	specCopied             []bool         // per subgroup: specCopy put its speculative working copy on the device
	specDirty              []bool         // per subgroup: specCopy was tried (an undo copies the old working copy back, even after a failed one)
	specRecopied           bool           // restoreSpec put old working copies back on the device: syncRecopies waits for them
	specHalted             bool           // StopSpeculation was called: Speculate starts nothing until the speculation is settled
	specIdle               bool           // the worker has had no request since it last stopped (true before any)
	specOn                 bool           // a Speculate since the last Update or drop (specC set)
	specStop               atomic.Bool    // the worker takes no more subgroups
	specReq                chan specReq   // to the CPU workers' speculation
	specAck                chan struct{}  // from either worker, for a stop request
	specMu                 sync.Mutex     // the slots' allocation and specTo's reservations (reserve), shared by the two workers
	cpuNeed                int64          // on specMu: the slots the CPU workers' subgroups still need this phase, which the GPU speculation leaves them (reserve)
	cpuSpecN               int64          // on specMu: the slots' elements the CPU workers took since the last markCPUNeed
	cpuMarked              bool           // on specMu: markCPUNeed ran before

	// The GPU speculation's (speculate_gpu.go, Options.SpeculateGPU).
	specReqG      chan specReq // to its worker (nil without it)
	specS         [3]Stream    // its H2D, kernel and D2H streams (the engine's kernel stream waits for the trainer's backward: HeldPartials)
	specTail      [3]Event     // drainGPUSpec's, on specS and the kernel stream
	specStage     [2]int32     // per device staging slot: the last state D2H step it enqueued from it, -1 none
	specNextStage int          // the staging slot its next subgroup takes
	specBad       []bool       // per subgroup: its speculative update failed on the device (never kept)
	keptGPU       int64        // parameters the last EndSpeculation kept of its updates

	// Per Update.
	c           *adam.Coeffs  // the phase's scalars (Update), or
	cs          []adam.Coeffs // each subgroup's (UpdatePer)
	done        []uint8       // bit per operation done (enqueued, or run on the CPU)
	cpuT        [][2]time.Duration
	t0          time.Time
	wall        time.Duration // the last Update's wall time
	updated     bool          // an Update ran since New or Replan: Trace and Measure have a phase to read
	spans       []interval    // Measure's scratch, one per operation of the plan
	abort       atomic.Bool
	deviceFault atomic.Bool // a wait failed: the device itself faulted
	firstMu     chan struct{}
	first       *FaultError
	progMu      sync.Mutex
	progress    sync.Cond                 // on progMu: issued or ended changed
	issued      [numIssuers]int32         // steps each issuer has issued
	ended       [numIssuers]bool          // the issuer stopped
	start       [numIssuers]chan struct{} // one per Update to each issuer but issGPU
	fin         chan struct{}
	running     bool // the issuers' goroutines run
	broken      bool
	inPhase     bool // StartUpdatePer began a phase that FinishUpdate has not ended
	phaseOn     bool // on progMu: inPhase, for WaitReady
}

// New allocates the engine's memory on the device and the host: the host
// state (zeroed; write it with HostState and then Load), the device
// gradients and working copy, the resident state and the staging.
//
// Errors: bad options (naming the field), allocation failures (what was
// allocated is freed).
func New(o Options) (*Engine, error) {
	if o.Device == nil {
		return nil, errors.New("scheduler: Options.Device is nil")
	}
	if len(o.Sizes) == 0 {
		return nil, errors.New("scheduler: Options.Sizes is empty")
	}
	switch o.GradDType {
	case adam.F32, adam.BF16, adam.F16:
	default:
		return nil, fmt.Errorf("scheduler: Options.GradDType %v: want float32, bfloat16 or float16", o.GradDType)
	}
	if o.WorkingDType != adam.BF16 && o.WorkingDType != adam.F16 {
		return nil, fmt.Errorf("scheduler: Options.WorkingDType %v: want bfloat16 or float16", o.WorkingDType)
	}
	if o.Plan == nil || len(o.Plan.Roles) != len(o.Sizes) {
		return nil, fmt.Errorf("scheduler: Options.Plan must place the %d subgroups", len(o.Sizes))
	}
	e := &Engine{o: o, dev: o.Device, pool: o.Pool, nArr: 3}
	e.hostCheck, _ = o.Device.(hostChecker)
	if o.AMSGrad {
		e.nArr = 4
	}
	e.gb = elemBytes(o.GradDType)
	e.off = make([]int64, len(o.Sizes))
	e.sizes = make([]int64, len(o.Sizes))
	for i, n := range o.Sizes {
		if n <= 0 {
			return nil, fmt.Errorf("scheduler: Options.Sizes[%d] = %d: want > 0", i, n)
		}
		if int64(n) > maxElems-e.total {
			return nil, fmt.Errorf("scheduler: Options.Sizes: more than %d elements in all", int64(maxElems))
		}
		e.off[i] = e.total
		e.sizes[i] = int64(n)
		e.total += int64(n)
		e.maxN = max(e.maxN, int64(n))
	}
	if err := e.mirrorPieces(o.Mirror); err != nil {
		return nil, err
	}
	if err := e.placeHeld(); err != nil {
		return nil, err
	}
	if err := e.checkHeld(o.Plan); err != nil {
		return nil, err
	}
	if e.pool == nil {
		e.pool, e.own = adam.NewPool(0), true
	}
	if err := e.allocBase(); err != nil {
		return nil, errors.Join(err, e.Close())
	}
	if err := e.allocPlan(o.Plan); err != nil {
		return nil, errors.Join(err, e.Close())
	}
	if err := e.allocSpec(); err != nil {
		return nil, errors.Join(err, e.Close())
	}
	n := len(o.Sizes)
	e.done = make([]uint8, n)
	e.cpuT = make([][2]time.Duration, n)
	e.firstMu = make(chan struct{}, 1)
	e.progress.L = &e.progMu
	e.fin = make(chan struct{}, numIssuers)
	for l := issDrain; l < numIssuers; l++ {
		e.start[l] = make(chan struct{})
		go e.runIssuer(l)
	}
	e.running = true
	return e, nil
}

// Close stops the engine's goroutines and frees its memory, the slots of
// Options.Speculate too, without Hold's gate: a caller with a lazy
// capture in flight waits for it first (offload.Optimizer.Close does).
// Views from HostState and StateOf must not be used afterwards.
//
// Errors: the device's, for what it could not free (the rest is freed).
func (e *Engine) Close() error {
	_ = e.DropPrefetch() // its copies done before their memory is freed
	e.closeSpec()
	if e.running {
		for l := issDrain; l < numIssuers; l++ {
			close(e.start[l])
		}
		for range numIssuers - 1 {
			<-e.fin
		}
		e.running = false
	}
	err := errors.Join(e.freePlan(false), e.free(e.allocs), e.leaked)
	e.allocs, e.leaked = nil, nil
	if e.own && e.pool != nil {
		e.pool.Close()
		e.pool = nil
	}
	return err
}

// Broken reports whether the engine returns ErrBroken: its state is no
// longer known to be consistent.
func (e *Engine) Broken() bool { return e.broken }

// HostState returns the master state in pinned host memory, all subgroups
// flat in order (total elements per array). For resident subgroups it is
// current only after Download, and with Options.Speculate only after
// DropSpeculation (a kept speculative update may leave a subgroup's state
// in a slot of its own until the subgroup's next one); after writing it,
// call Load.
func (e *Engine) HostState() adam.State { return e.state }

// Grad returns the device gradients, all subgroups flat in order (but the
// host-held ones: DeviceOffset), of Options.GradDType: the trainer's
// backward writes them. The memory is
// the engine's from New to Close (Replan does not move it); Stats and
// Update read it, SetGrad and ZeroGrad write it.
func (e *Engine) Grad() Vec { return Vec{Mem: e.grad, N: e.devN} }

// Working returns the device working copy (Options.WorkingDType), all
// subgroups flat in order (but the host-held ones: DeviceOffset): forward
// and backward read it. The memory is
// the engine's from New to Close (Replan does not move it); Load and
// Update write it, GetWorking reads it. When Update returns, every write
// of the phase to it is complete, the CPU subgroups' copies H2D included
// (Update drains every stream): work enqueued afterwards on any stream
// reads the new copy.
func (e *Engine) Working() Vec { return Vec{Mem: e.work, N: e.devN} }

// Mirror returns the device fp32 copy of Options.Mirror's master weights,
// its spans in order where MirrorLayout puts them (a zero Vec without
// Options.Mirror; the padding between spans is not written). The
// memory is the engine's from New to Close; Load and Update write it
// (when Update returns, every write of the phase is complete, as for
// Working).
func (e *Engine) Mirror() Vec { return Vec{Mem: e.mirror, N: e.mirrorN} }

// MirrorLayout returns where each of spans lies in the mirror
// (Options.Mirror): at[k] is span k's first element, the spans in order,
// each starting on a multiple of 4 elements (16 bytes, for vector loads),
// and n the mirror's elements in all.
func MirrorLayout(spans []Span) (at []int64, n int64) {
	at = make([]int64, len(spans))
	for k, sp := range spans {
		at[k] = (n + 3) &^ 3
		n = at[k] + sp.N
	}
	return at, n
}

// mpiece is a part of the mirror inside one subgroup: n elements from the
// subgroup's element sub, at the mirror's element at.
type mpiece struct{ sub, at, n int64 }

// mirrorPieces checks Options.Mirror and cuts it at the subgroups.
func (e *Engine) mirrorPieces(spans []Span) error {
	e.mpieces = make([][]mpiece, len(e.sizes))
	end := int64(0)
	for k, sp := range spans {
		if sp.N <= 0 || sp.Off < end || sp.Off > e.total-sp.N {
			return fmt.Errorf("scheduler: Options.Mirror[%d] = [%d, %d+%d): want N > 0, sorted, not overlapping, inside the %d elements", k, sp.Off, sp.Off, sp.N, e.total)
		}
		end = sp.Off + sp.N
	}
	at, n := MirrorLayout(spans)
	for k, sp := range spans {
		for i, off := range e.off {
			lo, hi := max(sp.Off, off), min(sp.Off+sp.N, off+e.sizes[i])
			if lo < hi {
				e.mpieces[i] = append(e.mpieces[i], mpiece{sub: lo - off, at: at[k] + lo - sp.Off, n: hi - lo})
			}
		}
	}
	e.mirrorN = n
	return nil
}

// Plan returns the plan.
func (e *Engine) Plan() *Plan { return e.plan }

func (e *Engine) hostVec(a int, i int) (Host, int64, int64) {
	return e.host[a], 4 * e.off[i], 4 * int64(e.o.Sizes[i])
}

func (e *Engine) resState(i int) State {
	n := int64(e.o.Sizes[i])
	var s State
	for a, v := range []*Vec{&s.Param, &s.ExpAvg, &s.ExpAvgSq, &s.MaxExpAvgSq}[:e.nArr] {
		*v = Vec{Mem: e.res[a], Off: e.resOff[i], N: n}
	}
	return s
}

func (e *Engine) slotState(slot, i int) State {
	n := int64(e.o.Sizes[i])
	var s State
	for a, v := range []*Vec{&s.Param, &s.ExpAvg, &s.ExpAvgSq, &s.MaxExpAvgSq}[:e.nArr] {
		*v = Vec{Mem: e.stage[a], Off: int64(slot) * e.maxN, N: n}
	}
	return s
}

// Hold makes every later Update, and every speculative update
// (Speculate), call gate(i) and wait for it to return before its first
// write to subgroup i's host state: before a CPU subgroup's update (in
// place, in the host state) and before a GPU subgroup's state D2H.
// Resident subgroups' host state is not written by Update. A lazy
// checkpoint's copy-on-write uses it (offload.SaveAsync passes
// checkpoint.Handle.WaitGroup), so that the next update of subgroup i
// waits only for the capture of subgroup i (DataStates-LLM's lazy,
// copy-on-write capture). gate runs on the engine's goroutines, once per
// subgroup and Update, again for a subgroup whose state D2H is redone
// after a fault and for a speculated subgroup that was restored (its
// update runs twice), and must not call the engine; nil removes it. It
// may be called at any time, also while a speculative update runs (that
// update keeps the gate it read). Subgroup i's state is wherever StateOf
// says: a CPU update of it in place in a slot calls the gate too, and a
// speculative update into a free slot (nothing is captured there) does
// not. Download, DownloadAsync and Replan write host state without it:
// their caller waits for the capture first.
func (e *Engine) Hold(gate func(i int)) {
	if gate == nil {
		e.gate.Store(nil)
		return
	}
	e.gate.Store(&gate)
}

// waitGate calls Hold's gate for subgroup i, if any.
func (e *Engine) waitGate(i int) {
	if g := e.gate.Load(); g != nil {
		(*g)(i)
	}
}

// Stats runs the global checks on the gradients: whether every element is
// finite and the sum of squares of the unscaled gradients, adam's
// GradStats over all subgroups flat, whatever the plan and wherever each
// gradient is: on the device one pass over them all (Device.GradStats);
// with host-held subgroups each adam.MinChunk block's partial sum where its
// gradient is (Device.GradPartials, the CPU workers' Pool.GradPartials, a
// block that lies in both places gathered on the host, and the sums
// HeldPartials took on the device where it took them), the partials added
// in block order, which is the same sum bit for bit. The gradients and the
// state do not change; it forgets HeldPartials' sums and allocates
// nothing.
//
// Errors: ErrBroken; the device's.
func (e *Engine) Stats(unscale float32) (finite bool, sumSquares float64, err error) {
	if e.broken {
		return false, 0, ErrBroken
	}
	if e.heldN == 0 {
		return e.dev.GradStats(e.s[sKernel], e.o.GradDType, e.Grad(), unscale)
	}
	return e.heldStats(unscale)
}

// Update runs the update phase with the scalars c (adam.Hyper.Coeffs: the
// step, the unscale and clip factors) over every subgroup as the plan
// places it, and returns when every copy is done. It executes the schedule
// core's steps: this goroutine issues the GPU lane's state H2D copies and
// kernels, three others the state D2H copies, the CPU lane's gradient D2H
// copies and its updates and copy H2D copies, each waiting as the core
// says; the device streams the GPU subgroups through two staging slots;
// only events order the work. It allocates nothing.
//
// Errors: *FaultError when enqueueing failed (the step was completed
// subgroup by subgroup: the state is fully advanced); ErrBroken when
// work failed on the device or the completion failed (the state may be
// mixed: restore from a checkpoint).
func (e *Engine) Update(c *adam.Coeffs) error { return e.update(c, nil) }

// UpdatePer is Update with each subgroup's own scalars: cs[i] for subgroup
// i (parameter groups with their own lr and weight_decay, as
// torch.optim's param_groups; the step, unscale and clip factors the
// same). cs is read while the phase runs; it allocates nothing.
//
// Errors: those of Update; len(cs) other than the subgroup count.
func (e *Engine) UpdatePer(cs []adam.Coeffs) error {
	if len(cs) != len(e.sizes) {
		return fmt.Errorf("scheduler: UpdatePer with %d coefficients for %d subgroups", len(cs), len(e.sizes))
	}
	return e.update(nil, cs)
}

// coeffs returns subgroup i's scalars in the running phase.
func (e *Engine) coeffs(i int) *adam.Coeffs {
	if e.cs != nil {
		return &e.cs[i]
	}
	return e.c
}

func (e *Engine) update(c *adam.Coeffs, cs []adam.Coeffs) error {
	if err := e.beginPhase(c, cs); err != nil {
		return err
	}
	return e.endPhase()
}

// StartUpdatePer is UpdatePer's first half: it settles the speculation,
// starts the phase's lanes and returns, the GPU lane not yet issued;
// FinishUpdate is the second half, which issues the GPU lane, waits for
// every copy and returns UpdatePer's error. Between the two, WaitReady and
// Ready may be called from any goroutine and FinishUpdate from any one
// goroutine; nothing else of the engine. A trainer runs FinishUpdate on a goroutine
// of its own and its next forward meanwhile, each block after WaitReady of
// its subgroups (issue 31: the next forward over the update's tail).
//
// Errors: those of UpdatePer before the phase began (nothing was done,
// and FinishUpdate must not be called).
func (e *Engine) StartUpdatePer(cs []adam.Coeffs) error {
	if len(cs) != len(e.sizes) {
		return fmt.Errorf("scheduler: StartUpdatePer with %d coefficients for %d subgroups", len(cs), len(e.sizes))
	}
	return e.beginPhase(nil, cs)
}

// FinishUpdate is the second half of the update phase StartUpdatePer
// began: see there.
//
// Errors: those of Update; no phase begun.
func (e *Engine) FinishUpdate() error {
	if !e.inPhase {
		return errors.New("scheduler: FinishUpdate without StartUpdatePer")
	}
	return e.endPhase()
}

// WaitReady returns once subgroup i's update in the phase under way (or
// the last one) has been issued to where its new 16-bit working copy and
// its part of the mirror are written, and makes s wait for them on the
// device: after a GPU subgroup's kernel and a CPU subgroup's copy H2D, the
// work enqueued on s from now on waits for their end event; a host-held
// subgroup's CPU update has returned (s waits for nothing: the caller
// copies its HostWorking after this). With no phase under way it returns
// at once (the last phase drained every stream). It may be called from any
// goroutine while the phase runs (as Ready may), and waits only
// on the host for the lane that issues the subgroup's step. s may be nil
// (a host wait only, for a host-held subgroup).
//
// Errors: i out of range; the phase stopped before it issued subgroup i's
// step (a fault: FinishUpdate reports it); the device's.
func (e *Engine) WaitReady(s Stream, i int) error {
	if i < 0 || i >= len(e.sizes) {
		return fmt.Errorf("scheduler: WaitReady of subgroup %d of %d", i, len(e.sizes))
	}
	e.progMu.Lock()
	on := e.phaseOn
	e.progMu.Unlock()
	if !on {
		e.acquire(handEnd)
		return nil
	}
	k := e.core.readyStep(i)
	st := &e.core.steps[k]
	ok := e.issuedYet(st)
	e.acquire(k)
	if !ok || e.abort.Load() {
		// (a fault is recorded before the lanes stop: a step issued
		// after it, or one whose mirror copy failed, is not complete)
		return fmt.Errorf("scheduler: WaitReady: the update phase faulted before subgroup %d's %s was complete", i, opNames[st.op])
	}
	if st.queue == qCPU || s == nil {
		return nil
	}
	return e.dev.Wait(s, e.endEv[k])
}

// Ready reports, without waiting, whether WaitReady(s, i) would return at
// once on the host: no phase is under way, or the lane has issued
// subgroup i's step (a host-held subgroup's CPU update has returned; a
// device step still needs WaitReady's stream wait before a read). Like
// WaitReady it may be called from any goroutine while the phase runs.
// It panics when i is out of range.
func (e *Engine) Ready(i int) bool {
	st := &e.core.steps[e.core.readyStep(i)]
	e.progMu.Lock()
	defer e.progMu.Unlock()
	return !e.phaseOn || e.issued[st.issuer] > st.seq
}

// beginPhase is the update phase's first half: the checks, the settling of
// the speculation, the phase's events, and the lanes but the GPU's
// started.
func (e *Engine) beginPhase(c *adam.Coeffs, cs []adam.Coeffs) error {
	if e.broken {
		return ErrBroken
	}
	if !e.running {
		return ErrEngineClosed
	}
	if e.inPhase {
		return errors.New("scheduler: an update phase is under way (FinishUpdate first)")
	}
	if err := e.dropHeldParts(); err != nil { // a phase without Stats: the next gradients' are not these
		return err
	}
	e.c, e.cs = c, cs
	for i := range e.sizes {
		if x := e.coeffs(i); x.AMSGrad != (e.nArr == 4) {
			return fmt.Errorf("scheduler: Update with amsgrad %v on an engine built with AMSGrad %v", x.AMSGrad, e.nArr == 4)
		}
		if cs == nil {
			break
		}
	}
	// What Prefetch issued is done (enqueued), and what EndSpeculation
	// kept (updated): the issuers skip it.
	e.settleSpec()
	if e.broken {
		return ErrBroken // an undo's copy back to the device failed: its working copy is neither
	}
	e.t0 = time.Now() // after the settling: its restores are before the phase
	copy(e.done, e.pre)
	copy(e.preLast, e.pre)
	if e.leftLast != nil { // Options.Speculate's: what this phase's Speculate left to it
		clear(e.leftLast)
		if e.specMarked {
			copy(e.leftLast, e.specLeave)
		}
		e.specMarked = false
	}
	e.first = nil
	e.abort.Store(false)
	e.deviceFault.Store(false)
	e.progMu.Lock()
	e.issued = [numIssuers]int32{}
	e.ended = [numIssuers]bool{}
	e.progMu.Unlock()
	// base on the kernel stream, where Prefetch issues nothing (the copy
	// lanes may still be busy with what it issued), after the last drain
	// of every stream (done: a no-op on a GPU; on the simulated device's
	// clocks, the phase starts after the last one ended).
	for k := range e.s {
		if k != sKernel {
			if err := e.dev.Wait(e.s[sKernel], e.tail[k]); err != nil {
				return err // nothing was done (a prefetch stays pending: DropPrefetch or the next Update)
			}
		}
	}
	if e.specGPUOn() {
		// and after the GPU speculation's last drain (done, as above)
		for _, ev := range e.specTail {
			if err := e.dev.Wait(e.s[sKernel], ev); err != nil {
				return err // nothing was done (a prefetch stays pending)
			}
		}
	}
	if err := e.dev.Record(e.base, e.s[sKernel]); err != nil {
		return err // nothing was done (a prefetch stays pending)
	}
	// Every stream starts the phase after base (a no-op on a GPU, where
	// the last phase drained them all): the phase's times are all from
	// base (Trace, Measure), on the simulated device's clocks too.
	for k, s := range e.s {
		if k == sKernel {
			continue
		}
		if err := e.dev.Wait(s, e.base); err != nil {
			return err // nothing was done (a prefetch stays pending)
		}
	}
	// From here the phase takes what Prefetch issued (its copies are
	// waited for by the steps after them and by the drain) and the kept
	// speculative updates: endPhase ends it.
	e.takeSpec()
	e.inPhase = true
	e.progMu.Lock()
	e.phaseOn = true
	e.progMu.Unlock()
	e.publish(handPhase)
	for l := issDrain; l < numIssuers; l++ {
		e.start[l] <- struct{}{}
	}
	return nil
}

// endPhase is the update phase's second half: the GPU lane issued on this
// goroutine, the other issuers waited for, every stream drained, a fault
// completed.
func (e *Engine) endPhase() error {
	defer func() {
		clear(e.pre)
		e.preOn = false
		e.endSpec()
		e.inPhase = false
		e.publish(handEnd)
		e.progMu.Lock()
		e.phaseOn = false
		e.progMu.Unlock()
		e.progress.Broadcast()
	}()
	e.issue(issGPU)
	for range numIssuers - 1 {
		<-e.fin
	}
	// Drain: every stream's work.
	for k, s := range e.s {
		if err := firstErr(e.dev.Record(e.tail[k], s), e.dev.Sync(e.tail[k])); err != nil {
			e.broken = true
			return fmt.Errorf("%w: %v", ErrBroken, err)
		}
	}
	e.wall = time.Since(e.t0)
	e.updated = true
	if e.first == nil {
		return nil
	}
	if e.deviceFault.Load() {
		e.broken = true
		return fmt.Errorf("%w: %v", ErrBroken, e.first)
	}
	return e.complete()
}
