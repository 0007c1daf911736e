package trainer

import (
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"strings"
	"time"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/offload"
)

// TrainConfig configures Train. The flags of `dos train` set these fields;
// the JSON names are theirs too.
type TrainConfig struct {
	Model Config `json:"model"`
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
	Threads      int     `json:"threads"`       // optimizer goroutines, 0..MaxThreads(); 0: GOMAXPROCS
	CkptDir      string  `json:"ckpt_dir"`      // "" disables checkpoints
	CkptEvery    int     `json:"ckpt_every"`    // iterations between checkpoints (and one at the end)
	// CkptSync writes checkpoints synchronously (checkpoint.Save) instead
	// of handing them to the lazy engine (checkpoint.Engine), which
	// captures the state while training goes on and flushes it in the
	// background.
	CkptSync bool `json:"ckpt_sync"`
	CkptKeep int  `json:"ckpt_keep"` // keep the newest N checkpoints (0: all)
	// Profile is a dos calibrate profile of this machine: the optimizer
	// plans its update phase with it, and the summary compares the
	// predicted update time with the measured one. "" for none.
	Profile string `json:"profile"`
	// Device runs the optimizer's update phase through the interleaved
	// engine on "sim" (the simulated device: a test of the engine) or
	// "cuda" (GPU 0); "" keeps it on the host. The trainer's forward and
	// backward stay on the host: its gradients are uploaded and the
	// working copy downloaded around each step.
	Device string `json:"device"`
	// GPUBudget is the device memory in GiB the update phase may use
	// (resident state and staging); 0 means DefaultGPUBudget.
	GPUBudget float64 `json:"gpu_budget_gib"`
	// MaxMemory is the host memory in GiB the run may use (--max-memory):
	// Validate refuses a configuration whose MemoryBytes exceeds it. 0
	// means the memory available when Validate runs (MemAvailable in
	// /proc/meminfo; where the system does not say, only MaxMemoryBytes
	// bounds it). At most MaxMemoryBytes.
	MaxMemory float64 `json:"max_memory_gib"`
	// Schedule forces the device's split as "CPU,GPU,RESIDENT" subgroup
	// counts; "" for the model's choice with Profile, else
	// offload.MixedSchedule.
	Schedule    string  `json:"schedule"`
	Resume      bool    `json:"resume"`       // continue from CkptDir's latest checkpoint
	EvalEvery   int     `json:"eval_every"`   // iterations between validation losses (0: only at the start and the end)
	EvalBatches int     `json:"eval_batches"` // batches of the validation split per evaluation
	LogEvery    int     `json:"log_every"`    // iterations between plain progress lines
	SampleBytes int     `json:"sample_bytes"` // bytes of text generated at the end
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
	}
}

// Validate reports the first invalid field, named by the `dos train` flag
// that sets it (--heads, --threads, ...; Model.VocabSize, which no flag
// sets, by its config.json name), with its value and what is allowed.
//
// Last it compares MemoryBytes with the memory the run may use: MaxMemory
// GiB, or, when that is 0, the memory available now (MemAvailable in
// /proc/meminfo, the one thing Validate reads from the system; skipped
// where the system does not say), and never more than MaxMemoryBytes. So a
// run too large for the machine is refused before anything is allocated.
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
	case m.VocabSize != VocabSize:
		return fmt.Errorf("trainer: vocab_size %d: the byte-level data needs %d", m.VocabSize, VocabSize)
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
		{"--steps", c.Steps, 1, math.MaxInt, ""},
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
	case c.Device == "" && (c.Schedule != "" || c.GPUBudget != 0):
		return errors.New("trainer: --schedule and --gpu-budget need --device")
	case !(c.GPUBudget >= 0) || c.GPUBudget > 1<<20:
		return fmt.Errorf("trainer: --gpu-budget %v GiB: want 0 to %d", c.GPUBudget, 1<<20)
	}
	if c.Schedule != "" {
		s, err := offload.ParseSchedule(c.Schedule)
		if err != nil {
			return fmt.Errorf("trainer: --schedule: %w", err)
		}
		if n := c.subgroups(); s.CPU+s.GPU+s.Resident != n {
			return fmt.Errorf("trainer: --schedule %s: %d subgroups, but the model's %d parameters in subgroups of %d make %d", c.Schedule, s.CPU+s.GPU+s.Resident, c.paramCount(), c.optimizerOptions().SubgroupSize, n)
		}
	}
	if err := c.optimizerOptions().Validate(); err != nil { // passes after the checks above
		return fmt.Errorf("trainer: %w", err)
	}
	return c.checkMemory()
}

