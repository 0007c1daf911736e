package offload

import (
	"encoding/json"
	"errors"
	"fmt"
	"sort"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/safetensors"
	"github.com/deepstates/dos/scheduler"
)

// ObjectName is the key of the optimizer's own object in a checkpoint's
// manifest; trainers must not use it for theirs.
const ObjectName = "optimizer"

// objectFormat names the schema of the optimizer object.
const objectFormat = "dos-offload/v1"

// The names of a parameter's tensors in a checkpoint are the parameter's
// name and one of these suffixes: NAME.master holds the fp32 master
// weights, then PyTorch's names of the Adam state (its state_dict keys);
// NAME.max_exp_avg_sq only with amsgrad. Every one is F32 with the
// parameter's shape.
const (
	MasterSuffix      = ".master"
	ExpAvgSuffix      = ".exp_avg"
	ExpAvgSqSuffix    = ".exp_avg_sq"
	MaxExpAvgSqSuffix = ".max_exp_avg_sq"
)

// stateSuffixes are the suffixes in the order of stateSlices.
var stateSuffixes = [...]string{MasterSuffix, ExpAvgSuffix, ExpAvgSqSuffix, MaxExpAvgSqSuffix}

// MasterName returns the checkpoint tensor that holds parameter param's
// fp32 master weights: param + MasterSuffix.
func MasterName(param string) string { return param + MasterSuffix }

// optimizerObject is the optimizer's object in a checkpoint's manifest.
type optimizerObject struct {
	Format  string     `json:"format"`
	Step    int64      `json:"step"`
	Hyper   adam.Hyper `json:"hyper"`
	Options Options    `json:"options"`
	Params  []Param    `json:"params"`
}

// groupState returns subgroup g's state array k (stateSlices' order:
// master weights, exp_avg, exp_avg_sq, max_exp_avg_sq): with
// Options.Device where its engine keeps it (scheduler.Engine.StateOf: the
// host state, or a speculation's slot), else its part of the host state.
// It allocates nothing.
func (o *Optimizer) groupState(g, k int) []float32 {
	s := o.state
	if o.eng != nil {
		s = o.eng.StateOf(g)
	} else {
		sg := o.subgroups[g]
		s = s.Slice(sg.Offset, sg.Offset+sg.Len)
	}
	return [...][]float32{s.Param, s.ExpAvg, s.ExpAvgSq, s.MaxExpAvgSq}[k]
}

func (o *Optimizer) stateSlices() [][]float32 {
	s := [][]float32{o.state.Param, o.state.ExpAvg, o.state.ExpAvgSq}
	if o.opts.Hyper.AMSGrad {
		s = append(s, o.state.MaxExpAvgSq)
	}
	return s
}

// Snapshot returns the optimizer's state as a checkpoint snapshot whose
// Step is the optimizer's step counter (a caller may raise it to its own
// iteration count, never lower it): for every parameter, NAME.master, NAME.exp_avg,
// NAME.exp_avg_sq (and NAME.max_exp_avg_sq with amsgrad), fp32 with the
// parameter's shape, as zero-copy views of the state; plus the "optimizer"
// object (step, hyperparameters, options, parameter list) and the trainer's
// objects, each marshalled to JSON. The views are valid until the next Step,
// SetParam or LoadCheckpoint (and with Options.Device until Close); they are
// not synchronized with those calls (see Optimizer's Concurrency). With
// Options.Speculate the next backward does not speculate (GradsFinal would
// update the host-held subgroups under the views before the Step).
//
// Errors: ErrClosed, an object named "optimizer", or one that does not
// marshal.
func (o *Optimizer) Snapshot(objects map[string]any) (*checkpoint.Snapshot, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.pool == nil {
		return nil, ErrClosed
	}
	if err := o.syncHost(); err != nil {
		return nil, err
	}
	o.specPaused = true // the views stay the state's until the next Step
	return o.snapshot(objects)
}

