package checkpoint

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const rank0 = "rank-00000.safetensors"

// twoCheckpoints saves steps 10 and 20 under a fresh root on the real file
// system and returns the root and step 20's directory.
func twoCheckpoints(t *testing.T) (root, dir string) {
	t.Helper()
	root = t.TempDir()
	mustSave(t, OS, root, testSnapshot(10))
	return root, mustSave(t, OS, root, testSnapshot(20))
}

// expectCorrupt checks that err wraps ErrCorrupt and mentions every one of
// names.
func expectCorrupt(t *testing.T, what string, err error, names ...string) {
	t.Helper()
	if !errors.Is(err, ErrCorrupt) {
		t.Fatalf("%s: error %v, want one wrapping ErrCorrupt", what, err)
	}
	for _, n := range names {
		if !strings.Contains(err.Error(), n) {
			t.Fatalf("%s: error %q does not name %q", what, err, n)
		}
	}
}

// checkOld checks that step 10 under root still opens and verifies.
func checkOld(t *testing.T, root string) {
	t.Helper()
	checkMatches(t, OS, filepath.Join(root, "step-000000010"), testSnapshot(10))
}

func modifyFile(t *testing.T, path string, f func(b []byte) []byte) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, f(b), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestCorruptTruncated(t *testing.T) {
	root, dir := twoCheckpoints(t)
	path := filepath.Join(dir, rank0)
	st, _ := os.Stat(path)
	for _, n := range []int64{0, 5, 8, 100, st.Size() - 1} {
		if err := os.Truncate(path, n); err != nil {
			t.Fatal(err)
		}
		_, err := Open(OS, dir, 0)
		expectCorrupt(t, "truncated file", err, path)
	}
	checkOld(t, root)
}

