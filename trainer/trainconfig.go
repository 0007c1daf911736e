package trainer

import (
	"errors"
	"fmt"
	"math"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/gpt"
	"github.com/deepstates/dos/offload"
)

// TrainConfig configures Train. The flags of `dos train` set these fields;
// the JSON names are theirs too.
type TrainConfig struct {
	Model Config `json:"model"`
	// Tokenizer names the tokenizer of the text and of samples: "byte" or
	// "gpt2" (NewTokenizer; "" is "byte", as in checkpoints that predate
	// the field). Model.VocabSize must hold its tokens: at least its
	// VocabSize, at most that padded to a multiple of 128 (gpt.PadVocab).
	Tokenizer string `json:"tokenizer"`
	// Steps is the iteration to train to (one batch each). A resumed run
	// continues from the checkpoint's iteration up to Steps.
	Steps int `json:"steps"`
	Batch int `json:"batch"` // sequences per iteration (B); each is Model.NCtx tokens long
	// LR is the peak learning rate, reached after WarmupSteps of linear
	// warm-up, then decayed along a cosine to LR*MinLRRatio at DecaySteps
	// and held there (Megatron's --lr-warmup-iters, --lr-decay-iters,
	// --min-lr).
	LR          float64 `json:"lr"`
	MinLRRatio  float64 `json:"min_lr_ratio"`
	WarmupSteps int     `json:"warmup_steps"`
	// DecaySteps is the cosine's horizon in iterations; 0 means Steps. Keep
	// it fixed across a run and its resumptions so the schedule is the same.
	DecaySteps  int        `json:"decay_steps"`
	WeightDecay float64    `json:"weight_decay"`
	Betas       [2]float64 `json:"betas"`
	Eps         float64    `json:"eps"`
	MaxGradNorm float64    `json:"max_grad_norm"` // 0 disables clipping
	// GradDType is the dtype of the gradients handed to the optimizer;
	// WorkingDType that of the copy the forward pass reads (0: the fp32
	// master weights themselves).
	GradDType    adam.DType `json:"grad_dtype"`
	WorkingDType adam.DType `json:"working_dtype"`
	// LossScale, when > 0, is the initial dynamic loss scale, in [1, 2^64]:
	// halved on a step with a non-finite gradient (which the optimizer
	// skips), doubled after ScaleGrowthInterval good steps
	// (torch.amp.GradScaler), and kept within [1, 2^64].
	LossScale    float64 `json:"loss_scale"`
	Seed         uint64  `json:"seed"`
	SubgroupSize int     `json:"subgroup_size"` // elements; 0: offload's default
	// SubgroupSizes, with a Device and no forced counts in Schedule, are
	// candidates the performance model chooses the subgroup size from
	// (offload.Options.SubgroupSizes; dos train --device cuda without
	// --subgroup-size: 1e8, 5e7, 2.5e7). Not saved in checkpoints: the
	// state does not depend on the cut.
	SubgroupSizes []int  `json:"-"`
	Threads       int    `json:"threads"`    // optimizer goroutines, 0..MaxThreads(); 0: GOMAXPROCS
	CkptDir       string `json:"ckpt_dir"`   // "" disables checkpoints
	CkptEvery     int    `json:"ckpt_every"` // iterations between checkpoints (and one at the end)
	// CkptSync writes checkpoints synchronously (checkpoint.Save) instead
	// of handing them to the lazy engine (checkpoint.Engine), which
	// captures the state while training goes on and flushes it in the
	// background.
	CkptSync bool `json:"ckpt_sync"`
	// CkptRing is the lazy checkpointer's staging memory between capture
	// and flush, in GiB (--ckpt-ring; checkpoint.EngineOptions.RingBytes);
	// 0: two copies of the state, at most 256 MiB. The step after a save
	// waits for the capture of the state it writes on the host (the CPU
	// and streamed subgroups'); a ring that holds it lets the capture run
	// at memory speed instead of the disk's. Not saved in checkpoints.
	CkptRing float64 `json:"-"`
	CkptKeep int     `json:"ckpt_keep"` // keep the newest N checkpoints (0: all)
	// Profile is a dos calibrate profile of this machine: the optimizer
	// plans its update phase with it, and the summary compares the
	// predicted update time with the measured one. "" for none.
	Profile string `json:"profile"`
	// Device is where training runs. "" keeps everything on the host.
	// "cuda" trains on GPU 0: forward and backward run there
	// (internal/gptcuda, bf16), reading the optimizer's device working
	// copy and writing its device gradients, and the update phase runs
	// through the interleaved engine with the optimizer state in pinned
	// host memory; it needs bf16 --working-dtype and --grad-dtype. "sim"
	// keeps forward and backward on the host and runs the update phase on
	// the simulated device (a test of the engine): the gradients are
	// uploaded and the working copy downloaded around each step.
	Device string `json:"device"`
	// GPUs is the ranks of ZeRO-3 data parallelism (0 or 1: one): each
	// holds 1/GPUs of every tensor and of its optimizer state and runs
	// forward and backward on Batch/GPUs rows, the working copy
	// all-gathered and the gradients reduce-scattered between them. The
	// ranks run in this process, one goroutine each. On the host or
	// Device "sim" (zero.go) over an in-process communicator
	// (internal/comm's Local); with Device "cuda" (zerogpu.go) rank r on
	// GPU r, over NCCL (or Collectives "staged"). Checkpoints: each rank
	// saves its pieces into CkptDir/rank-%05d (lazily, each rank its own
	// engine, or with CkptSync synchronously, the ranks in parallel) and
	// the job commits a step in CkptDir's latest once all are durable
	// (checkpoint.CommitJob); a resume needs the same GPUs, and Reshard
	// cuts a checkpoint for another number.
	GPUs int `json:"gpus,omitempty"`
	// Collectives, with Device "cuda", is how the GPU ranks all-gather and
	// reduce-scatter: "" or "nccl", NCCL between GPUs 0..GPUs-1 (one rank
	// per GPU; with one rank nothing to do); "staged", with GPUs > 1,
	// through pinned host memory
	// and an in-process communicator (nccl.Staged), rank r on GPU r mod
	// the GPUs there are: several ranks may share one GPU, slowly (how
	// the sharded GPU iteration is tested on one GPU). The trajectory is
	// the same within bf16 rounding. Not saved in checkpoints.
	Collectives string `json:"-"`
	// Recompute, with Device "cuda", keeps only each block's input through
	// forward and recomputes the block in backward (gptcuda's
	// Options.Recompute): for when the activations do not fit.
	Recompute bool `json:"recompute,omitempty"`
	// StreamBlocks, with Device "cuda" on one GPU, is how many
	// transformer blocks, the first ones, keep their matrices and biases
	// (their bf16 working copy and gradients) in pinned host memory
	// instead of device memory (offload.Options.OffloadParam, DeepSpeed
	// ZeRO-Infinity's offload_param): each such block is copied H2D into
	// one of two block slots before its forward and again before its
	// backward, overlapped with the previous block's compute, and its
	// gradients go D2H as its backward ends; the CPU workers update them
	// in place. StreamAuto (-1): none when the run fits GPUMemory (less
	// CapMargin) or there is no cap, else the count whose update phase
	// the performance model predicts fastest once the run has a profile
	// (StreamSweep), and before that (Validate, dos plan without one)
	// the fewest that leave the update phase StreamReserve, else the
	// fewest that fit (Streamed). The trajectory is the same, bit for
	// bit. Not saved in checkpoints.
	StreamBlocks int `json:"-"`
	// streamModel is StreamAuto's count chosen by the performance model
	// for streamKey (ChooseStreamed), set once the run has a profile; 0
	// before. A copy at another batch, cap or model does not take it.
	streamModel int
	streamKey   streamKey
	// NoOverlap, with Device "cuda", turns off what the update phase does
	// during backward (offload.Options.OverlapBackward: the CPU subgroups'
	// gradients move to the host as their blocks' backward ends, and the
	// first streamed subgroups' state to the device): for comparison; the
	// trajectory is the same, bit for bit.
	NoOverlap bool `json:"no_overlap,omitempty"`
	// NoOverlapForward runs each iteration's forward after the last
	// update phase has ended. By default the next iteration's forward
	// runs during the update phase, each block once its weights are
	// written (offload.Optimizer.StepAsync and WaitParams; on a GPU
	// replica that waits per block, not in a ZeRO-3 job), except where
	// an evaluation, a checkpoint or the traced iteration comes between:
	// for comparison; the trajectory is the same, bit for bit. Not
	// saved in checkpoints.
	NoOverlapForward bool `json:"-"`
	// ResidentFirst, with a Device, puts the resident subgroups at the
	// front of the flat space, the first blocks, instead of the last
	// (offload.Options.ResidentFirst): the speculation starts with the
	// backward, and the next forward finds its first blocks updated at
	// the update phase's start. On by default (DefaultTrainConfig; gpt2-xl
	// under 24 GiB on an H100 ran 22 % faster with it, BENCHMARKS.md,
	// issue 31); without a Device (no resident subgroups) it does nothing.
	// The trajectory is the same, bit for bit. Not saved in checkpoints.
	ResidentFirst bool `json:"-"`
	// Speculate, with Device "cuda" on one GPU and the overlap (not
	// NoOverlap), is host memory in GiB for speculative updates
	// (offload.Options.Speculate): the streamed blocks' subgroups and the
	// CPU subgroups updated by the CPU workers during the backward, as
	// their gradients arrive, out of place into slots of this memory, kept
	// when the step neither clips nor is skipped, undone otherwise; 14
	// bytes per parameter speculated on,
	// at most the model's. 0: none. SpeculateAuto (-1, the default):
	// SpeculateAutoGiB, or less where the host memory the run may use
	// leaves less (resolveSpeculate: half of what MemoryBytes leaves of
	// it, counted when Validate runs and again once --stream-blocks
	// auto's count is chosen; none before Validate or where the run may
	// not speculate). The trajectory is the same, bit for bit. Not saved
	// in checkpoints.
	Speculate float64 `json:"-"`
	// SpeculateLeave, with Speculate, has the speculation leave every
	// other CPU subgroup of the model's last blocks to the update phase
	// once the iteration is planned (offload.Options.SpeculateLeave):
	// about what the CPU updates while the next forward runs the blocks
	// after the phase's own CPU work, so that the CPU works beside that
	// forward. Off by default until measured on one plan; the trajectory
	// is the same, bit for bit. Not saved in checkpoints.
	SpeculateLeave bool `json:"-"`
	// SpeculateGPU, with Speculate, speculates on the streamed GPU
	// subgroups too (offload.Options.SpeculateGPU). Off by default.
	SpeculateGPU bool `json:"-"`
	// specAuto is SpeculateAuto's bytes (resolveSpeculate).
	specAuto int64
	// Replan, with a Device and the performance model's schedule
	// (--profile, or the start-up calibration with cuda; not --schedule),
	// corrects the model online from every update phase's measured times
	// and re-plans the schedule when its prediction misses by more than
	// 10 % (offload.Options.Replan); the log says each re-plan, and
	// --log-json records carry the predicted and measured update phase.
	Replan bool `json:"replan,omitempty"`
	// BF16Params, with Device "cuda", makes forward and backward read
	// every parameter from the bf16 working copy (llm.c's recipe). By
	// default the embedding lookup and the LayerNorms read fp32 master
	// weights that the optimizer keeps on the device
	// (offload.Options.DeviceMasters), as PyTorch's bf16 autocast reads
	// them: in the oracle's comparison (bench/gpt2_check.sh) the bf16
	// recipe drifted ten times as far from PyTorch as PyTorch from itself.
	BF16Params bool `json:"bf16_params,omitempty"`
	// LogJSON, when set, is a file that gets one JSON line per
	// optimizer step (stepRecord: step, loss, lr, grad_norm, skipped, pos,
	// seconds, update_s), appended to. Not saved in checkpoints.
	LogJSON string `json:"-"`
	// GPUBudget is the device memory in GiB the update phase may use
	// (resident state and staging); 0 means DefaultGPUBudget, or, with
	// Device "cuda", what the model's activations leave (less the
	// gradients, the working copy and a 2 GiB margin).
	GPUBudget float64 `json:"gpu_budget_gib"`
	// GPUMemory, with Device "cuda", caps in GiB all the device memory dos
	// allocates (weights, gradients, fp32 masters, activations, cuBLASLt's
	// workspace, the update phase: cuda.SetMemoryLimit), so that a large
	// GPU stands in for a smaller one; the update phase's default budget
	// is then what the cap leaves (less 256 MiB). 0: no cap. Not saved in
	// checkpoints.
	GPUMemory float64 `json:"-"`
	// TimelineAt traces that iteration (1-based; 0: none): Trainer.Timeline
	// then returns its forward, backward, step and update-phase operations
	// and the GPU memory along it (dos train --timeline). The traced
	// iteration waits for the device after forward. Not saved in
	// checkpoints.
	TimelineAt int `json:"-"`
	// MaxMemory is the host memory in GiB the run may use (--max-memory):
	// Validate refuses a configuration whose MemoryBytes exceeds it. 0
	// means the memory available when Validate runs (MemAvailable in
	// /proc/meminfo; where the system does not say, only MaxMemoryBytes
	// bounds it). At most MaxMemoryBytes.
	MaxMemory float64 `json:"max_memory_gib"`
	// Schedule forces the device's split: "CPU,GPU,RESIDENT" subgroup
	// counts; "cpu", every subgroup on the CPU (ZeRO-Offload's
	// placement); or "static", as many subgroups resident as the update
	// phase's budget holds and the rest on the CPU (perfmodel.StaticSplit,
	// ZeRO-Offload++'s and TwinFlow's; offload.Options.Placement). "" leaves it to the performance
	// model (with a profile or, on cuda, the start-up calibration), else
	// offload.MixedSchedule.
	Schedule    string  `json:"schedule"`
	Resume      bool    `json:"resume"`       // continue from CkptDir's latest checkpoint
	EvalEvery   int     `json:"eval_every"`   // iterations between validation losses (0: only at the start and the end)
	EvalBatches int     `json:"eval_batches"` // batches of the validation split per evaluation
	LogEvery    int     `json:"log_every"`    // iterations between plain progress lines
	SampleBytes int     `json:"sample_bytes"` // bytes of text generated at the end (GPT-2: tokens until that many bytes, at most that many tokens)
	ValFraction float64 `json:"val_fraction"` // tail of the text held out for validation
}

