package checkpoint

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/deepstates/dos/safetensors"
)

// testSnapshot returns a snapshot of step whose contents depend on step:
// F32 given as 3 byte ranges, BF16, U8, a zero-element tensor, a scalar,
// and two objects.
func testSnapshot(step int64) *Snapshot {
	r := rand.New(rand.NewPCG(uint64(step), 7))
	f32 := func(n int) []byte {
		v := make([]float32, n)
		for i := range v {
			v[i] = float32(r.NormFloat64())
		}
		return safetensors.Float32Bytes(v)
	}
	w := f32(12)
	bf := make([]uint16, 5)
	for i := range bf {
		bf[i] = uint16(r.Uint32())
	}
	u8 := make([]byte, 7)
	for i := range u8 {
		u8[i] = byte(r.Uint32())
	}
	return &Snapshot{
		Step: step,
		Tensors: []Tensor{
			{Name: "model.w.exp_avg", DType: safetensors.F32, Shape: []int64{3, 4}, Data: [][]byte{w[:8], w[8:20], w[20:]}},
			{Name: "model.b.bf16", DType: safetensors.BF16, Shape: []int64{5}, Data: [][]byte{safetensors.Uint16Bytes(bf)}},
			{Name: "mask", DType: safetensors.U8, Shape: []int64{7}, Data: [][]byte{u8}},
			{Name: "empty", DType: safetensors.F32, Shape: []int64{0, 3}},
			{Name: "scalar", DType: safetensors.F32, Data: [][]byte{f32(1)}},
		},
		Objects: map[string]json.RawMessage{
			"optimizer": json.RawMessage(fmt.Sprintf(`{"lr": 0.001, "betas": [0.9, 0.999], "t": %d}`, step)),
			"trainer":   json.RawMessage(fmt.Sprintf(`{"iteration": %d, "rng": "seed-%d"}`, step, step)),
		},
	}
}

func concat(ranges [][]byte) []byte {
	var b []byte
	for _, r := range ranges {
		b = append(b, r...)
	}
	if b == nil {
		b = []byte{}
	}
	return b
}

func mustSave(t testing.TB, fsys FS, root string, s *Snapshot) string {
	t.Helper()
	dir, err := Save(fsys, root, s)
	if err != nil {
		t.Fatalf("Save step %d: %v", s.Step, err)
	}
	return dir
}

// checkMatches opens dir and checks that it holds exactly s.
func checkMatches(t testing.TB, fsys FS, dir string, s *Snapshot) {
	t.Helper()
	c, err := Open(fsys, dir, s.Rank)
	if err != nil {
		t.Fatalf("Open %s: %v", dir, err)
	}
	defer c.Close()
	if c.Manifest.Step != s.Step || len(c.Manifest.Tensors) != len(s.Tensors) {
		t.Fatalf("%s: step %d with %d tensors, want step %d with %d", dir, c.Manifest.Step, len(c.Manifest.Tensors), s.Step, len(s.Tensors))
	}
	if err := c.Verify(); err != nil {
		t.Fatalf("Verify %s: %v", dir, err)
	}
	for _, want := range s.Tensors {
		data := concat(want.Data)
		e, ok := c.Entry(want.Name)
		if !ok || e.DType != want.DType || e.Bytes != int64(len(data)) || !slices.Equal(e.Shape, want.Shape) {
			t.Fatalf("%s: entry %+v for tensor %q (%s %v, %d bytes)", dir, e, want.Name, want.DType, want.Shape, len(data))
		}
		got := make([]byte, len(data))
		if err := c.ReadTensor(want.Name, got); err != nil {
			t.Fatalf("ReadTensor %q: %v", want.Name, err)
		}
		if !bytes.Equal(got, data) {
			t.Fatalf("tensor %q: read %x, want %x", want.Name, got, data)
		}
		// Into two ranges, split unevenly.
		clear(got)
		h := len(got) / 3
		if err := c.ReadTensor(want.Name, got[:h], got[h:]); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("ReadTensor %q in 2 ranges: %v, %x", want.Name, err, got)
		}
	}
	if len(c.Manifest.Objects) != len(s.Objects) {
		t.Fatalf("%d objects, want %d", len(c.Manifest.Objects), len(s.Objects))
	}
	for name, raw := range s.Objects {
		var got, want any
		if err := c.Object(name, &got); err != nil {
			t.Fatalf("Object %q: %v", name, err)
		}
		if err := json.Unmarshal(raw, &want); err != nil {
			t.Fatal(err)
		}
		g, _ := json.Marshal(got)
		w, _ := json.Marshal(want)
		if !bytes.Equal(g, w) {
			t.Fatalf("object %q: %s, want %s", name, g, w)
		}
	}
}

