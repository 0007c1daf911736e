package offload

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/deepstates/dos/checkpoint"
)

// TestExportForPython writes a checkpoint and, beside it, expect.json (each
// tensor's shape and first values) for scripts/check_safetensors.py to check
// with Python's safetensors. It runs only when DOS_CKPT_EXPORT names an
// output directory (scripts/gpu-check.sh sets it on the GPU machine, where
// Python has safetensors).
func TestExportForPython(t *testing.T) {
	out := os.Getenv("DOS_CKPT_EXPORT")
	if out == "" {
		t.Skip("set DOS_CKPT_EXPORT=DIR to write a checkpoint for scripts/check_safetensors.py")
	}
	o := newTest(t, resumeOpts())
	runSteps(t, o, 1, 3)
	dir, err := o.SaveCheckpoint(checkpoint.OS, filepath.Join(out, "ckpt"), map[string]any{"trainer": trainerState{Iteration: 3}})
	if err != nil {
		t.Fatal(err)
	}
	snap, err := o.Snapshot(nil)
	if err != nil {
		t.Fatal(err)
	}
	type expect struct {
		Shape []int64   `json:"shape"`
		First []float64 `json:"first"`
	}
	want := map[string]expect{}
	for _, ts := range snap.Tensors {
		b := ts.Data[0]
		var first []float64
		for i := 0; i < 4 && 4*i+4 <= len(b); i++ {
			first = append(first, float64(float32frombytes(b[4*i:])))
		}
		want[ts.Name] = expect{Shape: ts.Shape, First: first}
	}
	js, err := json.MarshalIndent(want, "", " ")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(out, "expect.json"), js, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("wrote %s and %s (%d tensors)", dir, filepath.Join(out, "expect.json"), len(want))
}

// float32frombytes decodes one little-endian float32.
func float32frombytes(b []byte) float32 {
	return math.Float32frombits(uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16 | uint32(b[3])<<24)
}
