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
// (rankObject). Nothing in src is written: src is read without its lock,
// so a trainer writing it may go on; when its retention retires the step
// being read, Reshard reads src's new latest step (up to 8 times).
//
// dst must be absent or an empty directory (a link to one: written into
// its target), outside src. Reshard holds dst's lock (checkpoint.Lock)
// and writes the checkpoint, committed, into dst/.tmp-reshard-*, then
// moves it into dst, the latest last: until then dst holds no latest
// (not committed), and a run of Reshard again over a dst that holds only
// that temporary directory (a Reshard killed before its moves) removes it
// and starts over; one over a dst that an interrupted Reshard moved some
// of its files into is refused, saying so. It reports progress on out and
// returns the step.
//
// Errors: a src without a committed checkpoint, damaged (the checkpoint
// package's errors, naming the file), not written by dos train, one
// rank's root of a job (named), or with rank roots copied, linked or
// moved (checkpoint.CheckJob's ErrWrongRank); a src whose step was
// retired as it was read, 8 times (naming src's holder); a dst not empty,
// not a directory, unwritable or inside src; n outside
// 1..checkpoint.MaxWorldSize or not dividing the batch; the file
// system's.
func Reshard(src, dst string, n int, out io.Writer) (int64, error) {
	if n < 1 || n > checkpoint.MaxWorldSize {
		return 0, fmt.Errorf("trainer: reshard to %d ranks: want 1..%d", n, checkpoint.MaxWorldSize)
	}
	if src == "" || dst == "" {
		return 0, errors.New("trainer: reshard: SRC and DST must be directories, not empty")
	}
	if st, err := os.Stat(src); err != nil || !st.IsDir() {
		return 0, fmt.Errorf("trainer: reshard: the source %s is not a directory (%v)", src, err)
	}
	if tmp := ReshardMovesLeft(src); tmp != "" {
		return 0, fmt.Errorf("trainer: reshard: the source %s holds part of the checkpoint an earlier dos ckpt reshard was moving into it when it was killed; the rest is in %s: dos ckpt recover %s finishes the moves, then reshard it; nothing was changed", src, tmp, checkpoint.ShellQuote(src))
	}
	target, err := reshardTarget(src, dst)
	if err != nil {
		return 0, err
	}
	if job, ok := checkpoint.RankSlot(checkpoint.OS, target); ok {
		return 0, fmt.Errorf("trainer: reshard: the destination %s is a rank root of the job %s: writing there would mix another run's checkpoints with the job's ranks; choose a directory outside it", dst, job)
	}
	if single, ok := checkpoint.InSingleRoot(checkpoint.OS, target); ok {
		return 0, fmt.Errorf("trainer: reshard: the destination %s is inside %s, which holds a single rank's checkpoints: a root named rank-NNNNN there would be taken for a job's rank root, and %s would no longer open; choose a directory outside it", dst, single, single)
	}
	// dst's lock, held to the end (no trainer starts there meanwhile),
	// and the temporary directory: dst is checked writable before the
	// work.
	_, serr := os.Stat(target)
	created := errors.Is(serr, fs.ErrNotExist)
	lock, err := checkpoint.Lock(checkpoint.OS, target)
	if err != nil {
		return 0, fmt.Errorf("trainer: reshard: the destination: %w", err)
	}
	defer lock.Unlock()
	keep := false
	if created {
		defer func() { // a failure leaves no dst where there was none
			if !keep {
				os.RemoveAll(target)
			}
		}()
	}
	if err := reshardEmpty(dst, target); err != nil { // again, under the lock
		return 0, err
	}
	tmp, err := os.MkdirTemp(target, ReshardTmp)
	if err != nil {
		return 0, fmt.Errorf("trainer: reshard: the destination: %w", err)
	}
	defer os.RemoveAll(tmp) // emptied by the moves; what a failure left otherwise

	var rs *reshardSource
	for try := 0; ; try++ {
		rs, err = readSource(src, n, out)
		if err == nil {
			break
		}
		var moved *stepMoved
		if try < 8 && errors.As(err, &moved) {
			fmt.Fprintf(out, "reshard: %s moved from step %d to %d as it was read (a trainer writing it): reading that\n", src, moved.from, moved.to)
			continue
		}
		if errors.As(err, &moved) {
			err = moved.err
		}
		if h := checkpoint.Holder(checkpoint.OS, src); h != "" && (errors.Is(err, fs.ErrNotExist) || errors.Is(err, checkpoint.ErrCorrupt)) {
			return 0, fmt.Errorf("%w (%s holds %s: a running dos train, whose retention retires what reshard reads; the source is not damaged: run reshard once that has stopped, or again)", err, h, src)
		}
		return 0, err
	}
	step, world, st, cfg := rs.step, rs.world, rs.st, rs.st.Config

	// Cut them for n ranks and save, committed, into tmp.
	st.Config.GPUs = n
	if n == 1 {
		st.Config.GPUs = 0
	}
	objs := map[string]any{}
	for name, raw := range rs.objects {
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
		if err := reshardRank(params, rs.oo, rs.full, rs.kinds, rs.optStep, step, ro, root, n, r); err != nil {
			return 0, fmt.Errorf("trainer: reshard: rank %d of %d: %w (nothing was written to %s)", r, n, err, dst)
		}
		fmt.Fprintf(out, "reshard: wrote rank %d of %d\n", r, n)
	}
	if n > 1 {
		if err := checkpoint.CommitJob(checkpoint.OS, tmp, n, step); err != nil {
			return 0, fmt.Errorf("trainer: reshard: %w", err)
		}
	}
	if err := reshardMove(tmp, target); err != nil {
		keep = true // what was moved stays, for the user to see
		return 0, fmt.Errorf("trainer: reshard: %w (%s is not committed: it has no latest; remove what it holds and run reshard again)", err, dst)
	}
	keep = true
	ranks := func(k int) string {
		if k == 1 {
			return "1 rank"
		}
		return fmt.Sprintf("%d ranks", k)
	}
	fmt.Fprintf(out, "reshard: step %d of %s (%s) is now %s, for %s: dos train --resume --ckpt-dir %s --gpus %d\n", step, src, ranks(world), dst, ranks(n), checkpoint.ShellQuote(dst), n)
	return step, nil
}