// checkMemory compares MemoryBytes with the memory the run may use (see
// Validate).
func (c *TrainConfig) checkMemory() error {
	const gib = 1 << 30
	need := c.MemoryBytes()
	limit, over, advice := float64(MaxMemoryBytes), fmt.Sprintf("dos's limit of %d GiB", MaxMemoryBytes>>30), ""
	if c.MaxMemory > 0 {
		limit, over = c.MaxMemory*gib, fmt.Sprintf("--max-memory %g GiB", c.MaxMemory)
		advice = fmt.Sprintf(", or raise --max-memory (at most %d GiB)", MaxMemoryBytes>>30)
	} else if avail, ok := memAvailable(); ok && float64(avail) < limit {
		limit, over = float64(avail), fmt.Sprintf("the %.1f GiB available (MemAvailable in /proc/meminfo)", float64(avail)/gib)
		advice = fmt.Sprintf(", or pass --max-memory GiB (at most %d) to allow more than is available now", MaxMemoryBytes>>30)
	}
	if need > limit {
		return fmt.Errorf("trainer: --layers %d --embd %d --ctx %d --batch %d need about %.3g GiB of memory (parameters, optimizer state, activations), over %s: make the model or --batch smaller%s",
			c.Model.NLayer, c.Model.NEmbd, c.Model.NCtx, c.Batch, need/gib, over, advice)
	}
	return nil
}

// MaxMemoryBytes bounds MemoryBytes: a configuration that needs more is
// refused before anything is allocated, whatever MaxMemory says.
const MaxMemoryBytes = 64 << 30

// MemoryBytes estimates the bytes of host memory a run allocates, in
// float64 so that no product overflows:
//
//   - per parameter: the fp32 master weights and moments (12 B), the
//     gradients (4 B in fp32, 2 B in 16 bits), the 16-bit working copy
//     (2 B, if any), the trainer's fp32 copies of 16-bit gradients and of a
//     16-bit working copy (4 B each), and the initial weights, live while
//     New hands them to the optimizer (4 B): 20 B with fp32 gradients and
//     no working copy, 28 B with bf16 gradients and working copy;
//   - the activations of one batch, llm.c's count of about
//     L*(16C + H*T) + 13C + 2V + max(4C, V) floats per position, the
//     transposed-weight buffer (max(4C², VC) floats) and one attention
//     scratch (3T² + 4TC/H floats) per goroutine of the model (GOMAXPROCS,
//     at most B*H);
//   - the lazy checkpoint engine's staging ring (two copies of the 16 B of
//     state per parameter, at most 256 MiB) when CkptDir is set without
//     CkptSync.
//
// What New allocates (runtime.MemStats.TotalAlloc) is within 1 % of it
// (TestMemoryBytesMeasured); the peak RSS of `dos train` on the 2-core
// development machine was 9 % below to 2 % above it, from 0.8 to 2.4 GiB,
// for parameter-bound and activation-bound models in fp32 and bf16.
func (c *TrainConfig) MemoryBytes() float64 {
	m := c.Model
	L, C, H, T, V := float64(m.NLayer), float64(m.NEmbd), float64(m.NHead), float64(m.NCtx), float64(m.VocabSize)
	params := V*C + T*C + L*(12*C*C+13*C) + 2*C
	perParam := 12.0 + 4 // master, moments; initial weights
	if c.GradDType == adam.F32 {
		perParam += 4
	} else {
		perParam += 2 + 4 // 16-bit gradients and the trainer's fp32 ones
	}
	if c.WorkingDType != 0 {
		perParam += 2 + 4 // 16-bit working copy and the trainer's fp32 one
	}
	perPos := L*(16*C+H*T) + 13*C + 2*V + math.Max(4*C, V)
	floats := perPos*float64(c.Batch)*T + math.Max(4*C*C, V*C) + math.Min(float64(workers()), float64(c.Batch)*H)*(3*T*T+4*T*C/H)
	ring := 0.0
	if c.CkptDir != "" && !c.CkptSync {
		ring = math.Min(2*16*params, 256<<20)
	}
	return perParam*params + 4*floats + ring
}

// validScale reports whether s can be a loss scale: within [1, 2^64], so
// that it and its reciprocal are normal float32 values.
func validScale(s float64) bool { return s >= 1 && s <= 1<<64 }

// device opens c.Device into o (with the schedule c.Schedule, or the
// mixed one when there is no profile) through offload.OpenDevice, and
// returns the function that closes it.
func (c *TrainConfig) device(o *offload.Options) (func(), error) {
	if c.Device == "" {
		return func() {}, nil
	}
	dev, closeDev, err := offload.OpenDevice(c.Device)
	if err != nil {
		return nil, fmt.Errorf("trainer: --device %s: %w", c.Device, err)
	}
	o.Device = dev
	o.GPUBudget = int64(c.GPUBudget * (1 << 30))
	if o.GPUBudget == 0 {
		o.GPUBudget = DefaultGPUBudget
	}
	switch {
	case c.Schedule != "":
		s, err := offload.ParseSchedule(c.Schedule)
		if err != nil {
			closeDev()
			return nil, fmt.Errorf("trainer: --schedule: %w", err)
		}
		o.Schedule = &s
	case c.Profile == "":
		s := offload.MixedSchedule(c.subgroups())
		o.Schedule = &s
	}
	return closeDev, nil
}