// horizon is the iteration the cosine schedule decays to MinLRRatio at:
// DecaySteps, or Steps when DecaySteps is 0.
func (c TrainConfig) horizon() int {
	if c.DecaySteps > 0 {
		return c.DecaySteps
	}
	return c.Steps
}

// ScaleGrowthInterval is how many consecutive good steps double the dynamic
// loss scale (torch.amp.GradScaler's growth_interval).
const ScaleGrowthInterval = 2000

// DefaultTrainConfig is the main job's default: a 4-layer byte-level GPT
// that trains on 2 cores in about a minute.
func DefaultTrainConfig() TrainConfig {
	return TrainConfig{
		Model:       Config{VocabSize: VocabSize, NCtx: 64, NLayer: 4, NHead: 4, NEmbd: 128},
		Tokenizer:   "byte",
		Steps:       150,
		Batch:       16,
		LR:          3e-3,
		MinLRRatio:  0.1,
		WarmupSteps: 30,
		WeightDecay: 0.1,
		Betas:       [2]float64{0.9, 0.95},
		Eps:         1e-8,
		MaxGradNorm: 1,
		GradDType:   adam.F32,
		Seed:        1337,
		CkptEvery:   50,
		EvalEvery:   25,
		EvalBatches: 8,
		LogEvery:    10,
		SampleBytes: 200,
		ValFraction: 0.1,
		// As few streamed blocks as --gpu-memory needs (none without).
		StreamBlocks: StreamAuto,
		// Issue 31's: the forward reads its first blocks' resident
		// weights at the phase's start, and the CPU updates during the
		// backward where no step clips (both change no bit).
		ResidentFirst: true,
		Speculate:     SpeculateAuto,
	}
}