// checkLatest checks that Latest gives the directory of s and that it
// holds s.
func checkLatest(t testing.TB, fsys FS, root string, s *Snapshot) {
	t.Helper()
	dir, err := Latest(fsys, root)
	if err != nil {
		t.Fatalf("Latest: %v", err)
	}
	if want := filepath.Join(root, stepDirName(s.Step)); dir != want {
		t.Fatalf("Latest = %s, want %s", dir, want)
	}
	checkMatches(t, fsys, dir, s)
}

func TestRoundTrip(t *testing.T) {
	root := filepath.Join(t.TempDir(), "ckpt") // Save creates it
	s := testSnapshot(10)
	dir := mustSave(t, OS, root, s)
	if want := filepath.Join(root, "step-000000010"); dir != want {
		t.Fatalf("dir = %s, want %s", dir, want)
	}
	checkLatest(t, OS, root, s)
	if b, err := os.ReadFile(filepath.Join(root, "latest")); err != nil || string(b) != "step-000000010\n" {
		t.Fatalf("latest holds %q (%v)", b, err)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if want := []string{"index.json", "manifest.json", "rank-00000.safetensors"}; !slices.Equal(names, want) {
		t.Fatalf("directory holds %v, want %v", names, want)
	}

	// The file is a plain safetensors file, as Python's safe_open reads it.
	f, err := safetensors.ReadFile(filepath.Join(dir, "rank-00000.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	if want := map[string]string{"format": "pt", "step": "10", "producer": "dos"}; fmt.Sprint(f.Metadata) != fmt.Sprint(want) {
		t.Fatalf("metadata %v, want %v", f.Metadata, want)
	}
	for _, tt := range s.Tensors {
		info, b, err := f.Bytes(tt.Name)
		if err != nil || !bytes.Equal(b, concat(tt.Data)) || info.DType != tt.DType {
			t.Fatalf("safetensors tensor %q: %v %v", tt.Name, info, err)
		}
	}

	// The manifest and index use the documented field names.
	var m map[string]any
	b, _ := os.ReadFile(filepath.Join(dir, "manifest.json"))
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"format", "version", "step", "rank", "world_size", "created", "files", "tensors", "objects"} {
		if _, ok := m[k]; !ok {
			t.Errorf("manifest has no %q", k)
		}
	}
	if m["format"] != "dos-checkpoint" || m["version"] != 1.0 || m["world_size"] != 1.0 {
		t.Errorf("manifest header %v %v %v", m["format"], m["version"], m["world_size"])
	}
	if _, err := time.Parse(time.RFC3339, m["created"].(string)); err != nil {
		t.Errorf("created: %v", err)
	}
	t0 := m["tensors"].([]any)[0].(map[string]any)
	for _, k := range []string{"name", "file", "dtype", "shape", "offset", "bytes", "crc32c"} {
		if _, ok := t0[k]; !ok {
			t.Errorf("manifest tensor has no %q", k)
		}
	}
	var ix struct {
		Metadata struct {
			TotalSize int64 `json:"total_size"`
		} `json:"metadata"`
		WeightMap map[string]string `json:"weight_map"`
	}
	b, _ = os.ReadFile(filepath.Join(dir, "index.json"))
	if err := json.Unmarshal(b, &ix); err != nil {
		t.Fatal(err)
	}
	if ix.Metadata.TotalSize != 12*4+5*2+7+0+4 || len(ix.WeightMap) != 5 || ix.WeightMap["mask"] != "rank-00000.safetensors" {
		t.Fatalf("index %s", b)
	}

	c, err := Open(OS, dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// Wrong destination size: an error, not corruption.
	err = c.ReadTensor("mask", make([]byte, 6))
	if err == nil || errors.Is(err, ErrCorrupt) {
		t.Fatalf("ReadTensor with 6 of 7 bytes: %v", err)
	}
	if err := c.ReadTensor("nope", nil); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("ReadTensor of an absent tensor: %v", err)
	}
	if err := c.ReadTensor("empty"); err != nil {
		t.Fatalf("ReadTensor of a zero-element tensor: %v", err)
	}
	var opt struct {
		LR    float64    `json:"lr"`
		Betas [2]float64 `json:"betas"`
		T     int64      `json:"t"`
	}
	if err := c.Object("optimizer", &opt); err != nil || opt.LR != 0.001 || opt.Betas[1] != 0.999 || opt.T != 10 {
		t.Fatalf("Object optimizer: %+v, %v", opt, err)
	}
	if err := c.Object("absent", &opt); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Object absent: %v", err)
	}
	if _, err := Open(OS, dir, 1); err == nil || errors.Is(err, ErrCorrupt) {
		t.Fatalf("Open of rank 1 in rank 0's directory: %v", err)
	}

	// Concurrent reads (run with -race).
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for _, tt := range s.Tensors {
				if err := c.ReadTensor(tt.Name, make([]byte, len(concat(tt.Data)))); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.ReadTensor("mask", make([]byte, 7)); !errors.Is(err, fs.ErrClosed) {
		t.Fatalf("ReadTensor after Close: %v", err)
	}
}

func TestRoundTripLargeRankAndWorld(t *testing.T) {
	root := t.TempDir()
	big := make([]byte, verifyChunk*2+3) // Verify reads it in 3 chunks
	for i := range big {
		big[i] = byte(i * 7)
	}
	s := &Snapshot{Step: 1234567890, Rank: 3, WorldSize: 8, Tensors: []Tensor{
		{Name: "big", DType: safetensors.U8, Shape: []int64{int64(len(big))}, Data: [][]byte{big[:1], big[1 : len(big)-1], big[len(big)-1:]}},
	}}
	dir := mustSave(t, OS, root, s)
	if filepath.Base(dir) != "step-1234567890" {
		t.Fatalf("dir %s", dir)
	}
	if _, err := os.Stat(filepath.Join(dir, "rank-00003.safetensors")); err != nil {
		t.Fatal(err)
	}
	checkLatest(t, OS, root, s)
	c, err := Open(OS, dir, 3)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if c.Manifest.WorldSize != 8 || c.Manifest.Objects == nil {
		t.Fatalf("manifest %+v", c.Manifest)
	}
}

func TestListAndReplace(t *testing.T) {
	root := t.TempDir()
	if dirs, err := List(OS, root); err != nil || len(dirs) != 0 {
		t.Fatalf("List of an empty root: %v, %v", dirs, err)
	}
	if _, err := Latest(OS, root); !errors.Is(err, fs.ErrNotExist) || errors.Is(err, ErrCorrupt) {
		t.Fatalf("Latest of an empty root: %v", err)
	}
	if dirs, err := List(OS, filepath.Join(root, "missing")); err != nil || len(dirs) != 0 {
		t.Fatalf("List of a missing root: %v, %v", dirs, err)
	}
	for _, step := range []int64{10, 30, 20} {
		mustSave(t, OS, root, testSnapshot(step))
	}
	// latest names step 20, the last saved; step 30 is newer but was
	// never the latest after 20's save, so it is not listed.
	checkLatest(t, OS, root, testSnapshot(20))
	dirs, err := List(OS, root)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{filepath.Join(root, "step-000000020"), filepath.Join(root, "step-000000010")}
	if !slices.Equal(dirs, want) {
		t.Fatalf("List = %v, want %v", dirs, want)
	}

	// The latest checkpoint is never replaced.
	if _, err := Save(OS, root, testSnapshot(20)); !errors.Is(err, fs.ErrExist) || !strings.Contains(err.Error(), "step 20") {
		t.Fatalf("Save over the latest: %v", err)
	}
	checkLatest(t, OS, root, testSnapshot(20))

	// A stale temporary directory and an uncommitted step directory (30)
	// are ignored, then cleaned and replaced by Save.
	stale := filepath.Join(root, ".tmp-step-000000040-deadbeef")
	if err := os.MkdirAll(stale, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(stale, "manifest.json"), []byte("{"), 0o644); err != nil {
		t.Fatal(err)
	}
	if dirs, _ := List(OS, root); !slices.Equal(dirs, want) {
		t.Fatalf("List with a stale temporary directory = %v", dirs)
	}
	s30 := testSnapshot(30)
	s30.Objects["trainer"] = json.RawMessage(`{"replaced": true}`)
	mustSave(t, OS, root, s30)
	checkLatest(t, OS, root, s30)
	if _, err := os.Stat(stale); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("stale temporary directory not removed: %v", err)
	}
	dirs, _ = List(OS, root)
	if len(dirs) != 3 || filepath.Base(dirs[0]) != "step-000000030" {
		t.Fatalf("List = %v", dirs)
	}
}