// paramCount returns the model's parameters.
func (c *TrainConfig) paramCount() int {
	total := 0
	for _, p := range c.Model.Params() {
		n := 1
		for _, d := range p.Shape {
			n *= d
		}
		total += n
	}
	return total
}

// subgroups returns the optimizer's subgroup count for the model.
func (c *TrainConfig) subgroups() int {
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

// Summary is what `dos train --summary-json` writes.
type Summary struct {
	InitialLoss float64 `json:"initial_loss"` // training loss of iteration 1 (nats/token)
	FinalLoss   float64 `json:"final_loss"`   // training loss of the last iteration
	ValLoss     float64 `json:"val_loss"`     // validation loss at the end
	InitValLoss float64 `json:"initial_val_loss"`
	Steps       int     `json:"steps"`  // iterations done, in all runs
	Params      int     `json:"params"` // model parameters
	TokensPerS  float64 `json:"tokens_per_s"`
	Skipped     int     `json:"skipped_steps"` // optimizer steps skipped for non-finite gradients, this run
	Sample      string  `json:"sample"`
	// UpdateS is the mean wall time of the optimizer's update phase this
	// run, its first iteration left out (warm-up), in seconds;
	// UpdatePredictedS the performance model's prediction (0 without a
	// profile).
	UpdateS          float64 `json:"update_s"`
	UpdatePredictedS float64 `json:"update_predicted_s,omitempty"`
}

// trainerState is the trainer's object in a checkpoint's manifest.
type trainerState struct {
	Iteration   int         `json:"iteration"`
	LoaderPos   int64       `json:"loader_pos"`
	RNG         []byte      `json:"rng"` // math/rand/v2 PCG state, MarshalBinary
	LossScale   float64     `json:"loss_scale"`
	GoodSteps   int         `json:"good_steps"`
	InitialLoss float64     `json:"initial_loss"`
	InitValLoss float64     `json:"initial_val_loss"`
	LastLoss    float64     `json:"last_loss"`
	TextCRC     uint32      `json:"text_crc32"` // of the whole training text: resuming on other data is refused
	TextBytes   int         `json:"text_bytes"`
	Config      TrainConfig `json:"config"`
}

// Trainer is one training run: the model, the data, and the offloaded
// optimizer that owns the parameters.
type Trainer struct {
	cfg    TrainConfig
	data   *Dataset
	loader *Loader
	val    *Loader // the validation split's, read from its start by Evaluate
	opt    *offload.Optimizer
	model  *Model[float32]
	rng    *rand.PCG

	params, grads [][]float32 // what the model reads and writes
	own16         bool        // params are fp32 copies of the 16-bit working copy
	inputs, tgts  []int32
	state         trainerState
	out           io.Writer
	tty           bool

	engine   *checkpoint.Engine   // the lazy checkpointer, made at the first save
	closeDev func()               // releases the update phase's device (cfg.Device)
	lock     *checkpoint.RootLock // cfg.CkptDir's, for the whole run
	last     *checkpoint.Handle   // its last save, reported when it is durable
}

// New builds a trainer over text with cfg: the optimizer with GPT-2's
// initial weights, or, with cfg.Resume, the state of the latest checkpoint
// in cfg.CkptDir (a fresh start when there is none). Progress goes to out
// (nil discards it).
//
// With cfg.CkptDir, New takes the directory's lock for the run
// (checkpoint.Lock; Close releases it) and checks it before allocating
// anything; with cfg.Resume a damaged root is repaired first
// (checkpoint.Recover), and what was done is printed.
//
// Errors: an invalid configuration, a text too short; a CkptDir that is
// not usable (a step directory, a file, not writable) or that another
// process writes under (checkpoint.ErrLocked); one that is not fresh
// without cfg.Resume (it holds checkpoints, or is damaged); a damaged root
// where no step directory verifies; a checkpoint that cannot be loaded
// or was made with another model, batch shape or text.
func New(cfg TrainConfig, text []byte, out io.Writer) (*Trainer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	data, err := NewDataset(text, cfg.ValFraction, cfg.Model.NCtx)
	if err != nil {
		return nil, err
	}
	loader, err := NewLoader(data.Train, cfg.Batch, cfg.Model.NCtx)
	if err != nil {
		return nil, err
	}
	val, err := NewLoader(data.Val, cfg.Batch, cfg.Model.NCtx)
	if err != nil {
		return nil, fmt.Errorf("trainer: the validation split: %w", err)
	}
	if out == nil {
		out = io.Discard
	}
	// --ckpt-dir is checked and locked for the whole run before anything
	// is allocated or trained: a second trainer, an unusable directory or
	// a root that is not fresh is refused now, not at the first checkpoint.
	var lock *checkpoint.RootLock
	var from *checkpoint.Recovery
	ok := false
	defer func() {
		if !ok {
			lock.Unlock()
		}
	}()
	if cfg.CkptDir != "" {
		if lock, from, err = openRoot(&cfg, out); err != nil {
			return nil, err
		}
	}
	oo := cfg.optimizerOptions()
	closeDev, err := cfg.device(oo)
	if err != nil {
		return nil, err
	}
	if cfg.Profile != "" {
		p, err := offload.LoadProfile(cfg.Profile, oo.Device)
		if err != nil {
			closeDev()
			return nil, fmt.Errorf("trainer: --profile: %w", err)
		}
		oo.Profile = p
	}
	opt, err := offload.New(cfg.Model.Params(), *oo)
	if err != nil {
		closeDev()
		return nil, err
	}
	t := &Trainer{cfg: cfg, data: data, loader: loader, val: val, opt: opt, out: out, closeDev: closeDev, lock: lock,
		rng:   rand.NewPCG(cfg.Seed, 0x5eed),
		state: trainerState{LossScale: cfg.LossScale, InitialLoss: math.NaN(), InitValLoss: math.NaN(), TextCRC: crc32.ChecksumIEEE(text), TextBytes: len(text)},
	}
	if f, ok := out.(*os.File); ok {
		if fi, err := f.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
			t.tty = true
		}
	}
	for i, v := range InitParams(cfg.Model, cfg.Seed) {
		if err := opt.SetParam(opt.Params()[i].Name, v); err != nil {
			t.Close()
			return nil, err
		}
	}
	if from != nil {
		if err := t.resume(from.Dir); err != nil {
			t.Close()
			return nil, err
		}
	}
	t.bind()
	ok = true
	return t, nil
}