// Validate reports the first invalid field, named by the `dos train` flag
// that sets it (--heads, --threads, ...; Model.VocabSize, which no flag
// sets (dos train derives it from --tokenizer), by its config.json name),
// with its value and what is allowed.
//
// Last it compares MemoryBytes with the memory the run may use: MaxMemory
// GiB, or, when that is 0, the memory available now (MemAvailable in
// /proc/meminfo, the one thing Validate reads from the system; skipped
// where the system does not say), and never more than MaxMemoryBytes. So a
// run too large for the machine is refused before anything is allocated.
// Before that, a run on one GPU under GPUMemory whose weights, gradients
// and activations alone are over the cap (DeviceMemory) is refused too,
// naming what would fit.
func (c *TrainConfig) Validate() error {
	m := c.Model
	switch {
	case m.NLayer < 1 || m.NLayer > MaxNLayer:
		return fmt.Errorf("trainer: --layers %d: want 1..%d", m.NLayer, MaxNLayer)
	case m.NEmbd < 1 || m.NEmbd > MaxNEmbd:
		return fmt.Errorf("trainer: --embd %d: want 1..%d", m.NEmbd, MaxNEmbd)
	case m.NHead < 1 || m.NEmbd%m.NHead != 0:
		return fmt.Errorf("trainer: --heads %d must divide --embd %d", m.NHead, m.NEmbd)
	case m.NCtx < 1 || m.NCtx > MaxNCtx:
		return fmt.Errorf("trainer: --ctx %d: want 1..%d", m.NCtx, MaxNCtx)
	}
	if err := c.checkVocab(); err != nil {
		return err
	}
	if err := m.Validate(); err != nil { // passes after the checks above; kept so the two cannot drift apart
		return err
	}
	for _, f := range []struct {
		flag   string
		v, lo  int
		hi     int // math.MaxInt: no upper bound here (MemoryBytes bounds --batch)
		suffix string
	}{
		{"--steps", c.Steps, 0, math.MaxInt, " (0: save the initial weights' checkpoint and stop)"},
		{"--batch", c.Batch, 1, math.MaxInt, ""},
		{"--warmup", c.WarmupSteps, 0, math.MaxInt, ""},
		{"--decay-steps", c.DecaySteps, 0, math.MaxInt, " (0: --steps)"},
		{"--subgroup-size", c.SubgroupSize, 0, math.MaxInt, " elements (0: the default)"},
		{"--threads", c.Threads, 0, MaxThreads(), " (0: GOMAXPROCS; at most 4 × the CPUs, as more workers only time-share them)"},
		{"--ckpt-every", c.CkptEvery, 0, math.MaxInt, ""},
		{"--ckpt-keep", c.CkptKeep, 0, math.MaxInt, " (0: keep all)"},
		{"--eval-every", c.EvalEvery, 0, math.MaxInt, ""},
		{"--eval-batches", c.EvalBatches, 0, 1 << 16, ""},
		{"--log-every", c.LogEvery, 0, math.MaxInt, ""},
		{"--sample", c.SampleBytes, 0, 1 << 20, " bytes"},
	} {
		if f.v < f.lo || f.v > f.hi {
			want := fmt.Sprintf(">= %d", f.lo)
			if f.hi != math.MaxInt {
				want = fmt.Sprintf("%d..%d", f.lo, f.hi)
			}
			return fmt.Errorf("trainer: %s %d: want %s%s", f.flag, f.v, want, f.suffix)
		}
	}
	switch {
	case !(c.LR > 0) || math.IsInf(c.LR, 0):
		return fmt.Errorf("trainer: --lr %v: want a finite value > 0", c.LR)
	case !(c.MinLRRatio >= 0 && c.MinLRRatio <= 1):
		return fmt.Errorf("trainer: --min-lr-ratio %v: want a value in [0, 1]", c.MinLRRatio)
	case !(c.Betas[0] >= 0 && c.Betas[0] < 1):
		return fmt.Errorf("trainer: --beta1 %v: want a value in [0, 1)", c.Betas[0])
	case !(c.Betas[1] >= 0 && c.Betas[1] < 1):
		return fmt.Errorf("trainer: --beta2 %v: want a value in [0, 1)", c.Betas[1])
	case !(c.Eps > 0) || math.IsInf(c.Eps, 0) || float32(c.Eps) == 0 || math.IsInf(float64(float32(c.Eps)), 0):
		return fmt.Errorf("trainer: --eps %v: want a finite value > 0 that stays so in fp32 (>= 1e-45)", c.Eps)
	case !(c.WeightDecay >= 0) || math.IsInf(c.WeightDecay, 0):
		return fmt.Errorf("trainer: --weight-decay %v: want a finite value >= 0", c.WeightDecay)
	case !(c.MaxGradNorm >= 0) || c.MaxGradNorm > 1e38:
		return fmt.Errorf("trainer: --clip %v: want a finite value >= 0 (0: off)", c.MaxGradNorm)
	case c.LossScale != 0 && !validScale(c.LossScale):
		return fmt.Errorf("trainer: --loss-scale %v: want 0 (off) or an initial scale in [1, 2^64]", c.LossScale)
	case c.GradDType == 0:
		return errors.New("trainer: --grad-dtype none: the gradients need a dtype: float32, bfloat16 or float16")
	case c.GradDType != adam.F32 && c.GradDType != adam.BF16 && c.GradDType != adam.F16:
		return fmt.Errorf("trainer: --grad-dtype %v: want float32, bfloat16 or float16", c.GradDType)
	case c.WorkingDType != 0 && c.WorkingDType != adam.BF16 && c.WorkingDType != adam.F16:
		return fmt.Errorf("trainer: --working-dtype %v: want bfloat16, float16 or none", c.WorkingDType)
	case !(c.MaxMemory >= 0) || c.MaxMemory > MaxMemoryBytes>>30:
		return fmt.Errorf("trainer: --max-memory %v GiB: want 0 (the available memory) to %d", c.MaxMemory, MaxMemoryBytes>>30)
	case c.Resume && c.CkptDir == "":
		return errors.New("trainer: --resume needs --ckpt-dir")
	case c.Device != "" && c.Device != "sim" && c.Device != "cuda":
		return fmt.Errorf("trainer: --device %q: want sim or cuda (or none: the host)", c.Device)
	case c.Device != "" && c.WorkingDType == 0:
		return fmt.Errorf("trainer: --device %s needs a 16-bit --working-dtype (the working copy lives on the device)", c.Device)
	case c.Device == "cuda" && (c.WorkingDType != adam.BF16 || c.GradDType != adam.BF16):
		return fmt.Errorf("trainer: --device cuda trains in bf16: --working-dtype %v --grad-dtype %v, want bfloat16 for both", c.WorkingDType, c.GradDType)
	case c.Recompute && c.Device != "cuda":
		return errors.New("trainer: --recompute needs --device cuda (the host's model keeps its activations)")
	case c.NoOverlap && c.Device != "cuda":
		return errors.New("trainer: --no-overlap needs --device cuda (only the GPU trainer overlaps its backward with the update phase)")
	case c.Speculate != SpeculateAuto && (!(c.Speculate >= 0) || c.Speculate > MaxMemoryBytes>>30):
		return fmt.Errorf("trainer: --speculate %v: want GiB from 0 to %d, or auto", c.Speculate, MaxMemoryBytes>>30)
	case c.Speculate > 0 && !c.maySpeculate():
		return errors.New("trainer: --speculate updates the CPU's subgroups during the backward: it needs --device cuda on one GPU, and not --no-overlap")
	case c.SpeculateGPU && (c.Speculate == 0 || !c.maySpeculate()):
		return errors.New("trainer: --speculate-gpu speculates on the GPU's streamed subgroups with --speculate's slots: it needs --speculate (GiB or auto) with --device cuda on one GPU, and not --no-overlap")
	case c.Replan && (c.Device == "" || c.Schedule != ""):
		return errors.New("trainer: --replan corrects the performance model's schedule: it needs --device, and no --schedule")
	case c.Replan && c.Device == "sim" && c.Profile == "":
		return errors.New("trainer: --replan with --device sim needs --profile (the simulated device is not calibrated)")
	case c.BF16Params && c.Device != "cuda":
		return errors.New("trainer: --bf16-params needs --device cuda (the host's model reads the fp32 master weights)")
	case c.Device == "" && (c.Schedule != "" || c.GPUBudget != 0):
		return errors.New("trainer: --schedule and --gpu-budget need --device")
	case !(c.GPUBudget >= 0) || c.GPUBudget > 1<<20:
		return fmt.Errorf("trainer: --gpu-budget %v GiB: want 0 to %d", c.GPUBudget, 1<<20)
	case !(c.CkptRing >= 0) || c.CkptRing > MaxMemoryBytes>>30:
		return fmt.Errorf("trainer: --ckpt-ring %v GiB: want 0 (the default) to %d", c.CkptRing, MaxMemoryBytes>>30)
	case c.CkptRing > 0 && (c.CkptDir == "" || c.CkptSync):
		return errors.New("trainer: --ckpt-ring sizes the lazy checkpointer's ring: it needs --ckpt-dir, and no --ckpt-sync")
	case c.GPUs < 0 || c.GPUs > checkpoint.MaxWorldSize:
		return fmt.Errorf("trainer: --gpus %d: want 0..%d (0 or 1: one rank)", c.GPUs, checkpoint.MaxWorldSize)
	case c.GPUs > 1 && c.Threads > 0 && c.GPUs*c.Threads > MaxThreads():
		return fmt.Errorf("trainer: --gpus %d --threads %d: the ranks' workers (threads per rank) would be %d, over %d (4 × the CPUs)", c.GPUs, c.Threads, c.GPUs*c.Threads, MaxThreads())
	case c.validateRanks() != nil:
		return c.validateRanks()
	case c.TimelineAt < 0:
		return fmt.Errorf("trainer: --timeline-at %d: want an iteration from 1 (0: none)", c.TimelineAt)
	case c.GPUs > 1 && c.TimelineAt != 0:
		return fmt.Errorf("trainer: --gpus %d: --timeline draws one rank's update phase, not built for several yet", c.GPUs)
	case !(c.GPUMemory >= 0) || c.GPUMemory > 1<<20:
		return fmt.Errorf("trainer: --gpu-memory %v GiB: want 0 to %d", c.GPUMemory, 1<<20)
	case c.GPUMemory != 0 && c.Device != "cuda":
		return errors.New("trainer: --gpu-memory caps the GPU's memory: it needs --device cuda")
	case c.GPUMemory != 0 && c.GPUBudget > c.GPUMemory:
		return fmt.Errorf("trainer: --gpu-budget %v GiB is over --gpu-memory %v GiB", c.GPUBudget, c.GPUMemory)
	case c.StreamBlocks < StreamAuto || c.StreamBlocks > m.NLayer:
		return fmt.Errorf("trainer: --stream-blocks %d: want 0..%d (--layers), or auto", c.StreamBlocks, m.NLayer)
	case c.StreamBlocks > 0 && c.Device != "cuda":
		return fmt.Errorf("trainer: --stream-blocks %d streams blocks' weights from host memory to the GPU: it needs --device cuda", c.StreamBlocks)
	case c.StreamBlocks > 0 && c.GPUs > 1:
		return fmt.Errorf("trainer: --stream-blocks %d with --gpus %d: streaming blocks' weights is built for one GPU only, not yet for ZeRO-3's ranks", c.StreamBlocks, c.GPUs)
	}
	if c.Schedule != "" && c.Schedule != "cpu" && c.Schedule != "static" {
		s, err := offload.ParseSchedule(c.Schedule)
		if err != nil {
			return fmt.Errorf("trainer: --schedule: %w (or cpu, or static)", err)
		}
		if n := c.subgroups(); s.CPU+s.GPU+s.Resident != n {
			return fmt.Errorf("trainer: --schedule %s: %d subgroups, but the model's %d parameters in subgroups of %d make %d (forced counts take --subgroup-size as given, not the performance model's choice of it)", c.Schedule, s.CPU+s.GPU+s.Resident, c.paramCount(), c.optimizerOptions().SubgroupSize, n)
		}
	}
	if err := c.optimizerOptions().Validate(); err != nil { // passes after the checks above
		return fmt.Errorf("trainer: %w", err)
	}
	c.resolveSpeculate()
	return c.checkMemory()
}

