package checkpoint

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
)

// Checkpoints of a multi-rank job (ZeRO-3 ranks). Each rank saves into a
// root of its own under the job's root, with this package's single-rank
// format and commit unchanged; the job commits a step only once every
// rank's save of it is durable, in a latest file of its own:
//
//	root/
//	├── .lock        the job's (the trainer holds it for the run)
//	├── job.json     {"format": "dos-job", "world_size": N}: written before the first commit
//	├── latest       "step-%09d\n": the newest step every rank committed (CommitJob)
//	├── rank-00000/  rank 0's root: its own .lock, latest and step directories
//	└── rank-00001/
//
// A rank whose save fails, or a crash before CommitJob, leaves the job's
// latest at the previous step although other ranks committed the new one
// in their roots; resuming reads the job's latest and rewinds each rank
// root to it (RewindRank), so that the next saves of the later steps
// replace what those ranks wrote.

// JobFile names the job root's description, written before its first
// commit: the rank count its checkpoints were cut for.
const JobFile = "job.json"

// jobFormat identifies JobFile's schema.
const jobFormat = "dos-job"

// MaxWorldSize is the most ranks a job may have: dos train's --gpus and
// dos ckpt reshard's bound, and that of a world_size read from JobFile
// (a larger one is damage: ErrCorrupt).
const MaxWorldSize = 64

// ErrWrongRank is wrapped by the errors of CheckJob, RecoverJob and the
// trainer's resume when a rank root holds another rank's checkpoints, two
// rank roots are one directory (a link), or the rank count its
// checkpoints were cut for is not JobFile's: the rank roots were copied,
// linked or moved, or JobFile was changed. The message says which and
// what to do; nothing was changed. It wraps ErrCorrupt.
var ErrWrongRank error = wrongRank{}

type wrongRank struct{}

func (wrongRank) Error() string { return "checkpoint: corrupt: rank roots not the job's" }
func (wrongRank) Unwrap() error { return ErrCorrupt }

type jobInfo struct {
	Format    string `json:"format"`
	WorldSize int    `json:"world_size"`
}

// ErrJobRoot is wrapped by the errors of the single-rank functions (Latest,
// Inspect, Save, Recover, Retain...) called on a job's root: its
// checkpoints are in its ranks' roots (RankRoot), committed by its own
// latest (JobLatest). They refuse it rather than take it for a damaged
// root and repair it.
var ErrJobRoot = errors.New("checkpoint: a multi-rank job's root")

// jobRoot returns an error wrapping ErrJobRoot when root holds job.json
// or a rank root (rank-%05d: a job whose job.json was lost), nil when it
// does not (or root is no directory), and the error of a Stat that failed
// otherwise.
func jobRoot(fsys FS, root string) error {
	path := filepath.Join(root, JobFile)
	if _, err := fsys.Stat(path); errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		if ranks, err := rankRootsIn(fsys, root); err == nil && len(ranks) > 0 {
			if holdsSteps(fsys, root) {
				return strayRankRoots(fsys, root, ranks)
			}
			if names, empty := emptyRankRoots(fsys, root, ranks); empty {
				return fmt.Errorf("%w: %s holds rank roots that hold nothing (%s: a job's run killed as it began?), and no %s: nothing was saved there; a job's run (--gpus N) starts there as it is; for one rank's, remove them first (rm -r %s)",
					ErrJobRoot, root, strings.Join(names, ", "), JobFile, strings.Join(quoteAll(names), " "))
			}
			return fmt.Errorf("%w: %s holds the rank roots of a job (%s...) but no %s (lost?): dos ckpt recover %s rewrites it from the rank roots' records",
				ErrJobRoot, root, RankRoot(root, ranks[0]), JobFile, ShellQuote(root))
		}
		return nil
	} else if err != nil {
		return fmt.Errorf("checkpoint: %s: %w", path, err)
	}
	world := "several ranks"
	if w, err := readJob(fsys, root); err == nil {
		world = Ranks(w)
	}
	return fmt.Errorf("%w: %s holds the checkpoints of a job of %s (%s): each rank's are in its own root, %s, ..., committed by %s's %s",
		ErrJobRoot, root, world, JobFile, RankRoot(root, 0), root, LatestFile)
}

// RankRoot returns the root of rank's checkpoints under the job root:
// root/rank-%05d.
func RankRoot(root string, rank int) string {
	return filepath.Join(root, fmt.Sprintf("rank-%05d", rank))
}