// openRoot takes the lock of cfg.CkptDir (checkpoint.Lock: it creates the
// directory, refuses a step directory, an unwritable directory and one
// that another process writes under) and decides where the run starts:
// without cfg.Resume the root must be fresh (no latest in any state, no
// step directory), since a run from scratch would replace checkpoints;
// with it, checkpoint.Recover gives the checkpoint to resume, repairing a
// damaged root (an interrupted first commit, a missing or corrupt latest)
// and saying so on out; a root without any checkpoint gives nil.
func openRoot(cfg *TrainConfig, out io.Writer) (*checkpoint.RootLock, *checkpoint.Recovery, error) {
	root := cfg.CkptDir
	lock, err := checkpoint.Lock(checkpoint.OS, root)
	if err != nil {
		return nil, nil, fmt.Errorf("trainer: --ckpt-dir: %w", err)
	}
	info, err := checkpoint.Inspect(checkpoint.OS, root)
	if err != nil {
		lock.Unlock()
		return nil, nil, fmt.Errorf("trainer: --ckpt-dir: %w", err)
	}
	if !cfg.Resume {
		switch {
		case info.Fresh():
			return lock, nil, nil
		case info.Latest != "":
			err = fmt.Errorf("trainer: --ckpt-dir %s already holds checkpoints (latest %s): pass --resume to continue, or choose another --ckpt-dir", root, info.Latest)
		default:
			err = fmt.Errorf("trainer: --ckpt-dir %s holds checkpoints but is damaged (%w): pass --resume to recover from the newest step directory that verifies, or choose another --ckpt-dir; nothing was changed", root, info.Problem)
		}
		lock.Unlock()
		return nil, nil, err
	}
	rec, err := checkpoint.Recover(checkpoint.OS, root, 0)
	if errors.Is(err, checkpoint.ErrNoCheckpoint) {
		fmt.Fprintf(out, "resume: no checkpoint in %s; starting at iteration 0\n", root)
		return lock, nil, nil
	}
	if err != nil {
		lock.Unlock()
		return nil, nil, fmt.Errorf("trainer: resume from %s: %w", root, err)
	}
	if rec.Repaired {
		fmt.Fprintf(out, "resume: recovered %s: %s\n", root, rec.Note)
	}
	return lock, rec, nil
}

// bind points the model's parameter and gradient slices at the optimizer's
// buffers where the dtypes allow (fp32: no copy), else at fp32 buffers the
// trainer converts from and to.
func (t *Trainer) bind() {
	T := t.cfg.Model.NCtx
	t.model = NewModel[float32](t.cfg.Model, t.cfg.Batch, T)
	t.inputs = make([]int32, t.cfg.Batch*T)
	t.tgts = make([]int32, t.cfg.Batch*T)
	n := len(t.opt.Params())
	t.params, t.grads = make([][]float32, n), make([][]float32, n)
	t.own16 = t.cfg.WorkingDType != 0
	for i, p := range t.opt.Params() {
		if t.own16 {
			t.params[i] = make([]float32, p.Len)
		} else {
			t.params[i] = t.opt.Working(i).Float32()
		}
		if t.cfg.GradDType == adam.F32 {
			t.grads[i] = t.opt.Grad(i).Float32()
		} else {
			t.grads[i] = make([]float32, p.Len)
		}
	}
}

