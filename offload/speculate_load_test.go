package offload

import (
	"math"
	"testing"

	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/perfmodel"
)

// TestSpeculateLoadCheckpointAfterKept: a Step keeps a speculation (a held
// subgroup's state now lives in a slot), then LoadCheckpoint writes the
// host state; a Master (or ReadState, Snapshot, SaveCheckpoint, SetParam)
// before the next Step or SyncDevice must see the loaded state.
func TestSpeculateLoadCheckpointAfterKept(t *testing.T) {
	for _, read := range []string{"Master", "SaveCheckpoint", "SetParam"} {
		t.Run(read, func(t *testing.T) {
			r := newSpecRig(t, specBase(), perfmodel.Schedule{CPU: 4}, 1<<20)
			root := t.TempDir()
			if _, err := r.b.SaveCheckpoint(checkpoint.OS, root, nil); err != nil { // step 0
				t.Fatal(err)
			}
			r.backward(t, 1, 0.01, false, true)
			if _, rb := r.step(t, StepArgs{}); rb.Speculated == 0 {
				t.Fatal("step 1 kept nothing")
			}
			if _, _, err := r.b.LoadCheckpoint(checkpoint.OS, root); err != nil {
				t.Fatal(err)
			}
			want := loaded(t, specBase(), root)
			got := r.b
			if read == "SetParam" {
				// A write of another parameter (its loaded values), as a
				// trainer that sets one tensor after a load does: the held
				// ones must stay the checkpoint's.
				other := r.b.Params()[len(r.b.Params())-1].Name
				j, _ := want.Index(other)
				if err := r.b.SetParam(other, master(t, want, j)); err != nil {
					t.Fatal(err)
				}
			}
			if read == "SaveCheckpoint" {
				root2 := t.TempDir()
				if _, err := r.b.SaveCheckpoint(checkpoint.OS, root2, nil); err != nil {
					t.Fatal(err)
				}
				got = loaded(t, specBase(), root2)
			}
			for _, name := range specHeld {
				i, _ := want.Index(name)
				w, g := master(t, want, i), master(t, got, i)
				for j := range w {
					if math.Float32bits(w[j]) != math.Float32bits(g[j]) {
						t.Fatalf("after LoadCheckpoint of step 0, %s: %s.master[%d] = %g, the checkpoint's %g (step 1's, before the load: %g)", read, name, j, g[j], w[j], master(t, r.ref, i)[j])
					}
				}
			}
		})
	}
}

// TestSpeculateSaveAsyncSlots: a lazy checkpoint of a state that kept
// speculative updates left in the engine's slots reads it there (nothing
// moves home: the subgroups stay in their slots), while the next steps
// speculate and update again (a write of a captured subgroup's state waits
// for its capture): the checkpoint holds the serial path's state at its
// step, and the run goes on the serial path's, bit for bit.
func TestSpeculateSaveAsyncSlots(t *testing.T) {
	r := newSpecRig(t, specBase(), perfmodel.Schedule{CPU: 4}, 1<<20)
	root := t.TempDir()
	ce := smallEngine(t, checkpoint.OS, root)
	inSlots := func() int {
		n := 0
		hs := r.b.eng.HostState()
		for g, sg := range r.b.subgroups {
			if sg.Len > 0 && &r.b.eng.StateOf(g).Param[0] != &hs.Param[sg.Offset] {
				n++
			}
		}
		return n
	}
	r.backward(t, 1, 0.01, false, true)
	if _, rb := r.step(t, StepArgs{}); rb.Speculated == 0 {
		t.Fatal("step 1 kept nothing")
	}
	moved := inSlots()
	if moved == 0 {
		t.Fatal("step 1 left no state in a slot")
	}
	want := make([][]float32, len(r.ref.Params()))
	for i := range want {
		want[i] = master(t, r.ref, i)
	}
	r.backward(t, 2, 0.01, false, true) // speculated, then undone by the save: the state of step 1 is saved
	h, err := r.b.SaveAsync(ce, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	if n := inSlots(); n != moved {
		t.Fatalf("SaveAsync moved states: %d in slots, %d before", n, moved)
	}
	r.step(t, StepArgs{})
	for k := int64(3); k <= 4; k++ {
		r.backward(t, k, 0.01, false, true)
		r.step(t, StepArgs{})
	}
	if _, err := h.Wait(); err != nil {
		t.Fatal(err)
	}
	got := loaded(t, specBase(), root)
	for i, w := range want {
		g := master(t, got, i)
		for j := range w {
			if math.Float32bits(w[j]) != math.Float32bits(g[j]) {
				t.Fatalf("the checkpoint of step 1: %s.master[%d] = %g, serial %g", r.ref.Params()[i].Name, j, g[j], w[j])
			}
		}
	}
	for i := range r.ref.Params() {
		w, g := master(t, r.ref, i), master(t, r.b, i)
		for j := range w {
			if math.Float32bits(w[j]) != math.Float32bits(g[j]) {
				t.Fatalf("after step 4: %s.master[%d] = %g, serial %g", r.ref.Params()[i].Name, j, g[j], w[j])
			}
		}
	}
}
