package main

/*
#include <stdint.h>
#include <stdlib.h>

// dos_reduce_fn combines this rank's gradient statistics with the other
// ranks' in place (an all-reduce with sum): *sum_squares holds this rank's
// sum of squares of its unscaled gradients, NaN when one is not finite,
// and receives the whole model's. It returns 0, or nonzero when it failed.
// NULL: the optimizer holds the whole model (offload.StepArgs.Reduce).
typedef int32_t (*dos_reduce_fn)(double *sum_squares);

static int32_t dos_call_reduce(dos_reduce_fn f, double *x) { return f(x); }
*/
import "C"

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"unsafe"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/offload"
	"github.com/deepstates/dos/perfmodel"
)

// spec is dos_adamw_new's JSON: torch.optim.AdamW's arguments and param
// groups, and the offload options DeepSpeed names so.
type spec struct {
	Params []struct {
		Name  string `json:"name"`
		Shape []int  `json:"shape"`
		Group int    `json:"group"`
	} `json:"params"`
	Groups []struct {
		LR          float64 `json:"lr"`
		WeightDecay float64 `json:"weight_decay"`
	} `json:"groups"`
	Betas        [2]float64 `json:"betas"`
	Eps          float64    `json:"eps"`
	AMSGrad      bool       `json:"amsgrad"`
	Maximize     bool       `json:"maximize"`
	MaxGradNorm  float64    `json:"max_grad_norm"`
	SubGroupSize int        `json:"sub_group_size"`
	Threads      int        `json:"threads"`
	// DType is the parameters' and gradients' dtype: "float32" (the
	// working copy is the fp32 master itself), "bfloat16" or "float16"
	// (a 16-bit working copy of fp32 master weights, 16-bit gradients).
	DType string `json:"dtype"`

	// The update phase's placement (DeepSpeed's offload_optimizer options
	// and dos's). Device "" updates on the CPU workers only, the state in
	// Go memory; "cuda" (GPU 0), "cuda:N" (GPU N) or "sim" (the simulated device, for
	// tests) runs the interleaved engine with the state in pinned host
	// memory (offload.Options.Device; 16-bit dtypes only).
	Device string `json:"device"`
	// GPUBudget is the device memory in bytes the update phase may hold:
	// resident state and staging (offload.Options.GPUBudget). 0: none, so
	// every subgroup is updated on the CPU.
	GPUBudget int64 `json:"gpu_budget"`
	// Profile is a dos calibrate profile of this machine
	// (perfmodel.Load); "" with Schedule "auto" measures one briefly at
	// construction (offload.Options.Calibrate).
	Profile string `json:"profile"`
	// Schedule is "auto" (or ""): the performance model's choice within
	// GPUBudget; "cpu": every subgroup on the CPU (ZeRO-Offload's
	// placement); "static": as many subgroups resident as GPUBudget holds,
	// the rest on the CPU (perfmodel.StaticSplit, ZeRO-Offload++'s and
	// TwinFlow's); "C,G,R": forced counts of CPU, streamed and resident
	// subgroups (offload.ParseSchedule), within GPUBudget unless it is 0.
	// Case and spaces do not matter.
	Schedule string `json:"schedule"`
	// PinMemory is DeepSpeed's pin_memory: with a Device the state is
	// always in pinned host memory (the engine's copies need it), so
	// false is refused there; without one nothing is copied and it has no
	// effect. nil: the default (true).
	PinMemory *bool `json:"pin_memory"`
	// DeviceParams says the parameters and gradients are in the device's
	// memory (CUDA tensors): the caller moves them with
	// dos_adamw_device_ptrs and dos_adamw_step_device. float32 ones then
	// read and write the fp32 master weights the engine keeps on the
	// device for every parameter (offload.Options.DeviceMasters) and write
	// fp32 gradients; the engine's 16-bit working copy goes unused.
	DeviceParams bool `json:"device_params"`
}

