package trainer

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deepstates/dos/checkpoint"
)

// TestReshardSourceMoves (issue 29, 6): a trainer writing the source
// commits a newer step and its retention retires the one Reshard is
// reading: Reshard reads the new step (it said the source was corrupt,
// "index.json: missing"); when the step keeps vanishing while a trainer
// holds the source, the error says so, not that the source is damaged.
func TestReshardSourceMoves(t *testing.T) {
	setMemAvailable(t, 0, false)
	toks := make([]uint16, 6000)
	for i := range toks {
		toks[i] = uint16((i*11 + i/7) % 256)
	}
	c := DefaultTrainConfig()
	c.Model.NLayer, c.Model.NEmbd, c.Model.NHead, c.Model.NCtx = 1, 16, 2, 8
	c.Batch, c.Steps, c.SampleBytes, c.EvalBatches, c.LogEvery = 4, 6, 0, 1, 0
	src := filepath.Join(t.TempDir(), "job")
	c.CkptDir, c.CkptEvery = src, 2
	zeroRun(t, c, 2, toks)
	// The job as a trainer had it at step 4, about to commit step 6.
	latest := filepath.Join(src, checkpoint.LatestFile)
	if err := os.WriteFile(latest, []byte("step-000000004\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	retired := filepath.Join(t.TempDir(), "retired")
	step4 := checkpoint.StepDir(checkpoint.RankRoot(src, 1), 4)
	t.Cleanup(func() { reshardReadHook = nil })
	reshardReadHook = func(dir string) {
		if dir == step4 { // as Reshard reaches rank 1: commit 6, retire 4
			os.WriteFile(latest, []byte("step-000000006\n"), 0o644)
			if err := os.Rename(step4, retired); err != nil && !errors.Is(err, fs.ErrNotExist) {
				t.Error(err)
			}
		}
	}
	var out bytes.Buffer
	step, err := Reshard(src, filepath.Join(t.TempDir(), "dst"), 1, &out)
	if err != nil || step != 6 || !strings.Contains(out.String(), "moved from step 4 to 6 as it was read") {
		t.Fatalf("Reshard of a source whose step moved: step %d, %v\n%s", step, err, out.String())
	}

	// Held by a trainer, and the step vanishing at every read: the error
	// names the holder and says the source is not damaged.
	lock, err := checkpoint.Lock(checkpoint.OS, src)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Unlock()
	reshardReadHook = func(dir string) {
		if strings.HasPrefix(dir, checkpoint.RankRoot(src, 1)) {
			os.RemoveAll(dir)
		}
	}
	_, err = Reshard(src, filepath.Join(t.TempDir(), "dst"), 1, &bytes.Buffer{})
	if err == nil || !strings.Contains(err.Error(), "a running dos train") || !strings.Contains(err.Error(), "the source is not damaged") {
		t.Errorf("Reshard of a held source whose step vanishes: %v", err)
	}
}
