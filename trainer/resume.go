package trainer

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/offload"
)

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
	if job, ok := checkpoint.RankSlot(checkpoint.OS, root); ok {
		return nil, nil, fmt.Errorf("trainer: --ckpt-dir %s is a rank root of the job %s: a run there would mix its checkpoints with the job's ranks; resume the job (--ckpt-dir %s --gpus N), or choose a directory outside it", root, job, checkpoint.ShellQuote(job))
	}
	if single, ok := checkpoint.InSingleRoot(checkpoint.OS, root); ok {
		return nil, nil, fmt.Errorf("trainer: --ckpt-dir %s is inside %s, which holds a single rank's checkpoints: a root named rank-NNNNN there would be taken for a job's rank root, and %s would no longer open; choose a directory outside it", root, single, single)
	}
	lock, err := checkpoint.Lock(checkpoint.OS, root)
	if err != nil {
		return nil, nil, fmt.Errorf("trainer: --ckpt-dir: %w", err)
	}
	if p := checkpoint.InterruptedSetAside(checkpoint.OS, root); p != "" {
		lock.Unlock()
		return nil, nil, fmt.Errorf("trainer: --ckpt-dir %s holds %s: a dos ckpt recover was cut short while it set a job's files aside there; run dos ckpt recover %s to finish it first (a run started now would be set aside with them)", root, p, checkpoint.ShellQuote(root))
	}
	if err := removeReshardLeftovers(root, cfg.Resume, out); err != nil {
		lock.Unlock()
		return nil, nil, err
	}
	if cfg.GPUs > 1 {
		rec, err := openJob(cfg, out)
		if err != nil {
			lock.Unlock()
			return nil, nil, err
		}
		return lock, rec, nil
	}
	if isJob(root) {
		lock.Unlock()
		if err := neverCommitted(root); err != nil {
			return nil, nil, err
		}
		return nil, nil, fmt.Errorf("trainer: --ckpt-dir %s holds the checkpoints of a job of ranks (%s, rank-*): pass the --gpus it was trained with, or re-shard it onto one rank first (`dos ckpt reshard %s NEWROOT --gpus 1`) and resume from NEWROOT", root, checkpoint.JobFile, checkpoint.ShellQuote(root))
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
		if err := nothingToResume(root); err != nil {
			lock.Unlock()
			return nil, nil, err
		}
		fmt.Fprintf(out, "resume: no checkpoint in %s; starting at iteration 0\n", root)
		return lock, nil, nil
	}
	if err != nil {
		lock.Unlock()
		return nil, nil, fmt.Errorf("trainer: resume from %s: %w%s", root, err, recoverHint(err, root))
	}
	if rec.Repaired {
		fmt.Fprintf(out, "resume: recovered %s: %s\n", root, rec.Note)
	}
	return lock, rec, nil
}

// removeReshardLeftovers removes what a killed dos ckpt reshard left in
// root (ReshardTmp*: never a checkpoint), saying so on out. The caller
// holds root's lock, which a running Reshard into root would hold.
//
// With resume, a root holding nothing but such a leftover (a reshard
// killed before its moves, the only thing ever put there) is refused,
// left as it is: --resume there would otherwise start over at iteration
// 0, which is not what the user asked for (ReshardLeftovers).
func removeReshardLeftovers(root string, resume bool, out io.Writer) error {
	tmps, moved := ReshardLeftovers(root) // moved: root holds what a reshard moves in (job.json, rank roots, steps, latest)
	if len(tmps) > 0 && !moved && resume {
		return fmt.Errorf("trainer: --resume: %s and resume from %s; or, to start afresh there, run without --resume", KilledReshardNote(root, tmps[0]), root)
	}
	for _, p := range tmps {
		if moved {
			// A reshard killed during its moves: root holds part of its
			// committed checkpoint, p the rest. Never removed.
			done, err := finishReshardMoves(p, root)
			if err != nil {
				return err
			}
			if done {
				if err := os.RemoveAll(p); err != nil {
					return fmt.Errorf("trainer: --ckpt-dir: removing %s, emptied: %w", p, err)
				}
				fmt.Fprintf(out, "checkpoint: finished the moves of a dos ckpt reshard killed while it moved its checkpoint from %s into %s (then removed it, empty)\n", p, root)
				continue
			}
		}
		if err := os.RemoveAll(p); err != nil {
			return fmt.Errorf("trainer: --ckpt-dir: removing %s, the leftover of a killed dos ckpt reshard: %w", p, err)
		}
		fmt.Fprintf(out, "checkpoint: removed %s, the leftover of a killed dos ckpt reshard (never a checkpoint)\n", p)
	}
	return nil
}

