package trainer

import (
	crand "crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"strings"
	"time"

	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/offload"
)

// Summary is what `dos train --summary-json` writes.
type Summary struct {
	InitialLoss float64 `json:"initial_loss"` // training loss of iteration 1 (nats/token); 0 when no iteration ran
	FinalLoss   float64 `json:"final_loss"`   // training loss of the last iteration
	ValLoss     float64 `json:"val_loss"`     // validation loss at the end
	InitValLoss float64 `json:"initial_val_loss"`
	Steps       int     `json:"steps"`         // iterations done, in all runs
	Params      int     `json:"params"`        // model parameters
	TokensPerS  float64 `json:"tokens_per_s"`  // this run's, its first iteration left out when there are two or more (on one GPU the second's forward runs alone, measured for the iteration's model: it counts)
	Skipped     int     `json:"skipped_steps"` // optimizer steps skipped for non-finite gradients, this run
	Sample      string  `json:"sample"`
	// UpdateS is the mean wall time of the optimizer's update phase this
	// run, its first iteration left out (warm-up), in seconds;
	// UpdatePredictedS the performance model's prediction (0 without a
	// profile), UpdateLimitS the machine's limit for the phase with a
	// device (offload.Optimizer.Limit: the model's fluid limit, a
	// prediction that counts contention) and UpdateBoundS a lower bound
	// (offload.Optimizer.Bound: every resource at its rate alone).
	UpdateS          float64 `json:"update_s"`
	UpdatePredictedS float64 `json:"update_predicted_s,omitempty"`
	UpdateLimitS     float64 `json:"update_limit_s,omitempty"`
	UpdateBoundS     float64 `json:"update_bound_s,omitempty"`
	// IterationS is the mean iteration, its first left out, in seconds;
	// with a device and a profile on one GPU, IterationPredictedS the
	// performance model's prediction of it (offload.Optimizer.
	// PredictIteration: the forward and backward measured alone, the
	// planned phase, the overlaps the run takes) and IterationBoundS a
	// lower bound on it (offload.Optimizer.IterationBound: the measured
	// forward and backward on the GPU beside the update phase's work at
	// each resource's rate alone, the streamed weights' copies on PCIe;
	// the largest resource's time, as if every overlap were reached).
	IterationS          float64 `json:"iteration_s,omitempty"`
	IterationPredictedS float64 `json:"iteration_predicted_s,omitempty"`
	IterationBoundS     float64 `json:"iteration_bound_s,omitempty"`
	// MFU is the model FLOP utilization of the GPU trainer: TokensPerS ×
	// gpt.Config.FLOPsPerToken over PeakFLOPS (llm.c's count); 0 on the
	// host.
	MFU float64 `json:"mfu,omitempty"`
}

// trainerState is the trainer's object in a checkpoint's manifest.
type trainerState struct {
	Iteration   int       `json:"iteration"`
	LoaderPos   int64     `json:"loader_pos"` // the next training batch's first token (Loader.Pos, TokenBatches.Pos)
	RNG         []byte    `json:"rng"`        // math/rand/v2 PCG state, MarshalBinary
	LossScale   float64   `json:"loss_scale"`
	GoodSteps   int       `json:"good_steps"`
	InitialLoss maybeLoss `json:"initial_loss"` // NaN (null in JSON) until the first iteration
	InitValLoss maybeLoss `json:"initial_val_loss"`
	LastLoss    float64   `json:"last_loss"`
	// TextCRC and TextBytes identify the data, so that resuming on other
	// data is refused: the CRC-32 (IEEE) and length of the whole text, or,
	// for pre-tokenized data (Data "tokens"), of its tokens as
	// little-endian uint16, the training tokens then the validation ones.
	TextCRC   uint32 `json:"text_crc32"`
	TextBytes int    `json:"text_bytes"`
	// TrainTokens is, for token data, how many of them train (the rest
	// validates): a resumed run must split the same tokens the same way.
	// 0 in older checkpoints (not checked).
	TrainTokens int `json:"train_tokens,omitempty"`
	// Data is "" for a text (New; its batches are Loader's) and "tokens"
	// for pre-tokenized data (NewTokens; TokenBatches').
	Data   string      `json:"data,omitempty"`
	Config TrainConfig `json:"config"`
	// RunID identifies the run: drawn at random when it starts from
	// scratch, kept by its resumes and by dos ckpt reshard, so that a
	// job's rank roots from two runs are told apart
	// (checkpoint.CheckJob). "" in older checkpoints (not compared).
	RunID string `json:"run_id,omitempty"`
}

// withRunID returns st with a new RunID.
func withRunID(st trainerState) trainerState {
	st.RunID = newRunID()
	return st
}

// newRunID returns a random run identity (trainerState.RunID): 16 hex
// digits.
func newRunID() string {
	var b [8]byte
	if _, err := crand.Read(b[:]); err != nil {
		// No system randomness: the time still tells two runs apart.
		return fmt.Sprintf("%016x", uint64(time.Now().UnixNano()))
	}
	return hex.EncodeToString(b[:])
}

// batches is what a run reads its batches from: a Loader over a text, or
// TokenBatches over pre-tokenized data.
type batches interface {
	Next(inputs, targets []int32)
	SetPos(pos int64) error
	position() int64
	lastStart() int64 // where the batch the last Next read began
}

// Trainer is one training run: the model, the data, and the offloaded
// optimizer that owns the parameters.
type Trainer struct {
	cfg     TrainConfig
	tok     Tokenizer
	loader  batches
	val     batches            // the validation data's, read from its start by Evaluate
	about   string             // the data, said after the model (none for the default: a byte-level text)
	w       *world             // the ranks: their replicas and optimizers (world.go)
	opt     *offload.Optimizer // rank 0's, whose plan and schedule the run reports
	saver   *saver             // the checkpoints into cfg.CkptDir
	rng     *rand.PCG
	logJSON *os.File // cfg.LogJSON's

	inputs, tgts []int32
	state        trainerState
	out          io.Writer
	tty          bool

	lock      *checkpoint.RootLock // cfg.CkptDir's, for the whole run
	closed    bool
	resumed   bool               // New loaded a checkpoint
	resumedAt int                // its iteration
	timeline  *IterationTimeline // cfg.TimelineAt's, once traced
	leaveSaid bool               // planIteration said what the speculation leaves to the phase
	// planWork, when set (tests), replaces the work planIteration's n-th
	// call (from 0) plans for: a test forces its moves with it.
	planWork func(n int, w offload.IterationWork) offload.IterationWork
	planN    int
}

