package checkpoint

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/deepstates/dos/safetensors"
)

// ErrCorrupt is wrapped by every error about a checkpoint's bad contents: a
// truncated or malformed file, a checksum mismatch, a manifest that
// disagrees with the files. Check with errors.Is. Errors of the file system
// itself (EIO, permission) are returned as they are, without ErrCorrupt.
var ErrCorrupt = errors.New("checkpoint: corrupt")

// Format and Version identify the manifest's schema: manifest.json's
// "format" and "version" fields. Open rejects any other value with
// ErrCorrupt.
const (
	Format  = "dos-checkpoint"
	Version = 1
)

// The fixed file names of a checkpoint directory.
const (
	ManifestFile = "manifest.json" // written last: its presence marks a complete directory
	IndexFile    = "index.json"    // Hugging Face style weight map
	LatestFile   = "latest"        // in the root: names the committed checkpoint directory
)

// maxJSONSize bounds the manifest and index read by Open, in bytes, so that
// a corrupt size never causes a huge allocation.
var maxJSONSize int64 = 256 << 20 // a variable so that tests can lower it

// castagnoli is the CRC32C table (the polynomial of iSCSI, ext4 and
// RocksDB); hash/crc32 computes it with the SSE4.2 instruction on amd64.
var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Manifest is the contents of manifest.json: what one rank saved at one
// step, with a CRC32C per tensor. It is written last, so a directory with a
// manifest is complete.
type Manifest struct {
	Format    string    `json:"format"`  // always Format
	Version   int       `json:"version"` // always Version
	Step      int64     `json:"step"`
	Rank      int       `json:"rank"`
	WorldSize int       `json:"world_size"` // at least 1
	Created   time.Time `json:"created"`    // UTC, RFC 3339
	// Files are the safetensors files of this rank, relative to the
	// checkpoint directory (for now exactly one, rank-%05d.safetensors).
	Files []string `json:"files"`
	// Tensors in the order of their offsets in the file.
	Tensors []TensorEntry `json:"tensors"`
	// Objects are the small serialized objects of the snapshot, such as
	// "optimizer" (hyperparameters) and "trainer" (iteration, data
	// position, RNG state, model configuration).
	Objects map[string]json.RawMessage `json:"objects"`
	// ObjectsCRC32C holds, for every object, the CRC32C of its canonical
	// JSON (keys sorted, compact, numbers as written), so a damaged object
	// is caught like a tensor.
	ObjectsCRC32C map[string]uint32 `json:"objects_crc32c"`
}

// objectCRC returns the CRC32C of the canonical form of the JSON value v:
// keys sorted, no insignificant space, numbers as written. Reformatting the
// manifest (indentation, key order) keeps the checksum; changing a value
// does not.
func objectCRC(v json.RawMessage) (uint32, error) {
	dec := json.NewDecoder(bytes.NewReader(v))
	dec.UseNumber()
	var x any
	if err := dec.Decode(&x); err != nil {
		return 0, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return 0, errors.New("trailing data after the JSON value")
	}
	b, err := json.Marshal(x)
	if err != nil {
		return 0, err
	}
	return crc32.Checksum(b, castagnoli), nil
}

// TensorEntry locates one tensor of a checkpoint and carries its checksum.
type TensorEntry struct {
	Name  string            `json:"name"`
	File  string            `json:"file"` // relative to the checkpoint directory
	DType safetensors.DType `json:"dtype"`
	Shape []int64           `json:"shape"` // row-major, in elements; [] for a scalar
	// Offset is the absolute offset of the tensor's first byte in File, in
	// bytes (the safetensors data section's start plus data_offsets[0]).
	Offset int64 `json:"offset"`
	// Bytes is the tensor's size in bytes: the product of Shape times the
	// dtype's size.
	Bytes int64 `json:"bytes"`
	// CRC32C is the Castagnoli CRC-32 of the tensor's Bytes bytes.
	CRC32C uint32 `json:"crc32c"`
}

// index is the contents of index.json, in the style of Hugging Face's
// model.safetensors.index.json.
type index struct {
	Metadata  indexMetadata     `json:"metadata"`
	WeightMap map[string]string `json:"weight_map"` // tensor name → file name
}

type indexMetadata struct {
	TotalSize int64 `json:"total_size"` // sum of the tensors' sizes, in bytes
}

// stepDirName returns the directory name of step: step-%09d.
func stepDirName(step int64) string { return fmt.Sprintf("step-%09d", step) }

// rankFileName returns the safetensors file name of rank: rank-%05d.safetensors.
func rankFileName(rank int) string { return fmt.Sprintf("rank-%05d.safetensors", rank) }

// parseStepDirName returns the step of a directory named step-%09d, or false
// when name is not in that canonical form.
func parseStepDirName(name string) (int64, bool) {
	digits, ok := strings.CutPrefix(name, "step-")
	if !ok || len(digits) < 9 {
		return 0, false
	}
	step, err := strconv.ParseInt(digits, 10, 64)
	if err != nil || step < 0 || stepDirName(step) != name {
		return 0, false
	}
	return step, true
}

// tmpPrefix starts the names of temporary directories, which List and Latest
// ignore and Save removes.
const tmpPrefix = ".tmp-"

