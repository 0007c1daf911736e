package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/deepstates/dos"
	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/gpt"
	"github.com/deepstates/dos/trainer"
)

// dtypeFlag is a flag.Value for an adam.DType.
type dtypeFlag struct{ d *adam.DType }

func (f dtypeFlag) String() string {
	if f.d == nil {
		return ""
	}
	return f.d.String()
}
func (f dtypeFlag) Set(s string) error {
	d, err := adam.ParseDType(s)
	if err != nil {
		return err
	}
	*f.d = d
	return nil
}

// streamFlag is --stream-blocks: a count of blocks, or auto
// (trainer.StreamAuto).
type streamFlag struct{ n *int }

func (f streamFlag) String() string {
	if f.n == nil || *f.n == trainer.StreamAuto {
		return "auto"
	}
	return strconv.Itoa(*f.n)
}
func (f streamFlag) Set(s string) error {
	if s == "auto" {
		*f.n = trainer.StreamAuto
		return nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 {
		return fmt.Errorf("want a count of blocks >= 0, or auto")
	}
	*f.n = n
	return nil
}

// speculateFlag is --speculate: GiB, or auto.
type speculateFlag struct{ gib *float64 }

func (f speculateFlag) String() string {
	if f.gib == nil {
		return "0"
	}
	if *f.gib == trainer.SpeculateAuto {
		return "auto"
	}
	return strconv.FormatFloat(*f.gib, 'g', -1, 64)
}
func (f speculateFlag) Set(s string) error {
	if s == "auto" {
		*f.gib = trainer.SpeculateAuto
		return nil
	}
	x, err := strconv.ParseFloat(s, 64)
	if err != nil || !(x >= 0) || x > trainer.MaxMemoryBytes>>30 {
		return fmt.Errorf("want GiB from 0 to %d, or auto", trainer.MaxMemoryBytes>>30)
	}
	*f.gib = x
	return nil
}

// trainAbout is what dos train -h says before the flags.
const trainAbout = `Trains a GPT-2 with the offloaded AdamW optimizer, checkpointing through dos's checkpointer: by
default a small byte-level model on Newton's Opticks (losses in nats per byte). --model gpt2 (or
gpt2-medium, gpt2-large, gpt2-xl) takes GPT-2's size and its BPE tokenizer (losses in nats per
token); --text trains on a text file, tokenized by --tokenizer; --data on a file of tokens
(llm.c's or nanoGPT's .bin; dos tokenize writes one), read in llm.c's batch order.

With --resume the run continues from the latest checkpoint in --ckpt-dir and takes the model and
dtype configuration from it: --layers, --heads, --embd, --ctx, --batch, --grad-dtype,
--working-dtype, --subgroup-size, --tokenizer and --gpus, where not given on the command line
(--model gives the first four). One given that differs is named: the dtypes and the subgroup
size then change from here on; the model's shape, the tokenizer, the batch and the ranks
cannot, and the run is refused.

With --gpus N and --ckpt-dir each rank saves its pieces into --ckpt-dir/rank-%05d and the step
is committed in --ckpt-dir's latest only once every rank's save is durable: a rank that fails
leaves the previous checkpoint latest.`

// resumeFlags are the flags dos train --resume takes from the checkpoint
// when they are not on the command line, with how to copy each.
var resumeFlags = []struct {
	name string
	take func(cfg *trainer.TrainConfig, old trainer.TrainConfig)
	show func(c trainer.TrainConfig) string
}{
	{"layers", func(c *trainer.TrainConfig, o trainer.TrainConfig) { c.Model.NLayer = o.Model.NLayer }, func(c trainer.TrainConfig) string { return fmt.Sprint(c.Model.NLayer) }},
	{"heads", func(c *trainer.TrainConfig, o trainer.TrainConfig) { c.Model.NHead = o.Model.NHead }, func(c trainer.TrainConfig) string { return fmt.Sprint(c.Model.NHead) }},
	{"embd", func(c *trainer.TrainConfig, o trainer.TrainConfig) { c.Model.NEmbd = o.Model.NEmbd }, func(c trainer.TrainConfig) string { return fmt.Sprint(c.Model.NEmbd) }},
	{"ctx", func(c *trainer.TrainConfig, o trainer.TrainConfig) { c.Model.NCtx = o.Model.NCtx }, func(c trainer.TrainConfig) string { return fmt.Sprint(c.Model.NCtx) }},
	{"batch", func(c *trainer.TrainConfig, o trainer.TrainConfig) { c.Batch = o.Batch }, func(c trainer.TrainConfig) string { return fmt.Sprint(c.Batch) }},
	{"grad-dtype", func(c *trainer.TrainConfig, o trainer.TrainConfig) { c.GradDType = o.GradDType }, func(c trainer.TrainConfig) string { return c.GradDType.String() }},
	{"working-dtype", func(c *trainer.TrainConfig, o trainer.TrainConfig) { c.WorkingDType = o.WorkingDType }, func(c trainer.TrainConfig) string { return c.WorkingDType.String() }},
	{"subgroup-size", func(c *trainer.TrainConfig, o trainer.TrainConfig) { c.SubgroupSize = o.SubgroupSize }, subgroupSizeOf},
	{"gpus", func(c *trainer.TrainConfig, o trainer.TrainConfig) { c.GPUs = o.GPUs }, func(c trainer.TrainConfig) string { return fmt.Sprint(max(c.GPUs, 1)) }},
}

// applyPreset makes cfg the GPT-2 preset name (gpt.Preset) where c's
// flags --layers, --heads, --embd and --ctx were not given, with the gpt2
// tokenizer: --model, as dos train and dos plan --gpu-memory take it.
//
// Errors: an unknown name, listing the presets.
func applyPreset(c *cli, cfg *trainer.TrainConfig, name string) error {
	p, err := gpt.Preset(name)
	if err != nil {
		return fmt.Errorf("--model %q: want one of %s", name, strings.Join(gpt.PresetNames(), ", "))
	}
	for _, f := range []struct {
		name     string
		dst, src *int
	}{{"layers", &cfg.Model.NLayer, &p.NLayer}, {"heads", &cfg.Model.NHead, &p.NHead}, {"embd", &cfg.Model.NEmbd, &p.NEmbd}, {"ctx", &cfg.Model.NCtx, &p.NCtx}} {
		if !c.set(f.name) {
			*f.dst = *f.src
		}
	}
	cfg.Tokenizer = "gpt2"
	return nil
}

func runTrain(args []string, stdout, stderr io.Writer) int {
	cfg := trainer.DefaultTrainConfig()
	c := newCLI("dos train", "dos train [flags]", trainAbout)
	fs := c.FlagSet
	fs.IntVar(&cfg.Steps, "steps", cfg.Steps, "train to this iteration (one batch each); a resumed run continues to it")
	model := fs.String("model", "", "a GPT-2 preset `NAME`: gpt2, gpt2-medium, gpt2-large or gpt2-xl (124M to 1.5B: GPT-2's layers, heads and width, context 1024, vocabulary 50304); --layers, --heads, --embd and --ctx given too override the preset's; the tokenizer becomes gpt2")
	fs.IntVar(&cfg.Model.NLayer, "layers", cfg.Model.NLayer, "transformer blocks (overrides --model's; with --resume: the checkpoint's)")
	fs.IntVar(&cfg.Model.NHead, "heads", cfg.Model.NHead, "attention heads (must divide --embd; overrides --model's; with --resume: the checkpoint's)")
	fs.IntVar(&cfg.Model.NEmbd, "embd", cfg.Model.NEmbd, "embedding width (elements; overrides --model's; with --resume: the checkpoint's)")
	fs.IntVar(&cfg.Model.NCtx, "ctx", cfg.Model.NCtx, "context length in tokens; every sequence is this long (overrides --model's; with --resume: the checkpoint's)")
	tokName := fs.String("tokenizer", "", "`NAME`: byte (one token per byte) or gpt2 (GPT-2's BPE, r50k_base); sets the vocabulary: 256, or 50304 (50257 padded to a multiple of 128) (default byte, gpt2 with --model; with --resume: the checkpoint's)")
	fs.IntVar(&cfg.Batch, "batch", cfg.Batch, "sequences per iteration (with --resume: the checkpoint's)")
	fs.Float64Var(&cfg.LR, "lr", cfg.LR, "peak learning rate")
	fs.Float64Var(&cfg.MinLRRatio, "min-lr-ratio", cfg.MinLRRatio, "the cosine's floor as a fraction of --lr")
	fs.IntVar(&cfg.WarmupSteps, "warmup", cfg.WarmupSteps, "iterations of linear learning-rate warm-up")
	fs.IntVar(&cfg.DecaySteps, "decay-steps", cfg.DecaySteps, "iteration where the cosine decay ends (0: --steps); keep it fixed across resumptions")
	fs.Float64Var(&cfg.WeightDecay, "weight-decay", cfg.WeightDecay, "AdamW weight_decay (decoupled)")
	fs.Float64Var(&cfg.Betas[0], "beta1", cfg.Betas[0], "AdamW beta1")
	fs.Float64Var(&cfg.Betas[1], "beta2", cfg.Betas[1], "AdamW beta2")
	fs.Float64Var(&cfg.Eps, "eps", cfg.Eps, "AdamW eps")
	fs.Float64Var(&cfg.MaxGradNorm, "clip", cfg.MaxGradNorm, "global gradient-norm clipping max_norm (0: off)")
	fs.Float64Var(&cfg.LossScale, "loss-scale", cfg.LossScale, "initial dynamic loss scale (0: off); halves on overflow, doubles after 2000 good steps")
	fs.Var(dtypeFlag{&cfg.GradDType}, "grad-dtype", "gradient dtype handed to the optimizer: float32, bfloat16 or float16 (with --resume: the checkpoint's)")
	fs.Var(dtypeFlag{&cfg.WorkingDType}, "working-dtype", "dtype of the weights forward reads: none (fp32 master), bfloat16 or float16 (with --resume: the checkpoint's)")
	fs.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed of initialisation and sampling")
	sizeVar(c, &cfg.SubgroupSize, "subgroup-size", "optimizer subgroup size in elements `N` (0: 1e9; with --device cuda the performance model chooses among 1e8, 5e7 and 2.5e7 unless this is given (1e8 under --schedule cpu or static, which skip the calibration); with --resume: the checkpoint's)")
	fs.IntVar(&cfg.Threads, "threads", cfg.Threads, fmt.Sprintf("optimizer worker goroutines, at most 4 × the CPUs (%d here) (0: GOMAXPROCS)", trainer.MaxThreads()))
	fs.Float64Var(&cfg.MaxMemory, "max-memory", cfg.MaxMemory, fmt.Sprintf("host memory in `GiB` the run may use, checked against the estimate before anything is allocated (0: the memory available now; at most %d)", trainer.MaxMemoryBytes>>30))
	fs.StringVar(&cfg.CkptDir, "ckpt-dir", cfg.CkptDir, "checkpoint root directory (empty: no checkpoints)")
	fs.IntVar(&cfg.CkptEvery, "ckpt-every", cfg.CkptEvery, "iterations between checkpoints (a final one is always written)")
	fs.Float64Var(&cfg.CkptRing, "ckpt-ring", cfg.CkptRing, "the lazy checkpointer's staging memory in `GiB` between capture and flush (0: two copies of the state, at most 0.25): the step after a save waits for the capture of the state it updates on the host; a ring that holds it (12 bytes per parameter of the CPU and streamed subgroups) captures at memory speed instead of the disk's")
	fs.IntVar(&cfg.CkptKeep, "ckpt-keep", cfg.CkptKeep, "keep only the newest `N` checkpoints (0: keep all)")
	fs.StringVar(&cfg.Profile, "profile", cfg.Profile, "a dos calibrate --json `PATH` of this machine (one measured on another machine is refused): print the performance model's predicted update time next to the measured one")
	fs.StringVar(&cfg.Device, "device", cfg.Device, "train on `DEV`: cuda (GPU 0, or GPUs 0..N-1 with --gpus N: forward and backward in bf16 on the GPU, the update phase interleaved between the CPU and the GPU with the optimizer state in pinned host memory; bfloat16 --working-dtype and --grad-dtype by default) or sim (forward and backward on the host, the update phase on the simulated device: a test); empty: all on the host")
	fs.Float64Var(&cfg.GPUMemory, "gpu-memory", cfg.GPUMemory, "with --device cuda: cap all the device memory dos allocates at `GiB` (weights, gradients, activations, workspaces, the update phase), so this GPU stands in for a smaller one (0: no cap); per GPU with --gpus")
	fs.Float64Var(&cfg.GPUBudget, "gpu-budget", cfg.GPUBudget, "with --device: device memory in `GiB` for the update phase's resident state and staging, per rank with --gpus (0: with cuda, what the model leaves less the gradients, the working copy, the fp32 masters and 2 GiB (under --gpu-memory, 256 MiB), split between the ranks on a GPU; with sim, 16)")
	fs.StringVar(&cfg.Schedule, "schedule", cfg.Schedule, "with --device: force `CPU,GPU,RESIDENT` subgroup counts adding up to the subgroups, or cpu (every subgroup on the CPU: ZeRO-Offload's placement), or static (as many resident as --gpu-budget holds, the rest on the CPU: TwinFlow's) (default: the model's with --profile or on cuda, else a third of each)")
	fs.BoolVar(&cfg.CkptSync, "ckpt-sync", cfg.CkptSync, "write checkpoints synchronously instead of capturing them lazily and flushing in the background")
	fs.BoolVar(&cfg.Resume, "resume", cfg.Resume, "continue from the latest checkpoint in --ckpt-dir, with its model and dtypes unless given here")
	fs.IntVar(&cfg.EvalEvery, "eval-every", cfg.EvalEvery, "iterations between validation losses (0: only at the start and the end)")
	fs.IntVar(&cfg.EvalBatches, "eval-batches", cfg.EvalBatches, "validation batches per evaluation")
	fs.IntVar(&cfg.LogEvery, "log-every", cfg.LogEvery, "iterations between progress lines")
	sizeVar(c, &cfg.SampleBytes, "sample", "bytes `N` of text to generate at the end (GPT-2: tokens until N bytes, at most N tokens; 0: none)")
	text := fs.String("text", "", "train on this UTF-8/byte text `FILE`, tokenized by --tokenizer; the last 10% validates (default: Newton's Opticks, embedded)")
	dataFile := fs.String("data", "", "train on this `FILE` of uint16 tokens instead of a text: llm.c's .bin (its 1024-byte header, magic 20240520) or nanoGPT's (no header), in llm.c's batch order; the last 10% validates unless --val-data")
	valFile := fs.String("val-data", "", "with --data: validate on this token `FILE` (same formats) instead of --data's last 10%")
	summary := fs.String("summary-json", "", "write {initial_loss, final_loss, val_loss, initial_val_loss, steps, params, tokens_per_s, skipped_steps, sample, update_s, update_predicted_s, update_limit_s, update_bound_s, iteration_s, iteration_predicted_s, iteration_bound_s, mfu} to this `PATH` (losses in nats per token: per byte byte-level; tokens_per_s leaves the run's first iteration out; update_s the mean update phase in seconds, update_predicted_s the model's with --profile (or the calibration on cuda), update_limit_s the machine's limit for it (the model's fluid limit, a prediction with the calibrated contention), update_bound_s a lower bound (every resource at its rate alone); iteration_s the mean iteration (its first left out), and on one GPU with a profile iteration_predicted_s the performance model's prediction of a steady iteration and iteration_bound_s its lower bound; mfu on the GPU, against 989 TFLOP/s; sample bytes that are not UTF-8 become U+FFFD; fields that do not apply are left out: update_predicted_s needs a profile (--profile, or on cuda the start-up calibration, which --schedule without --profile skips), the limit and bound fields a device too)")
	fs.BoolVar(&cfg.Replan, "replan", cfg.Replan, "with --device and the performance model's schedule (--profile, or the start-up calibration on cuda): correct the model from every update phase's measured times and re-plan when it misses the phase or a lane's busy time by more than 5% of the phase; a phase that kept speculative updates corrects only the CPU's rate, and four such phases after the schedule was chosen for the whole iteration it is chosen once more")
	fs.BoolVar(&cfg.BF16Params, "bf16-params", cfg.BF16Params, "with --device cuda: read every parameter from the bf16 working copy (llm.c's recipe); by default the embedding lookup and the LayerNorms read fp32 master weights kept on the device, as PyTorch's bf16 autocast does")
	fs.BoolVar(&cfg.Recompute, "recompute", cfg.Recompute, "with --device cuda: keep one block's activations and recompute each block's forward in backward (about a third more compute, a fraction of the activation memory)")
	fs.IntVar(&cfg.GPUs, "gpus", cfg.GPUs, "ZeRO-3 data parallelism over `N` ranks, 0..64 (default 0 or 1: one rank, no sharding): each holds 1/N of every tensor and of its optimizer state and trains on batch/N rows; the working copy is all-gathered and the gradients reduce-scattered between them. The ranks run in this process: on the host or with --device sim over an in-process communicator; with --device cuda rank r on GPU r over NCCL (see --collectives). With --ckpt-dir each rank saves into --ckpt-dir/rank-%05d, lazily (its own engine, --ckpt-ring split between the ranks) or with --ckpt-sync synchronously, and the job commits a step once all ranks' saves are durable (each rank root keeps one step more than --ckpt-keep while a lazy save awaits the job's commit, --ckpt-keep at the end); --resume needs the same N (and takes it from the checkpoint unless given): dos ckpt reshard cuts a checkpoint for another N. --threads is then per rank (0: GOMAXPROCS/N)")
	fs.StringVar(&cfg.Collectives, "collectives", cfg.Collectives, "with --device cuda: how the GPU ranks of --gpus N all-gather and reduce-scatter: nccl (the default: NCCL, one rank per GPU, GPUs 0..N-1; nothing to do with one GPU) or staged (--gpus 2 or more: through pinned host memory, rank r on GPU r mod the GPUs there are: several ranks may share one GPU, slowly; for tests)")
	fs.Var(streamFlag{&cfg.StreamBlocks}, "stream-blocks", "with --device cuda on one GPU: keep the first `N` transformer blocks' matrices and biases (their bf16 weights and gradients) in pinned host memory and stream them to the GPU block by block, H2D before each block's forward and backward, gradients D2H as its backward ends (DeepSpeed's offload_param), so that a model larger than the GPU trains; the CPU updates them in place; the same trajectory, bit for bit. auto: none when the run fits --gpu-memory (or there is no cap: give the card's size as --gpu-memory), else the count whose update phase the performance model predicts fastest (the fewest within 2 % of it), from the start-up calibration or --profile")
	fs.Var(speculateFlag{&cfg.Speculate}, "speculate", "with --device cuda on one GPU, not with --no-overlap: host memory in `GiB` (counted in --max-memory's estimate; auto, the default: 24, or half of what the run leaves of the host memory it may use if less) for speculative updates: the CPU workers update the streamed blocks and the CPU's subgroups (those whose gradients move to the host without the GPU upcast) during the backward, as their gradients arrive, before the global norm is known, out of place, writing the new state into slots of this memory (14 bytes a parameter) while slots are free, until the step begins; the step keeps each one whose scalars are the step's (no clipping, no skip, the same rate and loss scale), else forgets and redoes it (DeepSpeed SuperOffload's speculation-then-validation); not in the first backward, nor after a step that clipped or was skipped or a synchronous checkpoint; the same trajectory, bit for bit; 0: off")
	fs.BoolVar(&cfg.NoOverlap, "no-overlap", cfg.NoOverlap, "with --device cuda: start none of the update phase during backward (by default the CPU subgroups' gradients move to the host as their blocks' backward ends, and the first streamed subgroups' state to the device); the same trajectory, bit for bit")
	fs.BoolVar(&cfg.SpeculateGPU, "speculate-gpu", cfg.SpeculateGPU, "with --speculate, speculate on the GPU's streamed subgroups too, during the backward on the idle copy engines (their state H2D, the fused kernel, the new state D2H into the --speculate slots, which are then pinned whole: 14 bytes a parameter, not 6); off by default: on an H100 at 4.24B under 24 GiB it lost 1 to 2 %, its copies sharing the host memory the CPU's speculation needs; the same trajectory, bit for bit")
	fs.BoolVar(&cfg.SpeculateLeave, "speculate-leave", cfg.SpeculateLeave, "with --speculate, leave every other CPU update of the model's last blocks to the update phase once the iteration is planned, about what the CPU does while the next forward runs the blocks after the phase's own CPU work, so that the CPU works beside that forward (off by default: its gain is not yet measured on one plan); the same trajectory, bit for bit")
	fs.BoolVar(&cfg.NoOverlapForward, "no-overlap-forward", cfg.NoOverlapForward, "run each forward after the last update phase has ended (by default the next iteration's forward runs during the update phase, each block once its weights are written, on one GPU and on the host; not where an evaluation, a checkpoint or the --timeline iteration comes between, nor in a ZeRO-3 job with --device cuda --gpus N); the same trajectory, bit for bit")
	fs.BoolVar(&cfg.ResidentFirst, "resident-first", cfg.ResidentFirst, "with --device cuda or sim (ignored on the host): the update phase's resident subgroups are the model's first blocks, not its last (the speculation then starts with the backward, and the next forward finds its first blocks updated at the phase's start: gpt2-xl under 24 GiB ran about 20% faster on an H100); on by default, --resident-first=false puts them last; the same trajectory, bit for bit")
	timeline := fs.String("timeline", "", "draw one iteration's timeline to this `PATH` (.svg, .png or .pdf; the Chrome trace beside it, PATH with .json): forward, backward, the optimizer step and its update phase's CPU, H2D, D2H and GPU operations, and the GPU memory in use (that iteration waits for the device after forward)")
	fs.IntVar(&cfg.TimelineAt, "timeline-at", 0, "with --timeline: the iteration `N` to draw, from 1 (0, the default: the last of the run)")
	fs.StringVar(&cfg.LogJSON, "log-json", "", "append one JSON line per optimizer step to `PATH`: {step, loss, lr, grad_norm, skipped, pos, seconds, update_s}; with --replan also predicted_s, measured_s, replanned; with --speculate speculated (a run resumed after a crash appends the steps past its checkpoint again: the later line of a step is the one that counts)")
	if rc, ok := c.parseNoArgs(args, stdout, stderr); !ok {
		return rc
	}
	// --model's fields count as given (not taken from a checkpoint), and
	// the vocabulary follows the tokenizer.
	given := c.set
	if *model != "" {
		if err := applyPreset(c, &cfg, *model); err != nil {
			return c.usageError(stderr, "%v", err)
		}
		given = func(name string) bool {
			return c.set(name) || name == "layers" || name == "heads" || name == "embd" || name == "ctx"
		}
	}
	if c.set("tokenizer") {
		cfg.Tokenizer = *tokName
	}
	if cfg.Device == "cuda" { // the GPU trains in bf16
		if !c.set("working-dtype") {
			cfg.WorkingDType = adam.BF16
		}
		if !c.set("grad-dtype") {
			cfg.GradDType = adam.BF16
		}
		// Subgroups of 100M parameters (1.2 GB of state) give the
		// performance model a split to choose: one subgroup per
		// billion parameters leaves it all or nothing. Without
		// --subgroup-size the model also chooses the size among
		// 100M, 50M and 25M: smaller ones pack a small budget better
		// and fit the streamed lane's staging where 100M cannot.
		if !c.set("subgroup-size") {
			cfg.SubgroupSize = CUDASubgroupSize
			cfg.SubgroupSizes = cudaSubgroupSizes()
		}
	}
	tok, err := trainer.NewTokenizer(cfg.Tokenizer)
	if err != nil {
		return c.usageError(stderr, "%v", err)
	}
	cfg.Model.VocabSize = gpt.PadVocab(tok.VocabSize())
	if cfg.Resume && cfg.CkptDir != "" {
		if dir, old, ok := resumeSource(cfg.CkptDir); ok {
			// The checkpoint's values, checked as the checkpoint's
			// (damage), before they stand for flags.
			if err := trainer.CheckCheckpointConfig(old, dir); err != nil {
				return c.fail(stderr, "%v", err)
			}
			var taken []string
			for _, f := range resumeFlags {
				if f.name == "gpus" && old.GPUs <= 1 {
					continue // a single rank's checkpoint: nothing to say
				}
				if !given(f.name) {
					f.take(&cfg, old)
					taken = append(taken, "--"+f.name+" "+f.show(cfg))
					if f.name == "subgroup-size" {
						cfg.SubgroupSizes = nil // the checkpoint's size, not the model's choice again
					}
				}
			}
			// The tokenizer and its vocabulary: named when they differ
			// from what this command line gives without the checkpoint.
			if ot, err := trainer.NewTokenizer(old.Tokenizer); err == nil && !c.set("tokenizer") {
				if ot.Name() != tok.Name() {
					taken = append(taken, "--tokenizer "+ot.Name())
				}
				cfg.Tokenizer, cfg.Model.VocabSize, tok = ot.Name(), old.Model.VocabSize, ot
			}
			if len(taken) > 0 {
				fmt.Fprintf(stdout, "resume: from %s: %s\n", dir, strings.Join(taken, " "))
			}
		}
	}
	if err := cfg.Validate(); err != nil {
		var dm *trainer.DeviceMemoryError
		if errors.As(err, &dm) { // the flags are right, the run does not fit: no usage
			c.fail(stderr, "%v", err)
			return 2
		}
		return c.usageError(stderr, "%v", err)
	}
	switch {
	case *dataFile != "" && *text != "":
		return c.usageError(stderr, "--data and --text: give one (tokens or a text)")
	case *valFile != "" && *dataFile == "":
		return c.usageError(stderr, "--val-data needs --data")
	}
	data := dos.Opticks
	if *text != "" {
		b, err := readText(*text)
		if err != nil {
			return c.fail(stderr, "--text: %v", err)
		}
		data = b
	}
	var trainToks, valToks []uint16
	for _, f := range []struct {
		flag, path string
		dst        *[]uint16
	}{{"--data", *dataFile, &trainToks}, {"--val-data", *valFile, &valToks}} {
		if f.path == "" {
			continue
		}
		toks, format, err := trainer.ReadTokens(f.path, tok.VocabSize())
		if err != nil {
			hint := ""
			if tok.Name() == "byte" && strings.Contains(err.Error(), "outside the vocabulary") {
				hint = " (the byte tokenizer's; for GPT-2 tokens pass --model or --tokenizer gpt2)"
			}
			return c.fail(stderr, "%s: %v%s", f.flag, err, hint)
		}
		fmt.Fprintf(stdout, "%s %s: %s token file, %d tokens\n", f.flag, f.path, format, len(toks))
		*f.dst = toks
	}
	if *timeline != "" {
		if err := checkPlotExt(*timeline); err != nil {
			return c.usageError(stderr, "--timeline %v", err)
		}
		// Fail now, not after training, where the picture or the trace
		// beside it cannot be written.
		for _, p := range []string{*timeline, timelineTrace(*timeline)} {
			if err := probeWritable(p); err != nil {
				return c.fail(stderr, "--timeline: %v", err)
			}
		}
		if cfg.TimelineAt == 0 {
			cfg.TimelineAt = cfg.Steps
		}
		if cfg.TimelineAt > cfg.Steps {
			return c.usageError(stderr, "--timeline-at %d: the run trains to iteration %d (--steps)", cfg.TimelineAt, cfg.Steps)
		}
		if err := cfg.Validate(); err != nil { // what --timeline adds (e.g. with --gpus) is a usage error too
			return c.usageError(stderr, "%v", err)
		}
		// The Chrome trace goes beside the picture: it must not replace
		// another output.
		trace := timelineTrace(*timeline)
		for _, o := range []struct{ flag, path string }{{"--summary-json", *summary}, {"--log-json", cfg.LogJSON}} {
			if o.path == "" {
				continue
			}
			for _, w := range []string{*timeline, trace} {
				if samePath(o.path, w) {
					return c.usageError(stderr, "--timeline %s writes %s, the path of %s: choose another name", *timeline, w, o.flag)
				}
			}
		}
	} else if cfg.TimelineAt != 0 {
		return c.usageError(stderr, "--timeline-at needs --timeline PATH")
	}
	if *summary != "" { // fail now, not after training, if it cannot be written
		if err := probeWritable(*summary); err != nil {
			return c.fail(stderr, "--summary-json: %v", err)
		}
	}
	var t *trainer.Trainer
	if *dataFile != "" {
		t, err = trainer.NewTokens(cfg, trainToks, valToks, stdout)
	} else {
		t, err = trainer.New(cfg, data, stdout)
	}
	if short := (*trainer.ShortDataError)(nil); errors.As(err, &short) {
		return c.fail(stderr, "%s", shortData(short, *dataFile, *valFile, *text, tok.Name()))
	}
	if err != nil {
		return c.fail(stderr, "%v", err)
	}
	sum, err := t.Run()
	if cerr := t.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return c.fail(stderr, "%v", err)
	}
	nothing := false
	if it, ok := t.Resumed(); ok && it >= cfg.Steps {
		// Nothing to train: the trainer said so and how to train
		// further; no header, no losses, no throughput.
		nothing = true
	} else if sum.Steps == 0 {
		fmt.Fprintf(stdout, "done: no iteration trained (the initial weights are step 0 where --ckpt-dir is set), val_loss %.4f\n", sum.ValLoss)
	} else {
		this := "" // a resumed run's summary covers all runs: say how many were this run's
		if it, ok := t.Resumed(); ok {
			this = fmt.Sprintf(" (%d this run)", sum.Steps-it)
		}
		fmt.Fprintf(stdout, "done: %s%s, loss %.4f -> %.4f, val_loss %.4f -> %.4f, %.0f tokens/s\n",
			trainer.Iterations(sum.Steps), this, sum.InitialLoss, sum.FinalLoss, sum.InitValLoss, sum.ValLoss, sum.TokensPerS)
	}
	if *summary != "" {
		if err := writeJSON(*summary, sum); err != nil {
			return c.fail(stderr, "--summary-json: %v", err)
		}
	}
	if *timeline != "" && nothing {
		fmt.Fprintf(stdout, "--timeline %s: not drawn: nothing trained\n", *timeline)
	} else if *timeline != "" {
		if err := writeIteration(t, *timeline, cfg, stdout); err != nil {
			return c.fail(stderr, "--timeline: %v", err)
		}
	}
	return 0
}