// ReshardLeftovers returns the leftovers of killed dos ckpt reshards in
// root (its ReshardTmp* directories, in name order; none for none), and
// whether root holds anything else besides its lock file: what such a
// reshard moved in before it was killed (FinishReshard completes the
// moves), where without it a reshard killed before its moves left root
// holding no checkpoint. A root missing or unreadable gives none, false.
// While a reshard runs into root (checkpoint.Holder), the same is seen.
func ReshardLeftovers(root string) (tmps []string, moving bool) {
	es, err := os.ReadDir(root)
	if err != nil {
		return nil, false
	}
	for _, e := range es {
		switch n := e.Name(); {
		case strings.HasPrefix(n, ReshardTmp):
			tmps = append(tmps, filepath.Join(root, n))
		case n != checkpoint.LockFile:
			moving = true
		}
	}
	return tmps, moving
}

// KilledReshardNote says that root holds no checkpoint, only tmp, the
// leftover of a dos ckpt reshard into it killed before it committed, and
// what to do: the message of --resume and of dos ckpt recover there.
func KilledReshardNote(root, tmp string) string {
	return fmt.Sprintf("%s holds no checkpoint, only %s, the leftover of a dos ckpt reshard into it that was killed before it committed (never a checkpoint): run that reshard again (it removes the leftover; its source is unchanged)", root, tmp)
}

// ReshardMovesLeft returns the leftover of a dos ckpt reshard killed
// while it moved its committed checkpoint into root, when it still holds
// entries to move (more than a lock file) and no process holds root: what
// FinishReshard completes. It returns "" otherwise.
func ReshardMovesLeft(root string) string {
	tmps, moving := ReshardLeftovers(root)
	if len(tmps) == 0 || !moving || checkpoint.Holder(checkpoint.OS, root) != "" {
		return ""
	}
	for _, tmp := range tmps {
		if es, err := os.ReadDir(tmp); err == nil && slices.ContainsFunc(es, func(e os.DirEntry) bool { return e.Name() != checkpoint.LockFile }) {
			return tmp
		}
	}
	return ""
}

// FinishReshard completes, under root's lock, the moves of a dos ckpt
// reshard killed while it moved its committed checkpoint into root (a
// ReshardTmp* directory beside what it moved already), saying so on out;
// anything else is left as it is. It reports whether it finished any.
// dos ckpt recover runs it first, so that such a root is not taken for a
// job missing rank roots.
func FinishReshard(root string, out io.Writer) (bool, error) {
	tmps, moved := ReshardLeftovers(root)
	if !moved || len(tmps) == 0 {
		return false, nil
	}
	lock, err := checkpoint.Lock(checkpoint.OS, root)
	if err != nil {
		return false, err
	}
	defer lock.Unlock()
	finished := false
	for _, p := range tmps {
		done, err := finishReshardMoves(p, root)
		if err != nil {
			return finished, err
		}
		if done {
			if err := os.RemoveAll(p); err != nil {
				return true, fmt.Errorf("trainer: removing %s, emptied: %w", p, err)
			}
			fmt.Fprintf(out, "finished the moves of a dos ckpt reshard killed while it moved its checkpoint from %s into %s (then removed it, empty)\n", p, root)
			finished = true
		}
	}
	return finished, nil
}