// New builds a trainer over text with cfg: the optimizer with GPT-2's
// initial weights, or, with cfg.Resume, the state of the latest checkpoint
// in cfg.CkptDir (a fresh start when there is none). Progress goes to out
// (nil discards it).
//
// The text is tokenized by cfg.Tokenizer (the byte-level tokenizer reads
// it in place) and split by cfg.ValFraction (NewDataset); the batches are
// Loader's.
//
// With cfg.CkptDir, New takes the directory's lock for the run
// (checkpoint.Lock; Close releases it) and checks it before allocating
// anything; with cfg.Resume a damaged root is repaired first
// (checkpoint.Recover), and what was done is printed.
//
// Errors: an invalid configuration, a text too short (a *ShortDataError);
// a CkptDir that is not usable (a step directory, a file, not writable) or
// that another process writes under (checkpoint.ErrLocked); one that is not fresh
// without cfg.Resume (it holds checkpoints, or is damaged); a damaged root
// where no step directory verifies; a checkpoint that cannot be loaded
// or was made with another model, batch shape, tokenizer or text.
func New(cfg TrainConfig, text []byte, out io.Writer) (*Trainer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	tok, err := NewTokenizer(cfg.Tokenizer)
	if err != nil {
		return nil, err
	}
	id := trainerState{TextCRC: crc32.ChecksumIEEE(text), TextBytes: len(text)}
	if tok.Name() == "byte" { // the bytes are the tokens
		train, val, _, err := textBatches(text, &cfg)
		if err != nil {
			return nil, err
		}
		return newTrainer(cfg, tok, train, val, id, "", out)
	}
	toks, err := tok.Encode(text)
	if err != nil {
		return nil, err
	}
	train, val, d, err := textBatches(toks, &cfg)
	if err != nil {
		return nil, err
	}
	about := fmt.Sprintf("data: a text of %d bytes, %d %s tokens: %d training, %d validation\n", len(text), len(toks), tok.Name(), len(d.Train), len(d.Val))
	return newTrainer(cfg, tok, train, val, id, about, out)
}

// textBatches splits a text's tokens by cfg.ValFraction and returns the
// Loaders of both parts.
func textBatches[E Token](text []E, cfg *TrainConfig) (train, val batches, d *Dataset[E], err error) {
	d, err = NewDataset(text, cfg.ValFraction, cfg.Model.NCtx)
	var short *ShortDataError
	if errors.As(err, &short) {
		short.Text = true
	}
	if err != nil {
		return nil, nil, nil, err
	}
	train, err = NewLoader(d.Train, cfg.Batch, cfg.Model.NCtx)
	if err != nil {
		return nil, nil, nil, err
	}
	val, err = NewLoader(d.Val, cfg.Batch, cfg.Model.NCtx)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("trainer: the validation split: %w", err)
	}
	return train, val, d, nil
}

// NewTokens builds a trainer over pre-tokenized data (dos train --data; see
// ReadTokens), as New does over a text. The training batches are
// TokenBatches' over train: llm.c's DataLoader order. val validates; when
// it is nil, the last cfg.ValFraction of train is held out instead (as
// NewDataset splits a text: training then reads
// train[:int(len(train)*(1-ValFraction))]). Evaluate reads the validation
// tokens from their start in the same order (Loader, which repeats rows
// when they hold less than a batch).
//
// Errors: those of New; a token outside the tokenizer's vocabulary; fewer
// training tokens than a batch and its last target (B*T+1), or validation
// tokens fewer than a sequence and its target (a *ShortDataError, which
// says both).
func NewTokens(cfg TrainConfig, train, val []uint16, out io.Writer) (*Trainer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	tok, err := NewTokenizer(cfg.Tokenizer)
	if err != nil {
		return nil, err
	}
	for _, part := range []struct {
		name string
		toks []uint16
	}{{"training", train}, {"validation", val}} {
		for i, x := range part.toks {
			if int(x) >= tok.VocabSize() {
				return nil, fmt.Errorf("trainer: %s token %d at index %d is outside --tokenizer %s's %d tokens", part.name, x, i, tok.Name(), tok.VocabSize())
			}
		}
	}
	crc, n := tokensCRC(train, val)
	id := trainerState{TextCRC: crc, TextBytes: n, Data: "tokens"}
	// Both parts are checked before either is cut, so that the error
	// says all that is short.
	B, T := cfg.Batch, cfg.Model.NCtx
	short := &ShortDataError{Tokens: len(train), Train: len(train), Val: len(val), NeedTrain: int64(B)*int64(T) + 1, NeedVal: int64(T) + 1, Ctx: T, Batch: B}
	if val == nil {
		short.ValFraction = cfg.ValFraction
		short.Train = splitAt(len(train), cfg.ValFraction)
		short.Val = len(train) - short.Train
	}
	if short.short() {
		return nil, short
	}
	held := ""
	if val == nil {
		d, err := NewDataset(train, cfg.ValFraction, cfg.Model.NCtx)
		if err != nil {
			return nil, err
		}
		train, val = d.Train, d.Val
		held = fmt.Sprintf(" (the last %g of the data)", cfg.ValFraction)
	}
	tb, err := NewTokenBatches(train, cfg.Batch, cfg.Model.NCtx)
	if err != nil {
		return nil, err
	}
	vl, err := NewLoader(val, cfg.Batch, cfg.Model.NCtx)
	if err != nil {
		return nil, fmt.Errorf("trainer: the validation data: %s", strings.TrimPrefix(err.Error(), "trainer: "))
	}
	about := fmt.Sprintf("data: %d training tokens in llm.c's order (%d batches a pass), %d validation tokens%s\n", len(train), tb.Batches(), len(val), held)
	id.TrainTokens = len(train)
	return newTrainer(cfg, tok, tb, vl, id, about, out)
}

// tokensCRC returns the CRC-32 (IEEE) and the length in bytes of parts'
// tokens as little-endian uint16, one after the other.
func tokensCRC(parts ...[]uint16) (uint32, int) {
	var crc uint32
	n := 0
	buf := make([]byte, 0, 1<<16)
	for _, p := range parts {
		for i, x := range p {
			buf = binary.LittleEndian.AppendUint16(buf, x)
			if len(buf) == cap(buf) || i == len(p)-1 {
				crc = crc32.Update(crc, crc32.IEEETable, buf)
				n += len(buf)
				buf = buf[:0]
			}
		}
	}
	return crc, n
}

