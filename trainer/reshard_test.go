package trainer

import (
	"bytes"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
)

// TestReshard: a 2-rank job's checkpoint at step 4 re-sharded onto 2, 4 and
// 1 ranks (and the 1-rank one back onto 2) resumes to step 8: on 2 ranks
// bit for bit the uninterrupted run, on 4 and 1 within float tolerance
// (the ranks' partial sums associate differently; TestZeROMatchesOneRank's
// bound), clipping active. The source is unchanged; a destination that
// holds checkpoints, a rank count that does not divide the batch and a
// source without a checkpoint are refused by name.
func TestReshard(t *testing.T) {
	setMemAvailable(t, 0, false)
	toks := make([]uint16, 6000)
	for i := range toks {
		toks[i] = uint16((i*11 + i/7) % 256)
	}
	c := DefaultTrainConfig()
	c.Model.NLayer, c.Model.NEmbd, c.Model.NHead, c.Model.NCtx = 1, 20, 2, 8 // 20/4 and odd tensor sizes: uneven pieces
	c.Batch, c.Steps, c.SampleBytes, c.EvalBatches, c.LogEvery, c.MaxGradNorm = 4, 8, 0, 1, 0, 0.5
	ref, _ := zeroRun(t, c, 2, toks)

	src := t.TempDir()
	first := c
	first.CkptDir, first.CkptEvery, first.Steps, first.DecaySteps = src, 4, 4, 8
	zeroRun(t, first, 2, toks)
	before := listTree(t, src)

	resumed := func(root string, gpus int) [][2]float64 {
		t.Helper()
		r := c
		r.CkptDir, r.CkptEvery, r.Resume = root, 100, true
		got, _ := zeroRun(t, r, gpus, toks)
		if len(got) != 4 {
			t.Fatalf("--gpus %d from %s: %d steps logged, want 4 (5..8)", gpus, root, len(got))
		}
		return got
	}
	reshard := func(from string, n int) string {
		t.Helper()
		dst := filepath.Join(t.TempDir(), "dst")
		var out bytes.Buffer
		step, err := Reshard(from, dst, n, &out)
		if err != nil || step != 4 {
			t.Fatalf("Reshard(%s, %d ranks): step %d, %v\n%s", from, n, step, err, out.String())
		}
		return dst
	}
	clipped := false
	for _, tc := range []struct {
		gpus int
		tol  float64
	}{{2, 0}, {4, 2e-5}, {1, 2e-5}} {
		got := resumed(reshard(src, tc.gpus), tc.gpus)
		for i, g := range got {
			want := ref[4+i]
			clipped = clipped || want[1] > c.MaxGradNorm
			for j, what := range []string{"loss", "grad_norm"} {
				if d := math.Abs(g[j] - want[j]); d > tc.tol*math.Abs(want[j]) {
					t.Errorf("re-sharded onto %d ranks, step %d: %s %v, uninterrupted %v", tc.gpus, 5+i, what, g[j], want[j])
				}
			}
		}
	}
	if !clipped {
		t.Error("no step clipped after the resume: the global norm is not tested")
	}
	// One rank back onto two.
	back := resumed(reshard(reshard(src, 1), 2), 2)
	for i, g := range back {
		if d := math.Abs(g[0] - ref[4+i][0]); d > 2e-5*ref[4+i][0] {
			t.Errorf("2 -> 1 -> 2 ranks, step %d: loss %v, uninterrupted %v", 5+i, g[0], ref[4+i][0])
		}
	}
	if after := listTree(t, src); after != before {
		t.Errorf("Reshard changed its source:\nbefore %s\nafter  %s", before, after)
	}

	// Refusals.
	full := reshard(src, 4)
	if _, err := Reshard(src, full, 2, &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), "is not empty") {
		t.Errorf("into a root with checkpoints: %v", err)
	}
	if _, err := Reshard(src, filepath.Join(src, "inside"), 2, &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), "inside it") {
		t.Errorf("into a directory inside the source: %v", err)
	}
	if _, err := Reshard(filepath.Join(src, "rank-00001"), filepath.Join(t.TempDir(), "x"), 1, &bytes.Buffer{}); err == nil ||
		!strings.Contains(err.Error(), "one rank's root of a job of 2 ranks") {
		t.Errorf("a rank's root as the source: %v", err)
	}
	// Rank directories swapped (the same piece sizes: only the record of
	// the rank tells them apart) are refused, by name.
	swapped := filepath.Join(t.TempDir(), "swapped")
	if err := os.CopyFS(swapped, os.DirFS(full)); err != nil {
		t.Fatal(err)
	}
	r1, r2 := filepath.Join(swapped, "rank-00001"), filepath.Join(swapped, "rank-00002")
	if err := os.Rename(r1, r1+".x"); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(r2, r1); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(r1+".x", r2); err != nil {
		t.Fatal(err)
	}
	if _, err := Reshard(swapped, filepath.Join(t.TempDir(), "x"), 2, &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), "holds rank 2's pieces of a job of 4 ranks, not rank 1's of 4") {
		t.Errorf("rank directories swapped: %v", err)
	}
	r := c
	r.CkptDir, r.Resume, r.GPUs = swapped, true, 4
	if _, err := NewTokens(r, toks, nil, nil); err == nil || !strings.Contains(err.Error(), "holds rank 2's pieces") {
		t.Errorf("resume of swapped rank directories: %v", err)
	}
	// A run whose configuration ranks refuse (a float16 working copy) is
	// refused before anything is written.
	f16 := c
	f16.WorkingDType, f16.CkptDir, f16.CkptEvery, f16.Steps = adam.F16, filepath.Join(t.TempDir(), "f16"), 2, 2
	zeroRun(t, f16, 1, toks)
	if _, err := Reshard(f16.CkptDir, filepath.Join(t.TempDir(), "x"), 2, &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), "--working-dtype float16 is not supported") {
		t.Errorf("a float16 run onto 2 ranks: %v", err)
	}
	// A failed Reshard leaves neither the destination nor its temporary.
	parent := t.TempDir()
	if _, err := Reshard(src, filepath.Join(parent, "d"), 3, &bytes.Buffer{}); err == nil {
		t.Error("onto 3 ranks of a batch of 4: no error")
	}
	if es, _ := os.ReadDir(parent); len(es) != 0 {
		t.Errorf("a failed Reshard left %v", es)
	}
	if _, err := Reshard(src, filepath.Join(t.TempDir(), "x"), 3, &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), "batch 4 is not a multiple of 3") {
		t.Errorf("onto 3 ranks of a batch of 4: %v", err)
	}
	if _, err := Reshard(t.TempDir(), filepath.Join(t.TempDir(), "x"), 2, &bytes.Buffer{}); err == nil {
		t.Error("an empty source was re-sharded")
	}
	// The trainer points at it when the rank count differs, and refuses a
	// rank's root taken for a single-rank one.
	r = c
	r.CkptDir, r.Resume, r.GPUs = src, true, 4
	if _, err := NewTokens(r, toks, nil, nil); err == nil || !strings.Contains(err.Error(), "dos ckpt reshard "+src+" NEWROOT --gpus 4") {
		t.Errorf("resume on 4 ranks: %v", err)
	}
	r.CkptDir, r.GPUs = filepath.Join(src, "rank-00000"), 0
	if _, err := NewTokens(r, toks, nil, nil); err == nil || !strings.Contains(err.Error(), "one rank's root of a job of 2 ranks") {
		t.Errorf("a rank's root resumed as one rank's run: %v", err)
	}
}

// listTree returns every path under root with its size, sorted, as one
// string (lock files left out).
func listTree(t *testing.T, root string) string {
	t.Helper()
	var b strings.Builder
	err := filepath.Walk(root, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		if strings.Contains(fi.Name(), "lock") {
			return nil
		}
		rel, _ := filepath.Rel(root, p)
		b.WriteString(rel)
		if !fi.IsDir() {
			fmt.Fprintf(&b, ":%d", fi.Size())
		}
		b.WriteString(" ")
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return b.String()
}