// finishReshardMoves completes what a dos ckpt reshard killed during its
// moves (reshardMove) left: tmp, in root, holds the rest of its committed
// checkpoint (its latest, moved last, among them), root the entries
// moved already. The entries of tmp go into root, its latest last, and
// it reports true. A tmp that holds nothing but a lock file (killed after
// its last move) reports false; one that holds more but no latest, or an
// entry root holds too, is refused, naming it, nothing changed.
func finishReshardMoves(tmp, root string) (bool, error) {
	es, err := os.ReadDir(tmp)
	if err != nil {
		return false, fmt.Errorf("trainer: --ckpt-dir: reading %s, the leftover of a killed dos ckpt reshard: %w", tmp, err)
	}
	var names []string
	latest := false
	for _, e := range es {
		switch n := e.Name(); n {
		case checkpoint.LockFile:
		case checkpoint.LatestFile:
			latest = true
			names = append(names, n)
		default:
			names = append(names, n)
		}
	}
	if len(names) == 0 {
		return false, nil
	}
	refuse := func(why string) error {
		return fmt.Errorf("trainer: --ckpt-dir %s holds %s, the leftover of a dos ckpt reshard killed while it moved its checkpoint into %s (%s), and %s: nothing was changed; move its entries (%s) into %s yourself, the latest last, or remove %s and reshard again",
			root, tmp, root, strings.Join(names, ", "), why, strings.Join(names, ", "), root, checkpoint.ShellQuote(root))
	}
	if !latest {
		return false, refuse("no " + checkpoint.LatestFile + " in it (not what a reshard moving its committed checkpoint leaves)")
	}
	for _, n := range names {
		if _, err := os.Lstat(filepath.Join(root, n)); !errors.Is(err, fs.ErrNotExist) {
			return false, refuse(fmt.Sprintf("%s holds %s too", root, n))
		}
	}
	if err := reshardMove(tmp, root); err != nil {
		return false, fmt.Errorf("trainer: --ckpt-dir: finishing the moves of a killed dos ckpt reshard from %s: %w", tmp, err)
	}
	return true, nil
}

// openJob is openRoot for the ranks of TrainConfig.GPUs: CkptDir is a
// job's root (checkpoint.CommitJob). Without Resume it must hold nothing;
// with it, checkpoint.ResumeJob finds the newest step every rank holds and
// points the ranks' roots and the job's latest at it, and the returned
// Recovery names rank 0's directory of it (the trainer's objects). A
// single-rank root and another rank count are refused.
func openJob(cfg *TrainConfig, out io.Writer) (*checkpoint.Recovery, error) {
	root := cfg.CkptDir
	if !cfg.Resume {
		fresh, err := checkpoint.JobFresh(checkpoint.OS, root)
		if err != nil {
			return nil, fmt.Errorf("trainer: --ckpt-dir: %w", err)
		}
		if !fresh {
			if err := neverCommitted(root); err != nil {
				return nil, err
			}
			return nil, fmt.Errorf("trainer: --ckpt-dir %s already holds checkpoints: pass --resume to continue, or choose another --ckpt-dir", root)
		}
		return nil, nil
	}
	if isJob(root) {
		// The rank roots are the job's, and its job.json theirs: what
		// the loads below check of each rank, before anything changes.
		if err := checkpoint.CheckJob(checkpoint.OS, root, JobRank); err != nil {
			return nil, fmt.Errorf("trainer: resume from %s: %w", root, err)
		}
	}
	if _, world, err := checkpoint.JobLatest(checkpoint.OS, root); err == nil && world != cfg.GPUs {
		return nil, fmt.Errorf("trainer: resume from %s: its checkpoints hold %d ranks' pieces, this run has --gpus %d: pass --gpus %d, or re-shard it first (`dos ckpt reshard %s NEWROOT --gpus %d`) and resume from NEWROOT", root, world, cfg.GPUs, world, checkpoint.ShellQuote(root), cfg.GPUs)
	}
	step, note, err := checkpoint.ResumeJob(checkpoint.OS, root, cfg.GPUs)
	if err != nil {
		hint := ""
		switch job := filepath.Dir(filepath.Clean(root)); {
		case strings.HasPrefix(filepath.Base(filepath.Clean(root)), "rank-") && isJob(job):
			hint = fmt.Sprintf(" (%s is one rank's root of the job %s: resume the job, --ckpt-dir %s)", root, job, checkpoint.ShellQuote(job))
		case isJob(root):
		case outsideJob(root) != "":
			hint = " (" + outsideJob(root) + ")"
		default:
			hint = fmt.Sprintf(" (to continue a single-rank run on %d ranks, re-shard it first: `dos ckpt reshard %s NEWROOT --gpus %d`)", cfg.GPUs, checkpoint.ShellQuote(root), cfg.GPUs)
		}
		return nil, fmt.Errorf("trainer: resume from %s: %w%s", root, err, hint)
	}
	if note != "" {
		fmt.Fprintf(out, "resume: recovered %s: %s\n", root, note)
	}
	if step < 0 {
		if err := nothingToResume(root); err != nil {
			return nil, err
		}
		fmt.Fprintf(out, "resume: no checkpoint in %s; starting at iteration 0\n", root)
		return nil, nil
	}
	return &checkpoint.Recovery{Dir: checkpoint.StepDir(checkpoint.RankRoot(root, 0), step)}, nil
}