// JobFresh reports whether root holds nothing of a job (no job.json, no
// latest, no rank root but ones that hold only their lock files) and
// nothing of a single-rank root either: what a new job may start in. A
// missing root is fresh.
func JobFresh(fsys FS, root string) (bool, error) {
	es, err := fsys.ReadDir(root)
	if errors.Is(err, fs.ErrNotExist) {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	nrank := 0
	for _, e := range es {
		n := e.Name()
		if n == JobFile || n == LatestFile || n == pendingLatest || strings.HasPrefix(n, "step-") {
			return false, nil
		}
		if strings.HasPrefix(n, "rank-") {
			nrank++
		}
	}
	if nrank > 0 {
		ranks, err := rankRootsIn(fsys, root)
		if err != nil || len(ranks) != nrank { // a rank-* entry that is no rank root's name
			return false, err
		}
		// Rank roots that hold nothing but their lock files: what a run
		// killed as its job began leaves (BeginJob makes them before
		// job.json). Nothing was saved: fresh.
		_, empty := emptyRankRoots(fsys, root, ranks)
		return empty, nil
	}
	return true, nil
}

// CommitJob commits step for the job of world ranks under root: it checks
// that every rank root holds step's complete directory (its manifest
// written), writes job.json at the first commit (and refuses a job.json of
// another rank count), then replaces root/latest atomically (latest.tmp,
// fsync, rename, fsync root), as Save commits a single rank. The caller
// holds root's lock and has waited for every rank's save of step.
//
// Errors: a rank's directory missing or incomplete (named); a job.json of
// another world size or not a job's; the file system's. On an error the
// job's latest still names the previous step.
func CommitJob(fsys FS, root string, world int, step int64) error {
	if world < 1 || world > MaxWorldSize {
		return fmt.Errorf("checkpoint: CommitJob: world size %d: want 1..%d", world, MaxWorldSize)
	}
	for r := range world {
		if err := stepComplete(fsys, StepDir(RankRoot(root, r), step)); err != nil {
			return fmt.Errorf("checkpoint: job %s: rank %d has not committed step %d (%w)", root, r, step, err)
		}
	}
	if err := BeginJob(fsys, root, world); err != nil { // job.json, when a first commit has none
		return err
	}
	if err := moveLatest(fsys, root, []byte(stepDirName(step)+"\n")); err != nil {
		return fmt.Errorf("checkpoint: job %s: committing step %d: %w", root, step, err)
	}
	if err := fsys.SyncDir(root); err != nil {
		return fmt.Errorf("checkpoint: job %s: committing step %d: %w", root, step, err)
	}
	return nil
}

// readJob returns job.json's world size (fs.ErrNotExist when there is
// none).
func readJob(fsys FS, root string) (int, error) {
	path := filepath.Join(root, JobFile)
	if st, err := fsys.Stat(path); err == nil && !st.Mode().IsRegular() {
		// No rename replaces a directory: refused as it is, never sent
		// to recover (which rewrites only a file).
		return 0, fmt.Errorf("checkpoint: %s is a %s, not a file: move it away (dos ckpt recover %s then rewrites it from the rank roots)", path, FileKind(st.Mode()), ShellQuote(root))
	}
	b, err := readSmallFile(fsys, path, 4096)
	if err != nil {
		return 0, err
	}
	var j jobInfo
	if err := json.Unmarshal(b, &j); err != nil || j.Format != jobFormat {
		return 0, fmt.Errorf("%w: %s is not a dos job's description (%.60q)", ErrCorrupt, path, b)
	}
	if j.WorldSize < 1 || j.WorldSize > MaxWorldSize {
		return 0, fmt.Errorf("%w: %s: world_size %d: want 1..%d (the ranks dos train --gpus runs)", ErrCorrupt, path, j.WorldSize, MaxWorldSize)
	}
	return j.WorldSize, nil
}

// JobLatest returns the job's committed step and its world size.
//
// Errors: ErrNoCheckpoint (wrapped) when the job has committed nothing;
// ErrCorrupt (wrapped, naming the file) for a latest or job.json that is
// not a job's, or a latest without job.json.
func JobLatest(fsys FS, root string) (step int64, world int, err error) {
	if st, err := fsys.Stat(filepath.Join(root, LatestFile)); err == nil && !st.Mode().IsRegular() {
		return 0, 0, &notFileError{fmt.Errorf("%w: job %s: %s is a %s, not a file: move it away (dos ckpt recover %s then points the job at the newest step every rank holds)",
			ErrCorrupt, root, filepath.Join(root, LatestFile), FileKind(st.Mode()), ShellQuote(root))}
	}
	b, err := readSmallFile(fsys, filepath.Join(root, LatestFile), 4096)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, 0, fmt.Errorf("checkpoint: job %s: %w", root, ErrNoCheckpoint)
	}
	if err != nil {
		return 0, 0, err
	}
	name := strings.TrimSpace(string(b))
	step, ok := parseStepDirName(name)
	if !ok {
		return 0, 0, fmt.Errorf("%w: %s holds %.40q, not a step-%%09d directory name", ErrCorrupt, filepath.Join(root, LatestFile), name)
	}
	world, err = readJob(fsys, root)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, 0, fmt.Errorf("%w: job %s has a latest but no %s", ErrCorrupt, root, JobFile)
	}
	return step, world, err
}

// notFileError is JobLatest's error for a latest that is no file (a
// directory...): no commit can replace it, so that ResumeJob and
// RecoverJob refuse it rather than take it for a damaged latest.
type notFileError struct{ error }

func (e *notFileError) Unwrap() error { return e.error }

// BeginJob prepares root for a job of world ranks before its first save:
// it creates root and writes job.json when there is none (fsynced), so
// that a crash during the first save leaves a root ResumeJob recognizes;
// a job.json of another world size is refused.
func BeginJob(fsys FS, root string, world int) error {
	if world < 1 || world > MaxWorldSize {
		return fmt.Errorf("checkpoint: BeginJob: world size %d: want 1..%d", world, MaxWorldSize)
	}
	w, err := readJob(fsys, root)
	switch {
	case err == nil && w != world:
		return fmt.Errorf("checkpoint: job %s was cut for %s, not %d", root, Ranks(w), world)
	case err == nil:
		return nil
	case !errors.Is(err, fs.ErrNotExist):
		return err
	}
	if err := createDurably(fsys, root); err != nil {
		return fmt.Errorf("checkpoint: job %s: %w", root, err)
	}
	// Every rank root, holding its lock file, before job.json: a first
	// save cut short then leaves every rank root there, which is how a
	// resume tells it from a committed job with a rank root moved away
	// or not mounted (firstSaveCertain).
	for r := range world {
		rr := RankRoot(root, r)
		if err := createDurably(fsys, rr); err != nil {
			return fmt.Errorf("checkpoint: job %s: %w", root, err)
		}
		f, err := fsys.OpenFile(filepath.Join(rr, LockFile), os.O_WRONLY|os.O_CREATE, 0o644)
		if err != nil {
			return fmt.Errorf("checkpoint: job %s: %w", root, err)
		}
		if err := f.Close(); err != nil {
			return fmt.Errorf("checkpoint: job %s: %w", root, err)
		}
		if err := fsys.SyncDir(rr); err != nil {
			return fmt.Errorf("checkpoint: job %s: fsync: %w", root, err)
		}
	}
	return writeJob(fsys, root, world)
}

// writeJob writes job.json atomically (job.json.tmp, fsync, rename, fsync
// root): a crash leaves it whole or absent, never empty.
func writeJob(fsys FS, root string, world int) error {
	b, _ := json.Marshal(jobInfo{Format: jobFormat, WorldSize: world})
	if err := replaceFile(fsys, filepath.Join(root, JobFile+".tmp"), filepath.Join(root, JobFile), append(b, '\n')); err != nil {
		return fmt.Errorf("checkpoint: job %s: %w", root, err)
	}
	if err := fsys.SyncDir(root); err != nil {
		return fmt.Errorf("checkpoint: job %s: %w", root, err)
	}
	return nil
}

// ResumeJob finds the step a job of world ranks under root resumes from,
// and makes every rank root and the job's latest agree on it: the job's
// latest, which every rank root holds complete; without a latest (a first
// commit cut short), or with one that is damaged (it names no step, or a
// step that no rank root holds while every rank root's own latest names a
// complete step: a damaged pointer, not a missing checkpoint; or one that
// two steps or more complete in every rank root follow, which the job
// committed, since a rank runs at most one save ahead of it: an older
// latest put back), the newest step whose directory is complete in every
// rank root. Each rank root's
// latest is pointed at that step and its later directories (saves the job
// did not commit) are retired, or, when the job's latest was damaged (they
// may have been committed), set aside (damaged-unmatched-step-*, kept
// whole); the job's latest is committed at it when it named another step
// or none. It returns the step (-1 when no step is held by every rank:
// then the job never committed, and what its ranks wrote of a first save
// is retired so that it starts over) and a note saying what it changed
// ("" for nothing). The caller holds root's lock.
//
// A job latest that names a step some rank roots hold and others lack (a
// directory moved away, a disk not mounted) is refused, nothing changed:
// the rank roots that hold it keep their committed pieces of it until the
// missing ones are put back, or RecoverJob moves the job back. Where each
// rank root that lacks it set its piece aside (Rollback: it did not
// verify), the job moves back, the other ranks' pieces of the step set
// aside as well.
//
// Errors: a root that holds one rank's checkpoints (step directories, or a
// latest without job.json: a single-rank root); a job.json of another
// world size; a job latest that is no file; a job latest that a rank root
// lacks (ErrCorrupt, naming what is missing); a job latest with no step
// all ranks hold; the file system's.
func ResumeJob(fsys FS, root string, world int) (int64, string, error) {
	return resumeJob(fsys, root, world, false)
}