// snapshot is Snapshot without bringing resident state back first.
func (o *Optimizer) snapshot(objects map[string]any) (*checkpoint.Snapshot, error) {
	if o.pool == nil {
		return nil, ErrClosed
	}
	if o.opts.Device != nil && o.dev == devBroken {
		return nil, fmt.Errorf("offload: %w: nothing to save", scheduler.ErrBroken)
	}
	snap := &checkpoint.Snapshot{Step: o.step, WorldSize: 1, Objects: map[string]json.RawMessage{}}
	for k, v := range objects {
		if k == ObjectName {
			return nil, fmt.Errorf("offload: object name %q is reserved for the optimizer", k)
		}
		b, err := json.Marshal(v)
		if err != nil {
			return nil, fmt.Errorf("offload: object %q: %w", k, err)
		}
		snap.Objects[k] = b
	}
	obj := optimizerObject{Format: objectFormat, Step: o.step, Hyper: o.opts.Hyper, Options: o.opts}
	for _, p := range o.params {
		obj.Params = append(obj.Params, p.Param)
	}
	b, err := json.Marshal(obj)
	if err != nil {
		return nil, fmt.Errorf("offload: optimizer object: %w", err)
	}
	snap.Objects[ObjectName] = b
	// Parameter by parameter, so that the file is in subgroup order: a
	// lazy engine captures subgroup 0's state first, then subgroup 1's...
	// Each tensor's data is cut at subgroup boundaries, the pieces tagged
	// with their subgroup (checkpoint.Tensor.Groups).
	arrays := len(o.stateSlices())
	for _, i := range o.layout {
		p := o.params[i]
		shape := make([]int64, len(p.Shape))
		for i, d := range p.Shape {
			shape[i] = int64(d)
		}
		for k := range arrays {
			t := checkpoint.Tensor{Name: p.Name + stateSuffixes[k], DType: safetensors.F32, Shape: shape}
			for lo := p.Offset; lo < p.Offset+p.Len; {
				g := o.subgroupOf(lo)
				sg := o.subgroups[g]
				hi := min(p.Offset+p.Len, sg.Offset+sg.Len)
				t.Data = append(t.Data, safetensors.Float32View(o.groupState(g, k)[lo-sg.Offset:hi-sg.Offset]))
				t.Groups = append(t.Groups, g)
				lo = hi
			}
			snap.Tensors = append(snap.Tensors, t)
		}
	}
	snap.Check = newSaveCheck(snap)
	return snap, nil
}

// newSaveCheck returns the Check of a snapshot of the optimizer state ts
// (checkpoint.Snapshot.Check): the bytes on their way to the file pass
// CheckState's test, so that a state LoadCheckpoint would refuse (a master
// weight or moment gone Inf or NaN, which finite but huge gradients can
// cause) is never committed and never replaces, under Keep, a checkpoint
// that loads. It scans the staged bytes once, in the save's background
// stage, and allocates nothing per piece. It reads s.Tensors when the save
// runs, so tensors a caller adds to the snapshot are seen where they are;
// only F32 tensors named as optimizer state are checked (as
// VerifyCheckpoint does).
func newSaveCheck(s *checkpoint.Snapshot) func(t int, off int64, b []byte) error {
	var (
		scan stateScan
		cur  = -1
		size int64 // tensor cur's bytes
	)
	return func(t int, off int64, b []byte) error {
		ts := &s.Tensors[t]
		if !isStateTensor(ts.DType, ts.Name) {
			return nil // not optimizer state: a caller's tensor
		}
		if t != cur {
			cur, size = t, 0
			for _, r := range ts.Data {
				size += int64(len(r))
			}
		}
		if err := scan.piece(ts.Name, size, off, b); err != nil {
			return fmt.Errorf("offload: state tensor %q is not saved: %v; the previous checkpoint stays the latest", ts.Name, err)
		}
		return nil
	}
}

// CheckpointHyper reads the hyperparameters and the parameter groups a
// checkpoint was saved with (path: a root, its latest checkpoint, or one
// step directory), without loading its state, so that a caller can refuse
// it before LoadCheckpoint takes them (the PyTorch binding: dos fixes
// them at construction). Errors: those of checkpoint.Resolve and Open,
// and one wrapping checkpoint.ErrCorrupt for an optimizer object that
// does not decode or is invalid (as LoadCheckpoint).
func CheckpointHyper(fsys checkpoint.FS, path string) (dir string, hyper adam.Hyper, groups []Group, err error) {
	if dir, err = checkpoint.Resolve(fsys, path); err != nil {
		return "", hyper, nil, err
	}
	c, err := checkpoint.Open(fsys, dir, 0)
	if err != nil {
		return dir, hyper, nil, err
	}
	defer c.Close()
	obj, err := checkObject(c)
	if err != nil {
		return dir, hyper, nil, err
	}
	return dir, obj.Hyper, obj.Options.Groups, nil
}

// subgroupOf returns the index of the subgroup holding element i.
func (o *Optimizer) subgroupOf(i int) int {
	return sort.Search(len(o.subgroups), func(k int) bool { return o.subgroups[k].Offset+o.subgroups[k].Len > i })
}