// TestCorruptTruncatedAfterOpen truncates the file under an open Checkpoint:
// the reads report corruption naming the tensor.
func TestCorruptTruncatedAfterOpen(t *testing.T) {
	root, dir := twoCheckpoints(t)
	c, err := Open(OS, dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	e, _ := c.Entry("scalar")
	if err := os.Truncate(filepath.Join(dir, rank0), e.Offset+2); err != nil {
		t.Fatal(err)
	}
	expectCorrupt(t, "ReadTensor", c.ReadTensor("scalar", make([]byte, 4)), rank0, `"scalar"`)
	expectCorrupt(t, "Verify", c.Verify(), rank0, `"scalar"`)
	checkOld(t, root)
}

func TestCorruptDataBit(t *testing.T) {
	root, dir := twoCheckpoints(t)
	c, err := Open(OS, dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	e, _ := c.Entry("model.b.bf16")
	c.Close()
	modifyFile(t, filepath.Join(dir, rank0), func(b []byte) []byte {
		b[e.Offset+3] ^= 0x10
		return b
	})
	c, err = Open(OS, dir, 0) // Open reads no tensor data
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	expectCorrupt(t, "ReadTensor", c.ReadTensor("model.b.bf16", make([]byte, e.Bytes)), rank0, `"model.b.bf16"`, "crc32c")
	if err := c.ReadTensor("mask", make([]byte, 7)); err != nil {
		t.Fatalf("ReadTensor of an intact tensor: %v", err)
	}
	expectCorrupt(t, "Verify", c.Verify(), rank0, `"model.b.bf16"`)
	checkOld(t, root)
}

func TestCorruptHeaderBit(t *testing.T) {
	root, dir := twoCheckpoints(t)
	modifyFile(t, filepath.Join(dir, rank0), func(b []byte) []byte {
		b[8+20] ^= 0x04
		return b
	})
	_, err := Open(OS, dir, 0)
	expectCorrupt(t, "header bit", err, rank0)
	checkOld(t, root)
}

// editManifest rewrites dir's manifest through f on its generic JSON form.
func editManifest(t *testing.T, dir string, f func(m map[string]any)) {
	t.Helper()
	modifyFile(t, filepath.Join(dir, ManifestFile), func(b []byte) []byte {
		var m map[string]any
		if err := json.Unmarshal(b, &m); err != nil {
			t.Fatal(err)
		}
		f(m)
		out, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		return out
	})
}

func TestCorruptManifest(t *testing.T) {
	tensor := func(m map[string]any, i int) map[string]any { return m["tensors"].([]any)[i].(map[string]any) }
	cases := []struct {
		name  string
		edit  func(m map[string]any)
		names []string // the error must name these
	}{
		// Same byte count, so only the comparison with the file catches it.
		{"shape differs from the file", func(m map[string]any) { tensor(m, 0)["shape"] = []int{4, 3} }, []string{rank0, `"model.w.exp_avg"`, "shape"}},
		{"shape inconsistent with bytes", func(m map[string]any) { tensor(m, 0)["shape"] = []int{4, 4} }, []string{ManifestFile, `"model.w.exp_avg"`}},
		{"dtype differs", func(m map[string]any) { tensor(m, 1)["dtype"] = "F16" }, []string{rank0, `"model.b.bf16"`, "dtype"}},
		{"offset differs", func(m map[string]any) { tensor(m, 2)["offset"] = tensor(m, 2)["offset"].(float64) + 1 }, []string{rank0, `"mask"`}},
		{"huge offset", func(m map[string]any) { tensor(m, 2)["offset"] = 9.2e18 }, []string{`"mask"`}},
		{"huge shape", func(m map[string]any) { tensor(m, 2)["shape"] = []float64{4e9, 4e9, 4e9} }, []string{ManifestFile, `"mask"`}},
		{"negative shape", func(m map[string]any) { tensor(m, 2)["shape"] = []int{-7} }, []string{ManifestFile, `"mask"`}},
		{"number too large", func(m map[string]any) { tensor(m, 2)["bytes"] = json.Number("1e400") }, []string{ManifestFile}},
		{"tensor missing", func(m map[string]any) { m["tensors"] = m["tensors"].([]any)[1:] }, []string{rank0}},
		{"tensor renamed", func(m map[string]any) { tensor(m, 2)["name"] = "mask2" }, []string{rank0}},
		{"duplicate tensor", func(m map[string]any) { tensor(m, 2)["name"] = "scalar" }, []string{ManifestFile, `"scalar"`}},
		{"file escapes", func(m map[string]any) { m["files"] = []string{"../" + rank0} }, []string{ManifestFile}},
		{"unknown file", func(m map[string]any) { tensor(m, 0)["file"] = "other.safetensors" }, []string{ManifestFile}},
		{"wrong format", func(m map[string]any) { m["format"] = "other" }, []string{ManifestFile, "format"}},
		{"wrong version", func(m map[string]any) { m["version"] = 2 }, []string{ManifestFile, "version"}},
		{"wrong step", func(m map[string]any) { m["step"] = 21 }, []string{ManifestFile}},
		{"rank out of range", func(m map[string]any) { m["world_size"] = 0 }, []string{ManifestFile}},
		{"bad created", func(m map[string]any) { m["created"] = "yesterday" }, []string{ManifestFile}},
		{"unknown field", func(m map[string]any) { m["stepp"] = 20 }, []string{ManifestFile}},
		// encoding/json matches keys case-insensitively; Python does not.
		{"key in another case", func(m map[string]any) { m["STEP"] = m["step"]; delete(m, "step") }, []string{ManifestFile, `"STEP"`, "top level"}},
		{"tensor key in another case", func(m map[string]any) { tensor(m, 3)["Shape"] = tensor(m, 3)["shape"]; delete(tensor(m, 3), "shape") }, []string{ManifestFile, `"Shape"`, ".tensors[3]"}},
		{"null shape", func(m map[string]any) { tensor(m, 4)["shape"] = nil }, []string{ManifestFile, `"scalar"`}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			root, dir := twoCheckpoints(t)
			editManifest(t, dir, tc.edit)
			_, err := Open(OS, dir, 0)
			expectCorrupt(t, tc.name, err, tc.names...)
			checkOld(t, root)
		})
	}
}

func TestCorruptGarbage(t *testing.T) {
	cases := []struct {
		name, file string
		data       string
	}{
		{"garbage manifest", ManifestFile, "\x00\xffnot json{"},
		{"empty manifest", ManifestFile, ""},
		{"manifest of another type", ManifestFile, `[1, 2, 3]`},
		{"manifest with trailing data", ManifestFile, "{}{}"},
		{"garbage index", IndexFile, "garbage"},
		{"index with a wrong total", IndexFile, `{"metadata": {"total_size": 1}, "weight_map": {}}`},
		{"garbage safetensors", rank0, "\x10\x00\x00\x00\x00\x00\x00\x00{{{{{{{{{{{{{{{{"},
		{"huge header length", rank0, "\xff\xff\xff\xff\xff\xff\xff\x7f{}"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			root, dir := twoCheckpoints(t)
			path := filepath.Join(dir, tc.file)
			if err := os.WriteFile(path, []byte(tc.data), 0o644); err != nil {
				t.Fatal(err)
			}
			_, err := Open(OS, dir, 0)
			expectCorrupt(t, tc.name, err, path)
			checkOld(t, root)
		})
	}
	for _, file := range []string{IndexFile, rank0} {
		t.Run("missing "+file, func(t *testing.T) {
			root, dir := twoCheckpoints(t)
			if err := os.Remove(filepath.Join(dir, file)); err != nil {
				t.Fatal(err)
			}
			_, err := Open(OS, dir, 0)
			expectCorrupt(t, "missing "+file, err, file)
			checkOld(t, root)
		})
	}
	t.Run("missing manifest", func(t *testing.T) {
		root, dir := twoCheckpoints(t)
		if err := os.Remove(filepath.Join(dir, ManifestFile)); err != nil {
			t.Fatal(err)
		}
		if _, err := Open(OS, dir, 0); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("Open without a manifest: %v", err)
		}
		// latest names step 20, which is no longer complete.
		_, err := Latest(OS, root)
		expectCorrupt(t, "Latest", err, "step-000000020")
		if errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("Latest of a damaged root wraps fs.ErrNotExist: %v", err)
		}
		checkOld(t, root)
	})
	for _, latest := range []string{"", "garbage\n", "step-20\n", "../step-000000010\n", "step-000000010/..\n", strings.Repeat("x", 5000)} {
		t.Run("latest "+latest[:min(len(latest), 20)], func(t *testing.T) {
			root, _ := twoCheckpoints(t)
			if err := os.WriteFile(filepath.Join(root, LatestFile), []byte(latest), 0o644); err != nil {
				t.Fatal(err)
			}
			_, err := Latest(OS, root)
			expectCorrupt(t, "Latest", err, LatestFile)
			if _, err := List(OS, root); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("List: %v", err)
			}
			checkOld(t, root)
			// A save refuses the damaged root: it would adopt or replace
			// its checkpoints.
			if _, err := Save(OS, root, testSnapshot(30)); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "damaged root") {
				t.Fatalf("Save into a root with a damaged latest: %v", err)
			}
			checkOld(t, root)
			// Recover points latest at the newest step that verifies.
			rec, err := Recover(OS, root, 0)
			if err != nil || !rec.Repaired || filepath.Base(rec.Dir) != "step-000000020" {
				t.Fatalf("Recover: %+v, %v", rec, err)
			}
			checkLatest(t, OS, root, testSnapshot(20))
			mustSave(t, OS, root, testSnapshot(30))
			checkLatest(t, OS, root, testSnapshot(30))
		})
	}
}