// checkVocab checks Tokenizer and that Model.VocabSize holds its tokens
// (see TrainConfig.Tokenizer).
func (c *TrainConfig) checkVocab() error {
	tok, err := NewTokenizer(c.Tokenizer)
	if err != nil {
		return err
	}
	v, lo, hi := c.Model.VocabSize, tok.VocabSize(), gpt.PadVocab(tok.VocabSize())
	if v < lo || v > hi {
		want := fmt.Sprint(lo)
		if hi != lo {
			want = fmt.Sprintf("%d..%d", lo, hi)
		}
		return fmt.Errorf("trainer: vocab_size %d does not fit --tokenizer %s's %d tokens: want %s (dos train sets %d, the tokenizer's vocabulary padded to a multiple of 128, as --model's presets have it for gpt2)",
			v, tok.Name(), lo, want, hi)
	}
	return nil
}

// checkMemory compares MemoryBytes with the memory the run may use (see
// Validate).
func (c *TrainConfig) checkMemory() error {
	const gib = 1 << 30
	if err := c.checkDeviceMemory(); err != nil {
		return err
	}
	need := c.MemoryBytes()
	limit, over, advice := c.hostLimit()
	if need > limit {
		ring := ""
		if c.CkptRing > 0 {
			ring = fmt.Sprintf(" --ckpt-ring %g", c.CkptRing)
		}
		return fmt.Errorf("trainer: --layers %d --embd %d --ctx %d --batch %d%s need about %.3g GiB of memory (parameters, optimizer state, activations%s), over %s: make the model or --batch%s smaller%s",
			c.Model.NLayer, c.Model.NEmbd, c.Model.NCtx, c.Batch, ring, need/gib, map[bool]string{true: ", the checkpoint ring", false: ""}[ring != ""], over, map[bool]string{true: " or --ckpt-ring", false: ""}[ring != ""], advice)
	}
	return nil
}

