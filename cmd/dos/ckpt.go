package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
	"unicode"

	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/trainer"
)

const ckptUsage = `Usage:
  dos ckpt ls ROOT               list the committed checkpoints under ROOT, newest first (* marks latest),
                                 then what is not committed (leftovers of crashes) and any damage; for
                                 a job's root (dos train --gpus), its committed step and each rank's
  dos ckpt verify [--rank N] PATH
                                 open the checkpoint at PATH (a step directory, or a root's latest),
                                 check that manifest, index and file agree, every tensor's CRC32C,
                                 that the optimizer state is finite (exp_avg_sq >= 0) and its settings
                                 valid; for a job's root, its committed step in every rank's root
  dos ckpt recover [--rank N] ROOT
                                 repair ROOT for --resume: finish a commit a crash cut short, point a
                                 missing or corrupt latest at the newest checkpoint that verifies, or set
                                 aside (as ROOT/damaged-step-*) a latest checkpoint that does not verify, and the newer ones that do not
                                 (none verifies: all set aside, latest removed, a new run may start);
                                 for a job's root, each rank root checked to be its rank's, every rank's
                                 root, then the job moved to the newest step every rank holds
  dos ckpt inspect [--rank N] [--tensors] PATH
                                 describe the checkpoint at PATH without reading tensor data: step,
                                 files and sizes, tensors by dtype, the optimizer's hyperparameters,
                                 the trainer's configuration; --tensors lists every tensor
  dos ckpt reshard --gpus N SRC DST
                                 write SRC's latest checkpoint (a job of ranks, or a run without --gpus) into
                                 the empty DST cut for N ranks (1: whole tensors), for dos train --resume
                                 --ckpt-dir DST --gpus N; SRC is not changed
Exit status: 0 on success, 1 when a checkpoint is missing or corrupt (recover: when none is left after it set the damaged ones aside), 2 on a usage error.
`

// ckptSubcommands are dos ckpt's subcommands: the synopsis and what each
// does, for its -h.
var ckptSubcommands = map[string]struct{ synopsis, about string }{
	"ls": {"dos ckpt ls ROOT", "Lists the committed checkpoints under ROOT, newest first (* marks latest), then what is not\n" +
		"committed (leftovers of crashes, steps set aside by recover or kept as first-save-rank-* when a job that\n" +
		"never committed was cleared) and any damage. For a job's root (dos train --gpus): its committed\n" +
		"step, then each rank root's listing."},
	"verify": {"dos ckpt verify [--rank N] PATH", "Opens the checkpoint at PATH (a step directory, or a root's latest), checks that manifest,\n" +
		"index and file agree, every tensor's CRC32C, that the optimizer state is finite (exp_avg_sq >= 0)\n" +
		"and its settings valid. For a job's root (dos train --gpus): its committed step in every rank's root."},
	"recover": {"dos ckpt recover [--rank N] ROOT", "Repairs ROOT for --resume: finishes a commit a crash cut short, points a missing or corrupt\n" +
		"latest at the newest checkpoint that verifies, or sets aside (as ROOT/damaged-step-*) a latest\n" +
		"checkpoint that does not verify; when none verifies, sets them all aside and removes latest: no checkpoint\n" +
		"is left, and a new run may start there (dos train without --resume). For a job's root (dos train --gpus):\n" +
		"each rank root checked to hold its own rank's checkpoints (a copy or link of another's is refused,\n" +
		"nothing changed; a job.json its ranks' records contradict is rewritten), every rank's root so, then the\n" +
		"job's latest and every rank root moved to the newest step all ranks hold (what --resume would take);\n" +
		"when there is none, the job's files are set aside whole, as ROOT/damaged-job-*."},
	"reshard": {"dos ckpt reshard --gpus N SRC DST", "Writes SRC's latest checkpoint (a job of ranks from dos train --gpus, or a run's root without --gpus) into\n" +
		"DST, which must be empty (a link to an empty directory: written into its target), cut for N ranks (1: whole tensors, as dos train without --gpus saves them):\n" +
		"each tensor's master weights and moments joined from SRC's pieces and cut again, the step count,\n" +
		"hyperparameters and the trainer's state kept. Then dos train --resume --ckpt-dir DST --gpus N\n" +
		"continues the run on N ranks. SRC is not changed (a trainer may go on writing it); DST is committed,\n" +
		"its latest moved in last, only once every rank is written."},
	"inspect": {"dos ckpt inspect [--rank N] [--tensors] PATH", "Describes the checkpoint at PATH without reading tensor data: step, files and sizes, tensors by\n" +
		"dtype, the optimizer's hyperparameters, the trainer's configuration; --tensors lists every tensor.\n" +
		"For a job's root (dos train --gpus): rank N's committed step, N from --rank."},
}

