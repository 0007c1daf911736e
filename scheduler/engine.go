package scheduler

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

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
}

// ErrBroken is returned by an Engine whose state is no longer known to be
// consistent: a device fault surfaced while work was in flight (a CUDA
// fault poisons the context), or a fault came back while finishing a step
// after an earlier one. Restore from a checkpoint.
var ErrBroken = errors.New("scheduler: the optimizer state is inconsistent after a device fault; restore from a checkpoint")

// maxElems bounds the elements of an engine (offload's bound too).
const maxElems = 1 << 40

// ErrEngineClosed is Update's error after Close.
var ErrEngineClosed = errors.New("scheduler: the engine is closed")

// FaultError is Update's error when enqueueing a copy or a launch failed.
// The step was then finished subgroup by subgroup, each from where it
// stood, so the state is fully advanced (Recovered); had that failed too,
// Update returns ErrBroken instead.
type FaultError struct {
	Subgroup int    // the subgroup whose operation failed
	Op       string // "state H2D", "AdamW", "state D2H", "upcast", "grad D2H", "copy H2D"
	Err      error
}

func (e *FaultError) Error() string {
	return fmt.Sprintf("scheduler: %s of subgroup %d failed (the step was then completed subgroup by subgroup): %v", e.Op, e.Subgroup, e.Err)
}

func (e *FaultError) Unwrap() error { return e.Err }

// Operations of a subgroup, by index: a GPU subgroup runs opH2D, opKernel,
// opD2H; a resident one opKernel; a CPU one opUpcast (with the GPU upcast),
// opGradD2H, opCPU, opCopyH2D.
const (
	opH2D = iota
	opKernel
	opD2H
	opUpcast
	opGradD2H
	opCPU
	opCopyH2D
	numOps
)

var opNames = [numOps]string{"state H2D", "AdamW", "state D2H", "upcast", "grad D2H", "CPU AdamW", "copy H2D"}

// Engine runs the update phase of one rank over Options.Plan: the CPU
// workers on the CPU subgroups while the device streams the GPU subgroups'
// state through staging slots and updates the resident ones (Deep
// Optimizer States, section 4; DESIGN.md, update phase). It owns the
// master state in pinned host memory, the gradients and the 16-bit working
// copy in device memory, the resident state, two device staging slots and
// two host staging slots per lane. Its methods must not be called
// concurrently.
type Engine struct {
	o     Options
	dev   Device
	pool  *adam.Pool
	own   bool // the pool is ours
	plan  *Plan
	off   []int64 // first element of each subgroup
	total int64
	maxN  int64
	nArr  int // state arrays: 3, or 4 with amsgrad
	gb    int64

	host       [4]Host       // p, m, v, vmax in pinned host memory
	state      adam.State    // views of host
	grad       Mem           // device gradients
	work       Mem           // device working copy
	res        [4]Mem        // resident state
	resOff     []int64       // element offset of each resident subgroup in res
	stage      [4]Mem        // device staging: 2 slots of maxN per array
	scr        Mem           // device fp32 scratch for the upcast: 2 slots
	gst        Host          // host gradient staging: 2 slots
	cst        Host          // host copy staging: 2 slots
	upcast     bool          // CPU subgroups' 16-bit gradients widen on the device
	cpuGD      adam.DType    // the gradient dtype the CPU workers read
	s          [4]Stream     // sH2D (the H2D lane), sKernel, sD2H (the D2H lane), sUpcast
	laneMu     [4]sync.Mutex // per stream: a copy with its events (laneCopy)
	ev         [][numOps][2]Event
	base       Event
	xfer       Host // pinned staging for SetGrad and GetWorking
	tail       [4]Event
	dlEv       Event       // DownloadAsync's
	gate       func(i int) // Hold's
	allocs     []any       // freed by Close
	planAllocs []any       // freed by Replan and Close

	// Per Update.
	c           *adam.Coeffs
	done        []uint8 // bit per op done (enqueued, or run on the CPU)
	slot        []int   // staging slot of each GPU or CPU subgroup
	after       []Event // a GPU subgroup's state H2D waits for this (done) event
	cpuT        [][2]time.Duration
	t0          time.Time
	abort       atomic.Bool
	deviceFault atomic.Bool // a wait failed: the device itself faulted
	firstMu     chan struct{}
	first       *FaultError
	msgs        chan int
	tokens      chan struct{}
	startF      chan struct{} // one per Update to the feeder
	startW      chan struct{} // and to the worker
	startD      chan struct{} // and to the drainer
	dq          chan int      // GPU subgroups to the drainer
	dsig        chan struct{} // the drainer's D2H enqueued, one per GPU subgroup
	chunkEv     [4][2]Event   // per lane stream (sH2D, sD2H): the events of the last two chunks
	chunkK      [4]int        // per lane stream: chunks enqueued so far
	fin         chan struct{}
	broken      bool
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
	if o.AMSGrad {
		e.nArr = 4
	}
	e.gb = elemBytes(o.GradDType)
	e.off = make([]int64, len(o.Sizes))
	for i, n := range o.Sizes {
		if n <= 0 {
			return nil, fmt.Errorf("scheduler: Options.Sizes[%d] = %d: want > 0", i, n)
		}
		if int64(n) > maxElems-e.total {
			return nil, fmt.Errorf("scheduler: Options.Sizes: more than %d elements in all", int64(maxElems))
		}
		e.off[i] = e.total
		e.total += int64(n)
		e.maxN = max(e.maxN, int64(n))
	}
	if e.pool == nil {
		e.pool, e.own = adam.NewPool(0), true
	}
	if err := e.allocBase(); err != nil {
		e.Close()
		return nil, err
	}
	if err := e.allocPlan(o.Plan); err != nil {
		e.Close()
		return nil, err
	}
	n := len(o.Sizes)
	e.done = make([]uint8, n)
	e.slot = make([]int, n)
	e.after = make([]Event, n)
	e.cpuT = make([][2]time.Duration, n)
	e.firstMu = make(chan struct{}, 1)
	e.msgs = make(chan int, 2)
	e.tokens = make(chan struct{}, 2)
	e.startF = make(chan struct{})
	e.startW = make(chan struct{})
	e.startD = make(chan struct{})
	e.dq = make(chan int, n+1)
	e.dsig = make(chan struct{}, n)
	e.fin = make(chan struct{}, 3)
	go e.feeder()
	go e.worker()
	go e.drainer()
	return e, nil
}