// hostLimit returns the host memory in bytes the run may use (MaxMemory,
// else MemAvailable, never more than MaxMemoryBytes), what that limit is
// for checkMemory's message, and its advice on raising it.
func (c *TrainConfig) hostLimit() (limit float64, what, advice string) {
	const gib = 1 << 30
	limit, what = float64(MaxMemoryBytes), fmt.Sprintf("dos's limit of %d GiB", MaxMemoryBytes>>30)
	if c.MaxMemory > 0 {
		limit, what = c.MaxMemory*gib, fmt.Sprintf("--max-memory %g GiB", c.MaxMemory)
		advice = fmt.Sprintf(", or raise --max-memory (at most %d GiB)", MaxMemoryBytes>>30)
	} else if avail, ok := memAvailable(); ok && float64(avail) < limit {
		limit, what = float64(avail), fmt.Sprintf("the %.1f GiB available (MemAvailable in /proc/meminfo)", float64(avail)/gib)
		advice = fmt.Sprintf(", or pass --max-memory GiB (at most %d) to allow more than is available now", MaxMemoryBytes>>30)
	}
	return limit, what, advice
}

// MaxMemoryBytes bounds MemoryBytes: a configuration that needs more is
// refused before anything is allocated, whatever MaxMemory says. It is a
// bound on absurd configurations (1 TiB), not on a machine's memory: that
// is MemAvailable's or --max-memory's to say. (It was 64 GiB until a 4.2B
// GPT-2 on the 128 GiB GPU machine, estimated then at 79 GiB of host
// memory with --device cuda, was refused.)
const MaxMemoryBytes = 1 << 40