func runCkpt(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, ckptUsage)
		return 2
	}
	sub := args[0]
	switch sub {
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, ckptUsage)
		return 0
	}
	info, ok := ckptSubcommands[sub]
	if !ok {
		fmt.Fprintf(stderr, "dos ckpt: unknown subcommand %q\n%s", sub, ckptUsage)
		return 2
	}
	exit := "\nExit status: 0 on success, 1 when a checkpoint is missing or corrupt, 2 on a usage error."
	if sub == "recover" {
		exit = "\nExit status: 0 on success, 1 when no checkpoint is left after it set the damaged ones aside (or it cannot tell what to do, nothing changed), 2 on a usage error."
	}
	c := newCLI("dos ckpt "+sub, info.synopsis, info.about+exit)
	rank := 0
	all := false
	gpus := 0
	if sub == "reshard" {
		c.IntVar(&gpus, "gpus", 0, fmt.Sprintf("the `N` ranks to cut the checkpoint for (1..%d; 1: whole tensors)", checkpoint.MaxWorldSize))
	} else if sub != "ls" {
		c.IntVar(&rank, "rank", 0, "the rank `N` whose files to "+sub+" (default 0: the first)")
	}
	if sub == "inspect" {
		c.BoolVar(&all, "tensors", false, "list every tensor (name, dtype, shape, bytes, offset) and print the objects whole")
	}
	pos, rc, ok := c.parse(args[1:], stdout, stderr)
	if !ok {
		return rc
	}
	if sub == "reshard" {
		if len(pos) != 2 {
			return c.usageError(stderr, "want SRC and DST, got %d arguments", len(pos))
		}
		if !c.set("gpus") {
			return c.usageError(stderr, "--gpus N is required: the number of ranks to cut the checkpoint for (1: whole tensors)")
		}
		if gpus < 1 || gpus > checkpoint.MaxWorldSize {
			return c.usageError(stderr, "--gpus %d: want the ranks to cut for, 1..%d", gpus, checkpoint.MaxWorldSize)
		}
		if _, err := trainer.Reshard(pos[0], pos[1], gpus, stdout); err != nil {
			return c.fail(stderr, "%v", err)
		}
		return 0
	}
	if len(pos) != 1 {
		return c.usageError(stderr, "want one directory, got %d arguments", len(pos))
	}
	if rank < 0 {
		return c.usageError(stderr, "--rank %d: want a rank >= 0", rank)
	}
	path := pos[0]
	if strings.ContainsFunc(path, unicode.IsControl) && sub != "recover" {
		// Its listing prints paths raw: a newline or an escape code in
		// one would print lines that are not there.
		return c.usageError(stderr, "the path %q holds control characters (a newline, a tab or an escape code), which %s would print raw into its output; rename it (or reach it through a symbolic link without them)", path, sub)
	}
	if _, err := os.Stat(path); err != nil {
		return c.fail(stderr, "%v", err)
	}
	if tmp := trainer.ReshardMovesLeft(path); tmp != "" && sub != "recover" {
		fmt.Fprintf(stderr, "dos ckpt %s: %s holds part of the checkpoint a dos ckpt reshard was moving into it when it was killed; the rest is in %s: dos ckpt recover %s (or dos train --resume) finishes the moves; nothing was changed\n",
			sub, path, tmp, checkpoint.ShellQuote(path))
		return 1
	}
	if w, ok := checkpoint.JobNeverCommitted(checkpoint.OS, path); ok && (sub == "verify" || sub == "inspect") {
		fmt.Fprintf(stderr, "dos ckpt %s: %s\n", sub, neverCommittedNote(path, w))
		return 1
	}
	switch sub {
	case "ls":
		return ckptList(path, stdout, stderr)
	case "inspect":
		return ckptInspect(path, rank, c.set("rank"), all, stdout, stderr)
	case "recover":
		return ckptRecover(path, rank, stdout, stderr)
	}
	return ckptVerify(path, rank, c.set("rank"), stdout, stderr)
}