// placement fills opts's device options from s: the device (opened; its
// release is returned, never nil), the budget, the profile and the
// schedule over the subgroups that params make.
func (s *spec) placement(opts *offload.Options, params []offload.Param) (release func(), err error) {
	release = func() {}
	if s.Device == "" {
		switch {
		case s.Schedule != "" && s.Schedule != "auto" && s.Schedule != "cpu":
			return release, fmt.Errorf("dos: schedule %q needs a device (device=\"cuda\")", s.Schedule)
		case s.GPUBudget != 0 || s.Profile != "":
			return release, errors.New("dos: gpu_budget and profile need a device (device=\"cuda\")")
		}
		return release, nil
	}
	if s.PinMemory != nil && !*s.PinMemory {
		return release, errors.New("dos: pin_memory=False with a device: dos keeps the optimizer state in pinned host memory, which its copies need")
	}
	if opts.WorkingDType == 0 {
		if !s.DeviceParams {
			return release, fmt.Errorf("dos: device %q with float32 parameters on the CPU: the update phase writes a 16-bit working copy on the device; use bfloat16 or float16 parameters, or put the model on the GPU", s.Device)
		}
		// fp32 parameters on the device: they are the fp32 master
		// weights' device copy; the 16-bit working copy is the engine's
		// own.
		opts.WorkingDType = adam.BF16
		for _, p := range params {
			opts.DeviceMasters = append(opts.DeviceMasters, p.Name)
		}
	}
	if s.GPUBudget < 0 {
		return release, fmt.Errorf("dos: gpu_budget %d: want >= 0 bytes", s.GPUBudget)
	}
	dev, rel, err := offload.OpenDevice(s.Device)
	if err != nil {
		return release, err
	}
	opts.Device, opts.GPUBudget = dev, s.GPUBudget
	if s.Profile != "" {
		if opts.Profile, err = offload.LoadProfile(s.Profile, dev); err != nil {
			return rel, err
		}
	}
	sizes := offload.CutSizes(params, *opts) // the subgroups offload.New will cut
	total := int64(0)
	for _, n := range sizes {
		total += n
	}
	n := len(sizes)
	sched := strings.ToLower(strings.ReplaceAll(s.Schedule, " ", ""))
	switch sched {
	case "", "auto":
		opts.Calibrate = opts.Profile == nil
	case "cpu", "static": // offload.New resolves them over its subgroups
		opts.Placement = sched
	default:
		st, err := offload.ParseSchedule(sched)
		if err != nil {
			return rel, fmt.Errorf("dos: schedule %q: want \"auto\", \"cpu\", \"static\" or three subgroup counts CPU,GPU,RESIDENT such as \"2,2,1\"", s.Schedule)
		}
		if got := st.CPU + st.GPU + st.Resident; got != n {
			return rel, fmt.Errorf("dos: schedule %q: the counts add up to %d, but the parameters make %d subgroups (sub_group_size %d)", s.Schedule, got, n, opts.SubgroupSize)
		}
		w := perfmodel.Workload{Params: total, SubgroupSize: int64(opts.SubgroupSize), Sizes: sizes, AMSGrad: opts.Hyper.AMSGrad}
		if need := w.GPUMemory(st); s.GPUBudget > 0 && need > s.GPUBudget {
			return rel, fmt.Errorf("dos: schedule %q needs %d bytes of device memory for its resident state and staging; gpu_budget is %d (0 sets no limit for forced counts)", s.Schedule, need, s.GPUBudget)
		}
		opts.Schedule = &st
	}
	return rel, nil
}

// dtypes maps spec.DType to the working copy's and the gradients' dtype.
var dtypes = map[string][2]adam.DType{"": {0, adam.F32}, "float32": {0, adam.F32}, "bfloat16": {adam.BF16, adam.BF16}, "float16": {adam.F16, adam.F16}}

// savedBy is a lazy save and the optimizer it saves.
type savedBy struct {
	h  *checkpoint.Handle
	o  *offload.Optimizer
	oh int64  // o's handle
	sv *saver // the engine that ran h
}

// handles holds the live optimizers and saves by handle.
var handles struct {
	sync.Mutex
	next  int64
	m     map[int64]*offload.Optimizer
	eng   map[int64]*saver  // an optimizer's lazy checkpoint engine, by the optimizer's handle
	saves map[int64]savedBy // saves in flight or done, by their own handle
	// release closes an optimizer's device (offload.OpenDevice's), by the
	// optimizer's handle, after its Close.
	release map[int64]func()
	// closeErr is a close's error (its last save's failure), kept by the
	// closed handle until a second dos_adamw_close of it returns it once:
	// the binding closes again when an interrupt kept it from reading the
	// first's error.
	closeErr map[int64]error
}

// saver is an optimizer's checkpoint engine on one root.
type saver struct {
	root string
	// st is root's directory as the engine opened it: its identity
	// (os.SameFile), which another optimizer's save compares (ownerOf).
	st   os.FileInfo
	keep int   // checkpoint.EngineOptions.Keep
	ring int64 // checkpoint.EngineOptions.RingBytes (0: the default)
	e    *checkpoint.Engine
	last *checkpoint.Handle // the engine's latest save, nil before the first
}

// newerCommitted refuses saving step into dir (sv's root) when dir's latest
// committed checkpoint is at step or above it (a run resumed from an older
// checkpoint of the root, or a save of the same step again): the root's
// commit would make that checkpoint uncommitted, and a later save of its step
// would replace it; a checkpoint is never lost or replaced. sv's save in
// flight is waited for first (its commit counts; the engine's next save
// would wait for it anyway).
func newerCommitted(sv *saver, dir string, step int64) error {
	if sv.last != nil {
		_, _ = sv.last.Wait() // its error is the next save's (checkpoint.Engine.Save)
	}
	info, err := checkpoint.Inspect(checkpoint.OS, dir)
	if err != nil {
		return nil // a root that cannot be read: the save reports it (SaveHandle.wait)
	}
	latest := int64(-1)
	for _, s := range info.Steps {
		if s.Committed && s.Step > latest {
			latest = s.Step
		}
	}
	switch {
	case latest == step:
		return fmt.Errorf("dos: save: step %d is saved into %s already (its latest committed checkpoint, by this optimizer "+
			"or another run at the same step): a checkpoint is never replaced; step first, or save into another root", step, dir)
	case latest > step:
		return fmt.Errorf("dos: save: the checkpoint root %s holds a committed checkpoint at step %d, and this optimizer is at step %d: "+
			"a save there would retire or replace it (a checkpoint is never lost); save into another root, or move %s's "+
			"checkpoints of step %d and above out of it and run `dos ckpt recover %s` (which points latest at the newest "+
			"left) first", dir, latest, step, dir, step, dir)
	}
	return nil
}