// MemoryBytes estimates the bytes of host memory a run allocates, in
// float64 so that no product overflows:
//
//   - per parameter: the fp32 master weights and moments (12 B), the
//     gradients (4 B in fp32, 2 B in 16 bits), the 16-bit working copy
//     (2 B, if any), the trainer's fp32 copies of 16-bit gradients and of a
//     16-bit working copy (4 B each): 16 B with fp32 gradients and no
//     working copy, 24 B with bf16 gradients and working copy;
//   - the initial weights' buffers New draws them into, a window of
//     tensors at a time: in fp32, the whole model's when it has at most
//     64M parameters, else two windows of max(64M, V*C, 4C²) floats;
//   - the activations of one batch, llm.c's count of about
//     L*(16C + H*T) + 13C + 2V + max(4C, V) floats per position, the
//     transposed-weight buffer (max(4C², VC) floats) and one attention
//     scratch (3T² + 4TC/H floats) per goroutine of the model (GOMAXPROCS,
//     at most B*H);
//   - the lazy checkpoint engine's staging ring (two copies of the 16 B of
//     state per parameter, at most 256 MiB) when CkptDir is set without
//     CkptSync.
//
// With GPUs N > 1 (on the host or "sim") the pieces of the N optimizers add
// up to one model's state, and each rank adds its fp32 replica of the
// parameters and gradients (8N B per parameter; no fp32 copies beside
// them), and the activations are N models' of Batch/N rows (which
// evaluate too), and rank 0's sampler of one row when the run samples.
//
// With Device "cuda" the activations are on the GPU and there are no fp32
// copies: 14 B per parameter (the state and the working copy's host
// mirror; the gradients stay on the device, and the optimizer makes no
// host buffers for them: offload.Optimizer.Grad), 16 with the overlap
// with backward (the CPU subgroups' gradients in pinned memory of their
// own, counted for every parameter), the initial weights' buffers and the
// ring.
//
// What New allocates (runtime.MemStats.TotalAlloc) is within 1 % of it
// (TestMemoryBytesMeasured); the peak RSS of `dos train` on the 2-core
// development machine was 9 % below to 2 % above it, from 0.8 to 2.4 GiB,
// for parameter-bound and activation-bound models in fp32 and bf16.
func (c *TrainConfig) MemoryBytes() float64 {
	m := c.Model
	L, C, H, T, V := float64(m.NLayer), float64(m.NEmbd), float64(m.NHead), float64(m.NCtx), float64(m.VocabSize)
	params := V*C + T*C + L*(12*C*C+13*C) + 2*C
	perParam := 12.0 // master, moments
	if c.GradDType == adam.F32 {
		perParam += 4
	} else {
		perParam += 2 + 4 // 16-bit gradients and the trainer's fp32 ones
	}
	if c.WorkingDType != 0 {
		perParam += 2 + 4 // 16-bit working copy and the trainer's fp32 one
	}
	perPos := L*(16*C+H*T) + 13*C + 2*V + math.Max(4*C, V)
	model := func(batch float64) float64 { // one Model's floats for batch rows
		return perPos*batch*T + math.Max(4*C*C, V*C) + math.Min(float64(workers()), batch*H)*(3*T*T+4*T*C/H)
	}
	floats := model(float64(c.Batch))
	if n := float64(c.GPUs); c.GPUs > 1 && c.Device != "cuda" {
		// ZeRO-3 ranks (hostGathered): the optimizers' pieces add up to
		// one model's state (12 B), gradients (4 B, or 2 in 16 bits) and
		// 16-bit working copy (2 B, if any); each rank's fp32 replica of
		// the parameters and gradients is 8N B; N models of Batch/N rows,
		// and rank 0's sampler.
		perParam = 12 + 4 + 8*n
		if c.GradDType != adam.F32 {
			perParam -= 2
		}
		if c.WorkingDType != 0 {
			perParam += 2
		}
		floats = n * model(float64(c.Batch)/n)
		if c.SampleBytes > 0 {
			floats += model(1)
		}
	}
	if c.Device == "cuda" {
		// The GPU holds the activations and reads the 16-bit copies
		// itself: no fp32 copies on the host, and the gradients stay on
		// the device (GradOnDevice: no host gradient buffers).
		perParam, floats = 12+2, 0
		if !c.NoOverlap {
			perParam += 2
		}
	}
	// Streamed blocks' gradients and working copy in pinned host memory
	// (offload.Options.OffloadParam), 2 + 2 bytes a parameter.
	floats += float64(c.Streamed() * blockStreamedElems(c.Model)) // 4 bytes each, as a float
	floats += float64(initBufferElems(c.Model))                   // the initial weights' windows (New)
	floats += float64(c.speculateBytes()) / 4                     // the speculation's slots
	ring := 0.0
	if c.CkptDir != "" && !c.CkptSync {
		ring = c.ringBytes(params)
		if c.GPUs > 1 { // a lazy engine per rank
			ring = float64(c.GPUs) * c.rankRingBytes(params, c.GPUs)
		}
	}
	return perParam*params + 4*floats + ring
}