// resumeJob is ResumeJob; with rollback (RecoverJob's), a job latest that
// some rank roots lack moves the job back to the newest step every rank
// root holds, the other ranks' pieces of the steps after it that the job
// committed set aside (damaged-unmatched-step-*, kept whole), not deleted.
func resumeJob(fsys FS, root string, world int, rollback bool) (int64, string, error) {
	es, err := fsys.ReadDir(root)
	if errors.Is(err, fs.ErrNotExist) {
		return -1, "", nil
	}
	if err != nil {
		return 0, "", err
	}
	haveJob, haveLatest := false, false
	newest := "" // the last step entry: the newest
	for _, e := range es {
		switch n := e.Name(); {
		case strings.HasPrefix(n, "step-"):
			newest = n
		case n == JobFile:
			haveJob = true
		case n == LatestFile:
			haveLatest = true
		}
	}
	if haveJob {
		if err := strayStepEntries(root, stepEntries(fsys, root)); err != nil {
			return 0, "", err
		}
	}
	if newest != "" {
		// A single rank's root (a job's rank root, perhaps): named by
		// the checkpoint it would resume, its latest's.
		what := newest
		if b, err := readSmallFile(fsys, filepath.Join(root, LatestFile), 4096); err == nil {
			if name := strings.TrimSpace(string(b)); isStepDirName(name) {
				what = "its latest, " + name
			}
		}
		return 0, "", fmt.Errorf("checkpoint: %s holds one rank's checkpoints (%s), not a job's", root, what)
	}
	if haveLatest && !haveJob {
		return 0, "", fmt.Errorf("checkpoint: %s has a latest but no %s: one rank's root, not a job's", root, JobFile)
	}
	if haveJob {
		w, err := readJob(fsys, root)
		if err != nil {
			return 0, "", err
		}
		if w != world {
			if _, never := JobNeverCommitted(fsys, root); never {
				// Nothing was committed for its rank count: it starts over
				// with this run's, as on an empty root.
				note, err := clearFirstSave(fsys, root, w)
				return -1, note, err
			}
			return 0, "", fmt.Errorf("checkpoint: job %s was cut for %s, not %d", root, Ranks(w), world)
		}
	}
	jl, _, err := JobLatest(fsys, root)
	hasLatest := err == nil
	badLatest := ""
	var nf *notFileError
	switch {
	case errors.As(err, &nf):
		return 0, "", err
	case haveJob && haveLatest && errors.Is(err, ErrCorrupt):
		// A latest that names no step (damaged outside a commit, which
		// renames a whole file): taken as missing, as a single rank's
		// Recover takes it.
		badLatest = fmt.Sprintf("a latest that names no step (%v)", err)
	case err != nil && !errors.Is(err, ErrNoCheckpoint):
		return 0, "", err
	}
	// A rank root's latest that is no file (a directory...) no commit
	// can replace: refused before anything changes.
	for r := range world {
		p := filepath.Join(RankRoot(root, r), LatestFile)
		if st, err := fsys.Stat(p); err == nil && !st.Mode().IsRegular() {
			return 0, "", fmt.Errorf("%w: job %s: %s is a %s, not a file, which no commit replaces. Nothing was changed: move it away, then resume again (the resume points rank %d's root at the job's step)",
				ErrCorrupt, root, p, FileKind(st.Mode()), r)
		}
	}
	// The steps complete in each rank root, and in every one.
	perRank, common, err := stepsByRank(fsys, root, world)
	if err != nil {
		return 0, "", err
	}
	if !hasLatest && badLatest == "" && heldSteps(perRank) > 1 {
		// No job latest, but the ranks hold two steps or more: not a
		// first save cut short (its ranks hold at most its one step) but
		// a latest lost after the job committed. What they hold is a
		// checkpoint, never a first save's leftovers to remove.
		badLatest = fmt.Sprintf("no %s, while its rank roots hold checkpoints of %d steps (a job that committed)", LatestFile, heldSteps(perRank))
	}
	if ahead := stepsAfter(common, jl); hasLatest && (len(ahead) > 1 || rankTwoAhead(perRank, jl)) {
		// A rank runs at most one save ahead of the job (the job commits
		// a step once every rank's save of it is durable, and a save
		// that fails ends the run): steps that every rank holds past the
		// one after the job's latest were committed by the job, whose
		// latest was moved back since (an older copy of it put back).
		// Retiring them would delete committed checkpoints: the job
		// moves to the newest, as for a damaged latest.
		names := make([]string, len(ahead))
		for i, a := range ahead {
			names[i] = fmt.Sprint(a)
		}
		badLatest = fmt.Sprintf("a latest of step %d, while every rank root holds steps %s complete after it (a rank runs at most one save ahead of the job: its latest was moved back, or an older copy of it put back)", jl, strings.Join(names, ", "))
		if len(ahead) <= 1 {
			badLatest = fmt.Sprintf("a latest of step %d, while a rank root holds two steps or more complete after it (a rank runs at most one save ahead of the job: its latest was moved back, or an older copy of it put back)", jl)
		}
		hasLatest = false
	}
	if hasLatest && !common[jl] {
		var holders, lacking []string
		setAside := true // every rank that lacks it set its piece aside (Rollback: it did not verify)
		for r := range world {
			if perRank[r][jl] {
				holders = append(holders, filepath.Base(RankRoot(root, r)))
			} else {
				lacking = append(lacking, StepDir(RankRoot(root, r), jl))
				setAside = setAside && setAsideIn(fsys, RankRoot(root, r), jl, committedAt(fsys, root))
			}
		}
		switch {
		case setAside:
			// Its pieces that did not verify were set aside by dos ckpt
			// recover on their rank roots: the job moves back, the
			// other ranks' pieces set aside too.
		case len(holders) == 0 && ranksLatestSound(fsys, root, world):
			// No rank root holds it, and each one's own latest names a
			// complete step: the job's latest is a damaged pointer
			// (a flipped bit), not a checkpoint gone.
			badLatest = fmt.Sprintf("a latest that names step %d, which no rank root holds, while each rank root's own latest names a complete step (a damaged %s)", jl, filepath.Join(root, LatestFile))
			hasLatest = false
		case !rollback:
			held := "no rank root holds it"
			switch len(holders) {
			case 0:
			case 1:
				held = holders[0] + " holds it"
			default:
				held = strings.Join(holders, ", ") + " hold it"
			}
			return 0, "", fmt.Errorf("%w: job %s committed step %d, but %s (missing or incomplete; %s). Nothing was changed: put it back (a directory moved away, a disk not mounted?) and resume again; or dos ckpt recover %s moves the job back to the newest step every rank holds, setting the other ranks' pieces of the later steps aside (kept whole, not deleted)",
				ErrCorrupt, root, jl, strings.Join(lacking, ", "), held, ShellQuote(root))
		}
	}
	target := int64(-1)
	for s := range common {
		if s > target && (!hasLatest || s <= jl) {
			target = s
		}
	}
	if target < 0 {
		if hasLatest {
			return 0, "", fmt.Errorf("%w: job %s: its latest names step %d, but no step at or before it is complete in every rank root", ErrCorrupt, root, jl)
		}
		if badLatest != "" { // it committed something once: nothing is retired
			return 0, "", fmt.Errorf("%w: job %s has %s, and no step is complete in every rank root", ErrCorrupt, root, badLatest)
		}
		// Nothing was committed: what the ranks wrote of a first save is
		// not a checkpoint.
		note, err := clearFirstSave(fsys, root, world)
		return -1, note, err
	}
	// The steps after target that the job committed, or may have (its
	// latest damaged), are set aside; those after its latest retired.
	keepAbove := int64(-1)
	switch {
	case hasLatest:
		keepAbove = jl
	case badLatest != "":
		keepAbove = math.MaxInt64
	}
	var notes []string
	for r := range world {
		moved, retired, aside, err := pointRank(fsys, RankRoot(root, r), target, keepAbove)
		if err != nil {
			return 0, "", err
		}
		if len(aside) > 0 {
			notes = append(notes, fmt.Sprintf("rank %d: %s set aside (kept whole: steps after %d, the newest every rank holds, that another rank lacks)", r, strings.Join(aside, ", "), target))
		}
		if len(retired) > 0 {
			notes = append(notes, fmt.Sprintf("rank %d: %s retired (after step %d, which every rank holds; never committed for the job)", r, strings.Join(retired, ", "), target))
		} else if moved && len(aside) == 0 {
			notes = append(notes, fmt.Sprintf("rank %d's root pointed at step %d", r, target))
		}
	}
	if !hasLatest || jl != target {
		if err := CommitJob(fsys, root, world, target); err != nil {
			return 0, "", err
		}
		was := "no latest"
		switch {
		case hasLatest:
			was = fmt.Sprintf("a latest of step %d, not complete in every rank root", jl)
		case badLatest != "":
			was = badLatest
		}
		notes = append([]string{fmt.Sprintf("the job had %s: its latest is now step %d, the newest that every rank holds", was, target)}, notes...)
	}
	return target, strings.Join(notes, "; "), nil
}