// neverCommitted returns the error of a run on root, which holds a job
// that never committed a checkpoint (checkpoint.JobNeverCommitted: a run
// killed before its first commit), when that run may not start there:
// a run from scratch, or a --resume of one rank (nil otherwise).
func neverCommitted(root string) error {
	world, ok := checkpoint.JobNeverCommitted(checkpoint.OS, root)
	if !ok {
		return nil
	}
	return fmt.Errorf("trainer: --ckpt-dir %s holds a job of %s that never committed a checkpoint (%s and no latest: a run killed before its first commit?): dos ckpt recover %s removes what it left, for a new run; or dos train --resume --gpus N starts it over",
		root, checkpoint.Ranks(world), checkpoint.JobFile, checkpoint.ShellQuote(root))
}

// nothingToResume returns the error of --resume on root, which holds no
// checkpoint, when dos ckpt recover set aside what it held (nil
// otherwise: a new root, where --resume starts at iteration 0): resuming
// there would start over, which --resume was not asked for.
func nothingToResume(root string) error {
	aside := checkpoint.Aside(checkpoint.OS, root)
	if len(aside) == 0 {
		return nil
	}
	return fmt.Errorf("trainer: --resume: %s holds no checkpoint to resume: what it held did not verify and was set aside by dos ckpt recover (%s, kept whole); to start afresh there, run without --resume", root, strings.Join(aside, ", "))
}

// JobRank is a checkpoint.Identify for dos train's checkpoints: the rank
// and rank count (--gpus) a job's checkpoint records (its rank record,
// rankObject), ranks 0 for a checkpoint without it (a single rank's, or an
// older one); the run's identity (object "trainer", run_id: "" in older
// checkpoints); and what every rank's checkpoint of one step holds alike:
// the trainer's state (object "trainer", whole), the optimizer's step
// and its hyperparameters (object "optimizer": step, hyper,
// options.hyper), each as canonical JSON.
//
// Errors: a rank record that does not decode, or disagrees with itself or
// with the trainer state's --gpus (ErrCorrupt, naming the checkpoint).
func JobRank(c *checkpoint.Checkpoint) (checkpoint.RankID, error) {
	id := checkpoint.RankID{Agree: map[string]string{}}
	var st trainerState
	stErr := c.Object("trainer", &st)
	if stErr == nil {
		id.Run = st.RunID
		if b, err := json.Marshal(st); err == nil {
			id.Agree[`object "trainer" (iteration, data position, RNG, configuration, run)`] = string(b)
		}
	}
	var opt, opts map[string]json.RawMessage // Object decodes strictly: the fields compared, as they are
	if _, ok := c.Manifest.Objects["optimizer"]; ok && c.Object("optimizer", &opt) == nil {
		_ = json.Unmarshal(opt["options"], &opts)
		for k, raw := range map[string]json.RawMessage{
			`object "optimizer": step`: opt["step"], `object "optimizer": hyper`: opt["hyper"], `object "optimizer": options.hyper`: opts["hyper"],
		} {
			var v any
			if len(raw) > 0 && json.Unmarshal(raw, &v) == nil {
				b, _ := json.Marshal(v)
				id.Agree[k] = string(b)
			}
		}
	}
	if _, ok := c.Manifest.Objects[rankObjectName]; !ok {
		return id, nil
	}
	var ro rankObject
	if err := c.Object(rankObjectName, &ro); err != nil {
		return id, err
	}
	if ro.Ranks < 1 || ro.Ranks > checkpoint.MaxWorldSize || ro.Rank < 0 || ro.Rank >= ro.Ranks {
		return id, fmt.Errorf("%w: %s: object %q records rank %d of %d ranks", checkpoint.ErrCorrupt, c.Dir, rankObjectName, ro.Rank, ro.Ranks)
	}
	if stErr == nil && st.Config.GPUs != ro.Ranks {
		return id, fmt.Errorf("%w: %s: object %q records rank %d of %d ranks, object \"trainer\" --gpus %d", checkpoint.ErrCorrupt, c.Dir, rankObjectName, ro.Rank, ro.Ranks, st.Config.GPUs)
	}
	id.Rank, id.Ranks = ro.Rank, ro.Ranks
	return id, nil
}