// zeroOneRank, when set (tests), trains one rank through the ZeRO-3 path
// (zero.go, zerogpu.go) over its collectives ("nccl" or "staged" on the
// GPU, anything on the host): over one rank they are copies, so the
// trajectory is the single rank's, bit for bit.
var zeroOneRank string

// newTrainer is New and NewTokens once the data is ready: id holds the
// data's identity (TextCRC, TextBytes, Data) and about is said after the
// model's line.
func newTrainer(cfg TrainConfig, tok Tokenizer, loader, val batches, id trainerState, about string, out io.Writer) (*Trainer, error) {
	var err error
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
	if cfg.Device == "cuda" { // no GPU: said before anything is locked or allocated
		if err := gpuAvailable(); err != nil {
			return nil, err
		}
	}
	if cfg.CkptDir != "" {
		if lock, from, err = openRoot(&cfg, out); err != nil {
			return nil, err
		}
	}
	// The replicas first (on the GPU their activations are allocated
	// before the update phase's budget is taken from what is left), then
	// the ranks' optimizers.
	w, err := newWorld(&cfg, out)
	if err != nil {
		return nil, err
	}
	// What the world chose on its copy: --stream-blocks auto's count and
	// --speculate auto's slots at that count.
	cfg.streamModel, cfg.streamKey, cfg.specAuto = w.cfg.streamModel, w.cfg.streamKey, w.cfg.specAuto
	opt := w.ranks[0].opt
	// The subgroup size the optimizer cut at (SubgroupSizes: the model's
	// choice) is the run's: checkpoints record it and a resume keeps it.
	if len(cfg.SubgroupSizes) > 0 {
		cfg.SubgroupSize = opt.Options().SubgroupSize
	}
	id.LossScale, id.InitialLoss, id.InitValLoss = cfg.LossScale, maybeLoss(math.NaN()), maybeLoss(math.NaN())
	t := &Trainer{cfg: cfg, tok: tok, loader: loader, val: val, about: about, w: w, opt: opt, out: out, lock: lock,
		rng: rand.NewPCG(cfg.Seed, 0x5eed), state: withRunID(id),
	}
	t.saver = &saver{w: w, root: cfg.CkptDir, keep: cfg.CkptKeep, logf: t.logf, committed: -1}
	if f, ok := out.(*os.File); ok {
		if fi, err := f.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
			t.tty = true
		}
	}
	// The initial weights, drawn a window of tensors at a time on the
	// CPU's cores (the whole model's in fp32 would be 4 bytes a parameter
	// more at the peak).
	started := time.Now()
	ts := cfg.Model.Tensors()
	if err := initWeights(cfg.Model, cfg.Seed, workers(), initWindow, func(i int, v []float32) error { return w.setParam(i, ts[i].Name, v) }); err != nil {
		return nil, errors.Join(err, t.Close())
	}
	if el := time.Since(started); el > time.Second { // a large model's: said, as the calibration's is
		fmt.Fprintf(out, "initial weights in %.1f s\n", el.Seconds())
	}
	if from != nil {
		if err := t.resume(from.Dir); err != nil {
			return nil, errors.Join(err, t.Close())
		}
		t.resumed, t.resumedAt = true, t.state.Iteration
		t.saver.committed = int64(t.state.Iteration) // the job's latest, which a failed save leaves
	}
	if err := t.bind(); err != nil {
		return nil, errors.Join(err, t.Close())
	}
	if cfg.LogJSON != "" {
		if t.logJSON, err = os.OpenFile(cfg.LogJSON, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644); err != nil {
			return nil, errors.Join(fmt.Errorf("trainer: --log-json: %w", err), t.Close())
		}
	}
	ok = true
	return t, nil
}

// bind binds every rank's replica to its optimizer (world.bind) and
// allocates the batch's tokens.
func (t *Trainer) bind() error {
	T := t.cfg.Model.NCtx
	t.inputs = make([]int32, t.cfg.Batch*T)
	t.tgts = make([]int32, t.cfg.Batch*T)
	return t.w.bind()
}

// Close releases the optimizer's workers, the update phase's device, the
// lazy checkpoint engine (waiting for its save in flight) and the lock of
// cfg.CkptDir. A second Close does nothing.
//
// Errors: the optimizer's (device memory not freed) and a lazy checkpoint
// that failed and was not reported yet (checkpoint.Engine.Close); all is
// released whatever they say.
func (t *Trainer) Close() error {
	var errs []error
	if !t.closed {
		// A lazy save still in flight (a run stopped by an error after
		// it): durable (a job's committed) before the optimizers close.
		errs = append(errs, t.saver.report(true))
		errs = append(errs, t.w.close(), t.saver.close())
		t.closed = true
	}
	if t.logJSON != nil {
		errs = append(errs, t.logJSON.Close())
		t.logJSON = nil
	}
	t.lock.Unlock()
	return errors.Join(errs...)
}

// Resumed returns the iteration of the checkpoint New resumed from and
// true, or 0 and false for a fresh start. Resumed at or past cfg.Steps,
// the run has nothing to train (New says so): Run prints nothing, saves
// nothing, and returns the checkpoint's summary with its validation loss
// (no sample, no rates).
func (t *Trainer) Resumed() (iteration int, ok bool) { return t.resumedAt, t.resumed }

// NumParams returns the model's parameter count.
func (t *Trainer) NumParams() int { return t.cfg.Model.NumParams() }

// Evaluate returns the mean loss over cfg.EvalBatches batches of the
// validation split, read from its start (the same batches every time).
//
// Errors: only on the GPU (a device fault).
func (t *Trainer) Evaluate() (float64, error) {
	n := max(t.cfg.EvalBatches, 1)
	t.val.SetPos(0) // cannot fail: every loader holds a sequence
	if err := t.w.refresh(); err != nil {
		return 0, err
	}
	var sum float64
	for range n {
		t.val.Next(t.inputs, t.tgts)
		l, err := t.w.loss(t.inputs, t.tgts)
		if err != nil {
			return 0, err
		}
		sum += l
	}
	return sum / float64(n), nil
}