// JobNeverCommitted reports whether root holds a job that never committed
// a checkpoint (a run killed before its first commit): its JobFile (world
// ranks), no latest (nor latest.tmp), and no step complete in every one
// of its rank roots 0..world-1 (a lazy first save killed after some
// ranks' pieces were durable leaves those complete, and is still no
// checkpoint: what ResumeJob takes it for), at most one step held (a
// first save writes one: heldSteps) and nothing else that says it may
// have committed (firstSaveCertain). ResumeJob and RecoverJob
// remove what it left (clearFirstSave, which keeps a rank's complete
// piece whole, FirstSaveKept), so that a new run of any rank count may
// start there.
func JobNeverCommitted(fsys FS, root string) (world int, ok bool) {
	w, err := readJob(fsys, root)
	if err != nil {
		return 0, false
	}
	for _, n := range []string{LatestFile, pendingLatest} {
		if _, err := fsys.Stat(filepath.Join(root, n)); !errors.Is(err, fs.ErrNotExist) {
			return 0, false
		}
	}
	perRank := make([]map[int64]bool, w)
	for r := range w {
		if perRank[r], err = completeSteps(fsys, RankRoot(root, r)); err != nil {
			return 0, false
		}
	}
	if heldSteps(perRank) > 1 || firstSaveCertain(fsys, root, w) != nil {
		return 0, false // it committed, or may have (ResumeJob says why)
	}
	for s := range perRank[0] {
		if !slices.ContainsFunc(perRank, func(steps map[int64]bool) bool { return !steps[s] }) {
			return 0, false // a step every rank holds: a checkpoint
		}
	}
	return w, true
}

// firstSaveCertain returns nil when root's job of world ranks, with no
// latest and no step complete in every rank root, surely never committed
// (a run killed during its first save), so that clearFirstSave deletes
// no checkpoint: every rank root 0..world-1 is a directory (BeginJob
// makes them all before the first save; one may be missing only where
// no rank root holds a complete step, and none may be there at all:
// then clearing deletes no checkpoint), no
// rank root's own latest names a step not complete in it (damage: a
// committed step lost), and a rank root that holds no complete step holds
// the lock file a run opened it with (one empty may be an unmounted
// disk; without JobFile, a crash in BeginJob before it wrote one). Otherwise it returns an error wrapping ErrCorrupt that says what
// was seen and what to do; nothing is changed.
func firstSaveCertain(fsys FS, root string, world int) error {
	var seen, missing []string
	present, held := 0, false
	// BeginJob writes JobFile after every rank root and its lock file:
	// without it, an empty rank root is a crash in BeginJob's.
	_, err := fsys.Stat(filepath.Join(root, JobFile))
	hasJob := err == nil
	for r := range world {
		rr := RankRoot(root, r)
		st, err := fsys.Stat(rr)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			missing = append(missing, rr+" is missing")
			continue
		case err != nil:
			return fmt.Errorf("checkpoint: job %s: %w", root, err)
		case !st.IsDir():
			seen = append(seen, fmt.Sprintf("%s is a %s, not a directory", rr, FileKind(st.Mode())))
			present++
			continue
		}
		present++
		steps, err := completeSteps(fsys, rr)
		if err != nil {
			return err
		}
		if b, err := readSmallFile(fsys, filepath.Join(rr, LatestFile), 4096); err == nil {
			name := strings.TrimSpace(string(b))
			if s, ok := parseStepDirName(name); !ok {
				seen = append(seen, fmt.Sprintf("%s's latest names no step (%q)", rr, name))
			} else if !steps[s] {
				seen = append(seen, fmt.Sprintf("%s's latest names %s, which it does not hold complete (a committed step lost?)", rr, name))
			}
		} else if !errors.Is(err, fs.ErrNotExist) {
			seen = append(seen, fmt.Sprintf("%s's latest cannot be read (%v)", rr, err))
		}
		held = held || len(steps) > 0
		if len(steps) == 0 && hasJob {
			if _, err := fsys.Stat(filepath.Join(rr, LockFile)); err != nil {
				seen = append(seen, rr+" holds nothing, not even the lock file a run opens it with (an unmounted disk?)")
			}
		}
	}
	if held {
		// A rank root missing beside one that holds a complete step: it
		// may hold the rest of a committed step elsewhere. (Beside none,
		// clearing deletes no checkpoint: a crash in BeginJob.)
		seen = append(missing, seen...)
	}
	if len(seen) == 0 || present == 0 {
		return nil
	}
	return fmt.Errorf("%w: job %s has no latest and no step complete in every rank root, as a run killed during its first save leaves it, but %s: it may have committed a checkpoint. Nothing was changed: put back what is missing (a rank root or step directory moved away, a disk not mounted?) and run again; if the job really never committed (a run killed during its first save), move %s and its rank roots out of %s to start over (what else it holds, first-save-* pieces kept by an earlier clearing too, stays)",
		ErrCorrupt, root, strings.Join(seen, "; "), JobFile, ShellQuote(root))
}