// isJob reports whether root holds a job's checkpoints: its job.json or
// a rank root (checkpoint.IsJob).
func isJob(root string) bool {
	return checkpoint.IsJob(checkpoint.OS, root)
}

// outsideJob returns what path (a root, or a step directory in one) is
// when its checkpoint records rank r of a job of n > 1 ranks (rankObject)
// but its root is not in a job's root: one rank's pieces moved or copied
// out of their job, no run of their own; "" otherwise.
func outsideJob(path string) string {
	c, err := checkpoint.OpenPath(checkpoint.OS, path, 0)
	if err != nil {
		return ""
	}
	r, n, ok := CheckpointRank(c)
	c.Close()
	rr := filepath.Dir(c.Dir)
	if !ok || n < 2 || isJob(filepath.Dir(rr)) {
		return ""
	}
	return fmt.Sprintf("%s holds rank %d's pieces of a job of %s (its checkpoints record it), outside its job's root: no run of its own; put it back as %s in its job's root, beside %s and the other ranks' roots, and use that root",
		rr, r, checkpoint.Ranks(n), filepath.Base(checkpoint.RankRoot("", r)), checkpoint.JobFile)
}

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
	manifestStep := c.Manifest.Step
	c.Close()
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("trainer: resume from %s: not a dos train checkpoint: %w", dir, err)
	}
	if err != nil {
		// Its CRC matched: a trainer state that does not decode is
		// damaged (or edited), as dos ckpt verify says.
		if !errors.Is(err, checkpoint.ErrCorrupt) {
			err = fmt.Errorf("%w: %w", checkpoint.ErrCorrupt, err)
		}
		return fmt.Errorf("trainer: resume from %s: its trainer state does not decode: %w%s", dir, err, recoverHint(err, root))
	}
	if err := checkState(&st, manifestStep, dir); err != nil {
		return fmt.Errorf("%w%s", err, recoverHint(err, root))
	}
	if err := CheckCheckpointConfig(st.Config, dir); err != nil {
		return fmt.Errorf("%w%s", err, recoverHint(err, root))
	}
	// The model's shape and the batch cannot change: name every flag that
	// differs (dos train takes the ones not given from the checkpoint).
	var differ []string
	then, _ := NewTokenizer(st.Config.Tokenizer) // "" (older checkpoints) is byte
	thenTok := st.Config.Tokenizer
	if then != nil {
		thenTok = then.Name()
	}
	for _, d := range []struct {
		flag      string
		now, then any
	}{
		{"--layers", t.cfg.Model.NLayer, st.Config.Model.NLayer}, {"--heads", t.cfg.Model.NHead, st.Config.Model.NHead},
		{"--embd", t.cfg.Model.NEmbd, st.Config.Model.NEmbd}, {"--ctx", t.cfg.Model.NCtx, st.Config.Model.NCtx},
		{"--batch", t.cfg.Batch, st.Config.Batch}, {"--tokenizer", t.tok.Name(), thenTok},
		{"vocabulary (no flag)", t.cfg.Model.VocabSize, st.Config.Model.VocabSize},
	} {
		if d.now != d.then {
			differ = append(differ, fmt.Sprintf("%s %v (the checkpoint's: %v)", d.flag, d.now, d.then))
		}
	}
	if len(differ) > 0 {
		return fmt.Errorf("trainer: resume from %s: %s: a resumed run keeps the model's shape and batch (it was trained with %s); omit these flags",
			dir, strings.Join(differ, ", "), st.Config.shapeFlags())
	}
	if !t.w.job && st.Config.GPUs > 1 {
		return fmt.Errorf("trainer: resume from %s: it is one rank's root of a job of %d ranks (dos train --gpus %d): resume the job's root, its parent directory, with --gpus %d, or re-shard that for one rank (`dos ckpt reshard %s NEWROOT --gpus 1`)",
			root, st.Config.GPUs, st.Config.GPUs, st.Config.GPUs, checkpoint.ShellQuote(filepath.Dir(filepath.Clean(root))))
	}
	if err := t.saver.load(dir, int64(st.Iteration)); err != nil {
		return err
	}
	if st.Data != t.state.Data {
		was, is := "a text (--text)", "pre-tokenized data (--data)"
		if st.Data != "" {
			was, is = is, was
		}
		return fmt.Errorf("trainer: resume from %s: it was trained on %s, this run on %s", dir, was, is)
	}
	if st.TextCRC != t.state.TextCRC || st.TextBytes != t.state.TextBytes {
		what := "text"
		if st.Data != "" {
			what = "token data"
		}
		return fmt.Errorf("trainer: resume from %s: it was trained on another %s (%d bytes, crc32 %#08x; this run: %d bytes, %#08x)",
			dir, what, st.TextBytes, st.TextCRC, t.state.TextBytes, t.state.TextCRC)
	}
	if st.TrainTokens != 0 && st.TrainTokens != t.state.TrainTokens {
		return fmt.Errorf("trainer: resume from %s: the same tokens split another way: %d of them trained, this run would train on %d (--val-data, or its absence, differs)",
			dir, st.TrainTokens, t.state.TrainTokens)
	}
	if st.Iteration < 0 || int64(st.Iteration) < t.opt.StepCount() || (st.LossScale != 0 && !validScale(st.LossScale)) {
		return fmt.Errorf("trainer: resume from %s: inconsistent trainer state (iteration %d, optimizer step %d, loss scale %v)",
			dir, st.Iteration, t.opt.StepCount(), st.LossScale)
	}
	if err := t.loader.SetPos(st.LoaderPos); err != nil {
		return fmt.Errorf("trainer: resume from %s: %s, object \"trainer\", loader_pos: %w", dir, filepath.Join(dir, checkpoint.ManifestFile), err)
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
		kept      bool // the checkpoint's value continues (else this run's applies)
	}{
		{"--weight-decay", t.cfg.WeightDecay, h.WeightDecay, true}, {"--beta1", t.cfg.Betas[0], h.Betas[0], true},
		{"--beta2", t.cfg.Betas[1], h.Betas[1], true}, {"--eps", t.cfg.Eps, h.Eps, true},
		{"mode (no flag: dos train runs AdamW)", flags.Mode, h.Mode, true},
		{"maximize (no flag: dos train minimizes)", flags.Maximize, h.Maximize, true},
		{"amsgrad (no flag)", flags.AMSGrad, h.AMSGrad, true},
		{"--loss-scale", t.cfg.LossScale, old.LossScale, true}, {"--seed", t.cfg.Seed, old.Seed, true},
		{"--lr", t.cfg.LR, old.LR, false}, {"--warmup", t.cfg.WarmupSteps, old.WarmupSteps, false},
		{"--min-lr-ratio", t.cfg.MinLRRatio, old.MinLRRatio, false},
		{"--clip", t.cfg.MaxGradNorm, old.MaxGradNorm, false},
		{"--grad-dtype", t.cfg.GradDType, old.GradDType, false}, {"--working-dtype", t.cfg.WorkingDType, old.WorkingDType, false},
		{"--subgroup-size", t.cfg.SubgroupSize, old.SubgroupSize, false}, {"--bf16-params", t.cfg.BF16Params, old.BF16Params, false}, {"--threads", t.cfg.Threads, old.Threads, false},
	} {
		if d.now == d.then {
			continue
		}
		consequence := "this run's value applies from here on"
		if d.kept {
			consequence = "the checkpoint's state continues"
		}
		fmt.Fprintf(t.out, "resume: %s %v differs from the checkpoint's %v; %s\n", d.flag, d.now, d.then, consequence)
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
	if st.RunID == "" { // an older checkpoint: this run's from here on
		st.RunID = t.state.RunID
	}
	t.state = st
	fmt.Fprintf(t.out, "resume: %s at iteration %d (optimizer step %d)\n", dir, st.Iteration, t.opt.StepCount())
	if st.Iteration >= t.cfg.Steps {
		done := "already completed"
		if st.Iteration > t.cfg.Steps {
			done = "is past"
		}
		fmt.Fprintf(t.out, "resume: the checkpoint at step %d %s this run's --steps %d: nothing to train (to train further, pass --steps M with M > %d)\n", st.Iteration, done, t.cfg.Steps, st.Iteration)
	}
	return nil
}