// memCheckpoint saves step 20 into a memFS and returns it with the
// checkpoint's directory.
func memCheckpoint(t testing.TB) (*memFS, string) {
	mem := newMemFS()
	return mem, mustSave(t, mem, memRoot, testSnapshot(20))
}

// openAndVerify opens dir and reads everything, returning the first error.
func openAndVerify(fsys FS, dir string) error {
	c, err := Open(fsys, dir, 0)
	if err != nil {
		return err
	}
	defer c.Close()
	for _, e := range c.Manifest.Tensors {
		if err := c.ReadTensor(e.Name, make([]byte, e.Bytes)); err != nil {
			return err
		}
	}
	return c.Verify()
}

// TestCorruptEveryHeaderBit flips each bit of the safetensors file's
// length prefix and header in turn: Open must always report corruption.
func TestCorruptEveryHeaderBit(t *testing.T) {
	t.Parallel()
	mem, dir := memCheckpoint(t)
	path := filepath.Join(dir, rank0)
	orig := mem.readFile(path)
	end := 8 + int(binary.LittleEndian.Uint64(orig))
	for i := range end * 8 {
		b := append([]byte(nil), orig...)
		b[i/8] ^= 1 << (i % 8)
		mem.writeFile(path, b)
		_, err := Open(mem, dir, 0)
		if !errors.Is(err, ErrCorrupt) {
			t.Fatalf("bit %d of byte %d flipped: Open error %v", i%8, i/8, err)
		}
	}
	// Every bit of the data: Open succeeds, reading fails.
	for i := end * 8; i < len(orig)*8; i++ {
		b := append([]byte(nil), orig...)
		b[i/8] ^= 1 << (i % 8)
		mem.writeFile(path, b)
		if err := openAndVerify(mem, dir); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("bit %d of byte %d flipped: %v", i%8, i/8, err)
		}
	}
}

