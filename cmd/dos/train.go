package main

import (
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/deepstates/dos"
	"github.com/deepstates/dos/adam"
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

func runTrain(args []string, stdout, stderr io.Writer) int {
	cfg := trainer.DefaultTrainConfig()
	fs := flag.NewFlagSet("dos train", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&cfg.Steps, "steps", cfg.Steps, "train to this iteration (one batch each); a resumed run continues to it")
	fs.IntVar(&cfg.Model.NLayer, "layers", cfg.Model.NLayer, "transformer blocks")
	fs.IntVar(&cfg.Model.NHead, "heads", cfg.Model.NHead, "attention heads (must divide --embd)")
	fs.IntVar(&cfg.Model.NEmbd, "embd", cfg.Model.NEmbd, "embedding width (elements)")
	fs.IntVar(&cfg.Model.NCtx, "ctx", cfg.Model.NCtx, "context length in tokens (bytes); every sequence is this long")
	fs.IntVar(&cfg.Batch, "batch", cfg.Batch, "sequences per iteration")
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
	fs.Var(dtypeFlag{&cfg.GradDType}, "grad-dtype", "gradient dtype handed to the optimizer: float32, bfloat16 or float16")
	fs.Var(dtypeFlag{&cfg.WorkingDType}, "working-dtype", "dtype of the weights forward reads: none (fp32 master), bfloat16 or float16")
	fs.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed of initialisation and sampling")
	fs.IntVar(&cfg.SubgroupSize, "subgroup-size", cfg.SubgroupSize, "optimizer subgroup size in elements (0: 1e9)")
	fs.IntVar(&cfg.Threads, "threads", cfg.Threads, fmt.Sprintf("optimizer worker goroutines, at most 4 × the CPUs (%d here) (0: GOMAXPROCS)", trainer.MaxThreads()))
	fs.Float64Var(&cfg.MaxMemory, "max-memory", cfg.MaxMemory, fmt.Sprintf("host memory in `GiB` the run may use, checked against the estimate before anything is allocated (0: the memory available now; at most %d)", trainer.MaxMemoryBytes>>30))
	fs.StringVar(&cfg.CkptDir, "ckpt-dir", cfg.CkptDir, "checkpoint root directory (empty: no checkpoints)")
	fs.IntVar(&cfg.CkptEvery, "ckpt-every", cfg.CkptEvery, "iterations between checkpoints (a final one is always written)")
	fs.IntVar(&cfg.CkptKeep, "ckpt-keep", cfg.CkptKeep, "keep only the newest `N` checkpoints (0: keep all)")
	fs.StringVar(&cfg.Profile, "profile", cfg.Profile, "a dos calibrate --json `PATH` of this machine: print the performance model's predicted update time next to the measured one")
	fs.StringVar(&cfg.Device, "device", cfg.Device, "run the optimizer's update phase through the interleaved engine on `DEV`: cuda (GPU 0) or sim (the simulated device); empty: on the host. Needs --working-dtype bfloat16 or float16")
	fs.Float64Var(&cfg.GPUBudget, "gpu-budget", cfg.GPUBudget, "with --device: device memory in `GiB` for resident state and staging (0: 16)")
	fs.StringVar(&cfg.Schedule, "schedule", cfg.Schedule, "with --device: force `CPU,GPU,RESIDENT` subgroup counts, adding up to the subgroups (default: the model's with --profile, else a third of each; one subgroup is streamed through the GPU)")
	fs.BoolVar(&cfg.CkptSync, "ckpt-sync", cfg.CkptSync, "write checkpoints synchronously instead of capturing them lazily and flushing in the background")
	fs.BoolVar(&cfg.Resume, "resume", cfg.Resume, "continue from the latest checkpoint in --ckpt-dir")
	fs.IntVar(&cfg.EvalEvery, "eval-every", cfg.EvalEvery, "iterations between validation losses (0: only at the start and the end)")
	fs.IntVar(&cfg.EvalBatches, "eval-batches", cfg.EvalBatches, "validation batches per evaluation")
	fs.IntVar(&cfg.LogEvery, "log-every", cfg.LogEvery, "iterations between progress lines")
	fs.IntVar(&cfg.SampleBytes, "sample", cfg.SampleBytes, "bytes of text to generate at the end (0: none)")
	text := fs.String("text", "", "train on this UTF-8/byte text file (default: Newton's Opticks, embedded)")
	summary := fs.String("summary-json", "", "write {initial_loss, final_loss, val_loss, initial_val_loss, steps, params, tokens_per_s, skipped_steps, sample, update_s, update_predicted_s} to this `PATH` (losses in nats per byte; update_s the mean update phase in seconds, update_predicted_s the model's with --profile; sample bytes that are not UTF-8 become U+FFFD)")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: dos train [flags]\n\n"+
			"Trains a byte-level GPT-2 on Newton's Opticks with the offloaded AdamW optimizer, checkpointing\n"+
			"through dos's checkpointer. Losses are in nats per byte.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if rc, ok := parseNoArgs(fs, args, stderr); !ok {
		return rc
	}
	if err := cfg.Validate(); err != nil {
		fmt.Fprintf(stderr, "dos train: %v\n", err)
		return 2
	}
	data := dos.Opticks
	if *text != "" {
		b, err := readText(*text)
		if err != nil {
			fmt.Fprintf(stderr, "dos train: --text: %v\n", err)
			return 1
		}
		data = b
	}
	if *summary != "" { // fail now, not after training, if it cannot be written
		if err := writeFile(*summary, []byte("{}\n")); err != nil {
			fmt.Fprintf(stderr, "dos train: --summary-json: %v\n", err)
			return 1
		}
	}
	t, err := trainer.New(cfg, data, stdout)
	if err != nil {
		fmt.Fprintf(stderr, "dos train: %v\n", err)
		return 1
	}
	defer t.Close()
	sum, err := t.Run()
	if err != nil {
		fmt.Fprintf(stderr, "dos train: %v\n", err)
		return 1
	}
	fmt.Fprintf(stdout, "done: %d iterations, loss %.4f -> %.4f, val_loss %.4f -> %.4f, %.0f tokens/s\n",
		sum.Steps, sum.InitialLoss, sum.FinalLoss, sum.InitValLoss, sum.ValLoss, sum.TokensPerS)
	if *summary != "" {
		if err := writeJSON(*summary, sum); err != nil {
			fmt.Fprintf(stderr, "dos train: --summary-json: %v\n", err)
			return 1
		}
	}
	return 0
}

// maxText is the largest --text file dos train reads, in bytes.
const maxText = 1 << 30

// readText reads a regular file of at most maxText bytes.
func readText(path string) ([]byte, error) {
	info, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if !info.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", path)
	}
	if info.Size() > maxText {
		return nil, fmt.Errorf("%s is %d bytes, over the limit of %d", path, info.Size(), maxText)
	}
	return os.ReadFile(path)
}