func (e *Engine) devAlloc(list *[]any, bytes int64) (Mem, error) {
	m, err := e.dev.Alloc(bytes)
	if err != nil {
		return nil, fmt.Errorf("scheduler: %d bytes of device memory: %w", bytes, err)
	}
	*list = append(*list, m)
	return m, nil
}

func (e *Engine) hostAlloc(list *[]any, bytes int64) (Host, error) {
	h, err := e.dev.AllocHost(bytes)
	if err != nil {
		return nil, fmt.Errorf("scheduler: %d bytes of pinned host memory: %w", bytes, err)
	}
	*list = append(*list, h)
	return h, nil
}

// allocBase allocates what does not depend on the plan: the host state,
// the device gradients and working copy, streams and events.
func (e *Engine) allocBase() error {
	var err error
	views := []*[]float32{&e.state.Param, &e.state.ExpAvg, &e.state.ExpAvgSq, &e.state.MaxExpAvgSq}
	for a := range e.nArr {
		if e.host[a], err = e.hostAlloc(&e.allocs, 4*e.total); err != nil {
			return err
		}
		*views[a] = unsafe.Slice((*float32)(unsafe.Pointer(&e.host[a].Bytes()[0])), e.total)
	}
	if e.grad, err = e.devAlloc(&e.allocs, e.gb*e.total); err != nil {
		return err
	}
	if e.work, err = e.devAlloc(&e.allocs, 2*e.total); err != nil {
		return err
	}
	for i := range e.s {
		if e.s[i], err = e.dev.NewStream(); err != nil {
			return err
		}
		e.allocs = append(e.allocs, e.s[i])
	}
	event := func() (Event, error) {
		ev, err := e.dev.NewEvent()
		if err == nil {
			e.allocs = append(e.allocs, ev)
		}
		return ev, err
	}
	if e.xfer, err = e.hostAlloc(&e.allocs, 4*min(e.maxN, xferElems)); err != nil {
		return err
	}
	if e.base, err = event(); err != nil {
		return err
	}
	for d := range e.chunkEv {
		for j := range e.chunkEv[d] {
			if e.chunkEv[d][j], err = event(); err != nil {
				return err
			}
		}
	}
	for i := range e.tail {
		if e.tail[i], err = event(); err != nil {
			return err
		}
	}
	if e.dlEv, err = event(); err != nil {
		return err
	}
	e.ev = make([][numOps][2]Event, len(e.o.Sizes))
	for i := range e.ev {
		for op := range numOps {
			if op == opCPU {
				continue
			}
			for j := range 2 {
				if e.ev[i][op][j], err = event(); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// allocPlan places p: the resident state, the device staging slots, the
// upcast scratch, the host staging slots.
func (e *Engine) allocPlan(p *Plan) error {
	e.plan = p
	e.upcast = p.Schedule.UpcastOnGPU && e.o.GradDType != adam.F32
	e.cpuGD = e.o.GradDType
	if e.upcast {
		e.cpuGD = adam.F32
	}
	e.resOff = make([]int64, len(e.o.Sizes))
	var nRes int64
	for i, n := range e.o.Sizes {
		if p.Roles[i] == Resident {
			e.resOff[i] = nRes
			nRes += int64(n)
		}
	}
	e.res, e.stage, e.scr, e.gst, e.cst = [4]Mem{}, [4]Mem{}, nil, nil, nil
	var err error
	l := &e.planAllocs
	if nRes > 0 {
		for a := range e.nArr {
			if e.res[a], err = e.devAlloc(l, 4*nRes); err != nil {
				return err
			}
		}
	}
	if p.Schedule.GPU > 0 {
		for a := range e.nArr {
			if e.stage[a], err = e.devAlloc(l, 2*4*e.maxN); err != nil {
				return err
			}
		}
	}
	if len(p.CPUOrder) > 0 {
		if e.upcast {
			if e.scr, err = e.devAlloc(l, 2*4*e.maxN); err != nil {
				return err
			}
		}
		if e.gst, err = e.hostAlloc(l, 2*elemBytes(e.cpuGD)*e.maxN); err != nil {
			return err
		}
		if e.cst, err = e.hostAlloc(l, 2*2*e.maxN); err != nil {
			return err
		}
	}
	return nil
}

// Replan moves the engine to plan p (NewPlan over the same subgroups):
// the resident state comes back to the host, the memory of the old plan
// is freed, p's is allocated and its resident state moves to the device.
//
// Errors: a plan for other subgroups, a failed copy or allocation (the
// engine is then broken: Close it).
func (e *Engine) Replan(p *Plan) error {
	if e.broken {
		return ErrBroken
	}
	if p == nil || len(p.Roles) != len(e.o.Sizes) {
		return fmt.Errorf("scheduler: Replan: the plan must place the %d subgroups", len(e.o.Sizes))
	}
	if err := e.Download(); err != nil {
		return err
	}
	e.freePlan()
	if err := e.allocPlan(p); err != nil {
		e.broken = true
		return err
	}
	if err := e.upload(false); err != nil {
		// The new resident state is not all on the device.
		e.broken = true
		return fmt.Errorf("%w: Replan: %v", ErrBroken, err)
	}
	return nil
}

// Broken reports whether the engine returns ErrBroken: its state is no
// longer known to be consistent.
func (e *Engine) Broken() bool { return e.broken }

func (e *Engine) freePlan() {
	for i := len(e.planAllocs) - 1; i >= 0; i-- {
		_ = e.dev.Free(e.planAllocs[i])
	}
	e.planAllocs = nil
}

func elemBytes(d adam.DType) int64 {
	if d == adam.F32 {
		return 4
	}
	return 2
}

// ops returns subgroup i's operations in order.
func (e *Engine) ops(i int) []int {
	switch e.plan.Roles[i] {
	case OnGPU:
		return []int{opH2D, opKernel, opD2H}
	case Resident:
		return []int{opKernel}
	}
	if e.upcast {
		return []int{opUpcast, opGradD2H, opCPU, opCopyH2D}
	}
	return []int{opGradD2H, opCPU, opCopyH2D}
}

// Close stops the engine's goroutines and frees its memory. Views from
// HostState must not be used afterwards.
func (e *Engine) Close() {
	if e.startF != nil {
		close(e.startF)
		close(e.startW)
		close(e.startD)
		<-e.fin
		<-e.fin
		<-e.fin
		e.startF = nil
	}
	e.freePlan()
	for i := len(e.allocs) - 1; i >= 0; i-- {
		_ = e.dev.Free(e.allocs[i])
	}
	e.allocs = nil
	if e.own && e.pool != nil {
		e.pool.Close()
		e.pool = nil
	}
}

// HostState returns the master state in pinned host memory, all subgroups
// flat in order (total elements per array). For resident subgroups it is
// current only after Download; after writing it, call Load.
func (e *Engine) HostState() adam.State { return e.state }

// Grad returns the device gradients, all subgroups flat in order, of
// Options.GradDType: the trainer's backward writes them.
func (e *Engine) Grad() Vec { return Vec{Mem: e.grad, N: e.total} }

// Working returns the device working copy (Options.WorkingDType), all
// subgroups flat in order: forward and backward read it.
func (e *Engine) Working() Vec { return Vec{Mem: e.work, N: e.total} }

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

// Load makes the device match the host state: it moves the resident
// subgroups' state H2D and writes every subgroup's working copy, rounded
// from the master weights. It waits for the copies.
//
// Errors: a failed copy or allocation.
func (e *Engine) Load() error {
	if e.broken {
		return ErrBroken
	}
	return e.upload(true)
}

func (e *Engine) upload(working bool) error {
	s := e.s[sH2D]
	for i := range e.o.Sizes {
		if e.plan.Roles[i] != Resident {
			continue
		}
		for a := range e.nArr {
			h, off, b := e.hostVec(a, i)
			if err := e.dev.H2D(s, e.res[a], 4*e.resOff[i], h, off, b); err != nil {
				return err
			}
		}
	}
	if err := firstErr(e.dev.Record(e.tail[sH2D], s), e.dev.Sync(e.tail[sH2D])); err != nil {
		return err
	}
	if !working {
		return nil
	}
	// The working copy, all subgroups flat, rounded on the host into the
	// staging buffer piece by piece (the CPU's rounding is the kernels').
	return e.pieces(2*e.total, e.work, true, func(st []byte, o int64) {
		u := unsafe.Slice((*uint16)(unsafe.Pointer(&st[0])), len(st)/2)
		adam.Round16(e.o.WorkingDType, u, e.state.Param[o/2:o/2+int64(len(u))])
	})
}

// Download moves the resident subgroups' state D2H into the host state and
// waits: afterwards HostState is current for every subgroup (for a
// checkpoint or a comparison).
//
// Errors: a failed copy (the device's copy stays the one that counts).
func (e *Engine) Download() error {
	wait, err := e.DownloadAsync()
	if err != nil {
		return err
	}
	return wait()
}

// xferElems bounds the pinned staging of SetGrad and GetWorking in
// elements.
const xferElems = 16 << 20

// SetGrad copies a host gradient of every subgroup, flat (total elements,
// Options.GradDType), into the device gradients and waits: what a GPU
// trainer's backward leaves there, for a trainer that computes on the
// host.
//
// Errors: a gradient of another dtype or length, a failed copy.
func (e *Engine) SetGrad(g adam.Grad) error {
	if e.broken {
		return ErrBroken
	}
	if g.DType != e.o.GradDType || int64(g.Len()) != e.total {
		return fmt.Errorf("scheduler: SetGrad: a %v gradient of %d elements, want %v of %d", g.DType, g.Len(), e.o.GradDType, e.total)
	}
	var src []byte
	if g.DType == adam.F32 {
		src = unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(g.F32))), 4*len(g.F32))
	} else {
		src = unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(g.U16))), 2*len(g.U16))
	}
	return e.through(src, e.grad, true)
}