// maySpeculate says whether the run may speculate (Speculate): the GPU
// trainer on one GPU, with the overlap with backward.
func (c *TrainConfig) maySpeculate() bool { return c.Device == "cuda" && c.GPUs <= 1 && !c.NoOverlap }

// speculateBytes is offload.Options.Speculate for the run: Speculate GiB,
// at most what every parameter needs (scheduler.SpeculateBytes, 14 B
// each); 0 off one GPU or without the overlap.
func (c *TrainConfig) speculateBytes() int64 {
	if c.Speculate == SpeculateAuto && c.maySpeculate() {
		return c.specAuto
	}
	if c.Speculate <= 0 || !c.maySpeculate() {
		return 0
	}
	return min(int64(c.Speculate*(1<<30)), offload.SpeculateBytes(int64(c.Model.NumParams()), false)) // the trainer's AdamW has no amsgrad
}

// SpeculateAuto is TrainConfig.Speculate's auto (--speculate auto):
// SpeculateAutoGiB of host memory for speculative updates, or what the
// host memory the run may use leaves (resolveSpeculate).
const SpeculateAuto = -1

// SpeculateAutoGiB is SpeculateAuto's most host memory, in GiB: the slots
// of about 1.8B parameters' new state. On a 4.24B GPT-2 (36 x 3072, B =
// 8, T = 1024) on an H100 host, 24 GiB was 4 % faster than 16 under 24
// GiB, blocks streamed, and 16 5 % faster than 12 under 40 GiB, where 16
// GiB of slots were full 123 ms before the backward ended (the slots, not
// the backward, limit what the CPU workers update in it since the
// updates run out of place: BENCHMARKS.md, issue 31, 2026-12-07's fifth
// session; 24 under 40 GiB is not measured yet).
const SpeculateAutoGiB = 24

// resolveSpeculate sets SpeculateAuto's bytes (specAuto): at most
// SpeculateAutoGiB and what every parameter needs, and at most half of
// what MemoryBytes, without them, leaves of the host memory the run may
// use (hostLimit); nothing where that half is under both 256 MiB and what
// every parameter needs, nor where the run may not speculate. Validate
// calls it, and again the GPU trainer once --stream-blocks auto's count
// is chosen (StreamSweep leaves the slots out).
func (c *TrainConfig) resolveSpeculate() {
	c.specAuto = 0
	if c.Speculate != SpeculateAuto || !c.maySpeculate() {
		return
	}
	limit, _, _ := c.hostLimit()
	room := (limit - c.MemoryBytes()) / 2 // MemoryBytes counts specAuto, 0 here
	b := min(int64(SpeculateAutoGiB)<<30, offload.SpeculateBytes(int64(c.Model.NumParams()), false))
	if room < float64(b) {
		b = int64(max(room, 0))
		if b < 256<<20 {
			b = 0 // too little host memory to spare
		}
	}
	c.specAuto = b
}

// ringBytes is the lazy checkpointer's ring for params parameters:
// CkptRing GiB, or two copies of the 16 B of state per parameter, at most
// 256 MiB; at least two chunks, in whole chunks.
func (c *TrainConfig) ringBytes(params float64) float64 { return c.rankRingBytes(params, 1) }