func lookup(h C.int64_t) (*offload.Optimizer, error) {
	handles.Lock()
	defer handles.Unlock()
	o := handles.m[int64(h)]
	if o == nil {
		return nil, fmt.Errorf("dos: no optimizer with handle %d (closed?)", int64(h))
	}
	return o, nil
}

// newHandle registers and returns the next handle; hold handles.
func newHandle() int64 {
	if handles.m == nil {
		handles.m, handles.eng, handles.saves = map[int64]*offload.Optimizer{}, map[int64]*saver{}, map[int64]savedBy{}
		handles.release, handles.closeErr = map[int64]func(){}, map[int64]error{}
	}
	handles.next++
	return handles.next
}

// run calls f and reports its error, or a panic turned into one, through
// errOut (malloc'd, for dos_free); it returns whether f succeeded. Every
// export that can fail goes through it, so no Go panic crosses into C.
func run(errOut **C.char, f func() error) bool {
	err := func() (err error) {
		defer func() {
			if r := recover(); r != nil {
				err = fmt.Errorf("dos: internal error: %v\n%s", r, debug.Stack())
			}
		}()
		return f()
	}()
	if err != nil && errOut != nil {
		*errOut = C.CString(err.Error())
	}
	return err == nil
}

// status is the int32 convention: 0 done, -1 failed (the message in errOut).
func status(ok bool) C.int32_t {
	if ok {
		return 0
	}
	return -1
}

//export dos_version
func dos_version() *C.char { return cVersion }

// dos_lock_fds writes into fds (room for n) the file descriptors of the
// checkpoint roots' locks this process holds (checkpoint.HeldLockFDs) and
// returns how many there are (more than n: the first n written). The
// Python package closes them in a fork()ed child, which would otherwise
// keep a root locked after this process released it.
//
//export dos_lock_fds
func dos_lock_fds(fds *C.int32_t, n C.int32_t) C.int32_t {
	return putFDs(checkpoint.HeldLockFDs(), fds, n)
}

// dos_fork_prepare is dos_lock_fds, and holds off every open and close of
// a root's lock file in this process until dos_fork_done
// (checkpoint.PrepareFork): the Python package calls it in its before-fork
// hook and dos_fork_done in the parent after fork(), so that the child
// closes exactly the lock descriptors held at the fork. The child calls
// neither (Go's runtime does not survive fork()).
//
//export dos_fork_prepare
func dos_fork_prepare(fds *C.int32_t, n C.int32_t) C.int32_t {
	return putFDs(checkpoint.PrepareFork(), fds, n)
}

// dos_fork_done ends dos_fork_prepare's hold (checkpoint.ForkDone).
//
//export dos_fork_done
func dos_fork_done() { checkpoint.ForkDone() }

// putFDs writes held into fds (room for n) and returns len(held).
func putFDs(held []int, fds *C.int32_t, n C.int32_t) C.int32_t {
	if fds != nil && n > 0 {
		out := unsafe.Slice((*int32)(unsafe.Pointer(fds)), int(n))
		for k, fd := range held[:min(len(held), int(n))] {
			out[k] = int32(fd)
		}
	}
	return C.int32_t(len(held))
}

var cVersion = C.CString("dos capi 1")

//export dos_free
func dos_free(p *C.char) { C.free(unsafe.Pointer(p)) }

//export dos_adamw_new
func dos_adamw_new(specJSON *C.char, errOut **C.char) C.int64_t {
	var id int64
	ok := run(errOut, func() error {
		var s spec
		if err := json.Unmarshal([]byte(C.GoString(specJSON)), &s); err != nil {
			return fmt.Errorf("dos: the optimizer's spec: %w", err)
		}
		if len(s.Groups) == 0 {
			return fmt.Errorf("dos: no parameter group")
		}
		dt, ok := dtypes[s.DType]
		if !ok {
			return fmt.Errorf("dos: dtype %q: want float32, bfloat16 or float16", s.DType)
		}
		params := make([]offload.Param, len(s.Params))
		for i, p := range s.Params {
			params[i] = offload.Param{Name: p.Name, Shape: p.Shape, Group: p.Group}
		}
		opts := offload.Options{
			Hyper: adam.Hyper{Mode: adam.AdamW, LR: s.Groups[0].LR, Betas: s.Betas, Eps: s.Eps, WeightDecay: s.Groups[0].WeightDecay,
				AMSGrad: s.AMSGrad, Maximize: s.Maximize},
			SubgroupSize: s.SubGroupSize, WorkingDType: dt[0], GradDType: dt[1], MaxGradNorm: s.MaxGradNorm, Threads: s.Threads,
		}
		for _, g := range s.Groups {
			opts.Groups = append(opts.Groups, offload.Group{LR: g.LR, WeightDecay: g.WeightDecay})
		}
		opts.EnsureDefaults()
		release, err := s.placement(&opts, params)
		if err != nil {
			release()
			return err
		}
		o, err := offload.New(params, opts)
		if err != nil {
			release()
			return err
		}
		handles.Lock()
		defer handles.Unlock()
		id = newHandle()
		handles.m[id] = o
		handles.release[id] = release
		return nil
	})
	if !ok {
		return 0
	}
	return C.int64_t(id)
}

