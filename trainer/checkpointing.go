package trainer

import (
	"errors"
	"fmt"
	"time"

	"github.com/deepstates/dos/checkpoint"
)

// saver writes a run's checkpoints for its world, alone or as a job, with
// one mechanism: every rank's optimizer saves its state into its root
// (synchronously, checkpoint.Save, or lazily through the rank's own
// checkpoint.Engine), and a save is the run's once every rank's is
// durable. Alone the root is the run's --ckpt-dir itself; in a ZeRO-3 job
// (world.job) rank r's is checkpoint.RankRoot(root, r), each records its
// rank (rankObject), and the job commits the step (checkpoint.CommitJob)
// once all are durable: a rank that fails leaves the job's latest at the
// previous step, and the ranks that wrote the step are rewound at the
// next resume.
type saver struct {
	w    *world
	root string
	keep int // --ckpt-keep (0: all)
	logf func(format string, args ...any)
	// Lazy saves: each rank's engine on its root, made at the first
	// save, and the handles of the last save, which report commits.
	engines  []*checkpoint.Engine
	last     []*checkpoint.Handle
	lastStep int64
	// committed is the step the job last committed (-1: none yet).
	committed int64
	// abandoned says which lazy save of a job failed ("" for none): the
	// rank roots that wrote it hold a step the job never committed, and
	// each engine keeps only --ckpt-keep+1 steps, so a later save would
	// make a rank's retention retire the job's committed step (before
	// the job commits the later one, or for good if it fails too). No
	// lazy save is started after it: --resume rewinds the rank roots
	// first.
	abandoned string
}

// zeroSaveFault, when set (tests), runs before a job's rank's save of
// step: an error fails that rank's save as a failed write would.
var zeroSaveFault func(rank int, step int64) error

// rootOf returns rank r's root.
func (s *saver) rootOf(r int) string {
	if s.w.job {
		return checkpoint.RankRoot(s.root, r)
	}
	return s.root
}

// objectsOf returns what rank r's checkpoint records beside its state:
// objects, and in a job its rankObject.
func (s *saver) objectsOf(objects map[string]any, r int) map[string]any {
	if s.w.job {
		return rankObjects(objects, r, s.w.n)
	}
	return objects
}

// fault is zeroSaveFault's for rank r of a job.
func (s *saver) fault(r int, step int64) error {
	if f := zeroSaveFault; f != nil && s.w.job {
		return f(r, step)
	}
	return nil
}

// save writes step with objects synchronously (--ckpt-sync), the ranks in
// parallel, commits it for a job once all are durable, keeps the newest
// --ckpt-keep steps in every root, and says so.
func (s *saver) save(step int64, objects map[string]any) error {
	w := s.w
	t0 := time.Now()
	fail := func(err error) error { return fmt.Errorf("trainer: checkpoint at iteration %d: %w", step, err) }
	if w.job {
		if err := checkpoint.BeginJob(checkpoint.OS, s.root, w.n); err != nil {
			return fail(err)
		}
	}
	bytes, dirs := make([]int, w.n), make([]string, w.n)
	err := w.each(func(rk *rank) error {
		if err := s.fault(rk.r, step); err != nil {
			return err
		}
		snap, err := rk.opt.Snapshot(s.objectsOf(objects, rk.r))
		if err != nil {
			return err
		}
		snap.Step = step
		if dirs[rk.r], err = checkpoint.Save(checkpoint.OS, s.rootOf(rk.r), snap); err != nil {
			return err
		}
		for _, tn := range snap.Tensors {
			for _, b := range tn.Data {
				bytes[rk.r] += len(b)
			}
		}
		return nil
	})
	if err != nil && w.job {
		err = fmt.Errorf("%w (the job's latest checkpoint is unchanged)", err)
	}
	if err != nil {
		return fail(err)
	}
	total := 0
	for _, b := range bytes {
		total += b
	}
	took := time.Since(t0).Round(time.Millisecond)
	if w.job {
		if err := checkpoint.CommitJob(checkpoint.OS, s.root, w.n, step); err != nil {
			return fail(err)
		}
		s.committed = step
		s.logf("checkpoint %s, step %d (%d ranks, %.1f MB, synchronous, %v)\n", s.root, step, w.n, float64(total)/1e6, took)
	} else {
		s.logf("checkpoint %s (%.1f MB, synchronous, %v)\n", dirs[0], float64(total)/1e6, took)
	}
	return s.retain(s.keep)
}

