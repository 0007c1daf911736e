// Package safetensors reads and writes the safetensors file format used by
// Hugging Face, PyTorch's safetensors package, and dos's checkpoints and
// reference cases.
//
// Layout of a file (all integers little-endian):
//
//	+----------------+---------------------------+---------------------------+
//	| N: uint64 (8 B)| header: N bytes of JSON   | data: the tensors' bytes  |
//	+----------------+---------------------------+---------------------------+
//
// The header maps each tensor name to {"dtype", "shape", "data_offsets":
// [begin, end)} with offsets relative to the start of the data section, plus
// an optional "__metadata__" map of strings. The tensors cover the data
// section exactly, without gaps or overlaps. This package pads the header
// with spaces so that the data section starts at a multiple of 8 bytes, as
// the reference implementation does.
//
// References:
//   - https://github.com/huggingface/safetensors (format description, README)
//
// Nothing here panics on a file's contents: every inconsistency is returned
// as an error wrapping ErrInvalid that names the tensor at fault.
package safetensors

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"sort"
	"unicode/utf8"
	"unsafe"
)

// ErrInvalid is wrapped by every error that reports a malformed file.
// Check with errors.Is.
var ErrInvalid = errors.New("safetensors: invalid file")

// MaxHeaderSize is the largest header accepted, in bytes (100 MB, the limit
// the reference implementation applies).
const MaxHeaderSize = 100 << 20

// DType names an element type as the safetensors header spells it.
type DType string

// The element types this package knows. Others are rejected by ParseHeader.
const (
	F64  DType = "F64"
	F32  DType = "F32"
	F16  DType = "F16"
	BF16 DType = "BF16"
	I64  DType = "I64"
	I32  DType = "I32"
	I16  DType = "I16"
	I8   DType = "I8"
	U64  DType = "U64"
	U32  DType = "U32"
	U16  DType = "U16"
	U8   DType = "U8"
	Bool DType = "BOOL"
)

// Size returns the size of one element in bytes, or 0 for an unknown DType.
func (d DType) Size() int {
	switch d {
	case F64, I64, U64:
		return 8
	case F32, I32, U32:
		return 4
	case F16, BF16, I16, U16:
		return 2
	case I8, U8, Bool:
		return 1
	}
	return 0
}

// TensorInfo describes one tensor of a file: its name, element type, shape
// (row-major, in elements) and its byte range [Begin, End) relative to the
// start of the data section.
type TensorInfo struct {
	Name  string
	DType DType
	Shape []int64
	Begin int64
	End   int64
}

// NumElements returns the product of Shape (1 for a scalar, shape []).
func (t TensorInfo) NumElements() int64 {
	n := int64(1)
	for _, d := range t.Shape {
		n *= d
	}
	return n
}

// Header is a parsed and validated header.
type Header struct {
	// Metadata is the "__metadata__" map; nil when absent.
	Metadata map[string]string
	// Tensors in the order of their data offsets.
	Tensors []TensorInfo
	// DataOffset is the absolute file offset of the data section in bytes:
	// 8 + the header's length.
	DataOffset int64
	// DataSize is the size of the data section in bytes.
	DataSize int64

	byName map[string]int // index into Tensors, built by ParseHeader
}

// Find returns the tensor named name and true, or false when absent (always
// false for a Header that ParseHeader did not build).
func (h *Header) Find(name string) (TensorInfo, bool) {
	i, ok := h.byName[name]
	if !ok {
		return TensorInfo{}, false
	}
	return h.Tensors[i], true
}

type rawEntry struct {
	DType       DType   `json:"dtype"`
	Shape       []int64 `json:"shape"`
	DataOffsets []int64 `json:"data_offsets"`
}

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))
}

