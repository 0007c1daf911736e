package checkpoint

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Identify says which rank of a job's ranks the checkpoint c holds the
// pieces of, and what identifies its run, from what its writer recorded
// beside them (dos train's rank record and trainer state:
// trainer.JobRank). An error says that the record is damaged or
// disagrees with the rest of c.
type Identify func(c *Checkpoint) (RankID, error)

// RankID is what a job's checkpoint records of its place in the job
// (Identify).
type RankID struct {
	// Rank and Ranks: the checkpoint holds rank Rank's pieces of a job
	// of Ranks ranks; Ranks 0 when it records none (a single rank's
	// checkpoint, or an older one: not checked).
	Rank, Ranks int
	// Run identifies the run that wrote it: the same in every checkpoint
	// of one job, kept across its resumes and reshards. "" when it
	// records none (an older checkpoint): not compared.
	Run string
	// Agree holds, by a name for messages (such as `object "trainer"` or
	// "the optimizer's step"), what every rank's checkpoint of one step
	// holds alike when they are one job's pieces of it; the values are
	// compared as strings, and a name that one checkpoint lacks is not
	// compared.
	Agree map[string]string
}

// rankRootsIn returns the ranks whose roots (rank-%05d, exactly so
// spelled) root holds, in order.
func rankRootsIn(fsys FS, root string) ([]int, error) {
	es, err := fsys.ReadDir(root)
	if err != nil {
		return nil, fmt.Errorf("checkpoint: job %s: %w", root, err)
	}
	var ranks []int
	for _, e := range es {
		digits, ok := strings.CutPrefix(e.Name(), "rank-")
		if !ok {
			continue
		}
		if r, err := strconv.Atoi(digits); err == nil && r >= 0 && filepath.Base(RankRoot(root, r)) == e.Name() {
			ranks = append(ranks, r)
		}
	}
	slices.Sort(ranks)
	return ranks, nil
}

// rankRecord is what one rank root's step directory records of its rank.
type rankRecord struct {
	dir         string
	root        int // the rank whose root holds it
	step        int64
	rank, ranks int
	run         string
	agree       map[string]string
}

// CheckJob checks, without changing anything, that the rank roots under
// the job root root are the job's: each a directory of its own in root (no
// symbolic link, which could make the job write, and its retention delete,
// another job's checkpoints; no two the same directory through a bind
// mount), every complete step directory of rank root r recording
// (identify) rank r of the world size that JobFile gives, all of them one
// run's (RankID.Run), and the ranks' checkpoints of each step agreeing on
// what one job's pieces of a step hold alike (RankID.Agree: the trainer's
// state, the optimizer's step and hyperparameters). It opens each step
// directory's manifest, not its tensor data; a step directory that does
// not open is left to Verify and RecoverJob.
//
// Errors: an error wrapping ErrWrongRank and ErrCorrupt that names the rank
// root and what to do: a rank root that is a link, another rank's
// checkpoints in a rank root (a copy), two rank roots that are one
// directory, rank roots of different runs, ranks' checkpoints of one step
// that disagree, or a JobFile whose world size (or whole content, or its
// absence) disagrees with what every rank root records (then RecoverJob
// rewrites JobFile, and the message says so); JobFile's errors when it is
// missing or damaged and the rank roots do not say what it held; the file
// system's.
func CheckJob(fsys FS, root string, identify Identify) error {
	_, _, err := checkJob(fsys, root, identify)
	return err
}

// IsJob reports whether root holds a job's checkpoints: its JobFile, or a
// rank root (rank-%05d: a directory, a link or anything so named), which
// a single rank's root never holds, or the directory an interrupted
// RecoverJob was setting a job's files aside into (RecoverJob finishes
// it). A job whose JobFile was lost is a job's root still (CheckJob and
// RecoverJob say so and rewrite it).
func IsJob(fsys FS, root string) bool {
	if _, err := fsys.Stat(filepath.Join(root, JobFile)); err == nil {
		return true
	}
	if partialJobAside(fsys, root) != "" { // a job's files half set aside
		return true
	}
	ranks, err := rankRootsIn(fsys, root)
	if err != nil || len(ranks) == 0 || holdsSteps(fsys, root) {
		return false
	}
	_, empty := emptyRankRoots(fsys, root, ranks) // a run killed as its job began: nothing of a job yet
	return !empty
}