// setLRs sets each parameter group's learning rate from lrs[0:ngroups].
func setLRs(o *offload.Optimizer, lrs *C.double, ngroups C.int32_t) error {
	if n := len(o.Options().Groups); n != int(ngroups) {
		return fmt.Errorf("dos: %d learning rates for %d parameter groups", int(ngroups), n)
	}
	for g, lr := range unsafe.Slice((*float64)(unsafe.Pointer(lrs)), int(ngroups)) {
		if err := o.SetGroupLR(g, lr); err != nil {
			return err
		}
	}
	return nil
}

//export dos_adamw_device_ptrs
func dos_adamw_device_ptrs(h C.int64_t, i C.int32_t, grad, working *C.uint64_t, errOut **C.char) C.int32_t {
	return status(run(errOut, func() error {
		o, err := lookup(h)
		if err != nil {
			return err
		}
		if int(i) < 0 || int(i) >= len(o.Params()) {
			return fmt.Errorf("dos: parameter %d of %d", int(i), len(o.Params()))
		}
		g, err := o.DeviceGrad(int(i))
		if err != nil {
			return err
		}
		weights := o.DeviceWorking // 16-bit parameters: the working copy
		if g.DType == adam.F32 {
			weights = o.DeviceMaster // fp32 ones: the master weights' device copy
		}
		w, err := weights(int(i))
		if err != nil {
			return err
		}
		if g.Ptr == 0 || w.Ptr == 0 {
			return fmt.Errorf("dos: the optimizer's device %s has no device addresses (device=\"cuda\" has)", o.Options().Device.Name())
		}
		*grad, *working = C.uint64_t(g.Ptr), C.uint64_t(w.Ptr)
		return nil
	}))
}

//export dos_adamw_step_device
func dos_adamw_step_device(h C.int64_t, lrs *C.double, ngroups C.int32_t, lossScale C.double, reduce C.dos_reduce_fn, errOut **C.char) C.int32_t {
	return step(h, lrs, ngroups, errOut, func(o *offload.Optimizer) (offload.StepArgs, error) {
		// Master weights set since the last step (state_set kind 0) go to
		// the device first; a no-op otherwise.
		return offload.StepArgs{LossScale: float64(lossScale), GradOnDevice: true, Reduce: reduceArg(reduce)}, o.SyncDevice()
	}, nil)
}

//export dos_adamw_step
func dos_adamw_step(h C.int64_t, nparams C.int32_t, params *unsafe.Pointer, paramLens *C.int64_t, grads *unsafe.Pointer, gradLens *C.int64_t,
	lrs *C.double, ngroups C.int32_t, lossScale C.double, reduce C.dos_reduce_fn, errOut **C.char) C.int32_t {
	var pp []unsafe.Pointer
	return step(h, lrs, ngroups, errOut, func(o *offload.Optimizer) (offload.StepArgs, error) {
		ps := o.Params()
		if int(nparams) != len(ps) {
			return offload.StepArgs{}, fmt.Errorf("dos: %d parameters' buffers for an optimizer of %d parameters", int(nparams), len(ps))
		}
		if len(ps) == 0 {
			return offload.StepArgs{LossScale: float64(lossScale), Reduce: reduceArg(reduce)}, nil
		}
		if params == nil || grads == nil || paramLens == nil || gradLens == nil {
			return offload.StepArgs{}, errors.New("dos: a NULL array of data or gradient pointers or of their element counts")
		}
		gp := unsafe.Slice(grads, len(ps))
		pp = unsafe.Slice(params, len(ps))
		pn := unsafe.Slice((*int64)(unsafe.Pointer(paramLens)), len(ps))
		gn := unsafe.Slice((*int64)(unsafe.Pointer(gradLens)), len(ps))
		// Every buffer is checked before any is read: a buffer of another
		// size (the caller's tensor replaced meanwhile) is refused, never
		// read or written past its end.
		for i, p := range ps {
			if gp[i] == nil || pp[i] == nil {
				return offload.StepArgs{}, fmt.Errorf("dos: parameter %s: a nil gradient or data pointer", p.Name)
			}
			if pn[i] != int64(p.Len) || gn[i] != int64(p.Len) {
				return offload.StepArgs{}, fmt.Errorf("dos: parameter %s: a data buffer of %d elements and a gradient of %d; the parameter has %d", p.Name, pn[i], gn[i], p.Len)
			}
		}
		for i, p := range ps {
			if g := o.Grad(i); g.DType == adam.F32 {
				parCopy(g.Float32(), unsafe.Slice((*float32)(gp[i]), p.Len))
			} else {
				parCopy(g.Uint16(), unsafe.Slice((*uint16)(gp[i]), p.Len))
			}
		}
		return offload.StepArgs{LossScale: float64(lossScale), Reduce: reduceArg(reduce)}, nil
	}, func(o *offload.Optimizer) {
		for i, p := range o.Params() {
			if w := o.Working(i); w.DType == adam.F32 {
				parCopy(unsafe.Slice((*float32)(pp[i]), p.Len), w.Float32())
			} else {
				parCopy(unsafe.Slice((*uint16)(pp[i]), p.Len), w.Uint16())
			}
		}
	})
}