// retain keeps the newest keep steps in every rank's root (0: all).
func (s *saver) retain(keep int) error {
	if keep <= 0 {
		return nil
	}
	for r := range s.w.n {
		if err := checkpoint.Retain(checkpoint.OS, s.rootOf(r), keep); err != nil {
			return err
		}
	}
	return nil
}

// saveLazily reports the previous lazy save (waiting for it), then hands
// every rank's state of step, with objects, to the rank's engine
// (ringBytes of staging each) and returns once each rank's capture has
// started: the saves run in the background, and the run's latest moves
// to step when all are durable (report). In a job each rank root keeps
// --ckpt-keep+1 steps while the saves run: its newest save is durable
// before the job commits it, and the job's latest, one save behind until
// then, must stay in every rank root (close retires the extra one).
//
// Errors: the previous save's; a job whose earlier lazy save failed
// (abandoned); a rank whose save cannot start (its error, by rank: the
// job's latest is unchanged, the other ranks' saves of step go on and are
// rewound at the next resume).
func (s *saver) saveLazily(step int64, objects map[string]any, ringBytes int64) error {
	w := s.w
	if err := s.report(true); err != nil {
		return err
	}
	fail := func(err error) error { return fmt.Errorf("trainer: checkpoint at iteration %d: %w", step, err) }
	if s.abandoned != "" {
		return fail(fmt.Errorf("no checkpoint of step %d saved: %s, and its ranks' rank roots keep one step more than --ckpt-keep, the job's committed one among them: a later save would let their retention retire it; resume the job (dos train --resume) to save again", step, s.abandoned))
	}
	if w.job {
		if err := checkpoint.BeginJob(checkpoint.OS, s.root, w.n); err != nil {
			return fail(err)
		}
	}
	if s.engines == nil { // every rank's, or none (a later save tries again)
		keep := s.keep
		if w.job && keep > 0 {
			keep++
		}
		var engines []*checkpoint.Engine
		for r := range w.n {
			e, err := checkpoint.NewEngine(checkpoint.OS, s.rootOf(r),
				checkpoint.EngineOptions{ChunkBytes: checkpoint.DefaultChunkBytes, RingBytes: ringBytes, Keep: keep})
			if err != nil {
				if w.job {
					err = fmt.Errorf("rank %d: %w", r, err)
				}
				for _, e := range engines {
					e.Close()
				}
				return fmt.Errorf("trainer: checkpoint engine: %w", err)
			}
			engines = append(engines, e)
		}
		s.engines = engines
	}
	s.last, s.lastStep = make([]*checkpoint.Handle, w.n), step
	var errs []error
	for _, rk := range w.ranks {
		h, err := s.startSave(rk, step, objects)
		if err != nil {
			if w.job {
				err = fmt.Errorf("rank %d: %w", rk.r, err)
			}
			errs = append(errs, err)
			continue
		}
		s.last[rk.r] = h
	}
	if len(errs) == 0 {
		return nil
	}
	s.last = nil
	if !w.job {
		return fail(errs[0])
	}
	// Abandoned: the job never commits step.
	s.abandoned = fmt.Sprintf("the lazy save of step %d failed (the job's latest is still step %d)", step, s.committed)
	return fail(fmt.Errorf("%w (the job's latest checkpoint is unchanged)", errors.Join(errs...)))
}

// startSave starts rank rk's lazy save of step.
func (s *saver) startSave(rk *rank, step int64, objects map[string]any) (*checkpoint.Handle, error) {
	if err := s.fault(rk.r, step); err != nil {
		return nil, err
	}
	return rk.opt.SaveAsync(s.engines[rk.r], step, s.objectsOf(objects, rk.r))
}