// holdsSteps reports whether root holds a step directory's name
// (step-%09d), which a job's root never does: a single rank's root.
func holdsSteps(fsys FS, root string) bool {
	es, err := fsys.ReadDir(root)
	if err != nil {
		return false
	}
	for _, e := range es {
		if _, ok := parseStepDirName(e.Name()); ok {
			return true
		}
	}
	return false
}

// stepEntries returns the names of root's entries named step-*: in a
// job's root (its checkpoints are in its rank roots) each is stray.
func stepEntries(fsys FS, root string) []string {
	var names []string
	for _, e := range entriesNamed(fsys, root, "step-") {
		names = append(names, e.Name())
	}
	return names
}

// entriesNamed returns root's entries whose names begin with prefix, sorted
// by name (FS.ReadDir's order); none when root cannot be read.
func entriesNamed(fsys FS, root, prefix string) []os.DirEntry {
	es, err := fsys.ReadDir(root)
	if err != nil {
		return nil
	}
	var out []os.DirEntry
	for _, e := range es {
		if strings.HasPrefix(e.Name(), prefix) {
			out = append(out, e)
		}
	}
	return out
}

// strayStepEntries returns the error of the job root root (it holds
// JobFile) that holds the step-* entries names, nil for none: a job's
// checkpoints are in its rank roots, and such an entry (a note, an empty
// or copied step directory) would have root taken for a single rank's.
func strayStepEntries(root string, names []string) error {
	if len(names) == 0 {
		return nil
	}
	paths := make([]string, len(names))
	for i, n := range names {
		paths[i] = filepath.Join(root, n)
	}
	return fmt.Errorf("%w: job %s holds %s, named as a step directory, which a job's root never holds (its checkpoints are in its rank roots, rank-NNNNN). Nothing was changed: move %s out of %s, then run again",
		ErrCorrupt, root, strings.Join(paths, ", "), strings.Join(names, ", "), root)
}

// strayRankRoots returns the error of root, without JobFile, that holds
// step directories (a single rank's root) and the rank roots (rank-%05d)
// ranks, which a single rank's root never holds: one was made there by
// hand, or by a run or reshard into ROOT/rank-%05d before InSingleRoot
// refused it. It says to remove an empty one and to move one that holds
// files out.
func strayRankRoots(fsys FS, root string, ranks []int) error {
	var what []string
	for _, r := range ranks {
		rr := RankRoot(root, r)
		if es, err := fsys.ReadDir(rr); err == nil && onlyLock(es) {
			what = append(what, fmt.Sprintf("remove %s (it is empty)", rr))
		} else {
			what = append(what, fmt.Sprintf("move %s out of %s (it holds files: perhaps another run's checkpoints)", rr, root))
		}
	}
	return fmt.Errorf("checkpoint: %s holds a single rank's checkpoints (step directories, no %s) and %s, named as a job's rank root, which a single rank's root never holds: %s, then %s opens again",
		root, JobFile, filepath.Base(RankRoot(root, ranks[0])), strings.Join(what, "; "), root)
}

// InSingleRoot returns the single rank's root that dir is, or would be
// created, inside as a rank root: dir, or a directory above it, named
// rank-%05d in a directory that holds step directories and no JobFile.
// A run or a reshard writing there would make that root look like a
// job's whose job.json was lost, and it would no longer open: the
// commands refuse such a destination (RankSlot refuses a slot of a job).
func InSingleRoot(fsys FS, dir string) (string, bool) {
	if _, ok := fsys.(osFS); ok {
		if r, err := filepath.EvalSymlinks(dir); err == nil {
			dir = r
		}
		if a, err := filepath.Abs(dir); err == nil {
			dir = a
		}
	}
	for d := filepath.Clean(dir); filepath.Dir(d) != d; d = filepath.Dir(d) {
		base, parent := filepath.Base(d), filepath.Dir(d)
		digits, ok := strings.CutPrefix(base, "rank-")
		if !ok {
			continue
		}
		if r, err := strconv.Atoi(digits); err != nil || r < 0 || filepath.Base(RankRoot(parent, r)) != base {
			continue
		}
		if _, err := fsys.Stat(filepath.Join(parent, JobFile)); err != nil && holdsSteps(fsys, parent) {
			return parent, true
		}
	}
	return "", false
}