// parCopy copies src into dst (of src's length at least), a large one in
// chunks on up to GOMAXPROCS goroutines: the step's copies between the
// binding's buffers and dos's are bound by one core's memory bandwidth.
func parCopy[T float32 | uint16](dst, src []T) {
	const chunk = 1 << 20 // elements
	w := min(runtime.GOMAXPROCS(0), len(src)/chunk)
	if w <= 1 {
		copy(dst, src)
		return
	}
	per := (len(src) + w - 1) / w
	var wg sync.WaitGroup
	for lo := 0; lo < len(src); lo += per {
		hi := min(lo+per, len(src))
		wg.Add(1)
		go func() {
			defer wg.Done()
			copy(dst[lo:hi], src[lo:hi])
		}()
	}
	wg.Wait()
}

// reduceArg is the StepArgs.Reduce that calls the caller's f (nil for a
// NULL f): the binding's all-reduce over the ranks that each hold a shard
// (dos.torch under FSDP2), so that every rank clips by the whole model's
// gradient norm and skips a non-finite step alike.
func reduceArg(f C.dos_reduce_fn) func(float64) (float64, error) {
	if f == nil {
		return nil
	}
	return func(ss float64) (float64, error) {
		x := C.double(ss)
		if r := C.dos_call_reduce(f, &x); r != 0 {
			return 0, fmt.Errorf("dos: the all-reduce of the gradient statistics across ranks failed (the reduce callback returned %d)", int32(r))
		}
		return float64(x), nil
	}
}

// step is one optimizer step of handle h: the groups' learning rates from
// lrs, then prepare (the gradients in, and the StepArgs), the Step, and
// after a step that was taken, taken (the new weights out). It returns 1
// when the step was taken, 0 when it was skipped (non-finite gradients),
// -1 on error.
func step(h C.int64_t, lrs *C.double, ngroups C.int32_t, errOut **C.char,
	prepare func(*offload.Optimizer) (offload.StepArgs, error), taken func(*offload.Optimizer)) C.int32_t {
	out := C.int32_t(0)
	ok := run(errOut, func() error {
		o, err := lookup(h)
		if err != nil {
			return err
		}
		if err := setLRs(o, lrs, ngroups); err != nil {
			return err
		}
		args, err := prepare(o)
		if err != nil {
			return err
		}
		res, err := o.Step(args)
		if err != nil || res.Skipped {
			return err
		}
		if taken != nil {
			taken(o)
		}
		out = 1
		return nil
	})
	if !ok {
		return -1
	}
	return out
}

//export dos_adamw_close
func dos_adamw_close(h C.int64_t, errOut **C.char) C.int32_t {
	return status(run(errOut, func() error {
		handles.Lock()
		o, sv, rel := handles.m[int64(h)], handles.eng[int64(h)], handles.release[int64(h)]
		delete(handles.m, int64(h))
		delete(handles.eng, int64(h))
		delete(handles.release, int64(h))
		if o == nil { // closed already: the first close's error, once, if it was not read
			err := handles.closeErr[int64(h)]
			delete(handles.closeErr, int64(h))
			handles.Unlock()
			return err
		}
		handles.Unlock()
		var errs []error
		if sv != nil {
			errs = append(errs, sv.e.Close()) // waits for the save in flight
		}
		errs = append(errs, o.Close())
		if rel != nil {
			rel() // the device, after the optimizer that used it
		}
		err := errors.Join(errs...)
		if err != nil {
			handles.Lock()
			handles.closeErr[int64(h)] = err
			handles.Unlock()
		}
		return err
	}))
}

// stateKinds maps the C API's state kind (0 master, 1 exp_avg, 2
// exp_avg_sq, 3 max_exp_avg_sq) to offload's.
var stateKinds = []offload.StateKind{offload.MasterWeights, offload.ExpAvg, offload.ExpAvgSq, offload.MaxExpAvgSq}