// neverCommittedNote says that the job root of world ranks never
// committed a checkpoint (checkpoint.JobNeverCommitted) and what to do.
func neverCommittedNote(root string, world int) string {
	return fmt.Sprintf("job %s of %s never committed a checkpoint (%s, no latest, no step complete in every rank root: a run killed before its first commit?): dos ckpt recover %s removes what it left (a rank's complete piece kept whole), for a new run",
		root, checkpoint.Ranks(world), checkpoint.JobFile, checkpoint.ShellQuote(root))
}

// dirExists reports whether path names a directory (through links).
func dirExists(path string) bool {
	st, err := os.Stat(path)
	return err == nil && st.IsDir()
}

// jobList is dos ckpt ls for a job's root (dos train --gpus): its
// committed step, then each rank root's listing (a rank's step after the
// job's, committed in its root but not for the job, listed once, as
// such), then the job root's own leftovers. A rank root that is a
// symbolic link is named, not listed (CheckJob says why).
func jobList(root string, stdout, stderr io.Writer) int {
	rc := 0
	cerr := checkpoint.CheckJob(checkpoint.OS, root, trainer.JobRank)
	if cerr != nil {
		fmt.Fprintf(stderr, "dos ckpt ls: %v\n", cerr)
		rc = 1
	}
	// Rank roots that are not the job's (job.json edited, a rank root a
	// copy of another): cerr says what to do, and no rank is "missing".
	wrongRanks := errors.Is(cerr, checkpoint.ErrWrongRank)
	step, world, err := checkpoint.JobLatest(checkpoint.OS, root)
	if errors.Is(err, checkpoint.ErrNoCheckpoint) {
		// No job latest: a first save cut short, or a latest lost. What
		// the rank roots hold is listed, and the repair named.
		held := false
		if ranks, rerr := filepath.Glob(filepath.Join(root, "rank-*")); rerr == nil {
			for _, rr := range ranks {
				if dirs, lerr := checkpoint.List(checkpoint.OS, rr); lerr == nil && len(dirs) > 0 {
					held = true
				}
			}
			if held {
				fmt.Fprintf(stderr, "dos ckpt ls: job %s has no %s, but its rank roots hold checkpoints (listed below): dos ckpt recover %s points it at the newest step every rank holds (or says why none can be)\n",
					root, checkpoint.LatestFile, checkpoint.ShellQuote(root))
				for _, rr := range ranks {
					fmt.Fprintf(stdout, "%s\n", rr)
					listRoot(rr, -1, stdout, stderr)
				}
				return 1
			}
		}
		if w, ok := checkpoint.JobNeverCommitted(checkpoint.OS, root); ok {
			fmt.Fprintf(stderr, "dos ckpt ls: %s\n", neverCommittedNote(root, w))
			for r := range w {
				// What the first save left: a rank's piece may be complete.
				// (A rank root without latest is what a first save leaves,
				// not damage of its own: no listRoot, which would say so.)
				rr := checkpoint.RankRoot(root, r)
				if !dirExists(rr) {
					continue
				}
				fmt.Fprintf(stdout, "%s\n", rr)
				info, _ := checkpoint.Inspect(checkpoint.OS, rr)
				for _, s := range info.Steps {
					what := "incomplete: a save cut short"
					if s.Complete {
						what = "complete, a rank's piece of a first save that never committed: no checkpoint"
					}
					fmt.Fprintf(stdout, "  %s  (%s)\n", s.Dir, what)
				}
			}
			return 1
		}
	}
	if err != nil {
		fmt.Fprintf(stderr, "dos ckpt ls: %v\n", err)
		return 1
	}
	if rs, note := checkpoint.MovedBack(checkpoint.OS, root, world, step); note != "" {
		fmt.Fprintf(stderr, "dos ckpt ls: %s\n", note)
		step, rc = rs, 1
	}
	fmt.Fprintf(stdout, "job %s: %s, latest step %d (committed once every rank's save of it was durable)\n", root, checkpoint.Ranks(world), step)
	for r := range world {
		rr := checkpoint.RankRoot(root, r)
		if st, err := os.Lstat(rr); err == nil && st.Mode()&fs.ModeSymlink != 0 {
			fmt.Fprintf(stdout, "rank %d: %s  (a symbolic link, not the job's own directory: not listed)\n", r, rr)
			rc = 1
			continue
		}
		if _, err := os.Lstat(rr); err != nil && wrongRanks {
			continue // job.json names ranks its rank roots are not: cerr said what to do
		}
		fmt.Fprintf(stdout, "rank %d: %s\n", r, rr)
		if _, err := os.Stat(filepath.Join(checkpoint.StepDir(rr, step), checkpoint.ManifestFile)); err != nil && !wrongRanks {
			fmt.Fprintf(stderr, "dos ckpt ls: job %s: rank %d lacks the job's latest step %d (%v): the job cannot resume from it; put it back, or dos ckpt recover %s moves the job to an older step every rank holds, if there is one (setting the other ranks' pieces of step %d aside, kept whole)\n", root, r, step, err, checkpoint.ShellQuote(root), step)
			rc = 1
		}
		if _, err := os.Stat(rr); err != nil {
			continue
		}
		if c := listRoot(rr, step, stdout, stderr); c != 0 {
			rc = c
		}
	}
	holder := checkpoint.Holder(checkpoint.OS, root)
	if es, err := os.ReadDir(root); err == nil {
		moved := false // root holds more than leftovers: a reshard killed during its moves?
		for _, e := range es {
			if n := e.Name(); n != checkpoint.LockFile && !strings.HasPrefix(n, ".tmp-") {
				moved = true
			}
		}
		for _, e := range es {
			if strings.HasPrefix(e.Name(), ".tmp-") {
				note := leftoverNote(e.Name(), holder)
				if moved && holder == "" && strings.HasPrefix(e.Name(), trainer.ReshardTmp) {
					note = "leftover of a dos ckpt reshard killed while it moved its checkpoint into this root: what it holds is part of it; dos ckpt recover or dos train --resume finishes the moves"
				}
				fmt.Fprintf(stdout, "  %s  (%s)\n", filepath.Join(root, e.Name()), note)
			}
		}
	}
	for _, a := range checkpoint.Aside(checkpoint.OS, root) {
		fmt.Fprintf(stdout, "  %s  (set aside by dos ckpt recover: kept whole, never loaded or removed by dos)\n", a)
	}
	listFirstSaveKept(root, stdout)
	return rc
}