// fileMetadata returns the safetensors __metadata__ of a checkpoint file.
func fileMetadata(step int64) map[string]string {
	return map[string]string{"format": "pt", "step": strconv.FormatInt(step, 10), "producer": "dos"}
}

// tensorBytes returns the size in bytes of a tensor of dtype and shape, or
// false when the dtype is unknown, a dimension is negative or the size
// overflows int64.
func tensorBytes(dtype safetensors.DType, shape []int64) (int64, bool) {
	n := int64(dtype.Size())
	if n == 0 {
		return 0, false
	}
	for _, d := range shape {
		if d < 0 {
			return 0, false
		}
		if d != 0 && n > math.MaxInt64/d {
			return 0, false
		}
		n *= d
	}
	return n, true
}

// plan is the layout of one rank's checkpoint, computed before any byte is
// written: the safetensors header, every tensor's absolute offset and size,
// and the index. Writers (this package's synchronous one, a later lazy one)
// place tensor bytes at the planned offsets in any order and fill in the
// CRCs; then commit writes the index and the manifest.
type plan struct {
	dirName  string // step-%09d
	fileName string // rank-%05d.safetensors
	header   []byte // length prefix + padded JSON
	fileSize int64  // bytes
	manifest Manifest
	index    index
}

// newPlan checks s and lays it out. The CRCs in the manifest are zero until
// a writer fills them in.
func newPlan(s *Snapshot) (*plan, error) {
	world := s.WorldSize
	if world == 0 {
		world = 1
	}
	if s.Step < 0 {
		return nil, fmt.Errorf("negative step %d", s.Step)
	}
	if world < 0 || s.Rank < 0 || s.Rank >= world {
		return nil, fmt.Errorf("rank %d out of range for world size %d", s.Rank, s.WorldSize)
	}
	p := &plan{dirName: stepDirName(s.Step), fileName: rankFileName(s.Rank)}
	specs := make([]safetensors.Spec, len(s.Tensors))
	for i, t := range s.Tensors {
		shape := t.Shape
		if shape == nil {
			shape = []int64{}
		}
		want, ok := tensorBytes(t.DType, shape)
		if !ok {
			return nil, fmt.Errorf("tensor %q: invalid dtype %q or shape %v", t.Name, t.DType, shape)
		}
		var have int64
		for _, r := range t.Data {
			have += int64(len(r))
		}
		if have != want {
			panic(fmt.Sprintf("checkpoint: tensor %q: %d data bytes for shape %v of %s, want %d", t.Name, have, shape, t.DType, want))
		}
		specs[i] = safetensors.Spec{Name: t.Name, DType: t.DType, Shape: shape}
	}
	header, infos, size, err := safetensors.Layout(fileMetadata(s.Step), specs)
	if err != nil {
		return nil, err
	}
	p.header, p.fileSize = header, size
	objects := s.Objects
	crcs := make(map[string]uint32, len(objects))
	for name, v := range objects {
		crc, err := objectCRC(v)
		if err != nil || !utf8.ValidString(name) {
			return nil, fmt.Errorf("object %q is not valid JSON or its name not UTF-8", name)
		}
		crcs[name] = crc
	}
	if objects == nil {
		objects = map[string]json.RawMessage{}
	}
	p.manifest = Manifest{
		Format:    Format,
		Version:   Version,
		Step:      s.Step,
		Rank:      s.Rank,
		WorldSize: world,
		Files:     []string{p.fileName},
		Tensors:   make([]TensorEntry, len(infos)),
		Objects:   objects,

		ObjectsCRC32C: crcs,
	}
	p.index = index{WeightMap: make(map[string]string, len(infos))}
	for i, info := range infos {
		p.manifest.Tensors[i] = TensorEntry{
			Name:   info.Name,
			File:   p.fileName,
			DType:  info.DType,
			Shape:  info.Shape,
			Offset: int64(len(header)) + info.Begin,
			Bytes:  info.End - info.Begin,
		}
		p.index.WeightMap[info.Name] = p.fileName
		p.index.Metadata.TotalSize += info.End - info.Begin
	}
	// Refuse, before writing anything, what Open would refuse to read: the
	// size limits of the header and of the manifest (estimated with every
	// CRC at its widest and a creation time set).
	if n := len(header) - 8; n > safetensors.MaxHeaderSize {
		return nil, fmt.Errorf("the safetensors header would be %d bytes, over the limit of %d: too many tensors (%d)", n, safetensors.MaxHeaderSize, len(infos))
	}
	est := p.manifest
	est.Created = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)
	est.Tensors = slices.Clone(p.manifest.Tensors)
	for i := range est.Tensors {
		est.Tensors[i].CRC32C = math.MaxUint32
	}
	if b, err := json.MarshalIndent(est, "", "  "); err != nil {
		return nil, fmt.Errorf("encoding the manifest: %w", err)
	} else if int64(len(b)+1) > maxJSONSize {
		return nil, fmt.Errorf("the manifest would be %d bytes, over the limit of %d: too many tensors (%d) or objects too large", len(b)+1, maxJSONSize, len(infos))
	}
	return p, nil
}