// GetWorking copies the device working copy, flat (total elements), into
// dst and waits: for a trainer whose forward runs on the host.
//
// Errors: a dst of another length, a failed copy.
func (e *Engine) GetWorking(dst []uint16) error {
	if e.broken {
		return ErrBroken
	}
	if int64(len(dst)) != e.total {
		return fmt.Errorf("scheduler: GetWorking: %d elements, want %d", len(dst), e.total)
	}
	return e.through(unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(dst))), 2*len(dst)), e.work, false)
}

// through copies host bytes b to device memory m (up) or m to b, through
// the pinned staging buffer, piece by piece, waiting for each.
func (e *Engine) through(b []byte, m Mem, up bool) error {
	return e.pieces(int64(len(b)), m, up, func(st []byte, o int64) {
		if up {
			copy(st, b[o:])
		} else {
			copy(b[o:], st)
		}
	})
}

// pieces moves size bytes between the pinned staging buffer and device
// memory m from offset 0, a staging buffer's worth at a time, waiting for
// each: up, host fills the piece at byte o before it moves H2D; down, it
// reads it after the D2H.
func (e *Engine) pieces(size int64, m Mem, up bool, host func(st []byte, o int64)) error {
	st := e.xfer.Bytes()
	l := sH2D
	if !up {
		l = sD2H
	}
	s := e.s[l]
	for o := int64(0); o < size; o += int64(len(st)) {
		n := min(int64(len(st)), size-o)
		if up {
			host(st[:n], o)
		}
		var err error
		e.laneMu[l].Lock()
		if up {
			err = e.dev.H2D(s, m, o, e.xfer, 0, n)
		} else {
			err = e.dev.D2H(s, e.xfer, 0, m, o, n)
		}
		err = firstErr(err, e.dev.Record(e.tail[l], s))
		e.laneMu[l].Unlock()
		if err = firstErr(err, e.dev.Sync(e.tail[l])); err != nil {
			return err
		}
		if !up {
			host(st[:n], o)
		}
	}
	return nil
}