// linkedRankRoot returns an error wrapping ErrWrongRank when one of
// root's rank roots is a symbolic link (root's own entry, not what it
// names), nil otherwise.
func linkedRankRoot(fsys FS, root string) error {
	es, err := fsys.ReadDir(root)
	if err != nil {
		return fmt.Errorf("checkpoint: job %s: %w", root, err)
	}
	for _, e := range es {
		if e.Type()&fs.ModeSymlink == 0 {
			continue
		}
		digits, ok := strings.CutPrefix(e.Name(), "rank-")
		if !ok {
			continue
		}
		r, err := strconv.Atoi(digits)
		if err != nil || r < 0 || filepath.Base(RankRoot(root, r)) != e.Name() {
			continue
		}
		rr := RankRoot(root, r)
		to := ""
		if fsys == OS {
			if t, err := os.Readlink(rr); err == nil {
				to = fmt.Sprintf(" to %q", t)
			}
		}
		return fmt.Errorf("%w: job %s: %s is a symbolic link%s, not a directory of the job's own: through it the job would write, and its retention delete, checkpoints that may be another job's. Nothing was changed: put rank %d's own root (a directory) at %s in place of the link; without it the job cannot resume (start afresh with another --ckpt-dir)",
			ErrWrongRank, root, rr, to, r, rr)
	}
	return nil
}