// SaveAsync hands the optimizer's state and the trainer's objects (see
// Snapshot) to the lazy checkpointer e and returns at once, with the
// handle of the save; step names the checkpoint (at least the optimizer's
// step counter: a trainer passes its iteration). Until the state is
// captured, the next Step waits, subgroup by subgroup, only for the
// capture of the subgroup it is about to update; SetParam, LoadCheckpoint
// and Close wait for the whole capture. With Options.Device, the resident
// subgroups' state moves D2H on its own stream first (the snapshot's
// Prepare waits for it in the background), the next update's kernels wait
// for that copy on the device, and the engine's CPU workers and state D2H
// copies wait per subgroup (scheduler.Engine.Hold). A failed background save is
// returned by the handle, by e's next Save and by this optimizer's next
// Step (once, the step not taken).
//
// Errors: ErrClosed, a step below the step counter, the previous
// background save's error, those of Snapshot and of checkpoint.Engine.Save.
func (o *Optimizer) SaveAsync(e *checkpoint.Engine, step int64, objects map[string]any) (*checkpoint.Handle, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.pool == nil {
		return nil, ErrClosed
	}
	if e == nil {
		return nil, errors.New("offload: SaveAsync: a nil checkpoint engine (checkpoint.NewEngine makes one)")
	}
	if step < o.step {
		return nil, fmt.Errorf("offload: SaveAsync: step %d is below the optimizer's step counter %d", step, o.step)
	}
	if err := o.settle(true); err != nil {
		return nil, err
	}
	if o.eng != nil && o.dev != devBroken {
		// The state of the last step, not what Options.Speculate wrote
		// since; each subgroup's read where it is (the snapshot's views
		// of a state a kept speculative update left in a slot are the
		// slot's: scheduler.Engine.StateOf), not copied home first.
		o.eng.UndoSpeculation()
	}
	snap, err := o.snapshot(objects)
	if err != nil {
		return nil, err
	}
	d2h := false
	if o.eng != nil && o.dev == devDeviceAhead {
		// The resident subgroups' state moves D2H now, and the capture
		// waits for it in the background (checkpoint.Snapshot.Prepare):
		// the trainer's next forward and backward run meanwhile.
		wait, err := o.eng.DownloadAsync()
		if err != nil {
			return nil, o.engineErr(err)
		}
		snap.Prepare, d2h = wait, true
		o.dev = devSynced
	}
	snap.Step = step
	h, err := e.Save(snap)
	if err != nil {
		if d2h {
			// The resident state's D2H is in flight with no capture to
			// wait for it: the host state is current once it is done.
			if werr := snap.Prepare(); werr != nil {
				o.dev = devDeviceAhead // the device's copy still counts
			}
		}
		return nil, err
	}
	o.pending = lazySave{h: h, d2h: d2h}
	if o.eng != nil {
		// Copy-on-write: the engine's next writes to subgroup i's host
		// state wait for subgroup i's capture (and a failed save frees
		// the memory too; its error comes back from the handle).
		o.eng.Hold(func(i int) { _ = h.WaitGroup(i) })
	}
	return h, nil
}

// AcknowledgeSave says that the failure of h, this optimizer's last lazy
// save (SaveAsync), was reported to the user by other means (h.Wait
// returned it): the next Step, SaveAsync, SetParam or LoadCheckpoint does
// not report it again, and that Step is taken. A save still running, one
// that succeeded, or another optimizer's handle changes nothing. The
// failed save committed nothing: the previous checkpoint is the latest.
func (o *Optimizer) AcknowledgeSave(h *checkpoint.Handle) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if h == nil || o.pending.h != h || !h.Done() || h.Err() == nil {
		return
	}
	o.pending = lazySave{}
	if o.eng != nil {
		o.eng.Hold(nil)
	}
}

// settle deals with the save in flight: with all, it waits until the whole
// state is captured; it returns (once) the error of a save that failed.
func (o *Optimizer) settle(all bool) error {
	h := o.pending.h
	if h == nil {
		return nil
	}
	if all {
		o.pending.waitCapture()
	}
	if !h.Done() {
		return nil // still flushing (after the capture the state is free)
	}
	o.pending = lazySave{}
	if o.eng != nil {
		o.eng.Hold(nil)
	}
	if _, err := h.Wait(); err != nil {
		return fmt.Errorf("offload: the checkpoint of step %d failed: %w", h.Stats().Step, err)
	}
	return nil
}

