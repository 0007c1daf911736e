package main

/*
#include <stdint.h>
#include <stdlib.h>
*/
import "C"

import (
	"encoding/json"
	"fmt"
	"runtime/debug"
	"sync"
	"unsafe"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/offload"
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
}

// dtypes maps spec.DType to the working copy's and the gradients' dtype.
var dtypes = map[string][2]adam.DType{"": {0, adam.F32}, "float32": {0, adam.F32}, "bfloat16": {adam.BF16, adam.BF16}, "float16": {adam.F16, adam.F16}}

// handles holds the live optimizers and saves by handle.
var handles struct {
	sync.Mutex
	next  int64
	m     map[int64]*offload.Optimizer
	eng   map[int64]*saver             // an optimizer's lazy checkpoint engine, by the optimizer's handle
	saves map[int64]*checkpoint.Handle // saves in flight or done, by their own handle
}

// saver is an optimizer's checkpoint engine on one root.
type saver struct {
	root string
	e    *checkpoint.Engine
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
		handles.m, handles.eng, handles.saves = map[int64]*offload.Optimizer{}, map[int64]*saver{}, map[int64]*checkpoint.Handle{}
	}
	handles.next++
	return handles.next
}

// fail stores err's message in *errOut (malloc'd) when errOut is not nil.
func fail(errOut **C.char, err error) {
	if errOut != nil {
		*errOut = C.CString(err.Error())
	}
}

// guard turns a panic into an error, so none crosses into C.
func guard(err *error) {
	if r := recover(); r != nil {
		*err = fmt.Errorf("dos: internal error: %v\n%s", r, debug.Stack())
	}
}

//export dos_version
func dos_version() *C.char { return cVersion }

var cVersion = C.CString("dos capi 1")

//export dos_free
func dos_free(p *C.char) { C.free(unsafe.Pointer(p)) }

//export dos_adamw_new
func dos_adamw_new(specJSON *C.char, errOut **C.char) (h C.int64_t) {
	var err error
	defer func() {
		if err != nil {
			h = 0
			fail(errOut, err)
		}
	}()
	defer guard(&err)
	var s spec
	if err = json.Unmarshal([]byte(C.GoString(specJSON)), &s); err != nil {
		err = fmt.Errorf("dos: the optimizer's spec: %w", err)
		return 0
	}
	if len(s.Groups) == 0 {
		err = fmt.Errorf("dos: no parameter group")
		return 0
	}
	params := make([]offload.Param, len(s.Params))
	for i, p := range s.Params {
		params[i] = offload.Param{Name: p.Name, Shape: p.Shape, Group: p.Group}
	}
	dt, ok := dtypes[s.DType]
	if !ok {
		err = fmt.Errorf("dos: dtype %q: want float32, bfloat16 or float16", s.DType)
		return 0
	}
	opts := offload.Options{
		Hyper: adam.Hyper{Mode: adam.AdamW, LR: s.Groups[0].LR, Betas: s.Betas, Eps: s.Eps, WeightDecay: s.Groups[0].WeightDecay,
			AMSGrad: s.AMSGrad, Maximize: s.Maximize},
		SubgroupSize: s.SubGroupSize, WorkingDType: dt[0], GradDType: dt[1], MaxGradNorm: s.MaxGradNorm, Threads: s.Threads,
	}
	for _, g := range s.Groups {
		opts.Groups = append(opts.Groups, offload.Group{LR: g.LR, WeightDecay: g.WeightDecay})
	}
	o, err := offload.New(params, *opts.EnsureDefaults())
	if err != nil {
		return 0
	}
	handles.Lock()
	defer handles.Unlock()
	id := newHandle()
	handles.m[id] = o
	return C.int64_t(id)
}

//export dos_adamw_set
func dos_adamw_set(h C.int64_t, i C.int32_t, data *C.float, n C.int64_t, errOut **C.char) (rc C.int32_t) {
	var err error
	defer func() {
		if err != nil {
			rc = -1
			fail(errOut, err)
		}
	}()
	defer guard(&err)
	o, err := lookup(h)
	if err != nil {
		return -1
	}
	ps := o.Params()
	if int(i) < 0 || int(i) >= len(ps) {
		err = fmt.Errorf("dos: parameter %d of %d", int(i), len(ps))
		return -1
	}
	if int(n) != ps[i].Len {
		err = fmt.Errorf("dos: parameter %s has %d elements, not %d (its shape changed?)", ps[i].Name, ps[i].Len, int64(n))
		return -1
	}
	err = o.SetParam(ps[i].Name, unsafe.Slice((*float32)(unsafe.Pointer(data)), int(n)))
	return 0
}