// DownloadAsync enqueues the resident subgroups' state D2H into the host
// state and returns at once, with the function that waits for it: a lazy
// checkpoint's capture (checkpoint.Snapshot.Prepare) calls it while
// training goes on. The next Update's kernels wait for the copies on the
// device (a stream wait, no host wait); nothing else may write the
// resident subgroups' host state before wait returned.
//
// Errors: ErrBroken, a copy that cannot be enqueued (the device's copy of
// the resident state stays the one that counts: the host's was stale).
func (e *Engine) DownloadAsync() (wait func() error, err error) {
	if e.broken {
		return nil, ErrBroken
	}
	s := e.s[sD2H]
	e.laneMu[sD2H].Lock()
	defer e.laneMu[sD2H].Unlock()
	for i := range e.o.Sizes {
		if e.plan.Roles[i] != Resident {
			continue
		}
		for a := range e.nArr {
			h, off, b := e.hostVec(a, i)
			if err := e.dev.D2H(s, h, off, e.res[a], 4*e.resOff[i], b); err != nil {
				return nil, err
			}
		}
	}
	if err := e.dev.Record(e.dlEv, s); err != nil {
		return nil, err
	}
	// The resident state may change only once it has moved: the next
	// kernels wait for the copies on the device, never on the host.
	if err := e.dev.Wait(e.s[sKernel], e.dlEv); err != nil {
		return nil, err
	}
	ev := e.dlEv
	return func() error { return e.dev.Sync(ev) }, nil
}