// state reads (offload.Optimizer.ReadState) or writes (WriteState) one
// parameter's state of one kind through a C buffer of n floats.
func state(h C.int64_t, i, kind C.int32_t, data *C.float, n C.int64_t, errOut **C.char, write bool) C.int32_t {
	return status(run(errOut, func() error {
		o, err := lookup(h)
		if err != nil {
			return err
		}
		if int(kind) < 0 || int(kind) >= len(stateKinds) {
			return fmt.Errorf("dos: state kind %d: want 0 (master) to 3 (max_exp_avg_sq)", int(kind))
		}
		if n < 0 || (n > 0 && data == nil) {
			return fmt.Errorf("dos: a state buffer of %d elements at %p", int64(n), data)
		}
		buf := unsafe.Slice((*float32)(unsafe.Pointer(data)), int(n))
		if write {
			return o.WriteState(int(i), stateKinds[kind], buf)
		}
		return o.ReadState(int(i), stateKinds[kind], buf)
	}))
}

//export dos_adamw_state_get
func dos_adamw_state_get(h C.int64_t, i, kind C.int32_t, data *C.float, n C.int64_t, errOut **C.char) C.int32_t {
	return state(h, i, kind, data, n, errOut, false)
}

//export dos_adamw_state_set
func dos_adamw_state_set(h C.int64_t, i, kind C.int32_t, data *C.float, n C.int64_t, errOut **C.char) C.int32_t {
	return state(h, i, kind, data, n, errOut, true)
}

//export dos_adamw_get_step
func dos_adamw_get_step(h C.int64_t, errOut **C.char) C.int64_t {
	var step int64
	if !run(errOut, func() error {
		o, err := lookup(h)
		if err == nil {
			step = o.StepCount()
		}
		return err
	}) {
		return -1
	}
	return C.int64_t(step)
}

//export dos_adamw_set_step
func dos_adamw_set_step(h C.int64_t, step C.int64_t, errOut **C.char) C.int32_t {
	return status(run(errOut, func() error {
		o, err := lookup(h)
		if err != nil {
			return err
		}
		return o.SetStepCount(int64(step))
	}))
}

//export dos_adamw_save
func dos_adamw_save(h C.int64_t, root *C.char, objects *C.char, keep C.int32_t, ring C.int64_t, errOut **C.char) C.int64_t {
	var id int64
	if !run(errOut, func() error {
		o, err := lookup(h)
		if err != nil {
			return err
		}
		var objs map[string]any
		if objects != nil {
			if err := json.Unmarshal([]byte(C.GoString(objects)), &objs); err != nil {
				return fmt.Errorf("dos: save: the objects: %w", err)
			}
		}
		dir := C.GoString(root)
		if keep < 0 {
			return fmt.Errorf("dos: save: keep %d: want >= 0 (0 keeps every checkpoint)", int(keep))
		}
		if ring < 0 {
			return fmt.Errorf("dos: save: ring_bytes %d: want >= 0 (0: the default, 256 MiB)", int64(ring))
		}
		handles.Lock()
		sv := handles.eng[int64(h)]
		handles.Unlock()
		fresh := false // sv opened by this call: a refused save closes it, leaving dir unlocked
		if sv == nil || sv.root != dir || sv.keep != int(keep) || sv.ring != int64(ring) {
			// Refused before this optimizer's engine on its old root is
			// closed, and before an engine touches dir.
			if st, err := os.Stat(dir); err == nil {
				handles.Lock()
				other := ownerOf(st, int64(h))
				handles.Unlock()
				if other != 0 {
					return ownedByOther(dir, other)
				}
			}
			if sv != nil {
				handles.Lock()
				delete(handles.eng, int64(h))
				handles.Unlock()
				if err := sv.e.Close(); err != nil { // the last save's failure, which nothing reported yet
					return fmt.Errorf("dos: save: the previous save, into %s, failed (nothing is saved into %s now; save "+
						"again): %w", sv.root, dir, err)
				}
			}
			e, err := checkpoint.NewEngine(checkpoint.OS, dir, checkpoint.EngineOptions{Keep: int(keep), RingBytes: int64(ring)})
			if err != nil {
				return err
			}
			st, err := os.Stat(dir) // dir exists now
			if err != nil {
				_ = e.Close()
				return fmt.Errorf("dos: save: the checkpoint root %s: %w", dir, err)
			}
			sv = &saver{root: dir, st: st, keep: int(keep), ring: int64(ring), e: e}
			handles.Lock()
			if handles.m[int64(h)] != o { // closed meanwhile (dos_adamw_close): claim nothing
				handles.Unlock()
				_ = e.Close()
				return fmt.Errorf("dos: save: the optimizer (handle %d) was closed during the save", int64(h))
			}
			if other := ownerOf(st, int64(h)); other != 0 { // claimed meanwhile
				handles.Unlock()
				_ = e.Close()
				return ownedByOther(dir, other)
			}
			handles.eng[int64(h)] = sv
			handles.Unlock()
			fresh = true
		}
		step := o.StepCount()
		if err := newerCommitted(sv, dir, step); err != nil {
			if fresh { // nothing saved into dir by this engine: let go of the root's lock
				handles.Lock()
				if handles.eng[int64(h)] == sv {
					delete(handles.eng, int64(h))
				}
				handles.Unlock()
				_ = sv.e.Close()
			}
			return err
		}
		hd, err := o.SaveAsync(sv.e, step, objs)
		if err != nil {
			return err
		}
		sv.last = hd
		handles.Lock()
		defer handles.Unlock()
		id = newHandle()
		handles.saves[id] = savedBy{hd, o, int64(h), sv}
		return nil
	}) {
		return 0
	}
	return C.int64_t(id)
}

