package offload

import (
	"errors"
	"fmt"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// DefaultSubgroupSize is the default Options.SubgroupSize in elements:
// DeepSpeed's default sub_group_size, 1e9.
const DefaultSubgroupSize = 1_000_000_000

// Options configures an Optimizer.
type Options struct {
	// Hyper are the AdamW hyperparameters (PyTorch's names and defaults).
	Hyper adam.Hyper `json:"hyper"`
	// SubgroupSize is the number of elements per subgroup (DeepSpeed's
	// sub_group_size). 0 means DefaultSubgroupSize.
	SubgroupSize int `json:"subgroup_size"`
	// SubgroupSizes, when set, are candidates for SubgroupSize (each >= 1)
	// that the performance model chooses from: with Options.Device and a
	// profile (Profile, or Calibrate's), New cuts the parameters at each,
	// plans the update phase as it would (the model's schedule, or
	// Placement's), and keeps the size whose plan is predicted fastest,
	// the largest among those within 2 % of the fastest (fewer operations
	// for what the model leaves out). Smaller subgroups pack a small
	// budget better and fit the streamed lane's two staging slots where
	// large ones cannot (H200, GPT-2 1.5B, 1.4 GiB: 0.306 s predicted at
	// 25M against 0.416 s at 100M). Without a profile (none given, or a
	// Placement, which skips Calibrate) and with a forced Schedule (whose
	// counts are for one size) the first is taken. Options() then reports
	// the chosen SubgroupSize. The cut changes the order in which
	// the gradient norm's per-subgroup sums are added, so runs with
	// different sizes may differ in the clip coefficient's last bit.
	SubgroupSizes []int `json:"-"`
	// GradDType is the dtype of the gradients the trainer writes: F32, BF16
	// or F16. 0 means F32.
	GradDType adam.DType `json:"grad_dtype"`
	// WorkingDType is the dtype of the working copy forward and backward
	// read: BF16 or F16 for a 16-bit copy rounded from the master weights
	// after every step, or 0 (none) to read the fp32 master weights.
	WorkingDType adam.DType `json:"working_dtype"`
	// MaxGradNorm enables global gradient-norm clipping with this max_norm
	// (torch.nn.utils.clip_grad_norm_, L2 norm); 0 disables it.
	MaxGradNorm float64 `json:"max_grad_norm"`
	// Threads is the number of CPU goroutines for the update. 0 means
	// runtime.GOMAXPROCS(0).
	Threads int `json:"threads"`
	// Profile, when set, holds this machine's measured rates (dos
	// calibrate, perfmodel.Load): New asks the performance model for the
	// update phase's schedule and its predicted time, which Plan returns:
	// without Device the all-CPU schedule (host gradients, no copies),
	// with Device the fastest within GPUBudget (or Schedule's prediction
	// when Schedule forces one). Not saved in checkpoints.
	Profile *perfmodel.Profile `json:"-"`
	// Calibrate, when Profile is nil, makes New measure this machine
	// briefly and plan with the result (Profile is then the measured one):
	// the CPU update rate (perfmodel.CalibrateCPU at the optimizer's
	// thread count and gradient dtype, 3 repetitions of subgroups of 8M to
	// 64M parameters, whatever the model's size: 1 to 3 s and up to about
	// 2 GB of memory while it runs), and with a CUDA Device its copy,
	// conversion and update rates at reduced sizes (perfmodel.CalibrateGPU,
	// about a second more, in at most GPUBudget and DeviceBytes' device
	// memory, at least MinCalibrationBytes: Calibrate). On the simulated device the profile has no GPU
	// rates: the model keeps every subgroup on the CPU. With a forced
	// Schedule nothing is measured. Not saved in checkpoints.
	Calibrate bool `json:"-"`
	// Device, when set, runs every update phase through the interleaved
	// engine (scheduler.Engine) on this device (OpenDevice: "cuda" for
	// GPU 0, "sim" for the simulated device in tests): the gradients and
	// the 16-bit working copy live in device memory, the state in pinned
	// host memory, some subgroups GPU-resident within GPUBudget, and the
	// performance model's schedule (with Profile; Schedule forces one; all on the CPU
	// without either). Grad and Working stay host views: Step uploads the
	// gradients first, as a GPU trainer's backward would leave them, and
	// downloads the working copy after. A GPU trainer instead reads and
	// writes the device buffers themselves (DeviceWorking, DeviceGrad,
	// StepArgs.GradOnDevice). WorkingDType is then required.
	// Not saved in checkpoints.
	Device scheduler.Device `json:"-"`
	// GPUBudget is the device memory in bytes the update phase may use on
	// Device: resident state and two staging slots (and the upcast's
	// scratch), perfmodel.Workload.GPUBudget. With Profile the model
	// chooses within it (0: nothing on the GPU but the gradients and the
	// working copy, so all on the CPU); a forced Schedule must fit it
	// unless it is 0 (no limit checked). It does not count the gradients
	// and the working copy, which New allocates on Device whatever it is
	// (DeviceBytes). The engine holds all of it from New to Close. A GPU
	// trainer sizes it from cuMemGetInfo's free memory once its own
	// buffers (activations, workspaces) are allocated, less DeviceBytes,
	// less a margin.
	GPUBudget int64 `json:"-"`
	// Groups are the parameter groups, as torch.optim's param_groups: each
	// with its own lr and weight_decay (so biases and norms can skip
	// decay); Param.Group indexes them. The other hyperparameters (betas,
	// eps, mode, amsgrad, maximize) are Hyper's for every group. Without
	// groups every parameter is in one group with Hyper's lr and
	// weight_decay; with them, Hyper's lr and weight_decay are not used.
	// Saved and restored with the checkpoint (LoadCheckpoint restores the
	// groups' lr and weight_decay, as load_state_dict does).
	Groups []Group `json:"groups,omitempty"`
	// Replan, with Device and the performance model's schedule (Profile
	// or Calibrate; not a forced Schedule), corrects the model online:
	// after every update phase it compares each resource's measured busy
	// time (scheduler.Engine.Measure) with the profile's prediction for
	// the schedule, keeps a factor per resource weighted toward recent
	// phases (half the newest, half the past), and when the plan's
	// predicted update time missed the measured one by more than 5 %
	// (at most every 3 steps) it re-chooses the schedule with the profile
	// so corrected (perfmodel.Profile.Scaled) and re-plans the engine if
	// that is predicted 5 % faster; otherwise Plan takes the corrected
	// prediction. StepResult reports the predicted and measured update
	// phase and a re-plan. A re-plan moves resident state (Engine.Replan)
	// within the step that decides it. Not saved in checkpoints.
	Replan bool `json:"-"`
	// DeviceMasters, with Device, names the parameters whose fp32 master
	// weights the engine also keeps in device memory, refreshed by every
	// update (DeviceMaster): what a GPU trainer reads in fp32 where
	// PyTorch's bf16 autocast does (embedding lookups and LayerNorm read
	// fp32 parameters; only matrix products read the 16-bit copy). They
	// cost 4 bytes per element of device memory outside GPUBudget, and
	// their copies in every update (scheduler.Options.Mirror). Not saved
	// in checkpoints.
	DeviceMasters []string `json:"-"`
	// OverlapBackward, with Device, lets a trainer start the update
	// phase's work that needs no global value during its backward
	// (GradsFinal; scheduler.Engine.Prefetch): the CPU subgroups'
	// gradient D2H into pinned host memory of their own (gradient bytes
	// per CPU parameter, beside the state) and the first streamed
	// subgroups' state H2D. The performance model plans the phase without
	// that work (perfmodel.Workload.Prefetch). The update is the same,
	// bit for bit. Not saved in checkpoints.
	OverlapBackward bool `json:"-"`
	// OffloadParam, with Device, names the parameters whose 16-bit
	// working copy and gradient live in pinned host memory instead of
	// device memory (DeepSpeed ZeRO-Infinity's offload_param, per
	// parameter): a trainer streams their weights to the device before it
	// reads them (HostWorking) and copies their gradients back into
	// HostGrad; the CPU workers update them in place, first in each
	// update phase, with no copy (scheduler.Options.HostHeld). New cuts
	// the subgroups where a run of such parameters begins and ends, so a
	// subgroup is all of one kind; a forced Schedule counts the other
	// subgroups only. None of them may be in DeviceMasters. They save
	// GradDType's size + 2 bytes of device memory per element
	// (DeviceBytes). The update is the same, bit for bit. Not saved in
	// checkpoints.
	OffloadParam []string `json:"-"`
	// Speculate, with OverlapBackward, is host memory in bytes for
	// speculative updates (scheduler.Engine.Speculate): as GradsFinal
	// learns that an OffloadParam subgroup's gradients are final, or that
	// a CPU subgroup's are (their D2H then starts at once; not under a
	// schedule that upcasts them on the GPU), the CPU
	// workers update it during the backward, with clip factor 1 and the
	// last step's loss scale, out of place: the new state goes into a
	// free slot of this memory (scheduler.SpeculateBytes: 14 bytes a
	// parameter, 18 with amsgrad), or home from the slot an earlier kept
	// update left it in, while slots are free and until the Step begins
	// (what is left is the phase's, at the same 28 bytes of memory
	// traffic a parameter); the Step keeps each one whose scalars turn
	// out to be those, bit for bit, and undoes the others (a skipped
	// step, clipping that binds, another rate: the new state is
	// forgotten) before its phase updates them as before (DeepSpeed's
	// SuperOffload: speculation-then-validation). Every read of the state
	// before the Step (Master, Snapshot, SaveAsync, SaveCheckpoint,
	// Working of a stale copy, Close) undoes them first, and so does every
	// write (SetParam, ZeroGrad, LoadCheckpoint, a Step without
	// GradOnDevice); a synchronous read or write also moves every state
	// home (scheduler.Engine.DropSpeculation), and SaveAsync reads each
	// where it is (scheduler.Engine.StateOf). So the
	// update is the same, bit for bit, provided HostGrad is written by the
	// time GradsFinal's stream work is done (see HostGrad). The first
	// backward does not speculate, nor does one after a step that clipped
	// or was skipped, or after a Snapshot (a run that always clips loses
	// nothing). With Replan a step that kept a speculative update
	// corrects the CPU's rate alone (its phase lacks work the plan
	// counts: replanState.observeCPU) and re-plans nothing;
	// Optimizer.PlanIteration plans the schedule for the whole iteration
	// with the speculation's rate measured in the last phase (and with
	// Replan, the corrected rates). 0: none. Not saved in checkpoints.
	Speculate int64 `json:"-"`
	// SpeculateLeave, with Speculate, has the speculation leave every
	// other CPU subgroup of the model's last blocks to the phase, once
	// PlanIteration knows the forward's time and the forward overlaps the
	// phase (IterationWork.OverlapForward): about what the CPU updates
	// while the next forward runs the blocks after the phase's own CPU
	// work (Optimizer.SpeculateLeave), so that the CPU works beside that
	// forward instead of waiting for the next backward. Off by default:
	// its gain is not yet measured on one plan (BENCHMARKS.md, 2026-12-07,
	// seventh). The trajectory is the same, bit for bit. Not saved in
	// checkpoints.
	SpeculateLeave bool `json:"-"`
	// SpeculateGPU, with Speculate, speculates on the streamed GPU
	// subgroups too, during the backward, on the copy engines the
	// backward leaves idle (scheduler.Options.SpeculateGPU): their state
	// H2D, the fused kernel with the same speculative scalars, the new
	// state D2H into a slot of Speculate's memory, which is then pinned
	// whole (14 bytes a parameter, not 6). Kept or undone as the CPU's
	// (StepResult.SpeculatedGPU), the same bits. Off by default: on an
	// H100 at 4.24B under 24 GiB it lost 1 to 2 % (its copies share the
	// host memory the CPU's speculation needs; BENCHMARKS.md, 2026-12-08).
	// Not saved in checkpoints.
	SpeculateGPU bool `json:"-"`
	// Schedule, with Device, forces the split of the subgroups instead of
	// the model's choice: its counts must add up to the subgroups,
	// ceil(parameters / SubgroupSize) without Groups, the sum of each
	// group's ceil(its parameters / SubgroupSize) with them, less the
	// OffloadParam subgroups (CutSizes; len(Optimizer.Subgroups()) after
	// New, less those whose HostHeld is set).
	Schedule *perfmodel.Schedule `json:"-"`
	// Placement, with Device and no Schedule, names a fixed placement
	// instead of the model's choice, resolved by New over the optimizer's
	// subgroups: "cpu", every subgroup on the CPU workers (ZeRO-Offload's
	// placement); "static", as many subgroups resident as GPUBudget holds
	// their state and the rest on the CPU (perfmodel.StaticSplit:
	// ZeRO-Offload++'s and TwinFlow's). "": the model's choice (all on
	// the CPU without a profile). Not saved in checkpoints.
	Placement string `json:"-"`
	// ResidentFirst, with Device, puts the resident subgroups first in
	// the flat space instead of last (scheduler.ResidentFirst: a GPT's
	// first blocks resident, so that OverlapBackward's speculation starts
	// with the backward and the next forward reads its first blocks at
	// the phase's start). Off here; dos train (trainer.TrainConfig) sets
	// it by default, since gpt2-xl under 24 GiB ran 22 % faster with it
	// (issue 31). The update is the same, bit for bit. Not saved in
	// checkpoints.
	ResidentFirst bool `json:"-"`
}

// Group is one parameter group's own hyperparameters (Options.Groups).
type Group struct {
	LR          float64 `json:"lr"`           // learning rate, >= 0
	WeightDecay float64 `json:"weight_decay"` // >= 0, decoupled in mode AdamW
}

// groups returns the parameter groups in effect: Groups, or one group with
// Hyper's lr and weight_decay.
func (o *Options) groups() []Group {
	if len(o.Groups) > 0 {
		return o.Groups
	}
	return []Group{{LR: o.Hyper.LR, WeightDecay: o.Hyper.WeightDecay}}
}

// EnsureDefaults fills zero fields with their defaults and returns o.
// A zero Hyper becomes adam.DefaultHyper().
func (o *Options) EnsureDefaults() *Options {
	if o.Hyper == (adam.Hyper{}) {
		o.Hyper = adam.DefaultHyper()
	}
	if o.SubgroupSize == 0 {
		o.SubgroupSize = DefaultSubgroupSize
	}
	if o.GradDType == 0 {
		o.GradDType = adam.F32
	}
	return o
}

// Validate reports the first invalid option.
//
// Errors: the hyperparameters' (wrapping adam.ErrHyper), a SubgroupSize
// below 1, an unknown dtype, a negative or non-finite MaxGradNorm, or a
// negative Threads.
func (o *Options) Validate() error {
	if err := o.Hyper.Validate(); err != nil {
		return fmt.Errorf("offload: %w", err)
	}
	if o.SubgroupSize < 1 {
		return fmt.Errorf("offload: SubgroupSize %d: want >= 1 element", o.SubgroupSize)
	}
	for _, n := range o.SubgroupSizes {
		if n < 1 {
			return fmt.Errorf("offload: SubgroupSizes %v: want sizes >= 1 element", o.SubgroupSizes)
		}
	}
	if len(o.SubgroupSizes) > 0 && o.Device == nil {
		return errors.New("offload: SubgroupSizes needs a Device")
	}
	switch o.GradDType {
	case adam.F32, adam.BF16, adam.F16:
	default:
		return fmt.Errorf("offload: GradDType %v: want float32, bfloat16 or float16", o.GradDType)
	}
	switch o.WorkingDType {
	case 0, adam.BF16, adam.F16:
	default:
		return fmt.Errorf("offload: WorkingDType %v: want bfloat16, float16 or none", o.WorkingDType)
	}
	if !(o.MaxGradNorm >= 0) || o.MaxGradNorm > 1e38 {
		return fmt.Errorf("offload: MaxGradNorm %v: want a finite value >= 0 (0 disables clipping)", o.MaxGradNorm)
	}
	if o.Threads < 0 {
		return fmt.Errorf("offload: Threads %d: want >= 0 (0 means GOMAXPROCS)", o.Threads)
	}
	for g, grp := range o.Groups {
		h := o.Hyper
		h.LR, h.WeightDecay = grp.LR, grp.WeightDecay
		if err := h.Validate(); err != nil {
			return fmt.Errorf("offload: Groups[%d]: %w", g, err)
		}
	}
	if o.Device != nil && o.WorkingDType == 0 {
		return fmt.Errorf("offload: Device %s needs a 16-bit WorkingDType (the working copy lives in device memory)", o.Device.Name())
	}
	if o.GPUBudget < 0 {
		return fmt.Errorf("offload: GPUBudget %d: want >= 0 bytes", o.GPUBudget)
	}
	if o.Device == nil && (o.Schedule != nil || o.GPUBudget != 0 || len(o.DeviceMasters) > 0 || o.Replan || o.OverlapBackward || len(o.OffloadParam) > 0 || o.ResidentFirst) {
		return errors.New("offload: Schedule, GPUBudget, OffloadParam, DeviceMasters, Replan, OverlapBackward and ResidentFirst need a Device")
	}
	if o.Speculate < 0 {
		return fmt.Errorf("offload: Speculate %d: want bytes >= 0", o.Speculate)
	}
	if o.Speculate > 0 && !o.OverlapBackward {
		return errors.New("offload: Speculate starts the CPU and OffloadParam subgroups' updates during the backward (GradsFinal): it needs OverlapBackward")
	}
	if o.Replan && (o.Schedule != nil || o.Placement != "" || (o.Profile == nil && !o.Calibrate)) {
		return errors.New("offload: Replan corrects the performance model's schedule: it needs Profile or Calibrate, and no forced Schedule or Placement")
	}
	switch {
	case o.Placement != "" && o.Placement != "cpu" && o.Placement != "static":
		return fmt.Errorf("offload: Placement %q: want cpu, static or none", o.Placement)
	case o.Placement != "" && (o.Device == nil || o.Schedule != nil):
		return errors.New("offload: Placement needs a Device, and no forced Schedule")
	}
	return nil
}

// DeviceBytes returns the device memory in bytes that New allocates on
// Options.Device for params parameters (elements) outside GPUBudget: the
// gradients (GradDType) and the 16-bit working copy (WorkingDType), as
// many elements each. The update phase's own memory comes on top, within
// GPUBudget (perfmodel.Workload.GPUMemory of the schedule), and so do
// DeviceMasters' 4 bytes per element, which it does not count. Zero fields
// count with their defaults (GradDType F32).
func (o Options) DeviceBytes(params int) int64 {
	o.EnsureDefaults()
	return int64(params) * int64(o.GradDType.Size()+2)
}

// String formats the options on one line.
func (o Options) String() string {
	s := fmt.Sprintf("%v subgroup_size=%d grad_dtype=%v working_dtype=%v max_grad_norm=%g threads=%d",
		o.Hyper, o.SubgroupSize, o.GradDType, o.WorkingDType, o.MaxGradNorm, o.Threads)
	for g, grp := range o.Groups {
		s += fmt.Sprintf(" group%d(lr=%g weight_decay=%g)", g, grp.LR, grp.WeightDecay)
	}
	return s
}

// SpeculateBytes is the host memory Options.Speculate needs to speculate
// on n parameters (scheduler.SpeculateBytes): 14 bytes a parameter, 18
// with amsgrad.
func SpeculateBytes(n int64, amsgrad bool) int64 { return scheduler.SpeculateBytes(n, amsgrad) }