// forward runs the forward of the batch in t.inputs and t.tgts on every
// rank, for a backward of scale × loss. With marks (the traced iteration:
// TrainConfig.TimelineAt) it records when forward ended, the device
// synchronised first; on one GPU it sets *end to that time too (the
// iteration's model measures the forward alone: a stream's sync, no more),
// elsewhere to when forward returned.
func (t *Trainer) forward(scale float32, marks *timelineMarks, end *time.Time) error {
	var mark func()
	if marks != nil || t.modelsIteration() {
		mark = func() {
			*end = time.Now()
			if marks != nil {
				marks.forward = *end
				t.markMemory(marks, marks.forward)
			}
		}
	}
	if err := t.w.forward(t.inputs, t.tgts, scale, mark); err != nil {
		return err
	}
	if mark == nil {
		*end = time.Now()
	}
	return nil
}

// lossScale is the loss scale of the next backward: TrainState.LossScale,
// 1 without one.
func (t *Trainer) lossScale() float32 {
	if t.state.LossScale > 0 {
		return float32(t.state.LossScale)
	}
	return 1
}

// overlapForward says whether iteration it+1's forward runs during
// iteration it's update phase (between StepAsync and WaitStep): not with
// TrainConfig.NoOverlapForward, nor after the last iteration, nor where
// iteration it ends in an evaluation or a checkpoint (they read the
// weights, and a checkpoint saves the data's position), nor into the
// traced iteration (its forward is timed alone; the one after it runs
// during its step, drawn as NextForward), nor on a replica that does not
// wait for the weights per block (a job's ZeRO-3 ranks).
func (t *Trainer) overlapForward(it int) bool {
	cfg := &t.cfg
	return t.forwardOverlaps() && it < cfg.Steps &&
		!(cfg.EvalEvery > 0 && it%cfg.EvalEvery == 0) &&
		!(cfg.CkptEvery > 0 && it%cfg.CkptEvery == 0) &&
		it+1 != cfg.TimelineAt
}

// forwardOverlaps says whether the run's forwards run during the update
// phase before them (overlapForward, where nothing comes between): not
// with TrainConfig.NoOverlapForward, nor on a replica that does not wait
// for the weights per block.
func (t *Trainer) forwardOverlaps() bool { return !t.cfg.NoOverlapForward && t.w.overlapsUpdate() }

// iterationWork is the iteration's work for the performance model
// (offload.IterationWork): the forward and backward measured alone, the
// blocks, whether the forward overlaps the phase.
func (t *Trainer) iterationWork(fwd, bwd time.Duration) offload.IterationWork {
	return offload.IterationWork{Forward: fwd.Seconds(), Backward: bwd.Seconds(), Blocks: t.cfg.Model.NLayer, OverlapForward: t.forwardOverlaps()}
}

func (t *Trainer) logf(format string, args ...any) {
	if t.tty {
		fmt.Fprint(t.out, "\r\033[K")
	}
	fmt.Fprintf(t.out, format, args...)
}

// PeakFLOPS is the dense bf16 peak MFU is measured against, in FLOP/s:
// the H100 and H200 SXM datasheets' 989 TFLOP/s.
const PeakFLOPS = 989e12

// stepRecord is one line of --log-json: an optimizer step.
type stepRecord struct {
	Step     int     `json:"step"`      // the iteration, from 1
	Loss     float64 `json:"loss"`      // the batch's mean loss before the update, nats per token
	LR       float64 `json:"lr"`        // the learning rate of the update
	GradNorm float64 `json:"grad_norm"` // global L2 norm before clipping (0 without clipping)
	Skipped  bool    `json:"skipped"`   // a non-finite gradient skipped the update
	Pos      int64   `json:"pos"`       // the batch's first token in the training data
	Seconds  float64 `json:"seconds"`   // the iteration's wall time
	UpdateS  float64 `json:"update_s"`  // the optimizer step's wall time
	// With --replan: the plan's predicted update phase and the measured
	// one (seconds: the phase's span from its first operation to its
	// last, scheduler.Busy.Makespan, within UpdateS's wall time, which
	// adds the global checks, the speculation's validation and the
	// waits), and whether the schedule was re-planned after it.
	PredictedS float64 `json:"predicted_s,omitempty"`
	MeasuredS  float64 `json:"measured_s,omitempty"`
	Replanned  bool    `json:"replanned,omitempty"`
	// With --speculate: the parameters updated during the backward and
	// kept (offload.StepResult.Speculated), and with --speculate-gpu those
	// of the streamed subgroups (offload.StepResult.SpeculatedGPU).
	Speculated    int64 `json:"speculated,omitempty"`
	SpeculatedGPU int64 `json:"speculated_gpu,omitempty"`
}