// SaveCheckpoint writes the optimizer's state and the trainer's objects
// (marshalled to JSON; see Snapshot) as a committed checkpoint under root,
// synchronously, and returns its directory (checkpoint.Save). The
// checkpoint is named by the optimizer's step counter; a trainer that counts
// iterations, skipped steps included, names it by its iteration instead
// with Snapshot, setting Snapshot.Step, and checkpoint.Save. The other
// calls (Step, Close, ...) wait until the checkpoint is written.
//
// Errors: ErrClosed, those of Snapshot and of checkpoint.Save; on error the
// previous checkpoint stays the latest.
func (o *Optimizer) SaveCheckpoint(fsys checkpoint.FS, root string, objects map[string]any) (string, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.pool == nil {
		return "", ErrClosed
	}
	if err := o.syncHost(); err != nil {
		return "", err
	}
	snap, err := o.snapshot(objects)
	if err != nil {
		return "", err
	}
	return checkpoint.Save(fsys, root, snap)
}

// LoadCheckpoint restores the optimizer from the checkpoint at path: a
// checkpoint root (its latest committed checkpoint is loaded, as
// checkpoint.Resolve finds it) or one step directory, rank 0. It restores
// the master weights, exp_avg, exp_avg_sq, max_exp_avg_sq, the step counter
// and, as torch.optim.Optimizer.load_state_dict does, the hyperparameters
// (lr, betas, eps, weight_decay, maximize, mode, and the parameter groups'
// lr and weight_decay): call SetLR afterwards to follow a schedule. The
// other Options (subgroup size, dtypes, clipping, threads) stay this
// optimizer's. The working copy is refreshed from the master weights: in
// the host buffers (Working) at once, on the device (DeviceWorking) at
// the next SyncDevice or Step, so a GPU trainer calls SyncDevice before
// its next forward. After a device fault (scheduler.ErrBroken) the load
// replaces the engine: DeviceGrad, DeviceWorking and DeviceMaster views
// taken before are stale (DeviceTensor.Valid), ask for them again. A
// lazy save of this optimizer in flight (SaveAsync) is waited for first,
// so that the root is read committed. It returns the directory loaded and
// the checkpoint's objects, so the trainer can restore its own.
//
// Every tensor is read, checksummed and checked (CheckState) into new
// buffers before anything changes: on any error the optimizer is untouched.
//
// Errors: ErrClosed; those of checkpoint.Resolve, Open and ReadTensor
// (ErrCorrupt for bad contents); an error wrapping checkpoint.ErrCorrupt
// for an optimizer object that does not decode, whose format is unknown,
// whose hyperparameters are invalid or whose step is outside [0, the
// checkpoint's step], and for a state tensor that is not finite or an
// exp_avg_sq or max_exp_avg_sq below 0 (naming the directory, the tensor,
// its first bad element's index and value and the count of bad ones, as
// VerifyCheckpoint does); a checkpoint whose parameters (names, shapes) or
// amsgrad setting differ from this optimizer's, naming the tensor.
func (o *Optimizer) LoadCheckpoint(fsys checkpoint.FS, path string) (dir string, objects map[string]json.RawMessage, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.pool == nil {
		return "", nil, ErrClosed
	}
	if h := o.pending.h; h != nil {
		// A lazy save of this optimizer in flight may be committing into
		// the root being read: let it finish (settle reports its error),
		// so the root is seen committed, never mid-commit.
		_, _ = h.Wait()
	}
	if err := o.settle(true); err != nil {
		return "", nil, err
	}
	if dir, err = checkpoint.Resolve(fsys, path); err != nil {
		return "", nil, err
	}
	if o.opts.Device != nil && o.dev == devBroken {
		if err := o.replaceEngine(); err != nil {
			return "", nil, err
		}
	}
	if err := o.dropPrefetch(); err != nil {
		return "", nil, err
	}
	if o.eng != nil {
		// The states kept speculative updates left in the engine's slots
		// come home first, so that the checkpoint's replace them all (a
		// later DropSpeculation would otherwise bring the old ones back
		// over it), and a load that fails leaves the last step's.
		o.eng.DropSpeculation()
	}
	objects, err = o.load(fsys, dir)
	if err == nil {
		// load rounded the whole host working copy from the loaded
		// master weights.
		o.workStale.Store(false)
	}
	if err == nil && o.eng != nil {
		// The host state is the checkpoint's: the device follows it (at
		// the next SyncDevice or Step).
		o.dev = devHostAhead
	}
	return dir, objects, err
}