// ReshardTmp starts the name of Reshard's temporary directory in dst (a
// checkpoint leftover's prefix, ".tmp-": no checkpoint reader takes it).
// A Reshard killed leaves it; the next Reshard into dst, or the next
// trainer to start there (New, holding dst's lock, so that no Reshard is
// writing it), removes it.
const ReshardTmp = ".tmp-reshard-"

// reshardSource is what Reshard read of its source: the step, the rank
// count, the trainer state and objects of rank 0, the optimizer's step
// count and options, and every tensor's state joined (full[k][i]: tensor
// i's state of kind k, of kinds).
type reshardSource struct {
	step    int64
	world   int
	st      trainerState
	objects map[string]json.RawMessage
	optStep int64
	oo      *offload.Options
	full    [][][]float32
	kinds   []offload.StateKind
}

// stepMoved is readSource's error when what it read failed (err) and the
// source's committed step is now another (a trainer moved it, and its
// retention retired the step being read): Reshard reads again.
type stepMoved struct {
	from, to int64
	err      error
}

func (e *stepMoved) Error() string { return e.err.Error() }
func (e *stepMoved) Unwrap() error { return e.err }

// sourceStep returns the step src commits now: its job's latest, or its
// latest checkpoint's.
func sourceStep(src string) (int64, error) {
	if isJob(src) {
		step, world, err := checkpoint.JobLatest(checkpoint.OS, src)
		if err == nil {
			step, _ = checkpoint.MovedBack(checkpoint.OS, src, world, step)
		}
		return step, err
	}
	dir, err := checkpoint.Resolve(checkpoint.OS, src)
	if err != nil {
		return 0, err
	}
	c, err := checkpoint.Open(checkpoint.OS, dir, 0)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	return c.Manifest.Step, nil
}

// reshardReadHook, when set (tests), runs before Reshard reads each of
// its source's rank directories.
var reshardReadHook func(dir string)