// ParseHeader reads and validates the header of a safetensors stream of
// fileSize bytes. It checks that every dtype is known, every shape is
// non-negative, every byte range matches its shape, and that the ranges
// tile the data section exactly, which must end at fileSize.
//
// Errors: an I/O error from r, or an error wrapping ErrInvalid.
func ParseHeader(r io.ReaderAt, fileSize int64) (*Header, error) {
	if fileSize < 8 {
		return nil, invalid("file is %d bytes, shorter than the 8-byte header length", fileSize)
	}
	var lenBuf [8]byte
	if _, err := r.ReadAt(lenBuf[:], 0); err != nil {
		return nil, fmt.Errorf("safetensors: reading header length: %w", err)
	}
	n := binary.LittleEndian.Uint64(lenBuf[:])
	if n > MaxHeaderSize {
		return nil, invalid("header length %d exceeds the limit of %d bytes", n, MaxHeaderSize)
	}
	if int64(n) > fileSize-8 {
		return nil, invalid("header length %d runs past the end of the %d-byte file (truncated?)", n, fileSize)
	}
	buf := make([]byte, n)
	if _, err := r.ReadAt(buf, 8); err != nil {
		return nil, fmt.Errorf("safetensors: reading %d-byte header: %w", n, err)
	}
	return parseHeaderJSON(buf, 8+int64(n), fileSize)
}

func parseHeaderJSON(buf []byte, dataOffset, fileSize int64) (*Header, error) {
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(buf, &raw); err != nil {
		return nil, invalid("header is not a JSON object: %v", err)
	}
	h := &Header{DataOffset: dataOffset, DataSize: fileSize - dataOffset}
	for name, msg := range raw {
		if name == "__metadata__" {
			if err := json.Unmarshal(msg, &h.Metadata); err != nil {
				return nil, invalid("__metadata__ is not a map of strings: %v", err)
			}
			continue
		}
		e, err := decodeEntry(msg)
		if err != nil {
			return nil, invalid("tensor %q: bad entry: %v", name, err)
		}
		t, err := checkEntry(name, e)
		if err != nil {
			return nil, err
		}
		h.Tensors = append(h.Tensors, t)
	}
	sort.Slice(h.Tensors, func(i, j int) bool {
		a, b := h.Tensors[i], h.Tensors[j]
		if a.Begin != b.Begin {
			return a.Begin < b.Begin
		}
		return a.End < b.End
	})
	h.byName = make(map[string]int, len(h.Tensors))
	var at int64
	for i, t := range h.Tensors {
		h.byName[t.Name] = i
		if t.Begin != at {
			if t.Begin < at {
				return nil, invalid("tensor %q: byte range [%d, %d) overlaps the previous tensor", t.Name, t.Begin, t.End)
			}
			return nil, invalid("tensor %q: byte range [%d, %d) leaves a gap after offset %d", t.Name, t.Begin, t.End, at)
		}
		at = t.End
	}
	if at != h.DataSize {
		return nil, invalid("tensors cover %d bytes but the data section holds %d (truncated or padded file)", at, h.DataSize)
	}
	return h, nil
}

// decodeEntry decodes one tensor's entry with exactly the keys dtype, shape
// and data_offsets, spelled exactly (encoding/json alone would match keys
// case-insensitively and accept "Dtype", which the reference rejects).
func decodeEntry(msg json.RawMessage) (rawEntry, error) {
	var e rawEntry
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(msg, &fields); err != nil {
		return e, err
	}
	for k := range fields {
		if k != "dtype" && k != "shape" && k != "data_offsets" {
			return e, fmt.Errorf("unknown key %q", k)
		}
	}
	if err := json.Unmarshal(msg, &e); err != nil {
		return e, err
	}
	return e, nil
}