// Run trains from the current iteration to cfg.Steps and returns the
// summary. A non-finite loss stops it with an error; the last checkpoint
// written before stays the latest. With cfg.Steps equal to the current
// iteration (0 for a fresh run) it trains nothing and saves the
// checkpoint of that iteration: step 0 is the initial weights.
func (t *Trainer) Run() (Summary, error) {
	cfg := &t.cfg
	sum := Summary{Params: t.NumParams()}
	tokens := cfg.Batch * cfg.Model.NCtx
	flops := cfg.Model.FLOPsPerToken(cfg.Model.NCtx)
	peak := PeakFLOPS * float64(max(t.w.gpus, 1)) // MFU is per GPU: over the GPUs' peak
	if t.resumed && t.state.Iteration >= cfg.Steps {
		// Nothing to train (New said so): the checkpoint's summary, its
		// validation loss evaluated, without the run's header, log
		// lines or sample.
		sum.Steps, sum.FinalLoss = t.state.Iteration, t.state.LastLoss
		sum.InitialLoss, sum.InitValLoss = t.state.InitialLoss.or0(), t.state.InitValLoss.or0()
		l, err := t.Evaluate()
		sum.ValLoss = l
		return sum, err
	}
	fmt.Fprintf(t.out, "dos train: GPT-2 %d layers, %d heads, width %d, context %d, vocab %d: %d params; batch %d (%d tokens); %s; forward and backward on the %s; %v\n",
		cfg.Model.NLayer, cfg.Model.NHead, cfg.Model.NEmbd, cfg.Model.NCtx, cfg.Model.VocabSize, t.NumParams(), cfg.Batch, tokens, Iterations(cfg.Steps), t.w.where(), peakOptions(t.opt.Options(), cfg.LR))
	fmt.Fprint(t.out, t.about)
	if cfg.CkptDir != "" { // said every run: --ckpt-every and --ckpt-keep are this run's, never a checkpoint's
		every := "at the end"
		if cfg.CkptEvery > 0 {
			every = fmt.Sprintf("every %d iterations and at the end", cfg.CkptEvery)
		}
		keep, how := "all", "lazily"
		if cfg.CkptKeep > 0 {
			keep = fmt.Sprintf("the newest %d", cfg.CkptKeep)
		}
		if cfg.CkptSync {
			how = "synchronously"
		}
		fmt.Fprintf(t.out, "checkpoints into %s: %s, %s, keeping %s (this run's --ckpt-every, --ckpt-sync, --ckpt-keep)\n", cfg.CkptDir, every, how, keep)
	}
	sched := ""
	if s, ok := t.opt.Schedule(); ok {
		k := "inf"
		if !math.IsInf(s.K(), 1) {
			k = fmt.Sprintf("%.2f", s.K())
		}
		sched = fmt.Sprintf("%d/%d/%d", s.CPU, s.GPU, s.Resident)
		per := ""
		if t.w.job {
			per = " (rank 0's shard)"
		}
		held := 0
		for _, sg := range t.opt.Subgroups() {
			if sg.HostHeld {
				held++
			}
		}
		first := ""
		if t.opt.Options().ResidentFirst && s.Resident > 0 {
			first = ", the resident ones first in the model (--resident-first)"
		}
		fmt.Fprintf(t.out, "update phase on %s%s: %d of %d subgroups on the CPU, %d streamed through the GPU, %d resident (k = %s, upcast on the GPU: %v)%s\n",
			t.opt.Options().Device.Name(), per, s.CPU, len(t.opt.Subgroups())-held, s.GPU, s.Resident, k, s.UpcastOnGPU, first)
		if b := t.opt.Options().Speculate; b > 0 {
			auto := ""
			if cfg.Speculate == SpeculateAuto {
				auto = " (--speculate auto)"
			}
			fmt.Fprintf(t.out, "speculative updates in the backward: %.2f GiB of host memory%s for the slots of up to %.3gB parameters' new state a step, kept when the step neither clips nor is skipped\n",
				float64(b)/(1<<30), auto, float64(b/offload.SpeculateBytes(1, false))/1e9)
		} else if cfg.Speculate == SpeculateAuto && cfg.maySpeculate() {
			fmt.Fprintf(t.out, "speculative updates in the backward: none (--speculate auto: under 512 MiB of host memory left, of which it takes half)\n")
		}
	}
	fmt.Fprint(t.out, t.w.ranks[0].rep.describe(cfg))
	if math.IsNaN(float64(t.state.InitValLoss)) {
		l, err := t.Evaluate()
		if err != nil {
			return sum, err
		}
		t.state.InitValLoss = maybeLoss(l)
		t.logf("iter %5d  val_loss %.4f\n", t.state.Iteration, t.state.InitValLoss)
	}
	start := time.Now()
	var warm time.Time // the end of this run's first iteration
	done := 0
	// The update phases, and the forwards and backwards of the iterations
	// whose forward ran in their own iteration (not during the last update
	// phase: serial counts them); the first iteration's left out.
	var updates, forwards, backwards time.Duration
	serial := 0
	// steady is the iterations after the first whose forward ran as the
	// run's do (during the last update phase with the overlap, else
	// alone) and that moved no state for a re-plan: steadyN of them, the
	// iteration the model predicts.
	var steady time.Duration
	steadyN := 0
	overlap := t.forwardOverlaps()
	planned := false                    // planIteration has run
	keptSince := 0                      // with --replan, the steps that kept speculative updates since planIteration ran, until it runs again
	var speculated, speculatedGPU int64 // parameters kept from the CPU's and the GPU's speculative updates, this run
	specSteps := 0                      // the steps that kept some
	// ahead: the next iteration's forward ran during this one's update
	// phase (overlapForward), on the batch from aheadPos with that scale.
	ahead, aheadPos, aheadScale := false, int64(0), float32(1)
	for t.state.Iteration < cfg.Steps {
		it := t.state.Iteration + 1
		t0 := time.Now()
		ranAhead := ahead // this iteration's forward ran during the last update phase
		moved := false    // planIteration moved the state after this iteration's step
		if err := t.w.setLR(cfg.LRAt(it)); err != nil {
			return sum, err
		}
		var marks *timelineMarks
		pos, scale := aheadPos, aheadScale
		f1 := t0 // the end of this iteration's own forward
		if !ahead {
			t.loader.Next(t.inputs, t.tgts)
			pos, scale = t.loader.lastStart(), t.lossScale()
			if it == cfg.TimelineAt {
				marks = &timelineMarks{t0: t0}
				t.markMemory(marks, t0)
			}
			if err := t.forward(scale, marks, &f1); err != nil {
				return sum, err
			}
		}
		b0 := time.Now() // the backward's start: the forward is done, or queued ahead of it on the host
		loss, err := t.w.backward()
		if err != nil {
			return sum, err
		}
		if math.IsNaN(loss) || math.IsInf(loss, 0) {
			return sum, fmt.Errorf("trainer: loss %v at iteration %d: diverged", loss, it)
		}
		s0 := time.Now()
		if marks != nil {
			t.markMemory(marks, s0)
		}
		// The next iteration's forward over this update phase's tail,
		// each block once its weights are written; but on one GPU the
		// second iteration's forward runs alone, once, to measure it
		// (the iteration's prediction and bound need its time).
		ahead = (done > 0 || !t.modelsIteration()) && t.overlapForward(it)
		res, err := t.w.stepAsync(offload.StepArgs{LossScale: float64(scale), Beside: ahead})
		if err != nil {
			return sum, err
		}
		if t.state.LossScale > 0 { // res.Skipped is known: the next forward's scale
			if res.Skipped {
				t.state.LossScale = max(t.state.LossScale/2, 1) // floor 1: see validScale
				t.state.GoodSteps = 0
			} else if t.state.GoodSteps++; t.state.GoodSteps == ScaleGrowthInterval {
				t.state.LossScale = min(t.state.LossScale*2, 1<<64)
				t.state.GoodSteps = 0
			}
		}
		if ahead {
			t.loader.Next(t.inputs, t.tgts)
			aheadPos, aheadScale = t.loader.lastStart(), t.lossScale()
			var end func() // the traced iteration's: NextForward's span
			if marks != nil {
				marks.next[0] = time.Now()
				end = func() { marks.next[1] = time.Now() }
			}
			if err := t.w.forward(t.inputs, t.tgts, aheadScale, end); err != nil {
				_, werr := t.w.waitStep()
				return sum, errors.Join(err, werr)
			}
		}
		if res, err = t.w.waitStep(); err != nil {
			return sum, err
		}
		if marks != nil {
			s1 := time.Now()
			t.markMemory(marks, s1)
			t.finishTimeline(it, marks, s0, s1)
		}
		if done > 0 { // the first update of a run also pays for the caches and page tables warming up
			updates += res.Elapsed
			if !ranAhead {
				forwards += f1.Sub(t0)
				backwards += s0.Sub(b0)
				serial++
			}
			// The schedule for the iteration, once: from the forward and
			// backward measured alone, at the first step that kept
			// speculative updates (their rate measured).
			// With --replan, once more after replanIterationAfter more
			// such steps: their phases corrected the CPU's rate
			// (offload's refit from a speculating phase), which the
			// first plan took from the profile alone.
			if planned && keptSince >= 0 && res.Speculated > 0 && t.cfg.Replan {
				if keptSince++; keptSince == replanIterationAfter {
					keptSince = -1 // once
					if moved, err = t.planIteration(it, forwards/time.Duration(serial), backwards/time.Duration(serial), &sched); err != nil {
						return sum, err
					}
				}
			}
			if !planned && serial > 0 && res.Speculated > 0 {
				planned = true
				if moved, err = t.planIteration(it, forwards/time.Duration(serial), backwards/time.Duration(serial), &sched); err != nil {
					return sum, err
				}
			}
		}
		speculated += res.Speculated
		speculatedGPU += res.SpeculatedGPU
		if res.Speculated > 0 || res.SpeculatedGPU > 0 {
			specSteps++
		}
		if res.Skipped {
			sum.Skipped++
		}
		if res.Replanned {
			s, _ := t.opt.Schedule()
			plan, _ := t.opt.Plan()
			sched = fmt.Sprintf("%d/%d/%d", s.CPU, s.GPU, s.Resident)
			t.logf("iter %5d  re-planned the update phase: measured %.1f ms, predicted %.1f ms; now %d CPU / %d streamed / %d resident subgroups, predicted %.1f ms\n",
				it, 1e3*res.Measured.Seconds(), 1e3*res.Predicted.Seconds(), s.CPU, s.GPU, s.Resident, 1e3*plan.Makespan)
		}
		t.state.Iteration = it
		t.state.LastLoss = loss
		done++
		if math.IsNaN(float64(t.state.InitialLoss)) {
			t.state.InitialLoss = maybeLoss(loss)
		}
		now := time.Now()
		if done == 1 {
			warm = now
		}
		if done > 1 && ranAhead == overlap && !res.Replanned && !moved {
			steady += now.Sub(t0)
			steadyN++
		}
		if t.logJSON != nil {
			rec := stepRecord{Step: it, Loss: loss, LR: cfg.LRAt(it), GradNorm: res.GradNorm, Skipped: res.Skipped, Pos: pos,
				Seconds: now.Sub(t0).Seconds(), UpdateS: res.Elapsed.Seconds(),
				PredictedS: res.Predicted.Seconds(), MeasuredS: res.Measured.Seconds(), Replanned: res.Replanned, Speculated: res.Speculated, SpeculatedGPU: res.SpeculatedGPU}
			if err := writeRecord(t.logJSON, rec); err != nil {
				return sum, fmt.Errorf("trainer: --log-json: %w", err)
			}
		}
		// The rate leaves the first iteration out (warm-up: cuBLASLt's
		// plans, page faults), once there is a second.
		rate := float64(done*tokens) / now.Sub(start).Seconds()
		if done > 1 {
			rate = float64((done-1)*tokens) / now.Sub(warm).Seconds()
		}
		logNow := cfg.LogEvery > 0 && (it%cfg.LogEvery == 0 || it == cfg.Steps)
		var line string
		if t.tty || logNow { // only then: the GPU's memory is a driver call
			norm := "-" // --clip 0: the norm is not computed (the log's grad_norm is 0)
			if cfg.MaxGradNorm > 0 {
				norm = fmt.Sprintf("%.3f", res.GradNorm)
			}
			line = fmt.Sprintf("iter %5d/%d  loss %.4f  lr %.2e  grad_norm %s  %.0f tok/s", it, cfg.Steps, loss, cfg.LRAt(it), norm, rate)
			if t.w.gpus > 0 {
				used, _ := t.w.memory()
				line += fmt.Sprintf("  MFU %.1f%%  update %.0f ms (%s)  GPU %.1f GiB", 100*rate*flops/peak, 1e3*res.Elapsed.Seconds(), sched, float64(used)/(1<<30))
			}
			line += "  ETA " + eta(float64(cfg.Steps-it)*float64(tokens)/rate)
		}
		if t.tty {
			fmt.Fprint(t.out, "\r\033[K"+line)
		}
		if logNow {
			skipped := ""
			if res.Skipped {
				skipped = fmt.Sprintf("  SKIPPED (loss scale now %g)", t.state.LossScale)
			}
			t.logf("%s%s\n", line, skipped)
		}
		if cfg.EvalEvery > 0 && it%cfg.EvalEvery == 0 && it != cfg.Steps {
			l, err := t.Evaluate()
			if err != nil {
				return sum, err
			}
			t.logf("iter %5d  val_loss %.4f\n", it, l)
		}
		if err := t.saver.report(false); err != nil { // a lazy checkpoint durable since the last iteration
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
			limit := ""
			if lim, ok := t.opt.Limit(); ok && lim.Makespan > 0 {
				if speculated+speculatedGPU == 0 {
					sum.UpdateLimitS = lim.Makespan
					limit = fmt.Sprintf("; the machine's limit %.3f ms (the model's fluid limit), %+.1f%% of it", 1e3*lim.Makespan, 100*(sum.UpdateS/lim.Makespan-1))
				} else {
					// (nor is the limit: it covers the whole phase)
					limit = fmt.Sprintf("; %.0f parameters' CPU updates and %.0f of the GPU's a step were done in the backward (the mean of the %d steps that kept speculative updates), outside the phase and its limit", float64(speculated)/float64(specSteps), float64(speculatedGPU)/float64(specSteps), specSteps)
				}
			}
			if b, ok := t.opt.Bound(); ok && b.Seconds > 0 && speculated+speculatedGPU == 0 {
				// (a phase that kept speculative updates did part of its
				// work in the backward: the bound is not its)
				sum.UpdateBoundS = b.Seconds
				limit += fmt.Sprintf("; its lower bound %.3f ms (%s, every resource at its rate alone)", 1e3*b.Seconds, b.Bottleneck)
			}
			per := ""
			if t.w.job {
				per = " of rank 0's shard"
			}
			t.logf("update phase%s: %.3f ms measured (mean of iterations 2..%d of this run), %.3f ms predicted by the performance model (CPU/GPU/resident subgroups %d/%d/%d, bottleneck %s)%s\n",
				per, 1e3*sum.UpdateS, done, 1e3*plan.Makespan, plan.CPU, plan.GPU, plan.Resident, plan.Bottleneck, limit)
		}
		sum.TokensPerS = float64(done*tokens) / time.Since(start).Seconds()
		if done > 1 {
			sum.TokensPerS = float64((done-1)*tokens) / time.Since(warm).Seconds()
			sum.IterationS = time.Since(warm).Seconds() / float64(done-1)
			t.iterationModel(&sum, forwards, backwards, serial, steady, steadyN)
		}
		if t.w.gpus > 0 {
			sum.MFU = sum.TokensPerS * flops / peak
		}
	}
	if cfg.CkptDir != "" && (done > 0 && (cfg.CkptEvery == 0 || t.state.Iteration%cfg.CkptEvery != 0) || done == 0 && t.state.Iteration == 0 && !t.resumed) {
		if err := t.save(); err != nil {
			return sum, err
		}
	}
	if err := t.saver.report(true); err != nil { // the last checkpoint is durable before Run returns
		return sum, err
	}
	sum.FinalLoss = t.state.LastLoss
	sum.InitialLoss, sum.InitValLoss = t.state.InitialLoss.or0(), t.state.InitValLoss.or0()
	l, err := t.Evaluate()
	if err != nil {
		return sum, err
	}
	sum.ValLoss = l
	sum.Steps = t.state.Iteration
	t.logf("iter %5d  val_loss %.4f (from %.4f)\n", t.state.Iteration, sum.ValLoss, sum.InitValLoss)
	if cfg.SampleBytes > 0 && cfg.Steps > 0 { // --steps 0 saves the initial weights: nothing to hear yet
		if sum.Sample, err = t.Sample([]byte("\nLight "), cfg.SampleBytes); err != nil {
			return sum, err
		}
		fmt.Fprintf(t.out, "sample: %q\n", sum.Sample)
	}
	return sum, nil
}