// TestCorruptEveryLength truncates the safetensors file, the manifest and
// the index to every shorter length.
func TestCorruptEveryLength(t *testing.T) {
	t.Parallel()
	mem, dir := memCheckpoint(t)
	for _, name := range []string{rank0, ManifestFile, IndexFile} {
		path := filepath.Join(dir, name)
		orig := mem.readFile(path)
		for n := range len(orig) - 1 { // the JSON files end in a newline
			mem.writeFile(path, orig[:n])
			if _, err := Open(mem, dir, 0); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("%s truncated to %d bytes: Open error %v", name, n, err)
			}
		}
		mem.writeFile(path, orig)
	}
	if err := openAndVerify(mem, dir); err != nil {
		t.Fatal(err)
	}
}

// TestCorruptEveryManifestByte flips two bits of each byte of the manifest
// and the index in turn (0x20, which changes a letter's case, and a bit that
// cycles with the position): nothing panics, and every error is ErrCorrupt
// (or fs.ErrNotExist, when a flip changes the rank). Only flips in the
// values that no checksum covers and nothing else repeats, the world size,
// the creation time and the objects, may go unnoticed.
func TestCorruptEveryManifestByte(t *testing.T) {
	t.Parallel()
	mem, dir := memCheckpoint(t)
	for _, name := range []string{ManifestFile, IndexFile} {
		path := filepath.Join(dir, name)
		orig := mem.readFile(path)
		unchecked := func(at int) bool {
			s := string(orig)
			created := strings.Index(s, `"created": "`) + len(`"created": "`)
			objects := strings.Index(s, `"objects": `) + len(`"objects": `)
			world := strings.Index(s, `"world_size": `) + len(`"world_size": `)
			return name == ManifestFile && (at >= created && at < created+len("2006-01-02T15:04:05Z") || at == world ||
				at > objects && at < len(s)-3) // the object's braces and the manifest's own are checked
		}
		var accepted, flips int
		for at := range orig {
			bits := []int{5}
			if at%8 != 5 {
				bits = append(bits, at%8)
			}
			for _, bit := range bits {
				flips++
				b := append([]byte(nil), orig...)
				b[at] ^= 1 << bit
				mem.writeFile(path, b)
				err := openAndVerify(mem, dir)
				switch {
				case err == nil && !unchecked(at):
					t.Fatalf("%s: bit %d of byte %d (%q) flipped: no error", name, bit, at, orig[max(0, at-20):at+1])
				case err == nil:
					accepted++
				case !errors.Is(err, ErrCorrupt) && !errors.Is(err, fs.ErrNotExist):
					t.Fatalf("%s: bit %d of byte %d flipped: %v", name, bit, at, err)
				}
			}
		}
		mem.writeFile(path, orig)
		t.Logf("%s: %d of %d single-bit flips accepted (in world_size, created and objects)", name, accepted, flips)
	}
}

