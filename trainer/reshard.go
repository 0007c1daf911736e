package trainer

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

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
// trainer's --gpus set to n, and each rank's checkpoint records its rank
// (rankObject). Nothing in src is written (src is read without its lock).
// dst must be absent or an empty directory, outside src: the checkpoint
// is written into a temporary directory beside it, committed there, and
// renamed to dst once complete, so an interrupted Reshard leaves no dst
// (run it again; a killed one may leave the temporary .DST.reshard-*
// beside it). It reports progress on out and returns the step.
//
// Errors: a src without a committed checkpoint, damaged (the checkpoint
// package's errors, naming the file), not written by dos train, one
// rank's root of a job (named), or rank directories moved (ErrCorrupt,
// naming the directory); a dst not empty or inside src; n outside 1..64
// or not dividing the batch; the file system's.
func Reshard(src, dst string, n int, out io.Writer) (int64, error) {
	if n < 1 || n > 64 {
		return 0, fmt.Errorf("trainer: reshard to %d ranks: want 1..64", n)
	}
	if src == "" || dst == "" {
		return 0, errors.New("trainer: reshard: SRC and DST must be directories, not empty")
	}
	if st, err := os.Stat(src); err != nil || !st.IsDir() {
		return 0, fmt.Errorf("trainer: reshard: the source %s is not a directory (%v)", src, err)
	}
	if err := reshardTarget(src, dst); err != nil {
		return 0, err
	}
	// The source, read only (no lock: a trainer writing it may go on; a
	// checkpoint it retires meanwhile fails the read, never the result).
	var step int64
	world := 1
	var dirs []string
	var err error
	if isJob(src) {
		if step, world, err = checkpoint.JobLatest(checkpoint.OS, src); err != nil {
			return 0, fmt.Errorf("trainer: reshard: %w (dos ckpt recover %s moves a damaged or unfinished job to the newest step every rank holds)", err, src)
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
		if world == 1 {
			// src is a rank root, or a step directory in one.
			rr := filepath.Clean(src)
			if strings.HasPrefix(filepath.Base(rr), "step-") {
				rr = filepath.Dir(rr)
			}
			return 0, fmt.Errorf("trainer: reshard: %s is in one rank's root of a job of %d ranks (dos train --gpus %d): reshard the job's root, %s", src, w, w, filepath.Dir(rr))
		}
		return 0, fmt.Errorf("trainer: reshard: %s: its trainer state says %d ranks, its job %d: %w", dirs[0], w, world, checkpoint.ErrCorrupt)
	}
	if n > 1 && cfg.Batch%n != 0 {
		return 0, fmt.Errorf("trainer: reshard to %d ranks: the run's batch %d is not a multiple of %d (each rank trains on batch/ranks rows)", n, cfg.Batch, n)
	}
	// What a run of n ranks asks of the rest of the run's configuration
	// (its dtypes, device, schedule): checked now, not at the resume.
	// Forced --schedule counts are not a resumed run's (--resume does not
	// take --schedule from the checkpoint): they do not count.
	if cfg.Schedule != "cpu" && cfg.Schedule != "static" {
		cfg.Schedule = ""
	}
	ranked := cfg
	ranked.GPUs = n
	if err := ranked.validateRanks(); err != nil {
		return 0, fmt.Errorf("trainer: reshard to %d ranks: the run's configuration does not allow it: %s", n, strings.TrimPrefix(err.Error(), "trainer: "))
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
		if err == nil && world > 1 {
			err = checkRank(objs, dir, r, world)
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

	// Cut them for n ranks and save, into a directory beside dst that
	// becomes dst once complete: an interrupted Reshard leaves no dst.
	tmp, err := os.MkdirTemp(filepath.Dir(filepath.Clean(dst)), "."+filepath.Base(filepath.Clean(dst))+".reshard-")
	if err != nil {
		return 0, fmt.Errorf("trainer: reshard: %w", err)
	}
	defer os.RemoveAll(tmp) // gone after the rename; what a failure left otherwise
	st.Config.GPUs = n
	if n == 1 {
		st.Config.GPUs = 0
	}
	objs := map[string]any{}
	for name, raw := range objects {
		if name != offload.ObjectName && name != rankObjectName {
			objs[name] = raw
		}
	}
	objs["trainer"] = st
	if n > 1 {
		if err := checkpoint.BeginJob(checkpoint.OS, tmp, n); err != nil {
			return 0, fmt.Errorf("trainer: reshard: %w", err)
		}
	}
	for r := range n {
		params, root, ro := offloadParams(cfg.Model), tmp, objs
		if n > 1 {
			params, root, ro = shardParams(cfg.Model, n, r), checkpoint.RankRoot(tmp, r), rankObjects(objs, r, n)
		}
		if err := reshardRank(params, oo, full, kinds, optStep, step, ro, root, n, r); err != nil {
			return 0, fmt.Errorf("trainer: reshard: rank %d of %d: %w (nothing was written to %s)", r, n, err, dst)
		}
		fmt.Fprintf(out, "reshard: wrote rank %d of %d\n", r, n)
	}
	if n > 1 {
		if err := checkpoint.CommitJob(checkpoint.OS, tmp, n, step); err != nil {
			return 0, fmt.Errorf("trainer: reshard: %w", err)
		}
	}
	// dst is absent or an empty directory (reshardTarget): replace it.
	if err := os.Remove(dst); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return 0, fmt.Errorf("trainer: reshard: %w", err)
	}
	if err := os.Rename(tmp, dst); err != nil {
		return 0, fmt.Errorf("trainer: reshard: %w", err)
	}
	if err := checkpoint.OS.SyncDir(filepath.Dir(filepath.Clean(dst))); err != nil {
		return 0, fmt.Errorf("trainer: reshard: %w", err)
	}
	ranks := func(k int) string {
		if k == 1 {
			return "1 rank"
		}
		return fmt.Sprintf("%d ranks", k)
	}
	fmt.Fprintf(out, "reshard: step %d of %s (%s) is now %s, for %s: dos train --resume --ckpt-dir %s --gpus %d\n", step, src, ranks(world), dst, ranks(n), dst, n)
	return step, nil
}

// reshardTarget checks that dst can receive a re-sharded checkpoint of
// src: absent or an empty directory, and neither src nor inside it.
func reshardTarget(src, dst string) error {
	if es, err := os.ReadDir(dst); err == nil && len(es) > 0 {
		return fmt.Errorf("trainer: reshard: %s is not empty; choose a new or empty directory", dst)
	} else if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("trainer: reshard: the destination: %w", err)
	}
	abs := func(p string) string {
		a, err := filepath.Abs(p)
		if err != nil {
			return filepath.Clean(p)
		}
		// Resolve the longest existing prefix's links.
		rest := ""
		for cur := a; ; cur = filepath.Dir(cur) {
			if r, err := filepath.EvalSymlinks(cur); err == nil {
				return filepath.Join(r, rest)
			}
			if filepath.Dir(cur) == cur {
				return a
			}
			rest = filepath.Join(filepath.Base(cur), rest)
		}
	}
	s, d := abs(src), abs(dst)
	if d == s || strings.HasPrefix(d, s+string(filepath.Separator)) {
		return fmt.Errorf("trainer: reshard: the destination %s is the source %s or inside it; choose a directory outside it", dst, src)
	}
	return nil
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