// readSource reads src's latest checkpoint for Reshard to n ranks,
// checking first what n asks of its configuration. A failure while the
// source's step moved is a *stepMoved.
func readSource(src string, n int, out io.Writer) (rs *reshardSource, err error) {
	rs = &reshardSource{world: 1, step: -1}
	var dirs []string
	if isJob(src) {
		if err := checkpoint.CheckJob(checkpoint.OS, src, JobRank); err != nil {
			return nil, fmt.Errorf("trainer: reshard: %w", err)
		}
		step, world, err := checkpoint.JobLatest(checkpoint.OS, src)
		if err != nil {
			return nil, fmt.Errorf("trainer: reshard: %w (dos ckpt recover %s moves a damaged or unfinished job to the newest step every rank holds)", err, checkpoint.ShellQuote(src))
		}
		if moved, note := checkpoint.MovedBack(checkpoint.OS, src, world, step); note != "" {
			fmt.Fprintf(out, "reshard: %s\n", note)
			step = moved
		}
		rs.step, rs.world = step, world
		for r := range rs.world {
			dirs = append(dirs, checkpoint.StepDir(checkpoint.RankRoot(src, r), rs.step))
		}
	} else {
		dir, err := checkpoint.Resolve(checkpoint.OS, src)
		if err != nil {
			return nil, fmt.Errorf("trainer: reshard: %w", err)
		}
		dirs = []string{dir}
		rs.step = -1 // the manifest's, below
	}
	read := rs // rs is nil once a return has failed
	defer func() {
		if err != nil && read.step >= 0 {
			if now, nerr := sourceStep(src); nerr == nil && now != read.step {
				err = &stepMoved{from: read.step, to: now, err: err}
			}
		}
	}()
	c, err := checkpoint.Open(checkpoint.OS, dirs[0], 0)
	if err != nil {
		return nil, fmt.Errorf("trainer: reshard: %w", err)
	}
	st := &rs.st
	err = c.Object("trainer", st)
	if rs.world == 1 {
		rs.step = c.Manifest.Step
	}
	c.Close()
	if err != nil {
		return nil, fmt.Errorf("trainer: reshard: %s is not a dos train checkpoint: %w", dirs[0], err)
	}
	if err := checkState(st, rs.step, dirs[0]); err != nil {
		return nil, err
	}
	world := rs.world
	cfg := st.Config
	if w := max(cfg.GPUs, 1); w != world {
		if world == 1 {
			// src is a rank root, or a step directory in one.
			rr := filepath.Clean(src)
			if strings.HasPrefix(filepath.Base(rr), "step-") {
				rr = filepath.Dir(rr)
			}
			if note := outsideJob(src); note != "" {
				return nil, fmt.Errorf("trainer: reshard: %s", note)
			}
			return nil, fmt.Errorf("trainer: reshard: %s is in one rank's root of a job of %d ranks (dos train --gpus %d): reshard the job's root, %s", src, w, w, filepath.Dir(rr))
		}
		return nil, fmt.Errorf("trainer: reshard: %s: its trainer state says %d ranks, its job %d: %w", dirs[0], w, world, checkpoint.ErrCorrupt)
	}
	if n > 1 && cfg.Batch%n != 0 {
		return nil, fmt.Errorf("trainer: reshard to %d ranks: the run's batch %d is not a multiple of %d (each rank trains on batch/ranks rows)", n, cfg.Batch, n)
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
		return nil, fmt.Errorf("trainer: reshard to %d ranks: the run's configuration does not allow it: %s", n, strings.TrimPrefix(err.Error(), "trainer: "))
	}

	// Join the pieces: full[k][i] is tensor i's state of kind k.
	oo := cfg.optimizerOptions()
	oo.Threads = 0
	ts := cfg.Model.Tensors()
	kinds := []offload.StateKind{offload.MasterWeights, offload.ExpAvg, offload.ExpAvgSq}
	full := make([][][]float32, 4)
	for r, dir := range dirs {
		if reshardReadHook != nil {
			reshardReadHook(dir)
		}
		fmt.Fprintf(out, "reshard: reading %s (rank %d of %d)\n", dir, r, world)
		params := offloadParams(cfg.Model)
		if world > 1 {
			params = shardParams(cfg.Model, world, r)
		}
		o, err := offload.New(params, *oo)
		if err != nil {
			return nil, fmt.Errorf("trainer: reshard: %w", err)
		}
		_, objs, err := o.LoadCheckpoint(checkpoint.OS, dir)
		if err == nil && r == 0 {
			rs.objects, rs.optStep = objs, o.StepCount()
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
		if err == nil && o.StepCount() != rs.optStep {
			err = fmt.Errorf("its optimizer is at step %d, rank 0's at %d: %w", o.StepCount(), rs.optStep, checkpoint.ErrCorrupt)
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
			return nil, fmt.Errorf("trainer: reshard: %s: %w", dir, err)
		}
	}
	rs.oo, rs.full, rs.kinds = oo, full, kinds
	return rs, nil
}

// reshardTarget checks that dst can receive a re-sharded checkpoint of
// src, and returns the directory to write into: dst, or the target of
// the link dst (its links resolved). dst is absent (then created) or an
// empty directory (reshardEmpty), and neither src nor inside it.
func reshardTarget(src, dst string) (string, error) {
	target := dst
	if lst, err := os.Lstat(dst); err == nil && lst.Mode()&fs.ModeSymlink != 0 {
		t, err := filepath.EvalSymlinks(dst)
		if err != nil {
			return "", fmt.Errorf("trainer: reshard: the destination %s is a link whose target cannot be reached (%v): create its target, or choose another destination", dst, err)
		}
		target = t
	}
	switch st, err := os.Stat(target); {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return "", fmt.Errorf("trainer: reshard: the destination: %w", err)
	case !st.IsDir():
		return "", fmt.Errorf("trainer: reshard: the destination %s is a %s, not a directory; choose a new or empty directory", dst, checkpoint.FileKind(st.Mode()))
	}
	if err := reshardEmpty(dst, target); err != nil {
		return "", err
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
	s, d := abs(src), abs(target)
	if d == s || strings.HasPrefix(d, s+string(filepath.Separator)) {
		return "", fmt.Errorf("trainer: reshard: the destination %s is the source %s or inside it; choose a directory outside it", dst, src)
	}
	return target, nil
}

// reshardEmpty checks that target (dst's directory) is absent or empty:
// what it may hold is a lock file and the temporary directories of a
// Reshard killed before it moved anything into dst, which it removes.
// What an interrupted Reshard moved in (no latest beside it) is named so.
func reshardEmpty(dst, target string) error {
	es, err := os.ReadDir(target)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("trainer: reshard: the destination: %w", err)
	}
	var left, stale []string
	for _, e := range es {
		switch n := e.Name(); {
		case n == checkpoint.LockFile:
		case strings.HasPrefix(n, ReshardTmp):
			stale = append(stale, filepath.Join(target, n))
		default:
			left = append(left, n)
		}
	}
	if len(left) > 0 {
		if len(stale) > 0 {
			if _, err := os.Stat(filepath.Join(target, checkpoint.LatestFile)); errors.Is(err, fs.ErrNotExist) {
				return fmt.Errorf("trainer: reshard: %s holds what an interrupted reshard moved into it (%s, and no %s yet; the rest is in %s): dos ckpt recover %s finishes its moves, where it had committed its checkpoint; or remove what %s holds and run reshard again", dst, strings.Join(left, ", "), checkpoint.LatestFile, strings.Join(stale, ", "), checkpoint.ShellQuote(dst), dst)
			}
		}
		return fmt.Errorf("trainer: reshard: %s is not empty (%s); choose a new or empty directory", dst, strings.Join(left, ", "))
	}
	for _, p := range stale {
		if holder := checkpoint.Holder(checkpoint.OS, target); holder != "" {
			return fmt.Errorf("trainer: reshard: %s is in use by %s (another reshard?)", dst, holder)
		}
		if err := os.RemoveAll(p); err != nil {
			return fmt.Errorf("trainer: reshard: removing %s, left by an interrupted reshard: %w", p, err)
		}
	}
	return nil
}

// reshardMove moves the committed checkpoint in tmp into target (tmp's
// parent), its latest last, target fsynced before and after: until the
// latest is moved, target holds no latest, not a committed root.
func reshardMove(tmp, target string) error {
	es, err := os.ReadDir(tmp)
	if err != nil {
		return err
	}
	latest := false
	for _, e := range es {
		switch n := e.Name(); n {
		case checkpoint.LockFile:
		case checkpoint.LatestFile:
			latest = true
		default:
			if err := os.Rename(filepath.Join(tmp, n), filepath.Join(target, n)); err != nil {
				return err
			}
		}
	}
	if !latest {
		return fmt.Errorf("%s holds no %s", tmp, checkpoint.LatestFile)
	}
	if err := checkpoint.OS.SyncDir(target); err != nil {
		return err
	}
	if err := os.Rename(filepath.Join(tmp, checkpoint.LatestFile), filepath.Join(target, checkpoint.LatestFile)); err != nil {
		return err
	}
	return checkpoint.OS.SyncDir(target)
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