// FuzzOpen replaces a checkpoint's safetensors file, manifest and index
// with arbitrary bytes: Open, ReadTensor and Verify must never panic, and
// every error must be ErrCorrupt (or fs.ErrNotExist for another rank).
func FuzzOpen(f *testing.F) {
	mem, dir := memCheckpoint(f)
	st := mem.readFile(filepath.Join(dir, rank0))
	man := mem.readFile(filepath.Join(dir, ManifestFile))
	idx := mem.readFile(filepath.Join(dir, IndexFile))
	f.Add(st, man, idx)
	f.Add(st[:len(st)/2], man, idx)
	f.Add(st, man[:len(man)/2], idx)
	f.Add([]byte("\x02\x00\x00\x00\x00\x00\x00\x00{}"), []byte(`{"format":"dos-checkpoint","version":1,"step":20,"world_size":1,"created":"2026-01-01T00:00:00Z","files":["rank-00000.safetensors"],"tensors":[]}`), []byte(`{"metadata":{"total_size":0},"weight_map":{}}`))
	// Hostile safetensors files: a huge and a negative header length, a
	// truncated header, overlapping and out-of-range offsets, a duplicate
	// name, an unknown dtype, a shape that overflows.
	stFile := func(header string, data int) []byte {
		b := make([]byte, 8, 8+len(header)+data)
		for i := range 8 {
			b[i] = byte(len(header) >> (8 * i))
		}
		return append(append(b, header...), make([]byte, data)...)
	}
	for _, bad := range [][]byte{
		[]byte("\xff\xff\xff\xff\xff\xff\xff\xff{}"),
		[]byte("\x00\x00\x00\x00\x00\x00\x00\x80{}"),
		[]byte("\x00\x10\x00\x00\x00\x00\x00\x00{\"a\":"),
		stFile(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}`, 12),
		stFile(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,1000000000]}}`, 8),
		stFile(`{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}`, 8),
		stFile(`{"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,4]}}`, 4),
		stFile(`{"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,4]}}`, 4),
		stFile(`{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}`, 4),
	} {
		f.Add(bad, man, idx)
	}
	f.Fuzz(func(t *testing.T, st, man, idx []byte) {
		m := mem.crashClone(false)
		m.writeFile(filepath.Join(dir, rank0), st)
		m.writeFile(filepath.Join(dir, ManifestFile), man)
		m.writeFile(filepath.Join(dir, IndexFile), idx)
		err := openAndVerify(m, dir)
		if err != nil && !errors.Is(err, ErrCorrupt) && !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("error neither corrupt nor not-exist: %v", err)
		}
	})
}

func TestObjectChecksum(t *testing.T) {
	root := t.TempDir()
	s := &Snapshot{Step: 3, Tensors: []Tensor{{Name: "x", DType: "U8", Shape: []int64{1}, Data: [][]byte{{1}}}},
		Objects: map[string]json.RawMessage{"optimizer": json.RawMessage(`{"lr": 0.001, "betas": [0.9, 0.999], "rng": 123456789}`)}}
	dir, err := Save(OS, root, s)
	if err != nil {
		t.Fatal(err)
	}
	// Reformatting (key order, spacing) keeps the checksum ...
	editManifest(t, dir, func(m map[string]any) {})
	c, err := Open(OS, dir, 0)
	if err != nil {
		t.Fatalf("reformatted manifest: %v", err)
	}
	c.Close()
	// ... a changed value does not.
	editManifest(t, dir, func(m map[string]any) {
		m["objects"].(map[string]any)["optimizer"].(map[string]any)["lr"] = 50
	})
	if _, err := Open(OS, dir, 0); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), `object "optimizer"`) {
		t.Fatalf("edited object: %v", err)
	}
}

// Save refuses, before writing, a checkpoint whose manifest Open would
// refuse to read.
func TestSaveRefusesOversizedManifest(t *testing.T) {
	defer func(n int64) { maxJSONSize = n }(maxJSONSize)
	maxJSONSize = 4096
	root := t.TempDir()
	var ts []Tensor
	for i := range 100 {
		ts = append(ts, Tensor{Name: fmt.Sprintf("model.layers.%d.weight", i), DType: "U8", Shape: []int64{1}, Data: [][]byte{{1}}})
	}
	if _, err := Save(OS, root, &Snapshot{Step: 1, Tensors: ts}); err == nil || !strings.Contains(err.Error(), "manifest would be") {
		t.Fatalf("oversized manifest: %v", err)
	}
	if _, err := Latest(OS, root); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("latest after a refused save: %v", err)
	}
	if _, err := Save(OS, root, &Snapshot{Step: 1, Tensors: ts[:3]}); err != nil {
		t.Fatalf("small checkpoint: %v", err)
	}
}