// ownerOf returns the handle of the optimizer other than h whose engine
// writes the checkpoint root whose directory is st (os.SameFile: a link or
// another spelling of it is the same root), 0 for none; hold handles. The
// root's lock (checkpoint.Lock) refuses a writer of another process; within
// this process it is shared, so this refuses a second optimizer, whose
// retention (keep) would retire the first one's checkpoints.
func ownerOf(st os.FileInfo, h int64) int64 {
	for oh, sv := range handles.eng {
		if oh != h && os.SameFile(sv.st, st) {
			return oh
		}
	}
	return 0
}

// ownedByOther is the error of a save into root, which the optimizer of
// handle other writes.
func ownedByOther(root string, other int64) error {
	return fmt.Errorf("dos: save: the checkpoint root %s is written by another dos optimizer of this process "+
		"(a dos.torch.AdamW, handle %d): one optimizer per root, or one's retention would retire the other's "+
		"checkpoints and a load would mix them; save into another root, or close() that optimizer first", root, other)
}

//export dos_save_done
func dos_save_done(sh C.int64_t) C.int32_t {
	handles.Lock()
	hd := handles.saves[int64(sh)].h
	handles.Unlock()
	if hd == nil || hd.Done() {
		return 1
	}
	return 0
}

//export dos_save_wait
func dos_save_wait(sh C.int64_t, dirOut **C.char, errOut **C.char) C.int32_t {
	return status(run(errOut, func() error {
		handles.Lock()
		sb := handles.saves[int64(sh)]
		handles.Unlock()
		if sb.h == nil {
			return fmt.Errorf("dos: no save with handle %d", int64(sh))
		}
		dir, err := sb.h.Wait()
		if err != nil {
			// Reported here: the optimizer's next step does not report it
			// again (and is taken), and the next save starts a fresh
			// engine (this one would report it again too).
			sb.o.AcknowledgeSave(sb.h)
			handles.Lock()
			mine := handles.eng[sb.oh] == sb.sv // not a later save's engine
			if mine {
				delete(handles.eng, sb.oh)
			}
			handles.Unlock()
			if mine {
				_ = sb.sv.e.Close() // its error is the one returned here
			}
		} else if dirOut != nil {
			*dirOut = C.CString(dir)
		}
		return err
	}))
}

//export dos_save_free
func dos_save_free(sh C.int64_t) {
	handles.Lock()
	delete(handles.saves, int64(sh))
	handles.Unlock()
}

//export dos_adamw_load
func dos_adamw_load(h C.int64_t, path *C.char, objectsOut **C.char, errOut **C.char) C.int32_t {
	return status(run(errOut, func() error {
		o, err := lookup(h)
		if err != nil {
			return err
		}
		if err := sameFixedHyper(o, C.GoString(path)); err != nil {
			return err
		}
		if err := checkObjects(o, C.GoString(path)); err != nil {
			return err
		}
		_, objs, err := o.LoadCheckpoint(checkpoint.OS, C.GoString(path))
		if err != nil {
			return err
		}
		if objectsOut != nil {
			b, err := json.Marshal(objs)
			if err != nil {
				return err
			}
			*objectsOut = C.CString(string(b))
		}
		return nil
	}))
}

// sameFixedHyper refuses a checkpoint at path (a root or a step
// directory) whose hyperparameters other than lr differ from o's: the
// Python optimizer fixes betas, eps, weight_decay, amsgrad and maximize at
// construction and shows them in param_groups, so loading others would
// step with values it does not show (offload.Optimizer.LoadCheckpoint
// takes the checkpoint's). A checkpoint that cannot be read is left to
// LoadCheckpoint's errors.
func sameFixedHyper(o *offload.Optimizer, path string) error {
	dir, saved, savedGroups, err := offload.CheckpointHyper(checkpoint.OS, path)
	if err != nil {
		return nil
	}
	opts := o.Options()
	now := opts.Hyper
	decay := func(h adam.Hyper, groups []offload.Group) []float64 {
		if len(groups) == 0 {
			return []float64{h.WeightDecay}
		}
		d := make([]float64, len(groups))
		for i, g := range groups {
			d[i] = g.WeightDecay
		}
		return d
	}
	if n, m := max(len(savedGroups), 1), max(len(opts.Groups), 1); n != m {
		return fmt.Errorf("dos: %s was saved with %d parameter groups; this optimizer has %d: build it with the checkpoint's groups", dir, n, m)
	}
	a, b := decay(saved, savedGroups), decay(now, opts.Groups)
	if saved.Mode != now.Mode || saved.Betas != now.Betas || saved.Eps != now.Eps || saved.AMSGrad != now.AMSGrad ||
		saved.Maximize != now.Maximize || !slices.Equal(a, b) {
		return fmt.Errorf("dos: %s was saved with betas %v, eps %g, weight_decay %v, amsgrad %t, maximize %t; this optimizer has betas %v, eps %g, weight_decay %v, amsgrad %t, maximize %t: build it with the checkpoint's (dos fixes them at construction)",
			dir, saved.Betas, saved.Eps, a, saved.AMSGrad, saved.Maximize, now.Betas, now.Eps, b, now.AMSGrad, now.Maximize)
	}
	return nil
}