// checkJob is CheckJob; it also returns JobFile's world size (0 when it
// is unreadable or missing) and, when JobFile disagrees with the rank
// roots (or is missing) while they agree with each other, the world size
// they record (fix > 0: what RecoverJob writes).
func checkJob(fsys FS, root string, identify Identify) (world, fix int, err error) {
	jw, jerr := readJob(fsys, root)
	if jerr != nil && !errors.Is(jerr, ErrCorrupt) && !errors.Is(jerr, fs.ErrNotExist) {
		return 0, 0, jerr
	}
	if err := linkedRankRoot(fsys, root); err != nil {
		return 0, 0, err
	}
	if _, err := fsys.Stat(filepath.Join(root, JobFile)); err == nil {
		if err := strayStepEntries(root, stepEntries(fsys, root)); err != nil {
			return 0, 0, err
		}
	}
	present, err := rankRootsIn(fsys, root)
	if err != nil {
		return 0, 0, err
	}
	// Each rank root a directory of its own.
	type seen struct {
		r  int
		st os.FileInfo
	}
	var dirs []seen
	for _, r := range present {
		rr := RankRoot(root, r)
		st, err := fsys.Stat(rr)
		if err != nil {
			return 0, 0, fmt.Errorf("checkpoint: job %s: %w", root, err)
		}
		if !st.IsDir() {
			return 0, 0, fmt.Errorf("%w: job %s: %s is a %s, not a rank's root (a directory): move it away", ErrCorrupt, root, rr, FileKind(st.Mode()))
		}
		for _, d := range dirs {
			if os.SameFile(d.st, st) {
				return 0, 0, fmt.Errorf("%w: job %s: %s and %s are one directory (a link, or a bind mount): each rank's checkpoints need a root of their own. Nothing was changed: put rank %d's own root back at %s; without it the job cannot resume (start afresh with another --ckpt-dir)",
					ErrWrongRank, root, RankRoot(root, d.r), rr, r, rr)
			}
		}
		dirs = append(dirs, seen{r, st})
	}
	// What each rank root's checkpoints record.
	var recs []rankRecord
	for _, d := range dirs {
		rr := RankRoot(root, d.r)
		steps, err := completeSteps(fsys, rr)
		if err != nil {
			return 0, 0, err
		}
		for _, s := range slices.Sorted(maps.Keys(steps)) {
			dir := StepDir(rr, s)
			c, err := Open(fsys, dir, 0)
			if err != nil {
				continue // damage: Verify's and RecoverJob's to report
			}
			id, err := identify(c)
			c.Close()
			if err != nil {
				return 0, 0, fmt.Errorf("checkpoint: job %s: %w", root, err)
			}
			recs = append(recs, rankRecord{dir: dir, root: d.r, step: s, rank: id.Rank, ranks: id.Ranks, run: id.Run, agree: id.Agree})
		}
	}
	if err := sameRun(root, recs); err != nil {
		return 0, 0, err
	}
	// The world size the rank roots agree on, if they do: every record
	// says rank r of W in rank root r, and the rank roots are 0..W-1.
	agreed := 0
	for _, rc := range recs {
		if rc.ranks == 0 {
			continue
		}
		if agreed == 0 {
			agreed = rc.ranks
		}
		if rc.ranks != agreed || rc.rank != rc.root {
			agreed = -1
			break
		}
	}
	if agreed > 0 && (agreed > MaxWorldSize || len(dirs) != agreed || len(present) != agreed || present[len(present)-1] != agreed-1) {
		agreed = 0
	}
	agreed = max(agreed, 0)
	jobFile := filepath.Join(root, JobFile)
	if agreed > 0 && (jerr != nil || jw != agreed) {
		what := fmt.Sprintf("%s says %s", jobFile, Ranks(jw))
		switch {
		case errors.Is(jerr, fs.ErrNotExist):
			what = fmt.Sprintf("%s is missing", jobFile)
		case jerr != nil:
			what = fmt.Sprintf("%s is damaged (%v)", jobFile, jerr)
		}
		return jw, agreed, fmt.Errorf("%w: job %s: %s, but its %d rank roots (%s ... %s) hold the pieces of a job of %s (each checkpoint records its rank): %s was changed, replaced or removed; dos ckpt recover %s rewrites it for %d ranks",
			ErrWrongRank, root, what, agreed, filepath.Base(RankRoot(root, 0)), filepath.Base(RankRoot(root, agreed-1)), Ranks(agreed), JobFile, ShellQuote(root), agreed)
	}
	if errors.Is(jerr, fs.ErrNotExist) {
		if len(present) == 0 {
			return 0, 0, fmt.Errorf("checkpoint: %s is not a job's root (no %s, no rank root): %w", root, JobFile, jerr)
		}
		if names, empty := emptyRankRoots(fsys, root, present); empty {
			// What a run killed as its job began leaves (BeginJob makes
			// the rank roots, each with its lock file, before job.json).
			return 0, 0, fmt.Errorf("%w: %s holds no %s and rank roots that hold nothing (%s: a run killed as its job began?): nothing was saved there, and nothing was changed; remove them (rm -r %s) to start a run there",
				ErrCorrupt, root, JobFile, strings.Join(names, ", "), strings.Join(quoteAll(names), " "))
		}
		return 0, 0, fmt.Errorf("%w: job %s: %s is missing, and its rank roots' checkpoints do not say the job's rank count (an older dos, or rank roots missing): nothing was changed; put %s back",
			ErrCorrupt, root, jobFile, JobFile)
	}
	if jerr != nil {
		return 0, 0, jerr
	}
	for _, rc := range recs {
		if rc.ranks == 0 || rc.rank == rc.root && rc.ranks == jw {
			continue
		}
		rr := RankRoot(root, rc.root)
		all := true // every checkpoint of this rank root is another's
		for _, o := range recs {
			if o.root == rc.root && o.rank == rc.root && o.ranks == jw {
				all = false
			}
		}
		what := fmt.Sprintf("job %s (of %s, by its %s): %s holds rank %d's pieces of a job of %s, not rank %d's of %d", root, Ranks(jw), JobFile, rc.dir, rc.rank, Ranks(rc.ranks), rc.root, jw)
		if rc.root >= jw {
			// A rank root beyond the job's ranks (a copy, another job's):
			// it has no place in the job.
			return jw, 0, fmt.Errorf("%w: job %s has %s (%s ... %s, by its %s), and %s is not one of them (it holds rank %d's pieces of a job of %s). Nothing was changed: move %s out of the job's root",
				ErrWrongRank, root, Ranks(jw), filepath.Base(RankRoot(root, 0)), filepath.Base(RankRoot(root, jw-1)), JobFile, rr, rc.rank, Ranks(rc.ranks), rr)
		}
		if all {
			return jw, 0, fmt.Errorf("%w: %s: %s is a copy of another rank's root, or was moved? Nothing was changed: put rank %d's own checkpoints back in %s; without them the job cannot resume (start afresh with another --ckpt-dir)",
				ErrWrongRank, what, rr, rc.root, rr)
		}
		return jw, 0, fmt.Errorf("%w: %s: it is not rank %d's. Nothing was changed: move it out of the job's root, then dos ckpt recover %s moves the job to the newest step every rank holds",
			ErrWrongRank, what, rc.root, ShellQuote(root))
	}
	if err := stepsAgree(root, recs); err != nil {
		return jw, 0, err
	}
	return jw, 0, nil
}