//export dos_adamw_step
func dos_adamw_step(h C.int64_t, params **C.float, grads **C.float, lrs *C.double, ngroups C.int32_t, lossScale C.double, errOut **C.char) (rc C.int32_t) {
	var err error
	defer func() {
		if err != nil {
			rc = -1
			fail(errOut, err)
		}
	}()
	defer guard(&err)
	o, err := lookup(h)
	if err != nil {
		return -1
	}
	ps := o.Params()
	if len(o.Options().Groups) != int(ngroups) {
		err = fmt.Errorf("dos: %d learning rates for %d parameter groups", int(ngroups), len(o.Options().Groups))
		return -1
	}
	for g, lr := range unsafe.Slice((*float64)(unsafe.Pointer(lrs)), int(ngroups)) {
		if err = o.SetGroupLR(g, lr); err != nil {
			return -1
		}
	}
	gp := unsafe.Slice((*unsafe.Pointer)(unsafe.Pointer(grads)), len(ps))
	pp := unsafe.Slice((*unsafe.Pointer)(unsafe.Pointer(params)), len(ps))
	wide := o.Options().GradDType == adam.F32
	for i, p := range ps {
		if gp[i] == nil || pp[i] == nil {
			err = fmt.Errorf("dos: parameter %s: a nil gradient or data pointer", p.Name)
			return -1
		}
		if wide {
			copy(o.Grad(i).Float32(), unsafe.Slice((*float32)(gp[i]), p.Len))
		} else {
			copy(o.Grad(i).Uint16(), unsafe.Slice((*uint16)(gp[i]), p.Len))
		}
	}
	res, err := o.Step(offload.StepArgs{LossScale: float64(lossScale)})
	if err != nil {
		return -1
	}
	if res.Skipped {
		return 0
	}
	for i, p := range ps {
		if w := o.Working(i); w.DType == adam.F32 {
			copy(unsafe.Slice((*float32)(pp[i]), p.Len), w.Float32())
		} else {
			copy(unsafe.Slice((*uint16)(pp[i]), p.Len), w.Uint16())
		}
	}
	return 1
}

//export dos_adamw_close
func dos_adamw_close(h C.int64_t, errOut **C.char) (rc C.int32_t) {
	var err error
	defer func() {
		if err != nil {
			rc = -1
			fail(errOut, err)
		}
	}()
	defer guard(&err)
	handles.Lock()
	o, sv := handles.m[int64(h)], handles.eng[int64(h)]
	delete(handles.m, int64(h))
	delete(handles.eng, int64(h))
	handles.Unlock()
	if o == nil {
		return 0
	}
	var errs []error
	if sv != nil {
		errs = append(errs, sv.e.Close()) // waits for the save in flight
	}
	errs = append(errs, o.Close())
	for _, e := range errs {
		if e != nil && err == nil {
			err = e
		}
	}
	return 0
}

// stateKinds maps the C API's state kind (0 master, 1 exp_avg, 2
// exp_avg_sq, 3 max_exp_avg_sq) to offload's.
var stateKinds = []offload.StateKind{offload.MasterWeights, offload.ExpAvg, offload.ExpAvgSq, offload.MaxExpAvgSq}

// stateArgs resolves a state call's optimizer, kind and buffer.
func stateArgs(h C.int64_t, kind C.int32_t, data *C.float, n C.int64_t) (*offload.Optimizer, offload.StateKind, []float32, error) {
	o, err := lookup(h)
	if err != nil {
		return nil, 0, nil, err
	}
	if int(kind) < 0 || int(kind) >= len(stateKinds) {
		return nil, 0, nil, fmt.Errorf("dos: state kind %d: want 0 (master) to 3 (max_exp_avg_sq)", int(kind))
	}
	if n < 0 || (n > 0 && data == nil) {
		return nil, 0, nil, fmt.Errorf("dos: a state buffer of %d elements at %p", int64(n), data)
	}
	return o, stateKinds[kind], unsafe.Slice((*float32)(unsafe.Pointer(data)), int(n)), nil
}

//export dos_adamw_state_get
func dos_adamw_state_get(h C.int64_t, i, kind C.int32_t, data *C.float, n C.int64_t, errOut **C.char) (rc C.int32_t) {
	var err error
	defer func() {
		if err != nil {
			rc = -1
			fail(errOut, err)
		}
	}()
	defer guard(&err)
	o, k, buf, err := stateArgs(h, kind, data, n)
	if err != nil {
		return -1
	}
	err = o.ReadState(int(i), k, buf)
	return 0
}