// listFirstSaveKept lists the rank steps an earlier clearing of a job's
// first save kept whole in root (checkpoint.FirstSaveKept).
func listFirstSaveKept(root string, stdout io.Writer) {
	for _, k := range checkpoint.FirstSaveKept(checkpoint.OS, root) {
		fmt.Fprintf(stdout, "  %s  (a rank's complete step kept whole when a job that never committed was cleared for a new run: no checkpoint of this root, never loaded or removed by dos)\n", k)
	}
}

// leftoverNote says what the temporary entry name (.tmp-*) of a root is
// and what removes it; holder is the root's holder ("" for none).
func leftoverNote(name, holder string) string {
	switch {
	case holder != "":
		return "temporary: a save or reshard in progress, or a leftover"
	case strings.HasPrefix(name, trainer.ReshardTmp):
		return "leftover of a dos ckpt reshard killed before it committed: run that reshard again (it removes it), or a dos train here without --resume removes it and starts afresh"
	}
	return "leftover of a crashed save or retirement; the next save (or dos train start) removes it"
}

// ckptInspect prints what a checkpoint holds, from its manifest and
// header only (Open checks that they agree; no tensor data is read).
func ckptInspect(path string, rank int, rankSet, all bool, stdout, stderr io.Writer) int {
	if step, world, err := checkpoint.JobLatest(checkpoint.OS, path); err == nil {
		// A job's root: --rank picks the rank whose committed step to
		// describe (its file is rank 0's of its own root).
		if err := checkpoint.CheckJob(checkpoint.OS, path, trainer.JobRank); errors.Is(err, checkpoint.ErrWrongRank) {
			fmt.Fprintf(stderr, "dos ckpt inspect: %v\n", err)
			return 1
		}
		if rank >= world {
			fmt.Fprintf(stderr, "dos ckpt inspect: --rank %d: job %s has %s (0..%d)\n", rank, path, checkpoint.Ranks(world), world-1)
			return 2
		}
		if rs, note := checkpoint.MovedBack(checkpoint.OS, path, world, step); note != "" {
			fmt.Fprintf(stderr, "dos ckpt inspect: %s\n", note)
			step = rs
		}
		fmt.Fprintf(stdout, "job %s: %s, latest step %d; rank %d's pieces:\n", path, checkpoint.Ranks(world), step, rank)
		path, rank = checkpoint.StepDir(checkpoint.RankRoot(path, rank), step), 0
	} else if r, n, ok := jobRankAt(path); ok {
		// One rank's root of a job, or a step of it: its file is rank
		// 0's of its own root; --rank, if given, must be its rank.
		if rankSet && rank != r {
			fmt.Fprintf(stderr, "dos ckpt inspect: --rank %d: %s holds rank %d's pieces of a job of %s, not rank %d's (its file is its rank root's own: --rank is not needed)\n", rank, path, r, checkpoint.Ranks(n), rank)
			return 1
		}
		rank = 0
	}
	c, err := checkpoint.OpenPath(checkpoint.OS, path, rank)
	if err != nil {
		fmt.Fprintf(stderr, "dos ckpt inspect: %v\n", err)
		return 1
	}
	dir := c.Dir
	defer c.Close()
	if err := linkedRankStep(dir); err != nil {
		fmt.Fprintf(stderr, "dos ckpt inspect: %v\n", err)
		return 1
	}
	m := c.Manifest
	fmt.Fprintf(stdout, "%s\n  step %d, %s, created %s, %s v%d\n", dir, m.Step, whichRank(c),
		m.Created.Format(time.RFC3339), m.Format, m.Version)
	for _, f := range m.Files {
		size := "?"
		if st, err := os.Stat(filepath.Join(dir, f)); err == nil {
			size = fmt.Sprintf("%d bytes", st.Size())
		}
		fmt.Fprintf(stdout, "  file %s: %s\n", f, size)
	}
	type agg struct {
		n     int
		bytes int64
	}
	byDType := map[string]*agg{}
	var total int64
	for _, t := range m.Tensors {
		a := byDType[string(t.DType)]
		if a == nil {
			a = &agg{}
			byDType[string(t.DType)] = a
		}
		a.n++
		a.bytes += t.Bytes
		total += t.Bytes
	}
	fmt.Fprintf(stdout, "  %d tensors, %d bytes", len(m.Tensors), total)
	for _, d := range slices.Sorted(maps.Keys(byDType)) {
		fmt.Fprintf(stdout, "; %s: %d tensors, %d bytes", d, byDType[d].n, byDType[d].bytes)
	}
	fmt.Fprintln(stdout)
	for _, name := range slices.Sorted(maps.Keys(m.Objects)) {
		var v any
		if err := c.Object(name, &v); err != nil {
			fmt.Fprintf(stderr, "dos ckpt inspect: %v\n", err)
			return 1
		}
		b, _ := json.Marshal(v)
		if len(b) > 600 && !all {
			b = append(b[:600], []byte(" ... (truncated; --tensors prints it whole)")...)
		}
		fmt.Fprintf(stdout, "  object %q: %s\n", name, b)
	}
	n := len(m.Tensors)
	if !all {
		n = min(n, 12)
	}
	fmt.Fprintf(stdout, "  tensors (name, dtype, shape, bytes, offset):\n")
	for _, t := range m.Tensors[:n] {
		fmt.Fprintf(stdout, "    %-40s %-4s %-16s %12d %12d\n", t.Name, t.DType, fmt.Sprint(t.Shape), t.Bytes, t.Offset)
	}
	if n < len(m.Tensors) {
		fmt.Fprintf(stdout, "    ... %d more (--tensors lists them all)\n", len(m.Tensors)-n)
	}
	return 0
}