func TestSaveInvalid(t *testing.T) {
	root := t.TempDir()
	mustSave(t, OS, root, testSnapshot(1))
	bad := map[string]func(s *Snapshot){
		"negative step":      func(s *Snapshot) { s.Step = -1 },
		"rank out of range":  func(s *Snapshot) { s.Rank, s.WorldSize = 2, 2 },
		"negative rank":      func(s *Snapshot) { s.Rank = -1 },
		"duplicate name":     func(s *Snapshot) { s.Tensors[1].Name = s.Tensors[0].Name },
		"empty name":         func(s *Snapshot) { s.Tensors[2].Name = "" },
		"metadata name":      func(s *Snapshot) { s.Tensors[2].Name = "__metadata__" },
		"unknown dtype":      func(s *Snapshot) { s.Tensors[2].DType = "F8" },
		"negative dimension": func(s *Snapshot) { s.Tensors[3].Shape = []int64{-1, 0} },
		"overflowing shape":  func(s *Snapshot) { s.Tensors[3].Shape = []int64{1 << 40, 1 << 40, 0} },
		"invalid object":     func(s *Snapshot) { s.Objects["trainer"] = json.RawMessage("{") },
	}
	for name, mutate := range bad {
		s := testSnapshot(2)
		mutate(s)
		if _, err := Save(OS, root, s); err == nil {
			t.Errorf("%s: Save succeeded", name)
		}
	}
	checkLatest(t, OS, root, testSnapshot(1))
	if entries, _ := os.ReadDir(root); len(entries) != 3 || entries[0].Name() != LockFile {
		t.Fatalf("root holds %v after invalid saves (want .lock, latest and step 1)", entries)
	}

	mustPanic := func(name string, f func()) {
		t.Helper()
		defer func() {
			if recover() == nil {
				t.Errorf("%s: no panic", name)
			}
		}()
		f()
	}
	mustPanic("nil snapshot", func() { Save(OS, root, nil) })
	mustPanic("short data", func() {
		s := testSnapshot(2)
		s.Tensors[0].Data = s.Tensors[0].Data[:2]
		Save(OS, root, s)
	})
	checkLatest(t, OS, root, testSnapshot(1))
}

func TestResolveAndStepDir(t *testing.T) {
	root := t.TempDir()
	if _, err := Resolve(OS, filepath.Join(root, "missing")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Resolve of a missing path: %v", err)
	}
	if got, err := Resolve(OS, root); !errors.Is(err, ErrNoCheckpoint) || !errors.Is(err, fs.ErrNotExist) || errors.Is(err, ErrCorrupt) {
		t.Errorf("Resolve of an empty directory: %q, %v (want ErrNoCheckpoint)", got, err)
	}
	dir, err := Save(OS, root, &Snapshot{Step: 7, Tensors: []Tensor{{Name: "x", DType: "U8", Shape: []int64{1}, Data: [][]byte{{9}}}}})
	if err != nil {
		t.Fatal(err)
	}
	if dir != StepDir(root, 7) {
		t.Errorf("Save committed %s, StepDir says %s", dir, StepDir(root, 7))
	}
	for _, p := range []string{root, dir} {
		if got, err := Resolve(OS, p); err != nil || got != dir {
			t.Errorf("Resolve(%s) = %q, %v; want %s", p, got, err, dir)
		}
	}
}