// checkState checks the trainer state st read from the checkpoint in dir,
// whose manifest says step: its iteration is the step it was saved at
// (save), and its counters are within what a run reaches. Its error
// names the manifest and the field (ErrCorrupt: the object's CRC32C
// matched, so it was written so).
func checkState(st *trainerState, step int64, dir string) error {
	bad := func(field string, v any, want string) error {
		return fmt.Errorf("trainer: checkpoint %s: %s, object \"trainer\": %s %v: %s: %w",
			dir, filepath.Join(dir, checkpoint.ManifestFile), field, v, want, checkpoint.ErrCorrupt)
	}
	switch {
	case int64(st.Iteration) != step:
		return bad("iteration", st.Iteration, fmt.Sprintf("want %d, the checkpoint's step (a checkpoint is saved at its iteration)", step))
	case st.LoaderPos < 0:
		return bad("loader_pos", st.LoaderPos, "want a token position >= 0")
	case st.GoodSteps < 0 || st.GoodSteps >= ScaleGrowthInterval:
		return bad("good_steps", st.GoodSteps, fmt.Sprintf("want 0..%d (the loss scale grows every %d good steps)", ScaleGrowthInterval-1, ScaleGrowthInterval))
	case st.TextBytes < 0 || st.TrainTokens < 0:
		return bad("text_bytes/train_tokens", fmt.Sprint(st.TextBytes, "/", st.TrainTokens), "want sizes >= 0")
	}
	if err := new(rand.PCG).UnmarshalBinary(st.RNG); err != nil {
		return bad("rng", fmt.Sprintf("%q", st.RNG), fmt.Sprintf("want math/rand/v2's PCG state (%v)", err))
	}
	return nil
}

