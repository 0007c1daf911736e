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
// pieces of, from what its writer recorded beside them (dos train's rank
// record: trainer.JobRank): ranks 0 when c records nothing (a single
// rank's checkpoint, or an older one: not checked). An error says that
// the record is damaged or disagrees with the rest of c.
type Identify func(c *Checkpoint) (rank, ranks int, err error)

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
	rank, ranks int
}

// CheckJob checks, without changing anything, that the rank roots under
// the job root root are the job's: each a directory of its own (no two
// the same directory through a link or a bind mount), every complete step
// directory of rank root r recording (identify) rank r of the world size
// that JobFile gives. It opens each step directory's manifest, not its
// tensor data; a step directory that does not open is left to Verify and
// RecoverJob.
//
// Errors: an error wrapping ErrWrongRank and ErrCorrupt that names the rank
// root and what to do: another rank's checkpoints in a rank root (a copy),
// two rank roots that are one directory, or a JobFile whose world size
// (or whole content) disagrees with what every rank root records (then
// RecoverJob rewrites JobFile, and the message says so); JobFile's errors
// when it is missing or damaged and the rank roots do not say what it
// held; the file system's.
func CheckJob(fsys FS, root string, identify Identify) error {
	_, _, err := checkJob(fsys, root, identify)
	return err
}

// checkJob is CheckJob; it also returns JobFile's world size (0 when it
// is unreadable) and, when JobFile disagrees with the rank roots while
// they agree with each other, the world size they record (fix > 0: what
// RecoverJob writes).
func checkJob(fsys FS, root string, identify Identify) (world, fix int, err error) {
	jw, jerr := readJob(fsys, root)
	if jerr != nil && !errors.Is(jerr, ErrCorrupt) {
		return 0, 0, jerr
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
		if errors.Is(err, fs.ErrNotExist) {
			// A dangling link: no rank root, as if absent.
			continue
		}
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
			rank, ranks, err := identify(c)
			c.Close()
			if err != nil {
				return 0, 0, fmt.Errorf("checkpoint: job %s: %w", root, err)
			}
			if ranks > 0 {
				recs = append(recs, rankRecord{dir: dir, root: d.r, rank: rank, ranks: ranks})
			}
		}
	}
	// The world size the rank roots agree on, if they do: every record
	// says rank r of W in rank root r, and the rank roots are 0..W-1.
	agreed := 0
	if len(recs) > 0 {
		agreed = recs[0].ranks
		for _, rc := range recs {
			if rc.ranks != agreed || rc.rank != rc.root {
				agreed = 0
				break
			}
		}
		if agreed > 0 && (agreed > MaxWorldSize || len(dirs) != agreed || len(present) != agreed || present[len(present)-1] != agreed-1) {
			agreed = 0
		}
	}
	jobFile := filepath.Join(root, JobFile)
	if agreed > 0 && (jerr != nil || jw != agreed) {
		what := fmt.Sprintf("%s says %d ranks", jobFile, jw)
		if jerr != nil {
			what = fmt.Sprintf("%s is damaged (%v)", jobFile, jerr)
		}
		return jw, agreed, fmt.Errorf("%w: job %s: %s, but its %d rank roots (%s ... %s) hold the pieces of a job of %d ranks (each checkpoint records its rank): %s was changed or replaced; dos ckpt recover %s rewrites it for %d ranks",
			ErrWrongRank, root, what, agreed, filepath.Base(RankRoot(root, 0)), filepath.Base(RankRoot(root, agreed-1)), agreed, JobFile, root, agreed)
	}
	if jerr != nil {
		return 0, 0, jerr
	}
	for _, rc := range recs {
		if rc.rank == rc.root && rc.ranks == jw {
			continue
		}
		rr := RankRoot(root, rc.root)
		all := true // every checkpoint of this rank root is another's
		for _, o := range recs {
			if o.root == rc.root && o.rank == rc.root && o.ranks == jw {
				all = false
			}
		}
		what := fmt.Sprintf("job %s (of %d ranks, by its %s): %s holds rank %d's pieces of a job of %d ranks, not rank %d's of %d", root, jw, JobFile, rc.dir, rc.rank, rc.ranks, rc.root, jw)
		if all {
			return jw, 0, fmt.Errorf("%w: %s: %s is a copy of another rank's root, or was moved? Nothing was changed: put rank %d's own checkpoints back in %s; without them the job cannot resume (start afresh with another --ckpt-dir)",
				ErrWrongRank, what, rr, rc.root, rr)
		}
		return jw, 0, fmt.Errorf("%w: %s: it is not rank %d's. Nothing was changed: move it out of the job's root, then dos ckpt recover %s moves the job to the newest step every rank holds",
			ErrWrongRank, what, rc.root, root)
	}
	return jw, 0, nil
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
	es, err := fsys.ReadDir(root)
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range es {
		if strings.HasPrefix(e.Name(), asidePrefix) {
			out = append(out, filepath.Join(root, e.Name()))
		}
	}
	return out
}

// asideName returns a free name in root for name set aside now:
// damaged-NAME-<unix seconds>[-k].
func asideName(fsys FS, root, name string) string {
	base := filepath.Join(root, fmt.Sprintf("%s%s-%d", asidePrefix, name, time.Now().Unix()))
	p := base
	for k := 2; ; k++ {
		if _, err := fsys.Stat(p); errors.Is(err, fs.ErrNotExist) {
			return p
		}
		p = fmt.Sprintf("%s-%d", base, k)
	}
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
	var moved []string
	for _, e := range es {
		if _, ok := parseStepDirName(e.Name()); !ok {
			continue
		}
		to := asideName(fsys, root, e.Name())
		if err := fsys.Rename(filepath.Join(root, e.Name()), to); err != nil {
			return moved, fmt.Errorf("checkpoint: setting %s aside: %w", filepath.Join(root, e.Name()), err)
		}
		moved = append(moved, filepath.Base(to))
	}
	if err := fsys.SyncDir(root); err != nil {
		return moved, fmt.Errorf("checkpoint: %s: fsync: %w", root, err)
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
	aside := asideName(fsys, root, "job")
	if err := createDurably(fsys, aside); err != nil {
		return "", fmt.Errorf("checkpoint: job %s: %w", root, err)
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
		if err := fsys.Rename(from, filepath.Join(aside, n)); err != nil {
			return "", fmt.Errorf("checkpoint: job %s: setting %s aside: %w", root, from, err)
		}
		if err := fsys.SyncDir(root); err != nil {
			return "", fmt.Errorf("checkpoint: job %s: fsync: %w", root, err)
		}
	}
	if err := fsys.SyncDir(aside); err != nil {
		return "", fmt.Errorf("checkpoint: job %s: fsync: %w", root, err)
	}
	if err := fsys.SyncDir(root); err != nil {
		return "", fmt.Errorf("checkpoint: job %s: fsync: %w", root, err)
	}
	return aside, nil
}