// firstSaveUnsure returns firstSaveCertain's error when root's job of
// world ranks is in the state a resume clears as never committed (no
// latest, no step complete in every rank root, at most one step held)
// and that is not certain; nil otherwise. RecoverJob asks it before it
// changes anything.
func firstSaveUnsure(fsys FS, root string, world int) error {
	if world < 1 {
		return nil
	}
	for _, n := range []string{LatestFile, pendingLatest} {
		if _, err := fsys.Stat(filepath.Join(root, n)); !errors.Is(err, fs.ErrNotExist) {
			return nil
		}
	}
	perRank := make([]map[int64]bool, world)
	for r := range world {
		steps, err := completeSteps(fsys, RankRoot(root, r))
		if err != nil {
			return nil // refused later, naming it
		}
		perRank[r] = steps
	}
	if heldSteps(perRank) > 1 {
		return nil
	}
	for s := range perRank[0] {
		common := true
		for r := range world {
			common = common && perRank[r][s]
		}
		if common {
			return nil
		}
	}
	return firstSaveCertain(fsys, root, world)
}

// firstSavePrefix names a rank's complete step that clearFirstSave kept
// whole beside the job (root/first-save-rank-%05d-step-%09d-<unix
// seconds>): no checkpoint of the root (a new run starts there), never
// deleted by dos.
const firstSavePrefix = "first-save-"

// FirstSaveKept returns the paths of the complete steps an earlier clearing
// of a first save kept whole in root (root/first-save-rank-NNNNN-step-*-<unix
// seconds>, sorted), for dos ckpt ls to list; none (nil) when root cannot
// be read.
func FirstSaveKept(fsys FS, root string) []string {
	var out []string
	for _, e := range entriesNamed(fsys, root, firstSavePrefix) {
		if e.IsDir() {
			out = append(out, filepath.Join(root, e.Name()))
		}
	}
	return out
}

// clearFirstSave removes what a job of world ranks that never committed
// left in root: its rank roots (retired: what they hold of a first save
// is no checkpoint), then JobFile, which names a rank count nothing was
// committed for. root then holds nothing of a job (JobFresh). It returns
// what it removed, for a note ("" for nothing). The caller holds root's
// lock and has checked that the job never committed.
func clearFirstSave(fsys FS, root string, world int) (string, error) {
	if err := firstSaveCertain(fsys, root, world); err != nil {
		return "", err
	}
	var removed, kept []string
	for r := range world {
		rr := RankRoot(root, r)
		if _, err := fsys.Stat(rr); err == nil {
			// A rank's complete step is kept whole beside the job, never
			// deleted: it is a first save's piece, or (a job whose latest
			// was lost and another rank's step with it) a committed one.
			steps, err := completeSteps(fsys, rr)
			if err != nil {
				return "", err
			}
			if len(steps) > 0 {
				// The rank root's latest goes first: cut short after it,
				// the rank root holds a complete step and no latest (cleared
				// again the same way); cut short after a move, a latest
				// would name a step no longer there, which no command then
				// takes for a first save.
				for _, n := range []string{LatestFile, pendingLatest} {
					if err := fsys.RemoveAll(filepath.Join(rr, n)); err != nil {
						return "", fmt.Errorf("checkpoint: job %s never committed a checkpoint: removing %s: %w", root, filepath.Join(rr, n), err)
					}
				}
				if err := fsys.SyncDir(rr); err != nil {
					return "", fmt.Errorf("checkpoint: job %s: fsync: %w", root, err)
				}
			}
			for _, st := range slices.Sorted(maps.Keys(steps)) {
				d := StepDir(rr, st)
				a := freshName(fsys, root, firstSavePrefix+filepath.Base(rr)+"-"+filepath.Base(d))
				if err := fsys.Rename(d, a); err != nil {
					return "", fmt.Errorf("checkpoint: job %s never committed a checkpoint: keeping %s: %w", root, d, err)
				}
				if err := fsys.SyncDir(root); err != nil {
					return "", fmt.Errorf("checkpoint: job %s: fsync: %w", root, err)
				}
				kept = append(kept, a)
			}
			if err := retire(fsys, root, rr); err != nil {
				return "", err
			}
			removed = append(removed, filepath.Base(rr))
		}
	}
	what := ""
	if len(removed) > 0 {
		what = fmt.Sprintf("what its ranks wrote of a first save (%s)", strings.Join(removed, ", "))
		if len(kept) > 0 {
			what += fmt.Sprintf(", its complete pieces kept whole as %s (remove them once you know they are not a checkpoint you need)", strings.Join(kept, ", "))
		}
	}
	jf := filepath.Join(root, JobFile)
	if _, err := fsys.Stat(jf); err == nil {
		if err := fsys.RemoveAll(jf); err != nil {
			return "", fmt.Errorf("checkpoint: job %s never committed a checkpoint: removing %s: %w", root, jf, err)
		}
		if err := fsys.RemoveAll(jf + ".tmp"); err != nil {
			return "", fmt.Errorf("checkpoint: job %s never committed a checkpoint: removing %s.tmp: %w", root, jf, err)
		}
		if err := fsys.SyncDir(root); err != nil {
			return "", fmt.Errorf("checkpoint: job %s: fsync: %w", root, err)
		}
		if what != "" {
			what += " and "
		}
		what += fmt.Sprintf("%s (a job of %s)", JobFile, Ranks(world))
	}
	if what == "" {
		return "", nil
	}
	return fmt.Sprintf("the job never committed a checkpoint (a run killed before its first commit?): removed %s", what), nil
}

// Ranks says n ranks for a message: "1 rank", "2 ranks".
func Ranks(n int) string {
	if n == 1 {
		return "1 rank"
	}
	return fmt.Sprintf("%d ranks", n)
}