// writeRecord writes rec as one JSON line.
func writeRecord(w io.Writer, rec stepRecord) error {
	b, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	_, err = w.Write(append(b, '\n'))
	return err
}

// eta formats a duration in seconds as 1h02m, 3m04s or 5s.
func eta(sec float64) string {
	if !(sec >= 0) || math.IsInf(sec, 0) {
		return "?"
	}
	d := time.Duration(sec * float64(time.Second)).Round(time.Second)
	switch h, m := int(d.Hours()), int(d.Minutes())%60; {
	case h > 0:
		return fmt.Sprintf("%dh%02dm", h, m)
	case m > 0:
		return fmt.Sprintf("%dm%02ds", m, int(d.Seconds())%60)
	}
	return fmt.Sprintf("%ds", int(d.Seconds()))
}

// Sample continues prompt by at least n bytes drawn from the model's
// distribution (temperature 1, over the tokenizer's vocabulary: never a
// padding id) with the trainer's RNG, and returns the whole text. It draws
// tokens until they decode to n bytes or more, n at most (byte-level: n
// tokens, n bytes). An empty prompt starts from GPT-2's <|endoftext|>, or
// a newline byte-level.
//
// Errors: only on the GPU (a device fault, out of memory for the B = 1
// model).
func (t *Trainer) Sample(prompt []byte, n int) (string, error) {
	T := t.cfg.Model.NCtx
	r := rand.New(t.rng)
	if err := t.w.refresh(); err != nil {
		return string(prompt), err
	}
	p, err := t.tok.Encode(prompt)
	if err != nil {
		return string(prompt), nil // unreachable: the tokenizers encode any bytes
	}
	ctx := make([]int32, len(p), len(p)+n)
	for i, x := range p {
		ctx[i] = int32(x)
	}
	if len(ctx) == 0 {
		ctx = append(ctx, '\n')
		if t.tok.Name() == "gpt2" {
			ctx[0] = gpt2EOT
		}
	}
	out := append([]byte(nil), prompt...)
	for made := 0; made < n && len(out)-len(prompt) < n; made++ {
		logits, err := t.w.next(ctx[max(0, len(ctx)-T):])
		if err != nil {
			return string(out), err
		}
		next := int32(sampleLogits(logits[:t.tok.VocabSize()], r.Float64()))
		ctx = append(ctx, next)
		piece, _ := t.tok.Decode([]int32{next}) // next is in the vocabulary
		out = append(out, piece...)
	}
	return string(out), nil
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

// maybeLoss is a loss that may not be known yet: NaN, written as null in
// JSON and read back as NaN.
type maybeLoss float64

func (l maybeLoss) MarshalJSON() ([]byte, error) {
	if math.IsNaN(float64(l)) {
		return []byte("null"), nil
	}
	return json.Marshal(float64(l))
}

func (l *maybeLoss) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		*l = maybeLoss(math.NaN())
		return nil
	}
	return json.Unmarshal(b, (*float64)(l))
}