// replaceEngine gives a broken optimizer a fresh engine (the broken one's
// memory may be in any state), built before the broken one is released,
// so that a failure leaves the optimizer as it was: broken, its state
// views valid. When the device refuses the memory of a second engine, the
// broken one is released first and the build tried once more; if that
// fails too, the optimizer has no engine and no state and stays broken
// (every call that needs the state says so; LoadCheckpoint tries again).
// The optimizer stays broken until a load succeeds.
func (o *Optimizer) replaceEngine() error {
	// The broken engine's memory may be in any state after the fault: a
	// failure to free it says nothing about the new one, and is reported
	// only when no new engine could be built.
	eng, pred, err := o.buildEngine()
	var closeErr error
	if err != nil && o.eng != nil {
		closeErr = o.eng.Close()
		o.eng, o.state = nil, adam.State{}
		eng, pred, err = o.buildEngine()
	}
	if err != nil {
		return fmt.Errorf("offload: a new engine after the device fault: %w (still broken: LoadCheckpoint tries again)", errors.Join(err, closeErr))
	}
	if o.eng != nil {
		_ = o.eng.Close()
	}
	o.eng, o.state = eng, eng.HostState()
	if pred != nil {
		o.setPlan(pred) // the profile's choice again, and Replan starts over from it
	}
	return nil
}

func (o *Optimizer) load(fsys checkpoint.FS, dir string) (map[string]json.RawMessage, error) {
	c, err := checkpoint.Open(fsys, dir, 0)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	obj, err := checkObject(c)
	if err != nil {
		return nil, err
	}
	if obj.Hyper.AMSGrad != o.opts.Hyper.AMSGrad {
		return nil, fmt.Errorf("offload: %s was saved with amsgrad=%t; this optimizer has amsgrad=%t", dir, obj.Hyper.AMSGrad, o.opts.Hyper.AMSGrad)
	}
	if len(obj.Options.Groups) != len(o.opts.Groups) {
		groups := func(n int) string {
			if n == 0 {
				return "no parameter groups (one implicit)"
			}
			return fmt.Sprintf("%d parameter groups", n)
		}
		return nil, fmt.Errorf("offload: %s was saved with %s; this optimizer has %s", dir, groups(len(obj.Options.Groups)), groups(len(o.opts.Groups)))
	}
	saved := make(map[string]int, len(obj.Params))
	for _, p := range obj.Params {
		saved[p.Name] = p.Group
	}
	for _, p := range o.params {
		if g, ok := saved[p.Name]; ok && g != p.Group {
			return nil, fmt.Errorf("offload: %s: parameter %q was in group %d; this optimizer has it in group %d", dir, p.Name, g, p.Group)
		}
	}
	fresh := make([][]float32, len(o.stateSlices()))
	for k := range fresh {
		fresh[k] = make([]float32, o.total)
	}
	for _, p := range o.params {
		for k, buf := range fresh {
			name := p.Name + stateSuffixes[k]
			e, ok := c.Entry(name)
			if !ok {
				return nil, fmt.Errorf("offload: %s: checkpoint has no tensor %q (parameter %q, shape %v)", dir, name, p.Name, p.Shape)
			}
			if e.DType != safetensors.F32 || !sameShape(e.Shape, p.Shape) {
				return nil, fmt.Errorf("offload: %s: tensor %q is %s %v, want F32 %v", dir, name, e.DType, e.Shape, p.Shape)
			}
			v := buf[p.Offset : p.Offset+p.Len]
			if err := c.ReadTensor(name, safetensors.Float32View(v)); err != nil {
				return nil, err
			}
			if err := CheckState(name, v); err != nil {
				return nil, fmt.Errorf("offload: %s: %w", dir, err)
			}
		}
	}
	for _, e := range c.Manifest.Tensors {
		if _, ok := o.byName[trimStateSuffix(e.Name)]; !ok {
			return nil, fmt.Errorf("offload: %s: tensor %q belongs to no parameter of this optimizer", dir, e.Name)
		}
	}
	// Everything read and verified: commit. Copy rather than swap, so the
	// views that Working handed out stay valid.
	for k, dst := range o.stateSlices() {
		copy(dst, fresh[k])
	}
	o.step = obj.Step
	o.stepAt.Store(o.step)
	o.re.last, o.re.warm = o.step, false // Replan refits from the loaded step on, its first phase left out
	o.opts.Hyper = obj.Hyper
	copy(o.opts.Groups, obj.Options.Groups) // their lr and weight_decay, as load_state_dict
	o.refreshWorking(0, o.total)
	return c.Manifest.Objects, nil
}

func trimStateSuffix(name string) string {
	for _, s := range stateSuffixes {
		if len(name) > len(s) && name[len(name)-len(s):] == s {
			return name[:len(name)-len(s)]
		}
	}
	return name
}

func sameShape(a []int64, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != int64(b[i]) {
			return false
		}
	}
	return true
}
