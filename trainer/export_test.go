package trainer

import (
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/safetensors"
)

// saveWeights writes a checkpoint as Train does, as far as LoadWeights
// reads one: the trainer object and NAME.master of every parameter of cfg
// (GPT-2's initial weights), with element idx of parameter bad set to val
// when bad >= 0. It returns the directory.
func saveWeights(t *testing.T, cfg Config, bad, idx int, val float32) string {
	t.Helper()
	obj, err := json.Marshal(trainerState{Config: TrainConfig{Model: cfg}})
	if err != nil {
		t.Fatal(err)
	}
	snap := &checkpoint.Snapshot{Step: 1, Objects: map[string]json.RawMessage{"trainer": obj}}
	for i, w := range InitParams(cfg, 1) {
		p := cfg.Tensors()[i]
		if i == bad {
			w[idx] = val
		}
		shape := make([]int64, len(p.Shape))
		for j, d := range p.Shape {
			shape[j] = int64(d)
		}
		snap.Tensors = append(snap.Tensors, checkpoint.Tensor{Name: p.Name + ".master", DType: safetensors.F32, Shape: shape,
			Data: [][]byte{safetensors.Float32Bytes(w)}})
	}
	dir, err := checkpoint.Save(checkpoint.OS, t.TempDir(), snap)
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestLoadWeightsRefusesNaN is issue 14's defect 9 for dos export and dos
// eval: master weights with a NaN or an Inf, under valid checksums, are
// refused with the directory and the tensor named (and ExportHF writes
// nothing); finite ones load.
func TestLoadWeightsRefusesNaN(t *testing.T) {
	cfg := Config{VocabSize: VocabSize, NCtx: 4, NLayer: 1, NHead: 1, NEmbd: 4}
	if _, w, _, err := LoadWeights(saveWeights(t, cfg, -1, 0, 0)); err != nil || len(w) != len(cfg.Tensors()) {
		t.Fatalf("clean checkpoint: %d tensors, %v", len(w), err)
	}
	for _, val := range []float32{float32(math.NaN()), float32(math.Inf(-1))} {
		bad := 2 // h.0.ln_1.weight
		name := cfg.Tensors()[bad].Name + ".master"
		dir := saveWeights(t, cfg, bad, 3, val)
		_, _, _, err := LoadWeights(dir)
		for _, want := range []string{dir, `"` + name + `"`, "element 3 is "} {
			if !errors.Is(err, checkpoint.ErrCorrupt) || !strings.Contains(err.Error(), want) {
				t.Errorf("LoadWeights with %v: %v, want ErrCorrupt with %s", val, err, want)
			}
		}
		out := filepath.Join(t.TempDir(), "hf")
		if _, err := ExportHF(dir, out); !errors.Is(err, checkpoint.ErrCorrupt) {
			t.Errorf("ExportHF with %v: %v", val, err)
		}
		if _, err := os.Stat(out); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("ExportHF with %v wrote %s (%v)", val, out, err)
		}
	}
}