func checkEntry(name string, e rawEntry) (TensorInfo, error) {
	t := TensorInfo{Name: name, DType: e.DType, Shape: e.Shape}
	size := e.DType.Size()
	if size == 0 {
		return t, invalid("tensor %q: unknown dtype %q", name, e.DType)
	}
	if e.Shape == nil {
		return t, invalid("tensor %q: missing shape", name)
	}
	if len(e.DataOffsets) != 2 {
		return t, invalid("tensor %q: data_offsets has %d values, want 2", name, len(e.DataOffsets))
	}
	t.Begin, t.End = e.DataOffsets[0], e.DataOffsets[1]
	if t.Begin < 0 || t.End < t.Begin {
		return t, invalid("tensor %q: bad data_offsets [%d, %d]", name, t.Begin, t.End)
	}
	elems := int64(1)
	for _, d := range e.Shape {
		if d < 0 {
			return t, invalid("tensor %q: negative dimension in shape %v", name, e.Shape)
		}
		if d != 0 && elems > math.MaxInt64/int64(size)/d {
			return t, invalid("tensor %q: shape %v overflows", name, e.Shape)
		}
		elems *= d
	}
	if want := elems * int64(size); t.End-t.Begin != want {
		return t, invalid("tensor %q: shape %v of %s needs %d bytes, data_offsets give %d", name, e.Shape, e.DType, want, t.End-t.Begin)
	}
	return t, nil
}

// File is a safetensors file held in memory.
type File struct {
	Header
	data []byte // the data section
}