// ckptList lists what root holds: the committed checkpoints, newest first
// (* marks latest), then what is not committed (a complete step directory
// above latest, an incomplete one, the leftovers of crashed saves and
// retirements), and why the root is damaged if it is (exit 1 then).
func ckptList(root string, stdout, stderr io.Writer) int {
	if _, err := os.Stat(filepath.Join(root, checkpoint.ManifestFile)); err == nil {
		fmt.Fprintf(stderr, "dos ckpt ls: %s is a checkpoint (a step directory), not a checkpoint root: dos ckpt ls %s lists its root; dos ckpt verify or inspect %s reads it\n",
			root, checkpoint.ShellQuote(filepath.Dir(filepath.Clean(root))), checkpoint.ShellQuote(root))
		return 2
	}
	if checkpoint.IsJob(checkpoint.OS, root) {
		return jobList(root, stdout, stderr)
	}
	return listRoot(root, -1, stdout, stderr)
}

// listRoot is ckptList for one root; for a job's rank root, jobStep is
// the job's committed step (-1 otherwise): the rank's steps after it are
// not committed for the job.
func listRoot(root string, jobStep int64, stdout, stderr io.Writer) int {
	info, err := checkpoint.Inspect(checkpoint.OS, root)
	if errors.Is(err, checkpoint.ErrJobRoot) && jobStep < 0 {
		return jobList(root, stdout, stderr)
	}
	if err != nil {
		fmt.Fprintf(stderr, "dos ckpt ls: %v\n", err)
		return 1
	}
	holder := checkpoint.Holder(checkpoint.OS, root)
	if holder != "" {
		fmt.Fprintf(stdout, "in use by %s: a save may be in progress\n", holder)
	}
	committed := 0
	forJob := func(s checkpoint.StepInfo) bool { return jobStep < 0 || s.Step <= jobStep }
	for _, s := range info.Steps {
		if s.Committed && forJob(s) {
			mark := " "
			if (jobStep < 0 && s.Dir == info.Latest) || s.Step == jobStep {
				mark = "*" // the root's latest; in a rank root, the job's
			}
			fmt.Fprintf(stdout, "%s %s\n", mark, s.Dir)
			committed++
		}
	}
	if committed == 0 && info.Problem == nil {
		fmt.Fprintf(stdout, "no committed checkpoints in %s\n", root)
	}
	for _, s := range info.Steps {
		switch {
		case s.Committed && forJob(s):
		case s.Committed:
			fmt.Fprintf(stdout, "  %s  (this rank's save, not committed for the job: the next dos train --resume rewinds it)\n", s.Dir)
		case s.Complete && info.Problem == nil:
			fmt.Fprintf(stdout, "  %s  (not committed: above latest; the next save of its step replaces it)\n", s.Dir)
		case s.Complete:
			fmt.Fprintf(stdout, "  %s  (complete, not marked by latest)\n", s.Dir)
		default:
			fmt.Fprintf(stdout, "  %s  (leftover: incomplete, no %s; retention removes it)\n", s.Dir, checkpoint.ManifestFile)
		}
	}
	if info.Pending != "" && info.Problem != nil {
		fmt.Fprintf(stdout, "  %s.tmp names %s (a commit was cut short)\n", filepath.Join(root, checkpoint.LatestFile), filepath.Base(info.Pending))
	}
	for _, a := range info.Aside {
		why := "did not verify"
		if strings.HasPrefix(filepath.Base(a), "damaged-unmatched-") {
			why = "this rank's piece of a job's step that another rank lacked"
		}
		fmt.Fprintf(stdout, "  %s  (set aside by dos ckpt recover: %s; kept whole, never loaded or removed by dos)\n", a, why)
	}
	if committed == 0 && info.Problem == nil && len(info.Aside) > 0 {
		fmt.Fprintf(stdout, "%s holds no checkpoint to resume: a new run may start there (dos train --ckpt-dir %s, without --resume)\n", root, checkpoint.ShellQuote(root))
	}
	for _, l := range info.Leftovers {
		fmt.Fprintf(stdout, "  %s  (%s)\n", l, leftoverNote(filepath.Base(l), holder))
	}
	if jobStep < 0 {
		listFirstSaveKept(root, stdout)
	}
	if info.Problem != nil {
		fmt.Fprintf(stderr, "dos ckpt ls: %s is damaged: %v\n", root, info.Problem)
		return 1
	}
	return 0
}