// Hold makes every later Update call gate(i) and wait for it to return
// before its first write to subgroup i's host state: before a CPU
// subgroup's update (in place, in the host state) and before a GPU
// subgroup's state D2H. Resident subgroups' host state is not written by
// Update. A lazy checkpoint's copy-on-write uses it (offload.SaveAsync
// passes checkpoint.Handle.WaitGroup), so that the next update of
// subgroup i waits only for the capture of subgroup i (DataStates-LLM's
// lazy, copy-on-write capture). gate runs on the engine's goroutines,
// once per subgroup and Update (again for a subgroup whose state D2H is
// redone after a fault), and must not call the engine; nil removes it.
// Call it between Updates. Download, DownloadAsync and Replan write host
// state without it: their caller waits for the capture first.
func (e *Engine) Hold(gate func(i int)) { e.gate = gate }

// Stats runs the global checks on the device gradients: whether every
// element is finite and the sum of squares of the unscaled gradients
// (Device.GradStats over all subgroups at once, so the result does not
// depend on the plan). Nothing changes.
func (e *Engine) Stats(unscale float32) (finite bool, sumSquares float64, err error) {
	if e.broken {
		return false, 0, ErrBroken
	}
	return e.dev.GradStats(e.s[sKernel], e.o.GradDType, e.Grad(), unscale)
}

// Update runs the update phase with the scalars c (adam.Hyper.Coeffs: the
// step, the unscale and clip factors) over every subgroup as the plan
// places it, and returns when every copy is done. The CPU lane (two
// goroutines: one moves gradients D2H into two host slots, one runs the
// workers and moves the copies H2D) runs while the device streams the GPU
// subgroups through two staging slots on three streams; only events order
// the work. It allocates nothing.
//
// Errors: *FaultError when enqueueing failed (the step was completed
// subgroup by subgroup: the state is fully advanced); ErrBroken when
// work failed on the device or the completion failed (the state may be
// mixed: restore from a checkpoint).
func (e *Engine) Update(c *adam.Coeffs) error {
	if e.broken {
		return ErrBroken
	}
	if e.startF == nil {
		return ErrEngineClosed
	}
	if c.AMSGrad != (e.nArr == 4) {
		return fmt.Errorf("scheduler: Update with amsgrad %v on an engine built with AMSGrad %v", c.AMSGrad, e.nArr == 4)
	}
	e.c = c
	clear(e.done)
	clear(e.after)
	e.first = nil
	e.abort.Store(false)
	e.deviceFault.Store(false)
	e.t0 = time.Now()
	if err := e.dev.Record(e.base, e.s[sH2D]); err != nil {
		return err // nothing was done
	}
	// Start the CPU lane and the GPU lane's D2H goroutine, then issue the
	// GPU lane's H2D copies and kernels here.
	e.startF <- struct{}{}
	e.startW <- struct{}{}
	e.startD <- struct{}{}
	last := [2]int{-1, -1} // the GPU subgroup that used each staging slot last
	streamed, sent, drained := 0, 0, 0
	for _, i := range e.plan.GPUOrder {
		if e.abort.Load() {
			break
		}
		if e.plan.Roles[i] == Resident {
			if !e.run(i, opKernel, 0) {
				break
			}
			continue
		}
		slot := streamed % 2
		streamed++
		prev := last[slot]
		last[slot] = i
		e.slot[i] = slot
		// The slot's previous state must have moved D2H: wait here, so
		// that an H2D copy is enqueued only when it can run (copies in
		// one direction share a copy engine, in the order enqueued: one
		// waiting on an event would hold up the CPU lane's copies).
		if prev >= 0 {
			for drained < streamed-2 {
				<-e.dsig
				drained++
			}
			ev := e.ev[prev][opD2H][1]
			if e.done[prev]&(1<<opD2H) == 0 || e.fail(i, opH2D, e.wait(ev)) {
				break
			}
			// The copy waits on its stream too, which says so to the
			// device (a no-op on CUDA once the event is done; the
			// simulated device's clock needs it).
			e.after[i] = ev
		}
		if !e.run(i, opH2D, slot) || !e.run(i, opKernel, slot) {
			break
		}
		e.dq <- i
		sent++
	}
	e.dq <- -1
	for drained < sent {
		<-e.dsig
		drained++
	}
	<-e.fin
	<-e.fin
	<-e.fin
	// Drain: every stream's work.
	for k, s := range e.s {
		if err := firstErr(e.dev.Record(e.tail[k], s), e.dev.Sync(e.tail[k])); err != nil {
			e.broken = true
			return fmt.Errorf("%w: %v", ErrBroken, err)
		}
	}
	if e.first == nil {
		return nil
	}
	if e.deviceFault.Load() {
		e.broken = true
		return fmt.Errorf("%w: %v", ErrBroken, e.first)
	}
	// Complete every subgroup from where it stood, one at a time.
	for i := range e.o.Sizes {
		for _, op := range e.ops(i) {
			if e.done[i]&(1<<op) != 0 {
				continue
			}
			if op == opH2D || (op == opGradD2H && e.done[i]&(1<<opUpcast) == 0) || op == opUpcast {
				e.slot[i], e.after[i] = 0, nil // every slot is free now
			}
			if !e.run(i, op, e.slot[i]) {
				e.broken = true
				return fmt.Errorf("%w (after %v)", ErrBroken, e.first)
			}
			if op != opCPU {
				if err := e.dev.Sync(e.ev[i][op][1]); err != nil {
					e.broken = true
					return fmt.Errorf("%w: %v (after %v)", ErrBroken, err, e.first)
				}
			}
		}
	}
	return e.first
}