// Close releases the optimizer's workers, the update phase's device, the
// lazy checkpoint engine (waiting for its save in flight) and the lock of
// cfg.CkptDir.
func (t *Trainer) Close() {
	t.opt.Close()
	if t.closeDev != nil {
		t.closeDev()
		t.closeDev = nil
	}
	if t.engine != nil {
		_ = t.engine.Close()
		t.engine = nil
	}
	t.lock.Unlock()
}

// NumParams returns the model's parameter count.
func (t *Trainer) NumParams() int { return t.opt.NumParams() }

// resume restores the run from the checkpoint directory dir.
func (t *Trainer) resume(dir string) error {
	root := t.cfg.CkptDir
	// Read the trainer's object first, so a different model gets a message
	// about the model rather than about a tensor.
	c, err := checkpoint.Open(checkpoint.OS, dir, 0)
	if err != nil {
		return fmt.Errorf("trainer: resume from %s: %w%s", root, err, recoverHint(err, root))
	}
	var st trainerState
	err = c.Object("trainer", &st)
	c.Close()
	if err != nil {
		return fmt.Errorf("trainer: resume from %s: not a dos train checkpoint: %w", dir, err)
	}
	// The model's shape and the batch cannot change: name every flag that
	// differs (dos train takes the ones not given from the checkpoint).
	var differ []string
	for _, d := range []struct {
		flag      string
		now, then int
	}{
		{"--layers", t.cfg.Model.NLayer, st.Config.Model.NLayer}, {"--heads", t.cfg.Model.NHead, st.Config.Model.NHead},
		{"--embd", t.cfg.Model.NEmbd, st.Config.Model.NEmbd}, {"--ctx", t.cfg.Model.NCtx, st.Config.Model.NCtx},
		{"--batch", t.cfg.Batch, st.Config.Batch}, {"vocabulary (no flag)", t.cfg.Model.VocabSize, st.Config.Model.VocabSize},
	} {
		if d.now != d.then {
			differ = append(differ, fmt.Sprintf("%s %d (the checkpoint's: %d)", d.flag, d.now, d.then))
		}
	}
	if len(differ) > 0 {
		return fmt.Errorf("trainer: resume from %s: %s: a resumed run keeps the model's shape and batch (it was trained with %s); omit these flags",
			dir, strings.Join(differ, ", "), st.Config.shapeFlags())
	}
	if _, _, err := t.opt.LoadCheckpoint(checkpoint.OS, dir); err != nil {
		return fmt.Errorf("trainer: resume from %s: %w%s", root, err, recoverHint(err, root))
	}
	if st.TextCRC != t.state.TextCRC || st.TextBytes != t.state.TextBytes {
		return fmt.Errorf("trainer: resume from %s: it was trained on another text (%d bytes, crc32 %#08x; this run: %d bytes, %#08x)",
			dir, st.TextBytes, st.TextCRC, t.state.TextBytes, t.state.TextCRC)
	}
	if st.Iteration < 0 || int64(st.Iteration) < t.opt.StepCount() || (st.LossScale != 0 && !validScale(st.LossScale)) {
		return fmt.Errorf("trainer: resume from %s: inconsistent trainer state (iteration %d, optimizer step %d, loss scale %v)",
			dir, st.Iteration, t.opt.StepCount(), st.LossScale)
	}
	if err := t.loader.SetPos(st.LoaderPos); err != nil {
		return fmt.Errorf("trainer: resume from %s: %w", dir, err)
	}
	if err := t.rng.UnmarshalBinary(st.RNG); err != nil {
		return fmt.Errorf("trainer: resume from %s: RNG state: %w", dir, err)
	}
	// The optimizer restored its hyperparameters (PyTorch's load_state_dict)
	// and the loss scaler continues from its saved state: say so where this
	// run's flags differ. The learning rate follows this run's schedule.
	h := t.opt.Options().Hyper
	flags := t.cfg.optimizerOptions().Hyper // what this run's flags ask for
	old := st.Config
	for _, d := range []struct {
		flag      string
		now, then any
	}{
		{"--weight-decay", t.cfg.WeightDecay, h.WeightDecay}, {"--beta1", t.cfg.Betas[0], h.Betas[0]},
		{"--beta2", t.cfg.Betas[1], h.Betas[1]}, {"--eps", t.cfg.Eps, h.Eps},
		{"mode (no flag: dos train runs AdamW)", flags.Mode, h.Mode},
		{"maximize (no flag: dos train minimizes)", flags.Maximize, h.Maximize},
		{"amsgrad (no flag)", flags.AMSGrad, h.AMSGrad},
		{"--loss-scale", t.cfg.LossScale, old.LossScale}, {"--seed", t.cfg.Seed, old.Seed},
	} {
		if d.now != d.then {
			fmt.Fprintf(t.out, "resume: %s %v differs from the checkpoint's %v; the checkpoint's state continues\n", d.flag, d.now, d.then)
		}
	}
	for _, d := range []struct {
		flag      string
		now, then any
	}{
		{"--lr", t.cfg.LR, old.LR}, {"--warmup", t.cfg.WarmupSteps, old.WarmupSteps},
		{"--min-lr-ratio", t.cfg.MinLRRatio, old.MinLRRatio},
		{"--clip", t.cfg.MaxGradNorm, old.MaxGradNorm},
		{"--grad-dtype", t.cfg.GradDType, old.GradDType}, {"--working-dtype", t.cfg.WorkingDType, old.WorkingDType},
		{"--subgroup-size", t.cfg.SubgroupSize, old.SubgroupSize}, {"--threads", t.cfg.Threads, old.Threads},
	} {
		if d.now != d.then {
			fmt.Fprintf(t.out, "resume: %s %v differs from the checkpoint's %v; this run's value applies from here on\n", d.flag, d.now, d.then)
		}
	}
	if now, then := t.cfg.horizon(), old.horizon(); now != then {
		fmt.Fprintf(t.out, "resume: the cosine's horizon is %d iterations (--decay-steps, or --steps when it is 0), the checkpoint's %d: this run's applies from here on; pass --decay-steps %d to keep the schedule\n", now, then, then)
	}

	if err := t.opt.SetLR(t.cfg.LRAt(max(st.Iteration, 1))); err != nil {
		return err
	}
	t.cfg.WeightDecay, t.cfg.Betas, t.cfg.Eps = h.WeightDecay, h.Betas, h.Eps
	t.cfg.LossScale, t.cfg.Seed = old.LossScale, old.Seed
	st.Config = t.cfg
	t.state = st
	fmt.Fprintf(t.out, "resume: %s at iteration %d (optimizer step %d)\n", dir, st.Iteration, t.opt.StepCount())
	if st.Iteration >= t.cfg.Steps {
		fmt.Fprintf(t.out, "resume: already at iteration %d, at or past --steps %d: nothing to train\n", st.Iteration, t.cfg.Steps)
	}
	return nil
}