//export dos_adamw_state_set
func dos_adamw_state_set(h C.int64_t, i, kind C.int32_t, data *C.float, n C.int64_t, errOut **C.char) (rc C.int32_t) {
	var err error
	defer func() {
		if err != nil {
			rc = -1
			fail(errOut, err)
		}
	}()
	defer guard(&err)
	o, k, buf, err := stateArgs(h, kind, data, n)
	if err != nil {
		return -1
	}
	err = o.WriteState(int(i), k, buf)
	return 0
}

//export dos_adamw_get_step
func dos_adamw_get_step(h C.int64_t, errOut **C.char) (step C.int64_t) {
	var err error
	defer func() {
		if err != nil {
			step = -1
			fail(errOut, err)
		}
	}()
	defer guard(&err)
	o, err := lookup(h)
	if err != nil {
		return -1
	}
	return C.int64_t(o.StepCount())
}

//export dos_adamw_set_step
func dos_adamw_set_step(h C.int64_t, step C.int64_t, errOut **C.char) (rc C.int32_t) {
	var err error
	defer func() {
		if err != nil {
			rc = -1
			fail(errOut, err)
		}
	}()
	defer guard(&err)
	o, err := lookup(h)
	if err != nil {
		return -1
	}
	err = o.SetStepCount(int64(step))
	return 0
}

//export dos_adamw_save
func dos_adamw_save(h C.int64_t, root *C.char, objects *C.char, errOut **C.char) (sh C.int64_t) {
	var err error
	defer func() {
		if err != nil {
			sh = 0
			fail(errOut, err)
		}
	}()
	defer guard(&err)
	o, err := lookup(h)
	if err != nil {
		return 0
	}
	var objs map[string]any
	if objects != nil {
		if err = json.Unmarshal([]byte(C.GoString(objects)), &objs); err != nil {
			err = fmt.Errorf("dos: save: the objects: %w", err)
			return 0
		}
	}
	dir := C.GoString(root)
	handles.Lock()
	sv := handles.eng[int64(h)]
	handles.Unlock()
	if sv == nil || sv.root != dir {
		if sv != nil {
			if err = sv.e.Close(); err != nil {
				return 0
			}
		}
		e, err2 := checkpoint.NewEngine(checkpoint.OS, dir, checkpoint.EngineOptions{})
		if err = err2; err != nil {
			return 0
		}
		sv = &saver{root: dir, e: e}
		handles.Lock()
		handles.eng[int64(h)] = sv
		handles.Unlock()
	}
	hd, err := o.SaveAsync(sv.e, o.StepCount(), objs)
	if err != nil {
		return 0
	}
	handles.Lock()
	defer handles.Unlock()
	id := newHandle()
	handles.saves[id] = hd
	return C.int64_t(id)
}

//export dos_save_done
func dos_save_done(sh C.int64_t) C.int32_t {
	handles.Lock()
	hd := handles.saves[int64(sh)]
	handles.Unlock()
	if hd == nil || hd.Done() {
		return 1
	}
	return 0
}

//export dos_save_wait
func dos_save_wait(sh C.int64_t, dirOut **C.char, errOut **C.char) (rc C.int32_t) {
	var err error
	defer func() {
		if err != nil {
			rc = -1
			fail(errOut, err)
		}
	}()
	defer guard(&err)
	handles.Lock()
	hd := handles.saves[int64(sh)]
	handles.Unlock()
	if hd == nil {
		err = fmt.Errorf("dos: no save with handle %d", int64(sh))
		return -1
	}
	dir, err := hd.Wait()
	if err != nil {
		return -1
	}
	if dirOut != nil {
		*dirOut = C.CString(dir)
	}
	return 0
}

//export dos_save_free
func dos_save_free(sh C.int64_t) {
	handles.Lock()
	delete(handles.saves, int64(sh))
	handles.Unlock()
}

//export dos_adamw_load
func dos_adamw_load(h C.int64_t, path *C.char, objectsOut **C.char, errOut **C.char) (rc C.int32_t) {
	var err error
	defer func() {
		if err != nil {
			rc = -1
			fail(errOut, err)
		}
	}()
	defer guard(&err)
	o, err := lookup(h)
	if err != nil {
		return -1
	}
	_, objs, err := o.LoadCheckpoint(checkpoint.OS, C.GoString(path))
	if err != nil {
		return -1
	}
	if objectsOut != nil {
		b, err2 := json.Marshal(objs)
		if err = err2; err != nil {
			return -1
		}
		*objectsOut = C.CString(string(b))
	}
	return 0
}