// wait blocks until ev is done. A failure there is a fault inside the
// device (a CUDA fault poisons the context): Update then reports
// ErrBroken instead of completing the step.
func (e *Engine) wait(ev Event) error {
	err := e.dev.Sync(ev)
	if err != nil {
		e.deviceFault.Store(true)
	}
	return err
}

// fail records err (when not nil) as the step's first fault, stops the
// lanes, and reports whether there was one.
func (e *Engine) fail(i, op int, err error) bool {
	if err == nil {
		return false
	}
	e.firstMu <- struct{}{}
	if e.first == nil {
		e.first = &FaultError{Subgroup: i, Op: opNames[op], Err: err}
	}
	<-e.firstMu
	e.abort.Store(true)
	return true
}

// run enqueues (or, for opCPU, runs) op of subgroup i with staging slot
// slot, between its two events, waiting for the op before it on another
// stream; it marks the op done and reports success.
// Streams of an Engine.
const (
	sH2D    = iota // the H2D lane: every H2D copy, in the order enqueued
	sKernel        // the fused AdamW kernels
	sD2H           // the D2H lane: every D2H copy
	sUpcast        // the casts of CPU subgroups' gradients
)

func (e *Engine) run(i, op, slot int) bool {
	if op == opCPU {
		return e.cpu(i, slot)
	}
	n := int64(e.o.Sizes[i])
	ev := &e.ev[i][op]
	grad := Vec{Mem: e.grad, Off: e.off[i], N: n}
	var err error
	switch op {
	case opH2D:
		err = e.stateCopy(sH2D, i, slot, e.after[i])
	case opD2H:
		if e.gate != nil {
			e.gate(i) // the state D2H writes subgroup i's host state
		}
		err = e.stateCopy(sD2H, i, slot, e.ev[i][opKernel][1])
	case opKernel:
		s := e.s[sKernel]
		st := e.resState(i)
		if e.plan.Roles[i] == OnGPU {
			st = e.slotState(slot, i)
			err = e.dev.Wait(s, e.ev[i][opH2D][1])
		}
		if err == nil {
			err = firstErr(e.dev.Record(ev[0], s), e.dev.AdamW(s, e.c, st, e.o.GradDType, grad, e.o.WorkingDType, Vec{Mem: e.work, Off: e.off[i], N: n}), e.dev.Record(ev[1], s))
		}
	case opUpcast:
		s := e.s[sUpcast]
		err = firstErr(e.dev.Record(ev[0], s), e.dev.Widen16(s, e.o.GradDType, Vec{Mem: e.scr, Off: int64(slot) * e.maxN, N: n}, grad), e.dev.Record(ev[1], s))
	case opGradD2H:
		gb := elemBytes(e.cpuGD)
		src, srcOff := e.grad, gb*e.off[i]
		var up Event
		if e.upcast {
			// The D2H lane holds only copies that can run: wait here.
			src, srcOff, up = e.scr, 4*int64(slot)*e.maxN, e.ev[i][opUpcast][1]
			err = e.wait(up)
		}
		if err == nil {
			err = e.laneCopy(sD2H, ev, up, func(s Stream) error { return e.dev.D2H(s, e.gst, gb*int64(slot)*e.maxN, src, srcOff, gb*n) })
		}
	case opCopyH2D:
		err = e.laneCopy(sH2D, ev, nil, func(s Stream) error { return e.dev.H2D(s, e.work, 2*e.off[i], e.cst, 2*int64(slot)*e.maxN, 2*n) })
	}
	if e.fail(i, op, err) {
		return false
	}
	e.done[i] |= 1 << op
	return true
}