// or0 is the loss, or 0 when it is not known.
func (l maybeLoss) or0() float64 {
	if math.IsNaN(float64(l)) {
		return 0
	}
	return float64(l)
}

// modelsIteration says whether the run predicts and bounds its iteration
// (iterationModel): on one GPU, not in a ZeRO-3 job.
func (t *Trainer) modelsIteration() bool { return t.w.gpus > 0 && !t.w.job }

// iterationModel sets sum.IterationPredictedS and sum.IterationBoundS on
// one GPU with a profile, from the mean forward and backward of the
// serial iterations (serial of them, whose forward ran in their own
// iteration, the first left out: the overlap runs the second's alone to
// measure it) and the streamed blocks' copies, and says them beside the
// measured iteration: the mean of the steadyN steady iterations (steady
// in all; see Run), else sum.IterationS. With no serial iteration it says
// why there are none.
func (t *Trainer) iterationModel(sum *Summary, forwards, backwards time.Duration, serial int, steady time.Duration, steadyN int) {
	if !t.modelsIteration() {
		return
	}
	measured, of := sum.IterationS, "the mean of this run's iterations after the first"
	if steadyN > 0 {
		measured, of = steady.Seconds()/float64(steadyN), fmt.Sprintf("the mean of %s that moved no state for a re-plan, after the first", Iterations(steadyN))
	}
	if serial == 0 {
		t.logf("iteration: %.1f ms measured (%s); its prediction and lower bound need the forward's time alone, which no iteration after the first measured (every forward ran during the update phase before it)\n", 1e3*measured, of)
		return
	}
	work := t.iterationWork(forwards/time.Duration(serial), backwards/time.Duration(serial))
	fwd, bwd := work.Forward, work.Backward
	line := fmt.Sprintf("iteration: %.1f ms measured (%s; forward %.1f ms and backward %.1f ms alone)", 1e3*measured, of, 1e3*fwd, 1e3*bwd)
	if p, ok := t.opt.PredictIteration(work); ok && p.Seconds > 0 {
		sum.IterationPredictedS = p.Seconds
		how := "forward, backward and update phase in turn"
		if work.OverlapForward {
			how = "the next forward beside the update phase"
		}
		if p.Speculated > 0 {
			how += fmt.Sprintf(", %.1f ms of the CPU's updates speculated in the backward at %.2f Gparam/s, the last phase's", 1e3*p.Speculated, p.SpeculateRate/1e9)
		}
		line += fmt.Sprintf(", %.1f ms predicted (%s; %+.1f%% measured over it; serial %.1f ms)", 1e3*p.Seconds, how, 100*(measured/p.Seconds-1), 1e3*p.Serial)
	}
	h2d, d2h := StreamedCopyBytes(t.cfg.Model, t.cfg.Streamed())
	if b, ok := t.opt.IterationBound(offload.Iteration{Compute: fwd + bwd, H2DBytes: h2d, D2HBytes: d2h}); ok && b.Seconds > 0 {
		sum.IterationBoundS = b.Seconds
		line += fmt.Sprintf(", its lower bound %.1f ms (%s-bound: the forward and backward and the update phase's work at each resource's rate alone, every overlap reached), %.2fx it", 1e3*b.Seconds, b.Bottleneck, measured/b.Seconds)
	}
	t.logf("%s\n", line)
}