// writeIteration writes the iteration t traced (--timeline-at) to path as
// a picture and beside it, with the extension .json, as a Chrome trace.
func writeIteration(t *trainer.Trainer, path string, cfg trainer.TrainConfig, stdout io.Writer) error {
	tl, ok := t.Timeline()
	if !ok {
		return fmt.Errorf("iteration %d was not trained in this run (it trained to %d): nothing drawn", cfg.TimelineAt, cfg.Steps)
	}
	where := "the CPU"
	if cfg.Device != "" {
		where = "--device " + cfg.Device
	}
	title := fmt.Sprintf("dos train: iteration %d, %.1f ms, %d params on %s", tl.Iteration, 1e3*tl.Total.Seconds(), t.NumParams(), where)
	if err := plotIteration(tl, title, path); err != nil {
		return err
	}
	trace := timelineTrace(path)
	if err := writeTrace(trace, tl.Ops, tl.Memory...); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "timeline of iteration %d written to %s (Chrome trace: %s)\n", tl.Iteration, path, trace)
	return nil
}

// CUDASubgroupSize is dos train's --subgroup-size with --device cuda.
const CUDASubgroupSize = 100_000_000

// cudaSubgroupSizes are the subgroup sizes the performance model chooses
// among with --device cuda and no --subgroup-size (dos train and dos
// plan's sweep alike): CUDASubgroupSize, its half and its quarter.
func cudaSubgroupSizes() []int {
	return []int{CUDASubgroupSize, CUDASubgroupSize / 2, CUDASubgroupSize / 4}
}