// ckptRecover repairs root (checkpoint.Rollback, verifying with the
// optimizer's value checks; for a job's root, checkpoint.RecoverJob, the
// rank roots' identities checked too) and says what it did.
func ckptRecover(root string, rank int, stdout, stderr io.Writer) int {
	finished, err := trainer.FinishReshard(root, stdout)
	if err != nil {
		fmt.Fprintf(stderr, "dos ckpt recover: %v\n", err)
		return 1
	}
	nothing := "nothing to do"
	if finished {
		nothing = "nothing else to do"
	}
	if checkpoint.IsJob(checkpoint.OS, root) {
		// A job's root: every rank root, then the job.
		if rank != 0 {
			fmt.Fprintf(stderr, "dos ckpt recover: %s is a job's root, recovered for every rank; --rank %d: recover one rank's root instead, dos ckpt recover %s (then the job's root, to move every rank to a step they all hold)\n", root, rank, checkpoint.ShellQuote(checkpoint.RankRoot(root, rank)))
			return 2
		}
		step, note, err := checkpoint.RecoverJob(checkpoint.OS, root, trainer.VerifyCheckpoint, trainer.JobRank)
		switch {
		case err != nil:
			fmt.Fprintf(stderr, "dos ckpt recover: %v\n", err)
			return 1
		case step < 0:
			if note == "" {
				note = "the job never committed a checkpoint, and left nothing to remove"
			}
			fmt.Fprintf(stdout, "recovered job %s: %s. %s holds no checkpoint now: a new run may start there (dos train --ckpt-dir %s --gpus N, without --resume)\n",
				root, note, root, checkpoint.ShellQuote(root))
		case note == "":
			fmt.Fprintf(stdout, "OK job %s: step %d verifies in every rank's root and is the job's latest; %s\n", root, step, nothing)
		default:
			fmt.Fprintf(stdout, "recovered job %s: now at step %d: %s\n", root, step, note)
		}
		return 0
	}
	rec, err := checkpoint.Rollback(checkpoint.OS, root, rank, trainer.VerifyCheckpoint)
	if err != nil {
		if tmps, moving := trainer.ReshardLeftovers(root); len(tmps) > 0 && !moving && errors.Is(err, checkpoint.ErrNoCheckpoint) {
			fmt.Fprintf(stderr, "dos ckpt recover: %s\n", trainer.KilledReshardNote(root, tmps[0]))
			return 1
		}
		fmt.Fprintf(stderr, "dos ckpt recover: %v\n", err)
		return 1
	}
	if !rec.Repaired {
		fmt.Fprintf(stdout, "OK %s: latest names %s, which verifies; %s\n", root, rec.Dir, nothing)
		return 0
	}
	fmt.Fprintf(stdout, "recovered %s: %s\n", root, rec.Note)
	return 0
}