// VerifyCheckpoint is offload.VerifyCheckpoint and, for a dos train
// checkpoint (one holding the trainer's object), the trainer's state and
// configuration checked as --resume checks them (the iteration against
// the step, the data position, the loss scaler's count, the model's shape
// and the batch): what dos ckpt verify and recover verify with, so that a
// checkpoint they pass is one --resume takes, and one --resume refuses as
// damaged is set aside by recover.
//
// Errors: those of offload.VerifyCheckpoint; ErrCorrupt (wrapped), naming
// the manifest and the field.
func VerifyCheckpoint(c *checkpoint.Checkpoint) error {
	if err := offload.VerifyCheckpoint(c); err != nil {
		return err
	}
	if _, ok := c.Manifest.Objects["trainer"]; !ok {
		return nil // not dos train's: the Python binding's, a library's
	}
	var st trainerState
	if err := c.Object("trainer", &st); err != nil {
		if !errors.Is(err, checkpoint.ErrCorrupt) {
			// Its CRC matched: a value of the wrong type is damage too.
			err = fmt.Errorf("%w: %s: %w", checkpoint.ErrCorrupt, filepath.Join(c.Dir, checkpoint.ManifestFile), err)
		}
		return err
	}
	if err := checkState(&st, c.Manifest.Step, c.Dir); err != nil {
		return err
	}
	return CheckCheckpointConfig(st.Config, c.Dir)
}