// The two copy lanes: every H2D copy goes on stream e.s[sH2D], every D2H
// copy on e.s[sD2H], in the order enqueued. (On separate streams the
// H200's copy engines served a stream that always had work queued before
// another: a CPU subgroup's 16-bit copy waited 160 ms behind GPU
// subgroups' state, and the CPU workers stalled on it.) laneMu keeps a
// copy and its events together on the lane's stream.

// laneCopy enqueues one copy on lane stream l between ev's two events,
// after wait (an event already done: it tells the device) when not nil.
func (e *Engine) laneCopy(l int, ev *[2]Event, wait Event, copy func(s Stream) error) error {
	s := e.s[l]
	e.laneMu[l].Lock()
	defer e.laneMu[l].Unlock()
	if wait != nil {
		if err := e.dev.Wait(s, wait); err != nil {
			return err
		}
	}
	return firstErr(e.dev.Record(ev[0], s), copy(s), e.dev.Record(ev[1], s))
}

// CopyChunk is the size in bytes of the pieces a state copy is cut into
// (stateCopy).
const CopyChunk = 64 << 20

// stateCopy enqueues the state of GPU subgroup i between the host and
// staging slot slot on lane stream l (sH2D or sD2H), in CopyChunk pieces,
// each after the piece two before it on the lane is done: at most one
// piece waits in the lane, so a CPU subgroup's gradient or copy enqueued
// meanwhile waits for at most two (about 2.4 ms at 55 GB/s). wait, when
// not nil, is an event the copy waits for (already done: it tells the
// device).
func (e *Engine) stateCopy(l, i, slot int, wait Event) error {
	s := e.s[l]
	ev := &e.ev[i][opH2D]
	if l == sD2H {
		ev = &e.ev[i][opD2H]
	}
	dev := 4 * int64(slot) * e.maxN
	for a := 0; a < e.nArr; a++ {
		h, off, b := e.hostVec(a, i)
		for o := int64(0); o < b; o += CopyChunk {
			cev := e.chunkEv[l][e.chunkK[l]%2]
			if e.chunkK[l] >= 2 {
				if err := e.wait(cev); err != nil {
					return err
				}
			}
			first, last := a == 0 && o == 0, a == e.nArr-1 && o+CopyChunk >= b
			m := min(CopyChunk, b-o)
			if err := e.statePiece(l, s, ev, cev, first, last, wait, func() error {
				if l == sH2D {
					return e.dev.H2D(s, e.stage[a], dev+o, h, off+o, m)
				}
				return e.dev.D2H(s, h, off+o, e.stage[a], dev+o, m)
			}); err != nil {
				return err
			}
			e.chunkK[l]++
		}
	}
	return nil
}

// statePiece enqueues one piece under the lane's lock: after wait and ev's
// start when first, then the chunk's event, then ev's end when last.
func (e *Engine) statePiece(l int, s Stream, ev *[2]Event, cev Event, first, last bool, wait Event, copy func() error) error {
	e.laneMu[l].Lock()
	defer e.laneMu[l].Unlock()
	if first {
		if wait != nil {
			if err := e.dev.Wait(s, wait); err != nil {
				return err
			}
		}
		if err := e.dev.Record(ev[0], s); err != nil {
			return err
		}
	}
	if err := firstErr(copy(), e.dev.Record(cev, s)); err != nil {
		return err
	}
	if last {
		return e.dev.Record(ev[1], s)
	}
	return nil
}

// cpu updates CPU subgroup i on the host from gradient slot slot, writing
// its copy into copy slot slot.
func (e *Engine) cpu(i, slot int) bool {
	if e.fail(i, opCPU, e.wait(e.ev[i][opGradD2H][1])) {
		return false
	}
	n := int64(e.o.Sizes[i])
	lo := e.off[i]
	var g adam.Grad
	gs := e.gst.Bytes()
	if e.cpuGD == adam.F32 {
		g = adam.GradF32(unsafe.Slice((*float32)(unsafe.Pointer(&gs[4*int64(slot)*e.maxN])), n))
	} else {
		g = adam.Grad16(e.cpuGD, unsafe.Slice((*uint16)(unsafe.Pointer(&gs[2*int64(slot)*e.maxN])), n))
	}
	cs := e.cst.Bytes()
	out := adam.Copy16{DType: e.o.WorkingDType, Data: unsafe.Slice((*uint16)(unsafe.Pointer(&cs[2*int64(slot)*e.maxN])), n)}
	if e.gate != nil {
		e.gate(i) // the update writes subgroup i's host state in place
	}
	e.cpuT[i][0] = time.Since(e.t0)
	e.pool.Step(e.c, e.state.Slice(int(lo), int(lo+n)), g, out)
	e.cpuT[i][1] = time.Since(e.t0)
	e.done[i] |= 1 << opCPU
	return true
}