// shapeFlags spells the model's shape and the batch as dos train's flags.
func (c *TrainConfig) shapeFlags() string {
	m := c.Model
	return fmt.Sprintf("--layers %d --heads %d --embd %d --ctx %d --batch %d (vocabulary %d)", m.NLayer, m.NHead, m.NEmbd, m.NCtx, c.Batch, m.VocabSize)
}

// recoverHint tells the user of a damaged latest checkpoint the way out.
func recoverHint(err error, root string) string {
	if !errors.Is(err, checkpoint.ErrCorrupt) {
		return ""
	}
	return fmt.Sprintf("; `dos ckpt recover %s` sets this checkpoint aside and points latest at the newest one that verifies", root)
}

// refresh copies the 16-bit working copy into the model's fp32 parameters.
func (t *Trainer) refresh() {
	if !t.own16 {
		return
	}
	for i, dst := range t.params {
		adam.Widen16(t.cfg.WorkingDType, dst, t.opt.Working(i).Uint16())
	}
}

// handOver rounds the model's fp32 gradients into the optimizer's 16-bit
// gradient buffers (an overflow becomes Inf, which skips the step).
func (t *Trainer) handOver() {
	if t.cfg.GradDType == adam.F32 {
		return
	}
	for i, g := range t.grads {
		adam.Round16(t.cfg.GradDType, t.opt.Grad(i).Uint16(), g)
	}
}

// Evaluate returns the mean loss over cfg.EvalBatches batches of the
// validation split, read from its start (the same batches every time).
func (t *Trainer) Evaluate() float64 {
	n := max(t.cfg.EvalBatches, 1)
	t.val.Pos = 0
	t.refresh()
	var sum float64
	for range n {
		t.val.Next(t.inputs, t.tgts)
		sum += float64(t.model.Forward(t.params, t.inputs, t.tgts))
	}
	return sum / float64(n)
}

func (t *Trainer) save() error {
	if t.cfg.CkptDir == "" {
		return nil
	}
	t.state.LoaderPos = t.loader.Pos
	rng, err := t.rng.MarshalBinary()
	if err != nil {
		return err
	}
	t.state.RNG = rng
	t.state.Config = t.cfg
	objects := map[string]any{"trainer": t.state}
	step := int64(t.state.Iteration) // skipped optimizer steps still count as iterations
	if !t.cfg.CkptSync {
		return t.saveLazily(step, objects)
	}
	snap, err := t.opt.Snapshot(objects)
	if err != nil {
		return err
	}
	snap.Step = step
	t0 := time.Now()
	dir, err := checkpoint.Save(checkpoint.OS, t.cfg.CkptDir, snap)
	if err != nil {
		return fmt.Errorf("trainer: checkpoint at iteration %d: %w", t.state.Iteration, err)
	}
	var bytes int
	for _, tn := range snap.Tensors {
		for _, r := range tn.Data {
			bytes += len(r)
		}
	}
	t.logf("checkpoint %s (%.1f MB, synchronous, %v)\n", dir, float64(bytes)/1e6, time.Since(t0).Round(time.Millisecond))
	if t.cfg.CkptKeep > 0 {
		return checkpoint.Retain(checkpoint.OS, t.cfg.CkptDir, t.cfg.CkptKeep)
	}
	return nil
}