// CheckCheckpointConfig checks the configuration c that the dos train
// checkpoint in dir records (object "trainer", config) where a resume
// takes it: the model's shape, the vocabulary, the batch and the rank
// count. It is the checkpoint's, not the flags': an invalid value is
// damage (its CRC32C matched: written so, or edited), named by its
// manifest and field, never a flag the user did not pass.
//
// Errors: ErrCorrupt (wrapped), naming dir's manifest.json and the field.
func CheckCheckpointConfig(c TrainConfig, dir string) error {
	m := c.Model
	bad := func(field string, v any, want string) error {
		return fmt.Errorf("trainer: checkpoint %s: %s, object \"trainer\": config.%s %v: %s (the checkpoint's own value, not a flag's: it is damaged, or was edited): %w",
			dir, filepath.Join(dir, checkpoint.ManifestFile), field, v, want, checkpoint.ErrCorrupt)
	}
	switch {
	case m.NLayer < 1 || m.NLayer > MaxNLayer:
		return bad("model.n_layer", m.NLayer, fmt.Sprintf("want 1..%d", MaxNLayer))
	case m.NEmbd < 1 || m.NEmbd > MaxNEmbd:
		return bad("model.n_embd", m.NEmbd, fmt.Sprintf("want 1..%d", MaxNEmbd))
	case m.NHead < 1 || m.NEmbd%m.NHead != 0:
		return bad("model.n_head", m.NHead, fmt.Sprintf("want a divisor of n_embd %d", m.NEmbd))
	case m.NCtx < 1 || m.NCtx > MaxNCtx:
		return bad("model.n_positions", m.NCtx, fmt.Sprintf("want 1..%d", MaxNCtx))
	case c.Batch < 1:
		return bad("batch", c.Batch, "want >= 1")
	case c.GPUs < 0 || c.GPUs > checkpoint.MaxWorldSize:
		return bad("gpus", c.GPUs, fmt.Sprintf("want 0..%d", checkpoint.MaxWorldSize))
	}
	if err := m.Validate(); err != nil {
		return bad("model", fmt.Sprintf("%+v", m), err.Error())
	}
	return nil
}

// shapeFlags spells the model's shape and the batch as dos train's flags.
func (c *TrainConfig) shapeFlags() string {
	m := c.Model
	tok := c.Tokenizer
	if tok == "" {
		tok = "byte"
	}
	return fmt.Sprintf("--layers %d --heads %d --embd %d --ctx %d --batch %d --tokenizer %s (vocabulary %d)", m.NLayer, m.NHead, m.NEmbd, m.NCtx, c.Batch, tok, m.VocabSize)
}

// jobRecoverHint is recoverHint for rank's checkpoint of the job under
// root: recovering the rank's root sets it aside, and the next --resume
// moves the whole job back to the newest step every rank holds
// (checkpoint.ResumeJob).
func jobRecoverHint(err error, root string, rank int) string {
	if !errors.Is(err, checkpoint.ErrCorrupt) {
		return ""
	}
	if errors.Is(err, checkpoint.ErrWrongRank) {
		return fmt.Sprintf("; put rank %d's own checkpoints back in %s (dos ckpt verify %s names what is wrong); without them the job cannot resume from this step", rank, checkpoint.RankRoot(root, rank), checkpoint.ShellQuote(root))
	}
	return fmt.Sprintf("; `dos ckpt recover %s` sets rank %d's bad checkpoint aside and moves the job to the newest step every rank holds", checkpoint.ShellQuote(root), rank)
}

// recoverHint tells the user of a damaged latest checkpoint the way out.
func recoverHint(err error, root string) string {
	if !errors.Is(err, checkpoint.ErrCorrupt) {
		return ""
	}
	return fmt.Sprintf("; `dos ckpt recover %s` sets a checkpoint that does not verify aside (kept whole) and points latest at the newest one that does, or, when none does, leaves %s without a checkpoint, for a new run", checkpoint.ShellQuote(root), root)
}