// JobResumeStep returns the step a resume of the job of world ranks
// under root takes when its latest names step: step, or, when two steps
// or more complete in every rank root follow it (its latest moved back:
// a rank runs at most one save ahead of the job), the newest of them, as
// ResumeJob does. It changes nothing; a rank root that cannot be read
// counts as holding nothing.
func JobResumeStep(fsys FS, root string, world int, step int64) int64 {
	perRank, common, err := stepsByRank(fsys, root, world)
	if err != nil {
		return step
	}
	if ahead := stepsAfter(common, step); len(ahead) > 1 || (len(ahead) == 1 && rankTwoAhead(perRank, step)) {
		return ahead[len(ahead)-1]
	}
	return step
}

// stepsByRank returns the steps complete in each of the world rank roots
// under root (completeSteps) and those complete in every one.
func stepsByRank(fsys FS, root string, world int) (perRank []map[int64]bool, common map[int64]bool, err error) {
	perRank = make([]map[int64]bool, world)
	common = map[int64]bool{}
	for r := range world {
		if perRank[r], err = completeSteps(fsys, RankRoot(root, r)); err != nil {
			return nil, nil, err
		}
		if r == 0 {
			maps.Copy(common, perRank[r])
			continue
		}
		for s := range common {
			if !perRank[r][s] {
				delete(common, s)
			}
		}
	}
	return perRank, common, nil
}

// rankTwoAhead reports whether a rank root holds two steps or more
// complete after step: a rank runs at most one save ahead of the job, so
// the job's latest naming step was moved back (every rank holding both is
// the case stepsAfter sees; one rank holding both, another having lost its
// newest, is this one), and what follows it was committed: never retired.
func rankTwoAhead(perRank []map[int64]bool, step int64) bool {
	for _, steps := range perRank {
		if len(stepsAfter(steps, step)) > 1 {
			return true
		}
	}
	return false
}

// MovedBack returns, for the job of world ranks under root whose latest
// names step, the step a resume takes (JobResumeStep) and, when that is
// not step (its latest moved back), a note saying so for the read-only
// commands, which act on that step as the resume would ("" otherwise).
func MovedBack(fsys FS, root string, world int, step int64) (int64, string) {
	rs := JobResumeStep(fsys, root, world, step)
	if rs == step {
		return step, ""
	}
	return rs, fmt.Sprintf("job %s: its latest names step %d, but every rank root holds steps complete after it up to step %d (a rank runs at most one save ahead of the job: its latest was moved back, or an older copy of it put back): dos train --resume takes step %d, which this acts on; dos ckpt recover %s moves the job's latest there",
		root, step, rs, rs, ShellQuote(root))
}

// isStepDirName reports whether name is a step directory's (step-%09d).
func isStepDirName(name string) bool {
	_, ok := parseStepDirName(name)
	return ok
}

// stepsAfter returns the steps of steps after step, in order.
func stepsAfter(steps map[int64]bool, step int64) []int64 {
	var after []int64
	for s := range steps {
		if s > step {
			after = append(after, s)
		}
	}
	slices.Sort(after)
	return after
}

// lastNotes joins the last n of notes, saying how many came before.
func lastNotes(notes []string, n int) string {
	if len(notes) <= n {
		return strings.Join(notes, "; ")
	}
	return fmt.Sprintf("(%d before) ", len(notes)-n) + strings.Join(notes[len(notes)-n:], "; ")
}

// setAsideIn reports whether rankRoot holds its checkpoint of step set
// aside (damaged-step-%09d-*: Rollback's, which did not verify).
func setAsideIn(fsys FS, rankRoot string, step, since int64) bool {
	es, err := fsys.ReadDir(rankRoot)
	if err != nil {
		return false
	}
	for _, e := range es {
		rest, ok := strings.CutPrefix(e.Name(), asidePrefix+stepDirName(step)+"-")
		if !ok {
			continue
		}
		// Its name holds when it was set aside (asideName): one set aside
		// before the job committed the step (again) is an older piece's.
		secs, _, _ := strings.Cut(rest, "-")
		if t, err := strconv.ParseInt(secs, 10, 64); err == nil && t >= since {
			return true
		}
	}
	return false
}

// committedAt returns when the job under root last moved its latest (its
// modification time, in unix seconds; 0 when it cannot be read).
func committedAt(fsys FS, root string) int64 {
	st, err := fsys.Stat(filepath.Join(root, LatestFile))
	if err != nil {
		return 0
	}
	return st.ModTime().Unix()
}

// onlyLock reports whether a directory's entries es are none, or only a
// root's lock file.
func onlyLock(es []fs.DirEntry) bool {
	for _, e := range es {
		if e.Name() != LockFile {
			return false
		}
	}
	return true
}

// heldSteps counts the distinct steps complete in any rank root (perRank:
// each rank root's complete steps).
func heldSteps(perRank []map[int64]bool) int {
	held := map[int64]bool{}
	for _, steps := range perRank {
		maps.Copy(held, steps)
	}
	return len(held)
}

// jobCommitted reports whether the job under root committed a step: its
// latest names one, or its rank roots hold two steps or more (a first
// save cut short leaves at most its one step).
func jobCommitted(fsys FS, root string, world int) bool {
	if _, _, err := JobLatest(fsys, root); err == nil {
		return true
	}
	perRank := make([]map[int64]bool, world)
	for r := range world {
		perRank[r], _ = completeSteps(fsys, RankRoot(root, r))
	}
	return heldSteps(perRank) > 1
}

// ranksLatestSound reports whether every rank root of the job under root
// has a latest that names a complete step directory.
func ranksLatestSound(fsys FS, root string, world int) bool {
	for r := range world {
		if _, err := Latest(fsys, RankRoot(root, r)); err != nil {
			return false
		}
	}
	return true
}

// completeSteps returns the steps of rankRoot's complete step directories
// (stepComplete), whatever its latest says. A step entry that is a
// symbolic link is an error wrapping ErrWrongRank that names it: a job's
// rank root holds its rank's own step directories, and through a link the
// job would load, and its retention delete, what may be another run's
// (CheckJob, which reads each step's record, would not see it).
func completeSteps(fsys FS, rankRoot string) (map[int64]bool, error) {
	steps := map[int64]bool{}
	es, err := fsys.ReadDir(rankRoot)
	if errors.Is(err, fs.ErrNotExist) {
		return steps, nil
	}
	if err != nil {
		return nil, err
	}
	for _, e := range es {
		s, ok := parseStepDirName(e.Name())
		if ok && e.Type()&fs.ModeSymlink != 0 {
			return nil, linkedStepDir(fsys, rankRoot, e.Name())
		}
		if !ok || !e.IsDir() {
			continue
		}
		switch err := stepComplete(fsys, filepath.Join(rankRoot, e.Name())); {
		case err == nil:
			steps[s] = true
		case !errors.Is(err, errIncomplete):
			return nil, err
		}
	}
	return steps, nil
}

