package checkpoint

import (
	"errors"
	"path/filepath"
	"testing"
)

// TestPrepare: a snapshot's Prepare runs before its tensors are read (what
// it writes into them is what is saved), synchronously and lazily; its
// error fails the save and leaves the previous checkpoint the latest.
func TestPrepare(t *testing.T) {
	for _, lazy := range []bool{false, true} {
		root := t.TempDir()
		var e *Engine
		if lazy {
			var err error
			if e, err = NewEngine(OS, root, EngineOptions{ChunkBytes: 4096, RingBytes: 3 * 4096, Writers: 2}); err != nil {
				t.Fatal(err)
			}
		}
		save := func(s *Snapshot) error {
			if !lazy {
				_, err := Save(OS, root, s)
				return err
			}
			h, err := e.Save(s)
			if err != nil {
				return err
			}
			_, err = h.Wait()
			return err
		}
		// What the saved tensors should hold, and a snapshot whose data
		// is zero until Prepare writes it (a device's state moving D2H).
		want := testSnapshot(3)
		s := testSnapshot(3)
		for _, tn := range s.Tensors {
			for _, r := range tn.Data {
				clear(r)
			}
		}
		s.Prepare = func() error {
			for i, tn := range s.Tensors {
				for j, r := range tn.Data {
					copy(r, want.Tensors[i].Data[j])
				}
			}
			return nil
		}
		if err := save(s); err != nil {
			t.Fatal(err)
		}
		checkLatest(t, OS, root, want)
		bad := testSnapshot(4)
		boom := errors.New("device fault")
		bad.Prepare = func() error { return boom }
		if err := save(bad); !errors.Is(err, boom) {
			t.Fatalf("lazy %v: a failing Prepare: %v", lazy, err)
		}
		checkLatest(t, OS, root, want)
		if lazy {
			_ = e.Close()
		}
		if list, _ := List(OS, root); len(list) != 1 || filepath.Base(list[0]) != "step-000000003" {
			t.Errorf("lazy %v: checkpoints %v, want [3]", lazy, list)
		}
	}
}