// planIteration, with speculation on one GPU, has the optimizer choose
// the update phase's schedule for the whole iteration, after iteration it
// (whose step kept speculative updates), from a forward and backward of
// fwd and bwd alone (offload.Optimizer.PlanIteration: speculation hides
// CPU work in the backward, so the iteration's best schedule may give the
// CPU more than the phase's does); it says so and returns true when it
// moved. sched is the log lines' schedule.
func (t *Trainer) planIteration(it int, fwd, bwd time.Duration, sched *string) (moved bool, err error) {
	if !t.modelsIteration() || t.opt.Options().Speculate == 0 {
		return false, nil
	}
	work := t.iterationWork(fwd, bwd)
	if t.planWork != nil {
		work = t.planWork(t.planN, work)
		t.planN++
	}
	before, _ := t.opt.PredictIteration(work)
	if moved, err = t.opt.PlanIteration(work); err != nil {
		return false, err
	}
	if n := t.opt.SpeculateLeave(); n > 0 && !t.leaveSaid {
		t.leaveSaid = true
		t.logf("iter %5d  the speculation leaves %.2fB parameters' CPU updates to the phase, every other subgroup of the last ones, so that the CPU works while the next forward runs the blocks before them (forward %.1f ms alone)\n", it, float64(n)/1e9, 1e3*fwd.Seconds())
	}
	if !moved {
		return false, nil
	}
	s, _ := t.opt.Schedule()
	*sched = fmt.Sprintf("%d/%d/%d", s.CPU, s.GPU, s.Resident)
	after, _ := t.opt.PredictIteration(work)
	t.logf("iter %5d  planned the update phase for the iteration (forward %.1f ms, backward %.1f ms alone; speculation hides CPU work in the backward): now %d CPU / %d streamed / %d resident subgroups, the iteration predicted %.1f ms, was %.1f ms\n",
		it, 1e3*fwd.Seconds(), 1e3*bwd.Seconds(), s.CPU, s.GPU, s.Resident, 1e3*after.Seconds, 1e3*before.Seconds)
	return true, nil
}

// replanIterationAfter is how many steps that kept speculative updates,
// after the first plan for the iteration, a --replan run folds into the
// CPU's rate before it plans the iteration once more (offload's refit:
// the first sets the CPU's factor, each later one moves it halfway to its
// own).
const replanIterationAfter = 4

// StreamedCopyBytes returns the bytes one iteration's n streamed blocks
// of cfg's model move (blockStream, --stream-blocks): each block's bf16
// weights H2D before its forward and again before its backward, but for
// the two blocks whose slots still hold them from the forward (the last
// ones, the backward's first), and its bf16 gradients D2H once. n <= 0:
// none.
func StreamedCopyBytes(cfg Config, n int) (h2d, d2h float64) {
	n = max(n, 0)
	per := 2 * float64(blockStreamedElems(cfg))
	return per * float64(n+max(n-2, 0)), per * float64(n)
}

// Iterations says n iterations in English: "1 iteration", "3 iterations".
func Iterations(n int) string {
	if n == 1 {
		return "1 iteration"
	}
	return fmt.Sprintf("%d iterations", n)
}

// peakOptions is o with the peak learning rate (--lr) for the header: a
// resumed optimizer holds the schedule's rate of its iteration, which the
// header gave as if it were the run's lr; and the CPU workers it runs (0
// means GOMAXPROCS: the header said threads=0).
func peakOptions(o offload.Options, lr float64) offload.Options {
	o.Hyper.LR = lr
	o.Threads = cpuThreads(&o) // the workers it runs, not 0 for "GOMAXPROCS"
	return o
}