// linkedStepDir is completeSteps' error for the step entry name of
// rankRoot, a symbolic link.
func linkedStepDir(fsys FS, rankRoot, name string) error {
	p := filepath.Join(rankRoot, name)
	to := ""
	if fsys == OS {
		if t, err := os.Readlink(p); err == nil {
			to = fmt.Sprintf(" to %q", t)
		}
	}
	job := filepath.Dir(rankRoot)
	return fmt.Errorf("%w: job %s: %s is a symbolic link%s, not a step directory of %s's own: through it the job would load, and its retention delete, a checkpoint that may be another run's. Nothing was changed: put the rank's own %s (a directory) in place of the link, or remove the link (then dos ckpt recover %s moves the job to the newest step every rank holds)",
		ErrWrongRank, job, p, to, filepath.Base(rankRoot), name, ShellQuote(job))
}

// errIncomplete is wrapped by stepComplete's error for a step directory
// that is not complete: no manifest.json, or one that is no file.
var errIncomplete = errors.New("not a complete step directory")

// stepComplete returns nil when the step directory dir is complete: its
// manifest.json, which a save writes last, a regular file (Latest's test
// of the step latest names). Inspect, CommitJob, RewindRank and the job's
// steps (completeSteps) all take it, so that a step one of them counts as
// complete none takes for damaged. Errors: one wrapping errIncomplete
// that says what is wrong; an I/O error otherwise.
func stepComplete(fsys FS, dir string) error {
	m := filepath.Join(dir, ManifestFile)
	st, err := fsys.Stat(m)
	switch {
	case err == nil && st.Mode().IsRegular():
		return nil
	case err == nil:
		return fmt.Errorf("%w: %s is a %s, not a file", errIncomplete, m, FileKind(st.Mode()))
	case errors.Is(err, fs.ErrNotExist) || errors.Is(err, errNotDir):
		return fmt.Errorf("%w: %w", errIncomplete, err)
	}
	return fmt.Errorf("checkpoint: %w", err)
}

// pointRank makes step (complete) rankRoot's latest and retires its later
// step directories (saves the job did not commit: left, Retain would count
// them as committed once a later save moves latest past them); those of
// steps up to keepAbove (steps the job committed, which another rank
// lacks) are set aside whole instead (damaged-unmatched-step-*). It
// reports whether it moved latest and the directories it retired and set
// aside. It takes rankRoot's lock.
func pointRank(fsys FS, rankRoot string, step, keepAbove int64) (moved bool, retired, aside []string, err error) {
	err = writing(fsys, rankRoot, func() error {
		es, err := fsys.ReadDir(rankRoot)
		if err != nil {
			return err
		}
		// Set aside first, before latest moves below them: a crash
		// leaves them out of the step namespace, never retired.
		for _, e := range es {
			if s, ok := parseStepDirName(e.Name()); ok && s > step && s <= keepAbove {
				to := asideName(fsys, rankRoot, "unmatched-"+e.Name())
				if err := fsys.Rename(filepath.Join(rankRoot, e.Name()), to); err != nil {
					return fmt.Errorf("checkpoint: setting %s aside: %w", filepath.Join(rankRoot, e.Name()), err)
				}
				aside = append(aside, fmt.Sprintf("%s as %s", e.Name(), filepath.Base(to)))
			}
		}
		if len(aside) > 0 {
			if err := fsys.SyncDir(rankRoot); err != nil {
				return err
			}
		}
		if _, cur, err := readLatest(fsys, rankRoot); err != nil || cur != step {
			if err := moveLatest(fsys, rankRoot, []byte(stepDirName(step)+"\n")); err != nil {
				return fmt.Errorf("checkpoint: %s: pointing latest at step %d: %w", rankRoot, step, err)
			}
			if err := fsys.SyncDir(rankRoot); err != nil {
				return err
			}
			moved = true
		}
		for _, e := range es {
			if s, ok := parseStepDirName(e.Name()); ok && s > step && s > keepAbove {
				if err := retire(fsys, rankRoot, filepath.Join(rankRoot, e.Name())); err != nil {
					return err
				}
				retired = append(retired, e.Name())
			}
		}
		return nil
	})
	return moved, retired, aside, err
}

// RewindRank points rankRoot's latest at step, its directory complete, and
// retires its later step directories (ResumeJob does this for every rank).
// It takes rankRoot's lock.
//
// Errors: step's directory missing or incomplete; the lock's and the file
// system's.
func RewindRank(fsys FS, rankRoot string, step int64) error {
	if err := stepComplete(fsys, StepDir(rankRoot, step)); err != nil {
		return fmt.Errorf("checkpoint: %s: step %d: %w", rankRoot, step, err)
	}
	_, _, _, err := pointRank(fsys, rankRoot, step, -1)
	return err
}