// report says the last lazy save once every rank's save of it is
// durable, waiting for them with wait (without, it returns nil while one
// is in flight), and commits a job's step (checkpoint.CommitJob).
//
// Errors: a rank's save that failed (by rank in a job: the job's latest
// is unchanged); CommitJob's.
func (s *saver) report(wait bool) error {
	if s.last == nil {
		return nil
	}
	if !wait {
		for _, h := range s.last {
			if h != nil && !h.Done() {
				return nil
			}
		}
	}
	w, hs, step := s.w, s.last, s.lastStep
	s.last = nil
	var errs []error
	var dir string
	for r, h := range hs {
		d, err := h.Wait()
		if err != nil && w.job {
			err = fmt.Errorf("rank %d: %w", r, err)
		}
		if err != nil {
			errs = append(errs, err)
		}
		dir = d
	}
	if len(errs) > 0 && !w.job {
		return fmt.Errorf("trainer: checkpoint at iteration %d: %w", step, errs[0])
	}
	if len(errs) > 0 {
		s.abandoned = fmt.Sprintf("the lazy save of step %d failed (the job's latest is still step %d)", step, s.committed)
		return fmt.Errorf("trainer: checkpoint at iteration %d: %w (the job's latest checkpoint is unchanged)", step, errors.Join(errs...))
	}
	if !w.job {
		s.logf("checkpoint %s (%v)\n", dir, hs[0].Stats())
		return nil
	}
	if err := checkpoint.CommitJob(checkpoint.OS, s.root, w.n, step); err != nil {
		return fmt.Errorf("trainer: %w", err)
	}
	s.committed = step
	s.logf("checkpoint %s, step %d (%d ranks, each saved lazily; committed for the job once all were durable)\n", s.root, step, w.n)
	return nil
}

// close closes the engines (after the optimizers: a lazy save's capture
// reads their state) and, once a job's last save is committed and
// nothing newer is in a rank root, lets the rank roots keep --ckpt-keep
// again (their engines kept one more while the job's commit lagged). A
// second call does nothing.
func (s *saver) close() error {
	var errs []error
	for _, e := range s.engines {
		errs = append(errs, e.Close())
	}
	if s.engines != nil && s.w.job && s.last == nil && s.committed >= 0 && s.committed == s.lastStep {
		errs = append(errs, s.retain(s.keep))
	}
	s.engines = nil
	return errors.Join(errs...)
}

// load loads every rank's state of step from its root, dir being rank
// 0's step directory (the others' hold the same step: save), each
// checked to be that rank's (checkRank).
//
// Errors: a rank's checkpoint that cannot be loaded or is another
// rank's, by rank in a job, with what would repair it.
func (s *saver) load(dir string, step int64) error {
	w := s.w
	for _, rk := range w.ranks {
		d := dir
		if rk.r > 0 {
			d = checkpoint.StepDir(s.rootOf(rk.r), step)
		}
		_, objs, err := rk.opt.LoadCheckpoint(checkpoint.OS, d)
		if err == nil && w.job {
			err = checkRank(objs, d, rk.r, w.n)
		}
		switch {
		case err == nil:
		case !w.job:
			return fmt.Errorf("trainer: resume from %s: %w%s", s.root, err, recoverHint(err, s.root))
		case rk.r == 0:
			return fmt.Errorf("trainer: resume from %s: rank 0: %w%s", s.root, err, jobRecoverHint(err, s.root, 0))
		default:
			return fmt.Errorf("trainer: resume from %s: rank %d: %w%s", d, rk.r, err, jobRecoverHint(err, s.root, rk.r))
		}
	}
	return nil
}

// save saves the run's checkpoint of this iteration into cfg.CkptDir
// (nothing without one): lazily unless --ckpt-sync.
func (t *Trainer) save() error {
	if t.cfg.CkptDir == "" {
		return nil
	}
	t.state.LoaderPos = t.loader.position()
	rng, err := t.rng.MarshalBinary()
	if err != nil {
		return err
	}
	t.state.RNG = rng
	t.state.Config = t.cfg
	objects := map[string]any{"trainer": t.state}
	step := int64(t.state.Iteration) // skipped optimizer steps still count as iterations
	if t.cfg.CkptSync {
		return t.saver.save(step, objects)
	}
	return t.saver.saveLazily(step, objects, int64(t.cfg.rankRingBytes(float64(t.cfg.Model.NumParams()), t.w.n)))
}