// linkedRankStep returns an error, wrapping checkpoint.ErrWrongRank, when
// the step directory dir is a symbolic link in a job's rank root: what it
// names may be another run's (checkpoint.CheckJob refuses the job for it).
func linkedRankStep(dir string) error {
	st, err := os.Lstat(dir)
	if err != nil || st.Mode()&fs.ModeSymlink == 0 {
		return nil
	}
	rankRoot := filepath.Dir(dir)
	job := filepath.Dir(rankRoot)
	if !strings.HasPrefix(filepath.Base(rankRoot), "rank-") || !checkpoint.IsJob(checkpoint.OS, job) {
		return nil
	}
	return fmt.Errorf("%w: %s is a symbolic link in rank root %s of the job %s, not the rank's own step directory: it may name another run's checkpoint; dos ckpt verify %s says what to do",
		checkpoint.ErrWrongRank, dir, rankRoot, job, checkpoint.ShellQuote(job))
}

// whichRank says which rank a checkpoint is: "rank R of a job of N ranks"
// for a job's (dos train --gpus: trainer.CheckpointRank, since the
// manifest's is its rank root's own, 0 of 1), else the manifest's "rank R
// of N".
func whichRank(c *checkpoint.Checkpoint) string {
	if r, n, ok := trainer.CheckpointRank(c); ok && n > 1 {
		return fmt.Sprintf("rank %d of a job of %d ranks", r, n)
	}
	return fmt.Sprintf("rank %d of %d", c.Manifest.Rank, c.Manifest.WorldSize)
}