// saveLazily hands the checkpoint to the lazy engine and returns; the
// engine's staging ring holds two copies of the state, at most 256 MiB.
func (t *Trainer) saveLazily(step int64, objects map[string]any) error {
	if t.engine == nil {
		const chunk = checkpoint.DefaultChunkBytes
		state := int64(t.opt.NumParams()) * 16 // fp32 master, exp_avg, exp_avg_sq (and max_exp_avg_sq)
		ring := min(max(2*((state+chunk-1)/chunk*chunk), 2*chunk), 256<<20)
		e, err := checkpoint.NewEngine(checkpoint.OS, t.cfg.CkptDir, checkpoint.EngineOptions{ChunkBytes: chunk, RingBytes: ring, Keep: t.cfg.CkptKeep})
		if err != nil {
			return fmt.Errorf("trainer: checkpoint engine: %w", err)
		}
		t.engine = e
	}
	// The engine runs one save at a time (its Save waits for the last
	// one to be durable): report the last one first, never drop it.
	if err := t.reportSave(true); err != nil {
		return err
	}
	h, err := t.opt.SaveAsync(t.engine, step, objects)
	if err != nil {
		return fmt.Errorf("trainer: checkpoint at iteration %d: %w", step, err)
	}
	t.last = h
	return nil
}

// reportSave logs the last lazy save once it is durable (waiting for it
// with wait) and returns its error.
func (t *Trainer) reportSave(wait bool) error {
	h := t.last
	if h == nil || (!wait && !h.Done()) {
		return nil
	}
	t.last = nil
	dir, err := h.Wait()
	if err != nil {
		return fmt.Errorf("trainer: checkpoint at iteration %d: %w", h.Stats().Step, err)
	}
	t.logf("checkpoint %s (%v)\n", dir, h.Stats())
	return nil
}

func (t *Trainer) logf(format string, args ...any) {
	if t.tty {
		fmt.Fprint(t.out, "\r\033[K")
	}
	fmt.Fprintf(t.out, format, args...)
}