// feeder is the CPU lane's first goroutine: per Update, it enqueues the
// CPU subgroups' gradient D2H (after the upcast) into the two host
// gradient slots, each once the worker has read the slot's previous
// gradient, and hands each subgroup to the worker (-1: skip it).
func (e *Engine) feeder() {
	defer func() { e.fin <- struct{}{} }()
	for range e.startF {
		for ci, i := range e.plan.CPUOrder {
			if ci >= 2 {
				<-e.tokens
			}
			slot := ci % 2
			e.slot[i] = slot
			ok := !e.abort.Load()
			if ok && e.upcast {
				ok = e.run(i, opUpcast, slot)
			}
			ok = ok && e.run(i, opGradD2H, slot)
			if ok {
				e.msgs <- i
			} else {
				e.msgs <- -1
			}
		}
		// The worker's last tokens.
		for range min(2, len(e.plan.CPUOrder)) {
			<-e.tokens
		}
		e.fin <- struct{}{}
	}
}

// drainer is the GPU lane's D2H goroutine: per Update, for each GPU
// subgroup handed over (-1 ends the lane) it waits until the kernel is
// done, enqueues the state's D2H (so that a D2H copy too is enqueued only
// when it can run) and signals it.
func (e *Engine) drainer() {
	defer func() { e.fin <- struct{}{} }()
	for range e.startD {
		for i := <-e.dq; i >= 0; i = <-e.dq {
			if !e.abort.Load() && !e.fail(i, opD2H, e.wait(e.ev[i][opKernel][1])) {
				e.run(i, opD2H, e.slot[i])
			}
			e.dsig <- struct{}{}
		}
		e.fin <- struct{}{}
	}
}

// worker is the CPU lane's second goroutine: per Update, for each CPU
// subgroup it waits for its gradient, runs the workers (writing the copy
// into the copy slot once the slot's previous copy has moved H2D), hands
// the gradient slot back, and enqueues the copy's H2D.
func (e *Engine) worker() {
	defer func() { e.fin <- struct{}{} }()
	for range e.startW {
		for ci := range e.plan.CPUOrder {
			i := <-e.msgs
			ok := i >= 0 && !e.abort.Load()
			if ok && ci >= 2 {
				// The copy slot's previous copy must have moved.
				prev := e.plan.CPUOrder[ci-2]
				ok = e.done[prev]&(1<<opCopyH2D) != 0 && !e.fail(i, opCPU, e.wait(e.ev[prev][opCopyH2D][1]))
			}
			ok = ok && e.cpu(i, e.slot[i])
			e.tokens <- struct{}{}
			if ok {
				e.run(i, opCopyH2D, e.slot[i])
			}
		}
		e.fin <- struct{}{}
	}
}

// Op is one traced operation of the last Update.
type Op struct {
	Resource string        // "h2d", "d2h", "gpu" or "cpu" (perfmodel's resources)
	What     string        // "state H2D", "AdamW", "state D2H", "upcast", "grad D2H", "CPU AdamW", "copy H2D"
	Subgroup int           // its index
	Start    time.Duration // from the start of the update phase
	End      time.Duration
	Bytes    int64 // moved over PCIe (copies) or params updated (kernels, CPU)
}

// Trace returns the operations of the last Update with their times: the
// device's by its events (from an event recorded at the start), the CPU's
// by the host clock from the same start, sorted by start. Errors: the
// device's (Elapsed).
func (e *Engine) Trace() ([]Op, error) {
	var ops []Op
	for i := range e.o.Sizes {
		n := int64(e.o.Sizes[i])
		for _, op := range e.ops(i) {
			if e.done[i]&(1<<op) == 0 {
				continue
			}
			o := Op{What: opNames[op], Subgroup: i}
			switch op {
			case opH2D, opCopyH2D:
				o.Resource = "h2d"
			case opD2H, opGradD2H:
				o.Resource = "d2h"
			case opKernel, opUpcast:
				o.Resource = "gpu"
			case opCPU:
				o.Resource = "cpu"
			}
			switch op {
			case opH2D, opD2H:
				o.Bytes = 4 * int64(e.nArr) * n
			case opGradD2H:
				o.Bytes = elemBytes(e.cpuGD) * n
			case opCopyH2D:
				o.Bytes = 2 * n
			default:
				o.Bytes = n
			}
			if op == opCPU {
				o.Start, o.End = e.cpuT[i][0], e.cpuT[i][1]
			} else {
				a, err := e.dev.Elapsed(e.base, e.ev[i][op][0])
				if err != nil {
					return nil, err
				}
				b, err := e.dev.Elapsed(e.base, e.ev[i][op][1])
				if err != nil {
					return nil, err
				}
				o.Start, o.End = a, b
			}
			ops = append(ops, o)
		}
	}
	slices.SortStableFunc(ops, func(a, b Op) int { return int(a.Start - b.Start) })
	return ops, nil
}