// maxStep is the largest optimizer step a checkpoint may hold for the
// binding: torch keeps the step as a float, which holds every whole
// number up to 2**53 exactly (dos.torch.MAX_STEP, load_state_dict's and
// opt.state's bound); a step counter near int64's end would overflow.
const maxStep = 1 << 53

// checkObjects refuses, before offload.Optimizer.LoadCheckpoint changes
// anything, a checkpoint at path (a root or a step directory) whose
// optimizer object holds a step above maxStep, or whose "torch" object
// (the binding's: the param groups' lr values) is not a JSON object
// with "lrs" a list of finite numbers >= 0, one per param group of o. A
// checkpoint that cannot be read is left to LoadCheckpoint's errors.
func checkObjects(o *offload.Optimizer, path string) error {
	dir, err := checkpoint.Resolve(checkpoint.OS, path)
	if err != nil {
		return nil
	}
	c, err := checkpoint.Open(checkpoint.OS, dir, 0)
	if err != nil {
		return nil
	}
	defer c.Close()
	if raw, ok := c.Manifest.Objects[offload.ObjectName]; ok {
		var obj struct {
			Step json.Number `json:"step"`
		}
		if json.Unmarshal(raw, &obj) == nil && obj.Step != "" {
			if n, err := obj.Step.Int64(); err != nil || n > maxStep {
				return fmt.Errorf("dos: %s: the optimizer's step %s is above %d (2**53, the largest step torch's float step count holds exactly); this checkpoint is not one dos.torch.AdamW can continue", dir, obj.Step, int64(maxStep))
			}
		}
	}
	raw, ok := c.Manifest.Objects["torch"]
	if !ok {
		return nil
	}
	var t map[string]json.RawMessage
	if err := json.Unmarshal(raw, &t); err != nil || t == nil {
		return fmt.Errorf("dos: %s: the \"torch\" object is %s, not dos.torch.AdamW's (an object with \"lrs\", the param groups' lr values): a foreign or edited checkpoint", dir, clip(raw))
	}
	lrsRaw, ok := t["lrs"]
	if !ok {
		return nil
	}
	var lrs []any
	groups := max(len(o.Options().Groups), 1)
	if err := json.Unmarshal(lrsRaw, &lrs); err != nil || len(lrs) != groups {
		return fmt.Errorf("dos: %s: the \"torch\" object's \"lrs\" is %s: want a list of %d lr values (one per param group of this optimizer)", dir, clip(lrsRaw), groups)
	}
	for i, v := range lrs {
		f, ok := v.(float64)
		if !ok || math.IsNaN(f) || math.IsInf(f, 0) || f < 0 {
			b, _ := json.Marshal(v)
			return fmt.Errorf("dos: %s: the \"torch\" object's \"lrs\"[%d] is %s: want a finite number >= 0 (param group %d's lr)", dir, i, clip(b), i)
		}
	}
	return nil
}

// clip is raw JSON for a message: at most 80 bytes of it.
func clip(raw json.RawMessage) string {
	if len(raw) > 80 {
		return string(raw[:77]) + "..."
	}
	return string(raw)
}

// placementInfo is dos_adamw_placement's JSON: where the update phase runs.
type placementInfo struct {
	Device    string `json:"device"`     // the device's name, "" on the CPU workers only
	GPUBudget int64  `json:"gpu_budget"` // bytes
	Subgroups int    `json:"subgroups"`
	CPU       int    `json:"cpu"`      // subgroups updated on the CPU workers
	GPU       int    `json:"gpu"`      // streamed through the GPU
	Resident  int    `json:"resident"` // resident on the GPU
	Upcast    bool   `json:"upcast_on_gpu"`
	// PredictedS is the performance model's predicted update phase in
	// seconds, 0 without a profile (offload.Optimizer.Plan).
	PredictedS float64 `json:"predicted_s"`
}

//export dos_adamw_placement
func dos_adamw_placement(h C.int64_t, out **C.char, errOut **C.char) C.int32_t {
	return status(run(errOut, func() error {
		o, err := lookup(h)
		if err != nil {
			return err
		}
		opts := o.Options()
		n := len(o.Subgroups())
		info := placementInfo{GPUBudget: opts.GPUBudget, Subgroups: n, CPU: n}
		if opts.Device != nil {
			info.Device = opts.Device.Name()
		}
		if s, ok := o.Schedule(); ok {
			info.CPU, info.GPU, info.Resident, info.Upcast = s.CPU, s.GPU, s.Resident, s.UpcastOnGPU
		}
		if p, ok := o.Plan(); ok {
			info.PredictedS = p.Makespan
		}
		b, err := json.Marshal(info)
		if err != nil {
			return err
		}
		*out = C.CString(string(b))
		return nil
	}))
}