// Run trains from the current iteration to cfg.Steps and returns the
// summary. A non-finite loss stops it with an error; the last checkpoint
// written before stays the latest.
func (t *Trainer) Run() (Summary, error) {
	cfg := &t.cfg
	sum := Summary{Params: t.NumParams()}
	tokens := cfg.Batch * cfg.Model.NCtx
	fmt.Fprintf(t.out, "dos train: GPT-2 %d layers, %d heads, width %d, context %d, vocab %d: %d params; batch %d (%d tokens); %d iterations; %v\n",
		cfg.Model.NLayer, cfg.Model.NHead, cfg.Model.NEmbd, cfg.Model.NCtx, cfg.Model.VocabSize, t.NumParams(), cfg.Batch, tokens, cfg.Steps, t.opt.Options())
	if s, ok := t.opt.Schedule(); ok {
		k := "inf"
		if !math.IsInf(s.K(), 1) {
			k = fmt.Sprintf("%.2f", s.K())
		}
		fmt.Fprintf(t.out, "update phase on %s: %d of %d subgroups on the CPU, %d streamed through the GPU, %d resident (k = %s, upcast on the GPU: %v)\n",
			t.opt.Options().Device.Name(), s.CPU, len(t.opt.Subgroups()), s.GPU, s.Resident, k, s.UpcastOnGPU)
	}
	if math.IsNaN(t.state.InitValLoss) {
		t.state.InitValLoss = t.Evaluate()
		t.logf("iter %5d  val_loss %.4f\n", t.state.Iteration, t.state.InitValLoss)
	}
	start := time.Now()
	done := 0
	var updates time.Duration
	for t.state.Iteration < cfg.Steps {
		it := t.state.Iteration + 1
		if err := t.opt.SetLR(cfg.LRAt(it)); err != nil {
			return sum, err
		}
		t.loader.Next(t.inputs, t.tgts)
		t.refresh()
		scale := float32(1)
		if t.state.LossScale > 0 {
			scale = float32(t.state.LossScale)
		}
		loss := float64(t.model.Forward(t.params, t.inputs, t.tgts))
		if math.IsNaN(loss) || math.IsInf(loss, 0) {
			return sum, fmt.Errorf("trainer: loss %v at iteration %d: diverged", loss, it)
		}
		t.model.Backward(t.params, t.grads, scale)
		t.handOver()
		res, err := t.opt.Step(offload.StepArgs{LossScale: float64(scale)})
		if err != nil {
			return sum, err
		}
		if done > 0 { // the first update of a run also pays for the caches and page tables warming up
			updates += res.Elapsed
		}
		if t.state.LossScale > 0 {
			if res.Skipped {
				t.state.LossScale = max(t.state.LossScale/2, 1) // floor 1: see validScale
				t.state.GoodSteps = 0
			} else if t.state.GoodSteps++; t.state.GoodSteps == ScaleGrowthInterval {
				t.state.LossScale = min(t.state.LossScale*2, 1<<64)
				t.state.GoodSteps = 0
			}
		}
		if res.Skipped {
			sum.Skipped++
		}
		t.state.Iteration = it
		t.state.LastLoss = loss
		done++
		if math.IsNaN(t.state.InitialLoss) {
			t.state.InitialLoss = loss
		}
		rate := float64(done*tokens) / time.Since(start).Seconds()
		if t.tty {
			fmt.Fprintf(t.out, "\r\033[Kiter %5d/%d  loss %.4f  lr %.2e  grad_norm %.3f  %.0f tok/s", it, cfg.Steps, loss, cfg.LRAt(it), res.GradNorm, rate)
		}
		if cfg.LogEvery > 0 && (it%cfg.LogEvery == 0 || it == cfg.Steps) {
			skipped := ""
			if res.Skipped {
				skipped = fmt.Sprintf("  SKIPPED (loss scale now %g)", t.state.LossScale)
			}
			t.logf("iter %5d  loss %.4f  lr %.2e  grad_norm %.3f  %.0f tok/s%s\n", it, loss, cfg.LRAt(it), res.GradNorm, rate, skipped)
		}
		if cfg.EvalEvery > 0 && it%cfg.EvalEvery == 0 && it != cfg.Steps {
			t.logf("iter %5d  val_loss %.4f\n", it, t.Evaluate())
		}
		if err := t.reportSave(false); err != nil { // a lazy checkpoint durable since the last iteration
			return sum, err
		}
		if cfg.CkptEvery > 0 && it%cfg.CkptEvery == 0 {
			if err := t.save(); err != nil {
				return sum, err
			}
		}
	}
	if done > 0 {
		if done > 1 {
			sum.UpdateS = updates.Seconds() / float64(done-1)
		}
		if plan, ok := t.opt.Plan(); ok && done > 1 {
			sum.UpdatePredictedS = plan.Makespan
			t.logf("update phase: %.3f ms measured (mean of iterations 2..%d of this run), %.3f ms predicted by the performance model (CPU/GPU/resident subgroups %d/%d/%d, bottleneck %s)\n",
				1e3*sum.UpdateS, done, 1e3*plan.Makespan, plan.CPU, plan.GPU, plan.Resident, plan.Bottleneck)
		}
		sum.TokensPerS = float64(done*tokens) / time.Since(start).Seconds()
		if cfg.CkptEvery == 0 || t.state.Iteration%cfg.CkptEvery != 0 {
			if err := t.save(); err != nil {
				return sum, err
			}
		}
	}
	if err := t.reportSave(true); err != nil { // the last checkpoint is durable before Run returns
		return sum, err
	}
	sum.FinalLoss = t.state.LastLoss
	sum.InitialLoss, sum.InitValLoss = t.state.InitialLoss, t.state.InitValLoss
	sum.ValLoss = t.Evaluate()
	sum.Steps = t.state.Iteration
	t.logf("iter %5d  val_loss %.4f (from %.4f)\n", t.state.Iteration, sum.ValLoss, sum.InitValLoss)
	if cfg.SampleBytes > 0 {
		sum.Sample = t.Sample([]byte("\nLight "), cfg.SampleBytes)
		fmt.Fprintf(t.out, "sample: %q\n", sum.Sample)
	}
	return sum, nil
}

// Sample continues prompt by n bytes drawn from the model's distribution
// (temperature 1) with the trainer's RNG, and returns the whole text.
func (t *Trainer) Sample(prompt []byte, n int) string {
	T := t.cfg.Model.NCtx
	m := NewModel[float32](t.cfg.Model, 1, T)
	r := rand.New(t.rng)
	t.refresh()
	ctx := append([]byte(nil), prompt...)
	toks := make([]int32, T)
	var b strings.Builder
	b.Write(prompt)
	for range n {
		window := ctx[max(0, len(ctx)-T):]
		for i := range toks {
			toks[i] = 0
		}
		for i, c := range window {
			toks[i] = int32(c)
		}
		m.Forward(t.params, toks, nil)
		logits := m.Logits()[(len(window)-1)*VocabSize : len(window)*VocabSize]
		next := sampleLogits(logits, r.Float64())
		ctx = append(ctx, byte(next))
		b.WriteByte(byte(next))
	}
	return b.String()
}

// sampleLogits draws an index from softmax(logits) with the uniform u.
func sampleLogits(logits []float32, u float64) int {
	mx := math.Inf(-1)
	for _, l := range logits {
		mx = math.Max(mx, float64(l))
	}
	var z float64
	for _, l := range logits {
		z += math.Exp(float64(l) - mx)
	}
	acc := 0.0
	for i, l := range logits {
		acc += math.Exp(float64(l)-mx) / z
		if u < acc {
			return i
		}
	}
	return len(logits) - 1
}