// ReadFile reads and validates the whole file at path.
//
// Errors: an I/O error, or an error wrapping ErrInvalid; both name path.
func ReadFile(path string) (*File, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	f, err := Parse(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return f, nil
}

// Parse validates b as a whole safetensors file. The returned File refers to
// b's memory; b must not change while the File is used.
//
// Errors: an error wrapping ErrInvalid.
func Parse(b []byte) (*File, error) {
	h, err := ParseHeader(bytesReaderAt(b), int64(len(b)))
	if err != nil {
		return nil, err
	}
	return &File{Header: *h, data: b[h.DataOffset:]}, nil
}

type bytesReaderAt []byte

func (b bytesReaderAt) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 || off > int64(len(b)) {
		return 0, io.EOF
	}
	n := copy(p, b[off:])
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// Bytes returns the raw little-endian bytes of the tensor named name, as a
// view into the file's memory.
//
// Errors: a "no tensor" error wrapping ErrInvalid when name is absent.
func (f *File) Bytes(name string) (TensorInfo, []byte, error) {
	t, ok := f.Find(name)
	if !ok {
		return t, nil, fmt.Errorf("%w: no tensor %q", ErrInvalid, name)
	}
	return t, f.data[t.Begin:t.End], nil
}

// Float32 returns a copy of the F32 tensor named name, flattened.
//
// Errors: the tensor is absent or its dtype is not F32 (wrapping ErrInvalid).
func (f *File) Float32(name string) ([]float32, error) {
	t, b, err := f.Bytes(name)
	if err != nil {
		return nil, err
	}
	if t.DType != F32 {
		return nil, fmt.Errorf("%w: tensor %q has dtype %s, want F32", ErrInvalid, name, t.DType)
	}
	out := make([]float32, len(b)/4)
	for i := range out {
		out[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return out, nil
}

// Uint16 returns a copy of the 16-bit tensor (F16, BF16, U16 or I16) named
// name, flattened, as raw bit patterns.
//
// Errors: the tensor is absent or not 16-bit (wrapping ErrInvalid).
func (f *File) Uint16(name string) ([]uint16, DType, error) {
	t, b, err := f.Bytes(name)
	if err != nil {
		return nil, "", err
	}
	if t.DType.Size() != 2 {
		return nil, "", fmt.Errorf("%w: tensor %q has dtype %s, want a 16-bit type", ErrInvalid, name, t.DType)
	}
	out := make([]uint16, len(b)/2)
	for i := range out {
		out[i] = binary.LittleEndian.Uint16(b[2*i:])
	}
	return out, t.DType, nil
}

// Spec describes a tensor to be written: name, dtype and shape (elements).
type Spec struct {
	Name  string
	DType DType
	Shape []int64
}

// Layout computes a file's layout for the tensors in specs, in that order:
// the encoded header (length prefix included, padded with spaces to a
// multiple of 8 bytes), each tensor's byte range relative to the data
// section, and the total file size in bytes. The tensor bytes of specs[i]
// belong at absolute offset len(header)+infos[i].Begin. Precomputing the
// offsets lets a writer place tensors with positioned writes in any order.
//
// Errors: an empty or duplicate name, a name "__metadata__", an unknown
// dtype or a negative dimension.
func Layout(metadata map[string]string, specs []Spec) (header []byte, infos []TensorInfo, fileSize int64, err error) {
	entries := make(map[string]any, len(specs)+1)
	if len(metadata) > 0 {
		entries["__metadata__"] = metadata
	}
	infos = make([]TensorInfo, len(specs))
	var at int64
	for i, s := range specs {
		if s.Name == "" || s.Name == "__metadata__" || !utf8.ValidString(s.Name) {
			return nil, nil, 0, fmt.Errorf("safetensors: invalid tensor name %q (empty, reserved, or not UTF-8)", s.Name)
		}
		if _, dup := entries[s.Name]; dup {
			return nil, nil, 0, fmt.Errorf("safetensors: duplicate tensor name %q", s.Name)
		}
		size := s.DType.Size()
		if size == 0 {
			return nil, nil, 0, fmt.Errorf("safetensors: tensor %q: unknown dtype %q", s.Name, s.DType)
		}
		n := int64(size)
		shape := s.Shape
		if shape == nil {
			shape = []int64{}
		}
		for _, d := range shape {
			if d < 0 {
				return nil, nil, 0, fmt.Errorf("safetensors: tensor %q: negative dimension in shape %v", s.Name, shape)
			}
			n *= d
		}
		infos[i] = TensorInfo{Name: s.Name, DType: s.DType, Shape: shape, Begin: at, End: at + n}
		entries[s.Name] = rawEntry{DType: s.DType, Shape: shape, DataOffsets: []int64{at, at + n}}
		at += n
	}
	js, err := json.Marshal(entries)
	if err != nil {
		return nil, nil, 0, fmt.Errorf("safetensors: encoding header: %w", err)
	}
	padded := (len(js) + 7) &^ 7
	header = make([]byte, 8+padded)
	binary.LittleEndian.PutUint64(header, uint64(padded))
	copy(header[8:], js)
	for i := 8 + len(js); i < len(header); i++ {
		header[i] = ' '
	}
	return header, infos, int64(len(header)) + at, nil
}

// Tensor is a tensor to write with its little-endian bytes, which must be
// exactly the shape's element count times the dtype's size.
type Tensor struct {
	Spec
	Data []byte
}

// Encode returns a whole file holding tensors, in order, and metadata.
//
// Errors: as Layout, or a tensor whose Data length does not match its shape.
func Encode(metadata map[string]string, tensors []Tensor) ([]byte, error) {
	specs := make([]Spec, len(tensors))
	for i, t := range tensors {
		specs[i] = t.Spec
	}
	header, infos, size, err := Layout(metadata, specs)
	if err != nil {
		return nil, err
	}
	out := make([]byte, size)
	copy(out, header)
	for i, t := range tensors {
		if int64(len(t.Data)) != infos[i].End-infos[i].Begin {
			return nil, fmt.Errorf("safetensors: tensor %q: %d data bytes for shape %v of %s (want %d)",
				t.Name, len(t.Data), t.Shape, t.DType, infos[i].End-infos[i].Begin)
		}
		copy(out[int64(len(header))+infos[i].Begin:], t.Data)
	}
	return out, nil
}

// Float32View returns v's memory as bytes, without a copy: little-endian
// fp32 on the little-endian hosts dos runs on (amd64, arm64). The view
// aliases v.
func Float32View(v []float32) []byte {
	if len(v) == 0 {
		return []byte{}
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&v[0])), 4*len(v))
}

// Uint16View returns v's memory as bytes, without a copy, as Float32View
// does for fp32 (16-bit elements: bf16, fp16).
func Uint16View(v []uint16) []byte {
	if len(v) == 0 {
		return []byte{}
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&v[0])), 2*len(v))
}

// Float32Bytes encodes v as little-endian bytes (a copy).
func Float32Bytes(v []float32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return b
}

// Uint16Bytes encodes v as little-endian bytes (a copy).
func Uint16Bytes(v []uint16) []byte {
	b := make([]byte, 2*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint16(b[2*i:], x)
	}
	return b
}