// sameRun returns an error wrapping ErrWrongRank when the records recs
// (of the job root root) name more than one run.
func sameRun(root string, recs []rankRecord) error {
	runs := map[string][]int{} // run -> the rank roots that hold its checkpoints
	for _, rc := range recs {
		if rc.run != "" && !slices.Contains(runs[rc.run], rc.root) {
			runs[rc.run] = append(runs[rc.run], rc.root)
		}
	}
	if len(runs) < 2 {
		return nil
	}
	var parts []string
	for _, run := range slices.Sorted(maps.Keys(runs)) {
		var names []string
		for _, r := range runs[run] {
			names = append(names, filepath.Base(RankRoot(root, r)))
		}
		parts = append(parts, fmt.Sprintf("run %s in %s", run, strings.Join(names, ", ")))
	}
	return fmt.Errorf("%w: job %s: its rank roots hold the checkpoints of different runs (%s): rank roots of two runs were put together (copied or restored from another job?). Nothing was changed: put each rank's own root back; the job cannot resume from a mix (start afresh with another --ckpt-dir)",
		ErrWrongRank, root, strings.Join(parts, "; "))
}

// stepsAgree returns an error wrapping ErrWrongRank when two ranks'
// checkpoints of one step (records recs, of the job root root) disagree
// on something of RankID.Agree.
func stepsAgree(root string, recs []rankRecord) error {
	first := map[int64]rankRecord{} // per step, the lowest rank's record
	for _, rc := range recs {
		f, ok := first[rc.step]
		if !ok {
			first[rc.step] = rc
			continue
		}
		for _, k := range slices.Sorted(maps.Keys(rc.agree)) {
			v, ok := f.agree[k]
			if !ok || v == rc.agree[k] {
				continue
			}
			va, vb := differing(v, rc.agree[k])
			return fmt.Errorf("%w: job %s: the ranks' checkpoints of step %d disagree on %s: %s holds %s, %s holds %s. One job's ranks write one state at a step: these are not one job's pieces (copied from another run, or edited). Nothing was changed: put the rank's own checkpoint of step %d back, or move the step's directories out of the rank roots and run dos ckpt recover %s, which moves the job to the newest step every rank holds",
				ErrWrongRank, root, rc.step, k, f.dir, va, rc.dir, vb, rc.step, ShellQuote(root))
		}
	}
	return nil
}

// differing returns a and b, two JSON texts that differ, cut to where
// they do: from a little before their first differing byte, at most 120
// bytes each, "..." marking what was cut (both cut at one length of 120
// hid a difference beyond it).
func differing(a, b string) (string, string) {
	i := 0
	for i < len(a) && i < len(b) && a[i] == b[i] {
		i++
	}
	lo := max(i-40, 0)
	cut := func(s string) string {
		hi := min(lo+120, len(s))
		out := s[lo:hi]
		if lo > 0 {
			out = "..." + out
		}
		if hi < len(s) {
			out += "..."
		}
		return out
	}
	return cut(a), cut(b)
}

// ErrNoneLeft is wrapped by the errors of Rollback and RecoverJob when no
// checkpoint of the root (of the job) verifies: each was set aside whole,
// out of the step namespace (root/damaged-*, kept, never loaded or
// removed by dos), and the latest that named one was removed, so that the
// root holds no checkpoint: a new run may start there (dos train without
// --resume). It wraps ErrNoCheckpoint.
var ErrNoneLeft error = noneLeft{}

type noneLeft struct{}

func (noneLeft) Error() string { return "no checkpoint left" }
func (noneLeft) Unwrap() error { return ErrNoCheckpoint }

// Aside returns the entries of root that Rollback and RecoverJob set aside
// (damaged-*: checkpoints that did not verify, a job's files), in order;
// none for a root that does not exist.
func Aside(fsys FS, root string) []string {
	var out []string
	for _, e := range entriesNamed(fsys, root, asidePrefix) {
		out = append(out, filepath.Join(root, e.Name()))
	}
	return out
}

// asideName returns a free name in root for name set aside now:
// damaged-NAME-<unix seconds>[-k].
func asideName(fsys FS, root, name string) string {
	return freshName(fsys, root, asidePrefix+name)
}