// maxText is the largest --text file dos train reads, in bytes.
const maxText = 1 << 30

// readText reads a regular file of at most maxText bytes.
func readText(path string) ([]byte, error) {
	info, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, osCause(err))
	}
	if !info.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", path)
	}
	if info.Size() > maxText {
		return nil, fmt.Errorf("%s is %d bytes, over the limit of %d", path, info.Size(), maxText)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, osCause(err))
	}
	return b, nil
}

// timelineTrace is where --timeline PATH writes the iteration's Chrome
// trace: PATH with the extension .json.
func timelineTrace(path string) string {
	return strings.TrimSuffix(path, filepath.Ext(path)) + ".json"
}

// samePath reports whether a and b name the same file as paths (absolute,
// cleaned; links are not followed).
func samePath(a, b string) bool {
	x, err1 := filepath.Abs(a)
	y, err2 := filepath.Abs(b)
	return err1 == nil && err2 == nil && x == y
}

// shortData spells e in dos train's terms: the data's source (--data,
// --val-data or --text with its file, or the default text), its tokens,
// what --ctx and --batch need of each part that is short, and the flags
// that change it, with the largest --ctx (and for token data --batch)
// that the data holds.
func shortData(e *trainer.ShortDataError, dataFile, valFile, textFile, tokName string) string {
	seq := fmt.Sprintf("%d (one sequence of --ctx %d and its target)", e.Ctx+1, e.Ctx)
	if e.Text {
		src := "the default text (Newton's Opticks)"
		if textFile != "" {
			src = "--text " + textFile + ": the text"
		}
		return fmt.Sprintf("%s makes %d %s tokens, too few for --ctx %d: the last %g%% validates, leaving %d training and %d validation tokens, and each part needs %s; %s",
			src, e.Tokens, tokName, e.Ctx, 100*e.ValFraction, e.Train, e.Val, seq, remedy([]string{atMost("--ctx", min(e.Train, e.Val)-1, "")}, "--ctx", "a longer text"))
	}
	batch := fmt.Sprintf("%d (one batch of --batch %d × --ctx %d and the last target)", e.NeedTrain, e.Batch, e.Ctx)
	// The largest --ctx the training part holds at this --batch, and the
	// largest --batch it holds at this --ctx.
	trainCtx, trainBatch := (e.Train-1)/max(e.Batch, 1), (e.Train-1)/max(e.Ctx, 1)
	batchFits := ""
	if !e.ValShort() {
		batchFits = atMost("--batch", trainBatch, fmt.Sprintf(" at --ctx %d", e.Ctx))
	}
	if e.ValFraction > 0 {
		var need []string
		if e.TrainShort() {
			need = append(need, "training needs "+batch)
		}
		if e.ValShort() {
			need = append(need, "validation needs "+seq)
		}
		fits := []string{atMost("--ctx", min(trainCtx, e.Val-1), fmt.Sprintf(" at --batch %d", e.Batch)), batchFits}
		return fmt.Sprintf("--data %s: the token file holds %d tokens, too few for --ctx %d --batch %d: the last %g%% validates, leaving %d training and %d validation tokens; %s; %s",
			dataFile, e.Tokens, e.Ctx, e.Batch, 100*e.ValFraction, e.Train, e.Val, strings.Join(need, ", and "), remedy(fits, "--ctx or --batch", "more tokens (or --val-data FILE)"))
	}
	var msgs []string
	if e.TrainShort() {
		fits := []string{atMost("--ctx", trainCtx, fmt.Sprintf(" at --batch %d", e.Batch)), batchFits}
		msgs = append(msgs, fmt.Sprintf("--data %s: the token file holds %d tokens, too few for --ctx %d --batch %d: training needs %s; %s",
			dataFile, e.Train, e.Ctx, e.Batch, batch, remedy(fits, "--ctx or --batch", "more tokens")))
	}
	if e.ValShort() {
		msgs = append(msgs, fmt.Sprintf("--val-data %s: the token file holds %d tokens, too few for --ctx %d: validation needs %s; %s",
			valFile, e.Val, e.Ctx, seq, remedy([]string{atMost("--ctx", e.Val-1, "")}, "--ctx", "more validation tokens")))
	}
	return strings.Join(msgs, "; ")
}

// atMost is "FLAG N" and where, or "" when n < 1 (no value fits).
func atMost(flag string, n int, where string) string {
	if n < 1 {
		return ""
	}
	return fmt.Sprintf("%s %d%s", flag, n, where)
}

// remedy is "pass a smaller FLAGS (at most FITS), or MORE", the fits that
// are not "" joined by ", or ", or "pass MORE" when none is.
func remedy(fits []string, flags, more string) string {
	var f []string
	for _, s := range fits {
		if s != "" {
			f = append(f, s)
		}
	}
	if len(f) == 0 {
		return "no --ctx fits: pass " + more
	}
	return fmt.Sprintf("pass a smaller %s (at most %s), or %s", flags, strings.Join(f, ", or "), more)
}
