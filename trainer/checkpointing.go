package trainer

import (
	"fmt"
	"time"

	"github.com/deepstates/dos/checkpoint"
)

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
	if t.zero != nil && !t.cfg.CkptSync {
		// The previous save first: committed for the job, and said so.
		if err := t.reportSave(true); err != nil {
			return err
		}
		ring := int64(t.cfg.rankRingBytes(float64(t.cfg.Model.NumParams()), t.zero.n))
		if err := t.zero.saveLazily(t.cfg.CkptDir, step, objects, t.cfg.CkptKeep, ring); err != nil {
			return fmt.Errorf("trainer: checkpoint at iteration %d: %w", t.state.Iteration, err)
		}
		return nil
	}
	if t.zero != nil {
		t0 := time.Now()
		bytes, err := t.zero.save(t.cfg.CkptDir, step, objects, t.cfg.CkptKeep)
		if err != nil {
			return fmt.Errorf("trainer: checkpoint at iteration %d: %w", t.state.Iteration, err)
		}
		t.logf("checkpoint %s, step %d (%d ranks, %.1f MB, synchronous, %v)\n", t.cfg.CkptDir, step, t.zero.n, float64(bytes)/1e6, time.Since(t0).Round(time.Millisecond))
		return nil
	}
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
// engine's staging ring is TrainConfig.CkptRing's (ringBytes).
func (t *Trainer) saveLazily(step int64, objects map[string]any) error {
	if t.engine == nil {
		ring := int64(t.cfg.ringBytes(float64(t.opt.NumParams())))
		e, err := checkpoint.NewEngine(checkpoint.OS, t.cfg.CkptDir, checkpoint.EngineOptions{ChunkBytes: checkpoint.DefaultChunkBytes, RingBytes: ring, Keep: t.cfg.CkptKeep})
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
// with wait) and returns its error; for ranks (t.zero) it commits the
// step for the job once every rank's save is durable.
func (t *Trainer) reportSave(wait bool) error {
	if t.zero != nil {
		step, err := t.zero.commitLazy(t.cfg.CkptDir, wait)
		if err != nil {
			return fmt.Errorf("trainer: %w", err)
		}
		if step >= 0 {
			t.logf("checkpoint %s, step %d (%d ranks, each saved lazily; committed for the job once all were durable)\n", t.cfg.CkptDir, step, t.zero.n)
		}
		return nil
	}
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