// freshName returns root/NAME-<unix seconds>, or with -2, -3... after it,
// the first that Stat does not find.
func freshName(fsys FS, root, name string) string {
	base := filepath.Join(root, fmt.Sprintf("%s-%d", name, time.Now().Unix()))
	p := base
	for k := 2; ; k++ {
		// Taken only when Stat finds it: another error (EIO, EACCES) is
		// the rename's to report, never a reason to try the next name
		// (this looped for ever on a failing disk).
		if _, err := fsys.Stat(p); err != nil {
			return p
		}
		p = fmt.Sprintf("%s-%d", base, k)
	}
}

// setAside renames each of dirs (step directories of root) aside, whole,
// as root/damaged-NAME-<unix seconds> (asideName), then fsyncs root once;
// it returns the new paths of those it moved.
func setAside(fsys FS, root string, dirs []string) ([]string, error) {
	var to []string
	for _, d := range dirs {
		a := asideName(fsys, root, filepath.Base(d))
		if err := fsys.Rename(d, a); err != nil {
			return to, fmt.Errorf("checkpoint: setting %s aside: %w", d, err)
		}
		to = append(to, a)
	}
	if len(to) > 0 {
		if err := fsys.SyncDir(root); err != nil {
			return to, fmt.Errorf("checkpoint: %s: fsync: %w", root, err)
		}
	}
	return to, nil
}

// setAsideAll sets every step directory of root (complete or not) aside
// as root/damaged-step-%09d-<unix seconds>, then removes latest and
// latest.tmp (they named one of them): root then holds no checkpoint.
// Renames first, root fsynced, then the removals, root fsynced: a crash
// leaves a latest naming a missing step, which Rollback takes up again.
// It returns the names given. The caller holds root's lock and its write.
func setAsideAll(fsys FS, root string) ([]string, error) {
	es, err := fsys.ReadDir(root)
	if err != nil {
		return nil, fmt.Errorf("checkpoint: %s: %w", root, err)
	}
	var dirs []string
	for _, e := range es {
		if _, ok := parseStepDirName(e.Name()); ok {
			dirs = append(dirs, filepath.Join(root, e.Name()))
		}
	}
	to, err := setAside(fsys, root, dirs)
	var moved []string
	for _, t := range to {
		moved = append(moved, filepath.Base(t))
	}
	if err != nil {
		return moved, err
	}
	for _, n := range []string{LatestFile, pendingLatest} {
		if err := fsys.RemoveAll(filepath.Join(root, n)); err != nil {
			return moved, fmt.Errorf("checkpoint: %s: removing %s, which named a checkpoint set aside: %w", root, n, err)
		}
	}
	if err := fsys.SyncDir(root); err != nil {
		return moved, fmt.Errorf("checkpoint: %s: fsync: %w", root, err)
	}
	return moved, nil
}

// setJobAside moves the job's files (its rank roots, then job.json, its
// latest last) into root/damaged-job-<unix seconds>, whole: root then
// holds nothing of a job (JobFresh). The rank roots go first: a crash
// leaves a job latest without the rank roots, which RecoverJob takes up
// again, never a job.json without a latest beside rank roots, which
// ResumeJob would take for a first save never committed. The caller holds
// root's lock.
func setJobAside(fsys FS, root string) (string, error) {
	// The files move into a directory named partial first, renamed to its
	// final name once all are in: a dos ckpt recover killed meanwhile
	// leaves that name, and the next one finishes the move into it.
	partial := partialJobAside(fsys, root)
	if partial == "" {
		partial = asideName(fsys, root, "job") + partialSuffix
		if err := createDurably(fsys, partial); err != nil {
			return "", fmt.Errorf("checkpoint: job %s: %w", root, err)
		}
	}
	ranks, err := rankRootsIn(fsys, root)
	if err != nil {
		return "", err
	}
	var names []string
	for _, r := range ranks {
		names = append(names, filepath.Base(RankRoot(root, r)))
	}
	names = append(names, JobFile, JobFile+".tmp", pendingLatest, LatestFile)
	for _, n := range names {
		from := filepath.Join(root, n)
		if _, err := fsys.Stat(from); errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err := fsys.Rename(from, filepath.Join(partial, n)); err != nil {
			return "", fmt.Errorf("checkpoint: job %s: setting %s aside: %w", root, from, err)
		}
		if err := fsys.SyncDir(root); err != nil {
			return "", fmt.Errorf("checkpoint: job %s: fsync: %w", root, err)
		}
	}
	if err := fsys.SyncDir(partial); err != nil {
		return "", fmt.Errorf("checkpoint: job %s: fsync: %w", root, err)
	}
	aside := strings.TrimSuffix(partial, partialSuffix)
	if _, err := fsys.Stat(aside); err == nil {
		aside = asideName(fsys, root, "job")
	}
	if err := fsys.Rename(partial, aside); err != nil {
		return "", fmt.Errorf("checkpoint: job %s: naming %s: %w", root, partial, err)
	}
	if err := fsys.SyncDir(root); err != nil {
		return "", fmt.Errorf("checkpoint: job %s: fsync: %w", root, err)
	}
	return aside, nil
}