func ckptVerify(path string, rank int, rankSet bool, stdout, stderr io.Writer) int {
	if checkpoint.IsJob(checkpoint.OS, path) {
		// A job's root: its rank roots the job's, then its latest step
		// in every one.
		if err := checkpoint.CheckJob(checkpoint.OS, path, trainer.JobRank); err != nil {
			fmt.Fprintf(stderr, "dos ckpt verify: %v\n", err)
			return 1
		}
		step, world, err := checkpoint.JobLatest(checkpoint.OS, path)
		if err != nil {
			fmt.Fprintf(stderr, "dos ckpt verify: %v\n", err)
			return 1
		}
		if rank < 0 || rank >= world {
			fmt.Fprintf(stderr, "dos ckpt verify: --rank %d: job %s has %s (0..%d)\n", rank, path, checkpoint.Ranks(world), world-1)
			return 2
		}
		if rank != 0 {
			fmt.Fprintf(stderr, "dos ckpt verify: %s is a job's root, verified for every rank; --rank %d: verify one rank's root instead, %s\n", path, rank, checkpoint.RankRoot(path, rank))
			return 2
		}
		// A job's root: its latest step in every rank's root (the step a
		// resume takes, its latest moved back).
		if rs, note := checkpoint.MovedBack(checkpoint.OS, path, world, step); note != "" {
			fmt.Fprintf(stderr, "dos ckpt verify: %s\n", note)
			step = rs
		}
		for r := range world {
			sd := checkpoint.StepDir(checkpoint.RankRoot(path, r), step)
			if _, err := os.Stat(sd); errors.Is(err, fs.ErrNotExist) && checkpoint.Holder(checkpoint.OS, path) == "" {
				fmt.Fprintf(stderr, "dos ckpt verify: job %s: rank %d lacks the job's latest step %d (%s is missing): put it back, or dos ckpt recover %s moves the job to an older step every rank holds, if there is one (setting the other ranks' pieces of step %d aside, kept whole)\n", path, r, step, sd, checkpoint.ShellQuote(path), step)
				return 1
			}
			if rc := verifyRank(sd, r, world, stdout, stderr); rc != 0 {
				if holder := checkpoint.Holder(checkpoint.OS, path); holder != "" {
					// A running trainer retires old steps as it saves:
					// what verify was reading may be gone, not damaged.
					fmt.Fprintf(stderr, "dos ckpt verify: job %s: rank %d's step %d did not verify while %s holds the job (a running dos train, whose retention may have removed it as verify read it): verify again, or once it has stopped\n", path, r, step, holder)
					return rc
				}
				fmt.Fprintf(stderr, "dos ckpt verify: job %s: rank %d's step %d does not verify (dos ckpt recover %s sets it aside and moves the job to the newest step every rank holds)\n", path, r, step, checkpoint.ShellQuote(path))
				return rc
			}
		}
		roots := fmt.Sprintf("all %d ranks' roots", world)
		if world == 1 {
			roots = "its rank's root"
		}
		fmt.Fprintf(stdout, "OK job %s: step %d verifies in %s\n", path, step, roots)
		return 0
	}
	if r, n, ok := jobRankAt(path); ok {
		// One rank's root of a job, or a step of it: its file is rank
		// 0's of its own root; --rank, if given, must be its rank.
		if rankSet && rank != r {
			fmt.Fprintf(stderr, "dos ckpt verify: --rank %d: %s holds rank %d's pieces of a job of %s, not rank %d's (its file is its rank root's own: --rank is not needed)\n", rank, path, r, checkpoint.Ranks(n), rank)
			return 1
		}
		return verifyRank(path, r, n, stdout, stderr)
	}
	return verifyRank(path, rank, 0, stdout, stderr)
}

// jobRankAt returns the rank and rank count that the checkpoint at path
// (a root's latest, or a step directory) records when it holds one
// rank's pieces of a job (dos train --gpus: trainer.CheckpointRank; its
// file is rank 0's of its own root); ok is false otherwise, and when it
// does not open (the caller's open then says why).
func jobRankAt(path string) (rank, ranks int, ok bool) {
	c, err := checkpoint.OpenPath(checkpoint.OS, path, 0)
	if err != nil {
		return 0, 0, false
	}
	defer c.Close()
	r, n, ok := trainer.CheckpointRank(c)
	return r, n, ok && n > 1
}

// verifyRank is ckptVerify for one checkpoint (a step directory, or a
// root's latest) of rank; world > 0: of a job of world ranks (then rank is
// its rank in the job, its file rank 0 of its rank root's, and its rank
// record must say so).
func verifyRank(path string, rank, world int, stdout, stderr io.Writer) int {
	fileRank := rank
	if world > 0 {
		fileRank = 0
	}
	c, err := checkpoint.OpenPath(checkpoint.OS, path, fileRank)
	if err != nil {
		fmt.Fprintf(stderr, "dos ckpt verify: %v\n", err)
		return 1
	}
	dir := c.Dir
	defer c.Close()
	if err := linkedRankStep(dir); err != nil {
		fmt.Fprintf(stderr, "dos ckpt verify: %v\n", err)
		return 1
	}
	if err := trainer.VerifyCheckpoint(c); err != nil {
		fmt.Fprintf(stderr, "dos ckpt verify: %v\n", err)
		return 1
	}
	if world > 0 {
		if id, err := trainer.JobRank(c); err != nil {
			fmt.Fprintf(stderr, "dos ckpt verify: %v\n", err)
			return 1
		} else if id.Ranks > 0 && (id.Rank != rank || id.Ranks != world) {
			fmt.Fprintf(stderr, "dos ckpt verify: %s holds rank %d's pieces of a job of %d ranks, not rank %d's of %d: %v\n", dir, id.Rank, id.Ranks, rank, world, checkpoint.ErrWrongRank)
			return 1
		}
	}
	var bytes int64
	for _, t := range c.Manifest.Tensors {
		bytes += t.Bytes
	}
	fmt.Fprintf(stdout, "OK %s: step %d, %s, %d tensors, %d bytes, every CRC32C matches, the optimizer state is finite (exp_avg_sq >= 0) and its settings valid\n",
		dir, c.Manifest.Step, whichRank(c), len(c.Manifest.Tensors), bytes)
	return 0
}