// RecoverJob repairs a job's root for a resume. First it checks the rank
// roots' identities (CheckJob, with identify): a rank root that is a
// link, holds another rank's or another run's checkpoints, or two that
// are one directory, or ranks' checkpoints of one step that disagree, are
// refused, nothing changed; a JobFile that disagrees with what every rank
// root records (its world size edited, damaged, or missing: a job is
// recognized by its rank roots too) is rewritten from them. A job latest
// that is no file (a directory) is refused, nothing changed. Then it
// rolls back every rank root whose latest checkpoint does not open or
// verify (Rollback, with verify: the bad checkpoint set aside, the rank
// root pointed at its newest one that verifies), and moves the job to the
// newest step every rank holds (ResumeJob, except that a committed step
// some rank roots lack moves the job back: the other ranks' pieces of the
// steps after the one all hold, up to the job's latest, are set aside
// whole as damaged-unmatched-step-*, not deleted; the saves the job never
// committed are retired). It returns that step (-1 when the job never
// committed one) and what it changed, one note per change ("" for
// nothing). It never creates a rank root: one missing stays missing. It
// holds root's lock.
//
// A rank root missing from a job that committed a step is refused
// (ErrCorrupt, naming it), nothing changed: it may only be elsewhere.
// When no step is left that every rank holds (a rank's checkpoints all
// fail to verify), the job cannot resume: its
// files (rank roots, JobFile, latest) are moved, whole, into
// root/damaged-job-<unix seconds>, so that root holds nothing of a job
// and a new one may start there; the error wraps ErrNoneLeft and says so.
//
// Errors: a root with neither JobFile nor a rank root (not a job's root,
// named); CheckJob's; a job latest that is no file; ErrNoneLeft
// (wrapped), as above; those of Rollback, ResumeJob, Lock and the file
// system.
func RecoverJob(fsys FS, root string, verify func(*Checkpoint) error, identify Identify) (int64, string, error) {
	if !IsJob(fsys, root) {
		return 0, "", fmt.Errorf("checkpoint: %s is not a job's root (no %s, no rank root): %w", root, JobFile, fs.ErrNotExist)
	}
	lock, err := Lock(fsys, root)
	if err != nil {
		return 0, "", err
	}
	defer lock.Unlock()
	if partialJobAside(fsys, root) != "" {
		// A recover killed while it set the job's files aside (no step
		// was left that every rank holds): finished, as it decided.
		aside, err := setJobAside(fsys, root)
		if err != nil {
			return 0, "", fmt.Errorf("checkpoint: job %s: finishing an interrupted setting aside of its files: %w", root, err)
		}
		return 0, "", fmt.Errorf("checkpoint: %w: job %s: an interrupted dos ckpt recover was setting the job's files aside (no step was left that every rank holds): finished; they are, whole, in %s. %s holds no checkpoint now: a new run may start there (dos train --ckpt-dir %s --gpus N, without --resume)",
			ErrNoneLeft, root, aside, root, ShellQuote(root))
	}
	var notes []string
	world, fix, err := checkJob(fsys, root, identify)
	switch {
	case fix > 0:
		was := "said " + Ranks(world)
		if _, err := fsys.Stat(filepath.Join(root, JobFile)); errors.Is(err, fs.ErrNotExist) {
			was = "was missing"
		} else if world == 0 {
			was = "was damaged"
		}
		if err := writeJob(fsys, root, fix); err != nil {
			return 0, "", err
		}
		notes = append(notes, fmt.Sprintf("%s %s, but the checkpoints of its %d rank roots record a job of %s: rewritten for %d", JobFile, was, fix, Ranks(fix), fix))
		world = fix
	case err != nil:
		return 0, "", err
	}
	// A latest that is no file (a directory...) no commit can replace:
	// refused, nothing changed.
	var nf *notFileError
	if _, _, err := JobLatest(fsys, root); errors.As(err, &nf) {
		return 0, "", err
	}
	// A job that looks never committed (no latest, no step every rank
	// holds) but may have (a rank root missing, or a rank's latest naming
	// a step it lacks) is refused before anything changes: recover would
	// otherwise clear it, or set it aside, as a first save cut short.
	if err := firstSaveUnsure(fsys, root, world); err != nil {
		return 0, "", err
	}
	// A rank root missing from a job that committed a step is not damage
	// recover can mend (a disk not mounted, a directory moved away): it is
	// refused, nothing moved, so that the job resumes once it is back.
	if jobCommitted(fsys, root, world) {
		var missing []string
		for r := range world {
			rr := RankRoot(root, r)
			if _, err := fsys.Stat(rr); errors.Is(err, fs.ErrNotExist) {
				missing = append(missing, rr)
			} else if es, err := fsys.ReadDir(rr); err == nil && onlyLock(es) {
				missing = append(missing, rr+" (empty: an unmounted disk?)")
			}
		}
		if len(missing) > 0 {
			return 0, "", fmt.Errorf("%w: job %s of %s committed a step, but its rank roots %s are missing: nothing was changed; "+
				"put them back (a disk not mounted, a directory moved?) and run dos ckpt recover %s again, or start a new job in another --ckpt-dir",
				ErrCorrupt, root, Ranks(world), strings.Join(missing, ", "), ShellQuote(root))
		}
	}
	// Rounds: each rank root rolled back to its newest checkpoint that
	// verifies, then the job moved to the newest step every rank holds,
	// whose pieces (each rank root's latest now) the next round verifies,
	// until a round repairs nothing: the step the job is left at verifies
	// in every rank.
	// Each round that changes something sets a step directory aside or
	// moves the job back past one: the step directories the rank roots
	// hold bound the rounds. A round past that bound is a defect (two of
	// the steps' tests disagreeing): an error, never a success.
	rounds := 2
	for r := range world {
		if es, err := fsys.ReadDir(RankRoot(root, r)); err == nil {
			for _, e := range es {
				if _, ok := parseStepDirName(e.Name()); ok {
					rounds++
				}
			}
		}
	}
	var why string
	for round := 0; ; round++ {
		if round > rounds {
			return 0, "", fmt.Errorf("checkpoint: job %s: dos ckpt recover did not settle after %d rounds (each round should set a step aside or move the job back; the last changes: %s): the job was left as it is now; dos ckpt ls %s says what its rank roots hold",
				root, round, lastNotes(notes, 4), ShellQuote(root))
		}
		var lost []string // the ranks with no checkpoint that verifies
		repaired := false
		for r := range world {
			rr := RankRoot(root, r)
			if _, err := fsys.Stat(rr); errors.Is(err, fs.ErrNotExist) {
				continue // never created here: ResumeJob says what it lacks
			}
			rec, err := Rollback(fsys, rr, 0, verify)
			switch {
			case errors.Is(err, ErrNoneLeft):
				var nl *noneLeftError
				if errors.As(err, &nl) {
					lost = append(lost, fmt.Sprintf("rank %d: %s: %s", r, rr, nl.what))
				} else {
					lost = append(lost, fmt.Sprintf("rank %d: %v", r, err))
				}
				continue
			case errors.Is(err, ErrNoCheckpoint):
				continue // nothing committed in this rank root yet
			case err != nil:
				return 0, "", fmt.Errorf("checkpoint: job %s, rank %d: %w", root, r, err)
			}
			if rec.Repaired {
				repaired = true
				notes = append(notes, fmt.Sprintf("rank %d: %s", r, rec.Note))
			}
		}
		why = strings.Join(lost, "; ")
		if len(lost) > 0 {
			break
		}
		step, note, err := resumeJob(fsys, root, world, true)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				return 0, "", err
			}
			why = err.Error()
			break
		}
		if note != "" {
			notes = append(notes, note)
		}
		// A round that repaired nothing and moved nothing leaves the job
		// as it verified.
		if !repaired && note == "" {
			return step, strings.Join(notes, "; "), nil
		}
	}
	// No step every rank holds: the job cannot resume. Its files go
	// aside, whole, for a new job to start in root.
	aside, err := setJobAside(fsys, root)
	if err != nil {
		return 0, "", fmt.Errorf("checkpoint: job %s has no step every rank holds (%s); setting its files aside: %w", root, why, err)
	}
	notes = append(notes, why)
	return 0, "", fmt.Errorf("checkpoint: %w: job %s: no step is left that every rank holds (%s): the job's files (its rank roots, %s, %s) were moved, whole, into %s. %s holds no checkpoint now: a new run may start there (dos train --ckpt-dir %s --gpus N, without --resume)",
		ErrNoneLeft, root, strings.Join(notes, "; "), JobFile, LatestFile, aside, root, ShellQuote(root))
}