// partialSuffix ends the name of the directory a job's files are being
// set aside into (setJobAside), until all are in.
const partialSuffix = ".partial"

// InterruptedSetAside returns the directory of root into which a dos ckpt
// recover (RecoverJob) cut short was setting a job's files aside ("" when
// there is none): a new run must not start in root before RecoverJob has
// finished it, since it would finish it over the new run's files.
func InterruptedSetAside(fsys FS, root string) string { return partialJobAside(fsys, root) }

// partialJobAside returns the directory of root an interrupted
// setJobAside was moving the job's files into ("" when there is none).
func partialJobAside(fsys FS, root string) string {
	es, err := fsys.ReadDir(root)
	if err != nil {
		return ""
	}
	for _, e := range es {
		if n := e.Name(); e.IsDir() && strings.HasPrefix(n, asidePrefix+"job-") && strings.HasSuffix(n, partialSuffix) {
			return filepath.Join(root, n)
		}
	}
	return ""
}

// RankSlot returns the job root whose rank root dir would be (dir named
// rank-%05d, absent or empty, inside a directory holding a job: its
// JobFile, or another rank root), and whether it is one. A run or a
// reshard writing there would put another run's checkpoints among the
// job's ranks, which CheckJob then refuses: the commands refuse such a
// destination first. (A rank root that holds checkpoints is the job's
// own: the trainer's rank checks name it.)
func RankSlot(fsys FS, dir string) (string, bool) {
	// What dir names, links resolved (a link to a slot is the slot), and
	// each directory above it (a root inside an absent slot creates it).
	if _, ok := fsys.(osFS); ok {
		if r, err := filepath.EvalSymlinks(dir); err == nil {
			dir = r
		}
		if a, err := filepath.Abs(dir); err == nil {
			dir = a
		}
	}
	for d := filepath.Clean(dir); ; d = filepath.Dir(d) {
		if job, ok := rankSlot(fsys, d); ok {
			return job, true
		}
		if filepath.Dir(d) == d {
			return "", false
		}
	}
}

// rankSlot is RankSlot for dir itself.
func rankSlot(fsys FS, dir string) (string, bool) {
	clean := filepath.Clean(dir)
	base, parent := filepath.Base(clean), filepath.Dir(clean)
	digits, ok := strings.CutPrefix(base, "rank-")
	if !ok {
		return "", false
	}
	r, err := strconv.Atoi(digits)
	if err != nil || r < 0 || filepath.Base(RankRoot(parent, r)) != base {
		return "", false
	}
	if es, err := fsys.ReadDir(dir); err == nil && len(es) > 0 {
		return "", false
	}
	if _, err := fsys.Stat(filepath.Join(parent, JobFile)); err == nil {
		return parent, true
	}
	ranks, err := rankRootsIn(fsys, parent)
	if err != nil {
		return "", false
	}
	for _, o := range ranks {
		if o != r {
			return parent, true
		}
	}
	return "", false
}

// emptyRankRoots returns the rank roots of root among present (ranks) and
// whether every one holds nothing but its lock file.
func emptyRankRoots(fsys FS, root string, present []int) ([]string, bool) {
	var names []string
	for _, r := range present {
		rr := RankRoot(root, r)
		es, err := fsys.ReadDir(rr)
		if err != nil {
			return nil, false
		}
		for _, e := range es {
			if e.Name() != LockFile {
				return nil, false
			}
		}
		names = append(names, rr)
	}
	return names, len(names) > 0
}

// quoteAll is ShellQuote of each of names.
func quoteAll(names []string) []string {
	q := make([]string, len(names))
	for i, n := range names {
		q[i] = ShellQuote(n)
	}
	return q
}