// validateRanks checks what TrainConfig.GPUs asks of the rest of the
// configuration (the batch, the dtypes, the device, the schedule): what a
// checkpoint re-sharded for GPUs ranks must also pass (Reshard).
func (c *TrainConfig) validateRanks() error {
	switch {
	case c.Collectives != "" && c.Collectives != "nccl" && c.Collectives != "staged":
		return fmt.Errorf("trainer: --collectives %q: want nccl or staged", c.Collectives)
	case c.Collectives != "" && c.Device != "cuda":
		return fmt.Errorf("trainer: --collectives %s picks how GPU ranks communicate: it needs --device cuda (and --gpus 2 or more)", c.Collectives)
	case c.Collectives == "staged" && c.GPUs < 2:
		return errors.New("trainer: --collectives staged moves the collectives of several GPU ranks through host memory: it needs --gpus 2 or more")
	case c.GPUs > 1 && c.Batch%c.GPUs != 0:
		return fmt.Errorf("trainer: --batch %d is not a multiple of --gpus %d (each rank trains on batch/gpus rows)", c.Batch, c.GPUs)
	case c.GPUs > 1 && c.WorkingDType == adam.F16:
		return fmt.Errorf("trainer: --gpus %d all-gathers the working copy in bfloat16 or float32: --working-dtype float16 is not supported", c.GPUs)
	case c.GPUs > 1 && c.Schedule != "" && c.Schedule != "cpu" && c.Schedule != "static":
		return fmt.Errorf("trainer: --gpus %d: --schedule counts are per optimizer; each rank plans its own shard (use cpu, static or the model's)", c.GPUs)
	}
	return nil
}

// rankRingBytes is each rank's ring when n ranks share params parameters
// (each its own lazy engine): CkptRing GiB split n ways, or two copies of
// the 16 B of state per parameter of its share, at most 256 MiB; at least
// two chunks, in whole chunks.
func (c *TrainConfig) rankRingBytes(params float64, n int) float64 {
	const chunk = checkpoint.DefaultChunkBytes
	ring := math.Min(2*16*params/float64(n), 256<<20)
	if c.CkptRing > 0 {
		ring = c.CkptRing * (1 << 30) / float64(n)
	}
	return math.Max(math.Floor(ring/chunk)*chunk, 2*chunk)
}

// validScale reports whether s can be a loss scale: within [1, 2^64], so
// that it and its reciprocal are normal float32 values.
func validScale(s float64) bool { return s >= 1 && s <= 1<<64 }

// device opens c.Device into o (with the schedule c.Schedule, or the
// mixed one when there is no profile) through offload.OpenDevice, and
// returns the function that closes it.
func (c *TrainConfig) device(o *offload.Options) (func(), error) { return c.deviceOn(o, c.Device) }

// deviceOn is device with spec for c.Device (a ZeRO-3 rank's "cuda:N").
func (c *TrainConfig) deviceOn(o *offload.Options, spec string) (func(), error) {
	if spec == "" {
		return func() {}, nil
	}
	dev, closeDev, err := offload.OpenDevice(spec)
	if err != nil {
		return nil, fmt.Errorf("trainer: --device %s: %w", c.Device, err)
	}
	o.Device = dev
	if err := c.configureDevice(o); err != nil {
		closeDev()
		return nil, err
	}
	return closeDev, nil
}

// configureDevice sets o, whose Device is open, for c: its budget, its
// subgroup sizes and its schedule (c.Schedule, or the mixed one when
// there is no profile). Errors: --schedule's.
func (c *TrainConfig) configureDevice(o *offload.Options) error {
	o.GPUBudget = int64(c.GPUBudget * (1 << 30))
	if o.GPUBudget == 0 {
		o.GPUBudget = DefaultGPUBudget
	}
	if c.Schedule == "" || c.Schedule == "cpu" || c.Schedule == "static" {
		o.SubgroupSizes = c.SubgroupSizes
	}
	switch {
	case c.Schedule == "cpu" || c.Schedule == "static": // resolved by offload.New over the budget set by then
		o.Placement = c.Schedule
	case c.Schedule != "":
		s, err := offload.ParseSchedule(c.Schedule)
		if err != nil {
			return fmt.Errorf("trainer: --schedule: %w", err)
		}
		o.Schedule = &s
	case c.Profile == "":
		s := offload.MixedSchedule(c.subgroups())
		o.Schedule = &s
	}
	return nil
}

// paramCount returns the model's parameters.
func (c *TrainConfig) paramCount() int {
	return c.Model.NumParams()
}

// subgroups returns the optimizer's subgroup count for the model.
func (c *TrainConfig) subgroups() int {
	if n := c.Streamed(); n > 0 {
		o := c.optimizerOptions()
		o.OffloadParam = streamedNames(c.Model, n)
		dev := 0
		for _, sg := range offload.CutSubgroups(offloadParams(c.Model), *o) {
			if !sg.HostHeld {
				dev++
			}
		}
		return dev
	}
	return offload.SubgroupCount(c.paramCount(), c.optimizerOptions().SubgroupSize)
}

// DefaultGPUBudget is the device memory in bytes the update phase may use
// when TrainConfig.GPUBudget is 0: 16 GiB.
const DefaultGPUBudget = 16 << 30

// optimizerOptions returns the offload options of c.
func (c *TrainConfig) optimizerOptions() *offload.Options {
	o := &offload.Options{
		Hyper:        adam.Hyper{Mode: adam.AdamW, LR: c.LR, Betas: c.Betas, Eps: c.Eps, WeightDecay: c.WeightDecay},
		SubgroupSize: c.SubgroupSize, GradDType: c.GradDType, WorkingDType: c.WorkingDType,
		MaxGradNorm: c.MaxGradNorm, Threads: c.Threads,
	}
	return o.EnsureDefaults()
}

// LRAt returns the learning rate of iteration it (1-based): linear warm-up
// over WarmupSteps, cosine decay to LR*MinLRRatio at DecaySteps, then flat.
func (c *TrainConfig) LRAt(it int) float64 {
	if c.WarmupSteps > 0 && it <= c.WarmupSteps {
		return c.LR * float64(it) / float64(c.WarmupSteps)
	}
	decay := c.DecaySteps
	if decay == 0 {
		decay = c.Steps
	}
	min := c.LR * c.MinLRRatio
	if it >= decay || decay <= c.WarmupSteps {
		return min
	}
	frac := float64(it-c.WarmupSteps) / float64(decay-c.WarmupSteps)
	return min + 0.5*(c.LR-min)*(1+math.Cos(math.Pi*frac))
}
