package trainer

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"

	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/offload"
)

// Reshard writes the latest checkpoint of src, a job of ranks (dos train
// --gpus, checkpoint.CommitJob) or a single rank's root, into dst cut for
// n ranks (ZeRO-3's pieces, shardParams; n = 1: the whole tensors, as dos
// train without --gpus saves them), so that `dos train --resume
// --ckpt-dir dst --gpus n` continues the run on another number of ranks
// (DeepSpeed's universal checkpoint, done offline). Each tensor's fp32
// master weights, exp_avg and exp_avg_sq (max_exp_avg_sq with amsgrad) are
// joined from src's pieces in rank order and cut again; the optimizer's
// step count, hyperparameters and the trainer's state carry over, the
// trainer's --gpus set to n. Nothing in src changes; dst must hold
// nothing yet. For n > 1 the step is committed in dst only once every
// rank's checkpoint is durable (checkpoint.CommitJob), so an interrupted
// Reshard leaves no checkpoint in dst (run it again). It takes both
// roots' locks and reports progress on out. It returns the step.
//
// Errors: a src without a committed checkpoint, damaged (the checkpoint
// package's errors, naming the file), or not written by dos train; a dst
// that holds checkpoints; n outside 1..64 or not dividing the batch; the
// file system's.
func Reshard(src, dst string, n int, out io.Writer) (int64, error) {
	if n < 1 || n > 64 {
		return 0, fmt.Errorf("trainer: reshard to %d ranks: want 1..64", n)
	}
	slock, err := checkpoint.Lock(checkpoint.OS, src)
	if err != nil {
		return 0, fmt.Errorf("trainer: reshard: %w", err)
	}
	defer slock.Unlock()
	// The source: its committed step, in every rank's root.
	var step int64
	world := 1
	var dirs []string
	if isJob(src) {
		if step, world, err = checkpoint.JobLatest(checkpoint.OS, src); err != nil {
			return 0, fmt.Errorf("trainer: reshard: %w", err)
		}
		for r := range world {
			dirs = append(dirs, checkpoint.StepDir(checkpoint.RankRoot(src, r), step))
		}
	} else {
		dir, err := checkpoint.Resolve(checkpoint.OS, src)
		if err != nil {
			return 0, fmt.Errorf("trainer: reshard: %w", err)
		}
		dirs = []string{dir}
	}
	c, err := checkpoint.Open(checkpoint.OS, dirs[0], 0)
	if err != nil {
		return 0, fmt.Errorf("trainer: reshard: %w", err)
	}
	var st trainerState
	err = c.Object("trainer", &st)
	if world == 1 {
		step = c.Manifest.Step
	}
	c.Close()
	if err != nil {
		return 0, fmt.Errorf("trainer: reshard: %s is not a dos train checkpoint: %w", dirs[0], err)
	}
	cfg := st.Config
	if w := max(cfg.GPUs, 1); w != world {
		return 0, fmt.Errorf("trainer: reshard: %s: its trainer state says %d ranks, its root holds %d: %w", dirs[0], w, world, checkpoint.ErrCorrupt)
	}
	if n > 1 && cfg.Batch%n != 0 {
		return 0, fmt.Errorf("trainer: reshard to %d ranks: the run's batch %d is not a multiple of %d (each rank trains on batch/ranks rows)", n, cfg.Batch, n)
	}
	dlock, err := checkpoint.Lock(checkpoint.OS, dst)
	if err != nil {
		return 0, fmt.Errorf("trainer: reshard: %w", err)
	}
	defer dlock.Unlock()
	if fresh, err := checkpoint.JobFresh(checkpoint.OS, dst); err != nil || !fresh {
		return 0, fmt.Errorf("trainer: reshard: %s already holds checkpoints (or cannot be read: %v); choose an empty directory", dst, err)
	}
	if info, err := checkpoint.Inspect(checkpoint.OS, dst); err != nil || !info.Fresh() {
		return 0, fmt.Errorf("trainer: reshard: %s already holds checkpoints (or cannot be read: %v); choose an empty directory", dst, err)
	}

	// Join the pieces: full[k][i] is tensor i's state of kind k.
	oo := cfg.optimizerOptions()
	oo.Threads = 0
	ts := cfg.Model.Tensors()
	kinds := []offload.StateKind{offload.MasterWeights, offload.ExpAvg, offload.ExpAvgSq}
	full := make([][][]float32, 4)
	var objects map[string]json.RawMessage
	var optStep int64
	for r, dir := range dirs {
		fmt.Fprintf(out, "reshard: reading %s (rank %d of %d)\n", dir, r, world)
		params := offloadParams(cfg.Model)
		if world > 1 {
			params = shardParams(cfg.Model, world, r)
		}
		o, err := offload.New(params, *oo)
		if err != nil {
			return 0, fmt.Errorf("trainer: reshard: %w", err)
		}
		_, objs, err := o.LoadCheckpoint(checkpoint.OS, dir)
		if err == nil && r == 0 {
			objects, optStep = objs, o.StepCount()
			oo.Hyper = o.Options().Hyper // the checkpoint's (LoadCheckpoint took them), for the ranks written
			if o.Options().Hyper.AMSGrad {
				kinds = append(kinds, offload.MaxExpAvgSq)
			}
			for _, k := range kinds {
				full[k] = make([][]float32, len(ts))
				for i, t := range ts {
					full[k][i] = make([]float32, t.Numel())
				}
			}
		}
		if err == nil && o.StepCount() != optStep {
			err = fmt.Errorf("its optimizer is at step %d, rank 0's at %d: %w", o.StepCount(), optStep, checkpoint.ErrCorrupt)
		}
		for i := range ts {
			lo, hi := 0, ts[i].Numel()
			if world > 1 {
				lo, hi = pieceOf(ts[i].Numel(), world, r)
			}
			for _, k := range kinds {
				if err == nil && hi > lo {
					err = o.ReadState(i, k, full[k][i][lo:hi])
				}
			}
		}
		err = errors.Join(err, o.Close())
		if err != nil {
			return 0, fmt.Errorf("trainer: reshard: %s: %w", dir, err)
		}
	}

	// Cut them for n ranks and save.
	st.Config.GPUs = n
	if n == 1 {
		st.Config.GPUs = 0
	}
	objs := map[string]any{}
	for name, raw := range objects {
		if name != offload.ObjectName {
			objs[name] = raw
		}
	}
	objs["trainer"] = st
	if n > 1 {
		if err := checkpoint.BeginJob(checkpoint.OS, dst, n); err != nil {
			return 0, fmt.Errorf("trainer: reshard: %w", err)
		}
	}
	for r := range n {
		params, root := offloadParams(cfg.Model), dst
		if n > 1 {
			params, root = shardParams(cfg.Model, n, r), checkpoint.RankRoot(dst, r)
		}
		if err := reshardRank(params, oo, full, kinds, optStep, step, objs, root, n, r); err != nil {
			return 0, fmt.Errorf("trainer: reshard: rank %d of %d: %w (%s holds no checkpoint of it)", r, n, err, dst)
		}
		fmt.Fprintf(out, "reshard: wrote %s (rank %d of %d)\n", checkpoint.StepDir(root, step), r, n)
	}
	if n > 1 {
		if err := checkpoint.CommitJob(checkpoint.OS, dst, n, step); err != nil {
			return 0, fmt.Errorf("trainer: reshard: %w", err)
		}
	}
	fmt.Fprintf(out, "reshard: step %d of %s (%d ranks) is now %s for %d ranks: dos train --resume --ckpt-dir %s --gpus %d\n", step, src, world, dst, n, dst, n)
	return step, nil
}

// reshardRank saves rank r of n's pieces of the joined state full (per
// kind, per tensor) at step into root, its optimizer at optStep.
func reshardRank(params []offload.Param, oo *offload.Options, full [][][]float32, kinds []offload.StateKind,
	optStep, step int64, objs map[string]any, root string, n, r int) error {
	o, err := offload.New(params, *oo)
	if err != nil {
		return err
	}
	defer o.Close()
	for i := range params {
		lo, hi := 0, len(full[0][i])
		if n > 1 {
			lo, hi = pieceOf(len(full[0][i]), n, r)
		}
		for _, k := range kinds {
			if hi > lo {
				if err := o.WriteState(i, k, full[k][i][lo:hi]); err != nil {
					return err
				}
			}
		}
	}
	if err := o.SetStepCount(optStep); err != nil {
		return err
	}
	snap, err := o.Snapshot(objs)
	if err != nil {
		return err
	}
	snap.Step = step
	_, err = checkpoint.Save(checkpoint.OS, root, snap)
	return err
}
