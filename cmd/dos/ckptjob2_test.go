package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deepstates/dos/checkpoint"
)

// The defects of the second job/ckpt adversary round, each as a user
// meets them with the CLI.

// TestCommittedJobNotClearedAsFirstSave (round 2, F1): a job that
// committed, its latest lost, looked like a first save cut short (no step
// every rank holds, at most one held): dos ckpt recover and dos train
// --resume removed every rank root and job.json (rank 0's committed step
// 10 with them) and started at iteration 0. Now, with rank 1's root moved
// away (a --ckpt-keep 1 job) or rank 1's step gone while its latest names
// it, both refuse, saying what they saw, and change nothing.
func TestCommittedJobNotClearedAsFirstSave(t *testing.T) {
	keep1 := func(t *testing.T) string {
		dir := trainJobWith(t, "6", "--ckpt-keep", "1")
		os.Remove(filepath.Join(dir, checkpoint.LatestFile))
		if err := os.Rename(checkpoint.RankRoot(dir, 1), dir+"-rank1"); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	one := func(t *testing.T) string {
		dir := trainJobWith(t, "2")
		os.Remove(filepath.Join(dir, checkpoint.LatestFile))
		if err := os.RemoveAll(checkpoint.StepDir(checkpoint.RankRoot(dir, 1), 2)); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	for _, c := range []struct {
		name, want string
		make       func(t *testing.T) string
	}{
		{"rank root moved away", "rank-00001 is missing", keep1},
		{"rank latest names a step lost", "which it does not hold complete", one},
	} {
		for _, cmd := range []string{"recover", "resume"} {
			t.Run(c.name+"/"+cmd, func(t *testing.T) {
				dir := c.make(t)
				before := treeHash(t, dir)
				var rc int
				var stdout, stderr string
				if cmd == "recover" {
					rc, stdout, stderr = invoke(t, "ckpt", "recover", dir)
				} else {
					rc, stdout, stderr = invoke(t, "train", append(resumeArgs(dir, "8"), "--gpus", "2")...)
				}
				if rc != 1 || !strings.Contains(stderr, c.want) || !strings.Contains(stderr, "Nothing was changed") ||
					!strings.Contains(stderr, "may have committed") || strings.Contains(stdout+stderr, "never committed a checkpoint (") {
					t.Errorf("rc %d, want 1 naming %q\n%s%s", rc, c.want, stdout, stderr)
				}
				if after := treeHash(t, dir); after != before {
					t.Errorf("the job root changed")
				}
			})
		}
	}
}
